// The CUDA backend's kernels (declared in gpu/cuda/cuda_kernels.h). Most are written for parity
// with the CPU backend's scalar reference: every dot product, norm and sum runs in the same
// sequential order per output as the scalar code, and the file is compiled with --fmad=false so
// the device rounds where the reference does. Two are tuned and sum in their own order, within
// the parity tests' tolerances as the CPU's AVX2 kernels are: KeyDiff with a mean anchor (rows
// spread over every multiprocessor, a warp per row) and attention over fp16/bf16 keys (tensor
// cores, the fp32 queries split into exact parts). bench/README.md has the device figures.
//
// Launch shape: kThreads threads per block; one block per (job, head), (job, row) or job, with
// grid-stride loops where a job has many rows; the tuned kernels say their own.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <cstdint>

#include "gpu/cuda/cuda_kernels.h"
#include "gpu/device_counters.h"

namespace kvs::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxGrid = 1 << 20;

// Must match gpu/base/dtype.h.
constexpr int kFloat16 = 1, kBFloat16 = 2, kFloat32 = 3;
// KeyDiffAnchor / KeyDiffMetric values (gpu/backend.h).
constexpr int kMeanNormalized = 0, kMedianNormalized = 2;  // kMeanRaw = 1: plain mean
constexpr int kCosine = 0, kPairwise = 1, kDot = 2, kEuclidean = 3, kNegativeNorm = 4;

int GridFor(int64_t items) {
  if (items < 1) return 1;
  return items > kMaxGrid ? kMaxGrid : static_cast<int>(items);
}

__device__ inline float NegInf() { return __int_as_float(0xff800000); }
__device__ inline float PosInf() { return __int_as_float(0x7f800000); }

// std::max(a, b) exactly ((a < b) ? b : a): NaN in `a` survives, unlike fmaxf.
__device__ inline float StdMax(float a, float b) { return (a < b) ? b : a; }

__device__ inline float LoadF(const uint8_t* row, int dtype, int64_t d) {
  switch (dtype) {
    case kFloat16:
      return __half2float(__ushort_as_half(reinterpret_cast<const uint16_t*>(row)[d]));
    case kBFloat16:
      return __uint_as_float(static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(row)[d])
                             << 16);
    default:
      return reinterpret_cast<const float*>(row)[d];
  }
}

// Bit-exact ports of FloatToFloat16 / FloatToBFloat16 (gpu/base/dtype.h).
__device__ inline uint16_t ToFloat16(float value) {
  const uint32_t bits = __float_as_uint(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs_bits = bits & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return sign | 0x7e00u;
  if (abs_bits >= 0x477ff000u) return sign | 0x7c00u;
  if (abs_bits < 0x38800000u) {
    if (abs_bits < 0x33000000u) return sign;
    const uint32_t exponent = abs_bits >> 23;
    const uint32_t mantissa = (abs_bits & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exponent;
    uint32_t half = mantissa >> shift;
    const uint32_t remainder = mantissa & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (remainder > halfway || (remainder == halfway && (half & 1u))) ++half;
    return sign | static_cast<uint16_t>(half);
  }
  const uint32_t rounded = abs_bits + 0xfffu + ((abs_bits >> 13) & 1u);
  return sign | static_cast<uint16_t>((rounded - 0x38000000u) >> 13);
}

__device__ inline uint16_t ToBFloat16(float value) {
  uint32_t bits = __float_as_uint(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

__device__ inline void StoreF(uint8_t* row, int dtype, int64_t d, float value) {
  switch (dtype) {
    case kFloat16:
      reinterpret_cast<uint16_t*>(row)[d] = ToFloat16(value);
      return;
    case kBFloat16:
      reinterpret_cast<uint16_t*>(row)[d] = ToBFloat16(value);
      return;
    default:
      reinterpret_cast<float*>(row)[d] = value;
  }
}

__device__ inline int DTypeBytesOf(int dtype) { return dtype == kFloat32 ? 4 : 2; }

// The row of (view.kv_index, head, slot), laid out as gpu/backend.h says.
__device__ inline const uint8_t* PagedRow(const DevPagedView& v, int64_t head, int64_t slot) {
  const uint64_t row_bytes = static_cast<uint64_t>(v.head_dim) * DTypeBytesOf(v.dtype);
  return v.arena + static_cast<uint64_t>(v.block_table[slot / v.block_tokens]) * v.block_bytes +
         ((static_cast<uint64_t>(v.kv_index) * v.num_kv_heads + head) * v.block_tokens +
          slot % v.block_tokens) *
             row_bytes;
}

// Block-wide reductions; every thread of the block must call them. `scratch` holds kThreads.
__device__ float BlockMax(float value, float* scratch) {
  scratch[threadIdx.x] = value;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) {
      scratch[threadIdx.x] = StdMax(scratch[threadIdx.x], scratch[threadIdx.x + stride]);
    }
    __syncthreads();
  }
  const float result = scratch[0];
  __syncthreads();
  return result;
}

__device__ float BlockSum(float value, float* scratch) {
  scratch[threadIdx.x] = value;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) scratch[threadIdx.x] += scratch[threadIdx.x + stride];
    __syncthreads();
  }
  const float result = scratch[0];
  __syncthreads();
  return result;
}

__device__ int BlockSumInt(int value, int* scratch) {
  scratch[threadIdx.x] = value;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) scratch[threadIdx.x] += scratch[threadIdx.x + stride];
    __syncthreads();
  }
  const int result = scratch[0];
  __syncthreads();
  return result;
}

// Radix select over the items i in [0, n) for which key_of(i, &key) is true: the `rank`-th
// smallest key (0-based; the caller guarantees rank < number of such items). Returns the key and
// sets *rank_in_ties to the rank left within the items equal to it (0-based). Every thread calls.
template <typename KeyFn>
__device__ uint32_t BlockSelect(KeyFn key_of, int n, uint32_t rank, uint32_t* rank_in_ties) {
  __shared__ uint32_t histogram[256];
  __shared__ uint32_t state[2];
  uint32_t prefix = 0, mask = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += kThreads) histogram[i] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += kThreads) {
      uint32_t key;
      if (key_of(i, &key) && (key & mask) == prefix)
        atomicAdd(&histogram[(key >> shift) & 0xff], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      uint32_t below = 0;
      int digit = 0;
      for (; digit < 255; ++digit) {
        if (below + histogram[digit] > rank) break;
        below += histogram[digit];
      }
      state[0] = prefix | (static_cast<uint32_t>(digit) << shift);
      state[1] = rank - below;
    }
    __syncthreads();
    prefix = state[0];
    rank = state[1];
    mask |= 0xffu << shift;
    __syncthreads();
  }
  *rank_in_ties = rank;
  return prefix;
}

// ---------------------------------------------------------------------------------------------
// KeyDiff (gpu/cpu/keydiff_cpu.cc ScoreHeadScalar). One block per kv head; the head's scores
// buffer holds each slot's norm scale until the scoring pass overwrites it.

// Orders floats like LessNanLast: NaN above everything, -0 equal to +0.
__device__ inline uint32_t MedianKey(float value) {
  if (value != value) return 0xffffffffu;
  const uint32_t bits = __float_as_uint(value + 0.0f);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}
__device__ inline float MedianValue(uint32_t key) {
  if (key == 0xffffffffu) return __int_as_float(0x7fc00000);
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// One key's score from its dot product with the anchor, its squared norm and its squared
// distance to the anchor (ScoreHeadScalar's formulas; + 0.0f turns -0 into +0).
__device__ inline float KeyDiffScore(int metric, float dot, float squared, float distance,
                                     float anchor_norm) {
  const float key_norm = StdMax(sqrtf(squared), 1e-8f);
  switch (metric) {
    case kCosine:
      return -dot / (key_norm * anchor_norm) + 0.0f;
    case kPairwise:
      return -dot / key_norm + 0.0f;
    case kDot:
      return -dot + 0.0f;
    case kNegativeNorm:  // KNorm: no anchor
      return -sqrtf(squared) + 0.0f;
    case kEuclidean:
    default:
      return sqrtf(distance);
  }
}

// The floor of a key's norm when the anchor averages normalised keys; 0: the raw mean (keys are
// not normalised).
__host__ __device__ inline float KeyDiffNormFloor(int anchor_kind, int metric) {
  if (metric == kPairwise) return 1e-8f;
  if (metric == kCosine && (anchor_kind == kMeanNormalized || anchor_kind == kMedianNormalized)) {
    return 1e-12f;
  }
  return 0.0f;
}

// One block scores one head, in the scalar reference's order.
__device__ void KeyDiffHead(const DevPagedView& v, int anchor_kind, int metric, float* scores,
                            int64_t head) {
  extern __shared__ float anchor[];
  __shared__ float anchor_norm_shared;
  const int n = v.count;
  const int dim = v.head_dim;
  float* out = scores + head * n;
  const bool median = metric == kCosine && anchor_kind == kMedianNormalized;
  const float eps = KeyDiffNormFloor(anchor_kind, metric);
  // Pass 1: each slot's divisor.
  for (int s = threadIdx.x; s < n; s += kThreads) {
    const uint8_t* row = PagedRow(v, head, s);
    float squared = 0.0f;
    for (int d = 0; d < dim; ++d) {
      const float x = LoadF(row, v.dtype, d);
      squared += x * x;
    }
    out[s] = eps > 0.0f ? StdMax(sqrtf(squared), eps) : 1.0f;
  }
  __syncthreads();
  if (!median) {
    for (int d = threadIdx.x; d < dim; d += kThreads) {
      float sum = 0.0f;
      for (int s = 0; s < n; ++s) sum += LoadF(PagedRow(v, head, s), v.dtype, d) / out[s];
      sum /= static_cast<float>(n);
      if (metric == kPairwise) sum *= static_cast<float>(n);
      anchor[d] = sum;
    }
  } else {
    // Coordinate-wise median of the normalised keys; an even count averages the two middle ones.
    for (int d = 0; d < dim; ++d) {
      auto key_of = [&](int s, uint32_t* key) {
        *key = MedianKey(LoadF(PagedRow(v, head, s), v.dtype, d) / out[s]);
        return true;
      };
      uint32_t ties;
      float value = MedianValue(BlockSelect(key_of, n, static_cast<uint32_t>(n / 2), &ties));
      if (n % 2 == 0) {
        const float lower =
            MedianValue(BlockSelect(key_of, n, static_cast<uint32_t>(n / 2 - 1), &ties));
        value = 0.5f * (lower + value);
      }
      if (threadIdx.x == 0) anchor[d] = value;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float squared = 0.0f;
    for (int d = 0; d < dim; ++d) squared += anchor[d] * anchor[d];
    anchor_norm_shared = StdMax(sqrtf(squared), 1e-8f);
  }
  __syncthreads();
  const float anchor_norm = anchor_norm_shared;
  for (int s = threadIdx.x; s < n; s += kThreads) {
    const uint8_t* row = PagedRow(v, head, s);
    float dot = 0.0f, squared = 0.0f, distance = 0.0f;
    for (int d = 0; d < dim; ++d) {
      const float x = LoadF(row, v.dtype, d);
      dot += x * anchor[d];
      squared += x * x;
      const float diff = x - anchor[d];
      distance += diff * diff;
    }
    out[s] = KeyDiffScore(metric, dot, squared, distance, anchor_norm);
  }
}

__global__ void KeyDiffKernel(DevPagedView v, int anchor_kind, int metric, float* scores) {
  KeyDiffHead(v, anchor_kind, metric, scores, blockIdx.x);
}

// Every job of a call in one launch: block (x, y) scores head x of job y.
__global__ void KeyDiffBatchKernel(const DevKeyDiffJob* jobs) {
  const DevKeyDiffJob& job = jobs[blockIdx.y];
  if (static_cast<int32_t>(blockIdx.x) >= job.keys.num_kv_heads || job.keys.count == 0) return;
  KeyDiffHead(job.keys, job.anchor, job.metric, job.scores, blockIdx.x);
}

// The tiled KeyDiff for a mean anchor (every metric but the cosine median): the keys are read
// twice, each time by every multiprocessor at once. A warp owns a row (lane l holds dims l,
// l + 32, ...: each load instruction reads 64 or 128 contiguous bytes); a block owns
// kKeyDiffChunk rows of one head.
//   1. KeyDiffPartialsKernel: per (head, chunk), the chunk's sum of normalised keys.
//   2. KeyDiffAnchorKernel: per head, the chunk sums added in chunk order, the anchor and its norm.
//   3. KeyDiffScoreKernel: per (head, chunk), each row's score against the anchor.
// The sums are a tree, not the scalar reference's row order: results agree within the parity
// tests' tolerance, as the AVX2 kernels' do.
constexpr int kKeyDiffChunk = 256;
constexpr int kMaxDimsPerLane = 8;  // head_dim <= 256 takes the tiled path

__device__ inline float WarpSum(float value) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  return value;
}

__device__ inline void LoadRowLanes(const DevPagedView& v, int64_t head, int64_t slot, int lane,
                                    float (&x)[kMaxDimsPerLane]) {
  const uint8_t* row = PagedRow(v, head, slot);
#pragma unroll
  for (int j = 0; j < kMaxDimsPerLane; ++j) {
    const int d = lane + 32 * j;
    x[j] = d < v.head_dim ? LoadF(row, v.dtype, d) : 0.0f;
  }
}

__global__ void KeyDiffPartialsKernel(DevPagedView v, float eps, float* partials) {
  __shared__ float per_warp[kWarps][kMaxDimsPerLane * 32];
  const int64_t head = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int begin = blockIdx.x * kKeyDiffChunk;
  const int end = min(v.count, begin + kKeyDiffChunk);
  float sum[kMaxDimsPerLane] = {};
  for (int s = begin + warp; s < end; s += kWarps) {
    float x[kMaxDimsPerLane];
    LoadRowLanes(v, head, s, lane, x);
    float squared = 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxDimsPerLane; ++j) squared = __fmaf_rn(x[j], x[j], squared);
    squared = WarpSum(squared);
    const float divisor = eps > 0.0f ? StdMax(sqrtf(squared), eps) : 1.0f;
#pragma unroll
    for (int j = 0; j < kMaxDimsPerLane; ++j) sum[j] += x[j] / divisor;
  }
#pragma unroll
  for (int j = 0; j < kMaxDimsPerLane; ++j) per_warp[warp][lane + 32 * j] = sum[j];
  __syncthreads();
  float* out = partials + (head * gridDim.x + blockIdx.x) * v.head_dim;
  for (int d = threadIdx.x; d < v.head_dim; d += kThreads) {
    float total = 0.0f;
    for (int w = 0; w < kWarps; ++w) total += per_warp[w][d];
    out[d] = total;
  }
}

// anchors: [heads][head_dim + 1], the last entry the anchor's norm (floored at 1e-8).
__global__ void KeyDiffAnchorKernel(const float* partials, int32_t chunks, int32_t dim, int32_t n,
                                    int metric, float* anchors) {
  __shared__ float scratch[kThreads];
  const int64_t head = blockIdx.x;
  float* anchor = anchors + head * (dim + 1);
  float squared = 0.0f;
  for (int d = threadIdx.x; d < dim; d += kThreads) {
    float sum = 0.0f;
    for (int c = 0; c < chunks; ++c) sum += partials[(head * chunks + c) * dim + d];
    sum /= static_cast<float>(n);
    if (metric == kPairwise) sum *= static_cast<float>(n);
    anchor[d] = sum;
    squared += sum * sum;
  }
  squared = BlockSum(squared, scratch);
  if (threadIdx.x == 0) anchor[dim] = StdMax(sqrtf(squared), 1e-8f);
}

__global__ void KeyDiffScoreKernel(DevPagedView v, int metric, const float* anchors,
                                   float* scores) {
  const int64_t head = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float* anchor_row = anchors + head * (v.head_dim + 1);
  float anchor[kMaxDimsPerLane];
#pragma unroll
  for (int j = 0; j < kMaxDimsPerLane; ++j) {
    const int d = lane + 32 * j;
    anchor[j] = d < v.head_dim ? anchor_row[d] : 0.0f;
  }
  const float anchor_norm = anchor_row[v.head_dim];
  float* out = scores + head * v.count;
  const int begin = blockIdx.x * kKeyDiffChunk;
  const int end = min(v.count, begin + kKeyDiffChunk);
  for (int s = begin + warp; s < end; s += kWarps) {
    float x[kMaxDimsPerLane];
    LoadRowLanes(v, head, s, lane, x);
    float dot = 0.0f, squared = 0.0f, distance = 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxDimsPerLane; ++j) {
      dot = __fmaf_rn(x[j], anchor[j], dot);
      squared = __fmaf_rn(x[j], x[j], squared);
      const float diff = x[j] - anchor[j];
      distance = __fmaf_rn(diff, diff, distance);
    }
    dot = WarpSum(dot);
    squared = WarpSum(squared);
    distance = WarpSum(distance);
    if (lane != 0) continue;
    out[s] = KeyDiffScore(metric, dot, squared, distance, anchor_norm);
  }
}

// ---------------------------------------------------------------------------------------------
// Top-k (gpu/cpu/topk_cpu.cc): one block per row. The threshold key and the tie cut by position
// come from two radix selects; the kept slots are then written in slot order by a block scan.

__device__ inline uint32_t ScoreKey(float score) {
  if (score != score) return 0;
  const uint32_t bits = __float_as_uint(score + 0.0f);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

__global__ void TopKKernel(const float* scores_all, const int32_t* positions_all,
                           const uint8_t* forced_all, int32_t rows, int32_t n, int32_t k,
                           int32_t* kept_all) {
  __shared__ int int_scratch[kThreads];
  __shared__ int warp_totals[kWarps];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float* scores = scores_all + row * n;
    const int32_t* positions = positions_all + row * n;
    const uint8_t* forced = forced_all != nullptr ? forced_all + row * n : nullptr;
    int32_t* kept = kept_all + row * k;
    int local_forced = 0;
    if (forced != nullptr) {
      for (int s = threadIdx.x; s < n; s += kThreads) local_forced += forced[s] != 0 ? 1 : 0;
    }
    const int num_forced = BlockSumInt(local_forced, int_scratch);
    const int wanted = k - num_forced;
    const int num_candidates = n - num_forced;
    const bool keep_all = wanted >= num_candidates;
    uint32_t threshold = 0;
    // Candidates at the threshold key are kept up to this position key (position ^ 0x80000000).
    uint32_t tie_limit = 0xffffffffu;
    if (!keep_all && wanted > 0) {
      auto inverted = [&](int s, uint32_t* key) {
        if (forced != nullptr && forced[s] != 0) return false;
        *key = ~ScoreKey(scores[s]);
        return true;
      };
      uint32_t ties_before;
      threshold = ~BlockSelect(inverted, n, static_cast<uint32_t>(wanted - 1), &ties_before);
      // ties_before + 1 candidates with the threshold key are kept: the lowest positions.
      auto tie_positions = [&](int s, uint32_t* key) {
        if (forced != nullptr && forced[s] != 0) return false;
        if (ScoreKey(scores[s]) != threshold) return false;
        *key = static_cast<uint32_t>(positions[s]) ^ 0x80000000u;
        return true;
      };
      uint32_t unused;
      tie_limit = BlockSelect(tie_positions, n, ties_before, &unused);
    }
    int written = 0;
    for (int base = 0; base < n; base += kThreads) {
      const int s = base + threadIdx.x;
      bool keep = false;
      if (s < n) {
        if (forced != nullptr && forced[s] != 0) {
          keep = true;
        } else if (keep_all) {
          keep = true;
        } else if (wanted > 0) {
          const uint32_t key = ScoreKey(scores[s]);
          keep = key > threshold || (key == threshold && (static_cast<uint32_t>(positions[s]) ^
                                                          0x80000000u) <= tie_limit);
        }
      }
      const unsigned ballot = __ballot_sync(0xffffffffu, keep);
      const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
      if (lane == 0) warp_totals[warp] = __popc(ballot);
      __syncthreads();
      int offset = written;
      int total = 0;
      for (int w = 0; w < kWarps; ++w) {
        if (w < warp) offset += warp_totals[w];
        total += warp_totals[w];
      }
      offset += __popc(ballot & ((1u << lane) - 1u));
      if (keep && offset < k) kept[offset] = s;
      written += total;
      __syncthreads();
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Row copies.

// Copies one row with the whole block: 16-byte words when aligned, bytes otherwise; an
// overlapping (but not identical) pair is moved by one thread in the safe direction (memmove).
__device__ void BlockCopyRow(uint8_t* dst, const uint8_t* src, uint64_t bytes) {
  if (dst == src) return;
  const bool overlap = dst < src + bytes && src < dst + bytes;
  if (overlap) {
    if (threadIdx.x == 0) {
      if (dst < src) {
        for (uint64_t i = 0; i < bytes; ++i) dst[i] = src[i];
      } else {
        for (uint64_t i = bytes; i > 0; --i) dst[i - 1] = src[i - 1];
      }
    }
    return;
  }
  const uintptr_t alignment =
      reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes;
  if (alignment % 16 == 0) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (uint64_t i = threadIdx.x; i < bytes / 16; i += kThreads) d[i] = s[i];
  } else {
    for (uint64_t i = threadIdx.x; i < bytes; i += kThreads) dst[i] = src[i];
  }
}

// The fallback when no scratch can be had: one block, rows in order (a destination may be an
// earlier row's source). Correct, and about a microsecond per row.
__global__ void CopyRowsKernel(uint8_t* arena, const uint64_t* src_offsets,
                               const uint64_t* dst_offsets, int64_t count, uint64_t row_bytes) {
  for (int64_t r = 0; r < count; ++r) {
    BlockCopyRow(arena + dst_offsets[r], arena + src_offsets[r], row_bytes);
    __syncthreads();
  }
}

// Moves `count` rows of `row_bytes` from src (+ src_offsets[r], or r * row_bytes when null) to
// dst (+ dst_offsets[r], or r * row_bytes when null), every row in parallel: one thread per
// 16-byte word when row_bytes is a multiple of 16 (a row whose two ends are not 16-byte aligned
// is copied a byte at a time by the same threads), else one thread per byte.
__global__ void MoveRowsKernel(uint8_t* dst, const uint64_t* dst_offsets, const uint8_t* src,
                               const uint64_t* src_offsets, int64_t count, uint64_t row_bytes) {
  const bool words = row_bytes % 16 == 0;
  const uint64_t unit = words ? 16 : 1;
  const uint64_t per_row = row_bytes / unit;
  const uint64_t total = static_cast<uint64_t>(count) * per_row;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const uint64_t r = i / per_row, at = (i % per_row) * unit;
    const uint8_t* from = src + (src_offsets != nullptr ? src_offsets[r] : r * row_bytes) + at;
    uint8_t* to = dst + (dst_offsets != nullptr ? dst_offsets[r] : r * row_bytes) + at;
    if (!words) {
      *to = *from;
    } else if (((reinterpret_cast<uintptr_t>(from) | reinterpret_cast<uintptr_t>(to)) & 15) == 0) {
      *reinterpret_cast<uint4*>(to) = *reinterpret_cast<const uint4*>(from);
    } else {
      for (int b = 0; b < 16; ++b) to[b] = from[b];
    }
  }
}

__global__ void CopyHostRowsKernel(uint8_t* arena, uint8_t* host, const uint64_t* arena_offsets,
                                   const uint64_t* host_offsets, int64_t count, uint64_t row_bytes,
                                   bool to_host) {
  for (int64_t r = blockIdx.x; r < count; r += gridDim.x) {
    uint8_t* a = arena + arena_offsets[r];
    uint8_t* h = host + host_offsets[r];
    if (to_host) {
      BlockCopyRow(h, a, row_bytes);
    } else {
      BlockCopyRow(a, h, row_bytes);
    }
  }
}

// Finite check: one block per row (grid-strided); every thread tests the exponent bits of its
// elements and the lowest flat index wins through an unsigned atomicMin over a result preset to
// all ones (which reads as -1 when no value is non-finite). With `norms`, the block also sums the
// squares of the row's values it has read (FiniteCheckJob::row_norms).
__global__ void FindNonFiniteKernel(const uint8_t* arena, const uint64_t* row_offsets,
                                    int64_t count, int32_t row_elements, int32_t dtype,
                                    unsigned long long* first, float* norms) {
  __shared__ float scratch[kThreads];
  for (int64_t r = blockIdx.x; r < count; r += gridDim.x) {
    const uint8_t* row = arena + row_offsets[r];
    if (norms != nullptr) {
      float squared = 0.0f;
      for (int32_t e = threadIdx.x; e < row_elements; e += kThreads) {
        const float x = LoadF(row, dtype, e);
        squared += x * x;
      }
      squared = BlockSum(squared, scratch);  // every thread of the block takes part
      if (threadIdx.x == 0) norms[r] = sqrtf(squared);
    }
    for (int32_t e = threadIdx.x; e < row_elements; e += kThreads) {
      bool bad;
      if (dtype == 3) {
        const uint32_t bits = reinterpret_cast<const uint32_t*>(row)[e];
        bad = (bits & 0x7f800000u) == 0x7f800000u;
      } else {
        const uint16_t bits = reinterpret_cast<const uint16_t*>(row)[e];
        const uint16_t mask = dtype == 1 ? 0x7c00u : 0x7f80u;
        bad = (bits & mask) == mask;
      }
      if (bad) {
        atomicMin(first, static_cast<unsigned long long>(r * row_elements + e));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Attention: one block per (query head, query) row: logits, then the row's max and sum.

// Rows first, first + step, ... of `job`, one block each.
__device__ void AttentionRows(const DevAttentionJob& job, bool logits_only, int64_t first,
                              int64_t step) {
  extern __shared__ float query[];
  __shared__ float scratch[kThreads];
  const DevPagedView& v = job.keys;
  const int64_t count = v.count;
  const int dim = v.head_dim;
  const int64_t group = job.num_q_heads / v.num_kv_heads;
  const int64_t total_rows = static_cast<int64_t>(job.num_q_heads) * job.num_queries;
  for (int64_t row = first; row < total_rows; row += step) {
    const int64_t q_head = row / job.num_queries;
    const int64_t head = q_head / group;
    const int32_t query_position = job.query_positions[row % job.num_queries];
    const int32_t* key_positions =
        job.key_positions + head * (job.key_stride > 0 ? job.key_stride : count);
    float* out = job.out + row * count;
    __syncthreads();  // the previous row is done with `query`
    for (int d = threadIdx.x; d < dim; d += kThreads) query[d] = job.queries[row * dim + d];
    __syncthreads();
    float local_max = NegInf();
    for (int64_t s = threadIdx.x; s < count; s += kThreads) {
      float logit = NegInf();
      if (key_positions[s] <= query_position) {
        const uint8_t* key = PagedRow(v, head, s);
        float dot = 0.0f;
        for (int d = 0; d < dim; ++d) dot += query[d] * LoadF(key, v.dtype, d);
        logit = job.scale * dot;
        local_max = StdMax(local_max, logit);
      }
      out[s] = logit;
    }
    if (logits_only) continue;
    const float max = BlockMax(local_max, scratch);
    if (max == NegInf()) {  // every slot masked: all zeros
      for (int64_t s = threadIdx.x; s < count; s += kThreads) out[s] = 0.0f;
      continue;
    }
    float local_sum = 0.0f;
    for (int64_t s = threadIdx.x; s < count; s += kThreads) {
      const float logit = out[s];
      const float p = logit == NegInf() ? 0.0f : expf(logit - max);
      out[s] = p;
      local_sum += p;
    }
    const float inv = 1.0f / BlockSum(local_sum, scratch);
    for (int64_t s = threadIdx.x; s < count; s += kThreads) out[s] *= inv;
  }
}

__global__ void AttentionKernel(DevAttentionJob job, bool logits_only) {
  AttentionRows(job, logits_only, blockIdx.x, gridDim.x);
}

// Every job of a call in one launch: block (x, y) takes rows x, x + gridDim.x, ... of job y.
__global__ void AttentionBatchKernel(const DevAttentionJob* jobs, bool logits_only) {
  AttentionRows(jobs[blockIdx.y], logits_only, blockIdx.x, gridDim.x);
}

// ---------------------------------------------------------------------------------------------
// Tiled attention on the tensor cores, for fp16 and bf16 keys whose head_dim is a multiple of 16
// (at most 256). A block owns kTileRows query rows of one kv head (its q heads' rows, head-major,
// as `out` lays them) and kKeyTilesPerBlock tiles of kTileKeys keys; each warp multiplies 16 rows
// by the tile's 64 keys with wmma.
//
// Precision: the keys enter the tensor cores as they are stored (exact). Each fp32 query is split
// into parts of the key type that sum to it (2 fp16 parts, 22 significant bits; 3 bf16 parts,
// 24), and the parts' products are accumulated in fp32, so a logit differs from the fp32 dot
// product by rounding alone. A tile whose queries an fp16 part cannot hold (|q| >= 32768, or not
// finite) is computed with plain fp32 dot products instead.
//
// The softmax is two passes over the keys: the first keeps each row's running max and sum of
// exponentials per block (online), a small kernel combines the blocks', and the second recomputes
// the logits and writes the probabilities once. NaN and masking follow AttentionKernel: a masked
// key's probability is 0 times the row's reciprocal sum (NaN when the row's sum is), a row with
// every key masked is all zeros.
constexpr int kTileRows = 64, kTileKeys = 64, kTileThreads = 128, kKeyTilesPerBlock = 8;
constexpr int kTileMaxDim = 256;

template <typename T>
struct QuerySplit;
template <>
struct QuerySplit<half> {
  static constexpr int kParts = 2;
  __device__ static half Part(float value) { return __float2half_rn(value); }
  __device__ static float Value(half part) { return __half2float(part); }
  __device__ static bool Holds(float q) { return fabsf(q) < 32768.0f; }  // false for NaN
};
template <>
struct QuerySplit<__nv_bfloat16> {
  static constexpr int kParts = 3;
  __device__ static __nv_bfloat16 Part(float value) { return __float2bfloat16_rn(value); }
  __device__ static float Value(__nv_bfloat16 part) { return __bfloat162float(part); }
  __device__ static bool Holds(float q) { return fabsf(q) < 1e38f; }
};

// Shared memory of one block: the query parts, the key tile (both with rows padded by 8
// elements against bank conflicts) and the tile of raw dot products.
__host__ __device__ inline int TileLd(int dim) { return dim + 8; }
constexpr int kTileOutLd = kTileKeys + 4;
template <typename T>
__host__ __device__ inline size_t TileSharedBytes(int dim) {
  return sizeof(T) * static_cast<size_t>(QuerySplit<T>::kParts + 1) * kTileRows * TileLd(dim) +
         sizeof(float) * kTileRows * kTileOutLd;
}

// Running softmax statistics (max m, sum of exp(logit - m) l). A NaN sum stays NaN whatever is
// combined with it: one NaN logit makes the row's probabilities NaN, as in AttentionKernel
// (whose max skips NaN, so a row whose logits are all masked or NaN still ends at a max of -inf
// and is written as zeros, here too).
__device__ inline void CombineStats(float& m, float& l, float m2, float l2) {
  const bool nan = l != l || l2 != l2;
  const float top = StdMax(m, m2);
  if (top != NegInf()) {
    l = (m == NegInf() ? 0.0f : l * expf(m - top)) +
        (m2 == NegInf() ? 0.0f : l2 * expf(m2 - top));
    m = top;
  }
  if (nan) l = __int_as_float(0x7fc00000);
}

template <typename T, bool kStatsPass>
__global__ void __launch_bounds__(kTileThreads)
    TiledAttentionKernel(DevAttentionJob job, int32_t rows, bool logits_only, float2* partials,
                         const float2* row_stats) {
  namespace wmma = nvcuda::wmma;
  using Split = QuerySplit<T>;
  extern __shared__ __align__(128) unsigned char tile_shared[];
  __shared__ int unsplittable;
  __shared__ float2 stats[kTileRows];
  __shared__ int32_t row_position[kTileRows];
  __shared__ int32_t key_position[kTileKeys];
  __shared__ const uint8_t* key_row[kTileKeys];  // null: a padding key past `count`
  const DevPagedView& v = job.keys;
  const int dim = v.head_dim, ld = TileLd(dim);
  const int64_t count = v.count;
  const int64_t head = blockIdx.z;
  const int row0 = blockIdx.y * kTileRows;
  const int64_t row_base = head * rows;  // the head's first row in `out` and `queries`
  T* q_parts = reinterpret_cast<T*>(tile_shared);
  T* k_tile = q_parts + Split::kParts * kTileRows * ld;
  float* dots = reinterpret_cast<float*>(k_tile + kTileRows * ld);
  const int warp = threadIdx.x / 32;

  if (threadIdx.x == 0) unsplittable = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < kTileRows * dim; i += kTileThreads) {
    const int r = i / dim, d = i % dim;
    float q = row0 + r < rows ? job.queries[(row_base + row0 + r) * dim + d] : 0.0f;
    if (!Split::Holds(q)) unsplittable = 1;
    for (int p = 0; p < Split::kParts; ++p) {
      const T part = Split::Part(q);
      q_parts[(p * kTileRows + r) * ld + d] = part;
      q -= Split::Value(part);
    }
  }
  for (int r = threadIdx.x; r < kTileRows; r += kTileThreads) {
    row_position[r] = row0 + r < rows ? job.query_positions[(row0 + r) % job.num_queries] : 0;
    if (!kStatsPass && !logits_only) {
      stats[r] = row0 + r < rows ? row_stats[row_base + row0 + r] : make_float2(0.0f, 0.0f);
    }
  }
  __syncthreads();
  const bool use_tensor_cores = unsplittable == 0;
  // Pass 1's running statistics: thread t keeps row t / 2's (both threads of a pair agree).
  float run_m = NegInf(), run_l = 0.0f;
  const int64_t key_tiles = (count + kTileKeys - 1) / kTileKeys;
  const int64_t first_tile = static_cast<int64_t>(blockIdx.x) * kKeyTilesPerBlock;
  for (int64_t tile = first_tile; tile < min(key_tiles, first_tile + kKeyTilesPerBlock); ++tile) {
    const int64_t key0 = tile * kTileKeys;
    for (int k = threadIdx.x; k < kTileKeys; k += kTileThreads) {
      const bool real = key0 + k < count;
      key_position[k] =
          real ? job.key_positions[head * (job.key_stride > 0 ? job.key_stride : count) + key0 + k]
               : 0;
      key_row[k] = real ? PagedRow(v, head, key0 + k) : nullptr;
    }
    __syncthreads();
    // The key tile, 16 bytes per thread per step (rows of head_dim * 2 bytes, 16-byte aligned).
    const int chunks = dim / 8;
    for (int i = threadIdx.x; i < kTileKeys * chunks; i += kTileThreads) {
      const int k = i / chunks, c = i % chunks;
      uint4 value = make_uint4(0, 0, 0, 0);
      if (key_row[k] != nullptr) value = reinterpret_cast<const uint4*>(key_row[k])[c];
      reinterpret_cast<uint4*>(k_tile + k * ld)[c] = value;
    }
    __syncthreads();
    if (use_tensor_cores) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kTileKeys / 16];
      for (int j = 0; j < kTileKeys / 16; ++j) wmma::fill_fragment(acc[j], 0.0f);
      for (int k0 = 0; k0 < dim; k0 += 16) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b[kTileKeys / 16];
        for (int j = 0; j < kTileKeys / 16; ++j) {
          wmma::load_matrix_sync(b[j], k_tile + 16 * j * ld + k0, ld);
        }
        for (int p = 0; p < Split::kParts; ++p) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
          wmma::load_matrix_sync(a, q_parts + (p * kTileRows + 16 * warp) * ld + k0, ld);
          for (int j = 0; j < kTileKeys / 16; ++j) wmma::mma_sync(acc[j], a, b[j], acc[j]);
        }
      }
      for (int j = 0; j < kTileKeys / 16; ++j) {
        wmma::store_matrix_sync(dots + 16 * warp * kTileOutLd + 16 * j, acc[j], kTileOutLd,
                                wmma::mem_row_major);
      }
    } else {
      for (int i = threadIdx.x; i < kTileRows * kTileKeys; i += kTileThreads) {
        const int r = i / kTileKeys, k = i % kTileKeys;
        float dot = 0.0f;
        if (row0 + r < rows) {
          const float* q = job.queries + (row_base + row0 + r) * dim;
          for (int d = 0; d < dim; ++d) dot += q[d] * Split::Value(k_tile[k * ld + d]);
        }
        dots[r * kTileOutLd + k] = dot;
      }
    }
    __syncthreads();
    // The scaled logit of (row r, key k of the tile); -inf where masked and for a padding key
    // (a padding row's values are neither kept nor written).
    auto logit_at = [&](int r, int k) {
      return key_row[k] == nullptr || key_position[k] > row_position[r]
                 ? NegInf()
                 : job.scale * dots[r * kTileOutLd + k];
    };
    if (kStatsPass) {
      constexpr int kHalf = kTileKeys / 2;
      const int r = threadIdx.x / 2, k_begin = (threadIdx.x % 2) * kHalf;
      float logits[kHalf];
      float tile_m = NegInf();
      bool nan = false;  // the max skips NaN (StdMax); the sum must not
#pragma unroll
      for (int k = 0; k < kHalf; ++k) {
        logits[k] = logit_at(r, k_begin + k);
        tile_m = StdMax(tile_m, logits[k]);
        nan |= logits[k] != logits[k];
      }
      tile_m = StdMax(tile_m, __shfl_xor_sync(0xffffffffu, tile_m, 1));
      float tile_l = 0.0f;
      if (tile_m != NegInf()) {
#pragma unroll
        for (int k = 0; k < kHalf; ++k) {
          if (logits[k] != NegInf()) tile_l += expf(logits[k] - tile_m);
        }
      }
      if (nan) tile_l = __int_as_float(0x7fc00000);
      tile_l += __shfl_xor_sync(0xffffffffu, tile_l, 1);
      CombineStats(run_m, run_l, tile_m, tile_l);
    } else {
      for (int i = threadIdx.x; i < kTileRows * kTileKeys; i += kTileThreads) {
        const int r = i / kTileKeys, k = i % kTileKeys;
        if (row0 + r >= rows || key_row[k] == nullptr) continue;  // padding
        const float logit = logit_at(r, k);
        float value = logit;
        if (!logits_only) {
          const float2 row = stats[r];  // (max, 1 / sum); max -inf: every key masked
          if (row.x == NegInf()) {
            value = 0.0f;
          } else {
            value = (logit == NegInf() ? 0.0f : expf(logit - row.x)) * row.y;
          }
        }
        job.out[(row_base + row0 + r) * count + key0 + k] = value;
      }
    }
    __syncthreads();  // the tiles are refilled next
  }
  if (kStatsPass && threadIdx.x % 2 == 0 && row0 + threadIdx.x / 2 < rows) {
    partials[(row_base + row0 + threadIdx.x / 2) * gridDim.x + blockIdx.x] =
        make_float2(run_m, run_l);
  }
}

// Per row: the blocks' statistics combined in block order into (max, 1 / sum).
__global__ void CombineRowStatsKernel(const float2* partials, int64_t total_rows, int32_t groups,
                                      float2* row_stats) {
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; row < total_rows;
       row += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float m = NegInf(), l = 0.0f;
    for (int g = 0; g < groups; ++g) {
      const float2 part = partials[row * groups + g];
      CombineStats(m, l, part.x, part.y);
    }
    row_stats[row] = make_float2(m, m == NegInf() ? 0.0f : 1.0f / l);
  }
}

template <typename T>
cudaError_t LaunchTiledAttention(const DevAttentionJob& job, bool logits_only,
                                 cudaStream_t stream) {
  const DevPagedView& v = job.keys;
  const int32_t rows = job.num_q_heads / v.num_kv_heads * job.num_queries;
  const int64_t key_tiles = (static_cast<int64_t>(v.count) + kTileKeys - 1) / kTileKeys;
  const int64_t groups = (key_tiles + kKeyTilesPerBlock - 1) / kKeyTilesPerBlock;
  const dim3 grid(static_cast<unsigned>(groups), (rows + kTileRows - 1) / kTileRows,
                  v.num_kv_heads);
  const size_t shared = TileSharedBytes<T>(v.head_dim);
  cudaError_t error = cudaFuncSetAttribute(TiledAttentionKernel<T, false>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, shared);
  if (error != cudaSuccess) return error;
  if (logits_only) {
    kvs::DeviceCounters::Launch();
    TiledAttentionKernel<T, false><<<grid, kTileThreads, shared, stream>>>(job, rows, true,
                                                                          nullptr, nullptr);
    return cudaGetLastError();
  }
  error = cudaFuncSetAttribute(TiledAttentionKernel<T, true>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, shared);
  if (error != cudaSuccess) return error;
  const int64_t total_rows = static_cast<int64_t>(rows) * v.num_kv_heads;
  float2* scratch = nullptr;
  error = cudaMallocAsync(reinterpret_cast<void**>(&scratch),
                          sizeof(float2) * static_cast<size_t>(total_rows * (groups + 1)), stream);
  if (error != cudaSuccess) return error;
  float2* partials = scratch;
  float2* row_stats = scratch + total_rows * groups;
  kvs::DeviceCounters::Launch();
  TiledAttentionKernel<T, true><<<grid, kTileThreads, shared, stream>>>(job, rows, false, partials,
                                                                       nullptr);
  kvs::DeviceCounters::Launch();
  CombineRowStatsKernel<<<GridFor((total_rows + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      partials, total_rows, static_cast<int32_t>(groups), row_stats);
  kvs::DeviceCounters::Launch();
  TiledAttentionKernel<T, false><<<grid, kTileThreads, shared, stream>>>(job, rows, false, nullptr,
                                                                        row_stats);
  error = cudaGetLastError();
  const cudaError_t freed = cudaFreeAsync(scratch, stream);
  return error != cudaSuccess ? error : freed;
}

// The attention of one job: tiled on the tensor cores where the key type, head_dim and row count
// allow it, else one block per (query head, query) row.
cudaError_t AttentionInto(const DevAttentionJob& job, bool logits_only, cudaStream_t stream) {
  const DevPagedView& v = job.keys;
  // The key tile is loaded 16 bytes at a time: rows (head_dim * 2 bytes) and blocks must keep
  // that alignment.
  const bool aligned =
      reinterpret_cast<uintptr_t>(v.arena) % 16 == 0 && v.block_bytes % 16 == 0;
  // Fewer than 16 rows per kv head (a decode step's one query) would leave most of each warp's
  // 16-row tile empty: one block per row does less work there.
  const int64_t rows_per_head =
      static_cast<int64_t>(job.num_q_heads / v.num_kv_heads) * job.num_queries;
  // The grid's y and z (row tiles, kv heads) stop at 65535, and the tiles' shared memory must fit
  // what this device lets a block opt into (99 KiB on sm_86/sm_89, 163 KiB on A100, 227 KiB on
  // H100/H200): bf16 keys of head_dim 256 need about 150 KiB.
  bool tiled = aligned && rows_per_head >= 16 && v.head_dim % 16 == 0 &&
               v.head_dim <= kTileMaxDim && v.count > 0 &&
               (v.dtype == kFloat16 || v.dtype == kBFloat16) &&
               (rows_per_head + kTileRows - 1) / kTileRows <= 65535 && v.num_kv_heads <= 65535;
  if (tiled) {  // asked only here: a decode step's jobs never reach the tiles
    int device = 0, shared_limit = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&shared_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
            cudaSuccess) {
      (void)cudaGetLastError();
      shared_limit = 0;  // unknown: the row kernel
    }
    constexpr size_t kStaticShared = 2048;  // the kernel's own __shared__ arrays, rounded up
    const size_t tile_shared = v.dtype == kFloat16 ? TileSharedBytes<half>(v.head_dim)
                                                   : TileSharedBytes<__nv_bfloat16>(v.head_dim);
    tiled = tile_shared + kStaticShared <= static_cast<size_t>(shared_limit);
  }
  if (tiled && v.dtype == kFloat16) return LaunchTiledAttention<half>(job, logits_only, stream);
  if (tiled) return LaunchTiledAttention<__nv_bfloat16>(job, logits_only, stream);
  const int64_t rows = static_cast<int64_t>(job.num_q_heads) * job.num_queries;
  const size_t shared = static_cast<size_t>(v.head_dim) * sizeof(float);
  kvs::DeviceCounters::Launch();
  AttentionKernel<<<GridFor(rows), kThreads, shared, stream>>>(job, logits_only);
  return cudaGetLastError();
}

// Column sums of [rows][num_queries][count] probabilities: one thread per (row, slot), the
// query rows added in ascending order (the CPU backend's order).
__global__ void ColumnSumsKernel(const float* probs, int32_t num_q_heads, int32_t num_queries,
                                 int64_t count, float* sums) {
  const int64_t total = static_cast<int64_t>(num_q_heads) * count;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t q = idx / count;
    const int64_t s = idx % count;
    float sum = 0.0f;
    for (int32_t i = 0; i < num_queries; ++i) sum += probs[(q * num_queries + i) * count + s];
    sums[idx] = sum;
  }
}

// Pooling along an order of slots (gpu/cpu/pool_cpu.cc): out already holds a copy of in.
__global__ void PoolKernel(const float* in, const int32_t* order, const int32_t* lengths,
                           int32_t rows, int32_t num_kv_heads, int64_t count, int32_t kernel_size,
                           int kind, float* out) {
  const int64_t total = static_cast<int64_t>(rows) * count;
  const int32_t group = rows / num_kv_heads;
  const int32_t half = kernel_size / 2;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = idx / count;
    const int64_t j = idx % count;
    const int64_t head = row / group;
    const int32_t m = lengths[head];
    if (j >= m) continue;
    const int32_t* o = order + head * count;
    const float* src = in + row * count;
    const int64_t lo = j - half > 0 ? j - half : 0;
    const int64_t hi = j + half < m - 1 ? j + half : m - 1;
    float best = NegInf();
    double sum = 0.0;
    for (int64_t t = lo; t <= hi; ++t) {
      const float v = src[o[t]];
      best = StdMax(best, v);
      sum += v;
    }
    out[row * count + o[j]] = kind == 1 ? best : static_cast<float>(sum / kernel_size);
  }
}

// ---------------------------------------------------------------------------------------------
// CAKE's window statistics (gpu/cpu/window_stats_cpu.cc).

// One thread per (query head, slot): the window's rows of that slot, ascending, fp64.
__global__ void WindowVarianceKernel(const float* probs, int32_t num_q_heads, int32_t num_queries,
                                     int32_t window, int64_t count, double gamma, float* scores) {
  const int64_t total = static_cast<int64_t>(num_q_heads) * count;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t q = idx / count;
    const int64_t s = idx % count;
    const float* column = probs + (q * num_queries + (num_queries - window)) * count + s;
    double mean = 0.0;
    for (int32_t i = 0; i < window; ++i) mean += column[i * count];
    mean /= window;
    double squares = 0.0;
    for (int32_t i = 0; i < window; ++i) {
      const double d = static_cast<double>(column[i * count]) - mean;
      squares += d * d;
    }
    const double var = window > 1 ? squares / (window - 1) : 0.0;
    scores[idx] = static_cast<float>(mean + gamma * var);
  }
}

// Blocks of the entropy reduction: fixed for a job's size, so the sums are deterministic.
constexpr int kEntropyMaxBlocks = 1024;

// Sums `value` over the block's threads by a fixed tree; the result is valid in thread 0.
__device__ double BlockSum(double value, double* shared) {
  shared[threadIdx.x] = value;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) shared[threadIdx.x] += shared[threadIdx.x + stride];
    __syncthreads();
  }
  const double sum = shared[0];
  __syncthreads();
  return sum;
}

// Per-block partial sums of the entropy terms and the variances of the prefix (q, s) pairs:
// partials[2 * block] (sum of p ln(p + 1e-10), each slot's rows summed in fp32) and
// partials[2 * block + 1] (sum of unbiased variances).
__global__ void WindowEntropyPartialsKernel(const float* probs, const int32_t* key_positions,
                                            int32_t num_q_heads, int32_t group, int32_t num_queries,
                                            int32_t window, int64_t count,
                                            int32_t first_query_position, double* partials) {
  __shared__ double shared[kThreads];
  const int64_t total = static_cast<int64_t>(num_q_heads) * count;
  const float largest = 3.402823466e+38f;
  double plogp = 0.0;
  double shift = 0.0;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t q = idx / count;
    const int64_t s = idx % count;
    if (key_positions[(q / group) * count + s] >= first_query_position) continue;
    const float* column = probs + (q * num_queries + (num_queries - window)) * count + s;
    float terms = 0.0f;
    double sum = 0.0;
    for (int32_t i = 0; i < window; ++i) {
      const float p = column[i * count];
      sum += p;
      const float x = p + 1e-10f;
      // ln takes (0, max]; anything else poisons the slot, as on the CPU.
      terms += (x > 0.0f && x <= largest) ? p * logf(x) : __int_as_float(0x7fc00000);
    }
    plogp += terms;
    if (window >= 2) {
      const double mean = sum / window;
      double squares = 0.0;
      for (int32_t i = 0; i < window; ++i) {
        const double d = static_cast<double>(column[i * count]) - mean;
        squares += d * d;
      }
      shift += squares / (window - 1);
    }
  }
  plogp = BlockSum(plogp, shared);
  shift = BlockSum(shift, shared);
  if (threadIdx.x == 0) {
    partials[2 * blockIdx.x] = plogp;
    partials[2 * blockIdx.x + 1] = shift;
  }
}

// One block: the partials summed by a fixed tree into the job's two outputs.
__global__ void WindowEntropyFinishKernel(const double* partials, int32_t blocks, double* entropy,
                                          double* shift) {
  __shared__ double shared[kThreads];
  double plogp = 0.0;
  double sum = 0.0;
  for (int32_t b = threadIdx.x; b < blocks; b += kThreads) {
    plogp += partials[2 * b];
    sum += partials[2 * b + 1];
  }
  plogp = BlockSum(plogp, shared);
  sum = BlockSum(sum, shared);
  if (threadIdx.x == 0) {
    *entropy = -plogp;
    *shift = sum;
  }
}

// ---------------------------------------------------------------------------------------------
// CAOTE (gpu/cpu/caote_cpu.cc ScoreHeadScalar): one block per row; X accumulates in double.

__global__ void CaoteKernel(DevPagedView v, const float* alpha_all, int32_t rows, bool fast,
                            float eps, float* scores_all) {
  extern __shared__ float x[];
  const int64_t count = v.count;
  const int dim = v.head_dim;
  const int64_t rows_per_head = rows / v.num_kv_heads;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t head = row / rows_per_head;
    const float* alpha = alpha_all + row * count;
    float* scores = scores_all + row * count;
    __syncthreads();
    for (int d = threadIdx.x; d < dim; d += kThreads) {
      double sum = 0.0;
      for (int64_t s = 0; s < count; ++s) {
        const double weight = fast ? 1.0 : static_cast<double>(alpha[s]);
        sum += weight * static_cast<double>(LoadF(PagedRow(v, head, s), v.dtype, d));
      }
      x[d] = static_cast<float>(fast ? sum / static_cast<double>(count) : sum);
    }
    __syncthreads();
    for (int64_t s = threadIdx.x; s < count; s += kThreads) {
      const float a = alpha[s];
      if (a == 0.0f) {
        scores[s] = 0.0f;
        continue;
      }
      if (1.0f - a <= eps) {
        scores[s] = PosInf();
        continue;
      }
      const uint8_t* value = PagedRow(v, head, s);
      float squared = 0.0f;
      for (int d = 0; d < dim; ++d) {
        const float diff = x[d] - LoadF(value, v.dtype, d);
        squared += diff * diff;
      }
      scores[s] = a / (1.0f - a) * sqrtf(squared);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// D2O nearest keys (gpu/cpu/merge_cpu.cc NearestKeysOfJobScalar): one block per query slot.

struct Best {
  float similarity;
  int32_t position;
  int32_t index;  // -1: none yet
};

// merge_cpu.cc Better(), plus "the lower index" between two NaNs so that the block-wide result
// equals the sequential scan's (which keeps its first candidate when every similarity is NaN).
__device__ inline bool Beats(const Best& a, const Best& b) {
  if (a.index < 0) return false;
  if (b.index < 0) return true;
  const bool a_nan = a.similarity != a.similarity, b_nan = b.similarity != b.similarity;
  if (a_nan && b_nan) return a.index < b.index;
  if (a_nan) return false;
  if (b_nan) return true;
  return a.similarity > b.similarity || (a.similarity == b.similarity && a.position < b.position);
}

__device__ inline float NormOf(const uint8_t* row, int dtype, int dim) {
  float squared = 0.0f;
  for (int d = 0; d < dim; ++d) {
    const float x = LoadF(row, dtype, d);
    squared += x * x;
  }
  return StdMax(sqrtf(squared), 1e-6f);
}

__global__ void NearestKeysKernel(DevPagedView v, int32_t head, const int32_t* query_slots,
                                  int32_t num_queries, const int32_t* candidate_slots,
                                  const int32_t* candidate_positions, int32_t num_candidates,
                                  float* similarity, int32_t* target) {
  extern __shared__ float query[];
  __shared__ Best best_of[kThreads];
  __shared__ float query_norm;
  const int dim = v.head_dim;
  for (int64_t e = blockIdx.x; e < num_queries; e += gridDim.x) {
    const uint8_t* q_row = PagedRow(v, head, query_slots[e]);
    __syncthreads();
    if (threadIdx.x == 0) query_norm = NormOf(q_row, v.dtype, dim);
    __syncthreads();
    for (int d = threadIdx.x; d < dim; d += kThreads) {
      query[d] = LoadF(q_row, v.dtype, d) / query_norm;
    }
    __syncthreads();
    Best best{0.0f, 0, -1};
    for (int c = threadIdx.x; c < num_candidates; c += kThreads) {
      const uint8_t* c_row = PagedRow(v, head, candidate_slots[c]);
      const float norm = NormOf(c_row, v.dtype, dim);
      float dot = 0.0f;
      for (int d = 0; d < dim; ++d) dot += query[d] * (LoadF(c_row, v.dtype, d) / norm);
      const Best candidate{dot, candidate_positions[c], c};
      if (best.index < 0 || Beats(candidate, best)) best = candidate;
    }
    best_of[threadIdx.x] = best;
    __syncthreads();
    for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
      if (threadIdx.x < stride && Beats(best_of[threadIdx.x + stride], best_of[threadIdx.x])) {
        best_of[threadIdx.x] = best_of[threadIdx.x + stride];
      }
      __syncthreads();
    }
    if (threadIdx.x == 0) {
      similarity[e] = best_of[0].similarity;
      target[e] = best_of[0].index;
    }
  }
}

// The tiled path of prefill-sized jobs: every query and candidate row is normalised once into
// fp32 scratch (UnitRowsKernel), then a block takes kNearestTileQueries queries and streams the
// candidates through shared memory kNearestTileCandidates at a time, each thread scanning four
// candidates of one query. Each dot is the same sequential rounded sum over d as
// NearestKeysKernel's (this file is built with --fmad=false), and Beats is a total order, so both
// kernels pick the same target with the same similarity whatever the order of the scan.
constexpr int kNearestTileQueries = 16;
constexpr int kNearestTileCandidates = 64;
constexpr int kNearestLanes = kThreads / kNearestTileQueries;  // threads per query
constexpr int kNearestPerLane = kNearestTileCandidates / kNearestLanes;
static_assert(kNearestLanes * kNearestTileQueries == kThreads, "one tile row per lane group");
static_assert(kNearestLanes == 16 && kNearestPerLane == 4, "the lane reduction is written for 16");
constexpr int kNearestMaxTiledDim = 128;         // shared memory: (16 + 64) x 132 fp32 = 41 KiB
constexpr int32_t kNearestMinTiledQueries = 64;  // below: one block per query (decode steps)

// One warp per row: out[i] = row(slots[i]) / NormOf(row), NearestKeysKernel's numbers.
__global__ void UnitRowsKernel(DevPagedView v, int32_t head, const int32_t* slots, int32_t n,
                               float* out) {
  const int warps = kThreads / 32;
  const int lane = threadIdx.x % 32;
  const int dim = v.head_dim;
  for (int64_t i = int64_t{blockIdx.x} * warps + threadIdx.x / 32; i < n;
       i += int64_t{gridDim.x} * warps) {
    const uint8_t* row = PagedRow(v, head, slots[i]);
    float norm = 0.0f;
    if (lane == 0) norm = NormOf(row, v.dtype, dim);
    norm = __shfl_sync(0xffffffffu, norm, 0);
    for (int d = lane; d < dim; d += 32) out[i * dim + d] = LoadF(row, v.dtype, d) / norm;
  }
}

// Rows of `dim` (a multiple of 4) fp32 values, `count` of them from `first`, into a tile of
// `rows` rows of `stride` floats; rows past `count` are zero (never selected).
__device__ inline void LoadUnitTile(const float* units, int64_t first, int64_t count, int rows,
                                    int dim, int stride, float* tile) {
  const int vec = dim / 4;
  for (int i = threadIdx.x; i < rows * vec; i += kThreads) {
    const int r = i / vec, k = i % vec;
    float4 value = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (first + r < count) value = reinterpret_cast<const float4*>(units + (first + r) * dim)[k];
    reinterpret_cast<float4*>(tile + r * stride)[k] = value;
  }
}

__global__ void NearestTiledKernel(const float* query_units, int32_t num_queries,
                                   const float* candidate_units, int32_t num_candidates, int dim,
                                   const int32_t* candidate_positions, float* similarity,
                                   int32_t* target) {
  extern __shared__ float4 shared4[];  // float4: 16-byte aligned rows
  const int stride = dim + 4;          // 4 floats of padding: a quarter warp's rows hit 8 banks
  float* queries = reinterpret_cast<float*>(shared4);
  float* candidates = queries + kNearestTileQueries * stride;
  const int q = threadIdx.x / kNearestLanes, lane = threadIdx.x % kNearestLanes;
  const int vec = dim / 4;
  for (int64_t q0 = int64_t{blockIdx.x} * kNearestTileQueries; q0 < num_queries;
       q0 += int64_t{gridDim.x} * kNearestTileQueries) {
    __syncthreads();
    LoadUnitTile(query_units, q0, num_queries, kNearestTileQueries, dim, stride, queries);
    Best best{0.0f, 0, -1};
    for (int32_t c0 = 0; c0 < num_candidates; c0 += kNearestTileCandidates) {
      __syncthreads();
      LoadUnitTile(candidate_units, c0, num_candidates, kNearestTileCandidates, dim, stride,
                   candidates);
      __syncthreads();
      float dot[kNearestPerLane] = {0.0f, 0.0f, 0.0f, 0.0f};
      const float4* query = reinterpret_cast<const float4*>(queries + q * stride);
      for (int k = 0; k < vec; ++k) {
        const float4 a = query[k];
#pragma unroll
        for (int j = 0; j < kNearestPerLane; ++j) {
          const float4 b =
              reinterpret_cast<const float4*>(candidates + (lane + kNearestLanes * j) * stride)[k];
          dot[j] += a.x * b.x;  // in d order, each product rounded, then the sum (no fma)
          dot[j] += a.y * b.y;
          dot[j] += a.z * b.z;
          dot[j] += a.w * b.w;
        }
      }
#pragma unroll
      for (int j = 0; j < kNearestPerLane; ++j) {
        const int32_t c = c0 + lane + kNearestLanes * j;
        if (c >= num_candidates) continue;
        const Best candidate{dot[j], candidate_positions[c], c};
        if (best.index < 0 || Beats(candidate, best)) best = candidate;
      }
    }
    // The best of the 16 lanes of each query (lanes of one query are adjacent in one warp).
    for (int offset = kNearestLanes / 2; offset > 0; offset >>= 1) {
      Best other;
      other.similarity = __shfl_down_sync(0xffffffffu, best.similarity, offset, kNearestLanes);
      other.position = __shfl_down_sync(0xffffffffu, best.position, offset, kNearestLanes);
      other.index = __shfl_down_sync(0xffffffffu, best.index, offset, kNearestLanes);
      if (Beats(other, best)) best = other;
    }
    if (lane == 0 && q0 + q < num_queries) {
      similarity[q0 + q] = best.similarity;
      target[q0 + q] = best.index;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Weighted row merge: one block per merged row; every source element is read into shared memory
// before any element of dst is written (dst may be a source).

constexpr int kMergeChunk = 4096;  // = kMaxHeadDim: one chunk for every layout

__global__ void MergeRowsKernel(DevMergeJob job) {
  __shared__ float sum[kMergeChunk];
  for (int64_t r = blockIdx.x; r < job.rows; r += gridDim.x) {
    const int64_t first = job.source_starts[r], last = job.source_starts[r + 1];
    uint8_t* dst = job.arena + job.dst_offsets[r];
    for (int base = 0; base < job.row_elements; base += kMergeChunk) {
      const int end = job.row_elements - base < kMergeChunk ? job.row_elements : base + kMergeChunk;
      for (int d = base + threadIdx.x; d < end; d += kThreads) {
        float acc = 0.0f;
        for (int64_t k = first; k < last; ++k) {
          acc += job.weights[k] * LoadF(job.arena + job.src_offsets[k], job.dtype, d);
        }
        sum[d - base] = acc;
      }
      __syncthreads();
      for (int d = base + threadIdx.x; d < end; d += kThreads) {
        StoreF(dst, job.dtype, d, sum[d - base]);
      }
      __syncthreads();
    }
  }
}

// ---- DecodeEvict (gpu/backend.h): one block per (job, kv head) -------------------------------

// ScoreKey (above) is TopKJob's order: NaN below every number, -0 as +0.

__device__ inline bool Probability(float p) { return isfinite(p) && p >= 0.0f; }

// The k-th smallest (k >= 1) of the n non-negative int32 values at `values` (row-strided by 1),
// by a block-wide radix select on their bits, 8 at a time. Every thread gets the result.
__device__ int32_t BlockSelect(const int32_t* values, int32_t n, int32_t k, uint32_t* histogram) {
  uint32_t prefix = 0, prefix_mask = 0;
  int32_t remaining = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += kThreads) histogram[i] = 0;
    __syncthreads();
    for (int32_t s = threadIdx.x; s < n; s += kThreads) {
      const uint32_t v = static_cast<uint32_t>(values[s]);
      if ((v & prefix_mask) == prefix) atomicAdd(&histogram[(v >> shift) & 0xffu], 1u);
    }
    __syncthreads();
    __shared__ uint32_t digit_found, below_found;
    if (threadIdx.x == 0) {
      uint32_t below = 0, digit = 0;
      for (; digit < 256; ++digit) {
        if (below + histogram[digit] >= static_cast<uint32_t>(remaining)) break;
        below += histogram[digit];
      }
      digit_found = digit;
      below_found = below;
    }
    __syncthreads();
    remaining -= static_cast<int32_t>(below_found);
    prefix |= digit_found << shift;
    prefix_mask |= 0xffu << shift;
    __syncthreads();
  }
  return static_cast<int32_t>(prefix);
}

// Whether the job's inputs this head's block reads hold a non-finite row value (1), a query or
// probability out of range (2), or neither (0): the new token's K and V rows of the head, its
// query rows of the step's probabilities, and (head 0) the staged queries.
__device__ int DecodeInputsBad(const DevDecodeJob& job, int32_t h) {
  __shared__ int bad;
  const int32_t heads = job.keys.num_kv_heads;
  const int32_t n = job.keys.count;
  const int32_t group = job.num_q_heads / heads;
  if (threadIdx.x == 0) bad = 0;
  __syncthreads();
  DevPagedView v = job.keys;
  for (int kv = 0; kv < 2; ++kv) {
    v.kv_index = kv;
    const uint8_t* row = PagedRow(v, h, n - 1);
    for (int32_t d = threadIdx.x; d < v.head_dim; d += kThreads) {
      if (!isfinite(LoadF(row, v.dtype, d))) bad = 1;
    }
  }
  if (h == 0) {
    for (int64_t i = threadIdx.x; i < job.query_values; i += kThreads) {
      if (!isfinite(job.queries[i])) bad = 2;
    }
  }
  for (int32_t r = h * group; job.sums != nullptr && r < (h + 1) * group; ++r) {
    for (int32_t s = threadIdx.x; s < n; s += kThreads) {
      if (!Probability(job.sums[static_cast<int64_t>(r) * n + s])) bad = 2;
    }
  }
  if (job.rows != nullptr && job.rows_are_probabilities) {
    const int32_t row_group = job.rows_count / heads;
    for (int32_t r = h * row_group; r < (h + 1) * row_group; ++r) {
      for (int32_t s = threadIdx.x; s < n; s += kThreads) {
        if (!Probability(job.rows[static_cast<int64_t>(r) * n + s])) bad = 2;
      }
    }
  }
  __syncthreads();
  return bad;
}

// The selection score of slot s of head h (ScoredPolicy::Select's: GQA means in fp64).
__device__ float DecodeScore(const DevDecodeJob& job, int32_t h, int32_t s) {
  const int32_t heads = job.keys.num_kv_heads;
  const int32_t n = job.keys.count;
  if (job.scores == 1) {  // kAccumulated: accumulated + this step's sums (the new slot from 0)
    const int32_t group = job.num_q_heads / heads;
    double sum = 0.0;
    for (int32_t r = h * group; r < (h + 1) * group; ++r) {
      float value = s < n - 1 ? job.accumulated[static_cast<int64_t>(r) * job.stride + s] : 0.0f;
      if (job.sums != nullptr) value += job.sums[static_cast<int64_t>(r) * n + s];
      sum += value;
    }
    return group == 1 ? static_cast<float>(sum) : static_cast<float>(sum / group);
  }
  if (job.scores == 2) {  // kRows
    const int32_t row_group = job.rows_count / heads;
    if (row_group == 1) return job.rows[static_cast<int64_t>(h) * n + s];
    double sum = 0.0;
    for (int32_t r = h * row_group; r < (h + 1) * row_group; ++r) {
      sum += job.rows[static_cast<int64_t>(r) * n + s];
    }
    return static_cast<float>(sum / row_group);
  }
  return 0.0f;  // kNone
}

// kChoose for head h: the inputs checked, then the slot TopK would drop.
__device__ void DecodeChoose(const DevDecodeJob& job, int32_t h) {
  __shared__ uint32_t histogram[256];
  __shared__ unsigned long long best[kThreads];
  const int32_t n = job.keys.count;
  int32_t* positions = job.positions + static_cast<int64_t>(h) * job.stride;
  if (threadIdx.x == 0) positions[n - 1] = job.new_position;
  const int bad = DecodeInputsBad(job, h);  // its barriers order the write above
  if (bad != 0) {
    if (threadIdx.x == 0) job.evicted[h] = bad == 1 ? -2 : -3;  // kDecode* of gpu/backend.h
    return;
  }
  if (!job.evict) {
    if (threadIdx.x == 0) job.evicted[h] = -1;
    return;
  }
  // The protected positions' limits: the sinks-th lowest and the recent-th highest.
  int64_t sink_limit = -1;
  int64_t recent_limit = 0x7fffffffffffffffLL;
  if (job.sinks > 0) sink_limit = BlockSelect(positions, n, job.sinks, histogram);
  if (job.recent > 0) recent_limit = BlockSelect(positions, n, n - job.recent + 1, histogram);
  // Each thread's worst candidate as one 64-bit key: the score key (lower drops first), then
  // the position (higher drops first), so that the minimum is the slot TopK drops.
  unsigned long long mine = ~0ull;
  int32_t mine_slot = -1;
  for (int32_t s = threadIdx.x; s < n; s += kThreads) {
    const int32_t position = positions[s];
    if (position <= sink_limit || position >= recent_limit) continue;
    const unsigned long long key =
        (static_cast<unsigned long long>(ScoreKey(DecodeScore(job, h, s))) << 32) |
        static_cast<uint32_t>(0x7fffffff - position);
    if (key < mine) {
      mine = key;
      mine_slot = s;
    }
  }
  // The block's minimum; positions are distinct, so the key names one slot.
  best[threadIdx.x] = mine;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride && best[threadIdx.x + stride] < best[threadIdx.x]) {
      best[threadIdx.x] = best[threadIdx.x + stride];
    }
    __syncthreads();
  }
  if (mine_slot >= 0 && mine == best[0]) job.evicted[h] = mine_slot;
}

// kApply for head h: this step's sums into the head's group rows, then the last slot moved into
// the evicted one (K and V rows, position, accumulated rows).
__device__ void DecodeApply(const DevDecodeJob& job, int32_t h) {
  const int32_t n = job.keys.count;
  const int32_t last = n - 1;
  const int32_t group = job.num_q_heads / job.keys.num_kv_heads;
  for (int32_t r = h * group; job.accumulated != nullptr && r < (h + 1) * group; ++r) {
    float* row = job.accumulated + static_cast<int64_t>(r) * job.stride;
    for (int32_t s = threadIdx.x; s < n; s += kThreads) {
      float value = s < last ? row[s] : 0.0f;
      if (job.sums != nullptr) value += job.sums[static_cast<int64_t>(r) * n + s];
      row[s] = value;
    }
  }
  __syncthreads();
  if (!job.evict) return;
  const int32_t e = job.evicted[h];
  if (e < 0 || e == last) return;
  DevPagedView v = job.keys;
  const int32_t row_bytes = v.head_dim * DTypeBytesOf(v.dtype);
  for (int kv = 0; kv < 2; ++kv) {
    v.kv_index = kv;
    uint8_t* to = const_cast<uint8_t*>(PagedRow(v, h, e));
    const uint8_t* from = PagedRow(v, h, last);
    for (int32_t b = threadIdx.x; b < row_bytes; b += kThreads) to[b] = from[b];
  }
  int32_t* positions = job.positions + static_cast<int64_t>(h) * job.stride;
  if (threadIdx.x == 0) positions[e] = positions[last];
  for (int32_t r = h * group + static_cast<int32_t>(threadIdx.x);
       job.accumulated != nullptr && r < (h + 1) * group; r += kThreads) {
    float* row = job.accumulated + static_cast<int64_t>(r) * job.stride;
    row[e] = row[last];
  }
}

// One block per (kv head, job): stage 0 chooses, 1 applies.
__global__ void DecodeEvictKernel(const DevDecodeJob* jobs, int32_t num_jobs, int stage) {
  const int32_t j = blockIdx.y;
  const int32_t h = blockIdx.x;
  if (j >= num_jobs || h >= jobs[j].keys.num_kv_heads) return;
  if (stage == 0) {
    DecodeChoose(jobs[j], h);
  } else {
    DecodeApply(jobs[j], h);
  }
}

}  // namespace

cudaError_t LaunchKeyDiff(const DevPagedView& keys, int anchor, int metric, float* scores,
                          cudaStream_t stream) {
  if (keys.count == 0) return cudaSuccess;
  const bool median = metric == kCosine && anchor == kMedianNormalized;
  if (median || keys.head_dim > 32 * kMaxDimsPerLane) {
    // One block per head: the median's radix selects, or a head too wide for a warp's registers.
    const size_t shared = static_cast<size_t>(keys.head_dim) * sizeof(float);
    kvs::DeviceCounters::Launch();
    KeyDiffKernel<<<keys.num_kv_heads, kThreads, shared, stream>>>(keys, anchor, metric, scores);
    return cudaGetLastError();
  }
  const float eps = KeyDiffNormFloor(anchor, metric);
  const int32_t chunks = (keys.count + kKeyDiffChunk - 1) / kKeyDiffChunk;
  const int64_t heads = keys.num_kv_heads, dim = keys.head_dim;
  float* scratch = nullptr;
  const size_t bytes =
      sizeof(float) * static_cast<size_t>(heads * chunks * dim + heads * (dim + 1));
  cudaError_t error = cudaMallocAsync(reinterpret_cast<void**>(&scratch), bytes, stream);
  if (error != cudaSuccess) return error;
  float* partials = scratch;
  float* anchors = scratch + heads * chunks * dim;
  const dim3 grid(chunks, keys.num_kv_heads);
  if (metric == kNegativeNorm) {
    // No anchor: the score pass alone, over zero anchors.
    error = cudaMemsetAsync(anchors, 0, sizeof(float) * static_cast<size_t>(heads * (dim + 1)),
                            stream);
    if (error != cudaSuccess) {
      cudaFreeAsync(scratch, stream);
      return error;
    }
  } else {
    kvs::DeviceCounters::Launch();
    KeyDiffPartialsKernel<<<grid, kThreads, 0, stream>>>(keys, eps, partials);
    kvs::DeviceCounters::Launch();
    KeyDiffAnchorKernel<<<keys.num_kv_heads, kThreads, 0, stream>>>(
        partials, chunks, keys.head_dim, keys.count, metric, anchors);
  }
  kvs::DeviceCounters::Launch();
  KeyDiffScoreKernel<<<grid, kThreads, 0, stream>>>(keys, metric, anchors, scores);
  error = cudaGetLastError();
  const cudaError_t freed = cudaFreeAsync(scratch, stream);
  return error != cudaSuccess ? error : freed;
}

cudaError_t LaunchTopK(const float* scores, const int32_t* positions, const uint8_t* forced,
                       int32_t rows, int32_t n, int32_t k, int32_t* kept, cudaStream_t stream) {
  if (rows == 0 || k == 0) return cudaSuccess;
  kvs::DeviceCounters::Launch();
  TopKKernel<<<GridFor(rows), kThreads, 0, stream>>>(scores, positions, forced, rows, n, k, kept);
  return cudaGetLastError();
}

cudaError_t LaunchCopyRows(uint8_t* arena, const uint64_t* src_offsets, const uint64_t* dst_offsets,
                           int64_t count, uint64_t row_bytes, cudaStream_t stream) {
  if (count <= 0 || row_bytes == 0) return cudaSuccess;
  // A destination may be an earlier row's source (never a later one's: RowCopyJob), so every
  // read must land before the write that could clobber it. Reading all rows into scratch, then
  // writing them all, keeps that order with every row in flight at once: twice the traffic of a
  // plain gather, thousands of times less time than rows one by one.
  uint8_t* scratch = nullptr;
  const uint64_t bytes = static_cast<uint64_t>(count) * row_bytes;
  if (cudaMallocAsync(reinterpret_cast<void**>(&scratch), bytes, stream) != cudaSuccess) {
    (void)cudaGetLastError();  // no scratch: the sequential copy needs none
    kvs::DeviceCounters::Launch();
    CopyRowsKernel<<<1, kThreads, 0, stream>>>(arena, src_offsets, dst_offsets, count, row_bytes);
    return cudaGetLastError();
  }
  cudaError_t error =
      LaunchMoveRows(scratch, nullptr, arena, src_offsets, count, row_bytes, stream);
  if (error == cudaSuccess) {
    error = LaunchMoveRows(arena, dst_offsets, scratch, nullptr, count, row_bytes, stream);
  }
  const cudaError_t freed = cudaFreeAsync(scratch, stream);
  return error != cudaSuccess ? error : freed;
}

cudaError_t LaunchMoveRows(uint8_t* dst, const uint64_t* dst_offsets, const uint8_t* src,
                           const uint64_t* src_offsets, int64_t count, uint64_t row_bytes,
                           cudaStream_t stream) {
  if (count <= 0 || row_bytes == 0) return cudaSuccess;
  const uint64_t bytes = static_cast<uint64_t>(count) * row_bytes;
  const uint64_t units = row_bytes % 16 == 0 ? bytes / 16 : bytes;
  kvs::DeviceCounters::Launch();
  MoveRowsKernel<<<GridFor(static_cast<int64_t>((units + kThreads - 1) / kThreads)), kThreads, 0,
                   stream>>>(dst, dst_offsets, src, src_offsets, count, row_bytes);
  return cudaGetLastError();
}

cudaError_t LaunchCopyHostRows(uint8_t* arena, uint8_t* host, const uint64_t* arena_offsets,
                               const uint64_t* host_offsets, int64_t count, uint64_t row_bytes,
                               bool to_host, cudaStream_t stream) {
  if (count <= 0 || row_bytes == 0) return cudaSuccess;
  kvs::DeviceCounters::Launch();
  CopyHostRowsKernel<<<GridFor(count), kThreads, 0, stream>>>(
      arena, host, arena_offsets, host_offsets, count, row_bytes, to_host);
  return cudaGetLastError();
}

cudaError_t LaunchFindNonFinite(const uint8_t* arena, const uint64_t* row_offsets, int64_t count,
                                int32_t row_elements, int32_t dtype, int64_t* first_non_finite,
                                float* row_norms, cudaStream_t stream) {
  // All ones = -1 as int64 and the largest value for the unsigned atomicMin.
  cudaError_t error = cudaMemsetAsync(first_non_finite, 0xff, sizeof(int64_t), stream);
  if (error != cudaSuccess) return error;
  if (count <= 0 || row_elements <= 0) return cudaSuccess;
  kvs::DeviceCounters::Launch();
  FindNonFiniteKernel<<<GridFor(count), kThreads, 0, stream>>>(
      arena, row_offsets, count, row_elements, dtype,
      reinterpret_cast<unsigned long long*>(first_non_finite), row_norms);
  return cudaGetLastError();
}

cudaError_t LaunchAttention(const DevAttentionJob& job, bool logits_only, cudaStream_t stream) {
  if (job.keys.count == 0) return cudaSuccess;
  return AttentionInto(job, logits_only, stream);
}

bool AttentionBatchable(const DevAttentionJob& job) {
  const int64_t rows_per_head =
      static_cast<int64_t>(job.num_q_heads / job.keys.num_kv_heads) * job.num_queries;
  return rows_per_head < 16 && job.keys.count > 0;
}

cudaError_t LaunchAttentionBatch(const DevAttentionJob* device_jobs, int32_t num_jobs,
                                 int64_t max_rows, int32_t max_head_dim, bool logits_only,
                                 cudaStream_t stream) {
  constexpr int32_t kMaxGridY = 65535;
  const size_t shared = static_cast<size_t>(max_head_dim) * sizeof(float);
  for (int32_t first = 0; first < num_jobs; first += kMaxGridY) {
    const int32_t some = num_jobs - first < kMaxGridY ? num_jobs - first : kMaxGridY;
    kvs::DeviceCounters::Launch();
    AttentionBatchKernel<<<dim3(GridFor(max_rows), some), kThreads, shared, stream>>>(
        device_jobs + first, logits_only);
    if (cudaError_t error = cudaGetLastError(); error != cudaSuccess) return error;
  }
  return cudaSuccess;
}

cudaError_t LaunchAttentionColumnSums(const DevAttentionJob& job, float* sums,
                                      cudaStream_t stream) {
  if (job.keys.count == 0) return cudaSuccess;
  const int64_t rows = static_cast<int64_t>(job.num_q_heads) * job.num_queries;
  float* probs = nullptr;
  cudaError_t error = cudaMallocAsync(reinterpret_cast<void**>(&probs),
                                      static_cast<size_t>(rows * job.keys.count) * sizeof(float),
                                      stream);
  if (error != cudaSuccess) return error;
  DevAttentionJob full = job;
  full.out = probs;
  error = AttentionInto(full, false, stream);
  if (error == cudaSuccess) {
    const int64_t outputs = static_cast<int64_t>(job.num_q_heads) * job.keys.count;
    kvs::DeviceCounters::Launch();
    ColumnSumsKernel<<<GridFor((outputs + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        probs, job.num_q_heads, job.num_queries, job.keys.count, sums);
    error = cudaGetLastError();
  }
  const cudaError_t freed = cudaFreeAsync(probs, stream);
  return error != cudaSuccess ? error : freed;
}

cudaError_t LaunchPool(const float* in, const int32_t* order, const int32_t* lengths, int32_t rows,
                       int32_t num_kv_heads, int32_t count, int32_t kernel_size, int kind,
                       float* out, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const int64_t total = static_cast<int64_t>(rows) * count;
  cudaError_t error = cudaMemcpyAsync(out, in, static_cast<size_t>(total) * sizeof(float),
                                      cudaMemcpyDeviceToDevice, stream);
  if (error != cudaSuccess) return error;
  kvs::DeviceCounters::Launch();
  PoolKernel<<<GridFor((total + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      in, order, lengths, rows, num_kv_heads, count, kernel_size, kind, out);
  return cudaGetLastError();
}

cudaError_t LaunchWindowVariance(const float* probs, int32_t num_q_heads, int32_t num_queries,
                                 int32_t window, int32_t count, double gamma, float* scores,
                                 cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const int64_t total = static_cast<int64_t>(num_q_heads) * count;
  kvs::DeviceCounters::Launch();
  WindowVarianceKernel<<<GridFor((total + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      probs, num_q_heads, num_queries, window, count, gamma, scores);
  return cudaGetLastError();
}

cudaError_t LaunchWindowEntropy(const float* probs, const int32_t* key_positions,
                                int32_t num_q_heads, int32_t num_kv_heads, int32_t num_queries,
                                int32_t window, int32_t count, int32_t first_query_position,
                                double* entropy, double* shift, cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(num_q_heads) * count;
  const int64_t wanted = (total + kThreads - 1) / kThreads;
  const int32_t blocks =
      wanted < 1 ? 1 : (wanted > kEntropyMaxBlocks ? kEntropyMaxBlocks : static_cast<int>(wanted));
  double* partials = nullptr;
  cudaError_t error = cudaMallocAsync(reinterpret_cast<void**>(&partials),
                                      static_cast<size_t>(blocks) * 2 * sizeof(double), stream);
  if (error != cudaSuccess) return error;
  kvs::DeviceCounters::Launch();
  WindowEntropyPartialsKernel<<<blocks, kThreads, 0, stream>>>(
      probs, key_positions, num_q_heads, num_q_heads / num_kv_heads, num_queries, window, count,
      first_query_position, partials);
  error = cudaGetLastError();
  if (error == cudaSuccess) {
    kvs::DeviceCounters::Launch();
    WindowEntropyFinishKernel<<<1, kThreads, 0, stream>>>(partials, blocks, entropy, shift);
    error = cudaGetLastError();
  }
  const cudaError_t freed = cudaFreeAsync(partials, stream);
  return error != cudaSuccess ? error : freed;
}

cudaError_t LaunchCaote(const DevPagedView& values, const float* alpha, int32_t rows, bool fast,
                        float eps, float* scores, cudaStream_t stream) {
  if (values.count == 0) return cudaSuccess;
  const size_t shared = static_cast<size_t>(values.head_dim) * sizeof(float);
  kvs::DeviceCounters::Launch();
  CaoteKernel<<<GridFor(rows), kThreads, shared, stream>>>(values, alpha, rows, fast, eps, scores);
  return cudaGetLastError();
}

cudaError_t LaunchNearestKeys(const DevPagedView& keys, int32_t head, const int32_t* query_slots,
                              int32_t num_queries, const int32_t* candidate_slots,
                              const int32_t* candidate_positions, int32_t num_candidates,
                              float* similarity, int32_t* target, cudaStream_t stream) {
  if (num_queries == 0) return cudaSuccess;
  const int dim = keys.head_dim;
  if (num_queries < kNearestMinTiledQueries || dim > kNearestMaxTiledDim || dim % 4 != 0) {
    const size_t shared = static_cast<size_t>(dim) * sizeof(float);
    kvs::DeviceCounters::Launch();
    NearestKeysKernel<<<GridFor(num_queries), kThreads, shared, stream>>>(
        keys, head, query_slots, num_queries, candidate_slots, candidate_positions, num_candidates,
        similarity, target);
    return cudaGetLastError();
  }
  float* units = nullptr;
  const size_t rows = static_cast<size_t>(num_queries) + static_cast<size_t>(num_candidates);
  cudaError_t error = cudaMallocAsync(reinterpret_cast<void**>(&units),
                                      rows * static_cast<size_t>(dim) * sizeof(float), stream);
  if (error != cudaSuccess) return error;
  float* candidate_units = units + static_cast<size_t>(num_queries) * dim;
  constexpr int kRowsPerBlock = kThreads / 32;
  kvs::DeviceCounters::Launch();
  UnitRowsKernel<<<GridFor((num_queries + kRowsPerBlock - 1) / kRowsPerBlock), kThreads, 0,
                   stream>>>(keys, head, query_slots, num_queries, units);
  error = cudaGetLastError();
  if (error == cudaSuccess) {
    kvs::DeviceCounters::Launch();
    UnitRowsKernel<<<GridFor((num_candidates + kRowsPerBlock - 1) / kRowsPerBlock), kThreads, 0,
                     stream>>>(keys, head, candidate_slots, num_candidates, candidate_units);
    error = cudaGetLastError();
  }
  if (error == cudaSuccess) {
    const size_t shared = static_cast<size_t>(kNearestTileQueries + kNearestTileCandidates) *
                          static_cast<size_t>(dim + 4) * sizeof(float);
    kvs::DeviceCounters::Launch();
    NearestTiledKernel<<<GridFor((num_queries + kNearestTileQueries - 1) / kNearestTileQueries),
                         kThreads, shared, stream>>>(units, num_queries, candidate_units,
                                                     num_candidates, dim, candidate_positions,
                                                     similarity, target);
    error = cudaGetLastError();
  }
  const cudaError_t freed = cudaFreeAsync(units, stream);
  return error != cudaSuccess ? error : freed;
}

cudaError_t LaunchMergeRows(const DevMergeJob& job, cudaStream_t stream) {
  if (job.rows == 0) return cudaSuccess;
  kvs::DeviceCounters::Launch();
  MergeRowsKernel<<<GridFor(job.rows), kThreads, 0, stream>>>(job);
  return cudaGetLastError();
}

cudaError_t LaunchDecodeEvict(const DevDecodeJob* jobs, int32_t num_jobs, int32_t max_heads,
                              int stage, cudaStream_t stream) {
  constexpr int32_t kMaxGridY = 65535;
  for (int32_t first = 0; first < num_jobs; first += kMaxGridY) {
    const int32_t some = num_jobs - first < kMaxGridY ? num_jobs - first : kMaxGridY;
    kvs::DeviceCounters::Launch();
    DecodeEvictKernel<<<dim3(max_heads, some), kThreads, 0, stream>>>(jobs + first, some, stage);
    if (cudaError_t error = cudaGetLastError(); error != cudaSuccess) return error;
  }
  return cudaSuccess;
}

cudaError_t LaunchKeyDiffBatch(const DevKeyDiffJob* device_jobs, int32_t num_jobs,
                               int32_t max_heads, int32_t max_head_dim, cudaStream_t stream) {
  constexpr int32_t kMaxGridY = 65535;
  const size_t shared = static_cast<size_t>(max_head_dim) * sizeof(float);
  for (int32_t first = 0; first < num_jobs; first += kMaxGridY) {
    const int32_t some = num_jobs - first < kMaxGridY ? num_jobs - first : kMaxGridY;
    kvs::DeviceCounters::Launch();
    KeyDiffBatchKernel<<<dim3(max_heads, some), kThreads, shared, stream>>>(device_jobs + first);
    if (cudaError_t error = cudaGetLastError(); error != cudaSuccess) return error;
  }
  return cudaSuccess;
}

}  // namespace kvs::cuda
