// StreamingLLM through the real pool: keydiff.md §12 TV6 sink rows, hand-worked cases, and the
// rule that sinks and recency go by position, not by slot.
#include "cache/policy/streaming_llm.h"

#include <vector>

#include "cache/policy/policy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cache/cache_test_util.h"

namespace kvs {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing_util::Append;
using testing_util::Budget;
using testing_util::ContentsMatch;
using testing_util::HashValue;
using testing_util::HeadPositions;
using testing_util::KeyDiff;
using testing_util::MakeLayout;
using testing_util::RunBlocks;
using testing_util::StreamingLlm;
using testing_util::TestPool;

TEST(StreamingLlmTest, Tv6OneSink) {
  const ModelLayout layout = MakeLayout(1, 1, 2, DType::kFloat32, 2);
  TestPool pool;
  const std::string session = pool.Attach(layout, 32);
  const auto run = RunBlocks(pool, session, layout, StreamingLlm(1), HashValue, 3, 2, {2, 2, 2, 2});
  ASSERT_EQ(run.kept.size(), 4u);
  EXPECT_THAT(run.kept[0], ElementsAre(0, 1));
  EXPECT_THAT(run.kept[1], ElementsAre(0, 2, 3));
  EXPECT_THAT(run.kept[2], ElementsAre(0, 4, 5));
  EXPECT_THAT(run.kept[3], ElementsAre(0, 6, 7));
  EXPECT_EQ(run.peak, 5);
}

TEST(StreamingLlmTest, Tv6DefaultFourSinks) {
  // T = 20, N = 8, N_b = 4, n_sink at the default 4.
  const ModelLayout layout = MakeLayout(1, 1, 2, DType::kFloat32, 4);
  TestPool pool;
  const std::string session = pool.Attach(layout, 32);
  const auto run =
      RunBlocks(pool, session, layout, StreamingLlm(kDefaultStreamingLlmSinks), HashValue, 8, 4,
                {4, 4, 4, 4, 4});
  ASSERT_EQ(run.kept.size(), 5u);
  EXPECT_THAT(run.kept[1], ElementsAre(0, 1, 2, 3, 4, 5, 6, 7));
  EXPECT_THAT(run.kept[2], ElementsAre(0, 1, 2, 3, 8, 9, 10, 11));
  EXPECT_THAT(run.kept[4], ElementsAre(0, 1, 2, 3, 16, 17, 18, 19));
  EXPECT_EQ(run.peak, 12);
}

class StreamingLlmPoolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    layout_ = MakeLayout(2, 3, 4, DType::kFloat16, 4);
    session_ = pool_.Attach(layout_, 64);
  }
  std::vector<int32_t> Compress(const std::string& seq, int32_t budget,
                                std::optional<PolicyConfig> policy = std::nullopt) {
    CompressParams params;
    params.budget_tokens = budget;
    params.policy = policy;
    auto result = pool_.pool.Compress(session_, seq, params);
    EXPECT_TRUE(result.ok()) << result.status();
    auto view = pool_.pool.GetLayout(session_, seq, {}, true);
    // Every head of every layer chooses the same positions (no scores involved).
    for (const auto& layer : view->layers) {
      for (int h = 1; h < layout_.num_kv_heads; ++h) {
        EXPECT_EQ(HeadPositions(layer, h), HeadPositions(view->layers[0], 0));
      }
    }
    EXPECT_TRUE(ContentsMatch(pool_.pool, session_, seq, layout_, HashValue));
    return HeadPositions(view->layers[1], 0);
  }
  ModelLayout layout_;
  TestPool pool_;
  std::string session_;
};

TEST_F(StreamingLlmPoolTest, SinksPlusRecentByHand) {
  const std::string seq = pool_.Create(session_, StreamingLlm(2), Budget(0));
  ASSERT_TRUE(Append(pool_.pool, session_, seq, 10, layout_, HashValue).ok());
  EXPECT_THAT(Compress(seq, 5), ElementsAre(0, 1, 7, 8, 9));
  ASSERT_TRUE(Append(pool_.pool, session_, seq, 3, layout_, HashValue).ok());
  EXPECT_THAT(Compress(seq, 4), ElementsAre(0, 1, 11, 12));
  // Budget above the count: nothing evicted.
  EXPECT_THAT(Compress(seq, 10), ElementsAre(0, 1, 11, 12));
}

TEST_F(StreamingLlmPoolTest, BudgetAtMostSinksKeepsLowestPositions) {
  const std::string seq = pool_.Create(session_, StreamingLlm(4), Budget(0));
  ASSERT_TRUE(Append(pool_.pool, session_, seq, 9, layout_, HashValue).ok());
  EXPECT_THAT(Compress(seq, 4), ElementsAre(0, 1, 2, 3));
  EXPECT_THAT(Compress(seq, 3), ElementsAre(0, 1, 2));
}

TEST_F(StreamingLlmPoolTest, ExplicitPositionsAreRespected) {
  const std::string seq = pool_.Create(session_, StreamingLlm(1), Budget(0));
  testing_util::AppendOptions options;
  options.positions = {5, 17, 18, 40, 41, 99};
  ASSERT_TRUE(Append(pool_.pool, session_, seq, 6, layout_, HashValue, options).ok());
  EXPECT_THAT(Compress(seq, 3), ElementsAre(5, 41, 99));
}

// After a KeyDiff compaction slot order is not position order; the sink must be the lowest
// POSITION (a slot-based choice would keep slot 0, which now holds position 4).
TEST(StreamingLlmBySlotTest, SinksAndRecencyGoByPosition) {
  // Blocks of 4: no block is evicted whole, so the compaction is plain hole filling.
  const ModelLayout layout = MakeLayout(1, 1, 2, DType::kFloat32, 4);
  TestPool pool;
  const std::string session = pool.Attach(layout, 32);
  const std::string seq = pool.Create(session, KeyDiff(), Budget(0));
  const std::vector<std::vector<float>> keys = {{1, 0},  {2, 0}, {1, 1},
                                                {1, -1}, {0, 4}, {0, -0.5f}};
  auto fn = [&](int layer, int kv, int head, int32_t position, int d) {
    return kv == 0 ? keys[position][d] : HashValue(layer, kv, head, position, d);
  };
  ASSERT_TRUE(Append(pool.pool, session, seq, 6, layout, fn).ok());
  CompressParams keydiff;
  keydiff.budget_tokens = 3;
  ASSERT_TRUE(pool.pool.Compress(session, seq, keydiff).ok());
  auto view = pool.pool.GetLayout(session, seq, {}, true);
  // TV1 keeps {2, 4, 5}; hole filling puts 4 and 5 into slots 0 and 1.
  ASSERT_THAT(view->layers[0].positions, ElementsAre(4, 5, 2));

  CompressParams sink;
  sink.budget_tokens = 2;
  sink.policy = StreamingLlm(1);
  ASSERT_TRUE(pool.pool.Compress(session, seq, sink).ok());
  view = pool.pool.GetLayout(session, seq, {}, true);
  EXPECT_THAT(HeadPositions(view->layers[0], 0), ElementsAre(2, 5));
  EXPECT_TRUE(ContentsMatch(pool.pool, session, seq, layout, fn));
  // The override was for one call: the sequence still reports KeyDiff.
  EXPECT_EQ(view->policy.name, kPolicyKeyDiff);
}

TEST(StreamingLlmConfigTest, ValidationAndDefaults) {
  auto negative = ResolvePolicyConfig(StreamingLlm(-1));
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(negative.status().message(), HasSubstr("policy.streaming_llm.n_sink"));
  EXPECT_EQ(PolicyConfig{}.streaming_llm.n_sink, kDefaultStreamingLlmSinks);
  auto no_sinks = ResolvePolicyConfig(StreamingLlm(0));  // zero sinks is the paper's own option
  ASSERT_TRUE(no_sinks.ok());
  EXPECT_EQ(no_sinks->streaming_llm.n_sink, 0);
  auto kept = ResolvePolicyConfig(StreamingLlm(7));
  EXPECT_EQ(kept->streaming_llm.n_sink, 7);
}

}  // namespace
}  // namespace kvs
