// Every policy's prefill compression and a batched decode step, in process through KvPool and the
// CPU backend (issue 3's benchmark shape): L=32, H=8, Hq=32, D=128, fp16.
//   BM_Prefill/<policy>/<batch>: 8192 -> 2048 tokens per layer for `batch` sequences, attention
//     statistics computed by the sidecar from a 32-query window of every layer.
//   BM_DecodeStep/<policy>: one DecodeStep for 64 sequences holding 2048 tokens each (new token
//     inline, its query per layer), every sequence evicting back to its budget.
// Figures are reported against limits measured in the same run: memcpy bandwidth for the
// memory-bound work (bytes of K/V read and moved) and a dense fp32 dot-product loop for the
// attention statistics (2 * Hq * w * count * D flops per layer). See bench/README.md.
#include <benchmark/benchmark.h>
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "cache/clock.h"
#include "cache/pool.h"
#include "gpu/backend.h"
#include "gpu/base/dtype.h"

namespace kvs::bench {
namespace {

constexpr int kLayers = 32, kKvHeads = 8, kQHeads = 32, kHeadDim = 128, kWindow = 32;
constexpr int kTokens = 8192, kBudget = 2048;
constexpr int kDecodeSequences = 64, kDecodeTokens = 2048;
constexpr int kThreads = 2;

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

uint64_t Next(uint64_t& state) {
  state ^= state << 13;
  state ^= state >> 7;
  state ^= state << 17;
  return state;
}

// Gaussian-ish values (sum of uniforms) from a fixed xorshift stream.
float Noise(uint64_t& state) {
  const uint64_t bits = Next(state);
  return ((bits & 0xffff) + ((bits >> 16) & 0xffff) + ((bits >> 32) & 0xffff)) / 65536.0f - 1.5f;
}

std::vector<uint8_t> RandomPayload(uint64_t bytes, uint64_t seed) {
  std::vector<uint8_t> payload(bytes);
  uint64_t state = 0x9e3779b97f4a7c15ull ^ seed;
  auto* halves = reinterpret_cast<uint16_t*>(payload.data());
  for (uint64_t i = 0; i < bytes / 2; ++i) {
    halves[i] = FloatToFloat16(Noise(state) + ((i / kHeadDim) % 7 == 0 ? 0.8f : 0.0f));
  }
  return payload;
}

AttentionInput RandomQueries(int32_t num_queries, uint64_t seed) {
  AttentionInput attention;
  attention.num_queries = num_queries;
  attention.softmax_scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  attention.queries.resize(static_cast<size_t>(kLayers) * kQHeads * num_queries * kHeadDim);
  uint64_t state = 0x51ed2701a3c4e5f7ull ^ seed;
  for (float& q : attention.queries) q = Noise(state);
  return attention;
}

void Check(const absl::Status& status) {
  if (!status.ok()) {
    std::fprintf(stderr, "%s\n", status.ToString().c_str());
    std::abort();
  }
}

struct NamedPolicy {
  const char* label;
  PolicyConfig config;
  bool attention;
  // Passes over the cached keys or values that one decode step's algorithm cannot avoid: the
  // query's attention (or the key scores) reads every key once; D2O then compares the evicted
  // key with every kept key; CAOTE reads every value for the attention output.
  int decode_passes = 1;
};

std::vector<NamedPolicy> Policies() {
  std::vector<NamedPolicy> policies;
  auto add = [&](const char* label, const char* name, bool attention) {
    PolicyConfig config;
    config.name = name;
    policies.push_back({label, config, attention});
    return &policies.back().config;
  };
  add("streaming_llm", kPolicyStreamingLlm, false);
  add("keydiff", kPolicyKeyDiff, false);
  add("h2o", kPolicyH2o, true);
  add("tova", kPolicyTova, true);
  add("snapkv", kPolicySnapKv, true);
  add("cake", kPolicyCake, true);
  add("d2o", kPolicyD2o, true);
  policies.back().decode_passes = 2;
  add("caote_h2o_exact", kPolicyCaote, true);
  policies.back().decode_passes = 2;
  PolicyConfig* fast = add("caote_snapkv_fast", kPolicyCaote, true);
  policies.back().decode_passes = 2;
  fast->caote.base = CaoteBase::kSnapKv;
  fast->caote.variant = CaoteVariant::kFast;
  return policies;
}

double g_memcpy_limit = 0, g_dot_limit = 0;

void MeasureLimits() {
  if (g_memcpy_limit > 0) return;
  g_memcpy_limit = std::max(MemcpyBytesPerSecond(256ull << 20),
                            ParallelMemcpyBytesPerSecond(256ull << 20, kThreads));
  g_dot_limit = DotPeakFlopsPerSecond(kThreads);
}

// A pool big enough for `sequences` x `tokens` tokens in every layer.
struct Fixture {
  Fixture(int32_t sequences, int32_t tokens) : backend(MakeCpuBackend(kThreads)) {
    const ModelLayout layout = BenchLayout();
    blocks = sequences * kLayers * (tokens / layout.block_tokens + 1) + 64;
    PoolOptions options;
    options.arena_capacity_bytes = static_cast<uint64_t>(blocks) * layout.block_bytes();
    options.max_sequences_per_session = 4096;
    // Filling 64 sequences takes longer than the default lease, and nothing heartbeats here.
    options.default_lease = absl::Minutes(10);
    pool = std::make_unique<KvPool>(backend.get(), &clock, options);
    AttachParams attach;
    attach.layout = layout;
    attach.num_blocks = blocks;
    auto view = pool->Attach(attach);
    Check(view.status());
    session = view->session_id;
  }
  void Fill(const std::string& id, const PolicyConfig& policy, const std::vector<uint8_t>& payload,
            int32_t tokens) {
    SequenceParams params;
    params.policy = policy;
    params.sequence_id = id;
    BudgetConfig budget;
    budget.tokens_per_layer = kBudget;
    params.budget = budget;
    Check(pool->CreateSequence(session, params).status());
    auto reservation = pool->Reserve(session, id, tokens, {}, {});
    Check(reservation.status());
    Check(pool->WriteReserved(session, id, reservation->reservation_id, 0, payload));
    Check(pool->Commit(session, id, reservation->reservation_id, false).status());
  }
  std::unique_ptr<Backend> backend;
  RealClock clock;
  std::unique_ptr<KvPool> pool;
  std::string session;
  int32_t blocks = 0;
};

void BM_Prefill(benchmark::State& state, const NamedPolicy& policy, int batch) {
  mallopt(M_MMAP_THRESHOLD, 64 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
  MeasureLimits();
  const ModelLayout layout = BenchLayout();
  const std::vector<uint8_t> payload = RandomPayload(layout.token_bytes() * kTokens * kLayers, 1);
  const AttentionInput queries = RandomQueries(kWindow, 2);
  Fixture fixture(batch, kTokens);
  double seconds = 0;
  int64_t sequences = 0;
  for (auto _ : state) {
    state.PauseTiming();
    for (int b = 0; b < batch; ++b) {
      fixture.Fill("s" + std::to_string(b), policy.config, payload, kTokens);
    }
    CompressParams compress;
    if (policy.attention) compress.attention = queries;
    state.ResumeTiming();
    const auto start = std::chrono::steady_clock::now();
    for (int b = 0; b < batch; ++b) {
      auto result = fixture.pool->Compress(fixture.session, "s" + std::to_string(b), compress);
      Check(result.status());
    }
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    state.PauseTiming();
    for (int b = 0; b < batch; ++b) {
      Check(fixture.pool->ReleaseSequence(fixture.session, "s" + std::to_string(b)).status());
    }
    sequences += batch;
    state.ResumeTiming();
  }
  const double per_sequence = seconds / sequences;
  // Memory-bound floor of one compress: read every key once, move the kept rows (K and V) that
  // sit above the budget (3/4 of the kept ones when 1/4 is kept).
  const double key_bytes = double{kLayers} * kKvHeads * kTokens * layout.row_bytes();
  const double moved_bytes = double{kLayers} * kKvHeads * kBudget * 0.75 * 2 * layout.row_bytes();
  const double flops =
      policy.attention ? 2.0 * kLayers * kQHeads * kWindow * kTokens * kHeadDim : 0;
  state.counters["ms_per_sequence"] = 1e3 * per_sequence;
  state.counters["memcpy_GBps"] = g_memcpy_limit / 1e9;
  state.counters["bytes_fraction_of_memcpy"] =
      (key_bytes + moved_bytes) / per_sequence / g_memcpy_limit;
  if (policy.attention) {
    state.counters["dot_peak_GFLOPs"] = g_dot_limit / 1e9;
    // The whole compress (scores, top-k, compaction included) charged to the attention flops:
    // a lower bound of the attention kernel's own fraction.
    state.counters["attention_fraction_of_dot_peak"] = flops / per_sequence / g_dot_limit;
  }
}

void BM_DecodeStep(benchmark::State& state, const NamedPolicy& policy) {
  mallopt(M_MMAP_THRESHOLD, 64 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
  MeasureLimits();
  const ModelLayout layout = BenchLayout();
  const std::vector<uint8_t> payload =
      RandomPayload(layout.token_bytes() * kDecodeTokens * kLayers, 3);
  Fixture fixture(kDecodeSequences, kDecodeTokens + 2);
  const AttentionInput prefill_queries = RandomQueries(kWindow, 4);
  for (int b = 0; b < kDecodeSequences; ++b) {
    const std::string id = "d" + std::to_string(b);
    fixture.Fill(id, policy.config, payload, kDecodeTokens);
    // Prefill policies that freeze budgets (D2O, CAKE) see their prompt attention once.
    CompressParams compress;
    if (policy.attention) compress.attention = prefill_queries;
    Check(fixture.pool->Compress(fixture.session, id, compress).status());
  }
  std::vector<DecodeItem> items(kDecodeSequences);
  const std::vector<uint8_t> token = RandomPayload(layout.token_bytes() * kLayers, 5);
  const AttentionInput query = RandomQueries(1, 6);
  for (int b = 0; b < kDecodeSequences; ++b) {
    items[b].session_id = fixture.session;
    items[b].sequence_id = "d" + std::to_string(b);
    items[b].inline_kv = token;
    items[b].attention = query;
  }
  // One untimed step first: policies whose allocator freezes per-layer budgets at the first
  // decode step (D2O, CAKE) evict hundreds of tokens per head there, once per sequence; the
  // timed steps are the steady state, one token in and one out per (layer, head).
  Check(fixture.pool->DecodeStep(items).status());
  double seconds = 0;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    auto results = fixture.pool->DecodeStep(items);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    Check(results.status());
  }
  const double per_step = seconds / state.iterations();
  // Memory-bound floor: every key of every sequence is read once (the query's attention or the
  // key scores) and the evicted slot is refilled (one K and V row per head).
  const double bytes =
      double{kDecodeSequences} * kLayers * kKvHeads * kDecodeTokens * layout.row_bytes();
  state.counters["ms_per_step"] = 1e3 * per_step;
  state.counters["memcpy_GBps"] = g_memcpy_limit / 1e9;
  state.counters["bytes_fraction_of_memcpy"] = bytes / per_step / g_memcpy_limit;
  // The same against the passes the policy's algorithm needs (D2O, CAOTE: two).
  state.counters["passes_fraction_of_memcpy"] =
      policy.decode_passes * bytes / per_step / g_memcpy_limit;
}

// KVS_DECODE_ITERS=N runs N decode steps instead of 5: long enough to profile the steps past
// the set-up (bench/README.md).
int DecodeIterations() {
  const char* value = std::getenv("KVS_DECODE_ITERS");
  const int iterations = value != nullptr ? std::atoi(value) : 0;
  return iterations > 0 ? iterations : 5;
}

void RegisterAll() {
  static const std::vector<NamedPolicy> policies = Policies();
  for (const NamedPolicy& policy : policies) {
    for (int batch : {1, 16}) {
      benchmark::RegisterBenchmark(
          (std::string("BM_Prefill/") + policy.label + "/batch:" + std::to_string(batch)).c_str(),
          [&policy, batch](benchmark::State& state) { BM_Prefill(state, policy, batch); })
          ->Unit(benchmark::kMillisecond)
          ->Iterations(batch == 1 ? 3 : 1)
          ->UseRealTime();
    }
  }
  for (const NamedPolicy& policy : policies) {
    benchmark::RegisterBenchmark(
        (std::string("BM_DecodeStep/") + policy.label).c_str(),
        [&policy](benchmark::State& state) { BM_DecodeStep(state, policy); })
        ->Unit(benchmark::kMillisecond)
        ->Iterations(DecodeIterations())
        ->UseRealTime();
  }
}

}  // namespace
}  // namespace kvs::bench

int main(int argc, char** argv) {
  kvs::bench::RegisterAll();
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
