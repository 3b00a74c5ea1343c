#include "cache/pool.h"

#include <algorithm>
#include <thread>
#include <tuple>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "cache/block_allocator.h"
#include "cache/internal/batch_sessions.h"
#include "cache/internal/session.h"
#include "cache/internal/session_table.h"
#include "cache/internal/tenant_ledger.h"
#include "cache/internal/tier_mover.h"
#include "cache/policy/policy.h"
#include "cache/policy/registry.h"
#include "cache/sequence.h"
#include "cache/sequence_kind.h"
#include "gpu/base/status_macros.h"
#include "gpu/cpu/thread_pool.h"

namespace kvs {
namespace {

constexpr size_t kMaxSequenceIdLength = 128;
constexpr int32_t kMinSequencesPerSession = 16;

std::string RandomHex(int chars) {
  thread_local absl::BitGen gen;
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(chars, '0');
  for (char& c : out) c = kDigits[absl::Uniform<int>(gen, 0, 16)];
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

// An error of item i of a batch call, as the batch answers it.
absl::Status ItemError(size_t i, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat("items[", i, "]: ", status.message()));
}

// Runs fn(sequence, env, session) under the session lock, or NOT_FOUND for a dead session or an
// unknown sequence; a spilled sequence is restored first (TierMover). `clock` stamps the
// sequence's last use; env_of(session) makes what the call's sequence borrows.
template <typename EnvFn, typename Fn>
auto WithSequence(Session& session, std::string_view sequence_id, TierMover& mover,
                  const Clock& clock, EnvFn&& env_of, Fn&& fn)
    -> decltype(fn(std::declval<Sequence&>(), std::declval<const SequenceEnv&>(), session)) {
  absl::MutexLock lock(&session.mu);
  if (session.dead) return SessionGone(session.id);
  auto it = session.sequences.find(Sv(sequence_id));
  if (it == session.sequences.end() && session.spilled.contains(Sv(sequence_id))) {
    KVS_RETURN_IF_ERROR(mover.RestoreSpilledLocked(session, sequence_id));
    it = session.sequences.find(Sv(sequence_id));
  }
  if (it == session.sequences.end()) return SequenceNotFound(sequence_id, session.id);
  const SequenceEnv env = env_of(session);
  it->second->Touch(clock.Now());
  auto result = fn(*it->second, env, session);
  session.free_blocks_hint = session.allocator.free_blocks();
  return result;
}

// NOT_FOUND, as a lookup by id would now answer, for a session that ended after the caller's
// lookup; for calls that take a SessionRef but do not go through WithSequence.
absl::Status CheckNotEnded(Session& session) ABSL_LOCKS_EXCLUDED(session.mu) {
  absl::MutexLock lock(&session.mu);
  return session.dead ? SessionGone(session.id) : absl::OkStatus();
}

// With the batch's sessions locked: an item's sequence (restored first when spilled), NOT_FOUND
// for an ended session or an unknown sequence.
absl::StatusOr<Sequence*> BatchSequenceLocked(Session& session, std::string_view sequence_id,
                                              TierMover& mover)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(session.mu) {
  if (session.dead) return SessionGone(session.id);
  if (!session.sequences.contains(Sv(sequence_id)) && session.spilled.contains(Sv(sequence_id))) {
    KVS_RETURN_IF_ERROR(mover.RestoreSpilledLocked(session, sequence_id));
  }
  auto it = session.sequences.find(Sv(sequence_id));
  if (it == session.sequences.end()) return SequenceNotFound(sequence_id, session.id);
  return it->second.get();
}

// The earlier item of a batch that names `sequence` too, or -1.
int64_t EarlierItem(absl::Span<Sequence* const> earlier, const Sequence* sequence) {
  for (size_t j = 0; j < earlier.size(); ++j) {
    if (earlier[j] == sequence) return static_cast<int64_t>(j);
  }
  return -1;
}

// With the batch's sessions locked: item `i`'s sequence (restored first when spilled), refused
// when an earlier item of the batch (`sequences`[0, i)) names it too: "is already <verb> by
// items[j]". Stored into sequences[i] when found.
absl::Status DistinctSequenceLocked(const BatchSessions& batch, std::string_view sequence_id,
                                    size_t i, TierMover& mover, std::string_view verb,
                                    std::vector<Sequence*>& sequences) {
  Session& session = batch.of(i);
  session.mu.AssertHeld();
  KVS_ASSIGN_OR_RETURN(Sequence * sequence, BatchSequenceLocked(session, sequence_id, mover));
  sequences[i] = sequence;
  if (const int64_t j = EarlierItem(absl::MakeConstSpan(sequences.data(), i), sequence); j >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence ", Sv(sequence_id), " is already ", Sv(verb), " by items[", j, "]"));
  }
  return absl::OkStatus();
}

int DecodeThreads(int32_t requested) {
  if (requested > 0) return requested;
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

}  // namespace

template <typename Fn>
auto KvPool::OnSequence(std::string_view session_id, std::string_view sequence_id, Fn&& fn) {
  using Result = decltype(fn(std::declval<Sequence&>(), std::declval<const SequenceEnv&>(),
                             std::declval<Session&>()));
  absl::StatusOr<std::shared_ptr<Session>> session = sessions_->Find(session_id);
  if (!session.ok()) return Result(session.status());
  return OnSequence(**session, sequence_id, std::forward<Fn>(fn));
}

template <typename Fn>
auto KvPool::OnSequence(std::string_view session_id, std::string_view sequence_id,
                        Fn&& fn) const {
  using Result = decltype(fn(std::declval<Sequence&>(), std::declval<const SequenceEnv&>(),
                             std::declval<Session&>()));
  absl::StatusOr<std::shared_ptr<Session>> session = sessions_->Find(session_id);
  if (!session.ok()) return Result(session.status());
  return OnSequence(**session, sequence_id, std::forward<Fn>(fn));
}

template <typename Fn>
auto KvPool::OnSequence(Session& session, std::string_view sequence_id, Fn&& fn) {
  return WithSequence(
      session, sequence_id, *mover_, *clock_,
      [this](Session& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) { return EnvOf(s); },
      std::forward<Fn>(fn));
}

template <typename Fn>
auto KvPool::OnSequence(Session& session, std::string_view sequence_id, Fn&& fn) const {
  return WithSequence(
      session, sequence_id, *mover_, *clock_,
      [this](Session& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
        return s.Env(*backend_, options_.max_tokens_per_call);
      },
      std::forward<Fn>(fn));
}

KvPool::KvPool(Backend* backend, const Clock* clock, PoolOptions options)
    : backend_(backend),
      clock_(clock),
      options_(std::move(options)),
      decode_pool_(std::make_unique<ThreadPool>(DecodeThreads(options_.decode_threads))),
      sessions_(std::make_unique<SessionTable>(clock_, &options_)),
      ledger_(std::make_unique<TenantLedger>(sessions_.get())),
      mover_(std::make_unique<TierMover>(backend_, &options_, sessions_.get(), ledger_.get())) {
  absl::MutexLock lock(&defaults_mu_);
  live_default_policy_ = options_.default_policy;
  live_default_budget_ = options_.default_budget;
}

KvPool::~KvPool() {
  for (std::shared_ptr<Session>& session : sessions_->TakeAll()) DestroySession(session);
}

SequenceEnv KvPool::EnvOf(Session& session) {
  session.mu.AssertHeld();
  SequenceEnv env = session.Env(*backend_, options_.max_tokens_per_call, &tokens_appended_,
                                &tokens_evicted_);
  env.host_pool = decode_pool_.get();
  return env;
}

// ---- Sessions ----

ReleaseCounts KvPool::ReleaseLocked(Session& session, Sequence& sequence) {
  session.mu.AssertHeld();
  for (const SpillKey& pinned : sequence.pinned_host_keys()) {
    (void)session.host_pin(pinned, nullptr);
  }
  ReleaseCounts counts;
  counts.sequences = 1;
  counts.blocks = sequence.Release(session.Env(*backend_, options_.max_tokens_per_call));
  RetireTotals(sequence);
  return counts;
}

ReleaseCounts KvPool::DestroySession(std::shared_ptr<Session> session) {
  ReleaseCounts counts;
  absl::MutexLock lock(&session->mu);
  if (session->dead) return counts;
  session->dead = true;
  for (auto& [id, sequence] : session->sequences) {
    const ReleaseCounts released = ReleaseLocked(*session, *sequence);
    counts.sequences += released.sequences;
    counts.blocks += released.blocks;
  }
  session->sequences.clear();
  // Host copies die with the session; disk copies stay, adoptable by another session of the
  // tenant (KvPool::Restore with from_session_id).
  counts.sequences += mover_->EndSpilledLocked(*session);
  ledger_->RemoveSequences(session->tenant, counts.sequences);
  return counts;
}

absl::StatusOr<SessionView> KvPool::Attach(const AttachParams& params) {
  KVS_ASSIGN_OR_RETURN(const AttachPlan plan, sessions_->Plan(params));
  // Claim the capacity first, create the arena and the session without the table's lock (both
  // cost time proportional to their size), give the claim back on failure.
  KVS_RETURN_IF_ERROR(sessions_->Claim(plan));
  absl::StatusOr<std::unique_ptr<Arena>> arena =
      backend_->CreateArena(plan.arena_bytes, options_.arena_options);
  if (!arena.ok()) {
    sessions_->Unclaim(plan);
    return arena.status();
  }
  auto session = std::make_shared<Session>(SessionTable::NewSessionId(), plan.params,
                                           *std::move(arena), plan.num_blocks, plan.charge,
                                           plan.lease, clock_->Now(), plan.staging_offset);
  session->host_pin = mover_->HostPinFor(session->tenant, session->id);
  SessionView view = session->View();
  KVS_RETURN_IF_ERROR(sessions_->Insert(std::move(session)));
  return view;
}

absl::StatusOr<HeartbeatResult> KvPool::Heartbeat(std::string_view session_id) {
  return sessions_->Renew(session_id);
}

absl::StatusOr<ReleaseCounts> KvPool::Detach(std::string_view session_id) {
  return RemoveSession(session_id, /*reclaimed=*/false);
}

absl::StatusOr<HeartbeatResult> KvPool::Heartbeat(const SessionRef& session) {
  return sessions_->Renew(SharedOf(session));
}

absl::StatusOr<ReleaseCounts> KvPool::Detach(const SessionRef& session) {
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<Session> removed,
                       sessions_->Remove(SharedOf(session), /*reclaimed=*/false));
  return DestroySession(std::move(removed));
}

absl::StatusOr<ReleaseCounts> KvPool::RemoveSession(std::string_view session_id, bool reclaimed) {
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                       sessions_->Remove(session_id, reclaimed));
  return DestroySession(std::move(session));
}

int KvPool::ReapExpired() {
  std::vector<std::shared_ptr<Session>> expired = sessions_->TakeExpired(clock_->Now());
  for (std::shared_ptr<Session>& session : expired) DestroySession(std::move(session));
  return static_cast<int>(expired.size());
}

absl::StatusOr<ReleaseCounts> KvPool::Reclaim(std::string_view session_id) {
  return RemoveSession(session_id, /*reclaimed=*/true);
}

absl::StatusOr<SessionView> KvPool::GetSession(std::string_view session_id) const {
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, sessions_->Find(session_id));
  return session->View();
}

absl::StatusOr<SessionRef> KvPool::FindSession(std::string_view session_id) const {
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, sessions_->Find(session_id));
  return SessionRef(std::move(session));
}

absl::StatusOr<int> KvPool::DuplicateArenaFd(std::string_view session_id) const {
  // The shared pointer keeps the arena (and its descriptor) alive while it is duplicated, even if
  // the session is detached at the same moment.
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, sessions_->Find(session_id));
  return session->arena->DuplicateFd();
}

absl::Status KvPool::ReadArena(std::string_view session_id, uint64_t offset, void* out,
                               uint64_t bytes) const {
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, sessions_->Find(session_id));
  return session->arena->Read(offset, out, bytes);
}

// ---- Sequences ----

namespace {

// tokens_per_layer and prefill_block_tokens (defaulted) against what the arena holds per layer.
absl::Status CheckBudgetTokens(BudgetConfig& budget, int64_t per_layer_capacity,
                               int32_t max_tokens_per_call) {
  if (budget.tokens_per_layer < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("budget.tokens_per_layer must be >= 1, got ", budget.tokens_per_layer));
  }
  if (budget.tokens_per_layer > per_layer_capacity) {
    return absl::InvalidArgumentError(absl::StrCat(
        "budget.tokens_per_layer must be <= ", per_layer_capacity,
        " (the tokens per layer the session's arena holds), got ", budget.tokens_per_layer));
  }
  if (budget.prefill_block_tokens == 0) {
    budget.prefill_block_tokens = BudgetConfig{}.prefill_block_tokens;
  }
  if (budget.prefill_block_tokens < 1 || budget.prefill_block_tokens > max_tokens_per_call) {
    return absl::InvalidArgumentError(absl::StrCat("budget.prefill_block_tokens must be in [1, ",
                                                   max_tokens_per_call, "], got ",
                                                   budget.prefill_block_tokens));
  }
  if (!budget.strict) return absl::OkStatus();
  if (budget.tokens_per_layer == 0) {
    return absl::InvalidArgumentError(
        "budget.tokens_per_layer must be >= 1 for a strict budget, got 0");
  }
  if (int64_t{budget.tokens_per_layer} + budget.prefill_block_tokens > per_layer_capacity) {
    return absl::InvalidArgumentError(absl::StrCat(
        "budget.prefill_block_tokens ", budget.prefill_block_tokens,
        " + budget.tokens_per_layer ", budget.tokens_per_layer, " must be <= ",
        per_layer_capacity, " (the tokens per layer the session's arena holds)"));
  }
  return absl::OkStatus();
}

absl::Status CheckPerLayerTokens(const BudgetConfig& budget, int32_t num_layers,
                                 int64_t per_layer_capacity) {
  if (budget.per_layer_tokens.empty()) return absl::OkStatus();
  if (budget.per_layer_tokens.size() != static_cast<size_t>(num_layers)) {
    return absl::InvalidArgumentError(
        absl::StrCat("budget.per_layer_tokens has ", budget.per_layer_tokens.size(),
                     " entries, the model has ", num_layers, " layers"));
  }
  for (size_t l = 0; l < budget.per_layer_tokens.size(); ++l) {
    const int32_t tokens = budget.per_layer_tokens[l];
    if (tokens < 1 || tokens > per_layer_capacity) {
      return absl::InvalidArgumentError(absl::StrCat("budget.per_layer_tokens[", l,
                                                     "] must be in [1, ", per_layer_capacity,
                                                     "], got ", tokens));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckLayerWindows(const std::vector<int32_t>& windows, int32_t num_layers) {
  if (windows.empty()) return absl::OkStatus();
  if (windows.size() != static_cast<size_t>(num_layers)) {
    return absl::InvalidArgumentError(absl::StrCat("layer_windows has ", windows.size(),
                                                   " entries, the model has ", num_layers,
                                                   " layers"));
  }
  for (size_t l = 0; l < windows.size(); ++l) {
    if (windows[l] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer_windows[", l, "] must be >= 0 (0 = no window), got ", windows[l]));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> KvPool::AdmitSequenceLocked(Session& session,
                                                        const std::string& requested) {
  session.mu.AssertHeld();
  if (session.dead) return SessionGone(session.id);
  if (!requested.empty() &&
      (session.sequences.contains(requested) || session.spilled.contains(requested))) {
    return absl::AlreadyExistsError(
        absl::StrCat("sequence_id ", requested, " already exists in session ", session.id));
  }
  const int32_t max_sequences = std::min(options_.max_sequences_per_session,
                                         std::max(kMinSequencesPerSession, session.num_blocks));
  if (session.sequences.size() >= static_cast<size_t>(max_sequences)) {
    return absl::ResourceExhaustedError(absl::StrCat("session ", session.id, " already holds ",
                                                     session.sequences.size(),
                                                     " sequences, the most it may"));
  }
  KVS_RETURN_IF_ERROR(ledger_->AddSequence(session.tenant));
  std::string id = requested;
  while (id.empty() || session.sequences.contains(id)) id = RandomHex(16);
  return id;
}

absl::StatusOr<SequenceCreated> KvPool::CreateSequence(std::string_view session_id,
                                                       const SequenceParams& params) {
  if (!params.from_prefix.empty()) return CreateFromPrefix(session_id, params);
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, sessions_->Find(session_id));
  return CreateInSession(*session, params);
}

absl::StatusOr<SequenceCreated> KvPool::CreateSequence(const SessionRef& ref,
                                                       const SequenceParams& params) {
  if (!params.from_prefix.empty()) return CreateFromPrefix(ref.id(), params, &ref);
  Session& session = Of(ref);
  // A session that ended since the lookup answers as by id, before its parameters are checked.
  KVS_RETURN_IF_ERROR(CheckNotEnded(session));
  return CreateInSession(session, params);
}

absl::StatusOr<SequenceCreated> KvPool::CreateInSession(Session& session,
                                                        const SequenceParams& params) {
  if (params.retain_evicted && !mover_->has_tiers()) {
    return absl::FailedPreconditionError(
        "retain_evicted needs the host tier, which this pool was built without");
  }
  const int32_t num_layers = session.layout.num_layers;
  // Before the kind's admission, which plans OmniKV's layers around the windows.
  KVS_RETURN_IF_ERROR(CheckLayerWindows(params.layer_windows, num_layers));
  PolicyConfig policy_config = params.policy.value_or(default_policy());
  // What the sequence's kind makes of the parameters (OmniKV's defaults and refusals).
  KVS_ASSIGN_OR_RETURN(const SequenceAdmission admission,
                       SequenceAdmission::Resolve(policy_config, params, num_layers,
                                                  mover_->has_tiers()));
  KVS_ASSIGN_OR_RETURN(std::unique_ptr<Policy> policy, MakePolicy(policy_config));
  BudgetConfig budget = admission.Budget(params.budget.value_or(default_budget()));
  const int64_t per_layer_capacity =
      int64_t{session.num_blocks / num_layers} * session.layout.block_tokens;
  KVS_RETURN_IF_ERROR(CheckBudgetTokens(budget, per_layer_capacity, options_.max_tokens_per_call));
  KVS_RETURN_IF_ERROR(CheckPerLayerTokens(budget, num_layers, per_layer_capacity));
  if (!params.sequence_id.empty()) KVS_RETURN_IF_ERROR(ValidateSequenceId(params.sequence_id));

  absl::MutexLock lock(&session.mu);
  KVS_ASSIGN_OR_RETURN(const std::string id, AdmitSequenceLocked(session, params.sequence_id));
  SequenceCreated created{id, policy->config(), budget};
  auto sequence =
      std::make_unique<Sequence>(id, session.layout, std::move(policy), budget, clock_->Now());
  sequence->set_retain_evicted(params.retain_evicted);
  // All zeros is no window at all: the sequence then runs exactly as one without.
  if (std::any_of(params.layer_windows.begin(), params.layer_windows.end(),
                  [](int32_t w) { return w > 0; })) {
    sequence->set_layer_windows(params.layer_windows);
  }
  session.sequences.emplace(id, std::move(sequence));
  return created;
}

absl::StatusOr<SequenceCreated> KvPool::CreateFromPrefix(std::string_view session_id,
                                                         const SequenceParams& params,
                                                         const SessionRef* found) {
  if (!mover_->has_tiers()) {
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
  std::shared_ptr<Session> session;
  if (found != nullptr) {
    session = found->session_;
    KVS_RETURN_IF_ERROR(CheckNotEnded(*session));
  } else {
    KVS_ASSIGN_OR_RETURN(session, sessions_->Find(session_id));
  }
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<const SpilledSequence> data,
                       mover_->ReadPrefix(*session, params));
  KVS_RETURN_IF_ERROR(ledger_->CheckRestore(
      session->tenant, PrefixSpillKey(session->tenant, params.from_prefix).sequence_id,
      data->bytes()));

  absl::MutexLock lock(&session->mu);
  KVS_ASSIGN_OR_RETURN(const std::string id, AdmitSequenceLocked(*session, params.sequence_id));
  absl::StatusOr<std::unique_ptr<Sequence>> sequence =
      Sequence::Restore(session->Env(*backend_, options_.max_tokens_per_call), *data, id);
  if (!sequence.ok()) {
    ledger_->RemoveSequences(session->tenant, 1);
    return sequence.status();
  }
  (*sequence)->Touch(clock_->Now());
  SequenceCreated created{id, (*sequence)->policy_config(), (*sequence)->budget()};
  session->sequences.emplace(id, *std::move(sequence));
  session->free_blocks_hint = session->allocator.free_blocks();
  return created;
}

absl::StatusOr<ReleaseCounts> KvPool::ReleaseSequence(std::string_view session_id,
                                                      std::string_view sequence_id) {
  KVS_ASSIGN_OR_RETURN(SessionRef session, FindSession(session_id));
  return ReleaseSequence(session, sequence_id);
}

absl::StatusOr<ReleaseCounts> KvPool::ReleaseSequence(const SessionRef& ref,
                                                      std::string_view sequence_id) {
  Session* const session = &Of(ref);
  const std::string& session_id = session->id;
  absl::MutexLock lock(&session->mu);
  if (session->dead) return SessionGone(session_id);
  auto it = session->sequences.find(Sv(sequence_id));
  if (it == session->sequences.end() && session->spilled.contains(Sv(sequence_id))) {
    // A spilled sequence: drop its copy in the tiers; it held no blocks.
    KVS_RETURN_IF_ERROR(mover_->DropSpilledLocked(*session, sequence_id));
    ledger_->RemoveSequences(session->tenant, 1);
    return ReleaseCounts{1, 0};
  }
  if (it == session->sequences.end()) return SequenceNotFound(sequence_id, session_id);
  const ReleaseCounts counts = ReleaseLocked(*session, *it->second);
  session->sequences.erase(it);
  ledger_->RemoveSequences(session->tenant, 1);
  return counts;
}

// ---- Reservations and commits ----

absl::StatusOr<Reservation> KvPool::Reserve(std::string_view session_id,
                                            std::string_view sequence_id, int32_t num_tokens,
                                            absl::Span<const int32_t> positions,
                                            absl::Span<const int32_t> layers) {
  KVS_ASSIGN_OR_RETURN(SessionRef session, FindSession(session_id));
  return Reserve(session, sequence_id, num_tokens, positions, layers);
}

absl::StatusOr<Reservation> KvPool::Reserve(const SessionRef& session,
                                            std::string_view sequence_id, int32_t num_tokens,
                                            absl::Span<const int32_t> positions,
                                            absl::Span<const int32_t> layers) {
  KVS_RETURN_IF_ERROR(ledger_->CheckArenaGrowth(session.tenant()));
  return OnSequence(Of(session), sequence_id,
                    [&](Sequence& sequence, const SequenceEnv& env, Session& s)
                        ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) -> absl::StatusOr<Reservation> {
                          return ReserveLocked(s, sequence, env, num_tokens, positions, layers);
                        });
}

absl::StatusOr<Reservation> KvPool::ReserveLocked(Session& s, Sequence& sequence,
                                                  const SequenceEnv& env, int32_t num_tokens,
                                                  absl::Span<const int32_t> positions,
                                                  absl::Span<const int32_t> layers) {
  s.mu.AssertHeld();
  absl::StatusOr<Reservation> reservation =
      sequence.Reserve(env, s.next_reservation_id, num_tokens, positions, layers);
  // Arena full: demote the session's least recently used other sequences to the host tier, one
  // at a time, until the reservation fits (PoolOptions::spill_on_pressure).
  while (!reservation.ok() && reservation.status().code() == absl::StatusCode::kResourceExhausted &&
         options_.spill_on_pressure && mover_->DemoteOneLocked(s, sequence, env)) {
    reservation = sequence.Reserve(env, s.next_reservation_id, num_tokens, positions, layers);
  }
  if (reservation.ok()) ++s.next_reservation_id;
  return reservation;
}

absl::StatusOr<std::vector<Reservation>> KvPool::ReserveBatch(absl::Span<const ReserveItem> items,
                                                              absl::Span<const SessionRef> found,
                                                              int32_t* failed) {
  auto fail = [&](size_t i, absl::Status status) {
    if (failed != nullptr) *failed = static_cast<int32_t>(i);
    return status;
  };
  BatchSessions batch;
  for (const SessionRef& session : found) batch.Add(session.session_);
  size_t missing = 0;
  if (absl::Status looked_up = batch.Find(*sessions_, items, &missing); !looked_up.ok()) {
    return fail(missing, looked_up);
  }
  batch.LockAll();
  // 1. Every item's sequence, before anything is reserved.
  for (size_t i = 0; i < items.size(); ++i) {
    Session& session = batch.of(i);
    session.mu.AssertHeld();
    if (absl::Status known = BatchSequenceLocked(session, items[i].sequence_id, *mover_).status();
        !known.ok()) {
      batch.UnlockAll();
      return fail(i, known);
    }
  }
  // 2. Reserve in order. Each item finds its sequence again: demotion under pressure may have
  // moved a later item's sequence to the host tier (it then comes back as Reserve would bring
  // it); an item with a reservation is never demoted, so the rollback finds what it cancels.
  const absl::Time now = clock_->Now();
  std::vector<Reservation> made;
  std::vector<Sequence*> reserved;
  made.reserve(items.size());
  reserved.reserve(items.size());
  absl::Status status;
  size_t i = 0;
  for (; i < items.size(); ++i) {
    Session& session = batch.of(i);
    session.mu.AssertHeld();
    // The quota sees the items before this one: their sessions' free-block hints are current.
    status = ledger_->CheckArenaGrowth(session.tenant);
    if (!status.ok()) break;
    absl::StatusOr<Sequence*> sequence =
        BatchSequenceLocked(session, items[i].sequence_id, *mover_);
    if (!sequence.ok()) {
      status = sequence.status();
      break;
    }
    (*sequence)->Touch(now);
    absl::StatusOr<Reservation> reservation =
        ReserveLocked(session, **sequence, EnvOf(session), items[i].num_tokens, items[i].positions,
                      items[i].layers);
    session.free_blocks_hint = session.allocator.free_blocks();
    if (!reservation.ok()) {
      status = reservation.status();
      break;
    }
    made.push_back(*std::move(reservation));
    reserved.push_back(*sequence);
  }
  if (!status.ok()) {
    for (size_t j = 0; j < reserved.size(); ++j) {
      Session& session = batch.of(j);
      session.mu.AssertHeld();
      // Cannot fail: the reservation is pending and its session locked since it was made.
      reserved[j]->Cancel(EnvOf(session), made[j].reservation_id).IgnoreError();
    }
  }
  batch.UnlockAll();
  if (!status.ok()) return fail(i, status);
  return made;
}

absl::Status KvPool::CancelReservation(std::string_view session_id, std::string_view sequence_id,
                                       uint64_t reservation_id) {
  return OnSequence(session_id, sequence_id,
                    [&](Sequence& sequence, const SequenceEnv& env, Session&) {
                      return sequence.Cancel(env, reservation_id);
                    });
}

absl::Status KvPool::CancelReservation(const SessionRef& session, std::string_view sequence_id,
                                       uint64_t reservation_id) {
  return OnSequence(Of(session), sequence_id,
                    [&](Sequence& sequence, const SequenceEnv& env, Session&) {
                      return sequence.Cancel(env, reservation_id);
                    });
}

absl::Status KvPool::CheckReservation(std::string_view session_id, std::string_view sequence_id,
                                      uint64_t reservation_id) const {
  return OnSequence(session_id, sequence_id, [&](Sequence& sequence, const SequenceEnv&, Session&) {
    return sequence.CheckPending(reservation_id);
  });
}

absl::Status KvPool::WriteReserved(std::string_view session_id, std::string_view sequence_id,
                                   uint64_t reservation_id, uint64_t payload_offset,
                                   absl::Span<const uint8_t> bytes) {
  KVS_ASSIGN_OR_RETURN(SessionRef session, FindSession(session_id));
  return WriteReserved(session, sequence_id, reservation_id, payload_offset, bytes);
}

absl::Status KvPool::WriteReserved(const SessionRef& session, std::string_view sequence_id,
                                   uint64_t reservation_id, uint64_t payload_offset,
                                   absl::Span<const uint8_t> bytes) {
  return OnSequence(Of(session), sequence_id,
                    [&](Sequence& sequence, const SequenceEnv& env, Session&) {
                      return sequence.WriteReserved(env, reservation_id, payload_offset, bytes);
                    });
}

absl::StatusOr<CommitResult> KvPool::Commit(std::string_view session_id,
                                            std::string_view sequence_id, uint64_t reservation_id,
                                            bool compress_if_over_budget,
                                            const AttentionInput* attention) {
  KVS_ASSIGN_OR_RETURN(SessionRef session, FindSession(session_id));
  return Commit(session, sequence_id, reservation_id, compress_if_over_budget, attention);
}

absl::StatusOr<CommitResult> KvPool::Commit(const SessionRef& session,
                                            std::string_view sequence_id, uint64_t reservation_id,
                                            bool compress_if_over_budget,
                                            const AttentionInput* attention) {
  return OnSequence(Of(session), sequence_id,
                    [&](Sequence& sequence, const SequenceEnv& env, Session&) {
                      return sequence.Commit(env, reservation_id, compress_if_over_budget,
                                             attention);
                    });
}

namespace {

// With the batch's sessions locked: every item's sequence (restored first when spilled) and
// pending reservation, into `sequences`; the first failure is recorded in `out`.
void CheckCommitItemsLocked(const BatchSessions& batch, absl::Span<const CommitItem> items,
                            TierMover& mover, std::vector<Sequence*>& sequences,
                            CommitBatchResult& out) {
  for (size_t i = 0; i < items.size(); ++i) {
    Session& session = batch.of(i);
    session.mu.AssertHeld();
    absl::StatusOr<Sequence*> sequence =
        BatchSequenceLocked(session, items[i].sequence_id, mover);
    absl::Status status = sequence.status();
    if (status.ok()) {
      sequences[i] = *sequence;
      if (const int64_t j = EarlierItem(absl::MakeConstSpan(sequences.data(), i), *sequence);
          j >= 0) {
        status = absl::InvalidArgumentError(absl::StrCat(
            "sequence ", Sv(items[i].sequence_id), " is already committed by item ", j));
      }
    }
    if (status.ok()) status = sequences[i]->CheckPending(items[i].reservation_id);
    if (!status.ok()) {
      out.failed = static_cast<int32_t>(i);
      out.status = status;
      return;
    }
  }
}

// With the batch's sessions locked and every item's reservation checked: the rows every
// item's worker wrote, checked for finiteness in one backend call over the whole batch (a decode
// token is a few rows of every layer of every item: one call per item ran each on one thread).
// Per item, the outcome its commit reports where it would have run the check.
template <typename EnvFn>
std::vector<absl::Status> CheckBatchRowsLocked(const BatchSessions& batch,
                                               absl::Span<Sequence* const> sequences,
                                               Backend& backend, EnvFn&& env_of) {
  PendingRowChecks checks;
  for (size_t i = 0; i < sequences.size(); ++i) {
    Session& session = batch.of(i);
    session.mu.AssertHeld();
    sequences[i]->AddPendingRowChecks(env_of(session), checks);
  }
  // Each job names its own arena: one call covers items of different sessions.
  const absl::Status ran = checks.Run(backend);
  std::vector<absl::Status> statuses(sequences.size(), ran);
  if (!ran.ok()) return statuses;
  for (size_t i = 0; i < sequences.size(); ++i) {
    statuses[i] = sequences[i]->PendingRowsResult(checks.first(i));
  }
  return statuses;
}

}  // namespace

CommitBatchResult KvPool::CommitBatch(absl::Span<const CommitItem> items,
                                      absl::Span<const SessionRef> found) {
  CommitBatchResult out;
  // The batch's sessions, each looked up once (a decode batch names one session many times);
  // those the caller found are not looked up again.
  BatchSessions batch;
  for (const SessionRef& session : found) batch.Add(session.session_);
  size_t failed = 0;
  if (absl::Status looked_up = batch.Find(*sessions_, items, &failed); !looked_up.ok()) {
    out.failed = static_cast<int32_t>(failed);
    out.status = looked_up;
    return out;
  }
  // Locked together, in id order as DecodeStep does, so that what is checked is what commits.
  batch.LockAll();
  // 1. Every item's sequence and pending reservation.
  std::vector<Sequence*> sequences(items.size(), nullptr);
  CheckCommitItemsLocked(batch, items, *mover_, sequences, out);
  // 2. The rows of every item, checked in one backend call.
  std::vector<absl::Status> rows_checked;
  if (out.status.ok()) {
    rows_checked = CheckBatchRowsLocked(
        batch, sequences, *backend_,
        [this](Session& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) { return EnvOf(s); });
  }
  // 3. Commit them in order.
  const absl::Time now = clock_->Now();
  out.results.reserve(items.size());
  for (size_t i = 0; i < items.size() && out.status.ok(); ++i) {
    Session& session = batch.of(i);
    session.mu.AssertHeld();
    sequences[i]->Touch(now);
    absl::StatusOr<CommitResult> result = sequences[i]->Commit(
        EnvOf(session), items[i].reservation_id, items[i].compress_if_over_budget,
        items[i].attention, &rows_checked[i]);
    if (!result.ok()) {
      out.failed = static_cast<int32_t>(i);
      out.status = result.status();
    } else {
      out.results.push_back(*std::move(result));
    }
  }
  batch.UnlockAll();
  return out;
}

absl::StatusOr<CompressResult> KvPool::Compress(std::string_view session_id,
                                                std::string_view sequence_id,
                                                const CompressParams& params) {
  KVS_ASSIGN_OR_RETURN(SessionRef session, FindSession(session_id));
  return Compress(session, sequence_id, params);
}

absl::StatusOr<CompressResult> KvPool::Compress(const SessionRef& session,
                                                std::string_view sequence_id,
                                                const CompressParams& params) {
  return OnSequence(Of(session), sequence_id,
                    [&](Sequence& sequence, const SequenceEnv& env, Session&) {
                      return sequence.Compress(env, params);
                    });
}

absl::StatusOr<SequenceLayout> KvPool::GetLayout(std::string_view session_id,
                                                 std::string_view sequence_id,
                                                 absl::Span<const int32_t> layers,
                                                 bool with_positions) const {
  KVS_ASSIGN_OR_RETURN(SessionRef session, FindSession(session_id));
  return GetLayout(session, sequence_id, layers, with_positions);
}

absl::StatusOr<SequenceLayout> KvPool::GetLayout(const SessionRef& session,
                                                 std::string_view sequence_id,
                                                 absl::Span<const int32_t> layers,
                                                 bool with_positions) const {
  return OnSequence(Of(session), sequence_id,
                    [&](Sequence& sequence, const SequenceEnv& env, Session&) {
                      return sequence.GetLayout(env, layers, with_positions);
                    });
}

absl::Status KvPool::ReadExport(std::string_view session_id, std::string_view sequence_id,
                                absl::Span<const int32_t> layers, uint64_t version,
                                uint64_t payload_offset, absl::Span<uint8_t> out) const {
  return OnSequence(session_id, sequence_id,
                    [&](Sequence& sequence, const SequenceEnv& env, Session&) {
                      return sequence.ReadExport(env, layers, version, payload_offset, out);
                    });
}

absl::Status KvPool::ReadExport(const SessionRef& session, std::string_view sequence_id,
                                absl::Span<const int32_t> layers, uint64_t version,
                                uint64_t payload_offset, absl::Span<uint8_t> out) const {
  return OnSequence(Of(session), sequence_id,
                    [&](Sequence& sequence, const SequenceEnv& env, Session&) {
                      return sequence.ReadExport(env, layers, version, payload_offset, out);
                    });
}

// ---- Decode steps and OmniKV selection ----

namespace {

// Tenant arena quotas, before any lock: a tenant at its quota may not grow.
absl::Status CheckDecodeQuotas(const BatchSessions& batch, absl::Span<const DecodeItem> items,
                               const TenantLedger& ledger) {
  for (size_t i = 0; i < items.size(); ++i) {
    if (items[i].inline_kv.empty()) continue;  // commits of reservations already counted
    if (absl::Status quota = ledger.CheckArenaGrowth(batch.of(i).tenant); !quota.ok()) {
      return ItemError(i, quota);
    }
  }
  return absl::OkStatus();
}

// With the batch's sessions locked: every item's sequence (restored first when spilled) and its
// step checked (Sequence::CheckDecode) into `tasks`, the rows workers wrote into reservations
// checked in one backend call for the whole batch; nothing changes. The lowest failing item's
// error.
template <typename EnvFn>
absl::Status CheckDecodeItemsLocked(const BatchSessions& batch, absl::Span<const DecodeItem> items,
                                    TierMover& mover, EnvFn&& env_of,
                                    std::vector<Sequence::DecodeTask>& tasks) {
  std::vector<Sequence*> sequences(items.size(), nullptr);
  PendingRowChecks checks;
  size_t failed = items.size();
  absl::Status failure;
  for (size_t i = 0; i < items.size() && failed == items.size(); ++i) {
    Session& session = batch.of(i);
    session.mu.AssertHeld();
    absl::Status status =
        DistinctSequenceLocked(batch, items[i].sequence_id, i, mover, "stepped", sequences);
    if (status.ok()) {
      absl::StatusOr<Sequence::DecodePlan> plan =
          sequences[i]->CheckDecode(env_of(session), items[i], &checks);
      if (plan.ok()) {
        tasks[i].plan = *std::move(plan);
      } else {
        status = plan.status();
      }
    }
    tasks[i].sequence = sequences[i];
    tasks[i].item = &items[i];
    if (!status.ok()) {
      failed = i;
      failure = std::move(status);
    }
  }
  if (checks.groups() > 0) {
    Session& first = batch.of(0);
    first.mu.AssertHeld();
    KVS_RETURN_IF_ERROR(checks.Run(env_of(first).backend));
    for (size_t i = 0; i < failed; ++i) {
      if (!tasks[i].plan.rows_group.has_value()) continue;
      absl::Status rows =
          tasks[i].sequence->PendingRowsResult(checks.first(*tasks[i].plan.rows_group));
      if (!rows.ok()) return ItemError(i, rows);
    }
  }
  if (failed < items.size()) return ItemError(failed, failure);
  return absl::OkStatus();
}

// With the batch's sessions locked and every item checked: the items' steps together
// (Sequence::DecodeAll: each phase one backend call for every item's layers); results in item
// order. A failure leaves every item as it was.
template <typename EnvFn>
absl::StatusOr<std::vector<DecodeResult>> RunDecodeItemsLocked(
    const BatchSessions& batch, absl::Span<const DecodeItem> items,
    std::vector<Sequence::DecodeTask>& tasks, EnvFn&& env_of, absl::Time now) {
  // Items are distinct sequences, so they share nothing but their session's block allocator and
  // arena (disjoint blocks); reservation ids and last-use times are handed out here, in item
  // order.
  std::vector<SequenceEnv> envs;
  envs.reserve(batch.sessions().size());
  for (const std::shared_ptr<Session>& session : batch.sessions()) {
    session->mu.AssertHeld();
    envs.push_back(env_of(*session));
  }
  for (size_t i = 0; i < items.size(); ++i) {
    Session& session = batch.of(i);
    session.mu.AssertHeld();
    tasks[i].sequence->Touch(now);
    tasks[i].env = &envs[batch.index_of(i)];
    tasks[i].reservation_id = session.next_reservation_id;
    if (!items[i].inline_kv.empty()) ++session.next_reservation_id;
  }
  KVS_RETURN_IF_ERROR(Sequence::DecodeAll(absl::MakeSpan(tasks)));
  std::vector<DecodeResult> results(items.size());
  for (size_t i = 0; i < items.size(); ++i) results[i] = std::move(tasks[i].result);
  return results;
}

// With the batch's sessions locked: every item's sequence (restored first when spilled) and its
// Select checked (Sequence::CheckSelect) into `tasks`; nothing changes. A sequence named twice
// is refused.
absl::Status CheckSelectItemsLocked(const BatchSessions& batch, absl::Span<const SelectItem> items,
                                    TierMover& mover, const std::vector<SequenceEnv>& envs,
                                    std::vector<SelectTask>& tasks) {
  std::vector<Sequence*> sequences(items.size(), nullptr);
  for (size_t i = 0; i < items.size(); ++i) {
    const SequenceEnv& env = envs[batch.index_of(i)];
    absl::Status status =
        DistinctSequenceLocked(batch, items[i].sequence_id, i, mover, "selected", sequences);
    if (status.ok()) status = sequences[i]->CheckSelect(env, items[i]);
    if (!status.ok()) return ItemError(i, status);
    tasks[i].sequence = sequences[i];
    tasks[i].env = &env;
    tasks[i].item = &items[i];
    tasks[i].pin = &batch.of(i).host_pin;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<DecodeResult>> KvPool::DecodeStep(absl::Span<const DecodeItem> items,
                                                              absl::Span<const SessionRef> found) {
  BatchSessions batch;
  for (const SessionRef& session : found) batch.Add(session.session_);
  size_t failed = 0;
  if (absl::Status found = batch.Find(*sessions_, items, &failed); !found.ok()) {
    return ItemError(failed, found);
  }
  KVS_RETURN_IF_ERROR(CheckDecodeQuotas(batch, items, *ledger_));
  // Locked together so that every item is validated against exactly the state it then runs on.
  batch.LockAll();
  auto env_of = [this](Session& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) { return EnvOf(s); };
  std::vector<Sequence::DecodeTask> tasks(items.size());
  absl::Status checked = CheckDecodeItemsLocked(batch, items, *mover_, env_of, tasks);
  absl::StatusOr<std::vector<DecodeResult>> results =
      checked.ok() ? RunDecodeItemsLocked(batch, items, tasks, env_of, clock_->Now())
                   : absl::StatusOr<std::vector<DecodeResult>>(checked);
  batch.UnlockAll();
  return results;
}

absl::StatusOr<std::vector<SelectResult>> KvPool::Select(absl::Span<const SelectItem> items,
                                                          absl::Span<const SessionRef> found) {
  BatchSessions batch;
  for (const SessionRef& session : found) batch.Add(session.session_);
  size_t failed = 0;
  if (absl::Status found = batch.Find(*sessions_, items, &failed); !found.ok()) {
    return ItemError(failed, found);
  }
  // Locked together (as DecodeStep) so that every item is checked against exactly the state it
  // then runs on.
  batch.LockAll();
  std::vector<SequenceEnv> envs;
  envs.reserve(batch.sessions().size());
  for (const std::shared_ptr<Session>& session : batch.sessions()) {
    session->mu.AssertHeld();
    envs.push_back(EnvOf(*session));
  }
  std::vector<SelectTask> tasks(items.size());
  absl::Status checked = CheckSelectItemsLocked(batch, items, *mover_, envs, tasks);
  if (!checked.ok()) {
    batch.UnlockAll();
    return checked;
  }
  // Side by side (RunSelects): the results are those of running the items in order.
  const absl::Time now = clock_->Now();
  for (SelectTask& task : tasks) task.sequence->Touch(now);
  absl::StatusOr<std::vector<SelectResult>> results =
      RunSelects(absl::MakeSpan(tasks), *decode_pool_);
  batch.UnlockAll();
  return results;
}

absl::StatusOr<std::vector<RetainedHead>> KvPool::GetRetained(std::string_view session_id,
                                                              std::string_view sequence_id,
                                                              absl::Span<const int32_t> layers) {
  KVS_ASSIGN_OR_RETURN(SessionRef session, FindSession(session_id));
  return GetRetained(session, sequence_id, layers);
}

absl::StatusOr<std::vector<RetainedHead>> KvPool::GetRetained(const SessionRef& session,
                                                              std::string_view sequence_id,
                                                              absl::Span<const int32_t> layers) {
  return std::as_const(*this).OnSequence(
      Of(session), sequence_id,
      [&](Sequence& sequence, const SequenceEnv&, Session&) { return sequence.Retained(layers); });
}

absl::StatusOr<std::vector<LayerScores>> KvPool::Score(std::string_view session_id,
                                                       std::string_view sequence_id,
                                                       const ScoreParams& params) {
  KVS_ASSIGN_OR_RETURN(SessionRef session, FindSession(session_id));
  return Score(session, sequence_id, params);
}

absl::StatusOr<std::vector<LayerScores>> KvPool::Score(const SessionRef& session,
                                                       std::string_view sequence_id,
                                                       const ScoreParams& params) {
  return std::as_const(*this).OnSequence(
      Of(session), sequence_id, [&](Sequence& sequence, const SequenceEnv& env, Session&) {
        return sequence.Score(env, params);
      });
}

// ---- Introspection (Admin) ----

PoolStats KvPool::GetStats() const {
  PoolStats stats;
  const SessionTable::Totals totals = sessions_->GetTotals();
  stats.sessions = totals.sessions;
  stats.arena_bytes_capacity = options_.arena_capacity_bytes;
  stats.arena_bytes_reserved = totals.arena_bytes_reserved;
  stats.sessions_reclaimed = totals.sessions_reclaimed;
  for (const std::shared_ptr<Session>& session : sessions_->All()) {
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
  stats.spilled_on_pressure = mover_->spilled_on_pressure();
  return stats;
}

std::vector<SessionInfo> KvPool::ListSessions() const {
  std::vector<SessionInfo> result;
  for (const std::shared_ptr<Session>& session : sessions_->All()) {
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

namespace {

SequenceInfo InfoOf(const Session& session, const std::string& id, const Sequence& sequence) {
  SequenceInfo info;
  info.session_id = session.id;
  info.sequence_id = id;
  info.tenant = session.tenant;
  info.policy = sequence.policy_config();
  info.budget = sequence.budget();
  info.tokens_per_layer = sequence.counts();
  info.arena_bytes = static_cast<uint64_t>(sequence.blocks_held()) * session.block_bytes;
  info.host_bytes = sequence.host_bytes();
  info.created = sequence.created();
  info.last_used = sequence.last_used();
  return info;
}

// Policy, budget and kept tokens as they were when it left the arena (a spilled sequence does
// not change until it is restored); tier and bytes as the tiers hold it now.
SequenceInfo SpilledInfoOf(const Session& session, const std::string& id,
                           const SpilledSequenceInfo& spilled_info, const TierMover& mover) {
  SequenceInfo info;
  info.session_id = session.id;
  info.sequence_id = id;
  info.tenant = session.tenant;
  info.policy = spilled_info.policy;
  info.budget = spilled_info.budget;
  info.tokens_per_layer = spilled_info.tokens_per_layer;
  info.tier = spilled_info.tier;
  info.created = spilled_info.created;
  info.last_used = spilled_info.last_used;
  if (std::optional<SpilledInfo> spilled = mover.Find(SpillKey{session.tenant, session.id, id})) {
    info.tier = spilled->tier;  // the tiers may have demoted it since
    if (spilled->tier != StorageTier::kRemote) {
      (spilled->tier == StorageTier::kHost ? info.host_bytes : info.disk_bytes) = spilled->bytes;
    }
    info.last_used = spilled->spilled;
  }
  return info;
}

}  // namespace

std::vector<SequenceInfo> KvPool::ListSequences(std::string_view session_id) const {
  std::vector<std::shared_ptr<Session>> sessions;
  if (session_id.empty()) {
    sessions = sessions_->All();
  } else {
    // Admin lists a session whose lease lapsed until the reaper ends it.
    for (std::shared_ptr<Session>& session : sessions_->All()) {
      if (session->id == session_id) sessions.push_back(std::move(session));
    }
  }
  std::vector<SequenceInfo> result;
  for (const std::shared_ptr<Session>& session : sessions) {
    absl::MutexLock lock(&session->mu);
    if (session->dead) continue;
    for (const auto& [id, sequence] : session->sequences) {
      result.push_back(InfoOf(*session, id, *sequence));
    }
    for (const auto& [id, spilled_info] : session->spilled) {
      result.push_back(SpilledInfoOf(*session, id, spilled_info, *mover_));
    }
  }
  std::sort(result.begin(), result.end(), [](const SequenceInfo& a, const SequenceInfo& b) {
    return std::tie(a.session_id, a.sequence_id) < std::tie(b.session_id, b.sequence_id);
  });
  return result;
}

// ---- Live defaults, quotas, re-budget (Admin) ----

void KvPool::SetDefaults(std::optional<PolicyConfig> policy, std::optional<BudgetConfig> budget) {
  absl::MutexLock lock(&defaults_mu_);
  if (policy) live_default_policy_ = *std::move(policy);
  if (budget) live_default_budget_ = *std::move(budget);
}

PolicyConfig KvPool::default_policy() const {
  absl::MutexLock lock(&defaults_mu_);
  return live_default_policy_;
}

BudgetConfig KvPool::default_budget() const {
  absl::MutexLock lock(&defaults_mu_);
  return live_default_budget_;
}

void KvPool::SetTenantQuota(const std::string& tenant, const TenantQuota& quota) {
  ledger_->SetQuota(tenant, quota);
}

TenantQuota KvPool::GetTenantQuota(std::string_view tenant) const {
  return ledger_->Quota(tenant);
}

std::vector<std::pair<std::string, TenantQuota>> KvPool::TenantQuotas() const {
  return ledger_->Quotas();
}

TenantUsage KvPool::GetTenantUsage(std::string_view tenant) const {
  return ledger_->Usage(tenant);
}

std::vector<std::pair<std::string, TenantUsage>> KvPool::AllTenantUsage() const {
  return ledger_->AllUsage();
}

absl::Status KvPool::CheckTierQuota(std::string_view tenant, bool host,
                                    uint64_t extra_bytes) const {
  return ledger_->CheckTier(tenant, host, extra_bytes);
}

absl::Status KvPool::CheckTierQuota(std::string_view tenant, StorageTier tier,
                                    uint64_t extra_bytes) const {
  return ledger_->CheckTier(tenant, tier, extra_bytes);
}

void KvPool::SetTierUsageFn(std::function<uint64_t(std::string_view tenant, bool host)> fn) {
  ledger_->SetTierUsageFn(std::move(fn));
}

void KvPool::SetRemoteUsageFn(std::function<uint64_t(std::string_view tenant)> fn) {
  ledger_->SetRemoteUsageFn(std::move(fn));
}

uint64_t KvPool::TenantRemoteBytes(std::string_view tenant) const {
  return ledger_->RemoteBytes(tenant);
}

namespace {

// Gives `sequence` the budget `tokens_per_layer` and compresses it to it (RebudgetTenant); the
// reason it was skipped, or empty.
std::string RebudgetOne(Sequence& sequence, const SequenceEnv& env, int32_t tokens_per_layer,
                        int64_t per_layer_capacity) {
  BudgetConfig budget = sequence.budget();
  budget.tokens_per_layer = tokens_per_layer;
  budget.per_layer_tokens.clear();
  const int64_t needed = budget.strict ? int64_t{tokens_per_layer} + budget.prefill_block_tokens
                                       : int64_t{tokens_per_layer};
  if (needed > per_layer_capacity) {
    return absl::StrCat("the session's arena holds ", per_layer_capacity,
                        " tokens per layer, the budget ", "needs ", needed);
  }
  if (sequence.has_pending()) return "a reservation is pending";
  const BudgetConfig old = sequence.budget();
  sequence.set_budget(budget);
  absl::StatusOr<CompressResult> compressed = sequence.Compress(env, CompressParams{});
  if (compressed.ok()) return "";
  // Attention policies over budget: they keep the new budget and compress at their next step
  // (Commit/DecodeStep bring the queries); anything else is rolled back. (INVALID_ARGUMENT names
  // the missing attention; the sequence is unchanged by it).
  if (compressed.status().code() != absl::StatusCode::kInvalidArgument) {
    sequence.set_budget(old);
  }
  return std::string(compressed.status().message());
}

}  // namespace

RebudgetResult KvPool::RebudgetTenant(std::string_view tenant, int32_t tokens_per_layer) {
  std::vector<std::shared_ptr<Session>> sessions =
      tenant == "*" ? sessions_->All() : sessions_->OfTenant(tenant);
  std::sort(sessions.begin(), sessions.end(),
            [](const auto& a, const auto& b) { return a->id < b->id; });
  RebudgetResult result;
  for (const std::shared_ptr<Session>& session : sessions) {
    absl::MutexLock lock(&session->mu);
    if (session->dead) continue;
    const int64_t per_layer_capacity =
        int64_t{session->num_blocks / session->layout.num_layers} * session->layout.block_tokens;
    const SequenceEnv env = EnvOf(*session);
    std::vector<std::string> ids;
    for (const auto& [id, sequence] : session->sequences) ids.push_back(id);
    std::sort(ids.begin(), ids.end());
    for (const std::string& id : ids) {
      const std::string skipped = RebudgetOne(*session->sequences.at(id), env, tokens_per_layer,
                                              per_layer_capacity);
      if (skipped.empty()) {
        ++result.rebudgeted;
      } else {
        result.skipped.push_back(absl::StrCat(session->id, "/", id, ": ", skipped));
      }
    }
    session->free_blocks_hint = session->allocator.free_blocks();
  }
  return result;
}

// ---- Tiers (TierMover) ----

absl::StatusOr<SpillResult> KvPool::Spill(std::string_view session_id, std::string_view sequence_id,
                                          StorageTier target) {
  return Spill(FindSession(session_id), sequence_id, target);
}

absl::StatusOr<SpillResult> KvPool::Spill(const absl::StatusOr<SessionRef>& session,
                                          std::string_view sequence_id, StorageTier target) {
  if (!mover_->has_tiers()) return TierMover::NoTiers();
  if (target != StorageTier::kHost && target != StorageTier::kDisk &&
      target != StorageTier::kRemote) {
    return absl::InvalidArgumentError(absl::StrCat(
        "target must be TIER_HOST, TIER_DISK or TIER_REMOTE, got ", static_cast<int>(target)));
  }
  KVS_RETURN_IF_ERROR(session.status());
  return mover_->Spill(Of(*session), sequence_id, target);
}

absl::StatusOr<SpillResult> KvPool::Restore(std::string_view session_id,
                                            std::string_view sequence_id,
                                            std::string_view from_session_id) {
  return Restore(FindSession(session_id), sequence_id, from_session_id);
}

absl::StatusOr<SpillResult> KvPool::Restore(const absl::StatusOr<SessionRef>& session,
                                            std::string_view sequence_id,
                                            std::string_view from_session_id) {
  if (!mover_->has_tiers()) return TierMover::NoTiers();
  KVS_RETURN_IF_ERROR(session.status());
  return mover_->Restore(Of(*session), sequence_id, from_session_id);
}

absl::StatusOr<SpillResult> KvPool::Publish(std::string_view session_id,
                                            std::string_view sequence_id,
                                            std::string_view prefix_key, int32_t query_window) {
  return Publish(FindSession(session_id), sequence_id, prefix_key, query_window, std::nullopt);
}

absl::StatusOr<SpillResult> KvPool::Publish(const absl::StatusOr<SessionRef>& session,
                                            std::string_view sequence_id,
                                            std::string_view prefix_key, int32_t query_window,
                                            std::optional<StorageTier> target) {
  if (!mover_->has_tiers()) return TierMover::NoTiers();
  KVS_RETURN_IF_ERROR(ValidatePrefixKey(prefix_key, "prefix_key"));
  if (query_window < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("query_window must be >= 0 (0 = none stated), got ", query_window));
  }
  if (target && *target == StorageTier::kArena) {
    return absl::InvalidArgumentError(
        "tier: a prefix is published to TIER_HOST, TIER_DISK or TIER_REMOTE, not TIER_ARENA");
  }
  KVS_RETURN_IF_ERROR(session.status());
  return mover_->Publish(Of(*session), sequence_id, prefix_key, query_window, target);
}

absl::StatusOr<std::vector<std::optional<SpilledInfo>>> KvPool::LookupPrefixes(
    const absl::StatusOr<SessionRef>& session, const std::vector<std::string>& keys) const {
  if (!mover_->has_tiers()) return TierMover::NoTiers();
  for (size_t i = 0; i < keys.size(); ++i) {
    KVS_RETURN_IF_ERROR(ValidatePrefixKey(keys[i], absl::StrCat("prefix_keys[", i, "]")));
  }
  KVS_RETURN_IF_ERROR(session.status());
  Session& live = Of(*session);
  KVS_RETURN_IF_ERROR(CheckNotEnded(live));
  std::vector<std::optional<SpilledInfo>> found;
  found.reserve(keys.size());
  for (const std::string& key : keys) found.push_back(mover_->FindPrefix(live, key));
  return found;
}

absl::Status KvPool::Unpublish(std::string_view session_id, std::string_view prefix_key) {
  return Unpublish(FindSession(session_id), prefix_key);
}

absl::Status KvPool::Unpublish(const absl::StatusOr<SessionRef>& session,
                               std::string_view prefix_key) {
  if (!mover_->has_tiers()) return TierMover::NoTiers();
  KVS_RETURN_IF_ERROR(ValidatePrefixKey(prefix_key, "prefix_key"));
  KVS_RETURN_IF_ERROR(session.status());
  Session& live = Of(*session);
  // Unpublish touches only the tenant's copy, not the session, so the session is checked here.
  KVS_RETURN_IF_ERROR(CheckNotEnded(live));
  return mover_->Unpublish(live, prefix_key);
}

std::vector<SpilledInfo> KvPool::ListSpilled() const { return mover_->List(); }

// ---- Per-policy totals (metrics) ----

void KvPool::RetireTotals(const Sequence& sequence) {
  const Sequence::Totals& totals = sequence.totals();
  absl::MutexLock lock(&defaults_mu_);
  PolicyTokenTotals& retired = retired_[sequence.policy_config().name];
  retired.appended += totals.appended;
  retired.evicted += totals.evicted;
  retired.merged += totals.merged;
}

std::vector<PolicyTokenTotals> KvPool::PolicyTotals() const {
  absl::flat_hash_map<std::string, PolicyTokenTotals> by_policy;
  {
    absl::MutexLock lock(&defaults_mu_);
    by_policy = retired_;
  }
  for (const std::shared_ptr<Session>& session : sessions_->All()) {
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
