// The decode path's integer products for int8 caches (cpu/kernels/int8_products.hpp): the query
// rows' 16-bit codes against their definition, and dot_rows_int8 against sums in int64, which
// are exact, so the kernel's results are known to the bit: float(sum) · row scale, both rounded
// to fp32 once. Every row count up to 9 (blocks of 4 rows, then 3, 2 or 1) against every key
// count up to 19 (blocks of 4, 5, 8 or 16 keys and the ones left), head dims that are and are
// not whole steps of 32 dims (the masked last step), keys in order and at offsets (a paged
// cache), with and without rows ahead, codes at the extremes (query ±32767 against key codes
// -128 and 127 at 512 dims, the largest sum the int32 lanes hold). Only where the CPU has
// AVX512-VNNI; the decode with and without them is in test_kv_quantized.cpp.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "cpu/kernels/int8_products.hpp"

namespace flashattn::testing {
namespace {

namespace cpu = detail::cpu;

constexpr float kSentinel = -12345.0f;

bool vnni() { return cpu::supported_int8_products().back() == cpu::Int8Products::avx512_vnni; }

TEST(QueryCodes, RoundToTheNearestCodeOfTheRowsScale) {
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<float> values(-9.0f, 9.0f);
  for (const std::int64_t n : {1, 7, 32, 100, 128}) {
    std::vector<float> row(static_cast<std::size_t>(n));
    for (float& value : row) value = values(rng);
    row[n / 2] = -9.5f;  // the largest magnitude, negative
    const std::int64_t padded = (n + 31) / 32 * 32 + 32;
    std::vector<std::int16_t> codes(static_cast<std::size_t>(padded), 77);
    const float scale = cpu::quantize_query_row(codes.data(), row.data(), n, padded);
    EXPECT_EQ(scale, 9.5f / 32767.0f);
    EXPECT_EQ(codes[n / 2], -32767);
    for (std::int64_t d = 0; d < n; ++d) {
      const double exact = static_cast<double>(row[d]) / scale;
      EXPECT_LE(std::fabs(codes[d] - exact), 0.5) << "dim " << d;
      if (std::fabs(std::fabs(codes[d] - exact) - 0.5) < 1e-9) {
        EXPECT_EQ(codes[d] % 2, 0) << "a tie rounds to even, dim " << d;
      }
    }
    for (std::int64_t d = n; d < padded; ++d) EXPECT_EQ(codes[d], 0) << "padding " << d;
  }
}

TEST(QueryCodes, ZeroAndNonFiniteRows) {
  std::vector<std::int16_t> codes(32, 5);
  std::vector<float> row(20, 0.0f);
  EXPECT_EQ(cpu::quantize_query_row(codes.data(), row.data(), 20, 32), 0.0f);
  for (const std::int16_t code : codes) EXPECT_EQ(code, 0);
  for (const float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
        -std::numeric_limits<float>::infinity()}) {
    row.assign(20, 1.0f);
    row[3] = bad;
    EXPECT_TRUE(std::isnan(cpu::quantize_query_row(codes.data(), row.data(), 20, 32))) << bad;
    for (const std::int16_t code : codes) EXPECT_EQ(code, 0);
  }
  // A subnormal-only row: its scale underflows to 0 and the row counts as zeros.
  row.assign(20, 1e-44f);
  EXPECT_EQ(cpu::quantize_query_row(codes.data(), row.data(), 20, 32), 0.0f);
}

struct Case {
  std::int64_t rows, keys, n;
  bool offsets, ahead;
};

// dot_rows_int8 on one case, its rows and keys drawn from `code` (a function of the rng).
template <class QueryCode, class KeyCode>
void check(const Case& c, std::mt19937_64& rng, QueryCode query_code, KeyCode key_code) {
  SCOPED_TRACE(::testing::Message()
               << "rows " << c.rows << " keys " << c.keys << " n " << c.n
               << (c.offsets ? " at offsets" : " strided") << (c.ahead ? " with rows ahead" : ""));
  const std::int64_t ld_codes = (c.n + 31) / 32 * 32, ld_keys = c.n + 40;
  std::vector<std::int16_t> codes(static_cast<std::size_t>(c.rows * ld_codes), 0);
  std::vector<float> scales(static_cast<std::size_t>(c.rows));
  std::uniform_real_distribution<float> unit(0.5f, 2.0f);
  for (std::int64_t r = 0; r < c.rows; ++r) {
    for (std::int64_t d = 0; d < c.n; ++d) codes[r * ld_codes + d] = query_code(rng);
    scales[r] = unit(rng) * 1e-3f;
  }
  // Keys in a buffer with room around them, in reverse order when given by offsets.
  std::vector<std::int8_t> keys(static_cast<std::size_t>((c.keys + 2) * ld_keys), 99);
  std::vector<std::int64_t> offsets(static_cast<std::size_t>(c.keys));
  for (std::int64_t k = 0; k < c.keys; ++k) {
    offsets[k] = (c.offsets ? c.keys - k : k + 1) * ld_keys;
    for (std::int64_t d = 0; d < c.n; ++d) keys[offsets[k] + d] = key_code(rng);
  }
  const cpu::ScatteredRows x = c.offsets ? cpu::ScatteredRows{keys.data(), 0, offsets.data()}
                                         : cpu::ScatteredRows{keys.data() + ld_keys, ld_keys};
  const cpu::ScatteredRows ahead = c.ahead ? x : cpu::ScatteredRows{};
  const std::int64_t out_stride = c.keys + 3;
  std::vector<float> out(static_cast<std::size_t>(c.rows * out_stride), kSentinel);
  cpu::dot_rows_int8(out.data(), out_stride, codes.data(), ld_codes, scales.data(), c.rows, x,
                     c.keys, c.n, ahead);
  for (std::int64_t r = 0; r < c.rows; ++r) {
    for (std::int64_t k = 0; k < out_stride; ++k) {
      const float got = out[r * out_stride + k];
      if (k >= c.keys) {
        ASSERT_EQ(got, kSentinel) << "written outside the output, row " << r << " key " << k;
        continue;
      }
      std::int64_t sum = 0;
      for (std::int64_t d = 0; d < c.n; ++d) {
        sum += std::int64_t{codes[r * ld_codes + d]} * keys[offsets[k] + d];
      }
      const float want = static_cast<float>(sum) * scales[r];
      ASSERT_EQ(got, want) << "row " << r << " key " << k << " (sum " << sum << ")";
    }
  }
}

TEST(Int8Products, DotRowsAreTheExactSumsTimesTheRowScales) {
  if (!vnni()) GTEST_SKIP() << "no AVX512-VNNI on this CPU";
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<int> query(-cpu::kQueryCodeMax, cpu::kQueryCodeMax);
  std::uniform_int_distribution<int> key(-128, 127);
  auto query_code = [&](std::mt19937_64& g) { return static_cast<std::int16_t>(query(g)); };
  auto key_code = [&](std::mt19937_64& g) { return static_cast<std::int8_t>(key(g)); };
  for (const std::int64_t n : {16, 32, 48, 128, 200}) {
    for (std::int64_t rows = 1; rows <= 9; ++rows) {
      for (std::int64_t keys = 1; keys <= 19; ++keys) {
        check({rows, keys, n, keys % 2 == 1, keys % 3 == 0}, rng, query_code, key_code);
      }
    }
  }
}

TEST(Int8Products, TheLargestSumsFitTheirLanes) {
  if (!vnni()) GTEST_SKIP() << "no AVX512-VNNI on this CPU";
  std::mt19937_64 rng(11);
  const auto n = cpu::kMaxInt8ProductDims;
  // Every product at ±32767·128, all of one sign: the sum's magnitude is n · 32767 · 128.
  auto most = [](std::mt19937_64&) { return static_cast<std::int16_t>(-cpu::kQueryCodeMax); };
  auto lowest = [](std::mt19937_64&) { return std::int8_t{-128}; };
  auto highest = [](std::mt19937_64&) { return std::int8_t{127}; };
  check({5, 6, n, false, false}, rng, most, lowest);
  check({4, 4, n, true, true}, rng, most, highest);
}

}  // namespace
}  // namespace flashattn::testing
