// The scores product (cpu/kernels/tile_kernels.hpp: scores_tile, scores_tile_columns) on every SIMD
// target compiled in that this CPU runs, against sums in double: every row count up to 13 (the
// kernel's blocks of 6 rows and its remainders of 4, 2 and 1), Kᵀ laid out for 16 to 144 keys (one
// column panel, a whole panel and a partial one, two whole and a partial one), and every range of
// columns it may be asked to compute, with nothing written outside them. The forward computes only
// the keys that a few rows of a partly visible block see (flash_forward.cpp: kDiagonalChunkRows);
// the attention tests reach the kernel only through the shapes they happen to run.
//
// Inputs are multiples of 1/16 below 16 in magnitude, so every product is a multiple of 2^-8
// below 2^8 and a sum of at most 128 of them stays below 2^15: 23 significant bits, exact in
// fp32 in any order of summation. The kernel must match the double sums exactly.

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "cpu/kernels/tile_kernels.hpp"
#include "test_support.hpp"

namespace flashattn::testing {
namespace {

namespace cpu = detail::cpu;

constexpr float kSentinel = -12345.0f;

std::vector<float> random_sixteenths(std::mt19937_64& rng, std::int64_t n) {
  std::uniform_int_distribution<int> sixteenths(-255, 255);
  std::vector<float> values(static_cast<std::size_t>(n));
  for (float& value : values) value = static_cast<float>(sixteenths(rng)) / 16.0f;
  return values;
}

TEST(ScoresTile, ComputesExactlyTheColumnsAskedForOnEveryTarget) {
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("FLASHATTN_TEST_SEED=" + std::to_string(seed));
  std::mt19937_64 rng(seed);
  on_every_target([&] {
    for (const std::int64_t head_dim : {16, 59, 128}) {
      for (const std::int64_t keys_padded : {16, 48, 80, 128, 144}) {
        constexpr std::int64_t kRows = 13;
        // q rows 5 floats past head_dim apart; scores rows 7 past keys_padded.
        const std::int64_t ld_q = head_dim + 5, ld_scores = keys_padded + 7;
        const std::vector<float> q = random_sixteenths(rng, kRows * ld_q);
        const std::vector<float> k = random_sixteenths(rng, keys_padded * head_dim);  // [key][d]
        std::vector<float> k_packed(static_cast<std::size_t>(head_dim * keys_padded));
        for (std::int64_t key = 0; key < keys_padded; ++key) {
          for (std::int64_t d = 0; d < head_dim; ++d) {
            k_packed[cpu::packed_index(d, key, head_dim, keys_padded)] = k[key * head_dim + d];
          }
        }
        auto check_columns = [&](std::int64_t rows, std::int64_t begin, std::int64_t end) {
          SCOPED_TRACE("head_dim " + std::to_string(head_dim) + ", keys_padded " +
                       std::to_string(keys_padded) + ", rows " + std::to_string(rows) +
                       ", columns [" + std::to_string(begin) + ", " + std::to_string(end) + ")");
          std::vector<float> scores(static_cast<std::size_t>((kRows + 1) * ld_scores), kSentinel);
          if (begin == 0 && end == keys_padded) {
            cpu::scores_tile(scores.data(), ld_scores, {q.data(), ld_q}, k_packed.data(), rows,
                             keys_padded, head_dim);
          } else {
            cpu::scores_tile_columns(scores.data(), ld_scores, {q.data(), ld_q}, k_packed.data(),
                                     rows, keys_padded, head_dim, begin, end);
          }
          for (std::int64_t r = 0; r <= kRows; ++r) {
            for (std::int64_t key = 0; key < ld_scores; ++key) {
              double expected = kSentinel;
              if (r < rows && key >= begin && key < end) {
                expected = 0.0;
                for (std::int64_t d = 0; d < head_dim; ++d) {
                  expected += static_cast<double>(q[r * ld_q + d]) * k[key * head_dim + d];
                }
              }
              ASSERT_EQ(scores[r * ld_scores + key], expected) << "row " << r << ", key " << key;
            }
          }
        };
        for (std::int64_t rows = 1; rows <= kRows; ++rows) {
          for (std::int64_t begin = 0; begin < keys_padded; begin += cpu::kTileLanes) {
            for (std::int64_t end = begin + cpu::kTileLanes; end <= keys_padded;
                 end += cpu::kTileLanes) {
              check_columns(rows, begin, end);
            }
          }
        }
      }
    }
  });
}

}  // namespace
}  // namespace flashattn::testing
