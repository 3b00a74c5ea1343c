// KeyDiff scoring on the host (shared/design/policies/keydiff.md §3.1, §3.5, §10.8): the CPU
// backend's kernels, exposed so tests can compare the SIMD path with the scalar reference.
//
// Threading: pure functions of their arguments; different heads/jobs may be scored concurrently.
#ifndef KVSIDECAR_GPU_CPU_KEYDIFF_CPU_H_
#define KVSIDECAR_GPU_CPU_KEYDIFF_CPU_H_

#include <cstdint>

#include "absl/status/status.h"
#include "gpu/backend.h"
#include "gpu/cpu/avx2_util.h"  // CpuSupportsAvx2: whether kAvx2 runs here

namespace kvs {

enum class KeyDiffIsa {
  kScalar,  // portable reference, every anchor/metric/dtype
  kAvx2,    // AVX2+FMA+F16C: cosine with the mean_normalized or mean_raw anchor, head_dim % 8 == 0
};

// INVALID_ARGUMENT when the job's pointers, shape or block table cannot be scored safely.
// `index` names the job in the message.
absl::Status ValidateKeyDiffJob(const KeyDiffScoreJob& job, size_t index);

// Anchor/metric semantics shared with every backend: kCosine uses job.anchor; kPairwise
// (-sum_j cos(k_i, k_j), computed in O(n d) as -u_i . sum_j u_j with u = k / max(|k|, 1e-8)) has
// no anchor; kDot and kEuclidean always use the raw mean (§10.8), whatever job.anchor says. The
// median anchor of an even count is the mean of the two middle values.
//
// Writes job.scores[head * count + s] for s in [0, count). The job must have passed
// ValidateKeyDiffJob. kAvx2 silently uses the scalar code for the cases it does not cover and
// when the CPU lacks the instructions.
void KeyDiffScoreHead(const KeyDiffScoreJob& job, int head, KeyDiffIsa isa);

// The L2 norm of one key row of `dim` values of `dtype`, in fp32, computed exactly as
// KeyDiffScoreHead's KeyDiffMetric::kNegativeNorm pass at the same `isa` computes it (the same
// instructions in the same order), so that a norm taken elsewhere (FindNonFinite's row_norms,
// when the row is committed) equals the one a pass over the keys would give, bit for bit.
float KeyRowNorm(const uint8_t* row, DType dtype, int dim, KeyDiffIsa isa);
// The function KeyRowNorm calls for rows of `dtype` and `dim` at `isa`, chosen once for a run of
// rows (its second argument is `dim`).
using KeyRowNormFn = float (*)(const uint8_t* row, int dim);
KeyRowNormFn KeyRowNormFor(DType dtype, int dim, KeyDiffIsa isa);

}  // namespace kvs

#endif  // KVSIDECAR_GPU_CPU_KEYDIFF_CPU_H_
