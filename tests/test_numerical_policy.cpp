// The numerical policy (README "Numerical policy"), through all three paths: fully masked rows,
// NaN and ±inf in q, k, v, huge scores, denormals, extreme scales, and degenerate shapes.
//
// The fp64 reference is the specification: each path must give, element by element, a value of
// the same kind (NaN, +inf, -inf or finite) as the reference, and finite values within a derived
// tolerance. Outputs are pre-filled with a finite sentinel instead of NaN, because NaN is an
// expected result here and an unwritten element must not pass for one.
//
// Tolerance (first-order forward error of fp32 attention, as in test_attention_vs_reference):
//   out: u32·max|v|·(4·scale·D·max|q|·max|k| + 2·Skv + 16) + u_out·|ref| + floor
//   lse: u32·(4·scale·D·max|q|·max|k| + 2·Skv + 16) + 4·u32·|ref|
// where the scale·D·max|q|·max|k| term is the rounding of a length-D fp32 dot product and
// 2·Skv + 16 the softmax sum and the P·V accumulation. Tests whose q and k hold small integers
// times powers of two have exact scores, so they drop that term. `floor` is the absolute error
// of denormal arithmetic, where spacing is fixed instead of relative: 2^-149 per fp32 operation
// (Skv + D + 16 of them per output) plus half the smallest denormal of the output dtype. The
// reference path only rounds its fp64 result once: u_out·|ref| + floor for out, u32·|ref| + 2^-149
// for lse.

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <sstream>
#include <string>

#include "test_support.hpp"

namespace flashattn::testing {
namespace {

constexpr AttentionImpl kAllImpls[] = {AttentionImpl::flash, AttentionImpl::standard,
                                       AttentionImpl::reference};
constexpr DType kAllDtypes[] = {DType::f32, DType::f16, DType::bf16};
constexpr float kNaNf = std::numeric_limits<float>::quiet_NaN();
constexpr float kInff = std::numeric_limits<float>::infinity();
// Marks an element the call did not write; no test produces it.
constexpr float kSentinel = -12345.0f;

std::string impl_test_name(const ::testing::TestParamInfo<AttentionImpl>& info) {
  return impl_name(info.param);
}

struct Outcome {
  Tensor out;
  std::vector<float> lse;
};

Outcome run(AttentionImpl impl, const Tensor& q, const Tensor& k, const Tensor& v,
            const AttentionOptions& options) {
  Outcome result{Tensor(q.view.dtype, q.view.shape), {}};
  result.out.fill(kSentinel);
  const auto& s = q.view.shape;
  result.lse.assign(static_cast<std::size_t>(s[0] * s[2] * s[1]), kSentinel);
  attention_forward(impl, q.view, k.view, v.view, result.out.view, result.lse.data(), options);
  return result;
}

double max_abs_finite(const Tensor& t) {
  double result = 0.0;
  t.for_each_index([&](auto a, auto b, auto c, auto d) {
    const double x = t.at(a, b, c, d);
    if (std::isfinite(x)) result = std::max(result, std::abs(x));
  });
  return result;
}

// Half the smallest positive denormal of each dtype: the absolute rounding error near zero.
double half_smallest_denormal(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return 0x1p-150;
    case DType::f16:
      return 0x1p-25;
    case DType::bf16:
      return 0x1p-134;
    case DType::int8:
    case DType::fp8_e4m3:
    case DType::fp8_e5m2:
      break;  // cache dtypes: no attention output takes them
  }
  return 0.0;
}

struct Bounds {
  double out_absolute = 0.0;  // plus u_out·|ref| per element
  double lse_absolute = 0.0;  // plus lse_relative·|ref| per element
  double lse_relative = 0.0;
};

Bounds derive_bounds(AttentionImpl impl, const Tensor& q, const Tensor& k, const Tensor& v,
                     const AttentionOptions& options, bool exact_scores) {
  const double u32 = unit_roundoff(DType::f32);
  const DType dtype = q.view.dtype;
  const double D = static_cast<double>(q.view.shape[3]);
  const double Skv = static_cast<double>(k.view.shape[1]);
  const double scale = options.softmax_scale ? *options.softmax_scale : 1.0 / std::sqrt(D);
  const double floor = (Skv + D + 16.0) * 0x1p-149 + half_smallest_denormal(dtype);
  if (impl == AttentionImpl::reference) return {floor, 0x1p-149, u32};
  const double scores =
      exact_scores ? 0.0 : 4.0 * scale * D * max_abs_finite(q) * max_abs_finite(k);
  const double mixing = u32 * (scores + 2.0 * Skv + 16.0);
  return {mixing * max_abs_finite(v) + probability_rounding_bound(dtype, max_abs_finite(v)) + floor,
          mixing, 4.0 * u32};
}

enum class Kind { nan, plus_inf, minus_inf, finite };

Kind kind_of(double x) {
  if (std::isnan(x)) return Kind::nan;
  if (std::isinf(x)) return x > 0 ? Kind::plus_inf : Kind::minus_inf;
  return Kind::finite;
}

// Every element of `got` has the kind of the reference's, and finite ones are within bounds.
// Returns the number of mismatches (each reported, the first few in full).
int compare_with_reference(const Outcome& got, const ReferenceResult& ref, const Bounds& bounds,
                           const std::string& context) {
  const double u_out = unit_roundoff(got.out.view.dtype);
  int mismatches = 0;
  auto check = [&](const char* what, std::int64_t index, double value, double want,
                   double tolerance) {
    const bool same_kind = kind_of(value) == kind_of(want);
    if (same_kind && (!std::isfinite(want) || std::abs(value - want) <= tolerance)) return;
    if (++mismatches <= 5) {
      std::ostringstream limit;
      if (std::isfinite(want)) limit << " (tolerance " << tolerance << ")";
      ADD_FAILURE() << context << ": " << what << "[" << index << "] = " << value << ", reference "
                    << want << limit.str();
    }
  };
  std::int64_t flat = 0;
  got.out.for_each_index([&](auto b, auto s, auto h, auto d) {
    const double want = ref.out[flat];
    check("out", flat, got.out.at(b, s, h, d), want, bounds.out_absolute + u_out * std::abs(want));
    ++flat;
  });
  for (std::size_t i = 0; i < got.lse.size(); ++i) {
    const double want = ref.lse[i];
    check("lse", static_cast<std::int64_t>(i), got.lse[i], want,
          bounds.lse_absolute + bounds.lse_relative * std::abs(want));
  }
  return mismatches;
}

// Runs `impl` and compares it with the reference on the same inputs.
void expect_reference_result(AttentionImpl impl, const Tensor& q, const Tensor& k, const Tensor& v,
                             const AttentionOptions& options, bool exact_scores,
                             const std::string& context) {
  const ReferenceResult ref = reference(q, k, v, options);
  const Outcome got = run(impl, q, k, v, options);
  const Bounds bounds = derive_bounds(impl, q, k, v, options, exact_scores);
  EXPECT_EQ(compare_with_reference(got, ref, bounds, context), 0)
      << context << " (" << impl_name(impl) << ", " << dtype_name(q.view.dtype) << ", seed "
      << test_seed() << ")";
}

struct Problem {
  Tensor q, k, v;
  AttentionOptions options;
};

Problem random_problem(DType dtype, std::array<std::int64_t, 4> q_shape,
                       std::array<std::int64_t, 4> kv_shape, std::uint64_t salt) {
  std::mt19937_64 rng(test_seed() ^ salt);
  Problem p{Tensor(dtype, q_shape), Tensor(dtype, kv_shape), Tensor(dtype, kv_shape), {}};
  p.q.fill_normal(rng);
  p.k.fill_normal(rng);
  p.v.fill_normal(rng);
  return p;
}

// ---------------------------------------------------------------------------------------------
// NaN and ±inf: a non-finite input reaches exactly the output rows that read it. Inputs are
// [1, 300, 2, 8], causal, so rows and keys span several FlashAttention blocks and query row i
// reads keys 0..i; every poison goes into head 1, so head 0 must come out entirely finite.
// Which rows a poison touches, and what it does there, is IEEE arithmetic on the formula
// softmax(s)·V with s = scale·q·kᵀ and the max subtracted, exactly as the reference computes it:
//   NaN anywhere in a row's inputs                -> that row's out NaN (lse NaN unless only v)
//   ±inf in v                                      -> ±inf (or NaN) in that column of the rows
//   a +inf score                                   -> the row NaN (inf - inf), lse NaN
//   a -inf score among finite ones                 -> weight exactly 0 for that key, row finite
//   every visible score -inf                       -> out NaN (0/0), lse -inf

constexpr std::int64_t kSeq = 300, kDim = 8, kRow = 5, kKey = 200;

struct Poison {
  std::string name;
  std::function<void(Problem&)> apply;
  std::function<bool(std::int64_t row)> touches;  // rows of head 1 whose inputs it reaches
};

void set_sign_of_column(Tensor& t, std::int64_t head, std::int64_t column, float sign) {
  for (std::int64_t s = 0; s < t.view.shape[1]; ++s) {
    t.set(0, s, head, column, sign * (0.5f + std::abs(t.at(0, s, head, column))));
  }
}

std::vector<Poison> poisons() {
  auto from_key = [](std::int64_t row) { return row >= kKey; };
  auto one_row = [](std::int64_t row) { return row == kRow; };
  return {
      {"NaNInQuery", [](Problem& p) { p.q.set(0, kRow, 1, 2, kNaNf); }, one_row},
      {"NaNInKey", [](Problem& p) { p.k.set(0, kKey, 1, 3, kNaNf); }, from_key},
      {"NaNInValue", [](Problem& p) { p.v.set(0, kKey, 1, 3, kNaNf); }, from_key},
      {"PlusInfInValue", [](Problem& p) { p.v.set(0, kKey, 1, 3, kInff); }, from_key},
      {"MinusInfInValue", [](Problem& p) { p.v.set(0, kKey, 1, 3, -kInff); }, from_key},
      {"InfInKeyGivesPlusInfScore",
       [](Problem& p) {
         set_sign_of_column(p.q, 1, 3, 1.0f);
         p.k.set(0, kKey, 1, 3, kInff);
       },
       from_key},
      {"InfInKeyGivesMinusInfScore",
       [](Problem& p) {
         set_sign_of_column(p.q, 1, 3, -1.0f);
         p.k.set(0, kKey, 1, 3, kInff);
       },
       from_key},
      // Row 0 sees key 0 only: all of its scores are -inf.
      {"InfInKeyGivesOnlyMinusInfScores",
       [](Problem& p) {
         set_sign_of_column(p.q, 1, 3, -1.0f);
         p.k.set(0, 0, 1, 3, kInff);
       },
       [](std::int64_t) { return true; }},
      {"PlusInfInQuery",
       [](Problem& p) {
         set_sign_of_column(p.k, 1, 4, 1.0f);
         p.q.set(0, kRow, 1, 4, kInff);
       },
       one_row},
      {"MinusInfInQueryGivesOnlyMinusInfScores",
       [](Problem& p) {
         set_sign_of_column(p.k, 1, 4, 1.0f);
         p.q.set(0, kRow, 1, 4, -kInff);
       },
       one_row},
      // Keys after the diagonal are masked: nothing in them may reach a row that cannot see them.
      {"NonFiniteInMaskedKeys",
       [](Problem& p) {
         p.k.set(0, kSeq - 1, 1, 0, kNaNf);
         p.v.set(0, kSeq - 1, 1, 1, kInff);
         p.v.set(0, kSeq - 2, 1, 2, kNaNf);
         p.k.set(0, kSeq - 3, 1, 3, -kInff);
       },
       [](std::int64_t row) { return row >= kSeq - 3; }},
  };
}

void PrintTo(const Poison& poison, std::ostream* os) { *os << poison.name; }

// Kernel changes this policy still waits for (src/cpu, src/standard; see the README's
// robustness table). Each entry names the case and why the path fails it today; delete the
// entry with the fix.
class NonFiniteInputs : public ::testing::TestWithParam<std::tuple<AttentionImpl, Poison>> {};

TEST_P(NonFiniteInputs, ReachExactlyTheRowsThatReadThem) {
  const auto& [impl, poison] = GetParam();
  for (DType dtype : kAllDtypes) {
    Problem p = random_problem(dtype, {1, kSeq, 2, kDim}, {1, kSeq, 2, kDim}, 7);
    p.options.causal = true;
    poison.apply(p);
    const std::string context = poison.name + " " + dtype_name(dtype);

    // The oracle itself: rows the poison cannot reach stay finite, rows it reaches do not
    // (except where a -inf score only removes a key), and head 0 is untouched.
    const ReferenceResult ref = reference(p.q, p.k, p.v, p.options);
    for (std::int64_t h = 0; h < 2; ++h) {
      for (std::int64_t row = 0; row < kSeq; ++row) {
        bool finite = std::isfinite(ref.lse[h * kSeq + row]);
        for (std::int64_t d = 0; d < kDim; ++d) {
          finite = finite && std::isfinite(ref.out[(row * 2 + h) * kDim + d]);
        }
        if (h == 0 || !poison.touches(row)) {
          ASSERT_TRUE(finite) << context << ": reference row " << row << " head " << h;
        }
      }
    }
    expect_reference_result(impl, p.q, p.k, p.v, p.options, false, context);
  }
}

INSTANTIATE_TEST_SUITE_P(AllPaths, NonFiniteInputs,
                         ::testing::Combine(::testing::ValuesIn(kAllImpls),
                                            ::testing::ValuesIn(poisons())),
                         [](const auto& info) {
                           return std::string(impl_name(std::get<0>(info.param))) + "_" +
                                  std::get<1>(info.param).name;
                         });

// The same policy on the decode path (two positions of a GQA group, group · Sq = 4 rows per KV
// head, against 1500 keys: 12 chunks of 128 keys merged at the end; and 16 rows per KV head,
// taken by other blocks of the kernels). Under the causal mask the last key is seen by position
// 1 only, and a window shows key 498 to position 0 only: a poison must reach exactly the rows
// that read it, through the chunk merge.
TEST(NonFiniteInputsDecode, ReachExactlyTheRowsThatReadThem) {
  constexpr std::int64_t kKeys = 1500;
  struct DecodePoison {
    const char* name;
    bool causal;
    std::function<void(Problem&)> apply;
  };
  const DecodePoison decode_poisons[] = {
      {"NaNInLastKey", true, [](Problem& p) { p.k.set(0, kKeys - 1, 1, 3, kNaNf); }},
      {"PlusInfInLastValue", true, [](Problem& p) { p.v.set(0, kKeys - 1, 0, 2, kInff); }},
      {"NaNInValueOfAChunkBoundary", false, [](Problem& p) { p.v.set(0, 512, 1, 0, kNaNf); }},
      {"InfInKeyGivesPlusInfScore", false,
       [](Problem& p) {
         set_sign_of_column(p.q, 2, 3, 1.0f);
         p.k.set(0, 900, 1, 3, kInff);
       }},
      {"MinusInfInQuery", true,
       [](Problem& p) {
         set_sign_of_column(p.k, 0, 4, 1.0f);
         p.q.set(0, 1, 1, 4, -kInff);
       }},
      // Row (position 1, head 1) has nothing but -inf scores, and NaN at key 700: the chunk's
      // max skips the NaN, its sum does not, and the merge must keep the row NaN (a fuzzer
      // found the merge skipping such a chunk: lse -inf).
      {"NaNScoreAmongMinusInfScores", false,
       [](Problem& p) {
         set_sign_of_column(p.k, 0, 4, 1.0f);
         p.q.set(0, 1, 1, 4, -kInff);
         p.k.set(0, 700, 0, 2, kNaNf);
       }},
      // With window_left = 1000, position 0 sees keys 498 on and position 1 keys 499 on: key
      // 498 is seen by position 0 only, key 100 by neither.
      {"NonFiniteOutsideOneRowsWindow", false,
       [](Problem& p) {
         p.k.set(0, 498, 0, 1, kNaNf);
         p.v.set(0, 100, 1, 1, kInff);
       }},
  };
  for (const DecodePoison& poison : decode_poisons) {
    for (const std::int64_t heads_q : {4, 16}) {
      for (DType dtype : kAllDtypes) {
        Problem p = random_problem(dtype, {1, 2, heads_q, kDim}, {1, kKeys, 2, kDim}, 11);
        p.options.causal = poison.causal;
        if (std::string(poison.name) == "NonFiniteOutsideOneRowsWindow") {
          p.options.window_left = 1000;
        }
        poison.apply(p);
        const std::string context = std::string(poison.name) + " " + dtype_name(dtype) + ", " +
                                    std::to_string(heads_q) + " query heads";
        // Not vacuous: the poison reaches some outputs of the reference and not others.
        const ReferenceResult ref = reference(p.q, p.k, p.v, p.options);
        const auto non_finite = std::count_if(ref.out.begin(), ref.out.end(),
                                              [](double x) { return !std::isfinite(x); });
        EXPECT_GT(non_finite, 0) << context;
        EXPECT_LT(non_finite, static_cast<std::int64_t>(ref.out.size())) << context;
        expect_reference_result(AttentionImpl::flash, p.q, p.k, p.v, p.options, false, context);
      }
    }
  }
}

class NumericalPolicy : public ::testing::TestWithParam<AttentionImpl> {};

// ---------------------------------------------------------------------------------------------
// Fully masked rows give exactly 0 and lse -inf, whatever their own query holds: no key is
// visible, so the query enters no score. Window (0, 0) with Sq = 10 > Skv = 4: rows 0..5 sit
// before the first key, row 6 + j sees key j alone (out = v_j exactly, lse = its score).
TEST_P(NumericalPolicy, FullyMaskedRowsAreZeroAndMinusInfWhateverTheirQuery) {
  for (DType dtype : kAllDtypes) {
    Problem p = random_problem(dtype, {2, 10, 3, 8}, {2, 4, 3, 8}, 11);
    p.options.window_left = 0;
    p.options.window_right = 0;
    for (std::int64_t row = 0; row < 6; ++row) {
      p.q.set(1, row, 2, row % 8, row % 2 == 0 ? kNaNf : -kInff);
    }
    const Outcome got = run(GetParam(), p.q, p.k, p.v, p.options);
    for (std::int64_t b = 0; b < 2; ++b) {
      for (std::int64_t h = 0; h < 3; ++h) {
        for (std::int64_t row = 0; row < 10; ++row) {
          const float lse = got.lse[(b * 3 + h) * 10 + row];
          for (std::int64_t d = 0; d < 8; ++d) {
            const float out = got.out.at(b, row, h, d);
            if (row < 6) {
              EXPECT_EQ(out, 0.0f) << dtype_name(dtype) << " b" << b << " h" << h << " row " << row;
            } else {
              EXPECT_EQ(out, p.v.at(b, row - 6, h, d)) << dtype_name(dtype) << " row " << row;
            }
          }
          if (row < 6) {
            EXPECT_EQ(lse, -kInff) << dtype_name(dtype) << " b" << b << " h" << h << " row " << row;
          } else {
            EXPECT_TRUE(std::isfinite(lse)) << dtype_name(dtype) << " row " << row;
          }
        }
      }
    }
    expect_reference_result(GetParam(), p.q, p.k, p.v, p.options, false, "fully masked");
  }
}

// q and k hold small integers times `unit`, built so that every row has one largest score:
// dim 0 carries ±64·(π(j) + 1) for a random permutation π of the keys against a query of
// ±(1..3), which outweighs the other dims (|Σ| <= 7·3·3 = 63 < 64). Every product is an
// integer times unit², every dot product is exact in fp32, and distinct scores differ by at
// least unit²·scale. With that gap far above 104 (where exp() is exactly 0 in fp32) the softmax
// is exactly one-hot on the maximum: out = v of that key, lse = the maximum, whatever order or
// scaling a path uses. `negative`: q > 0 and k < 0, so every score is negative.
Problem unique_max_problem(DType dtype, std::array<std::int64_t, 4> q_shape,
                           std::array<std::int64_t, 4> kv_shape, float unit, bool negative,
                           std::uint64_t salt) {
  Problem p = random_problem(dtype, q_shape, kv_shape, salt);
  std::mt19937_64 rng(test_seed() ^ salt);
  std::uniform_int_distribution<int> small(1, 3), coin(0, 1);
  auto signed_small = [&] {
    return static_cast<float>(negative || coin(rng) ? small(rng) : -small(rng));
  };
  p.q.for_each_index(
      [&](auto a, auto b, auto c, auto d) { p.q.set(a, b, c, d, unit * signed_small()); });
  std::vector<int> order(static_cast<std::size_t>(kv_shape[1]));
  for (std::int64_t a = 0; a < kv_shape[0]; ++a) {
    for (std::int64_t c = 0; c < kv_shape[2]; ++c) {
      std::iota(order.begin(), order.end(), 1);
      std::shuffle(order.begin(), order.end(), rng);
      for (std::int64_t b = 0; b < kv_shape[1]; ++b) {
        for (std::int64_t d = 0; d < kv_shape[3]; ++d) {
          const float magnitude = d == 0 ? 64.0f * order[b] : static_cast<float>(small(rng));
          p.k.set(a, b, c, d, unit * (negative ? -magnitude : d == 0 ? magnitude : signed_small()));
        }
      }
    }
  }
  return p;
}

// |scores| up to ~1e30 (unit 2^44, scale 1), positive and negative, and all negative.
TEST_P(NumericalPolicy, HugeScoresMatchTheReference) {
  for (bool negative : {false, true}) {
    Problem p = unique_max_problem(DType::f32, {1, 70, 2, 8}, {1, 90, 2, 8}, 0x1p44f, negative, 13);
    p.options.softmax_scale = 1.0f;
    p.options.causal = true;
    const ReferenceResult ref = reference(p.q, p.k, p.v, p.options);
    double largest = 0.0;
    for (double x : ref.lse) largest = std::max(largest, std::abs(x));
    ASSERT_GT(largest, 5e28) << "the inputs did not produce huge scores";
    expect_reference_result(GetParam(), p.q, p.k, p.v, p.options, true,
                            negative ? "scores all negative, down to -1e30" : "scores up to ±1e30");
  }
}

// Scale 1e30 on the same construction with unit 1 (scores are integers times 1e30, so the
// softmax is one-hot), and scale 1e-30 on random data (every score within 1e-29 of 0, so the
// softmax is uniform to fp32 accuracy).
TEST_P(NumericalPolicy, ExtremeScalesMatchTheReference) {
  for (DType dtype : kAllDtypes) {
    Problem p = unique_max_problem(dtype, {2, 33, 2, 8}, {2, 47, 2, 8}, 1.0f, false, 17);
    p.options.softmax_scale = 1e30f;
    p.options.causal = true;
    expect_reference_result(GetParam(), p.q, p.k, p.v, p.options, true, "scale 1e30");

    Problem tiny = random_problem(dtype, {2, 33, 2, 8}, {2, 47, 2, 8}, 19);
    tiny.options.softmax_scale = 1e-30f;
    expect_reference_result(GetParam(), tiny.q, tiny.k, tiny.v, tiny.options, false, "scale 1e-30");
  }
}

// Denormal inputs are used as they are, never flushed to zero (no FTZ/DAZ anywhere):
//  * v = integers times the smallest denormal of the dtype: outputs are denormal too, and a
//    flushed v would give 0 instead, far outside the denormal floor of the tolerance;
//  * q = integers times 2^-149 (fp32 denormals) against k near 2^125: the scores are ordinary
//    numbers, and a flushed q would give uniform weights instead.
TEST_P(NumericalPolicy, DenormalInputsAreNotFlushed) {
  for (DType dtype : kAllDtypes) {
    std::mt19937_64 rng(test_seed() ^ 23);
    std::uniform_int_distribution<int> integer(-100, 100);
    const double denormal = 2.0 * half_smallest_denormal(dtype);
    Problem p = random_problem(dtype, {1, 40, 2, 16}, {1, 40, 2, 16}, 23);
    p.v.for_each_index([&](auto a, auto b, auto c, auto d) {
      p.v.set(a, b, c, d, static_cast<float>(integer(rng) * denormal));
    });
    p.options.causal = true;
    const ReferenceResult ref = reference(p.q, p.k, p.v, p.options);
    double largest = 0.0;
    for (double x : ref.out) largest = std::max(largest, std::abs(x));
    ASSERT_GT(largest, 20 * denormal) << "the outputs are not denormal multiples";
    expect_reference_result(GetParam(), p.q, p.k, p.v, p.options, false, "denormal v");
  }
  std::mt19937_64 rng(test_seed() ^ 29);
  std::uniform_int_distribution<int> mantissa(-(1 << 22), 1 << 22);
  Problem p = random_problem(DType::f32, {1, 40, 2, 16}, {1, 40, 2, 16}, 29);
  p.q.for_each_index([&](auto a, auto b, auto c, auto d) {
    p.q.set(a, b, c, d, std::ldexp(static_cast<float>(mantissa(rng)), -149));
  });
  p.k.for_each_index([&](auto a, auto b, auto c, auto d) {
    p.k.set(a, b, c, d, std::ldexp(p.k.at(a, b, c, d), 125));
  });
  const ReferenceResult ref = reference(p.q, p.k, p.v, p.options);
  double spread = 0.0;
  for (double x : ref.lse) spread = std::max(spread, std::abs(x - std::log(40.0)));
  ASSERT_GT(spread, 0.01) << "the denormal queries did not produce distinct scores";
  expect_reference_result(GetParam(), p.q, p.k, p.v, p.options, false, "denormal q");
}

// Degenerate shapes: head_dim 1, one query and/or one key, one query against many keys, and
// many queries against one key under the causal mask (all but the last row fully masked).
TEST_P(NumericalPolicy, SmallestShapesMatchTheReference) {
  struct Shape {
    std::int64_t batch, seqlen_q, seqlen_kv, heads, head_dim;
    bool causal;
  };
  const Shape shapes[] = {{2, 33, 33, 3, 1, false}, {2, 33, 20, 3, 1, true},
                          {3, 1, 1, 2, 16, false},  {3, 1, 1, 2, 16, true},
                          {2, 1, 70, 2, 16, true},  {2, 70, 1, 2, 16, true},
                          {1, 1, 1, 1, 1, false}};
  for (DType dtype : kAllDtypes) {
    for (const Shape& s : shapes) {
      Problem p = random_problem(dtype, {s.batch, s.seqlen_q, s.heads, s.head_dim},
                                 {s.batch, s.seqlen_kv, s.heads, s.head_dim}, 31);
      p.options.causal = s.causal;
      std::ostringstream context;
      context << "B" << s.batch << " Sq" << s.seqlen_q << " Skv" << s.seqlen_kv << " H" << s.heads
              << " D" << s.head_dim << (s.causal ? " causal" : "");
      expect_reference_result(GetParam(), p.q, p.k, p.v, p.options, false, context.str());
    }
  }
}

// Multi-query attention at its extreme: 64 query heads read one KV head.
TEST_P(NumericalPolicy, SixtyFourQueryHeadsOnOneKvHead) {
  Problem p = random_problem(DType::f32, {2, 37, 64, 16}, {2, 45, 1, 16}, 37);
  p.options.causal = true;
  expect_reference_result(GetParam(), p.q, p.k, p.v, p.options, false, "Hq 64 Hkv 1");
  Problem half = random_problem(DType::bf16, {1, 20, 64, 8}, {1, 20, 1, 8}, 41);
  expect_reference_result(GetParam(), half.q, half.k, half.v, half.options, false,
                          "Hq 64 Hkv 1 bf16");
}

// An empty batch (or no queries) is a valid call that does nothing: no error, nothing written,
// null data pointers accepted for the empty tensors.
TEST_P(NumericalPolicy, EmptyBatchIsANoOp) {
  for (DType dtype : kAllDtypes) {
    Tensor q(dtype, {0, 5, 4, 8}), k(dtype, {0, 7, 2, 8}), v(dtype, {0, 7, 2, 8});
    Tensor out(dtype, {0, 5, 4, 8});
    float lse_guard = kSentinel;
    EXPECT_NO_THROW(attention_forward(GetParam(), q.view, k.view, v.view, out.view, &lse_guard));
    EXPECT_EQ(lse_guard, kSentinel) << "lse written for an empty batch";
    q.view.data = k.view.data = v.view.data = out.view.data = nullptr;
    EXPECT_NO_THROW(attention_forward(GetParam(), q.view, k.view, v.view, out.view, nullptr));

    // No queries in a non-empty batch: the same.
    Tensor q2(dtype, {2, 0, 4, 8}), out2(dtype, {2, 0, 4, 8});
    Tensor k2(dtype, {2, 7, 2, 8}), v2(dtype, {2, 7, 2, 8});
    EXPECT_NO_THROW(
        attention_forward(GetParam(), q2.view, k2.view, v2.view, out2.view, &lse_guard));
    EXPECT_EQ(lse_guard, kSentinel) << "lse written without queries";
  }
  MultiHeadAttention layer({64, 4, 2, true});
  layer.init_random(1);
  EXPECT_NO_THROW(layer.forward(nullptr, 0, 16, nullptr, {}, GetParam()));
}

INSTANTIATE_TEST_SUITE_P(AllPaths, NumericalPolicy, ::testing::ValuesIn(kAllImpls), impl_test_name);

}  // namespace
}  // namespace flashattn::testing
