// D2O's nearest-key search and weighted row merge on the host (Backend::NearestKeys and
// Backend::MergeRows semantics, gpu/backend.h).
//
// NearestKeys has two AVX2 paths with the same job semantics: jobs with many queries (prefill:
// thousands of evicted tokens) normalise their candidates once into packed fp32 panels and run a
// register-blocked kernel over them (its dot products on AVX-512 where the CPU has it, bit-equal
// to AVX2's); jobs with at most kNearestStreamingMaxQueries (decode: one
// evicted token per (layer, head)) stream every query over the candidate rows straight from the
// arena. Targets agree exactly (ties -> lowest position); similarities agree to fp32 rounding.
//
// Threading: both spread their jobs over `pool` when a call is big enough to pay for it (small
// calls run on the caller); safe to call concurrently on disjoint rows.
#ifndef KVSIDECAR_GPU_CPU_MERGE_CPU_H_
#define KVSIDECAR_GPU_CPU_MERGE_CPU_H_

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "gpu/backend.h"
#include "gpu/cpu/cpu_isa.h"
#include "gpu/cpu/thread_pool.h"

namespace kvs {

// INVALID_ARGUMENT "<nearest key|row merge> job <index>: <field> ..." when the job cannot be
// computed safely. ValidateNearestKeyJob reads the block table, query_slots and candidate_slots;
// ValidateRowMergeJob reads dst_offsets, source_starts and src_offsets. Shared with the
// host-validating backends (staging, CUDA).
absl::Status ValidateNearestKeyJob(const NearestKeyJob& job, size_t index);
absl::Status ValidateRowMergeJob(const RowMergeJob& job, size_t index);

// Each validates every job first (INVALID_ARGUMENT naming the job index and the field; nothing
// written), then computes them all.
absl::Status RunNearestKeys(absl::Span<const NearestKeyJob> jobs, ThreadPool& pool);
// Jobs with at most this many queries take the streaming path. Measured with
// bench/merge_bench.cc (2047 fp16 candidates, D=128, one thread, CPU time per job, noisy shared
// machine): streaming ~50 us for 1 query, ~95 / 280 / 810 / 1230 us for 2 / 8 / 16 / 32; packed
// ~600 us for 2 queries (packing dominates), ~720 / 980 us for 16 / 32. They cross near 12.
inline constexpr int32_t kNearestStreamingMaxQueries = 12;

// Which NearestKeys path to take: kAuto picks per job by num_queries; the others force one path
// for every job (tests comparing the paths, benchmarks). CPUs without AVX2/FMA/F16C (or a
// max_isa of kScalar) always take the portable scalar path. The packed path's dot products run
// on AVX-512 where the CPU has it and max_isa allows, bit-equal to its AVX2 ones.
enum class NearestKeysPath { kAuto, kStreaming, kPacked };
absl::Status RunNearestKeys(absl::Span<const NearestKeyJob> jobs, ThreadPool& pool,
                            NearestKeysPath path, CpuIsa max_isa = CpuIsa::kAvx512);
absl::Status RunMergeRows(absl::Span<const RowMergeJob> jobs, ThreadPool& pool);

}  // namespace kvs

#endif  // KVSIDECAR_GPU_CPU_MERGE_CPU_H_
