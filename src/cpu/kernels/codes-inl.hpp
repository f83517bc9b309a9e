// Quantized cache codes (flashattn/dtype.hpp) widened to fp32 lanes in registers, exactly and
// unscaled, for the SIMD kernels of every Highway target (a per-target header: included from a
// file that foreach_target re-includes). Where the CPU converts halves in registers (F16C) fp8
// codes go through a half: E5M2 is a half's top byte, E4M3 a half 2^-8 times its value. Elsewhere
// they become fp32 bit patterns by integer arithmetic (normal codes: exponent and mantissa moved
// into fp32's, the exponent rebiased; subnormal codes: the mantissa converted and scaled; then
// the specials and the sign), so that a denormals-are-zero mode cannot change them.

// Per-target include guard (Highway's convention for -inl headers).
#if defined(FLASHATTN_CPU_KERNELS_CODES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FLASHATTN_CPU_KERNELS_CODES_INL_H_
#undef FLASHATTN_CPU_KERNELS_CODES_INL_H_
#else
#define FLASHATTN_CPU_KERNELS_CODES_INL_H_
#endif

#include <hwy/highway.h>

#include <cstdint>

HWY_BEFORE_NAMESPACE();
namespace flashattn::detail::cpu {
namespace HWY_NAMESPACE {
namespace codes_hn = hwy::HWY_NAMESPACE;

// One vector of int8 codes at `codes` as fp32.
template <class DF>
HWY_INLINE codes_hn::VFromD<DF> WidenInt8Codes(DF df, const std::int8_t* HWY_RESTRICT codes) {
  const codes_hn::RebindToSigned<DF> di;
  return codes_hn::ConvertTo(
      df, codes_hn::PromoteTo(di, codes_hn::LoadU(codes_hn::Rebind<std::int8_t, DF>(), codes)));
}

// fp8 codes (as 32-bit lanes) of a format with kMantissa mantissa bits and exponent bias kBias
// as fp32; kIeeeSpecials: the all-ones exponent holds infinities and NaNs (E5M2), else only
// S.1111.111 is NaN (E4M3).
template <int kMantissa, int kBias, bool kIeeeSpecials, class DF>
HWY_INLINE codes_hn::VFromD<DF> Fp8LanesToF32(
    DF df, codes_hn::VFromD<codes_hn::RebindToUnsigned<DF>> code) {
  const codes_hn::RebindToUnsigned<DF> du;
  const codes_hn::RebindToSigned<DF> di;
  const auto magnitude = codes_hn::And(code, codes_hn::Set(du, 0x7fu));
  const auto exponent = codes_hn::ShiftRight<kMantissa>(magnitude);
  const auto mantissa = codes_hn::And(magnitude, codes_hn::Set(du, (1u << kMantissa) - 1u));
  const auto normal =
      codes_hn::Add(codes_hn::ShiftLeft<23 - kMantissa>(magnitude),
                    codes_hn::Set(du, static_cast<std::uint32_t>(127 - kBias) << 23));
  constexpr float kSubnormalUnit = 1.0f / static_cast<float>(1u << (kBias - 1 + kMantissa));
  const auto subnormal = codes_hn::Mul(codes_hn::ConvertTo(df, codes_hn::BitCast(di, mantissa)),
                                       codes_hn::Set(df, kSubnormalUnit));
  auto bits = codes_hn::IfThenElse(codes_hn::Eq(exponent, codes_hn::Zero(du)),
                                   codes_hn::BitCast(du, subnormal), normal);
  if constexpr (kIeeeSpecials) {
    const std::uint32_t top = (1u << (7 - kMantissa)) - 1u;
    const auto special =
        codes_hn::Or(codes_hn::Set(du, 0x7f800000u), codes_hn::ShiftLeft<23 - kMantissa>(mantissa));
    bits = codes_hn::IfThenElse(codes_hn::Eq(exponent, codes_hn::Set(du, top)), special, bits);
  } else {
    bits = codes_hn::IfThenElse(codes_hn::Eq(magnitude, codes_hn::Set(du, 0x7fu)),
                                codes_hn::Set(du, 0x7fc00000u), bits);
  }
  bits = codes_hn::Or(bits, codes_hn::ShiftLeft<24>(codes_hn::And(code, codes_hn::Set(du, 0x80u))));
  return codes_hn::BitCast(df, bits);
}

// One vector of fp8 codes at `codes` as fp32.
template <class DF>
HWY_INLINE codes_hn::VFromD<DF> WidenFp8E4M3Codes(DF df, const std::uint8_t* HWY_RESTRICT codes) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
  // As an IEEE half 2^-8 times the value (the code's exponent and mantissa bits at the half's,
  // whose bias is 8 more; subnormal codes are subnormal halves), converted (F16C) and scaled
  // by 2^8, exactly; the NaN code S.1111.111 comes out as ±480, which no code is. The code
  // shifted left by 7 has them in place and the sign at bit 14, which adding that bit to itself
  // moves to bit 15 (bit 15 being 0).
  const codes_hn::Rebind<std::uint16_t, DF> d16;
  const auto shifted = codes_hn::ShiftLeft<7>(
      codes_hn::PromoteTo(d16, codes_hn::LoadU(codes_hn::Rebind<std::uint8_t, DF>(), codes)));
  const auto halves = codes_hn::Add(shifted, codes_hn::And(shifted, codes_hn::Set(d16, 0x4000)));
  const auto value = codes_hn::Mul(
      codes_hn::PromoteTo(df, codes_hn::BitCast(codes_hn::Rebind<hwy::float16_t, DF>(), halves)),
      codes_hn::Set(df, 256.0f));
  return codes_hn::IfThenElse(codes_hn::Eq(codes_hn::Abs(value), codes_hn::Set(df, 480.0f)),
                              codes_hn::NaN(df), value);
#else
  const codes_hn::RebindToUnsigned<DF> du;
  return Fp8LanesToF32<3, 7, false>(
      df, codes_hn::PromoteTo(du, codes_hn::LoadU(codes_hn::Rebind<std::uint8_t, DF>(), codes)));
#endif
}

template <class DF>
HWY_INLINE codes_hn::VFromD<DF> WidenFp8E5M2Codes(DF df, const std::uint8_t* HWY_RESTRICT codes) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
  // The code is the top byte of an IEEE half: widen to 16 bits, shift, convert (F16C).
  const codes_hn::Rebind<std::uint16_t, DF> d16;
  const auto halves = codes_hn::ShiftLeft<8>(
      codes_hn::PromoteTo(d16, codes_hn::LoadU(codes_hn::Rebind<std::uint8_t, DF>(), codes)));
  return codes_hn::PromoteTo(df, codes_hn::BitCast(codes_hn::Rebind<hwy::float16_t, DF>(), halves));
#else
  const codes_hn::RebindToUnsigned<DF> du;
  return Fp8LanesToF32<2, 15, true>(
      df, codes_hn::PromoteTo(du, codes_hn::LoadU(codes_hn::Rebind<std::uint8_t, DF>(), codes)));
#endif
}

}  // namespace HWY_NAMESPACE
}  // namespace flashattn::detail::cpu
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
