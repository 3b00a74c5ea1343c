// PoolOptions: how a KvPool is built (capacity, leases, limits, defaults, tiers). Set once at
// start from the sidecar's configuration; the pool never changes them.
#ifndef KVSIDECAR_CACHE_POOL_OPTIONS_H_
#define KVSIDECAR_CACHE_POOL_OPTIONS_H_

#include <cstdint>

#include "absl/time/time.h"
#include "cache/policy/policy_config.h"
#include "cache/tier.h"
#include "gpu/arena.h"

namespace kvs {

struct PoolOptions {
  // Sum of all sessions' arenas may not exceed this.
  uint64_t arena_capacity_bytes = uint64_t{1} << 30;
  // Arena size of a session that asks for 0 blocks.
  uint64_t default_session_bytes = uint64_t{256} << 20;
  absl::Duration default_lease = absl::Seconds(10);
  absl::Duration min_lease = absl::Milliseconds(100);
  absl::Duration max_lease = absl::Minutes(10);
  // At most this many sessions, and per session at most
  // min(max_sequences_per_session, max(16, num_blocks)) sequences: each costs host memory for its
  // tables whether or not it holds tokens, so a tiny arena cannot pin unbounded metadata.
  int32_t max_sessions = 256;
  int32_t max_sequences_per_session = 4096;
  int32_t max_tokens_per_call = 1 << 20;  // num_tokens of one Reserve/Append
  // Threads that run the sequences of one DecodeStep side by side (each sequence's own steps
  // stay in order); <= 0 picks the hardware concurrency, 1 runs them on the caller.
  int32_t decode_threads = 0;
  ArenaOptions arena_options;
  PolicyConfig default_policy;  // for sequences created without a policy
  // Where Spill puts sequences (storage/tier_manager.h); must outlive the pool. Null = Spill and
  // Restore answer UNIMPLEMENTED.
  SequenceTiers* tiers = nullptr;
  // Device -> host demotion: when a Reserve finds its session's arena full, spill the session's
  // least recently used other sequences (none with a pending reservation) to the host tier (which
  // moves its oldest copies to disk when full) until the Reserve fits. Needs `tiers`.
  bool spill_on_pressure = false;
  BudgetConfig default_budget;  // tokens_per_layer 0 = unbounded
};

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_POOL_OPTIONS_H_
