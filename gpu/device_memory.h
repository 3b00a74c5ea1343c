// DeviceMemory: the memory operations of a device backend that gpu/staging_backend.h needs to
// move the cache core's host-side job arrays to where the backend computes: ask whether the
// device can use a pointer, allocate scratch, and copy between host and device memory.
// Implementations: CUDA (gpu/cuda/cuda_device_memory.h) and the simulated device
// (gpu/sim/simulated_device.h).
//
// Copies are synchronous: they are ordered after the work already queued on `s` and complete
// before they return (CUDA: cudaMemcpyAsync on `s` followed by cudaStreamSynchronize(s)).
//
// Threading: every method is safe to call concurrently.
#ifndef KVSIDECAR_GPU_DEVICE_MEMORY_H_
#define KVSIDECAR_GPU_DEVICE_MEMORY_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu/backend.h"

namespace kvs {

class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;

  // True when the device backend's kernels can use `p` directly: device or managed memory, or
  // page-locked host memory mapped into the device's address space (CUDA); an address inside a
  // simulated allocation or arena, or registered page-locked host memory (simulated device).
  // nullptr is not accessible.
  virtual bool IsDeviceAccessible(const void* p) const = 0;

  // Device scratch of at least `bytes` (> 0) bytes, aligned to 256 bytes. RESOURCE_EXHAUSTED when
  // the device is out of memory. Implementations keep freed memory for reuse (the CUDA one in the
  // device's stream-ordered pool), so that the small allocations of every staged call do not
  // reach the driver each time. Stream-ordered (CUDA): usable by the work the calling thread
  // queues on its stream afterwards, without a wait.
  virtual absl::StatusOr<void*> Allocate(uint64_t bytes) = 0;
  // Returns memory from Allocate; nullptr is ignored. The buffer may be handed out again at once,
  // so the device work that uses it must have finished (the stream synchronised) before.
  virtual void Free(void* p) = 0;

  // `bytes` from host memory to device memory (`dst` device-accessible), and back. Synchronous
  // (see above); INVALID_ARGUMENT when a range is not where it must be.
  virtual absl::Status CopyToDevice(void* dst, const void* host_src, uint64_t bytes, Stream s) = 0;
  // The same copy ordered on `s` without waiting for it: `host_src` must be page-locked and stay
  // unchanged until `s` is next waited for (the staging layer's input buffer, which the call's
  // own wait covers). A call's inputs then cost no round trip of their own. By default the copy
  // is CopyToDevice's, synchronous.
  virtual absl::Status CopyToDeviceAsync(void* dst, const void* host_src, uint64_t bytes,
                                         Stream s) {
    return CopyToDevice(dst, host_src, bytes, s);
  }
  virtual absl::Status CopyToHost(void* host_dst, const void* src, uint64_t bytes, Stream s) = 0;
};

}  // namespace kvs

#endif  // KVSIDECAR_GPU_DEVICE_MEMORY_H_
