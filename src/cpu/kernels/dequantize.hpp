#pragma once

// Rows of a quantized KV cache dequantized with SIMD (one Highway target per CPU): the floats of
// util/quantize.hpp's dequantize_row bit for bit (a NaN's payload aside), which the decode's
// products then read as fp32 rows.

#include <cstdint>

#include "flashattn/dtype.hpp"

namespace flashattn::detail::cpu {

// dst[0, n) = codes[0, n) of `dtype` (int8, fp8_e4m3, fp8_e5m2) times their group's scale,
// scales[g·group_stride] for dims [g·group_dims, (g + 1)·group_dims).
void dequantize_row(float* dst, const std::uint8_t* codes, DType dtype, const float* scales,
                    std::int64_t group_stride, std::int64_t group_dims, std::int64_t n);

}  // namespace flashattn::detail::cpu
