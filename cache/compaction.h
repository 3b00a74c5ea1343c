// Compaction planner: after a policy chose which tokens of a layer to keep, plans how they come to
// fill slots [0, keep). Slots are logical: the block table maps slot / B to an arena block, so the
// plan works at block granularity first and moves rows only where it must:
//   1. a block none of whose tokens any head keeps leaves the table (it is freed, nothing copied);
//      when a block or more per head is evicted, the ceil(keep / B) blocks holding the most kept
//      tokens (summed over heads) become the new table, fullest first, so a block kept whole
//      stays wherever it lies; otherwise the blocks keep their order;
//   2. on that table, HOLE FILLING: kept tokens outside slots [0, keep) of it move into its
//      evicted slots (the i-th such token, by old slot, into the i-th hole), so the fewest rows
//      move and kept tokens already inside stay in their block.
// StreamingLLM's sinks + recent window thus drop every middle block and copy only the sinks'
// rows. Slot order is not position order (holes are refilled, blocks reordered); the new
// position table says which position every slot holds. The plan is pure data:
// arena offsets for Backend::CopyRows, the new block table, the blocks to free and the new
// position table; the caller executes it.
//
// Threading: pure functions, no state.
#ifndef KVSIDECAR_CACHE_COMPACTION_H_
#define KVSIDECAR_CACHE_COMPACTION_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "gpu/backend.h"
#include "gpu/base/layout.h"

namespace kvs {

struct CompactionPlan {
  // Row copies (keys and values, every head): row i goes from src_offsets[i] to dst_offsets[i],
  // both byte offsets into the arena, each row layout.row_bytes() long. Destinations are slots
  // < keep and sources slots >= keep, so no copy reads what another one writes.
  std::vector<uint64_t> src_offsets;
  std::vector<uint64_t> dst_offsets;
  // New position table, per head `keep` entries in slot order.
  std::vector<std::vector<int32_t>> positions;
  // [H][keep]: the old slot of every new slot (sources[h][t] == t for a token that stayed when
  // the table kept its order), for LayerPolicyState::Compact to permute the slot-aligned policy
  // state like the rows.
  std::vector<std::vector<int32_t>> sources;
  int64_t moved_tokens = 0;  // tokens whose rows were copied, summed over heads
  int32_t keep_blocks = 0;   // ceil(keep / B): block-table entries still needed
  // The layer's block table after the copies (keep_blocks entries) and every block of the old
  // table that is not in it (dropped whole, or past the new end), for the allocator.
  std::vector<int32_t> block_table;
  std::vector<int32_t> freed_blocks;
  // K and V bytes the copies move (rows x row bytes).
  uint64_t bytes_copied = 0;

  // A copy job over `arena` for this plan; valid while the plan lives.
  RowCopyJob Job(uint8_t* arena, uint64_t row_bytes) const {
    return RowCopyJob{arena, src_offsets.data(), dst_offsets.data(),
                      static_cast<int64_t>(src_offsets.size()), row_bytes};
  }
  // The same rows as Job(), appended to `jobs` in pieces of at most `max_rows` (>= 1) rows. No
  // row reads what another writes, so the pieces are independent and a backend may run them in
  // parallel; valid while the plan lives.
  void AppendJobs(uint8_t* arena, uint64_t row_bytes, int64_t max_rows,
                  std::vector<RowCopyJob>& jobs) const {
    const int64_t rows = static_cast<int64_t>(src_offsets.size());
    for (int64_t first = 0; first < rows; first += max_rows) {
      jobs.push_back(RowCopyJob{arena, src_offsets.data() + first, dst_offsets.data() + first,
                                std::min(max_rows, rows - first), row_bytes});
    }
  }
};

// Plans the compaction of one layer holding `count` tokens down to `keep`.
//   block_table: the layer's blocks (at least ceil(count / B); entries past that are freed).
//   kept:        [H][keep] slots to keep, strictly ascending per head, each in [0, count).
//   positions:   per head, the `count` original positions in slot order.
// INTERNAL when the inputs are inconsistent (a policy or bookkeeping bug); nothing is planned.
absl::StatusOr<CompactionPlan> PlanCompaction(const ModelLayout& layout,
                                              absl::Span<const int32_t> block_table, int32_t count,
                                              int32_t keep, absl::Span<const int32_t> kept,
                                              absl::Span<const std::vector<int32_t>> positions);

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_COMPACTION_H_
