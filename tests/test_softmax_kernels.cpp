// The exponentials of the softmax tiles (cpu/kernels/tile_kernels.hpp) on every SIMD target
// compiled in that this CPU runs: every float exponent between the flush threshold and 0 against
// exp2 in double, the edges exactly (t = 0, t < -125, -inf), and NaN scores whatever their bits.
// The attention tests reach these kernels only through scores that random inputs produce.
//
// Tolerance, in units of u = 2^-24: 2^t is 2^n times a degree-6 Taylor polynomial of f = t - n,
// f in [-1/2, 1/2], whose truncation is at most (ln 2 / 2)^7 / 7! = 1.2e-7 absolute, 1.7e-7 =
// 2.8 u relative at 2^-1/2; the Horner steps round 7 times, the last one by at most u and each
// earlier one shrunk by |f| <= 1/2 on its way out, under 2 u together; the scaling by 2^n is
// exact above the flush threshold. 6 u bounds the sum with margin (the largest error seen is
// 3.1 u, at f near -1/2); a wrong exponent or a wrong coefficient is off by far more.

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "cpu/kernels/tile_kernels.hpp"
#include "test_support.hpp"

namespace flashattn::testing {
namespace {

namespace cpu = detail::cpu;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr double kLog2e = 1.44269504088896341;
constexpr double kRelativeTolerance = 6 * 0x1p-24;

// NaN patterns a score can hold: quiet and signalling, either sign, payloads in the bits that
// an exponent computed from the pattern would pick up.
const std::uint32_t kNaNPatterns[] = {0x7fc00000u, 0xffc00000u, 0x7fc001ffu, 0x7f800001u,
                                      0xffffffffu, 0x7fbfffffu, 0x7fc00080u, 0xff8000ffu};

// The arguments t = s·log2 e that a score s gives with scale 1 and lse 0, as the kernel forms
// them in fp32.
float exponent_of(float score) { return static_cast<float>(score * static_cast<float>(kLog2e)); }

// Scores whose exponents cover [-126, 0]: 64 per binade of |t| down to 2^-20, the exponents
// near each integer (where n changes) and the flush threshold, and 0.
std::vector<float> probe_scores() {
  std::vector<float> scores{0.0f};
  for (int binade = -20; binade <= 6; ++binade) {
    for (int step = 0; step < 64; ++step) {
      scores.push_back(-std::ldexp(1.0f + step / 64.0f, binade) / static_cast<float>(kLog2e));
    }
  }
  for (int n = -126; n <= 0; ++n) {
    for (const float offset : {-0.5f, -0.25f, 0.0f, 0.25f, 0.5f}) {
      if (n + offset < 0) scores.push_back(static_cast<float>((n + offset) / kLog2e));
    }
  }
  for (float t = -125.0f, k = 0; k < 8; ++k, t = std::nextafter(t, 0.0f)) {
    scores.push_back(t / static_cast<float>(kLog2e));
  }
  // Pad to a whole number of tile lanes with exact zeros.
  while (scores.size() % cpu::kTileLanes != 0) scores.push_back(0.0f);
  return scores;
}

// Whether p is 2^t within the tolerance, or exactly 0 where t < -125 (the flush).
::testing::AssertionResult matches_exp2(float t, float p) {
  if (t < -125.0f) {
    if (p == 0.0f && !std::signbit(p)) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "2^" << t << " should be flushed to 0, got " << p;
  }
  const double want = std::exp2(static_cast<double>(t));
  if (std::abs(p - want) <= kRelativeTolerance * want) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "2^" << t << " = " << want << ", got " << p
                                       << " (relative error " << (p - want) / want << ")";
}

TEST(SoftmaxKernels, ProbabilitiesFromLseMatchExp2OnEveryTarget) {
  const std::vector<float> scores = probe_scores();
  const auto keys = static_cast<std::int64_t>(scores.size());
  on_every_target([&] {
    std::vector<float> tile = scores;
    const float lse = 0.0f;
    cpu::probabilities_from_lse_tile(tile.data(), keys, 1.0f, &lse, 1, keys);
    int failures = 0;
    for (std::int64_t j = 0; j < keys && failures < 5; ++j) {
      const auto result = matches_exp2(exponent_of(scores[j]), tile[j]);
      if (!result) ++failures;
      EXPECT_TRUE(result) << "score " << scores[j];
    }
  });
}

// The forward's online softmax: the row max is 0 (the probes' largest score), so every
// probability is 2^((s - 0)·log2 e), the max's exactly 1; a -inf score gives exactly 0, and so
// does every score of a row that saw nothing but -inf, which keeps l = 0.
TEST(SoftmaxKernels, OnlineSoftmaxMatchesExp2OnEveryTarget) {
  const std::vector<float> scores = probe_scores();
  const auto keys = static_cast<std::int64_t>(scores.size());
  constexpr std::int64_t kDims = cpu::kTileLanes;
  on_every_target([&] {
    std::vector<float> tile(2 * keys, -kInf);
    std::copy(scores.begin(), scores.end(), tile.begin());
    tile[3] = -kInf;
    float row_max[2] = {-kInf, -kInf}, row_sum[2] = {0.0f, 0.0f};
    std::vector<float> acc(2 * kDims, 0.0f);
    cpu::online_softmax_tile(tile.data(), keys, 1.0f, row_max, row_sum, acc.data(), kDims, 2, keys,
                             kDims);
    EXPECT_EQ(row_max[0], 0.0f);
    EXPECT_EQ(tile[0], 1.0f);
    EXPECT_EQ(std::bit_cast<std::uint32_t>(tile[3]), 0u) << "a -inf score gives +0";
    double sum = 0;
    int failures = 0;
    for (std::int64_t j = 0; j < keys; ++j) {
      sum += tile[j];
      if (j == 3 || failures >= 5) continue;
      const auto result = matches_exp2(exponent_of(scores[j]), tile[j]);
      if (!result) ++failures;
      EXPECT_TRUE(result) << "score " << scores[j];
    }
    // fp32 sums of `keys` terms against the double sum: keys·2^-24 relative at most.
    EXPECT_NEAR(row_sum[0], sum, static_cast<double>(keys) * 0x1p-24 * sum);
    // Highway's EMU128 target (clang builds) reduces a row of -inf to the lowest float, not
    // -inf: the probabilities, the sum and the lse it gives are the same.
    EXPECT_TRUE(row_max[1] == -kInf || row_max[1] == std::numeric_limits<float>::lowest())
        << row_max[1];
    EXPECT_EQ(row_sum[1], 0.0f);
    for (std::int64_t j = 0; j < keys; ++j) ASSERT_EQ(tile[keys + j], 0.0f) << "key " << j;
  });
}

// A NaN score gives a NaN probability, in its own lane only, whatever its sign and payload; on
// both kernels.
TEST(SoftmaxKernels, NaNScoresStayNaNOnEveryTarget) {
  constexpr std::int64_t kKeys = 2 * cpu::kTileLanes, kDims = cpu::kTileLanes;
  on_every_target([&] {
    for (const std::uint32_t pattern : kNaNPatterns) {
      SCOPED_TRACE("NaN pattern " + std::to_string(pattern));
      const float nan = std::bit_cast<float>(pattern);
      std::vector<float> scores(kKeys, -1.0f);
      scores[5] = nan;
      scores[kKeys - 1] = nan;

      std::vector<float> from_lse = scores;
      const float lse = 0.0f;
      cpu::probabilities_from_lse_tile(from_lse.data(), kKeys, 1.0f, &lse, 1, kKeys);
      std::vector<float> online = scores;
      float row_max = -kInf, row_sum = 0.0f;
      std::vector<float> acc(kDims, 0.0f);
      cpu::online_softmax_tile(online.data(), kKeys, 1.0f, &row_max, &row_sum, acc.data(), kDims, 1,
                               kKeys, kDims);
      for (std::int64_t j = 0; j < kKeys; ++j) {
        const bool poisoned = j == 5 || j == kKeys - 1;
        EXPECT_EQ(std::isnan(from_lse[j]), poisoned) << "probabilities_from_lse, key " << j;
        // Whatever max the row settles on with a NaN among its scores (x86's max keeps one
        // operand or the other), the other lanes stay finite.
        EXPECT_EQ(std::isnan(online[j]), poisoned) << "online softmax, key " << j;
      }
      EXPECT_TRUE(std::isnan(row_sum));
    }
  });
}

}  // namespace
}  // namespace flashattn::testing
