// SidecarService: the data plane (kvsidecar.v1.Sidecar) on the gRPC callback API. Validates each
// request (service/convert.h), calls the pool, converts the result; the handlers are defined in
// one file per service area (service/sidecar_<area>.cc). Owns the Watch streams: one per session
// at most; when a watch stream is cancelled or its connection drops, the session is reclaimed at
// once.
//
// Streams: Append is a ServerReadReactor (segments = header + data chunks, each segment reserved,
// written and committed in turn), Export a ServerWriteReactor (header, then payload chunks read
// at the layout version, so a concurrent change ends the stream with ABORTED).
//
// Threading: handlers run on gRPC's callback threads, concurrently; the pool is thread-safe and
// the watcher map has its own lock. Exceptions never leave a handler (service/rpc_guard.h).
// Lifetime: the service must outlive the grpc::Server it is registered with (Shutdown() it, then
// shut the server down and wait, then destroy it).
#ifndef KVSIDECAR_SERVICE_SIDECAR_SERVICE_H_
#define KVSIDECAR_SERVICE_SIDECAR_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "cache/pool.h"
#include "grpcpp/grpcpp.h"
#include "kvsidecar/v1/sidecar.grpc.pb.h"
#include "service/auth.h"

namespace kvs {

class WatchReactor;   // service/sidecar_session.cc
class ArenaFdServer;  // service/arena_fd_server.h
namespace service_internal {
class SessionLookups;  // service/internal/session_lookups.h
}  // namespace service_internal

// Largest number of items one batch call (BatchReserve, BatchCommit, BatchCompress) may carry.
inline constexpr int kMaxBatchItems = 1 << 16;
// Largest number of segments one Append stream may carry; the response holds one item per
// segment, so an unbounded stream would grow it without limit.
inline constexpr int kMaxAppendSegments = 4096;
// Largest gRPC message either way; a 4 MiB chunk plus its framing fits with room to spare.
inline constexpr int kMaxMessageBytes = 64 << 20;

class SidecarService final : public ::kvsidecar::v1::Sidecar::CallbackService {
 public:
  // `pool` must outlive the service. `backend_name` is what Attach reports ("cpu").
  SidecarService(KvPool* pool, std::string backend_name);
  ~SidecarService() override;
  SidecarService(const SidecarService&) = delete;
  SidecarService& operator=(const SidecarService&) = delete;

  // ---- Hooks for the Admin service and the server ----
  bool draining() const { return draining_.load(); }
  // Refuses further attaches and tells every watcher KIND_DRAINING. Idempotent.
  void StartDraining();
  // Ends the watch stream of `session_id`, if one is open, with `status`; the session is not
  // reclaimed by this (the caller already released it).
  void EndWatch(absl::string_view session_id, const grpc::Status& status);
  // Ends the watch streams whose session no longer exists (after the reaper ran).
  void EndOrphanWatches();
  // Server shutdown: refuses new watches and finishes every open one with OK.
  void Shutdown();
  int active_watches() const;
  KvPool* pool() const { return pool_; }

  // ---- kvsidecar.v1.Sidecar ----
  grpc::ServerUnaryReactor* Attach(grpc::CallbackServerContext* context,
                                   const ::kvsidecar::v1::AttachRequest* request,
                                   ::kvsidecar::v1::AttachResponse* response) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* context,
                                      const ::kvsidecar::v1::HeartbeatRequest* request,
                                      ::kvsidecar::v1::HeartbeatResponse* response) override;
  // First event KIND_WATCHING; KIND_DRAINING on drain. When the client cancels, its connection
  // drops or its deadline passes, the session is reclaimed at once (so watch without a
  // deadline). Ends with OK on Detach or server shutdown, NOT_FOUND when the lease lapsed,
  // ABORTED on Admin.ForceRelease; a second watcher of a session gets FAILED_PRECONDITION.
  grpc::ServerWriteReactor<::kvsidecar::v1::SessionEvent>* Watch(
      grpc::CallbackServerContext* context, const ::kvsidecar::v1::WatchRequest* request) override;
  grpc::ServerUnaryReactor* Detach(grpc::CallbackServerContext* context,
                                   const ::kvsidecar::v1::DetachRequest* request,
                                   ::kvsidecar::v1::DetachResponse* response) override;
  grpc::ServerUnaryReactor* CreateSequence(
      grpc::CallbackServerContext* context, const ::kvsidecar::v1::CreateSequenceRequest* request,
      ::kvsidecar::v1::CreateSequenceResponse* response) override;
  grpc::ServerUnaryReactor* ReleaseSequence(
      grpc::CallbackServerContext* context, const ::kvsidecar::v1::ReleaseSequenceRequest* request,
      ::kvsidecar::v1::ReleaseSequenceResponse* response) override;
  grpc::ServerUnaryReactor* Reserve(grpc::CallbackServerContext* context,
                                    const ::kvsidecar::v1::ReserveRequest* request,
                                    ::kvsidecar::v1::ReserveResponse* response) override;
  grpc::ServerUnaryReactor* Commit(grpc::CallbackServerContext* context,
                                   const ::kvsidecar::v1::CommitRequest* request,
                                   ::kvsidecar::v1::CommitResponse* response) override;
  grpc::ServerUnaryReactor* CancelReservation(
      grpc::CallbackServerContext* context,
      const ::kvsidecar::v1::CancelReservationRequest* request,
      ::kvsidecar::v1::CancelReservationResponse* response) override;
  // All or nothing: every item is validated once (ids, sizes, repeats, session, layers), then
  // the pool finds every item's sequence before the first reservation (KvPool::ReserveBatch), so
  // a bad field of any item is reported before a missing sequence; if reserving item i still
  // fails, the reservations of items < i are cancelled and the call fails with
  // "requests[i]: ...". Caveat: a strict-budget item evicts before it reserves, and that
  // eviction is not undone by the rollback.
  grpc::ServerUnaryReactor* BatchReserve(grpc::CallbackServerContext* context,
                                         const ::kvsidecar::v1::BatchReserveRequest* request,
                                         ::kvsidecar::v1::BatchReserveResponse* response) override;
  // Every item is validated first (ids, repeats, session and sequence exist, reservation_id is
  // the sequence's pending reservation): a stale id fails the batch before anything commits.
  // Commits then run in order; a commit cannot be undone, so if item i still fails (a concurrent
  // call committed or cancelled its reservation after the check), items < i stay committed, item
  // i and later stay reserved (the client may retry them), and the message says so.
  grpc::ServerUnaryReactor* BatchCommit(grpc::CallbackServerContext* context,
                                        const ::kvsidecar::v1::BatchCommitRequest* request,
                                        ::kvsidecar::v1::BatchCommitResponse* response) override;
  // At most kMaxAppendSegments segments per stream; segment kMaxAppendSegments fails the stream
  // with INVALID_ARGUMENT and the earlier segments stay committed.
  grpc::ServerReadReactor<::kvsidecar::v1::AppendChunk>* Append(
      grpc::CallbackServerContext* context, ::kvsidecar::v1::AppendResponse* response) override;
  grpc::ServerWriteReactor<::kvsidecar::v1::ExportChunk>* Export(
      grpc::CallbackServerContext* context, const ::kvsidecar::v1::ExportRequest* request) override;
  // GetLayout, Compress (return_positions), BatchCompress and the Export header estimate their
  // response size from the counts (no positions loaded) and refuse with RESOURCE_EXHAUSTED,
  // before building anything or evicting anything, when it would exceed kMaxMessageBytes.
  grpc::ServerUnaryReactor* GetLayout(grpc::CallbackServerContext* context,
                                      const ::kvsidecar::v1::GetLayoutRequest* request,
                                      ::kvsidecar::v1::GetLayoutResponse* response) override;
  grpc::ServerUnaryReactor* Compress(grpc::CallbackServerContext* context,
                                     const ::kvsidecar::v1::CompressRequest* request,
                                     ::kvsidecar::v1::CompressResponse* response) override;
  // Validated as a whole first; then compressed in order. If item i fails, items < i stay
  // compressed (eviction cannot be undone) and the message says so.
  grpc::ServerUnaryReactor* BatchCompress(
      grpc::CallbackServerContext* context, const ::kvsidecar::v1::BatchCompressRequest* request,
      ::kvsidecar::v1::BatchCompressResponse* response) override;
  // Every item is converted and checked first (ids, session exists, one item per sequence,
  // attention with num_queries 1, reservation_id or inline_kv of [L][2][H][1][D] bytes); the pool
  // then validates all items again before any runs. Errors name "items[i]".
  grpc::ServerUnaryReactor* DecodeStep(grpc::CallbackServerContext* context,
                                       const ::kvsidecar::v1::DecodeStepRequest* request,
                                       ::kvsidecar::v1::DecodeStepResponse* response) override;
  // Dry run; refused with RESOURCE_EXHAUSTED before scoring when the response (scores, kept slots
  // and positions of every held slot of the asked layers) could exceed kMaxMessageBytes.
  grpc::ServerUnaryReactor* Score(grpc::CallbackServerContext* context,
                                  const ::kvsidecar::v1::ScoreRequest* request,
                                  ::kvsidecar::v1::ScoreResponse* response) override;
  grpc::ServerUnaryReactor* GetRetained(grpc::CallbackServerContext* context,
                                        const ::kvsidecar::v1::GetRetainedRequest* request,
                                        ::kvsidecar::v1::GetRetainedResponse* response) override;
  grpc::ServerUnaryReactor* Select(grpc::CallbackServerContext* context,
                                   const ::kvsidecar::v1::SelectRequest* request,
                                   ::kvsidecar::v1::SelectResponse* response) override;
  grpc::ServerUnaryReactor* Spill(grpc::CallbackServerContext* context,
                                  const ::kvsidecar::v1::SpillRequest* request,
                                  ::kvsidecar::v1::SpillResponse* response) override;
  grpc::ServerUnaryReactor* Restore(grpc::CallbackServerContext* context,
                                    const ::kvsidecar::v1::RestoreRequest* request,
                                    ::kvsidecar::v1::RestoreResponse* response) override;
  // Compressed prefix reuse (sidecar.proto PublishRequest; KvPool::Publish).
  grpc::ServerUnaryReactor* Publish(grpc::CallbackServerContext* context,
                                    const ::kvsidecar::v1::PublishRequest* request,
                                    ::kvsidecar::v1::PublishResponse* response) override;
  grpc::ServerUnaryReactor* Unpublish(grpc::CallbackServerContext* context,
                                      const ::kvsidecar::v1::UnpublishRequest* request,
                                      ::kvsidecar::v1::UnpublishResponse* response) override;
  grpc::ServerUnaryReactor* LookupPrefixes(
      grpc::CallbackServerContext* context, const ::kvsidecar::v1::LookupPrefixesRequest* request,
      ::kvsidecar::v1::LookupPrefixesResponse* response) override;

  // Bearer-token checks (service/auth.h); null or no tenant tokens = the data plane is open.
  // Set once before serving.
  void set_authenticator(const Authenticator* auth) { auth_ = auth; }
  // Called with (policy, budget tokens per layer, 0 = unbounded) after every CreateSequence
  // that succeeded, for the budget histogram of the metrics. Set once before serving.
  using BudgetObserver = std::function<void(const std::string& policy, int32_t tokens)>;
  void set_budget_observer(BudgetObserver observer) { budget_observer_ = std::move(observer); }
  // Hands out memfd arenas; null = none (Attach then fails for a memfd arena). Must outlive this.
  void set_arena_fd_server(ArenaFdServer* server) { arena_fd_server_ = server; }
  // OK when the data plane is open. Else UNAUTHENTICATED without a valid tenant token, and
  // PERMISSION_DENIED (same text for a missing and a foreign session) unless every session the
  // request names (session_id, and those of repeated requests / items) belongs to the caller's
  // tenant; Restore's from_session_id may not name another tenant's session (NOT_FOUND, as for
  // a missing spilled copy).
  absl::Status Authorize(const grpc::CallbackServerContext& context,
                         const google::protobuf::Message& request) const;
  // The same, looking the sessions up through `lookups`, where the handler then finds the
  // handles the check was made on (one lookup per session per RPC). With the data plane open
  // it looks nothing up.
  absl::Status Authorize(const grpc::CallbackServerContext& context,
                         const google::protobuf::Message& request,
                         service_internal::SessionLookups& lookups) const;

 private:
  friend class WatchReactor;

  // Called by a WatchReactor from OnDone: forget it if it is still the session's watcher.
  void Unregister(const std::string& session_id, const WatchReactor* reactor);
  // Restore's adopt_any_session: the ended session of `session_id`'s tenant whose copy of
  // `sequence_id` to adopt (intact before lost, then the newest). NOT_FOUND when there is none.
  absl::StatusOr<std::string> FindOrphanCopy(const SessionRef& session,
                                             const std::string& sequence_id) const;
  // Upper bound of the CompressResponse bytes of `request` (positions if it asks for them), from
  // the counts and budgets only. `session`: the request's, as the handler looked it up.
  absl::StatusOr<uint64_t> EstimateCompressResponseBytes(
      const ::kvsidecar::v1::CompressRequest& request, const CompressParams& params,
      const SessionRef& session) const;

  KvPool* const pool_;
  const std::string backend_name_;
  const Authenticator* auth_ = nullptr;
  BudgetObserver budget_observer_;
  ArenaFdServer* arena_fd_server_ = nullptr;
  std::atomic<bool> draining_{false};

  mutable absl::Mutex mu_;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<std::string, std::shared_ptr<WatchReactor>> watchers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvs

#endif  // KVSIDECAR_SERVICE_SIDECAR_SERVICE_H_
