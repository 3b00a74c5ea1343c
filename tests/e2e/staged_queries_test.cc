// End to end: queries in the session's staging area (AttachRequest.staging_bytes,
// AttentionInputs.staging_offset). A worker writes a step's fp32 queries through its mapping of
// the arena and names them by offset, so that the request carries no tensor; the step is the
// one the same queries inline give, for a decode step and for a compress, on the CPU backend
// and (the /device_sim run) on the simulated device, whose decode step reads them on the device.
// Queries outside the area, misaligned or not finite are refused naming the field, and the
// sequence keeps what it held.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvsidecar/client.h"
#include "tests/e2e/e2e_util.h"

namespace kvs_e2e {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kSeed = 17;
constexpr int kBudget = 12;
constexpr uint64_t kStagingBytes = 64 << 10;

class StagedQueriesTest : public SharedServerTest<StagedQueriesTest> {
 protected:
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    auto client = server_->Connect();
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
    // 3 layers, 2 kv heads of 4 query heads each, head_dim 16, fp16, blocks of 4 tokens.
    layout_ = MakeLayout(3, 2, 8, 16, v1::DTYPE_FLOAT16, 4);
    inline_ = Attach(0);
    staged_ = Attach(kStagingBytes);
    ASSERT_NE(inline_, nullptr);
    ASSERT_NE(staged_, nullptr);
    for (kvsidecar::Session* session : {inline_.get(), staged_.get()}) {
      v1::PolicySpec policy;
      policy.set_name("h2o");
      ASSERT_TRUE(session->CreateSequence(policy, MakeBudget(kBudget), "seq").ok());
      ASSERT_TRUE(WriteTokens(*session, "seq", kBudget, kSeed).ok());
    }
  }

  std::unique_ptr<kvsidecar::Session> Attach(uint64_t staging_bytes) {
    v1::AttachRequest request;
    *request.mutable_layout() = layout_;
    request.set_num_blocks(256);
    request.set_staging_bytes(staging_bytes);
    auto session = client_->Attach(request);
    EXPECT_TRUE(session.ok()) << session.status();
    return session.ok() ? std::move(*session) : nullptr;
  }

  // [L][Hq][w][D] fp32 queries of step `step`.
  std::vector<float> Queries(int step, int w) const {
    std::vector<float> q(static_cast<size_t>(layout_.num_layers()) * layout_.num_q_heads() * w *
                         layout_.head_dim());
    for (size_t i = 0; i < q.size(); ++i) q[i] = 0.5f * std::sin(0.37f * (i + 1) + step);
    return q;
  }

  v1::AttentionInputs Inline(const std::vector<float>& q, int w) const {
    v1::AttentionInputs attention;
    attention.set_num_queries(w);
    attention.set_softmax_scale(0.25f);
    attention.set_queries_dtype(v1::DTYPE_FLOAT32);
    attention.set_inline_queries(
        std::string(reinterpret_cast<const char*>(q.data()), q.size() * sizeof(float)));
    return attention;
  }

  // The queries written into the staged session's area at `offset`, named by offset.
  v1::AttentionInputs Staged(const std::vector<float>& q, int w, uint64_t offset) const {
    auto area = staged_->geometry().Staging(offset, q.size() * sizeof(float));
    EXPECT_TRUE(area.ok()) << area.status();
    if (area.ok()) std::memcpy(*area, q.data(), q.size() * sizeof(float));
    v1::AttentionInputs attention;
    attention.set_num_queries(w);
    attention.set_softmax_scale(0.25f);
    attention.set_staging_offset(offset);
    return attention;
  }

  absl::StatusOr<v1::DecodeStepResponse> Decode(kvsidecar::Session& session, int position,
                                                v1::AttentionInputs attention) {
    v1::DecodeStepRequest request;
    v1::DecodeStepRequest::Item* item = request.add_items();
    item->set_sequence_id("seq");
    item->set_inline_kv(PatternPayload(layout_, kSeed, {}, {position}));
    *item->mutable_attention() = std::move(attention);
    return session.DecodeStep(std::move(request));
  }

  std::vector<std::vector<std::vector<int>>> Kept(kvsidecar::Session& session) {
    auto verified = VerifySequence(session, "seq", kSeed);
    EXPECT_TRUE(verified.ok()) << verified.status();
    return verified.ok() ? verified->positions : std::vector<std::vector<std::vector<int>>>();
  }

  std::unique_ptr<kvsidecar::Client> client_;
  v1::ModelLayout layout_;
  std::unique_ptr<kvsidecar::Session> inline_;
  std::unique_ptr<kvsidecar::Session> staged_;
};

TEST_F(StagedQueriesTest, AttachReportsTheStagingAreaAfterTheBlocks) {
  const v1::ArenaHandle& arena = staged_->arena();
  EXPECT_EQ(arena.staging_bytes(), kStagingBytes);
  EXPECT_GE(arena.staging_offset(),
            static_cast<uint64_t>(arena.num_blocks()) * arena.block_bytes());
  EXPECT_EQ(arena.staging_offset() % 256, 0u);
  EXPECT_GE(arena.size_bytes(), arena.staging_offset() + kStagingBytes);
  EXPECT_EQ(inline_->arena().staging_bytes(), 0u);
}

TEST_F(StagedQueriesTest, DecodeStepsOnStagedQueriesEqualTheInlineOnes) {
  for (int step = 0; step < 8; ++step) {
    const std::vector<float> q = Queries(step, 1);
    auto with_inline = Decode(*inline_, kBudget + step, Inline(q, 1));
    // Alternating offsets: the area is the worker's to lay out.
    auto with_staged = Decode(*staged_, kBudget + step, Staged(q, 1, (step % 2) * 4096));
    ASSERT_TRUE(with_inline.ok()) << with_inline.status();
    ASSERT_TRUE(with_staged.ok()) << with_staged.status();
    EXPECT_EQ(with_staged->items(0).evicted_positions_size(),
              with_inline->items(0).evicted_positions_size());
    for (int i = 0; i < with_inline->items(0).evicted_positions_size(); ++i) {
      EXPECT_EQ(with_staged->items(0).evicted_positions(i),
                with_inline->items(0).evicted_positions(i))
          << "step " << step << " entry " << i;
    }
  }
  EXPECT_EQ(Kept(*staged_), Kept(*inline_));
}

TEST_F(StagedQueriesTest, ACompressOnStagedQueriesEqualsTheInlineOne) {
  // 6 more tokens, then a window of 4 staged queries compresses to 8 per layer.
  for (kvsidecar::Session* session : {inline_.get(), staged_.get()}) {
    ASSERT_TRUE(WriteTokens(*session, "seq", 6, kSeed).ok());
  }
  const std::vector<float> q = Queries(3, 4);
  v1::CompressRequest request;
  request.set_sequence_id("seq");
  request.set_budget_tokens(8);
  *request.mutable_attention() = Inline(q, 4);
  ASSERT_TRUE(inline_->Compress(request).ok());
  *request.mutable_attention() = Staged(q, 4, 512);
  auto staged = staged_->Compress(request);
  ASSERT_TRUE(staged.ok()) << staged.status();
  EXPECT_EQ(Kept(*staged_), Kept(*inline_));
}

TEST_F(StagedQueriesTest, QueriesOutsideTheAreaOrNotFiniteAreRefusedAndChangeNothing) {
  const auto before = Kept(*staged_);
  std::vector<float> q = Queries(0, 1);
  // Past the end, misaligned, in a session without an area.
  for (uint64_t offset : {kStagingBytes - 4, uint64_t{2}}) {
    v1::AttentionInputs attention;
    attention.set_num_queries(1);
    attention.set_softmax_scale(0.25f);
    attention.set_staging_offset(offset);
    auto refused = Decode(*staged_, kBudget, attention);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
    EXPECT_THAT(MessageOf(refused.status()), HasSubstr("attention.staging_offset"));
  }
  v1::AttentionInputs none;
  none.set_num_queries(1);
  none.set_softmax_scale(0.25f);
  none.set_staging_offset(0);
  auto no_area = Decode(*inline_, kBudget, none);
  EXPECT_THAT(MessageOf(no_area.status()), HasSubstr("has no query staging area"));
  // A NaN in layer 1's queries: the device finds it, the host names it.
  q[static_cast<size_t>(layout_.num_q_heads()) * layout_.head_dim() + 5] = std::nanf("");
  auto bad = Decode(*staged_, kBudget, Staged(q, 1, 0));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_THAT(MessageOf(bad.status()),
              HasSubstr("attention.staging_offset: non-finite value at layer 1"));
  EXPECT_EQ(Kept(*staged_), before);
  // The sequence goes on as if nothing had been sent.
  auto good = Decode(*staged_, kBudget, Staged(Queries(0, 1), 1, 0));
  EXPECT_TRUE(good.ok()) << good.status();
}

}  // namespace
}  // namespace kvs_e2e
