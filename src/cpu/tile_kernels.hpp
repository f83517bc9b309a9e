#pragma once

// The FlashAttention inner steps on one (Q block, K/V block) tile, each a separate function so a
// SIMD version can replace one without touching the driver. Tiles are fp32 and row-major:
//   q        [rows x D]        the query block
//   k_packed [D x keys]        the key block transposed, so the score loop streams keys
//   v        [keys x D]        the value block
//   scores   [rows x keys]     scores, then probabilities, in place
//   acc      [rows x D]        unnormalized output accumulator
// `ld` arguments are row strides in elements.

#include <cstdint>

namespace flashattn::detail::cpu {

// scores = scale · q · k_packed                                   [rows x keys]
void scores_tile(float* scores, std::int64_t ld_scores, const float* q, const float* k_packed,
                 std::int64_t rows, std::int64_t keys, std::int64_t head_dim, float scale);

// Online softmax over one tile (Milakov & Gimelshein 2018; FlashAttention-2, Alg. 1): per row
// m_new = max(m, rowmax(s)); p = exp(s - m_new); l = l·exp(m - m_new) + rowsum(p); the
// accumulator row is rescaled by exp(m - m_new) only when the max grew. Masked scores are -inf
// and give p = 0; a row whose scores are all -inf so far keeps m = -inf, l = 0 and never
// computes (-inf) - (-inf).
void online_softmax_tile(float* scores, std::int64_t ld_scores, float* row_max, float* row_sum,
                         float* acc, std::int64_t ld_acc, std::int64_t rows, std::int64_t keys,
                         std::int64_t head_dim);

// acc += p · v                                                    [rows x D]
void accumulate_pv_tile(float* acc, std::int64_t ld_acc, const float* p, std::int64_t ld_p,
                        const float* v, std::int64_t rows, std::int64_t keys,
                        std::int64_t head_dim);

}  // namespace flashattn::detail::cpu
