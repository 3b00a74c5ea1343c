// OmniKV Select (issue 4's benchmark shape): one batched Select per decode step for 64 sequences
// of L=32 layers holding 8192 prompt tokens (+1 generated), k = 2048, filter layers {2, 8, 18}
// (wait 1: 24 sparse layers), sparse layers' prompt offloaded to the host tier, in process
// through KvPool, the CPU backend and the real TierManager.
//
// Per step and sequence the sidecar reads the keys of the 3 filter layers' prompts (scoring) and
// copies k tokens of K and V per sparse layer from the host tier into the arena (+ the tail).
// The figure is the time per step, reported with the bytes it moves against memcpy bandwidth
// measured in the same run. Head shape: Hkv = 1, Hq = 4, D = 128, fp16 (the 8-kv-head shape of
// the other benchmarks would need 64 GiB for 64 x 8K x 32 layers); KVS_OMNIKV_SEQUENCES
// overrides the 64 sequences.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "cache/clock.h"
#include "cache/pool.h"
#include "gpu/backend.h"
#include "gpu/base/dtype.h"
#include "storage/tier_manager.h"

namespace kvs::bench {
namespace {

constexpr int kLayers = 32, kKvHeads = 1, kQHeads = 4, kHeadDim = 128, kPrompt = 8192;
constexpr int kSelected = 2048, kThreads = 2;
constexpr int kSparseLayers = 24, kFilters = 3;

int Sequences() {
  const char* env = std::getenv("KVS_OMNIKV_SEQUENCES");
  return env != nullptr && std::atoi(env) > 0 ? std::atoi(env) : 64;
}

ModelLayout Layout() {
  ModelLayout layout;
  layout.num_layers = kLayers;
  layout.num_kv_heads = kKvHeads;
  layout.num_q_heads = kQHeads;
  layout.head_dim = kHeadDim;
  layout.dtype = DType::kFloat16;
  layout.block_tokens = 16;
  return layout;
}

void Check(const absl::Status& status) {
  if (!status.ok()) {
    std::fprintf(stderr, "%s\n", status.ToString().c_str());
    std::abort();
  }
}

float Noise(uint64_t& state) {
  state ^= state << 13;
  state ^= state >> 7;
  state ^= state << 17;
  return ((state & 0xffff) + ((state >> 16) & 0xffff) + ((state >> 32) & 0xffff)) / 65536.0f - 1.5f;
}

void BM_OmniKvSelect(benchmark::State& state) {
  const int sequences = Sequences();
  const ModelLayout layout = Layout();
  const double memcpy_limit = std::max(MemcpyBytesPerSecond(256ull << 20),
                                       ParallelMemcpyBytesPerSecond(256ull << 20, kThreads));
  const uint64_t row = layout.row_bytes();
  // Arena: per sequence the 8 dense layers' prompt, staging for 24 sparse layers, their tails;
  // plus one whole sequence in flight before its first Select offloads it.
  const int32_t per_layer_blocks = kPrompt / layout.block_tokens + 1;
  const int32_t blocks = sequences * ((kLayers - kSparseLayers) * per_layer_blocks +
                                      kSparseLayers * (kSelected / layout.block_tokens + 2)) +
                         kLayers * per_layer_blocks + 64;
  storage::TierOptions tier_options;
  tier_options.host_capacity_bytes =
      uint64_t(sequences + 1) * kSparseLayers * kPrompt * 2 * kKvHeads * row;
  std::unique_ptr<storage::TierManager> tiers = storage::TierManager::Open(tier_options);
  std::unique_ptr<Backend> backend = MakeCpuBackend(kThreads);
  RealClock clock;
  PoolOptions options;
  options.arena_capacity_bytes = uint64_t(blocks) * layout.block_bytes();
  options.max_sequences_per_session = 4096;
  options.default_lease = absl::Minutes(10);  // nothing heartbeats here
  options.tiers = tiers.get();
  KvPool pool(backend.get(), &clock, options);
  AttachParams attach;
  attach.layout = layout;
  attach.num_blocks = blocks;
  auto view = pool.Attach(attach);
  Check(view.status());
  const std::string session = view->session_id;

  PolicyConfig policy;
  policy.name = kPolicyOmniKv;
  policy.omnikv.filter_layers = {2, 8, 18};
  policy.omnikv.selected_tokens = kSelected;
  policy.omnikv.offload = true;
  std::vector<uint8_t> payload(layout.token_bytes() * kPrompt * kLayers);
  uint64_t noise = 0x9e3779b97f4a7c15ull;
  auto* halves = reinterpret_cast<uint16_t*>(payload.data());
  for (size_t i = 0; i < payload.size() / 2; ++i) halves[i] = FloatToFloat16(Noise(noise));
  std::vector<uint8_t> token(layout.token_bytes() * kLayers);
  std::copy(payload.begin(), payload.begin() + token.size(), token.begin());

  std::vector<SelectItem> items(sequences);
  for (int b = 0; b < sequences; ++b) {
    SelectItem& item = items[b];
    item.session_id = session;
    item.sequence_id = "s" + std::to_string(b);
    item.prompt_tokens = kPrompt;
    item.attention.layers = policy.omnikv.filter_layers;
    item.attention.num_queries = 1;
    item.attention.softmax_scale = 1.0f / std::sqrt(float(kHeadDim));
    item.attention.queries.resize(size_t{kFilters} * kQHeads * kHeadDim);
    for (float& q : item.attention.queries) q = Noise(noise);
    SequenceParams params;
    params.policy = policy;
    params.sequence_id = item.sequence_id;
    Check(pool.CreateSequence(session, params).status());
    auto reservation = pool.Reserve(session, item.sequence_id, kPrompt, {}, {});
    Check(reservation.status());
    Check(pool.WriteReserved(session, item.sequence_id, reservation->reservation_id, 0, payload));
    Check(pool.Commit(session, item.sequence_id, reservation->reservation_id, false).status());
    // The first generated token, then the first Select (which offloads this sequence's prompt).
    auto next = pool.Reserve(session, item.sequence_id, 1, {}, {});
    Check(next.status());
    Check(pool.WriteReserved(session, item.sequence_id, next->reservation_id, 0, token));
    Check(pool.Commit(session, item.sequence_id, next->reservation_id, false).status());
    item.step_id = 0;
    Check(pool.Select({&item, 1}).status());
  }
  int64_t step = 0;
  double seconds = 0;
  for (auto _ : state) {
    ++step;
    for (SelectItem& item : items) item.step_id = step;
    const auto start = std::chrono::steady_clock::now();
    auto results = pool.Select(items);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    Check(results.status());
  }
  const double per_step = seconds / state.iterations();
  // Bytes a step must touch: the filter layers' prompt keys (read to score) and, per sparse
  // layer, k selected tokens + the tail of K and V (read from the host tier, written to staging).
  const double score_bytes = double(sequences) * kFilters * kKvHeads * kPrompt * row;
  const double gather_bytes =
      double(sequences) * kSparseLayers * (kSelected + 1) * 2 * kKvHeads * row;
  state.counters["ms_per_step"] = 1e3 * per_step;
  state.counters["sequences"] = sequences;
  state.counters["memcpy_GBps"] = memcpy_limit / 1e9;
  state.counters["gathered_MB_per_step"] = gather_bytes / 1e6;
  state.counters["bytes_fraction_of_memcpy"] =
      (score_bytes + gather_bytes) / per_step / memcpy_limit;
  state.counters["host_tier_MB"] = double(tiers->GetStats().host_bytes_used) / 1e6;
}

BENCHMARK(BM_OmniKvSelect)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(5);

}  // namespace
}  // namespace kvs::bench

BENCHMARK_MAIN();
