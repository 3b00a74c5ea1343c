// Reductions of a step's attention probabilities that the attention-based scorers share (H2O,
// TOVA, SnapKV, CAKE, D2O, CAOTE): column sums over query rows, GQA means, and 1-D pooling along
// each head's POSITION order (slots are hole-filled, so slot order is not position order).
//
// Layouts: probs [Hq][num_queries][count]; per-head arrays [rows][count] in slot order; positions
// [H][count]. Query head q belongs to kv head q / (Hq / H).
//
// Threading: pure functions of their arguments.
#ifndef KVSIDECAR_CACHE_POLICY_ATTENTION_STATS_H_
#define KVSIDECAR_CACHE_POLICY_ATTENTION_STATS_H_

#include <cstdint>
#include <deque>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "cache/policy/policy.h"
#include "cache/policy/policy_config.h"
#include "gpu/backend.h"

namespace kvs {

// The one check of a step's attention every attention-based scorer makes before folding it into
// state that lives as long as the sequence: INVALID_ARGUMENT unless `layer` carries
// [num_q_heads][num_queries][count] finite, non-negative probabilities (num_q_heads a positive
// multiple of the kv heads); INTERNAL when the sequence passed a
// malformed layer (no state, position table of the wrong size). `policy` names the policy.
absl::Status CheckLayerStep(absl::string_view policy, const LayerStep& layer);

// H2O's and D2O's update (caote.md §4, d2o.md §4.1 Eq. 4 and §4.2 Eq. 6): checks `layer` (as
// CheckLayerStep) and adds the column sums of every query row of the step to
// layer.state->accumulated ([Hq][count], created at zero). INTERNAL when the state is misaligned.
absl::Status AccumulateColumnSums(absl::string_view policy, const LayerStep& layer);

// out[q][s] (+)= sum over the last `rows` query rows of probs[q][i][s] (all rows when rows <= 0
// or rows > num_queries). `accumulate` adds to out instead of overwriting it.
void SumQueryRows(absl::Span<const float> probs, int32_t num_q_heads, int32_t num_queries,
                  int32_t count, int32_t rows, bool accumulate, absl::Span<float> out);

// out[g][s] = mean over the query heads q of group g of in[q][s].
void GqaMean(absl::Span<const float> in, int32_t num_q_heads, int32_t num_kv_heads, int32_t count,
             absl::Span<float> out);

// Whether slot s holds position positions[0] + s for every s < n (a row nothing was evicted from
// yet, or only its newest tokens): its sinks and recent window are then its first and last slots.
bool HoldsConsecutivePositions(const int32_t* positions, int32_t n);

// Marks in `forced` (n entries) the slots holding the `sinks` lowest and the `recent` highest of
// the n distinct `positions` (a head's protected tokens). O(n): positions usually span little
// more than n values, so the two limits come from a bitmap of the span; a sparse span takes two
// partial selections on a copy instead. `scratch` and `bitmap` are reused between calls.
void MarkSinksAndRecent(const int32_t* positions, int32_t n, int32_t sinks, int32_t recent,
                        std::vector<int32_t>& scratch, std::vector<uint64_t>& bitmap,
                        uint8_t* forced);

// The slots of one head whose `eligible` flag is set (every slot when null), in ascending order
// of their distinct `positions`; `scratch` is reused between calls.
void SlotsByPosition(const int32_t* positions, int32_t count, const uint8_t* eligible,
                     std::vector<int32_t>& scratch, std::vector<int32_t>& order);

// Pools each row of `in` ([rows][count]; row r belongs to kv head r / (rows / num_kv_heads))
// along the position order of its head's slots, restricted to the slots with eligible[h][s] != 0
// (all slots when `eligible` is empty): out at the j-th eligible slot by position =
//   kAvg: (1/k) * sum_{t=-k/2}^{k/2} in at the (j+t)-th eligible slot, 0 outside (zero padding
//         counted in the divisor, as torch avg_pool1d with count_include_pad);
//   kMax: the max over the same neighbours that exist.
// Slots that are not eligible are copied through unchanged. kernel_size is odd and >= 1. The
// position order is worked out here; the pooling is Backend::PoolScores (synchronised before
// returning). `in` and `out` are host memory the backend can compute on; they do not overlap.
absl::Status PoolByPosition(Backend& backend, absl::Span<const float> in, int32_t rows,
                            int32_t num_kv_heads, int32_t count,
                            absl::Span<const int32_t> positions, absl::Span<const uint8_t> eligible,
                            int32_t kernel_size, Pooling pooling, absl::Span<float> out);

// PoolByPosition over many layers: each Add works out one layer's position order (reading
// `positions` and `eligible` then), Run pools them all in one Backend::PoolScores call and one
// wait. A step over 64 sequences x 32 layers pools in one call where it took 2048. `in` and `out`
// of every Add must stay valid, and `in` hold its values, by the time Run is called.
class PoolBatch {
 public:
  void Add(absl::Span<const float> in, int32_t rows, int32_t num_kv_heads, int32_t count,
           absl::Span<const int32_t> positions, absl::Span<const uint8_t> eligible,
           int32_t kernel_size, Pooling pooling, absl::Span<float> out);
  // Nothing when no job was added.
  absl::Status Run(Backend& backend);

 private:
  std::vector<PoolJob> jobs_;
  std::deque<std::vector<int32_t>> orders_;  // per job; a deque keeps them where they are
  std::deque<std::vector<int32_t>> lengths_;
  std::vector<int32_t> order_;
  std::vector<int32_t> by_offset_;
};

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_POLICY_ATTENTION_STATS_H_
