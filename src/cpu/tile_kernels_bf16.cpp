// vdpbf16ps tile products (see tile_kernels_bf16.hpp). Same register blocking as the fp32
// kernels: 4 rows x 4 vectors of fp32 accumulators while the reduction dimension streams in
// pairs; per pair step, 4 panel loads and 4 pair broadcasts feed 16 vdpbf16ps (512 MACs).

#include "cpu/tile_kernels_bf16.hpp"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "cpu/tile_kernels_amx.hpp"

#define FLASHATTN_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

namespace flashattn::detail::cpu {
namespace {

constexpr int kRows = 6;
constexpr std::int64_t kPanel = 64;  // keys (scores) or dims (P·V) per packed panel
constexpr std::int64_t kLanes = 16;

// A bf16 pair as one 32-bit pattern, for broadcasting.
inline std::int32_t load_pair(const std::uint16_t* pair) {
  std::int32_t bits;
  std::memcpy(&bits, pair, sizeof(bits));
  return bits;
}

// acc[R x C·16] (fp32, stored at out) = sum over pairs of a[R x 2·pairs] · b[pairs x C·16 x 2]
template <int R, int C, bool kAccumulate>
FLASHATTN_BF16_TARGET inline void DotBlock(float* out, std::int64_t ld_out, const std::uint16_t* a,
                                           std::int64_t ld_a, const std::uint16_t* b,
                                           std::int64_t ld_b_pairs, std::int64_t pairs,
                                           float scale) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      acc[r][c] =
          kAccumulate ? _mm512_loadu_ps(out + r * ld_out + c * kLanes) : _mm512_setzero_ps();
  for (std::int64_t m = 0; m < pairs; ++m) {
    __m512bh columns[C];
    for (int c = 0; c < C; ++c) {
      columns[c] = (__m512bh)_mm512_loadu_si512(b + (m * ld_b_pairs + c * kLanes) * 2);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh row_pair = (__m512bh)_mm512_set1_epi32(load_pair(a + r * ld_a + 2 * m));
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], row_pair, columns[c]);
    }
  }
  const __m512 scale_vec = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const __m512 value = kAccumulate ? acc[r][c] : _mm512_mul_ps(acc[r][c], scale_vec);
      _mm512_storeu_ps(out + r * ld_out + c * kLanes, value);
    }
}

// Rows [i, rows) of columns [j, j + C·16) of one panel: blocks of kRows rows, then what is left
// (at most 5 rows) in blocks of 4, 2 and 1. One row at a time costs C loads and a broadcast per
// C vdpbf16ps, and a 64-row tile of the backward has 4 such rows.
template <int C, bool kAccumulate>
FLASHATTN_BF16_TARGET inline void DotColumns(float* out, std::int64_t ld_out,
                                             const std::uint16_t* a, std::int64_t ld_a,
                                             const std::uint16_t* panel, std::int64_t width,
                                             std::int64_t j, std::int64_t rows, std::int64_t pairs,
                                             float scale) {
  std::int64_t i = 0;
  for (; i + kRows <= rows; i += kRows) {
    DotBlock<kRows, C, kAccumulate>(out + i * ld_out + j, ld_out, a + i * ld_a, ld_a, panel + 2 * j,
                                    width, pairs, scale);
  }
  if (rows - i >= 4) {
    DotBlock<4, C, kAccumulate>(out + i * ld_out + j, ld_out, a + i * ld_a, ld_a, panel + 2 * j,
                                width, pairs, scale);
    i += 4;
  }
  if (rows - i >= 2) {
    DotBlock<2, C, kAccumulate>(out + i * ld_out + j, ld_out, a + i * ld_a, ld_a, panel + 2 * j,
                                width, pairs, scale);
    i += 2;
  }
  if (rows - i >= 1) {
    DotBlock<1, C, kAccumulate>(out + i * ld_out + j, ld_out, a + i * ld_a, ld_a, panel + 2 * j,
                                width, pairs, scale);
  }
}

// All rows against one panel of `width` columns (a multiple of 16), panel kept in L1.
template <bool kAccumulate>
FLASHATTN_BF16_TARGET void DotPanel(float* out, std::int64_t ld_out, const std::uint16_t* a,
                                    std::int64_t ld_a, const std::uint16_t* panel,
                                    std::int64_t width, std::int64_t rows, std::int64_t pairs,
                                    float scale) {
  std::int64_t j = 0;
  for (; j + 4 * kLanes <= width; j += 4 * kLanes) {
    DotColumns<4, kAccumulate>(out, ld_out, a, ld_a, panel, width, j, rows, pairs, scale);
  }
  for (; j < width; j += kLanes) {
    DotColumns<1, kAccumulate>(out, ld_out, a, ld_a, panel, width, j, rows, pairs, scale);
  }
}

}  // namespace

bool bf16_products_supported() {
  static const bool supported = __builtin_cpu_supports("avx512bf16") &&
                                __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vl");
  return supported;
}

const char* bf16_products_name(Bf16Products products) {
  switch (products) {
    case Bf16Products::widened:
      return "widened";
    case Bf16Products::avx512_bf16:
      return "avx512_bf16";
    case Bf16Products::amx:
      return "amx";
  }
  return "unknown";
}

std::vector<Bf16Products> supported_bf16_products() {
  std::vector<Bf16Products> supported{Bf16Products::widened};
  if (bf16_products_supported()) supported.push_back(Bf16Products::avx512_bf16);
  if (amx_supported()) supported.push_back(Bf16Products::amx);
  return supported;
}

namespace {

// AMX where the CPU has it. Else vdpbf16ps on AMD CPUs, widening on Intel ones: the rate of a
// 512-bit vdpbf16ps against an fp32 FMA is a property of the core, twice the FLOPs of an FMA on
// Zen 5, half of them on Sapphire Rapids (docs/tuning.md). Decided by the vendor rather than
// timed at start-up, so that the choice, and with it the rounding of the results, is the same
// in every process on one machine.
Bf16Products default_bf16_products() {
  const std::vector<Bf16Products> supported = supported_bf16_products();
  if (const char* setting = std::getenv("FLASHATTN_BF16_PRODUCTS")) {
    for (Bf16Products products : supported) {
      if (std::string_view(setting) == bf16_products_name(products)) return products;
    }
  }
  if (supported.back() == Bf16Products::amx) return Bf16Products::amx;
  if (supported.back() == Bf16Products::avx512_bf16 && __builtin_cpu_is("amd")) {
    return Bf16Products::avx512_bf16;
  }
  return Bf16Products::widened;
}

constexpr int kDefault = -1;
std::atomic<int> forced_bf16_products{kDefault};

}  // namespace

Bf16Products active_bf16_products() {
  static const Bf16Products default_products = default_bf16_products();
  const int forced = forced_bf16_products.load(std::memory_order_relaxed);
  return forced == kDefault ? default_products : static_cast<Bf16Products>(forced);
}

void force_bf16_products(std::optional<Bf16Products> products) {
  forced_bf16_products.store(products ? static_cast<int>(*products) : kDefault,
                             std::memory_order_relaxed);
}

FLASHATTN_BF16_TARGET void scores_tile_bf16(float* scores, std::int64_t ld_scores,
                                            const std::uint16_t* q, std::int64_t ld_q,
                                            const std::uint16_t* k_packed, std::int64_t rows,
                                            std::int64_t keys_padded, std::int64_t dims_padded,
                                            float scale) {
  for (std::int64_t j = 0; j < keys_padded; j += kPanel) {
    const std::int64_t width = std::min(kPanel, keys_padded - j);
    DotPanel<false>(scores + j, ld_scores, q, ld_q, k_packed + j * dims_padded, width, rows,
                    dims_padded / 2, scale);
  }
}

FLASHATTN_BF16_TARGET void round_probabilities_bf16(std::uint16_t* p_bf16, std::int64_t ld_p_bf16,
                                                    const float* p, std::int64_t ld_p,
                                                    std::int64_t rows, std::int64_t keys_padded,
                                                    std::int64_t reduction) {
  for (std::int64_t i = 0; i < rows; ++i) {
    std::uint16_t* row = p_bf16 + i * ld_p_bf16;
    for (std::int64_t j = 0; j < keys_padded; j += kLanes) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_loadu_ps(p + i * ld_p + j));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + j), (__m256i)rounded);
    }
    std::fill(row + keys_padded, row + reduction, std::uint16_t{0});
  }
}

namespace {

// rows[0..15] = the transpose of rows[0..15] (16 x 16 fp32): pairs of rows interleaved, then
// pairs of pairs, so that each 128-bit lane holds 4 rows of one column; then lanes gathered
// across the registers. (The maskz forms with every lane selected are the plain instructions;
// g++ 12 warns inside the unmasked intrinsics, -Wmaybe-uninitialized.)
FLASHATTN_BF16_TARGET inline void transpose_16x16(__m512 rows[16]) {
  constexpr __mmask16 kAll16 = 0xffff;
  constexpr __mmask8 kAll8 = 0xff;
  __m512 pairs[16];
  for (int i = 0; i < 8; ++i) {
    pairs[2 * i] = _mm512_maskz_unpacklo_ps(kAll16, rows[2 * i], rows[2 * i + 1]);
    pairs[2 * i + 1] = _mm512_maskz_unpackhi_ps(kAll16, rows[2 * i], rows[2 * i + 1]);
  }
  // quads[4i + k], lane m: rows 4i..4i+3 of column 4m + k.
  __m512 quads[16];
  for (int i = 0; i < 4; ++i) {
    const __m512d lo_even = _mm512_castps_pd(pairs[4 * i]);
    const __m512d hi_even = _mm512_castps_pd(pairs[4 * i + 2]);
    const __m512d lo_odd = _mm512_castps_pd(pairs[4 * i + 1]);
    const __m512d hi_odd = _mm512_castps_pd(pairs[4 * i + 3]);
    quads[4 * i] = _mm512_castpd_ps(_mm512_maskz_unpacklo_pd(kAll8, lo_even, hi_even));
    quads[4 * i + 1] = _mm512_castpd_ps(_mm512_maskz_unpackhi_pd(kAll8, lo_even, hi_even));
    quads[4 * i + 2] = _mm512_castpd_ps(_mm512_maskz_unpacklo_pd(kAll8, lo_odd, hi_odd));
    quads[4 * i + 3] = _mm512_castpd_ps(_mm512_maskz_unpackhi_pd(kAll8, lo_odd, hi_odd));
  }
  for (int k = 0; k < 4; ++k) {
    const __m512 upper_low = _mm512_maskz_shuffle_f32x4(kAll16, quads[k], quads[4 + k], 0x44);
    const __m512 lower_low = _mm512_maskz_shuffle_f32x4(kAll16, quads[8 + k], quads[12 + k], 0x44);
    const __m512 upper_high = _mm512_maskz_shuffle_f32x4(kAll16, quads[k], quads[4 + k], 0xee);
    const __m512 lower_high = _mm512_maskz_shuffle_f32x4(kAll16, quads[8 + k], quads[12 + k], 0xee);
    rows[k] = _mm512_maskz_shuffle_f32x4(kAll16, upper_low, lower_low, 0x88);
    rows[4 + k] = _mm512_maskz_shuffle_f32x4(kAll16, upper_low, lower_low, 0xdd);
    rows[8 + k] = _mm512_maskz_shuffle_f32x4(kAll16, upper_high, lower_high, 0x88);
    rows[12 + k] = _mm512_maskz_shuffle_f32x4(kAll16, upper_high, lower_high, 0xdd);
  }
}

}  // namespace

FLASHATTN_BF16_TARGET void round_transposed_bf16(std::uint16_t* dst, std::int64_t ld_dst,
                                                 const float* src, std::int64_t ld_src,
                                                 std::int64_t rows, std::int64_t rows_padded,
                                                 std::int64_t columns) {
  __m512 block[kLanes];
  for (std::int64_t r = 0; r < rows_padded; r += kLanes) {
    for (std::int64_t c = 0; c < columns; c += kLanes) {
      for (std::int64_t i = 0; i < kLanes; ++i) {
        block[i] = r + i < rows ? _mm512_loadu_ps(src + (r + i) * ld_src + c) : _mm512_setzero_ps();
      }
      transpose_16x16(block);
      for (std::int64_t j = 0; j < kLanes; ++j) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (c + j) * ld_dst + r),
                            (__m256i)_mm512_cvtneps_pbh(block[j]));
      }
    }
  }
}

FLASHATTN_BF16_TARGET void accumulate_pv_tile_bf16(float* acc, std::int64_t ld_acc,
                                                   const std::uint16_t* p, std::int64_t ld_p,
                                                   const std::uint16_t* v_packed,
                                                   std::int64_t keys_even, std::int64_t rows,
                                                   std::int64_t dims_padded) {
  for (std::int64_t d = 0; d < dims_padded; d += kPanel) {
    const std::int64_t width = std::min(kPanel, dims_padded - d);
    DotPanel<true>(acc + d, ld_acc, p, ld_p, v_packed + d * keys_even, width, rows, keys_even / 2,
                   1.0f);
  }
}

void bf16_tile_product(Bf16Products products, float* c, std::int64_t ld_c, bool accumulate,
                       const std::uint16_t* a, std::int64_t ld_a, const std::uint16_t* b_packed,
                       std::int64_t rows, std::int64_t columns, std::int64_t reduction) {
  if (products == Bf16Products::amx) {
    amx_product(c, ld_c, accumulate, a, ld_a, b_packed, rows, columns, reduction);
  } else if (accumulate) {
    accumulate_pv_tile_bf16(c, ld_c, a, ld_a, b_packed, reduction, rows, columns);
  } else {
    scores_tile_bf16(c, ld_c, a, ld_a, b_packed, rows, columns, reduction, 1.0f);
  }
}

}  // namespace flashattn::detail::cpu
