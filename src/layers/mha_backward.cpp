// The backward of the multi-head attention layer (mha.cpp has the forward's data flow).
//
// The backward runs the same chain in reverse, each projection out = in·W + b giving
// dW = inᵀ·dout, db = column sums of dout and din = dout·Wᵀ:
//
//   dy  --> dW_O = attᵀ·dy, db_O, datt = dy·W_Oᵀ                  (att, datt [B·Sq, Nh·Dv])
//   attention_backward(impl, datt, q, k, v, att, lse) --> dq, dk, dv   (same head views)
//   dq  --> dW_Q = xᵀ·dq, db_Q, dx = dq·W_Qᵀ
//   dk  --> dW_K = contextᵀ·dk, db_K, dcontext += dk·W_Kᵀ      (self-attention: into dx)
//   dv  --> dW_V = contextᵀ·dv, db_V, dcontext += dv·W_Vᵀ

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "api/fail.hpp"
#include "flashattn/backward.hpp"
#include "flashattn/mha.hpp"
#include "layers/projections.hpp"

namespace flashattn {

using detail::allocate_or_fail;
using detail::fail;
using detail::gemm;
using detail::project_backward;
using detail::scratch;

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
  detail::out_of_memory_as_error(caller, [&] {
    const std::int64_t hidden = config_.hidden, heads = config_.num_heads,
                       heads_kv = num_kv_heads(), dim = head_dim(), width = kv_width();
    const std::int64_t dim_v = value_head_dim(), v_cols = v_width(), att_cols = attention_width();
    if (saved.hidden != hidden || saved.num_heads != heads || saved.num_kv_heads != heads_kv ||
        saved.value_head_dim != dim_v) {
      fail(caller, "saved: expected activations of a layer with hidden ", hidden, ", num_heads ",
           heads, ", num_kv_heads ", heads_kv, ", value_head_dim ", dim_v,
           " (filled by forward), got hidden ", saved.hidden, ", num_heads ", saved.num_heads,
           ", num_kv_heads ", saved.num_kv_heads, ", value_head_dim ", saved.value_head_dim);
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
    expect_size("v", saved.v, rows_kv * v_cols);
    expect_size("att", saved.att, rows_q * att_cols);
    expect_size("lse", saved.lse, batch * heads * seqlen_q);
    if (rows_q > 0 && dy == nullptr) fail(caller, "dy: expected a data pointer, got null");

    const auto size = [](std::int64_t count) { return static_cast<std::size_t>(count); };
    // The gradients, and dAtt, dQ, dK, dV between the projections and the attention.
    std::unique_ptr<float[]> datt, dq, dk, dv;
    const std::int64_t weights =
        static_cast<std::int64_t>(w_q_.size() + w_k_.size() + w_v_.size() + w_o_.size() +
                                  b_q_.size() + b_k_.size() + b_v_.size() + b_o_.size());
    const std::int64_t floats = 2 * rows_q * hidden + rows_q * att_cols +
                                (saved.cross ? rows_kv * hidden : 0) + rows_kv * (width + v_cols) +
                                weights;
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
      datt = scratch(rows_q * att_cols);
      dq = scratch(rows_q * hidden);
      dk = scratch(rows_kv * width);
      dv = scratch(rows_kv * v_cols);
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

    // Output projection; datt is the merged [B·Sq, Nh·Dv] matrix that the head views below split.
    project_backward(grads.dw_o, grads.db_o, saved.att.data(), dy, rows_q, att_cols, hidden);
    gemm(false, true, rows_q, att_cols, hidden, dy, hidden, w_o_.data(), hidden, 0.0f, datt.get(),
         att_cols);

    const std::array<std::int64_t, 4> q_shape{batch, seqlen_q, heads, dim};
    const std::array<std::int64_t, 4> kv_shape{batch, seqlen_kv, heads_kv, dim};
    const std::array<std::int64_t, 4> v_shape{batch, seqlen_kv, heads_kv, dim_v};
    const std::array<std::int64_t, 4> att_shape{batch, seqlen_q, heads, dim_v};
    if (rows_kv == 0) {
      // Without keys the attention output is the constant 0: nothing flows back into q.
      std::fill_n(dq.get(), rows_q * hidden, 0.0f);
    } else {
      attention_backward(
          impl, contiguous_view(datt.get(), att_shape), contiguous_view(saved.q.data(), q_shape),
          contiguous_view(saved.k.data(), kv_shape), contiguous_view(saved.v.data(), v_shape),
          contiguous_view(saved.att.data(), att_shape), saved.lse.data(),
          contiguous_view(dq.get(), q_shape), contiguous_view(dk.get(), kv_shape),
          contiguous_view(dv.get(), v_shape), saved.options);
    }

    // Input projections. Self-attention reads x three times, so its K and V paths add into dx.
    const float* context = saved.cross ? saved.context.data() : saved.x.data();
    project_backward(grads.dw_q, grads.db_q, saved.x.data(), dq.get(), rows_q, hidden, hidden);
    project_backward(grads.dw_k, grads.db_k, context, dk.get(), rows_kv, hidden, width);
    project_backward(grads.dw_v, grads.db_v, context, dv.get(), rows_kv, hidden, v_cols);
    gemm(false, true, rows_q, hidden, hidden, dq.get(), hidden, w_q_.data(), hidden, 0.0f,
         grads.dx.data(), hidden);
    float* dcontext = saved.cross ? grads.dcontext.data() : grads.dx.data();
    const float beta = saved.cross ? 0.0f : 1.0f;
    gemm(false, true, rows_kv, hidden, width, dk.get(), width, w_k_.data(), width, beta, dcontext,
         hidden);
    gemm(false, true, rows_kv, hidden, v_cols, dv.get(), v_cols, w_v_.data(), v_cols, 1.0f,
         dcontext, hidden);
  });
}

}  // namespace flashattn
