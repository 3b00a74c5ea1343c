#include "cache/sequence.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "cache/block_allocator.h"
#include "cache/policy/policy.h"
#include "gmock/gmock.h"
#include "gpu/backend.h"
#include "gtest/gtest.h"
#include "tests/cache/cache_test_util.h"

namespace kvs {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing_util::BuildPayload;
using testing_util::HashValue;
using testing_util::MakeLayout;

// A sequence on a real CPU-backend arena with its own allocator.
class SequenceHarness {
 public:
  SequenceHarness(const ModelLayout& layout, int32_t num_blocks,
                  PolicyConfig policy = testing_util::KeyDiff(), BudgetConfig budget = {})
      : layout_(layout), backend_(testing_util::MakeTestBackend(1)), allocator_(num_blocks) {
    ArenaOptions options;
    options.name_prefix = "kvs-sequence-test";
    auto arena = backend_->CreateArena(num_blocks * layout.block_bytes(), options);
    EXPECT_TRUE(arena.ok()) << arena.status();
    arena_ = *std::move(arena);
    auto made = MakePolicy(policy);
    EXPECT_TRUE(made.ok()) << made.status();
    sequence_ =
        std::make_unique<Sequence>("seq", layout, *std::move(made), budget, absl::UnixEpoch());
  }

  SequenceEnv env() {
    return SequenceEnv{layout_, *arena_, allocator_, *backend_, "session-1", 1 << 20};
  }
  Sequence& seq() { return *sequence_; }
  BlockAllocator& allocator() { return allocator_; }

  // Writes `payload` in chunks of `chunk` bytes.
  absl::Status Write(uint64_t id, const std::vector<uint8_t>& payload, uint64_t chunk) {
    for (uint64_t offset = 0; offset < payload.size(); offset += chunk) {
      const uint64_t n = std::min<uint64_t>(chunk, payload.size() - offset);
      absl::Status status = sequence_->WriteReserved(
          env(), id, offset, absl::MakeConstSpan(payload.data() + offset, n));
      if (!status.ok()) return status;
    }
    return absl::OkStatus();
  }

  // Reads the whole export payload of `layers` in chunks of `chunk` bytes.
  std::vector<uint8_t> Export(absl::Span<const int32_t> layers, uint64_t chunk) {
    auto view = sequence_->GetLayout(env(), layers, false);
    EXPECT_TRUE(view.ok());
    uint64_t total = 0;
    for (const auto& l : view->layers)
      total += 2ull * layout_.num_kv_heads * l.count * layout_.row_bytes();
    std::vector<uint8_t> out(total);
    for (uint64_t offset = 0; offset < total; offset += chunk) {
      const uint64_t n = std::min<uint64_t>(chunk, total - offset);
      absl::Status status = sequence_->ReadExport(env(), layers, view->version, offset,
                                                  absl::MakeSpan(out.data() + offset, n));
      EXPECT_TRUE(status.ok()) << status;
    }
    return out;
  }

 private:
  ModelLayout layout_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Arena> arena_;
  BlockAllocator allocator_;
  std::unique_ptr<Sequence> sequence_;
};

std::vector<int32_t> Iota(int32_t from, int32_t n) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), from);
  return v;
}

TEST(SequenceTest, ReservationSlotsContinueInThePartialBlock) {
  const ModelLayout layout = MakeLayout(2, 2, 3, DType::kFloat32, 4);
  SequenceHarness h(layout, 16);
  auto r1 = h.seq().Reserve(h.env(), 11, 6, {}, {});
  ASSERT_TRUE(r1.ok()) << r1.status();
  EXPECT_EQ(r1->reservation_id, 11u);
  ASSERT_EQ(r1->layers.size(), 2u);
  EXPECT_EQ(r1->layers[0].layer, 0);
  EXPECT_EQ(r1->layers[0].first_slot, 0);
  EXPECT_EQ(r1->layers[0].blocks.size(), 2u);
  EXPECT_THAT(r1->positions, ElementsAre(0, 1, 2, 3, 4, 5));
  EXPECT_EQ(r1->payload_bytes, 2u * 2 * 2 * 6 * 3 * 4);
  EXPECT_EQ(r1->evicted_before, 0);
  EXPECT_EQ(h.allocator().used_blocks(), 4);
  ASSERT_TRUE(h.seq().Commit(h.env(), 11, false).ok());

  // Slots 6..8: the rest of block 1 (slots 6, 7), then a new block for slot 8.
  auto r2 = h.seq().Reserve(h.env(), 12, 3, {}, {});
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(r2->layers[1].first_slot, 6);
  ASSERT_EQ(r2->layers[1].blocks.size(), 2u);
  EXPECT_EQ(r2->layers[1].blocks[0], r1->layers[1].blocks[1]);
  EXPECT_EQ(h.allocator().used_blocks(), 6);
  EXPECT_THAT(r2->positions, ElementsAre(6, 7, 8));
  ASSERT_TRUE(h.seq().Commit(h.env(), 12, false).ok());
  auto view = h.seq().GetLayout(h.env(), {}, true);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->layers[1].count, 9);
  EXPECT_EQ(view->layers[1].block_table.size(), 3u);
  EXPECT_EQ(view->next_position, 9);
  EXPECT_EQ(view->tokens_appended, 9);
  EXPECT_EQ(view->layers[0].positions,
            (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4, 5, 6, 7, 8}));
}

// Inline payload in, export out, bit for bit, for every dtype, with head counts, head dims and
// block sizes that make rows and blocks misalign with the chunks.
TEST(SequenceTest, WriteAndExportRoundTripBitForBit) {
  for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
    for (uint64_t chunk : {1ull, 7ull, 13ull, 1000ull, 1ull << 20}) {
      SCOPED_TRACE(::testing::Message() << DTypeName(dtype) << " chunk " << chunk);
      const ModelLayout layout = MakeLayout(3, 3, 5, dtype, 3);
      SequenceHarness h(layout, 64);
      int32_t next = 0;
      uint64_t id = 1;
      for (int32_t tokens : {7, 4, 1, 5}) {
        auto r = h.seq().Reserve(h.env(), id, tokens, {}, {});
        ASSERT_TRUE(r.ok()) << r.status();
        const auto payload = BuildPayload(layout, {0, 1, 2}, Iota(next, tokens), HashValue);
        ASSERT_EQ(payload.size(), r->payload_bytes);
        ASSERT_TRUE(h.Write(id, payload, chunk).ok());
        ASSERT_TRUE(h.seq().Commit(h.env(), id, false).ok());
        next += tokens;
        ++id;
      }
      // Export in slot order equals a freshly built payload of positions 0..next-1.
      EXPECT_EQ(h.Export({}, chunk * 3 + 1),
                BuildPayload(layout, {0, 1, 2}, Iota(0, next), HashValue));
      EXPECT_EQ(h.Export({2, 0}, chunk + 5),
                BuildPayload(layout, {2, 0}, Iota(0, next), HashValue));
    }
  }
}

TEST(SequenceTest, LayerSubsetReservation) {
  const ModelLayout layout = MakeLayout(3, 1, 4, DType::kFloat16, 2);
  SequenceHarness h(layout, 16);
  auto r = h.seq().Reserve(h.env(), 1, 3, {}, {2, 0});
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->layers.size(), 2u);
  EXPECT_EQ(r->layers[0].layer, 2);
  EXPECT_EQ(r->layers[1].layer, 0);
  ASSERT_TRUE(h.Write(1, BuildPayload(layout, {2, 0}, {0, 1, 2}, HashValue), 9).ok());
  auto commit = h.seq().Commit(h.env(), 1, false);
  ASSERT_TRUE(commit.ok());
  EXPECT_THAT(commit->counts, ElementsAre(3, 0, 3));
  EXPECT_EQ(h.Export({0, 1, 2}, 64), BuildPayload(layout, {0, 2}, {0, 1, 2}, HashValue));
}

TEST(SequenceTest, ExplicitPositions) {
  const ModelLayout layout = MakeLayout(1, 1, 2, DType::kFloat32, 2);
  SequenceHarness h(layout, 8);
  auto r = h.seq().Reserve(h.env(), 1, 3, {10, 20, 25}, {});
  ASSERT_TRUE(r.ok());
  EXPECT_THAT(r->positions, ElementsAre(10, 20, 25));
  ASSERT_TRUE(h.seq().Commit(h.env(), 1, false).ok());
  auto view = h.seq().GetLayout(h.env(), {}, true);
  EXPECT_EQ(view->next_position, 26);
  EXPECT_EQ(view->tokens_appended, 3);
  EXPECT_THAT(view->layers[0].positions, ElementsAre(10, 20, 25));

  // Not above what is there, not increasing, wrong length.
  auto low = h.seq().Reserve(h.env(), 2, 1, {25}, {});
  EXPECT_EQ(low.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(low.status().message(), HasSubstr("positions[0]"));
  auto flat = h.seq().Reserve(h.env(), 2, 2, {30, 30}, {});
  EXPECT_EQ(flat.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(flat.status().message(), HasSubstr("positions[1]"));
  auto size = h.seq().Reserve(h.env(), 2, 2, {30}, {});
  EXPECT_EQ(size.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(size.status().message(), HasSubstr("num_tokens"));
  // Default positions continue after the highest.
  auto next = h.seq().Reserve(h.env(), 2, 1, {}, {});
  ASSERT_TRUE(next.ok());
  EXPECT_THAT(next->positions, ElementsAre(26));
}

TEST(SequenceTest, PositionsNearInt32MaxAreRefused) {
  const ModelLayout layout = MakeLayout(1, 1, 2, DType::kFloat32, 2);
  SequenceHarness h(layout, 8);
  ASSERT_TRUE(h.seq().Reserve(h.env(), 1, 1, {2147483646}, {}).ok());
  ASSERT_TRUE(h.seq().Commit(h.env(), 1, false).ok());
  auto r = h.seq().Reserve(h.env(), 2, 2, {}, {});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  auto one = h.seq().Reserve(h.env(), 3, 1, {}, {});
  ASSERT_TRUE(one.ok());
  EXPECT_THAT(one->positions, ElementsAre(2147483647));
}

TEST(SequenceTest, ReservationLifecycleErrors) {
  const ModelLayout layout = MakeLayout(2, 1, 2, DType::kFloat16, 2);
  SequenceHarness h(layout, 8);
  auto r = h.seq().Reserve(h.env(), 5, 3, {}, {});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(h.allocator().used_blocks(), 4);
  // One outstanding reservation.
  EXPECT_EQ(h.seq().Reserve(h.env(), 6, 1, {}, {}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Unknown id.
  EXPECT_EQ(h.seq().Commit(h.env(), 99, false).status().code(), absl::StatusCode::kNotFound);
  // Past the payload.
  std::vector<uint8_t> bytes(8);
  auto past = h.seq().WriteReserved(h.env(), 5, r->payload_bytes - 4, bytes);
  EXPECT_EQ(past.code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(h.seq().WriteReserved(h.env(), 5, ~0ull - 2, bytes).code(),
            absl::StatusCode::kOutOfRange);
  // Compress with a pending reservation.
  CompressParams compress;
  compress.budget_tokens = 1;
  EXPECT_EQ(h.seq().Compress(h.env(), compress).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Commit, then double commit / write / cancel after commit.
  ASSERT_TRUE(h.seq().Commit(h.env(), 5, false).ok());
  EXPECT_EQ(h.seq().Commit(h.env(), 5, false).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(h.seq().WriteReserved(h.env(), 5, 0, bytes).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(h.seq().Cancel(h.env(), 5).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(SequenceTest, CancelReturnsOnlyTheNewBlocks) {
  const ModelLayout layout = MakeLayout(1, 1, 2, DType::kFloat16, 4);
  SequenceHarness h(layout, 8);
  ASSERT_TRUE(h.seq().Reserve(h.env(), 1, 3, {}, {}).ok());
  ASSERT_TRUE(h.seq().Commit(h.env(), 1, false).ok());
  const uint64_t version = h.seq().GetLayout(h.env(), {}, false)->version;
  auto r = h.seq().Reserve(h.env(), 2, 6, {}, {});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(h.allocator().used_blocks(), 3);  // slots 3..8: block 0 + two new
  ASSERT_TRUE(h.seq().Cancel(h.env(), 2).ok());
  EXPECT_EQ(h.allocator().used_blocks(), 1);
  EXPECT_EQ(h.seq().Cancel(h.env(), 2).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(h.seq().Commit(h.env(), 2, false).status().code(),
            absl::StatusCode::kFailedPrecondition);
  auto view = h.seq().GetLayout(h.env(), {}, true);
  EXPECT_EQ(view->layers[0].count, 3);
  EXPECT_EQ(view->next_position, 3);  // the cancelled positions are not consumed
  EXPECT_NE(view->version, version);
  auto again = h.seq().Reserve(h.env(), 3, 1, {}, {});
  ASSERT_TRUE(again.ok());
  EXPECT_THAT(again->positions, ElementsAre(3));
  EXPECT_EQ(again->layers[0].first_slot, 3);
}

TEST(SequenceTest, ArenaTooSmallChangesNothing) {
  const ModelLayout layout = MakeLayout(2, 1, 2, DType::kFloat16, 2);
  SequenceHarness h(layout, 5);
  ASSERT_TRUE(h.seq().Reserve(h.env(), 1, 3, {}, {}).ok());  // 2 blocks per layer
  ASSERT_TRUE(h.seq().Commit(h.env(), 1, false).ok());
  const auto before = h.seq().GetLayout(h.env(), {}, true);
  // Slot 3 fits in block 1; slots 4..5 need a new block per layer: 2 needed, 1 free.
  auto r = h.seq().Reserve(h.env(), 2, 3, {}, {});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(),
              HasSubstr("arena of session session-1 has 1 free blocks, reservation needs 2"));
  const auto after = h.seq().GetLayout(h.env(), {}, true);
  EXPECT_EQ(after->version, before->version);
  EXPECT_EQ(h.allocator().free_blocks(), 1);
  EXPECT_FALSE(h.seq().has_pending());
  // One layer only fits.
  EXPECT_TRUE(h.seq().Reserve(h.env(), 3, 3, {}, {1}).ok());
}

TEST(SequenceTest, ExportChecksVersionAndRange) {
  const ModelLayout layout = MakeLayout(1, 1, 2, DType::kFloat32, 2);
  SequenceHarness h(layout, 8);
  ASSERT_TRUE(h.seq().Reserve(h.env(), 1, 3, {}, {}).ok());
  ASSERT_TRUE(h.seq().Commit(h.env(), 1, false).ok());
  const uint64_t version = h.seq().GetLayout(h.env(), {}, false)->version;
  std::vector<uint8_t> out(2 * 3 * 8);
  EXPECT_TRUE(h.seq().ReadExport(h.env(), {}, version, 0, absl::MakeSpan(out)).ok());
  EXPECT_EQ(h.seq().ReadExport(h.env(), {}, version, 1, absl::MakeSpan(out)).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(h.seq().ReadExport(h.env(), {}, version + 1, 0, absl::MakeSpan(out)).code(),
            absl::StatusCode::kAborted);
  EXPECT_EQ(h.seq().ReadExport(h.env(), {1}, version, 0, absl::MakeSpan(out)).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(h.seq().Reserve(h.env(), 2, 1, {}, {}).ok());
  ASSERT_TRUE(h.seq().Commit(h.env(), 2, false).ok());
  EXPECT_EQ(h.seq().ReadExport(h.env(), {}, version, 0, absl::MakeSpan(out)).code(),
            absl::StatusCode::kAborted);
}

TEST(SequenceTest, CompressFreesTailBlocks) {
  const ModelLayout layout = MakeLayout(2, 2, 4, DType::kBFloat16, 2);
  SequenceHarness h(layout, 32, testing_util::StreamingLlm(1));
  auto r = h.seq().Reserve(h.env(), 1, 9, {}, {});
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(h.Write(1, BuildPayload(layout, {0, 1}, Iota(0, 9), HashValue), 11).ok());
  ASSERT_TRUE(h.seq().Commit(h.env(), 1, false).ok());
  EXPECT_EQ(h.allocator().used_blocks(), 10);
  CompressParams params;
  params.budget_tokens = 3;
  params.return_positions = true;
  auto result = h.seq().Compress(h.env(), params);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->blocks_freed, 6);  // 5 -> 2 blocks per layer
  EXPECT_EQ(h.allocator().used_blocks(), 4);
  ASSERT_EQ(result->layers.size(), 2u);
  EXPECT_EQ(result->layers[1].kept, 3);
  EXPECT_EQ(result->layers[1].evicted, 6);
  // Sink 0 stays in slot 0; 7 and 8 fill holes 1 and 2.
  EXPECT_THAT(result->layers[1].positions, ElementsAre(0, 7, 8, 0, 7, 8));
  // Values moved with their tokens: the export equals a payload of positions 0, 7, 8.
  EXPECT_EQ(h.Export({}, 100), BuildPayload(layout, {0, 1}, {0, 7, 8}, HashValue));
  // Release returns everything.
  EXPECT_EQ(h.seq().Release(h.env()), 4);
  EXPECT_EQ(h.allocator().used_blocks(), 0);
}

TEST(SequenceTest, ReleaseReturnsPendingBlocks) {
  const ModelLayout layout = MakeLayout(2, 1, 2, DType::kFloat16, 2);
  SequenceHarness h(layout, 16);
  ASSERT_TRUE(h.seq().Reserve(h.env(), 1, 3, {}, {}).ok());
  ASSERT_TRUE(h.seq().Commit(h.env(), 1, false).ok());
  ASSERT_TRUE(h.seq().Reserve(h.env(), 2, 4, {}, {}).ok());
  EXPECT_EQ(h.allocator().used_blocks(), 8);
  EXPECT_EQ(h.seq().blocks_held(), 8);
  EXPECT_EQ(h.seq().Release(h.env()), 8);
  EXPECT_EQ(h.allocator().used_blocks(), 0);
  EXPECT_FALSE(h.seq().has_pending());
}

TEST(SequenceTest, ResolveLayers) {
  EXPECT_THAT(*ResolveLayers({}, 3), ElementsAre(0, 1, 2));
  EXPECT_THAT(*ResolveLayers({2, 0}, 3), ElementsAre(2, 0));
  auto range = ResolveLayers({0, 3}, 3);
  EXPECT_EQ(range.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(range.status().message(), HasSubstr("layers[1] must be in [0, 3), got 3"));
  auto dup = ResolveLayers({1, 1}, 3);
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(dup.status().message(), HasSubstr("layers[1]"));
  EXPECT_EQ(ResolveLayers({-1}, 3).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvs
