#pragma once

// The work of kvcache_attention_forward (flashattn/kvcache.hpp) on validated parameters; the
// attention step also serves each sequence of a paged varlen batch (flashattn/varlen.hpp).

#include <cstdint>

#include "api/params.hpp"

namespace flashattn::detail {

// The scratch bytes attend_to_cache allocates at most for `impl`, all threads together.
std::int64_t kvcache_scratch_bytes(AttentionImpl impl, const AttentionParams& params);

// Writes the new rows into the cache at each sequence's cache_seqlens, the keys rotated when
// params.rotary is on.
void append_to_cache(const KVCacheParams& params);

// quantize_kv's rows (flashattn/kvcache.hpp), row by row in parallel.
void quantize_rows(const QuantizeParams& params);

// The bytes rotate_queries writes: q's elements in q's dtype, or 0 without rotary embedding.
std::int64_t rotated_q_bytes(const KVCacheParams& params);

// With rotary embedding on, q rotated into `rotated` (rotated_q_bytes of them, contiguous
// [batch, Sq, heads_q, head_dim]), which params.attention then reads as its q. Every path reads
// q many times (once per key block, or per product of the standard path), so q is rotated once
// here, a pass over q and no more, rather than inside each path; a decode step's q is
// batch · heads_q rows.
void rotate_queries(KVCacheParams& params, void* rotated);

// Every batch entry's queries against its first kv_length(b) keys, read through kv_offset (a
// dense or paged cache), into out and lse.
void attend_to_cache(AttentionImpl impl, const AttentionParams& params);

}  // namespace flashattn::detail
