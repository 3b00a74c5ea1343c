// End to end: a session's arena reaches only the worker that attached it. Through the real
// binary: the default arena leaves no name in /dev/shm; another process of the sidecar's uid finds
// no shared-memory name, cannot open /proc/<sidecar>/fd/*, /proc/<sidecar>/map_files/* or
// /proc/<sidecar>/mem, and gets no descriptor from the arena socket without the session's own
// unused, unexpired nonce; the legacy --arena_shm_names mode still works. As root (CI), the
// sidecar and the probing process both run as an unprivileged uid, since root bypasses the
// permission checks under test; otherwise both run as the current uid.
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvsidecar/client.h"
#include "tests/e2e/e2e_util.h"

namespace kvs_e2e {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// The unprivileged uid (nobody) the sidecar and the probe run as when the test runs as root.
constexpr int kNobody = 65534;
int ProbeUid() { return geteuid() == 0 ? kNobody : -1; }

// Entries of /dev/shm that name an arena of the process `pid` ("kvsidecar-<pid>-...").
std::vector<std::string> ShmNamesOf(pid_t pid) {
  std::vector<std::string> names;
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return names;
  const std::string prefix = absl::StrCat("kvsidecar-", pid, "-");
  while (const dirent* entry = readdir(dir)) {
    if (std::string(entry->d_name).rfind(prefix, 0) == 0) names.push_back(entry->d_name);
  }
  closedir(dir);
  return names;
}

// Runs the probe as `uid` and returns its "key=value" lines.
std::map<std::string, std::string> Probe(ServerProcess& server, int uid,
                                         const std::string& socket_path,
                                         const std::string& session_id,
                                         const std::vector<std::string>& nonces) {
  std::vector<std::string> argv = {BuildDir() + "/tests/e2e/kvs_e2e_arena_probe",
                                   absl::StrCat(server.process().pid()), "/dev/shm",
                                   socket_path.empty() ? "/nonexistent/arena.sock" : socket_path,
                                   session_id};
  argv.insert(argv.end(), nonces.begin(), nonces.end());
  auto probe = ChildProcess::Spawn(argv, server.dir(), "probe", uid);
  EXPECT_TRUE(probe.ok()) << probe.status();
  if (!probe.ok()) return {};
  EXPECT_EQ((*probe)->Wait(kStartTimeout), 0) << (*probe)->Stderr();
  std::map<std::string, std::string> result;
  for (absl::string_view line : absl::StrSplit((*probe)->Stdout(), '\n', absl::SkipEmpty())) {
    const size_t eq = line.find('=');
    result[std::string(line.substr(0, eq))] = std::string(line.substr(eq + 1));
  }
  return result;
}

// A bare Attach through the stub: the response with its unused nonce.
absl::StatusOr<v1::AttachResponse> RawAttach(kvsidecar::Client& client) {
  v1::AttachRequest request;
  *request.mutable_layout() = MakeLayout(2, 2, 2, 32, v1::DTYPE_FLOAT16);
  request.set_num_blocks(8);
  v1::AttachResponse response;
  grpc::ClientContext context;
  const grpc::Status status = client.stub()->Attach(&context, request, &response);
  if (!status.ok()) return kvsidecar::ToStatus(status);
  return response;
}

absl::StatusOr<std::unique_ptr<ServerProcess>> StartServer(std::vector<std::string> args = {}) {
  ServerProcess::Options options;
  options.extra_args = std::move(args);
  options.run_as_uid = ProbeUid();
  return ServerProcess::Start(options);
}

TEST(ArenaIsolationTest, DefaultArenaHasNoNameInDevShm) {
  auto server = StartServer();
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = (*server)->Connect();
  ASSERT_TRUE(client.ok()) << client.status();
  auto session = (*client)->Attach(MakeLayout(2, 2, 2, 32, v1::DTYPE_FLOAT16), "e2e", 16, 0);
  ASSERT_TRUE(session.ok()) << session.status();

  EXPECT_THAT(ShmNamesOf((*server)->process().pid()), ::testing::IsEmpty());
  const v1::ArenaHandle& arena = (*session)->arena();
  EXPECT_EQ(arena.kind(), v1::ArenaHandle::KIND_MEMFD);
  EXPECT_EQ(arena.shm_path(), "");
  EXPECT_THAT(arena.fd_socket_path(), StartsWith((*server)->dir() + "/data/run/"));
  EXPECT_EQ(arena.fd_nonce().size(), 64u);
  // The socket is 0600 in a 0700 directory.
  struct stat st;
  ASSERT_EQ(stat(arena.fd_socket_path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  ASSERT_EQ(stat(((*server)->dir() + "/data/run").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);

  // The worker's mapping is the sidecar's memory: written in place, read back by the sidecar.
  ASSERT_TRUE((*session)->CreateSequence(KeyDiffPolicy(), std::nullopt, "s").ok());
  ASSERT_TRUE(WriteTokens(**session, "s", 20, 5).ok());
  auto verified = VerifySequence(**session, "s", 5);
  ASSERT_TRUE(verified.ok()) << verified.status();
  EXPECT_THAT(verified->counts, ::testing::Each(20));
  EXPECT_THAT((*server)->Logs(), HasSubstr("arena_fd_sent"));
}

TEST(ArenaIsolationTest, SameUidProcessCannotReachTheArena) {
  auto server = StartServer();
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = (*server)->Connect();
  ASSERT_TRUE(client.ok()) << client.status();
  auto session = (*client)->Attach(MakeLayout(2, 2, 2, 32, v1::DTYPE_FLOAT16), "victim", 16, 0);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE((*session)->CreateSequence(KeyDiffPolicy(), std::nullopt, "secret").ok());
  ASSERT_TRUE(WriteTokens(**session, "secret", 20, 11).ok());
  const std::string victim = (*session)->session_id();
  const std::string socket_path = (*session)->arena().fd_socket_path();
  const std::string used_nonce = (*session)->arena().fd_nonce();
  // A second session whose nonce nobody has used yet.
  auto other = RawAttach(**client);
  ASSERT_TRUE(other.ok()) << other.status();

  auto probe = Probe(**server, ProbeUid(), socket_path, victim,
                     {"none=", "wrong=" + std::string(64, 'a'), "reused=" + used_nonce,
                      "other_session=" + other->arena().fd_nonce()});
  EXPECT_EQ(probe["shm_names"], "0");
  EXPECT_EQ(probe["shm_opened"], "0");
  EXPECT_EQ(probe["proc_fd_opened"], "0");
  EXPECT_EQ(probe["map_files_opened"], "0");
  EXPECT_EQ(probe["proc_mem_opened"], "0");
  EXPECT_THAT(probe["fetch_none"], StartsWith("REFUSED"));
  EXPECT_THAT(probe["fetch_wrong"], StartsWith("REFUSED"));
  EXPECT_THAT(probe["fetch_wrong"], HasSubstr("unknown or already used nonce"));
  EXPECT_THAT(probe["fetch_reused"], StartsWith("REFUSED"));
  EXPECT_THAT(probe["fetch_other_session"], StartsWith("REFUSED"));
  EXPECT_THAT(probe["fetch_other_session"], HasSubstr("another session"));
  // A nonce is spent by its first presentation, even a refused one: its own worker is refused too.
  auto late = kvsidecar::FetchArenaFd(socket_path, other->session_id(),
                                      other->arena().fd_nonce());
  EXPECT_EQ(late.status().code(), absl::StatusCode::kPermissionDenied) << late.status();
  // Refusals are logged with the peer's credentials.
  const std::string logs = (*server)->Logs();
  EXPECT_THAT(logs, HasSubstr("arena_fd_refused"));
  EXPECT_THAT(logs, HasSubstr(absl::StrCat("uid=", ProbeUid() >= 0 ? ProbeUid() : getuid())));
  // The victim's data is intact.
  auto verified = VerifySequence(**session, "secret", 11);
  EXPECT_TRUE(verified.ok()) << verified.status();
}

TEST(ArenaIsolationTest, ExpiredNonceIsRefused) {
  auto server = StartServer({"--arena_nonce_ttl_ms=300"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = (*server)->Connect();
  ASSERT_TRUE(client.ok()) << client.status();
  auto attached = RawAttach(**client);
  ASSERT_TRUE(attached.ok()) << attached.status();
  absl::SleepFor(absl::Milliseconds(800));
  auto probe = Probe(**server, ProbeUid(), attached->arena().fd_socket_path(),
                     attached->session_id(), {"expired=" + attached->arena().fd_nonce()});
  EXPECT_THAT(probe["fetch_expired"], StartsWith("REFUSED"));
  EXPECT_THAT(probe["fetch_expired"], HasSubstr("expired"));
  // Within its time, the session's own nonce fetches the descriptor, once.
  auto fresh = RawAttach(**client);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  auto fd = kvsidecar::FetchArenaFd(fresh->arena().fd_socket_path(), fresh->session_id(),
                                    fresh->arena().fd_nonce());
  ASSERT_TRUE(fd.ok()) << fd.status();
  // Sealed: neither side can resize it under the other's mapping.
  EXPECT_NE(ftruncate(*fd, 1 << 20), 0);
  const int seals = fcntl(*fd, F_GET_SEALS);
  EXPECT_EQ(seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL),
            F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  close(*fd);
  auto again = kvsidecar::FetchArenaFd(fresh->arena().fd_socket_path(), fresh->session_id(),
                                       fresh->arena().fd_nonce());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kPermissionDenied);
}

TEST(ArenaIsolationTest, LegacyShmNamesFlagStillServesNamedFiles) {
  auto server = StartServer({"--arena_shm_names=true"});
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_THAT((*server)->Logs(), HasSubstr("arena_shm_names"));
  EXPECT_THAT((*server)->Logs(), HasSubstr("NOT isolated"));
  auto client = (*server)->Connect();
  ASSERT_TRUE(client.ok()) << client.status();
  auto session = (*client)->Attach(MakeLayout(2, 2, 2, 32, v1::DTYPE_FLOAT16), "e2e", 16, 0);
  ASSERT_TRUE(session.ok()) << session.status();
  const v1::ArenaHandle& arena = (*session)->arena();
  EXPECT_EQ(arena.kind(), v1::ArenaHandle::KIND_SHARED_MEMORY_FILE);
  EXPECT_EQ(arena.fd_nonce(), "");
  EXPECT_THAT(arena.shm_path(), StartsWith("/dev/shm/kvsidecar-"));
  EXPECT_EQ(ShmNamesOf((*server)->process().pid()).size(), 1u);
  ASSERT_TRUE((*session)->CreateSequence(KeyDiffPolicy(), std::nullopt, "s").ok());
  ASSERT_TRUE(WriteTokens(**session, "s", 20, 7).ok());
  EXPECT_TRUE(VerifySequence(**session, "s", 7).ok());
  const std::string path = arena.shm_path();
  ASSERT_TRUE((*session)->Detach().ok());
  struct stat st;
  EXPECT_NE(stat(path.c_str(), &st), 0) << path << " outlived Detach";
}

// A client that trickles its request line a byte at a time is cut off one io_timeout (2 s) after
// it connected, not after 2 s of silence: otherwise a few such clients of the sidecar's uid would
// hold every connection slot, and with them every other worker's arena hand-out.
TEST(ArenaIsolationTest, TrickledRequestIsCutOffAtOneDeadline) {
  auto server = StartServer();
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = (*server)->Connect();
  ASSERT_TRUE(client.ok()) << client.status();
  auto attached = RawAttach(**client);
  ASSERT_TRUE(attached.ok()) << attached.status();
  const std::string socket_path = attached->arena().fd_socket_path();

  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  ASSERT_LT(socket_path.size(), sizeof(address.sun_path));
  std::strcpy(address.sun_path, socket_path.c_str());
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  const absl::Time start = absl::Now();
  bool cut_off = false;
  while (absl::Now() - start < absl::Seconds(6)) {
    // A byte every 300 ms, never the newline.
    if (send(fd, "F", 1, MSG_NOSIGNAL) != 1) {
      cut_off = true;
      break;
    }
    pollfd readable = {fd, POLLIN, 0};
    if (poll(&readable, 1, 300) > 0) {  // the server's ERROR line, or the connection closed
      cut_off = true;
      break;
    }
  }
  const absl::Duration held = absl::Now() - start;
  close(fd);
  EXPECT_TRUE(cut_off) << "a trickling client held its connection for " << held;
  EXPECT_LT(held, absl::Milliseconds(3500));
  EXPECT_THAT((*server)->Logs(), HasSubstr("no complete request line"));
}

TEST(ArenaIsolationTest, ArenaSocketBelongsToOneLiveSidecar) {
  const std::string dir = MakeTempDir("kvs-e2e-arena-socket-");
  ASSERT_FALSE(dir.empty());
  const std::string socket_path = dir + "/sock/arena.sock";
  // A socket file nothing listens on, as a killed sidecar leaves behind.
  ASSERT_EQ(mkdir((dir + "/sock").c_str(), 0700), 0);
  {
    const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::strcpy(address.sun_path, socket_path.c_str());
    ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
    close(fd);
  }
  ServerProcess::Options options;
  options.extra_args = {"--arena_socket=" + socket_path};
  auto first = ServerProcess::Start(options);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_THAT((*first)->Logs(), HasSubstr("arena_socket_stale_removed"));
  auto client = (*first)->Connect();
  ASSERT_TRUE(client.ok()) << client.status();
  auto session = (*client)->Attach(MakeLayout(2, 2, 2, 32, v1::DTYPE_FLOAT16), "e2e", 16, 0);
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ((*session)->arena().fd_socket_path(), socket_path);

  // A second sidecar on the same socket refuses to start rather than take it over.
  auto second = ServerProcess::Start(options);
  ASSERT_FALSE(second.ok());
  EXPECT_THAT(second.status().message(), HasSubstr("another process serves " + socket_path));

  // Something that is not a socket is never removed.
  const std::string file_path = dir + "/not-a-socket";
  { std::ofstream(file_path) << "keep"; }
  options.extra_args = {"--arena_socket=" + file_path};
  auto third = ServerProcess::Start(options);
  ASSERT_FALSE(third.ok());
  EXPECT_THAT(third.status().message(), HasSubstr("exists and is not a socket"));
  struct stat st;
  EXPECT_EQ(stat(file_path.c_str(), &st), 0);
  ASSERT_TRUE((*session)->Detach().ok());
  first->reset();  // stops the first sidecar, which removes its socket
  EXPECT_NE(stat(socket_path.c_str(), &st), 0);
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

}  // namespace
}  // namespace kvs_e2e
