// Dequantizing cache rows with SIMD, compiled once per Highway target (foreach_target re-includes
// this file): a vector of codes widened to fp32 (cpu/kernels/codes-inl.hpp), then one product
// with the group's scale, as the scalar definition (util/quantize.hpp).

// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/kernels/dequantize.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include "cpu/kernels/codes-inl.hpp"
// clang-format on

#include "cpu/kernels/dequantize.hpp"

#include <algorithm>

#include "util/quantize.hpp"

HWY_BEFORE_NAMESPACE();
namespace flashattn::detail::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

template <DType kDtype>
HWY_INLINE VF CodesToF32(const std::uint8_t* HWY_RESTRICT codes) {
  const DF df;
  if constexpr (kDtype == DType::int8) {
    return WidenInt8Codes(df, reinterpret_cast<const std::int8_t*>(codes));
  } else if constexpr (kDtype == DType::fp8_e4m3) {
    return WidenFp8E4M3Codes(df, codes);
  } else {
    return WidenFp8E5M2Codes(df, codes);
  }
}

template <DType kDtype>
HWY_INLINE void DequantizeGroups(float* HWY_RESTRICT dst, const std::uint8_t* HWY_RESTRICT codes,
                                 const float* scales, std::int64_t group_stride,
                                 std::int64_t group_dims, std::int64_t n) {
  const DF df;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(df));
  for (std::int64_t first = 0, g = 0; first < n; first += group_dims, ++g) {
    const std::int64_t last = std::min(first + group_dims, n);
    const float scale = scales[g * group_stride];
    const VF scale_v = hn::Set(df, scale);
    std::int64_t d = first;
    for (; d + N <= last; d += N) {
      hn::StoreU(hn::Mul(CodesToF32<kDtype>(codes + d), scale_v), df, dst + d);
    }
    // The tail of the group: the scalar definition.
    if (d < last) {
      detail::dequantize_row(dst + d, codes + d, kDtype, 0, &scale, 0, last - d, last - d);
    }
  }
}

void DequantizeRow(float* HWY_RESTRICT dst, const std::uint8_t* HWY_RESTRICT codes, DType dtype,
                   const float* scales, std::int64_t group_stride, std::int64_t group_dims,
                   std::int64_t n) {
  switch (dtype) {
    case DType::int8:
      return DequantizeGroups<DType::int8>(dst, codes, scales, group_stride, group_dims, n);
    case DType::fp8_e4m3:
      return DequantizeGroups<DType::fp8_e4m3>(dst, codes, scales, group_stride, group_dims, n);
    case DType::fp8_e5m2:
      return DequantizeGroups<DType::fp8_e5m2>(dst, codes, scales, group_stride, group_dims, n);
    default:
      HWY_ABORT("dequantize_row: %s is not a quantized dtype", dtype_name(dtype));
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace flashattn::detail::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace flashattn::detail::cpu {

HWY_EXPORT(DequantizeRow);

void dequantize_row(float* dst, const std::uint8_t* codes, DType dtype, const float* scales,
                    std::int64_t group_stride, std::int64_t group_dims, std::int64_t n) {
  HWY_DYNAMIC_DISPATCH(DequantizeRow)(dst, codes, dtype, scales, group_stride, group_dims, n);
}

}  // namespace flashattn::detail::cpu
#endif  // HWY_ONCE
