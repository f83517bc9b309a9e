// f16 and bf16 rows widened to fp32 with SIMD (F16C and AVX-512 conversions where the CPU has
// them), compiled once per Highway target and dispatched at run time. Widening is exact, so every
// target gives the same floats as the scalar f32_from_f16 / f32_from_bf16, whose f16 path takes
// ~10 integer operations and branches per element (docs/tuning.md).

// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "util/widen.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
// clang-format on

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "util/convert.hpp"

HWY_BEFORE_NAMESPACE();
namespace flashattn::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

template <class Half>
HWY_INLINE void WidenWith(float* HWY_RESTRICT dst, const std::uint16_t* HWY_RESTRICT src,
                          std::int64_t n, float (*widen_one)(std::uint16_t)) {
  const hn::ScalableTag<float> df;
  const hn::Rebind<Half, decltype(df)> dh;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(df));
  const Half* HWY_RESTRICT half = reinterpret_cast<const Half*>(src);
  std::int64_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::PromoteTo(df, hn::LoadU(dh, half + i)), df, dst + i);
  for (; i < n; ++i) dst[i] = widen_one(src[i]);
}

void WidenRow(float* HWY_RESTRICT dst, const std::uint16_t* HWY_RESTRICT src, std::int64_t n,
              bool is_f16) {
  if (!is_f16) {
    WidenWith<hwy::bfloat16_t>(dst, src, n, f32_from_bf16);
    return;
  }
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
  // F16C (part of Highway's AVX2 and AVX-512 targets) converts in hardware.
  WidenWith<hwy::float16_t>(dst, src, n, f32_from_f16);
#else
  // Highway 1.0's emulated f16 -> f32 on the other targets turns infinities and NaNs into
  // 65536 and larger finite values (tests/test_widen.cpp caught it): scalar there.
  for (std::int64_t i = 0; i < n; ++i) dst[i] = f32_from_f16(src[i]);
#endif
}

// bf16_from_f32 of the lanes of `values` (float lanes, any width), in integer operations
// (Highway 1.0's DemoteTo to bf16 does not round to nearest even on every target): the upper 16
// bits rounded to nearest even, NaN kept NaN (quieted), as u16 lanes.
template <class DF>
HWY_INLINE auto RoundToBf16(DF /*df*/, hn::Vec<DF> values) {
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<std::uint16_t, DF> dh;
  const auto magnitude_mask = hn::Set(du, 0x7fffffffu), infinity = hn::Set(du, 0x7f800000u);
  const auto half_ulp = hn::Set(du, 0x7fffu), one = hn::Set(du, 1u), quiet = hn::Set(du, 0x40u);
  const auto bits = hn::BitCast(du, values);
  const auto upper = hn::ShiftRight<16>(bits);
  const auto rounded = hn::ShiftRight<16>(hn::Add(bits, hn::Add(half_ulp, hn::And(upper, one))));
  const auto is_nan = hn::Gt(hn::And(bits, magnitude_mask), infinity);
  return hn::DemoteTo(dh, hn::BitCast(di, hn::IfThenElse(is_nan, hn::Or(upper, quiet), rounded)));
}

// The bf16 output rows of the flash forward, which element by element cost a visible share of
// its time once the products ran on AMX (docs/tuning.md).
void NarrowRowBf16(std::uint16_t* HWY_RESTRICT dst, const float* HWY_RESTRICT src, std::int64_t n) {
  const hn::ScalableTag<float> df;
  const hn::Rebind<std::uint16_t, decltype(df)> dh;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(df));
  std::int64_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(RoundToBf16(df, hn::LoadU(df, src + i)), dh, dst + i);
  for (; i < n; ++i) dst[i] = bf16_from_f32(src[i]);
}

// dst[begin, end) = src[begin, end) with non-temporal stores of 4 floats where dst is 16-byte
// aligned, plain stores elsewhere.
HWY_INLINE void StreamPart(float* HWY_RESTRICT dst, const float* HWY_RESTRICT src,
                           std::int64_t begin, std::int64_t end) {
  const hn::CappedTag<float, 4> d4;
  const std::int64_t N4 = static_cast<std::int64_t>(hn::Lanes(d4));
  const auto aligned = [&](std::int64_t i) {
    return reinterpret_cast<std::uintptr_t>(dst + i) % (N4 * sizeof(float)) == 0;
  };
  std::int64_t i = begin;
  for (; i < end && !aligned(i); ++i) dst[i] = src[i];
  for (; i + N4 <= end; i += N4) hn::Stream(hn::LoadU(d4, src + i), d4, dst + i);
  for (; i < end; ++i) dst[i] = src[i];
}

// Non-temporal stores of whole vectors from the first vector-aligned element on. Before it and
// in the tail, lines that the row shares with its neighbours: those take narrower non-temporal
// stores where dst is 16-byte aligned. Written with plain stores, each was read first, on rows
// that start 16 bytes into a line (a std::vector's, numpy's) (docs/tuning.md).
void StreamRowF32(float* HWY_RESTRICT dst, const float* HWY_RESTRICT src, std::int64_t n) {
  const hn::ScalableTag<float> df;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(df));
  const std::int64_t misaligned =
      static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(dst) % (N * sizeof(float)));
  std::int64_t i = std::min<std::int64_t>(
      n, misaligned % sizeof(float) != 0 ? n : (N - misaligned / sizeof(float)) % N);
  StreamPart(dst, src, 0, i);
  for (; i + N <= n; i += N) hn::Stream(hn::LoadU(df, src + i), df, dst + i);
  StreamPart(dst, src, i, n);
}

// As NarrowRowBf16, with non-temporal stores of 8 bf16 (16 bytes) from the first 16-byte aligned
// element on; the elements before it and the tail go through NarrowRowBf16 (plain stores).
void StreamRowBf16(std::uint16_t* HWY_RESTRICT dst, const float* HWY_RESTRICT src, std::int64_t n) {
  const hn::CappedTag<float, 8> df;
  const hn::Rebind<std::uint16_t, decltype(df)> dh;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(df));
  constexpr std::int64_t kStoreBytes = 16;
  std::int64_t i = 0;
  if (N * static_cast<std::int64_t>(sizeof(std::uint16_t)) == kStoreBytes) {
    const auto misaligned =
        static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(dst) % kStoreBytes);
    if (misaligned % sizeof(std::uint16_t) == 0) {
      i = std::min<std::int64_t>(n,
                                 (kStoreBytes - misaligned) % kStoreBytes / sizeof(std::uint16_t));
      NarrowRowBf16(dst, src, i);
      for (; i + N <= n; i += N) {
        hn::Stream(RoundToBf16(df, hn::LoadU(df, src + i)), dh, dst + i);
      }
    }
  }
  NarrowRowBf16(dst + i, src + i, n - i);
}

void FenceStreams() {
#if HWY_ARCH_X86
  _mm_sfence();
#endif
}

}  // namespace HWY_NAMESPACE
}  // namespace flashattn::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace flashattn::detail {

HWY_EXPORT(WidenRow);
HWY_EXPORT(NarrowRowBf16);
HWY_EXPORT(StreamRowF32);
HWY_EXPORT(StreamRowBf16);
HWY_EXPORT(FenceStreams);

void widen_row(float* dst, const std::uint16_t* src, DType dtype, std::int64_t n) {
  HWY_DYNAMIC_DISPATCH(WidenRow)(dst, src, n, dtype == DType::f16);
}

void narrow_row_bf16(std::uint16_t* dst, const float* src, std::int64_t n) {
  HWY_DYNAMIC_DISPATCH(NarrowRowBf16)(dst, src, n);
}

void stream_row_f32(float* dst, const float* src, std::int64_t n) {
  HWY_DYNAMIC_DISPATCH(StreamRowF32)(dst, src, n);
}

void stream_row_bf16(std::uint16_t* dst, const float* src, std::int64_t n) {
  HWY_DYNAMIC_DISPATCH(StreamRowBf16)(dst, src, n);
}

void fence_streams() { HWY_DYNAMIC_DISPATCH(FenceStreams)(); }

}  // namespace flashattn::detail
#endif  // HWY_ONCE
