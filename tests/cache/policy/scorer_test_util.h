// Helpers of the D2O and CAKE scorer tests: one layer of one sequence over a real paged fp32
// arena (std::vector<uint8_t>, block table deliberately not the identity, slot order not position
// order), drivers for Select/Merge with hand-built LayerSelection, and a CPU backend that counts
// the merge kernels' calls.
// Header-only; test code, not thread-safe.
#ifndef KVSIDECAR_TESTS_CACHE_POLICY_SCORER_TEST_UTIL_H_
#define KVSIDECAR_TESTS_CACHE_POLICY_SCORER_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "cache/policy/policy.h"
#include "gpu/backend.h"
#include "gpu/base/dtype.h"

namespace kvs::scorer_test {

// One layer: H kv heads of `count` slots, head_dim D, fp32, blocks of B tokens stored in reverse
// block order; positions [H][count].
class TestLayer {
 public:
  TestLayer(int32_t heads, int32_t dim, int32_t block_tokens, int32_t count)
      : heads_(heads), dim_(dim), block_tokens_(block_tokens), count_(count) {
    const int32_t blocks = (count + block_tokens - 1) / block_tokens + 1;
    block_bytes_ = uint64_t{2} * heads * block_tokens * dim * sizeof(float);
    arena_.assign(blocks * block_bytes_, 0);
    for (int32_t b = 0; b < blocks; ++b) table_.push_back(blocks - 1 - b);
    positions_.resize(static_cast<size_t>(heads) * count);
    for (int32_t h = 0; h < heads; ++h) {
      std::iota(positions_.begin() + int64_t{h} * count,
                positions_.begin() + int64_t{h + 1} * count, 0);
    }
  }

  int32_t heads() const { return heads_; }
  int32_t count() const { return count_; }
  int32_t dim() const { return dim_; }

  float* Row(int32_t kv, int32_t head, int32_t slot) {
    const uint64_t offset =
        uint64_t(table_[slot / block_tokens_]) * block_bytes_ +
        ((uint64_t(kv) * heads_ + head) * block_tokens_ + slot % block_tokens_) * dim_ *
            sizeof(float);
    return reinterpret_cast<float*>(arena_.data() + offset);
  }
  void Set(int32_t kv, int32_t head, int32_t slot, const std::vector<float>& row) {
    std::memcpy(Row(kv, head, slot), row.data(), dim_ * sizeof(float));
  }
  std::vector<float> Get(int32_t kv, int32_t head, int32_t slot) {
    const float* row = Row(kv, head, slot);
    return std::vector<float>(row, row + dim_);
  }

  // Slot s of head h holds position order[s].
  void SetPositions(int32_t head, const std::vector<int32_t>& order) {
    std::copy(order.begin(), order.end(), positions_.begin() + int64_t{head} * count_);
  }
  int32_t Position(int32_t head, int32_t slot) const {
    return positions_[int64_t{head} * count_ + slot];
  }
  int32_t SlotOf(int32_t head, int32_t position) const {
    for (int32_t s = 0; s < count_; ++s) {
      if (Position(head, s) == position) return s;
    }
    return -1;
  }
  const std::vector<int32_t>& positions() const { return positions_; }

  PagedLayerView View() {
    PagedLayerView view;
    view.arena = arena_.data();
    view.kv_index = 0;
    view.block_table = table_.data();
    view.count = count_;
    view.num_kv_heads = heads_;
    view.head_dim = dim_;
    view.block_tokens = block_tokens_;
    view.dtype = DType::kFloat32;
    view.block_bytes = block_bytes_;
    return view;
  }

  // A step with probabilities [num_q_heads][num_queries][count] (kept alive by the caller).
  LayerStep Step(int32_t layer, int32_t num_q_heads, absl::Span<const float> probs,
                 absl::Span<const int32_t> query_positions) {
    LayerStep step;
    step.layer = layer;
    step.keys = View();
    step.positions = positions_;
    step.num_q_heads = num_q_heads;
    step.probs = probs;
    step.num_queries = static_cast<int32_t>(query_positions.size());
    step.query_positions = query_positions;
    step.step_queries = step.num_queries;
    step.state = &state;
    return step;
  }

  // A selection keeping `keep` per head into `kept` (sized here).
  LayerSelection Selection(int32_t layer, int32_t num_q_heads, int32_t keep,
                           std::vector<int32_t>& kept) {
    kept.assign(static_cast<size_t>(heads_) * keep, -1);
    LayerSelection selection;
    selection.layer = layer;
    selection.keys = View();
    selection.positions = positions_;
    selection.num_q_heads = num_q_heads;
    selection.keep = keep;
    selection.kept = absl::MakeSpan(kept);
    selection.state = &state;
    selection.writable_arena = arena_.data();
    return selection;
  }

  // Kept positions of head h, ascending, from [H][keep] kept slots.
  std::vector<int32_t> KeptPositions(const std::vector<int32_t>& kept, int32_t head) const {
    const size_t keep = kept.size() / heads_;
    std::vector<int32_t> out;
    for (size_t t = 0; t < keep; ++t) out.push_back(Position(head, kept[head * keep + t]));
    std::sort(out.begin(), out.end());
    return out;
  }

  LayerPolicyState state;

 private:
  int32_t heads_, dim_, block_tokens_, count_;
  uint64_t block_bytes_ = 0;
  std::vector<int32_t> table_;
  std::vector<uint8_t> arena_;
  std::vector<int32_t> positions_;
};

// The CPU backend, counting the NearestKeys / MergeRows calls and jobs a policy issues.
class TestBackend final : public Backend {
 public:
  TestBackend() : cpu_(MakeCpuBackend(1)) {}
  std::string_view name() const override { return cpu_->name(); }
  bool healthy() const override { return cpu_->healthy(); }
  absl::StatusOr<std::unique_ptr<Arena>> CreateArena(uint64_t bytes,
                                                     const ArenaOptions& options) override {
    return cpu_->CreateArena(bytes, options);
  }
  absl::Status KeyDiffScores(absl::Span<const KeyDiffScoreJob> jobs, Stream stream) override {
    return cpu_->KeyDiffScores(jobs, stream);
  }
  absl::Status TopK(absl::Span<const TopKJob> jobs, Stream stream) override {
    return cpu_->TopK(jobs, stream);
  }
  absl::Status CopyRows(absl::Span<const RowCopyJob> jobs, Stream stream) override {
    return cpu_->CopyRows(jobs, stream);
  }
  absl::Status FindNonFinite(absl::Span<const FiniteCheckJob> jobs, Stream stream) override {
    return cpu_->FindNonFinite(jobs, stream);
  }
  absl::Status AttentionProbs(absl::Span<const AttentionJob> jobs, Stream stream) override {
    return cpu_->AttentionProbs(jobs, stream);
  }
  absl::Status AttentionLogits(absl::Span<const AttentionJob> jobs, Stream stream) override {
    return cpu_->AttentionLogits(jobs, stream);
  }
  absl::Status CopyHostRows(absl::Span<const HostRowCopyJob> jobs, Stream stream) override {
    return cpu_->CopyHostRows(jobs, stream);
  }
  absl::Status CaoteScores(absl::Span<const CaoteJob> jobs, Stream stream) override {
    return cpu_->CaoteScores(jobs, stream);
  }
  absl::Status NearestKeys(absl::Span<const NearestKeyJob> jobs, Stream stream) override {
    ++nearest_calls;
    return cpu_->NearestKeys(jobs, stream);
  }
  absl::Status MergeRows(absl::Span<const RowMergeJob> jobs, Stream stream) override {
    ++merge_calls;
    merge_jobs += static_cast<int>(jobs.size());
    for (const RowMergeJob& job : jobs) merge_rows += job.rows;
    return cpu_->MergeRows(jobs, stream);
  }
  absl::Status Synchronize(Stream stream) override { return cpu_->Synchronize(stream); }

  int nearest_calls = 0;
  int merge_calls = 0;
  int merge_jobs = 0;
  int64_t merge_rows = 0;

 private:
  std::unique_ptr<Backend> cpu_;
};

// Causal softmax reference: probs [Hq][nq][count] of queries [Hq][nq][D] against the layer's
// keys (kv head q / (Hq / H)), scale `scale`, key position > query position masked.
inline std::vector<float> SoftmaxProbs(TestLayer& layer, int32_t num_q_heads,
                                       const std::vector<std::vector<std::vector<float>>>& queries,
                                       const std::vector<int32_t>& query_positions, float scale) {
  const int32_t nq = static_cast<int32_t>(query_positions.size());
  const int32_t n = layer.count();
  const int32_t group = num_q_heads / layer.heads();
  std::vector<float> probs(static_cast<size_t>(num_q_heads) * nq * n, 0.0f);
  for (int32_t q = 0; q < num_q_heads; ++q) {
    const int32_t g = q / group;
    for (int32_t i = 0; i < nq; ++i) {
      std::vector<double> logits(n, -INFINITY);
      double max = -INFINITY;
      for (int32_t s = 0; s < n; ++s) {
        if (layer.Position(g, s) > query_positions[i]) continue;
        const std::vector<float> k = layer.Get(0, g, s);
        double dot = 0;
        for (int32_t d = 0; d < layer.dim(); ++d) dot += double(queries[q][i][d]) * k[d];
        logits[s] = scale * dot;
        max = std::max(max, logits[s]);
      }
      double total = 0;
      for (int32_t s = 0; s < n; ++s)
        total += std::isinf(logits[s]) ? 0.0 : std::exp(logits[s] - max);
      for (int32_t s = 0; s < n; ++s) {
        probs[(int64_t{q} * nq + i) * n + s] =
            std::isinf(logits[s]) ? 0.0f : static_cast<float>(std::exp(logits[s] - max) / total);
      }
    }
  }
  return probs;
}

}  // namespace kvs::scorer_test

#endif  // KVSIDECAR_TESTS_CACHE_POLICY_SCORER_TEST_UTIL_H_
