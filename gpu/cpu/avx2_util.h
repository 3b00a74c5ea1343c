// AVX2 building blocks the CPU kernels share: the function attribute that enables AVX2, FMA and
// F16C for one function (the rest of the binary stays baseline x86-64; callers pick the AVX2 path
// at run time with CpuSupportsAvx2()), loads of 8 elements of any storage dtype as fp32, and a
// horizontal sum.
//
// Threading: pure functions.
#ifndef KVSIDECAR_GPU_CPU_AVX2_UTIL_H_
#define KVSIDECAR_GPU_CPU_AVX2_UTIL_H_

#include <immintrin.h>

#include <cstdint>

#include "gpu/base/dtype.h"

#define KVS_AVX2 __attribute__((target("avx2,fma,f16c")))

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

KVS_AVX2 inline float HorizontalSum(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
  return _mm_cvtss_f32(sum);
}

}  // namespace kvs::avx2

#endif  // KVSIDECAR_GPU_CPU_AVX2_UTIL_H_
