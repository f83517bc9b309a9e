// Score modifiers (options.hpp: softcap, ALiBi, sinks, bias, mask) on every path: worked
// examples with their numbers written out, the fp64 reference's backward against finite
// differences, the flash and standard forward and backward against the reference over shapes that
// break tiling (the decode path, GQA, causal and windows, f16 and bf16, strided layouts), varlen
// and the KV cache, and bad input.
//
// Tolerances extend those of test_attention_vs_reference.cpp and test_backward.cpp by what the
// modifiers add to a logit's rounding. A logit is softcap·tanh(x / softcap) − slope·|distance|:
// Highway's tanh is within 4 ulp of tanh, so the cap adds up to 4·u32·softcap, and the ALiBi
// term A = max slope · max distance adds a rounding of its product and of the sum, 2·u32·A, to
// every logit; the first-order bounds therefore gain 4·A + 8·softcap beside the score term
// 4·scale·D·max|q|·max|k|, and the flash path's floor 4·u32·(A + softcap) beside its 4 score
// roundings. The sink is one more term of the normalizer (Skv + 1 terms instead of Skv). A bias
// adds one fp32 rounding of (logit + bias) to each logit: 4·max|bias| more in the first-order
// bounds and the floor (f16 and bf16 biases widen exactly). dbias sums the logits' gradients
// P ∘ (dP − D_i) of n (batch, head) pairs; each is off by the first-order bound of P times
// |dP − D_i| <= 2·D·max|dO|·max|v|, and by as much again through dP's own rounding.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cpu/kernels/score_modifiers.hpp"
#include "test_support.hpp"

namespace flashattn::testing {
namespace {

enum class Alibi { off, shared, per_entry };
// Bias shapes: [B, Hq, Sq, Skv]; [1, 1, Sq, Skv]; [1, Hq, Sq, Skv]; [B, 1, Sq, Skv]; one row for
// every query row ([1, Hq, Sq, Skv] with row stride 0); [1, 1, Sq, Skv] stored column-major.
enum class Bias { off, full, shared, per_head, per_batch, row_broadcast, transposed };
// Masks: random keys ([B, 1, Sq, Skv]); documents on the diagonal ([1, 1, Sq, Skv]); random with
// whole rows and a whole 64 x 64 region dropped ([1, Hq, Sq, Skv], key stride 2).
enum class Mask { off, random, documents, empty_rows };

struct ModifierCase {
  std::int64_t batch, seqlen_q, seqlen_kv, heads_q, heads_kv, head_dim;
  float softcap = 0.0f;
  Alibi alibi = Alibi::off;
  bool sinks = false;
  bool causal = false;
  std::int64_t window_left = -1, window_right = -1;
  DType dtype = DType::f32;
  int threads = 2;
  bool head_major = false;   // the seed's [B, H, S, D] memory seen as [B, S, H, D]
  float q_gain = 1.0f;       // scales q: scores far beyond the softcap saturate its tanh
  float sink_offset = 0.0f;  // added to every sink: sinks above every score
  Bias bias = Bias::off;
  DType bias_dtype = DType::f32;
  bool infinite_bias = false;  // −inf in about 1 bias entry of 8
  Mask mask = Mask::off;
  float dropout = 0.0f;  // dropout_p, with a seed and offset drawn from the case's seed
};

std::string describe(const ModifierCase& c) {
  static const char* alibi[] = {"", "_alibi", "_alibiB"};
  std::ostringstream text;
  text << "B" << c.batch << "_Sq" << c.seqlen_q << "_Skv" << c.seqlen_kv << "_Hq" << c.heads_q
       << "_Hkv" << c.heads_kv << "_D" << c.head_dim;
  if (c.softcap > 0.0f) text << "_cap" << c.softcap;
  text << alibi[static_cast<int>(c.alibi)] << (c.sinks ? "_sinks" : "")
       << (c.causal ? "_causal" : "");
  if (c.window_left >= 0 || c.window_right >= 0) {
    text << "_win" << c.window_left << "_" << c.window_right;
  }
  if (c.q_gain != 1.0f) text << "_gain" << c.q_gain;
  if (c.sink_offset != 0.0f) text << "_sinkplus" << c.sink_offset;
  static const char* bias[] = {"", "_bias", "_bias11", "_bias1H", "_biasB1", "_biasrow", "_biasT"};
  static const char* mask[] = {"", "_mask", "_docs", "_maskempty"};
  text << bias[static_cast<int>(c.bias)];
  if (c.bias != Bias::off && c.bias_dtype != DType::f32) text << dtype_name(c.bias_dtype);
  text << (c.infinite_bias ? "inf" : "") << mask[static_cast<int>(c.mask)];
  if (c.dropout > 0.0f) text << "_drop" << c.dropout;
  text << "_" << dtype_name(c.dtype) << "_t" << c.threads << (c.head_major ? "_bhsd" : "");
  std::string name = text.str();
  std::replace_if(
      name.begin(), name.end(), [](char ch) { return !std::isalnum(ch); }, '_');
  return name;
}

void PrintTo(const ModifierCase& c, std::ostream* os) { *os << describe(c); }

std::array<std::int64_t, 4> strides_for(bool head_major, std::array<std::int64_t, 4> shape) {
  const auto [B, S, H, D] = shape;
  return head_major ? std::array<std::int64_t, 4>{H * S * D, D, S * D, 1}
                    : contiguous_strides(shape);
}

// The ALiBi paper's slopes for n heads (n a power of two): 2^(−8·(h + 1) / n).
std::vector<float> paper_slopes(std::int64_t heads) {
  std::vector<float> slopes(static_cast<std::size_t>(heads));
  for (std::int64_t h = 0; h < heads; ++h) {
    slopes[h] = std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(heads));
  }
  return slopes;
}

// Inputs, modifier arrays, dO, and the flash forward's out and lse. Not copyable: the options'
// spans point into the arrays.
struct Problem {
  ModifierCase c;
  std::vector<float> slopes, sinks;
  AttentionOptions options;
  Tensor q, k, v, out, dout;
  std::vector<float> lse;
  Tensor bias{DType::f32, {1, 1, 1, 1}};
  std::vector<std::uint8_t> mask_bytes;

  Problem(const ModifierCase& c_, std::uint64_t seed)
      : c(c_),
        q(c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.head_dim},
          strides_for(c.head_major, {c.batch, c.seqlen_q, c.heads_q, c.head_dim})),
        k(c.dtype, {c.batch, c.seqlen_kv, c.heads_kv, c.head_dim},
          strides_for(c.head_major, {c.batch, c.seqlen_kv, c.heads_kv, c.head_dim})),
        v(c.dtype, k.view.shape, k.view.strides),
        out(c.dtype, q.view.shape, q.view.strides),
        dout(c.dtype, q.view.shape, q.view.strides),
        lse(static_cast<std::size_t>(c.batch * c.heads_q * c.seqlen_q)) {
    std::mt19937_64 rng(seed);
    q.fill_normal(rng, c.q_gain);
    k.fill_normal(rng);
    v.fill_normal(rng);
    dout.fill_normal(rng);
    std::normal_distribution<float> normal;
    if (c.alibi != Alibi::off) {
      const std::vector<float> paper = paper_slopes(c.heads_q);
      const std::int64_t entries = c.alibi == Alibi::shared ? 1 : c.batch;
      for (std::int64_t b = 0; b < entries; ++b) {
        for (float slope : paper) slopes.push_back(slope * static_cast<float>(b + 1));
      }
      options.alibi_slopes = slopes;
    }
    if (c.sinks) {
      for (std::int64_t h = 0; h < c.heads_q; ++h) sinks.push_back(normal(rng) + c.sink_offset);
      options.sinks = sinks;
    }
    make_bias(rng);
    make_mask(rng);
    options.softcap = c.softcap;
    options.causal = c.causal;
    options.window_left = c.window_left;
    options.window_right = c.window_right;
    options.num_threads = c.threads;
    options.dropout_p = c.dropout;
    options.dropout_seed = rng();
    options.dropout_offset = static_cast<std::uint32_t>(rng());
    flash_attention_forward(q.view, k.view, v.view, out.view, lse.data(), options);
  }
  Problem(const Problem&) = delete;
  Problem& operator=(const Problem&) = delete;

  void make_bias(std::mt19937_64& rng) {
    if (c.bias == Bias::off) return;
    const std::int64_t B = c.batch, H = c.heads_q, Sq = c.seqlen_q, Skv = c.seqlen_kv;
    std::array<std::int64_t, 4> shape = {B, H, Sq, Skv};
    if (c.bias == Bias::shared || c.bias == Bias::transposed) shape = {1, 1, Sq, Skv};
    if (c.bias == Bias::per_head || c.bias == Bias::row_broadcast) shape = {1, H, Sq, Skv};
    if (c.bias == Bias::per_batch) shape = {B, 1, Sq, Skv};
    std::array<std::int64_t, 4> strides = contiguous_strides(shape);
    if (c.bias == Bias::row_broadcast) strides = {H * Skv, Skv, 0, 1};
    if (c.bias == Bias::transposed) strides = {Sq * Skv, Sq * Skv, 1, Sq};
    bias = Tensor(c.bias_dtype, shape, strides);
    std::normal_distribution<float> normal;
    std::uniform_int_distribution<int> eighth(0, 7);
    bias.for_each_index([&](auto a, auto b, auto i, auto j) {
      bias.set(a, b, i, j, c.infinite_bias && eighth(rng) == 0 ? -INFINITY : normal(rng));
    });
    options.bias = bias.view;
  }

  void make_mask(std::mt19937_64& rng) {
    if (c.mask == Mask::off) return;
    const std::int64_t B = c.batch, H = c.heads_q, Sq = c.seqlen_q, Skv = c.seqlen_kv;
    std::array<std::int64_t, 4> shape = {B, 1, Sq, Skv}, strides = contiguous_strides(shape);
    if (c.mask == Mask::documents) shape = {1, 1, Sq, Skv}, strides = contiguous_strides(shape);
    if (c.mask == Mask::empty_rows)
      shape = {1, H, Sq, Skv}, strides = {0, 2 * Sq * Skv, 2 * Skv, 2};
    std::int64_t extent = 1;
    for (int d = 0; d < 4; ++d) extent += (shape[d] - 1) * strides[d];
    mask_bytes.assign(static_cast<std::size_t>(extent), 0);
    std::uniform_real_distribution<double> uniform;
    // Documents: boundaries every ~Skv/3 keys, the rows split in proportion.
    const std::int64_t documents = 3;
    for (std::int64_t a = 0; a < shape[0]; ++a)
      for (std::int64_t h = 0; h < shape[1]; ++h)
        for (std::int64_t i = 0; i < Sq; ++i)
          for (std::int64_t j = 0; j < Skv; ++j) {
            bool keep = uniform(rng) < 0.7;
            if (c.mask == Mask::documents) {
              keep = i * documents / std::max<std::int64_t>(Sq, 1) ==
                     j * documents / std::max<std::int64_t>(Skv, 1);
            }
            if (c.mask == Mask::empty_rows) {
              keep = keep && i % 5 != 2 && !(i >= 64 && i < 128 && j >= 64 && j < 128);
            }
            mask_bytes[a * strides[0] + h * strides[1] + i * strides[2] + j * strides[3]] = keep;
          }
    options.mask = MaskView{reinterpret_cast<const bool*>(mask_bytes.data()), shape, strides};
  }

  double max_finite_bias() const {
    if (c.bias == Bias::off) return 0.0;
    double largest = 0.0;
    bias.for_each_index([&](auto a, auto b, auto i, auto j) {
      const double value = bias.at(a, b, i, j);
      if (std::isfinite(value)) largest = std::max(largest, std::abs(value));
    });
    return largest;
  }

  // The largest |ALiBi term| any logit carries: A of the header.
  double alibi_extent() const {
    if (slopes.empty()) return 0.0;
    const double slope = *std::max_element(slopes.begin(), slopes.end());
    return slope * static_cast<double>(std::max(c.seqlen_q, c.seqlen_kv));
  }
  // The modifiers' part of the first-order bound (header).
  double modifier_terms() const {
    return 4.0 * alibi_extent() + 8.0 * c.softcap + 4.0 * max_finite_bias();
  }
  double scale() const { return 1.0 / std::sqrt(static_cast<double>(c.head_dim)); }
  // max|v| as the bounds see it: dropout scales the kept probabilities by 1 / (1 − p), so each
  // term of P·V (and of Pᵀ·dO, dO·Vᵀ) is at most that much larger.
  double max_value() const { return max_abs(v) / (1.0 - c.dropout); }
};

MaxError max_lse_error(const std::vector<float>& lse, const std::vector<double>& want) {
  MaxError worst;
  for (std::size_t i = 0; i < lse.size(); ++i) {
    double error = std::abs(lse[i] - want[i]);
    if (std::isinf(want[i])) error = lse[i] == want[i] ? 0.0 : INFINITY;
    if (std::isnan(lse[i])) error = INFINITY;
    if (error > worst.value || worst.index < 0) {
      worst = {error, static_cast<std::int64_t>(i), lse[i], want[i]};
    }
  }
  return worst;
}

struct ForwardErrors {
  double out = 0.0, lse = 0.0;  // the flash path's, against the reference
};

// Standard and flash forward against the reference (tolerances: header and
// test_attention_vs_reference.cpp).
ForwardErrors expect_forward_matches_reference(const Problem& p, const std::string& context) {
  const ModifierCase& c = p.c;
  const ReferenceResult ref = reference(p.q, p.k, p.v, p.options);
  auto run = [&](AttentionImpl impl, std::vector<float>& lse) {
    Tensor out(c.dtype, p.q.view.shape, p.q.view.strides);
    out.poison();
    lse.assign(p.lse.size(), NAN);
    attention_forward(impl, p.q.view, p.k.view, p.v.view, out.view, lse.data(), p.options);
    return out;
  };
  std::vector<float> standard_lse, flash_lse;
  const Tensor standard_out = run(AttentionImpl::standard, standard_lse);
  const Tensor flash_out = run(AttentionImpl::flash, flash_lse);

  const double u32 = unit_roundoff(DType::f32), u_out = unit_roundoff(c.dtype);
  const double qk = max_abs(p.q) * max_abs(p.k), max_v = p.max_value();
  const double max_out = max_abs_finite(ref.out), max_lse = max_abs_finite(ref.lse);
  const double standard_bound = u32 * max_v *
                                    (4.0 * p.scale() * c.head_dim * qk + p.modifier_terms() +
                                     2.0 * (c.seqlen_kv + 1) + 16.0) +
                                u_out * max_out;
  const double floor = 4.0 * u32 * p.scale() * std::sqrt(static_cast<double>(c.head_dim)) * qk +
                       4.0 * u32 * (p.alibi_extent() + c.softcap + p.max_finite_bias());
  const MaxError standard_error = max_error(standard_out, ref.out);
  const MaxError flash_error = max_error(flash_out, ref.out);
  const double flash_bound = 4.0 * standard_error.value + 2.0 * u_out * max_out + floor * max_v +
                             probability_rounding_bound(c.dtype, max_v);
  EXPECT_LE(standard_error.value, standard_bound)
      << context << ": standard out[" << standard_error.index << "] = " << standard_error.got
      << ", reference " << standard_error.want;
  EXPECT_LE(flash_error.value, flash_bound)
      << context << ": flash out[" << flash_error.index << "] = " << flash_error.got
      << ", reference " << flash_error.want << " (standard max error " << standard_error.value
      << ")";
  const MaxError standard_lse_error = max_lse_error(standard_lse, ref.lse);
  const MaxError flash_lse_error = max_lse_error(flash_lse, ref.lse);
  EXPECT_LE(standard_lse_error.value, standard_bound + 4.0 * u32 * max_lse)
      << context << ": standard lse[" << standard_lse_error.index
      << "] = " << standard_lse_error.got << ", reference " << standard_lse_error.want;
  EXPECT_LE(flash_lse_error.value, 4.0 * standard_lse_error.value + 4.0 * u32 * max_lse + floor)
      << context << ": flash lse[" << flash_lse_error.index << "] = " << flash_lse_error.got
      << ", reference " << flash_lse_error.want;
  return {flash_error.value, flash_lse_error.value};
}

struct Gradients {
  Tensor dq, dk, dv;
  std::vector<float> dsinks;
  Tensor dbias{DType::f32, {1, 1, 1, 1}};  // the bias's shape, contiguous
};

Gradients run_backward(const Problem& p, AttentionImpl impl, int threads) {
  Gradients g{Tensor(p.c.dtype, p.q.view.shape, p.q.view.strides),
              Tensor(p.c.dtype, p.k.view.shape, p.k.view.strides),
              Tensor(p.c.dtype, p.k.view.shape, p.k.view.strides),
              std::vector<float>(p.sinks.size(), NAN)};
  g.dq.poison();
  g.dk.poison();
  g.dv.poison();
  AttentionOptions options = p.options;
  options.num_threads = threads;
  ModifierGradients modifier_gradients;
  if (!p.sinks.empty()) modifier_gradients.dsinks = g.dsinks.data();
  if (p.c.bias != Bias::off) {
    g.dbias = Tensor(p.c.bias_dtype, p.bias.view.shape);
    g.dbias.poison();
    modifier_gradients.dbias = g.dbias.view;
  }
  attention_backward(impl, p.dout.view, p.q.view, p.k.view, p.v.view, p.out.view, p.lse.data(),
                     g.dq.view, g.dk.view, g.dv.view, options, modifier_gradients);
  return g;
}

struct ReferenceGradients {
  std::vector<double> dq, dk, dv, dsinks;
  std::vector<double> dbias;  // the bias's shape, contiguous
  double dbias_terms = 0.0;   // (batch, head) pairs summed into each dbias element
};

ReferenceGradients reference_gradients(const Problem& p) {
  Tensor dq(p.c.dtype, p.q.view.shape), dk(p.c.dtype, p.k.view.shape),
      dv(p.c.dtype, p.k.view.shape);
  const detail::BackwardParams params =
      detail::make_backward_params("reference", p.dout.view, p.q.view, p.k.view, p.v.view,
                                   p.out.view, p.lse.data(), dq.view, dk.view, dv.view, p.options);
  ReferenceGradients ref{std::vector<double>(static_cast<std::size_t>(p.q.view.numel())),
                         std::vector<double>(static_cast<std::size_t>(p.k.view.numel())),
                         std::vector<double>(static_cast<std::size_t>(p.k.view.numel())),
                         std::vector<double>(p.sinks.size()),
                         {},
                         0.0};
  std::vector<double> dlogits(
      static_cast<std::size_t>(p.c.batch * p.c.heads_q * p.c.seqlen_q * p.c.seqlen_kv));
  detail::reference_backward_f64(params, ref.dq.data(), ref.dk.data(), ref.dv.data(),
                                 p.sinks.empty() ? nullptr : ref.dsinks.data(), dlogits.data());
  if (p.c.bias == Bias::off) return ref;
  // dbias: dlogits summed over the dims the bias broadcasts.
  const auto& shape = p.bias.view.shape;
  ref.dbias.assign(static_cast<std::size_t>(p.bias.view.numel()), 0.0);
  ref.dbias_terms =
      static_cast<double>((shape[0] == 1 ? p.c.batch : 1) * (shape[1] == 1 ? p.c.heads_q : 1));
  for (std::int64_t b = 0; b < p.c.batch; ++b)
    for (std::int64_t h = 0; h < p.c.heads_q; ++h)
      for (std::int64_t i = 0; i < p.c.seqlen_q; ++i)
        for (std::int64_t j = 0; j < p.c.seqlen_kv; ++j) {
          const std::int64_t bb = shape[0] == 1 ? 0 : b, hb = shape[1] == 1 ? 0 : h;
          ref.dbias[((bb * shape[1] + hb) * shape[2] + i) * shape[3] + j] +=
              dlogits[((b * p.c.heads_q + h) * p.c.seqlen_q + i) * p.c.seqlen_kv + j];
        }
  return ref;
}

// Flash and standard backward against the reference (tolerances: header and test_backward.cpp).
// f16 and bf16 gradient products may round P and dS to the input dtype as their operands; each
// gradient is a sum over at most max(Sq, Skv) such products, which bounds what that costs by
// u_in · max(Sq, Skv) · max(max|dO|, 2·scale·max|dO|·max|v|·max(max|q|, max|k|)).
void expect_backward_matches_reference(const Problem& p, const ForwardErrors& forward,
                                       const std::string& context) {
  const ModifierCase& c = p.c;
  const ReferenceGradients ref = reference_gradients(p);
  const Gradients standard = run_backward(p, AttentionImpl::standard, c.threads);
  const Gradients flash = run_backward(p, AttentionImpl::flash, c.threads);

  const double u32 = unit_roundoff(DType::f32), u_out = unit_roundoff(c.dtype);
  const double qk = max_abs(p.q) * max_abs(p.k), max_dout = max_abs(p.dout);
  const double first_order = 4.0 * p.scale() * c.head_dim * qk + p.modifier_terms() +
                             2.0 * (c.seqlen_kv + c.seqlen_q + 1) + 16.0;
  const double floor = 4.0 * u32 * p.scale() * std::sqrt(static_cast<double>(c.head_dim)) * qk +
                       4.0 * u32 * (p.alibi_extent() + c.softcap + p.max_finite_bias());
  const double operand_rounding =
      c.dtype == DType::f32
          ? 0.0
          : unit_roundoff(c.dtype) * static_cast<double>(std::max(c.seqlen_q, c.seqlen_kv)) *
                std::max(max_dout, 2.0 * p.scale() * max_dout * p.max_value() *
                                       std::max(max_abs(p.q), max_abs(p.k)));
  const std::pair<const char*, std::tuple<const Tensor*, const Tensor*, const std::vector<double>*>>
      gradients[] = {{"dq", {&standard.dq, &flash.dq, &ref.dq}},
                     {"dk", {&standard.dk, &flash.dk, &ref.dk}},
                     {"dv", {&standard.dv, &flash.dv, &ref.dv}}};
  for (const auto& gradient : gradients) {
    const char* name = gradient.first;
    const auto& [standard_grad, flash_grad, ref_grad] = gradient.second;
    const double magnitude = max_abs_finite(*ref_grad) + max_dout * p.max_value();
    const double standard_bound = u32 * first_order * magnitude + u_out * magnitude;
    const MaxError standard_error = max_error(*standard_grad, *ref_grad);
    const MaxError flash_error = max_error(*flash_grad, *ref_grad);
    const double flash_bound =
        4.0 * standard_error.value + (2.0 * u_out + floor) * magnitude + operand_rounding;
    EXPECT_LE(standard_error.value, standard_bound)
        << context << " " << name << ": standard [" << standard_error.index
        << "] = " << standard_error.got << ", reference " << standard_error.want;
    EXPECT_LE(flash_error.value, flash_bound)
        << context << " " << name << ": flash [" << flash_error.index << "] = " << flash_error.got
        << ", reference " << flash_error.want << " (standard max error " << standard_error.value
        << ")";
  }
  if (p.c.bias != Bias::off) {
    // dbias (header): n terms, each within 2 first-order bounds of P times 2·D·max|dO|·max|v|.
    const double per_term = 2.0 * u32 * first_order * 2.0 * c.head_dim * max_dout * p.max_value();
    const double max_dbias = max_abs_finite(ref.dbias);
    const double standard_bound =
        ref.dbias_terms * per_term + unit_roundoff(c.bias_dtype) * max_dbias;
    const MaxError standard_error = max_error(standard.dbias, ref.dbias);
    const MaxError flash_error = max_error(flash.dbias, ref.dbias);
    EXPECT_LE(standard_error.value, standard_bound)
        << context << " dbias: standard [" << standard_error.index << "] = " << standard_error.got
        << ", reference " << standard_error.want;
    EXPECT_LE(flash_error.value,
              4.0 * standard_error.value + standard_bound + ref.dbias_terms * operand_rounding)
        << context << " dbias: flash [" << flash_error.index << "] = " << flash_error.got
        << ", reference " << flash_error.want;
  }
  if (p.sinks.empty()) return;
  // dσ_h = −Σ exp(σ_h − lse)·D_i over B·Sq rows, from the forward's out and lse: each term moves
  // by at most D·max|dO|·(the forward's out error + one rounding of out) through D_i, and by
  // max|D_i|·(its lse error + 4 fp32 roundings of lse) through exp(σ − lse) <= 1.
  double max_delta = 0.0;
  p.out.for_each_index([&](auto b, auto s, auto h, auto) {
    double delta = 0.0;
    for (std::int64_t d = 0; d < c.head_dim; ++d)
      delta += p.dout.at(b, s, h, d) * p.out.at(b, s, h, d);
    max_delta = std::max(max_delta, std::abs(delta));
  });
  double max_lse = 0.0;
  for (float value : p.lse) max_lse = std::max(max_lse, std::abs(static_cast<double>(value)));
  const double per_row = c.head_dim * max_dout * (forward.out + u_out * max_abs(p.out)) +
                         max_delta * (forward.lse + 4.0 * u32 * max_lse) +
                         4.0 * u32 * c.head_dim * max_dout * max_abs(p.out);
  const double dsinks_bound = static_cast<double>(c.batch * c.seqlen_q) * per_row;
  for (std::size_t h = 0; h < p.sinks.size(); ++h) {
    EXPECT_NEAR(standard.dsinks[h], ref.dsinks[h], dsinks_bound)
        << context << " dsinks[" << h << "] standard";
    EXPECT_NEAR(flash.dsinks[h], ref.dsinks[h], dsinks_bound)
        << context << " dsinks[" << h << "] flash";
  }
}

class ModifiersVsReference : public ::testing::TestWithParam<ModifierCase> {};

TEST_P(ModifiersVsReference, FlashAndStandardMatchFp64Reference) {
  const ModifierCase& c = GetParam();
  const std::uint64_t seed = test_seed() ^ std::hash<std::string>{}(describe(c));
  const Problem p(c, seed);
  const std::string context = describe(c) + " FLASHATTN_TEST_SEED=" + std::to_string(test_seed());
  const ForwardErrors forward = expect_forward_matches_reference(p, context);
  expect_backward_matches_reference(p, forward, context);
}

std::vector<ModifierCase> modifier_grid() {
  std::vector<ModifierCase> grid;
  // Each modifier alone and all three together, over shapes that break tiling, with and
  // without the causal mask.
  const std::array<std::int64_t, 6> shapes[] = {{1, 1, 1, 1, 1, 32},      {2, 7, 7, 2, 2, 40},
                                                {1, 113, 203, 4, 2, 59},  {1, 203, 113, 4, 2, 64},
                                                {1, 129, 129, 2, 1, 111}, {1, 255, 255, 2, 2, 128}};
  int n = 0;
  for (const auto& s : shapes) {
    for (int modifiers = 0; modifiers < 4; ++modifiers) {
      ModifierCase c{s[0], s[1], s[2], s[3], s[4], s[5]};
      c.softcap = modifiers == 0 || modifiers == 3 ? 5.0f : 0.0f;
      c.alibi = modifiers == 1 || modifiers == 3 ? (n % 2 ? Alibi::per_entry : Alibi::shared)
                                                 : Alibi::off;
      c.sinks = modifiers == 2 || modifiers == 3;
      c.causal = n % 2 == 0;
      c.threads = 1 + n % 3;
      c.head_major = n % 5 == 0;
      grid.push_back(c);
      ++n;
    }
  }
  // Softcap near saturation: scores ~ 10x the cap.
  ModifierCase saturated{1, 64, 129, 2, 2, 64, 2.0f};
  saturated.q_gain = 8.0f;
  grid.push_back(saturated);
  // Sinks larger than every score: most of each row's mass on the sink.
  ModifierCase heavy_sinks{2, 65, 70, 2, 1, 32};
  heavy_sinks.sinks = true;
  heavy_sinks.sink_offset = 12.0f;
  heavy_sinks.causal = true;
  grid.push_back(heavy_sinks);
  // Causal rows that see no key (Sq > Skv) with sinks: output 0 and lse = the sink.
  ModifierCase empty_rows{1, 9, 4, 2, 2, 16, 3.0f, Alibi::shared, true, true};
  grid.push_back(empty_rows);
  // Windows with ALiBi, and GQA with per-entry slopes.
  ModifierCase window{1, 200, 150, 4, 2, 48, 0.0f, Alibi::per_entry, true, true, 40, 8};
  window.threads = 3;
  grid.push_back(window);
  ModifierCase gqa{2, 97, 131, 8, 2, 64, 10.0f, Alibi::per_entry, true};
  gqa.threads = 3;
  grid.push_back(gqa);
  // The decode path (few query rows per KV head against long keys): one token and a few.
  for (std::int64_t sq : {1, 3}) {
    ModifierCase decode{2, sq, 700, 8, 2, 64, 4.0f, Alibi::per_entry, true, true};
    decode.threads = sq == 1 ? 3 : 2;
    grid.push_back(decode);
  }
  // f16 and bf16 inputs.
  for (DType dtype : {DType::f16, DType::bf16}) {
    ModifierCase c{1, 131, 97, 4, 2, 64, 6.0f, Alibi::shared, true, true};
    c.dtype = dtype;
    grid.push_back(c);
    ModifierCase decode{1, 1, 300, 4, 1, 128, 6.0f, Alibi::shared, true};
    decode.dtype = dtype;
    grid.push_back(decode);
  }
  // Additive biases of every broadcast shape and layout, f16 and bf16 biases, −inf entries,
  // with and without the other modifiers, over shapes that break tiling.
  const std::array<std::int64_t, 6> bias_shapes[] = {{1, 1, 1, 1, 1, 32},
                                                     {2, 7, 9, 2, 2, 40},
                                                     {1, 113, 203, 4, 2, 59},
                                                     {1, 203, 113, 2, 1, 64},
                                                     {2, 130, 130, 2, 2, 128}};
  int m = 0;
  for (const auto& s : bias_shapes) {
    for (Bias bias : {Bias::full, Bias::shared, Bias::per_head, Bias::per_batch,
                      Bias::row_broadcast, Bias::transposed}) {
      ModifierCase c{s[0], s[1], s[2], s[3], s[4], s[5]};
      c.bias = bias;
      c.causal = m % 2 == 0;
      c.threads = 1 + m % 3;
      c.head_major = m % 5 == 0;
      c.bias_dtype = m % 7 == 3 ? DType::f16 : (m % 7 == 5 ? DType::bf16 : DType::f32);
      c.infinite_bias = m % 4 == 1;
      if (m % 6 == 4) c.softcap = 5.0f, c.alibi = Alibi::shared, c.sinks = true;
      grid.push_back(c);
      ++m;
    }
  }
  // Masks: random, documents, and whole rows and blocks dropped, alone and with a bias, the
  // causal mask, GQA and the other modifiers; the decode shapes (which a mask sends to the
  // tiled path) and f16 / bf16 inputs.
  for (Mask mask : {Mask::random, Mask::documents, Mask::empty_rows}) {
    for (const auto& s : bias_shapes) {
      ModifierCase c{s[0], s[1], s[2], s[3], s[4], s[5]};
      c.mask = mask;
      c.causal = m % 2 == 0;
      c.threads = 1 + m % 3;
      if (m % 3 == 1) c.bias = Bias::shared, c.infinite_bias = true;
      if (m % 4 == 2) c.sinks = true, c.softcap = 4.0f;
      grid.push_back(c);
      ++m;
    }
  }
  // Dropout (FlashAttention's 0.17 and a heavy 0.5) over shapes that break tiling, with the
  // causal mask, windows, GQA, every modifier, a bias for dbias, f16 and bf16, the decode shape
  // (which dropout sends to the tiled path) and 1 to 3 threads.
  const std::array<std::int64_t, 6> dropout_shapes[] = {
      {1, 1, 1, 1, 1, 32},     {2, 7, 9, 2, 2, 40},      {1, 113, 203, 4, 2, 59},
      {1, 203, 113, 2, 1, 64}, {2, 130, 130, 2, 2, 128}, {2, 1, 700, 8, 2, 64}};
  for (const auto& s : dropout_shapes) {
    for (int variant = 0; variant < 3; ++variant) {
      ModifierCase c{s[0], s[1], s[2], s[3], s[4], s[5]};
      c.dropout = variant == 2 ? 0.5f : 0.17f;
      c.causal = m % 2 == 0;
      c.threads = 1 + m % 3;
      c.head_major = m % 5 == 0;
      if (variant == 1) c.softcap = 5.0f, c.alibi = Alibi::per_entry, c.sinks = true;
      if (variant == 2) c.bias = Bias::per_head, c.window_left = 50, c.window_right = 3;
      if (m % 4 == 3) c.dtype = m % 8 == 3 ? DType::f16 : DType::bf16;
      grid.push_back(c);
      ++m;
    }
  }
  ModifierCase document_blocks{1, 300, 300, 2, 1, 64};
  document_blocks.mask = Mask::empty_rows;
  document_blocks.causal = true;
  document_blocks.bias = Bias::full;
  grid.push_back(document_blocks);
  for (std::int64_t sq : {1, 3}) {
    ModifierCase decode{2, sq, 700, 8, 2, 64};
    decode.bias = Bias::per_head;
    decode.mask = sq == 1 ? Mask::off : Mask::random;
    decode.sinks = true;
    grid.push_back(decode);
  }
  for (DType dtype : {DType::f16, DType::bf16}) {
    ModifierCase c{1, 131, 197, 4, 2, 64};
    c.dtype = dtype;
    c.bias = Bias::per_batch;
    c.bias_dtype = dtype;
    c.mask = Mask::documents;
    c.causal = true;
    grid.push_back(c);
  }
  return grid;
}

INSTANTIATE_TEST_SUITE_P(Grid, ModifiersVsReference, ::testing::ValuesIn(modifier_grid()),
                         [](const auto& info) { return describe(info.param); });

// Every compiled SIMD target runs the modifier step (and the rest) within the same bounds.
TEST(ModifiersVsReferencePerTarget, EveryCompiledTargetMatches) {
  ModifierCase c{1, 70, 90, 4, 2, 40, 3.0f, Alibi::per_entry, true, true};
  const Problem p(c, test_seed());
  on_every_target([&] { expect_forward_matches_reference(p, describe(c)); });
}

// The reference itself: central finite differences of L = Σ dO ∘ O (and of the sinks' own
// gradient) through the fp64 forward reference. Each quotient uses the step actually taken (the
// perturbed input read back from its float). Truncation error of a central difference with step
// h is c·h²; the quotients at h and h/2 differ by (3/4)·c·h², so the one at h/2 is within a third
// of that difference of the true derivative: the assertion allows the whole difference, plus
// 1e-9 of the derivative's scale for the fp64 sums.
TEST(ModifiersReference, BackwardMatchesFiniteDifferences) {
  const ModifierCase cases[] = {
      {1, 5, 6, 2, 2, 8, 1.5f, Alibi::off, false, false},
      {1, 5, 6, 2, 1, 8, 0.0f, Alibi::per_entry, false, true},
      {2, 4, 7, 2, 2, 8, 0.0f, Alibi::off, true, true},
      {1, 6, 5, 4, 2, 8, 2.0f, Alibi::shared, true, false},
      [] {
        ModifierCase c{2, 4, 6, 2, 1, 8, 1.5f, Alibi::off, true, true};
        c.bias = Bias::per_head;
        c.mask = Mask::random;
        return c;
      }(),
      [] {
        ModifierCase c{2, 5, 5, 2, 2, 8};
        c.bias = Bias::full;
        c.infinite_bias = true;
        return c;
      }(),
  };
  for (const ModifierCase& c : cases) {
    Problem p(c, test_seed() ^ std::hash<std::string>{}(describe(c)));
    const ReferenceGradients ref = reference_gradients(p);
    auto loss = [&] {
      const ReferenceResult forward = reference(p.q, p.k, p.v, p.options);
      double sum = 0.0;
      std::int64_t flat = 0;
      p.dout.for_each_index([&](auto a, auto b, auto cc, auto d) {
        sum += p.dout.at(a, b, cc, d) * forward.out[flat++];
      });
      return sum;
    };
    // d loss / d x at the value x stored by `set`, from perturbations of `step` and step / 2.
    auto expect_derivative = [&](double analytic, const std::function<float()>& get,
                                 const std::function<void(float)>& set, const std::string& what) {
      const float original = get();
      auto quotient = [&](double step) {
        set(static_cast<float>(original + step));
        const double plus_x = get(), plus = loss();
        set(static_cast<float>(original - step));
        const double minus_x = get(), minus = loss();
        set(original);
        return (plus - minus) / (plus_x - minus_x);
      };
      const double coarse = quotient(0x1p-8), fine = quotient(0x1p-9);
      EXPECT_NEAR(analytic, fine, std::abs(coarse - fine) + 1e-9 * (1.0 + std::abs(fine)))
          << describe(c) << " " << what << " (coarse " << coarse << ")";
    };
    const std::pair<const char*, std::pair<Tensor*, const std::vector<double>*>> inputs[] = {
        {"q", {&p.q, &ref.dq}}, {"k", {&p.k, &ref.dk}}, {"v", {&p.v, &ref.dv}}};
    for (const auto& input : inputs) {
      Tensor* tensor = input.second.first;
      const std::vector<double>* gradient = input.second.second;
      std::int64_t flat = 0;
      tensor->for_each_index([&](auto a, auto b, auto cc, auto d) {
        if (flat++ % 3 != 0) return;  // a third of the elements keeps this fast
        expect_derivative((*gradient)[flat - 1], [&] { return tensor->at(a, b, cc, d); },
                          [&](float x) { tensor->set(a, b, cc, d, x); },
                          std::string(input.first) + "[" + std::to_string(flat - 1) + "]");
      });
    }
    for (std::size_t h = 0; h < p.sinks.size(); ++h) {
      expect_derivative(
          ref.dsinks[h], [&] { return p.sinks[h]; }, [&](float x) { p.sinks[h] = x; },
          "dsinks[" + std::to_string(h) + "]");
    }
    if (c.bias == Bias::off) continue;
    std::int64_t flat = 0;
    p.bias.for_each_index([&](auto a, auto b, auto i, auto j) {
      const std::int64_t index = flat++;
      if (!std::isfinite(p.bias.at(a, b, i, j))) {
        EXPECT_EQ(ref.dbias[index], 0.0) << describe(c) << " dbias at a -inf bias";
        return;
      }
      expect_derivative(
          ref.dbias[index], [&] { return p.bias.at(a, b, i, j); },
          [&](float x) { p.bias.set(a, b, i, j, x); }, "dbias[" + std::to_string(index) + "]");
    });
  }
}

// Worked examples, one query of head_dim 1 against two keys, scale 1: q = 1, k = (0, ln 2),
// v = (4, 8), so the plain logits are (0, ln 2) and the weights e^0 : e^ln2 = 1 : 2.
struct TinyProblem {
  Tensor q{DType::f32, {1, 1, 1, 1}}, k{DType::f32, {1, 2, 1, 1}}, v{DType::f32, {1, 2, 1, 1}};
  TinyProblem() {
    q.set(0, 0, 0, 0, 1.0f);
    k.set(0, 0, 0, 0, 0.0f);
    k.set(0, 1, 0, 0, std::log(2.0f));
    v.set(0, 0, 0, 0, 4.0f);
    v.set(0, 1, 0, 0, 8.0f);
  }
  // out and lse of every path.
  void expect(const AttentionOptions& base, double want_out, double want_lse, double tolerance) {
    for (AttentionImpl impl :
         {AttentionImpl::reference, AttentionImpl::standard, AttentionImpl::flash}) {
      AttentionOptions options = base;
      options.softmax_scale = 1.0f;
      Tensor out(DType::f32, {1, 1, 1, 1});
      float lse = NAN;
      attention_forward(impl, q.view, k.view, v.view, out.view, &lse, options);
      EXPECT_NEAR(out.at(0, 0, 0, 0), want_out, tolerance) << impl_name(impl);
      EXPECT_NEAR(lse, want_lse, tolerance) << impl_name(impl);
    }
  }
};

TEST(ModifierExamples, SinkTakesItsShareOfTheNormalizer) {
  // A sink of logit 0 weighs e^0 = 1: weights 1 : 2 : 1 (sink) over 4, out = 4/4 + 8·2/4 = 5,
  // lse = ln 4.
  const float sink = 0.0f;
  AttentionOptions options;
  options.sinks = std::span<const float>(&sink, 1);
  TinyProblem().expect(options, 5.0, std::log(4.0), 1e-6);
}

TEST(ModifierExamples, SoftcapBendsTheLogits) {
  // Cap 1: logits (tanh 0, tanh ln 2) = (0, 3/5), out = (4 + 8·e^0.6) / (1 + e^0.6).
  AttentionOptions options;
  options.softcap = 1.0f;
  const double e = std::exp(0.6);
  TinyProblem().expect(options, (4.0 + 8.0 * e) / (1.0 + e), std::log(1.0 + e), 1e-6);
}

TEST(ModifierExamples, AlibiCountsDistanceFromTheBottomRightDiagonal) {
  // One query against two keys sits on key 1's diagonal: distances (1, 0), slope 1, logits
  // (0 − 1, ln 2 − 0): weights e^-1 : 2.
  const float slope = 1.0f;
  AttentionOptions options;
  options.alibi_slopes = std::span<const float>(&slope, 1);
  const double a = std::exp(-1.0);
  TinyProblem().expect(options, (4.0 * a + 16.0) / (a + 2.0), std::log(a + 2.0), 1e-6);
}

TEST(ModifierExamples, BiasAddsToTheLogits) {
  // Bias (ln 2, 0): logits (ln 2, ln 2), weights 1 : 1, out = 6, lse = ln 4.
  const float bias[] = {std::log(2.0f), 0.0f};
  AttentionOptions options;
  options.bias = contiguous_view(bias, {1, 1, 1, 2});
  TinyProblem().expect(options, 6.0, std::log(4.0), 1e-6);
}

TEST(ModifierExamples, MaskDropsAKey) {
  // Key 1 dropped: out = v0 = 4, lse = logit 0 = 0.
  const bool keep[] = {true, false};
  AttentionOptions options;
  options.mask = MaskView{keep, {1, 1, 1, 2}, {2, 2, 2, 1}};
  TinyProblem().expect(options, 4.0, 0.0, 1e-6);
}

// With a bias or mask, a row whose every key is masked gets 0 and lse −inf (its sink with
// sinks) on every path, never 0/0.
TEST(ModifierExamples, RowWhoseKeysAreAllMaskedGetsZero) {
  const bool drop[] = {false, false};
  const float minus_infinity[] = {-INFINITY, -INFINITY};
  const float sink = 0.5f;
  for (int variant = 0; variant < 3; ++variant) {
    TinyProblem tiny;
    AttentionOptions options;
    options.softmax_scale = 1.0f;
    if (variant == 0) options.mask = MaskView{drop, {1, 1, 1, 2}, {2, 2, 2, 1}};
    if (variant >= 1) options.bias = contiguous_view(minus_infinity, {1, 1, 1, 2});
    if (variant == 2) options.sinks = std::span<const float>(&sink, 1);
    for (AttentionImpl impl :
         {AttentionImpl::reference, AttentionImpl::standard, AttentionImpl::flash}) {
      Tensor out(DType::f32, {1, 1, 1, 1});
      out.poison();
      float lse = NAN;
      attention_forward(impl, tiny.q.view, tiny.k.view, tiny.v.view, out.view, &lse, options);
      EXPECT_EQ(out.at(0, 0, 0, 0), 0.0f) << impl_name(impl) << " variant " << variant;
      EXPECT_EQ(lse, variant == 2 ? sink : -INFINITY) << impl_name(impl) << " variant " << variant;
    }
  }
}

// A row whose keys a bias or mask masks entirely is 0, and adds nothing to any gradient, even
// with an infinite value row among its keys and an infinite dO row (the libFuzzer harnesses
// found acc·0 and P·dO = 0·inf making it NaN); a masked key's infinite value row reaches no
// row.
TEST(ModifierExamples, FullyMaskedRowStaysZeroWithInfiniteValues) {
  const std::int64_t S = 6, H = 1, D = 4;
  std::mt19937_64 rng(test_seed());
  Tensor q(DType::f32, {1, S, H, D}), k(DType::f32, {1, S, H, D}), v(DType::f32, {1, S, H, D}),
      dout(DType::f32, {1, S, H, D});
  for (Tensor* t : {&q, &k, &v, &dout}) t->fill_normal(rng);
  v.set(0, 1, 0, 2, INFINITY);
  dout.set(0, 3, 0, 0, INFINITY);
  std::vector<float> bias(S * S, 0.0f);
  std::vector<std::uint8_t> keep(S * S, 1);
  for (std::int64_t j = 0; j < S; ++j) bias[3 * S + j] = -INFINITY;  // row 3: every key −inf
  for (std::int64_t j = 0; j < S; ++j) keep[3 * S + j] = 0;          // or dropped
  bias[4 * S + 1] = -INFINITY;  // row 4: key 1 (infinite value) masked, the others not
  keep[4 * S + 1] = 0;
  for (int variant = 0; variant < 2; ++variant) {
    for (bool sinks : {false, true}) {
      const float sink = 0.25f;
      AttentionOptions options;
      if (variant == 0) options.bias = contiguous_view(bias.data(), {1, 1, S, S});
      if (variant == 1) {
        options.mask =
            MaskView{reinterpret_cast<const bool*>(keep.data()), {1, 1, S, S}, {0, 0, S, 1}};
      }
      if (sinks) options.sinks = std::span<const float>(&sink, 1);
      for (AttentionImpl impl :
           {AttentionImpl::reference, AttentionImpl::standard, AttentionImpl::flash}) {
        const std::string context = std::string(impl_name(impl)) + " variant " +
                                    std::to_string(variant) + (sinks ? " sinks" : "");
        Tensor out(DType::f32, q.view.shape);
        std::vector<float> lse(S);
        attention_forward(impl, q.view, k.view, v.view, out.view, lse.data(), options);
        for (std::int64_t d = 0; d < D; ++d) EXPECT_EQ(out.at(0, 3, 0, d), 0.0f) << context;
        EXPECT_EQ(lse[3], sinks ? sink : -INFINITY) << context;
        for (std::int64_t d = 0; d < D; ++d) {
          EXPECT_TRUE(std::isfinite(out.at(0, 4, 0, d))) << context << " row 4";
        }
        Tensor dq(DType::f32, q.view.shape), dk(DType::f32, k.view.shape),
            dv(DType::f32, k.view.shape);
        float dsink = NAN;
        ModifierGradients gradients;
        if (sinks) gradients.dsinks = &dsink;
        attention_backward(impl, dout.view, q.view, k.view, v.view, out.view, lse.data(), dq.view,
                           dk.view, dv.view, options, gradients);
        for (std::int64_t d = 0; d < D; ++d) EXPECT_EQ(dq.at(0, 3, 0, d), 0.0f) << context;
        // Row 3's infinite dO reaches no dV: only the value row 1 (infinite) may be non-finite.
        for (std::int64_t j = 0; j < S; ++j) {
          if (j == 1) continue;
          for (std::int64_t d = 0; d < D; ++d) {
            EXPECT_TRUE(std::isfinite(dv.at(0, j, 0, d))) << context << " dv key " << j;
          }
        }
      }
    }
  }
}

// A row whose sink outweighs its keys so far that lse rounds to the sink is not a masked row: a
// NaN among its inputs still reaches its gradients (the backward fuzzer found it taken for one).
TEST(ModifierExamples, SinkDominatedRowIsNotMasked) {
  const std::int64_t S = 5, D = 4;
  std::mt19937_64 rng(test_seed());
  Tensor q(DType::f32, {1, S, 1, D}), k(DType::f32, {1, S, 1, D}), v(DType::f32, {1, S, 1, D}),
      dout(DType::f32, {1, S, 1, D});
  for (Tensor* t : {&q, &k, &v, &dout}) t->fill_normal(rng);
  dout.set(0, 2, 0, 1, NAN);
  const float sink = 300.0f;
  std::vector<float> bias(S * S, 0.5f);
  AttentionOptions options;
  options.sinks = std::span<const float>(&sink, 1);
  options.bias = contiguous_view(bias.data(), {1, 1, S, S});
  for (AttentionImpl impl :
       {AttentionImpl::reference, AttentionImpl::standard, AttentionImpl::flash}) {
    Tensor out(DType::f32, q.view.shape), dq(DType::f32, q.view.shape),
        dk(DType::f32, k.view.shape), dv(DType::f32, k.view.shape);
    std::vector<float> lse(S);
    attention_forward(impl, q.view, k.view, v.view, out.view, lse.data(), options);
    EXPECT_EQ(lse[2], sink) << impl_name(impl);
    attention_backward(impl, dout.view, q.view, k.view, v.view, out.view, lse.data(), dq.view,
                       dk.view, dv.view, options);
    EXPECT_TRUE(std::isnan(dq.at(0, 2, 0, 0))) << impl_name(impl);
  }
}

// A document mask (block-diagonal) gives what the same −inf bias gives, bit for bit on the flash
// path, though it skips the blocks that the bias computes.
TEST(ModifierExamples, DocumentMaskEqualsMinusInfinityBias) {
  const std::int64_t S = 700, H = 2, D = 64;
  std::mt19937_64 rng(test_seed());
  Tensor q(DType::f32, {1, S, H, D}), k(DType::f32, {1, S, H, D}), v(DType::f32, {1, S, H, D});
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  const std::int64_t ends[] = {130, 300, 301, 700};
  auto document = [&](std::int64_t i) {
    return std::upper_bound(std::begin(ends), std::end(ends), i) - std::begin(ends);
  };
  std::vector<std::uint8_t> keep(S * S);
  std::vector<float> bias(S * S);
  for (std::int64_t i = 0; i < S; ++i)
    for (std::int64_t j = 0; j < S; ++j) {
      keep[i * S + j] = document(i) == document(j);
      bias[i * S + j] = keep[i * S + j] ? 0.0f : -INFINITY;
    }
  AttentionOptions with_mask, with_bias;
  with_mask.causal = with_bias.causal = true;
  with_mask.mask = MaskView{reinterpret_cast<const bool*>(keep.data()), {1, 1, S, S}, {0, 0, S, 1}};
  with_bias.bias = contiguous_view(bias.data(), {1, 1, S, S});
  Tensor out_mask(DType::f32, q.view.shape), out_bias(DType::f32, q.view.shape);
  std::vector<float> lse_mask(H * S), lse_bias(H * S);
  flash_attention_forward(q.view, k.view, v.view, out_mask.view, lse_mask.data(), with_mask);
  flash_attention_forward(q.view, k.view, v.view, out_bias.view, lse_bias.data(), with_bias);
  EXPECT_EQ(out_mask.bytes, out_bias.bytes);
  EXPECT_EQ(lse_mask, lse_bias);
}

// A row that sees no key (here: there are none): output 0 and lse = its sink on every path.
TEST(ModifierExamples, RowWithoutKeysGetsItsSinkAsLse) {
  TinyProblem tiny;
  const float sink = 0.75f;
  AttentionOptions options;
  options.sinks = std::span<const float>(&sink, 1);
  Tensor k(DType::f32, {1, 0, 1, 1}), v(DType::f32, {1, 0, 1, 1});
  for (AttentionImpl impl :
       {AttentionImpl::reference, AttentionImpl::standard, AttentionImpl::flash}) {
    Tensor out(DType::f32, {1, 1, 1, 1});
    out.poison();
    float lse = NAN;
    attention_forward(impl, tiny.q.view, k.view, v.view, out.view, &lse, options);
    EXPECT_EQ(out.at(0, 0, 0, 0), 0.0f) << impl_name(impl);
    EXPECT_EQ(lse, sink) << impl_name(impl);
  }
}

// Bitwise the same for any thread count, modifiers, dsinks and dbias included: dbias of every
// broadcast (its sums take turns across the groups that share a bias slice), and one KV head
// whose keys split into chunks (B1 Hkv1).
TEST(ModifiersDeterminism, BitwiseIdenticalForAnyThreadCount) {
  struct Shape {
    std::int64_t batch, seqlen_q, heads_kv;
    Bias bias;
  };
  for (const Shape s : {Shape{2, 1, 2, Bias::per_head}, Shape{2, 300, 2, Bias::per_head},
                        Shape{2, 300, 2, Bias::shared}, Shape{2, 300, 2, Bias::per_batch},
                        Shape{2, 300, 2, Bias::full}, Shape{1, 300, 1, Bias::shared}}) {
    ModifierCase c{s.batch, s.seqlen_q, 300, 4, s.heads_kv, 64, 4.0f, Alibi::per_entry, true, true};
    c.bias = s.bias;
    c.mask = Mask::random;
    const Problem p(c, test_seed());
    const Gradients one = run_backward(p, AttentionImpl::flash, 1);
    for (int threads : {2, 3}) {
      AttentionOptions options = p.options;
      options.num_threads = threads;
      Tensor out(c.dtype, p.q.view.shape);
      std::vector<float> lse(p.lse.size());
      flash_attention_forward(p.q.view, p.k.view, p.v.view, out.view, lse.data(), options);
      EXPECT_EQ(lse, p.lse) << describe(c) << " threads " << threads;
      const Gradients other = run_backward(p, AttentionImpl::flash, threads);
      EXPECT_EQ(other.dq.bytes, one.dq.bytes) << describe(c) << " threads " << threads;
      EXPECT_EQ(other.dk.bytes, one.dk.bytes) << describe(c) << " threads " << threads;
      EXPECT_EQ(other.dsinks, one.dsinks) << describe(c) << " threads " << threads;
      EXPECT_EQ(other.dbias.bytes, one.dbias.bytes) << describe(c) << " threads " << threads;
    }
  }
}

// The flash backward sums dbias as it goes, in fp64 and in (batch, head) order: exactly the fp64
// sum, in that order, of the dbias each (batch, head) gives alone (one fp32 term each, so exact),
// rounded once. Without the ordered turns, threads adding in another order change low bits.
TEST(ModifiersDbias, FlashSumsEachHeadAloneInOrder) {
  for (Bias bias : {Bias::shared, Bias::per_batch, Bias::per_head}) {
    ModifierCase c{2, 131, 197, 8, 4, 40};
    c.bias = bias;
    c.causal = true;
    c.threads = 3;
    const Problem p(c, test_seed());
    const Gradients together = run_backward(p, AttentionImpl::flash, c.threads);
    const std::array<std::int64_t, 4> bias_shape = p.bias.view.shape;
    const std::int64_t Sq = c.seqlen_q, Skv = c.seqlen_kv, group = c.heads_q / c.heads_kv;
    std::vector<double> sums(static_cast<std::size_t>(p.bias.view.numel()), 0.0);
    // One (batch, head) at a time: views into q, k, v, out, dO, its lse and its bias slice.
    auto one_head = [](const TensorView& t, std::int64_t b, std::int64_t h) {
      TensorView one = t;
      one.data = static_cast<std::uint8_t*>(t.data) +
                 (b * t.strides[0] + h * t.strides[2]) * dtype_size(t.dtype);
      one.shape = {1, t.shape[1], 1, t.shape[3]};
      return one;
    };
    for (std::int64_t b = 0; b < c.batch; ++b) {
      for (std::int64_t h = 0; h < c.heads_q; ++h) {
        const std::int64_t bb = bias_shape[0] == 1 ? 0 : b, hb = bias_shape[1] == 1 ? 0 : h;
        AttentionOptions options = p.options;
        options.num_threads = 2;
        options.bias = p.bias.view;
        options.bias.data = static_cast<std::uint8_t*>(p.bias.view.data) +
                            (bb * p.bias.view.strides[0] + hb * p.bias.view.strides[1]) *
                                dtype_size(p.bias.view.dtype);
        options.bias.shape = {1, 1, Sq, Skv};
        Tensor dq(c.dtype, {1, Sq, 1, c.head_dim}), dk(c.dtype, {1, Skv, 1, c.head_dim}),
            dv(c.dtype, {1, Skv, 1, c.head_dim}), dbias(DType::f32, {1, 1, Sq, Skv});
        ModifierGradients gradients;
        gradients.dbias = dbias.view;
        flash_attention_backward(
            one_head(p.dout.view, b, h), one_head(p.q.view, b, h), one_head(p.k.view, b, h / group),
            one_head(p.v.view, b, h / group), one_head(p.out.view, b, h),
            p.lse.data() + (b * c.heads_q + h) * Sq, dq.view, dk.view, dv.view, options, gradients);
        for (std::int64_t i = 0; i < Sq; ++i) {
          for (std::int64_t j = 0; j < Skv; ++j) {
            sums[static_cast<std::size_t>(((bb * bias_shape[1] + hb) * Sq + i) * Skv + j)] +=
                static_cast<double>(dbias.at(0, 0, i, j));
          }
        }
      }
    }
    std::int64_t mismatches = 0;
    for (std::int64_t bb = 0; bb < bias_shape[0]; ++bb) {
      for (std::int64_t hb = 0; hb < bias_shape[1]; ++hb) {
        for (std::int64_t i = 0; i < Sq; ++i) {
          for (std::int64_t j = 0; j < Skv; ++j) {
            const float expected = static_cast<float>(
                sums[static_cast<std::size_t>(((bb * bias_shape[1] + hb) * Sq + i) * Skv + j)]);
            const float got = together.dbias.at(bb, hb, i, j);
            if (std::memcmp(&expected, &got, sizeof(float)) != 0 && ++mismatches <= 3) {
              ADD_FAILURE() << describe(c) << " dbias[" << bb << ", " << hb << ", " << i << ", "
                            << j << "] = " << got << ", expected " << expected;
            }
          }
        }
      }
    }
    EXPECT_EQ(mismatches, 0) << describe(c);
  }
}

// An empty query or key sequence with dbias asked for: every path returns, dbias has no element
// (the fuzzer's finding: the flash backward asked Highway for 0 bytes of sums, which aborts).
TEST(ModifiersDbias, EmptySequencesReturn) {
  for (const auto& [seqlen_q, seqlen_kv] : {std::pair<std::int64_t, std::int64_t>{0, 5}, {3, 0}}) {
    Tensor q(DType::f32, {1, seqlen_q, 2, 8}), k(DType::f32, {1, seqlen_kv, 1, 8}),
        v(DType::f32, {1, seqlen_kv, 1, 8}), out(DType::f32, {1, seqlen_q, 2, 8}),
        bias(DType::f32, {1, 1, seqlen_q, seqlen_kv}),
        dbias(DType::f32, {1, 1, seqlen_q, seqlen_kv});
    std::vector<float> lse(static_cast<std::size_t>(2 * seqlen_q) + 1);
    AttentionOptions options;
    options.bias = bias.view;
    for (AttentionImpl impl :
         {AttentionImpl::flash, AttentionImpl::standard, AttentionImpl::reference}) {
      attention_forward(impl, q.view, k.view, v.view, out.view, lse.data(), options);
      Tensor dq(DType::f32, q.view.shape), dk(DType::f32, k.view.shape),
          dv(DType::f32, v.view.shape);
      ModifierGradients gradients;
      gradients.dbias = dbias.view;
      EXPECT_NO_THROW(attention_backward(impl, out.view, q.view, k.view, v.view, out.view,
                                         lse.data(), dq.view, dk.view, dv.view, options, gradients))
          << impl_name(impl) << " Sq " << seqlen_q << " Skv " << seqlen_kv;
    }
  }
}

// Varlen: each sequence with its own ALiBi slopes ([batch, heads_q]) gives what that sequence
// alone gives with its row of slopes, bit for bit; dsinks sums over the sequences.
TEST(ModifiersVarlen, EachSequenceAsAlone) {
  const std::int32_t cu[] = {0, 5, 5, 41};
  const std::int64_t H = 2, D = 32, total = 41;
  std::mt19937_64 rng(test_seed());
  Tensor q(DType::f32, {1, total, H, D}), k(DType::f32, {1, total, H, D}),
      v(DType::f32, {1, total, H, D});
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  const std::vector<float> slopes = {0.5f, 0.25f, 0.125f, 0.0625f, 1.0f, 2.0f};
  const std::vector<float> sinks = {0.3f, -0.4f};
  AttentionOptions options;
  options.causal = true;
  options.softcap = 7.0f;
  options.alibi_slopes = slopes;
  options.sinks = sinks;
  Tensor out(DType::f32, {1, total, H, D});
  std::vector<float> lse(static_cast<std::size_t>(H * total));
  varlen_attention_forward(AttentionImpl::flash, q.view, k.view, v.view, cu, cu, 3, out.view,
                           lse.data(), options);
  for (std::int64_t b = 0; b < 3; ++b) {
    const std::int64_t begin = cu[b], length = cu[b + 1] - cu[b];
    if (length == 0) continue;
    auto rows = [&](const Tensor& t) {
      return ConstTensorView{static_cast<const char*>(t.view.data) + begin * H * D * 4,
                             DType::f32,
                             {1, length, H, D},
                             t.view.strides};
    };
    AttentionOptions alone = options;
    alone.alibi_slopes = std::span<const float>(slopes.data() + b * H, H);
    Tensor out_alone(DType::f32, {1, length, H, D});
    std::vector<float> lse_alone(static_cast<std::size_t>(H * length));
    flash_attention_forward(rows(q), rows(k), rows(v), out_alone.view, lse_alone.data(), alone);
    for (std::int64_t i = 0; i < length; ++i) {
      for (std::int64_t h = 0; h < H; ++h) {
        EXPECT_EQ(lse[h * total + begin + i], lse_alone[h * length + i]) << b << " " << i;
        for (std::int64_t d = 0; d < D; ++d) {
          EXPECT_EQ(out.at(0, begin + i, h, d), out_alone.at(0, i, h, d)) << b << " " << i;
        }
      }
    }
  }
  // dsinks of the packed batch = the sum of the sequences' own.
  Tensor dout(DType::f32, {1, total, H, D}), dq(DType::f32, {1, total, H, D}),
      dk(DType::f32, {1, total, H, D}), dv(DType::f32, {1, total, H, D});
  dout.fill_normal(rng);
  std::vector<float> dsinks(2, NAN);
  ModifierGradients gradients;
  gradients.dsinks = dsinks.data();
  varlen_attention_backward(AttentionImpl::reference, dout.view, q.view, k.view, v.view, out.view,
                            lse.data(), cu, cu, 3, dq.view, dk.view, dv.view, options, gradients);
  for (float value : dsinks) EXPECT_TRUE(std::isfinite(value));
  std::vector<double> sum(2, 0.0);
  for (std::int64_t b = 0; b < 3; ++b) {
    const std::int64_t begin = cu[b], length = cu[b + 1] - cu[b];
    if (length == 0) continue;
    auto rows = [&](const Tensor& t) {
      return TensorView{static_cast<char*>(const_cast<void*>(t.view.data)) + begin * H * D * 4,
                        DType::f32,
                        {1, length, H, D},
                        t.view.strides};
    };
    AttentionOptions alone = options;
    alone.alibi_slopes = std::span<const float>(slopes.data() + b * H, H);
    std::vector<float> lse_alone(static_cast<std::size_t>(H * length));
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < length; ++i)
        lse_alone[h * length + i] = lse[h * total + begin + i];
    Tensor ddq(DType::f32, {1, length, H, D}), ddk(DType::f32, {1, length, H, D}),
        ddv(DType::f32, {1, length, H, D});
    std::vector<float> part(2);
    ModifierGradients part_gradients;
    part_gradients.dsinks = part.data();
    reference_attention_backward(rows(dout), rows(q), rows(k), rows(v), rows(out), lse_alone.data(),
                                 ddq.view, ddk.view, ddv.view, alone, part_gradients);
    sum[0] += part[0];
    sum[1] += part[1];
  }
  for (int h = 0; h < 2; ++h) {
    EXPECT_NEAR(dsinks[h], sum[h], 1e-5 * (1.0 + std::abs(sum[h]))) << "head " << h;
  }
}

// The KV cache: a paged cache with modifiers gives the dense cache's result bit for bit, and the
// reference path agrees with the flash decode within the decode bounds' order.
TEST(ModifiersKVCache, PagedEqualsDenseAndMatchesReference) {
  const std::int64_t B = 2, capacity = 96, Hq = 4, Hkv = 2, D = 64, page = 16;
  std::mt19937_64 rng(test_seed());
  Tensor q(DType::f32, {B, 1, Hq, D}), dense_k(DType::f32, {B, capacity, Hkv, D}),
      dense_v(DType::f32, {B, capacity, Hkv, D});
  q.fill_normal(rng);
  dense_k.fill_normal(rng);
  dense_v.fill_normal(rng);
  const std::int64_t pages = B * capacity / page;
  Tensor paged_k(DType::f32, {pages, page, Hkv, D}), paged_v(DType::f32, {pages, page, Hkv, D});
  std::vector<std::int32_t> table(static_cast<std::size_t>(pages));
  std::iota(table.begin(), table.end(), 0);
  std::reverse(table.begin(), table.end());
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t j = 0; j < capacity; ++j)
      for (std::int64_t h = 0; h < Hkv; ++h)
        for (std::int64_t d = 0; d < D; ++d) {
          const std::int64_t p = table[b * (capacity / page) + j / page];
          paged_k.set(p, j % page, h, d, dense_k.at(b, j, h, d));
          paged_v.set(p, j % page, h, d, dense_v.at(b, j, h, d));
        }
  const std::int32_t lengths[] = {70, 33};
  const std::vector<float> slopes = paper_slopes(Hq);
  const std::vector<float> sinks = {0.1f, 1.5f, -2.0f, 0.0f};
  AttentionOptions options;
  options.softcap = 3.0f;
  options.alibi_slopes = slopes;
  options.sinks = sinks;
  auto attend = [&](AttentionImpl impl, const KVCacheView& cache, std::vector<float>& lse) {
    Tensor out(DType::f32, {B, 1, Hq, D});
    out.poison();
    lse.assign(B * Hq, NAN);
    kvcache_attention_forward(q.view, cache, lengths, NewKeysValues{}, out.view, lse.data(),
                              options, impl);
    return out;
  };
  std::vector<float> dense_lse, paged_lse, reference_lse;
  const Tensor dense =
      attend(AttentionImpl::flash, KVCacheView{dense_k.view, dense_v.view}, dense_lse);
  const Tensor paged =
      attend(AttentionImpl::flash,
             KVCacheView{paged_k.view, paged_v.view, table.data(), capacity / page}, paged_lse);
  const Tensor reference_out =
      attend(AttentionImpl::reference, KVCacheView{dense_k.view, dense_v.view}, reference_lse);
  EXPECT_EQ(dense.bytes, paged.bytes);
  EXPECT_EQ(dense_lse, paged_lse);
  // The decode bound's order: u32·(scale·D·max|q|·max|k| + modifiers + Skv) relative, max|v| = 5.
  for (std::size_t i = 0; i < dense_lse.size(); ++i) {
    EXPECT_NEAR(dense_lse[i], reference_lse[i], 1e-4) << i;
  }
  dense.for_each_index([&](auto b, auto s, auto h, auto d) {
    EXPECT_NEAR(dense.at(b, s, h, d), reference_out.at(b, s, h, d), 1e-4) << b << " " << h;
  });
}

// The modifier step itself on every SIMD target, at arguments far past the range of a plain exp
// (the libFuzzer harness found e^(2y) overflowing into garbage beyond 2y ~ 178), at both
// infinities and NaN: softcap·tanh(x / softcap) within 8 fp32 roundings of the softcap (the
// header's 4 ulps, twice), the derivative 1 − tanh² likewise of 1; ALiBi on a ragged length.
TEST(ModifyScoresKernel, MatchesTanhAndDistanceOnEveryTarget) {
  const std::vector<float> inputs = {0.0f,      1e-6f,  -0.3f,   0.5f,  3.0f,   -7.5f, 40.0f,
                                     89.0f,     100.0f, -100.0f, 1e6f,  -1e30f, 3e38f, INFINITY,
                                     -INFINITY, 1e-30f, -2.0f,   17.0f, 0.25f};
  on_every_target([&] {
    for (float softcap : {1.0f, 0.015625f, 30.0f}) {
      for (float slope : {0.0f, 0.25f}) {
        std::vector<float> scores = inputs, derivative(inputs.size(), NAN);
        const std::int64_t first_distance = 5;
        detail::cpu::modify_scores(scores.data(), derivative.data(),
                                   static_cast<std::int64_t>(scores.size()), 2.0f,
                                   {softcap, slope, first_distance});
        for (std::size_t j = 0; j < inputs.size(); ++j) {
          const double x = 2.0 * static_cast<double>(inputs[j]);
          const double t = std::tanh(x / softcap);
          const double want = softcap * t - slope * std::abs(first_distance - double(j));
          EXPECT_NEAR(scores[j], want, 8.0 * 0x1p-24 * (softcap + std::abs(want)))
              << "x " << x << " softcap " << softcap << " slope " << slope;
          EXPECT_NEAR(derivative[j], 1.0 - t * t, 8.0 * 0x1p-24)
              << "x " << x << " softcap " << softcap;
        }
      }
    }
    std::vector<float> nan_score = {NAN, 1.0f};
    detail::cpu::modify_scores(nan_score.data(), nullptr, 2, 1.0f, {1.0f, 0.0f, 0});
    EXPECT_TRUE(std::isnan(nan_score[0]));
    EXPECT_NEAR(nan_score[1], std::tanh(1.0), 1e-6);
  });
}

// A row that sees no key adds nothing to dsinks, even with an infinite dO row (out is 0 there;
// the libFuzzer harness found inf · 0 = NaN).
TEST(ModifiersBackward, RowsWithoutKeysAddNothingToDsinks) {
  ModifierCase c{1, 9, 4, 2, 2, 16, 0.0f, Alibi::off, true, true};
  Problem p(c, test_seed());
  for (std::int64_t d = 0; d < 16; ++d) p.dout.set(0, 0, 1, d, INFINITY);  // row 0 sees no key
  const ReferenceGradients ref = reference_gradients(p);
  for (AttentionImpl impl : {AttentionImpl::flash, AttentionImpl::standard}) {
    const Gradients g = run_backward(p, impl, 2);
    for (std::size_t h = 0; h < 2; ++h) {
      EXPECT_TRUE(std::isfinite(g.dsinks[h])) << impl_name(impl) << " head " << h;
      EXPECT_NEAR(g.dsinks[h], ref.dsinks[h], 1e-4 * (1.0 + std::abs(ref.dsinks[h])))
          << impl_name(impl) << " head " << h;
    }
  }
}

// The flash forward refuses `options` with an Error whose message holds `needle`, and leaves out
// as it was.
void expect_forward_refused(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                            std::vector<float>& lse, const AttentionOptions& options,
                            const std::string& needle) {
  out.fill(7.0f);
  try {
    flash_attention_forward(q.view, k.view, v.view, out.view, lse.data(), options);
    ADD_FAILURE() << "accepted; expected an error naming " << needle;
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(needle), std::string::npos) << error.what();
  }
  EXPECT_EQ(out.at(0, 0, 0, 0), 7.0f) << needle;
}

// Bad modifiers: one clear Error naming the argument, nothing written.
TEST(ModifierValidation, BadInputsAreRefused) {
  Tensor q(DType::f32, {2, 3, 4, 8}), k(DType::f32, {2, 5, 2, 8}), v(DType::f32, {2, 5, 2, 8});
  Tensor out(DType::f32, {2, 3, 4, 8});
  std::vector<float> lse(24);
  const std::vector<float> three(3, 0.5f), four(4, 0.5f), eight(8, 0.5f);
  const std::vector<float> with_nan = {0.5f, NAN, 0.5f, 0.5f};
  const std::vector<float> with_inf = {0.5f, 0.5f, INFINITY, 0.5f};
  auto expect_refused = [&](const AttentionOptions& options, const std::string& needle) {
    expect_forward_refused(q, k, v, out, lse, options, needle);
  };
  for (float cap : {-1.0f, NAN, INFINITY}) {
    AttentionOptions options;
    options.softcap = cap;
    expect_refused(options, "softcap: expected a finite value >= 0");
  }
  for (const std::vector<float>* slopes : {&three, &with_nan}) {
    AttentionOptions options;
    options.alibi_slopes = *slopes;
    expect_refused(options, "alibi_slopes");
  }
  for (const std::vector<float>* sinks : {&three, &eight, &with_inf}) {
    AttentionOptions options;
    options.sinks = *sinks;
    expect_refused(options, "sinks");
  }
  {
    AttentionOptions options;
    options.alibi_slopes = eight;  // [batch, heads_q] = [2, 4]: accepted
    EXPECT_NO_THROW(flash_attention_forward(q.view, k.view, v.view, out.view, lse.data(), options));
    options.sinks = std::span<const float>(static_cast<const float*>(out.view.data), 4);
    expect_refused(options, "sinks: expected memory disjoint from out");
  }
  // dsinks without sinks, and dsinks overlapping a gradient.
  Tensor dout(DType::f32, q.view.shape), dq(DType::f32, q.view.shape), dk(DType::f32, k.view.shape),
      dv(DType::f32, k.view.shape);
  std::vector<float> dsinks(4);
  ModifierGradients gradients;
  gradients.dsinks = dsinks.data();
  EXPECT_THROW(flash_attention_backward(dout.view, q.view, k.view, v.view, out.view, lse.data(),
                                        dq.view, dk.view, dv.view, {}, gradients),
               Error);
  AttentionOptions with_sinks;
  with_sinks.sinks = four;
  gradients.dsinks = static_cast<float*>(dq.view.data);
  try {
    flash_attention_backward(dout.view, q.view, k.view, v.view, out.view, lse.data(), dq.view,
                             dk.view, dv.view, with_sinks, gradients);
    ADD_FAILURE() << "dsinks overlapping dq accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("dsinks"), std::string::npos) << error.what();
  }
}

// Bad biases and masks: one clear Error naming the argument, nothing written.
TEST(ModifierValidation, BadBiasesAndMasksAreRefused) {
  const std::int64_t B = 2, Sq = 3, Skv = 5, Hq = 4, Hkv = 2, D = 8;
  Tensor q(DType::f32, {B, Sq, Hq, D}), k(DType::f32, {B, Skv, Hkv, D}),
      v(DType::f32, {B, Skv, Hkv, D}), out(DType::f32, {B, Sq, Hq, D});
  std::vector<float> lse(B * Hq * Sq);
  Tensor bias(DType::f32, {B, Hq, Sq, Skv});
  std::vector<std::uint8_t> keep(B * Hq * Sq * Skv, 1);
  const MaskView mask{reinterpret_cast<const bool*>(keep.data()),
                      {B, Hq, Sq, Skv},
                      contiguous_strides({B, Hq, Sq, Skv})};
  auto expect_refused = [&](const AttentionOptions& options, const std::string& needle) {
    expect_forward_refused(q, k, v, out, lse, options, needle);
  };
  for (const std::array<std::int64_t, 4>& shape : {std::array<std::int64_t, 4>{3, Hq, Sq, Skv},
                                                   {B, 2, Sq, Skv},
                                                   {B, Hq, Skv, Sq},
                                                   {1, 1, Sq, 1},
                                                   {B, Hq, Sq, Skv + 1}}) {
    AttentionOptions options;
    options.bias = ConstTensorView{bias.view.data, DType::f32, shape, contiguous_strides(shape)};
    expect_refused(options, "bias: expected shape [2 or 1, 4 or 1, 3, 5]");
    options = {};
    options.mask = MaskView{mask.data, shape, contiguous_strides(shape)};
    expect_refused(options, "mask: expected shape [2 or 1, 4 or 1, 3, 5]");
  }
  {
    AttentionOptions options;
    options.bias = bias.view;
    options.bias.strides[2] = -1;
    expect_refused(options, "bias: expected non-negative strides");
    options.bias = ConstTensorView{out.view.data, DType::f32, {1, 1, Sq, Skv}, {0, 0, Skv, 1}};
    expect_refused(options, "bias: expected memory disjoint from out");
    options = {};
    options.mask =
        MaskView{static_cast<const bool*>(out.view.data), {1, 1, Sq, Skv}, {0, 0, Skv, 1}};
    expect_refused(options, "mask: expected memory disjoint from out");
  }
  // Broadcast shapes and any strides are accepted.
  {
    AttentionOptions options;
    options.bias = ConstTensorView{bias.view.data, DType::f32, {1, Hq, Sq, Skv}, {0, 0, 0, 0}};
    options.mask = MaskView{mask.data, {B, 1, Sq, Skv}, {1, 0, 3, 7}};
    EXPECT_NO_THROW(flash_attention_forward(q.view, k.view, v.view, out.view, lse.data(), options));
  }
  // Varlen and the KV cache take neither.
  {
    AttentionOptions options;
    options.bias = ConstTensorView{bias.view.data, DType::f32, {1, 1, Sq, Skv}, {0, 0, Skv, 1}};
    const std::int32_t cu[] = {0, Sq};
    Tensor packed_q(DType::f32, {1, Sq, Hq, D}), packed_k(DType::f32, {1, Sq, Hkv, D}),
        packed_out(DType::f32, {1, Sq, Hq, D});
    try {
      varlen_attention_forward(AttentionImpl::flash, packed_q.view, packed_k.view, packed_k.view,
                               cu, cu, 1, packed_out.view, nullptr, options);
      ADD_FAILURE() << "varlen accepted a bias";
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find("bias: expected none"), std::string::npos)
          << error.what();
    }
    options = {};
    options.mask = mask;
    const std::int32_t lengths[] = {1, 2};
    Tensor one(DType::f32, {B, 1, Hq, D}), one_out(DType::f32, {B, 1, Hq, D});
    try {
      kvcache_attention_forward(one.view, KVCacheView{k.view, v.view}, lengths, NewKeysValues{},
                                one_out.view, nullptr, options);
      ADD_FAILURE() << "the KV cache accepted a mask";
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find("mask: expected none"), std::string::npos)
          << error.what();
    }
  }
  // dbias: without a bias, of another shape or dtype, overlapping a gradient.
  Tensor dout(DType::f32, q.view.shape), dq(DType::f32, q.view.shape), dk(DType::f32, k.view.shape),
      dv(DType::f32, k.view.shape);
  AttentionOptions with_bias;
  with_bias.bias = ConstTensorView{
      bias.view.data, DType::f32, {1, Hq, Sq, Skv}, contiguous_strides({1, Hq, Sq, Skv})};
  Tensor dbias(DType::f32, {1, Hq, Sq, Skv}), wrong_shape(DType::f32, {B, Hq, Sq, Skv}),
      wrong_dtype(DType::f16, {1, Hq, Sq, Skv});
  auto expect_backward_refused = [&](const AttentionOptions& options, const TensorView& target,
                                     const std::string& needle) {
    ModifierGradients gradients;
    gradients.dbias = target;
    try {
      flash_attention_backward(dout.view, q.view, k.view, v.view, out.view, lse.data(), dq.view,
                               dk.view, dv.view, options, gradients);
      ADD_FAILURE() << "accepted; expected an error naming " << needle;
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find(needle), std::string::npos) << error.what();
    }
  };
  flash_attention_forward(q.view, k.view, v.view, out.view, lse.data(), with_bias);
  expect_backward_refused({}, dbias.view, "dbias: expected none without options.bias");
  expect_backward_refused(with_bias, wrong_shape.view, "dbias: expected shape [1, 4, 3, 5]");
  expect_backward_refused(with_bias, wrong_dtype.view, "dbias: expected dtype f32");
  expect_backward_refused(
      with_bias,
      TensorView{dq.view.data, DType::f32, {1, Hq, Sq, Skv}, contiguous_strides({1, Hq, Sq, Skv})},
      "dq: expected memory disjoint from dbias");
  expect_backward_refused(with_bias,
                          TensorView{dbias.view.data, DType::f32, {1, Hq, Sq, Skv}, {0, 0, 0, 1}},
                          "dbias: expected strides that give every element its own address");
  ModifierGradients gradients;
  gradients.dbias = dbias.view;
  EXPECT_NO_THROW(flash_attention_backward(dout.view, q.view, k.view, v.view, out.view, lse.data(),
                                           dq.view, dk.view, dv.view, with_bias, gradients));
}

// The bias and mask steps of modify_scores on every SIMD target: contiguous and strided f32,
// f16 and bf16 biases, contiguous and strided masks, over a ragged length.
TEST(ModifyScoresKernel, AddsBiasAndDropsMaskedKeysOnEveryTarget) {
  const std::int64_t n = 37;
  std::mt19937_64 rng(test_seed());
  std::normal_distribution<float> normal;
  std::vector<float> scores(n), bias_f32(3 * n);
  std::vector<std::uint16_t> bias_f16(3 * n), bias_bf16(3 * n);
  std::vector<unsigned char> keep(3 * n);
  for (float& x : scores) x = normal(rng);
  for (std::int64_t i = 0; i < 3 * n; ++i) {
    bias_f32[i] = normal(rng);
    bias_f16[i] = f16_from_f32(bias_f32[i]);
    bias_bf16[i] = bf16_from_f32(bias_f32[i]);
    keep[i] = static_cast<unsigned char>(i % 3 == 0 ? 0 : i % 5);  // any non-zero byte keeps
  }
  on_every_target([&] {
    for (DType dtype : {DType::f32, DType::f16, DType::bf16}) {
      for (std::int64_t stride : {1, 3}) {
        const void* bias = dtype == DType::f32   ? static_cast<const void*>(bias_f32.data())
                           : dtype == DType::f16 ? static_cast<const void*>(bias_f16.data())
                                                 : static_cast<const void*>(bias_bf16.data());
        detail::cpu::RowModifiers row{0.0f, 0.0f, 0, bias, dtype, stride, keep.data(), stride};
        std::vector<float> got = scores;
        detail::cpu::modify_scores(got.data(), nullptr, n, 0.5f, row);
        for (std::int64_t j = 0; j < n; ++j) {
          const float want = keep[j * stride] == 0
                                 ? -INFINITY
                                 : 0.5f * scores[j] + load_f32(bias, dtype, j * stride);
          EXPECT_EQ(got[j], want) << dtype_name(dtype) << " stride " << stride << " j " << j;
        }
      }
    }
    // A −inf bias masks its key even where the score is +inf (the fuzzer found inf − inf = NaN).
    std::vector<float> infinite = {INFINITY, INFINITY, 1.0f};
    const std::vector<float> masking = {-INFINITY, 2.0f, -INFINITY};
    detail::cpu::RowModifiers row{0.0f, 0.0f, 0, masking.data(), DType::f32, 1, nullptr, 0};
    detail::cpu::modify_scores(infinite.data(), nullptr, 3, 1.0f, row);
    EXPECT_EQ(infinite[0], -INFINITY);
    EXPECT_EQ(infinite[1], INFINITY);
    EXPECT_EQ(infinite[2], -INFINITY);
  });
}

}  // namespace
}  // namespace flashattn::testing
