// FlashAttention forward on the CPU (seed 000, second half; seed 002).
//
// Work is cut into tasks of (batch, KV head, Q block); a task holds Br rows, Br / g positions of
// each of the g query heads that share the KV head (GQA), so each K/V block is packed once for
// the whole group. One OpenMP loop hands the tasks out.
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
#include <cstring>
#include <limits>
#include <vector>

#include "api/backends.hpp"
#include "cpu/tile_kernels.hpp"
#include "cpu/tile_kernels_bf16.hpp"
#include "cpu/tile_sizes.hpp"
#include "util/convert.hpp"
#include "util/parallel.hpp"

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
  // bf16 operands of the vdpbf16ps products (bf16 inputs on AVX512-BF16 CPUs only).
  std::vector<std::uint16_t> q_bf16, k_bf16, v_bf16, p_bf16;

  Scratch(FlashTiles tiles, std::int64_t D, bool bf16_products)
      : dims_padded(cpu::pad_to_lanes(D)),
        q(bf16_products ? 0 : tiles.rows * dims_padded),
        k_packed(bf16_products ? 0 : D * tiles.keys),
        v_packed(tiles.keys * dims_padded),
        scores(tiles.rows * tiles.keys),
        acc(tiles.rows * dims_padded),
        row_max(tiles.rows),
        row_sum(tiles.rows) {
    if (bf16_products) {
      q_bf16.assign(tiles.rows * dims_padded, 0);
      k_bf16.assign(tiles.keys * dims_padded, 0);
      v_bf16.assign(tiles.keys * dims_padded, 0);
      p_bf16.assign(tiles.rows * tiles.keys, 0);
    }
  }
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

// bf16 inputs for the vdpbf16ps kernels: bit patterns copied, no rounding. Kᵀ goes into
// panels of 64 keys, each d-pair of a key as one 32-bit word (cpu::bf16_key_index).
void pack_keys_bf16(const AttentionParams& p, Scratch& t, std::int64_t b, std::int64_t h_kv,
                    std::int64_t key_begin, std::int64_t keys, std::int64_t keys_padded) {
  const std::int64_t D = p.head_dim, pairs = t.dims_padded / 2;
  const auto* k = static_cast<const std::uint16_t*>(p.k);
  auto* words = reinterpret_cast<std::uint32_t*>(t.k_bf16.data());
  for (std::int64_t panel = 0; panel < keys_padded; panel += cpu::kPanelWidth) {
    const std::int64_t width = std::min(cpu::kPanelWidth, keys_padded - panel);
    std::uint32_t* panel_words = words + panel * pairs;
    for (std::int64_t j = panel; j < panel + width; ++j) {
      std::uint16_t row[2] = {0, 0};
      const std::uint16_t* src =
          j < keys ? k + p.k_strides.offset(b, key_begin + j, h_kv) : nullptr;
      for (std::int64_t m = 0; m < pairs; ++m) {
        row[0] = src && 2 * m < D ? src[2 * m] : 0;
        row[1] = src && 2 * m + 1 < D ? src[2 * m + 1] : 0;
        std::memcpy(panel_words + m * width + (j - panel), row, sizeof(row));
      }
    }
  }
}

// V into panels of 64 dims, the same dim of two consecutive keys as one 32-bit word
// (cpu::bf16_value_index); an odd last key is paired with zeros.
void pack_values_bf16(const AttentionParams& p, Scratch& t, std::int64_t b, std::int64_t h_kv,
                      std::int64_t key_begin, std::int64_t keys, std::int64_t keys_even) {
  const std::int64_t D = p.head_dim, Dp = t.dims_padded;
  const auto* v = static_cast<const std::uint16_t*>(p.v);
  for (std::int64_t pair = 0; pair < keys_even / 2; ++pair) {
    const std::int64_t j = 2 * pair;
    const std::uint16_t* first = v + p.v_strides.offset(b, key_begin + j, h_kv);
    const std::uint16_t* second =
        j + 1 < keys ? v + p.v_strides.offset(b, key_begin + j + 1, h_kv) : nullptr;
    for (std::int64_t panel = 0; panel < Dp; panel += cpu::kPanelWidth) {
      const std::int64_t width = std::min(cpu::kPanelWidth, Dp - panel);
      std::uint16_t* dst = t.v_bf16.data() + panel * keys_even + pair * width * 2;
      for (std::int64_t d = 0; d < width; ++d) {
        const bool inside = panel + d < D;
        dst[2 * d] = inside ? first[panel + d] : 0;
        dst[2 * d + 1] = inside && second ? second[panel + d] : 0;
      }
    }
  }
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

bool all_finite_bf16(const std::uint16_t* values, std::int64_t n) {
  constexpr std::uint16_t kExponentMask = 0x7f80u;
  std::uint32_t non_finite = 0;
  for (std::int64_t i = 0; i < n; ++i) non_finite |= (values[i] & kExponentMask) == kExponentMask;
  return non_finite == 0;
}

// The rows of one task: `positions` query positions from `position_begin`, for each of the
// `heads` query heads that read KV head `h_kv` (the GQA group). Tile row i is query head
// first_head + i / positions at position position_begin + i % positions, so every packed K/V
// block serves the whole group.
struct TaskRows {
  std::int64_t b, h_kv, first_head, heads, position_begin, positions;

  std::int64_t count() const { return heads * positions; }
  std::int64_t head(std::int64_t row) const { return first_head + row / positions; }
  std::int64_t position(std::int64_t row) const { return position_begin + row % positions; }
};

void flash_task(const AttentionParams& p, FlashTiles tiles, bool bf16_products, Scratch& t,
                const TaskRows& task) {
  const std::int64_t D = p.head_dim, Dp = t.dims_padded, rows = task.count(), b = task.b;
  const std::int64_t ld_scores = tiles.keys;

  // Prologue: load the Q rows, reset the running statistics.
  for (std::int64_t i = 0; i < rows; ++i) {
    const std::int64_t offset = p.q_strides.offset(b, task.position(i), task.head(i));
    if (bf16_products) {
      std::copy_n(static_cast<const std::uint16_t*>(p.q) + offset, D, t.q_bf16.data() + i * Dp);
    } else {
      load_row_f32(t.q.data() + i * Dp, p.q, p.dtype, offset, D);
    }
  }
  std::fill_n(t.acc.begin(), rows * Dp, 0.0f);
  std::fill_n(t.row_max.begin(), rows, kNegativeInfinity);
  std::fill_n(t.row_sum.begin(), rows, 0.0f);

  // Every key some position of the task can see; the ranges are monotone in the position.
  const std::int64_t last_position = task.position_begin + task.positions - 1;
  const KeyRange first_row = p.key_range(task.position_begin),
                 last_row = p.key_range(last_position);
  const KeyRange task_keys = p.key_range(task.position_begin, last_position + 1);

  for (std::int64_t key_begin = task_keys.begin; key_begin < task_keys.end;
       key_begin += tiles.keys) {
    const std::int64_t key_end = std::min(key_begin + tiles.keys, task_keys.end);
    const std::int64_t keys = key_end - key_begin, keys_padded = cpu::pad_to_lanes(keys);

    const std::int64_t keys_even = keys + keys % 2;
    const bool fully_visible = last_row.begin <= key_begin && first_row.end >= key_end;
    bool blocked_pv = true;
    if (bf16_products) {
      pack_keys_bf16(p, t, b, task.h_kv, key_begin, keys, keys_padded);
      pack_values_bf16(p, t, b, task.h_kv, key_begin, keys, keys_even);
    } else {
      pack_keys(p, t, b, task.h_kv, key_begin, keys, keys_padded);
      pack_values(p, t, b, task.h_kv, key_begin, keys);
    }
    // A masked key has p = 0 exactly, and 0 · v = 0 for finite v: then masked rows can go
    // through the blocked P·V kernel with the same result as skipping the masked keys. Otherwise
    // the fp32 kernel takes each row's visible keys on their own.
    if (!fully_visible) {
      blocked_pv = bf16_products ? all_finite_bf16(t.v_bf16.data(), keys_even * Dp)
                                 : all_finite(t.v_packed.data(), keys * Dp);
      if (!blocked_pv && bf16_products) pack_values(p, t, b, task.h_kv, key_begin, keys);
    }

    // Tile rows [row_lo, row_hi): S = scale·Q·Kᵀ, mask, online softmax, acc += P·V.
    auto process_rows = [&](std::int64_t row_lo, std::int64_t row_hi) {
      float* scores = t.scores.data() + row_lo * ld_scores;
      float* acc = t.acc.data() + row_lo * Dp;
      if (bf16_products) {
        cpu::scores_tile_bf16(scores, ld_scores, t.q_bf16.data() + row_lo * Dp, Dp, t.k_bf16.data(),
                              row_hi - row_lo, keys_padded, Dp, p.scale);
      } else {
        cpu::scores_tile(scores, ld_scores, t.q.data() + row_lo * Dp, Dp, t.k_packed.data(),
                         row_hi - row_lo, keys_padded, D, p.scale);
      }
      for (std::int64_t i = row_lo; i < row_hi; ++i) {
        float* s = t.scores.data() + i * ld_scores;
        std::fill(s + keys, s + keys_padded, kNegativeInfinity);
        if (fully_visible) continue;
        const KeyRange row_keys = p.key_range(task.position(i));
        for (std::int64_t j = 0; j < keys; ++j) {
          const std::int64_t key = key_begin + j;
          if (key < row_keys.begin || key >= row_keys.end) s[j] = kNegativeInfinity;
        }
      }
      cpu::online_softmax_tile(scores, ld_scores, t.row_max.data() + row_lo,
                               t.row_sum.data() + row_lo, acc, Dp, row_hi - row_lo, keys_padded,
                               Dp);
      if (blocked_pv && bf16_products) {
        // P is rounded to bf16 only as the operand of P·V (DESIGN.md §2, precision).
        std::uint16_t* p_bf16 = t.p_bf16.data() + row_lo * ld_scores;
        cpu::round_probabilities_bf16(p_bf16, ld_scores, scores, ld_scores, row_hi - row_lo,
                                      keys_padded);
        cpu::accumulate_pv_tile_bf16(acc, Dp, p_bf16, ld_scores, t.v_bf16.data(), keys_even,
                                     row_hi - row_lo, Dp);
        return;
      }
      if (blocked_pv) {
        cpu::accumulate_pv_tile(acc, Dp, scores, ld_scores, t.v_packed.data(), keys, 0, keys,
                                row_hi - row_lo, Dp);
        return;
      }
      // Only each row's visible keys: 0 · inf in a masked value row would leak NaN into a row
      // that never saw it.
      for (std::int64_t i = row_lo; i < row_hi; ++i) {
        const KeyRange row_keys = p.key_range(task.position(i));
        const std::int64_t first = std::clamp(row_keys.begin, key_begin, key_end) - key_begin;
        const std::int64_t last = std::clamp(row_keys.end, key_begin, key_end) - key_begin;
        if (first >= last) continue;
        cpu::accumulate_pv_tile(t.acc.data() + i * Dp, Dp, t.scores.data() + i * ld_scores,
                                ld_scores, t.v_packed.data(), keys, first, last, 1, Dp);
      }
    };

    if (fully_visible) {
      process_rows(0, rows);
      continue;
    }
    // A partly visible block, head by head: only the positions that see some key of the block
    // (below the diagonal of a causal block, inside a window) compute it.
    for (std::int64_t head = 0; head < task.heads; ++head) {
      std::int64_t row_lo = head * task.positions, row_hi = row_lo + task.positions;
      while (row_lo < row_hi && p.key_range(task.position(row_lo)).end <= key_begin) ++row_lo;
      while (row_hi > row_lo && p.key_range(task.position(row_hi - 1)).begin >= key_end) --row_hi;
      if (row_lo < row_hi) process_rows(row_lo, row_hi);
    }
  }

  // Epilogue: out = acc / l, lse = m + log(l); rows whose key range is empty get 0 and -inf.
  // A row that sees keys whose scores are all -inf (an infinite input) has l = 0 and gets
  // 0/0 = NaN, as the reference does.
  for (std::int64_t i = 0; i < rows; ++i) {
    float* acc_row = t.acc.data() + i * Dp;
    const float sum = t.row_sum[i];
    const bool no_key_seen = p.key_range(task.position(i)).empty();
    const float inverse_sum = no_key_seen ? 0.0f : 1.0f / sum;
    for (std::int64_t d = 0; d < D; ++d) acc_row[d] *= inverse_sum;
    store_row_f32(p.out, p.dtype, p.out_strides.offset(b, task.position(i), task.head(i)), acc_row,
                  D);
    if (p.lse) {
      const float max = t.row_max[i] == kNegativeInfinity ? 0.0f : t.row_max[i];
      p.lse[p.lse_index(b, task.head(i), task.position(i))] =
          no_key_seen ? kNegativeInfinity : max + std::log(sum);
    }
  }
}

}  // namespace

void flash_forward(const AttentionParams& p) {
  const FlashTiles tiles = flash_tiles(p.head_dim);
  // A task holds Br rows: Br / group positions of each query head of a GQA group.
  const std::int64_t group = p.group_size();
  const std::int64_t positions = std::max<std::int64_t>(1, tiles.rows / group);
  const FlashTiles scratch_tiles{group * positions, tiles.keys};
  const std::int64_t q_blocks = (p.seqlen_q + positions - 1) / positions;
  const std::int64_t tasks = p.batch * p.heads_kv * q_blocks;

  const bool bf16_products = p.dtype == DType::bf16 && cpu::bf16_products_enabled();

  // Dynamic schedule, last Q block first: under a causal mask the last blocks see the most
  // keys, so the long tasks start early and the short ones fill the gaps at the end.
  parallel_tasks(
      p.num_threads, tasks, [&] { return Scratch(scratch_tiles, p.head_dim, bf16_products); },
      [&](Scratch& scratch, std::int64_t index) {
        const std::int64_t q_block = q_blocks - 1 - index % q_blocks;
        const std::int64_t kv_head = index / q_blocks;
        const std::int64_t b = kv_head / p.heads_kv, h_kv = kv_head % p.heads_kv;
        const std::int64_t position_begin = q_block * positions;
        const TaskRows task{
            b,     h_kv,           h_kv * group,
            group, position_begin, std::min(positions, p.seqlen_q - position_begin)};
        flash_task(p, scratch_tiles, bf16_products, scratch, task);
      });
}

}  // namespace flashattn::detail
