#pragma once

// The work of kvcache_attention_forward (flashattn/kvcache.hpp) on validated parameters.

#include <cstdint>

#include "api/params.hpp"

namespace flashattn::detail {

// The scratch bytes attend_to_cache allocates at most for `impl`, all threads together.
std::int64_t kvcache_scratch_bytes(AttentionImpl impl, const KVCacheParams& params);

// Writes the new rows into the cache at each sequence's cache_seqlens.
void append_to_cache(const KVCacheParams& params);

// Every sequence's queries against its first kv_lengths[b] keys, into out and lse.
void attend_to_cache(AttentionImpl impl, const KVCacheParams& params);

}  // namespace flashattn::detail
