// CudaDeviceMemory (gpu/cuda/cuda_device_memory.h).
#include "gpu/cuda/cuda_device_memory.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gpu/base/status_macros.h"
#include "gpu/cuda/cuda_status.h"

namespace kvs {
namespace {

// At most this many freed buffers of at most this size are kept for reuse.
constexpr size_t kMaxCached = 8;
constexpr uint64_t kMaxCachedBytes = uint64_t{16} << 20;

class CudaDeviceMemory final : public DeviceMemory {
 public:
  explicit CudaDeviceMemory(int device) : device_(device) {}

  ~CudaDeviceMemory() override {
    absl::MutexLock lock(&mu_);
    if (!cache_.empty()) cudaSetDevice(device_);
    for (const Buffer& buffer : cache_) cudaFree(buffer.p);  // errors have nowhere to go
  }

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
    {
      absl::MutexLock lock(&mu_);
      auto best = cache_.end();
      for (auto it = cache_.begin(); it != cache_.end(); ++it) {
        if (it->bytes >= bytes && (best == cache_.end() || it->bytes < best->bytes)) best = it;
      }
      if (best != cache_.end()) {
        void* p = best->p;
        live_[p] = best->bytes;
        cache_.erase(best);
        return p;
      }
    }
    KVS_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    void* p = nullptr;
    if (cudaError_t error = cudaMalloc(&p, bytes); error != cudaSuccess) {
      cudaGetLastError();
      return CudaStatus(error, absl::StrCat("cudaMalloc of ", bytes, " staging bytes"));
    }
    absl::MutexLock lock(&mu_);
    live_[p] = bytes;
    return p;
  }

  void Free(void* p) override {
    if (p == nullptr) return;
    {
      absl::MutexLock lock(&mu_);
      auto it = live_.find(p);
      if (it == live_.end()) return;  // not from Allocate
      const uint64_t bytes = it->second;
      live_.erase(it);
      if (cache_.size() < kMaxCached && bytes <= kMaxCachedBytes) {
        cache_.push_back(Buffer{p, bytes});
        return;
      }
    }
    cudaSetDevice(device_);
    cudaFree(p);
  }

  absl::Status CopyToDevice(void* dst, const void* host_src, uint64_t bytes, Stream s) override {
    return Copy(dst, host_src, bytes, s, "CopyToDevice");
  }
  absl::Status CopyToHost(void* host_dst, const void* src, uint64_t bytes, Stream s) override {
    return Copy(host_dst, src, bytes, s, "CopyToHost");
  }

 private:
  struct Buffer {
    void* p;
    uint64_t bytes;
  };

  absl::Status Copy(void* dst, const void* src, uint64_t bytes, Stream s, const char* what) {
    if (bytes == 0) return absl::OkStatus();
    KVS_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_), "cudaSetDevice");
    const cudaStream_t stream = static_cast<cudaStream_t>(s);
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
  std::vector<Buffer> cache_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<void*, uint64_t> live_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<DeviceMemory> MakeCudaDeviceMemory(int device) {
  return std::make_unique<CudaDeviceMemory>(device);
}

}  // namespace kvs
