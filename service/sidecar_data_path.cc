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

absl::Status SidecarService::CheckSequenceExists(const SessionRef& session,
                                                 const std::string& sequence_id) const {
  const int32_t first_layer[] = {0};
  return pool_->GetLayout(session, sequence_id, first_layer, /*with_positions=*/false).status();
}

grpc::ServerUnaryReactor* SidecarService::Reserve(grpc::CallbackServerContext* context,
                                                  const v1::ReserveRequest* request,
                                                  v1::ReserveResponse* response) {
  return RunUnary(context, "Reserve", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(Authorize(*context, *request));
    KVS_RETURN_IF_ERROR(ValidateReserveRequest(*request, pool_->options().max_tokens_per_call));
    absl::StatusOr<Reservation> reservation;
    if (!request->layers().empty()) {
      // The session's layer count checks `layers`; the same lookup serves the reservation.
      KVS_ASSIGN_OR_RETURN(SessionRef session, pool_->FindSession(request->session_id()));
      KVS_RETURN_IF_ERROR(ValidateLayers(request->layers(), session.layout().num_layers, "layers"));
      reservation = pool_->Reserve(session, request->sequence_id(), request->num_tokens(),
                                   request->positions(), request->layers());
    } else {
      reservation = pool_->Reserve(request->session_id(), request->sequence_id(),
                                   request->num_tokens(), request->positions(), request->layers());
    }
    KVS_RETURN_IF_ERROR(reservation.status());
    ReservationToProto(*reservation, response);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SidecarService::Commit(grpc::CallbackServerContext* context,
                                                 const v1::CommitRequest* request,
                                                 v1::CommitResponse* response) {
  return RunUnary(context, "Commit", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(Authorize(*context, *request));
    KVS_RETURN_IF_ERROR(ValidateCommitRequest(*request));
    absl::StatusOr<CommitResult> result;
    if (request->has_attention()) {
      // The session's layout sizes the attention; the same lookup serves the commit.
      KVS_ASSIGN_OR_RETURN(SessionRef session, pool_->FindSession(request->session_id()));
      KVS_ASSIGN_OR_RETURN(AttentionInput attention,
                           AttentionFromProto(request->attention(), session.layout()));
      result = pool_->Commit(session, request->sequence_id(), request->reservation_id(),
                             request->compress_if_over_budget(), &attention);
    } else {
      result = pool_->Commit(request->session_id(), request->sequence_id(),
                             request->reservation_id(), request->compress_if_over_budget());
    }
    KVS_RETURN_IF_ERROR(result.status());
    CommitResultToProto(*result, response);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SidecarService::CancelReservation(
    grpc::CallbackServerContext* context, const v1::CancelReservationRequest* request,
    v1::CancelReservationResponse* response) {
  return RunUnary(context, "CancelReservation", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(Authorize(*context, *request));
    KVS_RETURN_IF_ERROR(ValidateCancelReservationRequest(*request));
    return pool_->CancelReservation(request->session_id(), request->sequence_id(),
                                    request->reservation_id());
  });
}

grpc::ServerUnaryReactor* SidecarService::BatchReserve(grpc::CallbackServerContext* context,
                                                       const v1::BatchReserveRequest* request,
                                                       v1::BatchReserveResponse* response) {
  return RunUnary(context, "BatchReserve", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(Authorize(*context, *request));
    const int n = request->requests_size();
    KVS_RETURN_IF_ERROR(CheckBatchSize(n));
    absl::flat_hash_map<std::pair<std::string, std::string>, int> seen;
    // Each session looked up once (a decode batch names one session many times); the handle
    // serves the sequence check, the layer check and the reservation.
    absl::flat_hash_map<std::string, SessionRef> sessions;
    std::vector<SessionRef> session_of;  // per item
    session_of.reserve(n);
    for (int i = 0; i < n; ++i) {
      const v1::ReserveRequest& item = request->requests(i);
      KVS_RETURN_IF_ERROR(ValidateReserveRequest(item, pool_->options().max_tokens_per_call,
                                                 absl::StrCat(Item(i), ".")));
      KVS_RETURN_IF_ERROR(CheckNoRepeat(&seen, item.session_id(), item.sequence_id(), i));
      auto known = sessions.find(item.session_id());
      if (known == sessions.end()) {
        absl::StatusOr<SessionRef> session = pool_->FindSession(item.session_id());
        KVS_RETURN_IF_ERROR(WithPrefix(absl::StrCat(Item(i), ": "), session.status()));
        known = sessions.emplace(item.session_id(), *std::move(session)).first;
      }
      session_of.push_back(known->second);
      KVS_RETURN_IF_ERROR(WithPrefix(absl::StrCat(Item(i), ": "),
                                     CheckSequenceExists(known->second, item.sequence_id())));
      if (!item.layers().empty()) {
        KVS_RETURN_IF_ERROR(ValidateLayers(item.layers(), known->second.layout().num_layers,
                                           absl::StrCat(Item(i), ".layers")));
      }
    }
    std::vector<Reservation> made;
    made.reserve(n);
    for (int i = 0; i < n; ++i) {
      const v1::ReserveRequest& item = request->requests(i);
      auto reservation = pool_->Reserve(session_of[i], item.sequence_id(), item.num_tokens(),
                                        item.positions(), item.layers());
      if (!reservation.ok()) {
        for (int j = 0; j < i; ++j) {
          const v1::ReserveRequest& done = request->requests(j);
          absl::Status undo = pool_->CancelReservation(done.session_id(), done.sequence_id(),
                                                       made[j].reservation_id);
          if (!undo.ok()) LogRpcFailure("BatchReserve(rollback)", undo);
        }
        return WithPrefix(absl::StrCat(Item(i), ": "), reservation.status());
      }
      made.push_back(*std::move(reservation));
    }
    for (const Reservation& reservation : made) {
      ReservationToProto(reservation, response->add_responses());
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SidecarService::BatchCommit(grpc::CallbackServerContext* context,
                                                      const v1::BatchCommitRequest* request,
                                                      v1::BatchCommitResponse* response) {
  return RunUnary(context, "BatchCommit", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(Authorize(*context, *request));
    const int n = request->requests_size();
    KVS_RETURN_IF_ERROR(CheckBatchSize(n));
    // One validation pass over the request here; the pool then looks each session up once and
    // checks every reservation before committing any (KvPool::CommitBatch).
    absl::flat_hash_map<std::pair<std::string, std::string>, int> seen;
    // The sessions sending attention (their layout sizes it), looked up once each; the pool
    // uses these and looks up only the others.
    absl::flat_hash_map<std::string, SessionRef> layouts;
    std::vector<SessionRef> found;  // the same, in the order the items first name them
    std::vector<std::optional<AttentionInput>> attention(n);
    std::vector<CommitItem> items(n);
    for (int i = 0; i < n; ++i) {
      const v1::CommitRequest& item = request->requests(i);
      KVS_RETURN_IF_ERROR(ValidateCommitRequest(item, absl::StrCat(Item(i), ".")));
      KVS_RETURN_IF_ERROR(CheckNoRepeat(&seen, item.session_id(), item.sequence_id(), i));
      if (item.has_attention()) {
        auto known = layouts.find(item.session_id());
        if (known == layouts.end()) {
          absl::StatusOr<SessionRef> session = pool_->FindSession(item.session_id());
          KVS_RETURN_IF_ERROR(WithPrefix(absl::StrCat(Item(i), ": "), session.status()));
          found.push_back(*session);
          known = layouts.emplace(item.session_id(), *std::move(session)).first;
        }
        KVS_ASSIGN_OR_RETURN(attention[i],
                             AttentionFromProto(item.attention(), known->second.layout(),
                                                absl::StrCat(Item(i), ".attention.")));
      }
      items[i] = CommitItem{item.session_id(), item.sequence_id(), item.reservation_id(),
                            item.compress_if_over_budget(),
                            attention[i].has_value() ? &*attention[i] : nullptr};
    }
    CommitBatchResult done = pool_->CommitBatch(items, found);
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

grpc::ServerUnaryReactor* SidecarService::DecodeStep(grpc::CallbackServerContext* context,
                                                     const v1::DecodeStepRequest* request,
                                                     v1::DecodeStepResponse* response) {
  return RunUnary(context, "DecodeStep", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(Authorize(*context, *request));
    std::vector<SessionRef> sessions;  // looked up once here; the pool uses them as they are
    KVS_ASSIGN_OR_RETURN(
        std::vector<DecodeItem> items,
        ItemsFromProto(request->items(), *pool_, &DecodeItemFromProto, &sessions));
    // The pool validates every item again (reservations, positions, attention sizes) before it
    // changes anything, and prefixes its errors with "items[i]: ".
    KVS_ASSIGN_OR_RETURN(std::vector<DecodeResult> results, pool_->DecodeStep(items, sessions));
    if (results.size() != items.size()) {
      return absl::InternalError(absl::StrCat("DecodeStep: the pool returned ", results.size(),
                                              " results for ", items.size(), " items"));
    }
    for (const DecodeResult& result : results) DecodeResultToProto(result, response->add_items());
    return absl::OkStatus();
  });
}

}  // namespace kvs
