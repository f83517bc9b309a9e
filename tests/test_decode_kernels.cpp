// The decode path's two products (cpu/kernels/tile_kernels.hpp: dot_rows, axpy_rows, and their bf16
// pair variants) on every SIMD target compiled in that this CPU runs, against sums in double:
// every row count up to 9 and every x count up to 19, so that each block shape the kernels pick
// (rows by 4, 2 and 1, or 3 and 5-7 rows at once; x rows by 8, 4, 2 and 1) and every remainder is
// reached, on fp32, bf16 and f16 rows that lie apart in memory, in order (given by a stride) or
// out of order (given by an offset per row, as a paged cache scatters them), with nothing written
// outside the outputs. The attention tests reach these kernels only through the shapes they
// happen to run.
//
// Inputs are representable in every dtype (multiples of 1/16 below 16 in magnitude: 8
// significant bits, all that bf16 holds, so every mantissa bit of a bf16 row is used), so the
// widening is exact and the double sums are the exact results. Tolerance: a sum of m products
// formed by fp32 FMAs and additions in any order is off by at most (m - 1)·u·Σ|terms| up to
// terms of order u² (Higham, Accuracy and Stability of Numerical Algorithms, §3.1), u = 2^-24;
// the test allows m·u·Σ|terms|. A dropped, doubled or misplaced term is off by a whole term, at
// least 1/256 here, orders of magnitude more.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "cpu/kernels/tile_kernels.hpp"
#include "flashattn/dtype.hpp"
#include "test_support.hpp"

namespace flashattn::testing {
namespace {

namespace cpu = detail::cpu;

constexpr double kUnitRoundoff = 0x1p-24;
constexpr float kSentinel = -12345.0f;

// x rows of `dtype` whose elements are the floats `values` (exactly representable).
std::vector<std::uint8_t> rows_in(DType dtype, const std::vector<float>& values) {
  std::vector<std::uint8_t> bytes(values.size() * dtype_size(dtype));
  for (std::size_t i = 0; i < values.size(); ++i) {
    store_f32(bytes.data(), dtype, static_cast<std::int64_t>(i), values[i]);
  }
  return bytes;
}

// Multiples of 1/16 in (-16, 16), zero included.
std::vector<float> random_values(std::mt19937_64& rng, std::size_t n) {
  std::uniform_int_distribution<int> sixteenths(-255, 255);
  std::vector<float> values(n);
  for (float& value : values) value = static_cast<float>(sixteenths(rng)) / 16.0f;
  return values;
}

struct Shape {
  std::int64_t rows, x_count, n;
};

std::vector<Shape> shapes() {
  std::vector<Shape> all;
  for (std::int64_t n : {16, 64, 128}) {
    for (std::int64_t rows = 1; rows <= 9; ++rows) {
      for (std::int64_t x_count = 0; x_count <= 19; ++x_count) all.push_back({rows, x_count, n});
    }
  }
  return all;
}

// Row and x strides beyond n, an output stride beyond x_count: the kernels must honour them.
constexpr std::int64_t kRowPadding = 16, kXPadding = 24, kOutPadding = 5;

// x rows of random values as floats (row k at k·ld) and as the bytes of `dtype`, kXPadding past
// n apart: in order, given by their stride, or shuffled, given by their offsets.
struct XRows {
  std::vector<float> values;
  std::vector<std::uint8_t> bytes;
  std::int64_t ld;
  std::vector<std::int64_t> byte_offsets;  // of each row where shuffled, else empty

  // The rows as they lie in `storage` (bytes, or other rows laid out alike).
  cpu::ScatteredRows rows_in(const std::vector<std::uint8_t>& storage) const {
    return {storage.data(), ld, byte_offsets.empty() ? nullptr : byte_offsets.data()};
  }
};

// check(dtype, shape, x) on every SIMD target, dtype and shape, until an assertion fails.
template <class Check>
void for_every_case(std::mt19937_64& rng, const Check& check) {
  on_every_target([&] {
    for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
      SCOPED_TRACE(dtype_name(dtype));
      for (const Shape& shape : shapes()) {
        const bool shuffled = rng() % 2 == 0;
        SCOPED_TRACE(::testing::Message()
                     << "rows " << shape.rows << ", x rows " << shape.x_count << ", n " << shape.n
                     << (shuffled ? ", shuffled" : "") << ", seed " << test_seed());
        const std::int64_t ld_x = shape.n + kXPadding;
        std::vector<float> x = random_values(rng, std::max<std::int64_t>(1, shape.x_count) * ld_x);
        std::vector<std::int64_t> slot(static_cast<std::size_t>(shape.x_count));
        std::iota(slot.begin(), slot.end(), std::int64_t{0});
        if (shuffled) std::shuffle(slot.begin(), slot.end(), rng);
        std::vector<float> stored(x.size());
        for (std::int64_t k = 0; k < shape.x_count; ++k) {
          std::copy_n(x.begin() + k * ld_x, ld_x, stored.begin() + slot[k] * ld_x);
        }
        std::vector<std::int64_t> byte_offsets;
        if (shuffled) {
          for (std::int64_t s : slot) {
            byte_offsets.push_back(s * ld_x * static_cast<std::int64_t>(dtype_size(dtype)));
          }
        }
        check(dtype, shape,
              XRows{std::move(x), rows_in(dtype, stored), ld_x, std::move(byte_offsets)});
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  });
}

// out[r · out_stride + k] against the double sums of rows[r] · x[k], and the sentinels past
// x_count untouched.
void check_dots(const std::vector<float>& out, std::int64_t out_stride,
                const std::vector<float>& rows, std::int64_t ld_rows, const Shape& shape,
                const XRows& x) {
  for (std::int64_t r = 0; r < shape.rows; ++r) {
    for (std::int64_t k = 0; k < out_stride; ++k) {
      const float got = out[r * out_stride + k];
      if (k >= shape.x_count) {
        ASSERT_EQ(got, kSentinel) << "written past x row " << shape.x_count << " of row " << r;
        continue;
      }
      double exact = 0.0, magnitude = 0.0;
      for (std::int64_t d = 0; d < shape.n; ++d) {
        const double term = static_cast<double>(rows[r * ld_rows + d]) * x.values[k * x.ld + d];
        exact += term;
        magnitude += std::fabs(term);
      }
      ASSERT_NEAR(got, exact, shape.n * kUnitRoundoff * magnitude)
          << "dot of row " << r << ", x row " << k;
    }
  }
}

// acc against the double sums of initial + weights · x, and the columns past n untouched.
void check_axpys(const std::vector<float>& acc, const std::vector<float>& initial,
                 std::int64_t ld_acc, const std::vector<float>& weights, std::int64_t weight_stride,
                 const Shape& shape, const XRows& x) {
  for (std::int64_t r = 0; r < shape.rows; ++r) {
    for (std::int64_t d = 0; d < ld_acc; ++d) {
      const float got = acc[r * ld_acc + d];
      if (d >= shape.n) {
        ASSERT_EQ(got, initial[r * ld_acc + d])
            << "written past column " << shape.n << " of row " << r;
        continue;
      }
      double exact = initial[r * ld_acc + d], magnitude = std::fabs(exact);
      for (std::int64_t k = 0; k < shape.x_count; ++k) {
        const double term =
            static_cast<double>(weights[r * weight_stride + k]) * x.values[k * x.ld + d];
        exact += term;
        magnitude += std::fabs(term);
      }
      ASSERT_NEAR(got, exact, (shape.x_count + 1) * kUnitRoundoff * magnitude)
          << "axpy of row " << r << ", column " << d;
    }
  }
}

TEST(DecodeKernels, DotRowsMatchesDoubleSumsOnEveryTarget) {
  std::mt19937_64 rng(test_seed());
  for_every_case(rng, [&](DType dtype, const Shape& shape, const XRows& x) {
    const std::int64_t ld_rows = shape.n + kRowPadding;
    const std::int64_t out_stride = shape.x_count + kOutPadding;
    const std::vector<float> rows = random_values(rng, shape.rows * ld_rows);
    std::vector<float> out(shape.rows * out_stride, kSentinel);
    cpu::dot_rows(out.data(), out_stride, rows.data(), ld_rows, shape.rows, x.rows_in(x.bytes),
                  dtype, shape.x_count, shape.n);
    check_dots(out, out_stride, rows, ld_rows, shape, x);
  });
}

TEST(DecodeKernels, AxpyRowsMatchesDoubleSumsOnEveryTarget) {
  std::mt19937_64 rng(test_seed() + 1);
  for_every_case(rng, [&](DType dtype, const Shape& shape, const XRows& x) {
    const std::int64_t ld_acc = shape.n + kRowPadding;
    const std::int64_t weight_stride = shape.x_count + kOutPadding;
    std::vector<float> acc = random_values(rng, shape.rows * ld_acc);
    const std::vector<float> initial = acc;
    const std::vector<float> weights = random_values(rng, shape.rows * weight_stride);
    cpu::axpy_rows(acc.data(), ld_acc, weights.data(), weight_stride, shape.rows,
                   x.rows_in(x.bytes), dtype, shape.x_count, shape.n);
    check_axpys(acc, initial, ld_acc, weights, weight_stride, shape, x);
  });
}

// The bf16 pair order: within each chunk, the even-indexed elements, then the odd-indexed ones;
// to_ and from_ are inverse.
TEST(DecodeKernels, Bf16PairOrderPutsEvenElementsFirstOnEveryTarget) {
  on_every_target([] {
    const std::int64_t chunk = cpu::bf16_pair_chunk();
    ASSERT_GE(chunk, 2);
    ASSERT_EQ(chunk % 2, 0);
    const std::int64_t n = 4 * chunk;
    std::vector<float> natural(n), paired(n), back(n);
    for (std::int64_t i = 0; i < n; ++i) natural[i] = static_cast<float>(i);
    cpu::to_bf16_pair_order(paired.data(), natural.data(), n);
    for (std::int64_t first = 0; first < n; first += chunk) {
      for (std::int64_t i = 0; i < chunk / 2; ++i) {
        ASSERT_EQ(paired[first + i], static_cast<float>(first + 2 * i)) << "chunk " << first;
        ASSERT_EQ(paired[first + chunk / 2 + i], static_cast<float>(first + 2 * i + 1));
      }
    }
    cpu::from_bf16_pair_order(back.data(), paired.data(), n);
    EXPECT_EQ(back, natural);
  });
}

// The rows of `values` (ld apart) with their first n elements in bf16 pair order.
std::vector<float> in_pair_order(std::vector<float> values, std::int64_t count, std::int64_t ld,
                                 std::int64_t n) {
  const std::vector<float> natural = values;
  for (std::int64_t r = 0; r < count; ++r) {
    cpu::to_bf16_pair_order(values.data() + r * ld, natural.data() + r * ld, n);
  }
  return values;
}

// dot_rows_bf16_pairs and axpy_rows_bf16_pairs against the same double sums, with the fp32
// operand given (and acc returned) in pair order; head widths that are not whole chunks of
// the target are not theirs to take.
TEST(DecodeKernels, Bf16PairKernelsMatchDoubleSumsOnEveryTarget) {
  std::mt19937_64 rng(test_seed() + 2);
  for_every_case(rng, [&](DType dtype, const Shape& shape, const XRows& x) {
    if (dtype != DType::bf16 || shape.n % cpu::bf16_pair_chunk() != 0) return;
    const cpu::ScatteredRows x_rows = x.rows_in(x.bytes);
    const std::int64_t ld_rows = shape.n + kRowPadding;
    const std::int64_t out_stride = shape.x_count + kOutPadding;
    const std::vector<float> rows = random_values(rng, shape.rows * ld_rows);
    const std::vector<float> paired_rows = in_pair_order(rows, shape.rows, ld_rows, shape.n);
    std::vector<float> out(shape.rows * out_stride, kSentinel);
    cpu::dot_rows_bf16_pairs(out.data(), out_stride, paired_rows.data(), ld_rows, shape.rows,
                             x_rows, shape.x_count, shape.n);

    const std::vector<float> weights = random_values(rng, shape.rows * out_stride);
    const std::vector<float> initial = random_values(rng, shape.rows * ld_rows);
    std::vector<float> acc = in_pair_order(initial, shape.rows, ld_rows, shape.n);
    cpu::axpy_rows_bf16_pairs(acc.data(), ld_rows, weights.data(), out_stride, shape.rows, x_rows,
                              shape.x_count, shape.n);
    std::vector<float> result = acc;
    for (std::int64_t r = 0; r < shape.rows; ++r) {
      cpu::from_bf16_pair_order(result.data() + r * ld_rows, acc.data() + r * ld_rows, shape.n);
    }

    check_dots(out, out_stride, rows, ld_rows, shape, x);
    if (::testing::Test::HasFatalFailure()) return;
    check_axpys(result, initial, ld_rows, weights, out_stride, shape, x);
  });
}

// The rows ahead that the decode path hands the pair kernels are only asked for: the same
// results bit for bit, with the rows ahead being x itself (in cache) or other rows.
TEST(DecodeKernels, Bf16PairKernelsGiveTheSameResultsWithRowsAhead) {
  std::mt19937_64 rng(test_seed() + 3);
  for_every_case(rng, [&](DType dtype, const Shape& shape, const XRows& x) {
    if (dtype != DType::bf16 || shape.n % cpu::bf16_pair_chunk() != 0) return;
    const cpu::ScatteredRows x_rows = x.rows_in(x.bytes);
    const std::vector<std::uint8_t> other(x.bytes.size(), 0x3f);
    const std::int64_t ld_rows = shape.n + kRowPadding;
    const std::int64_t out_stride = shape.x_count + kOutPadding;
    const std::vector<float> rows =
        in_pair_order(random_values(rng, shape.rows * ld_rows), shape.rows, ld_rows, shape.n);
    const std::vector<float> weights = random_values(rng, shape.rows * out_stride);
    const std::vector<float> initial = random_values(rng, shape.rows * ld_rows);
    std::vector<float> out(shape.rows * out_stride, kSentinel), acc = initial;
    cpu::dot_rows_bf16_pairs(out.data(), out_stride, rows.data(), ld_rows, shape.rows, x_rows,
                             shape.x_count, shape.n);
    cpu::axpy_rows_bf16_pairs(acc.data(), ld_rows, weights.data(), out_stride, shape.rows, x_rows,
                              shape.x_count, shape.n);
    for (const cpu::ScatteredRows& ahead : {x_rows, x.rows_in(other)}) {
      std::vector<float> out_ahead(shape.rows * out_stride, kSentinel), acc_ahead = initial;
      cpu::dot_rows_bf16_pairs(out_ahead.data(), out_stride, rows.data(), ld_rows, shape.rows,
                               x_rows, shape.x_count, shape.n, ahead);
      cpu::axpy_rows_bf16_pairs(acc_ahead.data(), ld_rows, weights.data(), out_stride, shape.rows,
                                x_rows, shape.x_count, shape.n, ahead);
      ASSERT_EQ(0, std::memcmp(out.data(), out_ahead.data(), out.size() * sizeof(float)));
      ASSERT_EQ(0, std::memcmp(acc.data(), acc_ahead.data(), acc.size() * sizeof(float)));
    }
  });
}

// The same for dot_rows and axpy_rows, on every dtype (f16 rows take rows ahead too).
TEST(DecodeKernels, KernelsGiveTheSameResultsWithRowsAhead) {
  std::mt19937_64 rng(test_seed() + 4);
  for_every_case(rng, [&](DType dtype, const Shape& shape, const XRows& x) {
    const std::vector<std::uint8_t> other(x.bytes.size(), 0x3c);
    const cpu::ScatteredRows x_rows = x.rows_in(x.bytes);
    const std::int64_t ld_rows = shape.n + kRowPadding;
    const std::int64_t out_stride = shape.x_count + kOutPadding;
    const std::vector<float> rows = random_values(rng, shape.rows * ld_rows);
    const std::vector<float> weights = random_values(rng, shape.rows * out_stride);
    const std::vector<float> initial = random_values(rng, shape.rows * ld_rows);
    std::vector<float> out(shape.rows * out_stride, kSentinel), acc = initial;
    cpu::dot_rows(out.data(), out_stride, rows.data(), ld_rows, shape.rows, x_rows, dtype,
                  shape.x_count, shape.n);
    cpu::axpy_rows(acc.data(), ld_rows, weights.data(), out_stride, shape.rows, x_rows, dtype,
                   shape.x_count, shape.n);
    for (const cpu::ScatteredRows& ahead : {x_rows, x.rows_in(other)}) {
      std::vector<float> out_ahead(shape.rows * out_stride, kSentinel), acc_ahead = initial;
      cpu::dot_rows(out_ahead.data(), out_stride, rows.data(), ld_rows, shape.rows, x_rows, dtype,
                    shape.x_count, shape.n, ahead);
      cpu::axpy_rows(acc_ahead.data(), ld_rows, weights.data(), out_stride, shape.rows, x_rows,
                     dtype, shape.x_count, shape.n, ahead);
      ASSERT_EQ(0, std::memcmp(out.data(), out_ahead.data(), out.size() * sizeof(float)));
      ASSERT_EQ(0, std::memcmp(acc.data(), acc_ahead.data(), acc.size() * sizeof(float)));
    }
  });
}

}  // namespace
}  // namespace flashattn::testing
