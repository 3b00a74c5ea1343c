// kvctl: the operator's command line for the kvsidecar Admin service (status, list, show, set,
// drain, release, config, health). Built on the C++ client library (kvsidecar::AdminClient) for
// the calls, CLI11 for the command line, protobuf's JSON printer for --json and the project's one
// byte-size parser (gpu/base/quantity.h: Kubernetes quantities) for sizes.
//
// Output: a readable table or text by default; with --json exactly one JSON document on stdout
// whose keys are stable (admin.proto responses, or the documents of kvctl/output.proto; proto
// field names, every field present also when zero, 64-bit integers as strings).
//
// Exit codes (scripts rely on them; keep in sync with kFooter and deploy/README.md):
//   0  success
//   1  the server answered with an error (the gRPC code and message are printed), or a condition
//      the command checks was not met (health not SERVING, drain --wait timed out, no such
//      session or sequence)
//   2  usage error (unknown command or flag, missing or malformed argument, unreadable file)
//   3  cannot connect to the server within --connect-timeout
//
// Single-threaded; one process per command.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "google/protobuf/util/json_util.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "kvctl/output.pb.h"
#include "kvsidecar/client.h"
#include "kvsidecar/v1/admin.pb.h"
#include "kvsidecar/v1/common.pb.h"
#include "gpu/base/build_info.h"
#include "gpu/base/quantity.h"

namespace {

namespace v1 = kvsidecar::v1;
namespace doc = kvsidecar::kvctl;

enum ExitCode : int {
  kExitOk = 0,
  kExitServerError = 1,
  kExitUsage = 2,
  kExitCannotConnect = 3,
};

constexpr char kDescription[] = "kvctl: operate a kvsidecar through its Admin service.";

constexpr char kFooter[] = R"(Commands:
  status                          tiers, tenants, sessions and spilled sequences
  list sessions [--tenant=T]      one line per attached session
  list sequences [--tenant=T] [--session=S]
                                  one line per sequence (spilled ones with their tier)
  list quotas [--tenant=T]        tenants with a quota or sessions: quota and usage
  list spilled [--tenant=T] [--session=S]
                                  spilled copies in the host and disk tiers, those of ended
                                  sessions and earlier runs (ATTACHED no) and lost ones included
  show session ID                 one session and its sequences
  show sequence ID [--session=S]  one sequence (--session when the id is used in several sessions)
  show config                     as `config`
  set budget N [--strict] [--prefill-block=N] [--per-layer=N1,N2,...] [--rebudget-tenant=T]
                                  default budget of new sequences: the tokens each layer keeps
                                  (N >= 1; kvpress's compression_ratio = 1 - N / prompt);
                                  --rebudget-tenant also compresses that tenant's sequences to it
  set budget none                 new sequences are unbounded again (the start-up default)
  set policy NAME [--spec=JSON] [--rebudget-tenant=T]
                                  default policy of new sequences (streaming_llm, keydiff, h2o,
                                  tova, snapkv, cake, d2o, caote); --spec is a PolicySpec in proto
                                  JSON whose params must be NAME's, e.g. '{"h2o":{"n_recent":64}}'
  set quota TENANT [--arena=SIZE] [--host=SIZE] [--disk=SIZE] [--sequences=N]
                 [--rebudget [--rebudget-tokens=N]]
                                  replaces the tenant's quota (an omitted limit = 0 = unlimited;
                                  all omitted removes the quota); --rebudget allows a quota below
                                  current use by compressing the tenant's sequences to N tokens
                                  per layer (default: the default budget)
  drain [--wait] [--wait-timeout=SECONDS] [--to=disk|remote] [--grace=SECONDS]
                                  stop accepting attaches; --wait polls until no session is left;
                                  --to moves every live sequence to that tier within --grace
                                  and lists what did not move
  release session ID              force-release a session and all its sequences
  release sequence ID --session=S force-release one sequence
  config                          the effective configuration (YAML; secrets redacted)
  health [--service=NAME]         gRPC health check (grpc.health.v1) of --admin; exit 0 if SERVING
  help [COMMAND...]               this text, or that command's flags (as COMMAND --help)

SIZE is a Kubernetes quantity, the same as in the sidecar's flags and YAML file: plain bytes, or
Ki Mi Gi Ti Pi Ei (powers of 1024) or k M G T P E (powers of 1000); fractions that come to whole
bytes are allowed (1.5Gi); KiB, MiB, ... and KB, MB, ... are accepted as aliases of Ki, Mi, ...
and k, M, ... (GiB = 2^30, GB = 10^9).

Environment: KVCTL_ADMIN (default of --admin), KVCTL_TOKEN (token when neither --token nor
--token-file is given).

Exit codes:
  0  success
  1  server error (gRPC code and message printed; with --json also {"error":{...}} on stdout),
     or a checked condition failed (not SERVING, drain --wait timed out, no such session/sequence)
  2  usage error
  3  cannot connect to the server
)";

std::string VersionText() {
  return absl::StrCat("kvctl ", KVS_VERSION, "\ngit revision: ", KVS_GIT_REVISION,
                      "\nbuild type: ", KVS_BUILD_TYPE);
}

// ---------------------------------------------------------------------------------------------
// Errors

// A malformed command line found after CLI11's parse (a value kvctl checks itself): exit 2.
class UsageError {
 public:
  explicit UsageError(std::string message) : message_(std::move(message)) {}
  const std::string& message() const { return message_; }

 private:
  std::string message_;
};

// A command that failed: the server's error, an unreachable server or an unmet condition.
struct Failure {
  int exit_code;
  std::string code;  // gRPC code name
  std::string message;
};

Failure ServerFailure(const absl::Status& status) {
  return Failure{kExitServerError, absl::StatusCodeToString(status.code()),
                 std::string(status.message())};
}

// The response of a call, or the command fails with the server's error.
template <typename T>
T Unwrap(absl::StatusOr<T> result) {
  if (!result.ok()) throw ServerFailure(result.status());
  return *std::move(result);
}

// ---------------------------------------------------------------------------------------------
// Values kvctl checks itself

int32_t ParseInt32(const std::string& text, const std::string& what) {
  int32_t value = 0;
  if (!absl::SimpleAtoi(text, &value)) {
    throw UsageError(absl::StrCat(what, " must be a whole number, got '", text, "'"));
  }
  return value;
}

uint64_t ParseSize(const std::string& text, const std::string& what) {
  absl::StatusOr<uint64_t> bytes = kvs::ParseQuantityBytes(text, what);
  if (!bytes.ok()) throw UsageError(std::string(bytes.status().message()));
  return *bytes;
}

std::string ReadFileOrThrow(const std::string& path, const std::string& flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError(absl::StrCat("cannot read --", flag, " file '", path, "'"));
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// A proto message in the proto3 JSON mapping with the proto field names and every field present.
std::string ToJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = false;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string out;
  if (!google::protobuf::util::MessageToJsonString(message, &out, options).ok()) return "null";
  return out;
}

// ---------------------------------------------------------------------------------------------
// Display

std::string HumanBytes(uint64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 5) {
    value /= 1024.0;
    ++unit;
  }
  if (unit == 0) return absl::StrCat(bytes, " B");
  return absl::StrFormat("%.1f %s", value, kUnits[unit]);
}

// "12s", "3m04s", "2h05m", "3d04h".
std::string Duration(int64_t ms) {
  const int64_t seconds = std::max<int64_t>(0, ms / 1000);
  if (seconds < 60) return absl::StrCat(seconds, "s");
  if (seconds < 3600) return absl::StrFormat("%dm%02ds", seconds / 60, seconds % 60);
  if (seconds < 86400) return absl::StrFormat("%dh%02dm", seconds / 3600, (seconds % 3600) / 60);
  return absl::StrFormat("%dd%02dh", seconds / 86400, (seconds % 86400) / 3600);
}

// Time since `unix_ms` by this machine's clock; "-" for 0.
std::string Age(int64_t unix_ms) {
  if (unix_ms <= 0) return "-";
  return Duration(absl::ToUnixMillis(absl::Now()) - unix_ms);
}

// Time until `unix_ms` ("in 8s"), or "expired".
std::string Until(int64_t unix_ms) {
  if (unix_ms <= 0) return "-";
  const int64_t ms = unix_ms - absl::ToUnixMillis(absl::Now());
  if (ms < 0) return "expired";
  return absl::StrCat(ms / 1000, "s");
}

std::string PolicyName(const v1::PolicySpec& policy) {
  return policy.name().empty() ? "(server default)" : policy.name();
}

std::string BudgetText(const v1::Budget& budget) {
  if (budget.tokens_per_layer() <= 0 && budget.per_layer_tokens_size() == 0) return "unbounded";
  std::string text =
      budget.per_layer_tokens_size() > 0
          ? absl::StrCat("per-layer[", absl::StrJoin(budget.per_layer_tokens(), ","), "]")
          : absl::StrCat(budget.tokens_per_layer());
  if (budget.strict()) {
    absl::StrAppend(&text, " strict(block ",
                    budget.prefill_block_tokens() > 0 ? budget.prefill_block_tokens() : 128, ")");
  }
  return text;
}

std::string TierName(v1::Tier tier) {
  switch (tier) {
    case v1::TIER_ARENA:
      return "arena";
    case v1::TIER_HOST:
      return "host";
    case v1::TIER_DISK:
      return "disk";
    case v1::TIER_REMOTE:
      return "remote";
    default:
      return "-";
  }
}

// Kept tokens per layer: "64" when all layers agree, "min-max (sum total)" otherwise.
std::string KeptText(const v1::SequenceInfo& sequence) {
  if (sequence.tokens_per_layer_size() == 0) return "0";
  const auto [lo, hi] =
      std::minmax_element(sequence.tokens_per_layer().begin(), sequence.tokens_per_layer().end());
  if (*lo == *hi) return absl::StrCat(*lo);
  int64_t total = 0;
  for (int32_t count : sequence.tokens_per_layer()) total += count;
  return absl::StrCat(*lo, "-", *hi, " (sum ", total, ")");
}

// Left-aligned columns separated by two spaces.
class Table {
 public:
  explicit Table(std::vector<std::string> header) { rows_.push_back(std::move(header)); }
  void Add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  std::string Render() const {
    std::vector<size_t> width;
    for (const auto& row : rows_) {
      width.resize(std::max(width.size(), row.size()), 0);
      for (size_t i = 0; i < row.size(); ++i) width[i] = std::max(width[i], row[i].size());
    }
    std::string out;
    for (const auto& row : rows_) {
      std::string line;
      for (size_t i = 0; i < row.size(); ++i) {
        line += row[i];
        if (i + 1 < row.size()) line += std::string(width[i] - row[i].size() + 2, ' ');
      }
      absl::StrAppend(&out, line, "\n");
    }
    if (rows_.size() == 1) absl::StrAppend(&out, "(none)\n");
    return out;
  }

 private:
  std::vector<std::vector<std::string>> rows_;
};

// ---------------------------------------------------------------------------------------------
// Connection

struct GlobalFlags {
  std::string admin;
  bool json = false;
  double timeout = 30;
  double connect_timeout = 5;
  std::string token;
  std::string token_file;
  bool tls = false;
  std::string ca;
  std::string cert;
  std::string key;
  std::string server_name;
};

// The Admin client, connected on first use: a command's usage errors (checked before its first
// call) never wait for a connection.
class Admin {
 public:
  explicit Admin(const GlobalFlags& flags) {
    target_ = flags.admin;
    if (target_.empty()) {
      const char* env = std::getenv("KVCTL_ADMIN");
      target_ = env != nullptr && env[0] != '\0' ? env : "127.0.0.1:50052";
    }
    connect_timeout_ = flags.connect_timeout;
    options_.connect_timeout = absl::Milliseconds(static_cast<int64_t>(flags.connect_timeout * 1e3));
    options_.rpc_timeout = absl::Milliseconds(static_cast<int64_t>(flags.timeout * 1e3));
    if (!flags.token.empty()) {
      options_.bearer_token = flags.token;
    } else if (!flags.token_file.empty()) {
      options_.bearer_token = std::string(absl::StripTrailingAsciiWhitespace(
          ReadFileOrThrow(flags.token_file, "token-file")));
    } else if (const char* env = std::getenv("KVCTL_TOKEN"); env != nullptr) {
      options_.bearer_token = env;
    }
    const bool tls = flags.tls || !flags.ca.empty() || !flags.cert.empty();
    if (!flags.server_name.empty() && !tls) {
      throw UsageError("--server-name needs TLS (--tls or --ca)");
    }
    if (tls) {
      grpc::SslCredentialsOptions ssl;
      if (!flags.ca.empty()) ssl.pem_root_certs = ReadFileOrThrow(flags.ca, "ca");
      if (!flags.cert.empty()) {
        ssl.pem_cert_chain = ReadFileOrThrow(flags.cert, "cert");
        ssl.pem_private_key = ReadFileOrThrow(flags.key, "key");
      }
      options_.credentials = grpc::SslCredentials(ssl);
      options_.tls_server_name = flags.server_name;
    }
  }

  kvsidecar::AdminClient& client() {
    if (client_ != nullptr) return *client_;
    absl::StatusOr<std::unique_ptr<kvsidecar::AdminClient>> client =
        kvsidecar::AdminClient::Connect(target_, options_);
    if (!client.ok()) {
      if (client.status().code() != absl::StatusCode::kUnavailable) {
        throw ServerFailure(client.status());
      }
      throw Failure{kExitCannotConnect, "UNAVAILABLE",
                    absl::StrFormat("cannot connect to %s within %gs (is the server running, and "
                                    "are the TLS settings right?)",
                                    target_, connect_timeout_)};
    }
    client_ = *std::move(client);
    return *client_;
  }

  const std::shared_ptr<grpc::Channel>& channel() { return client().channel(); }
  const kvsidecar::ClientOptions& options() const { return options_; }

 private:
  std::string target_;
  double connect_timeout_ = 5;
  kvsidecar::ClientOptions options_;
  std::unique_ptr<kvsidecar::AdminClient> client_;
};

// What a command prints: `text` for people, `json` for --json.
struct Output {
  std::string text;
  std::string json;
};

// ---------------------------------------------------------------------------------------------
// Commands

std::string SequencesText(int32_t sequences, int32_t spilled) {
  return spilled > 0 ? absl::StrCat(sequences, " (", spilled, " spilled)")
                     : absl::StrCat(sequences);
}

void SessionRow(const v1::SessionInfo& s, Table* table) {
  table->Add({s.session_id(), s.tenant(), s.worker_name().empty() ? "-" : s.worker_name(),
              absl::StrCat(s.num_blocks() - s.free_blocks(), "/", s.num_blocks()),
              SequencesText(s.sequences(), s.sequences_spilled()), Age(s.attached_unix_ms()),
              Age(s.last_heartbeat_unix_ms()), Until(s.lease_expires_unix_ms())});
}
Table SessionTable() {
  return Table({"SESSION", "TENANT", "WORKER", "BLOCKS(used/total)", "SEQUENCES", "AGE",
                "HEARTBEAT", "LEASE"});
}

// Ages as the server measured them (no clock skew), else from the timestamps.
std::string SequenceAge(const v1::SequenceInfo& s) {
  return s.age_ms() > 0 ? Duration(s.age_ms()) : Age(s.created_unix_ms());
}
std::string SequenceIdle(const v1::SequenceInfo& s) {
  return s.idle_ms() > 0 ? Duration(s.idle_ms()) : Age(s.last_used_unix_ms());
}

Table SequenceTable() {
  return Table({"SESSION", "SEQUENCE", "TENANT", "POLICY", "BUDGET", "KEPT/LAYER", "TIER", "BLOCKS",
                "ARENA", "HOST", "DISK", "AGE", "IDLE"});
}
void SequenceRow(const v1::SequenceInfo& s, Table* table) {
  table->Add({s.session_id(), s.sequence_id(), s.tenant(), PolicyName(s.policy()),
              BudgetText(s.budget()), KeptText(s), TierName(s.tier()), absl::StrCat(s.blocks()),
              HumanBytes(s.arena_bytes()), HumanBytes(s.host_bytes()), HumanBytes(s.disk_bytes()),
              SequenceAge(s), SequenceIdle(s)});
}

std::string Limit(uint64_t value, bool bytes) {
  if (value == 0) return "-";
  return bytes ? HumanBytes(value) : absl::StrCat(value);
}
Table TenantTable() {
  return Table(
      {"TENANT", "SESSIONS", "SEQUENCES", "ARENA", "HOST", "DISK", "QUOTA(arena/host/disk/seq)"});
}
void TenantRow(const v1::TenantQuota& tenant, Table* table) {
  const v1::TenantUsage& use = tenant.usage();
  const v1::Quota& q = tenant.quota();
  const bool limited =
      q.arena_bytes() != 0 || q.host_bytes() != 0 || q.disk_bytes() != 0 || q.sequences() != 0;
  table->Add(
      {tenant.tenant(), absl::StrCat(use.sessions()), absl::StrCat(use.sequences()),
       HumanBytes(use.arena_bytes()), HumanBytes(use.host_bytes()), HumanBytes(use.disk_bytes()),
       limited
           ? absl::StrCat(Limit(q.arena_bytes(), true), " / ", Limit(q.host_bytes(), true), " / ",
                          Limit(q.disk_bytes(), true), " / ", Limit(q.sequences(), false))
           : "none"});
}

Output Status(Admin& admin) {
  kvsidecar::AdminClient& client = admin.client();
  const v1::GetStatsResponse stats = Unwrap(client.GetStats());
  const v1::GetConfigResponse config = Unwrap(client.GetConfig());
  const v1::ListSessionsResponse sessions = Unwrap(client.ListSessions());
  const v1::ListSequencesResponse sequences = Unwrap(client.ListSequences());

  // Tenants: the server's accounting (quota and usage) where it has it; tenants it does not list
  // but that hold sessions get their usage summed from the lists.
  std::map<std::string, v1::TenantQuota> tenants;
  for (const auto& tenant : stats.tenants()) tenants[tenant.tenant()] = tenant;
  std::map<std::string, v1::TenantUsage> summed;
  for (const auto& s : sessions.sessions()) {
    v1::TenantUsage& use = summed[s.tenant()];
    use.set_sessions(use.sessions() + 1);
  }
  for (const auto& s : sequences.sequences()) {
    v1::TenantUsage& use = summed[s.tenant()];
    use.set_sequences(use.sequences() + 1);
    use.set_arena_bytes(use.arena_bytes() + s.arena_bytes());
    use.set_host_bytes(use.host_bytes() + s.host_bytes());
    use.set_disk_bytes(use.disk_bytes() + s.disk_bytes());
  }
  for (const auto& [name, use] : summed) {
    if (tenants.count(name) > 0) continue;
    v1::TenantQuota& tenant = tenants[name];
    tenant.set_tenant(name);
    *tenant.mutable_usage() = use;
  }
  for (auto& [name, tenant] : tenants) {
    tenant.mutable_quota();  // present in --json also when unset (all 0 = no quota)
    tenant.mutable_usage();
  }

  Output out;
  std::string& t = out.text;
  absl::StrAppend(
      &t, "backend: ", config.backend(),
      config.backend_reason().empty() ? "" : absl::StrCat(" (", config.backend_reason(), ")"),
      "   draining: ", stats.draining() ? "yes" : "no", "\n");
  absl::StrAppend(&t, "defaults: policy ", PolicyName(config.default_policy()), ", budget ",
                  BudgetText(config.default_budget()), "\n");
  absl::StrAppend(&t, "uptime: ", Duration(stats.uptime_ms()),
                  "   backend healthy: ", stats.backend_healthy() ? "yes" : "no", "\n");
  absl::StrAppend(&t, "sessions: ", stats.sessions(),
                  "   sequences: ", SequencesText(stats.sequences(), stats.sequences_spilled()),
                  "   reclaimed: ", stats.sessions_reclaimed(),
                  "   arena reserved: ", HumanBytes(stats.arena_bytes_reserved()), "\n");
  absl::StrAppend(&t, "tokens: kept ", stats.tokens_kept(), ", appended ", stats.tokens_appended(),
                  ", evicted ", stats.tokens_evicted(), ", merged ", stats.tokens_merged(),
                  "\n\nTIERS\n");
  doc::StatusDocument document;
  const auto add_tier = [&](const std::string& name, uint64_t used, uint64_t capacity) {
    doc::StatusDocument::Tier* tier = document.add_tiers();
    tier->set_tier(name);
    tier->set_used_bytes(used);
    tier->set_capacity_bytes(capacity);
  };
  add_tier("arena", stats.arena_bytes_used(), stats.arena_bytes_capacity());
  add_tier("host", stats.host_bytes_used(), stats.host_bytes_capacity());
  add_tier("disk", stats.disk_bytes_used(), stats.disk_bytes_capacity());
  Table tiers({"TIER", "USED", "CAPACITY", "USE%"});
  for (const doc::StatusDocument::Tier& tier : document.tiers()) {
    const uint64_t used = tier.used_bytes();
    const uint64_t capacity = tier.capacity_bytes();
    tiers.Add({tier.tier(), HumanBytes(used),
               capacity == 0 ? std::string("-") : HumanBytes(capacity),
               capacity == 0 ? std::string("-")
                             : absl::StrFormat("%.1f%%", 100.0 * static_cast<double>(used) /
                                                             static_cast<double>(capacity))});
  }
  absl::StrAppend(&t, tiers.Render(), "\nTENANTS\n");
  Table tenant_table = TenantTable();
  for (const auto& [name, tenant] : tenants) TenantRow(tenant, &tenant_table);
  absl::StrAppend(&t, tenant_table.Render(), "\nSESSIONS\n");
  Table session_table = SessionTable();
  for (const auto& s : sessions.sessions()) SessionRow(s, &session_table);
  absl::StrAppend(&t, session_table.Render());
  // Which sequences are out of the arena (counted above, listed here).
  Table spilled({"SESSION", "SEQUENCE", "TENANT", "TIER", "BYTES"});
  for (const v1::SequenceInfo& s : sequences.sequences()) {
    if (s.tier() != v1::TIER_HOST && s.tier() != v1::TIER_DISK) continue;
    spilled.Add({s.session_id(), s.sequence_id(), s.tenant(), TierName(s.tier()),
                 HumanBytes(s.host_bytes() + s.disk_bytes())});
  }
  absl::StrAppend(&t, "\nSPILLED SEQUENCES\n", spilled.Render());

  *document.mutable_stats() = stats;
  document.set_backend(config.backend());
  document.set_backend_reason(config.backend_reason());
  *document.mutable_default_policy() = config.default_policy();
  *document.mutable_default_budget() = config.default_budget();
  for (const auto& [name, tenant] : tenants) *document.add_tenants() = tenant;
  *document.mutable_sessions() = sessions.sessions();
  out.json = ToJson(document);
  return out;
}

Output ListSessions(Admin& admin, const std::string& tenant) {
  const v1::ListSessionsResponse response = Unwrap(admin.client().ListSessions(tenant));
  Table table = SessionTable();
  for (const auto& s : response.sessions()) SessionRow(s, &table);
  return {table.Render(), ToJson(response)};
}

Output ListSequences(Admin& admin, const std::string& tenant, const std::string& session) {
  const v1::ListSequencesResponse response =
      Unwrap(admin.client().ListSequences(session, tenant));
  Table table = SequenceTable();
  for (const auto& s : response.sequences()) SequenceRow(s, &table);
  return {table.Render(), ToJson(response)};
}

Output ListQuotas(Admin& admin, const std::string& tenant) {
  const v1::GetQuotasResponse response = Unwrap(admin.client().GetQuotas(tenant));
  Table table = TenantTable();
  for (const auto& t : response.tenants()) TenantRow(t, &table);
  return {table.Render(), ToJson(response)};
}

Output ListSpilled(Admin& admin, const std::string& tenant, const std::string& session) {
  const v1::ListSpilledResponse response = Unwrap(admin.client().ListSpilled(tenant, session));
  Table table({"SESSION", "SEQUENCE", "TENANT", "TIER", "BYTES", "SPILLED", "ATTACHED", "LOST"});
  for (const v1::SpilledCopy& copy : response.copies()) {
    table.Add({copy.session_id(), copy.sequence_id(), copy.tenant(), TierName(copy.tier()),
               HumanBytes(copy.bytes()), Age(copy.spilled_unix_ms()),
               copy.session_attached() ? "yes" : "no", copy.lost().empty() ? "-" : copy.lost()});
  }
  return {table.Render(), ToJson(response)};
}

std::string SequenceDetail(const v1::SequenceInfo& s) {
  std::string t;
  absl::StrAppend(&t, "sequence:   ", s.sequence_id(), "\nsession:    ", s.session_id(),
                  "\ntenant:     ", s.tenant(), "\npolicy:     ", PolicyName(s.policy()),
                  "\nbudget:     ", BudgetText(s.budget()), "\ntier:       ", TierName(s.tier()),
                  "\nblocks:     ", s.blocks(), "\nbytes:      arena ", HumanBytes(s.arena_bytes()),
                  ", host ", HumanBytes(s.host_bytes()), ", disk ", HumanBytes(s.disk_bytes()),
                  "\nage:        ", SequenceAge(s), "\nlast use:   ", SequenceIdle(s), " ago\n");
  Table layers({"LAYER", "KEPT"});
  for (int i = 0; i < s.tokens_per_layer_size(); ++i) {
    layers.Add({absl::StrCat(i), absl::StrCat(s.tokens_per_layer(i))});
  }
  absl::StrAppend(&t, "tokens kept per layer:\n", layers.Render());
  return t;
}

Output ShowSession(Admin& admin, const std::string& id) {
  const v1::ListSessionsResponse sessions = Unwrap(admin.client().ListSessions());
  const v1::SessionInfo* found = nullptr;
  for (const auto& s : sessions.sessions()) {
    if (s.session_id() == id) found = &s;
  }
  if (found == nullptr) {
    throw Failure{kExitServerError, "NOT_FOUND", absl::StrCat("no session '", id, "'")};
  }
  const v1::ListSequencesResponse sequences = Unwrap(admin.client().ListSequences(id));
  const auto& s = *found;
  const v1::ModelLayout& layout = s.layout();
  Output out;
  absl::StrAppend(&out.text, "session:    ", s.session_id(), "\ntenant:     ", s.tenant(),
                  "\nworker:     ", s.worker_name().empty() ? "-" : s.worker_name(),
                  "\nlayout:     ", layout.num_layers(), " layers, ", layout.num_kv_heads(),
                  " kv heads, ", layout.num_q_heads(), " q heads, head_dim ", layout.head_dim(),
                  ", ", v1::DType_Name(layout.dtype()), ", ", layout.block_tokens(),
                  " tokens/block", "\nblocks:     ", s.num_blocks() - s.free_blocks(), " used of ",
                  s.num_blocks(), "\nsequences:  ",
                  SequencesText(s.sequences(), s.sequences_spilled()),
                  "\nattached:   ", Age(s.attached_unix_ms()), " ago\nheartbeat:  ",
                  Age(s.last_heartbeat_unix_ms()), " ago\nlease:      expires in ",
                  Until(s.lease_expires_unix_ms()), "\n\nSEQUENCES\n");
  Table table = SequenceTable();
  for (const auto& q : sequences.sequences()) SequenceRow(q, &table);
  absl::StrAppend(&out.text, table.Render());
  doc::SessionDocument document;
  *document.mutable_session() = s;
  *document.mutable_sequences() = sequences.sequences();
  out.json = ToJson(document);
  return out;
}

Output ShowSequence(Admin& admin, const std::string& id, const std::string& session) {
  const v1::ListSequencesResponse sequences = Unwrap(admin.client().ListSequences(session));
  std::vector<const v1::SequenceInfo*> found;
  for (const auto& q : sequences.sequences()) {
    if (q.sequence_id() == id) found.push_back(&q);
  }
  if (found.empty()) {
    throw Failure{kExitServerError, "NOT_FOUND",
                  absl::StrCat("no sequence '", id, "'",
                               session.empty() ? "" : absl::StrCat(" in session '", session, "'"))};
  }
  if (found.size() > 1) {
    std::vector<std::string> where;
    for (const auto* q : found) where.push_back(q->session_id());
    throw UsageError(absl::StrCat("sequence '", id, "' exists in sessions ",
                                  absl::StrJoin(where, ", "), ": add --session=S"));
  }
  doc::SequenceDocument document;
  *document.mutable_sequence() = *found[0];
  return {SequenceDetail(*found[0]), ToJson(document)};
}

std::string SkippedText(const google::protobuf::RepeatedPtrField<std::string>& skipped) {
  std::string text;
  for (const std::string& line : skipped) absl::StrAppend(&text, "  not re-budgeted: ", line, "\n");
  return text;
}

// After a successful SetDefaults: the defaults now in force, as the server reports them.
Output DefaultsOutput(const v1::SetDefaultsResponse& response, const std::string& rebudget_tenant) {
  Output out;
  absl::StrAppend(&out.text, "defaults for new sequences: policy ",
                  PolicyName(response.default_policy()), ", budget ",
                  BudgetText(response.default_budget()), "\n");
  if (!rebudget_tenant.empty()) {
    absl::StrAppend(&out.text, "re-budgeted ", response.sequences_rebudgeted(),
                    " sequence(s) of tenant ", rebudget_tenant, "\n",
                    SkippedText(response.rebudget_skipped()));
  }
  out.json = ToJson(response);
  return out;
}

struct BudgetArgs {
  std::string tokens;  // text: a negative value is an argument, not a flag, and gets our message
  bool strict = false;
  std::optional<int32_t> prefill_block;
  std::string per_layer;
  std::string rebudget_tenant;
};

Output SetBudget(Admin& admin, const BudgetArgs& args) {
  v1::SetDefaultsRequest request;
  if (args.tokens == "none") {
    if (args.strict || args.prefill_block.has_value() || !args.per_layer.empty() ||
        !args.rebudget_tenant.empty()) {
      throw UsageError(
          "set budget none takes no --strict, --prefill-block, --per-layer or --rebudget-tenant");
    }
    request.set_unbounded_budget(true);
    return DefaultsOutput(Unwrap(admin.client().SetDefaults(request)), "");
  }
  v1::Budget* budget = request.mutable_default_budget();
  const int32_t tokens = ParseInt32(args.tokens, "the budget N (tokens per layer)");
  if (tokens == 0) {
    throw UsageError(
        "set budget 0: a budget is the tokens each layer keeps (N >= 1); `kvctl set budget "
        "none` makes new sequences unbounded");
  }
  // Any other whole number goes to the server, which refuses negative budgets naming the field
  // and the value (INVALID_ARGUMENT, exit 1).
  budget->set_tokens_per_layer(tokens);
  budget->set_strict(args.strict);
  if (args.prefill_block.has_value()) budget->set_prefill_block_tokens(*args.prefill_block);
  if (!args.per_layer.empty()) {
    for (absl::string_view part : absl::StrSplit(args.per_layer, ',')) {
      budget->add_per_layer_tokens(ParseInt32(std::string(absl::StripAsciiWhitespace(part)),
                                              "--per-layer entries"));
    }
  }
  request.set_rebudget_tenant(args.rebudget_tenant);
  return DefaultsOutput(Unwrap(admin.client().SetDefaults(request)), request.rebudget_tenant());
}

struct PolicyArgs {
  std::string name;
  std::optional<std::string> spec;
  std::string rebudget_tenant;
};

Output SetPolicy(Admin& admin, const PolicyArgs& args) {
  v1::SetDefaultsRequest request;
  v1::PolicySpec* policy = request.mutable_default_policy();
  if (args.spec.has_value()) {
    google::protobuf::util::JsonParseOptions options;
    options.ignore_unknown_fields = false;
    const auto parsed = google::protobuf::util::JsonStringToMessage(*args.spec, policy, options);
    if (!parsed.ok()) {
      throw UsageError(absl::StrCat("--spec is not a PolicySpec in JSON: ", parsed.ToString()));
    }
  }
  // The server checks the spec as CreateSequence does (params of another policy, ranges) and
  // answers INVALID_ARGUMENT naming the field: shown as its error, exit 1.
  policy->set_name(args.name);
  request.set_rebudget_tenant(args.rebudget_tenant);
  return DefaultsOutput(Unwrap(admin.client().SetDefaults(request)), request.rebudget_tenant());
}

struct QuotaArgs {
  std::string tenant;
  std::optional<std::string> arena, host, disk;
  std::optional<int32_t> sequences;
  bool rebudget = false;
  std::optional<int32_t> rebudget_tokens;
};

Output SetQuota(Admin& admin, const QuotaArgs& args) {
  v1::SetQuotaRequest request;
  request.set_tenant(args.tenant);
  v1::Quota* quota = request.mutable_quota();
  if (args.arena) quota->set_arena_bytes(ParseSize(*args.arena, "--arena"));
  if (args.host) quota->set_host_bytes(ParseSize(*args.host, "--host"));
  if (args.disk) quota->set_disk_bytes(ParseSize(*args.disk, "--disk"));
  if (args.sequences) quota->set_sequences(*args.sequences);
  request.set_rebudget(args.rebudget);
  if (args.rebudget_tokens) request.set_rebudget_tokens_per_layer(*args.rebudget_tokens);
  const v1::SetQuotaResponse response = Unwrap(admin.client().SetQuota(request));
  const v1::Quota& q = response.quota();
  const auto limit = [](uint64_t bytes) {
    return bytes == 0 ? std::string("unlimited") : HumanBytes(bytes);
  };
  Output out;
  absl::StrAppend(
      &out.text, "quota of tenant ", request.tenant(), ": arena ", limit(q.arena_bytes()), ", host ",
      limit(q.host_bytes()), ", disk ", limit(q.disk_bytes()), ", sequences ",
      q.sequences() == 0 ? std::string("unlimited") : absl::StrCat(q.sequences()), "\n");
  const v1::TenantUsage& use = response.usage();
  absl::StrAppend(&out.text, "in use: arena ", HumanBytes(use.arena_bytes()), ", host ",
                  HumanBytes(use.host_bytes()), ", disk ", HumanBytes(use.disk_bytes()),
                  ", sequences ", use.sequences(), ", sessions ", use.sessions(), "\n");
  if (request.rebudget()) {
    absl::StrAppend(&out.text, "re-budgeted ", response.sequences_rebudgeted(), " sequence(s)\n",
                    SkippedText(response.rebudget_skipped()));
  }
  if (response.over_quota()) {
    absl::StrAppend(&out.text,
                    "warning: the tenant still uses more than the quota; new growth is "
                    "refused until it shrinks\n");
  }
  doc::QuotaDocument document;
  document.set_tenant(request.tenant());
  *document.mutable_quota() = response.quota();
  document.set_sequences_rebudgeted(response.sequences_rebudgeted());
  *document.mutable_usage() = response.usage();
  document.set_over_quota(response.over_quota());
  *document.mutable_rebudget_skipped() = response.rebudget_skipped();
  out.json = ToJson(document);
  return out;
}

Output Drain(Admin& admin, bool wait, double wait_timeout, const std::string& to,
             double grace) {
  v1::DrainRequest request;
  if (to == "disk") {
    request.set_to(v1::TIER_DISK);
  } else if (to == "remote") {
    request.set_to(v1::TIER_REMOTE);
  }
  request.set_grace_ms(static_cast<int64_t>(grace * 1000));
  v1::DrainResponse response = Unwrap(admin.client().Drain(request));
  if (wait && !response.empty()) {
    const absl::Time deadline = absl::Now() + absl::Seconds(wait_timeout);
    while (!response.empty()) {
      if (absl::Now() >= deadline) {
        throw Failure{kExitServerError, "DEADLINE_EXCEEDED",
                      absl::StrFormat("still %d session(s) attached after %gs of draining",
                                      response.sessions_remaining(), wait_timeout)};
      }
      absl::SleepFor(absl::Milliseconds(200));
      const v1::GetStatsResponse stats = Unwrap(admin.client().GetStats());
      response.set_sessions_remaining(stats.sessions());
      response.set_sequences_remaining(stats.sequences());
      response.set_empty(stats.sessions() == 0);
    }
  }
  Output out;
  if (request.to() != v1::TIER_UNSPECIFIED) {
    absl::StrAppend(&out.text, "moved to ", to, ": ", response.sequences_moved(),
                    " sequence(s); not moved: ", response.sequences_not_moved(),
                    response.grace_expired() ? " (the grace period ended)" : "", "\n");
    for (const v1::DrainedSequence& s : response.sequences()) {
      if (!s.moved()) {
        absl::StrAppend(&out.text, "  not moved: ", s.tenant(), " ", s.session_id(), "/",
                        s.sequence_id(), ": ", s.reason(), "\n");
      }
    }
  }
  absl::StrAppend(&out.text, response.empty()
                                 ? "draining: no session attached; safe to stop\n"
                                 : absl::StrCat("draining: ", response.sessions_remaining(),
                                                " session(s) still attached\n"));
  out.json = ToJson(response);
  return out;
}

Output Release(Admin& admin, const std::string& session, const std::string& sequence) {
  const v1::ForceReleaseResponse response = Unwrap(admin.client().ForceRelease(session, sequence));
  return {absl::StrCat("released ", response.sequences_released(), " sequence(s), ",
                       response.blocks_released(), " block(s)\n"),
          ToJson(response)};
}

Output Config(Admin& admin) {
  const v1::GetConfigResponse response = Unwrap(admin.client().GetConfig());
  Output out;
  out.text = response.effective_config_yaml();
  if (!out.text.empty() && out.text.back() != '\n') out.text += "\n";
  out.json = ToJson(response);
  return out;
}

// grpc.health.v1.Health/Check (gRPC's public health proto, compiled in proto/); no credentials
// needed: probes carry none.
Output Health(Admin& admin, const std::string& service) {
  using grpc::health::v1::HealthCheckResponse;
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  std::unique_ptr<grpc::health::v1::Health::Stub> stub =
      grpc::health::v1::Health::NewStub(admin.channel());
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + admin.options().rpc_timeout));
  HealthCheckResponse response;
  if (const grpc::Status status = stub->Check(&context, request, &response); !status.ok()) {
    throw ServerFailure(kvsidecar::ToStatus(status));
  }
  const std::string name = HealthCheckResponse::ServingStatus_Name(response.status());
  const std::string shown = service.empty() ? "(server)" : service;
  if (response.status() != HealthCheckResponse::SERVING) {
    throw Failure{kExitServerError, "UNAVAILABLE",
                  absl::StrCat("health of ", shown, " is ", name)};
  }
  doc::HealthDocument document;
  document.set_service(service);
  document.set_status(name);
  return {absl::StrCat(shown, ": ", name, "\n"), ToJson(document)};
}

// ---------------------------------------------------------------------------------------------
// Command line

// The deepest command the line selected ("" for kvctl itself) and that command.
std::pair<std::string, CLI::App*> Selected(CLI::App& app) {
  std::string path;
  CLI::App* at = &app;
  while (!at->get_subcommands().empty()) {
    at = at->get_subcommands().front();
    absl::StrAppend(&path, path.empty() ? "" : " ", at->get_name());
  }
  return {path, at};
}

std::string CommandNames(const CLI::App& app) {
  std::vector<std::string> names;
  for (const CLI::App* sub : app.get_subcommands({})) names.push_back(sub->get_name());
  return absl::StrJoin(names, ", ");
}

// CLI11's words for a parse error, except where they mislead: a word that names no command is
// "unknown command", not "A subcommand is required".
std::string UsageText(CLI::App& app, const CLI::ParseError& error) {
  const bool missing_command = dynamic_cast<const CLI::RequiredError*>(&error) != nullptr ||
                               dynamic_cast<const CLI::ExtrasError*>(&error) != nullptr;
  auto [path, at] = Selected(app);
  const std::string shown = path.empty() ? "kvctl" : absl::StrCat("kvctl ", path);
  if (missing_command && !at->get_subcommands({}).empty() && at->get_subcommands().empty()) {
    std::vector<std::string> rest = at->remaining();
    if (rest.empty() && at != &app) rest = app.remaining();
    for (const std::string& word : rest) {
      if (!word.empty() && word[0] != '-') {
        return absl::StrCat("unknown command '", path.empty() ? "" : path + " ", word, "' (",
                            shown, " takes: ", CommandNames(*at), ")");
      }
    }
    return absl::StrCat(shown, " needs a command: ", CommandNames(*at));
  }
  return error.what();
}

// `kvctl help [COMMAND...]`: the whole text, or one command's (as `COMMAND --help`).
int PrintHelp(CLI::App& app, const std::vector<std::string>& topic) {
  CLI::App* at = &app;
  for (const std::string& word : topic) {
    CLI::App* sub = nullptr;
    for (CLI::App* candidate : at->get_subcommands({})) {
      if (candidate->get_name() == word) sub = candidate;
    }
    if (sub == nullptr) {
      std::cerr << "kvctl: help: unknown command '" << absl::StrJoin(topic, " ") << "' ("
                << (at == &app ? "kvctl" : at->get_name()) << " takes: " << CommandNames(*at)
                << ")\n";
      return kExitUsage;
    }
    at = sub;
  }
  // The formatter, not App::help(): that prints the help of the command just parsed, which is
  // `help` itself.
  const std::string name =
      topic.empty() ? "kvctl" : absl::StrCat("kvctl ", absl::StrJoin(topic, " "));
  std::cout << app.get_formatter()->make_help(at, name, CLI::AppFormatMode::Normal);
  return kExitOk;
}

// Numbers checked with messages that say what is wanted (CLI::PositiveNumber's names a range up to
// the largest double: "Value abc not in range 0 to 1.79769e+308").
CLI::Validator SecondsCheck(bool zero_allowed) {
  return CLI::Validator(
      [zero_allowed](std::string& text) -> std::string {
        double value = 0;
        if (!absl::SimpleAtod(text, &value) || std::isnan(value) || std::isinf(value) ||
            value < 0 || (value == 0 && !zero_allowed)) {
          return absl::StrCat("must be a ", zero_allowed ? "non-negative" : "positive",
                              " number of seconds (e.g. 30 or 0.5), got '", text, "'");
        }
        return "";
      },
      "SECONDS");
}

CLI::Validator CountCheck(int32_t least) {
  return CLI::Validator(
      [least](std::string& text) -> std::string {
        int32_t value = 0;
        if (!absl::SimpleAtoi(text, &value) || value < least) {
          return absl::StrCat("must be a whole number >= ", least, ", got '", text, "'");
        }
        return "";
      },
      "N");
}

int Run(int argc, char** argv) {
  CLI::App app(kDescription, "kvctl");
  app.set_version_flag("--version", VersionText(), "Print the version, git revision and build type");
  app.require_subcommand(1, 1);
  // Global flags may follow the command (`kvctl status --json`): a subcommand hands the flags it
  // does not know to this level.
  app.fallthrough();
  GlobalFlags flags;
  app.add_option("--admin", flags.admin,
                 "Admin address HOST:PORT (default 127.0.0.1:50052, or $KVCTL_ADMIN)");
  app.add_flag("--json", flags.json,
               "Machine-readable output: one JSON document on stdout with stable keys");
  app.add_option("--timeout", flags.timeout, "Deadline of each call, seconds (default 30)")
      ->check(SecondsCheck(false));
  app.add_option("--connect-timeout", flags.connect_timeout,
                 "How long to wait for the connection, seconds (default 5)")
      ->check(SecondsCheck(false));
  CLI::Option* token =
      app.add_option("--token", flags.token, "Admin bearer token (authorization: Bearer TOKEN)");
  app.add_option("--token-file", flags.token_file,
                 "The token from a file (trailing whitespace trimmed); else $KVCTL_TOKEN")
      ->check(CLI::ExistingFile)
      ->excludes(token);
  app.add_flag("--tls", flags.tls, "TLS with the system's root certificates");
  app.add_option("--ca", flags.ca, "TLS: trust these PEM root certificates (implies --tls)")
      ->check(CLI::ExistingFile);
  CLI::Option* cert =
      app.add_option("--cert", flags.cert, "Mutual TLS: client certificate chain (PEM)")
          ->check(CLI::ExistingFile);
  CLI::Option* key = app.add_option("--key", flags.key, "Mutual TLS: private key (PEM)")
                         ->check(CLI::ExistingFile);
  cert->needs(key);
  key->needs(cert);
  app.add_option("--server-name", flags.server_name, "TLS: expect this name in the certificate");

  // Each command's callback records what to run; it runs after the whole line has parsed.
  std::function<Output(Admin&)> action;

  CLI::App* status = app.add_subcommand("status", "Tiers, tenants, sessions and spilled sequences");
  status->callback([&] { action = Status; });

  CLI::App* list = app.add_subcommand("list", "List sessions, sequences, quotas or spilled copies");
  list->require_subcommand(1, 1);
  std::string tenant, session;
  CLI::App* list_sessions = list->add_subcommand("sessions", "One line per attached session");
  list_sessions->add_option("--tenant", tenant, "Only this tenant's");
  list_sessions->callback([&] { action = [&](Admin& a) { return ListSessions(a, tenant); }; });
  CLI::App* list_sequences = list->add_subcommand("sequences", "One line per sequence");
  list_sequences->add_option("--tenant", tenant, "Only this tenant's");
  list_sequences->add_option("--session", session, "Only this session's");
  list_sequences->callback(
      [&] { action = [&](Admin& a) { return ListSequences(a, tenant, session); }; });
  CLI::App* list_quotas = list->add_subcommand("quotas", "Tenants' quotas and usage");
  list_quotas->add_option("--tenant", tenant, "Only this tenant");
  list_quotas->callback([&] { action = [&](Admin& a) { return ListQuotas(a, tenant); }; });
  CLI::App* list_spilled = list->add_subcommand("spilled", "Spilled copies in the host and disk "
                                                           "tiers (ended sessions and lost ones too)");
  list_spilled->add_option("--tenant", tenant, "Only this tenant's");
  list_spilled->add_option("--session", session, "Only this session's");
  list_spilled->callback(
      [&] { action = [&](Admin& a) { return ListSpilled(a, tenant, session); }; });

  CLI::App* show = app.add_subcommand("show", "One session, sequence, or the configuration");
  show->require_subcommand(1, 1);
  std::string id;
  CLI::App* show_session = show->add_subcommand("session", "One session and its sequences");
  show_session->add_option("ID", id, "Session id")->required();
  show_session->callback([&] { action = [&](Admin& a) { return ShowSession(a, id); }; });
  CLI::App* show_sequence = show->add_subcommand("sequence", "One sequence");
  show_sequence->add_option("ID", id, "Sequence id")->required();
  show_sequence->add_option("--session", session, "The session (when the id is in several)");
  show_sequence->callback([&] { action = [&](Admin& a) { return ShowSequence(a, id, session); }; });
  show->add_subcommand("config", "As `config`")->callback([&] { action = Config; });

  CLI::App* set = app.add_subcommand("set", "Change defaults or a tenant's quota");
  set->require_subcommand(1, 1);
  BudgetArgs budget;
  CLI::App* set_budget = set->add_subcommand("budget", "Default budget (tokens per layer)");
  set_budget->add_option("N", budget.tokens,
                         "Tokens each layer of new sequences keeps (>= 1), or none: unbounded")
      ->required();
  set_budget->add_flag("--strict", budget.strict, "Strict budget (evicts during prefill)");
  set_budget->add_option("--prefill-block", budget.prefill_block,
                         "Strict budget: prefill block in tokens")
      ->check(CountCheck(1));
  set_budget->add_option("--per-layer", budget.per_layer, "N1,N2,...: tokens of each layer");
  set_budget->add_option("--rebudget-tenant", budget.rebudget_tenant,
                         "Also compress this tenant's sequences to the new budget");
  set_budget->callback([&] { action = [&](Admin& a) { return SetBudget(a, budget); }; });
  PolicyArgs policy;
  CLI::App* set_policy = set->add_subcommand("policy", "Default policy of new sequences");
  set_policy->add_option("NAME", policy.name, "Policy name")->required();
  set_policy->add_option("--spec", policy.spec, "PolicySpec in proto JSON (params of NAME)");
  set_policy->add_option("--rebudget-tenant", policy.rebudget_tenant,
                         "Also re-budget this tenant's sequences");
  set_policy->callback([&] { action = [&](Admin& a) { return SetPolicy(a, policy); }; });
  QuotaArgs quota;
  CLI::App* set_quota = set->add_subcommand("quota", "Replace a tenant's quota");
  set_quota->add_option("TENANT", quota.tenant, "Tenant")->required();
  set_quota->add_option("--arena", quota.arena, "Arena bytes (SIZE; 0 = unlimited)");
  set_quota->add_option("--host", quota.host, "Host-tier bytes (SIZE; 0 = unlimited)");
  set_quota->add_option("--disk", quota.disk, "Disk-tier bytes (SIZE; 0 = unlimited)");
  set_quota->add_option("--sequences", quota.sequences, "Sequences (0 = unlimited)")
      ->check(CountCheck(0));
  CLI::Option* rebudget = set_quota->add_flag(
      "--rebudget", quota.rebudget, "Allow a quota below current use by compressing sequences");
  set_quota->add_option("--rebudget-tokens", quota.rebudget_tokens,
                        "Tokens per layer to compress to (default: the default budget)")
      ->check(CountCheck(1))
      ->needs(rebudget);
  set_quota->callback([&] { action = [&](Admin& a) { return SetQuota(a, quota); }; });

  bool wait = false;
  double wait_timeout = 300;
  CLI::App* drain = app.add_subcommand("drain", "Stop accepting attaches");
  drain->add_flag("--wait", wait, "Poll until no session is left");
  drain->add_option("--wait-timeout", wait_timeout, "Give up after SECONDS (default 300)")
      ->check(SecondsCheck(false));
  std::string drain_to = "none";
  double drain_grace = 0;
  drain->add_option("--to", drain_to,
                    "Also move every live sequence to this tier: disk, remote or none (default)")
      ->check(CLI::IsMember({"disk", "remote", "none"}));
  drain->add_option("--grace", drain_grace,
                    "SECONDS the moves may take (default: the sidecar's --drain_grace)")
      ->check(SecondsCheck(true));
  drain->callback([&] {
    action = [&](Admin& a) { return Drain(a, wait, wait_timeout, drain_to, drain_grace); };
  });

  CLI::App* release = app.add_subcommand("release", "Force-release a session or a sequence");
  release->require_subcommand(1, 1);
  CLI::App* release_session = release->add_subcommand("session", "A session and its sequences");
  release_session->add_option("ID", id, "Session id")->required();
  release_session->callback([&] { action = [&](Admin& a) { return Release(a, id, ""); }; });
  CLI::App* release_sequence = release->add_subcommand("sequence", "One sequence");
  release_sequence->add_option("ID", id, "Sequence id")->required();
  release_sequence->add_option("--session", session, "The session that holds it")->required();
  release_sequence->callback([&] { action = [&](Admin& a) { return Release(a, session, id); }; });

  app.add_subcommand("config", "The effective configuration (YAML; secrets redacted)")
      ->callback([&] { action = Config; });
  std::string service;
  CLI::App* health = app.add_subcommand("health", "gRPC health check; exit 0 if SERVING");
  health->add_option("--service", service, "Service name (default: the server)");
  health->callback([&] { action = [&](Admin& a) { return Health(a, service); }; });
  bool help_command = false;
  std::vector<std::string> help_topic;
  CLI::App* help = app.add_subcommand("help", "Print this text, or the flags of COMMAND");
  help->add_option("COMMAND", help_topic, "A command (e.g. `set budget`)");
  help->callback([&] { help_command = true; });
  // After the subcommands: they copy their parent's footer when made, and `COMMAND --help` shows
  // only that command.
  app.footer(kFooter);

  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& success) {  // --help, --version
    return app.exit(success);
  } catch (const CLI::ParseError& error) {
    std::cerr << "kvctl: " << UsageText(app, error) << "\n(kvctl --help for usage)\n";
    return kExitUsage;
  }
  if (help_command) return PrintHelp(app, help_topic);
  try {
    Admin admin(flags);
    const Output output = action(admin);
    std::cout << (flags.json ? output.json + "\n" : output.text);
    return kExitOk;
  } catch (const UsageError& error) {
    std::cerr << "kvctl: " << error.message() << "\n(kvctl --help for usage)\n";
    return kExitUsage;
  } catch (const Failure& error) {
    std::cerr << "kvctl: " << error.code << ": " << error.message << "\n";
    if (flags.json) {
      doc::ErrorDocument document;
      document.mutable_error()->set_code(error.code);
      document.mutable_error()->set_exit_code(error.exit_code);
      document.mutable_error()->set_message(error.message);
      std::cout << ToJson(document) << "\n";
    }
    return error.exit_code;
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int code = Run(argc, argv);
  // One command per process: leave without running static destructors or atexit handlers.
  // After a refused TLS handshake gRPC's and OpenSSL's threads may still be tearing the
  // connection down, and racing them at exit crashed kvctl under AddressSanitizer (exit code
  // lost) and left OpenSSL's allocations to LeakSanitizer.
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  std::_Exit(code);
}
