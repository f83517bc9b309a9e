#pragma once

// Rows of one head of a [B, S, H, D] tensor (any strides, f32/f16/bf16) copied into the fp32
// column-panel layouts the tile kernels stream (tile_kernels.hpp: packed_index). The forward
// packs K and V per K/V block, the backward K, V, Q and dO.

#include <cstdint>

#include "api/params.hpp"

namespace flashattn::detail::cpu {

// Rows [row_begin, row_begin + rows) of head h as [rows x dims_padded] column panels; dims from
// head_dim to dims_padded are 0.
void pack_rows(float* panels, const void* base, DType dtype, const Strides& strides, std::int64_t b,
               std::int64_t h, std::int64_t row_begin, std::int64_t rows, std::int64_t head_dim,
               std::int64_t dims_padded);

// The same rows transposed: [head_dim x rows_padded] column panels; rows from `rows` to
// rows_padded (a multiple of kTileLanes) are 0.
void pack_rows_transposed(float* panels, const void* base, DType dtype, const Strides& strides,
                          std::int64_t b, std::int64_t h, std::int64_t row_begin, std::int64_t rows,
                          std::int64_t rows_padded, std::int64_t head_dim);

// bf16 operands of the vdpbf16ps and AMX products (tile_kernels_bf16.hpp), bit patterns copied
// from bf16 inputs. Those products count a subnormal bf16 as zero, so each function returns
// whether it copied one: then the caller multiplies in fp32 instead.

// dst[0, n) = src[0, n)
bool copy_row_bf16(std::uint16_t* dst, const std::uint16_t* src, std::int64_t n);

// Kᵀ: rows [row_begin, row_begin + rows) of head h in panels of kPanelWidth rows, each dim pair
// of a row as one 32-bit word (bf16_key_index with dims_padded = reduction, even); rows up to
// rows_padded (a multiple of kTileLanes) and dims up to `reduction` are 0.
bool pack_rows_transposed_bf16(std::uint16_t* panels, const void* base, const Strides& strides,
                               std::int64_t b, std::int64_t h, std::int64_t row_begin,
                               std::int64_t rows, std::int64_t rows_padded, std::int64_t head_dim,
                               std::int64_t reduction);

// V: the same dim of two consecutive rows as one 32-bit word, in panels of kPanelWidth dims
// (bf16_value_index with keys_even = reduction, even); rows up to `reduction` and dims up to
// dims_padded are 0. Requires AVX512-BW (as the bf16 products do).
bool pack_row_pairs_bf16(std::uint16_t* panels, const void* base, const Strides& strides,
                         std::int64_t b, std::int64_t h, std::int64_t row_begin, std::int64_t rows,
                         std::int64_t reduction, std::int64_t head_dim, std::int64_t dims_padded);

}  // namespace flashattn::detail::cpu
