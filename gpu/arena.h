// Arena: one allocation of KV memory owned by the sidecar and shared with one worker (on the CPU
// backend an anonymous memfd handed to that worker alone over a Unix socket, or, in the legacy
// mode, a named shared-memory file; a cudaMalloc exported through CUDA IPC on the CUDA backend).
// It is cut into fixed-size blocks by its owner (cache/); the arena itself knows only bytes.
//
// Threading: data()/size/handle are immutable after creation and safe from any thread. Read/Write
// may run concurrently on disjoint byte ranges; callers serialise overlapping ranges.
#ifndef KVSIDECAR_GPU_ARENA_H_
#define KVSIDECAR_GPU_ARENA_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvs {

// What a worker needs to map an arena (mirrors kvsidecar.v1.ArenaHandle).
struct ArenaHandle {
  // kMemfd: host memory without a name; the worker receives a descriptor over the arena socket
  // (service/arena_fd_server.h), never a path another process could open.
  enum class Kind { kSharedMemoryFile, kCudaIpc, kMemfd };
  Kind kind = Kind::kSharedMemoryFile;
  std::string shm_path;         // kSharedMemoryFile: file to open + mmap (mode 0600)
  std::string cuda_ipc_handle;  // kCudaIpc: the raw 64-byte cudaIpcMemHandle_t
  int cuda_device = -1;
  std::string cuda_device_uuid;
  uint64_t size_bytes = 0;
  uint64_t generation = 0;  // unique per arena created by this process
};

class Arena {
 public:
  virtual ~Arena() = default;

  // Base address in the sidecar's address space: host memory on the CPU backend, a device
  // pointer on the CUDA backend (not dereferenceable on the host).
  virtual uint8_t* data() = 0;
  virtual const uint8_t* data() const = 0;
  virtual uint64_t size_bytes() const = 0;
  virtual const ArenaHandle& handle() const = 0;
  // True when data() may be dereferenced on the host (the shared-memory arena). False by default:
  // a device arena, or a wrapper that does not know, is reached only through Read/Write and the
  // backend's kernels.
  virtual bool host_mapped() const { return false; }

  // Copies between host memory and the arena. OUT_OF_RANGE if [offset, offset + bytes) leaves
  // the arena (checked without overflow); nothing is copied then.
  virtual absl::Status Write(uint64_t offset, const void* source, uint64_t bytes) = 0;
  virtual absl::Status Read(uint64_t offset, void* destination, uint64_t bytes) const = 0;

  // A new descriptor of the arena's memory (close-on-exec; the caller owns and closes it), for
  // handing to the one worker that attached. FAILED_PRECONDITION for arenas that are not a memfd.
  virtual absl::StatusOr<int> DuplicateFd() const {
    return absl::FailedPreconditionError("this arena is not handed over as a file descriptor");
  }
};

}  // namespace kvs

#endif  // KVSIDECAR_GPU_ARENA_H_
