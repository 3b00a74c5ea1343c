// Metrics: the sidecar's Prometheus metrics on prometheus-cpp (Debian prometheus-cpp-dev), and
// MetricsHttpServer, which serves them at GET /metrics on their own port with cpp-httplib
// (Debian libcpp-httplib-dev) in the text exposition format (version 0.0.4) that
// prometheus-cpp's TextSerializer writes. Values print exactly (a byte count keeps every digit).
//
// Two kinds of series:
//  - Event series live in a prometheus::Registry: counters and histograms updated where the
//    event happens (RPCs by method and code, budgets given to new sequences). They only count up
//    and last as long as the process (their label values are bounded: methods, codes, policies).
//  - State series are derived from the pool at every scrape by the collectors (bytes per tier,
//    sessions, per-tenant usage, backend health). A series exists only while its state does:
//    the series of a tenant whose last session ended are gone from the next scrape.
//
// The tenant label is bounded by TenantLabeler: tenants named in the configuration keep their
// own value, at most `max_tenants` others get theirs, and the rest share tenant="_other".
//
// Naming follows Prometheus conventions: kvsidecar_ prefix, base units (_bytes, _seconds),
// counters end in _total.
//
// Threading: everything is thread-safe. A family's series are looked up under prometheus-cpp's
// family mutex; callers on hot paths may keep the returned pointer, which stays valid for the
// registry's lifetime.
#ifndef KVSIDECAR_SERVICE_METRICS_H_
#define KVSIDECAR_SERVICE_METRICS_H_

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace httplib {
class Server;
}

namespace kvs {

// Label name -> value (prometheus::Labels).
using MetricLabels = std::map<std::string, std::string>;

// Bucket bounds for latencies in seconds: 100 us .. 10 s.
std::vector<double> LatencyBuckets();
// Bounds for token budgets per layer: 0 (unbounded), 64 .. 65536.
std::vector<double> BudgetBuckets();

// A family built at scrape time: AddSample sums samples that share their labels (series folded
// into tenant="_other" add up).
class StateFamily {
 public:
  StateFamily(std::string name, std::string help, prometheus::MetricType type);
  void AddSample(const MetricLabels& labels, double value);
  prometheus::MetricFamily Build() const;

 private:
  std::string name_;
  std::string help_;
  prometheus::MetricType type_;
  std::map<MetricLabels, double> samples_;
};

class MetricsRegistry {
 public:
  MetricsRegistry();
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  // The event series of family `name` with `labels`, created on first use. A name is one type
  // for good: asking for it as another type (or an invalid name) is a programming error (aborts
  // in debug, returns a private dummy in release so that a bug never takes the server down).
  prometheus::Counter* GetCounter(const std::string& name, const std::string& help,
                                  const MetricLabels& labels = {});
  prometheus::Gauge* GetGauge(const std::string& name, const std::string& help,
                              const MetricLabels& labels = {});
  prometheus::Histogram* GetHistogram(const std::string& name, const std::string& help,
                                      const std::vector<double>& bounds,
                                      const MetricLabels& labels = {});

  // `collect` runs at every scrape, outside any registry lock, and appends the state families
  // it derives from current state.
  using Collector = std::function<void(std::vector<prometheus::MetricFamily>*)>;
  void AddCollector(Collector collect);

  // Every family (event and state), sorted by name.
  std::vector<prometheus::MetricFamily> Collect();
  // Collect() in the text exposition format.
  std::string Render();

 private:
  enum class Type { kCounter, kGauge, kHistogram };
  struct FamilyRef {
    Type type;
    void* family;  // prometheus::Family<Counter|Gauge|Histogram>, owned by registry_
  };
  void* FamilyFor(const std::string& name, const std::string& help, Type type)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::shared_ptr<prometheus::Registry> registry_;
  absl::Mutex mu_;
  std::map<std::string, FamilyRef> families_ ABSL_GUARDED_BY(mu_);
  std::vector<Collector> collectors_ ABSL_GUARDED_BY(mu_);
  // Returned for a type clash instead of crashing.
  prometheus::Counter dummy_counter_;
  prometheus::Gauge dummy_gauge_;
  prometheus::Histogram dummy_histogram_{prometheus::Histogram::BucketBoundaries{}};
};

// Bounds the values of the tenant label. Tenants named in the configuration always have their
// own value. Other tenants get their own while fewer than `max_tenants` of them hold one, first
// come first served; the rest share kOtherTenant. A tenant keeps its value while it is live and
// frees its place once it has ended (it is absent from a later Assign). Thread-safe.
class TenantLabeler {
 public:
  static constexpr char kOtherTenant[] = "_other";

  TenantLabeler(std::set<std::string> configured, int max_tenants);
  // The label value of each tenant of `live` (the tenants alive now, each once), in order.
  std::vector<std::string> Assign(const std::vector<std::string>& live);

 private:
  const std::set<std::string> configured_;
  const size_t max_tenants_;
  absl::Mutex mu_;
  std::set<std::string> admitted_ ABSL_GUARDED_BY(mu_);  // unconfigured tenants with a label
};

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
