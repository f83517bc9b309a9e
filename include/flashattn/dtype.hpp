#pragma once

// Element types of tensors, and exact scalar conversions between them and fp32:
// round-to-nearest-even, NaN and infinities preserved. The library's SIMD kernels convert whole
// rows in registers to the same floats.

#include <bit>
#include <cstddef>
#include <cstdint>

namespace flashattn {

enum class DType : std::uint8_t { f32, f16, bf16 };

constexpr std::size_t dtype_size(DType dtype) { return dtype == DType::f32 ? 4 : 2; }

constexpr const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return "f32";
    case DType::f16:
      return "f16";
    case DType::bf16:
      return "bf16";
  }
  return "unknown";
}

inline float f32_from_bf16(std::uint16_t bits) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

inline std::uint16_t bf16_from_f32(float value) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((bits >> 16) | 0x40u);
  const std::uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>((bits + rounding) >> 16);
}

inline float f32_from_f16(std::uint16_t half) {
  const std::uint32_t sign = static_cast<std::uint32_t>(half & 0x8000u) << 16;
  const std::uint32_t exponent = (half >> 10) & 0x1fu;
  const std::uint32_t mantissa = half & 0x3ffu;
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    // Zero or subnormal: value = mantissa * 2^-24, exact in fp32.
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return sign ? -magnitude : magnitude;
  }
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline std::uint16_t f16_from_f32(float value) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  const std::uint16_t sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  const std::uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;  // rounds to infinity
  if (magnitude < 0x38800000u) {                        // subnormal half or zero
    // Scale so that one half-subnormal ulp (2^-24) is 1.0, then round to nearest even.
    const float scaled = std::bit_cast<float>(magnitude) * 0x1p24f;
    const float rounded = scaled + 0x1p23f - 0x1p23f;  // exact RNE for scaled < 2^23
    return sign | static_cast<std::uint16_t>(rounded);
  }
  const std::uint32_t rounding = 0xfffu + ((magnitude >> 13) & 1u);
  return sign | static_cast<std::uint16_t>((magnitude - 0x38000000u + rounding) >> 13);
}

// Element `index` of a buffer of `dtype` elements, as fp32.
inline float load_f32(const void* base, DType dtype, std::int64_t index) {
  switch (dtype) {
    case DType::f32:
      return static_cast<const float*>(base)[index];
    case DType::f16:
      return f32_from_f16(static_cast<const std::uint16_t*>(base)[index]);
    case DType::bf16:
      return f32_from_bf16(static_cast<const std::uint16_t*>(base)[index]);
  }
  return 0.0f;
}

// Element `index` of a buffer of `dtype` elements = `value` rounded to dtype.
inline void store_f32(void* base, DType dtype, std::int64_t index, float value) {
  switch (dtype) {
    case DType::f32:
      static_cast<float*>(base)[index] = value;
      return;
    case DType::f16:
      static_cast<std::uint16_t*>(base)[index] = f16_from_f32(value);
      return;
    case DType::bf16:
      static_cast<std::uint16_t*>(base)[index] = bf16_from_f32(value);
      return;
  }
}

}  // namespace flashattn
