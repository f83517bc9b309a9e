// dot_f32 and add_widened_f64, compiled once per Highway target and dispatched at run time. The
// backward's D_i, one dot product of head_dim per query row, summed element by element was a
// chain of dependent adds, 4 cycles each (docs/tuning.md). The flash backward's dbias adds every
// (batch, head)'s logits' gradient into fp64 sums (add_widened_f64): scalar, that was half of
// what dbias cost it.

// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "util/dot.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
// clang-format on

#include "util/dot.hpp"

HWY_BEFORE_NAMESPACE();
namespace flashattn::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

float DotF32(const float* HWY_RESTRICT a, const float* HWY_RESTRICT b, std::int64_t n) {
  const hn::ScalableTag<float> d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  // Two accumulators, so that consecutive vectors do not wait for each other's add.
  auto sum0 = hn::Zero(d), sum1 = hn::Zero(d);
  std::int64_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    sum0 = hn::MulAdd(hn::LoadU(d, a + i), hn::LoadU(d, b + i), sum0);
    sum1 = hn::MulAdd(hn::LoadU(d, a + i + N), hn::LoadU(d, b + i + N), sum1);
  }
  for (; i + N <= n; i += N) sum0 = hn::MulAdd(hn::LoadU(d, a + i), hn::LoadU(d, b + i), sum0);
  float sum = hn::GetLane(hn::SumOfLanes(d, hn::Add(sum0, sum1)));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

void AddWidenedF64(double* HWY_RESTRICT sums, const float* HWY_RESTRICT x, std::int64_t n) {
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> df;  // as many floats as a vector holds doubles
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(dd));
  std::int64_t i = 0;
  for (; i + N <= n; i += N) {
    hn::StoreU(hn::Add(hn::LoadU(dd, sums + i), hn::PromoteTo(dd, hn::LoadU(df, x + i))), dd,
               sums + i);
  }
  for (; i < n; ++i) sums[i] += static_cast<double>(x[i]);
}

}  // namespace HWY_NAMESPACE
}  // namespace flashattn::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace flashattn::detail {

HWY_EXPORT(DotF32);

float dot_f32(const float* a, const float* b, std::int64_t n) {
  return HWY_DYNAMIC_DISPATCH(DotF32)(a, b, n);
}

HWY_EXPORT(AddWidenedF64);

void add_widened_f64(double* sums, const float* x, std::int64_t n) {
  HWY_DYNAMIC_DISPATCH(AddWidenedF64)(sums, x, n);
}

}  // namespace flashattn::detail
#endif  // HWY_ONCE
