#pragma once

// Shared helpers for the attention tests: owned tensors in any dtype, random fill, NaN poison,
// and the fp64 oracle on the same inputs.

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <vector>

#include "api/backends.hpp"
#include "cpu/kernels/tile_kernels.hpp"
#include "flashattn/dtype.hpp"
#include "flashattn/flashattn.hpp"

namespace flashattn::testing {

// An owned buffer seen through a 4-d view whose strides may differ from C order.
struct Tensor {
  std::vector<std::uint8_t> bytes;
  TensorView view;

  Tensor(DType dtype, std::array<std::int64_t, 4> shape)
      : Tensor(dtype, shape, contiguous_strides(shape)) {}

  // `strides` must describe a layout that fits in the product of the padded extents.
  Tensor(DType dtype, std::array<std::int64_t, 4> shape, std::array<std::int64_t, 4> strides) {
    std::int64_t extent = 1;
    for (int d = 0; d < 4; ++d) extent += (shape[d] - 1) * strides[d];
    bytes.assign(static_cast<std::size_t>(std::max<std::int64_t>(extent, 1)) * dtype_size(dtype),
                 0);
    view = {bytes.data(), dtype, shape, strides};
  }

  std::int64_t offset(std::int64_t i0, std::int64_t i1, std::int64_t i2, std::int64_t i3) const {
    return i0 * view.strides[0] + i1 * view.strides[1] + i2 * view.strides[2] +
           i3 * view.strides[3];
  }
  float at(std::int64_t i0, std::int64_t i1, std::int64_t i2, std::int64_t i3) const {
    return load_f32(view.data, view.dtype, offset(i0, i1, i2, i3));
  }
  void set(std::int64_t i0, std::int64_t i1, std::int64_t i2, std::int64_t i3, float value) {
    store_f32(view.data, view.dtype, offset(i0, i1, i2, i3), value);
  }

  template <class Fn>
  void for_each_index(Fn&& fn) const {
    const auto& s = view.shape;
    for (std::int64_t a = 0; a < s[0]; ++a)
      for (std::int64_t b = 0; b < s[1]; ++b)
        for (std::int64_t c = 0; c < s[2]; ++c)
          for (std::int64_t d = 0; d < s[3]; ++d) fn(a, b, c, d);
  }

  void fill_normal(std::mt19937_64& rng, float stddev = 1.0f) {
    std::normal_distribution<float> normal(0.0f, stddev);
    for_each_index([&](auto a, auto b, auto c, auto d) { set(a, b, c, d, normal(rng)); });
  }
  void fill(float value) {
    for_each_index([&](auto a, auto b, auto c, auto d) { set(a, b, c, d, value); });
  }
  void poison() { fill(std::numeric_limits<float>::quiet_NaN()); }
};

// Seed for "fresh random inputs": new each run unless FLASHATTN_TEST_SEED pins it. Failure
// messages print it so a failing run can be replayed.
inline std::uint64_t test_seed() {
  static const std::uint64_t seed = [] {
    if (const char* pinned = std::getenv("FLASHATTN_TEST_SEED")) {
      return static_cast<std::uint64_t>(std::strtoull(pinned, nullptr, 10));
    }
    return (static_cast<std::uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  }();
  return seed;
}

// Runs check once per SIMD target compiled in that this CPU supports, each forced in turn (with
// gtest's SCOPED_TRACE naming it where the caller includes gtest), then restores the default.
template <class Check>
void on_every_target(const Check& check) {
  for (const detail::cpu::SimdTarget& target : detail::cpu::supported_simd_targets()) {
    SCOPED_TRACE("SIMD target " + target.name);
    detail::cpu::force_simd_target(target.id);
    check();
  }
  detail::cpu::force_simd_target(0);
}

// Unit roundoff of a storage dtype (half an ulp at 1).
inline double unit_roundoff(DType dtype) {
  return std::ldexp(1.0, -dtype_traits(dtype).significand_bits);
}

// docs/design.md, "The contract" lets the probabilities be rounded to the input dtype as the
// operand of P·V (the
// bf16 products of the flash path do): that moves an output element by at most
// sum_j |p~_j - p_j|·|v_j| / l <= u_in · max|v|.
inline double probability_rounding_bound(DType dtype, double max_abs_v) {
  return dtype == DType::f32 ? 0.0 : unit_roundoff(dtype) * max_abs_v;
}

// out's shape: q's [batch, seqlen_q, heads_q] and v's head dim (head_dim_v).
inline std::array<std::int64_t, 4> out_shape_of(const Tensor& q, const Tensor& v) {
  return {q.view.shape[0], q.view.shape[1], q.view.shape[2], v.view.shape[3]};
}

struct ReferenceResult {
  std::vector<double> out;  // contiguous [B, Sq, Hq, Dv]
  std::vector<double> lse;  // contiguous [B, Hq, Sq]
};

inline ReferenceResult reference(const Tensor& q, const Tensor& k, const Tensor& v,
                                 const AttentionOptions& options) {
  Tensor unused_out(q.view.dtype, out_shape_of(q, v));
  const detail::AttentionParams params =
      detail::make_params("reference", q.view, k.view, v.view, unused_out.view, nullptr, options);
  ReferenceResult result;
  result.out.resize(static_cast<std::size_t>(unused_out.view.numel()));
  result.lse.resize(static_cast<std::size_t>(params.batch * params.heads_q * params.seqlen_q));
  detail::reference_forward_f64(params, result.out.data(), result.lse.data());
  return result;
}

// The largest |got - want| over all elements, where it occurred and both values.
struct MaxError {
  double value = 0.0;
  std::int64_t index = -1;
  double got = 0.0, want = 0.0;
};

// Over the elements of `got` in index order against contiguous `want` (NaN counts as infinite).
inline MaxError max_error(const Tensor& got, const std::vector<double>& want) {
  MaxError worst;
  std::int64_t flat = 0;
  got.for_each_index([&](auto a, auto b, auto c, auto d) {
    const double value = got.at(a, b, c, d);
    const double error = std::isnan(value) ? INFINITY : std::abs(value - want[flat]);
    if (error > worst.value || worst.index < 0) worst = {error, flat, value, want[flat]};
    ++flat;
  });
  return worst;
}

inline double max_abs(const Tensor& t) {
  double result = 0.0;
  t.for_each_index([&](auto a, auto b, auto c, auto d) {
    result = std::max<double>(result, std::abs(t.at(a, b, c, d)));
  });
  return result;
}

// Largest finite |x| (infinite and NaN entries, e.g. the -inf lse of masked rows, skipped).
inline double max_abs_finite(const std::vector<double>& values) {
  double result = 0.0;
  for (double x : values) {
    if (std::isfinite(x)) result = std::max(result, std::abs(x));
  }
  return result;
}

// Tolerance of a result assembled from `pieces` partial results (outputs merged by their lse, or
// gradients summed: block attention, ring attention) against the fp64 reference, relative to the
// single-call flash path's measured error on the same inputs: 4x that error, plus a floor at the
// result's scale G of two roundings of the dtype, four typical score roundings
// (u32·scale·sqrt(D)·max|q|·max|k|), and per piece one rounding of the partial as stored (fp32,
// or the 16-bit dtype the block calls write) plus one fp32 rounding of the sum it enters.
inline double assembled_tolerance(double single_flash_error, DType dtype, std::int64_t pieces,
                                  double score_rounding, double scale_g) {
  const double per_piece = unit_roundoff(dtype) + 0x1p-24;
  return 4.0 * single_flash_error +
         (2.0 * unit_roundoff(dtype) + 4.0 * score_rounding + pieces * per_piece) * scale_g;
}

// What a gradient assembled from partial ones (block or ring attention) is held to: the fp64
// reference gradients (contiguous, C order) of one forward whose out and lse are given, the
// single-call flash backward's largest error against them, and the gradients' scale
// G = max|grad| + max|dO|·max|v| (assembled_tolerance's scale_g).
struct GradientOracle {
  std::vector<double> dq, dk, dv;
  double single_flash_error = 0.0, scale_g = 0.0;
};
inline GradientOracle gradient_oracle(const Tensor& dout, const Tensor& q, const Tensor& k,
                                      const Tensor& v, const Tensor& out, const float* lse,
                                      const AttentionOptions& options) {
  Tensor dq(q.view.dtype, q.view.shape), dk(k.view.dtype, k.view.shape),
      dv(v.view.dtype, v.view.shape);
  const detail::BackwardParams params =
      detail::make_backward_params("reference", dout.view, q.view, k.view, v.view, out.view, lse,
                                   dq.view, dk.view, dv.view, options);
  GradientOracle oracle;
  oracle.dq.resize(static_cast<std::size_t>(q.view.numel()));
  oracle.dk.resize(static_cast<std::size_t>(k.view.numel()));
  oracle.dv.resize(static_cast<std::size_t>(v.view.numel()));
  detail::reference_backward_f64(params, oracle.dq.data(), oracle.dk.data(), oracle.dv.data());
  flash_attention_backward(dout.view, q.view, k.view, v.view, out.view, lse, dq.view, dk.view,
                           dv.view, options);
  oracle.single_flash_error =
      std::max({max_error(dq, oracle.dq).value, max_error(dk, oracle.dk).value,
                max_error(dv, oracle.dv).value});
  oracle.scale_g =
      std::max({max_abs_finite(oracle.dq), max_abs_finite(oracle.dk), max_abs_finite(oracle.dv)}) +
      max_abs(dout) * max_abs(v);
  return oracle;
}

}  // namespace flashattn::testing
