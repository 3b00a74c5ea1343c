// StagingBackend: a Backend decorator that lets the cache core (cache/), which builds every job
// over host vectors (block tables, positions, scores, offsets, weights, queries, outputs), run on
// a device backend whose jobs must point at device memory (gpu/backend.h "Pointer spaces").
//
// For every call it validates each job on the host with the CPU backend's validators (the same
// INVALID_ARGUMENT messages, job index and field named), refuses an arena pointer the device
// cannot use ("<job> <i>: <field> is not device memory"), packs every host input array of the
// call into one page-locked host buffer (256-byte aligned pieces) that reaches the device with
// one DeviceMemory::Allocate and one copy queued without a wait (CopyToDeviceAsync), runs the
// wrapped device backend on device copies of the jobs, and waits once: the copy of the output
// region back (one CopyToHost, scattered to the caller's host arrays), or one synchronisation of
// the stream for a call without outputs. A call is thus one round trip to the device, whatever
// its jobs. The host buffers are reused across calls, up to 256 MiB of them kept: a copy from
// pageable memory is bounced through the driver's own buffer at a fraction of the bus's speed.
// Arrays that are already device-accessible pass through untouched (index arrays a validator
// reads are mirrored to the host for validation). Nothing is written to the caller's outputs when
// validation or the device call fails. Jobs that do no work (count 0, k 0, no queries) are not
// sent to the device, and a call without work allocates nothing; the device is still called
// (with no jobs) so that an unhealthy device answers as it would.
//
// CopyHostRows: when the job's `host` buffer is device-accessible (page-locked), only the offsets
// are staged and the device copies; otherwise the job's rows go through one page-locked bounce
// buffer for the call (packed into it before the device copies them into the arena, unpacked
// from it after the device copied them out), so the inline tokens of a whole decode step are one
// transfer and one device call. Such a job checks, beyond the CPU validator, that no host offset
// + row_bytes overflows. Only where no page-locked buffer can be had are the rows copied here,
// one DeviceMemory copy per run of rows whose arena and host offsets both advance by row_bytes.
//
// Every call returns after the device work it queued has finished, so Synchronize has nothing to
// wait for and returns at once: the staging buffer is freed (returned to DeviceMemory's cache)
// when the call returns.
//
// KVS_STAGING_TRACE set in the environment: one line per staged call on stderr (job type, jobs,
// bytes up and down, microseconds planning, uploading, launching, and waiting and downloading), how
// a device run tells the staging layer's cost from the kernels'.
//
// Threading: safe to call concurrently when the device backend and DeviceMemory are (both are
// required to be); the decorator itself holds no mutable state.
#ifndef KVSIDECAR_GPU_STAGING_BACKEND_H_
#define KVSIDECAR_GPU_STAGING_BACKEND_H_

#include <cstdint>
#include <memory>

#include "gpu/backend.h"
#include "gpu/device_memory.h"

namespace kvs {

// Input pieces of the staging buffer start at multiples of this many bytes (the kernels' 16-byte
// vector loads); outputs are packed at their element's alignment, so that the region that comes
// back holds no padding.
inline constexpr uint64_t kStagingAlignment = 16;

// name(), healthy(), CreateArena and Synchronize forward to `device`; `memory` must describe the
// device's memory (the arenas `device` creates must be device-accessible to it).
std::unique_ptr<Backend> MakeStagingBackend(std::unique_ptr<Backend> device,
                                            std::unique_ptr<DeviceMemory> memory);

}  // namespace kvs

#endif  // KVSIDECAR_GPU_STAGING_BACKEND_H_
