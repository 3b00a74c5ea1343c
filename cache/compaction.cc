#include "cache/compaction.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace kvs {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

absl::StatusOr<CompactionPlan> PlanCompaction(const ModelLayout& layout,
                                              absl::Span<const int32_t> block_table, int32_t count,
                                              int32_t keep, absl::Span<const int32_t> kept,
                                              absl::Span<const std::vector<int32_t>> positions) {
  const int32_t heads = layout.num_kv_heads;
  const int32_t b = layout.block_tokens;
  if (count < 0 || keep < 0 || keep > count) {
    return absl::InternalError(absl::StrCat("compaction of ", count, " tokens to ", keep));
  }
  const int32_t old_blocks = static_cast<int32_t>(CeilDiv(count, b));
  if (static_cast<int64_t>(block_table.size()) < old_blocks) {
    return absl::InternalError(
        absl::StrCat("block table has ", block_table.size(), " blocks for ", count, " tokens"));
  }
  if (static_cast<int64_t>(kept.size()) != int64_t{heads} * keep) {
    return absl::InternalError(
        absl::StrCat("kept set has ", kept.size(), " slots, expected ", int64_t{heads} * keep));
  }
  if (static_cast<int32_t>(positions.size()) != heads) {
    return absl::InternalError(absl::StrCat("position table has ", positions.size(), " heads"));
  }
  for (int32_t h = 0; h < heads; ++h) {
    if (static_cast<int32_t>(positions[h].size()) != count) {
      return absl::InternalError(absl::StrCat("head ", h, " has ", positions[h].size(),
                                              " positions for ", count, " tokens"));
    }
  }

  CompactionPlan plan;
  plan.keep_blocks = static_cast<int32_t>(CeilDiv(keep, b));
  plan.positions.resize(heads);
  plan.sources.resize(heads);

  // 1. Block granularity: the blocks some head keeps a token of, in table order (kept_in_block:
  // nonzero for those; with fewer evictions per head than a block holds, every block but a short
  // last one has a kept token, so only that one is looked at). Logical slot
  // s of this reduced table is old slot old_block[s / b] * b + s % b; a block nobody keeps a
  // token of is not in it (freed below without a copy).
  std::vector<int32_t> kept_in_block(old_blocks, 1);
  if (count - keep >= b) {
    std::fill(kept_in_block.begin(), kept_in_block.end(), 0);
    for (int32_t slot : kept) {
      if (slot < 0 || slot >= count) {
        return absl::InternalError(absl::StrCat("kept slot ", slot, " outside [0, ", count, ")"));
      }
      ++kept_in_block[slot / b];
    }
  } else if (old_blocks > 0 && count - (old_blocks - 1) * b <= count - keep) {
    // Fewer evictions per head than a block holds (a decode step): only a short last block can
    // be evicted whole. A binary search per head instead of a pass over every kept slot.
    const int32_t first = (old_blocks - 1) * b;
    kept_in_block[old_blocks - 1] = 0;
    for (int32_t h = 0; h < heads; ++h) {
      const absl::Span<const int32_t> head_kept = kept.subspan(int64_t{h} * keep, keep);
      if (std::lower_bound(head_kept.begin(), head_kept.end(), first) != head_kept.end()) {
        kept_in_block[old_blocks - 1] = 1;
        break;
      }
    }
  }
  std::vector<int32_t> old_block;  // reduced index -> old table index
  std::vector<int32_t> reduced_index(old_blocks, -1);
  old_block.reserve(old_blocks);
  for (int32_t j = 0; j < old_blocks; ++j) {
    if (kept_in_block[j] == 0) continue;
    reduced_index[j] = static_cast<int32_t>(old_block.size());
    old_block.push_back(j);
  }
  // Nothing dropped (every decode step): logical slots are the old ones, no division per slot.
  const bool identity = static_cast<int32_t>(old_block.size()) == old_blocks;
  auto to_old = [&](int32_t logical) {
    return identity ? logical : old_block[logical / b] * b + logical % b;
  };

  const uint64_t block_bytes = layout.block_bytes();
  const uint64_t row_bytes = layout.row_bytes();
  // V rows sit a fixed distance after the K row of the same head and slot.
  const uint64_t value_delta = layout.RowOffsetInBlock(1, 0, 0);
  // Offset of the K row of (head, old slot): head_base is RowOffsetInBlock(0, head, 0).
  auto key_offset = [&](uint64_t head_base, int32_t slot) {
    return static_cast<uint64_t>(block_table[slot / b]) * block_bytes + head_base +
           static_cast<uint64_t>(slot % b) * row_bytes;
  };

  // 2. Hole filling on the reduced table. At most min(keep, count - keep) tokens per head move,
  // each with a K and a V row. The offsets are written by index into vectors sized for the worst
  // case, then trimmed.
  const size_t max_rows = 2ull * heads * std::min(keep, count - keep);
  plan.src_offsets.resize(max_rows);
  plan.dst_offsets.resize(max_rows);
  uint64_t* src = plan.src_offsets.data();
  uint64_t* dst = plan.dst_offsets.data();
  size_t rows = 0;
  std::vector<int32_t> holes;  // logical slots
  for (int32_t h = 0; h < heads; ++h) {
    const absl::Span<const int32_t> head_kept = kept.subspan(int64_t{h} * keep, keep);
    const std::vector<int32_t>& head_positions = positions[h];
    const uint64_t head_base = layout.RowOffsetInBlock(0, h, 0);
    // Walk the kept slots once: the ones below `keep` (logically) leave holes between them; the
    // ones at or above `keep` are the movers, paired in order with the holes.
    holes.clear();
    int32_t next_unkept = 0;  // every logical slot in [next_unkept, slot) below keep is a hole
    size_t hole_index = 0;
    std::vector<int32_t>& new_positions = plan.positions[h];
    std::vector<int32_t>& sources = plan.sources[h];
    new_positions.resize(keep);
    sources.resize(keep);
    for (int32_t i = 0; i < keep; ++i) {
      const int32_t slot = head_kept[i];
      if (slot < 0 || slot >= count || (i > 0 && slot <= head_kept[i - 1])) {
        return absl::InternalError(absl::StrCat("kept slots of head ", h,
                                                " are not strictly ascending in [0, ", count,
                                                "): slot ", slot, " at index ", i));
      }
      int32_t logical = slot;
      if (!identity) {
        const int32_t rank = reduced_index[slot / b];
        if (rank < 0) {
          return absl::InternalError(absl::StrCat("head ", h, ": kept slot ", slot,
                                                  " lies in a block found evicted"));
        }
        logical = rank * b + slot % b;
      }
      if (logical < keep) {
        for (int32_t hole = next_unkept; hole < logical; ++hole) holes.push_back(hole);
        next_unkept = logical + 1;
        new_positions[logical] = head_positions[slot];
        sources[logical] = slot;
        continue;
      }
      // First mover: every unkept logical slot below keep is a hole.
      for (int32_t hole = next_unkept; hole < keep; ++hole) holes.push_back(hole);
      next_unkept = keep;
      if (hole_index >= holes.size()) {
        return absl::InternalError(absl::StrCat("head ", h, ": more movers than holes"));
      }
      const int32_t destination = holes[hole_index++];
      new_positions[destination] = head_positions[slot];
      sources[destination] = slot;
      const uint64_t from = key_offset(head_base, slot);
      const uint64_t to = key_offset(head_base, to_old(destination));
      src[rows] = from;
      dst[rows] = to;
      src[rows + 1] = from + value_delta;
      dst[rows + 1] = to + value_delta;
      rows += 2;
      ++plan.moved_tokens;
    }
    // keep kept slots, so after the walk every hole below keep received exactly one mover.
  }
  plan.src_offsets.resize(rows);
  plan.dst_offsets.resize(rows);
  plan.bytes_copied = rows * row_bytes;

  // 3. The new table: the first keep_blocks blocks of the reduced one. Everything else of the
  // old table (blocks nobody kept a token of, reduced blocks past the new end, entries past
  // ceil(count / B)) goes back to the allocator.
  plan.block_table.reserve(plan.keep_blocks);
  for (int32_t r = 0; r < plan.keep_blocks; ++r) plan.block_table.push_back(block_table[old_block[r]]);
  for (int32_t j = 0; j < old_blocks; ++j) {
    if (reduced_index[j] < 0 || reduced_index[j] >= plan.keep_blocks) {
      plan.freed_blocks.push_back(block_table[j]);
    }
  }
  plan.freed_blocks.insert(plan.freed_blocks.end(), block_table.begin() + old_blocks,
                           block_table.end());
  return plan;
}

}  // namespace kvs
