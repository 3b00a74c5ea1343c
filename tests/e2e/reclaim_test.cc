// End to end: the memory of a worker that goes away is reclaimed by the real server: a worker
// process that is SIGKILLed (its Watch stream breaks), a session whose lease lapses without Watch
// or heartbeat, an explicit Detach and a Session destroyed without Detach. Leases run on the
// monotonic clock: steps of the server's system clock (libfaketime) neither end live sessions
// nor keep lapsed ones. The arenas are memfds
// (the default): reclaimed means the sidecar holds no descriptor of them any more (checked through
// /proc/<sidecar>/fd where this test may read it, i.e. as root, the sidecar being non-dumpable).
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
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

// Starts kvs_e2e_worker on `server` with a lease of `lease_ms` (and `env` on top of this
// process's environment) and waits for its "READY session=<id> shm=<path>" line, kept in `ready`.
std::unique_ptr<ChildProcess> StartWorker(ServerProcess& server, const std::string& log_dir,
                                          int lease_ms, const std::vector<std::string>& env,
                                          std::string* ready) {
  auto worker = ChildProcess::Spawn(
      {BuildDir() + "/tests/e2e/kvs_e2e_worker", server.data_target(), std::to_string(lease_ms)},
      log_dir, "worker", /*run_as_uid=*/-1, env);
  EXPECT_TRUE(worker.ok()) << worker.status();
  if (!worker.ok()) return nullptr;
  PollUntil(
      [&] {
        const std::string out = (*worker)->Stdout();
        if (out.find('\n') != std::string::npos) *ready = out;
        return !ready->empty() || !(*worker)->Running();
      },
      kStartTimeout);
  EXPECT_THAT(*ready, ::testing::HasSubstr("READY")) << (*worker)->Stderr();
  return *std::move(worker);
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
  std::string ready;
  std::unique_ptr<ChildProcess> worker =
      StartWorker(*server_, server_->dir(), /*lease_ms=*/120000, {}, &ready);
  ASSERT_TRUE(worker != nullptr && absl::StrContains(ready, "READY"));
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

  ASSERT_EQ(worker->Stop(SIGKILL, absl::Seconds(30)) & 0x7f, SIGKILL);
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

// ---------------------------------------------------------------------------------------------
// Steps of the system clock. NTP, a VM resumed from a pause or an operator may step a host's
// clock by any amount at any moment; a lease measured on it would end every session at once
// (forward) or keep a dead worker's memory for as long as the step (backward).

// libfaketime (Debian package libfaketime), the multithreaded build; "" when not installed.
std::string FakeTimeLibrary() {
  for (const char* dir : {"/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib",
                          "/usr/local/lib"}) {
    const std::string path = absl::StrCat(dir, "/faketime/libfaketimeMT.so.1");
    if (access(path.c_str(), R_OK) == 0) return path;
  }
  return "";
}

// The time of the server's "attach" log line of `session_id` (its system clock), if logged yet.
std::optional<absl::Time> LoggedAttachTime(ServerProcess& server, const std::string& session_id) {
  const std::string logs = server.process().Stderr();
  const size_t at = logs.find(absl::StrCat(" attach session=", session_id));
  if (at == std::string::npos) return std::nullopt;
  const size_t line = logs.rfind('\n', at);
  const size_t start = line == std::string::npos ? 0 : line + 1;
  const std::string stamp = logs.substr(start, logs.find(' ', start) - start);  // first field
  absl::Time time;
  std::string error;
  if (!absl::ParseTime("%Y-%m-%dT%H:%M:%E*SZ", stamp, &time, &error)) return std::nullopt;
  return time;
}

class ClockStepTest : public ::testing::Test {
 protected:
  void SetUp() override {
    library_ = FakeTimeLibrary();
    if (library_.empty()) {
      GTEST_SKIP() << "libfaketime is not installed (deploy/install_deps.sh installs the Debian "
                      "package libfaketime)";
    }
    dir_ = MakeTempDir("kvs-e2e-clock-");
    offset_file_ = dir_ + "/offset";
    ASSERT_TRUE(SetOffset("+0"));
    ServerProcess::Options options;
    options.env = FakeTimeEnv(offset_file_);
    auto server = ServerProcess::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    auto client = server_->Connect();
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
    auto admin = server_->ConnectAdmin();
    ASSERT_TRUE(admin.ok()) << admin.status();
    admin_ = std::move(*admin);
  }

  // The environment of a process whose system clock (CLOCK_REALTIME) is offset by what
  // `offset_file` says, read again on every call; CLOCK_MONOTONIC is left alone.
  std::vector<std::string> FakeTimeEnv(const std::string& offset_file) const {
    std::string asan_options = "verify_asan_link_order=0";  // libfaketime is preloaded first
    if (const char* inherited = getenv("ASAN_OPTIONS")) {
      asan_options = absl::StrCat(inherited, ":", asan_options);
    }
    return {"LD_PRELOAD=" + library_,         "FAKETIME_TIMESTAMP_FILE=" + offset_file,
            "FAKETIME_NO_CACHE=1",            "FAKETIME_DONT_FAKE_MONOTONIC=1",
            "ASAN_OPTIONS=" + asan_options};
  }

  bool SetOffset(const std::string& offset) { return SetOffset(offset_file_, offset); }
  // Written aside and renamed over: libfaketime reads the file on every call and must never
  // see it empty.
  static bool SetOffset(const std::string& offset_file, const std::string& offset) {
    const std::string written = offset_file + ".new";
    {
      std::ofstream file(written, std::ios::trunc);
      file << offset << "\n";
      if (!file.flush()) return false;
    }
    return std::rename(written.c_str(), offset_file.c_str()) == 0;
  }

  // Steps the server's system clock to `offset` from the real one and waits until the server
  // shows it: a session attached then (through the arena socket, whose nonces have lifetimes
  // too) is logged at that offset, give or take a minute. Every probe session is detached.
  void StepTo(const std::string& offset, absl::Duration expected) {
    ASSERT_TRUE(SetOffset(offset));
    bool seen = false;
    absl::Duration logged;
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (!seen && absl::Now() < deadline) {
      const absl::Time before = absl::Now();
      auto probe = client_->Attach(MakeLayout(1, 1, 1, 16, v1::DTYPE_FLOAT16), "probe", 4, 0);
      ASSERT_TRUE(probe.ok()) << probe.status() << "\n" << server_->Logs();
      std::optional<absl::Time> at;
      PollUntil(
          [&] {
            at = LoggedAttachTime(*server_, (*probe)->session_id());
            return at.has_value();
          },
          absl::Seconds(5));
      ASSERT_TRUE(at.has_value()) << server_->Logs();
      logged = *at - before;
      seen = absl::AbsDuration(logged - expected) < absl::Minutes(1);
      ASSERT_TRUE((*probe)->Detach().ok());
      if (!seen) absl::SleepFor(absl::Milliseconds(200));
    }
    ASSERT_TRUE(seen) << "the server's clock is " << logged << " from this one, not " << expected;
  }

  // A bare Attach: no Watch stream and no heartbeat, so only its lease can end it.
  std::string AttachBare(int lease_ms) {
    v1::AttachRequest request;
    *request.mutable_layout() = MakeLayout(2, 2, 2, 32, v1::DTYPE_FLOAT16);
    request.set_num_blocks(16);
    request.set_lease_ms(lease_ms);
    v1::AttachResponse response;
    grpc::ClientContext context;
    const grpc::Status status = client_->stub()->Attach(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response.session_id();
  }

  std::string library_;
  std::string dir_;
  std::string offset_file_;  // the server's
  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<kvsidecar::Client> client_;
  std::unique_ptr<kvsidecar::AdminClient> admin_;
};

TEST_F(ClockStepTest, StepsOfTheSystemClockNeitherEndNorExtendLeases) {
  // A worker with heartbeats and data, and a bare session with a lease of 10 s.
  auto worker = client_->Attach(MakeLayout(2, 2, 2, 32, v1::DTYPE_FLOAT16), "e2e", 16,
                                /*lease_ms=*/3000);
  ASSERT_TRUE(worker.ok()) << worker.status();
  ASSERT_TRUE((*worker)->CreateSequence(KeyDiffPolicy(), std::nullopt, "kept").ok());
  ASSERT_TRUE(WriteTokens(**worker, "kept", 10, 5).ok());
  const std::string bare = AttachBare(10000);
  ASSERT_FALSE(bare.empty());
  const absl::Time bare_attached = absl::Now();

  // An hour forward: a clock-based lease would have lapsed for both.
  ASSERT_NO_FATAL_FAILURE(StepTo("+1h", absl::Hours(1)));
  absl::SleepFor(absl::Seconds(1));  // the reaper runs every 200 ms
  EXPECT_TRUE(SessionListed(*admin_, (*worker)->session_id())) << server_->Logs();
  EXPECT_TRUE((*worker)->health().ok()) << (*worker)->health();
  auto verified = VerifySequence(**worker, "kept", 5);
  ASSERT_TRUE(verified.ok()) << verified.status();
  EXPECT_THAT(verified->counts, ::testing::Each(10));
  if (absl::Now() - bare_attached < absl::Seconds(8)) {
    EXPECT_TRUE(SessionListed(*admin_, bare)) << "reclaimed before its lease of 10 s";
  }
  // The bare session still lapses, 10 s after its attach by the monotonic clock.
  EXPECT_TRUE(PollUntil([&] { return !SessionListed(*admin_, bare); },
                        absl::Seconds(10) + kReclaimTimeout));

  // A session attached now, then the clock back by the hour: it lapses after its 3 s all the
  // same, not an hour later.
  const std::string lapsing = AttachBare(3000);
  ASSERT_FALSE(lapsing.empty());
  ASSERT_NO_FATAL_FAILURE(StepTo("+0", absl::ZeroDuration()));
  EXPECT_TRUE(PollUntil([&] { return !SessionListed(*admin_, lapsing); },
                        absl::Seconds(3) + kReclaimTimeout))
      << server_->Logs();
  // The worker, heartbeating through both steps, is still there with its data.
  EXPECT_TRUE(SessionListed(*admin_, (*worker)->session_id()));
  verified = VerifySequence(**worker, "kept", 5);
  ASSERT_TRUE(verified.ok()) << verified.status();
  EXPECT_THAT(verified->counts, ::testing::Each(10));
}

// The worker's side: its heartbeats keep a short lease alive across a step of its own clock.
TEST_F(ClockStepTest, AWorkersHeartbeatsGoOnAcrossAStepOfItsClock) {
  const std::string worker_offset = dir_ + "/worker-offset";
  ASSERT_TRUE(SetOffset(worker_offset, "+0"));
  std::string ready;
  std::unique_ptr<ChildProcess> worker =
      StartWorker(*server_, dir_, /*lease_ms=*/3000, FakeTimeEnv(worker_offset), &ready);
  ASSERT_TRUE(worker != nullptr && absl::StrContains(ready, "READY"));
  const std::string session_id = FieldOf(ready, "session");
  std::ifstream maps(absl::StrCat("/proc/", worker->pid(), "/maps"));
  const std::string mapped((std::istreambuf_iterator<char>(maps)), {});
  ASSERT_THAT(mapped, ::testing::HasSubstr("libfaketime")) << "the worker runs without it";

  // Stepped by an hour, the worker's heartbeat thread must keep its interval of lease / 3.
  ASSERT_TRUE(SetOffset(worker_offset, "+1h"));
  absl::SleepFor(absl::Seconds(10));  // over three leases
  EXPECT_TRUE(SessionListed(*admin_, session_id)) << server_->Logs();
  auto sequences = admin_->ListSequences(session_id);
  ASSERT_TRUE(sequences.ok()) << sequences.status();
  EXPECT_EQ(sequences->sequences_size(), 1);
}

}  // namespace
}  // namespace kvs_e2e
