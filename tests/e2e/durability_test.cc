// End to end, through the real binary and its real RocksDB files: a damaged write-ahead log costs
// only the copy whose record it damaged, which is then listed lost (DATA_LOSS on Restore, its
// layer file kept, logged at ERROR) across restarts; the server's files are owner-only under a
// permissive umask; an admin token equal to a tenant token stops the start; token files readable
// by others are warned about.
#include <sys/stat.h>
#include <sys/wait.h>

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvsidecar/client.h"
#include "tests/e2e/e2e_util.h"

namespace kvs_e2e {
namespace {

using ::testing::HasSubstr;

constexpr char kTenant[] = "e2e";
constexpr int kCopies = 4;

struct ScopedDir {
  ScopedDir() : path(MakeTempDir("kvs-e2e-durability-")) {}
  ~ScopedDir() {
    if (!path.empty()) std::filesystem::remove_all(path);
  }
  const std::string path;
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void WriteFile(const std::string& path, const std::string& text, mode_t mode) {
  std::ofstream(path) << text;
  chmod(path.c_str(), mode);
}

std::vector<std::string> Files(const std::string& dir, const std::string& extension) {
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() == extension) files.push_back(entry.path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

absl::Status Spill(kvsidecar::Session& session, const std::string& seq) {
  v1::SpillRequest request;
  request.set_sequence_id(seq);
  request.set_target(v1::TIER_DISK);
  return session.Spill(request).status();
}

absl::Status Restore(kvsidecar::Session& session, const std::string& seq,
                     const std::string& from_session) {
  v1::RestoreRequest request;
  request.set_sequence_id(seq);
  request.set_from_session_id(from_session);
  return session.Restore(request).status();
}

const v1::SpilledCopy* FindCopy(const v1::ListSpilledResponse& listed, const std::string& seq) {
  for (const v1::SpilledCopy& copy : listed.copies()) {
    if (copy.sequence_id() == seq) return &copy;
  }
  return nullptr;
}

// The reproduction: four disk copies, one byte of the second one's metadata record
// flipped in the write-ahead log while the server is down.
TEST(DurabilityE2eTest, ACorruptWalRecordLosesOnlyItsCopyAndStaysLost) {
  const ScopedDir scoped;
  const std::string& dir = scoped.path;
  ASSERT_FALSE(dir.empty());
  const std::string data_dir = dir + "/data";
  ServerProcess::Options options;
  options.extra_args = {"--data_dir=" + data_dir};
  const v1::ModelLayout layout = MakeLayout(2, 2, 4, 32, v1::DTYPE_FLOAT16);
  std::string old_session;
  {
    auto server = ServerProcess::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    auto client = (*server)->Connect();
    ASSERT_TRUE(client.ok());
    auto session = (*client)->Attach(layout, kTenant, 128, 30000);
    ASSERT_TRUE(session.ok()) << session.status();
    old_session = (*session)->session_id();
    for (int i = 0; i < kCopies; ++i) {
      const std::string id = "copy-" + std::to_string(i);
      ASSERT_TRUE((*session)->CreateSequence(KeyDiffPolicy(), MakeBudget(64), id).ok());
      ASSERT_TRUE(WriteTokens(**session, id, 20 + i, 500 + i).ok());
      ASSERT_TRUE(Spill(**session, id).ok());
    }
    EXPECT_EQ((*server)->process().Stop(SIGTERM, absl::Seconds(20)), 0);
  }
  const std::string layer_dir = data_dir + "/rocksdb/kvs-layers";
  ASSERT_EQ(Files(layer_dir, ".kvl").size(), static_cast<size_t>(kCopies));

  // Flip one byte of copy-1's metadata value (a few bytes past its key) in the WAL.
  bool flipped = false;
  for (const std::string& log : Files(data_dir + "/rocksdb", ".log")) {
    std::string bytes = ReadFile(log);
    const size_t at = bytes.find("copy-1");
    if (at == std::string::npos) continue;
    ASSERT_LT(at + 20, bytes.size());
    bytes[at + 20] = static_cast<char>(bytes[at + 20] ^ 0x10);
    std::ofstream(log, std::ios::binary | std::ios::trunc) << bytes;
    flipped = true;
    break;
  }
  ASSERT_TRUE(flipped) << "no WAL record of copy-1 under " << data_dir << "/rocksdb";

  for (int restart = 0; restart < 2; ++restart) {
    SCOPED_TRACE(::testing::Message() << "restart " << restart);
    auto server = ServerProcess::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    auto admin = (*server)->ConnectAdmin();
    ASSERT_TRUE(admin.ok());
    auto listed = (*admin)->ListSpilled();
    ASSERT_TRUE(listed.ok()) << listed.status();
    ASSERT_EQ(listed->copies_size(), kCopies) << listed->DebugString() << (*server)->Logs();
    for (int i = 0; i < kCopies; ++i) {
      const v1::SpilledCopy* copy = FindCopy(*listed, "copy-" + std::to_string(i));
      ASSERT_NE(copy, nullptr) << i;
      EXPECT_EQ(copy->session_id(), old_session);
      if (i == 1) {
        EXPECT_THAT(copy->lost(), HasSubstr("write-ahead log")) << copy->lost();
      } else {
        EXPECT_TRUE(copy->lost().empty()) << i << ": " << copy->lost();
      }
    }
    // Reported at ERROR, and no intact layer file was deleted.
    EXPECT_THAT((*server)->Logs(), HasSubstr("ERROR disk_copy_lost"));
    EXPECT_EQ(Files(layer_dir, ".kvl").size(), static_cast<size_t>(kCopies));
    auto client = (*server)->Connect();
    ASSERT_TRUE(client.ok());
    auto session = (*client)->Attach(layout, kTenant, 128, 30000);
    ASSERT_TRUE(session.ok()) << session.status();
    const absl::Status lost = Restore(**session, "copy-1", old_session);
    EXPECT_EQ(lost.code(), absl::StatusCode::kDataLoss) << lost;
    if (restart == 1) {
      // The intact copies come back bit for bit.
      for (int i : {0, 2, 3}) {
        const std::string id = "copy-" + std::to_string(i);
        const absl::Status restored = Restore(**session, id, old_session);
        ASSERT_TRUE(restored.ok()) << id << ": " << restored;
        auto verified = VerifySequence(**session, id, 500 + i);
        ASSERT_TRUE(verified.ok()) << verified.status();
        EXPECT_THAT(verified->counts, ::testing::Each(20 + i));
      }
    }
    EXPECT_EQ((*server)->process().Stop(SIGTERM, absl::Seconds(20)), 0);
  }
}

// Under umask 022 the data directory, the RocksDB files (WAL included) and the layer files are
// still readable by their owner only.
TEST(DurabilityE2eTest, ServerFilesAreOwnerOnlyUnderAPermissiveUmask) {
  const ScopedDir scoped;
  const std::string data_dir = scoped.path + "/data";
  const mode_t previous = umask(022);
  ServerProcess::Options options;
  options.extra_args = {"--data_dir=" + data_dir};
  auto server = ServerProcess::Start(options);
  umask(previous);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = (*server)->Connect();
  ASSERT_TRUE(client.ok());
  auto session = (*client)->Attach(MakeLayout(2, 2, 4, 32, v1::DTYPE_FLOAT16), kTenant, 64, 30000);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE((*session)->CreateSequence(KeyDiffPolicy(), MakeBudget(64), "s").ok());
  ASSERT_TRUE(WriteTokens(**session, "s", 20, 1).ok());
  ASSERT_TRUE(Spill(**session, "s").ok());
  int checked = 0;
  struct stat st;
  ASSERT_EQ(stat(data_dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u) << data_dir;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(data_dir)) {
    ASSERT_EQ(stat(entry.path().c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 077, 0u) << entry.path() << " has mode " << std::oct
                                    << (st.st_mode & 0777);
    ++checked;
  }
  EXPECT_GT(checked, 5);  // the RocksDB directory, its WAL, MANIFEST, ..., the layer file
}

// Starts the binary with `args`; returns its wait status (or -1) and its stderr.
std::pair<int, std::string> RunToExit(const std::string& dir, const std::vector<std::string>& args) {
  std::vector<std::string> argv = {BuildDir() + "/service/kvsidecar", "--listen=127.0.0.1:0",
                                   "--admin_listen=127.0.0.1:0", "--data_dir=" + dir + "/data"};
  argv.insert(argv.end(), args.begin(), args.end());
  auto process = ChildProcess::Spawn(argv, dir, "kvsidecar");
  if (!process.ok()) return {-1, process.status().ToString()};
  const int status = (*process)->Wait(absl::Seconds(30));
  if (status == -1) (*process)->Stop(SIGKILL, absl::Seconds(5));
  return {status, (*process)->Stderr()};
}

TEST(DurabilityE2eTest, AnAdminTokenEqualToATenantTokenStopsTheStart) {
  const ScopedDir scoped;
  const std::string& dir = scoped.path;
  WriteFile(dir + "/tokens.yaml", "team-a: token-aaaa\nteam-b: shared-secret\n", 0600);
  WriteFile(dir + "/admin.token", "shared-secret\n", 0600);
  const auto [status, err] = RunToExit(dir, {"--tenant_tokens_file=" + dir + "/tokens.yaml",
                                             "--admin_token_file=" + dir + "/admin.token"});
  ASSERT_TRUE(WIFEXITED(status)) << status << err;
  EXPECT_EQ(WEXITSTATUS(status), 2) << err;
  EXPECT_THAT(err, HasSubstr("the admin token"));
  EXPECT_THAT(err, HasSubstr("equals the token of tenant \"team-b\""));
  EXPECT_THAT(err, ::testing::Not(HasSubstr("shared-secret"))) << "the secret is not printed";
}

TEST(DurabilityE2eTest, TokenFilesReadableByOthersAreWarnedAbout) {
  const ScopedDir scoped;
  const std::string& dir = scoped.path;
  WriteFile(dir + "/tokens.yaml", "team-a: token-aaaa\n", 0644);
  WriteFile(dir + "/admin.token", "admin-secret\n", 0600);
  ServerProcess::Options options;
  options.extra_args = {"--tenant_tokens_file=" + dir + "/tokens.yaml",
                        "--admin_token_file=" + dir + "/admin.token"};
  auto server = ServerProcess::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string logs = (*server)->Logs();
  EXPECT_THAT(logs, HasSubstr("WARNING token_file_readable_by_others"));
  EXPECT_THAT(logs, HasSubstr(dir + "/tokens.yaml"));
  EXPECT_THAT(logs, HasSubstr("mode=0644"));
  // The owner-only file is not reported.
  EXPECT_THAT(logs, ::testing::Not(HasSubstr("file=" + dir + "/admin.token ")));
}

}  // namespace
}  // namespace kvs_e2e
