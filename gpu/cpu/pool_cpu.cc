#include "gpu/cpu/pool_cpu.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gpu/base/checked_math.h"
#include "gpu/cpu/avx2_util.h"

namespace kvs {
namespace {

// The whole-window passes over `interior` interleaved values: one pass per window offset, each
// element added (or compared) in the same order whatever the vector width, so both builds
// below give the same bits.
__attribute__((always_inline)) inline void WindowPasses(const float* first, int64_t interior,
                                                        int32_t group, int32_t half, PoolKind kind,
                                                        float* pooled_max, double* pooled_sum) {
  if (kind == PoolKind::kMax) {
    for (int64_t i = 0; i < interior; ++i) pooled_max[i] = first[i];
    for (int32_t t = 1; t <= 2 * half; ++t) {
      const float* shifted = first + int64_t{t} * group;
      for (int64_t i = 0; i < interior; ++i) {
        pooled_max[i] = pooled_max[i] < shifted[i] ? shifted[i] : pooled_max[i];  // std::max
      }
    }
  } else {
    for (int64_t i = 0; i < interior; ++i) pooled_sum[i] = first[i];
    for (int32_t t = 1; t <= 2 * half; ++t) {
      const float* shifted = first + int64_t{t} * group;
      for (int64_t i = 0; i < interior; ++i) pooled_sum[i] += shifted[i];
    }
  }
}

__attribute__((target("avx2"))) void WindowPassesAvx2(const float* first, int64_t interior,
                                                      int32_t group, int32_t half, PoolKind kind,
                                                      float* pooled_max, double* pooled_sum) {
  WindowPasses(first, interior, group, half, kind, pooled_max, pooled_sum);
}

void WindowPassesBaseline(const float* first, int64_t interior, int32_t group, int32_t half,
                          PoolKind kind, float* pooled_max, double* pooled_sum) {
  WindowPasses(first, interior, group, half, kind, pooled_max, pooled_sum);
}

// The rows of kv head `head` of `job`.
void PoolHead(const PoolJob& job, int32_t head, bool avx2) {
  const int64_t n = job.count;
  const int32_t group = job.rows / job.num_kv_heads;
  const int32_t first_row = head * group;
  const int32_t half = job.kernel_size / 2;
  const int32_t* order = job.order + int64_t{head} * n;
  const int32_t m = job.lengths[head];
  const float* src = job.in + int64_t{first_row} * n;
  float* dst = job.out + int64_t{first_row} * n;
  thread_local std::vector<uint8_t> pooled_slot;
  thread_local std::vector<float> sequence;
  thread_local std::vector<float> pooled_max;
  thread_local std::vector<double> pooled_sum;
  // Slots outside the order keep their input (a decode step's window: a few slots), copied one
  // by one rather than copying whole rows first.
  if (m < n) {
    pooled_slot.assign(static_cast<size_t>(n), 0);
    for (int32_t j = 0; j < m; ++j) pooled_slot[order[j]] = 1;
    for (int64_t s = 0; s < n; ++s) {
      if (pooled_slot[s] != 0) continue;
      for (int32_t g = 0; g < group; ++g) dst[g * n + s] = src[g * n + s];
    }
  }
  sequence.resize(static_cast<size_t>(m) * group);
  for (int32_t j = 0; j < m; ++j) {
    for (int32_t g = 0; g < group; ++g) sequence[int64_t{j} * group + g] = src[g * n + order[j]];
  }
  // Windows cut by either end of the sequence, one by one.
  auto edge = [&](int32_t j) {
    const int32_t lo = std::max(0, j - half);
    const int32_t hi = std::min(m - 1, j + half);
    for (int32_t g = 0; g < group; ++g) {
      float best = -std::numeric_limits<float>::infinity();
      double sum = 0.0;
      for (int32_t t = lo; t <= hi; ++t) {
        const float v = sequence[int64_t{t} * group + g];
        best = std::max(best, v);
        sum += v;
      }
      dst[g * n + order[j]] =
          job.kind == PoolKind::kMax ? best : static_cast<float>(sum / job.kernel_size);
    }
  };
  const int32_t interior_begin = std::min(half, m);
  const int32_t interior_end = std::max(interior_begin, m - half);
  for (int32_t j = 0; j < interior_begin; ++j) edge(j);
  for (int32_t j = interior_end; j < m; ++j) edge(j);
  // Whole windows: one pass per window offset, adding (or comparing) in the same order as a
  // window-by-window loop, so the result is the same to the bit.
  const int64_t interior = int64_t{interior_end - interior_begin} * group;
  if (interior == 0) return;
  const float* first = sequence.data() + int64_t{interior_begin - half} * group;
  if (job.kind == PoolKind::kMax) {
    pooled_max.resize(static_cast<size_t>(interior));
  } else {
    pooled_sum.resize(static_cast<size_t>(interior));
  }
  (avx2 ? WindowPassesAvx2 : WindowPassesBaseline)(first, interior, group, half, job.kind,
                                                   pooled_max.data(), pooled_sum.data());
  for (int32_t j = interior_begin; j < interior_end; ++j) {
    const int64_t at = int64_t{j - interior_begin} * group;
    for (int32_t g = 0; g < group; ++g) {
      dst[g * n + order[j]] = job.kind == PoolKind::kMax
                                  ? pooled_max[at + g]
                                  : static_cast<float>(pooled_sum[at + g] / job.kernel_size);
    }
  }
}

}  // namespace

absl::Status ValidatePoolJob(const PoolJob& job, size_t index) {
  auto invalid = [index](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("pool job ", index, ": ", parts...));
  };
  if (job.num_kv_heads < 1) return invalid("num_kv_heads must be >= 1, got ", job.num_kv_heads);
  if (job.rows < 1 || job.rows % job.num_kv_heads != 0) {
    return invalid("rows must be a positive multiple of num_kv_heads (", job.num_kv_heads,
                   "), got ", job.rows);
  }
  if (job.count < 0) return invalid("count must be >= 0, got ", job.count);
  if (job.kernel_size < 1 || job.kernel_size % 2 == 0) {
    return invalid("kernel_size must be odd and >= 1, got ", job.kernel_size);
  }
  if (job.kind != PoolKind::kAvg && job.kind != PoolKind::kMax) {
    return invalid("kind ", static_cast<int>(job.kind), " is not a pooling");
  }
  if (!CheckedProduct({job.rows, job.count}) || !CheckedProduct({job.num_kv_heads, job.count})) {
    return invalid("rows x count overflows");
  }
  if (job.count == 0) return absl::OkStatus();  // nothing is read or written
  if (job.in == nullptr) return invalid("in is null");
  if (job.out == nullptr) return invalid("out is null");
  if (job.order == nullptr) return invalid("order is null");
  if (job.lengths == nullptr) return invalid("lengths is null");
  for (int32_t h = 0; h < job.num_kv_heads; ++h) {
    const int32_t m = job.lengths[h];
    if (m < 0 || m > job.count) {
      return invalid("lengths[", h, "] must be in [0, ", job.count, "], got ", m);
    }
    const int32_t* order = job.order + int64_t{h} * job.count;
    for (int32_t j = 0; j < m; ++j) {
      if (order[j] < 0 || order[j] >= job.count) {
        return invalid("order[", h, "][", j, "] = ", order[j], " is not a slot below ", job.count);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status RunPoolScores(absl::Span<const PoolJob> jobs, ThreadPool* pool, bool allow_avx2) {
  std::vector<std::pair<const PoolJob*, int32_t>> tasks;
  int64_t values = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (auto status = ValidatePoolJob(jobs[i], i); !status.ok()) return status;
    if (jobs[i].count == 0) continue;
    values += int64_t{jobs[i].rows} * jobs[i].count;
    for (int32_t h = 0; h < jobs[i].num_kv_heads; ++h) tasks.emplace_back(&jobs[i], h);
  }
  const bool avx2 = allow_avx2 && CpuSupportsAvx2();
  auto run = [&](int64_t t) { PoolHead(*tasks[t].first, tasks[t].second, avx2); };
  // A decode step's pooling (a few thousand values per layer) is not worth a worker's wake-up.
  constexpr int64_t kParallelMinValues = 1 << 18;
  if (pool == nullptr || values < kParallelMinValues) {
    for (int64_t t = 0; t < static_cast<int64_t>(tasks.size()); ++t) run(t);
  } else {
    pool->ParallelFor(static_cast<int64_t>(tasks.size()), run);
  }
  return absl::OkStatus();
}

absl::Status Backend::PoolScores(absl::Span<const PoolJob> jobs, Stream) {
  return RunPoolScores(jobs, nullptr);
}

}  // namespace kvs
