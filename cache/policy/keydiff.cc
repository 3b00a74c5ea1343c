#include "cache/policy/keydiff.h"
#include "cache/policy/registry.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvs {

int32_t KeyDiffPolicy::RecentTokens(int32_t keep) const {
  return static_cast<int32_t>(FloorFraction(config().keydiff.recent_fraction, keep));
}

ScoredPolicy::Protection KeyDiffPolicy::Protect(Phase, const LayerSelection& layer) const {
  return Protection{0, RecentTokens(layer.keep)};
}

absl::Status KeyDiffPolicy::Score(Backend& backend, Phase, absl::Span<const LayerSelection> layers,
                                  absl::Span<float* const> scores) const {
  // The anchor runs over all candidates, recent ones included (keydiff.md §10.7).
  std::vector<KeyDiffScoreJob> jobs(layers.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    jobs[i].keys = layers[i].keys;
    jobs[i].anchor = config().keydiff.anchor;
    jobs[i].metric = config().keydiff.metric;
    jobs[i].scores = scores[i];
  }
  return backend.KeyDiffScores(jobs, nullptr);
}

absl::Status ResolveKeyDiffConfig(PolicyConfig& config) {
  const KeyDiffConfig& keydiff = config.keydiff;
  switch (keydiff.anchor) {
    case KeyDiffAnchor::kMeanNormalized:
    case KeyDiffAnchor::kMeanRaw:
    case KeyDiffAnchor::kMedianNormalized:
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "policy.keydiff.anchor is not a known anchor: ", static_cast<int>(keydiff.anchor)));
  }
  switch (keydiff.metric) {
    case KeyDiffMetric::kCosine:
    case KeyDiffMetric::kPairwise:
    case KeyDiffMetric::kDot:
    case KeyDiffMetric::kEuclidean:
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "policy.keydiff.metric is not a known metric: ", static_cast<int>(keydiff.metric)));
  }
  // Written so that NaN fails too.
  if (!(keydiff.recent_fraction >= 0.0f && keydiff.recent_fraction <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.keydiff.recent_fraction must be in [0, 1], got ", keydiff.recent_fraction));
  }
  return absl::OkStatus();
}

std::unique_ptr<Policy> MakeKeyDiffPolicy(const PolicyConfig& config) {
  return std::make_unique<KeyDiffPolicy>(config);
}


// ---- Registry unit (cache/policy/registry.h) ----------------------------------------
namespace {

void EncodeKeyDiffParams(const PolicyConfig& config, FieldWriter& out) {
  out.Enum(1, config.keydiff.anchor);
  out.Enum(2, config.keydiff.metric);
  out.F32(3, config.keydiff.recent_fraction);
}
bool DecodeKeyDiffParams(const FieldReader& in, uint32_t, PolicyConfig* config) {
  return in.Enum(1, &config->keydiff.anchor) && in.Enum(2, &config->keydiff.metric) &&
         in.F32(3, &config->keydiff.recent_fraction);
}
}  // namespace

extern const PolicyUnit kKeyDiffUnit;
const PolicyUnit kKeyDiffUnit = {
    .name = kPolicyKeyDiff,
    .capabilities = {.needs_attention = false, .query_agnostic = true},
    .resolve = &ResolveKeyDiffConfig,
    .make = &MakeKeyDiffPolicy,
    .encode_params = &EncodeKeyDiffParams,
    .decode_params = &DecodeKeyDiffParams,
};

}  // namespace kvs
