// H2O driven directly (Observe -> Select over a real paged fp32 layer): accumulation of every
// query over steps, the GQA mean, sinks/recent by position, the tie rule on scrambled slots,
// caote.md §13 TV3's raw scores, missing attention and config validation.
#include "cache/policy/h2o.h"

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
using testing_util::Round;
using testing_util::Rows;
using testing_util::TestLayer;

constexpr float kInf = std::numeric_limits<float>::infinity();

PolicyConfig H2o(int32_t n_sink = 0, int32_t n_recent = 0) {
  PolicyConfig config;
  config.name = kPolicyH2o;
  config.h2o.n_sink = n_sink;
  config.h2o.n_recent = n_recent;
  EXPECT_TRUE(ResolveH2oConfig(config).ok());
  return config;
}

Rows Values(int32_t n) { return Rows(n, std::vector<float>{1.0f, 2.0f}); }

class H2oTest : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> backend_ = MakeCpuBackend(1);
};

TEST_F(H2oTest, RequirementsAllQueriesAndAccumulated) {
  const auto policy = MakeH2oPolicy(H2o());
  for (Phase phase : {Phase::kPrefill, Phase::kDecode}) {
    EXPECT_TRUE(policy->attention(phase).needed);
    EXPECT_EQ(policy->attention(phase).trailing_queries, 0);
  }
  EXPECT_TRUE(policy->needs_accumulated());
}

TEST_F(H2oTest, Tv3RawScoresAreTheAccumulatedSums) {
  const auto policy = MakeH2oPolicy(H2o());
  TestLayer layer({Values(5)}, Identity(1, 5));
  layer.state.accumulated = {1, 2, 4, 1, 2};
  auto round = ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 1, {}, 0, 2);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_THAT(round->scores, ElementsAre(1, 2, 4, 1, 2));
  EXPECT_THAT(round->kept[0], ElementsAre(1, 2));  // 1 and 4 tie at 2: the lower position stays
  round = ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 1, {}, 0, 4);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_THAT(round->kept[0], ElementsAre(0, 1, 2, 4));  // 0 and 3 tie at 1
}

TEST_F(H2oTest, AccumulatesEveryQueryOverTwoSteps) {
  const auto policy = MakeH2oPolicy(H2o());
  // Step 1: 3 tokens, 2 query heads of one kv head, 2 queries each.
  TestLayer first({Values(3)}, Identity(1, 3));
  const std::vector<float> probs1 = {1,   0,   0,   .5f, .5f, 0,     // head 0
                                     .2f, .3f, .5f, .1f, .1f, .8f};  // head 1
  ASSERT_TRUE(policy->Observe(*backend_, Phase::kPrefill, {first.Step(2, probs1, 2)}).ok());
  EXPECT_THAT(first.state.accumulated,
              Pointwise(FloatNear(1e-6), std::vector<float>{1.5f, .5f, 0, .3f, .4f, 1.3f}));
  // One token appended (zero-extended), then a decode step with one query.
  LayerPolicyState state = first.state;
  state.Extend(1, 3, 1);
  TestLayer second({Values(4)}, Identity(1, 4));
  second.state = state;
  const std::vector<float> probs2 = {.25f, .25f, .25f, .25f, 0, 0, .25f, .75f};
  auto round = ObserveSelect(*policy, *backend_, Phase::kDecode, second, 2, probs2, 1, 2);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_THAT(second.state.accumulated,
              Pointwise(FloatNear(1e-6),
                        std::vector<float>{1.75f, .75f, .25f, .25f, .3f, .4f, 1.55f, .75f}));
  // GQA mean [1.025, .575, .9, .5].
  EXPECT_THAT(round->scores,
              Pointwise(FloatNear(1e-6), std::vector<float>{1.025f, .575f, .9f, .5f}));
  EXPECT_THAT(round->kept[0], ElementsAre(0, 2));
}

TEST_F(H2oTest, SinksAndRecentByPosition) {
  const auto policy = MakeH2oPolicy(H2o(1, 1));
  // Slots scrambled: slot s holds position pos[s]; scores by position [1, 2, 4, 1, 2].
  const std::vector<int32_t> pos = {3, 1, 4, 0, 2};
  TestLayer layer({Values(5)}, {pos});
  layer.state.accumulated = {1, 2, 2, 1, 4};
  auto round = ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 1, {}, 0, 3);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_THAT(round->kept[0], ElementsAre(0, 2, 4));
  EXPECT_THAT(round->scores, ElementsAre(1, 2, kInf, kInf, 4));  // sink 0 (slot 3), recent 4
  // keep 1: the sink alone (sinks + recent are clamped to keep).
  round = ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 1, {}, 0, 1);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_THAT(round->kept[0], ElementsAre(0));
}

TEST_F(H2oTest, TiesKeepTheLowerPositionOnScrambledSlots) {
  const auto policy = MakeH2oPolicy(H2o());
  TestLayer layer({Values(5)}, {{3, 1, 4, 0, 2}});
  layer.state.accumulated = {1, 1, 1, 1, 1};
  auto round = ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 1, {}, 0, 2);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_THAT(round->kept[0], ElementsAre(0, 1));
  // Scores by slot [1, 2, 4, 1, 2] -> by position {3:1, 1:2, 4:4, 0:1, 2:2}; 0 beats 3.
  layer.state.accumulated = {1, 2, 4, 1, 2};
  round = ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 1, {}, 0, 4);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_THAT(round->kept[0], ElementsAre(0, 1, 2, 4));
}

TEST_F(H2oTest, PerKvHeadSelection) {
  const auto policy = MakeH2oPolicy(H2o());
  TestLayer layer({Values(4), Values(4)}, Identity(2, 4));
  // 4 query heads, 2 per kv head; one query.
  const std::vector<float> probs = {.25f, .25f, 0,    .5f, 0,    0, .25f, .75f,   // kv head 0
                                    .5f,  .25f, .25f, 0,   .75f, 0, 0,    .25f};  // kv head 1
  auto round = ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 4, probs, 1, 2);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_THAT(round->kept[0], ElementsAre(0, 3));  // means [.125, .125, .125, .625]: ties -> 0
  EXPECT_THAT(round->kept[1], ElementsAre(0, 1));  // means [.625, .125, .125, .125]: 1 wins
}

TEST_F(H2oTest, MissingAttentionIsInvalidArgument) {
  const auto policy = MakeH2oPolicy(H2o());
  TestLayer layer({Values(3)}, Identity(1, 3));
  auto round = ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 1, {}, 0, 2);
  ASSERT_EQ(round.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(round.status().message(), HasSubstr("h2o"));
  EXPECT_THAT(round.status().message(), HasSubstr("attention"));
}

TEST_F(H2oTest, MalformedAttentionIsInvalidArgument) {
  const auto policy = MakeH2oPolicy(H2o());
  TestLayer layer({Values(3)}, Identity(1, 3));
  const std::vector<float> probs = {1, 0};  // 1 x 1 x 3 expected
  const absl::Status status =
      policy->Observe(*backend_, Phase::kPrefill, {layer.Step(1, probs, 1)});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("attention"));
  // Query heads not a multiple of the kv heads.
  TestLayer two({Values(3), Values(3)}, Identity(2, 3));
  const std::vector<float> three(9, 0.0f);
  EXPECT_EQ(policy->Observe(*backend_, Phase::kPrefill, {two.Step(3, three, 1)}).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(H2oConfigTest, Validation) {
  PolicyConfig config;
  config.name = kPolicyH2o;
  config.h2o.n_sink = -1;
  EXPECT_EQ(ResolveH2oConfig(config).message(), "policy.h2o.n_sink must be >= 0, got -1");
  config.h2o.n_sink = 0;
  config.h2o.n_recent = -2;
  EXPECT_EQ(ResolveH2oConfig(config).message(), "policy.h2o.n_recent must be >= 0, got -2");
  config.h2o.n_recent = 3;
  EXPECT_TRUE(ResolveH2oConfig(config).ok());
}

}  // namespace
}  // namespace kvs
