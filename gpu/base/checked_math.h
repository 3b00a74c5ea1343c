// Overflow-safe arithmetic for validating sizes before memory is touched. Header-only, pure.
#ifndef KVSIDECAR_GPU_BASE_CHECKED_MATH_H_
#define KVSIDECAR_GPU_BASE_CHECKED_MATH_H_

#include <cstdint>
#include <initializer_list>
#include <optional>

namespace kvs {

// Product of non-negative factors, or nullopt if any is negative or the product overflows.
inline std::optional<uint64_t> CheckedProduct(std::initializer_list<int64_t> factors) {
  uint64_t result = 1;
  for (int64_t factor : factors) {
    if (factor < 0) return std::nullopt;
    if (__builtin_mul_overflow(result, static_cast<uint64_t>(factor), &result)) {
      return std::nullopt;
    }
  }
  return result;
}

inline std::optional<uint64_t> CheckedAdd(uint64_t a, uint64_t b) {
  uint64_t result;
  if (__builtin_add_overflow(a, b, &result)) return std::nullopt;
  return result;
}

}  // namespace kvs

#endif  // KVSIDECAR_GPU_BASE_CHECKED_MATH_H_
