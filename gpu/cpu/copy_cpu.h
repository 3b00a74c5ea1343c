// Validation of the row jobs (Backend::CopyRows, Backend::CopyHostRows, Backend::FindNonFinite;
// gpu/backend.h), shared by the CPU backend and the host-validating backends
// (gpu/staging_backend.h) so that their INVALID_ARGUMENT messages agree. The arena's size is not part of a job, so offsets are
// not range-checked here (the CPU backend trusts them, as it trusts every arena offset).
//
// Threading: pure functions.
#ifndef KVSIDECAR_GPU_CPU_COPY_CPU_H_
#define KVSIDECAR_GPU_CPU_COPY_CPU_H_

#include <cstddef>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "gpu/backend.h"
#include "gpu/cpu/keydiff_cpu.h"  // KeyDiffIsa, KeyRowNorm

namespace kvs {

// INVALID_ARGUMENT "row copy job <index>: ..." for a negative count, or null arena/offsets when
// the job copies anything (count > 0 and row_bytes > 0). Reads no offsets.
absl::Status ValidateRowCopyJob(const RowCopyJob& job, size_t index);

// INVALID_ARGUMENT "host row copy job <index>: ..." likewise (null arena, host or offsets).
absl::Status ValidateHostRowCopyJob(const HostRowCopyJob& job, size_t index);

// INVALID_ARGUMENT "finite check job <index>: ..." for a negative count or row_elements, a null
// output, or null arena/offsets when the job reads anything. Reads no offsets.
absl::Status ValidateFiniteCheckJob(const FiniteCheckJob& job, size_t index);

// The results of a run of jobs, in order, computed on the host (the CPU backend's kernel; row
// offsets trusted), reading ahead across the jobs' boundaries (a decode commit's jobs are a few
// rows each). A job's row_norms are KeyRowNorm's at `isa` (gpu/cpu/keydiff_cpu.h), the values
// KNorm's score pass at the same ISA computes.
void FindNonFiniteRows(absl::Span<const FiniteCheckJob> jobs, KeyDiffIsa isa);

}  // namespace kvs

#endif  // KVSIDECAR_GPU_CPU_COPY_CPU_H_
