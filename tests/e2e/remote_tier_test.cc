// The remote tier on real Redis, end to end against the real sidecar binary: redis-server
// processes on loopback ports started by the test (a single node and a 3-master Redis Cluster).
// Spill to TIER_REMOTE and Restore bit-identical (automatic restore included); a sequence moved
// between two sidecars sharing one Redis (positions and policy state included); racing restores
// (exactly one wins, the claim is exclusive, a restored copy is not served again); tenant
// isolation; the remote_bytes quota; a SIGTERM drain to Redis adopted elsewhere; and the
// faults: a Redis node killed mid-spill (UNAVAILABLE, the arena copy intact, a spill after its
// restart succeeds), a restore while Redis is down (UNAVAILABLE, never NOT_FOUND), a damaged
// chunk (DATA_LOSS, never served), a wrong password (UNAUTHENTICATED, the password in no log
// or config), and a full Redis (maxmemory + noeviction: RESOURCE_EXHAUSTED).
#include <signal.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvsidecar/client.h"
#include "tests/e2e/e2e_util.h"
#include "tests/e2e/redis_util.h"

namespace kvs_e2e {
namespace {

using ::testing::HasSubstr;

constexpr char kTenant[] = "e2e";

#define SKIP_WITHOUT_REDIS()                                                            \
  if (!RedisInstalled()) {                                                              \
    GTEST_SKIP() << "redis-server / redis-cli are not installed (deploy/install_deps.sh " \
                    "installs redis-server and redis-tools)";                           \
  }

std::unique_ptr<ServerProcess> StartSidecar(const std::string& url,
                                            std::vector<std::string> extra = {}) {
  ServerProcess::Options options;
  options.extra_args = {"--remote_tier=" + url};
  options.extra_args.insert(options.extra_args.end(), extra.begin(), extra.end());
  auto server = ServerProcess::Start(options);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? std::move(*server) : nullptr;
}

std::unique_ptr<kvsidecar::Session> Attach(kvsidecar::Client& client, const v1::ModelLayout& layout,
                                           int num_blocks, const std::string& tenant = kTenant) {
  auto session = client.Attach(layout, tenant, num_blocks, /*lease_ms=*/30000);
  EXPECT_TRUE(session.ok()) << session.status();
  return session.ok() ? std::move(*session) : nullptr;
}

absl::StatusOr<v1::SpillResponse> Spill(kvsidecar::Session& session, const std::string& seq,
                                        v1::Tier target = v1::TIER_REMOTE) {
  v1::SpillRequest request;
  request.set_sequence_id(seq);
  request.set_target(target);
  return session.Spill(request);
}

absl::StatusOr<v1::RestoreResponse> Restore(kvsidecar::Session& session, const std::string& seq,
                                            const std::string& from_session = "") {
  v1::RestoreRequest request;
  request.set_sequence_id(seq);
  request.set_from_session_id(from_session);
  return session.Restore(request);
}

void MakeSequence(kvsidecar::Session& session, const std::string& id, int tokens, int budget,
                  uint64_t seed) {
  auto created = session.CreateSequence(KeyDiffPolicy(), MakeBudget(budget), id);
  ASSERT_TRUE(created.ok()) << created.status();
  auto committed = WriteTokens(session, id, tokens, seed, /*compress_if_over_budget=*/true);
  ASSERT_TRUE(committed.ok()) << committed.status();
}

struct Snapshot {
  Verified verified;
  std::string payload;
};

Snapshot Take(kvsidecar::Session& session, const std::string& seq, uint64_t seed) {
  Snapshot out;
  auto verified = VerifySequence(session, seq, seed);
  EXPECT_TRUE(verified.ok()) << verified.status();
  if (verified.ok()) out.verified = *verified;
  auto exported = session.Export(seq);
  EXPECT_TRUE(exported.ok()) << exported.status();
  if (exported.ok()) out.payload.assign(exported->payload.begin(), exported->payload.end());
  return out;
}

void ExpectSame(const Snapshot& a, const Snapshot& b) {
  EXPECT_EQ(a.verified.counts, b.verified.counts);
  EXPECT_EQ(a.verified.positions, b.verified.positions);
  EXPECT_EQ(a.verified.rows, b.verified.rows);
  EXPECT_GT(a.verified.rows, 0);
  EXPECT_TRUE(a.payload == b.payload) << "export payloads differ";
}

// The Redis key prefix of (tenant, sequence) copies (storage/redis/remote_tier.h).
std::string KeyPrefix(const std::string& tenant, const std::string& seq) {
  return absl::StrCat("kvs:{", absl::BytesToHexString(tenant), ":", seq, "}");
}

const v1::ModelLayout kLayout = MakeLayout(3, 2, 4, 32, v1::DTYPE_FLOAT16);

TEST(RemoteTierE2eTest, SingleNodeRoundTripAutomaticRestoreAndListing) {
  SKIP_WITHOUT_REDIS();
  auto redis = RedisNode::Start({});
  ASSERT_TRUE(redis.ok()) << redis.status();
  auto server = StartSidecar("redis://" + (*redis)->address(),
                             {"--remote_tier_chunk_bytes=64Ki"});  // several chunks per layer
  ASSERT_NE(server, nullptr);
  auto client = server->Connect();
  ASSERT_TRUE(client.ok());
  auto admin = server->ConnectAdmin();
  ASSERT_TRUE(admin.ok());
  auto session = Attach(**client, kLayout, 512);
  ASSERT_NE(session, nullptr);
  MakeSequence(*session, "s", 400, 300, 21);
  const Snapshot before = Take(*session, "s", 21);

  auto spilled = Spill(*session, "s");
  ASSERT_TRUE(spilled.ok()) << spilled.status() << server->Logs();
  EXPECT_EQ(spilled->tier(), v1::TIER_REMOTE);
  auto listed = (*admin)->ListSpilled(kTenant);
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->copies_size(), 1);
  EXPECT_EQ(listed->copies(0).tier(), v1::TIER_REMOTE);
  EXPECT_EQ(listed->copies(0).sequence_id(), "s");
  EXPECT_EQ(listed->copies(0).session_id(), session->session_id());
  EXPECT_EQ(listed->copies(0).bytes(), spilled->bytes());
  // The keys carry the TTL.
  auto ttl = (*redis)->Cli(absl::StrCat("PTTL '", KeyPrefix(kTenant, "s"), ":m'"));
  ASSERT_TRUE(ttl.ok());
  int64_t ms = 0;
  ASSERT_TRUE(absl::SimpleAtoi(absl::StripAsciiWhitespace(*ttl), &ms)) << *ttl;
  EXPECT_GT(ms, 0);

  auto restored = Restore(*session, "s");
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->tier(), v1::TIER_REMOTE);
  EXPECT_EQ(restored->bytes(), spilled->bytes());
  ExpectSame(before, Take(*session, "s", 21));
  // Restored: the copy is gone from Redis and from the listing.
  auto keys = (*redis)->Cli("--scan --pattern 'kvs:{*'");
  ASSERT_TRUE(keys.ok());
  EXPECT_EQ(absl::StripAsciiWhitespace(*keys), "") << *keys;
  listed = (*admin)->ListSpilled(kTenant);
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->copies_size(), 0);

  // Automatic restore on use (Export through GetLayout).
  ASSERT_TRUE(Spill(*session, "s").ok());
  ExpectSame(before, Take(*session, "s", 21));
  // Between tiers: remote -> disk -> remote -> host.
  ASSERT_TRUE(Spill(*session, "s").ok());
  ASSERT_TRUE(Spill(*session, "s", v1::TIER_DISK).ok());
  keys = (*redis)->Cli("--scan --pattern 'kvs:{*'");
  EXPECT_EQ(absl::StripAsciiWhitespace(*keys), "") << "moved to disk, still in Redis: " << *keys;
  ASSERT_TRUE(Spill(*session, "s").ok());
  ASSERT_TRUE(Spill(*session, "s", v1::TIER_HOST).ok());
  ExpectSame(before, Take(*session, "s", 21));
}

// A sidecar on `url` with one worker session of kTenant attached (kLayout, 512 blocks); `session`
// is null when a step failed (the failure is reported).
struct Worker {
  std::unique_ptr<ServerProcess> server;
  std::unique_ptr<kvsidecar::Client> client;
  std::unique_ptr<kvsidecar::Session> session;
};

Worker StartWorker(const std::string& url, std::vector<std::string> extra = {}) {
  Worker worker;
  worker.server = StartSidecar(url, std::move(extra));
  if (worker.server == nullptr) return worker;
  auto client = worker.server->Connect();
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return worker;
  worker.client = std::move(*client);
  worker.session = Attach(*worker.client, kLayout, 512);
  return worker;
}

// Two sidecars sharing one Redis: a sequence spilled by one is adopted by a session of the same
// tenant on the other, bit-identical, with its positions and KeyDiff state (it keeps compressing
// the same way on both).
void MigrateBetweenSidecars(const std::string& url) {
  Worker a = StartWorker(url);
  Worker b = StartWorker(url);
  ASSERT_TRUE(a.session && b.session);
  kvsidecar::Session* session_a = a.session.get();
  kvsidecar::Session* session_b = b.session.get();
  for (int i = 0; i < 4; ++i) {
    const std::string seq = absl::StrCat("m", i);  // several slots across the cluster
    MakeSequence(*session_a, seq, 300, 200, 40 + i);
    const Snapshot before = Take(*session_a, seq, 40 + i);
    auto spilled = Spill(*session_a, seq);
    ASSERT_TRUE(spilled.ok()) << spilled.status() << a.server->Logs();
    auto adopted = Restore(*session_b, seq, session_a->session_id());
    ASSERT_TRUE(adopted.ok()) << adopted.status() << b.server->Logs();
    EXPECT_EQ(adopted->tier(), v1::TIER_REMOTE);
    ExpectSame(before, Take(*session_b, seq, 40 + i));
    // The policy state moved too: the same further tokens compress the same way on both.
    auto more = WriteTokens(*session_b, seq, 60, 40 + i, /*compress_if_over_budget=*/true);
    ASSERT_TRUE(more.ok()) << more.status();
    // A claimed and restored copy is not served again.
    auto again = Restore(*session_a, seq);
    EXPECT_EQ(again.status().code(), absl::StatusCode::kNotFound) << again.status();
  }
}

TEST(RemoteTierE2eTest, TwoSidecarsMigrateBitIdenticalSingleNode) {
  SKIP_WITHOUT_REDIS();
  auto redis = RedisNode::Start({});
  ASSERT_TRUE(redis.ok()) << redis.status();
  MigrateBetweenSidecars("redis://" + (*redis)->address());
}

TEST(RemoteTierE2eTest, TwoSidecarsMigrateBitIdenticalCluster) {
  SKIP_WITHOUT_REDIS();
  auto cluster = RedisCluster::Start();
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  // One seed is enough: the client learns the slot map and follows MOVED.
  MigrateBetweenSidecars("redis://" + (*cluster)->node(1).address());
}

TEST(RemoteTierE2eTest, ClaimIsExclusiveAndRacingRestoresHaveOneWinner) {
  SKIP_WITHOUT_REDIS();
  auto redis = RedisNode::Start({});
  ASSERT_TRUE(redis.ok()) << redis.status();
  const std::string url = "redis://" + (*redis)->address();
  auto a = StartSidecar(url);
  auto b = StartSidecar(url);
  auto c = StartSidecar(url);
  ASSERT_TRUE(a && b && c);
  auto client_a = a->Connect();
  auto client_b = b->Connect();
  auto client_c = c->Connect();
  ASSERT_TRUE(client_a.ok() && client_b.ok() && client_c.ok());
  auto session_a = Attach(**client_a, kLayout, 512);
  auto session_b = Attach(**client_b, kLayout, 512);
  auto session_c = Attach(**client_c, kLayout, 512);
  ASSERT_TRUE(session_a && session_b && session_c);

  // A claim held by another sidecar: ABORTED naming it; the copy stays and is served once the
  // claim ends.
  MakeSequence(*session_a, "held", 200, 150, 5);
  const Snapshot held = Take(*session_a, "held", 5);
  ASSERT_TRUE(Spill(*session_a, "held").ok());
  const std::string claim = KeyPrefix(kTenant, "held") + ":claim";
  ASSERT_TRUE((*redis)->Cli(absl::StrCat("SET '", claim, "' other-sidecar PX 60000")).ok());
  auto refused = Restore(*session_b, "held", session_a->session_id());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kAborted) << refused.status();
  EXPECT_THAT(MessageOf(refused.status()), HasSubstr("claimed by sidecar other-sidecar"));
  ASSERT_TRUE((*redis)->Cli(absl::StrCat("DEL '", claim, "'")).ok());
  auto adopted = Restore(*session_b, "held", session_a->session_id());
  ASSERT_TRUE(adopted.ok()) << adopted.status();
  ExpectSame(held, Take(*session_b, "held", 5));

  // Two sidecars racing for each of several copies: never both.
  for (int round = 0; round < 6; ++round) {
    const std::string seq = absl::StrCat("race", round);
    MakeSequence(*session_a, seq, 400, 400, 60 + round);
    ASSERT_TRUE(Spill(*session_a, seq).ok());
    std::atomic<int> go{0};
    absl::Status result_b, result_c;
    std::thread tb([&] {
      while (go.load() == 0) {
      }
      result_b = Restore(*session_b, seq, session_a->session_id()).status();
    });
    std::thread tc([&] {
      while (go.load() == 0) {
      }
      result_c = Restore(*session_c, seq, session_a->session_id()).status();
    });
    go = 1;
    tb.join();
    tc.join();
    SCOPED_TRACE(absl::StrCat(seq, ": b ", result_b.ToString(), "; c ", result_c.ToString()));
    EXPECT_EQ(result_b.ok() + result_c.ok(), 1);
    for (const absl::Status& s : {result_b, result_c}) {
      if (s.ok()) continue;
      // Lost the race: the claim (while the winner reads) or the copy already gone.
      EXPECT_TRUE(s.code() == absl::StatusCode::kAborted ||
                  s.code() == absl::StatusCode::kNotFound)
          << s;
      if (s.code() == absl::StatusCode::kAborted) {
        EXPECT_THAT(MessageOf(s), HasSubstr("restore claim"));
      }
    }
    kvsidecar::Session& winner = result_b.ok() ? *session_b : *session_c;
    auto verified = VerifySequence(winner, seq, 60 + round);
    EXPECT_TRUE(verified.ok()) << verified.status();
  }
}

TEST(RemoteTierE2eTest, TenantsNeverReachEachOthersCopies) {
  SKIP_WITHOUT_REDIS();
  auto redis = RedisNode::Start({});
  ASSERT_TRUE(redis.ok()) << redis.status();
  auto server = StartSidecar("redis://" + (*redis)->address());
  ASSERT_NE(server, nullptr);
  auto client = server->Connect();
  ASSERT_TRUE(client.ok());
  auto admin = server->ConnectAdmin();
  ASSERT_TRUE(admin.ok());
  auto mine = Attach(**client, kLayout, 256, "alpha");
  auto theirs = Attach(**client, kLayout, 256, "beta");
  ASSERT_TRUE(mine && theirs);
  MakeSequence(*mine, "secret", 100, 100, 9);
  ASSERT_TRUE(Spill(*mine, "secret").ok());
  ASSERT_TRUE(mine->Detach().ok());
  auto stolen = Restore(*theirs, "secret", "anything");
  EXPECT_EQ(stolen.status().code(), absl::StatusCode::kNotFound) << stolen.status();
  auto listed = (*admin)->ListSpilled("beta");
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->copies_size(), 0);
  // The copy is intact for its own tenant.
  auto again = Attach(**client, kLayout, 256, "alpha");
  ASSERT_NE(again, nullptr);
  auto adopted = Restore(*again, "secret", "anything");
  ASSERT_TRUE(adopted.ok()) << adopted.status();
  EXPECT_TRUE(VerifySequence(*again, "secret", 9).ok());
}

TEST(RemoteTierE2eTest, RemoteBytesQuota) {
  SKIP_WITHOUT_REDIS();
  auto redis = RedisNode::Start({});
  ASSERT_TRUE(redis.ok()) << redis.status();
  auto server = StartSidecar("redis://" + (*redis)->address());
  ASSERT_NE(server, nullptr);
  auto client = server->Connect();
  auto admin = server->ConnectAdmin();
  ASSERT_TRUE(client.ok() && admin.ok());
  auto session = Attach(**client, kLayout, 256);
  ASSERT_NE(session, nullptr);
  MakeSequence(*session, "q1", 100, 100, 1);
  MakeSequence(*session, "q2", 100, 100, 2);
  auto first = Spill(*session, "q1");
  ASSERT_TRUE(first.ok()) << first.status();
  v1::SetQuotaRequest quota;
  quota.set_tenant(kTenant);
  quota.mutable_quota()->set_remote_bytes(first->bytes() + first->bytes() / 2);
  auto set = (*admin)->SetQuota(quota);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->usage().remote_bytes(), first->bytes());
  auto over = Spill(*session, "q2");
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted) << over.status();
  EXPECT_THAT(MessageOf(over.status()), HasSubstr("remote_bytes"));
  EXPECT_TRUE(VerifySequence(*session, "q2", 2).ok());  // still in the arena
  auto quotas = (*admin)->GetQuotas(kTenant);
  ASSERT_TRUE(quotas.ok());
  ASSERT_EQ(quotas->tenants_size(), 1);
  EXPECT_EQ(quotas->tenants(0).usage().remote_bytes(), first->bytes());
  // Restoring q1 frees the room.
  ASSERT_TRUE(Restore(*session, "q1").ok());
  EXPECT_TRUE(Spill(*session, "q2").ok());
}

TEST(RemoteTierE2eTest, DamagedChunkIsDataLossNeverServed) {
  SKIP_WITHOUT_REDIS();
  auto redis = RedisNode::Start({});
  ASSERT_TRUE(redis.ok()) << redis.status();
  auto server = StartSidecar("redis://" + (*redis)->address(), {"--remote_tier_chunk_bytes=64Ki"});
  ASSERT_NE(server, nullptr);
  auto client = server->Connect();
  ASSERT_TRUE(client.ok());
  auto session = Attach(**client, kLayout, 512);
  ASSERT_NE(session, nullptr);
  MakeSequence(*session, "d", 300, 300, 77);
  ASSERT_TRUE(Spill(*session, "d").ok());
  auto chunks = (*redis)->Cli("--scan --pattern 'kvs:*:c:*'");
  ASSERT_TRUE(chunks.ok());
  std::vector<std::string> keys = absl::StrSplit(*chunks, '\n', absl::SkipWhitespace());
  ASSERT_GE(keys.size(), 2u) << *chunks;
  // One byte of one chunk flipped in place (same length).
  ASSERT_TRUE((*redis)->Cli(absl::StrCat("SETRANGE '", keys[keys.size() / 2], "' 1000 Z")).ok());
  for (int attempt = 0; attempt < 2; ++attempt) {
    auto restored = Restore(*session, "d");
    EXPECT_EQ(restored.status().code(), absl::StatusCode::kDataLoss) << restored.status();
    EXPECT_THAT(MessageOf(restored.status()), HasSubstr("fails its checksum"));
    // Nor through an automatic restore.
    auto layout = session->GetLayout("d");
    EXPECT_EQ(layout.status().code(), absl::StatusCode::kDataLoss) << layout.status();
  }
  // A missing chunk too.
  ASSERT_TRUE((*redis)->Cli(absl::StrCat("DEL '", keys[0], "'")).ok());
  auto missing = Restore(*session, "d");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kDataLoss) << missing.status();
}

TEST(RemoteTierE2eTest, WrongPasswordIsUnauthenticatedAndNeverLogged) {
  SKIP_WITHOUT_REDIS();
  RedisNode::Options options;
  options.requirepass = "admin-pass-1";
  auto redis = RedisNode::Start(options);
  ASSERT_TRUE(redis.ok()) << redis.status();
  ASSERT_TRUE((*redis)->Cli("ACL SETUSER kvs on '>tier-secret-42' '~kvs:*' '+@all'").ok());
  const std::string dir = MakeTempDir("kvs-redis-pw-");
  const std::string wrong = dir + "/wrong", right = dir + "/right";
  std::ofstream(wrong) << "not-the-password-17\n";
  std::ofstream(right) << "tier-secret-42\n";
  std::filesystem::permissions(wrong, std::filesystem::perms::owner_read);
  std::filesystem::permissions(right, std::filesystem::perms::owner_read);
  const std::string url = "redis://" + (*redis)->address();

  auto bad = StartSidecar(url, {"--remote_tier_user=kvs", "--remote_tier_password_file=" + wrong});
  ASSERT_NE(bad, nullptr);
  auto client = bad->Connect();
  ASSERT_TRUE(client.ok());
  auto session = Attach(**client, kLayout, 256);
  ASSERT_NE(session, nullptr);
  MakeSequence(*session, "p", 100, 100, 4);
  auto refused = Spill(*session, "p");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnauthenticated) << refused.status();
  EXPECT_THAT(MessageOf(refused.status()), HasSubstr("--remote_tier_password_file"));
  EXPECT_TRUE(VerifySequence(*session, "p", 4).ok());  // still in the arena
  auto admin = bad->ConnectAdmin();
  ASSERT_TRUE(admin.ok());
  auto config = (*admin)->GetConfig();
  ASSERT_TRUE(config.ok());
  EXPECT_THAT(config->effective_config_yaml(), HasSubstr(wrong));
  EXPECT_THAT(config->effective_config_yaml(), ::testing::Not(HasSubstr("not-the-password-17")));
  EXPECT_THAT(bad->Logs(), ::testing::Not(HasSubstr("not-the-password-17")));

  // No password at all: NOAUTH, named.
  auto none = StartSidecar(url);
  ASSERT_NE(none, nullptr);
  auto client_none = none->Connect();
  ASSERT_TRUE(client_none.ok());
  auto session_none = Attach(**client_none, kLayout, 256);
  ASSERT_NE(session_none, nullptr);
  MakeSequence(*session_none, "p", 100, 100, 4);
  auto noauth = Spill(*session_none, "p");
  EXPECT_EQ(noauth.status().code(), absl::StatusCode::kUnauthenticated) << noauth.status();

  auto good = StartSidecar(url, {"--remote_tier_user=kvs", "--remote_tier_password_file=" + right});
  ASSERT_NE(good, nullptr);
  auto client_good = good->Connect();
  ASSERT_TRUE(client_good.ok());
  auto session_good = Attach(**client_good, kLayout, 256);
  ASSERT_NE(session_good, nullptr);
  MakeSequence(*session_good, "p", 100, 100, 4);
  auto spilled = Spill(*session_good, "p");
  EXPECT_TRUE(spilled.ok()) << spilled.status();
  EXPECT_TRUE(VerifySequence(*session_good, "p", 4).ok());
  EXPECT_THAT(good->Logs(), ::testing::Not(HasSubstr("tier-secret-42")));
  std::filesystem::remove_all(dir);
}

TEST(RemoteTierE2eTest, FullRedisIsResourceExhausted) {
  SKIP_WITHOUT_REDIS();
  RedisNode::Options options;
  options.maxmemory = "3mb";
  auto redis = RedisNode::Start(options);
  ASSERT_TRUE(redis.ok()) << redis.status();
  auto server = StartSidecar("redis://" + (*redis)->address(), {"--remote_tier_chunk_bytes=256Ki"});
  ASSERT_NE(server, nullptr);
  auto client = server->Connect();
  ASSERT_TRUE(client.ok());
  const v1::ModelLayout big = MakeLayout(4, 4, 4, 128, v1::DTYPE_FLOAT32);  // 16 KiB per token
  auto session = Attach(**client, big, 1024);
  ASSERT_NE(session, nullptr);
  MakeSequence(*session, "big", 600, 600, 8);  // ~9.4 MiB
  auto spilled = Spill(*session, "big");
  EXPECT_EQ(spilled.status().code(), absl::StatusCode::kResourceExhausted) << spilled.status();
  EXPECT_THAT(MessageOf(spilled.status()), HasSubstr("out of memory"));
  EXPECT_TRUE(VerifySequence(*session, "big", 8).ok());  // intact in the arena
  // Nothing of it stays listed, and the chunks written before the refusal were removed.
  auto admin = server->ConnectAdmin();
  ASSERT_TRUE(admin.ok());
  auto listed = (*admin)->ListSpilled();
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->copies_size(), 0);
}

TEST(RemoteTierE2eTest, NodeKilledMidSpillIsUnavailableAndTheArenaCopySurvives) {
  SKIP_WITHOUT_REDIS();
  auto redis = RedisNode::Start({});
  ASSERT_TRUE(redis.ok()) << redis.status();
  auto server = StartSidecar("redis://" + (*redis)->address(), {"--remote_tier_chunk_bytes=64Ki"});
  ASSERT_NE(server, nullptr);
  auto client = server->Connect();
  ASSERT_TRUE(client.ok());
  const v1::ModelLayout big = MakeLayout(4, 4, 4, 128, v1::DTYPE_FLOAT32);
  auto session = Attach(**client, big, 2048);
  ASSERT_NE(session, nullptr);
  MakeSequence(*session, "k", 1500, 1500, 31);  // ~23 MiB
  const Snapshot before = Take(*session, "k", 31);
  absl::Status result;
  std::thread spill([&] { result = Spill(*session, "k").status(); });
  // Kill Redis once the spill has written some chunks (or right away if it is that fast).
  PollUntil(
      [&] {
        auto count = (*redis)->Cli("DBSIZE");
        int64_t n = 0;
        return count.ok() && absl::SimpleAtoi(absl::StripAsciiWhitespace(*count), &n) && n > 3;
      },
      absl::Seconds(10), absl::Milliseconds(1));
  (*redis)->Kill();
  spill.join();
  if (result.ok()) {
    GTEST_SKIP() << "the spill finished before Redis was killed";
  }
  EXPECT_EQ(result.code(), absl::StatusCode::kUnavailable) << result;
  ExpectSame(before, Take(*session, "k", 31));  // intact, usable
  ASSERT_TRUE((*redis)->Restart().ok());
  auto again = Spill(*session, "k");
  ASSERT_TRUE(again.ok()) << again.status() << server->Logs();
  ExpectSame(before, Take(*session, "k", 31));
}

// A worker adopting a remote copy while Redis is down is told the tier is unavailable (retry),
// never that the copy does not exist; the same session's own restore likewise.
TEST(RemoteTierE2eTest, RedisDownIsUnavailableNeverNotFound) {
  SKIP_WITHOUT_REDIS();
  auto redis = RedisNode::Start({});
  ASSERT_TRUE(redis.ok()) << redis.status();
  const std::string url = "redis://" + (*redis)->address();
  Worker a = StartWorker(url);
  Worker b = StartWorker(url);
  ASSERT_TRUE(a.session && b.session);
  kvsidecar::Session* session_a = a.session.get();
  kvsidecar::Session* session_b = b.session.get();
  MakeSequence(*session_a, "d", 200, 200, 17);
  ASSERT_TRUE(Spill(*session_a, "d").ok()) << a.server->Logs();
  (*redis)->Kill();
  auto adopted = Restore(*session_b, "d", session_a->session_id());
  EXPECT_EQ(adopted.status().code(), absl::StatusCode::kUnavailable) << adopted.status();
  auto own = Restore(*session_a, "d");
  EXPECT_EQ(own.status().code(), absl::StatusCode::kUnavailable) << own.status();
}

// SIGTERM with --drain_to=remote and a worker attached: the sidecar moves its live sequences to
// Redis and exits 0; a worker on another sidecar sharing that Redis adopts each copy bit-identical.
TEST(RemoteTierE2eTest, SigtermDrainsToRedisAndAnotherSidecarAdopts) {
  SKIP_WITHOUT_REDIS();
  auto redis = RedisNode::Start({});
  ASSERT_TRUE(redis.ok()) << redis.status();
  const std::string url = "redis://" + (*redis)->address();
  std::vector<Snapshot> before;
  std::string old_session;
  {
    Worker a = StartWorker(url, {"--drain_to=remote", "--drain_grace=20s"});
    ASSERT_NE(a.session, nullptr);
    kvsidecar::Session* session_a = a.session.get();
    old_session = session_a->session_id();
    for (int i = 0; i < 3; ++i) {
      const std::string seq = absl::StrCat("t", i);
      MakeSequence(*session_a, seq, 250, 200, 70 + i);
      before.push_back(Take(*session_a, seq, 70 + i));
    }
    const int status = a.server->process().Stop(SIGTERM, absl::Seconds(20));
    EXPECT_EQ(status, 0) << a.server->Logs();
    EXPECT_THAT(a.server->Logs(), ::testing::HasSubstr("moved=3")) << a.server->Logs();
  }
  Worker b = StartWorker(url);
  ASSERT_NE(b.session, nullptr);
  kvsidecar::Session* session_b = b.session.get();
  for (int i = 0; i < 3; ++i) {
    const std::string seq = absl::StrCat("t", i);
    auto adopted = Restore(*session_b, seq, old_session);
    ASSERT_TRUE(adopted.ok()) << adopted.status() << b.server->Logs();
    EXPECT_EQ(adopted->tier(), v1::TIER_REMOTE);
    ExpectSame(before[i], Take(*session_b, seq, 70 + i));
  }
}

TEST(RemoteTierE2eTest, ClusterNodeDownIsUnavailableThenRecovers) {
  SKIP_WITHOUT_REDIS();
  auto cluster = RedisCluster::Start();
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto server = StartSidecar((*cluster)->url());
  ASSERT_NE(server, nullptr);
  auto client = server->Connect();
  ASSERT_TRUE(client.ok());
  auto session = Attach(**client, kLayout, 512);
  ASSERT_NE(session, nullptr);
  MakeSequence(*session, "c", 200, 200, 12);
  const Snapshot before = Take(*session, "c", 12);
  auto owner = (*cluster)->NodeFor(KeyPrefix(kTenant, "c") + ":m");
  ASSERT_TRUE(owner.ok()) << owner.status();
  (*owner)->Kill();
  auto down = Spill(*session, "c");
  EXPECT_EQ(down.status().code(), absl::StatusCode::kUnavailable) << down.status();
  ExpectSame(before, Take(*session, "c", 12));
  // The node comes back with its cluster identity (nodes.conf), its slots, and no data.
  ASSERT_TRUE((*owner)->Restart().ok());
  // A spill succeeds again once the cluster is whole.
  bool spilled = PollUntil([&] { return Spill(*session, "c").ok(); }, absl::Seconds(30),
                           absl::Milliseconds(500));
  EXPECT_TRUE(spilled) << server->Logs();
  ExpectSame(before, Take(*session, "c", 12));
}

}  // namespace
}  // namespace kvs_e2e
