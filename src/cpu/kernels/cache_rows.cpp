// Quantized cache rows with SIMD, compiled once per Highway target (foreach_target re-includes
// this file), as the scalar definitions of util/quantize.hpp:
//   dequantizing: a vector of codes widened to fp32 (cpu/kernels/codes-inl.hpp), then one
//                 product with the group's scale;
//   quantizing to int8: the group's max |x| and finiteness over vectors, the scale in scalar
//                 arithmetic as the definition computes it, then x / scale clamped to ±127 and
//                 rounded to nearest even per lane (IEEE division and rounding: the same codes).

// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/kernels/cache_rows.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include "cpu/kernels/codes-inl.hpp"
// clang-format on

#include "cpu/kernels/cache_rows.hpp"

#include <algorithm>
#include <cmath>

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

// One int8 group: src[0, n) into codes[0, n) and *scale.
HWY_INLINE void QuantizeInt8Group(std::int8_t* HWY_RESTRICT codes, const float* HWY_RESTRICT src,
                                  float* scale, std::int64_t n) {
  const DF df;
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<std::int8_t, DF> d8;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(df));
  VF largest = hn::Zero(df);
  auto finite = hn::FirstN(df, N);
  std::int64_t d = 0;
  for (; d + N <= n; d += N) {
    const VF x = hn::LoadU(df, src + d);
    finite = hn::And(finite, hn::IsFinite(x));
    largest = hn::Max(largest, hn::Abs(x));
  }
  float group_max = hn::GetLane(hn::MaxOfLanes(df, largest));
  bool group_finite = hn::AllTrue(df, finite);
  for (std::int64_t e = d; e < n; ++e) {
    group_finite = group_finite && std::isfinite(src[e]);
    group_max = std::max(group_max, std::fabs(src[e]));
  }
  if (!group_finite || !(group_max / 127.0f > 0.0f)) {
    // A group of zeros, or one holding a NaN or an infinity: the scalar definition.
    detail::quantize_row(codes, DType::int8, 0, src, scale, 0, n, n);
    return;
  }
  *scale = group_max / 127.0f;
  const VF divisor = hn::Set(df, *scale), bound = hn::Set(df, 127.0f);
  for (d = 0; d + N <= n; d += N) {
    const VF x = hn::Div(hn::LoadU(df, src + d), divisor);
    const VF clamped = hn::Min(hn::Max(x, hn::Neg(bound)), bound);
    hn::StoreU(hn::DemoteTo(d8, hn::ConvertTo(di, hn::Round(clamped))), d8, codes + d);
  }
  for (; d < n; ++d) codes[d] = int8_from_f32(src[d] / *scale);
}

void QuantizeRow(std::uint8_t* HWY_RESTRICT codes, DType dtype, const float* HWY_RESTRICT src,
                 float* scales, std::int64_t group_stride, std::int64_t group_dims,
                 std::int64_t n) {
  if (dtype != DType::int8) {
    return detail::quantize_row(codes, dtype, 0, src, scales, group_stride, group_dims, n);
  }
  for (std::int64_t first = 0, g = 0; first < n; first += group_dims, ++g) {
    QuantizeInt8Group(reinterpret_cast<std::int8_t*>(codes) + first, src + first,
                      scales + g * group_stride, std::min(group_dims, n - first));
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
HWY_EXPORT(QuantizeRow);

void quantize_row(std::uint8_t* codes, DType dtype, const float* src, float* scales,
                  std::int64_t group_stride, std::int64_t group_dims, std::int64_t n) {
  HWY_DYNAMIC_DISPATCH(QuantizeRow)(codes, dtype, src, scales, group_stride, group_dims, n);
}

void dequantize_row(float* dst, const std::uint8_t* codes, DType dtype, const float* scales,
                    std::int64_t group_stride, std::int64_t group_dims, std::int64_t n) {
  HWY_DYNAMIC_DISPATCH(DequantizeRow)(dst, codes, dtype, scales, group_stride, group_dims, n);
}

}  // namespace flashattn::detail::cpu
#endif  // HWY_ONCE
