// MultiHeadAttention::backward against central finite differences of the seed's layer written
// out as plain loops in fp64 (mha_test_support.hpp): every gradient (dx, dcontext, all dW, all
// db), self- and cross-attention, GQA, causal and not, with and without biases, each attention
// impl. Also the Activations/Gradients contract: what forward keeps, poisoned outputs, empty and
// keyless inputs, bad arguments.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <limits>
#include <ostream>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "flashattn/mha.hpp"
#include "mha_test_support.hpp"

namespace flashattn {
namespace {

using testing::fill_uniform;
using testing::naive_of;
using testing::random_uniform;
using Activations = MultiHeadAttention::Activations;
using Gradients = MultiHeadAttention::Gradients;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr AttentionImpl kImpls[] = {AttentionImpl::flash, AttentionImpl::standard,
                                    AttentionImpl::reference};

struct GradShape {
  const char* name;
  std::int64_t batch, seqlen_q, seqlen_kv;
  bool cross;
  std::int64_t hidden, heads, kv_heads;  // kv_heads 0 = heads
  bool bias;
  std::int64_t value_head_dim = 0;  // 0 = head_dim
};

std::ostream& operator<<(std::ostream& os, const GradShape& s) {
  return os << s.name << " {B=" << s.batch << " Sq=" << s.seqlen_q << " Skv=" << s.seqlen_kv
            << (s.cross ? " cross" : " self") << " H=" << s.hidden << " Nh=" << s.heads
            << " Nkv=" << s.kv_heads << " Dv=" << s.value_head_dim << (s.bias ? " bias" : "")
            << '}';
}

// A layer with random weights and, when it has them, random (non-zero) biases, and its inputs.
struct Problem {
  MultiHeadAttention layer;
  std::vector<float> x, context, dy;  // context empty for self-attention

  Problem(const GradShape& s, std::uint32_t seed)
      : layer({s.hidden, s.heads, s.kv_heads, s.bias, s.value_head_dim}) {
    layer.init_random(seed);
    fill_uniform(layer.b_q(), 0.5f, seed + 1);
    fill_uniform(layer.b_k(), 0.5f, seed + 2);
    fill_uniform(layer.b_v(), 0.5f, seed + 3);
    fill_uniform(layer.b_o(), 0.5f, seed + 4);
    const auto rows_q = static_cast<std::size_t>(s.batch * s.seqlen_q);
    x = random_uniform(rows_q * s.hidden, 1.0f, seed + 5);
    if (s.cross) {
      context = random_uniform(static_cast<std::size_t>(s.batch * s.seqlen_kv * s.hidden), 1.0f,
                               seed + 6);
    }
    dy = random_uniform(rows_q * s.hidden, 1.0f, seed + 7);
  }
};

// y of the library's forward, keeping the activations.
std::vector<float> forward(const GradShape& s, const Problem& p, Activations& saved,
                           const AttentionOptions& options, AttentionImpl impl) {
  std::vector<float> y(p.x.size(), kNaN);
  if (s.cross) {
    p.layer.forward(p.x.data(), s.batch, s.seqlen_q, p.context.data(), s.seqlen_kv, y.data(), saved,
                    options, impl);
  } else {
    p.layer.forward(p.x.data(), s.batch, s.seqlen_q, y.data(), saved, options, impl);
  }
  return y;
}

// One parameter tensor of the layer: its values (perturbed in place) and the library's gradient.
struct Parameter {
  const char* name;
  std::span<float> values;
  const std::vector<float>* gradient;
};

std::vector<Parameter> parameters_of(Problem& p, const Gradients& g, bool cross) {
  std::vector<Parameter> all = {{"dx", p.x, &g.dx},
                                {"dw_q", p.layer.w_q(), &g.dw_q},
                                {"dw_k", p.layer.w_k(), &g.dw_k},
                                {"dw_v", p.layer.w_v(), &g.dw_v},
                                {"dw_o", p.layer.w_o(), &g.dw_o},
                                {"db_q", p.layer.b_q(), &g.db_q},
                                {"db_k", p.layer.b_k(), &g.db_k},
                                {"db_v", p.layer.b_v(), &g.db_v},
                                {"db_o", p.layer.b_o(), &g.db_o}};
  if (cross) all.push_back({"dcontext", p.context, &g.dcontext});
  return all;
}

// dL/dθ of L(θ) = Σ dy·y(θ) by central differences of `loss` (fp64) at steps h and 2h around
// the float θ, Richardson-extrapolated: value = (4·D(h) - D(2h)) / 3. θ ± h is rounded to float
// (where the loss is evaluated), so each difference divides by the step actually taken.
struct Derivative {
  double value;
  double error;  // bound on |value - dL/dθ|: |D(2h) - D(h)| (3x D(h)'s own h² term) + roundoff
};

Derivative central_difference(float& theta, const std::function<double()>& loss,
                              double loss_magnitude) {
  constexpr double kStep = 0x1p-10;
  const float original = theta;
  const auto difference = [&](double step) {
    theta = static_cast<float>(original + step);
    const double up_step = double{theta} - original, up = loss();
    theta = static_cast<float>(original - step);
    const double down_step = original - double{theta}, down = loss();
    theta = original;
    return (up - down) / (up_step + down_step);
  };
  const double d1 = difference(kStep), d2 = difference(2 * kStep);
  // Each loss carries at most ~n·eps64·Σ|dy·y| of rounding; n = 64 covers the loops' lengths.
  const double roundoff = 64 * std::numeric_limits<double>::epsilon() * loss_magnitude / kStep;
  return {(4 * d1 - d2) / 3, std::abs(d2 - d1) + roundoff};
}

// Tolerance. The finite differences are fp64 and carry their own error bound (above). The layer
// computes in fp32: a gradient element is the end of a chain of sums, the longest being
// dy·W_Oᵀ (H terms) -> dP = datt·vᵀ and D = rowsum(datt∘att) (Dh each) -> dq = dS·k (Skv) ->
// dx = dq·W_Qᵀ + dk·W_Kᵀ + dv·W_Vᵀ (3H), or the weight gradients' sums over B·S rows. Each sum
// of n terms is off by at most ~n·u32 of its terms' magnitude, and the terms here are no larger
// than the largest gradient (unit-sized weights and inputs, short rows), so the fp32 error is
// below n_chain·u32·max|g| with n_chain = H + 2·Dh + Skv + max(3H, B·max(Sq, Skv)), max|g| over
// all gradients of the layer (normwise: db_K is exactly 0 mathematically — the softmax cancels
// a shift of a row's scores — and only rounding shows in it). The check allows 4x that.
// (Measured: the largest error is below 0.02x this tolerance on every case and impl.)
void expect_gradients_match_finite_differences(const GradShape& shape,
                                               const AttentionOptions& options) {
  Problem p(shape, 100);
  const bool causal = options.causal;
  const double scale = options.softmax_scale.value_or(
      static_cast<float>(1.0 / std::sqrt(static_cast<double>(p.layer.head_dim()))));

  // L = Σ dy·y through the fp64 loops, over whatever the parameters hold right now.
  const auto y_fp64 = [&] {
    return naive_of<double>(p.layer).forward(p.x, shape.cross ? p.context : p.x, shape.batch,
                                             shape.seqlen_q, shape.seqlen_kv, causal, scale);
  };
  const auto loss = [&] {
    const std::vector<double> y = y_fp64();
    double sum = 0;
    for (std::size_t e = 0; e < y.size(); ++e) sum += double{p.dy[e]} * y[e];
    return sum;
  };
  double loss_magnitude = 0;  // Σ|dy·y|, the size of the terms that L sums
  const std::vector<double> y = y_fp64();
  for (std::size_t e = 0; e < y.size(); ++e) loss_magnitude += std::abs(p.dy[e] * y[e]);

  // The finite differences of every parameter, in the order of parameters_of.
  const Gradients unused;
  std::vector<std::vector<Derivative>> expected;
  double largest = 0;
  for (const Parameter& parameter : parameters_of(p, unused, shape.cross)) {
    std::vector<Derivative>& derivatives = expected.emplace_back();
    for (float& theta : parameter.values) {
      derivatives.push_back(central_difference(theta, loss, loss_magnitude));
      largest = std::max(largest, std::abs(derivatives.back().value));
    }
  }

  const std::int64_t dim = p.layer.head_dim(), rows_max = std::max(shape.seqlen_q, shape.seqlen_kv);
  const std::int64_t chain =
      shape.hidden + 2 * dim + shape.seqlen_kv + std::max(3 * shape.hidden, shape.batch * rows_max);
  const double fp32_tolerance = 4.0 * chain * 0x1p-24 * largest;

  for (const AttentionImpl impl : kImpls) {
    SCOPED_TRACE(::testing::Message()
                 << shape << (causal ? " causal " : " full ") << impl_name(impl));
    Activations saved;
    forward(shape, p, saved, options, impl);
    // Every output poisoned: an element that backward does not write stays NaN and fails.
    Gradients grads;
    grads.dx.assign(p.x.size(), kNaN);
    grads.dcontext.assign(p.context.size(), kNaN);
    for (auto [gradient, weights] :
         {std::pair{&grads.dw_q, p.layer.w_q()}, std::pair{&grads.dw_k, p.layer.w_k()},
          std::pair{&grads.dw_v, p.layer.w_v()}, std::pair{&grads.dw_o, p.layer.w_o()},
          std::pair{&grads.db_q, p.layer.b_q()}, std::pair{&grads.db_k, p.layer.b_k()},
          std::pair{&grads.db_v, p.layer.b_v()}, std::pair{&grads.db_o, p.layer.b_o()}}) {
      gradient->assign(weights.size(), kNaN);
    }
    p.layer.backward(p.dy.data(), saved, grads, impl);

    const std::vector<Parameter> parameters = parameters_of(p, grads, shape.cross);
    for (std::size_t t = 0; t < parameters.size(); ++t) {
      const Parameter& parameter = parameters[t];
      ASSERT_EQ(parameter.gradient->size(), parameter.values.size()) << parameter.name;
      std::int64_t failures = 0;
      for (std::size_t e = 0; e < parameter.values.size(); ++e) {
        const double got = (*parameter.gradient)[e];
        const Derivative& want = expected[t][e];
        const double tolerance = fp32_tolerance + want.error;
        if (std::abs(got - want.value) <= tolerance) continue;  // written so that NaN fails
        if (failures++ == 0) {
          ADD_FAILURE() << parameter.name << "[" << e << "]: got " << got << ", finite difference "
                        << want.value << " (error " << std::abs(got - want.value) << ", tolerance "
                        << tolerance << " = 4 x " << chain << " x u32 x max|g| " << largest
                        << " + difference error " << want.error << ")";
        }
      }
      EXPECT_EQ(failures, 0) << parameter.name << ": of " << parameter.values.size();
    }
  }
  // The check has teeth: every gradient but db_K (exactly 0) is far above the tolerance.
  for (std::size_t t = 0; t < expected.size(); ++t) {
    const std::string name = parameters_of(p, unused, shape.cross)[t].name;
    if (name == "db_k" || expected[t].empty()) continue;
    double tensor_largest = 0;
    for (const Derivative& d : expected[t]) {
      tensor_largest = std::max(tensor_largest, std::abs(d.value));
    }
    EXPECT_GT(tensor_largest, 100 * fp32_tolerance) << name;
  }
}

using GradParam = std::tuple<GradShape, bool /*causal*/>;

class MhaBackwardVsFiniteDifferences : public ::testing::TestWithParam<GradParam> {};

TEST_P(MhaBackwardVsFiniteDifferences, EveryGradientMatches) {
  AttentionOptions options;
  options.causal = std::get<1>(GetParam());
  expect_gradients_match_finite_differences(std::get<0>(GetParam()), options);
}

const GradShape kGradShapes[] = {
    {"mha_bias", 2, 5, 5, false, 12, 3, 0, true},
    {"mha", 2, 5, 5, false, 12, 3, 0, false},
    {"mqa_bias", 2, 5, 5, false, 12, 3, 1, true},
    {"cross_sq_lt_skv", 2, 4, 7, true, 12, 3, 1, true},
    // Causal with Sq > Skv: rows 0..2 see no key (bottom-right alignment); they carry no gradient
    // into q, k or v.
    {"cross_sq_gt_skv", 2, 6, 3, true, 12, 3, 3, true},
    // V and the attention output of a head dim of their own (head_dim 4).
    {"value_dims", 2, 5, 5, false, 12, 3, 1, true, 6},
    {"value_dims_cross", 2, 4, 6, true, 12, 3, 3, false, 2},
};

INSTANTIATE_TEST_SUITE_P(Grid, MhaBackwardVsFiniteDifferences,
                         ::testing::Combine(::testing::ValuesIn(kGradShapes), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<GradParam>& info) {
                           return std::string(std::get<0>(info.param).name) +
                                  (std::get<1>(info.param) ? "_causal" : "_full");
                         });

TEST(MhaBackward, CustomSoftmaxScaleReachesTheBackward) {
  AttentionOptions options;
  options.causal = true;
  options.softmax_scale = 1.7f;  // sharp enough that the default scale in backward would show
  expect_gradients_match_finite_differences({"scaled", 2, 5, 5, false, 12, 3, 1, true}, options);
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

bool all_zero(const std::vector<float>& values) {
  return std::all_of(values.begin(), values.end(), [](float value) { return value == 0.0f; });
}

// The forward that keeps activations computes the same y, and keeps the inputs and
// intermediates in the documented layouts.
TEST(MhaBackward, ForwardWithActivationsKeepsWhatBackwardNeeds) {
  const GradShape shape{"cross", 2, 3, 4, true, 16, 4, 2, true};
  const Problem p(shape, 7);
  AttentionOptions options;
  options.causal = true;
  for (const AttentionImpl impl : kImpls) {
    SCOPED_TRACE(impl_name(impl));
    std::vector<float> plain(p.x.size(), kNaN);
    p.layer.forward(p.x.data(), 2, 3, p.context.data(), 4, plain.data(), options, impl);
    Activations saved;
    const std::vector<float> y = forward(shape, p, saved, options, impl);
    EXPECT_EQ(y, plain);

    EXPECT_EQ(saved.hidden, 16);
    EXPECT_EQ(saved.num_heads, 4);
    EXPECT_EQ(saved.num_kv_heads, 2);
    EXPECT_EQ(saved.batch, 2);
    EXPECT_EQ(saved.seqlen_q, 3);
    EXPECT_EQ(saved.seqlen_kv, 4);
    EXPECT_TRUE(saved.cross);
    EXPECT_TRUE(saved.options.causal);
    EXPECT_EQ(saved.x, p.x);
    EXPECT_EQ(saved.context, p.context);
    EXPECT_EQ(saved.q.size(), 2u * 3 * 16);
    EXPECT_EQ(saved.k.size(), 2u * 4 * 8);
    EXPECT_EQ(saved.v.size(), 2u * 4 * 8);
    EXPECT_EQ(saved.att.size(), 2u * 3 * 16);
    ASSERT_EQ(saved.lse.size(), 2u * 4 * 3);
    // lse of row i, head h is log Σ_j exp(q_i·k_j·scale) over the keys the row sees.
    for (const float value : saved.lse) EXPECT_TRUE(std::isfinite(value));

    // The convenience overload returns what the one with an output argument writes.
    const Gradients returned = p.layer.backward(p.dy.data(), saved, impl);
    Gradients written;
    p.layer.backward(p.dy.data(), saved, written, impl);
    EXPECT_EQ(returned.dx, written.dx);
    EXPECT_EQ(returned.dcontext, written.dcontext);
    EXPECT_EQ(returned.dw_k, written.dw_k);
    EXPECT_EQ(returned.db_o, written.db_o);
  }

  // Self-attention keeps no separate context: x is it.
  const GradShape self{"self", 2, 3, 3, false, 16, 4, 2, false};
  const Problem q(self, 8);
  Activations saved;
  forward(self, q, saved, {}, AttentionImpl::flash);
  EXPECT_FALSE(saved.cross);
  EXPECT_TRUE(saved.context.empty());
  const Gradients grads = q.layer.backward(q.dy.data(), saved);
  EXPECT_TRUE(grads.dcontext.empty());
  EXPECT_EQ(grads.dx.size(), q.x.size());
  EXPECT_TRUE(grads.db_q.empty() && grads.db_k.empty() && grads.db_v.empty() && grads.db_o.empty());
}

// backward reads its own copy of the inputs: the caller may reuse x's buffer after forward.
TEST(MhaBackward, ActivationsOwnTheirInputs) {
  const GradShape shape{"self", 1, 4, 4, false, 8, 2, 0, true};
  Problem p(shape, 9);
  Activations saved;
  forward(shape, p, saved, {}, AttentionImpl::flash);
  const Gradients before = p.layer.backward(p.dy.data(), saved);
  std::fill(p.x.begin(), p.x.end(), kNaN);
  const Gradients after = p.layer.backward(p.dy.data(), saved);
  EXPECT_EQ(before.dx, after.dx);
  EXPECT_EQ(before.dw_q, after.dw_q);
}

// Without keys the attention output is the constant 0 (docs/design.md, "The contract"): y = b_O,
// so only b_O has
// a gradient (the column sums of dy); everything else is exactly 0, never NaN.
TEST(MhaBackward, NoKeysGiveGradientOnlyToOutputBias) {
  const GradShape shape{"no_keys", 2, 3, 0, true, 16, 4, 0, true};
  const Problem p(shape, 10);
  for (const AttentionImpl impl : kImpls) {
    SCOPED_TRACE(impl_name(impl));
    Activations saved;
    forward(shape, p, saved, {}, impl);
    Gradients grads;
    grads.dx.assign(p.x.size(), kNaN);
    grads.dw_q.assign(16 * 16, kNaN);
    grads.db_o.assign(16, kNaN);
    p.layer.backward(p.dy.data(), saved, grads, impl);
    for (const auto* zero : {&grads.dx, &grads.dw_q, &grads.dw_k, &grads.dw_v, &grads.dw_o,
                             &grads.db_q, &grads.db_k, &grads.db_v}) {
      EXPECT_TRUE(all_zero(*zero));
    }
    EXPECT_EQ(grads.dx.size(), p.x.size());
    EXPECT_TRUE(grads.dcontext.empty());
    ASSERT_EQ(grads.db_o.size(), 16u);
    for (std::int64_t c = 0; c < 16; ++c) {
      float sum = 0;
      for (std::int64_t r = 0; r < 6; ++r) sum += p.dy[r * 16 + c];
      EXPECT_NEAR(grads.db_o[c], sum, 1e-6) << "column " << c;
    }
  }
}

// No query token: y is empty and every gradient is 0 (shaped as the weights and the context).
TEST(MhaBackward, NoQueriesGiveZeroGradients) {
  MultiHeadAttention layer({16, 4, 2, true});
  layer.init_random(11);
  const std::vector<float> context = random_uniform(2 * 5 * 16, 1.0f, 12);
  Activations saved;
  layer.forward(nullptr, 2, 0, context.data(), 5, nullptr, saved);
  Gradients grads;
  grads.dcontext.assign(context.size(), kNaN);
  layer.backward(nullptr, saved, grads);
  EXPECT_TRUE(grads.dx.empty());
  EXPECT_EQ(grads.dcontext.size(), context.size());
  EXPECT_TRUE(all_zero(grads.dcontext));
  EXPECT_EQ(grads.dw_k.size(), 16u * 8);
  for (const auto* zero : {&grads.dw_q, &grads.dw_k, &grads.dw_v, &grads.dw_o, &grads.db_q,
                           &grads.db_k, &grads.db_v, &grads.db_o}) {
    EXPECT_TRUE(all_zero(*zero));
  }

  layer.forward(nullptr, 0, 5, nullptr, saved);
  const Gradients none = layer.backward(nullptr, saved);
  EXPECT_TRUE(none.dx.empty() && none.dcontext.empty());
  EXPECT_EQ(none.dw_o.size(), 16u * 16);
  EXPECT_TRUE(all_zero(none.dw_o));
}

TEST(MhaBackward, BadArgumentsRaiseNamedError) {
  MultiHeadAttention layer({16, 4, 2, false});
  layer.init_random(13);
  const std::vector<float> x = random_uniform(2 * 5 * 16, 1.0f, 14), dy = x;
  Activations saved;
  std::vector<float> y(x.size());
  layer.forward(x.data(), 2, 5, y.data(), saved);

  expect_error([&] { layer.backward(dy.data(), Activations{}); },
               {"MultiHeadAttention::backward: saved: expected activations of a layer with "
                "hidden 16, num_heads 4, num_kv_heads 2",
                "got hidden 0"});
  MultiHeadAttention other({16, 4, 0, false});
  expect_error([&] { other.backward(dy.data(), saved); },
               {"saved: ", "num_kv_heads 4", "got hidden 16, num_heads 4, num_kv_heads 2"});
  expect_error([&] { layer.backward(nullptr, saved); },
               {"MultiHeadAttention::backward: dy: expected a data pointer, got null"});
  Activations tampered = saved;
  tampered.lse.pop_back();
  expect_error([&] { layer.backward(dy.data(), tampered); },
               {"saved.lse: expected 40 elements", "got 39"});
  tampered = saved;
  tampered.cross = true;
  expect_error([&] { layer.backward(dy.data(), tampered); },
               {"saved.context: expected 160 elements", "got 0"});
}

// A forward that raises leaves both y and the caller's activations as they were.
TEST(MhaBackward, FailedForwardKeepsPreviousActivations) {
  MultiHeadAttention layer({16, 4, 0, false});
  layer.init_random(15);
  const std::vector<float> x = random_uniform(2 * 5 * 16, 1.0f, 16);
  std::vector<float> y(x.size());
  Activations saved;
  layer.forward(x.data(), 2, 5, y.data(), saved);
  const Activations before = saved;

  AttentionOptions bad;
  bad.softmax_scale = -1.0f;
  std::fill(y.begin(), y.end(), 7.0f);
  const std::vector<float> other = random_uniform(1 * 3 * 16, 1.0f, 17);
  for (const AttentionImpl impl : kImpls) {
    expect_error([&] { layer.forward(other.data(), 1, 3, y.data(), saved, bad, impl); },
                 {"softmax_scale"});
  }
  EXPECT_TRUE(std::all_of(y.begin(), y.end(), [](float value) { return value == 7.0f; }));
  EXPECT_EQ(saved.batch, before.batch);
  EXPECT_EQ(saved.seqlen_q, before.seqlen_q);
  EXPECT_EQ(saved.x, before.x);
  EXPECT_EQ(saved.q, before.q);
  EXPECT_EQ(saved.lse, before.lse);
}

}  // namespace
}  // namespace flashattn
