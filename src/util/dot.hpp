#pragma once

#include <cstdint>

namespace flashattn::detail {

// Σ a[i]·b[i] over [0, n) in fp32, with SIMD (util/dot.cpp). The summation order depends on the
// vector width of the CPU's SIMD target, never on anything else.
float dot_f32(const float* a, const float* b, std::int64_t n);

// sums[i] += x[i] widened to fp64, for i in [0, n), with SIMD (util/dot.cpp): one exact widening
// and one fp64 add per element, so the same bits on every SIMD target.
void add_widened_f64(double* sums, const float* x, std::int64_t n);

}  // namespace flashattn::detail
