#include "cpu/kernels/visible_gradients.hpp"

#include <algorithm>

#include "cpu/kernels/score_modifiers.hpp"

namespace flashattn::detail::cpu {

void add_visible_gradients(const AttentionParams& p, const VisibleGradientTile& t) {
  const std::int64_t D = t.head_dim, Dv = t.head_dim_v;
  for (std::int64_t i = 0; i < t.rows; ++i) {
    if (row_fully_masked(p, t.batch, t.head, t.row_begin + i, t.lse[i])) continue;
    const KeyRange visible = p.key_range(t.row_begin + i);
    const std::int64_t first = std::clamp(visible.begin - t.key_begin, std::int64_t{0}, t.keys);
    const std::int64_t last = std::clamp(visible.end - t.key_begin, std::int64_t{0}, t.keys);
    const float* q = t.q + i * t.ld_q;
    const float* dout = t.dout + i * t.ld_dout;
    float* dq = t.dq + i * t.ld_dq;
    for (std::int64_t j = first; j < last; ++j) {
      if (p.key_masked(t.batch, t.head, t.row_begin + i, t.key_begin + j)) continue;
      const float probability = t.probabilities[i * t.ld_scores + j];
      const float dscore = t.dscores[i * t.ld_scores + j];
      const float* k = t.k + j * t.ld_k;
      float* dk = t.dk + j * t.ld_dk;
      float* dv = t.dv + j * t.ld_dv;
      for (std::int64_t d = 0; d < Dv; ++d) dv[d] += probability * dout[d];
      for (std::int64_t d = 0; d < D; ++d) {
        dk[d] += dscore * q[d];
        dq[d] += dscore * k[d];
      }
    }
  }
}

}  // namespace flashattn::detail::cpu
