// ShmArena: the CPU backend's Arena, shared memory that the sidecar maps and one worker process
// maps again. By default an anonymous memfd (ArenaHandle::Kind::kMemfd) sealed against resizing:
// it has no name, and the worker gets it only as a descriptor (Arena::DuplicateFd, sent over the
// arena socket). With ArenaOptions::shm_names, the legacy named file (default under /dev/shm) the
// worker opens by path (ArenaHandle::shm_path); every process of the same uid can open that one.
// The object owns the mapping, the descriptor and the file: destruction unmaps, closes and
// unlinks. While a named arena lives, the sidecar holds an exclusive flock(2) on its file, so that
// a later sidecar tells a live arena from one a killed process left behind even across PID
// namespaces.
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

// Creates a sealed memfd named `name_prefix` (shown only in /proc) or, with options.shm_names,
// the file "<shm_directory>/<name_prefix>-<pid>-<generation>-<8 hex>" of `bytes` bytes, mode 0600,
// with its storage reserved up front (a full tmpfs fails here with RESOURCE_EXHAUSTED instead of
// raising SIGBUS on a later write). INVALID_ARGUMENT for bytes == 0, RESOURCE_EXHAUSTED when the
// space or address space cannot be had, INTERNAL for other system errors.
// With shm_names, the first call per (directory, prefix) in a process first removes stale arena
// files there (RemoveStaleShmArenas).
absl::StatusOr<std::unique_ptr<Arena>> CreateShmArena(uint64_t bytes, const ArenaOptions& options);

// Unlinks the arena files "<name_prefix>-<pid>-<generation>-<8 hex>" in options.shm_directory
// that belong to this user, whose pid is not a live process and whose flock no process holds
// (their sidecar died without cleaning up, e.g. SIGKILL or OOM). Returns how many it removed; files
// it cannot inspect are left alone. A worker that still maps such a file keeps its mapping.
int RemoveStaleShmArenas(const ArenaOptions& options);

}  // namespace kvs

#endif  // KVSIDECAR_GPU_CPU_SHM_ARENA_H_
