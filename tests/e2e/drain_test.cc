// End to end, through the real binary and its real RocksDB files: a sidecar drains its live
// sequences to the disk tier on SIGTERM (--drain_to=disk) within --drain_grace and exits, with a
// worker attached; a restarted sidecar on the same data directory lists the copies and a new
// session of the tenant adopts them (Restore with adopt_any_session) bit for bit, positions
// included. Admin.Drain with a target tier moves the sequences, reports per sequence what moved
// and what did not and why (a tenant's disk quota), refuses a host target without changing
// anything, and a grace period too short reports the sequences it left where they were.
#include <csignal>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvsidecar/client.h"
#include "tests/e2e/e2e_util.h"

namespace kvs_e2e {
namespace {

using ::testing::HasSubstr;

constexpr char kTenant[] = "drain";

struct ScopedDir {
  ScopedDir() : path(MakeTempDir("kvs-e2e-drain-")) {}
  ~ScopedDir() {
    if (!path.empty()) std::filesystem::remove_all(path);
  }
  const std::string path;
};

absl::Status Spill(kvsidecar::Session& session, const std::string& seq, v1::Tier tier) {
  v1::SpillRequest request;
  request.set_sequence_id(seq);
  request.set_target(tier);
  return session.Spill(request).status();
}

// Counts and per-(layer, head) positions, the state that must come back unchanged.
std::string LayoutOf(kvsidecar::Session& session, const std::string& seq) {
  auto layout = session.GetLayout(seq);
  if (!layout.ok()) return layout.status().ToString();
  std::string out;
  for (const v1::LayerLayout& layer : layout->layers()) {
    out += "layer " + std::to_string(layer.layer()) + " count " + std::to_string(layer.count()) +
           ":";
    for (int32_t position : layer.positions()) out += " " + std::to_string(position);
    out += "\n";
  }
  out += "next " + std::to_string(layout->next_position());
  return out;
}

const v1::DrainedSequence* FindDrained(const v1::DrainResponse& response, const std::string& seq) {
  for (const v1::DrainedSequence& drained : response.sequences()) {
    if (drained.sequence_id() == seq) return &drained;
  }
  return nullptr;
}

struct Written {
  std::string id;
  uint64_t seed;
  std::string layout;  // LayoutOf before the drain
};

// SIGTERM with a worker attached and sequences live in the arena and in host memory: the process
// exits 0 within the grace, every sequence is in the disk tier, and a restarted sidecar serves
// them back bit-identical to a new session of the tenant that knows only the sequence ids.
TEST(DrainE2eTest, SigtermMovesLiveSequencesToDiskAndARestartedSidecarAdoptsThem) {
  const ScopedDir scoped;
  ASSERT_FALSE(scoped.path.empty());
  ServerProcess::Options options;
  options.extra_args = {"--data_dir=" + scoped.path + "/data", "--drain_to=disk",
                        "--drain_grace=20s"};
  const v1::ModelLayout layout = MakeLayout(2, 2, 4, 32, v1::DTYPE_FLOAT16);
  std::vector<Written> written;
  std::string old_session;
  {
    auto server = ServerProcess::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    auto client = (*server)->Connect();
    ASSERT_TRUE(client.ok());
    auto session = (*client)->Attach(layout, kTenant, 256, 30000);
    ASSERT_TRUE(session.ok()) << session.status();
    old_session = (*session)->session_id();
    ASSERT_TRUE(PollUntil([&] { return (*session)->watching(); }, absl::Seconds(10)));
    for (int i = 0; i < 4; ++i) {
      const std::string id = "live-" + std::to_string(i);
      // Budget 32 for 50 tokens: KeyDiff evicts, so the kept positions are not 0..n-1.
      ASSERT_TRUE((*session)->CreateSequence(KeyDiffPolicy(), MakeBudget(32), id).ok());
      ASSERT_TRUE(WriteTokens(**session, id, 50, 900 + i, /*compress_if_over_budget=*/true).ok());
      written.push_back({id, static_cast<uint64_t>(900 + i), LayoutOf(**session, id)});
    }
    // One in host memory (lost with the process unless the drain moves it).
    ASSERT_TRUE(Spill(**session, "live-3", v1::TIER_HOST).ok());
    const absl::Time sent = absl::Now();
    const int status = (*server)->process().Stop(SIGTERM, absl::Seconds(20));
    EXPECT_EQ(status, 0) << (*server)->Logs();
    EXPECT_LT(absl::Now() - sent, absl::Seconds(20));
    const std::string logs = (*server)->Logs();
    EXPECT_THAT(logs, HasSubstr("drained_on_exit")) << logs;
    EXPECT_THAT(logs, HasSubstr("moved=4")) << logs;
    EXPECT_THAT(logs, HasSubstr("not_moved=0")) << logs;
  }

  auto server = ServerProcess::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto admin = (*server)->ConnectAdmin();
  ASSERT_TRUE(admin.ok());
  auto listed = (*admin)->ListSpilled(kTenant);
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->copies_size(), 4) << listed->DebugString() << (*server)->Logs();
  for (const v1::SpilledCopy& copy : listed->copies()) {
    EXPECT_EQ(copy.tier(), v1::TIER_DISK) << copy.DebugString();
    EXPECT_EQ(copy.session_id(), old_session);
    EXPECT_TRUE(copy.lost().empty()) << copy.lost();
  }
  auto client = (*server)->Connect();
  ASSERT_TRUE(client.ok());
  auto session = (*client)->Attach(layout, kTenant, 256, 30000);
  ASSERT_TRUE(session.ok()) << session.status();
  for (const Written& w : written) {
    SCOPED_TRACE(w.id);
    v1::RestoreRequest request;
    request.set_sequence_id(w.id);
    request.set_adopt_any_session(true);
    auto restored = (*session)->Restore(request);
    ASSERT_TRUE(restored.ok()) << restored.status();
    EXPECT_EQ(restored->tier(), v1::TIER_DISK);
    EXPECT_EQ(restored->adopted_from_session_id(), old_session);
    EXPECT_EQ(LayoutOf(**session, w.id), w.layout);
    auto verified = VerifySequence(**session, w.id, w.seed);
    ASSERT_TRUE(verified.ok()) << verified.status();
    EXPECT_GT(verified->rows, 0);
  }
  // Adopted copies are gone: a second adoption finds nothing.
  v1::RestoreRequest again;
  again.set_sequence_id("live-0");
  again.set_adopt_any_session(true);
  auto session2 = (*client)->Attach(layout, kTenant, 64, 30000);
  ASSERT_TRUE(session2.ok());
  EXPECT_EQ((*session2)->Restore(again).status().code(), absl::StatusCode::kNotFound);
  // Another tenant never adopts them.
  auto intruder = (*client)->Attach(layout, "other", 64, 30000);
  ASSERT_TRUE(intruder.ok());
  EXPECT_EQ((*intruder)->Restore(again).status().code(), absl::StatusCode::kNotFound);
}

class AdminDrainE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerProcess::Options options;
    options.extra_args = {"--data_dir=" + scoped_.path + "/data"};
    auto server = ServerProcess::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    auto client = server_->Connect();
    ASSERT_TRUE(client.ok());
    client_ = *std::move(client);
    auto admin = server_->ConnectAdmin();
    ASSERT_TRUE(admin.ok());
    admin_ = *std::move(admin);
  }

  const ScopedDir scoped_;
  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<kvsidecar::Client> client_;
  std::unique_ptr<kvsidecar::AdminClient> admin_;
  const v1::ModelLayout layout_ = MakeLayout(2, 2, 4, 32, v1::DTYPE_FLOAT16);
};

TEST_F(AdminDrainE2eTest, DrainToDiskReportsWhatMovedAndWhatTheQuotaKept) {
  // Tenant "small" may keep 1 byte on disk: its sequence cannot move.
  v1::SetQuotaRequest quota;
  quota.set_tenant("small");
  quota.mutable_quota()->set_disk_bytes(1);
  ASSERT_TRUE(admin_->SetQuota(quota).ok());
  auto session = client_->Attach(layout_, kTenant, 128, 30000);
  ASSERT_TRUE(session.ok()) << session.status();
  for (int i = 0; i < 3; ++i) {
    const std::string id = "s" + std::to_string(i);
    ASSERT_TRUE((*session)->CreateSequence(KeyDiffPolicy(), MakeBudget(64), id).ok());
    ASSERT_TRUE(WriteTokens(**session, id, 20, 40 + i).ok());
  }
  ASSERT_TRUE(Spill(**session, "s2", v1::TIER_DISK).ok());  // already there
  auto small = client_->Attach(layout_, "small", 64, 30000);
  ASSERT_TRUE(small.ok()) << small.status();
  ASSERT_TRUE((*small)->CreateSequence(KeyDiffPolicy(), MakeBudget(64), "q0").ok());
  ASSERT_TRUE(WriteTokens(**small, "q0", 20, 77).ok());

  // A host target is refused and changes nothing (not even the draining state).
  v1::DrainRequest host;
  host.set_to(v1::TIER_HOST);
  auto refused = admin_->Drain(host);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(MessageOf(refused.status()), HasSubstr("to must be TIER_DISK"));
  v1::DrainRequest negative;
  negative.set_to(v1::TIER_DISK);
  negative.set_grace_ms(-1);
  EXPECT_THAT(MessageOf(admin_->Drain(negative).status()), HasSubstr("grace_ms"));
  auto stats = admin_->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_FALSE(stats->draining());

  v1::DrainRequest request;
  request.set_to(v1::TIER_DISK);
  request.set_grace_ms(20000);
  auto drained = admin_->Drain(request);
  ASSERT_TRUE(drained.ok()) << drained.status();
  EXPECT_EQ(drained->sequences_size(), 4) << drained->DebugString();
  EXPECT_EQ(drained->sequences_moved(), 3) << drained->DebugString();
  EXPECT_EQ(drained->sequences_not_moved(), 1) << drained->DebugString();
  EXPECT_FALSE(drained->grace_expired());
  for (const std::string id : {"s0", "s1", "s2"}) {
    const v1::DrainedSequence* s = FindDrained(*drained, id);
    ASSERT_NE(s, nullptr) << id;
    EXPECT_TRUE(s->moved()) << s->DebugString();
    EXPECT_EQ(s->tier(), v1::TIER_DISK);
    EXPECT_EQ(s->tenant(), kTenant);
    EXPECT_EQ(s->session_id(), (*session)->session_id());
  }
  const v1::DrainedSequence* q0 = FindDrained(*drained, "q0");
  ASSERT_NE(q0, nullptr);
  EXPECT_FALSE(q0->moved());
  EXPECT_EQ(q0->tier(), v1::TIER_ARENA);
  EXPECT_THAT(q0->reason(), HasSubstr("quota")) << q0->reason();
  EXPECT_THAT(server_->Logs(), HasSubstr("moved=3"));
  EXPECT_THAT(server_->Logs(), HasSubstr("sequence=q0"));

  // Now in the disk tier, listed there, and served back on use.
  auto sequences = admin_->ListSequences((*session)->session_id());
  ASSERT_TRUE(sequences.ok());
  for (const v1::SequenceInfo& info : sequences->sequences()) {
    EXPECT_EQ(info.tier(), v1::TIER_DISK) << info.sequence_id();
  }
  for (int i = 0; i < 3; ++i) {
    auto verified = VerifySequence(**session, "s" + std::to_string(i), 40 + i);
    ASSERT_TRUE(verified.ok()) << verified.status();
  }
  auto q0_verified = VerifySequence(**small, "q0", 77);
  EXPECT_TRUE(q0_verified.ok()) << q0_verified.status();
}

TEST_F(AdminDrainE2eTest, AGraceTooShortReportsTheSequencesItDidNotMove) {
  auto session = client_->Attach(MakeLayout(4, 4, 8, 64, v1::DTYPE_FLOAT32), kTenant, 2048, 30000);
  ASSERT_TRUE(session.ok()) << session.status();
  constexpr int kSequences = 40;
  for (int i = 0; i < kSequences; ++i) {
    const std::string id = "g" + std::to_string(i);
    ASSERT_TRUE((*session)->CreateSequence(KeyDiffPolicy(), MakeBudget(256), id).ok());
    ASSERT_TRUE(WriteTokens(**session, id, 48, 300 + i).ok());
  }
  v1::DrainRequest request;
  request.set_to(v1::TIER_DISK);
  request.set_grace_ms(1);
  auto drained = admin_->Drain(request);
  ASSERT_TRUE(drained.ok()) << drained.status();
  EXPECT_EQ(drained->sequences_size(), kSequences);
  EXPECT_TRUE(drained->grace_expired());
  EXPECT_GE(drained->sequences_not_moved(), 1) << drained->DebugString();
  EXPECT_EQ(drained->sequences_moved() + drained->sequences_not_moved(), kSequences);
  for (const v1::DrainedSequence& s : drained->sequences()) {
    if (s.moved()) continue;
    EXPECT_EQ(s.tier(), v1::TIER_ARENA);
    EXPECT_THAT(s.reason(), HasSubstr("grace period ended")) << s.DebugString();
  }
  // Nothing was lost: every sequence is served, moved or not.
  for (int i = 0; i < kSequences; ++i) {
    auto verified = VerifySequence(**session, "g" + std::to_string(i), 300 + i);
    ASSERT_TRUE(verified.ok()) << i << ": " << verified.status();
  }
}

}  // namespace
}  // namespace kvs_e2e
