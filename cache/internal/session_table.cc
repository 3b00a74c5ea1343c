#include "cache/internal/session_table.h"

#include <sys/random.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "gpu/base/checked_math.h"
#include "gpu/base/status_macros.h"

namespace kvs {
namespace {

constexpr size_t kMaxTenantLength = 256;
constexpr size_t kMaxWorkerNameLength = 256;
// Charged at page granularity: each arena is its own mapping, however few bytes it asks for.
constexpr uint64_t kPageBytes = 4096;

absl::Status CheckNames(const AttachParams& params) {
  if (params.tenant.size() > kMaxTenantLength) {
    return absl::InvalidArgumentError(absl::StrCat("tenant must be at most ", kMaxTenantLength,
                                                   " bytes, got ", params.tenant.size()));
  }
  if (params.worker_name.size() > kMaxWorkerNameLength) {
    return absl::InvalidArgumentError(absl::StrCat("worker_name must be at most ",
                                                   kMaxWorkerNameLength, " bytes, got ",
                                                   params.worker_name.size()));
  }
  return absl::OkStatus();
}

}  // namespace

// A session id is the only handle on a session (whoever holds it can use or end the session), so
// it comes from the kernel's CSPRNG rather than a statistical generator.
std::string SessionTable::NewSessionId() {
  constexpr int kBytes = 16;
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string raw(kBytes, '\0');
  ssize_t got = 0;
  while (got < kBytes) {
    const ssize_t n = getrandom(raw.data() + got, kBytes - got, 0);
    if (n > 0) got += n;
  }
  std::string out;
  out.reserve(2 * kBytes);
  for (unsigned char c : raw) {
    out.push_back(kDigits[c >> 4]);
    out.push_back(kDigits[c & 15]);
  }
  return out;
}

SessionTable::SessionTable(const Clock* clock, const PoolOptions* options)
    : clock_(clock), options_(options) {}

absl::StatusOr<AttachPlan> SessionTable::Plan(const AttachParams& params) const {
  AttachPlan plan;
  plan.params = params;
  AttachParams& resolved = plan.params;
  if (resolved.layout.block_tokens == 0) resolved.layout.block_tokens = kDefaultBlockTokens;
  KVS_RETURN_IF_ERROR(resolved.layout.Validate("layout."));
  if (resolved.tenant.empty()) resolved.tenant = "default";
  KVS_RETURN_IF_ERROR(CheckNames(resolved));
  const uint64_t block_bytes = resolved.layout.block_bytes();
  int64_t num_blocks = resolved.num_blocks;
  if (num_blocks < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_blocks must be >= 0, got ", resolved.num_blocks));
  }
  if (num_blocks == 0) {
    num_blocks = static_cast<int64_t>(std::min<uint64_t>(
        options_->default_session_bytes / block_bytes, std::numeric_limits<int32_t>::max()));
    num_blocks = std::max<int64_t>(num_blocks, 1);
  }
  const std::optional<uint64_t> blocks_bytes =
      CheckedProduct({num_blocks, static_cast<int64_t>(block_bytes)});
  if (!blocks_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_blocks ", num_blocks, " * block_bytes ", block_bytes, " overflows"));
  }
  if (resolved.staging_bytes > kMaxStagingBytes) {
    return absl::InvalidArgumentError(absl::StrCat("staging_bytes must be <= ", kMaxStagingBytes,
                                                   ", got ", resolved.staging_bytes));
  }
  // The staging area starts on a 256-byte boundary, where device kernels may read it.
  plan.staging_offset = (*blocks_bytes + 255) / 256 * 256;
  const std::optional<uint64_t> arena_bytes =
      CheckedAdd(plan.staging_offset, resolved.staging_bytes);
  if (!arena_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("num_blocks ", num_blocks, " is too large"));
  }
  plan.lease = resolved.lease;
  if (plan.lease == absl::ZeroDuration()) plan.lease = options_->default_lease;
  if (plan.lease < options_->min_lease || plan.lease > options_->max_lease) {
    return absl::InvalidArgumentError(
        absl::StrCat("lease_ms must be in [", absl::ToInt64Milliseconds(options_->min_lease), ", ",
                     absl::ToInt64Milliseconds(options_->max_lease), "], got ",
                     absl::ToInt64Milliseconds(resolved.lease)));
  }
  const std::optional<uint64_t> charged_bytes = CheckedAdd(*arena_bytes, kPageBytes - 1);
  if (!charged_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("num_blocks ", num_blocks, " is too large"));
  }
  plan.num_blocks = static_cast<int32_t>(num_blocks);
  plan.arena_bytes = *arena_bytes;
  plan.charge = *charged_bytes / kPageBytes * kPageBytes;
  return plan;
}

absl::Status SessionTable::Claim(const AttachPlan& plan) {
  absl::MutexLock lock(&mu_);
  if (sessions_.size() + sessions_pending_ >= static_cast<size_t>(options_->max_sessions)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the sidecar already serves ", sessions_.size(), " sessions, the most it may"));
  }
  const uint64_t capacity = options_->arena_capacity_bytes;
  const uint64_t free_bytes = capacity - std::min(arena_bytes_reserved_, capacity);
  if (plan.charge > free_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "pool has ", free_bytes, " of ", capacity, " arena bytes free, the session needs ",
        plan.charge, " (num_blocks ", plan.num_blocks, " * block_bytes ",
        plan.params.layout.block_bytes(), ", in whole pages)"));
  }
  arena_bytes_reserved_ += plan.charge;
  ++sessions_pending_;
  return absl::OkStatus();
}

void SessionTable::Unclaim(const AttachPlan& plan) {
  absl::MutexLock lock(&mu_);
  arena_bytes_reserved_ -= plan.charge;
  --sessions_pending_;
}

absl::Status SessionTable::Insert(std::shared_ptr<Session> session) {
  absl::MutexLock lock(&mu_);
  --sessions_pending_;
  const uint64_t charge = session->charged_bytes();
  if (!sessions_.emplace(session->id, std::move(session)).second) {
    // 2^-128; refuse rather than alias.
    arena_bytes_reserved_ -= charge;
    return absl::InternalError("session id collision; retry");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Session>> SessionTable::Find(std::string_view session_id) const {
  std::shared_ptr<Session> session;
  {
    absl::ReaderMutexLock lock(&mu_);
    auto it = sessions_.find(Sv(session_id));
    if (it == sessions_.end()) return SessionGone(session_id);
    session = it->second;
  }
  // A lapsed lease ends the session even before the reaper gets to it.
  if (session->lease_expires() <= clock_->Now()) {
    return absl::NotFoundError(
        absl::StrCat("session ", Sv(session_id), " not found (lease expired)"));
  }
  return session;
}

bool SessionTable::Contains(std::string_view session_id) const {
  absl::ReaderMutexLock lock(&mu_);
  return sessions_.contains(Sv(session_id));
}

absl::StatusOr<HeartbeatResult> SessionTable::Renew(std::string_view session_id) {
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, Find(session_id));
  return Renew(session);
}

absl::StatusOr<HeartbeatResult> SessionTable::Renew(const std::shared_ptr<Session>& session) {
  const std::string_view session_id = session->id;
  const absl::Time now = clock_->Now();
  const absl::Time expires = now + session->lease;
  session->last_heartbeat_ns = absl::ToUnixNanos(now);
  session->lease_expires_ns = absl::ToUnixNanos(expires);
  {
    // The reaper may have removed the session between the lookup and the renewal.
    absl::ReaderMutexLock lock(&mu_);
    auto it = sessions_.find(Sv(session_id));
    if (it == sessions_.end() || it->second != session) return SessionGone(session_id);
  }
  return HeartbeatResult{expires, session->free_blocks_hint.load()};
}

absl::StatusOr<std::shared_ptr<Session>> SessionTable::Remove(std::string_view session_id,
                                                              bool reclaimed) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(Sv(session_id));
  if (it == sessions_.end()) return SessionGone(session_id);
  return RemoveLocked(it, reclaimed);
}

absl::StatusOr<std::shared_ptr<Session>> SessionTable::Remove(
    const std::shared_ptr<Session>& session, bool reclaimed) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(Sv(session->id));
  if (it == sessions_.end() || it->second != session) return SessionGone(session->id);
  return RemoveLocked(it, reclaimed);
}

std::shared_ptr<Session> SessionTable::RemoveLocked(SessionMap::iterator it, bool reclaimed) {
  std::shared_ptr<Session> session = std::move(it->second);
  sessions_.erase(it);
  arena_bytes_reserved_ -= session->charged_bytes();
  if (reclaimed) ++sessions_reclaimed_;
  return session;
}

std::vector<std::shared_ptr<Session>> SessionTable::TakeExpired(absl::Time now) {
  std::vector<std::shared_ptr<Session>> expired;
  absl::MutexLock lock(&mu_);
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    if (it->second->lease_expires() <= now) {
      arena_bytes_reserved_ -= it->second->charged_bytes();
      expired.push_back(std::move(it->second));
      sessions_.erase(it++);
    } else {
      ++it;
    }
  }
  sessions_reclaimed_ += static_cast<int64_t>(expired.size());
  return expired;
}

std::vector<std::shared_ptr<Session>> SessionTable::TakeAll() {
  std::vector<std::shared_ptr<Session>> all;
  absl::MutexLock lock(&mu_);
  for (auto& [id, session] : sessions_) all.push_back(std::move(session));
  sessions_.clear();
  arena_bytes_reserved_ = 0;
  return all;
}

std::vector<std::shared_ptr<Session>> SessionTable::All() const {
  std::vector<std::shared_ptr<Session>> all;
  absl::ReaderMutexLock lock(&mu_);
  all.reserve(sessions_.size());
  for (const auto& [id, session] : sessions_) all.push_back(session);
  return all;
}

std::vector<std::shared_ptr<Session>> SessionTable::OfTenant(std::string_view tenant) const {
  std::vector<std::shared_ptr<Session>> of_tenant;
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& [id, session] : sessions_) {
    if (session->tenant == tenant) of_tenant.push_back(session);
  }
  return of_tenant;
}

void SessionTable::ForEach(const std::function<void(const Session&)>& fn) const {
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& [id, session] : sessions_) fn(*session);
}

SessionTable::Totals SessionTable::GetTotals() const {
  absl::ReaderMutexLock lock(&mu_);
  return Totals{static_cast<int32_t>(sessions_.size()), arena_bytes_reserved_,
                sessions_reclaimed_};
}

}  // namespace kvs
