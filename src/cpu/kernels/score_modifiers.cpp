// The score modifiers on one row of a score tile (score_modifiers.hpp), compiled once per
// Highway target (foreach_target re-includes this file) and dispatched at run time.

// Highway's order: foreach_target.h first, then highway.h, then the contrib headers.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/kernels/score_modifiers.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include <hwy/contrib/math/math-inl.h>
// clang-format on

#include "cpu/kernels/score_modifiers.hpp"

HWY_BEFORE_NAMESPACE();
namespace flashattn::detail::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

void ModifyScores(float* HWY_RESTRICT scores, float* HWY_RESTRICT derivative, std::int64_t n,
                  float scale, float softcap, float slope, std::int64_t first_distance) {
  const hn::ScalableTag<float> tag;
  using Vec = hn::Vec<decltype(tag)>;
  const auto N = static_cast<std::int64_t>(hn::Lanes(tag));
  const Vec scale_vec = hn::Set(tag, scale);
  const bool capped = softcap > 0.0f;
  const Vec cap = hn::Set(tag, softcap), inverse_cap = hn::Set(tag, capped ? 1.0f / softcap : 0.0f);
  const Vec two_inverse_cap = hn::Add(inverse_cap, inverse_cap);
  const Vec one = hn::Set(tag, 1.0f), two = hn::Set(tag, 2.0f), slope_vec = hn::Set(tag, slope);
  const Vec lane_offsets = hn::Iota(tag, 0.0f);
  // The last vector's lanes past n: through a buffer, so that n need not be a whole vector.
  HWY_ALIGN float tail_scores[hn::MaxLanes(tag)];
  HWY_ALIGN float tail_derivative[hn::MaxLanes(tag)];
  for (std::int64_t j = 0; j < n; j += N) {
    const std::int64_t count = n - j < N ? n - j : N;
    float* s = scores + j;
    float* ds = derivative ? derivative + j : nullptr;
    if (count < N) {
      hn::Store(hn::Zero(tag), tag, tail_scores);
      for (std::int64_t i = 0; i < count; ++i) tail_scores[i] = s[i];
      s = tail_scores;
      if (ds) ds = tail_derivative;
    }
    Vec logit = hn::Mul(hn::LoadU(tag, s), scale_vec);
    if (capped) {
      // tanh y = 1 − 2 / (e^(2y) + 1): one Exp instead of Highway's Tanh (Expm1 and a select),
      // within a few fp32 roundings of 1 in absolute terms, which is what the logit c·tanh needs;
      // e^(2y) = inf gives 1, 0 gives −1, NaN stays NaN.
      const Vec e = hn::Exp(tag, hn::Mul(logit, two_inverse_cap));
      const Vec t = hn::Sub(one, hn::Div(two, hn::Add(e, one)));
      logit = hn::Mul(cap, t);
      if (ds) hn::StoreU(hn::NegMulAdd(t, t, one), tag, ds);
    } else if (ds) {
      hn::StoreU(one, tag, ds);
    }
    if (slope != 0.0f) {
      // |first_distance − j − lane|, exact in fp32 up to 2^24.
      const Vec distance =
          hn::Sub(hn::Set(tag, static_cast<float>(first_distance - j)), lane_offsets);
      logit = hn::NegMulAdd(slope_vec, hn::Abs(distance), logit);
    }
    hn::StoreU(logit, tag, s);
    if (count < N) {
      for (std::int64_t i = 0; i < count; ++i) scores[j + i] = tail_scores[i];
      if (ds) {
        for (std::int64_t i = 0; i < count; ++i) derivative[j + i] = tail_derivative[i];
      }
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace flashattn::detail::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace flashattn::detail::cpu {

HWY_EXPORT(ModifyScores);

void modify_scores(float* scores, float* derivative, std::int64_t n, float scale,
                   const RowModifiers& row) {
  HWY_DYNAMIC_DISPATCH(ModifyScores)
  (scores, derivative, n, scale, row.softcap, row.slope, row.first_distance);
}

}  // namespace flashattn::detail::cpu
#endif
