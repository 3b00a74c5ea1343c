// RocksTier: the disk tier, an embedded RocksDB 7.8 in a directory of its own
// (<data_dir>/rocksdb) for the metadata, and one layer file per spilled copy for the bulk bytes.
// Owns both and an in-memory index of what they hold.
//
// Records (every one checksummed with CRC-32C):
//   "M" key -> crc32c(rest) u32 LE, format u32 (2), gen u64, spilled unix ns i64, layers u32,
//              per layer (bytes u64, crc32c of its bytes u32), meta bytes
//   "L" key -> gen u64 LE, reason: a copy found lost, so that it stays lost across restarts
//   <path>/kvs-layers/<gen, 16 hex digits>.kvl: the layers' bytes, concatenated in layer order
//   <path>/kvs-layers/<gen>.kvk: crc32c u32 LE, key: whose layer file it is
// where key = for tenant, session id and sequence id: length u32 BE then the bytes.
// A Put writes the layer file of a fresh generation with plain write()s and one fdatasync (the
// bulk bytes pass through memory once, as in a raw sequential write: RocksDB's memtable and
// flush copied them twice more), syncs the directory entry, then writes the metadata record
// through the WAL with sync, then removes the previous generation's file: a crash leaves the old
// or the new version, never a mix. Open removes layer files of keys no metadata names (a Put cut
// short, or a removal that did not finish) and data records of the earlier record format (format
// 1 kept layers as RocksDB records), and reports as lost the metadata that fails its checksum or
// whose layer file is missing or has the wrong size; a layer that fails its checksum on a Get is
// reported lost from then on. Lost copies are listed (SpilledInfo::lost), never served, recorded
// ("L") so that they stay lost across restarts, and keep their layer file until released.
//
// Damage to RocksDB itself: it opens with kAbsoluteConsistency WAL recovery and paranoid
// checks, so a damaged log record fails the open instead of silently ending the replay there
// (which dropped every later record: acknowledged copies vanished and their layer files were
// removed as orphans). Open then moves the damaged database to <path>/quarantine-<ns>/, replays
// its intact records (past the damaged one) into a fresh database, and reports the copies whose
// record is gone lost, found by their key files; their layer files are kept.
//
// Settings for the metadata: no compression; the records are small.
//
// Threading: thread-safe. The index has its own mutex; RocksDB and file calls run outside it.
// Callers serialise operations on one key (KvPool does, under the owning session's lock).
#ifndef KVSIDECAR_STORAGE_ROCKSDB_TIER_H_
#define KVSIDECAR_STORAGE_ROCKSDB_TIER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cache/tier.h"

namespace rocksdb {
class DB;
}

namespace kvs::storage {

class RocksTier {
 public:
  struct Options {
    std::string path;             // the database directory (created if missing)
    uint64_t capacity_bytes = 0;  // 0 = unlimited
  };
  // FAILED_PRECONDITION naming the path and RocksDB's reason when it cannot be opened.
  static absl::StatusOr<std::unique_ptr<RocksTier>> Open(const Options& options);
  ~RocksTier();

  // RESOURCE_EXHAUSTED when over capacity or the disk is full; the previous copy stays.
  absl::Status Put(const SpillKey& key, const SpilledSequence& data, absl::Time now);
  // NOT_FOUND without a copy; DATA_LOSS when a record fails its checksum or is missing.
  absl::StatusOr<std::shared_ptr<const SpilledSequence>> Get(const SpillKey& key) const;
  absl::Status Erase(const SpillKey& key);
  std::optional<SpilledInfo> Find(const SpillKey& key) const;
  std::vector<SpilledInfo> List() const;
  uint64_t TenantBytes(const std::string& tenant) const;
  uint64_t used_bytes() const;
  uint64_t capacity_bytes() const { return options_.capacity_bytes; }
  // Metadata/data records Open removed or reported (for logs and tests).
  int orphans_removed() const { return orphans_removed_; }
  // Non-empty when Open found the database damaged (RocksDB's reason and where the damaged copy
  // was moved); the copies it cost are listed lost. For the start-up log (at ERROR).
  const std::string& corruption() const { return corruption_; }
  // Layer files kept although no copy could be named for them (no readable key file).
  const std::vector<std::string>& unnamed_lost_files() const { return unnamed_lost_files_; }
  static std::string LostKey(const SpillKey& key);

  // Record keys and file names, for tests that corrupt records through RocksDB or the files.
  static std::string MetaKey(const SpillKey& key);
  // A data record of record format 1 (removed at Open).
  static std::string DataKey(const SpillKey& key, uint64_t generation, uint32_t layer);
  // The layer file of `key`'s current copy; empty without a readable copy.
  std::string LayerFile(const SpillKey& key) const;
  static std::string LayerDir(const std::string& path) { return path + "/kvs-layers"; }

 private:
  struct Entry {
    uint64_t generation = 0;  // 0: unknown (the metadata is unreadable)
    uint64_t bytes = 0;
    absl::Time spilled;
    std::string lost;  // non-empty: the copy failed a check (at Open or on a Get)
  };
  RocksTier(Options options, std::unique_ptr<rocksdb::DB> db);
  absl::Status Load();
  std::string FilePath(uint64_t generation) const;
  // <gen>.kvk beside the layer file: the copy's key (crc32c + EncodeKey), so that a layer file
  // whose metadata record is unreadable is still known as that copy's.
  std::string KeyFilePath(uint64_t generation) const;
  void RemoveFiles(uint64_t generation) const;  // the layer and key files of `generation`
  // Marks `key`'s copy of `generation` lost with `reason` (a failed Get) and returns DATA_LOSS.
  absl::Status MarkLost(const SpillKey& key, uint64_t generation, const std::string& reason) const;

  const Options options_;
  const std::unique_ptr<rocksdb::DB> db_;
  int orphans_removed_ = 0;
  std::string corruption_;
  std::vector<std::string> unnamed_lost_files_;
  mutable absl::Mutex mu_;
  // Mutable: a Get that finds a corrupt copy marks it lost.
  mutable std::map<SpillKey, Entry> entries_ ABSL_GUARDED_BY(mu_);
  mutable uint64_t used_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_generation_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace kvs::storage

#endif  // KVSIDECAR_STORAGE_ROCKSDB_TIER_H_
