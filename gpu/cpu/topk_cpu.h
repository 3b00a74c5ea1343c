// Per-row top-k selection on the host (Backend::TopK semantics, gpu/backend.h), exposed for
// the CPU backend and its tests.
//
// Threading: pure functions of their arguments; distinct rows may be selected concurrently.
#ifndef KVSIDECAR_GPU_CPU_TOPK_CPU_H_
#define KVSIDECAR_GPU_CPU_TOPK_CPU_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "gpu/backend.h"

namespace kvs {

// INVALID_ARGUMENT unless 0 <= k <= n, the buffers are present and no row forces more than k
// slots. `index` names the job in the message. Reads every forced flag (O(rows * n)).
absl::Status ValidateTopKJob(const TopKJob& job, size_t index);

// Per-thread buffers reused across rows to avoid allocations.
struct TopKScratch {
  std::vector<uint32_t> keys;       // per slot: the order-preserving score key
  std::vector<int32_t> candidates;  // slots still in the running during the radix select
  std::vector<int32_t> spare;       // the next round's candidates
};

// Writes job.kept[row * k .. row * k + k) for one row of a validated job. O(n): a radix select
// on the score keys, ties at the threshold broken by position.
void TopKRow(const TopKJob& job, int32_t row, TopKScratch& scratch);

}  // namespace kvs

#endif  // KVSIDECAR_GPU_CPU_TOPK_CPU_H_
