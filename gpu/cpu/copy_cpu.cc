#include "gpu/cpu/copy_cpu.h"

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

}  // namespace

void FindNonFiniteRows(const FiniteCheckJob& job) {
  *job.first_non_finite = -1;
  if (job.row_elements <= 0) return;
  // Rows are scattered over the arena's blocks (one per head and token), so the hardware
  // prefetcher does not see them coming: ask for the rows a few ahead, which keeps several
  // cache misses in flight instead of one (the check is bound by the latency of those misses).
  constexpr int64_t kPrefetchRows = 4;
  const int64_t row_bytes = job.row_elements * static_cast<int64_t>(DTypeBytes(job.dtype));
  for (int64_t r = 0; r < job.count && r < kPrefetchRows; ++r) {
    PrefetchRow(job.arena + job.row_offsets[r], row_bytes);
  }
  for (int64_t r = 0; r < job.count; ++r) {
    if (r + kPrefetchRows < job.count) {
      PrefetchRow(job.arena + job.row_offsets[r + kPrefetchRows], row_bytes);
    }
    const int64_t at = FirstNonFinite(job.arena + job.row_offsets[r], job.row_elements, job.dtype);
    if (at >= 0) {
      *job.first_non_finite = r * job.row_elements + at;
      return;
    }
  }
}

}  // namespace kvs
