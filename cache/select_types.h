// The value types of KvPool::Select, OmniKV's per-step selection (policies/omnikv.md): one item
// per sequence of a decode step, and per filter layer the tokens selected and staged.
#ifndef KVSIDECAR_CACHE_SELECT_TYPES_H_
#define KVSIDECAR_CACHE_SELECT_TYPES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "cache/sequence_types.h"

namespace kvs {

// OmniKV Select (policies/omnikv.md §4, §10): one item per sequence of a decode step.
struct SelectItem {
  std::string session_id;
  std::string sequence_id;
  // Idempotency key: a filter layer already selected at this step returns the same selection.
  int64_t step_id = 0;
  // The listed filter layers' queries (attention.layers: filter layers of the sequence's
  // policy, non-empty; queries only). The newest query is the current token's; uniform/exp keep
  // a window of the last W queries per filter layer across calls.
  AttentionInput attention;
  // N: tokens at positions below it are the prompt (the candidates); fixed by the sequence's
  // first Select. 0 = the sequence's next position at that call.
  int64_t prompt_tokens = 0;
};

struct FilterSelection {
  int32_t filter_layer = 0;
  std::vector<int32_t> positions;      // T_f, ascending
  std::vector<int32_t> sparse_layers;  // the layers that attend to T_f (ascending)
};

struct SelectResult {
  std::vector<FilterSelection> filters;  // in the order attention.layers lists them
  // One staging view per sparse layer of the listed filters, in layer order: slots
  // [0, positions.size()) hold T_f's tokens in position order, then the layer's generated tokens
  // (positions >= N) in position order. positions left empty (they are filters[].positions
  // followed by the generated positions).
  std::vector<LayerLayoutView> sparse_layers;
  int64_t prompt_tokens = 0;  // N
  int32_t budget_tokens = 0;  // k
  uint64_t host_bytes = 0;    // the sequence's offloaded prompt K/V in the host tier
};

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_SELECT_TYPES_H_
