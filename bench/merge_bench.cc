// NearestKeys on the CPU backend (gpu/cpu/merge_cpu.cc) in D2O's decode shape: every sequence
// evicts one token per (layer, kv head) and looks for its nearest kept key among the other 2047
// (32 layers x 8 heads = 256 jobs per sequence, one call per sequence as D2oPolicy::Merge makes
// it), fp16, D=128, real paged blocks behind shuffled block tables. kSequences sequences hold 1 GiB
// of keys, far past the caches.
// Reported against memcpy measured in the same run: candidate key bytes (read once per job) per
// second / memcpy bytes per second (`keys_per_memcpy`; 1.0 = the job reads its keys as fast as
// memcpy copies).
// Args: path (0 auto, 1 streaming, 2 packed), queries per job (evicted tokens; decode = 1; the
// crossover between the paths sets kNearestStreamingMaxQueries), threads.
#include <benchmark/benchmark.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "bench/bench_util.h"
#include "gpu/backend.h"
#include "gpu/base/dtype.h"
#include "gpu/cpu/merge_cpu.h"
#include "gpu/cpu/thread_pool.h"

namespace kvs::bench {
namespace {

constexpr int kLayers = 32, kKvHeads = 8, kHeadDim = 128, kBlockTokens = 16, kCount = 2048;
// 8 sequences x 32 layers x 8 heads x 2048 tokens x 256 B = 1 GiB of keys.
constexpr int kSequences = 8;

void Check(const absl::Status& status) {
  if (!status.ok()) {
    std::fprintf(stderr, "%s\n", status.ToString().c_str());
    std::abort();
  }
}

uint64_t Next(uint64_t& state) {
  state ^= state << 13;
  state ^= state >> 7;
  state ^= state << 17;
  return state;
}

// kSequences x kLayers layers of kCount fp16 tokens in one arena ([2][H][B][D] blocks, only the
// key halves written: mmap leaves the value halves unbacked), and per sequence the 256 jobs of a
// decode step with `queries` evicted slots per (layer, head).
struct DecodeMerge {
  static constexpr uint64_t kBlockBytes = 2ull * kKvHeads * kBlockTokens * kHeadDim * 2;
  uint8_t* arena = nullptr;
  uint64_t arena_bytes = 0;
  std::vector<std::vector<int32_t>> tables;  // per (sequence, layer)
  // Per (sequence, layer, head): evicted slots, kept slots and their positions, outputs.
  std::vector<std::vector<int32_t>> query_slots, candidate_slots, candidate_positions, targets;
  std::vector<std::vector<float>> similarities;
  std::vector<std::vector<NearestKeyJob>> jobs;  // per sequence

  explicit DecodeMerge(int queries) {
    const int blocks_per_layer = kCount / kBlockTokens;
    const int64_t layers = int64_t{kSequences} * kLayers;
    const int64_t blocks = layers * blocks_per_layer;
    arena_bytes = blocks * kBlockBytes;
    arena = static_cast<uint8_t*>(
        mmap(nullptr, arena_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    if (arena == MAP_FAILED) std::abort();
    uint64_t state = 0x9e3779b97f4a7c15ull;
    for (int64_t b = 0; b < blocks; ++b) {
      auto* halves = reinterpret_cast<uint16_t*>(arena + b * kBlockBytes);
      for (int i = 0; i < kKvHeads * kBlockTokens * kHeadDim; ++i) {
        const uint64_t bits = Next(state);
        const float x =
            ((bits & 0xffff) + ((bits >> 16) & 0xffff) + ((bits >> 32) & 0xffff)) / 65536.0f - 1.5f;
        halves[i] = FloatToFloat16(x);
      }
    }
    std::vector<int32_t> ids(blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::mt19937 rng(1);
    std::shuffle(ids.begin(), ids.end(), rng);
    for (int64_t l = 0; l < layers; ++l) {
      tables.emplace_back(ids.begin() + l * blocks_per_layer,
                          ids.begin() + (l + 1) * blocks_per_layer);
    }
    // Slots hold positions in hole-filled order; the evicted ones are random, the kept ones
    // ascend by slot (as Select writes them).
    std::vector<int32_t> positions(kCount);
    std::iota(positions.begin(), positions.end(), 0);
    std::shuffle(positions.begin(), positions.end(), rng);
    const size_t heads = static_cast<size_t>(layers) * kKvHeads;
    query_slots.resize(heads);
    candidate_slots.resize(heads);
    candidate_positions.resize(heads);
    targets.resize(heads);
    similarities.resize(heads);
    jobs.resize(kSequences);
    for (int64_t l = 0; l < layers; ++l) {
      for (int h = 0; h < kKvHeads; ++h) {
        const size_t i = static_cast<size_t>(l) * kKvHeads + h;
        std::vector<int32_t> slots(kCount);
        std::iota(slots.begin(), slots.end(), 0);
        std::shuffle(slots.begin(), slots.end(), rng);
        query_slots[i].assign(slots.begin(), slots.begin() + queries);
        candidate_slots[i].assign(slots.begin() + queries, slots.end());
        std::sort(candidate_slots[i].begin(), candidate_slots[i].end());
        for (int32_t s : candidate_slots[i]) candidate_positions[i].push_back(positions[s]);
        targets[i].assign(queries, -1);
        similarities[i].assign(queries, 0.0f);
        NearestKeyJob job;
        job.keys.arena = arena;
        job.keys.kv_index = 0;
        job.keys.block_table = tables[l].data();
        job.keys.count = kCount;
        job.keys.num_kv_heads = kKvHeads;
        job.keys.head_dim = kHeadDim;
        job.keys.block_tokens = kBlockTokens;
        job.keys.dtype = DType::kFloat16;
        job.keys.block_bytes = kBlockBytes;
        job.head = h;
        job.query_slots = query_slots[i].data();
        job.num_queries = queries;
        job.candidate_slots = candidate_slots[i].data();
        job.candidate_positions = candidate_positions[i].data();
        job.num_candidates = static_cast<int32_t>(candidate_slots[i].size());
        job.similarity = similarities[i].data();
        job.target = targets[i].data();
        jobs[l / kLayers].push_back(job);
      }
    }
  }
  ~DecodeMerge() { munmap(arena, arena_bytes); }
  // Candidate key bytes of one pass over every sequence (each job's candidates counted once).
  uint64_t candidate_bytes() const {
    uint64_t total = 0;
    for (const auto& sequence : jobs) {
      for (const NearestKeyJob& job : sequence)
        total += uint64_t{2} * kHeadDim * job.num_candidates;
    }
    return total;
  }
};

void BM_NearestKeysDecode(benchmark::State& state) {
  const auto path = static_cast<NearestKeysPath>(state.range(0));
  const int queries = static_cast<int>(state.range(1));
  const int threads = static_cast<int>(state.range(2));
  DecodeMerge merge(queries);
  ThreadPool pool(threads);
  for (const auto& sequence : merge.jobs) Check(RunNearestKeys(sequence, pool, path));  // warm-up
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    for (const auto& sequence : merge.jobs) Check(RunNearestKeys(sequence, pool, path));
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double bytes = static_cast<double>(merge.candidate_bytes());
  const double limit = std::max(MemcpyBytesPerSecond(256ull << 20),
                                ParallelMemcpyBytesPerSecond(256ull << 20, threads));
  state.counters["key_GBps"] =
      benchmark::Counter(bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["memcpy_GBps"] = limit / 1e9;
  state.counters["keys_per_memcpy"] =
      benchmark::Counter(bytes / limit, benchmark::Counter::kIsIterationInvariantRate);
  // Wall microseconds per (layer, head) job.
  const double jobs = static_cast<double>(state.iterations()) * kSequences * kLayers * kKvHeads;
  state.counters["us_per_job"] = 1e6 * seconds / jobs;
}

// args: path (0 auto, 1 streaming, 2 packed), queries per job, threads.
BENCHMARK(BM_NearestKeysDecode)
    ->ArgNames({"path", "queries", "threads"})
    ->Args({0, 1, 2})  // the decode step: auto picks streaming
    ->Args({0, 1, 1})
    ->Args({2, 1, 2})  // the packed path on the decode shape (before this path existed)
    // the crossover (kNearestStreamingMaxQueries), one thread
    ->Args({1, 2, 1})
    ->Args({2, 2, 1})
    ->Args({1, 4, 1})
    ->Args({2, 4, 1})
    ->Args({1, 8, 1})
    ->Args({2, 8, 1})
    ->Args({1, 16, 1})
    ->Args({2, 16, 1})
    ->Args({1, 32, 1})
    ->Args({2, 32, 1})
    ->Args({1, 64, 1})
    ->Args({2, 64, 1})
    ->Unit(benchmark::kMillisecond)
    ->MinTime(1.0)
    ->UseRealTime();

}  // namespace
}  // namespace kvs::bench

BENCHMARK_MAIN();
