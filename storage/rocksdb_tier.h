// RocksTier: the disk tier, an embedded RocksDB 7.8 in a directory of its own
// (<data_dir>/rocksdb). Owns the database and an in-memory index of what it holds.
//
// Records (every one checksummed with CRC-32C):
//   "D" key gen(u64 BE) layer(u32 BE) -> crc32c(data) u32 LE, data   one per layer: its blocks
//   "M" key                           -> crc32c(rest) u32 LE, format u32, gen u64, spilled unix
//                                        ns i64, layers u32, per layer (bytes u64), meta bytes
// where key = for tenant, session id and sequence id: length u32 BE then the bytes.
// A Put writes the data records of a fresh generation without the WAL and flushes them (one pass
// of the bulk bytes into blob files, synced by the flush), then the metadata record through the
// WAL with sync, then deletes the previous generation: a crash leaves the old or the new version,
// never a mix. Open deletes data records no metadata points at (a Put cut short) and reports
// metadata that fails its checksum as lost.
//
// Settings for cache data: no compression, values of 64 KiB and more in blob files (BlobDB), no
// WAL and no per-write fsync for the bulk records.
//
// Threading: thread-safe. The index has its own mutex; RocksDB calls run outside it. Callers
// serialise operations on one key (KvPool does, under the owning session's lock).
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

  // Record keys, for tests that corrupt records through RocksDB.
  static std::string MetaKey(const SpillKey& key);
  static std::string DataKey(const SpillKey& key, uint64_t generation, uint32_t layer);

 private:
  struct Entry {
    uint64_t generation = 0;
    uint64_t bytes = 0;
    absl::Time spilled;
    std::string lost;  // non-empty: the metadata failed its checksum
  };
  RocksTier(Options options, std::unique_ptr<rocksdb::DB> db);
  absl::Status Load();

  const Options options_;
  const std::unique_ptr<rocksdb::DB> db_;
  int orphans_removed_ = 0;
  mutable absl::Mutex mu_;
  std::map<SpillKey, Entry> entries_ ABSL_GUARDED_BY(mu_);
  uint64_t used_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_generation_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace kvs::storage

#endif  // KVSIDECAR_STORAGE_ROCKSDB_TIER_H_
