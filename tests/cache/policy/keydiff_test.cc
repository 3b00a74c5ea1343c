// KeyDiff through the real pool and CPU backend: every test vector of keydiff.md §12 (TV1-TV5,
// TV7; TV6 lives with the StreamingLLM tests), on a 1-layer, d = 2, fp32 layout with small blocks
// so compaction moves rows across blocks. Kept sets are read back from GetLayout positions, and
// the kept rows are checked bit for bit.
#include "cache/policy/keydiff.h"

#include <cstring>
#include <limits>
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
using testing_util::AppendOptions;
using testing_util::Budget;
using testing_util::ContentsMatch;
using testing_util::HeadPositions;
using testing_util::KeyDiff;
using testing_util::MakeLayout;
using testing_util::TestPool;
using testing_util::ValueFn;

using Keys = std::vector<std::vector<float>>;  // [position][d]

const Keys kTv1Keys = {{1, 0}, {2, 0}, {1, 1}, {1, -1}, {0, 4}, {0, -0.5f}};
const Keys kTv4Keys = {{-1, -1}, {1, 0}, {0, 1}, {3, 2}, {-3, -1}, {-1, 3}, {1, 1}, {2, -1}};

// Keys per head from `heads`, values from the hash (so they are distinct and checkable).
ValueFn KeysFn(std::vector<Keys> heads) {
  return [heads](int layer, int kv, int head, int32_t position, int d) {
    if (kv == 0) return heads[head][position][d];
    return testing_util::HashValue(layer, kv, head, position, d);
  };
}

class KeyDiffPoolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    layout_ = MakeLayout(1, 1, 2, DType::kFloat32, 2);
    session_ = pool_.Attach(layout_, 64);
  }

  // One-shot: append all keys in one block, compress to `n`; kept positions of head 0.
  std::vector<int32_t> OneShot(const PolicyConfig& policy, const Keys& keys, int32_t n) {
    const std::string seq = pool_.Create(session_, policy, Budget(0));
    const ValueFn fn = KeysFn({keys});
    auto commit = Append(pool_.pool, session_, seq, static_cast<int32_t>(keys.size()), layout_, fn);
    EXPECT_TRUE(commit.ok()) << commit.status();
    CompressParams params;
    params.budget_tokens = n;
    params.return_positions = true;
    auto result = pool_.pool.Compress(session_, seq, params);
    EXPECT_TRUE(result.ok()) << result.status();
    if (!result.ok()) return {};
    EXPECT_EQ(result->layers[0].kept, n);
    EXPECT_EQ(result->layers[0].evicted, static_cast<int32_t>(keys.size()) - n);
    EXPECT_TRUE(ContentsMatch(pool_.pool, session_, seq, layout_, fn));
    auto view = pool_.pool.GetLayout(session_, seq, {}, true);
    EXPECT_EQ(view->layers[0].positions, result->layers[0].positions);
    return HeadPositions(view->layers[0], 0);
  }

  testing_util::BlockRun RunBlocks(const PolicyConfig& policy, const Keys& keys, int32_t budget,
                                   int32_t block_tokens, const std::vector<int32_t>& blocks) {
    return testing_util::RunBlocks(pool_, session_, layout_, policy, KeysFn({keys}), budget,
                                   block_tokens, blocks);
  }

  ModelLayout layout_;
  TestPool pool_;
  std::string session_;
};

TEST_F(KeyDiffPoolTest, Tv1NormalizedAnchor) {
  EXPECT_THAT(OneShot(KeyDiff(), kTv1Keys, 3), ElementsAre(2, 4, 5));
  EXPECT_THAT(OneShot(KeyDiff(), kTv1Keys, 4), ElementsAre(2, 3, 4, 5));
  EXPECT_THAT(OneShot(KeyDiff(), kTv1Keys, 5), ElementsAre(0, 2, 3, 4, 5));
}

TEST_F(KeyDiffPoolTest, Tv2RawAnchor) {
  EXPECT_THAT(OneShot(KeyDiff(KeyDiffAnchor::kMeanRaw), kTv1Keys, 3), ElementsAre(3, 4, 5));
}

TEST_F(KeyDiffPoolTest, Tv3Ablations) {
  EXPECT_THAT(
      OneShot(KeyDiff(KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kPairwise), kTv1Keys, 3),
      ElementsAre(2, 4, 5));
  EXPECT_THAT(OneShot(KeyDiff(KeyDiffAnchor::kMedianNormalized), kTv1Keys, 3),
              ElementsAre(2, 4, 5));
  EXPECT_THAT(OneShot(KeyDiff(KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kDot), kTv1Keys, 3),
              ElementsAre(0, 3, 5));
  EXPECT_THAT(
      OneShot(KeyDiff(KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kEuclidean), kTv1Keys, 3),
      ElementsAre(3, 4, 5));
}

TEST_F(KeyDiffPoolTest, Tv4BlockWiseStrictBudget) {
  const testing_util::BlockRun run = RunBlocks(KeyDiff(), kTv4Keys, 3, 2, {2, 2, 2, 2});
  ASSERT_EQ(run.kept.size(), 4u);
  EXPECT_THAT(run.kept[0], ElementsAre(0, 1));
  EXPECT_THAT(run.kept[1], ElementsAre(0, 1, 2));
  EXPECT_THAT(run.kept[2], ElementsAre(0, 1, 4));
  EXPECT_THAT(run.kept[3], ElementsAre(0, 4, 6));
  EXPECT_EQ(run.peak, 5);  // N + N_b
  EXPECT_THAT(run.evicted_before, ElementsAre(0, 0, 1, 2));
}

TEST_F(KeyDiffPoolTest, Tv4RawAnchor) {
  const testing_util::BlockRun run =
      RunBlocks(KeyDiff(KeyDiffAnchor::kMeanRaw), kTv4Keys, 3, 2, {2, 2, 2, 2});
  ASSERT_EQ(run.kept.size(), 4u);
  EXPECT_THAT(run.kept[0], ElementsAre(0, 1));
  EXPECT_THAT(run.kept[1], ElementsAre(0, 1, 2));
  EXPECT_THAT(run.kept[2], ElementsAre(0, 1, 2));
  EXPECT_THAT(run.kept[3], ElementsAre(0, 2, 6));
}

TEST_F(KeyDiffPoolTest, Tv4PrefillThenDecode) {
  // Prefill 6 tokens in blocks of N_b = 2, then decode tokens 6 and 7 one at a time.
  const testing_util::BlockRun run = RunBlocks(KeyDiff(), kTv4Keys, 3, 2, {2, 2, 2, 1, 1});
  ASSERT_EQ(run.kept.size(), 5u);
  EXPECT_THAT(run.kept[0], ElementsAre(0, 1));
  EXPECT_THAT(run.kept[1], ElementsAre(0, 1, 2));
  EXPECT_THAT(run.kept[2], ElementsAre(0, 1, 4));
  EXPECT_THAT(run.kept[3], ElementsAre(1, 4, 6));
  EXPECT_THAT(run.kept[4], ElementsAre(4, 6, 7));
}

TEST_F(KeyDiffPoolTest, Tv4DecodeScoresThroughTheBackend) {
  // The decode-step scores of TV4 over candidates [0, 1, 4, 6], computed on the very rows the
  // pool stored (after its compactions), in the pool's slot order.
  const std::string seq = pool_.Create(session_, KeyDiff(), Budget(3, true, 2));
  const ValueFn fn = KeysFn({kTv4Keys});
  for (int32_t block : {2, 2, 2, 1}) {
    ASSERT_TRUE(Append(pool_.pool, session_, seq, block, layout_, fn).ok());
  }
  auto view = pool_.pool.GetLayout(session_, seq, {}, true);
  ASSERT_EQ(view->layers[0].count, 4);
  auto session_view = pool_.pool.GetSession(session_);
  ASSERT_TRUE(session_view.ok());
  // Scores are recomputed from keys read through the export (slot order).
  std::vector<uint8_t> exported(2 * 4 * 2 * 4);
  ASSERT_TRUE(
      pool_.pool.ReadExport(session_, seq, {}, view->version, 0, absl::MakeSpan(exported)).ok());
  std::vector<int32_t> table = {0, 1};
  PagedLayerView keys;
  // A private copy laid out as two blocks of 2 slots (keys then values per block).
  std::vector<uint8_t> arena(2 * layout_.block_bytes());
  for (int s = 0; s < 4; ++s) {
    std::memcpy(arena.data() + (s / 2) * layout_.block_bytes() + (s % 2) * 8,
                exported.data() + s * 8, 8);
  }
  keys.arena = arena.data();
  keys.block_table = table.data();
  keys.count = 4;
  keys.num_kv_heads = 1;
  keys.head_dim = 2;
  keys.block_tokens = 2;
  keys.dtype = DType::kFloat32;
  keys.block_bytes = layout_.block_bytes();
  std::vector<float> scores(4);
  KeyDiffScoreJob job{keys, KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kCosine, scores.data()};
  // The private copy is host memory: score it on the CPU reference backend whatever the pool's
  // backend is (a device backend refuses a host arena).
  ASSERT_TRUE(MakeCpuBackend(1)->KeyDiffScores({&job, 1}, nullptr).ok());
  const std::vector<int32_t>& positions = view->layers[0].positions;
  const std::vector<std::pair<int32_t, float>> expected = {
      {0, -0.584710f}, {1, -0.160182f}, {4, -0.160182f}, {6, 0.584710f}};
  for (int s = 0; s < 4; ++s) {
    for (const auto& [position, score] : expected) {
      if (positions[s] == position) {
        EXPECT_NEAR(scores[s], score, 1e-5) << "position " << position;
      }
    }
  }
}

TEST_F(KeyDiffPoolTest, Tv5RecentFraction) {
  const testing_util::BlockRun recent =
      RunBlocks(KeyDiff(KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kCosine, 0.5f), kTv4Keys, 4,
                2, {2, 2, 2, 2});
  ASSERT_EQ(recent.kept.size(), 4u);
  EXPECT_THAT(recent.kept[0], ElementsAre(0, 1));
  EXPECT_THAT(recent.kept[1], ElementsAre(0, 1, 2, 3));
  EXPECT_THAT(recent.kept[2], ElementsAre(0, 1, 4, 5));
  EXPECT_THAT(recent.kept[3], ElementsAre(0, 4, 6, 7));
  EXPECT_EQ(recent.peak, 6);

  const testing_util::BlockRun vanilla = RunBlocks(KeyDiff(), kTv4Keys, 4, 2, {2, 2, 2, 2});
  ASSERT_EQ(vanilla.kept.size(), 4u);
  EXPECT_THAT(vanilla.kept[0], ElementsAre(0, 1));
  EXPECT_THAT(vanilla.kept[1], ElementsAre(0, 1, 2, 3));
  EXPECT_THAT(vanilla.kept[2], ElementsAre(0, 1, 3, 4));
  EXPECT_THAT(vanilla.kept[3], ElementsAre(0, 3, 4, 6));
}

TEST(KeyDiffTwoHeadsTest, Tv7HeadsChooseIndependently) {
  const ModelLayout layout = MakeLayout(1, 2, 2, DType::kFloat32, 2);
  TestPool pool;
  const std::string session = pool.Attach(layout, 32);
  const std::string seq = pool.Create(session, KeyDiff(), Budget(0));
  Keys reversed(kTv1Keys.rbegin(), kTv1Keys.rend());
  const ValueFn fn = KeysFn({kTv1Keys, reversed});
  ASSERT_TRUE(Append(pool.pool, session, seq, 6, layout, fn).ok());
  CompressParams params;
  params.budget_tokens = 3;
  auto result = pool.pool.Compress(session, seq, params);
  ASSERT_TRUE(result.ok()) << result.status();
  auto view = pool.pool.GetLayout(session, seq, {}, true);
  EXPECT_THAT(HeadPositions(view->layers[0], 0), ElementsAre(2, 4, 5));
  EXPECT_THAT(HeadPositions(view->layers[0], 1), ElementsAre(0, 1, 2));
  EXPECT_TRUE(ContentsMatch(pool.pool, session, seq, layout, fn));
}

TEST(KeyDiffPolicyTest, RecentTokensFloorsTheFraction) {
  auto policy = MakePolicy(KeyDiff(KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kCosine, 0.5f));
  ASSERT_TRUE(policy.ok());
  const auto& keydiff = static_cast<const KeyDiffPolicy&>(**policy);
  EXPECT_EQ(keydiff.RecentTokens(4), 2);
  EXPECT_EQ(keydiff.RecentTokens(5), 2);
  EXPECT_EQ(keydiff.RecentTokens(1), 0);
  auto seventy = MakePolicy(KeyDiff(KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kCosine, 0.7f));
  // 0.7f is slightly below 0.7; the decimal the user meant still gives 7 of 10.
  EXPECT_EQ(static_cast<const KeyDiffPolicy&>(**seventy).RecentTokens(10), 7);
  auto all = MakePolicy(KeyDiff(KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kCosine, 1.0f));
  EXPECT_EQ(static_cast<const KeyDiffPolicy&>(**all).RecentTokens(9), 9);
}

TEST(KeyDiffPolicyTest, ConfigValidationNamesTheField) {
  for (float bad : {-0.1f, 1.5f, std::numeric_limits<float>::quiet_NaN()}) {
    auto policy = MakePolicy(KeyDiff(KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kCosine, bad));
    EXPECT_EQ(policy.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(policy.status().message(), HasSubstr("policy.keydiff.recent_fraction"));
  }
  auto anchor = MakePolicy(KeyDiff(static_cast<KeyDiffAnchor>(9)));
  EXPECT_EQ(anchor.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(anchor.status().message(), HasSubstr("policy.keydiff.anchor"));
  auto metric = MakePolicy(KeyDiff(KeyDiffAnchor::kMeanRaw, static_cast<KeyDiffMetric>(-1)));
  EXPECT_EQ(metric.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(metric.status().message(), HasSubstr("policy.keydiff.metric"));
}

// With recent_fraction 1 KeyDiff degenerates to "keep the newest": a check that forced slots win
// over scores, through the pool.
TEST(KeyDiffPolicyTest, FullRecentFractionKeepsNewest) {
  const ModelLayout layout = MakeLayout(2, 2, 4, DType::kFloat16, 4);
  TestPool pool;
  const std::string session = pool.Attach(layout, 32);
  const std::string seq = pool.Create(
      session, KeyDiff(KeyDiffAnchor::kMeanNormalized, KeyDiffMetric::kCosine, 1.0f), Budget(5));
  ASSERT_TRUE(Append(pool.pool, session, seq, 13, layout, testing_util::HashValue).ok());
  ASSERT_TRUE(pool.pool.Compress(session, seq, {}).ok());
  auto view = pool.pool.GetLayout(session, seq, {}, true);
  for (const auto& layer : view->layers) {
    for (int h = 0; h < 2; ++h) {
      EXPECT_THAT(HeadPositions(layer, h), ElementsAre(8, 9, 10, 11, 12));
    }
  }
  EXPECT_TRUE(ContentsMatch(pool.pool, session, seq, layout, testing_util::HashValue));
}

}  // namespace
}  // namespace kvs
