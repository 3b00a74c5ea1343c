#include "service/process_metrics.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace kvs {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::InternalError(absl::StrCat("cannot read ", path));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// btime of /proc/stat: the boot time, seconds since the epoch (start times count from it).
absl::StatusOr<double> BootTime() {
  absl::StatusOr<std::string> stat = ReadFile("/proc/stat");
  if (!stat.ok()) return stat.status();
  for (absl::string_view line : absl::StrSplit(*stat, '\n')) {
    if (absl::ConsumePrefix(&line, "btime ")) {
      int64_t seconds = 0;
      if (absl::SimpleAtoi(line, &seconds)) return static_cast<double>(seconds);
    }
  }
  return absl::InternalError("/proc/stat has no btime line");
}

}  // namespace

absl::StatusOr<ProcessStats> ReadProcessStats() {
  absl::StatusOr<std::string> stat = ReadFile("/proc/self/stat");
  if (!stat.ok()) return stat.status();
  // Fields after the command name, which is in parentheses and may hold spaces (proc(5)).
  const size_t close = stat->rfind(')');
  if (close == std::string::npos) return absl::InternalError("/proc/self/stat: no ')'");
  const std::vector<std::string> fields =
      absl::StrSplit(absl::string_view(*stat).substr(close + 2), ' ', absl::SkipEmpty());
  // proc(5) numbers fields from 1 (pid): field 3, state, is fields[0] here.
  auto field = [&](int number) -> absl::StatusOr<double> {
    const size_t index = static_cast<size_t>(number - 3);
    double value = 0;
    if (index >= fields.size() || !absl::SimpleAtod(fields[index], &value)) {
      return absl::InternalError(absl::StrCat("/proc/self/stat: field ", number, " unreadable"));
    }
    return value;
  };
  const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
  const double page = static_cast<double>(sysconf(_SC_PAGESIZE));
  ProcessStats stats;
  absl::StatusOr<double> utime = field(14), stime = field(15), start = field(22),
                         vsize = field(23), rss = field(24);
  for (const absl::StatusOr<double>* value : {&utime, &stime, &start, &vsize, &rss}) {
    if (!value->ok()) return value->status();
  }
  stats.cpu_seconds = (*utime + *stime) / ticks;
  stats.virtual_bytes = *vsize;
  stats.resident_bytes = *rss * page;
  absl::StatusOr<double> boot = BootTime();
  if (!boot.ok()) return boot.status();
  stats.start_time_seconds = *boot + *start / ticks;
  std::error_code error;
  for (std::filesystem::directory_iterator it("/proc/self/fd", error), end; !error && it != end;
       it.increment(error)) {
    ++stats.open_fds;
  }
  if (error) return absl::InternalError(absl::StrCat("/proc/self/fd: ", error.message()));
  --stats.open_fds;  // the iterator's own descriptor of the directory
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0) stats.max_fds = static_cast<double>(limit.rlim_cur);
  return stats;
}

void CollectProcessMetrics(const MetricLabels& build_info,
                           std::vector<prometheus::MetricFamily>* out) {
  if (!build_info.empty()) {
    StateFamily info("kvsidecar_build_info",
                     "1, labelled with the version, git revision, build type and backend of the "
                     "running kvsidecar.",
                     prometheus::MetricType::Gauge);
    info.AddSample(build_info, 1);
    out->push_back(info.Build());
  }
  absl::StatusOr<ProcessStats> stats = ReadProcessStats();
  if (!stats.ok()) return;
  const struct {
    const char* name;
    const char* help;
    prometheus::MetricType type;
    double value;
  } series[] = {
      {"process_cpu_seconds_total", "Total user and system CPU time spent in seconds.",
       prometheus::MetricType::Counter, stats->cpu_seconds},
      {"process_resident_memory_bytes", "Resident memory size in bytes.",
       prometheus::MetricType::Gauge, stats->resident_bytes},
      {"process_virtual_memory_bytes", "Virtual memory size in bytes.",
       prometheus::MetricType::Gauge, stats->virtual_bytes},
      {"process_open_fds", "Number of open file descriptors.", prometheus::MetricType::Gauge,
       stats->open_fds},
      {"process_max_fds", "Maximum number of open file descriptors.",
       prometheus::MetricType::Gauge, stats->max_fds},
      {"process_start_time_seconds", "Start time of the process since unix epoch in seconds.",
       prometheus::MetricType::Gauge, stats->start_time_seconds},
  };
  for (const auto& s : series) {
    StateFamily family(s.name, s.help, s.type);
    family.AddSample({}, s.value);
    out->push_back(family.Build());
  }
}

}  // namespace kvs
