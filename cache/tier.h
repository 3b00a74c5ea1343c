// SequenceTiers: the interface through which the cache core (KvPool) moves a whole sequence out
// of its session's arena and back: to the host memory tier, the disk tier or the remote tier
// (Redis, shared between sidecars). storage/
// implements it (storage/tier_manager.h); cache/ sees only this header, so it never depends on
// RocksDB or on the storage library.
//
// A spilled sequence is an opaque metadata blob (cache/sequence_snapshot.h encodes it) plus the
// K/V bytes of each layer (its blocks, whole, in block-table order). It is addressed by
// (tenant, session that spilled it, sequence id): sessions die with their worker or with a
// restart, so the disk tier keeps the session id only as part of the name, and the remote tier
// names a copy by (tenant, sequence id) alone (so that a session on another sidecar can adopt
// it; storage/redis/remote_tier.h).
//
// Threading: implementations are thread-safe. Data handed to Put is owned by the tier afterwards;
// what Get returns is immutable and shared.
#ifndef KVSIDECAR_CACHE_TIER_H_
#define KVSIDECAR_CACHE_TIER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvs {

// Where a sequence's bytes live. The values match kvsidecar.v1.Tier.
enum class StorageTier { kArena = 1, kHost = 2, kDisk = 3, kRemote = 4 };

const char* StorageTierName(StorageTier tier);

struct SpillKey {
  std::string tenant;
  std::string session_id;  // the session that spilled the sequence
  std::string sequence_id;

  friend bool operator==(const SpillKey& a, const SpillKey& b) {
    return std::tie(a.tenant, a.session_id, a.sequence_id) ==
           std::tie(b.tenant, b.session_id, b.sequence_id);
  }
  friend bool operator<(const SpillKey& a, const SpillKey& b) {
    return std::tie(a.tenant, a.session_id, a.sequence_id) <
           std::tie(b.tenant, b.session_id, b.sequence_id);
  }
  template <typename H>
  friend H AbslHashValue(H h, const SpillKey& key) {
    return H::combine(std::move(h), key.tenant, key.session_id, key.sequence_id);
  }
};

// Where the layer buffers of a SpilledSequence go when it is destroyed: cache/spill_buffers.h
// installs its pool, which recycles them and unpins a page-locked buffer before freeing it. Null
// (the default): they are freed.
using SpilledLayersRecycler = void (*)(std::vector<std::string>&& layers);
inline std::atomic<SpilledLayersRecycler>& SpilledLayersRecyclerSlot() {
  static std::atomic<SpilledLayersRecycler> slot{nullptr};
  return slot;
}
inline void SetSpilledLayersRecycler(SpilledLayersRecycler recycler) {
  SpilledLayersRecyclerSlot().store(recycler);
}

// The bytes of one spilled sequence.
struct SpilledSequence {
  SpilledSequence() = default;
  SpilledSequence(std::string meta, std::vector<std::string> layers)
      : meta(std::move(meta)), layers(std::move(layers)) {}
  SpilledSequence(const SpilledSequence&) = default;
  SpilledSequence(SpilledSequence&&) = default;
  SpilledSequence& operator=(const SpilledSequence& other) {
    if (this != &other) {
      Recycle();
      meta = other.meta;
      layers = other.layers;
    }
    return *this;
  }
  SpilledSequence& operator=(SpilledSequence&& other) {
    if (this != &other) {
      Recycle();
      meta = std::move(other.meta);
      layers = std::move(other.layers);
    }
    return *this;
  }
  ~SpilledSequence() { Recycle(); }

  std::string meta;                 // EncodeSnapshot(...) of the sequence's full state
  std::vector<std::string> layers;  // per layer: its blocks' bytes, whole, in table order

  // Hands the layer buffers to the recycler (see above); `layers` is left empty.
  void Recycle() {
    if (layers.empty()) return;
    if (SpilledLayersRecycler recycler = SpilledLayersRecyclerSlot().load()) {
      recycler(std::move(layers));
    }
    layers.clear();
  }

  uint64_t bytes() const {
    uint64_t total = meta.size();
    for (const std::string& layer : layers) total += layer.size();
    return total;
  }
};

// One entry of SequenceTiers::List.
struct SpilledInfo {
  SpillKey key;
  StorageTier tier = StorageTier::kHost;
  uint64_t bytes = 0;
  absl::Time spilled;
  // Set for a disk record that failed its checksum (or could not be parsed) when the tier was
  // opened: the sequence is lost; Get answers DATA_LOSS with this message.
  std::string lost;
};

class SequenceTiers {
 public:
  virtual ~SequenceTiers() = default;

  // Stores `data` under `key` in `tier` (kHost, kDisk or kRemote), replacing any copy under that
  // key in another tier. RESOURCE_EXHAUSTED when the tier is full, FAILED_PRECONDITION when the tier is
  // unavailable (the disk tier could not be opened), INVALID_ARGUMENT for kArena. A failed Put
  // leaves the previous copy (if any) as it was.
  virtual absl::Status Put(StorageTier tier, const SpillKey& key, SpilledSequence data) = 0;
  // Host memory a live sequence keeps beside its arena (OmniKV's offloaded prompt K/V), stored in
  // the host tier under `key`: counted in its capacity and in the tenant's host usage, never
  // demoted to disk and not listed by List (it is not a spilled sequence). Erase removes it.
  // RESOURCE_EXHAUSTED when the host tier cannot hold it.
  virtual absl::Status PutPinnedHost(const SpillKey& key,
                                     std::shared_ptr<const SpilledSequence> data) = 0;
  // The stored copy: NOT_FOUND when there is none, DATA_LOSS when it fails its checksum. A copy
  // in the remote tier is claimed for the caller (ABORTED while another sidecar holds the claim)
  // until Erase, or Release when the restore that read it fails.
  virtual absl::StatusOr<std::shared_ptr<const SpilledSequence>> Get(const SpillKey& key) = 0;
  // Gives up the claim a Get took (a restore that failed after it); a no-op for local tiers.
  virtual void Release(const SpillKey& key) { (void)key; }
  // Deletes the copy (a no-op when there is none).
  virtual absl::Status Erase(const SpillKey& key) = 0;
  // Published prefixes (KvPool::Publish): copies read many times, by any sidecar sharing the
  // remote tier, and never claimed. Read is Get without the claim (NOT_FOUND, DATA_LOSS as Get);
  // EraseShared deletes the copy wherever it is, a remote copy written by another sidecar
  // included; has_remote says whether a remote tier is configured.
  virtual absl::StatusOr<std::shared_ptr<const SpilledSequence>> Read(const SpillKey& key) {
    absl::StatusOr<std::shared_ptr<const SpilledSequence>> data = Get(key);
    if (data.ok()) Release(key);
    return data;
  }
  virtual absl::Status EraseShared(const SpillKey& key) { return Erase(key); }
  virtual bool has_remote() const { return false; }
  // The entry of `key`, if any.
  virtual std::optional<SpilledInfo> Find(const SpillKey& key) const = 0;
  // Every stored sequence (lost ones included), ordered by key.
  virtual std::vector<SpilledInfo> List() const = 0;
};

inline const char* StorageTierName(StorageTier tier) {
  switch (tier) {
    case StorageTier::kArena:
      return "arena";
    case StorageTier::kHost:
      return "host";
    case StorageTier::kDisk:
      return "disk";
    case StorageTier::kRemote:
      return "remote";
  }
  return "unknown";
}

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_TIER_H_
