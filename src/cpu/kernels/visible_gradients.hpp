#pragma once

// The three gradient products of one (query rows, keys) tile over its visible pairs only, for
// operands that hold an infinity or a NaN. The blocked products multiply every pair, a masked
// one with P = dS = 0, and 0·inf = NaN: an infinite value in a key that a row cannot see
// would make that row's dQ NaN, an infinite query row would reach the dK of keys it never
// saw. The fp64 reference sums over visible pairs only, and so does this.

#include <cstdint>

#include "api/params.hpp"

namespace flashattn::detail::cpu {

// Rows [row_begin, row_begin + rows) of query head `head` of batch entry `batch` against keys
// [key_begin, key_begin + keys). Row-major fp32 operands, element (r, d) at data[r·ld + d].
struct VisibleGradientTile {
  std::int64_t batch, head;
  std::int64_t row_begin, rows, key_begin, keys, head_dim, head_dim_v;
  const float* lse;            // [rows], the forward's as the backward reads it
  const float* probabilities;  // P [rows x keys] (P ∘ M with dropout: what dV takes)
  const float* dscores;        // dS, scaled [rows x keys]
  std::int64_t ld_scores;
  const float* q;  // [rows x head_dim]
  std::int64_t ld_q;
  const float* dout;  // [rows x head_dim_v]
  std::int64_t ld_dout;
  const float* k;  // [keys x head_dim]
  std::int64_t ld_k;
  float* dq;  // [rows x head_dim], added into
  std::int64_t ld_dq;
  float* dk;  // [keys x head_dim], added into
  std::int64_t ld_dk;
  float* dv;  // [keys x head_dim_v], added into
  std::int64_t ld_dv;
};

// dV_j += Σ_i P_ij·dO_i, dK_j += Σ_i dS_ij·Q_i, dQ_i += Σ_j dS_ij·K_j over the pairs where
// query position row_begin + i sees key key_begin + j (p.key_range) and no bias or mask masks
// it (p.key_masked), and no pair of a row that a bias or mask masked entirely (row_fully_masked).
// Plain loops: the path of non-finite inputs only.
void add_visible_gradients(const AttentionParams& p, const VisibleGradientTile& tile);

}  // namespace flashattn::detail::cpu
