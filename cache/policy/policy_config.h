// PolicyConfig: a named, parameterised policy as the cache core sees it (the service converts
// kvsidecar.v1.PolicySpec into this). Zero values mean the spec's default. Value type.
#ifndef KVSIDECAR_CACHE_POLICY_POLICY_CONFIG_H_
#define KVSIDECAR_CACHE_POLICY_POLICY_CONFIG_H_

#include <cstdint>
#include <string>

#include "gpu/backend.h"

namespace kvs {

inline constexpr char kPolicyStreamingLlm[] = "streaming_llm";
inline constexpr char kPolicyKeyDiff[] = "keydiff";

struct StreamingLlmConfig {
  int32_t n_sink = 4;
};

struct KeyDiffConfig {
  KeyDiffAnchor anchor = KeyDiffAnchor::kMeanNormalized;
  KeyDiffMetric metric = KeyDiffMetric::kCosine;
  float recent_fraction = 0.0f;  // r = floor(recent_fraction * budget) newest positions kept
};

struct PolicyConfig {
  std::string name = kPolicyKeyDiff;
  StreamingLlmConfig streaming_llm;
  KeyDiffConfig keydiff;
};

struct BudgetConfig {
  int32_t tokens_per_layer = 0;        // 0 = unbounded
  bool strict = false;
  int32_t prefill_block_tokens = 128;  // N_b, strict mode only
};

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_POLICY_POLICY_CONFIG_H_
