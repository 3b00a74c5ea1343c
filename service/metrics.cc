#include "service/metrics.h"

#include <sys/socket.h>

#include <cassert>
#include <cmath>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "httplib.h"
#include "service/log.h"

namespace kvs {
namespace {

std::string EscapeLabelValue(absl::string_view value) {
  std::string out;
  for (char c : value) {
    if (c == '\\' || c == '"') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string FormatValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  if (value == std::floor(value) && std::fabs(value) < 1e15) {
    return absl::StrCat(static_cast<int64_t>(value));
  }
  return absl::StrCat(value);
}

// `{a="x"}` + `,le="0.5"` merged into one label set.
std::string WithLe(const std::string& labels, const std::string& le) {
  const std::string pair = absl::StrCat("le=\"", le, "\"");
  if (labels.empty()) return absl::StrCat("{", pair, "}");
  return absl::StrCat(labels.substr(0, labels.size() - 1), ",", pair, "}");
}

}  // namespace

std::string RenderLabels(const MetricLabels& labels) {
  if (labels.empty()) return "";
  std::string out = "{";
  for (size_t i = 0; i < labels.size(); ++i) {
    if (i > 0) out += ',';
    absl::StrAppend(&out, labels[i].first, "=\"", EscapeLabelValue(labels[i].second), "\"");
  }
  out += '}';
  return out;
}

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::Observe(double value) {
  size_t bucket = 0;
  while (bucket < bounds_.size() && value > bounds_[bucket]) ++bucket;
  absl::MutexLock lock(&mu_);
  ++counts_[bucket];
  sum_ += value;
  ++count_;
}

void Histogram::Reset() {
  absl::MutexLock lock(&mu_);
  counts_.assign(bounds_.size() + 1, 0);
  sum_ = 0;
  count_ = 0;
}

Histogram::Snapshot Histogram::Read() const {
  Snapshot snapshot;
  snapshot.bounds = bounds_;
  absl::MutexLock lock(&mu_);
  uint64_t running = 0;
  for (uint64_t c : counts_) {
    running += c;
    snapshot.cumulative.push_back(running);
  }
  snapshot.sum = sum_;
  snapshot.count = count_;
  return snapshot;
}

std::vector<double> LatencyBuckets() {
  return {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
          0.05,   0.1,     0.25,   0.5,   1.0,    2.5,   5.0,  10.0};
}

std::vector<double> BudgetBuckets() {
  return {0, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536};
}

MetricsRegistry::Family* MetricsRegistry::FamilyFor(const std::string& name,
                                                    const std::string& help, Type type,
                                                    const std::vector<double>& bounds) {
  auto [it, inserted] = families_.try_emplace(name);
  if (inserted) {
    it->second.type = type;
    it->second.help = help;
    it->second.bounds = bounds;
  }
  if (it->second.type != type) {
    assert(false && "metric family requested with two types");
    KVS_LOG(kError, "metric_type_clash")("name", name);
    return nullptr;
  }
  return &it->second;
}

Counter* MetricsRegistry::GetCounter(const std::string& name, const std::string& help,
                                     const MetricLabels& labels) {
  absl::MutexLock lock(&mu_);
  Family* family = FamilyFor(name, help, Type::kCounter, {});
  if (family == nullptr) return &dummy_counter_;
  auto& slot = family->counters[RenderLabels(labels)];
  if (slot == nullptr) slot = std::make_unique<Counter>();
  return slot.get();
}

Gauge* MetricsRegistry::GetGauge(const std::string& name, const std::string& help,
                                 const MetricLabels& labels) {
  absl::MutexLock lock(&mu_);
  Family* family = FamilyFor(name, help, Type::kGauge, {});
  if (family == nullptr) return &dummy_gauge_;
  auto& slot = family->gauges[RenderLabels(labels)];
  if (slot == nullptr) slot = std::make_unique<Gauge>();
  return slot.get();
}

Histogram* MetricsRegistry::GetHistogram(const std::string& name, const std::string& help,
                                         const std::vector<double>& bounds,
                                         const MetricLabels& labels) {
  absl::MutexLock lock(&mu_);
  Family* family = FamilyFor(name, help, Type::kHistogram, bounds);
  if (family == nullptr) return &dummy_histogram_;
  auto& slot = family->histograms[RenderLabels(labels)];
  if (slot == nullptr) slot = std::make_unique<Histogram>(family->bounds);
  return slot.get();
}

void MetricsRegistry::AddCollector(std::function<void()> collect) {
  absl::MutexLock lock(&mu_);
  collectors_.push_back(std::move(collect));
}

std::string MetricsRegistry::Render() {
  std::vector<std::function<void()>> collectors;
  {
    absl::MutexLock lock(&mu_);
    collectors = collectors_;
  }
  for (const auto& collect : collectors) collect();

  std::string out;
  absl::MutexLock lock(&mu_);
  for (const auto& [name, family] : families_) {
    const char* type = family.type == Type::kCounter ? "counter"
                       : family.type == Type::kGauge ? "gauge"
                                                     : "histogram";
    absl::StrAppend(&out, "# HELP ", name, " ", family.help, "\n# TYPE ", name, " ", type, "\n");
    for (const auto& [labels, counter] : family.counters) {
      absl::StrAppend(&out, name, labels, " ", FormatValue(counter->value()), "\n");
    }
    for (const auto& [labels, gauge] : family.gauges) {
      absl::StrAppend(&out, name, labels, " ", FormatValue(gauge->value()), "\n");
    }
    for (const auto& [labels, histogram] : family.histograms) {
      const Histogram::Snapshot s = histogram->Read();
      for (size_t i = 0; i < s.bounds.size(); ++i) {
        absl::StrAppend(&out, name, "_bucket", WithLe(labels, FormatValue(s.bounds[i])), " ",
                        s.cumulative[i], "\n");
      }
      absl::StrAppend(&out, name, "_bucket", WithLe(labels, "+Inf"), " ", s.cumulative.back(),
                      "\n");
      absl::StrAppend(&out, name, "_sum", labels, " ", FormatValue(s.sum), "\n");
      absl::StrAppend(&out, name, "_count", labels, " ", s.count, "\n");
    }
  }
  return out;
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& address, MetricsRegistry* registry) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_listen must be host:port, got '", address, "'"));
  }
  const std::string host = address.substr(0, colon);
  int port = 0;
  if (!absl::SimpleAtoi(address.substr(colon + 1), &port)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_listen must end in a port, got '", address, "'"));
  }
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer());
  server->server_ = std::make_unique<httplib::Server>();
  // httplib's default also sets SO_REUSEPORT, which would let a second sidecar bind a port that
  // is in use and steal half the scrapes; SO_REUSEADDR alone only allows rebinding after exit.
  server->server_->set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  server->server_->Get("/metrics", [registry](const httplib::Request&, httplib::Response& res) {
    res.set_content(registry->Render(), "text/plain; version=0.0.4; charset=utf-8");
  });
  server->server_->Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("kvsidecar: metrics at /metrics\n", "text/plain");
  });
  if (port == 0) {
    port = server->server_->bind_to_any_port(host);
  } else if (!server->server_->bind_to_port(host, port)) {
    port = -1;
  }
  if (port <= 0) {
    return absl::UnavailableError(absl::StrCat("--metrics_listen: cannot listen on ", address,
                                               " (address in use or invalid)"));
  }
  server->address_ = absl::StrCat(host, ":", port);
  httplib::Server* raw = server->server_.get();
  server->thread_ = std::thread([raw] { raw->listen_after_bind(); });
  // stop() before the loop runs would be lost (and Stop would then wait forever).
  for (int i = 0; i < 5000 && !raw->is_running(); ++i) absl::SleepFor(absl::Milliseconds(1));
  return server;
}

void MetricsHttpServer::Stop() {
  if (server_ != nullptr) server_->stop();
  if (thread_.joinable()) thread_.join();
}

MetricsHttpServer::~MetricsHttpServer() { Stop(); }

}  // namespace kvs
