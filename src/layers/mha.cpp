// The multi-head attention layer of seed 000, for fp32 activations [batch, seqlen, H].
//
// Data flow of one forward call (self-attention: context = x, seqlen_kv = seqlen_q):
//
//   x       [B·Sq,  H] --sgemm W_Q [H, H]   (+b_Q)--> q   [B·Sq,  H]    = [B, Sq,  Nh,  Dh]
//   context [B·Skv, H] --sgemm W_K [H, Hkv] (+b_K)--> k   [B·Skv, Hkv]  = [B, Skv, Nkv, Dh]
//   context [B·Skv, H] --sgemm W_V [H, Hv]  (+b_V)--> v   [B·Skv, Hv]   = [B, Skv, Nkv, Dv]
//   attention_forward(impl, q, k, v)             --> att [B·Sq,  Ha]   = [B, Sq,  Nh,  Dv]
//   att     [B·Sq, Ha] --sgemm W_O [Ha, H]  (+b_O)--> y   [B·Sq,  H]
//
// with Hkv = Nkv·Dh, Hv = Nkv·Dv, Ha = Nh·Dv (Dv = Dh unless value_head_dim says otherwise).
// Splitting heads costs nothing: a row-major [B·S, Nh·Dh] matrix is the [B, S, Nh, Dh] tensor with
// strides {S·H, H, Dh, 1}, which attention_forward reads directly (the seed's [B, Nh, S, Dh] is the
// same memory through strides {S·H, Dh, H, 1}). Likewise the attention output, written as [B, Sq,
// Nh, Dh], already is the merged [B·Sq, H] matrix that the output projection multiplies.
//
// Buffers allocated per forward call (fp32): q, B·Sq·H; att, B·Sq·Ha; k, B·Skv·Hkv; v, B·Skv·Hv
// (kept in Activations when the caller asks for them, with lse and copies of the inputs).
// Per backward call: dq, B·Sq·H; datt, B·Sq·Ha; dk, B·Skv·Hkv; dv, B·Skv·Hv. Attention itself
// allocates only what the chosen impl needs (score_buffer_bytes). The layer keeps no per-call
// state, so forward and backward are const.

#include "flashattn/mha.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "api/fail.hpp"
#include "layers/projections.hpp"

namespace flashattn {

using detail::allocate_or_fail;
using detail::fail;
using detail::matrix_rows;
using detail::overlaps;
using detail::project;
using detail::scratch;

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
  if (config.value_head_dim < 0) {
    fail(caller, "value_head_dim: expected >= 0 (0 = head_dim), got ", config.value_head_dim);
  }

  // Every dimension reaches CBLAS as an int.
  if (config.hidden > INT32_MAX) {
    fail(caller, "hidden: expected <= ", INT32_MAX, " (a CBLAS int), got ", config.hidden);
  }
  if (config.value_head_dim > INT32_MAX / config.num_heads) {
    fail(caller, "value_head_dim: expected num_heads x value_head_dim <= ", INT32_MAX,
         " (a CBLAS int), got ", config.value_head_dim);
  }

  const std::int64_t hidden = config.hidden;
  const auto q_weights = static_cast<std::size_t>(hidden * hidden);
  const auto k_weights = static_cast<std::size_t>(hidden * kv_width());
  const auto v_weights = static_cast<std::size_t>(hidden * v_width());
  const auto o_weights = static_cast<std::size_t>(attention_width() * hidden);
  const std::int64_t biases = config.bias ? 2 * hidden + kv_width() + v_width() : 0;
  allocate_or_fail(
      caller, "the weights",
      static_cast<std::int64_t>(q_weights + k_weights + v_weights + o_weights) + biases, [&] {
        w_q_.resize(q_weights);
        w_k_.resize(k_weights);
        w_v_.resize(v_weights);
        w_o_.resize(o_weights);
        if (config.bias) {
          b_q_.resize(static_cast<std::size_t>(hidden));
          b_k_.resize(static_cast<std::size_t>(kv_width()));
          b_v_.resize(static_cast<std::size_t>(v_width()));
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
  detail::out_of_memory_as_error(caller, [&] {
    if (batch < 0) fail(caller, "batch: expected >= 0, got ", batch);
    if (seqlen_q < 0) fail(caller, "seqlen_q: expected >= 0, got ", seqlen_q);
    if (seqlen_kv < 0) fail(caller, "seqlen_kv: expected >= 0, got ", seqlen_kv);

    const std::int64_t hidden = config_.hidden;
    const std::int64_t rows_q = matrix_rows(caller, "x", batch, seqlen_q);
    const std::int64_t rows_kv = matrix_rows(caller, "context", batch, seqlen_kv);
    const std::int64_t q_count = rows_q * hidden;  // < 2^62: both factors are CBLAS ints
    const std::int64_t context_count = rows_kv * hidden;
    const std::int64_t kv_count = rows_kv * kv_width();
    const std::int64_t v_count = rows_kv * v_width();
    const std::int64_t att_count = rows_q * attention_width();

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
    const std::int64_t dim_v = value_head_dim();
    // Without `saved` the intermediates live for this call only; with it they are built in a fresh
    // Activations that replaces *saved once everything succeeded.
    Activations kept;
    std::unique_ptr<float[]> q_scratch, k_scratch, v_scratch, att_scratch;
    float *q = nullptr, *k = nullptr, *v = nullptr, *att = nullptr, *lse = nullptr;
    if (saved != nullptr) {
      kept.hidden = hidden;
      kept.num_heads = heads;
      kept.num_kv_heads = heads_kv;
      kept.value_head_dim = dim_v;
      kept.batch = batch;
      kept.seqlen_q = seqlen_q;
      kept.seqlen_kv = seqlen_kv;
      kept.cross = cross;
      kept.options = options;
      const std::int64_t floats = 2 * q_count + att_count + (cross ? context_count : 0) + kv_count +
                                  v_count + batch * heads * seqlen_q;
      allocate_or_fail(caller, "the activations", floats, [&] {
        if (q_count > 0) kept.x.assign(x, x + q_count);
        if (cross && context_count > 0) kept.context.assign(context, context + context_count);
        kept.q.resize(static_cast<std::size_t>(q_count));
        kept.k.resize(static_cast<std::size_t>(kv_count));
        kept.v.resize(static_cast<std::size_t>(v_count));
        kept.att.resize(static_cast<std::size_t>(att_count));
        kept.lse.resize(static_cast<std::size_t>(batch * heads * seqlen_q));
      });
      q = kept.q.data();
      k = kept.k.data();
      v = kept.v.data();
      att = kept.att.data();
      lse = kept.lse.data();
    } else {
      allocate_or_fail(caller, "the projections", q_count + att_count + kv_count + v_count, [&] {
        q_scratch = scratch(q_count);
        k_scratch = scratch(kv_count);
        v_scratch = scratch(v_count);
        att_scratch = scratch(att_count);
      });
      q = q_scratch.get();
      k = k_scratch.get();
      v = v_scratch.get();
      att = att_scratch.get();
    }
    project(q, x, rows_q, hidden, w_q_, b_q_, hidden);
    project(k, context, rows_kv, hidden, w_k_, b_k_, kv_width());
    project(v, context, rows_kv, hidden, w_v_, b_v_, v_width());

    if (q_count > 0) {
      // Split heads: the projections above, read as [B, S, heads, Dh] with strides {S·H, H, Dh, 1}.
      const ConstTensorView q_heads = contiguous_view(q, {batch, seqlen_q, heads, dim});
      const ConstTensorView k_heads = contiguous_view(k, {batch, seqlen_kv, heads_kv, dim});
      const ConstTensorView v_heads = contiguous_view(v, {batch, seqlen_kv, heads_kv, dim_v});
      const TensorView att_heads = contiguous_view(att, {batch, seqlen_q, heads, dim_v});
      attention_forward(impl, q_heads, k_heads, v_heads, att_heads, lse, options);

      // Merge heads: att [B, Sq, heads, Dv] is the row-major [B·Sq, Ha] matrix.
      project(y, att, rows_q, attention_width(), w_o_, b_o_, hidden);
    }
    if (saved != nullptr) *saved = std::move(kept);
  });
}

}  // namespace flashattn
