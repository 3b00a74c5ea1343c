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
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"

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

  // Block copies between the arena and one contiguous host buffer: block i, `block_bytes` long,
  // between arena + offsets[i] and host + i * block_bytes (what a spill and a restore move). A
  // device arena gathers or scatters the blocks on the device and crosses the bus once per large
  // piece; a copy per block cost a synchronous transfer of microseconds each (4096 of them for a
  // 256 MiB sequence of 64 KiB blocks). OUT_OF_RANGE if any block leaves the arena, before
  // anything is copied. By default each run of adjacent blocks is one Read or Write.
  virtual absl::Status ReadBlocks(absl::Span<const uint64_t> offsets, uint64_t block_bytes,
                                  void* destination) const {
    return EachBlockRun(offsets, block_bytes, destination, [&](uint64_t offset, uint8_t* host,
                                                               uint64_t bytes) {
      return Read(offset, host, bytes);
    });
  }
  virtual absl::Status WriteBlocks(absl::Span<const uint64_t> offsets, uint64_t block_bytes,
                                   const void* source) {
    return EachBlockRun(offsets, block_bytes, const_cast<void*>(source),
                        [&](uint64_t offset, uint8_t* host, uint64_t bytes) {
                          return Write(offset, host, bytes);
                        });
  }

  // A new descriptor of the arena's memory (close-on-exec; the caller owns and closes it), for
  // handing to the one worker that attached. FAILED_PRECONDITION for arenas that are not a memfd.
  virtual absl::StatusOr<int> DuplicateFd() const {
    return absl::FailedPreconditionError("this arena is not handed over as a file descriptor");
  }

 protected:
  // OUT_OF_RANGE unless every block [offsets[i], offsets[i] + block_bytes) lies in the arena
  // (checked without overflow); INVALID_ARGUMENT for a null host buffer with blocks to copy.
  absl::Status CheckBlocks(absl::Span<const uint64_t> offsets, uint64_t block_bytes,
                           const void* host) const {
    if (offsets.empty() || block_bytes == 0) return absl::OkStatus();
    if (host == nullptr) return absl::InvalidArgumentError("arena block copy: null host buffer");
    for (size_t i = 0; i < offsets.size(); ++i) {
      if (offsets[i] > size_bytes() || block_bytes > size_bytes() - offsets[i]) {
        return absl::OutOfRangeError(absl::StrCat("arena block copy: block ", i, " of ",
                                                  block_bytes, " bytes at offset ", offsets[i],
                                                  " leaves the arena of ", size_bytes(), " bytes"));
      }
    }
    return absl::OkStatus();
  }

  // Blocks adjacent both in `offsets` and in the arena, as runs: blocks [first, first + count)
  // of the list, which one copy of count * block_bytes moves.
  struct BlockRun {
    size_t first = 0;
    size_t count = 0;
  };
  static std::vector<BlockRun> BlockRuns(absl::Span<const uint64_t> offsets,
                                         uint64_t block_bytes) {
    std::vector<BlockRun> runs;
    for (size_t b = 0; b < offsets.size();) {
      size_t count = 1;
      while (b + count < offsets.size() && offsets[b + count] == offsets[b] + count * block_bytes) {
        ++count;
      }
      runs.push_back({b, count});
      b += count;
    }
    return runs;
  }

 private:
  // copy(offset, host, bytes) once per run of blocks, after CheckBlocks.
  template <typename Copy>
  absl::Status EachBlockRun(absl::Span<const uint64_t> offsets, uint64_t block_bytes, void* host,
                            const Copy& copy) const {
    if (absl::Status status = CheckBlocks(offsets, block_bytes, host); !status.ok()) return status;
    if (offsets.empty() || block_bytes == 0) return absl::OkStatus();
    auto* bytes = static_cast<uint8_t*>(host);
    for (const BlockRun& run : BlockRuns(offsets, block_bytes)) {
      if (absl::Status status = copy(offsets[run.first], bytes + run.first * block_bytes,
                                     run.count * block_bytes);
          !status.ok()) {
        return status;
      }
    }
    return absl::OkStatus();
  }
};

}  // namespace kvs

#endif  // KVSIDECAR_GPU_ARENA_H_
