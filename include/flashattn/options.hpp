#pragma once

#include <cstdint>
#include <optional>

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
  // Worker threads for the call, 0 to kMaxThreads; 0 means all the OpenMP runtime offers.
  int num_threads = 0;
};

// The most worker threads a call may ask for: libgomp exits the process when it cannot start the
// threads asked for (1e6, say), so counts far beyond any machine are refused instead.
inline constexpr int kMaxThreads = 1024;

}  // namespace flashattn
