// D2O's nearest-key search and weighted row merge on the host (Backend::NearestKeys and
// Backend::MergeRows semantics, gpu/backend.h).
//
// Threading: both spread their jobs over `pool`; safe to call concurrently on disjoint rows.
#ifndef KVSIDECAR_GPU_CPU_MERGE_CPU_H_
#define KVSIDECAR_GPU_CPU_MERGE_CPU_H_

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "gpu/backend.h"
#include "gpu/cpu/thread_pool.h"

namespace kvs {

// Each validates every job first (INVALID_ARGUMENT naming the job index and the field; nothing
// written), then computes them all.
absl::Status RunNearestKeys(absl::Span<const NearestKeyJob> jobs, ThreadPool& pool);
absl::Status RunMergeRows(absl::Span<const RowMergeJob> jobs, ThreadPool& pool);

}  // namespace kvs

#endif  // KVSIDECAR_GPU_CPU_MERGE_CPU_H_
