// libFuzzer target: the backward API. The input bytes choose the path, dtype, a small shape,
// each tensor's memory layout (dim order, padding, stride-0 broadcast of an input), the options
// (causal, window, scale, GQA group, threads), the data (NaN, ±inf and denormals included), the
// score modifiers (softcap, ALiBi slopes of either length, sinks with or without dsinks, a bias
// with or without dbias, a mask; each sometimes a value, length, shape or dsinks buffer the API
// must refuse) and, for one input in eight,
// a corruption that makes the call invalid (a dropout_p outside [0, 1) among them; dropout's own
// backward is checked against the reference by tests/test_score_modifiers.cpp's grid). out and lse
// come from the flash forward of the same inputs and valid modifiers, as in training.
//
// Invalid calls must raise flashattn::Error and leave dq, dk, dv and dsinks untouched. Valid
// calls must not throw, must write nothing around the three gradients, and must match the fp64
// reference
// (detail::reference_backward_f64, which recomputes P from q and k and trusts neither out nor
// lse) element by element: non-finite exactly where the reference is, and finite values within
// the bound below.
//
// The bound follows the error of every quantity the fast paths compute, per query row i and
// visible key j, from fp64 values of what they read (u = 2^-24):
//   P_ij = exp(scale·s_ij − lse_i), with s_ij = q_i·k_j and a_ij = scale·Σ_d |q_id·k_jd|. The
//     computed P is within a factor e^(±ε_ij) of it, plus 2^-125 absolute (exp flushes
//     results below 2^-125), where ε_ij = (D + 3)·u·a_ij (the fp32 dot product and the scale)
//     + 2u·|scale·s_ij − lse_i| + 4u (the subtraction, its product by log2 e for the base-2
//     exp, and the exp) + |lse_i − lse_i,exact| (the
//     given lse is the forward's, itself rounded) + scale·D·t (flushed products, see t below).
//   dP_ij = dO_i·v_j within (D + 2)·u·Σ_d |dO_id·v_jd| + D·t.
//   D_i = rowsum(dO_i ∘ out_i) within |D_i,given − D_i,exact| (out is the forward's, rounded to
//     the dtype) + (D + 2)·u·Σ_d |dO_id·out_id| + D·t.
//   dS_ij = P_ij·(dP_ij − D_i): with c_ij an upper bound of |dP − D| as computed and e_P the
//     P error above, within e_P·c + P·(dP and D errors) + 3u·(P + e_P)·c.
//   Each gradient element is then a sum of n products (n = Skv for dQ, the GQA group's
//     Hq/Hkv · Sq rows for dK and dV): Σ |operand error|·|other operand| + ((n + 2)·u + u_p)·Σ
//     |computed operand|·|other operand| (both times scale for dQ and dK, whose dS operand
//     carries it) + t·Σ (|other operand| + 2), plus u_out·|reference| and half the smallest
//     denormal of the output dtype.
// u_p = u_in for f16 and bf16 (P and dS may be rounded to the input dtype as operands, as the
// bf16 products on AMX do) and 0 for f32; t = 2^-126 for bf16 (the tile instructions flush
// fp32 results below the smallest normal float, and a bf16 operand below it counts as 0), else
// 2^-149 (the absolute spacing of denormal results); scale·P, which the fast paths form before
// multiplying by dP − D_i (for dbias: P·(dP − D_i), before the scale), may round by t too, an
// error the other factor then scales. Values are small
// integers times 2^e (|x| <= 2^15) and the scale at most 2^60, so nothing overflows fp32 (an f16
// gradient may round to ±inf where the bound reaches past 65504); where ε is so large that e^ε
// overflows, a finite reference value is not compared.
//
// With score modifiers the logit z_ij replaces scale·s_ij (lse_i then includes the sink), and
// the fp32 logit's error replaces (D + 3)·u·a_ij + scale·D·t in ε_ij, as fuzz_attention.cpp
// derives it: under a softcap c, min(that, 2c) + 8·u·c; with ALiBi (A_ij = |slope|·|distance|)
// u·(|z_ij| + 2·A_ij) more, |z_ij| bounded by c or a_ij before the ALiBi term. A softcap
// multiplies dS by g = 1 − tanh² computed from the fp32 tanh, whose error δt is the logit's
// error over c (at most 2) plus 6u; then |g − g_exact| <= (2·|tanh| + δt)·δt + 2u, and dS's
// bound becomes e_dS·g_hi + dS_hi·e_g + u·dS_hi·g_hi (one more product), with g_hi = g + e_g.
// dsinks_h = −Σ_i exp(σ_h − lse_i)·D_i: the fast paths take lse and out from the forward and
// sum in fp64, so each row's term is off by |exp(σ − lse)·D_i,given − exp(σ − lse_exact)·
// D_i,exact| (the forward's rounding, known here) plus exp(σ − lse)·((D + 3)·u·Σ_d |dO_id·out_id|
// + D·t) (the fp32 D_i, rounded once more to fp32, with a u to spare for the fp64 exp and
// sums), and the result is rounded once to fp32. A bias adds u·(|z_ij| + |β_ij|) to the logit's
// error (fuzz_attention.cpp); keys whose logit is −inf (a −inf bias, a key the mask drops) have
// P = dS = 0 on every path, and a row with no other key has zero gradients. dbias sums the
// logits' gradient P ∘ (dP − D_i) (dS before the softcap's g and the scale) over the dims the
// bias broadcasts, in fp64, rounded once to the bias's dtype: within the sum of those terms'
// e_dS, each plus t (the fp32 product may be subnormal).

#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "api/backends.hpp"
#include "flashattn/dtype.hpp"
#include "flashattn/flashattn.hpp"
#include "fuzz_support.hpp"
#include "reference/logits.hpp"

namespace {

using flashattn::AttentionImpl;
using flashattn::AttentionOptions;
using flashattn::DType;
using namespace fuzz_support;

struct Problem {
  AttentionImpl impl = AttentionImpl::flash;
  DType dtype = DType::f32;
  Tensor q, k, v, out, dout, dq, dk, dv;
  std::vector<float> lse;
  AttentionOptions options;
  std::vector<float> alibi_slopes, sinks;  // what options.alibi_slopes and options.sinks view
  std::vector<std::uint8_t> dsinks_bytes;  // [heads_q] fp32, sentinel-filled
  float* dsinks = nullptr;  // ModifierGradients::dsinks: into dsinks_bytes (or, refused, sinks)
  // Modifiers the API must refuse: the backward gets them, the forward (which makes out and
  // lse) runs without them.
  bool refused_softcap = false, refused_alibi = false, refused_sinks = false;
  bool refused_dsinks = false;   // dsinks without sinks, or aliasing them
  FuzzedLogitViews logit_views;  // what options.bias and options.mask view
  Tensor dbias;                  // ModifierGradients::dbias when want_dbias
  bool want_dbias = false;
  std::string description;

  bool refused_modifier() const {
    return refused_softcap || refused_alibi || refused_sinks || refused_dsinks ||
           logit_views.refused;
  }
  flashattn::TensorView dbias_view() {
    if (!want_dbias) return {};
    return {dbias.buffer.bytes.data(), logit_views.bias_dtype, dbias.shape, dbias.strides};
  }
  AttentionOptions forward_options() const {
    AttentionOptions forward = options;
    if (refused_softcap) forward.softcap = 0.0f;
    if (refused_alibi) forward.alibi_slopes = {};
    if (refused_sinks) forward.sinks = {};
    if (logit_views.refused) forward.bias = {}, forward.mask = {};
    return forward;
  }

  flashattn::ConstTensorView view(const Tensor& t) const {
    return {t.buffer.bytes.data(), dtype, t.shape, t.strides};
  }
  flashattn::TensorView view(Tensor& t) {
    return {t.buffer.bytes.data(), dtype, t.shape, t.strides};
  }
};

[[noreturn]] void finding(const Problem& p, const std::string& what) {
  report_finding("fuzz_backward", p.description, what);
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
    p.refused_softcap = true;
  }

  // Slopes up to 2^7 and distances up to 600 keep every ALiBi term far inside fp32.
  const int alibi = in.ConsumeIntegralInRange(0, 7);
  if (alibi >= 4) {
    p.refused_alibi = alibi == 7;
    const bool wrong_length = p.refused_alibi && in.ConsumeBool();
    const std::int64_t n = wrong_length ? refused_length(in, heads_q, shape.batch)
                           : alibi == 6 ? shape.batch * heads_q
                                        : heads_q;
    p.alibi_slopes = modifier_values(in, n, in.ConsumeIntegralInRange(-8, 4));
    if (p.refused_alibi && !wrong_length) make_non_finite(in, p.alibi_slopes);
    p.options.alibi_slopes = p.alibi_slopes;
  }

  // 4, 5: sinks and their gradient; 6: sinks alone; 7: refused, as a wrong length, a non-finite
  // sink, dsinks without sinks or dsinks on the sinks themselves (an input).
  const int sinks = in.ConsumeIntegralInRange(0, 7);
  const int refused = sinks == 7 ? in.ConsumeIntegralInRange(0, 3) : -1;
  p.dsinks_bytes.assign(static_cast<std::size_t>(heads_q) * sizeof(float), kSentinelByte);
  if (sinks == 4 || sinks == 5 || refused == 2) {
    p.dsinks = reinterpret_cast<float*>(p.dsinks_bytes.data());
  }
  if (sinks >= 4 && refused != 2) {
    const std::int64_t n = refused == 0 ? refused_length(in, heads_q, 0) : heads_q;
    p.sinks = modifier_values(in, n, in.ConsumeIntegralInRange(-8, 12));
    if (refused == 1) make_non_finite(in, p.sinks);
    if (refused == 3) p.dsinks = p.sinks.data();
    p.options.sinks = p.sinks;
  }
  p.refused_sinks = refused == 0 || refused == 1;
  p.refused_dsinks = refused == 2 || refused == 3;
}

void describe_modifiers(std::ostream& text, const Problem& p) {
  text << " softcap " << p.options.softcap << " alibi [";
  for (float slope : p.alibi_slopes) text << " " << slope;
  text << " ] sinks [";
  for (float sink : p.sinks) text << " " << sink;
  text << " ] dsinks "
       << (p.dsinks == nullptr          ? "none"
           : p.dsinks == p.sinks.data() ? "on the sinks"
                                        : "own buffer");
}

Problem make_problem(FuzzedDataProvider& in) {
  Problem p;
  p.impl = fuzzed_impl(in);
  p.dtype = fuzzed_dtype(in);
  // Half the forward target's budget: the reference backward and the bound cost several
  // forwards.
  const FuzzedShape shape = fuzzed_shape(in, 1 << 15);
  const Shape q_shape = shape.q(), kv_shape = shape.kv();
  p.q = fuzzed_layout(in, p.dtype, q_shape, true);
  p.k = fuzzed_layout(in, p.dtype, kv_shape, true);
  p.v = fuzzed_layout(in, p.dtype, shape.v(), true);
  p.dout = fuzzed_layout(in, p.dtype, shape.out(), true);
  p.out = fuzzed_layout(in, p.dtype, shape.out(), false);
  p.dq = fuzzed_layout(in, p.dtype, q_shape, false);
  p.dk = fuzzed_layout(in, p.dtype, kv_shape, false);
  p.dv = fuzzed_layout(in, p.dtype, shape.v(), false);
  for (Tensor* gradient : {&p.dq, &p.dk, &p.dv}) mark_view(*gradient);
  p.lse.assign(static_cast<std::size_t>(std::max<std::int64_t>(shape.lse_elements(), 1)), 0.0f);
  p.options = fuzzed_options(in);

  const bool specials = in.ConsumeIntegralInRange(0, 3) == 0;
  for (Tensor* input : {&p.q, &p.k, &p.v, &p.dout}) {
    fill(*input, p.dtype, in, in.ConsumeIntegralInRange(-12, 12), specials, true);
  }
  fuzzed_modifiers(in, p, shape);
  p.logit_views = fuzzed_logit_views(in, shape);
  p.logit_views.apply(p.options);
  if (p.logit_views.has_bias && in.ConsumeBool()) {
    p.want_dbias = true;
    p.dbias = fuzzed_layout(in, p.logit_views.bias_dtype, p.logit_views.bias.shape, false);
    mark_view(p.dbias);
  }

  std::ostringstream text;
  text << flashattn::impl_name(p.impl) << " " << flashattn::dtype_name(p.dtype);
  describe_tensor(text, "q", p.q);
  describe_tensor(text, "k", p.k);
  describe_tensor(text, "v", p.v);
  describe_tensor(text, "dout", p.dout);
  describe_tensor(text, "out", p.out);
  describe_tensor(text, "dq", p.dq);
  describe_tensor(text, "dk", p.dk);
  describe_tensor(text, "dv", p.dv);
  describe_options(text, p.options);
  describe_modifiers(text, p);
  p.logit_views.describe(text);
  if (p.want_dbias) describe_tensor(text, "dbias", p.dbias);
  text << " specials " << specials;
  p.description = text.str();
  return p;
}

struct Call {
  flashattn::ConstTensorView dout, q, k, v, out;
  const float* lse;
  flashattn::TensorView dq, dk, dv;
};

// Turns the call invalid; false when this corruption cannot apply to this problem.
bool corrupt(Problem& p, int kind, Call& c) {
  const bool has_queries =
      std::all_of(c.dq.shape.begin(), c.dq.shape.end(), [](std::int64_t d) { return d > 0; });
  const bool has_keys =
      std::all_of(c.dk.shape.begin(), c.dk.shape.end(), [](std::int64_t d) { return d > 0; });
  switch (kind) {
    case 0:
      c.dout.shape[1] += 1;
      return true;
    case 1:
      c.dq.shape[3] += 1;
      return true;
    case 2:
      c.dk.dtype = p.dtype == DType::f32 ? DType::bf16 : DType::f32;
      return true;
    case 3:
      c.dv.shape[2] += 1;
      return true;
    case 4:
      if (!has_queries) return false;
      c.lse = nullptr;
      return true;
    case 5:
      if (!has_queries) return false;
      c.dq.data = const_cast<void*>(c.q.data);
      return true;
    case 6:
      if (!has_keys) return false;
      c.dk.data = c.dv.data;
      return true;
    case 7:
      if (!has_keys || c.dv.shape[1] < 2) return false;
      c.dv.strides[1] = 0;
      return true;
    case 8:
      if (!has_queries) return false;
      c.dout.data = nullptr;
      return true;
    case 9:
      if (!has_queries) return false;
      c.dq.data = const_cast<float*>(c.lse);
      return true;
    case 10:
      c.out.shape[2] += 1;
      return true;
    case 11:
      p.options.softmax_scale = std::array<float, 3>{0.0f, -1.0f, NAN}[p.q.shape[1] % 3];
      return true;
    case 12:
      p.options.num_threads = -1;
      return true;
    case 13:
      p.options.dropout_p = std::array<float, 3>{1.0f, -0.25f, NAN}[p.q.shape[1] % 3];
      return true;
    default:
      return false;
  }
}

// fp64 copies of the operands, [batch, seq, heads, D] contiguous (v, out and dout: Dv).
struct Operands {
  std::vector<double> q, k, v, out, dout;
};

// Per-element error bounds of dq, dk, dv (contiguous like the reference's) and dsinks, as
// derived above.
struct Bounds {
  std::vector<double> dq, dk, dv, dsinks;
  std::vector<double> dlogits;  // [B, Hq, Sq, Skv], the logits' gradient's (dbias asked for)
};

__attribute__((no_sanitize("coverage"))) Bounds gradient_bounds(
    const Problem& p, const flashattn::detail::BackwardParams& bp, const Operands& x) {
  const flashattn::detail::AttentionParams& f = bp.forward;
  const std::int64_t B = f.batch, Sq = f.seqlen_q, Skv = f.seqlen_kv, Hq = f.heads_q,
                     Hkv = f.heads_kv, D = f.head_dim, Dv = f.head_dim_v, group = f.group_size();
  const double u = kU32, scale = f.scale;
  const double u_p = p.dtype == DType::f32 ? 0.0 : unit_roundoff(p.dtype);
  const double t = p.dtype == DType::bf16 ? 0x1p-126 : 0x1p-149;
  const double gamma_q = static_cast<double>(Skv + 2) * u + u_p;          // dQ's sums over keys
  const double gamma_kv = static_cast<double>(group * Sq + 2) * u + u_p;  // dK's, dV's over rows
  const flashattn::detail::ScoreModifiers& modifiers = f.modifiers;
  const double softcap = modifiers.softcap;
  Bounds bound{std::vector<double>(x.q.size()), std::vector<double>(x.k.size()),
               std::vector<double>(x.v.size()), std::vector<double>(static_cast<std::size_t>(Hq)),
               std::vector<double>(
                   bp.dbias.data == nullptr ? 0 : static_cast<std::size_t>(B * Hq * Sq * Skv))};
  // Per visible key of one row: the logit, its d/d(scale·s), dP, and the upper bounds and
  // errors of P and dS.
  std::vector<double> scores(static_cast<std::size_t>(Skv)), derivative(scores.size()),
      dp(scores.size()), p_hi(scores.size()), p_err(scores.size()), ds_hi(scores.size()),
      ds_err(scores.size()), ds_tiny(scores.size());
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < Hq; ++h) {
      const std::int64_t h_kv = f.kv_head(h);
      const double slope = std::abs(static_cast<double>(modifiers.alibi_slope(b, h)));
      const double sink = flashattn::detail::reference_sink(f, h);
      // dsinks_h's bound: the rows' terms, and the magnitudes their fp64 sums round against.
      double dsink_error = 0.0, dsink_magnitude = 0.0;
      auto k_row = [&](std::int64_t j) { return x.k.data() + ((b * Skv + j) * Hkv + h_kv) * D; };
      auto v_row = [&](std::int64_t j) { return x.v.data() + ((b * Skv + j) * Hkv + h_kv) * Dv; };
      for (std::int64_t i = 0; i < Sq; ++i) {
        const flashattn::detail::KeyRange keys = f.key_range(i);
        if (keys.empty()) continue;
        const double* q = x.q.data() + ((b * Sq + i) * Hq + h) * D;
        const double* dout = x.dout.data() + ((b * Sq + i) * Hq + h) * Dv;
        const double* out = x.out.data() + ((b * Sq + i) * Hq + h) * Dv;
        // The exact softmax of the row (the sink's logit in it), and D_i exact and as the fast
        // paths get it.
        double max_score = sink;
        for (std::int64_t j = keys.begin; j < keys.end; ++j) {
          double s = 0.0;
          for (std::int64_t d = 0; d < D; ++d) s += q[d] * k_row(j)[d];
          scores[j] = flashattn::detail::reference_logit(f, b, h, i, j, scale * s, &derivative[j]);
          max_score = std::max(max_score, scores[j]);
        }
        // Under a bias or mask, a row whose logits are all −inf has zero gradients.
        if (modifiers.masks_logits() && max_score == -INFINITY) continue;
        auto dropped = [&](std::int64_t j) { return scores[j] == -INFINITY; };
        double sum = std::exp(sink - max_score);
        for (std::int64_t j = keys.begin; j < keys.end; ++j) sum += std::exp(scores[j] - max_score);
        const double lse_exact = max_score + std::log(sum);
        const double lse = p.lse[static_cast<std::size_t>(f.lse_index(b, h, i))];
        double delta_exact = 0.0, delta_given = 0.0, delta_abs = 0.0;
        for (std::int64_t j = keys.begin; j < keys.end; ++j) {
          if (dropped(j)) continue;
          double dot = 0.0;
          for (std::int64_t d = 0; d < Dv; ++d) dot += dout[d] * v_row(j)[d];
          dp[j] = dot;
          delta_exact += std::exp(scores[j] - lse_exact) * dot;
        }
        for (std::int64_t d = 0; d < Dv; ++d) {
          delta_given += dout[d] * out[d];
          delta_abs += std::abs(dout[d] * out[d]);
        }
        const double delta_err = std::abs(delta_given - delta_exact) +
                                 static_cast<double>(Dv + 2) * u * delta_abs +
                                 static_cast<double>(Dv) * t;
        if (modifiers.sinks != nullptr) {
          // The fast paths' term against the reference's (exp(σ − lse_exact)·D_i,exact).
          const double weight = std::exp(sink - lse), weight_exact = std::exp(sink - lse_exact);
          double weighted_abs = 0.0;
          for (std::int64_t j = keys.begin; j < keys.end; ++j) {
            if (!dropped(j)) weighted_abs += std::exp(scores[j] - lse_exact) * std::abs(dp[j]);
          }
          dsink_error +=
              std::abs(weight * delta_given - weight_exact * delta_exact) +
              weight * (static_cast<double>(Dv + 3) * u * delta_abs + static_cast<double>(Dv) * t);
          dsink_magnitude += weight * delta_abs + weight_exact * weighted_abs;
        }
        for (std::int64_t j = keys.begin; j < keys.end; ++j) {
          if (dropped(j)) {
            p_err[j] = p_hi[j] = ds_err[j] = ds_hi[j] = ds_tiny[j] = 0.0;
            continue;
          }
          double magnitude = 0.0, dp_abs = 0.0;
          for (std::int64_t d = 0; d < D; ++d) magnitude += std::abs(q[d] * k_row(j)[d]);
          for (std::int64_t d = 0; d < Dv; ++d) dp_abs += std::abs(dout[d] * v_row(j)[d]);
          const double exact = std::exp(scores[j] - lse_exact);
          // The fp32 logit's error and a bound of its magnitude (see the top of the file).
          const double score_error = static_cast<double>(D + 3) * u * scale * magnitude +
                                     scale * static_cast<double>(D) * t;
          double logit_error = score_error, logit = scale * magnitude;
          if (softcap > 0) {
            logit_error = std::min(score_error, 2 * softcap) + 8 * u * softcap;
            logit = softcap;
          }
          if (slope > 0) {
            const double alibi = slope * static_cast<double>(std::abs(i + Skv - Sq - j));
            logit_error += u * (logit + 2 * alibi);
            logit += alibi;
          }
          if (modifiers.bias.data != nullptr) {
            const double bias = std::abs(static_cast<double>(modifiers.bias.bias(b, h, i, j)));
            logit_error += u * (logit + bias);
          }
          const double epsilon =
              logit_error + 2 * u * std::abs(scores[j] - lse) + 4 * u + std::abs(lse - lse_exact);
          p_err[j] = exact * std::expm1(epsilon) + 0x1p-125;
          p_hi[j] = exact + p_err[j];
          const double dp_err =
              static_cast<double>(Dv + 2) * u * dp_abs + static_cast<double>(Dv) * t;
          const double centered = std::abs(dp[j] - delta_exact) + dp_err + delta_err;
          ds_err[j] =
              p_err[j] * centered + exact * (dp_err + delta_err) + 3 * u * p_hi[j] * centered;
          ds_hi[j] = p_hi[j] * centered;
          // The fast paths form scale·P first (or, for dbias, P·(dP − D_i) and then the scale):
          // below 2^-126 it rounds by up to t absolute, which the other factor then scales
          // (scale·dS's error, already scaled).
          ds_tiny[j] = t * (centered + scale);
          if (!bound.dlogits.empty()) {
            // The fp32 product P·(dP − D_i) may land below 2^-126: t more, absolute.
            bound.dlogits[static_cast<std::size_t>(((b * Hq + h) * Sq + i) * Skv + j)] =
                ds_err[j] + t;
          }
          if (softcap > 0) {
            const double tanh = std::sqrt(std::max(0.0, 1.0 - derivative[j]));
            const double tanh_err = std::min(score_error / softcap, 2.0) + 6 * u;
            const double g_err = (2 * tanh + tanh_err) * tanh_err + 2 * u;
            const double g_hi = derivative[j] + g_err;
            ds_err[j] = ds_err[j] * g_hi + ds_hi[j] * g_err + u * ds_hi[j] * g_hi;
            ds_hi[j] *= g_hi;
          }
        }
        // dQ_i = scale·Σ_j dS_ij K_j; dK_j += scale·dS_ij Q_i; dV_j += P_ij dO_i.
        double* dq = bound.dq.data() + ((b * Sq + i) * Hq + h) * D;
        for (std::int64_t j = keys.begin; j < keys.end; ++j) {
          const double* k = k_row(j);
          double* dk = bound.dk.data() + ((b * Skv + j) * Hkv + h_kv) * D;
          double* dv = bound.dv.data() + ((b * Skv + j) * Hkv + h_kv) * Dv;
          for (std::int64_t d = 0; d < D; ++d) {
            dq[d] += (scale * (ds_err[j] + gamma_q * ds_hi[j]) + ds_tiny[j]) * std::abs(k[d]) +
                     t * (std::abs(k[d]) + 2);
            dk[d] += (scale * (ds_err[j] + gamma_kv * ds_hi[j]) + ds_tiny[j]) * std::abs(q[d]) +
                     t * (std::abs(q[d]) + 2);
          }
          for (std::int64_t d = 0; d < Dv; ++d) {
            dv[d] +=
                (p_err[j] + gamma_kv * p_hi[j]) * std::abs(dout[d]) + t * (std::abs(dout[d]) + 2);
          }
        }
      }
      // 2^-40 bounds the fp64 sums' rounding, both sides, for far fewer than 2^12 rows.
      bound.dsinks[static_cast<std::size_t>(h)] += dsink_error + 0x1p-40 * dsink_magnitude;
    }
  }
  return bound;
}

double largest_finite(DType dtype) {
  return dtype == DType::f16 ? 65504.0 : std::numeric_limits<float>::max();
}

__attribute__((no_sanitize("coverage"))) void check_against_reference(
    const Problem& p, const flashattn::detail::BackwardParams& bp) {
  const flashattn::detail::AttentionParams& f = bp.forward;
  const std::int64_t B = f.batch, Sq = f.seqlen_q, Skv = f.seqlen_kv, Hq = f.heads_q,
                     Hkv = f.heads_kv, D = f.head_dim, Dv = f.head_dim_v;
  std::vector<double> ref_dq(static_cast<std::size_t>(B * Sq * Hq * D));
  std::vector<double> ref_dk(static_cast<std::size_t>(B * Skv * Hkv * D));
  std::vector<double> ref_dv(static_cast<std::size_t>(B * Skv * Hkv * Dv));
  std::vector<double> ref_dsinks(bp.dsinks == nullptr ? 0 : static_cast<std::size_t>(Hq));
  std::vector<double> ref_dlogits(
      bp.dbias.data == nullptr ? 0 : static_cast<std::size_t>(B * Hq * Sq * Skv));
  flashattn::detail::reference_backward_f64(
      bp, ref_dq.data(), ref_dk.data(), ref_dv.data(),
      bp.dsinks == nullptr ? nullptr : ref_dsinks.data(),
      bp.dbias.data == nullptr ? nullptr : ref_dlogits.data());
  const bool exact = p.impl == AttentionImpl::reference;
  Bounds bound;
  if (!exact) {
    const Operands x{to_f64(f.q, p.dtype, f.q_strides, B, Sq, Hq, D),
                     to_f64(f.k, p.dtype, f.k_strides, B, Skv, Hkv, D),
                     to_f64(f.v, p.dtype, f.v_strides, B, Skv, Hkv, Dv),
                     to_f64(f.out, p.dtype, f.out_strides, B, Sq, Hq, Dv),
                     to_f64(bp.dout, p.dtype, bp.dout_strides, B, Sq, Hq, Dv)};
    bound = gradient_bounds(p, bp, x);
  }
  const double u_out = unit_roundoff(p.dtype), floor = half_smallest_denormal(p.dtype);
  struct Gradient {
    const char* name;
    const Tensor& tensor;
    const std::vector<double>& want;
    const std::vector<double>& bound;
    std::int64_t seq, heads;
  };
  const Gradient gradients[] = {{"dq", p.dq, ref_dq, bound.dq, Sq, Hq},
                                {"dk", p.dk, ref_dk, bound.dk, Skv, Hkv},
                                {"dv", p.dv, ref_dv, bound.dv, Skv, Hkv}};
  // Whether `got` (rounded to a type with unit roundoff u_out, smallest denormal 2·floor and
  // largest finite value `largest`) may stand for `want` computed within `derived`.
  auto matches = [](double got, double want, double derived, double u_out, double floor,
                    double largest, double& tolerance) {
    tolerance = 0.0;
    // An infinity or NaN reaches exactly the elements it reaches in the reference (whether
    // as ±inf or NaN may differ, as in the forward).
    if (!std::isfinite(want)) return !std::isfinite(got);
    // e^ε overflowed (scores too large for fp32 to pin P down): no bound holds the value.
    if (!std::isfinite(derived)) return true;
    // The computed value, within `derived` of want, is rounded once to the output dtype.
    tolerance = derived * (1 + u_out) + u_out * std::abs(want) + floor;
    // A result allowed past the dtype's largest finite value may round to ±inf.
    if (got == INFINITY && want + tolerance > largest) return true;
    if (got == -INFINITY && want - tolerance < -largest) return true;
    return std::isfinite(got) && std::abs(got - want) <= tolerance;
  };
  for (const Gradient& g : gradients) {
    std::size_t index = 0;
    for_each_index(g.tensor.shape, [&](auto b, auto s, auto h, auto d) {
      const double want = g.want[index];
      const double derived = exact ? 0.0 : g.bound[index];
      ++index;
      const double got =
          load_f32(g.tensor.buffer.bytes.data(), p.dtype, g.tensor.offset(b, s, h, d));
      double tolerance = 0.0;
      if (!matches(got, want, derived, u_out, floor, largest_finite(p.dtype), tolerance)) {
        std::ostringstream what;
        what << g.name << "[b=" << b << ", s=" << s << ", h=" << h << ", d=" << d << "] = " << got
             << ", reference " << want << ", tolerance " << tolerance;
        finding(p, what.str());
      }
    });
    const std::int64_t written = written_around_view(g.tensor, p.dtype);
    if (written >= 0) {
      finding(p, std::string("wrote padding element ") + std::to_string(written) + " of " + g.name);
    }
  }
  // dbias: the reference's and the bound's logit gradients summed over the broadcast dims.
  if (bp.dbias.data != nullptr) {
    const flashattn::TensorView& dbias = bp.dbias;
    const DType dtype = dbias.dtype;
    for_each_index(dbias.shape, [&](auto bb, auto hb, auto i, auto j) {
      double want = 0.0, derived = 0.0;
      for (std::int64_t b = 0; b < B; ++b) {
        for (std::int64_t h = 0; h < Hq; ++h) {
          if ((dbias.shape[0] != 1 && b != bb) || (dbias.shape[1] != 1 && h != hb)) continue;
          const auto at = static_cast<std::size_t>(((b * Hq + h) * Sq + i) * Skv + j);
          want += ref_dlogits[at];
          if (!exact) derived += bound.dlogits[at];
        }
      }
      const double got = load_f32(dbias.data, dtype, p.dbias.offset(bb, hb, i, j));
      double tolerance = 0.0;
      if (!matches(got, want, derived, unit_roundoff(dtype), half_smallest_denormal(dtype),
                   largest_finite(dtype), tolerance)) {
        std::ostringstream what;
        what << "dbias[" << bb << ", " << hb << ", " << i << ", " << j << "] = " << got
             << ", reference " << want << ", tolerance " << tolerance;
        finding(p, what.str());
      }
    });
    const std::int64_t written = written_around_view(p.dbias, dtype);
    if (written >= 0) finding(p, "wrote padding element " + std::to_string(written) + " of dbias");
  }
  // dsinks is fp32 whatever the dtype.
  for (std::size_t h = 0; h < ref_dsinks.size(); ++h) {
    const double got = bp.dsinks[h], want = ref_dsinks[h];
    double tolerance = 0.0;
    if (!matches(got, want, exact ? 0.0 : bound.dsinks[h], kU32, half_smallest_denormal(DType::f32),
                 largest_finite(DType::f32), tolerance)) {
      std::ostringstream what;
      what << "dsinks[" << h << "] = " << got << ", reference " << want << ", tolerance "
           << tolerance;
      finding(p, what.str());
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  const int corruption =
      in.ConsumeIntegralInRange(0, 7) == 0 ? in.ConsumeIntegralInRange(0, 13) : -1;
  Problem p = make_problem(in);
  try {
    flashattn::flash_attention_forward(p.view(p.q), p.view(p.k), p.view(p.v), p.view(p.out),
                                       p.lse.data(), p.forward_options());
  } catch (const flashattn::Error& error) {
    finding(p, std::string("the forward of a valid problem raised Error: ") + error.what());
  }
  Call c{p.view(p.dout), p.view(p.q),  p.view(p.k),  p.view(p.v), p.view(p.out),
         p.lse.data(),   p.view(p.dq), p.view(p.dk), p.view(p.dv)};
  const flashattn::ModifierGradients modifier_gradients{p.dsinks, p.dbias_view()};

  // A corruption that cannot apply skips the input, unless a refused modifier makes the call
  // invalid anyway.
  bool invalid = p.refused_modifier();
  if (corruption >= 0) {
    if (corrupt(p, corruption, c)) {
      invalid = true;
      p.description += " corruption " + std::to_string(corruption);
    } else if (!invalid) {
      return 0;
    }
  }
  if (invalid) {
    const std::vector<std::uint8_t> before[] = {p.dq.buffer.bytes, p.dk.buffer.bytes,
                                                p.dv.buffer.bytes, p.dsinks_bytes,
                                                p.dbias.buffer.bytes};
    const std::vector<float> sinks_before = p.sinks;
    try {
      flashattn::attention_backward(p.impl, c.dout, c.q, c.k, c.v, c.out, c.lse, c.dq, c.dk, c.dv,
                                    p.options, modifier_gradients);
    } catch (const flashattn::Error&) {
      if (p.dq.buffer.bytes != before[0] || p.dk.buffer.bytes != before[1] ||
          p.dv.buffer.bytes != before[2] || p.dsinks_bytes != before[3] ||
          p.dbias.buffer.bytes != before[4]) {
        finding(p, "an invalid call wrote a gradient before raising Error");
      }
      // Compared bitwise: a refused sink may be NaN.
      if (!p.sinks.empty() &&
          std::memcmp(p.sinks.data(), sinks_before.data(), p.sinks.size() * sizeof(float)) != 0) {
        finding(p, "an invalid call wrote dsinks over the sinks before raising Error");
      }
      return 0;
    }
    finding(p, "an invalid call did not raise flashattn::Error");
  }

  try {
    flashattn::attention_backward(p.impl, c.dout, c.q, c.k, c.v, c.out, c.lse, c.dq, c.dk, c.dv,
                                  p.options, modifier_gradients);
  } catch (const flashattn::Error& error) {
    finding(p, std::string("a valid call raised Error: ") + error.what());
  }
  const flashattn::detail::BackwardParams params = flashattn::detail::make_backward_params(
      "fuzz", c.dout, c.q, c.k, c.v, c.out, c.lse, c.dq, c.dk, c.dv, p.options, modifier_gradients);
  check_against_reference(p, params);
  return 0;
}
