// D2O scorer and merger (shared/design/policies/d2o.md): H2O-style eviction by attention
// accumulated over every query the sidecar saw, with T sinks and M recent positions protected
// (the split of each layer's budget, SplitD2oBudget), and evicted tokens merged into their most
// cosine-similar kept key instead of dropped when that similarity reaches an EMA threshold.
// The per-layer budgets come from the D2O layer allocator (allocator.h), not from here.
//
// Merge, per (layer, kv head), after Select (d2o.md §4.1 steps 6-8, §4.2 steps 5-7):
//   E = the evicted slots; u_i, j*(i) = Backend::NearestKeys over the kept slots (ties to the
//   lowest position); observation = mean_i u_i; tau = observation the first time (tau_0),
//   beta * observation + (1 - beta) * tau_prev after (computed before comparing); every i with
//   u_i >= tau is folded into j*(i) in K and V by one Backend::MergeRows job per (target, kv):
//     paper: x_j <- (e * x_j + sum e^{u_i} x_i) / (e + sum e^{u_i})
//     code:  x_j <- (x_j + sum u_i x_i) / (1 + n)
//   threshold_scope=layer keeps one tau per layer from the heads' mean observation and decides
//   the r-th evicted token (by position) of every head from the heads' mean u (TV7).
//   Non-finite similarities (NaN keys) never merge and are left out of the observation.
//
// Immutable; safe to share across threads. Per-sequence state lives in LayerPolicyState
// (accumulated, threshold).
#ifndef KVSIDECAR_CACHE_POLICY_D2O_H_
#define KVSIDECAR_CACHE_POLICY_D2O_H_

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "cache/policy/allocator.h"
#include "cache/policy/policy.h"

namespace kvs {

class D2oPolicy final : public AttentionScoredPolicy {
 public:
  explicit D2oPolicy(const PolicyConfig& config)
      : AttentionScoredPolicy(config, MakeLayerAllocator(config)) {}

  absl::Status Merge(Backend& backend, Phase phase, absl::Span<const LayerSelection> layers,
                     absl::Span<int32_t> merged) const override;
  // rho: the budget form of a sequence created without a token budget (d2o.md §3).
  float budget_fraction() const override { return config().d2o.rho; }

  // The GQA mean of the layer's accumulated attention, [H][count] (returns H).
  absl::StatusOr<RawRows> RawScores(Backend& backend, Phase phase, const LayerSelection& layer,
                                    std::vector<float>& storage) const override;

 protected:
  // Every query's attention, but only its column sums are read (the accumulated scores): the
  // backend may sum the rows as it computes them.
  AttentionRequirement ScorerAttention(Phase) const override {
    return {.needed = true, .trailing_queries = 0, .column_sums = true};
  }
  bool ScorerNeedsAccumulated() const override { return true; }
  Protection Protect(Phase phase, const LayerSelection& layer) const override;
};

// Validates config.d2o ("policy.d2o.beta must be in (0, 1], got 2") and fills the defaults of
// the fields whose zero is not a valid value (beta, min_ratio, max_ratio). n_sink = 0 and
// recent_frac = 0 are meaningful and kept.
absl::Status ResolveD2oConfig(PolicyConfig& config);
// `config` must be resolved.
std::unique_ptr<Policy> MakeD2oPolicy(const PolicyConfig& config);

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_POLICY_D2O_H_
