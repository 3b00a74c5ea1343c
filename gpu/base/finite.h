// Finiteness of stored K/V values, read from their bit patterns: a value is non-finite (NaN or
// +-inf) exactly when its exponent bits are all ones, in fp16, bf16 and fp32 alike. Working on
// the bits keeps the check exact (no conversion) and lets the compiler vectorise the scan.
//
// Used by the CPU backend's FindNonFinite (gpu/backend.h) over arena rows and by request
// validation over inline K/V bytes that have not reached an arena yet.
//
// Threading: pure functions.
#ifndef KVSIDECAR_GPU_BASE_FINITE_H_
#define KVSIDECAR_GPU_BASE_FINITE_H_

#include <cstdint>
#include <cstring>

#include "gpu/base/dtype.h"

namespace kvs {

namespace finite_internal {

// True when any of the n values at `data` has every exponent bit set. Branch-free over the
// whole run, so that it vectorises; the caller finds the exact element only when this says so.
template <typename Bits>
inline bool AnyExponentAllOnes(const uint8_t* data, int64_t n, Bits mask) {
  Bits any = 0;
  for (int64_t i = 0; i < n; ++i) {
    Bits bits;
    std::memcpy(&bits, data + i * static_cast<int64_t>(sizeof(Bits)), sizeof(Bits));
    any |= static_cast<Bits>((bits & mask) == mask);
  }
  return any != 0;
}

template <typename Bits>
inline int64_t FirstExponentAllOnes(const uint8_t* data, int64_t n, Bits mask) {
  // Runs of 256 values: the common all-finite case costs one vectorised pass.
  constexpr int64_t kRun = 256;
  for (int64_t begin = 0; begin < n; begin += kRun) {
    const int64_t len = n - begin < kRun ? n - begin : kRun;
    const uint8_t* run = data + begin * static_cast<int64_t>(sizeof(Bits));
    if (!AnyExponentAllOnes<Bits>(run, len, mask)) continue;
    for (int64_t i = 0; i < len; ++i) {
      Bits bits;
      std::memcpy(&bits, run + i * static_cast<int64_t>(sizeof(Bits)), sizeof(Bits));
      if ((bits & mask) == mask) return begin + i;
    }
  }
  return -1;
}

}  // namespace finite_internal

// The index of the first non-finite value among the `elements` values of `dtype` at `data`,
// or -1 when all are finite.
inline int64_t FirstNonFinite(const uint8_t* data, int64_t elements, DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return finite_internal::FirstExponentAllOnes<uint16_t>(data, elements, 0x7c00u);
    case DType::kBFloat16:
      return finite_internal::FirstExponentAllOnes<uint16_t>(data, elements, 0x7f80u);
    case DType::kFloat32:
      return finite_internal::FirstExponentAllOnes<uint32_t>(data, elements, 0x7f800000u);
  }
  return -1;
}

}  // namespace kvs

#endif  // KVSIDECAR_GPU_BASE_FINITE_H_
