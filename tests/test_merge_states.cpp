// merge_attention_states (flashattn/merge.hpp): two partial states over disjoint key sets, merged,
// against the fp64 reference over the union; its edge rules; its bad inputs.

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "flashattn/merge.hpp"
#include "test_support.hpp"

namespace flashattn::testing {
namespace {

constexpr double kU32 = 0x1p-24;  // unit roundoff of fp32
constexpr float kInf = std::numeric_limits<float>::infinity();

struct SplitCase {
  std::int64_t batch, seqlen_q, seqlen_kv, heads, head_dim, split;
  bool causal;
  DType out_dtype;
};

std::string case_name(const SplitCase& c) {
  std::ostringstream name;
  name << "B" << c.batch << "_Sq" << c.seqlen_q << "_Skv" << c.seqlen_kv << "_H" << c.heads << "_D"
       << c.head_dim << "_split" << c.split << (c.causal ? "_causal_" : "_")
       << dtype_name(c.out_dtype);
  return name.str();
}

// A partial state as a forward call would hand it over: out and lse rounded to fp32.
struct State {
  Tensor out;
  std::vector<float> lse;
};

State rounded_state(const ReferenceResult& exact, std::array<std::int64_t, 4> shape) {
  State state{Tensor(DType::f32, shape), std::vector<float>(exact.lse.size())};
  std::int64_t flat = 0;
  state.out.for_each_index([&](auto a, auto b, auto c, auto d) {
    state.out.set(a, b, c, d, static_cast<float>(exact.out[flat++]));
  });
  for (std::size_t i = 0; i < exact.lse.size(); ++i) {
    state.lse[i] = static_cast<float>(exact.lse[i]);
  }
  return state;
}

class MergeSplitKeys : public ::testing::TestWithParam<SplitCase> {};

// The keys of a causal call split at `split`: the suffix [split, Skv) under the same causal
// rule (bottom-right alignment survives dropping a prefix), the prefix [0, split) under a window
// whose right edge is the full call's diagonal, Skv − split keys past the prefix's own. Rows that
// see nothing on a side get lse −inf there (Sq > Skv − split, or Sq > Skv), so the −inf rule is
// exercised too.
TEST_P(MergeSplitKeys, MatchesTheReferenceOverTheUnion) {
  const SplitCase c = GetParam();
  std::mt19937_64 rng(test_seed());
  SCOPED_TRACE(case_name(c) + ", seed " + std::to_string(test_seed()));
  Tensor q(DType::f32, {c.batch, c.seqlen_q, c.heads, c.head_dim});
  Tensor k(DType::f32, {c.batch, c.seqlen_kv, c.heads, c.head_dim});
  Tensor v(DType::f32, {c.batch, c.seqlen_kv, c.heads, c.head_dim});
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);

  AttentionOptions whole_options, prefix_options, suffix_options;
  whole_options.causal = suffix_options.causal = c.causal;
  if (c.causal) prefix_options.window_right = c.seqlen_kv - c.split;
  const ReferenceResult whole = reference(q, k, v, whole_options);
  const auto part = [&](std::int64_t begin, std::int64_t end, const AttentionOptions& options) {
    Tensor k_part(DType::f32, {c.batch, end - begin, c.heads, c.head_dim});
    Tensor v_part(DType::f32, {c.batch, end - begin, c.heads, c.head_dim});
    k_part.for_each_index([&](auto a, auto s, auto h, auto d) {
      k_part.set(a, s, h, d, k.at(a, begin + s, h, d));
      v_part.set(a, s, h, d, v.at(a, begin + s, h, d));
    });
    return rounded_state(reference(q, k_part, v_part, options), q.view.shape);
  };
  const State prefix = part(0, c.split, prefix_options);
  const State suffix = part(c.split, c.seqlen_kv, suffix_options);

  Tensor out(c.out_dtype, q.view.shape);
  out.poison();
  std::vector<float> lse(prefix.lse.size(), NAN);
  merge_attention_states(prefix.out.view, prefix.lse.data(), suffix.out.view, suffix.lse.data(),
                         out.view, lse.data());

  // Bound. The inputs are the exact states rounded once (u·max|v| on out, u·|lse| on lse). The
  // weights exp(lse_i − m) / Σ carry the lse roundings, the subtraction's and exp's: a relative
  // error of at most 4u·(L + 2), L = max finite |lse|, on each of the two weights that sum to 1,
  // so 8u·(L + 2)·max|v| on out, plus the inputs' u·max|v|, two roundings of the sum of products
  // (2u·max|v|) and the output's rounding to its dtype (u_out·max|v|). lse = m + log(s) has the
  // input's u·L, log's and the sum's roundings: 4u·(L + 2) with margin.
  const double max_v = max_abs(v), L = max_abs_finite(whole.lse);
  const double out_tolerance =
      max_v * (8.0 * kU32 * (L + 2.0) + 3.0 * kU32 + unit_roundoff(c.out_dtype)) + 1e-30;
  const double lse_tolerance = 4.0 * kU32 * (L + 2.0);
  const MaxError out_error = max_error(out, whole.out);
  EXPECT_LE(out_error.value, out_tolerance) << "out index " << out_error.index << ": got "
                                            << out_error.got << ", want " << out_error.want;
  for (std::size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(whole.lse[i])) {
      EXPECT_EQ(lse[i], static_cast<float>(whole.lse[i])) << "lse index " << i;
    } else {
      EXPECT_NEAR(lse[i], whole.lse[i], lse_tolerance) << "lse index " << i;
    }
  }
}

std::vector<SplitCase> split_cases() {
  std::vector<SplitCase> cases;
  for (const DType dtype : {DType::f32, DType::f16, DType::bf16}) {
    cases.push_back({2, 7, 203, 3, 64, 113, false, dtype});
    cases.push_back({1, 129, 129, 2, 40, 64, true, dtype});
  }
  cases.push_back({1, 1, 239, 4, 128, 1, false, DType::f32});    // one query, a one-key side
  cases.push_back({1, 1, 239, 4, 128, 238, true, DType::f32});   // decode: the cache, then one
  cases.push_back({2, 113, 203, 2, 59, 90, true, DType::f32});   // Sq < Skv, causal
  cases.push_back({1, 20, 30, 2, 32, 25, true, DType::f32});     // suffix empty for early rows
  cases.push_back({1, 40, 30, 2, 32, 10, true, DType::f32});     // Sq > Skv: rows see nothing
  cases.push_back({3, 64, 256, 1, 1, 128, false, DType::bf16});  // head_dim 1
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, MergeSplitKeys, ::testing::ValuesIn(split_cases()),
                         [](const auto& info) { return case_name(info.param); });

// A small state filled with random values and lse, for the rules below.
struct Pair {
  Tensor out_a{DType::f32, {2, 5, 3, 8}}, out_b{DType::f32, {2, 5, 3, 8}};
  std::vector<float> lse_a = std::vector<float>(2 * 3 * 5), lse_b = lse_a;

  explicit Pair(std::uint64_t seed = 7) {
    std::mt19937_64 rng(seed);
    out_a.fill_normal(rng);
    out_b.fill_normal(rng);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    for (float& x : lse_a) x = normal(rng);
    for (float& x : lse_b) x = normal(rng);
  }
};

std::vector<std::uint8_t> bytes_of(const Tensor& t) { return t.bytes; }

TEST(MergeStates, InPlaceGivesTheSameBitsAsASeparateOutput) {
  Pair p;
  Tensor out(DType::f32, p.out_a.view.shape);
  std::vector<float> lse(p.lse_a.size());
  merge_attention_states(p.out_a.view, p.lse_a.data(), p.out_b.view, p.lse_b.data(), out.view,
                         lse.data());
  merge_attention_states(p.out_a.view, p.lse_a.data(), p.out_b.view, p.lse_b.data(), p.out_a.view,
                         p.lse_a.data());
  EXPECT_EQ(bytes_of(p.out_a), bytes_of(out));
  EXPECT_EQ(0, std::memcmp(p.lse_a.data(), lse.data(), lse.size() * sizeof(float)));
}

TEST(MergeStates, ResultDoesNotDependOnTheThreadCount) {
  Pair p(11);
  Tensor first(DType::bf16, p.out_a.view.shape), other(DType::bf16, p.out_a.view.shape);
  merge_attention_states(p.out_a.view, p.lse_a.data(), p.out_b.view, p.lse_b.data(), first.view,
                         nullptr, 1);
  for (const int threads : {2, 3, 7}) {
    other.poison();
    merge_attention_states(p.out_a.view, p.lse_a.data(), p.out_b.view, p.lse_b.data(), other.view,
                           nullptr, threads);
    EXPECT_EQ(bytes_of(first), bytes_of(other)) << threads << " threads";
  }
}

// Rows: 0 both sides saw keys; 1 side a saw none (lse −inf, out 0); 2 neither did; 3 a NaN lse;
// 4 side b saw keys whose scores were all −inf (the forward's out NaN, lse −inf).
TEST(MergeStates, EdgeRowsFollowTheRules) {
  const std::array<std::int64_t, 4> shape = {1, 5, 1, 4};
  Tensor out_a(DType::f32, shape), out_b(DType::f32, shape), out(DType::f32, shape);
  std::mt19937_64 rng(3);
  out_a.fill_normal(rng);
  out_b.fill_normal(rng);
  std::vector<float> lse_a = {0.5f, -kInf, -kInf, NAN, 1.0f};
  std::vector<float> lse_b = {-1.5f, 2.0f, -kInf, 0.0f, -kInf};
  for (std::int64_t d = 0; d < 4; ++d) {
    out_a.set(0, 1, 0, d, 0.0f);
    out_a.set(0, 2, 0, d, 0.0f);
    out_b.set(0, 2, 0, d, 0.0f);
    out_b.set(0, 4, 0, d, NAN);
  }
  std::vector<float> lse(5, 123.0f);
  out.poison();
  merge_attention_states(out_a.view, lse_a.data(), out_b.view, lse_b.data(), out.view, lse.data());
  const double weight_a = 1.0 / (1.0 + std::exp(-1.5 - 0.5));
  EXPECT_NEAR(lse[0], 0.5 + std::log(1.0 + std::exp(-2.0)), 1e-6);
  EXPECT_EQ(lse[1], 2.0f);
  EXPECT_EQ(lse[2], -kInf);
  EXPECT_TRUE(std::isnan(lse[3]));
  EXPECT_EQ(lse[4], 1.0f) << "b's keys add exp(-inf) = 0 to the sum";
  for (std::int64_t d = 0; d < 4; ++d) {
    EXPECT_NEAR(out.at(0, 0, 0, d),
                weight_a * out_a.at(0, 0, 0, d) + (1.0 - weight_a) * out_b.at(0, 0, 0, d), 1e-6);
    EXPECT_EQ(out.at(0, 1, 0, d), out_b.at(0, 1, 0, d)) << "a side with no keys adds nothing";
    EXPECT_EQ(out.at(0, 2, 0, d), 0.0f) << "no keys on either side: 0";
    EXPECT_TRUE(std::isnan(out.at(0, 3, 0, d)));
    EXPECT_TRUE(std::isnan(out.at(0, 4, 0, d)));
  }
}

// One call's arguments over owned storage, for a bad-input case to corrupt.
struct Call {
  Pair inputs;
  Tensor out_storage{DType::f32, {2, 5, 3, 8}};
  std::vector<float> lse_storage = std::vector<float>(2 * 3 * 5, NAN);
  ConstTensorView out_a = inputs.out_a.view, out_b = inputs.out_b.view;
  const float* lse_a = inputs.lse_a.data();
  const float* lse_b = inputs.lse_b.data();
  TensorView out = out_storage.view;
  float* lse = lse_storage.data();
  int threads = 0;

  Call() { out_storage.poison(); }
};

struct BadMerge {
  std::string name;
  std::function<void(Call&)> corrupt;
  std::string message;  // the start of the error, after "merge_attention_states: "
};

class MergeBadInput : public ::testing::TestWithParam<BadMerge> {};

TEST_P(MergeBadInput, RaisesANamedErrorAndWritesNothing) {
  const BadMerge& bad = GetParam();
  Call call;
  bad.corrupt(call);
  const Call before = call;
  try {
    merge_attention_states(call.out_a, call.lse_a, call.out_b, call.lse_b, call.out, call.lse,
                           call.threads);
    FAIL() << "no error raised";
  } catch (const Error& error) {
    const std::string what = error.what();
    EXPECT_EQ(what.rfind("merge_attention_states: " + bad.message, 0), 0u) << what;
  }
  EXPECT_EQ(call.out_storage.bytes, before.out_storage.bytes) << "out written despite the error";
  EXPECT_EQ(call.inputs.out_a.bytes, before.inputs.out_a.bytes);
  EXPECT_EQ(call.inputs.out_b.bytes, before.inputs.out_b.bytes);
  EXPECT_EQ(0, std::memcmp(call.lse_storage.data(), before.lse_storage.data(),
                           call.lse_storage.size() * sizeof(float)))
      << "lse written despite the error";
  EXPECT_EQ(0, std::memcmp(call.inputs.lse_a.data(), before.inputs.lse_a.data(),
                           call.inputs.lse_a.size() * sizeof(float)));
}

std::vector<BadMerge> bad_merges() {
  return {
      {"OutAIsNotFp32", [](Call& c) { c.out_a.dtype = DType::f16; }, "out_a: expected dtype f32"},
      {"OutBShapeDiffers", [](Call& c) { c.out_b.shape[3] = 7; },
       "out_b: expected shape [2, 5, 3, 8] (as out_a), got [2, 5, 3, 7]"},
      {"OutShapeDiffers", [](Call& c) { c.out.shape[1] = 4; },
       "out: expected shape [2, 5, 3, 8] (as out_a), got [2, 4, 3, 8]"},
      {"LseANull", [](Call& c) { c.lse_a = nullptr; },
       "lse_a: expected the logsumexp [2, 3, 5], got null"},
      {"LseBNull", [](Call& c) { c.lse_b = nullptr; },
       "lse_b: expected the logsumexp [2, 3, 5], got null"},
      {"OutDataNull", [](Call& c) { c.out.data = nullptr; }, "out: expected a data pointer"},
      {"OutLastDimStrided", [](Call& c) { c.out_b.strides[3] = 2; },
       "out_b: expected a contiguous last dim"},
      {"HeadDimZero", [](Call& c) { c.out_a.shape[3] = c.out_b.shape[3] = c.out.shape[3] = 0; },
       "out_a: expected head_dim >= 1, got 0"},
      {"NegativeThreads", [](Call& c) { c.threads = -1; }, "num_threads: expected 0..1024"},
      {"TooManyThreads", [](Call& c) { c.threads = 1025; }, "num_threads: expected 0..1024"},
      {"OutOverlapsOutBInPart",
       [](Call& c) {
         // out_b's memory one element further on: neither out_b itself nor disjoint from it.
         c.out = {static_cast<float*>(c.inputs.out_b.view.data) + 1, DType::f32, c.out_b.shape,
                  c.out_b.strides};
         c.out.shape[3] = 7;
         c.out_a.shape[3] = c.out_b.shape[3] = 7;
       },
       "out: expected memory disjoint from out_b"},
      {"OutIsOutAInAnotherDtype",
       [](Call& c) {
         c.out = {c.inputs.out_a.view.data, DType::bf16, c.out_a.shape,
                  contiguous_strides(c.out_a.shape)};
       },
       "out: expected memory disjoint from out_a"},
      {"OutSelfOverlapping", [](Call& c) { c.out.strides[1] = 0; },
       "out: expected strides that give every element its own address"},
      {"LseInsideOutA", [](Call& c) { c.lse = static_cast<float*>(c.inputs.out_a.view.data) + 3; },
       "lse: expected memory disjoint from out_a"},
      {"LseOverlapsLseBInPart", [](Call& c) { c.lse = c.inputs.lse_b.data() + 1; },
       "lse: expected memory disjoint from lse_b"},
  };
}

INSTANTIATE_TEST_SUITE_P(Merge, MergeBadInput, ::testing::ValuesIn(bad_merges()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace flashattn::testing
