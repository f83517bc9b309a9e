#pragma once

// Attention over a packed batch of sequences of different lengths (as FlashAttention's
// flash_attn_varlen_func): the rows of every sequence one after the other, no padding. Sequence
// b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] − 1 of q, its keys rows
// cu_seqlens_k[b] .. cu_seqlens_k[b + 1] − 1 of k and v; it attends to its own keys only, with
// the causal mask and window aligned to its own bottom-right corner (as attention_forward on that
// sequence alone). A sequence without queries computes nothing; one without keys gives its rows
// output 0 and lse −inf. The forward also takes K and V from a paged cache (PagedKVView below).

#include <cstdint>

#include "flashattn/attention.hpp"
#include "flashattn/backward.hpp"
#include "flashattn/options.hpp"
#include "flashattn/tensor.hpp"

namespace flashattn {

// The packed layout, as 4-d views whose first dim is 1:
//   q, out       [1, total_q, heads_q, head_dim] (out: head_dim_v)
//   k, v         [1, total_k, heads_kv, head_dim] (v: head_dim_v)   heads_q % heads_kv == 0
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

// K and V of a varlen batch in a paged cache (as flash_attn_varlen_func's block_table, and as
// KVCacheView's paged cache in flashattn/kvcache.hpp, only read here):
//   k, v          [num_pages, page_size, heads_kv, head_dim], page_size >= 1; any element
//                 strides with the last dim contiguous (a head-major pool, [num_pages, heads_kv,
//                 page_size, head_dim], passed with dims 1 and 2 swapped in shape and strides)
//   block_table   int32 [batch, pages_per_sequence] row-major: sequence b's key j is row
//                 j % page_size of page block_table[b * pages_per_sequence + j / page_size]
// Only the entries that cover a sequence's keys are read (and must lie in [0, num_pages)); the
// rest may hold anything. Pages may be shared between sequences (a common prompt prefix).
// A quantized pool (k, v int8, fp8_e4m3 or fp8_e5m2) takes its fp32 scales as KVCacheView does
// (flashattn/kvcache.hpp): k_scale, v_scale [num_pages, page_size, heads_kv, groups], 0 strides
// broadcasting; read only.
struct PagedKVView {
  ConstTensorView k, v;
  const std::int32_t* block_table = nullptr;
  std::int64_t pages_per_sequence = 0;
  ConstTensorView k_scale{}, v_scale{};  // quantized pools only
};

// The same attention with K and V in pages: q, out, lse, cu_seqlens_q, batch and options as
// above, and sequence b's keys the first L_b = cu_seqlens_k[b + 1] − cu_seqlens_k[b] rows of its
// pages (FlashAttention's meaning of cu_seqlens_k with a block table: the offsets count keys,
// they are not rows of k). cu_seqlens_k: batch + 1 int32 offsets from 0, never decreasing, each
// L_b at most pages_per_sequence · page_size; block_table non-null for any batch > 0, even one
// whose sequences hold no page yet. k, v, out in q's dtype, or k, v quantized under any q.
// The results are those of the packed forward above on the same rows, bit for bit, for any page
// size and table order: the flash path reads the pages where they lie for up to 32 query rows
// per KV head (decode), and otherwise gathers one sequence's rows at a time into a contiguous
// buffer that the dense path reads, as kvcache_attention_forward does.
// Invalid arguments raise flashattn::Error before anything is written.
void varlen_attention_forward(AttentionImpl impl, const ConstTensorView& q, const PagedKVView& kv,
                              const std::int32_t* cu_seqlens_q, const std::int32_t* cu_seqlens_k,
                              std::int64_t batch, const TensorView& out, float* lse,
                              const AttentionOptions& options = {});

// Gradients of the packed forward (flashattn/backward.hpp), in the packed layout: dout, out, dq
// like q; dk, dv like k, v; lse [heads_q, total_q] as the forward wrote it, required.
void varlen_attention_backward(AttentionImpl impl, const ConstTensorView& dout,
                               const ConstTensorView& q, const ConstTensorView& k,
                               const ConstTensorView& v, const ConstTensorView& out,
                               const float* lse, const std::int32_t* cu_seqlens_q,
                               const std::int32_t* cu_seqlens_k, std::int64_t batch,
                               const TensorView& dq, const TensorView& dk, const TensorView& dv,
                               const AttentionOptions& options = {},
                               const ModifierGradients& modifier_gradients = {});

}  // namespace flashattn
