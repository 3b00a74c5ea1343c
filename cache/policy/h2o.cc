#include "cache/policy/h2o.h"

#include <algorithm>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache/policy/allocator.h"
#include "cache/policy/attention_stats.h"
#include "cache/policy/registry.h"
#include "gpu/base/status_macros.h"

namespace kvs {

H2oPolicy::H2oPolicy(const PolicyConfig& config, const H2oConfig& params)
    : AttentionScoredPolicy(config, MakeLayerAllocator(config)), params_(params) {}

absl::StatusOr<AttentionScoredPolicy::RawRows> H2oPolicy::RawScores(
    Backend&, Phase, const LayerSelection& layer, std::vector<float>& raw) const {
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
  const int32_t rows = static_cast<int32_t>(accumulated.size() / count);
  if (!params_.normalize_by_queries) return RawRows{accumulated, rows};
  const int64_t heads = layer.keys.num_kv_heads;
  if (heads < 1 || rows % heads != 0 ||
      static_cast<int64_t>(layer.positions.size()) != heads * count) {
    return absl::InternalError(absl::StrCat("policy h2o: layer ", layer.layer, " has ", rows,
                                            " rows for ", heads, " kv heads"));
  }
  const std::vector<int32_t> observers =
      ObserverCounts(layer.state->observed_queries, layer.positions);
  const int64_t rows_per_head = rows / heads;
  raw.resize(accumulated.size());
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* seen = observers.data() + (r / rows_per_head) * count;
    const float* sums = accumulated.data() + r * count;
    float* out = raw.data() + r * count;
    for (int64_t s = 0; s < count; ++s) {
      // Unseen keys have a zero sum: they score 0 rather than 0/0.
      out[s] = seen[s] > 0 ? static_cast<float>(double{sums[s]} / seen[s]) : 0.0f;
    }
  }
  return RawRows{raw, rows};
}

absl::Status H2oPolicy::ObserveLayers(Backend&, Phase, absl::Span<const LayerStep> layers) const {
  if (!params_.normalize_by_queries) return absl::OkStatus();
  for (const LayerStep& layer : layers) {
    if (static_cast<int32_t>(layer.query_positions.size()) != layer.num_queries) {
      return absl::InternalError(absl::StrCat("policy h2o: layer ", layer.layer, " has ",
                                              layer.query_positions.size(),
                                              " query positions for ", layer.num_queries,
                                              " queries"));
    }
    std::vector<int32_t>& runs = layer.state->observed_queries;
    for (int32_t p : layer.query_positions) {
      // Extends the last run when contiguous: a prompt and every decode step after it stay one.
      if (!runs.empty() && runs.back() == p && p < std::numeric_limits<int32_t>::max()) {
        ++runs.back();
      } else {
        runs.push_back(p);
        runs.push_back(p + 1);
      }
    }
  }
  return absl::OkStatus();
}

std::vector<int32_t> ObserverCounts(absl::Span<const int32_t> runs,
                                    absl::Span<const int32_t> positions) {
  // A run [s, e) holds e - max(s, p) queries at or after p when e > p. Summed over runs that is
  //   count(p) = g(ends, p) - g(starts, p),  g(xs, p) = sum over x in xs, x > p, of (x - p),
  // each g one binary search over sorted values with suffix sums: O((runs + keys) log runs),
  // however long the runs are.
  std::vector<int64_t> starts, ends;
  for (size_t i = 0; i + 1 < runs.size(); i += 2) {
    if (runs[i + 1] <= runs[i]) continue;
    starts.push_back(runs[i]);
    ends.push_back(runs[i + 1]);
  }
  std::sort(starts.begin(), starts.end());
  std::sort(ends.begin(), ends.end());
  auto suffix_sums = [](const std::vector<int64_t>& xs) {
    std::vector<int64_t> sums(xs.size() + 1, 0);
    for (size_t i = xs.size(); i-- > 0;) sums[i] = sums[i + 1] + xs[i];
    return sums;
  };
  const std::vector<int64_t> start_sums = suffix_sums(starts);
  const std::vector<int64_t> end_sums = suffix_sums(ends);
  auto g = [](const std::vector<int64_t>& xs, const std::vector<int64_t>& sums, int64_t p) {
    const size_t first = std::upper_bound(xs.begin(), xs.end(), p) - xs.begin();
    return sums[first] - p * static_cast<int64_t>(xs.size() - first);
  };
  std::vector<int32_t> counts(positions.size());
  for (size_t s = 0; s < positions.size(); ++s) {
    const int64_t p = positions[s];
    const int64_t n = g(ends, end_sums, p) - g(starts, start_sums, p);
    counts[s] = static_cast<int32_t>(std::clamp<int64_t>(n, 0, std::numeric_limits<int32_t>::max()));
  }
  return counts;
}

std::optional<DeviceDecodeRule> H2oPolicy::DeviceScores() const {
  if (params_.normalize_by_queries) return std::nullopt;
  return DeviceDecodeRule{.scores = DecodeScores::kAccumulated};
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

// Tag of the observed query runs in H2O's layer state, beside the shared encoding's tags.
constexpr uint32_t kTagObservedQueries = 32;

void EncodeH2oParams(const PolicyConfig& config, FieldWriter& out) {
  out.I32(1, config.h2o.n_sink);
  out.I32(2, config.h2o.n_recent);
  // Only when set: a default snapshot stays what earlier builds wrote; absent reads as false.
  if (config.h2o.normalize_by_queries) out.Bool(3, true);
}
bool DecodeH2oParams(const FieldReader& in, uint32_t, PolicyConfig* config) {
  return in.I32(1, &config->h2o.n_sink) && in.I32(2, &config->h2o.n_recent) &&
         in.Bool(3, &config->h2o.normalize_by_queries);
}
void EncodeH2oState(const LayerPolicyState& state, FieldWriter& out) {
  EncodeLayerState(state, out);
  if (!state.observed_queries.empty()) out.I32s(kTagObservedQueries, state.observed_queries);
}
bool DecodeH2oState(const FieldReader& in, LayerPolicyState* state) {
  return DecodeLayerState(in, state) && in.I32s(kTagObservedQueries, &state->observed_queries) &&
         state->observed_queries.size() % 2 == 0;
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
    .encode_state = &EncodeH2oState,
    .decode_state = &DecodeH2oState,
};

}  // namespace kvs
