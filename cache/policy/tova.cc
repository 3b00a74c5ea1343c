#include "cache/policy/tova.h"

#include <algorithm>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "cache/policy/allocator.h"
#include "cache/policy/attention_stats.h"
#include "cache/policy/h2o.h"
#include "cache/policy/registry.h"
#include "gpu/base/status_macros.h"

namespace kvs {

TovaPolicy::TovaPolicy(const PolicyConfig& config, const TovaConfig& params)
    : AttentionScoredPolicy(config, MakeLayerAllocator(config)), params_(params) {}

absl::Status TovaPolicy::ObserveLayers(Backend&, Phase, absl::Span<const LayerStep> layers) const {
  for (const LayerStep& layer : layers) {
    KVS_RETURN_IF_ERROR(CheckLayerStep(config().name, layer));
    const int64_t size = int64_t{layer.num_q_heads} * layer.keys.count;
    std::vector<float>& scores = layer.state->step_scores;
    scores.assign(static_cast<size_t>(size), 0.0f);
    SumQueryRows(layer.probs, layer.num_q_heads, layer.num_queries, layer.keys.count, 1,
                 /*accumulate=*/false, absl::MakeSpan(scores));
  }
  return absl::OkStatus();
}

absl::StatusOr<AttentionScoredPolicy::RawRows> TovaPolicy::RawScores(
    Backend&, Phase, const LayerSelection& layer, std::vector<float>& raw) const {
  const std::vector<float>& scores = layer.state->step_scores;
  const int64_t count = layer.keys.count;
  const int64_t heads = layer.keys.num_kv_heads;
  if (scores.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy ", config().name,
                     " needs attention (the last query) in this call: field attention"));
  }
  if (count == 0 || scores.size() % count != 0 ||
      static_cast<int64_t>(scores.size() / count) % heads != 0) {
    return absl::InternalError(absl::StrCat("policy ", config().name, ": step scores of layer ",
                                            layer.layer, " hold ", scores.size(), " values for ",
                                            heads, " x ", count, " slots"));
  }
  const int64_t rows = static_cast<int64_t>(scores.size()) / count;
  if (!params_.all_heads) return RawRows{scores, static_cast<int32_t>(rows)};
  // One score per TOKEN over every query head of the layer. Heads may hold different positions
  // in a given slot (compaction is per head), so the mean is taken by position, over the query
  // heads whose kv head still holds the token.
  const int64_t rows_per_head = rows / heads;
  raw.assign(static_cast<size_t>(heads * count), 0.0f);
  const int32_t* positions = layer.positions.data();
  bool same_slots = true;  // every kv head holds the same position in each slot
  for (int64_t h = 1; h < heads && same_slots; ++h) {
    same_slots = std::equal(positions, positions + count, positions + h * count);
  }
  if (same_slots) {
    // The common case (all_heads keeps one set for every head): a column mean, summed in the
    // same row order as the by-position mean below, so the result is the same to the bit.
    std::vector<double> sums(static_cast<size_t>(count), 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = scores.data() + r * count;
      int64_t s = 0;
      for (; s + 16 <= count; s += 16) {  // fixed chunks, which -O2 vectorises
        for (int j = 0; j < 16; ++j) sums[s + j] += row[s + j];
      }
      for (; s < count; ++s) sums[s] += row[s];
    }
    for (int64_t s = 0; s < count; ++s) raw[s] = static_cast<float>(sums[s] / rows);
    for (int64_t h = 1; h < heads; ++h) {
      std::copy(raw.begin(), raw.begin() + count, raw.begin() + h * count);
    }
    return RawRows{raw, static_cast<int32_t>(heads)};
  }
  absl::flat_hash_map<int32_t, std::pair<double, int32_t>> by_position;
  by_position.reserve(static_cast<size_t>(count));
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* pos = positions + (r / rows_per_head) * count;
    for (int64_t s = 0; s < count; ++s) {
      auto& [sum, n] = by_position[pos[s]];
      sum += scores[r * count + s];
      ++n;
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t s = 0; s < count; ++s) {
      const auto& [sum, n] = by_position.at(positions[h * count + s]);
      raw[h * count + s] = static_cast<float>(sum / n);
    }
  }
  return RawRows{raw, static_cast<int32_t>(heads)};
}

ScoredPolicy::Protection TovaPolicy::Protect(Phase, const LayerSelection& layer) const {
  // kvpress scores the last token max + 1, so it survives any budget of at least one token.
  return Protection{0, params_.keep_last_token ? std::min(1, layer.keep) : 0};
}

absl::Status ResolveTovaConfig(PolicyConfig&) { return absl::OkStatus(); }

std::unique_ptr<Policy> MakeTovaPolicy(const PolicyConfig& config) {
  return std::make_unique<TovaPolicy>(config);
}


// ---- Registry unit (cache/policy/registry.h) ----------------------------------------
namespace {

void EncodeTovaParams(const PolicyConfig& config, FieldWriter& out) {
  out.Bool(1, config.tova.all_heads);
  // Only when set: a default snapshot stays what earlier builds wrote; absent reads as false.
  if (config.tova.keep_last_token) out.Bool(2, true);
}
bool DecodeTovaParams(const FieldReader& in, uint32_t, PolicyConfig* config) {
  return in.Bool(1, &config->tova.all_heads) && in.Bool(2, &config->tova.keep_last_token);
}
}  // namespace

extern const PolicyUnit kTovaUnit;
const PolicyUnit kTovaUnit = {
    .name = kPolicyTova,
    .capabilities = {.needs_attention = true},
    .resolve = &ResolveTovaConfig,
    .make = &MakeTovaPolicy,
    .encode_params = &EncodeTovaParams,
    .decode_params = &DecodeTovaParams,
};

}  // namespace kvs
