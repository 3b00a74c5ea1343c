// OmniKV (shared/design/policies/omnikv.md): decode-time sparse attention that never evicts. This
// header owns the policy object (which keeps every token: Compress and Score do not apply) and
// the spec's arithmetic that Select needs — the layer plan (prefix / filter / wait / sparse
// layers, sliding-window layers, and which filter feeds which sparse layers), the budget k, and
// the per-candidate score of each selector. The state and the gathers live with the sequence
// (cache/omnikv.cc).
//
// Threading: everything here is immutable or pure.
#ifndef KVSIDECAR_CACHE_POLICY_OMNIKV_H_
#define KVSIDECAR_CACHE_POLICY_OMNIKV_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "cache/policy/policy.h"

namespace kvs {

// kWindowed: a sliding-window layer (SequenceParams::layer_windows, e.g. Gemma 3's local
// layers). It attends to its own last W tokens, which is all it holds, so it is dense wherever it
// sits: never a filter (it cannot rank the whole prompt) and never sparse (its window, not T_f, is
// what the model attends to there).
enum class OmniKvRole { kPrefix, kFilter, kWait, kSparse, kWindowed };

// Layer roles of one model under one config (omnikv.md §2). The wait layers are the
// `wait_layers` layers after each filter, whatever their kind (a windowed one among them still
// hides the Select's latency); the full-attention layers after them are that filter's sparse
// layers.
struct OmniKvPlan {
  std::vector<OmniKvRole> roles;        // per layer
  std::vector<int32_t> feeding_filter;  // per layer: the filter layer a sparse layer reads, else -1
  std::vector<std::vector<int32_t>> sparse;  // per entry of config.filter_layers: its sparse layers
};

// The plan for `num_layers` whose sliding windows are `windows` (empty, or one per layer with
// 0 = full attention, as KvPool::CreateSequence checked them); INVALID_ARGUMENT naming
// policy.omnikv.filter_layers[i] when a filter layer is out of range or a sliding-window layer, or
// the list is empty, unsorted or repeats a layer.
absl::StatusOr<OmniKvPlan> PlanOmniKvLayers(const OmniKvConfig& config, int32_t num_layers,
                                            absl::Span<const int32_t> windows = {});

// The filter layers the paper gives for a model of `num_layers` layers (32: {2, 8, 18};
// 48: {6, 11, 30}; 80: {4, 19, 41}); empty when it gives none.
std::vector<int32_t> DefaultOmniKvFilterLayers(int32_t num_layers);

// k for a prompt of `prompt_tokens`: selected_tokens if set, else floor(fraction * N); clamped to
// [0, N] (omnikv.md §3.3, §12).
int32_t ResolveOmniKvBudget(const OmniKvConfig& config, int64_t prompt_tokens);

// S[t] for t < n from per-query-head rows of one filter layer (omnikv.md §4.2):
//   kLast / kSoftmaxBeforeLast: `rows` is [Hq][n] (logits resp. probabilities of the newest
//   query); S[t] = max over heads.
//   kUniform / kExp: `rows` is [Hq][w][n] probabilities of the window's w queries (oldest
//   first); S[t] = sum_j alpha_j max_h rows[h][j][t], alpha_j = 1 (uniform) or 2^(j - (w - 1)).
// NaN entries count as -inf. `scores` has n entries.
void OmniKvCandidateScores(OmniKvSelector selector, absl::Span<const float> rows,
                           int32_t num_q_heads, int32_t window, int32_t n,
                           absl::Span<float> scores);

// Filter ability (omnikv.md §6), the offline analysis that picks a model's filter layers:
// `layers[l][t]` is layer l's distribution over the prompt at one decode step (the softmax of the
// head-max logits); sim(l1, l2) = the mass layers[l2] puts on the top k tokens of layers[l1] (ties
// to the lower index); A(l1; n) = the mean of sim(l1, l2) over l2 in [l1, l1 + n), for every l1
// with l1 + n < L (TV8). All layers must have the same length.
std::vector<double> OmniKvFilterAbility(absl::Span<const std::vector<float>> layers, int32_t k,
                                        int32_t n);

// The OmniKV policy object: it keeps every token (no allocator split, no scorer); its Select is
// never reached because an OmniKV sequence has no budget, and reports INTERNAL if it is.
class OmniKvPolicy final : public Policy {
 public:
  explicit OmniKvPolicy(const PolicyConfig& config);
  absl::Status Select(Backend& backend, Phase phase,
                      absl::Span<const LayerSelection> layers) const override;
};

absl::Status ResolveOmniKvConfig(PolicyConfig& config);
std::unique_ptr<Policy> MakeOmniKvPolicy(const PolicyConfig& config);

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_POLICY_OMNIKV_H_
