// The value types of KvPool's session calls: what Attach asks for and answers, heartbeats,
// what a release frees, and the sessions Admin lists. Plain data; no locks, no behaviour.
#ifndef KVSIDECAR_CACHE_SESSION_TYPES_H_
#define KVSIDECAR_CACHE_SESSION_TYPES_H_

#include <cstdint>
#include <string>

#include "absl/time/time.h"
#include "gpu/arena.h"
#include "gpu/base/layout.h"

namespace kvs {

struct AttachParams {
  ModelLayout layout;  // block_tokens 0 is resolved to the default
  std::string tenant = "default";
  std::string worker_name;
  int32_t num_blocks = 0;                       // 0 = PoolOptions::default_session_bytes worth
  absl::Duration lease = absl::ZeroDuration();  // 0 = default
  // Bytes of the query staging area after the blocks (0 = none): the worker writes a step's
  // queries there through its own mapping and the call names them by offset
  // (AttentionInput::staging_offset), so that no tensor travels in the request.
  uint64_t staging_bytes = 0;
};

struct SessionView {
  std::string session_id;
  std::string tenant;  // owner (authorization checks)
  ModelLayout layout;
  ArenaHandle arena;
  int32_t num_blocks = 0;
  uint64_t block_bytes = 0;
  uint64_t staging_offset = 0;  // the query staging area: arena bytes [offset, offset + bytes)
  uint64_t staging_bytes = 0;
  absl::Duration lease;
  absl::Time lease_expires;
};

struct HeartbeatResult {
  absl::Time lease_expires;
  int32_t free_blocks = 0;  // free blocks of the session's arena after its last completed call
};

struct ReleaseCounts {
  int32_t sequences = 0;
  int32_t blocks = 0;
};

struct SessionInfo {
  std::string session_id;
  std::string tenant;
  std::string worker_name;
  ModelLayout layout;
  int32_t num_blocks = 0;
  int32_t free_blocks = 0;
  int32_t sequences = 0;          // in the arena and spilled
  int32_t sequences_spilled = 0;  // of `sequences`, those in the host or disk tier
  absl::Time attached;
  absl::Time last_heartbeat;
  absl::Time lease_expires;
};

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_SESSION_TYPES_H_
