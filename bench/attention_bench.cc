// AttentionProbs on the CPU backend (gpu/cpu/attention_cpu.cc) for the shapes of a 32-layer GQA
// model (Hq=32, H=8, D=128, fp16 keys), reported against limits measured in the same run:
//   - prefill/compress window (w=32, count 8192): compute-bound, FLOP/s as a fraction of a dense
//     fp32 AVX2 FMA dot-product loop on L1-resident data with the same thread count, and per CPU
//     second as a fraction of one core's 512-bit FMA chains where the CPU has AVX-512 (the label
//     names the ISA the kernels ran at; KVS_CPU_ISA=avx2 measures the AVX2 kernel);
//   - decode (w=1, count 2048, 16 sequences x 32 layers): memory-bound, key bytes read per second
//     as a fraction of memcpy bandwidth.
// AttentionColumnSums (the same window, summed over its rows inside the kernel: SnapKV's vote),
// and CaoteScores (gpu/cpu/caote_cpu.cc) over paged fp16 values (decode and prefill shapes), value
// bytes per second as a fraction of memcpy.
// Threads: the benchmark argument (2 = this machine's cores).
#include <benchmark/benchmark.h>
#include <immintrin.h>
#include <sys/mman.h>
#include <time.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "bench/bench_util.h"
#include "gpu/backend.h"
#include "gpu/base/dtype.h"
#include "gpu/cpu/cpu_isa.h"

namespace kvs::bench {
namespace {

constexpr int kLayers = 32, kKvHeads = 8, kQHeads = 32, kHeadDim = 128, kBlockTokens = 16;

void Check(const absl::Status& status) {
  if (!status.ok()) {
    std::fprintf(stderr, "%s\n", status.ToString().c_str());
    std::abort();
  }
}

// `count` fp16 tokens per layer for `layers` (sequence, layer) pairs in one arena with the real
// block layout ([2][H][B][D]; only the key half is written), through shuffled block tables.
struct Cache {
  uint64_t block_bytes = 2ull * kKvHeads * kBlockTokens * kHeadDim * 2;
  uint8_t* arena = nullptr;
  uint64_t arena_bytes = 0;
  std::vector<std::vector<int32_t>> tables;
  std::vector<std::vector<int32_t>> key_positions;
  std::vector<std::vector<float>> queries;
  std::vector<int32_t> query_positions;
  std::vector<float*> probs;
  std::vector<AttentionJob> jobs;

  Cache(int layers, int count, int window) {
    const int blocks_per_layer = (count + kBlockTokens - 1) / kBlockTokens;
    const int64_t blocks = int64_t{layers} * blocks_per_layer;
    arena_bytes = blocks * block_bytes;
    // mmap: the untouched value halves of the blocks cost no memory.
    arena = static_cast<uint8_t*>(
        mmap(nullptr, arena_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    if (arena == MAP_FAILED) std::abort();
    std::vector<int32_t> ids(blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::mt19937 rng(1);
    std::shuffle(ids.begin(), ids.end(), rng);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    // One random key row pattern per block (fast to fill, enough for timing).
    std::vector<uint16_t> pattern(kKvHeads * kBlockTokens * kHeadDim);
    for (auto& h : pattern) h = FloatToFloat16(normal(rng));
    for (int64_t b = 0; b < blocks; ++b) {
      std::memcpy(arena + b * block_bytes, pattern.data(), pattern.size() * 2);
    }
    for (int l = 0; l < layers; ++l) {
      tables.emplace_back(ids.begin() + int64_t{l} * blocks_per_layer,
                          ids.begin() + int64_t{l + 1} * blocks_per_layer);
      std::vector<int32_t> pos(int64_t{kKvHeads} * count);
      for (int h = 0; h < kKvHeads; ++h)
        std::iota(pos.begin() + h * count, pos.begin() + (h + 1) * count, 0);
      key_positions.push_back(std::move(pos));
      std::vector<float> q(int64_t{kQHeads} * window * kHeadDim);
      for (float& x : q) x = normal(rng);
      queries.push_back(std::move(q));
    }
    for (int i = 0; i < window; ++i) query_positions.push_back(count - window + i);
    for (int l = 0; l < layers; ++l) {
      const size_t bytes = sizeof(float) * kQHeads * window * count;
      float* out = static_cast<float*>(std::malloc(bytes));
      std::memset(out, 0, bytes);  // fault the pages in outside the timed loop
      probs.push_back(out);
      AttentionJob job;
      job.keys.arena = arena;
      job.keys.kv_index = 0;
      job.keys.block_table = tables[l].data();
      job.keys.count = count;
      job.keys.num_kv_heads = kKvHeads;
      job.keys.head_dim = kHeadDim;
      job.keys.block_tokens = kBlockTokens;
      job.keys.dtype = DType::kFloat16;
      job.keys.block_bytes = block_bytes;
      job.key_positions = key_positions[l].data();
      job.queries = queries[l].data();
      job.query_positions = query_positions.data();
      job.num_q_heads = kQHeads;
      job.num_queries = window;
      job.scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
      job.probs = out;
      jobs.push_back(job);
    }
  }
  ~Cache() {
    for (float* p : probs) std::free(p);
    munmap(arena, arena_bytes);
  }
  uint64_t key_bytes() const {
    return uint64_t{kKvHeads} * jobs.size() * jobs[0].keys.count * kHeadDim * 2;
  }
};

// FLOP per CPU second of one thread running 24 independent chains of 512-bit FMAs on registers
// (bench/fma_peak's AVX-512 loop): the compute limit of the AVX-512 window kernel. Best of 3.
KVS_AVX512 double Avx512FmaFlopsPerCpuSecond() {
  constexpr int kChains = 24;
  constexpr int64_t kIterations = 1 << 20;
  double best = 1e30;
  float sink = 0;
  for (int repeat = 0; repeat < 3; ++repeat) {
    __m512 acc[kChains];
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(1.0f + 0.01f * i);
    const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
    timespec start, end;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &start);
    for (int64_t i = 0; i < kIterations; ++i) {
#pragma GCC unroll 24
      for (int c = 0; c < kChains; ++c) acc[c] = _mm512_fmadd_ps(a, acc[c], b);
    }
    __m512 sum = acc[0];
    for (int i = 1; i < kChains; ++i) sum = _mm512_add_ps(sum, acc[i]);
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, sum);
    sink += lanes[0];
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &end);
    best = std::min(best, (end.tv_sec - start.tv_sec) + 1e-9 * (end.tv_nsec - start.tv_nsec));
  }
  volatile float keep = sink;
  (void)keep;
  return 32.0 * kChains * kIterations / best;
}

// The FLOP counters of a window benchmark: Q.K^T of `window` queries over `count` keys per layer,
// as a rate, against the dot-product peak of `threads`, and per CPU second (all threads) against
// one core's peak, which is robust to other processes sharing the cores.
void ReportWindowFlops(benchmark::State& state, int threads, int window, int count, int layers,
                       double cpu_seconds) {
  const double flops = 2.0 * kQHeads * window * static_cast<double>(count) * kHeadDim * layers;
  const double peak = DotPeakFlopsPerSecond(threads);
  state.counters["GFLOPs"] =
      benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["dot_peak_GFLOPs"] = peak / 1e9;
  state.counters["flops_per_peak"] =
      benchmark::Counter(flops / peak, benchmark::Counter::kIsIterationInvariantRate);
  const double flops_per_cpu_second = flops * state.iterations() / cpu_seconds;
  const double core_peak = DotPeakFlopsPerCpuSecond();
  state.counters["GFLOP_per_cpu_s"] = flops_per_cpu_second / 1e9;
  state.counters["core_peak_GFLOP_per_cpu_s"] = core_peak / 1e9;
  state.counters["cpu_flops_per_core_peak"] = flops_per_cpu_second / core_peak;
  // The ISA the kernels ran at (KVS_CPU_ISA caps it) and, where the CPU has AVX-512, the rate per
  // CPU second against one core's 512-bit FMA chains.
  state.SetLabel(CpuIsaName(DetectedCpuIsa()));
  if (HardwareCpuIsa() == CpuIsa::kAvx512) {
    const double fma512 = Avx512FmaFlopsPerCpuSecond();
    state.counters["avx512_fma_GFLOP_per_cpu_s"] = fma512 / 1e9;
    state.counters["cpu_flops_per_avx512_fma"] = flops_per_cpu_second / fma512;
  }
}

void BM_AttentionWindow(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const int window = static_cast<int>(state.range(1));
  const int count = static_cast<int>(state.range(2));
  const int layers = static_cast<int>(state.range(3));
  Cache cache(layers, count, window);
  auto backend = MakeCpuBackend(threads);
  Check(backend->AttentionProbs(cache.jobs, nullptr));  // warm-up
  const double cpu_start = ProcessCpuSeconds();
  for (auto _ : state) {
    Check(backend->AttentionProbs(cache.jobs, nullptr));
  }
  ReportWindowFlops(state, threads, window, count, layers, ProcessCpuSeconds() - cpu_start);
  const double limit = std::max(MemcpyBytesPerSecond(256ull << 20),
                                ParallelMemcpyBytesPerSecond(256ull << 20, threads));
  state.counters["key_GBps"] =
      benchmark::Counter(cache.key_bytes() / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["memcpy_GBps"] = limit / 1e9;
  state.counters["keys_per_memcpy"] =
      benchmark::Counter(cache.key_bytes() / limit, benchmark::Counter::kIsIterationInvariantRate);
}

// args: threads, window, count, jobs (layers x sequences).
BENCHMARK(BM_AttentionWindow)
    ->ArgNames({"threads", "w", "count", "jobs"})
    ->Args({2, 32, 8192, kLayers})      // compress of one 8192-token sequence: 32 layers, one call
    ->Args({2, 32, 2048, 4 * kLayers})  // batch: 4 sequences x 32 layers of 2048 tokens
    // decode: one query per (sequence, layer). 16 sequences x 32 layers (2.1 GB of keys, far past
    // the caches) rather than 64: the 8.6 GB of 64 would not fit this shared machine's memory.
    ->Args({2, 1, 2048, 16 * kLayers})
    ->Args({2, 1, 8192, kLayers})  // TOVA's compress: the newest query against 8192 keys, 32 layers
    ->Args({1, 32, 8192, kLayers})
    ->Unit(benchmark::kMillisecond)
    ->MinTime(1.0)
    ->UseRealTime();

// AttentionColumnSums (SnapKV's window vote): the same window as BM_AttentionWindow, but the
// [Hq][w][count] probabilities are summed over the window inside the kernel and never written
// out; only [Hq][count] sums per layer leave it. Same FLOP count and the same limits.
void BM_AttentionColumnSums(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const int window = static_cast<int>(state.range(1));
  const int count = static_cast<int>(state.range(2));
  const int layers = static_cast<int>(state.range(3));
  Cache cache(layers, count, window);
  std::vector<std::vector<float>> sums(layers, std::vector<float>(int64_t{kQHeads} * count, 0.f));
  std::vector<AttentionSumsJob> jobs;
  for (int l = 0; l < layers; ++l) {
    AttentionSumsJob job{.attention = cache.jobs[l], .sums = sums[l].data()};
    job.attention.probs = nullptr;
    jobs.push_back(job);
  }
  auto backend = MakeCpuBackend(threads);
  Check(backend->AttentionColumnSums(jobs, nullptr));  // warm-up
  const double cpu_start = ProcessCpuSeconds();
  for (auto _ : state) {
    Check(backend->AttentionColumnSums(jobs, nullptr));
  }
  ReportWindowFlops(state, threads, window, count, layers, ProcessCpuSeconds() - cpu_start);
}

// args: threads, window, count, jobs (layers).
BENCHMARK(BM_AttentionColumnSums)
    ->ArgNames({"threads", "w", "count", "jobs"})
    ->Args({2, 32, 8192, kLayers})  // SnapKV's compress of one 8192-token sequence
    ->Args({1, 32, 8192, kLayers})
    ->Unit(benchmark::kMillisecond)
    ->MinTime(1.0)
    ->UseRealTime();

// CaoteScores (gpu/cpu/caote_cpu.cc) over the value halves of paged fp16 blocks: `jobs`
// (sequence, layer) pairs of `count` tokens, `rows` alpha rows per job (8 = one per kv head, 32 =
// one per query head for gqa_reduce rss). Memory-bound: value bytes (each read once by the
// formula, twice by the kernel) per second as a fraction of memcpy measured in the same run.
struct ValueCache {
  uint64_t block_bytes = 2ull * kKvHeads * kBlockTokens * kHeadDim * 2;
  uint8_t* arena = nullptr;
  uint64_t arena_bytes = 0;
  std::vector<std::vector<int32_t>> tables;
  std::vector<float> alpha;
  std::vector<float> scores;
  std::vector<CaoteJob> jobs;

  ValueCache(int layers, int count, int rows, bool fast) {
    const int blocks_per_layer = (count + kBlockTokens - 1) / kBlockTokens;
    const int64_t blocks = int64_t{layers} * blocks_per_layer;
    arena_bytes = blocks * block_bytes;
    // mmap: the untouched key halves of the blocks cost no memory.
    arena = static_cast<uint8_t*>(
        mmap(nullptr, arena_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    if (arena == MAP_FAILED) std::abort();
    std::vector<int32_t> ids(blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::mt19937 rng(2);
    std::shuffle(ids.begin(), ids.end(), rng);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<uint16_t> pattern(kKvHeads * kBlockTokens * kHeadDim);
    for (auto& h : pattern) h = FloatToFloat16(normal(rng));
    for (int64_t b = 0; b < blocks; ++b) {
      std::memcpy(arena + b * block_bytes + block_bytes / 2, pattern.data(), pattern.size() * 2);
    }
    // One alpha pattern (normalised rows) for every job; its reads are small next to the values.
    alpha.resize(int64_t{rows} * count);
    std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
    for (int r = 0; r < rows; ++r) {
      double sum = 0;
      for (int s = 0; s < count; ++s) sum += alpha[int64_t{r} * count + s] = uniform(rng);
      for (int s = 0; s < count; ++s) alpha[int64_t{r} * count + s] /= sum;
    }
    scores.assign(int64_t{layers} * rows * count, 0.0f);
    for (int l = 0; l < layers; ++l) {
      tables.emplace_back(ids.begin() + int64_t{l} * blocks_per_layer,
                          ids.begin() + int64_t{l + 1} * blocks_per_layer);
    }
    for (int l = 0; l < layers; ++l) {
      CaoteJob job;
      job.values.arena = arena;
      job.values.kv_index = 1;
      job.values.block_table = tables[l].data();
      job.values.count = count;
      job.values.num_kv_heads = kKvHeads;
      job.values.head_dim = kHeadDim;
      job.values.block_tokens = kBlockTokens;
      job.values.dtype = DType::kFloat16;
      job.values.block_bytes = block_bytes;
      job.alpha = alpha.data();
      job.rows = rows;
      job.fast = fast;
      job.scores = scores.data() + int64_t{l} * rows * count;
      jobs.push_back(job);
    }
  }
  ~ValueCache() { munmap(arena, arena_bytes); }
  uint64_t value_bytes() const {
    return uint64_t{kKvHeads} * jobs.size() * jobs[0].values.count * kHeadDim * 2;
  }
};

void BM_CaoteScores(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const int rows = static_cast<int>(state.range(1));
  const int count = static_cast<int>(state.range(2));
  const int layers = static_cast<int>(state.range(3));
  const bool fast = state.range(4) != 0;
  ValueCache cache(layers, count, rows, fast);
  auto backend = MakeCpuBackend(threads);
  Check(backend->CaoteScores(cache.jobs, nullptr));  // warm-up
  const double cpu_start = ProcessCpuSeconds();
  for (auto _ : state) {
    Check(backend->CaoteScores(cache.jobs, nullptr));
  }
  // Per CPU second (all threads): steadier than wall time when other processes share the cores.
  state.counters["value_GB_per_cpu_s"] =
      cache.value_bytes() * state.iterations() / (ProcessCpuSeconds() - cpu_start) / 1e9;
  const double limit = std::max(MemcpyBytesPerSecond(256ull << 20),
                                ParallelMemcpyBytesPerSecond(256ull << 20, threads));
  state.counters["value_GBps"] =
      benchmark::Counter(cache.value_bytes() / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["memcpy_GBps"] = limit / 1e9;
  state.counters["values_per_memcpy"] = benchmark::Counter(
      cache.value_bytes() / limit, benchmark::Counter::kIsIterationInvariantRate);
}

// args: threads, rows, count, jobs (layers x sequences), fast.
BENCHMARK(BM_CaoteScores)
    ->ArgNames({"threads", "rows", "count", "jobs", "fast"})
    // decode: one call per sequence in the service; here 4 sequences x 32 layers in one call
    // (512 MiB of values, far past the caches). rows 8 = gqa_reduce mean, 32 = rss.
    ->Args({2, 8, 2048, 4 * kLayers, 0})
    ->Args({2, 32, 2048, 4 * kLayers, 0})
    ->Args({2, 8, 2048, 4 * kLayers, 1})
    // one sequence's 32 layers: the size of one decode-step call.
    ->Args({2, 8, 2048, kLayers, 0})
    // prefill/compress of one 8192-token sequence (SnapKV base: rows 8).
    ->Args({2, 8, 8192, kLayers, 0})
    ->Unit(benchmark::kMillisecond)
    ->MinTime(1.0)
    ->UseRealTime();

}  // namespace
}  // namespace kvs::bench

BENCHMARK_MAIN();
