#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "flashattn/attention.hpp"

namespace flashattn {

struct MultiHeadAttentionConfig {
  std::int64_t hidden = 0;        // H = num_heads * head_dim
  std::int64_t num_heads = 0;     // Nh
  std::int64_t num_kv_heads = 0;  // heads of K and V (GQA); 0 means num_heads
  bool bias = false;              // add b_Q, b_K, b_V, b_O after each projection
};

// The seed's layer: X -> Q, K, V -> QKᵀ·scale -> mask -> softmax -> PV -> merge heads -> ·W_O.
// Weights are row-major [in, out] so that Q = X·W_Q:
//   W_Q, W_O: [H, H];  W_K, W_V: [H, num_kv_heads * head_dim] (== [H, H] without GQA).
// Projections are OpenBLAS sgemms; heads are split and merged as strided views, never copied.
class MultiHeadAttention {
 public:
  explicit MultiHeadAttention(const MultiHeadAttentionConfig& config);

  const MultiHeadAttentionConfig& config() const { return config_; }
  std::int64_t head_dim() const { return config_.hidden / config_.num_heads; }
  std::int64_t kv_width() const { return num_kv_heads() * head_dim(); }
  std::int64_t num_kv_heads() const {
    return config_.num_kv_heads == 0 ? config_.num_heads : config_.num_kv_heads;
  }

  std::span<float> w_q() { return w_q_; }
  std::span<float> w_k() { return w_k_; }
  std::span<float> w_v() { return w_v_; }
  std::span<float> w_o() { return w_o_; }
  std::span<float> b_q() { return b_q_; }  // empty without bias
  std::span<float> b_k() { return b_k_; }
  std::span<float> b_v() { return b_v_; }
  std::span<float> b_o() { return b_o_; }

  // Fills every weight uniformly in ±1/sqrt(H) and biases with zeros, deterministically.
  void init_random(std::uint64_t seed);

  // Self-attention: x, y contiguous fp32 [batch, seqlen, H]. y may not alias x.
  void forward(const float* x, std::int64_t batch, std::int64_t seqlen, float* y,
               const AttentionOptions& options = {},
               AttentionImpl impl = AttentionImpl::flash) const;

  // Cross-attention: queries from x [batch, seqlen_q, H], keys and values from
  // context [batch, seqlen_kv, H].
  void forward(const float* x, std::int64_t batch, std::int64_t seqlen_q, const float* context,
               std::int64_t seqlen_kv, float* y, const AttentionOptions& options = {},
               AttentionImpl impl = AttentionImpl::flash) const;

 private:
  MultiHeadAttentionConfig config_;
  std::vector<float> w_q_, w_k_, w_v_, w_o_;
  std::vector<float> b_q_, b_k_, b_v_, b_o_;
};

}  // namespace flashattn
