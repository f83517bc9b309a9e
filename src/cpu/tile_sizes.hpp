#pragma once

// How big the FlashAttention tiles are: choose_tile_sizes is a pure function of the head dims and
// the cache sizes, so it can be tested without the machine it runs on; flash_tiles and
// flash_backward_tiles apply it to this machine and a call's parameters.

#include <cstdint>

#include "api/params.hpp"
#include "cpu/kernels/bf16_products.hpp"

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

// head_dim: q's and k's, head_dim_v: v's and out's.
TileSizes choose_tile_sizes(std::int64_t head_dim, std::int64_t head_dim_v, CacheSizes caches);

// The forward's tiles on this machine: Br query rows by Bc keys, and how many Q blocks of Br
// rows at most share each packed K/V block.
TileSizes flash_tiles(std::int64_t head_dim, std::int64_t head_dim_v);

// How many chunks the forward cuts the keys of a call of few Q blocks into (flash_forward.cpp),
// 1 for most calls: a function of the shape only, so results do not depend on the thread count.
std::int64_t flash_forward_key_chunks(const AttentionParams& p);

// How the flash backward's products run: bf16 inputs as active_bf16_products says, every other
// dtype widened to fp32.
Bf16Products backward_bf16_products(const AttentionParams& p);
// The backward's Br x Bc (blocks_per_task unused).
TileSizes flash_backward_tiles(const AttentionParams& p);
// How many chunks of K/V blocks the flash backward cuts each (batch, KV head) group into: a
// function of the shape only, so results do not depend on the thread count.
std::int64_t flash_backward_chunks(const AttentionParams& p);

}  // namespace flashattn::detail::cpu
