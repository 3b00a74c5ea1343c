// End to end: the real kvsidecar binary serves Prometheus metrics over HTTP (--metrics_listen);
// the scraped values match what the test did (sessions, sequences, tokens per policy, bytes,
// RPC counts by method and code), and log lines carry the client's x-request-id.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "gpu/base/build_info.h"
#include "httplib.h"
#include "kvsidecar/client.h"
#include "kvsidecar/v1/sidecar.grpc.pb.h"
#include "tests/e2e/e2e_util.h"

namespace kvs_e2e {
namespace {

using ::testing::HasSubstr;

// `name{b="2",a="1"}` -> `name{a="1",b="2"}`: the order of labels carries no meaning in the
// exposition format, so the tests compare series with their labels sorted by name.
std::string Canonical(absl::string_view series) {
  const size_t brace = series.find('{');
  if (brace == absl::string_view::npos || series.back() != '}') return std::string(series);
  std::vector<std::string> pairs;
  absl::string_view labels = series.substr(brace + 1, series.size() - brace - 2);
  // Split at commas outside quoted values (values may hold escaped quotes and commas).
  std::string current;
  bool quoted = false;
  for (size_t i = 0; i < labels.size(); ++i) {
    const char c = labels[i];
    if (quoted && c == '\\' && i + 1 < labels.size()) {
      current += c;
      current += labels[++i];
      continue;
    }
    if (c == '"') quoted = !quoted;
    if (c == ',' && !quoted) {
      pairs.push_back(current);
      current.clear();
      continue;
    }
    current += c;
  }
  if (!current.empty()) pairs.push_back(current);
  std::sort(pairs.begin(), pairs.end());
  return absl::StrCat(series.substr(0, brace), "{", absl::StrJoin(pairs, ","), "}");
}

// GET /metrics; series line "name{labels}" (labels sorted, see Canonical) -> value.
std::map<std::string, double> Scrape(const std::string& target, std::string* text = nullptr) {
  const size_t colon = target.rfind(':');
  httplib::Client http(target.substr(0, colon), std::stoi(target.substr(colon + 1)));
  http.set_connection_timeout(10);
  http.set_read_timeout(30);
  auto response = http.Get("/metrics");
  std::map<std::string, double> values;
  EXPECT_TRUE(response) << "no HTTP response from " << target;
  if (!response) return values;
  EXPECT_EQ(response->status, 200);
  EXPECT_THAT(response->get_header_value("Content-Type"), HasSubstr("text/plain"));
  if (text != nullptr) *text = response->body;
  for (absl::string_view line : absl::StrSplit(response->body, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    double value = 0;
    EXPECT_TRUE(absl::SimpleAtod(line.substr(space + 1), &value)) << line;
    values[Canonical(line.substr(0, space))] = value;
  }
  return values;
}

TEST(MetricsE2eTest, ScrapeMatchesWhatTheTestDid) {
  ServerProcess::Options options;
  options.extra_args = {"--metrics_listen=127.0.0.1:0"};
  auto server = ServerProcess::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_FALSE((*server)->metrics_target().empty()) << (*server)->Logs();

  auto client = (*server)->Connect();
  ASSERT_TRUE(client.ok()) << client.status();
  const v1::ModelLayout layout = MakeLayout(2, 2, 4, 16, v1::DTYPE_FLOAT16, 4);
  v1::AttachRequest attach;
  *attach.mutable_layout() = layout;
  attach.set_num_blocks(128);
  auto session = (*client)->Attach(attach);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE((*session)->CreateSequence(KeyDiffPolicy(), MakeBudget(8), "k").ok());
  ASSERT_TRUE((*session)->CreateSequence(StreamingPolicy(2), std::nullopt, "s").ok());
  // keydiff: 20 tokens into a budget of 8 -> 12 evicted per layer; streaming: 5 kept.
  ASSERT_TRUE(WriteTokens(**session, "k", 20, 1, /*compress_if_over_budget=*/true).ok());
  ASSERT_TRUE(WriteTokens(**session, "s", 5, 2).ok());
  // One failing call: an unknown sequence.
  EXPECT_EQ((*session)->GetLayout("nope").status().code(), absl::StatusCode::kNotFound);

  std::string text;
  auto m = Scrape((*server)->metrics_target(), &text);
  EXPECT_EQ(m["kvsidecar_sessions"], 1);
  EXPECT_EQ(m["kvsidecar_sequences"], 2);
  EXPECT_EQ(m["kvsidecar_tokens_appended_total{policy=\"keydiff\"}"], 40);
  EXPECT_EQ(m["kvsidecar_tokens_evicted_total{policy=\"keydiff\"}"], 24);
  EXPECT_EQ(m["kvsidecar_tokens_kept{policy=\"keydiff\"}"], 16);
  EXPECT_EQ(m["kvsidecar_tokens_appended_total{policy=\"streaming_llm\"}"], 10);
  EXPECT_EQ(m["kvsidecar_tokens_kept{policy=\"streaming_llm\"}"], 10);
  EXPECT_EQ(m["kvsidecar_tokens_merged_total{policy=\"keydiff\"}"], 0);
  // Blocks of 4 tokens: keydiff 2 per layer, streaming 2 per layer = 8 blocks.
  const double block_bytes = 2.0 * 2 * 4 * 16 * 2;  // K and V x heads x tokens x dim x fp16
  EXPECT_EQ(m["kvsidecar_tier_used_bytes{tier=\"arena\"}"], 8 * block_bytes);
  EXPECT_EQ(m["kvsidecar_tier_capacity_bytes{tier=\"arena\"}"], 1 << 30);
  EXPECT_EQ(m["kvsidecar_arena_reserved_bytes"], 128 * block_bytes);
  EXPECT_EQ(m["kvsidecar_backend_healthy{backend=\"cpu\"}"], 1);
  EXPECT_EQ(m["kvsidecar_sequence_budget_tokens_count{policy=\"keydiff\"}"], 1);
  EXPECT_EQ(m["kvsidecar_sequence_budget_tokens_bucket{le=\"64\",policy=\"keydiff\"}"], 1);
  EXPECT_EQ(m["kvsidecar_sequence_budget_tokens_bucket{le=\"0\",policy=\"streaming_llm\"}"], 1);
  EXPECT_EQ(m["kvsidecar_rpcs_total{code=\"OK\",method=\"Attach\",service=\"Sidecar\"}"], 1);
  EXPECT_EQ(m["kvsidecar_rpcs_total{code=\"OK\",method=\"CreateSequence\",service=\"Sidecar\"}"],
            2);
  EXPECT_EQ(m["kvsidecar_rpcs_total{code=\"NOT_FOUND\",method=\"GetLayout\",service=\"Sidecar\"}"],
            1);
  EXPECT_EQ(m["kvsidecar_rpc_duration_seconds_count{code=\"OK\",method=\"Reserve\","
              "service=\"Sidecar\"}"],
            2);
  EXPECT_EQ(m["kvsidecar_rpc_duration_seconds_bucket{code=\"OK\",le=\"+Inf\",method=\"Reserve\","
              "service=\"Sidecar\"}"],
            2);
  EXPECT_THAT(text, HasSubstr("# TYPE kvsidecar_rpc_duration_seconds histogram"));
  EXPECT_THAT(text, HasSubstr("# TYPE kvsidecar_tokens_evicted_total counter"));

  // Release: the gauges follow, the counters keep their totals.
  ASSERT_TRUE((*session)->ReleaseSequence("k").ok());
  m = Scrape((*server)->metrics_target());
  EXPECT_EQ(m["kvsidecar_sequences"], 1);
  EXPECT_EQ(m["kvsidecar_tokens_kept{policy=\"keydiff\"}"], 0);
  EXPECT_EQ(m["kvsidecar_tokens_appended_total{policy=\"keydiff\"}"], 40);
  EXPECT_EQ(m["kvsidecar_tokens_evicted_total{policy=\"keydiff\"}"], 24);
}

TEST(MetricsE2eTest, RequestIdFromMetadataIsEchoedInLogs) {
  // Client mistakes are logged at debug level.
  ServerProcess::Options options;
  options.extra_args = {"--log_level=debug"};
  auto server = ServerProcess::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = v1::Sidecar::NewStub(
      grpc::CreateChannel((*server)->data_target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.AddMetadata("x-request-id", "req-7f3a");
  v1::HeartbeatRequest request;
  request.set_session_id("no-such-session");
  v1::HeartbeatResponse response;
  EXPECT_EQ(stub->Heartbeat(&context, request, &response).error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(PollUntil(
      [&] {
        const std::string logs = (*server)->Logs();
        return logs.find("request_id=req-7f3a") != std::string::npos;
      },
      absl::Seconds(10)))
      << (*server)->Logs();
  EXPECT_THAT((*server)->Logs(), HasSubstr("rpc_failed rpc=Heartbeat"));
}


// The series of `family` (any suffix-free name) whose labels include `label`.
int CountSeries(const std::map<std::string, double>& m, const std::string& family,
                const std::string& label) {
  int n = 0;
  for (const auto& [series, value] : m) {
    if (absl::StartsWith(series, family + "{") && absl::StrContains(series, label)) ++n;
  }
  return n;
}

// The distinct values of the tenant label over every series.
std::set<std::string> TenantLabels(const std::map<std::string, double>& m) {
  std::set<std::string> tenants;
  for (const auto& [series, value] : m) {
    const size_t at = series.find("tenant=\"");
    if (at == std::string::npos) continue;
    const size_t end = series.find('"', at + 8);
    tenants.insert(series.substr(at + 8, end - at - 8));
  }
  return tenants;
}

std::unique_ptr<v1::Sidecar::Stub> RawStub(const ServerProcess& server) {
  return v1::Sidecar::NewStub(
      grpc::CreateChannel(server.data_target(), grpc::InsecureChannelCredentials()));
}

absl::StatusOr<std::string> RawAttach(v1::Sidecar::Stub& stub, const std::string& tenant) {
  v1::AttachRequest request;
  *request.mutable_layout() = MakeLayout(1, 1, 1, 8, v1::DTYPE_FLOAT16, 4);
  request.set_tenant(tenant);
  request.set_num_blocks(4);
  v1::AttachResponse response;
  grpc::ClientContext context;
  const grpc::Status status = stub.Attach(&context, request, &response);
  if (!status.ok()) return kvsidecar::ToStatus(status);
  return response.session_id();
}

absl::Status RawDetach(v1::Sidecar::Stub& stub, const std::string& session_id) {
  v1::DetachRequest request;
  request.set_session_id(session_id);
  v1::DetachResponse response;
  grpc::ClientContext context;
  return kvsidecar::ToStatus(stub.Detach(&context, request, &response));
}

absl::StatusOr<std::unique_ptr<ServerProcess>> StartWithMetrics(
    std::vector<std::string> extra_args = {}) {
  ServerProcess::Options options;
  options.extra_args = {"--metrics_listen=127.0.0.1:0"};
  options.extra_args.insert(options.extra_args.end(), extra_args.begin(), extra_args.end());
  return ServerProcess::Start(options);
}

// A tenant whose last session detached has no series left (issue 19: its arena bytes and
// sequences stayed at their last values for good).
TEST(MetricsE2eTest, SeriesOfAnEndedTenantGoAway) {
  auto server = StartWithMetrics();
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = (*server)->Connect();
  ASSERT_TRUE(client.ok()) << client.status();
  v1::AttachRequest attach;
  *attach.mutable_layout() = MakeLayout(2, 2, 4, 16, v1::DTYPE_FLOAT16, 4);
  attach.set_num_blocks(64);
  attach.set_tenant("gone-tenant");
  auto session = (*client)->Attach(attach);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE((*session)->CreateSequence(KeyDiffPolicy(), MakeBudget(8), "k").ok());
  ASSERT_TRUE(WriteTokens(**session, "k", 20, 1, /*compress_if_over_budget=*/true).ok());
  auto m = Scrape((*server)->metrics_target());
  EXPECT_GT(m["kvsidecar_tenant_arena_used_bytes{tenant=\"gone-tenant\"}"], 0);
  EXPECT_EQ(m["kvsidecar_tenant_sequences{tenant=\"gone-tenant\"}"], 1);

  ASSERT_TRUE((*session)->Detach().ok());
  std::string text;
  m = Scrape((*server)->metrics_target(), &text);
  EXPECT_EQ(CountSeries(m, "kvsidecar_tenant_arena_used_bytes", "gone-tenant"), 0) << text;
  EXPECT_EQ(CountSeries(m, "kvsidecar_tenant_sequences", "gone-tenant"), 0) << text;
  EXPECT_THAT(text, ::testing::Not(HasSubstr("gone-tenant")));
  EXPECT_EQ(m["kvsidecar_sessions"], 0);
}

// Client-named tenants beyond --metrics_max_tenants share one tenant="_other" series; tenants
// named in the configuration always keep their own. 3,000 tenants come and go; no scrape ever
// shows more than configured + cap + 1 tenant label values, and none is left once they end.
TEST(MetricsE2eTest, TenantLabelsAreBounded) {
  const std::string dir = MakeTempDir("kvs_metrics_cap");
  const std::string config = dir + "/kvsidecar.yaml";
  {
    std::ofstream out(config);
    out << "metrics_max_tenants: 4\nquotas:\n  configured-tenant:\n    sequences: 100\n";
  }
  auto server = StartWithMetrics({"--config=" + config});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = RawStub(**server);
  constexpr int kTenants = 3000;
  constexpr int kLive = 24;  // sessions held at once
  constexpr int kCap = 4;
  auto configured = RawAttach(*stub, "configured-tenant");
  ASSERT_TRUE(configured.ok()) << configured.status();
  std::vector<std::string> live;
  size_t most_labels = 0;
  for (int t = 0; t < kTenants; ++t) {
    auto session = RawAttach(*stub, absl::StrCat("client-tenant-", t));
    ASSERT_TRUE(session.ok()) << t << ": " << session.status();
    live.push_back(*session);
    if (live.size() == kLive) {
      if (t % 600 == kLive - 1) {
        std::string text;
        auto m = Scrape((*server)->metrics_target(), &text);
        const std::set<std::string> labels = TenantLabels(m);
        most_labels = std::max(most_labels, labels.size());
        ASSERT_LE(labels.size(), kCap + 2u) << ::testing::PrintToString(labels);
        EXPECT_TRUE(labels.count("configured-tenant")) << ::testing::PrintToString(labels);
        EXPECT_TRUE(labels.count("_other")) << ::testing::PrintToString(labels);
        // Folding loses nothing: the client tenants' reserved bytes (own series and _other)
        // add up to kLive sessions' worth.
        double reserved = 0;
        for (const auto& [series, value] : m) {
          if (absl::StartsWith(series, "kvsidecar_tenant_arena_reserved_bytes{") &&
              !absl::StrContains(series, "configured-tenant")) {
            reserved += value;
          }
        }
        const double per_session =
            m["kvsidecar_tenant_arena_reserved_bytes{tenant=\"configured-tenant\"}"];
        EXPECT_GT(per_session, 0) << text;
        EXPECT_EQ(reserved, kLive * per_session) << text;
      }
      for (const std::string& id : live) ASSERT_TRUE(RawDetach(*stub, id).ok());
      live.clear();
    }
  }
  for (const std::string& id : live) ASSERT_TRUE(RawDetach(*stub, id).ok());
  EXPECT_GT(most_labels, 0u);
  std::string text;
  const auto m = Scrape((*server)->metrics_target(), &text);
  EXPECT_EQ(TenantLabels(m), std::set<std::string>{"configured-tenant"}) << text;
}

// kvsidecar_sequence_budget_tokens is a histogram of the budgets given to sequences: its counts
// only grow, whatever the sequences do afterwards (it was rebuilt from the live sequences at
// every scrape, so counts fell when a sequence ended).
TEST(MetricsE2eTest, BudgetHistogramOnlyCountsUp) {
  auto server = StartWithMetrics();
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = (*server)->Connect();
  ASSERT_TRUE(client.ok()) << client.status();
  auto session = (*client)->Attach(MakeLayout(2, 2, 4, 16, v1::DTYPE_FLOAT16, 4), "default", 64);
  ASSERT_TRUE(session.ok()) << session.status();
  const std::string count = "kvsidecar_sequence_budget_tokens_count{policy=\"keydiff\"}";
  const std::string le64 = "kvsidecar_sequence_budget_tokens_bucket{le=\"64\",policy=\"keydiff\"}";
  std::map<std::string, double> last;
  // Every series of the histogram is at least what the previous scrape showed.
  auto scrape_and_check = [&] {
    auto m = Scrape((*server)->metrics_target());
    for (const auto& [series, value] : m) {
      if (!absl::StartsWith(series, "kvsidecar_sequence_budget_tokens")) continue;
      EXPECT_GE(value, last[series]) << series << " went down";
      last[series] = value;
    }
    return m;
  };
  for (int round = 0; round < 3; ++round) {
    ASSERT_TRUE((*session)->CreateSequence(KeyDiffPolicy(), MakeBudget(8), "a").ok());
    ASSERT_TRUE((*session)->CreateSequence(KeyDiffPolicy(), MakeBudget(32), "b").ok());
    auto m = scrape_and_check();
    EXPECT_EQ(m[count], 2 * (round + 1));
    EXPECT_EQ(m[le64], 2 * (round + 1));
    ASSERT_TRUE((*session)->ReleaseSequence("a").ok());
    ASSERT_TRUE((*session)->ReleaseSequence("b").ok());
    for (int scrape = 0; scrape < 2; ++scrape) {
      m = scrape_and_check();
      EXPECT_EQ(m[count], 2 * (round + 1));
      EXPECT_EQ(m["kvsidecar_sequence_budget_tokens_sum{policy=\"keydiff\"}"], 40 * (round + 1));
    }
  }
}

// Values are printed exactly: a byte count of 16 digits keeps every digit (it was printed with
// 6 significant digits past 10^15).
TEST(MetricsE2eTest, LargeByteCountsArePrintedExactly) {
  auto server = StartWithMetrics({"--disk_tier_bytes=1234567890123457"});
  ASSERT_TRUE(server.ok()) << server.status();
  std::string text;
  Scrape((*server)->metrics_target(), &text);
  EXPECT_THAT(text, HasSubstr("kvsidecar_tier_capacity_bytes{tier=\"disk\"} 1234567890123457\n"));
  EXPECT_THAT(text, HasSubstr("kvsidecar_tier_capacity_bytes{tier=\"arena\"} 1073741824\n"));
}

// kvsidecar_backend_healthy (and Admin.GetStats) follow the backend's own health report. The
// simulated device reports a device fault while KVS_DEVICE_SIM_FAULT_FILE exists.
TEST(MetricsE2eTest, BackendHealthyFollowsTheBackend) {
  const std::string dir = MakeTempDir("kvs_metrics_health");
  const std::string fault = dir + "/fault";
  ASSERT_EQ(setenv("KVS_DEVICE_SIM_FAULT_FILE", fault.c_str(), 1), 0);
  auto server = StartWithMetrics({"--backend=device-sim"});
  unsetenv("KVS_DEVICE_SIM_FAULT_FILE");
  ASSERT_TRUE(server.ok()) << server.status();
  auto admin = (*server)->ConnectAdmin();
  ASSERT_TRUE(admin.ok()) << admin.status();
  const std::string series = "kvsidecar_backend_healthy{backend=\"device-sim\"}";
  auto m = Scrape((*server)->metrics_target());
  EXPECT_EQ(m.count(series), 1u);
  EXPECT_EQ(m[series], 1);
  std::ofstream(fault) << "device lost\n";
  m = Scrape((*server)->metrics_target());
  EXPECT_EQ(m[series], 0);
  auto stats = (*admin)->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_FALSE(stats->backend_healthy());
  ASSERT_EQ(std::remove(fault.c_str()), 0);
  m = Scrape((*server)->metrics_target());
  EXPECT_EQ(m[series], 1);
  stats = (*admin)->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_TRUE(stats->backend_healthy());
}

// kvsidecar_build_info says what runs, and the process_* series are the process's own numbers
// (read here from /proc/<pid> as well: the test runs the server as its own child).
TEST(MetricsE2eTest, BuildInfoAndProcessSeries) {
  auto server = StartWithMetrics();
  ASSERT_TRUE(server.ok()) << server.status();
  std::string text;
  auto m = Scrape((*server)->metrics_target(), &text);
  EXPECT_THAT(text, HasSubstr("# TYPE kvsidecar_build_info gauge"));
  EXPECT_EQ(m[absl::StrCat("kvsidecar_build_info{backend=\"cpu\",build_type=\"", KVS_BUILD_TYPE,
                           "\",revision=\"", KVS_GIT_REVISION, "\",version=\"", KVS_VERSION,
                           "\"}")],
            1)
      << text;
  EXPECT_THAT(text, HasSubstr("# TYPE process_cpu_seconds_total counter"));
  for (const char* name : {"process_resident_memory_bytes", "process_virtual_memory_bytes",
                           "process_open_fds", "process_max_fds", "process_start_time_seconds"}) {
    EXPECT_THAT(text, HasSubstr(absl::StrCat("# TYPE ", name, " gauge"))) << name;
  }
  const pid_t pid = (*server)->process().pid();
  // Started by this test a moment ago.
  const double now = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
  EXPECT_GT(m["process_start_time_seconds"], now - 120);
  EXPECT_LE(m["process_start_time_seconds"], now + 1);
  // RSS within 10 % of what /proc/<pid>/status says (the scrape itself allocates a little).
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  double rss_kib = 0;
  while (std::getline(status, line)) {
    if (absl::StartsWith(line, "VmRSS:")) {
      std::vector<std::string> parts = absl::StrSplit(line, ' ', absl::SkipEmpty());
      ASSERT_TRUE(absl::SimpleAtod(parts[1], &rss_kib)) << line;
    }
  }
  ASSERT_GT(rss_kib, 0);
  EXPECT_NEAR(m["process_resident_memory_bytes"], rss_kib * 1024, 0.1 * rss_kib * 1024);
  EXPECT_GT(m["process_virtual_memory_bytes"], m["process_resident_memory_bytes"]);
  EXPECT_GT(m["process_open_fds"], 3);
  EXPECT_GT(m["process_max_fds"], m["process_open_fds"]);
  // Descriptors: this test may read the sidecar's fd directory where it runs as root.
  std::error_code error;
  double fds = 0;
  for (std::filesystem::directory_iterator it(absl::StrCat("/proc/", pid, "/fd"), error), end;
       !error && it != end; it.increment(error)) {
    ++fds;
  }
  if (!error) {
    EXPECT_NEAR(m["process_open_fds"], fds, 4);
  }
  // CPU time only goes up, and work adds to it.
  const double cpu = m["process_cpu_seconds_total"];
  EXPECT_GT(cpu, 0);
  auto client = (*server)->Connect();
  ASSERT_TRUE(client.ok()) << client.status();
  // Refused calls (no layout) are work enough.
  for (int i = 0; i < 200; ++i) EXPECT_FALSE((*client)->Attach(v1::AttachRequest()).ok());
  EXPECT_GE(Scrape((*server)->metrics_target())["process_cpu_seconds_total"], cpu);
}

}  // namespace
}  // namespace kvs_e2e
