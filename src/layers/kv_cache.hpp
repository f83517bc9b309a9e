#pragma once

// The work of kvcache_attention_forward (flashattn/kvcache.hpp) on validated parameters; the
// attention step also serves each sequence of a paged varlen batch (flashattn/varlen.hpp).

#include <cstdint>

#include "api/params.hpp"

namespace flashattn::detail {

// The scratch bytes attend_to_cache allocates at most for `impl`, all threads together.
std::int64_t kvcache_scratch_bytes(AttentionImpl impl, const AttentionParams& params);

// Writes the new rows into the cache at each sequence's cache_seqlens.
void append_to_cache(const KVCacheParams& params);

// Every batch entry's queries against its first kv_length(b) keys, read through kv_offset (a
// dense or paged cache), into out and lse.
void attend_to_cache(AttentionImpl impl, const AttentionParams& params);

}  // namespace flashattn::detail
