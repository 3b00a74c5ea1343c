#include "gpu/cpu/caote_cpu.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gpu/base/checked_math.h"
#include "gpu/base/dtype.h"
#include "gpu/cpu/attention_cpu.h"
#include "gpu/cpu/avx2_util.h"
#include "gpu/cpu/keydiff_cpu.h"

namespace kvs {
namespace {

// Below this many value bytes (each head's values are read twice) in a whole call, the work runs
// on the calling thread: a (job, head) task of a few hundred KiB takes tens of microseconds, so
// handing out fewer than a few of them costs more than it saves.
constexpr uint64_t kParallelMinValueBytes = 1 << 20;
// Value rows are handled in groups of kGroup slots (the 8 lanes of one vector of scores), within
// units of kUnitSlots slots of one head (a block's rows of that head when block_tokens is 16).
// The rows kAheadUnits units ahead (8 KiB of fp16 values at head_dim 128) are prefetched: blocks
// are scattered through the arena, which defeats the hardware stream prefetcher.
constexpr int kGroup = 8;
constexpr int kUnitSlots = 16;
constexpr int64_t kAheadUnits = 2;
// A task covers one or more kv heads of a job (see Sweep) but reads at most about this many value
// bytes (at least one head), so that the second sweep finds them in L2 (512 KiB per core here);
// in attention_bench a limit of 1 MiB or 8 MiB (more heads per task, longer contiguous runs per
// block) was no faster. Jobs are split further when there are too few tasks to keep the threads
// busy.
constexpr uint64_t kMaxTaskValueBytes = 512 << 10;

}  // namespace

absl::Status ValidateCaoteJob(const CaoteJob& job, size_t index) {
  const std::string context = absl::StrCat("caote job ", index);
  auto invalid = [&context](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(context, ": ", parts...));
  };
  const PagedLayerView& v = job.values;
  if (auto status = ValidatePagedLayerView(v, context, "values"); !status.ok()) return status;
  if (job.rows < 1 || job.rows % v.num_kv_heads != 0) {
    return invalid("rows must be a positive multiple of values.num_kv_heads (", v.num_kv_heads,
                   "), got ", job.rows);
  }
  if (!(job.eps >= 0.0f && job.eps < 1.0f)) {
    return invalid("eps must be in [0, 1), got ", job.eps);
  }
  const auto elements = CheckedProduct({job.rows, v.count});
  if (!elements || *elements > (uint64_t{1} << 60)) {
    return invalid("rows x values.count overflows");
  }
  if (v.count == 0) return absl::OkStatus();
  if (job.alpha == nullptr) return invalid("alpha is null");
  if (job.scores == nullptr) return invalid("scores is null");
  return absl::OkStatus();
}

namespace {

// Portable reference (any head_dim, any CPU; double accumulation). All rows of one kv head: the
// value rows are converted once per sweep and shared by the head's rows (the GQA group's
// query-head rows, or one row per kv head).
void ScoreHeadScalar(const CaoteJob& job, int64_t head) {
  const PagedLayerView& v = job.values;
  const int64_t count = v.count, dim = v.head_dim;
  const int64_t rows_per_head = job.rows / v.num_kv_heads;
  const int64_t first_row = head * rows_per_head;
  std::vector<float> value(dim);
  auto load = [&](int64_t s) {
    const uint8_t* row = PagedRow(v, head, s);
    for (int64_t d = 0; d < dim; ++d) value[d] = LoadAsFloat(row, v.dtype, d);
  };
  // X per row, accumulated in double (cheap next to the distances and exact enough that the
  // sum's rounding never shows in the scores); fast mode shares the plain mean.
  std::vector<double> x_sum(rows_per_head * dim, 0.0);
  for (int64_t s = 0; s < count; ++s) {
    load(s);
    for (int64_t r = 0; r < rows_per_head; ++r) {
      const double weight =
          job.fast ? 1.0 : static_cast<double>(job.alpha[(first_row + r) * count + s]);
      double* x = x_sum.data() + r * dim;
      for (int64_t d = 0; d < dim; ++d) x[d] += weight * value[d];
      if (job.fast) break;  // one mean for all rows
    }
  }
  std::vector<float> x(rows_per_head * dim);
  for (int64_t r = 0; r < rows_per_head; ++r) {
    const double* sum = x_sum.data() + (job.fast ? 0 : r * dim);
    for (int64_t d = 0; d < dim; ++d) {
      x[r * dim + d] = static_cast<float>(job.fast ? sum[d] / static_cast<double>(count) : sum[d]);
    }
  }
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t s = 0; s < count; ++s) {
    load(s);
    for (int64_t r = 0; r < rows_per_head; ++r) {
      const int64_t index = (first_row + r) * count + s;
      const float alpha = job.alpha[index];
      if (alpha == 0.0f) {
        job.scores[index] = 0.0f;
        continue;
      }
      if (1.0f - alpha <= job.eps) {
        job.scores[index] = inf;  // holds almost all the mass: never evicted (caote.md §3.7)
        continue;
      }
      const float* xr = x.data() + r * dim;
      float squared = 0.0f;
      for (int64_t d = 0; d < dim; ++d) {
        const float diff = xr[d] - value[d];
        squared += diff * diff;
      }
      job.scores[index] = alpha / (1.0f - alpha) * std::sqrt(squared);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// AVX2 + FMA + F16C (head_dim % 8 == 0), fp32 accumulation. Per (job, kv head), two sweeps over
// the head's values in groups of 8 slots: X (per row, or the shared mean) and then the distances.
// Each value row is converted once per sweep and shared by every row of the head (straight from
// the arena with one row per head; through an 8-row fp32 scratch otherwise). The second sweep
// finds the head's values (512 KiB at 2048 fp16 tokens x 128) mostly in L2/L3.

using avx2::Load8;

// x[0, dim) += sum_j weight[j] * row j, for kN rows of dtype kType.
template <DType kType, int kN>
KVS_AVX2 inline void Accumulate(const uint8_t* const* rows, const float* weight, int dim,
                                float* x) {
  constexpr int kBytes = DTypeBytes(kType);
  __m256 w[kN];
#pragma GCC unroll 8
  for (int j = 0; j < kN; ++j) w[j] = _mm256_set1_ps(weight[j]);
  for (int d = 0; d < dim; d += 8) {
    // Two interleaved chains: half the FMA latency on the critical path of each 8 dims.
    __m256 even = _mm256_loadu_ps(x + d);
    __m256 odd = _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int j = 0; j < kN; ++j) {
      const __m256 value = Load8<kType>(rows[j] + d * kBytes);
      if (j % 2 == 0) {
        even = _mm256_fmadd_ps(w[j], value, even);
      } else {
        odd = _mm256_fmadd_ps(w[j], value, odd);
      }
    }
    _mm256_storeu_ps(x + d, _mm256_add_ps(even, odd));
  }
}

// Squared distances ||x - row j||^2 of kN rows: lane j of the result (lanes >= kN are 0).
template <DType kType, int kN>
KVS_AVX2 inline __m256 SquaredDistances(const uint8_t* const* rows, const float* x, int dim) {
  constexpr int kBytes = DTypeBytes(kType);
  __m256 acc[kGroup];
#pragma GCC unroll 8
  for (int j = 0; j < kGroup; ++j) acc[j] = _mm256_setzero_ps();
  for (int d = 0; d < dim; d += 8) {
    const __m256 xv = _mm256_loadu_ps(x + d);
#pragma GCC unroll 8
    for (int j = 0; j < kN; ++j) {
      const __m256 diff = _mm256_sub_ps(xv, Load8<kType>(rows[j] + d * kBytes));
      acc[j] = _mm256_fmadd_ps(diff, diff, acc[j]);
    }
  }
  // Transpose-reduce: lane j = the horizontal sum of acc[j].
  const __m256 t0 = _mm256_hadd_ps(acc[0], acc[1]);
  const __m256 t1 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 t2 = _mm256_hadd_ps(acc[4], acc[5]);
  const __m256 t3 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1);
  const __m256 u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The scores of kN slots from their weights and squared distances (caote.md §3: alpha / (1 -
// alpha) * distance, +inf where 1 - alpha <= eps, exactly 0 where alpha == 0), the same float
// operations as the scalar code.
template <int kN>
KVS_AVX2 inline void StoreScores(const float* alpha, __m256 squared, float eps, float* out) {
  if constexpr (kN == kGroup) {
    const __m256 a = _mm256_loadu_ps(alpha);
    const __m256 rest = _mm256_sub_ps(_mm256_set1_ps(1.0f), a);
    __m256 c = _mm256_mul_ps(_mm256_div_ps(a, rest), _mm256_sqrt_ps(squared));
    c = _mm256_blendv_ps(c, _mm256_set1_ps(std::numeric_limits<float>::infinity()),
                         _mm256_cmp_ps(rest, _mm256_set1_ps(eps), _CMP_LE_OQ));
    c = _mm256_blendv_ps(c, _mm256_setzero_ps(), _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_EQ_OQ));
    _mm256_storeu_ps(out, c);
  } else {
    alignas(32) float sq[kGroup];
    _mm256_store_ps(sq, squared);
    for (int j = 0; j < kN; ++j) {
      const float a = alpha[j];
      if (a == 0.0f) {
        out[j] = 0.0f;
      } else if (1.0f - a <= eps) {
        out[j] = std::numeric_limits<float>::infinity();
      } else {
        out[j] = a / (1.0f - a) * std::sqrt(sq[j]);
      }
    }
  }
}

// Converts kN rows to fp32 rows of `dim` in `scratch`, pointed to by `converted`.
template <DType kType, int kN>
KVS_AVX2 inline void ConvertRows(const uint8_t* const* rows, int dim, float* scratch,
                                 const uint8_t** converted) {
  constexpr int kBytes = DTypeBytes(kType);
  for (int j = 0; j < kN; ++j) {
    float* out = scratch + j * dim;
    for (int d = 0; d < dim; d += 8) _mm256_storeu_ps(out + d, Load8<kType>(rows[j] + d * kBytes));
    converted[j] = reinterpret_cast<const uint8_t*>(out);
  }
}

// One group of kN slots starting at s0 of one head, at `rows`, sweep 1 (X) or 2 (scores). x: the
// head's X rows (one when fast).
template <DType kType, int kN, bool kSecond>
KVS_AVX2 inline void Group(const CaoteJob& job, int64_t head, int64_t s0,
                           const uint8_t* const* rows, int64_t rows_per_head, float* x,
                           float* scratch) {
  const int dim = job.values.head_dim;
  const int64_t count = job.values.count;
  const int64_t first_row = head * rows_per_head;
  const bool shared_x = job.fast;
  if (!kSecond && shared_x) {
    const float ones[kGroup] = {1, 1, 1, 1, 1, 1, 1, 1};
    Accumulate<kType, kN>(rows, ones, dim, x);
    return;
  }
  if (rows_per_head == 1) {
    const int64_t index = first_row * count + s0;
    if constexpr (kSecond) {
      StoreScores<kN>(job.alpha + index, SquaredDistances<kType, kN>(rows, x, dim), job.eps,
                      job.scores + index);
    } else {
      Accumulate<kType, kN>(rows, job.alpha + index, dim, x);
    }
    return;
  }
  // Several rows share each value row: convert it once (fp32 values are used in place).
  const uint8_t* converted[kGroup];
  constexpr DType kShared = DType::kFloat32;
  if constexpr (kType == DType::kFloat32) {
    for (int j = 0; j < kN; ++j) converted[j] = rows[j];
  } else {
    ConvertRows<kType, kN>(rows, dim, scratch, converted);
  }
  for (int64_t r = 0; r < rows_per_head; ++r) {
    const int64_t index = (first_row + r) * count + s0;
    if constexpr (kSecond) {
      const float* xr = x + (shared_x ? 0 : r * dim);
      StoreScores<kN>(job.alpha + index, SquaredDistances<kShared, kN>(converted, xr, dim), job.eps,
                      job.scores + index);
    } else {
      Accumulate<kShared, kN>(converted, job.alpha + index, dim, x + r * dim);
    }
  }
}

// One sweep over kv heads [head_begin, head_end) of a job in units of (16 slots, head), slots
// outer and heads inner: a block holds every head's rows of its slots ([2][H][B][D]), so this
// order reads each block's values as one contiguous run where a head-by-head order would read
// scattered 4 KiB pieces, which this machine streams at under half the speed. The unit
// kAheadUnits further on is prefetched. x: x_rows * dim floats per head.
template <DType kType, bool kSecond>
KVS_AVX2 void Sweep(const CaoteJob& job, int64_t head_begin, int64_t head_end,
                    int64_t rows_per_head, int64_t x_rows, float* x, float* scratch) {
  const PagedLayerView& v = job.values;
  const int64_t count = v.count;
  const int dim = v.head_dim;
  const int row_bytes = dim * DTypeBytes(kType);
  const int64_t heads = head_end - head_begin;
  const int64_t units = (count + kUnitSlots - 1) / kUnitSlots * heads;
  auto prefetch = [&](int64_t unit) {
    if (unit >= units) return;
    const int64_t s0 = unit / heads * kUnitSlots;
    const int n = static_cast<int>(std::min<int64_t>(kUnitSlots, count - s0));
    const uint8_t* rows[kUnitSlots];
    PagedRows(v, head_begin + unit % heads, s0, n, rows);
    for (int j = 0; j < n; ++j) {
      for (int offset = 0; offset < row_bytes; offset += 64) __builtin_prefetch(rows[j] + offset);
    }
  };
  for (int64_t u = 0; u < kAheadUnits; ++u) prefetch(u);
  for (int64_t u = 0; u < units; ++u) {
    prefetch(u + kAheadUnits);
    const int64_t s0 = u / heads * kUnitSlots;
    const int64_t head = head_begin + u % heads;
    const int n = static_cast<int>(std::min<int64_t>(kUnitSlots, count - s0));
    const uint8_t* rows[kUnitSlots];
    PagedRows(v, head, s0, n, rows);
    float* xh = x + (head - head_begin) * x_rows * dim;
    int j = 0;
    for (; j + kGroup <= n; j += kGroup) {
      Group<kType, kGroup, kSecond>(job, head, s0 + j, rows + j, rows_per_head, xh, scratch);
    }
    for (; j < n; ++j) {
      Group<kType, 1, kSecond>(job, head, s0 + j, rows + j, rows_per_head, xh, scratch);
    }
  }
}

template <DType kType>
KVS_AVX2 void ScoreHeadsAvx2(const CaoteJob& job, int64_t head_begin, int64_t head_end) {
  const int dim = job.values.head_dim;
  const int64_t rows_per_head = job.rows / job.values.num_kv_heads;
  const int64_t x_rows = job.fast ? 1 : rows_per_head;
  const int64_t heads = head_end - head_begin;
  thread_local std::vector<float> buffer;
  buffer.assign(static_cast<size_t>(heads * x_rows + kGroup) * dim, 0.0f);
  float* x = buffer.data();
  float* scratch = x + heads * x_rows * dim;
  Sweep<kType, false>(job, head_begin, head_end, rows_per_head, x_rows, x, scratch);
  if (job.fast) {  // the plain means
    const __m256 count = _mm256_set1_ps(static_cast<float>(job.values.count));
    for (int64_t d = 0; d < heads * dim; d += 8) {
      _mm256_storeu_ps(x + d, _mm256_div_ps(_mm256_loadu_ps(x + d), count));
    }
  }
  Sweep<kType, true>(job, head_begin, head_end, rows_per_head, x_rows, x, scratch);
}

void ScoreHeads(const CaoteJob& job, int64_t head_begin, int64_t head_end, bool avx2) {
  if (avx2 && job.values.head_dim % 8 == 0) {
    switch (job.values.dtype) {
      case DType::kFloat16:
        return ScoreHeadsAvx2<DType::kFloat16>(job, head_begin, head_end);
      case DType::kBFloat16:
        return ScoreHeadsAvx2<DType::kBFloat16>(job, head_begin, head_end);
      case DType::kFloat32:
        return ScoreHeadsAvx2<DType::kFloat32>(job, head_begin, head_end);
    }
  }
  for (int64_t head = head_begin; head < head_end; ++head) ScoreHeadScalar(job, head);
}

}  // namespace

absl::Status RunCaoteScoresWithIsa(absl::Span<const CaoteJob> jobs, ThreadPool& pool,
                                   bool allow_avx2) {
  uint64_t value_bytes = 0;
  int64_t active_jobs = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (auto status = ValidateCaoteJob(jobs[i], i); !status.ok()) return status;
    const PagedLayerView& v = jobs[i].values;
    if (v.count == 0) continue;
    value_bytes +=
        static_cast<uint64_t>(v.num_kv_heads) * v.count * v.head_dim * DTypeBytes(v.dtype);
    ++active_jobs;
  }
  if (active_jobs == 0) return absl::OkStatus();
  const bool parallel = value_bytes >= kParallelMinValueBytes && pool.num_threads() > 1;
  // Tasks: (job, range of kv heads); heads_per_task[i] for job i.
  const int64_t want_tasks = parallel ? 4 * pool.num_threads() : 1;
  const int64_t splits = std::max<int64_t>(1, (want_tasks + active_jobs - 1) / active_jobs);
  std::vector<int64_t> first_task(jobs.size() + 1, 0);
  std::vector<int64_t> heads_per_task(jobs.size(), 1);
  for (size_t i = 0; i < jobs.size(); ++i) {
    const PagedLayerView& v = jobs[i].values;
    int64_t tasks = 0;
    if (v.count > 0) {
      const uint64_t head_bytes = static_cast<uint64_t>(v.count) * v.head_dim * DTypeBytes(v.dtype);
      int64_t per_task = (v.num_kv_heads + splits - 1) / splits;
      per_task = std::min<int64_t>(
          per_task, std::max<uint64_t>(1, kMaxTaskValueBytes / std::max<uint64_t>(1, head_bytes)));
      heads_per_task[i] = per_task;
      tasks = (v.num_kv_heads + per_task - 1) / per_task;
    }
    first_task[i + 1] = first_task[i] + tasks;
  }
  const bool avx2 = allow_avx2 && CpuSupportsAvx2();
  pool.ParallelFor(
      first_task.back(),
      [&](int64_t task) {
        const size_t i =
            std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1;
        const int64_t head_begin = (task - first_task[i]) * heads_per_task[i];
        const int64_t head_end =
            std::min<int64_t>(jobs[i].values.num_kv_heads, head_begin + heads_per_task[i]);
        ScoreHeads(jobs[i], head_begin, head_end, avx2);
      },
      parallel ? 0 : 1);
  return absl::OkStatus();
}

absl::Status RunCaoteScores(absl::Span<const CaoteJob> jobs, ThreadPool& pool) {
  return RunCaoteScoresWithIsa(jobs, pool, /*allow_avx2=*/true);
}

}  // namespace kvs
