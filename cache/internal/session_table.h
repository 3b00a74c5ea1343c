// SessionTable: the attached sessions by id, their leases and the pool's arena capacity. It
// admits a new session (session count, arena bytes), finds a live one (a lapsed lease ends it
// even before the reaper runs), renews leases and takes sessions out when they end. It does not
// release what a session holds: KvPool does that with the ledger and the tiers.
//
// Threading: thread-safe; its lock is held only around the map and the capacity counters, never
// while a session lock is taken.
#ifndef KVSIDECAR_CACHE_INTERNAL_SESSION_TABLE_H_
#define KVSIDECAR_CACHE_INTERNAL_SESSION_TABLE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cache/clock.h"
#include "cache/internal/session.h"
#include "cache/pool_options.h"
#include "cache/session_types.h"

namespace kvs {

// An Attach request resolved against the pool's options: the arena it gets and what it costs.
// The largest query staging area a session may ask for.
inline constexpr uint64_t kMaxStagingBytes = uint64_t{1} << 30;

struct AttachPlan {
  AttachParams params;  // block_tokens and tenant defaulted
  int32_t num_blocks = 0;
  uint64_t staging_offset = 0;  // num_blocks * block_bytes, rounded up to 256 bytes
  uint64_t arena_bytes = 0;     // the blocks, then staging_bytes of query staging
  uint64_t charge = 0;          // arena_bytes rounded up to whole pages
  absl::Duration lease;
};

class SessionTable {
 public:
  // `clock` and `options` must outlive the table.
  SessionTable(const Clock* clock, const PoolOptions* options);
  SessionTable(const SessionTable&) = delete;
  SessionTable& operator=(const SessionTable&) = delete;

  // A fresh session id: 32 hex digits from the kernel's CSPRNG.
  static std::string NewSessionId();

  // Validates `params` (INVALID_ARGUMENT naming the field) and sizes the session's arena.
  absl::StatusOr<AttachPlan> Plan(const AttachParams& params) const;
  // Claims room for the planned session (the session limit, the pool's arena capacity:
  // RESOURCE_EXHAUSTED) while its arena is created outside the lock. Every successful Claim ends
  // in exactly one Insert or Unclaim.
  absl::Status Claim(const AttachPlan& plan);
  void Unclaim(const AttachPlan& plan);
  // Adds the session its claim was for (INTERNAL on an id collision, the claim given back).
  absl::Status Insert(std::shared_ptr<Session> session);

  // The live session under `session_id`: NOT_FOUND when unknown or its lease has lapsed.
  absl::StatusOr<std::shared_ptr<Session>> Find(std::string_view session_id) const;
  // Whether a session is attached under `session_id` (lapsed lease or not).
  bool Contains(std::string_view session_id) const;
  // Extends the session's lease from now; NOT_FOUND if it ended meanwhile.
  absl::StatusOr<HeartbeatResult> Renew(std::string_view session_id);
  // The same for a session already found: NOT_FOUND unless the table still holds this session.
  absl::StatusOr<HeartbeatResult> Renew(const std::shared_ptr<Session>& session);

  // Takes the session out of the table (NOT_FOUND if gone); `reclaimed` counts it as reclaimed.
  absl::StatusOr<std::shared_ptr<Session>> Remove(std::string_view session_id, bool reclaimed);
  // The same for a session already found: NOT_FOUND unless the table still holds this session
  // (a session that ended is not confused with a later one under the same id).
  absl::StatusOr<std::shared_ptr<Session>> Remove(const std::shared_ptr<Session>& session,
                                                  bool reclaimed);
  // Takes out every session whose lease lapsed at `now`, counting them as reclaimed.
  std::vector<std::shared_ptr<Session>> TakeExpired(absl::Time now);
  // Takes out every session (the pool is going away).
  std::vector<std::shared_ptr<Session>> TakeAll();

  // The sessions now (all, or those of `tenant`; "*" is not special here).
  std::vector<std::shared_ptr<Session>> All() const;
  std::vector<std::shared_ptr<Session>> OfTenant(std::string_view tenant) const;
  // Runs fn on every session under the table's lock: fn must not block or take a session lock.
  void ForEach(const std::function<void(const Session&)>& fn) const;

  struct Totals {
    int32_t sessions = 0;
    uint64_t arena_bytes_reserved = 0;  // sum of the sessions' charges
    int64_t sessions_reclaimed = 0;
  };
  Totals GetTotals() const;

 private:
  const Clock* const clock_;
  const PoolOptions* const options_;

  using SessionMap = absl::flat_hash_map<std::string, std::shared_ptr<Session>>;

  // Takes the session at `it` out, giving back its arena charge.
  std::shared_ptr<Session> RemoveLocked(SessionMap::iterator it, bool reclaimed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  SessionMap sessions_ ABSL_GUARDED_BY(mu_);
  uint64_t arena_bytes_reserved_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t sessions_reclaimed_ ABSL_GUARDED_BY(mu_) = 0;
  int32_t sessions_pending_ ABSL_GUARDED_BY(mu_) = 0;  // claimed, arena being created
};

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_INTERNAL_SESSION_TABLE_H_
