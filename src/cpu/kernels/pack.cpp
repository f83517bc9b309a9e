#include "cpu/kernels/pack.hpp"

#include <immintrin.h>

#include <algorithm>

#include "cpu/kernels/tile_kernels.hpp"
#include "util/convert.hpp"

namespace flashattn::detail::cpu {

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
  // kTileLanes rows at a time, so that each store fills 64 contiguous bytes of one panel row:
  // row by row, every store went to another cache line (docs/tuning.md). f16 and bf16 rows are
  // first widened, kPanelWidth dims at a time, into `widened`.
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
      transpose_rows(columns + d0 * width, width, sources, loaded, dims);
    }
  }
}

namespace {

// Whether any of values[0, n) is a subnormal bf16 (exponent bits 0, mantissa not). Branch-free
// so that the loop vectorizes.
bool has_subnormal_bf16(const std::uint16_t* values, std::int64_t n) {
  constexpr std::uint16_t kExponent = 0x7f80, kMantissa = 0x007f;
  unsigned found = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    found |= static_cast<unsigned>((values[i] & kExponent) == 0) &
             static_cast<unsigned>((values[i] & kMantissa) != 0);
  }
  return found != 0;
}

}  // namespace

bool copy_row_bf16(std::uint16_t* dst, const std::uint16_t* src, std::int64_t n) {
  std::copy_n(src, n, dst);
  return has_subnormal_bf16(dst, n);
}

bool pack_rows_transposed_bf16(std::uint16_t* panels, const void* base, const Strides& strides,
                               std::int64_t b, std::int64_t h, std::int64_t row_begin,
                               std::int64_t rows, std::int64_t rows_padded, std::int64_t head_dim,
                               std::int64_t reduction) {
  // As pack_rows_transposed: kTileLanes rows at a time, each copied (zero-padded) into `staged`,
  // kPanelWidth dim pairs at a time, then written out one panel row of 16 words per pair.
  const auto* source = static_cast<const std::uint16_t*>(base);
  const std::int64_t pairs = reduction / 2;
  std::uint16_t staged[kTileLanes][2 * kPanelWidth];
  std::int64_t offsets[kTileLanes];
  bool subnormal = false;
  for (std::int64_t j0 = 0; j0 < rows_padded; j0 += kTileLanes) {
    const std::int64_t panel_begin = j0 / kPanelWidth * kPanelWidth;
    const std::int64_t width = std::min(kPanelWidth, rows_padded - panel_begin);
    std::uint16_t* columns = panels + (panel_begin * pairs + (j0 - panel_begin)) * 2;
    const std::int64_t loaded = std::clamp(rows - j0, std::int64_t{0}, kTileLanes);
    for (std::int64_t jj = 0; jj < loaded; ++jj) {
      offsets[jj] = strides.offset(b, row_begin + j0 + jj, h);
      if (j0 + kTileLanes + jj < rows) {
        prefetch_row(base, DType::bf16, strides.offset(b, row_begin + j0 + kTileLanes + jj, h),
                     head_dim);
      }
    }
    for (std::int64_t m0 = 0; m0 < pairs; m0 += kPanelWidth) {
      const std::int64_t chunk = std::min(kPanelWidth, pairs - m0);
      const std::int64_t dims = std::clamp(head_dim - 2 * m0, std::int64_t{0}, 2 * chunk);
      for (std::int64_t jj = 0; jj < kTileLanes; ++jj) {
        std::uint16_t* row = staged[jj];
        const std::int64_t copied = jj < loaded ? dims : 0;
        if (copied > 0) subnormal |= copy_row_bf16(row, source + offsets[jj] + 2 * m0, copied);
        std::fill(row + copied, row + 2 * chunk, std::uint16_t{0});
      }
      for (std::int64_t m = 0; m < chunk; ++m) {
        std::uint16_t* dst = columns + (m0 + m) * width * 2;
        for (std::int64_t jj = 0; jj < kTileLanes; ++jj) {
          dst[2 * jj] = staged[jj][2 * m];
          dst[2 * jj + 1] = staged[jj][2 * m + 1];
        }
      }
    }
  }
  return subnormal;
}

// With AVX512-BW, which every CPU with bf16 products has (tile_kernels_bf16.hpp): per pair of
// rows, 32 dims of each in one register, interleaved by one permute per 16 dims, and the
// subnormal test on the same registers; element by element was too slow on AMX (docs/tuning.md).
__attribute__((target("avx512f,avx512bw"))) bool pack_row_pairs_bf16(
    std::uint16_t* panels, const void* base, const Strides& strides, std::int64_t b, std::int64_t h,
    std::int64_t row_begin, std::int64_t rows, std::int64_t reduction, std::int64_t head_dim,
    std::int64_t dims_padded) {
  constexpr std::int64_t kChunk = 32;  // bf16 per register
  const auto* source = static_cast<const std::uint16_t*>(base);
  // Word 2i of the low half takes dim i of the first row, word 2i + 1 dim i of the second; the
  // high half the same for dims 16..31.
  alignas(64) std::uint16_t low_index[kChunk], high_index[kChunk];
  for (int i = 0; i < kChunk; ++i) {
    low_index[i] = static_cast<std::uint16_t>(i / 2 + (i % 2) * kChunk);
    high_index[i] = static_cast<std::uint16_t>(low_index[i] + kChunk / 2);
  }
  const __m512i low = _mm512_load_si512(low_index), high = _mm512_load_si512(high_index);
  const __m512i exponent = _mm512_set1_epi16(0x7f80), mantissa = _mm512_set1_epi16(0x007f);
  __mmask32 subnormal = 0;
  for (std::int64_t pair = 0; pair < reduction / 2; ++pair) {
    const std::uint16_t* pair_rows[2];
    for (std::int64_t e = 0; e < 2; ++e) {
      const std::int64_t row = 2 * pair + e;
      pair_rows[e] = row < rows ? source + strides.offset(b, row_begin + row, h) : nullptr;
      if (row + 2 * kRowsAhead < rows) {
        prefetch_row(base, DType::bf16, strides.offset(b, row_begin + row + 2 * kRowsAhead, h),
                     head_dim);
      }
    }
    for (std::int64_t d0 = 0; d0 < dims_padded; d0 += kPanelWidth) {
      const std::int64_t width = std::min(kPanelWidth, dims_padded - d0);
      std::uint16_t* dst = panels + d0 * reduction + pair * width * 2;
      for (std::int64_t c = 0; c < width; c += kChunk) {
        const std::int64_t valid = std::clamp(head_dim - d0 - c, std::int64_t{0}, kChunk);
        const __mmask32 lanes = static_cast<__mmask32>((std::uint64_t{1} << valid) - 1);
        __m512i halves[2];
        for (std::int64_t e = 0; e < 2; ++e) {
          halves[e] = pair_rows[e] ? _mm512_maskz_loadu_epi16(lanes, pair_rows[e] + d0 + c)
                                   : _mm512_setzero_si512();
          subnormal |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(halves[e], exponent),
                                               _mm512_setzero_si512()) &
                       _mm512_test_epi16_mask(halves[e], mantissa);
        }
        _mm512_storeu_si512(dst + 2 * c, _mm512_permutex2var_epi16(halves[0], low, halves[1]));
        if (c + kChunk / 2 < width) {
          _mm512_storeu_si512(dst + 2 * c + kChunk,
                              _mm512_permutex2var_epi16(halves[0], high, halves[1]));
        }
      }
    }
  }
  return subnormal != 0;
}

}  // namespace flashattn::detail::cpu
