// Layer allocators: cake.md §11 (TV1-TV4, TV5 measure, TV7, the random cascade check), d2o.md §11
// (TV1, TV2), PyramidKV budgets, and the allocator objects driven through AllocationRequest and
// LayerStep the way the sequence drives them.
#include "cache/policy/allocator.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "cache/policy/policy.h"
#include "cache/policy/policy_config.h"
#include "gmock/gmock.h"
#include "gpu/backend.h"
#include "gtest/gtest.h"

namespace kvs {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

constexpr double kInf = std::numeric_limits<double>::infinity();

std::vector<double> Logs(std::vector<double> values) {
  for (double& v : values) v = v > 0 ? std::log(v) : -kInf;
  return values;
}

// cake.md §11 common window rows: [layer][row][position], 1 head, S = 8, W = 2.
const float kCakeRows[3][2][8] = {
    {{.40f, .10f, .10f, .10f, .10f, .00f, .20f, .00f},
     {.20f, .10f, .10f, .10f, .10f, .20f, .10f, .10f}},
    {{.15f, .15f, .15f, .15f, .10f, .10f, .20f, .00f},
     {.10f, .20f, .10f, .20f, .10f, .10f, .10f, .10f}},
    {{.70f, .00f, .00f, .00f, .00f, .10f, .20f, .00f},
     {.80f, .00f, .00f, .00f, .00f, .00f, .10f, .10f}},
};
const double kTv1Entropy[3] = {2.8523595, 3.1635982, 0.6584458};
const double kTv1Shift[3] = {0.04, 0.005, 0.01};

std::vector<float> CakeProbs(int layer) {
  std::vector<float> probs;
  for (int row = 0; row < 2; ++row) {
    probs.insert(probs.end(), kCakeRows[layer][row], kCakeRows[layer][row] + 8);
  }
  return probs;
}

const std::vector<int32_t> kPositions8 = {0, 1, 2, 3, 4, 5, 6, 7};

CakeMeasure Tv1Measure(int layer) {
  const std::vector<float> probs = CakeProbs(layer);
  return CakeLayerMeasure(probs, 1, 2, 8, 1, kPositions8, 6);
}

std::vector<double> Tv1LogPreferences(double tau1, double tau2) {
  std::vector<double> logs;
  for (int l = 0; l < 3; ++l) logs.push_back(CakeLogPreference(Tv1Measure(l), tau1, tau2));
  return logs;
}

TEST(CakeMeasureTest, Tv1EntropyAndShift) {
  for (int l = 0; l < 3; ++l) {
    const CakeMeasure measure = Tv1Measure(l);
    EXPECT_NEAR(measure.entropy, kTv1Entropy[l], 1e-6) << "layer " << l;
    EXPECT_NEAR(measure.shift, kTv1Shift[l], 1e-7) << "layer " << l;
  }
  const double p[3] = {0.11409438, 0.01581799, 0.00658446};
  const std::vector<double> logs = Tv1LogPreferences(1.0, 1.0);
  for (int l = 0; l < 3; ++l) EXPECT_NEAR(std::exp(logs[l]), p[l], 1e-7) << "layer " << l;
}

TEST(CakeMeasureTest, Tv2Temperatures) {
  const double p[3] = {1.6271910, 0.7076975, 0.0433551};
  const std::vector<double> logs = Tv1LogPreferences(0.5, 2.0);
  for (int l = 0; l < 3; ++l) EXPECT_NEAR(std::exp(logs[l]), p[l], 1e-6) << "layer " << l;
}

TEST(CakeMeasureTest, SlotOrderDoesNotMatter) {
  // Same rows with the slots permuted: the prefix is found by position, not by slot.
  const std::vector<int32_t> order = {7, 2, 6, 0, 5, 1, 4, 3};
  const std::vector<float> probs = CakeProbs(0);
  std::vector<float> permuted(16);
  for (int row = 0; row < 2; ++row) {
    for (int s = 0; s < 8; ++s) permuted[row * 8 + s] = probs[row * 8 + order[s]];
  }
  const CakeMeasure measure = CakeLayerMeasure(permuted, 1, 2, 8, 1, order, 6);
  EXPECT_NEAR(measure.entropy, kTv1Entropy[0], 1e-6);
  EXPECT_NEAR(measure.shift, kTv1Shift[0], 1e-7);
}

TEST(CakeMeasureTest, Tv5GqaFromKeysAndQueries) {
  // H_q = 2 over one kv head, d = 2, s = 1/sqrt(2); window queries at positions 6 and 7.
  const double keys[8][2] = {{1, 0}, {0, 1}, {1, 1}, {-1, 0}, {0, -1}, {2, 0}, {0, 2}, {1, -1}};
  const double queries[2][2][2] = {{{2, 0}, {0, 2}}, {{1, 1}, {-1, 1}}};
  std::vector<float> probs(2 * 2 * 8, 0.0f);
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 2; ++i) {
      const int visible = 6 + i + 1;
      double logits[8];
      double top = -kInf;
      for (int j = 0; j < visible; ++j) {
        logits[j] =
            (queries[h][i][0] * keys[j][0] + queries[h][i][1] * keys[j][1]) / std::sqrt(2.0);
        top = std::max(top, logits[j]);
      }
      double sum = 0;
      for (int j = 0; j < visible; ++j) sum += std::exp(logits[j] - top);
      for (int j = 0; j < visible; ++j) {
        probs[(h * 2 + i) * 8 + j] = static_cast<float>(std::exp(logits[j] - top) / sum);
      }
    }
  }
  EXPECT_NEAR(probs[0], .1449, 1e-4);
  EXPECT_NEAR(probs[5], .5960, 1e-4);
  const CakeMeasure measure = CakeLayerMeasure(probs, 2, 2, 8, 1, kPositions8, 6);
  EXPECT_NEAR(measure.entropy, 4.7047951, 1e-5);
  EXPECT_NEAR(measure.shift, 0.2215725, 1e-6);
  EXPECT_NEAR(std::exp(CakeLogPreference(measure, 1, 1)), 1.0424530, 1e-5);
}

TEST(CakeMeasureTest, ZeroShiftIsMinusInfinity) {
  CakeMeasure measure;
  measure.entropy = 1.0;
  EXPECT_EQ(CakeLogPreference(measure, 1, 1), -kInf);
  // One window row: no unbiased variance, so no shift.
  const std::vector<float> row = {.5f, .5f, 0.f};
  const std::vector<int32_t> positions = {0, 1, 2};
  EXPECT_EQ(CakeLayerMeasure(row, 1, 1, 3, 1, positions, 2).shift, 0.0);
}

TEST(CakeAllocateTest, Tv1AndTv2Budgets) {
  const std::vector<int32_t> caps = {6, 6, 6};
  EXPECT_THAT(CakeAllocate(Tv1LogPreferences(1, 1), 6, caps, 0, true), ElementsAre(5, 1, 0));
  EXPECT_THAT(CakeAllocate(Tv1LogPreferences(0.5, 2), 6, caps, 0, true), ElementsAre(4, 2, 0));
}

TEST(CakeAllocateTest, Tv3CascadeStages) {
  const std::vector<double> logs = Tv1LogPreferences(1, 1);
  const std::vector<int32_t> caps = {6, 6, 6};
  EXPECT_THAT(CakeAllocate(absl::MakeSpan(logs).subspan(0, 1), 6,
                           absl::MakeSpan(caps).subspan(0, 1), 0, false),
              ElementsAre(6));
  EXPECT_THAT(CakeAllocate(absl::MakeSpan(logs).subspan(0, 2), 6,
                           absl::MakeSpan(caps).subspan(0, 2), 0, false),
              ElementsAre(6, 1));
  EXPECT_THAT(CakeAllocate(logs, 6, caps, 0, true), ElementsAre(5, 1, 0));
}

TEST(CakeAllocateTest, Tv4Caps) {
  const std::vector<int32_t> caps = {6, 6, 6};
  EXPECT_THAT(CakeAllocate(Logs({8, 1, 1}), 12, caps, 0, true), ElementsAre(6, 3, 3));
  EXPECT_THAT(CakeAllocate(Logs({6, 3, 1}), 12, caps, 0, true), ElementsAre(6, 5, 1));
  EXPECT_THAT(CakeAllocate(Logs({.25, .25, .5}), 8, caps, 1, true), ElementsAre(2, 2, 4));
}

TEST(CakeAllocateTest, Tv7SpecStages) {
  const std::vector<double> logs = Logs({.276, .405, .485, .129, .064});
  const std::vector<int32_t> caps(5, 15);
  const std::vector<std::vector<int32_t>> expected = {
      {5}, {3, 3}, {2, 2, 3}, {2, 2, 2, 1}, {1, 2, 2, 0, 0}};
  for (size_t m = 0; m < 5; ++m) {
    EXPECT_THAT(CakeAllocate(absl::MakeConstSpan(logs).subspan(0, m + 1), 5,
                             absl::MakeConstSpan(caps).subspan(0, m + 1), 0, m == 4),
                ElementsAreArray(expected[m]))
        << "stage " << m;
  }
}

TEST(CakeAllocateTest, EdgeCases) {
  const std::vector<int32_t> caps = {6, 6, 6};
  // Equal preferences: the remainder goes to the lower layers; provisional = ceilings.
  EXPECT_THAT(CakeAllocate({0.0, 0.0, 0.0}, 4, caps, 0, true), ElementsAre(2, 1, 1));
  EXPECT_THAT(CakeAllocate({0.0, 0.0, 0.0}, 4, caps, 0, false), ElementsAre(2, 2, 2));
  // No preference anywhere: uniform.
  EXPECT_THAT(CakeAllocate({-kInf, -kInf, -kInf}, 7, caps, 0, true), ElementsAre(3, 2, 2));
  // Huge and tiny log-preferences neither overflow nor vanish.
  EXPECT_THAT(CakeAllocate({1000.0, 999.0, -1000.0}, 10, {20, 20, 20}, 0, true),
              ElementsAre(7, 3, 0));
  EXPECT_THAT(CakeAllocate({-1e6, -1e6}, 10, {20, 20}, 0, true), ElementsAre(5, 5));
  // A layer without preference gets only the floor, unless every other layer is capped.
  EXPECT_THAT(CakeAllocate({0.0, -kInf}, 6, {10, 10}, 1, true), ElementsAre(5, 1));
  EXPECT_THAT(CakeAllocate({0.0, -kInf, -kInf}, 10, {4, 10, 10}, 1, true), ElementsAre(4, 3, 3));
  // The total is clipped to the caps; nothing for a non-positive total.
  EXPECT_THAT(CakeAllocate({0.0, 0.0}, 100, {3, 5}, 0, true), ElementsAre(3, 5));
  EXPECT_THAT(CakeAllocate({0.0, 0.0}, 0, {3, 5}, 0, true), ElementsAre(0, 0));
  EXPECT_THAT(CakeAllocate({0.0, 0.0}, -5, {3, 5}, 0, false), ElementsAre(0, 0));
  // Below the floors: uniform.
  EXPECT_THAT(CakeAllocate(Logs({9, 1, 1}), 5, caps, 2, true), ElementsAre(2, 2, 1));
  // NaN counts as no preference.
  EXPECT_THAT(CakeAllocate({std::nan(""), 0.0}, 4, {6, 6}, 0, true), ElementsAre(0, 4));
}

// Independent reference: the real water-filling budgets by bisection on the fill level
// (level in [0, 1): the uniform split under the floors; [1, 2): lambda; [2, 3): layers without
// preference share the rest).
std::vector<double> ReferenceFill(const std::vector<double>& logs, int64_t total,
                                  const std::vector<int32_t>& caps, int32_t floor) {
  const size_t n = logs.size();
  double top = -kInf;
  for (double lp : logs) top = std::max(top, lp);
  std::vector<double> p(n, 0.0), f(n);
  int64_t sum_caps = 0;
  for (size_t l = 0; l < n; ++l) {
    if (top > -kInf && logs[l] > -kInf) p[l] = std::exp(logs[l] - top);
    f[l] = std::min(floor, caps[l]);
    sum_caps += caps[l];
  }
  const double target = static_cast<double>(std::clamp<int64_t>(total, 0, sum_caps));
  double max_lambda = 0;
  for (size_t l = 0; l < n; ++l) {
    if (p[l] > 0) max_lambda = std::max(max_lambda, (caps[l] - f[l]) / p[l]);
  }
  const double max_mu = *std::max_element(caps.begin(), caps.end()) + 1.0;
  auto fill = [&](double level) {
    std::vector<double> x(n);
    for (size_t l = 0; l < n; ++l) {
      if (level < 1) {
        x[l] = std::min(f[l], level * max_mu);
      } else if (level < 2) {
        x[l] = f[l] + std::min(caps[l] - f[l], (level - 1) * max_lambda * p[l]);
      } else {
        x[l] = p[l] > 0 ? caps[l] : std::min<double>(caps[l], f[l] + (level - 2) * max_mu);
      }
    }
    return x;
  };
  double lo = 0, hi = 3;
  for (int it = 0; it < 200; ++it) {
    const double mid = (lo + hi) / 2;
    const std::vector<double> x = fill(mid);
    (std::accumulate(x.begin(), x.end(), 0.0) < target ? lo : hi) = mid;
  }
  return fill(hi);
}

TEST(CakeAllocateTest, RandomCascadeMatchesOneShot) {
  std::mt19937 rng(20250311);
  const std::vector<double> palette = {0.0, 0.5, 1.0, 1.0, 2.0, 3.7};
  for (int trial = 0; trial < 300; ++trial) {
    const int num_layers = std::uniform_int_distribution<int>(2, 8)(rng);
    std::vector<double> logs(num_layers);
    std::vector<int32_t> caps(num_layers);
    for (int l = 0; l < num_layers; ++l) {
      const int pick = std::uniform_int_distribution<int>(0, 7)(rng);
      const double value =
          pick < 6 ? palette[pick] : std::uniform_real_distribution<double>(0.01, 5.0)(rng);
      logs[l] = value > 0 ? std::log(value) : -kInf;
      caps[l] = std::uniform_int_distribution<int32_t>(0, 24)(rng);
    }
    const int32_t floor = std::uniform_int_distribution<int32_t>(0, 3)(rng);
    const int64_t sum_caps = std::accumulate(caps.begin(), caps.end(), int64_t{0});
    const int64_t total = std::uniform_int_distribution<int64_t>(0, sum_caps + 10)(rng);
    SCOPED_TRACE(testing::Message()
                 << "trial " << trial << " L=" << num_layers << " T=" << total << " f=" << floor);

    std::vector<int32_t> held;
    std::vector<int32_t> previous;
    for (int m = 0; m < num_layers; ++m) {
      const bool final = m == num_layers - 1;
      const std::vector<int32_t> stage =
          CakeAllocate(absl::MakeConstSpan(logs).subspan(0, m + 1), total,
                       absl::MakeConstSpan(caps).subspan(0, m + 1), floor, final);
      ASSERT_EQ(stage.size(), static_cast<size_t>(m + 1));
      for (int l = 0; l < m; ++l) {
        EXPECT_LE(stage[l], previous[l]) << "layer " << l << " grew at stage " << m;
        held[l] = std::min(held[l], stage[l]);
      }
      held.push_back(stage[m]);
      previous = stage;
    }
    const std::vector<int32_t> one_shot = CakeAllocate(logs, total, caps, floor, true);
    EXPECT_EQ(held, one_shot);
    EXPECT_EQ(std::accumulate(one_shot.begin(), one_shot.end(), int64_t{0}),
              std::min(total, sum_caps));
    const std::vector<double> x = ReferenceFill(logs, total, caps, floor);
    const std::vector<int32_t> provisional = CakeAllocate(logs, total, caps, floor, false);
    for (int l = 0; l < num_layers; ++l) {
      EXPECT_LE(one_shot[l], caps[l]);
      EXPECT_LT(std::abs(one_shot[l] - x[l]), 1.0 + 1e-6) << "layer " << l;
      EXPECT_GE(provisional[l], x[l] - 1e-6) << "layer " << l;
      EXPECT_LT(provisional[l], x[l] + 1.0) << "layer " << l;
    }
  }
}

TEST(D2oMathTest, Tv1Density) {
  const std::vector<float> sums = {11.f / 6, 5.f / 6, 1.f / 3, 3.f, 0.f, 0.f};
  EXPECT_NEAR(D2oLayerDensity(sums, 2, 3, D2oDensityMode::kRaw), 1.791667, 1e-6);
  EXPECT_NEAR(D2oLayerDensity(sums, 2, 3, D2oDensityMode::kHeadNorm), 0.4999998, 1e-7);
  // One head: min == max, so the normalised density is 0.
  EXPECT_EQ(
      D2oLayerDensity(absl::MakeConstSpan(sums).subspan(0, 3), 1, 3, D2oDensityMode::kHeadNorm),
      0.0);
}

TEST(D2oMathTest, Tv2Ratios) {
  const std::vector<double> alpha =
      D2oLayerRatios({0, 0, std::log(2.0), std::log(2.0)}, 0.5, 0.01, 1.0);
  ASSERT_EQ(alpha.size(), 4u);
  const double expected[4] = {2. / 3, 2. / 3, 1. / 3, 1. / 3};
  for (int l = 0; l < 4; ++l) {
    EXPECT_NEAR(alpha[l], expected[l], 1e-12);
    EXPECT_EQ(static_cast<int>(std::floor(alpha[l] * 12 + 1e-9)), l < 2 ? 8 : 4);
  }
  EXPECT_THAT(D2oLayerRatios({0, 10, 10, 10}, 0.5, 0.01, 1.0), ElementsAre(1.0, 0.01, 0.01, 0.01));
  // Raw densities are O(P): no overflow, one layer takes everything.
  const std::vector<double> raw = D2oLayerRatios({5000, 9000}, 0.5, 0.0, 10.0);
  EXPECT_DOUBLE_EQ(raw[0], 1.0);
  EXPECT_DOUBLE_EQ(raw[1], 0.0);
}

TEST(D2oMathTest, Tv2Split) {
  const D2oSplit a = SplitD2oBudget(5, 1, 0.5f);
  EXPECT_EQ(a.sinks, 1);
  EXPECT_EQ(a.heavy, 2);
  EXPECT_EQ(a.recent, 2);
  const D2oSplit b = SplitD2oBudget(410, 4, 0.25f);
  EXPECT_EQ(b.sinks, 4);
  EXPECT_EQ(b.heavy, 305);
  EXPECT_EQ(b.recent, 101);
}

TEST(PyramidTest, BudgetsFallLinearly) {
  EXPECT_THAT(PyramidBudgets(100, 4, 20), ElementsAre(195, 132, 69, 6));
  EXPECT_THAT(PyramidBudgets(100, 1, 20), ElementsAre(100));
  EXPECT_TRUE(PyramidBudgets(100, 0, 20).empty());
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int32_t budget = std::uniform_int_distribution<int32_t>(1, 5000)(rng);
    const int32_t layers = std::uniform_int_distribution<int32_t>(2, 80)(rng);
    const float beta = std::uniform_real_distribution<float>(1.0f, 40.0f)(rng);
    const std::vector<int32_t> b = PyramidBudgets(budget, layers, beta);
    ASSERT_EQ(b.size(), static_cast<size_t>(layers));
    const int64_t min_budget = static_cast<int64_t>(std::floor(budget / static_cast<double>(beta)));
    EXPECT_EQ(b[0], 2 * budget - min_budget);
    for (int l = 1; l < layers; ++l) EXPECT_LE(b[l], b[l - 1]);
    EXPECT_GE(b.back(), min_budget);
    const int64_t sum = std::accumulate(b.begin(), b.end(), int64_t{0});
    // Integer steps round down: the sum is at least L * budget, at most L^2 / 2 more.
    EXPECT_GE(sum, int64_t{layers} * budget);
    EXPECT_LE(sum, int64_t{layers} * budget + int64_t{layers} * layers / 2);
  }
}

// --- Allocator objects -------------------------------------------------------------------

AllocationRequest Request(int32_t budget, const std::vector<int32_t>& counts,
                          std::vector<LayerPolicyState>& states, Phase phase = Phase::kPrefill) {
  AllocationRequest request;
  request.phase = phase;
  request.budget = budget;
  request.counts = counts;
  request.states = absl::MakeSpan(states);
  request.block_tokens = 16;
  return request;
}

TEST(LayerAllocatorTest, FactoryPicksByName) {
  PolicyConfig config;
  config.name = kPolicyD2o;
  EXPECT_TRUE(MakeLayerAllocator(config)->needs_accumulated());
  EXPECT_TRUE(MakeLayerAllocator(config)->attention(Phase::kPrefill).needed);
  EXPECT_EQ(MakeLayerAllocator(config)->attention(Phase::kPrefill).trailing_queries, 0);
  EXPECT_FALSE(MakeLayerAllocator(config)->attention(Phase::kDecode).needed);

  config.name = kPolicyCake;
  config.cake.window = 12;
  EXPECT_EQ(CakeWindowFor(config), 12);
  EXPECT_EQ(MakeLayerAllocator(config)->attention(Phase::kPrefill).trailing_queries, 12);
  EXPECT_FALSE(MakeLayerAllocator(config)->attention(Phase::kDecode).needed);
  EXPECT_FALSE(MakeLayerAllocator(config)->needs_accumulated());

  config.name = kPolicyCaote;
  config.caote.base = CaoteBase::kCake;
  config.caote.cake.window = 9;
  EXPECT_EQ(CakeWindowFor(config), 9);
  EXPECT_EQ(MakeLayerAllocator(config)->attention(Phase::kPrefill).trailing_queries, 9);
  config.caote.base = CaoteBase::kH2o;
  EXPECT_FALSE(MakeLayerAllocator(config)->attention(Phase::kPrefill).needed);

  config.name = kPolicySnapKv;
  config.snapkv.window = 5;
  EXPECT_FALSE(MakeLayerAllocator(config)->attention(Phase::kPrefill).needed);
  config.allocator.kind = LayerAllocatorKind::kCake;
  EXPECT_EQ(CakeWindowFor(config), 5);
  EXPECT_EQ(MakeLayerAllocator(config)->attention(Phase::kPrefill).trailing_queries, 5);

  config.name = kPolicyKeyDiff;
  EXPECT_EQ(CakeWindowFor(config), 12);
  config.allocator.kind = LayerAllocatorKind::kDefault;
  EXPECT_FALSE(MakeLayerAllocator(config)->attention(Phase::kPrefill).needed);
  EXPECT_FALSE(MakeLayerAllocator(config)->needs_accumulated());
}

TEST(LayerAllocatorTest, UniformCapsByCountAndAppliesFloor) {
  PolicyConfig config;
  std::vector<LayerPolicyState> states(3);
  const std::vector<int32_t> counts = {10, 3, 20};
  auto allocation = MakeLayerAllocator(config)->Allocate(Request(8, counts, states));
  ASSERT_TRUE(allocation.ok()) << allocation.status();
  EXPECT_THAT(allocation->keep, ElementsAre(8, 3, 8));
  EXPECT_EQ(allocation->floor_applied_layers, 0);

  config.allocator.min_layer_tokens = 12;
  allocation = MakeLayerAllocator(config)->Allocate(Request(8, counts, states));
  ASSERT_TRUE(allocation.ok());
  // Layer 1 simply holds fewer tokens: not raised, not counted.
  EXPECT_THAT(allocation->keep, ElementsAre(10, 3, 12));
  EXPECT_EQ(allocation->floor_applied_layers, 2);

  EXPECT_EQ(MakeLayerAllocator(config)->Allocate(Request(0, counts, states)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(LayerAllocatorTest, PyramidThroughRequest) {
  PolicyConfig config;
  config.allocator.kind = LayerAllocatorKind::kPyramidKv;
  config.allocator.min_layer_tokens = 10;
  std::vector<LayerPolicyState> states(4);
  const std::vector<int32_t> counts = {150, 200, 200, 4};
  auto allocation = MakeLayerAllocator(config)->Allocate(Request(100, counts, states));
  ASSERT_TRUE(allocation.ok()) << allocation.status();
  EXPECT_THAT(allocation->keep, ElementsAre(150, 132, 69, 4));
  EXPECT_EQ(allocation->floor_applied_layers, 0);

  const std::vector<int32_t> full = {200, 200, 200, 200};
  allocation = MakeLayerAllocator(config)->Allocate(Request(100, full, states));
  ASSERT_TRUE(allocation.ok());
  EXPECT_THAT(allocation->keep, ElementsAre(195, 132, 69, 10));  // 6 raised to the floor
  EXPECT_EQ(allocation->floor_applied_layers, 1);
}

// Two layers of 12 tokens, 2 query heads: layer 0's heads have equal variance (headnorm F = 0),
// layer 1's differ (F ~ 0.5).
std::vector<LayerPolicyState> D2oStates() {
  std::vector<LayerPolicyState> states(2);
  for (int h = 0; h < 2; ++h) {
    for (int j = 0; j < 12; ++j) states[0].accumulated.push_back(j % 2 ? 1.0f : 3.0f);
    for (int j = 0; j < 12; ++j) states[1].accumulated.push_back(h == 0 ? 1.0f : (j % 3) * 2.0f);
  }
  return states;
}

TEST(LayerAllocatorTest, D2oAllocatesFreezesAndKeepsFrozen) {
  PolicyConfig config;
  config.name = kPolicyD2o;
  config.allocator.min_layer_tokens = 1;
  auto allocator = MakeLayerAllocator(config);
  std::vector<LayerPolicyState> states = D2oStates();
  const std::vector<int32_t> counts = {12, 12};
  // rho = 6 / 12; alpha = 2 * rho * softmax(-[0, 0.5]) = [.62246, .37754]; B = floor(12 alpha).
  auto allocation = allocator->Allocate(Request(6, counts, states));
  ASSERT_TRUE(allocation.ok()) << allocation.status();
  EXPECT_THAT(allocation->keep, ElementsAre(7, 4));
  EXPECT_EQ(states[0].frozen_budget, 7);
  EXPECT_EQ(states[1].frozen_budget, 4);
  EXPECT_EQ(states[0].frozen_for, 6);

  // Decode: the frozen budgets rule, whatever the attention says now.
  states[0].accumulated.clear();
  states[1].accumulated.assign(24, 0.0f);
  const std::vector<int32_t> decode = {8, 5};
  allocation = allocator->Allocate(Request(6, decode, states, Phase::kDecode));
  ASSERT_TRUE(allocation.ok()) << allocation.status();
  EXPECT_THAT(allocation->keep, ElementsAre(7, 4));

  // A different budget recomputes, and needs the attention of every layer again.
  auto missing = allocator->Allocate(Request(5, decode, states, Phase::kDecode));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(missing.status().message(), HasSubstr("policy d2o"));
  EXPECT_THAT(missing.status().message(), HasSubstr("every layer"));
}

TEST(LayerAllocatorTest, D2oFloorFullCacheLayersAndMissingAttention) {
  PolicyConfig config;
  config.name = kPolicyD2o;
  const std::vector<int32_t> counts = {12, 12};
  {
    std::vector<LayerPolicyState> states = D2oStates();
    // Default floor = min(16, 6) = 6: layer 1 (4) is raised.
    auto allocation = MakeLayerAllocator(config)->Allocate(Request(6, counts, states));
    ASSERT_TRUE(allocation.ok()) << allocation.status();
    EXPECT_THAT(allocation->keep, ElementsAre(7, 6));
    EXPECT_EQ(allocation->floor_applied_layers, 1);
  }
  {
    config.allocator.min_layer_tokens = 1;
    config.d2o.full_cache_layers = {1};
    std::vector<LayerPolicyState> states = D2oStates();
    auto allocator = MakeLayerAllocator(config);
    auto allocation = allocator->Allocate(Request(6, counts, states));
    ASSERT_TRUE(allocation.ok()) << allocation.status();
    // Layer 1 still takes part in the softmax, and is never compressed.
    EXPECT_THAT(allocation->keep, ElementsAre(7, 12));
    const std::vector<int32_t> grown = {8, 40};
    allocation = allocator->Allocate(Request(6, grown, states, Phase::kDecode));
    ASSERT_TRUE(allocation.ok());
    EXPECT_THAT(allocation->keep, ElementsAre(7, 40));
  }
  {
    std::vector<LayerPolicyState> states = D2oStates();
    states[1].accumulated.clear();
    auto allocator = MakeLayerAllocator(config);
    // Nothing over the budget yet: nothing to compress, nothing frozen, no attention needed.
    const std::vector<int32_t> small = {5, 6};
    auto allocation = allocator->Allocate(Request(6, small, states));
    ASSERT_TRUE(allocation.ok()) << allocation.status();
    EXPECT_THAT(allocation->keep, ElementsAre(5, 6));
    EXPECT_EQ(states[0].frozen_budget, 0);
    allocation = allocator->Allocate(Request(6, counts, states));
    EXPECT_EQ(allocation.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(allocation.status().message(), HasSubstr("send attention (all prompt queries)"));
    EXPECT_EQ(states[0].frozen_budget, 0);
  }
}

// Observes cake.md §11 layer `layer` through LayerStep: `extra_rows` leading query rows of
// noise come before the two window rows (only the trailing W are the window).
absl::Status ObserveCakeLayer(const LayerAllocator& allocator, int layer, LayerPolicyState& state,
                              int extra_rows = 0) {
  std::vector<float> probs;
  std::vector<int32_t> query_positions;
  for (int r = 0; r < extra_rows; ++r) {
    for (int j = 0; j < 8; ++j) probs.push_back(j == 3 ? 1.0f : 0.0f);
    query_positions.push_back(6 - extra_rows + r);
  }
  const std::vector<float> window = CakeProbs(layer);
  probs.insert(probs.end(), window.begin(), window.end());
  query_positions.push_back(6);
  query_positions.push_back(7);
  LayerStep step;
  step.layer = layer;
  step.keys.count = 8;
  step.keys.num_kv_heads = 1;
  step.positions = kPositions8;
  step.num_q_heads = 1;
  step.probs = probs;
  step.num_queries = 2 + extra_rows;
  step.query_positions = query_positions;
  step.step_queries = step.num_queries;
  step.state = &state;
  return allocator.Observe(*MakeCpuBackend(1), Phase::kPrefill, step);
}

PolicyConfig CakeConfig3(int32_t min_layer_tokens) {
  PolicyConfig config;
  config.name = kPolicyCake;
  config.cake.window = 2;
  config.allocator.min_layer_tokens = min_layer_tokens;
  return config;
}

TEST(LayerAllocatorTest, CakeObserveMeasuresTheTrailingWindow) {
  auto allocator = MakeLayerAllocator(CakeConfig3(1));
  for (int extra : {0, 1, 3}) {
    LayerPolicyState state;
    ASSERT_TRUE(ObserveCakeLayer(*allocator, 0, state, extra).ok());
    EXPECT_TRUE(state.measured);
    EXPECT_NEAR(std::exp(state.preference), 0.11409438, 1e-7) << extra;
  }
  // Decode attention does not measure.
  LayerPolicyState state;
  LayerStep step;
  step.state = &state;
  EXPECT_TRUE(allocator->Observe(*MakeCpuBackend(1), Phase::kDecode, step).ok());
  EXPECT_FALSE(state.measured);
  // Malformed probabilities are an error naming the field.
  std::vector<float> probs(5, 0.1f);
  step.keys.count = 8;
  step.keys.num_kv_heads = 1;
  step.positions = kPositions8;
  step.num_q_heads = 1;
  step.probs = probs;
  step.num_queries = 2;
  const std::vector<int32_t> qpos = {6, 7};
  step.query_positions = qpos;
  const absl::Status status = allocator->Observe(*MakeCpuBackend(1), Phase::kPrefill, step);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("attention"));
  EXPECT_FALSE(state.measured);
}

TEST(LayerAllocatorTest, CakeCascadeThroughObserve) {
  auto allocator = MakeLayerAllocator(CakeConfig3(1));
  std::vector<LayerPolicyState> states(3);
  std::vector<int32_t> counts = {8, 8, 8};
  const std::vector<std::vector<int32_t>> expected = {{8, 8, 8}, {8, 3, 8}, {7, 3, 2}};
  for (int m = 0; m < 3; ++m) {
    ASSERT_TRUE(ObserveCakeLayer(*allocator, m, states[m]).ok());
    auto allocation = allocator->Allocate(Request(4, counts, states));
    ASSERT_TRUE(allocation.ok()) << allocation.status();
    EXPECT_THAT(allocation->keep, ElementsAreArray(expected[m])) << "stage " << m;
    EXPECT_EQ(allocation->floor_applied_layers, 0);
    EXPECT_EQ(states[0].frozen_budget != 0, m == 2) << "stage " << m;
    counts = allocation->keep;  // the sequence compacts to what was kept
  }
  EXPECT_EQ(states[0].frozen_budget, 7);
  EXPECT_EQ(states[1].frozen_budget, 3);
  EXPECT_EQ(states[2].frozen_budget, 2);
  EXPECT_EQ(states[2].frozen_for, 4);
  // Decode: one new token per layer, back to the frozen budgets.
  const std::vector<int32_t> decode = {8, 4, 3};
  auto allocation = allocator->Allocate(Request(4, decode, states, Phase::kDecode));
  ASSERT_TRUE(allocation.ok());
  EXPECT_THAT(allocation->keep, ElementsAre(7, 3, 2));
}

TEST(LayerAllocatorTest, CakeFloorsAreCounted) {
  // Default floor min(16, budget 4) = 4: layers 1 and 2 are raised at the final stage.
  auto allocator = MakeLayerAllocator(CakeConfig3(0));
  std::vector<LayerPolicyState> states(3);
  for (int l = 0; l < 3; ++l) ASSERT_TRUE(ObserveCakeLayer(*allocator, l, states[l]).ok());
  const std::vector<int32_t> counts = {8, 8, 8};
  auto allocation = allocator->Allocate(Request(4, counts, states));
  ASSERT_TRUE(allocation.ok()) << allocation.status();
  EXPECT_THAT(allocation->keep, ElementsAre(7, 4, 4));
  EXPECT_EQ(allocation->floor_applied_layers, 2);
  EXPECT_EQ(states[1].frozen_budget, 4);
}

TEST(LayerAllocatorTest, CakeNonCascadingWaitsForEveryLayer) {
  PolicyConfig config = CakeConfig3(1);
  config.cake.non_cascading = true;
  auto allocator = MakeLayerAllocator(config);
  std::vector<LayerPolicyState> states(3);
  const std::vector<int32_t> counts = {8, 8, 8};
  for (int m = 0; m < 3; ++m) {
    ASSERT_TRUE(ObserveCakeLayer(*allocator, m, states[m]).ok());
    auto allocation = allocator->Allocate(Request(4, counts, states));
    ASSERT_TRUE(allocation.ok());
    if (m < 2) {
      EXPECT_THAT(allocation->keep, ElementsAre(8, 8, 8));
      EXPECT_EQ(states[0].frozen_budget, 0);
    } else {
      EXPECT_THAT(allocation->keep, ElementsAre(7, 3, 2));
    }
  }
}

TEST(LayerAllocatorTest, CakePromptFitFreezesTheUniformBudget) {
  auto allocator = MakeLayerAllocator(CakeConfig3(1));
  std::vector<LayerPolicyState> states(3);
  for (int l = 0; l < 3; ++l) ASSERT_TRUE(ObserveCakeLayer(*allocator, l, states[l]).ok());
  // Budget 8: T = 18 >= the caps 4 + 5 + 6, nothing evicted; every layer may then grow to the
  // uniform 8 in decode (cake.md step 7), not just to what it held.
  const std::vector<int32_t> counts = {6, 7, 8};
  auto allocation = allocator->Allocate(Request(8, counts, states));
  ASSERT_TRUE(allocation.ok());
  EXPECT_THAT(allocation->keep, ElementsAre(6, 7, 8));
  EXPECT_EQ(states[0].frozen_budget, 8);
  EXPECT_EQ(states[0].frozen_for, 8);
  const std::vector<int32_t> decode = {7, 8, 9};
  allocation = allocator->Allocate(Request(8, decode, states, Phase::kDecode));
  ASSERT_TRUE(allocation.ok());
  EXPECT_THAT(allocation->keep, ElementsAre(7, 8, 8));
}

// kvpress 0.5.5's PyramidKVPress.get_layer_budget (docs/policies/snapkv_kvpress_defaults.md),
// hand-computed.
TEST(KvpressPyramidTest, CapFallbackAndRounding) {
  // B 128 of T 256, window 64: max = 249.6 >= T - w = 192 -> max 192, min 2B - 192 = 64 >= w;
  // steps 128 / 3 -> 192, 149.33, 106.67, 64.
  std::vector<int32_t> got;
  for (int32_t l = 0; l < 4; ++l) got.push_back(KvpressPyramidBudget(128, 256, 4, l, 20, 64));
  EXPECT_THAT(got, ElementsAre(192, 149, 107, 64));
  // B 64 of 256: min = 3.2 < w = 64 -> uniform SnapKV (the paper would give 125, 85, 45, 5).
  got.clear();
  for (int32_t l = 0; l < 4; ++l) got.push_back(KvpressPyramidBudget(64, 256, 4, l, 20, 64));
  EXPECT_THAT(got, ElementsAre(64, 64, 64, 64));
  // Neither: B 100 of 1000, beta 2, window 10 -> min 50, max 150, steps 50.
  got.clear();
  for (int32_t l = 0; l < 3; ++l) got.push_back(KvpressPyramidBudget(100, 1000, 3, l, 2, 10));
  EXPECT_THAT(got, ElementsAre(150, 100, 50));
  // Halves round to even, as Python's round(): 7.5 -> 8, 2.5 -> 2.
  EXPECT_EQ(KvpressPyramidBudget(5, 100, 2, 0, 2, 1), 8);
  EXPECT_EQ(KvpressPyramidBudget(5, 100, 2, 1, 2, 1), 2);
  // One layer: max itself (steps 0).
  EXPECT_EQ(KvpressPyramidBudget(100, 1000, 1, 0, 2, 10), 150);
}

TEST(LayerAllocatorTest, SnapKvKvpressDefaultsBringKvpressPyramid) {
  PolicyConfig config;
  config.name = kPolicySnapKv;
  config.snapkv.window = 64;
  config.snapkv.defaults = SnapKvDefaults::kKvpress;
  config.allocator.kind = LayerAllocatorKind::kPyramidKv;
  std::vector<LayerPolicyState> states(4);
  const std::vector<int32_t> counts = {256, 256, 256, 256};
  auto allocation = MakeLayerAllocator(config)->Allocate(Request(128, counts, states));
  ASSERT_TRUE(allocation.ok()) << allocation.status();
  EXPECT_THAT(allocation->keep, ElementsAre(192, 149, 107, 64));
  allocation = MakeLayerAllocator(config)->Allocate(Request(64, counts, states));
  ASSERT_TRUE(allocation.ok());
  EXPECT_THAT(allocation->keep, ElementsAre(64, 64, 64, 64));
  // The paper's set keeps the paper's pyramid: 250, 169, 88, 7 -> the floor (16) on the top.
  config.snapkv.defaults = SnapKvDefaults::kPaper;
  allocation = MakeLayerAllocator(config)->Allocate(Request(128, counts, states));
  ASSERT_TRUE(allocation.ok());
  EXPECT_THAT(allocation->keep, ElementsAre(250, 169, 88, 16));
}

}  // namespace
}  // namespace kvs
