// SidecarService, sessions: Attach, Heartbeat, Detach, and the Watch streams (one per session at
// most) with the hooks the Admin service and the server use to drain and end them.
#include <algorithm>
#include <deque>
#include <optional>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "cache/policy/policy.h"
#include "cache/policy/registry.h"
#include "gpu/base/checked_math.h"
#include "gpu/base/status_macros.h"
#include "service/arena_fd_server.h"
#include "service/convert.h"
#include "service/internal/failed_reactors.h"
#include "service/internal/session_lookups.h"
#include "service/log.h"
#include "service/rpc_guard.h"
#include "service/sidecar_service.h"
#include "service/status_convert.h"

namespace kvs {

namespace v1 = ::kvsidecar::v1;

using service_internal::FailedWriteReactor;
using service_internal::SessionLookups;

// ---- Watch -------------------------------------------------------------------------------------

// One open Watch stream. Kept alive by `self_` until gRPC calls OnDone (and by the service's map
// while registered). Writes are queued: gRPC allows one outstanding write per stream.
class WatchReactor final : public grpc::ServerWriteReactor<v1::SessionEvent> {
 public:
  WatchReactor(SidecarService* service, std::string session_id)
      : service_(service), session_id_(std::move(session_id)) {}

  const std::string& session_id() const { return session_id_; }

  // Binds the reactor's lifetime to the RPC and sends KIND_WATCHING.
  void Begin(std::shared_ptr<WatchReactor> self) {
    self_ = std::move(self);
    Send(v1::SessionEvent::KIND_WATCHING);
  }

  void Send(v1::SessionEvent::Kind kind) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (finish_requested_ || finished_) return;
    v1::SessionEvent event;
    event.set_kind(kind);
    queue_.push_back(std::move(event));
    if (!writing_) WriteNextLocked();
  }

  // Ends the stream from the server side once queued events are out. The session is not
  // reclaimed for it.
  void End(const grpc::Status& status) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (finish_requested_ || finished_) return;
    finish_requested_ = true;
    finish_status_ = status;
    if (!writing_) WriteNextLocked();
  }

  void OnWriteDone(bool ok) override ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) {  // the stream is broken (cancelled, connection gone): nothing more can be sent
      queue_.clear();
      FinishLocked(finish_requested_ ? finish_status_ : grpc::Status::CANCELLED);
      return;
    }
    WriteNextLocked();
  }

  void OnCancel() override ABSL_LOCKS_EXCLUDED(mu_) {
    bool reclaim = false;
    {
      absl::MutexLock lock(&mu_);
      // A stream the server ended itself (Detach, drain, shutdown) releases nothing more.
      reclaim = !finish_requested_;
      queue_.clear();
      if (!writing_) FinishLocked(grpc::Status::CANCELLED);  // else OnWriteDone(false) does it
    }
    if (!reclaim) return;
    // The worker is gone (or gave up the session): reclaim without waiting for the lease.
    absl::Status status = Guarded("Watch", [&]() -> absl::Status {
      auto released = service_->pool()->Reclaim(session_id_);
      if (released.ok()) {
        KVS_LOG(kInfo, "session_reclaimed")
        ("session", session_id_)("reason", "watch_ended")("sequences", released->sequences)(
            "blocks", released->blocks);
      } else if (released.status().code() != absl::StatusCode::kNotFound) {
        return released.status();
      }
      return absl::OkStatus();
    });
    (void)status;
  }

  void OnDone() override {
    service_->Unregister(session_id_, this);
    // Dropping the last reference destroys `this`: nothing may touch members after this line.
    std::shared_ptr<WatchReactor> keep_alive_until_return = std::move(self_);
  }

 private:
  void WriteNextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    if (queue_.empty()) {
      if (finish_requested_) FinishLocked(finish_status_);
      return;
    }
    current_ = std::move(queue_.front());
    queue_.pop_front();
    writing_ = true;
    StartWrite(&current_);
  }

  void FinishLocked(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    finished_ = true;
    Finish(status);  // OnDone is never run inline from Finish for these reactors
  }

  SidecarService* const service_;
  const std::string session_id_;
  std::shared_ptr<WatchReactor> self_;

  absl::Mutex mu_;
  std::deque<v1::SessionEvent> queue_ ABSL_GUARDED_BY(mu_);
  v1::SessionEvent current_ ABSL_GUARDED_BY(mu_);  // the event being written
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_requested_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status finish_status_ ABSL_GUARDED_BY(mu_);
};

void SidecarService::StartDraining() {
  if (draining_.exchange(true)) return;
  KVS_LOG(kInfo, "draining")("watchers", active_watches());
  std::vector<std::shared_ptr<WatchReactor>> watchers;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, reactor] : watchers_) watchers.push_back(reactor);
  }
  for (auto& reactor : watchers) reactor->Send(v1::SessionEvent::KIND_DRAINING);
}

void SidecarService::EndWatch(absl::string_view session_id, const grpc::Status& status) {
  std::shared_ptr<WatchReactor> reactor;
  {
    absl::MutexLock lock(&mu_);
    auto it = watchers_.find(session_id);
    if (it == watchers_.end()) return;
    reactor = it->second;
  }
  reactor->End(status);
}

void SidecarService::EndOrphanWatches() {
  std::vector<std::shared_ptr<WatchReactor>> watchers;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, reactor] : watchers_) watchers.push_back(reactor);
  }
  for (auto& reactor : watchers) {
    if (pool_->GetSession(reactor->session_id()).status().code() == absl::StatusCode::kNotFound) {
      reactor->End(grpc::Status(grpc::StatusCode::NOT_FOUND,
                                absl::StrCat("session '", reactor->session_id(),
                                             "' ended: its lease expired or it was released")));
    }
  }
}

void SidecarService::Shutdown() {
  std::vector<std::shared_ptr<WatchReactor>> watchers;
  {
    absl::MutexLock lock(&mu_);
    shutting_down_ = true;
    for (auto& [id, reactor] : watchers_) watchers.push_back(reactor);
  }
  for (auto& reactor : watchers) reactor->End(grpc::Status::OK);
}

int SidecarService::active_watches() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(watchers_.size());
}

void SidecarService::Unregister(const std::string& session_id, const WatchReactor* reactor) {
  absl::MutexLock lock(&mu_);
  auto it = watchers_.find(session_id);
  if (it != watchers_.end() && it->second.get() == reactor) watchers_.erase(it);
}

grpc::ServerUnaryReactor* SidecarService::Attach(grpc::CallbackServerContext* context,
                                                 const v1::AttachRequest* request,
                                                 v1::AttachResponse* response) {
  return RunUnary(context, "Attach", [&]() -> absl::Status {
    std::optional<std::string> caller;  // the token's tenant; nullopt = data plane open
    if (auth_ != nullptr) {
      KVS_ASSIGN_OR_RETURN(caller, auth_->DataTenant(*context));
    }
    if (draining()) {
      return absl::UnavailableError(
          "the sidecar is draining and accepts no new sessions; attach to another instance");
    }
    KVS_ASSIGN_OR_RETURN(AttachParams params, AttachFromProto(*request, pool_->options()));
    // The tenant of the token wins over the request's tenant field.
    if (caller.has_value()) params.tenant = *caller;
    KVS_ASSIGN_OR_RETURN(SessionView session, pool_->Attach(params));
    if (session.arena.kind == ArenaHandle::Kind::kMemfd && arena_fd_server_ == nullptr) {
      (void)pool_->Detach(session.session_id);  // a failed Attach leaves no session behind
      return absl::FailedPreconditionError(
          "this sidecar's arenas are memfds but it has no arena socket to hand them out");
    }
    response->set_session_id(session.session_id);
    ArenaHandleToProto(session, response->mutable_arena());
    if (session.arena.kind == ArenaHandle::Kind::kMemfd) {
      // Only this answer, sent to the caller the token authenticated, can fetch the arena.
      response->mutable_arena()->set_fd_socket_path(arena_fd_server_->socket_path());
      response->mutable_arena()->set_fd_nonce(arena_fd_server_->IssueNonce(session.session_id));
    }
    LayoutToProto(session.layout, response->mutable_layout());
    response->set_lease_ms(static_cast<int32_t>(
        std::min<int64_t>(absl::ToInt64Milliseconds(session.lease), INT32_MAX)));
    response->set_backend(backend_name_);
    KVS_LOG(kInfo, "attach")
    ("session", session.session_id)("tenant", params.tenant)("worker", params.worker_name)(
        "blocks", session.num_blocks)("block_bytes", session.block_bytes)("peer", context->peer());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SidecarService::Heartbeat(grpc::CallbackServerContext* context,
                                                    const v1::HeartbeatRequest* request,
                                                    v1::HeartbeatResponse* response) {
  return RunUnary(context, "Heartbeat", [&]() -> absl::Status {
    SessionLookups sessions(*pool_);
    KVS_RETURN_IF_ERROR(Authorize(*context, *request, sessions));
    KVS_RETURN_IF_ERROR(ValidateName(request->session_id(), "session_id", true));
    KVS_ASSIGN_OR_RETURN(SessionRef session, sessions.Find(request->session_id()));
    KVS_ASSIGN_OR_RETURN(HeartbeatResult beat, pool_->Heartbeat(session));
    response->set_lease_expires_unix_ms(UnixMillisOf(beat.lease_expires));
    response->set_free_blocks(beat.free_blocks);
    return absl::OkStatus();
  });
}

grpc::ServerWriteReactor<v1::SessionEvent>* SidecarService::Watch(
    grpc::CallbackServerContext* context, const v1::WatchRequest* request) {
  std::shared_ptr<WatchReactor> reactor;
  const absl::Status status = Guarded("Watch", [&]() -> absl::Status {
    SessionLookups sessions(*pool_);
    KVS_RETURN_IF_ERROR(Authorize(*context, *request, sessions));
    KVS_RETURN_IF_ERROR(ValidateName(request->session_id(), "session_id", true));
    KVS_RETURN_IF_ERROR(sessions.Find(request->session_id()).status());
    absl::MutexLock lock(&mu_);
    if (shutting_down_) return absl::UnavailableError("the sidecar is shutting down");
    if (watchers_.contains(request->session_id())) {
      return absl::FailedPreconditionError(
          absl::StrCat("session '", request->session_id(),
                       "' already has a Watch stream; a session has at most one"));
    }
    reactor = std::make_shared<WatchReactor>(this, request->session_id());
    watchers_[request->session_id()] = reactor;
    return absl::OkStatus();
  });
  if (!status.ok()) return new FailedWriteReactor<v1::SessionEvent>(status);
  reactor->Begin(reactor);
  KVS_LOG(kDebug, "watch_started")("session", request->session_id())("peer", context->peer());
  // The session may have been reclaimed between the check and the registration: a second
  // lookup on purpose, since Detach ends only the streams registered when it ran.
  if (!pool_->GetSession(request->session_id()).ok()) {
    reactor->End(grpc::Status(grpc::StatusCode::NOT_FOUND,
                              absl::StrCat("session '", request->session_id(), "' ended")));
  }
  return reactor.get();
}

grpc::ServerUnaryReactor* SidecarService::Detach(grpc::CallbackServerContext* context,
                                                 const v1::DetachRequest* request,
                                                 v1::DetachResponse* response) {
  return RunUnary(context, "Detach", [&]() -> absl::Status {
    SessionLookups sessions(*pool_);
    KVS_RETURN_IF_ERROR(Authorize(*context, *request, sessions));
    KVS_RETURN_IF_ERROR(ValidateName(request->session_id(), "session_id", true));
    // Detach by id ends a session whose lease lapsed before the reaper got to it, where a lookup
    // answers NOT_FOUND; so the handle is used only when the tenant check already looked it up
    // (data auth on, which refuses a lapsed session there).
    absl::StatusOr<ReleaseCounts> detached;
    if (sessions.Looked(request->session_id())) {
      KVS_ASSIGN_OR_RETURN(SessionRef session, sessions.Find(request->session_id()));
      detached = pool_->Detach(session);
    } else {
      detached = pool_->Detach(request->session_id());
    }
    KVS_ASSIGN_OR_RETURN(ReleaseCounts released, std::move(detached));
    response->set_sequences_released(released.sequences);
    response->set_blocks_released(released.blocks);
    EndWatch(request->session_id(), grpc::Status::OK);
    KVS_LOG(kInfo, "detach")
    ("session", request->session_id())("sequences", released.sequences)("blocks", released.blocks);
    return absl::OkStatus();
  });
}

}  // namespace kvs
