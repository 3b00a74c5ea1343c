// AdminService: the operator API (kvsidecar.v1.Admin) on the gRPC callback API: effective
// configuration, live defaults (policy, budget) with an optional re-budget of a tenant's
// sequences, tenant quotas, sessions, sequences, stats, drain and force-release. Every call needs
// the admin token when one is configured (UNAUTHENTICATED otherwise).
//
// Threading: handlers run concurrently on gRPC's callback threads; everything they touch (pool,
// SidecarService hooks, the authenticator) is thread-safe, the rest is immutable after
// construction.
#ifndef KVSIDECAR_SERVICE_ADMIN_SERVICE_H_
#define KVSIDECAR_SERVICE_ADMIN_SERVICE_H_

#include <cstdint>
#include <functional>
#include <mutex>
#include <string>

#include "absl/time/time.h"
#include "cache/clock.h"
#include "cache/pool.h"
#include "grpcpp/grpcpp.h"
#include "kvsidecar/v1/admin.grpc.pb.h"
#include "service/auth.h"
#include "service/sidecar_service.h"

namespace kvs {

struct AdminInfo {
  std::string effective_config_yaml;
  std::string backend;               // "cpu"
  std::string backend_reason;        // why that backend
  std::string metrics_address;       // "" = no /metrics endpoint
  uint64_t host_bytes_capacity = 0;  // spill tiers (0 = none / unlimited)
  uint64_t disk_bytes_capacity = 0;
  bool tls = false;
  bool mtls = false;
  // Admin.Drain with a target tier and no grace_ms: how long the moves may take (--drain_grace).
  absl::Duration drain_grace = absl::Seconds(25);
  const Authenticator* authenticator = nullptr;  // null = open; must outlive the service
};

class AdminService final : public ::kvsidecar::v1::Admin::CallbackService {
 public:
  // `pool` and `sidecar` must outlive the service. `on_drain` (may be empty) runs once, on the
  // first Drain, after the data plane stopped accepting attaches (the server uses it to mark the
  // Sidecar service NOT_SERVING in the health service).
  AdminService(KvPool* pool, SidecarService* sidecar, AdminInfo info,
               std::function<void()> on_drain = {});

  grpc::ServerUnaryReactor* GetConfig(grpc::CallbackServerContext* context,
                                      const ::kvsidecar::v1::GetConfigRequest* request,
                                      ::kvsidecar::v1::GetConfigResponse* response) override;
  grpc::ServerUnaryReactor* SetDefaults(grpc::CallbackServerContext* context,
                                        const ::kvsidecar::v1::SetDefaultsRequest* request,
                                        ::kvsidecar::v1::SetDefaultsResponse* response) override;
  grpc::ServerUnaryReactor* SetQuota(grpc::CallbackServerContext* context,
                                     const ::kvsidecar::v1::SetQuotaRequest* request,
                                     ::kvsidecar::v1::SetQuotaResponse* response) override;
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* context,
                                         const ::kvsidecar::v1::ListSessionsRequest* request,
                                         ::kvsidecar::v1::ListSessionsResponse* response) override;
  grpc::ServerUnaryReactor* ListSequences(
      grpc::CallbackServerContext* context, const ::kvsidecar::v1::ListSequencesRequest* request,
      ::kvsidecar::v1::ListSequencesResponse* response) override;
  grpc::ServerUnaryReactor* ListSpilled(grpc::CallbackServerContext* context,
                                        const ::kvsidecar::v1::ListSpilledRequest* request,
                                        ::kvsidecar::v1::ListSpilledResponse* response) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* context,
                                     const ::kvsidecar::v1::GetStatsRequest* request,
                                     ::kvsidecar::v1::GetStatsResponse* response) override;
  // Stops attaches (UNAVAILABLE from then on), sends KIND_DRAINING to every watcher, and reports
  // the sessions still attached. Call it again to poll until `empty`. With a target tier
  // (request.to), also moves every sequence there within the grace period (service/drain.h) and
  // reports per sequence what moved and what did not; the call takes up to the grace period.
  grpc::ServerUnaryReactor* Drain(grpc::CallbackServerContext* context,
                                  const ::kvsidecar::v1::DrainRequest* request,
                                  ::kvsidecar::v1::DrainResponse* response) override;
  // Releases a whole session (its watch stream ends with ABORTED) or one sequence.
  grpc::ServerUnaryReactor* ForceRelease(grpc::CallbackServerContext* context,
                                         const ::kvsidecar::v1::ForceReleaseRequest* request,
                                         ::kvsidecar::v1::ForceReleaseResponse* response) override;
  grpc::ServerUnaryReactor* GetQuotas(grpc::CallbackServerContext* context,
                                      const ::kvsidecar::v1::GetQuotasRequest* request,
                                      ::kvsidecar::v1::GetQuotasResponse* response) override;

 private:
  absl::Status CheckAdmin(const grpc::CallbackServerContext& context) const;
  // Every tenant with a quota or a session (or only `tenant`), sorted.
  void FillTenants(absl::string_view tenant,
                   google::protobuf::RepeatedPtrField<::kvsidecar::v1::TenantQuota>* out) const;

  KvPool* const pool_;
  const absl::Time started_ = MonotonicNow();
  SidecarService* const sidecar_;
  const AdminInfo info_;
  const std::function<void()> on_drain_;
  std::once_flag drain_once_;
};

}  // namespace kvs

#endif  // KVSIDECAR_SERVICE_ADMIN_SERVICE_H_
