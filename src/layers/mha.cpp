// The multi-head attention layer of seed 000, for fp32 activations [batch, seqlen, H].
//
// Data flow of one forward call (self-attention: context = x, seqlen_kv = seqlen_q):
//
//   x       [B·Sq,  H] --sgemm W_Q [H, H]   (+b_Q)--> q   [B·Sq,  H]    = [B, Sq,  Nh,  Dh]
//   context [B·Skv, H] --sgemm W_K [H, Hkv] (+b_K)--> k   [B·Skv, Hkv]  = [B, Skv, Nkv, Dh]
//   context [B·Skv, H] --sgemm W_V [H, Hkv] (+b_V)--> v   [B·Skv, Hkv]  = [B, Skv, Nkv, Dh]
//   attention_forward(impl, q, k, v)             --> att [B·Sq,  H]    = [B, Sq,  Nh,  Dh]
//   att     [B·Sq,  H] --sgemm W_O [H, H]   (+b_O)--> y   [B·Sq,  H]
//
// with Hkv = Nkv·Dh. Splitting heads costs nothing: a row-major [B·S, Nh·Dh] matrix is the
// [B, S, Nh, Dh] tensor with strides {S·H, H, Dh, 1}, which attention_forward reads directly (the
// seed's [B, Nh, S, Dh] is the same memory through strides {S·H, Dh, H, 1}). Likewise the
// attention output, written as [B, Sq, Nh, Dh], already is the merged [B·Sq, H] matrix that the
// output projection multiplies.
//
// The backward runs the same chain in reverse, each projection out = in·W + b giving
// dW = inᵀ·dout, db = column sums of dout and din = dout·Wᵀ:
//
//   dy  --> dW_O = attᵀ·dy, db_O, datt = dy·W_Oᵀ
//   attention_backward(impl, datt, q, k, v, att, lse) --> dq, dk, dv   (same head views)
//   dq  --> dW_Q = xᵀ·dq, db_Q, dx = dq·W_Qᵀ
//   dk  --> dW_K = contextᵀ·dk, db_K, dcontext += dk·W_Kᵀ      (self-attention: into dx)
//   dv  --> dW_V = contextᵀ·dv, db_V, dcontext += dv·W_Vᵀ
//
// Buffers allocated per forward call (fp32): q and att, B·Sq·H each; k and v, B·Skv·Hkv each
// (kept in Activations when the caller asks for them, with lse and copies of the inputs).
// Per backward call: datt and dq, B·Sq·H each; dk and dv, B·Skv·Hkv each. Attention itself
// allocates only what the chosen impl needs (score_buffer_bytes). The layer keeps no per-call
// state, so forward and backward are const.

#include "flashattn/mha.hpp"

#include <cblas.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <memory>
#include <new>
#include <random>
#include <sstream>
#include <utility>
#include <vector>

#include "api/fail.hpp"
#include "flashattn/backward.hpp"
#include "flashattn/error.hpp"
#include "util/blas_lock.hpp"

namespace flashattn {
namespace {

using detail::fail;

// Rows of a [batch·seqlen, H] matrix, or an Error when they overflow the int that CBLAS takes.
std::int64_t matrix_rows(const char* caller, const char* name, std::int64_t batch,
                         std::int64_t seqlen) {
  std::int64_t rows = 0;
  if (__builtin_mul_overflow(batch, seqlen, &rows) || rows > INT32_MAX) {
    fail(caller, name, ": expected batch * seqlen <= ", INT32_MAX, " (a CBLAS int), got ", batch,
         " * ", seqlen);
  }
  return rows;
}

// Whether [a, a + a_count) and [b, b + b_count) share an element. Compared as integers: `<` on
// pointers into different arrays is unspecified.
bool overlaps(const float* a, std::int64_t a_count, const float* b, std::int64_t b_count) {
  const auto a_begin = reinterpret_cast<std::uintptr_t>(a);
  const auto b_begin = reinterpret_cast<std::uintptr_t>(b);
  const auto a_end = a_begin + static_cast<std::uintptr_t>(a_count) * sizeof(float);
  const auto b_end = b_begin + static_cast<std::uintptr_t>(b_count) * sizeof(float);
  return a_count > 0 && b_count > 0 && a_begin < b_end && b_begin < a_end;
}

// out[rows, n] = in[rows, k] · weight[k, n] + bias[n] (bias may be empty), all row-major.
// The bias is broadcast into `out` first so that one sgemm with beta = 1 adds the product.
void project(float* out, const float* in, std::int64_t rows, std::int64_t k,
             const std::vector<float>& weight, const std::vector<float>& bias, std::int64_t n) {
  if (rows == 0) return;
  float beta = 0.0f;
  if (!bias.empty()) {
    for (std::int64_t r = 0; r < rows; ++r) {
      std::copy(bias.begin(), bias.end(), out + r * n);
    }
    beta = 1.0f;
  }
  const std::lock_guard blas_lock(detail::blas_mutex());
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rows),
              static_cast<int>(n), static_cast<int>(k), 1.0f, in, static_cast<int>(k),
              weight.data(), static_cast<int>(n), beta, out, static_cast<int>(n));
}

// c[m, n] = op(a)[m, k] · op(b)[k, n] + beta · c, all row-major, op = transpose where asked.
// An empty inner dimension gives beta · c, which BLAS implementations need not write.
void gemm(bool transpose_a, bool transpose_b, std::int64_t m, std::int64_t n, std::int64_t k,
          const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
          std::int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (beta == 0.0f) {
      for (std::int64_t r = 0; r < m; ++r) std::fill_n(c + r * ldc, n, 0.0f);
    }
    return;
  }
  const std::lock_guard blas_lock(detail::blas_mutex());
  cblas_sgemm(CblasRowMajor, transpose_a ? CblasTrans : CblasNoTrans,
              transpose_b ? CblasTrans : CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
              static_cast<int>(k), 1.0f, a, static_cast<int>(lda), b, static_cast<int>(ldb), beta,
              c, static_cast<int>(ldc));
}

// The gradients of out[rows, n] = in[rows, k] · weight[k, n] + bias[n] given d_out:
// d_weight = inᵀ · d_out and, when the layer has biases, d_bias = the column sums of d_out.
void project_backward(std::vector<float>& d_weight, std::vector<float>& d_bias, const float* in,
                      const float* d_out, std::int64_t rows, std::int64_t k, std::int64_t n) {
  gemm(true, false, k, n, rows, in, k, d_out, n, 0.0f, d_weight.data(), n);
  if (d_bias.empty()) return;
  std::fill(d_bias.begin(), d_bias.end(), 0.0f);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < n; ++c) d_bias[c] += d_out[r * n + c];
  }
}

// Runs allocate(), which sizes the layer's own buffers (`floats` floats in all): a failed
// allocation raises Error, as the attention calls' scratch does (README, Robustness), not
// std::bad_alloc.
template <class Allocate>
void allocate_or_fail(const char* caller, const char* what, std::int64_t floats,
                      Allocate&& allocate) {
  try {
    allocate();
  } catch (const std::bad_alloc&) {
    fail(caller, "out of memory: could not allocate ", what, " (", floats * 4, " bytes)");
  }
}

// A buffer the next step overwrites entirely, so it is left uninitialized.
std::unique_ptr<float[]> scratch(std::int64_t count) {
  return std::make_unique_for_overwrite<float[]>(static_cast<std::size_t>(count));
}

}  // namespace

MultiHeadAttention::MultiHeadAttention(const MultiHeadAttentionConfig& config) : config_(config) {
  constexpr const char* caller = "MultiHeadAttention";
  if (config.hidden <= 0) fail(caller, "hidden: expected > 0, got ", config.hidden);
  if (config.num_heads <= 0) fail(caller, "num_heads: expected > 0, got ", config.num_heads);
  if (config.hidden % config.num_heads != 0) {
    fail(caller, "num_heads: expected a divisor of hidden = ", config.hidden, ", got ",
         config.num_heads);
  }
  if (config.num_kv_heads < 0) {
    fail(caller, "num_kv_heads: expected >= 0 (0 = num_heads), got ", config.num_kv_heads);
  }
  if (config.num_kv_heads > 0 && config.num_heads % config.num_kv_heads != 0) {
    fail(caller, "num_kv_heads: expected a divisor of num_heads = ", config.num_heads, ", got ",
         config.num_kv_heads);
  }

  // Every dimension reaches CBLAS as an int.
  if (config.hidden > INT32_MAX) {
    fail(caller, "hidden: expected <= ", INT32_MAX, " (a CBLAS int), got ", config.hidden);
  }

  const std::int64_t hidden = config.hidden;
  const auto square = static_cast<std::size_t>(hidden * hidden);
  const auto kv = static_cast<std::size_t>(hidden * kv_width());
  const std::int64_t biases = config.bias ? 2 * (hidden + kv_width()) : 0;
  allocate_or_fail(caller, "the weights", static_cast<std::int64_t>(2 * (square + kv)) + biases,
                   [&] {
                     w_q_.resize(square);
                     w_k_.resize(kv);
                     w_v_.resize(kv);
                     w_o_.resize(square);
                     if (config.bias) {
                       b_q_.resize(static_cast<std::size_t>(hidden));
                       b_k_.resize(static_cast<std::size_t>(kv_width()));
                       b_v_.resize(static_cast<std::size_t>(kv_width()));
                       b_o_.resize(static_cast<std::size_t>(hidden));
                     }
                   });
}

void MultiHeadAttention::init_random(std::uint64_t seed) {
  // mt19937_64 is specified bit for bit by the standard, and the conversion to float below is
  // ours (std::uniform_real_distribution differs between standard libraries), so a seed gives
  // the same weights everywhere.
  std::mt19937_64 engine(seed);
  const float bound = 1.0f / std::sqrt(static_cast<float>(config_.hidden));
  const auto uniform = [&] {
    const float unit = static_cast<float>(engine() >> 40) * 0x1.0p-24f;  // [0, 1), 24 bits
    return bound * (2.0f * unit - 1.0f);
  };
  for (std::vector<float>* weight : {&w_q_, &w_k_, &w_v_, &w_o_}) {
    for (float& w : *weight) w = uniform();
  }
  for (std::vector<float>* bias : {&b_q_, &b_k_, &b_v_, &b_o_}) {
    std::fill(bias->begin(), bias->end(), 0.0f);
  }
}

void MultiHeadAttention::forward(const float* x, std::int64_t batch, std::int64_t seqlen, float* y,
                                 const AttentionOptions& options, AttentionImpl impl) const {
  if (seqlen < 0) fail("MultiHeadAttention::forward", "seqlen: expected >= 0, got ", seqlen);
  forward_into(x, batch, seqlen, x, seqlen, false, y, nullptr, options, impl);
}

void MultiHeadAttention::forward(const float* x, std::int64_t batch, std::int64_t seqlen_q,
                                 const float* context, std::int64_t seqlen_kv, float* y,
                                 const AttentionOptions& options, AttentionImpl impl) const {
  forward_into(x, batch, seqlen_q, context, seqlen_kv, true, y, nullptr, options, impl);
}

void MultiHeadAttention::forward(const float* x, std::int64_t batch, std::int64_t seqlen, float* y,
                                 Activations& saved, const AttentionOptions& options,
                                 AttentionImpl impl) const {
  if (seqlen < 0) fail("MultiHeadAttention::forward", "seqlen: expected >= 0, got ", seqlen);
  forward_into(x, batch, seqlen, x, seqlen, false, y, &saved, options, impl);
}

void MultiHeadAttention::forward(const float* x, std::int64_t batch, std::int64_t seqlen_q,
                                 const float* context, std::int64_t seqlen_kv, float* y,
                                 Activations& saved, const AttentionOptions& options,
                                 AttentionImpl impl) const {
  forward_into(x, batch, seqlen_q, context, seqlen_kv, true, y, &saved, options, impl);
}

void MultiHeadAttention::forward_into(const float* x, std::int64_t batch, std::int64_t seqlen_q,
                                      const float* context, std::int64_t seqlen_kv, bool cross,
                                      float* y, Activations* saved, const AttentionOptions& options,
                                      AttentionImpl impl) const {
  constexpr const char* caller = "MultiHeadAttention::forward";
  if (batch < 0) fail(caller, "batch: expected >= 0, got ", batch);
  if (seqlen_q < 0) fail(caller, "seqlen_q: expected >= 0, got ", seqlen_q);
  if (seqlen_kv < 0) fail(caller, "seqlen_kv: expected >= 0, got ", seqlen_kv);

  const std::int64_t hidden = config_.hidden;
  const std::int64_t rows_q = matrix_rows(caller, "x", batch, seqlen_q);
  const std::int64_t rows_kv = matrix_rows(caller, "context", batch, seqlen_kv);
  const std::int64_t q_count = rows_q * hidden;  // < 2^62: both factors are CBLAS ints
  const std::int64_t context_count = rows_kv * hidden;
  const std::int64_t kv_count = rows_kv * kv_width();

  if (q_count > 0 && x == nullptr) fail(caller, "x: expected a data pointer, got null");
  if (q_count > 0 && y == nullptr) fail(caller, "y: expected a data pointer, got null");
  if (context_count > 0 && context == nullptr) {
    fail(caller, "context: expected a data pointer, got null");
  }
  if (overlaps(y, q_count, x, q_count)) {
    fail(caller, "y: expected memory disjoint from x, got overlapping buffers");
  }
  if (overlaps(y, q_count, context, context_count)) {
    fail(caller, "y: expected memory disjoint from context, got overlapping buffers");
  }
  if (q_count == 0 && saved == nullptr) return;

  const std::int64_t heads = config_.num_heads, heads_kv = num_kv_heads(), dim = head_dim();
  // Without `saved` the intermediates live for this call only; with it they are built in a fresh
  // Activations that replaces *saved once everything succeeded.
  Activations kept;
  std::unique_ptr<float[]> q_scratch, k_scratch, v_scratch, att_scratch;
  float *q = nullptr, *k = nullptr, *v = nullptr, *att = nullptr, *lse = nullptr;
  if (saved != nullptr) {
    kept.hidden = hidden;
    kept.num_heads = heads;
    kept.num_kv_heads = heads_kv;
    kept.batch = batch;
    kept.seqlen_q = seqlen_q;
    kept.seqlen_kv = seqlen_kv;
    kept.cross = cross;
    kept.options = options;
    const std::int64_t floats =
        3 * q_count + (cross ? context_count : 0) + 2 * kv_count + batch * heads * seqlen_q;
    allocate_or_fail(caller, "the activations", floats, [&] {
      if (q_count > 0) kept.x.assign(x, x + q_count);
      if (cross && context_count > 0) kept.context.assign(context, context + context_count);
      kept.q.resize(static_cast<std::size_t>(q_count));
      kept.k.resize(static_cast<std::size_t>(kv_count));
      kept.v.resize(static_cast<std::size_t>(kv_count));
      kept.att.resize(static_cast<std::size_t>(q_count));
      kept.lse.resize(static_cast<std::size_t>(batch * heads * seqlen_q));
    });
    q = kept.q.data();
    k = kept.k.data();
    v = kept.v.data();
    att = kept.att.data();
    lse = kept.lse.data();
  } else {
    allocate_or_fail(caller, "the projections", 2 * q_count + 2 * kv_count, [&] {
      q_scratch = scratch(q_count);
      k_scratch = scratch(kv_count);
      v_scratch = scratch(kv_count);
      att_scratch = scratch(q_count);
    });
    q = q_scratch.get();
    k = k_scratch.get();
    v = v_scratch.get();
    att = att_scratch.get();
  }
  project(q, x, rows_q, hidden, w_q_, b_q_, hidden);
  project(k, context, rows_kv, hidden, w_k_, b_k_, kv_width());
  project(v, context, rows_kv, hidden, w_v_, b_v_, kv_width());

  if (q_count > 0) {
    // Split heads: the projections above, read as [B, S, heads, Dh] with strides {S·H, H, Dh, 1}.
    const ConstTensorView q_heads = contiguous_view(q, {batch, seqlen_q, heads, dim});
    const ConstTensorView k_heads = contiguous_view(k, {batch, seqlen_kv, heads_kv, dim});
    const ConstTensorView v_heads = contiguous_view(v, {batch, seqlen_kv, heads_kv, dim});
    const TensorView att_heads = contiguous_view(att, {batch, seqlen_q, heads, dim});
    attention_forward(impl, q_heads, k_heads, v_heads, att_heads, lse, options);

    // Merge heads: att [B, Sq, heads, Dh] is the row-major [B·Sq, H] matrix.
    project(y, att, rows_q, hidden, w_o_, b_o_, hidden);
  }
  if (saved != nullptr) *saved = std::move(kept);
}

MultiHeadAttention::Gradients MultiHeadAttention::backward(const float* dy,
                                                           const Activations& saved,
                                                           AttentionImpl impl) const {
  Gradients grads;
  backward(dy, saved, grads, impl);
  return grads;
}

void MultiHeadAttention::backward(const float* dy, const Activations& saved, Gradients& grads,
                                  AttentionImpl impl) const {
  constexpr const char* caller = "MultiHeadAttention::backward";
  const std::int64_t hidden = config_.hidden, heads = config_.num_heads, heads_kv = num_kv_heads(),
                     dim = head_dim(), width = kv_width();
  if (saved.hidden != hidden || saved.num_heads != heads || saved.num_kv_heads != heads_kv) {
    fail(caller, "saved: expected activations of a layer with hidden ", hidden, ", num_heads ",
         heads, ", num_kv_heads ", heads_kv, " (filled by forward), got hidden ", saved.hidden,
         ", num_heads ", saved.num_heads, ", num_kv_heads ", saved.num_kv_heads);
  }
  const std::int64_t batch = saved.batch, seqlen_q = saved.seqlen_q, seqlen_kv = saved.seqlen_kv;
  const std::int64_t rows_q = batch * seqlen_q, rows_kv = batch * seqlen_kv;
  const auto expect_size = [&](const char* name, const std::vector<float>& values,
                               std::int64_t count) {
    if (static_cast<std::int64_t>(values.size()) != count) {
      fail(caller, "saved.", name, ": expected ", count, " elements for batch ", batch,
           ", seqlen_q ", seqlen_q, ", seqlen_kv ", seqlen_kv, ", got ", values.size());
    }
  };
  expect_size("x", saved.x, rows_q * hidden);
  expect_size("context", saved.context, saved.cross ? rows_kv * hidden : 0);
  expect_size("q", saved.q, rows_q * hidden);
  expect_size("k", saved.k, rows_kv * width);
  expect_size("v", saved.v, rows_kv * width);
  expect_size("att", saved.att, rows_q * hidden);
  expect_size("lse", saved.lse, batch * heads * seqlen_q);
  if (rows_q > 0 && dy == nullptr) fail(caller, "dy: expected a data pointer, got null");

  const auto size = [](std::int64_t count) { return static_cast<std::size_t>(count); };
  // The gradients, and dAtt, dQ, dK, dV between the projections and the attention.
  std::unique_ptr<float[]> datt, dq, dk, dv;
  const std::int64_t weights =
      static_cast<std::int64_t>(w_q_.size() + w_k_.size() + w_v_.size() + w_o_.size() +
                                b_q_.size() + b_k_.size() + b_v_.size() + b_o_.size());
  const std::int64_t floats =
      3 * rows_q * hidden + (saved.cross ? rows_kv * hidden : 0) + 2 * rows_kv * width + weights;
  allocate_or_fail(caller, "the gradients", floats, [&] {
    grads.dx.resize(size(rows_q * hidden));
    grads.dcontext.resize(size(saved.cross ? rows_kv * hidden : 0));
    grads.dw_q.resize(w_q_.size());
    grads.dw_k.resize(w_k_.size());
    grads.dw_v.resize(w_v_.size());
    grads.dw_o.resize(w_o_.size());
    grads.db_q.resize(b_q_.size());
    grads.db_k.resize(b_k_.size());
    grads.db_v.resize(b_v_.size());
    grads.db_o.resize(b_o_.size());
    if (rows_q == 0) return;
    datt = scratch(rows_q * hidden);
    dq = scratch(rows_q * hidden);
    dk = scratch(rows_kv * width);
    dv = scratch(rows_kv * width);
  });
  if (rows_q == 0) {
    // No query: y does not depend on anything.
    for (std::vector<float>* gradient :
         {&grads.dcontext, &grads.dw_q, &grads.dw_k, &grads.dw_v, &grads.dw_o, &grads.db_q,
          &grads.db_k, &grads.db_v, &grads.db_o}) {
      std::fill(gradient->begin(), gradient->end(), 0.0f);
    }
    return;
  }

  // Output projection; datt is the merged [B·Sq, H] matrix that the head views below split.
  project_backward(grads.dw_o, grads.db_o, saved.att.data(), dy, rows_q, hidden, hidden);
  gemm(false, true, rows_q, hidden, hidden, dy, hidden, w_o_.data(), hidden, 0.0f, datt.get(),
       hidden);

  const std::array<std::int64_t, 4> q_shape{batch, seqlen_q, heads, dim};
  const std::array<std::int64_t, 4> kv_shape{batch, seqlen_kv, heads_kv, dim};
  if (rows_kv == 0) {
    // Without keys the attention output is the constant 0: nothing flows back into q.
    std::fill_n(dq.get(), rows_q * hidden, 0.0f);
  } else {
    attention_backward(
        impl, contiguous_view(datt.get(), q_shape), contiguous_view(saved.q.data(), q_shape),
        contiguous_view(saved.k.data(), kv_shape), contiguous_view(saved.v.data(), kv_shape),
        contiguous_view(saved.att.data(), q_shape), saved.lse.data(),
        contiguous_view(dq.get(), q_shape), contiguous_view(dk.get(), kv_shape),
        contiguous_view(dv.get(), kv_shape), saved.options);
  }

  // Input projections. Self-attention reads x three times, so its K and V paths add into dx.
  const float* context = saved.cross ? saved.context.data() : saved.x.data();
  project_backward(grads.dw_q, grads.db_q, saved.x.data(), dq.get(), rows_q, hidden, hidden);
  project_backward(grads.dw_k, grads.db_k, context, dk.get(), rows_kv, hidden, width);
  project_backward(grads.dw_v, grads.db_v, context, dv.get(), rows_kv, hidden, width);
  gemm(false, true, rows_q, hidden, hidden, dq.get(), hidden, w_q_.data(), hidden, 0.0f,
       grads.dx.data(), hidden);
  float* dcontext = saved.cross ? grads.dcontext.data() : grads.dx.data();
  const float beta = saved.cross ? 0.0f : 1.0f;
  gemm(false, true, rows_kv, hidden, width, dk.get(), width, w_k_.data(), width, beta, dcontext,
       hidden);
  gemm(false, true, rows_kv, hidden, width, dv.get(), width, w_v_.data(), width, 1.0f, dcontext,
       hidden);
}

}  // namespace flashattn
