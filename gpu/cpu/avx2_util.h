// AVX2 building blocks the CPU kernels share: the function attribute that enables AVX2, FMA and
// F16C for one function (the rest of the binary stays baseline x86-64; callers pick the AVX2 path
// at run time with CpuSupportsAvx2()), loads of 8 elements of any storage dtype as fp32, and a
// horizontal sum (of one vector, or of four at once), and an 8 x 8 transpose.
//
// Threading: pure functions.
#ifndef KVSIDECAR_GPU_CPU_AVX2_UTIL_H_
#define KVSIDECAR_GPU_CPU_AVX2_UTIL_H_

#include <immintrin.h>

#include <cstdint>

#include "gpu/base/dtype.h"
#include "gpu/cpu/cpu_isa.h"

#define KVS_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace kvs {

// True when the kernels may run KVS_AVX2 code (AVX2, FMA and F16C): the CPU has it and
// KVS_CPU_ISA does not cap the process below it (gpu/cpu/cpu_isa.h, the one detection).
inline bool CpuSupportsAvx2() { return DetectedCpuIsa() >= CpuIsa::kAvx2; }

}  // namespace kvs

namespace kvs::avx2 {

// Eight consecutive elements of dtype kType at `p`, as fp32.
template <DType kType>
KVS_AVX2 inline __m256 Load8(const uint8_t* p) {
  if constexpr (kType == DType::kFloat16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else if constexpr (kType == DType::kBFloat16) {
    const __m256i wide =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  } else {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  }
}

// r[i] <- (r[0][i], r[1][i], ..., r[7][i]): an 8 x 8 transpose in registers.
KVS_AVX2 inline void Transpose8x8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// Lane i of the result = the horizontal sum of a_i, ((0+1)+(2+3)) + ((4+5)+(6+7)) for every i:
// four dot products finished at once, always in the same order.
KVS_AVX2 inline __m128 HorizontalSum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

KVS_AVX2 inline float HorizontalSum(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
  return _mm_cvtss_f32(sum);
}

}  // namespace kvs::avx2

#endif  // KVSIDECAR_GPU_CPU_AVX2_UTIL_H_
