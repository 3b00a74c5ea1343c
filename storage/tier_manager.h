// TierManager: the storage tiers behind KvPool (implements cache/tier.h's SequenceTiers): the
// host pool (storage/host_pool.h) and the RocksDB disk tier (storage/rocksdb_tier.h), each with
// its capacity, and optionally the remote tier on Redis (storage/redis/remote_tier.h). A key
// lives in at most one tier: a Put into one tier removes the copy in the others. A remote copy
// is only removed by the sidecar that wrote it or claimed it (other sidecars' copies of the same
// tenant and sequence id are theirs). Remote calls run outside the manager's mutex. When the disk tier cannot be opened the manager still serves the host tier, and every
// disk operation answers FAILED_PRECONDITION with the reason (the server keeps serving).
//
// Capacity pressure (TierOptions::demote): a Put that does not fit the host tier first moves the
// least recently stored host copies to disk; a Put that does not fit the disk tier's capacity
// deletes the oldest disk copies (a later Get of one answers NOT_FOUND saying so). A copy larger
// than its tier is refused (RESOURCE_EXHAUSTED) without touching the others.
//
// Threading: thread-safe. One mutex serialises the operations (so a copy being demoted is never
// missing from both tiers for a concurrent Get).
#ifndef KVSIDECAR_STORAGE_TIER_MANAGER_H_
#define KVSIDECAR_STORAGE_TIER_MANAGER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "cache/tier.h"
#include "storage/host_pool.h"
#include "storage/redis/remote_tier.h"
#include "storage/rocksdb_tier.h"

namespace kvs::storage {

struct TierOptions {
  uint64_t host_capacity_bytes = uint64_t{1} << 30;
  std::string disk_path;             // <data_dir>/rocksdb; empty = no disk tier
  uint64_t disk_capacity_bytes = 0;  // 0 = unlimited
  bool demote = true;                // host -> disk demotion and oldest-first disk deletion
  RemoteTierOptions remote = {};     // remote.client.seeds empty = no remote tier
};

struct TierStats {
  uint64_t host_bytes_used = 0;
  uint64_t host_bytes_capacity = 0;
  uint64_t disk_bytes_used = 0;
  uint64_t disk_bytes_capacity = 0;  // 0 = unlimited
  bool disk_available = false;
  int64_t demoted_to_disk = 0;    // host copies moved to disk to make room
  int64_t deleted_from_disk = 0;  // disk copies deleted to stay within the disk capacity
  bool remote_configured = false;
};

class TierManager final : public SequenceTiers {
 public:
  // Never fails: a disk tier that cannot be opened is reported by disk_status().
  static std::unique_ptr<TierManager> Open(const TierOptions& options);

  absl::Status Put(StorageTier tier, const SpillKey& key, SpilledSequence data) override;
  absl::StatusOr<std::shared_ptr<const SpilledSequence>> Get(const SpillKey& key) override;
  absl::Status Erase(const SpillKey& key) override;
  std::optional<SpilledInfo> Find(const SpillKey& key) const override;
  std::vector<SpilledInfo> List() const override;
  void Release(const SpillKey& key) override;
  absl::StatusOr<std::shared_ptr<const SpilledSequence>> Read(const SpillKey& key) override;
  absl::Status EraseShared(const SpillKey& key) override;
  bool has_remote() const override { return remote_ != nullptr; }
  absl::Status PutPinnedHost(const SpillKey& key,
                             std::shared_ptr<const SpilledSequence> data) override;

  // OK, or why the disk tier is unavailable (FAILED_PRECONDITION naming the directory).
  const absl::Status& disk_status() const { return disk_status_; }
  // Bytes `tenant` holds in the host (host = true) or disk tier (KvPool::SetTierUsageFn).
  uint64_t TenantBytes(const std::string& tenant, bool host) const;
  // Bytes of `tenant`'s copies in the remote tier, every sidecar's (0 without a remote tier or
  // when Redis cannot be reached).
  uint64_t TenantRemoteBytes(const std::string& tenant) const;
  TierStats GetStats() const;
  RocksTier* disk() { return disk_.get(); }
  RemoteTier* remote() { return remote_.get(); }

 private:
  TierManager(const TierOptions& options, std::unique_ptr<RocksTier> disk,
              absl::Status disk_status);
  absl::Status PutLocal(StorageTier tier, const SpillKey& key, SpilledSequence data);
  // Drops `key`'s remote copy if this sidecar owns it (outside mu_).
  absl::Status EraseRemoteIfMine(const SpillKey& key);
  absl::Status PutHostLocked(const SpillKey& key, std::shared_ptr<const SpilledSequence> data)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status PutDiskLocked(const SpillKey& key, const SpilledSequence& data)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The least recently stored key of `tier` other than `except`, if any.
  std::optional<SpillKey> OldestLocked(StorageTier tier, const SpillKey& except) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const bool demote_;
  HostPool host_;
  const std::unique_ptr<RocksTier> disk_;
  const absl::Status disk_status_;
  const std::unique_ptr<RemoteTier> remote_;
  mutable absl::Mutex mu_;
  // Remote copies this sidecar wrote or claimed, by (tenant, sequence id): the ones it may
  // delete when the key moves to another tier or is erased.
  absl::flat_hash_set<std::pair<std::string, std::string>> remote_mine_ ABSL_GUARDED_BY(mu_);
  // Store order of every copy (LRU: a copy is used once, by its Restore, which deletes it).
  absl::flat_hash_map<SpillKey, uint64_t> stored_at_ ABSL_GUARDED_BY(mu_);
  uint64_t clock_ ABSL_GUARDED_BY(mu_) = 0;
  // Keys deleted to make room (the latest few thousand), for a clear NOT_FOUND.
  absl::flat_hash_set<SpillKey> deleted_ ABSL_GUARDED_BY(mu_);
  int64_t demoted_to_disk_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t deleted_from_disk_ ABSL_GUARDED_BY(mu_) = 0;
  // Host entries of live sequences (PutPinnedHost): never demoted, not listed.
  absl::flat_hash_set<SpillKey> pinned_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvs::storage

#endif  // KVSIDECAR_STORAGE_TIER_MANAGER_H_
