// fma_peak: the FMA rates of this machine, the compute limits the window-attention figures of
// bench/kvpress_compare.py are a fraction of. Each thread runs 12 independent chains of fused
// multiply-adds on registers (no loads: more chains than the FMA latency times the pipes, so the
// pipes never wait): 256-bit AVX2 FMAs (16 FLOP per instruction: 8 lanes x multiply and add)
// and, where the CPU has AVX-512, 512-bit ones (32 FLOP; 24 chains, twice the registers).
// Prints JSON lines {"threads": N, "gflops": best of the repeats, "gflops_per_thread": ...,
// "isa": "avx2"} for 1 thread and for --threads threads (default 2), the same with
// "isa": "avx512" where the CPU has it, and last {"kernel_isa": ...}: the level the attention
// kernels run at in a process with this environment (gpu/cpu/cpu_isa.h, KVS_CPU_ISA included).
//
//   fma_peak [--threads=N] [--seconds=S]
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "gpu/cpu/cpu_isa.h"

namespace {

constexpr int kChains = 12;
constexpr int64_t kInnerIterations = 1 << 20;  // 12 M FMA instructions per outer pass

__attribute__((target("avx2,fma"))) float FmaLoop(int64_t passes, float seed) {
  __m256 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_ps(seed + 0.01f * i);
  // a * acc + b with |a| < 1 converges, so the values stay finite however long it runs.
  const __m256 a = _mm256_set1_ps(0.999f);
  const __m256 b = _mm256_set1_ps(1e-3f);
  for (int64_t p = 0; p < passes; ++p) {
    for (int64_t i = 0; i < kInnerIterations; ++i) {
#pragma GCC unroll 12
      for (int c = 0; c < kChains; ++c) acc[c] = _mm256_fmadd_ps(a, acc[c], b);
    }
  }
  __m256 sum = acc[0];
  for (int i = 1; i < kChains; ++i) sum = _mm256_add_ps(sum, acc[i]);
  float out[8];
  _mm256_storeu_ps(out, sum);
  return out[0];
}

constexpr int kChains512 = 24;

KVS_AVX512 float FmaLoop512(int64_t passes, float seed) {
  __m512 acc[kChains512];
  for (int i = 0; i < kChains512; ++i) acc[i] = _mm512_set1_ps(seed + 0.01f * i);
  const __m512 a = _mm512_set1_ps(0.999f);
  const __m512 b = _mm512_set1_ps(1e-3f);
  // Half the inner iterations of FmaLoop with twice the chains: the same instruction count.
  for (int64_t p = 0; p < passes; ++p) {
    for (int64_t i = 0; i < kInnerIterations / 2; ++i) {
#pragma GCC unroll 24
      for (int c = 0; c < kChains512; ++c) acc[c] = _mm512_fmadd_ps(a, acc[c], b);
    }
  }
  __m512 sum = acc[0];
  for (int i = 1; i < kChains512; ++i) sum = _mm512_add_ps(sum, acc[i]);
  float out[16];
  _mm512_storeu_ps(out, sum);
  return out[0];
}

// FLOP per second of `threads` threads each running `passes` outer passes, best of `repeats`;
// `avx512` picks the 512-bit loop (twice the FLOP per instruction, the same instruction count).
double Measure(int threads, int64_t passes, int repeats, bool avx512 = false) {
  double best = 1e30;
  std::vector<float> sink(threads);
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t) {
      workers.emplace_back(
          [&, t] { sink[t] = avx512 ? FmaLoop512(passes, 1.0f + t) : FmaLoop(passes, 1.0f + t); });
    }
    for (auto& w : workers) w.join();
    best = std::min(
        best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  volatile float keep = sink[0];
  (void)keep;
  return (avx512 ? 32.0 : 16.0) * kChains * kInnerIterations * static_cast<double>(passes) *
         threads / best;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 2;
  double seconds = 0.3;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--threads=", 10) == 0)
      threads = std::max(1, std::atoi(argv[i] + 10));
    if (std::strncmp(argv[i], "--seconds=", 10) == 0) seconds = std::atof(argv[i] + 10);
  }
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
    std::printf("{\"error\": \"no AVX2/FMA on this CPU\"}\n");
    return 1;
  }
  // Size the run to about `seconds` per repeat from a one-pass probe.
  const double probe = Measure(1, 1, 1);
  const int64_t passes = std::max<int64_t>(
      1, static_cast<int64_t>(seconds * probe / (16.0 * kChains * kInnerIterations)));
  const bool has_avx512 = kvs::HardwareCpuIsa() == kvs::CpuIsa::kAvx512;
  for (bool avx512 : {false, true}) {
    if (avx512 && !has_avx512) break;
    for (int n : {1, threads}) {
      const double flops = Measure(n, passes, 5, avx512);
      std::printf(
          "{\"threads\": %d, \"gflops\": %.1f, \"gflops_per_thread\": %.1f, \"isa\": \"%s\"}\n", n,
          flops / 1e9, flops / 1e9 / n, avx512 ? "avx512" : "avx2");
      if (n == threads) break;
    }
  }
  std::printf("{\"kernel_isa\": \"%s\"}\n", kvs::CpuIsaName(kvs::DetectedCpuIsa()));
  return 0;
}
