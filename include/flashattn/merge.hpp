#pragma once

// Merging attention states. Attention over a key set K = A ∪ B (A and B disjoint) can be
// computed as two partial calls, one over A and one over B, each giving (out, lse) for every
// query row, and then merged exactly:
//   m   = max(lse_a, lse_b)
//   out = (exp(lse_a − m)·out_a + exp(lse_b − m)·out_b) / (exp(lse_a − m) + exp(lse_b − m))
//   lse = m + log(exp(lse_a − m) + exp(lse_b − m))
// This is the online softmax one level up: split-KV decoding, cascade (shared-prefix) attention
// and context parallelism across processes all reduce partial results this way.

#include "flashattn/tensor.hpp"

namespace flashattn {

// Shapes, as the forward writes them (attention.hpp):
//   out_a, out_b  fp32 [batch, seqlen_q, heads, head_dim], any element strides, last dim
//                 contiguous: the partial outputs, each normalized over its own key set
//   lse_a, lse_b  fp32 contiguous [batch, heads, seqlen_q]: their log-sum-exps (natural log)
//   out           [batch, seqlen_q, heads, head_dim], f32, f16 or bf16: the merged output
//   lse           fp32 contiguous [batch, heads, seqlen_q], or null: the merged log-sum-exp
// A side whose lse is −inf saw no key and weighs 0 (its out row is 0 by the forward's contract;
// 0·x keeps a NaN or infinity there visible). Both −inf: out 0, lse −inf. A NaN lse on either
// side makes the row's out and lse NaN. out may be out_a or out_b itself, and lse may be lse_a or
// lse_b itself (in-place accumulation); any other overlap of an output with an input, or of out
// with itself, is refused. num_threads: 0 = all, at most kMaxThreads. Invalid arguments raise
// flashattn::Error before anything is written. Results do not depend on the thread count.
void merge_attention_states(const ConstTensorView& out_a, const float* lse_a,
                            const ConstTensorView& out_b, const float* lse_b, const TensorView& out,
                            float* lse, int num_threads = 0);

}  // namespace flashattn
