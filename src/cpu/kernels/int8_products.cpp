// vpdpwssd products of 16-bit query codes and int8 key codes (see int8_products.hpp). Blocks of
// R query rows against K keys, R·K <= 16: per step of 32 dims, R code loads, K key loads widened
// to 16 bits (vpmovsxbw) and R·K vpdpwssd into one int32 accumulator per (row, key); then the R·K
// accumulators are summed across their lanes together, into one vector whose lane r·K + k is
// the (row r, key k) sum.

#include "cpu/kernels/int8_products.hpp"

// GCC 12 sees the undefined vectors that the AVX-512 unpack and shuffle intrinsics pass as
// their unused merge source as used uninitialized (-Wuninitialized, -Wmaybe-uninitialized, in the
// header's own lines).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string_view>

#include "util/memory_hints.hpp"

#define FLASHATTN_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

namespace flashattn::detail::cpu {
namespace {

constexpr std::int64_t kStepDims = 32;  // int16 lanes of a vector
constexpr std::int64_t kLineBytes = 64;

bool vnni_supported() {
  static const bool supported = __builtin_cpu_supports("avx512vnni") &&
                                __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vl");
  return supported;
}

Int8Products default_int8_products() {
  const std::vector<Int8Products> supported = supported_int8_products();
  if (const char* setting = std::getenv("FLASHATTN_INT8_PRODUCTS")) {
    for (Int8Products products : supported) {
      if (std::string_view(setting) == int8_products_name(products)) return products;
    }
  }
  return supported.back();
}

constexpr int kDefault = -1;
std::atomic<int> forced_int8_products{kDefault};

// Row k of x: strided, or at its own byte offset from the base.
inline const std::int8_t* row_of(const ScatteredRows& x, std::int64_t k) {
  const auto* base = static_cast<const std::int8_t*>(x.base);
  return x.byte_offsets != nullptr ? base + x.byte_offsets[k] : base + k * x.ld;
}

// acc += the products of a and b's 16-bit pairs, summed in pairs into acc's 32-bit lanes. In
// place, as the instruction is: GCC 12 copies the accumulator around the intrinsic's builtin,
// two moves per product.
FLASHATTN_VNNI_TARGET __attribute__((always_inline)) inline void dpwssd(__m512i& acc, __m512i a,
                                                                        __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
}

// The 16 int32 vectors v, each summed across its lanes, as the lanes of one vector (lane i: the
// sum of v[i]): pairs interleaved and added (32-bit, then 64-bit elements), which leaves each
// 128-bit block with 4 sums of its own block of each of 4 vectors, then the blocks added.
FLASHATTN_VNNI_TARGET __attribute__((always_inline)) inline __m512i sums_of_sixteen(
    const __m512i (&v)[16]) {
  __m512i pairs[8], quads[4];
  for (int i = 0; i < 8; ++i) {
    pairs[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                                _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    quads[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(pairs[2 * i], pairs[2 * i + 1]),
                                _mm512_unpackhi_epi64(pairs[2 * i], pairs[2 * i + 1]));
  }
  // quads[q] block b: the block-b sums of vectors 4q .. 4q + 3. Add blocks 0+1 and 2+3, then
  // the two halves, gathering vector 4q's four sums into block q.
  const __m512i half01 =
      _mm512_add_epi32(_mm512_shuffle_i32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_i32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i half23 =
      _mm512_add_epi32(_mm512_shuffle_i32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_i32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(half01, half23, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_i32x4(half01, half23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// One step of dot_block: dims [d, d + 32) (those of `mask`) of R rows and K keys.
template <int R, int K>
FLASHATTN_VNNI_TARGET __attribute__((always_inline)) inline void dot_step(
    __m512i (&sums)[R * K], const std::int16_t* codes, std::int64_t ld_codes,
    const std::int8_t* const* x, std::int64_t d, __mmask32 mask) {
  __m512i rows[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) rows[r] = _mm512_loadu_si512(codes + r * ld_codes + d);
#pragma GCC unroll 16
  for (int k = 0; k < K; ++k) {
    const __m512i key = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, x[k] + d));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      dpwssd(sums[r * K + k], rows[r], key);
    }
  }
}

// R rows against the K keys x[0, K) (rows of n int8 codes): out[r · out_stride + k]. `ahead`:
// null, or K rows of which a line is asked for per line of x's rows read.
template <int R, int K>
FLASHATTN_VNNI_TARGET __attribute__((always_inline)) inline void dot_block(
    float* out, std::int64_t out_stride, const std::int16_t* codes, std::int64_t ld_codes,
    __m512 lane_scales, const std::int8_t* const* x, std::int64_t n,
    const std::int8_t* const* ahead, bool into_l2) {
  static_assert(R * K <= 16);
  __m512i sums[R * K];
#pragma GCC unroll 16
  for (int i = 0; i < R * K; ++i) sums[i] = _mm512_setzero_si512();
  std::int64_t d = 0;
  for (; d + kStepDims <= n; d += kStepDims) {
    dot_step<R, K>(sums, codes, ld_codes, x, d, ~__mmask32{0});
    if (ahead != nullptr && d % kLineBytes == 0) {
#pragma GCC unroll 16
      for (int k = 0; k < K; ++k) {
        prefetch_line(reinterpret_cast<const char*>(ahead[k] + d), into_l2);
      }
    }
  }
  if (d < n) {
    dot_step<R, K>(sums, codes, ld_codes, x, d,
                   static_cast<__mmask32>((std::uint64_t{1} << (n - d)) - 1));
    if (ahead != nullptr && d % kLineBytes == 0) {
#pragma GCC unroll 16
      for (int k = 0; k < K; ++k) {
        prefetch_line(reinterpret_cast<const char*>(ahead[k] + d), into_l2);
      }
    }
  }
  __m512i all[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) all[i] = i < R * K ? sums[i] : _mm512_setzero_si512();
  // Lane r·K + k: row r's scale (lane_scales, from dot_rows_block) times the (r, k) sum.
  alignas(64) float results[16];
  _mm512_store_ps(results, _mm512_mul_ps(_mm512_cvtepi32_ps(sums_of_sixteen(all)), lane_scales));
  for (int r = 0; r < R; ++r) {
    for (int k = 0; k < K; ++k) out[r * out_stride + k] = results[r * K + k];
  }
}

// R rows against all x_count keys: K at a time, then one by one.
template <int R, int K>
FLASHATTN_VNNI_TARGET void dot_rows_block(float* out, std::int64_t out_stride,
                                          const std::int16_t* codes, std::int64_t ld_codes,
                                          const float* row_scales, const ScatteredRows& x,
                                          std::int64_t x_count, std::int64_t n,
                                          const ScatteredRows& ahead) {
  const std::int8_t* rows[K];
  const std::int8_t* ahead_rows[K];
  const bool has_ahead = ahead.base != nullptr;
  alignas(64) float scales[16] = {};
  for (int i = 0; i < R * K; ++i) scales[i] = row_scales[i / K];
  const __m512 lane_scales = _mm512_load_ps(scales);
  alignas(64) float tail_scales[16] = {};
  for (int r = 0; r < R; ++r) tail_scales[r] = row_scales[r];
  const __m512 tail_lane_scales = _mm512_load_ps(tail_scales);
  auto gather = [&](std::int64_t first, int count) {
    for (int i = 0; i < count; ++i) {
      rows[i] = row_of(x, first + i);
      if (has_ahead) ahead_rows[i] = row_of(ahead, first + i);
    }
  };
  std::int64_t k = 0;
  for (; k + K <= x_count; k += K) {
    gather(k, K);
    dot_block<R, K>(out + k, out_stride, codes, ld_codes, lane_scales, rows, n,
                    has_ahead ? ahead_rows : nullptr, ahead.into_l2);
  }
  for (; k < x_count; ++k) {
    gather(k, 1);
    dot_block<R, 1>(out + k, out_stride, codes, ld_codes, tail_lane_scales, rows, n,
                    has_ahead ? ahead_rows : nullptr, ahead.into_l2);
  }
}

}  // namespace

const char* int8_products_name(Int8Products products) {
  switch (products) {
    case Int8Products::widened:
      return "widened";
    case Int8Products::avx512_vnni:
      return "avx512_vnni";
  }
  return "unknown";
}

std::vector<Int8Products> supported_int8_products() {
  std::vector<Int8Products> supported{Int8Products::widened};
  if (vnni_supported()) supported.push_back(Int8Products::avx512_vnni);
  return supported;
}

Int8Products active_int8_products() {
  static const Int8Products default_products = default_int8_products();
  const int forced = forced_int8_products.load(std::memory_order_relaxed);
  return forced == kDefault ? default_products : static_cast<Int8Products>(forced);
}

void force_int8_products(std::optional<Int8Products> products) {
  forced_int8_products.store(products ? static_cast<int>(*products) : kDefault,
                             std::memory_order_relaxed);
}

float quantize_query_row(std::int16_t* codes, const float* row, std::int64_t n,
                         std::int64_t padded) {
  float max = 0.0f;
  bool finite = true;
  for (std::int64_t d = 0; d < n; ++d) {
    finite = finite && std::isfinite(row[d]);
    max = std::max(max, std::fabs(row[d]));
  }
  std::fill(codes, codes + padded, std::int16_t{0});
  if (!finite) return std::numeric_limits<float>::quiet_NaN();
  const float scale = max / static_cast<float>(kQueryCodeMax);
  if (scale == 0.0f) return 0.0f;
  const double limit = kQueryCodeMax;
  for (std::int64_t d = 0; d < n; ++d) {
    const double code = std::nearbyint(static_cast<double>(row[d]) / scale);
    codes[d] = static_cast<std::int16_t>(std::clamp(code, -limit, limit));
  }
  return scale;
}

// Blocks of 4 rows against 4 keys, then the rows left (3, 2 or 1) against 5, 8 or 16 keys: as
// many accumulators as one sums_of_sixteen takes. Only the first block of rows asks for the rows
// ahead.
void dot_rows_int8(float* out, std::int64_t out_stride, const std::int16_t* codes,
                   std::int64_t ld_codes, const float* row_scales, std::int64_t count,
                   const ScatteredRows& x, std::int64_t x_count, std::int64_t n,
                   const ScatteredRows& ahead) {
  std::int64_t r = 0;
  for (; r + 4 <= count; r += 4) {
    dot_rows_block<4, 4>(out + r * out_stride, out_stride, codes + r * ld_codes, ld_codes,
                         row_scales + r, x, x_count, n, r == 0 ? ahead : ScatteredRows{});
  }
  const ScatteredRows rest_ahead = r == 0 ? ahead : ScatteredRows{};
  out += r * out_stride;
  codes += r * ld_codes;
  row_scales += r;
  switch (count - r) {
    case 3:
      return dot_rows_block<3, 5>(out, out_stride, codes, ld_codes, row_scales, x, x_count, n,
                                  rest_ahead);
    case 2:
      return dot_rows_block<2, 8>(out, out_stride, codes, ld_codes, row_scales, x, x_count, n,
                                  rest_ahead);
    case 1:
      return dot_rows_block<1, 16>(out, out_stride, codes, ld_codes, row_scales, x, x_count, n,
                                   rest_ahead);
    default:
      return;
  }
}

}  // namespace flashattn::detail::cpu
