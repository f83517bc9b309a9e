#pragma once

// Backend entry points. Each takes validated AttentionParams and writes params.out and
// params.lse (when not null).

#include "api/params.hpp"

namespace flashattn::detail {

// Plain loops, fp64 accumulation. out_f64 is contiguous [batch, seqlen_q, heads_q, head_dim],
// lse_f64 contiguous [batch, heads_q, seqlen_q] (may be null). Used by the tests as the oracle.
void reference_forward_f64(const AttentionParams& params, double* out_f64, double* lse_f64);
void reference_forward(const AttentionParams& params);

void standard_forward(const AttentionParams& params);

void flash_forward(const AttentionParams& params);

// Backward passes: write params.dq, dk, dv, and params.dsinks when not null (the reference on its
// own; the others by way of add_sink_gradients). reference_backward_f64 writes contiguous fp64
// dq [batch, seqlen_q, heads_q, head_dim], dk and dv [batch, seqlen_kv, heads_kv, head_dim], and
// dsinks [heads_q] when not null.
// dlogits_f64, when not null, receives the logits' gradient, contiguous
// [batch, heads_q, seqlen_q, seqlen_kv] (0 where masked).
void reference_backward_f64(const BackwardParams& params, double* dq_f64, double* dk_f64,
                            double* dv_f64, double* dsinks_f64 = nullptr,
                            double* dlogits_f64 = nullptr);
void reference_backward(const BackwardParams& params);
void standard_backward(const BackwardParams& params);
void flash_backward(const BackwardParams& params);

// Adds to sums[h] the sinks' gradient of every row of params (flashattn::ModifierGradients),
// − exp(σ_h − lse) · rowsum(dO ∘ O), from the forward's out and lse; params.forward has sinks.
void add_sink_gradients(const BackwardParams& params, double* sums);

// params.dbias from the logits' gradient of every (batch, query head, row, key), contiguous
// [batch, heads_q, seqlen_q, seqlen_kv] (the standard and reference paths'): summed in fp64 over
// the dims the bias broadcasts, in increasing (batch, head) order, as the flash backward sums.
void store_bias_gradient(const BackwardParams& params, const float* dlogits);
void store_bias_gradient(const BackwardParams& params, const double* dlogits);

// Row (bb, hb, i) of dbias from its fp64 sums[0, seqlen_kv), each rounded once to dbias's dtype.
void store_bias_gradient_row(const TensorView& dbias, std::int64_t bb, std::int64_t hb,
                             std::int64_t i, const double* sums);

// Merges two partial states into params.out and params.lse (cpu/merge_states.cpp).
void merge_states(const MergeParams& params);

}  // namespace flashattn::detail
