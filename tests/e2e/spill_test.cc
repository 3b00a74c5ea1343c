// Spill / Restore end to end against the real server binary: both tiers bit-identical (in place
// and through Export), automatic restore, restart on the same data directory with adoption into
// a new session, SIGKILL in the middle of spills (every sequence afterwards either restores
// bit-identical or is reported missing/lost, never served corrupted), and the faults: unknown
// sequence, bad target, full host tier, unopenable disk tier (the server keeps serving); and
// Admin.ListSpilled over live, orphaned and lost copies.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvsidecar/client.h"
#include "kvsidecar/v1/sidecar.grpc.pb.h"
#include "tests/e2e/e2e_util.h"

namespace kvs_e2e {
namespace {

using ::testing::HasSubstr;

constexpr char kTenant[] = "e2e";

// A temporary directory removed when the test ends, however it ends.
struct ScopedDir {
  ScopedDir() : path(MakeTempDir("kvs-e2e-spill-")) {}
  ~ScopedDir() {
    if (!path.empty()) std::filesystem::remove_all(path);
  }
  const std::string path;
};

std::unique_ptr<kvsidecar::Session> Attach(kvsidecar::Client& client, const v1::ModelLayout& layout,
                                           int num_blocks) {
  auto session = client.Attach(layout, kTenant, num_blocks, /*lease_ms=*/30000);
  EXPECT_TRUE(session.ok()) << session.status();
  return session.ok() ? std::move(*session) : nullptr;
}

absl::StatusOr<v1::SpillResponse> Spill(kvsidecar::Session& session, const std::string& seq,
                                        v1::Tier target) {
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

// A sequence of `tokens` PatternRow tokens under `seed`, compressed by KeyDiff to `budget`.
std::string MakeSequence(kvsidecar::Session& session, const std::string& id, int tokens, int budget,
                         uint64_t seed) {
  auto created = session.CreateSequence(KeyDiffPolicy(), MakeBudget(budget), id);
  EXPECT_TRUE(created.ok()) << created.status();
  auto committed = WriteTokens(session, id, tokens, seed, /*compress_if_over_budget=*/true);
  EXPECT_TRUE(committed.ok()) << committed.status();
  return id;
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
  EXPECT_TRUE(a.payload == b.payload) << "export payloads differ";
}

TEST(SpillE2eTest, BothTiersRoundTripBitIdentical) {
  auto server = ServerProcess::Start();
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = (*server)->Connect();
  ASSERT_TRUE(client.ok());
  const v1::DType dtypes[] = {v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16, v1::DTYPE_FLOAT32};
  for (v1::DType dtype : dtypes) {
    SCOPED_TRACE(v1::DType_Name(dtype));
    const v1::ModelLayout layout = MakeLayout(3, 2, 4, 32, dtype);
    auto session = Attach(**client, layout, 256);
    ASSERT_NE(session, nullptr);
    const std::string seq = MakeSequence(*session, "s", 120, 64, 11);
    const Snapshot before = Take(*session, seq, 11);

    for (v1::Tier tier : {v1::TIER_HOST, v1::TIER_DISK}) {
      auto spilled = Spill(*session, seq, tier);
      ASSERT_TRUE(spilled.ok()) << spilled.status() << (*server)->Logs();
      EXPECT_EQ(spilled->tier(), tier);
      EXPECT_GT(spilled->bytes(), 0u);
      auto restored = Restore(*session, seq);
      ASSERT_TRUE(restored.ok()) << restored.status();
      EXPECT_EQ(restored->tier(), tier);
      EXPECT_EQ(restored->bytes(), spilled->bytes());
      ExpectSame(before, Take(*session, seq, 11));
      // Automatic restore: Export (through its GetLayout) on a spilled sequence.
      ASSERT_TRUE(Spill(*session, seq, tier).ok());
      ExpectSame(before, Take(*session, seq, 11));
    }
    // Restoring a sequence in the arena is a no-op.
    auto again = Restore(*session, seq);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->tier(), v1::TIER_ARENA);
    ASSERT_TRUE(session->Detach().ok());
  }
}

TEST(SpillE2eTest, BadRequestsAndFullHostTier) {
  ServerProcess::Options options;
  options.extra_args = {"--host_tier_bytes=4096"};
  auto server = ServerProcess::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = (*server)->Connect();
  ASSERT_TRUE(client.ok());
  auto session = Attach(**client, MakeLayout(2, 2, 2, 64, v1::DTYPE_FLOAT32), 64);
  ASSERT_NE(session, nullptr);
  const std::string seq = MakeSequence(*session, "s", 40, 40, 3);

  auto unknown = Spill(*session, "nope", v1::TIER_DISK);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Restore(*session, "nope").status().code(), absl::StatusCode::kNotFound);
  auto bad_target = Spill(*session, seq, v1::TIER_ARENA);
  EXPECT_EQ(bad_target.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(MessageOf(bad_target.status()), HasSubstr("target"));
  v1::SpillRequest no_id;
  no_id.set_target(v1::TIER_HOST);
  auto missing = session->Spill(no_id);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(MessageOf(missing.status()), HasSubstr("sequence_id"));
  auto full = Spill(*session, seq, v1::TIER_HOST);
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(MessageOf(full.status()), HasSubstr("host_tier_bytes"));
  // Nothing changed; the disk tier still takes it.
  ASSERT_TRUE(VerifySequence(*session, seq, 3).ok());
  ASSERT_TRUE(Spill(*session, seq, v1::TIER_DISK).ok());
  ASSERT_TRUE(VerifySequence(*session, seq, 3).ok());
}

// A tier call with a bad parameter and a session that does not exist answers the parameter's
// INVALID_ARGUMENT, as it always has (the session is looked up once, but its NOT_FOUND is answered
// only after the parameters are checked); with good parameters, the session's NOT_FOUND.
TEST(SpillE2eTest, ABadParameterIsAnsweredBeforeAMissingSession) {
  auto server = ServerProcess::Start({});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = v1::Sidecar::NewStub(
      grpc::CreateChannel((*server)->data_target(), grpc::InsecureChannelCredentials()));
  const std::string missing(32, '0');
  auto expect = [](const grpc::Status& status, grpc::StatusCode code, const std::string& text,
                   const char* what) {
    EXPECT_EQ(status.error_code(), code) << what << ": " << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr(text)) << what;
  };
#define KVS_CALL(Method, request)                      \
  [&] {                                                \
    grpc::ClientContext context;                       \
    v1::Method##Response response;                     \
    return stub->Method(&context, request, &response); \
  }()
  v1::SpillRequest spill;
  spill.set_session_id(missing);
  spill.set_sequence_id("s");
  spill.set_target(v1::TIER_ARENA);
  expect(KVS_CALL(Spill, spill), grpc::StatusCode::INVALID_ARGUMENT, "target", "Spill");
  spill.set_target(v1::TIER_HOST);
  expect(KVS_CALL(Spill, spill), grpc::StatusCode::NOT_FOUND, missing, "Spill(good)");
  v1::PublishRequest publish;
  publish.set_session_id(missing);
  publish.set_sequence_id("s");
  publish.set_prefix_key("not-a-key");
  expect(KVS_CALL(Publish, publish), grpc::StatusCode::INVALID_ARGUMENT, "prefix_key", "Publish");
  publish.set_prefix_key(std::string(64, 'a'));
  publish.set_query_window(-1);
  expect(KVS_CALL(Publish, publish), grpc::StatusCode::INVALID_ARGUMENT, "query_window",
         "Publish(query_window)");
  publish.set_query_window(0);
  expect(KVS_CALL(Publish, publish), grpc::StatusCode::NOT_FOUND, missing, "Publish(good)");
  v1::UnpublishRequest unpublish;
  unpublish.set_session_id(missing);
  unpublish.set_prefix_key("not-a-key");
  expect(KVS_CALL(Unpublish, unpublish), grpc::StatusCode::INVALID_ARGUMENT, "prefix_key",
         "Unpublish");
  unpublish.set_prefix_key(std::string(64, 'a'));
  expect(KVS_CALL(Unpublish, unpublish), grpc::StatusCode::NOT_FOUND, missing, "Unpublish(good)");
  v1::RestoreRequest restore;
  restore.set_session_id(missing);
  restore.set_sequence_id("s");
  restore.set_from_session_id(missing);
  restore.set_adopt_any_session(true);
  expect(KVS_CALL(Restore, restore), grpc::StatusCode::INVALID_ARGUMENT, "adopt_any_session",
         "Restore");
  restore.clear_from_session_id();
  expect(KVS_CALL(Restore, restore), grpc::StatusCode::NOT_FOUND, missing,
         "Restore(adopt_any_session)");
#undef KVS_CALL
}

TEST(SpillE2eTest, UnopenableDiskTierKeepsTheServerServing) {
  const ScopedDir scoped;
  const std::string& dir = scoped.path;
  ASSERT_FALSE(dir.empty());
  std::filesystem::create_directories(dir + "/data");
  std::ofstream(dir + "/data/rocksdb") << "not a directory";
  ServerProcess::Options options;
  options.extra_args = {"--data_dir=" + dir + "/data"};
  auto server = ServerProcess::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = (*server)->Connect();
  ASSERT_TRUE(client.ok());
  auto session = Attach(**client, MakeLayout(2, 2, 2, 32, v1::DTYPE_FLOAT16), 64);
  ASSERT_NE(session, nullptr);
  const std::string seq = MakeSequence(*session, "s", 30, 30, 5);
  auto disk = Spill(*session, seq, v1::TIER_DISK);
  EXPECT_EQ(disk.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(MessageOf(disk.status()), HasSubstr("rocksdb"));
  EXPECT_THAT((*server)->Logs(), HasSubstr("disk_tier_unavailable"));
  ASSERT_TRUE(Spill(*session, seq, v1::TIER_HOST).ok());
  ASSERT_TRUE(VerifySequence(*session, seq, 5).ok());
}

TEST(SpillE2eTest, RestartReadoptsDiskCopies) {
  const ScopedDir scoped;
  const std::string& dir = scoped.path;
  ASSERT_FALSE(dir.empty());
  ServerProcess::Options options;
  options.extra_args = {"--data_dir=" + dir + "/data"};
  const v1::ModelLayout layout = MakeLayout(4, 2, 4, 64, v1::DTYPE_BFLOAT16);
  std::string old_session;
  std::vector<Snapshot> before;
  {
    auto server = ServerProcess::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    auto client = (*server)->Connect();
    ASSERT_TRUE(client.ok());
    auto session = Attach(**client, layout, 256);
    ASSERT_NE(session, nullptr);
    old_session = session->session_id();
    for (int i = 0; i < 3; ++i) {
      const std::string id = "seq" + std::to_string(i);
      MakeSequence(*session, id, 100 + 20 * i, 80, 100 + i);
      before.push_back(Take(*session, id, 100 + i));
      ASSERT_TRUE(Spill(*session, id, i == 2 ? v1::TIER_HOST : v1::TIER_DISK).ok());
    }
    // SIGTERM: a clean shutdown; the session dies with the server.
    EXPECT_EQ((*server)->process().Stop(SIGTERM, absl::Seconds(20)), 0);
  }
  auto server = ServerProcess::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_THAT((*server)->Logs(), HasSubstr("spilled_sequences"));
  auto client = (*server)->Connect();
  ASSERT_TRUE(client.ok());
  auto session = Attach(**client, layout, 256);
  ASSERT_NE(session, nullptr);
  for (int i = 0; i < 2; ++i) {
    const std::string id = "seq" + std::to_string(i);
    auto restored = Restore(*session, id, old_session);
    ASSERT_TRUE(restored.ok()) << restored.status() << (*server)->Logs();
    EXPECT_EQ(restored->tier(), v1::TIER_DISK);
    ExpectSame(before[i], Take(*session, id, 100 + i));
    // Adopted once: the copy is gone.
    EXPECT_EQ(Restore(*session, id, old_session).status().code(), absl::StatusCode::kNotFound);
  }
  // Host copies do not survive a restart.
  EXPECT_EQ(Restore(*session, "seq2", old_session).status().code(), absl::StatusCode::kNotFound);
}

// The layer files of the disk tier under `data_dir`, oldest generation first (spill order).
std::vector<std::string> LayerFiles(const std::string& data_dir) {
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(data_dir + "/rocksdb/kvs-layers")) {
    if (entry.path().extension() == ".kvl") files.push_back(entry.path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

const v1::SpilledCopy* FindCopy(const v1::ListSpilledResponse& listed, const std::string& seq) {
  for (const v1::SpilledCopy& copy : listed.copies()) {
    if (copy.sequence_id() == seq) return &copy;
  }
  return nullptr;
}

// Admin.ListSpilled: live copies, then after a restart the orphans of the ended session, a copy
// whose layer file was cut short (lost at start) and one corrupted while the server ran (lost on
// the Restore that found it); filters and bad input.
TEST(SpillE2eTest, AdminListsOrphanedAndLostCopies) {
  const ScopedDir scoped;
  const std::string& dir = scoped.path;
  ASSERT_FALSE(dir.empty());
  ServerProcess::Options options;
  options.extra_args = {"--data_dir=" + dir + "/data"};
  const v1::ModelLayout layout = MakeLayout(4, 2, 4, 64, v1::DTYPE_BFLOAT16);
  std::string old_session;
  const int64_t start_ms = absl::ToUnixMillis(absl::Now());
  {
    auto server = ServerProcess::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    auto client = (*server)->Connect();
    ASSERT_TRUE(client.ok());
    auto admin = (*server)->ConnectAdmin();
    ASSERT_TRUE(admin.ok());
    auto session = Attach(**client, layout, 256);
    ASSERT_NE(session, nullptr);
    old_session = session->session_id();
    for (int i = 0; i < 3; ++i) {
      const std::string id = "seq" + std::to_string(i);
      MakeSequence(*session, id, 100 + 20 * i, 200, 300 + i);
      ASSERT_TRUE(Spill(*session, id, i == 2 ? v1::TIER_HOST : v1::TIER_DISK).ok());
    }
    auto listed = (*admin)->ListSpilled();
    ASSERT_TRUE(listed.ok()) << listed.status();
    ASSERT_EQ(listed->copies_size(), 3) << listed->DebugString();
    for (const v1::SpilledCopy& copy : listed->copies()) {
      EXPECT_EQ(copy.tenant(), kTenant);
      EXPECT_EQ(copy.session_id(), old_session);
      EXPECT_TRUE(copy.session_attached());
      EXPECT_TRUE(copy.lost().empty());
      EXPECT_GT(copy.bytes(), 100u * 4 * 2 * 2 * 64 * 2);  // at least its K/V bytes
      EXPECT_GE(copy.spilled_unix_ms(), start_ms);
    }
    EXPECT_EQ(FindCopy(*listed, "seq0")->tier(), v1::TIER_DISK);
    EXPECT_EQ(FindCopy(*listed, "seq2")->tier(), v1::TIER_HOST);
    EXPECT_EQ((*admin)->ListSpilled("other-tenant")->copies_size(), 0);
    EXPECT_EQ((*admin)->ListSpilled(kTenant, old_session)->copies_size(), 3);
    EXPECT_EQ((*admin)->ListSpilled("", "no-such-session")->copies_size(), 0);
    EXPECT_EQ((*admin)->ListSpilled("bad\x01tenant").status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ((*server)->process().Stop(SIGTERM, absl::Seconds(20)), 0);
  }
  // Cut seq1's layer file short while the server is down.
  std::vector<std::string> files = LayerFiles(dir + "/data");
  ASSERT_EQ(files.size(), 2u);
  std::filesystem::resize_file(files[1], 1000);
  auto server = ServerProcess::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = (*server)->Connect();
  ASSERT_TRUE(client.ok());
  auto admin = (*server)->ConnectAdmin();
  ASSERT_TRUE(admin.ok());
  auto listed = (*admin)->ListSpilled();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->copies_size(), 2)
      << "the host copy does not survive a restart; " << listed->DebugString();
  const v1::SpilledCopy* orphan = FindCopy(*listed, "seq0");
  ASSERT_NE(orphan, nullptr);
  EXPECT_EQ(orphan->session_id(), old_session);
  EXPECT_FALSE(orphan->session_attached()) << "its session ended with the old server";
  EXPECT_EQ(orphan->tier(), v1::TIER_DISK);
  EXPECT_TRUE(orphan->lost().empty()) << orphan->lost();
  const v1::SpilledCopy* cut = FindCopy(*listed, "seq1");
  ASSERT_NE(cut, nullptr);
  EXPECT_THAT(cut->lost(), HasSubstr("has 1000 bytes")) << cut->lost();
  auto session = Attach(**client, layout, 256);
  ASSERT_NE(session, nullptr);
  EXPECT_EQ(Restore(*session, "seq1", old_session).status().code(), absl::StatusCode::kDataLoss);
  // Corrupt seq0's layer file under the running server: its adoption finds it and refuses it.
  {
    std::fstream file(files[0], std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(file.good());
    file.seekg(500);
    char c = 0;
    file.get(c);
    file.seekp(500);
    file.put(static_cast<char>(c ^ 0x40));
  }
  auto refused = Restore(*session, "seq0", old_session);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss) << refused.status();
  listed = (*admin)->ListSpilled();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_NE(FindCopy(*listed, "seq0"), nullptr);
  EXPECT_THAT(FindCopy(*listed, "seq0")->lost(), HasSubstr("fails its checksum"));
  // The server keeps serving: a fresh spill of the new session is listed as attached.
  MakeSequence(*session, "fresh", 64, 200, 7);
  ASSERT_TRUE(Spill(*session, "fresh", v1::TIER_DISK).ok());
  listed = (*admin)->ListSpilled(kTenant, session->session_id());
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->copies_size(), 1);
  EXPECT_TRUE(listed->copies(0).session_attached());
  EXPECT_TRUE(listed->copies(0).lost().empty());
}

// --spill_on_pressure=true: a Reserve that finds the session's arena full spills the least
// recently used other sequence to the host tier (listed by Admin.ListSpilled), and the next use
// of that sequence restores it bit-identical. Without the flag the same Reserve is refused.
TEST(SpillE2eTest, SpillOnPressureDemotesTheLeastRecentlyUsedSequence) {
  const v1::ModelLayout layout = MakeLayout(4, 2, 4, 64, v1::DTYPE_BFLOAT16);
  // 96 tokens = 6 blocks a layer = 24 blocks; the arena holds 40: not two such sequences.
  for (const bool enabled : {false, true}) {
    SCOPED_TRACE(enabled ? "--spill_on_pressure=true" : "default (off)");
    ServerProcess::Options options;
    if (enabled) options.extra_args = {"--spill_on_pressure=true"};
    auto server = ServerProcess::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    auto client = (*server)->Connect();
    ASSERT_TRUE(client.ok());
    auto admin = (*server)->ConnectAdmin();
    ASSERT_TRUE(admin.ok());
    auto config = (*admin)->GetConfig();
    ASSERT_TRUE(config.ok());
    EXPECT_THAT(config->effective_config_yaml(),
                HasSubstr(enabled ? "spill_on_pressure: true" : "spill_on_pressure: false"));
    auto session = Attach(**client, layout, 40);
    ASSERT_NE(session, nullptr);
    MakeSequence(*session, "old", 96, 128, 41);
    const Snapshot before = Take(*session, "old", 41);
    ASSERT_TRUE(session->CreateSequence(KeyDiffPolicy(), MakeBudget(128), "new").ok());
    auto written = WriteTokens(*session, "new", 96, 42);
    if (!enabled) {
      EXPECT_EQ(written.status().code(), absl::StatusCode::kResourceExhausted) << written.status();
      EXPECT_TRUE((*admin)->ListSpilled()->copies().empty());
      continue;
    }
    ASSERT_TRUE(written.ok()) << written.status();
    auto listed = (*admin)->ListSpilled();
    ASSERT_TRUE(listed.ok()) << listed.status();
    ASSERT_EQ(listed->copies_size(), 1) << listed->DebugString();
    EXPECT_EQ(listed->copies(0).sequence_id(), "old");
    EXPECT_EQ(listed->copies(0).tier(), v1::TIER_HOST);
    EXPECT_TRUE(listed->copies(0).session_attached());
    auto verified_new = VerifySequence(*session, "new", 42);
    ASSERT_TRUE(verified_new.ok()) << verified_new.status();
    // Make room, then use the spilled sequence: it comes back as it was.
    ASSERT_TRUE(session->ReleaseSequence("new").ok());
    ExpectSame(before, Take(*session, "old", 41));
    EXPECT_TRUE((*admin)->ListSpilled()->copies().empty()) << "restored: the copy is gone";
  }
}

TEST(SpillE2eTest, SigkillDuringSpillsNeverServesCorruptData) {
  const ScopedDir scoped;
  const std::string& dir = scoped.path;
  ASSERT_FALSE(dir.empty());
  ServerProcess::Options options;
  options.extra_args = {"--data_dir=" + dir + "/data"};
  const v1::ModelLayout layout = MakeLayout(4, 4, 4, 64, v1::DTYPE_FLOAT16);
  constexpr int kSequences = 6;
  std::mt19937 gen(2024);
  int restored_total = 0, missing_total = 0;
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    std::string old_session;
    {
      auto server = ServerProcess::Start(options);
      ASSERT_TRUE(server.ok()) << server.status();
      auto client = (*server)->Connect();
      ASSERT_TRUE(client.ok());
      auto session = Attach(**client, layout, 2048);
      ASSERT_NE(session, nullptr);
      old_session = session->session_id();
      for (int i = 0; i < kSequences; ++i) {
        // 256 tokens x 4 layers x 2 x 4 heads x 64 x 2 bytes = 1 MiB of K/V each.
        MakeSequence(*session, absl::StrCat("r", round, "s", i), 256, 256, round * 100 + i);
      }
      // Spill and restore in a loop from another thread until the server dies under it.
      std::thread churn([&] {
        for (int step = 0;; ++step) {
          const std::string id = absl::StrCat("r", round, "s", step % kSequences);
          if (!Spill(*session, id, v1::TIER_DISK).ok()) return;
          if (step % 3 == 0 && !Restore(*session, id).ok()) return;
        }
      });
      std::this_thread::sleep_for(std::chrono::milliseconds(50 + gen() % 400));
      (*server)->process().Stop(SIGKILL, absl::Seconds(10));
      churn.join();
    }
    auto server = ServerProcess::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    auto client = (*server)->Connect();
    ASSERT_TRUE(client.ok());
    auto session = Attach(**client, layout, 2048);
    ASSERT_NE(session, nullptr);
    for (int i = 0; i < kSequences; ++i) {
      const std::string id = absl::StrCat("r", round, "s", i);
      auto restored = Restore(*session, id, old_session);
      if (restored.ok()) {
        // Fully restorable: every row is exactly what was written at its position.
        auto verified = VerifySequence(*session, id, round * 100 + i);
        ASSERT_TRUE(verified.ok()) << id << ": " << verified.status();
        EXPECT_EQ(verified->counts, std::vector<int>(4, 256));
        ++restored_total;
      } else {
        // In the arena when the server died (never spilled or restored last), or reported lost.
        EXPECT_THAT(restored.status().code(),
                    ::testing::AnyOf(absl::StatusCode::kNotFound, absl::StatusCode::kDataLoss))
            << restored.status();
        ++missing_total;
      }
    }
    EXPECT_EQ((*server)->process().Stop(SIGTERM, absl::Seconds(20)), 0);
  }
  std::cout << "after 3 SIGKILLs: " << restored_total << " sequences restored bit-identical, "
            << missing_total << " not on disk\n";
  EXPECT_GT(restored_total, 0) << "the kills all came before any spill finished";
}

}  // namespace
}  // namespace kvs_e2e
