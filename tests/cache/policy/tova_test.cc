// TOVA driven directly (Observe -> Select over a real paged fp32 layer): the last query only,
// caote.md §13 TV2's probabilities from queries, all_heads (mean over every query head, by
// position), ties on scrambled slots, missing attention.
#include "cache/policy/tova.h"

#include <cmath>
#include <vector>

#include "cache/policy/registry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cache/policy/attention_policy_test_util.h"

namespace kvs {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::FloatNear;
using ::testing::Pointwise;
using testing_util::Identity;
using testing_util::ObserveSelect;
using testing_util::Rows;
using testing_util::TestLayer;

PolicyConfig Tova(bool all_heads = false) {
  PolicyConfig config;
  config.name = kPolicyTova;
  config.tova.all_heads = all_heads;
  EXPECT_TRUE(ResolveTovaConfig(config).ok());
  return config;
}

Rows Values(int32_t n) { return Rows(n, std::vector<float>{1.0f, 0.0f}); }

// softmax(scale * <q, k_j>) over the keys.
std::vector<float> Softmax(std::vector<float> q, const Rows& keys, float scale) {
  std::vector<double> logits;
  double max = -1e30;
  for (const auto& k : keys) {
    double dot = 0.0;
    for (size_t c = 0; c < q.size(); ++c) dot += double{q[c]} * k[c];
    logits.push_back(scale * dot);
    max = std::max(max, logits.back());
  }
  double sum = 0.0;
  for (double& l : logits) sum += (l = std::exp(l - max));
  std::vector<float> out;
  for (double l : logits) out.push_back(static_cast<float>(l / sum));
  return out;
}

class TovaTest : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> backend_ = MakeCpuBackend(1);
};

TEST_F(TovaTest, RequirementsLastQuery) {
  const auto policy = MakeTovaPolicy(Tova());
  for (Phase phase : {Phase::kPrefill, Phase::kDecode}) {
    EXPECT_TRUE(policy->attention(phase).needed);
    EXPECT_EQ(policy->attention(phase).trailing_queries, 1);
  }
  EXPECT_FALSE(policy->needs_accumulated());
}

TEST_F(TovaTest, Tv2LastQueryFromQueries) {
  // q = [sqrt 2, 0], K as in caote.md TV2, scale 1/sqrt 2: alpha = [.1, .2, .4, .1, .2].
  const Rows keys = {{0, 0}, {std::log(2.0f), 0}, {std::log(4.0f), 0}, {0, 0}, {std::log(2.0f), 0}};
  const float root2 = std::sqrt(2.0f);
  std::vector<float> probs = {.2f, .2f, .2f, .2f, .2f};  // an earlier query: must not count
  for (float p : Softmax({root2, 0}, keys, 1.0f / root2)) probs.push_back(p);
  const auto policy = MakeTovaPolicy(Tova());
  for (int32_t keep : {1, 4}) {
    TestLayer layer({Values(5)}, Identity(1, 5));
    auto round = ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 1, probs, 2, keep);
    ASSERT_TRUE(round.ok()) << round.status();
    EXPECT_THAT(round->scores,
                Pointwise(FloatNear(1e-6), std::vector<float>{.1f, .2f, .4f, .1f, .2f}));
    if (keep == 1) {
      EXPECT_THAT(round->kept[0], ElementsAre(2));
    } else {
      EXPECT_THAT(round->kept[0], ElementsAre(0, 1, 2, 4));
    }
  }
}

TEST_F(TovaTest, GqaMeanPerKvHeadAndDecode) {
  const auto policy = MakeTovaPolicy(Tova());
  TestLayer layer({Values(4)}, Identity(1, 4));
  const std::vector<float> probs = {.5f, .25f, .25f, 0, 0, .25f, .25f, .5f};  // 2 query heads
  auto round = ObserveSelect(*policy, *backend_, Phase::kDecode, layer, 2, probs, 1, 2);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_THAT(round->scores, ElementsAre(.25f, .25f, .25f, .25f));
  EXPECT_THAT(round->kept[0], ElementsAre(0, 1));
}

TEST_F(TovaTest, AllHeadsMeansOverEveryQueryHeadByPosition) {
  // Two kv heads (one query head each) holding the same positions in opposite slot orders.
  const std::vector<std::vector<int32_t>> positions = {{0, 1, 2, 3}, {3, 2, 1, 0}};
  const std::vector<float> probs = {.125f, .25f,  .375f, .25f,    // head 0 by slot = by position
                                    .625f, .125f, .125f, .125f};  // head 1: position 3 high
  {
    const auto policy = MakeTovaPolicy(Tova());
    TestLayer layer({Values(4), Values(4)}, positions);
    auto round = ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 2, probs, 1, 2);
    ASSERT_TRUE(round.ok()) << round.status();
    EXPECT_THAT(round->kept[0], ElementsAre(1, 2));
    EXPECT_THAT(round->kept[1], ElementsAre(0, 3));  // 0, 1, 2 tie: the lowest position stays
  }
  {
    // Means by position: 0: .125, 1: .1875, 2: .25, 3: .4375; the same for both heads.
    const auto policy = MakeTovaPolicy(Tova(true));
    TestLayer layer({Values(4), Values(4)}, positions);
    auto round = ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 2, probs, 1, 2);
    ASSERT_TRUE(round.ok()) << round.status();
    EXPECT_THAT(round->kept[0], ElementsAre(2, 3));
    EXPECT_THAT(round->kept[1], ElementsAre(2, 3));
    EXPECT_THAT(round->scores,
                ElementsAre(.125f, .1875f, .25f, .4375f, .4375f, .25f, .1875f, .125f));
  }
}

TEST_F(TovaTest, AllHeadsOnHeadsHoldingTheSameSlotsIsTheColumnMean) {
  // Every kv head holds the same position in each slot (the usual case: all_heads keeps one set
  // for all heads): 2 kv heads x 2 query heads each, 9 scrambled slots, distinct probabilities.
  const std::vector<int32_t> order = {3, 0, 8, 6, 1, 5, 2, 7, 4};
  const int32_t n = static_cast<int32_t>(order.size());
  std::vector<float> probs;
  for (int32_t q = 0; q < 4; ++q) {
    for (int32_t s = 0; s < n; ++s) probs.push_back(static_cast<float>((q * 7 + s * 5) % 11 + 1));
  }
  std::vector<float> expected(static_cast<size_t>(2 * n));
  for (int32_t s = 0; s < n; ++s) {
    double sum = 0.0;
    for (int32_t q = 0; q < 4; ++q) sum += probs[q * n + s];
    expected[s] = expected[n + s] = static_cast<float>(sum / 4);
  }
  const auto policy = MakeTovaPolicy(Tova(true));
  TestLayer layer({Values(n), Values(n)}, {order, order});
  auto round = ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 4, probs, 1, 4);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_THAT(round->scores, ElementsAreArray(expected));
  EXPECT_EQ(round->kept[0], round->kept[1]);
}

TEST_F(TovaTest, TiesKeepTheLowerPositionOnScrambledSlots) {
  const auto policy = MakeTovaPolicy(Tova());
  TestLayer layer({Values(5)}, {{4, 2, 0, 3, 1}});
  const std::vector<float> probs = {.2f, .2f, .2f, .2f, .2f};
  auto round = ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 1, probs, 1, 3);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_THAT(round->kept[0], ElementsAre(0, 1, 2));
}

TEST_F(TovaTest, MissingAttentionIsInvalidArgument) {
  const auto policy = MakeTovaPolicy(Tova());
  TestLayer layer({Values(3)}, Identity(1, 3));
  auto round = ObserveSelect(*policy, *backend_, Phase::kDecode, layer, 1, {}, 0, 2);
  ASSERT_EQ(round.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(round.status().message(),
            "policy tova needs attention (the last query) in this call: field attention");
}

// keep_last_token (docs/policies/tova_keep_last_token.md): the newest position of every head
// stays whatever its score, as kvpress's TOVAPress scores it max + 1.
TEST_F(TovaTest, KeepLastTokenProtectsTheNewestPosition) {
  // Two query heads of one kv head, last query: [.4, .3, .2, .1] and [.4, .1, .4, .1];
  // GQA mean [.4, .2, .3, .1]: the paper keeps 0 and 2, kvpress's variant 0 and the newest (3).
  const std::vector<float> probs = {.4f, .3f, .2f, .1f, .4f, .1f, .4f, .1f};
  {
    const auto policy = MakeTovaPolicy(Tova());
    TestLayer layer({Values(4)}, Identity(1, 4));
    auto round = ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 2, probs, 1, 2);
    ASSERT_TRUE(round.ok()) << round.status();
    EXPECT_THAT(round->kept[0], ElementsAre(0, 2));
  }
  PolicyConfig config = Tova();
  config.tova.keep_last_token = true;
  const auto policy = MakeTovaPolicy(config);
  TestLayer layer({Values(4)}, Identity(1, 4));
  auto round = ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 2, probs, 1, 2);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_THAT(round->kept[0], ElementsAre(0, 3));
  ASSERT_EQ(round->scores.size(), 4u);
  EXPECT_NEAR(round->scores[0], .4f, 1e-6);
  EXPECT_NEAR(round->scores[2], .3f, 1e-6);
  EXPECT_TRUE(std::isinf(round->scores[3]));  // protected
  // A budget of one keeps the last token alone.
  round = ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 2, probs, 1, 1);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_THAT(round->kept[0], ElementsAre(3));
}

TEST_F(TovaTest, KvpressTovaIsAllHeadsPlusLastTokenOnScrambledSlots) {
  // The newest position sits in slot 0 of head 0 and slot 3 of head 1.
  const std::vector<std::vector<int32_t>> positions = {{3, 2, 1, 0}, {0, 1, 2, 3}};
  // Head 0 by slot (positions 3 2 1 0): .1 .2 .3 .4; head 1 by position: .5 .1 .3 .1.
  // All-head means by position: 0: .45, 1: .2, 2: .25, 3: .1.
  const std::vector<float> probs = {.1f, .2f, .3f, .4f, .5f, .1f, .3f, .1f};
  PolicyConfig config = Tova(true);
  config.tova.keep_last_token = true;
  const auto policy = MakeTovaPolicy(config);
  TestLayer layer({Values(4), Values(4)}, positions);
  auto round = ObserveSelect(*policy, *backend_, Phase::kPrefill, layer, 2, probs, 1, 2);
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_THAT(round->kept[0], ElementsAre(0, 3));  // slots of positions 3 and 0
  EXPECT_THAT(round->kept[1], ElementsAre(0, 3));  // slots of positions 0 and 3
}

TEST(TovaRegistryTest, KeepLastTokenSurvivesASnapshot) {
  auto unit = FindPolicyUnit(kPolicyTova);
  ASSERT_TRUE(unit.ok());
  PolicyConfig config = Tova(true);
  config.tova.keep_last_token = true;
  FieldWriter out;
  (*unit)->encode_params(config, out);
  FieldReader in;
  ASSERT_TRUE(in.Parse(out.bytes()));
  PolicyConfig back;
  ASSERT_TRUE((*unit)->decode_params(in, (*unit)->params_version, &back));
  EXPECT_TRUE(back.tova.all_heads);
  EXPECT_TRUE(back.tova.keep_last_token);
  FieldWriter plain;
  (*unit)->encode_params(Tova(), plain);
  ASSERT_TRUE(in.Parse(plain.bytes()));
  EXPECT_FALSE(in.has(2));  // the paper's default writes what earlier builds wrote
  back = PolicyConfig{};
  ASSERT_TRUE((*unit)->decode_params(in, (*unit)->params_version, &back));
  EXPECT_FALSE(back.tova.keep_last_token);
}

}  // namespace
}  // namespace kvs
