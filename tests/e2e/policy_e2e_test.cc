// End-to-end tests of the issue-3 plumbing against the real kvsidecar binary: a decode loop of
// DecodeStep items with inline K/V under a KeyDiff budget, Score as a dry run of Compress, and
// a DecodeStep batch with a bad item that changes nothing. Per-policy conformance lives in
// conformance_test.cc.
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvsidecar/client.h"
#include "tests/e2e/e2e_util.h"

namespace kvs_e2e {
namespace {

using ::testing::HasSubstr;

class PolicyE2eTest : public SharedServerTest<PolicyE2eTest> {
 protected:
  void SetUp() override {
    auto client = server_->Connect();
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
    // 3 layers, 2 kv heads, 4 q heads, head_dim 16, fp16, blocks of 4 tokens.
    layout_ = MakeLayout(3, 2, 4, 16, v1::DTYPE_FLOAT16, 4);
    auto session = client_->Attach(layout_);
    ASSERT_TRUE(session.ok()) << session.status();
    session_ = std::move(*session);
  }

  // The inline K/V of the token at `position`: [L][2][H][1][D] PatternRow values.
  std::string DecodeKv(uint64_t seed, int position) const {
    return PatternPayload(layout_, seed, {}, {position});
  }

  v1::ModelLayout layout_;
  std::unique_ptr<kvsidecar::Client> client_;
  std::unique_ptr<kvsidecar::Session> session_;
};

constexpr uint64_t kSeed = 77;

TEST_F(PolicyE2eTest, KeyDiffDecodeLoopKeepsEveryLayerAtBudget) {
  constexpr int kBudget = 12;
  ASSERT_TRUE(session_->CreateSequence(KeyDiffPolicy(), MakeBudget(kBudget), "dec").ok());
  ASSERT_TRUE(WriteTokens(*session_, "dec", 20, kSeed, /*compress_if_over_budget=*/true).ok());
  auto layout = session_->GetLayout("dec");
  ASSERT_TRUE(layout.ok()) << layout.status();
  for (const v1::LayerLayout& layer : layout->layers()) ASSERT_EQ(layer.count(), kBudget);

  for (int step = 0; step < 10; ++step) {
    const int position = 20 + step;
    v1::DecodeStepRequest request;
    v1::DecodeStepRequest::Item* item = request.add_items();
    item->set_sequence_id("dec");
    item->set_inline_kv(DecodeKv(kSeed, position));
    auto response = session_->DecodeStep(request);
    ASSERT_TRUE(response.ok()) << response.status();
    ASSERT_EQ(response->items_size(), 1);
    const v1::DecodeStepResponse::Item& result = response->items(0);
    EXPECT_EQ(result.position(), position);
    EXPECT_THAT(result.counts(), ::testing::Each(kBudget)) << "step " << step;
    ASSERT_EQ(result.evicted_positions_size(), layout_.num_layers() * layout_.num_kv_heads());
    for (int32_t evicted : result.evicted_positions()) {
      EXPECT_GE(evicted, 0);
      EXPECT_LE(evicted, position);
    }
  }
  // Every kept row is still the bytes written for its position (prefill and decode tokens alike).
  auto verified = VerifySequence(*session_, "dec", kSeed);
  ASSERT_TRUE(verified.ok()) << verified.status();
  EXPECT_THAT(verified->counts, ::testing::Each(kBudget));
  layout = session_->GetLayout("dec", {}, /*omit_positions=*/true);
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(layout->next_position(), 30);
}

TEST_F(PolicyE2eTest, ScoreIsADryRunOfTheNextCompress) {
  ASSERT_TRUE(session_->CreateSequence(KeyDiffPolicy(), MakeBudget(10), "score").ok());
  ASSERT_TRUE(WriteTokens(*session_, "score", 27, kSeed).ok());
  auto before = session_->GetLayout("score");
  ASSERT_TRUE(before.ok()) << before.status();

  v1::ScoreRequest score;
  score.set_sequence_id("score");
  auto scored = session_->Score(score);
  ASSERT_TRUE(scored.ok()) << scored.status();
  auto after = session_->GetLayout("score");
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->SerializeAsString(), before->SerializeAsString()) << "Score changed the layout";

  const int heads = layout_.num_kv_heads();
  ASSERT_EQ(scored->layers_size(), layout_.num_layers());
  std::vector<std::set<int>> would_keep;  // [layer * heads + head]
  for (const auto& layer : scored->layers()) {
    const int count = before->layers(layer.layer()).count();
    ASSERT_EQ(count, 27);
    EXPECT_EQ(layer.kept(), 10);
    ASSERT_EQ(layer.scores_size(), heads * count);
    ASSERT_EQ(layer.positions_size(), heads * count);
    ASSERT_EQ(layer.kept_slots_size(), heads * layer.kept());
    for (int h = 0; h < heads; ++h) {
      std::set<int> kept;
      for (int i = 0; i < layer.kept(); ++i) {
        kept.insert(layer.positions(h * count + layer.kept_slots(h * layer.kept() + i)));
      }
      would_keep.push_back(kept);
    }
  }

  kvsidecar::CompressOptions options;
  options.return_positions = true;
  auto compressed = session_->Compress("score", options);
  ASSERT_TRUE(compressed.ok()) << compressed.status();
  ASSERT_EQ(compressed->layers_size(), layout_.num_layers());
  for (int l = 0; l < layout_.num_layers(); ++l) {
    const auto& layer = compressed->layers(l);
    ASSERT_EQ(layer.kept(), 10);
    for (int h = 0; h < heads; ++h) {
      std::set<int> kept(layer.positions().begin() + h * 10,
                         layer.positions().begin() + (h + 1) * 10);
      EXPECT_EQ(kept, would_keep[l * heads + h]) << "layer " << l << " head " << h;
    }
  }
  auto verified = VerifySequence(*session_, "score", kSeed);
  ASSERT_TRUE(verified.ok()) << verified.status();
}

TEST_F(PolicyE2eTest, BadDecodeStepItemChangesNothing) {
  for (const char* id : {"x", "y"}) {
    ASSERT_TRUE(session_->CreateSequence(KeyDiffPolicy(), MakeBudget(8), id).ok());
    ASSERT_TRUE(WriteTokens(*session_, id, 8, kSeed).ok());
  }
  auto before_x = session_->GetLayout("x");
  auto before_y = session_->GetLayout("y");
  ASSERT_TRUE(before_x.ok() && before_y.ok());

  v1::DecodeStepRequest request;
  v1::DecodeStepRequest::Item* good = request.add_items();
  good->set_sequence_id("x");
  good->set_inline_kv(DecodeKv(kSeed, 8));
  v1::DecodeStepRequest::Item* bad = request.add_items();
  bad->set_sequence_id("y");
  bad->set_inline_kv(DecodeKv(kSeed, 8).substr(1));  // one byte short
  absl::Status status = session_->DecodeStep(request).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(MessageOf(status), HasSubstr("items[1].inline_kv"));

  // An unknown sequence in item 1: refused before item 0 is touched.
  bad->set_inline_kv(DecodeKv(kSeed, 8));
  bad->set_sequence_id("ghost");
  status = session_->DecodeStep(request).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  EXPECT_THAT(MessageOf(status), HasSubstr("items[1]"));

  auto after_x = session_->GetLayout("x");
  auto after_y = session_->GetLayout("y");
  ASSERT_TRUE(after_x.ok() && after_y.ok());
  EXPECT_EQ(after_x->SerializeAsString(), before_x->SerializeAsString());
  EXPECT_EQ(after_y->SerializeAsString(), before_y->SerializeAsString());
  auto verified = VerifySequence(*session_, "x", kSeed);
  ASSERT_TRUE(verified.ok()) << verified.status();
  EXPECT_EQ(verified->counts, std::vector<int>(layout_.num_layers(), 8));
}

// return_layout: the item's answer carries the layout GetLayout gives right after the step
// (counts, block tables as compaction left them); an item that does not ask gets none.
TEST_F(PolicyE2eTest, DecodeStepAnswersWithTheLayoutAnItemAsksFor) {
  constexpr int kBudget = 12;
  for (const char* id : {"with", "without"}) {
    ASSERT_TRUE(session_->CreateSequence(KeyDiffPolicy(), MakeBudget(kBudget), id).ok());
    ASSERT_TRUE(WriteTokens(*session_, id, 20, kSeed, /*compress_if_over_budget=*/true).ok());
  }
  for (int step = 0; step < 6; ++step) {
    const int position = 20 + step;
    v1::DecodeStepRequest request;
    v1::DecodeStepRequest::Item* asking = request.add_items();
    asking->set_sequence_id("with");
    asking->set_inline_kv(DecodeKv(kSeed, position));
    asking->set_return_layout(true);
    v1::DecodeStepRequest::Item* silent = request.add_items();
    silent->set_sequence_id("without");
    silent->set_inline_kv(DecodeKv(kSeed, position));
    auto response = session_->DecodeStep(request);
    ASSERT_TRUE(response.ok()) << response.status();
    ASSERT_EQ(response->items_size(), 2);
    EXPECT_EQ(response->items(1).layers_size(), 0);
    auto layout = session_->GetLayout("with", {}, /*omit_positions=*/true);
    ASSERT_TRUE(layout.ok()) << layout.status();
    ASSERT_EQ(response->items(0).layers_size(), layout_.num_layers()) << "step " << step;
    for (int l = 0; l < layout_.num_layers(); ++l) {
      EXPECT_EQ(response->items(0).layers(l).SerializeAsString(),
                layout->layers(l).SerializeAsString())
          << "step " << step << " layer " << l;
      EXPECT_EQ(response->items(0).layers(l).count(), kBudget);
    }
  }
  ASSERT_TRUE(VerifySequence(*session_, "with", kSeed).ok());
}

// Layouts that could exceed the message limit are refused before the step changes anything:
// 8192 items of a 1024-layer session would answer with some 8192 x 1024 layer entries.
TEST_F(PolicyE2eTest, DecodeStepRefusesLayoutsBeyondTheMessageLimit) {
  const v1::ModelLayout wide = MakeLayout(1024, 1, 1, 8, v1::DTYPE_FLOAT16, 4);
  auto session = client_->Attach(wide, "default", /*num_blocks=*/2048);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE((*session)->CreateSequence(KeyDiffPolicy(), MakeBudget(4), "s0").ok());
  ASSERT_TRUE(WriteTokens(**session, "s0", 2, kSeed).ok());
  auto before = (*session)->GetLayout("s0");
  ASSERT_TRUE(before.ok()) << before.status();
  v1::DecodeStepRequest request;
  for (int i = 0; i < 8192; ++i) {
    v1::DecodeStepRequest::Item* item = request.add_items();
    item->set_sequence_id("s" + std::to_string(i));
    item->set_return_layout(true);
  }
  request.mutable_items(0)->set_inline_kv(PatternPayload(wide, kSeed, {}, {2}));
  absl::Status status = (*session)->DecodeStep(request).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_THAT(MessageOf(status), HasSubstr("return_layout"));
  auto after = (*session)->GetLayout("s0");
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->SerializeAsString(), before->SerializeAsString());
}

TEST_F(PolicyE2eTest, CommitCarriesAttention) {
  ASSERT_TRUE(session_->CreateSequence(KeyDiffPolicy(), MakeBudget(6), "att").ok());
  auto reservation = session_->Reserve("att", 9);
  ASSERT_TRUE(reservation.ok()) << reservation.status();
  ASSERT_TRUE(WritePattern(*session_, *reservation, kSeed).ok());
  v1::CommitRequest commit;
  commit.set_sequence_id("att");
  commit.set_reservation_id(reservation->id());
  commit.set_compress_if_over_budget(true);
  v1::AttentionInputs* attention = commit.mutable_attention();
  attention->set_num_queries(1);
  attention->set_softmax_scale(0.25f);
  // [L][Hq][1][D] fp16 = 3 * 4 * 16 * 2 bytes; one short first.
  attention->set_inline_queries(std::string(3 * 4 * 16 * 2 - 1, '\0'));
  absl::Status status = session_->Commit(commit).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(MessageOf(status), HasSubstr("attention.inline_queries has 383 bytes, expected 384"));
  attention->set_inline_queries(std::string(3 * 4 * 16 * 2, '\0'));
  auto committed = session_->Commit(commit);  // keydiff ignores the attention
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_THAT(committed->counts(), ::testing::Each(6));
  EXPECT_EQ(committed->evicted(), 3);
}

}  // namespace
}  // namespace kvs_e2e
