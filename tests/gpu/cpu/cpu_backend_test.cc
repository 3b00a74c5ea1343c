#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gpu/backend.h"
#include "gpu/base/dtype.h"
#include "gpu/cpu/keydiff_cpu.h"
#include "gtest/gtest.h"

namespace kvs {
namespace {

using ::testing::Each;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;

constexpr float kS = 0.70710678118654752f;  // 1/sqrt(2)

// A paged layer built on the host: keys[h][s][d] stored through a shuffled block table, with the
// value rows and the unused blocks filled with NaN so that reading anything but keys shows up.
struct PagedKeys {
  std::vector<uint8_t> arena;
  std::vector<int32_t> block_table;
  PagedLayerView view;

  PagedKeys(const std::vector<std::vector<std::vector<float>>>& keys, DType dtype, int block_tokens,
            uint32_t seed = 7) {
    const int heads = static_cast<int>(keys.size());
    const int count = static_cast<int>(keys[0].size());
    const int dim = count > 0 ? static_cast<int>(keys[0][0].size()) : 4;
    const int bytes = DTypeBytes(dtype);
    const int used_blocks = (count + block_tokens - 1) / block_tokens;
    const int total_blocks = used_blocks + 3;
    const uint64_t block_bytes = 2ull * heads * block_tokens * dim * bytes;
    arena.resize(total_blocks * block_bytes);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (uint64_t i = 0; i < arena.size() / bytes; ++i) StoreFromFloat(arena.data(), dtype, i, nan);
    std::vector<int32_t> ids(total_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937(seed));
    block_table.assign(ids.begin(), ids.begin() + used_blocks);
    for (int h = 0; h < heads; ++h) {
      for (int s = 0; s < count; ++s) {
        const uint64_t row = block_table[s / block_tokens] * block_bytes +
                             ((0ull * heads + h) * block_tokens + s % block_tokens) * dim * bytes;
        for (int d = 0; d < dim; ++d) {
          StoreFromFloat(arena.data() + row, dtype, d, keys[h][s][d]);
        }
      }
    }
    view.arena = arena.data();
    view.block_table = block_table.data();
    view.count = count;
    view.num_kv_heads = heads;
    view.head_dim = dim;
    view.block_tokens = block_tokens;
    view.dtype = dtype;
    view.block_bytes = block_bytes;
  }
};

const std::vector<std::vector<float>> kTv1Keys = {{1, 0},  {2, 0}, {1, 1},
                                                  {1, -1}, {0, 4}, {0, -0.5f}};

std::vector<float> Score(Backend& backend, const PagedKeys& keys, KeyDiffAnchor anchor,
                         KeyDiffMetric metric) {
  std::vector<float> scores(keys.view.num_kv_heads * keys.view.count, -123.0f);
  KeyDiffScoreJob job;
  job.keys = keys.view;
  job.anchor = anchor;
  job.metric = metric;
  job.scores = scores.data();
  EXPECT_TRUE(backend.KeyDiffScores({job}, nullptr).ok());
  return scores;
}

std::vector<int32_t> TopKOf(Backend& backend, const std::vector<float>& scores, int k,
                            std::vector<int32_t> positions = {}) {
  const int n = static_cast<int>(scores.size());
  if (positions.empty()) {
    positions.resize(n);
    std::iota(positions.begin(), positions.end(), 0);
  }
  std::vector<int32_t> kept(k, -1);
  TopKJob job;
  job.scores = scores.data();
  job.positions = positions.data();
  job.rows = 1;
  job.n = n;
  job.k = k;
  job.kept = kept.data();
  EXPECT_TRUE(backend.TopK({job}, nullptr).ok());
  return kept;
}

// Zero coordinates change no norm, dot product or distance, so padding the 2-d test vectors to
// `dim` keeps the expected scores and lets dim % 8 == 0 cases run through the SIMD kernels.
std::vector<std::vector<float>> Pad(const std::vector<std::vector<float>>& keys, int dim) {
  std::vector<std::vector<float>> padded = keys;
  for (auto& key : padded) key.resize(dim, 0.0f);
  return padded;
}

class KeyDiffVectorsTest : public ::testing::TestWithParam<std::tuple<DType, int>> {
 protected:
  DType dtype() const { return std::get<0>(GetParam()); }
  std::vector<std::vector<float>> Tv1() const { return Pad(kTv1Keys, std::get<1>(GetParam())); }
  std::unique_ptr<Backend> backend_ = MakeCpuBackend(2);
};

void ExpectNear(const std::vector<float>& actual, const std::vector<float>& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_NEAR(actual[i], expected[i], 1e-5) << "index " << i;
  }
}

TEST_P(KeyDiffVectorsTest, Tv1NormalizedAnchor) {
  PagedKeys keys({Tv1()}, dtype(), 4);
  const auto scores =
      Score(*backend_, keys, KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kCosine);
  ExpectNear(scores, {-1, -1, -kS, -kS, 0, 0});
  EXPECT_THAT(TopKOf(*backend_, scores, 3), ElementsAre(2, 4, 5));
  EXPECT_THAT(TopKOf(*backend_, scores, 4), ElementsAre(2, 3, 4, 5));
  EXPECT_THAT(TopKOf(*backend_, scores, 5), ElementsAre(0, 2, 3, 4, 5));
}

TEST_P(KeyDiffVectorsTest, Tv2RawAnchor) {
  PagedKeys keys({Tv1()}, dtype(), 4);
  const auto scores = Score(*backend_, keys, KeyDiffAnchor::kMeanRaw, KeyDiffMetric::kCosine);
  ExpectNear(scores, {-0.819232f, -0.819232f, -0.984784f, -0.173785f, -0.573462f, 0.573462f});
  EXPECT_THAT(TopKOf(*backend_, scores, 3), ElementsAre(3, 4, 5));
}

TEST_P(KeyDiffVectorsTest, Tv3Ablations) {
  PagedKeys keys({Tv1()}, dtype(), 4);
  const auto pairwise =
      Score(*backend_, keys, KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kPairwise);
  ExpectNear(pairwise, {-3.414214f, -3.414214f, -2.414214f, -2.414214f, 0, 0});
  EXPECT_THAT(TopKOf(*backend_, pairwise, 3), ElementsAre(2, 4, 5));

  const auto median =
      Score(*backend_, keys, KeyDiffAnchor::kMedianNormalized, KeyDiffMetric::kCosine);
  ExpectNear(median, {-1, -1, -kS, -kS, 0, 0});
  EXPECT_THAT(TopKOf(*backend_, median, 3), ElementsAre(2, 4, 5));

  const auto dot = Score(*backend_, keys, KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kDot);
  ExpectNear(dot, {-5 / 6.0f, -10 / 6.0f, -17 / 12.0f, -3 / 12.0f, -28 / 12.0f, 3.5f / 12});
  EXPECT_THAT(TopKOf(*backend_, dot, 3), ElementsAre(0, 3, 5));

  const auto euclidean =
      Score(*backend_, keys, KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kEuclidean);
  ExpectNear(euclidean, {0.606676f, 1.304373f, 0.448764f, 1.592081f, 3.516825f, 1.366768f});
  EXPECT_THAT(TopKOf(*backend_, euclidean, 3), ElementsAre(3, 4, 5));
}

TEST_P(KeyDiffVectorsTest, Tv7HeadsAreIndependent) {
  const auto tv1 = Tv1();
  std::vector<std::vector<float>> reversed(tv1.rbegin(), tv1.rend());
  PagedKeys keys({tv1, reversed}, dtype(), 4);
  const auto scores =
      Score(*backend_, keys, KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kCosine);
  ExpectNear(scores, {-1, -1, -kS, -kS, 0, 0, 0, 0, -kS, -kS, -1, -1});
  std::vector<float> head0(scores.begin(), scores.begin() + 6);
  std::vector<float> head1(scores.begin() + 6, scores.end());
  EXPECT_THAT(TopKOf(*backend_, head0, 3), ElementsAre(2, 4, 5));
  EXPECT_THAT(TopKOf(*backend_, head1, 3), ElementsAre(0, 1, 2));
}

INSTANTIATE_TEST_SUITE_P(DTypesAndDims, KeyDiffVectorsTest,
                         ::testing::Combine(::testing::Values(DType::kFloat16, DType::kBFloat16,
                                                              DType::kFloat32),
                                            ::testing::Values(2, 8, 40, 128)),
                         [](const auto& info) {
                           return std::string(DTypeName(std::get<0>(info.param))) + "_dim" +
                                  std::to_string(std::get<1>(info.param));
                         });

// ---------------------------------------------------------------------------------------------
// KeyDiff: properties and degenerate inputs.

std::vector<std::vector<std::vector<float>>> RandomKeys(int heads, int count, int dim,
                                                        uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.3f, 1.0f);  // a non-zero mean, like real keys
  std::vector<std::vector<std::vector<float>>> keys(
      heads, std::vector<std::vector<float>>(count, std::vector<float>(dim)));
  for (auto& head : keys) {
    for (auto& key : head) {
      // Quantise to a grid every dtype holds exactly, so all dtypes see the same values.
      for (float& x : key) x = std::round(normal(rng) * 16.0f) / 16.0f;
    }
  }
  return keys;
}

std::vector<float> ScoreHeads(const PagedKeys& keys, KeyDiffAnchor anchor, KeyDiffMetric metric,
                              KeyDiffIsa isa) {
  std::vector<float> scores(keys.view.num_kv_heads * keys.view.count, -123.0f);
  KeyDiffScoreJob job;
  job.keys = keys.view;
  job.anchor = anchor;
  job.metric = metric;
  job.scores = scores.data();
  EXPECT_TRUE(ValidateKeyDiffJob(job, 0).ok());
  for (int h = 0; h < keys.view.num_kv_heads; ++h) KeyDiffScoreHead(job, h, isa);
  return scores;
}

TEST(KeyDiffTest, SimdAgreesWithScalar) {
  if (!CpuSupportsAvx2()) GTEST_SKIP() << "no AVX2/FMA/F16C on this CPU";
  int checked = 0;
  for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
    for (int dim : {8, 24, 64, 128, 136}) {
      for (int count : {1, 5, 17, 300}) {
        for (int block_tokens : {4, 16, 32}) {
          PagedKeys keys(RandomKeys(3, count, dim, count * 31 + dim), dtype, block_tokens);
          // The cosine to both mean anchors, and KNorm's anchorless -|k|.
          const std::pair<KeyDiffAnchor, KeyDiffMetric> kinds[] = {
              {KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kCosine},
              {KeyDiffAnchor::kMeanRaw, KeyDiffMetric::kCosine},
              {KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kNegativeNorm}};
          for (const auto& [anchor, metric] : kinds) {
            const auto scalar = ScoreHeads(keys, anchor, metric, KeyDiffIsa::kScalar);
            const auto simd = ScoreHeads(keys, anchor, metric, KeyDiffIsa::kAvx2);
            ASSERT_EQ(scalar.size(), simd.size());
            for (size_t i = 0; i < scalar.size(); ++i) {
              ASSERT_NEAR(simd[i], scalar[i], 1e-5f * std::max(1.0f, std::fabs(scalar[i])))
                  << DTypeName(dtype) << " dim " << dim << " count " << count << " B "
                  << block_tokens << " index " << i;
              ++checked;
            }
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 0);
}

TEST(KeyDiffTest, BackendMatchesPerHeadReferenceAcrossManyJobs) {
  // Several jobs of different shapes in one call, big enough (> 1 MiB of keys) for the thread
  // pool: the (job, head) split over threads must put every score in its own place.
  auto backend = MakeCpuBackend(3);
  std::vector<PagedKeys> layers;
  layers.reserve(6);
  for (int l = 0; l < 6; ++l) {
    layers.emplace_back(RandomKeys(1 + l % 4, 400 + 97 * l, l % 2 ? 64 : 12, l), DType::kFloat16,
                        l % 2 ? 16 : 3, l);
  }
  std::vector<std::vector<float>> scores(layers.size());
  std::vector<KeyDiffScoreJob> jobs;
  for (size_t l = 0; l < layers.size(); ++l) {
    scores[l].assign(layers[l].view.num_kv_heads * layers[l].view.count, -123.0f);
    KeyDiffScoreJob job;
    job.keys = layers[l].view;
    job.anchor = l % 3 == 2 ? KeyDiffAnchor::kMeanRaw : KeyDiffAnchor::kMeanNormalized;
    job.scores = scores[l].data();
    jobs.push_back(job);
  }
  ASSERT_TRUE(backend->KeyDiffScores(jobs, nullptr).ok());
  for (size_t l = 0; l < layers.size(); ++l) {
    const auto expected =
        ScoreHeads(layers[l], jobs[l].anchor, KeyDiffMetric::kCosine, KeyDiffIsa::kScalar);
    ASSERT_EQ(scores[l].size(), expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      ASSERT_NEAR(scores[l][i], expected[i], 1e-5f) << "layer " << l << " index " << i;
    }
  }
}

TEST(KeyDiffTest, ConcurrentCallsOnOneBackend) {
  auto backend = MakeCpuBackend(2);
  PagedKeys keys(RandomKeys(4, 1200, 64, 9), DType::kBFloat16, 16);  // 600 KiB: pooled
  const auto expected =
      ScoreHeads(keys, KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kCosine, KeyDiffIsa::kScalar);
  std::vector<std::thread> threads;
  std::vector<std::vector<float>> results(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20; ++i) {
        results[t] = Score(*backend, keys, KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kCosine);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (const auto& result : results) {
    ASSERT_EQ(result.size(), expected.size());
    for (size_t i = 0; i < expected.size(); ++i) EXPECT_NEAR(result[i], expected[i], 1e-5f);
  }
}

TEST(KeyDiffTest, PairwiseIsNTimesAnchorNormTimesCosineScore) {
  // Spec §3.1: s_pairwise = n |mu| s_keydiff, so both rank identically.
  auto backend = MakeCpuBackend(1);
  const int count = 50, dim = 16;
  const auto raw = RandomKeys(1, count, dim, 5);
  PagedKeys keys(raw, DType::kFloat32, 4);
  const auto pairwise =
      Score(*backend, keys, KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kPairwise);
  const auto cosine = Score(*backend, keys, KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kCosine);
  std::vector<double> mu(dim, 0.0);
  for (const auto& key : raw[0]) {
    double norm = 0;
    for (float x : key) norm += double{x} * x;
    for (int d = 0; d < dim; ++d) mu[d] += key[d] / std::sqrt(norm) / count;
  }
  double mu_norm = 0;
  for (double x : mu) mu_norm += x * x;
  mu_norm = std::sqrt(mu_norm);
  for (int s = 0; s < count; ++s) {
    EXPECT_NEAR(pairwise[s], count * mu_norm * cosine[s], 1e-4) << s;
  }
}

TEST(KeyDiffTest, MedianAnchorWithAnOddCount) {
  // Normalised keys (1,0), (0,1), (s,s): the coordinate medians are (s, s).
  auto backend = MakeCpuBackend(1);
  PagedKeys keys({{{1, 0}, {0, 3}, {2, 2}}}, DType::kFloat32, 2);
  const auto scores =
      Score(*backend, keys, KeyDiffAnchor::kMedianNormalized, KeyDiffMetric::kCosine);
  ExpectNear(scores, {-kS, -kS, -1});
}

TEST(KeyDiffTest, ZeroKeyScoresZero) {
  auto backend = MakeCpuBackend(1);
  for (int dim : {2, 8}) {
    PagedKeys keys({Pad({{1, 0}, {0, 0}, {1, 1}, {0, 2}}, dim)}, DType::kFloat16, 4);
    for (KeyDiffAnchor anchor : {KeyDiffAnchor::kMeanNormalized, KeyDiffAnchor::kMeanRaw,
                                 KeyDiffAnchor::kMedianNormalized}) {
      const auto scores = Score(*backend, keys, anchor, KeyDiffMetric::kCosine);
      EXPECT_EQ(scores[1], 0.0f) << "dim " << dim;
      EXPECT_FALSE(std::signbit(scores[1]));
      EXPECT_LT(scores[0], 0.0f);
    }
    EXPECT_EQ(Score(*backend, keys, KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kPairwise)[1],
              0.0f);
    EXPECT_EQ(Score(*backend, keys, KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kDot)[1], 0.0f);
  }
}

TEST(KeyDiffTest, ZeroAnchorScoresEverythingZero) {
  auto backend = MakeCpuBackend(1);
  for (int dim : {2, 8}) {
    // Opposite keys: the mean of the normalised keys, and the raw mean, are exactly zero.
    PagedKeys keys({Pad({{3, 0}, {-1, 0}, {0, 2}, {0, -5}}, dim)}, DType::kBFloat16, 4);
    const auto normalized =
        Score(*backend, keys, KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kCosine);
    EXPECT_THAT(normalized, ElementsAre(0.0f, 0.0f, 0.0f, 0.0f)) << "dim " << dim;
    PagedKeys raw_keys({Pad({{1, 0}, {-1, 0}, {0, 2}, {0, -2}}, dim)}, DType::kBFloat16, 4);
    EXPECT_THAT(Score(*backend, raw_keys, KeyDiffAnchor::kMeanRaw, KeyDiffMetric::kCosine),
                ElementsAre(0.0f, 0.0f, 0.0f, 0.0f));
    // With every score equal, the tie rule keeps the lowest positions.
    EXPECT_THAT(TopKOf(*backend, normalized, 2), ElementsAre(0, 1));
  }
}

TEST(KeyDiffTest, SingleTokenAndEmptyLayer) {
  auto backend = MakeCpuBackend(2);
  PagedKeys one({{{0, 0, 0, 0, 0, 0, 0, 2}}}, DType::kFloat16, 16);
  EXPECT_THAT(Score(*backend, one, KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kCosine),
              ElementsAre(-1.0f));
  // count == 0: nothing to read or write, so null pointers are fine.
  KeyDiffScoreJob empty;
  empty.keys.num_kv_heads = 2;
  empty.keys.head_dim = 8;
  empty.keys.block_tokens = 16;
  empty.keys.block_bytes = 2 * 2 * 16 * 8 * 2;
  EXPECT_TRUE(backend->KeyDiffScores({empty}, nullptr).ok());
  EXPECT_TRUE(backend->KeyDiffScores({}, nullptr).ok());
}

TEST(KeyDiffTest, InvalidJobsAreRejectedBeforeAnyScoreIsWritten) {
  auto backend = MakeCpuBackend(2);
  PagedKeys keys({kTv1Keys}, DType::kFloat32, 4);
  std::vector<float> good_scores(6, -123.0f), bad_scores(6, -123.0f);
  KeyDiffScoreJob good;
  good.keys = keys.view;
  good.scores = good_scores.data();

  auto expect_rejected = [&](KeyDiffScoreJob bad, const char* what) {
    bad.scores = bad.scores == nullptr ? nullptr : bad_scores.data();
    const absl::Status status = backend->KeyDiffScores({good, bad}, nullptr);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_THAT(status.message(), ::testing::HasSubstr("keydiff job 1")) << what;
    EXPECT_THAT(good_scores, ::testing::Each(-123.0f)) << what;
  };
  KeyDiffScoreJob bad = good;
  bad.keys.count = -1;
  expect_rejected(bad, "negative count");
  bad = good;
  bad.keys.head_dim = 0;
  expect_rejected(bad, "zero head_dim");
  bad = good;
  bad.keys.num_kv_heads = 0;
  expect_rejected(bad, "zero heads");
  bad = good;
  bad.keys.block_tokens = 0;
  expect_rejected(bad, "zero block_tokens");
  bad = good;
  bad.keys.block_bytes = 4;
  expect_rejected(bad, "block_bytes too small");
  bad = good;
  bad.keys.dtype = static_cast<DType>(0);
  expect_rejected(bad, "bad dtype");
  bad = good;
  bad.metric = static_cast<KeyDiffMetric>(17);
  expect_rejected(bad, "bad metric");
  bad = good;
  bad.anchor = static_cast<KeyDiffAnchor>(17);
  expect_rejected(bad, "bad anchor");
  bad = good;
  bad.scores = nullptr;
  expect_rejected(bad, "null scores");
  bad = good;
  bad.keys.arena = nullptr;
  expect_rejected(bad, "null arena");
  std::vector<int32_t> bad_table = {keys.block_table[0], -1};
  bad = good;
  bad.keys.block_table = bad_table.data();
  expect_rejected(bad, "negative block id");
}

// ---------------------------------------------------------------------------------------------
// TopK.

struct TopKCase {
  std::vector<float> scores;
  std::vector<int32_t> positions;
  std::vector<uint8_t> forced;
};

absl::Status RunTopK(Backend& backend, const TopKCase& c, int rows, int k,
                     std::vector<int32_t>& kept) {
  TopKJob job;
  job.rows = rows;
  job.n = static_cast<int32_t>(c.scores.size() / std::max(rows, 1));
  job.k = k;
  job.scores = c.scores.data();
  job.positions = c.positions.data();
  job.forced = c.forced.empty() ? nullptr : c.forced.data();
  job.kept = kept.data();
  return backend.TopK({job}, nullptr);
}

TEST(TopKTest, EqualScoresKeepTheLowerPositionNotTheLowerSlot) {
  auto backend = MakeCpuBackend(1);
  // After hole filling the slot order is not the position order.
  TopKCase c{{0.5f, 0.5f, 0.5f, 0.5f, 0.9f}, {40, 7, 12, 3, 50}, {}};
  std::vector<int32_t> kept(3, -1);
  ASSERT_TRUE(RunTopK(*backend, c, 1, 3, kept).ok());
  EXPECT_THAT(kept, ElementsAre(1, 3, 4));  // positions 7 and 3 win the tie, slot 4 on score
}

TEST(TopKTest, HighestScoresKeptAndReturnedAscending) {
  auto backend = MakeCpuBackend(1);
  TopKCase c{{0.1f, 0.9f, -0.3f, 0.8f, 0.2f, 0.85f}, {0, 1, 2, 3, 4, 5}, {}};
  std::vector<int32_t> kept(3, -1);
  ASSERT_TRUE(RunTopK(*backend, c, 1, 3, kept).ok());
  EXPECT_THAT(kept, ElementsAre(1, 3, 5));
}

TEST(TopKTest, ForcedSlotsAreKeptFirstAndCountTowardK) {
  auto backend = MakeCpuBackend(1);
  TopKCase c{{0.1f, 0.9f, -0.3f, 0.8f, 0.2f, 0.85f}, {0, 1, 2, 3, 4, 5}, {1, 0, 1, 0, 0, 0}};
  std::vector<int32_t> kept(3, -1);
  ASSERT_TRUE(RunTopK(*backend, c, 1, 3, kept).ok());
  EXPECT_THAT(kept, ElementsAre(0, 1, 2));
  kept.assign(2, -1);
  ASSERT_TRUE(RunTopK(*backend, c, 1, 2, kept).ok());  // forced == k: only forced kept
  EXPECT_THAT(kept, ElementsAre(0, 2));
}

TEST(TopKTest, NanRanksBelowEverything) {
  auto backend = MakeCpuBackend(1);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  TopKCase c{{nan, -inf, 0.0f, nan, -1.0f}, {4, 3, 2, 1, 0}, {}};
  std::vector<int32_t> kept(3, -1);
  ASSERT_TRUE(RunTopK(*backend, c, 1, 3, kept).ok());
  EXPECT_THAT(kept, ElementsAre(1, 2, 4));
  kept.assign(4, -1);
  ASSERT_TRUE(RunTopK(*backend, c, 1, 4, kept).ok());
  EXPECT_THAT(kept, ElementsAre(1, 2, 3, 4));  // NaN vs NaN: lower position (slot 3) wins
}

TEST(TopKTest, KZeroAndKEqualsN) {
  auto backend = MakeCpuBackend(1);
  TopKCase c{{0.3f, 0.1f, 0.2f}, {0, 1, 2}, {}};
  std::vector<int32_t> kept(4, -7);
  ASSERT_TRUE(RunTopK(*backend, c, 1, 0, kept).ok());
  EXPECT_THAT(kept, Each(-7));
  ASSERT_TRUE(RunTopK(*backend, c, 1, 3, kept).ok());
  EXPECT_THAT(std::vector<int32_t>(kept.begin(), kept.begin() + 3), ElementsAre(0, 1, 2));
  EXPECT_EQ(kept[3], -7) << "wrote past k";
}

TEST(TopKTest, RowsAreIndependent) {
  auto backend = MakeCpuBackend(1);
  TopKCase c{{1, 2, 3, 3, 2, 1}, {0, 1, 2, 5, 4, 3}, {}};
  std::vector<int32_t> kept(4, -1);
  ASSERT_TRUE(RunTopK(*backend, c, 2, 2, kept).ok());
  EXPECT_THAT(kept, ElementsAre(1, 2, 0, 1));
}

TEST(TopKTest, InvalidJobsAreRejected) {
  auto backend = MakeCpuBackend(1);
  TopKCase c{{1, 2, 3}, {0, 1, 2}, {1, 1, 0}};
  std::vector<int32_t> kept(4, -7);
  EXPECT_EQ(RunTopK(*backend, c, 1, 4, kept).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RunTopK(*backend, c, 1, -1, kept).code(), absl::StatusCode::kInvalidArgument);
  const absl::Status too_many_forced = RunTopK(*backend, c, 1, 1, kept);
  EXPECT_EQ(too_many_forced.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(too_many_forced.message(), ::testing::HasSubstr("forces 2"));
  EXPECT_THAT(kept, Each(-7));
  TopKJob null_scores;
  null_scores.rows = 1;
  null_scores.n = 3;
  null_scores.k = 1;
  null_scores.kept = kept.data();
  EXPECT_EQ(backend->TopK({null_scores}, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

TEST(TopKTest, MatchesAFullSortOnRandomInputs) {
  // Large enough for the parallel path; scores from a small set so ties are common.
  auto backend = MakeCpuBackend(2);
  std::mt19937 rng(3);
  const int rows = 9, n = 5000, k = 1234;
  TopKCase c;
  c.scores.resize(rows * n);
  c.positions.resize(rows * n);
  c.forced.resize(rows * n);
  for (int r = 0; r < rows; ++r) {
    std::vector<int32_t> perm(n);
    std::iota(perm.begin(), perm.end(), 100);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int s = 0; s < n; ++s) {
      const int bucket = static_cast<int>(rng() % 50);
      c.scores[r * n + s] =
          bucket == 0 ? std::numeric_limits<float>::quiet_NaN() : static_cast<float>(bucket % 7);
      c.positions[r * n + s] = perm[s];
      c.forced[r * n + s] = rng() % 100 == 0;
    }
  }
  std::vector<int32_t> kept(rows * k, -1);
  ASSERT_TRUE(RunTopK(*backend, c, rows, k, kept).ok());
  for (int r = 0; r < rows; ++r) {
    std::vector<int32_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    auto key = [&](int32_t s) {
      const float score = c.scores[r * n + s];
      // forced first, then score (NaN last), then position
      return std::make_tuple(!c.forced[r * n + s], std::isnan(score),
                             std::isnan(score) ? 0.0f : -score, c.positions[r * n + s]);
    };
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return key(a) < key(b); });
    std::vector<int32_t> expected(order.begin(), order.begin() + k);
    std::sort(expected.begin(), expected.end());
    EXPECT_THAT(std::vector<int32_t>(kept.begin() + r * k, kept.begin() + (r + 1) * k),
                ElementsAreArray(expected))
        << "row " << r;
  }
}

// The radix select must agree with a full sort on inputs that stress every digit: scores a few
// ulps apart (equal high bits, differences only in the last digit), both zeros, infinities and
// NaN, with and without forced slots, for k from 1 to n (and so does the few-dropped path).
// Without the special values every key shares its high bits, where the select starts below
// them; with every score equal no bit differs and position alone decides.
enum class CloseScores { kWithSpecials, kSharedHighBits, kAllEqual };

void CheckRadixSelectOnCloseScores(CloseScores kind) {
  auto backend = MakeCpuBackend(2);
  std::mt19937 rng(11);
  const float specials[] = {0.0f,
                            -0.0f,
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            1.0f,
                            -1.0f};
  for (const int n : {1, 7, 300, 4099}) {
    for (const bool with_forced : {false, true}) {
      const int rows = 3;
      // n - 1 ... n - 8 drop so few that the drop list replaces the radix select; n - 9 and
      // n - 12 are just past it.
      const int k_values[] = {1,
                              std::max(1, n / 3),
                              std::max(1, n - 12),
                              std::max(1, n - 9),
                              std::max(1, n - 8),
                              std::max(1, n - 5),
                              std::max(1, n - 2),
                              std::max(1, n - 1),
                              n};
      for (const int k : k_values) {
        TopKCase c;
        c.scores.resize(rows * n);
        c.positions.resize(rows * n);
        if (with_forced) c.forced.assign(rows * n, 0);
        for (int r = 0; r < rows; ++r) {
          std::vector<int32_t> perm(n);
          std::iota(perm.begin(), perm.end(), -n / 2);  // negative positions too
          std::shuffle(perm.begin(), perm.end(), rng);
          int forced_left = k / 4;
          for (int s = 0; s < n; ++s) {
            const uint32_t pick = rng() % 16;
            float score;
            if (kind == CloseScores::kAllEqual) {
              score = 1.5f;
            } else if (pick < 3 && kind == CloseScores::kWithSpecials) {
              score = specials[rng() % 7];
            } else {
              // 1.5 + a few ulps: shares the top two digits with its neighbours.
              score = 1.5f;
              for (uint32_t steps = rng() % 40; steps > 0; --steps) {
                score = std::nextafter(score, 2.0f);
              }
              if (pick == 3 && kind == CloseScores::kWithSpecials) score = -score;
            }
            c.scores[r * n + s] = score;
            c.positions[r * n + s] = perm[s];
            if (with_forced && forced_left > 0 && rng() % 5 == 0) {
              c.forced[r * n + s] = 1;
              --forced_left;
            }
          }
        }
        std::vector<int32_t> kept(rows * k, -1);
        ASSERT_TRUE(RunTopK(*backend, c, rows, k, kept).ok());
        for (int r = 0; r < rows; ++r) {
          std::vector<int32_t> order(n);
          std::iota(order.begin(), order.end(), 0);
          auto key = [&](int32_t s) {
            const float score = c.scores[r * n + s];
            const bool is_forced = with_forced && c.forced[r * n + s] != 0;
            // forced first, then score (NaN last, -0 == +0), then position
            return std::make_tuple(!is_forced, std::isnan(score),
                                   std::isnan(score) ? 0.0f : -(score + 0.0f),
                                   c.positions[r * n + s]);
          };
          std::sort(order.begin(), order.end(),
                    [&](int32_t a, int32_t b) { return key(a) < key(b); });
          std::vector<int32_t> expected(order.begin(), order.begin() + k);
          std::sort(expected.begin(), expected.end());
          EXPECT_THAT(std::vector<int32_t>(kept.begin() + r * k, kept.begin() + (r + 1) * k),
                      ElementsAreArray(expected))
              << "n " << n << " k " << k << " forced " << with_forced << " row " << r;
        }
      }
    }
  }
}

TEST(TopKTest, RadixSelectMatchesAFullSortOnCloseScores) {
  for (const CloseScores kind :
       {CloseScores::kWithSpecials, CloseScores::kSharedHighBits, CloseScores::kAllEqual}) {
    SCOPED_TRACE(static_cast<int>(kind));
    CheckRadixSelectOnCloseScores(kind);
  }
}

// ---------------------------------------------------------------------------------------------
// CopyRows, Synchronize, identity.

TEST(CopyRowsTest, MovesRowsInOrder) {
  auto backend = MakeCpuBackend(1);
  std::vector<uint8_t> arena(64);
  std::iota(arena.begin(), arena.end(), 0);
  // Hole filling: rows at 48 and 56 move into holes at 8 and 24; then a chain shift where each
  // destination is an earlier row's source (allowed: it is never a later source).
  std::vector<uint64_t> src = {48, 56, 32, 40};
  std::vector<uint64_t> dst = {8, 24, 40, 32};
  RowCopyJob job;
  job.arena = arena.data();
  job.src_offsets = src.data();
  job.dst_offsets = dst.data();
  job.count = 2;
  job.row_bytes = 8;
  ASSERT_TRUE(backend->CopyRows({job}, nullptr).ok());
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(arena[8 + i], 48 + i);
    EXPECT_EQ(arena[24 + i], 56 + i);
    EXPECT_EQ(arena[16 + i], 16 + i) << "untouched row changed";
  }
  std::vector<uint64_t> chain_src = {16, 24, 32};
  std::vector<uint64_t> chain_dst = {12, 20, 28};  // overlapping shift down by 4 bytes
  std::vector<uint8_t> before = arena;
  job.src_offsets = chain_src.data();
  job.dst_offsets = chain_dst.data();
  job.count = 3;
  ASSERT_TRUE(backend->CopyRows({job}, nullptr).ok());
  for (int i = 0; i < 24; ++i) EXPECT_EQ(arena[12 + i], before[16 + i]) << i;
}

TEST(CopyRowsTest, EmptyAndInvalidJobs) {
  auto backend = MakeCpuBackend(1);
  RowCopyJob empty;
  EXPECT_TRUE(backend->CopyRows({empty}, nullptr).ok());
  RowCopyJob negative;
  negative.count = -1;
  EXPECT_EQ(backend->CopyRows({negative}, nullptr).code(), absl::StatusCode::kInvalidArgument);
  RowCopyJob null_offsets;
  null_offsets.count = 1;
  null_offsets.row_bytes = 4;
  EXPECT_EQ(backend->CopyRows({null_offsets}, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

// Enough jobs and rows for the parallel path: every job's rows land as the same rows copied one
// by one in order would put them, including a job whose destinations are its own earlier
// sources (a chain, which must run in order within the job), and jobs of row sizes without a
// special case.
TEST(CopyRowsTest, ManyJobsInParallelMatchInOrderCopies) {
  auto backend = MakeCpuBackend(2);
  std::mt19937 rng(5);
  constexpr uint64_t kRegion = 1 << 20;  // each job owns one region of the arena
  constexpr int kJobs = 24;
  std::vector<uint8_t> arena(kRegion * kJobs);
  for (auto& byte : arena) byte = static_cast<uint8_t>(rng());
  std::vector<uint8_t> expected = arena;
  std::vector<std::vector<uint64_t>> src(kJobs), dst(kJobs);
  std::vector<RowCopyJob> jobs(kJobs);
  for (int j = 0; j < kJobs; ++j) {
    const uint64_t row_bytes = j % 3 == 0 ? 256 : (j % 3 == 1 ? 48 : 512);
    const uint64_t base = j * kRegion;
    const int64_t slots = static_cast<int64_t>(kRegion / row_bytes);
    if (j == 5) {
      // Chain: row i moves to slot i - 1, each destination an earlier row's source.
      for (int64_t i = 1; i < slots; ++i) {
        src[j].push_back(base + i * row_bytes);
        dst[j].push_back(base + (i - 1) * row_bytes);
      }
    } else {
      // Hole filling: the upper half's rows, in a random order, into random lower-half slots.
      std::vector<int64_t> lower(slots / 2), upper(slots - slots / 2);
      std::iota(lower.begin(), lower.end(), 0);
      std::iota(upper.begin(), upper.end(), slots / 2);
      std::shuffle(lower.begin(), lower.end(), rng);
      std::shuffle(upper.begin(), upper.end(), rng);
      for (size_t i = 0; i < lower.size(); ++i) {
        src[j].push_back(base + upper[i] * row_bytes);
        dst[j].push_back(base + lower[i] * row_bytes);
      }
    }
    for (size_t i = 0; i < src[j].size(); ++i) {
      std::memmove(expected.data() + dst[j][i], expected.data() + src[j][i], row_bytes);
    }
    jobs[j] = RowCopyJob{arena.data(), src[j].data(), dst[j].data(),
                         static_cast<int64_t>(src[j].size()), row_bytes};
  }
  ASSERT_TRUE(backend->CopyRows(jobs, nullptr).ok());
  for (int j = 0; j < kJobs; ++j) {
    EXPECT_EQ(std::memcmp(arena.data() + j * kRegion, expected.data() + j * kRegion, kRegion), 0)
        << "job " << j;
  }
}

TEST(CopyRowsTest, ZeroRowBytesOrCountIgnoresNullOffsets) {
  auto backend = MakeCpuBackend(2);
  RowCopyJob no_bytes;
  no_bytes.count = 1000000;  // nothing to copy: the offsets are never read
  RowCopyJob no_rows;
  no_rows.row_bytes = 256;
  EXPECT_TRUE(backend->CopyRows({no_bytes, no_rows}, nullptr).ok());
}

TEST(CpuBackendTest, Identity) {
  auto backend = MakeCpuBackend(0);
  EXPECT_EQ(backend->name(), "cpu");
  EXPECT_TRUE(backend->healthy());
  EXPECT_TRUE(backend->Synchronize(nullptr).ok());
}

// FindNonFinite: the lowest flat index of a value with every exponent bit set (NaN, +-inf), in
// every dtype; finite extremes (largest, subnormal, -0) are finite; -1 when all are.
TEST(CpuBackendTest, FindNonFiniteFindsTheFirstNaNOrInfInEveryDtype) {
  auto backend = MakeCpuBackend(2);
  constexpr int kRow = 300;  // more than one 256-value run
  for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
    SCOPED_TRACE(std::string(DTypeName(dtype)));
    const int bytes = DTypeBytes(dtype);
    std::vector<uint8_t> arena(4 * kRow * bytes, 0);
    auto set = [&](int element, uint32_t bits) {
      std::memcpy(arena.data() + element * bytes, &bits, bytes);  // little-endian host
    };
    const uint32_t largest = dtype == DType::kFloat32 ? 0x7f7fffffu
                             : dtype == DType::kFloat16 ? 0x7bffu : 0x7f7fu;
    const uint32_t inf = dtype == DType::kFloat32 ? 0xff800000u
                         : dtype == DType::kFloat16 ? 0xfc00u : 0xff80u;  // -inf
    const uint32_t nan = dtype == DType::kFloat32 ? 0x7fc00001u
                         : dtype == DType::kFloat16 ? 0x7e01u : 0x7fc1u;
    set(3, largest);
    set(5, 1);                          // subnormal
    set(6, dtype == DType::kFloat32 ? 0x80000000u : 0x8000u);  // -0
    // Rows read in the order of the offsets: row 0 = arena row 2, row 1 = arena row 1.
    const std::vector<uint64_t> offsets = {2ull * kRow * bytes, 1ull * kRow * bytes};
    int64_t first = 7;
    FiniteCheckJob job;
    job.arena = arena.data();
    job.row_offsets = offsets.data();
    job.count = 2;
    job.row_elements = kRow;
    job.dtype = dtype;
    job.first_non_finite = &first;
    ASSERT_TRUE(backend->FindNonFinite({job}, nullptr).ok());
    EXPECT_EQ(first, -1);
    set(kRow + 290, inf);      // arena row 1, element 290: job row 1
    set(2 * kRow + 299, nan);  // arena row 2, element 299: job row 0, found first
    ASSERT_TRUE(backend->FindNonFinite({job}, nullptr).ok());
    EXPECT_EQ(first, 299);
    set(2 * kRow + 299, 0);
    ASSERT_TRUE(backend->FindNonFinite({job}, nullptr).ok());
    EXPECT_EQ(first, kRow + 290);
  }
  FiniteCheckJob bad;
  bad.count = 1;
  bad.row_elements = 4;
  int64_t out = 0;
  bad.first_non_finite = &out;
  EXPECT_EQ(backend->FindNonFinite({bad}, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

// FindNonFinite's row_norms (what a commit keeps for KNorm) are, bit for bit, the norms KNorm's
// pass over the same keys negates (KeyDiffMetric::kNegativeNorm), at the backend's ISA and at each
// ISA through KeyRowNorm; with dims the AVX2 path covers (% 8 == 0) and one it does not.
TEST(CpuBackendTest, FindNonFiniteRowNormsAreTheNormsKnormScoresBy) {
  auto backend = MakeCpuBackend(2);
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
    for (int dim : {128, 12}) {
      SCOPED_TRACE(std::string(DTypeName(dtype)) + " dim " + std::to_string(dim));
      constexpr int kHeads = 2, kBlockTokens = 16, kCount = 40;
      const int bytes = DTypeBytes(dtype);
      std::vector<std::vector<std::vector<float>>> values(
          kHeads, std::vector<std::vector<float>>(kCount, std::vector<float>(dim)));
      for (auto& head : values) {
        for (auto& row : head) {
          for (float& x : row) x = normal(rng);
        }
      }
      PagedKeys paged(values, dtype, kBlockTokens);
      const PagedLayerView& keys = paged.view;
      std::vector<uint8_t>& arena = paged.arena;
      const std::vector<int32_t>& table = paged.block_table;
      const uint64_t block_bytes = keys.block_bytes;
      std::vector<float> scores(kHeads * kCount);
      KeyDiffScoreJob knorm;
      knorm.keys = keys;
      knorm.metric = KeyDiffMetric::kNegativeNorm;
      knorm.scores = scores.data();
      ASSERT_TRUE(backend->KeyDiffScores({knorm}, nullptr).ok());

      std::vector<uint64_t> offsets;  // rows [head][slot], as a commit's check lists them
      for (int h = 0; h < kHeads; ++h) {
        for (int s = 0; s < kCount; ++s) {
          offsets.push_back(table[s / kBlockTokens] * block_bytes +
                            static_cast<uint64_t>((h * kBlockTokens + s % kBlockTokens) * dim) *
                                bytes);
        }
      }
      std::vector<float> norms(offsets.size(), -1.0f);
      int64_t first = 7;
      FiniteCheckJob check;
      check.arena = arena.data();
      check.row_offsets = offsets.data();
      check.count = static_cast<int64_t>(offsets.size());
      check.row_elements = dim;
      check.dtype = dtype;
      check.first_non_finite = &first;
      check.row_norms = norms.data();
      ASSERT_TRUE(backend->FindNonFinite({check}, nullptr).ok());
      ASSERT_EQ(first, -1);
      for (size_t i = 0; i < norms.size(); ++i) {
        const float score = -norms[i] + 0.0f;
        ASSERT_EQ(std::memcmp(&score, &scores[i], sizeof(float)), 0)
            << "row " << i << ": norm " << norms[i] << ", score " << scores[i];
      }
      // The check itself is unchanged by the norms: the largest finite value is finite (its
      // square overflows fp32 in bf16 and fp32), -inf and NaN are found where they are.
      const uint32_t largest = dtype == DType::kFloat32   ? 0x7f7fffffu
                               : dtype == DType::kFloat16 ? 0x7bffu
                                                          : 0x7f7fu;
      const uint32_t minus_inf = dtype == DType::kFloat32   ? 0xff800000u
                                 : dtype == DType::kFloat16 ? 0xfc00u
                                                            : 0xff80u;
      const uint32_t nan = dtype == DType::kFloat32   ? 0x7fc00001u
                           : dtype == DType::kFloat16 ? 0x7e01u
                                                      : 0x7fc1u;
      std::vector<uint8_t> saved = arena;
      auto set = [&](size_t row, int element, uint32_t bits) {
        std::memcpy(arena.data() + offsets[row] + static_cast<size_t>(element) * bytes, &bits,
                    bytes);
      };
      set(3, dim - 1, largest);
      ASSERT_TRUE(backend->FindNonFinite({check}, nullptr).ok());
      EXPECT_EQ(first, -1);
      set(50, 1, minus_inf);
      set(30, dim - 2, nan);
      ASSERT_TRUE(backend->FindNonFinite({check}, nullptr).ok());
      EXPECT_EQ(first, 30 * dim + dim - 2);
      std::copy(saved.begin(), saved.end(), arena.begin());

      for (KeyDiffIsa isa : {KeyDiffIsa::kScalar, KeyDiffIsa::kAvx2}) {
        std::vector<float> isa_scores(kHeads * kCount);
        knorm.scores = isa_scores.data();
        for (int h = 0; h < kHeads; ++h) KeyDiffScoreHead(knorm, h, isa);
        for (size_t i = 0; i < offsets.size(); ++i) {
          const float score = -KeyRowNorm(arena.data() + offsets[i], dtype, dim, isa) + 0.0f;
          ASSERT_EQ(std::memcmp(&score, &isa_scores[i], sizeof(float)), 0)
              << "isa " << static_cast<int>(isa) << " row " << i;
        }
      }
    }
  }
}

// A commit's check: thousands of jobs of a few rows each (some empty), in one call large enough to
// be split over the pool, the rows scattered. Every job gets its own answer: its first
// non-finite value (the first of several), or -1, whatever the jobs around it hold.
TEST(CpuBackendTest, FindNonFiniteAnswersEveryJobOfAManyJobCall) {
  for (int threads : {1, 2, 4}) {
    SCOPED_TRACE(threads);
    auto backend = MakeCpuBackend(threads);
    constexpr int kRow = 128;  // fp16 values per row
    constexpr int kRowBytes = kRow * 2;
    constexpr int kArenaRows = 8192;
    std::vector<uint8_t> arena(static_cast<size_t>(kArenaRows) * kRowBytes, 0);
    std::mt19937 rng(7);
    constexpr int kJobs = 3000;
    std::vector<std::vector<uint64_t>> offsets(kJobs);
    std::vector<int64_t> expected(kJobs, -1);
    std::vector<int> used(kArenaRows);
    std::iota(used.begin(), used.end(), 0);
    std::shuffle(used.begin(), used.end(), rng);
    size_t next_row = 0;
    auto set = [&](uint64_t offset, int element, uint16_t bits) {
      std::memcpy(arena.data() + offset + 2 * element, &bits, sizeof(bits));
    };
    for (int j = 0; j < kJobs && next_row + 9 < used.size(); ++j) {
      const int count = static_cast<int>(rng() % 10);  // 0..9 rows
      for (int r = 0; r < count; ++r) {
        offsets[j].push_back(static_cast<uint64_t>(used[next_row++]) * kRowBytes);
      }
      if (count == 0 || rng() % 3 != 0) continue;
      // One or two non-finite values; the answer is the lower flat index.
      const int r1 = static_cast<int>(rng() % count), e1 = static_cast<int>(rng() % kRow);
      set(offsets[j][r1], e1, 0x7e00);  // NaN
      expected[j] = int64_t{r1} * kRow + e1;
      const int r2 = static_cast<int>(rng() % count), e2 = static_cast<int>(rng() % kRow);
      set(offsets[j][r2], e2, 0xfc00);  // -inf
      expected[j] = std::min<int64_t>(expected[j], int64_t{r2} * kRow + e2);
    }
    std::vector<int64_t> first(kJobs, 7);
    std::vector<FiniteCheckJob> jobs(kJobs);
    for (int j = 0; j < kJobs; ++j) {
      jobs[j].arena = arena.data();
      jobs[j].row_offsets = offsets[j].data();
      jobs[j].count = static_cast<int64_t>(offsets[j].size());
      jobs[j].row_elements = kRow;
      jobs[j].dtype = DType::kFloat16;
      jobs[j].first_non_finite = &first[j];
    }
    ASSERT_TRUE(backend->FindNonFinite(jobs, nullptr).ok());
    EXPECT_EQ(first, expected);
  }
}

}  // namespace
}  // namespace kvs
