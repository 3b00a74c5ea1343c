// HostPool: the host-memory tier. A bounded map from SpillKey to a spilled sequence's bytes
// (held as an immutable shared buffer, so that Restore reads it without a copy). Plain memory
// (the CPU backend; pinned allocation is the CUDA backend's business, not built yet).
//
// Threading: thread-safe (one internal mutex, held only for map updates).
#ifndef KVSIDECAR_STORAGE_HOST_POOL_H_
#define KVSIDECAR_STORAGE_HOST_POOL_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cache/tier.h"

namespace kvs::storage {

class HostPool {
 public:
  explicit HostPool(uint64_t capacity_bytes) : capacity_bytes_(capacity_bytes) {}

  // Stores `data` under `key` (replacing a previous copy). RESOURCE_EXHAUSTED, naming the
  // capacity, when the pool would exceed it; the previous copy stays then.
  absl::Status Put(const SpillKey& key, std::shared_ptr<const SpilledSequence> data,
                   absl::Time now);
  // Null when there is no copy.
  std::shared_ptr<const SpilledSequence> Get(const SpillKey& key) const;
  // Whether there was a copy.
  bool Erase(const SpillKey& key);
  std::optional<SpilledInfo> Find(const SpillKey& key) const;
  std::vector<SpilledInfo> List() const;
  // Bytes `tenant` holds here.
  uint64_t TenantBytes(const std::string& tenant) const;

  uint64_t capacity_bytes() const { return capacity_bytes_; }
  uint64_t used_bytes() const;

 private:
  struct Entry {
    std::shared_ptr<const SpilledSequence> data;
    uint64_t bytes = 0;
    absl::Time spilled;
  };
  const uint64_t capacity_bytes_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<SpillKey, Entry> entries_ ABSL_GUARDED_BY(mu_);
  uint64_t used_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvs::storage

#endif  // KVSIDECAR_STORAGE_HOST_POOL_H_
