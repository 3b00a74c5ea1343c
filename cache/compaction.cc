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
  if (static_cast<int64_t>(block_table.size()) < CeilDiv(count, b)) {
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

  CompactionPlan plan;
  plan.keep_blocks = static_cast<int32_t>(CeilDiv(keep, b));
  plan.positions.resize(heads);
  plan.sources.resize(heads);
  const uint64_t block_bytes = layout.block_bytes();
  const uint64_t row_bytes = layout.row_bytes();
  // V rows sit a fixed distance after the K row of the same head and slot.
  const uint64_t value_delta = layout.RowOffsetInBlock(1, 0, 0);
  // Offset of the K row of (head, slot): head_base is RowOffsetInBlock(0, head, 0).
  auto key_offset = [&](uint64_t head_base, int32_t slot) {
    return static_cast<uint64_t>(block_table[slot / b]) * block_bytes + head_base +
           static_cast<uint64_t>(slot % b) * row_bytes;
  };

  // At most min(keep, count - keep) tokens per head move, each with a K and a V row. The
  // offsets are written by index into vectors sized for the worst case, then trimmed.
  const size_t max_rows = 2ull * heads * std::min(keep, count - keep);
  plan.src_offsets.resize(max_rows);
  plan.dst_offsets.resize(max_rows);
  uint64_t* src = plan.src_offsets.data();
  uint64_t* dst = plan.dst_offsets.data();
  size_t rows = 0;
  std::vector<int32_t> holes;
  for (int32_t h = 0; h < heads; ++h) {
    const absl::Span<const int32_t> head_kept = kept.subspan(int64_t{h} * keep, keep);
    const std::vector<int32_t>& head_positions = positions[h];
    if (static_cast<int32_t>(head_positions.size()) != count) {
      return absl::InternalError(absl::StrCat("head ", h, " has ", head_positions.size(),
                                              " positions for ", count, " tokens"));
    }
    const uint64_t head_base = layout.RowOffsetInBlock(0, h, 0);
    // Walk the kept slots once: the ones below `keep` leave holes between them; the ones at or
    // above `keep` are the movers, paired in order with the holes.
    holes.clear();
    int32_t next_unkept = 0;  // every slot in [next_unkept, slot) below keep is a hole
    size_t hole_index = 0;
    std::vector<int32_t>& new_positions = plan.positions[h];
    new_positions.assign(head_positions.begin(), head_positions.begin() + keep);
    std::vector<int32_t>& sources = plan.sources[h];
    sources.resize(keep);
    for (int32_t t = 0; t < keep; ++t) sources[t] = t;
    for (int32_t i = 0; i < keep; ++i) {
      const int32_t slot = head_kept[i];
      if (slot < 0 || slot >= count || (i > 0 && slot <= head_kept[i - 1])) {
        return absl::InternalError(absl::StrCat("kept slots of head ", h,
                                                " are not strictly ascending in [0, ", count,
                                                "): slot ", slot, " at index ", i));
      }
      if (slot < keep) {
        for (int32_t hole = next_unkept; hole < slot; ++hole) holes.push_back(hole);
        next_unkept = slot + 1;
        continue;
      }
      // First mover: every unkept slot below keep is a hole.
      for (int32_t hole = next_unkept; hole < keep; ++hole) holes.push_back(hole);
      next_unkept = keep;
      if (hole_index >= holes.size()) {
        return absl::InternalError(absl::StrCat("head ", h, ": more movers than holes"));
      }
      const int32_t destination = holes[hole_index++];
      new_positions[destination] = head_positions[slot];
      sources[destination] = slot;
      const uint64_t from = key_offset(head_base, slot);
      const uint64_t to = key_offset(head_base, destination);
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
  return plan;
}

}  // namespace kvs
