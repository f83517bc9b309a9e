#pragma once

#include <cstdint>

#include "flashattn/error.hpp"
#include "flashattn/options.hpp"
#include "flashattn/tensor.hpp"

namespace flashattn {

enum class AttentionImpl { flash, standard, reference };

const char* impl_name(AttentionImpl impl);

// Shapes (docs/design.md, "The contract"):
//   q    [batch, seqlen_q,  heads_q,  head_dim]
//   k    [batch, seqlen_kv, heads_kv, head_dim]     heads_q % heads_kv == 0 (GQA / MQA)
//   v    [batch, seqlen_kv, heads_kv, head_dim_v]   head_dim_v >= 1, any (192 against 128 for
//                                                   DeepSeek's MLA); most calls have head_dim
//   out  [batch, seqlen_q,  heads_q,  head_dim_v]   same dtype as q, k, v
//   lse  fp32, contiguous [batch, heads_q, seqlen_q]; may be null
// Any element strides with the last dim contiguous. `out` must not overlap q, k, v or lse, nor
// `lse` q, k or v.
// A row whose keys are all masked (or seqlen_kv == 0) gets output 0 and lse -inf.
// Invalid arguments raise flashattn::Error before anything is written.

// FlashAttention: block-by-block with an online softmax. Memory independent of seqlen; blocks
// that the mask removes entirely are skipped.
void flash_attention_forward(const ConstTensorView& q, const ConstTensorView& k,
                             const ConstTensorView& v, const TensorView& out, float* lse,
                             const AttentionOptions& options = {});

// The standard path: per (batch, head) the full seqlen_q x seqlen_kv score matrix by OpenBLAS
// sgemm, mask, row softmax with max subtraction, then P·V by sgemm.
void standard_attention_forward(const ConstTensorView& q, const ConstTensorView& k,
                                const ConstTensorView& v, const TensorView& out, float* lse,
                                const AttentionOptions& options = {});

// The oracle: plain loops with fp64 accumulation, rounded once into `out`.
void reference_attention_forward(const ConstTensorView& q, const ConstTensorView& k,
                                 const ConstTensorView& v, const TensorView& out, float* lse,
                                 const AttentionOptions& options = {});

// Runs the chosen path.
void attention_forward(AttentionImpl impl, const ConstTensorView& q, const ConstTensorView& k,
                       const ConstTensorView& v, const TensorView& out, float* lse,
                       const AttentionOptions& options = {});

// The names before 0.2, kept for one release: every path is now <path>_attention_<pass>.
[[deprecated("use standard_attention_forward")]] inline void attention_standard(
    const ConstTensorView& q, const ConstTensorView& k, const ConstTensorView& v,
    const TensorView& out, float* lse, const AttentionOptions& options = {}) {
  standard_attention_forward(q, k, v, out, lse, options);
}
[[deprecated("use reference_attention_forward")]] inline void attention_reference(
    const ConstTensorView& q, const ConstTensorView& k, const ConstTensorView& v,
    const TensorView& out, float* lse, const AttentionOptions& options = {}) {
  reference_attention_forward(q, k, v, out, lse, options);
}

// Bytes of score / probability tiles that one call of `impl` allocates at most, all threads
// together:
// seqlen_q * seqlen_kv floats per concurrently processed head for the standard path, one
// Br x Bc tile per thread for FlashAttention, one row of doubles per thread for the reference.
std::int64_t score_buffer_bytes(AttentionImpl impl, std::int64_t seqlen_q, std::int64_t seqlen_kv,
                                std::int64_t head_dim, const AttentionOptions& options = {});

// The dropout mask that a call with `options` (dropout_p, dropout_seed, dropout_offset) applies
// to batch entry `batch_index` (a varlen batch's sequence index) of `heads_q` query heads:
// keep[(h · seqlen_q + i) · seqlen_kv + j] = 1 where P_ij is kept (and scaled by
// 1 / (1 − dropout_p)), 0 where it is dropped, for every pair whether the mask hides it or not.
// For tests and debugging (FlashAttention's S_dmask): the attention calls never form it.
// dropout_p 0 keeps everything. Bad input raises flashattn::Error naming the argument.
void dropout_mask(const AttentionOptions& options, std::int64_t batch_index, std::int64_t heads_q,
                  std::int64_t seqlen_q, std::int64_t seqlen_kv, std::uint8_t* keep);

// Number of (query, key) pairs that the mask leaves visible, summed over all rows of one
// (batch, head), counted exactly row by row.
std::int64_t visible_pairs(std::int64_t seqlen_q, std::int64_t seqlen_kv,
                           const AttentionOptions& options);

// Floating-point operations of one forward call: 4 * batch * heads_q * head_dim * visible_pairs
// (2 for q·k and 2 for p·v per visible pair; the softmax is not counted).
double attention_flops(std::int64_t batch, std::int64_t heads_q, std::int64_t seqlen_q,
                       std::int64_t seqlen_kv, std::int64_t head_dim,
                       const AttentionOptions& options);

}  // namespace flashattn
