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

void FindNonFiniteRows(const FiniteCheckJob& job) {
  *job.first_non_finite = -1;
  if (job.row_elements <= 0) return;
  for (int64_t r = 0; r < job.count; ++r) {
    const int64_t at = FirstNonFinite(job.arena + job.row_offsets[r], job.row_elements, job.dtype);
    if (at >= 0) {
      *job.first_non_finite = r * job.row_elements + at;
      return;
    }
  }
}

}  // namespace kvs
