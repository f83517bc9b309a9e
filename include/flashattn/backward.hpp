#pragma once

#include "flashattn/attention.hpp"

namespace flashattn {

// Gradients of attention (training). Shapes as for the forward (attention.hpp):
//   dout, out        [batch, seqlen_q, heads_q, head_dim_v]  out and lse as the forward wrote them
//   lse              fp32 contiguous [batch, heads_q, seqlen_q], required
//   dq               like q;  dk, dv like k and v (GQA: a KV head's gradient sums over the query
//                    heads that read it)
// All tensors share q's dtype; gradients are accumulated in fp32 and written once (not added
// to what dq, dk, dv held). Same options as the forward. A fully masked row contributes
// nothing: its dq row is 0. Invalid arguments raise flashattn::Error before anything is written.
// Results are bitwise identical for any thread count. The gradients must not overlap the inputs
// or each other, except that dq, dk and dv of one dtype, shape and strides may interleave in one
// buffer as long as no element is shared (FlashAttention's packed dqkv [B, S, 3, H, D]).
// With options.dropout_p, the same dropout_seed and dropout_offset as the forward's.

// Gradients of the score modifiers' own inputs (options.hpp), written when a pointer is given.
struct ModifierGradients {
  // fp32 [heads_q], for options.sinks: dL/dsink_h = − Σ over batch and rows of
  // exp(sink_h − lse) · rowsum(dO ∘ O). Null: not computed.
  float* dsinks = nullptr;
  // For options.bias: dL/dbias, the logits' gradient P ∘ (dP − D_i) summed over the dims the
  // bias broadcasts; the bias's shape and dtype, any strides that give each element its own
  // address. Data null: not computed. Summed in fp64 in increasing (batch, head) order, the same
  // bits for any thread count: the flash path into sums of the bias's size as it goes, the
  // standard path from an fp32 scratch of [batch, heads_q, seqlen_q, seqlen_kv].
  TensorView dbias;
};

// FlashAttention-2 backward: P is recomputed block by block from lse; no memory proportional to
// seqlen_q · seqlen_kv.
void flash_attention_backward(const ConstTensorView& dout, const ConstTensorView& q,
                              const ConstTensorView& k, const ConstTensorView& v,
                              const ConstTensorView& out, const float* lse, const TensorView& dq,
                              const TensorView& dk, const TensorView& dv,
                              const AttentionOptions& options = {},
                              const ModifierGradients& modifier_gradients = {});

// The standard backward: per (batch, head) the full P, dP and dS matrices, products by OpenBLAS.
void standard_attention_backward(const ConstTensorView& dout, const ConstTensorView& q,
                                 const ConstTensorView& k, const ConstTensorView& v,
                                 const ConstTensorView& out, const float* lse, const TensorView& dq,
                                 const TensorView& dk, const TensorView& dv,
                                 const AttentionOptions& options = {},
                                 const ModifierGradients& modifier_gradients = {});

// The oracle: plain loops in fp64 that recompute P from q and k (out and lse are validated but
// not used), rounded once into dq, dk, dv.
void reference_attention_backward(const ConstTensorView& dout, const ConstTensorView& q,
                                  const ConstTensorView& k, const ConstTensorView& v,
                                  const ConstTensorView& out, const float* lse,
                                  const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                  const AttentionOptions& options = {},
                                  const ModifierGradients& modifier_gradients = {});

void attention_backward(AttentionImpl impl, const ConstTensorView& dout, const ConstTensorView& q,
                        const ConstTensorView& k, const ConstTensorView& v,
                        const ConstTensorView& out, const float* lse, const TensorView& dq,
                        const TensorView& dk, const TensorView& dv,
                        const AttentionOptions& options = {},
                        const ModifierGradients& modifier_gradients = {});

// The names before 0.2, kept for one release: every path is now <path>_attention_<pass>.
[[deprecated("use standard_attention_backward")]] inline void attention_backward_standard(
    const ConstTensorView& dout, const ConstTensorView& q, const ConstTensorView& k,
    const ConstTensorView& v, const ConstTensorView& out, const float* lse, const TensorView& dq,
    const TensorView& dk, const TensorView& dv, const AttentionOptions& options = {}) {
  standard_attention_backward(dout, q, k, v, out, lse, dq, dk, dv, options);
}
[[deprecated("use reference_attention_backward")]] inline void attention_backward_reference(
    const ConstTensorView& dout, const ConstTensorView& q, const ConstTensorView& k,
    const ConstTensorView& v, const ConstTensorView& out, const float* lse, const TensorView& dq,
    const TensorView& dk, const TensorView& dv, const AttentionOptions& options = {}) {
  reference_attention_backward(dout, q, k, v, out, lse, dq, dk, dv, options);
}

// FLOPs of one backward call by the usual convention: 2.5 x the forward's (five products of the
// forward's size: S, dP, dV, dQ, dK).
double attention_backward_flops(std::int64_t batch, std::int64_t heads_q, std::int64_t seqlen_q,
                                std::int64_t seqlen_kv, std::int64_t head_dim,
                                const AttentionOptions& options);

}  // namespace flashattn
