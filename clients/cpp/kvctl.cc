// kvctl: the operator's command line for the kvsidecar Admin service (status, list, show, set,
// drain, release, config, health). Talks to the generated Admin stub directly so that it controls
// the channel credentials (TLS, mutual TLS) and the per-call metadata (bearer token).
//
// Output: a readable table or text by default; with --json exactly one JSON document on stdout
// whose keys are stable (the proto field names of admin.proto, snake_case; every field present,
// also when zero; 64-bit integers as strings as in the proto3 JSON mapping).
//
// Exit codes (scripts rely on them; keep in sync with kUsage and deploy/README.md):
//   0  success
//   1  the server answered with an error (the gRPC code and message are printed), or a condition
//      the command checks was not met (health not SERVING, drain --wait timed out, no such
//      session or sequence)
//   2  usage error (unknown command or flag, missing or malformed argument, unreadable file)
//   3  cannot connect to the server within --connect-timeout
//
// Single-threaded; one process per command.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <variant>
#include <vector>

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
#include "kvsidecar/v1/admin.grpc.pb.h"
#include "kvsidecar/v1/common.pb.h"

namespace {

namespace v1 = kvsidecar::v1;

enum ExitCode : int {
  kExitOk = 0,
  kExitServerError = 1,
  kExitUsage = 2,
  kExitCannotConnect = 3,
};

constexpr char kUsage[] = R"(kvctl: operate a kvsidecar through its Admin service.

Usage: kvctl [global flags] COMMAND [ARGS] [flags]

Commands:
  status                          tiers, tenants and sessions as tables
  list sessions [--tenant=T]      one line per attached session
  list sequences [--tenant=T] [--session=S]
                                  one line per sequence
  list quotas [--tenant=T]        tenants with a quota or sessions: quota and usage
  list spilled [--tenant=T] [--session=S]
                                  spilled copies in the host and disk tiers, those of ended
                                  sessions and earlier runs (ATTACHED no) and lost ones included
  show session ID                 one session and its sequences
  show sequence ID [--session=S]  one sequence (--session when the id is used in several sessions)
  set budget N [--strict] [--prefill-block=N] [--per-layer=N1,N2,...] [--rebudget-tenant=T]
                                  default token budget (tokens per layer) of new sequences;
                                  --rebudget-tenant also compresses that tenant's sequences to it
  set policy NAME [--spec=JSON] [--rebudget-tenant=T]
                                  default policy of new sequences (streaming_llm, keydiff, h2o,
                                  tova, snapkv, cake, d2o, caote, omnikv); --spec is a PolicySpec
                                  in proto JSON for its parameters, e.g. '{"h2o":{"n_recent":64}}'
  set quota TENANT [--arena=SIZE] [--host=SIZE] [--disk=SIZE] [--sequences=N]
                 [--rebudget [--rebudget-tokens=N]]
                                  replaces the tenant's quota (an omitted limit = 0 = unlimited;
                                  all omitted removes the quota); SIZE is bytes with an optional
                                  K, M, G or T suffix (binary); --rebudget allows a quota below
                                  current use by compressing the tenant's sequences to N tokens
                                  per layer (default: the default budget)
  drain [--wait] [--wait-timeout=SECONDS]
                                  stop accepting attaches; --wait polls until no session is left
  release session ID              force-release a session and all its sequences
  release sequence ID --session=S force-release one sequence
  config                          the effective configuration (YAML; secrets redacted; also
                                  `show config`)
  health [--service=NAME]         gRPC health check (grpc.health.v1) of --admin; exit 0 if SERVING
  help                            this text

Global flags (anywhere on the line, --flag=value or --flag value):
  --admin=HOST:PORT        Admin address (default 127.0.0.1:50052, or $KVCTL_ADMIN)
  --json                   machine-readable output: one JSON document on stdout with stable keys
                           (admin.proto field names; 64-bit integers as strings)
  --timeout=SECONDS        deadline of each call (default 30)
  --connect-timeout=SECONDS  how long to wait for the connection (default 5)
  --token=TOKEN            admin bearer token, sent as "authorization: Bearer TOKEN"
  --token-file=PATH        the token from a file (trailing whitespace trimmed), or $KVCTL_TOKEN
  --tls                    TLS with the system's root certificates
  --ca=PATH                TLS: trust these PEM root certificates (implies --tls)
  --cert=PATH --key=PATH   mutual TLS: this client certificate chain and private key (PEM)
  --server-name=NAME       TLS: expect this name in the server certificate

Exit codes:
  0  success
  1  server error (gRPC code and message printed; with --json also {"error":{...}} on stdout),
     or a checked condition failed (not SERVING, drain --wait timed out, no such session/sequence)
  2  usage error
  3  cannot connect to the server
)";

// ---------------------------------------------------------------------------------------------
// Command line

class UsageError {
 public:
  explicit UsageError(std::string message) : message_(std::move(message)) {}
  const std::string& message() const { return message_; }

 private:
  std::string message_;
};

// Flags that take no value; every other flag needs one.
const std::set<std::string>& BoolFlags() {
  static const auto* flags =
      new std::set<std::string>{"json", "tls", "help", "strict", "rebudget", "wait"};
  return *flags;
}
const std::set<std::string>& GlobalFlags() {
  static const auto* flags = new std::set<std::string>{
      "admin", "json", "timeout", "connect-timeout", "token", "token-file", "tls",
      "ca",    "cert", "key",     "server-name",     "help"};
  return *flags;
}
const std::set<std::string>& AllFlags() {
  static const auto* flags = [] {
    auto* all = new std::set<std::string>(GlobalFlags());
    for (const char* name : {"tenant", "session", "strict", "prefill-block", "per-layer",
                             "rebudget-tenant", "spec", "arena", "host", "disk", "sequences",
                             "rebudget", "rebudget-tokens", "wait", "wait-timeout", "service"}) {
      all->insert(name);
    }
    return all;
  }();
  return *flags;
}

struct CommandLine {
  std::map<std::string, std::string> flags;
  std::vector<std::string> args;  // positional: command, subcommand, ids

  bool Has(const std::string& name) const { return flags.count(name) > 0; }
  std::string Get(const std::string& name, const std::string& fallback = "") const {
    auto it = flags.find(name);
    return it == flags.end() ? fallback : it->second;
  }
  bool Bool(const std::string& name) const {
    auto it = flags.find(name);
    return it != flags.end() && it->second != "false" && it->second != "0";
  }
};

CommandLine Parse(int argc, char** argv) {
  CommandLine line;
  bool only_positional = false;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (only_positional || arg.size() < 2 || arg[0] != '-') {
      line.args.push_back(arg);
      continue;
    }
    if (arg == "--") {
      only_positional = true;
      continue;
    }
    if (arg == "-h") arg = "--help";
    if (arg.rfind("--", 0) != 0) throw UsageError(absl::StrCat("unknown flag ", arg));
    std::string name = arg.substr(2);
    std::optional<std::string> value;
    if (const size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    std::replace(name.begin(), name.end(), '_', '-');
    if (AllFlags().count(name) == 0) throw UsageError(absl::StrCat("unknown flag --", name));
    if (!value.has_value()) {
      if (BoolFlags().count(name) > 0) {
        value = "true";
      } else if (i + 1 < argc) {
        value = argv[++i];
      } else {
        throw UsageError(absl::StrCat("flag --", name, " needs a value"));
      }
    } else if (BoolFlags().count(name) > 0 && *value != "true" && *value != "false" &&
               *value != "1" && *value != "0") {
      throw UsageError(absl::StrCat("flag --", name, " takes no value (or true/false)"));
    }
    line.flags[name] = *value;
  }
  return line;
}

// The command's own flags; anything else that is not global is a usage error.
void AllowFlags(const CommandLine& line, const std::string& command,
                std::initializer_list<const char*> allowed) {
  std::set<std::string> ok(GlobalFlags());
  for (const char* name : allowed) ok.insert(name);
  for (const auto& [name, value] : line.flags) {
    if (ok.count(name) == 0) {
      throw UsageError(absl::StrCat("flag --", name, " does not apply to '", command, "'"));
    }
  }
}

void ExpectArgs(const CommandLine& line, size_t count, const std::string& form) {
  if (line.args.size() != count) {
    throw UsageError(absl::StrCat(line.args.size() < count ? "missing argument" : "extra argument",
                                  ": usage: kvctl ", form));
  }
}

int64_t ParseInt(const std::string& text, const std::string& what, int64_t min, int64_t max) {
  int64_t value = 0;
  if (!absl::SimpleAtoi(text, &value) || value < min || value > max) {
    throw UsageError(
        absl::StrCat(what, " must be an integer in [", min, ", ", max, "], got '", text, "'"));
  }
  return value;
}

double ParseSeconds(const std::string& text, const std::string& what) {
  double value = 0;
  if (!absl::SimpleAtod(text, &value) || !(value > 0) || value > 86400 * 365) {
    throw UsageError(absl::StrCat(what, " must be a positive number of seconds, got '", text, "'"));
  }
  return value;
}

// "1073741824", "512M", "4Gi", "1.5G" (binary units).
uint64_t ParseSize(const std::string& text, const std::string& what) {
  std::string number = absl::AsciiStrToUpper(text);
  uint64_t unit = 1;
  if (absl::EndsWith(number, "IB")) {
    number.resize(number.size() - 2);
  } else if (absl::EndsWith(number, "I") || absl::EndsWith(number, "B")) {
    number.resize(number.size() - 1);
  }
  if (!number.empty()) {
    switch (number.back()) {
      case 'K':
        unit = 1ull << 10;
        break;
      case 'M':
        unit = 1ull << 20;
        break;
      case 'G':
        unit = 1ull << 30;
        break;
      case 'T':
        unit = 1ull << 40;
        break;
      default:
        break;
    }
    if (unit != 1) number.pop_back();
  }
  double value = 0;
  if (number.empty() || !absl::SimpleAtod(number, &value) || value < 0 ||
      value * static_cast<double>(unit) >= 1.8e19) {
    throw UsageError(
        absl::StrCat(what, " must be a byte size like 1073741824, 512M or 4G, got '", text, "'"));
  }
  return static_cast<uint64_t>(value * static_cast<double>(unit));
}

std::string ReadFileOrThrow(const std::string& path, const std::string& flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError(absl::StrCat("cannot read --", flag, " file '", path, "'"));
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// ---------------------------------------------------------------------------------------------
// Output helpers

const char* CodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::UNKNOWN:
      return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      return "UNKNOWN";
  }
}

std::string JsonString(absl::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += absl::StrFormat("\\u%04x", static_cast<int>(static_cast<unsigned char>(c)));
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
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

// Builds one JSON object from pre-rendered values, keys in insertion order.
class JsonObject {
 public:
  JsonObject& Raw(absl::string_view key, absl::string_view json) {
    parts_.push_back(absl::StrCat(JsonString(key), ":", json));
    return *this;
  }
  JsonObject& Str(absl::string_view key, absl::string_view value) {
    return Raw(key, JsonString(value));
  }
  JsonObject& Int(absl::string_view key, int64_t value) { return Raw(key, absl::StrCat(value)); }
  // 64-bit values as strings, as the proto3 JSON mapping does for the proto messages.
  JsonObject& Int64(absl::string_view key, uint64_t value) {
    return Raw(key, absl::StrCat("\"", value, "\""));
  }
  JsonObject& Bool(absl::string_view key, bool value) { return Raw(key, value ? "true" : "false"); }
  JsonObject& Msg(absl::string_view key, const google::protobuf::Message& message) {
    return Raw(key, ToJson(message));
  }
  std::string Render() const { return absl::StrCat("{", absl::StrJoin(parts_, ","), "}"); }

 private:
  std::vector<std::string> parts_;
};

std::string JsonArray(const std::vector<std::string>& items) {
  return absl::StrCat("[", absl::StrJoin(items, ","), "]");
}

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
// Connection and calls

// A command that failed; `exit_code` is what kvctl exits with.
struct Failure {
  int exit_code;
  std::string code;  // gRPC code name
  std::string message;
};

class Admin {
 public:
  explicit Admin(const CommandLine& line) : json_(line.Bool("json")) {
    target_ = line.Get("admin", getenv("KVCTL_ADMIN") != nullptr && getenv("KVCTL_ADMIN")[0]
                                    ? getenv("KVCTL_ADMIN")
                                    : "127.0.0.1:50052");
    if (target_.empty()) throw UsageError("--admin must not be empty");
    timeout_ = ParseSeconds(line.Get("timeout", "30"), "--timeout");
    connect_timeout_ = ParseSeconds(line.Get("connect-timeout", "5"), "--connect-timeout");
    if (line.Has("token") && line.Has("token-file")) {
      throw UsageError("give --token or --token-file, not both");
    }
    if (line.Has("token")) {
      token_ = line.Get("token");
    } else if (line.Has("token-file")) {
      token_ = std::string(absl::StripTrailingAsciiWhitespace(
          ReadFileOrThrow(line.Get("token-file"), "token-file")));
    } else if (const char* env = getenv("KVCTL_TOKEN"); env != nullptr) {
      token_ = env;
    }
    if (line.Has("token") && token_.empty()) throw UsageError("--token must not be empty");

    const bool tls = line.Bool("tls") || line.Has("ca") || line.Has("cert") || line.Has("key");
    if (line.Has("cert") != line.Has("key")) {
      throw UsageError("mutual TLS needs both --cert and --key");
    }
    if (line.Has("server-name") && !tls) {
      throw UsageError("--server-name needs TLS (--tls or --ca)");
    }
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    std::shared_ptr<grpc::ChannelCredentials> credentials;
    if (tls) {
      grpc::SslCredentialsOptions ssl;
      if (line.Has("ca")) ssl.pem_root_certs = ReadFileOrThrow(line.Get("ca"), "ca");
      if (line.Has("cert")) {
        ssl.pem_cert_chain = ReadFileOrThrow(line.Get("cert"), "cert");
        ssl.pem_private_key = ReadFileOrThrow(line.Get("key"), "key");
      }
      credentials = grpc::SslCredentials(ssl);
      if (line.Has("server-name")) args.SetSslTargetNameOverride(line.Get("server-name"));
    } else {
      credentials = grpc::InsecureChannelCredentials();
    }
    channel_ = grpc::CreateCustomChannel(target_, credentials, args);
    stub_ = v1::Admin::NewStub(channel_);
  }

  bool json() const { return json_; }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }

  // Waits up to --connect-timeout for the channel, once, before the first call; if it does not
  // become ready, that and every later call fail at once with exit code 3. Lazy, so that a
  // command's usage errors (checked before its first call) never wait for a connection.
  const std::optional<Failure>& Connect() {
    if (connected_) return unreachable_;
    connected_ = true;
    const auto deadline = std::chrono::system_clock::now() +
                          std::chrono::milliseconds(static_cast<int64_t>(connect_timeout_ * 1000));
    if (channel_->WaitForConnected(deadline)) return unreachable_;
    unreachable_ = Failure{kExitCannotConnect, "UNAVAILABLE",
                           absl::StrFormat("cannot connect to %s within %gs (is the server "
                                           "running, and are the TLS settings right?)",
                                           target_, connect_timeout_)};
    return unreachable_;
  }

  void Prepare(grpc::ClientContext* context) const {
    context->set_deadline(std::chrono::system_clock::now() +
                          std::chrono::milliseconds(static_cast<int64_t>(timeout_ * 1000)));
    if (!token_.empty()) context->AddMetadata("authorization", absl::StrCat("Bearer ", token_));
  }

  // One unary Admin call; a failure carries the server's code and message.
  template <typename Request, typename Response>
  std::optional<Failure> Call(grpc::Status (v1::Admin::Stub::*method)(grpc::ClientContext*,
                                                                      const Request&, Response*),
                              const Request& request, Response* response) {
    if (Connect().has_value()) return unreachable_;
    grpc::ClientContext context;
    Prepare(&context);
    const grpc::Status status = (stub_.get()->*method)(&context, request, response);
    if (status.ok()) return std::nullopt;
    return Failure{kExitServerError, CodeName(status.error_code()), status.error_message()};
  }

 private:
  bool json_;
  std::string target_;
  double timeout_ = 30;
  double connect_timeout_ = 5;
  std::string token_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Admin::Stub> stub_;
  bool connected_ = false;  // Connect() has run
  std::optional<Failure> unreachable_;
};

#define KVCTL_CALL(admin, method, request, response)                                  \
  do {                                                                                \
    if (auto failure = (admin).Call(&v1::Admin::Stub::method, (request), (response)); \
        failure.has_value()) {                                                        \
      return *failure;                                                                \
    }                                                                                 \
  } while (0)

// What a command prints: `text` for people, `json` for --json.
struct Output {
  std::string text;
  std::string json;
};

using Result = std::variant<Output, Failure>;

// ---------------------------------------------------------------------------------------------
// Commands

void SessionRow(const v1::SessionInfo& s, Table* table) {
  table->Add({s.session_id(), s.tenant(), s.worker_name().empty() ? "-" : s.worker_name(),
              absl::StrCat(s.num_blocks() - s.free_blocks(), "/", s.num_blocks()),
              absl::StrCat(s.sequences()), Age(s.attached_unix_ms()),
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

Result Status(const CommandLine& line, Admin& admin) {
  AllowFlags(line, "status", {});
  ExpectArgs(line, 1, "status");
  v1::GetStatsResponse stats;
  KVCTL_CALL(admin, GetStats, v1::GetStatsRequest(), &stats);
  v1::GetConfigResponse config;
  KVCTL_CALL(admin, GetConfig, v1::GetConfigRequest(), &config);
  v1::ListSessionsResponse sessions;
  KVCTL_CALL(admin, ListSessions, v1::ListSessionsRequest(), &sessions);
  v1::ListSequencesResponse sequences;
  KVCTL_CALL(admin, ListSequences, v1::ListSequencesRequest(), &sequences);

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
  absl::StrAppend(&t, "sessions: ", stats.sessions(), "   sequences: ", stats.sequences(),
                  "   reclaimed: ", stats.sessions_reclaimed(),
                  "   arena reserved: ", HumanBytes(stats.arena_bytes_reserved()), "\n");
  absl::StrAppend(&t, "tokens: kept ", stats.tokens_kept(), ", appended ", stats.tokens_appended(),
                  ", evicted ", stats.tokens_evicted(), ", merged ", stats.tokens_merged(),
                  "\n\nTIERS\n");
  Table tiers({"TIER", "USED", "CAPACITY", "USE%"});
  const auto capacity = [](uint64_t bytes) {
    return bytes == 0 ? std::string("-") : HumanBytes(bytes);
  };
  const auto percent = [](uint64_t used, uint64_t capacity) {
    return capacity == 0 ? std::string("-")
                         : absl::StrFormat("%.1f%%", 100.0 * static_cast<double>(used) /
                                                         static_cast<double>(capacity));
  };
  tiers.Add({"arena", HumanBytes(stats.arena_bytes_used()),
             HumanBytes(stats.arena_bytes_capacity()),
             percent(stats.arena_bytes_used(), stats.arena_bytes_capacity())});
  tiers.Add({"host", HumanBytes(stats.host_bytes_used()), capacity(stats.host_bytes_capacity()),
             percent(stats.host_bytes_used(), stats.host_bytes_capacity())});
  tiers.Add({"disk", HumanBytes(stats.disk_bytes_used()), capacity(stats.disk_bytes_capacity()),
             percent(stats.disk_bytes_used(), stats.disk_bytes_capacity())});
  absl::StrAppend(&t, tiers.Render(), "\nTENANTS\n");
  Table tenant_table = TenantTable();
  for (const auto& [name, tenant] : tenants) TenantRow(tenant, &tenant_table);
  absl::StrAppend(&t, tenant_table.Render(), "\nSESSIONS\n");
  Table session_table = SessionTable();
  for (const auto& s : sessions.sessions()) SessionRow(s, &session_table);
  absl::StrAppend(&t, session_table.Render());

  std::vector<std::string> tier_json = {JsonObject()
                                            .Str("tier", "arena")
                                            .Int64("used_bytes", stats.arena_bytes_used())
                                            .Int64("capacity_bytes", stats.arena_bytes_capacity())
                                            .Render(),
                                        JsonObject()
                                            .Str("tier", "host")
                                            .Int64("used_bytes", stats.host_bytes_used())
                                            .Int64("capacity_bytes", stats.host_bytes_capacity())
                                            .Render(),
                                        JsonObject()
                                            .Str("tier", "disk")
                                            .Int64("used_bytes", stats.disk_bytes_used())
                                            .Int64("capacity_bytes", stats.disk_bytes_capacity())
                                            .Render()};
  std::vector<std::string> tenant_json;
  for (const auto& [name, tenant] : tenants) tenant_json.push_back(ToJson(tenant));
  std::vector<std::string> session_json;
  for (const auto& s : sessions.sessions()) session_json.push_back(ToJson(s));
  out.json = JsonObject()
                 .Msg("stats", stats)
                 .Str("backend", config.backend())
                 .Str("backend_reason", config.backend_reason())
                 .Msg("default_policy", config.default_policy())
                 .Msg("default_budget", config.default_budget())
                 .Raw("tiers", JsonArray(tier_json))
                 .Raw("tenants", JsonArray(tenant_json))
                 .Raw("sessions", JsonArray(session_json))
                 .Render();
  return out;
}

Result List(const CommandLine& line, Admin& admin) {
  if (line.args.size() < 2) {
    throw UsageError("usage: kvctl list sessions|sequences|quotas|spilled");
  }
  Output out;
  if (line.args[1] == "sessions") {
    AllowFlags(line, "list sessions", {"tenant"});
    ExpectArgs(line, 2, "list sessions [--tenant=T]");
    v1::ListSessionsRequest request;
    request.set_tenant(line.Get("tenant"));
    v1::ListSessionsResponse response;
    KVCTL_CALL(admin, ListSessions, request, &response);
    Table table = SessionTable();
    for (const auto& s : response.sessions()) SessionRow(s, &table);
    out.text = table.Render();
    out.json = ToJson(response);
    return out;
  }
  if (line.args[1] == "sequences") {
    AllowFlags(line, "list sequences", {"tenant", "session"});
    ExpectArgs(line, 2, "list sequences [--tenant=T] [--session=S]");
    v1::ListSequencesRequest request;
    request.set_tenant(line.Get("tenant"));
    request.set_session_id(line.Get("session"));
    v1::ListSequencesResponse response;
    KVCTL_CALL(admin, ListSequences, request, &response);
    Table table = SequenceTable();
    for (const auto& s : response.sequences()) SequenceRow(s, &table);
    out.text = table.Render();
    out.json = ToJson(response);
    return out;
  }
  if (line.args[1] == "quotas") {
    AllowFlags(line, "list quotas", {"tenant"});
    ExpectArgs(line, 2, "list quotas [--tenant=T]");
    v1::GetQuotasRequest request;
    request.set_tenant(line.Get("tenant"));
    v1::GetQuotasResponse response;
    KVCTL_CALL(admin, GetQuotas, request, &response);
    Table table = TenantTable();
    for (const auto& tenant : response.tenants()) TenantRow(tenant, &table);
    out.text = table.Render();
    out.json = ToJson(response);
    return out;
  }
  if (line.args[1] == "spilled") {
    AllowFlags(line, "list spilled", {"tenant", "session"});
    ExpectArgs(line, 2, "list spilled [--tenant=T] [--session=S]");
    v1::ListSpilledRequest request;
    request.set_tenant(line.Get("tenant"));
    request.set_session_id(line.Get("session"));
    v1::ListSpilledResponse response;
    KVCTL_CALL(admin, ListSpilled, request, &response);
    Table table({"SESSION", "SEQUENCE", "TENANT", "TIER", "BYTES", "SPILLED", "ATTACHED", "LOST"});
    for (const v1::SpilledCopy& copy : response.copies()) {
      table.Add({copy.session_id(), copy.sequence_id(), copy.tenant(), TierName(copy.tier()),
                 HumanBytes(copy.bytes()), Age(copy.spilled_unix_ms()),
                 copy.session_attached() ? "yes" : "no", copy.lost().empty() ? "-" : copy.lost()});
    }
    out.text = table.Render();
    out.json = ToJson(response);
    return out;
  }
  throw UsageError(
      absl::StrCat("cannot list '", line.args[1], "': use sessions, sequences, quotas or spilled"));
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

Result Config(const CommandLine& line, Admin& admin);

Result Show(const CommandLine& line, Admin& admin) {
  if (line.args.size() < 2) throw UsageError("usage: kvctl show session|sequence ID");
  if (line.args[1] == "config") {  // alias of `kvctl config`
    CommandLine rest = line;
    rest.args.erase(rest.args.begin());
    return Config(rest, admin);
  }
  Output out;
  if (line.args[1] == "session") {
    AllowFlags(line, "show session", {});
    ExpectArgs(line, 3, "show session ID");
    const std::string& id = line.args[2];
    v1::ListSessionsResponse sessions;
    KVCTL_CALL(admin, ListSessions, v1::ListSessionsRequest(), &sessions);
    const v1::SessionInfo* found = nullptr;
    for (const auto& s : sessions.sessions()) {
      if (s.session_id() == id) found = &s;
    }
    if (found == nullptr) {
      return Failure{kExitServerError, "NOT_FOUND", absl::StrCat("no session '", id, "'")};
    }
    v1::ListSequencesRequest request;
    request.set_session_id(id);
    v1::ListSequencesResponse sequences;
    KVCTL_CALL(admin, ListSequences, request, &sequences);
    const auto& s = *found;
    const v1::ModelLayout& layout = s.layout();
    absl::StrAppend(&out.text, "session:    ", s.session_id(), "\ntenant:     ", s.tenant(),
                    "\nworker:     ", s.worker_name().empty() ? "-" : s.worker_name(),
                    "\nlayout:     ", layout.num_layers(), " layers, ", layout.num_kv_heads(),
                    " kv heads, ", layout.num_q_heads(), " q heads, head_dim ", layout.head_dim(),
                    ", ", v1::DType_Name(layout.dtype()), ", ", layout.block_tokens(),
                    " tokens/block", "\nblocks:     ", s.num_blocks() - s.free_blocks(),
                    " used of ", s.num_blocks(), "\nattached:   ", Age(s.attached_unix_ms()),
                    " ago\nheartbeat:  ", Age(s.last_heartbeat_unix_ms()),
                    " ago\nlease:      expires in ", Until(s.lease_expires_unix_ms()),
                    "\n\nSEQUENCES\n");
    Table table = SequenceTable();
    for (const auto& q : sequences.sequences()) SequenceRow(q, &table);
    absl::StrAppend(&out.text, table.Render());
    std::vector<std::string> items;
    for (const auto& q : sequences.sequences()) items.push_back(ToJson(q));
    out.json = JsonObject().Msg("session", s).Raw("sequences", JsonArray(items)).Render();
    return out;
  }
  if (line.args[1] == "sequence") {
    AllowFlags(line, "show sequence", {"session"});
    ExpectArgs(line, 3, "show sequence ID [--session=S]");
    const std::string& id = line.args[2];
    v1::ListSequencesRequest request;
    request.set_session_id(line.Get("session"));
    v1::ListSequencesResponse sequences;
    KVCTL_CALL(admin, ListSequences, request, &sequences);
    std::vector<const v1::SequenceInfo*> found;
    for (const auto& q : sequences.sequences()) {
      if (q.sequence_id() == id) found.push_back(&q);
    }
    if (found.empty()) {
      return Failure{
          kExitServerError, "NOT_FOUND",
          absl::StrCat(
              "no sequence '", id, "'",
              line.Has("session") ? absl::StrCat(" in session '", line.Get("session"), "'") : "")};
    }
    if (found.size() > 1) {
      std::vector<std::string> where;
      for (const auto* q : found) where.push_back(q->session_id());
      throw UsageError(absl::StrCat("sequence '", id, "' exists in sessions ",
                                    absl::StrJoin(where, ", "), ": add --session=S"));
    }
    out.text = SequenceDetail(*found[0]);
    out.json = JsonObject().Msg("sequence", *found[0]).Render();
    return out;
  }
  throw UsageError(absl::StrCat("cannot show '", line.args[1], "': use session or sequence"));
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

Result Set(const CommandLine& line, Admin& admin) {
  if (line.args.size() < 2) throw UsageError("usage: kvctl set budget|policy|quota ...");
  const std::string& what = line.args[1];
  if (what == "budget") {
    AllowFlags(line, "set budget", {"strict", "prefill-block", "per-layer", "rebudget-tenant"});
    ExpectArgs(line, 3, "set budget N [--strict] [--prefill-block=N] [--per-layer=...]");
    v1::SetDefaultsRequest request;
    v1::Budget* budget = request.mutable_default_budget();
    // Zero and negative budgets go to the server, which refuses them with its reason.
    budget->set_tokens_per_layer(
        static_cast<int32_t>(ParseInt(line.args[2], "the budget N", INT32_MIN, INT32_MAX)));
    budget->set_strict(line.Bool("strict"));
    if (line.Has("prefill-block")) {
      budget->set_prefill_block_tokens(static_cast<int32_t>(
          ParseInt(line.Get("prefill-block"), "--prefill-block", 1, INT32_MAX)));
    }
    if (line.Has("per-layer")) {
      for (absl::string_view part : absl::StrSplit(line.Get("per-layer"), ',')) {
        budget->add_per_layer_tokens(static_cast<int32_t>(ParseInt(
            std::string(absl::StripAsciiWhitespace(part)), "--per-layer entries", 0, INT32_MAX)));
      }
    }
    request.set_rebudget_tenant(line.Get("rebudget-tenant"));
    v1::SetDefaultsResponse response;
    KVCTL_CALL(admin, SetDefaults, request, &response);
    return DefaultsOutput(response, request.rebudget_tenant());
  }
  if (what == "policy") {
    AllowFlags(line, "set policy", {"spec", "rebudget-tenant"});
    ExpectArgs(line, 3, "set policy NAME [--spec=JSON] [--rebudget-tenant=T]");
    v1::SetDefaultsRequest request;
    v1::PolicySpec* policy = request.mutable_default_policy();
    if (line.Has("spec")) {
      google::protobuf::util::JsonParseOptions options;
      options.ignore_unknown_fields = false;
      const auto parsed =
          google::protobuf::util::JsonStringToMessage(line.Get("spec"), policy, options);
      if (!parsed.ok()) {
        throw UsageError(absl::StrCat("--spec is not a PolicySpec in JSON: ", parsed.ToString()));
      }
    }
    policy->set_name(line.args[2]);
    request.set_rebudget_tenant(line.Get("rebudget-tenant"));
    v1::SetDefaultsResponse response;
    KVCTL_CALL(admin, SetDefaults, request, &response);
    return DefaultsOutput(response, request.rebudget_tenant());
  }
  if (what == "quota") {
    AllowFlags(line, "set quota",
               {"arena", "host", "disk", "sequences", "rebudget", "rebudget-tokens"});
    ExpectArgs(line, 3,
               "set quota TENANT [--arena=SIZE] [--host=SIZE] [--disk=SIZE] [--sequences=N]");
    v1::SetQuotaRequest request;
    request.set_tenant(line.args[2]);
    v1::Quota* quota = request.mutable_quota();
    if (line.Has("arena")) quota->set_arena_bytes(ParseSize(line.Get("arena"), "--arena"));
    if (line.Has("host")) quota->set_host_bytes(ParseSize(line.Get("host"), "--host"));
    if (line.Has("disk")) quota->set_disk_bytes(ParseSize(line.Get("disk"), "--disk"));
    if (line.Has("sequences")) {
      quota->set_sequences(
          static_cast<int32_t>(ParseInt(line.Get("sequences"), "--sequences", 0, INT32_MAX)));
    }
    request.set_rebudget(line.Bool("rebudget"));
    if (line.Has("rebudget-tokens")) {
      if (!request.rebudget()) throw UsageError("--rebudget-tokens needs --rebudget");
      request.set_rebudget_tokens_per_layer(static_cast<int32_t>(
          ParseInt(line.Get("rebudget-tokens"), "--rebudget-tokens", 1, INT32_MAX)));
    }
    v1::SetQuotaResponse response;
    KVCTL_CALL(admin, SetQuota, request, &response);
    const v1::Quota& q = response.quota();
    const auto limit = [](uint64_t bytes) {
      return bytes == 0 ? std::string("unlimited") : HumanBytes(bytes);
    };
    Output out;
    absl::StrAppend(
        &out.text, "quota of tenant ", request.tenant(), ": arena ", limit(q.arena_bytes()),
        ", host ", limit(q.host_bytes()), ", disk ", limit(q.disk_bytes()), ", sequences ",
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
    // The response's fields with the tenant in front: {"tenant":...,"quota":...,"usage":...}.
    out.json =
        absl::StrCat("{\"tenant\":", JsonString(request.tenant()), ",", ToJson(response).substr(1));
    return out;
  }
  throw UsageError(absl::StrCat("cannot set '", what, "': use budget, policy or quota"));
}

Result Drain(const CommandLine& line, Admin& admin) {
  AllowFlags(line, "drain", {"wait", "wait-timeout"});
  ExpectArgs(line, 1, "drain [--wait] [--wait-timeout=SECONDS]");
  const double wait_timeout = ParseSeconds(line.Get("wait-timeout", "300"), "--wait-timeout");
  v1::DrainResponse response;
  KVCTL_CALL(admin, Drain, v1::DrainRequest(), &response);
  if (line.Bool("wait") && !response.empty()) {
    const absl::Time deadline = absl::Now() + absl::Seconds(wait_timeout);
    while (!response.empty()) {
      if (absl::Now() >= deadline) {
        return Failure{kExitServerError, "DEADLINE_EXCEEDED",
                       absl::StrFormat("still %d session(s) attached after %gs of draining",
                                       response.sessions_remaining(), wait_timeout)};
      }
      absl::SleepFor(absl::Milliseconds(200));
      v1::GetStatsResponse stats;
      KVCTL_CALL(admin, GetStats, v1::GetStatsRequest(), &stats);
      response.set_sessions_remaining(stats.sessions());
      response.set_sequences_remaining(stats.sequences());
      response.set_empty(stats.sessions() == 0);
    }
  }
  Output out;
  out.text = response.empty() ? "draining: no session attached; safe to stop\n"
                              : absl::StrCat("draining: ", response.sessions_remaining(),
                                             " session(s) still attached\n");
  out.json = ToJson(response);
  return out;
}

Result Release(const CommandLine& line, Admin& admin) {
  if (line.args.size() < 2) throw UsageError("usage: kvctl release session|sequence ID");
  v1::ForceReleaseRequest request;
  if (line.args[1] == "session") {
    AllowFlags(line, "release session", {});
    ExpectArgs(line, 3, "release session ID");
    request.set_session_id(line.args[2]);
  } else if (line.args[1] == "sequence") {
    AllowFlags(line, "release sequence", {"session"});
    ExpectArgs(line, 3, "release sequence ID --session=S");
    if (!line.Has("session") || line.Get("session").empty()) {
      throw UsageError("release sequence needs --session=S (the session that holds it)");
    }
    request.set_session_id(line.Get("session"));
    request.set_sequence_id(line.args[2]);
  } else {
    throw UsageError(absl::StrCat("cannot release '", line.args[1], "': use session or sequence"));
  }
  v1::ForceReleaseResponse response;
  KVCTL_CALL(admin, ForceRelease, request, &response);
  Output out;
  out.text = absl::StrCat("released ", response.sequences_released(), " sequence(s), ",
                          response.blocks_released(), " block(s)\n");
  out.json = ToJson(response);
  return out;
}

Result Config(const CommandLine& line, Admin& admin) {
  AllowFlags(line, "config", {});
  ExpectArgs(line, 1, "config");
  v1::GetConfigResponse response;
  KVCTL_CALL(admin, GetConfig, v1::GetConfigRequest(), &response);
  Output out;
  out.text = response.effective_config_yaml();
  if (!out.text.empty() && out.text.back() != '\n') out.text += "\n";
  out.json = ToJson(response);
  return out;
}

// grpc.health.v1.Health/Check through the generic stub (the health proto's generated code is not
// part of Debian's gRPC): HealthCheckRequest{service=1}, HealthCheckResponse{status=1 (enum)}.
Result Health(const CommandLine& line, Admin& admin) {
  AllowFlags(line, "health", {"service"});
  ExpectArgs(line, 1, "health [--service=NAME]");
  const std::string service = line.Get("service");
  if (service.size() > 127) throw UsageError("--service is too long");
  std::string request;
  if (!service.empty()) {
    request.push_back(0x0a);
    request.push_back(static_cast<char>(service.size()));
    request += service;
  }
  if (admin.Connect().has_value()) return *admin.Connect();
  grpc::TemplatedGenericStub<grpc::ByteBuffer, grpc::ByteBuffer> stub(admin.channel());
  grpc::ClientContext context;
  admin.Prepare(&context);
  grpc::CompletionQueue cq;
  grpc::Slice slice(request);
  grpc::ByteBuffer request_buffer(&slice, 1);
  auto call = stub.PrepareUnaryCall(&context, "/grpc.health.v1.Health/Check", request_buffer, &cq);
  call->StartCall();
  grpc::ByteBuffer response;
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  cq.Next(&tag, &ok);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  if (!status.ok()) {
    return Failure{kExitServerError, CodeName(status.error_code()), status.error_message()};
  }
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (response.Dump(&slices).ok()) {
    for (const grpc::Slice& s : slices)
      bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  // The only field: tag 0x08 + a one-byte varint (0 UNKNOWN, 1 SERVING, 2 NOT_SERVING,
  // 3 SERVICE_UNKNOWN); an empty message is UNKNOWN.
  int value = 0;
  if (bytes.size() == 2 && bytes[0] == 0x08) value = static_cast<unsigned char>(bytes[1]);
  static const char* kNames[] = {"UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"};
  const std::string name = value >= 0 && value <= 3 ? kNames[value] : absl::StrCat(value);
  const std::string shown = service.empty() ? "(server)" : service;
  if (value != 1) {
    return Failure{kExitServerError, "UNAVAILABLE",
                   absl::StrCat("health of ", shown, " is ", name)};
  }
  Output out;
  out.text = absl::StrCat(shown, ": ", name, "\n");
  out.json = JsonObject().Str("service", service).Str("status", name).Render();
  return out;
}

int Run(int argc, char** argv) {
  CommandLine line;
  try {
    line = Parse(argc, argv);
  } catch (const UsageError& error) {
    std::cerr << "kvctl: " << error.message() << "\n(kvctl --help for usage)\n";
    return kExitUsage;
  }
  if (line.Bool("help") || (!line.args.empty() && line.args[0] == "help")) {
    std::cout << kUsage;
    return kExitOk;
  }
  const bool json = line.Bool("json");
  try {
    if (line.args.empty()) throw UsageError("no command given");
    using Command = Result (*)(const CommandLine&, Admin&);
    static const std::map<std::string, Command> kCommands = {
        {"status", Status}, {"list", List},       {"show", Show},     {"set", Set},
        {"drain", Drain},   {"release", Release}, {"config", Config}, {"health", Health}};
    const auto command = kCommands.find(line.args[0]);
    if (command == kCommands.end()) {
      throw UsageError(absl::StrCat("unknown command '", line.args[0], "'"));
    }
    Admin admin(line);
    Result result = command->second(line, admin);
    if (auto* output = std::get_if<Output>(&result)) {
      std::cout << (json ? output->json + "\n" : output->text);
      return kExitOk;
    }
    const Failure& error = std::get<Failure>(result);
    std::cerr << "kvctl: " << error.code << ": " << error.message << "\n";
    if (json) {
      std::cout << JsonObject()
                       .Raw("error", JsonObject()
                                         .Str("code", error.code)
                                         .Int("exit_code", error.exit_code)
                                         .Str("message", error.message)
                                         .Render())
                       .Render()
                << "\n";
    }
    return error.exit_code;
  } catch (const UsageError& error) {
    std::cerr << "kvctl: " << error.message() << "\n(kvctl --help for usage)\n";
    return kExitUsage;
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
