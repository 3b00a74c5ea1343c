// A CudaIpcDriver without a GPU for the client's unit tests: "devices" are UUIDs, an opened handle
// is a zeroed host buffer (so the client's row arithmetic and copies can be checked byte for
// byte), and every call is recorded. Thread-safe (one mutex).
#ifndef KVSIDECAR_TESTS_CLIENTS_CPP_FAKE_CUDA_IPC_DRIVER_H_
#define KVSIDECAR_TESTS_CLIENTS_CPP_FAKE_CUDA_IPC_DRIVER_H_

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "clients/cpp/cuda_ipc.h"

namespace kvsidecar::internal {

class FakeCudaIpcDriver final : public CudaIpcDriver {
 public:
  explicit FakeCudaIpcDriver(std::vector<CudaUuid> devices, size_t bytes_per_open = 4096)
      : devices_(std::move(devices)), bytes_per_open_(bytes_per_open) {}

  bool available() const override { return true; }
  absl::StatusOr<std::vector<CudaUuid>> DeviceUuids() override {
    absl::MutexLock lock(&mu_);
    if (devices_.empty()) return absl::FailedPreconditionError("no CUDA device (fake)");
    return devices_;
  }
  absl::StatusOr<uint8_t*> Open(int device, absl::string_view handle) override {
    absl::MutexLock lock(&mu_);
    opens_.push_back({device, std::string(handle)});
    auto memory = std::make_unique<std::vector<uint8_t>>(bytes_per_open_, 0);
    uint8_t* base = memory->data();
    memory_[base] = std::move(memory);
    return base;
  }
  absl::Status Close(int device, uint8_t* base) override {
    absl::MutexLock lock(&mu_);
    closes_.push_back(device);
    if (memory_.erase(base) == 0) return absl::InternalError("close of a pointer never opened");
    return absl::OkStatus();
  }
  absl::Status CopyToDevice(int, uint8_t* dst, const uint8_t* src, size_t bytes) override {
    absl::MutexLock lock(&mu_);
    ++copies_to_device_;
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyFromDevice(int, uint8_t* dst, const uint8_t* src, size_t bytes) override {
    absl::MutexLock lock(&mu_);
    ++copies_from_device_;
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }

  struct OpenCall {
    int device;
    std::string handle;
  };
  std::vector<OpenCall> opens() {
    absl::MutexLock lock(&mu_);
    return opens_;
  }
  std::vector<int> closes() {
    absl::MutexLock lock(&mu_);
    return closes_;
  }
  int copies_to_device() {
    absl::MutexLock lock(&mu_);
    return copies_to_device_;
  }
  int copies_from_device() {
    absl::MutexLock lock(&mu_);
    return copies_from_device_;
  }

 private:
  absl::Mutex mu_;
  std::vector<CudaUuid> devices_ ABSL_GUARDED_BY(mu_);
  const size_t bytes_per_open_;
  std::map<uint8_t*, std::unique_ptr<std::vector<uint8_t>>> memory_ ABSL_GUARDED_BY(mu_);
  std::vector<OpenCall> opens_ ABSL_GUARDED_BY(mu_);
  std::vector<int> closes_ ABSL_GUARDED_BY(mu_);
  int copies_to_device_ ABSL_GUARDED_BY(mu_) = 0;
  int copies_from_device_ ABSL_GUARDED_BY(mu_) = 0;
};

// Installs a driver for the lifetime of the object (restores the default after).
class ScopedCudaIpcDriver {
 public:
  explicit ScopedCudaIpcDriver(CudaIpcDriver* driver) { SetCudaIpcDriverForTesting(driver); }
  ~ScopedCudaIpcDriver() { SetCudaIpcDriverForTesting(nullptr); }
  ScopedCudaIpcDriver(const ScopedCudaIpcDriver&) = delete;
  ScopedCudaIpcDriver& operator=(const ScopedCudaIpcDriver&) = delete;
};

}  // namespace kvsidecar::internal

#endif  // KVSIDECAR_TESTS_CLIENTS_CPP_FAKE_CUDA_IPC_DRIVER_H_
