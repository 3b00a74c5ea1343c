#include "cache/policy/attention_stats.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gpu/base/status_macros.h"

namespace kvs {
namespace {

// 1 for a probability no softmax gives: negative, infinite or NaN (the comparisons are written so
// that NaN fails them). Branch-free, so the scan below vectorises.
inline int BadProbability(float p) {
  return !(p >= 0.0f) | !(p <= std::numeric_limits<float>::max());
}

}  // namespace

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
  const int64_t rows = layer.summed_rows > 0 ? 1 : layer.num_queries;
  const int64_t expected = q_heads * rows * count;
  if (static_cast<int64_t>(layer.probs.size()) != expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention of layer ", layer.layer, ": policy ", policy, " expected ", q_heads, " x ", rows,
        " x ", count, " = ", expected, " probabilities, got ", layer.probs.size()));
  }
  // Keys in the arena are whatever the worker wrote, so computed probabilities are checked as
  // well. The branch-free block loop vectorises, which keeps the scan far below the cost of the
  // step; the rare bad block is then searched for the value to report.
  constexpr size_t kBlock = 4096;
  const float* probs = layer.probs.data();
  for (size_t begin = 0; begin < layer.probs.size(); begin += kBlock) {
    const size_t end = std::min(layer.probs.size(), begin + kBlock);
    int bad = 0;
    size_t i = begin;
    // Fixed 16-wide chunks: -O2's cheap vectoriser takes only loops with a known trip count.
    for (; i + 16 <= end; i += 16) {
      for (int j = 0; j < 16; ++j) bad |= BadProbability(probs[i + j]);
    }
    for (; i < end; ++i) bad |= BadProbability(probs[i]);
    if (bad == 0) continue;
    for (size_t i = begin; i < end; ++i) {
      if (BadProbability(probs[i]) != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("attention of layer ", layer.layer, ": policy ", policy,
                         " got a negative or non-finite probability ", probs[i]));
      }
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
  // A summed step carries one row per query head: the sum of its num_queries rows.
  const int32_t rows = layer.summed_rows > 0 ? 1 : layer.num_queries;
  SumQueryRows(layer.probs, layer.num_q_heads, rows, layer.keys.count, 0,
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

// The `rank`-th (1-based) set bit of `words`, counted from the lowest bit when `from_low`, else
// from the highest; the caller guarantees at least `rank` bits are set.
namespace {
int64_t NthSetBit(const std::vector<uint64_t>& words, int64_t rank, bool from_low) {
  const int64_t size = static_cast<int64_t>(words.size());
  for (int64_t i = 0; i < size; ++i) {
    const int64_t w = from_low ? i : size - 1 - i;
    uint64_t word = words[w];
    const int64_t bits = __builtin_popcountll(word);
    if (bits < rank) {
      rank -= bits;
      continue;
    }
    while (true) {
      const int bit = from_low ? __builtin_ctzll(word) : 63 - __builtin_clzll(word);
      if (--rank == 0) return w * 64 + bit;
      word &= ~(uint64_t{1} << bit);
    }
  }
  return -1;  // unreachable for a valid rank
}
}  // namespace

bool HoldsConsecutivePositions(const int32_t* positions, int32_t n) {
  if (n == 0) return true;
  // Unsigned differences from the expected value, OR-ed: zero iff every slot matches. Fixed
  // 16-wide chunks let the compiler vectorise the scan at -O2 (its cheap cost model takes only
  // loops with a known trip count); an 8K-slot row per head per layer adds up on a compress.
  const uint32_t first = static_cast<uint32_t>(positions[0]);
  uint32_t diff = 0;
  int32_t s = 0;
  for (; s + 16 <= n; s += 16) {
    uint32_t chunk = 0;
    for (int32_t j = 0; j < 16; ++j) {
      chunk |= static_cast<uint32_t>(positions[s + j]) - (first + static_cast<uint32_t>(s + j));
    }
    diff |= chunk;
    if (diff != 0) return false;
  }
  for (; s < n; ++s) diff |= static_cast<uint32_t>(positions[s]) - (first + static_cast<uint32_t>(s));
  // Unsigned steps wrap from INT32_MAX to INT32_MIN; consecutive ints never do.
  return diff == 0 && positions[n - 1] >= positions[0];
}

void MarkSinksAndRecent(const int32_t* positions, int32_t n, int32_t sinks, int32_t recent,
                        std::vector<int32_t>& scratch, std::vector<uint64_t>& bitmap,
                        uint8_t* forced) {
  if (int64_t{sinks} + recent >= n) {
    std::fill(forced, forced + n, uint8_t{1});
    return;
  }
  if (sinks == 0 && recent == 1) {
    // A decode step's window (SnapKV): the newest position alone, one pass.
    const int32_t newest =
        static_cast<int32_t>(std::max_element(positions, positions + n) - positions);
    std::fill(forced, forced + n, uint8_t{0});
    forced[newest] = 1;
    return;
  }
  // Positions are distinct, so "at or below the sinks-th smallest" is exactly `sinks` slots.
  int64_t sink_limit = -1;
  int64_t recent_limit = 0;
  const auto [low, high] = std::minmax_element(positions, positions + n);
  const int64_t span = int64_t{*high} - *low + 1;
  if (span == n) {
    // Distinct positions filling [low, high] (nothing evicted yet, or only from the ends, as
    // StreamingLLM leaves it): the limits are known without ranking anything.
    sink_limit = int64_t{*low} + sinks - 1;
    recent_limit = int64_t{*high} - recent + 1;
  } else if (span <= 64 * int64_t{n}) {
    bitmap.assign(static_cast<size_t>((span + 63) / 64), 0);
    for (int32_t s = 0; s < n; ++s) {
      const int64_t offset = int64_t{positions[s]} - *low;
      bitmap[offset / 64] |= uint64_t{1} << (offset % 64);
    }
    if (sinks > 0) sink_limit = *low + NthSetBit(bitmap, sinks, /*from_low=*/true);
    if (recent > 0) recent_limit = *low + NthSetBit(bitmap, recent, /*from_low=*/false);
  } else {
    scratch.assign(positions, positions + n);
    if (sinks > 0) {
      std::nth_element(scratch.begin(), scratch.begin() + (sinks - 1), scratch.end());
      sink_limit = scratch[sinks - 1];
    }
    if (recent > 0) {
      // After the first partition everything from index `sinks` on is above the sinks.
      std::nth_element(scratch.begin() + sinks, scratch.begin() + (n - recent), scratch.end());
      recent_limit = scratch[n - recent];
    }
  }
  for (int32_t s = 0; s < n; ++s) {
    const bool sink = sinks > 0 && positions[s] <= sink_limit;
    const bool fresh = recent > 0 && positions[s] >= recent_limit;
    forced[s] = (sink || fresh) ? 1 : 0;
  }
}

void SlotsByPosition(const int32_t* positions, int32_t count, const uint8_t* eligible,
                     std::vector<int32_t>& scratch, std::vector<int32_t>& order) {
  order.clear();
  if (count == 0) return;
  const auto [low, high] = std::minmax_element(positions, positions + count);
  const int64_t span = int64_t{*high} - *low + 1;
  if (span > 32 * int64_t{count}) {
    for (int32_t s = 0; s < count; ++s) {
      if (eligible == nullptr || eligible[s] != 0) order.push_back(s);
    }
    std::sort(order.begin(), order.end(),
              [positions](int32_t a, int32_t b) { return positions[a] < positions[b]; });
    return;
  }
  // Positions are distinct and usually span a few times the slot count (what compression left
  // of the prompt): one pass places every slot at its position's offset, one pass reads them
  // back in order. Linear, where a sort of every head at every decode step was not.
  scratch.assign(static_cast<size_t>(span), -1);
  for (int32_t s = 0; s < count; ++s) {
    if (eligible == nullptr || eligible[s] != 0) scratch[positions[s] - *low] = s;
  }
  for (int32_t slot : scratch) {
    if (slot >= 0) order.push_back(slot);
  }
}

absl::Status PoolByPosition(Backend& backend, absl::Span<const float> in, int32_t rows,
                            int32_t num_kv_heads, int32_t count,
                            absl::Span<const int32_t> positions, absl::Span<const uint8_t> eligible,
                            int32_t kernel_size, Pooling pooling, absl::Span<float> out) {
  PoolBatch batch;
  batch.Add(in, rows, num_kv_heads, count, positions, eligible, kernel_size, pooling, out);
  return batch.Run(backend);
}

void PoolBatch::Add(absl::Span<const float> in, int32_t rows, int32_t num_kv_heads, int32_t count,
                    absl::Span<const int32_t> positions, absl::Span<const uint8_t> eligible,
                    int32_t kernel_size, Pooling pooling, absl::Span<float> out) {
  const int64_t n = count;
  // The position order of each head's eligible slots: bookkeeping on positions, kept here; the
  // pooling of the values is the backend's (PoolJob).
  std::vector<int32_t>& orders =
      orders_.emplace_back(static_cast<size_t>(std::max(num_kv_heads, 0) * n));
  std::vector<int32_t>& lengths =
      lengths_.emplace_back(static_cast<size_t>(std::max(num_kv_heads, 0)), 0);
  for (int32_t h = 0; h < num_kv_heads; ++h) {
    SlotsByPosition(positions.data() + int64_t{h} * n, count,
                    eligible.empty() ? nullptr : eligible.data() + int64_t{h} * n, by_offset_,
                    order_);
    std::copy(order_.begin(), order_.end(), orders.begin() + int64_t{h} * n);
    lengths[h] = static_cast<int32_t>(order_.size());
  }
  PoolJob& job = jobs_.emplace_back();
  job.in = in.data();
  job.order = orders.data();
  job.lengths = lengths.data();
  job.rows = rows;
  job.num_kv_heads = num_kv_heads;
  job.count = count;
  job.kernel_size = kernel_size;
  job.kind = pooling == Pooling::kMax ? PoolKind::kMax : PoolKind::kAvg;
  job.out = out.data();
}

absl::Status PoolBatch::Run(Backend& backend) {
  if (jobs_.empty()) return absl::OkStatus();
  KVS_RETURN_IF_ERROR(backend.PoolScores(jobs_, nullptr));
  return backend.Synchronize(nullptr);
}

}  // namespace kvs
