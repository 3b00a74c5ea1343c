// Metrics: a small in-house registry of Prometheus counters, gauges and histograms (with labels),
// rendered in the Prometheus text exposition format (version 0.0.4), and MetricsHttpServer,
// which serves it at GET /metrics on its own port with cpp-httplib (Debian libcpp-httplib-dev).
//
// Naming follows Prometheus conventions: kvsidecar_ prefix, base units (_bytes, _seconds),
// counters end in _total. Series are created on first use and never removed; values that are
// read from the pool (bytes per tier, sessions, tokens per policy) are refreshed by collectors
// that run at scrape time.
//
// Threading: everything is thread-safe. Counter/gauge updates are lock-free atomics; a histogram
// observation takes the histogram's own mutex; series lookup takes the registry mutex (callers
// on hot paths keep the returned pointer, which stays valid for the registry's lifetime).
#ifndef KVSIDECAR_SERVICE_METRICS_H_
#define KVSIDECAR_SERVICE_METRICS_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace httplib {
class Server;
}

namespace kvs {

// Label pairs in the order given, e.g. {{"method", "Attach"}, {"code", "OK"}}.
using MetricLabels = std::vector<std::pair<std::string, std::string>>;

class Counter {
 public:
  void Increment(double amount = 1.0) { value_.fetch_add(amount, std::memory_order_relaxed); }
  // For a counter mirrored at scrape time from a source that is itself monotonic (pool totals).
  void Set(double value) { value_.store(value, std::memory_order_relaxed); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Gauge {
 public:
  void Set(double value) { value_.store(value, std::memory_order_relaxed); }
  void Add(double amount) { value_.fetch_add(amount, std::memory_order_relaxed); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Histogram {
 public:
  // `bounds`: upper bounds of the buckets, increasing; +Inf is implicit.
  explicit Histogram(std::vector<double> bounds);
  void Observe(double value);
  // Replaces every observation (scrape-time histograms over the current state).
  void Reset();
  struct Snapshot {
    std::vector<double> bounds;
    std::vector<uint64_t> cumulative;  // per bound, then +Inf
    double sum = 0;
    uint64_t count = 0;
  };
  Snapshot Read() const;

 private:
  const std::vector<double> bounds_;
  mutable absl::Mutex mu_;
  std::vector<uint64_t> counts_ ABSL_GUARDED_BY(mu_);  // per bucket, last = +Inf
  double sum_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t count_ ABSL_GUARDED_BY(mu_) = 0;
};

// Bucket bounds for latencies in seconds: 100 us .. 10 s.
std::vector<double> LatencyBuckets();
// Bounds for token budgets per layer: 0 (unbounded), 64 .. 65536.
std::vector<double> BudgetBuckets();

class MetricsRegistry {
 public:
  MetricsRegistry() = default;
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  // The series of family `name` with `labels`, created on first use. A name is one type for
  // good: asking for it as another type is a programming error (aborts in debug, returns a
  // private dummy in release so that a bug never takes the server down).
  Counter* GetCounter(const std::string& name, const std::string& help,
                      const MetricLabels& labels = {});
  Gauge* GetGauge(const std::string& name, const std::string& help,
                  const MetricLabels& labels = {});
  Histogram* GetHistogram(const std::string& name, const std::string& help,
                          const std::vector<double>& bounds, const MetricLabels& labels = {});

  // `collect` runs at the start of every Render, outside the registry lock (it may call the
  // Get* methods and set values).
  void AddCollector(std::function<void()> collect);

  // The text exposition format: families sorted by name, series by labels.
  std::string Render();

 private:
  enum class Type { kCounter, kGauge, kHistogram };
  struct Family {
    Type type;
    std::string help;
    std::vector<double> bounds;
    std::map<std::string, std::unique_ptr<Counter>> counters;  // key: rendered labels
    std::map<std::string, std::unique_ptr<Gauge>> gauges;
    std::map<std::string, std::unique_ptr<Histogram>> histograms;
  };
  Family* FamilyFor(const std::string& name, const std::string& help, Type type,
                    const std::vector<double>& bounds) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  std::map<std::string, Family> families_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void()>> collectors_ ABSL_GUARDED_BY(mu_);
  // Returned for a type clash instead of crashing.
  Counter dummy_counter_;
  Gauge dummy_gauge_;
  Histogram dummy_histogram_{{}};
};

// `{a="x",b="y"}` with \ " and newlines escaped; "" for no labels.
std::string RenderLabels(const MetricLabels& labels);

// GET /metrics (text/plain; version=0.0.4) and GET / (a pointer to /metrics) on `address`
// (host:port, port 0 = any free one), on a thread of its own.
class MetricsHttpServer {
 public:
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const std::string& address,
                                                                  MetricsRegistry* registry);
  ~MetricsHttpServer();                                    // stops and joins
  const std::string& address() const { return address_; }  // with the port bound
  void Stop();

 private:
  MetricsHttpServer() = default;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  std::string address_;
};

}  // namespace kvs

#endif  // KVSIDECAR_SERVICE_METRICS_H_
