// Attention probabilities on the host (Backend::AttentionProbs semantics, gpu/backend.h), exposed
// for the CPU backend and its tests. The hot loop is the q·k dot products of a GQA group's window
// queries against each key row (a small GEMM per block), in fp32 with AVX2/FMA when the CPU has it.
//
// Threading: RunAttentionProbs spreads the jobs' (job, query head group) tasks over `pool`; it
// may be called concurrently from several threads.
#ifndef KVSIDECAR_GPU_CPU_ATTENTION_CPU_H_
#define KVSIDECAR_GPU_CPU_ATTENTION_CPU_H_

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "gpu/backend.h"
#include "gpu/cpu/thread_pool.h"

namespace kvs {

// Validates every job (INVALID_ARGUMENT naming the job index and the field; nothing written),
// then computes them all.
absl::Status RunAttentionProbs(absl::Span<const AttentionJob> jobs, ThreadPool& pool);

}  // namespace kvs

#endif  // KVSIDECAR_GPU_CPU_ATTENTION_CPU_H_
