#include "bench/bench_util.h"

#include <fcntl.h>
#include <immintrin.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
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

constexpr int kDotDim = 256;
constexpr int kDotRows = 4, kDotCols = 3;
constexpr int64_t kDotPasses = 200000;  // per thread: 200000 x 4 x 3 x 256 x 2 = 1.2 GFLOP

// Returns a value derived from the accumulators so the loop cannot be optimised away.
__attribute__((target("avx2,fma"))) float DotLoopAvx2(const float* a, const float* b,
                                                      int64_t passes) {
  __m256 acc[kDotRows][kDotCols];
  for (auto& row : acc) {
    for (auto& x : row) x = _mm256_setzero_ps();
  }
  for (int64_t p = 0; p < passes; ++p) {
    for (int d = 0; d < kDotDim; d += 8) {
      __m256 col[kDotCols];
#pragma GCC unroll 4
      for (int c = 0; c < kDotCols; ++c) col[c] = _mm256_loadu_ps(b + c * kDotDim + d);
#pragma GCC unroll 4
      for (int r = 0; r < kDotRows; ++r) {
        const __m256 x = _mm256_loadu_ps(a + r * kDotDim + d);
#pragma GCC unroll 4
        for (int c = 0; c < kDotCols; ++c) acc[r][c] = _mm256_fmadd_ps(x, col[c], acc[r][c]);
      }
    }
  }
  __m256 sum = _mm256_setzero_ps();
  for (auto& row : acc) {
    for (auto& x : row) sum = _mm256_add_ps(sum, x);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  return lanes[0] + lanes[7];
}

float DotLoopScalar(const float* a, const float* b, int64_t passes) {
  float acc[kDotRows][kDotCols] = {};
  for (int64_t p = 0; p < passes; ++p) {
    for (int d = 0; d < kDotDim; ++d) {
      for (int r = 0; r < kDotRows; ++r) {
        for (int c = 0; c < kDotCols; ++c) acc[r][c] += a[r * kDotDim + d] * b[c * kDotDim + d];
      }
    }
  }
  return acc[0][0] + acc[kDotRows - 1][kDotCols - 1];
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

double DotPeakFlopsPerSecond(int threads, int repeats) {
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const int64_t passes = avx2 ? kDotPasses : kDotPasses / 20;
  threads = std::max(1, threads);
  std::vector<float> sink(threads);
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const auto start = Clock::now();
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t) {
      workers.emplace_back([&, t] {
        // Small values so the sums stay finite; per-thread data in its own L1.
        std::vector<float> a(kDotRows * kDotDim, 1e-3f), b(kDotCols * kDotDim, 1e-3f);
        sink[t] = avx2 ? DotLoopAvx2(a.data(), b.data(), passes)
                       : DotLoopScalar(a.data(), b.data(), passes);
      });
    }
    for (auto& w : workers) w.join();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count());
  }
  volatile float keep = sink[0];
  (void)keep;
  return 2.0 * kDotRows * kDotCols * kDotDim * static_cast<double>(passes) * threads / best;
}

double DotPeakFlopsPerCpuSecond(int repeats) {
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const int64_t passes = avx2 ? kDotPasses : kDotPasses / 20;
  std::vector<float> a(kDotRows * kDotDim, 1e-3f), b(kDotCols * kDotDim, 1e-3f);
  double best = 1e30;
  float sink = 0;
  for (int r = 0; r < repeats; ++r) {
    timespec start, end;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &start);
    sink +=
        avx2 ? DotLoopAvx2(a.data(), b.data(), passes) : DotLoopScalar(a.data(), b.data(), passes);
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &end);
    best = std::min(best, (end.tv_sec - start.tv_sec) + 1e-9 * (end.tv_nsec - start.tv_nsec));
  }
  volatile float keep = sink;
  (void)keep;
  return 2.0 * kDotRows * kDotCols * kDotDim * static_cast<double>(passes) / best;
}

double ProcessCpuSeconds() {
  timespec now;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &now);
  return now.tv_sec + 1e-9 * now.tv_nsec;
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
  // KVS_BENCH_SERVER_LOG: keep what the server wrote (its trace lines, say) past the run.
  if (const char* keep = std::getenv("KVS_BENCH_SERVER_LOG"); keep != nullptr && *keep != 0) {
    std::ifstream log(data_dir_ + "/server.log", std::ios::binary);
    std::ofstream(keep, std::ios::binary | std::ios::app) << log.rdbuf();
  }
  std::error_code ignored;
  std::filesystem::remove_all(data_dir_, ignored);
}

}  // namespace kvs::bench
