#pragma once

#include <cstdint>

namespace flashattn::detail {

// Σ a[i]·b[i] over [0, n) in fp32, with SIMD (util/dot.cpp). The summation order depends on the
// vector width of the CPU's SIMD target, never on anything else.
float dot_f32(const float* a, const float* b, std::int64_t n);

}  // namespace flashattn::detail
