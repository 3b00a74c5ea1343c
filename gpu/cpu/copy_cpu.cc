#include "gpu/cpu/copy_cpu.h"

#include "absl/strings/str_cat.h"

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

}  // namespace kvs
