// KeyDiff (shared/design/policies/keydiff.md): keys only. Every slot of every kv head is scored
// by Backend::KeyDiffScores (negative cosine to an anchor over all candidates, or an ablation
// metric); the r = floor(recent_fraction * keep) newest positions are always kept (§3.5) and the
// highest scores fill the rest (ties keep the lower position). The strict block-wise prefill of
// §3.3 is the sequence's evict-then-append, not the policy's business.
//
// Immutable; safe to share across threads.
#ifndef KVSIDECAR_CACHE_POLICY_KEYDIFF_H_
#define KVSIDECAR_CACHE_POLICY_KEYDIFF_H_

#include <memory>

#include "absl/status/status.h"
#include "cache/policy/allocator.h"
#include "cache/policy/policy.h"

namespace kvs {

class KeyDiffPolicy final : public ScoredPolicy {
 public:
  explicit KeyDiffPolicy(const PolicyConfig& config)
      : ScoredPolicy(config, MakeLayerAllocator(config)) {}

  // r for a layer keeping `keep` tokens.
  int32_t RecentTokens(int32_t keep) const;

 protected:
  Protection Protect(Phase phase, const LayerSelection& layer) const override;
  absl::Status Score(Backend& backend, Phase phase, absl::Span<const LayerSelection> layers,
                     absl::Span<float* const> scores) const override;
  std::optional<DeviceDecodeRule> DeviceScores() const override {
    return DeviceDecodeRule{.scores = DecodeScores::kRows,
                            .rows = DeviceDecodeRule::Rows::kKeyDiff,
                            .anchor = config().keydiff.anchor,
                            .metric = config().keydiff.metric};
  }
};

// Validates config.keydiff ("policy.keydiff.recent_fraction ...", anchor, metric).
absl::Status ResolveKeyDiffConfig(PolicyConfig& config);
// `config` must be resolved.
std::unique_ptr<Policy> MakeKeyDiffPolicy(const PolicyConfig& config);

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_POLICY_KEYDIFF_H_
