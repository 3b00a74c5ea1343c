#include "service/config.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <system_error>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "gpu/backend_factory.h"
#include "gpu/base/status_macros.h"
#include "service/convert.h"
#include "gpu/base/quantity.h"
#include "storage/redis/redis_client.h"
#include "yaml-cpp/yaml.h"

namespace kvs {
namespace {

std::string YamlQuote(absl::string_view value) {
  std::string out = "\"";
  for (char c : value) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  out += '"';
  return out;
}

}  // namespace

absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text, absl::string_view flag) {
  return ParseQuantityBytes(text, flag);
}

absl::StatusOr<int64_t> ParseInteger(absl::string_view text, absl::string_view flag) {
  int64_t value = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &value)) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " must be an integer, got '", text, "'"));
  }
  return value;
}

absl::Status ValidateListenAddress(absl::string_view address, absl::string_view flag) {
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos || colon == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " must be host:port (e.g. 127.0.0.1:50051), got '", address, "'"));
  }
  const absl::string_view port_text = address.substr(colon + 1);
  int port = -1;
  if (port_text.empty() || port_text.size() > 5 || !absl::SimpleAtoi(port_text, &port) ||
      port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, " must end in a port in [0, 65535] (0 = pick a free one), got '", address, "'"));
  }
  return absl::OkStatus();
}

absl::Status ValidateConfig(const SidecarConfig& config) {
  KVS_RETURN_IF_ERROR(ValidateListenAddress(config.listen, "--listen"));
  KVS_RETURN_IF_ERROR(ValidateListenAddress(config.admin_listen, "--admin_listen"));
  if (config.data_dir.empty()) return absl::InvalidArgumentError("--data_dir must not be empty");
  if (config.shm_dir.empty()) return absl::InvalidArgumentError("--shm_dir must not be empty");
  if (config.arena_nonce_ttl_ms < 100 || config.arena_nonce_ttl_ms > 3600000) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--arena_nonce_ttl_ms must be in [100, 3600000], got ", config.arena_nonce_ttl_ms));
  }
  if (config.arena_capacity_bytes == 0) {
    return absl::InvalidArgumentError("--arena_capacity_bytes must be > 0");
  }
  if (config.default_session_bytes == 0 ||
      config.default_session_bytes > config.arena_capacity_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--default_session_bytes must be in [1, --arena_capacity_bytes = ",
                     config.arena_capacity_bytes, "], got ", config.default_session_bytes));
  }
  const PoolOptions defaults;
  const int64_t min_ms = absl::ToInt64Milliseconds(defaults.min_lease);
  const int64_t max_ms = absl::ToInt64Milliseconds(defaults.max_lease);
  if (config.lease_ms < min_ms || config.lease_ms > max_ms) {
    return absl::InvalidArgumentError(
        absl::StrCat("--lease_ms must be in [", min_ms, ", ", max_ms, "], got ", config.lease_ms));
  }
  KVS_RETURN_IF_ERROR(ChooseBackend(config.backend).status());
  KVS_RETURN_IF_ERROR(DefaultPolicyNamed(config.default_policy, "--default_policy").status());
  if (config.default_budget_tokens < 0 || config.default_budget_tokens > kMaxBudgetTokens) {
    return absl::InvalidArgumentError(absl::StrCat("--default_budget_tokens must be in [0, ",
                                                   kMaxBudgetTokens, "] (0 = unbounded), got ",
                                                   config.default_budget_tokens));
  }
  if (config.threads < 0 || config.threads > 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--threads must be in [0, 1024] (0 = hardware concurrency), got ", config.threads));
  }
  const std::string& level = config.log_level;
  if (level != "debug" && level != "info" && level != "warning" && level != "error") {
    return absl::InvalidArgumentError(
        absl::StrCat("--log_level must be debug, info, warning or error, got '", level, "'"));
  }
  if (!config.metrics_listen.empty()) {
    KVS_RETURN_IF_ERROR(ValidateListenAddress(config.metrics_listen, "--metrics_listen"));
  }
  if (config.metrics_max_tenants < 0 || config.metrics_max_tenants > 100000) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_max_tenants must be in [0, 100000], got ",
                     config.metrics_max_tenants));
  }
  if (!config.remote_tier.empty()) {
    KVS_RETURN_IF_ERROR(
        storage::redis::ParseRedisUrl(config.remote_tier, "--remote_tier (remote_tier.url)")
            .status());
  }
  if (config.remote_tier_ttl_s < 1 || config.remote_tier_ttl_s > 365 * 24 * 3600) {
    return absl::InvalidArgumentError(
        absl::StrCat("--remote_tier_ttl (remote_tier.ttl) must be in [1s, 8760h], got ",
                     config.remote_tier_ttl_s, "s"));
  }
  if (config.remote_tier_chunk_bytes < (uint64_t{64} << 10) ||
      config.remote_tier_chunk_bytes > (uint64_t{256} << 20)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--remote_tier_chunk_bytes (remote_tier.chunk_bytes) must be in [64Ki, 256Mi] (Redis "
        "values above a few MiB stall its event loop), got ",
        config.remote_tier_chunk_bytes));
  }
  if (config.remote_tier.empty() &&
      (!config.remote_tier_user.empty() || !config.remote_tier_password_file.empty())) {
    return absl::InvalidArgumentError(
        "--remote_tier_user / --remote_tier_password_file need --remote_tier=redis://host:port");
  }
  if (config.tls_cert_file.empty() != config.tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        "tls.cert_file (--tls_cert_file) and tls.key_file (--tls_key_file) must be set together");
  }
  if (!config.tls_client_ca_file.empty() && config.tls_cert_file.empty()) {
    return absl::InvalidArgumentError(
        "tls.client_ca_file (--tls_client_ca_file) needs tls.cert_file and tls.key_file: mutual "
        "TLS is TLS with client certificates");
  }
  if (config.drain_to != "disk" && config.drain_to != "remote" && config.drain_to != "none") {
    return absl::InvalidArgumentError(absl::StrCat(
        "drain.to (--drain_to) must be disk, remote or none, got \"", config.drain_to, "\""));
  }
  if (config.drain_grace_ms < 0 || config.drain_grace_ms > 3600000) {
    return absl::InvalidArgumentError(
        absl::StrCat("drain.grace (--drain_grace) must be in [0s, 1h], got ",
                     absl::FormatDuration(absl::Milliseconds(config.drain_grace_ms))));
  }
  for (const auto& [tenant, quota] : config.quotas) {
    if (tenant.empty() || tenant.size() > 256) {
      return absl::InvalidArgumentError("quotas: a tenant name must have 1 to 256 bytes");
    }
    if (quota.sequences < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "quotas.", tenant, ".sequences must be >= 0 (0 = unlimited), got ", quota.sequences));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<BackendChoice> ChooseBackend(absl::string_view flag_value) {
  if (flag_value == "cpu") return BackendChoice{"cpu", "--backend=cpu"};
  if (flag_value == "device-sim") {
    return BackendChoice{"device-sim",
                         "--backend=device-sim: the CPU kernels behind a simulated device address "
                         "space, to test the device data path without a GPU"};
  }
  if (flag_value == "auto") {
    if (!CudaBuilt()) {
      return BackendChoice{"cpu", "--backend=auto: this build has no CUDA backend, using cpu"};
    }
    const CudaProbe& probe = ProbeCuda();
    if (probe.devices == 0) {
      return BackendChoice{"cpu", absl::StrCat("--backend=auto: built with CUDA but no CUDA "
                                               "device is usable (",
                                               probe.detail, "), using cpu")};
    }
    return BackendChoice{"cuda", absl::StrCat("--backend=auto: CUDA device ", probe.detail)};
  }
  if (flag_value == "cuda") {
    if (!CudaBuilt()) {
      return absl::FailedPreconditionError(
          "--backend=cuda: this build has no CUDA backend (use --backend=cpu or auto)");
    }
    const CudaProbe& probe = ProbeCuda();
    if (probe.devices == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("--backend=cuda: no CUDA device is usable on this host (", probe.detail,
                       "); use --backend=cpu or auto"));
    }
    return BackendChoice{"cuda", absl::StrCat("--backend=cuda: CUDA device ", probe.detail)};
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--backend must be cpu, auto, cuda or device-sim, got '", flag_value, "'"));
}

absl::StatusOr<PoolOptions> ToPoolOptions(const SidecarConfig& config) {
  KVS_RETURN_IF_ERROR(ValidateConfig(config));
  PoolOptions options;
  options.arena_capacity_bytes = config.arena_capacity_bytes;
  options.default_session_bytes = config.default_session_bytes;
  options.default_lease = absl::Milliseconds(config.lease_ms);
  options.arena_options.shm_directory = config.shm_dir;
  options.arena_options.shm_names = config.arena_shm_names;
  KVS_ASSIGN_OR_RETURN(options.default_policy,
                       DefaultPolicyNamed(config.default_policy, "--default_policy"));
  options.default_budget.tokens_per_layer = config.default_budget_tokens;
  // A decode step runs its sequences on as many threads as the backend has.
  options.decode_threads = config.threads;
  options.spill_on_pressure = config.spill_on_pressure;  // needs the tiers main.cc attaches
  return options;
}

std::string ArenaSocketPath(const SidecarConfig& config) {
  if (!config.arena_socket.empty()) return config.arena_socket;
  return absl::StrCat(absl::StripSuffix(config.data_dir, "/"), "/run/arena.sock");
}

absl::Status PrepareDirectory(const std::string& path, absl::string_view flag, bool create) {
  namespace fs = std::filesystem;
  std::error_code error;
  if (create) {
    fs::create_directories(path, error);
    if (error) {
      return absl::FailedPreconditionError(
          absl::StrCat(flag, "=", path, ": cannot create the directory: ", error.message()));
    }
  }
  if (!fs::is_directory(path, error)) {
    return absl::FailedPreconditionError(
        absl::StrCat(flag, "=", path, ": not a directory", error ? ": " + error.message() : ""));
  }
  // access(W_OK) is not enough (read-only mounts, ACLs): write a probe file.
  const std::string probe = absl::StrCat(path, "/.kvsidecar-probe-", ::getpid());
  {
    std::ofstream file(probe, std::ios::out | std::ios::trunc);
    if (!file || !(file << "probe") || !file.flush()) {
      const int saved = errno;
      return absl::FailedPreconditionError(
          absl::StrCat(flag, "=", path, ": the directory is not writable: ", std::strerror(saved)));
    }
  }
  fs::remove(probe, error);
  return absl::OkStatus();
}

std::string ConfigToYaml(const SidecarConfig& config, const BackendChoice& backend) {
  std::string out;
  absl::StrAppend(&out, "listen: ", YamlQuote(config.listen), "\n");
  absl::StrAppend(&out, "admin_listen: ", YamlQuote(config.admin_listen), "\n");
  absl::StrAppend(&out, "data_dir: ", YamlQuote(config.data_dir), "\n");
  absl::StrAppend(&out, "shm_dir: ", YamlQuote(config.shm_dir), "\n");
  absl::StrAppend(&out, "arena_shm_names: ", config.arena_shm_names ? "true" : "false", "\n");
  absl::StrAppend(&out, "arena_socket: ",
                  YamlQuote(config.arena_shm_names ? "" : ArenaSocketPath(config)), "\n");
  absl::StrAppend(&out, "arena_nonce_ttl_ms: ", config.arena_nonce_ttl_ms, "\n");
  absl::StrAppend(&out, "arena_capacity_bytes: ", config.arena_capacity_bytes, "\n");
  absl::StrAppend(&out, "default_session_bytes: ", config.default_session_bytes, "\n");
  absl::StrAppend(&out, "host_tier_bytes: ", config.host_tier_bytes, "\n");
  absl::StrAppend(&out, "disk_tier_bytes: ", config.disk_tier_bytes, "\n");
  absl::StrAppend(&out, "spill_on_pressure: ", config.spill_on_pressure ? "true" : "false", "\n");
  absl::StrAppend(&out, "lease_ms: ", config.lease_ms, "\n");
  absl::StrAppend(&out, "backend: ", YamlQuote(backend.name), "\n");
  absl::StrAppend(&out, "backend_flag: ", YamlQuote(config.backend), "\n");
  absl::StrAppend(&out, "backend_reason: ", YamlQuote(backend.reason), "\n");
  absl::StrAppend(&out, "default_policy: ", YamlQuote(config.default_policy), "\n");
  absl::StrAppend(&out, "default_budget_tokens: ", config.default_budget_tokens, "\n");
  absl::StrAppend(&out, "threads: ", config.threads, "\n");
  absl::StrAppend(&out, "log_level: ", YamlQuote(config.log_level), "\n");
  absl::StrAppend(&out, "metrics_listen: ", YamlQuote(config.metrics_listen), "\n");
  absl::StrAppend(&out, "metrics_max_tenants: ", config.metrics_max_tenants, "\n");
  absl::StrAppend(&out, "tls:\n  cert_file: ", YamlQuote(config.tls_cert_file), "\n");
  absl::StrAppend(&out, "  key_file: ", YamlQuote(config.tls_key_file), "\n");
  absl::StrAppend(&out, "  client_ca_file: ", YamlQuote(config.tls_client_ca_file), "\n");
  absl::StrAppend(&out, "auth:\n  admin_token_file: ", YamlQuote(config.admin_token_file), "\n");
  absl::StrAppend(&out, "  tenant_tokens_file: ", YamlQuote(config.tenant_tokens_file), "\n");
  absl::StrAppend(&out, "remote_tier:\n  url: ", YamlQuote(config.remote_tier), "\n");
  absl::StrAppend(&out, "  user: ", YamlQuote(config.remote_tier_user), "\n");
  absl::StrAppend(&out, "  password_file: ", YamlQuote(config.remote_tier_password_file), "\n");
  absl::StrAppend(&out, "  ttl: ", YamlQuote(absl::StrCat(config.remote_tier_ttl_s, "s")), "\n");
  absl::StrAppend(&out, "  chunk_bytes: ", config.remote_tier_chunk_bytes, "\n");
  absl::StrAppend(&out, "drain:\n  to: ", YamlQuote(config.drain_to), "\n");
  absl::StrAppend(&out, "  grace: ", YamlQuote(absl::FormatDuration(absl::Milliseconds(config.drain_grace_ms))), "\n");
  absl::StrAppend(&out, "quotas:", config.quotas.empty() ? " {}" : "", "\n");
  for (const auto& [tenant, quota] : config.quotas) {
    absl::StrAppend(&out, "  ", YamlQuote(tenant), ": {arena_bytes: ", quota.arena_bytes,
                    ", host_bytes: ", quota.host_bytes, ", disk_bytes: ", quota.disk_bytes,
                    // Only when set: the line stays as it was for configurations without it.
                    quota.remote_bytes != 0 ? absl::StrCat(", remote_bytes: ", quota.remote_bytes)
                                            : std::string(),
                    ", sequences: ", quota.sequences, "}\n");
  }
  absl::StrAppend(&out, "config_file: ", YamlQuote(config.config_file), "\n");
  return out;
}

// ---- Configuration sources: keys, YAML file, flags. ----

const std::vector<ConfigKey>& ConfigKeys() {
  static const std::vector<ConfigKey>* keys = new std::vector<ConfigKey>{
      {"listen", "listen"},
      {"admin_listen", "admin_listen"},
      {"metrics_listen", "metrics_listen"},
      {"metrics_max_tenants", "metrics_max_tenants"},
      {"data_dir", "data_dir"},
      {"shm_dir", "shm_dir"},
      {"arena_socket", "arena_socket"},
      {"arena_shm_names", "arena_shm_names"},
      {"arena_nonce_ttl_ms", "arena_nonce_ttl_ms"},
      {"arena_capacity_bytes", "arena_capacity_bytes"},
      {"default_session_bytes", "default_session_bytes"},
      {"host_tier_bytes", "host_tier_bytes"},
      {"disk_tier_bytes", "disk_tier_bytes"},
      {"spill_on_pressure", "spill_on_pressure"},
      {"lease_ms", "lease_ms"},
      {"backend", "backend"},
      {"default_policy", "default_policy"},
      {"default_budget_tokens", "default_budget_tokens"},
      {"threads", "threads"},
      {"log_level", "log_level"},
      {"tls.cert_file", "tls_cert_file"},
      {"tls.key_file", "tls_key_file"},
      {"tls.client_ca_file", "tls_client_ca_file"},
      {"auth.admin_token_file", "admin_token_file"},
      {"auth.tenant_tokens_file", "tenant_tokens_file"},
      {"remote_tier.url", "remote_tier"},
      {"remote_tier.user", "remote_tier_user"},
      {"remote_tier.password_file", "remote_tier_password_file"},
      {"remote_tier.ttl", "remote_tier_ttl"},
      {"remote_tier.chunk_bytes", "remote_tier_chunk_bytes"},
      {"drain.to", "drain_to"},
      {"drain.grace", "drain_grace"},
  };
  return *keys;
}

namespace {

// Out-of-range values are clamped to one ValidateConfig refuses with its message.
absl::Status SetInt32(int32_t* out, absl::string_view value, absl::string_view name) {
  KVS_ASSIGN_OR_RETURN(int64_t parsed, ParseInteger(value, name));
  *out = static_cast<int32_t>(std::clamp<int64_t>(parsed, -1, INT32_MAX));
  return absl::OkStatus();
}

}  // namespace

absl::Status SetConfigValue(SidecarConfig* config, absl::string_view key, absl::string_view value,
                            absl::string_view name) {
  const ConfigKey* found = nullptr;
  for (const ConfigKey& k : ConfigKeys()) {
    if (key == k.yaml || key == k.flag) found = &k;
  }
  if (found == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": unknown key"));
  }
  const absl::string_view flag = found->flag;
  const std::string text(value);
  if (flag == "listen") {
    config->listen = text;
  } else if (flag == "admin_listen") {
    config->admin_listen = text;
  } else if (flag == "metrics_listen") {
    config->metrics_listen = text == "off" ? "" : text;
  } else if (flag == "data_dir") {
    config->data_dir = text;
  } else if (flag == "shm_dir") {
    config->shm_dir = text;
  } else if (flag == "arena_socket") {
    config->arena_socket = text;
  } else if (flag == "arena_shm_names") {
    if (text == "true") {
      config->arena_shm_names = true;
    } else if (text == "false") {
      config->arena_shm_names = false;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": must be true or false, got \"", text, "\""));
    }
  } else if (flag == "arena_nonce_ttl_ms") {
    KVS_ASSIGN_OR_RETURN(config->arena_nonce_ttl_ms, ParseInteger(value, name));
  } else if (flag == "arena_capacity_bytes") {
    KVS_ASSIGN_OR_RETURN(config->arena_capacity_bytes, ParseByteSize(value, name));
  } else if (flag == "default_session_bytes") {
    KVS_ASSIGN_OR_RETURN(config->default_session_bytes, ParseByteSize(value, name));
  } else if (flag == "host_tier_bytes") {
    KVS_ASSIGN_OR_RETURN(config->host_tier_bytes, ParseByteSize(value, name));
  } else if (flag == "disk_tier_bytes") {
    KVS_ASSIGN_OR_RETURN(config->disk_tier_bytes, ParseByteSize(value, name));
  } else if (flag == "spill_on_pressure") {
    if (text == "true") {
      config->spill_on_pressure = true;
    } else if (text == "false") {
      config->spill_on_pressure = false;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": must be true or false, got \"", text, "\""));
    }
  } else if (flag == "lease_ms") {
    KVS_ASSIGN_OR_RETURN(config->lease_ms, ParseInteger(value, name));
  } else if (flag == "backend") {
    config->backend = text;
  } else if (flag == "default_policy") {
    config->default_policy = text;
  } else if (flag == "default_budget_tokens") {
    KVS_RETURN_IF_ERROR(SetInt32(&config->default_budget_tokens, value, name));
  } else if (flag == "metrics_max_tenants") {
    KVS_RETURN_IF_ERROR(SetInt32(&config->metrics_max_tenants, value, name));
  } else if (flag == "threads") {
    KVS_RETURN_IF_ERROR(SetInt32(&config->threads, value, name));
  } else if (flag == "log_level") {
    config->log_level = text;
  } else if (flag == "tls_cert_file") {
    config->tls_cert_file = text;
  } else if (flag == "tls_key_file") {
    config->tls_key_file = text;
  } else if (flag == "tls_client_ca_file") {
    config->tls_client_ca_file = text;
  } else if (flag == "admin_token_file") {
    config->admin_token_file = text;
  } else if (flag == "tenant_tokens_file") {
    config->tenant_tokens_file = text;
  } else if (flag == "remote_tier") {
    config->remote_tier = text;
  } else if (flag == "remote_tier_user") {
    config->remote_tier_user = text;
  } else if (flag == "remote_tier_password_file") {
    config->remote_tier_password_file = text;
  } else if (flag == "remote_tier_ttl") {
    // A duration ("168h", "30m", "90s") or plain seconds.
    absl::Duration ttl;
    int64_t seconds = 0;
    if (absl::SimpleAtoi(text, &seconds)) {
      config->remote_tier_ttl_s = seconds;
    } else if (absl::ParseDuration(text, &ttl)) {
      config->remote_tier_ttl_s = absl::ToInt64Seconds(ttl);
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": must be a duration such as 168h, 30m or 90s (or seconds), got \"",
          text.substr(0, 100), "\""));
    }
  } else if (flag == "remote_tier_chunk_bytes") {
    KVS_ASSIGN_OR_RETURN(config->remote_tier_chunk_bytes, ParseByteSize(value, name));
  } else if (flag == "drain_to") {
    config->drain_to = text;
  } else if (flag == "drain_grace") {
    // A duration ("30s", "1m30s", "500ms") or a plain number of seconds.
    absl::Duration grace;
    int64_t seconds = 0;
    if (absl::SimpleAtoi(text, &seconds)) {
      grace = absl::Seconds(seconds);
    } else if (!absl::ParseDuration(text, &grace)) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": must be a duration such as 30s, 1m30s or 500ms (or seconds), got \"", text,
          "\""));
    }
    config->drain_grace_ms =
        std::clamp<int64_t>(absl::ToInt64Milliseconds(grace), -1, int64_t{1} << 40);
  }
  return absl::OkStatus();
}

namespace {

absl::Status ApplyQuotas(const YAML::Node& node, absl::string_view source, SidecarConfig* config) {
  if (node.IsNull()) return absl::OkStatus();
  if (!node.IsMap()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source,
                     ": quotas: must be a map tenant -> {arena_bytes, host_bytes, "
                     "disk_bytes, remote_bytes, sequences}"));
  }
  for (const auto& entry : node) {
    const std::string tenant = entry.first.as<std::string>();
    const std::string prefix = absl::StrCat(source, ": quotas.", tenant);
    if (!entry.second.IsMap()) {
      return absl::InvalidArgumentError(absl::StrCat(prefix, ": must be a map"));
    }
    TenantQuota quota;
    for (const auto& field : entry.second) {
      const std::string name = field.first.as<std::string>();
      const std::string where = absl::StrCat(prefix, ".", name);
      if (!field.second.IsScalar()) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": must be a scalar"));
      }
      const std::string value = field.second.Scalar();
      if (name == "arena_bytes") {
        KVS_ASSIGN_OR_RETURN(quota.arena_bytes, ParseByteSize(value, where));
      } else if (name == "host_bytes") {
        KVS_ASSIGN_OR_RETURN(quota.host_bytes, ParseByteSize(value, where));
      } else if (name == "disk_bytes") {
        KVS_ASSIGN_OR_RETURN(quota.disk_bytes, ParseByteSize(value, where));
      } else if (name == "sequences") {
        KVS_RETURN_IF_ERROR(SetInt32(&quota.sequences, value, where));
      } else if (name == "remote_bytes") {
        KVS_ASSIGN_OR_RETURN(quota.remote_bytes, ParseByteSize(value, where));
      } else {
        return absl::InvalidArgumentError(absl::StrCat(
            where,
            ": unknown key (use arena_bytes, host_bytes, disk_bytes, remote_bytes, sequences)"));
      }
    }
    config->quotas[tenant] = quota;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ApplyConfigYaml(absl::string_view yaml, absl::string_view source,
                             SidecarConfig* config) {
  YAML::Node root;
  try {
    root = YAML::Load(std::string(yaml));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": YAML syntax error: ", e.what()));
  }
  if (root.IsNull()) return absl::OkStatus();  // an empty file changes nothing
  if (!root.IsMap()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": the document must be a map of keys"));
  }
  try {
    for (const auto& entry : root) {
      const std::string key = entry.first.as<std::string>();
      const YAML::Node& value = entry.second;
      if (key == "quotas") {
        KVS_RETURN_IF_ERROR(ApplyQuotas(value, source, config));
        continue;
      }
      if (key == "tls" || key == "auth" || key == "remote_tier" || key == "drain") {
        if (value.IsNull()) continue;
        if (!value.IsMap()) {
          return absl::InvalidArgumentError(absl::StrCat(source, ": ", key, ": must be a map"));
        }
        for (const auto& sub : value) {
          const std::string path = absl::StrCat(key, ".", sub.first.as<std::string>());
          bool known = false;
          for (const ConfigKey& k : ConfigKeys()) known |= path == k.yaml;
          if (!known) {
            return absl::InvalidArgumentError(absl::StrCat(source, ": ", path, ": unknown key"));
          }
          if (!sub.second.IsScalar() && !sub.second.IsNull()) {
            return absl::InvalidArgumentError(
                absl::StrCat(source, ": ", path, ": must be a scalar"));
          }
          const std::string text = sub.second.IsNull() ? "" : sub.second.Scalar();
          KVS_RETURN_IF_ERROR(SetConfigValue(config, path, text, absl::StrCat(source, ": ", path)));
        }
        continue;
      }
      bool known = false;
      for (const ConfigKey& k : ConfigKeys()) known |= key == k.yaml;
      if (!known) {
        return absl::InvalidArgumentError(absl::StrCat(
            source, ": ", key, ": unknown key (see deploy/kvsidecar.example.yaml for the keys)"));
      }
      if (!value.IsScalar() && !value.IsNull()) {
        return absl::InvalidArgumentError(absl::StrCat(source, ": ", key, ": must be a scalar"));
      }
      const std::string text = value.IsNull() ? "" : value.Scalar();
      KVS_RETURN_IF_ERROR(SetConfigValue(config, key, text, absl::StrCat(source, ": ", key)));
    }
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", e.what()));
  }
  return absl::OkStatus();
}

absl::Status LoadConfigFile(const std::string& path, SidecarConfig* config) {
  std::ifstream file(path);
  if (!file) {
    return absl::FailedPreconditionError(
        absl::StrCat("--config=", path, ": cannot read the file: ", std::strerror(errno)));
  }
  std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  KVS_RETURN_IF_ERROR(ApplyConfigYaml(text, path, config));
  config->config_file = path;
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadSecretFile(const std::string& path, absl::string_view key) {
  std::ifstream file(path);
  if (!file) {
    return absl::FailedPreconditionError(
        absl::StrCat(key, "=", path, ": cannot read the file: ", std::strerror(errno)));
  }
  std::string line;
  std::getline(file, line);
  const std::string secret(absl::StripAsciiWhitespace(line));
  if (secret.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat(key, "=", path, ": the first line (the secret) is empty"));
  }
  return secret;
}

absl::StatusOr<std::map<std::string, std::string>> ReadTenantTokens(const std::string& path) {
  constexpr absl::string_view kKey = "auth.tenant_tokens_file";
  std::ifstream file(path);
  if (!file) {
    return absl::FailedPreconditionError(
        absl::StrCat(kKey, "=", path, ": cannot read the file: ", std::strerror(errno)));
  }
  std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  std::map<std::string, std::string> tokens;
  try {
    const YAML::Node root = YAML::Load(text);
    if (!root.IsMap() || root.size() == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(kKey, "=", path, ": must be a non-empty YAML map tenant: token"));
    }
    std::map<std::string, std::string> seen;  // token -> tenant
    for (const auto& entry : root) {
      const std::string tenant = entry.first.as<std::string>();
      if (!entry.second.IsScalar() || entry.second.Scalar().empty() || tenant.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(kKey, "=", path, ": tenant '", tenant, "' must map to a non-empty token"));
      }
      const std::string token = entry.second.Scalar();
      if (!seen.emplace(token, tenant).second) {
        return absl::InvalidArgumentError(absl::StrCat(kKey, "=", path, ": tenants '", seen[token],
                                                       "' and '", tenant,
                                                       "' share a token; tokens must be distinct"));
      }
      tokens[tenant] = token;
    }
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(kKey, "=", path, ": ", e.what()));
  }
  return tokens;
}

}  // namespace kvs
