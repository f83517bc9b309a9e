#pragma once

// Rows of a quantized KV cache (flashattn/dtype.hpp's cache dtypes, flashattn/kvcache.hpp's
// scales): a row of n dims is split into groups of group_dims, group g's scale at
// scales[g·group_stride], and value d = code d · scale of its group.

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "flashattn/dtype.hpp"

namespace flashattn::detail {

// dst[0, n) = the values of the quantized row at element `offset` of `cache`, as fp32: code ·
// scale rounded once (the code is exact in fp32).
inline void dequantize_row(float* dst, const void* cache, DType dtype, std::int64_t offset,
                           const float* scales, std::int64_t group_stride, std::int64_t group_dims,
                           std::int64_t n) {
  const auto* codes = static_cast<const std::uint8_t*>(cache) + offset;
  for (std::int64_t first = 0, g = 0; first < n; first += group_dims, ++g) {
    const float scale = scales[g * group_stride];
    const std::int64_t last = std::min(first + group_dims, n);
    switch (dtype) {
      case DType::int8:
        for (std::int64_t d = first; d < last; ++d) {
          dst[d] = static_cast<float>(static_cast<std::int8_t>(codes[d])) * scale;
        }
        break;
      case DType::fp8_e4m3:
        for (std::int64_t d = first; d < last; ++d) dst[d] = f32_from_fp8_e4m3(codes[d]) * scale;
        break;
      case DType::fp8_e5m2:
        for (std::int64_t d = first; d < last; ++d) dst[d] = f32_from_fp8_e5m2(codes[d]) * scale;
        break;
      default:
        break;
    }
  }
}

// The row src[0, n) quantized into element `offset` of `cache`, group by group:
//   int8  scale = max |x| / 127 over the group, written to the group's scale; code =
//         round(x / scale), ties to even, within [-127, 127]. An all-zero group gets scale 0
//         and codes 0; a group holding a NaN or an infinity scale NaN and codes 0, so that the
//         whole group reads NaN.
//   fp8   the group's scale read; code = x / scale rounded to the format, ties to even, beyond
//         its largest finite value (infinities too) saturating to it, NaN kept NaN.
inline void quantize_row(void* cache, DType dtype, std::int64_t offset, const float* src,
                         float* scales, std::int64_t group_stride, std::int64_t group_dims,
                         std::int64_t n) {
  for (std::int64_t first = 0, g = 0; first < n; first += group_dims, ++g) {
    const std::int64_t last = std::min(first + group_dims, n);
    float scale = scales[g * group_stride];
    if (dtype == DType::int8) {
      float largest = 0.0f;
      bool finite = true;
      for (std::int64_t d = first; d < last; ++d) {
        finite = finite && std::isfinite(src[d]);
        largest = std::max(largest, std::fabs(src[d]));
      }
      scale = finite ? largest / 127.0f : std::nanf("");
      scales[g * group_stride] = scale;
      auto* codes = static_cast<std::int8_t*>(cache) + offset;
      for (std::int64_t d = first; d < last; ++d) {
        codes[d] = finite && scale > 0.0f ? int8_from_f32(src[d] / scale) : std::int8_t{0};
      }
      continue;
    }
    for (std::int64_t d = first; d < last; ++d) store_f32(cache, dtype, offset + d, src[d] / scale);
  }
}

}  // namespace flashattn::detail
