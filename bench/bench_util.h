// Shared pieces of the benchmarks: the same-run hardware limits figures are reported against
// (memcpy bandwidth, a dense fp32 dot loop), latency percentiles, and a real sidecar server process
// on loopback. Single-threaded use from one benchmark at a time.
#ifndef KVSIDECAR_BENCH_BENCH_UTIL_H_
#define KVSIDECAR_BENCH_BENCH_UTIL_H_

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace kvs::bench {

// Bytes per second of a single-threaded memcpy of `bytes` (best of `repeats`), source and
// destination fresh pages touched beforehand. Each copied byte counts once.
double MemcpyBytesPerSecond(uint64_t bytes, int repeats = 5);

// Same with `threads` threads each copying bytes / threads (the machine's copy limit).
double ParallelMemcpyBytesPerSecond(uint64_t bytes, int threads, int repeats = 5);

// FLOP/s of a dense fp32 dot-product loop with `threads` threads (best of `repeats`): each thread
// computes the 4 x 3 dot products of 4 and 3 rows of 256 floats (L1-resident) with one AVX2 FMA
// accumulator per pair, over and over. The compute ceiling that kernels built from register-
// blocked dot products (attention logits) can approach; each multiply-add counts as 2 FLOP. Falls
// back to scalar code (and a correspondingly low figure) on CPUs without AVX2/FMA.
double DotPeakFlopsPerSecond(int threads, int repeats = 3);

// The same loop on one thread, per second of that thread's CPU time: the per-core ceiling,
// insensitive to other processes taking turns on a shared machine (compare with work per
// process CPU second, ProcessCpuSeconds).
double DotPeakFlopsPerCpuSecond(int repeats = 3);

// CPU seconds used by this process so far, all threads together.
double ProcessCpuSeconds();

// Value at quantile q in [0, 1] of `samples` (sorted in place).
double Percentile(std::vector<double>& samples, double q);

// The real `kvsidecar` binary started on ephemeral loopback ports; killed on destruction, when
// its output is appended to the file KVS_BENCH_SERVER_LOG names, if set.
class ServerProcess {
 public:
  // `extra_args` are appended to the defaults (--listen/--admin_listen on port 0, a temp data dir).
  explicit ServerProcess(const std::vector<std::string>& extra_args = {});
  ~ServerProcess();
  const std::string& data_target() const { return data_target_; }
  const std::string& admin_target() const { return admin_target_; }

 private:
  pid_t pid_ = -1;
  std::string data_dir_;
  std::string data_target_;
  std::string admin_target_;
};

}  // namespace kvs::bench

#endif  // KVSIDECAR_BENCH_BENCH_UTIL_H_
