// SidecarConfig: the sidecar's command-line configuration as plain values, its validation
// (messages name the flag: "--lease_ms must be ..."), and what is derived from it: the pool
// options, the backend choice and the effective-config text Admin.GetConfig shows.
// main.cc fills it from absl flags; tests build it directly. Value type, pure functions, except
// PrepareDirectory which touches the file system.
#ifndef KVSIDECAR_SERVICE_CONFIG_H_
#define KVSIDECAR_SERVICE_CONFIG_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cache/pool.h"

namespace kvs {

struct SidecarConfig {
  std::string listen = "127.0.0.1:50051";
  std::string admin_listen = "127.0.0.1:50052";  // equal to listen: one server for both
  std::string data_dir = "./kvsidecar-data";
  std::string shm_dir = "/dev/shm";
  uint64_t arena_capacity_bytes = uint64_t{1} << 30;
  uint64_t default_session_bytes = uint64_t{256} << 20;
  int64_t lease_ms = 10000;
  std::string backend = "auto";            // cpu | auto | cuda
  std::string default_policy = "keydiff";  // streaming_llm | keydiff
  int32_t default_budget_tokens = 0;       // 0 = unbounded
  int32_t threads = 0;             // backend and DecodeStep threads, 0 = hardware concurrency
  std::string log_level = "info";  // debug | info | warning | error
};

struct BackendChoice {
  std::string name;    // "cpu"
  std::string reason;  // why, for logs and Admin.GetConfig
};

// Flag text parsers (main.cc takes numbers as strings so that a bad value gets a message naming
// the flag and exit code 2). Byte sizes: plain bytes, or K/M/G/T (also Ki/KiB, Mi/MiB, ...) =
// powers of 1024, KB/MB/GB/TB = powers of 1000; overflow is an error.
absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text, absl::string_view flag);
absl::StatusOr<int64_t> ParseInteger(absl::string_view text, absl::string_view flag);

// "host:port" with a non-empty host and a port in [0, 65535]; `flag` names it in errors.
absl::Status ValidateListenAddress(absl::string_view address, absl::string_view flag);
// Every value range; INVALID_ARGUMENT naming the flag. Does not touch the file system.
absl::Status ValidateConfig(const SidecarConfig& config);
// cpu -> cpu; auto -> cpu with the reason; cuda -> FAILED_PRECONDITION (no CUDA backend in
// this build); anything else INVALID_ARGUMENT.
absl::StatusOr<BackendChoice> ChooseBackend(absl::string_view flag_value);
// Pool options for a validated config.
absl::StatusOr<PoolOptions> ToPoolOptions(const SidecarConfig& config);
// Creates `path` (and parents) if missing and checks that it is a writable directory by
// creating and removing a probe file. `flag` names it in errors.
absl::Status PrepareDirectory(const std::string& path, absl::string_view flag, bool create);
// YAML text of the configuration in force (no secrets exist yet to redact).
std::string ConfigToYaml(const SidecarConfig& config, const BackendChoice& backend);

}  // namespace kvs

#endif  // KVSIDECAR_SERVICE_CONFIG_H_
