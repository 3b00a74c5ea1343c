#include "cache/policy/h2o.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "cache/policy/allocator.h"
#include "cache/policy/attention_stats.h"
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

}  // namespace kvs
