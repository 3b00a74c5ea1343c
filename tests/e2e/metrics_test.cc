// End to end: the real kvsidecar binary serves Prometheus metrics over HTTP (--metrics_listen);
// the scraped values match what the test did (sessions, sequences, tokens per policy, bytes,
// RPC counts by method and code), and log lines carry the client's x-request-id.
#include <grpcpp/grpcpp.h>

#include <map>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "kvsidecar/client.h"
#include "kvsidecar/v1/sidecar.grpc.pb.h"
#include "tests/e2e/e2e_util.h"

namespace kvs_e2e {
namespace {

using ::testing::HasSubstr;

// GET /metrics; series line "name{labels}" -> value.
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
    values[std::string(line.substr(0, space))] = value;
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
  EXPECT_EQ(m["kvsidecar_sequence_budget_tokens_bucket{policy=\"keydiff\",le=\"64\"}"], 1);
  EXPECT_EQ(m["kvsidecar_sequence_budget_tokens_bucket{policy=\"streaming_llm\",le=\"0\"}"], 1);
  EXPECT_EQ(m["kvsidecar_rpcs_total{service=\"Sidecar\",method=\"Attach\",code=\"OK\"}"], 1);
  EXPECT_EQ(m["kvsidecar_rpcs_total{service=\"Sidecar\",method=\"CreateSequence\",code=\"OK\"}"],
            2);
  EXPECT_EQ(m["kvsidecar_rpcs_total{service=\"Sidecar\",method=\"GetLayout\",code=\"NOT_FOUND\"}"],
            1);
  EXPECT_EQ(m["kvsidecar_rpc_duration_seconds_count{service=\"Sidecar\",method=\"Reserve\","
              "code=\"OK\"}"],
            2);
  EXPECT_EQ(m["kvsidecar_rpc_duration_seconds_bucket{service=\"Sidecar\",method=\"Reserve\","
              "code=\"OK\",le=\"+Inf\"}"],
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

}  // namespace
}  // namespace kvs_e2e
