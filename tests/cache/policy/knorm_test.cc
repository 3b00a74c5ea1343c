// KNorm (docs/policies/knorm.md) through the real pool: the lowest-norm keys of each kv head stay,
// hand-worked vectors and a brute-force check on hashed keys; the unit is registered and says it
// reads keys only.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "cache/policy/policy.h"
#include "cache/policy/registry.h"
#include "cache/pool.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cache/cache_test_util.h"

namespace kvs {
namespace {

using ::testing::ElementsAre;
using testing_util::Append;
using testing_util::Budget;
using testing_util::HashValue;
using testing_util::HeadPositions;
using testing_util::MakeLayout;
using testing_util::TestPool;

PolicyConfig Knorm() {
  PolicyConfig config;
  config.name = "knorm";
  return config;
}

// Key of head h at position t: only its dimension 0 is non-zero, with ||k|| = (7t + 3h) % 10 + 1
// (distinct for t = 0..9 in each head). Values are hashed.
float HandValue(int layer, int kv, int head, int32_t position, int d) {
  if (kv == 1) return HashValue(layer, kv, head, position, d);
  return d == 0 ? static_cast<float>((7 * position + 3 * head) % 10 + 1) : 0.0f;
}

std::vector<int32_t> CompressTo(TestPool& pool, const std::string& session, const std::string& seq,
                                int32_t budget, int head, int layer = 0) {
  CompressParams params;
  params.budget_tokens = budget;
  auto result = pool.pool.Compress(session, seq, params);
  EXPECT_TRUE(result.ok()) << result.status();
  auto view = pool.pool.GetLayout(session, seq, {}, true);
  EXPECT_TRUE(view.ok()) << view.status();
  return HeadPositions(view->layers[layer], head);
}

TEST(KnormTest, KeepsTheLowestNormKeysOfEachHead) {
  const ModelLayout layout = MakeLayout(1, 2, 4, DType::kFloat32, 4);
  TestPool pool;
  const std::string session = pool.Attach(layout, 32);
  const std::string seq = pool.Create(session, Knorm(), Budget(0));
  ASSERT_TRUE(Append(pool.pool, session, seq, 10, layout, HandValue).ok());
  // Head 0 norms by position: 1 8 5 2 9 6 3 10 7 4 -> the four lowest are 0, 3, 6, 9.
  EXPECT_THAT(CompressTo(pool, session, seq, 4, 0), ElementsAre(0, 3, 6, 9));
  // Head 1 norms: 4 1 8 5 2 9 6 3 10 7 -> 1, 4, 7, 0.
  auto view = pool.pool.GetLayout(session, seq, {}, true);
  ASSERT_TRUE(view.ok());
  EXPECT_THAT(HeadPositions(view->layers[0], 1), ElementsAre(0, 1, 4, 7));
  // No sink or recent window is protected: a second compression keeps the two lowest again.
  EXPECT_THAT(CompressTo(pool, session, seq, 2, 0), ElementsAre(0, 3));
}

TEST(KnormTest, MatchesABruteForceOnHashedKeys) {
  const ModelLayout layout = MakeLayout(2, 2, 16, DType::kFloat16, 8);
  TestPool pool;
  const std::string session = pool.Attach(layout, 64);
  const std::string seq = pool.Create(session, Knorm(), Budget(0));
  constexpr int kTokens = 40, kBudget = 12;
  ASSERT_TRUE(Append(pool.pool, session, seq, kTokens, layout, HashValue).ok());
  CompressParams params;
  params.budget_tokens = kBudget;
  ASSERT_TRUE(pool.pool.Compress(session, seq, params).ok());
  auto view = pool.pool.GetLayout(session, seq, {}, true);
  ASSERT_TRUE(view.ok());
  for (int l = 0; l < layout.num_layers; ++l) {
    for (int h = 0; h < layout.num_kv_heads; ++h) {
      // The norm of the stored (fp16) key, ties to the lower position.
      std::vector<std::pair<double, int>> ranked;
      for (int t = 0; t < kTokens; ++t) {
        double sum = 0;
        for (int d = 0; d < layout.head_dim; ++d) {
          const double k = HashValue(l, 0, h, t, d);
          sum += k * k;
        }
        ranked.emplace_back(std::sqrt(sum), t);
      }
      std::sort(ranked.begin(), ranked.end());
      std::vector<int32_t> expected;
      for (int i = 0; i < kBudget; ++i) expected.push_back(ranked[i].second);
      std::sort(expected.begin(), expected.end());
      EXPECT_EQ(HeadPositions(view->layers[l], h), expected) << "layer " << l << " head " << h;
    }
  }
}

TEST(KnormTest, IsOneRegistryUnitThatReadsKeysOnly) {
  absl::StatusOr<const PolicyUnit*> unit = FindPolicyUnit("knorm");
  ASSERT_TRUE(unit.ok()) << unit.status();
  EXPECT_FALSE((*unit)->capabilities.needs_attention);
  EXPECT_TRUE((*unit)->capabilities.query_agnostic);
  EXPECT_FALSE((*unit)->capabilities.never_evicts);
  EXPECT_NE(std::find(KnownPolicyNames().begin(), KnownPolicyNames().end(), "knorm"),
            KnownPolicyNames().end());
  absl::StatusOr<std::unique_ptr<Policy>> policy = MakePolicy(Knorm());
  ASSERT_TRUE(policy.ok()) << policy.status();
  EXPECT_FALSE((*policy)->attention(Phase::kPrefill).needed);
  EXPECT_FALSE((*policy)->attention(Phase::kDecode).needed);
}

}  // namespace
}  // namespace kvs
