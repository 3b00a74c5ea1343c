#include "cache/compaction.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gpu/backend.h"
#include "gtest/gtest.h"
#include "tests/cache/cache_test_util.h"

namespace kvs {
namespace {

using ::testing::ElementsAre;
using ::testing::UnorderedElementsAre;
using testing_util::MakeLayout;

uint64_t RowOffset(const ModelLayout& layout, const std::vector<int32_t>& table, int kv, int head,
                   int32_t slot) {
  return static_cast<uint64_t>(table[slot / layout.block_tokens]) * layout.block_bytes() +
         layout.RowOffsetInBlock(kv, head, slot % layout.block_tokens);
}

std::vector<std::vector<int32_t>> Positions(int heads, int32_t count, int32_t base) {
  std::vector<std::vector<int32_t>> positions(heads);
  for (int h = 0; h < heads; ++h) {
    for (int32_t s = 0; s < count; ++s) positions[h].push_back(base + 10 * h + 100 * s);
  }
  return positions;
}

TEST(CompactionTest, MoversFillHolesInOrder) {
  const ModelLayout layout = MakeLayout(1, 2, 3, DType::kFloat32, 4);
  const std::vector<int32_t> table = {5, 2, 7};  // 10 tokens
  const auto positions = Positions(2, 10, 1);
  // Head 0 keeps slots 1, 3, 6, 9: holes 0 and 2 receive 6 and 9.
  // Head 1 keeps slots 0..3: nothing moves.
  const std::vector<int32_t> kept = {1, 3, 6, 9, 0, 1, 2, 3};
  auto plan = PlanCompaction(layout, table, 10, 4, kept, positions);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->moved_tokens, 2);
  EXPECT_EQ(plan->keep_blocks, 1);
  EXPECT_THAT(plan->positions[0],
              ElementsAre(positions[0][6], positions[0][1], positions[0][9], positions[0][3]));
  EXPECT_THAT(plan->positions[1],
              ElementsAre(positions[1][0], positions[1][1], positions[1][2], positions[1][3]));
  // The old slot of every new slot: what the policy state is permuted by.
  ASSERT_EQ(plan->sources.size(), 2u);
  EXPECT_THAT(plan->sources[0], ElementsAre(6, 1, 9, 3));
  EXPECT_THAT(plan->sources[1], ElementsAre(0, 1, 2, 3));
  ASSERT_EQ(plan->src_offsets.size(), 4u);  // 2 tokens x (K, V)
  EXPECT_EQ(plan->src_offsets[0], RowOffset(layout, table, 0, 0, 6));
  EXPECT_EQ(plan->dst_offsets[0], RowOffset(layout, table, 0, 0, 0));
  EXPECT_EQ(plan->src_offsets[1], RowOffset(layout, table, 1, 0, 6));
  EXPECT_EQ(plan->dst_offsets[1], RowOffset(layout, table, 1, 0, 0));
  EXPECT_EQ(plan->src_offsets[2], RowOffset(layout, table, 0, 0, 9));
  EXPECT_EQ(plan->dst_offsets[2], RowOffset(layout, table, 0, 0, 2));
  EXPECT_EQ(plan->src_offsets[3], RowOffset(layout, table, 1, 0, 9));
  EXPECT_EQ(plan->dst_offsets[3], RowOffset(layout, table, 1, 0, 2));
}

// A block no head keeps a token of leaves the table without a copy, a block every head keeps
// whole stays where it is, and hole filling runs on what is left.
TEST(CompactionTest, EvictedBlocksLeaveTheTableAndWholeBlocksStay) {
  const ModelLayout layout = MakeLayout(1, 2, 3, DType::kFloat32, 4);
  const std::vector<int32_t> table = {5, 2, 7, 9};  // 16 tokens
  const auto positions = Positions(2, 16, 1);
  // Both heads keep slots 0, 1 (block 5) and 12..15 (block 9, whole); blocks 2 and 7 are evicted.
  // Reduced table [5, 9]: logical slots 0, 1, 4..7 kept, holes 2 and 3 take logical 6 and 7.
  const std::vector<int32_t> kept = {0, 1, 12, 13, 14, 15, 0, 1, 12, 13, 14, 15};
  auto plan = PlanCompaction(layout, table, 16, 6, kept, positions);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->keep_blocks, 2);
  EXPECT_THAT(plan->block_table, ElementsAre(5, 9));
  EXPECT_THAT(plan->freed_blocks, ElementsAre(2, 7));
  EXPECT_EQ(plan->moved_tokens, 4);  // 2 per head; hole filling of the whole table moved 4
  EXPECT_EQ(plan->bytes_copied, 8 * layout.row_bytes());
  for (int h = 0; h < 2; ++h) {
    EXPECT_THAT(plan->sources[h], ElementsAre(0, 1, 14, 15, 12, 13));
    EXPECT_THAT(plan->positions[h],
                ElementsAre(positions[h][0], positions[h][1], positions[h][14], positions[h][15],
                            positions[h][12], positions[h][13]));
  }
  ASSERT_EQ(plan->src_offsets.size(), 8u);
  // Head 0, K: slot 14 (block 9) into logical slot 2, i.e. old slot 2 (block 5).
  EXPECT_EQ(plan->src_offsets[0], RowOffset(layout, table, 0, 0, 14));
  EXPECT_EQ(plan->dst_offsets[0], RowOffset(layout, table, 0, 0, 2));
  EXPECT_EQ(plan->src_offsets[2], RowOffset(layout, table, 0, 0, 15));
  EXPECT_EQ(plan->dst_offsets[2], RowOffset(layout, table, 0, 0, 3));
}

// The blocks holding the most kept tokens form the new table, fullest first: a block kept whole
// at the end of the table stays, and the partly kept ones fill in after it.
TEST(CompactionTest, TheFullestBlocksStayWhereverTheyLie) {
  const ModelLayout layout = MakeLayout(1, 1, 3, DType::kFloat32, 4);
  const std::vector<int32_t> table = {5, 2, 7, 9};  // 16 tokens
  const auto positions = Positions(1, 16, 2);
  // Kept: slot 0 (block 5), slot 4 (block 2), slots 12..15 (block 9, whole); block 7 evicted.
  // New table [9, 5]: slots 12..15 stay as logical 0..3, slot 0 as logical 4; slot 4 moves into
  // logical 5 (old slot 1, block 5). First blocks first ([5, 2], then 9) would have moved 4.
  auto plan = PlanCompaction(layout, table, 16, 6, {0, 4, 12, 13, 14, 15}, positions);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(plan->block_table, ElementsAre(9, 5));
  EXPECT_THAT(plan->freed_blocks, UnorderedElementsAre(2, 7));
  EXPECT_EQ(plan->moved_tokens, 1);
  EXPECT_THAT(plan->sources[0], ElementsAre(12, 13, 14, 15, 0, 4));
  ASSERT_EQ(plan->src_offsets.size(), 2u);
  EXPECT_EQ(plan->src_offsets[0], RowOffset(layout, table, 0, 0, 4));
  EXPECT_EQ(plan->dst_offsets[0], RowOffset(layout, table, 0, 0, 1));
}

TEST(CompactionTest, NothingMovesWhenKeptSlotsArePrefix) {
  const ModelLayout layout = MakeLayout(1, 1, 2, DType::kFloat16, 2);
  const std::vector<int32_t> table = {0, 1, 2};
  const auto positions = Positions(1, 5, 0);
  auto plan = PlanCompaction(layout, table, 5, 3, {0, 1, 2}, positions);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->moved_tokens, 0);
  EXPECT_TRUE(plan->src_offsets.empty());
  EXPECT_EQ(plan->keep_blocks, 2);
}

TEST(CompactionTest, KeepZeroAndKeepAll) {
  const ModelLayout layout = MakeLayout(1, 1, 2, DType::kFloat16, 2);
  const std::vector<int32_t> table = {3, 4};
  const auto positions = Positions(1, 4, 0);
  auto none = PlanCompaction(layout, table, 4, 0, {}, positions);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->keep_blocks, 0);
  EXPECT_TRUE(none->positions[0].empty());
  auto all = PlanCompaction(layout, table, 4, 4, {0, 1, 2, 3}, positions);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->moved_tokens, 0);
  EXPECT_EQ(all->positions[0], positions[0]);
}

TEST(CompactionTest, MalformedInputsAreInternal) {
  const ModelLayout layout = MakeLayout(1, 1, 2, DType::kFloat16, 2);
  const std::vector<int32_t> table = {0, 1};
  const auto positions = Positions(1, 4, 0);
  // Not ascending, duplicate, out of range, wrong size, keep > count, short table.
  EXPECT_EQ(PlanCompaction(layout, table, 4, 2, {3, 1}, positions).status().code(),
            absl::StatusCode::kInternal);
  EXPECT_EQ(PlanCompaction(layout, table, 4, 2, {1, 1}, positions).status().code(),
            absl::StatusCode::kInternal);
  EXPECT_EQ(PlanCompaction(layout, table, 4, 2, {1, 4}, positions).status().code(),
            absl::StatusCode::kInternal);
  EXPECT_EQ(PlanCompaction(layout, table, 4, 2, {1}, positions).status().code(),
            absl::StatusCode::kInternal);
  EXPECT_EQ(PlanCompaction(layout, table, 4, 5, {0, 1, 2, 3, 4}, positions).status().code(),
            absl::StatusCode::kInternal);
  EXPECT_EQ(PlanCompaction(layout, {0}, 4, 2, {0, 1}, positions).status().code(),
            absl::StatusCode::kInternal);
  EXPECT_EQ(PlanCompaction(layout, table, 3, 2, {0, 1}, positions).status().code(),
            absl::StatusCode::kInternal);  // positions do not match count
}

// Random kept sets, executed with Backend::CopyRows on a host arena: every kept token's K and V
// rows end up bit-identical in the slot the new position table and block table name, and the
// moves are the kept tokens at slots >= keep once the blocks nobody keeps have left the table.
TEST(CompactionTest, ExecutedPlanPreservesEveryKeptRow) {
  std::mt19937 rng(1234);
  auto backend = MakeCpuBackend(2);
  for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
    const ModelLayout layout = MakeLayout(1, 3, 5, dtype, 4);
    for (int trial = 0; trial < 40; ++trial) {
      const int32_t count = 1 + static_cast<int32_t>(rng() % 37);
      const int32_t keep = static_cast<int32_t>(rng() % (count + 1));
      const int32_t blocks = (count + 3) / 4;
      std::vector<int32_t> table(blocks + 2);
      std::iota(table.begin(), table.end(), 0);
      std::shuffle(table.begin(), table.end(), rng);
      table.resize(blocks);
      std::vector<uint8_t> arena((blocks + 2) * layout.block_bytes());
      for (size_t i = 0; i < arena.size(); ++i) arena[i] = static_cast<uint8_t>(rng());
      const std::vector<uint8_t> before = arena;
      const auto positions = Positions(layout.num_kv_heads, count, trial);
      std::vector<int32_t> kept;
      for (int h = 0; h < layout.num_kv_heads; ++h) {
        std::vector<int32_t> slots(count);
        std::iota(slots.begin(), slots.end(), 0);
        std::shuffle(slots.begin(), slots.end(), rng);
        slots.resize(keep);
        std::sort(slots.begin(), slots.end());
        kept.insert(kept.end(), slots.begin(), slots.end());
      }
      // Blocks no head keeps a token of leave the table. When a block or more per head is
      // evicted, the ceil(keep / 4) blocks holding the most kept tokens come first, fullest first
      // (ties: the earlier), then the others in table order; otherwise the table order stays.
      // That order numbers the slots, and the kept tokens at slots >= keep of it move.
      std::vector<int32_t> in_block(blocks, 0);
      for (int32_t s : kept) ++in_block[s / 4];
      std::vector<int32_t> order;
      for (int32_t j = 0; j < blocks; ++j) {
        if (in_block[j] > 0) order.push_back(j);
      }
      const int32_t keep_blocks = (keep + 3) / 4;
      if (count - keep >= 4 && static_cast<int32_t>(order.size()) > keep_blocks) {
        std::vector<int32_t> densest = order;
        std::sort(densest.begin(), densest.end(), [&](int32_t x, int32_t y) {
          return in_block[x] != in_block[y] ? in_block[x] > in_block[y] : x < y;
        });
        densest.resize(keep_blocks);
        std::vector<int32_t> rest;
        for (int32_t j : order) {
          if (std::find(densest.begin(), densest.end(), j) == densest.end()) rest.push_back(j);
        }
        order = densest;
        order.insert(order.end(), rest.begin(), rest.end());
      }
      std::vector<int32_t> rank(blocks, -1);
      for (int32_t r = 0; r < static_cast<int32_t>(order.size()); ++r) rank[order[r]] = r;
      int64_t expected_moves = 0;
      for (int32_t s : kept) expected_moves += rank[s / 4] * 4 + s % 4 >= keep ? 1 : 0;
      auto plan = PlanCompaction(layout, table, count, keep, kept, positions);
      ASSERT_TRUE(plan.ok()) << plan.status();
      EXPECT_EQ(plan->moved_tokens, expected_moves);
      EXPECT_EQ(plan->bytes_copied, 2 * expected_moves * layout.row_bytes());
      // Every block of the old table is either in the new one or freed, once.
      ASSERT_EQ(plan->block_table.size(), static_cast<size_t>((keep + 3) / 4));
      std::vector<int32_t> all = plan->block_table;
      all.insert(all.end(), plan->freed_blocks.begin(), plan->freed_blocks.end());
      std::sort(all.begin(), all.end());
      std::vector<int32_t> old_table = table;
      std::sort(old_table.begin(), old_table.end());
      EXPECT_EQ(all, old_table);
      // Odd trials run the plan as one job, even ones in small independent pieces.
      std::vector<RowCopyJob> jobs;
      if (trial % 2 == 1) {
        jobs.push_back(plan->Job(arena.data(), layout.row_bytes()));
      } else {
        plan->AppendJobs(arena.data(), layout.row_bytes(), 1 + trial % 5, jobs);
      }
      ASSERT_TRUE(backend->CopyRows(jobs, nullptr).ok());
      for (int h = 0; h < layout.num_kv_heads; ++h) {
        std::vector<int32_t> want(kept.begin() + h * keep, kept.begin() + (h + 1) * keep);
        std::vector<int32_t> got;
        for (int32_t s = 0; s < keep; ++s) {
          const int32_t position = plan->positions[h][s];
          const auto it = std::find(positions[h].begin(), positions[h].end(), position);
          ASSERT_NE(it, positions[h].end());
          const int32_t original = static_cast<int32_t>(it - positions[h].begin());
          ASSERT_EQ(plan->sources[h][s], original) << "trial " << trial << " head " << h;
          got.push_back(original);
          for (int kv = 0; kv < 2; ++kv) {
            ASSERT_EQ(std::memcmp(arena.data() + RowOffset(layout, plan->block_table, kv, h, s),
                                  before.data() + RowOffset(layout, table, kv, h, original),
                                  layout.row_bytes()),
                      0)
                << "trial " << trial << " head " << h << " slot " << s;
          }
        }
        std::sort(got.begin(), got.end());
        EXPECT_EQ(got, want);
      }
    }
  }
}

TEST(CompactionTest, AppendJobsSplitsThePlanInOrder) {
  CompactionPlan plan;
  for (uint64_t i = 0; i < 10; ++i) {
    plan.src_offsets.push_back(1000 + i);
    plan.dst_offsets.push_back(i);
  }
  uint8_t arena[1];
  std::vector<RowCopyJob> jobs;
  plan.AppendJobs(arena, 8, 4, jobs);
  ASSERT_EQ(jobs.size(), 3u);
  const int64_t counts[] = {4, 4, 2};
  for (size_t j = 0; j < jobs.size(); ++j) {
    EXPECT_EQ(jobs[j].arena, arena);
    EXPECT_EQ(jobs[j].row_bytes, 8u);
    EXPECT_EQ(jobs[j].count, counts[j]);
    EXPECT_EQ(jobs[j].src_offsets, plan.src_offsets.data() + 4 * j);
    EXPECT_EQ(jobs[j].dst_offsets, plan.dst_offsets.data() + 4 * j);
  }
  CompactionPlan empty;
  empty.AppendJobs(arena, 8, 4, jobs);
  EXPECT_EQ(jobs.size(), 3u);  // nothing to move: no job
}

}  // namespace
}  // namespace kvs
