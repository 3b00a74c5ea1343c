#include "gpu/cpu/keydiff_cpu.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gpu/base/checked_math.h"
#include "gpu/base/dtype.h"
#include "gpu/cpu/avx2_util.h"

namespace kvs {
namespace {

// Floors from the spec (§3.1 step 4): PyTorch's F.normalize and F.cosine_similarity defaults.
constexpr float kNormalizeEps = 1e-12f;
constexpr float kCosineEps = 1e-8f;

// The keys of one kv head of a paged layer: in each block of the table, rows_in_block(b)
// consecutive rows of row_bytes() starting at block_rows(b).
struct HeadView {
  const PagedLayerView& view;
  int head;
  uint64_t row_bytes() const {
    return static_cast<uint64_t>(view.head_dim) * DTypeBytes(view.dtype);
  }
  int64_t num_blocks() const {
    return (static_cast<int64_t>(view.count) + view.block_tokens - 1) / view.block_tokens;
  }
  // First key row of this head in block `b` of the table; rows of one block are contiguous.
  const uint8_t* block_rows(int64_t b) const {
    return view.arena + static_cast<uint64_t>(view.block_table[b]) * view.block_bytes +
           static_cast<uint64_t>(head) * view.block_tokens * row_bytes();
  }
  int64_t rows_in_block(int64_t b) const {
    return std::min<int64_t>(view.block_tokens, view.count - b * view.block_tokens);
  }
  // Calls fn(slot, row pointer) for every slot in [0, count), in slot order.
  template <typename Fn>
  void ForEachRow(Fn&& fn) const {
    const uint64_t stride = row_bytes();
    for (int64_t b = 0; b < num_blocks(); ++b) {
      const uint8_t* row = block_rows(b);
      const int64_t rows = rows_in_block(b);
      for (int64_t r = 0; r < rows; ++r, row += stride) fn(b * view.block_tokens + r, row);
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Scalar reference.

void LoadRow(const uint8_t* row, DType dtype, int dim, float* out) {
  for (int d = 0; d < dim; ++d) out[d] = LoadAsFloat(row, dtype, d);
}

float Dot(const float* a, const float* b, int dim) {
  float sum = 0.0f;
  for (int d = 0; d < dim; ++d) sum += a[d] * b[d];
  return sum;
}

float Norm(const float* a, int dim) { return std::sqrt(Dot(a, a, dim)); }

// KNorm's scalar norm of one row, through `scratch` ([dim]).
float ScalarRowNorm(const uint8_t* row, DType dtype, int dim, float* scratch) {
  LoadRow(row, dtype, dim, scratch);
  return Norm(scratch, dim);
}

// Orders NaN after every number so nth_element sees a strict weak ordering on any input.
bool LessNanLast(float a, float b) { return !std::isnan(a) && (std::isnan(b) || a < b); }

// Coordinate-wise median of the normalised keys. For an even count the median is the mean of the
// two middle values (numpy's convention, which the spec's reference uses: TV3 gets (s, 0)).
// Coordinates are processed in groups so scratch stays O(count * group), not O(count * dim).
void MedianNormalizedAnchor(const HeadView& keys, float* anchor) {
  const int dim = keys.view.head_dim;
  const int64_t n = keys.view.count;
  std::vector<float> row(dim);
  std::vector<float> norm(n);
  keys.ForEachRow([&](int64_t s, const uint8_t* p) {
    LoadRow(p, keys.view.dtype, dim, row.data());
    norm[s] = std::max(Norm(row.data(), dim), kNormalizeEps);
  });
  constexpr int kGroup = 16;
  std::vector<float> values(static_cast<size_t>(n) * kGroup);
  for (int d0 = 0; d0 < dim; d0 += kGroup) {
    const int group = std::min(kGroup, dim - d0);
    keys.ForEachRow([&](int64_t s, const uint8_t* p) {
      for (int g = 0; g < group; ++g) {
        values[g * n + s] = LoadAsFloat(p, keys.view.dtype, d0 + g) / norm[s];
      }
    });
    for (int g = 0; g < group; ++g) {
      float* first = values.data() + g * n;
      float* middle = first + n / 2;
      std::nth_element(first, middle, first + n, LessNanLast);
      float median = *middle;
      if (n % 2 == 0) {
        const float lower = *std::max_element(first, middle, LessNanLast);
        median = 0.5f * (lower + median);
      }
      anchor[d0 + g] = median;
    }
  }
}

// Mean of the keys, each first divided by max(|k|, eps) when `normalize_eps` > 0.
void MeanAnchor(const HeadView& keys, float normalize_eps, float* anchor) {
  const int dim = keys.view.head_dim;
  std::vector<float> row(dim);
  std::fill(anchor, anchor + dim, 0.0f);
  keys.ForEachRow([&](int64_t, const uint8_t* p) {
    LoadRow(p, keys.view.dtype, dim, row.data());
    const float scale = normalize_eps > 0 ? std::max(Norm(row.data(), dim), normalize_eps) : 1.0f;
    for (int d = 0; d < dim; ++d) anchor[d] += row[d] / scale;
  });
  const float n = static_cast<float>(keys.view.count);
  for (int d = 0; d < dim; ++d) anchor[d] /= n;
}

void ScoreHeadScalar(const KeyDiffScoreJob& job, int head) {
  const HeadView keys{job.keys, head};
  const int dim = job.keys.head_dim;
  float* out = job.scores + static_cast<int64_t>(head) * job.keys.count;
  std::vector<float> anchor(dim);
  std::vector<float> row(dim);
  switch (job.metric) {
    case KeyDiffMetric::kCosine: {
      switch (job.anchor) {
        case KeyDiffAnchor::kMeanNormalized:
          MeanAnchor(keys, kNormalizeEps, anchor.data());
          break;
        case KeyDiffAnchor::kMeanRaw:
          MeanAnchor(keys, 0.0f, anchor.data());
          break;
        case KeyDiffAnchor::kMedianNormalized:
          MedianNormalizedAnchor(keys, anchor.data());
          break;
      }
      const float anchor_norm = std::max(Norm(anchor.data(), dim), kCosineEps);
      keys.ForEachRow([&](int64_t s, const uint8_t* p) {
        LoadRow(p, job.keys.dtype, dim, row.data());
        const float key_norm = std::max(Norm(row.data(), dim), kCosineEps);
        // + 0.0f turns the -0 of a zero key or zero anchor into +0.
        out[s] = -Dot(row.data(), anchor.data(), dim) / (key_norm * anchor_norm) + 0.0f;
      });
      return;
    }
    case KeyDiffMetric::kPairwise: {
      // -sum_j cos(k_i, k_j) = -u_i . sum_j u_j with u = k / max(|k|, eps_c): O(n d) instead of
      // O(n^2 d), identical up to rounding (the j = i term is included, as in Eq. 7).
      MeanAnchor(keys, kCosineEps, anchor.data());
      const float n = static_cast<float>(job.keys.count);
      for (int d = 0; d < dim; ++d) anchor[d] *= n;
      keys.ForEachRow([&](int64_t s, const uint8_t* p) {
        LoadRow(p, job.keys.dtype, dim, row.data());
        const float key_norm = std::max(Norm(row.data(), dim), kCosineEps);
        out[s] = -Dot(row.data(), anchor.data(), dim) / key_norm + 0.0f;
      });
      return;
    }
    case KeyDiffMetric::kNegativeNorm:
      keys.ForEachRow([&](int64_t s, const uint8_t* p) {
        out[s] = -ScalarRowNorm(p, job.keys.dtype, dim, row.data()) + 0.0f;
      });
      return;
    case KeyDiffMetric::kDot:
    case KeyDiffMetric::kEuclidean: {
      // Both ablations are defined against the raw mean (§10.8); `anchor` does not apply.
      MeanAnchor(keys, 0.0f, anchor.data());
      const bool dot = job.metric == KeyDiffMetric::kDot;
      keys.ForEachRow([&](int64_t s, const uint8_t* p) {
        LoadRow(p, job.keys.dtype, dim, row.data());
        if (dot) {
          out[s] = -Dot(row.data(), anchor.data(), dim) + 0.0f;
        } else {
          float sum = 0.0f;
          for (int d = 0; d < dim; ++d) {
            const float diff = row[d] - anchor[d];
            sum += diff * diff;
          }
          out[s] = std::sqrt(sum);
        }
      });
      return;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// AVX2 + FMA + F16C: the default cosine metric with a mean anchor, two streaming passes over the
// keys (anchor, then scores). Chosen at run time; the rest of the binary stays baseline x86-64.

using avx2::HorizontalSum;
using avx2::Load8;

// Rows of a block are taken in groups small enough to stay in L1 between the two sweeps below.
constexpr int kRowGroup = 16;

// Converts one row to fp32 (into `converted`, unless the row already is fp32) and returns its
// sum of squares; dim % 8 == 0. Four accumulators hide the FMA latency.
template <DType kType>
KVS_AVX2 inline float ConvertRowAvx2(const uint8_t* row, int dim, float* converted) {
  constexpr int kBytes = DTypeBytes(kType);
  __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                 _mm256_setzero_ps()};
  int d = 0;
  for (; d + 32 <= dim; d += 32) {
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      const __m256 x = Load8<kType>(row + (d + 8 * v) * kBytes);
      if constexpr (kType != DType::kFloat32) _mm256_storeu_ps(converted + d + 8 * v, x);
      a[v] = _mm256_fmadd_ps(x, x, a[v]);
    }
  }
  for (; d < dim; d += 8) {
    const __m256 x = Load8<kType>(row + d * kBytes);
    if constexpr (kType != DType::kFloat32) _mm256_storeu_ps(converted + d, x);
    a[0] = _mm256_fmadd_ps(x, x, a[0]);
  }
  return HorizontalSum(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
}

// anchor[d0, d0 + 8 * kVectors) += sum over `count` fp32 rows of scale[r] * row[r]. The partial
// sums stay in registers for the whole group instead of going through memory once per row.
// Multiply, then add (not FMA): k * (1/|k|) is rounded before it is summed, like the scalar
// k / |k|, so exactly opposite keys cancel to an exactly zero anchor (spec §3.1 step 4) instead
// of leaving an FMA residue that the 1e-8 floor would blow up into non-zero scores.
template <int kVectors>
KVS_AVX2 inline void AccumulateRowsAvx2(const float* rows, uint64_t stride, int count,
                                        const float* scale, int d0, float* anchor) {
  __m256 acc[kVectors];
#pragma GCC unroll 8
  for (int v = 0; v < kVectors; ++v) acc[v] = _mm256_loadu_ps(anchor + d0 + 8 * v);
  const float* row = rows + d0;
  for (int r = 0; r < count; ++r, row += stride) {
    const __m256 factor = _mm256_set1_ps(scale[r]);
#pragma GCC unroll 8
    for (int v = 0; v < kVectors; ++v) {
      acc[v] = _mm256_add_ps(acc[v], _mm256_mul_ps(_mm256_loadu_ps(row + 8 * v), factor));
    }
  }
#pragma GCC unroll 8
  for (int v = 0; v < kVectors; ++v) _mm256_storeu_ps(anchor + d0 + 8 * v, acc[v]);
}

// Blocks of a head are scattered through the arena, which defeats the hardware stream
// prefetcher at every block boundary; while a block is processed, row r pulls in row r of the
// next block.
inline void PrefetchRow(const uint8_t* row, uint64_t bytes) {
  for (uint64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(row + offset);
}

// Writes the anchor and, per slot, the key's squared norm (reused by the scoring pass).
template <DType kType, bool kNormalize>
KVS_AVX2 void MeanAnchorAvx2(const HeadView& keys, float* anchor, float* squared_norms) {
  const int dim = keys.view.head_dim;
  const uint64_t stride = keys.row_bytes();
  const int64_t blocks = keys.num_blocks();
  std::fill(anchor, anchor + dim, 0.0f);
  float scale[kRowGroup];
  std::fill(scale, scale + kRowGroup, 1.0f);
  // fp16/bf16 rows are converted once into this buffer and summed from there; fp32 rows are
  // summed in place.
  std::vector<float> buffer(kType == DType::kFloat32 ? 0 : kRowGroup * dim);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* next = b + 1 < blocks ? keys.block_rows(b + 1) : nullptr;
    const int64_t rows = keys.rows_in_block(b);
    for (int64_t r0 = 0; r0 < rows; r0 += kRowGroup) {
      const uint8_t* group = keys.block_rows(b) + r0 * stride;
      const int count = static_cast<int>(std::min<int64_t>(kRowGroup, rows - r0));
      for (int r = 0; r < count; ++r) {
        if (next != nullptr) PrefetchRow(next + (r0 + r) * stride, stride);
        // The norms of a group are independent of each other, so their sqrt/div latencies
        // overlap instead of stalling the accumulation row by row.
        float* converted = kType == DType::kFloat32 ? nullptr : buffer.data() + r * dim;
        const float squared = ConvertRowAvx2<kType>(group + r * stride, dim, converted);
        squared_norms[b * keys.view.block_tokens + r0 + r] = squared;
        if constexpr (kNormalize) {
          scale[r] = 1.0f / std::max(std::sqrt(squared), kNormalizeEps);
        }
      }
      const float* rows_f32 =
          kType == DType::kFloat32 ? reinterpret_cast<const float*>(group) : buffer.data();
      int d = 0;
      for (; d + 64 <= dim; d += 64) {
        AccumulateRowsAvx2<8>(rows_f32, dim, count, scale, d, anchor);
      }
      for (; d < dim; d += 8) AccumulateRowsAvx2<1>(rows_f32, dim, count, scale, d, anchor);
    }
  }
  const float inv_n = 1.0f / static_cast<float>(keys.view.count);
  for (int d = 0; d < dim; ++d) anchor[d] *= inv_n;
}

// A key row's dot product with `other` ([dim] fp32), or with itself (its squared norm) when
// kSelf; dim % 8 == 0. Four accumulators hide the FMA latency.
template <DType kType, bool kSelf>
KVS_AVX2 inline float RowDotAvx2(const uint8_t* row, const float* other, int dim) {
  constexpr int kBytes = DTypeBytes(kType);
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  int d = 0;
  for (; d + 32 <= dim; d += 32) {
    for (int v = 0; v < 4; ++v) {
      const __m256 x = Load8<kType>(row + (d + 8 * v) * kBytes);
      acc[v] = _mm256_fmadd_ps(x, kSelf ? x : _mm256_loadu_ps(other + d + 8 * v), acc[v]);
    }
  }
  for (; d < dim; d += 8) {
    const __m256 x = Load8<kType>(row + d * kBytes);
    acc[0] = _mm256_fmadd_ps(x, kSelf ? x : _mm256_loadu_ps(other + d), acc[0]);
  }
  return HorizontalSum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

// KNorm's AVX2 norm of one row (KeyRowNorm).
template <DType kType>
KVS_AVX2 float Avx2RowNorm(const uint8_t* row, int dim) {
  return std::sqrt(RowDotAvx2<kType, true>(row, nullptr, dim));
}

// One streaming pass over a head's keys (the next block's rows prefetched): the cosine to
// `anchor` when kCosine, with `out` holding each slot's squared key norm on entry; else KNorm's
// -|k| (KeyDiffMetric::kNegativeNorm, no anchor). `out` holds the scores on return.
template <DType kType, bool kCosine>
KVS_AVX2 void ScorePassAvx2(const HeadView& keys, const float* anchor, float* out) {
  const int dim = keys.view.head_dim;
  const uint64_t stride = keys.row_bytes();
  float anchor_norm = 0.0f;
  if constexpr (kCosine) {
    float anchor_sq = 0.0f;
    for (int d = 0; d < dim; ++d) anchor_sq += anchor[d] * anchor[d];
    anchor_norm = std::max(std::sqrt(anchor_sq), kCosineEps);
  }
  for (int64_t b = 0; b < keys.num_blocks(); ++b) {
    const uint8_t* row = keys.block_rows(b);
    const uint8_t* next = b + 1 < keys.num_blocks() ? keys.block_rows(b + 1) : nullptr;
    const int64_t rows = keys.rows_in_block(b);
    float* block_out = out + b * keys.view.block_tokens;
    for (int64_t r = 0; r < rows; ++r, row += stride) {
      if (next != nullptr) PrefetchRow(next + r * stride, stride);
      // + 0.0f turns the -0 of a zero key or zero anchor into +0.
      if constexpr (kCosine) {
        const float dot = RowDotAvx2<kType, false>(row, anchor, dim);
        const float key_norm = std::max(std::sqrt(block_out[r]), kCosineEps);
        block_out[r] = -dot / (key_norm * anchor_norm) + 0.0f;
      } else {
        block_out[r] = -Avx2RowNorm<kType>(row, dim) + 0.0f;
      }
    }
  }
}

template <DType kType>
KVS_AVX2 void ScoreHeadAvx2(const KeyDiffScoreJob& job, int head) {
  const HeadView keys{job.keys, head};
  float* out = job.scores + static_cast<int64_t>(head) * job.keys.count;
  if (job.metric == KeyDiffMetric::kNegativeNorm) {
    return ScorePassAvx2<kType, false>(keys, nullptr, out);
  }
  std::vector<float> anchor(job.keys.head_dim);
  if (job.anchor == KeyDiffAnchor::kMeanNormalized) {
    MeanAnchorAvx2<kType, true>(keys, anchor.data(), out);
  } else {
    MeanAnchorAvx2<kType, false>(keys, anchor.data(), out);
  }
  ScorePassAvx2<kType, true>(keys, anchor.data(), out);
}

bool Avx2Covers(const KeyDiffScoreJob& job) {
  if (job.keys.head_dim % 8 != 0) return false;
  if (job.metric == KeyDiffMetric::kNegativeNorm) return true;  // no anchor
  return job.metric == KeyDiffMetric::kCosine &&
         (job.anchor == KeyDiffAnchor::kMeanNormalized || job.anchor == KeyDiffAnchor::kMeanRaw);
}

}  // namespace

absl::Status ValidateKeyDiffJob(const KeyDiffScoreJob& job, size_t index) {
  const PagedLayerView& v = job.keys;
  auto invalid = [index](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("keydiff job ", index, ": ", parts...));
  };
  if (v.count < 0) return invalid("count must be >= 0, got ", v.count);
  if (v.num_kv_heads < 1) return invalid("num_kv_heads must be >= 1, got ", v.num_kv_heads);
  if (v.head_dim < 1) return invalid("head_dim must be >= 1, got ", v.head_dim);
  if (v.block_tokens < 1) return invalid("block_tokens must be >= 1, got ", v.block_tokens);
  if (v.dtype != DType::kFloat16 && v.dtype != DType::kBFloat16 && v.dtype != DType::kFloat32) {
    return invalid("unsupported dtype");
  }
  switch (job.anchor) {
    case KeyDiffAnchor::kMeanNormalized:
    case KeyDiffAnchor::kMeanRaw:
    case KeyDiffAnchor::kMedianNormalized:
      break;
    default:
      return invalid("unknown anchor");
  }
  switch (job.metric) {
    case KeyDiffMetric::kCosine:
    case KeyDiffMetric::kPairwise:
    case KeyDiffMetric::kDot:
    case KeyDiffMetric::kEuclidean:
    case KeyDiffMetric::kNegativeNorm:
      break;
    default:
      return invalid("unknown metric");
  }
  // Keys occupy the first num_kv_heads * block_tokens rows of each block.
  const auto key_bytes =
      CheckedProduct({v.num_kv_heads, v.block_tokens, v.head_dim, DTypeBytes(v.dtype)});
  if (!key_bytes || *key_bytes > v.block_bytes) {
    return invalid("block_bytes ", v.block_bytes, " cannot hold the keys of ", v.num_kv_heads,
                   " heads x ", v.block_tokens, " tokens x ", v.head_dim, " dims");
  }
  if (v.count == 0) return absl::OkStatus();
  if (v.arena == nullptr || v.block_table == nullptr || job.scores == nullptr) {
    return invalid("null arena, block_table or scores");
  }
  const int64_t blocks = (static_cast<int64_t>(v.count) + v.block_tokens - 1) / v.block_tokens;
  for (int64_t b = 0; b < blocks; ++b) {
    const int32_t block = v.block_table[b];
    if (block < 0 || !CheckedProduct({block + int64_t{1}, static_cast<int64_t>(v.block_bytes)})) {
      return invalid("block_table[", b, "] = ", block, " is not a valid block");
    }
  }
  return absl::OkStatus();
}

void KeyDiffScoreHead(const KeyDiffScoreJob& job, int head, KeyDiffIsa isa) {
  if (job.keys.count == 0) return;
  if (isa == KeyDiffIsa::kAvx2 && CpuSupportsAvx2() && Avx2Covers(job)) {
    switch (job.keys.dtype) {
      case DType::kFloat16:
        return ScoreHeadAvx2<DType::kFloat16>(job, head);
      case DType::kBFloat16:
        return ScoreHeadAvx2<DType::kBFloat16>(job, head);
      case DType::kFloat32:
        return ScoreHeadAvx2<DType::kFloat32>(job, head);
    }
  }
  ScoreHeadScalar(job, head);
}

namespace {

// KNorm's scalar norm of one row of kType values (KeyRowNormFor).
template <DType kType>
float ScalarKeyRowNorm(const uint8_t* row, int dim) {
  constexpr int kStackDims = 512;
  if (dim <= kStackDims) {
    float scratch[kStackDims];
    return ScalarRowNorm(row, kType, dim, scratch);
  }
  std::vector<float> scratch(dim);
  return ScalarRowNorm(row, kType, dim, scratch.data());
}

}  // namespace

KeyRowNormFn KeyRowNormFor(DType dtype, int dim, KeyDiffIsa isa) {
  // The same choice as KeyDiffScoreHead's for a kNegativeNorm job (Avx2Covers: dim % 8 == 0).
  const bool avx2 = isa == KeyDiffIsa::kAvx2 && CpuSupportsAvx2() && dim % 8 == 0;
  switch (dtype) {
    case DType::kFloat16:
      return avx2 ? &Avx2RowNorm<DType::kFloat16> : &ScalarKeyRowNorm<DType::kFloat16>;
    case DType::kBFloat16:
      return avx2 ? &Avx2RowNorm<DType::kBFloat16> : &ScalarKeyRowNorm<DType::kBFloat16>;
    case DType::kFloat32:
      return avx2 ? &Avx2RowNorm<DType::kFloat32> : &ScalarKeyRowNorm<DType::kFloat32>;
  }
  return &ScalarKeyRowNorm<DType::kFloat32>;  // not reached: every dtype is listed
}

float KeyRowNorm(const uint8_t* row, DType dtype, int dim, KeyDiffIsa isa) {
  return KeyRowNormFor(dtype, dim, isa)(row, dim);
}

}  // namespace kvs
