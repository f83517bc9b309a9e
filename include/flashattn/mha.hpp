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
  // Dv, the head dim of V and of the attention output (DeepSeek's MLA: 128 against a query/key
  // head dim of 192); 0 means head_dim.
  std::int64_t value_head_dim = 0;
};

// The seed's layer: X -> Q, K, V -> QKᵀ·scale -> mask -> softmax -> PV -> merge heads -> ·W_O.
// Weights are row-major [in, out] so that Q = X·W_Q:
//   W_Q: [H, H];  W_K: [H, num_kv_heads * head_dim] (== [H, H] without GQA);
//   W_V: [H, num_kv_heads * Dv];  W_O: [num_heads * Dv, H] (all [H, H] when Dv = head_dim).
// Projections are OpenBLAS sgemms; heads are split and merged as strided views, never copied.
class MultiHeadAttention {
 public:
  explicit MultiHeadAttention(const MultiHeadAttentionConfig& config);

  const MultiHeadAttentionConfig& config() const { return config_; }
  std::int64_t head_dim() const { return config_.hidden / config_.num_heads; }
  std::int64_t value_head_dim() const {
    return config_.value_head_dim == 0 ? head_dim() : config_.value_head_dim;
  }
  std::int64_t kv_width() const { return num_kv_heads() * head_dim(); }  // K's columns
  std::int64_t v_width() const { return num_kv_heads() * value_head_dim(); }
  std::int64_t attention_width() const { return config_.num_heads * value_head_dim(); }
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

  // Training. A forward that takes `saved` also keeps what backward needs; backward then turns
  // dL/dy into the gradients of the inputs, weights and biases:
  //
  //   MultiHeadAttention::Activations saved;
  //   layer.forward(x, batch, seqlen, y, saved, options);
  //   ... dy = dL/dy ...
  //   const MultiHeadAttention::Gradients grads = layer.backward(dy, saved);
  //   ... update w_q() etc. from grads.dw_q etc. ...
  //
  // All fp32, row-major, in the layouts of forward.
  struct Activations {
    // The call that produced them; backward checks that they fit this layer.
    std::int64_t hidden = 0, num_heads = 0, num_kv_heads = 0, value_head_dim = 0;
    std::int64_t batch = 0, seqlen_q = 0, seqlen_kv = 0;
    bool cross = false;          // keys and values came from a separate context
    AttentionOptions options;    // the forward's; backward uses the same mask and scale
    std::vector<float> x;        // [B·Sq, H], a copy of the input
    std::vector<float> context;  // [B·Skv, H], a copy; empty for self-attention (x is it)
    std::vector<float> q;        // [B·Sq, H]      = [B, Sq, Nh, Dh]
    std::vector<float> k;        // [B·Skv, Hkv]   = [B, Skv, Nkv, Dh]
    std::vector<float> v;        // [B·Skv, Nkv·Dv] = [B, Skv, Nkv, Dv]
    std::vector<float> att;      // [B·Sq, Nh·Dv]  attention output, before W_O
    std::vector<float> lse;      // [B, Nh, Sq]    its logsumexp
  };

  struct Gradients {
    std::vector<float> dx;        // [B·Sq, H]; for self-attention includes the K and V paths
    std::vector<float> dcontext;  // [B·Skv, H]; empty for self-attention
    std::vector<float> dw_q, dw_k, dw_v, dw_o;  // shaped like w_q() ... w_o()
    std::vector<float> db_q, db_k, db_v, db_o;  // like b_q() ... b_o(); empty without bias
  };

  // As the forwards above, and `saved` replaced by this call's activations (left unchanged if
  // the call raises). Memory kept: 2·B·Sq·H + B·Sq·Nh·Dv + B·Skv·(Hkv + Nkv·Dv) + B·Nh·Sq floats,
  // plus B·Skv·H for cross-attention.
  void forward(const float* x, std::int64_t batch, std::int64_t seqlen, float* y,
               Activations& saved, const AttentionOptions& options = {},
               AttentionImpl impl = AttentionImpl::flash) const;
  void forward(const float* x, std::int64_t batch, std::int64_t seqlen_q, const float* context,
               std::int64_t seqlen_kv, float* y, Activations& saved,
               const AttentionOptions& options = {},
               AttentionImpl impl = AttentionImpl::flash) const;

  // Gradients of a loss L given dy = dL/dy, contiguous fp32 [batch, seqlen_q, H], for the
  // forward that filled `saved`. Uses the layer's current weights: call it before updating
  // them. `impl` chooses the attention backward (attention_backward); the mask, scale and
  // threads are those of the forward. The overload with `grads` resizes its vectors and
  // overwrites every element (no accumulation), reusing their memory from call to call.
  Gradients backward(const float* dy, const Activations& saved,
                     AttentionImpl impl = AttentionImpl::flash) const;
  void backward(const float* dy, const Activations& saved, Gradients& grads,
                AttentionImpl impl = AttentionImpl::flash) const;

 private:
  void forward_into(const float* x, std::int64_t batch, std::int64_t seqlen_q, const float* context,
                    std::int64_t seqlen_kv, bool cross, float* y, Activations* saved,
                    const AttentionOptions& options, AttentionImpl impl) const;

  MultiHeadAttentionConfig config_;
  std::vector<float> w_q_, w_k_, w_v_, w_o_;
  std::vector<float> b_q_, b_k_, b_v_, b_o_;
};

}  // namespace flashattn
