// Drain to a tier: moves every sequence of every attached session that is not in a target tier
// yet (in the arena, or spilled to host memory) to that tier, one after the other, until a
// deadline, and reports per sequence what moved and what did not, and why. Used by Admin.Drain
// with a target tier and by the sidecar on SIGTERM (--drain_to, --drain_grace) before it exits,
// so that the copies outlive the process: the disk tier keeps them in the data directory (a
// restarted sidecar lists them and a new session of the tenant adopts them), the remote tier in
// the shared store.
//
// Nothing is dropped: a sequence that cannot be moved (the tier or the tenant's quota for it is
// full, it cannot be spilled, the deadline passed first) stays where it was and is reported with
// the reason. A pending reservation blocks a Spill; with `retry` the drain tries such a sequence
// again (and any sequence a worker brought back into the arena meanwhile) until the deadline.
//
// Threading: thread-safe (the pool is); one call at a time is expected, several only repeat work.
#ifndef KVSIDECAR_SERVICE_DRAIN_H_
#define KVSIDECAR_SERVICE_DRAIN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "cache/pool.h"
#include "cache/tier.h"

namespace kvs {

// "disk" -> kDisk, "remote" -> the remote tier, "none" -> kArena (meaning: move nothing);
// anything else INVALID_ARGUMENT naming `name`.
absl::StatusOr<StorageTier> ParseDrainTarget(absl::string_view text, absl::string_view name);
// The name of a drain target: "disk", "remote", "none".
std::string DrainTargetName(StorageTier tier);

struct DrainedSequence {
  std::string tenant;
  std::string session_id;
  std::string sequence_id;
  bool moved = false;                       // in the target tier now
  StorageTier tier = StorageTier::kArena;   // where it is now
  uint64_t bytes = 0;                       // bytes in the target tier (moved only)
  std::string reason;                       // not moved: why
};

struct DrainReport {
  std::vector<DrainedSequence> sequences;   // ordered by (session, sequence)
  int32_t moved = 0;
  int32_t not_moved = 0;
  bool grace_expired = false;               // the deadline passed before every move was tried
  absl::Duration elapsed;
};

// Moves every sequence of `pool`'s attached sessions to `target` (kDisk or the remote tier)
// until `deadline`, a time on MonotonicNow()'s clock (cache/clock.h; a Spill already running
// finishes). `retry`: sequences blocked by a pending
// reservation, and sequences brought back into the arena by a call meanwhile, are tried again
// until everything is moved or the deadline passes; without it each sequence is tried once.
DrainReport DrainSequences(KvPool& pool, StorageTier target, absl::Time deadline, bool retry);

// One log line per sequence not moved (WARNING) and a summary line (INFO) under `event`.
void LogDrainReport(const DrainReport& report, StorageTier target, absl::string_view event);

}  // namespace kvs

#endif  // KVSIDECAR_SERVICE_DRAIN_H_
