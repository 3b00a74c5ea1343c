#include "gpu/cpu/window_stats_cpu.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gpu/base/checked_math.h"
#include "gpu/cpu/avx2_util.h"

namespace kvs {
namespace {

// Slots per block: the window's rows x kBlock floats stay in L2 for the second (variance) pass.
constexpr int32_t kBlock = 512;

// AVX2 without FMA on purpose: GCC contracts the vector mul + add into an FMA when FMA is
// enabled, and the scores must round exactly like the scalar definition (ties pick positions).
#define KVS_WINDOW_AVX2 __attribute__((target("avx2")))

// ---- WindowVarianceScores ------------------------------------------------------------------

// out[s] = mean + gamma * unbiased variance of rows[i][s] over the `rows` rows (stride apart),
// fp64 per slot in row order, for s in [0, len). `mean` and `squares` are kBlock scratch.
void MeanVarianceScalar(const float* head, int64_t stride, int32_t rows, int32_t len, double gamma,
                        double* mean, double* squares, float* out) {
  std::fill(mean, mean + len, 0.0);
  std::fill(squares, squares + len, 0.0);
  for (int32_t i = 0; i < rows; ++i) {
    const float* row = head + i * stride;
    for (int32_t s = 0; s < len; ++s) mean[s] += row[s];
  }
  for (int32_t s = 0; s < len; ++s) mean[s] /= rows;
  for (int32_t i = 0; i < rows; ++i) {
    const float* row = head + i * stride;
    for (int32_t s = 0; s < len; ++s) {
      const double d = row[s] - mean[s];
      squares[s] += d * d;
    }
  }
  for (int32_t s = 0; s < len; ++s) {
    const double var = rows > 1 ? squares[s] / (rows - 1) : 0.0;
    out[s] = static_cast<float>(mean[s] + gamma * var);
  }
}

KVS_WINDOW_AVX2 void MeanVarianceAvx2(const float* head, int64_t stride, int32_t rows, int32_t len,
                                      double gamma, double* mean, double* squares, float* out) {
  const int32_t vec = len & ~3;
  std::fill(mean, mean + len, 0.0);
  std::fill(squares, squares + len, 0.0);
  for (int32_t i = 0; i < rows; ++i) {
    const float* row = head + i * stride;
    for (int32_t s = 0; s < vec; s += 4) {
      _mm256_storeu_pd(mean + s, _mm256_add_pd(_mm256_loadu_pd(mean + s),
                                               _mm256_cvtps_pd(_mm_loadu_ps(row + s))));
    }
    for (int32_t s = vec; s < len; ++s) mean[s] += row[s];
  }
  const __m256d divisor = _mm256_set1_pd(rows);
  for (int32_t s = 0; s < vec; s += 4) {
    _mm256_storeu_pd(mean + s, _mm256_div_pd(_mm256_loadu_pd(mean + s), divisor));
  }
  for (int32_t s = vec; s < len; ++s) mean[s] /= rows;
  for (int32_t i = 0; i < rows; ++i) {
    const float* row = head + i * stride;
    for (int32_t s = 0; s < vec; s += 4) {
      const __m256d d =
          _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(row + s)), _mm256_loadu_pd(mean + s));
      _mm256_storeu_pd(squares + s,
                       _mm256_add_pd(_mm256_loadu_pd(squares + s), _mm256_mul_pd(d, d)));
    }
    for (int32_t s = vec; s < len; ++s) {
      const double d = row[s] - mean[s];
      squares[s] += d * d;
    }
  }
  for (int32_t s = 0; s < len; ++s) {
    const double var = rows > 1 ? squares[s] / (rows - 1) : 0.0;
    out[s] = static_cast<float>(mean[s] + gamma * var);
  }
}

// Query head q of `job`, block by block.
void VarianceHead(const WindowVarianceJob& job, int32_t q, bool avx2) {
  thread_local std::vector<double> mean(kBlock), squares(kBlock);
  const int64_t n = job.count;
  const int32_t w = job.window;
  const float* head = job.probs + (int64_t{q} * job.num_queries + (job.num_queries - w)) * n;
  for (int64_t s0 = 0; s0 < n; s0 += kBlock) {
    const int32_t len = static_cast<int32_t>(std::min<int64_t>(kBlock, n - s0));
    float* out = job.scores + int64_t{q} * n + s0;
    if (avx2) {
      MeanVarianceAvx2(head + s0, n, w, len, job.gamma, mean.data(), squares.data(), out);
    } else {
      MeanVarianceScalar(head + s0, n, w, len, job.gamma, mean.data(), squares.data(), out);
    }
  }
}

// ---- WindowEntropyShift --------------------------------------------------------------------

// Per-slot accumulators of one block: sum of p and sum of p ln(p + 1e-10) over the rows (the
// latter in float; NaN for an input the log cannot take), then the squared deviations from the
// mean. The sums and squares are fp64 in the same row order as the per-slot definition.
struct MeasureBlock {
  double sum[kBlock];
  double squares[kBlock];
  float plogp[kBlock];
};

void MeasureBlockScalar(const float* head, int64_t stride, int32_t rows, int32_t len,
                        MeasureBlock& block) {
  std::fill(block.sum, block.sum + len, 0.0);
  std::fill(block.squares, block.squares + len, 0.0);
  std::fill(block.plogp, block.plogp + len, 0.0f);
  for (int32_t i = 0; i < rows; ++i) {
    const float* row = head + i * stride;
    for (int32_t s = 0; s < len; ++s) {
      block.sum[s] += row[s];
      block.plogp[s] += row[s] * std::log(row[s] + 1e-10f);
    }
  }
  if (rows < 2) return;
  for (int32_t i = 0; i < rows; ++i) {
    const float* row = head + i * stride;
    for (int32_t s = 0; s < len; ++s) {
      const double d = row[s] - block.sum[s] / rows;
      block.squares[s] += d * d;
    }
  }
}

// ln(x) for x > 0 (Cephes' logf: frexp, a degree-8 polynomial on [sqrt(1/2) - 1, sqrt(2) - 1],
// ~1 ulp). Garbage for x <= 0 / inf / NaN: the caller masks those.
KVS_WINDOW_AVX2 inline __m256 LogPositive(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  __m256 e =
      _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(126)));
  // Mantissa in [0.5, 1).
  __m256 m = _mm256_castsi256_ps(_mm256_or_si256(
      _mm256_and_si256(bits, _mm256_set1_epi32(0x007FFFFF)), _mm256_set1_epi32(0x3F000000)));
  const __m256 small = _mm256_cmp_ps(m, _mm256_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
  e = _mm256_sub_ps(e, _mm256_and_ps(small, _mm256_set1_ps(1.0f)));
  m = _mm256_sub_ps(_mm256_add_ps(m, _mm256_and_ps(small, m)), _mm256_set1_ps(1.0f));
  const __m256 z = _mm256_mul_ps(m, m);
  __m256 y = _mm256_set1_ps(7.0376836292E-2f);
  y = _mm256_add_ps(_mm256_mul_ps(y, m), _mm256_set1_ps(-1.1514610310E-1f));
  y = _mm256_add_ps(_mm256_mul_ps(y, m), _mm256_set1_ps(1.1676998740E-1f));
  y = _mm256_add_ps(_mm256_mul_ps(y, m), _mm256_set1_ps(-1.2420140846E-1f));
  y = _mm256_add_ps(_mm256_mul_ps(y, m), _mm256_set1_ps(1.4249322787E-1f));
  y = _mm256_add_ps(_mm256_mul_ps(y, m), _mm256_set1_ps(-1.6668057665E-1f));
  y = _mm256_add_ps(_mm256_mul_ps(y, m), _mm256_set1_ps(2.0000714765E-1f));
  y = _mm256_add_ps(_mm256_mul_ps(y, m), _mm256_set1_ps(-2.4999993993E-1f));
  y = _mm256_add_ps(_mm256_mul_ps(y, m), _mm256_set1_ps(3.3333331174E-1f));
  y = _mm256_mul_ps(_mm256_mul_ps(y, m), z);
  y = _mm256_add_ps(y, _mm256_mul_ps(e, _mm256_set1_ps(-2.12194440e-4f)));
  y = _mm256_sub_ps(y, _mm256_mul_ps(z, _mm256_set1_ps(0.5f)));
  return _mm256_add_ps(_mm256_add_ps(m, y), _mm256_mul_ps(e, _mm256_set1_ps(0.693359375f)));
}

KVS_WINDOW_AVX2 void MeasureBlockAvx2(const float* head, int64_t stride, int32_t rows, int32_t len,
                                      MeasureBlock& block) {
  const int32_t vec = len & ~7;
  std::fill(block.sum, block.sum + len, 0.0);
  std::fill(block.squares, block.squares + len, 0.0);
  std::fill(block.plogp, block.plogp + len, 0.0f);
  const __m256 tiny = _mm256_set1_ps(1e-10f);
  const __m256 zero = _mm256_setzero_ps();
  const __m256 largest = _mm256_set1_ps(std::numeric_limits<float>::max());
  const __m256 nan = _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN());
  for (int32_t i = 0; i < rows; ++i) {
    const float* row = head + i * stride;
    for (int32_t s = 0; s < vec; s += 8) {
      const __m256 p = _mm256_loadu_ps(row + s);
      _mm256_storeu_pd(block.sum + s, _mm256_add_pd(_mm256_loadu_pd(block.sum + s),
                                                    _mm256_cvtps_pd(_mm256_castps256_ps128(p))));
      _mm256_storeu_pd(block.sum + s + 4,
                       _mm256_add_pd(_mm256_loadu_pd(block.sum + s + 4),
                                     _mm256_cvtps_pd(_mm256_extractf128_ps(p, 1))));
      const __m256 x = _mm256_add_ps(p, tiny);
      // ln takes (0, max]; anything else (negative, inf, NaN) poisons the slot as std::log would.
      const __m256 ok =
          _mm256_and_ps(_mm256_cmp_ps(x, zero, _CMP_GT_OQ), _mm256_cmp_ps(x, largest, _CMP_LE_OQ));
      const __m256 term = _mm256_blendv_ps(nan, _mm256_mul_ps(p, LogPositive(x)), ok);
      _mm256_storeu_ps(block.plogp + s, _mm256_add_ps(_mm256_loadu_ps(block.plogp + s), term));
    }
    for (int32_t s = vec; s < len; ++s) {
      block.sum[s] += row[s];
      block.plogp[s] += row[s] * std::log(row[s] + 1e-10f);
    }
  }
  if (rows < 2) return;
  const double count = rows;
  alignas(32) double mean[kBlock];
  for (int32_t s = 0; s < len; ++s) mean[s] = block.sum[s] / count;
  for (int32_t i = 0; i < rows; ++i) {
    const float* row = head + i * stride;
    for (int32_t s = 0; s < vec; s += 8) {
      const __m256 p = _mm256_loadu_ps(row + s);
      const __m256d d0 =
          _mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(p)), _mm256_load_pd(mean + s));
      const __m256d d1 =
          _mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(p, 1)), _mm256_load_pd(mean + s + 4));
      _mm256_storeu_pd(block.squares + s,
                       _mm256_add_pd(_mm256_loadu_pd(block.squares + s), _mm256_mul_pd(d0, d0)));
      _mm256_storeu_pd(block.squares + s + 4, _mm256_add_pd(_mm256_loadu_pd(block.squares + s + 4),
                                                            _mm256_mul_pd(d1, d1)));
    }
    for (int32_t s = vec; s < len; ++s) {
      const double d = row[s] - mean[s];
      block.squares[s] += d * d;
    }
  }
}

// One job: entropy terms summed per slot in float over the rows, then in fp64 in (head, slot)
// order; squares as defined.
void EntropyJob(const WindowEntropyJob& job, bool avx2) {
  const int32_t count = job.count;
  const int32_t w = job.window;
  const int32_t group = job.num_q_heads / job.num_kv_heads;
  auto block = std::make_unique<MeasureBlock>();
  double plogp = 0.0;
  double shift = 0.0;
  for (int32_t h = 0; h < job.num_q_heads; ++h) {
    const int32_t* positions = job.key_positions + static_cast<int64_t>(h / group) * count;
    const float* head =
        job.probs + (static_cast<int64_t>(h) * job.num_queries + (job.num_queries - w)) * count;
    for (int32_t s0 = 0; s0 < count; s0 += kBlock) {
      const int32_t len = std::min(kBlock, count - s0);
      if (avx2) {
        MeasureBlockAvx2(head + s0, count, w, len, *block);
      } else {
        MeasureBlockScalar(head + s0, count, w, len, *block);
      }
      for (int32_t s = 0; s < len; ++s) {
        // A window token, not prefix.
        if (positions[s0 + s] >= job.first_query_position) continue;
        plogp += block->plogp[s];
        // The unbiased variance needs two rows.
        if (w >= 2) shift += block->squares[s] / (w - 1);
      }
    }
  }
  *job.entropy = -plogp;
  *job.shift = shift;
}

// Shape checks shared by both jobs.
template <typename Invalid>
absl::Status ValidateWindowShape(const float* probs, int32_t num_q_heads, int32_t num_queries,
                                 int32_t window, int32_t count, const Invalid& invalid) {
  if (num_q_heads < 1) return invalid("num_q_heads must be >= 1, got ", num_q_heads);
  if (num_queries < 1) return invalid("num_queries must be >= 1, got ", num_queries);
  if (window < 1 || window > num_queries) {
    return invalid("window must be in [1, num_queries = ", num_queries, "], got ", window);
  }
  if (count < 0) return invalid("count must be >= 0, got ", count);
  if (!CheckedProduct({num_q_heads, num_queries, count})) {
    return invalid("num_q_heads x num_queries x count overflows");
  }
  if (count > 0 && probs == nullptr) return invalid("probs is null");
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateWindowVarianceJob(const WindowVarianceJob& job, size_t index) {
  auto invalid = [index](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("window variance job ", index, ": ", parts...));
  };
  if (absl::Status status = ValidateWindowShape(job.probs, job.num_q_heads, job.num_queries,
                                                job.window, job.count, invalid);
      !status.ok()) {
    return status;
  }
  if (!std::isfinite(job.gamma)) return invalid("gamma must be finite, got ", job.gamma);
  if (job.count > 0 && job.scores == nullptr) return invalid("scores is null");
  return absl::OkStatus();
}

absl::Status ValidateWindowEntropyJob(const WindowEntropyJob& job, size_t index) {
  auto invalid = [index](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("window entropy job ", index, ": ", parts...));
  };
  if (job.num_kv_heads < 1) return invalid("num_kv_heads must be >= 1, got ", job.num_kv_heads);
  if (job.num_q_heads < 1 || job.num_q_heads % job.num_kv_heads != 0) {
    return invalid("num_q_heads must be a positive multiple of num_kv_heads (", job.num_kv_heads,
                   "), got ", job.num_q_heads);
  }
  if (absl::Status status = ValidateWindowShape(job.probs, job.num_q_heads, job.num_queries,
                                                job.window, job.count, invalid);
      !status.ok()) {
    return status;
  }
  if (job.count > 0 && job.key_positions == nullptr) return invalid("key_positions is null");
  if (job.entropy == nullptr) return invalid("entropy is null");
  if (job.shift == nullptr) return invalid("shift is null");
  return absl::OkStatus();
}

absl::Status RunWindowVarianceScores(absl::Span<const WindowVarianceJob> jobs, ThreadPool* pool,
                                     bool allow_avx2) {
  std::vector<std::pair<const WindowVarianceJob*, int32_t>> tasks;
  int64_t values = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (auto status = ValidateWindowVarianceJob(jobs[i], i); !status.ok()) return status;
    if (jobs[i].count == 0) continue;
    values += int64_t{jobs[i].num_q_heads} * jobs[i].window * jobs[i].count;
    for (int32_t q = 0; q < jobs[i].num_q_heads; ++q) tasks.emplace_back(&jobs[i], q);
  }
  const bool avx2 = allow_avx2 && CpuSupportsAvx2();
  auto run = [&](int64_t t) { VarianceHead(*tasks[t].first, tasks[t].second, avx2); };
  // A small window (a short prompt) is not worth a worker's wake-up.
  constexpr int64_t kParallelMinValues = 1 << 18;
  if (pool == nullptr || values < kParallelMinValues) {
    for (int64_t t = 0; t < static_cast<int64_t>(tasks.size()); ++t) run(t);
  } else {
    pool->ParallelFor(static_cast<int64_t>(tasks.size()), run);
  }
  return absl::OkStatus();
}

absl::Status RunWindowEntropyShift(absl::Span<const WindowEntropyJob> jobs, ThreadPool* pool,
                                   bool allow_avx2) {
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (auto status = ValidateWindowEntropyJob(jobs[i], i); !status.ok()) return status;
  }
  const bool avx2 = allow_avx2 && CpuSupportsAvx2();
  // One task per job: the sum across slots is sequential (the documented order), so only whole
  // jobs (layers) run side by side.
  auto run = [&](int64_t i) { EntropyJob(jobs[i], avx2); };
  if (pool == nullptr || jobs.size() < 2) {
    for (int64_t i = 0; i < static_cast<int64_t>(jobs.size()); ++i) run(i);
  } else {
    pool->ParallelFor(static_cast<int64_t>(jobs.size()), run);
  }
  return absl::OkStatus();
}

absl::Status Backend::WindowVarianceScores(absl::Span<const WindowVarianceJob> jobs, Stream) {
  return RunWindowVarianceScores(jobs, nullptr);
}

absl::Status Backend::WindowEntropyShift(absl::Span<const WindowEntropyJob> jobs, Stream) {
  return RunWindowEntropyShift(jobs, nullptr);
}

}  // namespace kvs
