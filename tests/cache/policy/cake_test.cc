// CAKE scorer (cake.md §11 TV1, TV5, TV6), driven directly with hand-built LayerStep and
// LayerSelection over a real paged fp32 arena whose slot order is not position order. The CAKE
// allocator and cascade are tested elsewhere: budgets (+ W) are given explicitly as keep.
#include "cache/policy/cake.h"

#include <cmath>
#include <limits>
#include <map>
#include <ostream>
#include <vector>

#include "cache/policy/policy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cache/policy/scorer_test_util.h"

namespace kvs {
namespace {

using scorer_test::SoftmaxProbs;
using scorer_test::TestBackend;
using scorer_test::TestLayer;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

PolicyConfig CakeConfigFor(int32_t kernel_size, int32_t window = 2) {
  PolicyConfig config;
  config.name = kPolicyCake;
  config.cake.window = window;
  config.cake.gamma = 200;
  config.cake.tau1 = 1;
  config.cake.tau2 = 1;
  config.cake.kernel_size = kernel_size;
  return config;
}

std::unique_ptr<CakePolicy> MakeCake(PolicyConfig config) {
  EXPECT_TRUE(ResolveCakeConfig(config).ok());
  return std::make_unique<CakePolicy>(config, config.cake);
}

// TV1 window rows (row 0 = position 6, row 1 = position 7), per layer, by position.
const float kTv1Rows[3][2][8] = {
    {{.40f, .10f, .10f, .10f, .10f, .00f, .20f, .00f},
     {.20f, .10f, .10f, .10f, .10f, .20f, .10f, .10f}},
    {{.15f, .15f, .15f, .15f, .10f, .10f, .20f, .00f},
     {.10f, .20f, .10f, .20f, .10f, .10f, .10f, .10f}},
    {{.70f, .00f, .00f, .00f, .00f, .10f, .20f, .00f},
     {.80f, .00f, .00f, .00f, .00f, .00f, .10f, .10f}},
};
const std::vector<int32_t> kTv1Order = {5, 7, 0, 3, 6, 1, 4, 2};  // slot -> position

// Indicator of head 0 by position (prefix only).
std::vector<float> PrefixIndicator(const TestLayer& layer, int32_t prefix) {
  std::vector<float> out(prefix);
  for (int32_t s = 0; s < layer.count(); ++s) {
    const int32_t p = layer.Position(0, s);
    if (p < prefix) out[p] = layer.state.indicator[s];
  }
  return out;
}

void ExpectNear(const std::vector<float>& actual, const std::vector<float>& expected,
                double tolerance) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_NEAR(actual[i], expected[i], tolerance) << "index " << i;
  }
}

struct Tv1Case {
  int32_t kernel;
  std::vector<std::vector<float>> indicators;
  std::vector<std::vector<int32_t>> kept;
};

void PrintTo(const Tv1Case& tv, std::ostream* os) { *os << "kernel " << tv.kernel; }

class CakeTv1Test : public ::testing::TestWithParam<Tv1Case> {};

TEST_P(CakeTv1Test, IndicatorsAndKeptSets) {
  const Tv1Case& tv = GetParam();
  auto policy = MakeCake(CakeConfigFor(tv.kernel));
  TestBackend backend;
  std::vector<TestLayer> layers;
  for (int32_t l = 0; l < 3; ++l) layers.emplace_back(1, 2, 3, 8);
  std::vector<std::vector<float>> probs(3);
  const std::vector<int32_t> queries = {6, 7};
  std::vector<LayerStep> steps;
  for (int32_t l = 0; l < 3; ++l) {
    layers[l].SetPositions(0, kTv1Order);
    for (int32_t r = 0; r < 2; ++r) {
      for (int32_t s = 0; s < 8; ++s) probs[l].push_back(kTv1Rows[l][r][kTv1Order[s]]);
    }
    steps.push_back(layers[l].Step(l, 1, probs[l], queries));
  }
  ASSERT_TRUE(policy->BaseObserve(backend, Phase::kPrefill, steps).ok());
  for (int32_t l = 0; l < 3; ++l) {
    ExpectNear(PrefixIndicator(layers[l], 6), tv.indicators[l], 1e-5);
    for (int32_t s = 0; s < 8; ++s) {
      if (layers[l].Position(0, s) >= 6) {
        EXPECT_EQ(layers[l].state.indicator[s], std::numeric_limits<float>::infinity());
      }
    }
  }
  // Spec budgets [5, 1, 0] plus the window W = 2, selected in one batch.
  const int32_t keep[3] = {7, 3, 2};
  std::vector<std::vector<int32_t>> kept(3);
  std::vector<LayerSelection> selections;
  for (int32_t l = 0; l < 3; ++l) selections.push_back(layers[l].Selection(l, 1, keep[l], kept[l]));
  ASSERT_TRUE(policy->Select(backend, Phase::kPrefill, selections).ok());
  for (int32_t l = 0; l < 3; ++l) {
    EXPECT_THAT(layers[l].KeptPositions(kept[l], 0), ElementsAreArray(tv.kept[l])) << "layer " << l;
  }
  // The raw scores stay finite and non-negative (CAOTE normalises them).
  std::vector<float> raw;
  auto rows = policy->RawScores(backend, Phase::kPrefill, selections[0], raw);
  ASSERT_TRUE(rows.ok());
  EXPECT_EQ(rows->rows, 1);
  EXPECT_EQ(rows->values.size(), 8u);
  for (float x : rows->values) EXPECT_TRUE(std::isfinite(x) && x >= 0.0f);
}

INSTANTIATE_TEST_SUITE_P(Kernels, CakeTv1Test,
                         ::testing::Values(Tv1Case{1,
                                                   {{4.3f, .1f, .1f, .1f, .1f, 4.1f},
                                                    {.375f, .425f, .375f, .425f, .1f, .1f},
                                                    {1.75f, 0, 0, 0, 0, 1.05f}},
                                                   {{0, 1, 2, 3, 5, 6, 7}, {1, 6, 7}, {6, 7}}},
                                           Tv1Case{5,
                                                   {{.90f, .92f, .94f, .90f, .88f, .86f},
                                                    {.235f, .32f, .34f, .285f, .20f, .125f},
                                                    {.35f, .35f, .35f, .21f, .21f, .21f}},
                                                   {{0, 1, 2, 3, 4, 6, 7}, {2, 6, 7}, {6, 7}}}));

// TV5: GQA (Hq = 2, H = 1), d = 2, scale 1/sqrt(2), probabilities from keys and queries.
struct Tv5Case {
  int32_t kernel;
  std::vector<float> indicator;
  std::vector<int32_t> kept;
};

void PrintTo(const Tv5Case& tv, std::ostream* os) { *os << "kernel " << tv.kernel; }

class CakeTv5Test : public ::testing::TestWithParam<Tv5Case> {};

TEST_P(CakeTv5Test, GqaEndToEnd) {
  const Tv5Case& tv = GetParam();
  auto policy = MakeCake(CakeConfigFor(tv.kernel));
  TestBackend backend;
  TestLayer layer(1, 2, 3, 8);
  layer.SetPositions(0, kTv1Order);
  const std::vector<std::vector<float>> keys = {{1, 0},  {0, 1}, {1, 1}, {-1, 0},
                                                {0, -1}, {2, 0}, {0, 2}, {1, -1}};
  for (int32_t s = 0; s < 8; ++s) layer.Set(0, 0, s, keys[layer.Position(0, s)]);
  const std::vector<int32_t> queries = {6, 7};
  const std::vector<float> probs = SoftmaxProbs(layer, 2, {{{2, 0}, {0, 2}}, {{1, 1}, {-1, 1}}},
                                                queries, 1.0f / std::sqrt(2.0f));
  // A[0, 0] of the spec, by position.
  const std::vector<float> a00 = {.1449f, .0352f, .1449f, .0086f, .0352f, .5960f, .0352f, 0};
  for (int32_t s = 0; s < 8; ++s) {
    EXPECT_NEAR(probs[s], a00[layer.Position(0, s)], 1e-4) << "position " << layer.Position(0, s);
  }
  const LayerStep step = layer.Step(0, 2, probs, queries);
  ASSERT_TRUE(policy->BaseObserve(backend, Phase::kPrefill, {&step, 1}).ok());
  ExpectNear(PrefixIndicator(layer, 6), tv.indicator, 2e-4);
  std::vector<int32_t> kept;
  const LayerSelection selection = layer.Selection(0, 2, 5, kept);  // budget 3 + W
  ASSERT_TRUE(policy->Select(backend, Phase::kPrefill, {&selection, 1}).ok());
  EXPECT_THAT(layer.KeptPositions(kept, 0), ElementsAreArray(tv.kept));
}

INSTANTIATE_TEST_SUITE_P(
    Kernels, CakeTv5Test,
    ::testing::Values(
        Tv5Case{1, {0.93775f, 0.98252f, 1.17258f, 1.41601f, 0.08148f, 18.24676f}, {2, 3, 5, 6, 7}},
        Tv5Case{5, {0.61857f, 0.90177f, 0.91807f, 4.37987f, 4.18336f, 3.94885f}, {3, 4, 5, 6, 7}}));

// TV6: decode, b = 2, W = 2, 5 slots after the append; one kv head, two query heads.
struct Tv6Case {
  int32_t kernel;
  std::vector<int32_t> kept;
};

void PrintTo(const Tv6Case& tv, std::ostream* os) { *os << "kernel " << tv.kernel; }

class CakeTv6Test : public ::testing::TestWithParam<Tv6Case> {};

TEST_P(CakeTv6Test, DecodeEvictsOne) {
  const Tv6Case& tv = GetParam();
  auto policy = MakeCake(CakeConfigFor(tv.kernel));
  TestBackend backend;
  TestLayer layer(1, 2, 2, 5);
  layer.SetPositions(0, {3, 0, 4, 1, 2});  // hole-filled slots
  const std::vector<std::vector<float>> keys = {{1, 0}, {0, 1}, {0, 2}, {1, -1}, {1, 1}};
  for (int32_t s = 0; s < 5; ++s) layer.Set(0, 0, s, keys[layer.Position(0, s)]);
  const std::vector<int32_t> queries = {4};
  const std::vector<float> probs =
      SoftmaxProbs(layer, 2, {{{0, 1}}, {{0, 2}}}, queries, 1.0f / std::sqrt(2.0f));
  const std::vector<float> head0 = {.1035f, .2099f, .4257f, .0510f, .2099f};
  for (int32_t s = 0; s < 5; ++s) EXPECT_NEAR(probs[s], head0[layer.Position(0, s)], 1e-4);
  const LayerStep step = layer.Step(0, 2, probs, queries);
  ASSERT_TRUE(policy->BaseObserve(backend, Phase::kDecode, {&step, 1}).ok());
  ASSERT_EQ(layer.state.step_scores.size(), 10u);  // [Hq][count]
  EXPECT_TRUE(layer.state.indicator.empty());
  // Window slots (positions 3, 4) keep their unpooled probabilities.
  for (int32_t q = 0; q < 2; ++q) {
    for (int32_t s = 0; s < 5; ++s) {
      if (layer.Position(0, s) >= 3) {
        EXPECT_EQ(layer.state.step_scores[q * 5 + s], probs[q * 5 + s]);
      }
    }
  }
  std::vector<int32_t> kept;
  const LayerSelection selection = layer.Selection(0, 2, 4, kept);  // b + W
  ASSERT_TRUE(policy->Select(backend, Phase::kDecode, {&selection, 1}).ok());
  EXPECT_THAT(layer.KeptPositions(kept, 0), ElementsAreArray(tv.kept));
  std::vector<float> raw;
  auto rows = policy->RawScores(backend, Phase::kDecode, selection, raw);
  ASSERT_TRUE(rows.ok());
  EXPECT_EQ(rows->rows, 2);
  EXPECT_EQ(rows->values.size(), 10u);
}

INSTANTIATE_TEST_SUITE_P(Kernels, CakeTv6Test,
                         ::testing::Values(Tv6Case{1, {1, 2, 3, 4}}, Tv6Case{5, {0, 1, 3, 4}}));

TEST(CakeTest, AttentionAndWindow) {
  auto policy = MakeCake(CakeConfigFor(5, 32));
  EXPECT_EQ(policy->window_tokens(), 32);
  EXPECT_TRUE(policy->BaseAttention(Phase::kPrefill).needed);
  EXPECT_EQ(policy->BaseAttention(Phase::kPrefill).trailing_queries, 32);
  EXPECT_TRUE(policy->BaseAttention(Phase::kDecode).needed);
  EXPECT_EQ(policy->BaseAttention(Phase::kDecode).trailing_queries, 1);
  EXPECT_FALSE(policy->BaseNeedsAccumulated());
  PolicyConfig config = CakeConfigFor(5);
  ASSERT_TRUE(ResolveCakeConfig(config).ok());
  auto scorer = MakeCakeScorer(config, config.cake);
  ASSERT_NE(scorer, nullptr);
  EXPECT_EQ(scorer->window_tokens(), 2);
  EXPECT_NE(MakeCakePolicy(config), nullptr);
}

TEST(CakeTest, SelectWithoutWindowQueriesNamesTheField) {
  auto policy = MakeCake(CakeConfigFor(5));
  TestBackend backend;
  TestLayer layer(1, 2, 3, 8);
  std::vector<int32_t> kept;
  const LayerSelection selection = layer.Selection(0, 1, 4, kept);
  absl::Status status = policy->Select(backend, Phase::kPrefill, {&selection, 1});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("policy cake needs the window queries"));
  EXPECT_THAT(status.message(), HasSubstr("field attention"));
  status = policy->Select(backend, Phase::kDecode, {&selection, 1});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("attention"));
  // A NaN probability is refused, not folded into the indicator.
  std::vector<float> probs(16, 0.1f);
  probs[5] = std::nanf("");
  const std::vector<int32_t> queries = {6, 7};
  const LayerStep step = layer.Step(0, 1, probs, queries);
  EXPECT_EQ(policy->BaseObserve(backend, Phase::kPrefill, {&step, 1}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(layer.state.indicator.empty());
}

// One window query (w = 1): variance 0, the indicator is the pooled mean.
TEST(CakeTest, ShortWindowHasNoVariance) {
  auto policy = MakeCake(CakeConfigFor(1, 4));
  TestBackend backend;
  TestLayer layer(1, 2, 3, 4);
  const std::vector<float> probs = {.5f, .25f, .125f, .125f};
  const std::vector<int32_t> queries = {3};
  const LayerStep step = layer.Step(0, 1, probs, queries);
  ASSERT_TRUE(policy->BaseObserve(backend, Phase::kPrefill, {&step, 1}).ok());
  ExpectNear(PrefixIndicator(layer, 3), {.5f, .25f, .125f}, 0.0);
  EXPECT_EQ(layer.state.indicator[3], std::numeric_limits<float>::infinity());
}

TEST(CakeConfigTest, ValidationNamesTheField) {
  struct Case {
    void (*mutate)(CakeConfig&);
    const char* message;
  };
  const Case cases[] = {
      {[](CakeConfig& c) { c.window = -1; }, "policy.cake.window must be >= 1, got -1"},
      {[](CakeConfig& c) { c.tau1 = -1; }, "policy.cake.tau1"},
      {[](CakeConfig& c) { c.tau2 = std::numeric_limits<float>::infinity(); }, "policy.cake.tau2"},
      {[](CakeConfig& c) { c.tau1 = std::nanf(""); }, "policy.cake.tau1"},
      {[](CakeConfig& c) { c.gamma = -1; }, "policy.cake.gamma"},
      {[](CakeConfig& c) { c.kernel_size = 4; }, "policy.cake.kernel_size must be odd"},
      {[](CakeConfig& c) { c.kernel_size = -3; }, "policy.cake.kernel_size"},
  };
  for (const Case& c : cases) {
    PolicyConfig config = CakeConfigFor(5);
    c.mutate(config.cake);
    const absl::Status status = ResolveCakeConfig(config);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(status.message(), HasSubstr(c.message));
  }
  CakeConfig zeros{0, 0, 0, 0, 0, false};
  ASSERT_TRUE(ResolveCakeParams(zeros, "policy.caote.cake").ok());
  EXPECT_EQ(zeros.window, 32);
  EXPECT_EQ(zeros.tau1, 1.0f);
  EXPECT_EQ(zeros.tau2, 1.0f);
  EXPECT_EQ(zeros.gamma, 0.0f);  // mean-only indicator is meaningful
  EXPECT_EQ(zeros.kernel_size, 5);
  CakeConfig bad;
  bad.kernel_size = 2;
  EXPECT_THAT(ResolveCakeParams(bad, "policy.caote.cake").message(),
              HasSubstr("policy.caote.cake.kernel_size"));
}

}  // namespace
}  // namespace kvs
