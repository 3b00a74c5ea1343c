// The C++ client's side of a CUDA arena (ArenaHandle.KIND_CUDA_IPC): device lookup by UUID, one
// cudaIpcOpenMemHandle per (session, generation) cached process-wide, refusal of stale or foreign
// handles, and the row copies between host memory and the mapped device memory. Internal to the
// client library (not installed); tests include it to inject a fake CudaIpcDriver.
//
// Why process-wide: CUDA maps one IPC allocation at most once per process and context, and a
// worker may attach several sessions; the registry is the one place that knows which session and
// which arena generation owns each mapping, so that a handle of another session, or a handle of a
// different generation for a session that still has one mapped, is refused instead of silently
// aliasing (or reusing) a stale mapping.
//
// Threading: every function here is thread-safe. CudaIpcMappings serialises opens and closes under
// its own mutex. The driver is called with no lock held by the caller except CudaIpcMappings'.
#ifndef KVSIDECAR_CLIENTS_CPP_CUDA_IPC_H_
#define KVSIDECAR_CLIENTS_CPP_CUDA_IPC_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "kvsidecar/v1/common.pb.h"

namespace kvsidecar::internal {

// Bytes of a cudaIpcMemHandle_t (CUDA_IPC_HANDLE_SIZE).
inline constexpr size_t kCudaIpcHandleBytes = 64;

using CudaUuid = std::array<uint8_t, 16>;

// Parses a device UUID as nvidia-smi and the sidecar print it: an optional "GPU-" or "MIG-"
// prefix, then 32 hex digits grouped 8-4-4-4-12 by dashes (case-insensitive). INVALID_ARGUMENT
// naming the text otherwise.
absl::StatusOr<CudaUuid> ParseCudaUuid(absl::string_view text);
// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (lower-case hex), the sidecar's format.
std::string FormatCudaUuid(const CudaUuid& uuid);

// The CUDA runtime calls the client needs, behind an interface so that the caching and refusal
// logic is testable without a GPU. Device numbers are this process's ordinals.
class CudaIpcDriver {
 public:
  virtual ~CudaIpcDriver() = default;
  // False for the driver of a build without CUDA (every call then fails FAILED_PRECONDITION).
  virtual bool available() const = 0;
  // UUIDs of the devices this process can use, indexed by ordinal. FAILED_PRECONDITION naming the
  // CUDA error when there are none (no driver, no device).
  virtual absl::StatusOr<std::vector<CudaUuid>> DeviceUuids() = 0;
  // cudaIpcOpenMemHandle(handle, cudaIpcMemLazyEnablePeerAccess) on `device`.
  virtual absl::StatusOr<uint8_t*> Open(int device, absl::string_view handle) = 0;
  // cudaIpcCloseMemHandle of a pointer Open returned.
  virtual absl::Status Close(int device, uint8_t* base) = 0;
  // Synchronous copies between pageable host memory and device memory of `device`.
  virtual absl::Status CopyToDevice(int device, uint8_t* device_dst, const uint8_t* host_src,
                                    size_t bytes) = 0;
  virtual absl::Status CopyFromDevice(int device, uint8_t* host_dst, const uint8_t* device_src,
                                      size_t bytes) = 0;
};

// True when the client library was built with CUDA (KVS_WITH_CUDA).
bool ClientBuiltWithCuda();
// The driver sessions use: the test override if one is set, else the CUDA runtime (or, without
// CUDA in the build, a driver whose every call says so). Never null.
CudaIpcDriver* CurrentCudaIpcDriver();
// Replaces the driver used by sessions attached from now on; nullptr restores the default. The
// caller keeps `driver` alive until every session that mapped through it has detached.
void SetCudaIpcDriverForTesting(CudaIpcDriver* driver);

// One open mapping of a session's device arena.
struct CudaIpcMapping {
  uint8_t* base = nullptr;  // device pointer in this process
  int device = -1;          // this process's ordinal of the arena's device
  uint64_t size_bytes = 0;
  uint64_t generation = 0;
};

// The process-wide cache of open IPC mappings, keyed by session id (one generation each).
class CudaIpcMappings {
 public:
  static CudaIpcMappings& Global();

  // Maps the KIND_CUDA_IPC `handle` of `session_id` through `driver`, or returns the cached
  // mapping when this session already has the same handle of the same generation mapped (counted;
  // each Acquire needs a Release). Refused with FAILED_PRECONDITION (nothing opened) when:
  // the driver has no CUDA; no device of this process has handle.cuda_device_uuid; the session
  // has another generation (or other handle bytes) mapped; the same handle bytes are mapped for
  // another session. INTERNAL for a malformed handle (wrong kind or handle length, bad UUID text).
  absl::StatusOr<CudaIpcMapping> Acquire(CudaIpcDriver* driver, absl::string_view session_id,
                                         const v1::ArenaHandle& handle);
  // Drops one reference; the last closes the mapping (cudaIpcCloseMemHandle). NOT_FOUND when the
  // session has no mapping of `generation`.
  absl::Status Release(absl::string_view session_id, uint64_t generation);
  // Mappings currently open (for tests and diagnostics).
  int open_mappings() const;

 private:
  struct Entry {
    CudaIpcDriver* driver = nullptr;
    std::string handle;  // the raw cudaIpcMemHandle_t bytes
    CudaIpcMapping mapping;
    int references = 0;
  };
  mutable absl::Mutex mu_;
  std::map<std::string, Entry, std::less<>> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvsidecar::internal

#endif  // KVSIDECAR_CLIENTS_CPP_CUDA_IPC_H_
