#pragma once

// Attention over a packed batch of sequences of different lengths (as FlashAttention's
// flash_attn_varlen_func): the rows of every sequence one after the other, no padding. Sequence
// b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] − 1 of q, its keys rows
// cu_seqlens_k[b] .. cu_seqlens_k[b + 1] − 1 of k and v; it attends to its own keys only, with
// the causal mask and window aligned to its own bottom-right corner (as attention_forward on that
// sequence alone). A sequence without queries computes nothing; one without keys gives its rows
// output 0 and lse −inf.

#include <cstdint>

#include "flashattn/attention.hpp"
#include "flashattn/backward.hpp"
#include "flashattn/options.hpp"
#include "flashattn/tensor.hpp"

namespace flashattn {

// The packed layout, as 4-d views whose first dim is 1:
//   q, out       [1, total_q, heads_q, head_dim]
//   k, v         [1, total_k, heads_kv, head_dim]   heads_q % heads_kv == 0
//   lse          fp32 contiguous [heads_q, total_q] (FlashAttention's varlen layout), or null
//   cu_seqlens_q int32 [batch + 1]: 0, then the running totals of the query lengths, ending at
//                total_q; cu_seqlens_k likewise for the keys, ending at total_k
// Any element strides with the last dim contiguous; dtypes and options as attention_forward,
// except that per-entry ALiBi slopes are [batch, heads_q] for the batch's sequences.
// Each sequence runs on all the threads in turn, so a batch of very different lengths keeps
// every thread busy; results are those of the sequence alone, bit for bit.
// Invalid arguments raise flashattn::Error before anything is written.
void varlen_attention_forward(AttentionImpl impl, const ConstTensorView& q,
                              const ConstTensorView& k, const ConstTensorView& v,
                              const std::int32_t* cu_seqlens_q, const std::int32_t* cu_seqlens_k,
                              std::int64_t batch, const TensorView& out, float* lse,
                              const AttentionOptions& options = {});

// Gradients of the same (flashattn/backward.hpp), in the packed layout: dout, out, dq like q;
// dk, dv like k, v; lse [heads_q, total_q] as the forward wrote it, required.
void varlen_attention_backward(AttentionImpl impl, const ConstTensorView& dout,
                               const ConstTensorView& q, const ConstTensorView& k,
                               const ConstTensorView& v, const ConstTensorView& out,
                               const float* lse, const std::int32_t* cu_seqlens_q,
                               const std::int32_t* cu_seqlens_k, std::int64_t batch,
                               const TensorView& dq, const TensorView& dk, const TensorView& dv,
                               const AttentionOptions& options = {},
                               const ModifierGradients& modifier_gradients = {});

}  // namespace flashattn
