#pragma once

// Rows of one head of a [B, S, H, D] tensor (any strides, f32/f16/bf16) copied into the fp32
// column-panel layouts the tile kernels stream (tile_kernels.hpp: packed_index). The forward
// packs K and V per K/V block, the backward K, V, Q and dO.

#include <cstdint>

#include "api/params.hpp"

namespace flashattn::detail::cpu {

// Rows of one head lie a sequence stride apart (H·D elements in [B, S, H, D]), usually 4 KiB
// or more, and the hardware prefetchers do not follow a stream across 4 KiB pages: each row's
// first line waited for memory. Copy loops ask for the row kRowsAhead rows on while copying
// one, so that those waits overlap.
inline constexpr std::int64_t kRowsAhead = 8;

// Asks for the head_dim elements at base + offset to be brought into the caches; returns at
// once.
void prefetch_row(const void* base, DType dtype, std::int64_t offset, std::int64_t head_dim);

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

}  // namespace flashattn::detail::cpu
