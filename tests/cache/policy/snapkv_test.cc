// SnapKV driven directly (Observe -> Select over a real paged fp32 layer): caote.md §13 TV7's raw
// scores and kept sets, pooling by POSITION with scrambled slots, trailing rows only, max pooling,
// decode (pooled TOVA with the newest protected), missing attention and config validation.
#include "cache/policy/snapkv.h"

#include <limits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cache/policy/attention_policy_test_util.h"

namespace kvs {
namespace {

using ::testing::ElementsAre;
using ::testing::FloatNear;
using ::testing::HasSubstr;
using ::testing::Pointwise;
using testing_util::Identity;
using testing_util::ObserveSelect;
using testing_util::Rows;
using testing_util::TestLayer;

constexpr float kInf = std::numeric_limits<float>::infinity();

PolicyConfig SnapKv(int32_t window, int32_t kernel, Pooling pooling = Pooling::kAvg) {
  PolicyConfig config;
  config.name = kPolicySnapKv;
  config.snapkv = SnapKvConfig{window, kernel, pooling};
  EXPECT_TRUE(ResolveSnapKvConfig(config).ok());
  return config;
}

Rows Values(int32_t n) { return Rows(n, std::vector<float>{1.0f, 0.0f}); }

// caote.md TV7: 3 queries (positions 3, 4, 5) over 6 keys.
const std::vector<std::vector<float>> kTv7Rows = {
    {.5f, .1f, .1f, .3f, 0, 0}, {.2f, .2f, .1f, .1f, .4f, 0}, {.1f, .3f, .2f, .1f, .1f, .2f}};
const std::vector<float> kTv7Raw = {0.8f / 3, 1.1f / 3, 1.0f / 3, 0.5f / 3, .5f, .2f};

// probs [1][rows][6] in the slot order `slot_positions` (slot s holds position slot_positions[s]).
std::vector<float> Tv7Probs(const std::vector<int32_t>& slot_positions, size_t first_row = 0) {
  std::vector<float> probs;
  for (size_t i = first_row; i < kTv7Rows.size(); ++i) {
    for (int32_t p : slot_positions) probs.push_back(kTv7Rows[i][p]);
  }
  return probs;
}

class SnapKvTest : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> backend_ = MakeCpuBackend(1);
};

TEST_F(SnapKvTest, RequirementsTrailingWindow) {
  const auto policy = MakeSnapKvPolicy(SnapKv(2, 3));
  EXPECT_TRUE(policy->attention(Phase::kPrefill).needed);
  EXPECT_EQ(policy->attention(Phase::kPrefill).trailing_queries, 2);
  EXPECT_EQ(policy->attention(Phase::kDecode).trailing_queries, 2);
  EXPECT_FALSE(policy->needs_accumulated());
}

TEST_F(SnapKvTest, Tv7RawScoresAndKeptSets) {
  const auto policy = MakeSnapKvPolicy(SnapKv(2, 3));
  const std::vector<int32_t> identity = {0, 1, 2, 3, 4, 5};
  TestLayer layer({Values(6)}, {identity});
  auto round =
      ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 1, Tv7Probs(identity), 3, 4);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_THAT(layer.state.step_scores, Pointwise(FloatNear(1e-6), kTv7Raw));
  EXPECT_EQ(layer.state.step_protected_recent, 2);
  EXPECT_THAT(round->scores,
              Pointwise(FloatNear(1e-6), std::vector<float>{kTv7Raw[0], kTv7Raw[1], kTv7Raw[2],
                                                            kTv7Raw[3], kInf, kInf}));
  EXPECT_THAT(round->kept[0], ElementsAre(1, 2, 4, 5));
  round = ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 1, Tv7Probs(identity), 3, 3);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_THAT(round->kept[0], ElementsAre(1, 4, 5));
}

TEST_F(SnapKvTest, Tv7TrailingRowsOnly) {
  // The sequence may send only the last w' rows; w' still comes from the step's query count.
  const auto policy = MakeSnapKvPolicy(SnapKv(2, 3));
  const std::vector<int32_t> identity = {0, 1, 2, 3, 4, 5};
  TestLayer layer({Values(6)}, {identity});
  auto round = ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 1, Tv7Probs(identity, 1),
                             2, 4, /*step_queries=*/3);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_THAT(layer.state.step_scores, Pointwise(FloatNear(1e-6), kTv7Raw));
  EXPECT_THAT(round->kept[0], ElementsAre(1, 2, 4, 5));
}

TEST_F(SnapKvTest, Tv7PoolsByPositionOnScrambledSlots) {
  const auto policy = MakeSnapKvPolicy(SnapKv(2, 3));
  const std::vector<int32_t> scrambled = {5, 2, 0, 4, 1, 3};
  TestLayer layer({Values(6)}, {scrambled});
  auto round =
      ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 1, Tv7Probs(scrambled), 3, 4);
  ASSERT_TRUE(round.ok()) << round.status();
  std::vector<float> expected;
  for (int32_t p : scrambled) expected.push_back(kTv7Raw[p]);
  EXPECT_THAT(layer.state.step_scores, Pointwise(FloatNear(1e-6), expected));
  EXPECT_THAT(round->kept[0], ElementsAre(1, 2, 4, 5));
  round = ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 1, Tv7Probs(scrambled), 3, 3);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_THAT(round->kept[0], ElementsAre(1, 4, 5));
}

TEST_F(SnapKvTest, Tv7MaxPooling) {
  // Window sums over the prefix [.3, .5, .3, .2] max-pool to [.5, .5, .5, .3]: 0 wins the tie.
  const auto policy = MakeSnapKvPolicy(SnapKv(2, 3, Pooling::kMax));
  const std::vector<int32_t> identity = {0, 1, 2, 3, 4, 5};
  TestLayer layer({Values(6)}, {identity});
  auto round =
      ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 1, Tv7Probs(identity), 3, 4);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_THAT(round->kept[0], ElementsAre(0, 1, 4, 5));
}

TEST_F(SnapKvTest, DecodeIsPooledTovaWithTheNewestProtected) {
  const auto policy = MakeSnapKvPolicy(SnapKv(32, 3));
  TestLayer layer({Values(4)}, Identity(1, 4));
  // Pooled prefix [.5/3, .8/3, .4/3]; the newest (.2) is protected.
  auto round =
      ObserveSelect(*policy, *backend_, Phase::kDecode, layer, 1, {.4f, .1f, .3f, .2f}, 1, 2);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_EQ(layer.state.step_protected_recent, 1);
  EXPECT_THAT(round->scores,
              Pointwise(FloatNear(1e-6), std::vector<float>{.5f / 3, .8f / 3, .4f / 3, kInf}));
  EXPECT_THAT(round->kept[0], ElementsAre(1, 3));
}

TEST_F(SnapKvTest, TooFewQueriesIsInvalidArgument) {
  const auto policy = MakeSnapKvPolicy(SnapKv(2, 3));
  const std::vector<int32_t> identity = {0, 1, 2, 3, 4, 5};
  TestLayer layer({Values(6)}, {identity});
  auto round = ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 1, Tv7Probs(identity, 2),
                             1, 4, /*step_queries=*/3);
  ASSERT_EQ(round.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(round.status().message(), HasSubstr("attention.num_queries"));
}

TEST_F(SnapKvTest, MissingAttentionIsInvalidArgument) {
  const auto policy = MakeSnapKvPolicy(SnapKv(2, 3));
  TestLayer layer({Values(3)}, Identity(1, 3));
  auto round = ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 1, {}, 0, 2);
  ASSERT_EQ(round.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(round.status().message(), HasSubstr("snapkv"));
  EXPECT_THAT(round.status().message(), HasSubstr("attention"));
}

TEST(SnapKvConfigTest, DefaultsAndValidation) {
  PolicyConfig config;
  config.name = kPolicySnapKv;
  config.snapkv = SnapKvConfig{0, 0, Pooling::kAvg};
  ASSERT_TRUE(ResolveSnapKvConfig(config).ok());
  EXPECT_EQ(config.snapkv.window, 32);
  EXPECT_EQ(config.snapkv.kernel_size, 7);
  config.snapkv.kernel_size = 4;
  EXPECT_EQ(ResolveSnapKvConfig(config).message(),
            "policy.snapkv.kernel_size must be odd and >= 1, got 4");
  config.snapkv.kernel_size = -3;
  EXPECT_EQ(ResolveSnapKvConfig(config).message(),
            "policy.snapkv.kernel_size must be odd and >= 1, got -3");
  config.snapkv.kernel_size = 1;
  config.snapkv.window = -1;
  EXPECT_EQ(ResolveSnapKvConfig(config).message(), "policy.snapkv.window must be >= 1, got -1");
  config.snapkv.window = 1;
  config.snapkv.pooling = static_cast<Pooling>(7);
  EXPECT_EQ(ResolveSnapKvConfig(config).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvs
