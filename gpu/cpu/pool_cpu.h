// Backend::PoolScores on the host (gpu/backend.h PoolJob): SnapKV's and CAKE's pooling of score
// rows along each head's position order, for the CPU backend, Backend's default and the tests.
// The rows of one head share its order: they are gathered interleaved ([m][rows per head]) so
// that every window offset is one contiguous pass over all of them, compiled for baseline x86-64
// and for AVX2 (no FMA: nothing may be contracted), bit-identical either way.
//
// Threading: RunPoolScores spreads (job, kv head) tasks over `pool`; pure otherwise.
#ifndef KVSIDECAR_GPU_CPU_POOL_CPU_H_
#define KVSIDECAR_GPU_CPU_POOL_CPU_H_

#include <cstddef>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "gpu/backend.h"
#include "gpu/cpu/thread_pool.h"

namespace kvs {

// INVALID_ARGUMENT "pool job <index>: <field> ..." unless the job is well formed. Reads `lengths`
// and `order`. Shared by the backends that validate on the host.
absl::Status ValidatePoolJob(const PoolJob& job, size_t index);

// Validates every job (nothing written on error), then pools them. `allow_avx2` false forces the
// baseline code (the same bits).
absl::Status RunPoolScores(absl::Span<const PoolJob> jobs, ThreadPool* pool,
                           bool allow_avx2 = true);

}  // namespace kvs

#endif  // KVSIDECAR_GPU_CPU_POOL_CPU_H_
