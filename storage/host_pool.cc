#include "storage/host_pool.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvs::storage {

absl::Status HostPool::Put(const SpillKey& key, std::shared_ptr<const SpilledSequence> data,
                           absl::Time now) {
  const uint64_t bytes = data->bytes();
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(key);
  const uint64_t replaced = it == entries_.end() ? 0 : it->second.bytes;
  const uint64_t after = used_bytes_ - replaced + bytes;
  if (after > capacity_bytes_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the host tier holds ", used_bytes_ - replaced, " of its ", capacity_bytes_,
                     " bytes (--host_tier_bytes); sequence ", key.sequence_id, " needs ", bytes));
  }
  used_bytes_ = after;
  entries_[key] = Entry{std::move(data), bytes, now};
  return absl::OkStatus();
}

std::shared_ptr<const SpilledSequence> HostPool::Get(const SpillKey& key) const {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(key);
  return it == entries_.end() ? nullptr : it->second.data;
}

bool HostPool::Erase(const SpillKey& key) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(key);
  if (it == entries_.end()) return false;
  used_bytes_ -= it->second.bytes;
  entries_.erase(it);
  return true;
}

std::optional<SpilledInfo> HostPool::Find(const SpillKey& key) const {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(key);
  if (it == entries_.end()) return std::nullopt;
  return SpilledInfo{key, StorageTier::kHost, it->second.bytes, it->second.spilled, ""};
}

std::vector<SpilledInfo> HostPool::List() const {
  std::vector<SpilledInfo> result;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, entry] : entries_) {
      result.push_back(SpilledInfo{key, StorageTier::kHost, entry.bytes, entry.spilled, ""});
    }
  }
  std::sort(result.begin(), result.end(),
            [](const SpilledInfo& a, const SpilledInfo& b) { return a.key < b.key; });
  return result;
}

uint64_t HostPool::TenantBytes(const std::string& tenant) const {
  absl::MutexLock lock(&mu_);
  uint64_t total = 0;
  for (const auto& [key, entry] : entries_) {
    if (key.tenant == tenant) total += entry.bytes;
  }
  return total;
}

uint64_t HostPool::used_bytes() const {
  absl::MutexLock lock(&mu_);
  return used_bytes_;
}

}  // namespace kvs::storage
