// OmniKvState: what an OmniKV sequence keeps for Select (policies/omnikv.md §10) — N and k
// (fixed by the first Select), the layer plan, the sparse layers' prompt K/V when they are
// offloaded to the host tier, one staging block table per sparse layer (the gathered T_f plus
// the layer's generated tokens, which the worker attends to), and per filter layer its last
// selection (for idempotent retries) and, for the window selectors, its last W queries.
//
// Internal to cache/: Sequence owns one (created by its first Select) and cache/omnikv.cc
// implements Sequence::Select over it. Threading: none; the session lock serialises access.
#ifndef KVSIDECAR_CACHE_OMNIKV_H_
#define KVSIDECAR_CACHE_OMNIKV_H_

#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <vector>

#include "cache/policy/omnikv.h"
#include "cache/tier.h"

namespace kvs {

struct OmniKvState {
  OmniKvPlan plan;
  int64_t prompt_end = 0;  // N: positions below it are the prompt
  int32_t k = 0;
  // Offloaded prompt K/V of the sparse layers ([2][H][n][D] per sparse layer, in prompt order;
  // empty for the others), held in the host tier under `host_key` and shared with it.
  std::shared_ptr<const SpilledSequence> host;
  std::vector<int32_t> host_tokens;  // per layer: prompt tokens in `host` (0 = none)
  SpillKey host_key;
  // Per layer: the staging blocks of a sparse layer (empty otherwise).
  std::vector<std::vector<int32_t>> staging;

  struct Filter {
    int64_t last_step = std::numeric_limits<int64_t>::min();
    std::vector<int32_t> selected;  // T_f of last_step, ascending positions
    // Window selectors: the last W queries ([Hq][D] each, oldest first) and their positions.
    std::deque<std::vector<float>> window_queries;
    std::deque<int64_t> window_positions;
  };
  std::vector<Filter> filters;  // per entry of the config's filter_layers

  int32_t staging_blocks() const {
    int64_t total = 0;
    for (const auto& blocks : staging) total += static_cast<int64_t>(blocks.size());
    return static_cast<int32_t>(total);
  }
  uint64_t host_bytes() const { return host ? host->bytes() : 0; }
};

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_OMNIKV_H_
