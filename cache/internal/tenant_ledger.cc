#include "cache/internal/tenant_ledger.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace kvs {

TenantLedger::TenantLedger(const SessionTable* sessions) : sessions_(sessions) {}

void TenantLedger::SetQuota(const std::string& tenant, const TenantQuota& quota) {
  absl::MutexLock lock(&mu_);
  if (quota.unlimited()) {
    quotas_.erase(tenant);
  } else {
    quotas_[tenant] = quota;
  }
}

TenantQuota TenantLedger::Quota(std::string_view tenant) const {
  absl::MutexLock lock(&mu_);
  auto it = quotas_.find(Sv(tenant));
  return it == quotas_.end() ? TenantQuota{} : it->second;
}

std::vector<std::pair<std::string, TenantQuota>> TenantLedger::Quotas() const {
  std::vector<std::pair<std::string, TenantQuota>> result;
  {
    absl::MutexLock lock(&mu_);
    result.assign(quotas_.begin(), quotas_.end());
  }
  std::sort(result.begin(), result.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  return result;
}

void TenantLedger::SetTierUsageFn(std::function<uint64_t(std::string_view tenant, bool host)> fn) {
  absl::MutexLock lock(&mu_);
  tier_usage_fn_ = std::move(fn);
}

void TenantLedger::SetRemoteUsageFn(std::function<uint64_t(std::string_view tenant)> fn) {
  absl::MutexLock lock(&mu_);
  remote_usage_fn_ = std::move(fn);
}

std::function<uint64_t(std::string_view, bool)> TenantLedger::TierUsageFn() const {
  absl::MutexLock lock(&mu_);
  return tier_usage_fn_;
}

uint64_t TenantLedger::RemoteBytes(std::string_view tenant) const {
  std::function<uint64_t(std::string_view)> fn;
  {
    absl::MutexLock lock(&mu_);
    fn = remote_usage_fn_;
  }
  // Outside mu_: the hook asks Redis.
  return fn ? fn(tenant) : 0;
}

std::vector<std::pair<std::string, TenantUsage>> TenantLedger::AllUsage() const {
  absl::flat_hash_map<std::string, TenantUsage> usage;
  sessions_->ForEach([&usage](const Session& session) {
    TenantUsage& u = usage[session.tenant];
    ++u.sessions;
    u.arena_bytes_reserved += session.charged_bytes();
    u.arena_bytes += session.arena_bytes_in_use();
  });
  std::function<uint64_t(std::string_view, bool)> tier_usage;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [tenant, count] : sequences_) {
      if (count > 0) usage[tenant].sequences = count;
    }
    tier_usage = tier_usage_fn_;
  }
  std::vector<std::pair<std::string, TenantUsage>> result(usage.begin(), usage.end());
  for (auto& [tenant, u] : result) {
    if (tier_usage) {
      u.host_bytes = tier_usage(tenant, true);
      u.disk_bytes = tier_usage(tenant, false);
    }
  }
  std::sort(result.begin(), result.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  return result;
}

TenantUsage TenantLedger::Usage(std::string_view tenant) const {
  for (auto& [name, usage] : AllUsage()) {
    if (name == tenant) return usage;
  }
  TenantUsage none;
  if (std::function<uint64_t(std::string_view, bool)> tier_usage = TierUsageFn()) {
    none.host_bytes = tier_usage(tenant, true);
    none.disk_bytes = tier_usage(tenant, false);
  }
  return none;
}

absl::Status TenantLedger::CheckArenaGrowth(const std::string& tenant) const {
  uint64_t limit = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = quotas_.find(tenant);
    if (it == quotas_.end() || it->second.arena_bytes == 0) return absl::OkStatus();
    limit = it->second.arena_bytes;
  }
  uint64_t used = 0;
  sessions_->ForEach([&](const Session& session) {
    if (session.tenant == tenant) used += session.arena_bytes_in_use();
  });
  if (used < limit) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat("tenant ", tenant, " uses ", used,
                                                   " arena bytes, its quota arena_bytes is ", limit,
                                                   " (release or compress sequences first)"));
}

absl::Status TenantLedger::CheckRestore(const std::string& tenant, std::string_view sequence_id,
                                        uint64_t bytes) const {
  const uint64_t limit = Quota(tenant).arena_bytes;
  if (limit == 0) return absl::OkStatus();
  const uint64_t used = Usage(tenant).arena_bytes;
  if (used + bytes <= limit) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat("restoring sequence ", Sv(sequence_id), " needs up to ", bytes,
                   " arena bytes; tenant ", tenant, " uses ", used, " of its quota arena_bytes ",
                   limit, " (the spilled copy stays; release or spill sequences first)"));
}

absl::Status TenantLedger::CheckTier(std::string_view tenant, bool host,
                                     uint64_t extra_bytes) const {
  uint64_t limit = 0;
  std::function<uint64_t(std::string_view, bool)> tier_usage;
  {
    absl::MutexLock lock(&mu_);
    auto it = quotas_.find(Sv(tenant));
    if (it == quotas_.end()) return absl::OkStatus();
    limit = host ? it->second.host_bytes : it->second.disk_bytes;
    tier_usage = tier_usage_fn_;
  }
  if (limit == 0) return absl::OkStatus();
  // Outside mu_: the hook takes the tier manager's own lock.
  const uint64_t used = tier_usage ? tier_usage(tenant, host) : 0;
  if (used + extra_bytes <= limit) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat("tenant ", Sv(tenant), " holds ", used, " ",
                                                   host ? "host" : "disk", " tier bytes, ",
                                                   extra_bytes, " more would exceed its quota ",
                                                   host ? "host_bytes" : "disk_bytes", " ", limit));
}

absl::Status TenantLedger::CheckTier(std::string_view tenant, StorageTier tier,
                                     uint64_t extra_bytes) const {
  if (tier != StorageTier::kRemote) {
    return CheckTier(tenant, tier == StorageTier::kHost, extra_bytes);
  }
  uint64_t limit = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = quotas_.find(Sv(tenant));
    if (it == quotas_.end()) return absl::OkStatus();
    limit = it->second.remote_bytes;
  }
  if (limit == 0) return absl::OkStatus();
  const uint64_t used = RemoteBytes(tenant);
  if (used + extra_bytes <= limit) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "tenant ", Sv(tenant), " holds ", used, " remote tier bytes, ", extra_bytes,
      " more would exceed its quota remote_bytes ", limit));
}

absl::Status TenantLedger::AddSequence(const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  int32_t& count = sequences_[tenant];
  auto it = quotas_.find(tenant);
  if (it != quotas_.end() && it->second.sequences > 0 && count >= it->second.sequences) {
    const int32_t held = count;
    if (held == 0) sequences_.erase(tenant);
    return absl::ResourceExhaustedError(absl::StrCat("tenant ", tenant, " holds ", held,
                                                     " sequences, its quota sequences is ",
                                                     it->second.sequences));
  }
  ++count;
  return absl::OkStatus();
}

void TenantLedger::RemoveSequences(const std::string& tenant, int32_t count) {
  if (count <= 0) return;
  absl::MutexLock lock(&mu_);
  auto it = sequences_.find(tenant);
  if (it == sequences_.end()) return;
  it->second -= count;
  if (it->second <= 0) sequences_.erase(it);
}

}  // namespace kvs
