// TenantLedger: every tenant's quotas and what it uses (arena bytes from its sessions, host and
// disk bytes from the tiers' usage hook, remote bytes from the remote tier's, its sequences), and
// the one place that admits or refuses growth against them: each Check* and AddSequence answers
// OK or RESOURCE_EXHAUSTED naming the tenant and the quota.
//
// Threading: thread-safe. Its lock is a leaf (nothing else is taken while it is held); the usage
// hooks run outside it, and arena usage is read from the session table without session locks.
#ifndef KVSIDECAR_CACHE_INTERNAL_TENANT_LEDGER_H_
#define KVSIDECAR_CACHE_INTERNAL_TENANT_LEDGER_H_

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "cache/internal/session_table.h"
#include "cache/tenant_types.h"
#include "cache/tier.h"

namespace kvs {

class TenantLedger {
 public:
  // `sessions` must outlive the ledger.
  explicit TenantLedger(const SessionTable* sessions);
  TenantLedger(const TenantLedger&) = delete;
  TenantLedger& operator=(const TenantLedger&) = delete;

  // Quotas (Admin.SetQuota): an unlimited quota removes the entry.
  void SetQuota(const std::string& tenant, const TenantQuota& quota);
  TenantQuota Quota(std::string_view tenant) const;                 // unlimited if none
  std::vector<std::pair<std::string, TenantQuota>> Quotas() const;  // sorted by tenant

  // Usage hooks, set once at start by whoever owns the tiers; null = 0.
  void SetTierUsageFn(std::function<uint64_t(std::string_view tenant, bool host)> fn);
  void SetRemoteUsageFn(std::function<uint64_t(std::string_view tenant)> fn);
  uint64_t RemoteBytes(std::string_view tenant) const;  // asks the remote tier
  // Every tenant that has a session, with its usage (remote_bytes 0), sorted by tenant.
  std::vector<std::pair<std::string, TenantUsage>> AllUsage() const;
  TenantUsage Usage(std::string_view tenant) const;

  // Admission. A tenant at or above its arena quota may not grow (Reserve, DecodeStep).
  absl::Status CheckArenaGrowth(const std::string& tenant) const;
  // Restoring `bytes` of `sequence_id` into the arena must keep `tenant` within its arena quota.
  absl::Status CheckRestore(const std::string& tenant, std::string_view sequence_id,
                            uint64_t bytes) const;
  // Storing `extra_bytes` more in the host (host=true) or disk tier, or in `tier`.
  absl::Status CheckTier(std::string_view tenant, bool host, uint64_t extra_bytes) const;
  absl::Status CheckTier(std::string_view tenant, StorageTier tier, uint64_t extra_bytes) const;
  // Counts one more sequence for `tenant` if below its quota.
  absl::Status AddSequence(const std::string& tenant);
  void RemoveSequences(const std::string& tenant, int32_t count);

 private:
  std::function<uint64_t(std::string_view, bool)> TierUsageFn() const;

  const SessionTable* const sessions_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, TenantQuota> quotas_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, int32_t> sequences_ ABSL_GUARDED_BY(mu_);
  std::function<uint64_t(std::string_view, bool)> tier_usage_fn_ ABSL_GUARDED_BY(mu_);
  std::function<uint64_t(std::string_view)> remote_usage_fn_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_INTERNAL_TENANT_LEDGER_H_
