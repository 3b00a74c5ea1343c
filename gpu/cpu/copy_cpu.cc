#include "gpu/cpu/copy_cpu.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "gpu/base/finite.h"

namespace kvs {

absl::Status ValidateRowCopyJob(const RowCopyJob& job, size_t index) {
  if (job.count < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("row copy job ", index, ": count must be >= 0, got ", job.count));
  }
  if (job.count > 0 && job.row_bytes > 0 &&
      (job.arena == nullptr || job.src_offsets == nullptr || job.dst_offsets == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("row copy job ", index, ": null arena or offsets"));
  }
  return absl::OkStatus();
}

absl::Status ValidateHostRowCopyJob(const HostRowCopyJob& job, size_t index) {
  if (job.count < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("host row copy job ", index, ": count must be >= 0, got ", job.count));
  }
  if (job.count > 0 && job.row_bytes > 0 &&
      (job.arena == nullptr || job.host == nullptr || job.arena_offsets == nullptr ||
       job.host_offsets == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("host row copy job ", index, ": null arena, host or offsets"));
  }
  return absl::OkStatus();
}

absl::Status ValidateFiniteCheckJob(const FiniteCheckJob& job, size_t index) {
  if (job.count < 0 || job.row_elements < 0) {
    return absl::InvalidArgumentError(absl::StrCat("finite check job ", index,
                                                   ": count and row_elements must be >= 0, got ",
                                                   job.count, " and ", job.row_elements));
  }
  if (job.first_non_finite == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("finite check job ", index, ": null first_non_finite"));
  }
  if (job.count > 0 && job.row_elements > 0 &&
      (job.arena == nullptr || job.row_offsets == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("finite check job ", index, ": null arena or row_offsets"));
  }
  return absl::OkStatus();
}

namespace {

// Asks for the cache lines of one row ahead of its use.
inline void PrefetchRow(const uint8_t* row, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(row + at, /*rw=*/0, /*locality=*/3);
}

// A position in the rows of a run of jobs: job j, row r.
struct RowCursor {
  size_t job = 0;
  int64_t row = 0;
};

// Moves `at` to the next row of `jobs` that has one (past the end: at.job == jobs.size()).
inline void NextRow(absl::Span<const FiniteCheckJob> jobs, RowCursor& at) {
  ++at.row;
  while (at.job < jobs.size() && at.row >= jobs[at.job].count) {
    ++at.job;
    at.row = 0;
  }
}

inline int64_t RowBytes(const FiniteCheckJob& job) {
  return job.row_elements * static_cast<int64_t>(DTypeBytes(job.dtype));
}

}  // namespace

void FindNonFiniteRows(absl::Span<const FiniteCheckJob> jobs, KeyDiffIsa isa) {
  // Rows are scattered over the arena's blocks (one per head and token, each in its own page), so
  // neither the hardware prefetcher nor the TLB sees them coming: ask for the rows a few ahead,
  // which keeps several cache misses and page walks in flight instead of one (the check is
  // bound by their latency). The cursor runs ahead across jobs: a decode commit's jobs are a
  // few rows each, and a prefetch that stopped at every job's end would leave most rows
  // unprefetched.
  constexpr int kPrefetchRows = 8;
  RowCursor ahead{0, -1};
  NextRow(jobs, ahead);
  for (int i = 0; i < kPrefetchRows && ahead.job < jobs.size(); ++i, NextRow(jobs, ahead)) {
    const FiniteCheckJob& job = jobs[ahead.job];
    PrefetchRow(job.arena + job.row_offsets[ahead.row], RowBytes(job));
  }
  for (size_t j = 0; j < jobs.size(); ++j) {
    const FiniteCheckJob& job = jobs[j];
    *job.first_non_finite = -1;
    const KeyRowNormFn row_norm =
        job.row_norms != nullptr ? KeyRowNormFor(job.dtype, job.row_elements, isa) : nullptr;
    for (int64_t r = 0; r < job.count; ++r) {
      if (ahead.job < jobs.size()) {
        const FiniteCheckJob& next = jobs[ahead.job];
        PrefetchRow(next.arena + next.row_offsets[ahead.row], RowBytes(next));
        NextRow(jobs, ahead);
      }
      if (job.row_elements <= 0) break;
      const uint8_t* row = job.arena + job.row_offsets[r];
      if (row_norm != nullptr) {
        const float norm = row_norm(row, job.row_elements);
        job.row_norms[r] = norm;
        // In fp16 the norm is the check: a NaN or inf makes the sum of squares NaN or inf, and no
        // finite row can overflow it (65504^2 per value), so only a row whose norm is not finite
        // is scanned for the value that made it so.
        if (job.dtype == DType::kFloat16 && std::isfinite(norm)) continue;
      }
      const int64_t at = FirstNonFinite(row, job.row_elements, job.dtype);
      if (at >= 0) {
        *job.first_non_finite = r * job.row_elements + at;
        break;
      }
    }
  }
}

}  // namespace kvs
