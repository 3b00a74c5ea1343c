#include "cache/policy/h2o.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "cache/policy/allocator.h"
#include "cache/policy/attention_stats.h"
#include "gpu/base/status_macros.h"

namespace kvs {

H2oPolicy::H2oPolicy(const PolicyConfig& config, const H2oConfig& params)
    : AttentionScoredPolicy(config, MakeLayerAllocator(config)), params_(params) {}

absl::Status CheckAttentionStep(const std::string& policy, const LayerStep& layer) {
  const int64_t heads = layer.keys.num_kv_heads;
  const int64_t q_heads = layer.num_q_heads;
  const int64_t count = layer.keys.count;
  if (layer.state == nullptr || heads < 1 || count < 0 ||
      static_cast<int64_t>(layer.positions.size()) != heads * count) {
    return absl::InternalError(absl::StrCat("policy ", policy, ": malformed layer ", layer.layer,
                                            " (kv heads ", heads, ", count ", count, ", positions ",
                                            layer.positions.size(), ")"));
  }
  if (q_heads < heads || q_heads % heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("attention of layer ", layer.layer, ": policy ",
                                                   policy, " needs a multiple of ", heads,
                                                   " query heads, got ", q_heads));
  }
  if (layer.num_queries < 1) {
    return absl::InvalidArgumentError(absl::StrCat("attention.num_queries of layer ", layer.layer,
                                                   " must be >= 1 for policy ", policy, ", got ",
                                                   layer.num_queries));
  }
  const int64_t expected = q_heads * layer.num_queries * count;
  if (static_cast<int64_t>(layer.probs.size()) != expected) {
    return absl::InvalidArgumentError(absl::StrCat("attention of layer ", layer.layer, ": policy ",
                                                   policy, " expected ", q_heads, " x ",
                                                   layer.num_queries, " x ", count, " = ", expected,
                                                   " probabilities, got ", layer.probs.size()));
  }
  return absl::OkStatus();
}

absl::Status H2oPolicy::ObserveLayers(Backend&, Phase, absl::Span<const LayerStep> layers) const {
  for (const LayerStep& layer : layers) {
    KVS_RETURN_IF_ERROR(CheckAttentionStep(config().name, layer));
    const int64_t count = layer.keys.count;
    const int64_t size = int64_t{layer.num_q_heads} * count;
    std::vector<float>& accumulated = layer.state->accumulated;
    if (accumulated.empty()) {
      accumulated.assign(static_cast<size_t>(size), 0.0f);
    } else if (static_cast<int64_t>(accumulated.size()) != size) {
      return absl::InternalError(absl::StrCat("policy h2o: accumulated attention of layer ",
                                              layer.layer, " holds ", accumulated.size(),
                                              " values, expected ", size));
    }
    // Every query of the step counts, including steps that evict nothing (caote.md §5.4).
    SumQueryRows(layer.probs, layer.num_q_heads, layer.num_queries, layer.keys.count, 0,
                 /*accumulate=*/true, absl::MakeSpan(accumulated));
  }
  return absl::OkStatus();
}

absl::StatusOr<int32_t> H2oPolicy::RawScores(Backend&, Phase, const LayerSelection& layer,
                                             std::vector<float>& raw) const {
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
  raw = accumulated;
  return static_cast<int32_t>(accumulated.size() / count);
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
