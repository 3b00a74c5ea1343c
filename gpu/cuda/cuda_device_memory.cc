// CudaDeviceMemory (gpu/cuda/cuda_device_memory.h).
#include "gpu/cuda/cuda_device_memory.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <unordered_set>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gpu/base/status_macros.h"
#include "gpu/cuda/cuda_status.h"
#include "gpu/device_counters.h"

namespace kvs {
namespace {

// Staging buffers come from the device's stream-ordered memory pool (cudaMallocAsync on the
// calling thread's stream), the pool the kernels' scratch comes from: it keeps freed memory for
// reuse up to the release threshold MakeCudaBackend sets, and hands it back when an arena is
// freed (~CudaArena trims it). A cache of our own held cudaMalloc'd buffers past every session,
// and each cudaMalloc or cudaFree it missed synchronised the whole device, serialising the host
// threads that stage the layers of a step side by side.
class CudaDeviceMemory final : public DeviceMemory {
 public:
  explicit CudaDeviceMemory(int device) : device_(device) {}

  bool IsDeviceAccessible(const void* p) const override {
    if (p == nullptr) return false;
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
      cudaGetLastError();  // not sticky: an unknown pointer
      return false;
    }
    return attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged ||
           (attributes.type == cudaMemoryTypeHost && attributes.devicePointer != nullptr);
  }

  absl::StatusOr<void*> Allocate(uint64_t bytes) override {
    if (bytes == 0) return absl::InvalidArgumentError("CUDA device memory: Allocate of 0 bytes");
    KVS_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    void* p = nullptr;
    if (cudaError_t error = cudaMallocAsync(&p, bytes, cudaStreamPerThread);
        error != cudaSuccess) {
      cudaGetLastError();
      return CudaStatus(error, absl::StrCat("cudaMallocAsync of ", bytes, " staging bytes"));
    }
    // Stream-ordered on this thread's stream, which every staged call of this thread uses
    // (CUDA_API_PER_THREAD_DEFAULT_STREAM): work queued after it may use the memory, with no wait.
    absl::MutexLock lock(&mu_);
    live_.insert(p);
    return p;
  }

  // Back to the pool behind whatever this thread's stream still runs; the work of other streams
  // that used the buffer has finished (see DeviceMemory::Free).
  void Free(void* p) override {
    if (p == nullptr) return;
    {
      absl::MutexLock lock(&mu_);
      if (live_.erase(p) == 0) return;  // not from Allocate
    }
    cudaSetDevice(device_);
    if (cudaFreeAsync(p, cudaStreamPerThread) != cudaSuccess) cudaGetLastError();
  }

  absl::Status CopyToDevice(void* dst, const void* host_src, uint64_t bytes, Stream s) override {
    return Copy(dst, host_src, bytes, s, /*to_device=*/true);
  }
  absl::Status CopyToHost(void* host_dst, const void* src, uint64_t bytes, Stream s) override {
    return Copy(host_dst, src, bytes, s, /*to_device=*/false);
  }
  absl::Status CopyToDeviceAsync(void* dst, const void* host_src, uint64_t bytes,
                                 Stream s) override {
    if (bytes == 0) return absl::OkStatus();
    KVS_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    DeviceCounters::Upload(bytes);
    if (cudaError_t error = cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice,
                                            static_cast<cudaStream_t>(s));
        error != cudaSuccess) {
      const absl::Status status = CudaStatus(error, "CopyToDeviceAsync (cudaMemcpyAsync)");
      if (error == cudaErrorInvalidValue) cudaGetLastError();  // a bad range is not sticky
      return error == cudaErrorInvalidValue ? absl::InvalidArgumentError(status.message()) : status;
    }
    return absl::OkStatus();
  }

 private:
  absl::Status Copy(void* dst, const void* src, uint64_t bytes, Stream s, bool to_device) {
    if (bytes == 0) return absl::OkStatus();
    const char* what = to_device ? "CopyToDevice" : "CopyToHost";
    KVS_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    const cudaStream_t stream = static_cast<cudaStream_t>(s);
    if (to_device) {
      DeviceCounters::Upload(bytes);
    } else {
      DeviceCounters::Download(bytes);
    }
    DeviceCounters::Sync();
    if (cudaError_t error = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream);
        error != cudaSuccess) {
      const absl::Status status = CudaStatus(error, absl::StrCat(what, " (cudaMemcpyAsync)"));
      if (error == cudaErrorInvalidValue) cudaGetLastError();  // a bad range is not sticky
      return error == cudaErrorInvalidValue ? absl::InvalidArgumentError(status.message()) : status;
    }
    return CudaStatus(cudaStreamSynchronize(stream),
                      absl::StrCat(what, " (cudaStreamSynchronize)"));
  }

  const int device_;
  absl::Mutex mu_;
  std::unordered_set<void*> live_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<DeviceMemory> MakeCudaDeviceMemory(int device) {
  return std::make_unique<CudaDeviceMemory>(device);
}

}  // namespace kvs
