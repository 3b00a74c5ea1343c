// H2O driven directly (Observe -> Select over a real paged fp32 layer): accumulation of every
// query over steps, the GQA mean, sinks/recent by position, the tie rule on scrambled slots,
// caote.md §13 TV3's raw scores, missing attention and config validation.
#include "cache/policy/h2o.h"

#include <limits>
#include <vector>

#include "cache/policy/registry.h"
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

// normalize_by_queries (docs/policies/h2o_observed_attention.md): 4 causal queries over 4 tokens,
// one query head. Sums [1.8, 1.0, .85, .35], observers [4, 3, 2, 1] -> [.45, .333, .425, .35].
constexpr int32_t kNormCount = 4;
const std::vector<float> kCausalProbs = {1,  0,  0,   0,     // query at position 0
                                         .5f, .5f, 0,   0,     // 1
                                         .2f, .2f, .6f, 0,     // 2
                                         .1f, .3f, .25f, .35f};  // 3

PolicyConfig NormalizedH2o() {
  PolicyConfig config = H2o();
  config.h2o.normalize_by_queries = true;
  return config;
}

absl::StatusOr<testing_util::Round> ObserveCausalPrompt(const Policy& policy, Backend& backend,
                                                        TestLayer& layer, int32_t keep) {
  const std::vector<int32_t> query_positions = {0, 1, 2, 3};
  LayerStep step = layer.Step(1, kCausalProbs, kNormCount);
  step.query_positions = query_positions;
  if (absl::Status status = policy.Observe(backend, Phase::kPrefill, {step}); !status.ok()) {
    return status;
  }
  return ObserveSelect(policy, backend, Phase::kPrefill, layer, 1, {}, 0, keep);
}

TEST_F(H2oTest, PaperSumKeepsTheEarliestTokens) {
  const auto policy = MakeH2oPolicy(H2o());
  TestLayer layer({Values(kNormCount)}, Identity(1, kNormCount));
  auto round = ObserveCausalPrompt(*policy, *backend_, layer, 2);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_THAT(round->scores, Pointwise(FloatNear(1e-6), std::vector<float>{1.8f, 1, .85f, .35f}));
  EXPECT_THAT(round->kept[0], ElementsAre(0, 1));
  EXPECT_TRUE(layer.state.observed_queries.empty());  // nothing recorded for the paper's sum
}

TEST_F(H2oTest, NormalizedByQueriesDividesByTheObservers) {
  const auto policy = MakeH2oPolicy(NormalizedH2o());
  TestLayer layer({Values(kNormCount)}, Identity(1, kNormCount));
  auto round = ObserveCausalPrompt(*policy, *backend_, layer, 2);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_THAT(round->scores,
              Pointwise(FloatNear(1e-6), std::vector<float>{.45f, 1.0f / 3, .425f, .35f}));
  EXPECT_THAT(round->kept[0], ElementsAre(0, 2));
  EXPECT_THAT(layer.state.observed_queries, ElementsAre(0, 4));  // one run [0, 4)
  EXPECT_THAT(layer.state.accumulated,  // the sums themselves are unchanged
              Pointwise(FloatNear(1e-6), std::vector<float>{1.8f, 1, .85f, .35f}));

  // A decode step: token 4 appended, its query at position 4 sees all five keys.
  // Sums [1.9, 1.1, .95, .45, .6] / observers [5, 4, 3, 2, 1] = [.38, .275, .3167, .225, .6].
  LayerPolicyState state = layer.state;
  state.Extend(1, kNormCount, 1);
  TestLayer next({Values(5)}, Identity(1, 5));
  next.state = state;
  const std::vector<float> decode = {.1f, .1f, .1f, .1f, .6f};
  const std::vector<int32_t> decode_position = {4};
  LayerStep step = next.Step(1, decode, 1);
  step.query_positions = decode_position;
  ASSERT_TRUE(policy->Observe(*backend_, Phase::kDecode, {step}).ok());
  auto decoded = ObserveSelect(*policy, *backend_, Phase::kDecode, next, 1, {}, 0, 3);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_THAT(decoded->scores, Pointwise(FloatNear(1e-6), std::vector<float>{
                                                              .38f, .275f, .95f / 3, .225f, .6f}));
  EXPECT_THAT(decoded->kept[0], ElementsAre(0, 2, 4));
  EXPECT_THAT(next.state.observed_queries, ElementsAre(0, 5));  // the run grew
}

TEST_F(H2oTest, NormalizedSinksRecentAndGqaMean) {
  PolicyConfig config = NormalizedH2o();
  config.h2o.n_recent = 1;
  const auto policy = MakeH2oPolicy(config);
  // Two query heads of one kv head: head 0 as above, head 1 uniform over what it sees.
  TestLayer layer({Values(kNormCount)}, Identity(1, kNormCount));
  std::vector<float> probs = kCausalProbs;
  for (float p : {1.0f, 0.f, 0.f, 0.f, .5f, .5f, 0.f, 0.f, 1 / 3.f, 1 / 3.f, 1 / 3.f, 0.f, .25f,
                  .25f, .25f, .25f}) {
    probs.push_back(p);
  }
  // Head 1 sums [2.0833, 1.0833, .5833, .25] / [4, 3, 2, 1] = [.5208, .3611, .2917, .25].
  // GQA mean: [.4854, .3472, .3583, .3]; the newest (3) is protected, then 0.
  const std::vector<int32_t> query_positions = {0, 1, 2, 3};
  LayerStep step = layer.Step(2, probs, kNormCount);
  step.query_positions = query_positions;
  ASSERT_TRUE(policy->Observe(*backend_, Phase::kPrefill, {step}).ok());
  auto round = ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 2, {}, 0, 2);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_NEAR(round->scores[0], (.45 + 2.0833333 / 4) / 2, 1e-6);
  EXPECT_NEAR(round->scores[1], (1.0 / 3 + 1.0833333 / 3) / 2, 1e-6);
  EXPECT_NEAR(round->scores[2], (.425 + .5833333 / 2) / 2, 1e-6);
  EXPECT_EQ(round->scores[3], kInf);
  EXPECT_THAT(round->kept[0], ElementsAre(0, 3));
}

TEST(H2oObserverCountsTest, RunsGapsAndRepeats) {
  // Queries at 0 1 2 3 6 7: a key at p is seen by those at >= p.
  EXPECT_THAT(ObserverCounts({0, 4, 6, 8}, {0, 3, 5, 7, 9}), ElementsAre(6, 3, 2, 1, 0));
  // The same queries observed twice count twice, as their attention is summed twice.
  EXPECT_THAT(ObserverCounts({0, 2, 0, 2}, {0, 1, 2}), ElementsAre(4, 2, 0));
  // Runs in any order; empty runs ignored; no runs: nobody saw anything.
  EXPECT_THAT(ObserverCounts({10, 12, 0, 3, 5, 5}, {1, 11}), ElementsAre(4, 1));
  EXPECT_THAT(ObserverCounts({}, {0, 1}), ElementsAre(0, 0));
  // Long runs cost no more than short ones.
  EXPECT_THAT(ObserverCounts({0, 2000000000}, {0, 1999999999}), ElementsAre(2000000000, 1));
}

TEST(H2oRegistryTest, NormalizeAndObservedQueriesSurviveASnapshot) {
  auto unit = FindPolicyUnit(kPolicyH2o);
  ASSERT_TRUE(unit.ok());
  PolicyConfig config = NormalizedH2o();
  FieldWriter params;
  (*unit)->encode_params(config, params);
  FieldReader in;
  ASSERT_TRUE(in.Parse(params.bytes()));
  PolicyConfig back;
  ASSERT_TRUE((*unit)->decode_params(in, (*unit)->params_version, &back));
  EXPECT_TRUE(back.h2o.normalize_by_queries);
  // The paper's default writes no tag, and an absent tag reads back as false.
  FieldWriter plain;
  (*unit)->encode_params(H2o(), plain);
  ASSERT_TRUE(in.Parse(plain.bytes()));
  EXPECT_FALSE(in.has(3));
  back.h2o.normalize_by_queries = false;
  ASSERT_TRUE((*unit)->decode_params(in, (*unit)->params_version, &back));
  EXPECT_FALSE(back.h2o.normalize_by_queries);

  LayerPolicyState state;
  state.accumulated = {1, 2};
  state.observed_queries = {0, 4, 7, 9};
  FieldWriter encoded;
  ASSERT_NE((*unit)->encode_state, nullptr);
  (*unit)->encode_state(state, encoded);
  ASSERT_TRUE(in.Parse(encoded.bytes()));
  LayerPolicyState restored;
  ASSERT_TRUE((*unit)->decode_state(in, &restored));
  EXPECT_THAT(restored.accumulated, ElementsAre(1, 2));
  EXPECT_THAT(restored.observed_queries, ElementsAre(0, 4, 7, 9));
}

}  // namespace
}  // namespace kvs
