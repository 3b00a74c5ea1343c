// CAKE scorer (shared/design/policies/cake.md steps 3, 6, 7); the preference-driven layer budgets
// and the cascade are the CAKE layer allocator's (allocator.h).
//
// Prefill (a Commit/Compress/Score step with the window queries): from the trailing
// w = min(W, num_queries) query rows of the step, per query head and slot, mu = mean and
// var = unbiased variance (divisor w - 1; 0 when w == 1); u = mu + gamma * var on the prefix
// slots (positions before the first window query), avg-pooled by position over the prefix (kernel
// k, zero padding counted), GQA mean per kv head -> LayerPolicyState::indicator [H][count], +inf
// on the window slots. Later cascade stages re-select from the stored indicator.
// Decode: the new query's row a [Hq][count]; candidates = every slot except each head's W newest
// positions; step_scores = a avg-pooled by position over the candidates, window slots keep their
// unpooled a. The window is always kept through Protect (recent = min(W, keep)), so raw scores
// stay finite and non-negative (CAOTE normalises them).
//
// Immutable; safe to share across threads.
#ifndef KVSIDECAR_CACHE_POLICY_CAKE_H_
#define KVSIDECAR_CACHE_POLICY_CAKE_H_

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "cache/policy/allocator.h"
#include "cache/policy/policy.h"

namespace kvs {

class FieldWriter;
class FieldReader;

class CakePolicy final : public AttentionScoredPolicy {
 public:
  // `cake` is config.cake for "cake", config.caote.cake for CAOTE over CAKE; the allocator is
  // MakeLayerAllocator(config).
  CakePolicy(const PolicyConfig& config, const CakeConfig& cake)
      : AttentionScoredPolicy(config, MakeLayerAllocator(config)), cake_(cake) {}

  int32_t window_tokens() const override { return cake_.window; }
  const CakeConfig& cake() const { return cake_; }

  // Prefill: the indicator [H][count], window slots (+inf in the state) given the row's largest
  // finite indicator so that the scores stay finite (they are protected either way). Decode: the
  // step scores [Hq][count].
  absl::StatusOr<RawRows> RawScores(Backend& backend, Phase phase, const LayerSelection& layer,
                                    std::vector<float>& storage) const override;

 protected:
  AttentionRequirement ScorerAttention(Phase phase) const override;
  absl::Status ObserveLayers(Backend& backend, Phase phase,
                             absl::Span<const LayerStep> layers) const override;
  Protection Protect(Phase phase, const LayerSelection& layer) const override;

 private:
  const CakeConfig cake_;
};

// The CAKE scorer over `cake` (resolved) with the allocator of `config`; CAOTE over CAKE uses it.
std::unique_ptr<AttentionScoredPolicy> MakeCakeScorer(const PolicyConfig& config,
                                                      const CakeConfig& cake);

// Validates `cake`, naming fields under `field_prefix` ("policy.cake", "policy.caote.cake"), and
// fills the defaults of the fields whose zero is not a valid value (window 32, tau1 = tau2 = 1,
// kernel_size 5). gamma = 0 (mean only) is kept.
absl::Status ResolveCakeParams(CakeConfig& cake, absl::string_view field_prefix);
// ResolveCakeParams(config.cake, "policy.cake").
absl::Status ResolveCakeConfig(PolicyConfig& config);
// `config` must be resolved.
std::unique_ptr<Policy> MakeCakePolicy(const PolicyConfig& config);

// CAKE's parameters as snapshot fields (CAKE itself and CAOTE over CAKE).
void EncodeCakeFields(const CakeConfig& params, FieldWriter& out);
bool DecodeCakeFields(const FieldReader& in, CakeConfig* params);

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_POLICY_CAKE_H_
