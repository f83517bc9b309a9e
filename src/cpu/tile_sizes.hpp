#pragma once

// How big the FlashAttention tiles are: a pure function of the head dim and the cache sizes,
// so it can be tested without the machine it runs on.

#include <cstdint>

namespace flashattn::detail::cpu {

struct CacheSizes {
  std::int64_t l1d_bytes = 0;  // per core
  std::int64_t l2_bytes = 0;   // per core
};

// The fallback when the OS does not say: a common x86 server core of the last decade.
inline constexpr CacheSizes kFallbackCaches{32 * 1024, 1024 * 1024};

// Reads cpu0's L1d and L2 sizes from Linux sysfs; kFallbackCaches for any size it cannot read.
CacheSizes detect_cache_sizes();

// detect_cache_sizes() of the first call, kept for the process.
const CacheSizes& machine_cache_sizes();

// Whether an output of `bytes` that `threads` threads write should bypass the caches
// (store_row_f32 with stream): when it is larger than their L2 caches together it cannot stay
// there, and plain stores would first read every line from memory.
bool stream_output(std::int64_t bytes, int threads);

struct TileSizes {
  std::int64_t rows = 0;             // Br: query rows of a task
  std::int64_t keys = 0;             // Bc: keys of a K/V block
  std::int64_t blocks_per_task = 1;  // Q blocks of Br rows that share each packed K/V block
};

TileSizes choose_tile_sizes(std::int64_t head_dim, CacheSizes caches);

}  // namespace flashattn::detail::cpu
