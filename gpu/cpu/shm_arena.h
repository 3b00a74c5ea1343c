// ShmArena: the CPU backend's Arena, a shared-memory file (default under /dev/shm) that the
// sidecar maps and a worker process maps again by path (ArenaHandle::shm_path). The object owns
// the mapping, the descriptor and the file: destruction unmaps, closes and unlinks.
//
// Threading: immutable after creation; Read/Write on disjoint ranges may run concurrently.
#ifndef KVSIDECAR_GPU_CPU_SHM_ARENA_H_
#define KVSIDECAR_GPU_CPU_SHM_ARENA_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "gpu/arena.h"
#include "gpu/backend.h"

namespace kvs {

// Creates "<shm_directory>/<name_prefix>-<pid>-<generation>-<8 hex>" of `bytes` bytes, mode 0600,
// with its storage reserved up front (a full tmpfs fails here with RESOURCE_EXHAUSTED instead of
// raising SIGBUS on a later write). INVALID_ARGUMENT for bytes == 0, RESOURCE_EXHAUSTED when the
// space or address space cannot be had, INTERNAL for other system errors.
absl::StatusOr<std::unique_ptr<Arena>> CreateShmArena(uint64_t bytes, const ArenaOptions& options);

}  // namespace kvs

#endif  // KVSIDECAR_GPU_CPU_SHM_ARENA_H_
