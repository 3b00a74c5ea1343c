// Spill / Restore of whole sequences through KvPool with the real storage tiers (host memory and
// RocksDB in a temporary directory): bit-identical K/V, positions and policy state, automatic
// restore, faults, and re-adoption of disk copies by a new pool on the same directory.
#include "cache/sequence_snapshot.h"

#include <unistd.h>

#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cache/pool.h"
#include "gtest/gtest.h"
#include "storage/tier_manager.h"
#include "tests/cache/cache_test_util.h"

namespace kvs {
namespace {

using testing_util::Append;
using testing_util::Budget;
using testing_util::HashValue;
using testing_util::MakeLayout;
using testing_util::TestPool;

class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "kvs-spill-XXXXXX").string();
    path_ = mkdtemp(pattern.data());
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A pool whose tiers live in `dir` (host capacity `host_bytes`).
struct TieredPool {
  explicit TieredPool(const std::string& dir, uint64_t host_bytes = uint64_t{64} << 20)
      : tiers(storage::TierManager::Open({host_bytes, dir + "/rocksdb", 0})),
        test_pool(Options(tiers.get())) {}
  static PoolOptions Options(SequenceTiers* tiers) {
    PoolOptions options = TestPool::DefaultOptions();
    options.tiers = tiers;
    return options;
  }
  std::unique_ptr<storage::TierManager> tiers;
  TestPool test_pool;
  KvPool& pool() { return test_pool.pool; }
};

// Queries [L][Hq][w][D] for every layer, a pure function of the seed.
AttentionInput Queries(const ModelLayout& layout, int32_t w, uint32_t seed) {
  AttentionInput input;
  input.num_queries = w;
  input.softmax_scale = 0.125f;
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  input.queries.resize(static_cast<size_t>(layout.num_layers) * layout.num_q_heads * w *
                       layout.head_dim);
  for (float& q : input.queries) q = dist(gen);
  return input;
}

struct Observed {
  SequenceLayout layout;
  std::vector<uint8_t> payload;
  std::vector<LayerScores> scores;
};

// Everything a client can see of a sequence: layout with positions, the export payload, and the
// scores its policy would give now (which read the accumulated policy state).
Observed Observe(KvPool& pool, const std::string& session, const std::string& sequence,
                 const ModelLayout& model, bool with_scores) {
  Observed out;
  absl::StatusOr<SequenceLayout> layout = pool.GetLayout(session, sequence, {}, true);
  EXPECT_TRUE(layout.ok()) << layout.status();
  if (!layout.ok()) return out;
  out.layout = *layout;
  uint64_t total = 0;
  for (const LayerLayoutView& l : layout->layers) total += l.count * model.token_bytes();
  out.payload.resize(total);
  EXPECT_TRUE(
      pool.ReadExport(session, sequence, {}, layout->version, 0, absl::MakeSpan(out.payload)).ok());
  if (with_scores) {
    ScoreParams params;
    params.budget_tokens = 8;
    params.attention = Queries(model, 2, 99);
    absl::StatusOr<std::vector<LayerScores>> scores = pool.Score(session, sequence, params);
    EXPECT_TRUE(scores.ok()) << scores.status();
    if (scores.ok()) out.scores = *scores;
  }
  return out;
}

void ExpectSame(const Observed& a, const Observed& b) {
  ASSERT_EQ(a.layout.layers.size(), b.layout.layers.size());
  for (size_t l = 0; l < a.layout.layers.size(); ++l) {
    EXPECT_EQ(a.layout.layers[l].count, b.layout.layers[l].count) << "layer " << l;
    EXPECT_EQ(a.layout.layers[l].positions, b.layout.layers[l].positions) << "layer " << l;
    EXPECT_EQ(a.layout.layers[l].budget, b.layout.layers[l].budget) << "layer " << l;
  }
  EXPECT_EQ(a.layout.next_position, b.layout.next_position);
  EXPECT_EQ(a.layout.tokens_appended, b.layout.tokens_appended);
  EXPECT_TRUE(a.payload == b.payload) << "export payloads differ";
  ASSERT_EQ(a.scores.size(), b.scores.size());
  for (size_t l = 0; l < a.scores.size(); ++l) {
    EXPECT_EQ(a.scores[l].kept_slots, b.scores[l].kept_slots) << "layer " << l;
    ASSERT_EQ(a.scores[l].scores.size(), b.scores[l].scores.size());
    EXPECT_EQ(0, std::memcmp(a.scores[l].scores.data(), b.scores[l].scores.data(),
                             a.scores[l].scores.size() * sizeof(float)))
        << "scores of layer " << l << " differ";
  }
}

PolicyConfig Named(const char* name) {
  PolicyConfig config;
  config.name = name;
  return config;
}

// Random layouts and dtypes, both tiers, several policies with state (H2O's accumulated
// attention, D2O's thresholds and frozen budgets, CAKE's indicator): a twin sequence that is
// never spilled sees the same calls, and the two must stay identical after restore, through a
// further compression and a decode step.
TEST(SpillRestoreTest, RoundTripsAreBitIdenticalOnBothTiers) {
  TempDir dir;
  TieredPool tiered(dir.path());
  KvPool& pool = tiered.pool();
  std::mt19937 gen(1234);
  const DType dtypes[] = {DType::kFloat16, DType::kBFloat16, DType::kFloat32};
  // KNorm: a spilled copy does not carry the key norms its commits took, so the restored
  // sequence reads its keys where its twin reads the kept norms; both must keep the same tokens.
  const char* policies[] = {kPolicyH2o, kPolicyD2o, kPolicyCake, kPolicyKeyDiff, "knorm"};
  constexpr int kPolicies = sizeof(policies) / sizeof(policies[0]);
  for (int trial = 0; trial < 15; ++trial) {
    SCOPED_TRACE(absl::StrCat("trial ", trial));
    ModelLayout layout = MakeLayout(1 + gen() % 4, 1 + gen() % 3, 8 << (gen() % 3),
                                    dtypes[trial % 3], trial % 2 == 0 ? 4 : 16);
    layout.num_q_heads = layout.num_kv_heads * (1 + gen() % 2);
    const StorageTier tier = trial % 2 == 0 ? StorageTier::kHost : StorageTier::kDisk;
    const std::string session = tiered.test_pool.Attach(layout, 400);
    const PolicyConfig policy = Named(policies[trial % kPolicies]);
    const std::string a = tiered.test_pool.Create(session, policy, Budget(0), "a");
    const std::string b = tiered.test_pool.Create(session, policy, Budget(0), "b");
    const int32_t prompt = 20 + gen() % 40;
    const AttentionInput attention = Queries(layout, 4, trial);
    for (const std::string& id : {a, b}) {
      ASSERT_TRUE(Append(pool, session, id, prompt, layout, HashValue).ok());
      CompressParams params;
      params.budget_tokens = prompt / 2;
      params.attention = attention;
      ASSERT_TRUE(pool.Compress(session, id, params).ok());
    }
    const Observed before = Observe(pool, session, a, layout, true);
    const int32_t free_before = tiered.test_pool.FreeBlocks(session);

    absl::StatusOr<SpillResult> spilled = pool.Spill(session, a, tier);
    ASSERT_TRUE(spilled.ok()) << spilled.status();
    EXPECT_EQ(spilled->tier, tier);
    EXPECT_GT(spilled->bytes, 0u);
    EXPECT_GT(tiered.test_pool.FreeBlocks(session), free_before) << "spill frees the blocks";
    bool listed = false;
    for (const SequenceInfo& info : pool.ListSequences(session)) {
      if (info.sequence_id == a) {
        listed = true;
        EXPECT_EQ(info.tier, tier);
        EXPECT_EQ(tier == StorageTier::kHost ? info.host_bytes : info.disk_bytes, spilled->bytes);
      }
    }
    EXPECT_TRUE(listed);

    absl::StatusOr<SpillResult> restored = pool.Restore(session, a);
    ASSERT_TRUE(restored.ok()) << restored.status();
    EXPECT_EQ(restored->tier, tier);
    EXPECT_EQ(restored->bytes, spilled->bytes);
    ExpectSame(before, Observe(pool, session, a, layout, true));
    EXPECT_FALSE(tiered.tiers->Find(SpillKey{"default", session, a}).has_value())
        << "the spilled copy is deleted once restored";

    // Behaves exactly as before: the same compression and decode step on both.
    for (const std::string& id : {a, b}) {
      CompressParams params;
      params.budget_tokens = prompt / 3;
      params.attention = Queries(layout, 3, trial + 100);
      ASSERT_TRUE(pool.Compress(session, id, params).ok());
      DecodeItem item;
      item.session_id = session;
      item.sequence_id = id;
      item.attention = Queries(layout, 1, trial + 200);
      item.inline_kv = testing_util::BuildPayload(
          layout,
          [&] {
            std::vector<int32_t> all(layout.num_layers);
            for (int32_t l = 0; l < layout.num_layers; ++l) all[l] = l;
            return all;
          }(),
          {prompt + 5}, HashValue);
      ASSERT_TRUE(pool.DecodeStep({item}).ok());
    }
    ExpectSame(Observe(pool, session, b, layout, true), Observe(pool, session, a, layout, true));
    ASSERT_TRUE(pool.Detach(session).ok());
  }
}

TEST(SpillRestoreTest, DataPlaneCallsRestoreAutomatically) {
  TempDir dir;
  TieredPool tiered(dir.path());
  KvPool& pool = tiered.pool();
  const ModelLayout layout = MakeLayout(2, 2, 16, DType::kFloat16, 16);
  const std::string session = tiered.test_pool.Attach(layout, 64);
  const std::string seq = tiered.test_pool.Create(session, Named(kPolicyStreamingLlm), Budget(0));
  ASSERT_TRUE(Append(pool, session, seq, 40, layout, HashValue).ok());
  ASSERT_TRUE(pool.Spill(session, seq, StorageTier::kDisk).ok());
  // Reserve on the spilled sequence restores it and proceeds.
  ASSERT_TRUE(Append(pool, session, seq, 3, layout, HashValue).ok());
  EXPECT_TRUE(testing_util::ContentsMatch(pool, session, seq, layout, HashValue));
  absl::StatusOr<SequenceLayout> view = pool.GetLayout(session, seq, {}, false);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->layers[0].count, 43);
  // GetLayout restores too; a second Restore is a no-op.
  ASSERT_TRUE(pool.Spill(session, seq, StorageTier::kHost).ok());
  ASSERT_TRUE(pool.GetLayout(session, seq, {}, false).ok());
  absl::StatusOr<SpillResult> again = pool.Restore(session, seq);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->tier, StorageTier::kArena);
  // Moving between tiers, then releasing a spilled sequence drops its copy.
  ASSERT_TRUE(pool.Spill(session, seq, StorageTier::kHost).ok());
  absl::StatusOr<SpillResult> moved = pool.Spill(session, seq, StorageTier::kDisk);
  ASSERT_TRUE(moved.ok());
  EXPECT_EQ(moved->tier, StorageTier::kDisk);
  EXPECT_EQ(tiered.tiers->Find(SpillKey{"default", session, seq})->tier, StorageTier::kDisk);
  absl::StatusOr<ReleaseCounts> released = pool.ReleaseSequence(session, seq);
  ASSERT_TRUE(released.ok());
  EXPECT_TRUE(tiered.tiers->List().empty());
  EXPECT_EQ(pool.GetLayout(session, seq, {}, false).status().code(), absl::StatusCode::kNotFound);
}

TEST(SpillRestoreTest, Faults) {
  TempDir dir;
  TieredPool tiered(dir.path(), /*host_bytes=*/4096);
  KvPool& pool = tiered.pool();
  const ModelLayout layout = MakeLayout(2, 2, 16, DType::kFloat32, 16);
  const std::string session = tiered.test_pool.Attach(layout, 16);
  const std::string seq = tiered.test_pool.Create(session, Named(kPolicyStreamingLlm), Budget(0));
  ASSERT_TRUE(Append(pool, session, seq, 40, layout, HashValue).ok());

  EXPECT_EQ(pool.Spill(session, "nope", StorageTier::kDisk).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(pool.Restore(session, "nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(pool.Spill(session, seq, StorageTier::kArena).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Host tier full: nothing changes.
  absl::Status full = pool.Spill(session, seq, StorageTier::kHost).status();
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_TRUE(testing_util::ContentsMatch(pool, session, seq, layout, HashValue));
  // A pending reservation blocks the spill.
  absl::StatusOr<Reservation> pending = pool.Reserve(session, seq, 1, {}, {});
  ASSERT_TRUE(pending.ok());
  EXPECT_EQ(pool.Spill(session, seq, StorageTier::kDisk).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(pool.CancelReservation(session, seq, pending->reservation_id).ok());

  // Restore into a full arena: RESOURCE_EXHAUSTED and the spilled copy stays.
  ASSERT_TRUE(pool.Spill(session, seq, StorageTier::kDisk).ok());
  const std::string filler =
      tiered.test_pool.Create(session, Named(kPolicyStreamingLlm), Budget(0));
  ASSERT_TRUE(Append(pool, session, filler, 100, layout, HashValue).ok());
  absl::Status no_room = pool.Restore(session, seq).status();
  EXPECT_EQ(no_room.code(), absl::StatusCode::kResourceExhausted) << no_room;
  EXPECT_EQ(pool.GetLayout(session, seq, {}, false).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(tiered.tiers->Find(SpillKey{"default", session, seq}).has_value());
  ASSERT_TRUE(pool.ReleaseSequence(session, filler).ok());
  ASSERT_TRUE(pool.Restore(session, seq).ok());
  EXPECT_TRUE(testing_util::ContentsMatch(pool, session, seq, layout, HashValue));
}

TEST(SpillRestoreTest, DiskCopiesOutliveTheSessionAndThePool) {
  TempDir dir;
  const ModelLayout layout = MakeLayout(3, 2, 32, DType::kBFloat16, 16);
  std::string old_session;
  Observed before;
  {
    TieredPool tiered(dir.path());
    KvPool& pool = tiered.pool();
    old_session = tiered.test_pool.Attach(layout, 64);
    for (const char* id : {"disk", "host"}) {
      tiered.test_pool.Create(old_session, Named(kPolicyH2o), Budget(0), id);
      ASSERT_TRUE(Append(pool, old_session, id, 50, layout, HashValue).ok());
      CompressParams params;
      params.budget_tokens = 30;
      params.attention = Queries(layout, 4, 7);
      ASSERT_TRUE(pool.Compress(old_session, id, params).ok());
    }
    before = Observe(pool, old_session, "disk", layout, true);
    ASSERT_TRUE(pool.Spill(old_session, "disk", StorageTier::kDisk).ok());
    ASSERT_TRUE(pool.Spill(old_session, "host", StorageTier::kHost).ok());
  }  // the pool and its tiers go away, as in a restart
  TieredPool tiered(dir.path());
  KvPool& pool = tiered.pool();
  const std::vector<SpilledInfo> listed = pool.ListSpilled();
  ASSERT_EQ(listed.size(), 1u) << "host copies do not survive, disk copies do";
  EXPECT_EQ(listed[0].key, (SpillKey{"default", old_session, "disk"}));
  EXPECT_EQ(listed[0].tier, StorageTier::kDisk);
  EXPECT_TRUE(listed[0].lost.empty());

  const std::string session = tiered.test_pool.Attach(layout, 64);
  EXPECT_EQ(pool.Restore(session, "host", old_session).status().code(),
            absl::StatusCode::kNotFound);
  // Another tenant cannot see it; another layout cannot take it.
  AttachParams other;
  other.layout = layout;
  other.num_blocks = 64;
  other.tenant = "other";
  const std::string other_tenant = pool.Attach(other)->session_id;
  EXPECT_EQ(pool.Restore(other_tenant, "disk", old_session).status().code(),
            absl::StatusCode::kNotFound);
  const std::string wide = tiered.test_pool.Attach(MakeLayout(3, 4, 32, DType::kBFloat16, 16), 64);
  EXPECT_EQ(pool.Restore(wide, "disk", old_session).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // A live session's copies are restored through it.
  EXPECT_EQ(pool.Restore(session, "disk", wide).status().code(),
            absl::StatusCode::kFailedPrecondition);

  absl::StatusOr<SpillResult> adopted = pool.Restore(session, "disk", old_session);
  ASSERT_TRUE(adopted.ok()) << adopted.status();
  EXPECT_EQ(adopted->tier, StorageTier::kDisk);
  ExpectSame(before, Observe(pool, session, "disk", layout, true));
  EXPECT_TRUE(pool.ListSpilled().empty());
}

// Restore checks the tenant's arena quota before anything moves: RESOURCE_EXHAUSTED naming the
// quota, and the copy stays where it was (restorable once the quota allows).
TEST(SpillRestoreTest, RestoreChecksTheTenantArenaQuota) {
  TempDir dir;
  TieredPool tiered(dir.path());
  KvPool& pool = tiered.pool();
  const ModelLayout layout = MakeLayout(2, 2, 32, DType::kFloat16, 16);
  const std::string session = tiered.test_pool.Attach(layout, 64);
  tiered.test_pool.Create(session, Named(kPolicyH2o), Budget(0), "big");
  tiered.test_pool.Create(session, Named(kPolicyH2o), Budget(0), "small");
  ASSERT_TRUE(Append(pool, session, "big", 160, layout, HashValue).ok());  // 10 blocks a layer
  ASSERT_TRUE(Append(pool, session, "small", 16, layout, HashValue).ok());
  const Observed before = Observe(pool, session, "big", layout, false);
  ASSERT_TRUE(pool.Spill(session, "big", StorageTier::kDisk).ok());
  // Room for what "small" holds and a little more, not for "big" again.
  TenantQuota quota;
  quota.arena_bytes = 8 * layout.block_bytes();
  pool.SetTenantQuota("default", quota);
  absl::Status refused = pool.Restore(session, "big").status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("arena_bytes"), std::string::npos) << refused;
  std::optional<SpilledInfo> copy = tiered.tiers->Find({"default", session, "big"});
  ASSERT_TRUE(copy.has_value()) << "the copy stays";
  EXPECT_EQ(copy->tier, StorageTier::kDisk);
  // Adoption by another session is held to the same quota.
  const std::string adopter = tiered.test_pool.Attach(layout, 64);
  ASSERT_TRUE(pool.Detach(session).ok());
  refused = pool.Restore(adopter, "big", session).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  ASSERT_TRUE(tiered.tiers->Find({"default", session, "big"}).has_value());
  // Once the quota allows it, the same copy comes back intact.
  pool.SetTenantQuota("default", TenantQuota{});
  absl::StatusOr<SpillResult> restored = pool.Restore(adopter, "big", session);
  ASSERT_TRUE(restored.ok()) << restored.status();
  ExpectSame(before, Observe(pool, adopter, "big", layout, false));
}

// The automatic restore a data-plane call makes is held to the same quota: refused with the
// copy kept, and served once the quota allows it.
TEST(SpillRestoreTest, AutomaticRestoreChecksTheTenantArenaQuota) {
  TempDir dir;
  TieredPool tiered(dir.path());
  KvPool& pool = tiered.pool();
  const ModelLayout layout = MakeLayout(2, 2, 32, DType::kFloat16, 16);
  const std::string session = tiered.test_pool.Attach(layout, 64);
  tiered.test_pool.Create(session, Named(kPolicyH2o), Budget(0), "big");
  tiered.test_pool.Create(session, Named(kPolicyH2o), Budget(0), "small");
  ASSERT_TRUE(Append(pool, session, "big", 160, layout, HashValue).ok());  // 10 blocks a layer
  ASSERT_TRUE(Append(pool, session, "small", 16, layout, HashValue).ok());
  const Observed before = Observe(pool, session, "big", layout, false);
  ASSERT_TRUE(pool.Spill(session, "big", StorageTier::kHost).ok());
  TenantQuota quota;
  quota.arena_bytes = 8 * layout.block_bytes();
  pool.SetTenantQuota("default", quota);
  absl::Status refused = pool.GetLayout(session, "big", {}, false).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("arena_bytes"), std::string::npos) << refused;
  ASSERT_TRUE(tiered.tiers->Find({"default", session, "big"}).has_value()) << "the copy stays";
  pool.SetTenantQuota("default", TenantQuota{});
  ExpectSame(before, Observe(pool, session, "big", layout, false));
}

// Two sessions adopting the same copy at the same time: exactly one gets the sequence, the other
// a clear error (ABORTED while the first restores, NOT_FOUND after it erased the copy), never a
// second copy of the sequence.
TEST(SpillRestoreTest, ConcurrentAdoptionsOfOneCopyRestoreItOnce) {
  TempDir dir;
  TieredPool tiered(dir.path());
  KvPool& pool = tiered.pool();
  const ModelLayout layout = MakeLayout(4, 2, 64, DType::kFloat32, 16);
  for (int round = 0; round < 8; ++round) {
    // A disk copy (a detached session's host copies are dropped), large enough that the two
    // restores overlap in most rounds.
    const std::string owner = tiered.test_pool.Attach(layout, 600);
    tiered.test_pool.Create(owner, Named(kPolicyH2o), Budget(0), "shared");
    ASSERT_TRUE(Append(pool, owner, "shared", 2000, layout, HashValue).ok());
    ASSERT_TRUE(pool.Spill(owner, "shared", StorageTier::kDisk).ok());
    ASSERT_TRUE(pool.Detach(owner).ok());
    const std::string a = tiered.test_pool.Attach(layout, 600);
    const std::string b = tiered.test_pool.Attach(layout, 600);
    absl::Status status_a, status_b;
    std::thread thread_a([&] { status_a = pool.Restore(a, "shared", owner).status(); });
    std::thread thread_b([&] { status_b = pool.Restore(b, "shared", owner).status(); });
    thread_a.join();
    thread_b.join();
    ASSERT_NE(status_a.ok(), status_b.ok()) << status_a << " / " << status_b;
    const absl::Status& loser = status_a.ok() ? status_b : status_a;
    EXPECT_TRUE(loser.code() == absl::StatusCode::kAborted ||
                loser.code() == absl::StatusCode::kNotFound)
        << loser;
    const std::string& winner = status_a.ok() ? a : b;
    const std::string& other = status_a.ok() ? b : a;
    EXPECT_TRUE(pool.GetLayout(winner, "shared", {}, false).ok());
    EXPECT_EQ(pool.GetLayout(other, "shared", {}, false).status().code(),
              absl::StatusCode::kNotFound);
    EXPECT_FALSE(tiered.tiers->Find({"default", owner, "shared"}).has_value());
    ASSERT_TRUE(pool.Detach(a).ok());
    ASSERT_TRUE(pool.Detach(b).ok());
  }
}

// PoolOptions::spill_on_pressure: a Reserve that finds the arena full demotes the least recently
// used other sequences to the host tier (and the host tier its oldest copy to disk), keeping every
// tier within its capacity; the demoted sequences come back bit-identical.
TEST(SpillRestoreTest, ArenaPressureDemotesLeastRecentlyUsedSequences) {
  TempDir dir;
  const ModelLayout layout = MakeLayout(1, 2, 16, DType::kFloat32, 16);
  const uint64_t sequence_bytes = 7 * layout.block_bytes();  // 100 tokens = 7 blocks
  // The host tier holds one demoted sequence (its blocks plus metadata), not two.
  auto tiers = storage::TierManager::Open({sequence_bytes + 4096, dir.path() + "/rocksdb", 0});
  PoolOptions options = TieredPool::Options(tiers.get());
  options.spill_on_pressure = true;
  TestPool test_pool(options);
  KvPool& pool = test_pool.pool;
  const std::string session = test_pool.Attach(layout, 16);
  for (const char* id : {"old", "mid", "new"}) {
    test_pool.Create(session, Named(kPolicyStreamingLlm), Budget(0), id);
  }
  ASSERT_TRUE(Append(pool, session, "old", 100, layout, HashValue).ok());
  test_pool.clock.Advance(absl::Seconds(1));
  ASSERT_TRUE(Append(pool, session, "mid", 100, layout, HashValue).ok());
  test_pool.clock.Advance(absl::Seconds(1));
  // 14 of 16 blocks used: "new" needs 7, so "old" (least recently used) goes to the host tier.
  ASSERT_TRUE(Append(pool, session, "new", 100, layout, HashValue).ok());
  EXPECT_EQ(pool.GetStats().spilled_on_pressure, 1);
  EXPECT_EQ(tiers->Find(SpillKey{"default", session, "old"})->tier, StorageTier::kHost);
  test_pool.clock.Advance(absl::Seconds(1));
  // Growing "new" again pushes out "mid"; the host tier makes room by moving "old" to disk.
  ASSERT_TRUE(Append(pool, session, "new", 100, layout, HashValue).ok());
  EXPECT_EQ(pool.GetStats().spilled_on_pressure, 2);
  EXPECT_EQ(tiers->Find(SpillKey{"default", session, "mid"})->tier, StorageTier::kHost);
  EXPECT_EQ(tiers->Find(SpillKey{"default", session, "old"})->tier, StorageTier::kDisk);
  EXPECT_EQ(tiers->GetStats().demoted_to_disk, 1);
  EXPECT_LE(tiers->GetStats().host_bytes_used, tiers->GetStats().host_bytes_capacity);
  // Without a victim left, the arena's RESOURCE_EXHAUSTED stands.
  EXPECT_EQ(pool.Reserve(session, "new", 200, {}, {}).status().code(),
            absl::StatusCode::kResourceExhausted);
  // Every demoted sequence restores bit-identical once there is room.
  ASSERT_TRUE(pool.ReleaseSequence(session, "new").ok());
  EXPECT_TRUE(testing_util::ContentsMatch(pool, session, "old", layout, HashValue));
  EXPECT_TRUE(testing_util::ContentsMatch(pool, session, "mid", layout, HashValue));
  EXPECT_TRUE(tiers->List().empty());
}

TEST(SpillRestoreTest, WithoutTiersSpillIsUnimplemented) {
  TestPool test_pool;
  const ModelLayout layout = MakeLayout(1, 1, 8, DType::kFloat16, 16);
  const std::string session = test_pool.Attach(layout, 8);
  const std::string seq = test_pool.Create(session, Named(kPolicyStreamingLlm), Budget(0));
  EXPECT_EQ(test_pool.pool.Spill(session, seq, StorageTier::kHost).status().code(),
            absl::StatusCode::kUnimplemented);
}

TEST(SequenceSnapshotTest, MalformedMetadataIsDataLoss) {
  SequenceSnapshot snapshot;
  snapshot.id = "s";
  snapshot.layout = MakeLayout(2, 2, 8, DType::kFloat16, 16);
  snapshot.layers.resize(2);
  snapshot.layers[0].count = 2;
  snapshot.layers[0].positions = {{0, 1}, {1, 0}};
  snapshot.layers[0].state.accumulated = {1, 2, 3, 4};
  const std::string bytes = EncodeSnapshot(snapshot);
  absl::StatusOr<SequenceSnapshot> decoded = DecodeSnapshot(bytes);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->layers[0].positions, snapshot.layers[0].positions);
  EXPECT_EQ(decoded->layers[0].state.accumulated, snapshot.layers[0].state.accumulated);
  // Every truncation, and trailing garbage, is DATA_LOSS rather than a crash.
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_EQ(DecodeSnapshot(bytes.substr(0, n)).status().code(), absl::StatusCode::kDataLoss) << n;
  }
  EXPECT_EQ(DecodeSnapshot(bytes + "x").status().code(), absl::StatusCode::kDataLoss);
}

TEST(SequenceSnapshotTest, LayerWindowsRoundTripAndOlderSnapshotsHaveNone) {
  SequenceSnapshot snapshot;
  snapshot.id = "s";
  snapshot.layout = MakeLayout(2, 2, 8, DType::kFloat16, 16);
  snapshot.layers.resize(2);
  const std::string without = EncodeSnapshot(snapshot);
  snapshot.layer_windows = {0, 7};
  const std::string with = EncodeSnapshot(snapshot);
  // Windows go last: a snapshot without them is byte-for-byte what was written before they
  // existed, and decodes with none.
  EXPECT_EQ(with.substr(0, without.size()), without);
  absl::StatusOr<SequenceSnapshot> decoded = DecodeSnapshot(with);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->layer_windows, (std::vector<int32_t>{0, 7}));
  decoded = DecodeSnapshot(without);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_TRUE(decoded->layer_windows.empty());
  // A window list of the wrong length or with a negative window is DATA_LOSS.
  for (const std::vector<int32_t>& bad : {std::vector<int32_t>{7}, std::vector<int32_t>{0, -1}}) {
    snapshot.layer_windows = bad;
    EXPECT_EQ(DecodeSnapshot(EncodeSnapshot(snapshot)).status().code(),
              absl::StatusCode::kDataLoss);
  }
}

// A layer's own next position (a cascading prefill commits layers one by one) survives the
// snapshot; one written before layers tracked their own decodes as -1 (the sequence's stands in).
TEST(SequenceSnapshotTest, LayerNextPositionsRoundTripAndOlderSnapshotsHaveNone) {
  SequenceSnapshot snapshot;
  snapshot.id = "s";
  snapshot.layout = MakeLayout(2, 2, 8, DType::kFloat16, 16);
  snapshot.next_position = 8;
  snapshot.layers.resize(2);
  const std::string without = EncodeSnapshot(snapshot);
  snapshot.layers[0].next_position = 8;
  snapshot.layers[1].next_position = 0;
  absl::StatusOr<SequenceSnapshot> decoded = DecodeSnapshot(EncodeSnapshot(snapshot));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->layers[0].next_position, 8);
  EXPECT_EQ(decoded->layers[1].next_position, 0);
  decoded = DecodeSnapshot(without);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->layers[0].next_position, -1);
  EXPECT_EQ(decoded->layers[1].next_position, -1);
}

}  // namespace
}  // namespace kvs
