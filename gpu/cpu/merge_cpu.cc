#include "gpu/cpu/merge_cpu.h"

namespace kvs {

absl::Status RunNearestKeys(absl::Span<const NearestKeyJob>, ThreadPool&) {
  return absl::UnimplementedError("NearestKeys: not yet implemented");
}
absl::Status RunMergeRows(absl::Span<const RowMergeJob>, ThreadPool&) {
  return absl::UnimplementedError("MergeRows: not yet implemented");
}

}  // namespace kvs
