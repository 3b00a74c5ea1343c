// Test helpers for the attention-based policies (H2O, TOVA, SnapKV, CAOTE): one hand-built layer
// in a real paged fp32 arena (blocks of 2 tokens, block table reversed so paging is exercised),
// driven through Policy::Observe -> Policy::Select directly, without a sequence.
//
// Threading: test-only, single-threaded.
#ifndef KVSIDECAR_TESTS_CACHE_POLICY_ATTENTION_POLICY_TEST_UTIL_H_
#define KVSIDECAR_TESTS_CACHE_POLICY_ATTENTION_POLICY_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cache/policy/policy.h"
#include "gpu/backend.h"

namespace kvs {
namespace testing_util {

using Rows = std::vector<std::vector<float>>;  // [slot][d]

// One layer: values[h][slot][d] (keys are zero; the policies here never read them) and the
// original positions[h][slot].
class TestLayer {
 public:
  TestLayer(std::vector<Rows> values, std::vector<std::vector<int32_t>> positions,
            int32_t block_tokens = 2)
      : heads_(static_cast<int32_t>(values.size())),
        count_(static_cast<int32_t>(values[0].size())),
        dim_(static_cast<int32_t>(values[0][0].size())),
        block_tokens_(block_tokens) {
    const int32_t blocks = (count_ + block_tokens_ - 1) / block_tokens_;
    block_bytes_ = uint64_t{2} * heads_ * block_tokens_ * dim_ * sizeof(float);
    arena_.assign(block_bytes_ * (blocks + 1), 0);
    for (int32_t b = 0; b < blocks; ++b) block_table_.push_back(blocks - b);  // reversed
    for (int32_t h = 0; h < heads_; ++h) {
      for (int32_t s = 0; s < count_; ++s) {
        std::memcpy(arena_.data() + Offset(1, h, s), values[h][s].data(), dim_ * sizeof(float));
        positions_.push_back(positions[h][s]);
      }
    }
  }

  PagedLayerView keys() const {
    PagedLayerView view;
    view.arena = arena_.data();
    view.kv_index = 0;
    view.block_table = block_table_.data();
    view.count = count_;
    view.num_kv_heads = heads_;
    view.head_dim = dim_;
    view.block_tokens = block_tokens_;
    view.dtype = DType::kFloat32;
    view.block_bytes = block_bytes_;
    return view;
  }

  // A step with probs [num_q_heads][num_queries][count]; step_queries 0 = num_queries.
  LayerStep Step(int32_t num_q_heads, const std::vector<float>& probs, int32_t num_queries,
                 int32_t step_queries = 0) {
    LayerStep step;
    step.keys = keys();
    step.positions = positions_;
    step.num_q_heads = num_q_heads;
    step.probs = probs;
    step.num_queries = num_queries;
    step.step_queries = step_queries > 0 ? step_queries : num_queries;
    step.state = &state;
    return step;
  }

  LayerSelection Selection(int32_t num_q_heads, int32_t keep, std::vector<int32_t>& kept,
                           float* scores_out = nullptr) {
    kept.assign(static_cast<size_t>(heads_) * keep, -1);
    LayerSelection selection;
    selection.keys = keys();
    selection.positions = positions_;
    selection.num_q_heads = num_q_heads;
    selection.keep = keep;
    selection.kept = absl::MakeSpan(kept);
    selection.state = &state;
    selection.writable_arena = arena_.data();
    selection.scores_out = scores_out;
    return selection;
  }

  // Kept positions of head h (ascending) for kept slots.
  std::vector<int32_t> KeptPositions(const std::vector<int32_t>& kept, int32_t keep,
                                     int32_t h) const {
    std::vector<int32_t> out;
    for (int32_t t = 0; t < keep; ++t) out.push_back(positions_[h * count_ + kept[h * keep + t]]);
    std::sort(out.begin(), out.end());
    return out;
  }

  const std::vector<int32_t>& positions() const { return positions_; }
  int32_t count() const { return count_; }
  int32_t heads() const { return heads_; }

  LayerPolicyState state;

 private:
  uint64_t Offset(int32_t kv, int32_t h, int32_t s) const {
    return block_table_[s / block_tokens_] * block_bytes_ +
           ((uint64_t{static_cast<uint32_t>(kv)} * heads_ + h) * block_tokens_ +
            s % block_tokens_) *
               dim_ * sizeof(float);
  }

  int32_t heads_;
  int32_t count_;
  int32_t dim_;
  int32_t block_tokens_;
  uint64_t block_bytes_ = 0;
  std::vector<uint8_t> arena_;
  std::vector<int32_t> block_table_;
  std::vector<int32_t> positions_;
};

// Positions 0..n-1 in slot order, for `heads` heads.
inline std::vector<std::vector<int32_t>> Identity(int32_t heads, int32_t n) {
  std::vector<int32_t> row(n);
  for (int32_t i = 0; i < n; ++i) row[i] = i;
  return std::vector<std::vector<int32_t>>(heads, row);
}

// Result of one Observe -> Select round: kept positions per head (ascending) and the dry-run
// scores [H][count] (slot order, +inf on protected slots).
struct Round {
  std::vector<std::vector<int32_t>> kept;
  std::vector<float> scores;
};

// Observes `probs` (skipped when empty) and selects `keep` tokens per head.
inline absl::StatusOr<Round> ObserveSelect(const Policy& policy, Backend& backend, Phase phase,
                                           TestLayer& layer, int32_t num_q_heads,
                                           const std::vector<float>& probs, int32_t num_queries,
                                           int32_t keep, int32_t step_queries = 0) {
  if (!probs.empty()) {
    const LayerStep step = layer.Step(num_q_heads, probs, num_queries, step_queries);
    absl::Status observed = policy.Observe(backend, phase, {step});
    if (!observed.ok()) return observed;
  }
  std::vector<int32_t> kept;
  Round round;
  round.scores.assign(static_cast<size_t>(layer.heads()) * layer.count(), 0.0f);
  const LayerSelection selection = layer.Selection(num_q_heads, keep, kept, round.scores.data());
  absl::Status selected = policy.Select(backend, phase, {selection});
  if (!selected.ok()) return selected;
  for (int32_t h = 0; h < layer.heads(); ++h) {
    round.kept.push_back(layer.KeptPositions(kept, keep, h));
  }
  return round;
}

}  // namespace testing_util
}  // namespace kvs

#endif  // KVSIDECAR_TESTS_CACHE_POLICY_ATTENTION_POLICY_TEST_UTIL_H_
