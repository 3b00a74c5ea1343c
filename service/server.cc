#include "service/server.h"

#include <chrono>
#include <exception>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "cache/clock.h"
#include "gpu/device_counters.h"
#include "grpc/health/v1/health.pb.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/support/server_interceptor.h"
#include "service/log.h"
#include "service/process_metrics.h"
#include "service/reflection_v1.h"
#include "service/status_convert.h"

namespace kvs {
namespace {

constexpr char kSidecarServiceName[] = "kvsidecar.v1.Sidecar";
constexpr char kAdminServiceName[] = "kvsidecar.v1.Admin";
constexpr char kHealthServiceName[] = "grpc.health.v1.Health";
constexpr char kReflectionV1AlphaName[] = "grpc.reflection.v1alpha.ServerReflection";

// "host:port" -> "host:<port>".
std::string WithPort(const std::string& address, int port) {
  const size_t colon = address.rfind(':');
  return absl::StrCat(address.substr(0, colon), ":", port);
}

// "/kvsidecar.v1.Sidecar/Attach" -> ("Sidecar", "Attach").
std::pair<std::string, std::string> SplitMethod(absl::string_view path) {
  const size_t slash = path.rfind('/');
  if (slash == absl::string_view::npos) return {"", std::string(path)};
  absl::string_view service = path.substr(0, slash);
  const size_t dot = service.rfind('.');
  if (dot != absl::string_view::npos) service.remove_prefix(dot + 1);
  while (!service.empty() && service.front() == '/') service.remove_prefix(1);
  return {std::string(service), std::string(path.substr(slash + 1))};
}

// Counts every call and its latency by service, method and status code, from the arrival of the
// call to its status (streams included).
class RpcMetricsInterceptor final : public grpc::experimental::Interceptor {
 public:
  RpcMetricsInterceptor(MetricsRegistry* metrics, absl::string_view method)
      : metrics_(metrics), method_(SplitMethod(method)), start_(MonotonicNow()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status status = methods->GetSendStatus();
      const double seconds = absl::ToDoubleSeconds(MonotonicNow() - start_);
      const std::string code = absl::StatusCodeToString(FromGrpcStatus(status).code());
      const MetricLabels labels = {
          {"service", method_.first}, {"method", method_.second}, {"code", code}};
      metrics_
          ->GetCounter("kvsidecar_rpcs_total", "gRPC calls finished, by method and code.", labels)
          ->Increment();
      metrics_
          ->GetHistogram("kvsidecar_rpc_duration_seconds",
                         "gRPC call latency from arrival to status, by method and code.",
                         LatencyBuckets(), labels)
          ->Observe(seconds);
      if (absl::StrContains(method_.second, "Compress") || method_.second == "DecodeStep") {
        metrics_
            ->GetHistogram("kvsidecar_compress_duration_seconds",
                           "Latency of the calls that run a compression (Compress, "
                           "BatchCompress, DecodeStep), by method and code.",
                           LatencyBuckets(), labels)
            ->Observe(seconds);
      }
    }
    methods->Proceed();
  }

 private:
  MetricsRegistry* const metrics_;
  const std::pair<std::string, std::string> method_;
  const absl::Time start_;
};

class RpcMetricsFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RpcMetricsFactory(MetricsRegistry* metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new RpcMetricsInterceptor(metrics_, info->method());
  }

 private:
  MetricsRegistry* const metrics_;
};

// Builds, binds and starts one server with `services` (named `names`), standard health checking
// and reflection v1alpha (the library's plugin) and v1 (`reflection`, made here and kept by the
// caller). `port` gets the port bound.
absl::StatusOr<std::unique_ptr<grpc::Server>> BuildServer(
    const std::string& address, std::initializer_list<grpc::Service*> services,
    const std::vector<std::string>& names, int* port,
    const std::shared_ptr<grpc::ServerCredentials>& credentials, MetricsRegistry* metrics,
    std::vector<std::unique_ptr<ReflectionV1Service>>* reflection) {
  std::vector<std::string> listed = names;
  listed.insert(listed.end(),
                {kHealthServiceName, kReflectionV1AlphaName, ReflectionV1Service::kServiceName});
  reflection->push_back(std::make_unique<ReflectionV1Service>(std::move(listed)));
  grpc::ServerBuilder builder;
  builder.RegisterService(reflection->back().get());
  builder.AddListeningPort(address, credentials, port);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> factories;
  factories.push_back(std::make_unique<RpcMetricsFactory>(metrics));
  builder.experimental().SetInterceptorCreators(std::move(factories));
  // Without this, Linux SO_REUSEPORT lets a second sidecar bind a port that is in use.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  for (grpc::Service* service : services) builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || *port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", address, " (address in use or not valid)"));
  }
  return server;
}

}  // namespace

absl::StatusOr<std::unique_ptr<SidecarServer>> SidecarServer::Start(KvPool* pool,
                                                                    const ServerOptions& options) {
  // Both are process-wide switches read when a server is built.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  // gRPC's health service carries no protobuf descriptors; ours (compiled from the same proto)
  // must be in the generated pool for reflection to describe it. Naming one links them in.
  (void)grpc::health::v1::HealthCheckRequest::descriptor();

  std::unique_ptr<SidecarServer> server(new SidecarServer(pool));
  auto credentials = MakeServerCredentials(options.tls);
  if (!credentials.ok()) return credentials.status();
  server->auth_ = std::make_unique<Authenticator>(options.auth);
  if (!options.arena_socket.empty()) {
    ArenaFdServer::Options fd_options;
    fd_options.socket_path = options.arena_socket;
    fd_options.nonce_ttl = options.arena_nonce_ttl;
    auto fd_server = ArenaFdServer::Start(
        fd_options, [pool](absl::string_view session_id) -> absl::StatusOr<int> {
          return pool->DuplicateArenaFd(std::string_view(session_id.data(), session_id.size()));
        });
    if (!fd_server.ok()) return fd_server.status();
    server->arena_fd_server_ = *std::move(fd_server);
  }
  server->sidecar_ = std::make_unique<SidecarService>(pool, options.admin_info.backend);
  server->sidecar_->set_authenticator(server->auth_.get());
  server->sidecar_->set_arena_fd_server(server->arena_fd_server_.get());
  SidecarServer* raw = server.get();
  AdminInfo admin_info = options.admin_info;
  admin_info.tls = !options.tls.cert_file.empty();
  admin_info.mtls = !options.tls.client_ca_file.empty();
  admin_info.authenticator = server->auth_.get();
  if (!options.metrics_listen.empty()) {
    auto metrics = MetricsHttpServer::Start(options.metrics_listen, &server->metrics_);
    if (!metrics.ok()) return metrics.status();
    server->metrics_server_ = *std::move(metrics);
    server->metrics_address_ = server->metrics_server_->address();
    admin_info.metrics_address = server->metrics_address_;
  }
  server->host_capacity_ = options.admin_info.host_bytes_capacity;
  server->disk_capacity_ = options.admin_info.disk_bytes_capacity;
  server->tenant_labeler_ =
      std::make_unique<TenantLabeler>(options.metrics_tenants, options.metrics_max_tenants);
  server->metrics_.AddCollector(
      [raw](std::vector<prometheus::MetricFamily>* out) { raw->CollectPoolMetrics(out); });
  server->metrics_.AddCollector([build_info = options.build_info](
                                    std::vector<prometheus::MetricFamily>* out) {
    CollectProcessMetrics(build_info, out);
  });
  // A histogram of the budgets sequences are created with: observed once per sequence, so that
  // it only counts up (a distribution over the live sequences would fall as they end).
  server->sidecar_->set_budget_observer([raw](const std::string& policy, int32_t tokens) {
    raw->metrics_
        .GetHistogram("kvsidecar_sequence_budget_tokens",
                      "Token budget per layer given to each sequence at CreateSequence "
                      "(0 = unbounded), by policy.",
                      BudgetBuckets(), {{"policy", policy}})
        ->Observe(tokens);
  });
  server->admin_ = std::make_unique<AdminService>(pool, server->sidecar_.get(), admin_info, [raw] {
    // Load balancers stop routing new workers.
    if (auto* health = raw->data_server_->GetHealthCheckService()) {
      health->SetServingStatus(kSidecarServiceName, false);
    }
  });
  // Equal addresses share one server, except port 0: "any free port" twice means two ports.
  const bool shared =
      options.admin_listen == options.listen && !absl::EndsWith(options.listen, ":0");
  if (shared) {
    auto built = BuildServer(options.listen, {server->sidecar_.get(), server->admin_.get()},
                             {kSidecarServiceName, kAdminServiceName}, &server->data_port_,
                             *credentials, &server->metrics_, &server->reflection_);
    if (!built.ok()) return built.status();
    server->data_server_ = *std::move(built);
    server->admin_port_ = server->data_port_;
  } else {
    auto data = BuildServer(options.listen, {server->sidecar_.get()}, {kSidecarServiceName},
                            &server->data_port_, *credentials, &server->metrics_,
                            &server->reflection_);
    if (!data.ok()) return data.status();
    server->data_server_ = *std::move(data);
    auto admin = BuildServer(options.admin_listen, {server->admin_.get()}, {kAdminServiceName},
                             &server->admin_port_, *credentials, &server->metrics_,
                             &server->reflection_);
    if (!admin.ok()) {
      server->data_server_->Shutdown();
      server->data_server_->Wait();
      return admin.status();
    }
    server->admin_server_ = *std::move(admin);
  }
  server->data_address_ = WithPort(options.listen, server->data_port_);
  server->admin_address_ = WithPort(options.admin_listen, server->admin_port_);

  if (auto* health = server->data_server_->GetHealthCheckService()) {
    health->SetServingStatus(true);
    health->SetServingStatus(kSidecarServiceName, true);
    if (shared) health->SetServingStatus(kAdminServiceName, true);
  }
  if (server->admin_server_ != nullptr) {
    if (auto* health = server->admin_server_->GetHealthCheckService()) {
      health->SetServingStatus(true);
      health->SetServingStatus(kAdminServiceName, true);
    }
  }
  server->reaper_ =
      std::thread([raw, interval = options.reap_interval] { raw->ReaperLoop(interval); });
  KVS_LOG(kInfo, "serving")
  ("data", server->data_address_)("admin", server->admin_address_)("backend",
                                                                   options.admin_info.backend);
  return server;
}

SidecarServer::~SidecarServer() { Shutdown(absl::ZeroDuration()); }

std::string SidecarServer::ListeningLine() const {
  std::string line =
      absl::StrCat("kvsidecar listening data=", data_address_, " admin=", admin_address_);
  if (!metrics_address_.empty()) absl::StrAppend(&line, " metrics=", metrics_address_);
  return line;
}

void SidecarServer::CollectPoolMetrics(std::vector<prometheus::MetricFamily>* out) {
  using prometheus::MetricType;
  const PoolStats stats = pool_->GetStats();
  StateFamily used("kvsidecar_tier_used_bytes",
                   "Bytes in use per tier (arena: blocks held by sequences).", MetricType::Gauge);
  StateFamily capacity(
      "kvsidecar_tier_capacity_bytes",
      "Capacity per tier in bytes (0 = not configured, or unlimited for the disk tier).",
      MetricType::Gauge);
  StateFamily reserved(
      "kvsidecar_arena_reserved_bytes",
      "Bytes of the session arenas (each session's arena is reserved whole at Attach).",
      MetricType::Gauge);
  used.AddSample({{"tier", "arena"}}, stats.arena_bytes_used);
  capacity.AddSample({{"tier", "arena"}}, stats.arena_bytes_capacity);
  reserved.AddSample({}, stats.arena_bytes_reserved);

  // Per tenant: only the tenants that have a session now, their label bounded by the labeler.
  StateFamily tenant_used("kvsidecar_tenant_arena_used_bytes",
                          "Arena bytes in use per tenant (tenants beyond --metrics_max_tenants "
                          "are summed under the tenant _other).",
                          MetricType::Gauge);
  StateFamily tenant_reserved("kvsidecar_tenant_arena_reserved_bytes",
                              "Bytes of the arenas of each tenant's sessions.", MetricType::Gauge);
  StateFamily tenant_sessions("kvsidecar_tenant_sessions", "Attached sessions per tenant.",
                              MetricType::Gauge);
  StateFamily tenant_sequences("kvsidecar_tenant_sequences", "Sequences per tenant.",
                               MetricType::Gauge);
  const auto usage = pool_->AllTenantUsage();
  std::vector<std::string> tenants;
  tenants.reserve(usage.size());
  for (const auto& [tenant, u] : usage) tenants.push_back(tenant);
  const std::vector<std::string> labels = tenant_labeler_->Assign(tenants);
  uint64_t host = 0, disk = 0;
  for (size_t i = 0; i < usage.size(); ++i) {
    const TenantUsage& u = usage[i].second;
    host += u.host_bytes;
    disk += u.disk_bytes;
    const MetricLabels tenant = {{"tenant", labels[i]}};
    tenant_used.AddSample(tenant, u.arena_bytes);
    tenant_reserved.AddSample(tenant, u.arena_bytes_reserved);
    tenant_sessions.AddSample(tenant, u.sessions);
    tenant_sequences.AddSample(tenant, u.sequences);
  }
  used.AddSample({{"tier", "host"}}, host);
  used.AddSample({{"tier", "disk"}}, disk);
  capacity.AddSample({{"tier", "host"}}, host_capacity_);
  capacity.AddSample({{"tier", "disk"}}, disk_capacity_);

  StateFamily sessions("kvsidecar_sessions", "Attached sessions.", MetricType::Gauge);
  sessions.AddSample({}, stats.sessions);
  StateFamily sequences("kvsidecar_sequences", "Live sequences.", MetricType::Gauge);
  sequences.AddSample({}, stats.sequences);
  // The pool's own totals, which only grow: exposed as counters as they are.
  StateFamily reclaimed("kvsidecar_sessions_reclaimed_total",
                        "Sessions reclaimed by lease expiry or a lost connection.",
                        MetricType::Counter);
  reclaimed.AddSample({}, stats.sessions_reclaimed);
  StateFamily draining("kvsidecar_draining", "1 while the sidecar is draining.",
                       MetricType::Gauge);
  draining.AddSample({}, sidecar_ != nullptr && sidecar_->draining() ? 1 : 0);
  StateFamily healthy("kvsidecar_backend_healthy",
                      "1 when the compute backend reports itself healthy (0 after a device "
                      "error).",
                      MetricType::Gauge);
  healthy.AddSample({{"backend", std::string(pool_->backend()->name())}},
                    pool_->backend()->healthy() ? 1 : 0);

  StateFamily appended("kvsidecar_tokens_appended_total",
                       "Layer-tokens appended (a token in 3 layers counts 3), by policy.",
                       MetricType::Counter);
  StateFamily evicted("kvsidecar_tokens_evicted_total", "Layer-tokens evicted, by policy.",
                      MetricType::Counter);
  StateFamily merged("kvsidecar_tokens_merged_total",
                     "Layer-tokens merged into kept ones (D2O), by policy.", MetricType::Counter);
  StateFamily kept("kvsidecar_tokens_kept",
                   "Layer-tokens held now by live sequences, by policy.", MetricType::Gauge);
  StateFamily policy_sequences("kvsidecar_policy_sequences", "Live sequences, by policy.",
                               MetricType::Gauge);
  for (const PolicyTokenTotals& p : pool_->PolicyTotals()) {
    const MetricLabels policy = {{"policy", p.policy}};
    appended.AddSample(policy, p.appended);
    evicted.AddSample(policy, p.evicted);
    merged.AddSample(policy, p.merged);
    kept.AddSample(policy, p.kept);
    policy_sequences.AddSample(policy, p.sequences);
  }
  for (const StateFamily* family :
       {&used, &capacity, &reserved, &tenant_used, &tenant_reserved, &tenant_sessions,
        &tenant_sequences, &sessions, &sequences, &reclaimed, &draining, &healthy, &appended,
        &evicted, &merged, &kept, &policy_sequences}) {
    out->push_back(family->Build());
  }
  CollectDeviceMetrics(out);
}

// The compute seam's counters (gpu/device_counters.h): what a GPU's time goes to is mostly how
// often the host waits for it and how many bytes cross the bus, which these show per second.
void SidecarServer::CollectDeviceMetrics(std::vector<prometheus::MetricFamily>* out) {
  using prometheus::MetricType;
  const DeviceCounts counts = DeviceCounters::Read();
  StateFamily calls("kvsidecar_backend_calls_total",
                    "Compute backend calls the cache core made, by method.", MetricType::Counter);
  StateFamily jobs("kvsidecar_backend_jobs_total", "Jobs those calls carried, by method.",
                   MetricType::Counter);
  for (size_t i = 0; i < kNumBackendMethods; ++i) {
    const MetricLabels method = {{"method", BackendMethodName(static_cast<BackendMethod>(i))}};
    calls.AddSample(method, counts.calls[i]);
    jobs.AddSample(method, counts.jobs[i]);
  }
  StateFamily syncs("kvsidecar_device_synchronizations_total",
                    "Times the host waited for the device (0 on the CPU backend).",
                    MetricType::Counter);
  syncs.AddSample({}, counts.syncs);
  StateFamily transfers("kvsidecar_device_transfers_total",
                        "Copies between host and device memory, by direction.",
                        MetricType::Counter);
  StateFamily transfer_bytes("kvsidecar_device_transfer_bytes_total",
                             "Bytes copied between host and device memory, by direction.",
                             MetricType::Counter);
  transfers.AddSample({{"direction", "to_device"}}, counts.uploads);
  transfers.AddSample({{"direction", "to_host"}}, counts.downloads);
  transfer_bytes.AddSample({{"direction", "to_device"}}, counts.up_bytes);
  transfer_bytes.AddSample({{"direction", "to_host"}}, counts.down_bytes);
  StateFamily arena_copies("kvsidecar_arena_host_copies_total",
                           "Host copies into (write) and out of (read) session arenas.",
                           MetricType::Counter);
  StateFamily arena_bytes("kvsidecar_arena_host_copy_bytes_total",
                          "Bytes of host copies into and out of session arenas.",
                          MetricType::Counter);
  arena_copies.AddSample({{"direction", "write"}}, counts.arena_writes);
  arena_copies.AddSample({{"direction", "read"}}, counts.arena_reads);
  arena_bytes.AddSample({{"direction", "write"}}, counts.arena_write_bytes);
  arena_bytes.AddSample({{"direction", "read"}}, counts.arena_read_bytes);
  StateFamily launches("kvsidecar_device_kernel_launches_total",
                       "Device kernels launched (CUDA backend; the simulated device's count).",
                       MetricType::Counter);
  launches.AddSample({}, counts.launches);
  for (const StateFamily* family : {&calls, &jobs, &syncs, &transfers, &transfer_bytes,
                                    &arena_copies, &arena_bytes, &launches}) {
    out->push_back(family->Build());
  }
}

void SidecarServer::ReaperLoop(absl::Duration interval) {
  while (!reaper_stop_.WaitFor(interval)) {
    try {
      const int reaped = pool_->ReapExpired();
      if (reaped > 0) {
        KVS_LOG(kInfo, "session_reclaimed")("reason", "lease_expired")("sessions", reaped);
        sidecar_->EndOrphanWatches();
      }
    } catch (const std::exception& e) {
      KVS_LOG(kError, "reaper_failed")("error", e.what());
    } catch (...) {
      KVS_LOG(kError, "reaper_failed")("error", "unknown exception");
    }
  }
}

void SidecarServer::Shutdown(absl::Duration grace) {
  if (shut_down_) return;
  shut_down_ = true;
  KVS_LOG(kInfo, "shutting_down")("grace_ms", absl::ToInt64Milliseconds(grace));
  // The collectors read the pool and the services: stop scrapes first.
  if (metrics_server_ != nullptr) metrics_server_->Stop();
  for (grpc::Server* server : {data_server_.get(), admin_server_.get()}) {
    if (server == nullptr) continue;
    if (auto* health = server->GetHealthCheckService()) health->Shutdown();
  }
  // Watch streams never end on their own; end them first so the servers can drain.
  if (sidecar_ != nullptr) sidecar_->Shutdown();
  reaper_stop_.Stop();
  if (reaper_.joinable()) reaper_.join();
  const auto deadline = std::chrono::system_clock::now() + absl::ToChronoMilliseconds(grace);
  for (grpc::Server* server : {data_server_.get(), admin_server_.get()}) {
    if (server == nullptr) continue;
    server->Shutdown(deadline);
    server->Wait();
  }
  KVS_LOG(kInfo, "stopped");
}

}  // namespace kvs
