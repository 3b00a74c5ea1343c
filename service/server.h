// SidecarServer: builds and runs the gRPC servers around one KvPool: the data plane on
// `listen`, Admin on `admin_listen` (one server for both when the addresses are equal and the port
// is not 0), standard health checking and server reflection (v1alpha and v1) on each, and a
// reaper thread that reclaims sessions whose lease lapsed. Port 0 binds a free port; the ports
// actually bound are reported.
// Operations: TLS / mTLS credentials and bearer-token checks on both gRPC ports (service/auth.h),
// RPC metrics by method and code for every call (a gRPC server interceptor), and the Prometheus
// /metrics HTTP endpoint on its own port (service/metrics.h) when `metrics_listen` is set.
//
// Threading: Start/Shutdown from one controlling thread; the accessors are immutable after
// Start. Lifetime: the pool must outlive the server; Shutdown (or the destructor) finishes watch
// streams, stops the reaper, shuts the gRPC servers down with a deadline and waits for them.
#ifndef KVSIDECAR_SERVICE_SERVER_H_
#define KVSIDECAR_SERVICE_SERVER_H_

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cache/pool.h"
#include "grpcpp/grpcpp.h"
#include "gpu/base/stop_signal.h"
#include "service/admin_service.h"
#include "service/auth.h"
#include "service/metrics.h"
#include "service/reflection_v1.h"
#include "service/arena_fd_server.h"
#include "service/sidecar_service.h"

namespace kvs {

struct ServerOptions {
  std::string listen = "127.0.0.1:50051";
  std::string admin_listen = "127.0.0.1:50052";
  absl::Duration reap_interval = absl::Milliseconds(200);
  AdminInfo admin_info;  // what Admin.GetConfig reports; admin_info.backend also goes to Attach
  TlsFiles tls;          // both gRPC ports; empty cert_file = plaintext
  AuthConfig auth;       // tenant tokens (data plane) and the admin token
  std::string metrics_listen;  // host:port of /metrics; "" = no metrics endpoint
  // The tenant label of the metrics: tenants named in the configuration keep their own value,
  // at most metrics_max_tenants others get theirs, the rest share tenant="_other".
  std::set<std::string> metrics_tenants;
  int32_t metrics_max_tenants = 100;
  // The labels of kvsidecar_build_info (version, revision, build_type, backend); empty = no
  // such series. The process_* series are always on the metrics endpoint.
  MetricLabels build_info;
  // Unix socket that hands memfd arenas to their workers (service/arena_fd_server.h); "" = none
  // (then an Attach whose arena is a memfd fails: only named or device arenas can be served).
  std::string arena_socket;
  absl::Duration arena_nonce_ttl = absl::Seconds(30);
};

class SidecarServer {
 public:
  // Binds, starts serving and starts the reaper. UNAVAILABLE if an address cannot be bound.
  static absl::StatusOr<std::unique_ptr<SidecarServer>> Start(KvPool* pool,
                                                              const ServerOptions& options);
  ~SidecarServer();
  SidecarServer(const SidecarServer&) = delete;
  SidecarServer& operator=(const SidecarServer&) = delete;

  // host:port with the port actually bound.
  const std::string& data_address() const { return data_address_; }
  const std::string& admin_address() const { return admin_address_; }
  int data_port() const { return data_port_; }
  int admin_port() const { return admin_port_; }
  // The single machine-readable start line:
  //   kvsidecar listening data=127.0.0.1:PORT admin=127.0.0.1:PORT
  //   ... metrics=127.0.0.1:PORT   (when the metrics endpoint is on)
  std::string ListeningLine() const;
  const std::string& metrics_address() const { return metrics_address_; }  // "" = off

  SidecarService* sidecar() { return sidecar_.get(); }
  MetricsRegistry* metrics() { return &metrics_; }

  // Graceful stop: watch streams end with OK, in-flight calls get until `grace` to finish and
  // are cancelled after. Idempotent.
  void Shutdown(absl::Duration grace = absl::Seconds(2));

 private:
  explicit SidecarServer(KvPool* pool) : pool_(pool) {}
  void ReaperLoop(absl::Duration interval);

  // Scrape-time families from the pool (bytes per tier, sessions, per-tenant usage, tokens per
  // policy, backend health).
  void CollectPoolMetrics(std::vector<prometheus::MetricFamily>* out);
  // The compute seam's counters: backend calls and jobs by method, device synchronisations,
  // transfers, arena host copies and kernel launches.
  static void CollectDeviceMetrics(std::vector<prometheus::MetricFamily>* out);

  KvPool* const pool_;
  MetricsRegistry metrics_;
  std::unique_ptr<TenantLabeler> tenant_labeler_;
  std::unique_ptr<Authenticator> auth_;
  std::unique_ptr<MetricsHttpServer> metrics_server_;
  std::string metrics_address_;
  // Declared before sidecar_, which issues its nonces, so that it outlives it.
  std::unique_ptr<ArenaFdServer> arena_fd_server_;
  uint64_t host_capacity_ = 0;
  uint64_t disk_capacity_ = 0;
  std::unique_ptr<SidecarService> sidecar_;
  std::unique_ptr<AdminService> admin_;
  // Reflection v1 of each gRPC server; declared before the servers so that it outlives them.
  std::vector<std::unique_ptr<ReflectionV1Service>> reflection_;
  std::unique_ptr<grpc::Server> data_server_;
  std::unique_ptr<grpc::Server> admin_server_;  // null when Admin shares the data server
  std::string data_address_;
  std::string admin_address_;
  int data_port_ = 0;
  int admin_port_ = 0;
  bool shut_down_ = false;

  std::thread reaper_;
  StopSignal reaper_stop_;
};

}  // namespace kvs

#endif  // KVSIDECAR_SERVICE_SERVER_H_
