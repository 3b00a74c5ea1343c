// SnapKV driven directly (Observe -> Select over a real paged fp32 layer): caote.md §13 TV7's raw
// scores and kept sets, pooling by POSITION with scrambled slots, trailing rows only, max pooling,
// decode (pooled TOVA with the newest protected), missing attention and config validation.
#include "cache/policy/snapkv.h"

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

// SnapKvDefaults::kKvpress (docs/policies/snapkv_kvpress_defaults.md): kvpress 0.5.5's window
// 64 and kernel 5 for the fields left at zero; explicit values still win.
TEST(SnapKvConfigTest, KvpressDefaults) {
  PolicyConfig config;
  config.name = kPolicySnapKv;
  config.snapkv = SnapKvConfig{0, 0, Pooling::kAvg, SnapKvDefaults::kKvpress};
  ASSERT_TRUE(ResolveSnapKvConfig(config).ok());
  EXPECT_EQ(config.snapkv.window, 64);
  EXPECT_EQ(config.snapkv.kernel_size, 5);
  config.snapkv = SnapKvConfig{16, 0, Pooling::kAvg, SnapKvDefaults::kKvpress};
  ASSERT_TRUE(ResolveSnapKvConfig(config).ok());
  EXPECT_EQ(config.snapkv.window, 16);
  EXPECT_EQ(config.snapkv.kernel_size, 5);
  config.snapkv = SnapKvConfig{0, 0, Pooling::kAvg, static_cast<SnapKvDefaults>(9)};
  EXPECT_EQ(ResolveSnapKvConfig(config).message(), "policy.snapkv.defaults is not a known set: 9");
  // CAOTE's SnapKV base takes the same set under its own field name.
  SnapKvConfig base{0, 0, Pooling::kAvg, SnapKvDefaults::kKvpress};
  ASSERT_TRUE(ResolveSnapKvParams(base, "policy.caote.snapkv", 32, 5).ok());
  EXPECT_EQ(base.window, 64);
}

TEST(SnapKvRegistryTest, DefaultsSurviveASnapshot) {
  auto unit = FindPolicyUnit(kPolicySnapKv);
  ASSERT_TRUE(unit.ok());
  PolicyConfig config;
  config.name = kPolicySnapKv;
  config.snapkv = SnapKvConfig{0, 0, Pooling::kAvg, SnapKvDefaults::kKvpress};
  ASSERT_TRUE(ResolveSnapKvConfig(config).ok());
  FieldWriter out;
  (*unit)->encode_params(config, out);
  FieldReader in;
  ASSERT_TRUE(in.Parse(out.bytes()));
  PolicyConfig back;
  ASSERT_TRUE((*unit)->decode_params(in, (*unit)->params_version, &back));
  EXPECT_EQ(back.snapkv.window, 64);
  EXPECT_EQ(back.snapkv.kernel_size, 5);
  EXPECT_EQ(back.snapkv.defaults, SnapKvDefaults::kKvpress);
  // The paper's set writes no tag (what earlier builds wrote) and reads back as the paper's.
  FieldWriter plain;
  (*unit)->encode_params(SnapKv(0, 0), plain);
  ASSERT_TRUE(in.Parse(plain.bytes()));
  EXPECT_FALSE(in.has(4));
  back = PolicyConfig{};
  ASSERT_TRUE((*unit)->decode_params(in, (*unit)->params_version, &back));
  EXPECT_EQ(back.snapkv.defaults, SnapKvDefaults::kPaper);
}

TEST_F(SnapKvTest, KvpressDefaultsProtectA64TokenWindowAndPoolBy5) {
  // 70 keys, 65 queries: w' = 64, so only positions 0..5 are scored (pooled with kernel 5) and
  // the 64 newest are kept whatever their scores.
  const auto policy = MakeSnapKvPolicy([] {
    PolicyConfig config;
    config.name = kPolicySnapKv;
    config.snapkv.window = 0;
    config.snapkv.kernel_size = 0;
    config.snapkv.defaults = SnapKvDefaults::kKvpress;
    EXPECT_TRUE(ResolveSnapKvConfig(config).ok());
    return config;
  }());
  constexpr int32_t kCount = 70, kQueries = 65;
  std::vector<float> probs(static_cast<size_t>(kQueries) * kCount, 0.0f);
  // Every window query puts its mass on position 1 (and the rest on itself).
  for (int32_t i = 0; i < kQueries; ++i) {
    probs[static_cast<size_t>(i) * kCount + 1] = .5f;
    probs[static_cast<size_t>(i) * kCount + std::min(kCount - 1, 5 + i)] += .5f;
  }
  TestLayer layer({Values(kCount)}, Identity(1, kCount));
  auto round = ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 1, probs, kQueries, 66);
  ASSERT_TRUE(round.ok()) << round.status();
  // Window sums over the last 64 queries: position 1 gets 32, position 5 gets 0 (query 0 is
  // outside the window). Pooled (kernel 5, zero padded) over positions 0..5:
  //   0: (0 + 0 + 0 + 32 + 0) / 5 = 6.4, 1: 32/5, 2: 32/5, 3: 32/5, 4: 0, 5: 0.
  EXPECT_NEAR(round->scores[0], 6.4f, 1e-4);
  EXPECT_NEAR(round->scores[3], 6.4f, 1e-4);
  EXPECT_NEAR(round->scores[4], 0.0f, 1e-4);
  for (int32_t s = 6; s < kCount; ++s) EXPECT_EQ(round->scores[s], kInf) << s;
  // 66 kept: the 64-token window and the two best-pooled of 0..3 (ties: the lowest positions).
  ASSERT_EQ(round->kept[0].size(), 66u);
  EXPECT_EQ(round->kept[0][0], 0);
  EXPECT_EQ(round->kept[0][1], 1);
  EXPECT_EQ(round->kept[0][2], 6);
}

}  // namespace
}  // namespace kvs
