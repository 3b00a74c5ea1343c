// SidecarService, the data path: Reserve, Commit, CancelReservation, BatchReserve, BatchCommit
// and DecodeStep.
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
#include "service/internal/batch_items.h"
#include "service/internal/response_size.h"
#include "service/internal/session_lookups.h"
#include "service/log.h"
#include "service/rpc_guard.h"
#include "service/sidecar_service.h"
#include "service/status_convert.h"

namespace kvs {

namespace v1 = ::kvsidecar::v1;

using service_internal::CheckBatchSize;
using service_internal::CheckNoRepeat;
using service_internal::Item;
using service_internal::ItemsFromProto;
using service_internal::SessionLookups;

grpc::ServerUnaryReactor* SidecarService::Reserve(grpc::CallbackServerContext* context,
                                                  const v1::ReserveRequest* request,
                                                  v1::ReserveResponse* response) {
  return RunUnary(context, "Reserve", [&]() -> absl::Status {
    SessionLookups sessions(*pool_);
    KVS_RETURN_IF_ERROR(Authorize(*context, *request, sessions));
    KVS_RETURN_IF_ERROR(ValidateReserveRequest(*request, pool_->options().max_tokens_per_call));
    // The handle the tenant check was made on; it also checks `layers` and serves the reservation.
    KVS_ASSIGN_OR_RETURN(SessionRef session, sessions.Find(request->session_id()));
    if (!request->layers().empty()) {
      KVS_RETURN_IF_ERROR(ValidateLayers(request->layers(), session.layout().num_layers, "layers"));
    }
    KVS_ASSIGN_OR_RETURN(Reservation reservation,
                         pool_->Reserve(session, request->sequence_id(), request->num_tokens(),
                                        request->positions(), request->layers()));
    ReservationToProto(reservation, response);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SidecarService::Commit(grpc::CallbackServerContext* context,
                                                 const v1::CommitRequest* request,
                                                 v1::CommitResponse* response) {
  return RunUnary(context, "Commit", [&]() -> absl::Status {
    SessionLookups sessions(*pool_);
    KVS_RETURN_IF_ERROR(Authorize(*context, *request, sessions));
    KVS_RETURN_IF_ERROR(ValidateCommitRequest(*request));
    // The handle the tenant check was made on; its layout sizes the attention.
    KVS_ASSIGN_OR_RETURN(SessionRef session, sessions.Find(request->session_id()));
    std::optional<AttentionInput> attention;
    if (request->has_attention()) {
      KVS_ASSIGN_OR_RETURN(attention, AttentionFromProto(request->attention(), session.layout()));
    }
    KVS_ASSIGN_OR_RETURN(CommitResult result,
                         pool_->Commit(session, request->sequence_id(), request->reservation_id(),
                                       request->compress_if_over_budget(),
                                       attention.has_value() ? &*attention : nullptr));
    CommitResultToProto(result, response);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SidecarService::CancelReservation(
    grpc::CallbackServerContext* context, const v1::CancelReservationRequest* request,
    v1::CancelReservationResponse* response) {
  return RunUnary(context, "CancelReservation", [&]() -> absl::Status {
    SessionLookups sessions(*pool_);
    KVS_RETURN_IF_ERROR(Authorize(*context, *request, sessions));
    KVS_RETURN_IF_ERROR(ValidateCancelReservationRequest(*request));
    KVS_ASSIGN_OR_RETURN(SessionRef session, sessions.Find(request->session_id()));
    return pool_->CancelReservation(session, request->sequence_id(), request->reservation_id());
  });
}

grpc::ServerUnaryReactor* SidecarService::BatchReserve(grpc::CallbackServerContext* context,
                                                       const v1::BatchReserveRequest* request,
                                                       v1::BatchReserveResponse* response) {
  return RunUnary(context, "BatchReserve", [&]() -> absl::Status {
    SessionLookups sessions(*pool_);
    KVS_RETURN_IF_ERROR(Authorize(*context, *request, sessions));
    const int n = request->requests_size();
    KVS_RETURN_IF_ERROR(CheckBatchSize(n));
    // One pass over the items checks what the request alone decides (fields, repeats, the
    // session, layers against its layout); the pool then finds every item's sequence before
    // reserving any (KvPool::ReserveBatch), and nothing is checked twice.
    absl::flat_hash_map<std::pair<std::string, std::string>, int> seen;
    std::vector<ReserveItem> items(n);
    for (int i = 0; i < n; ++i) {
      const v1::ReserveRequest& item = request->requests(i);
      KVS_RETURN_IF_ERROR(ValidateReserveRequest(item, pool_->options().max_tokens_per_call,
                                                 absl::StrCat(Item(i), ".")));
      KVS_RETURN_IF_ERROR(CheckNoRepeat(&seen, item.session_id(), item.sequence_id(), i));
      absl::StatusOr<SessionRef> session = sessions.Find(item.session_id());
      KVS_RETURN_IF_ERROR(WithPrefix(absl::StrCat(Item(i), ": "), session.status()));
      if (!item.layers().empty()) {
        KVS_RETURN_IF_ERROR(ValidateLayers(item.layers(), session->layout().num_layers,
                                           absl::StrCat(Item(i), ".layers")));
      }
      items[i] = ReserveItem{item.session_id(), item.sequence_id(), item.num_tokens(),
                             item.positions(), item.layers()};
    }
    int32_t failed = 0;
    absl::StatusOr<std::vector<Reservation>> made =
        pool_->ReserveBatch(items, sessions.found(), &failed);
    if (!made.ok()) return WithPrefix(absl::StrCat(Item(failed), ": "), made.status());
    for (const Reservation& reservation : *made) {
      ReservationToProto(reservation, response->add_responses());
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SidecarService::BatchCommit(grpc::CallbackServerContext* context,
                                                      const v1::BatchCommitRequest* request,
                                                      v1::BatchCommitResponse* response) {
  return RunUnary(context, "BatchCommit", [&]() -> absl::Status {
    // The sessions the tenant check found (data auth on), and those sending attention (their
    // layout sizes it), each looked up once; the pool uses these and looks up only the others.
    SessionLookups sessions(*pool_);
    KVS_RETURN_IF_ERROR(Authorize(*context, *request, sessions));
    const int n = request->requests_size();
    KVS_RETURN_IF_ERROR(CheckBatchSize(n));
    // One validation pass over the request here; the pool then checks every reservation before
    // committing any (KvPool::CommitBatch).
    absl::flat_hash_map<std::pair<std::string, std::string>, int> seen;
    std::vector<std::optional<AttentionInput>> attention(n);
    std::vector<CommitItem> items(n);
    for (int i = 0; i < n; ++i) {
      const v1::CommitRequest& item = request->requests(i);
      KVS_RETURN_IF_ERROR(ValidateCommitRequest(item, absl::StrCat(Item(i), ".")));
      KVS_RETURN_IF_ERROR(CheckNoRepeat(&seen, item.session_id(), item.sequence_id(), i));
      if (item.has_attention()) {
        absl::StatusOr<SessionRef> session = sessions.Find(item.session_id());
        KVS_RETURN_IF_ERROR(WithPrefix(absl::StrCat(Item(i), ": "), session.status()));
        KVS_ASSIGN_OR_RETURN(attention[i],
                             AttentionFromProto(item.attention(), session->layout(),
                                                absl::StrCat(Item(i), ".attention.")));
      }
      items[i] = CommitItem{item.session_id(), item.sequence_id(), item.reservation_id(),
                            item.compress_if_over_budget(),
                            attention[i].has_value() ? &*attention[i] : nullptr};
    }
    CommitBatchResult done = pool_->CommitBatch(items, sessions.found());
    for (const CommitResult& result : done.results) {
      CommitResultToProto(result, response->add_responses());
    }
    if (done.status.ok()) return absl::OkStatus();
    const int i = done.failed;
    const std::string note =
        done.results.empty()
            ? std::string(" (nothing was committed)")
            : absl::StrCat(" (requests[0..", i - 1, "] were committed; requests[", i, "..", n - 1,
                           "] were not)");
    return absl::Status(done.status.code(),
                        absl::StrCat(Item(i), ": ", done.status.message(), note));
  });
}

namespace {

// RESOURCE_EXHAUSTED, before the step changes anything, when the layouts the items ask for
// (return_layout) could exceed the message limit.
absl::Status CheckDecodeLayoutsFit(const v1::DecodeStepRequest& request,
                                   SessionLookups& sessions) {
  // Bounded before the step changes anything: per item asking, its layers' entries; per session
  // among them, every block of its arena as a table entry (a session's tables share no block).
  uint64_t bytes = service_internal::kResponseFixedBytes;
  absl::flat_hash_set<std::string> tables_counted;
  for (const v1::DecodeStepRequest::Item& item : request.items()) {
    if (!item.return_layout()) continue;
    KVS_ASSIGN_OR_RETURN(SessionRef session, sessions.Find(item.session_id()));
    bytes += service_internal::SequenceLayoutEntriesBytes(session);
    if (tables_counted.insert(item.session_id()).second) {
      bytes += service_internal::SessionTableBytes(session);
    }
  }
  if (bytes > static_cast<uint64_t>(kMaxMessageBytes)) {
    return service_internal::TooLarge(
        "the layouts asked for (return_layout)", bytes, kMaxMessageBytes,
        "ask for fewer of them and read the others with GetLayout");
  }
  return absl::OkStatus();
}

}  // namespace

grpc::ServerUnaryReactor* SidecarService::DecodeStep(grpc::CallbackServerContext* context,
                                                     const v1::DecodeStepRequest* request,
                                                     v1::DecodeStepResponse* response) {
  return RunUnary(context, "DecodeStep", [&]() -> absl::Status {
    SessionLookups sessions(*pool_);  // looked up once here; the pool uses them as they are
    KVS_RETURN_IF_ERROR(Authorize(*context, *request, sessions));
    KVS_ASSIGN_OR_RETURN(std::vector<DecodeItem> items,
                         ItemsFromProto(request->items(), sessions, &DecodeItemFromProto));
    KVS_RETURN_IF_ERROR(CheckDecodeLayoutsFit(*request, sessions));
    // The pool validates every item again (reservations, positions, attention sizes) before it
    // changes anything, and prefixes its errors with "items[i]: ".
    KVS_ASSIGN_OR_RETURN(std::vector<DecodeResult> results,
                         pool_->DecodeStep(items, sessions.found()));
    if (results.size() != items.size()) {
      return absl::InternalError(absl::StrCat("DecodeStep: the pool returned ", results.size(),
                                              " results for ", items.size(), " items"));
    }
    for (size_t i = 0; i < results.size(); ++i) {
      v1::DecodeStepResponse::Item* out = response->add_items();
      DecodeResultToProto(results[i], out);
      if (!request->items(static_cast<int>(i)).return_layout()) continue;
      // The step has run: a layout that cannot be read now (the sequence released by another
      // call meanwhile) leaves the item's layers empty rather than failing a call that changed
      // state; the worker then asks GetLayout, which names the reason.
      absl::StatusOr<SessionRef> session = sessions.Find(items[i].session_id);
      if (!session.ok()) continue;
      absl::StatusOr<SequenceLayout> layout =
          pool_->GetLayout(*session, items[i].sequence_id, {}, /*with_positions=*/false);
      if (!layout.ok()) continue;
      for (const LayerLayoutView& layer : layout->layers) {
        LayerLayoutToProto(layer, out->add_layers());
      }
    }
    return absl::OkStatus();
  });
}

}  // namespace kvs
