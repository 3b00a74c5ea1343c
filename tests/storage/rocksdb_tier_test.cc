// The disk tier against a real RocksDB and real layer files in a temporary directory: round
// trips, reopening, corruption injected through RocksDB and into the files, unfinished spills,
// capacity, open failures.
#include "storage/rocksdb_tier.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>

#include "gtest/gtest.h"
#include "rocksdb/db.h"
#include "tests/storage/storage_test_util.h"

namespace kvs::storage {
namespace {

using testing_util::RandomSequence;
using testing_util::TempDir;

std::unique_ptr<RocksTier> OpenTier(const std::string& path, uint64_t capacity = 0) {
  absl::StatusOr<std::unique_ptr<RocksTier>> tier = RocksTier::Open({path, capacity});
  EXPECT_TRUE(tier.ok()) << tier.status();
  return tier.ok() ? *std::move(tier) : nullptr;
}

void ExpectEqual(const SpilledSequence& a, const SpilledSequence& b) {
  EXPECT_TRUE(a.meta == b.meta);
  ASSERT_EQ(a.layers.size(), b.layers.size());
  for (size_t l = 0; l < a.layers.size(); ++l) EXPECT_TRUE(a.layers[l] == b.layers[l]) << l;
}

// Applies `edit` to every record whose key starts with `prefix`, through RocksDB directly (the
// tier must be closed).
template <typename Edit>
int EditRecords(const std::string& path, char prefix, Edit edit) {
  rocksdb::DB* raw = nullptr;
  rocksdb::Options options;
  options.enable_blob_files = true;
  EXPECT_TRUE(rocksdb::DB::Open(options, path, &raw).ok());
  std::unique_ptr<rocksdb::DB> db(raw);
  std::map<std::string, std::string> records;
  std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(rocksdb::ReadOptions()));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    if (it->key()[0] == prefix) records[it->key().ToString()] = it->value().ToString();
  }
  it.reset();
  int edited = 0;
  for (auto& [key, value] : records) {
    if (edit(key, value)) {
      EXPECT_TRUE(db->Put(rocksdb::WriteOptions(), key, value).ok());
      ++edited;
    }
  }
  EXPECT_TRUE(db->Close().ok());
  return edited;
}

TEST(RocksTierTest, RoundTripsReplaceEraseAndReopen) {
  TempDir dir;
  std::mt19937 gen(42);
  std::map<SpillKey, SpilledSequence> expected;
  {
    std::unique_ptr<RocksTier> tier = OpenTier(dir.path());
    ASSERT_NE(tier, nullptr);
    for (int i = 0; i < 12; ++i) {
      const SpillKey key{i % 2 ? "tenant-a" : "tenant-b", "session", "seq" + std::to_string(i)};
      // Small values stay in the LSM tree, large ones (>= 64 KiB) go to blob files.
      SpilledSequence data = RandomSequence(gen, 1 + gen() % 5, i % 3 == 0 ? (1 << 20) : 2000);
      ASSERT_TRUE(tier->Put(key, data, absl::FromUnixSeconds(i)).ok());
      expected[key] = std::move(data);
    }
    // Replace one (a new generation), erase another.
    const SpillKey replaced{"tenant-a", "session", "seq1"};
    expected[replaced] = RandomSequence(gen, 3, 100000);
    ASSERT_TRUE(tier->Put(replaced, expected[replaced], absl::FromUnixSeconds(50)).ok());
    const SpillKey erased{"tenant-b", "session", "seq2"};
    ASSERT_TRUE(tier->Erase(erased).ok());
    expected.erase(erased);
    ASSERT_TRUE(tier->Erase(erased).ok()) << "erasing nothing is fine";
    for (const auto& [key, data] : expected) {
      absl::StatusOr<std::shared_ptr<const SpilledSequence>> got = tier->Get(key);
      ASSERT_TRUE(got.ok()) << got.status();
      ExpectEqual(**got, data);
    }
    EXPECT_EQ(tier->Get(erased).status().code(), absl::StatusCode::kNotFound);
  }
  std::unique_ptr<RocksTier> tier = OpenTier(dir.path());
  ASSERT_NE(tier, nullptr);
  EXPECT_EQ(tier->orphans_removed(), 0);
  const std::vector<SpilledInfo> listed = tier->List();
  ASSERT_EQ(listed.size(), expected.size());
  uint64_t total = 0, tenant_a = 0;
  auto want = expected.begin();
  for (const SpilledInfo& info : listed) {
    EXPECT_EQ(info.key, want->first);
    EXPECT_EQ(info.bytes, want->second.bytes());
    EXPECT_TRUE(info.lost.empty());
    total += info.bytes;
    if (info.key.tenant == "tenant-a") tenant_a += info.bytes;
    absl::StatusOr<std::shared_ptr<const SpilledSequence>> got = tier->Get(info.key);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectEqual(**got, want->second);
    ++want;
  }
  EXPECT_EQ(tier->used_bytes(), total);
  EXPECT_EQ(tier->TenantBytes("tenant-a"), tenant_a);
  EXPECT_EQ(tier->Find({"tenant-a", "session", "seq1"})->spilled, absl::FromUnixSeconds(50));
}

// Flips the byte at `offset` of `file`.
void FlipByte(const std::string& file, uint64_t offset) {
  std::fstream stream(file, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(stream.good()) << file;
  stream.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  stream.get(c);
  stream.seekp(static_cast<std::streamoff>(offset));
  stream.put(static_cast<char>(c ^ 0x01));
  ASSERT_TRUE(stream.good()) << file;
}

TEST(RocksTierTest, CorruptedDataRecordIsDataLossAndNeverServed) {
  TempDir dir;
  std::mt19937 gen(1);
  const SpillKey good{"t", "s", "good"}, bad{"t", "s", "bad"};
  const SpilledSequence good_data = RandomSequence(gen, 3, 200000);
  SpilledSequence bad_data;
  bad_data.meta = "meta";
  bad_data.layers = {std::string(5000, 'a'), std::string(300000, 'b')};
  std::string bad_file;
  {
    std::unique_ptr<RocksTier> tier = OpenTier(dir.path());
    ASSERT_TRUE(tier->Put(good, good_data, absl::Now()).ok());
    ASSERT_TRUE(tier->Put(bad, bad_data, absl::Now()).ok());
    bad_file = tier->LayerFile(bad);
    ASSERT_FALSE(bad_file.empty());
  }
  // Flip one byte in the middle of layer 1 of `bad` (its layer file: layer 0, then layer 1).
  FlipByte(bad_file, 5000 + 150000);
  std::unique_ptr<RocksTier> tier = OpenTier(dir.path());
  ASSERT_TRUE(tier->Find(bad)->lost.empty()) << "Open checks sizes, not every byte";
  const uint64_t used = tier->used_bytes();
  absl::Status status = tier->Get(bad).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_NE(status.message().find("layer 1"), std::string::npos) << status;
  // From then on it is listed as lost and counts for nothing.
  std::optional<SpilledInfo> info = tier->Find(bad);
  ASSERT_TRUE(info.has_value());
  EXPECT_NE(info->lost.find("layer 1 fails its checksum"), std::string::npos) << info->lost;
  EXPECT_EQ(tier->used_bytes(), used - info->bytes);
  EXPECT_EQ(tier->Get(bad).status().code(), absl::StatusCode::kDataLoss);
  absl::StatusOr<std::shared_ptr<const SpilledSequence>> other = tier->Get(good);
  ASSERT_TRUE(other.ok()) << other.status();
  ExpectEqual(**other, good_data);
  // The lost copy can be erased, or replaced by a fresh spill.
  ASSERT_TRUE(tier->Put(bad, bad_data, absl::Now()).ok());
  EXPECT_FALSE(std::filesystem::exists(bad_file)) << "the replaced generation's file is removed";
  absl::StatusOr<std::shared_ptr<const SpilledSequence>> fresh = tier->Get(bad);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  ExpectEqual(**fresh, bad_data);
  const std::string fresh_file = tier->LayerFile(bad);
  ASSERT_TRUE(tier->Erase(bad).ok());
  EXPECT_FALSE(tier->Find(bad).has_value());
  EXPECT_FALSE(std::filesystem::exists(fresh_file));
}

TEST(RocksTierTest, TruncatedOrMissingLayerFilesAreReportedLostAtOpen) {
  TempDir dir;
  std::mt19937 gen(4);
  const SpillKey cut{"t", "s", "cut"}, gone{"t", "s", "gone"}, fine{"t", "s", "fine"};
  std::string cut_file, gone_file;
  const SpilledSequence fine_data = RandomSequence(gen, 2, 70000);
  {
    std::unique_ptr<RocksTier> tier = OpenTier(dir.path());
    ASSERT_TRUE(tier->Put(cut, {"m", {std::string(100000, 'c')}}, absl::Now()).ok());
    ASSERT_TRUE(tier->Put(gone, {"m", {std::string(1000, 'g')}}, absl::Now()).ok());
    ASSERT_TRUE(tier->Put(fine, fine_data, absl::Now()).ok());
    cut_file = tier->LayerFile(cut);
    gone_file = tier->LayerFile(gone);
  }
  std::filesystem::resize_file(cut_file, 4096);
  std::filesystem::remove(gone_file);
  std::unique_ptr<RocksTier> tier = OpenTier(dir.path());
  EXPECT_NE(tier->Find(cut)->lost.find("has 4096 bytes"), std::string::npos)
      << tier->Find(cut)->lost;
  EXPECT_NE(tier->Find(gone)->lost.find("missing"), std::string::npos) << tier->Find(gone)->lost;
  EXPECT_EQ(tier->Get(cut).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(tier->Get(gone).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(tier->used_bytes(), fine_data.bytes());
  absl::StatusOr<std::shared_ptr<const SpilledSequence>> got = tier->Get(fine);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectEqual(**got, fine_data);
  EXPECT_EQ(tier->List().size(), 3u);
  ASSERT_TRUE(tier->Erase(cut).ok());
  EXPECT_FALSE(std::filesystem::exists(cut_file));
}

TEST(RocksTierTest, CorruptedMetadataIsReportedLostAtOpen) {
  TempDir dir;
  std::mt19937 gen(2);
  const SpillKey key{"t", "s", "x"}, other{"t", "s", "y"};
  {
    std::unique_ptr<RocksTier> tier = OpenTier(dir.path());
    ASSERT_TRUE(tier->Put(key, RandomSequence(gen, 2, 1000), absl::Now()).ok());
    ASSERT_TRUE(tier->Put(other, RandomSequence(gen, 2, 1000), absl::Now()).ok());
  }
  const std::string target = RocksTier::MetaKey(key);
  EXPECT_EQ(1, EditRecords(dir.path(), 'M', [&](const std::string& k, std::string& value) {
              if (k != target) return false;
              value[value.size() - 1] ^= 0x80;
              return true;
            }));
  std::unique_ptr<RocksTier> tier = OpenTier(dir.path());
  std::optional<SpilledInfo> info = tier->Find(key);
  ASSERT_TRUE(info.has_value());
  EXPECT_NE(info->lost.find("checksum"), std::string::npos) << info->lost;
  EXPECT_EQ(tier->Get(key).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(tier->Get(other).ok());
  EXPECT_EQ(tier->used_bytes(), tier->Find(other)->bytes) << "lost copies count for nothing";
  ASSERT_TRUE(tier->Erase(key).ok());
  EXPECT_EQ(tier->List().size(), 1u);
}

// A crash after a damaged database was moved aside, before its records were carried over, leaves
// a fresh database that names nothing: the salvage marker makes the next start keep every layer
// file and report its copy lost (persistently), instead of removing them all as orphans.
TEST(RocksTierTest, InterruptedSalvageKeepsEveryCopyAndReportsItLost) {
  TempDir dir;
  std::mt19937 gen(5);
  const SpillKey x{"t", "s", "x"}, y{"t", "s", "y"};
  std::string x_file, y_file;
  {
    std::unique_ptr<RocksTier> tier = OpenTier(dir.path());
    ASSERT_TRUE(tier->Put(x, RandomSequence(gen, 2, 1000), absl::Now()).ok());
    ASSERT_TRUE(tier->Put(y, RandomSequence(gen, 2, 1000), absl::Now()).ok());
    x_file = tier->LayerFile(x);
    y_file = tier->LayerFile(y);
  }
  {
    // The fresh database the interrupted salvage had opened: no records.
    rocksdb::DB* raw = nullptr;
    rocksdb::Options options;
    options.enable_blob_files = true;
    ASSERT_TRUE(rocksdb::DB::Open(options, dir.path(), &raw).ok());
    std::unique_ptr<rocksdb::DB> db(raw);
    std::vector<std::string> keys;
    std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(rocksdb::ReadOptions()));
    for (it->SeekToFirst(); it->Valid(); it->Next()) keys.push_back(it->key().ToString());
    it.reset();
    for (const std::string& key : keys) ASSERT_TRUE(db->Delete({}, key).ok());
    ASSERT_TRUE(db->Close().ok());
  }
  const std::string marker = RocksTier::LayerDir(dir.path()) + "/salvage-pending";
  std::ofstream(marker) << "";
  for (int open = 0; open < 2; ++open) {
    std::unique_ptr<RocksTier> tier = OpenTier(dir.path());
    ASSERT_NE(tier, nullptr);
    EXPECT_EQ(tier->orphans_removed(), 0) << "open " << open;
    for (const SpillKey& key : {x, y}) {
      std::optional<SpilledInfo> info = tier->Find(key);
      ASSERT_TRUE(info.has_value()) << "open " << open;
      EXPECT_NE(info->lost.find("salvage"), std::string::npos) << info->lost;
      EXPECT_EQ(tier->Get(key).status().code(), absl::StatusCode::kDataLoss);
    }
    EXPECT_TRUE(std::filesystem::exists(x_file));
    EXPECT_TRUE(std::filesystem::exists(y_file));
    EXPECT_FALSE(std::filesystem::exists(marker)) << "removed once the lost copies are recorded";
  }
}

// A layer file with no key file (older builds wrote none) is never removed while a metadata
// record cannot be read: it may be that record's copy. It is kept across restarts.
TEST(RocksTierTest, UnnamedFileIsKeptWhileAnyRecordIsUnreadable) {
  TempDir dir;
  std::mt19937 gen(6);
  const SpillKey key{"t", "s", "x"};
  std::string file;
  {
    std::unique_ptr<RocksTier> tier = OpenTier(dir.path());
    ASSERT_TRUE(tier->Put(key, RandomSequence(gen, 2, 1000), absl::Now()).ok());
    file = tier->LayerFile(key);
  }
  std::string key_file = file;
  key_file.replace(key_file.size() - 4, 4, ".kvk");
  ASSERT_TRUE(std::filesystem::remove(key_file)) << key_file;
  const std::string target = RocksTier::MetaKey(key);
  EXPECT_EQ(1, EditRecords(dir.path(), 'M', [&](const std::string& k, std::string& value) {
              if (k != target) return false;
              value[value.size() - 1] ^= 0x80;
              return true;
            }));
  for (int open = 0; open < 2; ++open) {
    std::unique_ptr<RocksTier> tier = OpenTier(dir.path());
    ASSERT_NE(tier, nullptr);
    EXPECT_EQ(tier->orphans_removed(), 0) << "open " << open;
    EXPECT_EQ(tier->Get(key).status().code(), absl::StatusCode::kDataLoss);
    EXPECT_TRUE(std::filesystem::exists(file) || std::filesystem::exists(file + ".lost"))
        << "open " << open;
  }
}

TEST(RocksTierTest, UnfinishedSpillsAreRemovedAtOpen) {
  TempDir dir;
  std::mt19937 gen(3);
  const SpillKey kept{"t", "s", "kept"};
  const SpilledSequence data = RandomSequence(gen, 2, 5000);
  std::string kept_file;
  {
    std::unique_ptr<RocksTier> tier = OpenTier(dir.path());
    ASSERT_TRUE(tier->Put(kept, data, absl::Now()).ok());
    kept_file = tier->LayerFile(kept);
  }
  // As a crash between a layer file and its metadata leaves them: layer files no metadata names
  // (generations 7 and 9, above kept's); plus a data record of record format 1 and a file that
  // is not a layer file (left alone).
  const std::string layers = RocksTier::LayerDir(dir.path());
  std::ofstream(layers + "/0000000000000007.kvl") << "orphan";
  std::ofstream(layers + "/0000000000000009.kvl") << "orphan";
  std::ofstream(layers + "/notes.txt") << "not ours";
  {
    rocksdb::DB* raw = nullptr;
    rocksdb::Options options;
    ASSERT_TRUE(rocksdb::DB::Open(options, dir.path(), &raw).ok());
    std::unique_ptr<rocksdb::DB> db(raw);
    ASSERT_TRUE(
        db->Put({}, RocksTier::DataKey({"t", "s", "never"}, 7, 0), std::string(10, 'x')).ok());
    ASSERT_TRUE(db->Close().ok());
  }
  std::unique_ptr<RocksTier> tier = OpenTier(dir.path());
  EXPECT_EQ(tier->orphans_removed(), 3);
  EXPECT_FALSE(std::filesystem::exists(layers + "/0000000000000007.kvl"));
  EXPECT_FALSE(std::filesystem::exists(layers + "/0000000000000009.kvl"));
  EXPECT_TRUE(std::filesystem::exists(layers + "/notes.txt"));
  EXPECT_TRUE(std::filesystem::exists(kept_file));
  ASSERT_EQ(tier->List().size(), 1u);
  absl::StatusOr<std::shared_ptr<const SpilledSequence>> got = tier->Get(kept);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectEqual(**got, data);
  // A later Put takes a generation above every one seen (files included).
  ASSERT_TRUE(tier->Put(kept, data, absl::Now()).ok());
  EXPECT_EQ(tier->LayerFile(kept), layers + "/000000000000000a.kvl");
  ASSERT_TRUE(tier->Get(kept).ok());
  tier.reset();
  EXPECT_EQ(OpenTier(dir.path())->orphans_removed(), 0);
}

TEST(RocksTierTest, CapacityIsEnforced) {
  TempDir dir;
  std::unique_ptr<RocksTier> tier = OpenTier(dir.path(), 10000);
  SpilledSequence small{"m", {std::string(6000, 'a')}};
  SpilledSequence big{"m", {std::string(6000, 'b')}};
  ASSERT_TRUE(tier->Put({"t", "s", "a"}, small, absl::Now()).ok());
  absl::Status full = tier->Put({"t", "s", "b"}, big, absl::Now());
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_NE(full.message().find("--disk_tier_bytes"), std::string::npos);
  EXPECT_FALSE(tier->Find({"t", "s", "b"}).has_value());
  // Replacing a copy counts only the difference.
  ASSERT_TRUE(tier->Put({"t", "s", "a"}, big, absl::Now()).ok());
}

TEST(RocksTierTest, UnopenableDirectoryIsFailedPrecondition) {
  TempDir dir;
  const std::string file = dir.path() + "/not-a-dir";
  std::ofstream(file) << "x";
  absl::StatusOr<std::unique_ptr<RocksTier>> tier = RocksTier::Open({file + "/rocksdb", 0});
  ASSERT_FALSE(tier.ok());
  EXPECT_EQ(tier.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(tier.status().message().find(file), std::string::npos) << tier.status();
}

}  // namespace
}  // namespace kvs::storage
