// KvPool's operator-facing half (cache/pool.h, "Live defaults", "Tenant quotas", re-budget and
// per-policy totals): what Admin and the metrics read and change.
#include <string>

#include "cache/pool.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cache/cache_test_util.h"

namespace kvs {
namespace {

using ::testing::HasSubstr;
using testing_util::Append;
using testing_util::Budget;
using testing_util::HashValue;
using testing_util::KeyDiff;
using testing_util::MakeLayout;
using testing_util::StreamingLlm;
using testing_util::TestPool;

class PoolAdminTest : public ::testing::Test {
 protected:
  std::string AttachAs(const std::string& tenant, int32_t blocks = 64) {
    AttachParams params;
    params.layout = layout_;
    params.num_blocks = blocks;
    params.tenant = tenant;
    absl::StatusOr<SessionView> view = pool_.pool.Attach(params);
    EXPECT_TRUE(view.ok()) << view.status();
    EXPECT_EQ(view->tenant, tenant);
    return view.ok() ? view->session_id : "";
  }

  ModelLayout layout_ = MakeLayout(2, 2, 4, DType::kFloat16, 4);
  TestPool pool_;
};

TEST_F(PoolAdminTest, LiveDefaultsApplyToTheNextSequence) {
  const std::string session = AttachAs("a");
  SequenceParams none;
  auto before = pool_.pool.CreateSequence(session, none);
  ASSERT_TRUE(before.ok());
  EXPECT_EQ(before->budget.tokens_per_layer, 0);
  pool_.pool.SetDefaults(StreamingLlm(2), Budget(12));
  EXPECT_EQ(pool_.pool.default_budget().tokens_per_layer, 12);
  EXPECT_EQ(pool_.pool.default_policy().name, StreamingLlm(2).name);
  auto after = pool_.pool.CreateSequence(session, none);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->budget.tokens_per_layer, 12);
  EXPECT_EQ(after->policy.name, StreamingLlm(2).name);
  // Only the budget: the policy stays.
  pool_.pool.SetDefaults(std::nullopt, Budget(20));
  EXPECT_EQ(pool_.pool.default_policy().name, StreamingLlm(2).name);
  EXPECT_EQ(pool_.pool.default_budget().tokens_per_layer, 20);
}

TEST_F(PoolAdminTest, SequenceQuotaCountsAcrossSessionsAndReleases) {
  const std::string s1 = AttachAs("t");
  const std::string s2 = AttachAs("t");
  TenantQuota quota;
  quota.sequences = 2;
  pool_.pool.SetTenantQuota("t", quota);
  pool_.Create(s1, KeyDiff(), Budget(0), "a");
  pool_.Create(s2, KeyDiff(), Budget(0), "b");
  SequenceParams params;
  params.sequence_id = "c";
  auto refused = pool_.pool.CreateSequence(s1, params);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("its quota sequences is 2"));
  EXPECT_EQ(pool_.pool.GetTenantUsage("t").sequences, 2);
  EXPECT_EQ(pool_.pool.GetTenantUsage("t").sessions, 2);
  ASSERT_TRUE(pool_.pool.ReleaseSequence(s1, "a").ok());
  EXPECT_TRUE(pool_.pool.CreateSequence(s1, params).ok());
  // Detaching a session gives its sequences back.
  ASSERT_TRUE(pool_.pool.Detach(s2).ok());
  EXPECT_EQ(pool_.pool.GetTenantUsage("t").sequences, 1);
  // Removing the quota (all zero) lifts the limit.
  pool_.pool.SetTenantQuota("t", TenantQuota{});
  EXPECT_TRUE(pool_.pool.TenantQuotas().empty());
}

TEST_F(PoolAdminTest, ArenaQuotaRefusesGrowthAtTheLimit) {
  const std::string session = AttachAs("m");
  const std::string seq = pool_.Create(session, KeyDiff(), Budget(0), "s");
  ASSERT_TRUE(Append(pool_.pool, session, seq, 8, layout_, HashValue).ok());  // 2 blocks/layer
  const TenantUsage usage = pool_.pool.GetTenantUsage("m");
  EXPECT_EQ(usage.arena_bytes, 4 * layout_.block_bytes());
  TenantQuota quota;
  quota.arena_bytes = usage.arena_bytes;
  pool_.pool.SetTenantQuota("m", quota);
  auto refused = Append(pool_.pool, session, seq, 1, layout_, HashValue);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("quota arena_bytes"));
  // Another tenant is not affected.
  const std::string other = AttachAs("n");
  const std::string seq2 = pool_.Create(other, KeyDiff(), Budget(0), "s");
  EXPECT_TRUE(Append(pool_.pool, other, seq2, 8, layout_, HashValue).ok());
}

TEST_F(PoolAdminTest, RebudgetCompressesOnlyTheTenantsSequences) {
  const std::string a = AttachAs("a");
  const std::string b = AttachAs("b");
  pool_.Create(a, KeyDiff(), Budget(0), "s");
  pool_.Create(b, KeyDiff(), Budget(0), "s");
  ASSERT_TRUE(Append(pool_.pool, a, "s", 40, layout_, HashValue).ok());
  ASSERT_TRUE(Append(pool_.pool, b, "s", 40, layout_, HashValue).ok());
  const RebudgetResult result = pool_.pool.RebudgetTenant("a", 16);
  EXPECT_EQ(result.rebudgeted, 1);
  EXPECT_TRUE(result.skipped.empty());
  auto layout_a = pool_.pool.GetLayout(a, "s", {}, false);
  ASSERT_TRUE(layout_a.ok());
  EXPECT_EQ(layout_a->budget.tokens_per_layer, 16);
  for (const LayerLayoutView& layer : layout_a->layers) EXPECT_EQ(layer.count, 16);
  auto layout_b = pool_.pool.GetLayout(b, "s", {}, false);
  for (const LayerLayoutView& layer : layout_b->layers) EXPECT_EQ(layer.count, 40);
  // A budget larger than the arena holds is skipped with the reason; "*" = every tenant.
  const RebudgetResult too_big = pool_.pool.RebudgetTenant("*", 1 << 20);
  EXPECT_EQ(too_big.rebudgeted, 0);
  ASSERT_EQ(too_big.skipped.size(), 2u);
  EXPECT_THAT(too_big.skipped[0], HasSubstr("tokens per layer"));
  // A pending reservation is never compressed under the worker.
  ASSERT_TRUE(pool_.pool.Reserve(b, "s", 1, {}, {}).ok());
  const RebudgetResult pending = pool_.pool.RebudgetTenant("b", 8);
  EXPECT_EQ(pending.rebudgeted, 0);
  ASSERT_EQ(pending.skipped.size(), 1u);
  EXPECT_THAT(pending.skipped[0], HasSubstr("reservation is pending"));
}

TEST_F(PoolAdminTest, PolicyTotalsKeepReleasedSequences) {
  const std::string session = AttachAs("p");
  pool_.Create(session, KeyDiff(), Budget(8), "k");
  pool_.Create(session, StreamingLlm(2), Budget(0), "s");
  testing_util::AppendOptions compress;
  compress.compress = true;
  ASSERT_TRUE(Append(pool_.pool, session, "k", 20, layout_, HashValue, compress).ok());
  ASSERT_TRUE(Append(pool_.pool, session, "s", 5, layout_, HashValue).ok());
  auto totals = pool_.pool.PolicyTotals();
  ASSERT_EQ(totals.size(), 2u);
  const PolicyTokenTotals& keydiff = totals[0].policy == KeyDiff().name ? totals[0] : totals[1];
  const PolicyTokenTotals& streaming = totals[0].policy == KeyDiff().name ? totals[1] : totals[0];
  EXPECT_EQ(keydiff.appended, 40);
  EXPECT_EQ(keydiff.evicted, 24);
  EXPECT_EQ(keydiff.kept, 16);
  EXPECT_EQ(keydiff.sequences, 1);
  EXPECT_EQ(keydiff.budgets, std::vector<int32_t>{8});
  EXPECT_EQ(streaming.appended, 10);
  EXPECT_EQ(streaming.kept, 10);
  ASSERT_TRUE(pool_.pool.ReleaseSequence(session, "k").ok());
  totals = pool_.pool.PolicyTotals();
  const PolicyTokenTotals& released = totals[0].policy == KeyDiff().name ? totals[0] : totals[1];
  EXPECT_EQ(released.appended, 40);
  EXPECT_EQ(released.evicted, 24);
  EXPECT_EQ(released.kept, 0);
  EXPECT_EQ(released.sequences, 0);
}

}  // namespace
}  // namespace kvs
