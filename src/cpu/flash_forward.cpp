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
// m and l: 448 KiB at D = 128 with Br = 256, Bc = 128 (tile_sizes.cpp says why those sizes),
// whatever the sequence lengths. Every byte of K and V is read and packed once per Q block, so
// K/V traffic is Skv·D·4·2 · ceil(Sq / Br) bytes per head instead of the standard path's 3
// passes over a 4·Sq·Skv-byte score matrix.

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "api/backends.hpp"
#include "cpu/tile_kernels.hpp"
#include "cpu/tile_sizes.hpp"
#include "util/convert.hpp"

namespace flashattn::detail {

FlashTiles flash_tiles(std::int64_t head_dim) {
  static const cpu::CacheSizes caches = cpu::detect_cache_sizes();
  const cpu::TileSizes tiles = cpu::choose_tile_sizes(head_dim, caches);
  return {tiles.rows, tiles.keys};
}

namespace {

constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

// Per-thread tiles. Row widths are padded to whole vectors (cpu::pad_to_lanes) with zeros, so
// the kernels never handle a ragged edge: padded keys get score -inf, padded dims stay 0.
struct Scratch {
  std::int64_t dims_padded;
  std::vector<float> q, k_packed, v_packed, scores, acc, row_max, row_sum;

  Scratch(FlashTiles tiles, std::int64_t D)
      : dims_padded(cpu::pad_to_lanes(D)),
        q(tiles.rows * dims_padded),
        k_packed(D * tiles.keys),
        v_packed(tiles.keys * dims_padded),
        scores(tiles.rows * tiles.keys),
        acc(tiles.rows * dims_padded),
        row_max(tiles.rows),
        row_sum(tiles.rows) {}
};

// Element readers for the storage dtypes, so that packing compiles to plain loads for f32.
struct LoadF32 {
  const float* base;
  float operator()(std::int64_t index) const { return base[index]; }
};
template <float (*kWiden)(std::uint16_t)>
struct LoadHalf {
  const std::uint16_t* base;
  float operator()(std::int64_t index) const { return kWiden(base[index]); }
};

template <class Visitor>
decltype(auto) with_loader(DType dtype, const void* base, Visitor&& visit) {
  switch (dtype) {
    case DType::f16:
      return visit(LoadHalf<f32_from_f16>{static_cast<const std::uint16_t*>(base)});
    case DType::bf16:
      return visit(LoadHalf<f32_from_bf16>{static_cast<const std::uint16_t*>(base)});
    case DType::f32:
      break;
  }
  return visit(LoadF32{static_cast<const float*>(base)});
}

// Kᵀ of keys [key_begin, key_begin + keys) as [D x keys_padded] column panels; padded keys are 0.
void pack_keys(const AttentionParams& p, Scratch& t, std::int64_t b, std::int64_t h_kv,
               std::int64_t key_begin, std::int64_t keys, std::int64_t keys_padded) {
  const std::int64_t D = p.head_dim;
  with_loader(p.dtype, p.k, [&](auto load) {
    for (std::int64_t j = 0; j < keys_padded; ++j) {
      const std::int64_t panel_begin = j / cpu::kPanelWidth * cpu::kPanelWidth;
      const std::int64_t width = std::min(cpu::kPanelWidth, keys_padded - panel_begin);
      float* column = t.k_packed.data() + cpu::packed_index(0, j, D, keys_padded);
      if (j >= keys) {
        for (std::int64_t d = 0; d < D; ++d) column[d * width] = 0.0f;
        continue;
      }
      const std::int64_t offset = p.k_strides.offset(b, key_begin + j, h_kv);
      for (std::int64_t d = 0; d < D; ++d) column[d * width] = load(offset + d);
    }
  });
}

// V of keys [key_begin, key_begin + keys) as [keys x Dp] column panels; padded dims are 0.
void pack_values(const AttentionParams& p, Scratch& t, std::int64_t b, std::int64_t h_kv,
                 std::int64_t key_begin, std::int64_t keys) {
  const std::int64_t D = p.head_dim, Dp = t.dims_padded;
  with_loader(p.dtype, p.v, [&](auto load) {
    for (std::int64_t j = 0; j < keys; ++j) {
      const std::int64_t offset = p.v_strides.offset(b, key_begin + j, h_kv);
      for (std::int64_t d0 = 0; d0 < Dp; d0 += cpu::kPanelWidth) {
        const std::int64_t width = std::min(cpu::kPanelWidth, Dp - d0);
        const std::int64_t loaded = std::min(width, D - d0);
        float* row = t.v_packed.data() + cpu::packed_index(j, d0, keys, Dp);
        for (std::int64_t d = 0; d < loaded; ++d) row[d] = load(offset + d0 + d);
        for (std::int64_t d = loaded; d < width; ++d) row[d] = 0.0f;
      }
    }
  });
}

// Whether no element of values[0, n) is an infinity or NaN (exponent bits all ones). Integer
// arithmetic so that the loop vectorizes.
bool all_finite(const float* values, std::int64_t n) {
  constexpr std::uint32_t kExponentMask = 0x7f800000u;
  std::uint32_t non_finite = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    non_finite |= (std::bit_cast<std::uint32_t>(values[i]) & kExponentMask) == kExponentMask;
  }
  return non_finite == 0;
}

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

    pack_keys(p, t, b, h_kv, key_begin, keys, keys_padded);
    pack_values(p, t, b, h_kv, key_begin, keys);

    // Rows [active_begin, active_end) see some key of this block: the others (above the diagonal
    // of a causal block, beside a window) skip it entirely.
    const bool fully_visible = last_row.begin <= key_begin && first_row.end >= key_end;
    std::int64_t active_begin = 0, active_end = rows;
    if (!fully_visible) {
      while (active_begin < rows && p.key_range(row_begin + active_begin).end <= key_begin) {
        ++active_begin;
      }
      while (active_end > active_begin &&
             p.key_range(row_begin + active_end - 1).begin >= key_end) {
        --active_end;
      }
    }
    const std::int64_t active = active_end - active_begin;
    if (active == 0) continue;
    float* scores = t.scores.data() + active_begin * tiles.keys;
    float* acc = t.acc.data() + active_begin * Dp;

    cpu::scores_tile(scores, tiles.keys, t.q.data() + active_begin * Dp, Dp, t.k_packed.data(),
                     active, keys_padded, D, p.scale);

    // Mask: padded keys always, and the keys of a partly visible block outside each row's range.
    for (std::int64_t i = active_begin; i < active_end; ++i) {
      float* s = t.scores.data() + i * tiles.keys;
      std::fill(s + keys, s + keys_padded, kNegativeInfinity);
      if (fully_visible) continue;
      const KeyRange row_keys = p.key_range(row_begin + i);
      for (std::int64_t j = 0; j < keys; ++j) {
        const std::int64_t key = key_begin + j;
        if (key < row_keys.begin || key >= row_keys.end) s[j] = kNegativeInfinity;
      }
    }

    cpu::online_softmax_tile(scores, tiles.keys, t.row_max.data() + active_begin,
                             t.row_sum.data() + active_begin, acc, Dp, active, keys_padded, Dp);

    // A masked key has p = 0 exactly, and 0 · v = 0 for finite v: then the whole tile can go
    // through the blocked kernel with the same result as skipping the masked keys.
    if (fully_visible || all_finite(t.v_packed.data(), keys * Dp)) {
      cpu::accumulate_pv_tile(acc, Dp, scores, tiles.keys, t.v_packed.data(), keys, 0, keys, active,
                              Dp);
    } else {
      // Only each row's visible keys: 0 · inf in a masked value row would leak NaN into a row
      // that never saw it.
      for (std::int64_t i = active_begin; i < active_end; ++i) {
        const KeyRange row_keys = p.key_range(row_begin + i);
        const std::int64_t first = std::clamp(row_keys.begin, key_begin, key_end) - key_begin;
        const std::int64_t last = std::clamp(row_keys.end, key_begin, key_end) - key_begin;
        if (first >= last) continue;
        cpu::accumulate_pv_tile(t.acc.data() + i * Dp, Dp, t.scores.data() + i * tiles.keys,
                                tiles.keys, t.v_packed.data(), keys, first, last, 1, Dp);
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
