#include "storage/tier_manager.h"

#include <fstream>
#include <map>
#include <random>

#include "gtest/gtest.h"
#include "tests/storage/storage_test_util.h"

namespace kvs::storage {
namespace {

using testing_util::RandomSequence;
using testing_util::TempDir;

TEST(TierManagerTest, AKeyLivesInOneTier) {
  TempDir dir;
  std::unique_ptr<TierManager> tiers = TierManager::Open({1 << 20, dir.path() + "/rocksdb", 0});
  ASSERT_TRUE(tiers->disk_status().ok()) << tiers->disk_status();
  std::mt19937 gen(5);
  const SpillKey key{"t", "s", "q"};
  const SpilledSequence data = RandomSequence(gen, 3, 10000);
  ASSERT_TRUE(tiers->Put(StorageTier::kHost, key, data).ok());
  EXPECT_EQ(tiers->Find(key)->tier, StorageTier::kHost);
  EXPECT_EQ(tiers->TenantBytes("t", true), data.bytes());
  ASSERT_TRUE(tiers->Put(StorageTier::kDisk, key, data).ok());
  EXPECT_EQ(tiers->Find(key)->tier, StorageTier::kDisk);
  EXPECT_EQ(tiers->TenantBytes("t", true), 0u);
  EXPECT_EQ(tiers->TenantBytes("t", false), data.bytes());
  ASSERT_EQ(tiers->List().size(), 1u);
  absl::StatusOr<std::shared_ptr<const SpilledSequence>> got = tiers->Get(key);
  ASSERT_TRUE(got.ok());
  EXPECT_TRUE((*got)->layers == data.layers);
  ASSERT_TRUE(tiers->Put(StorageTier::kHost, key, data).ok());
  EXPECT_EQ(tiers->GetStats().disk_bytes_used, 0u);
  EXPECT_EQ(tiers->GetStats().host_bytes_used, data.bytes());
  ASSERT_TRUE(tiers->Erase(key).ok());
  EXPECT_TRUE(tiers->List().empty());
  EXPECT_EQ(tiers->Get(key).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(tiers->Put(StorageTier::kArena, key, data).code(), absl::StatusCode::kInvalidArgument);
}

TEST(TierManagerTest, UnavailableDiskLeavesTheHostTierServing) {
  TempDir dir;
  const std::string file = dir.path() + "/file";
  std::ofstream(file) << "x";
  std::unique_ptr<TierManager> tiers = TierManager::Open({1 << 20, file + "/rocksdb", 0});
  EXPECT_EQ(tiers->disk_status().code(), absl::StatusCode::kFailedPrecondition);
  const SpilledSequence data{"m", {"kv"}};
  absl::Status disk = tiers->Put(StorageTier::kDisk, {"t", "s", "q"}, data);
  EXPECT_EQ(disk.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(disk.message().find("--data_dir"), std::string::npos) << disk;
  EXPECT_TRUE(tiers->Put(StorageTier::kHost, {"t", "s", "q"}, data).ok());
  EXPECT_FALSE(tiers->GetStats().disk_available);
}

}  // namespace
}  // namespace kvs::storage

namespace kvs::storage {
namespace {

// Random puts under pressure: every tier stays within its capacity, host copies move to disk
// oldest first, disk copies beyond its capacity are deleted oldest first (and say so), and every
// copy still listed reads back exactly.
TEST(TierManagerTest, DemotionUnderPressureKeepsEveryTierWithinCapacity) {
  TempDir dir;
  constexpr uint64_t kHost = 40000, kDisk = 120000;
  std::unique_ptr<TierManager> tiers = TierManager::Open({kHost, dir.path() + "/rocksdb", kDisk});
  ASSERT_TRUE(tiers->disk_status().ok());
  std::mt19937 gen(11);
  std::map<SpillKey, SpilledSequence> written;
  std::vector<SpillKey> order;
  for (int i = 0; i < 40; ++i) {
    const SpillKey key{"t", "s", "q" + std::to_string(i)};
    SpilledSequence data{std::string(100, 'm'),
                         {testing_util::RandomBytes(gen, 5000 + gen() % 10000)}};
    const StorageTier tier = i % 4 == 3 ? StorageTier::kDisk : StorageTier::kHost;
    ASSERT_TRUE(tiers->Put(tier, key, data).ok()) << i;
    written[key] = std::move(data);
    order.push_back(key);
    const TierStats stats = tiers->GetStats();
    ASSERT_LE(stats.host_bytes_used, kHost);
    ASSERT_LE(stats.disk_bytes_used, kDisk);
  }
  const TierStats stats = tiers->GetStats();
  EXPECT_GT(stats.demoted_to_disk, 0);
  EXPECT_GT(stats.deleted_from_disk, 0);
  // The newest copy is always kept; deleted ones answer NOT_FOUND naming the reason.
  int kept = 0, deleted = 0;
  for (const SpillKey& key : order) {
    absl::StatusOr<std::shared_ptr<const SpilledSequence>> got = tiers->Get(key);
    if (got.ok()) {
      EXPECT_TRUE((*got)->layers == written[key].layers);
      ++kept;
    } else {
      EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound);
      EXPECT_NE(got.status().message().find("--disk_tier_bytes"), std::string::npos);
      ++deleted;
    }
  }
  EXPECT_TRUE(tiers->Get(order.back()).ok());
  EXPECT_EQ(deleted, stats.deleted_from_disk);
  EXPECT_EQ(kept, static_cast<int>(tiers->List().size()));
  // Oldest first: the first copies stored are the ones deleted.
  EXPECT_FALSE(tiers->Get(order.front()).ok());
  // A copy larger than a tier is refused and nothing is evicted for it.
  const size_t before = tiers->List().size();
  EXPECT_EQ(tiers
                ->Put(StorageTier::kDisk, {"t", "s", "huge"},
                      SpilledSequence{"m", {std::string(kDisk + 1, 'x')}})
                .code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(tiers
                ->Put(StorageTier::kHost, {"t", "s", "huge"},
                      SpilledSequence{"m", {std::string(kHost + 1, 'x')}})
                .code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(tiers->List().size(), before);
}

TEST(TierManagerTest, WithoutDemotionAFullHostTierRefuses) {
  TempDir dir;
  TierOptions options{10000, dir.path() + "/rocksdb", 0, /*demote=*/false};
  std::unique_ptr<TierManager> tiers = TierManager::Open(options);
  ASSERT_TRUE(
      tiers->Put(StorageTier::kHost, {"t", "s", "a"}, {"m", {std::string(6000, 'a')}}).ok());
  EXPECT_EQ(tiers->Put(StorageTier::kHost, {"t", "s", "b"}, {"m", {std::string(6000, 'b')}}).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(tiers->GetStats().demoted_to_disk, 0);
}

}  // namespace
}  // namespace kvs::storage
