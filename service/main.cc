// kvsidecar: the sidecar binary. Reads the YAML configuration (--config), lets flags given
// explicitly override it, validates the result (a bad value: a message naming the key or flag,
// exit 2), logs the effective configuration once, prepares the data directory, builds the backend,
// the pool and the servers, prints one machine-readable line with the bound addresses, and serves
// until SIGINT/SIGTERM, then shuts down gracefully and exits 0.
#include <malloc.h>
#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <set>
#include <string>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cache/clock.h"
#include "cache/pool.h"
#include "cache/spill_buffers.h"
#include "gpu/backend.h"
#include "gpu/backend_factory.h"
#include "gpu/cpu/shm_arena.h"
#include "service/config.h"
#include "service/drain.h"
#include "service/log.h"
#include "gpu/base/build_info.h"
#include "service/server.h"
#include "storage/tier_manager.h"

// Numbers are taken as text so that a malformed value gets our message and exit code 2.
ABSL_FLAG(std::string, listen, "127.0.0.1:50051", "Data-plane address host:port (port 0 = any).");
ABSL_FLAG(std::string, admin_listen, "127.0.0.1:50052",
          "Admin address host:port (port 0 = any; equal to --listen = one server for both).");
ABSL_FLAG(std::string, data_dir, "./kvsidecar-data",
          "Directory for the sidecar's files (created if missing).");
ABSL_FLAG(std::string, shm_dir, "/dev/shm",
          "Directory of the named shared-memory arena files (--arena_shm_names only).");
ABSL_FLAG(std::string, arena_socket, "",
          "Unix socket that hands each session's arena (an anonymous memfd) to the worker that "
          "attached it; empty = <data_dir>/run/arena.sock. Created mode 0600; a missing "
          "directory is created 0700. Workers must see it at the same path.");
ABSL_FLAG(std::string, arena_shm_names, "false",
          "true: legacy named arena files in --shm_dir that any process of the sidecar's uid can "
          "open and map (no isolation between tenants in memory).");
ABSL_FLAG(std::string, arena_nonce_ttl_ms, "30000",
          "How long the single-use nonce of an Attach can fetch the arena over --arena_socket.");
ABSL_FLAG(std::string, arena_capacity_bytes, "1Gi",
          "Total bytes of all session arenas, a Kubernetes quantity: 1073741824, 1Gi (2^30), 1G "
          "(10^9), 512Mi, 1.5Gi.");
ABSL_FLAG(std::string, default_session_bytes, "256Mi",
          "Arena bytes of a session that asks for 0 blocks.");
ABSL_FLAG(std::string, host_tier_bytes, "1Gi",
          "Host-memory tier capacity for spilled sequences (Spill to TIER_HOST).");
ABSL_FLAG(std::string, disk_tier_bytes, "0",
          "Disk (RocksDB, <data_dir>/rocksdb) tier capacity for spilled sequences; 0 = unlimited.");
ABSL_FLAG(std::string, remote_tier, "",
          "The remote tier (Spill to TIER_REMOTE): redis://host:port[,host:port...], the seed "
          "nodes of a single Redis or a Redis Cluster shared by sidecars; empty = none. hiredis "
          "has no TLS here: reach Redis over a trusted network or a TLS tunnel (see README).");
ABSL_FLAG(std::string, remote_tier_user, "",
          "Redis ACL user of the remote tier; empty = AUTH with the password only.");
ABSL_FLAG(std::string, remote_tier_password_file, "",
          "File whose first line is the remote tier's Redis password; empty = no AUTH.");
ABSL_FLAG(std::string, remote_tier_ttl, "168h",
          "Remote copies expire this long after their spill (168h, 30m, 90s or seconds).");
ABSL_FLAG(std::string, remote_tier_chunk_bytes, "8Mi",
          "Largest value the remote tier writes to Redis: layers are cut into chunks of this.");
ABSL_FLAG(std::string, spill_on_pressure, "false",
          "true: a Reserve that finds its session's arena full spills the session's least "
          "recently used other sequences to the host tier (restored on their next use).");
ABSL_FLAG(std::string, lease_ms, "10000", "Default session lease in milliseconds.");
ABSL_FLAG(
    std::string, backend, "auto",
    "Compute backend: cpu, auto, cuda or device-sim (auto picks cuda when a CUDA device is usable, "
    "else cpu, and logs why; device-sim tests the device data path on the CPU; see README).");
ABSL_FLAG(std::string, default_policy, "keydiff",
          "Policy of sequences created without one: streaming_llm or keydiff.");
ABSL_FLAG(std::string, default_budget_tokens, "0",
          "Budget (tokens per layer) of sequences created without one; 0 = unbounded.");
ABSL_FLAG(std::string, threads, "0",
          "Backend threads, and threads running the sequences of one DecodeStep side by side; "
          "0 = hardware concurrency.");
ABSL_FLAG(std::string, log_level, "info", "debug, info, warning or error.");
ABSL_FLAG(std::string, config, "",
          "YAML configuration file (see deploy/kvsidecar.example.yaml); flags given explicitly "
          "override its values.");
ABSL_FLAG(std::string, metrics_listen, "",
          "Prometheus /metrics HTTP address host:port (port 0 = any); empty or 'off' = disabled.");
ABSL_FLAG(std::string, metrics_max_tenants, "100",
          "Tenants not named in the configuration (quotas, tenant tokens) that get a tenant label "
          "of their own in the metrics; the rest are summed under tenant=\"_other\".");
ABSL_FLAG(std::string, tls_cert_file, "", "PEM server certificate chain: TLS on both gRPC ports.");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file.");
ABSL_FLAG(std::string, tls_client_ca_file, "",
          "PEM CA bundle: require client certificates signed by it (mutual TLS).");
ABSL_FLAG(std::string, admin_token_file, "",
          "File whose first line is the admin bearer token; empty = Admin unauthenticated.");
ABSL_FLAG(std::string, tenant_tokens_file, "",
          "YAML map tenant: token of data-plane bearer tokens; empty = data plane "
          "unauthenticated.");
ABSL_FLAG(std::string, drain_to, "none",
          "On SIGTERM/SIGINT, move every live sequence to this tier before exiting: disk (the "
          "RocksDB tier under --data_dir, adopted by a restarted sidecar), remote (the shared "
          "remote tier) or none (exit at once; arena and host copies are lost).");
ABSL_FLAG(std::string, drain_grace, "25s",
          "How long the moves of --drain_to (and of Admin.Drain without grace_ms) may take: a "
          "duration (30s, 1m30s, 500ms) or seconds. Keep it below the orchestrator's kill "
          "deadline (Kubernetes terminationGracePeriodSeconds) with room to shut down.");
// How the process is launched, not how it serves: a command-line flag only, not a YAML key.
ABSL_FLAG(std::string, exit_when_stdin_closes, "false",
          "true: shut down as on SIGTERM when standard input reaches end of file. For a parent "
          "that starts the sidecar with a pipe as its stdin (tests, benchmarks, a worker "
          "launching its own): the kernel closes the pipe when the parent dies, however it "
          "dies, so the sidecar never outlives it.");

namespace {

using StatusOrTier = absl::StatusOr<kvs::StorageTier>;
constexpr int kExitBadFlags = 2;

// --help and --helpshort list the flags of this file (Abseil's default looks for a file named
// after the binary and finds none); --version names the release, the git revision it was built
// from and the build type.
void ConfigureUsage() {
  absl::FlagsUsageConfig usage;
  const auto ours = [](absl::string_view file) { return absl::EndsWith(file, "service/main.cc"); };
  usage.contains_help_flags = ours;
  usage.contains_helpshort_flags = ours;
  usage.normalize_filename = [](absl::string_view file) {
    const size_t at = file.rfind("service/");
    return std::string(at == absl::string_view::npos ? file : file.substr(at));
  };
  usage.version_string = [] {
    return absl::StrCat("kvsidecar ", KVS_VERSION, "\ngit revision: ", KVS_GIT_REVISION,
                        "\nbuild type: ", KVS_BUILD_TYPE, "\n");
  };
  absl::SetFlagsUsageConfig(usage);
  absl::SetProgramUsageMessage(
      "owns the KV-cache memory of model workers and keeps sequences inside their budgets.\n\n"
      "Usage: kvsidecar [--config=FILE.yaml] [--flag=value ...]\n\n"
      "Flags given explicitly override the YAML file (deploy/kvsidecar.example.yaml). Byte sizes "
      "are Kubernetes quantities: Ki, Mi, Gi, Ti (powers of 1024), k, M, G, T (powers of 1000), "
      "plain numbers are bytes. --version prints the version, git revision and build type.");
}

int Fail(absl::string_view message, int code) {
  std::fprintf(stderr, "kvsidecar: %.*s\n", static_cast<int>(message.size()), message.data());
  return code;
}

// Reads standard input until end of file (or an error), then sends this process SIGTERM, which
// the main thread's sigwait takes: the shutdown is the one a signal gets. Runs on a thread of its
// own, started after the stop signals are blocked, so the signal is never delivered to it.
void StopWhenStdinCloses() {
  std::thread([] {
    char buffer[256];
    for (;;) {
      const ssize_t n = read(STDIN_FILENO, buffer, sizeof(buffer));
      if (n > 0 || (n < 0 && errno == EINTR)) continue;
      break;
    }
    KVS_LOG(kInfo, "stdin_closed")("action", "shutting down as on SIGTERM");
    kill(getpid(), SIGTERM);
  }).detach();
}

// absl exits with status 1 on an unknown flag; look for one first so that every flag mistake
// exits 2. Returns the first unknown flag name, or "".
// The flags given on the command line (this Abseil keeps IsSpecifiedOnCommandLine private).
// --flagfile contents are not seen: flags set there do not override the YAML file.
std::set<std::string> ExplicitFlags(int argc, char** argv) {
  std::set<std::string> names;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (!absl::ConsumePrefix(&arg, "--") && !absl::ConsumePrefix(&arg, "-")) continue;
    const absl::string_view name = arg.substr(0, arg.find('='));
    if (absl::FindCommandLineFlag(name) == nullptr) continue;
    names.insert(std::string(name));
    if (arg.find('=') == absl::string_view::npos) ++i;  // "--flag value"
  }
  return names;
}

std::string FirstUnknownFlag(int argc, char** argv) {
  static constexpr absl::string_view kBuiltins[] = {
      "help",    "helpfull",        "helpshort", "helppackage", "helpon",     "helpmatch",
      "version", "only_check_args", "flagfile",  "fromenv",     "tryfromenv", "undefok"};
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (!absl::ConsumePrefix(&arg, "--") && !absl::ConsumePrefix(&arg, "-")) continue;
    const absl::string_view name = arg.substr(0, arg.find('='));
    bool builtin = false;
    for (absl::string_view b : kBuiltins) builtin |= name == b;
    if (builtin) continue;
    if (absl::FindCommandLineFlag(name) != nullptr) {
      // Every flag here is a string: "--threads -1" takes the next argument as its value.
      if (arg.find('=') == absl::string_view::npos) ++i;
      continue;
    }
    return std::string(name);
  }
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  // Inline K/V arrives and leaves in 1-4 MiB protobuf buffers. With glibc's defaults each one is a
  // fresh mmap that is faulted in, zeroed and unmapped again per chunk, which halves Append
  // throughput; keep such buffers on the heap and keep up to 256 MiB of freed heap for reuse.
  mallopt(M_MMAP_THRESHOLD, 64 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
  // Everything the sidecar creates (data_dir, the RocksDB files and WAL, which hold tenant,
  // session and sequence ids, the layer files, the arenas) is its own: owner-only whatever the
  // inherited umask says.
  umask(077);
  ConfigureUsage();
  if (std::string unknown = FirstUnknownFlag(argc, argv); !unknown.empty()) {
    return Fail(absl::StrCat("unknown flag --", unknown, " (see --help)"), kExitBadFlags);
  }
  const std::set<std::string> explicit_flags = ExplicitFlags(argc, argv);
  absl::ParseCommandLine(argc, argv);
  bool exit_when_stdin_closes = false;
  if (!absl::SimpleAtob(absl::GetFlag(FLAGS_exit_when_stdin_closes), &exit_when_stdin_closes)) {
    return Fail(absl::StrCat("--exit_when_stdin_closes=\"",
                             absl::GetFlag(FLAGS_exit_when_stdin_closes),
                             "\" is not a boolean (true or false)"),
                kExitBadFlags);
  }

  kvs::SidecarConfig config;
  if (const std::string path = absl::GetFlag(FLAGS_config); !path.empty()) {
    if (absl::Status status = kvs::LoadConfigFile(path, &config); !status.ok()) {
      return Fail(status.message(), kExitBadFlags);
    }
  }
  // A flag given explicitly wins over the file; one left out keeps the file's (or the default)
  // value.
  for (const kvs::ConfigKey& key : kvs::ConfigKeys()) {
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(key.flag);
    if (flag == nullptr || !explicit_flags.contains(key.flag)) continue;
    if (absl::Status status = kvs::SetConfigValue(&config, key.flag, flag->CurrentValue(),
                                                  absl::StrCat("--", key.flag));
        !status.ok()) {
      return Fail(status.message(), kExitBadFlags);
    }
  }
  if (absl::Status status = kvs::ValidateConfig(config); !status.ok()) {
    return Fail(status.message(), kExitBadFlags);
  }
  kvs::AuthConfig auth;
  if (!config.admin_token_file.empty()) {
    auto token = kvs::ReadSecretFile(config.admin_token_file, "auth.admin_token_file");
    if (!token.ok()) return Fail(token.status().message(), kExitBadFlags);
    auth.admin_token = *std::move(token);
  }
  if (!config.tenant_tokens_file.empty()) {
    auto tokens = kvs::ReadTenantTokens(config.tenant_tokens_file);
    if (!tokens.ok()) return Fail(tokens.status().message(), kExitBadFlags);
    auth.tenant_tokens = *std::move(tokens);
  }
  // A tenant holding the admin token would pass Admin with its data-plane token.
  for (const auto& [tenant, token] : auth.tenant_tokens) {
    if (!auth.admin_token.empty() && token == auth.admin_token) {
      return Fail(absl::StrCat("auth: the admin token (auth.admin_token_file=",
                               config.admin_token_file, ") equals the token of tenant \"", tenant,
                               "\" in auth.tenant_tokens_file=", config.tenant_tokens_file,
                               "; the admin token must differ from every tenant token"),
                  kExitBadFlags);
    }
  }
  kvs::LogLevel level = kvs::LogLevel::kInfo;
  kvs::ParseLogLevel(config.log_level, &level);
  kvs::SetLogLevel(level);
  std::string remote_password;
  if (!config.remote_tier_password_file.empty()) {
    auto password =
        kvs::ReadSecretFile(config.remote_tier_password_file, "remote_tier.password_file");
    if (!password.ok()) return Fail(password.status().message(), kExitBadFlags);
    remote_password = *std::move(password);
  }
  for (const std::string& file : {config.admin_token_file, config.tenant_tokens_file,
                                  config.remote_tier_password_file}) {
    struct stat st;
    if (!file.empty() && stat(file.c_str(), &st) == 0 && (st.st_mode & 077) != 0) {
      KVS_LOG(kWarning, "token_file_readable_by_others")
      ("file", file)("mode", absl::StrFormat("%04o", st.st_mode & 07777))(
          "advice", "chmod 600 it: group and other users can read the secrets in it");
    }
  }

  auto backend_choice = kvs::ChooseBackend(config.backend);
  if (!backend_choice.ok()) return Fail(backend_choice.status().message(), kExitBadFlags);
  KVS_LOG(kInfo, "backend")("name", backend_choice->name)("reason", backend_choice->reason);
  const std::string effective_yaml = kvs::ConfigToYaml(config, *backend_choice);
  KVS_LOG(kInfo, "config")
  ("source", config.config_file.empty() ? "flags" : config.config_file)("effective",
                                                                        effective_yaml);
  if (absl::Status status = kvs::PrepareDirectory(config.data_dir, "--data_dir", true);
      !status.ok()) {
    return Fail(status.message(), kExitBadFlags);
  }
  // A data_dir made before (or by someone else's umask) is narrowed too.
  if (chmod(config.data_dir.c_str(), 0700) != 0) {
    KVS_LOG(kWarning, "data_dir_mode")("path", config.data_dir)("error", std::strerror(errno));
  }
  if (config.arena_shm_names) {
    if (absl::Status status = kvs::PrepareDirectory(config.shm_dir, "--shm_dir", false);
        !status.ok()) {
      return Fail(status.message(), kExitBadFlags);
    }
    KVS_LOG(kWarning, "arena_shm_names")
    ("shm_dir", config.shm_dir)(
        "msg",
        "arenas are named files that any process of this uid can open and map: tenants are NOT "
        "isolated in memory; leave --arena_shm_names off to hand each arena to its worker only");
  }
  auto pool_options = kvs::ToPoolOptions(config);
  if (!pool_options.ok()) return Fail(pool_options.status().message(), kExitBadFlags);
  // Storage tiers. A disk tier that cannot be opened does not stop the sidecar: Spill to disk
  // then answers FAILED_PRECONDITION with the reason, everything else keeps serving.
  kvs::storage::TierOptions tier_options;
  tier_options.host_capacity_bytes = config.host_tier_bytes;
  tier_options.disk_path = config.data_dir + "/rocksdb";
  tier_options.disk_capacity_bytes = config.disk_tier_bytes;
  if (!config.remote_tier.empty()) {
    // Validated by ValidateConfig.
    tier_options.remote.client.seeds =
        *kvs::storage::redis::ParseRedisUrl(config.remote_tier, "--remote_tier");
    tier_options.remote.client.user = config.remote_tier_user;
    tier_options.remote.client.password = std::move(remote_password);
    tier_options.remote.ttl = absl::Seconds(config.remote_tier_ttl_s);
    tier_options.remote.chunk_bytes = config.remote_tier_chunk_bytes;
  }
  std::unique_ptr<kvs::storage::TierManager> tiers = kvs::storage::TierManager::Open(tier_options);
  if (tiers->remote() != nullptr) {
    // Never the password: the user and the seeds only.
    KVS_LOG(kInfo, "remote_tier")
    ("seeds", config.remote_tier)("user", config.remote_tier_user)(
        "auth", config.remote_tier_password_file.empty() ? "none" : "password file")(
        "redis", tiers->remote()->Describe())("ttl_s", config.remote_tier_ttl_s);
  }
  if (!tiers->disk_status().ok()) {
    KVS_LOG(kWarning, "disk_tier_unavailable")("reason", tiers->disk_status().message());
  } else {
    KVS_LOG(kInfo, "disk_tier")
    ("path", config.data_dir + "/rocksdb")("spilled_sequences", tiers->List().size())(
        "unfinished_spills_removed", tiers->disk()->orphans_removed());
    if (!tiers->disk()->corruption().empty()) {
      KVS_LOG(kError, "disk_tier_damaged")("reason", tiers->disk()->corruption());
    }
    for (const kvs::SpilledInfo& info : tiers->List()) {
      if (info.lost.empty()) continue;
      KVS_LOG(kError, "disk_copy_lost")
      ("tenant", info.key.tenant)("session", info.key.session_id)(
          "sequence", info.key.sequence_id)("reason", info.lost);
    }
    for (const std::string& file : tiers->disk()->unnamed_lost_files()) {
      KVS_LOG(kError, "disk_copy_lost")
      ("file", file)("reason", "no readable metadata or key file names its copy; kept");
    }
  }
  pool_options->tiers = tiers.get();

  // Block the stop signals before any thread starts, so that every thread inherits the mask
  // and only sigwait below sees them.
  // A shell starts background jobs with SIGINT ignored, and an ignored signal is discarded
  // rather than queued for sigwait: restore the default disposition first.
  std::signal(SIGINT, SIG_DFL);
  std::signal(SIGTERM, SIG_DFL);
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  // cuda and device-sim stage the cache core's host-side job arrays through device memory
  // (gpu/staging_backend.h); the arena itself lives where the backend computes.
  const kvs::BackendKind kind = backend_choice->name == "cuda" ? kvs::BackendKind::kCuda
                                : backend_choice->name == "device-sim"
                                    ? kvs::BackendKind::kDeviceSim
                                    : kvs::BackendKind::kCpu;
  auto made_backend = kvs::MakeBackend(kind, config.threads);
  if (!made_backend.ok()) return Fail(made_backend.status().message(), kExitBadFlags);
  // A memfd arena has no name, but a process of the same uid could still take it from this
  // process: open /proc/<pid>/fd/<n> or /proc/<pid>/map_files/*, read /proc/<pid>/mem, or
  // ptrace it. Not dumpable, those belong to root and ptrace needs CAP_SYS_PTRACE, so only the
  // worker the arena socket hands the descriptor to can map it. (Core dumps are off as a
  // consequence.) Not for CUDA: its arenas are device memory exported by CUDA IPC, whose driver
  // may need to reach this process, and there is no host arena to protect.
  if (kind != kvs::BackendKind::kCuda) {
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0) {
      KVS_LOG(kWarning, "not_dumpable_failed")("error", std::strerror(errno));
    }
  }
  std::unique_ptr<kvs::Backend> backend = *std::move(made_backend);
  // Spill buffers page-locked for the device (the CUDA backend; nothing on the others), so that
  // a spill or restore between the arena and the host tier runs at the bus's speed. The pinner
  // is cleared before the backend goes (this guard is destroyed first).
  kvs::SpillBuffers::Default().SetPinner(
      {[b = backend.get()](void* p, size_t bytes) { return b->PinHostMemory(p, bytes); },
       [b = backend.get()](void* p) { b->UnpinHostMemory(p); }});
  absl::Cleanup forget_pinner = [] { kvs::SpillBuffers::Default().SetPinner({}); };
  kvs::RealClock clock;
  kvs::KvPool pool(backend.get(), &clock, *pool_options);
  pool.SetTierUsageFn([tiers = tiers.get()](std::string_view tenant, bool host) {
    return tiers->TenantBytes(std::string(tenant), host);
  });
  if (tiers->remote() != nullptr) {
    pool.SetRemoteUsageFn([tiers = tiers.get()](std::string_view tenant) {
      return tiers->TenantRemoteBytes(std::string(tenant));
    });
  }
  // Arenas a killed sidecar left in the shared-memory directory hold memory until removed (also
  // after a switch back from --arena_shm_names).
  if (const int removed = kvs::RemoveStaleShmArenas(pool_options->arena_options); removed > 0) {
    KVS_LOG(kWarning, "stale_arenas_removed")
    ("directory", pool_options->arena_options.shm_directory)("files", removed);
  }

  kvs::ServerOptions server_options;
  server_options.listen = config.listen;
  server_options.admin_listen = config.admin_listen;
  server_options.admin_info.effective_config_yaml = effective_yaml;
  server_options.metrics_listen = config.metrics_listen;
  server_options.metrics_max_tenants = config.metrics_max_tenants;
  for (const auto& [tenant, quota] : config.quotas) server_options.metrics_tenants.insert(tenant);
  for (const auto& [tenant, token] : auth.tenant_tokens) {
    server_options.metrics_tenants.insert(tenant);
  }
  if (!config.arena_shm_names) {
    server_options.arena_socket = kvs::ArenaSocketPath(config);
    server_options.arena_nonce_ttl = absl::Milliseconds(config.arena_nonce_ttl_ms);
  }
  server_options.admin_info.drain_grace = absl::Milliseconds(config.drain_grace_ms);
  server_options.admin_info.host_bytes_capacity = config.host_tier_bytes;
  server_options.admin_info.disk_bytes_capacity = config.disk_tier_bytes;
  server_options.tls = {config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file};
  server_options.auth = std::move(auth);
  for (const auto& [tenant, quota] : config.quotas) pool.SetTenantQuota(tenant, quota);
  server_options.admin_info.backend = std::string(backend->name());
  server_options.admin_info.backend_reason = backend_choice->reason;
  server_options.build_info = {{"version", KVS_VERSION},
                               {"revision", KVS_GIT_REVISION},
                               {"build_type", KVS_BUILD_TYPE},
                               {"backend", std::string(backend->name())}};
  auto server = kvs::SidecarServer::Start(&pool, server_options);
  if (!server.ok()) {
    // Unreadable certificate files are configuration errors.
    return Fail(
        server.status().message(),
        server.status().code() == absl::StatusCode::kFailedPrecondition ? kExitBadFlags : 1);
  }

  std::cout << (*server)->ListeningLine() << std::endl;  // endl flushes: tests wait for it
  if (exit_when_stdin_closes) StopWhenStdinCloses();

  int signal_number = 0;
  sigwait(&stop_signals, &signal_number);
  KVS_LOG(kInfo, "signal")("signal", signal_number == SIGINT ? "SIGINT" : "SIGTERM");
  const absl::Time deadline = kvs::MonotonicNow() + absl::Milliseconds(config.drain_grace_ms);
  const StatusOrTier target = kvs::ParseDrainTarget(config.drain_to, "--drain_to");
  if (target.ok() && *target != kvs::StorageTier::kArena) {
    // Workers hear KIND_DRAINING and get a moment to finish the calls in flight; then the
    // servers stop (no call can bring a sequence back into the arena while it moves) and every
    // sequence of every session still attached moves to the target tier. Sessions are not
    // reclaimed by the shutdown: their sequences stay in the pool until moved.
    (*server)->sidecar()->StartDraining();
    (*server)->Shutdown(std::min(absl::Seconds(2),
                                 absl::Milliseconds(config.drain_grace_ms) / 4));
    const kvs::DrainReport report =
        kvs::DrainSequences(pool, *target, deadline, /*retry=*/false);
    kvs::LogDrainReport(report, *target, "drained_on_exit");
  } else {
    (*server)->Shutdown(absl::Seconds(2));
  }
  server->reset();
  return 0;
}
