#include "cache/pool.h"

#include <sys/random.h>

#include <algorithm>
#include <limits>
#include <thread>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "cache/block_allocator.h"
#include "cache/policy/omnikv.h"
#include "cache/policy/policy.h"
#include "cache/sequence.h"
#include "cache/policy/registry.h"
#include "cache/sequence_snapshot.h"
#include "gpu/base/checked_math.h"
#include "gpu/base/status_macros.h"
#include "gpu/cpu/thread_pool.h"

namespace kvs {
namespace {
// Debian's Abseil is built with its own string_view type, distinct from std::string_view.
absl::string_view Sv(std::string_view s) { return absl::string_view(s.data(), s.size()); }

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
}  // namespace

// One attached worker: its arena cut into blocks, its sequences, its lease. Identity fields are
// immutable; the lease lives in atomics so the reaper can read it without waiting for a session
// that is busy compressing; everything else is guarded by `mu`.
class Session {
 public:
  Session(std::string id, const AttachParams& params, std::unique_ptr<Arena> arena,
          int32_t num_blocks, uint64_t charge, absl::Duration lease, absl::Time now)
      : id(std::move(id)),
        tenant(params.tenant),
        worker_name(params.worker_name),
        layout(params.layout),
        arena(std::move(arena)),
        num_blocks(num_blocks),
        block_bytes(params.layout.block_bytes()),
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

  SessionView View() const {
    SessionView view;
    view.session_id = id;
    view.tenant = tenant;
    view.layout = layout;
    view.arena = arena->handle();
    view.num_blocks = num_blocks;
    view.block_bytes = block_bytes;
    view.lease = lease;
    view.lease_expires = lease_expires();
    return view;
  }

  const std::string id;
  const std::string tenant;
  const std::string worker_name;
  const ModelLayout layout;
  const std::unique_ptr<Arena> arena;
  const int32_t num_blocks;
  const uint64_t block_bytes;
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
  // The tenant's arena quota check of a restore of `bytes` (CheckRestoreQuota); set at Attach.
  // Safe under `mu`: it reads the pool's session map and quotas, never a session lock.
  std::function<absl::Status(std::string_view sequence_id, uint64_t bytes)> restore_quota;
  bool dead ABSL_GUARDED_BY(mu) = false;  // detached or reclaimed; holders of a stale pointer
  uint64_t next_reservation_id ABSL_GUARDED_BY(mu) = 1;
};

namespace {

constexpr size_t kMaxSequenceIdLength = 128;
constexpr size_t kMaxTenantLength = 256;
constexpr size_t kMaxWorkerNameLength = 256;

constexpr int32_t kMinSequencesPerSession = 16;

// Restoring `bytes` of `sequence_id` into the arena must keep `tenant` within its arena quota.
absl::Status CheckRestoreQuota(const KvPool& pool, const std::string& tenant,
                               std::string_view sequence_id, uint64_t bytes) {
  const uint64_t limit = pool.GetTenantQuota(tenant).arena_bytes;
  if (limit == 0) return absl::OkStatus();
  const uint64_t used = pool.GetTenantUsage(tenant).arena_bytes;
  if (used + bytes <= limit) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat("restoring sequence ", Sv(sequence_id), " needs up to ", bytes,
                   " arena bytes; tenant ", tenant, " uses ", used, " of its quota arena_bytes ",
                   limit, " (the spilled copy stays; release or spill sequences first)"));
}

std::string RandomHex(int chars) {
  thread_local absl::BitGen gen;
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(chars, '0');
  for (char& c : out) c = kDigits[absl::Uniform<int>(gen, 0, 16)];
  return out;
}

// A session id is the only handle on a session (whoever holds it can use or end the session), so
// it comes from the kernel's CSPRNG rather than a statistical generator.
std::string SecureRandomHex(int bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string raw(bytes, '\0');
  ssize_t got = 0;
  while (got < bytes) {
    const ssize_t n = getrandom(raw.data() + got, bytes - got, 0);
    if (n > 0) got += n;
  }
  std::string out;
  out.reserve(2 * bytes);
  for (unsigned char c : raw) {
    out.push_back(kDigits[c >> 4]);
    out.push_back(kDigits[c & 15]);
  }
  return out;
}

bool IsSequenceIdChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == ':' || c == '-';
}

absl::Status ValidateSequenceId(std::string_view id) {
  bool ok = !id.empty() && id.size() <= kMaxSequenceIdLength;
  for (size_t i = 0; ok && i < id.size(); ++i) ok = IsSequenceIdChar(id[i]);
  if (ok) return absl::OkStatus();
  // Echo a bounded, printable prefix only.
  std::string shown;
  for (size_t i = 0; i < id.size() && i < 40; ++i) {
    shown.push_back(IsSequenceIdChar(id[i]) ? id[i] : '?');
  }
  return absl::InvalidArgumentError(
      absl::StrCat("sequence_id must match [A-Za-z0-9._:-]{1,", kMaxSequenceIdLength, "}, got \"",
                   shown, id.size() > 40 ? "..." : "", "\" (", id.size(), " bytes)"));
}

absl::Status SessionGone(std::string_view session_id) {
  return absl::NotFoundError(absl::StrCat("session ", Sv(session_id), " not found"));
}

// Brings spilled sequence `sequence_id` of `session` back into its arena (KvPool::Restore).
absl::Status RestoreSpilledLocked(Session& session, std::string_view sequence_id, Backend& backend,
                                  const PoolOptions& options)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(session.mu);

// Runs fn(sequence, env) under the session lock, or NOT_FOUND for a dead session or an unknown
// sequence; a spilled sequence is restored first. `clock` stamps the sequence's last use.
template <typename Fn>
auto WithSequence(Session& session, std::string_view sequence_id, Backend& backend,
                  const Clock& clock, const PoolOptions& options,
                  std::atomic<int64_t>* tokens_appended, std::atomic<int64_t>* tokens_evicted,
                  Fn&& fn)
    -> decltype(fn(std::declval<Sequence&>(), std::declval<const SequenceEnv&>(), session)) {
  absl::MutexLock lock(&session.mu);
  if (session.dead) return SessionGone(session.id);
  auto it = session.sequences.find(Sv(sequence_id));
  if (it == session.sequences.end() && session.spilled.contains(Sv(sequence_id))) {
    if (absl::Status restored = RestoreSpilledLocked(session, sequence_id, backend, options);
        !restored.ok()) {
      return restored;
    }
    it = session.sequences.find(Sv(sequence_id));
  }
  if (it == session.sequences.end()) {
    return absl::NotFoundError(
        absl::StrCat("sequence ", Sv(sequence_id), " not found in session ", session.id));
  }
  const SequenceEnv env{session.layout,  *session.arena, session.allocator,
                        backend,         session.id,     options.max_tokens_per_call,
                        tokens_appended, tokens_evicted, &session.host_pin};
  it->second->Touch(clock.Now());
  auto result = fn(*it->second, env, session);
  session.free_blocks_hint = session.allocator.free_blocks();
  return result;
}

}  // namespace

namespace {
int DecodeThreads(int32_t requested) {
  if (requested > 0) return requested;
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}
}  // namespace

KvPool::KvPool(Backend* backend, const Clock* clock, PoolOptions options)
    : backend_(backend),
      clock_(clock),
      options_(std::move(options)),
      decode_pool_(std::make_unique<ThreadPool>(DecodeThreads(options_.decode_threads))) {
  absl::MutexLock lock(&quota_mu_);
  live_default_policy_ = options_.default_policy;
  live_default_budget_ = options_.default_budget;
}

KvPool::~KvPool() {
  absl::flat_hash_map<std::string, std::shared_ptr<Session>> sessions;
  {
    absl::MutexLock lock(&mu_);
    sessions.swap(sessions_);
    arena_bytes_reserved_ = 0;
  }
  for (auto& [id, session] : sessions) DestroySession(session);
}

absl::StatusOr<std::shared_ptr<Session>> KvPool::FindSession(std::string_view session_id) const {
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

ReleaseCounts KvPool::DestroySession(std::shared_ptr<Session> session) {
  ReleaseCounts counts;
  absl::MutexLock lock(&session->mu);
  if (session->dead) return counts;
  session->dead = true;
  const SequenceEnv env{session->layout, *session->arena, session->allocator,
                        *backend_,       session->id,     options_.max_tokens_per_call};
  for (auto& [id, sequence] : session->sequences) {
    for (const SpillKey& pinned : sequence->pinned_host_keys()) {
      (void)session->host_pin(pinned, nullptr);
    }
    counts.blocks += sequence->Release(env);
    ++counts.sequences;
    RetireTotals(*sequence);
  }
  session->sequences.clear();
  // Host copies die with the session; disk copies stay, adoptable by another session of the
  // tenant (KvPool::Restore with from_session_id). The tiers may have demoted a host copy to
  // disk since: ask them where it is.
  for (const auto& [id, tier] : session->spilled) {
    if (options_.tiers != nullptr) {
      const SpillKey key{session->tenant, session->id, id};
      std::optional<SpilledInfo> info = options_.tiers->Find(key);
      if (info && info->tier == StorageTier::kHost) (void)options_.tiers->Erase(key);
    }
    ++counts.sequences;
  }
  session->spilled.clear();
  RemoveTenantSequences(session->tenant, counts.sequences);
  return counts;
}

absl::StatusOr<SessionView> KvPool::Attach(const AttachParams& params) {
  AttachParams resolved = params;
  if (resolved.layout.block_tokens == 0) resolved.layout.block_tokens = kDefaultBlockTokens;
  KVS_RETURN_IF_ERROR(resolved.layout.Validate("layout."));
  if (resolved.tenant.empty()) resolved.tenant = "default";
  if (resolved.tenant.size() > kMaxTenantLength) {
    return absl::InvalidArgumentError(absl::StrCat("tenant must be at most ", kMaxTenantLength,
                                                   " bytes, got ", resolved.tenant.size()));
  }
  if (resolved.worker_name.size() > kMaxWorkerNameLength) {
    return absl::InvalidArgumentError(absl::StrCat("worker_name must be at most ",
                                                   kMaxWorkerNameLength, " bytes, got ",
                                                   resolved.worker_name.size()));
  }
  const uint64_t block_bytes = resolved.layout.block_bytes();
  int64_t num_blocks = resolved.num_blocks;
  if (num_blocks < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_blocks must be >= 0, got ", resolved.num_blocks));
  }
  if (num_blocks == 0) {
    num_blocks = static_cast<int64_t>(std::min<uint64_t>(
        options_.default_session_bytes / block_bytes, std::numeric_limits<int32_t>::max()));
    num_blocks = std::max<int64_t>(num_blocks, 1);
  }
  const std::optional<uint64_t> arena_bytes =
      CheckedProduct({num_blocks, static_cast<int64_t>(block_bytes)});
  if (!arena_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_blocks ", num_blocks, " * block_bytes ", block_bytes, " overflows"));
  }
  absl::Duration lease = resolved.lease;
  if (lease == absl::ZeroDuration()) lease = options_.default_lease;
  if (lease < options_.min_lease || lease > options_.max_lease) {
    return absl::InvalidArgumentError(
        absl::StrCat("lease_ms must be in [", absl::ToInt64Milliseconds(options_.min_lease), ", ",
                     absl::ToInt64Milliseconds(options_.max_lease), "], got ",
                     absl::ToInt64Milliseconds(resolved.lease)));
  }

  // Charged at page granularity: each arena is its own mapping, however few bytes it asks for.
  constexpr uint64_t kPageBytes = 4096;
  const std::optional<uint64_t> charged_bytes = CheckedAdd(*arena_bytes, kPageBytes - 1);
  if (!charged_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("num_blocks ", num_blocks, " is too large"));
  }
  const uint64_t charge = *charged_bytes / kPageBytes * kPageBytes;

  // Claim the capacity first, create the arena and the session without the lock (both cost time
  // proportional to their size), give the claim back on failure.
  {
    absl::MutexLock lock(&mu_);
    if (sessions_.size() + sessions_pending_ >= static_cast<size_t>(options_.max_sessions)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the sidecar already serves ", sessions_.size(), " sessions, the most it may"));
    }
    const uint64_t free_bytes = options_.arena_capacity_bytes -
                                std::min(arena_bytes_reserved_, options_.arena_capacity_bytes);
    if (charge > free_bytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("pool has ", free_bytes, " of ", options_.arena_capacity_bytes,
                       " arena bytes free, the session needs ", charge, " (num_blocks ", num_blocks,
                       " * block_bytes ", block_bytes, ", in whole pages)"));
    }
    arena_bytes_reserved_ += charge;
    ++sessions_pending_;
  }
  auto give_back = [&] {
    absl::MutexLock lock(&mu_);
    arena_bytes_reserved_ -= charge;
    --sessions_pending_;
  };
  absl::StatusOr<std::unique_ptr<Arena>> arena =
      backend_->CreateArena(*arena_bytes, options_.arena_options);
  if (!arena.ok()) {
    give_back();
    return arena.status();
  }
  auto session =
      std::make_shared<Session>(SecureRandomHex(16), resolved, *std::move(arena),
                                static_cast<int32_t>(num_blocks), charge, lease, clock_->Now());
  session->restore_quota = [this, tenant = session->tenant](std::string_view sequence_id,
                                                            uint64_t bytes) {
    return CheckRestoreQuota(*this, tenant, sequence_id, bytes);
  };
  if (options_.tiers != nullptr) {
    session->host_pin = [this, tenant = session->tenant, id = session->id](
                            const SpillKey& key,
                            std::shared_ptr<const SpilledSequence> data) -> absl::Status {
      const SpillKey full{tenant, id, key.sequence_id};
      if (data == nullptr) return options_.tiers->Erase(full);
      KVS_RETURN_IF_ERROR(CheckTierQuota(tenant, /*host=*/true, data->bytes()));
      return options_.tiers->PutPinnedHost(full, std::move(data));
    };
  }
  absl::MutexLock lock(&mu_);
  --sessions_pending_;
  if (!sessions_.emplace(session->id, session).second) {  // 2^-128; refuse rather than alias
    arena_bytes_reserved_ -= charge;
    return absl::InternalError("session id collision; retry");
  }
  return session->View();
}

absl::StatusOr<HeartbeatResult> KvPool::Heartbeat(std::string_view session_id) {
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, FindSession(session_id));
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

absl::StatusOr<ReleaseCounts> KvPool::Detach(std::string_view session_id) {
  return RemoveSession(session_id, /*reclaimed=*/false);
}

absl::StatusOr<ReleaseCounts> KvPool::RemoveSession(std::string_view session_id, bool reclaimed) {
  std::shared_ptr<Session> session;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(Sv(session_id));
    if (it == sessions_.end()) return SessionGone(session_id);
    session = std::move(it->second);
    sessions_.erase(it);
    arena_bytes_reserved_ -= session->charged_bytes();
    if (reclaimed) ++sessions_reclaimed_;
  }
  return DestroySession(std::move(session));
}

int KvPool::ReapExpired() {
  std::vector<std::shared_ptr<Session>> expired;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = clock_->Now();
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
  }
  for (std::shared_ptr<Session>& session : expired) DestroySession(std::move(session));
  return static_cast<int>(expired.size());
}

absl::StatusOr<ReleaseCounts> KvPool::Reclaim(std::string_view session_id) {
  return RemoveSession(session_id, /*reclaimed=*/true);
}

absl::StatusOr<SessionView> KvPool::GetSession(std::string_view session_id) const {
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, FindSession(session_id));
  return session->View();
}

absl::StatusOr<int> KvPool::DuplicateArenaFd(std::string_view session_id) const {
  // The shared pointer keeps the arena (and its descriptor) alive while it is duplicated, even if
  // the session is detached at the same moment.
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, FindSession(session_id));
  return session->arena->DuplicateFd();
}

absl::StatusOr<SequenceCreated> KvPool::CreateSequence(std::string_view session_id,
                                                       const SequenceParams& params) {
  if (!params.from_prefix.empty()) return CreateFromPrefix(session_id, params);
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, FindSession(session_id));
  if (params.retain_evicted && options_.tiers == nullptr) {
    return absl::FailedPreconditionError(
        "retain_evicted needs the host tier, which this pool was built without");
  }
  PolicyConfig policy_config = params.policy.value_or(default_policy());
  const bool omnikv = CapabilitiesOf(policy_config).never_evicts;
  if (omnikv) {
    if (params.retain_evicted) {
      return absl::InvalidArgumentError(
          "retain_evicted does not apply to policy omnikv, which never evicts");
    }
    // Filter layers: the policy's, else the paper's for this depth of model (omnikv.md §5).
    if (policy_config.omnikv.filter_layers.empty()) {
      policy_config.omnikv.filter_layers = DefaultOmniKvFilterLayers(session->layout.num_layers);
    }
    if (policy_config.omnikv.filter_layers.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "policy.omnikv.filter_layers is required: no default is known for a model of ",
          session->layout.num_layers, " layers (defaults exist for 32, 48 and 80)"));
    }
    KVS_RETURN_IF_ERROR(
        PlanOmniKvLayers(policy_config.omnikv, session->layout.num_layers).status());
    if (policy_config.omnikv.offload && options_.tiers == nullptr) {
      return absl::FailedPreconditionError(
          "policy.omnikv.offload needs the host tier, which this pool was built without");
    }
    if (params.budget.has_value() &&
        (params.budget->tokens_per_layer != 0 || !params.budget->per_layer_tokens.empty())) {
      return absl::InvalidArgumentError(
          "budget must be unset for policy omnikv, which never evicts (Select bounds what the "
          "sparse layers attend to)");
    }
  }
  KVS_ASSIGN_OR_RETURN(std::unique_ptr<Policy> policy, MakePolicy(policy_config));

  BudgetConfig budget = omnikv ? BudgetConfig{} : params.budget.value_or(default_budget());
  const int64_t per_layer_capacity =
      int64_t{session->num_blocks / session->layout.num_layers} * session->layout.block_tokens;
  if (budget.tokens_per_layer < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("budget.tokens_per_layer must be >= 1, got ", budget.tokens_per_layer));
  }
  if (budget.tokens_per_layer > per_layer_capacity) {
    return absl::InvalidArgumentError(absl::StrCat(
        "budget.tokens_per_layer must be <= ", per_layer_capacity,
        " (the tokens per layer the session's arena holds), got ", budget.tokens_per_layer));
  }
  if (budget.prefill_block_tokens == 0)
    budget.prefill_block_tokens = BudgetConfig{}.prefill_block_tokens;
  if (budget.prefill_block_tokens < 1 ||
      budget.prefill_block_tokens > options_.max_tokens_per_call) {
    return absl::InvalidArgumentError(absl::StrCat("budget.prefill_block_tokens must be in [1, ",
                                                   options_.max_tokens_per_call, "], got ",
                                                   budget.prefill_block_tokens));
  }
  if (budget.strict) {
    if (budget.tokens_per_layer == 0) {
      return absl::InvalidArgumentError(
          "budget.tokens_per_layer must be >= 1 for a strict budget, got 0");
    }
    if (int64_t{budget.tokens_per_layer} + budget.prefill_block_tokens > per_layer_capacity) {
      return absl::InvalidArgumentError(absl::StrCat(
          "budget.prefill_block_tokens ", budget.prefill_block_tokens,
          " + budget.tokens_per_layer ", budget.tokens_per_layer,
          " must be <= ", per_layer_capacity, " (the tokens per layer the session's arena holds)"));
    }
  }
  if (!budget.per_layer_tokens.empty()) {
    if (budget.per_layer_tokens.size() != static_cast<size_t>(session->layout.num_layers)) {
      return absl::InvalidArgumentError(
          absl::StrCat("budget.per_layer_tokens has ", budget.per_layer_tokens.size(),
                       " entries, the model has ", session->layout.num_layers, " layers"));
    }
    for (size_t l = 0; l < budget.per_layer_tokens.size(); ++l) {
      const int32_t tokens = budget.per_layer_tokens[l];
      if (tokens < 1 || tokens > per_layer_capacity) {
        return absl::InvalidArgumentError(absl::StrCat("budget.per_layer_tokens[", l,
                                                       "] must be in [1, ", per_layer_capacity,
                                                       "], got ", tokens));
      }
    }
  }
  if (!params.layer_windows.empty()) {
    if (omnikv) {
      return absl::InvalidArgumentError(
          "layer_windows does not apply to policy omnikv, which never evicts");
    }
    if (params.layer_windows.size() != static_cast<size_t>(session->layout.num_layers)) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer_windows has ", params.layer_windows.size(), " entries, the model has ",
                       session->layout.num_layers, " layers"));
    }
    for (size_t l = 0; l < params.layer_windows.size(); ++l) {
      if (params.layer_windows[l] < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "layer_windows[", l, "] must be >= 0 (0 = no window), got ", params.layer_windows[l]));
      }
    }
  }
  if (!params.sequence_id.empty()) KVS_RETURN_IF_ERROR(ValidateSequenceId(params.sequence_id));

  absl::MutexLock lock(&session->mu);
  KVS_ASSIGN_OR_RETURN(const std::string id,
                       AdmitSequenceLocked(*session, session_id, params.sequence_id));
  SequenceCreated created;
  created.sequence_id = id;
  created.policy = policy->config();
  created.budget = budget;
  auto sequence =
      std::make_unique<Sequence>(id, session->layout, std::move(policy), budget, clock_->Now());
  sequence->set_retain_evicted(params.retain_evicted);
  // All zeros is no window at all: the sequence then runs exactly as one without.
  if (std::any_of(params.layer_windows.begin(), params.layer_windows.end(),
                  [](int32_t w) { return w > 0; })) {
    sequence->set_layer_windows(params.layer_windows);
  }
  session->sequences.emplace(id, std::move(sequence));
  return created;
}

absl::StatusOr<ReleaseCounts> KvPool::ReleaseSequence(std::string_view session_id,
                                                      std::string_view sequence_id) {
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, FindSession(session_id));
  absl::MutexLock lock(&session->mu);
  if (session->dead) return SessionGone(session_id);
  auto it = session->sequences.find(Sv(sequence_id));
  if (it == session->sequences.end() && session->spilled.contains(Sv(sequence_id))) {
    // A spilled sequence: drop its copy in the tiers; it held no blocks.
    if (options_.tiers != nullptr) {
      KVS_RETURN_IF_ERROR(
          options_.tiers->Erase(SpillKey{session->tenant, session->id, std::string(sequence_id)}));
    }
    session->spilled.erase(Sv(sequence_id));
    RemoveTenantSequences(session->tenant, 1);
    return ReleaseCounts{1, 0};
  }
  if (it == session->sequences.end()) {
    return absl::NotFoundError(
        absl::StrCat("sequence ", Sv(sequence_id), " not found in session ", Sv(session_id)));
  }
  const SequenceEnv env{session->layout, *session->arena, session->allocator,
                        *backend_,       session->id,     options_.max_tokens_per_call};
  ReleaseCounts counts;
  counts.sequences = 1;
  for (const SpillKey& pinned : it->second->pinned_host_keys()) {
    (void)session->host_pin(pinned, nullptr);
  }
  counts.blocks = it->second->Release(env);
  RetireTotals(*it->second);
  session->sequences.erase(it);
  RemoveTenantSequences(session->tenant, 1);
  return counts;
}

absl::StatusOr<Reservation> KvPool::Reserve(std::string_view session_id,
                                            std::string_view sequence_id, int32_t num_tokens,
                                            absl::Span<const int32_t> positions,
                                            absl::Span<const int32_t> layers) {
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, FindSession(session_id));
  KVS_RETURN_IF_ERROR(CheckArenaQuota(session->tenant));
  return WithSequence(
      *session, sequence_id, *backend_, *clock_, options_, &tokens_appended_, &tokens_evicted_,
      [&](Sequence& sequence, const SequenceEnv& env,
          Session& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) -> absl::StatusOr<Reservation> {
        absl::StatusOr<Reservation> reservation =
            sequence.Reserve(env, s.next_reservation_id, num_tokens, positions, layers);
        // Arena full: demote the session's least recently used other sequences to the host
        // tier, one at a time, until the reservation fits (PoolOptions::spill_on_pressure).
        while (!reservation.ok() &&
               reservation.status().code() == absl::StatusCode::kResourceExhausted &&
               options_.spill_on_pressure && options_.tiers != nullptr) {
          Sequence* victim = nullptr;
          for (auto& [id, other] : s.sequences) {
            if (other.get() == &sequence || other->has_pending() || other->blocks_held() == 0 ||
                !other->spillable()) {
              continue;
            }
            if (victim == nullptr || other->last_used() < victim->last_used()) {
              victim = other.get();
            }
          }
          if (victim == nullptr) break;
          absl::StatusOr<SpilledSequence> data = victim->Spill(env);
          if (!data.ok()) break;
          const SpillKey key{s.tenant, s.id, victim->id()};
          if (!CheckTierQuota(s.tenant, /*host=*/true, data->bytes()).ok() ||
              !options_.tiers->Put(StorageTier::kHost, key, *std::move(data)).ok()) {
            break;
          }
          s.spilled[key.sequence_id] = SpilledSequenceInfo::Of(*victim, StorageTier::kHost);
          victim->Release(env);
          s.sequences.erase(key.sequence_id);
          ++spilled_on_pressure_;
          reservation = sequence.Reserve(env, s.next_reservation_id, num_tokens, positions, layers);
        }
        if (reservation.ok()) ++s.next_reservation_id;
        return reservation;
      });
}

absl::Status KvPool::CancelReservation(std::string_view session_id, std::string_view sequence_id,
                                       uint64_t reservation_id) {
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, FindSession(session_id));
  return WithSequence(*session, sequence_id, *backend_, *clock_, options_, &tokens_appended_,
                      &tokens_evicted_, [&](Sequence& sequence, const SequenceEnv& env, Session&) {
                        return sequence.Cancel(env, reservation_id);
                      });
}

absl::Status KvPool::CheckReservation(std::string_view session_id, std::string_view sequence_id,
                                      uint64_t reservation_id) const {
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, FindSession(session_id));
  return WithSequence(*session, sequence_id, *backend_, *clock_, options_, nullptr, nullptr,
                      [&](Sequence& sequence, const SequenceEnv&, Session&) {
                        return sequence.CheckPending(reservation_id);
                      });
}

absl::Status KvPool::WriteReserved(std::string_view session_id, std::string_view sequence_id,
                                   uint64_t reservation_id, uint64_t payload_offset,
                                   absl::Span<const uint8_t> bytes) {
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, FindSession(session_id));
  return WithSequence(*session, sequence_id, *backend_, *clock_, options_, &tokens_appended_,
                      &tokens_evicted_, [&](Sequence& sequence, const SequenceEnv& env, Session&) {
                        return sequence.WriteReserved(env, reservation_id, payload_offset, bytes);
                      });
}

absl::StatusOr<CommitResult> KvPool::Commit(std::string_view session_id,
                                            std::string_view sequence_id, uint64_t reservation_id,
                                            bool compress_if_over_budget,
                                            const AttentionInput* attention) {
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, FindSession(session_id));
  return WithSequence(*session, sequence_id, *backend_, *clock_, options_, &tokens_appended_,
                      &tokens_evicted_, [&](Sequence& sequence, const SequenceEnv& env, Session&) {
                        return sequence.Commit(env, reservation_id, compress_if_over_budget,
                                               attention);
                      });
}

CommitBatchResult KvPool::CommitBatch(absl::Span<const CommitItem> items) {
  CommitBatchResult out;
  auto fail = [&out](size_t i, const absl::Status& status) {
    out.failed = static_cast<int32_t>(i);
    out.status = status;
  };
  // The batch's sessions, each looked up once (a decode batch names one session many times).
  std::vector<std::shared_ptr<Session>> sessions;
  std::vector<size_t> session_of(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    size_t k = 0;
    while (k < sessions.size() && sessions[k]->id != items[i].session_id) ++k;
    if (k == sessions.size()) {
      absl::StatusOr<std::shared_ptr<Session>> session = FindSession(items[i].session_id);
      if (!session.ok()) {
        fail(i, session.status());
        return out;
      }
      sessions.push_back(*std::move(session));
    }
    session_of[i] = k;
  }
  // Locked together, in id order as DecodeStep does, so that what is checked is what commits.
  std::vector<size_t> lock_order(sessions.size());
  for (size_t k = 0; k < lock_order.size(); ++k) lock_order[k] = k;
  std::sort(lock_order.begin(), lock_order.end(),
            [&](size_t a, size_t b) { return sessions[a]->id < sessions[b]->id; });
  for (size_t k : lock_order) sessions[k]->mu.Lock();

  // 1. Every item's sequence (restored first when spilled) and pending reservation.
  std::vector<Sequence*> sequences(items.size(), nullptr);
  for (size_t i = 0; i < items.size() && out.status.ok(); ++i) {
    Session& session = *sessions[session_of[i]];
    session.mu.AssertHeld();
    absl::Status status;
    if (session.dead) {
      status = SessionGone(session.id);
    } else if (!session.sequences.contains(Sv(items[i].sequence_id)) &&
               session.spilled.contains(Sv(items[i].sequence_id))) {
      status = RestoreSpilledLocked(session, items[i].sequence_id, *backend_, options_);
    }
    auto it = session.sequences.find(Sv(items[i].sequence_id));
    if (status.ok() && it == session.sequences.end()) {
      status = absl::NotFoundError(absl::StrCat("sequence ", Sv(items[i].sequence_id),
                                                " not found in session ", session.id));
    }
    if (status.ok()) {
      sequences[i] = it->second.get();
      for (size_t j = 0; j < i && status.ok(); ++j) {
        if (sequences[j] == sequences[i]) {
          status = absl::InvalidArgumentError(absl::StrCat(
              "sequence ", Sv(items[i].sequence_id), " is already committed by item ", j));
        }
      }
    }
    if (status.ok()) status = sequences[i]->CheckPending(items[i].reservation_id);
    if (!status.ok()) fail(i, status);
  }

  // 2. Commit them in order.
  const absl::Time now = clock_->Now();
  out.results.reserve(items.size());
  for (size_t i = 0; i < items.size() && out.status.ok(); ++i) {
    Session& session = *sessions[session_of[i]];
    session.mu.AssertHeld();
    const SequenceEnv env{session.layout,    *session.arena,   session.allocator,
                          *backend_,         session.id,       options_.max_tokens_per_call,
                          &tokens_appended_, &tokens_evicted_, &session.host_pin};
    sequences[i]->Touch(now);
    absl::StatusOr<CommitResult> result =
        sequences[i]->Commit(env, items[i].reservation_id, items[i].compress_if_over_budget,
                             items[i].attention);
    if (!result.ok()) {
      fail(i, result.status());
    } else {
      out.results.push_back(*std::move(result));
    }
  }

  for (auto it = lock_order.rbegin(); it != lock_order.rend(); ++it) {
    Session& session = *sessions[*it];
    session.mu.AssertHeld();
    session.free_blocks_hint = session.allocator.free_blocks();
    session.mu.Unlock();
  }
  return out;
}

absl::StatusOr<CompressResult> KvPool::Compress(std::string_view session_id,
                                                std::string_view sequence_id,
                                                const CompressParams& params) {
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, FindSession(session_id));
  return WithSequence(*session, sequence_id, *backend_, *clock_, options_, &tokens_appended_,
                      &tokens_evicted_, [&](Sequence& sequence, const SequenceEnv& env, Session&) {
                        return sequence.Compress(env, params);
                      });
}

absl::StatusOr<SequenceLayout> KvPool::GetLayout(std::string_view session_id,
                                                 std::string_view sequence_id,
                                                 absl::Span<const int32_t> layers,
                                                 bool with_positions) const {
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, FindSession(session_id));
  return WithSequence(*session, sequence_id, *backend_, *clock_, options_, nullptr, nullptr,
                      [&](Sequence& sequence, const SequenceEnv& env, Session&) {
                        return sequence.GetLayout(env, layers, with_positions);
                      });
}

absl::Status KvPool::ReadExport(std::string_view session_id, std::string_view sequence_id,
                                absl::Span<const int32_t> layers, uint64_t version,
                                uint64_t payload_offset, absl::Span<uint8_t> out) const {
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, FindSession(session_id));
  return WithSequence(*session, sequence_id, *backend_, *clock_, options_, nullptr, nullptr,
                      [&](Sequence& sequence, const SequenceEnv& env, Session&) {
                        return sequence.ReadExport(env, layers, version, payload_offset, out);
                      });
}

PoolStats KvPool::GetStats() const {
  PoolStats stats;
  std::vector<std::shared_ptr<Session>> sessions;
  {
    absl::ReaderMutexLock lock(&mu_);
    stats.sessions = static_cast<int32_t>(sessions_.size());
    stats.arena_bytes_capacity = options_.arena_capacity_bytes;
    stats.arena_bytes_reserved = arena_bytes_reserved_;
    stats.sessions_reclaimed = sessions_reclaimed_;
    for (const auto& [id, session] : sessions_) sessions.push_back(session);
  }
  for (const std::shared_ptr<Session>& session : sessions) {
    absl::MutexLock lock(&session->mu);
    if (session->dead) continue;
    stats.sequences +=
        static_cast<int32_t>(session->sequences.size() + session->spilled.size());
    stats.sequences_spilled += static_cast<int32_t>(session->spilled.size());
    stats.arena_bytes_used +=
        static_cast<uint64_t>(session->allocator.used_blocks()) * session->block_bytes;
  }
  stats.tokens_appended = tokens_appended_.load();
  stats.tokens_evicted = tokens_evicted_.load();
  stats.spilled_on_pressure = spilled_on_pressure_.load();
  return stats;
}

std::vector<SessionInfo> KvPool::ListSessions() const {
  std::vector<std::shared_ptr<Session>> sessions;
  {
    absl::ReaderMutexLock lock(&mu_);
    for (const auto& [id, session] : sessions_) sessions.push_back(session);
  }
  std::vector<SessionInfo> result;
  result.reserve(sessions.size());
  for (const std::shared_ptr<Session>& session : sessions) {
    SessionInfo info;
    info.session_id = session->id;
    info.tenant = session->tenant;
    info.worker_name = session->worker_name;
    info.layout = session->layout;
    info.num_blocks = session->num_blocks;
    info.attached = session->attached;
    info.last_heartbeat = session->last_heartbeat();
    info.lease_expires = session->lease_expires();
    {
      absl::MutexLock lock(&session->mu);
      if (session->dead) continue;
      info.free_blocks = session->allocator.free_blocks();
      info.sequences = static_cast<int32_t>(session->sequences.size() + session->spilled.size());
      info.sequences_spilled = static_cast<int32_t>(session->spilled.size());
    }
    result.push_back(std::move(info));
  }
  std::sort(result.begin(), result.end(), [](const SessionInfo& a, const SessionInfo& b) {
    return a.attached != b.attached ? a.attached < b.attached : a.session_id < b.session_id;
  });
  return result;
}

std::vector<SequenceInfo> KvPool::ListSequences(std::string_view session_id) const {
  std::vector<std::shared_ptr<Session>> sessions;
  {
    absl::ReaderMutexLock lock(&mu_);
    if (session_id.empty()) {
      for (const auto& [id, session] : sessions_) sessions.push_back(session);
    } else if (auto it = sessions_.find(Sv(session_id)); it != sessions_.end()) {
      sessions.push_back(it->second);
    }
  }
  std::vector<SequenceInfo> result;
  for (const std::shared_ptr<Session>& session : sessions) {
    absl::MutexLock lock(&session->mu);
    if (session->dead) continue;
    for (const auto& [id, sequence] : session->sequences) {
      SequenceInfo info;
      info.session_id = session->id;
      info.sequence_id = id;
      info.tenant = session->tenant;
      info.policy = sequence->policy_config();
      info.budget = sequence->budget();
      info.tokens_per_layer = sequence->counts();
      info.arena_bytes = static_cast<uint64_t>(sequence->blocks_held()) * session->block_bytes;
      info.host_bytes = sequence->host_bytes();
      info.created = sequence->created();
      info.last_used = sequence->last_used();
      result.push_back(std::move(info));
    }
    for (const auto& [id, spilled_info] : session->spilled) {
      SequenceInfo info;
      info.session_id = session->id;
      info.sequence_id = id;
      info.tenant = session->tenant;
      // Policy, budget and kept tokens as they were when it left the arena (a spilled sequence
      // does not change until it is restored).
      info.policy = spilled_info.policy;
      info.budget = spilled_info.budget;
      info.tokens_per_layer = spilled_info.tokens_per_layer;
      info.tier = spilled_info.tier;
      info.created = spilled_info.created;
      info.last_used = spilled_info.last_used;
      if (options_.tiers != nullptr) {
        if (std::optional<SpilledInfo> spilled =
                options_.tiers->Find(SpillKey{session->tenant, session->id, id})) {
          info.tier = spilled->tier;  // the tiers may have demoted it since
          if (spilled->tier != StorageTier::kRemote) {
            (spilled->tier == StorageTier::kHost ? info.host_bytes : info.disk_bytes) =
                spilled->bytes;
          }
          info.last_used = spilled->spilled;
        }
      }
      result.push_back(std::move(info));
    }
  }
  std::sort(result.begin(), result.end(), [](const SequenceInfo& a, const SequenceInfo& b) {
    return std::tie(a.session_id, a.sequence_id) < std::tie(b.session_id, b.sequence_id);
  });
  return result;
}

}  // namespace kvs

namespace kvs {

absl::StatusOr<std::vector<DecodeResult>> KvPool::DecodeStep(absl::Span<const DecodeItem> items) {
  // Sessions of the batch, each once; locked together (in id order, so two batches never wait
  // on each other) so that every item is validated against exactly the state it then runs on.
  std::vector<std::shared_ptr<Session>> sessions;
  std::vector<size_t> session_of(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    absl::StatusOr<std::shared_ptr<Session>> session = FindSession(items[i].session_id);
    if (!session.ok()) {
      return absl::Status(session.status().code(),
                          absl::StrCat("items[", i, "]: ", session.status().message()));
    }
    auto it = std::find(sessions.begin(), sessions.end(), *session);
    session_of[i] = static_cast<size_t>(it - sessions.begin());
    if (it == sessions.end()) sessions.push_back(*std::move(session));
  }
  // Tenant arena quotas, before any lock: a tenant at its quota may not grow.
  for (size_t i = 0; i < items.size(); ++i) {
    if (items[i].inline_kv.empty()) continue;  // commits of reservations already counted
    if (absl::Status quota = CheckArenaQuota(sessions[session_of[i]]->tenant); !quota.ok()) {
      return absl::Status(quota.code(), absl::StrCat("items[", i, "]: ", quota.message()));
    }
  }
  std::vector<size_t> lock_order(sessions.size());
  for (size_t k = 0; k < lock_order.size(); ++k) lock_order[k] = k;
  std::sort(lock_order.begin(), lock_order.end(),
            [&](size_t a, size_t b) { return sessions[a]->id < sessions[b]->id; });
  for (size_t k : lock_order) sessions[k]->mu.Lock();
  auto unlock_all = [&] {
    for (auto it = lock_order.rbegin(); it != lock_order.rend(); ++it) {
      Session& session = *sessions[*it];
      session.mu.AssertHeld();
      session.free_blocks_hint = session.allocator.free_blocks();
      session.mu.Unlock();
    }
  };
  auto env_of = [&](Session& session) ABSL_EXCLUSIVE_LOCKS_REQUIRED(session.mu) {
    return SequenceEnv{session.layout,    *session.arena,   session.allocator,
                       *backend_,         session.id,       options_.max_tokens_per_call,
                       &tokens_appended_, &tokens_evicted_, &session.host_pin};
  };

  // 1. Validate every item; nothing changes.
  std::vector<Sequence*> sequences(items.size(), nullptr);
  for (size_t i = 0; i < items.size(); ++i) {
    Session& session = *sessions[session_of[i]];
    session.mu.AssertHeld();
    absl::Status status;
    if (!session.dead && !session.sequences.contains(Sv(items[i].sequence_id)) &&
        session.spilled.contains(Sv(items[i].sequence_id))) {
      status = RestoreSpilledLocked(session, items[i].sequence_id, *backend_, options_);
    }
    if (!status.ok()) {
      // The spilled sequence could not be restored: its error, below.
    } else if (session.dead) {
      status = SessionGone(session.id);
    } else if (auto it = session.sequences.find(Sv(items[i].sequence_id));
               it == session.sequences.end()) {
      status = absl::NotFoundError(absl::StrCat("sequence ", Sv(items[i].sequence_id),
                                                " not found in session ", session.id));
    } else {
      sequences[i] = it->second.get();
      for (size_t j = 0; j < i && status.ok(); ++j) {
        if (sequences[j] == sequences[i]) {
          status = absl::InvalidArgumentError(absl::StrCat(
              "sequence ", items[i].sequence_id, " is already stepped by items[", j, "]"));
        }
      }
      if (status.ok()) status = sequences[i]->CheckDecode(env_of(session), items[i]);
    }
    if (!status.ok()) {
      unlock_all();
      return absl::Status(status.code(), absl::StrCat("items[", i, "]: ", status.message()));
    }
  }

  // 2. Run them. Items are distinct sequences, so they share nothing but their session's block
  // allocator (thread-safe) and arena (disjoint blocks); reservation ids and last-use times are
  // handed out here, in item order, so that they do not depend on the schedule.
  std::vector<SequenceEnv> envs;
  envs.reserve(sessions.size());
  for (const std::shared_ptr<Session>& session : sessions) {
    session->mu.AssertHeld();
    envs.push_back(env_of(*session));
  }
  std::vector<uint64_t> reservation_ids(items.size());
  const absl::Time now = clock_->Now();
  for (size_t i = 0; i < items.size(); ++i) {
    Session& session = *sessions[session_of[i]];
    session.mu.AssertHeld();
    sequences[i]->Touch(now);
    reservation_ids[i] = session.next_reservation_id;
    if (!items[i].inline_kv.empty()) ++session.next_reservation_id;
  }
  std::vector<DecodeResult> results(items.size());
  std::vector<absl::Status> statuses(items.size());
  decode_pool_->ParallelFor(static_cast<int64_t>(items.size()), [&](int64_t i) {
    absl::StatusOr<DecodeResult> result =
        sequences[i]->Decode(envs[session_of[i]], items[i], reservation_ids[i]);
    if (result.ok()) {
      results[i] = *std::move(result);
    } else {
      statuses[i] = std::move(result).status();
    }
  });
  absl::Status failure;
  for (size_t i = 0; i < items.size() && failure.ok(); ++i) {
    if (!statuses[i].ok()) {
      failure =
          absl::Status(statuses[i].code(), absl::StrCat("items[", i, "]: ", statuses[i].message()));
    }
  }
  unlock_all();
  if (!failure.ok()) return failure;
  return results;
}

absl::StatusOr<std::vector<SelectResult>> KvPool::Select(absl::Span<const SelectItem> items) {
  // Sessions of the call, each once, locked together in id order (as DecodeStep) so that every
  // item is checked against exactly the state it then runs on.
  std::vector<std::shared_ptr<Session>> sessions;
  std::vector<size_t> session_of(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    absl::StatusOr<std::shared_ptr<Session>> session = FindSession(items[i].session_id);
    if (!session.ok()) {
      return absl::Status(session.status().code(),
                          absl::StrCat("items[", i, "]: ", session.status().message()));
    }
    auto it = std::find(sessions.begin(), sessions.end(), *session);
    session_of[i] = static_cast<size_t>(it - sessions.begin());
    if (it == sessions.end()) sessions.push_back(*std::move(session));
  }
  std::vector<size_t> lock_order(sessions.size());
  for (size_t k = 0; k < lock_order.size(); ++k) lock_order[k] = k;
  std::sort(lock_order.begin(), lock_order.end(),
            [&](size_t a, size_t b) { return sessions[a]->id < sessions[b]->id; });
  for (size_t k : lock_order) sessions[k]->mu.Lock();
  auto unlock_all = [&] {
    for (auto it = lock_order.rbegin(); it != lock_order.rend(); ++it) {
      Session& session = *sessions[*it];
      session.mu.AssertHeld();
      session.free_blocks_hint = session.allocator.free_blocks();
      session.mu.Unlock();
    }
  };
  std::vector<SequenceEnv> envs;
  envs.reserve(sessions.size());
  for (const std::shared_ptr<Session>& session : sessions) {
    session->mu.AssertHeld();
    envs.push_back(SequenceEnv{session->layout, *session->arena, session->allocator, *backend_,
                               session->id, options_.max_tokens_per_call, &tokens_appended_,
                               &tokens_evicted_, &session->host_pin});
  }

  // 1. Validation first: a bad item changes nothing.
  std::vector<SelectTask> tasks(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    Session& session = *sessions[session_of[i]];
    session.mu.AssertHeld();
    const std::string_view id = items[i].sequence_id;
    absl::Status status;
    if (!session.dead && !session.sequences.contains(Sv(id)) && session.spilled.contains(Sv(id))) {
      status = RestoreSpilledLocked(session, id, *backend_, options_);
    }
    if (!status.ok()) {
      // The spilled sequence could not be restored: its error, below.
    } else if (session.dead) {
      status = SessionGone(session.id);
    } else if (auto it = session.sequences.find(Sv(id)); it == session.sequences.end()) {
      status = absl::NotFoundError(
          absl::StrCat("sequence ", Sv(id), " not found in session ", session.id));
    } else {
      tasks[i].sequence = it->second.get();
      for (size_t j = 0; j < i && status.ok(); ++j) {
        if (tasks[j].sequence == tasks[i].sequence) {
          status = absl::InvalidArgumentError(
              absl::StrCat("sequence ", Sv(id), " is already selected by items[", j, "]"));
        }
      }
      if (status.ok()) status = tasks[i].sequence->CheckSelect(envs[session_of[i]], items[i]);
    }
    if (!status.ok()) {
      unlock_all();
      return absl::Status(status.code(), absl::StrCat("items[", i, "]: ", status.message()));
    }
    tasks[i].env = &envs[session_of[i]];
    tasks[i].item = &items[i];
    tasks[i].pin = &session.host_pin;
  }

  // 2. Run them side by side (RunSelects): the results are those of running them in order.
  const absl::Time now = clock_->Now();
  for (SelectTask& task : tasks) task.sequence->Touch(now);
  absl::StatusOr<std::vector<SelectResult>> results =
      RunSelects(absl::MakeSpan(tasks), *decode_pool_);
  unlock_all();
  return results;
}

absl::StatusOr<std::vector<RetainedHead>> KvPool::GetRetained(std::string_view session_id,
                                                              std::string_view sequence_id,
                                                              absl::Span<const int32_t> layers) {
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, FindSession(session_id));
  return WithSequence(
      *session, sequence_id, *backend_, *clock_, options_, nullptr, nullptr,
      [&](Sequence& sequence, const SequenceEnv&, Session&) { return sequence.Retained(layers); });
}

absl::StatusOr<std::vector<LayerScores>> KvPool::Score(std::string_view session_id,
                                                       std::string_view sequence_id,
                                                       const ScoreParams& params) {
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, FindSession(session_id));
  return WithSequence(*session, sequence_id, *backend_, *clock_, options_, nullptr, nullptr,
                      [&](Sequence& sequence, const SequenceEnv& env, Session&) {
                        return sequence.Score(env, params);
                      });
}

// Live defaults, quotas, re-budget (Admin).

void KvPool::SetDefaults(std::optional<PolicyConfig> policy, std::optional<BudgetConfig> budget) {
  absl::MutexLock lock(&quota_mu_);
  if (policy) live_default_policy_ = *std::move(policy);
  if (budget) live_default_budget_ = *std::move(budget);
}

PolicyConfig KvPool::default_policy() const {
  absl::MutexLock lock(&quota_mu_);
  return live_default_policy_;
}

BudgetConfig KvPool::default_budget() const {
  absl::MutexLock lock(&quota_mu_);
  return live_default_budget_;
}

void KvPool::SetTenantQuota(const std::string& tenant, const TenantQuota& quota) {
  absl::MutexLock lock(&quota_mu_);
  if (quota.unlimited()) {
    quotas_.erase(tenant);
  } else {
    quotas_[tenant] = quota;
  }
}

TenantQuota KvPool::GetTenantQuota(std::string_view tenant) const {
  absl::MutexLock lock(&quota_mu_);
  auto it = quotas_.find(Sv(tenant));
  return it == quotas_.end() ? TenantQuota{} : it->second;
}

std::vector<std::pair<std::string, TenantQuota>> KvPool::TenantQuotas() const {
  std::vector<std::pair<std::string, TenantQuota>> result;
  {
    absl::MutexLock lock(&quota_mu_);
    result.assign(quotas_.begin(), quotas_.end());
  }
  std::sort(result.begin(), result.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  return result;
}

void KvPool::SetTierUsageFn(std::function<uint64_t(std::string_view tenant, bool host)> fn) {
  absl::MutexLock lock(&quota_mu_);
  tier_usage_fn_ = std::move(fn);
}

std::vector<std::pair<std::string, TenantUsage>> KvPool::AllTenantUsage() const {
  absl::flat_hash_map<std::string, TenantUsage> usage;
  {
    absl::ReaderMutexLock lock(&mu_);
    for (const auto& [id, session] : sessions_) {
      TenantUsage& u = usage[session->tenant];
      ++u.sessions;
      u.arena_bytes_reserved += session->charged_bytes();
      // The hint is refreshed at the end of every call: no session lock, no waiting.
      const int32_t used = session->num_blocks - session->free_blocks_hint.load();
      u.arena_bytes += static_cast<uint64_t>(std::max(used, 0)) * session->block_bytes;
    }
  }
  std::function<uint64_t(std::string_view, bool)> tier_usage;
  {
    absl::MutexLock lock(&quota_mu_);
    for (const auto& [tenant, count] : tenant_sequences_) {
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

TenantUsage KvPool::GetTenantUsage(std::string_view tenant) const {
  for (auto& [name, usage] : AllTenantUsage()) {
    if (name == tenant) return usage;
  }
  TenantUsage none;
  std::function<uint64_t(std::string_view, bool)> tier_usage;
  {
    absl::MutexLock lock(&quota_mu_);
    tier_usage = tier_usage_fn_;
  }
  if (tier_usage) {
    none.host_bytes = tier_usage(tenant, true);
    none.disk_bytes = tier_usage(tenant, false);
  }
  return none;
}

absl::Status KvPool::CheckArenaQuota(const std::string& tenant) const {
  uint64_t limit = 0;
  {
    absl::MutexLock lock(&quota_mu_);
    auto it = quotas_.find(tenant);
    if (it == quotas_.end() || it->second.arena_bytes == 0) return absl::OkStatus();
    limit = it->second.arena_bytes;
  }
  uint64_t used = 0;
  {
    absl::ReaderMutexLock lock(&mu_);
    for (const auto& [id, session] : sessions_) {
      if (session->tenant != tenant) continue;
      const int32_t blocks = session->num_blocks - session->free_blocks_hint.load();
      used += static_cast<uint64_t>(std::max(blocks, 0)) * session->block_bytes;
    }
  }
  if (used < limit) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat("tenant ", tenant, " uses ", used,
                                                   " arena bytes, its quota arena_bytes is ", limit,
                                                   " (release or compress sequences first)"));
}

absl::Status KvPool::CheckTierQuota(std::string_view tenant, bool host,
                                    uint64_t extra_bytes) const {
  uint64_t limit = 0;
  std::function<uint64_t(std::string_view, bool)> tier_usage;
  {
    absl::MutexLock lock(&quota_mu_);
    auto it = quotas_.find(Sv(tenant));
    if (it == quotas_.end()) return absl::OkStatus();
    limit = host ? it->second.host_bytes : it->second.disk_bytes;
    tier_usage = tier_usage_fn_;
  }
  if (limit == 0) return absl::OkStatus();
  // Outside quota_mu_: the hook takes the tier manager's own lock.
  const uint64_t used = tier_usage ? tier_usage(tenant, host) : 0;
  if (used + extra_bytes <= limit) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat("tenant ", Sv(tenant), " holds ", used, " ",
                                                   host ? "host" : "disk", " tier bytes, ",
                                                   extra_bytes, " more would exceed its quota ",
                                                   host ? "host_bytes" : "disk_bytes", " ", limit));
}

absl::Status KvPool::CheckTierQuota(std::string_view tenant, StorageTier tier,
                                    uint64_t extra_bytes) const {
  if (tier != StorageTier::kRemote) {
    return CheckTierQuota(tenant, tier == StorageTier::kHost, extra_bytes);
  }
  uint64_t limit = 0;
  {
    absl::MutexLock lock(&quota_mu_);
    auto it = quotas_.find(Sv(tenant));
    if (it == quotas_.end()) return absl::OkStatus();
    limit = it->second.remote_bytes;
  }
  if (limit == 0) return absl::OkStatus();
  const uint64_t used = TenantRemoteBytes(tenant);
  if (used + extra_bytes <= limit) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "tenant ", Sv(tenant), " holds ", used, " remote tier bytes, ", extra_bytes,
      " more would exceed its quota remote_bytes ", limit));
}

void KvPool::SetRemoteUsageFn(std::function<uint64_t(std::string_view tenant)> fn) {
  absl::MutexLock lock(&quota_mu_);
  remote_usage_fn_ = std::move(fn);
}

uint64_t KvPool::TenantRemoteBytes(std::string_view tenant) const {
  std::function<uint64_t(std::string_view)> fn;
  {
    absl::MutexLock lock(&quota_mu_);
    fn = remote_usage_fn_;
  }
  // Outside quota_mu_: the hook asks Redis.
  return fn ? fn(tenant) : 0;
}

absl::StatusOr<std::string> KvPool::AdmitSequenceLocked(Session& session,
                                                        std::string_view session_id,
                                                        const std::string& requested) {
  if (session.dead) return SessionGone(session_id);
  if (!requested.empty() &&
      (session.sequences.contains(requested) || session.spilled.contains(requested))) {
    return absl::AlreadyExistsError(
        absl::StrCat("sequence_id ", requested, " already exists in session ", Sv(session_id)));
  }
  const int32_t max_sequences = std::min(options_.max_sequences_per_session,
                                         std::max(kMinSequencesPerSession, session.num_blocks));
  if (session.sequences.size() >= static_cast<size_t>(max_sequences)) {
    return absl::ResourceExhaustedError(absl::StrCat("session ", Sv(session_id), " already holds ",
                                                     session.sequences.size(),
                                                     " sequences, the most it may"));
  }
  KVS_RETURN_IF_ERROR(AddTenantSequence(session.tenant));
  std::string id = requested;
  while (id.empty() || session.sequences.contains(id)) id = RandomHex(16);
  return id;
}

absl::Status KvPool::AddTenantSequence(const std::string& tenant) {
  absl::MutexLock lock(&quota_mu_);
  int32_t& count = tenant_sequences_[tenant];
  auto it = quotas_.find(tenant);
  if (it != quotas_.end() && it->second.sequences > 0 && count >= it->second.sequences) {
    const int32_t held = count;
    if (held == 0) tenant_sequences_.erase(tenant);
    return absl::ResourceExhaustedError(absl::StrCat("tenant ", tenant, " holds ", held,
                                                     " sequences, its quota sequences is ",
                                                     it->second.sequences));
  }
  ++count;
  return absl::OkStatus();
}

void KvPool::RemoveTenantSequences(const std::string& tenant, int32_t count) {
  if (count <= 0) return;
  absl::MutexLock lock(&quota_mu_);
  auto it = tenant_sequences_.find(tenant);
  if (it == tenant_sequences_.end()) return;
  it->second -= count;
  if (it->second <= 0) tenant_sequences_.erase(it);
}

RebudgetResult KvPool::RebudgetTenant(std::string_view tenant, int32_t tokens_per_layer) {
  std::vector<std::shared_ptr<Session>> sessions;
  {
    absl::ReaderMutexLock lock(&mu_);
    for (const auto& [id, session] : sessions_) {
      if (tenant == "*" || session->tenant == tenant) sessions.push_back(session);
    }
  }
  std::sort(sessions.begin(), sessions.end(),
            [](const auto& a, const auto& b) { return a->id < b->id; });
  RebudgetResult result;
  for (const std::shared_ptr<Session>& session : sessions) {
    absl::MutexLock lock(&session->mu);
    if (session->dead) continue;
    const int64_t per_layer_capacity =
        int64_t{session->num_blocks / session->layout.num_layers} * session->layout.block_tokens;
    const SequenceEnv env{session->layout,   *session->arena,  session->allocator,
                          *backend_,         session->id,      options_.max_tokens_per_call,
                          &tokens_appended_, &tokens_evicted_, &session->host_pin};
    std::vector<std::string> ids;
    for (const auto& [id, sequence] : session->sequences) ids.push_back(id);
    std::sort(ids.begin(), ids.end());
    for (const std::string& id : ids) {
      Sequence& sequence = *session->sequences.at(id);
      const std::string name = absl::StrCat(session->id, "/", id, ": ");
      BudgetConfig budget = sequence.budget();
      budget.tokens_per_layer = tokens_per_layer;
      budget.per_layer_tokens.clear();
      const int64_t needed = budget.strict ? int64_t{tokens_per_layer} + budget.prefill_block_tokens
                                           : int64_t{tokens_per_layer};
      if (needed > per_layer_capacity) {
        result.skipped.push_back(absl::StrCat(name, "the session's arena holds ",
                                              per_layer_capacity, " tokens per layer, the budget ",
                                              "needs ", needed));
        continue;
      }
      if (sequence.has_pending()) {
        result.skipped.push_back(absl::StrCat(name, "a reservation is pending"));
        continue;
      }
      const BudgetConfig old = sequence.budget();
      sequence.set_budget(budget);
      absl::StatusOr<CompressResult> compressed = sequence.Compress(env, CompressParams{});
      if (!compressed.ok()) {
        // Attention policies over budget: they keep the new budget and compress at their next
        // step (Commit/DecodeStep bring the queries); anything else is rolled back.
        // (INVALID_ARGUMENT names the missing attention; the sequence is unchanged by it).
        if (compressed.status().code() != absl::StatusCode::kInvalidArgument) {
          sequence.set_budget(old);
        }
        result.skipped.push_back(absl::StrCat(name, compressed.status().message()));
        continue;
      }
      ++result.rebudgeted;
    }
    session->free_blocks_hint = session->allocator.free_blocks();
  }
  return result;
}

}  // namespace kvs

// Tiers: Spill, Restore, automatic restore.

namespace kvs {
namespace {

absl::Status NoTiers() {
  return absl::UnimplementedError(
      "Spill and Restore need storage tiers, which this pool was built without");
}

SequenceEnv EnvOf(Session& session, Backend& backend, const PoolOptions& options)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(session.mu) {
  return SequenceEnv{session.layout, *session.arena, session.allocator,
                     backend,        session.id,     options.max_tokens_per_call};
}

// Restores `key`'s copy into `session` as sequence `sequence_id`; the copy is deleted once the
// sequence is in the arena (a failed deletion only leaves a stale copy a later Restore would
// refuse as ALREADY_EXISTS, never a wrong sequence).
absl::Status RestoreKeyLocked(Session& session, const SpillKey& key, Backend& backend,
                              const PoolOptions& options)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(session.mu) {
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<const SpilledSequence> data, options.tiers->Get(key));
  const SequenceEnv env = EnvOf(session, backend, options);
  absl::StatusOr<std::unique_ptr<Sequence>> restored = Sequence::Restore(env, *data);
  if (!restored.ok()) {
    // The copy stays: give up the claim a remote Get took, for a later restore.
    options.tiers->Release(key);
    return restored.status();
  }
  std::unique_ptr<Sequence> sequence = *std::move(restored);
  if (sequence->id() != key.sequence_id) {
    sequence->Release(env);
    options.tiers->Release(key);
    return absl::DataLossError(absl::StrCat("the spilled copy of sequence ", key.sequence_id,
                                            " holds sequence ", sequence->id()));
  }
  session.sequences.emplace(key.sequence_id, std::move(sequence));
  session.free_blocks_hint = session.allocator.free_blocks();
  (void)options.tiers->Erase(key);
  return absl::OkStatus();
}

}  // namespace

namespace {
absl::Status RestoreSpilledLocked(Session& session, std::string_view sequence_id, Backend& backend,
                                  const PoolOptions& options) {
  if (options.tiers == nullptr) return NoTiers();
  const SpillKey key{session.tenant, session.id, std::string(sequence_id)};
  // The automatic restore of a data-plane call is held to the tenant's arena quota too.
  if (const std::optional<SpilledInfo> copy = options.tiers->Find(key);
      copy && copy->lost.empty() && session.restore_quota) {
    KVS_RETURN_IF_ERROR(session.restore_quota(sequence_id, copy->bytes));
  }
  KVS_RETURN_IF_ERROR(RestoreKeyLocked(session, key, backend, options));
  session.spilled.erase(Sv(sequence_id));
  return absl::OkStatus();
}
}  // namespace

absl::StatusOr<SpillResult> KvPool::Spill(std::string_view session_id, std::string_view sequence_id,
                                          StorageTier target) {
  if (options_.tiers == nullptr) return NoTiers();
  if (target != StorageTier::kHost && target != StorageTier::kDisk &&
      target != StorageTier::kRemote) {
    return absl::InvalidArgumentError(absl::StrCat(
        "target must be TIER_HOST, TIER_DISK or TIER_REMOTE, got ", static_cast<int>(target)));
  }
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, FindSession(session_id));
  absl::MutexLock lock(&session->mu);
  if (session->dead) return SessionGone(session_id);
  const SpillKey key{session->tenant, session->id, std::string(sequence_id)};
  if (auto spilled = session->spilled.find(Sv(sequence_id)); spilled != session->spilled.end()) {
    // Already spilled: move it between the tiers (Put replaces the other tier's copy).
    if (target == StorageTier::kRemote && spilled->second.tier == StorageTier::kRemote) {
      // Already there: no need to read (and claim) the whole copy back to say so.
      if (const std::optional<SpilledInfo> info = options_.tiers->Find(key);
          info && info->lost.empty() && info->tier == StorageTier::kRemote) {
        return SpillResult{target, info->bytes};
      }
    }
    KVS_ASSIGN_OR_RETURN(std::shared_ptr<const SpilledSequence> data, options_.tiers->Get(key));
    const uint64_t bytes = data->bytes();
    if (spilled->second.tier != target) {
      if (absl::Status quota = CheckTierQuota(session->tenant, target, bytes); !quota.ok()) {
        options_.tiers->Release(key);
        return quota;
      }
      if (absl::Status put = options_.tiers->Put(target, key, SpilledSequence(*data));
          !put.ok()) {
        options_.tiers->Release(key);
        return put;
      }
      spilled->second.tier = target;
    } else {
      options_.tiers->Release(key);  // nothing moves: give up a remote claim Get took
    }
    return SpillResult{target, bytes};
  }
  auto it = session->sequences.find(Sv(sequence_id));
  if (it == session->sequences.end()) {
    return absl::NotFoundError(
        absl::StrCat("sequence ", Sv(sequence_id), " not found in session ", session->id));
  }
  const SequenceEnv env = EnvOf(*session, *backend_, options_);
  if (!it->second->spillable()) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", Sv(sequence_id),
                     " is an OmniKV sequence that has selected: its cache spans "
                     "the arena, its staging blocks and the host tier, and cannot be spilled"));
  }
  KVS_ASSIGN_OR_RETURN(SpilledSequence data, it->second->Spill(env));
  const uint64_t bytes = data.bytes();
  KVS_RETURN_IF_ERROR(CheckTierQuota(session->tenant, target, bytes));
  KVS_RETURN_IF_ERROR(options_.tiers->Put(target, key, std::move(data)));
  session->spilled[key.sequence_id] = SpilledSequenceInfo::Of(*it->second, target);
  it->second->Release(env);
  session->sequences.erase(it);
  session->free_blocks_hint = session->allocator.free_blocks();
  return SpillResult{target, bytes};
}

namespace {
// Releases an adoption claim (KvPool::adopting_) when the Restore that took it returns.
class AdoptionClaim {
 public:
  AdoptionClaim(absl::Mutex* mu, absl::flat_hash_map<SpillKey, std::string>* claims, SpillKey key)
      : mu_(mu), claims_(claims), key_(std::move(key)) {}
  AdoptionClaim(const AdoptionClaim&) = delete;
  AdoptionClaim& operator=(const AdoptionClaim&) = delete;
  ~AdoptionClaim() {
    absl::MutexLock lock(mu_);
    claims_->erase(key_);
  }

 private:
  absl::Mutex* const mu_;
  absl::flat_hash_map<SpillKey, std::string>* const claims_;
  const SpillKey key_;
};
}  // namespace

absl::StatusOr<SpillResult> KvPool::Restore(std::string_view session_id,
                                            std::string_view sequence_id,
                                            std::string_view from_session_id) {
  if (options_.tiers == nullptr) return NoTiers();
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, FindSession(session_id));
  const bool adopt = !from_session_id.empty() && from_session_id != session_id;
  if (adopt) {
    absl::ReaderMutexLock lock(&mu_);
    if (sessions_.contains(Sv(from_session_id))) {
      return absl::FailedPreconditionError(
          absl::StrCat("session ", Sv(from_session_id),
                       " is still attached: restore its sequences through it "
                       "(from_session_id is for sequences whose session ended)"));
    }
  }
  if (from_session_id == kPrefixSessionId) {
    return absl::InvalidArgumentError(
        "from_session_id: published prefixes are started from with CreateSequence(from_prefix), "
        "not restored");
  }
  const SpillKey key{session->tenant, std::string(adopt ? from_session_id : session_id),
                     std::string(sequence_id)};
  // The tenant's arena quota, before anything moves (and before the session lock: usage takes
  // the pool lock): RESOURCE_EXHAUSTED naming it, the copy stays.
  if (const std::optional<SpilledInfo> pending = options_.tiers->Find(key);
      pending && pending->lost.empty()) {
    KVS_RETURN_IF_ERROR(CheckRestoreQuota(*this, session->tenant, sequence_id, pending->bytes));
  }
  // One adoption of a copy at a time: the first claims it until its restore ends (the copy is
  // erased then, so later ones find nothing); a concurrent one is ABORTED.
  std::optional<AdoptionClaim> claim;
  if (adopt) {
    absl::MutexLock claim_lock(&adopt_mu_);
    if (auto other = adopting_.find(key); other != adopting_.end()) {
      return absl::AbortedError(absl::StrCat(
          "the spilled copy of sequence ", Sv(sequence_id), " of session ", Sv(from_session_id),
          " is being adopted by session ", other->second, "; only one session can adopt it"));
    }
    adopting_.emplace(key, session->id);
    claim.emplace(&adopt_mu_, &adopting_, key);
  }
  absl::MutexLock lock(&session->mu);
  if (session->dead) return SessionGone(session_id);
  if (!adopt) {
    if (session->sequences.contains(Sv(sequence_id))) return SpillResult{StorageTier::kArena, 0};
    auto spilled = session->spilled.find(Sv(sequence_id));
    if (spilled == session->spilled.end()) {
      return absl::NotFoundError(
          absl::StrCat("sequence ", Sv(sequence_id), " not found in session ", session->id));
    }
    const std::optional<SpilledInfo> info = options_.tiers->Find(key);
    const SpillResult result{info ? info->tier : spilled->second.tier, info ? info->bytes : 0};
    KVS_RETURN_IF_ERROR(RestoreSpilledLocked(*session, sequence_id, *backend_, options_));
    return result;
  }
  const std::optional<SpilledInfo> info = options_.tiers->Find(key);
  if (!info) {
    return absl::NotFoundError(absl::StrCat("no spilled copy of sequence ", Sv(sequence_id),
                                            " of session ", Sv(from_session_id), " for tenant ",
                                            session->tenant));
  }
  if (session->sequences.contains(Sv(sequence_id)) || session->spilled.contains(Sv(sequence_id))) {
    return absl::AlreadyExistsError(
        absl::StrCat("sequence_id ", Sv(sequence_id), " already exists in session ", session->id));
  }
  KVS_RETURN_IF_ERROR(AddTenantSequence(session->tenant));
  if (absl::Status status = RestoreKeyLocked(*session, key, *backend_, options_); !status.ok()) {
    RemoveTenantSequences(session->tenant, 1);
    return status;
  }
  return SpillResult{info->tier, info->bytes};
}

// ---- Compressed prefix reuse ----

absl::Status ValidatePrefixKey(std::string_view prefix_key, std::string_view field) {
  bool ok = prefix_key.size() == 64;
  for (size_t i = 0; ok && i < prefix_key.size(); ++i) {
    const char c = prefix_key[i];
    ok = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
  }
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      Sv(field), " must be 64 lowercase hex digits (a sha256 content key, as the client's "
      "prefix_key computes it), got ", prefix_key.size(), " bytes"));
}

bool PolicyIsQueryAware(const PolicyConfig& policy) {
  // The cake allocator sizes the layers' budgets from the attention the queries paid them.
  if (policy.allocator.kind == LayerAllocatorKind::kCake) return true;
  // The policy's unit says whether it scores keys alone (streaming_llm by position, keydiff and
  // knorm by the keys' geometry) or ranks tokens by the attention of queries.
  return !CapabilitiesOf(policy).query_agnostic;
}

namespace {

absl::Status LayoutMismatch(std::string_view field, int64_t published, int64_t here) {
  return absl::FailedPreconditionError(
      absl::StrCat("from_prefix: the prefix was published from a session with ", Sv(field), " ",
                   published, "; this session's ", Sv(field), " is ", here));
}

// The policy's resolved parameters as bytes (the snapshot encoding of a sequence holding only
// them), for comparing two configurations field by field without a hand-written operator.
std::string PolicyBytes(const PolicyConfig& policy) {
  SequenceSnapshot snapshot;
  snapshot.policy = policy;
  return EncodeSnapshot(snapshot);
}

}  // namespace

absl::StatusOr<SpillResult> KvPool::Publish(std::string_view session_id,
                                            std::string_view sequence_id,
                                            std::string_view prefix_key, int32_t query_window) {
  if (options_.tiers == nullptr) return NoTiers();
  KVS_RETURN_IF_ERROR(ValidatePrefixKey(prefix_key, "prefix_key"));
  if (query_window < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("query_window must be >= 0 (0 = none stated), got ", query_window));
  }
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, FindSession(session_id));
  absl::MutexLock lock(&session->mu);
  if (session->dead) return SessionGone(session_id);
  auto it = session->sequences.find(Sv(sequence_id));
  if (it == session->sequences.end()) {
    if (auto spilled = session->spilled.find(Sv(sequence_id));
        spilled != session->spilled.end()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "sequence ", Sv(sequence_id), " is spilled to the ",
          StorageTierName(spilled->second.tier), " tier: restore it before publishing it"));
    }
    return absl::NotFoundError(
        absl::StrCat("sequence ", Sv(sequence_id), " not found in session ", session->id));
  }
  const Sequence& sequence = *it->second;
  if (PolicyIsQueryAware(sequence.policy_config()) && query_window == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "query_window: sequence ", Sv(sequence_id), " uses policy ",
        sequence.policy_config().name,
        ", which chooses the tokens it keeps from the queries that attended to them (the "
        "prompt's last tokens, e.g. a question): its compressed cache fits another prompt only "
        "with the same queries. State query_window (the trailing prefix tokens whose queries "
        "drove the compression) and include it in the key, or publish from a query-agnostic "
        "policy (streaming_llm, keydiff)"));
  }
  if (!sequence.spillable()) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", Sv(sequence_id),
                     " is an OmniKV sequence that has selected: its cache spans the arena, its "
                     "staging blocks and the host tier, and cannot be published"));
  }
  const SequenceEnv env = EnvOf(*session, *backend_, options_);
  KVS_ASSIGN_OR_RETURN(SpilledSequence data, sequence.Spill(env));
  const uint64_t bytes = data.bytes();
  const StorageTier target = options_.tiers->has_remote() ? StorageTier::kRemote
                                                          : StorageTier::kDisk;
  KVS_RETURN_IF_ERROR(CheckTierQuota(session->tenant, target, bytes));
  KVS_RETURN_IF_ERROR(
      options_.tiers->Put(target, PrefixSpillKey(session->tenant, prefix_key), std::move(data)));
  return SpillResult{target, bytes};
}

absl::Status KvPool::Unpublish(std::string_view session_id, std::string_view prefix_key) {
  if (options_.tiers == nullptr) return NoTiers();
  KVS_RETURN_IF_ERROR(ValidatePrefixKey(prefix_key, "prefix_key"));
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, FindSession(session_id));
  const SpillKey key = PrefixSpillKey(session->tenant, prefix_key);
  if (!options_.tiers->Find(key)) {
    return absl::NotFoundError(absl::StrCat("prefix_key: tenant ", session->tenant,
                                            " has no prefix published under ",
                                            Sv(prefix_key)));
  }
  return options_.tiers->EraseShared(key);
}

absl::StatusOr<SequenceCreated> KvPool::CreateFromPrefix(std::string_view session_id,
                                                         const SequenceParams& params) {
  if (options_.tiers == nullptr) {
    return absl::UnimplementedError(
        "from_prefix needs storage tiers, which this pool was built without");
  }
  KVS_RETURN_IF_ERROR(ValidatePrefixKey(params.from_prefix, "from_prefix"));
  if (params.retain_evicted) {
    return absl::InvalidArgumentError(
        "retain_evicted does not apply with from_prefix (the prefix's evicted tokens are gone)");
  }
  if (!params.layer_windows.empty()) {
    return absl::InvalidArgumentError(
        "layer_windows does not apply with from_prefix (the prefix keeps the windows it was "
        "published with)");
  }
  if (!params.sequence_id.empty()) KVS_RETURN_IF_ERROR(ValidateSequenceId(params.sequence_id));
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, FindSession(session_id));
  // The key is under the caller's tenant: another tenant's prefixes cannot be named.
  const SpillKey key = PrefixSpillKey(session->tenant, params.from_prefix);
  absl::StatusOr<std::shared_ptr<const SpilledSequence>> data = options_.tiers->Read(key);
  if (absl::IsNotFound(data.status())) {
    return absl::NotFoundError(absl::StrCat("from_prefix: tenant ", session->tenant,
                                            " has no prefix published under ",
                                            params.from_prefix));
  }
  if (!data.ok()) return data.status();
  KVS_ASSIGN_OR_RETURN(SequenceSnapshot snapshot, DecodeSnapshot((*data)->meta));
  const ModelLayout& have = snapshot.layout;
  const ModelLayout& want = session->layout;
  if (have.num_layers != want.num_layers) {
    return LayoutMismatch("layout.num_layers", have.num_layers, want.num_layers);
  }
  if (have.num_kv_heads != want.num_kv_heads) {
    return LayoutMismatch("layout.num_kv_heads", have.num_kv_heads, want.num_kv_heads);
  }
  if (have.num_q_heads != want.num_q_heads) {
    return LayoutMismatch("layout.num_q_heads", have.num_q_heads, want.num_q_heads);
  }
  if (have.head_dim != want.head_dim) {
    return LayoutMismatch("layout.head_dim", have.head_dim, want.head_dim);
  }
  if (have.dtype != want.dtype) {
    return LayoutMismatch("layout.dtype", static_cast<int>(have.dtype),
                          static_cast<int>(want.dtype));
  }
  if (have.block_tokens != want.block_tokens) {
    return LayoutMismatch("layout.block_tokens", have.block_tokens, want.block_tokens);
  }
  if (params.policy.has_value()) {
    if (params.policy->name != snapshot.policy.name) {
      return absl::InvalidArgumentError(absl::StrCat(
          "policy.name: the prefix was published with policy ", snapshot.policy.name,
          ", the request asks for ", params.policy->name,
          " (leave policy unset to take the published one)"));
    }
    KVS_ASSIGN_OR_RETURN(std::unique_ptr<Policy> requested, MakePolicy(*params.policy));
    if (PolicyBytes(requested->config()) != PolicyBytes(snapshot.policy)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "policy: the parameters of policy ", snapshot.policy.name,
          " differ from those the prefix was published with (leave policy unset to take them)"));
    }
  }
  if (params.budget.has_value()) {
    BudgetConfig asked = *params.budget;
    if (asked.prefill_block_tokens == 0) {
      asked.prefill_block_tokens = BudgetConfig{}.prefill_block_tokens;
    }
    const BudgetConfig& published = snapshot.budget;
    auto mismatch = [](const char* field, const std::string& was, const std::string& is) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": the prefix was published with ", was, ", the request asks for ",
                       is, " (leave budget unset to take the published one)"));
    };
    if (asked.tokens_per_layer != published.tokens_per_layer) {
      return mismatch("budget.tokens_per_layer", absl::StrCat(published.tokens_per_layer),
                      absl::StrCat(asked.tokens_per_layer));
    }
    if (asked.strict != published.strict) {
      return mismatch("budget.strict", published.strict ? "true" : "false",
                      asked.strict ? "true" : "false");
    }
    if (asked.prefill_block_tokens != published.prefill_block_tokens) {
      return mismatch("budget.prefill_block_tokens", absl::StrCat(published.prefill_block_tokens),
                      absl::StrCat(asked.prefill_block_tokens));
    }
    if (asked.per_layer_tokens != published.per_layer_tokens) {
      return mismatch("budget.per_layer_tokens",
                      absl::StrCat(published.per_layer_tokens.size(), " entries"),
                      absl::StrCat(asked.per_layer_tokens.size(), " entries (or other values)"));
    }
  }
  KVS_RETURN_IF_ERROR(CheckRestoreQuota(*this, session->tenant, key.sequence_id, (*data)->bytes()));

  absl::MutexLock lock(&session->mu);
  KVS_ASSIGN_OR_RETURN(const std::string id,
                       AdmitSequenceLocked(*session, session_id, params.sequence_id));
  const SequenceEnv env = EnvOf(*session, *backend_, options_);
  absl::StatusOr<std::unique_ptr<Sequence>> sequence = Sequence::Restore(env, **data, id);
  if (!sequence.ok()) {
    RemoveTenantSequences(session->tenant, 1);
    return sequence.status();
  }
  (*sequence)->Touch(clock_->Now());
  SequenceCreated created;
  created.sequence_id = id;
  created.policy = (*sequence)->policy_config();
  created.budget = (*sequence)->budget();
  session->sequences.emplace(id, *std::move(sequence));
  session->free_blocks_hint = session->allocator.free_blocks();
  return created;
}

std::vector<SpilledInfo> KvPool::ListSpilled() const {
  if (options_.tiers == nullptr) return {};
  return options_.tiers->List();
}

void KvPool::RetireTotals(const Sequence& sequence) {
  const Sequence::Totals& totals = sequence.totals();
  absl::MutexLock lock(&quota_mu_);
  PolicyTokenTotals& retired = retired_[sequence.policy_config().name];
  retired.appended += totals.appended;
  retired.evicted += totals.evicted;
  retired.merged += totals.merged;
}

std::vector<PolicyTokenTotals> KvPool::PolicyTotals() const {
  absl::flat_hash_map<std::string, PolicyTokenTotals> by_policy;
  {
    absl::MutexLock lock(&quota_mu_);
    by_policy = retired_;
  }
  std::vector<std::shared_ptr<Session>> sessions;
  {
    absl::ReaderMutexLock lock(&mu_);
    for (const auto& [id, session] : sessions_) sessions.push_back(session);
  }
  for (const std::shared_ptr<Session>& session : sessions) {
    absl::MutexLock lock(&session->mu);
    if (session->dead) continue;
    for (const auto& [id, sequence] : session->sequences) {
      PolicyTokenTotals& t = by_policy[sequence->policy_config().name];
      const Sequence::Totals& totals = sequence->totals();
      t.appended += totals.appended;
      t.evicted += totals.evicted;
      t.merged += totals.merged;
      for (int32_t count : sequence->counts()) t.kept += count;
      ++t.sequences;
      t.budgets.push_back(sequence->budget().tokens_per_layer);
    }
  }
  std::vector<PolicyTokenTotals> result;
  for (auto& [name, totals] : by_policy) {
    totals.policy = name;
    result.push_back(std::move(totals));
  }
  std::sort(result.begin(), result.end(),
            [](const auto& a, const auto& b) { return a.policy < b.policy; });
  return result;
}

}  // namespace kvs
