#pragma once

// Rows of a quantized KV cache with SIMD (one Highway target per CPU), bit for bit the rows of
// util/quantize.hpp's scalar definitions (a NaN's payload aside): dequantized into fp32 rows that
// the decode's products read, and quantized from new rows (appends, quantize_kv).

#include <cstdint>

#include "flashattn/dtype.hpp"

namespace flashattn::detail::cpu {

// dst[0, n) = codes[0, n) of `dtype` (int8, fp8_e4m3, fp8_e5m2) times their group's scale,
// scales[g·group_stride] for dims [g·group_dims, (g + 1)·group_dims).
void dequantize_row(float* dst, const std::uint8_t* codes, DType dtype, const float* scales,
                    std::int64_t group_stride, std::int64_t group_dims, std::int64_t n);

// codes[0, n) = src[0, n) quantized to `dtype` group by group, as util/quantize.hpp's
// quantize_row (int8 writes each group's scale, fp8 reads it); SIMD for int8.
void quantize_row(std::uint8_t* codes, DType dtype, const float* src, float* scales,
                  std::int64_t group_stride, std::int64_t group_dims, std::int64_t n);

}  // namespace flashattn::detail::cpu
