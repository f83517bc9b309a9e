#pragma once

// Row conversions between the storage dtypes and fp32, with SIMD where the CPU has it
// (util/widen.cpp). The scalar conversions are public: flashattn/dtype.hpp.

#include <cstdint>
#include <cstring>

#include "flashattn/dtype.hpp"
#include "util/memory_hints.hpp"

namespace flashattn::detail {

// dst[0, n) = src[0, n) of an f16 (dtype f16) or bf16 (dtype bf16) row widened to fp32, with
// SIMD where the CPU has it (util/widen.cpp); exactly the floats of f32_from_f16/bf16.
void widen_row(float* dst, const std::uint16_t* src, DType dtype, std::int64_t n);

// dst[0, n) = bf16_from_f32(src[0, n)), with SIMD where the CPU has it (util/widen.cpp).
void narrow_row_bf16(std::uint16_t* dst, const float* src, std::int64_t n);

// dst[0, n) = src[offset, offset + n) widened to fp32.
inline void load_row_f32(float* dst, const void* src, DType dtype, std::int64_t offset,
                         std::int64_t n) {
  if (dtype == DType::f32) {
    std::memcpy(dst, static_cast<const float*>(src) + offset, sizeof(float) * n);
    return;
  }
  widen_row(dst, static_cast<const std::uint16_t*>(src) + offset, dtype, n);
}

// dst[offset, offset + n) = src[0, n) rounded to dtype.
inline void store_row_f32(void* dst, DType dtype, std::int64_t offset, const float* src,
                          std::int64_t n) {
  if (dtype == DType::f32) {
    std::memcpy(static_cast<float*>(dst) + offset, src, sizeof(float) * n);
    return;
  }
  if (dtype == DType::bf16) {
    narrow_row_bf16(static_cast<std::uint16_t*>(dst) + offset, src, n);
    return;
  }
  for (std::int64_t i = 0; i < n; ++i) store_f32(dst, dtype, offset + i, src[i]);
}

// As store_row_f32, with non-temporal stores for f32 (stream_row_f32) and bf16
// (stream_row_bf16) when `stream`.
inline void store_row_f32(void* dst, DType dtype, std::int64_t offset, const float* src,
                          std::int64_t n, bool stream) {
  if (streams_rows(dtype, stream)) {
    if (dtype == DType::f32) {
      stream_row_f32(static_cast<float*>(dst) + offset, src, n);
    } else {
      stream_row_bf16(static_cast<std::uint16_t*>(dst) + offset, src, n);
    }
    return;
  }
  store_row_f32(dst, dtype, offset, src, n);
}

}  // namespace flashattn::detail
