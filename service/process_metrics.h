// Process metrics: the series every Prometheus client library exports about its own process
// (process_cpu_seconds_total, process_resident_memory_bytes, process_virtual_memory_bytes,
// process_open_fds, process_max_fds, process_start_time_seconds; names and units as the
// Prometheus client libraries' "process collector" gives them), read from /proc/self at every
// scrape, and kvsidecar_build_info: a gauge of 1 whose labels say what is running (version, git
// revision, build type, backend). prometheus-cpp has no process collector, so it is here.
//
// Threading: pure functions of /proc/self; safe from any thread.
#ifndef KVSIDECAR_SERVICE_PROCESS_METRICS_H_
#define KVSIDECAR_SERVICE_PROCESS_METRICS_H_

#include <prometheus/metric_family.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "service/metrics.h"

namespace kvs {

struct ProcessStats {
  double cpu_seconds = 0;            // user + system time of every thread
  double resident_bytes = 0;         // RSS
  double virtual_bytes = 0;          // VmSize
  double open_fds = 0;               // entries of /proc/self/fd
  double max_fds = 0;                // RLIMIT_NOFILE soft limit
  double start_time_seconds = 0;     // since the Unix epoch
};

// /proc/self/stat, /proc/self/fd, getrlimit and the boot time in /proc/stat; INTERNAL naming
// the file when one cannot be read or parsed.
absl::StatusOr<ProcessStats> ReadProcessStats();

// Appends the process_* families (none when /proc cannot be read: a scrape still answers) and,
// when `build_info` is not empty, kvsidecar_build_info{build_info...} 1.
void CollectProcessMetrics(const MetricLabels& build_info,
                           std::vector<prometheus::MetricFamily>* out);

}  // namespace kvs

#endif  // KVSIDECAR_SERVICE_PROCESS_METRICS_H_
