// End to end: every Admin call against the real kvsidecar binary: live defaults (new sequences
// get them at once), a re-budget of running sequences visible in GetLayout, tenant quotas enforced
// with RESOURCE_EXHAUSTED, refused changes, listings, stats, drain and force release.
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvsidecar/client.h"
#include "tests/e2e/e2e_util.h"

namespace kvs_e2e {
namespace {

using ::testing::HasSubstr;

class AdminE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = ServerProcess::Start();
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    auto client = server_->Connect();
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
    auto admin = server_->ConnectAdmin();
    ASSERT_TRUE(admin.ok()) << admin.status();
    admin_ = std::move(*admin);
    // 2 layers, 2 kv heads, head_dim 16, fp16, blocks of 4 tokens.
    layout_ = MakeLayout(2, 2, 4, 16, v1::DTYPE_FLOAT16, 4);
  }

  absl::StatusOr<std::unique_ptr<kvsidecar::Session>> AttachAs(const std::string& tenant,
                                                               int num_blocks = 256) {
    v1::AttachRequest request;
    *request.mutable_layout() = layout_;
    request.set_tenant(tenant);
    request.set_num_blocks(num_blocks);
    return client_->Attach(request);
  }

  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<kvsidecar::Client> client_;
  std::unique_ptr<kvsidecar::AdminClient> admin_;
  v1::ModelLayout layout_;
};

TEST_F(AdminE2eTest, SetDefaultsAppliesToNewSequencesAtOnce) {
  auto session = AttachAs("team-a");
  ASSERT_TRUE(session.ok()) << session.status();
  auto before = (*session)->CreateSequence(v1::CreateSequenceRequest());
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(before->budget().tokens_per_layer(), 0);  // server default: unbounded

  v1::SetDefaultsRequest request;
  request.mutable_default_policy()->set_name("streaming_llm");
  request.mutable_default_budget()->set_tokens_per_layer(24);
  auto set = admin_->SetDefaults(request);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->default_policy().name(), "streaming_llm");
  EXPECT_EQ(set->default_budget().tokens_per_layer(), 24);
  EXPECT_EQ(set->sequences_rebudgeted(), 0);

  auto after = (*session)->CreateSequence(v1::CreateSequenceRequest());
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->budget().tokens_per_layer(), 24);
  EXPECT_EQ(after->policy().name(), "streaming_llm");
  auto config = admin_->GetConfig();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->default_budget().tokens_per_layer(), 24);
  EXPECT_EQ(config->default_policy().name(), "streaming_llm");
  // The sequence created before keeps its budget.
  auto old_layout = (*session)->GetLayout(before->sequence_id());
  ASSERT_TRUE(old_layout.ok()) << old_layout.status();
  EXPECT_EQ(old_layout->budget().tokens_per_layer(), 0);

  // unbounded_budget puts the start-up default back: new sequences are unbounded again.
  v1::SetDefaultsRequest both;
  both.set_unbounded_budget(true);
  both.mutable_default_budget()->set_tokens_per_layer(8);
  auto refused = admin_->SetDefaults(both);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(MessageOf(refused.status()), HasSubstr("unbounded_budget"));
  v1::SetDefaultsRequest unbounded;
  unbounded.set_unbounded_budget(true);
  set = admin_->SetDefaults(unbounded);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->default_budget().tokens_per_layer(), 0);
  EXPECT_EQ(set->default_policy().name(), "streaming_llm");  // unchanged
  auto unbounded_seq = (*session)->CreateSequence(v1::CreateSequenceRequest());
  ASSERT_TRUE(unbounded_seq.ok()) << unbounded_seq.status();
  EXPECT_EQ(unbounded_seq->budget().tokens_per_layer(), 0);
}

TEST_F(AdminE2eTest, RefusedDefaultChangesNameTheReasonAndChangeNothing) {
  v1::SetDefaultsRequest zero;
  zero.mutable_default_budget()->set_tokens_per_layer(0);
  auto refused = admin_->SetDefaults(zero);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(MessageOf(refused.status()), HasSubstr("default_budget.tokens_per_layer"));
  EXPECT_THAT(MessageOf(refused.status()), HasSubstr("kvctl set budget none"));

  v1::SetDefaultsRequest unknown;
  unknown.mutable_default_policy()->set_name("no_such_policy");
  refused = admin_->SetDefaults(unknown);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(MessageOf(refused.status()), HasSubstr("default_policy"));

  refused = admin_->SetDefaults(v1::SetDefaultsRequest());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);

  v1::SetDefaultsRequest rebudget_unbounded;  // the default budget is still unbounded
  rebudget_unbounded.set_rebudget_tenant("default");
  refused = admin_->SetDefaults(rebudget_unbounded);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(MessageOf(refused.status()), HasSubstr("bounded default budget"));

  auto config = admin_->GetConfig();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->default_budget().tokens_per_layer(), 0);
  EXPECT_EQ(config->default_policy().name(), "keydiff");
}

TEST_F(AdminE2eTest, RebudgetCompressesRunningSequencesOfOneTenantOnly) {
  auto a = AttachAs("team-a");
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = AttachAs("team-b");
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_TRUE((*a)->CreateSequence(KeyDiffPolicy(), std::nullopt, "s").ok());
  ASSERT_TRUE((*b)->CreateSequence(KeyDiffPolicy(), std::nullopt, "s").ok());
  ASSERT_TRUE(WriteTokens(**a, "s", 60, 1).ok());
  ASSERT_TRUE(WriteTokens(**b, "s", 60, 2).ok());

  v1::SetDefaultsRequest request;
  request.mutable_default_budget()->set_tokens_per_layer(16);
  request.set_rebudget_tenant("team-a");
  auto set = admin_->SetDefaults(request);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->sequences_rebudgeted(), 1);
  EXPECT_EQ(set->rebudget_skipped_size(), 0);

  auto layout_a = (*a)->GetLayout("s");
  ASSERT_TRUE(layout_a.ok()) << layout_a.status();
  EXPECT_EQ(layout_a->budget().tokens_per_layer(), 16);
  for (const v1::LayerLayout& layer : layout_a->layers()) EXPECT_EQ(layer.count(), 16);
  // The kept tokens are still exactly the ones written (compression moved rows, did not corrupt).
  auto verified = VerifySequence(**a, "s", 1);
  ASSERT_TRUE(verified.ok()) << verified.status();

  auto layout_b = (*b)->GetLayout("s");
  ASSERT_TRUE(layout_b.ok()) << layout_b.status();
  EXPECT_EQ(layout_b->budget().tokens_per_layer(), 0);
  for (const v1::LayerLayout& layer : layout_b->layers()) EXPECT_EQ(layer.count(), 60);

  auto listed = admin_->ListSequences("", "team-a");
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->sequences_size(), 1);
  EXPECT_EQ(listed->sequences(0).budget().tokens_per_layer(), 16);
  EXPECT_THAT(listed->sequences(0).tokens_per_layer(), ::testing::ElementsAre(16, 16));
}

// A re-budget cannot compress a sequence whose policy needs queries: it is listed as skipped,
// holds its tokens under the new budget (over a strict bound: Budget.strict in common.proto), and
// its next Commit with the step's queries brings it under the bound.
TEST_F(AdminE2eTest, RebudgetSkipsAnAttentionSequenceAndItsNextStepCompressesIt) {
  auto a = AttachAs("team-h");
  ASSERT_TRUE(a.ok()) << a.status();
  v1::PolicySpec h2o;
  h2o.set_name("h2o");
  v1::Budget strict = MakeBudget(8);
  strict.set_strict(true);
  strict.set_prefill_block_tokens(4);
  ASSERT_TRUE((*a)->CreateSequence(h2o, strict, "s").ok());
  for (int block = 0; block < 2; ++block) {
    auto written = WriteTokens(**a, "s", 4, 1 + block);  // at the budget: no queries needed
    ASSERT_TRUE(written.ok()) << written.status();
  }

  v1::SetDefaultsRequest request;
  request.mutable_default_budget()->set_tokens_per_layer(2);
  request.set_rebudget_tenant("team-h");
  auto set = admin_->SetDefaults(request);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->sequences_rebudgeted(), 0);
  ASSERT_EQ(set->rebudget_skipped_size(), 1);
  EXPECT_THAT(set->rebudget_skipped(0), HasSubstr((*a)->session_id() + "/s: "));
  EXPECT_THAT(set->rebudget_skipped(0), HasSubstr("needs attention"));
  auto skipped = (*a)->GetLayout("s");
  ASSERT_TRUE(skipped.ok()) << skipped.status();
  EXPECT_EQ(skipped->budget().tokens_per_layer(), 2);
  EXPECT_TRUE(skipped->budget().strict());
  for (const v1::LayerLayout& layer : skipped->layers()) EXPECT_EQ(layer.count(), 8);

  // The next block, committed with its queries: evicted down to the new budget.
  auto reservation = (*a)->Reserve("s", 1);
  ASSERT_TRUE(reservation.ok()) << reservation.status();
  ASSERT_TRUE(WritePattern(**a, *reservation, 3).ok());
  v1::CommitRequest commit;
  commit.set_sequence_id("s");
  commit.set_reservation_id(reservation->id());
  v1::AttentionInputs& attention = *commit.mutable_attention();
  attention.set_num_queries(1);
  attention.add_query_positions(reservation->positions()[0]);
  attention.set_softmax_scale(0.25f);
  attention.set_queries_dtype(v1::DTYPE_FLOAT32);
  std::string queries;
  for (int i = 0; i < layout_.num_layers() * layout_.num_q_heads() * layout_.head_dim(); ++i) {
    const float value = 0.01f * static_cast<float>(i % 17);
    queries.append(reinterpret_cast<const char*>(&value), sizeof(value));
  }
  attention.set_inline_queries(queries);
  auto committed = (*a)->Commit(commit);
  ASSERT_TRUE(committed.ok()) << committed.status();
  auto after = (*a)->GetLayout("s");
  ASSERT_TRUE(after.ok()) << after.status();
  for (const v1::LayerLayout& layer : after->layers()) {
    EXPECT_LE(layer.count(), 2 + 4) << "layer " << layer.layer();
  }
}

TEST_F(AdminE2eTest, SequenceQuotaIsEnforcedAndQuotaBelowUseIsRefused) {
  auto a = AttachAs("team-q");
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE((*a)->CreateSequence(KeyDiffPolicy(), std::nullopt, "one").ok());
  ASSERT_TRUE((*a)->CreateSequence(KeyDiffPolicy(), std::nullopt, "two").ok());

  v1::SetQuotaRequest below;
  below.set_tenant("team-q");
  below.mutable_quota()->set_sequences(1);
  auto refused = admin_->SetQuota(below);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(MessageOf(refused.status()), HasSubstr("quota.sequences 1 is below the 2"));

  v1::SetQuotaRequest ok;
  ok.set_tenant("team-q");
  ok.mutable_quota()->set_sequences(2);
  auto set = admin_->SetQuota(ok);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->usage().sequences(), 2);
  EXPECT_FALSE(set->over_quota());

  auto third = (*a)->CreateSequence(KeyDiffPolicy(), std::nullopt, "three");
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(MessageOf(third.status()), HasSubstr("tenant team-q"));
  // Another tenant is not limited.
  auto other = AttachAs("team-r");
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_TRUE((*other)->CreateSequence(KeyDiffPolicy(), std::nullopt, "x").ok());
  // Releasing one makes room again.
  ASSERT_TRUE((*a)->ReleaseSequence("one").ok());
  EXPECT_TRUE((*a)->CreateSequence(KeyDiffPolicy(), std::nullopt, "three").ok());

  v1::SetQuotaRequest negative;
  negative.set_tenant("team-q");
  negative.mutable_quota()->set_sequences(-1);
  EXPECT_EQ(admin_->SetQuota(negative).status().code(), absl::StatusCode::kInvalidArgument);
  v1::SetQuotaRequest no_tenant;
  EXPECT_EQ(admin_->SetQuota(no_tenant).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(AdminE2eTest, ArenaQuotaRefusesGrowthAndRebudgetBringsATenantUnderIt) {
  auto a = AttachAs("team-m");
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE((*a)->CreateSequence(KeyDiffPolicy(), std::nullopt, "s").ok());
  ASSERT_TRUE(WriteTokens(**a, "s", 64, 3).ok());
  auto stats = admin_->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  const uint64_t used = stats->arena_bytes_used();
  ASSERT_GT(used, 0u);

  // Half of what the tenant uses: refused without the re-budget flag.
  v1::SetQuotaRequest request;
  request.set_tenant("team-m");
  request.mutable_quota()->set_arena_bytes(used / 2);
  auto refused = admin_->SetQuota(request);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(MessageOf(refused.status()), HasSubstr("quota.arena_bytes"));

  // With it: the sequence is compressed to 16 tokens per layer (a quarter) and fits.
  request.set_rebudget(true);
  request.set_rebudget_tokens_per_layer(16);
  auto set = admin_->SetQuota(request);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->sequences_rebudgeted(), 1);
  EXPECT_FALSE(set->over_quota());
  EXPECT_LE(set->usage().arena_bytes(), used / 2);
  auto layout = (*a)->GetLayout("s");
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->budget().tokens_per_layer(), 16);
  for (const v1::LayerLayout& layer : layout->layers()) EXPECT_EQ(layer.count(), 16);

  // A tenant at its quota may not grow: fill it up, then the next write is refused.
  v1::SetQuotaRequest tight;
  tight.set_tenant("team-m");
  tight.mutable_quota()->set_arena_bytes(set->usage().arena_bytes());
  ASSERT_TRUE(admin_->SetQuota(tight).ok());
  ASSERT_TRUE((*a)->CreateSequence(KeyDiffPolicy(), std::nullopt, "grow").ok());
  auto grown = WriteTokens(**a, "grow", 8, 4);
  EXPECT_EQ(grown.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(MessageOf(grown.status()), HasSubstr("quota arena_bytes"));

  auto quotas = admin_->GetConfig();
  ASSERT_TRUE(quotas.ok());
  ASSERT_EQ(quotas->quotas_size(), 1);
  EXPECT_EQ(quotas->quotas(0).tenant(), "team-m");
}

TEST_F(AdminE2eTest, ListingsStatsForceReleaseAndDrain) {
  auto a = AttachAs("team-l");
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE((*a)->CreateSequence(KeyDiffPolicy(), MakeBudget(32), "s1").ok());
  ASSERT_TRUE((*a)->CreateSequence(KeyDiffPolicy(), std::nullopt, "s2").ok());
  ASSERT_TRUE(WriteTokens(**a, "s1", 10, 5).ok());

  auto sessions = admin_->ListSessions("team-l");
  ASSERT_TRUE(sessions.ok()) << sessions.status();
  ASSERT_EQ(sessions->sessions_size(), 1);
  EXPECT_EQ(sessions->sessions(0).session_id(), (*a)->session_id());
  EXPECT_EQ(sessions->sessions(0).sequences(), 2);
  auto sequences = admin_->ListSequences((*a)->session_id());
  ASSERT_TRUE(sequences.ok()) << sequences.status();
  ASSERT_EQ(sequences->sequences_size(), 2);
  const v1::SequenceInfo& s1 = sequences->sequences(0);
  EXPECT_EQ(s1.sequence_id(), "s1");
  EXPECT_EQ(s1.tenant(), "team-l");
  EXPECT_EQ(s1.policy().name(), "keydiff");
  EXPECT_EQ(s1.budget().tokens_per_layer(), 32);
  EXPECT_THAT(s1.tokens_per_layer(), ::testing::ElementsAre(10, 10));
  EXPECT_EQ(s1.blocks(), 2 * 3);  // ceil(10 / 4) blocks per layer
  EXPECT_GT(s1.arena_bytes(), 0u);
  EXPECT_GE(s1.age_ms(), 0);
  EXPECT_GT(s1.created_unix_ms(), 0);

  auto stats = admin_->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->sessions(), 1);
  EXPECT_EQ(stats->sequences(), 2);
  EXPECT_EQ(stats->tokens_appended(), 20);
  EXPECT_EQ(stats->tokens_kept(), 20);
  EXPECT_TRUE(stats->backend_healthy());
  ASSERT_EQ(stats->tenants_size(), 1);
  EXPECT_EQ(stats->tenants(0).usage().sequences(), 2);

  auto released = admin_->ForceRelease((*a)->session_id(), "s1");
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_EQ(released->sequences_released(), 1);
  EXPECT_EQ(released->blocks_released(), 6);
  EXPECT_EQ(admin_->ForceRelease((*a)->session_id(), "s1").status().code(),
            absl::StatusCode::kNotFound);

  auto drain = admin_->Drain();
  ASSERT_TRUE(drain.ok()) << drain.status();
  EXPECT_EQ(drain->sessions_remaining(), 1);
  EXPECT_EQ(drain->sequences_remaining(), 1);
  EXPECT_FALSE(drain->empty());
  EXPECT_EQ(AttachAs("team-l").status().code(), absl::StatusCode::kUnavailable);

  auto whole = admin_->ForceRelease((*a)->session_id());
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(whole->sequences_released(), 1);
  drain = admin_->Drain();
  ASSERT_TRUE(drain.ok()) << drain.status();
  EXPECT_TRUE(drain->empty());
  EXPECT_TRUE(admin_->GetStats()->draining());
}

}  // namespace
}  // namespace kvs_e2e
