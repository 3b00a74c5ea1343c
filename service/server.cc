#include "service/server.h"

#include <chrono>
#include <exception>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/support/server_interceptor.h"
#include "service/log.h"
#include "service/status_convert.h"

namespace kvs {
namespace {

constexpr char kSidecarServiceName[] = "kvsidecar.v1.Sidecar";
constexpr char kAdminServiceName[] = "kvsidecar.v1.Admin";

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
      : metrics_(metrics), method_(SplitMethod(method)), start_(absl::Now()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status status = methods->GetSendStatus();
      const double seconds = absl::ToDoubleSeconds(absl::Now() - start_);
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

// Builds, binds and starts one server with `services`. `port` gets the port bound.
absl::StatusOr<std::unique_ptr<grpc::Server>> BuildServer(
    const std::string& address, std::initializer_list<grpc::Service*> services, int* port,
    const std::shared_ptr<grpc::ServerCredentials>& credentials, MetricsRegistry* metrics) {
  grpc::ServerBuilder builder;
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
  server->metrics_.AddCollector([raw] { raw->CollectPoolMetrics(); });
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
                             &server->data_port_, *credentials, &server->metrics_);
    if (!built.ok()) return built.status();
    server->data_server_ = *std::move(built);
    server->admin_port_ = server->data_port_;
  } else {
    auto data = BuildServer(options.listen, {server->sidecar_.get()}, &server->data_port_,
                            *credentials, &server->metrics_);
    if (!data.ok()) return data.status();
    server->data_server_ = *std::move(data);
    auto admin = BuildServer(options.admin_listen, {server->admin_.get()}, &server->admin_port_,
                             *credentials, &server->metrics_);
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

void SidecarServer::CollectPoolMetrics() {
  MetricsRegistry& m = metrics_;
  const PoolStats stats = pool_->GetStats();
  constexpr char kUsed[] = "kvsidecar_tier_used_bytes";
  constexpr char kUsedHelp[] = "Bytes in use per tier (arena: blocks held by sequences).";
  constexpr char kCap[] = "kvsidecar_tier_capacity_bytes";
  constexpr char kCapHelp[] =
      "Capacity per tier in bytes (0 = not configured, or unlimited for the disk tier).";
  m.GetGauge(kUsed, kUsedHelp, {{"tier", "arena"}})->Set(stats.arena_bytes_used);
  m.GetGauge(kCap, kCapHelp, {{"tier", "arena"}})->Set(stats.arena_bytes_capacity);
  m.GetGauge("kvsidecar_arena_reserved_bytes",
             "Bytes of the session arenas (each session's arena is reserved whole at Attach).")
      ->Set(stats.arena_bytes_reserved);
  uint64_t host = 0, disk = 0;
  for (const auto& [tenant, usage] : pool_->AllTenantUsage()) {
    host += usage.host_bytes;
    disk += usage.disk_bytes;
    m.GetGauge("kvsidecar_tenant_arena_used_bytes", "Arena bytes in use per tenant.",
               {{"tenant", tenant}})
        ->Set(usage.arena_bytes);
    m.GetGauge("kvsidecar_tenant_sequences", "Sequences per tenant.", {{"tenant", tenant}})
        ->Set(usage.sequences);
  }
  m.GetGauge(kUsed, kUsedHelp, {{"tier", "host"}})->Set(host);
  m.GetGauge(kUsed, kUsedHelp, {{"tier", "disk"}})->Set(disk);
  m.GetGauge(kCap, kCapHelp, {{"tier", "host"}})->Set(host_capacity_);
  m.GetGauge(kCap, kCapHelp, {{"tier", "disk"}})->Set(disk_capacity_);
  m.GetGauge("kvsidecar_sessions", "Attached sessions.")->Set(stats.sessions);
  m.GetGauge("kvsidecar_sequences", "Live sequences.")->Set(stats.sequences);
  m.GetCounter("kvsidecar_sessions_reclaimed_total",
               "Sessions reclaimed by lease expiry or a lost connection.")
      ->Set(stats.sessions_reclaimed);
  m.GetGauge("kvsidecar_draining", "1 while the sidecar is draining.")
      ->Set(sidecar_ != nullptr && sidecar_->draining() ? 1 : 0);
  m.GetGauge("kvsidecar_backend_healthy", "1 when the compute backend is healthy.",
             {{"backend", std::string(pool_->backend()->name())}})
      ->Set(1);
  for (const PolicyTokenTotals& p : pool_->PolicyTotals()) {
    const MetricLabels labels = {{"policy", p.policy}};
    m.GetCounter("kvsidecar_tokens_appended_total",
                 "Layer-tokens appended (a token in 3 layers counts 3), by policy.", labels)
        ->Set(p.appended);
    m.GetCounter("kvsidecar_tokens_evicted_total", "Layer-tokens evicted, by policy.", labels)
        ->Set(p.evicted);
    m.GetCounter("kvsidecar_tokens_merged_total",
                 "Layer-tokens merged into kept ones (D2O), by policy.", labels)
        ->Set(p.merged);
    m.GetGauge("kvsidecar_tokens_kept", "Layer-tokens held now by live sequences, by policy.",
               labels)
        ->Set(p.kept);
    m.GetGauge("kvsidecar_policy_sequences", "Live sequences, by policy.", labels)
        ->Set(p.sequences);
    Histogram* budgets =
        m.GetHistogram("kvsidecar_sequence_budget_tokens",
                       "Token budget per layer of the live sequences (0 = unbounded), by policy.",
                       BudgetBuckets(), labels);
    budgets->Reset();
    for (int32_t budget : p.budgets) budgets->Observe(budget);
  }
}

void SidecarServer::ReaperLoop(absl::Duration interval) {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stop_), interval);
      if (stop_) return;
    }
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
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
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
