#include "gpu/cpu/merge_cpu.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gpu/base/checked_math.h"
#include "gpu/base/dtype.h"
#include "gpu/cpu/attention_cpu.h"
#include "gpu/cpu/avx2_util.h"
#include "gpu/cpu/cpu_isa.h"
#include "gpu/cpu/keydiff_cpu.h"

namespace kvs {
namespace {

// Below these sizes a whole call runs on the calling thread (a decode step's few merges).
constexpr uint64_t kParallelMinNearestElements = 1 << 18;
constexpr uint64_t kParallelMinMergeElements = 1 << 16;
// Norms are floored here before dividing (d2o.md §4.1 step 6).
constexpr float kNormFloor = 1e-6f;

}  // namespace

absl::Status ValidateNearestKeyJob(const NearestKeyJob& job, size_t index) {
  const std::string context = absl::StrCat("nearest key job ", index);
  auto invalid = [&context](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(context, ": ", parts...));
  };
  const PagedLayerView& v = job.keys;
  if (auto status = ValidatePagedLayerView(v, context, "keys"); !status.ok()) return status;
  if (job.head < 0 || job.head >= v.num_kv_heads) {
    return invalid("head must be in [0, ", v.num_kv_heads, "), got ", job.head);
  }
  if (job.num_queries < 0) return invalid("num_queries must be >= 0, got ", job.num_queries);
  if (job.num_queries == 0) return absl::OkStatus();
  if (job.num_candidates < 1) {
    return invalid("num_candidates must be >= 1, got ", job.num_candidates);
  }
  if (job.query_slots == nullptr) return invalid("query_slots is null");
  if (job.candidate_slots == nullptr) return invalid("candidate_slots is null");
  if (job.candidate_positions == nullptr) return invalid("candidate_positions is null");
  if (job.similarity == nullptr) return invalid("similarity is null");
  if (job.target == nullptr) return invalid("target is null");
  for (int32_t e = 0; e < job.num_queries; ++e) {
    if (job.query_slots[e] < 0 || job.query_slots[e] >= v.count) {
      return invalid("query_slots[", e, "] = ", job.query_slots[e], " is not in [0, ", v.count,
                     ")");
    }
  }
  for (int32_t c = 0; c < job.num_candidates; ++c) {
    if (job.candidate_slots[c] < 0 || job.candidate_slots[c] >= v.count) {
      return invalid("candidate_slots[", c, "] = ", job.candidate_slots[c], " is not in [0, ",
                     v.count, ")");
    }
  }
  return absl::OkStatus();
}

namespace {

// Loads a key row as fp32 and returns its norm floored at kNormFloor.
float LoadKey(const PagedLayerView& v, int64_t head, int64_t slot, float* out) {
  const uint8_t* row = PagedRow(v, head, slot);
  float squared = 0.0f;
  for (int d = 0; d < v.head_dim; ++d) {
    out[d] = LoadAsFloat(row, v.dtype, d);
    squared += out[d] * out[d];
  }
  return std::max(std::sqrt(squared), kNormFloor);
}

// True when (a, pa) beats (b, pb): a higher similarity, or an equal one at a lower position. NaN
// loses to every number, so a NaN key never becomes a merge target over a real one.
bool Better(float a, int32_t pa, float b, int32_t pb) {
  if (std::isnan(a)) return false;
  if (std::isnan(b)) return true;
  return a > b || (a == b && pa < pb);
}

// The portable path (CPUs without AVX2/FMA): candidates are normalised once (unit rows), then
// every query is a sweep of dot products in candidate order.
void NearestKeysOfJobScalar(const NearestKeyJob& job) {
  if (job.num_queries == 0) return;
  const PagedLayerView& v = job.keys;
  const int dim = v.head_dim;
  std::vector<float> candidates(static_cast<size_t>(job.num_candidates) * dim);
  for (int32_t c = 0; c < job.num_candidates; ++c) {
    float* row = candidates.data() + static_cast<size_t>(c) * dim;
    const float norm = LoadKey(v, job.head, job.candidate_slots[c], row);
    for (int d = 0; d < dim; ++d) row[d] /= norm;
  }
  std::vector<float> query(dim);
  for (int32_t e = 0; e < job.num_queries; ++e) {
    const float norm = LoadKey(v, job.head, job.query_slots[e], query.data());
    for (int d = 0; d < dim; ++d) query[d] /= norm;
    float best = 0.0f;
    int32_t best_index = -1;
    for (int32_t c = 0; c < job.num_candidates; ++c) {
      const float* row = candidates.data() + static_cast<size_t>(c) * dim;
      float dot = 0.0f;
      for (int d = 0; d < dim; ++d) dot += query[d] * row[d];
      if (best_index < 0 ||
          Better(dot, job.candidate_positions[c], best, job.candidate_positions[best_index])) {
        best = dot;
        best_index = c;
      }
    }
    job.similarity[e] = best;
    job.target[e] = best_index;
  }
}

// ---- AVX2/FMA path (its dot products also on AVX-512) ----------------------------------------
// A small GEMM of unit query rows against unit candidate rows with a running (max, argmax) per
// query. Candidates are packed once per job into panels of kPanel candidates, transposed
// ([dim][kPanel]), so the micro-kernel broadcasts one query element and FMAs it into kPanel
// candidate lanes: every (query, candidate) dot is the same sequential fp32 FMA chain over d no
// matter which lane or panel the candidate sits in, or which ISA runs it, so equal unit rows give
// bit-equal cosines and exact ties stay exact. Padding candidates (zero rows past num_candidates)
// are never selected. Candidates are visited in index order per query and fed to Better()
// exactly like the scalar path, so the tie rule (lowest position) and NaN handling are unchanged.

using avx2::Transpose8x8;

constexpr int kPanel = 16;             // candidates per packed panel (two ymm, one zmm)
constexpr int kChunkRows = 48;         // queries per task (normalised into a thread-local buffer)
constexpr int kPanelsPerBlock = 8;     // 128 candidates x dim fp32 per L2-resident block
// Packed candidates of all jobs of one batch stay under this many floats (16 MiB: bounds memory for
// calls with hundreds of jobs; each job's panels are ~1 MiB at 2048 x 128).
constexpr size_t kBatchFloats = size_t{4} << 20;

// One job's normalised candidates, [panels][dim][kPanel], zero past num_candidates.
struct PackedCandidates {
  std::vector<float> data;
  int panels = 0;
};

// Bit-identical to normalising every candidate with LoadKey (the scalar path's numbers), 16
// candidates at a time: each lane of a panel holds one candidate, so the per-candidate sum of
// squares runs sequentially over d exactly like LoadKey's (a rounded product, then a rounded add;
// never fused), and sqrt, the floor and the division are the same IEEE operations.
template <DType kType>
KVS_AVX2 void PackCandidatesAvx2(const NearestKeyJob& job, PackedCandidates& out) {
  const PagedLayerView& v = job.keys;
  const int dim = v.head_dim;
  const int vec = dim & ~7;
  out.panels = (job.num_candidates + kPanel - 1) / kPanel;
  // Every element is written below (padding lanes as zeros): no clearing pass over the buffer,
  // whose capacity is reused across the batches of a call.
  out.data.resize(static_cast<size_t>(out.panels) * dim * kPanel);
  const __m256 floor = _mm256_set1_ps(kNormFloor);
  for (int p = 0; p < out.panels; ++p) {
    float* panel = out.data.data() + static_cast<size_t>(p) * dim * kPanel;
    const int lanes = std::min(kPanel, job.num_candidates - p * kPanel);
    // Eight candidates at a time: 8 x 8 blocks converted in registers and transposed into the
    // panel's [d][lane] order; missing candidates (the last panel's padding) are zero rows.
    for (int j0 = 0; j0 < kPanel; j0 += 8) {
      const uint8_t* src[8];
      for (int j = 0; j < 8; ++j) {
        src[j] = j0 + j < lanes ? PagedRow(v, job.head, job.candidate_slots[p * kPanel + j0 + j])
                                : nullptr;
      }
      for (int d = 0; d < vec; d += 8) {
        __m256 r[8];
        for (int j = 0; j < 8; ++j) {
          r[j] = src[j] != nullptr ? avx2::Load8<kType>(src[j] + d * DTypeBytes(kType))
                                   : _mm256_setzero_ps();
        }
        Transpose8x8(r);
        for (int i = 0; i < 8; ++i) {
          _mm256_storeu_ps(panel + static_cast<size_t>(d + i) * kPanel + j0, r[i]);
        }
      }
      for (int d = vec; d < dim; ++d) {
        for (int j = 0; j < 8; ++j) {
          panel[static_cast<size_t>(d) * kPanel + j0 + j] =
              src[j] != nullptr ? LoadAsFloat(src[j], kType, d) : 0.0f;
        }
      }
    }
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
    for (int d = 0; d < dim; ++d) {
      const __m256 x0 = _mm256_loadu_ps(panel + static_cast<size_t>(d) * kPanel);
      const __m256 x1 = _mm256_loadu_ps(panel + static_cast<size_t>(d) * kPanel + 8);
      __m256 p0 = _mm256_mul_ps(x0, x0), p1 = _mm256_mul_ps(x1, x1);
      // Opaque to the optimiser: the products stay rounded, never contracted into an FMA.
      asm("" : "+x"(p0), "+x"(p1));
      s0 = _mm256_add_ps(s0, p0);
      s1 = _mm256_add_ps(s1, p1);
    }
    // max(floor, norm) returns its second operand for NaN: a NaN norm stays NaN (std::max).
    const __m256 n0 = _mm256_max_ps(floor, _mm256_sqrt_ps(s0));
    const __m256 n1 = _mm256_max_ps(floor, _mm256_sqrt_ps(s1));
    for (int d = 0; d < dim; ++d) {
      float* at = panel + static_cast<size_t>(d) * kPanel;
      _mm256_storeu_ps(at, _mm256_div_ps(_mm256_loadu_ps(at), n0));
      _mm256_storeu_ps(at + 8, _mm256_div_ps(_mm256_loadu_ps(at + 8), n1));
    }
  }
}

void PackCandidates(const NearestKeyJob& job, PackedCandidates& out) {
  switch (job.keys.dtype) {
    case DType::kFloat16:
      return PackCandidatesAvx2<DType::kFloat16>(job, out);
    case DType::kBFloat16:
      return PackCandidatesAvx2<DType::kBFloat16>(job, out);
    default:
      return PackCandidatesAvx2<DType::kFloat32>(job, out);
  }
}

// Dots of Dots::kRows unit query rows (row stride = dim) with one candidate panel, into
// out[row][lane]. Returns false (out untouched) when no lane of any row can beat that row's best:
// every dot is a number below best[r] (best[r] NaN or an unset best never skips). Each lane is
// one sequential fp32 FMA chain over d in both kernels, so AVX2 and AVX-512 give bit-equal dots.
struct PanelDotsAvx2 {
  static constexpr int kRows = 6;  // 12 accumulators + 2 candidate registers + 1 broadcast
  KVS_AVX2 static bool Run(const float* q, int dim, const float* panel, const float* best,
                           float (*out)[kPanel]) {
    __m256 acc[kRows][2];
#pragma GCC unroll 6
    for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int d = 0; d < dim; ++d) {
      const __m256 c0 = _mm256_loadu_ps(panel + static_cast<size_t>(d) * kPanel);
      const __m256 c1 = _mm256_loadu_ps(panel + static_cast<size_t>(d) * kPanel + 8);
#pragma GCC unroll 6
      for (int r = 0; r < kRows; ++r) {
        const __m256 x = _mm256_broadcast_ss(q + static_cast<size_t>(r) * dim + d);
        acc[r][0] = _mm256_fmadd_ps(x, c0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(x, c1, acc[r][1]);
      }
    }
    int all_below = 1;
#pragma GCC unroll 6
    for (int r = 0; r < kRows; ++r) {
      const __m256 b = _mm256_set1_ps(best[r]);
      // Ordered compares: false for NaN dots and NaN bests, which then take the exact path.
      const __m256 below = _mm256_and_ps(_mm256_cmp_ps(acc[r][0], b, _CMP_LT_OQ),
                                         _mm256_cmp_ps(acc[r][1], b, _CMP_LT_OQ));
      all_below &= _mm256_movemask_ps(below) == 0xff;
    }
    if (all_below) return false;
#pragma GCC unroll 6
    for (int r = 0; r < kRows; ++r) {
      _mm256_storeu_ps(out[r], acc[r][0]);
      _mm256_storeu_ps(out[r] + 8, acc[r][1]);
    }
    return true;
  }
};

// A panel's 16 lanes are one zmm: twice the query rows per candidate load.
struct PanelDotsAvx512 {
  static constexpr int kRows = 12;  // 12 accumulators + 1 candidate register + broadcasts
  KVS_AVX512 static bool Run(const float* q, int dim, const float* panel, const float* best,
                             float (*out)[kPanel]) {
    static_assert(kPanel == 16, "one zmm per panel row");
    __m512 acc[kRows];
#pragma GCC unroll 12
    for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
    for (int d = 0; d < dim; ++d) {
      const __m512 c = _mm512_loadu_ps(panel + static_cast<size_t>(d) * kPanel);
#pragma GCC unroll 12
      for (int r = 0; r < kRows; ++r) {
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[static_cast<size_t>(r) * dim + d]), c, acc[r]);
      }
    }
    bool all_below = true;
#pragma GCC unroll 12
    for (int r = 0; r < kRows; ++r) {
      // Ordered compare: false for NaN dots and NaN bests, which then take the exact path.
      all_below &= _mm512_cmp_ps_mask(acc[r], _mm512_set1_ps(best[r]), _CMP_LT_OQ) == 0xffff;
    }
    if (all_below) return false;
#pragma GCC unroll 12
    for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(out[r], acc[r]);
    return true;
  }
};

// Queries [first, first + rows) of `job` (rows <= kChunkRows) against all packed candidates,
// Dots::kRows queries per pass over a block of panels.
template <typename Dots>
void NearestChunk(const NearestKeyJob& job, const PackedCandidates& packed, int32_t first,
                  int rows) {
  static_assert(kChunkRows % Dots::kRows == 0, "a chunk is whole passes");
  const PagedLayerView& v = job.keys;
  const int dim = v.head_dim;
  thread_local std::vector<float> queries;
  queries.assign(static_cast<size_t>(kChunkRows) * dim, 0.0f);
  for (int r = 0; r < rows; ++r) {
    float* row = queries.data() + static_cast<size_t>(r) * dim;
    const float norm = LoadKey(v, job.head, job.query_slots[first + r], row);
    for (int d = 0; d < dim; ++d) row[d] /= norm;
  }
  // best is NaN while unset (index -1), so no panel is skipped before a query has a best.
  float best[kChunkRows];
  int32_t best_index[kChunkRows];
  for (int r = 0; r < kChunkRows; ++r) {
    best[r] = std::numeric_limits<float>::quiet_NaN();
    best_index[r] = -1;
  }
  float dots[Dots::kRows][kPanel];
  const int32_t* positions = job.candidate_positions;
  for (int p0 = 0; p0 < packed.panels; p0 += kPanelsPerBlock) {
    const int p1 = std::min(packed.panels, p0 + kPanelsPerBlock);
    for (int r0 = 0; r0 < rows; r0 += Dots::kRows) {
      const float* q = queries.data() + static_cast<size_t>(r0) * dim;
      for (int p = p0; p < p1; ++p) {
        const float* panel = packed.data.data() + static_cast<size_t>(p) * dim * kPanel;
        if (!Dots::Run(q, dim, panel, best + r0, dots)) continue;
        const int lanes = std::min(kPanel, job.num_candidates - p * kPanel);
        for (int r = 0; r < Dots::kRows && r0 + r < rows; ++r) {
          float& b = best[r0 + r];
          int32_t& bi = best_index[r0 + r];
          for (int j = 0; j < lanes; ++j) {
            const int32_t c = p * kPanel + j;
            if (bi < 0 || Better(dots[r][j], positions[c], b, positions[bi])) {
              b = dots[r][j];
              bi = c;
            }
          }
        }
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    job.similarity[first + r] = best[r];
    job.target[first + r] = best_index[r];
  }
}

// ---- Streaming path (few queries: decode) -----------------------------------------------------
// Decode evicts one token per (layer, head) against ~2k kept candidates: packing (converting and
// normalising) every candidate into panels costs a write and a read of 4 * dim bytes per candidate
// for ONE dot product. Here each query streams over the candidate rows straight from the arena
// instead, converting in registers and computing dot(q, c) and ||c||^2 in the same pass; the
// cosine is dot / (max(||q||, floor) * max(||c||, floor)). Four candidates go through the same
// code at once (8 independent FMA chains hide the FMA latency); a short last group repeats its
// last row, so every candidate's dot, norm and cosine come from the same sequence of operations
// wherever it sits: equal rows give bit-equal cosines and exact ties stay exact. Candidates are
// fed to Better() in index order, like the other paths (tie -> lowest position, NaN loses).

// Candidates prefetched ahead of the one being read (rows hop between blocks of the table).
constexpr int kStreamPrefetchAhead = 16;
// Below this many streamed elements (queries x candidates x dim) a call runs on the calling
// thread: a decode step's handful of (layer, head) jobs is tens of microseconds, less than waking
// a worker, and several sequences may be calling at once anyway.
constexpr uint64_t kParallelMinStreamElements = uint64_t{1} << 21;

KVS_AVX2 inline void PrefetchRow(const uint8_t* row, int row_bytes) {
  for (int b = 0; b < row_bytes; b += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(row + b), _MM_HINT_T0);
  }
}

// One query (fp32, `q_norm` already floored) against every candidate of `job`.
template <DType kType>
KVS_AVX2 void StreamQuery(const NearestKeyJob& job, const float* q, float q_norm, float& similarity,
                          int32_t& target) {
  const PagedLayerView& v = job.keys;
  const int dim = v.head_dim;
  const int vec = dim & ~7;
  const int row_bytes = dim * DTypeBytes(kType);
  const int32_t n = job.num_candidates;
  const int32_t* slots = job.candidate_slots;
  const int32_t* positions = job.candidate_positions;
  const __m128 q_norm4 = _mm_set1_ps(q_norm);
  const __m128 floor4 = _mm_set1_ps(kNormFloor);
  float best = std::numeric_limits<float>::quiet_NaN();  // NaN while unset: nothing skipped
  int32_t best_index = -1;
  for (int32_t c = 0; c < n; c += 4) {
    const int lanes = std::min<int32_t>(4, n - c);
    const uint8_t* r[4];
    for (int j = 0; j < 4; ++j) r[j] = PagedRow(v, job.head, slots[c + std::min(j, lanes - 1)]);
    for (int j = 0; j < 4 && c + kStreamPrefetchAhead + j < n; ++j) {
      PrefetchRow(PagedRow(v, job.head, slots[c + kStreamPrefetchAhead + j]), row_bytes);
    }
    __m256 d0 = _mm256_setzero_ps(), d1 = d0, d2 = d0, d3 = d0;
    __m256 s0 = d0, s1 = d0, s2 = d0, s3 = d0;
    for (int d = 0; d < vec; d += 8) {
      const __m256 x = _mm256_loadu_ps(q + d);
      const __m256 k0 = avx2::Load8<kType>(r[0] + d * DTypeBytes(kType));
      const __m256 k1 = avx2::Load8<kType>(r[1] + d * DTypeBytes(kType));
      const __m256 k2 = avx2::Load8<kType>(r[2] + d * DTypeBytes(kType));
      const __m256 k3 = avx2::Load8<kType>(r[3] + d * DTypeBytes(kType));
      d0 = _mm256_fmadd_ps(x, k0, d0);
      s0 = _mm256_fmadd_ps(k0, k0, s0);
      d1 = _mm256_fmadd_ps(x, k1, d1);
      s1 = _mm256_fmadd_ps(k1, k1, s1);
      d2 = _mm256_fmadd_ps(x, k2, d2);
      s2 = _mm256_fmadd_ps(k2, k2, s2);
      d3 = _mm256_fmadd_ps(x, k3, d3);
      s3 = _mm256_fmadd_ps(k3, k3, s3);
    }
    __m128 dots = avx2::HorizontalSum4(d0, d1, d2, d3);
    __m128 squares = avx2::HorizontalSum4(s0, s1, s2, s3);
    if (vec < dim) {  // odd head_dim: the same scalar tail for every lane
      alignas(16) float dot[4], square[4];
      _mm_store_ps(dot, dots);
      _mm_store_ps(square, squares);
      for (int j = 0; j < 4; ++j) {
        for (int d = vec; d < dim; ++d) {
          const float k = LoadAsFloat(r[j], kType, d);
          dot[j] += q[d] * k;
          square[j] += k * k;
        }
      }
      dots = _mm_load_ps(dot);
      squares = _mm_load_ps(square);
    }
    const __m128 norms = _mm_max_ps(_mm_sqrt_ps(squares), floor4);
    const __m128 cosines = _mm_div_ps(dots, _mm_mul_ps(q_norm4, norms));
    // Ordered compare: false for NaN cosines and a NaN (unset) best, which take the exact path.
    if (_mm_movemask_ps(_mm_cmplt_ps(cosines, _mm_set1_ps(best))) == 0xf) continue;
    alignas(16) float cosine[4];
    _mm_store_ps(cosine, cosines);
    for (int j = 0; j < lanes; ++j) {
      if (best_index < 0 || Better(cosine[j], positions[c + j], best, positions[best_index])) {
        best = cosine[j];
        best_index = c + j;
      }
    }
  }
  similarity = best;
  target = best_index;
}

template <DType kType>
KVS_AVX2 void StreamJob(const NearestKeyJob& job) {
  const PagedLayerView& v = job.keys;
  const int dim = v.head_dim;
  thread_local std::vector<float> query;
  if (query.size() < static_cast<size_t>(dim)) query.resize(dim);
  for (int32_t e = 0; e < job.num_queries; ++e) {
    // The query's norm in the same fp32 arithmetic as LoadKey (the packed path).
    const float q_norm = LoadKey(v, job.head, job.query_slots[e], query.data());
    StreamQuery<kType>(job, query.data(), q_norm, job.similarity[e], job.target[e]);
  }
}

void NearestKeysOfJobStreaming(const NearestKeyJob& job) {
  if (job.num_queries == 0) return;
  switch (job.keys.dtype) {
    case DType::kFloat16:
      return StreamJob<DType::kFloat16>(job);
    case DType::kBFloat16:
      return StreamJob<DType::kBFloat16>(job);
    case DType::kFloat32:
      return StreamJob<DType::kFloat32>(job);
    default:
      return NearestKeysOfJobScalar(job);  // unreachable: validated
  }
}

}  // namespace

absl::Status ValidateRowMergeJob(const RowMergeJob& job, size_t index) {
  auto invalid = [index](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("row merge job ", index, ": ", parts...));
  };
  if (job.dtype != DType::kFloat16 && job.dtype != DType::kBFloat16 &&
      job.dtype != DType::kFloat32) {
    return invalid("dtype ", static_cast<int>(job.dtype), " is not supported");
  }
  if (job.row_elements < 1) return invalid("row_elements must be >= 1, got ", job.row_elements);
  if (job.rows < 0) return invalid("rows must be >= 0, got ", job.rows);
  if (job.rows > kMaxRowMergeRows) {
    return invalid("rows must be <= ", kMaxRowMergeRows, ", got ", job.rows);
  }
  if (job.rows == 0) return absl::OkStatus();  // nothing is read or written
  if (job.arena == nullptr) return invalid("arena is null");
  if (job.dst_offsets == nullptr) return invalid("dst_offsets is null");
  if (job.source_starts == nullptr) return invalid("source_starts is null");
  if (job.src_offsets == nullptr) return invalid("src_offsets is null");
  if (job.weights == nullptr) return invalid("weights is null");
  if (job.source_starts[0] != 0) {
    return invalid("source_starts[0] must be 0, got ", job.source_starts[0]);
  }
  // The arena's size is not part of the job; the offsets can at least not wrap around.
  const uint64_t row_bytes = static_cast<uint64_t>(job.row_elements) * DTypeBytes(job.dtype);
  for (int64_t r = 0; r < job.rows; ++r) {
    if (job.source_starts[r + 1] <= job.source_starts[r]) {
      return invalid("source_starts[", r + 1, "] must be above source_starts[", r, "] (every row ",
                     "has a source), got ", job.source_starts[r + 1]);
    }
    if (!CheckedAdd(job.dst_offsets[r], row_bytes)) {
      return invalid("dst_offsets[", r, "] overflows");
    }
  }
  for (int64_t k = 0; k < job.source_starts[job.rows]; ++k) {
    if (!CheckedAdd(job.src_offsets[k], row_bytes)) {
      return invalid("src_offsets[", k, "] overflows");
    }
  }
  return absl::OkStatus();
}

namespace {

// Every source is read into the fp32 sum before dst is written, so dst may be a source.
void MergeRow(const RowMergeJob& job, int64_t r, std::vector<float>& sum) {
  const int n = job.row_elements;
  sum.assign(n, 0.0f);
  for (int64_t k = job.source_starts[r]; k < job.source_starts[r + 1]; ++k) {
    const uint8_t* src = job.arena + job.src_offsets[k];
    const float w = job.weights[k];
    for (int d = 0; d < n; ++d) sum[d] += w * LoadAsFloat(src, job.dtype, d);
  }
  uint8_t* dst = job.arena + job.dst_offsets[r];
  for (int d = 0; d < n; ++d) StoreFromFloat(dst, job.dtype, d, sum[d]);
}

}  // namespace

absl::Status RunNearestKeys(absl::Span<const NearestKeyJob> jobs, ThreadPool& pool) {
  return RunNearestKeys(jobs, pool, NearestKeysPath::kAuto);
}

absl::Status RunNearestKeys(absl::Span<const NearestKeyJob> jobs, ThreadPool& pool,
                            NearestKeysPath path, CpuIsa max_isa) {
  uint64_t elements = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (auto status = ValidateNearestKeyJob(jobs[i], i); !status.ok()) return status;
    elements += static_cast<uint64_t>(jobs[i].num_queries) *
                static_cast<uint64_t>(std::max(jobs[i].num_candidates, 0)) * jobs[i].keys.head_dim;
  }
  const CpuIsa isa = UsableCpuIsa(max_isa);
  const bool avx512 = isa >= CpuIsa::kAvx512;  // the packed path's dots; the rest is AVX2
  if (isa < CpuIsa::kAvx2) {
    pool.ParallelFor(
        static_cast<int64_t>(jobs.size()), [&](int64_t i) { NearestKeysOfJobScalar(jobs[i]); },
        elements < kParallelMinNearestElements ? 1 : 0);
    return absl::OkStatus();
  }
  // Jobs with few queries stream (one task per job); the rest are packed.
  auto streams = [path](const NearestKeyJob& job) {
    if (job.num_queries == 0) return false;
    switch (path) {
      case NearestKeysPath::kStreaming:
        return true;
      case NearestKeysPath::kPacked:
        return false;
      default:
        return job.num_queries <= kNearestStreamingMaxQueries;
    }
  };
  std::vector<size_t> streamed, packed_jobs;
  uint64_t stream_elements = 0, packed_elements = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    const NearestKeyJob& job = jobs[i];
    if (job.num_queries == 0) continue;
    const uint64_t e = static_cast<uint64_t>(job.num_queries) *
                       static_cast<uint64_t>(job.num_candidates) * job.keys.head_dim;
    if (streams(job)) {
      streamed.push_back(i);
      stream_elements += e;
    } else {
      packed_jobs.push_back(i);
      packed_elements += e;
    }
  }
  if (!streamed.empty()) {
    pool.ParallelFor(
        static_cast<int64_t>(streamed.size()),
        [&](int64_t t) { NearestKeysOfJobStreaming(jobs[streamed[t]]); },
        stream_elements < kParallelMinStreamElements ? 1 : 0);
  }
  if (packed_jobs.empty()) return absl::OkStatus();
  const int max_parallel = packed_elements < kParallelMinNearestElements ? 1 : 0;
  // Batches of jobs whose packed candidates fit kBatchFloats: pack them (one task per job), then
  // one task per (job, chunk of kChunkRows queries) so even a single big job spreads over the
  // pool's threads.
  std::vector<PackedCandidates> packed;
  std::vector<std::pair<size_t, int32_t>> tasks;  // (index into packed_jobs, first query)
  size_t begin = 0;
  while (begin < packed_jobs.size()) {
    size_t end = begin;
    size_t floats = 0;
    while (end < packed_jobs.size()) {
      const NearestKeyJob& job = jobs[packed_jobs[end]];
      const size_t job_floats = static_cast<size_t>((job.num_candidates + kPanel - 1) / kPanel) *
                                kPanel * job.keys.head_dim;
      if (end > begin && floats + job_floats > kBatchFloats) break;
      floats += job_floats;
      ++end;
    }
    if (packed.size() < end - begin) packed.resize(end - begin);
    pool.ParallelFor(
        static_cast<int64_t>(end - begin),
        [&](int64_t i) { PackCandidates(jobs[packed_jobs[begin + i]], packed[i]); }, max_parallel);
    tasks.clear();
    for (size_t i = begin; i < end; ++i) {
      for (int32_t e = 0; e < jobs[packed_jobs[i]].num_queries; e += kChunkRows) {
        tasks.emplace_back(i, e);
      }
    }
    pool.ParallelFor(
        static_cast<int64_t>(tasks.size()),
        [&](int64_t t) {
          const auto [i, first] = tasks[t];
          const NearestKeyJob& job = jobs[packed_jobs[i]];
          const int rows = std::min(kChunkRows, job.num_queries - first);
          if (avx512) {
            NearestChunk<PanelDotsAvx512>(job, packed[i - begin], first, rows);
          } else {
            NearestChunk<PanelDotsAvx2>(job, packed[i - begin], first, rows);
          }
        },
        max_parallel);
    begin = end;
  }
  return absl::OkStatus();
}

absl::Status RunMergeRows(absl::Span<const RowMergeJob> jobs, ThreadPool& pool) {
  uint64_t elements = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (auto status = ValidateRowMergeJob(jobs[i], i); !status.ok()) return status;
    if (jobs[i].rows > 0) {
      elements += static_cast<uint64_t>(jobs[i].source_starts[jobs[i].rows]) *
                  static_cast<uint64_t>(jobs[i].row_elements);
    }
  }
  // Rows write distinct rows and read none another row writes (gpu/backend.h): any order works.
  // Tasks of up to kRowsPerTask rows of one job.
  constexpr int64_t kRowsPerTask = 64;
  std::vector<std::pair<size_t, int64_t>> tasks;  // (job, first row)
  for (size_t i = 0; i < jobs.size(); ++i) {
    for (int64_t r = 0; r < jobs[i].rows; r += kRowsPerTask) tasks.emplace_back(i, r);
  }
  pool.ParallelFor(
      static_cast<int64_t>(tasks.size()),
      [&](int64_t t) {
        thread_local std::vector<float> sum;
        const RowMergeJob& job = jobs[tasks[t].first];
        const int64_t end = std::min(job.rows, tasks[t].second + kRowsPerTask);
        for (int64_t r = tasks[t].second; r < end; ++r) MergeRow(job, r, sum);
      },
      elements < kParallelMinMergeElements ? 1 : 0);
  return absl::OkStatus();
}

}  // namespace kvs
