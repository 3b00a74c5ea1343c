#include "gpu/cpu/merge_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gpu/base/checked_math.h"
#include "gpu/base/dtype.h"
#include "gpu/cpu/attention_cpu.h"

namespace kvs {
namespace {

// Below these sizes a whole call runs on the calling thread (a decode step's few merges).
constexpr uint64_t kParallelMinNearestElements = 1 << 18;
constexpr uint64_t kParallelMinMergeElements = 1 << 16;
// Norms are floored here before dividing (d2o.md §4.1 step 6).
constexpr float kNormFloor = 1e-6f;

absl::Status ValidateNearestKeyJob(const NearestKeyJob& job, size_t index) {
  const std::string context = absl::StrCat("nearest key job ", index);
  auto invalid = [&context](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(context, ": ", parts...));
  };
  const PagedLayerView& v = job.keys;
  if (auto status = ValidatePagedLayerView(v, context, "keys"); !status.ok()) return status;
  if (job.head < 0 || job.head >= v.num_kv_heads) {
    return invalid("head must be in [0, ", v.num_kv_heads, "), got ", job.head);
  }
  if (job.num_queries < 0) return invalid("num_queries must be >= 0, got ", job.num_queries);
  if (job.num_queries == 0) return absl::OkStatus();
  if (job.num_candidates < 1) {
    return invalid("num_candidates must be >= 1, got ", job.num_candidates);
  }
  if (job.query_slots == nullptr) return invalid("query_slots is null");
  if (job.candidate_slots == nullptr) return invalid("candidate_slots is null");
  if (job.candidate_positions == nullptr) return invalid("candidate_positions is null");
  if (job.similarity == nullptr) return invalid("similarity is null");
  if (job.target == nullptr) return invalid("target is null");
  for (int32_t e = 0; e < job.num_queries; ++e) {
    if (job.query_slots[e] < 0 || job.query_slots[e] >= v.count) {
      return invalid("query_slots[", e, "] = ", job.query_slots[e], " is not in [0, ", v.count,
                     ")");
    }
  }
  for (int32_t c = 0; c < job.num_candidates; ++c) {
    if (job.candidate_slots[c] < 0 || job.candidate_slots[c] >= v.count) {
      return invalid("candidate_slots[", c, "] = ", job.candidate_slots[c], " is not in [0, ",
                     v.count, ")");
    }
  }
  return absl::OkStatus();
}

// Loads a key row as fp32 and returns its norm floored at kNormFloor.
float LoadKey(const PagedLayerView& v, int64_t head, int64_t slot, float* out) {
  const uint8_t* row = PagedRow(v, head, slot);
  float squared = 0.0f;
  for (int d = 0; d < v.head_dim; ++d) {
    out[d] = LoadAsFloat(row, v.dtype, d);
    squared += out[d] * out[d];
  }
  return std::max(std::sqrt(squared), kNormFloor);
}

// True when (a, pa) beats (b, pb): a higher similarity, or an equal one at a lower position. NaN
// loses to every number, so a NaN key never becomes a merge target over a real one.
bool Better(float a, int32_t pa, float b, int32_t pb) {
  if (std::isnan(a)) return false;
  if (std::isnan(b)) return true;
  return a > b || (a == b && pa < pb);
}

void NearestKeysOfJob(const NearestKeyJob& job) {
  if (job.num_queries == 0) return;
  const PagedLayerView& v = job.keys;
  const int dim = v.head_dim;
  // Candidates are normalised once (unit rows), then every query is a sweep of dot products.
  std::vector<float> candidates(static_cast<size_t>(job.num_candidates) * dim);
  for (int32_t c = 0; c < job.num_candidates; ++c) {
    float* row = candidates.data() + static_cast<size_t>(c) * dim;
    const float norm = LoadKey(v, job.head, job.candidate_slots[c], row);
    for (int d = 0; d < dim; ++d) row[d] /= norm;
  }
  std::vector<float> query(dim);
  for (int32_t e = 0; e < job.num_queries; ++e) {
    const float norm = LoadKey(v, job.head, job.query_slots[e], query.data());
    for (int d = 0; d < dim; ++d) query[d] /= norm;
    float best = 0.0f;
    int32_t best_index = -1;
    for (int32_t c = 0; c < job.num_candidates; ++c) {
      const float* row = candidates.data() + static_cast<size_t>(c) * dim;
      float dot = 0.0f;
      for (int d = 0; d < dim; ++d) dot += query[d] * row[d];
      if (best_index < 0 ||
          Better(dot, job.candidate_positions[c], best, job.candidate_positions[best_index])) {
        best = dot;
        best_index = c;
      }
    }
    job.similarity[e] = best;
    job.target[e] = best_index;
  }
}

absl::Status ValidateRowMergeJob(const RowMergeJob& job, size_t index) {
  auto invalid = [index](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("row merge job ", index, ": ", parts...));
  };
  if (job.dtype != DType::kFloat16 && job.dtype != DType::kBFloat16 &&
      job.dtype != DType::kFloat32) {
    return invalid("dtype ", static_cast<int>(job.dtype), " is not supported");
  }
  if (job.row_elements < 1) return invalid("row_elements must be >= 1, got ", job.row_elements);
  if (job.num_sources < 1) return invalid("num_sources must be >= 1, got ", job.num_sources);
  if (job.arena == nullptr) return invalid("arena is null");
  if (job.src_offsets == nullptr) return invalid("src_offsets is null");
  if (job.weights == nullptr) return invalid("weights is null");
  // The arena's size is not part of the job; the offsets can at least not wrap around.
  const uint64_t row_bytes = static_cast<uint64_t>(job.row_elements) * DTypeBytes(job.dtype);
  if (!CheckedAdd(job.dst_offset, row_bytes)) return invalid("dst_offset overflows");
  for (int32_t k = 0; k < job.num_sources; ++k) {
    if (!CheckedAdd(job.src_offsets[k], row_bytes)) {
      return invalid("src_offsets[", k, "] overflows");
    }
  }
  return absl::OkStatus();
}

// Every source is read into the fp32 sum before dst is written, so dst may be a source.
void MergeJob(const RowMergeJob& job, std::vector<float>& sum) {
  const int n = job.row_elements;
  sum.assign(n, 0.0f);
  for (int32_t k = 0; k < job.num_sources; ++k) {
    const uint8_t* src = job.arena + job.src_offsets[k];
    const float w = job.weights[k];
    for (int d = 0; d < n; ++d) sum[d] += w * LoadAsFloat(src, job.dtype, d);
  }
  uint8_t* dst = job.arena + job.dst_offset;
  for (int d = 0; d < n; ++d) StoreFromFloat(dst, job.dtype, d, sum[d]);
}

}  // namespace

absl::Status RunNearestKeys(absl::Span<const NearestKeyJob> jobs, ThreadPool& pool) {
  uint64_t elements = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (auto status = ValidateNearestKeyJob(jobs[i], i); !status.ok()) return status;
    elements += static_cast<uint64_t>(jobs[i].num_queries) *
                static_cast<uint64_t>(std::max(jobs[i].num_candidates, 0)) * jobs[i].keys.head_dim;
  }
  pool.ParallelFor(
      static_cast<int64_t>(jobs.size()), [&](int64_t i) { NearestKeysOfJob(jobs[i]); },
      elements < kParallelMinNearestElements ? 1 : 0);
  return absl::OkStatus();
}

absl::Status RunMergeRows(absl::Span<const RowMergeJob> jobs, ThreadPool& pool) {
  uint64_t elements = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (auto status = ValidateRowMergeJob(jobs[i], i); !status.ok()) return status;
    elements += static_cast<uint64_t>(jobs[i].num_sources) * jobs[i].row_elements;
  }
  // Jobs write distinct rows and read none another job writes (gpu/backend.h): any order works.
  pool.ParallelFor(
      static_cast<int64_t>(jobs.size()),
      [&](int64_t i) {
        thread_local std::vector<float> sum;
        MergeJob(jobs[i], sum);
      },
      elements < kParallelMinMergeElements ? 1 : 0);
  return absl::OkStatus();
}

}  // namespace kvs
