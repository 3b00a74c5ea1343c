// The CUDA backend (gpu/cuda) at the shape issue 5 names: L=32, H=8, Hq=32, D=128, fp16, batch of
// 8 sequences of 32K tokens (32 GiB of K/V in one arena), compressed to 4K. Every figure is a ratio
// to a limit measured in the same run on the same device:
//   - BM_Gather: the kept rows of every (sequence, layer, kv, head) gathered into fresh blocks
//     (CopyRows), bytes moved per second / a device-to-device cudaMemcpy's (target >= 0.7);
//   - BM_KeyDiffScores: bytes of keys read per second / the same copy bandwidth (>= 0.7);
//   - BM_TopK: 32K -> 4K per (layer, head) row for the batch: time per batch (no limit named);
//   - BM_AttentionWindow: AttentionProbs of a 32-query window against 32K keys, one layer of the
//     batch per call, time of a cuBLAS GEMM of the same shape (fp16 in, fp32 out) / ours (>= 0.3).
// Without a CUDA device every benchmark reports "no CUDA device" and skips.
#include <benchmark/benchmark.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gpu/backend.h"
#include "gpu/base/dtype.h"
#include "gpu/cuda/cuda_backend.h"

namespace kvs::bench {
namespace {

constexpr int kSequences = 8, kLayers = 32, kKvHeads = 8, kQHeads = 32, kHeadDim = 128;
constexpr int kTokens = 32768, kKept = 4096, kBlockTokens = 16, kWindow = 32;
constexpr uint64_t kRowBytes = uint64_t{kHeadDim} * 2;
constexpr uint64_t kBlockBytes = 2 * kKvHeads * kBlockTokens * kRowBytes;
constexpr int kBlocksPerLayer = kTokens / kBlockTokens;
constexpr int kPairs = kSequences * kLayers;  // (sequence, layer)

bool Ok(benchmark::State& state, cudaError_t error, const char* what) {
  if (error == cudaSuccess) return true;
  state.SkipWithError((std::string(what) + ": " + cudaGetErrorString(error)).c_str());
  return false;
}
bool Ok(benchmark::State& state, const absl::Status& status) {
  if (status.ok()) return true;
  state.SkipWithError(status.ToString().c_str());
  return false;
}

template <typename T>
T* DeviceCopy(const std::vector<T>& host) {
  void* p = nullptr;
  if (cudaMalloc(&p, std::max<size_t>(1, host.size()) * sizeof(T)) != cudaSuccess) return nullptr;
  if (!host.empty()) cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  return static_cast<T*>(p);
}

// The batch: one arena holding every (sequence, layer)'s 32K tokens through shuffled block tables,
// keys and values random fp16 in [-2, 2); 4K blocks of spare room past them for the gather.
struct Batch {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Arena> arena;
  std::vector<int32_t*> tables;      // device, [kBlocksPerLayer] per pair
  std::vector<int32_t> host_tables;  // [kPairs][kBlocksPerLayer]
  int64_t spare_block = 0;           // first block of the gather's destination
  std::string error;

  static Batch* Get() {
    static Batch* batch = new Batch();
    return batch;
  }

 private:
  Batch() {
    std::string why;
    if (CudaDeviceCount(&why) == 0) {
      error = "no CUDA device (" + why + ")";
      return;
    }
    auto made = MakeCudaBackend(0);
    if (!made.ok()) {
      error = made.status().ToString();
      return;
    }
    backend = *std::move(made);
    const int64_t cache_blocks = int64_t{kPairs} * kBlocksPerLayer;
    const int64_t gather_blocks = int64_t{kPairs} * (kKept / kBlockTokens);
    auto created = backend->CreateArena((cache_blocks + gather_blocks) * kBlockBytes, {});
    if (!created.ok()) {
      error = created.status().ToString();
      return;
    }
    arena = *std::move(created);
    spare_block = cache_blocks;
    std::mt19937 rng(5);
    std::vector<int32_t> ids(cache_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    host_tables = ids;
    for (int p = 0; p < kPairs; ++p) {
      tables.push_back(
          DeviceCopy(std::vector<int32_t>(ids.begin() + int64_t{p} * kBlocksPerLayer,
                                          ids.begin() + int64_t{p + 1} * kBlocksPerLayer)));
    }
    // 64 MiB of random fp16 written over and over: the content only has to be varied.
    std::vector<uint16_t> chunk(uint64_t{32} << 20);
    std::uniform_real_distribution<float> value(-2.0f, 2.0f);
    std::vector<uint8_t> bytes(chunk.size() * 2);
    for (size_t i = 0; i < chunk.size(); ++i)
      StoreFromFloat(bytes.data(), DType::kFloat16, i, value(rng));
    for (uint64_t offset = 0; offset < arena->size_bytes(); offset += bytes.size()) {
      const uint64_t n = std::min<uint64_t>(bytes.size(), arena->size_bytes() - offset);
      if (!arena->Write(offset, bytes.data(), n).ok()) {
        error = "filling the arena failed";
        return;
      }
    }
  }
};

Batch* Ready(benchmark::State& state) {
  Batch* batch = Batch::Get();
  if (!batch->error.empty()) {
    state.SkipWithError(batch->error.c_str());
    return nullptr;
  }
  return batch;
}

PagedLayerView View(Batch& batch, int pair, int kv_index) {
  PagedLayerView view;
  view.arena = batch.arena->data();
  view.kv_index = kv_index;
  view.block_table = batch.tables[pair];
  view.count = kTokens;
  view.num_kv_heads = kKvHeads;
  view.head_dim = kHeadDim;
  view.block_tokens = kBlockTokens;
  view.dtype = DType::kFloat16;
  view.block_bytes = kBlockBytes;
  return view;
}

// Seconds of a device-to-device cudaMemcpy of `bytes` (best of 5).
double MemcpySeconds(benchmark::State& state, uint64_t bytes) {
  void *source = nullptr, *destination = nullptr;
  if (!Ok(state, cudaMalloc(&source, bytes), "cudaMalloc") ||
      !Ok(state, cudaMalloc(&destination, bytes), "cudaMalloc")) {
    return 0;
  }
  double best = 1e30;
  for (int i = 0; i < 6; ++i) {
    const auto start = std::chrono::steady_clock::now();
    cudaMemcpy(destination, source, bytes, cudaMemcpyDeviceToDevice);
    cudaDeviceSynchronize();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (i > 0) best = std::min(best, seconds);  // the first warms up
  }
  cudaFree(source);
  cudaFree(destination);
  return best;
}

// Runs `run` once to warm up, then once per iteration, synchronised; returns the mean seconds of
// the timed iterations (0 after an error, which skips the benchmark).
template <typename Fn>
double TimeIterations(benchmark::State& state, Batch& batch, Fn&& run) {
  if (!run() || !Ok(state, batch.backend->Synchronize(nullptr))) return 0;
  double total = 0;
  int64_t iterations = 0;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    if (!run() || !Ok(state, batch.backend->Synchronize(nullptr))) return 0;
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    state.SetIterationTime(seconds);
    total += seconds;
    ++iterations;
  }
  return iterations > 0 ? total / iterations : 0;
}

void BM_Gather(benchmark::State& state) {
  Batch* batch = Ready(state);
  if (batch == nullptr) return;
  // Per (pair, kv, head): 4K kept slots of 32K, ascending, gathered into the pair's 256 spare
  // blocks in slot order.
  std::mt19937 rng(7);
  std::vector<uint64_t> src, dst;
  std::vector<int32_t> slots(kTokens);
  std::iota(slots.begin(), slots.end(), 0);
  for (int p = 0; p < kPairs; ++p) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int h = 0; h < kKvHeads; ++h) {
        std::shuffle(slots.begin(), slots.end(), rng);
        std::vector<int32_t> kept(slots.begin(), slots.begin() + kKept);
        std::sort(kept.begin(), kept.end());
        for (int t = 0; t < kKept; ++t) {
          const auto row = [&](int64_t block, int slot) {
            return static_cast<uint64_t>(block) * kBlockBytes +
                   ((uint64_t{static_cast<uint32_t>(kv)} * kKvHeads + h) * kBlockTokens +
                    slot % kBlockTokens) *
                       kRowBytes;
          };
          src.push_back(row(
              batch->host_tables[int64_t{p} * kBlocksPerLayer + kept[t] / kBlockTokens], kept[t]));
          dst.push_back(
              row(batch->spare_block + int64_t{p} * (kKept / kBlockTokens) + t / kBlockTokens, t));
        }
      }
    }
  }
  uint64_t* device_src = DeviceCopy(src);
  uint64_t* device_dst = DeviceCopy(dst);
  const int64_t rows_per_job = int64_t{2} * kKvHeads * kKept;
  std::vector<RowCopyJob> jobs;
  for (int p = 0; p < kPairs; ++p) {
    jobs.push_back(RowCopyJob{batch->arena->data(), device_src + p * rows_per_job,
                              device_dst + p * rows_per_job, rows_per_job, kRowBytes});
  }
  const uint64_t bytes = src.size() * kRowBytes;
  const double seconds = TimeIterations(
      state, *batch, [&] { return Ok(state, batch->backend->CopyRows(jobs, nullptr)); });
  const double memcpy_seconds = MemcpySeconds(state, bytes);
  if (seconds > 0 && memcpy_seconds > 0) {
    state.counters["GBps"] = bytes / seconds / 1e9;
    state.counters["memcpy_GBps"] = bytes / memcpy_seconds / 1e9;
    state.counters["of_memcpy"] = memcpy_seconds / seconds;  // target >= 0.7
  }
  cudaFree(device_src);
  cudaFree(device_dst);
}

void BM_KeyDiffScores(benchmark::State& state) {
  Batch* batch = Ready(state);
  if (batch == nullptr) return;
  float* scores = nullptr;
  if (!Ok(state,
          cudaMalloc(reinterpret_cast<void**>(&scores),
                     sizeof(float) * kPairs * kKvHeads * kTokens),
          "cudaMalloc")) {
    return;
  }
  std::vector<KeyDiffScoreJob> jobs;
  for (int p = 0; p < kPairs; ++p) {
    KeyDiffScoreJob job;
    job.keys = View(*batch, p, 0);
    job.scores = scores + int64_t{p} * kKvHeads * kTokens;
    jobs.push_back(job);
  }
  const uint64_t key_bytes = uint64_t{kPairs} * kKvHeads * kTokens * kRowBytes;
  const double seconds = TimeIterations(
      state, *batch, [&] { return Ok(state, batch->backend->KeyDiffScores(jobs, nullptr)); });
  constexpr uint64_t kCopyBytes = uint64_t{1} << 30;
  const double memcpy_seconds = MemcpySeconds(state, kCopyBytes);
  if (seconds > 0 && memcpy_seconds > 0) {
    state.counters["key_GBps"] = key_bytes / seconds / 1e9;
    state.counters["memcpy_GBps"] = kCopyBytes / memcpy_seconds / 1e9;
    state.counters["of_memcpy"] = (key_bytes / seconds) / (kCopyBytes / memcpy_seconds);  // >= 0.7
  }
  cudaFree(scores);
}

void BM_TopK(benchmark::State& state) {
  Batch* batch = Ready(state);
  if (batch == nullptr) return;
  const int64_t rows = int64_t{kPairs} * kKvHeads;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> score(0.0f, 1.0f);
  std::vector<float> host_scores(rows * kTokens);
  for (float& s : host_scores) s = score(rng);
  std::vector<int32_t> host_positions(rows * kTokens);
  for (int64_t r = 0; r < rows; ++r) {
    std::iota(host_positions.begin() + r * kTokens, host_positions.begin() + (r + 1) * kTokens, 0);
  }
  float* scores = DeviceCopy(host_scores);
  int32_t* positions = DeviceCopy(host_positions);
  int32_t* kept = nullptr;
  if (!Ok(state, cudaMalloc(reinterpret_cast<void**>(&kept), sizeof(int32_t) * rows * kKept),
          "cudaMalloc"))
    return;
  std::vector<TopKJob> jobs;
  for (int p = 0; p < kPairs; ++p) {
    TopKJob job;
    job.scores = scores + int64_t{p} * kKvHeads * kTokens;
    job.positions = positions + int64_t{p} * kKvHeads * kTokens;
    job.rows = kKvHeads;
    job.n = kTokens;
    job.k = kKept;
    job.kept = kept + int64_t{p} * kKvHeads * kKept;
    jobs.push_back(job);
  }
  const double seconds =
      TimeIterations(state, *batch, [&] { return Ok(state, batch->backend->TopK(jobs, nullptr)); });
  state.counters["rows"] = static_cast<double>(rows);
  if (seconds > 0) state.counters["us_per_row"] = seconds * 1e6 / rows;
  cudaFree(scores);
  cudaFree(positions);
  cudaFree(kept);
}

// Seconds of the cuBLAS GEMM of one layer's attention logits for the batch: per (sequence, kv
// head), [32K keys x 128] x [128 x (4 q heads x 32 queries)] in fp16 with fp32 output.
double GemmSeconds(benchmark::State& state) {
  const int m = kTokens, n = (kQHeads / kKvHeads) * kWindow, k = kHeadDim;
  const int batch = kSequences * kKvHeads;
  void *a = nullptr, *b = nullptr, *c = nullptr;
  if (!Ok(state, cudaMalloc(&a, uint64_t{2} * m * k * batch), "cudaMalloc") ||
      !Ok(state, cudaMalloc(&b, uint64_t{2} * k * n * batch), "cudaMalloc") ||
      !Ok(state, cudaMalloc(&c, uint64_t{4} * m * n * batch), "cudaMalloc")) {
    return 0;
  }
  cudaMemset(a, 0x3c, uint64_t{2} * m * k * batch);
  cudaMemset(b, 0x3c, uint64_t{2} * k * n * batch);
  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) {
    state.SkipWithError("cublasCreate failed");
    return 0;
  }
  const float alpha = 1.0f, beta = 0.0f;
  double best = 1e30;
  for (int i = 0; i < 6; ++i) {
    const auto start = std::chrono::steady_clock::now();
    // Column-major: C[m x n] = A^T[m x k] * B[k x n] with A stored [k x m] per batch (keys rows).
    const cublasStatus_t status = cublasGemmStridedBatchedEx(
        handle, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, a, CUDA_R_16F, k, int64_t{m} * k, b,
        CUDA_R_16F, k, int64_t{k} * n, &beta, c, CUDA_R_32F, m, int64_t{m} * n, batch,
        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    cudaDeviceSynchronize();
    if (status != CUBLAS_STATUS_SUCCESS) {
      state.SkipWithError("cublasGemmStridedBatchedEx failed");
      best = 0;
      break;
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (i > 0) best = std::min(best, seconds);
  }
  cublasDestroy(handle);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  return best;
}

void BM_AttentionWindow(benchmark::State& state) {
  Batch* batch = Ready(state);
  if (batch == nullptr) return;
  std::mt19937 rng(13);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  std::vector<float> host_queries(int64_t{kQHeads} * kWindow * kHeadDim);
  for (float& q : host_queries) q = value(rng);
  std::vector<int32_t> host_query_positions(kWindow);
  std::iota(host_query_positions.begin(), host_query_positions.end(), kTokens - kWindow);
  std::vector<int32_t> host_key_positions(int64_t{kKvHeads} * kTokens);
  for (int h = 0; h < kKvHeads; ++h) {
    std::iota(host_key_positions.begin() + int64_t{h} * kTokens,
              host_key_positions.begin() + int64_t{h + 1} * kTokens, 0);
  }
  float* queries = DeviceCopy(host_queries);
  int32_t* query_positions = DeviceCopy(host_query_positions);
  int32_t* key_positions = DeviceCopy(host_key_positions);
  float* probs = nullptr;
  const uint64_t probs_per_job = uint64_t{kQHeads} * kWindow * kTokens;
  if (!Ok(state,
          cudaMalloc(reinterpret_cast<void**>(&probs), sizeof(float) * probs_per_job * kSequences),
          "cudaMalloc")) {
    return;
  }
  // One layer of the batch per call (the probabilities of all 32 layers would need 32 GiB).
  std::vector<AttentionJob> jobs;
  for (int s = 0; s < kSequences; ++s) {
    AttentionJob job;
    job.keys = View(*batch, s * kLayers, 0);
    job.key_positions = key_positions;
    job.queries = queries;
    job.query_positions = query_positions;
    job.num_q_heads = kQHeads;
    job.num_queries = kWindow;
    job.scale = 0.08838834764f;
    job.probs = probs + s * probs_per_job;
    jobs.push_back(job);
  }
  const double seconds = TimeIterations(
      state, *batch, [&] { return Ok(state, batch->backend->AttentionProbs(jobs, nullptr)); });
  const double gemm_seconds = GemmSeconds(state);
  if (seconds > 0 && gemm_seconds > 0) {
    state.counters["gemm_ms"] = gemm_seconds * 1e3;
    state.counters["of_gemm"] = gemm_seconds / seconds;  // target >= 0.3
  }
  cudaFree(queries);
  cudaFree(query_positions);
  cudaFree(key_positions);
  cudaFree(probs);
}

BENCHMARK(BM_Gather)->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(10);
BENCHMARK(BM_KeyDiffScores)->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(10);
BENCHMARK(BM_TopK)->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(10);
BENCHMARK(BM_AttentionWindow)->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(10);

}  // namespace
}  // namespace kvs::bench

BENCHMARK_MAIN();
