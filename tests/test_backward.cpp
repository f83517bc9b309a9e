// The backward passes: the fp64 reference against central finite differences, then the flash
// and standard backward against the reference on shapes that break tiling.
//
// Tolerance of the fast paths, derived like the forward's (test_attention_vs_reference.cpp):
//  * the standard backward must stay inside a first-order fp32 error bound: its scores carry
//    u32·scale·D·max|q|·max|k| (length-D dot products), its sums over keys and over query rows
//    another u32·(Skv + Sq) relative; every gradient is a sum of products bounded by
//    G = max|grad_ref| + max|dO|·max|v|. Bound: u32·(4·scale·D·max|q|·max|k| + 2·(Skv + Sq) + 16)·G
//    plus one rounding of the output dtype at G;
//  * the flash backward must be within 4x the standard backward's measured max error, plus two
//    roundings of the output dtype and 4 typical score roundings (u32·scale·sqrt(D)·max|q|·max|k|)
//    at G — the same floor as the forward's — plus, for f16 and bf16 inputs, what rounding P and
//    dS to the input dtype as operands of the gradient products may cost (the bf16 products, on
//    AMX or with vdpbf16ps, do; operand_rounding below), plus (Sq + Skv)·2^-126 for the fp32
//    intermediates below the smallest normal float that those products flush.

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>

#include "cpu/kernels/bf16_products.hpp"
#include "cpu/kernels/tile_kernels_bf16.hpp"
#include "test_support.hpp"

namespace flashattn::testing {
namespace {

struct BackwardCase {
  std::int64_t batch, seqlen_q, seqlen_kv, heads_q, heads_kv, head_dim;
  bool causal = false;
  std::int64_t window_left = -1, window_right = -1;
  DType dtype = DType::f32;
  int threads = 2;
  bool head_major = false;      // the seed's [B, H, S, D] memory seen as [B, S, H, D]
  std::int64_t head_dim_v = 0;  // v's, out's, dO's and dV's head dim; 0: head_dim

  std::int64_t value_dims() const { return head_dim_v > 0 ? head_dim_v : head_dim; }
};

std::string describe(const BackwardCase& c) {
  std::ostringstream text;
  text << "B" << c.batch << "_Sq" << c.seqlen_q << "_Skv" << c.seqlen_kv << "_Hq" << c.heads_q
       << "_Hkv" << c.heads_kv << "_D" << c.head_dim
       << (c.head_dim_v > 0 ? "_Dv" + std::to_string(c.head_dim_v) : "")
       << (c.causal ? "_causal" : "");
  if (c.window_left >= 0 || c.window_right >= 0) {
    text << "_win" << c.window_left << "_" << c.window_right;
  }
  text << "_" << dtype_name(c.dtype) << "_t" << c.threads << (c.head_major ? "_bhsd" : "");
  return text.str();
}

std::array<std::int64_t, 4> strides_for(bool head_major, std::array<std::int64_t, 4> shape) {
  const auto [B, S, H, D] = shape;
  return head_major ? std::array<std::int64_t, 4>{H * S * D, D, S * D, 1}
                    : contiguous_strides(shape);
}

// Inputs, the forward's out and lse (by the flash path), and dO.
struct Problem {
  BackwardCase c;
  AttentionOptions options;
  Tensor q, k, v, out, dout;
  std::vector<float> lse;

  explicit Problem(const BackwardCase& c_, std::uint64_t seed)
      : c(c_),
        q(c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.head_dim},
          strides_for(c.head_major, {c.batch, c.seqlen_q, c.heads_q, c.head_dim})),
        k(c.dtype, {c.batch, c.seqlen_kv, c.heads_kv, c.head_dim},
          strides_for(c.head_major, {c.batch, c.seqlen_kv, c.heads_kv, c.head_dim})),
        v(c.dtype, {c.batch, c.seqlen_kv, c.heads_kv, c.value_dims()},
          strides_for(c.head_major, {c.batch, c.seqlen_kv, c.heads_kv, c.value_dims()})),
        out(c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.value_dims()},
            strides_for(c.head_major, {c.batch, c.seqlen_q, c.heads_q, c.value_dims()})),
        dout(c.dtype, out.view.shape, out.view.strides),
        lse(static_cast<std::size_t>(c.batch * c.heads_q * c.seqlen_q)) {
    std::mt19937_64 rng(seed);
    q.fill_normal(rng);
    k.fill_normal(rng);
    v.fill_normal(rng);
    dout.fill_normal(rng);
    options.causal = c.causal;
    options.window_left = c.window_left;
    options.window_right = c.window_right;
    options.num_threads = c.threads;
    flash_attention_forward(q.view, k.view, v.view, out.view, lse.data(), options);
  }

  struct Gradients {
    Tensor dq, dk, dv;
  };
  Gradients run(AttentionImpl impl, int threads) const {
    Gradients g{Tensor(c.dtype, q.view.shape, q.view.strides),
                Tensor(c.dtype, k.view.shape, k.view.strides),
                Tensor(c.dtype, v.view.shape, v.view.strides)};
    g.dq.poison();
    g.dk.poison();
    g.dv.poison();
    AttentionOptions run_options = options;
    run_options.num_threads = threads;
    attention_backward(impl, dout.view, q.view, k.view, v.view, out.view, lse.data(), g.dq.view,
                       g.dk.view, g.dv.view, run_options);
    return g;
  }
};

struct ReferenceGradients {
  std::vector<double> dq, dk, dv;  // contiguous
};

ReferenceGradients reference_gradients(const Problem& p) {
  Tensor dq(p.c.dtype, p.q.view.shape), dk(p.c.dtype, p.k.view.shape),
      dv(p.c.dtype, p.v.view.shape);
  const detail::BackwardParams params =
      detail::make_backward_params("reference", p.dout.view, p.q.view, p.k.view, p.v.view,
                                   p.out.view, p.lse.data(), dq.view, dk.view, dv.view, p.options);
  ReferenceGradients ref;
  ref.dq.resize(static_cast<std::size_t>(p.q.view.numel()));
  ref.dk.resize(static_cast<std::size_t>(p.k.view.numel()));
  ref.dv.resize(static_cast<std::size_t>(p.v.view.numel()));
  detail::reference_backward_f64(params, ref.dq.data(), ref.dk.data(), ref.dv.data());
  return ref;
}

class BackwardVsReference : public ::testing::TestWithParam<BackwardCase> {};

struct OperandRounding {
  double dq = 0.0, dk = 0.0, dv = 0.0;
};

// First-order bounds of rounding P and dS (unscaled: P ∘ (dP − D_i)) to the input dtype as the
// left operands of dV += Pᵀ·dO, dK += scale·dSᵀ·Q and dQ += scale·dS·K, from fp64 P and dS:
//   dV[j,d]: u·Σ_i P[i,j]·|dO[i,d]|      dK[j,d]: u·scale·Σ_i |dS[i,j]|·|Q[i,d]|
//   dQ[i,d]: u·scale·Σ_j |dS[i,j]|·|K[j,d]|, each maximized over its elements. 0 for f32.
OperandRounding operand_rounding(const Problem& p, const detail::AttentionParams& params) {
  OperandRounding bound;
  if (p.c.dtype == DType::f32) return bound;
  const double u = unit_roundoff(p.c.dtype), scale = params.scale;
  const std::int64_t B = p.c.batch, Hq = p.c.heads_q, Sq = p.c.seqlen_q, Skv = p.c.seqlen_kv;
  const std::int64_t D = p.c.head_dim, Dv = p.c.value_dims(), group = Hq / p.c.heads_kv;
  std::vector<double> p_row(static_cast<std::size_t>(Skv)), ds_row(p_row.size());
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h_kv = 0; h_kv < p.c.heads_kv; ++h_kv) {
      // Column sums over the group's rows, per key and dim, for dV and dK.
      std::vector<double> dv_sum(static_cast<std::size_t>(Skv * Dv)),
          dk_sum(static_cast<std::size_t>(Skv * D));
      for (std::int64_t h = h_kv * group; h < (h_kv + 1) * group; ++h) {
        for (std::int64_t i = 0; i < Sq; ++i) {
          const double lse = p.lse[static_cast<std::size_t>((b * Hq + h) * Sq + i)];
          double delta = 0.0;
          for (std::int64_t d = 0; d < Dv; ++d)
            delta += p.dout.at(b, i, h, d) * p.out.at(b, i, h, d);
          const detail::KeyRange visible = params.key_range(i);
          for (std::int64_t j = 0; j < Skv; ++j) {
            p_row[j] = ds_row[j] = 0.0;
            if (j < visible.begin || j >= visible.end || std::isinf(lse)) continue;
            double s = 0.0, dp = 0.0;
            for (std::int64_t d = 0; d < D; ++d) {
              s += static_cast<double>(p.q.at(b, i, h, d)) * p.k.at(b, j, h_kv, d);
            }
            for (std::int64_t d = 0; d < Dv; ++d) {
              dp += static_cast<double>(p.dout.at(b, i, h, d)) * p.v.at(b, j, h_kv, d);
            }
            p_row[j] = std::exp(s * scale - lse);
            ds_row[j] = std::abs(p_row[j] * (dp - delta));
          }
          for (std::int64_t d = 0; d < D; ++d) {
            double dq_sum = 0.0;
            for (std::int64_t j = 0; j < Skv; ++j) {
              dq_sum += ds_row[j] * std::abs(p.k.at(b, j, h_kv, d));
              dk_sum[j * D + d] += ds_row[j] * std::abs(p.q.at(b, i, h, d));
            }
            bound.dq = std::max(bound.dq, u * scale * dq_sum);
          }
          for (std::int64_t d = 0; d < Dv; ++d) {
            for (std::int64_t j = 0; j < Skv; ++j) {
              dv_sum[j * Dv + d] += p_row[j] * std::abs(p.dout.at(b, i, h, d));
            }
          }
        }
      }
      for (const double sum : dv_sum) bound.dv = std::max(bound.dv, u * sum);
      for (const double sum : dk_sum) bound.dk = std::max(bound.dk, u * scale * sum);
    }
  }
  return bound;
}

// Flash and standard backward of p against the fp64 reference, within the bounds above.
void expect_backward_matches_reference(const Problem& p, std::uint64_t seed) {
  const BackwardCase& c = p.c;
  const ReferenceGradients ref = reference_gradients(p);
  const auto standard = p.run(AttentionImpl::standard, c.threads);
  const auto flash = p.run(AttentionImpl::flash, c.threads);

  const double u32 = unit_roundoff(DType::f32), u_out = unit_roundoff(c.dtype);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  const double qk = max_abs(p.q) * max_abs(p.k);
  const double dv_scale = max_abs(p.dout) * max_abs(p.v);
  const double first_order =
      4.0 * scale * c.head_dim * qk + 2.0 * (c.seqlen_kv + c.seqlen_q) + 16.0;
  const double score_rounding = u32 * scale * std::sqrt(static_cast<double>(c.head_dim)) * qk;
  Tensor scratch_dq(c.dtype, p.q.view.shape), scratch_dk(c.dtype, p.k.view.shape),
      scratch_dv(c.dtype, p.v.view.shape);
  const detail::BackwardParams params = detail::make_backward_params(
      "flash", p.dout.view, p.q.view, p.k.view, p.v.view, p.out.view, p.lse.data(), scratch_dq.view,
      scratch_dk.view, scratch_dv.view, p.options);
  const OperandRounding rounding = operand_rounding(p, params.forward);
  const double flushed = static_cast<double>(c.seqlen_q + c.seqlen_kv) * 0x1p-126;

  const std::pair<const char*, std::tuple<const Tensor*, const Tensor*, const std::vector<double>*>>
      gradients[] = {{"dq", {&standard.dq, &flash.dq, &ref.dq}},
                     {"dk", {&standard.dk, &flash.dk, &ref.dk}},
                     {"dv", {&standard.dv, &flash.dv, &ref.dv}}};
  const double operand_bounds[] = {rounding.dq, rounding.dk, rounding.dv};
  int index = 0;
  for (const auto& [name, tensors] : gradients) {
    const double operand_bound = operand_bounds[index++];
    const auto& [standard_grad, flash_grad, ref_grad] = tensors;
    const double magnitude = max_abs_finite(*ref_grad) + dv_scale;
    const double standard_bound = u32 * first_order * magnitude + u_out * magnitude;
    const MaxError standard_error = max_error(*standard_grad, *ref_grad);
    const MaxError flash_error = max_error(*flash_grad, *ref_grad);
    const double flash_bound = 4.0 * standard_error.value +
                               (2.0 * u_out + 4.0 * score_rounding) * magnitude + operand_bound +
                               flushed;
    const std::string context = describe(c) + " seed " + std::to_string(seed) + " " + name;
    EXPECT_LE(standard_error.value, standard_bound)
        << context << ": standard [" << standard_error.index << "] = " << standard_error.got
        << ", reference " << standard_error.want;
    EXPECT_LE(flash_error.value, flash_bound)
        << context << ": flash [" << flash_error.index << "] = " << flash_error.got
        << ", reference " << flash_error.want << " (standard max error " << standard_error.value
        << ")";
  }
}

// bf16 cases run once per way of multiplying bf16 that this CPU supports (widened, vdpbf16ps,
// AMX), not only the default one.
TEST_P(BackwardVsReference, FlashAndStandardMatchFp64Reference) {
  const BackwardCase& c = GetParam();
  const std::uint64_t seed = test_seed() ^ std::hash<std::string>{}(describe(c));
  const Problem p(c, seed);
  if (c.dtype != DType::bf16) {
    expect_backward_matches_reference(p, seed);
    return;
  }
  for (detail::cpu::Bf16Products products : detail::cpu::supported_bf16_products()) {
    SCOPED_TRACE(detail::cpu::bf16_products_name(products));
    detail::cpu::force_bf16_products(products);
    expect_backward_matches_reference(p, seed);
  }
  detail::cpu::force_bf16_products(std::nullopt);
}

std::vector<BackwardCase> backward_grid() {
  std::vector<BackwardCase> grid = {
      {1, 1, 1, 1, 1, 32},
      {2, 7, 7, 2, 2, 32, true},
      {1, 64, 64, 2, 2, 64, false},
      {1, 113, 203, 4, 2, 40, true},
      {1, 203, 113, 4, 2, 40, true},
      {1, 1, 239, 2, 1, 64, true},
      {1, 239, 1, 2, 1, 64, false},
      {2, 129, 129, 2, 1, 59, true},
      {1, 255, 255, 2, 2, 64, false, 16, 0},
      {1, 200, 150, 2, 2, 48, true, 40, 8},
      {1, 300, 300, 2, 2, 128, true},
      {1, 97, 131, 6, 1, 111, false},
      {1, 65, 70, 2, 2, 256, true},
      {1, 129, 257, 2, 2, 80, false},
  };
  grid[2].threads = 1;
  grid[4].threads = 3;
  grid[7].threads = 3;
  grid[9].head_major = true;
  grid[12].head_major = true;
  BackwardCase f16{1, 131, 97, 4, 2, 64, true};
  f16.dtype = DType::f16;
  BackwardCase bf16{1, 97, 131, 2, 1, 96, false, 20, 20};
  bf16.dtype = DType::bf16;
  grid.push_back(f16);
  grid.push_back(bf16);
  // At least 8 (batch, KV head) groups: each task owns its group's query rows and dQ sums
  // (flash_backward.cpp) instead of sharing them with the other chunks of its group.
  BackwardCase owned{2, 97, 131, 8, 4, 40, true};
  owned.threads = 3;
  BackwardCase owned_window{3, 70, 61, 6, 3, 64, false, 20, 5};
  owned_window.dtype = DType::bf16;
  grid.push_back(owned);
  grid.push_back(owned_window);
  // bf16 runs on bf16 products (AMX, vdpbf16ps) where the CPU has them: rows and keys that end
  // inside a tile and inside a 32-element reduction step, GQA, causal with Sq != Skv, head-major
  // strides, and head dims that pad (59 -> 64, 80 -> 96) or span several panels (256).
  for (BackwardCase c :
       {BackwardCase{2, 129, 129, 4, 2, 59, true}, BackwardCase{1, 203, 113, 2, 1, 80, true},
        BackwardCase{1, 65, 70, 2, 2, 256, false}}) {
    c.dtype = DType::bf16;
    c.threads = 3;
    grid.push_back(c);
  }
  grid.back().head_major = true;
  // A value head dim unlike the key head dim, smaller and larger, whole and ragged numbers of
  // vectors: fp32, f16 and bf16 on every bf16 product path, GQA, causal both alignments, a
  // window, head-major strides, and enough groups for tasks that own their query rows.
  const std::pair<BackwardCase, std::int64_t> value_dims[] = {
      {{1, 113, 203, 4, 2, 192, true}, 128},      {{1, 203, 113, 4, 2, 64, true}, 128},
      {{2, 129, 129, 2, 1, 59, true}, 96},        {{1, 97, 131, 6, 1, 40, false}, 17},
      {{1, 150, 150, 2, 2, 48, true, 40, 8}, 80}, {{2, 97, 131, 8, 4, 96, true}, 40},
      {{1, 129, 129, 4, 2, 192, true}, 128},      {{1, 65, 70, 2, 2, 64, false}, 80},
      {{1, 131, 97, 4, 2, 80, true}, 59}};
  int n = 0;
  for (auto [c, dv] : value_dims) {
    c.head_dim_v = dv;
    c.threads = 1 + n % 3;
    if (n >= 6) c.dtype = n == 8 ? DType::f16 : DType::bf16;
    c.head_major = n % 4 == 3;
    grid.push_back(c);
    ++n;
  }
  return grid;
}

INSTANTIATE_TEST_SUITE_P(Grid, BackwardVsReference, ::testing::ValuesIn(backward_grid()),
                         [](const auto& info) { return describe(info.param); });

// The reference itself: central finite differences of L = Σ dO ∘ O through the fp64 forward
// reference, for a sample of elements of q, k and v. The perturbation is read back from the
// float it was stored in, so the quotient uses the step actually taken; with h = 2^-10 the
// truncation error is O(h²) ~ 1e-6 of the gradient's scale.
TEST(BackwardReference, MatchesFiniteDifferences) {
  for (bool causal : {false, true}) {
    for (const auto& heads : {std::pair<std::int64_t, std::int64_t>{2, 2}, {4, 1}}) {
      const std::int64_t heads_q = heads.first, heads_kv = heads.second;
      BackwardCase c{1, 5, 6, heads_q, heads_kv, 8, causal};
      Problem p(c, test_seed() + static_cast<std::uint64_t>(causal) + heads_kv);
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
      const std::pair<const char*, std::pair<Tensor*, const std::vector<double>*>> inputs[] = {
          {"q", {&p.q, &ref.dq}}, {"k", {&p.k, &ref.dk}}, {"v", {&p.v, &ref.dv}}};
      // Plain variables, not structured bindings: clang 14 (the tsan job) cannot capture those.
      for (const auto& input : inputs) {
        const char* name = input.first;
        Tensor* tensor = input.second.first;
        const std::vector<double>* gradient = input.second.second;
        std::int64_t flat = 0;
        tensor->for_each_index([&](auto a, auto b, auto cc, auto d) {
          if (flat++ % 3 != 0) return;  // a third of the elements keeps this fast
          const float original = tensor->at(a, b, cc, d);
          const double h = 0x1p-10;
          tensor->set(a, b, cc, d, static_cast<float>(original + h));
          const double plus_x = tensor->at(a, b, cc, d), plus = loss();
          tensor->set(a, b, cc, d, static_cast<float>(original - h));
          const double minus_x = tensor->at(a, b, cc, d), minus = loss();
          tensor->set(a, b, cc, d, original);
          const double numeric = (plus - minus) / (plus_x - minus_x);
          EXPECT_NEAR((*gradient)[flat - 1], numeric, 1e-5 * (1.0 + std::abs(numeric)))
              << name << "[" << flat - 1 << "] causal " << causal << " Hq " << heads_q << " Hkv "
              << heads_kv;
        });
      }
    }
  }
}

// Rows that see no key (causal with Sq > Skv) contribute nothing and get dq = 0, never NaN.
TEST(Backward, FullyMaskedRowsGiveZeroGradients) {
  const BackwardCase c{1, 9, 4, 2, 2, 16, true};
  const Problem p(c, test_seed());
  for (AttentionImpl impl :
       {AttentionImpl::flash, AttentionImpl::standard, AttentionImpl::reference}) {
    const auto g = p.run(impl, 2);
    for (std::int64_t row = 0; row < 9; ++row)
      for (std::int64_t h = 0; h < 2; ++h)
        for (std::int64_t d = 0; d < 16; ++d) {
          const float value = g.dq.at(0, row, h, d);
          if (row < 5) {
            EXPECT_EQ(value, 0.0f) << impl_name(impl) << " row " << row;
          }
          EXPECT_TRUE(std::isfinite(value)) << impl_name(impl) << " row " << row;
        }
    for (const Tensor* t : {&g.dk, &g.dv}) {
      t->for_each_index([&](auto a, auto b, auto cc, auto d) {
        EXPECT_TRUE(std::isfinite(t->at(a, b, cc, d))) << impl_name(impl);
      });
    }
  }
}

// No keys at all: every row is fully masked, dq is 0 and dk, dv are empty. With 2 and with 8
// (batch, KV head) groups: the flash path's shared and task-owned query rows.
TEST(Backward, EmptyKeySequence) {
  for (const BackwardCase& c :
       {BackwardCase{1, 5, 0, 2, 2, 16, false}, BackwardCase{2, 5, 0, 8, 4, 16, false}}) {
    const Problem p(c, test_seed());
    for (AttentionImpl impl :
         {AttentionImpl::flash, AttentionImpl::standard, AttentionImpl::reference}) {
      const auto g = p.run(impl, 2);
      g.dq.for_each_index([&](auto a, auto b, auto cc, auto d) {
        EXPECT_EQ(g.dq.at(a, b, cc, d), 0.0f) << impl_name(impl) << " " << describe(c);
      });
    }
  }
}

// Keys that no query row sees get zero dK and dV, written into the NaN-poisoned buffers: one
// query against 300 keys with a window of 50 (the first K/V blocks are seen by no row), and no
// queries at all (the backward fuzzer found both left unwritten by the flash path).
TEST(Backward, KeysNoRowSeesGetZeroGradients) {
  BackwardCase window{1, 1, 300, 2, 1, 32, false, 50, 0};
  BackwardCase no_queries{1, 0, 70, 2, 2, 16, false};
  for (const BackwardCase& c : {window, no_queries}) {
    const Problem p(c, test_seed());
    const ReferenceGradients ref = reference_gradients(p);
    for (AttentionImpl impl :
         {AttentionImpl::flash, AttentionImpl::standard, AttentionImpl::reference}) {
      const auto g = p.run(impl, 2);
      std::size_t index = 0;
      std::int64_t zeros = 0;
      g.dk.for_each_index([&](auto a, auto b, auto h, auto d) {
        const double want_k = ref.dk[index], want_v = ref.dv[index];
        ++index;
        if (want_k != 0.0 || want_v != 0.0) return;
        ++zeros;
        EXPECT_EQ(g.dk.at(a, b, h, d), 0.0f)
            << impl_name(impl) << " " << describe(c) << " key " << b;
        EXPECT_EQ(g.dv.at(a, b, h, d), 0.0f)
            << impl_name(impl) << " " << describe(c) << " key " << b;
      });
      EXPECT_GT(zeros, 0) << describe(c);
    }
  }
}

// The chunks' dQ partial sums are added in a fixed order and every dK, dV row has one owner.
// 2 groups of 4 chunks each, and 8 groups whose tasks own their query rows; the first also in
// bf16, once per way of multiplying bf16 that this CPU supports.
TEST(Backward, FlashIsBitwiseIdenticalForAnyThreadCount) {
  BackwardCase bf16{1, 301, 517, 4, 2, 72, true};
  bf16.dtype = DType::bf16;
  for (const BackwardCase& c : {BackwardCase{1, 301, 517, 4, 2, 72, true},
                                BackwardCase{2, 150, 200, 8, 4, 40, true}, bf16}) {
    const Problem p(c, test_seed());
    // Other dtypes ignore the bf16 way: they run once.
    const std::vector<detail::cpu::Bf16Products> ways =
        c.dtype == DType::bf16 ? detail::cpu::supported_bf16_products()
                               : std::vector{detail::cpu::Bf16Products::widened};
    for (const detail::cpu::Bf16Products way : ways) {
      detail::cpu::force_bf16_products(way);
      const std::string context = describe(c) + ", " + detail::cpu::bf16_products_name(way);
      const auto first = p.run(AttentionImpl::flash, 1);
      for (int threads : {2, 3, 7}) {
        const auto other = p.run(AttentionImpl::flash, threads);
        EXPECT_EQ(other.dq.bytes, first.dq.bytes) << threads << " threads, " << context;
        EXPECT_EQ(other.dk.bytes, first.dk.bytes) << threads << " threads, " << context;
        EXPECT_EQ(other.dv.bytes, first.dv.bytes) << threads << " threads, " << context;
      }
    }
  }
  detail::cpu::force_bf16_products(std::nullopt);
}

// With bf16 products (AMX tiles, vdpbf16ps) the backward computes S and dP in bf16, which counts
// a subnormal bf16 as zero; a (row block, K/V block) pair where either holds one goes the fp32 way.
// Subnormal q at rows [64, 128) (one row block) against k near 2^125, or subnormal k at keys [128,
// 256) (one K/V block) against q near 2^125, make scores of order 1 that a flushed operand would
// turn into 0 (the other rows or keys are scaled by 2^-120 so that no score overflows). Every
// bf16 product path against the widened fp32 path (on these extreme inputs the standard
// backward leaves the bounds above, so the reference check cannot lean on it): a flushed operand
// moves the gradients by their own size, the order of the fp32 sums by far less than 1% of the
// largest (plus what flushing sums below 2^-126 costs, below); and bitwise identical for 1, 2, 3
// and 7 threads. One batch: several tasks share the query rows, laid out in advance; 8 batches:
// each task owns its group's rows and lays out their fp32 panels only for the pairs that fall back
// (the same scratch serving one group after another).
TEST(Backward, Bf16SubnormalsInSomeBlocksAreUsed) {
  const std::uint64_t seed = test_seed() ^ 37;
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> integer(-100, 100);
  for (const auto& config :
       {std::pair<std::int64_t, bool>{1, false}, {1, true}, {8, false}, {8, true}}) {
    // Not a structured binding: clang 14 (the sanitizer jobs) cannot capture one in a lambda.
    const std::int64_t batch = config.first;
    const bool subnormal_keys = config.second;
    BackwardCase c{batch, 200, 300, 2, 1, 64, true};
    c.dtype = DType::bf16;
    Problem p(c, seed);
    Tensor& small = subnormal_keys ? p.k : p.q;
    Tensor& large = subnormal_keys ? p.q : p.k;
    small.for_each_index([&](auto a, auto row, auto h, auto d) {
      const bool subnormal = subnormal_keys ? row >= 128 && row < 256 : row >= 64 && row < 128;
      small.set(a, row, h, d,
                subnormal ? static_cast<float>(std::ldexp(integer(rng), -133))
                          : std::ldexp(small.at(a, row, h, d), -120));
    });
    large.for_each_index([&](auto a, auto row, auto h, auto d) {
      large.set(a, row, h, d, std::ldexp(large.at(a, row, h, d), 125));
    });
    p.options.num_threads = 1;
    detail::cpu::force_bf16_products(detail::cpu::Bf16Products::widened);
    flash_attention_forward(p.q.view, p.k.view, p.v.view, p.out.view, p.lse.data(), p.options);
    const auto widened = p.run(AttentionImpl::flash, 2);
    // The bf16 products flush every fp32 sum below 2^-126 to zero (vdpbf16ps and AMX imply FTZ):
    // at most 2^-126 per term of a gradient element's sum, which matters for the gradient of the
    // small operand (dk for small q, dq for small k), a sum of products with its 2^-120-scaled
    // rows that lies near 2^-126 itself (seen: largest 1.6e-38, vdpbf16ps off by 1.8e-38).
    const double flushed =
        static_cast<double>(c.seqlen_q * (c.heads_q / c.heads_kv) + c.seqlen_kv) * 0x1p-126;
    for (detail::cpu::Bf16Products products : detail::cpu::supported_bf16_products()) {
      detail::cpu::force_bf16_products(products);
      SCOPED_TRACE(std::to_string(batch) + " batches, " +
                   (subnormal_keys ? "subnormal k, " : "subnormal q, ") +
                   detail::cpu::bf16_products_name(products));
      const auto first = p.run(AttentionImpl::flash, 1);
      for (const auto& [name, got, want] :
           {std::tuple{"dq", &first.dq, &widened.dq}, std::tuple{"dk", &first.dk, &widened.dk},
            std::tuple{"dv", &first.dv, &widened.dv}}) {
        double largest = 0.0, worst = 0.0;
        want->for_each_index([&, w = want, g = got](auto a, auto b, auto h, auto d) {
          largest = std::max(largest, std::abs(static_cast<double>(w->at(a, b, h, d))));
          worst =
              std::max(worst, std::abs(static_cast<double>(g->at(a, b, h, d)) - w->at(a, b, h, d)));
        });
        EXPECT_GT(largest, 0.0) << name;
        EXPECT_LE(worst, 0.01 * largest + flushed) << name << " differs from the widened path's";
      }
      for (int threads : {2, 3, 7}) {
        const auto other = p.run(AttentionImpl::flash, threads);
        EXPECT_EQ(other.dq.bytes, first.dq.bytes) << threads << " threads";
        EXPECT_EQ(other.dk.bytes, first.dk.bytes) << threads << " threads";
        EXPECT_EQ(other.dv.bytes, first.dv.bytes) << threads << " threads";
      }
    }
  }
  detail::cpu::force_bf16_products(std::nullopt);
}

// An infinity or a NaN in q, k, v or dO reaches exactly the gradient elements that the fp64
// reference gives non-finite, and no other: in particular not the rows and keys that a causal
// mask or a window keeps apart from it, where the blocked products would multiply it by a
// masked pair's 0 (0·inf = NaN; cpu/kernels/visible_gradients.hpp). 150 rows and keys make row
// blocks and K/V blocks that the mask cuts (the flash backward's tiles are 64 x 128); GQA, 1 and 3
// threads, every dtype (bf16 on bf16 products where the CPU has them). With the flash path's
// visible-pairs step switched off, 72 of these checks failed. The values of the finite
// elements are the grid test's business; here they only have to be within 1% of the
// gradient's largest finite value, which catches an element left unwritten or added twice.
TEST(Backward, NonFiniteInputsReachOnlyTheGradientsThatReadThem) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  constexpr std::int64_t kSeq = 150;
  struct Poison {
    const char* name;
    std::function<void(Problem&)> apply;
  };
  const Poison poisons[] = {
      {"keys_and_values_after_the_diagonal",
       [](Problem& p) {
         p.k.set(0, kSeq - 1, 0, 0, kNaN);
         p.v.set(0, kSeq - 1, 0, 1, kInf);
         p.v.set(0, kSeq - 20, 0, 2, kNaN);
         p.k.set(0, 131, 0, 3, -kInf);
       }},
      {"query_row", [](Problem& p) { p.q.set(0, 70, 1, 2, kInf); }},
      // Every score of row 70 is -inf: the forward gives out NaN and lse -inf, which the
      // backward must not take for a fully masked row's (zero gradients).
      {"query_row_whose_scores_are_all_minus_inf",
       [](Problem& p) {
         for (std::int64_t key = 0; key < kSeq; ++key) p.k.set(0, key, 0, 3, 1.0f);
         p.q.set(0, 70, 1, 3, -kInf);
       }},
      {"output_gradient_row", [](Problem& p) { p.dout.set(0, 40, 0, 1, kNaN); }},
  };
  for (const DType dtype : {DType::f32, DType::f16, DType::bf16}) {
    for (const bool window : {false, true}) {
      BackwardCase c{1, kSeq, kSeq, 2, 1, 16, !window, window ? 30 : -1, window ? 10 : -1, dtype};
      for (const Poison& poison : poisons) {
        Problem p(c, test_seed() ^ 41);
        poison.apply(p);
        flash_attention_forward(p.q.view, p.k.view, p.v.view, p.out.view, p.lse.data(), p.options);
        const ReferenceGradients ref = reference_gradients(p);
        for (const AttentionImpl impl : {AttentionImpl::flash, AttentionImpl::standard}) {
          for (const int threads : {1, 3}) {
            const auto got = p.run(impl, threads);
            const std::string context = std::string(poison.name) + " " + describe(c) + " " +
                                        impl_name(impl) + " threads " + std::to_string(threads);
            std::int64_t finite = 0, non_finite = 0;
            for (const auto& [name, tensor, want] :
                 {std::tuple{"dq", &got.dq, &ref.dq}, std::tuple{"dk", &got.dk, &ref.dk},
                  std::tuple{"dv", &got.dv, &ref.dv}}) {
              const double tolerance = 0.01 * max_abs_finite(*want);
              std::string first_mismatch;
              std::size_t index = 0;
              tensor->for_each_index([&, t = tensor, w = want](auto a, auto b, auto h, auto d) {
                const double expected = (*w)[index++];
                const double value = t->at(a, b, h, d);
                (std::isfinite(expected) ? finite : non_finite) += 1;
                const bool wrong =
                    std::isfinite(value) != std::isfinite(expected) ||
                    (std::isfinite(expected) && std::abs(value - expected) > tolerance);
                if (wrong && first_mismatch.empty()) {
                  first_mismatch = "[" + std::to_string(b) + ", " + std::to_string(h) + ", " +
                                   std::to_string(d) + "] = " + std::to_string(value) +
                                   ", reference " + std::to_string(expected);
                }
              });
              EXPECT_EQ(first_mismatch, "") << context << " " << name;
            }
            // Not vacuous: the poison reaches some gradient elements and not others.
            EXPECT_GT(finite, 0) << context;
            EXPECT_GT(non_finite, 0) << context;
          }
        }
      }
    }
  }
}

TEST(Backward, BadInputNamesTheArgument) {
  const BackwardCase c{1, 5, 6, 2, 2, 8};
  const Problem p(c, 1);
  Tensor dq(DType::f32, {1, 5, 2, 8}), dk(DType::f32, {1, 6, 2, 8}), dv(DType::f32, {1, 6, 2, 8});
  Tensor wrong_dout(DType::f32, {1, 4, 2, 8});
  auto message = [&](auto&& call) {
    try {
      call();
    } catch (const Error& error) {
      return std::string(error.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] {
              flash_attention_backward(wrong_dout.view, p.q.view, p.k.view, p.v.view, p.out.view,
                                       p.lse.data(), dq.view, dk.view, dv.view);
            }).find("dout: expected shape [1, 5, 2, 8] (as out), got [1, 4, 2, 8]"),
            std::string::npos);
  EXPECT_NE(message([&] {
              flash_attention_backward(p.dout.view, p.q.view, p.k.view, p.v.view, p.out.view,
                                       nullptr, dq.view, dk.view, dv.view);
            }).find("lse: expected the forward's logsumexp [1, 2, 5], got null"),
            std::string::npos);
  EXPECT_NE(message([&] {
              flash_attention_backward(p.dout.view, p.q.view, p.k.view, p.v.view, p.out.view,
                                       p.lse.data(), dq.view, dq.view, dv.view);
            }).find("expected shape [1, 6, 2, 8] (as k)"),
            std::string::npos);
  EXPECT_NE(message([&] {
              TensorView aliased = dk.view;
              aliased.data = dv.view.data;
              flash_attention_backward(p.dout.view, p.q.view, p.k.view, p.v.view, p.out.view,
                                       p.lse.data(), dq.view, aliased, dv.view);
            }).find("dv: expected memory disjoint from dk"),
            std::string::npos);
}

// dq, dk and dv may interleave in one buffer, as FlashAttention's packed gradient dqkv
// [B, S, 3, H, D] holds them: the same bits as three separate buffers, on every path. Views that
// share one element, or interleave with other strides, are refused.
TEST(Backward, GradientsInterleavedInOnePackedBufferAreAccepted) {
  constexpr std::int64_t B = 2, S = 37, H = 3, D = 24;
  const BackwardCase c{B, S, S, H, H, D};
  const Problem p(c, test_seed());
  const std::array<std::int64_t, 4> shape{B, S, H, D};
  const std::array<std::int64_t, 4> packed_strides{S * 3 * H * D, 3 * H * D, D, 1};
  for (AttentionImpl impl :
       {AttentionImpl::flash, AttentionImpl::standard, AttentionImpl::reference}) {
    Tensor dq(DType::f32, shape), dk(DType::f32, shape), dv(DType::f32, shape);
    attention_backward(impl, p.dout.view, p.q.view, p.k.view, p.v.view, p.out.view, p.lse.data(),
                       dq.view, dk.view, dv.view);
    std::vector<float> packed(static_cast<std::size_t>(B * S * 3 * H * D), NAN);
    auto part = [&](std::int64_t i) {
      return TensorView{packed.data() + i * H * D, DType::f32, shape, packed_strides};
    };
    attention_backward(impl, p.dout.view, p.q.view, p.k.view, p.v.view, p.out.view, p.lse.data(),
                       part(0), part(1), part(2));
    const Tensor* separate[] = {&dq, &dk, &dv};
    for (std::int64_t i = 0; i < 3; ++i) {
      separate[i]->for_each_index([&](auto b, auto s, auto h, auto d) {
        const float got =
            packed[static_cast<std::size_t>(((b * S + s) * 3 + i) * H * D + h * D + d)];
        ASSERT_EQ(std::bit_cast<std::uint32_t>(got),
                  std::bit_cast<std::uint32_t>(separate[i]->at(b, s, h, d)))
            << impl_name(impl) << " gradient " << i << " at " << b << " " << s << " " << h << " "
            << d;
      });
    }
    // One element shared: dk shifted onto the last element of dq's first row.
    TensorView shifted = part(1);
    shifted.data = packed.data() + 3 * H * D - 1;
    EXPECT_THROW(attention_backward(impl, p.dout.view, p.q.view, p.k.view, p.v.view, p.out.view,
                                    p.lse.data(), part(0), shifted, part(2)),
                 Error);
    // dk contiguous inside dq's span (other strides): refused by the spans, as before.
    const TensorView contiguous{packed.data() + 1, DType::f32, shape, contiguous_strides(shape)};
    EXPECT_THROW(attention_backward(impl, p.dout.view, p.q.view, p.k.view, p.v.view, p.out.view,
                                    p.lse.data(), part(0), contiguous, part(2)),
                 Error);
  }
}

}  // namespace
}  // namespace flashattn::testing
