// SidecarConfig: the sidecar's configuration as plain values, its sources (one YAML file, then
// command-line flags given explicitly, which win), its validation (messages name the key or
// flag: "--lease_ms must be ...", "kvsidecar.yaml: tls.cert_file: ..."), and what is derived
// from it: the pool options, the backend choice and the effective-config text Admin.GetConfig
// shows. main.cc fills it; tests build it directly. Value type, pure functions, except
// PrepareDirectory / LoadConfigFile / ReadSecretFile which touch the file system.
#ifndef KVSIDECAR_SERVICE_CONFIG_H_
#define KVSIDECAR_SERVICE_CONFIG_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cache/pool.h"

namespace kvs {

struct SidecarConfig {
  std::string listen = "127.0.0.1:50051";
  std::string admin_listen = "127.0.0.1:50052";  // equal to listen: one server for both
  std::string data_dir = "./kvsidecar-data";
  std::string shm_dir = "/dev/shm";  // arena_shm_names only
  // Arena isolation. By default each session's CPU arena is an anonymous memfd that only the
  // worker that attached receives, over the Unix socket arena_socket ("" = <data_dir>/run/
  // arena.sock), with a single-use nonce valid for arena_nonce_ttl_ms. arena_shm_names = true is
  // the legacy mode: named files in shm_dir that any process of the sidecar's uid can open.
  std::string arena_socket;
  bool arena_shm_names = false;
  int64_t arena_nonce_ttl_ms = 30000;
  uint64_t arena_capacity_bytes = uint64_t{1} << 30;
  uint64_t default_session_bytes = uint64_t{256} << 20;
  // Storage tiers (issue 4): host memory for spilled sequences; the RocksDB tier in
  // <data_dir>/rocksdb, 0 = unlimited.
  uint64_t host_tier_bytes = uint64_t{1} << 30;
  uint64_t disk_tier_bytes = 0;
  // A Reserve that finds its session's arena full spills the session's least recently used other
  // sequences to the host tier until it fits (PoolOptions::spill_on_pressure); they come back on
  // their next use.
  bool spill_on_pressure = false;
  int64_t lease_ms = 10000;
  std::string backend = "auto";            // cpu | auto | cuda | device-sim
  std::string default_policy = "keydiff";  // streaming_llm | keydiff
  int32_t default_budget_tokens = 0;       // 0 = unbounded
  int32_t threads = 0;             // backend and DecodeStep threads, 0 = hardware concurrency
  std::string log_level = "info";  // debug | info | warning | error
  // Added with the operations issue.
  std::string metrics_listen;      // host:port of the Prometheus /metrics endpoint; "" = off
  // Tenants not named in the configuration (quotas, tenant tokens) that get a tenant label of
  // their own in the metrics; the others beyond it share tenant="_other".
  int32_t metrics_max_tenants = 100;
  std::string tls_cert_file;       // PEM server certificate chain; "" = plaintext
  std::string tls_key_file;        // PEM private key of tls_cert_file
  std::string tls_client_ca_file;  // PEM CA bundle; set = mutual TLS (client certificate required)
  std::string admin_token_file;  // file holding the admin bearer token; "" = Admin unauthenticated
  // YAML map tenant -> bearer token for the data plane; "" = data plane unauthenticated.
  std::string tenant_tokens_file;
  // The remote tier on Redis (storage/redis/remote_tier.h): "redis://host:port[,host:port...]"
  // seed nodes (a single Redis or Redis Cluster), "" = none. The password lives in a file; only
  // its path is configuration (and shown by Admin.GetConfig).
  std::string remote_tier;
  std::string remote_tier_user;           // ACL user; "" = AUTH with the password only
  std::string remote_tier_password_file;  // first line: the password; "" = no AUTH
  int64_t remote_tier_ttl_s = 7 * 24 * 3600;  // expiry of copies no one restores
  uint64_t remote_tier_chunk_bytes = uint64_t{8} << 20;  // the largest value written to Redis
  // Added with the shared-tier issue. On SIGTERM/SIGINT: move every live sequence to drain_to
  // ("disk", "remote" or "none" = exit without moving) within drain_grace_ms, report what moved,
  // then exit (service/drain.h). Admin.Drain without a grace uses drain_grace_ms too.
  std::string drain_to = "none";
  int64_t drain_grace_ms = 25000;
  std::map<std::string, TenantQuota> quotas;  // initial tenant quotas (Admin.SetQuota changes them)
  std::string config_file;  // where the YAML came from ("" = flags only), for the log
};

// One scalar setting: its YAML path ("tls.cert_file") and flag name ("tls_cert_file").
struct ConfigKey {
  const char* yaml;
  const char* flag;
};
// Every scalar setting, in the order the effective config lists them.
const std::vector<ConfigKey>& ConfigKeys();
// Parses `value` for the setting whose YAML path or flag name is `key` into `config`. `name`
// (e.g. "--lease_ms" or "kvsidecar.yaml: lease_ms") starts every error message.
absl::Status SetConfigValue(SidecarConfig* config, absl::string_view key, absl::string_view value,
                            absl::string_view name);
// Applies a YAML document (a map of the keys above, plus `quotas: {tenant: {arena_bytes,
// host_bytes, disk_bytes, sequences}}`) to `config`. Errors: INVALID_ARGUMENT "<source>: <key>:
// <reason>" for an unknown key, a non-scalar value or a bad value; "<source>: YAML syntax error
// ..." otherwise.
absl::Status ApplyConfigYaml(absl::string_view yaml, absl::string_view source,
                             SidecarConfig* config);
// Reads `path` and applies it (FAILED_PRECONDITION naming the file if it cannot be read).
absl::Status LoadConfigFile(const std::string& path, SidecarConfig* config);
// The first line of a secret file, whitespace stripped; non-empty. `key` names it in errors.
absl::StatusOr<std::string> ReadSecretFile(const std::string& path, absl::string_view key);
// tenant_tokens_file: a YAML map tenant -> token (distinct, non-empty tokens).
absl::StatusOr<std::map<std::string, std::string>> ReadTenantTokens(const std::string& path);

// The arena socket the sidecar serves: arena_socket, or <data_dir>/run/arena.sock when empty.
std::string ArenaSocketPath(const SidecarConfig& config);

struct BackendChoice {
  std::string name;    // "cpu"
  std::string reason;  // why, for logs and Admin.GetConfig
};

// Flag text parsers (main.cc takes numbers as strings so that a bad value gets a message naming
// the flag and exit code 2). Byte sizes are Kubernetes quantities (gpu/base/quantity.h): Ki, Mi,
// Gi, ... = powers of 1024, k, M, G, ... = powers of 1000, plain numbers = bytes.
absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text, absl::string_view flag);
absl::StatusOr<int64_t> ParseInteger(absl::string_view text, absl::string_view flag);

// "host:port" with a non-empty host and a port in [0, 65535]; `flag` names it in errors.
absl::Status ValidateListenAddress(absl::string_view address, absl::string_view flag);
// Every value range; INVALID_ARGUMENT naming the flag. Does not touch the file system.
absl::Status ValidateConfig(const SidecarConfig& config);
// cpu -> cpu; device-sim -> device-sim (tests the device data path on the CPU); auto -> cuda when
// this build has the CUDA backend and a device is usable, else cpu with the reason; cuda ->
// FAILED_PRECONDITION without CUDA in the build or a usable device; anything else
// INVALID_ARGUMENT. Probes the CUDA devices once per process (gpu/backend_factory.h).
absl::StatusOr<BackendChoice> ChooseBackend(absl::string_view flag_value);
// Pool options for a validated config.
absl::StatusOr<PoolOptions> ToPoolOptions(const SidecarConfig& config);
// Creates `path` (and parents) if missing and checks that it is a writable directory by
// creating and removing a probe file. `flag` names it in errors.
absl::Status PrepareDirectory(const std::string& path, absl::string_view flag, bool create);
// YAML text of the configuration in force. Secrets live in files and only the paths appear.
std::string ConfigToYaml(const SidecarConfig& config, const BackendChoice& backend);

}  // namespace kvs

#endif  // KVSIDECAR_SERVICE_CONFIG_H_
