// CAOTE output-error scores on the host (Backend::CaoteScores semantics, gpu/backend.h).
//
// Threading: RunCaoteScores spreads (job, row) tasks over `pool`; safe to call concurrently.
#ifndef KVSIDECAR_GPU_CPU_CAOTE_CPU_H_
#define KVSIDECAR_GPU_CPU_CAOTE_CPU_H_

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "gpu/backend.h"
#include "gpu/cpu/thread_pool.h"

namespace kvs {

// Validates every job (INVALID_ARGUMENT naming the job index and the field; nothing written),
// then computes them all.
absl::Status RunCaoteScores(absl::Span<const CaoteJob> jobs, ThreadPool& pool);

}  // namespace kvs

#endif  // KVSIDECAR_GPU_CPU_CAOTE_CPU_H_
