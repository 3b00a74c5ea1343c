#include "cache/session_ref.h"

#include "cache/internal/session.h"

namespace kvs {

const std::string& SessionRef::id() const { return session_->id; }
const std::string& SessionRef::tenant() const { return session_->tenant; }
const ModelLayout& SessionRef::layout() const { return session_->layout; }
int32_t SessionRef::num_blocks() const { return session_->num_blocks; }

absl::StatusOr<SessionRef> WeakSessionRef::Lock() const {
  std::shared_ptr<Session> session = session_.lock();
  if (session == nullptr) return SessionGone(id_);
  return SessionRef(std::move(session));
}

}  // namespace kvs
