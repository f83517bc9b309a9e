#pragma once

// Element types of tensors, and exact scalar conversions between them and fp32:
// round-to-nearest-even, NaN and infinities preserved. The library's SIMD kernels convert whole
// rows in registers to the same floats.

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>

namespace flashattn {

// f32, f16 and bf16 are the compute dtypes: q, k, v, out and every gradient take them. int8,
// fp8_e4m3 and fp8_e5m2 are cache dtypes: a KV cache (flashattn/kvcache.hpp) stores codes that
// times an fp32 scale are its values, and only the paths that read a cache take them.
//   int8       two's complement codes in [-127, 127] (quantized symmetric: -128 is never stored)
//   fp8_e4m3   OCP E4M3 as torch.float8_e4m3fn: bias 7, no infinities, S.1111.111 NaN, max 448
//   fp8_e5m2   OCP E5M2 as torch.float8_e5m2: bias 15, infinities and NaNs as IEEE, max 57344
enum class DType : std::uint8_t { f32, f16, bf16, int8, fp8_e4m3, fp8_e5m2 };

// What the library knows of a dtype: the one table every path asks.
struct DTypeTraits {
  const char* name;
  std::size_t bytes;  // per element
  // Whether elements are codes of a quantized cache, values only with their scales.
  bool quantized;
  // Largest finite code of a quantized dtype (0 for the compute dtypes): a value scaled into the
  // cache saturates there.
  float max_code;
  // Significand bits of a floating-point dtype, the implicit one included (unit roundoff
  // 2^-significand_bits); 0 for int8.
  int significand_bits;
};

constexpr DTypeTraits dtype_traits(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return {"f32", 4, false, 0.0f, 24};
    case DType::f16:
      return {"f16", 2, false, 0.0f, 11};
    case DType::bf16:
      return {"bf16", 2, false, 0.0f, 8};
    case DType::int8:
      return {"int8", 1, true, 127.0f, 0};
    case DType::fp8_e4m3:
      return {"fp8_e4m3", 1, true, 448.0f, 4};
    case DType::fp8_e5m2:
      return {"fp8_e5m2", 1, true, 57344.0f, 3};
  }
  return {"unknown", 1, false, 0.0f, 0};
}

constexpr std::size_t dtype_size(DType dtype) { return dtype_traits(dtype).bytes; }
constexpr const char* dtype_name(DType dtype) { return dtype_traits(dtype).name; }
constexpr bool is_quantized(DType dtype) { return dtype_traits(dtype).quantized; }

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

// fp8 codes (dtype.hpp's DType comment) as fp32, exactly.
inline float f32_from_fp8_e4m3(std::uint8_t code) {
  const float sign = (code & 0x80u) ? -1.0f : 1.0f;
  const unsigned exponent = (code >> 3) & 0xfu, mantissa = code & 0x7u;
  if (exponent == 0xf && mantissa == 0x7) return std::nanf("");
  if (exponent == 0) return sign * static_cast<float>(mantissa) * 0x1p-9f;
  return sign *
         std::ldexp(1.0f + static_cast<float>(mantissa) * 0.125f, static_cast<int>(exponent) - 7);
}

inline float f32_from_fp8_e5m2(std::uint8_t code) {
  return f32_from_f16(static_cast<std::uint16_t>(code << 8));
}

// fp32 to the nearest code of a format with `mantissa_bits` and exponent bias `bias` whose
// largest finite value is `max`, ties to even; beyond max (infinities too) saturating to ±max,
// NaN to `nan_code`. The code's bits are sign, exponent, mantissa as E4M3's and E5M2's.
inline std::uint8_t fp8_from_f32(float value, int mantissa_bits, int bias, float max,
                                 std::uint8_t nan_code) {
  if (std::isnan(value)) return nan_code;
  const std::uint8_t sign = std::signbit(value) ? 0x80u : 0x00u;
  float magnitude = std::fabs(value);
  if (magnitude >= max) magnitude = max;
  // The spacing of codes at this magnitude: that of the binade, or the subnormals'.
  const int min_exponent = 1 - bias;
  int exponent = magnitude == 0.0f ? min_exponent : std::ilogb(magnitude);
  if (exponent < min_exponent) exponent = min_exponent;
  const float spacing = std::ldexp(1.0f, exponent - mantissa_bits);
  // Exact: magnitude / spacing < 2^(mantissa_bits + 1), and nearbyint rounds ties to even.
  float units = std::nearbyint(magnitude / spacing);
  if (units >= std::ldexp(1.0f, mantissa_bits + 1)) {  // rounded up into the next binade
    units = std::ldexp(1.0f, mantissa_bits);
    ++exponent;
  }
  const bool normal = units >= std::ldexp(1.0f, mantissa_bits);
  const unsigned biased = normal ? static_cast<unsigned>(exponent + bias) : 0u;
  const unsigned mantissa =
      static_cast<unsigned>(units) & ((1u << static_cast<unsigned>(mantissa_bits)) - 1u);
  return static_cast<std::uint8_t>(sign | (biased << mantissa_bits) | mantissa);
}
inline std::uint8_t fp8_e4m3_from_f32(float value) {
  return fp8_from_f32(value, 3, 7, 448.0f, 0x7f);
}
inline std::uint8_t fp8_e5m2_from_f32(float value) {
  return fp8_from_f32(value, 2, 15, 57344.0f, 0x7e);
}

// An int8 code: value rounded to the nearest integer, ties to even, saturating to ±127; NaN
// (which the quantizer never hands it) to 0.
inline std::int8_t int8_from_f32(float value) {
  if (!(value == value)) return 0;
  const float clamped = value < -127.0f ? -127.0f : (value > 127.0f ? 127.0f : value);
  return static_cast<std::int8_t>(std::nearbyint(clamped));
}

// Element `index` of a buffer of `dtype` elements, as fp32 (a quantized dtype's code, unscaled).
inline float load_f32(const void* base, DType dtype, std::int64_t index) {
  switch (dtype) {
    case DType::f32:
      return static_cast<const float*>(base)[index];
    case DType::f16:
      return f32_from_f16(static_cast<const std::uint16_t*>(base)[index]);
    case DType::bf16:
      return f32_from_bf16(static_cast<const std::uint16_t*>(base)[index]);
    case DType::int8:
      return static_cast<const std::int8_t*>(base)[index];
    case DType::fp8_e4m3:
      return f32_from_fp8_e4m3(static_cast<const std::uint8_t*>(base)[index]);
    case DType::fp8_e5m2:
      return f32_from_fp8_e5m2(static_cast<const std::uint8_t*>(base)[index]);
  }
  return 0.0f;
}

// Element `index` of a buffer of `dtype` elements = `value` rounded to dtype (a quantized
// dtype's code: `value` already divided by its scale, saturating).
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
    case DType::int8:
      static_cast<std::int8_t*>(base)[index] = int8_from_f32(value);
      return;
    case DType::fp8_e4m3:
      static_cast<std::uint8_t*>(base)[index] = fp8_e4m3_from_f32(value);
      return;
    case DType::fp8_e5m2:
      static_cast<std::uint8_t*>(base)[index] = fp8_e5m2_from_f32(value);
      return;
  }
}

}  // namespace flashattn
