// KeyDiff compress of an fp16 cache (L=32, H=8, D=128) from 8192 to 2048 tokens per layer, run in
// process through KvPool and the CPU backend. Reported as bytes moved per second (key bytes read
// by scoring + K/V bytes copied by compaction) and as a fraction of this machine's memcpy
// bandwidth measured in the same run.
#include <benchmark/benchmark.h>
#include <malloc.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "bench/bench_util.h"
#include "cache/clock.h"
#include "cache/pool.h"
#include "gpu/backend.h"
#include "gpu/base/dtype.h"

namespace kvs::bench {
namespace {

constexpr int kLayers = 32, kKvHeads = 8, kQHeads = 32, kHeadDim = 128;
constexpr int kTokens = 8192, kBudget = 2048;

ModelLayout BenchLayout() {
  ModelLayout layout;
  layout.num_layers = kLayers;
  layout.num_kv_heads = kKvHeads;
  layout.num_q_heads = kQHeads;
  layout.head_dim = kHeadDim;
  layout.dtype = DType::kFloat16;
  layout.block_tokens = 16;
  return layout;
}

// Gaussian-ish fp16 values (sum of uniforms) from a fixed xorshift stream.
std::vector<uint8_t> RandomPayload(uint64_t bytes) {
  std::vector<uint8_t> payload(bytes);
  uint64_t state = 0x9e3779b97f4a7c15ull;
  auto* halves = reinterpret_cast<uint16_t*>(payload.data());
  for (uint64_t i = 0; i < bytes / 2; ++i) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    const float u =
        ((state & 0xffff) + ((state >> 16) & 0xffff) + ((state >> 32) & 0xffff)) / 65536.0f - 1.5f;
    halves[i] = FloatToFloat16(u + ((i / kHeadDim) % 7 == 0 ? 0.8f : 0.0f));
  }
  return payload;
}

void Check(const absl::Status& status) {
  if (!status.ok()) {
    std::fprintf(stderr, "%s\n", status.ToString().c_str());
    std::abort();
  }
}

void BM_KeyDiffCompress8192To2048(benchmark::State& state) {
  // The allocator settings of the kvsidecar binary (service/main.cc): multi-MiB scratch buffers
  // stay on the heap instead of being mapped, faulted in and unmapped on every compress.
  mallopt(M_MMAP_THRESHOLD, 64 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
  const ModelLayout layout = BenchLayout();
  const uint64_t payload_bytes = layout.token_bytes() * kTokens * kLayers;
  const std::vector<uint8_t> payload = RandomPayload(payload_bytes);

  auto backend = MakeCpuBackend(static_cast<int>(state.range(0)));
  RealClock clock;
  PoolOptions options;
  const int32_t blocks = kLayers * (kTokens / layout.block_tokens) + 64;
  options.arena_capacity_bytes = static_cast<uint64_t>(blocks) * layout.block_bytes();
  KvPool pool(backend.get(), &clock, options);
  AttachParams attach;
  attach.layout = layout;
  attach.num_blocks = blocks;
  auto session = pool.Attach(attach);
  Check(session.status());

  PolicyConfig policy;
  policy.name = kPolicyKeyDiff;
  int64_t bytes_moved = 0;
  double seconds = 0;
  for (auto _ : state) {
    state.PauseTiming();
    SequenceParams params;
    params.policy = policy;
    params.sequence_id = "bench";
    Check(pool.CreateSequence(session->session_id, params).status());
    auto reservation = pool.Reserve(session->session_id, "bench", kTokens, {}, {});
    Check(reservation.status());
    Check(
        pool.WriteReserved(session->session_id, "bench", reservation->reservation_id, 0, payload));
    Check(pool.Commit(session->session_id, "bench", reservation->reservation_id, false).status());
    CompressParams compress;
    compress.budget_tokens = kBudget;
    state.ResumeTiming();

    const auto start = std::chrono::steady_clock::now();
    auto result = pool.Compress(session->session_id, "bench", compress);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

    state.PauseTiming();
    Check(result.status());
    // Slots held positions in order before compress; kept tokens from slots >= kBudget moved.
    auto layout_after = pool.GetLayout(session->session_id, "bench", {}, true);
    Check(layout_after.status());
    int64_t moved_rows = 0;
    for (const auto& l : layout_after->layers) {
      moved_rows += std::count_if(l.positions.begin(), l.positions.end(),
                                  [](int32_t p) { return p >= kBudget; });
    }
    const int64_t key_bytes = int64_t{kLayers} * kKvHeads * kTokens * layout.row_bytes();
    bytes_moved += key_bytes + moved_rows * 2 * static_cast<int64_t>(layout.row_bytes());
    Check(pool.ReleaseSequence(session->session_id, "bench").status());
    state.ResumeTiming();
  }
  const double rate = bytes_moved / seconds;
  const double memcpy_single = MemcpyBytesPerSecond(256ull << 20);
  const double memcpy_all = ParallelMemcpyBytesPerSecond(256ull << 20, 2);
  const double limit = std::max(memcpy_single, memcpy_all);
  state.counters["moved_GBps"] = rate / 1e9;
  state.counters["memcpy_GBps"] = limit / 1e9;
  state.counters["fraction_of_memcpy"] = rate / limit;
  state.counters["ms_per_compress"] = 1e3 * seconds / state.iterations();
}
BENCHMARK(BM_KeyDiffCompress8192To2048)
    ->ArgName("threads")
    ->Arg(1)
    ->Arg(2)
    ->Unit(benchmark::kMillisecond)
    ->Iterations(5)
    ->UseRealTime();

}  // namespace
}  // namespace kvs::bench

BENCHMARK_MAIN();
