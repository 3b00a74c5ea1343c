// Backend::WindowVarianceScores and Backend::WindowEntropyShift on the host (gpu/backend.h
// WindowVarianceJob, WindowEntropyJob): CAKE's per-slot mean + gamma * variance of a window of
// attention probabilities, and its layer preference terms (entropy and shift). For the CPU
// backend, Backend's defaults and the tests.
//
// Both stream the window's rows of a head row by row (contiguous) over blocks of slots with
// per-slot accumulators, so that the rows of one block stay in L2 for the second (variance)
// pass. The AVX2 paths (AVX2 without FMA: nothing may be contracted) give the same bits as the
// scalar ones for the variance scores; the entropy's AVX2 path evaluates ln with its own
// polynomial (~1 ulp) and so differs from std::log in the last bits.
//
// Threading: the Run functions spread (job, query head) tasks (variance) or jobs (entropy, whose
// sum across slots is sequential) over `pool`; pure otherwise.
#ifndef KVSIDECAR_GPU_CPU_WINDOW_STATS_CPU_H_
#define KVSIDECAR_GPU_CPU_WINDOW_STATS_CPU_H_

#include <cstddef>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "gpu/backend.h"
#include "gpu/cpu/thread_pool.h"

namespace kvs {

// INVALID_ARGUMENT "window variance job <index>: <field> ..." / "window entropy job <index>:
// <field> ..." unless the job is well formed. Read no array. Shared by the backends that validate
// on the host.
absl::Status ValidateWindowVarianceJob(const WindowVarianceJob& job, size_t index);
absl::Status ValidateWindowEntropyJob(const WindowEntropyJob& job, size_t index);

// Validate every job (nothing written on error), then compute them. `allow_avx2` false forces
// the scalar code.
absl::Status RunWindowVarianceScores(absl::Span<const WindowVarianceJob> jobs, ThreadPool* pool,
                                     bool allow_avx2 = true);
absl::Status RunWindowEntropyShift(absl::Span<const WindowEntropyJob> jobs, ThreadPool* pool,
                                   bool allow_avx2 = true);

}  // namespace kvs

#endif  // KVSIDECAR_GPU_CPU_WINDOW_STATS_CPU_H_
