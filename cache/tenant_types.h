// The value types of the pool's accounting: tenant quotas and usage (Admin.SetQuota, GetUsage),
// pool-wide statistics, per-policy token totals (metrics) and the outcome of a re-budget.
#ifndef KVSIDECAR_CACHE_TENANT_TYPES_H_
#define KVSIDECAR_CACHE_TENANT_TYPES_H_

#include <cstdint>
#include <string>
#include <vector>

namespace kvs {

struct PoolStats {
  int32_t sessions = 0;
  // Sequences of attached sessions, in the arena and spilled (as counted for tenants' quotas);
  // sequences_spilled of them are in the host or disk tier.
  int32_t sequences = 0;
  int32_t sequences_spilled = 0;
  uint64_t arena_bytes_capacity = 0;
  uint64_t arena_bytes_reserved = 0;  // sum of session arenas
  uint64_t arena_bytes_used = 0;      // blocks in use * block bytes
  int64_t tokens_appended = 0;
  int64_t tokens_evicted = 0;
  int64_t sessions_reclaimed = 0;   // by lease expiry or Reclaim()
  int64_t spilled_on_pressure = 0;  // sequences PoolOptions::spill_on_pressure moved out
};

// A tenant's limits (Admin.SetQuota); 0 = unlimited. arena_bytes bounds the arena blocks in use
// by the tenant's sequences (checked before every Reserve and DecodeStep: a tenant at or above
// it may not grow; and before every restore, explicit or automatic, with the copy's bytes);
// sequences bounds CreateSequence; host_bytes, disk_bytes and remote_bytes bound the spill
// tiers (checked through CheckTierQuota by whoever spills). remote_bytes counts the tenant's
// copies in the remote tier from every sidecar sharing it.
struct TenantQuota {
  uint64_t arena_bytes = 0;
  uint64_t host_bytes = 0;
  uint64_t disk_bytes = 0;
  int32_t sequences = 0;
  uint64_t remote_bytes = 0;
  bool unlimited() const {
    return arena_bytes == 0 && host_bytes == 0 && disk_bytes == 0 && sequences == 0 &&
           remote_bytes == 0;
  }
};

// What a tenant uses now. host_bytes/disk_bytes come from the tier-usage hook (0 without one).
struct TenantUsage {
  uint64_t arena_bytes = 0;           // blocks in use x block bytes
  uint64_t arena_bytes_reserved = 0;  // its sessions' arenas
  uint64_t host_bytes = 0;
  uint64_t disk_bytes = 0;
  int32_t sequences = 0;
  int32_t sessions = 0;
  // Only filled by TenantRemoteBytes' callers (it asks Redis): 0 in AllTenantUsage.
  uint64_t remote_bytes = 0;
};

// Layer-token totals of one policy over the pool's lifetime (live + released sequences), and
// what its live sequences hold now.
struct PolicyTokenTotals {
  std::string policy;
  int64_t appended = 0;
  int64_t evicted = 0;
  int64_t merged = 0;
  int64_t kept = 0;              // layer-tokens held now
  int32_t sequences = 0;         // live
  std::vector<int32_t> budgets;  // per live sequence: its budget tokens per layer (0 = unbounded)
};

struct RebudgetResult {
  int32_t rebudgeted = 0;            // sequences that got the budget (compressed when needed)
  std::vector<std::string> skipped;  // "session/sequence: reason"
};

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_TENANT_TYPES_H_
