#include "bench/bench_util.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace kvs::bench {
namespace {

using Clock = std::chrono::steady_clock;

double BestCopySeconds(uint8_t* dst, const uint8_t* src, uint64_t bytes, int threads, int repeats) {
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const auto start = Clock::now();
    if (threads <= 1) {
      std::memcpy(dst, src, bytes);
    } else {
      std::vector<std::thread> workers;
      const uint64_t share = bytes / threads;
      for (int t = 0; t < threads; ++t) {
        const uint64_t begin = share * t;
        const uint64_t size = t == threads - 1 ? bytes - begin : share;
        workers.emplace_back([=] { std::memcpy(dst + begin, src + begin, size); });
      }
      for (auto& w : workers) w.join();
    }
    best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count());
  }
  return best;
}

double CopyBandwidth(uint64_t bytes, int threads, int repeats) {
  std::unique_ptr<uint8_t[]> src(new uint8_t[bytes]);
  std::unique_ptr<uint8_t[]> dst(new uint8_t[bytes]);
  std::memset(src.get(), 1, bytes);
  std::memset(dst.get(), 2, bytes);
  return static_cast<double>(bytes) /
         BestCopySeconds(dst.get(), src.get(), bytes, threads, repeats);
}

std::string ServerBinary() {
  if (const char* path = std::getenv("KVS_SERVER_BINARY")) return path;
  return std::string(KVS_BUILD_DIR) + "/service/kvsidecar";
}

}  // namespace

double MemcpyBytesPerSecond(uint64_t bytes, int repeats) {
  return CopyBandwidth(bytes, 1, repeats);
}

double ParallelMemcpyBytesPerSecond(uint64_t bytes, int threads, int repeats) {
  return CopyBandwidth(bytes, threads, repeats);
}

double Percentile(std::vector<double>& samples, double q) {
  if (samples.empty()) return 0;
  std::sort(samples.begin(), samples.end());
  const size_t index =
      std::min(samples.size() - 1, static_cast<size_t>(q * (samples.size() - 1) + 0.5));
  return samples[index];
}

ServerProcess::ServerProcess(const std::vector<std::string>& extra_args) {
  char dir_template[] = "/tmp/kvs-bench-XXXXXX";
  if (mkdtemp(dir_template) == nullptr) throw std::runtime_error("mkdtemp failed");
  data_dir_ = dir_template;
  const std::string log_path = data_dir_ + "/server.log";

  std::vector<std::string> args = {ServerBinary(), "--listen=127.0.0.1:0",
                                   "--admin_listen=127.0.0.1:0",
                                   "--data_dir=" + data_dir_ + "/data"};
  args.insert(args.end(), extra_args.begin(), extra_args.end());
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0600);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  const int rc = posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) throw std::runtime_error("cannot start " + args[0] + ": " + std::strerror(rc));

  const auto deadline = Clock::now() + std::chrono::seconds(30);
  while (Clock::now() < deadline) {
    std::ifstream log(log_path);
    std::string line;
    while (std::getline(log, line)) {
      if (line.rfind("kvsidecar listening", 0) != 0) continue;
      auto field = [&](const std::string& key) {
        const size_t at = line.find(key + "=");
        const size_t begin = at + key.size() + 1;
        return line.substr(begin, line.find(' ', begin) - begin);
      };
      data_target_ = field("data");
      admin_target_ = field("admin");
      return;
    }
    int status;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      throw std::runtime_error("kvsidecar exited at start; see " + log_path);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  throw std::runtime_error("kvsidecar did not report its ports; see " + log_path);
}

ServerProcess::~ServerProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGTERM);
    int status;
    waitpid(pid_, &status, 0);
  }
  std::error_code ignored;
  std::filesystem::remove_all(data_dir_, ignored);
}

}  // namespace kvs::bench
