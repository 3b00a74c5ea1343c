// Policy: decides, for each kv head of a layer, which `keep` of the layer's `count` tokens stay.
// A policy is a composition (ARCHITECTURE.md §4): a layer allocator (how many tokens each layer
// keeps), a scorer (a float per slot), the shared selector (protected positions + per-head top-k
// through Backend::TopK, ties to the lower position) and, for D2O, a merge of evicted tokens into
// kept ones. New policies derive from ScoredPolicy (or AttentionScoredPolicy) and supply only
// what differs.
//
// One step of the pipeline, as the sequence drives it for Commit, Compress, DecodeStep and Score:
//   1. Observe(phase, layers with this step's attention probabilities): fold the attention into
//      the per-layer state (accumulated column sums, step scores, allocator preferences).
//   2. AllocateLayers(request): tokens each layer keeps (may freeze per-layer budgets).
//   3. Select(phase, layers): the kept slots of every head of every layer that must shrink.
//   4. Merge(phase, layers): fold evicted tokens into kept ones in the arena (D2O only).
//   5. The sequence compacts the arena rows and every slot-aligned state array together.
//
// State: policies are immutable after construction and may serve many calls concurrently; all
// per-sequence state lives in LayerPolicyState, owned by the sequence and passed in (the
// sequence's lock serialises calls on one sequence). Every kernel runs through the Backend.
#ifndef KVSIDECAR_CACHE_POLICY_POLICY_H_
#define KVSIDECAR_CACHE_POLICY_POLICY_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "cache/policy/policy_config.h"
#include "gpu/backend.h"

namespace kvs {

// Prefill: Commit, Compress and Score calls. Decode: DecodeStep (one new token per layer).
enum class Phase { kPrefill, kDecode };

// What a policy reads of a step's attention.
struct AttentionRequirement {
  // The policy needs this step's attention to evict: a call that must evict without it is
  // INVALID_ARGUMENT naming the policy and the field `attention`.
  bool needed = false;
  // Only the last n queries of the step matter (0 = every query); the sequence may then compute
  // probabilities for those rows only.
  int32_t trailing_queries = 0;
  // Only the column sums of those rows' probabilities are read (SnapKV's vote, H2O's
  // accumulation): the sequence may then have the backend sum them as it computes them
  // (Backend::AttentionColumnSums) and pass LayerStep::summed_rows instead of every row.
  bool column_sums = false;
};

// Per-layer policy state of one sequence. Slot-aligned arrays are [rows][count] in slot order
// (rows = size / count; row r belongs to kv head r / (rows / num_kv_heads), so a [Hq][count]
// array follows the GQA grouping) and the sequence keeps them aligned: it zero-extends them when
// tokens are appended and permutes them with the arena rows when it compacts. Empty = unused.
struct LayerPolicyState {
  // H2O / D2O (and the D2O allocator): attention accumulated over every query observed so far,
  // [Hq][count]; a new token starts at 0 (caote.md §4, d2o.md §4).
  std::vector<float> accumulated;
  // CAKE: the eviction indicator measured at prefill, [H][count] (+inf on window tokens); the
  // cascade re-selects from it as later layers arrive.
  std::vector<float> indicator;
  // Transient: scores this step's attention gave ([Hq][count] or [H][count], as the policy chose),
  // written by Observe and read by Select/Merge of the same call; Compact drops them and the
  // sequence clears them at the end of every call.
  std::vector<float> step_scores;
  // Transient, with step_scores: newest positions this step protects (SnapKV's window w').
  int32_t step_protected_recent = 0;
  // D2O: EMA merge thresholds tau, one per kv head (or one per layer for threshold_scope=layer);
  // empty until the first merge set tau_0.
  std::vector<float> threshold;
  // H2O with normalize_by_queries: the positions of every query observed so far, as runs
  // [start, end) flattened (start0, end0, start1, end1, ...) in the order observed. Not
  // slot-aligned: a key's observer count is read from it by position.
  std::vector<int32_t> observed_queries;
  // Allocator input measured from attention: CAKE's preference P_l, D2O's density F_l.
  double preference = 0.0;
  bool measured = false;
  // Tokens this layer keeps once an allocator froze it (D2O after prefill, CAKE after its last
  // cascade stage); 0 = not frozen. `frozen_for` is the sequence budget it was computed for.
  int32_t frozen_budget = 0;
  int32_t frozen_for = 0;
  // Policies that keep them (Policy::keeps_key_norms, KNorm): the L2 norm of every key, [H][count],
  // taken by the finiteness check as the keys were committed (FiniteCheckJob::row_norms), so that
  // scoring reads no keys; empty = not known (a path that adds or rewrites keys without them
  // clears it, and the scorer then reads the keys).
  std::vector<float> key_norms;

  // After compaction, new slot t of head h holds what old slot sources[h][t] held.
  void Compact(int32_t num_kv_heads, int32_t old_count,
               absl::Span<const std::vector<int32_t>> sources);
  // `added` new slots at the end of every head, zero in every slot-aligned array. key_norms takes
  // `added_key_norms` ([H][added]) when it is known and they are given, else it is cleared.
  void Extend(int32_t num_kv_heads, int32_t old_count, int32_t added,
              const float* added_key_norms = nullptr);
};

// One layer of one sequence as Observe sees it.
struct LayerStep {
  int32_t layer = 0;
  PagedLayerView keys;                  // kv_index 0; ValuesOf(keys) reads the values
  absl::Span<const int32_t> positions;  // [H][count] original positions, slot order
  int32_t num_q_heads = 0;
  // This step's attention probabilities [Hq][num_queries][count] (Backend::AttentionProbs
  // semantics, or the worker's own scores), for the trailing `num_queries` queries of the step.
  absl::Span<const float> probs;
  int32_t num_queries = 0;
  absl::Span<const int32_t> query_positions;  // [num_queries]
  // Queries the step had in all (>= num_queries): SnapKV's w' = min(window, step_queries).
  int32_t step_queries = 0;
  // 0: `probs` holds every row as above. n > 0 (a policy whose requirement asked for column_sums):
  // `probs` is [Hq][1][count], the sum of the probabilities of the n = num_queries trailing rows.
  int32_t summed_rows = 0;
  LayerPolicyState* state = nullptr;
};

// One layer of one sequence as Select and Merge see it, and where the choice goes.
struct LayerSelection {
  int32_t layer = 0;
  PagedLayerView keys;                  // keys.count tokens in every kv head
  absl::Span<const int32_t> positions;  // [H][count] original positions, slot order
  int32_t num_q_heads = 0;
  int32_t keep = 0;                   // tokens each head keeps, 0 <= keep <= count
  absl::Span<int32_t> kept;           // out: [H][keep] kept slots, ascending per head
  LayerPolicyState* state = nullptr;  // never null
  uint8_t* writable_arena = nullptr;  // the same arena as keys.arena, for Merge
  // Optional out: [H][count] the selection scores (Score dry run); written even when keep ==
  // count. +inf marks protected slots.
  float* scores_out = nullptr;
};

// What an allocator decides from.
struct AllocationRequest {
  Phase phase = Phase::kPrefill;
  int32_t budget = 0;                   // the sequence's tokens per layer, > 0
  absl::Span<const int32_t> counts;     // tokens each layer holds now
  absl::Span<LayerPolicyState> states;  // per layer; an allocator may freeze budgets in them
  int32_t block_tokens = 16;            // for the default floor
};

struct Allocation {
  std::vector<int32_t> keep;         // per layer, 0 <= keep[l] <= counts[l]
  int32_t floor_applied_layers = 0;  // layers raised to the floor
};

// How a policy's decode-time eviction of one layer runs where the layer lives
// (Backend::DecodeEvict, the device path of a DecodeStep): what it scores by and what it
// protects. A policy has one when its decode step is "score every slot from what the device
// holds, keep the protected ones, drop the lowest"; the device step then equals its host step.
struct DeviceDecodeRule {
  DecodeScores scores = DecodeScores::kNone;
  // kRows: this step's attention probabilities ([Hq][count], TOVA), or the KeyDiff job's scores
  // over the layer's keys ([H][count]) with `anchor` and `metric`.
  enum class Rows { kNone, kAttention, kKeyDiff };
  Rows rows = Rows::kNone;
  KeyDiffAnchor anchor = KeyDiffAnchor::kMeanNormalized;
  KeyDiffMetric metric = KeyDiffMetric::kCosine;
  int32_t sinks = 0;   // each head's lowest positions kept whatever the scores
  int32_t recent = 0;  // and its highest
};

// Splits a sequence budget across layers (uniform, PyramidKV, D2O, CAKE): a real seam, chosen
// per sequence independently of the scorer (cake.md §7, d2o.md §7). Immutable, thread-safe.
class LayerAllocator {
 public:
  virtual ~LayerAllocator() = default;
  virtual AttentionRequirement attention(Phase phase) const = 0;
  // Whether LayerPolicyState::accumulated must be maintained (D2O's density).
  virtual bool needs_accumulated() const { return false; }
  // Measures a layer's preference from this step's attention (CAKE). Default: nothing.
  virtual absl::Status Observe(Backend& backend, Phase phase, const LayerStep& layer) const;
  // The same for every layer of a step (a batched step's layers of many sequences), so that an
  // allocator that measures on the backend does it in one call. Default: Observe of each.
  virtual absl::Status ObserveLayers(Backend& backend, Phase phase,
                                     absl::Span<const LayerStep> layers) const;
  virtual absl::StatusOr<Allocation> Allocate(const AllocationRequest& request) const = 0;
};

class Policy {
 public:
  virtual ~Policy() = default;
  Policy(const Policy&) = delete;
  Policy& operator=(const Policy&) = delete;

  // The resolved configuration (defaults filled in).
  const PolicyConfig& config() const { return config_; }
  const LayerAllocator& allocator() const { return *allocator_; }

  // What the scorer and the allocator together read of a step's attention.
  AttentionRequirement attention(Phase phase) const;
  // Whether LayerPolicyState::accumulated is maintained for this policy.
  bool needs_accumulated() const {
    return ScorerNeedsAccumulated() || allocator_->needs_accumulated();
  }
  // Whether LayerPolicyState::key_norms is maintained for this policy (the commits' finiteness
  // checks then take each key's norm).
  virtual bool keeps_key_norms() const { return false; }
  // Tokens every layer keeps outside the allocated share (CAKE's window W; 0 for the others).
  virtual int32_t window_tokens() const { return 0; }
  // The budget as a fraction of the prompt, for a sequence that has no token budget (D2O's rho;
  // 0 = the policy has no such form). The sequence turns it into tokens per layer.
  virtual float budget_fraction() const { return 0.0f; }

  // Step 1: the scorer's Observe, then the allocator's, for each layer that has attention.
  // Each layer is observed on its own: the scorer and the allocator read only that layer's step
  // and write only its LayerStep::state, so callers may observe the layers of a step one at a
  // time and side by side (Sequence does, on its host threads); a policy that needs to see
  // several layers at once must do so in the allocator's Allocate.
  absl::Status Observe(Backend& backend, Phase phase, absl::Span<const LayerStep> layers) const;
  // Step 2: the allocator's split (per-layer explicit budgets are the sequence's business).
  absl::StatusOr<Allocation> AllocateLayers(const AllocationRequest& request) const {
    return allocator_->Allocate(request);
  }
  // Step 3: fills layers[i].kept for every layer, one batch of backend calls for all of them.
  // INTERNAL when a selection is malformed, or the backend's error. As with Observe, each layer
  // is selected on its own (a selection reads that layer and writes only its state, kept and
  // scores_out), so callers may select the layers one at a time and side by side.
  virtual absl::Status Select(Backend& backend, Phase phase,
                              absl::Span<const LayerSelection> layers) const = 0;
  // Step 4: after Select, before compaction; merged[i] = evicted rows folded into kept ones in
  // layers[i], summed over heads. Default: nothing merged.
  virtual absl::Status Merge(Backend& backend, Phase phase, absl::Span<const LayerSelection> layers,
                             absl::Span<int32_t> merged) const;
  // The rule of this policy's decode step on the device for a layer keeping `keep` of its
  // `count` tokens (keep >= count - 1); nullopt when the step needs the host (pooling by
  // position, merges, scorers over other state). Default: none.
  virtual std::optional<DeviceDecodeRule> DeviceDecode(int32_t keep, int32_t count) const {
    return std::nullopt;
  }

 protected:
  Policy(PolicyConfig config, std::unique_ptr<LayerAllocator> allocator)
      : config_(std::move(config)), allocator_(std::move(allocator)) {}

  virtual AttentionRequirement ScorerAttention(Phase) const { return {}; }
  virtual bool ScorerNeedsAccumulated() const { return false; }
  // The scorer's part of Observe; called only for layers with attention. Default: nothing.
  virtual absl::Status ObserveLayers(Backend& backend, Phase phase,
                                     absl::Span<const LayerStep> layers) const;

 private:
  const PolicyConfig config_;
  const std::unique_ptr<LayerAllocator> allocator_;
};

// The shared selector: scores [H][count] per layer, protected positions marked as forced, then
// Backend::TopK. Subclasses provide Score and Protect.
class ScoredPolicy : public Policy {
 public:
  absl::Status Select(Backend& backend, Phase phase,
                      absl::Span<const LayerSelection> layers) const final;
  std::optional<DeviceDecodeRule> DeviceDecode(int32_t keep, int32_t count) const final;

  // Positions every head keeps whatever the scores: its `sinks` lowest and `recent` highest.
  struct Protection {
    int32_t sinks = 0;
    int32_t recent = 0;
  };

 protected:
  using Policy::Policy;

  // For `layer` keeping layer.keep tokens; sinks + recent must not exceed keep.
  virtual Protection Protect(Phase phase, const LayerSelection& layer) const = 0;

  // Writes scores[i][h * count + s] for every layer i; higher is kept first. The buffers are
  // zeroed on entry, so a position-only policy may leave them alone.
  virtual absl::Status Score(Backend& backend, Phase phase, absl::Span<const LayerSelection> layers,
                             absl::Span<float* const> scores) const = 0;

  // What the scores of a device decode step are (DeviceDecode fills in the protection from
  // Protect); nullopt: the policy's decode step stays on the host. Default: none.
  virtual std::optional<DeviceDecodeRule> DeviceScores() const { return std::nullopt; }

  // False for a policy whose protected tokens always fill the budget and whose Score writes
  // nothing (StreamingLLM): the selector then keeps the protected slots of a layer without
  // zeroing, scoring or ranking its [H][count] slots, which at 8K tokens x 32 layers was most of
  // such a compress. A dry run (scores_out) still takes the scored path.
  virtual bool RanksTokens() const { return true; }

 private:
  // The protected slots of `layer`, ascending per head, into layer.kept (RanksTokens() false).
  absl::Status KeepProtected(Phase phase, const LayerSelection& layer) const;
};

// An attention-based scorer (H2O, TOVA, SnapKV, CAKE): its raw scores are non-negative, per query
// head (or already per kv head), read from the layer's state; the selection score of a kv head is
// the mean of its group's raw scores. CAOTE (caote.md) owns one of these as its base and drives
// it through the public Base* surface.
class AttentionScoredPolicy : public ScoredPolicy {
 public:
  AttentionRequirement BaseAttention(Phase phase) const { return ScorerAttention(phase); }
  bool BaseNeedsAccumulated() const { return ScorerNeedsAccumulated(); }
  absl::Status BaseObserve(Backend& backend, Phase phase,
                           absl::Span<const LayerStep> layers) const {
    return ObserveLayers(backend, phase, layers);
  }
  Protection BaseProtect(Phase phase, const LayerSelection& layer) const {
    return Protect(phase, layer);
  }
  // [rows][count] non-negative scores of `layer`; rows is num_q_heads (per query head) or
  // num_kv_heads (already reduced per kv head).
  struct RawRows {
    absl::Span<const float> values;
    int32_t rows = 0;
  };
  // The scores of `layer`, viewed where they already live (the layer's state) or computed into
  // `storage`: a decode step reads them once, so a copy of every layer's [Hq][count] scores
  // would be a pass of its own. The view lives until the state or `storage` changes.
  virtual absl::StatusOr<RawRows> RawScores(Backend& backend, Phase phase,
                                            const LayerSelection& layer,
                                            std::vector<float>& storage) const = 0;

 protected:
  using ScoredPolicy::ScoredPolicy;
  // The GQA mean of RawScores per kv head.
  absl::Status Score(Backend& backend, Phase phase, absl::Span<const LayerSelection> layers,
                     absl::Span<float* const> scores) const override;
};

// A view of the values of the layer `keys` views.
inline PagedLayerView ValuesOf(PagedLayerView keys) {
  keys.kv_index = 1;
  return keys;
}

// Validates `config` and fills in defaults (zero values mean the spec's default).
// INVALID_ARGUMENT naming the field ("policy.keydiff.recent_fraction ...", "policy.name ..."
// listing the known names) when it is malformed; UNIMPLEMENTED for policies of later builds.
absl::StatusOr<PolicyConfig> ResolvePolicyConfig(const PolicyConfig& config);

// A policy for `config` (validated as by ResolvePolicyConfig).
absl::StatusOr<std::unique_ptr<Policy>> MakePolicy(const PolicyConfig& config);

// Every policy name of the contract, implemented or not, in the order the proto lists them.
const std::vector<std::string>& KnownPolicyNames();

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_POLICY_POLICY_H_
