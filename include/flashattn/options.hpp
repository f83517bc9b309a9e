#pragma once

#include <cstdint>
#include <optional>
#include <span>

namespace flashattn {

struct AttentionOptions {
  // Multiplies q·k before the softmax. Unset means 1/sqrt(head_dim). Must be finite and > 0.
  std::optional<float> softmax_scale;
  // Causal mask aligned to the bottom-right corner: query row i sees key j iff
  // j <= i + seqlen_kv - seqlen_q (FlashAttention >= 2.1). With one new query against a KV cache
  // the query sees the whole cache.
  bool causal = false;
  // Sliding window on the same diagonal: row i sees keys j with
  // i + seqlen_kv - seqlen_q - window_left <= j <= i + seqlen_kv - seqlen_q + window_right.
  // -1 means unbounded on that side.
  std::int64_t window_left = -1;
  std::int64_t window_right = -1;
  // Score modifiers, applied in this order (docs/semantics.md, "Score modifiers"):
  //   s = scale·q·k  ->  softcap·tanh(s / softcap)  ->  − slope_h·|i + seqlen_kv − seqlen_q − j|
  //   ->  causal / window mask  ->  softmax whose denominator also holds exp(sink_h)
  // Soft capping of the scores (Gemma 2): 0 = off; otherwise finite and > 0.
  float softcap = 0.0f;
  // ALiBi slopes, fp32: [heads_q] for every batch entry, or [batch, heads_q]; empty = off. The
  // distance is taken from the bottom-right diagonal, like the causal mask, as FlashAttention
  // does: key j of query row i gets − slope·|i + seqlen_kv − seqlen_q − j| (keys on either side
  // of the diagonal alike). Finite values; the memory is read during the call only.
  std::span<const float> alibi_slopes;
  // Attention sinks (StreamingLLM, gpt-oss), fp32 [heads_q]; empty = off. Each query head's
  // logit takes part in the softmax's normalizer with no value row: out = Σ_j p_j v_j with
  // Σ_j p_j = 1 − exp(sink − lse), and lse includes the sink. A row that sees no key gets output
  // 0 and lse = its sink. Finite values.
  std::span<const float> sinks;
  // Worker threads for the call, 0 to kMaxThreads; 0 means all the OpenMP runtime offers.
  int num_threads = 0;
};

// The most worker threads a call may ask for: libgomp exits the process when it cannot start the
// threads asked for (1e6, say), so counts far beyond any machine are refused instead.
inline constexpr int kMaxThreads = 1024;

}  // namespace flashattn
