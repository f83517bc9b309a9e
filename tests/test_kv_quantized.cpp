// Quantized KV caches (flashattn/kvcache.hpp, KVCacheView's scales; docs/semantics.md,
// "Quantized KV caches"): the fp8 formats against a brute-force nearest-code oracle, the int8
// quantizer against its definition, and kvcache_attention_forward over int8 and fp8 caches
// against the fp64 reference computed on the dequantized cache, dense and paged, with appends
// quantized in place; zero, tiny, huge and non-finite rows; bad input.
//
// Tolerance: the output is the attention of q over the dequantized cache (code · scale). The
// reference takes those values rounded once to fp32 (relative 2^-24 per element, inside the
// scores' u32 term), and the bound is test_kvcache.cpp's. A 16-bit q adds the rounding of the
// gathered rows to its dtype where the call gathers (more than 32 query rows per KV head, the
// standard and reference paths): K's moves each score by u_q·scale·D·max|q|·max|k| and so the
// output by twice that times max|v|, V's the output by u_q·max|v|. Over an int8 cache with a
// scale per row the decode path may multiply q's rows rounded to 16-bit codes
// (cpu/kernels/int8_products.hpp), each element by at most u_c = 1/(2·32767) of its row's max|q|:
// u_c·scores more on each score, so 2·u_c·scores·max|v| on the output and u_c·scores on the lse;
// both ways (with and without the integer products) are run where the CPU has them.

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <numeric>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/kernels/cache_rows.hpp"
#include "cpu/kernels/int8_products.hpp"
#include "flashattn/kvcache.hpp"
#include "test_support.hpp"
#include "util/quantize.hpp"

namespace flashattn::testing {
namespace {

constexpr double kU32 = 0x1p-24;
// The rounding of q's rows to the integer products' codes, relative to the row's max|q|.
constexpr double kQueryCodeRoundoff = 0.5 / detail::cpu::kQueryCodeMax;

// The finite values of an fp8 format, by code.
std::vector<std::pair<float, int>> finite_codes(DType dtype) {
  std::vector<std::pair<float, int>> values;
  for (int code = 0; code < 256; ++code) {
    const auto byte = static_cast<std::uint8_t>(code);
    const float value =
        dtype == DType::fp8_e4m3 ? f32_from_fp8_e4m3(byte) : f32_from_fp8_e5m2(byte);
    if (std::isfinite(value)) values.emplace_back(value, code);
  }
  return values;
}

std::uint8_t to_fp8(DType dtype, float value) {
  return dtype == DType::fp8_e4m3 ? fp8_e4m3_from_f32(value) : fp8_e5m2_from_f32(value);
}
float from_fp8(DType dtype, std::uint8_t code) {
  return dtype == DType::fp8_e4m3 ? f32_from_fp8_e4m3(code) : f32_from_fp8_e5m2(code);
}

TEST(Fp8, DecodesAsTheFormatsDefine) {
  // E4M3: bias 7, subnormals m·2^-9, S.1111.111 NaN, no infinities; E5M2 as IEEE half's top byte.
  EXPECT_EQ(f32_from_fp8_e4m3(0x00), 0.0f);
  EXPECT_EQ(f32_from_fp8_e4m3(0x01), 0x1p-9f);
  EXPECT_EQ(f32_from_fp8_e4m3(0x08), 0x1p-6f);
  EXPECT_EQ(f32_from_fp8_e4m3(0x38), 1.0f);
  EXPECT_EQ(f32_from_fp8_e4m3(0x7e), 448.0f);
  EXPECT_EQ(f32_from_fp8_e4m3(0xfe), -448.0f);
  EXPECT_TRUE(std::isnan(f32_from_fp8_e4m3(0x7f)));
  EXPECT_TRUE(std::isnan(f32_from_fp8_e4m3(0xff)));
  EXPECT_EQ(f32_from_fp8_e4m3(0x78), 256.0f);  // exponent 15 is a binade, not infinity
  EXPECT_EQ(f32_from_fp8_e5m2(0x01), 0x1p-16f);
  EXPECT_EQ(f32_from_fp8_e5m2(0x3c), 1.0f);
  EXPECT_EQ(f32_from_fp8_e5m2(0x7b), 57344.0f);
  EXPECT_EQ(f32_from_fp8_e5m2(0x7c), INFINITY);
  EXPECT_TRUE(std::isnan(f32_from_fp8_e5m2(0x7e)));
}

// Every finite code round-trips; random values and every midpoint between neighbours go to the
// nearest finite value (ties to the even code), beyond the largest saturating to it.
TEST(Fp8, RoundsToTheNearestCodeTiesToEvenAndSaturates) {
  std::mt19937_64 rng(test_seed());
  SCOPED_TRACE("seed " + std::to_string(test_seed()));
  for (const DType dtype : {DType::fp8_e4m3, DType::fp8_e5m2}) {
    SCOPED_TRACE(dtype_name(dtype));
    const auto values = finite_codes(dtype);
    const float max = dtype_traits(dtype).max_code;
    for (const auto& [value, code] : values) {
      ASSERT_EQ(to_fp8(dtype, value), code) << "value " << value;
    }
    // The oracle: the nearest finite value by brute force; of two equally near, the even code.
    const auto nearest = [&](float x) {
      const float clamped = std::clamp(x, -max, max);
      double best = INFINITY;
      int best_code = -1;
      for (const auto& [value, code] : values) {
        if (value == 0.0f && std::signbit(value) != std::signbit(clamped)) continue;
        const double distance = std::abs(static_cast<double>(value) - clamped);
        if (distance < best || (distance == best && (code & 1) == 0)) {
          best = distance;
          best_code = code;
        }
      }
      return best_code;
    };
    std::vector<float> samples;
    std::vector<float> sorted;
    for (const auto& [value, code] : values) sorted.push_back(value);
    std::sort(sorted.begin(), sorted.end());
    for (std::size_t i = 0; i + 1 < sorted.size(); ++i) {
      samples.push_back(0.5f * (sorted[i] + sorted[i + 1]));  // exact in fp32
    }
    std::uniform_real_distribution<float> exponent(-24.0f, 20.0f);
    std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
    for (int i = 0; i < 20000; ++i) {
      const float x = std::ldexp(mantissa(rng), static_cast<int>(std::floor(exponent(rng))));
      samples.push_back(i % 2 ? x : -x);
    }
    samples.insert(samples.end(), {INFINITY, -INFINITY, 1e30f, -1e30f, 1e-45f, -1e-45f});
    for (const float x : samples) {
      ASSERT_EQ(static_cast<int>(to_fp8(dtype, x)), nearest(x)) << "x = " << x;
    }
    EXPECT_TRUE(std::isnan(from_fp8(dtype, to_fp8(dtype, NAN))));
  }
}

// The SIMD dequantizer of every target against the scalar definition, bit for bit (NaN as NaN):
// every code, groups whose width is not a whole number of vectors, subnormal and huge scales.
TEST(Dequantize, EveryTargetIsTheDefinition) {
  std::mt19937_64 rng(test_seed());
  SCOPED_TRACE("seed " + std::to_string(test_seed()));
  std::vector<std::uint8_t> codes(512);
  for (std::size_t i = 0; i < codes.size(); ++i)
    codes[i] = static_cast<std::uint8_t>(i * 7 + i / 256);
  const std::pair<std::int64_t, std::int64_t> shapes[] = {
      {512, 512}, {512, 32}, {510, 85}, {37, 37}, {96, 3}};
  on_every_target([&] {
    for (const DType dtype : {DType::int8, DType::fp8_e4m3, DType::fp8_e5m2}) {
      SCOPED_TRACE(dtype_name(dtype));
      for (const auto& [n, group_dims] : shapes) {
        const std::int64_t groups = (n + group_dims - 1) / group_dims;
        std::vector<float> scales(static_cast<std::size_t>(2 * groups));
        std::uniform_real_distribution<float> spread(-130.0f, 130.0f);
        for (float& scale : scales) scale = std::ldexp(1.0f, static_cast<int>(spread(rng)));
        std::vector<float> want(static_cast<std::size_t>(n)), got(want.size(), 1.0f);
        detail::dequantize_row(want.data(), codes.data(), dtype, 0, scales.data(), 2, group_dims,
                               n);
        detail::cpu::dequantize_row(got.data(), codes.data(), dtype, scales.data(), 2, group_dims,
                                    n);
        for (std::int64_t d = 0; d < n; ++d) {
          if (std::isnan(want[d])) {
            ASSERT_TRUE(std::isnan(got[d])) << "dim " << d << " code " << int{codes[d]};
          } else {
            ASSERT_EQ(std::bit_cast<std::uint32_t>(got[d]), std::bit_cast<std::uint32_t>(want[d]))
                << "n " << n << " group " << group_dims << " dim " << d << " code " << int{codes[d]}
                << ": got " << got[d] << ", want " << want[d];
          }
        }
      }
    }
  });
}

// The SIMD quantizer of every target against the scalar definition, codes and scales bit for
// bit: random rows across magnitudes, groups that are not a whole number of vectors, zero, tiny
// and non-finite groups, values on the rounding ties.
TEST(QuantizeRow, EveryTargetIsTheDefinition) {
  std::mt19937_64 rng(test_seed());
  SCOPED_TRACE("seed " + std::to_string(test_seed()));
  const std::pair<std::int64_t, std::int64_t> shapes[] = {{128, 128}, {128, 32}, {96, 3},
                                                          {100, 20},  {37, 37},  {64, 16}};
  std::normal_distribution<float> normal(0.0f, 1.0f);
  on_every_target([&] {
    for (const DType dtype : {DType::int8, DType::fp8_e4m3, DType::fp8_e5m2}) {
      SCOPED_TRACE(dtype_name(dtype));
      for (const auto& [n, group_dims] : shapes) {
        for (int round = 0; round < 20; ++round) {
          std::vector<float> row(static_cast<std::size_t>(n));
          const float magnitude = std::ldexp(1.0f, static_cast<int>(rng() % 60) - 30);
          for (float& x : row) x = normal(rng) * magnitude;
          if (round == 1) std::fill(row.begin(), row.end(), 0.0f);
          if (round == 2) row[static_cast<std::size_t>(n - 1)] = NAN;
          if (round == 3) row[0] = -INFINITY;
          if (round == 4) std::fill(row.begin(), row.end(), 1e-44f);
          if (round == 5) {  // x / scale on the half-way points
            for (std::int64_t d = 0; d < n; ++d) row[d] = static_cast<float>(d % 255 - 127) + 0.5f;
          }
          const std::int64_t groups = (n + group_dims - 1) / group_dims;
          std::vector<float> want_scales(static_cast<std::size_t>(groups), 0.25f),
              got_scales = want_scales;
          std::vector<std::uint8_t> want(static_cast<std::size_t>(n)), got(want.size(), 0xAB);
          detail::quantize_row(want.data(), dtype, 0, row.data(), want_scales.data(), 1, group_dims,
                               n);
          detail::cpu::quantize_row(got.data(), dtype, row.data(), got_scales.data(), 1, group_dims,
                                    n);
          ASSERT_EQ(got, want) << "n " << n << " group " << group_dims << " round " << round;
          for (std::int64_t g = 0; g < groups; ++g) {
            ASSERT_TRUE(std::isnan(want_scales[g]) ? std::isnan(got_scales[g])
                                                   : got_scales[g] == want_scales[g])
                << "group " << g << ": got " << got_scales[g] << ", want " << want_scales[g];
          }
        }
      }
    }
  });
}

// quantize_kv's int8 rows against the definition: per group, scale = max|x| / 127 (fp32) and
// code = round(x / scale), ties to even; zero groups scale 0, non-finite ones scale NaN.
TEST(QuantizeKV, Int8IsTheDefinitionBitForBit) {
  std::mt19937_64 rng(test_seed());
  SCOPED_TRACE("seed " + std::to_string(test_seed()));
  for (const std::int64_t groups : {1, 2, 4}) {
    SCOPED_TRACE("groups " + std::to_string(groups));
    const std::int64_t D = 128, G = D / groups;
    Tensor values(DType::f32, {2, 5, 3, D});
    values.fill_normal(rng, 3.0f);
    // Row (0, 1, 0) all zeros; row (1, 2, 1) a NaN in its last group; row (1, 3, 2) an infinity.
    for (std::int64_t d = 0; d < D; ++d) values.set(0, 1, 0, d, 0.0f);
    values.set(1, 2, 1, D - 1, NAN);
    values.set(1, 3, 2, 0, -INFINITY);
    Tensor cache(DType::int8, values.view.shape), scales(DType::f32, {2, 5, 3, groups});
    quantize_kv(values.view, cache.view, scales.view, 2);
    values.for_each_index([&](auto b, auto i, auto h, auto d) {
      const std::int64_t g = d / G;
      float largest = 0.0f;
      bool finite = true;
      for (std::int64_t e = g * G; e < (g + 1) * G; ++e) {
        finite = finite && std::isfinite(values.at(b, i, h, e));
        largest = std::max(largest, std::abs(values.at(b, i, h, e)));
      }
      const float scale = scales.at(b, i, h, g);
      if (!finite) {
        ASSERT_TRUE(std::isnan(scale));
        ASSERT_EQ(cache.at(b, i, h, d), 0.0f);
        return;
      }
      ASSERT_EQ(scale, largest / 127.0f);
      const float want = scale == 0.0f ? 0.0f : std::nearbyint(values.at(b, i, h, d) / scale);
      ASSERT_EQ(cache.at(b, i, h, d), std::clamp(want, -127.0f, 127.0f))
          << b << " " << i << " " << h << " " << d;
    });
  }
}

TEST(QuantizeKV, Fp8DividesByTheGivenScalesAndSaturates) {
  std::mt19937_64 rng(test_seed());
  SCOPED_TRACE("seed " + std::to_string(test_seed()));
  for (const DType dtype : {DType::fp8_e4m3, DType::fp8_e5m2}) {
    SCOPED_TRACE(dtype_name(dtype));
    const std::int64_t H = 4, D = 32;
    Tensor values(DType::f32, {3, 6, H, D});
    values.fill_normal(rng, 100.0f);
    values.set(0, 0, 0, 0, INFINITY);
    values.set(0, 0, 0, 1, NAN);
    values.set(0, 0, 0, 2, -1e30f);
    // One scale per KV head, broadcast over batch and rows.
    Tensor per_head(DType::f32, {3, 6, H, 1}, {0, 0, 1, 0});
    for (std::int64_t h = 0; h < H; ++h)
      per_head.set(0, 0, h, 0, 0.25f * static_cast<float>(h + 1));
    Tensor cache(dtype, values.view.shape);
    quantize_kv(values.view, cache.view, per_head.view, 1);
    values.for_each_index([&](auto b, auto i, auto h, auto d) {
      const float x = values.at(b, i, h, d) / per_head.at(b, i, h, 0);
      const float got = cache.at(b, i, h, d);
      if (std::isnan(x)) {
        ASSERT_TRUE(std::isnan(got));
      } else {
        ASSERT_EQ(static_cast<std::uint8_t>(
                      static_cast<const std::uint8_t*>(cache.view.data)[cache.offset(b, i, h, d)]),
                  to_fp8(dtype, x));
      }
    });
    const float max = dtype_traits(dtype).max_code;
    EXPECT_EQ(cache.at(0, 0, 0, 0), max);   // +inf saturates
    EXPECT_EQ(cache.at(0, 0, 0, 2), -max);  // beyond the range saturates
  }
}

// How a case lays out its scales.
enum class Scales { per_row, per_group32, per_head, per_tensor };

const char* scales_name(Scales s) {
  switch (s) {
    case Scales::per_row:
      return "per_row";
    case Scales::per_group32:
      return "per_group32";
    case Scales::per_head:
      return "per_head";
    case Scales::per_tensor:
      return "per_tensor";
  }
  return "?";
}

struct QuantCase {
  std::vector<std::int32_t> cached;
  std::int64_t seqlen_q, seqlen_new, heads_q, heads_kv, head_dim, capacity, page_size;
  DType cache_dtype;
  Scales scales;
  bool causal = false;
  std::int64_t window_left = -1;
  DType q_dtype = DType::f32;
  AttentionImpl impl = AttentionImpl::flash;
};

std::string case_name(const QuantCase& c) {
  std::ostringstream name;
  name << dtype_name(c.cache_dtype) << "_" << scales_name(c.scales) << "_B" << c.cached.size()
       << "_Sq" << c.seqlen_q << "_new" << c.seqlen_new << "_Hq" << c.heads_q << "_Hkv"
       << c.heads_kv << "_D" << c.head_dim << "_page" << c.page_size << (c.causal ? "_causal" : "")
       << (c.window_left >= 0 ? "_win" + std::to_string(c.window_left) : "") << "_q"
       << dtype_name(c.q_dtype) << "_" << impl_name(c.impl);
  return name.str();
}

void PrintTo(const QuantCase& c, std::ostream* os) { *os << case_name(c); }

// A quantized cache, dense [B, capacity, Hkv, D] and the same codes and scales in shuffled
// pages, with the scales of the case's layout. Rows past a sequence's length: per-row scales
// NaN, broadcast ones' codes NaN (int8 has no NaN code, so int8 is always per row or group), so
// that a read of a key no row sees shows in the output.
struct QuantCache {
  std::int64_t batch, pages_per_sequence, num_pages, groups;
  Tensor dense_k, dense_v, paged_k, paged_v;
  Tensor dense_k_scale, dense_v_scale, paged_k_scale, paged_v_scale;
  std::vector<std::int32_t> block_table;

  static Tensor scale_tensor(const QuantCase& c, std::int64_t rows0, std::int64_t rows1,
                             std::int64_t groups) {
    const std::array<std::int64_t, 4> shape{rows0, rows1, c.heads_kv, groups};
    switch (c.scales) {
      case Scales::per_head:
        return Tensor(DType::f32, shape, {0, 0, 1, 0});
      case Scales::per_tensor:
        return Tensor(DType::f32, shape, {0, 0, 0, 0});
      default:
        return Tensor(DType::f32, shape);
    }
  }

  QuantCache(const QuantCase& c, std::mt19937_64& rng)
      : batch(static_cast<std::int64_t>(c.cached.size())),
        pages_per_sequence((c.capacity + c.page_size - 1) / c.page_size),
        num_pages(pages_per_sequence * batch + 1),
        groups(c.scales == Scales::per_group32 ? c.head_dim / 32 : 1),
        dense_k(c.cache_dtype, {batch, c.capacity, c.heads_kv, c.head_dim}),
        dense_v(c.cache_dtype, dense_k.view.shape),
        paged_k(c.cache_dtype, {num_pages, c.page_size, c.heads_kv, c.head_dim}),
        paged_v(c.cache_dtype, paged_k.view.shape),
        dense_k_scale(scale_tensor(c, batch, c.capacity, groups)),
        dense_v_scale(scale_tensor(c, batch, c.capacity, groups)),
        paged_k_scale(scale_tensor(c, num_pages, c.page_size, groups)),
        paged_v_scale(scale_tensor(c, num_pages, c.page_size, groups)) {
    std::vector<std::int32_t> order(static_cast<std::size_t>(num_pages));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    block_table.assign(order.begin(), order.end() - 1);
    // Values N(0, 1) quantized by quantize_kv; broadcast fp8 scales fitted to max |x| = 4.
    Tensor k_values(DType::f32, dense_k.view.shape), v_values(DType::f32, dense_k.view.shape);
    k_values.fill_normal(rng);
    v_values.fill_normal(rng);
    const bool broadcast = c.scales == Scales::per_head || c.scales == Scales::per_tensor;
    const bool int8 = c.cache_dtype == DType::int8;
    // fp8 scales are given: about max|x| / max code, apart per KV head or at random per row.
    std::uniform_real_distribution<float> spread(0.5f, 2.0f);
    const float fit = 4.0f / dtype_traits(c.cache_dtype).max_code;
    for (Tensor* s : {&dense_k_scale, &dense_v_scale, &paged_k_scale, &paged_v_scale}) {
      if (int8) break;
      s->for_each_index([&](auto i, auto j, auto h, auto g) {
        s->set(i, j, h, g,
               broadcast ? fit * (1.0f + 0.5f * static_cast<float>(h)) : fit * spread(rng));
      });
    }
    quantize_kv(k_values.view, dense_k.view, dense_k_scale.view, 1);
    quantize_kv(v_values.view, dense_v.view, dense_v_scale.view, 1);
    // Unseen rows poisoned: int8 by NaN scales (it has no NaN code), fp8 by NaN codes.
    dense_k.for_each_index([&](auto b, auto j, auto h, auto d) {
      if (j < c.cached[b]) return;
      if (!int8) {
        dense_k.set(b, j, h, d, NAN);
        dense_v.set(b, j, h, d, NAN);
      } else if (d < groups) {
        dense_k_scale.set(b, j, h, d, NAN);
        dense_v_scale.set(b, j, h, d, NAN);
      }
    });
    if (int8) {
      paged_k_scale.poison();
      paged_v_scale.poison();
    } else {
      paged_k.poison();
      paged_v.poison();
    }
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t j = 0; j < c.capacity; ++j) {
        const auto [page, row] = paged_row(b, j, c.page_size);
        for (std::int64_t h = 0; h < c.heads_kv; ++h) {
          copy_codes(paged_k, page, row, dense_k, b, j, h);
          copy_codes(paged_v, page, row, dense_v, b, j, h);
          if (broadcast) continue;
          for (std::int64_t g = 0; g < groups; ++g) {
            paged_k_scale.set(page, row, h, g, dense_k_scale.at(b, j, h, g));
            paged_v_scale.set(page, row, h, g, dense_v_scale.at(b, j, h, g));
          }
        }
      }
    }
  }

  static void copy_codes(Tensor& to, std::int64_t i0, std::int64_t i1, const Tensor& from,
                         std::int64_t f0, std::int64_t f1, std::int64_t h) {
    std::memcpy(static_cast<std::uint8_t*>(to.view.data) + to.offset(i0, i1, h, 0),
                static_cast<const std::uint8_t*>(from.view.data) + from.offset(f0, f1, h, 0),
                static_cast<std::size_t>(from.view.shape[3]));
  }

  std::pair<std::int64_t, std::int64_t> paged_row(std::int64_t b, std::int64_t j,
                                                  std::int64_t page_size) const {
    return {block_table[b * pages_per_sequence + j / page_size], j % page_size};
  }

  KVCacheView dense() {
    return {dense_k.view, dense_v.view, nullptr, 0, dense_k_scale.view, dense_v_scale.view};
  }
  KVCacheView paged() {
    return {paged_k.view,       paged_v.view,       block_table.data(),
            pages_per_sequence, paged_k_scale.view, paged_v_scale.view};
  }

  // Sequence b's first L rows of K or V dequantized: code · scale, in fp32.
  Tensor dequantized(const Tensor& codes, const Tensor& scales, std::int64_t b,
                     std::int64_t L) const {
    const std::int64_t Hkv = codes.view.shape[2], D = codes.view.shape[3];
    Tensor values(DType::f32, {1, L, Hkv, D});
    values.for_each_index([&](auto, auto j, auto h, auto d) {
      values.set(0, j, h, d, codes.at(b, j, h, d) * scales.at(b, j, h, d / (D / groups)));
    });
    return values;
  }
};

struct Outputs {
  Tensor out;
  std::vector<float> lse;
};

Outputs run(const QuantCase& c, const Tensor& q, const KVCacheView& cache,
            const std::vector<std::int32_t>& cached, const NewKeysValues& new_kv, int threads) {
  Outputs result{
      Tensor(c.q_dtype, q.view.shape),
      std::vector<float>(static_cast<std::size_t>(q.view.shape[0] * c.heads_q * c.seqlen_q), NAN)};
  result.out.poison();
  AttentionOptions options;
  options.causal = c.causal;
  options.window_left = c.window_left;
  options.num_threads = threads;
  kvcache_attention_forward(q.view, cache, cached.data(), new_kv, result.out.view,
                            result.lse.data(), options, c.impl);
  return result;
}

bool same_bits(const Outputs& a, const Outputs& b) {
  return a.out.bytes == b.out.bytes &&
         std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)) == 0;
}

class QuantizedCacheAgainstReference : public ::testing::TestWithParam<QuantCase> {};

TEST_P(QuantizedCacheAgainstReference, MatchesTheReferenceOnTheDequantizedCache) {
  const QuantCase c = GetParam();
  std::mt19937_64 rng(test_seed());
  SCOPED_TRACE(case_name(c) + ", seed " + std::to_string(test_seed()));
  const std::int64_t B = static_cast<std::int64_t>(c.cached.size()), Hkv = c.heads_kv,
                     D = c.head_dim;
  QuantCache cache(c, rng);
  Tensor q(c.q_dtype, {B, c.seqlen_q, c.heads_q, D});
  Tensor k_new(c.q_dtype, {B, c.seqlen_new, Hkv, D}), v_new(c.q_dtype, k_new.view.shape);
  q.fill_normal(rng);
  k_new.fill_normal(rng);
  v_new.fill_normal(rng);
  NewKeysValues new_kv;
  if (c.seqlen_new > 0) new_kv = {k_new.view, v_new.view};

  const Outputs from_dense = run(c, q, cache.dense(), c.cached, new_kv, 2);
  const Outputs from_paged = run(c, q, cache.paged(), c.cached, new_kv, 2);
  EXPECT_TRUE(same_bits(from_dense, from_paged)) << "dense and paged caches disagree";

  // The appended rows: what quantize_kv makes of the new rows, codes and scales, in both caches.
  std::vector<std::int32_t> after = c.cached;
  for (auto& length : after) length += static_cast<std::int32_t>(c.seqlen_new);
  if (c.seqlen_new > 0) {
    // Plain locals rather than structured bindings, which lambdas may not capture (C++20).
    for (const auto& operands :
         {std::tuple{&k_new, &cache.dense_k, &cache.dense_k_scale, &cache.paged_k,
                     &cache.paged_k_scale},
          {&v_new, &cache.dense_v, &cache.dense_v_scale, &cache.paged_v, &cache.paged_v_scale}}) {
      const Tensor* values = std::get<0>(operands);
      const Tensor *codes = std::get<1>(operands), *scales = std::get<2>(operands);
      const Tensor *paged_codes = std::get<3>(operands), *paged_scales = std::get<4>(operands);
      // fp8 divides by the scales of the rows written, int8 writes them.
      Tensor want(c.cache_dtype, values->view.shape);
      Tensor want_scales = QuantCache::scale_tensor(c, B, c.seqlen_new, cache.groups);
      want_scales.for_each_index([&](auto b, auto i, auto h, auto g) {
        want_scales.set(b, i, h, g, scales->at(b, c.cached[b] + i, h, g));
      });
      quantize_kv(values->view, want.view, want_scales.view, 1);
      want.for_each_index([&](auto b, auto i, auto h, auto d) {
        const std::int64_t j = c.cached[b] + i;
        const auto [page, row] = cache.paged_row(b, j, c.page_size);
        const float g = want_scales.at(b, i, h, d / (D / cache.groups));
        ASSERT_EQ(codes->at(b, j, h, d), want.at(b, i, h, d)) << b << " " << j << " " << h;
        ASSERT_EQ(paged_codes->at(page, row, h, d), want.at(b, i, h, d));
        ASSERT_EQ(scales->at(b, j, h, d / (D / cache.groups)), g);
        ASSERT_EQ(paged_scales->at(page, row, h, d / (D / cache.groups)), g);
      });
    }
  }

  // The same without the append (the rows now in the cache), on 1 thread: bit for bit.
  EXPECT_TRUE(same_bits(from_paged, run(c, q, cache.paged(), after, {}, 1)))
      << "1 thread and 2 threads disagree";

  // Each sequence's fp64 reference on the dequantized cache, and its bounds.
  AttentionOptions options;
  options.causal = c.causal;
  options.window_left = c.window_left;
  const double u_q = c.q_dtype == DType::f32 ? 0.0 : unit_roundoff(c.q_dtype);
  const double u_c = c.cache_dtype == DType::int8 ? kQueryCodeRoundoff : 0.0;
  struct Expected {
    ReferenceResult want;
    double tolerance, lse_tolerance;
  };
  std::vector<Expected> expected;
  for (std::int64_t b = 0; b < B; ++b) {
    const std::int64_t L = after[b];
    Tensor q_b(DType::f32, {1, c.seqlen_q, c.heads_q, D});
    q_b.for_each_index(
        [&](auto, auto i, auto h, auto d) { q_b.set(0, i, h, d, q.at(b, i, h, d)); });
    const Tensor k_b = cache.dequantized(cache.dense_k, cache.dense_k_scale, b, L);
    const Tensor v_b = cache.dequantized(cache.dense_v, cache.dense_v_scale, b, L);
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    const double max_v = max_abs(v_b);
    const double scores = scale * static_cast<double>(D) * max_abs(q_b) * max_abs(k_b);
    ReferenceResult want = reference(q_b, k_b, v_b, options);
    const double lse_tolerance =
        kU32 * (4.0 * scores + 2.0 * static_cast<double>(L) + 4.0 * max_abs_finite(want.lse)) +
        (u_q + u_c) * scores;
    expected.push_back({std::move(want),
                        kU32 * max_v * (4.0 * scores + 2.0 * static_cast<double>(L) + 16.0) +
                            unit_roundoff(c.q_dtype) * max_v +
                            probability_rounding_bound(c.q_dtype, max_v) +
                            u_q * max_v * (2.0 * scores + 1.0) + u_c * max_v * 2.0 * scores + 1e-30,
                        lse_tolerance});
  }
  const auto expect_matches_reference = [&](const Outputs& got) {
    for (std::int64_t b = 0; b < B; ++b) {
      SCOPED_TRACE("sequence " + std::to_string(b));
      const Expected& e = expected[b];
      Tensor out_b(c.q_dtype, {1, c.seqlen_q, c.heads_q, D});
      out_b.for_each_index(
          [&](auto, auto i, auto h, auto d) { out_b.set(0, i, h, d, got.out.at(b, i, h, d)); });
      const MaxError error = max_error(out_b, e.want.out);
      EXPECT_LE(error.value, e.tolerance)
          << "out index " << error.index << ": got " << error.got << ", want " << error.want;
      for (std::int64_t h = 0; h < c.heads_q; ++h) {
        for (std::int64_t i = 0; i < c.seqlen_q; ++i) {
          const double wanted = e.want.lse[h * c.seqlen_q + i];
          const float lse = got.lse[(b * c.heads_q + h) * c.seqlen_q + i];
          if (std::isinf(wanted)) {
            EXPECT_EQ(lse, -INFINITY) << "lse head " << h << " row " << i;
          } else {
            EXPECT_NEAR(lse, wanted, e.lse_tolerance) << "lse head " << h << " row " << i;
          }
        }
      }
    }
  };
  expect_matches_reference(from_dense);
  // Every SIMD target's products on the codes (or dequantized rows), paged; over an int8 cache
  // each way of its products that the CPU has.
  const std::vector<detail::cpu::Int8Products> ways =
      c.cache_dtype == DType::int8 ? detail::cpu::supported_int8_products()
                                   : std::vector{detail::cpu::active_int8_products()};
  for (const detail::cpu::Int8Products way : ways) {
    SCOPED_TRACE(detail::cpu::int8_products_name(way));
    detail::cpu::force_int8_products(way);
    on_every_target([&] { expect_matches_reference(run(c, q, cache.paged(), after, {}, 2)); });
  }
  detail::cpu::force_int8_products(std::nullopt);
}

std::vector<QuantCase> quant_cases() {
  std::vector<QuantCase> cases;
  const std::vector<std::int32_t> ragged = {37, 0, 300};
  // Every cache dtype and scale layout, decode with one new token, GQA 4, pages of 1, 7 and 16.
  const std::pair<DType, Scales> layouts[] = {
      {DType::int8, Scales::per_row},        {DType::int8, Scales::per_group32},
      {DType::fp8_e4m3, Scales::per_head},   {DType::fp8_e4m3, Scales::per_row},
      {DType::fp8_e5m2, Scales::per_tensor}, {DType::fp8_e5m2, Scales::per_group32}};
  for (const auto& [dtype, scales] : layouts) {
    for (const std::int64_t page : {1, 7, 16}) {
      cases.push_back({ragged, 1, 1, 8, 2, 64, 320, page, dtype, scales});
    }
  }
  // GQA 1 and 8, causal speculative decode (3 rows) with a window, appends crossing pages.
  for (const DType dtype : {DType::int8, DType::fp8_e4m3}) {
    cases.push_back({{17, 200, 63}, 3, 3, 4, 4, 64, 210, 16, dtype, Scales::per_row, true, 40});
    cases.push_back({{5, 70}, 1, 2, 8, 1, 96, 80, 7, dtype, Scales::per_group32, true});
  }
  // int8 rows of 80 dims (the integer products' masked last step), one query row per KV head.
  cases.push_back({{3, 129}, 1, 1, 4, 4, 80, 140, 16, DType::int8, Scales::per_row});
  // A bf16 q (and new rows) over int8; head_dim not a whole number of vectors.
  {
    QuantCase c = {ragged, 1, 1, 8, 2, 64, 320, 16, DType::int8, Scales::per_row};
    c.q_dtype = DType::bf16;
    cases.push_back(c);
    cases.push_back({{9, 33}, 2, 1, 6, 2, 40, 40, 5, DType::fp8_e5m2, Scales::per_head, true});
  }
  // Chunked prefill (more rows than the decode path takes: gathered), f32 and f16 q.
  for (const DType q_dtype : {DType::f32, DType::f16}) {
    QuantCase c = {{0, 150}, 40, 40, 4, 2, 64, 200, 16, DType::int8, Scales::per_group32, true};
    c.q_dtype = q_dtype;
    cases.push_back(c);
  }
  // The standard and reference paths.
  for (const AttentionImpl impl : {AttentionImpl::standard, AttentionImpl::reference}) {
    QuantCase c = {ragged, 1, 1, 8, 2, 64, 320, 7, DType::fp8_e4m3, Scales::per_row};
    c.impl = impl;
    cases.push_back(c);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, QuantizedCacheAgainstReference, ::testing::ValuesIn(quant_cases()),
                         [](const auto& info) { return case_name(info.param); });

// Rows of zeros, of tiny and huge values, and non-finite rows appended to an int8 cache: zeros
// and tiny values attend as the dequantized cache says; a NaN or an infinity makes the rows
// that see it NaN and leaves the others as they were.
TEST(QuantizedCache, ZeroTinyHugeAndNonFiniteRows) {
  std::mt19937_64 rng(test_seed());
  SCOPED_TRACE("seed " + std::to_string(test_seed()));
  const std::int64_t D = 64, Hkv = 2, Hq = 4, cap = 32;
  for (const float magnitude : {0.0f, 1e-40f, 1e30f, NAN, INFINITY}) {
    SCOPED_TRACE("new row magnitude " + std::to_string(magnitude));
    Tensor k(DType::int8, {2, cap, Hkv, D}), v(DType::int8, k.view.shape);
    Tensor k_scale(DType::f32, {2, cap, Hkv, 1}), v_scale(DType::f32, k_scale.view.shape);
    Tensor values(DType::f32, k.view.shape);
    values.fill_normal(rng);
    quantize_kv(values.view, k.view, k_scale.view, 1);
    quantize_kv(values.view, v.view, v_scale.view, 1);
    // Sequence 0 appends the odd row (its V; its K ordinary, so scores stay finite); sequence 1
    // an ordinary one.
    Tensor k_new(DType::f32, {2, 1, Hkv, D}), v_new(DType::f32, k_new.view.shape);
    k_new.fill_normal(rng);
    v_new.fill_normal(rng);
    for (std::int64_t d = 0; d < D; ++d) {
      for (std::int64_t h = 0; h < Hkv; ++h) {
        v_new.set(0, 0, h, d, d % 3 == 0 ? magnitude : (std::isnan(magnitude) ? 1.0f : 0.0f));
      }
    }
    Tensor q(DType::f32, {2, 1, Hq, D}), out(DType::f32, q.view.shape);
    q.fill_normal(rng);
    std::vector<float> lse(2 * Hq);
    const std::vector<std::int32_t> cached = {10, 20};
    const KVCacheView cache{k.view, v.view, nullptr, 0, k_scale.view, v_scale.view};
    kvcache_attention_forward(q.view, cache, cached.data(), {k_new.view, v_new.view}, out.view,
                              lse.data());
    const bool finite = std::isfinite(magnitude);
    for (std::int64_t h = 0; h < Hkv; ++h) {
      EXPECT_EQ(std::isnan(v_scale.at(0, 10, h, 0)), !finite);
      if (finite) {
        EXPECT_EQ(v_scale.at(0, 10, h, 0), magnitude / 127.0f);
      }
    }
    for (std::int64_t b = 0; b < 2; ++b) {
      const std::int64_t L = cached[b] + 1;
      Tensor q_b(DType::f32, {1, 1, Hq, D}), out_b(DType::f32, q_b.view.shape);
      Tensor k_b(DType::f32, {1, L, Hkv, D}), v_b(DType::f32, k_b.view.shape);
      q_b.for_each_index([&](auto, auto, auto h, auto d) {
        q_b.set(0, 0, h, d, q.at(b, 0, h, d));
        out_b.set(0, 0, h, d, out.at(b, 0, h, d));
      });
      k_b.for_each_index([&](auto, auto j, auto h, auto d) {
        k_b.set(0, j, h, d, k.at(b, j, h, d) * k_scale.at(b, j, h, 0));
        v_b.set(0, j, h, d, v.at(b, j, h, d) * v_scale.at(b, j, h, 0));
      });
      if (b == 0 && !finite) {
        out_b.for_each_index([&](auto, auto, auto h, auto d) {
          EXPECT_TRUE(std::isnan(out_b.at(0, 0, h, d))) << "head " << h << " dim " << d;
        });
        continue;
      }
      const ReferenceResult want = reference(q_b, k_b, v_b, {});
      const double max_v = max_abs(v_b);
      const double scores = std::sqrt(static_cast<double>(D)) * max_abs(q_b) * max_abs(k_b);
      const double tolerance = kU32 * max_v * (4.0 * scores + 2.0 * L + 16.0) +
                               kQueryCodeRoundoff * max_v * 2.0 * scores + 1e-300;
      const MaxError error = max_error(out_b, want.out);
      EXPECT_LE(error.value, tolerance) << "sequence " << b << " out index " << error.index
                                        << ": got " << error.got << ", want " << error.want;
    }
  }
}

// A varlen batch over a quantized pool (PagedKVView with scales): each sequence as the
// KV-cache call gives it alone (batch 1, its row of the table), bit for bit, decode-sized and
// gathered; bad scales refused by name.
TEST(QuantizedCache, PagedVarlenIsTheKVCacheCallPerSequence) {
  std::mt19937_64 rng(test_seed());
  SCOPED_TRACE("seed " + std::to_string(test_seed()));
  for (const auto& layout : {std::tuple{DType::int8, Scales::per_row, std::int64_t{1}},
                             {DType::fp8_e4m3, Scales::per_head, std::int64_t{1}},
                             {DType::int8, Scales::per_group32, std::int64_t{20}}}) {
    const auto [dtype, scales, rows] = layout;
    const std::int64_t seqlen_q = rows;  // captured below: not a structured binding
    SCOPED_TRACE(std::string(dtype_name(dtype)) + " Sq " + std::to_string(seqlen_q));
    const QuantCase c = {{37, 5, 200}, seqlen_q, 0, 8, 2, 64, 210, 16, dtype, scales, true};
    QuantCache cache(c, rng);
    const std::int64_t B = 3, D = c.head_dim;
    Tensor q(DType::f32, {1, B * seqlen_q, c.heads_q, D}), out(DType::f32, q.view.shape);
    q.fill_normal(rng);
    std::vector<float> lse(static_cast<std::size_t>(c.heads_q * B * seqlen_q));
    std::vector<std::int32_t> cu_q = {0}, cu_k = {0};
    for (std::int64_t b = 0; b < B; ++b) {
      cu_q.push_back(static_cast<std::int32_t>((b + 1) * seqlen_q));
      cu_k.push_back(cu_k.back() + c.cached[b]);
    }
    const KVCacheView pool = cache.paged();
    PagedKVView kv{pool.k,       pool.v,      pool.block_table, pool.pages_per_sequence,
                   pool.k_scale, pool.v_scale};
    AttentionOptions options;
    options.causal = true;
    options.num_threads = 2;
    varlen_attention_forward(AttentionImpl::flash, q.view, kv, cu_q.data(), cu_k.data(), B,
                             out.view, lse.data(), options);
    for (std::int64_t b = 0; b < B; ++b) {
      Tensor q_b(DType::f32, {1, seqlen_q, c.heads_q, D}), out_b(DType::f32, q_b.view.shape);
      q_b.for_each_index([&](auto, auto i, auto h, auto d) {
        q_b.set(0, i, h, d, q.at(0, b * seqlen_q + i, h, d));
      });
      KVCacheView one = pool;
      one.block_table = pool.block_table + b * pool.pages_per_sequence;
      const std::int32_t length = c.cached[b];
      std::vector<float> lse_b(static_cast<std::size_t>(c.heads_q * seqlen_q));
      kvcache_attention_forward(q_b.view, one, &length, {}, out_b.view, lse_b.data(), options);
      q_b.for_each_index([&](auto, auto i, auto h, auto d) {
        ASSERT_EQ(std::bit_cast<std::uint32_t>(out.at(0, b * seqlen_q + i, h, d)),
                  std::bit_cast<std::uint32_t>(out_b.at(0, i, h, d)))
            << "sequence " << b << " row " << i << " head " << h << " dim " << d;
      });
      for (std::int64_t h = 0; h < c.heads_q; ++h) {
        for (std::int64_t i = 0; i < seqlen_q; ++i) {
          ASSERT_EQ(lse[h * B * seqlen_q + b * seqlen_q + i], lse_b[h * seqlen_q + i]);
        }
      }
    }
    PagedKVView unscaled = kv;
    unscaled.v_scale = {};
    EXPECT_THROW(
        {
          try {
            varlen_attention_forward(AttentionImpl::flash, q.view, unscaled, cu_q.data(),
                                     cu_k.data(), B, out.view, lse.data(), options);
          } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("v_scale: expected shape"), std::string::npos)
                << e.what();
            throw;
          }
        },
        Error);
  }
}

// Bad input names the argument, the expected and the given value, and writes nothing.
TEST(QuantizedCache, BadInputRaisesANamedError) {
  const std::int64_t D = 64, Hkv = 2;
  Tensor k(DType::int8, {2, 16, Hkv, D}), v(DType::int8, k.view.shape);
  Tensor k_scale(DType::f32, {2, 16, Hkv, 2}), v_scale(DType::f32, k_scale.view.shape);
  Tensor q(DType::f32, {2, 1, 4, D}), out(DType::f32, q.view.shape);
  Tensor k_new(DType::f32, {2, 1, Hkv, D}), v_new(DType::f32, k_new.view.shape);
  k_new.fill(1.0f);
  v_new.fill(1.0f);
  const std::vector<std::int32_t> cached = {3, 4};
  const auto expect_error = [&](KVCacheView cache, NewKeysValues new_kv, const std::string& want) {
    const auto k_before = k.bytes, scale_before = k_scale.bytes;
    try {
      kvcache_attention_forward(q.view, cache, cached.data(), new_kv, out.view, nullptr);
      ADD_FAILURE() << "no error; expected " << want;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
    EXPECT_EQ(k.bytes, k_before);
    EXPECT_EQ(k_scale.bytes, scale_before);
  };
  const KVCacheView good{k.view, v.view, nullptr, 0, k_scale.view, v_scale.view};
  const NewKeysValues appended{k_new.view, v_new.view};
  kvcache_attention_forward(q.view, good, cached.data(), appended, out.view, nullptr);

  KVCacheView no_scales = good;
  no_scales.k_scale = {};
  expect_error(no_scales, appended, "k_scale: expected shape [2, 16, 2, groups]");
  KVCacheView null_scales = good;
  null_scales.v_scale.data = nullptr;
  expect_error(null_scales, appended, "v_scale: expected fp32 scales for the int8 cache, got null");
  KVCacheView odd_groups = good;
  odd_groups.k_scale.shape[3] = 3;
  expect_error(odd_groups, appended, "groups dividing head_dim = 64), got [2, 16, 2, 3]");
  KVCacheView f16_scales = good;
  f16_scales.k_scale.dtype = DType::f16;
  expect_error(f16_scales, appended, "k_scale: expected dtype f32, got f16");
  KVCacheView broadcast = good;
  broadcast.k_scale.strides = {0, 0, 1, 0};
  broadcast.k_scale.shape[3] = 1;
  expect_error(broadcast, appended, "k_scale: expected one element per (row, KV head, group)");
  KVCacheView mixed = good;
  mixed.v.dtype = DType::fp8_e4m3;
  expect_error(mixed, appended, "v_cache: expected dtype int8 (as k_cache), got fp8_e4m3");
  KVCacheView scales_on_cache = good;
  scales_on_cache.k_scale.data = k.view.data;
  expect_error(scales_on_cache, appended, "expected memory disjoint from");
  Tensor k_f32(DType::f32, k.view.shape), v_f32(DType::f32, k.view.shape);
  const KVCacheView f32_with_scales{k_f32.view, v_f32.view, nullptr, 0, k_scale.view, v_scale.view};
  expect_error(f32_with_scales, appended,
               "k_scale: expected none for a f32 cache (scales belong to int8 and fp8 caches)");
  Tensor k_new_int8(DType::int8, k_new.view.shape);
  expect_error(good, {k_new_int8.view, v_new.view},
               "k_new: expected dtype f32, f16 or bf16, got int8");

  // The other paths refuse the cache dtypes by name.
  Tensor q8(DType::int8, {1, 4, 2, 32}), k8(DType::int8, {1, 4, 2, 32}),
      v8(DType::int8, {1, 4, 2, 32});
  Tensor out8(DType::int8, q8.view.shape);
  try {
    attention_forward(AttentionImpl::flash, q8.view, k8.view, v8.view, out8.view, nullptr);
    ADD_FAILURE() << "attention_forward took int8";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "q: expected dtype f32, f16 or bf16, got int8 (a cache dtype, which only the "
                  "KV-cache call takes)"),
              std::string::npos)
        << e.what();
  }

  // quantize_kv.
  Tensor values(DType::f32, {2, 3, Hkv, D}), codes(DType::int8, values.view.shape);
  Tensor scales(DType::f32, {2, 3, Hkv, 1});
  const auto expect_quantize_error = [&](const ConstTensorView& from, const TensorView& to,
                                         const TensorView& s, const std::string& want) {
    try {
      quantize_kv(from, to, s);
      ADD_FAILURE() << "no error; expected " << want;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  Tensor f16_cache(DType::f16, values.view.shape);
  expect_quantize_error(values.view, f16_cache.view, scales.view,
                        "quantize_kv: cache: expected dtype int8, fp8_e4m3 or fp8_e5m2, got f16");
  Tensor short_cache(DType::int8, {2, 2, Hkv, D});
  expect_quantize_error(values.view, short_cache.view, scales.view,
                        "cache: expected shape [2, 3, 2, 64] (as values), got [2, 2, 2, 64]");
  expect_quantize_error(codes.view, codes.view, scales.view,
                        "values: expected dtype f32, f16 or bf16, got int8");
  Tensor wide_scales(DType::f32, {2, 3, Hkv, 5});
  expect_quantize_error(values.view, codes.view, wide_scales.view,
                        "scales: expected shape [2, 3, 2, groups]");
}

}  // namespace
}  // namespace flashattn::testing
