// TOVA (Oren et al., "Transformers are Multi-State RNNs"; policies/caote.md §4): a token's score
// is the attention the step's LAST query gives it, per query head; the selection score of a kv
// head is the GQA mean of its group. all_heads = original TOVA: one score per token, the mean over
// every query head of the layer, shared by all kv heads. Nothing is protected, unless
// keep_last_token (kvpress's TOVAPress) keeps each head's newest position whatever its score. The
// scores are transient (LayerPolicyState::step_scores: [Hq][count], or with all_heads the means
// already taken, [H][count]): a call that must evict without this step's attention is
// INVALID_ARGUMENT.
//
// Immutable; safe to share across threads.
#ifndef KVSIDECAR_CACHE_POLICY_TOVA_H_
#define KVSIDECAR_CACHE_POLICY_TOVA_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cache/policy/policy.h"

namespace kvs {

class TovaPolicy final : public AttentionScoredPolicy {
 public:
  explicit TovaPolicy(const PolicyConfig& config) : TovaPolicy(config, config.tova) {}
  TovaPolicy(const PolicyConfig& config, const TovaConfig& params);

  // Rows: num_q_heads, or num_kv_heads with all_heads (the layer mean replicated per kv head).
  absl::StatusOr<RawRows> RawScores(Backend& backend, Phase phase, const LayerSelection& layer,
                                    std::vector<float>& storage) const override;

 protected:
  AttentionRequirement ScorerAttention(Phase) const override { return {true, 1}; }
  absl::Status ObserveLayers(Backend& backend, Phase phase,
                             absl::Span<const LayerStep> layers) const override;
  Protection Protect(Phase phase, const LayerSelection& layer) const override;
  // The device step scores by the last query's probabilities (per kv head group; the all-heads
  // means by position stay on the host).
  std::optional<DeviceDecodeRule> DeviceScores() const override;

 private:
  const TovaConfig params_;
};

// config.tova has nothing to validate (two booleans); present for the registry's uniformity.
absl::Status ResolveTovaConfig(PolicyConfig& config);
std::unique_ptr<Policy> MakeTovaPolicy(const PolicyConfig& config);

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_POLICY_TOVA_H_
