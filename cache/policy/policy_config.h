// PolicyConfig: a named, parameterised policy as the cache core sees it (the service converts
// kvsidecar.v1.PolicySpec into this). Zero values mean the spec's default; ResolvePolicyConfig
// (policy.h) fills them in. Value types, no behaviour.
#ifndef KVSIDECAR_CACHE_POLICY_POLICY_CONFIG_H_
#define KVSIDECAR_CACHE_POLICY_POLICY_CONFIG_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "gpu/backend.h"

namespace kvs {

inline constexpr char kPolicyStreamingLlm[] = "streaming_llm";
inline constexpr char kPolicyKeyDiff[] = "keydiff";
inline constexpr char kPolicyH2o[] = "h2o";
inline constexpr char kPolicyTova[] = "tova";
inline constexpr char kPolicySnapKv[] = "snapkv";
inline constexpr char kPolicyCake[] = "cake";
inline constexpr char kPolicyD2o[] = "d2o";
inline constexpr char kPolicyCaote[] = "caote";
inline constexpr char kPolicyOmniKv[] = "omnikv";

// The one rounding rule for every fraction of a token count (KeyDiff's recent_fraction, D2O's
// recent_frac, OmniKV's selected_fraction, D2O's rho): floor(fraction * tokens), clamped to
// [0, tokens], with the product nudged up by about one float ulp first. Fractions arrive as
// float32, and 0.7f is 0.69999999: 0.7 of 10 must be 7 and 0.9 of 10 must be 9.
inline int64_t FloorFraction(double fraction, int64_t tokens) {
  const double product = std::floor(fraction * static_cast<double>(tokens) * (1.0 + 1.2e-7));
  return static_cast<int64_t>(std::clamp(product, 0.0, static_cast<double>(std::max<int64_t>(
                                                           tokens, 0))));
}

struct StreamingLlmConfig {
  int32_t n_sink = 4;
};

struct KeyDiffConfig {
  KeyDiffAnchor anchor = KeyDiffAnchor::kMeanNormalized;
  KeyDiffMetric metric = KeyDiffMetric::kCosine;
  float recent_fraction = 0.0f;  // r = floor(recent_fraction * budget) newest positions kept
};

// H2O: accumulated attention (column sums of every query the sidecar saw), sinks + recent kept.
// normalize_by_queries = kvpress's ObservedAttentionPress: each key's sum divided by the number
// of observed queries whose position is at or after the key's (the queries that can see it).
struct H2oConfig {
  int32_t n_sink = 0;
  int32_t n_recent = 0;
  bool normalize_by_queries = false;
};

// TOVA: the last query's attention; all_heads = one score per layer from the mean over every
// query head of the layer (original TOVA) instead of per kv head group.
// keep_last_token = kvpress's TOVAPress: the newest position of every head is always kept.
struct TovaConfig {
  bool all_heads = false;
  bool keep_last_token = false;
};

enum class Pooling { kAvg, kMax };

// Which defaults a SnapKV configuration takes: the paper's (window 32, kernel 7, PyramidKV's
// pyramid always) or kvpress 0.5.5's (window 64, kernel 5, and PyramidKV's budgets by kvpress's
// rule: top layer capped at T - window, uniform when the pyramid would go below the window).
enum class SnapKvDefaults { kPaper, kKvpress };

// SnapKV: the last w queries' attention summed, pooled along the prefix (stride 1, zero padding
// kernel/2, divide by kernel), the window's own tokens always kept.
struct SnapKvConfig {
  int32_t window = 32;
  int32_t kernel_size = 7;
  Pooling pooling = Pooling::kAvg;
  SnapKvDefaults defaults = SnapKvDefaults::kPaper;
};

// CAKE (cake.md): window W, preference temperatures, variance weight, pooling kernel.
struct CakeConfig {
  int32_t window = 32;
  float tau1 = 1.0f;
  float tau2 = 1.0f;
  float gamma = 200.0f;
  int32_t kernel_size = 5;
  bool non_cascading = false;
};

enum class D2oDensityMode { kHeadNorm, kRaw };
enum class D2oMergeWeighting { kPaper, kCode };
enum class D2oThresholdScope { kLayerHead, kLayer };

// D2O (d2o.md §3).
struct D2oConfig {
  float rho = 0.0f;  // total budget / prompt length when the sequence has no token budget
  float recent_frac = 0.25f;
  int32_t n_sink = 4;
  float beta = 0.7f;
  D2oDensityMode density_mode = D2oDensityMode::kHeadNorm;
  float min_ratio = 0.01f;
  float max_ratio = 1.0f;
  std::vector<int32_t> full_cache_layers;  // never compressed
  D2oMergeWeighting merge_weighting = D2oMergeWeighting::kPaper;
  D2oThresholdScope threshold_scope = D2oThresholdScope::kLayerHead;
};

enum class CaoteBase { kH2o, kTova, kSnapKv, kCake };
enum class CaoteVariant { kExact, kFast, kNone };
enum class GqaReduce { kMean, kRss };

// CAOTE (caote.md): a value-aware wrapper over an attention-based base scorer.
struct CaoteConfig {
  CaoteBase base = CaoteBase::kH2o;
  CaoteVariant variant = CaoteVariant::kExact;
  GqaReduce gqa_reduce = GqaReduce::kMean;
  float eps = 1e-6f;
  int32_t n_sink = 0;
  int32_t n_recent = 0;
  bool greedy = false;  // evict one token at a time, renormalising (extension; O(n * evicted))
  SnapKvConfig snapkv{32, 5, Pooling::kAvg};  // CAOTE's SnapKV defaults (caote.md §6)
  CakeConfig cake;
};

enum class OmniKvSelector { kLast, kSoftmaxBeforeLast, kUniform, kExp };

// OmniKV (omnikv.md): never evicts; at each decode step the filter layers choose top-k prompt
// tokens (one index set per filter layer) that the sparse layers of its segment attend to.
struct OmniKvConfig {
  std::vector<int32_t> filter_layers;  // ascending, distinct, >= 0; required
  int32_t wait_layers = 1;             // w
  int32_t selected_tokens = 0;         // k; 0 = floor(selected_fraction * N)
  float selected_fraction = 0.067f;
  OmniKvSelector selector = OmniKvSelector::kLast;
  int32_t window = 16;  // W for uniform / exp
  // Keep the sparse layers' prompt K/V in the host tier (freeing their arena blocks); false =
  // everything stays in the arena and Select gathers arena -> staging.
  bool offload = false;
};

enum class LayerAllocatorKind { kDefault, kUniform, kPyramidKv, kD2o, kCake };

// How a sequence budget is split across layers. kDefault = the policy's own (D2O -> kD2o,
// CAKE -> kCake, every other policy -> kUniform).
struct AllocatorConfig {
  LayerAllocatorKind kind = LayerAllocatorKind::kDefault;
  // Floor per layer: an allocation never gives a layer fewer tokens than this (unless it holds
  // fewer); 0 = min(block_tokens, budget). Raising a layer to the floor is reported.
  int32_t min_layer_tokens = 0;
  float pyramid_beta = 20.0f;
};

struct PolicyConfig {
  std::string name = kPolicyKeyDiff;
  StreamingLlmConfig streaming_llm;
  KeyDiffConfig keydiff;
  H2oConfig h2o;
  TovaConfig tova;
  SnapKvConfig snapkv;
  CakeConfig cake;
  D2oConfig d2o;
  CaoteConfig caote;
  OmniKvConfig omnikv;
  AllocatorConfig allocator;
};

struct BudgetConfig {
  int32_t tokens_per_layer = 0;  // 0 = unbounded
  bool strict = false;
  int32_t prefill_block_tokens = 128;  // N_b, strict mode only
  // Explicit per-layer budgets (size L, each > 0) that override the allocator; empty = none.
  std::vector<int32_t> per_layer_tokens;
};

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_POLICY_POLICY_CONFIG_H_
