// Layer allocators: how a sequence budget of `budget` tokens per layer is split across layers.
//   uniform   every layer keeps the budget.
//   PyramidKV budgets falling linearly with depth (min = budget / beta at the top layer, max =
//             2 * budget - min at layer 0), summing to about L * budget; or kvpress's rule
//             (KvpressPyramidBudget) for SnapKV with kvpress's defaults.
//   D2O       inverse-variance softmax over the layers' attention density, clamped (d2o.md §4.1).
//   CAKE      preference-proportional water-filling with caps, largest-remainder rounding, and
//             ceiling-provisional cascade stages that end equal to the one-shot split (cake.md §3).
// Every allocator raises a layer below the floor (AllocatorConfig::min_layer_tokens, default
// min(block_tokens, budget)) to it and reports how many it raised: a layer never rounds to zero
// silently. The pure functions are exposed for the specs' test vectors.
//
// Threading: pure functions and immutable allocator objects; safe to share.
#ifndef KVSIDECAR_CACHE_POLICY_ALLOCATOR_H_
#define KVSIDECAR_CACHE_POLICY_ALLOCATOR_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "cache/policy/policy.h"
#include "cache/policy/policy_config.h"

namespace kvs {

// The allocator a resolved policy config asks for (kDefault resolved per the policy's name).
std::unique_ptr<LayerAllocator> MakeLayerAllocator(const PolicyConfig& config);

// The CAKE window W the CAKE allocator reserves in every layer: config.cake.window for "cake",
// config.caote.cake.window for CAOTE over CAKE, config.snapkv.window for "snapkv",
// config.cake.window otherwise.
int32_t CakeWindowFor(const PolicyConfig& config);

// PyramidKV: per-layer budgets for L layers (before the floor and the counts cap).
std::vector<int32_t> PyramidBudgets(int32_t budget, int32_t num_layers, float beta);

// PyramidKV by kvpress 0.5.5's rule (PyramidKVPress.get_layer_budget) for layer `layer` of L
// holding `count` tokens, budget B tokens per layer and observation window w, in doubles:
//   min = B / beta, max = 2B - min; if max >= count - w: max = count - w, min = 2B - max;
//   unless count >= max >= min >= w: max(1, round(B)) (uniform, SnapKV's budget);
//   otherwise round(max - layer * (max - min) / (L - 1)),
// round() halving to even as Python's. Before the floor and the counts cap.
int32_t KvpressPyramidBudget(int32_t budget, int32_t count, int32_t num_layers, int32_t layer,
                             float beta, int32_t window);

// D2O layer density F^l from the column sums [num_q_heads][count] of one layer (d2o.md §4.1 step
// 2): unbiased variance per query head, then head-min-max-normalised mean (kHeadNorm) or mean
// (kRaw). fp64 accumulation.
double D2oLayerDensity(absl::Span<const float> column_sums, int32_t num_q_heads, int32_t count,
                       D2oDensityMode mode);
// alpha_l = clip(L * rho * exp(-F_l) / sum exp(-F), min_ratio, max_ratio) (d2o.md §4.1 step 3).
std::vector<double> D2oLayerRatios(absl::Span<const double> density, double rho, double min_ratio,
                                   double max_ratio);

// D2O's split of a layer budget B into sinks T = min(n_sink, B), recent M = floor((B - T) *
// recent_frac) and heavy hitters N = B - T - M (d2o.md §4.1 step 3, TV2).
struct D2oSplit {
  int32_t sinks = 0;
  int32_t heavy = 0;
  int32_t recent = 0;
};
inline D2oSplit SplitD2oBudget(int32_t budget, int32_t n_sink, float recent_frac) {
  D2oSplit split;
  split.sinks = std::clamp(n_sink, 0, std::max(budget, 0));
  // recent_frac is a float (0.3f is 0.29999999): nudge the product up by about one ulp first.
  const double rest = static_cast<double>(budget - split.sinks);
  split.recent =
      static_cast<int32_t>(FloorFraction(recent_frac, static_cast<int64_t>(rest)));
  split.heavy = budget - split.sinks - split.recent;
  return split;
}

// CAKE preference terms of one layer from its window attention probs [Hq][W][count] (the W
// window queries of the prompt, slot order): over the prefix slots of each query head's kv head
// (key_positions[g][s] < first_query_position) entropy H = -sum p ln(p + 1e-10) and shift V = sum
// over (head, slot) of the unbiased variance over the W rows (cake.md step 2). fp64. The
// allocator measures through Backend::WindowEntropyShift (gpu/backend.h WindowEntropyJob, the
// same definition); this is its host form, the CPU backend's code over host arrays, for callers
// without a backend. Zeros for a malformed shape.
struct CakeMeasure {
  double entropy = 0.0;
  double shift = 0.0;
};
CakeMeasure CakeLayerMeasure(absl::Span<const float> probs, int32_t num_q_heads,
                             int32_t num_queries, int32_t count, int32_t num_kv_heads,
                             absl::Span<const int32_t> key_positions, int32_t first_query_position);
// ln P = ln H / tau1 + ln V / tau2; -inf when H or V is 0.
double CakeLogPreference(const CakeMeasure& measure, double tau1, double tau2);

// CAKE's split of `total` non-window tokens over the layers whose log-preferences are given
// (cake.md step 4): water-filling x_l = f + min(cap_l - f, lambda * P_l) summing to
// min(total, sum caps); final = largest remainder (ties to the lower layer), provisional = ceil.
std::vector<int32_t> CakeAllocate(absl::Span<const double> log_preferences, int64_t total,
                                  absl::Span<const int32_t> caps, int32_t floor, bool final);

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_POLICY_ALLOCATOR_H_
