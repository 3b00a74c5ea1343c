#include "cache/policy/cake.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache/policy/attention_stats.h"
#include "cache/policy/registry.h"
#include "gpu/base/status_macros.h"

namespace kvs {
namespace {

constexpr int32_t kDefaultWindow = 32;
constexpr float kDefaultTau = 1.0f;
constexpr int32_t kDefaultKernel = 5;

}  // namespace

AttentionRequirement CakePolicy::ScorerAttention(Phase phase) const {
  // Prefill: the observation window; decode: the new token's query alone.
  return AttentionRequirement{true, phase == Phase::kPrefill ? cake_.window : 1};
}

absl::Status CakePolicy::ObserveLayers(Backend& backend, Phase phase,
                                       absl::Span<const LayerStep> layers) const {
  // Every layer's statistics in one backend call and every layer's pooling in one more: what a
  // layer's call reads and writes is kept per layer until the calls have run.
  struct Prefill {
    const LayerStep* step;
    std::vector<float> rows;
    std::vector<float> pooled;
    std::vector<uint8_t> eligible;
  };
  std::deque<Prefill> prefills;
  std::deque<std::vector<float>> decode_rows;
  std::vector<WindowVarianceJob> statistics;
  PoolBatch pools;
  std::vector<uint8_t> eligible;
  std::vector<int32_t> scratch;
  std::vector<uint64_t> bitmap;
  for (const LayerStep& step : layers) {
    KVS_RETURN_IF_ERROR(CheckLayerStep(config().name, step));
    const int32_t hq = step.num_q_heads;
    const int32_t heads = step.keys.num_kv_heads;
    const int32_t count = step.keys.count;
    const int32_t nq = step.num_queries;
    const int64_t n = count;
    if (phase == Phase::kPrefill) {
      // Step 3 over the trailing window: mean + gamma * unbiased variance, fp64 per slot.
      const int32_t w = std::min(cake_.window, nq);
      const int32_t first_window_position = step.query_positions[nq - w];
      // Every slot of both is written (the indicator rows, then the pooling).
      Prefill& layer = prefills.emplace_back(Prefill{&step, {}, {}, {}});
      layer.rows.resize(static_cast<size_t>(hq) * n);
      layer.pooled.resize(layer.rows.size());
      layer.eligible.assign(static_cast<size_t>(heads) * n, 0);
      statistics.push_back(WindowVarianceJob{.probs = step.probs.data(),
                                             .num_q_heads = hq,
                                             .num_queries = nq,
                                             .window = w,
                                             .count = count,
                                             .gamma = cake_.gamma,
                                             .scores = layer.rows.data()});
      for (int64_t j = 0; j < heads * n; ++j) {
        layer.eligible[j] = step.positions[j] < first_window_position ? 1 : 0;
      }
      pools.Add(layer.rows, hq, heads, count, step.positions, layer.eligible, cake_.kernel_size,
                Pooling::kAvg, absl::MakeSpan(layer.pooled));
      continue;
    }
    // Decode (step 7): the last query's row, pooled over the candidates. With one query (the
    // decode step itself) the probabilities are those rows already.
    absl::Span<const float> last_rows = step.probs;
    if (nq > 1) {
      std::vector<float>& rows = decode_rows.emplace_back(static_cast<size_t>(hq) * n);
      for (int64_t q = 0; q < hq; ++q) {
        const float* row = step.probs.data() + (q * nq + (nq - 1)) * n;
        std::copy(row, row + n, rows.begin() + q * n);
      }
      last_rows = rows;
    }
    eligible.assign(static_cast<size_t>(heads) * n, 0);
    for (int32_t h = 0; h < heads; ++h) {
      const int32_t* positions = step.positions.data() + int64_t{h} * n;
      const int32_t candidates = count - cake_.window;
      if (candidates <= 0) continue;  // everything is window
      // Candidates: everything but the W newest positions.
      uint8_t* mark = eligible.data() + h * n;
      MarkSinksAndRecent(positions, count, 0, cake_.window, scratch, bitmap, mark);
      for (int64_t s = 0; s < n; ++s) mark[s] ^= 1;
    }
    // Window slots keep the unpooled probabilities; the pooling writes every slot.
    std::vector<float>& scores = step.state->step_scores;
    scores.resize(static_cast<size_t>(hq) * n);
    pools.Add(last_rows, hq, heads, count, step.positions, eligible, cake_.kernel_size,
              Pooling::kAvg, absl::MakeSpan(scores));
  }
  if (!statistics.empty()) KVS_RETURN_IF_ERROR(backend.WindowVarianceScores(statistics, nullptr));
  KVS_RETURN_IF_ERROR(pools.Run(backend));
  for (Prefill& layer : prefills) {
    const LayerStep& step = *layer.step;
    const int64_t cells = int64_t{step.keys.num_kv_heads} * step.keys.count;
    std::vector<float>& indicator = step.state->indicator;
    indicator.assign(static_cast<size_t>(cells), 0.0f);
    GqaMean(layer.pooled, step.num_q_heads, step.keys.num_kv_heads, step.keys.count,
            absl::MakeSpan(indicator));
    // The window is always kept: stored as +inf (cake.md step 3, Omega).
    for (int64_t j = 0; j < cells; ++j) {
      if (layer.eligible[j] == 0) indicator[j] = std::numeric_limits<float>::infinity();
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<AttentionScoredPolicy::RawRows> CakePolicy::RawScores(
    Backend&, Phase phase, const LayerSelection& layer, std::vector<float>& raw) const {
  const int64_t heads = layer.keys.num_kv_heads;
  const int64_t count = layer.keys.count;
  if (phase == Phase::kPrefill) {
    const std::vector<float>& indicator = layer.state->indicator;
    if (indicator.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "policy cake needs the window queries of layer ", layer.layer, ": field attention"));
    }
    if (static_cast<int64_t>(indicator.size()) != heads * count) {
      return absl::InternalError(absl::StrCat("layer ", layer.layer, " holds ", indicator.size(),
                                              " indicator entries for ", heads, " x ", count));
    }
    raw = indicator;
    // The +inf of the window would poison a normalisation (CAOTE): the window is protected by
    // Protect anyway, so it gets the row's largest finite score instead.
    for (int64_t h = 0; h < heads; ++h) {
      float* row = raw.data() + h * count;
      float best = 0.0f;
      for (int64_t s = 0; s < count; ++s) {
        if (std::isfinite(row[s])) best = std::max(best, row[s]);
      }
      for (int64_t s = 0; s < count; ++s) {
        if (!std::isfinite(row[s])) row[s] = best;
      }
    }
    return RawRows{raw, static_cast<int32_t>(heads)};
  }
  const std::vector<float>& scores = layer.state->step_scores;
  if (scores.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy cake needs the new token's query of layer ", layer.layer, ": field attention"));
  }
  const int64_t rows = count > 0 ? static_cast<int64_t>(scores.size()) / count : 0;
  if (rows < heads || rows % heads != 0 || static_cast<int64_t>(scores.size()) != rows * count) {
    return absl::InternalError(absl::StrCat("layer ", layer.layer, " holds ", scores.size(),
                                            " step scores for ", heads, " x ", count));
  }
  return RawRows{scores, static_cast<int32_t>(rows)};
}

ScoredPolicy::Protection CakePolicy::Protect(Phase, const LayerSelection& layer) const {
  return Protection{0, std::min(cake_.window, layer.keep)};
}

std::unique_ptr<AttentionScoredPolicy> MakeCakeScorer(const PolicyConfig& config,
                                                      const CakeConfig& cake) {
  return std::make_unique<CakePolicy>(config, cake);
}

absl::Status ResolveCakeParams(CakeConfig& cake, absl::string_view field_prefix) {
  // Zero is not a valid value of these: it stands for the spec's default.
  if (cake.window == 0) cake.window = kDefaultWindow;
  if (cake.tau1 == 0.0f) cake.tau1 = kDefaultTau;
  if (cake.tau2 == 0.0f) cake.tau2 = kDefaultTau;
  if (cake.kernel_size == 0) cake.kernel_size = kDefaultKernel;
  if (cake.window < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(field_prefix, ".window must be >= 1, got ", cake.window));
  }
  // Written so that NaN fails.
  const float kMax = std::numeric_limits<float>::max();
  if (!(cake.tau1 > 0.0f && cake.tau1 <= kMax)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field_prefix, ".tau1 must be finite and > 0, got ", cake.tau1));
  }
  if (!(cake.tau2 > 0.0f && cake.tau2 <= kMax)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field_prefix, ".tau2 must be finite and > 0, got ", cake.tau2));
  }
  if (!(cake.gamma >= 0.0f && cake.gamma <= kMax)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field_prefix, ".gamma must be finite and >= 0, got ", cake.gamma));
  }
  if (cake.kernel_size < 1 || cake.kernel_size % 2 == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field_prefix, ".kernel_size must be odd and >= 1, got ", cake.kernel_size));
  }
  return absl::OkStatus();
}

absl::Status ResolveCakeConfig(PolicyConfig& config) {
  return ResolveCakeParams(config.cake, "policy.cake");
}

std::unique_ptr<Policy> MakeCakePolicy(const PolicyConfig& config) {
  return MakeCakeScorer(config, config.cake);
}


void EncodeCakeFields(const CakeConfig& params, FieldWriter& out) {
  out.I32(1, params.window);
  out.F32(2, params.tau1);
  out.F32(3, params.tau2);
  out.F32(4, params.gamma);
  out.I32(5, params.kernel_size);
  out.Bool(6, params.non_cascading);
}

bool DecodeCakeFields(const FieldReader& in, CakeConfig* params) {
  return in.I32(1, &params->window) && in.F32(2, &params->tau1) && in.F32(3, &params->tau2) &&
         in.F32(4, &params->gamma) && in.I32(5, &params->kernel_size) &&
         in.Bool(6, &params->non_cascading);
}

// ---- Registry unit (cache/policy/registry.h) ----------------------------------------
namespace {

void EncodeCakeParams(const PolicyConfig& config, FieldWriter& out) {
  EncodeCakeFields(config.cake, out);
}
bool DecodeCakeParams(const FieldReader& in, uint32_t, PolicyConfig* config) {
  return DecodeCakeFields(in, &config->cake);
}
AllocatorDefaults CakeAllocatorDefaults(const PolicyConfig& config) {
  return {LayerAllocatorKind::kCake, &config.cake, config.cake.window};
}
}  // namespace

extern const PolicyUnit kCakeUnit;
const PolicyUnit kCakeUnit = {
    .name = kPolicyCake,
    .capabilities = {.needs_attention = true},
    .resolve = &ResolveCakeConfig,
    .make = &MakeCakePolicy,
    .allocator_defaults = &CakeAllocatorDefaults,
    .encode_params = &EncodeCakeParams,
    .decode_params = &DecodeCakeParams,
};

}  // namespace kvs
