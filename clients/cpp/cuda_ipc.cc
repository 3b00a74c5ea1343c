#include "clients/cpp/cuda_ipc.h"

#include <atomic>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

#ifdef KVS_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace kvsidecar::internal {
namespace {

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

constexpr absl::string_view kPrefix = "cannot map the KIND_CUDA_IPC arena: ";

// The driver of a build without CUDA: says so on every call.
class NoCudaDriver final : public CudaIpcDriver {
 public:
  bool available() const override { return false; }
  absl::StatusOr<std::vector<CudaUuid>> DeviceUuids() override { return Error(); }
  absl::StatusOr<uint8_t*> Open(int, absl::string_view) override { return Error(); }
  absl::Status Close(int, uint8_t*) override { return Error(); }
  absl::Status CopyToDevice(int, uint8_t*, const uint8_t*, size_t) override { return Error(); }
  absl::Status CopyFromDevice(int, uint8_t*, const uint8_t*, size_t) override { return Error(); }

 private:
  static absl::Status Error() {
    return absl::FailedPreconditionError(
        "this kvsidecar client library was built without CUDA (KVS_WITH_CUDA off: no nvcc at "
        "build time), so it cannot map a CUDA IPC arena; rebuild it with CUDA or serve the "
        "session from a --backend=cpu sidecar");
  }
};

#ifdef KVS_WITH_CUDA
absl::Status CudaError(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();  // do not leave a non-sticky error behind for the caller's next CUDA call
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorName(error), " (", cudaGetErrorString(error), ")"));
}

// Selects `device` for the calling thread and restores the thread's previous device afterwards:
// the client must not change which device the worker's own CUDA code runs on.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      cudaGetLastError();
      previous_ = -1;
    }
    status_ =
        previous_ == device ? absl::OkStatus() : CudaError(cudaSetDevice(device), "cudaSetDevice");
    restore_ = status_.ok() && previous_ >= 0 && previous_ != device;
  }
  ~DeviceGuard() {
    if (restore_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  const absl::Status& status() const { return status_; }

 private:
  int previous_ = -1;
  bool restore_ = false;
  absl::Status status_;
};

class CudartDriver final : public CudaIpcDriver {
 public:
  bool available() const override { return true; }

  absl::StatusOr<std::vector<CudaUuid>> DeviceUuids() override {
    int count = 0;
    if (cudaError_t error = cudaGetDeviceCount(&count); error != cudaSuccess || count == 0) {
      cudaGetLastError();
      return absl::FailedPreconditionError(
          error == cudaSuccess
              ? std::string("no CUDA device is visible to this process")
              : absl::StrCat("no CUDA device is usable in this process: cudaGetDeviceCount: ",
                             cudaGetErrorName(error), " (", cudaGetErrorString(error), ")"));
    }
    std::vector<CudaUuid> uuids(count);
    for (int i = 0; i < count; ++i) {
      cudaDeviceProp props;
      if (cudaError_t error = cudaGetDeviceProperties(&props, i); error != cudaSuccess) {
        return absl::FailedPreconditionError(
            CudaError(error, absl::StrCat("cudaGetDeviceProperties(", i, ")")).message());
      }
      static_assert(sizeof(props.uuid.bytes) == 16);
      for (int b = 0; b < 16; ++b) uuids[i][b] = static_cast<uint8_t>(props.uuid.bytes[b]);
    }
    return uuids;
  }

  absl::StatusOr<uint8_t*> Open(int device, absl::string_view handle) override {
    static_assert(sizeof(cudaIpcMemHandle_t) == kCudaIpcHandleBytes);
    if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
      return absl::InternalError(absl::StrCat("IPC handle of ", handle.size(), " bytes"));
    }
    DeviceGuard guard(device);
    if (!guard.status().ok()) return guard.status();
    cudaIpcMemHandle_t ipc;
    std::memcpy(&ipc, handle.data(), sizeof(ipc));
    void* base = nullptr;
    const cudaError_t error = cudaIpcOpenMemHandle(&base, ipc, cudaIpcMemLazyEnablePeerAccess);
    if (error != cudaSuccess) {
      // The handle names memory this process cannot reach (another host, a freed arena, a
      // device without peer access): a precondition of the caller's environment.
      return absl::FailedPreconditionError(
          CudaError(error, absl::StrCat("cudaIpcOpenMemHandle on device ", device)).message());
    }
    return static_cast<uint8_t*>(base);
  }

  absl::Status Close(int device, uint8_t* base) override {
    DeviceGuard guard(device);
    if (!guard.status().ok()) return guard.status();
    return CudaError(cudaIpcCloseMemHandle(base), "cudaIpcCloseMemHandle");
  }

  absl::Status CopyToDevice(int device, uint8_t* device_dst, const uint8_t* host_src,
                            size_t bytes) override {
    DeviceGuard guard(device);
    if (!guard.status().ok()) return guard.status();
    return CudaError(cudaMemcpy(device_dst, host_src, bytes, cudaMemcpyHostToDevice),
                     "cudaMemcpy host to arena");
  }

  absl::Status CopyFromDevice(int device, uint8_t* host_dst, const uint8_t* device_src,
                              size_t bytes) override {
    DeviceGuard guard(device);
    if (!guard.status().ok()) return guard.status();
    return CudaError(cudaMemcpy(host_dst, device_src, bytes, cudaMemcpyDeviceToHost),
                     "cudaMemcpy arena to host");
  }
};
#endif  // KVS_WITH_CUDA

CudaIpcDriver* DefaultDriver() {
#ifdef KVS_WITH_CUDA
  static CudaIpcDriver* const driver = new CudartDriver();
#else
  static CudaIpcDriver* const driver = new NoCudaDriver();
#endif
  return driver;
}

std::atomic<CudaIpcDriver*> g_test_driver{nullptr};

}  // namespace

absl::StatusOr<CudaUuid> ParseCudaUuid(absl::string_view text) {
  absl::string_view rest = text;
  for (absl::string_view prefix : {"GPU-", "MIG-", "gpu-", "mig-"}) {
    if (rest.substr(0, prefix.size()) == prefix) {
      rest.remove_prefix(prefix.size());
      break;
    }
  }
  // 8-4-4-4-12: dashes after hex digits 8, 12, 16 and 20.
  CudaUuid uuid{};
  int digits = 0;
  bool ok = rest.size() == 36;
  for (size_t i = 0; ok && i < rest.size(); ++i) {
    if (i == 8 || i == 13 || i == 18 || i == 23) {
      ok = rest[i] == '-';
      continue;
    }
    const int value = HexValue(rest[i]);
    if (value < 0) {
      ok = false;
      break;
    }
    uuid[digits / 2] = static_cast<uint8_t>(uuid[digits / 2] << 4 | value);
    ++digits;
  }
  if (!ok || digits != 32) {
    return absl::InvalidArgumentError(absl::StrCat(
        "\"", text, "\" is not a CUDA device UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)"));
  }
  return uuid;
}

std::string FormatCudaUuid(const CudaUuid& b) {
  return absl::StrFormat("GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
                         b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11],
                         b[12], b[13], b[14], b[15]);
}

bool ClientBuiltWithCuda() {
#ifdef KVS_WITH_CUDA
  return true;
#else
  return false;
#endif
}

CudaIpcDriver* CurrentCudaIpcDriver() {
  CudaIpcDriver* driver = g_test_driver.load();
  return driver != nullptr ? driver : DefaultDriver();
}

void SetCudaIpcDriverForTesting(CudaIpcDriver* driver) { g_test_driver.store(driver); }

CudaIpcMappings& CudaIpcMappings::Global() {
  static CudaIpcMappings* const mappings = new CudaIpcMappings();
  return *mappings;
}

absl::StatusOr<CudaIpcMapping> CudaIpcMappings::Acquire(CudaIpcDriver* driver,
                                                        absl::string_view session_id,
                                                        const v1::ArenaHandle& handle) {
  if (!driver->available()) {
    // The driver's own message says why (the build has no CUDA).
    return absl::FailedPreconditionError(
        absl::StrCat(kPrefix, driver->DeviceUuids().status().message()));
  }
  if (handle.kind() != v1::ArenaHandle::KIND_CUDA_IPC) {
    return absl::InternalError(
        absl::StrCat(kPrefix, "arena.kind is ", v1::ArenaHandle::Kind_Name(handle.kind())));
  }
  if (handle.cuda_ipc_handle().size() != kCudaIpcHandleBytes) {
    return absl::InternalError(absl::StrCat(kPrefix, "arena.cuda_ipc_handle has ",
                                            handle.cuda_ipc_handle().size(), " bytes, expected ",
                                            kCudaIpcHandleBytes));
  }
  absl::StatusOr<CudaUuid> uuid = ParseCudaUuid(handle.cuda_device_uuid());
  if (!uuid.ok()) {
    return absl::InternalError(
        absl::StrCat(kPrefix, "arena.cuda_device_uuid: ", uuid.status().message()));
  }

  absl::MutexLock lock(&mu_);
  // Refusals first: nothing is opened for a handle that must not be mapped.
  if (auto it = entries_.find(session_id); it != entries_.end()) {
    Entry& entry = it->second;
    if (entry.mapping.generation != handle.generation()) {
      return absl::FailedPreconditionError(absl::StrCat(
          kPrefix, "session ", session_id, " has arena generation ", entry.mapping.generation,
          " mapped in this process and the handle carries generation ", handle.generation(),
          "; a mapping of another generation is never reused (detach the session first)"));
    }
    if (entry.handle != handle.cuda_ipc_handle()) {
      return absl::FailedPreconditionError(absl::StrCat(
          kPrefix, "session ", session_id, " has a different IPC handle of generation ",
          handle.generation(), " mapped in this process"));
    }
    ++entry.references;
    return entry.mapping;
  }
  for (const auto& [other, entry] : entries_) {
    if (entry.handle == handle.cuda_ipc_handle()) {
      return absl::FailedPreconditionError(
          absl::StrCat(kPrefix, "the IPC handle is the arena of session ", other,
                       ", mapped in this process; a handle of another session is refused"));
    }
  }

  absl::StatusOr<std::vector<CudaUuid>> uuids = driver->DeviceUuids();
  if (!uuids.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(kPrefix, uuids.status().message()));
  }
  int device = -1;
  for (size_t i = 0; i < uuids->size(); ++i) {
    if ((*uuids)[i] == *uuid) device = static_cast<int>(i);
  }
  if (device < 0) {
    std::vector<std::string> seen;
    for (const CudaUuid& u : *uuids) seen.push_back(FormatCudaUuid(u));
    return absl::FailedPreconditionError(
        absl::StrCat(kPrefix, "arena.cuda_device_uuid ", handle.cuda_device_uuid(),
                     " (the sidecar's device ", handle.cuda_device(),
                     ") is not among the devices this process sees (", absl::StrJoin(seen, ", "),
                     "); the worker must run on the sidecar's GPU (check CUDA_VISIBLE_DEVICES)"));
  }
  absl::StatusOr<uint8_t*> base = driver->Open(device, handle.cuda_ipc_handle());
  if (!base.ok()) {
    return absl::Status(base.status().code(), absl::StrCat(kPrefix, base.status().message()));
  }
  Entry entry;
  entry.driver = driver;
  entry.handle = handle.cuda_ipc_handle();
  entry.mapping.base = *base;
  entry.mapping.device = device;
  entry.mapping.size_bytes = handle.size_bytes();
  entry.mapping.generation = handle.generation();
  entry.references = 1;
  CudaIpcMapping mapping = entry.mapping;
  entries_.emplace(std::string(session_id), std::move(entry));
  return mapping;
}

absl::Status CudaIpcMappings::Release(absl::string_view session_id, uint64_t generation) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(session_id);
  if (it == entries_.end() || it->second.mapping.generation != generation) {
    return absl::NotFoundError(absl::StrCat("session ", session_id, " has no CUDA IPC mapping of ",
                                            "generation ", generation, " in this process"));
  }
  if (--it->second.references > 0) return absl::OkStatus();
  const Entry entry = std::move(it->second);
  entries_.erase(it);
  return entry.driver->Close(entry.mapping.device, entry.mapping.base);
}

int CudaIpcMappings::open_mappings() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(entries_.size());
}

}  // namespace kvsidecar::internal
