#include "cpu/pack.hpp"

#include <algorithm>

#include "cpu/tile_kernels.hpp"
#include "util/convert.hpp"

namespace flashattn::detail::cpu {

void prefetch_row(const void* base, DType dtype, std::int64_t offset, std::int64_t head_dim) {
  constexpr std::int64_t kLineBytes = 64;
  const std::int64_t element_bytes = static_cast<std::int64_t>(dtype_size(dtype));
  const char* first = static_cast<const char*>(base) + offset * element_bytes;
  for (std::int64_t byte = 0; byte < head_dim * element_bytes; byte += kLineBytes) {
    __builtin_prefetch(first + byte);
  }
  __builtin_prefetch(first + head_dim * element_bytes - 1);
}

void pack_rows(float* panels, const void* base, DType dtype, const Strides& strides, std::int64_t b,
               std::int64_t h, std::int64_t row_begin, std::int64_t rows, std::int64_t head_dim,
               std::int64_t dims_padded) {
  for (std::int64_t i = 0; i < rows; ++i) {
    if (i + kRowsAhead < rows) {
      prefetch_row(base, dtype, strides.offset(b, row_begin + i + kRowsAhead, h), head_dim);
    }
    const std::int64_t offset = strides.offset(b, row_begin + i, h);
    for (std::int64_t d0 = 0; d0 < dims_padded; d0 += kPanelWidth) {
      const std::int64_t width = std::min(kPanelWidth, dims_padded - d0);
      const std::int64_t loaded = std::clamp(head_dim - d0, std::int64_t{0}, width);
      float* dst = panels + packed_index(i, d0, rows, dims_padded);
      load_row_f32(dst, base, dtype, offset + d0, loaded);
      std::fill(dst + loaded, dst + width, 0.0f);
    }
  }
}

void pack_rows_transposed(float* panels, const void* base, DType dtype, const Strides& strides,
                          std::int64_t b, std::int64_t h, std::int64_t row_begin, std::int64_t rows,
                          std::int64_t rows_padded, std::int64_t head_dim) {
  // kTileLanes rows at a time, so that each store fills 64 contiguous bytes of one panel row.
  // Row by row, every store went to another cache line, ~9 cycles per element (the transpose
  // of K took 7.8% of the forward's time on the seed shape). f16 and bf16 rows are first
  // widened, kPanelWidth dims at a time, into `widened`.
  float widened[kTileLanes][kPanelWidth];
  const float* sources[kTileLanes];
  std::int64_t offsets[kTileLanes];
  for (std::int64_t j0 = 0; j0 < rows_padded; j0 += kTileLanes) {
    const std::int64_t width = std::min(kPanelWidth, rows_padded - j0 / kPanelWidth * kPanelWidth);
    float* columns = panels + packed_index(0, j0, head_dim, rows_padded);
    const std::int64_t loaded = std::clamp(rows - j0, std::int64_t{0}, kTileLanes);
    for (std::int64_t jj = 0; jj < loaded; ++jj) {
      offsets[jj] = strides.offset(b, row_begin + j0 + jj, h);
      if (j0 + kTileLanes + jj < rows) {
        prefetch_row(base, dtype, strides.offset(b, row_begin + j0 + kTileLanes + jj, h), head_dim);
      }
    }
    for (std::int64_t d0 = 0; d0 < head_dim; d0 += kPanelWidth) {
      const std::int64_t dims = std::min(kPanelWidth, head_dim - d0);
      for (std::int64_t jj = 0; jj < loaded; ++jj) {
        if (dtype == DType::f32) {
          sources[jj] = static_cast<const float*>(base) + offsets[jj] + d0;
        } else {
          load_row_f32(widened[jj], base, dtype, offsets[jj] + d0, dims);
          sources[jj] = widened[jj];
        }
      }
      for (std::int64_t d = 0; d < dims; ++d) {
        float* dst = columns + (d0 + d) * width;
        for (std::int64_t jj = 0; jj < loaded; ++jj) dst[jj] = sources[jj][d];
        for (std::int64_t jj = loaded; jj < kTileLanes; ++jj) dst[jj] = 0.0f;
      }
    }
  }
}

}  // namespace flashattn::detail::cpu
