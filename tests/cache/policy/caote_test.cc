// CAOTE driven directly (Observe -> Select over a real paged fp32 layer, values read through the
// arena by Backend::CaoteScores): every test vector of caote.md §13 TV1-TV7 (scores and kept
// sets, exact / fast / variant none, GQA mean and rss, greedy), protection united with the
// base's, forwarding of the base's attention needs, missing attention and config validation.
#include "cache/policy/caote.h"

#include <cmath>
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

struct Options {
  CaoteBase base = CaoteBase::kH2o;
  CaoteVariant variant = CaoteVariant::kExact;
  GqaReduce gqa = GqaReduce::kMean;
  bool greedy = false;
  int32_t n_sink = 0;
  int32_t n_recent = 0;
};

PolicyConfig Caote(const Options& options) {
  PolicyConfig config;
  config.name = kPolicyCaote;
  config.caote.base = options.base;
  config.caote.variant = options.variant;
  config.caote.gqa_reduce = options.gqa;
  config.caote.greedy = options.greedy;
  config.caote.n_sink = options.n_sink;
  config.caote.n_recent = options.n_recent;
  config.caote.snapkv = SnapKvConfig{2, 3, Pooling::kAvg};  // TV7
  const absl::Status status = ResolveCaoteConfig(config);
  EXPECT_TRUE(status.ok()) << status;
  return config;
}

// TV1: alpha [.1, .2, .4, .1, .2] (one query of one head) over these values.
const Rows kTv1Values = {{1, 0}, {0, 1}, {1, 1}, {0, 0}, {2, 0}};
const std::vector<float> kTv1Alpha = {.1f, .2f, .4f, .1f, .2f};
const std::vector<float> kTv1Exact = {0.067586f, 0.246221f, 0.274874f, 0.120185f, 0.313249f};
const std::vector<float> kTv1Fast = {0.049690f, 0.25f, 0.421637f, 0.099381f, 0.316228f};

class CaoteTest : public ::testing::Test {
 protected:
  // One Observe -> Select round over a fresh layer of one kv head.
  absl::StatusOr<Round> Run(const Options& options, const std::vector<Rows>& values,
                            int32_t num_q_heads, const std::vector<float>& probs,
                            int32_t num_queries, int32_t keep) {
    const auto policy = MakeCaotePolicy(Caote(options));
    TestLayer layer(values, Identity(static_cast<int32_t>(values.size()),
                                     static_cast<int32_t>(values[0].size())));
    return ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, num_q_heads, probs,
                         num_queries, keep);
  }

  std::vector<int32_t> Kept(const Options& options, const std::vector<Rows>& values,
                            int32_t num_q_heads, const std::vector<float>& probs,
                            int32_t num_queries, int32_t keep) {
    auto round = Run(options, values, num_q_heads, probs, num_queries, keep);
    EXPECT_TRUE(round.ok()) << round.status();
    return round.ok() ? round->kept[0] : std::vector<int32_t>{};
  }

  std::vector<float> Scores(const Options& options, const std::vector<Rows>& values,
                            int32_t num_q_heads, const std::vector<float>& probs,
                            int32_t num_queries) {
    const int32_t count = static_cast<int32_t>(values[0].size());
    auto round = Run(options, values, num_q_heads, probs, num_queries, count);
    EXPECT_TRUE(round.ok()) << round.status();
    return round.ok() ? round->scores : std::vector<float>{};
  }

  std::unique_ptr<Backend> backend_ = MakeCpuBackend(1);
};

TEST_F(CaoteTest, Tv1ExactFastAndAttentionOnly) {
  Options exact;
  Options fast;
  fast.variant = CaoteVariant::kFast;
  Options none;
  none.variant = CaoteVariant::kNone;
  EXPECT_THAT(Scores(exact, {kTv1Values}, 1, kTv1Alpha, 1), Pointwise(FloatNear(1e-5), kTv1Exact));
  EXPECT_THAT(Scores(fast, {kTv1Values}, 1, kTv1Alpha, 1), Pointwise(FloatNear(1e-5), kTv1Fast));
  EXPECT_THAT(Scores(none, {kTv1Values}, 1, kTv1Alpha, 1), Pointwise(FloatNear(1e-7), kTv1Alpha));

  EXPECT_THAT(Kept(exact, {kTv1Values}, 1, kTv1Alpha, 1, 1), ElementsAre(4));
  EXPECT_THAT(Kept(fast, {kTv1Values}, 1, kTv1Alpha, 1, 1), ElementsAre(2));
  EXPECT_THAT(Kept(none, {kTv1Values}, 1, kTv1Alpha, 1, 1), ElementsAre(2));
  for (const Options& options : {exact, fast}) {
    EXPECT_THAT(Kept(options, {kTv1Values}, 1, kTv1Alpha, 1, 2), ElementsAre(2, 4));
    EXPECT_THAT(Kept(options, {kTv1Values}, 1, kTv1Alpha, 1, 3), ElementsAre(1, 2, 4));
    EXPECT_THAT(Kept(options, {kTv1Values}, 1, kTv1Alpha, 1, 4), ElementsAre(1, 2, 3, 4));
  }
  // Attention only: 0 and 3 tie at .1, the lower position stays.
  EXPECT_THAT(Kept(none, {kTv1Values}, 1, kTv1Alpha, 1, 4), ElementsAre(0, 1, 2, 4));
}

TEST_F(CaoteTest, Tv1Greedy) {
  Options greedy;
  greedy.greedy = true;
  EXPECT_THAT(Kept(greedy, {kTv1Values}, 1, kTv1Alpha, 1, 2), ElementsAre(1, 4));
  EXPECT_THAT(Kept(greedy, {kTv1Values}, 1, kTv1Alpha, 1, 1), ElementsAre(1));
  EXPECT_THAT(Kept(greedy, {kTv1Values}, 1, kTv1Alpha, 1, 3), ElementsAre(1, 2, 4));
  EXPECT_THAT(Kept(greedy, {kTv1Values}, 1, kTv1Alpha, 1, 4), ElementsAre(1, 2, 3, 4));
  // Nothing evicted: the greedy scores are the one-shot scores.
  EXPECT_THAT(Scores(greedy, {kTv1Values}, 1, kTv1Alpha, 1), Pointwise(FloatNear(1e-5), kTv1Exact));
  Options fast = greedy;
  fast.variant = CaoteVariant::kFast;
  EXPECT_THAT(Kept(fast, {kTv1Values}, 1, kTv1Alpha, 1, 2), ElementsAre(1, 4));
  EXPECT_THAT(Scores(fast, {kTv1Values}, 1, kTv1Alpha, 1), Pointwise(FloatNear(1e-5), kTv1Fast));
  // A protected sink is never evicted but keeps its weight in every renormalisation.
  Options sink = greedy;
  sink.n_sink = 1;
  EXPECT_THAT(Kept(sink, {kTv1Values}, 1, kTv1Alpha, 1, 2), ElementsAre(0, 1));
  Options fast_sink = fast;
  fast_sink.n_sink = 1;
  EXPECT_THAT(Kept(fast_sink, {kTv1Values}, 1, kTv1Alpha, 1, 3), ElementsAre(0, 1, 2));
}

TEST_F(CaoteTest, Tv2TovaFromQueries) {
  // q = [sqrt 2, 0], K = [[0,0],[ln2,0],[ln4,0],[0,0],[ln2,0]], scale 1/sqrt 2: the logits are
  // k_x, so the probabilities are [1, 2, 4, 1, 2] / 10.
  const float root2 = std::sqrt(2.0f);
  const std::vector<float> logits = {0, std::log(2.0f), std::log(4.0f), 0, std::log(2.0f)};
  std::vector<float> probs;
  double sum = 0.0;
  for (float k : logits) sum += std::exp(double{root2} * k / root2);
  for (float k : logits)
    probs.push_back(static_cast<float>(std::exp(double{root2} * k / root2) / sum));
  Options tova;
  tova.base = CaoteBase::kTova;
  EXPECT_THAT(Scores(tova, {kTv1Values}, 1, probs, 1), Pointwise(FloatNear(1e-5), kTv1Exact));
  EXPECT_THAT(Kept(tova, {kTv1Values}, 1, probs, 1, 1), ElementsAre(4));
}

TEST_F(CaoteTest, Tv3H2oRawSumsAboveOne) {
  // Ten queries whose column sums are [1, 2, 4, 1, 2]: normalises to TV1.
  std::vector<float> probs;
  const std::vector<std::vector<float>> rows = {
      {1, 0, 0, 0, 0}, {0, 1, 0, 0, 0}, {0, 1, 0, 0, 0}, {0, 0, 1, 0, 0}, {0, 0, 1, 0, 0},
      {0, 0, 1, 0, 0}, {0, 0, 1, 0, 0}, {0, 0, 0, 1, 0}, {0, 0, 0, 0, 1}, {0, 0, 0, 0, 1}};
  for (const auto& row : rows) probs.insert(probs.end(), row.begin(), row.end());
  const auto policy = MakeCaotePolicy(Caote({}));
  TestLayer layer({kTv1Values}, Identity(1, 5));
  auto round = ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 1, probs, 10, 2);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_THAT(layer.state.accumulated, ElementsAre(1, 2, 4, 1, 2));
  EXPECT_THAT(round->kept[0], ElementsAre(2, 4));
  round = ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 1, {}, 0, 5);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_THAT(round->scores, Pointwise(FloatNear(1e-5), kTv1Exact));
}

TEST_F(CaoteTest, Tv4UniformWeights) {
  const Rows values = {{1, 0}, {0, 1}, {-1, 0}, {0, -1}};
  const std::vector<float> probs = {.25f, .25f, .25f, .25f};
  Options tova;
  tova.base = CaoteBase::kTova;
  EXPECT_THAT(Scores(tova, {values}, 1, probs, 1),
              Pointwise(FloatNear(1e-6), std::vector<float>(4, 1.0f / 3)));
  EXPECT_THAT(Kept(tova, {values}, 1, probs, 1, 2), ElementsAre(0, 1));
}

TEST_F(CaoteTest, Tv4ZeroRowIsUniform) {
  // Raw scores summing to 0 become alpha = 1/n.
  const Rows values = {{1, 0}, {0, 1}, {-1, 0}, {0, -1}};
  Options tova;
  tova.base = CaoteBase::kTova;
  EXPECT_THAT(Scores(tova, {values}, 1, {0, 0, 0, 0}, 1),
              Pointwise(FloatNear(1e-6), std::vector<float>(4, 1.0f / 3)));
}

TEST_F(CaoteTest, Tv5GqaMeanAndRss) {
  const Rows values = {{1, 0}, {0, 1}, {0, 0}, {-1, 0}};
  const std::vector<float> probs = {.7f, .1f, .1f, .1f, .1f, .1f, .1f, .7f};  // 2 query heads
  struct Case {
    CaoteVariant variant;
    GqaReduce gqa;
    std::vector<float> scores;
  };
  const std::vector<Case> cases = {
      {CaoteVariant::kExact, GqaReduce::kMean, {0.669992f, 0.1f, 0.011111f, 0.669992f}},
      {CaoteVariant::kExact, GqaReduce::kRss, {0.978409f, 0.169967f, 0.095581f, 0.978409f}},
      {CaoteVariant::kFast, GqaReduce::kMean, {0.687184f, 0.083333f, 0.027778f, 0.687184f}},
      {CaoteVariant::kFast, GqaReduce::kRss, {2.40787f, 0.117851f, 0.039284f, 2.40787f}},
  };
  for (const Case& c : cases) {
    Options options;
    options.base = CaoteBase::kTova;
    options.variant = c.variant;
    options.gqa = c.gqa;
    SCOPED_TRACE(static_cast<int>(c.variant) * 10 + static_cast<int>(c.gqa));
    EXPECT_THAT(Scores(options, {values}, 2, probs, 1), Pointwise(FloatNear(1e-5), c.scores));
    EXPECT_THAT(Kept(options, {values}, 2, probs, 1, 2), ElementsAre(0, 3));
    EXPECT_THAT(Kept(options, {values}, 2, probs, 1, 3), ElementsAre(0, 1, 3));
    options.greedy = true;
    EXPECT_THAT(Kept(options, {values}, 2, probs, 1, 3), ElementsAre(0, 1, 3));
  }
}

TEST_F(CaoteTest, Tv5PerKvHead) {
  // Two kv heads, two query heads each: head 1 sees TV5 mirrored, so it keeps the mirror set.
  const Rows values = {{1, 0}, {0, 1}, {0, 0}, {-1, 0}};
  const Rows mirrored = {{-1, 0}, {0, 0}, {0, 1}, {1, 0}};
  const std::vector<float> probs = {.7f, .1f, .1f, .1f, .1f, .1f, .1f, .7f,
                                    .1f, .1f, .1f, .7f, .7f, .1f, .1f, .1f};
  for (GqaReduce gqa : {GqaReduce::kMean, GqaReduce::kRss}) {
    Options options;
    options.base = CaoteBase::kTova;
    options.gqa = gqa;
    const auto policy = MakeCaotePolicy(Caote(options));
    TestLayer layer({values, mirrored}, Identity(2, 4));
    auto round = ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 4, probs, 1, 3);
    ASSERT_TRUE(round.ok()) << round.status();
    EXPECT_THAT(round->kept[0], ElementsAre(0, 1, 3));
    EXPECT_THAT(round->kept[1], ElementsAre(0, 2, 3));
  }
}

TEST_F(CaoteTest, Tv6AllMassOnOneTokenIsInfinite) {
  const Rows values = {{1, 0}, {0, 1}, {1, 1}};
  Options tova;
  tova.base = CaoteBase::kTova;
  EXPECT_THAT(Scores(tova, {values}, 1, {1, 0, 0}, 1), ElementsAre(kInf, 0, 0));
  EXPECT_THAT(Kept(tova, {values}, 1, {1, 0, 0}, 1, 2), ElementsAre(0, 1));
  tova.variant = CaoteVariant::kFast;
  EXPECT_THAT(Kept(tova, {values}, 1, {1, 0, 0}, 1, 2), ElementsAre(0, 1));
  tova.greedy = true;
  EXPECT_THAT(Kept(tova, {values}, 1, {1, 0, 0}, 1, 1), ElementsAre(0));
}

TEST_F(CaoteTest, Tv6GreedyTiesKeepTheLowerPositionOnScrambledSlots) {
  // Slot s holds position {0, 2, 1}[s]; alpha by position [1, 0, 0]: positions 1 and 2 tie at 0.
  const Rows values = {{1, 0}, {1, 1}, {0, 1}};
  for (CaoteVariant variant : {CaoteVariant::kExact, CaoteVariant::kFast}) {
    Options options;
    options.base = CaoteBase::kTova;
    options.variant = variant;
    for (bool greedy : {false, true}) {
      options.greedy = greedy;
      const auto policy = MakeCaotePolicy(Caote(options));
      TestLayer layer({values}, {{0, 2, 1}});
      auto round = ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 1, {1, 0, 0}, 1, 2);
      ASSERT_TRUE(round.ok()) << round.status();
      EXPECT_THAT(round->kept[0], ElementsAre(0, 1));
    }
  }
}

// TV7: SnapKV base, m = 3, n = 6, w = 2, kernel 3.
const Rows kTv7Values = {{1, 0}, {0, 1}, {1, 1}, {0, 0}, {2, 0}, {0, 2}};
const std::vector<float> kTv7Probs = {.5f, .1f, .1f, .3f, 0,   0,   .2f, .2f, .1f,
                                      .1f, .4f, 0,   .1f, .3f, .2f, .1f, .1f, .2f};

TEST_F(CaoteTest, Tv7SnapKvBase) {
  Options exact;
  exact.base = CaoteBase::kSnapKv;
  Options fast = exact;
  fast.variant = CaoteVariant::kFast;
  Options none = exact;
  none.variant = CaoteVariant::kNone;
  // The window {4, 5} is protected (+inf in the dry-run scores).
  EXPECT_THAT(Scores(exact, {kTv7Values}, 1, kTv7Probs, 3),
              Pointwise(FloatNear(1e-4),
                        std::vector<float>{0.1044f, 0.240007f, 0.09328f, 0.105908f, kInf, kInf}));
  EXPECT_THAT(Scores(fast, {kTv7Values}, 1, kTv7Probs, 3),
              Pointwise(FloatNear(1e-5), std::vector<float>{0.126869f, 0.186339f, 0.104757f,
                                                            0.094281f, kInf, kInf}));
  EXPECT_THAT(Kept(exact, {kTv7Values}, 1, kTv7Probs, 3, 4), ElementsAre(1, 3, 4, 5));
  EXPECT_THAT(Kept(fast, {kTv7Values}, 1, kTv7Probs, 3, 4), ElementsAre(0, 1, 4, 5));
  EXPECT_THAT(Kept(none, {kTv7Values}, 1, kTv7Probs, 3, 4), ElementsAre(1, 2, 4, 5));
  for (const Options& options : {exact, fast, none}) {
    EXPECT_THAT(Kept(options, {kTv7Values}, 1, kTv7Probs, 3, 3), ElementsAre(1, 4, 5));
  }
}

TEST_F(CaoteTest, ProtectionIsTheUnionWithTheBase) {
  Options snap;
  snap.base = CaoteBase::kSnapKv;
  snap.n_sink = 1;
  EXPECT_THAT(Kept(snap, {kTv7Values}, 1, kTv7Probs, 3, 4), ElementsAre(0, 1, 4, 5));
  Options h2o;
  h2o.n_sink = 1;
  h2o.n_recent = 1;
  EXPECT_THAT(Kept(h2o, {kTv1Values}, 1, kTv1Alpha, 1, 3), ElementsAre(0, 2, 4));
  // Clamped to the budget: the sink alone.
  EXPECT_THAT(Kept(h2o, {kTv1Values}, 1, kTv1Alpha, 1, 1), ElementsAre(0));
}

TEST_F(CaoteTest, ScrambledSlotsGoByPosition) {
  // TV7 with the slots permuted: slot s holds position perm[s].
  const std::vector<int32_t> perm = {5, 2, 0, 4, 1, 3};
  Rows values;
  std::vector<float> probs;
  for (int32_t p : perm) values.push_back(kTv7Values[p]);
  for (int32_t i = 0; i < 3; ++i) {
    for (int32_t p : perm) probs.push_back(kTv7Probs[i * 6 + p]);
  }
  Options exact;
  exact.base = CaoteBase::kSnapKv;
  const auto policy = MakeCaotePolicy(Caote(exact));
  TestLayer layer({values}, {perm});
  auto round = ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 1, probs, 3, 4);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_THAT(round->kept[0], ElementsAre(1, 3, 4, 5));
  exact.greedy = true;
  const auto greedy = MakeCaotePolicy(Caote(exact));
  TestLayer again({values}, {perm});
  round = ObserveSelect(*greedy, *backend_, Phase::kPrefill, again, 1, probs, 3, 3);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_THAT(round->kept[0], ElementsAre(1, 4, 5));
}

TEST_F(CaoteTest, ForwardsTheBaseRequirements) {
  Options options;
  auto policy = MakeCaotePolicy(Caote(options));
  EXPECT_TRUE(policy->attention(Phase::kPrefill).needed);
  EXPECT_EQ(policy->attention(Phase::kPrefill).trailing_queries, 0);
  EXPECT_TRUE(policy->needs_accumulated());
  options.base = CaoteBase::kTova;
  policy = MakeCaotePolicy(Caote(options));
  EXPECT_EQ(policy->attention(Phase::kDecode).trailing_queries, 1);
  EXPECT_FALSE(policy->needs_accumulated());
  options.base = CaoteBase::kSnapKv;
  policy = MakeCaotePolicy(Caote(options));
  EXPECT_EQ(policy->attention(Phase::kPrefill).trailing_queries, 2);
  options.base = CaoteBase::kCake;
  policy = MakeCaotePolicy(Caote(options));
  EXPECT_TRUE(policy->attention(Phase::kPrefill).needed);
  EXPECT_EQ(policy->window_tokens(), policy->config().caote.cake.window);
}

TEST_F(CaoteTest, MissingAttentionIsInvalidArgument) {
  Options tova;
  tova.base = CaoteBase::kTova;
  auto round = Run(tova, {kTv1Values}, 1, {}, 0, 2);
  ASSERT_EQ(round.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(round.status().message(), HasSubstr("caote"));
  EXPECT_THAT(round.status().message(), HasSubstr("attention"));
  round = Run(Options{}, {kTv1Values}, 1, {}, 0, 2);
  ASSERT_EQ(round.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(round.status().message(), HasSubstr("attention"));
}

TEST(CaoteConfigTest, DefaultsAndValidation) {
  PolicyConfig config;
  config.name = kPolicyCaote;
  config.caote.eps = 0.0f;
  config.caote.snapkv = SnapKvConfig{0, 0, Pooling::kAvg};
  ASSERT_TRUE(ResolveCaoteConfig(config).ok());
  EXPECT_FLOAT_EQ(config.caote.eps, 1e-6f);
  EXPECT_EQ(config.caote.snapkv.window, 32);
  EXPECT_EQ(config.caote.snapkv.kernel_size, 5);

  PolicyConfig bad = config;
  bad.caote.eps = -1.0f;
  EXPECT_EQ(ResolveCaoteConfig(bad).message(), "policy.caote.eps must be in (0, 0.5), got -1");
  bad.caote.eps = 0.5f;
  EXPECT_EQ(ResolveCaoteConfig(bad).code(), absl::StatusCode::kInvalidArgument);
  bad.caote.eps = std::nanf("");
  EXPECT_EQ(ResolveCaoteConfig(bad).code(), absl::StatusCode::kInvalidArgument);
  bad = config;
  bad.caote.snapkv.kernel_size = 4;
  EXPECT_EQ(ResolveCaoteConfig(bad).message(),
            "policy.caote.snapkv.kernel_size must be odd and >= 1, got 4");
  bad = config;
  bad.caote.snapkv.window = -1;
  EXPECT_EQ(ResolveCaoteConfig(bad).message(), "policy.caote.snapkv.window must be >= 1, got -1");
  bad = config;
  bad.caote.n_sink = -1;
  EXPECT_EQ(ResolveCaoteConfig(bad).message(), "policy.caote.n_sink must be >= 0, got -1");
  bad = config;
  bad.caote.n_recent = -1;
  EXPECT_EQ(ResolveCaoteConfig(bad).message(), "policy.caote.n_recent must be >= 0, got -1");
  bad = config;
  bad.caote.variant = static_cast<CaoteVariant>(9);
  EXPECT_EQ(ResolveCaoteConfig(bad).code(), absl::StatusCode::kInvalidArgument);
  bad = config;
  bad.caote.base = static_cast<CaoteBase>(9);
  EXPECT_EQ(ResolveCaoteConfig(bad).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvs
