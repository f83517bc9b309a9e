// libFuzzer target: the attention API. The input bytes choose the path, dtype, a small shape,
// each tensor's memory layout (dim order, padding, stride-0 broadcast of an input), the options
// (causal, window, scale, GQA group, threads, lse or not), the data (including NaN, ±inf and
// denormals), the score modifiers (softcap, ALiBi slopes of either length, sinks, a bias and a
// mask of any broadcast shape and layout; each sometimes a value, length or shape the API must
// refuse), dropout (its seed from the input, or a p it must refuse), for one input in four
// without a bias, mask, sinks or dropout an offset that makes the call a block of a longer
// sequence (api/block_attention.hpp: the diagonal moved, the largest shift included, one past it
// refused) and, for one input in eight, a corruption that makes the call invalid.
//
// Invalid calls must raise flashattn::Error and leave out and lse untouched. Valid calls must
// not throw, must write every element of out (and lse) and nothing around them, and must match
// the fp64 reference (detail::reference_forward_f64) element by element: out finite where the
// reference is (NaN and ±inf may trade places, see below), lse of the same kind (NaN, +inf,
// -inf, finite), and finite values within
//   out: Vmax·((e^(2Δ) − 1) + (2·Skv + 16)·u) + u_out·|ref| + floor
//   lse: Δ + (2·Skv + 16)·u + 4·u·|ref|
// per row, where u = 2^-24, Vmax is the largest |v| among the row's visible keys, and
//   Δ = (D + 2)·u·scale·max_j Σ_d |q_d·k_jd|
// bounds the error of every fp32 score (a length-D dot product, then the scale). Perturbing
// each score by at most Δ changes each softmax weight by a factor in [e^(−2Δ), e^(2Δ)], hence
// the first term; (2·Skv + 16)·u covers the exp, the sum of the weights and the P·V sum;
// u_out·|ref| the final rounding to the output dtype; floor = (Skv + max(D, Dv) + 16)·2^-149 plus
// half the smallest denormal of the output dtype covers denormal arithmetic, whose spacing is
// absolute. When Δ is large (huge scores whose rounding can reorder them) the bound degrades
// to what is always true: every output lies within the visible values (the convex hull).
// Values are small integers times 2^e (|x| <= 2^15) and the scale at most 2^60, so no finite
// score can overflow fp32.
//
// The score modifiers widen the error of each key's logit z_j (options.hpp) beyond Δ_j, the
// score error above, with a_j = scale·Σ_d |q_d·k_jd| bounding |scale·q·k_j|:
//   softcap c: c·tanh(x / c) is 1-Lipschitz in x and lies in [−c, c], so the score error
//     carries over as min(Δ_j, 2c); the tanh (1 − 2 / (e^(2y) + 1), within a few fp32
//     roundings of 1 absolute) and the product by c add 8·u·c. |z_j| <= c.
//   ALiBi, A_j = |slope|·|distance| (the distance is exact): the product and the subtraction
//     round, u·(|z_j| + 2·A_j), with |z_j| <= (c or a_j) before it. |z_j| then grows by A_j.
//   sinks σ: the sink's logit is exact, but the epilogue's σ − max or max − σ rounds, which
//     shifts every weight as a logit error of u·(|σ| + max_j |z_j|) would (2u, for the
//     two orders); its exp, product and sum add 4u to the mixing term.
//   bias β: the sum rounds, u·(|z_j| + |β|), and |z_j| grows by |β|; a −inf bias and a key the
//     mask drops give the key weight 0 exactly on every path, so they add no error (and a row
//     with nothing else gets 0 and lse −inf, as in the reference).
// Δ is then the largest logit error of the row, and the bounds above hold as they are: a sink
// only adds one exactly known term to the normalizer, so each weight still moves by a factor
// within e^(±2Δ), and an output with sinks is a combination of the visible values whose
// weights sum to less than 1, inside the same hull.

#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "api/backends.hpp"
#include "api/block_attention.hpp"
#include "flashattn/dtype.hpp"
#include "flashattn/flashattn.hpp"
#include "fuzz_support.hpp"

namespace {

using flashattn::AttentionImpl;
using flashattn::AttentionOptions;
using flashattn::DType;
using namespace fuzz_support;

struct Problem {
  AttentionImpl impl = AttentionImpl::flash;
  DType dtype = DType::f32;
  Tensor q, k, v, out;
  std::vector<std::uint8_t> lse_bytes;  // empty: lse = nullptr
  AttentionOptions options;
  std::vector<float> alibi_slopes, sinks;  // what options.alibi_slopes and options.sinks view
  bool refused_modifier = false;           // a modifier the API must refuse
  FuzzedLogitViews logit_views;            // what options.bias and options.mask view
  // Set: the call attends as a block of a longer sequence, row i on key i + offset
  // (api/block_attention.hpp).
  std::optional<std::int64_t> block_offset;
  bool refused_offset = false;  // an offset whose diagonal shift is past the API's limit
  std::string description;

  flashattn::ConstTensorView view(const Tensor& t) const {
    return {t.buffer.bytes.data(), dtype, t.shape, t.strides};
  }
  flashattn::TensorView out_view() {
    return {out.buffer.bytes.data(), dtype, out.shape, out.strides};
  }
  float* lse() { return lse_bytes.empty() ? nullptr : reinterpret_cast<float*>(lse_bytes.data()); }
};

[[noreturn]] void finding(const Problem& p, const std::string& what) {
  report_finding("fuzz_attention", p.description, what);
}

// Softcaps the API must refuse (−0 is 0, off), and valid extremes: the smallest normal float
// (its doubled reciprocal, 2^127, still finite) and the largest.
constexpr float kRefusedSoftcaps[] = {-1.0f, -0x1p-149f, NAN, INFINITY, -INFINITY};
constexpr float kExtremeSoftcaps[] = {0x1p-126f, std::numeric_limits<float>::max()};

// A length of modifier values that is neither 0 (off) nor heads_q nor, where `batch` > 0 (ALiBi),
// batch·heads_q: one short when the input says so and heads_q > 1, else one or two long.
std::int64_t refused_length(FuzzedDataProvider& in, std::int64_t heads_q, std::int64_t batch) {
  if (in.ConsumeBool() && heads_q > 1) return heads_q - 1;
  return heads_q + 1 == batch * heads_q ? heads_q + 2 : heads_q + 1;
}

// n fp32 modifier values: small integers times 2^e like the data, finite, or for a refused one,
// a NaN or ±inf at one position.
std::vector<float> modifier_values(FuzzedDataProvider& in, std::int64_t n, int exponent) {
  std::vector<float> values(static_cast<std::size_t>(n));
  for (float& value : values) {
    value = value_from(in.ConsumeIntegral<std::uint8_t>(), exponent, false, false);
  }
  return values;
}
void make_non_finite(FuzzedDataProvider& in, std::vector<float>& values) {
  const auto at = in.ConsumeIntegralInRange<std::size_t>(0, values.size() - 1);
  values[at] = kSpecials[in.ConsumeIntegralInRange(0, kNonFiniteSpecials - 1)];
}

// The score modifiers, decoded after everything else: an input that ends before them (the
// corpus from before they existed) decodes as it did, every modifier off. Each is off for half
// the inputs that reach it, and for one in eight (one in sixteen for the softcap) refused.
void fuzzed_modifiers(FuzzedDataProvider& in, Problem& p, const FuzzedShape& shape) {
  const std::int64_t heads_q = shape.heads_kv * shape.group;
  const int softcap = in.ConsumeIntegralInRange(0, 15);
  if (softcap >= 8 && softcap <= 13) {
    // From far below the scores (every logit saturated) to far above them (tanh linear).
    p.options.softcap =
        std::ldexp(in.PickValueInArray({1.0f, 1.5f, 1.25f}), in.ConsumeIntegralInRange(-8, 24));
  } else if (softcap == 14) {
    p.options.softcap = in.PickValueInArray(kExtremeSoftcaps);
  } else if (softcap == 15) {
    p.options.softcap = in.PickValueInArray(kRefusedSoftcaps);
    p.refused_modifier = true;
  }

  // Slopes up to 2^7 and distances up to 600 keep every ALiBi term far inside fp32.
  const int alibi = in.ConsumeIntegralInRange(0, 7);
  if (alibi >= 4) {
    const bool refused = alibi == 7, wrong_length = refused && in.ConsumeBool();
    const std::int64_t n = wrong_length ? refused_length(in, heads_q, shape.batch)
                           : alibi == 6 ? shape.batch * heads_q
                                        : heads_q;
    p.alibi_slopes = modifier_values(in, n, in.ConsumeIntegralInRange(-8, 4));
    if (refused && !wrong_length) make_non_finite(in, p.alibi_slopes);
    p.refused_modifier = p.refused_modifier || refused;
    p.options.alibi_slopes = p.alibi_slopes;
  }

  const int sinks = in.ConsumeIntegralInRange(0, 7);
  if (sinks >= 4) {
    const bool refused = sinks == 7, wrong_length = refused && in.ConsumeBool();
    const std::int64_t n = wrong_length ? refused_length(in, heads_q, 0) : heads_q;
    p.sinks = modifier_values(in, n, in.ConsumeIntegralInRange(-8, 12));
    if (refused && !wrong_length) make_non_finite(in, p.sinks);
    p.refused_modifier = p.refused_modifier || refused;
    p.options.sinks = p.sinks;
  }

  // Dropout for three inputs in sixteen that reach it, its seed and offset from the input; a
  // p outside [0, 1) for one in sixteen, refused.
  const int dropout = in.ConsumeIntegralInRange(0, 15);
  if (dropout >= 12 && dropout <= 14) {
    p.options.dropout_p = in.PickValueInArray({0.1f, 0.5f, 0.9f});
    p.options.dropout_seed = in.ConsumeIntegral<std::uint64_t>();
    p.options.dropout_offset = in.ConsumeIntegral<std::uint32_t>();
  } else if (dropout == 15) {
    p.options.dropout_p = in.PickValueInArray({1.0f, -0.5f, NAN});
    p.refused_modifier = true;
  }
}

void describe_modifiers(std::ostream& text, const Problem& p) {
  text << " softcap " << p.options.softcap << " alibi [";
  for (float slope : p.alibi_slopes) text << " " << slope;
  text << " ] sinks [";
  for (float sink : p.sinks) text << " " << sink;
  text << " ] dropout " << p.options.dropout_p << " seed " << p.options.dropout_seed << " offset "
       << p.options.dropout_offset;
}

Problem make_problem(FuzzedDataProvider& in) {
  Problem p;
  p.impl = fuzzed_impl(in);
  p.dtype = fuzzed_dtype(in);
  const FuzzedShape shape = fuzzed_shape(in, 1 << 16);
  const Shape q_shape = shape.q(), kv_shape = shape.kv();

  p.q = fuzzed_layout(in, p.dtype, q_shape, true);
  p.k = fuzzed_layout(in, p.dtype, kv_shape, true);
  p.v = fuzzed_layout(in, p.dtype, shape.v(), true);
  p.out = fuzzed_layout(in, p.dtype, shape.out(), false);
  mark_view(p.out);
  if (in.ConsumeBool()) {
    p.lse_bytes.assign(
        static_cast<std::size_t>(std::max<std::int64_t>(shape.lse_elements(), 1)) * 4,
        kSentinelByte);
  }

  p.options = fuzzed_options(in);

  const bool specials = in.ConsumeIntegralInRange(0, 3) == 0;
  const int q_exponent = in.ConsumeIntegralInRange(-12, 12);
  const int k_exponent = in.ConsumeIntegralInRange(-12, 12);
  const int v_exponent = in.ConsumeIntegralInRange(-12, 12);
  fill(p.q, p.dtype, in, q_exponent, specials, true);
  fill(p.k, p.dtype, in, k_exponent, specials, true);
  fill(p.v, p.dtype, in, v_exponent, specials, true);
  fuzzed_modifiers(in, p, shape);
  p.logit_views = fuzzed_logit_views(in, shape);
  p.logit_views.apply(p.options);
  p.refused_modifier = p.refused_modifier || p.logit_views.refused;

  std::ostringstream text;
  text << flashattn::impl_name(p.impl) << " " << flashattn::dtype_name(p.dtype);
  describe_tensor(text, "q", p.q);
  describe_tensor(text, "k", p.k);
  describe_tensor(text, "v", p.v);
  describe_tensor(text, "out", p.out);
  describe_options(text, p.options);
  describe_modifiers(text, p);
  p.logit_views.describe(text);
  text << " lse " << !p.lse_bytes.empty() << " specials " << specials;
  p.description = text.str();
  return p;
}

// Turns the call invalid; false when this corruption cannot apply to this problem.
bool corrupt(Problem& p, int kind, flashattn::ConstTensorView& q, flashattn::ConstTensorView& k,
             flashattn::ConstTensorView& v, flashattn::TensorView& out, float*& lse) {
  const bool has_output =
      std::all_of(out.shape.begin(), out.shape.end(), [](auto d) { return d > 0; });
  constexpr std::int64_t kHuge = std::int64_t{1} << 40;
  switch (kind) {
    case 0:
      k.shape[3] += 1;
      return true;
    case 1:
      v.shape[1] += 1;
      return true;
    case 2:
      k.shape[0] += 1;
      v.shape[0] += 1;
      return true;
    case 3:
      k.shape[2] = v.shape[2] = q.shape[2] + 1;
      return true;
    case 4:
      out.shape[1] += 1;
      return true;
    case 5:
      q.shape[1] = -1 - q.shape[1];
      return true;
    case 6:
      k.strides[1] = -1;
      return true;
    case 7:
      if (q.shape[3] < 2) return false;
      q.strides[3] = 2;
      return true;
    case 8:
      v.dtype = p.dtype == DType::f32 ? DType::bf16 : DType::f32;
      return true;
    case 9:
      if (!has_output) return false;
      q.data = nullptr;
      return true;
    case 10:
      if (!has_output) return false;
      out.data = const_cast<void*>(q.data);
      return true;
    case 11:
      if (!has_output || out.shape[1] < 2) return false;
      out.strides[1] = 0;
      return true;
    case 12:
      if (!has_output || lse == nullptr) return false;
      lse = static_cast<float*>(out.data);
      return true;
    case 13:
      p.options.softmax_scale = std::array<float, 4>{0.0f, -1.0f, NAN, INFINITY}[p.q.shape[1] % 4];
      return true;
    case 14:
      p.options.window_left = -2 - p.q.shape[1];
      return true;
    case 15:
      p.options.num_threads = -1;
      return true;
    case 16:
      q.shape = out.shape = {kHuge, kHuge, kHuge, 8};
      return true;
    case 17:
      if (k.shape[0] < 2 || k.shape[1] == 0) return false;
      k.strides[0] = std::numeric_limits<std::int64_t>::max() / 2 + 1;
      return true;
    case 18:
      k.shape[1] = v.shape[1] = (std::int64_t{1} << 61) + 1;
      return true;
    case 19:
      q.shape[3] = k.shape[3] = v.shape[3] = out.shape[3] = 0;
      return true;
    case 20:
      if (!has_output || lse == nullptr) return false;
      lse = static_cast<float*>(const_cast<void*>(q.data));
      return true;
    default:
      return false;
  }
}

// Whether x, stored in `dtype` (rounded to nearest), becomes infinite.
bool rounds_to_infinity(DType dtype, double x) {
  std::uint32_t stored = 0;  // room for any dtype's element
  flashattn::store_f32(&stored, dtype, 0, static_cast<float>(x));
  return std::isinf(flashattn::load_f32(&stored, dtype, 0));
}

enum class Kind { nan, plus_inf, minus_inf, finite };
Kind kind_of(double x) {
  if (std::isnan(x)) return Kind::nan;
  if (std::isinf(x)) return x > 0 ? Kind::plus_inf : Kind::minus_inf;
  return Kind::finite;
}

// The checks run O(B·Hq·Sq·Skv·D) loops of their own: kept out of the coverage
// instrumentation, which would otherwise cost more than the library calls under test.
__attribute__((no_sanitize("coverage"))) void check_against_reference(
    Problem& p, const flashattn::detail::AttentionParams& params) {
  const std::int64_t B = params.batch, Sq = params.seqlen_q, Hq = params.heads_q,
                     D = params.head_dim, Dv = params.head_dim_v, Skv = params.seqlen_kv,
                     Hkv = params.heads_kv;
  std::vector<double> ref_out(static_cast<std::size_t>(B * Sq * Hq * Dv));
  std::vector<double> ref_lse(static_cast<std::size_t>(B * Hq * Sq));
  flashattn::detail::reference_forward_f64(params, ref_out.data(), ref_lse.data());

  const bool exact = p.impl == AttentionImpl::reference;
  const double u_out = unit_roundoff(p.dtype);
  const double floor =
      static_cast<double>(Skv + std::max(D, Dv) + 16) * 0x1p-149 + half_smallest_denormal(p.dtype);
  const flashattn::detail::ScoreModifiers& modifiers = params.modifiers;
  const double softcap = modifiers.softcap;
  const bool sinks = modifiers.sinks != nullptr;
  const double mixing = static_cast<double>(2 * Skv + 16 + (sinks ? 4 : 0)) * kU32;
  // The flash path may round P to the input dtype as the operand of P·V (docs/design.md, "The
  // contract"; bf16 on AMX does): at most u_in·max|v| more. The bf16 tile instructions flush
  // fp32 intermediates below 2^-126 (scores' products, P·V products, the accumulator between
  // blocks): at most (Skv + D + 16)·2^-126 more, absolute.
  const double u_p = exact || p.dtype == DType::f32 ? 0.0 : unit_roundoff(p.dtype);
  const double flushed = exact || p.dtype != DType::bf16
                             ? 0.0
                             : static_cast<double>(Skv + std::max(D, Dv) + 16) * 0x1p-126;
  const std::uint8_t* out = p.out.buffer.bytes.data();
  const float* lse = p.lse();

  const std::vector<double> q_abs =
      finite_magnitudes(params.q, p.dtype, params.q_strides, B, Sq, Hq, D);
  const std::vector<double> k_abs =
      finite_magnitudes(params.k, p.dtype, params.k_strides, B, Skv, Hkv, D);
  const std::vector<double> v_abs =
      finite_magnitudes(params.v, p.dtype, params.v_strides, B, Skv, Hkv, Dv);
  // Per key row: the largest finite |v|.
  std::vector<double> v_row_max(static_cast<std::size_t>(B * Skv * Hkv), 0.0);
  for (std::size_t row = 0; row < v_row_max.size(); ++row) {
    for (std::int64_t d = 0; d < Dv; ++d) {
      v_row_max[row] = std::max(v_row_max[row], v_abs[row * Dv + d]);
    }
  }
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < Hq; ++h) {
      const std::int64_t h_kv = params.kv_head(h);
      auto key_row = [&](std::int64_t j) {
        return static_cast<std::size_t>((b * Skv + j) * Hkv + h_kv);
      };
      const double slope = std::abs(static_cast<double>(modifiers.alibi_slope(b, h)));
      for (std::int64_t row = 0; row < Sq; ++row) {
        const flashattn::detail::KeyRange keys = params.key_range(row);
        const double* q_row = q_abs.data() + ((b * Sq + row) * Hq + h) * D;
        double delta = 0.0, v_max = 0.0, logit_max = 0.0;
        for (std::int64_t j = keys.begin; j < keys.end; ++j) {
          if (modifiers.mask.data != nullptr && !modifiers.mask.kept(b, h, row, j)) continue;
          const double bias =
              modifiers.bias.data != nullptr ? modifiers.bias.bias(b, h, row, j) : 0.0;
          if (std::isinf(bias)) continue;
          const double* k_row = k_abs.data() + key_row(j) * D;
          double magnitude = 0.0;
          for (std::int64_t d = 0; d < D; ++d) magnitude += q_row[d] * k_row[d];
          // The logit's error and a bound of its magnitude (see the top of the file).
          double error = static_cast<double>(D + 2) * kU32 * params.scale * magnitude;
          double logit = params.scale * magnitude;
          if (softcap > 0) {
            error = std::min(error, 2 * softcap) + 8 * kU32 * softcap;
            logit = softcap;
          }
          if (slope > 0) {
            const double alibi =
                slope * static_cast<double>(std::abs(row + Skv - Sq + params.diagonal_shift - j));
            error += kU32 * (logit + 2 * alibi);
            logit += alibi;
          }
          if (bias != 0.0) {
            error += kU32 * (logit + std::abs(bias));
            logit += std::abs(bias);
          }
          delta = std::max(delta, error);
          logit_max = std::max(logit_max, logit);
          v_max = std::max(v_max, v_row_max[key_row(j)]);
        }
        if (sinks && !keys.empty()) {
          delta += 2 * kU32 * (std::abs(static_cast<double>(modifiers.sinks[h])) + logit_max);
        }
        // Dropout scales the kept weights by 1 / (1 − p), both sides by the same mask: the
        // output stays within that multiple of the visible values' hull.
        if (params.dropout.on()) v_max *= params.dropout.scale;
        const double lse_want = ref_lse[static_cast<std::size_t>(params.lse_index(b, h, row))];
        // Both got and want lie in the hull, so 2·hull bounds their distance whatever Δ is.
        const double hull = v_max * (1.0 + mixing) + floor;
        const double mixed = delta < 20 ? v_max * (std::expm1(2.0 * delta) + mixing) : INFINITY;
        for (std::int64_t d = 0; d < Dv; ++d) {
          const double want = ref_out[static_cast<std::size_t>(((b * Sq + row) * Hq + h) * Dv + d)];
          const double got = load_f32(out, p.dtype, p.out.offset(b, row, h, d));
          const double tolerance = (exact ? 0.0 : std::min(mixed, 2.0 * hull)) + u_p * v_max +
                                   u_out * std::abs(want) + floor + flushed;
          // Dropout's 1 / (1 − p) can carry an output past the dtype's largest value: stored,
          // it is then ±inf, as the reference's own rounding to the dtype makes it.
          if (std::isinf(got) && std::isfinite(want) && (got > 0) == (want > 0) &&
              rounds_to_infinity(p.dtype, std::abs(want) + tolerance)) {
            continue;
          }
          // Whether a non-finite value shows as ±inf or NaN can differ: a weight that is tiny
          // in fp64 may be 0 in fp32, and p·inf is inf while 0·inf is NaN. Finiteness may not.
          if (std::isfinite(got) != std::isfinite(want) ||
              (std::isfinite(want) && std::abs(got - want) > tolerance)) {
            std::ostringstream what;
            what << "out[b=" << b << ", row=" << row << ", h=" << h << ", d=" << d << "] = " << got
                 << ", reference " << want << ", tolerance " << tolerance << " (delta " << delta
                 << ", v_max " << v_max << ")";
            finding(p, what.str());
          }
        }
        if (lse == nullptr) continue;
        const double got = lse[params.lse_index(b, h, row)];
        // The reference path rounds its fp64 lse once to fp32, where below 2^-126 the spacing
        // is the absolute 2^-149 (a tiny lse may round to 0).
        const double tolerance = exact ? kU32 * std::abs(lse_want) + 0x1p-149
                                       : delta + mixing + 4 * kU32 * std::abs(lse_want);
        if (kind_of(got) != kind_of(lse_want) ||
            (std::isfinite(lse_want) && std::abs(got - lse_want) > tolerance)) {
          std::ostringstream what;
          what << "lse[b=" << b << ", h=" << h << ", row=" << row << "] = " << got << ", reference "
               << lse_want << ", tolerance " << tolerance;
          finding(p, what.str());
        }
      }
    }
  }
  // Nothing around the view: padding elements still hold the sentinel.
  const std::int64_t written = written_around_view(p.out, p.dtype);
  if (written >= 0) finding(p, "wrote padding element " + std::to_string(written) + " of out");
}

// One input in four without a bias, mask or sinks attends as a block of a longer sequence: its
// diagonal moved by an offset within a few lengths, now and then by the largest shift the API
// takes (without ALiBi, whose distances would then dwarf fp32), or one past it, which must be
// refused.
void choose_block_offset(FuzzedDataProvider& in, Problem& p) {
  const AttentionOptions& o = p.options;
  if (o.bias.data != nullptr || o.mask.data != nullptr || !o.sinks.empty() || o.dropout_p != 0.0f ||
      in.ConsumeIntegralInRange(0, 3) != 0) {
    return;
  }
  constexpr std::int64_t kMaxShift = std::int64_t{1} << 59;
  const std::int64_t lengths = p.q.shape[1] - p.k.shape[1];
  const std::int64_t reach = p.q.shape[1] + p.k.shape[1] + 4;
  const bool alibi = !o.alibi_slopes.empty();
  switch (in.ConsumeIntegralInRange(0, 7)) {
    case 0:
      p.block_offset = alibi ? reach : kMaxShift - lengths;
      break;
    case 1:
      p.block_offset = alibi ? -reach : -kMaxShift - lengths;
      break;
    case 2:
      p.block_offset = kMaxShift - lengths + 1;
      p.refused_offset = true;
      break;
    default:
      p.block_offset = in.ConsumeIntegralInRange(-reach, reach);
  }
  p.description += " block offset " + std::to_string(*p.block_offset);
}

void attend(const Problem& p, const flashattn::ConstTensorView& q,
            const flashattn::ConstTensorView& k, const flashattn::ConstTensorView& v,
            const flashattn::TensorView& out, float* lse) {
  if (p.block_offset) {
    flashattn::detail::block_attention_forward(p.impl, q, k, v, out, lse, p.options,
                                               *p.block_offset);
  } else {
    flashattn::attention_forward(p.impl, q, k, v, out, lse, p.options);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  const int corruption =
      in.ConsumeIntegralInRange(0, 7) == 0 ? in.ConsumeIntegralInRange(0, 20) : -1;
  Problem p = make_problem(in);
  choose_block_offset(in, p);
  flashattn::ConstTensorView q = p.view(p.q), k = p.view(p.k), v = p.view(p.v);
  flashattn::TensorView out = p.out_view();
  float* lse = p.lse();

  // A corruption that cannot apply skips the input, unless a refused modifier or offset makes
  // the call invalid anyway.
  bool invalid = p.refused_modifier || p.refused_offset;
  if (corruption >= 0) {
    if (corrupt(p, corruption, q, k, v, out, lse)) {
      invalid = true;
      p.description += " corruption " + std::to_string(corruption);
    } else if (!invalid) {
      return 0;
    }
  }
  if (invalid) {
    const std::vector<std::uint8_t> out_before = p.out.buffer.bytes, lse_before = p.lse_bytes;
    try {
      attend(p, q, k, v, out, lse);
    } catch (const flashattn::Error&) {
      if (p.out.buffer.bytes != out_before || p.lse_bytes != lse_before) {
        finding(p, "an invalid call wrote its output before raising Error");
      }
      return 0;
    }
    finding(p, "an invalid call did not raise flashattn::Error");
  }

  try {
    attend(p, q, k, v, out, lse);
  } catch (const flashattn::Error& error) {
    finding(p, std::string("a valid call raised Error: ") + error.what());
  }
  flashattn::detail::AttentionParams params =
      flashattn::detail::make_params("fuzz", q, k, v, out, lse, p.options);
  if (p.block_offset) flashattn::detail::place_block("fuzz", params, p.options, *p.block_offset);
  check_against_reference(p, params);
  return 0;
}
