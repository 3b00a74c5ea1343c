#include "service/metrics.h"

#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "httplib.h"

namespace kvs {
namespace {

using ::testing::HasSubstr;

TEST(MetricsTest, RendersCountersGaugesAndLabels) {
  MetricsRegistry registry;
  registry.GetCounter("kvsidecar_x_total", "Things.", {{"method", "Attach"}, {"code", "OK"}})
      ->Increment(2);
  registry.GetCounter("kvsidecar_x_total", "Things.", {{"method", "Attach"}, {"code", "OK"}})
      ->Increment();
  registry.GetGauge("kvsidecar_y_bytes", "Bytes.")->Set(1.5);
  registry.GetGauge("kvsidecar_z", "Quoted.", {{"tenant", "a\"b\\c\nd"}})->Set(-3);
  const std::string text = registry.Render();
  EXPECT_THAT(text, HasSubstr("# HELP kvsidecar_x_total Things.\n# TYPE kvsidecar_x_total "
                              "counter\nkvsidecar_x_total{code=\"OK\",method=\"Attach\"} 3\n"));
  EXPECT_THAT(text, HasSubstr("# TYPE kvsidecar_y_bytes gauge\nkvsidecar_y_bytes 1.5\n"));
  EXPECT_THAT(text, HasSubstr("kvsidecar_z{tenant=\"a\\\"b\\\\c\\nd\"} -3\n"));
  // Families in name order.
  EXPECT_LT(text.find("kvsidecar_x_total"), text.find("kvsidecar_y_bytes"));
}

TEST(MetricsTest, ValuesPrintExactly) {
  MetricsRegistry registry;
  registry.GetGauge("kvsidecar_a_bytes", "A.")->Set(1234567890123457.0);
  registry.GetGauge("kvsidecar_b_bytes", "B.")->Set(229376);
  registry.GetGauge("kvsidecar_c_seconds", "C.")->Set(0.1234567891);
  const std::string text = registry.Render();
  EXPECT_THAT(text, HasSubstr("kvsidecar_a_bytes 1234567890123457\n"));
  EXPECT_THAT(text, HasSubstr("kvsidecar_b_bytes 229376\n"));
  EXPECT_THAT(text, HasSubstr("kvsidecar_c_seconds 0.1234567891\n"));
}

TEST(MetricsTest, HistogramBucketsAreCumulative) {
  MetricsRegistry registry;
  prometheus::Histogram* h =
      registry.GetHistogram("kvsidecar_d_seconds", "Latency.", {0.1, 1.0}, {{"m", "A"}});
  for (double v : {0.05, 0.1, 0.5, 2.0, 3.0}) h->Observe(v);
  const std::string text = registry.Render();
  EXPECT_THAT(text, HasSubstr("# TYPE kvsidecar_d_seconds histogram\n"));
  EXPECT_THAT(text, HasSubstr("kvsidecar_d_seconds_bucket{m=\"A\",le=\"0.1\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("kvsidecar_d_seconds_bucket{m=\"A\",le=\"1\"} 3\n"));
  EXPECT_THAT(text, HasSubstr("kvsidecar_d_seconds_bucket{m=\"A\",le=\"+Inf\"} 5\n"));
  EXPECT_THAT(text, HasSubstr("kvsidecar_d_seconds_sum{m=\"A\"} 5.65\n"));
  EXPECT_THAT(text, HasSubstr("kvsidecar_d_seconds_count{m=\"A\"} 5\n"));
}

TEST(MetricsTest, TypeClashGetsADummyNotACrash) {
#ifdef NDEBUG
  MetricsRegistry registry;
  registry.GetCounter("kvsidecar_t_total", "T.")->Increment();
  registry.GetGauge("kvsidecar_t_total", "T.")->Set(7);
  EXPECT_THAT(registry.Render(), HasSubstr("kvsidecar_t_total 1\n"));
#else
  GTEST_SKIP() << "asserts in debug builds";
#endif
}

TEST(MetricsTest, CollectorsRunAtRenderAndUpdatesAreThreadSafe) {
  MetricsRegistry registry;
  int runs = 0;
  registry.AddCollector([&](std::vector<prometheus::MetricFamily>* out) {
    StateFamily family("kvsidecar_runs", "Runs.", prometheus::MetricType::Gauge);
    family.AddSample({}, ++runs);
    out->push_back(family.Build());
  });
  prometheus::Counter* counter = registry.GetCounter("kvsidecar_c_total", "C.");
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 1000; ++i) {
        counter->Increment();
        registry.GetHistogram("kvsidecar_h", "H.", {1}, {})->Observe(0.5);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(counter->Value(), 4000);
  const std::string text = registry.Render();
  EXPECT_THAT(text, HasSubstr("kvsidecar_runs 1\n"));
  EXPECT_THAT(text, HasSubstr("kvsidecar_h_count 4000\n"));
  EXPECT_THAT(registry.Render(), HasSubstr("kvsidecar_runs 2\n"));
}

TEST(MetricsTest, StateFamiliesSumFoldedSamples) {
  StateFamily family("kvsidecar_s", "S.", prometheus::MetricType::Gauge);
  family.AddSample({{"tenant", "_other"}}, 2);
  family.AddSample({{"tenant", "a"}}, 1);
  family.AddSample({{"tenant", "_other"}}, 3);
  const prometheus::MetricFamily built = family.Build();
  ASSERT_EQ(built.metric.size(), 2u);
  EXPECT_EQ(built.metric[0].label[0].value, "_other");
  EXPECT_EQ(built.metric[0].gauge.value, 5);
  EXPECT_EQ(built.metric[1].gauge.value, 1);
}

TEST(MetricsTest, TenantLabelerKeepsConfiguredCapsOthersAndFreesEndedOnes) {
  TenantLabeler labeler({"conf"}, 2);
  using V = std::vector<std::string>;
  EXPECT_EQ(labeler.Assign({"a", "b", "c", "conf"}), (V{"a", "b", "_other", "conf"}));
  // Places are kept while live, whatever the order.
  EXPECT_EQ(labeler.Assign({"c", "b", "a"}), (V{"_other", "b", "a"}));
  // "a" ended: "c" takes its place.
  EXPECT_EQ(labeler.Assign({"b", "c", "d"}), (V{"b", "c", "_other"}));
  // A client may not take the shared value for itself.
  EXPECT_EQ(labeler.Assign({"_other"}), (V{"_other"}));
  TenantLabeler none({}, 0);
  EXPECT_EQ(none.Assign({"x"}), (V{"_other"}));
}

TEST(MetricsTest, HttpServerServesMetrics) {
  MetricsRegistry registry;
  registry.GetGauge("kvsidecar_sessions", "Sessions.")->Set(4);
  auto server = MetricsHttpServer::Start("127.0.0.1:0", &registry);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = (*server)->address();
  const int port = std::stoi(address.substr(address.rfind(':') + 1));
  ASSERT_GT(port, 0);
  httplib::Client client("127.0.0.1", port);
  auto response = client.Get("/metrics");
  ASSERT_TRUE(response);
  EXPECT_EQ(response->status, 200);
  EXPECT_THAT(response->body, HasSubstr("kvsidecar_sessions 4\n"));
  EXPECT_EQ(client.Get("/nope")->status, 404);
  // A second server on the same port is refused, naming the flag.
  auto clash = MetricsHttpServer::Start(address, &registry);
  EXPECT_EQ(clash.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(clash.status().message()), HasSubstr("--metrics_listen"));
  (*server)->Stop();
}

}  // namespace
}  // namespace kvs
