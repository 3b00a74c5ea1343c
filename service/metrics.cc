#include "service/metrics.h"

#include <sys/socket.h>

#include <prometheus/text_serializer.h>

#include <algorithm>
#include <cassert>
#include <exception>
#include <iterator>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "httplib.h"
#include "service/log.h"

namespace kvs {

std::vector<double> LatencyBuckets() {
  return {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
          0.05,   0.1,     0.25,   0.5,   1.0,    2.5,   5.0,  10.0};
}

std::vector<double> BudgetBuckets() {
  return {0, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536};
}

StateFamily::StateFamily(std::string name, std::string help, prometheus::MetricType type)
    : name_(std::move(name)), help_(std::move(help)), type_(type) {}

void StateFamily::AddSample(const MetricLabels& labels, double value) { samples_[labels] += value; }

prometheus::MetricFamily StateFamily::Build() const {
  prometheus::MetricFamily family;
  family.name = name_;
  family.help = help_;
  family.type = type_;
  for (const auto& [labels, value] : samples_) {
    prometheus::ClientMetric metric;
    for (const auto& [name, label_value] : labels) metric.label.push_back({name, label_value});
    if (type_ == prometheus::MetricType::Counter) {
      metric.counter.value = value;
    } else {
      metric.gauge.value = value;
    }
    family.metric.push_back(std::move(metric));
  }
  return family;
}

MetricsRegistry::MetricsRegistry() : registry_(std::make_shared<prometheus::Registry>()) {}

void* MetricsRegistry::FamilyFor(const std::string& name, const std::string& help, Type type) {
  auto it = families_.find(name);
  if (it == families_.end()) {
    void* family = nullptr;
    // prometheus-cpp throws on an invalid name; a programming error, kept off the server's path.
    try {
      switch (type) {
        case Type::kCounter:
          family = &prometheus::BuildCounter().Name(name).Help(help).Register(*registry_);
          break;
        case Type::kGauge:
          family = &prometheus::BuildGauge().Name(name).Help(help).Register(*registry_);
          break;
        case Type::kHistogram:
          family = &prometheus::BuildHistogram().Name(name).Help(help).Register(*registry_);
          break;
      }
    } catch (const std::exception& e) {
      assert(false && "metric family cannot be registered");
      KVS_LOG(kError, "metric_family_invalid")("name", name)("error", e.what());
      return nullptr;
    }
    it = families_.emplace(name, FamilyRef{type, family}).first;
  }
  if (it->second.type != type) {
    assert(false && "metric family requested with two types");
    KVS_LOG(kError, "metric_type_clash")("name", name);
    return nullptr;
  }
  return it->second.family;
}

prometheus::Counter* MetricsRegistry::GetCounter(const std::string& name, const std::string& help,
                                                 const MetricLabels& labels) {
  absl::MutexLock lock(&mu_);
  auto* family =
      static_cast<prometheus::Family<prometheus::Counter>*>(FamilyFor(name, help, Type::kCounter));
  if (family == nullptr) return &dummy_counter_;
  return &family->Add(labels);
}

prometheus::Gauge* MetricsRegistry::GetGauge(const std::string& name, const std::string& help,
                                             const MetricLabels& labels) {
  absl::MutexLock lock(&mu_);
  auto* family =
      static_cast<prometheus::Family<prometheus::Gauge>*>(FamilyFor(name, help, Type::kGauge));
  if (family == nullptr) return &dummy_gauge_;
  return &family->Add(labels);
}

prometheus::Histogram* MetricsRegistry::GetHistogram(const std::string& name,
                                                     const std::string& help,
                                                     const std::vector<double>& bounds,
                                                     const MetricLabels& labels) {
  absl::MutexLock lock(&mu_);
  auto* family = static_cast<prometheus::Family<prometheus::Histogram>*>(
      FamilyFor(name, help, Type::kHistogram));
  if (family == nullptr) return &dummy_histogram_;
  // The bounds of an existing series are its own: prometheus-cpp ignores them then.
  return &family->Add(labels, bounds);
}

void MetricsRegistry::AddCollector(Collector collect) {
  absl::MutexLock lock(&mu_);
  collectors_.push_back(std::move(collect));
}

std::vector<prometheus::MetricFamily> MetricsRegistry::Collect() {
  std::vector<Collector> collectors;
  {
    absl::MutexLock lock(&mu_);
    collectors = collectors_;
  }
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  for (const Collector& collect : collectors) collect(&families);
  std::stable_sort(families.begin(), families.end(),
                   [](const prometheus::MetricFamily& a, const prometheus::MetricFamily& b) {
                     return a.name < b.name;
                   });
  return families;
}

std::string MetricsRegistry::Render() { return prometheus::TextSerializer().Serialize(Collect()); }

TenantLabeler::TenantLabeler(std::set<std::string> configured, int max_tenants)
    : configured_(std::move(configured)), max_tenants_(std::max(max_tenants, 0)) {}

std::vector<std::string> TenantLabeler::Assign(const std::vector<std::string>& live) {
  absl::MutexLock lock(&mu_);
  // Ended tenants free their places first, so that a newcomer can take one.
  const std::set<std::string> live_set(live.begin(), live.end());
  for (auto it = admitted_.begin(); it != admitted_.end();) {
    it = live_set.contains(*it) ? std::next(it) : admitted_.erase(it);
  }
  std::vector<std::string> labels;
  labels.reserve(live.size());
  for (const std::string& tenant : live) {
    if (configured_.contains(tenant) || admitted_.contains(tenant)) {
      labels.push_back(tenant);
    } else if (admitted_.size() < max_tenants_ && tenant != kOtherTenant) {
      admitted_.insert(tenant);
      labels.push_back(tenant);
    } else {
      labels.push_back(kOtherTenant);
    }
  }
  return labels;
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
