#include "service/server.h"

#include <chrono>
#include <exception>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "service/log.h"

namespace kvs {
namespace {

constexpr char kSidecarServiceName[] = "kvsidecar.v1.Sidecar";
constexpr char kAdminServiceName[] = "kvsidecar.v1.Admin";

// "host:port" -> "host:<port>".
std::string WithPort(const std::string& address, int port) {
  const size_t colon = address.rfind(':');
  return absl::StrCat(address.substr(0, colon), ":", port);
}

// Builds, binds and starts one server with `services`. `port` gets the port bound.
absl::StatusOr<std::unique_ptr<grpc::Server>> BuildServer(
    const std::string& address, std::initializer_list<grpc::Service*> services, int* port) {
  grpc::ServerBuilder builder;
  // TODO(security issue): tokens or mTLS on both services; loopback-only defaults until then.
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), port);
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
  server->sidecar_ = std::make_unique<SidecarService>(pool, options.admin_info.backend);
  SidecarServer* raw = server.get();
  server->admin_ =
      std::make_unique<AdminService>(pool, server->sidecar_.get(), options.admin_info, [raw] {
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
                             &server->data_port_);
    if (!built.ok()) return built.status();
    server->data_server_ = *std::move(built);
    server->admin_port_ = server->data_port_;
  } else {
    auto data = BuildServer(options.listen, {server->sidecar_.get()}, &server->data_port_);
    if (!data.ok()) return data.status();
    server->data_server_ = *std::move(data);
    auto admin = BuildServer(options.admin_listen, {server->admin_.get()}, &server->admin_port_);
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
  return absl::StrCat("kvsidecar listening data=", data_address_, " admin=", admin_address_);
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
