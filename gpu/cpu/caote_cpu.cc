#include "gpu/cpu/caote_cpu.h"

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

namespace kvs {
namespace {

// Below this many value elements (rows x count x head_dim) in a whole call, the work runs on the
// calling thread.
constexpr uint64_t kParallelMinElements = 1 << 18;

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

// All rows of one kv head: the value rows are converted once per sweep and shared by the head's
// rows (the GQA group's query-head rows, or one row per kv head).
void ScoreHead(const CaoteJob& job, int64_t head) {
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

}  // namespace

absl::Status RunCaoteScores(absl::Span<const CaoteJob> jobs, ThreadPool& pool) {
  std::vector<int64_t> first_task(jobs.size() + 1, 0);
  uint64_t elements = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (auto status = ValidateCaoteJob(jobs[i], i); !status.ok()) return status;
    const CaoteJob& job = jobs[i];
    const int64_t heads = job.values.count > 0 ? job.values.num_kv_heads : 0;
    first_task[i + 1] = first_task[i] + heads;
    elements += static_cast<uint64_t>(job.rows) * job.values.count * job.values.head_dim;
  }
  // One task per (job, kv head): it reads that head's values twice and nothing else.
  pool.ParallelFor(
      first_task.back(),
      [&](int64_t task) {
        const size_t job =
            std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1;
        ScoreHead(jobs[job], task - first_task[job]);
      },
      elements < kParallelMinElements ? 1 : 0);
  return absl::OkStatus();
}

}  // namespace kvs
