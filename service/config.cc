#include "service/config.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <system_error>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gpu/base/status_macros.h"
#include "service/convert.h"

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
  const absl::string_view trimmed = absl::StripAsciiWhitespace(text);
  size_t digits = 0;
  while (digits < trimmed.size() && absl::ascii_isdigit(trimmed[digits])) ++digits;
  const absl::string_view number = trimmed.substr(0, digits);
  const absl::string_view suffix = trimmed.substr(digits);
  uint64_t value = 0;
  if (number.empty() || !absl::SimpleAtoi(number, &value)) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, " must be a byte size such as 1073741824, 1G or 256MiB, got '", text, "'"));
  }
  static const std::pair<absl::string_view, uint64_t> kSuffixes[] = {
      {"", 1},
      {"K", uint64_t{1} << 10},
      {"Ki", uint64_t{1} << 10},
      {"KiB", uint64_t{1} << 10},
      {"M", uint64_t{1} << 20},
      {"Mi", uint64_t{1} << 20},
      {"MiB", uint64_t{1} << 20},
      {"G", uint64_t{1} << 30},
      {"Gi", uint64_t{1} << 30},
      {"GiB", uint64_t{1} << 30},
      {"T", uint64_t{1} << 40},
      {"Ti", uint64_t{1} << 40},
      {"TiB", uint64_t{1} << 40},
      {"KB", 1000},
      {"MB", 1000 * 1000},
      {"GB", 1000 * 1000 * 1000},
      {"TB", uint64_t{1000} * 1000 * 1000 * 1000},
      {"B", 1}};
  for (const auto& [name, multiplier] : kSuffixes) {
    if (suffix != name) continue;
    uint64_t bytes = 0;
    if (__builtin_mul_overflow(value, multiplier, &bytes)) {
      return absl::InvalidArgumentError(absl::StrCat(flag, " overflows 64 bits: '", text, "'"));
    }
    return bytes;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(flag, " has an unknown size suffix '", suffix,
                   "' (use K, M, G, T, KiB, MiB, GiB or KB, MB, GB)"));
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
  return absl::OkStatus();
}

absl::StatusOr<BackendChoice> ChooseBackend(absl::string_view flag_value) {
  if (flag_value == "cpu") return BackendChoice{"cpu", "--backend=cpu"};
  if (flag_value == "auto") {
    return BackendChoice{"cpu", "--backend=auto: this build has no CUDA backend, using cpu"};
  }
  if (flag_value == "cuda") {
    return absl::FailedPreconditionError(
        "--backend=cuda: this build has no CUDA backend (use --backend=cpu or auto)");
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--backend must be cpu, auto or cuda, got '", flag_value, "'"));
}

absl::StatusOr<PoolOptions> ToPoolOptions(const SidecarConfig& config) {
  KVS_RETURN_IF_ERROR(ValidateConfig(config));
  PoolOptions options;
  options.arena_capacity_bytes = config.arena_capacity_bytes;
  options.default_session_bytes = config.default_session_bytes;
  options.default_lease = absl::Milliseconds(config.lease_ms);
  options.arena_options.shm_directory = config.shm_dir;
  KVS_ASSIGN_OR_RETURN(options.default_policy,
                       DefaultPolicyNamed(config.default_policy, "--default_policy"));
  options.default_budget.tokens_per_layer = config.default_budget_tokens;
  // A decode step runs its sequences on as many threads as the backend has.
  options.decode_threads = config.threads;
  return options;
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
  absl::StrAppend(&out, "arena_capacity_bytes: ", config.arena_capacity_bytes, "\n");
  absl::StrAppend(&out, "default_session_bytes: ", config.default_session_bytes, "\n");
  absl::StrAppend(&out, "lease_ms: ", config.lease_ms, "\n");
  absl::StrAppend(&out, "backend: ", YamlQuote(backend.name), "\n");
  absl::StrAppend(&out, "backend_flag: ", YamlQuote(config.backend), "\n");
  absl::StrAppend(&out, "backend_reason: ", YamlQuote(backend.reason), "\n");
  absl::StrAppend(&out, "default_policy: ", YamlQuote(config.default_policy), "\n");
  absl::StrAppend(&out, "default_budget_tokens: ", config.default_budget_tokens, "\n");
  absl::StrAppend(&out, "threads: ", config.threads, "\n");
  absl::StrAppend(&out, "log_level: ", YamlQuote(config.log_level), "\n");
  return out;
}

}  // namespace kvs
