// StreamingLLM (Xiao et al.): every kv head keeps its n_sink lowest positions (attention sinks)
// and fills the rest of the budget with its most recent positions. Chosen by position, never by
// slot, since compaction scatters positions over slots. If the budget is at most n_sink, the
// lowest `keep` positions stay. Needs no scores and no inputs.
//
// Immutable; safe to share across threads.
#ifndef KVSIDECAR_CACHE_POLICY_STREAMING_LLM_H_
#define KVSIDECAR_CACHE_POLICY_STREAMING_LLM_H_

#include <memory>

#include "absl/status/status.h"
#include "cache/policy/allocator.h"
#include "cache/policy/policy.h"

namespace kvs {

inline constexpr int32_t kDefaultStreamingLlmSinks = 4;

class StreamingLlmPolicy final : public ScoredPolicy {
 public:
  explicit StreamingLlmPolicy(const PolicyConfig& config)
      : ScoredPolicy(config, MakeLayerAllocator(config)) {}

 protected:
  Protection Protect(Phase phase, const LayerSelection& layer) const override;
  absl::Status Score(Backend& backend, Phase phase, absl::Span<const LayerSelection> layers,
                     absl::Span<float* const> scores) const override;
  bool RanksTokens() const override { return false; }
  std::optional<DeviceDecodeRule> DeviceScores() const override {
    return DeviceDecodeRule{.scores = DecodeScores::kNone};
  }
};

// Validates config.streaming_llm ("policy.streaming_llm.n_sink ...") and fills its defaults.
absl::Status ResolveStreamingLlmConfig(PolicyConfig& config);
// `config` must be resolved.
std::unique_ptr<Policy> MakeStreamingLlmPolicy(const PolicyConfig& config);

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_POLICY_STREAMING_LLM_H_
