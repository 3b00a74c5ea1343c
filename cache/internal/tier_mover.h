// TierMover: moves sequences between a session's arena and the storage tiers (cache/tier.h):
// Spill and Restore (adoption of another session's copy included), the automatic restore of a
// spilled sequence that a data-plane call names, demotion under arena pressure, publishing a
// sequence as a compressed prefix and reading one back, and what a session's copies become when
// it ends. Every byte it stores is first admitted by the TenantLedger.
//
// Threading: thread-safe. Methods named *Locked run under the session's lock; the others take it
// themselves. Its own lock (adoption claims) is a leaf.
#ifndef KVSIDECAR_CACHE_INTERNAL_TIER_MOVER_H_
#define KVSIDECAR_CACHE_INTERNAL_TIER_MOVER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "cache/internal/session.h"
#include "cache/internal/session_table.h"
#include "cache/internal/tenant_ledger.h"
#include "cache/pool_options.h"
#include "cache/sequence.h"
#include "cache/sequence_types.h"
#include "cache/tier.h"
#include "cache/tier_types.h"
#include "gpu/backend.h"

namespace kvs {

class TierMover {
 public:
  // Every pointer must outlive the mover; options->tiers may be null (then every move is
  // UNIMPLEMENTED and HostPinFor is empty).
  TierMover(Backend* backend, const PoolOptions* options, const SessionTable* sessions,
            TenantLedger* ledger);
  TierMover(const TierMover&) = delete;
  TierMover& operator=(const TierMover&) = delete;

  bool has_tiers() const { return options_->tiers != nullptr; }
  // UNIMPLEMENTED: the pool was built without tiers.
  static absl::Status NoTiers();

  // The session's pin into the host tier (Session::host_pin), held to the tenant's host quota.
  HostPin HostPinFor(const std::string& tenant, const std::string& session_id) const;

  // Brings spilled sequence `sequence_id` of `session` back into its arena (the automatic restore
  // of a data-plane call), held to the tenant's arena quota.
  absl::Status RestoreSpilledLocked(Session& session, std::string_view sequence_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(session.mu);
  // Arena pressure (PoolOptions::spill_on_pressure): spills the session's least recently used
  // sequence other than `keep` (none with a pending reservation) to the host tier. False when
  // there is none or it could not be stored; nothing changed then.
  bool DemoteOneLocked(Session& session, const Sequence& keep, const SequenceEnv& env)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(session.mu);
  int64_t spilled_on_pressure() const { return spilled_on_pressure_.load(); }

  // KvPool::Spill / Restore / Publish / Unpublish on a session found by the caller.
  absl::StatusOr<SpillResult> Spill(Session& session, std::string_view sequence_id,
                                    StorageTier target);
  absl::StatusOr<SpillResult> Restore(Session& session, std::string_view sequence_id,
                                      std::string_view from_session_id);
  // Publish's `target`: nullopt = the remote tier when there is one, else disk.
  absl::StatusOr<SpillResult> Publish(Session& session, std::string_view sequence_id,
                                      std::string_view prefix_key, int32_t query_window,
                                      std::optional<StorageTier> target);
  absl::Status Unpublish(const Session& session, std::string_view prefix_key);
  // Where the session's tenant has a prefix under `prefix_key`, if it has one (reads nothing).
  std::optional<SpilledInfo> FindPrefix(const Session& session, std::string_view prefix_key) const;
  // The copy published under params.from_prefix by the session's tenant, checked against the
  // session's layout and the request's policy and budget (what a sequence started from it gets).
  absl::StatusOr<std::shared_ptr<const SpilledSequence>> ReadPrefix(
      const Session& session, const SequenceParams& params) const;

  // A session ends: its host copies go, its disk and remote copies stay for adoption. Returns
  // how many spilled sequences it had.
  int32_t EndSpilledLocked(Session& session) ABSL_EXCLUSIVE_LOCKS_REQUIRED(session.mu);
  // A spilled sequence is released: its copy is dropped.
  absl::Status DropSpilledLocked(Session& session, std::string_view sequence_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(session.mu);

  std::vector<SpilledInfo> List() const;
  // Where a spilled sequence is now (the tiers may have demoted it); nullopt without tiers.
  std::optional<SpilledInfo> Find(const SpillKey& key) const;

 private:
  // Restores `key`'s copy into `session` as its sequence of the same id.
  absl::Status RestoreKeyLocked(Session& session, const SpillKey& key)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(session.mu);
  // Spill of a sequence that is already spilled: moves it between the tiers.
  absl::StatusOr<SpillResult> MoveSpilledLocked(Session& session, SpilledSequenceInfo& spilled,
                                                const SpillKey& key, StorageTier target)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(session.mu);
  // Restore with from_session_id: adopts the copy of an ended session.
  absl::StatusOr<SpillResult> AdoptLocked(Session& session, const SpillKey& key)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(session.mu);
  // Restore's `from_session_id`: not a session still attached (adoption), not a prefix.
  absl::Status CheckRestoreSource(std::string_view from_session_id, bool adopt) const;
  // Claims `key` for adoption by `session_id` (ABORTED if another session holds the claim); the
  // claim is dropped when the Restore that took it returns.
  absl::Status ClaimAdoption(const SpillKey& key, const std::string& session_id);

  Backend* const backend_;
  const PoolOptions* const options_;
  const SessionTable* const sessions_;
  TenantLedger* const ledger_;
  std::atomic<int64_t> spilled_on_pressure_{0};

  // Spilled copies being adopted (Restore with from_session_id) -> the adopting session, so
  // that two sessions never both restore one copy.
  absl::Mutex adopt_mu_;
  absl::flat_hash_map<SpillKey, std::string> adopting_ ABSL_GUARDED_BY(adopt_mu_);
};

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_INTERNAL_TIER_MOVER_H_
