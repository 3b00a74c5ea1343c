// CAOTE output-error scores on the host (Backend::CaoteScores semantics, gpu/backend.h): per
// (job, kv head), one sweep over the head's values for X and one for the distances, in fp32 with
// AVX2/FMA/F16C when the CPU has it and head_dim % 8 == 0 (else portable scalar code).
//
// Threading: RunCaoteScores spreads (job, kv head) tasks over `pool` when the call reads enough
// values to pay for it (else it runs on the calling thread); safe to call concurrently.
#ifndef KVSIDECAR_GPU_CPU_CAOTE_CPU_H_
#define KVSIDECAR_GPU_CPU_CAOTE_CPU_H_

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "gpu/backend.h"
#include "gpu/cpu/thread_pool.h"

namespace kvs {

// INVALID_ARGUMENT "caote job <index>: <field> ..." when the job cannot be computed safely.
// Reads the block table. Shared with the host-validating backends (staging, CUDA).
absl::Status ValidateCaoteJob(const CaoteJob& job, size_t index);

// Validates every job (INVALID_ARGUMENT naming the job index and the field; nothing written),
// then computes them all.
absl::Status RunCaoteScores(absl::Span<const CaoteJob> jobs, ThreadPool& pool);

// Test hook: the same with the AVX2 kernels allowed or not (false = the portable scalar code).
absl::Status RunCaoteScoresWithIsa(absl::Span<const CaoteJob> jobs, ThreadPool& pool,
                                   bool allow_avx2);

}  // namespace kvs

#endif  // KVSIDECAR_GPU_CPU_CAOTE_CPU_H_
