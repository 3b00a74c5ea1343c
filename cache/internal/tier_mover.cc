#include "cache/internal/tier_mover.h"

#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cache/policy/policy.h"
#include "cache/sequence_snapshot.h"
#include "gpu/base/status_macros.h"

namespace kvs {
namespace {

// Releases an adoption claim (TierMover::ClaimAdoption) when the Restore that took it returns.
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

absl::Status NotSpillable(std::string_view sequence_id, std::string_view what) {
  return absl::FailedPreconditionError(
      absl::StrCat("sequence ", Sv(sequence_id),
                   " is an OmniKV sequence that has selected: its cache spans the arena, its "
                   "staging blocks and the host tier, and cannot be ",
                   Sv(what)));
}

absl::Status LayoutMismatch(std::string_view field, int64_t published, int64_t here) {
  return absl::FailedPreconditionError(
      absl::StrCat("from_prefix: the prefix was published from a session with ", Sv(field), " ",
                   published, "; this session's ", Sv(field), " is ", here));
}

// A prefix fits only a session of the same model layout.
absl::Status CheckPrefixLayout(const ModelLayout& have, const ModelLayout& want) {
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
  return absl::OkStatus();
}

// The policy's resolved parameters as bytes (the snapshot encoding of a sequence holding only
// them), for comparing two configurations field by field without a hand-written operator.
std::string PolicyBytes(const PolicyConfig& policy) {
  SequenceSnapshot snapshot;
  snapshot.policy = policy;
  return EncodeSnapshot(snapshot);
}

// A policy asked for with from_prefix must be the published one, parameters included.
absl::Status CheckPrefixPolicy(const std::optional<PolicyConfig>& asked,
                               const PolicyConfig& published) {
  if (!asked.has_value()) return absl::OkStatus();
  if (asked->name != published.name) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.name: the prefix was published with policy ", published.name,
        ", the request asks for ", asked->name,
        " (leave policy unset to take the published one)"));
  }
  KVS_ASSIGN_OR_RETURN(std::unique_ptr<Policy> requested, MakePolicy(*asked));
  if (PolicyBytes(requested->config()) != PolicyBytes(published)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy: the parameters of policy ", published.name,
        " differ from those the prefix was published with (leave policy unset to take them)"));
  }
  return absl::OkStatus();
}

// A budget asked for with from_prefix must be the published one.
absl::Status CheckPrefixBudget(const std::optional<BudgetConfig>& budget,
                               const BudgetConfig& published) {
  if (!budget.has_value()) return absl::OkStatus();
  BudgetConfig asked = *budget;
  if (asked.prefill_block_tokens == 0) {
    asked.prefill_block_tokens = BudgetConfig{}.prefill_block_tokens;
  }
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
  return absl::OkStatus();
}

}  // namespace

TierMover::TierMover(Backend* backend, const PoolOptions* options, const SessionTable* sessions,
                     TenantLedger* ledger)
    : backend_(backend), options_(options), sessions_(sessions), ledger_(ledger) {}

absl::Status TierMover::NoTiers() {
  return absl::UnimplementedError(
      "Spill and Restore need storage tiers, which this pool was built without");
}

HostPin TierMover::HostPinFor(const std::string& tenant, const std::string& session_id) const {
  if (options_->tiers == nullptr) return HostPin();
  return [tiers = options_->tiers, ledger = ledger_, tenant, session_id](
             const SpillKey& key, std::shared_ptr<const SpilledSequence> data) -> absl::Status {
    const SpillKey full{tenant, session_id, key.sequence_id};
    if (data == nullptr) return tiers->Erase(full);
    KVS_RETURN_IF_ERROR(ledger->CheckTier(tenant, /*host=*/true, data->bytes()));
    return tiers->PutPinnedHost(full, std::move(data));
  };
}

// The copy is deleted once the sequence is in the arena (a failed deletion only leaves a stale
// copy a later Restore would refuse as ALREADY_EXISTS, never a wrong sequence).
absl::Status TierMover::RestoreKeyLocked(Session& session, const SpillKey& key) {
  SequenceTiers& tiers = *options_->tiers;
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<const SpilledSequence> data, tiers.Get(key));
  const SequenceEnv env = session.Env(*backend_, options_->max_tokens_per_call);
  absl::StatusOr<std::unique_ptr<Sequence>> restored = Sequence::Restore(env, *data);
  if (!restored.ok()) {
    // The copy stays: give up the claim a remote Get took, for a later restore.
    tiers.Release(key);
    return restored.status();
  }
  std::unique_ptr<Sequence> sequence = *std::move(restored);
  if (sequence->id() != key.sequence_id) {
    sequence->Release(env);
    tiers.Release(key);
    return absl::DataLossError(absl::StrCat("the spilled copy of sequence ", key.sequence_id,
                                            " holds sequence ", sequence->id()));
  }
  session.sequences.emplace(key.sequence_id, std::move(sequence));
  session.free_blocks_hint = session.allocator.free_blocks();
  (void)tiers.Erase(key);
  return absl::OkStatus();
}

absl::Status TierMover::RestoreSpilledLocked(Session& session, std::string_view sequence_id) {
  if (options_->tiers == nullptr) return NoTiers();
  const SpillKey key{session.tenant, session.id, std::string(sequence_id)};
  // The automatic restore of a data-plane call is held to the tenant's arena quota too.
  if (const std::optional<SpilledInfo> copy = options_->tiers->Find(key);
      copy && copy->lost.empty()) {
    KVS_RETURN_IF_ERROR(ledger_->CheckRestore(session.tenant, sequence_id, copy->bytes));
  }
  KVS_RETURN_IF_ERROR(RestoreKeyLocked(session, key));
  session.spilled.erase(Sv(sequence_id));
  return absl::OkStatus();
}

bool TierMover::DemoteOneLocked(Session& session, const Sequence& keep, const SequenceEnv& env) {
  if (options_->tiers == nullptr) return false;
  Sequence* victim = nullptr;
  for (auto& [id, other] : session.sequences) {
    if (other.get() == &keep || other->has_pending() || other->blocks_held() == 0 ||
        !other->spillable()) {
      continue;
    }
    if (victim == nullptr || other->last_used() < victim->last_used()) victim = other.get();
  }
  if (victim == nullptr) return false;
  absl::StatusOr<SpilledSequence> data = victim->Spill(env);
  if (!data.ok()) return false;
  const SpillKey key{session.tenant, session.id, victim->id()};
  if (!ledger_->CheckTier(session.tenant, /*host=*/true, data->bytes()).ok() ||
      !options_->tiers->Put(StorageTier::kHost, key, *std::move(data)).ok()) {
    return false;
  }
  session.spilled[key.sequence_id] = SpilledSequenceInfo::Of(*victim, StorageTier::kHost);
  victim->Release(env);
  session.sequences.erase(key.sequence_id);
  ++spilled_on_pressure_;
  return true;
}

absl::StatusOr<SpillResult> TierMover::MoveSpilledLocked(Session& session,
                                                         SpilledSequenceInfo& spilled,
                                                         const SpillKey& key,
                                                         StorageTier target) {
  SequenceTiers& tiers = *options_->tiers;
  if (target == StorageTier::kRemote && spilled.tier == StorageTier::kRemote) {
    // Already there: no need to read (and claim) the whole copy back to say so.
    if (const std::optional<SpilledInfo> info = tiers.Find(key);
        info && info->lost.empty() && info->tier == StorageTier::kRemote) {
      return SpillResult{target, info->bytes};
    }
  }
  KVS_ASSIGN_OR_RETURN(std::shared_ptr<const SpilledSequence> data, tiers.Get(key));
  const uint64_t bytes = data->bytes();
  if (spilled.tier == target) {
    tiers.Release(key);  // nothing moves: give up a remote claim Get took
    return SpillResult{target, bytes};
  }
  if (absl::Status quota = ledger_->CheckTier(session.tenant, target, bytes); !quota.ok()) {
    tiers.Release(key);
    return quota;
  }
  // Put replaces the other tier's copy.
  if (absl::Status put = tiers.Put(target, key, SpilledSequence(*data)); !put.ok()) {
    tiers.Release(key);
    return put;
  }
  spilled.tier = target;
  return SpillResult{target, bytes};
}

absl::StatusOr<SpillResult> TierMover::Spill(Session& session, std::string_view sequence_id,
                                             StorageTier target) {
  absl::MutexLock lock(&session.mu);
  if (session.dead) return SessionGone(session.id);
  const SpillKey key{session.tenant, session.id, std::string(sequence_id)};
  if (auto spilled = session.spilled.find(Sv(sequence_id)); spilled != session.spilled.end()) {
    return MoveSpilledLocked(session, spilled->second, key, target);
  }
  auto it = session.sequences.find(Sv(sequence_id));
  if (it == session.sequences.end()) return SequenceNotFound(sequence_id, session.id);
  const SequenceEnv env = session.Env(*backend_, options_->max_tokens_per_call);
  if (!it->second->spillable()) return NotSpillable(sequence_id, "spilled");
  KVS_ASSIGN_OR_RETURN(SpilledSequence data, it->second->Spill(env));
  const uint64_t bytes = data.bytes();
  KVS_RETURN_IF_ERROR(ledger_->CheckTier(session.tenant, target, bytes));
  KVS_RETURN_IF_ERROR(options_->tiers->Put(target, key, std::move(data)));
  session.spilled[key.sequence_id] = SpilledSequenceInfo::Of(*it->second, target);
  it->second->Release(env);
  session.sequences.erase(it);
  session.free_blocks_hint = session.allocator.free_blocks();
  return SpillResult{target, bytes};
}

absl::StatusOr<SpillResult> TierMover::AdoptLocked(Session& session, const SpillKey& key) {
  const std::optional<SpilledInfo> info = options_->tiers->Find(key);
  if (!info) {
    return absl::NotFoundError(absl::StrCat("no spilled copy of sequence ", key.sequence_id,
                                            " of session ", key.session_id, " for tenant ",
                                            session.tenant));
  }
  if (session.sequences.contains(key.sequence_id) || session.spilled.contains(key.sequence_id)) {
    return absl::AlreadyExistsError(absl::StrCat("sequence_id ", key.sequence_id,
                                                 " already exists in session ", session.id));
  }
  KVS_RETURN_IF_ERROR(ledger_->AddSequence(session.tenant));
  if (absl::Status status = RestoreKeyLocked(session, key); !status.ok()) {
    ledger_->RemoveSequences(session.tenant, 1);
    return status;
  }
  return SpillResult{info->tier, info->bytes};
}

absl::Status TierMover::CheckRestoreSource(std::string_view from_session_id, bool adopt) const {
  if (adopt && sessions_->Contains(from_session_id)) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", Sv(from_session_id),
                     " is still attached: restore its sequences through it "
                     "(from_session_id is for sequences whose session ended)"));
  }
  if (from_session_id == kPrefixSessionId) {
    return absl::InvalidArgumentError(
        "from_session_id: published prefixes are started from with CreateSequence(from_prefix), "
        "not restored");
  }
  return absl::OkStatus();
}

absl::Status TierMover::ClaimAdoption(const SpillKey& key, const std::string& session_id) {
  absl::MutexLock lock(&adopt_mu_);
  if (auto other = adopting_.find(key); other != adopting_.end()) {
    return absl::AbortedError(absl::StrCat(
        "the spilled copy of sequence ", key.sequence_id, " of session ", key.session_id,
        " is being adopted by session ", other->second, "; only one session can adopt it"));
  }
  adopting_.emplace(key, session_id);
  return absl::OkStatus();
}

absl::StatusOr<SpillResult> TierMover::Restore(Session& session, std::string_view sequence_id,
                                               std::string_view from_session_id) {
  const bool adopt = !from_session_id.empty() && from_session_id != session.id;
  KVS_RETURN_IF_ERROR(CheckRestoreSource(from_session_id, adopt));
  const SpillKey key{session.tenant, adopt ? std::string(from_session_id) : session.id,
                     std::string(sequence_id)};
  // The tenant's arena quota, before anything moves (and before the session lock: usage takes
  // the session table's lock): RESOURCE_EXHAUSTED naming it, the copy stays.
  if (const std::optional<SpilledInfo> pending = options_->tiers->Find(key);
      pending && pending->lost.empty()) {
    KVS_RETURN_IF_ERROR(ledger_->CheckRestore(session.tenant, sequence_id, pending->bytes));
  }
  // One adoption of a copy at a time: the first claims it until its restore ends (the copy is
  // erased then, so later ones find nothing); a concurrent one is ABORTED.
  std::optional<AdoptionClaim> claim;
  if (adopt) {
    KVS_RETURN_IF_ERROR(ClaimAdoption(key, session.id));
    claim.emplace(&adopt_mu_, &adopting_, key);
  }
  absl::MutexLock lock(&session.mu);
  if (session.dead) return SessionGone(session.id);
  if (adopt) return AdoptLocked(session, key);
  if (session.sequences.contains(Sv(sequence_id))) return SpillResult{StorageTier::kArena, 0};
  auto spilled = session.spilled.find(Sv(sequence_id));
  if (spilled == session.spilled.end()) return SequenceNotFound(sequence_id, session.id);
  const std::optional<SpilledInfo> info = options_->tiers->Find(key);
  const SpillResult result{info ? info->tier : spilled->second.tier, info ? info->bytes : 0};
  KVS_RETURN_IF_ERROR(RestoreSpilledLocked(session, sequence_id));
  return result;
}

absl::StatusOr<SpillResult> TierMover::Publish(Session& session, std::string_view sequence_id,
                                               std::string_view prefix_key,
                                               int32_t query_window,
                                               std::optional<StorageTier> target) {
  absl::MutexLock lock(&session.mu);
  if (session.dead) return SessionGone(session.id);
  auto it = session.sequences.find(Sv(sequence_id));
  if (it == session.sequences.end()) {
    if (auto spilled = session.spilled.find(Sv(sequence_id)); spilled != session.spilled.end()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "sequence ", Sv(sequence_id), " is spilled to the ",
          StorageTierName(spilled->second.tier), " tier: restore it before publishing it"));
    }
    return SequenceNotFound(sequence_id, session.id);
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
  if (!sequence.spillable()) return NotSpillable(sequence_id, "published");
  const SequenceEnv env = session.Env(*backend_, options_->max_tokens_per_call);
  KVS_ASSIGN_OR_RETURN(SpilledSequence data, sequence.Spill(env));
  const uint64_t bytes = data.bytes();
  const StorageTier tier = target.value_or(options_->tiers->has_remote() ? StorageTier::kRemote
                                                                          : StorageTier::kDisk);
  if (tier == StorageTier::kRemote && !options_->tiers->has_remote()) {
    return absl::FailedPreconditionError(
        "tier: TIER_REMOTE asked, but this sidecar has no remote tier (--remote_tier)");
  }
  KVS_RETURN_IF_ERROR(ledger_->CheckTier(session.tenant, tier, bytes));
  KVS_RETURN_IF_ERROR(
      options_->tiers->Put(tier, PrefixSpillKey(session.tenant, prefix_key), std::move(data)));
  return SpillResult{tier, bytes};
}

std::optional<SpilledInfo> TierMover::FindPrefix(const Session& session,
                                                 std::string_view prefix_key) const {
  // Under the caller's tenant only: another tenant's prefixes are never reported.
  std::optional<SpilledInfo> info =
      options_->tiers->Find(PrefixSpillKey(session.tenant, prefix_key));
  // A disk record that failed its checksum is no prefix to start from.
  if (info && !info->lost.empty()) return std::nullopt;
  return info;
}

absl::Status TierMover::Unpublish(const Session& session, std::string_view prefix_key) {
  const SpillKey key = PrefixSpillKey(session.tenant, prefix_key);
  if (!options_->tiers->Find(key)) {
    return absl::NotFoundError(absl::StrCat("prefix_key: tenant ", session.tenant,
                                            " has no prefix published under ", Sv(prefix_key)));
  }
  return options_->tiers->EraseShared(key);
}

absl::StatusOr<std::shared_ptr<const SpilledSequence>> TierMover::ReadPrefix(
    const Session& session, const SequenceParams& params) const {
  // The key is under the caller's tenant: another tenant's prefixes cannot be named.
  const SpillKey key = PrefixSpillKey(session.tenant, params.from_prefix);
  absl::StatusOr<std::shared_ptr<const SpilledSequence>> data = options_->tiers->Read(key);
  if (absl::IsNotFound(data.status())) {
    return absl::NotFoundError(absl::StrCat("from_prefix: tenant ", session.tenant,
                                            " has no prefix published under ",
                                            params.from_prefix));
  }
  if (!data.ok()) return data.status();
  KVS_ASSIGN_OR_RETURN(SequenceSnapshot snapshot, DecodeSnapshot((*data)->meta));
  KVS_RETURN_IF_ERROR(CheckPrefixLayout(snapshot.layout, session.layout));
  KVS_RETURN_IF_ERROR(CheckPrefixPolicy(params.policy, snapshot.policy));
  KVS_RETURN_IF_ERROR(CheckPrefixBudget(params.budget, snapshot.budget));
  return data;
}

int32_t TierMover::EndSpilledLocked(Session& session) {
  int32_t count = 0;
  // The tiers may have demoted a host copy to disk since it was spilled: ask them where it is.
  for (const auto& [id, info] : session.spilled) {
    if (options_->tiers != nullptr) {
      const SpillKey key{session.tenant, session.id, id};
      std::optional<SpilledInfo> now = options_->tiers->Find(key);
      if (now && now->tier == StorageTier::kHost) (void)options_->tiers->Erase(key);
    }
    ++count;
  }
  session.spilled.clear();
  return count;
}

absl::Status TierMover::DropSpilledLocked(Session& session, std::string_view sequence_id) {
  if (options_->tiers != nullptr) {
    KVS_RETURN_IF_ERROR(
        options_->tiers->Erase(SpillKey{session.tenant, session.id, std::string(sequence_id)}));
  }
  session.spilled.erase(Sv(sequence_id));
  return absl::OkStatus();
}

std::vector<SpilledInfo> TierMover::List() const {
  if (options_->tiers == nullptr) return {};
  return options_->tiers->List();
}

std::optional<SpilledInfo> TierMover::Find(const SpillKey& key) const {
  if (options_->tiers == nullptr) return std::nullopt;
  return options_->tiers->Find(key);
}

}  // namespace kvs
