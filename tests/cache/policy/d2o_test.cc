// D2O scorer and merge (d2o.md §11 TV3-TV8), driven directly with hand-built LayerStep and
// LayerSelection over a real paged fp32 arena whose slot order is not position order. The
// layer allocator is tested elsewhere: keep is given explicitly.
#include "cache/policy/d2o.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <vector>

#include "cache/policy/policy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cache/policy/scorer_test_util.h"

namespace kvs {
namespace {

using scorer_test::TestBackend;
using scorer_test::TestLayer;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

using Rows = std::map<int32_t, std::vector<float>>;  // position -> row

// TV3/TV4: T = 1, M = 2 of a budget of 5 (recent_frac 0.5), beta 0.7.
PolicyConfig D2oConfigFor(D2oMergeWeighting weighting = D2oMergeWeighting::kPaper,
                          D2oThresholdScope scope = D2oThresholdScope::kLayerHead) {
  PolicyConfig config;
  config.name = kPolicyD2o;
  config.d2o.n_sink = 1;
  config.d2o.recent_frac = 0.5f;
  config.d2o.beta = 0.7f;
  config.d2o.merge_weighting = weighting;
  config.d2o.threshold_scope = scope;
  return config;
}

std::unique_ptr<D2oPolicy> MakeD2o(PolicyConfig config) {
  EXPECT_TRUE(ResolveD2oConfig(config).ok());
  return std::make_unique<D2oPolicy>(config);
}

const Rows kTv4Keys = {{0, {1, 0}}, {1, {4, 1}},   {2, {0, 1}},  {3, {-1, 0}},
                       {4, {2, 0}}, {5, {-1, -1}}, {6, {0, -1}}, {7, {1, -1}}};
const std::vector<float> kTv3Scores = {5, .2f, .9f, .9f, .9f, .1f, .3f, .6f};  // by position

// Probabilities [1][rows][count] whose rows sum, per slot, to `by_position` (split evenly).
std::vector<float> ProbsFor(const TestLayer& layer, const std::map<int32_t, float>& by_position,
                            int32_t rows) {
  std::vector<float> probs(static_cast<size_t>(rows) * layer.count());
  for (int32_t r = 0; r < rows; ++r) {
    for (int32_t s = 0; s < layer.count(); ++s) {
      probs[r * layer.count() + s] = by_position.at(layer.Position(0, s)) / rows;
    }
  }
  return probs;
}

// The TV3/TV4 prompt: 8 tokens, slots hold positions {3, 0, 7, 1, 6, 2, 5, 4}, keys of TV4,
// values (i, 1), and the TV3 scores observed through two prefill query rows.
TestLayer Tv4Prompt(const D2oPolicy& policy, Backend& backend) {
  TestLayer layer(1, 2, 3, 8);
  layer.SetPositions(0, {3, 0, 7, 1, 6, 2, 5, 4});
  for (int32_t s = 0; s < 8; ++s) {
    const int32_t p = layer.Position(0, s);
    layer.Set(0, 0, s, kTv4Keys.at(p));
    layer.Set(1, 0, s, {static_cast<float>(p), 1});
  }
  std::map<int32_t, float> scores;
  for (int32_t p = 0; p < 8; ++p) scores[p] = kTv3Scores[p];
  const std::vector<float> probs = ProbsFor(layer, scores, 2);
  const std::vector<int32_t> queries = {6, 7};
  const LayerStep step = layer.Step(0, 1, probs, queries);
  EXPECT_TRUE(policy.Observe(backend, Phase::kPrefill, {&step, 1}).ok());
  return layer;
}

// The sequence's compaction: keep `kept` ([1][keep]) in slot order, then append one token.
TestLayer Advance(TestLayer& old, const std::vector<int32_t>& kept, int32_t position,
                  const std::vector<float>& key, const std::vector<float>& value) {
  const int32_t keep = static_cast<int32_t>(kept.size());
  TestLayer next(1, old.dim(), 3, keep + 1);
  std::vector<int32_t> order;
  for (int32_t t = 0; t < keep; ++t) {
    next.Set(0, 0, t, old.Get(0, 0, kept[t]));
    next.Set(1, 0, t, old.Get(1, 0, kept[t]));
    order.push_back(old.Position(0, kept[t]));
  }
  next.Set(0, 0, keep, key);
  next.Set(1, 0, keep, value);
  order.push_back(position);
  next.SetPositions(0, order);
  next.state = old.state;
  next.state.Compact(1, old.count(), {kept});
  next.state.Extend(1, keep, 1);
  return next;
}

std::map<int32_t, float> Accumulated(const TestLayer& layer) {
  std::map<int32_t, float> out;
  for (int32_t s = 0; s < layer.count(); ++s) {
    out[layer.Position(0, s)] = layer.state.accumulated[s];
  }
  return out;
}

void ExpectRow(TestLayer& layer, int32_t kv, int32_t position, std::vector<float> expected,
               double tolerance = 2e-6) {
  const std::vector<float> row = layer.Get(kv, 0, layer.SlotOf(0, position));
  ASSERT_EQ(row.size(), expected.size());
  for (size_t d = 0; d < row.size(); ++d) {
    EXPECT_NEAR(row[d], expected[d], tolerance)
        << "kv " << kv << " position " << position << " d " << d;
  }
}

TEST(D2oTest, AttentionRequirementAndAccumulation) {
  auto policy = MakeD2o(D2oConfigFor());
  for (Phase phase : {Phase::kPrefill, Phase::kDecode}) {
    EXPECT_TRUE(policy->attention(phase).needed);
    EXPECT_EQ(policy->attention(phase).trailing_queries, 0);  // every query
    EXPECT_TRUE(policy->BaseNeedsAccumulated());
  }
  EXPECT_TRUE(policy->needs_accumulated());
  TestBackend backend;
  TestLayer layer = Tv4Prompt(*policy, backend);
  const std::map<int32_t, float> accumulated = Accumulated(layer);
  for (int32_t p = 0; p < 8; ++p) EXPECT_FLOAT_EQ(accumulated.at(p), kTv3Scores[p]) << p;
}

TEST(D2oTest, Tv3EvictionTieKeepsLowerPositions) {
  auto policy = MakeD2o(D2oConfigFor());
  TestBackend backend;
  TestLayer layer = Tv4Prompt(*policy, backend);
  std::vector<int32_t> kept;
  const LayerSelection selection = layer.Selection(0, 1, 5, kept);
  ASSERT_TRUE(policy->Select(backend, Phase::kPrefill, {&selection, 1}).ok());
  EXPECT_TRUE(std::is_sorted(kept.begin(), kept.end()));
  EXPECT_THAT(layer.KeptPositions(kept, 0), ElementsAre(0, 2, 3, 6, 7));
}

class D2oWeightingTest : public ::testing::TestWithParam<D2oMergeWeighting> {};

TEST_P(D2oWeightingTest, Tv4PrefillMerge) {
  auto policy = MakeD2o(D2oConfigFor(GetParam()));
  TestBackend backend;
  TestLayer layer = Tv4Prompt(*policy, backend);
  std::vector<int32_t> kept;
  const LayerSelection selection = layer.Selection(0, 1, 5, kept);
  ASSERT_TRUE(policy->Select(backend, Phase::kPrefill, {&selection, 1}).ok());
  std::vector<int32_t> merged(1, -1);
  ASSERT_TRUE(
      policy->Merge(backend, Phase::kPrefill, {&selection, 1}, absl::MakeSpan(merged)).ok());
  EXPECT_EQ(merged[0], 2);  // 1 and 4 merge into 0; 5 (u = 0.707 < tau0) is dropped
  ASSERT_EQ(layer.state.threshold.size(), 1u);
  EXPECT_NEAR(layer.state.threshold[0], 0.892416, 1e-6);
  EXPECT_EQ(backend.nearest_calls, 1);
  EXPECT_EQ(backend.merge_calls, 1);
  EXPECT_EQ(backend.merge_jobs, 1);  // one layer
  EXPECT_EQ(backend.merge_rows, 2);  // one target, K and V
  if (GetParam() == D2oMergeWeighting::kPaper) {
    ExpectRow(layer, 0, 0, {2.316829f, 0.326732f});
    ExpectRow(layer, 1, 0, {1.673268f, 1.0f});
  } else {
    ExpectRow(layer, 0, 0, {2.293523f, 0.323381f});
    ExpectRow(layer, 1, 0, {1.656714f, 0.990048f});
  }
  // Nothing merges into the other kept tokens (3 got nothing: 5 was dropped).
  for (int32_t p : {2, 3, 6, 7}) {
    ExpectRow(layer, 0, p, kTv4Keys.at(p), 0.0);
    ExpectRow(layer, 1, p, {static_cast<float>(p), 1.0f}, 0.0);
  }
  // Kept tokens keep their accumulated scores.
  const std::map<int32_t, float> accumulated = Accumulated(layer);
  EXPECT_FLOAT_EQ(accumulated.at(0), 5.0f);
  EXPECT_FLOAT_EQ(accumulated.at(7), 0.6f);
}

INSTANTIATE_TEST_SUITE_P(Weightings, D2oWeightingTest,
                         ::testing::Values(D2oMergeWeighting::kPaper, D2oMergeWeighting::kCode),
                         [](const ::testing::TestParamInfo<D2oMergeWeighting>& info) {
                           return info.param == D2oMergeWeighting::kPaper ? "Paper" : "Code";
                         });

TEST(D2oTest, Tv5Tv6DecodeMergeThenDrop) {
  auto policy = MakeD2o(D2oConfigFor());
  TestBackend backend;
  TestLayer prompt = Tv4Prompt(*policy, backend);
  std::vector<int32_t> kept;
  const LayerSelection first = prompt.Selection(0, 1, 5, kept);
  ASSERT_TRUE(policy->Select(backend, Phase::kPrefill, {&first, 1}).ok());
  std::vector<int32_t> merged(1);
  ASSERT_TRUE(policy->Merge(backend, Phase::kPrefill, {&first, 1}, absl::MakeSpan(merged)).ok());

  // TV5: position 8, k = (0, -2), v = (8, 1).
  TestLayer tv5 = Advance(prompt, kept, 8, {0, -2}, {8, 1});
  const std::vector<float> p5 =
      ProbsFor(tv5, {{0, .5f}, {2, .1f}, {3, .1f}, {6, .1f}, {7, .1f}, {8, .1f}}, 1);
  const std::vector<int32_t> q5 = {8};
  const LayerStep step5 = tv5.Step(0, 1, p5, q5);
  ASSERT_TRUE(policy->Observe(backend, Phase::kDecode, {&step5, 1}).ok());
  const std::map<int32_t, float> scores5 = Accumulated(tv5);
  EXPECT_FLOAT_EQ(scores5.at(0), 5.5f);
  EXPECT_FLOAT_EQ(scores5.at(2), 1.0f);
  EXPECT_FLOAT_EQ(scores5.at(3), 1.0f);
  EXPECT_FLOAT_EQ(scores5.at(6), 0.4f);
  EXPECT_FLOAT_EQ(scores5.at(7), 0.7f);
  EXPECT_FLOAT_EQ(scores5.at(8), 0.1f);
  const LayerSelection decode5 = tv5.Selection(0, 1, 5, kept);
  ASSERT_TRUE(policy->Select(backend, Phase::kDecode, {&decode5, 1}).ok());
  EXPECT_THAT(tv5.KeptPositions(kept, 0), ElementsAre(0, 2, 3, 7, 8));
  ASSERT_TRUE(policy->Merge(backend, Phase::kDecode, {&decode5, 1}, absl::MakeSpan(merged)).ok());
  EXPECT_EQ(merged[0], 1);
  ASSERT_EQ(tv5.state.threshold.size(), 1u);
  EXPECT_NEAR(tv5.state.threshold[0], 0.967725, 1e-6);  // 0.7 * 1 + 0.3 * tau0
  ExpectRow(tv5, 0, 8, {0.0f, -1.5f});
  ExpectRow(tv5, 1, 8, {7.0f, 1.0f});
  ExpectRow(tv5, 0, 0, {2.316829f, 0.326732f});

  // TV6: position 9, k = (2, 1), v = (9, 1); 7 is evicted and dropped (0.707 < tau2).
  TestLayer tv6 = Advance(tv5, kept, 9, {2, 1}, {9, 1});
  const std::vector<float> p6 =
      ProbsFor(tv6, {{0, .4f}, {2, .05f}, {3, .3f}, {7, .05f}, {8, .1f}, {9, .1f}}, 1);
  const std::vector<int32_t> q6 = {9};
  const LayerStep step6 = tv6.Step(0, 1, p6, q6);
  ASSERT_TRUE(policy->Observe(backend, Phase::kDecode, {&step6, 1}).ok());
  const LayerSelection decode6 = tv6.Selection(0, 1, 5, kept);
  ASSERT_TRUE(policy->Select(backend, Phase::kDecode, {&decode6, 1}).ok());
  EXPECT_THAT(tv6.KeptPositions(kept, 0), ElementsAre(0, 2, 3, 8, 9));
  const int merges_before = backend.merge_calls;
  ASSERT_TRUE(policy->Merge(backend, Phase::kDecode, {&decode6, 1}, absl::MakeSpan(merged)).ok());
  EXPECT_EQ(merged[0], 0);
  EXPECT_EQ(backend.merge_calls, merges_before);  // nothing to merge, no job
  ASSERT_EQ(tv6.state.threshold.size(), 1u);
  EXPECT_NEAR(tv6.state.threshold[0], 0.785292, 1e-6);
  ExpectRow(tv6, 0, 8, {0.0f, -1.5f});
  ExpectRow(tv6, 1, 8, {7.0f, 1.0f});
  ExpectRow(tv6, 0, 9, {2.0f, 1.0f}, 0.0);
}

// TV7: 2 heads x 2 evicted tokens with u = [[.9, .2], [.5, .8]] against one kept key (1, 0).
TestLayer Tv7Layer() {
  TestLayer layer(2, 2, 2, 3);
  const float c[2][2] = {{.9f, .2f}, {.5f, .8f}};
  for (int32_t h = 0; h < 2; ++h) {
    layer.Set(0, h, 0, {1, 0});
    layer.Set(1, h, 0, {10.0f * h, 1});
    for (int32_t e = 0; e < 2; ++e) {
      layer.Set(0, h, e + 1, {c[h][e], std::sqrt(1.0f - c[h][e] * c[h][e])});
      layer.Set(1, h, e + 1, {10.0f * h + e + 1, 1});
    }
  }
  return layer;
}

// Paper weights of a kept value v0 merged with one token of value v at similarity u.
float PaperMerge(float v0, float v, double u) {
  const double e = std::exp(1.0);
  return static_cast<float>((e * v0 + std::exp(u) * v) / (e + std::exp(u)));
}

TEST(D2oTest, Tv7ThresholdPerHead) {
  auto policy = MakeD2o(D2oConfigFor());
  TestBackend backend;
  TestLayer layer = Tv7Layer();
  std::vector<int32_t> kept;
  const LayerSelection selection = layer.Selection(0, 2, 1, kept);
  kept = {0, 0};  // hand-made selection: each head keeps slot 0
  std::vector<int32_t> merged(1);
  ASSERT_TRUE(
      policy->Merge(backend, Phase::kPrefill, {&selection, 1}, absl::MakeSpan(merged)).ok());
  ASSERT_EQ(layer.state.threshold.size(), 2u);
  EXPECT_NEAR(layer.state.threshold[0], 0.55, 1e-6);
  EXPECT_NEAR(layer.state.threshold[1], 0.65, 1e-6);
  EXPECT_EQ(merged[0], 2);  // mask [[T, F], [F, T]]
  EXPECT_NEAR(layer.Get(1, 0, 0)[0], PaperMerge(0, 1, .9), 1e-5);
  EXPECT_NEAR(layer.Get(1, 1, 0)[0], PaperMerge(10, 12, .8), 1e-5);
  EXPECT_NEAR(layer.Get(1, 1, 0)[1], 1.0, 1e-6);
}

TEST(D2oTest, Tv7ThresholdPerLayer) {
  auto policy = MakeD2o(D2oConfigFor(D2oMergeWeighting::kPaper, D2oThresholdScope::kLayer));
  TestBackend backend;
  TestLayer layer = Tv7Layer();
  std::vector<int32_t> kept;
  const LayerSelection selection = layer.Selection(0, 2, 1, kept);
  kept = {0, 0};
  std::vector<int32_t> merged(1);
  ASSERT_TRUE(
      policy->Merge(backend, Phase::kPrefill, {&selection, 1}, absl::MakeSpan(merged)).ok());
  ASSERT_EQ(layer.state.threshold.size(), 1u);
  EXPECT_NEAR(layer.state.threshold[0], 0.6, 1e-6);
  EXPECT_EQ(merged[0], 2);  // head means [.7, .5] vs .6: mask [[T, F], [T, F]]
  EXPECT_NEAR(layer.Get(1, 0, 0)[0], PaperMerge(0, 1, .9), 1e-5);
  EXPECT_NEAR(layer.Get(1, 1, 0)[0], PaperMerge(10, 11, .5), 1e-5);

  // The next step is an EMA of the layer observation: beta * mean + (1 - beta) * 0.6.
  TestLayer next = Tv7Layer();
  next.state.threshold = layer.state.threshold;
  const LayerSelection again = next.Selection(0, 2, 1, kept);
  kept = {0, 0};
  ASSERT_TRUE(policy->Merge(backend, Phase::kDecode, {&again, 1}, absl::MakeSpan(merged)).ok());
  EXPECT_NEAR(next.state.threshold[0], 0.6, 1e-6);  // observation 0.6 again
  EXPECT_EQ(merged[0], 2);
}

TEST(D2oTest, NothingEvictedNothingMerged) {
  auto policy = MakeD2o(D2oConfigFor());
  TestBackend backend;
  TestLayer layer = Tv4Prompt(*policy, backend);
  std::vector<int32_t> kept;
  const LayerSelection selection = layer.Selection(0, 1, 8, kept);
  ASSERT_TRUE(policy->Select(backend, Phase::kPrefill, {&selection, 1}).ok());
  std::vector<int32_t> merged(1, 7);
  ASSERT_TRUE(
      policy->Merge(backend, Phase::kPrefill, {&selection, 1}, absl::MakeSpan(merged)).ok());
  EXPECT_EQ(merged[0], 0);
  EXPECT_TRUE(layer.state.threshold.empty());
  EXPECT_EQ(backend.nearest_calls, 0);
  for (int32_t p = 0; p < 8; ++p) ExpectRow(layer, 0, p, kTv4Keys.at(p), 0.0);
}

// Merge reads kept slots ascending (as Select writes them) on a fast path; any other order of
// the same slots must merge exactly the same, and a repeated or out-of-range slot is refused.
TEST(D2oTest, MergeDoesNotDependOnKeptOrder) {
  auto policy = MakeD2o(D2oConfigFor());
  TestBackend backend;
  TestLayer ascending = Tv4Prompt(*policy, backend);
  std::vector<int32_t> kept;
  const LayerSelection selection = ascending.Selection(0, 1, 5, kept);
  ASSERT_TRUE(policy->Select(backend, Phase::kPrefill, {&selection, 1}).ok());
  ASSERT_TRUE(std::is_sorted(kept.begin(), kept.end()));
  const std::vector<int32_t> selected = kept;
  std::vector<int32_t> merged(1);
  ASSERT_TRUE(
      policy->Merge(backend, Phase::kPrefill, {&selection, 1}, absl::MakeSpan(merged)).ok());
  EXPECT_EQ(merged[0], 2);  // TV4: 1 and 4 merge into 0

  TestLayer shuffled = Tv4Prompt(*policy, backend);
  std::vector<int32_t> kept2;
  const LayerSelection selection2 = shuffled.Selection(0, 1, 5, kept2);
  kept2.assign(selected.rbegin(), selected.rend());
  std::vector<int32_t> merged2(1);
  ASSERT_TRUE(
      policy->Merge(backend, Phase::kPrefill, {&selection2, 1}, absl::MakeSpan(merged2)).ok());
  EXPECT_EQ(merged2, merged);
  EXPECT_EQ(shuffled.state.threshold, ascending.state.threshold);
  for (int32_t kv = 0; kv < 2; ++kv) {
    for (int32_t s = 0; s < 8; ++s) EXPECT_EQ(shuffled.Get(kv, 0, s), ascending.Get(kv, 0, s));
  }

  for (const std::vector<int32_t>& bad :
       {std::vector<int32_t>{0, 2, 2, 5, 6}, std::vector<int32_t>{0, 2, 3, 5, 8}}) {
    TestLayer layer = Tv4Prompt(*policy, backend);
    std::vector<int32_t> kept3;
    const LayerSelection selection3 = layer.Selection(0, 1, 5, kept3);
    kept3 = bad;
    EXPECT_EQ(
        policy->Merge(backend, Phase::kPrefill, {&selection3, 1}, absl::MakeSpan(merged)).code(),
        absl::StatusCode::kInternal);
    EXPECT_TRUE(layer.state.threshold.empty());
  }
}

TEST(D2oTest, ScoresWithoutAttentionNameTheField) {
  auto policy = MakeD2o(D2oConfigFor());
  TestBackend backend;
  TestLayer layer(1, 2, 3, 8);
  std::vector<int32_t> kept;
  const LayerSelection selection = layer.Selection(0, 1, 5, kept);
  const absl::Status status = policy->Select(backend, Phase::kPrefill, {&selection, 1});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("attention"));
  // Malformed or poisoned probabilities are refused, never accumulated.
  std::vector<float> probs(8, 0.1f);
  probs[3] = std::nanf("");
  const std::vector<int32_t> queries = {7};
  const LayerStep step = layer.Step(0, 1, probs, queries);
  EXPECT_EQ(policy->Observe(backend, Phase::kPrefill, {&step, 1}).code(),
            absl::StatusCode::kInvalidArgument);
  const LayerStep short_step = layer.Step(0, 1, absl::MakeSpan(probs).subspan(1), queries);
  EXPECT_EQ(policy->Observe(backend, Phase::kPrefill, {&short_step, 1}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(layer.state.accumulated.empty());
}

// TV8: random GQA layer (Hq = 4, H = 2, P = 40, d = 8, T = 2); constant V survives the paper
// merge, every layer keeps exactly its budget with sinks and recent present, over prefill and
// three decode steps.
TEST(D2oTest, Tv8ConstantValuesSurviveThePaperMerge) {
  PolicyConfig config = D2oConfigFor();
  config.d2o.n_sink = 2;
  config.d2o.recent_frac = 0.25f;
  auto policy = MakeD2o(config);
  TestBackend backend;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  const int32_t kHeads = 2, kQHeads = 4, kDim = 8, kKeep = 20;
  const std::vector<float> constant = {0.5f, -1.0f, 2.0f, 0.25f, 3.0f, -0.75f, 1.5f, 0.0f};
  int32_t count = 40;
  // The layer, re-built after every step as the sequence would compact and append.
  std::vector<std::vector<std::vector<float>>> keys(kHeads);  // [h][slot] row
  std::vector<std::vector<int32_t>> positions(kHeads);
  for (int32_t h = 0; h < kHeads; ++h) {
    for (int32_t s = 0; s < count; ++s) {
      std::vector<float> k(kDim);
      for (float& x : k) x = normal(rng);
      keys[h].push_back(k);
      positions[h].push_back((s * 7 + h * 3) % count);  // a permutation of 0..39
    }
  }
  LayerPolicyState state;
  int32_t next_position = count;
  int32_t total_merged = 0;
  for (int step = 0; step < 4; ++step) {
    const Phase phase = step == 0 ? Phase::kPrefill : Phase::kDecode;
    TestLayer layer(kHeads, kDim, 4, count);
    for (int32_t h = 0; h < kHeads; ++h) {
      layer.SetPositions(h, positions[h]);
      for (int32_t s = 0; s < count; ++s) {
        layer.Set(0, h, s, keys[h][s]);
        layer.Set(1, h, s, constant);
      }
    }
    layer.state = state;
    const int32_t nq = phase == Phase::kPrefill ? 3 : 1;
    std::vector<float> probs(static_cast<size_t>(kQHeads) * nq * count);
    for (float& p : probs) p = uniform(rng);
    std::vector<int32_t> queries;
    for (int32_t i = 0; i < nq; ++i) queries.push_back(next_position - nq + i);
    const LayerStep observe = layer.Step(0, kQHeads, probs, queries);
    ASSERT_TRUE(policy->Observe(backend, phase, {&observe, 1}).ok());
    std::vector<int32_t> kept;
    const LayerSelection selection = layer.Selection(0, kQHeads, kKeep, kept);
    ASSERT_TRUE(policy->Select(backend, phase, {&selection, 1}).ok());
    std::vector<int32_t> merged(1);
    ASSERT_TRUE(policy->Merge(backend, phase, {&selection, 1}, absl::MakeSpan(merged)).ok());
    total_merged += merged[0];
    EXPECT_EQ(layer.state.threshold.size(), 2u);
    const D2oSplit split = SplitD2oBudget(kKeep, 2, 0.25f);
    for (int32_t h = 0; h < kHeads; ++h) {
      std::vector<int32_t> held = positions[h];
      std::sort(held.begin(), held.end());
      const std::vector<int32_t> kept_positions = layer.KeptPositions(kept, h);
      ASSERT_EQ(kept_positions.size(), static_cast<size_t>(kKeep));
      for (int32_t t = 0; t < split.sinks; ++t) {
        EXPECT_TRUE(std::binary_search(kept_positions.begin(), kept_positions.end(), held[t]));
      }
      for (int32_t t = 0; t < split.recent; ++t) {
        EXPECT_TRUE(std::binary_search(kept_positions.begin(), kept_positions.end(),
                                       held[held.size() - 1 - t]));
      }
      for (int32_t t = 0; t < kKeep; ++t) {
        const std::vector<float> v = layer.Get(1, h, kept[h * kKeep + t]);
        for (int32_t d = 0; d < kDim; ++d) EXPECT_NEAR(v[d], constant[d], 1e-5);
      }
    }
    // Compact (kept slots in order) and append one token per head.
    std::vector<std::vector<int32_t>> sources(kHeads);
    for (int32_t h = 0; h < kHeads; ++h) {
      std::vector<std::vector<float>> new_keys;
      std::vector<int32_t> new_positions;
      for (int32_t t = 0; t < kKeep; ++t) {
        const int32_t slot = kept[h * kKeep + t];
        sources[h].push_back(slot);
        new_keys.push_back(layer.Get(0, h, slot));
        new_positions.push_back(positions[h][slot]);
      }
      std::vector<float> k(kDim);
      for (float& x : k) x = normal(rng);
      new_keys.push_back(k);
      new_positions.push_back(next_position);
      keys[h] = new_keys;
      positions[h] = new_positions;
    }
    state = layer.state;
    state.Compact(kHeads, count, sources);
    state.Extend(kHeads, kKeep, 1);
    count = kKeep + 1;
    ++next_position;
  }
  EXPECT_GT(total_merged, 0);  // the invariant was exercised
}

TEST(D2oConfigTest, ValidationNamesTheField) {
  struct Case {
    void (*mutate)(D2oConfig&);
    const char* message;
  };
  const Case cases[] = {
      {[](D2oConfig& c) { c.beta = 2; }, "policy.d2o.beta must be in (0, 1], got 2"},
      {[](D2oConfig& c) { c.beta = -0.5f; }, "policy.d2o.beta"},
      {[](D2oConfig& c) { c.beta = std::nanf(""); }, "policy.d2o.beta"},
      {[](D2oConfig& c) { c.recent_frac = 1.5f; }, "policy.d2o.recent_frac"},
      {[](D2oConfig& c) { c.recent_frac = -0.1f; }, "policy.d2o.recent_frac"},
      {[](D2oConfig& c) { c.n_sink = -1; }, "policy.d2o.n_sink"},
      {[](D2oConfig& c) { c.rho = 1.5f; }, "policy.d2o.rho"},
      {[](D2oConfig& c) { c.min_ratio = 0.5f, c.max_ratio = 0.25f; }, "policy.d2o.min_ratio"},
      {[](D2oConfig& c) { c.min_ratio = -0.5f; }, "policy.d2o.min_ratio"},
      {[](D2oConfig& c) { c.max_ratio = 2; }, "policy.d2o.max_ratio"},
      {[](D2oConfig& c) {
         c.full_cache_layers = {0, -1};
       },
       "policy.d2o.full_cache_layers"},
      {[](D2oConfig& c) { c.merge_weighting = static_cast<D2oMergeWeighting>(7); },
       "policy.d2o.merge_weighting"},
      {[](D2oConfig& c) { c.threshold_scope = static_cast<D2oThresholdScope>(7); },
       "policy.d2o.threshold_scope"},
      {[](D2oConfig& c) { c.density_mode = static_cast<D2oDensityMode>(7); },
       "policy.d2o.density_mode"},
  };
  for (const Case& c : cases) {
    PolicyConfig config = D2oConfigFor();
    c.mutate(config.d2o);
    const absl::Status status = ResolveD2oConfig(config);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(status.message(), HasSubstr(c.message));
  }
  PolicyConfig zeros = D2oConfigFor();
  zeros.d2o.beta = 0;
  zeros.d2o.min_ratio = 0;
  zeros.d2o.max_ratio = 0;
  zeros.d2o.n_sink = 0;
  zeros.d2o.recent_frac = 0;
  zeros.d2o.full_cache_layers = {0, 1, 31};
  ASSERT_TRUE(ResolveD2oConfig(zeros).ok());
  EXPECT_FLOAT_EQ(zeros.d2o.beta, 0.7f);
  EXPECT_FLOAT_EQ(zeros.d2o.min_ratio, 0.01f);
  EXPECT_FLOAT_EQ(zeros.d2o.max_ratio, 1.0f);
  EXPECT_EQ(zeros.d2o.n_sink, 0);  // meaningful zeros stay
  EXPECT_EQ(zeros.d2o.recent_frac, 0.0f);
  EXPECT_NE(MakeD2oPolicy(zeros), nullptr);
}

}  // namespace
}  // namespace kvs
