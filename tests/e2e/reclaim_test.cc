// End to end: the memory of a worker that goes away is reclaimed by the real server: a worker
// process that is SIGKILLed (its Watch stream breaks), a session whose lease lapses without Watch
// or heartbeat, an explicit Detach and a Session destroyed without Detach. The arenas are memfds
// (the default): reclaimed means the sidecar holds no descriptor of them any more (checked through
// /proc/<sidecar>/fd where this test may read it, i.e. as root, the sidecar being non-dumpable).
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvsidecar/client.h"
#include "tests/e2e/e2e_util.h"

namespace kvs_e2e {
namespace {

bool FileExists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

// The sidecar no longer holds the arena: its memfd count is back to `before` (unknown = -1: not
// checked), or, for a named arena, its file is gone.
bool ArenaReleased(ServerProcess& server, int before, const std::string& shm_path) {
  if (!shm_path.empty()) return !FileExists(shm_path);
  if (before < 0) return true;
  return CountArenaMemfds(server.process().pid()) == before;
}

bool SessionListed(kvsidecar::AdminClient& admin, const std::string& session_id) {
  auto sessions = admin.ListSessions();
  if (!sessions.ok()) return true;  // unknown: keep polling
  for (const auto& info : sessions->sessions()) {
    if (info.session_id() == session_id) return true;
  }
  return false;
}

std::string FieldOf(const std::string& text, const std::string& key) {
  const size_t at = text.find(key + "=");
  if (at == std::string::npos) return "";
  const size_t start = at + key.size() + 1;
  return text.substr(start, text.find_first_of(" \n", start) - start);
}

class ReclaimTest : public SharedServerTest<ReclaimTest> {
 protected:
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    auto admin = server_->ConnectAdmin();
    ASSERT_TRUE(admin.ok()) << admin.status();
    admin_ = std::move(*admin);
  }

  std::unique_ptr<kvsidecar::AdminClient> admin_;
};

TEST_F(ReclaimTest, KilledWorkerProcessIsReclaimedWithinSeconds) {
  auto before = admin_->GetStats();
  ASSERT_TRUE(before.ok()) << before.status();
  const int memfds = CountArenaMemfds(server_->process().pid());
  // A two-minute lease: only the broken Watch stream can explain a reclaim within seconds.
  auto worker = ChildProcess::Spawn(
      {BuildDir() + "/tests/e2e/kvs_e2e_worker", server_->data_target(), "120000"}, server_->dir(),
      "worker");
  ASSERT_TRUE(worker.ok()) << worker.status();
  std::string ready;
  ASSERT_TRUE(PollUntil(
      [&] {
        const std::string out = (*worker)->Stdout();
        if (out.find('\n') != std::string::npos) ready = out;
        return !ready.empty() || !(*worker)->Running();
      },
      kStartTimeout));
  ASSERT_THAT(ready, ::testing::HasSubstr("READY")) << (*worker)->Stderr();
  const std::string session_id = FieldOf(ready, "session");
  const std::string shm_path = FieldOf(ready, "shm");
  ASSERT_FALSE(session_id.empty());
  ASSERT_TRUE(shm_path.empty()) << "a named arena in the default mode: " << shm_path;
  if (memfds >= 0) {
    EXPECT_EQ(CountArenaMemfds(server_->process().pid()), memfds + 1);
  }

  ASSERT_TRUE(SessionListed(*admin_, session_id));
  auto sequences = admin_->ListSequences(session_id);
  ASSERT_TRUE(sequences.ok()) << sequences.status();
  ASSERT_EQ(sequences->sequences_size(), 1);
  auto during = admin_->GetStats();
  ASSERT_TRUE(during.ok());
  EXPECT_EQ(during->sessions(), before->sessions() + 1);
  EXPECT_GT(during->arena_bytes_used(), before->arena_bytes_used());

  ASSERT_EQ((*worker)->Stop(SIGKILL, absl::Seconds(30)) & 0x7f, SIGKILL);
  const absl::Time killed = absl::Now();
  EXPECT_TRUE(PollUntil([&] { return !SessionListed(*admin_, session_id); }, kReclaimTimeout))
      << server_->Logs();
  EXPECT_LT(absl::Now() - killed, kReclaimTimeout);
  EXPECT_TRUE(PollUntil([&] { return ArenaReleased(*server_, memfds, shm_path); },
                        kReclaimTimeout));

  auto after = admin_->GetStats();
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->sessions(), before->sessions());
  EXPECT_EQ(after->sequences(), before->sequences());
  EXPECT_EQ(after->arena_bytes_used(), before->arena_bytes_used());
  EXPECT_GE(after->sessions_reclaimed(), before->sessions_reclaimed() + 1);
  auto left = admin_->ListSequences(session_id);
  ASSERT_TRUE(left.ok());
  EXPECT_EQ(left->sequences_size(), 0);
}

TEST_F(ReclaimTest, LeaseExpiryWithoutWatchOrHeartbeatReclaims) {
  auto before = admin_->GetStats();
  ASSERT_TRUE(before.ok());
  const int memfds = CountArenaMemfds(server_->process().pid());
  auto client = server_->Connect();
  ASSERT_TRUE(client.ok()) << client.status();
  // A bare Attach through the stub: no Watch stream, no heartbeat thread.
  v1::AttachRequest request;
  *request.mutable_layout() = MakeLayout(2, 2, 2, 32, v1::DTYPE_FLOAT16);
  request.set_num_blocks(16);
  request.set_lease_ms(3000);
  v1::AttachResponse response;
  {
    grpc::ClientContext context;
    ASSERT_TRUE((*client)->stub()->Attach(&context, request, &response).ok());
  }
  const std::string shm_path = response.arena().shm_path();
  EXPECT_EQ(response.arena().kind(), v1::ArenaHandle::KIND_MEMFD);
  EXPECT_FALSE(ArenaReleased(*server_, memfds, shm_path));
  EXPECT_EQ(response.lease_ms(), 3000);
  {
    v1::CreateSequenceRequest create;
    create.set_session_id(response.session_id());
    create.set_sequence_id("s");
    v1::CreateSequenceResponse created;
    grpc::ClientContext context;
    ASSERT_TRUE((*client)->stub()->CreateSequence(&context, create, &created).ok());
  }
  EXPECT_TRUE(PollUntil([&] { return !SessionListed(*admin_, response.session_id()); },
                        absl::Milliseconds(3000) + kReclaimTimeout))
      << server_->Logs();
  EXPECT_TRUE(PollUntil([&] { return ArenaReleased(*server_, memfds, shm_path); },
                        kReclaimTimeout));
  v1::HeartbeatRequest heartbeat;
  heartbeat.set_session_id(response.session_id());
  v1::HeartbeatResponse ignored;
  grpc::ClientContext context;
  EXPECT_EQ((*client)->stub()->Heartbeat(&context, heartbeat, &ignored).error_code(),
            grpc::StatusCode::NOT_FOUND);
  auto after = admin_->GetStats();
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->sessions(), before->sessions());
  EXPECT_EQ(after->arena_bytes_used(), before->arena_bytes_used());
  EXPECT_GE(after->sessions_reclaimed(), before->sessions_reclaimed() + 1);
}

TEST_F(ReclaimTest, HeartbeatsKeepAShortLeaseAlive) {
  auto client = server_->Connect();
  ASSERT_TRUE(client.ok());
  auto session = (*client)->Attach(MakeLayout(2, 2, 2, 32, v1::DTYPE_FLOAT16), "e2e", 16,
                                   /*lease_ms=*/1200);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE((*session)->CreateSequence(KeyDiffPolicy(), std::nullopt, "alive").ok());
  ASSERT_TRUE(WriteTokens(**session, "alive", 10, 9).ok());
  // Over three leases later the session, its sequence and its data are all still there.
  absl::SleepFor(absl::Seconds(4));
  EXPECT_TRUE((*session)->health().ok()) << (*session)->health();
  EXPECT_TRUE(SessionListed(*admin_, (*session)->session_id()));
  auto verified = VerifySequence(**session, "alive", 9);
  ASSERT_TRUE(verified.ok()) << verified.status();
  EXPECT_THAT(verified->counts, ::testing::Each(10));
}

TEST_F(ReclaimTest, DetachAndDestructionReleaseAtOnce) {
  auto client = server_->Connect();
  ASSERT_TRUE(client.ok());
  auto before = admin_->GetStats();
  ASSERT_TRUE(before.ok());
  const int memfds = CountArenaMemfds(server_->process().pid());
  std::string shm_path, session_id;
  {
    auto session = (*client)->Attach(MakeLayout(2, 2, 2, 32, v1::DTYPE_FLOAT16), "e2e", 16, 0);
    ASSERT_TRUE(session.ok()) << session.status();
    ASSERT_TRUE((*session)->CreateSequence(KeyDiffPolicy(), std::nullopt, "a").ok());
    ASSERT_TRUE((*session)->CreateSequence(KeyDiffPolicy(), std::nullopt, "b").ok());
    ASSERT_TRUE(WriteTokens(**session, "a", 20, 1).ok());
    shm_path = (*session)->arena().shm_path();
    auto detached = (*session)->Detach();
    ASSERT_TRUE(detached.ok()) << detached.status();
    EXPECT_EQ(detached->sequences_released(), 2);
    EXPECT_EQ(detached->blocks_released(), 4);  // 20 tokens = 2 blocks in each of 2 layers
    EXPECT_TRUE(ArenaReleased(*server_, memfds, shm_path));
    EXPECT_EQ((*session)->Detach().status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ((*session)->Reserve("a", 1).status().code(), absl::StatusCode::kFailedPrecondition);
  }
  {
    auto session = (*client)->Attach(MakeLayout(2, 2, 2, 32, v1::DTYPE_FLOAT16), "e2e", 16, 0);
    ASSERT_TRUE(session.ok()) << session.status();
    session_id = (*session)->session_id();
    shm_path = (*session)->arena().shm_path();
    ASSERT_TRUE(SessionListed(*admin_, session_id));
  }  // destroyed without Detach
  EXPECT_FALSE(SessionListed(*admin_, session_id));
  EXPECT_TRUE(ArenaReleased(*server_, memfds, shm_path));
  auto after = admin_->GetStats();
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->sessions(), before->sessions());
  EXPECT_EQ(after->arena_bytes_used(), before->arena_bytes_used());
}

}  // namespace
}  // namespace kvs_e2e
