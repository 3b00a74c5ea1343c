#include "service/admin_service.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "gpu/base/status_macros.h"
#include "service/convert.h"
#include "service/log.h"
#include "service/rpc_guard.h"

namespace kvs {

namespace v1 = ::kvsidecar::v1;

AdminService::AdminService(KvPool* pool, SidecarService* sidecar, AdminInfo info,
                           std::function<void()> on_drain)
    : pool_(pool), sidecar_(sidecar), info_(std::move(info)), on_drain_(std::move(on_drain)) {}

grpc::ServerUnaryReactor* AdminService::GetConfig(grpc::CallbackServerContext* context,
                                                  const v1::GetConfigRequest* request,
                                                  v1::GetConfigResponse* response) {
  return RunUnary(context, "Admin.GetConfig", [&]() -> absl::Status {
    response->set_effective_config_yaml(info_.effective_config_yaml);
    PolicyToProto(pool_->options().default_policy, response->mutable_default_policy());
    BudgetToProto(pool_->options().default_budget, response->mutable_default_budget());
    response->set_backend(info_.backend);
    response->set_backend_reason(info_.backend_reason);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AdminService::SetDefaults(grpc::CallbackServerContext* context,
                                                    const v1::SetDefaultsRequest* request,
                                                    v1::SetDefaultsResponse* response) {
  return RunUnary(context, "Admin.SetDefaults", [] {
    return absl::UnimplementedError(
        "SetDefaults is not implemented in this build: live re-configuration comes with the "
        "operations issue; restart with --default_policy / --default_budget_tokens");
  });
}

grpc::ServerUnaryReactor* AdminService::SetQuota(grpc::CallbackServerContext* context,
                                                 const v1::SetQuotaRequest* request,
                                                 v1::SetQuotaResponse* response) {
  return RunUnary(context, "Admin.SetQuota", [] {
    return absl::UnimplementedError(
        "SetQuota is not implemented in this build: tenant quotas come with the operations issue");
  });
}

grpc::ServerUnaryReactor* AdminService::ListSessions(grpc::CallbackServerContext* context,
                                                     const v1::ListSessionsRequest* request,
                                                     v1::ListSessionsResponse* response) {
  return RunUnary(context, "Admin.ListSessions", [&]() -> absl::Status {
    for (const SessionInfo& info : pool_->ListSessions()) {
      if (!request->tenant().empty() && info.tenant != request->tenant()) continue;
      SessionInfoToProto(info, response->add_sessions());
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AdminService::ListSequences(grpc::CallbackServerContext* context,
                                                      const v1::ListSequencesRequest* request,
                                                      v1::ListSequencesResponse* response) {
  return RunUnary(context, "Admin.ListSequences", [&]() -> absl::Status {
    for (const SequenceInfo& info : pool_->ListSequences(request->session_id())) {
      if (!request->session_id().empty() && info.session_id != request->session_id()) continue;
      if (!request->tenant().empty() && info.tenant != request->tenant()) continue;
      SequenceInfoToProto(info, response->add_sequences());
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AdminService::GetStats(grpc::CallbackServerContext* context,
                                                 const v1::GetStatsRequest* request,
                                                 v1::GetStatsResponse* response) {
  return RunUnary(context, "Admin.GetStats", [&]() -> absl::Status {
    const PoolStats stats = pool_->GetStats();
    response->set_sessions(stats.sessions);
    response->set_sequences(stats.sequences);
    response->set_arena_bytes_capacity(stats.arena_bytes_capacity);
    response->set_arena_bytes_used(stats.arena_bytes_used);
    response->set_host_bytes_used(0);
    response->set_disk_bytes_used(0);
    response->set_tokens_appended(stats.tokens_appended);
    response->set_tokens_evicted(stats.tokens_evicted);
    response->set_tokens_merged(0);
    response->set_sessions_reclaimed(stats.sessions_reclaimed);
    response->set_draining(sidecar_->draining());
    response->set_backend(info_.backend);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AdminService::Drain(grpc::CallbackServerContext* context,
                                              const v1::DrainRequest* request,
                                              v1::DrainResponse* response) {
  return RunUnary(context, "Admin.Drain", [&]() -> absl::Status {
    sidecar_->StartDraining();
    std::call_once(drain_once_, [&] {
      if (on_drain_) on_drain_();
    });
    const int32_t remaining = pool_->GetStats().sessions;
    response->set_sessions_remaining(remaining);
    response->set_empty(remaining == 0);
    KVS_LOG(kInfo, "drain")("sessions_remaining", remaining)("peer", context->peer());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AdminService::ForceRelease(grpc::CallbackServerContext* context,
                                                     const v1::ForceReleaseRequest* request,
                                                     v1::ForceReleaseResponse* response) {
  return RunUnary(context, "Admin.ForceRelease", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(ValidateName(request->session_id(), "session_id", true));
    KVS_RETURN_IF_ERROR(ValidateName(request->sequence_id(), "sequence_id", false));
    if (!request->sequence_id().empty()) {
      KVS_ASSIGN_OR_RETURN(ReleaseCounts released,
                           pool_->ReleaseSequence(request->session_id(), request->sequence_id()));
      response->set_sequences_released(1);
      response->set_blocks_released(released.blocks);
      KVS_LOG(kInfo, "force_release")
      ("session", request->session_id())("sequence", request->sequence_id())("blocks",
                                                                             released.blocks);
      return absl::OkStatus();
    }
    KVS_ASSIGN_OR_RETURN(ReleaseCounts released, pool_->Detach(request->session_id()));
    response->set_sequences_released(released.sequences);
    response->set_blocks_released(released.blocks);
    sidecar_->EndWatch(request->session_id(),
                       grpc::Status(grpc::StatusCode::ABORTED,
                                    absl::StrCat("session '", request->session_id(),
                                                 "' was force-released by an operator")));
    KVS_LOG(kInfo, "force_release")
    ("session", request->session_id())("sequences", released.sequences)("blocks", released.blocks);
    return absl::OkStatus();
  });
}

}  // namespace kvs
