// BatchSessions: the sessions a batch call (CommitBatch, DecodeStep, Select) names, each looked
// up once in the SessionTable however many items name it, and locked together in id order (so
// two batches never wait on each other) for calls that validate every item against exactly the
// state it then runs on.
#ifndef KVSIDECAR_CACHE_INTERNAL_BATCH_SESSIONS_H_
#define KVSIDECAR_CACHE_INTERNAL_BATCH_SESSIONS_H_

#include <algorithm>
#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "cache/internal/session.h"
#include "cache/internal/session_table.h"

namespace kvs {

class BatchSessions {
 public:
  // A session the caller already looked up: Find uses it for the items that name it.
  void Add(std::shared_ptr<Session> session) {
    for (const std::shared_ptr<Session>& known : sessions_) {
      if (known == session) return;
    }
    sessions_.push_back(std::move(session));
  }

  // Looks up the session of every item (those added are not looked up again); on failure, `failed` is the first item whose session is
  // unknown or expired.
  template <typename Item>
  absl::Status Find(const SessionTable& table, absl::Span<const Item> items, size_t* failed) {
    of_.resize(items.size());
    for (size_t i = 0; i < items.size(); ++i) {
      size_t k = 0;
      while (k < sessions_.size() && sessions_[k]->id != items[i].session_id) ++k;
      if (k == sessions_.size()) {
        absl::StatusOr<std::shared_ptr<Session>> session = table.Find(items[i].session_id);
        if (!session.ok()) {
          *failed = i;
          return session.status();
        }
        sessions_.push_back(*std::move(session));
      }
      of_[i] = k;
    }
    return absl::OkStatus();
  }

  void LockAll() {
    lock_order_.resize(sessions_.size());
    for (size_t k = 0; k < lock_order_.size(); ++k) lock_order_[k] = k;
    std::sort(lock_order_.begin(), lock_order_.end(),
              [&](size_t a, size_t b) { return sessions_[a]->id < sessions_[b]->id; });
    for (size_t k : lock_order_) sessions_[k]->mu.Lock();
  }
  // Refreshes each session's free-block hint and unlocks it.
  void UnlockAll() {
    for (auto it = lock_order_.rbegin(); it != lock_order_.rend(); ++it) {
      Session& session = *sessions_[*it];
      session.mu.AssertHeld();
      session.free_blocks_hint = session.allocator.free_blocks();
      session.mu.Unlock();
    }
    lock_order_.clear();
  }

  Session& of(size_t item) const { return *sessions_[of_[item]]; }
  size_t index_of(size_t item) const { return of_[item]; }
  const std::vector<std::shared_ptr<Session>>& sessions() const { return sessions_; }

 private:
  std::vector<std::shared_ptr<Session>> sessions_;
  std::vector<size_t> of_;  // per item: its session's index in sessions_
  std::vector<size_t> lock_order_;
};

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_INTERNAL_BATCH_SESSIONS_H_
