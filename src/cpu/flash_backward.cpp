// FlashAttention-2 backward on the CPU (Dao 2023, Alg. 2), deterministic.
//
// A task is (batch, KV head, chunk of K/V blocks). It walks its K/V blocks of Bc keys (outer
// loop, so dK and dV accumulate in cache), and for each the Q blocks of Br rows, of every query
// head of the GQA group, that see it (inner loop):
//   S  = Q·Kᵀ                              [Br x Bc]  scores_tile
//   Z  = scale · S, or its softcap, ALiBi  [Br x Bc]  modify_scores (when asked for)
//   P  = exp(Z − lse), masked → 0          [Br x Bc]  probabilities_from_lse_tile
//   dV += Pᵀ·dO                            [Bc x Dv]  accumulate_transposed_pv_tile
//   dP = dO·Vᵀ                             [Br x Bc]  scores_tile
// With dropout, M the forward's mask times 1/(1 − p) (dropout_multipliers), dV takes P ∘ M and
// dP becomes dP ∘ M before dS; D_i = rowsum(dO_i ∘ O_i) stays as it is.
//   dS = scale · P ∘ (dP − D_i)            [Br x Bc]  softmax_gradient_tile
//        ∘ (1 − tanh²) under a softcap
//   dQ += dS·K                             [Br x D]   accumulate_pv_tile
//   dK += dSᵀ·Q                            [Bc x D]   accumulate_transposed_pv_tile
// with D_i = rowsum(dO_i ∘ O_i). dQ goes into the fp32 sums of the task's chunk.
// Each task owns its dK and dV rows outright. dQ rows receive from every chunk, so each chunk
// adds into its own fp32 buffer and the buffers are summed in chunk order at the end. The chunk
// count depends only on the shape, never on the thread count: results are bitwise identical for
// any number of threads.
//
// Every query row block is laid out once before the K/V blocks that read it: Q and dO as the
// column panels that S, dP, dK and dV stream, and D_i (by the task that owns the group's rows,
// or, when several chunks share them, in one parallel pass before the tasks). Packed inside the
// loop instead, each row block was re-read and re-packed once per K/V block it sees
// (docs/tuning.md).
//
// bf16 inputs run all five products in bf16 where the forward does (cpu::active_bf16_products:
// on AMX tiles, or with vdpbf16ps): S = Q·Kᵀ and dP = dO·Vᵀ from the bf16 inputs as they are, and
// dV += Pᵀ·dO, dQ += dS·K, dK += dSᵀ·Q with P and dS rounded to bf16 as their operands (as the
// forward rounds P for P·V; README says what that costs), every sum in fp32. Both ways read the
// same operand layouts (cpu::bf16_tile_product). A (row block, K/V block) pair where either
// holds a subnormal bf16, which both count as zero, takes the fp32 path.
//
// dbias is summed as the tasks go, without a [B, Hq, Sq, Skv] scratch: see BiasGradientSums.
//
// Non-finite inputs: a pair that the mask cuts and that holds an infinity or a NaN on either
// side adds its three gradient products over its visible (row, key) pairs only, since a masked
// pair's P = dS = 0 times an infinity would be NaN (cpu/kernels/visible_gradients.hpp).
//
// Memory: per thread the K/V-side tiles (K, V in three layouts, S/P, dP/dS, the dK and dV
// accumulators: at most 0.7 MiB at D = 128); the query side, Q and dO packed, D_i and the fp32 dQ
// sums, 3 x seqlen_q x Dp floats per query head: per thread for one GQA group when each task owns
// its group, else for all heads (and one dQ buffer per chunk). Proportional to seqlen_q, never to
// seqlen_q x seqlen_kv.

#include <hwy/aligned_allocator.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <thread>
#include <vector>

#include "api/backends.hpp"
#include "cpu/kernels/bf16_products.hpp"
#include "cpu/kernels/dropout.hpp"
#include "cpu/kernels/pack.hpp"
#include "cpu/kernels/score_modifiers.hpp"
#include "cpu/kernels/tile_kernels.hpp"
#include "cpu/kernels/tile_kernels_amx.hpp"
#include "cpu/kernels/tile_kernels_bf16.hpp"
#include "cpu/kernels/visible_gradients.hpp"
#include "cpu/tile_sizes.hpp"
#include "flashattn/dtype.hpp"
#include "util/aligned_vector.hpp"
#include "util/convert.hpp"
#include "util/dot.hpp"
#include "util/dropout.hpp"
#include "util/parallel.hpp"
#include "util/rows.hpp"

namespace flashattn::detail {
namespace {

constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

// Storage whose every element is written before it is read. A zero-filled std::vector was a
// serial pass on the calling thread before the parallel work: ~100 MiB on the seed shape.
hwy::AlignedFreeUniquePtr<float[]> uninitialized_floats(std::int64_t n) {
  auto buffer = hwy::AllocateAligned<float>(static_cast<std::size_t>(std::max<std::int64_t>(n, 1)));
  if (!buffer) throw std::bad_alloc();
  return buffer;
}

// D is q's and k's head dim, Dv v's and out's (dO, dV): each padded on its own.
struct BackwardTiles {
  std::int64_t rows, keys, dims_padded, value_dims_padded;
  // The products in bf16 (bf16 inputs, AMX tiles or vdpbf16ps), or in fp32 (widened).
  cpu::Bf16Products products;
  bool stream_gradients;        // dQ, dK, dV written with non-temporal stores (cpu::stream_output)
  std::int64_t bf16_reduction;  // head_dim zero-padded to a whole AMX tile row (kAmxReduction)
  std::int64_t value_bf16_reduction;  // head_dim_v the same way
  std::int64_t bf16_rows;             // rows (Br) and keys (Bc) zero-padded the same way
  std::int64_t bf16_keys;
  std::int64_t ld_scores;  // row stride of the score-sized tiles (scores_stride)

  bool bf16_operands() const { return products != cpu::Bf16Products::widened; }
};

// Row stride of the [Br x Bc] tiles S/P and dP/dS: Bc plus one cache line. dV += Pᵀ·dO and
// dK += dSᵀ·Q walk down a few columns of P and dS, one line per row; rows 512 bytes apart (Bc =
// 128) put those 64 lines in 8 of L1's 64 sets, where they and the panel of dO or Q evicted
// each other (docs/tuning.md).
std::int64_t scores_stride(std::int64_t keys) { return keys + cpu::kTileLanes; }

// Query row blocks of `groups` GQA groups (batch, KV head), laid out once for all the K/V blocks
// that read them. Block (slot, g, n) holds rows [n·Br, n·Br + rows) of query head g of the
// group in `slot`: Q and dO as column panels ([rows x Dp], cpu::packed_index), which all four
// products that read them stream (the scores kernel too, panel by panel), and
// D_i = rowsum(dO_i ∘ O_i).
//
// With bf16 products (AMX, vdpbf16ps) the products read bf16 copies, and the fp32 panels serve only
// the pairs that fall back to fp32 (a subnormal on either side). When one task owns the blocks
// (`fp32_on_demand`) it lays them out at the first such pair, if any: packing them always made
// the bf16 backward slower (docs/tuning.md). Blocks that several tasks share are laid out whole
// in advance.
class QueryBlocks {
 public:
  QueryBlocks(const AttentionParams& p, const BackwardTiles& tiles, std::int64_t groups,
              bool fp32_on_demand)
      : p_(p),
        tiles_(tiles),
        blocks_per_head_((p.seqlen_q + tiles.rows - 1) / tiles.rows),
        fp32_on_demand_(fp32_on_demand && tiles.bf16_operands()) {
    const std::int64_t heads = groups * p.group_size();
    q_panels_ = uninitialized_floats(heads * blocks_per_head_ * tiles.rows * tiles.dims_padded);
    dout_panels_ =
        uninitialized_floats(heads * blocks_per_head_ * tiles.rows * tiles.value_dims_padded);
    delta_ = uninitialized_floats(heads * blocks_per_head_ * tiles.rows);
    lse_ = uninitialized_floats(heads * blocks_per_head_ * tiles.rows);
    if (tiles.bf16_operands()) {
      const std::int64_t blocks = heads * blocks_per_head_;
      q_bf16_.assign(blocks * tiles.rows * tiles.bf16_reduction, 0);
      dout_bf16_.assign(blocks * tiles.rows * tiles.value_bf16_reduction, 0);
      q_pairs_.assign(blocks * tiles.bf16_rows * tiles.dims_padded, 0);
      dout_pairs_.assign(blocks * tiles.bf16_rows * tiles.value_dims_padded, 0);
      bf16_exact_.assign(heads * blocks_per_head_, 1);
    }
    finite_.assign(heads * blocks_per_head_, 1);
    fp32_packed_.assign(heads * blocks_per_head_, 0);
  }

  std::int64_t blocks_per_head() const { return blocks_per_head_; }
  std::int64_t rows(std::int64_t n) const {
    return std::min(tiles_.rows, p_.seqlen_q - n * tiles_.rows);
  }

  // Lays out block (slot, g, n) from the group of batch b, KV head h_kv.
  void pack(const BackwardParams& bp, std::int64_t slot, std::int64_t b, std::int64_t h_kv,
            std::int64_t g, std::int64_t n) {
    const std::int64_t h = h_kv * p_.group_size() + g, row_begin = n * tiles_.rows;
    const std::int64_t index = block_index(slot, g, n);
    fp32_packed_[index] = 0;  // a task's scratch serves one group after another
    float* delta = delta_.get() + index * tiles_.rows;
    row_deltas(delta, bp.dout, bp.dout_strides, p_.out, p_.out_strides, p_.dtype, b, h, row_begin,
               rows(n), p_.head_dim_v);
    float* lse = lse_.get() + index * tiles_.rows;
    backward_row_lse(lse, p_, b, h, row_begin, rows(n));
    if (!tiles_.bf16_operands()) {
      pack_fp32(bp, slot, b, h_kv, g, n);
      finite_[index] =
          cpu::all_finite(q_panels(slot, g, n), rows(n) * tiles_.dims_padded) &&
          cpu::all_finite(dout_panels(slot, g, n), rows(n) * tiles_.value_dims_padded) &&
          cpu::all_finite(delta, rows(n)) && !any_nan(lse, rows(n));
      return;
    }
    // As pairs of rows, the right operand of dK += dSᵀ·Q and dV += Pᵀ·dO; packing them also
    // tells whether the block holds a subnormal.
    const std::int64_t pairs_offset = index * tiles_.bf16_rows;
    const bool subnormal_q = cpu::pack_row_pairs_bf16(
        q_pairs_.data() + pairs_offset * tiles_.dims_padded, p_.q, p_.q_strides, b, h, row_begin,
        rows(n), tiles_.bf16_rows, p_.head_dim, tiles_.dims_padded);
    const bool subnormal_dout = cpu::pack_row_pairs_bf16(
        dout_pairs_.data() + pairs_offset * tiles_.value_dims_padded, bp.dout, bp.dout_strides, b,
        h, row_begin, rows(n), tiles_.bf16_rows, p_.head_dim_v, tiles_.value_dims_padded);
    bf16_exact_[index] = !subnormal_q && !subnormal_dout;
    // And as row-major bf16 rows, each head dim zero-padded (the padding is never written).
    const auto* q_rows = static_cast<const std::uint16_t*>(p_.q);
    const auto* dout_rows = static_cast<const std::uint16_t*>(bp.dout);
    for (std::int64_t i = 0; i < rows(n); ++i) {
      const std::int64_t row = index * tiles_.rows + i;
      std::copy_n(q_rows + p_.q_strides.offset(b, row_begin + i, h), p_.head_dim,
                  q_bf16_.data() + row * tiles_.bf16_reduction);
      std::copy_n(dout_rows + bp.dout_strides.offset(b, row_begin + i, h), p_.head_dim_v,
                  dout_bf16_.data() + row * tiles_.value_bf16_reduction);
    }
    finite_[index] =
        cpu::all_finite_bf16(q_bf16(slot, g, n), rows(n) * tiles_.bf16_reduction) &&
        cpu::all_finite_bf16(dout_bf16(slot, g, n), rows(n) * tiles_.value_bf16_reduction) &&
        cpu::all_finite(delta, rows(n)) && !any_nan(lse, rows(n));
    if (!fp32_on_demand_) pack_fp32(bp, slot, b, h_kv, g, n);
  }

  // Lays out the fp32 panels of Q and dO of block (slot, g, n), unless they are already.
  void pack_fp32(const BackwardParams& bp, std::int64_t slot, std::int64_t b, std::int64_t h_kv,
                 std::int64_t g, std::int64_t n) {
    const std::int64_t index = block_index(slot, g, n);
    if (fp32_packed_[index]) return;
    const std::int64_t h = h_kv * p_.group_size() + g, row_begin = n * tiles_.rows;
    float* q = q_panels_.get() + index * tiles_.rows * tiles_.dims_padded;
    float* dout = dout_panels_.get() + index * tiles_.rows * tiles_.value_dims_padded;
    cpu::pack_rows(q, p_.q, p_.dtype, p_.q_strides, b, h, row_begin, rows(n), p_.head_dim,
                   tiles_.dims_padded);
    cpu::pack_rows(dout, bp.dout, p_.dtype, bp.dout_strides, b, h, row_begin, rows(n),
                   p_.head_dim_v, tiles_.value_dims_padded);
    fp32_packed_[index] = 1;
  }

  const float* q_panels(std::int64_t slot, std::int64_t g, std::int64_t n) const {
    return q_panels_.get() + block_index(slot, g, n) * tiles_.rows * tiles_.dims_padded;
  }
  const float* dout_panels(std::int64_t slot, std::int64_t g, std::int64_t n) const {
    return dout_panels_.get() + block_index(slot, g, n) * tiles_.rows * tiles_.value_dims_padded;
  }
  const float* delta(std::int64_t slot, std::int64_t g, std::int64_t n) const {
    return delta_.get() + block_index(slot, g, n) * tiles_.rows;
  }
  // The rows' lse as the backward uses it (backward_row_lse).
  const float* lse(std::int64_t slot, std::int64_t g, std::int64_t n) const {
    return lse_.get() + block_index(slot, g, n) * tiles_.rows;
  }
  // bf16 products only: the block's Q and dO as bf16 rows [rows x bf16_reduction] and
  // [rows x value_bf16_reduction], and whether they hold no subnormal.
  const std::uint16_t* q_bf16(std::int64_t slot, std::int64_t g, std::int64_t n) const {
    return q_bf16_.data() + block_index(slot, g, n) * tiles_.rows * tiles_.bf16_reduction;
  }
  const std::uint16_t* dout_bf16(std::int64_t slot, std::int64_t g, std::int64_t n) const {
    return dout_bf16_.data() + block_index(slot, g, n) * tiles_.rows * tiles_.value_bf16_reduction;
  }
  bool bf16_exact(std::int64_t slot, std::int64_t g, std::int64_t n) const {
    return bf16_exact_[block_index(slot, g, n)] != 0;
  }
  // Whether the block's Q, dO and D_i hold no infinity or NaN and its lse no NaN
  // (cpu/kernels/visible_gradients.hpp).
  bool finite(std::int64_t slot, std::int64_t g, std::int64_t n) const {
    return finite_[block_index(slot, g, n)] != 0;
  }
  // bf16 products only: Q and dO as pairs of rows (cpu::bf16_value_index, rows padded to
  // bf16_rows).
  const std::uint16_t* q_pairs(std::int64_t slot, std::int64_t g, std::int64_t n) const {
    return q_pairs_.data() + block_index(slot, g, n) * tiles_.bf16_rows * tiles_.dims_padded;
  }
  const std::uint16_t* dout_pairs(std::int64_t slot, std::int64_t g, std::int64_t n) const {
    return dout_pairs_.data() +
           block_index(slot, g, n) * tiles_.bf16_rows * tiles_.value_dims_padded;
  }

 private:
  std::int64_t block_index(std::int64_t slot, std::int64_t g, std::int64_t n) const {
    return (slot * p_.group_size() + g) * blocks_per_head_ + n;
  }

  const AttentionParams& p_;
  BackwardTiles tiles_;
  std::int64_t blocks_per_head_;
  hwy::AlignedFreeUniquePtr<float[]> q_panels_, dout_panels_, delta_, lse_;
  AlignedVector<std::uint16_t> q_bf16_, dout_bf16_, q_pairs_, dout_pairs_;
  bool fp32_on_demand_;
  std::vector<char> bf16_exact_, finite_, fp32_packed_;
};

struct Scratch {
  AlignedVector<float> k_packed_t, k_packed, v_packed_t;  // Kᵀ panels, K panels, Vᵀ panels
  // bf16 products: Kᵀ and Vᵀ as pairs of dims (bf16_key_index), K as pairs of keys
  // (bf16_value_index); Pᵀ and dSᵀ [keys x bf16_rows] and dS [rows x bf16_keys] rounded to bf16.
  AlignedVector<std::uint16_t> k_bf16, v_bf16, k_pairs, probabilities_t, dscores_t, dscores_bf16;
  AlignedVector<float> probabilities, dscores;  // [Br x Bc] each
  AlignedVector<float> softcap_derivative;      // [Br x Bc] d logit / dx, under a softcap only
  // With dropout only, [Br x Bc] each: M (1/(1 − p) where kept, 0 where dropped) and P ∘ M.
  AlignedVector<float> dropout_multipliers, kept_probabilities;
  AlignedVector<float> dk, dv;
  // Non-finite inputs only: a row block's Q and dO, a K/V block's K, as row-major fp32 rows
  // [rows x head_dim] ([rows x head_dim_v] for dO).
  std::vector<float> q_rows, dout_rows, k_rows;
  AlignedVector<float> dlogits_row;  // dbias: one row's logits' gradient against the K/V block
  // With one chunk per group: the task's own query rows and dQ sums, [group x seqlen_q x Dp].
  std::optional<QueryBlocks> queries;
  hwy::AlignedFreeUniquePtr<float[]> dq;

  Scratch(const AttentionParams& p, const BackwardTiles& tiles, bool task_owns_queries)
      : k_packed_t(p.head_dim * tiles.keys),
        k_packed(tiles.keys * tiles.dims_padded),
        v_packed_t(p.head_dim_v * tiles.keys),
        probabilities(tiles.rows * tiles.ld_scores),
        dscores(tiles.rows * tiles.ld_scores),
        softcap_derivative(p.modifiers.softcap > 0.0f ? tiles.rows * tiles.ld_scores : 0),
        dropout_multipliers(p.dropout.on() ? tiles.rows * tiles.ld_scores : 0),
        kept_probabilities(p.dropout.on() ? tiles.rows * tiles.ld_scores : 0),
        dk(tiles.keys * tiles.dims_padded),
        dv(tiles.keys * tiles.value_dims_padded),
        dlogits_row(tiles.keys) {
    if (tiles.bf16_operands()) {
      k_bf16.assign(tiles.keys * tiles.bf16_reduction, 0);
      v_bf16.assign(tiles.keys * tiles.value_bf16_reduction, 0);
      k_pairs.assign(tiles.bf16_keys * tiles.dims_padded, 0);
      probabilities_t.assign(tiles.keys * tiles.bf16_rows, 0);
      dscores_t.assign(tiles.keys * tiles.bf16_rows, 0);
      dscores_bf16.assign(tiles.rows * tiles.bf16_keys, 0);
    }
    if (task_owns_queries) {
      queries.emplace(p, tiles, 1, true);
      dq = uninitialized_floats(p.group_size() * p.seqlen_q * tiles.dims_padded);
    }
  }
};

// dbias without a [B, Hq, Sq, Skv] scratch. dbias[bb, hb, i, j] sums the logits' gradient of the
// (b, h) that read bias[bb, hb] (every b where the bias has batch 1, likewise the heads) in
// fp64, in increasing (b, h) order: the order, and so the bits, of the sums the standard path
// makes from its scratch (api/backward.cpp), for any thread count. Each task adds its pairs'
// rows as it computes them. Groups (batch, KV head) whose heads read the same bias slices take
// turns per K/V block: a group adds to a block's keys once the group before it in its slices
// has added all of its own rows there. The threads claim tasks in increasing order
// (parallel_tasks), so the group waited for runs or ran, and they move through the blocks as a
// pipeline, one block apart.
class BiasGradientSums {
 public:
  BiasGradientSums(const BackwardParams& bp, std::int64_t kv_blocks)
      : p_(bp.forward),
        bias_batch_(bp.dbias.shape[0]),
        bias_heads_(bp.dbias.shape[1]),
        kv_blocks_(kv_blocks),
        added_(
            new std::atomic<bool>[static_cast<std::size_t>(p_.batch * p_.heads_kv * kv_blocks)]) {
    for (std::int64_t i = 0; i < p_.batch * p_.heads_kv * kv_blocks; ++i) added_[i] = false;
    const std::int64_t count = bias_batch_ * bias_heads_ * p_.seqlen_q * p_.seqlen_kv;
    if (count == 0) return;  // an empty bias: nothing to sum (Highway allocates no 0 bytes)
    sums_ = hwy::AllocateAligned<double>(static_cast<std::size_t>(count));
    if (!sums_) throw std::bad_alloc();
    constexpr std::int64_t kChunk = std::int64_t{1} << 18;
    parallel_tasks(
        p_.num_threads, (count + kChunk - 1) / kChunk, [] { return 0; },
        [&](int&, std::int64_t chunk) {
          const std::int64_t begin = chunk * kChunk;
          std::fill_n(sums_.get() + begin, std::min(kChunk, count - begin), 0.0);
        });
  }

  // Waits until the group before `group` in its bias slices has added K/V block `block`.
  void wait_for_turn(std::int64_t group, std::int64_t block) const {
    const std::int64_t before = group_before(group);
    if (before < 0) return;
    const std::atomic<bool>& added = added_[before * kv_blocks_ + block];
    while (!added.load(std::memory_order_acquire) && !aborted_.load(std::memory_order_acquire)) {
      std::this_thread::yield();
    }
  }
  void mark_added(std::int64_t group, std::int64_t block) {
    added_[group * kv_blocks_ + block].store(true, std::memory_order_release);
  }
  // A task failed: the call fails, and no task waits for its blocks any more.
  void abort() { aborted_.store(true, std::memory_order_release); }

  // Adds row `row` of (batch b, query head h), keys [key_begin, key_begin + n).
  void add_row(std::int64_t b, std::int64_t h, std::int64_t row, std::int64_t key_begin,
               const float* dlogits, std::int64_t n) {
    const std::int64_t bb = bias_batch_ == 1 ? 0 : b, hb = bias_heads_ == 1 ? 0 : h;
    double* sums =
        sums_.get() + ((bb * bias_heads_ + hb) * p_.seqlen_q + row) * p_.seqlen_kv + key_begin;
    add_widened_f64(sums, dlogits, n);
  }

  // dbias, the sums rounded to its dtype.
  void store(const TensorView& dbias) const {
    if (!sums_) return;  // an empty bias
    const std::int64_t Sq = p_.seqlen_q, Skv = p_.seqlen_kv;
    parallel_tasks(
        p_.num_threads, bias_batch_ * bias_heads_ * Sq, [] { return 0; },
        [&](int&, std::int64_t task) {
          const std::int64_t bb = task / (bias_heads_ * Sq), hb = task / Sq % bias_heads_,
                             i = task % Sq;
          store_bias_gradient_row(dbias, bb, hb, i, sums_.get() + task * Skv);
        });
  }

 private:
  // The group before `group` (b · heads_kv + h_kv) whose heads read the same bias slices, or -1.
  std::int64_t group_before(std::int64_t group) const {
    const std::int64_t b = group / p_.heads_kv, h_kv = group % p_.heads_kv;
    if (bias_heads_ == 1) {
      // One slice per batch (or one for all): the groups of that batch in turn.
      if (bias_batch_ == 1) return group - 1;
      return h_kv > 0 ? group - 1 : -1;
    }
    // A slice per query head: the same KV head's group in the batch before, where shared.
    return bias_batch_ == 1 && b > 0 ? group - p_.heads_kv : -1;
  }

  const AttentionParams& p_;
  std::int64_t bias_batch_, bias_heads_, kv_blocks_;
  hwy::AlignedFreeUniquePtr<double[]> sums_;    // [bias batch, bias heads, seqlen_q, seqlen_kv]
  std::unique_ptr<std::atomic<bool>[]> added_;  // [groups][K/V blocks]
  std::atomic<bool> aborted_{false};
};

struct Task {
  std::int64_t b, h_kv, block_begin, block_end;  // K/V blocks [block_begin, block_end)
  QueryBlocks* queries;                          // holding the group's row blocks
  std::int64_t slot;                             // at this slot
  float* dq;  // the fp32 dQ sums this task adds into, [group x seqlen_q x dims_padded]
  BiasGradientSums* bias_sums;  // dbias asked for: where the task adds its logits' gradient
};

// The K/V block [begin, end) of a task, packed once for every row block that sees it: in the
// layouts that the three products reading it stream, in fp32 unless the products are bf16 ones
// (then in bf16, and in fp32 only once a pair needs it).
struct KeyBlock {
  std::int64_t begin, end, keys, keys_padded;
  std::int64_t bf16_keys;  // keys zero-padded to a whole AMX reduction
  bool bf16_exact;         // bf16 products: K and V hold no subnormal
  bool fp32_packed;        // Kᵀ, K and Vᵀ laid out in fp32
  bool finite;             // K and V hold no infinity or NaN
};

// One Q row block (query head g of the group, row block n) against the task's K/V block.
struct BlockPair {
  std::int64_t g, n, row_begin, rows;
  bool bf16;          // all five products in bf16
  bool visible_only;  // masked pairs and a non-finite input: gradients over visible pairs only
  const float* q;     // the block's fp32 Q and dO panels (valid when !bf16 or visible_only)
  const float* dout;
};

// Kᵀ, K and Vᵀ of the block in fp32.
void pack_key_block_fp32(const AttentionParams& p, const BackwardTiles& tiles, Scratch& t,
                         std::int64_t b, std::int64_t h_kv, KeyBlock& kv) {
  const std::int64_t D = p.head_dim;
  cpu::pack_rows_transposed(t.k_packed_t.data(), p.k, p.dtype, p.k_strides, b, h_kv, kv.begin,
                            kv.keys, kv.keys_padded, D);
  cpu::pack_rows_transposed(t.v_packed_t.data(), p.v, p.dtype, p.v_strides, b, h_kv, kv.begin,
                            kv.keys, kv.keys_padded, p.head_dim_v);
  cpu::pack_rows(t.k_packed.data(), p.k, p.dtype, p.k_strides, b, h_kv, kv.begin, kv.keys, D,
                 tiles.dims_padded);
  kv.fp32_packed = true;
}

// Prologue of one K/V block: pack K and V, zero the dK and dV accumulators.
KeyBlock start_key_block(const AttentionParams& p, const BackwardTiles& tiles, Scratch& t,
                         std::int64_t b, std::int64_t h_kv, std::int64_t block) {
  const std::int64_t D = p.head_dim, Dv = p.head_dim_v, Dp = tiles.dims_padded;
  KeyBlock kv{};
  kv.begin = block * tiles.keys;
  kv.end = std::min(kv.begin + tiles.keys, p.seqlen_kv);
  kv.keys = kv.end - kv.begin;
  kv.keys_padded = cpu::pad_to_lanes(kv.keys);
  kv.bf16_keys = cpu::pad_to_amx_reduction(kv.keys);
  const std::int64_t keys_transposed =
      (tiles.bf16_operands() ? tiles.bf16_reduction : D) * kv.keys_padded;
  const std::int64_t values_transposed =
      (tiles.bf16_operands() ? tiles.value_bf16_reduction : Dv) * kv.keys_padded;
  if (tiles.bf16_operands()) {
    const bool subnormal_keys =
        cpu::pack_rows_transposed_bf16(t.k_bf16.data(), p.k, p.k_strides, b, h_kv, kv.begin,
                                       kv.keys, kv.keys_padded, D, tiles.bf16_reduction);
    const bool subnormal_values =
        cpu::pack_rows_transposed_bf16(t.v_bf16.data(), p.v, p.v_strides, b, h_kv, kv.begin,
                                       kv.keys, kv.keys_padded, Dv, tiles.value_bf16_reduction);
    kv.bf16_exact = !subnormal_keys && !subnormal_values;
    kv.finite = cpu::all_finite_bf16(t.k_bf16.data(), keys_transposed) &&
                cpu::all_finite_bf16(t.v_bf16.data(), values_transposed);
    cpu::pack_row_pairs_bf16(t.k_pairs.data(), p.k, p.k_strides, b, h_kv, kv.begin, kv.keys,
                             kv.bf16_keys, D, Dp);
  } else {
    pack_key_block_fp32(p, tiles, t, b, h_kv, kv);
    kv.finite = cpu::all_finite(t.k_packed_t.data(), keys_transposed) &&
                cpu::all_finite(t.v_packed_t.data(), values_transposed);
  }
  std::fill_n(t.dk.begin(), kv.keys * Dp, 0.0f);
  std::fill_n(t.dv.begin(), kv.keys * tiles.value_dims_padded, 0.0f);
  return kv;
}

// Row blocks [first, end) holding the query rows that see some key of the block: the row ranges
// are monotone in the row. The blocks are visited whole; their rows that see none of the block
// get P = 0, hence dS = 0, from the mask. A block that no row sees (no queries, or keys outside
// every window) visits none and still writes its dK and dV: zeros.
struct RowBlocks {
  std::int64_t first, end;
};
RowBlocks row_blocks_that_see(const AttentionParams& p, const BackwardTiles& tiles,
                              const KeyBlock& kv) {
  std::int64_t first_row = 0, last_row = p.seqlen_q;
  while (first_row < last_row && p.key_range(first_row).end <= kv.begin) ++first_row;
  while (last_row > first_row && p.key_range(last_row - 1).begin >= kv.end) --last_row;
  const std::int64_t first_block = first_row / tiles.rows;
  return {first_block,
          first_row == last_row ? first_block : (last_row + tiles.rows - 1) / tiles.rows};
}

// Which way the pair's products run, with the fp32 operands they then need laid out.
BlockPair start_pair(const BackwardParams& bp, const BackwardTiles& tiles, Scratch& t,
                     const Task& task, KeyBlock& kv, std::int64_t g, std::int64_t n) {
  const AttentionParams& p = bp.forward;
  QueryBlocks& queries = *task.queries;
  BlockPair pair{};
  pair.g = g;
  pair.n = n;
  pair.row_begin = n * tiles.rows;
  pair.rows = queries.rows(n);
  pair.bf16 = kv.bf16_exact && queries.bf16_exact(task.slot, g, n);
  if (!pair.bf16) queries.pack_fp32(bp, task.slot, task.b, task.h_kv, g, n);
  pair.q = queries.q_panels(task.slot, g, n);
  pair.dout = queries.dout_panels(task.slot, g, n);
  // A pair with masked (row, key) pairs and an infinity or NaN on either side adds its gradients
  // over the visible pairs only (cpu/kernels/visible_gradients.hpp).
  const bool fully_visible = p.key_range(pair.row_begin).end >= kv.end &&
                             p.key_range(pair.row_begin + pair.rows - 1).begin <= kv.begin &&
                             !p.modifiers.masks_logits();
  pair.visible_only = !fully_visible && !(kv.finite && queries.finite(task.slot, g, n));
  if (!pair.bf16 && !kv.fp32_packed) pack_key_block_fp32(p, tiles, t, task.b, task.h_kv, kv);
  return pair;
}

// The reduction of a score product: S = Q·Kᵀ sums over head_dim, dP = dO·Vᵀ over head_dim_v.
struct Reduction {
  std::int64_t dims, dims_padded, bf16_dims;
};

// out[rows x keys_padded] = A·Bᵀ of a row block against the K/V block, S = Q·Kᵀ or dP = dO·Vᵀ:
// the bf16 rows a_bf16 against b_bf16 (Bᵀ packed in bf16), or the fp32 panels a against b_t.
// a_bf16 is null for an fp32 pair: the bf16 copies exist only with bf16 products.
void score_product(const BackwardTiles& tiles, Reduction reduction, float* out, const KeyBlock& kv,
                   const BlockPair& pair, const std::uint16_t* a_bf16, const std::uint16_t* b_bf16,
                   const float* a, const float* b_t) {
  if (pair.bf16) {
    cpu::bf16_tile_product(tiles.products, out, tiles.ld_scores, false, a_bf16, reduction.bf16_dims,
                           b_bf16, pair.rows, kv.keys_padded, reduction.bf16_dims);
  } else {
    cpu::scores_tile(out, tiles.ld_scores, {a, reduction.dims_padded, pair.rows}, b_t, pair.rows,
                     kv.keys_padded, reduction.dims);
  }
}

// P = exp(Z − lse), Z = scale · Q·Kᵀ or its score modifiers, masked and padded keys 0
//                                                                       [rows x keys_padded]
void probabilities_step(const AttentionParams& p, const BackwardTiles& tiles, Scratch& t,
                        const Task& task, const KeyBlock& kv, const BlockPair& pair) {
  const QueryBlocks& queries = *task.queries;
  const std::int64_t ld_s = tiles.ld_scores;
  score_product(tiles, {p.head_dim, tiles.dims_padded, tiles.bf16_reduction},
                t.probabilities.data(), kv, pair,
                pair.bf16 ? queries.q_bf16(task.slot, pair.g, pair.n) : nullptr, t.k_bf16.data(),
                pair.q, t.k_packed_t.data());
  const std::int64_t head = task.h_kv * p.group_size() + pair.g;
  for (std::int64_t i = 0; i < pair.rows; ++i) {
    float* s = t.probabilities.data() + i * ld_s;
    if (p.modifiers.change_logits()) {
      float* derivative = t.softcap_derivative.empty() ? nullptr : &t.softcap_derivative[i * ld_s];
      cpu::modify_scores(
          s, derivative, kv.keys, p.scale,
          cpu::row_modifiers(p, task.b, head, pair.row_begin + i, kv.begin, p.seqlen_kv));
    }
    mask_invisible(s, p.key_range(pair.row_begin + i), kv.begin, kv.keys);
    std::fill(s + kv.keys, s + kv.keys_padded, kNegativeInfinity);
  }
  cpu::probabilities_from_lse_tile(t.probabilities.data(), ld_s, p.tile_scale(),
                                   queries.lse(task.slot, pair.g, pair.n), pair.rows,
                                   kv.keys_padded);
  if (!p.dropout.on()) return;
  // The forward's dropout mask M, regenerated, and P ∘ M (0 on the padded keys).
  for (std::int64_t i = 0; i < pair.rows; ++i) {
    float* multipliers = t.dropout_multipliers.data() + i * ld_s;
    const float* probabilities = t.probabilities.data() + i * ld_s;
    float* kept = t.kept_probabilities.data() + i * ld_s;
    cpu::dropout_multipliers(multipliers, kv.begin, kv.keys,
                             {&p.dropout, dropout_stream(p, task.b, head),
                              static_cast<std::uint32_t>(pair.row_begin + i)});
    for (std::int64_t j = 0; j < kv.keys; ++j) kept[j] = probabilities[j] * multipliers[j];
    std::fill(kept + kv.keys, kept + kv.keys_padded, 0.0f);
  }
}

// P as dV += Pᵀ·dO takes it: P ∘ M with dropout.
const float* kept_probabilities(const AttentionParams& p, const Scratch& t) {
  return p.dropout.on() ? t.kept_probabilities.data() : t.probabilities.data();
}

// dV += Pᵀ·dO                                                           [keys x Dvp]
// (visible_only pairs add theirs with dQ and dK, in gradients_step)
void value_gradient_step(const AttentionParams& p, const BackwardTiles& tiles, Scratch& t,
                         const Task& task, const KeyBlock& kv, const BlockPair& pair) {
  if (pair.visible_only) return;
  const std::int64_t ld_s = tiles.ld_scores, Dvp = tiles.value_dims_padded;
  const float* probabilities = kept_probabilities(p, t);
  if (pair.bf16) {
    cpu::round_transposed_bf16(t.probabilities_t.data(), tiles.bf16_rows, probabilities, ld_s,
                               pair.rows, tiles.bf16_rows, kv.keys_padded);
    cpu::bf16_tile_product(tiles.products, t.dv.data(), Dvp, true, t.probabilities_t.data(),
                           tiles.bf16_rows, task.queries->dout_pairs(task.slot, pair.g, pair.n),
                           kv.keys, Dvp, tiles.bf16_rows);
  } else {
    cpu::accumulate_transposed_pv_tile(t.dv.data(), Dvp, probabilities, ld_s, pair.dout, pair.rows,
                                       kv.keys, Dvp);
  }
}

// dS = scale · P ∘ (dO·Vᵀ − D_i)                                        [rows x keys_padded]
// (for dbias, the logits' gradient P ∘ (dP − D_i) is copied out on the way)
void score_gradient_step(const BackwardParams& bp, const BackwardTiles& tiles, Scratch& t,
                         const Task& task, const KeyBlock& kv, const BlockPair& pair) {
  const AttentionParams& p = bp.forward;
  const QueryBlocks& queries = *task.queries;
  const std::int64_t ld_s = tiles.ld_scores;
  score_product(tiles, {p.head_dim_v, tiles.value_dims_padded, tiles.value_bf16_reduction},
                t.dscores.data(), kv, pair,
                pair.bf16 ? queries.dout_bf16(task.slot, pair.g, pair.n) : nullptr, t.v_bf16.data(),
                pair.dout, t.v_packed_t.data());
  if (p.dropout.on()) {
    for (std::int64_t i = 0; i < pair.rows; ++i) {
      float* dp = t.dscores.data() + i * ld_s;
      const float* multipliers = t.dropout_multipliers.data() + i * ld_s;
      for (std::int64_t j = 0; j < kv.keys; ++j) dp[j] *= multipliers[j];
    }
  }
  cpu::softmax_gradient_tile(t.dscores.data(), ld_s, t.probabilities.data(), ld_s,
                             queries.delta(task.slot, pair.g, pair.n),
                             task.bias_sums != nullptr ? 1.0f : p.scale, pair.rows, kv.keys_padded);
  if (task.bias_sums != nullptr) {
    const std::int64_t head = task.h_kv * p.group_size() + pair.g;
    for (std::int64_t i = 0; i < pair.rows; ++i) {
      float* ds = t.dscores.data() + i * ld_s;
      const std::int64_t row = pair.row_begin + i;
      cpu::store_dlogits_row(p, task.b, head, row, kv.begin, kv.keys, ds,
                             queries.lse(task.slot, pair.g, pair.n)[i], t.dlogits_row.data());
      task.bias_sums->add_row(task.b, head, row, kv.begin, t.dlogits_row.data(), kv.keys);
      for (std::int64_t j = 0; j < kv.keys_padded; ++j) ds[j] *= p.scale;
    }
  }
  if (t.softcap_derivative.empty()) return;
  // Through the softcap: dS ∘= 1 − tanh²                                [rows x keys]
  for (std::int64_t i = 0; i < pair.rows; ++i) {
    float* ds = t.dscores.data() + i * ld_s;
    const float* derivative = t.softcap_derivative.data() + i * ld_s;
    for (std::int64_t j = 0; j < kv.keys; ++j) ds[j] *= derivative[j];
  }
}

// dQ += dS·K                                                            [rows x Dp]
// dK += dSᵀ·Q                                                           [keys x Dp]
// and, for visible_only pairs, dV += Pᵀ·dO, each over the visible (row, key) pairs only.
void gradients_step(const BackwardParams& bp, const BackwardTiles& tiles, Scratch& t,
                    const Task& task, const KeyBlock& kv, const BlockPair& pair) {
  const AttentionParams& p = bp.forward;
  const std::int64_t D = p.head_dim, Dv = p.head_dim_v, Dp = tiles.dims_padded;
  const std::int64_t ld_s = tiles.ld_scores;
  const std::int64_t rows = pair.rows, row_begin = pair.row_begin, b = task.b;
  float* dq = task.dq + (pair.g * p.seqlen_q + row_begin) * Dp;
  if (pair.visible_only) {
    const std::int64_t h = task.h_kv * p.group_size() + pair.g;
    t.q_rows.resize(static_cast<std::size_t>(rows * D));
    t.dout_rows.resize(static_cast<std::size_t>(rows * Dv));
    t.k_rows.resize(static_cast<std::size_t>(kv.keys * D));
    for (std::int64_t i = 0; i < rows; ++i) {
      load_row_f32(t.q_rows.data() + i * D, p.q, p.dtype, p.q_strides.offset(b, row_begin + i, h),
                   D);
      load_row_f32(t.dout_rows.data() + i * Dv, bp.dout, p.dtype,
                   bp.dout_strides.offset(b, row_begin + i, h), Dv);
    }
    for (std::int64_t j = 0; j < kv.keys; ++j) {
      load_row_f32(t.k_rows.data() + j * D, p.k, p.dtype,
                   p.k_strides.offset(b, kv.begin + j, task.h_kv), D);
    }
    cpu::add_visible_gradients(p, {b,
                                   h,
                                   row_begin,
                                   rows,
                                   kv.begin,
                                   kv.keys,
                                   D,
                                   Dv,
                                   task.queries->lse(task.slot, pair.g, pair.n),
                                   kept_probabilities(p, t),
                                   t.dscores.data(),
                                   ld_s,
                                   t.q_rows.data(),
                                   D,
                                   t.dout_rows.data(),
                                   Dv,
                                   t.k_rows.data(),
                                   D,
                                   dq,
                                   Dp,
                                   t.dk.data(),
                                   Dp,
                                   t.dv.data(),
                                   tiles.value_dims_padded});
  } else if (pair.bf16) {
    cpu::round_probabilities_bf16(t.dscores_bf16.data(), tiles.bf16_keys, t.dscores.data(), ld_s,
                                  rows, kv.keys_padded, kv.bf16_keys);
    cpu::bf16_tile_product(tiles.products, dq, Dp, true, t.dscores_bf16.data(), tiles.bf16_keys,
                           t.k_pairs.data(), rows, Dp, kv.bf16_keys);
    cpu::round_transposed_bf16(t.dscores_t.data(), tiles.bf16_rows, t.dscores.data(), ld_s, rows,
                               tiles.bf16_rows, kv.keys_padded);
    cpu::bf16_tile_product(tiles.products, t.dk.data(), Dp, true, t.dscores_t.data(),
                           tiles.bf16_rows, task.queries->q_pairs(task.slot, pair.g, pair.n),
                           kv.keys, Dp, tiles.bf16_rows);
  } else {
    cpu::accumulate_pv_tile(dq, Dp, t.dscores.data(), ld_s, t.k_packed.data(), kv.keys, 0, kv.keys,
                            rows, Dp);
    cpu::accumulate_transposed_pv_tile(t.dk.data(), Dp, t.dscores.data(), ld_s, pair.q, rows,
                                       kv.keys, Dp);
  }
}

// Epilogue of one K/V block: its dK and dV rows, written once.
void store_key_gradients(const BackwardParams& bp, const BackwardTiles& tiles, const Scratch& t,
                         const Task& task, const KeyBlock& kv) {
  const AttentionParams& p = bp.forward;
  const std::int64_t D = p.head_dim, Dv = p.head_dim_v, Dp = tiles.dims_padded;
  const std::int64_t Dvp = tiles.value_dims_padded, b = task.b, h_kv = task.h_kv;
  for (std::int64_t j = 0; j < kv.keys; ++j) {
    if (j + kRowsAhead < kv.keys) {
      prefetch_store_row(bp.dk, p.dtype, bp.dk_strides.offset(b, kv.begin + j + kRowsAhead, h_kv),
                         D, tiles.stream_gradients);
      prefetch_store_row(bp.dv, p.dtype, bp.dv_strides.offset(b, kv.begin + j + kRowsAhead, h_kv),
                         Dv, tiles.stream_gradients);
    }
    store_row_f32(bp.dk, p.dtype, bp.dk_strides.offset(b, kv.begin + j, h_kv), t.dk.data() + j * Dp,
                  D, tiles.stream_gradients);
    store_row_f32(bp.dv, p.dtype, bp.dv_strides.offset(b, kv.begin + j, h_kv),
                  t.dv.data() + j * Dvp, Dv, tiles.stream_gradients);
  }
}

// A task: each of its K/V blocks against every row block that sees it, the five products of the
// table atop this file per pair.
void backward_task(const BackwardParams& bp, const BackwardTiles& tiles, Scratch& t,
                   const Task& task) {
  const AttentionParams& p = bp.forward;
  for (std::int64_t block = task.block_begin; block < task.block_end; ++block) {
    KeyBlock kv = start_key_block(p, tiles, t, task.b, task.h_kv, block);
    const RowBlocks row_blocks = row_blocks_that_see(p, tiles, kv);
    const std::int64_t group = task.b * p.heads_kv + task.h_kv;
    if (task.bias_sums != nullptr) task.bias_sums->wait_for_turn(group, block);
    for (std::int64_t g = 0; g < p.group_size(); ++g) {
      for (std::int64_t n = row_blocks.first; n < row_blocks.end; ++n) {
        // A pair that the bias and mask mask entirely adds nothing (its logits' gradient is 0,
        // which the dbias sums need not add: they start at +0 and never become −0).
        const std::int64_t row_begin = n * tiles.rows, head = task.h_kv * p.group_size() + g;
        if (!cpu::logits_keep_some(p, task.b, head, row_begin, row_begin + task.queries->rows(n),
                                   kv.begin, kv.end)) {
          continue;
        }
        const BlockPair pair = start_pair(bp, tiles, t, task, kv, g, n);
        probabilities_step(p, tiles, t, task, kv, pair);
        value_gradient_step(p, tiles, t, task, kv, pair);
        score_gradient_step(bp, tiles, t, task, kv, pair);
        gradients_step(bp, tiles, t, task, kv, pair);
      }
    }
    if (task.bias_sums != nullptr) task.bias_sums->mark_added(group, block);
    store_key_gradients(bp, tiles, t, task, kv);
  }
  fence_streams();
}

}  // namespace

void flash_backward(const BackwardParams& bp) {
  const AttentionParams& p = bp.forward;
  const std::int64_t D = p.head_dim, Dv = p.head_dim_v;
  const cpu::TileSizes sizes = cpu::flash_backward_tiles(p);
  const cpu::Bf16Products products = cpu::backward_bf16_products(p);
  // Written with plain stores, the three gradients' rows were first read from memory
  // (write-allocate); too large for the caches, they are streamed (docs/tuning.md).
  const std::int64_t gradient_bytes =
      static_cast<std::int64_t>(dtype_size(p.dtype)) *
      ((p.batch * p.seqlen_q * p.heads_q + p.batch * p.seqlen_kv * p.heads_kv) * D +
       p.batch * p.seqlen_kv * p.heads_kv * Dv);
  const BackwardTiles tiles{sizes.rows,
                            sizes.keys,
                            cpu::pad_to_lanes(D),
                            cpu::pad_to_lanes(Dv),
                            products,
                            cpu::stream_output(gradient_bytes, p.num_threads),
                            cpu::pad_to_amx_reduction(D),
                            cpu::pad_to_amx_reduction(Dv),
                            cpu::pad_to_amx_reduction(sizes.rows),
                            cpu::pad_to_amx_reduction(sizes.keys),
                            scores_stride(sizes.keys)};
  const std::int64_t kv_blocks = (p.seqlen_kv + tiles.keys - 1) / tiles.keys;
  const std::int64_t groups = p.batch * p.heads_kv;
  const std::int64_t chunks = cpu::flash_backward_chunks(p);
  const std::int64_t group_floats = p.group_size() * p.seqlen_q * tiles.dims_padded;

  // With one chunk per group (cpu::flash_backward_chunks) a task owns its group's query
  // rows: it lays out their Q, dO and D_i and sums their dQ in its thread's scratch, and writes
  // dQ at its end, instead of faulting in and streaming shared buffers (docs/tuning.md).
  // Several chunks share a group's rows: then those are laid out once before the tasks, each
  // chunk adds into its own dQ buffer ([chunk][batch][heads_kv][group][seqlen_q][Dp], zeroed by
  // its task), and the buffers are summed in chunk order after them.
  const bool task_owns_queries = chunks == 1;
  std::optional<QueryBlocks> shared_queries;
  hwy::AlignedFreeUniquePtr<float[]> dq_buffers;
  if (!task_owns_queries) {
    shared_queries.emplace(p, tiles, groups, false);
    dq_buffers = uninitialized_floats(chunks * groups * group_floats);
    const std::int64_t blocks = shared_queries->blocks_per_head();
    const std::int64_t count = groups * p.group_size() * blocks;
#pragma omp parallel for num_threads(p.num_threads) schedule(static)
    for (std::int64_t index = 0; index < count; ++index) {
      const std::int64_t group = index / (p.group_size() * blocks);
      const std::int64_t g = index / blocks % p.group_size(), n = index % blocks;
      shared_queries->pack(bp, group, group / p.heads_kv, group % p.heads_kv, g, n);
    }
  }

  std::optional<BiasGradientSums> bias_sums;
  if (bp.dbias.data != nullptr) bias_sums.emplace(bp, kv_blocks);

  // A failed task or scratch skips the tasks after it: none may then wait for its blocks.
  parallel_tasks(
      p.num_threads, groups * chunks,
      [&] {
        try {
          return Scratch(p, tiles, task_owns_queries);
        } catch (...) {
          if (bias_sums) bias_sums->abort();
          throw;
        }
      },
      [&](Scratch& scratch, std::int64_t index) {
        const std::int64_t group = index / chunks, chunk = index % chunks;
        const std::int64_t b = group / p.heads_kv, h_kv = group % p.heads_kv;
        Task task{.b = b,
                  .h_kv = h_kv,
                  .block_begin = chunk * kv_blocks / chunks,
                  .block_end = (chunk + 1) * kv_blocks / chunks,
                  .queries = nullptr,
                  .slot = 0,
                  .dq = nullptr,
                  .bias_sums = bias_sums ? &*bias_sums : nullptr};
        if (task_owns_queries) {
          for (std::int64_t g = 0; g < p.group_size(); ++g) {
            for (std::int64_t n = 0; n < scratch.queries->blocks_per_head(); ++n) {
              scratch.queries->pack(bp, 0, b, h_kv, g, n);
            }
          }
          task.queries = &*scratch.queries;
          task.dq = scratch.dq.get();
        } else {
          task.queries = &*shared_queries;
          task.slot = group;
          task.dq = dq_buffers.get() + (chunk * groups + group) * group_floats;
        }
        std::fill_n(task.dq, group_floats, 0.0f);
        try {
          backward_task(bp, tiles, scratch, task);
        } catch (...) {
          if (bias_sums) bias_sums->abort();
          throw;
        }
        if (!task_owns_queries) return;
        for (std::int64_t g = 0; g < p.group_size(); ++g) {
          const std::int64_t h = h_kv * p.group_size() + g;
          for (std::int64_t position = 0; position < p.seqlen_q; ++position) {
            if (position + kRowsAhead < p.seqlen_q) {
              prefetch_store_row(bp.dq, p.dtype, bp.dq_strides.offset(b, position + kRowsAhead, h),
                                 D, tiles.stream_gradients);
            }
            store_row_f32(bp.dq, p.dtype, bp.dq_strides.offset(b, position, h),
                          task.dq + (g * p.seqlen_q + position) * tiles.dims_padded, D,
                          tiles.stream_gradients);
          }
        }
        fence_streams();
      });
  if (bias_sums) bias_sums->store(bp.dbias);
  if (task_owns_queries) return;

#pragma omp parallel num_threads(p.num_threads)
  {
    // dQ = Σ over chunks in chunk order, summed into chunk 0's buffer and written once.
#pragma omp for schedule(static)
    for (std::int64_t index = 0; index < groups * p.group_size() * p.seqlen_q; ++index) {
      const std::int64_t group = index / (p.group_size() * p.seqlen_q);
      const std::int64_t within = index % (p.group_size() * p.seqlen_q);
      const std::int64_t g = within / p.seqlen_q, position = within % p.seqlen_q;
      float* row = dq_buffers.get() + group * group_floats + within * tiles.dims_padded;
      for (std::int64_t chunk = 1; chunk < chunks; ++chunk) {
        const float* partial = row + chunk * groups * group_floats;
        for (std::int64_t d = 0; d < D; ++d) row[d] += partial[d];
      }
      const std::int64_t b = group / p.heads_kv, h = (group % p.heads_kv) * p.group_size() + g;
      store_row_f32(bp.dq, p.dtype, bp.dq_strides.offset(b, position, h), row, D,
                    tiles.stream_gradients);
    }
    fence_streams();
  }
}

}  // namespace flashattn::detail
