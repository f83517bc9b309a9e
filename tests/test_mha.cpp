// MultiHeadAttention against the seed's equations (seed 000), written out below as plain loops:
// projections, split heads, per-head scores q_i·k_j·scale, bottom-right causal mask, softmax
// with max subtraction, P·V, merge heads, output projection.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <random>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "flashattn/mha.hpp"
#include "mha_test_support.hpp"

namespace flashattn {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

struct LayerShape {
  const char* name;
  std::int64_t batch, seqlen_q, seqlen_kv;
  bool cross;  // keys and values from a separate context of seqlen_kv tokens
  std::int64_t hidden, heads, kv_heads;  // kv_heads 0 = heads
  std::int64_t value_head_dim = 0;       // 0 = head_dim
};

std::ostream& operator<<(std::ostream& os, const LayerShape& s) {
  return os << s.name << " {B=" << s.batch << " Sq=" << s.seqlen_q << " Skv=" << s.seqlen_kv
            << (s.cross ? " cross" : " self") << " H=" << s.hidden << " Nh=" << s.heads
            << " Nkv=" << s.kv_heads << " Dv=" << s.value_head_dim << '}';
}

using testing::fill_uniform;
using testing::naive_of;
using testing::random_uniform;

// Compares the layer's output y with the seed's loops run in fp64 on the same weights and inputs.
//
// Tolerance. The layer computes in fp32: the four projections are dot products of length H
// (error ~ H·eps·Σ|x||w| in the worst case, ~ sqrt(H)·eps typically), the scores dot products of
// length Dh, the softmax sums of length Skv. The fp32 run of the same loops does these operations
// in the same precision, only in another order, so its error against the fp64 run measures what
// fp32 costs for this very input. The layer may sum in a different order (sgemm blocking and
// FMA, FlashAttention's online rescaling, a vectorized exp), so it gets 4x that error, plus a
// floor of a few ulps of the largest output for inputs where the fp32 loops happen to be exact.
// (Measured: the largest error is below 0.2x this tolerance over the whole grid.)
void expect_matches_seed(const std::vector<float>& y, MultiHeadAttention& layer,
                         const std::vector<float>& x, const std::vector<float>& context,
                         std::int64_t batch, std::int64_t seqlen_q, std::int64_t seqlen_kv,
                         bool causal, double scale) {
  const std::vector<double> expected =
      naive_of<double>(layer).forward(x, context, batch, seqlen_q, seqlen_kv, causal, scale);
  const std::vector<float> in_fp32 = naive_of<float>(layer).forward(
      x, context, batch, seqlen_q, seqlen_kv, causal, static_cast<float>(scale));
  ASSERT_EQ(y.size(), expected.size());

  double fp32_error = 0, max_abs = 0;
  for (std::size_t e = 0; e < expected.size(); ++e) {
    fp32_error = std::max(fp32_error, std::abs(in_fp32[e] - expected[e]));
    max_abs = std::max(max_abs, std::abs(expected[e]));
  }
  const double eps = std::numeric_limits<float>::epsilon();
  const double tolerance = 4 * fp32_error + 8 * eps * max_abs;

  const std::int64_t hidden = layer.config().hidden;
  std::int64_t failures = 0;
  for (std::size_t e = 0; e < y.size(); ++e) {
    const double error = std::abs(y[e] - expected[e]);
    if (error <= tolerance) continue;  // written so that NaN fails
    if (failures++ == 0) {
      const std::int64_t row = static_cast<std::int64_t>(e) / hidden;
      ADD_FAILURE() << "first mismatch at batch " << row / seqlen_q << ", token " << row % seqlen_q
                    << ", column " << static_cast<std::int64_t>(e) % hidden << ": got " << y[e]
                    << ", expected " << expected[e] << " (error " << error << ", tolerance "
                    << tolerance << " = 4 x fp32 loop error " << fp32_error << " + floor)";
    }
  }
  EXPECT_EQ(failures, 0) << "of " << y.size() << " outputs";
}

using LayerParam = std::tuple<LayerShape, AttentionImpl, bool /*bias*/, bool /*causal*/>;

class MultiHeadAttentionVsSeed : public ::testing::TestWithParam<LayerParam> {};

TEST_P(MultiHeadAttentionVsSeed, MatchesPerHeadLoops) {
  const auto& [shape, impl, bias, causal] = GetParam();
  SCOPED_TRACE(::testing::Message()
               << shape << " impl=" << impl_name(impl) << " bias=" << bias << " causal=" << causal);

  MultiHeadAttention layer({shape.hidden, shape.heads, shape.kv_heads, bias, shape.value_head_dim});
  layer.init_random(1234);
  // init_random zeroes biases; make them matter. (b_K shifts row i of the scores by the constant
  // q_i·b_K, which the softmax cancels: only b_Q, b_V and b_O can show in y.)
  if (bias) {
    fill_uniform(layer.b_q(), 0.5f, 11);
    fill_uniform(layer.b_k(), 0.5f, 12);
    fill_uniform(layer.b_v(), 0.5f, 13);
    fill_uniform(layer.b_o(), 0.5f, 14);
  }

  const auto q_count = static_cast<std::size_t>(shape.batch * shape.seqlen_q * shape.hidden);
  const auto kv_count = static_cast<std::size_t>(shape.batch * shape.seqlen_kv * shape.hidden);
  const std::vector<float> x = random_uniform(q_count, 1.0f, 21);
  const std::vector<float> context = shape.cross ? random_uniform(kv_count, 1.0f, 22) : x;

  AttentionOptions options;
  options.causal = causal;
  std::vector<float> y(q_count, kNaN);
  if (shape.cross) {
    layer.forward(x.data(), shape.batch, shape.seqlen_q, context.data(), shape.seqlen_kv, y.data(),
                  options, impl);
  } else {
    layer.forward(x.data(), shape.batch, shape.seqlen_q, y.data(), options, impl);
  }
  expect_matches_seed(y, layer, x, context, shape.batch, shape.seqlen_q, shape.seqlen_kv, causal,
                      1.0 / std::sqrt(static_cast<double>(layer.head_dim())));
}

const LayerShape kShapes[] = {
    {"mha", 2, 16, 16, false, 32, 4, 0},
    {"gqa", 2, 16, 16, false, 32, 4, 2},
    {"mqa", 2, 16, 16, false, 32, 4, 1},
    {"odd", 3, 7, 7, false, 24, 3, 0},        // head_dim 8
    {"tiles", 1, 131, 131, false, 64, 2, 1},  // head_dim 32; crosses block edges
    {"one_token", 1, 1, 1, false, 8, 2, 0},
    {"cross_sq_lt_skv", 2, 5, 11, true, 32, 4, 2},
    // Causal with Sq > Skv: rows 0..9 see no key at all (bottom-right alignment) and must be b_O.
    {"cross_sq_gt_skv", 2, 13, 3, true, 24, 3, 1},
    // V and the attention output of a head dim of their own (head_dim 12 and 16).
    {"value_dims", 2, 16, 16, false, 48, 4, 2, 20},
    {"value_dims_cross", 1, 9, 23, true, 64, 4, 1, 8},
};

std::string layer_param_name(const ::testing::TestParamInfo<LayerParam>& info) {
  const auto& [shape, impl, bias, causal] = info.param;
  return std::string(shape.name) + "_" + impl_name(impl) + (bias ? "_bias" : "_nobias") +
         (causal ? "_causal" : "_full");
}

INSTANTIATE_TEST_SUITE_P(Grid, MultiHeadAttentionVsSeed,
                         ::testing::Combine(::testing::ValuesIn(kShapes),
                                            ::testing::Values(AttentionImpl::flash,
                                                              AttentionImpl::standard,
                                                              AttentionImpl::reference),
                                            ::testing::Bool(), ::testing::Bool()),
                         layer_param_name);

TEST(MultiHeadAttention, CustomSoftmaxScaleReachesAttention) {
  MultiHeadAttention layer({16, 2, 0, false});
  layer.init_random(5);
  const std::vector<float> x = random_uniform(2 * 6 * 16, 1.0f, 6);
  AttentionOptions options;
  options.softmax_scale = 2.5f;  // sharp enough that a dropped scale shows
  std::vector<float> y(x.size(), kNaN);
  layer.forward(x.data(), 2, 6, y.data(), options);

  expect_matches_seed(y, layer, x, x, 2, 6, 6, false, 2.5);
}

TEST(MultiHeadAttention, WeightShapesFollowConfig) {
  MultiHeadAttention gqa({48, 6, 2, true});
  EXPECT_EQ(gqa.head_dim(), 8);
  EXPECT_EQ(gqa.num_kv_heads(), 2);
  EXPECT_EQ(gqa.kv_width(), 16);
  EXPECT_EQ(gqa.w_q().size(), 48u * 48u);
  EXPECT_EQ(gqa.w_k().size(), 48u * 16u);
  EXPECT_EQ(gqa.w_v().size(), 48u * 16u);
  EXPECT_EQ(gqa.w_o().size(), 48u * 48u);
  EXPECT_EQ(gqa.b_q().size(), 48u);
  EXPECT_EQ(gqa.b_k().size(), 16u);
  EXPECT_EQ(gqa.b_v().size(), 16u);
  EXPECT_EQ(gqa.b_o().size(), 48u);

  MultiHeadAttention values({48, 6, 2, true, 20});
  EXPECT_EQ(values.value_head_dim(), 20);
  EXPECT_EQ(values.w_k().size(), 48u * 16u);
  EXPECT_EQ(values.w_v().size(), 48u * 40u);
  EXPECT_EQ(values.w_o().size(), 120u * 48u);
  EXPECT_EQ(values.b_v().size(), 40u);
  EXPECT_EQ(values.b_o().size(), 48u);

  MultiHeadAttention plain({48, 6, 0, false});
  EXPECT_EQ(plain.num_kv_heads(), 6);
  EXPECT_EQ(plain.w_k().size(), 48u * 48u);
  EXPECT_TRUE(plain.b_q().empty() && plain.b_k().empty() && plain.b_v().empty() &&
              plain.b_o().empty());
}

TEST(MultiHeadAttention, InitRandomIsDeterministicAndBounded) {
  MultiHeadAttention a({32, 4, 2, true}), b({32, 4, 2, true}), c({32, 4, 2, true});
  fill_uniform(a.b_q(), 1.0f, 1);  // init_random must reset biases to zero
  a.init_random(42);
  b.init_random(42);
  c.init_random(43);
  const float bound = 1.0f / std::sqrt(32.0f);
  for (auto weight : {&MultiHeadAttention::w_q, &MultiHeadAttention::w_k, &MultiHeadAttention::w_v,
                      &MultiHeadAttention::w_o}) {
    const std::span<float> wa = (a.*weight)(), wb = (b.*weight)(), wc = (c.*weight)();
    EXPECT_TRUE(std::equal(wa.begin(), wa.end(), wb.begin(), wb.end()));
    EXPECT_FALSE(std::equal(wa.begin(), wa.end(), wc.begin(), wc.end()));
    float lowest = 0, highest = 0;
    for (float w : wa) {
      lowest = std::min(lowest, w);
      highest = std::max(highest, w);
    }
    EXPECT_GE(lowest, -bound);
    EXPECT_LE(highest, bound);
    // Uniform over the whole range, not a fraction of it.
    EXPECT_LT(lowest, -0.9f * bound);
    EXPECT_GT(highest, 0.9f * bound);
  }
  for (auto bias : {&MultiHeadAttention::b_q, &MultiHeadAttention::b_k, &MultiHeadAttention::b_v,
                    &MultiHeadAttention::b_o}) {
    for (float value : (a.*bias)()) ASSERT_EQ(value, 0.0f);
  }
}

// Without keys the attention output is 0 (docs/design.md, "The contract"), so y is exactly b_O
// on every row.
TEST(MultiHeadAttention, NoKeysGivesOutputBias) {
  for (AttentionImpl impl :
       {AttentionImpl::flash, AttentionImpl::standard, AttentionImpl::reference}) {
    SCOPED_TRACE(impl_name(impl));
    MultiHeadAttention layer({16, 4, 0, true});
    layer.init_random(3);
    fill_uniform(layer.b_o(), 1.0f, 4);
    const std::vector<float> x = random_uniform(2 * 3 * 16, 1.0f, 5);
    std::vector<float> y(x.size(), kNaN);
    layer.forward(x.data(), 2, 3, nullptr, 0, y.data(), {}, impl);
    for (std::size_t e = 0; e < y.size(); ++e) ASSERT_EQ(y[e], layer.b_o()[e % 16]) << "at " << e;
  }
}

TEST(MultiHeadAttention, EmptyBatchIsANoOp) {
  MultiHeadAttention layer({16, 4, 0, false});
  EXPECT_NO_THROW(layer.forward(nullptr, 0, 5, nullptr));
  EXPECT_NO_THROW(layer.forward(nullptr, 3, 0, nullptr));
  EXPECT_NO_THROW(layer.forward(nullptr, 0, 5, nullptr, 4, nullptr));
}

// Runs `call`, expects a flashattn::Error whose message contains every one of `parts`.
template <class Call>
void expect_error(Call call, std::initializer_list<const char*> parts) {
  try {
    call();
    ADD_FAILURE() << "no flashattn::Error raised; expected one mentioning " << *parts.begin();
  } catch (const Error& error) {
    const std::string message = error.what();
    for (const char* part : parts) {
      EXPECT_NE(message.find(part), std::string::npos)
          << "message \"" << message << "\" lacks \"" << part << '"';
    }
  }
}

TEST(MultiHeadAttention, BadConfigRaisesNamedError) {
  const auto make = [](MultiHeadAttentionConfig config) {
    return [config] { MultiHeadAttention layer(config); };
  };
  expect_error(make({0, 4, 0, false}), {"MultiHeadAttention: hidden: expected > 0, got 0"});
  expect_error(make({-32, 4, 0, false}), {"hidden: ", "got -32"});
  expect_error(make({32, 0, 0, false}), {"num_heads: expected > 0, got 0"});
  expect_error(make({32, -2, 0, false}), {"num_heads: ", "got -2"});
  expect_error(make({30, 4, 0, false}), {"num_heads: ", "divisor of hidden = 30", "got 4"});
  expect_error(make({32, 4, 3, false}), {"num_kv_heads: ", "divisor of num_heads = 4", "got 3"});
  expect_error(make({32, 4, 8, false}), {"num_kv_heads: ", "divisor of num_heads = 4", "got 8"});
  expect_error(make({32, 4, -1, false}), {"num_kv_heads: ", ">= 0", "got -1"});
  expect_error(make({32, 4, 0, false, -8}),
               {"value_head_dim: expected >= 0 (0 = head_dim), got -8"});
  expect_error(make({32, 4, 0, false, std::int64_t{1} << 40}),
               {"value_head_dim: expected num_heads x value_head_dim <= 2147483647"});
}

TEST(MultiHeadAttention, BadForwardArgumentsRaiseNamedError) {
  MultiHeadAttention layer({16, 4, 2, false});
  layer.init_random(7);
  std::vector<float> x(2 * 5 * 16, 0.5f), context(2 * 3 * 16, 0.5f), y(x.size());
  float* const xs = x.data();
  float* const ys = y.data();
  float* const cs = context.data();

  expect_error([&] { layer.forward(nullptr, 2, 5, ys); },
               {"MultiHeadAttention::forward: x: expected a data pointer, got null"});
  expect_error([&] { layer.forward(xs, 2, 5, nullptr); }, {"y: expected a data pointer"});
  expect_error([&] { layer.forward(xs, 2, 5, nullptr, 3, ys); },
               {"context: expected a data pointer"});
  expect_error([&] { layer.forward(xs, -1, 5, ys); }, {"batch: expected >= 0, got -1"});
  expect_error([&] { layer.forward(xs, 2, -5, ys); }, {"seqlen: expected >= 0, got -5"});
  expect_error([&] { layer.forward(xs, 2, -5, cs, 3, ys); }, {"seqlen_q: expected >= 0, got -5"});
  expect_error([&] { layer.forward(xs, 2, 5, cs, -3, ys); }, {"seqlen_kv: expected >= 0, got -3"});
  expect_error([&] { layer.forward(xs, 2, 5, xs); }, {"y: expected memory disjoint from x"});
  expect_error([&] { layer.forward(xs + 8, 1, 5, xs); }, {"y: expected memory disjoint from x"});
  expect_error([&] { layer.forward(xs, 1, 2, cs, 3, cs + 16); },
               {"y: expected memory disjoint from context"});
  expect_error([&] { layer.forward(xs, INT32_MAX, 2, ys); },
               {"x: expected batch * seqlen <= 2147483647", "got 2147483647 * 2"});
}

// An option that attention_forward rejects surfaces as its Error, and y keeps its contents.
TEST(MultiHeadAttention, BadOptionsRaiseBeforeWritingOutput) {
  MultiHeadAttention layer({16, 4, 0, false});
  layer.init_random(8);
  const std::vector<float> x = random_uniform(2 * 5 * 16, 1.0f, 9);
  std::vector<float> y(x.size(), 7.0f);
  AttentionOptions options;
  options.softmax_scale = -1.0f;
  for (AttentionImpl impl :
       {AttentionImpl::flash, AttentionImpl::standard, AttentionImpl::reference}) {
    expect_error([&] { layer.forward(x.data(), 2, 5, y.data(), options, impl); },
                 {"softmax_scale"});
  }
  EXPECT_TRUE(std::all_of(y.begin(), y.end(), [](float value) { return value == 7.0f; }));
}

}  // namespace
}  // namespace flashattn
