// The CUDA backend's kernel launchers (gpu/cuda/cuda_kernels.cu): plain structs of raw device
// pointers and shapes, one launcher per Backend step, each enqueuing its kernels on `stream` and
// returning the launch's cudaError_t. No Abseil, protobuf or service types here, so that nvcc
// compiles only this header and the kernels. Jobs reaching a launcher have been validated by the
// backend (gpu/cuda/cuda_backend.cc); the launchers check nothing but the launch itself.
//
// Semantics are those of gpu/backend.h (the CPU backend is the reference): fp32 accumulation
// (CAOTE's X in double, like the scalar reference), the same tie, NaN and masking rules.
//
// Threading: launchers are stateless; concurrent calls on different streams are independent.
#ifndef KVSIDECAR_GPU_CUDA_CUDA_KERNELS_H_
#define KVSIDECAR_GPU_CUDA_CUDA_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace kvs::cuda {

// A PagedLayerView (gpu/backend.h) with the dtype as its integer value (gpu/base/dtype.h).
struct DevPagedView {
  const uint8_t* arena = nullptr;
  const int32_t* block_table = nullptr;
  int32_t kv_index = 0;
  int32_t count = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t block_tokens = 0;
  int32_t dtype = 1;  // 1 fp16, 2 bf16, 3 fp32
  uint64_t block_bytes = 0;
};

// anchor/metric: the integer values of KeyDiffAnchor / KeyDiffMetric. scores: [heads][count].
// A mean anchor takes three kernels over (head, 256-row chunk) and a stream-ordered scratch
// allocation; the median anchor one block per head.
cudaError_t LaunchKeyDiff(const DevPagedView& keys, int anchor, int metric, float* scores,
                          cudaStream_t stream);
// Many small jobs (a decode step's layers) in one launch, one block per (job, head) in the scalar
// reference's order (as LaunchKeyDiff's median path). `device_jobs` is device memory.
struct DevKeyDiffJob {
  DevPagedView keys;
  int anchor = 0;
  int metric = 0;
  float* scores = nullptr;
};
cudaError_t LaunchKeyDiffBatch(const DevKeyDiffJob* device_jobs, int32_t num_jobs,
                               int32_t max_heads, int32_t max_head_dim, cudaStream_t stream);

cudaError_t LaunchTopK(const float* scores, const int32_t* positions, const uint8_t* forced,
                       int32_t rows, int32_t n, int32_t k, int32_t* kept, cudaStream_t stream);

// Rows of one job copied in order (a destination may be an earlier row's source).
cudaError_t LaunchCopyRows(uint8_t* arena, const uint64_t* src_offsets, const uint64_t* dst_offsets,
                           int64_t count, uint64_t row_bytes, cudaStream_t stream);

// Moves `count` rows of `row_bytes` in device memory: row r from src + src_offsets[r] (or
// r * row_bytes when src_offsets is null) to dst + dst_offsets[r] (or r * row_bytes), every row
// in parallel; no row may overlap another's destination. Offsets live in device memory.
cudaError_t LaunchMoveRows(uint8_t* dst, const uint64_t* dst_offsets, const uint8_t* src,
                           const uint64_t* src_offsets, int64_t count, uint64_t row_bytes,
                           cudaStream_t stream);

// FindNonFinite (gpu/backend.h): writes to *first_non_finite the lowest flat index of a value with
// every exponent bit set, or -1; with row_norms (nullable, [count]) each row's L2 norm too.
// dtype: 1 fp16, 2 bf16, 3 fp32.
cudaError_t LaunchFindNonFinite(const uint8_t* arena, const uint64_t* row_offsets, int64_t count,
                                int32_t row_elements, int32_t dtype, int64_t* first_non_finite,
                                float* row_norms, cudaStream_t stream);

// `host` must be device-accessible page-locked host memory (cudaHostAlloc / cudaHostRegister).
cudaError_t LaunchCopyHostRows(uint8_t* arena, uint8_t* host, const uint64_t* arena_offsets,
                               const uint64_t* host_offsets, int64_t count, uint64_t row_bytes,
                               bool to_host, cudaStream_t stream);

struct DevAttentionJob {
  DevPagedView keys;
  const int32_t* key_positions = nullptr;
  int32_t key_stride = 0;  // row length of key_positions (0 = keys.count)
  const float* queries = nullptr;
  const int32_t* query_positions = nullptr;
  int32_t num_q_heads = 0;
  int32_t num_queries = 0;
  float scale = 0.0f;
  float* out = nullptr;  // probabilities or logits
};
// logits_only: write the scaled logits (-inf where masked) instead of the probabilities.
// fp16/bf16 keys with head_dim a multiple of 16 (<= 256) and at least 16 query rows per kv head
// run on the tensor cores (two passes over the keys and a stream-ordered scratch allocation for
// the softmax statistics); the rest one block per (query head, query) row.
cudaError_t LaunchAttention(const DevAttentionJob& job, bool logits_only, cudaStream_t stream);
// Whether LaunchAttention would take one block per row for `job` (fewer than 16 query rows per
// kv head, a decode step's): such jobs of a call go to the device in one launch.
bool AttentionBatchable(const DevAttentionJob& job);
// Jobs (device memory) that are all AttentionBatchable, in one launch: max_rows and
// max_head_dim are the largest num_q_heads * num_queries and head_dim among them.
cudaError_t LaunchAttentionBatch(const DevAttentionJob* device_jobs, int32_t num_jobs,
                                 int64_t max_rows, int32_t max_head_dim, bool logits_only,
                                 cudaStream_t stream);
// sums[q][s] = the sum over the job's query rows i (ascending) of the probabilities
// LaunchAttention writes; job.out is ignored. The probabilities go to a stream-ordered scratch
// allocation freed on the same stream.
cudaError_t LaunchAttentionColumnSums(const DevAttentionJob& job, float* sums, cudaStream_t stream);

// PoolJob (gpu/backend.h): `in` copied to `out`, then one thread per (row, ordered slot)
// computes its window in the CPU backend's order (fp64 sum ascending / `best < v` max). kind:
// 0 = average, 1 = max.
cudaError_t LaunchPool(const float* in, const int32_t* order, const int32_t* lengths, int32_t rows,
                       int32_t num_kv_heads, int32_t count, int32_t kernel_size, int kind,
                       float* out, cudaStream_t stream);

// WindowVarianceJob (gpu/backend.h): one thread per (query head, slot), the window's rows in
// ascending order in fp64 as the CPU backend does (with --fmad=false: the same bits).
cudaError_t LaunchWindowVariance(const float* probs, int32_t num_q_heads, int32_t num_queries,
                                 int32_t window, int32_t count, double gamma, float* scores,
                                 cudaStream_t stream);

// WindowEntropyJob (gpu/backend.h): per-slot terms as the CPU backend defines them (logf in
// place of its polynomial), summed across slots in fp64 by a fixed tree (per-block partials in a
// stream-ordered scratch allocation, then one block): deterministic, but not the CPU's order.
// `entropy` and `shift` are device pointers to one double each.
cudaError_t LaunchWindowEntropy(const float* probs, const int32_t* key_positions,
                                int32_t num_q_heads, int32_t num_kv_heads, int32_t num_queries,
                                int32_t window, int32_t count, int32_t first_query_position,
                                double* entropy, double* shift, cudaStream_t stream);

cudaError_t LaunchCaote(const DevPagedView& values, const float* alpha, int32_t rows, bool fast,
                        float eps, float* scores, cudaStream_t stream);

cudaError_t LaunchNearestKeys(const DevPagedView& keys, int32_t head, const int32_t* query_slots,
                              int32_t num_queries, const int32_t* candidate_slots,
                              const int32_t* candidate_positions, int32_t num_candidates,
                              float* similarity, int32_t* target, cudaStream_t stream);

struct DevMergeJob {
  uint8_t* arena = nullptr;
  int32_t dtype = 1;
  int32_t row_elements = 0;
  int64_t rows = 0;
  const uint64_t* dst_offsets = nullptr;   // device, [rows]
  const int64_t* source_starts = nullptr;  // device, [rows + 1]
  const uint64_t* src_offsets = nullptr;   // device
  const float* weights = nullptr;          // device
};
// One thread block per merged row of `job` (RowMergeJob semantics, gpu/backend.h).
cudaError_t LaunchMergeRows(const DevMergeJob& job, cudaStream_t stream);

// DecodeEvictJob (gpu/backend.h) with device pointers; scores: 0 none, 1 accumulated, 2 rows.
struct DevDecodeJob {
  DevPagedView keys;
  int32_t stride = 0;
  int32_t* positions = nullptr;
  int32_t new_position = 0;
  int32_t num_q_heads = 0;
  float* accumulated = nullptr;
  const float* sums = nullptr;
  int32_t scores = 0;
  const float* rows = nullptr;
  int32_t rows_count = 0;
  bool rows_are_probabilities = false;
  int32_t sinks = 0;
  int32_t recent = 0;
  bool evict = false;
  int32_t* evicted = nullptr;
  const float* queries = nullptr;  // checked finite (by head 0's block)
  int64_t query_values = 0;
};
// One launch for every job of a call: a block per (job, kv head). `jobs` is device memory.
// stage: 0 choose, 1 apply (DecodeStage).
cudaError_t LaunchDecodeEvict(const DevDecodeJob* jobs, int32_t num_jobs, int32_t max_heads,
                              int stage, cudaStream_t stream);

}  // namespace kvs::cuda

#endif  // KVSIDECAR_GPU_CUDA_CUDA_KERNELS_H_
