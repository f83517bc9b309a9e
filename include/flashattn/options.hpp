#pragma once

#include <cstdint>
#include <optional>
#include <span>

#include "flashattn/tensor.hpp"

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
  //   ->  + bias[b, h, i, j]  ->  mask, causal, window  ->  softmax whose denominator also holds
  //   exp(sink_h)
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
  // Additive bias on the logits (T5, relative positions), f32, f16 or bf16, shape
  // [batch | 1, heads_q | 1, seqlen_q, seqlen_kv]: a dim of 1 is shared by every batch entry or
  // head. Any strides (0 included); data null = off. A −inf entry masks its key as a false mask
  // entry does.
  ConstTensorView bias;
  // Boolean mask (document and prefix-LM masks), true = the key is kept; same shapes and
  // broadcasting as the bias; data null = off. Blocks that the bias and mask mask entirely are
  // skipped.
  // With a bias or a mask, a row whose every key is masked (−inf) gets output 0 and lse −inf
  // (its sink with sinks), as a row outside the causal mask does, and never NaN.
  MaskView mask;
  // Attention dropout (training), as FlashAttention defines it: each probability P_ij is kept
  // with probability 1 − dropout_p and then scaled by 1 / (1 − dropout_p), or set to 0; lse is
  // the softmax's before dropout. The mask is a function of (dropout_seed, dropout_offset, batch
  // entry, query head, row, key) (docs/semantics.md, "Dropout"): the backward given the same
  // seed and offset regenerates it, and no thread count or tile size changes it. 0 = off;
  // otherwise in (0, 1). Forward and backward of the flash, standard and reference paths and
  // the varlen batch; the serving calls (KV cache, paged varlen) and the ring refuse it.
  float dropout_p = 0.0f;
  std::uint64_t dropout_seed = 0;
  std::uint32_t dropout_offset = 0;
  // Worker threads for the call, 0 to kMaxThreads; 0 means all the OpenMP runtime offers.
  int num_threads = 0;
};

// The most worker threads a call may ask for: libgomp exits the process when it cannot start the
// threads asked for (1e6, say), so counts far beyond any machine are refused instead.
inline constexpr int kMaxThreads = 1024;

}  // namespace flashattn
