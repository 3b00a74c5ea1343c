// Session: one attached worker as the pool holds it (its arena cut into blocks, its sequences in
// the arena and those spilled to the tiers, its lease). Internal to cache/: KvPool and its parts
// (SessionTable, TenantLedger, TierMover) share it; the service sees SessionView / SessionInfo.
#ifndef KVSIDECAR_CACHE_INTERNAL_SESSION_H_
#define KVSIDECAR_CACHE_INTERNAL_SESSION_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cache/block_allocator.h"
#include "cache/policy/policy_config.h"
#include "cache/sequence.h"
#include "cache/session_types.h"
#include "cache/tier.h"
#include "gpu/arena.h"
#include "gpu/base/layout.h"

namespace kvs {

// Debian's Abseil is built with its own string_view type, distinct from std::string_view.
inline absl::string_view Sv(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// A sequence of a session that is spilled to the host or disk tier: where it is, and what it was
// when it left the arena (Admin lists it with its own policy, budget and kept tokens; they do not
// change until it is restored).
struct SpilledSequenceInfo {
  StorageTier tier = StorageTier::kHost;
  PolicyConfig policy;
  BudgetConfig budget;
  std::vector<int32_t> tokens_per_layer;
  absl::Time created;
  absl::Time last_used;

  static SpilledSequenceInfo Of(const Sequence& sequence, StorageTier tier) {
    return {tier,
            sequence.policy_config(),
            sequence.budget(),
            sequence.counts(),
            sequence.created(),
            sequence.last_used()};
  }
};

// Identity fields are immutable; the lease lives in atomics so the reaper can read it without
// waiting for a session that is busy compressing; everything else is guarded by `mu`.
class Session {
 public:
  Session(std::string id, const AttachParams& params, std::unique_ptr<Arena> arena,
          int32_t num_blocks, uint64_t charge, absl::Duration lease, absl::Time now,
          uint64_t staging_offset = 0)
      : id(std::move(id)),
        tenant(params.tenant),
        worker_name(params.worker_name),
        layout(params.layout),
        arena(std::move(arena)),
        num_blocks(num_blocks),
        block_bytes(params.layout.block_bytes()),
        staging_offset(staging_offset),
        staging_bytes(params.staging_bytes),
        charge(charge),
        lease(lease),
        attached(now),
        last_heartbeat_ns(absl::ToUnixNanos(now)),
        lease_expires_ns(absl::ToUnixNanos(now + lease)),
        free_blocks_hint(num_blocks),
        allocator(num_blocks) {}

  absl::Time last_heartbeat() const { return absl::FromUnixNanos(last_heartbeat_ns.load()); }
  absl::Time lease_expires() const { return absl::FromUnixNanos(lease_expires_ns.load()); }
  // What the session counts against the pool's capacity (whole pages).
  uint64_t charged_bytes() const { return charge; }
  // Arena bytes its sequences hold, from the hint (no lock, no waiting for a call in progress).
  uint64_t arena_bytes_in_use() const {
    const int32_t used = num_blocks - free_blocks_hint.load();
    return static_cast<uint64_t>(used > 0 ? used : 0) * block_bytes;
  }

  SessionView View() const {
    SessionView view;
    view.session_id = id;
    view.tenant = tenant;
    view.layout = layout;
    view.arena = arena->handle();
    view.num_blocks = num_blocks;
    view.block_bytes = block_bytes;
    view.staging_offset = staging_offset;
    view.staging_bytes = staging_bytes;
    view.lease = lease;
    view.lease_expires = lease_expires();
    return view;
  }

  // What a sequence of this session borrows for one call (Sequence's SequenceEnv). The counters
  // (lifetime totals of the pool) may be null for calls that append and evict nothing.
  SequenceEnv Env(Backend& backend, int32_t max_tokens_per_call,
                  std::atomic<int64_t>* tokens_appended = nullptr,
                  std::atomic<int64_t>* tokens_evicted = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    SequenceEnv env{layout,          *arena,         allocator, backend, id, max_tokens_per_call,
                    tokens_appended, tokens_evicted, &host_pin};
    env.staging_offset = staging_offset;
    env.staging_bytes = staging_bytes;
    return env;
  }

  const std::string id;
  const std::string tenant;
  const std::string worker_name;
  const ModelLayout layout;
  const std::unique_ptr<Arena> arena;
  const int32_t num_blocks;
  const uint64_t block_bytes;
  const uint64_t staging_offset;  // the query staging area, after the blocks
  const uint64_t staging_bytes;
  const uint64_t charge;
  const absl::Duration lease;
  const absl::Time attached;
  std::atomic<int64_t> last_heartbeat_ns;
  std::atomic<int64_t> lease_expires_ns;
  // Mirror of allocator.free_blocks(), refreshed at the end of every call under `mu`, so that
  // heartbeats can report it without waiting for a call in progress.
  std::atomic<int32_t> free_blocks_hint;

  absl::Mutex mu;
  BlockAllocator allocator ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<std::string, std::unique_ptr<Sequence>> sequences ABSL_GUARDED_BY(mu);
  // Sequences spilled out of the arena (KvPool::Spill) -> their tier and what Admin lists of them.
  // Their bytes live in PoolOptions::tiers under {tenant, id, sequence id}; they still count as
  // the session's.
  absl::flat_hash_map<std::string, SpilledSequenceInfo> spilled ABSL_GUARDED_BY(mu);
  // Stores / drops the pinned host-tier entries of this session's sequences (OmniKV's offloaded
  // prompt, retain_evicted chunks) under {tenant, id, ...}; empty without tiers. Set at Attach.
  HostPin host_pin;
  bool dead ABSL_GUARDED_BY(mu) = false;  // detached or reclaimed; holders of a stale pointer
  uint64_t next_reservation_id ABSL_GUARDED_BY(mu) = 1;
};

inline absl::Status SessionGone(std::string_view session_id) {
  return absl::NotFoundError(absl::StrCat("session ", Sv(session_id), " not found"));
}

inline absl::Status SequenceNotFound(std::string_view sequence_id, std::string_view session_id) {
  return absl::NotFoundError(
      absl::StrCat("sequence ", Sv(sequence_id), " not found in session ", Sv(session_id)));
}

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_INTERNAL_SESSION_H_
