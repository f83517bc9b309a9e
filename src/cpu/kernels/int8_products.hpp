#pragma once

// The decode path's scores against an int8 cache's keys in integers (flash_decode.cpp): each
// query row rounded once to 16-bit integer codes with a scale of its own, then multiplied by the
// keys' int8 codes with vpdpwssd (AVX512-VNNI), 32 products an instruction where the widened
// products take 16 FMAs of fp32, and exact: the sums are integers, in int32 without overflow
// (below). The choice follows the CPU, never a timing, and the rounding of q comes with it
// (docs/semantics.md, "Quantized KV caches").

#include <cstdint>
#include <optional>
#include <vector>

#include "cpu/kernels/tile_kernels.hpp"

namespace flashattn::detail::cpu {

// How the decode path multiplies q by an int8 cache's keys: widened to fp32 (any CPU, q as it
// is), or with q's rows as 16-bit codes on vpdpwssd.
enum class Int8Products { widened, avx512_vnni };

const char* int8_products_name(Int8Products products);

// The ways this CPU supports, `widened` first.
std::vector<Int8Products> supported_int8_products();

// avx512_vnni where supported; FLASHATTN_INT8_PRODUCTS=widened|avx512_vnni picks another
// supported one (read once), and tests pin one with force_int8_products (std::nullopt restores
// the default; not thread-safe against concurrent attention calls).
Int8Products active_int8_products();
void force_int8_products(std::optional<Int8Products> products);

// The largest query code, and with it the largest head dim the integer products take: each sum
// is at most head_dim · kQueryCodeMax · 128 in magnitude (a cache's code may be -128), below
// 2^31 up to 512 dims.
constexpr std::int32_t kQueryCodeMax = 32767;
constexpr std::int64_t kMaxInt8ProductDims = 512;

// codes[0, padded) from row[0, n): code = row / scale rounded to the nearest integer (ties to
// even), scale = max|row| / kQueryCodeMax; codes past n are 0. Returns the scale: 0 for a row of
// zeros, NaN for a row with a non-finite value (whose codes are then 0), so that its scores are
// NaN as q·k's would be.
float quantize_query_row(std::int16_t* codes, const float* row, std::int64_t n,
                         std::int64_t padded);

// out[r · out_stride + k] = row_scales[r] · Σ_d codes[r · ld_codes + d] · x[k][d] for r < count,
// k < x_count, d < n (n <= kMaxInt8ProductDims): the integer sums exact, then one rounding to
// fp32 and one of the product by the row's scale. x: int8 rows where they lie (ScatteredRows);
// `ahead`, if given, x_count rows like them whose lines are asked for as these are read
// (Prefetching::kSpread in flash_decode.cpp). Requires avx512_vnni among the supported ways.
void dot_rows_int8(float* out, std::int64_t out_stride, const std::int16_t* codes,
                   std::int64_t ld_codes, const float* row_scales, std::int64_t count,
                   const ScatteredRows& x, std::int64_t x_count, std::int64_t n,
                   const ScatteredRows& ahead = {});

}  // namespace flashattn::detail::cpu
