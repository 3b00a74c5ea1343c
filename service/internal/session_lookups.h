// SessionLookups: the sessions one RPC names, each looked up once (KvPool::FindSession) and
// remembered for the rest of the RPC. SidecarService::Authorize checks the caller's tenant on the
// handles it finds here, and the handler then takes the same handles for its layout checks and
// the pool's calls, so that a call with data auth on does not look a session up twice (a decode
// batch names one session many times; the lookup takes the session table's lock).
//
// A handle keeps the session's memory, not the session (cache/session_ref.h): a session that
// ends after the lookup answers the pool's calls NOT_FOUND, as an unknown one does. An unknown
// session's NOT_FOUND is remembered too, so the RPC sees one answer per session id.
//
// One per RPC, on the handler's thread; not thread-safe. Internal to service/.
#ifndef KVSIDECAR_SERVICE_INTERNAL_SESSION_LOOKUPS_H_
#define KVSIDECAR_SERVICE_INTERNAL_SESSION_LOOKUPS_H_

#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cache/pool.h"
#include "cache/session_ref.h"

namespace kvs {
namespace service_internal {

class SessionLookups {
 public:
  explicit SessionLookups(const KvPool& pool) : pool_(pool) {}
  SessionLookups(const SessionLookups&) = delete;
  SessionLookups& operator=(const SessionLookups&) = delete;

  // The session under `session_id`: looked up on the first call, the same answer afterwards.
  absl::StatusOr<SessionRef> Find(std::string_view session_id) {
    auto it = lookups_.find(Key(session_id));
    if (it == lookups_.end()) {
      it = lookups_.emplace(std::string(session_id), pool_.FindSession(session_id)).first;
      if (it->second.ok()) found_.push_back(*it->second);
    }
    return it->second;
  }

  // True when `session_id` was looked up already (found or not).
  bool Looked(std::string_view session_id) const { return lookups_.contains(Key(session_id)); }

  // Every session found so far, in the order first looked up: what the pool's batch calls take
  // as `found`, so that they look up none of these again.
  const std::vector<SessionRef>& found() const { return found_; }

 private:
  static absl::string_view Key(std::string_view id) { return {id.data(), id.size()}; }

  const KvPool& pool_;
  absl::flat_hash_map<std::string, absl::StatusOr<SessionRef>> lookups_;
  std::vector<SessionRef> found_;
};

}  // namespace service_internal
}  // namespace kvs

#endif  // KVSIDECAR_SERVICE_INTERNAL_SESSION_LOOKUPS_H_
