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

namespace {

// The all_heads score of every slot of every kv head ([H][count], into `out`): the mean over
// every query head's row of `rows` ([Hq][count]) by position, over the query heads whose kv head
// still holds the token (compaction is per head, so heads may hold different positions in a
// slot).
void AllHeadsMeans(const float* rows, int64_t num_rows, int64_t heads, int64_t count,
                   const int32_t* positions, std::vector<float>& out) {
  out.resize(static_cast<size_t>(heads * count));
  bool same_slots = true;  // every kv head holds the same position in each slot
  for (int64_t h = 1; h < heads && same_slots; ++h) {
    same_slots = std::equal(positions, positions + count, positions + h * count);
  }
  if (same_slots) {
    // The common case (all_heads keeps one set for every head): a column mean, summed in the
    // same row order as the by-position mean below, so the result is the same to the bit.
    std::vector<double> sums(static_cast<size_t>(count), 0.0);
    for (int64_t r = 0; r < num_rows; ++r) {
      const float* row = rows + r * count;
      int64_t s = 0;
      for (; s + 16 <= count; s += 16) {  // fixed chunks, which -O2 vectorises
        for (int j = 0; j < 16; ++j) sums[s + j] += row[s + j];
      }
      for (; s < count; ++s) sums[s] += row[s];
    }
    for (int64_t s = 0; s < count; ++s) out[s] = static_cast<float>(sums[s] / num_rows);
    for (int64_t h = 1; h < heads; ++h) {
      std::copy(out.begin(), out.begin() + count, out.begin() + h * count);
    }
    return;
  }
  const int64_t rows_per_head = num_rows / heads;
  absl::flat_hash_map<int32_t, std::pair<double, int32_t>> by_position;
  by_position.reserve(static_cast<size_t>(count));
  for (int64_t r = 0; r < num_rows; ++r) {
    const int32_t* pos = positions + (r / rows_per_head) * count;
    for (int64_t s = 0; s < count; ++s) {
      auto& [sum, n] = by_position[pos[s]];
      sum += rows[r * count + s];
      ++n;
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t s = 0; s < count; ++s) {
      const auto& [sum, n] = by_position.at(positions[h * count + s]);
      out[h * count + s] = static_cast<float>(sum / n);
    }
  }
}

}  // namespace

absl::Status TovaPolicy::ObserveLayers(Backend&, Phase, absl::Span<const LayerStep> layers) const {
  for (const LayerStep& layer : layers) {
    KVS_RETURN_IF_ERROR(CheckLayerStep(config().name, layer));
    const int64_t count = layer.keys.count;
    const int64_t size = int64_t{layer.num_q_heads} * count;
    std::vector<float>& scores = layer.state->step_scores;
    if (!params_.all_heads) {
      scores.resize(static_cast<size_t>(size));
      SumQueryRows(layer.probs, layer.num_q_heads, layer.num_queries, layer.keys.count, 1,
                   /*accumulate=*/false, absl::MakeSpan(scores));
      continue;
    }
    // all_heads: the layer mean is taken here, from the step's rows as they are, and kept as
    // [H][count] (an eighth of the [Hq][count] rows for GQA groups of 8), so the rows are
    // neither copied nor read a second time by Select.
    const float* rows = layer.probs.data();
    std::vector<float> summed;
    if (layer.num_queries != 1) {
      summed.resize(static_cast<size_t>(size));
      SumQueryRows(layer.probs, layer.num_q_heads, layer.num_queries, layer.keys.count, 1,
                   /*accumulate=*/false, absl::MakeSpan(summed));
      rows = summed.data();
    }
    AllHeadsMeans(rows, layer.num_q_heads, layer.keys.num_kv_heads, count,
                  layer.positions.data(), scores);
  }
  return absl::OkStatus();
}

absl::StatusOr<AttentionScoredPolicy::RawRows> TovaPolicy::RawScores(
    Backend&, Phase, const LayerSelection& layer, std::vector<float>&) const {
  const std::vector<float>& scores = layer.state->step_scores;
  const int64_t count = layer.keys.count;
  const int64_t heads = layer.keys.num_kv_heads;
  if (scores.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy ", config().name,
                     " needs attention (the last query) in this call: field attention"));
  }
  // Observe left [H][count] (all_heads) or [Hq][count].
  const int64_t rows = params_.all_heads ? heads : layer.num_q_heads;
  if (count == 0 || static_cast<int64_t>(scores.size()) != rows * count) {
    return absl::InternalError(absl::StrCat("policy ", config().name, ": step scores of layer ",
                                            layer.layer, " hold ", scores.size(), " values for ",
                                            rows, " x ", count, " slots"));
  }
  return RawRows{scores, static_cast<int32_t>(rows)};
}

std::optional<DeviceDecodeRule> TovaPolicy::DeviceScores() const {
  if (params_.all_heads) return std::nullopt;
  return DeviceDecodeRule{.scores = DecodeScores::kRows,
                          .rows = DeviceDecodeRule::Rows::kAttention};
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
