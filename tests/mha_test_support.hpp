#pragma once

// The seed's multi-head attention layer (seed 000) as plain loops in any scalar type, shared by
// the layer's forward and backward tests, and seeded random fills.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include "flashattn/mha.hpp"

namespace flashattn::testing {

inline std::vector<float> random_uniform(std::size_t count, float bound, std::uint32_t seed) {
  std::mt19937 engine(seed);
  std::uniform_real_distribution<float> uniform(-bound, bound);
  std::vector<float> values(count);
  for (float& value : values) value = uniform(engine);
  return values;
}

inline void fill_uniform(std::span<float> values, float bound, std::uint32_t seed) {
  const std::vector<float> random = random_uniform(values.size(), bound, seed);
  std::copy(random.begin(), random.end(), values.begin());
}

// The seed's layer in scalar type T, one loop per equation. Weights are row-major [in, out];
// an empty bias means none.
template <class T>
struct NaiveLayer {
  std::int64_t hidden, heads, kv_heads, head_dim, head_dim_v;
  std::span<const float> w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o;

  // out[r, n] = Σ_c in[r, c] · w[c, n] + bias[n], c < in_width (hidden unless given)
  std::vector<T> project(const std::vector<T>& in, std::int64_t rows, std::span<const float> w,
                         std::span<const float> bias, std::int64_t width,
                         std::int64_t in_width = 0) const {
    if (in_width == 0) in_width = hidden;
    std::vector<T> out(static_cast<std::size_t>(rows * width));
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t n = 0; n < width; ++n) {
        T sum = bias.empty() ? T(0) : T(bias[n]);
        for (std::int64_t c = 0; c < in_width; ++c) {
          sum += in[r * in_width + c] * T(w[c * width + n]);
        }
        out[r * width + n] = sum;
      }
    }
    return out;
  }

  std::vector<T> forward(const std::vector<float>& x, const std::vector<float>& context,
                         std::int64_t batch, std::int64_t seqlen_q, std::int64_t seqlen_kv,
                         bool causal, T scale) const {
    const std::int64_t kv_width = kv_heads * head_dim, v_width = kv_heads * head_dim_v;
    const std::int64_t att_width = heads * head_dim_v;
    const std::vector<T> x_t(x.begin(), x.end()), context_t(context.begin(), context.end());
    const std::vector<T> q = project(x_t, batch * seqlen_q, w_q, b_q, hidden);
    const std::vector<T> k = project(context_t, batch * seqlen_kv, w_k, b_k, kv_width);
    const std::vector<T> v = project(context_t, batch * seqlen_kv, w_v, b_v, v_width);

    // Split heads: element (b, h, i, d) of the seed's [B, Nh, S, Dh] is column h·Dh + d of row
    // b·S + i. GQA: query head h reads KV head h / (Nh / Nkv).
    const auto q_at = [&](auto b, auto h, auto i, auto d) {
      return q[(b * seqlen_q + i) * hidden + h * head_dim + d];
    };
    const auto kv_index = [&](auto b, auto h, auto j, auto d) {
      return (b * seqlen_kv + j) * kv_width + (h / (heads / kv_heads)) * head_dim + d;
    };
    const auto v_index = [&](auto b, auto h, auto j, auto d) {
      return (b * seqlen_kv + j) * v_width + (h / (heads / kv_heads)) * head_dim_v + d;
    };

    std::vector<T> merged(static_cast<std::size_t>(batch * seqlen_q * att_width));
    std::vector<T> scores(static_cast<std::size_t>(seqlen_kv));
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t h = 0; h < heads; ++h) {
        for (std::int64_t i = 0; i < seqlen_q; ++i) {
          // Causal mask aligned to the bottom-right corner: key j is visible iff
          // j <= i + seqlen_kv - seqlen_q.
          const std::int64_t visible =
              causal ? std::clamp<std::int64_t>(i + seqlen_kv - seqlen_q + 1, 0, seqlen_kv)
                     : seqlen_kv;
          T row_max = -std::numeric_limits<T>::infinity();
          for (std::int64_t j = 0; j < visible; ++j) {
            T dot = 0;
            for (std::int64_t d = 0; d < head_dim; ++d)
              dot += q_at(b, h, i, d) * k[kv_index(b, h, j, d)];
            scores[j] = dot * scale;
            row_max = std::max(row_max, scores[j]);
          }
          T normalizer = 0;
          for (std::int64_t j = 0; j < visible; ++j) {
            scores[j] = std::exp(scores[j] - row_max);
            normalizer += scores[j];
          }
          // Merge heads: o_i of head h becomes columns h·Dv .. h·Dv + Dv - 1 of row b·Sq + i.
          // A row with no visible key gets 0 (docs/design.md, "The contract").
          for (std::int64_t d = 0; d < head_dim_v; ++d) {
            T sum = 0;
            for (std::int64_t j = 0; j < visible; ++j) sum += scores[j] * v[v_index(b, h, j, d)];
            merged[(b * seqlen_q + i) * att_width + h * head_dim_v + d] =
                visible > 0 ? sum / normalizer : T(0);
          }
        }
      }
    }
    return project(merged, batch * seqlen_q, w_o, b_o, hidden, att_width);
  }
};

template <class T>
NaiveLayer<T> naive_of(MultiHeadAttention& layer) {
  return {.hidden = layer.config().hidden,
          .heads = layer.config().num_heads,
          .kv_heads = layer.num_kv_heads(),
          .head_dim = layer.head_dim(),
          .head_dim_v = layer.value_head_dim(),
          .w_q = layer.w_q(),
          .w_k = layer.w_k(),
          .w_v = layer.w_v(),
          .w_o = layer.w_o(),
          .b_q = layer.b_q(),
          .b_k = layer.b_k(),
          .b_v = layer.b_v(),
          .b_o = layer.b_o()};
}

}  // namespace flashattn::testing
