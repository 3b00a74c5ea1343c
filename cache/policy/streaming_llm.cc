#include "cache/policy/streaming_llm.h"
#include "cache/policy/registry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace kvs {

ScoredPolicy::Protection StreamingLlmPolicy::Protect(Phase, const LayerSelection& layer) const {
  // Everything kept is protected: the sinks, then the newest positions for the rest.
  const int32_t sinks = std::min(config().streaming_llm.n_sink, layer.keep);
  return Protection{sinks, layer.keep - sinks};
}

absl::Status StreamingLlmPolicy::Score(Backend&, Phase, absl::Span<const LayerSelection>,
                                       absl::Span<float* const>) const {
  return absl::OkStatus();  // position-only: the forced set is the whole choice
}

absl::Status ResolveStreamingLlmConfig(PolicyConfig& config) {
  int32_t& n_sink = config.streaming_llm.n_sink;
  if (n_sink < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.streaming_llm.n_sink must be >= 0, got ", n_sink));
  }
  return absl::OkStatus();
}

std::unique_ptr<Policy> MakeStreamingLlmPolicy(const PolicyConfig& config) {
  return std::make_unique<StreamingLlmPolicy>(config);
}


// ---- Registry unit (cache/policy/registry.h) ----------------------------------------
namespace {

void EncodeStreamingLlmParams(const PolicyConfig& config, FieldWriter& out) {
  out.I32(1, config.streaming_llm.n_sink);
}
bool DecodeStreamingLlmParams(const FieldReader& in, uint32_t, PolicyConfig* config) {
  return in.I32(1, &config->streaming_llm.n_sink);
}
}  // namespace

extern const PolicyUnit kStreamingLlmUnit;
const PolicyUnit kStreamingLlmUnit = {
    .name = kPolicyStreamingLlm,
    .capabilities = {.needs_attention = false, .query_agnostic = true},
    .resolve = &ResolveStreamingLlmConfig,
    .make = &MakeStreamingLlmPolicy,
    .encode_params = &EncodeStreamingLlmParams,
    .decode_params = &DecodeStreamingLlmParams,
};

}  // namespace kvs
