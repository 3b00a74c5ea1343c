// Compressed prefix reuse, end to end against the real sidecar binary: Publish copies a
// sequence's compressed cache under a client-computed content key (disk tier without a remote
// tier, Redis with one), CreateSequence(from_prefix) starts new sequences from it in other
// sessions, bit-identical (K/V, positions, next position, policy, budget), as many times as
// asked; the stored layout and budget are checked (naming the field), another tenant never sees
// a prefix, a query-aware policy publishes only with a stated query window, the tenant's quota
// holds, Unpublish deletes; LookupPrefixes reports which keys the tenant holds (tier, bytes)
// without taking them, Publish's tier puts the copy where it is named; and with a remote tier a
// second sidecar starts from a prefix the first one published.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvsidecar/client.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/redis_util.h"

namespace kvs_e2e {
namespace {

using ::testing::HasSubstr;

const v1::ModelLayout kLayout = MakeLayout(3, 2, 4, 32, v1::DTYPE_FLOAT16);
// Content keys: the client computes them (sha256 hex); any 64 lowercase hex digits will do here.
const std::string kKey(64, 'a');
const std::string kOtherKey = std::string(63, 'b') + "c";

std::unique_ptr<kvsidecar::Session> Attach(kvsidecar::Client& client, const std::string& tenant,
                                           const v1::ModelLayout& layout = kLayout) {
  auto session = client.Attach(layout, tenant, /*num_blocks=*/512, /*lease_ms=*/30000);
  EXPECT_TRUE(session.ok()) << session.status();
  return session.ok() ? std::move(*session) : nullptr;
}

// A keydiff sequence of `tokens` tokens compressed to `budget`.
void MakeCompressed(kvsidecar::Session& session, const std::string& id, int tokens, int budget,
                    uint64_t seed, const v1::PolicySpec& policy = KeyDiffPolicy()) {
  auto created = session.CreateSequence(policy, MakeBudget(budget), id);
  ASSERT_TRUE(created.ok()) << created.status();
  auto committed = WriteTokens(session, id, tokens, seed, /*compress_if_over_budget=*/true);
  ASSERT_TRUE(committed.ok()) << committed.status();
}

absl::StatusOr<v1::PublishResponse> Publish(kvsidecar::Session& session, const std::string& seq,
                                            const std::string& key, int query_window = 0) {
  v1::PublishRequest request;
  request.set_sequence_id(seq);
  request.set_prefix_key(key);
  request.set_query_window(query_window);
  return session.Publish(request);
}

absl::StatusOr<v1::CreateSequenceResponse> FromPrefix(kvsidecar::Session& session,
                                                      const std::string& key,
                                                      const std::string& id = "") {
  v1::CreateSequenceRequest request;
  request.set_from_prefix(key);
  request.set_sequence_id(id);
  return session.CreateSequence(request);
}

struct State {
  Verified verified;
  std::string payload;
  v1::GetLayoutResponse layout;
};

State Take(kvsidecar::Session& session, const std::string& seq, uint64_t seed) {
  State out;
  auto verified = VerifySequence(session, seq, seed);
  EXPECT_TRUE(verified.ok()) << verified.status();
  if (verified.ok()) out.verified = *verified;
  auto exported = session.Export(seq);
  EXPECT_TRUE(exported.ok()) << exported.status();
  if (exported.ok()) out.payload.assign(exported->payload.begin(), exported->payload.end());
  auto layout = session.GetLayout(seq, {}, /*omit_positions=*/true);
  EXPECT_TRUE(layout.ok()) << layout.status();
  if (layout.ok()) out.layout = *layout;
  return out;
}

void ExpectSame(const State& a, const State& b) {
  EXPECT_GT(a.verified.rows, 0);
  EXPECT_EQ(a.verified.rows, b.verified.rows);
  EXPECT_EQ(a.verified.counts, b.verified.counts);
  EXPECT_EQ(a.verified.positions, b.verified.positions);
  EXPECT_TRUE(a.payload == b.payload) << "export payloads differ";
  EXPECT_EQ(a.layout.next_position(), b.layout.next_position());
  EXPECT_EQ(a.layout.tokens_appended(), b.layout.tokens_appended());
  EXPECT_EQ(a.layout.policy().SerializeAsString(), b.layout.policy().SerializeAsString());
  EXPECT_EQ(a.layout.budget().SerializeAsString(), b.layout.budget().SerializeAsString());
}

class PrefixTest : public SharedServerTest<PrefixTest> {};

TEST_F(PrefixTest, PublishedPrefixStartsSequencesInOtherSessionsBitIdentical) {
  auto client = server_->Connect();
  ASSERT_TRUE(client.ok());
  auto a = Attach(**client, "t-reuse");
  ASSERT_NE(a, nullptr);
  MakeCompressed(*a, "doc", 400, 300, 31);
  const State before = Take(*a, "doc", 31);

  auto published = Publish(*a, "doc", kKey);
  ASSERT_TRUE(published.ok()) << published.status() << server_->Logs();
  EXPECT_EQ(published->tier(), v1::TIER_DISK);  // no remote tier configured
  EXPECT_GT(published->bytes(), 0u);
  // Copying, not moving: the published sequence stays live and unchanged.
  ExpectSame(before, Take(*a, "doc", 31));

  // Another session of the tenant, twice (the copy is not consumed), and a third session.
  auto b = Attach(**client, "t-reuse");
  ASSERT_NE(b, nullptr);
  for (const std::string id : {"q1", "q2"}) {
    auto created = FromPrefix(*b, kKey, id);
    ASSERT_TRUE(created.ok()) << created.status();
    EXPECT_EQ(created->sequence_id(), id);
    EXPECT_EQ(created->policy().name(), "keydiff");
    EXPECT_EQ(created->budget().tokens_per_layer(), 300);
    ExpectSame(before, Take(*b, id, 31));
  }
  auto c = Attach(**client, "t-reuse");
  ASSERT_NE(c, nullptr);
  auto generated = FromPrefix(*c, kKey);
  ASSERT_TRUE(generated.ok()) << generated.status();
  EXPECT_FALSE(generated->sequence_id().empty());
  ExpectSame(before, Take(*c, generated->sequence_id(), 31));

  // The new sequence goes on like the original: the next tokens land at the same positions.
  auto more = WriteTokens(*b, "q1", 16, 31, /*compress_if_over_budget=*/true);
  ASSERT_TRUE(more.ok()) << more.status();
  auto more_a = WriteTokens(*a, "doc", 16, 31, /*compress_if_over_budget=*/true);
  ASSERT_TRUE(more_a.ok()) << more_a.status();
  ExpectSame(Take(*a, "doc", 31), Take(*b, "q1", 31));

  // The prefix is listed (under its own namespace), and Unpublish deletes it.
  auto admin = server_->ConnectAdmin();
  ASSERT_TRUE(admin.ok());
  auto listed = (*admin)->ListSpilled("t-reuse");
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->copies_size(), 1);
  EXPECT_EQ(listed->copies(0).sequence_id(), "prefix/" + kKey);
  v1::UnpublishRequest unpublish;
  unpublish.set_prefix_key(kKey);
  ASSERT_TRUE(c->Unpublish(unpublish).ok());
  auto gone = FromPrefix(*c, kKey);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound) << gone.status();
  EXPECT_EQ(c->Unpublish(unpublish).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(PrefixTest, MismatchedLayoutAndBudgetAreRefusedNamingTheField) {
  auto client = server_->Connect();
  ASSERT_TRUE(client.ok());
  auto a = Attach(**client, "t-shape");
  ASSERT_NE(a, nullptr);
  MakeCompressed(*a, "doc", 200, 100, 32);
  ASSERT_TRUE(Publish(*a, "doc", kKey).ok());

  auto other = Attach(**client, "t-shape", MakeLayout(3, 2, 4, 64, v1::DTYPE_FLOAT16));
  ASSERT_NE(other, nullptr);
  auto refused = FromPrefix(*other, kKey, "x");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(MessageOf(refused.status()), HasSubstr("layout.head_dim"));
  auto layers = Attach(**client, "t-shape", MakeLayout(4, 2, 4, 32, v1::DTYPE_FLOAT16));
  ASSERT_NE(layers, nullptr);
  refused = FromPrefix(*layers, kKey, "x");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(MessageOf(refused.status()), HasSubstr("layout.num_layers"));

  auto b = Attach(**client, "t-shape");
  ASSERT_NE(b, nullptr);
  v1::CreateSequenceRequest request;
  request.set_from_prefix(kKey);
  *request.mutable_budget() = MakeBudget(64);
  auto budget = b->CreateSequence(request);
  EXPECT_EQ(budget.status().code(), absl::StatusCode::kInvalidArgument) << budget.status();
  EXPECT_THAT(MessageOf(budget.status()), HasSubstr("budget.tokens_per_layer"));
  request.clear_budget();
  *request.mutable_policy() = StreamingPolicy(4);
  auto policy = b->CreateSequence(request);
  EXPECT_EQ(policy.status().code(), absl::StatusCode::kInvalidArgument) << policy.status();
  EXPECT_THAT(MessageOf(policy.status()), HasSubstr("policy.name"));
  // The same policy and budget stated explicitly are accepted.
  *request.mutable_policy() = KeyDiffPolicy();
  *request.mutable_budget() = MakeBudget(100);
  EXPECT_TRUE(b->CreateSequence(request).ok());

  // Malformed and unknown keys; a failed call left nothing behind.
  auto malformed = FromPrefix(*b, "ABC");
  EXPECT_EQ(malformed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(MessageOf(malformed.status()), HasSubstr("from_prefix"));
  auto bad_publish = Publish(*a, "doc", std::string(64, 'G'));
  EXPECT_EQ(bad_publish.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(MessageOf(bad_publish.status()), HasSubstr("prefix_key"));
  auto unknown = FromPrefix(*b, kOtherKey);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound) << unknown.status();
  EXPECT_EQ(other->GetLayout("x").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(PrefixTest, AnotherTenantNeverSeesOrDeletesAPrefix) {
  auto client = server_->Connect();
  ASSERT_TRUE(client.ok());
  auto owner = Attach(**client, "t-owner");
  ASSERT_NE(owner, nullptr);
  MakeCompressed(*owner, "doc", 200, 100, 33);
  ASSERT_TRUE(Publish(*owner, "doc", kKey).ok());

  auto stranger = Attach(**client, "t-stranger");
  ASSERT_NE(stranger, nullptr);
  auto refused = FromPrefix(*stranger, kKey, "stolen");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kNotFound) << refused.status();
  EXPECT_THAT(MessageOf(refused.status()), HasSubstr("t-stranger"));
  v1::UnpublishRequest unpublish;
  unpublish.set_prefix_key(kKey);
  EXPECT_EQ(stranger->Unpublish(unpublish).status().code(), absl::StatusCode::kNotFound);
  // Nor by restoring it as a spilled copy.
  v1::RestoreRequest restore;
  restore.set_sequence_id("prefix/" + kKey);
  restore.set_from_session_id("#prefix");
  EXPECT_FALSE(stranger->Restore(restore).ok());
  EXPECT_FALSE(owner->Restore(restore).ok());
  // The owner's prefix is still there and whole.
  auto again = Attach(**client, "t-owner");
  ASSERT_NE(again, nullptr);
  auto created = FromPrefix(*again, kKey, "mine");
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_TRUE(VerifySequence(*again, "mine", 33).ok());
}

absl::StatusOr<v1::LookupPrefixesResponse> Lookup(kvsidecar::Session& session,
                                                  const std::vector<std::string>& keys) {
  v1::LookupPrefixesRequest request;
  for (const std::string& key : keys) request.add_prefix_keys(key);
  return session.LookupPrefixes(request);
}

TEST_F(PrefixTest, LookupPrefixesFindsTheTenantsKeysWithoutReadingThem) {
  auto client = server_->Connect();
  ASSERT_TRUE(client.ok());
  auto owner = Attach(**client, "t-lookup");
  ASSERT_NE(owner, nullptr);
  MakeCompressed(*owner, "doc", 200, 100, 35);
  auto published = Publish(*owner, "doc", kKey);
  ASSERT_TRUE(published.ok()) << published.status();
  const std::string third = std::string(62, 'd') + "ef";

  // Found by any session of the tenant, in key order, with the tier and bytes Publish reported.
  auto other = Attach(**client, "t-lookup");
  ASSERT_NE(other, nullptr);
  auto found = Lookup(*other, {kOtherKey, kKey, third});
  ASSERT_TRUE(found.ok()) << found.status();
  ASSERT_EQ(found->found_size(), 1);
  EXPECT_EQ(found->found(0).index(), 1);
  EXPECT_EQ(found->found(0).tier(), v1::TIER_DISK);
  EXPECT_EQ(found->found(0).bytes(), published->bytes());
  // Looking up takes nothing: the prefix still starts sequences, and lookups repeat.
  ASSERT_TRUE(FromPrefix(*other, kKey, "q").ok());
  auto again = Lookup(*other, {kKey});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->found_size(), 1);
  auto none = Lookup(*other, {});
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->found_size(), 0);

  // Another tenant finds nothing under the same key.
  auto stranger = Attach(**client, "t-lookup-stranger");
  ASSERT_NE(stranger, nullptr);
  auto foreign = Lookup(*stranger, {kKey});
  ASSERT_TRUE(foreign.ok()) << foreign.status();
  EXPECT_EQ(foreign->found_size(), 0);

  // Bad keys and too many keys name the field; an unknown session is NOT_FOUND.
  auto bad = Lookup(*other, {kKey, "not-a-key"});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(MessageOf(bad.status()), HasSubstr("prefix_keys[1]"));
  auto many = Lookup(*other, std::vector<std::string>(4097, kKey));
  EXPECT_EQ(many.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(MessageOf(many.status()), HasSubstr("prefix_keys: at most 4096"));
  v1::LookupPrefixesRequest unknown;
  unknown.set_session_id("no-such-session");
  unknown.add_prefix_keys(kKey);
  grpc::ClientContext context;
  v1::LookupPrefixesResponse response;
  EXPECT_EQ(other->stub()->LookupPrefixes(&context, unknown, &response).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST_F(PrefixTest, PublishGoesToTheTierNamed) {
  auto client = server_->Connect();
  ASSERT_TRUE(client.ok());
  auto a = Attach(**client, "t-tier");
  ASSERT_NE(a, nullptr);
  MakeCompressed(*a, "doc", 200, 100, 36);
  v1::PublishRequest request;
  request.set_sequence_id("doc");
  request.set_prefix_key(kKey);
  request.set_tier(v1::TIER_HOST);
  auto host = a->Publish(request);
  ASSERT_TRUE(host.ok()) << host.status();
  EXPECT_EQ(host->tier(), v1::TIER_HOST);
  auto found = Lookup(*a, {kKey});
  ASSERT_TRUE(found.ok());
  ASSERT_EQ(found->found_size(), 1);
  EXPECT_EQ(found->found(0).tier(), v1::TIER_HOST);
  auto b = Attach(**client, "t-tier");
  ASSERT_NE(b, nullptr);
  ASSERT_TRUE(FromPrefix(*b, kKey, "from-host").ok());
  EXPECT_TRUE(VerifySequence(*b, "from-host", 36).ok());
  // Publishing again to disk moves the copy there.
  request.set_tier(v1::TIER_DISK);
  auto disk = a->Publish(request);
  ASSERT_TRUE(disk.ok()) << disk.status();
  EXPECT_EQ(disk->tier(), v1::TIER_DISK);
  found = Lookup(*a, {kKey});
  ASSERT_TRUE(found.ok());
  ASSERT_EQ(found->found_size(), 1);
  EXPECT_EQ(found->found(0).tier(), v1::TIER_DISK);

  // No remote tier here; the arena and unknown values are not tiers to publish to.
  request.set_prefix_key(kOtherKey);
  request.set_tier(v1::TIER_REMOTE);
  auto remote = a->Publish(request);
  EXPECT_EQ(remote.status().code(), absl::StatusCode::kFailedPrecondition) << remote.status();
  EXPECT_THAT(MessageOf(remote.status()), HasSubstr("no remote tier"));
  for (int tier : {static_cast<int>(v1::TIER_ARENA), 99}) {
    request.set_tier(static_cast<v1::Tier>(tier));
    auto refused = a->Publish(request);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << tier;
    EXPECT_THAT(MessageOf(refused.status()), HasSubstr("tier"));
  }
  // None of the refused calls stored anything.
  auto after = Lookup(*a, {kOtherKey});
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->found_size(), 0);
}

TEST_F(PrefixTest, QueryAwarePolicyPublishesOnlyWithAQueryWindow) {
  auto client = server_->Connect();
  ASSERT_TRUE(client.ok());
  auto session = Attach(**client, "t-window");
  ASSERT_NE(session, nullptr);
  v1::PolicySpec snapkv;
  snapkv.set_name("snapkv");
  snapkv.mutable_snapkv();
  auto created = session->CreateSequence(snapkv, MakeBudget(100), "snap");
  ASSERT_TRUE(created.ok()) << created.status();
  ASSERT_TRUE(WriteTokens(*session, "snap", 64, 34).ok());

  auto refused = Publish(*session, "snap", kKey);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(MessageOf(refused.status()), HasSubstr("query_window"));
  EXPECT_THAT(MessageOf(refused.status()), HasSubstr("snapkv"));
  // Nothing was stored.
  auto none = FromPrefix(*session, kKey);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound) << none.status();
  EXPECT_EQ(Publish(*session, "snap", kKey, -1).status().code(),
            absl::StatusCode::kInvalidArgument);

  auto allowed = Publish(*session, "snap", kKey, /*query_window=*/32);
  ASSERT_TRUE(allowed.ok()) << allowed.status();
  auto from = FromPrefix(*session, kKey, "snap2");
  ASSERT_TRUE(from.ok()) << from.status();
  EXPECT_EQ(from->policy().name(), "snapkv");

  // Query-agnostic policies need no window.
  ASSERT_TRUE(session->CreateSequence(StreamingPolicy(4), MakeBudget(32), "stream").ok());
  ASSERT_TRUE(WriteTokens(*session, "stream", 64, 35, /*compress_if_over_budget=*/true).ok());
  EXPECT_TRUE(Publish(*session, "stream", kOtherKey).ok());
}

TEST_F(PrefixTest, PublishedBytesCountAgainstTheTenantsDiskQuota) {
  auto client = server_->Connect();
  ASSERT_TRUE(client.ok());
  auto admin = server_->ConnectAdmin();
  ASSERT_TRUE(admin.ok());
  v1::SetQuotaRequest quota;
  quota.set_tenant("t-quota");
  quota.mutable_quota()->set_disk_bytes(4096);
  ASSERT_TRUE((*admin)->SetQuota(quota).ok());
  auto session = Attach(**client, "t-quota");
  ASSERT_NE(session, nullptr);
  MakeCompressed(*session, "doc", 200, 100, 36);
  auto refused = Publish(*session, "doc", kKey);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(MessageOf(refused.status()), HasSubstr("disk_bytes"));
  EXPECT_EQ(FromPrefix(*session, kKey).status().code(), absl::StatusCode::kNotFound);

  quota.mutable_quota()->set_disk_bytes(0);
  ASSERT_TRUE((*admin)->SetQuota(quota).ok());
  auto published = Publish(*session, "doc", kKey);
  ASSERT_TRUE(published.ok()) << published.status();
  auto quotas = (*admin)->GetQuotas("t-quota");
  ASSERT_TRUE(quotas.ok()) << quotas.status();
  ASSERT_EQ(quotas->tenants_size(), 1);
  EXPECT_EQ(quotas->tenants(0).usage().disk_bytes(), published->bytes());
}

TEST(PrefixRemoteTest, SecondSidecarStartsFromAPrefixTheFirstPublished) {
  if (!RedisInstalled()) GTEST_SKIP() << "redis-server / redis-cli are not installed";
  auto redis = RedisNode::Start({});
  ASSERT_TRUE(redis.ok()) << redis.status();
  ServerProcess::Options options;
  options.extra_args = {"--remote_tier=redis://" + (*redis)->address()};
  auto first = ServerProcess::Start(options);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = ServerProcess::Start(options);
  ASSERT_TRUE(second.ok()) << second.status();

  auto client_a = (*first)->Connect();
  ASSERT_TRUE(client_a.ok());
  auto a = Attach(**client_a, "t-shared");
  ASSERT_NE(a, nullptr);
  MakeCompressed(*a, "doc", 400, 300, 37);
  const State before = Take(*a, "doc", 37);
  auto published = Publish(*a, "doc", kKey);
  ASSERT_TRUE(published.ok()) << published.status() << (*first)->Logs();
  EXPECT_EQ(published->tier(), v1::TIER_REMOTE);
  ExpectSame(before, Take(*a, "doc", 37));

  auto client_b = (*second)->Connect();
  ASSERT_TRUE(client_b.ok());
  auto b = Attach(**client_b, "t-shared");
  ASSERT_NE(b, nullptr);
  // Many times, from two sessions: a published prefix is read without a restore claim.
  for (const std::string id : {"q1", "q2"}) {
    auto created = FromPrefix(*b, kKey, id);
    ASSERT_TRUE(created.ok()) << created.status() << (*second)->Logs();
    ExpectSame(before, Take(*b, id, 37));
  }
  auto b2 = Attach(**client_b, "t-shared");
  ASSERT_NE(b2, nullptr);
  ASSERT_TRUE(FromPrefix(*b2, kKey, "q").ok());
  // Another tenant on the second sidecar sees nothing.
  auto stranger = Attach(**client_b, "t-other");
  ASSERT_NE(stranger, nullptr);
  EXPECT_EQ(FromPrefix(*stranger, kKey).status().code(), absl::StatusCode::kNotFound);
  // The second sidecar deletes the first one's copy.
  v1::UnpublishRequest unpublish;
  unpublish.set_prefix_key(kKey);
  auto deleted = b->Unpublish(unpublish);
  ASSERT_TRUE(deleted.ok()) << deleted.status();
  EXPECT_EQ(FromPrefix(*a, kKey).status().code(), absl::StatusCode::kNotFound);
  auto keys = (*redis)->Cli("--scan --pattern 'kvs:*prefix*'");
  ASSERT_TRUE(keys.ok()) << keys.status();
  EXPECT_EQ(*keys, "");
}

}  // namespace
}  // namespace kvs_e2e
