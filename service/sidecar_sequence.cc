// SidecarService, the sequence lifecycle: CreateSequence, ReleaseSequence, GetLayout.
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
#include "service/internal/response_size.h"
#include "service/internal/session_lookups.h"
#include "service/log.h"
#include "service/rpc_guard.h"
#include "service/sidecar_service.h"
#include "service/status_convert.h"

namespace kvs {

namespace v1 = ::kvsidecar::v1;

using service_internal::kGetLayoutAdvice;
using service_internal::kResponseFixedBytes;
using service_internal::LayerLayoutsBytes;
using service_internal::SessionLookups;
using service_internal::TooLarge;

grpc::ServerUnaryReactor* SidecarService::CreateSequence(grpc::CallbackServerContext* context,
                                                         const v1::CreateSequenceRequest* request,
                                                         v1::CreateSequenceResponse* response) {
  return RunUnary(context, "CreateSequence", [&]() -> absl::Status {
    SessionLookups sessions(*pool_);
    KVS_RETURN_IF_ERROR(Authorize(*context, *request, sessions));
    // budget.per_layer_tokens must give one budget per layer of the session.
    int32_t num_layers = -1;
    if (request->budget().per_layer_tokens_size() > 0) {
      KVS_RETURN_IF_ERROR(ValidateName(request->session_id(), "session_id", /*required=*/true));
      KVS_ASSIGN_OR_RETURN(SessionRef session, sessions.Find(request->session_id()));
      num_layers = session.layout().num_layers;
    }
    KVS_ASSIGN_OR_RETURN(
        SequenceParams params,
        SequenceParamsFromProto(*request, pool_->options().max_tokens_per_call, num_layers));
    absl::StatusOr<SequenceCreated> made;
    if (sessions.Looked(request->session_id())) {
      // The tenant check or the layer count already looked the session up: create through that
      // handle. Otherwise the pool looks it up, after checking the parameters it checks first.
      KVS_ASSIGN_OR_RETURN(SessionRef session, sessions.Find(request->session_id()));
      made = pool_->CreateSequence(session, params);
    } else {
      made = pool_->CreateSequence(request->session_id(), params);
    }
    KVS_ASSIGN_OR_RETURN(SequenceCreated created, std::move(made));
    response->set_sequence_id(created.sequence_id);
    PolicyToProto(created.policy, response->mutable_policy());
    BudgetToProto(created.budget, response->mutable_budget());
    if (budget_observer_) budget_observer_(created.policy.name, created.budget.tokens_per_layer);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SidecarService::ReleaseSequence(grpc::CallbackServerContext* context,
                                                          const v1::ReleaseSequenceRequest* request,
                                                          v1::ReleaseSequenceResponse* response) {
  return RunUnary(context, "ReleaseSequence", [&]() -> absl::Status {
    SessionLookups sessions(*pool_);
    KVS_RETURN_IF_ERROR(Authorize(*context, *request, sessions));
    KVS_RETURN_IF_ERROR(ValidateName(request->session_id(), "session_id", true));
    KVS_RETURN_IF_ERROR(ValidateName(request->sequence_id(), "sequence_id", true));
    KVS_ASSIGN_OR_RETURN(SessionRef session, sessions.Find(request->session_id()));
    KVS_ASSIGN_OR_RETURN(ReleaseCounts released,
                         pool_->ReleaseSequence(session, request->sequence_id()));
    response->set_blocks_released(released.blocks);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SidecarService::GetLayout(grpc::CallbackServerContext* context,
                                                    const v1::GetLayoutRequest* request,
                                                    v1::GetLayoutResponse* response) {
  return RunUnary(context, "GetLayout", [&]() -> absl::Status {
    SessionLookups sessions(*pool_);
    KVS_RETURN_IF_ERROR(Authorize(*context, *request, sessions));
    KVS_RETURN_IF_ERROR(ValidateName(request->session_id(), "session_id", true));
    KVS_RETURN_IF_ERROR(ValidateName(request->sequence_id(), "sequence_id", true));
    // One lookup serves the tenant check, the layer check and both reads.
    KVS_ASSIGN_OR_RETURN(SessionRef session, sessions.Find(request->session_id()));
    KVS_RETURN_IF_ERROR(ValidateLayers(request->layers(), session.layout().num_layers, "layers"));
    // Counts and block tables first (cheap); positions only once they are known to fit.
    KVS_ASSIGN_OR_RETURN(SequenceLayout layout,
                         pool_->GetLayout(session, request->sequence_id(), request->layers(),
                                          /*with_positions=*/false));
    const bool with_positions = !request->omit_positions();
    const uint64_t estimate =
        kResponseFixedBytes + LayerLayoutsBytes(layout, session, with_positions);
    if (estimate > static_cast<uint64_t>(kMaxMessageBytes)) {
      return TooLarge("the response", estimate, kMaxMessageBytes, kGetLayoutAdvice);
    }
    if (with_positions) {
      KVS_ASSIGN_OR_RETURN(layout, pool_->GetLayout(session, request->sequence_id(),
                                                    request->layers(), /*with_positions=*/true));
    }
    SequenceLayoutToProto(layout, response);
    const size_t bytes = response->ByteSizeLong();
    if (bytes > static_cast<size_t>(kMaxMessageBytes)) {  // grew since the estimate
      response->Clear();
      return TooLarge("the response", bytes, kMaxMessageBytes, kGetLayoutAdvice);
    }
    return absl::OkStatus();
  });
}

}  // namespace kvs
