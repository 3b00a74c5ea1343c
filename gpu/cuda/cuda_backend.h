// CudaBackend: the CUDA implementation of gpu/backend.h (built when KVS_WITH_CUDA is on). Every
// pointer in a job is device memory (or page-locked host memory where a field says host), the
// arena is one cudaMalloc exported once through cudaIpcGetMemHandle, and kernels run on the
// caller's stream (nullptr = the legacy default stream); Synchronize waits for them.
// CopyHostRows: `host` must be page-locked (cudaHostAlloc / cudaHostRegister) so the copy kernel
// reaches it; its offset arrays are device memory like every other index array.
//
// The cache core builds its jobs over host vectors, so the server does not use this backend
// directly: gpu/backend_factory.h (BackendKind::kCuda) wraps it in the staging decorator
// (gpu/staging_backend.h) with CudaDeviceMemory (gpu/cuda/cuda_device_memory.h), which moves the
// host arrays to the device. tests/gpu/cuda/cuda_backend_test.cc exercises it bare.
//
// Untrusted (bare use), validation uses the CPU backend's validators (same INVALID_ARGUMENT
// messages): the small index arrays a check must read (block tables, slot lists, forced flags,
// source offsets) are copied to the host first, so a call that fails validation launches nothing.
// Trusted (behind the staging layer, which validated every job), it launches at once. A pointer the
// device cannot access (e.g. pageable host memory) is INVALID_ARGUMENT naming the field. Every CUDA
// error becomes a status; a device error (anything but an out-of-memory or invalid-value answer)
// marks the backend unhealthy: later calls fail with FAILED_PRECONDITION and healthy() is false.
// Nothing aborts the process.
//
// Threading: a CudaBackend may be called from any thread (each call selects its device first).
#ifndef KVSIDECAR_GPU_CUDA_CUDA_BACKEND_H_
#define KVSIDECAR_GPU_CUDA_CUDA_BACKEND_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "gpu/backend.h"

namespace kvs {

// The number of usable CUDA devices; 0 with `*why` set ("cudaGetDeviceCount: ..." naming the CUDA
// error, e.g. no driver) when there are none. Never aborts.
int CudaDeviceCount(std::string* why);
// "<name> (sm_XY, N MiB)" of device `ordinal`, or the CUDA error text.
std::string CudaDeviceDescription(int ordinal);

// FAILED_PRECONDITION when `device` does not exist or cannot be initialised. `trusted`: the
// caller validates every job on the host (the staging layer does, with the CPU backend's
// validators), so the backend launches without a second pass: no pointer queries, no mirror
// copies of index arrays, each of which was a synchronous round trip per job.
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device = 0, bool trusted = false);

}  // namespace kvs

#endif  // KVSIDECAR_GPU_CUDA_CUDA_BACKEND_H_
