#include "cache/policy/attention_stats.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvs {

absl::Status CheckLayerStep(absl::string_view policy, const LayerStep& layer) {
  const int64_t heads = layer.keys.num_kv_heads;
  const int64_t q_heads = layer.num_q_heads;
  const int64_t count = layer.keys.count;
  if (layer.state == nullptr || heads < 1 || count < 0 ||
      static_cast<int64_t>(layer.positions.size()) != heads * count) {
    return absl::InternalError(absl::StrCat("policy ", policy, ": malformed layer ", layer.layer,
                                            " (kv heads ", heads, ", count ", count, ", positions ",
                                            layer.positions.size(), ")"));
  }
  if (q_heads < heads || q_heads % heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("attention of layer ", layer.layer, ": policy ",
                                                   policy, " needs a multiple of ", heads,
                                                   " query heads, got ", q_heads));
  }
  if (layer.num_queries < 1) {
    return absl::InvalidArgumentError(absl::StrCat("attention.num_queries of layer ", layer.layer,
                                                   " must be >= 1 for policy ", policy, ", got ",
                                                   layer.num_queries));
  }
  const int64_t expected = q_heads * layer.num_queries * count;
  if (static_cast<int64_t>(layer.probs.size()) != expected) {
    return absl::InvalidArgumentError(absl::StrCat("attention of layer ", layer.layer, ": policy ",
                                                   policy, " expected ", q_heads, " x ",
                                                   layer.num_queries, " x ", count, " = ", expected,
                                                   " probabilities, got ", layer.probs.size()));
  }
  // Written so that NaN fails too.
  for (float p : layer.probs) {
    if (!(p >= 0.0f && p <= std::numeric_limits<float>::max())) {
      return absl::InvalidArgumentError(
          absl::StrCat("attention of layer ", layer.layer, ": policy ", policy,
                       " got a negative or non-finite probability ", p));
    }
  }
  return absl::OkStatus();
}

absl::Status AccumulateColumnSums(absl::string_view policy, const LayerStep& layer) {
  if (absl::Status status = CheckLayerStep(policy, layer); !status.ok()) return status;
  const int64_t size = int64_t{layer.num_q_heads} * layer.keys.count;
  std::vector<float>& accumulated = layer.state->accumulated;
  if (accumulated.empty()) {
    accumulated.assign(static_cast<size_t>(size), 0.0f);
  } else if (static_cast<int64_t>(accumulated.size()) != size) {
    return absl::InternalError(absl::StrCat("policy ", policy, ": accumulated attention of layer ",
                                            layer.layer, " holds ", accumulated.size(),
                                            " values, expected ", size));
  }
  SumQueryRows(layer.probs, layer.num_q_heads, layer.num_queries, layer.keys.count, 0,
               /*accumulate=*/true, absl::MakeSpan(accumulated));
  return absl::OkStatus();
}

void SumQueryRows(absl::Span<const float> probs, int32_t num_q_heads, int32_t num_queries,
                  int32_t count, int32_t rows, bool accumulate, absl::Span<float> out) {
  if (rows <= 0 || rows > num_queries) rows = num_queries;
  const int64_t n = count;
  for (int64_t q = 0; q < num_q_heads; ++q) {
    float* dst = out.data() + q * n;
    if (!accumulate) std::fill(dst, dst + n, 0.0f);
    for (int64_t i = num_queries - rows; i < num_queries; ++i) {
      const float* row = probs.data() + (q * num_queries + i) * n;
      for (int64_t s = 0; s < n; ++s) dst[s] += row[s];
    }
  }
}

void GqaMean(absl::Span<const float> in, int32_t num_q_heads, int32_t num_kv_heads, int32_t count,
             absl::Span<float> out) {
  const int64_t n = count;
  const int32_t group = num_q_heads / num_kv_heads;
  std::vector<double> sums;
  for (int64_t g = 0; g < num_kv_heads; ++g) {
    float* dst = out.data() + g * n;
    if (group == 1) {
      std::copy(in.data() + g * n, in.data() + (g + 1) * n, dst);
      continue;
    }
    // Accumulate in double per slot so the mean does not depend on the summation order; rows
    // stream contiguously into the per-slot sums (same per-slot order as a column loop).
    sums.assign(n, 0.0);
    for (int32_t j = 0; j < group; ++j) {
      const float* src = in.data() + (g * group + j) * n;
      for (int64_t s = 0; s < n; ++s) sums[s] += src[s];
    }
    for (int64_t s = 0; s < n; ++s) dst[s] = static_cast<float>(sums[s] / group);
  }
}

void PoolByPosition(absl::Span<const float> in, int32_t rows, int32_t num_kv_heads, int32_t count,
                    absl::Span<const int32_t> positions, absl::Span<const uint8_t> eligible,
                    int32_t kernel_size, Pooling pooling, absl::Span<float> out) {
  const int64_t n = count;
  const int32_t rows_per_head = std::max(1, rows / std::max(1, num_kv_heads));
  const int32_t half = kernel_size / 2;
  std::vector<int32_t> order;  // eligible slots of the head, by position
  std::vector<float> sequence;
  for (int32_t r = 0; r < rows; ++r) {
    const int32_t head = r / rows_per_head;
    const int32_t* pos = positions.data() + int64_t{head} * n;
    const float* src = in.data() + int64_t{r} * n;
    float* dst = out.data() + int64_t{r} * n;
    std::copy(src, src + n, dst);
    if (r % rows_per_head == 0 || order.empty()) {
      order.clear();
      for (int32_t s = 0; s < count; ++s) {
        if (eligible.empty() || eligible[int64_t{head} * n + s] != 0) order.push_back(s);
      }
      std::sort(order.begin(), order.end(),
                [pos](int32_t a, int32_t b) { return pos[a] < pos[b]; });
    }
    const int32_t m = static_cast<int32_t>(order.size());
    sequence.resize(m);
    for (int32_t j = 0; j < m; ++j) sequence[j] = src[order[j]];
    for (int32_t j = 0; j < m; ++j) {
      const int32_t lo = std::max(0, j - half);
      const int32_t hi = std::min(m - 1, j + half);
      if (pooling == Pooling::kMax) {
        float best = -std::numeric_limits<float>::infinity();
        for (int32_t t = lo; t <= hi; ++t) best = std::max(best, sequence[t]);
        dst[order[j]] = best;
      } else {
        double sum = 0.0;
        for (int32_t t = lo; t <= hi; ++t) sum += sequence[t];
        dst[order[j]] = static_cast<float>(sum / kernel_size);
      }
    }
  }
}

}  // namespace kvs
