// The SIMD row helpers on every SIMD target this CPU runs. Widening f16 and bf16 rows
// (util/widen.cpp) gives exactly the floats of the scalar conversions: every one of the 65536
// bit patterns, in a row whose length leaves a scalar tail. NaN stays NaN (F16C quiets a
// signaling NaN, the scalar path keeps its payload; both are NaN, which is all the library
// promises). Narrowing to bf16 matches the scalar rounding bit for bit. dot_f32 (util/dot.cpp)
// matches an fp64 sum within fp32 summation error; add_widened_f64 matches the scalar widening add
// bit for bit. The transposes that pack operands match the
// scalar ones exactly.

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "cpu/kernels/tile_kernels.hpp"
#include "cpu/kernels/tile_kernels_bf16.hpp"
#include "test_support.hpp"
#include "util/convert.hpp"
#include "util/dot.hpp"

namespace flashattn::testing {
namespace {

TEST(WidenRow, EveryBitPatternOnEveryTarget) {
  std::vector<std::uint16_t> patterns(65536 + 7);
  for (std::size_t i = 0; i < patterns.size(); ++i) patterns[i] = static_cast<std::uint16_t>(i);
  std::vector<float> widened(patterns.size());
  on_every_target([&] {
    for (const DType dtype : {DType::f16, DType::bf16}) {
      SCOPED_TRACE(dtype == DType::f16 ? "f16" : "bf16");
      std::fill(widened.begin(), widened.end(), 1234.5f);
      detail::widen_row(widened.data(), patterns.data(), dtype,
                        static_cast<std::int64_t>(patterns.size()));
      int mismatches = 0;
      for (std::size_t i = 0; i < patterns.size() && mismatches < 5; ++i) {
        const float want =
            dtype == DType::f16 ? f32_from_f16(patterns[i]) : f32_from_bf16(patterns[i]);
        const bool same = std::isnan(want) ? std::isnan(widened[i])
                                           : std::bit_cast<std::uint32_t>(widened[i]) ==
                                                 std::bit_cast<std::uint32_t>(want);
        if (!same) {
          ++mismatches;
          ADD_FAILURE() << "pattern 0x" << std::hex << patterns[i] << ": got " << widened[i]
                        << ", want " << want;
        }
      }
    }
  });
}

// Narrowing fp32 rows to bf16 gives exactly the bits of the scalar bf16_from_f32 (round to
// nearest even, NaN kept NaN and quiet), on every target: the floats of every bf16 pattern and
// their neighbours half an ulp away and in between (ties both ways), infinities, NaNs and
// subnormals, in a row whose length leaves a scalar tail; and so does the non-temporal variant.
TEST(NarrowRowBf16, MatchesTheScalarRoundingOnEveryTarget) {
  std::vector<float> values;
  for (std::uint32_t pattern = 0; pattern < 65536; ++pattern) {
    for (std::uint32_t low : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
      values.push_back(std::bit_cast<float>(pattern << 16 | low));
    }
  }
  values.push_back(1.0f);
  std::vector<std::uint16_t> narrowed(values.size());
  on_every_target([&] {
    for (const bool stream : {false, true}) {
      std::fill(narrowed.begin(), narrowed.end(), std::uint16_t{0x1234});
      const auto n = static_cast<std::int64_t>(values.size());
      if (stream) {
        detail::stream_row_bf16(narrowed.data(), values.data(), n);
        detail::fence_streams();
      } else {
        detail::narrow_row_bf16(narrowed.data(), values.data(), n);
      }
      int mismatches = 0;
      for (std::size_t i = 0; i < values.size() && mismatches < 5; ++i) {
        const std::uint16_t want = bf16_from_f32(values[i]);
        if (narrowed[i] != want) {
          ++mismatches;
          ADD_FAILURE() << (stream ? "streamed: " : "") << "0x" << std::hex
                        << std::bit_cast<std::uint32_t>(values[i]) << " -> 0x" << narrowed[i]
                        << ", want 0x" << want;
        }
      }
    }
  });
}

// Non-temporal bf16 rows write exactly the rounded source and nothing around it, whatever the
// destination's alignment (the elements before the first 16-byte aligned one and the tail are
// plain stores) and length.
TEST(StreamRowBf16, WritesEveryElementOnEveryTarget) {
  std::vector<float> source(300);
  for (std::size_t i = 0; i < source.size(); ++i) source[i] = static_cast<float>(i) + 0.25f;
  std::vector<std::uint16_t> destination(400);
  on_every_target([&] {
    for (std::int64_t offset = 0; offset < 17; ++offset) {
      for (const std::int64_t n : {0, 1, 7, 8, 9, 15, 16, 17, 100, 255, 300}) {
        std::fill(destination.begin(), destination.end(), std::uint16_t{0xdead});
        detail::stream_row_bf16(destination.data() + offset, source.data(), n);
        detail::fence_streams();
        for (std::int64_t i = 0; i < static_cast<std::int64_t>(destination.size()); ++i) {
          const bool inside = i >= offset && i < offset + n;
          const std::uint16_t want =
              inside ? bf16_from_f32(source[static_cast<std::size_t>(i - offset)])
                     : std::uint16_t{0xdead};
          ASSERT_EQ(destination[static_cast<std::size_t>(i)], want)
              << "offset " << offset << " n " << n << " element " << i;
        }
      }
    }
  });
}

// Non-temporal row copies write exactly the source, whatever the destination's alignment (the
// head before the first aligned vector and the tail are plain stores) and length.
TEST(StreamRowF32, CopiesEveryElementOnEveryTarget) {
  std::vector<float> source(300), destination(400);
  for (std::size_t i = 0; i < source.size(); ++i) source[i] = static_cast<float>(i) + 0.5f;
  on_every_target([&] {
    for (std::int64_t offset = 0; offset < 17; ++offset) {
      for (const std::int64_t n : {0, 1, 15, 16, 17, 100, 255, 300}) {
        std::fill(destination.begin(), destination.end(), -1.0f);
        detail::stream_row_f32(destination.data() + offset, source.data(), n);
        detail::fence_streams();
        for (std::int64_t i = 0; i < static_cast<std::int64_t>(destination.size()); ++i) {
          const bool inside = i >= offset && i < offset + n;
          const float want = inside ? source[static_cast<std::size_t>(i - offset)] : -1.0f;
          ASSERT_EQ(destination[static_cast<std::size_t>(i)], want)
              << "offset " << offset << " n " << n << " element " << i;
        }
      }
    }
  });
}

// The backward's transposed bf16 operands (AVX512-BF16, used where the CPU has AMX): every
// element of the transpose rounded to nearest even as the scalar rounding does (normal values:
// the instruction counts subnormal inputs as zero), rows past `rows` zero, over ragged row
// counts and several 16 x 16 blocks.
TEST(RoundTransposedBf16, MatchesTheScalarTranspose) {
  if (!detail::cpu::bf16_products_supported()) GTEST_SKIP() << "no AVX512-BF16";
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal;
  for (const std::int64_t rows : {1, 15, 16, 17, 50, 64}) {
    for (const std::int64_t columns : {16, 48, 128}) {
      const std::int64_t rows_padded = 64, ld_src = columns + 16, ld_dst = rows_padded + 32;
      std::vector<float> src(static_cast<std::size_t>(rows * ld_src));
      for (float& x : src) x = normal(rng);
      std::vector<std::uint16_t> dst(static_cast<std::size_t>(columns * ld_dst), 0x1234);
      detail::cpu::round_transposed_bf16(dst.data(), ld_dst, src.data(), ld_src, rows, rows_padded,
                                         columns);
      for (std::int64_t c = 0; c < columns; ++c) {
        for (std::int64_t r = 0; r < rows_padded; ++r) {
          const std::uint16_t want =
              r < rows ? bf16_from_f32(src[static_cast<std::size_t>(r * ld_src + c)]) : 0;
          ASSERT_EQ(dst[static_cast<std::size_t>(c * ld_dst + r)], want)
              << "rows " << rows << " columns " << columns << " at (" << c << ", " << r << ")";
        }
        EXPECT_EQ(dst[static_cast<std::size_t>(c * ld_dst + rows_padded)], 0x1234)
            << "wrote past rows_padded";
      }
    }
  }
}

// The transposed packing of K and V (pack_rows_transposed): up to 16 rows, each from its own
// place in memory, become columns of 16 floats, on every target. Counts below 16 zero the
// missing rows' columns; lengths that are not a whole number of vectors leave a scalar tail;
// nothing is written past the 16 columns of a row of dst.
TEST(TransposeRows, MatchesTheScalarTransposeOnEveryTarget) {
  constexpr std::int64_t kRows = detail::cpu::kTileLanes, ld_dst = kRows + 5;
  std::mt19937_64 rng(12);
  std::normal_distribution<float> normal;
  std::vector<std::vector<float>> sources(kRows, std::vector<float>(70));
  for (auto& row : sources) {
    for (float& x : row) x = normal(rng);
  }
  const float* rows[kRows];
  for (std::int64_t r = 0; r < kRows; ++r) rows[r] = sources[static_cast<std::size_t>(r)].data();
  on_every_target([&] {
    for (const std::int64_t count : {1, 5, 8, 15, 16}) {
      for (const std::int64_t n : {1, 4, 16, 17, 64, 70}) {
        std::vector<float> dst(static_cast<std::size_t>(n * ld_dst), -7.0f);
        detail::cpu::transpose_rows(dst.data(), ld_dst, rows, count, n);
        for (std::int64_t d = 0; d < n; ++d) {
          for (std::int64_t r = 0; r < ld_dst; ++r) {
            const float want =
                r >= kRows  ? -7.0f
                : r < count ? sources[static_cast<std::size_t>(r)][static_cast<std::size_t>(d)]
                            : 0.0f;
            ASSERT_EQ(dst[static_cast<std::size_t>(d * ld_dst + r)], want)
                << "count " << count << " n " << n << " at (" << d << ", " << r << ")";
          }
        }
      }
    }
  });
}

// |Σ a·b - fp64| <= n·u·Σ|a·b| (u = 2^-24), the worst case of any summation order, for lengths
// with and without vector tails.
TEST(DotF32, MatchesFp64OnEveryTarget) {
  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal;
  on_every_target([&] {
    for (const std::int64_t n : {0, 1, 7, 16, 31, 32, 33, 111, 128, 1000}) {
      std::vector<float> a(static_cast<std::size_t>(n)), b(a.size());
      for (std::size_t i = 0; i < a.size(); ++i) {
        a[i] = normal(rng);
        b[i] = normal(rng);
      }
      double exact = 0.0, magnitude = 0.0;
      for (std::size_t i = 0; i < a.size(); ++i) {
        exact += static_cast<double>(a[i]) * b[i];
        magnitude += std::abs(static_cast<double>(a[i]) * b[i]);
      }
      const double got = detail::dot_f32(a.data(), b.data(), n);
      EXPECT_LE(std::abs(got - exact), n * 0x1p-24 * magnitude)
          << "n " << n << ": got " << got << ", fp64 " << exact;
    }
  });
}

// sums[i] += double(x[i]): one exact widening and one fp64 add per element, the scalar loop's bits
// on every target, over lengths with vector tails and values of every magnitude and sign.
TEST(AddWidenedF64, MatchesTheScalarAddOnEveryTarget) {
  std::mt19937_64 rng(11);
  std::normal_distribution<double> normal;
  on_every_target([&] {
    for (const std::int64_t n : {0, 1, 3, 7, 8, 9, 17, 64, 100}) {
      std::vector<float> x(static_cast<std::size_t>(n));
      std::vector<double> sums(x.size()), expected(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) {
        x[i] = static_cast<float>(normal(rng) * std::ldexp(1.0, static_cast<int>(i % 61) - 30));
        sums[i] = expected[i] = normal(rng) * std::ldexp(1.0, static_cast<int>(i % 53) - 26);
        expected[i] += static_cast<double>(x[i]);
      }
      detail::add_widened_f64(sums.data(), x.data(), n);
      for (std::size_t i = 0; i < x.size(); ++i) {
        EXPECT_EQ(std::bit_cast<std::uint64_t>(sums[i]), std::bit_cast<std::uint64_t>(expected[i]))
            << "n " << n << " element " << i;
      }
    }
  });
}

}  // namespace
}  // namespace flashattn::testing
