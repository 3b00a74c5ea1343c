#include "service/admin_service.h"

#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cache/clock.h"
#include "cache/policy/policy.h"
#include "cache/policy/registry.h"
#include "gpu/base/status_macros.h"
#include "gpu/device_counters.h"
#include "service/convert.h"
#include "service/drain.h"
#include "service/log.h"
#include "service/rpc_guard.h"

namespace kvs {

namespace v1 = ::kvsidecar::v1;

namespace {

void QuotaToProto(const TenantQuota& quota, v1::Quota* out) {
  out->set_arena_bytes(quota.arena_bytes);
  out->set_host_bytes(quota.host_bytes);
  out->set_disk_bytes(quota.disk_bytes);
  out->set_sequences(quota.sequences);
  out->set_remote_bytes(quota.remote_bytes);
}

void FillDeviceCounters(const DeviceCounts& counts, v1::DeviceCounters& out) {
  for (size_t i = 0; i < kNumBackendMethods; ++i) {
    v1::DeviceCounters::Method* method = out.add_methods();
    method->set_name(BackendMethodName(static_cast<BackendMethod>(i)));
    method->set_calls(counts.calls[i]);
    method->set_jobs(counts.jobs[i]);
  }
  out.set_calls(counts.total_calls());
  out.set_syncs(counts.syncs);
  out.set_uploads(counts.uploads);
  out.set_downloads(counts.downloads);
  out.set_up_bytes(counts.up_bytes);
  out.set_down_bytes(counts.down_bytes);
  out.set_arena_writes(counts.arena_writes);
  out.set_arena_write_bytes(counts.arena_write_bytes);
  out.set_arena_reads(counts.arena_reads);
  out.set_arena_read_bytes(counts.arena_read_bytes);
  out.set_launches(counts.launches);
}

void UsageToProto(const TenantUsage& usage, v1::TenantUsage* out) {
  out->set_arena_bytes(usage.arena_bytes);
  out->set_host_bytes(usage.host_bytes);
  out->set_disk_bytes(usage.disk_bytes);
  out->set_sequences(usage.sequences);
  out->set_sessions(usage.sessions);
  out->set_arena_bytes_reserved(usage.arena_bytes_reserved);
  out->set_remote_bytes(usage.remote_bytes);
}

// The first limit of `quota` that `usage` exceeds, as "quota.<field> N is below the M ... tenant
// uses"; "" if none.
std::string FirstExceeded(absl::string_view tenant, const TenantQuota& quota,
                          const TenantUsage& usage) {
  auto below = [&](absl::string_view field, uint64_t limit, uint64_t used,
                   absl::string_view unit) -> std::string {
    if (limit == 0 || used <= limit) return "";
    return absl::StrCat("quota.", field, " ", limit, " is below the ", used, " ", unit, " tenant ",
                        tenant, " uses now");
  };
  for (std::string reason :
       {below("arena_bytes", quota.arena_bytes, usage.arena_bytes, "arena bytes"),
        below("host_bytes", quota.host_bytes, usage.host_bytes, "host-tier bytes"),
        below("disk_bytes", quota.disk_bytes, usage.disk_bytes, "disk bytes"),
        below("remote_bytes", quota.remote_bytes, usage.remote_bytes, "remote tier bytes"),
        below("sequences", static_cast<uint64_t>(quota.sequences),
              static_cast<uint64_t>(usage.sequences), "sequences")}) {
    if (!reason.empty()) return reason;
  }
  return "";
}

}  // namespace

AdminService::AdminService(KvPool* pool, SidecarService* sidecar, AdminInfo info,
                           std::function<void()> on_drain)
    : pool_(pool), sidecar_(sidecar), info_(std::move(info)), on_drain_(std::move(on_drain)) {}

absl::Status AdminService::CheckAdmin(const grpc::CallbackServerContext& context) const {
  if (info_.authenticator == nullptr) return absl::OkStatus();
  return info_.authenticator->CheckAdmin(context);
}

void AdminService::FillTenants(absl::string_view tenant,
                               google::protobuf::RepeatedPtrField<v1::TenantQuota>* out) const {
  std::map<std::string, std::pair<TenantQuota, TenantUsage>> tenants;
  for (auto& [name, quota] : pool_->TenantQuotas()) {
    tenants[name].first = quota;
    tenants[name].second = pool_->GetTenantUsage(name);
  }
  for (auto& [name, usage] : pool_->AllTenantUsage()) tenants[name].second = usage;
  for (const auto& [name, entry] : tenants) {
    if (!tenant.empty() && name != tenant) continue;
    v1::TenantQuota* item = out->Add();
    item->set_tenant(name);
    QuotaToProto(entry.first, item->mutable_quota());
    UsageToProto(entry.second, item->mutable_usage());
  }
}

grpc::ServerUnaryReactor* AdminService::GetConfig(grpc::CallbackServerContext* context,
                                                  const v1::GetConfigRequest* request,
                                                  v1::GetConfigResponse* response) {
  return RunUnary(context, "Admin.GetConfig", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(CheckAdmin(*context));
    response->set_effective_config_yaml(info_.effective_config_yaml);
    PolicyToProto(pool_->default_policy(), response->mutable_default_policy());
    BudgetToProto(pool_->default_budget(), response->mutable_default_budget());
    response->set_backend(info_.backend);
    response->set_backend_reason(info_.backend_reason);
    for (const auto& [tenant, quota] : pool_->TenantQuotas()) {
      v1::TenantQuota* item = response->add_quotas();
      item->set_tenant(tenant);
      QuotaToProto(quota, item->mutable_quota());
      UsageToProto(pool_->GetTenantUsage(tenant), item->mutable_usage());
    }
    response->set_metrics_address(info_.metrics_address);
    response->set_tls(info_.tls);
    response->set_mtls(info_.mtls);
    response->set_data_auth(info_.authenticator != nullptr && info_.authenticator->data_auth());
    response->set_admin_auth(info_.authenticator != nullptr && info_.authenticator->admin_auth());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AdminService::SetDefaults(grpc::CallbackServerContext* context,
                                                    const v1::SetDefaultsRequest* request,
                                                    v1::SetDefaultsResponse* response) {
  return RunUnary(context, "Admin.SetDefaults", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(CheckAdmin(*context));
    if (!request->has_default_policy() && !request->has_default_budget() &&
        request->rebudget_tenant().empty() && !request->unbounded_budget()) {
      return absl::InvalidArgumentError(
          "set default_policy, default_budget, unbounded_budget or rebudget_tenant: the request "
          "changes nothing");
    }
    if (request->unbounded_budget() &&
        (request->has_default_budget() || !request->rebudget_tenant().empty())) {
      return absl::InvalidArgumentError(
          "unbounded_budget: not with default_budget or rebudget_tenant (an unbounded default "
          "has nothing to compress to)");
    }
    std::optional<PolicyConfig> policy;
    if (request->has_default_policy()) {
      if (request->default_policy().name().empty()) {
        return absl::InvalidArgumentError(
            "default_policy.name must name a policy (e.g. keydiff, streaming_llm)");
      }
      KVS_ASSIGN_OR_RETURN(policy, PolicyFromProto(request->default_policy(), "default_policy."));
      if (policy.has_value() && CapabilitiesOf(*policy).never_evicts) {
        return absl::InvalidArgumentError(
            "default_policy: omnikv cannot be the default policy (it never evicts and its filter "
            "layers depend on the model); name it per sequence");
      }
      if (policy.has_value()) {
        // Everything CreateSequence would refuse is refused now, not at the next attach.
        absl::StatusOr<std::unique_ptr<Policy>> made = MakePolicy(*policy);
        if (!made.ok()) {
          return absl::InvalidArgumentError(
              absl::StrCat("default_policy: ", made.status().message()));
        }
        *policy = (*made)->config();
      }
    }
    std::optional<BudgetConfig> budget;
    if (request->has_default_budget()) {
      const v1::Budget& b = request->default_budget();
      if (b.tokens_per_layer() <= 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "default_budget.tokens_per_layer must be >= 1, got ", b.tokens_per_layer(),
            " (a budget is the tokens each layer keeps; to make new sequences unbounded set "
            "unbounded_budget instead: kvctl set budget none)"));
      }
      if (b.per_layer_tokens_size() > 0) {
        return absl::InvalidArgumentError(
            "default_budget.per_layer_tokens cannot be a default: it depends on each model's "
            "layer count (set it per sequence)");
      }
      KVS_ASSIGN_OR_RETURN(
          budget, BudgetFromProto(b, pool_->options().max_tokens_per_call, "default_budget."));
    }
    if (!request->rebudget_tenant().empty()) {
      if (request->rebudget_tenant() != "*") {
        KVS_RETURN_IF_ERROR(ValidateName(request->rebudget_tenant(), "rebudget_tenant", true));
      }
      const BudgetConfig target = budget.has_value() ? *budget : pool_->default_budget();
      if (target.tokens_per_layer <= 0) {
        return absl::FailedPreconditionError(
            "rebudget_tenant needs a bounded default budget: set default_budget.tokens_per_layer");
      }
    }
    if (request->unbounded_budget()) budget = BudgetConfig{};  // tokens_per_layer 0: unbounded
    pool_->SetDefaults(policy, budget);
    if (!request->rebudget_tenant().empty()) {
      const RebudgetResult result = pool_->RebudgetTenant(request->rebudget_tenant(),
                                                          pool_->default_budget().tokens_per_layer);
      response->set_sequences_rebudgeted(result.rebudgeted);
      for (const std::string& skipped : result.skipped) response->add_rebudget_skipped(skipped);
    }
    PolicyToProto(pool_->default_policy(), response->mutable_default_policy());
    BudgetToProto(pool_->default_budget(), response->mutable_default_budget());
    KVS_LOG(kInfo, "admin_set_defaults")
    ("policy", pool_->default_policy().name)("budget_tokens",
                                             pool_->default_budget().tokens_per_layer)(
        "rebudget_tenant", request->rebudget_tenant())("rebudgeted",
                                                       response->sequences_rebudgeted());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AdminService::SetQuota(grpc::CallbackServerContext* context,
                                                 const v1::SetQuotaRequest* request,
                                                 v1::SetQuotaResponse* response) {
  return RunUnary(context, "Admin.SetQuota", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(CheckAdmin(*context));
    KVS_RETURN_IF_ERROR(ValidateName(request->tenant(), "tenant", true));
    const v1::Quota& q = request->quota();
    if (q.sequences() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("quota.sequences must be >= 0 (0 = unlimited), got ", q.sequences()));
    }
    if (request->rebudget_tokens_per_layer() < 0 ||
        request->rebudget_tokens_per_layer() > kMaxBudgetTokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("rebudget_tokens_per_layer must be in [0, ", kMaxBudgetTokens,
                       "] (0 = the default budget), got ", request->rebudget_tokens_per_layer()));
    }
    TenantQuota quota;
    quota.arena_bytes = q.arena_bytes();
    quota.host_bytes = q.host_bytes();
    quota.disk_bytes = q.disk_bytes();
    quota.sequences = q.sequences();
    quota.remote_bytes = q.remote_bytes();
    const std::string& tenant = request->tenant();
    TenantUsage before = pool_->GetTenantUsage(tenant);
    if (quota.remote_bytes != 0) before.remote_bytes = pool_->TenantRemoteBytes(tenant);
    const std::string exceeded = FirstExceeded(tenant, quota, before);
    int32_t tokens = 0;
    if (!exceeded.empty()) {
      if (!request->rebudget()) {
        return absl::FailedPreconditionError(absl::StrCat(
            exceeded, "; set rebudget to compress its sequences, or release some first"));
      }
      tokens = request->rebudget_tokens_per_layer() > 0 ? request->rebudget_tokens_per_layer()
                                                        : pool_->default_budget().tokens_per_layer;
      if (tokens <= 0) {
        return absl::FailedPreconditionError(
            absl::StrCat(exceeded,
                         "; rebudget needs a budget: set rebudget_tokens_per_layer or a bounded "
                         "default budget (SetDefaults)"));
      }
    }
    pool_->SetTenantQuota(tenant, quota);
    if (tokens > 0) {
      const RebudgetResult result = pool_->RebudgetTenant(tenant, tokens);
      response->set_sequences_rebudgeted(result.rebudgeted);
      for (const std::string& skipped : result.skipped) response->add_rebudget_skipped(skipped);
    }
    TenantUsage usage = pool_->GetTenantUsage(tenant);
    usage.remote_bytes = pool_->TenantRemoteBytes(tenant);
    QuotaToProto(quota, response->mutable_quota());
    UsageToProto(usage, response->mutable_usage());
    response->set_over_quota(!FirstExceeded(tenant, quota, usage).empty());
    KVS_LOG(kInfo, "admin_set_quota")
    ("tenant", tenant)("arena_bytes", quota.arena_bytes)("host_bytes", quota.host_bytes)(
        "disk_bytes", quota.disk_bytes)("remote_bytes", quota.remote_bytes)(
        "sequences", quota.sequences)(
        "rebudgeted", response->sequences_rebudgeted())("over_quota", response->over_quota());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AdminService::GetQuotas(grpc::CallbackServerContext* context,
                                                  const v1::GetQuotasRequest* request,
                                                  v1::GetQuotasResponse* response) {
  return RunUnary(context, "Admin.GetQuotas", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(CheckAdmin(*context));
    KVS_RETURN_IF_ERROR(ValidateName(request->tenant(), "tenant", false));
    FillTenants(request->tenant(), response->mutable_tenants());
    // Remote tier usage asks Redis: here only, not in GetStats' tenant list.
    for (v1::TenantQuota& item : *response->mutable_tenants()) {
      item.mutable_usage()->set_remote_bytes(pool_->TenantRemoteBytes(item.tenant()));
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AdminService::ListSessions(grpc::CallbackServerContext* context,
                                                     const v1::ListSessionsRequest* request,
                                                     v1::ListSessionsResponse* response) {
  return RunUnary(context, "Admin.ListSessions", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(CheckAdmin(*context));
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
    KVS_RETURN_IF_ERROR(CheckAdmin(*context));
    std::map<std::string, uint64_t> block_bytes;  // per session
    for (const SessionInfo& session : pool_->ListSessions()) {
      block_bytes[session.session_id] = session.layout.block_bytes();
    }
    const absl::Time now = MonotonicNow();
    for (const SequenceInfo& info : pool_->ListSequences(request->session_id())) {
      if (!request->session_id().empty() && info.session_id != request->session_id()) continue;
      if (!request->tenant().empty() && info.tenant != request->tenant()) continue;
      v1::SequenceInfo* out = response->add_sequences();
      SequenceInfoToProto(info, out);
      out->set_age_ms(absl::ToInt64Milliseconds(now - info.created));
      out->set_idle_ms(absl::ToInt64Milliseconds(now - info.last_used));
      const uint64_t bytes = block_bytes[info.session_id];
      out->set_blocks(bytes == 0 ? 0 : static_cast<int32_t>(info.arena_bytes / bytes));
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AdminService::ListSpilled(grpc::CallbackServerContext* context,
                                                    const v1::ListSpilledRequest* request,
                                                    v1::ListSpilledResponse* response) {
  return RunUnary(context, "Admin.ListSpilled", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(CheckAdmin(*context));
    KVS_RETURN_IF_ERROR(ValidateName(request->tenant(), "tenant", false));
    if (request->session_id().size() > 256) {
      return absl::InvalidArgumentError("session_id is longer than 256 bytes");
    }
    std::set<std::string> attached;
    for (const SessionInfo& session : pool_->ListSessions()) attached.insert(session.session_id);
    for (const SpilledInfo& info : pool_->ListSpilled()) {
      if (!request->tenant().empty() && info.key.tenant != request->tenant()) continue;
      if (!request->session_id().empty() && info.key.session_id != request->session_id()) continue;
      v1::SpilledCopy* out = response->add_copies();
      out->set_tenant(info.key.tenant);
      out->set_session_id(info.key.session_id);
      out->set_sequence_id(info.key.sequence_id);
      out->set_tier(static_cast<v1::Tier>(info.tier));
      out->set_bytes(info.bytes);
      out->set_spilled_unix_ms(absl::ToUnixMillis(info.spilled));  // 0 when unreadable (lost)
      out->set_session_attached(attached.contains(info.key.session_id));
      out->set_lost(info.lost);
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AdminService::GetStats(grpc::CallbackServerContext* context,
                                                 const v1::GetStatsRequest* request,
                                                 v1::GetStatsResponse* response) {
  return RunUnary(context, "Admin.GetStats", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(CheckAdmin(*context));
    const PoolStats stats = pool_->GetStats();
    response->set_sessions(stats.sessions);
    response->set_sequences(stats.sequences);
    response->set_sequences_spilled(stats.sequences_spilled);
    response->set_arena_bytes_capacity(stats.arena_bytes_capacity);
    response->set_arena_bytes_used(stats.arena_bytes_used);
    response->set_arena_bytes_reserved(stats.arena_bytes_reserved);
    uint64_t host = 0, disk = 0;
    for (const auto& [tenant, usage] : pool_->AllTenantUsage()) {
      host += usage.host_bytes;
      disk += usage.disk_bytes;
    }
    response->set_host_bytes_used(host);
    response->set_host_bytes_capacity(info_.host_bytes_capacity);
    response->set_disk_bytes_capacity(info_.disk_bytes_capacity);
    response->set_disk_bytes_used(disk);
    response->set_tokens_appended(stats.tokens_appended);
    response->set_tokens_evicted(stats.tokens_evicted);
    int64_t merged = 0, kept = 0;
    for (const PolicyTokenTotals& totals : pool_->PolicyTotals()) {
      merged += totals.merged;
      kept += totals.kept;
    }
    response->set_tokens_merged(merged);
    response->set_tokens_kept(kept);
    response->set_sessions_reclaimed(stats.sessions_reclaimed);
    response->set_draining(sidecar_->draining());
    response->set_backend(info_.backend);
    response->set_backend_healthy(pool_->backend()->healthy());
    response->set_uptime_ms(absl::ToInt64Milliseconds(MonotonicNow() - started_));
    FillDeviceCounters(DeviceCounters::Read(), *response->mutable_device());
    FillTenants("", response->mutable_tenants());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AdminService::Drain(grpc::CallbackServerContext* context,
                                              const v1::DrainRequest* request,
                                              v1::DrainResponse* response) {
  return RunUnary(context, "Admin.Drain", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(CheckAdmin(*context));
    // Validated before anything changes: a refused call does not start draining.
    const int to = static_cast<int>(request->to());
    if (to != v1::TIER_UNSPECIFIED && to != v1::TIER_DISK && to != v1::TIER_REMOTE) {
      return absl::InvalidArgumentError(absl::StrCat(
          "to must be TIER_DISK or the remote tier (4), or unset to only stop attaches, got ",
          v1::Tier_Name(request->to()).empty() ? absl::StrCat(to) : v1::Tier_Name(request->to()),
          to == v1::TIER_HOST ? ": host copies do not outlive the process" : ""));
    }
    if (request->grace_ms() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("grace_ms must be >= 0 (0 = --drain_grace), got ", request->grace_ms()));
    }
    sidecar_->StartDraining();
    std::call_once(drain_once_, [&] {
      if (on_drain_) on_drain_();
    });
    if (to != v1::TIER_UNSPECIFIED) {
      const StorageTier target = static_cast<StorageTier>(to);
      const absl::Duration grace = request->grace_ms() > 0
                                       ? absl::Milliseconds(request->grace_ms())
                                       : info_.drain_grace;
      KVS_LOG(kInfo, "drain_to_tier")
      ("to", DrainTargetName(target))("grace_ms", absl::ToInt64Milliseconds(grace))(
          "peer", context->peer());
      const DrainReport report =
          DrainSequences(*pool_, target, MonotonicNow() + grace, /*retry=*/true);
      LogDrainReport(report, target, "drained");
      for (const DrainedSequence& sequence : report.sequences) {
        v1::DrainedSequence* out = response->add_sequences();
        out->set_tenant(sequence.tenant);
        out->set_session_id(sequence.session_id);
        out->set_sequence_id(sequence.sequence_id);
        out->set_moved(sequence.moved);
        out->set_tier(static_cast<v1::Tier>(sequence.tier));
        out->set_bytes(sequence.bytes);
        out->set_reason(sequence.reason);
      }
      response->set_sequences_moved(report.moved);
      response->set_sequences_not_moved(report.not_moved);
      response->set_grace_expired(report.grace_expired);
      response->set_elapsed_ms(absl::ToInt64Milliseconds(report.elapsed));
    }
    const PoolStats stats = pool_->GetStats();
    response->set_sessions_remaining(stats.sessions);
    response->set_sequences_remaining(stats.sequences);
    response->set_empty(stats.sessions == 0);
    KVS_LOG(kInfo, "drain")("sessions_remaining", stats.sessions)("peer", context->peer());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* AdminService::ForceRelease(grpc::CallbackServerContext* context,
                                                     const v1::ForceReleaseRequest* request,
                                                     v1::ForceReleaseResponse* response) {
  return RunUnary(context, "Admin.ForceRelease", [&]() -> absl::Status {
    KVS_RETURN_IF_ERROR(CheckAdmin(*context));
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
