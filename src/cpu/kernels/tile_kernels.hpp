#pragma once

// The FlashAttention inner steps on one (Q block, K/V block) tile, each a separate function so
// that one can be replaced without touching the driver. Each is compiled once per SIMD target
// (Highway: SSSE3, SSE4, AVX2, AVX-512 and a portable fallback) and picked at run time for the
// CPU at hand. Tiles are fp32:
//   q        [rows x head_dim]        the query block, row-major or in column panels (RowsOperand)
//   k_packed Kᵀ [head_dim x keys_padded] in column panels (packed_index), keys zero-padded
//   v_packed V [keys x dims_padded] in column panels (packed_index), dims zero-padded
//   scores   [rows x ld_scores]       scores, then probabilities, in place, row-major
//   acc      [rows x ld_acc]          unnormalized output accumulator, row-major
// `keys_padded` and `dims_padded` are multiples of kTileLanes.

#include <cstdint>
#include <string>
#include <vector>

#include "flashattn/tensor.hpp"

namespace flashattn::detail::cpu {

// Row widths are padded to this many floats: a whole number of vectors on every target
// (AVX-512 holds 16 floats).
inline constexpr std::int64_t kTileLanes = 16;

constexpr std::int64_t pad_to_lanes(std::int64_t n) {
  return (n + kTileLanes - 1) / kTileLanes * kTileLanes;
}

// Packed operands are stored as column panels of kPanelWidth floats: panel after panel, each
// holding all rows of its columns contiguously. A kernel streams one panel (32 KiB for 128 rows)
// from L1 while every row block of the other operand passes over it; row-major rows 512 bytes
// apart would instead alias into half of L1's sets.
inline constexpr std::int64_t kPanelWidth = 64;

// Partial sums. A product kernel sums a long reduction in partial sums, which it then adds in
// turn: one chain through every term rounds as often into the same growing sum, and its error
// then grows with the length faster than sgemm's (OpenBLAS's kernels sum blocks of a few hundred
// along the reduced dimension). scores_tile sums at most kDimsPerPartialSum head dims at a time;
// the P·V kernels add each call's products, summed from zero, to acc (the forward's acc runs
// through every key of a row, dK and dV through every query row), for the same loads and stores
// and one more add per vector. Up to 256 head dims, every head dim in use, the scores are the
// one chain they were, bit for bit. The bf16 products (tile_kernels_bf16.hpp,
// tile_kernels_amx.hpp) keep their chains: the rounding of their bf16 operands outweighs the
// sums'. A multiple of kPanelWidth. Errors before and after, and speed: docs/tuning.md.
inline constexpr std::int64_t kDimsPerPartialSum = 256;
static_assert(kDimsPerPartialSum % kPanelWidth == 0);

// Index of element (row, col) of a [rows x cols_padded] matrix packed in column panels.
constexpr std::int64_t packed_index(std::int64_t row, std::int64_t col, std::int64_t rows,
                                    std::int64_t cols_padded) {
  const std::int64_t panel_begin = col / kPanelWidth * kPanelWidth;
  const std::int64_t width =
      cols_padded - panel_begin < kPanelWidth ? cols_padded - panel_begin : kPanelWidth;
  return panel_begin * rows + row * width + (col - panel_begin);
}

// The left operand of scores_tile, rows of head_dim floats: row-major (row r at data + r·ld,
// packed_rows = 0), or the column panels of a [packed_rows x ld] matrix (packed_index,
// ld = its padded width), as the backward packs Q and dO for its other products.
struct RowsOperand {
  const float* data;
  std::int64_t ld;
  std::int64_t packed_rows = 0;
};

// dst[d · ld_dst + r] = rows[r][d] for r < count, d < n, and 0 for r in [count, kTileLanes):
// up to kTileLanes rows transposed into columns of kTileLanes floats, as pack_rows_transposed
// lays out Kᵀ and Vᵀ (pack.hpp).
void transpose_rows(float* dst, std::int64_t ld_dst, const float* const* rows, std::int64_t count,
                    std::int64_t n);

// scores[:, :keys_padded] = q · Kᵀ, unscaled: the softmax steps below take the scale
//                                                                     [rows x keys_padded]
void scores_tile(float* scores, std::int64_t ld_scores, const RowsOperand& q, const float* k_packed,
                 std::int64_t rows, std::int64_t keys_padded, std::int64_t head_dim);
// The same for the columns [column_begin, column_end) of the Kᵀ packed for keys_padded keys
// (multiples of kTileLanes), the other columns of scores untouched: the keys that a few rows of a
// partly visible block see (flash_forward.cpp).
void scores_tile_columns(float* scores, std::int64_t ld_scores, const RowsOperand& q,
                         const float* k_packed, std::int64_t rows, std::int64_t keys_padded,
                         std::int64_t head_dim, std::int64_t column_begin, std::int64_t column_end);

// Online softmax over one tile of unscaled scores s (Milakov & Gimelshein 2018;
// FlashAttention-2, Alg. 1): per row m_new = max(m, rowmax(s)); p = exp(scale·(s - m_new));
// l = l·exp(scale·(m - m_new)) + rowsum(p); the accumulator row is rescaled by
// exp(scale·(m - m_new)) only when the max grew. m is the running max of the unscaled scores
// (the row's lse is scale·m + log(l)); scale > 0. Masked scores are -inf and give p = 0; a row
// whose scores are all -inf so far keeps m = -inf (the lowest float on Highway's EMU128 target,
// whose max reduction starts there: the same p, l and lse), l = 0 and never computes
// (-inf) - (-inf). A NaN score makes its row NaN.
void online_softmax_tile(float* scores, std::int64_t ld_scores, float scale, float* row_max,
                         float* row_sum, float* acc, std::int64_t ld_acc, std::int64_t rows,
                         std::int64_t keys_padded, std::int64_t dims_padded);

// acc[:, :dims_padded] += p[:, key_begin:key_end] · V[key_begin:key_end]   [rows x dims_padded]
// V is the packed [packed_keys x dims_padded] value tile; p points at column 0 of the tile.
void accumulate_pv_tile(float* acc, std::int64_t ld_acc, const float* p, std::int64_t ld_p,
                        const float* v_packed, std::int64_t packed_keys, std::int64_t key_begin,
                        std::int64_t key_end, std::int64_t rows, std::int64_t dims_padded);

// Backward: acc[:columns, :dims_padded] += pᵀ · V, where p is [packed_rows x columns] row-major
// (ld_p) and V the packed [packed_rows x dims_padded] tile: dV += Pᵀ·dO and dK += dSᵀ·Q without
// a transposed copy of P or dS.
void accumulate_transposed_pv_tile(float* acc, std::int64_t ld_acc, const float* p,
                                   std::int64_t ld_p, const float* v_packed,
                                   std::int64_t packed_rows, std::int64_t columns,
                                   std::int64_t dims_padded);

// Backward: unscaled scores -> probabilities from the forward's logsumexp,
// p = exp(scale·s - lse_row) in place. Masked scores (-inf) give 0; so does every score of a row
// whose lse is -inf (no visible key).
void probabilities_from_lse_tile(float* scores, std::int64_t ld_scores, float scale,
                                 const float* lse, std::int64_t rows, std::int64_t keys_padded);

// Backward: dP -> dS = scale · P ∘ (dP - delta_row) in place, delta_row = rowsum(dO ∘ O).
void softmax_gradient_tile(float* dp, std::int64_t ld_dp, const float* p, std::int64_t ld_p,
                           const float* row_delta, float scale, std::int64_t rows,
                           std::int64_t keys_padded);

// Rows of the decode products' second operand: `ld` elements apart from base, or, where
// byte_offsets is given, row k at byte_offsets[k] bytes from base (the rows of a paged cache
// that cross a page; the offsets serve every KV head's rows). A null base is no rows. Taken by
// reference: a copy of rows just written misses store forwarding (docs/tuning.md).
struct ScatteredRows {
  const void* base = nullptr;
  std::int64_t ld = 0;
  const std::int64_t* byte_offsets = nullptr;
  // Rows ahead (asked for, not read): whether into L2 (prefetcht1) rather than L1.
  bool into_l2 = false;
};

// Decode (few query rows against a long key sequence, flash_decode.cpp): fp32 rows padded with
// zeros to n, a multiple of kTileLanes, against the x_count rows x[k] of n elements, of dtype
// x_dtype (widened exactly in registers; a quantized dtype's codes unscaled):
// out[r · out_stride + k] = rows[r · ld_rows .. + n) · x[k][0 .. n)   r < count, k < x_count
void dot_rows(float* out, std::int64_t out_stride, const float* rows, std::int64_t ld_rows,
              std::int64_t count, const ScatteredRows& x, DType x_dtype, std::int64_t x_count,
              std::int64_t n, const ScatteredRows& ahead = {});
// acc[r · ld_acc + d] += Σ_k weights[r · weight_stride + k] · x[k][d]   r < count, d < n
void axpy_rows(float* acc, std::int64_t ld_acc, const float* weights, std::int64_t weight_stride,
               std::int64_t count, const ScatteredRows& x, DType x_dtype, std::int64_t x_count,
               std::int64_t n, const ScatteredRows& ahead = {});

// The same two products on bf16 x rows with the fp32 operand (rows, acc) in bf16 pair order:
// each chunk of bf16_pair_chunk() elements (2 vectors of the SIMD target that runs) holds its
// even-indexed elements, then its odd-indexed ones, the order in which a shift and a mask widen
// a vector of bf16 pairs without a shuffle (tile_kernels.cpp: Bf16Pairs). n is a multiple of
// the chunk. The sums are those of dot_rows and axpy_rows, added in another order.
// ahead, if given: x_count rows that a later call will take, whose lines are asked for
// (prefetcht0) as the same lines of x are read: the decode path's prefetching spread over the
// products rather than issued all at once before them (flash_decode.cpp: KeyWalk). Given in the
// other form than x (strided, or with offsets) they are not asked for.
std::int64_t bf16_pair_chunk();
void to_bf16_pair_order(float* dst, const float* src, std::int64_t n);
void from_bf16_pair_order(float* dst, const float* src, std::int64_t n);
void dot_rows_bf16_pairs(float* out, std::int64_t out_stride, const float* rows,
                         std::int64_t ld_rows, std::int64_t count, const ScatteredRows& x,
                         std::int64_t x_count, std::int64_t n, const ScatteredRows& ahead = {});
void axpy_rows_bf16_pairs(float* acc, std::int64_t ld_acc, const float* weights,
                          std::int64_t weight_stride, std::int64_t count, const ScatteredRows& x,
                          std::int64_t x_count, std::int64_t n, const ScatteredRows& ahead = {});

// Whether no element of values[0, n) is an infinity or NaN (of fp32 values, of bf16 bit
// patterns): the backward asks it of each packed block (cpu/kernels/visible_gradients.hpp).
bool all_finite(const float* values, std::int64_t n);
bool all_finite_bf16(const std::uint16_t* values, std::int64_t n);

// The SIMD targets compiled into the library that this CPU supports, best first, and a way to
// pin dispatch to one of them (0 restores the default: the best). For tests and benchmarks.
struct SimdTarget {
  std::int64_t id;
  std::string name;
};
std::vector<SimdTarget> supported_simd_targets();
void force_simd_target(std::int64_t id);
std::string active_simd_target();

}  // namespace flashattn::detail::cpu
