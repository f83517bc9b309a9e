// FlashAttention forward on the CPU (seed 000, second half; seed 002).
//
// Work is cut into tasks of (batch, head, Q block of Br rows); one OpenMP loop hands them out.
// A task walks the K/V blocks of Bc keys that its rows can see, and per block:
//   S = scale · Q_blk · K_blkᵀ                     [Br x Bc]   scores_tile
//   mask S where the block is only partly visible  [Br x Bc]
//   online softmax: m, l, rescale acc              [Br], [Br x D]  online_softmax_tile
//   acc += P · V_blk                               [Br x D]    accumulate_pv_tile
// and finally out = acc / l, lse = m + log(l). Blocks that the causal mask or the window hide
// from every row of the task are never visited.
//
// Memory: per thread Q (Br·D), Kᵀ (D·Bc), V (Bc·D), S (Br·Bc), acc (Br·D) floats plus 2·Br for
// m and l: ~224 KiB at D = 128, whatever the sequence lengths. Every byte of K and V is read
// once per Q block, so K/V traffic is Skv·D·4·2 · ceil(Sq / Br) bytes per head instead of the
// standard path's 3 passes over a 4·Sq·Skv-byte score matrix.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "api/backends.hpp"
#include "cpu/tile_kernels.hpp"
#include "util/convert.hpp"

namespace flashattn::detail {

FlashTiles flash_tiles(std::int64_t head_dim) {
  // Br = 64 query rows, Bc = 128 keys keeps the five tiles of one task (224 KiB at D = 128)
  // inside a 1-2 MiB L2 with room for the next K/V block; shrink the query block for wide
  // heads so the working set stays about the same. Bc must be a multiple of cpu::kTileLanes.
  const std::int64_t rows = head_dim > 128 ? 32 : 64;
  return {rows, 128};
}

namespace {

constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

// Per-thread tiles. Row widths are padded to whole vectors (cpu::pad_to_lanes) with zeros, so
// the kernels never handle a ragged edge: padded keys get score -inf, padded dims stay 0.
struct Scratch {
  std::int64_t dims_padded;
  std::vector<float> q, k_packed, v, scores, acc, row_max, row_sum;

  Scratch(FlashTiles tiles, std::int64_t D)
      : dims_padded(cpu::pad_to_lanes(D)),
        q(tiles.rows * dims_padded),
        k_packed(D * tiles.keys),
        v(tiles.keys * dims_padded),
        scores(tiles.rows * tiles.keys),
        acc(tiles.rows * dims_padded),
        row_max(tiles.rows),
        row_sum(tiles.rows) {}
};

// One task: rows [row_begin, row_end) of head h in batch b.
void flash_task(const AttentionParams& p, FlashTiles tiles, Scratch& t, std::int64_t b,
                std::int64_t h, std::int64_t row_begin, std::int64_t row_end) {
  const std::int64_t D = p.head_dim, Dp = t.dims_padded, rows = row_end - row_begin;
  const std::int64_t h_kv = p.kv_head(h);

  // Prologue: load the Q block, reset the running statistics.
  for (std::int64_t i = 0; i < rows; ++i) {
    load_row_f32(t.q.data() + i * Dp, p.q, p.dtype, p.q_strides.offset(b, row_begin + i, h), D);
  }
  std::fill_n(t.acc.begin(), rows * Dp, 0.0f);
  std::fill_n(t.row_max.begin(), rows, kNegativeInfinity);
  std::fill_n(t.row_sum.begin(), rows, 0.0f);

  // Every key some row of the block can see; the row ranges are monotone in the row.
  const KeyRange first_row = p.key_range(row_begin), last_row = p.key_range(row_end - 1);
  const KeyRange block_keys = p.key_range(row_begin, row_end);

  for (std::int64_t key_begin = block_keys.begin; key_begin < block_keys.end;
       key_begin += tiles.keys) {
    const std::int64_t key_end = std::min(key_begin + tiles.keys, block_keys.end);
    const std::int64_t keys = key_end - key_begin, keys_padded = cpu::pad_to_lanes(keys);

    // Pack Kᵀ [D x keys_padded] and V [keys x Dp], zero-padded.
    for (std::int64_t j = 0; j < keys; ++j) {
      const std::int64_t k_offset = p.k_strides.offset(b, key_begin + j, h_kv);
      for (std::int64_t d = 0; d < D; ++d) {
        t.k_packed[d * keys_padded + j] = load_f32(p.k, p.dtype, k_offset + d);
      }
      load_row_f32(t.v.data() + j * Dp, p.v, p.dtype, p.v_strides.offset(b, key_begin + j, h_kv),
                   D);
    }
    for (std::int64_t d = 0; d < D; ++d) {
      std::fill(t.k_packed.begin() + d * keys_padded + keys,
                t.k_packed.begin() + (d + 1) * keys_padded, 0.0f);
    }

    cpu::scores_tile(t.scores.data(), tiles.keys, t.q.data(), Dp, t.k_packed.data(), keys_padded,
                     rows, keys_padded, D, p.scale);

    // Mask: padded keys always, and the keys of a partly visible block outside each row's range.
    const bool fully_visible = last_row.begin <= key_begin && first_row.end >= key_end;
    for (std::int64_t i = 0; i < rows; ++i) {
      float* s = t.scores.data() + i * tiles.keys;
      std::fill(s + keys, s + keys_padded, kNegativeInfinity);
      if (fully_visible) continue;
      const KeyRange row_keys = p.key_range(row_begin + i);
      for (std::int64_t j = 0; j < keys; ++j) {
        const std::int64_t key = key_begin + j;
        if (key < row_keys.begin || key >= row_keys.end) s[j] = kNegativeInfinity;
      }
    }

    cpu::online_softmax_tile(t.scores.data(), tiles.keys, t.row_max.data(), t.row_sum.data(),
                             t.acc.data(), Dp, rows, keys_padded, Dp);

    if (fully_visible) {
      cpu::accumulate_pv_tile(t.acc.data(), Dp, t.scores.data(), tiles.keys, t.v.data(), Dp, rows,
                              keys, Dp);
    } else {
      // Only each row's visible keys: a masked key's p is 0, but 0 · inf in its value row would
      // still leak NaN into a row that never saw it.
      for (std::int64_t i = 0; i < rows; ++i) {
        const KeyRange row_keys = p.key_range(row_begin + i);
        const std::int64_t first = std::clamp(row_keys.begin, key_begin, key_end) - key_begin;
        const std::int64_t last = std::clamp(row_keys.end, key_begin, key_end) - key_begin;
        if (first >= last) continue;
        cpu::accumulate_pv_tile(t.acc.data() + i * Dp, Dp, t.scores.data() + i * tiles.keys + first,
                                tiles.keys, t.v.data() + first * Dp, Dp, 1, last - first, Dp);
      }
    }
  }

  // Epilogue: out = acc / l, lse = m + log(l); rows that saw no key get 0 and -inf.
  for (std::int64_t i = 0; i < rows; ++i) {
    float* acc_row = t.acc.data() + i * Dp;
    const float sum = t.row_sum[i];
    const bool no_key_seen = sum == 0.0f;
    const float inverse_sum = no_key_seen ? 0.0f : 1.0f / sum;
    for (std::int64_t d = 0; d < D; ++d) acc_row[d] *= inverse_sum;
    store_row_f32(p.out, p.dtype, p.out_strides.offset(b, row_begin + i, h), acc_row, D);
    if (p.lse) {
      const float max = t.row_max[i] == kNegativeInfinity ? 0.0f : t.row_max[i];
      p.lse[p.lse_index(b, h, row_begin + i)] =
          no_key_seen ? kNegativeInfinity : max + std::log(sum);
    }
  }
}

}  // namespace

void flash_forward(const AttentionParams& p) {
  const FlashTiles tiles = flash_tiles(p.head_dim);
  const std::int64_t q_blocks = (p.seqlen_q + tiles.rows - 1) / tiles.rows;
  const std::int64_t tasks = p.batch * p.heads_q * q_blocks;

#pragma omp parallel num_threads(p.num_threads)
  {
    Scratch scratch(tiles, p.head_dim);
    // Dynamic schedule, last Q block first: under a causal mask the last blocks see the most
    // keys, so the long tasks start early and the short ones fill the gaps at the end.
#pragma omp for schedule(dynamic)
    for (std::int64_t task = 0; task < tasks; ++task) {
      const std::int64_t q_block = q_blocks - 1 - task % q_blocks;
      const std::int64_t head = task / q_blocks;
      const std::int64_t b = head / p.heads_q, h = head % p.heads_q;
      const std::int64_t row_begin = q_block * tiles.rows;
      flash_task(p, tiles, scratch, b, h, row_begin, std::min(row_begin + tiles.rows, p.seqlen_q));
    }
  }
}

}  // namespace flashattn::detail
