#include "gpu/cpu/attention_cpu.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gpu/base/checked_math.h"
#include "gpu/base/dtype.h"
#include "gpu/cpu/avx2_util.h"
#include "gpu/cpu/cpu_isa.h"
#include "gpu/cpu/keydiff_cpu.h"

namespace kvs {
namespace {

// Keys are processed in tiles of kTile consecutive slots (a tile may span several blocks). With
// 8+ query rows per kv head (windows) the tile is converted to fp32 once and then multiplied with
// every query row of the GQA group, so the conversion is paid once per key and group; with fewer
// (decode) the conversion is fused into the multiply and the tile only paces the prefetches and
// the softmax records. 48 fp32 rows of head_dim 128 (24 KiB) stay in L1 next to a strip of
// queries; 48 is a multiple of the micro-kernels' 3 and 16 keys and of the 8 lanes of the
// softmax pass.
constexpr int kTile = 48;
// Below this many multiply-adds in a whole call the work runs on the calling thread: waking a
// worker costs more (decode steps of short sequences).
constexpr uint64_t kParallelMinMacs = 1 << 20;
// A (job, kv head) is split into chunks of at least this many tiles when there are too few
// (job, head) pairs to keep every thread busy.
constexpr int64_t kMinChunkTiles = 4;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Where a job's slots live and what the kernels need of it, precomputed once per call.
struct JobPlan {
  const AttentionJob* job;
  int64_t group;           // G = num_q_heads / num_kv_heads
  int64_t group_rows;      // G * num_queries: the probability rows of one kv head (contiguous)
  int64_t tiles;           // ceil(count / kTile)
  int64_t chunk_tiles;     // tiles per task
  int64_t chunks;          // tasks per group of heads_per_task kv heads
  int64_t heads_per_task;  // kv heads one task covers: all of them in the decode kernel
  int64_t first_task;      // index of this job's first phase-1 task
  uint64_t row_bytes;      // head_dim * dtype bytes
  // Records of split (job, head)s (chunks > 1), kept until phase 2; see Records.
  std::vector<float> tile_max;
  std::vector<float> tile_sum;
};

// Per (probability row, tile): the tile's max logit and its sum of exp(logit - max), written
// while the tile is computed and folded into the row's softmax normaliser at the end. Rows
// [row_base, row_base + rows) of a job, `tiles` entries per row.
struct Records {
  float* max;
  float* sum;
  int64_t row_base;
  int64_t tiles;
  int64_t At(int64_t row, int64_t tile) const { return (row - row_base) * tiles + tile; }
};

// ---------------------------------------------------------------------------------------------
// Scalar reference (any head_dim, any CPU).

void ScalarTask(const JobPlan& plan, const Records& records, int64_t head, int64_t tile_begin,
                int64_t tile_end) {
  const AttentionJob& job = *plan.job;
  const PagedLayerView& keys = job.keys;
  const int dim = keys.head_dim;
  const int64_t count = keys.count;
  const int64_t rows = plan.group_rows;
  const float* queries = job.queries + head * rows * dim;
  const int32_t* key_positions = job.key_positions + KeyPositionsOffset(job, head);
  std::vector<float> tile_keys(static_cast<size_t>(kTile) * dim);
  float logits[kTile];
  for (int64_t t = tile_begin; t < tile_end; ++t) {
    const int64_t s0 = t * kTile;
    const int n = static_cast<int>(std::min<int64_t>(kTile, count - s0));
    for (int j = 0; j < n; ++j) {
      const uint8_t* row = PagedRow(keys, head, s0 + j);
      for (int d = 0; d < dim; ++d) tile_keys[j * dim + d] = LoadAsFloat(row, keys.dtype, d);
    }
    for (int64_t m = 0; m < rows; ++m) {
      const float* q = queries + m * dim;
      const int32_t query_position = job.query_positions[m % job.num_queries];
      float max = kNegInf;
      for (int j = 0; j < n; ++j) {
        if (key_positions[s0 + j] > query_position) {
          logits[j] = kNegInf;
          continue;
        }
        float dot = 0.0f;
        const float* k = tile_keys.data() + j * dim;
        for (int d = 0; d < dim; ++d) dot += q[d] * k[d];
        logits[j] = job.scale * dot;
        max = std::max(max, logits[j]);
      }
      const int64_t row = head * rows + m;
      float* out = job.probs + row * count + s0;
      float sum = 0.0f;
      for (int j = 0; j < n; ++j) {
        out[j] = logits[j] == kNegInf ? 0.0f : std::exp(logits[j] - max);
        sum += out[j];
      }
      records.max[records.At(row, t)] = max;
      records.sum[records.At(row, t)] = sum;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// AVX2 + FMA + F16C. Chosen at run time; the rest of the binary stays baseline x86-64.

using avx2::HorizontalSum;
using avx2::Load8;
using avx2::Transpose8x8;

// exp(x) for x <= 0 (Cephes' expf: range reduction by ln 2 and a degree-5 polynomial, ~2 ulp).
// Returns exactly 0 below -87.3 (where expf underflows) and for -inf, the masked slots.
KVS_AVX2 inline __m256 ExpNonPositive(__m256 x) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 result = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  return _mm256_andnot_ps(underflow, result);
}

KVS_AVX2 inline float HorizontalMax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// Micro-kernel shape: 4 query rows x 3 keys = 12 accumulators + 3 key registers + 1 query register
// = the 16 ymm registers.
constexpr int kRowBlock = 4;
constexpr int kKeyBlock = 3;
constexpr int kLogitStride = kTile + 4;  // room for the scratch columns of the last 4-wide store

// --- Decode kernel (GQA groups of < 8 query rows, e.g. w=1 and G=4): the few query rows share
// each key, so the work per key byte is small and the kernel is bound by the memory stream. The
// key rows are therefore read straight from the arena, converted to fp32 in registers
// (vcvtph2ps / a shift / a plain load) and multiplied at once, with no fp32 tile stored and read
// back; the next tile's rows are prefetched while this one is computed (see DecodeTiles).

// Requests every 64-byte line of rows[begin, end) (row_bytes each) towards the cache: the next
// tile's key rows, while this one is computed.
inline void PrefetchRowLines(const uint8_t* const* rows, int begin, int end, int row_bytes) {
  for (int i = begin; i < end; ++i) {
    for (int offset = 0; offset < row_bytes; offset += 64) __builtin_prefetch(rows[i] + offset);
  }
}

// Dot products of kRows fp32 query rows with kKeys key rows of dtype kType read from the arena
// (dim % 8 == 0): one accumulator per pair (kRows * kKeys independent FMA chains, enough to cover
// the FMA latency on both pipes), reduced at the end with hadds. out[r * out_stride + j] gets the
// dot of query row r with key j; columns kKeys..3 of each 4-wide store are scratch (the caller's
// row buffer is padded). When `prefetch` is not null, the lines of prefetch[0 .. kKeys) (rows of
// the next tile to be computed) are requested first, spreading that tile's prefetches evenly over
// this tile's work.
template <DType kType, int kRows, int kKeys>
KVS_AVX2 inline void FusedDotKernel(const float* q, const uint8_t* const* k,
                                    const uint8_t* const* prefetch, int dim, float* out,
                                    int out_stride) {
  static_assert(kKeys >= 1 && kKeys <= 4);
  constexpr int kBytes = DTypeBytes(kType);
  if (prefetch != nullptr) PrefetchRowLines(prefetch, 0, kKeys, dim * kBytes);
  const uint8_t* key_row[kKeys];
#pragma GCC unroll 4
  for (int j = 0; j < kKeys; ++j) key_row[j] = k[j];
  __m256 acc[kRows][kKeys];
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 4
    for (int j = 0; j < kKeys; ++j) acc[r][j] = _mm256_setzero_ps();
  }
  for (int d = 0; d < dim; d += 8) {
    __m256 key[kKeys];
#pragma GCC unroll 4
    for (int j = 0; j < kKeys; ++j) key[j] = Load8<kType>(key_row[j] + d * kBytes);
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const __m256 x = _mm256_loadu_ps(q + r * dim + d);
#pragma GCC unroll 4
      for (int j = 0; j < kKeys; ++j) acc[r][j] = _mm256_fmadd_ps(x, key[j], acc[r][j]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) {
    const __m256 zero = _mm256_setzero_ps();
    const __m256 a0 = acc[r][0];
    const __m256 a1 = kKeys > 1 ? acc[r][kKeys > 1 ? 1 : 0] : zero;
    const __m256 a2 = kKeys > 2 ? acc[r][kKeys > 2 ? 2 : 0] : zero;
    const __m256 a3 = kKeys > 3 ? acc[r][kKeys > 3 ? 3 : 0] : zero;
    _mm_storeu_ps(out + r * out_stride, avx2::HorizontalSum4(a0, a1, a2, a3));
  }
}

// The logits of kRows query rows against the n keys at `rows` (a tile); `prefetch` (null or the
// next tile's row pointers, n_prefetch of them) is requested along the way.
template <DType kType, int kRows>
KVS_AVX2 inline void FusedDotStrip(const float* q, const uint8_t* const* rows, int n,
                                   const uint8_t* const* prefetch, int n_prefetch, int dim,
                                   float* out) {
  int j = 0;
  int prefetched = 0;
  for (; j + kKeyBlock <= n; j += kKeyBlock) {
    const uint8_t* const* p = nullptr;
    if (prefetch != nullptr && j + kKeyBlock <= n_prefetch) {
      p = prefetch + j;
      prefetched = j + kKeyBlock;
    }
    FusedDotKernel<kType, kRows, kKeyBlock>(q, rows + j, p, dim, out + j, kLogitStride);
  }
  if (n - j == 2) {
    FusedDotKernel<kType, kRows, 2>(q, rows + j, nullptr, dim, out + j, kLogitStride);
  }
  if (n - j == 1) {
    FusedDotKernel<kType, kRows, 1>(q, rows + j, nullptr, dim, out + j, kLogitStride);
  }
  // Prefetch rows the blocked loop above did not reach (a next tile longer than this one).
  if (prefetch != nullptr) {
    PrefetchRowLines(prefetch, prefetched, n_prefetch, dim * DTypeBytes(kType));
  }
}

// Scale, mask, max, exp and sum of one row's logits of one tile, with max = the larger of the
// tile's max and *running_max (the row's max over its earlier tiles in this task, updated): writes
// exp(l - max) to `out` (n floats) and max and the sum to *tile_max and *tile_sum. Taking the
// running max keeps the recorded maxima non-decreasing, so NormalizeRow rescales long runs of
// tiles with one factor (one exp per run, not per tile).
KVS_AVX2 inline void SoftmaxTileRow(const float* logits, const int32_t* key_positions,
                                    int32_t query_position, float scale, int n, float* out,
                                    float* running_max, float* tile_max, float* tile_sum) {
  const __m256 neg_inf = _mm256_set1_ps(kNegInf);
  const __m256i qpos = _mm256_set1_epi32(query_position);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 vscale = _mm256_set1_ps(scale);
  __m256 l[kTile / 8];
  __m256 vmax = neg_inf;
  __m256 nan = _mm256_setzero_ps();
  const int vectors = (n + 7) / 8;
  for (int v = 0; v < vectors; ++v) {
    // Slots past n (a partial last tile) are masked like causal ones; their positions are not
    // read past the end of the job's array.
    const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8 * v), lane);
    const __m256i kpos = _mm256_maskload_epi32(key_positions + 8 * v, valid);
    const __m256i keep = _mm256_andnot_si256(_mm256_cmpgt_epi32(kpos, qpos), valid);
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(logits + 8 * v), vscale);
    l[v] = _mm256_blendv_ps(neg_inf, x, _mm256_castsi256_ps(keep));
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(l[v], l[v], _CMP_UNORD_Q));
    vmax = _mm256_max_ps(vmax, l[v]);
  }
  // A NaN logit (a dot product that overflowed to inf - inf) must not vanish: maxps returns its
  // second operand when one is NaN, so the max may drop it and leave finite, meaningless
  // probabilities. The tile's probabilities become NaN instead, for the caller's finiteness
  // check to refuse, as the scalar kernel's do.
  if (_mm256_movemask_ps(nan) != 0) {
    std::fill(out, out + n, std::numeric_limits<float>::quiet_NaN());
    *tile_max = std::numeric_limits<float>::quiet_NaN();
    *tile_sum = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const float max = std::max(HorizontalMax(vmax), *running_max);
  *running_max = max;
  *tile_max = max;
  if (max == kNegInf) {
    std::fill(out, out + n, 0.0f);
    *tile_sum = 0.0f;
    return;
  }
  const __m256 bmax = _mm256_set1_ps(max);
  __m256 vsum = _mm256_setzero_ps();
  for (int v = 0; v < vectors; ++v) {
    const __m256 e = ExpNonPositive(_mm256_sub_ps(l[v], bmax));
    vsum = _mm256_add_ps(vsum, e);
    if (8 * v + 8 <= n) {
      _mm256_storeu_ps(out + 8 * v, e);
    } else {
      const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8 * v), lane);
      _mm256_maskstore_ps(out + 8 * v, valid, e);
    }
  }
  *tile_sum = HorizontalSum(vsum);
}

// --- Window kernel (GQA groups of >= 8 query rows): the tile is stored transposed, [dim][kTile],
// so that a 6-row x 16-key block of logits accumulates in 12 registers from 2 key loads and 6
// query broadcasts per dimension, with no horizontal reductions. The transpose costs a few
// percent of the tile's multiply-adds when 8+ rows share it; for decode (G rows, often 4) the
// untransposed FusedDotKernel is used instead.

// Slots [s0, s0 + n) as fp32 columns of tile[dim][kTile]; columns up to the next multiple of 16
// past n are zero (the 16-wide kernel reads them; their logits are masked).
template <DType kType>
KVS_AVX2 void ConvertTileTransposed(const PagedLayerView& keys, int64_t head, int64_t s0, int n,
                                    float* tile) {
  constexpr int kBytes = DTypeBytes(kType);
  const int dim = keys.head_dim;
  const int columns = std::min(kTile, (n + 15) / 16 * 16);
  for (int j0 = 0; j0 < columns; j0 += 8) {
    const uint8_t* rows[8];
    for (int i = 0; i < 8; ++i) rows[i] = j0 + i < n ? PagedRow(keys, head, s0 + j0 + i) : nullptr;
    for (int d0 = 0; d0 < dim; d0 += 8) {
      __m256 r[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        r[i] = rows[i] != nullptr ? Load8<kType>(rows[i] + d0 * kBytes) : _mm256_setzero_ps();
      }
      Transpose8x8(r);
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(tile + (d0 + i) * kTile + j0, r[i]);
    }
  }
}

template <int kRows>
KVS_AVX2 inline void DotKernelT(const float* q, const float* tile, int dim, float* out) {
  __m256 acc[kRows][2];
#pragma GCC unroll 6
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int d = 0; d < dim; ++d) {
    const __m256 k0 = _mm256_loadu_ps(tile + d * kTile);
    const __m256 k1 = _mm256_loadu_ps(tile + d * kTile + 8);
#pragma GCC unroll 6
    for (int r = 0; r < kRows; ++r) {
      const __m256 x = _mm256_broadcast_ss(q + r * dim + d);
      acc[r][0] = _mm256_fmadd_ps(x, k0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, k1, acc[r][1]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < kRows; ++r) {
    _mm256_storeu_ps(out + r * kLogitStride, acc[r][0]);
    _mm256_storeu_ps(out + r * kLogitStride + 8, acc[r][1]);
  }
}

constexpr int kRowBlockT = 6;

template <int kRows>
KVS_AVX2 inline void DotStripT(const float* q, const float* tile, int n, int dim, float* out) {
  for (int j = 0; j < n; j += 16) DotKernelT<kRows>(q, tile + j, dim, out + j);
}

// Pulls the next tile's key rows towards the cache while this tile is computed: blocks are
// scattered through the arena, which defeats the hardware stream prefetcher at block boundaries.
void PrefetchTile(const PagedLayerView& keys, int64_t head, int64_t s0, int n, uint64_t row_bytes) {
  for (int j = 0; j < n; ++j) {
    const uint8_t* row = PagedRow(keys, head, s0 + j);
    for (uint64_t offset = 0; offset < row_bytes; offset += 64) __builtin_prefetch(row + offset);
  }
}

// The key rows of (tile t, kv head `head`) and of the (tile, head) after it in the decode
// kernels' order, which are prefetched while this one is computed.
struct DecodeRows {
  const uint8_t* rows[kTile];
  const uint8_t* ahead[kTile];
  int n = 0;
  int n_next = 0;  // 0: nothing after this (tile, head) in the task

  void Load(const PagedLayerView& keys, int64_t head, int64_t head_begin, int64_t head_end,
            int64_t t, int64_t tile_end) {
    const int64_t s0 = t * kTile;
    n = static_cast<int>(std::min<int64_t>(kTile, keys.count - s0));
    PagedRows(keys, head, s0, n, rows);
    n_next = 0;
    if (head + 1 < head_end) {
      n_next = n;
      PagedRows(keys, head + 1, s0, n_next, ahead);
    } else if (t + 1 < tile_end) {
      n_next = static_cast<int>(std::min<int64_t>(kTile, keys.count - s0 - kTile));
      PagedRows(keys, head_begin, s0 + kTile, n_next, ahead);
    }
  }
  const uint8_t* const* next() const { return n_next > 0 ? ahead : nullptr; }
};

// The body of the decode kernel, for the ISA whose kernels `Kernels` gives: Strip<kType, kRows>
// (the logits of a strip of query rows against a tile, prefetching the next tile's rows) and
// Softmax (SoftmaxTileRow's contract). Inlined into each ISA's entry point, which carries the
// target attribute the kernels need.
template <DType kType, typename Kernels>
__attribute__((always_inline)) inline void DecodeLoop(const JobPlan& plan, const Records& records,
                                                      int64_t head_begin, int64_t head_end,
                                                      int64_t tile_begin, int64_t tile_end,
                                                      float* running_max) {
  const AttentionJob& job = *plan.job;
  const int dim = job.keys.head_dim;
  const int64_t count = job.keys.count;
  const int64_t rows = plan.group_rows;
  alignas(64) float logits[kRowBlock * kLogitStride];
  DecodeRows tile;
  for (int64_t t = tile_begin; t < tile_end; ++t) {
    const int64_t s0 = t * kTile;
    for (int64_t head = head_begin; head < head_end; ++head) {
      tile.Load(job.keys, head, head_begin, head_end, t, tile_end);
      const int n = tile.n;
      const float* queries = job.queries + head * rows * dim;
      for (int64_t m0 = 0; m0 < rows; m0 += kRowBlock) {
        const int strip = static_cast<int>(std::min<int64_t>(kRowBlock, rows - m0));
        const float* q = queries + m0 * dim;
        // Only the first strip prefetches; later strips find the tile in L1/L2.
        const uint8_t* const* p = m0 == 0 ? tile.next() : nullptr;
        switch (strip) {
          case 4:
            Kernels::template Strip<kType, 4>(q, tile.rows, n, p, tile.n_next, dim, logits);
            break;
          case 3:
            Kernels::template Strip<kType, 3>(q, tile.rows, n, p, tile.n_next, dim, logits);
            break;
          case 2:
            Kernels::template Strip<kType, 2>(q, tile.rows, n, p, tile.n_next, dim, logits);
            break;
          default:
            Kernels::template Strip<kType, 1>(q, tile.rows, n, p, tile.n_next, dim, logits);
            break;
        }
        for (int r = 0; r < strip; ++r) {
          const int64_t m = m0 + r;
          const int64_t row = head * rows + m;
          Kernels::Softmax(
              logits + r * kLogitStride, job.key_positions + KeyPositionsOffset(job, head) + s0,
              job.query_positions[m % job.num_queries], job.scale, n, job.probs + row * count + s0,
              &running_max[(head - head_begin) * rows + m], &records.max[records.At(row, t)],
              &records.sum[records.At(row, t)]);
        }
      }
    }
  }
}

struct Avx2DecodeKernels {
  template <DType kType, int kRows>
  KVS_AVX2 static void Strip(const float* q, const uint8_t* const* rows, int n,
                             const uint8_t* const* prefetch, int n_prefetch, int dim,
                             float* out) {
    FusedDotStrip<kType, kRows>(q, rows, n, prefetch, n_prefetch, dim, out);
  }
  KVS_AVX2 static void Softmax(const float* logits, const int32_t* key_positions,
                               int32_t query_position, float scale, int n, float* out,
                               float* running_max, float* tile_max, float* tile_sum) {
    SoftmaxTileRow(logits, key_positions, query_position, scale, n, out, running_max, tile_max,
                   tile_sum);
  }
};

// The decode kernel over tiles [tile_begin, tile_end) of kv heads [head_begin, head_end), tile
// by tile and head by head within a tile: a block holds every head's rows of its slots
// ([2][H][B][D]), so this order reads each block's keys as one contiguous run (32 KiB for 8 heads
// x 16 fp16 tokens x 128) where a head-by-head order would read scattered 4 KiB pieces, which
// this machine streams at under half the speed (TLB and DRAM page misses). Keys are streamed from
// the arena (FusedDotStrip) while the next (tile, head) is prefetched, 12 KiB ahead for fp16
// keys of head_dim 128 (further ahead, or prefetches to L2 only, were no better in
// attention_bench). running_max: (head_end - head_begin) * group_rows entries.
template <DType kType>
KVS_AVX2 void DecodeTiles(const JobPlan& plan, const Records& records, int64_t head_begin,
                          int64_t head_end, int64_t tile_begin, int64_t tile_end,
                          float* running_max) {
  DecodeLoop<kType, Avx2DecodeKernels>(plan, records, head_begin, head_end, tile_begin, tile_end,
                                       running_max);
}

template <DType kType>
KVS_AVX2 void Avx2Task(const JobPlan& plan, const Records& records, int64_t head_begin,
                       int64_t head_end, int64_t tile_begin, int64_t tile_end) {
  const AttentionJob& job = *plan.job;
  const PagedLayerView& keys = job.keys;
  const int dim = keys.head_dim;
  const int64_t count = keys.count;
  const int64_t rows = plan.group_rows;
  alignas(32) float logits[kRowBlockT * kLogitStride];
  // Each row's largest logit so far in this task: a tile's exponentials are taken against it
  // (or the tile's own max when larger), so the per-tile maxima recorded are non-decreasing and
  // the normalisation pass rescales long runs of tiles with one factor.
  thread_local std::vector<float> running_max;
  running_max.assign((head_end - head_begin) * rows, kNegInf);
  const bool transposed = rows >= 8;
  if (!transposed) {
    DecodeTiles<kType>(plan, records, head_begin, head_end, tile_begin, tile_end,
                       running_max.data());
    return;
  }
  const int64_t head = head_begin;  // the window kernel's tasks cover one head
  const float* queries = job.queries + head * rows * dim;
  const int32_t* key_positions = job.key_positions + KeyPositionsOffset(job, head);
  thread_local std::vector<float> tile_buffer;
  tile_buffer.resize(static_cast<size_t>(kTile) * dim);
  float* tile = tile_buffer.data();
  for (int64_t t = tile_begin; t < tile_end; ++t) {
    const int64_t s0 = t * kTile;
    const int n = static_cast<int>(std::min<int64_t>(kTile, count - s0));
    ConvertTileTransposed<kType>(keys, head, s0, n, tile);
    if (t + 1 < tile_end) {
      PrefetchTile(keys, head, s0 + kTile,
                   static_cast<int>(std::min<int64_t>(kTile, count - s0 - kTile)), plan.row_bytes);
    }
    for (int64_t m0 = 0; m0 < rows; m0 += kRowBlockT) {
      const int strip = static_cast<int>(std::min<int64_t>(kRowBlockT, rows - m0));
      const float* q = queries + m0 * dim;
      switch (strip) {
        case 6:
          DotStripT<6>(q, tile, n, dim, logits);
          break;
        case 5:
          DotStripT<5>(q, tile, n, dim, logits);
          break;
        case 4:
          DotStripT<4>(q, tile, n, dim, logits);
          break;
        case 3:
          DotStripT<3>(q, tile, n, dim, logits);
          break;
        case 2:
          DotStripT<2>(q, tile, n, dim, logits);
          break;
        default:
          DotStripT<1>(q, tile, n, dim, logits);
          break;
      }
      for (int r = 0; r < strip; ++r) {
        const int64_t m = m0 + r;
        const int64_t row = head * rows + m;
        SoftmaxTileRow(logits + r * kLogitStride, key_positions + s0,
                       job.query_positions[m % job.num_queries], job.scale, n,
                       job.probs + row * count + s0, &running_max[m],
                       &records.max[records.At(row, t)], &records.sum[records.At(row, t)]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// AVX-512 window kernel (GQA groups of >= 8 query rows; decode shapes, bound by the key stream,
// keep the AVX2 kernel). The same transposed fp32 tile and the same per-tile softmax records as
// Avx2Task, with the micro-kernel widened to the 32 zmm registers: 8 query rows x the whole
// 48-key tile (3 zmm) = 24 accumulators + 3 key registers per dimension, each query element
// broadcast straight from memory into the FMA. Every logit is the same ordered fp32 FMA chain
// over d as in the AVX2 kernel, so the two agree exactly on the logits; the softmax differs only
// in the order its 48 exponentials are summed.

// GCC 12's avx512fintrin.h initialises the pass-through operand of unmasked intrinsics from
// _mm512_undefined_*(), which -Wuninitialized reports at every use (a false positive).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// ExpNonPositive on 16 lanes: the same reduction and polynomial, so the same values (vscalefps
// multiplies by 2^n exactly as the exponent-bits product does, in one instruction).
KVS_AVX512 inline __m512 ExpNonPositive512(__m512 x) {
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~underflow), p, n);
}

// SoftmaxTileRow on 16 lanes (see there): the same masking, running max and records. kFull: n is
// kTile (every tile but a partial last one), so the loops unroll and need no tail masks.
template <bool kFull>
KVS_AVX512 inline void SoftmaxTileRow512(const float* logits, const int32_t* key_positions,
                                         int32_t query_position, float scale, int n, float* out,
                                         float* running_max, float* tile_max, float* tile_sum) {
  static_assert(kTile % 16 == 0);
  if constexpr (kFull) n = kTile;
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  const __m512i qpos = _mm512_set1_epi32(query_position);
  const __m512 vscale = _mm512_set1_ps(scale);
  __m512 l[kTile / 16];
  __mmask16 valid[kTile / 16];
  __m512 vmax = neg_inf;
  __mmask16 nan = 0;
  const int vectors = (n + 15) / 16;
#pragma GCC unroll 3
  for (int v = 0; v < vectors; ++v) {
    // Slots past n (a partial last tile) are masked like causal ones and not read.
    const int left = n - 16 * v;
    valid[v] =
        left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
    const __m512i kpos = _mm512_maskz_loadu_epi32(valid[v], key_positions + 16 * v);
    const __mmask16 keep = _mm512_mask_cmple_epi32_mask(valid[v], kpos, qpos);
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(logits + 16 * v), vscale);
    l[v] = _mm512_mask_blend_ps(keep, neg_inf, x);
    nan |= _mm512_cmp_ps_mask(l[v], l[v], _CMP_UNORD_Q);
    vmax = _mm512_max_ps(vmax, l[v]);
  }
  // A NaN logit must not vanish into the max (see SoftmaxTileRow).
  if (nan != 0) {
    std::fill(out, out + n, std::numeric_limits<float>::quiet_NaN());
    *tile_max = std::numeric_limits<float>::quiet_NaN();
    *tile_sum = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const float max = std::max(_mm512_reduce_max_ps(vmax), *running_max);
  *running_max = max;
  *tile_max = max;
  if (max == kNegInf) {
    std::fill(out, out + n, 0.0f);
    *tile_sum = 0.0f;
    return;
  }
  const __m512 bmax = _mm512_set1_ps(max);
  __m512 vsum = _mm512_setzero_ps();
#pragma GCC unroll 3
  for (int v = 0; v < vectors; ++v) {
    const __m512 e = ExpNonPositive512(_mm512_sub_ps(l[v], bmax));
    vsum = _mm512_add_ps(vsum, e);
    _mm512_mask_storeu_ps(out + 16 * v, valid[v], e);
  }
  *tile_sum = _mm512_reduce_add_ps(vsum);
}

// Logits of kRows query rows (rows of q, `dim` apart) against the 48 columns of the transposed
// tile, into out[r * kLogitStride + j]. Columns past the tile's keys hold whatever the buffer
// had (finite converted keys or zeros); their logits are masked by the softmax.
template <int kRows>
KVS_AVX512 inline void DotKernel512(const float* q, const float* tile, int dim, float* out) {
  static_assert(kTile == 48);
  __m512 acc[kRows][3];
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = acc[r][2] = _mm512_setzero_ps();
  for (int d = 0; d < dim; ++d) {
    const float* k = tile + d * kTile;
    const __m512 k0 = _mm512_loadu_ps(k);
    const __m512 k1 = _mm512_loadu_ps(k + 16);
    const __m512 k2 = _mm512_loadu_ps(k + 32);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const __m512 x = _mm512_set1_ps(q[r * dim + d]);
      acc[r][0] = _mm512_fmadd_ps(x, k0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(x, k1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(x, k2, acc[r][2]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
    _mm512_storeu_ps(out + r * kLogitStride, acc[r][0]);
    _mm512_storeu_ps(out + r * kLogitStride + 16, acc[r][1]);
    _mm512_storeu_ps(out + r * kLogitStride + 32, acc[r][2]);
  }
}

constexpr int kRowBlock512 = 8;
// How far ahead the key rows are requested (2 measured no better than 1 in attention_bench).
constexpr int64_t kPrefetchTilesAhead = 1;

// The window kernel of one kv head (head_begin; plan.group_rows >= 8) over tiles
// [tile_begin, tile_end), AVX-512.
template <DType kType>
KVS_AVX512 void Avx512Task(const JobPlan& plan, const Records& records, int64_t head_begin,
                           int64_t tile_begin, int64_t tile_end) {
  const AttentionJob& job = *plan.job;
  const PagedLayerView& keys = job.keys;
  const int dim = keys.head_dim;
  const int64_t count = keys.count;
  const int64_t rows = plan.group_rows;
  alignas(64) float logits[kRowBlock512 * kLogitStride];
  thread_local std::vector<float> running_max;
  running_max.assign(rows, kNegInf);
  const int64_t head = head_begin;
  const float* queries = job.queries + head * rows * dim;
  const int32_t* key_positions = job.key_positions + KeyPositionsOffset(job, head);
  // 64-byte aligned: each 48-float row of the tile is then exactly three cache lines.
  thread_local std::vector<float> tile_buffer;
  tile_buffer.resize(static_cast<size_t>(kTile) * dim + 16);
  float* tile = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(tile_buffer.data()) + 63) &
                                         ~uintptr_t{63});
  // The next tile's key rows, prefetched a few lines per strip of rows: spread over the tile's
  // work, the requests do not queue up behind each other (issued all at once, as PrefetchTile
  // does, the conversion waited on memory for ~17% of this kernel's samples in perf; spread,
  // the prefetches and the conversion take ~12% + 3%: the keys come from DRAM, ~7 GB/s here).
  const uint8_t* next_rows[kTile];
  const int64_t strips = (rows + kRowBlock512 - 1) / kRowBlock512;
  const int64_t lines_per_row = (static_cast<int64_t>(plan.row_bytes) + 63) / 64;
  for (int64_t t = tile_begin; t < tile_end; ++t) {
    const int64_t s0 = t * kTile;
    const int n = static_cast<int>(std::min<int64_t>(kTile, count - s0));
    ConvertTileTransposed<kType>(keys, head, s0, n, tile);
    const int64_t ahead = t + kPrefetchTilesAhead;
    const int n_next =
        ahead < tile_end ? static_cast<int>(std::min<int64_t>(kTile, count - ahead * kTile)) : 0;
    if (n_next > 0) PagedRows(keys, head, ahead * kTile, n_next, next_rows);
    const int64_t lines_per_strip = (n_next * lines_per_row + strips - 1) / strips;
    int next_row = 0;  // the next line to request: row next_row, byte offset next_offset
    int64_t next_offset = 0;
    for (int64_t m0 = 0; m0 < rows; m0 += kRowBlock512) {
      const int strip = static_cast<int>(std::min<int64_t>(kRowBlock512, rows - m0));
      const float* q = queries + m0 * dim;
      for (int64_t i = 0; i < lines_per_strip && next_row < n_next; ++i) {
        __builtin_prefetch(next_rows[next_row] + next_offset);
        next_offset += 64;
        if (next_offset >= static_cast<int64_t>(plan.row_bytes)) {
          next_offset = 0;
          ++next_row;
        }
      }
      switch (strip) {
        case 8:
          DotKernel512<8>(q, tile, dim, logits);
          break;
        case 7:
          DotKernel512<7>(q, tile, dim, logits);
          break;
        case 6:
          DotKernel512<6>(q, tile, dim, logits);
          break;
        case 5:
          DotKernel512<5>(q, tile, dim, logits);
          break;
        case 4:
          DotKernel512<4>(q, tile, dim, logits);
          break;
        case 3:
          DotKernel512<3>(q, tile, dim, logits);
          break;
        case 2:
          DotKernel512<2>(q, tile, dim, logits);
          break;
        default:
          DotKernel512<1>(q, tile, dim, logits);
          break;
      }
      const auto softmax = n == kTile ? SoftmaxTileRow512<true> : SoftmaxTileRow512<false>;
      for (int r = 0; r < strip; ++r) {
        const int64_t m = m0 + r;
        const int64_t row = head * rows + m;
        softmax(logits + r * kLogitStride, key_positions + s0,
                job.query_positions[m % job.num_queries], job.scale, n,
                job.probs + row * count + s0, &running_max[m], &records.max[records.At(row, t)],
                &records.sum[records.At(row, t)]);
      }
    }
  }
}

// --- AVX-512 decode kernel (fewer than 8 query rows per kv head). Where DRAM streams keys
// faster than the AVX2 decode kernel reads them (a 2-core EPYC streams this key layout at
// ~34 GB/s on two threads; the AVX2 kernel read it at ~24), halving its multiply-adds took 15-20 %
// off in attention_bench. Each zmm register holds two keys: its low 8 lanes accumulate one key
// and its high 8 the next, each the same ordered FMA chain over d as a lane of FusedDotKernel,
// and the halves are reduced by the same HorizontalSum4, so by construction the logits are the
// AVX2 kernel's to the bit.

// Elements [d, d + 8) of two key rows (the same offset into each) as one zmm: a's in the low
// half, b's in the high half.
template <DType kType>
KVS_AVX512 inline __m512 LoadKeyPair(const uint8_t* a, const uint8_t* b) {
  if constexpr (kType == DType::kFloat32) {
    const __m256 low = _mm256_loadu_ps(reinterpret_cast<const float*>(a));
    return _mm512_insertf32x8(_mm512_castps256_ps512(low),
                              _mm256_loadu_ps(reinterpret_cast<const float*>(b)), 1);
  } else {
    const __m256i halves = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
    if constexpr (kType == DType::kFloat16) return _mm512_cvtph_ps(halves);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
  }
}

// FusedDotKernel with kKeys <= 8 keys in (kKeys + 1) / 2 zmm pairs (an odd last key is paired
// with itself; its copy is dropped): 4 rows x 4 pairs = 16 accumulators + 4 key registers.
// out[r * out_stride + j] gets the dot of query row r with key j; the columns up to the next
// multiple of 4 are scratch, as in FusedDotKernel.
template <DType kType, int kRows, int kKeys>
KVS_AVX512 inline void FusedDotKernel512(const float* q, const uint8_t* const* k,
                                         const uint8_t* const* prefetch, int dim, float* out,
                                         int out_stride) {
  static_assert(kKeys >= 1 && kKeys <= 8);
  constexpr int kPairs = (kKeys + 1) / 2;
  constexpr int kBytes = DTypeBytes(kType);
  if (prefetch != nullptr) PrefetchRowLines(prefetch, 0, kKeys, dim * kBytes);
  const uint8_t* lo[kPairs];
  const uint8_t* hi[kPairs];
#pragma GCC unroll 4
  for (int p = 0; p < kPairs; ++p) {
    lo[p] = k[2 * p];
    hi[p] = 2 * p + 1 < kKeys ? k[2 * p + 1] : k[2 * p];
  }
  __m512 acc[kRows][kPairs];
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 4
    for (int p = 0; p < kPairs; ++p) acc[r][p] = _mm512_setzero_ps();
  }
  for (int d = 0; d < dim; d += 8) {
    __m512 key[kPairs];
#pragma GCC unroll 4
    for (int p = 0; p < kPairs; ++p) {
      key[p] = LoadKeyPair<kType>(lo[p] + d * kBytes, hi[p] + d * kBytes);
    }
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const __m512 x = _mm512_broadcast_f32x8(_mm256_loadu_ps(q + r * dim + d));
#pragma GCC unroll 4
      for (int p = 0; p < kPairs; ++p) acc[r][p] = _mm512_fmadd_ps(x, key[p], acc[r][p]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) {
    __m256 half[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) half[i] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int p = 0; p < kPairs; ++p) {
      half[2 * p] = _mm512_castps512_ps256(acc[r][p]);
      half[2 * p + 1] = _mm512_extractf32x8_ps(acc[r][p], 1);
    }
    _mm_storeu_ps(out + r * out_stride, avx2::HorizontalSum4(half[0], half[1], half[2], half[3]));
    if constexpr (kKeys > 4) {
      _mm_storeu_ps(out + r * out_stride + 4,
                    avx2::HorizontalSum4(half[4], half[5], half[6], half[7]));
    }
  }
}

constexpr int kKeyBlock512 = 8;

// FusedDotStrip with FusedDotKernel512: the logits of kRows query rows against a tile's n keys.
template <DType kType, int kRows>
KVS_AVX512 inline void FusedDotStrip512(const float* q, const uint8_t* const* rows, int n,
                                        const uint8_t* const* prefetch, int n_prefetch, int dim,
                                        float* out) {
  int j = 0;
  int prefetched = 0;
  for (; j + kKeyBlock512 <= n; j += kKeyBlock512) {
    const uint8_t* const* p = nullptr;
    if (prefetch != nullptr && j + kKeyBlock512 <= n_prefetch) {
      p = prefetch + j;
      prefetched = j + kKeyBlock512;
    }
    FusedDotKernel512<kType, kRows, kKeyBlock512>(q, rows + j, p, dim, out + j, kLogitStride);
  }
  const uint8_t* const* r = rows + j;
  float* o = out + j;
  switch (n - j) {
    case 7:
      FusedDotKernel512<kType, kRows, 7>(q, r, nullptr, dim, o, kLogitStride);
      break;
    case 6:
      FusedDotKernel512<kType, kRows, 6>(q, r, nullptr, dim, o, kLogitStride);
      break;
    case 5:
      FusedDotKernel512<kType, kRows, 5>(q, r, nullptr, dim, o, kLogitStride);
      break;
    case 4:
      FusedDotKernel512<kType, kRows, 4>(q, r, nullptr, dim, o, kLogitStride);
      break;
    case 3:
      FusedDotKernel512<kType, kRows, 3>(q, r, nullptr, dim, o, kLogitStride);
      break;
    case 2:
      FusedDotKernel512<kType, kRows, 2>(q, r, nullptr, dim, o, kLogitStride);
      break;
    case 1:
      FusedDotKernel512<kType, kRows, 1>(q, r, nullptr, dim, o, kLogitStride);
      break;
    default:
      break;
  }
  if (prefetch != nullptr) {
    PrefetchRowLines(prefetch, prefetched, n_prefetch, dim * DTypeBytes(kType));
  }
}

struct Avx512DecodeKernels {
  template <DType kType, int kRows>
  KVS_AVX512 static void Strip(const float* q, const uint8_t* const* rows, int n,
                               const uint8_t* const* prefetch, int n_prefetch, int dim,
                               float* out) {
    FusedDotStrip512<kType, kRows>(q, rows, n, prefetch, n_prefetch, dim, out);
  }
  KVS_AVX512 static void Softmax(const float* logits, const int32_t* key_positions,
                                 int32_t query_position, float scale, int n, float* out,
                                 float* running_max, float* tile_max, float* tile_sum) {
    if (n == kTile) {
      SoftmaxTileRow512<true>(logits, key_positions, query_position, scale, n, out, running_max,
                              tile_max, tile_sum);
    } else {
      SoftmaxTileRow512<false>(logits, key_positions, query_position, scale, n, out, running_max,
                               tile_max, tile_sum);
    }
  }
};

// DecodeTiles (the same order, prefetches and records) with FusedDotStrip512 and the 16-lane
// softmax. (Reading each block's heads as one contiguous run, prefetching further ahead or to L2
// only, or spreading the prefetches over the loop over d were no faster in attention_bench on a
// 2-core EPYC.)
template <DType kType>
KVS_AVX512 void Avx512DecodeTask(const JobPlan& plan, const Records& records,
                                 int64_t head_begin, int64_t head_end, int64_t tile_begin,
                                 int64_t tile_end) {
  thread_local std::vector<float> running_max;
  running_max.assign((head_end - head_begin) * plan.group_rows, kNegInf);
  DecodeLoop<kType, Avx512DecodeKernels>(plan, records, head_begin, head_end, tile_begin, tile_end,
                                         running_max.data());
}

#pragma GCC diagnostic pop

// ---------------------------------------------------------------------------------------------

// Multiplies n floats by factor; AVX2 when allowed (the pass is bound by cache bandwidth, so
// wide loads and stores matter more than the arithmetic).
KVS_AVX2 void ScaleAvx2(float* p, int64_t n, float factor) {
  const __m256 f = _mm256_set1_ps(factor);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(p + j, _mm256_mul_ps(_mm256_loadu_ps(p + j), f));
  for (; j < n; ++j) p[j] *= factor;
}

void ScaleScalar(float* p, int64_t n, float factor) {
  for (int64_t j = 0; j < n; ++j) p[j] *= factor;
}

// Calls apply(begin_slot, end_slot, factor) for the runs of a row's tiles that share one factor
// exp(tile max - row max) / sum (the softmax normaliser folded from the per-tile (max, sum)
// records). Runs of tiles with the same max (the common case once the row max has been seen
// early) share one factor, so the sweeps cover long contiguous stretches. Fully masked tiles
// (sum 0) are skipped, and so is a row whose every slot is masked.
template <typename Apply>
void ForEachNormalizedRun(const JobPlan& plan, const Records& records, int64_t row,
                          Apply&& apply) {
  const int64_t count = plan.job->keys.count;
  const float* maxes = records.max + records.At(row, 0);
  const float* sums = records.sum + records.At(row, 0);
  float max = kNegInf;
  bool nan = false;  // a tile saw a NaN logit (SoftmaxTileRow): the whole row is NaN
  for (int64_t t = 0; t < plan.tiles; ++t) {
    max = std::max(max, maxes[t]);
    nan |= std::isnan(maxes[t]) || std::isnan(sums[t]);
  }
  if (nan) {
    apply(0, count, std::numeric_limits<float>::quiet_NaN());
    return;
  }
  if (max == kNegInf) return;
  float sum = 0.0f;
  for (int64_t t = 0; t < plan.tiles; ++t) {
    if (sums[t] > 0.0f) sum += sums[t] * std::exp(maxes[t] - max);
  }
  const float inv = 1.0f / sum;
  int64_t t = 0;
  while (t < plan.tiles) {
    if (sums[t] == 0.0f) {  // all zeros (masked)
      ++t;
      continue;
    }
    int64_t end = t + 1;
    while (end < plan.tiles && maxes[end] == maxes[t] && sums[end] != 0.0f) ++end;
    apply(t * kTile, std::min<int64_t>(count, end * kTile), std::exp(maxes[t] - max) * inv);
    t = end;
  }
}

// Rescales each tile's exp(l - tile max) to exp(l - row max) / sum, in place. A fully masked
// row keeps the zeros the tiles wrote.
void NormalizeRow(const JobPlan& plan, const Records& records, int64_t row, bool avx2) {
  float* out = plan.job->probs + row * plan.job->keys.count;
  ForEachNormalizedRun(plan, records, row, [&](int64_t begin, int64_t end, float factor) {
    if (avx2) {
      ScaleAvx2(out + begin, end - begin, factor);
    } else {
      ScaleScalar(out + begin, end - begin, factor);
    }
  });
}

bool ValidDType(DType dtype) {
  return dtype == DType::kFloat16 || dtype == DType::kBFloat16 || dtype == DType::kFloat32;
}

}  // namespace

absl::Status ValidateAttentionJob(const AttentionJob& job, size_t index) {
  const PagedLayerView& v = job.keys;
  const std::string context = absl::StrCat("attention job ", index);
  auto invalid = [&context](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(context, ": ", parts...));
  };
  if (auto status = ValidatePagedLayerView(v, context, "keys"); !status.ok()) return status;
  if (job.num_q_heads < 1 || job.num_q_heads % v.num_kv_heads != 0) {
    return invalid("num_q_heads must be a positive multiple of keys.num_kv_heads (", v.num_kv_heads,
                   "), got ", job.num_q_heads);
  }
  if (job.num_queries < 1) return invalid("num_queries must be >= 1, got ", job.num_queries);
  if (!std::isfinite(job.scale) || !(job.scale > 0.0f)) {
    return invalid("scale must be finite and > 0, got ", job.scale);
  }
  const auto prob_elements = CheckedProduct({job.num_q_heads, job.num_queries, v.count});
  const auto query_elements = CheckedProduct({job.num_q_heads, job.num_queries, v.head_dim});
  constexpr uint64_t kMaxElements = uint64_t{1} << 60;
  if (!prob_elements || *prob_elements > kMaxElements || !query_elements ||
      *query_elements > kMaxElements) {
    return invalid("num_q_heads x num_queries x keys.count/head_dim overflows");
  }
  if (v.count == 0) return absl::OkStatus();  // nothing is read or written
  if (job.key_positions == nullptr) return invalid("key_positions is null");
  if (job.key_stride != 0 && job.key_stride < v.count) {
    return invalid("key_stride ", job.key_stride, " is below keys.count ", v.count);
  }
  if (job.queries == nullptr) return invalid("queries is null");
  if (job.query_positions == nullptr) return invalid("query_positions is null");
  if (job.probs == nullptr) return invalid("probs is null");
  return absl::OkStatus();
}

namespace {

Records SplitRecords(const JobPlan& plan) {
  // Tasks write distinct (row, tile) entries of the plan's arrays.
  return Records{const_cast<float*>(plan.tile_max.data()), const_cast<float*>(plan.tile_sum.data()),
                 0, plan.tiles};
}

// isa: the level to run at (already limited to the CPU's and to head_dim % 8 == 0).
void RunTask(const JobPlan& plan, const Records& records, int64_t head_begin, int64_t head_end,
             int64_t tile_begin, int64_t tile_end, CpuIsa isa) {
  if (isa == CpuIsa::kAvx512 && plan.group_rows >= 8) {
    switch (plan.job->keys.dtype) {
      case DType::kFloat16:
        return Avx512Task<DType::kFloat16>(plan, records, head_begin, tile_begin, tile_end);
      case DType::kBFloat16:
        return Avx512Task<DType::kBFloat16>(plan, records, head_begin, tile_begin, tile_end);
      case DType::kFloat32:
        return Avx512Task<DType::kFloat32>(plan, records, head_begin, tile_begin, tile_end);
    }
  }
  if (isa == CpuIsa::kAvx512) {
    switch (plan.job->keys.dtype) {
      case DType::kFloat16:
        return Avx512DecodeTask<DType::kFloat16>(plan, records, head_begin, head_end, tile_begin,
                                                 tile_end);
      case DType::kBFloat16:
        return Avx512DecodeTask<DType::kBFloat16>(plan, records, head_begin, head_end, tile_begin,
                                                  tile_end);
      case DType::kFloat32:
        return Avx512DecodeTask<DType::kFloat32>(plan, records, head_begin, head_end, tile_begin,
                                                 tile_end);
    }
  }
  if (isa >= CpuIsa::kAvx2) {
    switch (plan.job->keys.dtype) {
      case DType::kFloat16:
        return Avx2Task<DType::kFloat16>(plan, records, head_begin, head_end, tile_begin, tile_end);
      case DType::kBFloat16:
        return Avx2Task<DType::kBFloat16>(plan, records, head_begin, head_end, tile_begin,
                                          tile_end);
      case DType::kFloat32:
        return Avx2Task<DType::kFloat32>(plan, records, head_begin, head_end, tile_begin, tile_end);
    }
  }
  for (int64_t head = head_begin; head < head_end; ++head) {
    ScalarTask(plan, records, head, tile_begin, tile_end);
  }
}

}  // namespace

absl::Status ValidatePagedLayerView(const PagedLayerView& v, std::string_view context,
                                    std::string_view field) {
  const std::string prefix = std::string(context) + ": " + std::string(field) + ".";
  auto invalid = [&prefix](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, parts...));
  };
  if (v.count < 0) return invalid("count must be >= 0, got ", v.count);
  if (v.num_kv_heads < 1) return invalid("num_kv_heads must be >= 1, got ", v.num_kv_heads);
  if (v.head_dim < 1) return invalid("head_dim must be >= 1, got ", v.head_dim);
  if (v.block_tokens < 1) return invalid("block_tokens must be >= 1, got ", v.block_tokens);
  if (!ValidDType(v.dtype)) {
    return invalid("dtype ", static_cast<int>(v.dtype), " is not supported");
  }
  if (v.kv_index != 0 && v.kv_index != 1) {
    return invalid("kv_index must be 0 or 1, got ", v.kv_index);
  }
  // kv index k of every head occupies the first (k + 1) * num_kv_heads * block_tokens rows.
  const auto used_bytes = CheckedProduct(
      {v.kv_index + int64_t{1}, v.num_kv_heads, v.block_tokens, v.head_dim, DTypeBytes(v.dtype)});
  if (!used_bytes || *used_bytes > v.block_bytes) {
    return invalid("block_bytes ", v.block_bytes, " cannot hold kv index ", v.kv_index, " of ",
                   v.num_kv_heads, " heads x ", v.block_tokens, " tokens x ", v.head_dim, " dims");
  }
  if (v.count == 0) return absl::OkStatus();  // nothing is read
  if (v.arena == nullptr) return invalid("arena is null");
  if (v.block_table == nullptr) return invalid("block_table is null");
  const int64_t blocks = (static_cast<int64_t>(v.count) + v.block_tokens - 1) / v.block_tokens;
  for (int64_t b = 0; b < blocks; ++b) {
    const int32_t block = v.block_table[b];
    if (block < 0 || !CheckedProduct({block + int64_t{1}, static_cast<int64_t>(v.block_bytes)})) {
      return invalid("block_table[", b, "] = ", block, " is not a valid block");
    }
  }
  return absl::OkStatus();
}

absl::Status RunAttentionProbsWithIsa(absl::Span<const AttentionJob> jobs, ThreadPool& pool,
                                      CpuIsa max_isa) {
  // Validate everything first so that a failed call writes nothing.
  // A task covers one kv head of a job in the window kernel, every kv head of it in the decode
  // kernel (fewer than 8 rows per head; see DecodeTiles), and a chunk of its tiles when the
  // (job, heads) units are too few.
  auto heads_per_task = [](const AttentionJob& job) -> int64_t {
    const int64_t group_rows =
        static_cast<int64_t>(job.num_q_heads / job.keys.num_kv_heads) * job.num_queries;
    return group_rows < 8 ? job.keys.num_kv_heads : 1;
  };
  uint64_t macs = 0;
  int64_t units = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (auto status = ValidateAttentionJob(jobs[i], i); !status.ok()) return status;
    const AttentionJob& job = jobs[i];
    if (job.keys.count == 0) continue;
    macs += static_cast<uint64_t>(job.num_q_heads) * job.num_queries * job.keys.count *
            job.keys.head_dim;
    units += job.keys.num_kv_heads / heads_per_task(job);
  }
  if (units == 0) return absl::OkStatus();
  const bool parallel = macs >= kParallelMinMacs && pool.num_threads() > 1;
  // Aim at >= 4 tasks per thread so that the dynamic schedule balances uneven jobs; a unit is
  // split into chunks of tiles only when the units alone are too few.
  const int64_t want_tasks = parallel ? 4 * pool.num_threads() : 1;
  const int64_t split = std::max<int64_t>(1, (want_tasks + units - 1) / units);

  std::vector<JobPlan> plans;
  plans.reserve(jobs.size());
  int64_t tasks = 0;
  for (const AttentionJob& job : jobs) {
    if (job.keys.count == 0) continue;
    JobPlan plan;
    plan.job = &job;
    plan.group = job.num_q_heads / job.keys.num_kv_heads;
    plan.group_rows = plan.group * job.num_queries;
    plan.tiles = (static_cast<int64_t>(job.keys.count) + kTile - 1) / kTile;
    const int64_t max_chunks = std::max<int64_t>(1, plan.tiles / kMinChunkTiles);
    plan.heads_per_task = heads_per_task(job);
    plan.chunks = std::min(split, max_chunks);
    plan.chunk_tiles = (plan.tiles + plan.chunks - 1) / plan.chunks;
    plan.chunks = (plan.tiles + plan.chunk_tiles - 1) / plan.chunk_tiles;
    plan.first_task = tasks;
    plan.row_bytes = static_cast<uint64_t>(job.keys.head_dim) * DTypeBytes(job.keys.dtype);
    const int64_t job_rows = static_cast<int64_t>(job.num_q_heads) * job.num_queries;
    if (plan.chunks > 1) {
      plan.tile_max.resize(job_rows * plan.tiles);
      plan.tile_sum.resize(job_rows * plan.tiles);
    }
    tasks += plan.chunks * (job.keys.num_kv_heads / plan.heads_per_task);
    plans.push_back(std::move(plan));
  }
  const CpuIsa isa = UsableCpuIsa(max_isa);
  const bool avx2 = isa >= CpuIsa::kAvx2;
  auto plan_of = [&plans](int64_t task) {
    return std::upper_bound(plans.begin(), plans.end(), task,
                            [](int64_t t, const JobPlan& p) { return t < p.first_task; }) -
           1;
  };
  pool.ParallelFor(
      tasks,
      [&](int64_t task) {
        const JobPlan& plan = *plan_of(task);
        const int64_t local = task - plan.first_task;
        const int64_t head_begin = local / plan.chunks * plan.heads_per_task;
        const int64_t head_end = head_begin + plan.heads_per_task;
        const int64_t chunk = local % plan.chunks;
        const int64_t begin = chunk * plan.chunk_tiles;
        const int64_t end = std::min(plan.tiles, begin + plan.chunk_tiles);
        const CpuIsa use_isa = plan.job->keys.head_dim % 8 == 0 ? isa : CpuIsa::kScalar;
        const bool use_avx2 = use_isa >= CpuIsa::kAvx2;
        if (plan.chunks > 1) {
          RunTask(plan, SplitRecords(plan), head_begin, head_end, begin, end, use_isa);
          return;
        }
        // The task sees every slot of its rows: its records live in a reused per-thread buffer
        // (no page faults on fresh allocations), and the rows are normalised right away, while
        // they are still in the last-level cache, instead of in a second sweep.
        const int64_t task_rows = plan.heads_per_task * plan.group_rows;
        thread_local std::vector<float> buffer;
        buffer.resize(2 * task_rows * plan.tiles);
        const Records records{buffer.data(), buffer.data() + task_rows * plan.tiles,
                              head_begin * plan.group_rows, plan.tiles};
        RunTask(plan, records, head_begin, head_end, begin, end, use_isa);
        for (int64_t m = 0; m < task_rows; ++m) {
          NormalizeRow(plan, records, head_begin * plan.group_rows + m, use_avx2);
        }
      },
      parallel ? 0 : 1);
  // Phase 2 for the rows of split (job, head)s, in groups of rows (~count multiplies per row).
  std::vector<std::pair<const JobPlan*, int64_t>> split_rows;
  for (const JobPlan& plan : plans) {
    if (plan.chunks == 1) continue;
    const int64_t job_rows = static_cast<int64_t>(plan.job->num_q_heads) * plan.job->num_queries;
    for (int64_t row = 0; row < job_rows; ++row) split_rows.emplace_back(&plan, row);
  }
  constexpr int64_t kRowsPerTask = 64;
  const int64_t split_count = static_cast<int64_t>(split_rows.size());
  pool.ParallelFor((split_count + kRowsPerTask - 1) / kRowsPerTask,
                   [&](int64_t task) {
                     const int64_t row_end = std::min(split_count, (task + 1) * kRowsPerTask);
                     for (int64_t i = task * kRowsPerTask; i < row_end; ++i) {
                       NormalizeRow(*split_rows[i].first, SplitRecords(*split_rows[i].first),
                                    split_rows[i].second, avx2);
                     }
                   },
                   parallel ? 0 : 1);
  return absl::OkStatus();
}

namespace {

// out[s] += e[s] * factor over n floats: the product NormalizeRow writes, then one add, so a sum
// of these equals a sum of AttentionProbs' rows. AVX2 without FMA: nothing may be contracted.
__attribute__((target("avx2"))) void AddScaledAvx2(float* out, const float* e, int64_t n,
                                                   float factor) {
  const __m256 f = _mm256_set1_ps(factor);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 p = _mm256_mul_ps(_mm256_loadu_ps(e + j), f);
    _mm256_storeu_ps(out + j, _mm256_add_ps(_mm256_loadu_ps(out + j), p));
  }
  for (; j < n; ++j) {
    const float p = e[j] * factor;
    out[j] += p;
  }
}

void AddScaledScalar(float* out, const float* e, int64_t n, float factor) {
  for (int64_t j = 0; j < n; ++j) {
    const float p = e[j] * factor;
    out[j] += p;
  }
}

// NormalizeRow's folding of a row's per-tile (max, sum) records, added into `out` (count floats)
// instead of written over the row: the probabilities of the row never leave the cache.
void AddNormalizedRow(const JobPlan& plan, const Records& records, int64_t row, float* out,
                      bool avx2) {
  const float* e = plan.job->probs + row * plan.job->keys.count;
  ForEachNormalizedRun(plan, records, row, [&](int64_t begin, int64_t end, float factor) {
    if (avx2) {
      AddScaledAvx2(out + begin, e + begin, end - begin, factor);
    } else {
      AddScaledScalar(out + begin, e + begin, end - begin, factor);
    }
  });
}

// One task of RunAttentionColumnSums: kv heads [head_begin, head_end) of `job`. The window
// kernel computes the heads' unnormalised exponentials into a per-thread buffer ([G*w][count]
// per head: 4 MiB for 32 queries x 4 heads x 8K slots, which stays in the last-level cache),
// and the normalisation adds each row straight into the sums.
void ColumnSumsTask(const AttentionSumsJob& sums_job, int64_t head_begin, int64_t head_end,
                    CpuIsa isa) {
  const bool avx2 = isa >= CpuIsa::kAvx2;
  const AttentionJob& job = sums_job.attention;
  const int64_t count = job.keys.count;
  const int64_t group = job.num_q_heads / job.keys.num_kv_heads;
  const int64_t w = job.num_queries;
  const int64_t heads = head_end - head_begin;
  const uint64_t row_bytes = static_cast<uint64_t>(job.keys.head_dim) * DTypeBytes(job.keys.dtype);
  AttentionJob sub = job;
  if (heads != job.keys.num_kv_heads) {
    // One kv head as a one-head view: its rows of every block start at the head's offset.
    sub.keys.arena +=
        (static_cast<uint64_t>(job.keys.kv_index) * job.keys.num_kv_heads + head_begin) *
        job.keys.block_tokens * row_bytes;
    sub.keys.kv_index = 0;
    sub.keys.num_kv_heads = static_cast<int32_t>(heads);
    sub.num_q_heads = static_cast<int32_t>(heads * group);
    sub.queries += head_begin * group * w * job.keys.head_dim;
    sub.key_positions += KeyPositionsOffset(job, head_begin);
  }
  thread_local std::vector<float> exps;
  thread_local std::vector<float> buffer;
  const int64_t task_rows = heads * group * w;
  exps.resize(static_cast<size_t>(task_rows * count));
  sub.probs = exps.data();
  JobPlan plan;
  plan.job = &sub;
  plan.group = group;
  plan.group_rows = group * w;
  plan.tiles = (count + kTile - 1) / kTile;
  plan.chunk_tiles = plan.tiles;
  plan.chunks = 1;
  plan.heads_per_task = heads;
  plan.first_task = 0;
  plan.row_bytes = row_bytes;
  buffer.resize(static_cast<size_t>(2 * task_rows * plan.tiles));
  const Records records{buffer.data(), buffer.data() + task_rows * plan.tiles, 0, plan.tiles};
  RunTask(plan, records, 0, heads, 0, plan.tiles, isa);
  for (int64_t q = 0; q < heads * group; ++q) {
    float* out = sums_job.sums + (head_begin * group + q) * count;
    std::fill(out, out + count, 0.0f);
    for (int64_t i = 0; i < w; ++i) AddNormalizedRow(plan, records, q * w + i, out, avx2);
  }
}

}  // namespace

absl::Status ValidateAttentionSumsJob(const AttentionSumsJob& job, size_t index) {
  if (job.attention.keys.count > 0 && job.sums == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("attention job ", index, ": sums is null"));
  }
  AttentionJob check = job.attention;
  check.probs = job.sums;  // the output the checks of AttentionProbs apply to
  return ValidateAttentionJob(check, index);
}

absl::Status RunAttentionColumnSums(absl::Span<const AttentionSumsJob> jobs, ThreadPool& pool,
                                    CpuIsa max_isa) {
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (auto status = ValidateAttentionSumsJob(jobs[i], i); !status.ok()) return status;
  }
  // One query row: its probabilities are its sums.
  std::vector<AttentionJob> single;
  // (job, first kv head, last kv head + 1): one kv head per task in the window kernel (8+ rows
  // per head), every head of the job in the decode kernel.
  struct Unit {
    const AttentionSumsJob* job;
    int64_t head_begin;
    int64_t head_end;
  };
  std::vector<Unit> units;
  uint64_t macs = 0;
  for (const AttentionSumsJob& job : jobs) {
    const AttentionJob& a = job.attention;
    if (a.keys.count == 0) continue;
    if (a.num_queries == 1) {
      single.push_back(a);
      single.back().probs = job.sums;
      continue;
    }
    macs += static_cast<uint64_t>(a.num_q_heads) * a.num_queries * a.keys.count * a.keys.head_dim;
    const int64_t group_rows = int64_t{a.num_q_heads / a.keys.num_kv_heads} * a.num_queries;
    if (group_rows < 8) {
      units.push_back({&job, 0, a.keys.num_kv_heads});
    } else {
      for (int64_t h = 0; h < a.keys.num_kv_heads; ++h) units.push_back({&job, h, h + 1});
    }
  }
  if (!single.empty()) {
    if (auto status = RunAttentionProbsWithIsa(single, pool, max_isa); !status.ok()) {
      return status;
    }
  }
  const CpuIsa isa = UsableCpuIsa(max_isa);
  const bool parallel = macs >= kParallelMinMacs && pool.num_threads() > 1;
  pool.ParallelFor(
      static_cast<int64_t>(units.size()),
      [&](int64_t u) {
        const Unit& unit = units[u];
        ColumnSumsTask(*unit.job, unit.head_begin, unit.head_end,
                       unit.job->attention.keys.head_dim % 8 == 0 ? isa : CpuIsa::kScalar);
      },
      parallel ? 0 : 1);
  return absl::OkStatus();
}

absl::Status Backend::AttentionColumnSums(absl::Span<const AttentionSumsJob> jobs, Stream stream) {
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (auto status = ValidateAttentionSumsJob(jobs[i], i); !status.ok()) return status;
  }
  for (const AttentionSumsJob& job : jobs) {
    const AttentionJob& a = job.attention;
    if (a.keys.count == 0) continue;
    const int64_t count = a.keys.count;
    std::vector<float> probs(static_cast<size_t>(int64_t{a.num_q_heads} * a.num_queries * count));
    AttentionJob full = a;
    full.probs = probs.data();
    if (auto status = AttentionProbs({&full, 1}, stream); !status.ok()) return status;
    if (auto status = Synchronize(stream); !status.ok()) return status;
    for (int64_t q = 0; q < a.num_q_heads; ++q) {
      float* out = job.sums + q * count;
      std::fill(out, out + count, 0.0f);
      for (int64_t i = 0; i < a.num_queries; ++i) {
        const float* row = probs.data() + (q * a.num_queries + i) * count;
        for (int64_t s = 0; s < count; ++s) out[s] += row[s];
      }
    }
  }
  return absl::OkStatus();
}

absl::Status RunAttentionProbs(absl::Span<const AttentionJob> jobs, ThreadPool& pool) {
  return RunAttentionProbsWithIsa(jobs, pool, CpuIsa::kAvx512);
}

namespace {

constexpr int64_t kLogitChunkSlots = 512;

void LogitsChunkScalar(const AttentionJob& job, int64_t head, int64_t begin, int64_t end) {
  const PagedLayerView& keys = job.keys;
  const int64_t dim = keys.head_dim;
  const int64_t group = job.num_q_heads / keys.num_kv_heads;
  const int64_t count = keys.count;
  const int32_t* key_positions = job.key_positions + KeyPositionsOffset(job, head);
  std::vector<float> row(dim);
  for (int64_t s = begin; s < end; ++s) {
    const uint8_t* key = PagedRow(keys, head, s);
    for (int64_t d = 0; d < dim; ++d) row[d] = LoadAsFloat(key, keys.dtype, d);
    for (int64_t g = 0; g < group; ++g) {
      const int64_t q = head * group + g;
      for (int64_t i = 0; i < job.num_queries; ++i) {
        float* out = job.probs + (q * job.num_queries + i) * count;
        if (key_positions[s] > job.query_positions[i]) {
          out[s] = kNegInf;
          continue;
        }
        const float* query = job.queries + (q * job.num_queries + i) * dim;
        float dot = 0.0f;
        for (int64_t d = 0; d < dim; ++d) dot += query[d] * row[d];
        out[s] = job.scale * dot;
      }
    }
  }
}

template <DType kType>
KVS_AVX2 void LogitsChunkAvx2(const AttentionJob& job, int64_t head, int64_t begin, int64_t end) {
  const PagedLayerView& keys = job.keys;
  const int64_t dim = keys.head_dim;
  const int64_t group = job.num_q_heads / keys.num_kv_heads;
  const int64_t rows = group * job.num_queries;  // contiguous query rows of this kv head
  const int64_t count = keys.count;
  const int32_t* key_positions = job.key_positions + KeyPositionsOffset(job, head);
  const float* queries = job.queries + head * rows * dim;
  float* out = job.probs + head * rows * count;
  const int64_t element_bytes = DTypeBytes(kType);
  for (int64_t s = begin; s < end; ++s) {
    const uint8_t* key = PagedRow(keys, head, s);
    int64_t r = 0;
    // Four query rows per pass over the key row: the row is converted once per pass and stays in
    // registers' reach (L1) for the next pass.
    for (; r + 4 <= rows; r += 4) {
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
             a3 = _mm256_setzero_ps();
      const float* q0 = queries + r * dim;
      for (int64_t d = 0; d < dim; d += 8) {
        const __m256 k = avx2::Load8<kType>(key + d * element_bytes);
        a0 = _mm256_fmadd_ps(k, _mm256_loadu_ps(q0 + d), a0);
        a1 = _mm256_fmadd_ps(k, _mm256_loadu_ps(q0 + dim + d), a1);
        a2 = _mm256_fmadd_ps(k, _mm256_loadu_ps(q0 + 2 * dim + d), a2);
        a3 = _mm256_fmadd_ps(k, _mm256_loadu_ps(q0 + 3 * dim + d), a3);
      }
      alignas(16) float sums[4];
      _mm_store_ps(sums, avx2::HorizontalSum4(a0, a1, a2, a3));
      for (int64_t j = 0; j < 4; ++j) out[(r + j) * count + s] = job.scale * sums[j];
    }
    for (; r < rows; ++r) {
      __m256 a = _mm256_setzero_ps();
      const float* q = queries + r * dim;
      for (int64_t d = 0; d < dim; d += 8) {
        a = _mm256_fmadd_ps(avx2::Load8<kType>(key + d * element_bytes), _mm256_loadu_ps(q + d), a);
      }
      out[r * count + s] = job.scale * avx2::HorizontalSum(a);
    }
    for (int64_t r2 = 0; r2 < rows; ++r2) {
      if (key_positions[s] > job.query_positions[r2 % job.num_queries]) {
        out[r2 * count + s] = kNegInf;
      }
    }
  }
}

}  // namespace

absl::Status RunAttentionLogits(absl::Span<const AttentionJob> jobs, ThreadPool& pool,
                                CpuIsa max_isa) {
  std::vector<int64_t> first_task(jobs.size() + 1, 0);
  uint64_t macs = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (auto status = ValidateAttentionJob(jobs[i], i); !status.ok()) return status;
    const AttentionJob& job = jobs[i];
    const int64_t chunks = (job.keys.count + kLogitChunkSlots - 1) / kLogitChunkSlots;
    first_task[i + 1] = first_task[i] + chunks * job.keys.num_kv_heads;
    macs += static_cast<uint64_t>(job.num_q_heads) * job.num_queries * job.keys.count *
            job.keys.head_dim;
  }
  const bool avx2 = UsableCpuIsa(max_isa) >= CpuIsa::kAvx2;  // no AVX-512 variant: memory-bound
  pool.ParallelFor(
      first_task.back(),
      [&](int64_t task) {
        const size_t index =
            std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1;
        const AttentionJob& job = jobs[index];
        const int64_t chunks = (job.keys.count + kLogitChunkSlots - 1) / kLogitChunkSlots;
        const int64_t local = task - first_task[index];
        const int64_t head = local / chunks;
        const int64_t begin = (local % chunks) * kLogitChunkSlots;
        const int64_t end = std::min<int64_t>(job.keys.count, begin + kLogitChunkSlots);
        if (avx2 && job.keys.head_dim % 8 == 0) {
          switch (job.keys.dtype) {
            case DType::kFloat16:
              return LogitsChunkAvx2<DType::kFloat16>(job, head, begin, end);
            case DType::kBFloat16:
              return LogitsChunkAvx2<DType::kBFloat16>(job, head, begin, end);
            case DType::kFloat32:
              return LogitsChunkAvx2<DType::kFloat32>(job, head, begin, end);
          }
        }
        LogitsChunkScalar(job, head, begin, end);
      },
      macs >= kParallelMinMacs ? 0 : 1);
  return absl::OkStatus();
}

}  // namespace kvs
