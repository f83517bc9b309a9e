#pragma once

// bf16 tile products with AVX512-BF16's vdpbf16ps, which multiplies pairs of bf16 and adds both
// products into one fp32 lane: twice the multiply-adds of an fp32 FMA per instruction. Highway
// 1.0.3 does not emit it, so these two kernels are written with intrinsics in functions compiled
// for that ISA (docs/design.md, "Dependencies") and used only when the CPU reports avx512bf16.
//
// Operands are bf16 bit patterns (std::uint16_t) packed so that each 32-bit lane holds a pair
// along the reduction dimension:
//   q        [rows x ld_q]                    row-major, head_dim zero-padded to ld_q (even)
//   k_packed Kᵀ in panels of kPanelWidth keys: panel, then d-pair, then key, then pair element
//   p        [rows x ld_p]                    row-major probabilities, keys zero-padded to even
//   v_packed V in panels of kPanelWidth dims: panel, then key-pair, then dim, then pair element
// Accumulation is fp32 throughout.

#include <cstdint>

namespace flashattn::detail::cpu {

// Whether this CPU runs these kernels (AVX512-BF16 with AVX512-BW and -VL).
bool bf16_products_supported();

// Index of k(key, d) in k_packed for a tile of keys_padded keys and dims_padded (even) dims.
constexpr std::int64_t bf16_key_index(std::int64_t key, std::int64_t d, std::int64_t keys_padded,
                                      std::int64_t dims_padded) {
  const std::int64_t panel_begin = key / 64 * 64;
  const std::int64_t width = keys_padded - panel_begin < 64 ? keys_padded - panel_begin : 64;
  return panel_begin * dims_padded + ((d / 2) * width + (key - panel_begin)) * 2 + d % 2;
}

// Index of v(key, d) in v_packed for a tile of keys_even (even) keys and dims_padded dims.
constexpr std::int64_t bf16_value_index(std::int64_t key, std::int64_t d, std::int64_t keys_even,
                                        std::int64_t dims_padded) {
  const std::int64_t panel_begin = d / 64 * 64;
  const std::int64_t width = dims_padded - panel_begin < 64 ? dims_padded - panel_begin : 64;
  return panel_begin * keys_even + ((key / 2) * width + (d - panel_begin)) * 2 + key % 2;
}

// scores[:, :keys_padded] = scale · q · Kᵀ (fp32 out)
void scores_tile_bf16(float* scores, std::int64_t ld_scores, const std::uint16_t* q,
                      std::int64_t ld_q, const std::uint16_t* k_packed, std::int64_t rows,
                      std::int64_t keys_padded, std::int64_t dims_padded, float scale);

// p_bf16[:, :keys_padded] = bf16(p[:, :keys_padded]), rounded to nearest even, and
// p_bf16[:, keys_padded:reduction] = 0 (the zero padding of the P·V reduction); both multiples
// of 16.
void round_probabilities_bf16(std::uint16_t* p_bf16, std::int64_t ld_p_bf16, const float* p,
                              std::int64_t ld_p, std::int64_t rows, std::int64_t keys_padded,
                              std::int64_t reduction);

// dst[c][r] = bf16(src[r][c]) for r < rows, and 0 for r in [rows, rows_padded), for every
// c < columns: the transpose of an fp32 tile [rows x columns] rounded to nearest even, as the
// left operand of a product that reduces over its rows (the backward's Pᵀ·dO and dSᵀ·Q).
// rows_padded and columns are multiples of 16.
void round_transposed_bf16(std::uint16_t* dst, std::int64_t ld_dst, const float* src,
                           std::int64_t ld_src, std::int64_t rows, std::int64_t rows_padded,
                           std::int64_t columns);

// acc[:, :dims_padded] += p · V over keys [0, keys_even)
void accumulate_pv_tile_bf16(float* acc, std::int64_t ld_acc, const std::uint16_t* p,
                             std::int64_t ld_p, const std::uint16_t* v_packed,
                             std::int64_t keys_even, std::int64_t rows, std::int64_t dims_padded);

}  // namespace flashattn::detail::cpu
