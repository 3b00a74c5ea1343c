#include "cache/policy/snapkv.h"

#include <algorithm>
#include <deque>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache/policy/allocator.h"
#include "cache/policy/attention_stats.h"
#include "cache/policy/h2o.h"
#include "cache/policy/registry.h"
#include "gpu/base/status_macros.h"

namespace kvs {

SnapKvPolicy::SnapKvPolicy(const PolicyConfig& config, const SnapKvConfig& params)
    : AttentionScoredPolicy(config, MakeLayerAllocator(config)), params_(params) {}

absl::Status SnapKvPolicy::ObserveLayers(Backend& backend, Phase,
                                         absl::Span<const LayerStep> layers) const {
  // Every layer's pooling in one backend call: the window sums each pools are kept until then.
  PoolBatch pools;
  std::deque<std::vector<float>> sums;
  std::vector<uint8_t> eligible;
  std::vector<int32_t> scratch;
  std::vector<uint64_t> bitmap;
  for (const LayerStep& layer : layers) {
    KVS_RETURN_IF_ERROR(CheckLayerStep(config().name, layer));
    const int32_t count = layer.keys.count;
    const int32_t heads = layer.keys.num_kv_heads;
    const int32_t step_queries = layer.step_queries > 0 ? layer.step_queries : layer.num_queries;
    const int32_t window = std::min(params_.window, step_queries);
    if (layer.num_queries < window) {
      return absl::InvalidArgumentError(absl::StrCat(
          "attention.num_queries of layer ", layer.layer, ": policy ", config().name,
          " needs the last ", window, " queries of the step, got ", layer.num_queries));
    }
    const int64_t size = int64_t{layer.num_q_heads} * count;
    // A decode step's one query: its probabilities are the window sums already; so are
    // probabilities the backend summed over exactly the window.
    absl::Span<const float> window_sums = layer.probs;
    if (layer.summed_rows > 0 && layer.summed_rows != window) {
      return absl::InternalError(absl::StrCat("policy ", config().name, ": layer ", layer.layer,
                                              " carries sums of ", layer.summed_rows,
                                              " query rows for a window of ", window));
    }
    if (layer.summed_rows == 0 && (window != 1 || layer.num_queries != 1)) {
      // SumQueryRows clears what it sums into.
      std::vector<float>& layer_sums = sums.emplace_back(static_cast<size_t>(size));
      SumQueryRows(layer.probs, layer.num_q_heads, layer.num_queries, count, window,
                   /*accumulate=*/false, absl::MakeSpan(layer_sums));
      window_sums = layer_sums;
    }
    // The window = each head's `window` newest positions; everything older is pooled.
    eligible.assign(static_cast<size_t>(int64_t{heads} * count), 1);
    for (int32_t h = 0; h < heads; ++h) {
      const int32_t* pos = layer.positions.data() + int64_t{h} * count;
      uint8_t* mark = eligible.data() + int64_t{h} * count;
      if (window >= count) {
        std::fill(mark, mark + count, uint8_t{0});
        continue;
      }
      // Everything but the `window` newest positions.
      MarkSinksAndRecent(pos, count, 0, window, scratch, bitmap, mark);
      for (int32_t s = 0; s < count; ++s) mark[s] ^= 1;
    }
    std::vector<float>& scores = layer.state->step_scores;
    scores.resize(static_cast<size_t>(size));  // the pooling writes every slot
    pools.Add(window_sums, layer.num_q_heads, heads, count, layer.positions, eligible,
              params_.kernel_size, params_.pooling, absl::MakeSpan(scores));
    layer.state->step_protected_recent = window;
  }
  return pools.Run(backend);
}

absl::StatusOr<AttentionScoredPolicy::RawRows> SnapKvPolicy::RawScores(Backend&, Phase,
                                                                       const LayerSelection& layer,
                                                                       std::vector<float>&) const {
  const std::vector<float>& scores = layer.state->step_scores;
  const int64_t count = layer.keys.count;
  if (scores.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy ", config().name,
        " needs attention (the last min(window, step) queries) in this call: field attention"));
  }
  if (count == 0 || scores.size() % count != 0) {
    return absl::InternalError(absl::StrCat("policy ", config().name, ": step scores of layer ",
                                            layer.layer, " hold ", scores.size(), " values for ",
                                            count, " slots"));
  }
  return RawRows{scores, static_cast<int32_t>(scores.size() / count)};
}

ScoredPolicy::Protection SnapKvPolicy::Protect(Phase, const LayerSelection& layer) const {
  return Protection{0, std::clamp(layer.state->step_protected_recent, 0, layer.keep)};
}

absl::Status ResolveSnapKvParams(SnapKvConfig& params, const char* field, int32_t default_window,
                                 int32_t default_kernel) {
  if (params.window < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".window must be >= 1, got ", params.window));
  }
  switch (params.defaults) {
    case SnapKvDefaults::kPaper:
      break;
    case SnapKvDefaults::kKvpress:
      default_window = kKvpressSnapKvWindow;
      default_kernel = kKvpressSnapKvKernel;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(field, ".defaults is not a known set: ",
                                                     static_cast<int>(params.defaults)));
  }
  if (params.window == 0) params.window = default_window;
  if (params.kernel_size == 0) params.kernel_size = default_kernel;
  if (params.kernel_size < 1 || params.kernel_size % 2 == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".kernel_size must be odd and >= 1, got ", params.kernel_size));
  }
  if (params.pooling != Pooling::kAvg && params.pooling != Pooling::kMax) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".pooling is not a known pooling: ", static_cast<int>(params.pooling)));
  }
  return absl::OkStatus();
}

absl::Status ResolveSnapKvConfig(PolicyConfig& config) {
  return ResolveSnapKvParams(config.snapkv, "policy.snapkv", kDefaultSnapKvWindow,
                             kDefaultSnapKvKernel);
}

std::unique_ptr<Policy> MakeSnapKvPolicy(const PolicyConfig& config) {
  return std::make_unique<SnapKvPolicy>(config);
}


void EncodeSnapKvFields(const SnapKvConfig& params, FieldWriter& out) {
  out.I32(1, params.window);
  out.I32(2, params.kernel_size);
  out.Enum(3, params.pooling);
  // Written only when it differs from the default, so a paper-defaults snapshot is byte-for-byte
  // what earlier builds wrote; absent reads back as kPaper.
  if (params.defaults != SnapKvDefaults::kPaper) out.Enum(4, params.defaults);
}

bool DecodeSnapKvFields(const FieldReader& in, SnapKvConfig* params) {
  return in.I32(1, &params->window) && in.I32(2, &params->kernel_size) &&
         in.Enum(3, &params->pooling) && in.Enum(4, &params->defaults);
}

// ---- Registry unit (cache/policy/registry.h) ----------------------------------------
namespace {

void EncodeSnapKvParams(const PolicyConfig& config, FieldWriter& out) {
  EncodeSnapKvFields(config.snapkv, out);
}
bool DecodeSnapKvParams(const FieldReader& in, uint32_t, PolicyConfig* config) {
  return DecodeSnapKvFields(in, &config->snapkv);
}
AllocatorDefaults SnapKvAllocatorDefaults(const PolicyConfig& config) {
  // Composed with the CAKE allocator, SnapKV's observation window is the window every layer
  // keeps on top of its share; composed with PyramidKV, kvpress's defaults bring kvpress's
  // budget rule, which reads the window too.
  return {LayerAllocatorKind::kUniform, nullptr, config.snapkv.window,
          config.snapkv.defaults == SnapKvDefaults::kKvpress};
}
}  // namespace

extern const PolicyUnit kSnapKvUnit;
const PolicyUnit kSnapKvUnit = {
    .name = kPolicySnapKv,
    .capabilities = {.needs_attention = true},
    .resolve = &ResolveSnapKvConfig,
    .make = &MakeSnapKvPolicy,
    .allocator_defaults = &SnapKvAllocatorDefaults,
    .encode_params = &EncodeSnapKvParams,
    .decode_params = &DecodeSnapKvParams,
};

}  // namespace kvs
