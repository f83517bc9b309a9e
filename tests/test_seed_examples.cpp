// The worked examples of the seeds (../shared/seeds), with their numbers written out, through
// all three paths; and the edge semantics of docs/design.md, "The contract".

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "test_support.hpp"

namespace flashattn::testing {
namespace {

constexpr AttentionImpl kAllImpls[] = {AttentionImpl::flash, AttentionImpl::standard,
                                       AttentionImpl::reference};

// A [1, S, 1, D] tensor holding `rows` (S x D, row-major).
Tensor single_head(std::int64_t S, std::int64_t D, std::initializer_list<float> rows) {
  Tensor t(DType::f32, {1, S, 1, D});
  auto value = rows.begin();
  for (std::int64_t s = 0; s < S; ++s)
    for (std::int64_t d = 0; d < D; ++d) t.set(0, s, 0, d, *value++);
  return t;
}

// Seed 002: n = 2 tokens, d = 3, S = Q·Kᵀ (the seed does not scale, so softmax_scale = 1).
//   Q = [[1,0,1],[0,1,1]], K = [[1,1,0],[0,1,1]], V = [[1,2,3],[4,5,6]]
//   S = [[1,1],[1,2]]
//   P = [[1/2, 1/2], [1/(1+e), e/(1+e)]] = [[0.5, 0.5], [0.2689414214, 0.7310585786]]
//   O = P·V = [[2.5, 3.5, 4.5], [1 + 3·0.7310585786, ...]] = [[2.5,3.5,4.5],[3.1931757359,...]]
//   lse = [1 + ln 2, 1 + ln(1 + e)] = [1.6931471806, 2.3132616875]
// With the causal mask the first row sees only k1: P = [[1, 0], ...], O_1 = v_1 = [1, 2, 3],
// lse_1 = 1; the second row is unchanged.
class SeedTwoTokenExample : public ::testing::TestWithParam<AttentionImpl> {};

TEST_P(SeedTwoTokenExample, MatchesTheWorkedNumbers) {
  const Tensor q = single_head(2, 3, {1, 0, 1, 0, 1, 1});
  const Tensor k = single_head(2, 3, {1, 1, 0, 0, 1, 1});
  const Tensor v = single_head(2, 3, {1, 2, 3, 4, 5, 6});
  const double second_row[3] = {3.1931757359, 4.1931757359, 5.1931757359};

  for (bool causal : {false, true}) {
    Tensor out(DType::f32, {1, 2, 1, 3});
    out.poison();
    float lse[2] = {NAN, NAN};
    AttentionOptions options;
    options.softmax_scale = 1.0f;
    options.causal = causal;
    attention_forward(GetParam(), q.view, k.view, v.view, out.view, lse, options);

    const double first_row[3] = {causal ? 1.0 : 2.5, causal ? 2.0 : 3.5, causal ? 3.0 : 4.5};
    for (int d = 0; d < 3; ++d) {
      EXPECT_NEAR(out.at(0, 0, 0, d), first_row[d], 1e-6) << "causal=" << causal << " d=" << d;
      EXPECT_NEAR(out.at(0, 1, 0, d), second_row[d], 1e-6) << "causal=" << causal << " d=" << d;
    }
    EXPECT_NEAR(lse[0], causal ? 1.0 : 1.6931471806, 1e-6);
    EXPECT_NEAR(lse[1], 2.3132616875, 1e-6);
  }
}

// Seed 000: S = 4 tokens with the causal mask. With V = I, O = P·V = P, so the output shows the
// probabilities directly: row i attends only to j <= i (exact zeros above the diagonal), every
// row sums to 1, and the first row is (1, 0, 0, 0).
class SeedFourTokenCausal : public ::testing::TestWithParam<AttentionImpl> {};

TEST_P(SeedFourTokenCausal, RowsSeeOnlyThePastAndSumToOne) {
  std::mt19937_64 rng(test_seed());
  Tensor q(DType::f32, {1, 4, 1, 4}), k(DType::f32, {1, 4, 1, 4});
  q.fill_normal(rng);
  k.fill_normal(rng);
  const Tensor v = single_head(4, 4, {1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1});
  Tensor p(DType::f32, {1, 4, 1, 4});
  p.poison();
  AttentionOptions options;
  options.causal = true;
  attention_forward(GetParam(), q.view, k.view, v.view, p.view, nullptr, options);

  for (int i = 0; i < 4; ++i) {
    double row_sum = 0.0;
    for (int j = 0; j < 4; ++j) {
      if (j > i) {
        EXPECT_EQ(p.at(0, i, 0, j), 0.0f) << "future token " << j << " seen by " << i;
      }
      EXPECT_GE(p.at(0, i, 0, j), 0.0f);
      row_sum += p.at(0, i, 0, j);
    }
    EXPECT_NEAR(row_sum, 1.0, 4e-7) << "row " << i;
  }
  EXPECT_EQ(p.at(0, 0, 0, 0), 1.0f);
}

// Seed 000: softmax(3, 1, -inf) = (e³/(e³+e), e/(e³+e), 0) = (0.8807970780, 0.1192029220, 0):
// the masked probability is exactly 0. Scores 3 and 1 come from q = (1, 0, 0) against keys
// (3, 0, 0) and (1, 0, 0); a third key (100, 0, 0) is hidden by a window (left = 1: the query,
// on diagonal key 2, sees keys 1 and 2). With V = I the output is the probability vector, in
// key order (masked, 3, 1).
TEST_P(SeedFourTokenCausal, SoftmaxOfThreeOneMinusInfinity) {
  const Tensor q = single_head(1, 3, {1, 0, 0});
  const Tensor k = single_head(3, 3, {100, 0, 0, 3, 0, 0, 1, 0, 0});
  Tensor v(DType::f32, {1, 3, 1, 3});
  v.fill(0.0f);
  for (int j = 0; j < 3; ++j) v.set(0, j, 0, j, 1.0f);
  Tensor p(DType::f32, {1, 1, 1, 3});
  p.poison();
  AttentionOptions options;
  options.softmax_scale = 1.0f;
  options.window_left = 1;
  attention_forward(GetParam(), q.view, k.view, v.view, p.view, nullptr, options);
  EXPECT_EQ(p.at(0, 0, 0, 0), 0.0f);
  EXPECT_NEAR(p.at(0, 0, 0, 1), 0.8807970780, 1e-7);
  EXPECT_NEAR(p.at(0, 0, 0, 2), 0.1192029220, 1e-7);
}

INSTANTIATE_TEST_SUITE_P(AllPaths, SeedTwoTokenExample, ::testing::ValuesIn(kAllImpls),
                         [](const auto& info) { return std::string(impl_name(info.param)); });
INSTANTIATE_TEST_SUITE_P(AllPaths, SeedFourTokenCausal, ::testing::ValuesIn(kAllImpls),
                         [](const auto& info) { return std::string(impl_name(info.param)); });

// docs/design.md, "The contract" edge semantics, for every path.
class EdgeSemantics : public ::testing::TestWithParam<AttentionImpl> {
 protected:
  // Runs GetParam() on q [1, Sq, 2, D] and k/v [1, Skv, 2, D] filled by the callers.
  void run(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, std::vector<float>& lse,
           const AttentionOptions& options) {
    out.poison();
    lse.assign(static_cast<std::size_t>(q.view.shape[0] * q.view.shape[2] * q.view.shape[1]), NAN);
    attention_forward(GetParam(), q.view, k.view, v.view, out.view, lse.data(), options);
  }
};

// Causal with Sq > Skv: bottom-right alignment leaves the first Sq - Skv rows without keys.
TEST_P(EdgeSemantics, FullyMaskedRowsGiveZeroAndMinusInfinity) {
  std::mt19937_64 rng(test_seed());
  const std::int64_t Sq = 9, Skv = 4, D = 8;
  Tensor q(DType::f32, {1, Sq, 2, D}), k(DType::f32, {1, Skv, 2, D}), v(DType::f32, {1, Skv, 2, D});
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  Tensor out(DType::f32, {1, Sq, 2, D});
  std::vector<float> lse;
  AttentionOptions options;
  options.causal = true;
  run(q, k, v, out, lse, options);
  for (std::int64_t h = 0; h < 2; ++h) {
    for (std::int64_t row = 0; row < Sq; ++row) {
      const bool masked = row < Sq - Skv;
      const float row_lse = lse[h * Sq + row];
      if (masked) {
        EXPECT_EQ(row_lse, -std::numeric_limits<float>::infinity()) << "row " << row;
      } else {
        EXPECT_TRUE(std::isfinite(row_lse)) << "row " << row;
      }
      for (std::int64_t d = 0; d < D; ++d) {
        if (masked) {
          EXPECT_EQ(out.at(0, row, h, d), 0.0f) << "row " << row;
        }
        EXPECT_TRUE(std::isfinite(out.at(0, row, h, d))) << "row " << row;
      }
    }
  }
}

TEST_P(EdgeSemantics, EmptyKeySequenceGivesZeroAndMinusInfinity) {
  Tensor q(DType::f32, {1, 5, 2, 16}), k(DType::f32, {1, 0, 2, 16}), v(DType::f32, {1, 0, 2, 16});
  q.fill(1.0f);
  Tensor out(DType::f32, {1, 5, 2, 16});
  std::vector<float> lse;
  run(q, k, v, out, lse, {});
  out.for_each_index([&](auto a, auto b, auto c, auto d) { EXPECT_EQ(out.at(a, b, c, d), 0.0f); });
  for (float x : lse) EXPECT_EQ(x, -std::numeric_limits<float>::infinity());
}

// Scores near ±1e4 neither overflow exp() nor lose the row: the max subtraction keeps the
// largest term at exp(0). q and k hold integers in [-100, 100] and D = 16, so every product and
// sum is exact in fp32 (|q·k| <= 1.6e5 < 2^24) and scale = 1/4 is exact: the scores carry no
// rounding at all, and the outputs must match the fp64 reference to fp32 accuracy.
TEST_P(EdgeSemantics, HugeScoresStayFiniteAndExact) {
  std::mt19937_64 rng(test_seed());
  const std::int64_t S = 37, D = 16;
  Tensor q(DType::f32, {1, S, 2, D}), k(DType::f32, {1, S, 2, D}), v(DType::f32, {1, S, 2, D});
  std::uniform_int_distribution<int> integer(-100, 100);
  q.for_each_index([&](auto a, auto b, auto c, auto d) { q.set(a, b, c, d, integer(rng)); });
  k.for_each_index([&](auto a, auto b, auto c, auto d) { k.set(a, b, c, d, integer(rng)); });
  v.fill_normal(rng);
  AttentionOptions options;
  options.causal = true;
  const ReferenceResult ref = reference(q, k, v, options);
  Tensor out(DType::f32, {1, S, 2, D});
  std::vector<float> lse;
  run(q, k, v, out, lse, options);
  double max_lse = 0.0;
  for (double x : ref.lse) max_lse = std::max(max_lse, std::abs(x));
  EXPECT_GT(max_lse, 5e3) << "the inputs did not produce huge scores";
  std::int64_t flat = 0;
  out.for_each_index([&](auto a, auto b, auto c, auto d) {
    EXPECT_NEAR(out.at(a, b, c, d), ref.out[flat], 1e-5) << "index " << flat;
    ++flat;
  });
  for (std::size_t i = 0; i < lse.size(); ++i) {
    EXPECT_NEAR(lse[i], ref.lse[i], 4 * 0x1p-24 * std::abs(ref.lse[i]) + 1e-6) << "lse " << i;
  }
}

// A NaN in one query row poisons exactly that row; a NaN in one key poisons exactly the rows
// that see that key (causal: rows at or after it), and no other row.
TEST_P(EdgeSemantics, NaNPropagatesOnlyToRowsItTouches) {
  std::mt19937_64 rng(test_seed());
  const std::int64_t S = 150, D = 8, nan_query = 3, nan_key = 140;
  Tensor q(DType::f32, {1, S, 2, D}), k(DType::f32, {1, S, 2, D}), v(DType::f32, {1, S, 2, D});
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  q.set(0, nan_query, 0, 2, NAN);
  k.set(0, nan_key, 1, 5, NAN);
  Tensor out(DType::f32, {1, S, 2, D});
  std::vector<float> lse;
  AttentionOptions options;
  options.causal = true;
  run(q, k, v, out, lse, options);
  for (std::int64_t h = 0; h < 2; ++h) {
    for (std::int64_t row = 0; row < S; ++row) {
      const bool poisoned = (h == 0 && row == nan_query) || (h == 1 && row >= nan_key);
      for (std::int64_t d = 0; d < D; ++d) {
        EXPECT_EQ(std::isnan(out.at(0, row, h, d)), poisoned) << "head " << h << " row " << row;
      }
      EXPECT_EQ(std::isnan(lse[h * S + row]), poisoned) << "lse head " << h << " row " << row;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllPaths, EdgeSemantics, ::testing::ValuesIn(kAllImpls),
                         [](const auto& info) { return std::string(impl_name(info.param)); });

}  // namespace
}  // namespace flashattn::testing
