// Portable tile kernels: plain loops with the innermost loop over contiguous memory so that the
// compiler vectorizes them for the baseline target.

#include "cpu/tile_kernels.hpp"

#include <cmath>
#include <limits>

namespace flashattn::detail::cpu {
namespace {
constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();
}

void scores_tile(float* scores, std::int64_t ld_scores, const float* q, const float* k_packed,
                 std::int64_t rows, std::int64_t keys, std::int64_t head_dim, float scale) {
  for (std::int64_t i = 0; i < rows; ++i) {
    float* s = scores + i * ld_scores;
    const float* q_row = q + i * head_dim;
    for (std::int64_t j = 0; j < keys; ++j) s[j] = 0.0f;
    for (std::int64_t d = 0; d < head_dim; ++d) {
      const float q_value = q_row[d];
      const float* k_column = k_packed + d * keys;
      for (std::int64_t j = 0; j < keys; ++j) s[j] += q_value * k_column[j];
    }
    for (std::int64_t j = 0; j < keys; ++j) s[j] *= scale;
  }
}

void online_softmax_tile(float* scores, std::int64_t ld_scores, float* row_max, float* row_sum,
                         float* acc, std::int64_t ld_acc, std::int64_t rows, std::int64_t keys,
                         std::int64_t head_dim) {
  for (std::int64_t i = 0; i < rows; ++i) {
    float* s = scores + i * ld_scores;
    // NaN scores fail every comparison, so they never become the max; they reach the sum
    // through exp() instead and turn the row into NaN, as the reference does.
    float tile_max = kNegativeInfinity;
    for (std::int64_t j = 0; j < keys; ++j) tile_max = s[j] > tile_max ? s[j] : tile_max;
    const float old_max = row_max[i];
    const float new_max = tile_max > old_max ? tile_max : old_max;
    const float shift = new_max == kNegativeInfinity ? 0.0f : new_max;

    float tile_sum = 0.0f;
    for (std::int64_t j = 0; j < keys; ++j) {
      s[j] = std::exp(s[j] - shift);
      tile_sum += s[j];
    }
    if (new_max > old_max) {
      const float correction = std::exp(old_max - shift);  // 0 when old_max is -inf
      float* acc_row = acc + i * ld_acc;
      for (std::int64_t d = 0; d < head_dim; ++d) acc_row[d] *= correction;
      row_sum[i] = row_sum[i] * correction + tile_sum;
      row_max[i] = new_max;
    } else {
      row_sum[i] += tile_sum;
    }
  }
}

void accumulate_pv_tile(float* acc, std::int64_t ld_acc, const float* p, std::int64_t ld_p,
                        const float* v, std::int64_t rows, std::int64_t keys,
                        std::int64_t head_dim) {
  for (std::int64_t i = 0; i < rows; ++i) {
    float* acc_row = acc + i * ld_acc;
    const float* p_row = p + i * ld_p;
    for (std::int64_t j = 0; j < keys; ++j) {
      const float weight = p_row[j];
      const float* v_row = v + j * head_dim;
      for (std::int64_t d = 0; d < head_dim; ++d) acc_row[d] += weight * v_row[d];
    }
  }
}

}  // namespace flashattn::detail::cpu
