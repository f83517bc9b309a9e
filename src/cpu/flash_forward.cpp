// FlashAttention forward on the CPU (seed 000, second half; seed 002).
//
// A Q block holds Br rows: Br / g positions of each of the g query heads that share a KV head
// (GQA), so each K/V block is packed once for the whole group. A task is up to n consecutive Q
// blocks of one (batch, KV head), n = 4 to 8 (tile_sizes.cpp says how many), and one OpenMP loop
// hands the tasks out. A task walks the K/V blocks of Bc keys that its rows can see, packs each
// once, and every Q block that sees some of it computes
//   S = Q_blk · K_blkᵀ                             [Br x Bc]   scores_tile
//   Z = softcap, ALiBi of scale·S (when asked for) [Br x Bc]    modify_scores
//   mask Z where the block is only partly visible  [Br x Bc]
//   online softmax of Z: m, l, rescale acc         [Br], [Br x Dv]  online_softmax_tile
//   P ∘= dropout mask · 1/(1 − p) (when asked for) [Br x Bc]    apply_dropout
//   acc += P · V_blk                               [Br x Dv]   accumulate_pv_tile
// and finally out = acc / l, lse = m + log(l) (with each head's sink in l when there are sinks).
// Blocks that the causal mask or the window hide from every row of a Q block are never visited by
// it. bf16 inputs multiply as bf16 on AMX tiles or with vdpbf16ps where the CPU has them
// (cpu::active_bf16_products), P rounded to bf16 for P·V; every other input is widened to fp32 when
// packed.
//
// A call of few Q blocks against many keys (a handful of rows per KV head too many for the
// decode path: MLA's absorbed decode, 128 query heads on one KV head) would leave threads idle:
// its keys are then cut into chunks (cpu::flash_forward_key_chunks, from the shape alone), each
// (task, chunk) keeps its own m, l and acc, and a last pass merges each row's chunks in chunk
// order, as the decode path does:
//   m = max_c m_c,  l = Σ_c l_c·w_c,  out = Σ_c acc_c·w_c / l,  w_c = exp(scale·(m_c − m)).
//
// Memory: per thread, for each Q block of a task Q and acc (Br·(D + Dv) floats) and m, l (2·Br);
// once Kᵀ (D·Bc), V (Bc·Dv), S (Br·Bc): 1.3 MiB at D = Dv = 128 with Br = 256, Bc = 128 and 4
// blocks (tile_sizes.cpp says why those sizes), whatever the sequence lengths; with key chunks,
// (Dv + 2) floats per query row and chunk besides. Every byte of K and V is read and packed once
// per task, so K/V traffic is Skv·(D + Dv)·4 · ceil(Sq / (n·Br)) bytes per head instead of the
// standard path's 3 passes over a 4·Sq·Skv-byte score matrix.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "api/backends.hpp"
#include "cpu/flash_decode.hpp"
#include "cpu/kernels/bf16_products.hpp"
#include "cpu/kernels/dropout.hpp"
#include "cpu/kernels/pack.hpp"
#include "cpu/kernels/score_modifiers.hpp"
#include "cpu/kernels/tile_kernels.hpp"
#include "cpu/kernels/tile_kernels_amx.hpp"
#include "cpu/kernels/tile_kernels_bf16.hpp"
#include "cpu/tile_sizes.hpp"
#include "util/aligned_vector.hpp"
#include "util/convert.hpp"
#include "util/dropout.hpp"
#include "util/parallel.hpp"

namespace flashattn::detail {

namespace {

constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

// The rows of a partly visible K/V block go in chunks of this many, each computing only the keys
// from the first one its first row sees to the last one its last row sees: under a causal mask a
// diagonal block's rows see ever more of its keys, in a sliding window both ends move. Two row
// blocks of the product kernels: smaller chunks skip more scores but pay for more calls
// (docs/tuning.md).
constexpr std::int64_t kDiagonalChunkRows = 12;
// Score rows made logits and masked just before their online softmax: 8 rows of Bc = 128 keys
// are 4 KiB, in L1 between the two passes; a whole tile of 256 rows (128 KiB) is not.
constexpr std::int64_t kSoftmaxGroupRows = 8;

// Per-thread tiles. Row widths are padded to whole vectors (cpu::pad_to_lanes) with zeros, so
// the kernels never handle a ragged edge: padded keys get score -inf, padded dims stay 0. Q and K
// rows have head_dim (padded: dims_padded), V rows and the accumulator head_dim_v
// (value_dims_padded).
struct Scratch {
  cpu::Bf16Products products;  // widened unless the inputs are bf16
  std::int64_t dims_padded, value_dims_padded;
  // bf16 products: the reductions of Q·Kᵀ (dims) and P·V (keys) zero-padded to a whole AMX tile
  // row, the row widths of Q, P and the packed K and V (tile_kernels_amx.hpp).
  std::int64_t bf16_dims, bf16_keys;
  AlignedVector<float> q, k_packed, v_packed, scores, acc, row_max, row_sum;
  // bf16 operands of the vdpbf16ps or AMX products (bf16 inputs only). The fp32 tiles above
  // then serve the tiles whose bf16 inputs hold a subnormal (cpu::copy_row_bf16).
  AlignedVector<std::uint16_t> q_bf16, k_bf16, v_bf16, p_bf16;

  // Q, acc, row_max and row_sum hold tiles.blocks_per_task blocks of tiles.rows rows.
  Scratch(cpu::TileSizes tiles, std::int64_t D, std::int64_t Dv, cpu::Bf16Products bf16_products)
      : products(bf16_products),
        dims_padded(cpu::pad_to_lanes(D)),
        value_dims_padded(cpu::pad_to_lanes(Dv)),
        bf16_dims(cpu::pad_to_amx_reduction(D)),
        bf16_keys(cpu::pad_to_amx_reduction(tiles.keys)),
        q(tiles.blocks_per_task * tiles.rows * dims_padded),
        k_packed(D * tiles.keys),
        v_packed(tiles.keys * value_dims_padded),
        scores(tiles.rows * tiles.keys),
        acc(tiles.blocks_per_task * tiles.rows * value_dims_padded),
        row_max(tiles.blocks_per_task * tiles.rows),
        row_sum(tiles.blocks_per_task * tiles.rows) {
    if (bf16_operands()) {
      q_bf16.assign(tiles.blocks_per_task * tiles.rows * bf16_dims, 0);
      k_bf16.assign(tiles.keys * bf16_dims, 0);
      v_bf16.assign(bf16_keys * value_dims_padded, 0);
      p_bf16.assign(tiles.rows * bf16_keys, 0);
    }
  }

  // Whether Q, K, V and P are bf16 operands of bf16 products rather than fp32 tiles.
  bool bf16_operands() const { return products != cpu::Bf16Products::widened; }
};

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

// One Q block's tiles inside the task's scratch: its rows, Q, accumulator and running statistics.
struct QueryBlock {
  TaskRows rows;
  float* q;
  std::uint16_t* q_bf16;
  bool bf16_exact;  // whether q_bf16 holds no subnormal
  bool fp32_rows;   // whether q holds the rows (always for widened products; else on demand)
  float* acc;
  float* row_max;
  float* row_sum;
};

// The Q block's rows into block.q as fp32.
void load_fp32_rows(const AttentionParams& p, const Scratch& t, QueryBlock& block) {
  const TaskRows& task = block.rows;
  for (std::int64_t i = 0; i < task.count(); ++i) {
    load_row_f32(block.q + i * t.dims_padded, p.q, p.dtype,
                 p.q_strides.offset(task.b, task.position(i), task.head(i)), p.head_dim);
  }
  block.fp32_rows = true;
}

// Prologue of one Q block: load its Q rows, reset the running statistics.
void start_block(const AttentionParams& p, const Scratch& t, QueryBlock& block) {
  const TaskRows& task = block.rows;
  const std::int64_t rows = task.count();
  for (std::int64_t i = 0; i < rows; ++i) {
    if (i + kRowsAhead < rows) {
      const std::int64_t ahead = i + kRowsAhead;
      prefetch_row(p.q, p.dtype, p.q_strides.offset(task.b, task.position(ahead), task.head(ahead)),
                   p.head_dim);
    }
    const std::int64_t offset = p.q_strides.offset(task.b, task.position(i), task.head(i));
    if (t.bf16_operands()) {
      block.bf16_exact &=
          !cpu::copy_row_bf16(block.q_bf16 + i * t.bf16_dims,
                              static_cast<const std::uint16_t*>(p.q) + offset, p.head_dim);
    } else {
      load_row_f32(block.q + i * t.dims_padded, p.q, p.dtype, offset, p.head_dim);
    }
  }
  block.fp32_rows = !t.bf16_operands();
  std::fill_n(block.acc, rows * t.value_dims_padded, 0.0f);
  std::fill_n(block.row_max, rows, kNegativeInfinity);
  std::fill_n(block.row_sum, rows, 0.0f);
}

// Epilogue of one Q block: out = acc / l, lse = scale·m + log(l), the sink in l when there are
// sinks (cpu::normalize_row); rows whose key range is empty get 0 and -inf (the sink). A row that
// sees keys whose scores are all -inf (an infinite input) has l = 0 and gets 0/0 = NaN, as the
// reference does.
void finish_block(const AttentionParams& p, std::int64_t Dvp, bool stream_out,
                  const QueryBlock& block) {
  const TaskRows& task = block.rows;
  for (std::int64_t i = 0; i < task.count(); ++i) {
    if (i + kRowsAhead < task.count()) {
      const std::int64_t ahead = i + kRowsAhead;
      prefetch_store_row(p.out, p.dtype,
                         p.out_strides.offset(task.b, task.position(ahead), task.head(ahead)),
                         p.head_dim_v, stream_out);
    }
    float* acc_row = block.acc + i * Dvp;
    const float row_max = block.row_max[i] == kNegativeInfinity ? kNegativeInfinity
                                                                : p.tile_scale() * block.row_max[i];
    const cpu::RowNormalizer normalizer =
        cpu::normalize_row(row_max, block.row_sum[i],
                           cpu::no_key_seen(p, task.b, task.head(i), task.position(i), row_max),
                           cpu::sink_logit(p, task.head(i)));
    for (std::int64_t d = 0; d < p.head_dim_v; ++d) {
      acc_row[d] = normalizer.empty ? 0.0f : acc_row[d] * normalizer.inverse_sum;
    }
    store_row_f32(p.out, p.dtype, p.out_strides.offset(task.b, task.position(i), task.head(i)),
                  acc_row, p.head_dim_v, stream_out);
    if (p.lse) p.lse[p.lse_index(task.b, task.head(i), task.position(i))] = normalizer.lse;
  }
}

// Key chunks (split-K): each chunk's m, l and unnormalized acc of every query row of the call,
// row ((b·Hq + h)·Sq + position) of chunk c at slot c·rows + row.
struct ChunkResults {
  std::int64_t chunks = 1, rows = 0, value_dims_padded = 0;
  UninitializedAlignedVector<float> max, sum, acc;  // acc: value_dims_padded floats per slot

  std::int64_t slot(std::int64_t chunk, const AttentionParams& p, std::int64_t b, std::int64_t h,
                    std::int64_t position) const {
    return chunk * rows + (b * p.heads_q + h) * p.seqlen_q + position;
  }
};

// Epilogue of one Q block of a key chunk: its rows' m, l and acc, as they are, into `results`.
void store_partial_block(const AttentionParams& p, const Scratch& t, const QueryBlock& block,
                         std::int64_t chunk, ChunkResults& results) {
  const TaskRows& task = block.rows;
  for (std::int64_t i = 0; i < task.count(); ++i) {
    const std::int64_t slot = results.slot(chunk, p, task.b, task.head(i), task.position(i));
    results.max[slot] = block.row_max[i];
    results.sum[slot] = block.row_sum[i];
    std::copy_n(block.acc + i * t.value_dims_padded, p.head_dim_v,
                results.acc.data() + slot * results.value_dims_padded);
  }
}

// Every row's chunks merged into out and lse, as finish_block would have from one pass. A NaN
// chunk max (a NaN score) is passed over by the max; its NaN weight makes the row NaN.
void merge_key_chunks(const AttentionParams& p, const ChunkResults& results) {
  const std::int64_t Dv = p.head_dim_v, Dvp = results.value_dims_padded;
  parallel_tasks(
      p.num_threads, results.rows,
      [&] { return std::vector<float>(static_cast<std::size_t>(Dvp)); },
      [&](std::vector<float>& out_row, std::int64_t row) {
        const std::int64_t position = row % p.seqlen_q, h = row / p.seqlen_q % p.heads_q;
        const std::int64_t b = row / p.seqlen_q / p.heads_q;
        float max = kNegativeInfinity;
        for (std::int64_t c = 0; c < results.chunks; ++c) {
          max =
              results.max[c * results.rows + row] > max ? results.max[c * results.rows + row] : max;
        }
        float sum = 0.0f;
        std::fill(out_row.begin(), out_row.end(), 0.0f);
        for (std::int64_t c = 0; c < results.chunks; ++c) {
          const std::int64_t slot = c * results.rows + row;
          const float chunk_max = results.max[slot];
          const float weight =
              chunk_max == max ? 1.0f : std::exp(p.tile_scale() * (chunk_max - max));
          sum += results.sum[slot] * weight;
          const float* acc = results.acc.data() + slot * Dvp;
          for (std::int64_t d = 0; d < Dv; ++d) out_row[d] += weight * acc[d];
        }
        const float row_max = max == kNegativeInfinity ? kNegativeInfinity : p.tile_scale() * max;
        const cpu::RowNormalizer normalizer = cpu::normalize_row(
            row_max, sum, cpu::no_key_seen(p, b, h, position, row_max), cpu::sink_logit(p, h));
        for (std::int64_t d = 0; d < Dv; ++d) {
          out_row[d] = normalizer.empty ? 0.0f : out_row[d] * normalizer.inverse_sum;
        }
        store_row_f32(p.out, p.dtype, p.out_strides.offset(b, position, h), out_row.data(), Dv);
        if (p.lse) p.lse[p.lse_index(b, h, position)] = normalizer.lse;
      });
}

// The keys [key_begin, key_end) some row of the block can see; the ranges are monotone in the
// position.
KeyRange block_keys(const AttentionParams& p, const TaskRows& task) {
  return p.key_range(task.position_begin, task.position_begin + task.positions);
}

// Whether every row of the block sees every key of [key_begin, key_end): then nothing is masked.
bool sees_all_keys(const AttentionParams& p, const TaskRows& task, std::int64_t key_begin,
                   std::int64_t key_end) {
  return p.key_range(task.position_begin + task.positions - 1).begin <= key_begin &&
         p.key_range(task.position_begin).end >= key_end;
}

// Whether the bias and mask leave some key of [key_begin, key_end) unmasked for some row of the
// block: a block they mask entirely is not visited (true without them).
bool logits_keep_some(const AttentionParams& p, const TaskRows& task, std::int64_t key_begin,
                      std::int64_t key_end) {
  for (std::int64_t head = task.first_head; head < task.first_head + task.heads; ++head) {
    if (cpu::logits_keep_some(p, task.b, head, task.position_begin,
                              task.position_begin + task.positions, key_begin, key_end)) {
      return true;
    }
  }
  return false;
}

// The packed K/V block [key_begin, key_begin + keys) that a task's Q blocks read in turn.
struct KeyBlock {
  std::int64_t begin, end, keys_padded;
  std::int64_t bf16_reduction;  // bf16 products: keys zero-padded to a whole AMX tile row
  bool bf16_exact;              // whether the bf16 K and V hold no subnormal
  bool blocked_pv;  // whether masked rows may go through the blocked P·V kernel (see below)
};

// One Q block against one packed K/V block:
//   S = Q·Kᵀ, score modifiers, mask, online softmax, acc += P·V
void visit_key_block(const AttentionParams& p, cpu::TileSizes tiles, Scratch& t,
                     const QueryBlock& block, const KeyBlock& kv) {
  const TaskRows& task = block.rows;
  const std::int64_t Dp = t.dims_padded, Dvp = t.value_dims_padded, ld_scores = tiles.keys;
  const std::int64_t keys = kv.end - kv.begin, keys_padded = kv.keys_padded;
  const bool fully_visible = sees_all_keys(p, task, kv.begin, kv.end);
  const cpu::Bf16Products products =
      block.bf16_exact && kv.bf16_exact ? t.products : cpu::Bf16Products::widened;

  // Tile rows [row_lo, row_hi) against the block's keys [key_begin, key_end), which hold every
  // key those rows see (key_begin a multiple of kTileLanes); the scores tile's row i holds the
  // block's row row_lo + i, its columns the block's keys.
  auto process_rows = [&](std::int64_t row_lo, std::int64_t row_hi, std::int64_t key_begin,
                          std::int64_t key_end) {
    const std::int64_t rows = row_hi - row_lo;
    const std::int64_t key_end_padded = cpu::pad_to_lanes(key_end);
    float* scores = t.scores.data();
    float* acc = block.acc + row_lo * Dvp;
    // A bias's rows lie a whole row of keys apart, out of the prefetchers' reach: asked for
    // now, they arrive while the product below runs.
    const LogitView& bias = p.modifiers.bias;
    if (bias.data != nullptr && bias.key == 1) {
      for (std::int64_t i = row_lo; i < row_hi; ++i) {
        prefetch_row(bias.data, bias.dtype,
                     bias.offset(task.b, task.head(i), task.position(i), kv.begin + key_begin),
                     key_end - key_begin);
      }
    }
    if (products != cpu::Bf16Products::widened) {
      cpu::bf16_tile_product(products, scores, ld_scores, false,
                             block.q_bf16 + row_lo * t.bf16_dims, t.bf16_dims, t.k_bf16.data(),
                             rows, keys_padded, t.bf16_dims);
    } else {
      cpu::scores_tile_columns(scores, ld_scores, {block.q + row_lo * Dp, Dp}, t.k_packed.data(),
                               rows, keys_padded, p.head_dim, key_begin, key_end_padded);
    }
    // Row groups of kSoftmaxGroupRows: each group's scores become logits, masked, while they
    // are in L1, then the group's online softmax runs.
    for (std::int64_t group = 0; group < rows; group += kSoftmaxGroupRows) {
      const std::int64_t group_end = std::min(group + kSoftmaxGroupRows, rows);
      for (std::int64_t i = group; i < group_end; ++i) {
        float* s = scores + i * ld_scores;
        const std::int64_t row = row_lo + i;
        if (p.modifiers.change_logits()) {
          cpu::modify_scores(s + key_begin, nullptr, key_end - key_begin, p.scale,
                             cpu::row_modifiers(p, task.b, task.head(row), task.position(row),
                                                kv.begin + key_begin, p.seqlen_kv));
        }
        std::fill(s + key_end, s + key_end_padded, kNegativeInfinity);
        if (fully_visible) continue;
        mask_invisible(s + key_begin, p.key_range(task.position(row)), kv.begin + key_begin,
                       key_end - key_begin);
      }
      cpu::online_softmax_tile(scores + group * ld_scores + key_begin, ld_scores, p.tile_scale(),
                               block.row_max + row_lo + group, block.row_sum + row_lo + group,
                               acc + group * Dvp, Dvp, group_end - group,
                               key_end_padded - key_begin, Dvp);
      if (!p.dropout.on()) continue;
      // Dropout after the row sums took P: it changes what P·V adds, not the softmax.
      cpu::DropoutRow rows_of_group[kSoftmaxGroupRows];
      for (std::int64_t i = group; i < group_end; ++i) {
        const std::int64_t row = row_lo + i;
        rows_of_group[i - group] = {&p.dropout, dropout_stream(p, task.b, task.head(row)),
                                    static_cast<std::uint32_t>(task.position(row))};
      }
      cpu::apply_dropout_rows(scores + group * ld_scores + key_begin, ld_scores, rows_of_group,
                              group_end - group, kv.begin + key_begin, key_end - key_begin);
    }
    if (kv.blocked_pv && products != cpu::Bf16Products::widened) {
      // P is rounded to bf16 only as the operand of P·V (docs/design.md, "The contract",
      // precision).
      cpu::round_probabilities_bf16(t.p_bf16.data(), t.bf16_keys, scores, ld_scores, rows,
                                    keys_padded, kv.bf16_reduction);
      cpu::bf16_tile_product(products, acc, Dvp, true, t.p_bf16.data(), t.bf16_keys,
                             t.v_bf16.data(), rows, Dvp, kv.bf16_reduction);
      return;
    }
    if (kv.blocked_pv) {
      cpu::accumulate_pv_tile(acc, Dvp, scores, ld_scores, t.v_packed.data(), keys, key_begin,
                              key_end, rows, Dvp);
      return;
    }
    // Only each row's visible keys: 0 · inf in a masked value row would leak NaN into a row
    // that never saw it.
    for (std::int64_t i = 0; i < rows; ++i) {
      const std::int64_t row = row_lo + i;
      const KeyRange row_keys = p.key_range(task.position(row));
      cpu::for_each_kept_run(p, task.b, task.head(row), task.position(row),
                             std::clamp(row_keys.begin, kv.begin, kv.end),
                             std::clamp(row_keys.end, kv.begin, kv.end),
                             [&](std::int64_t first, std::int64_t last) {
                               cpu::accumulate_pv_tile(acc + i * Dvp, Dvp, scores + i * ld_scores,
                                                       ld_scores, t.v_packed.data(), keys,
                                                       first - kv.begin, last - kv.begin, 1, Dvp);
                             });
    }
  };

  if (fully_visible) {
    process_rows(0, task.count(), 0, keys);
    return;
  }
  // A partly visible block, head by head: only the positions that see some key of the block
  // (below the diagonal of a causal block, inside a window) compute it, in chunks of
  // kDiagonalChunkRows rows that each compute only the keys their rows see: from the first key
  // their first row sees (rounded down to whole vectors) to the last their last row sees (fp32
  // products; the bf16 products' tiles take whole blocks of keys).
  const bool whole_keys = products != cpu::Bf16Products::widened;
  const std::int64_t chunk_rows = whole_keys ? task.positions : kDiagonalChunkRows;
  for (std::int64_t head = 0; head < task.heads; ++head) {
    std::int64_t row_lo = head * task.positions, row_hi = row_lo + task.positions;
    while (row_lo < row_hi && p.key_range(task.position(row_lo)).end <= kv.begin) ++row_lo;
    while (row_hi > row_lo && p.key_range(task.position(row_hi - 1)).begin >= kv.end) --row_hi;
    for (std::int64_t lo = row_lo; lo < row_hi; lo += chunk_rows) {
      const std::int64_t hi = std::min(lo + chunk_rows, row_hi);
      if (whole_keys) {
        process_rows(lo, hi, 0, keys);
        continue;
      }
      const std::int64_t first_key = std::max(p.key_range(task.position(lo)).begin, kv.begin);
      const std::int64_t last_key = std::min(p.key_range(task.position(hi - 1)).end, kv.end);
      process_rows(lo, hi, (first_key - kv.begin) / cpu::kTileLanes * cpu::kTileLanes,
                   last_key - kv.begin);
    }
  }
}

// A task: consecutive Q blocks of one (batch, KV head) against the keys of `chunk` (all of them
// without key chunks). Each K/V block is packed once and then visited by every Q block of the
// task that sees some of it. With key chunks the blocks' m, l and acc go to `partial`.
void flash_task(const AttentionParams& p, cpu::TileSizes tiles, bool stream_out, Scratch& t,
                std::vector<QueryBlock>& blocks, KeyRange chunk, std::int64_t chunk_index,
                ChunkResults* partial) {
  const std::int64_t Dvp = t.value_dims_padded, b = blocks.front().rows.b;
  const std::int64_t h_kv = blocks.front().rows.h_kv;
  for (QueryBlock& block : blocks) start_block(p, t, block);

  // K/V blocks are the keys [n·Bc, (n + 1)·Bc) whatever Q blocks share a task, so every row
  // sees the same blocks, and the same result, however the Q blocks are grouped (the keys of a
  // block that no row of the task sees are masked); key chunks are whole blocks.
  const KeyRange task_keys{std::max(block_keys(p, blocks.front().rows).begin, chunk.begin),
                           std::min(block_keys(p, blocks.back().rows).end, chunk.end)};
  std::vector<QueryBlock*> visitors;
  visitors.reserve(blocks.size());
  for (std::int64_t key_begin = task_keys.begin / tiles.keys * tiles.keys;
       key_begin < task_keys.end; key_begin += tiles.keys) {
    KeyBlock kv{key_begin, std::min(key_begin + tiles.keys, p.seqlen_kv), 0, 0, true, true};
    visitors.clear();
    // With a bias or mask, keys inside the causal range may be masked: P·V then checks its values.
    bool all_visible = !p.modifiers.masks_logits();
    for (QueryBlock& block : blocks) {
      const KeyRange seen = block_keys(p, block.rows);
      if (seen.begin >= kv.end || seen.end <= kv.begin) continue;
      if (!logits_keep_some(p, block.rows, kv.begin, kv.end)) continue;
      visitors.push_back(&block);
      all_visible = all_visible && sees_all_keys(p, block.rows, kv.begin, kv.end);
    }
    if (visitors.empty()) continue;

    const std::int64_t keys = kv.end - kv.begin;
    kv.keys_padded = cpu::pad_to_lanes(keys);
    kv.bf16_reduction = cpu::pad_to_amx_reduction(keys);
    // fp32 products for every visitor with widened inputs, and for the pairs of a Q block and
    // this block where either holds a bf16 subnormal.
    bool fp32_products = !t.bf16_operands();
    if (t.bf16_operands()) {
      const bool subnormal_keys =
          cpu::pack_rows_transposed_bf16(t.k_bf16.data(), p.k, p.k_strides, b, h_kv, key_begin,
                                         keys, kv.keys_padded, p.head_dim, t.bf16_dims);
      const bool subnormal_values =
          cpu::pack_row_pairs_bf16(t.v_bf16.data(), p.v, p.v_strides, b, h_kv, key_begin, keys,
                                   kv.bf16_reduction, p.head_dim_v, Dvp);
      kv.bf16_exact = !subnormal_keys && !subnormal_values;
      for (const QueryBlock* block : visitors) {
        fp32_products = fp32_products || !(block->bf16_exact && kv.bf16_exact);
      }
    }
    if (fp32_products) {
      for (QueryBlock* block : visitors) {
        if (!block->fp32_rows) load_fp32_rows(p, t, *block);
      }
      cpu::pack_rows_transposed(t.k_packed.data(), p.k, p.dtype, p.k_strides, b, h_kv, key_begin,
                                keys, kv.keys_padded, p.head_dim);
      cpu::pack_rows(t.v_packed.data(), p.v, p.dtype, p.v_strides, b, h_kv, key_begin, keys,
                     p.head_dim_v, Dvp);
    }
    // A masked key has p = 0 exactly, and 0 · v = 0 for finite v: then masked rows can go
    // through the blocked P·V kernel with the same result as skipping the masked keys. Otherwise
    // the fp32 kernel takes each row's visible keys on their own.
    if (!all_visible) {
      kv.blocked_pv = fp32_products
                          ? cpu::all_finite(t.v_packed.data(), keys * Dvp)
                          : cpu::all_finite_bf16(t.v_bf16.data(), kv.bf16_reduction * Dvp);
      if (!kv.blocked_pv && !fp32_products) {
        cpu::pack_rows(t.v_packed.data(), p.v, p.dtype, p.v_strides, b, h_kv, key_begin, keys,
                       p.head_dim_v, Dvp);
      }
    }
    for (const QueryBlock* block : visitors) {
      visit_key_block(p, tiles, t, *block, kv);
    }
  }

  if (partial != nullptr) {
    for (const QueryBlock& block : blocks) store_partial_block(p, t, block, chunk_index, *partial);
    return;
  }
  for (const QueryBlock& block : blocks) finish_block(p, Dvp, stream_out, block);
  fence_streams();
}

}  // namespace

void flash_forward(const AttentionParams& p) {
  if (cpu::use_flash_decode(p)) {
    cpu::flash_decode(p);
    return;
  }
  const cpu::TileSizes tiles = cpu::flash_tiles(p.head_dim, p.head_dim_v);
  // A Q block holds Br rows: Br / group positions of each query head of a GQA group.
  const std::int64_t group = p.group_size();
  const std::int64_t positions = std::max<std::int64_t>(1, tiles.rows / group);
  const std::int64_t q_blocks = (p.seqlen_q + positions - 1) / positions;
  const std::int64_t kv_heads = p.batch * p.heads_kv;
  // Up to tiles.blocks_per_task Q blocks per task, but at least 4 tasks per thread, so that
  // the dynamic schedule can even out causal tasks of different lengths. How the blocks are
  // grouped changes no result (flash_task).
  std::int64_t blocks_per_task = tiles.blocks_per_task;
  auto task_count = [&](std::int64_t per_task) {
    return kv_heads * ((q_blocks + per_task - 1) / per_task);
  };
  while (blocks_per_task > 1 && task_count(blocks_per_task) < 4 * p.num_threads) --blocks_per_task;
  const std::int64_t tasks_per_head = (q_blocks + blocks_per_task - 1) / blocks_per_task;
  const cpu::TileSizes scratch_tiles{group * positions, tiles.keys, blocks_per_task};

  // Key chunks: whole K/V blocks, the same for every task (a function of the shape only).
  const std::int64_t chunks = cpu::flash_forward_key_chunks(p);
  const std::int64_t key_blocks = (p.seqlen_kv + tiles.keys - 1) / tiles.keys;
  auto chunk_keys = [&](std::int64_t c) {
    return KeyRange{c * key_blocks / chunks * tiles.keys,
                    std::min((c + 1) * key_blocks / chunks * tiles.keys, p.seqlen_kv)};
  };
  ChunkResults partial;
  if (chunks > 1) {
    partial.chunks = chunks;
    partial.rows = p.batch * p.heads_q * p.seqlen_q;
    partial.value_dims_padded = cpu::pad_to_lanes(p.head_dim_v);
    partial.max = UninitializedAlignedVector<float>(chunks * partial.rows);
    partial.sum = UninitializedAlignedVector<float>(chunks * partial.rows);
    partial.acc =
        UninitializedAlignedVector<float>(chunks * partial.rows * partial.value_dims_padded);
  }

  // Output rows that cannot stay in the L2 caches go straight to memory: plain stores read every
  // line first (docs/tuning.md).
  const bool stream_out = cpu::stream_output(static_cast<std::int64_t>(dtype_size(p.dtype)) *
                                                 p.batch * p.seqlen_q * p.heads_q * p.head_dim_v,
                                             p.num_threads);
  const cpu::Bf16Products bf16_products =
      p.dtype == DType::bf16 ? cpu::active_bf16_products() : cpu::Bf16Products::widened;

  // Dynamic schedule, last Q blocks first: under a causal mask the last blocks see the most
  // keys, so the long tasks start early and the short ones fill the gaps at the end.
  parallel_tasks(
      p.num_threads, task_count(blocks_per_task) * chunks,
      [&] { return Scratch(scratch_tiles, p.head_dim, p.head_dim_v, bf16_products); },
      [&](Scratch& t, std::int64_t task) {
        const std::int64_t chunk = task % chunks, index = task / chunks;
        const std::int64_t kv_head = index / tasks_per_head;
        const std::int64_t b = kv_head / p.heads_kv, h_kv = kv_head % p.heads_kv;
        const std::int64_t first_block =
            (tasks_per_head - 1 - index % tasks_per_head) * blocks_per_task;
        const std::int64_t end_block = std::min(first_block + blocks_per_task, q_blocks);
        const std::int64_t block_floats = scratch_tiles.rows * t.dims_padded;
        const std::int64_t block_values = scratch_tiles.rows * t.value_dims_padded;
        const std::int64_t block_bf16 = scratch_tiles.rows * t.bf16_dims;
        std::vector<QueryBlock> blocks;
        for (std::int64_t n = first_block; n < end_block; ++n) {
          const std::int64_t position_begin = n * positions, slot = n - first_block;
          const TaskRows rows{
              b,     h_kv,           h_kv * group,
              group, position_begin, std::min(positions, p.seqlen_q - position_begin)};
          blocks.push_back({rows, t.q.data() + slot * block_floats,
                            t.bf16_operands() ? t.q_bf16.data() + slot * block_bf16 : nullptr, true,
                            false, t.acc.data() + slot * block_values,
                            t.row_max.data() + slot * scratch_tiles.rows,
                            t.row_sum.data() + slot * scratch_tiles.rows});
        }
        flash_task(p, scratch_tiles, stream_out, t, blocks, chunk_keys(chunk), chunk,
                   chunks > 1 ? &partial : nullptr);
      });
  if (chunks > 1) merge_key_chunks(p, partial);
}

}  // namespace flashattn::detail
