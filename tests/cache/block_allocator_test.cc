#include "cache/block_allocator.h"

#include <algorithm>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvs {
namespace {

using ::testing::ElementsAre;
using ::testing::UnorderedElementsAre;

TEST(BlockAllocatorTest, FreshAllocatorHandsOutLowIdsFirst) {
  BlockAllocator allocator(5);
  EXPECT_EQ(allocator.num_blocks(), 5);
  EXPECT_EQ(allocator.free_blocks(), 5);
  std::vector<int32_t> ids = {42};  // Allocate appends
  ASSERT_TRUE(allocator.Allocate(3, &ids).ok());
  EXPECT_THAT(ids, ElementsAre(42, 0, 1, 2));
  EXPECT_EQ(allocator.free_blocks(), 2);
  EXPECT_EQ(allocator.used_blocks(), 3);
  EXPECT_TRUE(allocator.IsUsed(1));
  EXPECT_FALSE(allocator.IsUsed(3));
}

TEST(BlockAllocatorTest, AllocateIsAllOrNothing) {
  BlockAllocator allocator(4);
  std::vector<int32_t> ids;
  ASSERT_TRUE(allocator.Allocate(3, &ids).ok());
  std::vector<int32_t> more = {7};
  const absl::Status status = allocator.Allocate(2, &more);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(more, ElementsAre(7));
  EXPECT_EQ(allocator.free_blocks(), 1);
  ASSERT_TRUE(allocator.Allocate(1, &more).ok());
  EXPECT_THAT(more, ElementsAre(7, 3));
  EXPECT_EQ(allocator.free_blocks(), 0);
}

TEST(BlockAllocatorTest, ZeroAndNegativeCounts) {
  BlockAllocator allocator(2);
  std::vector<int32_t> ids;
  EXPECT_TRUE(allocator.Allocate(0, &ids).ok());
  EXPECT_TRUE(ids.empty());
  EXPECT_EQ(allocator.Allocate(-1, &ids).code(), absl::StatusCode::kInvalidArgument);
  BlockAllocator empty(-3);
  EXPECT_EQ(empty.num_blocks(), 0);
  EXPECT_EQ(empty.Allocate(1, &ids).code(), absl::StatusCode::kResourceExhausted);
}

TEST(BlockAllocatorTest, FreedBlocksAreReused) {
  BlockAllocator allocator(3);
  std::vector<int32_t> ids;
  ASSERT_TRUE(allocator.Allocate(3, &ids).ok());
  ASSERT_TRUE(allocator.Free({ids[0], ids[2]}).ok());
  EXPECT_EQ(allocator.free_blocks(), 2);
  std::vector<int32_t> again;
  ASSERT_TRUE(allocator.Allocate(2, &again).ok());
  EXPECT_THAT(again, UnorderedElementsAre(0, 2));
}

TEST(BlockAllocatorTest, DoubleFreeIsInternalAndFreesNothing) {
  BlockAllocator allocator(4);
  std::vector<int32_t> ids;
  ASSERT_TRUE(allocator.Allocate(3, &ids).ok());
  ASSERT_TRUE(allocator.Free({1}).ok());
  // 0 is valid, 1 is already free: nothing may be freed, 0 stays in use.
  absl::Status status = allocator.Free({0, 1});
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(status.message(), ::testing::HasSubstr("double free of block 1"));
  EXPECT_TRUE(allocator.IsUsed(0));
  EXPECT_EQ(allocator.free_blocks(), 2);
}

TEST(BlockAllocatorTest, DuplicateInOneCallIsDetected) {
  BlockAllocator allocator(4);
  std::vector<int32_t> ids;
  ASSERT_TRUE(allocator.Allocate(2, &ids).ok());
  EXPECT_EQ(allocator.Free({0, 1, 0}).code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(allocator.IsUsed(0));
  EXPECT_TRUE(allocator.IsUsed(1));
  EXPECT_EQ(allocator.free_blocks(), 2);
  EXPECT_TRUE(allocator.Free({0, 1}).ok());
  EXPECT_EQ(allocator.free_blocks(), 4);
}

TEST(BlockAllocatorTest, OutOfRangeFreeIsInternal) {
  BlockAllocator allocator(2);
  std::vector<int32_t> ids;
  ASSERT_TRUE(allocator.Allocate(2, &ids).ok());
  EXPECT_EQ(allocator.Free({2}).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(allocator.Free({-1}).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(allocator.free_blocks(), 0);
}

TEST(BlockAllocatorTest, ManyCyclesKeepAccounting) {
  BlockAllocator allocator(64);
  std::vector<std::vector<int32_t>> held;
  for (int round = 0; round < 200; ++round) {
    std::vector<int32_t> ids;
    const int32_t n = 1 + round % 7;
    if (allocator.Allocate(n, &ids).ok()) {
      held.push_back(ids);
    } else {
      ASSERT_TRUE(allocator.Free(held.front()).ok());
      held.erase(held.begin());
    }
    int32_t used = 0;
    for (const auto& h : held) used += static_cast<int32_t>(h.size());
    ASSERT_EQ(allocator.used_blocks(), used);
  }
  std::vector<int32_t> all;
  for (const auto& h : held) all.insert(all.end(), h.begin(), h.end());
  std::sort(all.begin(), all.end());
  EXPECT_EQ(std::adjacent_find(all.begin(), all.end()), all.end());
  for (const auto& h : held) ASSERT_TRUE(allocator.Free(h).ok());
  EXPECT_EQ(allocator.free_blocks(), 64);
}

}  // namespace
}  // namespace kvs
