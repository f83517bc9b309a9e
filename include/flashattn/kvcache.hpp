#pragma once

// Attention against a serving batch's KV cache (as FlashAttention's flash_attn_with_kvcache):
// every sequence of the batch has its own length, new K/V rows are appended in place before the
// new queries attend, and the cache is either dense or paged (vLLM's block tables).
//
// A step of decoding, for each sequence b of the batch:
//   1. the Snew new rows k_new[b], v_new[b] are written at positions
//      cache_seqlens[b] .. cache_seqlens[b] + Snew − 1 of sequence b's cache;
//   2. q[b] (Sq rows) attends to the sequence's first L_b = cache_seqlens[b] + Snew keys, the
//      causal mask and window aligned to the bottom-right corner of that sequence (query row i
//      sees key j <= i + L_b − Sq), exactly as attention_forward on a dense [1, L_b] cache.
// cache_seqlens is read, never changed: the caller adds Snew to it after the call.

#include <cstdint>

#include "flashattn/attention.hpp"
#include "flashattn/options.hpp"
#include "flashattn/tensor.hpp"

namespace flashattn {

// The cache of one layer.
//   dense (block_table null):  k, v [batch, capacity, heads_kv, head_dim (v: head_dim_v)];
//                              sequence b's key j is row (b, j)
//   paged (block_table set):   k, v [num_pages, page_size, heads_kv, head_dim (head_dim_v)],
//                              page_size >= 1;
//                              block_table int32 [batch, pages_per_sequence] row-major: sequence
//                              b's key j is row j % page_size of page block_table[b, j / page_size]
// Any element strides with the last dim contiguous: a cache that keeps each KV head's rows
// together ([num_pages, heads_kv, page_size, head_dim], FlashInfer's HND; dense [batch, heads_kv,
// capacity, head_dim]) is passed with dims 1 and 2 swapped in shape and strides, and gives the
// same results bit for bit (the decode reads the layout above faster: bench/RESULTS.md, "HND").
// The capacity of a sequence is `capacity` (dense) or pages_per_sequence · page_size (paged).
// Only the block-table entries that cover a sequence's L_b keys are read (and must lie in
// [0, num_pages)); the rest may hold anything. Pages may be shared between sequences (a common
// prompt prefix) but not written by two sequences, nor twice by one, in the same call. The
// pointer decides: a paged cache needs a non-null block_table even when no sequence has a page
// yet (an empty std::vector's data() may be null; reserve it).
//
// A quantized cache (k and v of dtype int8, fp8_e4m3 or fp8_e5m2, both the same) holds codes;
// its values are code · scale, exactly (docs/semantics.md, "Quantized KV caches"). The scales
// are fp32 views k_scale, v_scale [k.shape[0], k.shape[1], heads_kv, groups] beside the cache:
// element (i, j, h, g) scales dims [g·D/groups, (g + 1)·D/groups) of row (i, j, h) of the cache,
// groups dividing head_dim (1: one scale per row; D/32: llama.cpp's q8_0 blocks of 32). Strides
// of 0 broadcast one scale over a dim: strides {0, 0, 1, 0} give a scale per KV head and all 0
// one per tensor (vLLM's k_scale, v_scale). Appended rows (NewKeysValues) are quantized into the
// cache: int8 computes each new row's scales from its values and writes them (its scales then
// need one element per (row, group): no 0 strides), fp8 divides by the scales there. Scales are
// not checked: a NaN scale makes its values NaN (the int8 quantizer writes one for a row holding
// a NaN or an infinity). Rows of f32, f16 and bf16 caches take no scales.
//
// A shared cache (DeepSeek's MLA, absorbed: one latent row of 576 dims per token, whose first 512
// are also its values): pass v as k's first head_dim_v dims, the same data and strides with
// shape[3] = head_dim_v, and append new rows as NewKeysValues' k alone, which declares the cache
// shared and writes each latent row once. A quantized shared cache passes v_scale as k_scale's
// view: the same data and strides, one scale per row for both, or v's groups k's first ones of
// the same width (group size).
struct KVCacheView {
  TensorView k, v;
  const std::int32_t* block_table = nullptr;
  std::int64_t pages_per_sequence = 0;
  TensorView k_scale{}, v_scale{};  // quantized caches only
};

// The new rows to append, k [batch, Snew, heads_kv, head_dim] and v [.., head_dim_v], in the
// cache's dtype or in q's (then rounded to the cache's, to nearest even). Leave both empty (the
// default) to append nothing; k alone appends to a shared cache (KVCacheView), whose v must then
// be a view of k's first head_dim_v dims.
struct NewKeysValues {
  ConstTensorView k, v;
};

// Rotary position embedding (RoPE) of the new keys and of q, as FlashAttention 2.8's
// flash_attn_with_kvcache applies it. cos and sin: fp32 row-major [positions, rotary_dim / 2],
// row p holding cos(p·θ_i), sin(p·θ_i); rotary_dim even, in [2, head_dim]. Each pair of dims
// (x1, x2) of a row at position p becomes (x1·cos − x2·sin, x2·cos + x1·sin), computed in fp64
// and rounded once to the destination's dtype; dims from rotary_dim on are left as they are.
//   interleaved (GPT-J):      pairs (2i, 2i + 1)
//   not interleaved (NeoX):   pairs (i, i + rotary_dim / 2)
// The new key row i of sequence b is rotated at position cache_seqlens[b] + i before it is
// written, so the cache holds rotated keys. q row i is rotated at cache_seqlens[b] + i when
// the call is causal or windowed, and every q row at cache_seqlens[b] otherwise (FlashAttention
// counts as windowed a window_left or window_right in [0, capacity)). Positions are cache rows:
// cache_leftpad does not shift them. Rotary needs new rows to append (as FlashAttention), and
// every position must be below `positions`.
struct RotaryEmbedding {
  const float* cos = nullptr;  // null: no rotary embedding
  const float* sin = nullptr;
  std::int64_t positions = 0;   // rows of cos and sin (FlashAttention's seqlen_ro)
  std::int64_t rotary_dim = 0;  // dims rotated, 2 · the columns of cos and sin
  bool interleaved = true;
};

// The rest of flash_attn_with_kvcache's arguments, all off by default.
//   rotary           above
//   cache_leftpad    int32 [batch], or null: sequence b's keys are rows cache_leftpad[b] ..
//                    cache_seqlens[b] + Snew − 1 of its cache, L_b = cache_seqlens[b] + Snew −
//                    cache_leftpad[b] of them, and the masks and ALiBi count from the first
//                    (0 <= cache_leftpad[b] <= cache_seqlens[b]). Dense caches only.
//   cache_batch_idx  int32 [batch], or null: batch entry b reads and appends to row
//                    cache_batch_idx[b] of a dense cache [batch_cache, capacity, heads_kv,
//                    head_dim] (any batch_cache; entries in [0, batch_cache), and distinct
//                    when rows are appended). Dense caches only.
struct KVCacheOptions {
  RotaryEmbedding rotary;
  const std::int32_t* cache_leftpad = nullptr;
  const std::int32_t* cache_batch_idx = nullptr;
};

// q    [batch, Sq, heads_q, head_dim]: Sq = 1 decodes, a few speculate, more prefill a chunk,
//      0 only appends
// out  [batch, Sq, heads_q, head_dim_v] in q's dtype; must not overlap any other argument
// lse  fp32 contiguous [batch, heads_q, Sq], or null
// cache_seqlens int32 [batch], each >= 0 and with Snew at most the sequence's capacity
// dtypes (q, cache): (f32, f32), (f16, f16), (bf16, bf16), and f32 q with an f16 or bf16
// cache (the 16-bit values widen exactly; products and softmax in fp32). Others are refused.
// options: scale, causal, window and threads as for attention_forward.
// impl: flash reads the cache where it lies for up to 32 query rows per KV head (decode, any
// page size); beyond that, and for the standard and reference paths, the dense path reads each
// sequence's rows: where they lie in a dense cache of q's dtype, else first gathered into a
// contiguous buffer (in q's dtype). A dense and a paged cache holding the same rows give the same
// results bit for bit.
// Invalid arguments raise flashattn::Error before anything is written, the cache included.
void kvcache_attention_forward(const ConstTensorView& q, const KVCacheView& cache,
                               const std::int32_t* cache_seqlens, const NewKeysValues& new_kv,
                               const TensorView& out, float* lse,
                               const AttentionOptions& options = {},
                               AttentionImpl impl = AttentionImpl::flash);

// The same with rotary embedding, left padding or a batch index (KVCacheOptions); the call
// above is this one with cache_options at their defaults.
void kvcache_attention_forward(const ConstTensorView& q, const KVCacheView& cache,
                               const std::int32_t* cache_seqlens, const NewKeysValues& new_kv,
                               const KVCacheOptions& cache_options, const TensorView& out,
                               float* lse, const AttentionOptions& options = {},
                               AttentionImpl impl = AttentionImpl::flash);

// Rows of a compute dtype quantized into a quantized cache, as kvcache_attention_forward
// quantizes appended rows (a prefill's K or V, say):
//   values  [batch, seq, heads_kv, head_dim], f32, f16 or bf16
//   cache   the same shape, int8, fp8_e4m3 or fp8_e5m2: a dense cache, or a page's rows
//   scales  fp32 [batch, seq, heads_kv, groups] as KVCacheView's k_scale: int8 writes them (one
//           element per row and group), fp8 reads them (0 strides broadcast)
// Rounding, saturation, zeros and non-finite values: docs/semantics.md, "Quantized KV caches".
// num_threads as AttentionOptions' (0: OpenMP's default). Invalid arguments raise
// flashattn::Error before anything is written.
void quantize_kv(const ConstTensorView& values, const TensorView& cache, const TensorView& scales,
                 int num_threads = 0);

}  // namespace flashattn
