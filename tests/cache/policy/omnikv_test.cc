// The spec's arithmetic for OmniKV (policies/omnikv.md §13): layer plans (TV4), budgets (TV3),
// candidate scores and top-k through the CPU backend (TV1, TV1b, TV2, TV6).
#include "cache/policy/omnikv.h"

#include <cmath>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvs {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

OmniKvConfig Config(std::vector<int32_t> filters, int32_t wait = 1) {
  OmniKvConfig config;
  config.filter_layers = std::move(filters);
  config.wait_layers = wait;
  return config;
}

std::vector<int32_t> DenseLayers(const OmniKvPlan& plan) {
  std::vector<int32_t> dense;
  for (size_t l = 0; l < plan.roles.size(); ++l) {
    if (plan.roles[l] != OmniKvRole::kSparse) dense.push_back(static_cast<int32_t>(l));
  }
  return dense;
}

TEST(OmniKvPlanTest, PaperPlansTv4) {
  auto llama = PlanOmniKvLayers(Config({2, 8, 18}), 32);
  ASSERT_TRUE(llama.ok()) << llama.status();
  EXPECT_THAT(DenseLayers(*llama), ElementsAre(0, 1, 2, 3, 8, 9, 18, 19));
  EXPECT_THAT(llama->sparse[0], ElementsAre(4, 5, 6, 7));
  EXPECT_EQ(llama->sparse[1].size(), 8u);
  EXPECT_EQ(llama->sparse[2].size(), 12u);
  EXPECT_EQ(llama->feeding_filter[20], 18);
  EXPECT_EQ(llama->roles[0], OmniKvRole::kPrefix);
  EXPECT_EQ(llama->roles[9], OmniKvRole::kWait);

  auto seventy = PlanOmniKvLayers(Config({4, 19, 41}), 80);
  ASSERT_TRUE(seventy.ok());
  EXPECT_THAT(DenseLayers(*seventy), ElementsAre(0, 1, 2, 3, 4, 5, 19, 20, 41, 42));

  auto yi = PlanOmniKvLayers(Config({6, 11, 30}), 48);
  ASSERT_TRUE(yi.ok());
  EXPECT_EQ(DenseLayers(*yi).size(), 12u);

  auto wait2 = PlanOmniKvLayers(Config({2, 8, 18}, 2), 32);
  ASSERT_TRUE(wait2.ok());
  EXPECT_THAT(DenseLayers(*wait2), ElementsAre(0, 1, 2, 3, 4, 8, 9, 10, 18, 19, 20));
}

TEST(OmniKvPlanTest, Tv7Roles) {
  auto plan = PlanOmniKvLayers(Config({1, 4}), 8);
  ASSERT_TRUE(plan.ok());
  EXPECT_THAT(plan->roles, ElementsAre(OmniKvRole::kPrefix, OmniKvRole::kFilter, OmniKvRole::kWait,
                                       OmniKvRole::kSparse, OmniKvRole::kFilter, OmniKvRole::kWait,
                                       OmniKvRole::kSparse, OmniKvRole::kSparse));
}

// Gemma 3 270M's 18 layers: five sliding-window layers, then a global one (5, 11, 17). The
// windowed layers are dense wherever they sit; the global layers past the wait layer are sparse.
TEST(OmniKvPlanTest, SlidingWindowLayersAreNeitherFiltersNorSparse) {
  std::vector<int32_t> windows(18, 512);
  for (int32_t global : {5, 11, 17}) windows[global] = 0;
  auto plan = PlanOmniKvLayers(Config({5}), 18, windows);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(plan->sparse[0], ElementsAre(11, 17));
  EXPECT_THAT(DenseLayers(*plan),
              ElementsAre(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16));
  EXPECT_EQ(plan->roles[5], OmniKvRole::kFilter);
  EXPECT_EQ(plan->roles[6], OmniKvRole::kWindowed);  // the wait layer is a windowed one here
  EXPECT_EQ(plan->roles[0], OmniKvRole::kWindowed);
  EXPECT_EQ(plan->feeding_filter[17], 5);
  EXPECT_EQ(plan->feeding_filter[12], -1);
  // A full-attention wait layer stays a wait layer; the one after it is sparse.
  windows[6] = 0;
  windows[7] = 0;
  auto waiting = PlanOmniKvLayers(Config({5}), 18, windows);
  ASSERT_TRUE(waiting.ok());
  EXPECT_EQ(waiting->roles[6], OmniKvRole::kWait);
  EXPECT_THAT(waiting->sparse[0], ElementsAre(7, 11, 17));
  // All zeros is no window: the plan without windows.
  auto none = PlanOmniKvLayers(Config({5}), 18, std::vector<int32_t>(18, 0));
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->roles, PlanOmniKvLayers(Config({5}), 18)->roles);
}

TEST(OmniKvPlanTest, RefusesASlidingWindowFilterLayer) {
  std::vector<int32_t> windows(18, 512);
  windows[5] = 0;
  EXPECT_THAT(std::string(PlanOmniKvLayers(Config({5, 8}), 18, windows).status().message()),
              HasSubstr("policy.omnikv.filter_layers[1] = 8 is a sliding-window layer "
                        "(layer_windows[8] = 512)"));
}

TEST(OmniKvPlanTest, RejectsBadFilterLayers) {
  EXPECT_THAT(std::string(PlanOmniKvLayers(Config({}), 8).status().message()),
              HasSubstr("filter_layers is empty"));
  EXPECT_THAT(std::string(PlanOmniKvLayers(Config({1, 8}), 8).status().message()),
              HasSubstr("filter_layers[1] = 8 is outside the model's 8 layers"));
  EXPECT_THAT(std::string(PlanOmniKvLayers(Config({4, 4}), 8).status().message()),
              HasSubstr("strictly ascending"));
  EXPECT_THAT(DefaultOmniKvFilterLayers(32), ElementsAre(2, 8, 18));
  EXPECT_TRUE(DefaultOmniKvFilterLayers(30).empty());
}

TEST(OmniKvBudgetTest, Tv3) {
  OmniKvConfig config;
  config.selected_fraction = 0.067f;
  EXPECT_EQ(ResolveOmniKvBudget(config, 131072), 8781);
  config.selected_tokens = 2048;
  EXPECT_EQ(ResolveOmniKvBudget(config, 1000), 1000);
  EXPECT_EQ(ResolveOmniKvBudget(config, 0), 0);
}

TEST(OmniKvConfigTest, ResolvesDefaultsAndRejectsBadValues) {
  PolicyConfig config;
  config.name = kPolicyOmniKv;
  config.omnikv.wait_layers = 0;
  config.omnikv.selected_fraction = 0.0f;
  config.omnikv.window = 0;
  ASSERT_TRUE(ResolveOmniKvConfig(config).ok());
  EXPECT_EQ(config.omnikv.wait_layers, 1);
  EXPECT_FLOAT_EQ(config.omnikv.selected_fraction, 0.067f);
  EXPECT_EQ(config.omnikv.window, 16);
  PolicyConfig bad = config;
  bad.omnikv.selected_fraction = 1.5f;
  EXPECT_THAT(std::string(ResolveOmniKvConfig(bad).message()),
              HasSubstr("policy.omnikv.selected_fraction must be in (0, 1]"));
  bad = config;
  bad.omnikv.selected_tokens = -1;
  EXPECT_THAT(std::string(ResolveOmniKvConfig(bad).message()),
              HasSubstr("policy.omnikv.selected_tokens"));
  bad = config;
  bad.allocator.kind = LayerAllocatorKind::kPyramidKv;
  EXPECT_THAT(std::string(ResolveOmniKvConfig(bad).message()), HasSubstr("policy.allocator"));
}

// Logits z[h][t] = s * <q_h, K[g(h)][t]> of the TV1 inputs (Hq 4, Hkv 2, d 4, s 1/2, N 6).
std::vector<float> Tv1Logits() {
  const float k[2][6][4] = {
      {{1, 0, 0, 0}, {0, 2, 0, 0}, {0, 0, 0, 0}, {3, 0, 0, 0}, {0, 0, 1, 0}, {0, 1, 0, 0}},
      {{0, 0, 0, 0}, {0, 0, 0, 0}, {4, 0, 0, 0}, {0, 0, 0, 0}, {0, 0, 0, 2}, {0, 0, 0, 0}}};
  const float q[4][4] = {{2, 0, 0, 0}, {0, 2, 0, 0}, {1, 0, 0, 0}, {0, 0, 0, 1.5f}};
  std::vector<float> z(4 * 6);
  for (int h = 0; h < 4; ++h) {
    for (int t = 0; t < 6; ++t) {
      float dot = 0;
      for (int i = 0; i < 4; ++i) dot += q[h][i] * k[h / 2][t][i];
      z[h * 6 + t] = 0.5f * dot;
    }
  }
  return z;
}

std::vector<float> SoftmaxRows(const std::vector<float>& z, int rows, int n) {
  std::vector<float> p(z.size());
  for (int r = 0; r < rows; ++r) {
    float max = -INFINITY, sum = 0;
    for (int t = 0; t < n; ++t) max = std::max(max, z[r * n + t]);
    for (int t = 0; t < n; ++t) sum += std::exp(z[r * n + t] - max);
    for (int t = 0; t < n; ++t) p[r * n + t] = std::exp(z[r * n + t] - max) / sum;
  }
  return p;
}

// Top-k through the CPU backend's TopK (ties to the lower index), ascending.
std::vector<int32_t> TopK(const std::vector<float>& scores, int32_t k) {
  std::unique_ptr<Backend> backend = MakeCpuBackend(1);
  std::vector<int32_t> positions(scores.size());
  for (size_t i = 0; i < positions.size(); ++i) positions[i] = static_cast<int32_t>(i);
  std::vector<int32_t> kept(k);
  TopKJob job;
  job.scores = scores.data();
  job.positions = positions.data();
  job.rows = 1;
  job.n = static_cast<int32_t>(scores.size());
  job.k = k;
  job.kept = kept.data();
  EXPECT_TRUE(backend->TopK({&job, 1}, nullptr).ok());
  return kept;
}

TEST(OmniKvScoresTest, Tv1LastWithTies) {
  const std::vector<float> z = Tv1Logits();
  std::vector<float> s(6);
  OmniKvCandidateScores(OmniKvSelector::kLast, z, 4, 1, 6, absl::MakeSpan(s));
  EXPECT_THAT(s, ElementsAre(1, 2, 2, 3, 1.5f, 1));
  EXPECT_THAT(TopK(s, 2), ElementsAre(1, 3));
  EXPECT_THAT(TopK(s, 3), ElementsAre(1, 2, 3));
  EXPECT_THAT(TopK(s, 5), ElementsAre(0, 1, 2, 3, 4));
  EXPECT_THAT(TopK(s, 6), ElementsAre(0, 1, 2, 3, 4, 5));
  EXPECT_TRUE(TopK(s, 0).empty());
}

TEST(OmniKvScoresTest, Tv1bSoftmaxBeforeLast) {
  const std::vector<float> p = SoftmaxRows(Tv1Logits(), 4, 6);
  std::vector<float> s(6);
  OmniKvCandidateScores(OmniKvSelector::kSoftmaxBeforeLast, p, 4, 1, 6, absl::MakeSpan(s));
  const float expected[] = {0.105466f, 0.523774f, 0.596418f, 0.749354f, 0.472668f, 0.192686f};
  for (int t = 0; t < 6; ++t) EXPECT_NEAR(s[t], expected[t], 1e-5f) << t;
  EXPECT_THAT(TopK(s, 2), ElementsAre(2, 3));
  EXPECT_THAT(TopK(s, 3), ElementsAre(1, 2, 3));
}

TEST(OmniKvScoresTest, Tv2WindowSelectors) {
  // W = 2, Hq = Hkv = 1, d = 2, s = 1; K = (1,0), (0,1), (0,0), (0,0).
  const float l9 = std::log(9.0f), l5 = std::log(5.0f);
  const std::vector<float> z = {l9, 0, 0, 0, /*new*/ 0, l5, 0, 0};
  const std::vector<float> p = SoftmaxRows(z, 2, 4);  // [h=1][w=2][4]
  std::vector<float> s(4);
  OmniKvCandidateScores(OmniKvSelector::kUniform, p, 1, 2, 4, absl::MakeSpan(s));
  EXPECT_NEAR(s[0], 0.875f, 1e-6f);
  EXPECT_NEAR(s[1], 0.708333f, 1e-6f);
  EXPECT_NEAR(s[2], 0.208333f, 1e-6f);
  EXPECT_THAT(TopK(s, 1), ElementsAre(0));
  EXPECT_THAT(TopK(s, 2), ElementsAre(0, 1));
  OmniKvCandidateScores(OmniKvSelector::kExp, p, 1, 2, 4, absl::MakeSpan(s));
  EXPECT_NEAR(s[0], 0.5f, 1e-6f);
  EXPECT_NEAR(s[1], 0.666667f, 1e-6f);
  EXPECT_NEAR(s[2], 0.166667f, 1e-6f);
  EXPECT_THAT(TopK(s, 1), ElementsAre(1));
  EXPECT_THAT(TopK(s, 3), ElementsAre(0, 1, 2));
  // last: the newest query's logits only.
  const std::vector<float> last(z.begin() + 4, z.end());
  OmniKvCandidateScores(OmniKvSelector::kLast, last, 1, 1, 4, absl::MakeSpan(s));
  EXPECT_THAT(TopK(s, 1), ElementsAre(1));
}

TEST(OmniKvScoresTest, Tv6PortableFormula) {
  const int hq = 4, n = 16, d = 4;
  std::vector<float> z(hq * n);
  for (int h = 0; h < hq; ++h) {
    for (int t = 0; t < n; ++t) {
      float dot = 0;
      for (int i = 0; i < d; ++i) {
        const float key = static_cast<float>(((7 * t + 3 * i + 5 * (h / 2)) % 11) - 5);
        const float q = static_cast<float>(((3 * h + 5 * i) % 7) - 3);
        dot += key * q;
      }
      z[h * n + t] = 0.5f * dot;
    }
  }
  std::vector<float> s(n);
  OmniKvCandidateScores(OmniKvSelector::kLast, z, hq, 1, n, absl::MakeSpan(s));
  std::vector<float> twice(n);
  for (int t = 0; t < n; ++t) twice[t] = 2 * s[t];
  EXPECT_THAT(twice,
              ElementsAreArray({14, 11, 16, 9, 13, 19, 7, 10, 14, 9, 13, 14, 11, 16, 9, 13}));
  EXPECT_THAT(TopK(s, 4), ElementsAre(0, 2, 5, 13));
  EXPECT_THAT(TopK(s, 5), ElementsAre(0, 2, 5, 8, 13));
  EXPECT_THAT(TopK(s, 6), ElementsAre(0, 2, 5, 8, 11, 13));
  OmniKvCandidateScores(OmniKvSelector::kSoftmaxBeforeLast, SoftmaxRows(z, hq, n), hq, 1, n,
                        absl::MakeSpan(s));
  EXPECT_THAT(TopK(s, 4), ElementsAre(4, 5, 8, 15));
}

TEST(OmniKvFilterAbilityTest, Tv8) {
  const std::vector<std::vector<float>> a = {
      {.7f, .1f, .1f, .1f}, {.6f, .2f, .1f, .1f}, {.1f, .1f, .1f, .7f}, {.25f, .25f, .25f, .25f}};
  const std::vector<double> ability = OmniKvFilterAbility(a, /*k=*/1, /*n=*/2);
  ASSERT_EQ(ability.size(), 2u);
  EXPECT_NEAR(ability[0], 0.65, 1e-6);
  EXPECT_NEAR(ability[1], 0.35, 1e-6);
  // k = all tokens: every distribution sums to one.
  for (double value : OmniKvFilterAbility(a, 4, 1)) EXPECT_NEAR(value, 1.0, 1e-6);
}

TEST(OmniKvScoresTest, NanRanksLowest) {
  std::vector<float> rows = {NAN, 1.0f, 0.5f, NAN};  // [Hq 2][n 2]
  std::vector<float> s(2);
  OmniKvCandidateScores(OmniKvSelector::kLast, rows, 2, 1, 2, absl::MakeSpan(s));
  EXPECT_EQ(s[0], 0.5f);
  EXPECT_EQ(s[1], 1.0f);
}

}  // namespace
}  // namespace kvs
