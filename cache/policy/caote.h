// CAOTE / FastCAOTE (Goel et al.; shared/design/policies/caote.md): a value-aware wrapper over an
// attention-based base scorer (H2O, TOVA, SnapKV or CAKE). The base's raw scores are reduced over
// each GQA group and normalised into weights alpha (a zero row becomes uniform); a token's score is
// then the attention-output error of evicting it alone,
//   c_j = alpha_j / (1 - alpha_j) * ||X - v_j||_2,  X = sum alpha v (exact) or mean v (fast),
// computed by Backend::CaoteScores (+inf where 1 - alpha <= eps). gqa_reduce = rss scores each
// query head against the shared values and combines sqrt(sum c^2). variant none = the base's
// GQA-mean scores unchanged. Protection = the base's (SnapKV window, H2O sinks/recent, CAKE
// window) united with caote.n_sink / n_recent. greedy evicts one token at a time, renormalising
// over the tokens left (an extension; O(n * evicted) backend passes per layer).
//
// Base raw scores of +inf (CAKE's window indicator) carry no finite mass: they are left out of the
// normalisation and score +inf.
//
// Immutable; safe to share across threads. The base object is owned and only driven through the
// AttentionScoredPolicy Base* surface.
#ifndef KVSIDECAR_CACHE_POLICY_CAOTE_H_
#define KVSIDECAR_CACHE_POLICY_CAOTE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cache/policy/policy.h"

namespace kvs {

class CaotePolicy final : public ScoredPolicy {
 public:
  // `config` resolved; `base` built from config.caote.base (MakeCaoteBase).
  CaotePolicy(const PolicyConfig& config, std::unique_ptr<AttentionScoredPolicy> base);

  int32_t window_tokens() const override { return base_->window_tokens(); }
  const AttentionScoredPolicy& base() const { return *base_; }

 protected:
  AttentionRequirement ScorerAttention(Phase phase) const override {
    return base_->BaseAttention(phase);
  }
  bool ScorerNeedsAccumulated() const override { return base_->BaseNeedsAccumulated(); }
  absl::Status ObserveLayers(Backend& backend, Phase phase,
                             absl::Span<const LayerStep> layers) const override {
    return base_->BaseObserve(backend, phase, layers);
  }
  Protection Protect(Phase phase, const LayerSelection& layer) const override;
  absl::Status Score(Backend& backend, Phase phase, absl::Span<const LayerSelection> layers,
                     absl::Span<float* const> scores) const override;

 private:
  // One layer's greedy selection turned into scores: tokens evicted at step t of E score
  // -(E - t), the survivors their final CAOTE score (>= 0), so the top-k is the greedy set.
  absl::Status GreedyScores(Backend& backend, Phase phase, const LayerSelection& layer,
                            const std::vector<float>& alpha, int32_t rows,
                            const std::vector<uint8_t>& infinite, float* scores) const;

  const std::unique_ptr<AttentionScoredPolicy> base_;
};

// The base scorer config.caote asks for: H2O with caote.n_sink / n_recent, TOVA with
// config.tova, SnapKV with caote.snapkv, CAKE with caote.cake (MakeCakeScorer). `config` resolved.
std::unique_ptr<AttentionScoredPolicy> MakeCaoteBase(const PolicyConfig& config);

// Validates config.caote ("policy.caote.eps must be in (0, 0.5), got -1", n_sink / n_recent >= 0,
// known base / variant / gqa_reduce, caote.snapkv window >= 1 and odd kernel; caote.cake through
// ResolveCakeParams when the base is CAKE) and fills its defaults (snapkv window 32, kernel 5).
absl::Status ResolveCaoteConfig(PolicyConfig& config);
// `config` must be resolved.
std::unique_ptr<Policy> MakeCaotePolicy(const PolicyConfig& config);

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_POLICY_CAOTE_H_
