#include "cpu/tile_sizes.hpp"

#include <algorithm>
#include <fstream>
#include <string>

#include "cpu/kernels/tile_kernels.hpp"

namespace flashattn::detail::cpu {
namespace {

// "48K", "2048K", "1M" -> bytes; 0 when unreadable.
std::int64_t parse_cache_size(const std::string& text) {
  std::size_t digits = 0;
  std::int64_t value = 0;
  while (digits < text.size() && text[digits] >= '0' && text[digits] <= '9') {
    value = value * 10 + (text[digits] - '0');
    ++digits;
  }
  if (digits == 0) return 0;
  const char unit = digits < text.size() ? text[digits] : ' ';
  if (unit == 'K') return value * 1024;
  if (unit == 'M') return value * 1024 * 1024;
  return value;
}

// Q blocks per task: at least 4, more while a task holds fewer than kRowsPerTask query rows, at
// most 8 (see choose_tile_sizes).
constexpr std::int64_t kMinBlocksPerTask = 4;
constexpr std::int64_t kMaxBlocksPerTask = 8;
constexpr std::int64_t kRowsPerTask = 1024;

std::int64_t round_down(std::int64_t value, std::int64_t multiple) {
  return value / multiple * multiple;
}

}  // namespace

CacheSizes detect_cache_sizes() {
  CacheSizes caches{0, 0};
  for (int index = 0; index < 8; ++index) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index);
    std::ifstream level_file(dir + "/level"), type_file(dir + "/type"), size_file(dir + "/size");
    int level = 0;
    std::string type, size;
    if (!(level_file >> level) || !(type_file >> type) || !(size_file >> size)) continue;
    if (level == 1 && type == "Data") caches.l1d_bytes = parse_cache_size(size);
    if (level == 2 && (type == "Unified" || type == "Data"))
      caches.l2_bytes = parse_cache_size(size);
  }
  if (caches.l1d_bytes <= 0) caches.l1d_bytes = kFallbackCaches.l1d_bytes;
  if (caches.l2_bytes <= 0) caches.l2_bytes = kFallbackCaches.l2_bytes;
  return caches;
}

const CacheSizes& machine_cache_sizes() {
  static const CacheSizes caches = detect_cache_sizes();
  return caches;
}

bool stream_output(std::int64_t bytes, int threads) {
  return bytes > machine_cache_sizes().l2_bytes * threads;
}

TileSizes choose_tile_sizes(std::int64_t head_dim, std::int64_t head_dim_v, CacheSizes caches) {
  constexpr std::int64_t kFloat = 4;
  // A Q row and an acc row; a K row and a V row.
  const std::int64_t dims = pad_to_lanes(head_dim) + pad_to_lanes(head_dim_v);

  // Bc: the packed V panel (Bc keys x kPanelWidth floats) is what the P·V kernel keeps in L1
  // while all query rows pass over it; give it at most two thirds of L1 (Bc = 128 at 48 KiB,
  // 64 at 32 KiB): larger blocks pay the softmax and the rescale fewer times (docs/tuning.md).
  const std::int64_t keys =
      std::clamp(round_down(caches.l1d_bytes * 2 / 3 / (kPanelWidth * kFloat), kTileLanes),
                 std::int64_t{64}, std::int64_t{256});

  // Br: one task's tiles, Q and acc (Br x (D + Dv)), scores (Br x Bc) and packed K and V
  // (Bc x (D + Dv)), fill at most half of L2 so the next K/V rows and the output stream past
  // them. The larger Br, the more query rows share each packed K/V block (docs/tuning.md).
  // Capped at 256: beyond it causal diagonal blocks waste more than packing saves.
  const std::int64_t budget = caches.l2_bytes / 2 / kFloat - keys * dims;
  const std::int64_t rows =
      std::clamp(round_down(budget / (dims + keys), kTileLanes), kTileLanes, std::int64_t{256});

  // Q blocks per task: each packed K/V block is then read by that many Q blocks, which divides
  // the packing (a transpose of K) by as much. Their Q and acc tiles need not stay in L2: a Q
  // block's visit to a K/V block reads Q and acc and writes acc, 3·Br·D floats against
  // 4·Br·Bc·D FLOPs, 3 / Bc bytes per FLOP (under 4 GB/s per core at 100 GFLOP/s and Bc = 80),
  // in sequence from L3. Where Br is smaller than 256, more blocks, so that a packed K/V block
  // serves 1024 query rows: what a task packs beyond the keys its rows see in full (a causal
  // diagonal, a window's edges) weighs less (docs/tuning.md).
  const std::int64_t blocks_per_task =
      std::clamp((kRowsPerTask + rows - 1) / rows, kMinBlocksPerTask, kMaxBlocksPerTask);
  return {rows, keys, blocks_per_task};
}

TileSizes flash_tiles(std::int64_t head_dim, std::int64_t head_dim_v) {
  return choose_tile_sizes(head_dim, head_dim_v, machine_cache_sizes());
}

Bf16Products backward_bf16_products(const AttentionParams& p) {
  return p.dtype == DType::bf16 ? active_bf16_products() : Bf16Products::widened;
}

TileSizes flash_backward_tiles(const AttentionParams& p) {
  // Br x Bc of the backward. Five products share each tile pair (two in the forward): Br = 64
  // keeps a row block's Q-side tiles and the two score-sized tiles in L2 beside the K/V block.
  // On AMX, Br = 128: dV += Pᵀ·dO and dK += dSᵀ·Q reduce over Br, and each AMX accumulator tile
  // is loaded and stored once per call, which at 64 (two 32-row steps) cost about as much as
  // the products. Bc: the forward's, except for the fp32 products under a causal mask or a
  // window: half the forward's, at least 64, so that the blocks the mask cuts waste half as
  // much. vdpbf16ps takes the fp32 sizes too: its accumulators are registers, as the fp32
  // kernels' are. The sizes tried and their times: docs/tuning.md.
  const std::int64_t forward_keys = flash_tiles(p.head_dim, p.head_dim_v).keys;
  const bool amx = backward_bf16_products(p) == Bf16Products::amx;
  const bool masked = p.causal || p.window_left >= 0 || p.window_right >= 0;
  const bool half_keys = masked && !amx;
  return {amx ? 128 : 64, half_keys ? std::max<std::int64_t>(forward_keys / 2, 64) : forward_keys,
          1};
}

// The forward's key chunks: a call of fewer tasks (batch x heads_kv x Q blocks) than this cuts
// its keys into chunks of at least kMinChunkBlocks K/V blocks, so that its tasks times chunks
// reach it where the keys allow (flash_forward.cpp). From the shape only, so that the results do
// not depend on the thread count; 16 as the decode path's chunks per call.
constexpr std::int64_t kMinForwardTasks = 16;
constexpr std::int64_t kMinChunkBlocks = 2;

std::int64_t flash_forward_key_chunks(const AttentionParams& p) {
  const TileSizes tiles = flash_tiles(p.head_dim, p.head_dim_v);
  const std::int64_t positions = std::max<std::int64_t>(1, tiles.rows / p.group_size());
  const std::int64_t tasks = p.batch * p.heads_kv * ((p.seqlen_q + positions - 1) / positions);
  const std::int64_t key_blocks = (p.seqlen_kv + tiles.keys - 1) / tiles.keys;
  if (tasks == 0 || tasks >= kMinForwardTasks) return 1;
  return std::clamp((kMinForwardTasks + tasks - 1) / tasks, std::int64_t{1},
                    std::max<std::int64_t>(1, key_blocks / kMinChunkBlocks));
}

// Enough tasks to keep every thread busy when batch x heads_kv is small; a function of the
// shape only (flash_backward.cpp: results do not depend on the thread count).
constexpr std::int64_t kMinimumTasks = 8;

std::int64_t flash_backward_chunks(const AttentionParams& p) {
  const std::int64_t keys = flash_backward_tiles(p).keys;
  const std::int64_t kv_blocks = (p.seqlen_kv + keys - 1) / keys;
  const std::int64_t groups = p.batch * p.heads_kv;
  return std::clamp((kMinimumTasks + groups - 1) / std::max<std::int64_t>(groups, 1),
                    std::int64_t{1}, std::max<std::int64_t>(kv_blocks, 1));
}

}  // namespace flashattn::detail::cpu
