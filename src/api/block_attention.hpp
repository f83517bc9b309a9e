#pragma once

// Attention of one block of a longer sequence: the seam that context parallelism (src/dist/)
// builds on. A rank holds query rows at global positions [q_begin, q_begin + seqlen_q) and, in
// turn, key blocks at [k_begin, k_begin + seqlen_kv); the causal mask, the window and ALiBi of
// the whole sequence (seqlen_q == seqlen_kv there) put row i's diagonal at global key
// q_begin + i, that is at block key i + (q_begin − k_begin). The forward and backward here take
// that offset and otherwise behave as the public ones (attention.hpp, backward.hpp): the same
// validation, errors and results, with lse and the backward's out/lse those of the whole
// sequence where the caller merges blocks.

#include <cstdint>

#include "flashattn/attention.hpp"
#include "flashattn/backward.hpp"

namespace flashattn::detail {

// Row i of the block sees the keys j that a whole sequence's row sees when its diagonal key is
// i + query_minus_key_offset (q_begin − k_begin above). Bias, mask and sinks are refused: they
// are indexed by the whole sequence's rows or belong to it once, not per block.
void block_attention_forward(AttentionImpl impl, const ConstTensorView& q, const ConstTensorView& k,
                             const ConstTensorView& v, const TensorView& out, float* lse,
                             const AttentionOptions& options, std::int64_t query_minus_key_offset);

// The block's share of the gradients: dq for its rows from these keys, dk and dv for these keys
// from its rows, given out and lse of the whole sequence (P = exp(s − lse) is then the whole
// softmax's, restricted to the block). The flash and standard paths; the reference, which
// recomputes the block's own softmax, is refused.
void block_attention_backward(AttentionImpl impl, const ConstTensorView& dout,
                              const ConstTensorView& q, const ConstTensorView& k,
                              const ConstTensorView& v, const ConstTensorView& out,
                              const float* lse, const TensorView& dq, const TensorView& dk,
                              const TensorView& dv, const AttentionOptions& options,
                              std::int64_t query_minus_key_offset);

}  // namespace flashattn::detail
