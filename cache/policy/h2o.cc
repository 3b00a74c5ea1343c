#include "cache/policy/h2o.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "cache/policy/allocator.h"
#include "cache/policy/attention_stats.h"
#include "cache/policy/registry.h"
#include "gpu/base/status_macros.h"

namespace kvs {

H2oPolicy::H2oPolicy(const PolicyConfig& config, const H2oConfig& params)
    : AttentionScoredPolicy(config, MakeLayerAllocator(config)), params_(params) {}

absl::StatusOr<AttentionScoredPolicy::RawRows> H2oPolicy::RawScores(Backend&, Phase,
                                                                    const LayerSelection& layer,
                                                                    std::vector<float>&) const {
  const std::vector<float>& accumulated = layer.state->accumulated;
  const int64_t count = layer.keys.count;
  if (accumulated.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy ", config().name,
                     " needs attention (every query) before it can evict: field attention"));
  }
  if (count == 0 || accumulated.size() % count != 0) {
    return absl::InternalError(absl::StrCat("policy h2o: accumulated attention of layer ",
                                            layer.layer, " holds ", accumulated.size(),
                                            " values for ", count, " slots"));
  }
  return RawRows{accumulated, static_cast<int32_t>(accumulated.size() / count)};
}

ScoredPolicy::Protection H2oPolicy::Protect(Phase, const LayerSelection& layer) const {
  const int32_t sinks = std::clamp(params_.n_sink, 0, layer.keep);
  const int32_t recent = std::clamp(params_.n_recent, 0, layer.keep - sinks);
  return Protection{sinks, recent};
}

absl::Status ResolveH2oConfig(PolicyConfig& config) {
  const H2oConfig& h2o = config.h2o;
  if (h2o.n_sink < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.h2o.n_sink must be >= 0, got ", h2o.n_sink));
  }
  if (h2o.n_recent < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.h2o.n_recent must be >= 0, got ", h2o.n_recent));
  }
  return absl::OkStatus();
}

std::unique_ptr<Policy> MakeH2oPolicy(const PolicyConfig& config) {
  return std::make_unique<H2oPolicy>(config);
}


// ---- Registry unit (cache/policy/registry.h) ----------------------------------------
namespace {

void EncodeH2oParams(const PolicyConfig& config, FieldWriter& out) {
  out.I32(1, config.h2o.n_sink);
  out.I32(2, config.h2o.n_recent);
}
bool DecodeH2oParams(const FieldReader& in, uint32_t, PolicyConfig* config) {
  return in.I32(1, &config->h2o.n_sink) && in.I32(2, &config->h2o.n_recent);
}
}  // namespace

extern const PolicyUnit kH2oUnit;
const PolicyUnit kH2oUnit = {
    .name = kPolicyH2o,
    .capabilities = {.needs_attention = true},
    .resolve = &ResolveH2oConfig,
    .make = &MakeH2oPolicy,
    .encode_params = &EncodeH2oParams,
    .decode_params = &DecodeH2oParams,
};

}  // namespace kvs
