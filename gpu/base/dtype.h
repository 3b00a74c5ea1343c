// Storage dtypes of K/V and scalar conversions to and from fp32 (the accumulation type).
// Header-only, pure; the SIMD paths live in the backends.
#ifndef KVSIDECAR_GPU_BASE_DTYPE_H_
#define KVSIDECAR_GPU_BASE_DTYPE_H_

#include <cstdint>
#include <cstring>
#include <string_view>

namespace kvs {

enum class DType : uint8_t { kFloat16 = 1, kBFloat16 = 2, kFloat32 = 3 };

constexpr int DTypeBytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

constexpr std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat32: return "float32";
  }
  return "unknown";
}

inline float BFloat16ToFloat(uint16_t bits) {
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float result;
  std::memcpy(&result, &wide, sizeof(result));
  return result;
}

// Round to nearest even; NaN stays NaN.
inline uint16_t FloatToBFloat16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float Float16ToFloat(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  uint32_t exponent = (bits >> 10) & 0x1fu;
  uint32_t mantissa = bits & 0x3ffu;
  uint32_t result_bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      result_bits = sign;
    } else {  // subnormal: renormalise
      exponent = 127 - 15 + 1;
      while ((mantissa & 0x400u) == 0) {
        mantissa <<= 1;
        --exponent;
      }
      mantissa &= 0x3ffu;
      result_bits = sign | (exponent << 23) | (mantissa << 13);
    }
  } else if (exponent == 0x1f) {
    result_bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    result_bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  }
  float result;
  std::memcpy(&result, &result_bits, sizeof(result));
  return result;
}

// Round to nearest even, overflow to infinity, NaN stays NaN.
inline uint16_t FloatToFloat16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs_bits = bits & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return sign | 0x7e00u;             // NaN
  if (abs_bits >= 0x477ff000u) return sign | 0x7c00u;            // overflow -> inf
  if (abs_bits < 0x38800000u) {                                  // subnormal or zero
    if (abs_bits < 0x33000000u) return sign;                     // rounds to 0
    const uint32_t exponent = abs_bits >> 23;
    const uint32_t mantissa = (abs_bits & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exponent;                       // 14..24
    uint32_t half = mantissa >> shift;
    const uint32_t remainder = mantissa & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (remainder > halfway || (remainder == halfway && (half & 1u))) ++half;
    return sign | static_cast<uint16_t>(half);
  }
  uint32_t rounded = abs_bits + 0xfffu + ((abs_bits >> 13) & 1u);
  return sign | static_cast<uint16_t>((rounded - 0x38000000u) >> 13);
}

// Reads element `index` of a buffer of `dtype` as fp32.
inline float LoadAsFloat(const void* data, DType dtype, int64_t index) {
  switch (dtype) {
    case DType::kFloat16: return Float16ToFloat(static_cast<const uint16_t*>(data)[index]);
    case DType::kBFloat16: return BFloat16ToFloat(static_cast<const uint16_t*>(data)[index]);
    case DType::kFloat32: return static_cast<const float*>(data)[index];
  }
  return 0.0f;
}

inline void StoreFromFloat(void* data, DType dtype, int64_t index, float value) {
  switch (dtype) {
    case DType::kFloat16: static_cast<uint16_t*>(data)[index] = FloatToFloat16(value); return;
    case DType::kBFloat16: static_cast<uint16_t*>(data)[index] = FloatToBFloat16(value); return;
    case DType::kFloat32: static_cast<float*>(data)[index] = value; return;
  }
}

}  // namespace kvs

#endif  // KVSIDECAR_GPU_BASE_DTYPE_H_
