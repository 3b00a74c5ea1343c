// SessionRef: a handle on one attached session as KvPool::FindSession found it, so that a call
// which needs the session's layout or owner before it reaches the pool (to validate layers or
// attention sizes, to check the caller's tenant) looks the session up once: the handler reads
// what it needs from the handle and passes the handle to the pool's calls that take one.
//
// The handle keeps the session's memory alive, not the session. A session detached or reclaimed
// after the lookup answers every pool call made through the handle exactly as an unknown session
// does (NOT_FOUND "session <id> not found"), and changes nothing. The lease is checked at the
// lookup: a handle is meant to live for one RPC, not to be kept (a streaming call that spans
// many steps keeps a WeakSessionRef instead).
#ifndef KVSIDECAR_CACHE_SESSION_REF_H_
#define KVSIDECAR_CACHE_SESSION_REF_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "gpu/base/layout.h"

namespace kvs {

class Session;  // cache/internal/session.h
class KvPool;   // cache/pool.h

class SessionRef {
 public:
  // Identity fields of the session; they never change while it is attached.
  const std::string& id() const;
  const std::string& tenant() const;  // owner (authorization checks)
  const ModelLayout& layout() const;
  int32_t num_blocks() const;  // of its arena

 private:
  friend class KvPool;
  friend class WeakSessionRef;
  explicit SessionRef(std::shared_ptr<Session> session) : session_(std::move(session)) {}

  std::shared_ptr<Session> session_;  // never null
};

// A SessionRef that does not keep the session's memory, for a call that spans many steps (an
// Export stream, read chunk by chunk as the client takes them): a session that ends mid-call
// frees its arena at once rather than when a slow client ends the stream. Lock() gives a
// SessionRef for one step, without a lookup.
class WeakSessionRef {
 public:
  explicit WeakSessionRef(const SessionRef& session)
      : id_(session.id()), session_(session.session_) {}

  // The session's handle; NOT_FOUND "session <id> not found", as a lookup answers, once its
  // memory is gone (a session that ended but is still held elsewhere answers the same through
  // the pool's calls).
  absl::StatusOr<SessionRef> Lock() const;

 private:
  std::string id_;
  std::weak_ptr<Session> session_;
};

}  // namespace kvs

#endif  // KVSIDECAR_CACHE_SESSION_REF_H_
