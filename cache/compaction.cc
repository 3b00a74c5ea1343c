#include "cache/compaction.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace kvs {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// INTERNAL unless the inputs are consistent (see PlanCompaction).
absl::Status CheckInputs(const ModelLayout& layout, absl::Span<const int32_t> block_table,
                         int32_t count, int32_t keep, absl::Span<const int32_t> kept,
                         absl::Span<const std::vector<int32_t>> positions) {
  const int32_t heads = layout.num_kv_heads;
  if (count < 0 || keep < 0 || keep > count) {
    return absl::InternalError(absl::StrCat("compaction of ", count, " tokens to ", keep));
  }
  const int64_t old_blocks = CeilDiv(count, layout.block_tokens);
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
  return absl::OkStatus();
}

// Step 1, block granularity: the blocks some head keeps a token of, in table order. Logical slot
// s of this reduced table is old slot old_block[s / b] * b + s % b; a block nobody keeps a token
// of is not in it (freed without a copy).
struct ReducedTable {
  std::vector<int32_t> old_block;      // reduced index -> old table index
  std::vector<int32_t> reduced_index;  // old table index -> reduced index, -1 = dropped
  bool identity = false;               // nothing dropped: logical slots are the old ones
};

// Per old block: nonzero when some head keeps a token of it. With fewer evictions per head than
// a block holds, every block but a short last one has a kept token, so only that one is looked
// at (a binary search per head instead of a pass over every kept slot).
absl::StatusOr<std::vector<int32_t>> KeptInBlock(int32_t b, int32_t heads, int32_t count,
                                                 int32_t keep, absl::Span<const int32_t> kept) {
  const int32_t old_blocks = static_cast<int32_t>(CeilDiv(count, b));
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
  return kept_in_block;
}

absl::StatusOr<ReducedTable> ReduceTable(int32_t b, int32_t heads, int32_t count, int32_t keep,
                                         absl::Span<const int32_t> kept) {
  absl::StatusOr<std::vector<int32_t>> kept_in_block = KeptInBlock(b, heads, count, keep, kept);
  if (!kept_in_block.ok()) return kept_in_block.status();
  const std::vector<int32_t>& in_block = *kept_in_block;
  const int32_t old_blocks = static_cast<int32_t>(in_block.size());
  const int32_t keep_blocks = static_cast<int32_t>(CeilDiv(keep, b));
  ReducedTable table;
  table.old_block.reserve(old_blocks);
  for (int32_t j = 0; j < old_blocks; ++j) {
    if (in_block[j] != 0) table.old_block.push_back(j);
  }
  // The new table is the reduced one's first keep_blocks blocks, and a kept token in them stays
  // where it is (below `keep`) while every other kept token is copied. With exact counts (an
  // eviction of a block or more per head) those are the keep_blocks blocks holding the most kept
  // tokens, fullest first (ties: the earlier), so that the partly used last one is the emptiest;
  // then the rest in table order. A block a policy keeps whole (a recent window, dense
  // attention) stays wherever it lies.
  if (count - keep >= b && static_cast<int32_t>(table.old_block.size()) > keep_blocks) {
    auto fuller = [&](int32_t x, int32_t y) {
      return in_block[x] != in_block[y] ? in_block[x] > in_block[y] : x < y;
    };
    std::vector<int32_t> by_kept = table.old_block;
    std::nth_element(by_kept.begin(), by_kept.begin() + keep_blocks, by_kept.end(), fuller);
    std::sort(by_kept.begin(), by_kept.begin() + keep_blocks, fuller);
    std::vector<uint8_t> chosen(old_blocks, 0);
    for (int32_t i = 0; i < keep_blocks; ++i) chosen[by_kept[i]] = 1;
    by_kept.resize(keep_blocks);
    for (int32_t j : table.old_block) {
      if (chosen[j] == 0) by_kept.push_back(j);
    }
    table.old_block = std::move(by_kept);
  }
  table.reduced_index.assign(old_blocks, -1);
  table.identity = static_cast<int32_t>(table.old_block.size()) == old_blocks;
  for (int32_t r = 0; r < static_cast<int32_t>(table.old_block.size()); ++r) {
    table.reduced_index[table.old_block[r]] = r;
    table.identity = table.identity && table.old_block[r] == r;
  }
  return table;
}

// Step 2 for one head: hole filling on the reduced table. The head's kept slots below `keep`
// (logically) stay and leave holes between them; the ones at or above `keep` are the movers,
// paired in order with the holes. Writes the head's new positions and sources, and the K and V
// row copies of each mover at `rows` onwards (advanced).
class HoleFiller {
 public:
  HoleFiller(const ModelLayout& layout, absl::Span<const int32_t> block_table, int32_t count,
             int32_t keep, const ReducedTable& table, CompactionPlan& plan)
      : layout_(layout),
        block_table_(block_table),
        count_(count),
        keep_(keep),
        block_bytes_(layout.block_bytes()),
        row_bytes_(layout.row_bytes()),
        table_(table),
        plan_(plan) {}

  absl::Status Head(int32_t h, absl::Span<const int32_t> head_kept,
                    const std::vector<int32_t>& head_positions, size_t& rows);

 private:
  int32_t ToOld(int32_t logical) const {
    const int32_t b = layout_.block_tokens;
    return table_.identity ? logical : table_.old_block[logical / b] * b + logical % b;
  }
  // Offset of the K row of (head, old slot): head_base is RowOffsetInBlock(0, head, 0).
  uint64_t KeyOffset(uint64_t head_base, int32_t slot) const {
    const int32_t b = layout_.block_tokens;
    return static_cast<uint64_t>(block_table_[slot / b]) * block_bytes_ + head_base +
           static_cast<uint64_t>(slot % b) * row_bytes_;
  }
  absl::StatusOr<int32_t> Logical(int32_t h, int32_t slot) const;

  const ModelLayout& layout_;
  absl::Span<const int32_t> block_table_;
  const int32_t count_;
  const int32_t keep_;
  const uint64_t block_bytes_;
  const uint64_t row_bytes_;
  const ReducedTable& table_;
  CompactionPlan& plan_;
  std::vector<uint8_t> stays_;    // per logical slot below keep: a kept token stays there
  std::vector<int32_t> logical_;  // per kept token of the head: its logical slot
};

absl::StatusOr<int32_t> HoleFiller::Logical(int32_t h, int32_t slot) const {
  if (table_.identity) return slot;
  const int32_t b = layout_.block_tokens;
  const int32_t rank = table_.reduced_index[slot / b];
  if (rank < 0) {
    return absl::InternalError(
        absl::StrCat("head ", h, ": kept slot ", slot, " lies in a block found evicted"));
  }
  return rank * b + slot % b;
}

absl::Status HoleFiller::Head(int32_t h, absl::Span<const int32_t> head_kept,
                              const std::vector<int32_t>& head_positions, size_t& rows) {
  const uint64_t head_base = layout_.RowOffsetInBlock(0, h, 0);
  // V rows sit a fixed distance after the K row of the same head and slot.
  const uint64_t value_delta = layout_.RowOffsetInBlock(1, 0, 0);
  std::vector<int32_t>& new_positions = plan_.positions[h];
  std::vector<int32_t>& sources = plan_.sources[h];
  new_positions.resize(keep_);
  sources.resize(keep_);
  // First pass: the kept tokens at logical slots below keep stay; the reduced table need not
  // follow the old one's order, so they are marked rather than met in order.
  stays_.assign(keep_, 0);
  logical_.resize(keep_);
  for (int32_t i = 0; i < keep_; ++i) {
    const int32_t slot = head_kept[i];
    if (slot < 0 || slot >= count_ || (i > 0 && slot <= head_kept[i - 1])) {
      return absl::InternalError(absl::StrCat("kept slots of head ", h,
                                              " are not strictly ascending in [0, ", count_,
                                              "): slot ", slot, " at index ", i));
    }
    absl::StatusOr<int32_t> logical = Logical(h, slot);
    if (!logical.ok()) return logical.status();
    logical_[i] = *logical;
    if (*logical >= keep_) continue;
    stays_[*logical] = 1;
    new_positions[*logical] = head_positions[slot];
    sources[*logical] = slot;
  }
  // Second pass: the movers (logical slots at or past keep), in slot order, fill the holes below
  // keep in ascending order. keep kept slots, so every hole receives exactly one mover.
  int32_t hole = 0;
  for (int32_t i = 0; i < keep_; ++i) {
    if (logical_[i] < keep_) continue;
    const int32_t slot = head_kept[i];
    while (hole < keep_ && stays_[hole] != 0) ++hole;
    if (hole >= keep_) {
      return absl::InternalError(absl::StrCat("head ", h, ": more movers than holes"));
    }
    const int32_t destination = hole++;
    new_positions[destination] = head_positions[slot];
    sources[destination] = slot;
    const uint64_t from = KeyOffset(head_base, slot);
    const uint64_t to = KeyOffset(head_base, ToOld(destination));
    plan_.src_offsets[rows] = from;
    plan_.dst_offsets[rows] = to;
    plan_.src_offsets[rows + 1] = from + value_delta;
    plan_.dst_offsets[rows + 1] = to + value_delta;
    rows += 2;
    ++plan_.moved_tokens;
  }
  return absl::OkStatus();
}

// Step 3, the new table: the first keep_blocks blocks of the reduced one. Everything else of the
// old table (blocks nobody kept a token of, reduced blocks past the new end, entries past
// ceil(count / B)) goes back to the allocator.
void FinishTable(absl::Span<const int32_t> block_table, int32_t old_blocks,
                 const ReducedTable& table, CompactionPlan& plan) {
  plan.block_table.reserve(plan.keep_blocks);
  for (int32_t r = 0; r < plan.keep_blocks; ++r) {
    plan.block_table.push_back(block_table[table.old_block[r]]);
  }
  for (int32_t j = 0; j < old_blocks; ++j) {
    if (table.reduced_index[j] < 0 || table.reduced_index[j] >= plan.keep_blocks) {
      plan.freed_blocks.push_back(block_table[j]);
    }
  }
  plan.freed_blocks.insert(plan.freed_blocks.end(), block_table.begin() + old_blocks,
                           block_table.end());
}

}  // namespace

absl::StatusOr<CompactionPlan> PlanCompaction(const ModelLayout& layout,
                                              absl::Span<const int32_t> block_table, int32_t count,
                                              int32_t keep, absl::Span<const int32_t> kept,
                                              absl::Span<const std::vector<int32_t>> positions) {
  if (absl::Status checked = CheckInputs(layout, block_table, count, keep, kept, positions);
      !checked.ok()) {
    return checked;
  }
  const int32_t heads = layout.num_kv_heads;
  const int32_t b = layout.block_tokens;
  absl::StatusOr<ReducedTable> table = ReduceTable(b, heads, count, keep, kept);
  if (!table.ok()) return table.status();

  CompactionPlan plan;
  plan.keep_blocks = static_cast<int32_t>(CeilDiv(keep, b));
  plan.positions.resize(heads);
  plan.sources.resize(heads);
  // At most min(keep, count - keep) tokens per head move, each with a K and a V row. The offsets
  // are written by index into vectors sized for the worst case, then trimmed.
  const size_t max_rows = 2ull * heads * std::min(keep, count - keep);
  plan.src_offsets.resize(max_rows);
  plan.dst_offsets.resize(max_rows);
  size_t rows = 0;
  HoleFiller filler(layout, block_table, count, keep, *table, plan);
  for (int32_t h = 0; h < heads; ++h) {
    if (absl::Status filled = filler.Head(h, kept.subspan(int64_t{h} * keep, keep), positions[h],
                                          rows);
        !filled.ok()) {
      return filled;
    }
  }
  plan.src_offsets.resize(rows);
  plan.dst_offsets.resize(rows);
  plan.bytes_copied = rows * layout.row_bytes();
  FinishTable(block_table, static_cast<int32_t>(CeilDiv(count, b)), *table, plan);
  return plan;
}

}  // namespace kvs
