// End to end: the kvctl binary against the real kvsidecar binary on loopback. Every command runs as
// a child process; its --json output is parsed (strictly, into the admin.proto messages where the
// output is one) and compared with what the test did through the client library; table output is
// checked for the rows the test created; usage errors exit 2, an unreachable server exits 3,
// server errors exit 1 with the gRPC code.
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "kvsidecar/client.h"
#include "gpu/base/build_info.h"
#include "tests/e2e/e2e_util.h"

namespace kvs_e2e {
namespace {

using ::google::protobuf::Struct;
using ::google::protobuf::Value;
using ::testing::HasSubstr;
using ::testing::Not;

struct KvctlRun {
  int exit_code = -1;
  std::string out;
  std::string err;
};

std::ostream& operator<<(std::ostream& os, const KvctlRun& run) {
  return os << "exit " << run.exit_code << "\n--- stdout ---\n"
            << run.out << "--- stderr ---\n"
            << run.err;
}

// Runs <build>/clients/cpp/kvctl with `args` and waits for it.
KvctlRun RunKvctl(const std::vector<std::string>& args) {
  static std::atomic<int> counter{0};
  static const std::string log_dir = MakeTempDir("kvs-kvctl-");
  std::vector<std::string> argv = {BuildDir() + "/clients/cpp/kvctl"};
  argv.insert(argv.end(), args.begin(), args.end());
  KvctlRun run;
  auto child = ChildProcess::Spawn(argv, log_dir, absl::StrCat("kvctl", counter++));
  if (!child.ok()) {
    run.err = child.status().ToString();
    return run;
  }
  const int status = (*child)->Wait(absl::Seconds(120));
  run.out = (*child)->Stdout();
  run.err = (*child)->Stderr();
  if (status != -1 && WIFEXITED(status)) run.exit_code = WEXITSTATUS(status);
  return run;
}

// Strict: a key that is not a field of `message` fails the parse.
template <typename Message>
Message ParseJsonAs(const std::string& json) {
  Message message;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  const auto status = google::protobuf::util::JsonStringToMessage(json, &message, options);
  EXPECT_TRUE(status.ok()) << status.ToString() << "\n" << json;
  return message;
}

Struct ParseJson(const std::string& json) { return ParseJsonAs<Struct>(json); }

Value ValueOf(const Struct& object) {
  Value value;
  *value.mutable_struct_value() = object;
  return value;
}

std::string ToJsonText(const Value& value) {
  std::string out;
  EXPECT_TRUE(google::protobuf::util::MessageToJsonString(value, &out).ok());
  return out;
}

const Value& Field(const Struct& object, const std::string& key) {
  static const Value* const kMissing = new Value();
  auto it = object.fields().find(key);
  EXPECT_NE(it, object.fields().end()) << "missing key " << key;
  return it == object.fields().end() ? *kMissing : it->second;
}

// A port on 127.0.0.1 that nothing listens on (bound, then closed).
int ClosedPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t size = sizeof(address);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &size) == 0) {
    port = ntohs(address.sin_port);
  }
  close(fd);
  return port;
}

v1::ModelLayout SmallLayout() { return MakeLayout(2, 2, 4, 16, v1::DTYPE_FLOAT16); }

class KvctlTest : public SharedServerTest<KvctlTest> {
 protected:
  // kvctl --admin=<the shared server's admin port> args...
  static KvctlRun Kvctl(std::vector<std::string> args) {
    args.insert(args.begin(), "--admin=" + server_->admin_target());
    return RunKvctl(args);
  }
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    auto client = server_->Connect();
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
    auto admin = server_->ConnectAdmin();
    ASSERT_TRUE(admin.ok()) << admin.status();
    admin_ = std::move(*admin);
  }
  std::unique_ptr<kvsidecar::Session> Attach(const std::string& tenant) {
    auto session = client_->Attach(SmallLayout(), tenant);
    EXPECT_TRUE(session.ok()) << session.status();
    return session.ok() ? std::move(*session) : nullptr;
  }

  std::unique_ptr<kvsidecar::Client> client_;
  std::unique_ptr<kvsidecar::AdminClient> admin_;
};

TEST_F(KvctlTest, StatusListAndShowReportWhatTheTestAttached) {
  auto acme = Attach("acme");
  auto beta = Attach("beta");
  ASSERT_NE(acme, nullptr);
  ASSERT_NE(beta, nullptr);
  ASSERT_TRUE(acme->CreateSequence(KeyDiffPolicy(), MakeBudget(64), "s1").ok());
  ASSERT_TRUE(WriteTokens(*acme, "s1", 40, 1).ok());
  ASSERT_TRUE(acme->CreateSequence(StreamingPolicy(4), std::nullopt, "s2").ok());
  ASSERT_TRUE(WriteTokens(*acme, "s2", 24, 2).ok());
  ASSERT_TRUE(beta->CreateSequence(KeyDiffPolicy(), std::nullopt, "t1").ok());
  ASSERT_TRUE(WriteTokens(*beta, "t1", 16, 3).ok());
  auto truth = admin_->ListSequences();
  ASSERT_TRUE(truth.ok()) << truth.status();
  uint64_t acme_arena = 0;
  for (const auto& s : truth->sequences()) {
    if (s.tenant() == "acme") acme_arena += s.arena_bytes();
  }
  ASSERT_GT(acme_arena, 0u);

  // status --json: stats, tiers, tenants aggregated per tenant, sessions.
  KvctlRun run = Kvctl({"status", "--json"});
  ASSERT_EQ(run.exit_code, 0) << run;
  Struct status = ParseJson(run.out);
  const Struct& stats = Field(status, "stats").struct_value();
  EXPECT_EQ(Field(stats, "sessions").number_value(), 2);
  EXPECT_EQ(Field(stats, "sequences").number_value(), 3);
  EXPECT_EQ(Field(stats, "draining").bool_value(), false);
  EXPECT_EQ(Field(status, "backend").string_value(), "cpu");
  EXPECT_EQ(Field(status, "tiers").list_value().values_size(), 3);
  EXPECT_EQ(
      Field(Field(status, "tiers").list_value().values(0).struct_value(), "tier").string_value(),
      "arena");
  const auto& tenants = Field(status, "tenants").list_value();
  ASSERT_EQ(tenants.values_size(), 2) << run.out;
  // Sorted by name, each a TenantQuota (admin.proto).
  const auto acme_row = ParseJsonAs<v1::TenantQuota>(ToJsonText(tenants.values(0)));
  EXPECT_EQ(acme_row.tenant(), "acme");
  EXPECT_EQ(acme_row.usage().sessions(), 1);
  EXPECT_EQ(acme_row.usage().sequences(), 2);
  EXPECT_EQ(acme_row.usage().arena_bytes(), acme_arena);
  const auto beta_row = ParseJsonAs<v1::TenantQuota>(ToJsonText(tenants.values(1)));
  EXPECT_EQ(beta_row.tenant(), "beta");
  EXPECT_EQ(beta_row.usage().sequences(), 1);
  EXPECT_EQ(Field(status, "sessions").list_value().values_size(), 2);

  // status as tables.
  run = Kvctl({"status"});
  ASSERT_EQ(run.exit_code, 0) << run;
  EXPECT_THAT(run.out, HasSubstr("TIERS"));
  EXPECT_THAT(run.out, HasSubstr("TENANTS"));
  EXPECT_THAT(run.out, HasSubstr("SESSIONS"));
  EXPECT_THAT(run.out, HasSubstr(acme->session_id()));
  EXPECT_THAT(run.out, HasSubstr(beta->session_id()));
  EXPECT_THAT(run.out, HasSubstr("backend: cpu"));

  // list sessions, all and by tenant.
  run = Kvctl({"list", "sessions", "--json"});
  ASSERT_EQ(run.exit_code, 0) << run;
  auto sessions = ParseJsonAs<v1::ListSessionsResponse>(run.out);
  ASSERT_EQ(sessions.sessions_size(), 2);
  run = Kvctl({"list", "sessions", "--tenant=acme", "--json"});
  ASSERT_EQ(run.exit_code, 0) << run;
  sessions = ParseJsonAs<v1::ListSessionsResponse>(run.out);
  ASSERT_EQ(sessions.sessions_size(), 1);
  EXPECT_EQ(sessions.sessions(0).session_id(), acme->session_id());
  EXPECT_EQ(sessions.sessions(0).tenant(), "acme");
  EXPECT_EQ(sessions.sessions(0).worker_name(), "e2e");
  EXPECT_EQ(sessions.sessions(0).sequences(), 2);
  EXPECT_EQ(sessions.sessions(0).layout().num_layers(), 2);
  run = Kvctl({"list", "sessions"});
  ASSERT_EQ(run.exit_code, 0) << run;
  EXPECT_THAT(run.out, HasSubstr("SESSION"));
  EXPECT_THAT(run.out, HasSubstr(acme->session_id()));

  // list sequences: filters, kept tokens per layer, policy and budget.
  run = Kvctl({"list", "sequences", "--session", acme->session_id(), "--json"});
  ASSERT_EQ(run.exit_code, 0) << run;
  auto sequences = ParseJsonAs<v1::ListSequencesResponse>(run.out);
  ASSERT_EQ(sequences.sequences_size(), 2) << run.out;
  for (const auto& s : sequences.sequences()) {
    ASSERT_EQ(s.tokens_per_layer_size(), 2) << s.DebugString();
    const int expected = s.sequence_id() == "s1" ? 40 : 24;
    EXPECT_EQ(s.tokens_per_layer(0), expected);
    EXPECT_EQ(s.tokens_per_layer(1), expected);
    EXPECT_EQ(s.tenant(), "acme");
    if (s.sequence_id() == "s1") {
      EXPECT_EQ(s.policy().name(), "keydiff");
      EXPECT_EQ(s.budget().tokens_per_layer(), 64);
    }
  }
  run = Kvctl({"list", "sequences", "--tenant=nobody", "--json"});
  ASSERT_EQ(run.exit_code, 0) << run;
  EXPECT_EQ(run.out, "{\"sequences\":[]}\n");
  run = Kvctl({"list", "sequences", "--tenant=beta"});
  ASSERT_EQ(run.exit_code, 0) << run;
  EXPECT_THAT(run.out, HasSubstr("t1"));
  EXPECT_THAT(run.out, Not(HasSubstr("s2")));

  // show session: the session and its sequences.
  run = Kvctl({"show", "session", acme->session_id(), "--json"});
  ASSERT_EQ(run.exit_code, 0) << run;
  Struct shown = ParseJson(run.out);
  EXPECT_EQ(Field(Field(shown, "session").struct_value(), "session_id").string_value(),
            acme->session_id());
  EXPECT_EQ(Field(shown, "sequences").list_value().values_size(), 2);
  run = Kvctl({"show", "session", acme->session_id()});
  ASSERT_EQ(run.exit_code, 0) << run;
  EXPECT_THAT(run.out, HasSubstr("tenant:     acme"));
  EXPECT_THAT(run.out, HasSubstr("s1"));

  // show sequence: per-layer kept tokens; unknown ids are NOT_FOUND (exit 1).
  run = Kvctl({"show", "sequence", "t1", "--json"});
  ASSERT_EQ(run.exit_code, 0) << run;
  Struct sequence = Field(ParseJson(run.out), "sequence").struct_value();
  EXPECT_EQ(Field(sequence, "session_id").string_value(), beta->session_id());
  const auto& kept = Field(sequence, "tokens_per_layer").list_value();
  ASSERT_EQ(kept.values_size(), 2);
  EXPECT_EQ(kept.values(0).number_value(), 16);
  run = Kvctl({"show", "sequence", "s2", "--session", acme->session_id()});
  ASSERT_EQ(run.exit_code, 0) << run;
  EXPECT_THAT(run.out, HasSubstr("tokens kept per layer"));
  run = Kvctl({"show", "sequence", "nope", "--json"});
  EXPECT_EQ(run.exit_code, 1) << run;
  EXPECT_THAT(run.err, HasSubstr("NOT_FOUND"));
  const Struct error = Field(ParseJson(run.out), "error").struct_value();
  EXPECT_EQ(Field(error, "code").string_value(), "NOT_FOUND");
  EXPECT_EQ(Field(error, "exit_code").number_value(), 1);
  run = Kvctl({"show", "session", "no-such-session"});
  EXPECT_EQ(run.exit_code, 1) << run;
}

TEST_F(KvctlTest, ReleaseSequenceAndSessionByForce) {
  auto session = Attach("acme");
  ASSERT_NE(session, nullptr);
  ASSERT_TRUE(session->CreateSequence(KeyDiffPolicy(), std::nullopt, "s1").ok());
  ASSERT_TRUE(WriteTokens(*session, "s1", 40, 1).ok());
  ASSERT_TRUE(session->CreateSequence(KeyDiffPolicy(), std::nullopt, "s2").ok());
  ASSERT_TRUE(WriteTokens(*session, "s2", 20, 2).ok());

  KvctlRun run =
      Kvctl({"release", "sequence", "s1", "--session=" + session->session_id(), "--json"});
  ASSERT_EQ(run.exit_code, 0) << run;
  auto released = ParseJsonAs<v1::ForceReleaseResponse>(run.out);
  EXPECT_EQ(released.sequences_released(), 1);
  EXPECT_EQ(released.blocks_released(), 2 * 3);  // 2 layers x ceil(40 / 16) blocks
  EXPECT_EQ(session->GetLayout("s1").status().code(), absl::StatusCode::kNotFound);
  auto left = admin_->ListSequences(session->session_id());
  ASSERT_TRUE(left.ok()) << left.status();
  ASSERT_EQ(left->sequences_size(), 1);
  EXPECT_EQ(left->sequences(0).sequence_id(), "s2");

  // Unknown targets are the server's NOT_FOUND; a sequence needs its session (usage).
  run = Kvctl({"release", "sequence", "s1", "--session=" + session->session_id()});
  EXPECT_EQ(run.exit_code, 1) << run;
  EXPECT_THAT(run.err, HasSubstr("NOT_FOUND"));
  run = Kvctl({"release", "sequence", "s2"});
  EXPECT_EQ(run.exit_code, 2) << run;

  run = Kvctl({"release", "session", session->session_id()});
  ASSERT_EQ(run.exit_code, 0) << run;
  EXPECT_THAT(run.out, HasSubstr("released 1 sequence(s), 4 block(s)"));
  auto sessions = admin_->ListSessions();
  ASSERT_TRUE(sessions.ok()) << sessions.status();
  EXPECT_EQ(sessions->sessions_size(), 0);
  run = Kvctl({"release", "session", session->session_id(), "--json"});
  EXPECT_EQ(run.exit_code, 1) << run;
  EXPECT_EQ(Field(Field(ParseJson(run.out), "error").struct_value(), "code").string_value(),
            "NOT_FOUND");
}

TEST_F(KvctlTest, ListSpilledShowsCopiesOfLiveAndEndedSessions) {
  auto session = Attach("spiller");
  ASSERT_NE(session, nullptr);
  ASSERT_TRUE(session->CreateSequence(KeyDiffPolicy(), std::nullopt, "cold").ok());
  ASSERT_TRUE(WriteTokens(*session, "cold", 40, 3).ok());
  v1::SpillRequest spill;
  spill.set_sequence_id("cold");
  spill.set_target(v1::TIER_DISK);
  ASSERT_TRUE(session->Spill(spill).ok());

  KvctlRun run = Kvctl({"list", "spilled", "--tenant=spiller", "--json"});
  ASSERT_EQ(run.exit_code, 0) << run;
  auto listed = ParseJsonAs<v1::ListSpilledResponse>(run.out);
  ASSERT_EQ(listed.copies_size(), 1) << run.out;
  EXPECT_EQ(listed.copies(0).sequence_id(), "cold");
  EXPECT_EQ(listed.copies(0).session_id(), session->session_id());
  EXPECT_EQ(listed.copies(0).tier(), v1::TIER_DISK);
  EXPECT_TRUE(listed.copies(0).session_attached());
  EXPECT_GT(listed.copies(0).bytes(), 0u);
  run = Kvctl({"list", "spilled", "--session=" + session->session_id()});
  ASSERT_EQ(run.exit_code, 0) << run;
  EXPECT_THAT(run.out, HasSubstr("ATTACHED"));
  EXPECT_THAT(run.out, HasSubstr("cold"));

  // The session ends: its disk copy stays, listed as an orphan another session can adopt.
  ASSERT_EQ(Kvctl({"release", "session", session->session_id()}).exit_code, 0);
  run = Kvctl({"list", "spilled", "--tenant=spiller", "--json"});
  ASSERT_EQ(run.exit_code, 0) << run;
  listed = ParseJsonAs<v1::ListSpilledResponse>(run.out);
  ASSERT_EQ(listed.copies_size(), 1) << run.out;
  EXPECT_FALSE(listed.copies(0).session_attached());
  EXPECT_TRUE(listed.copies(0).lost().empty());
  run = Kvctl({"list", "spilled", "--tenant=nobody"});
  ASSERT_EQ(run.exit_code, 0) << run;
  EXPECT_THAT(run.out, ::testing::Not(HasSubstr("cold")));
  run = Kvctl({"list", "spilled", "extra"});
  EXPECT_EQ(run.exit_code, 2) << run;
}

TEST_F(KvctlTest, ConfigPrintsTheEffectiveConfiguration) {
  auto config = admin_->GetConfig();
  ASSERT_TRUE(config.ok()) << config.status();
  KvctlRun run = Kvctl({"config"});
  ASSERT_EQ(run.exit_code, 0) << run;
  ASSERT_FALSE(config->effective_config_yaml().empty());
  std::string expected = config->effective_config_yaml();
  if (expected.back() != '\n') expected += "\n";
  EXPECT_EQ(run.out, expected);
  run = Kvctl({"config", "--json"});
  ASSERT_EQ(run.exit_code, 0) << run;
  EXPECT_EQ(Kvctl({"show", "config", "--json"}).out, run.out);  // the alias
  auto parsed = ParseJsonAs<v1::GetConfigResponse>(run.out);
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(parsed, *config))
      << parsed.DebugString() << "\nvs\n"
      << config->DebugString();
}

TEST_F(KvctlTest, HealthChecksTheServer) {
  KvctlRun run = Kvctl({"health"});
  ASSERT_EQ(run.exit_code, 0) << run;
  EXPECT_EQ(run.out, "(server): SERVING\n");
  run = Kvctl({"health", "--service=kvsidecar.v1.Admin", "--json"});
  ASSERT_EQ(run.exit_code, 0) << run;
  EXPECT_EQ(run.out, "{\"service\":\"kvsidecar.v1.Admin\",\"status\":\"SERVING\"}\n");
  // The data port serves health too (the container's HEALTHCHECK uses it).
  run = RunKvctl({"--admin=" + server_->data_target(), "health", "--service=kvsidecar.v1.Sidecar"});
  EXPECT_EQ(run.exit_code, 0) << run;
  run = Kvctl({"health", "--service=no.such.Service"});
  EXPECT_EQ(run.exit_code, 1) << run;
  EXPECT_THAT(run.err, HasSubstr("NOT_FOUND"));
}

TEST_F(KvctlTest, SetBudgetAppliesToNewSequencesAndRebudgetsATenant) {
  auto acme = Attach("acme");
  auto beta = Attach("beta");
  ASSERT_NE(acme, nullptr);
  ASSERT_NE(beta, nullptr);
  ASSERT_TRUE(acme->CreateSequence(KeyDiffPolicy(), MakeBudget(48), "a1").ok());
  ASSERT_TRUE(WriteTokens(*acme, "a1", 40, 11).ok());
  ASSERT_TRUE(beta->CreateSequence(KeyDiffPolicy(), MakeBudget(48), "b1").ok());
  ASSERT_TRUE(WriteTokens(*beta, "b1", 40, 12).ok());

  KvctlRun run = Kvctl({"set", "budget", "16", "--rebudget-tenant=acme", "--json"});
  ASSERT_EQ(run.exit_code, 0) << run;
  auto set = ParseJsonAs<v1::SetDefaultsResponse>(run.out);
  EXPECT_EQ(set.sequences_rebudgeted(), 1);
  EXPECT_EQ(set.default_budget().tokens_per_layer(), 16);
  // acme's sequence now holds 16 tokens per layer, still bit-exact; beta's is untouched.
  auto layout = acme->GetLayout("a1");
  ASSERT_TRUE(layout.ok()) << layout.status();
  for (const auto& layer : layout->layers()) EXPECT_EQ(layer.count(), 16);
  EXPECT_TRUE(VerifySequence(*acme, "a1", 11).ok());
  auto untouched = beta->GetLayout("b1");
  ASSERT_TRUE(untouched.ok()) << untouched.status();
  for (const auto& layer : untouched->layers()) EXPECT_EQ(layer.count(), 40);
  // New sequences get the new default.
  auto config = admin_->GetConfig();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->default_budget().tokens_per_layer(), 16);

  run = Kvctl({"set", "budget", "32"});
  ASSERT_EQ(run.exit_code, 0) << run;
  EXPECT_THAT(run.out, HasSubstr("budget 32"));

  // Refused by the server (exit 1 with its code) or by kvctl (exit 2): 0 keeps no token, and
  // kvctl says what makes new sequences unbounded.
  run = Kvctl({"set", "budget", "-3"});
  EXPECT_EQ(run.exit_code, 1) << run;
  EXPECT_THAT(run.err, HasSubstr("INVALID_ARGUMENT"));
  run = Kvctl({"set", "budget", "0"});
  EXPECT_EQ(run.exit_code, 2) << run;
  EXPECT_THAT(run.err, HasSubstr("`kvctl set budget none` makes new sequences unbounded"));
  run = Kvctl({"set", "budget", "lots"});
  EXPECT_EQ(run.exit_code, 2) << run;
  run = Kvctl({"set", "budget", "none", "--strict"});
  EXPECT_EQ(run.exit_code, 2) << run;
  config = admin_->GetConfig();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->default_budget().tokens_per_layer(), 32);

  // `none` puts the start-up default back: new sequences are unbounded.
  run = Kvctl({"set", "budget", "none"});
  ASSERT_EQ(run.exit_code, 0) << run;
  EXPECT_THAT(run.out, HasSubstr("budget unbounded"));
  config = admin_->GetConfig();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->default_budget().tokens_per_layer(), 0);
  EXPECT_TRUE(acme->CreateSequence(KeyDiffPolicy(), std::nullopt, "a2").ok());
  auto fresh = acme->GetLayout("a2");
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_EQ(fresh->budget().tokens_per_layer(), 0);
}

TEST_F(KvctlTest, SetPolicyChangesTheDefault) {
  KvctlRun run = Kvctl(
      {"set", "policy", "streaming_llm", "--spec", R"({"streaming_llm":{"n_sink":2}})", "--json"});
  ASSERT_EQ(run.exit_code, 0) << run;
  auto set = ParseJsonAs<v1::SetDefaultsResponse>(run.out);
  EXPECT_EQ(set.default_policy().name(), "streaming_llm");
  EXPECT_EQ(set.default_policy().streaming_llm().n_sink(), 2);
  auto config = admin_->GetConfig();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->default_policy().name(), "streaming_llm");
  EXPECT_EQ(config->default_policy().streaming_llm().n_sink(), 2);

  run = Kvctl({"set", "policy", "no_such_policy"});
  EXPECT_EQ(run.exit_code, 1) << run;
  EXPECT_THAT(run.err, HasSubstr("INVALID_ARGUMENT"));
  run = Kvctl({"set", "policy", "h2o", "--spec={not json"});
  EXPECT_EQ(run.exit_code, 2) << run;
  run = Kvctl({"set", "policy", "h2o", R"(--spec={"no_such_field":1})"});
  EXPECT_EQ(run.exit_code, 2) << run;
  config = admin_->GetConfig();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->default_policy().name(), "streaming_llm");
}

TEST_F(KvctlTest, SetQuotaReturnsTheQuotaInForce) {
  KvctlRun run = Kvctl({"set", "quota", "acme", "--arena=64Mi", "--sequences=3", "--json"});
  ASSERT_EQ(run.exit_code, 0) << run;
  Struct set = ParseJson(run.out);
  EXPECT_EQ(Field(set, "tenant").string_value(), "acme");
  set.mutable_fields()->erase("tenant");
  const auto response = ParseJsonAs<v1::SetQuotaResponse>(ToJsonText(ValueOf(set)));
  EXPECT_EQ(response.quota().arena_bytes(), 64u << 20);
  EXPECT_EQ(response.quota().sequences(), 3);
  EXPECT_FALSE(response.over_quota());
  run = Kvctl({"set", "quota", "acme", "--sequences=3"});
  ASSERT_EQ(run.exit_code, 0) << run;
  EXPECT_THAT(run.out, HasSubstr("sequences 3"));
  run = Kvctl({"set", "quota", "acme", "--arena=12Q"});
  EXPECT_EQ(run.exit_code, 2) << run;
  run = Kvctl({"set", "quota", "acme", "--rebudget-tokens=8"});  // needs --rebudget
  EXPECT_EQ(run.exit_code, 2) << run;

  // With two sequences in use, a quota of one is refused (exit 1) and changes nothing.
  auto session = Attach("acme");
  ASSERT_NE(session, nullptr);
  ASSERT_TRUE(session->CreateSequence(KeyDiffPolicy(), std::nullopt, "q1").ok());
  ASSERT_TRUE(session->CreateSequence(KeyDiffPolicy(), std::nullopt, "q2").ok());
  run = Kvctl({"set", "quota", "acme", "--sequences=1"});
  EXPECT_EQ(run.exit_code, 1) << run;
  EXPECT_THAT(run.err, HasSubstr("FAILED_PRECONDITION"));

  // list quotas: the quota in force and the usage.
  run = Kvctl({"list", "quotas", "--tenant=acme", "--json"});
  ASSERT_EQ(run.exit_code, 0) << run;
  const auto quotas = ParseJsonAs<v1::GetQuotasResponse>(run.out);
  ASSERT_EQ(quotas.tenants_size(), 1) << run.out;
  EXPECT_EQ(quotas.tenants(0).tenant(), "acme");
  EXPECT_EQ(quotas.tenants(0).quota().sequences(), 3);
  EXPECT_EQ(quotas.tenants(0).usage().sequences(), 2);
  EXPECT_EQ(quotas.tenants(0).usage().sessions(), 1);
  run = Kvctl({"list", "quotas"});
  ASSERT_EQ(run.exit_code, 0) << run;
  EXPECT_THAT(run.out, HasSubstr("- / - / - / 3"));
  run = Kvctl({"status"});
  ASSERT_EQ(run.exit_code, 0) << run;
  EXPECT_THAT(run.out, HasSubstr("- / - / - / 3"));
}

// A spilled sequence is listed as it was when it left the arena (its own policy, budget and kept
// tokens, the tier it is in), and every count includes it: the session's, the tenant's and the
// server's, with the spilled ones named.
TEST_F(KvctlTest, SpilledSequencesAreListedAndCountedAsTheyAre) {
  auto session = Attach("spillers");
  ASSERT_NE(session, nullptr);
  ASSERT_TRUE(session->CreateSequence(StreamingPolicy(4), MakeBudget(32), "hot").ok());
  ASSERT_TRUE(WriteTokens(*session, "hot", 20, 5).ok());
  ASSERT_TRUE(session->CreateSequence(StreamingPolicy(4), MakeBudget(32), "warm").ok());
  ASSERT_TRUE(WriteTokens(*session, "warm", 24, 6).ok());
  ASSERT_TRUE(session->CreateSequence(KeyDiffPolicy(), MakeBudget(48), "cold").ok());
  ASSERT_TRUE(WriteTokens(*session, "cold", 40, 7).ok());
  for (const auto& [id, tier] : {std::pair{"warm", v1::TIER_HOST}, {"cold", v1::TIER_DISK}}) {
    v1::SpillRequest spill;
    spill.set_sequence_id(id);
    spill.set_target(tier);
    ASSERT_TRUE(session->Spill(spill).ok()) << id;
  }

  KvctlRun run = Kvctl({"list", "sequences", "--tenant=spillers", "--json"});
  ASSERT_EQ(run.exit_code, 0) << run;
  const auto listed = ParseJsonAs<v1::ListSequencesResponse>(run.out);
  ASSERT_EQ(listed.sequences_size(), 3) << run.out;
  for (const v1::SequenceInfo& s : listed.sequences()) {
    SCOPED_TRACE(s.sequence_id());
    EXPECT_EQ(s.tokens_per_layer_size(), 2) << s.DebugString();
    if (s.tokens_per_layer_size() != 2) continue;
    if (s.sequence_id() == "cold") {
      EXPECT_EQ(s.tier(), v1::TIER_DISK);
      EXPECT_EQ(s.policy().name(), "keydiff");
      EXPECT_EQ(s.budget().tokens_per_layer(), 48);
      EXPECT_EQ(s.tokens_per_layer(0), 40);
      EXPECT_GT(s.disk_bytes(), 0u);
    } else {
      EXPECT_EQ(s.tier(), s.sequence_id() == "warm" ? v1::TIER_HOST : v1::TIER_ARENA);
      EXPECT_EQ(s.policy().name(), "streaming_llm");
      EXPECT_EQ(s.policy().streaming_llm().n_sink(), 4);
      EXPECT_EQ(s.budget().tokens_per_layer(), 32);
      EXPECT_EQ(s.tokens_per_layer(0), s.sequence_id() == "warm" ? 24 : 20);
    }
  }
  run = Kvctl({"list", "sequences", "--tenant=spillers"});
  ASSERT_EQ(run.exit_code, 0) << run;
  EXPECT_THAT(run.out, ::testing::ContainsRegex("warm +spillers +streaming_llm +32 +24 +host"));
  EXPECT_THAT(run.out, ::testing::ContainsRegex("cold +spillers +keydiff +48 +40 +disk"));
  EXPECT_THAT(run.out, Not(HasSubstr("unbounded")));

  // status: the session, its tenant and the server count all three, two of them spilled.
  run = Kvctl({"status", "--json"});
  ASSERT_EQ(run.exit_code, 0) << run;
  const Struct status = ParseJson(run.out);
  const auto stats = ParseJsonAs<v1::GetStatsResponse>(ToJsonText(Field(status, "stats")));
  int sequences = 0, spilled = 0;
  for (const Value& value : Field(status, "sessions").list_value().values()) {
    const auto row = ParseJsonAs<v1::SessionInfo>(ToJsonText(value));
    sequences += row.sequences();
    spilled += row.sequences_spilled();
    if (row.session_id() == session->session_id()) {
      EXPECT_EQ(row.sequences(), 3);
      EXPECT_EQ(row.sequences_spilled(), 2);
    }
  }
  EXPECT_EQ(stats.sequences(), sequences);
  EXPECT_EQ(stats.sequences_spilled(), spilled);
  EXPECT_GE(stats.sequences(), 3);
  for (const Value& value : Field(status, "tenants").list_value().values()) {
    const auto row = ParseJsonAs<v1::TenantQuota>(ToJsonText(value));
    if (row.tenant() == "spillers") {
      EXPECT_EQ(row.usage().sequences(), 3);
    }
  }
  run = Kvctl({"status"});
  ASSERT_EQ(run.exit_code, 0) << run;
  EXPECT_THAT(run.out, HasSubstr("3 (2 spilled)"));
  EXPECT_THAT(run.out, HasSubstr("SPILLED SEQUENCES"));
  EXPECT_THAT(run.out, ::testing::ContainsRegex(session->session_id() + " +warm +spillers +host"));
  EXPECT_THAT(run.out, ::testing::ContainsRegex(session->session_id() + " +cold +spillers +disk"));
  run = Kvctl({"show", "session", session->session_id()});
  ASSERT_EQ(run.exit_code, 0) << run;
  EXPECT_THAT(run.out, HasSubstr("sequences:  3 (2 spilled)"));
}

// A negative number is the command's argument, refused for its value, never taken for a flag.
TEST_F(KvctlTest, NegativeNumbersAreValuesRefusedForWhatTheyAre) {
  auto before = admin_->GetConfig();
  ASSERT_TRUE(before.ok()) << before.status();
  KvctlRun run = Kvctl({"set", "budget", "-5"});
  EXPECT_EQ(run.exit_code, 1) << run;
  EXPECT_THAT(run.err, HasSubstr("INVALID_ARGUMENT"));
  EXPECT_THAT(run.err, HasSubstr("default_budget.tokens_per_layer must be >= 1, got -5"));
  EXPECT_THAT(run.err, Not(HasSubstr("flag")));
  run = Kvctl({"set", "quota", "acme", "--sequences", "-1"});
  EXPECT_EQ(run.exit_code, 2) << run;
  EXPECT_THAT(run.err, HasSubstr("-1"));
  EXPECT_THAT(run.err, Not(HasSubstr("unknown flag")));
  run = Kvctl({"set", "quota", "acme", "--arena", "-1Gi"});
  EXPECT_EQ(run.exit_code, 2) << run;
  EXPECT_THAT(run.err, HasSubstr("--arena must not be negative"));
  auto config = admin_->GetConfig();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->default_budget().tokens_per_layer(),
            before->default_budget().tokens_per_layer());  // unchanged
}

// The default policy is held to what CreateSequence accepts: another policy's parameters are
// refused by the server, naming the field, and change nothing.
TEST_F(KvctlTest, SetPolicyRefusesAnotherPolicysParams) {
  // The server is shared by the suite's tests: another test may have set the default before.
  auto before = admin_->GetConfig();
  ASSERT_TRUE(before.ok()) << before.status();
  KvctlRun run =
      Kvctl({"set", "policy", "h2o", R"(--spec={"snapkv":{"window":32,"kernel_size":7}})"});
  EXPECT_EQ(run.exit_code, 1) << run;
  EXPECT_THAT(run.err, HasSubstr("INVALID_ARGUMENT"));
  EXPECT_THAT(run.err, HasSubstr("default_policy.snapkv is set but default_policy.name is 'h2o'"));
  auto config = admin_->GetConfig();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->default_policy().DebugString(), before->default_policy().DebugString());
  // CreateSequence refuses the same spec the same way.
  auto session = Attach("acme");
  ASSERT_NE(session, nullptr);
  v1::PolicySpec spec;
  spec.set_name("h2o");
  spec.mutable_snapkv()->set_window(32);
  const absl::Status created = session->CreateSequence(spec, std::nullopt, "mixed").status();
  EXPECT_EQ(created.code(), absl::StatusCode::kInvalidArgument) << created;
  EXPECT_THAT(created.message(), HasSubstr("policy.snapkv is set but policy.name is 'h2o'"));
  // The policy's own parameters are accepted.
  run = Kvctl({"set", "policy", "h2o", R"(--spec={"h2o":{"n_recent":8}})", "--json"});
  ASSERT_EQ(run.exit_code, 0) << run;
  EXPECT_EQ(ParseJsonAs<v1::SetDefaultsResponse>(run.out).default_policy().h2o().n_recent(), 8);
}

// Sizes are Kubernetes quantities, as in the sidecar's flags: Gi binary, G decimal.
TEST_F(KvctlTest, QuotaSizesAreKubernetesQuantities) {
  KvctlRun run = Kvctl({"set", "quota", "sizes", "--arena=1.5Gi", "--host=1G", "--disk=.5G",
                        "--json"});
  ASSERT_EQ(run.exit_code, 0) << run;
  Struct set = ParseJson(run.out);
  set.mutable_fields()->erase("tenant");
  auto quota = ParseJsonAs<v1::SetQuotaResponse>(ToJsonText(ValueOf(set))).quota();
  EXPECT_EQ(quota.arena_bytes(), (uint64_t{3} << 30) / 2);
  EXPECT_EQ(quota.host_bytes(), 1'000'000'000u);
  EXPECT_EQ(quota.disk_bytes(), 500'000'000u);
  // The byte-spelled aliases keep their base: GB = 10^9, GiB = 2^30.
  run = Kvctl({"set", "quota", "sizes", "--arena=2GB", "--host=1GiB", "--json"});
  ASSERT_EQ(run.exit_code, 0) << run;
  set = ParseJson(run.out);
  set.mutable_fields()->erase("tenant");
  quota = ParseJsonAs<v1::SetQuotaResponse>(ToJsonText(ValueOf(set))).quota();
  EXPECT_EQ(quota.arena_bytes(), 2'000'000'000u);
  EXPECT_EQ(quota.host_bytes(), uint64_t{1} << 30);
  for (const auto& [flag, message] :
       {std::pair<std::string, std::string>{"--arena=0.5", "--arena must be a whole number of bytes"},
        {"--host=1K", "--host has an unknown size suffix 'K'"},
        {"--disk=20000000000000000000", "--disk is larger than 2^64-1 bytes"}}) {
    run = Kvctl({"set", "quota", "sizes", flag});
    EXPECT_EQ(run.exit_code, 2) << run;
    EXPECT_THAT(run.err, HasSubstr(message)) << flag;
  }
  auto quotas = admin_->GetQuotas("sizes");
  ASSERT_TRUE(quotas.ok()) << quotas.status();
  ASSERT_EQ(quotas->tenants_size(), 1);
  EXPECT_EQ(quotas->tenants(0).quota().arena_bytes(), 2'000'000'000u);  // refusals changed nothing
}

// Drain changes the server for good: a server of its own.
TEST(KvctlDrainTest, DrainReportsRemainingSessionsAndWaitsForEmpty) {
  auto server = ServerProcess::Start();
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string admin_flag = "--admin=" + (*server)->admin_target();
  auto client = (*server)->Connect();
  ASSERT_TRUE(client.ok()) << client.status();
  auto session = (*client)->Attach(SmallLayout(), "acme");
  ASSERT_TRUE(session.ok()) << session.status();

  KvctlRun run = RunKvctl({admin_flag, "drain", "--json"});
  ASSERT_EQ(run.exit_code, 0) << run;
  auto drained = ParseJsonAs<v1::DrainResponse>(run.out);
  EXPECT_EQ(drained.sessions_remaining(), 1);
  EXPECT_FALSE(drained.empty());
  run = RunKvctl({admin_flag, "status", "--json"});
  ASSERT_EQ(run.exit_code, 0) << run;
  EXPECT_TRUE(Field(Field(ParseJson(run.out), "stats").struct_value(), "draining").bool_value());
  // The data port stops reporting the Sidecar service as serving.
  run = RunKvctl({"--admin=" + (*server)->data_target(), "health", "--service",
                  "kvsidecar.v1.Sidecar", "--json"});
  EXPECT_EQ(run.exit_code, 1) << run;
  EXPECT_THAT(run.err, HasSubstr("NOT_SERVING"));
  // New attaches are refused while draining.
  EXPECT_EQ((*client)->Attach(SmallLayout(), "acme").status().code(),
            absl::StatusCode::kUnavailable);
  // --wait gives up (exit 1) while the session stays...
  run = RunKvctl({admin_flag, "drain", "--wait", "--wait-timeout=0.5"});
  EXPECT_EQ(run.exit_code, 1) << run;
  EXPECT_THAT(run.err, HasSubstr("DEADLINE_EXCEEDED"));
  // ...and returns once it has gone.
  ASSERT_TRUE((*session)->Detach().ok());
  run = RunKvctl({admin_flag, "drain", "--wait", "--json"});
  ASSERT_EQ(run.exit_code, 0) << run;
  drained = ParseJsonAs<v1::DrainResponse>(run.out);
  EXPECT_EQ(drained.sessions_remaining(), 0);
  EXPECT_TRUE(drained.empty());
}

// Credentials: an admin token, TLS and mutual TLS from certificates made at test time.
class KvctlCredentialsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir("kvs-kvctl-tls-");
    ASSERT_FALSE(dir_.empty());
    Write("server.ext", "subjectAltName=DNS:localhost,IP:127.0.0.1\n");
    Write("admin.token", "admin-secret-7\n");
    const std::string ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
    const std::string command = absl::StrCat(
        "cd '", dir_, "' && (openssl req -x509 ", ec,
        " -keyout ca.key -out ca.pem -days 2 -subj /CN=kvctl-test-ca && openssl req ", ec,
        " -keyout server.key -out server.csr -subj /CN=localhost && openssl x509 -req -in "
        "server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -extfile server.ext -out "
        "server.pem && openssl req ",
        ec,
        " -keyout client.key -out client.csr -subj /CN=kvctl && openssl x509 -req -in client.csr "
        "-CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -out client.pem) > openssl.log 2>&1");
    ASSERT_EQ(std::system(command.c_str()), 0) << "openssl failed; see " << dir_;
  }
  void Write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ + "/" + name) << text;
  }
  std::unique_ptr<ServerProcess> Start(std::vector<std::string> args) {
    args.push_back("--admin_token_file=" + dir_ + "/admin.token");
    ServerProcess::Options options;
    for (std::string& arg : args) {
      if (arg.find("$DIR") != std::string::npos) arg.replace(arg.find("$DIR"), 4, dir_);
    }
    options.extra_args = args;
    auto server = ServerProcess::Start(options);
    EXPECT_TRUE(server.ok()) << server.status();
    return server.ok() ? std::move(*server) : nullptr;
  }
  std::string dir_;
};

TEST_F(KvctlCredentialsTest, AdminTokenIsSentAsBearerMetadata) {
  auto server = Start({});
  ASSERT_NE(server, nullptr);
  const std::string admin = "--admin=" + server->admin_target();
  KvctlRun run = RunKvctl({admin, "status"});
  EXPECT_EQ(run.exit_code, 1) << run;
  EXPECT_THAT(run.err, HasSubstr("UNAUTHENTICATED"));
  run = RunKvctl({admin, "--token=not-the-token", "list", "sessions"});
  EXPECT_EQ(run.exit_code, 1) << run;
  EXPECT_THAT(run.err, HasSubstr("UNAUTHENTICATED"));
  run = RunKvctl({admin, "--token-file=" + dir_ + "/admin.token", "status", "--json"});
  EXPECT_EQ(run.exit_code, 0) << run;
  run = RunKvctl({admin, "--token", "admin-secret-7", "config"});
  EXPECT_EQ(run.exit_code, 0) << run;
  EXPECT_THAT(run.out, HasSubstr("admin_token_file"));
  EXPECT_THAT(run.out, Not(HasSubstr("admin-secret-7")));  // secrets stay in their files
  setenv("KVCTL_TOKEN", "admin-secret-7", 1);
  run = RunKvctl({admin, "list", "sequences"});
  unsetenv("KVCTL_TOKEN");
  EXPECT_EQ(run.exit_code, 0) << run;
  // Health stays open: probes carry no credentials.
  run = RunKvctl({admin, "health"});
  EXPECT_EQ(run.exit_code, 0) << run;
}

TEST_F(KvctlCredentialsTest, TlsAndMutualTls) {
  const std::string token = "--token-file=" + dir_ + "/admin.token";
  const std::string ca = "--ca=" + dir_ + "/ca.pem";
  {
    auto server = Start({"--tls_cert_file=$DIR/server.pem", "--tls_key_file=$DIR/server.key"});
    ASSERT_NE(server, nullptr);
    const std::string admin = "--admin=" + server->admin_target();
    KvctlRun run = RunKvctl({admin, ca, token, "status", "--json"});
    EXPECT_EQ(run.exit_code, 0) << run;
    // Plaintext to a TLS port, or a certificate for another name: no connection (exit 3).
    run = RunKvctl({admin, token, "--connect-timeout=1", "status"});
    EXPECT_EQ(run.exit_code, 3) << run;
    run = RunKvctl(
        {admin, ca, "--server-name=other.example", token, "--connect-timeout=1", "status"});
    EXPECT_EQ(run.exit_code, 3) << run;
    run = RunKvctl({admin, ca, "status"});
    EXPECT_EQ(run.exit_code, 1) << run;
    EXPECT_THAT(run.err, HasSubstr("UNAUTHENTICATED"));
    run = RunKvctl(
        {"--admin=" + server->data_target(), ca, "health", "--service=kvsidecar.v1.Sidecar"});
    EXPECT_EQ(run.exit_code, 0) << run;
  }
  auto server = Start({"--tls_cert_file=$DIR/server.pem", "--tls_key_file=$DIR/server.key",
                       "--tls_client_ca_file=$DIR/ca.pem"});
  ASSERT_NE(server, nullptr);
  const std::string admin = "--admin=" + server->admin_target();
  const std::string cert = "--cert=" + dir_ + "/client.pem";
  const std::string key = "--key=" + dir_ + "/client.key";
  KvctlRun run = RunKvctl({admin, ca, cert, key, token, "list", "sessions", "--json"});
  EXPECT_EQ(run.exit_code, 0) << run;
  EXPECT_EQ(run.out, "{\"sessions\":[]}\n");
  // Without a client certificate the handshake fails.
  run = RunKvctl({admin, ca, token, "--connect-timeout=1", "status"});
  EXPECT_EQ(run.exit_code, 3) << run;
  run = RunKvctl({admin, ca, cert, key, "health"});
  EXPECT_EQ(run.exit_code, 0) << run;
}

TEST(KvctlUsageTest, HelpDocumentsCommandsAndExitCodes) {
  KvctlRun run = RunKvctl({"--help"});
  ASSERT_EQ(run.exit_code, 0) << run;
  for (const char* text : {"status", "list sessions", "show sequence", "set budget", "set policy",
                           "set quota", "drain", "release session", "config", "health", "--json",
                           "--token", "--ca", "Exit codes", "3  cannot connect"}) {
    EXPECT_THAT(run.out, HasSubstr(text));
  }
  // `help` prints the same text (it printed its own one-line description, "This text"), and
  // `help COMMAND` that command's flags.
  const KvctlRun help = RunKvctl({"help"});
  EXPECT_EQ(help.exit_code, 0) << help;
  EXPECT_EQ(help.out, run.out);
  const KvctlRun budget = RunKvctl({"help", "set", "budget"});
  EXPECT_EQ(budget.exit_code, 0) << budget;
  EXPECT_THAT(budget.out, HasSubstr("--strict"));
  EXPECT_THAT(budget.out, HasSubstr("none: unbounded"));
  const KvctlRun unknown = RunKvctl({"help", "frobnicate"});
  EXPECT_EQ(unknown.exit_code, 2) << unknown;
  EXPECT_THAT(unknown.err, HasSubstr("unknown command 'frobnicate'"));
}

TEST(KvctlUsageTest, UsageErrorsSayWhatIsWrong) {
  const std::string nowhere = absl::StrCat("--admin=127.0.0.1:", ClosedPort());
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"frobnicate"}, "unknown command 'frobnicate' (kvctl takes: status, list, show, set"},
      {{"list", "things"}, "unknown command 'list things' (kvctl list takes: sessions"},
      {{"set", "colour", "red"}, "unknown command 'set colour'"},
      {{}, "kvctl needs a command: status, list"},
      {{"--timeout=abc", "status"}, "must be a positive number of seconds (e.g. 30 or 0.5), got "
                                    "'abc'"},
      {{"--connect-timeout=0", "status"}, "positive number of seconds"},
      {{"drain", "--grace=-1"}, "non-negative number of seconds"},
      {{"set", "quota", "acme", "--sequences=-1"}, "must be a whole number >= 0, got '-1'"},
  };
  for (const auto& [args, expected] : cases) {
    std::vector<std::string> line = {nowhere, "--connect-timeout=1"};
    line.insert(line.end(), args.begin(), args.end());
    const KvctlRun run = RunKvctl(line);
    EXPECT_EQ(run.exit_code, 2) << ::testing::PrintToString(args) << "\n" << run;
    EXPECT_THAT(run.err, HasSubstr(expected)) << ::testing::PrintToString(args);
    EXPECT_THAT(run.err, Not(HasSubstr("1.79769e+308"))) << ::testing::PrintToString(args);
    EXPECT_THAT(run.err, Not(HasSubstr("A subcommand is required")))
        << ::testing::PrintToString(args);
  }
}

TEST(KvctlUsageTest, VersionNamesTheRevisionAndBuildType) {
  const KvctlRun run = RunKvctl({"--version"});
  ASSERT_EQ(run.exit_code, 0) << run;
  EXPECT_THAT(run.out, HasSubstr(absl::StrCat("kvctl ", KVS_VERSION)));
  EXPECT_THAT(run.out, HasSubstr(absl::StrCat("git revision: ", KVS_GIT_REVISION)));
  EXPECT_THAT(run.out, HasSubstr(absl::StrCat("build type: ", KVS_BUILD_TYPE)));
  EXPECT_EQ(run.err, "");
}

TEST(KvctlUsageTest, BadUsageExitsTwoEvenWithoutAServer) {
  // Usage errors win over an unreachable server: they are found before the first call.
  const std::string nowhere = absl::StrCat("--admin=127.0.0.1:", ClosedPort());
  const std::vector<std::vector<std::string>> cases = {
      {},
      {"frobnicate"},
      {"list"},
      {"list", "things"},
      {"list", "sessions", "extra"},
      {"show", "session"},
      {"show", "widget", "x"},
      {"set", "budget"},
      {"set", "budget", "12abc"},
      {"set", "quota", "acme", "--arena=lots"},
      {"set", "quota", "acme", "--sequences=-1"},
      {"set", "colour", "red"},
      {"release", "sequence", "s1"},
      {"status", "--bogus"},
      {"status", "--tenant=acme"},
      {"status", "extra"},
      {"--timeout=soon", "status"},
      {"--connect-timeout=-1", "status"},
      {"--json=maybe", "status"},
      {"--cert=/dev/null", "status"},
      {"--ca=/no/such/file", "status"},
      {"--token"},
      {"--token=abc", "--token-file=/dev/null", "status"},
  };
  for (std::vector<std::string> args : cases) {
    args.insert(args.begin(), {nowhere, "--connect-timeout=1"});
    const KvctlRun run = RunKvctl(args);
    EXPECT_EQ(run.exit_code, 2) << ::testing::PrintToString(args) << "\n" << run;
    EXPECT_THAT(run.err, HasSubstr("kvctl: ")) << ::testing::PrintToString(args);
    EXPECT_EQ(run.out, "") << ::testing::PrintToString(args);
  }
}

TEST(KvctlUsageTest, UnreachableServerExitsThree) {
  const std::string nowhere = absl::StrCat("--admin=127.0.0.1:", ClosedPort());
  KvctlRun run = RunKvctl({nowhere, "--connect-timeout=1", "status"});
  EXPECT_EQ(run.exit_code, 3) << run;
  EXPECT_THAT(run.err, HasSubstr("cannot connect to 127.0.0.1:"));
  run = RunKvctl({nowhere, "--connect-timeout=1", "--json", "list", "sessions"});
  EXPECT_EQ(run.exit_code, 3) << run;
  const Struct error = Field(ParseJson(run.out), "error").struct_value();
  EXPECT_EQ(Field(error, "exit_code").number_value(), 3);
  EXPECT_EQ(Field(error, "code").string_value(), "UNAVAILABLE");
  run = RunKvctl({nowhere, "--connect-timeout=1", "health"});
  EXPECT_EQ(run.exit_code, 3) << run;
}

}  // namespace
}  // namespace kvs_e2e
