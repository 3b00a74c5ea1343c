#include "storage/tier_manager.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cache/spill_buffers.h"
#include "gpu/base/status_macros.h"

namespace kvs::storage {
namespace {
constexpr size_t kMaxDeletedKeys = 4096;
}  // namespace

std::unique_ptr<TierManager> TierManager::Open(const TierOptions& options) {
  std::unique_ptr<RocksTier> disk;
  absl::Status status = absl::FailedPreconditionError("no disk tier is configured");
  if (!options.disk_path.empty()) {
    absl::StatusOr<std::unique_ptr<RocksTier>> opened =
        RocksTier::Open({options.disk_path, options.disk_capacity_bytes});
    if (opened.ok()) {
      disk = *std::move(opened);
      status = absl::OkStatus();
    } else {
      status = absl::FailedPreconditionError(
          absl::StrCat("the disk tier is unavailable (", opened.status().message(),
                       "); fix --data_dir and restart the sidecar"));
    }
  }
  return std::unique_ptr<TierManager>(new TierManager(options, std::move(disk), status));
}

TierManager::TierManager(const TierOptions& options, std::unique_ptr<RocksTier> disk,
                         absl::Status disk_status)
    : demote_(options.demote),
      host_(options.host_capacity_bytes),
      disk_(std::move(disk)),
      disk_status_(std::move(disk_status)),
      remote_(options.remote.client.seeds.empty() ? nullptr
                                                  : std::make_unique<RemoteTier>(options.remote)) {
  if (!disk_) return;
  // Copies from earlier runs, oldest first.
  std::vector<SpilledInfo> found = disk_->List();
  std::stable_sort(found.begin(), found.end(), [](const SpilledInfo& a, const SpilledInfo& b) {
    return a.spilled < b.spilled;
  });
  absl::MutexLock lock(&mu_);
  for (const SpilledInfo& info : found) stored_at_[info.key] = ++clock_;
}

std::optional<SpillKey> TierManager::OldestLocked(StorageTier tier, const SpillKey& except) const {
  std::optional<SpillKey> oldest;
  uint64_t oldest_at = 0;
  for (const SpilledInfo& info : tier == StorageTier::kHost ? host_.List() : disk_->List()) {
    if (info.key == except || pinned_.contains(info.key)) continue;
    auto it = stored_at_.find(info.key);
    const uint64_t at = it == stored_at_.end() ? 0 : it->second;
    if (!oldest || at < oldest_at) {
      oldest = info.key;
      oldest_at = at;
    }
  }
  return oldest;
}

absl::Status TierManager::PutDiskLocked(const SpillKey& key, const SpilledSequence& data) {
  if (!disk_) return disk_status_;
  const uint64_t capacity = disk_->capacity_bytes();
  if (capacity != 0 && data.bytes() > capacity) {
    return absl::ResourceExhaustedError(
        absl::StrCat("sequence ", key.sequence_id, " needs ", data.bytes(),
                     " bytes, more than the disk tier holds (--disk_tier_bytes ", capacity, ")"));
  }
  while (true) {
    absl::Status status = disk_->Put(key, data, absl::Now());
    if (status.ok()) {
      deleted_.erase(key);
      return status;
    }
    // Over the configured capacity (not a full disk): delete the oldest copy and retry.
    const uint64_t replaced = disk_->Find(key) ? disk_->Find(key)->bytes : 0;
    const bool over_capacity = capacity != 0 &&
                               status.code() == absl::StatusCode::kResourceExhausted &&
                               disk_->used_bytes() - replaced + data.bytes() > capacity;
    if (!demote_ || !over_capacity) return status;
    std::optional<SpillKey> victim = OldestLocked(StorageTier::kDisk, key);
    if (!victim) return status;
    KVS_RETURN_IF_ERROR(disk_->Erase(*victim));
    stored_at_.erase(*victim);
    if (deleted_.size() >= kMaxDeletedKeys) deleted_.clear();
    deleted_.insert(*victim);
    ++deleted_from_disk_;
  }
}

absl::Status TierManager::PutHostLocked(const SpillKey& key,
                                        std::shared_ptr<const SpilledSequence> data) {
  if (data->bytes() > host_.capacity_bytes()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "sequence ", key.sequence_id, " needs ", data->bytes(),
        " bytes, more than the host tier holds (--host_tier_bytes ", host_.capacity_bytes(), ")"));
  }
  while (true) {
    absl::Status status = host_.Put(key, data, absl::Now());
    if (status.ok() || !demote_ || !disk_ ||
        status.code() != absl::StatusCode::kResourceExhausted) {
      return status;
    }
    // Make room: the least recently stored host copy goes to disk.
    std::optional<SpillKey> victim = OldestLocked(StorageTier::kHost, key);
    if (!victim) return status;
    std::shared_ptr<const SpilledSequence> moved = host_.Get(*victim);
    if (absl::Status demoted = PutDiskLocked(*victim, *moved); !demoted.ok()) {
      return absl::Status(status.code(), absl::StrCat(status.message(), "; moving the oldest host ",
                                                      "copy to disk failed: ", demoted.message()));
    }
    host_.Erase(*victim);
    ++demoted_to_disk_;
  }
}

absl::Status TierManager::EraseRemoteIfMine(const SpillKey& key) {
  if (!remote_) return absl::OkStatus();
  {
    absl::MutexLock lock(&mu_);
    if (!remote_mine_.contains(std::make_pair(key.tenant, key.sequence_id))) {
      return absl::OkStatus();
    }
  }
  KVS_RETURN_IF_ERROR(remote_->Erase(key));
  absl::MutexLock lock(&mu_);
  remote_mine_.erase(std::make_pair(key.tenant, key.sequence_id));
  return absl::OkStatus();
}

absl::Status TierManager::Put(StorageTier tier, const SpillKey& key, SpilledSequence data) {
  if (tier == StorageTier::kRemote) {
    if (!remote_) {
      SpillBuffers::Default().Give(std::move(data.layers));
      return absl::FailedPreconditionError(
          "no remote tier is configured (start the sidecar with --remote_tier=redis://...)");
    }
    // Outside mu_: a large copy takes a while on the network.
    absl::Status status = remote_->Put(key, data, absl::Now());
    SpillBuffers::Default().Give(std::move(data.layers));
    KVS_RETURN_IF_ERROR(status);
    absl::MutexLock lock(&mu_);
    remote_mine_.insert(std::make_pair(key.tenant, key.sequence_id));
    host_.Erase(key);
    if (disk_) KVS_RETURN_IF_ERROR(disk_->Erase(key));
    stored_at_[key] = ++clock_;
    deleted_.erase(key);
    return absl::OkStatus();
  }
  // Stored here, the copy leaves the remote tier (if it is this sidecar's there).
  absl::Status local = PutLocal(tier, key, std::move(data));
  if (!local.ok()) return local;
  return EraseRemoteIfMine(key);
}

absl::Status TierManager::PutLocal(StorageTier tier, const SpillKey& key, SpilledSequence data) {
  absl::MutexLock lock(&mu_);
  switch (tier) {
    case StorageTier::kHost:
      // The layer buffers go back to the spill buffer cache when the copy's last reader is done.
      KVS_RETURN_IF_ERROR(PutHostLocked(key, SpillBuffers::Default().Share(std::move(data))));
      if (disk_) KVS_RETURN_IF_ERROR(disk_->Erase(key));
      break;
    case StorageTier::kDisk: {
      absl::Status status = PutDiskLocked(key, data);
      // Written (or not): the buffers serve the next spill.
      SpillBuffers::Default().Give(std::move(data.layers));
      KVS_RETURN_IF_ERROR(status);
      host_.Erase(key);
      break;
    }
    case StorageTier::kArena:
    case StorageTier::kRemote:
      return absl::InvalidArgumentError(
          "a spill target must be the host, the disk or the remote tier");
  }
  stored_at_[key] = ++clock_;
  deleted_.erase(key);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const SpilledSequence>> TierManager::Get(const SpillKey& key) {
  {
    absl::MutexLock lock(&mu_);
    if (std::shared_ptr<const SpilledSequence> data = host_.Get(key)) return data;
    if (deleted_.contains(key)) {
      return absl::NotFoundError(absl::StrCat(
          "the spilled copy of sequence ", key.sequence_id,
          " was deleted, oldest first, to keep the disk tier within --disk_tier_bytes"));
    }
    if (disk_ && (!remote_ || disk_->Find(key))) return disk_->Get(key);
    if (!remote_) {
      return absl::NotFoundError(
          absl::StrCat("sequence ", key.sequence_id, " has no spilled copy"));
    }
  }
  // The remote tier, outside mu_ (network). Get claims the copy for this sidecar.
  absl::StatusOr<std::shared_ptr<const SpilledSequence>> data = remote_->Get(key);
  if (data.ok()) {
    absl::MutexLock lock(&mu_);
    remote_mine_.insert(std::make_pair(key.tenant, key.sequence_id));
  }
  return data;
}

absl::StatusOr<std::shared_ptr<const SpilledSequence>> TierManager::Read(const SpillKey& key) {
  {
    absl::MutexLock lock(&mu_);
    if (std::shared_ptr<const SpilledSequence> data = host_.Get(key)) return data;
    if (deleted_.contains(key)) {
      return absl::NotFoundError(absl::StrCat(
          "the copy ", key.sequence_id,
          " was deleted, oldest first, to keep the disk tier within --disk_tier_bytes"));
    }
    if (disk_ && (!remote_ || disk_->Find(key))) return disk_->Get(key);
    if (!remote_) return absl::NotFoundError(absl::StrCat("no copy ", key.sequence_id));
  }
  // Unclaimed: a published prefix is read by many sidecars at once and never consumed.
  return remote_->Get(key, /*claim=*/false);
}

absl::Status TierManager::EraseShared(const SpillKey& key) {
  {
    absl::MutexLock lock(&mu_);
    host_.Erase(key);
    stored_at_.erase(key);
    deleted_.erase(key);
    if (disk_) KVS_RETURN_IF_ERROR(disk_->Erase(key));
  }
  if (!remote_) return absl::OkStatus();
  KVS_RETURN_IF_ERROR(remote_->Erase(key));
  absl::MutexLock lock(&mu_);
  remote_mine_.erase(std::make_pair(key.tenant, key.sequence_id));
  return absl::OkStatus();
}

void TierManager::Release(const SpillKey& key) {
  if (remote_) remote_->Release(key);
}

uint64_t TierManager::TenantRemoteBytes(const std::string& tenant) const {
  if (!remote_) return 0;
  absl::StatusOr<uint64_t> bytes = remote_->TenantBytes(tenant);
  return bytes.ok() ? *bytes : 0;
}

absl::Status TierManager::PutPinnedHost(const SpillKey& key,
                                        std::shared_ptr<const SpilledSequence> data) {
  absl::MutexLock lock(&mu_);
  KVS_RETURN_IF_ERROR(PutHostLocked(key, std::move(data)));
  pinned_.insert(key);
  return absl::OkStatus();
}

absl::Status TierManager::Erase(const SpillKey& key) {
  {
    absl::MutexLock lock(&mu_);
    pinned_.erase(key);
    host_.Erase(key);
    stored_at_.erase(key);
    deleted_.erase(key);
    if (disk_) KVS_RETURN_IF_ERROR(disk_->Erase(key));
  }
  return EraseRemoteIfMine(key);
}

std::optional<SpilledInfo> TierManager::Find(const SpillKey& key) const {
  if (std::optional<SpilledInfo> info = host_.Find(key)) return info;
  if (disk_) {
    if (std::optional<SpilledInfo> info = disk_->Find(key)) return info;
  }
  if (remote_) {
    // Under the caller's key: a remote copy has no session in its name.
    if (std::optional<SpilledInfo> info = remote_->Find(key)) {
      info->key = key;
      return info;
    }
  }
  return std::nullopt;
}

std::vector<SpilledInfo> TierManager::List() const {
  std::vector<SpilledInfo> result = host_.List();
  {
    absl::MutexLock lock(&mu_);
    result.erase(std::remove_if(result.begin(), result.end(),
                                [this](const SpilledInfo& info) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                  return pinned_.contains(info.key);
                                }),
                 result.end());
  }
  if (disk_) {
    std::vector<SpilledInfo> disk = disk_->List();
    result.insert(result.end(), disk.begin(), disk.end());
  }
  if (remote_) {
    std::vector<SpilledInfo> remote = remote_->List();
    result.insert(result.end(), remote.begin(), remote.end());
  }
  std::sort(result.begin(), result.end(),
            [](const SpilledInfo& a, const SpilledInfo& b) { return a.key < b.key; });
  return result;
}

uint64_t TierManager::TenantBytes(const std::string& tenant, bool host) const {
  if (host) return host_.TenantBytes(tenant);
  return disk_ ? disk_->TenantBytes(tenant) : 0;
}

TierStats TierManager::GetStats() const {
  TierStats stats;
  stats.host_bytes_used = host_.used_bytes();
  stats.host_bytes_capacity = host_.capacity_bytes();
  stats.disk_available = disk_ != nullptr;
  stats.remote_configured = remote_ != nullptr;
  if (disk_) {
    stats.disk_bytes_used = disk_->used_bytes();
    stats.disk_bytes_capacity = disk_->capacity_bytes();
  }
  absl::MutexLock lock(&mu_);
  stats.demoted_to_disk = demoted_to_disk_;
  stats.deleted_from_disk = deleted_from_disk_;
  return stats;
}

}  // namespace kvs::storage
