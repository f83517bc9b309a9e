// Bad input raises flashattn::Error naming the argument, what was expected and what was given,
// and writes nothing.

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <string_view>

#include "test_support.hpp"

namespace flashattn::testing {
namespace {

struct Problem {
  Tensor q{DType::f32, {2, 5, 4, 8}};
  Tensor k{DType::f32, {2, 7, 2, 8}};
  Tensor v{DType::f32, {2, 7, 2, 8}};
  Tensor out{DType::f32, {2, 5, 4, 8}};
  std::vector<float> lse = std::vector<float>(2 * 4 * 5, NAN);
  AttentionOptions options;

  Problem() {
    std::mt19937_64 rng(1);
    q.fill_normal(rng);
    k.fill_normal(rng);
    v.fill_normal(rng);
    out.poison();
  }
  // Replacing the output keeps it poisoned, so "writes nothing" stays checkable.
  void replace_out(Tensor replacement) {
    out = std::move(replacement);
    out.poison();
  }
};

struct BadCase {
  std::string name;
  std::function<void(Problem&)> corrupt;
  std::vector<std::string> message_parts;
};

std::vector<BadCase> bad_cases() {
  return {
      {"KeyHeadDimMismatch",
       [](Problem& p) {
         p.k = Tensor(DType::f32, {2, 7, 2, 16});
       },
       {"k: expected head_dim 8 (as q), got 16"}},
      {"ValueShapeMismatch",
       [](Problem& p) {
         p.v = Tensor(DType::f32, {2, 6, 2, 8});
       },
       {"v: expected shape [2, 7, 2, head_dim_v] (as k but for its head dim), got [2, 6, 2, 8]"}},
      {"ValueHeadDimUnlikeOut",
       [](Problem& p) {
         p.v = Tensor(DType::f32, {2, 7, 2, 16});
       },
       {"out: expected shape [2, 5, 4, 16] (q's [batch, seqlen_q, heads_q] and v's head_dim_v = "
        "16), got [2, 5, 4, 8]"}},
      {"ValueHeadDimZero",
       [](Problem& p) {
         p.v = Tensor(DType::f32, {2, 7, 2, 0});
       },
       {"v: expected head_dim_v >= 1, got 0"}},
      {"BatchMismatch",
       [](Problem& p) {
         p.k = Tensor(DType::f32, {1, 7, 2, 8});
         p.v = Tensor(DType::f32, {1, 7, 2, 8});
       },
       {"k: expected batch 2 (as q), got 1"}},
      {"OutShapeMismatch",
       [](Problem& p) {
         p.replace_out(Tensor(DType::f32, {2, 5, 4, 7}));
       },
       {"out: expected shape [2, 5, 4, 8] (q's [batch, seqlen_q, heads_q] and v's head_dim_v = 8), "
        "got [2, 5, 4, 7]"}},
      {"DtypeMismatch",
       [](Problem& p) {
         p.v = Tensor(DType::bf16, {2, 7, 2, 8});
       },
       {"v: expected dtype f32 (as q), got bf16"}},
      {"OutDtypeMismatch",
       [](Problem& p) {
         p.replace_out(Tensor(DType::f16, {2, 5, 4, 8}));
       },
       {"out: expected dtype f32 (as q), got f16"}},
      {"HeadDimZero",
       [](Problem& p) {
         p.q = Tensor(DType::f32, {2, 5, 4, 0});
         p.k = Tensor(DType::f32, {2, 7, 2, 0});
         p.v = Tensor(DType::f32, {2, 7, 2, 0});
         p.replace_out(Tensor(DType::f32, {2, 5, 4, 0}));
       },
       {"q: expected head_dim >= 1, got 0"}},
      {"HeadsNotAMultiple",
       [](Problem& p) {
         p.k = Tensor(DType::f32, {2, 7, 3, 8});
         p.v = Tensor(DType::f32, {2, 7, 3, 8});
       },
       {"k: expected heads_kv dividing heads_q = 4, got heads_kv 3"}},
      {"NullQuery",
       [](Problem& p) { p.q.view.data = nullptr; },
       {"q: expected a data pointer, got null"}},
      {"NullOut",
       [](Problem& p) { p.out.view.data = nullptr; },
       {"out: expected a data pointer, got null"}},
      {"ZeroScale",
       [](Problem& p) { p.options.softmax_scale = 0.0f; },
       {"softmax_scale: expected a finite value > 0, got 0"}},
      {"NegativeScale",
       [](Problem& p) { p.options.softmax_scale = -1.0f; },
       {"softmax_scale: expected a finite value > 0, got -1"}},
      {"NaNScale",
       [](Problem& p) { p.options.softmax_scale = NAN; },
       {"softmax_scale: expected a finite value > 0, got nan"}},
      {"InfiniteScale",
       [](Problem& p) { p.options.softmax_scale = INFINITY; },
       {"softmax_scale: expected a finite value > 0, got inf"}},
      {"WindowLeftBelowMinusOne",
       [](Problem& p) { p.options.window_left = -2; },
       {"window_left: expected >= -1 (-1 = unbounded), got -2"}},
      {"WindowRightBelowMinusOne",
       [](Problem& p) { p.options.window_right = -5; },
       {"window_right: expected >= -1 (-1 = unbounded), got -5"}},
      {"NegativeThreads",
       [](Problem& p) { p.options.num_threads = -1; },
       {"num_threads: expected 0..1024 (0 = all), got -1"}},
      {"AbsurdThreadCount",
       [](Problem& p) { p.options.num_threads = 1000000; },
       {"num_threads: expected 0..1024 (0 = all), got 1000000"}},
      {"NonContiguousLastDim",
       [](Problem& p) {
         p.q = Tensor(DType::f32, {2, 5, 4, 8}, {320, 64, 16, 2});
       },
       {"q: expected a contiguous last dim (stride 1), got stride 2"}},
      {"NegativeStride",
       [](Problem& p) { p.k.view.strides[1] = -16; },
       {"k: expected non-negative strides"}},
      {"OutAliasesQuery",
       [](Problem& p) { p.out.view.data = p.q.view.data; },
       {"out: expected memory disjoint from q, got overlapping buffers"}},
      {"OutOverlapsValue",
       [](Problem& p) {
         p.out.view.data = p.v.bytes.data() + 4 * sizeof(float);
         p.out.view.shape = {1, 1, 1, 8};
         p.out.view.strides = {8, 8, 8, 1};
         p.q.view.shape = {1, 1, 1, 8};
         p.k.view.shape = {1, 7, 1, 8};
         p.v.view.shape = {1, 7, 1, 8};
       },
       {"out: expected memory disjoint from v, got overlapping buffers"}},
      {"OutSelfOverlapping",
       [](Problem& p) {
         p.out.view.strides = {32, 0, 8, 1};
       },
       {"out: expected strides that give every element its own address"}},
      {"LseOverlapsOut",
       [](Problem& p) { p.lse.clear(); },
       {"lse: expected memory disjoint from out"}},
  };
}

class BadInput : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadInput, RaisesErrorNamingArgumentAndWritesNothing) {
  const BadCase& bad = GetParam();
  for (AttentionImpl impl :
       {AttentionImpl::flash, AttentionImpl::standard, AttentionImpl::reference}) {
    Problem p;
    bad.corrupt(p);
    float* lse = p.lse.empty() ? static_cast<float*>(p.out.view.data) : p.lse.data();
    try {
      attention_forward(impl, p.q.view, p.k.view, p.v.view, p.out.view, lse, p.options);
      ADD_FAILURE() << impl_name(impl) << ": no error raised for " << bad.name;
    } catch (const Error& error) {
      const std::string message = error.what();
      for (const std::string& part : bad.message_parts) {
        EXPECT_NE(message.find(part), std::string::npos)
            << impl_name(impl) << ": message \"" << message << "\" lacks \"" << part << "\"";
      }
    }
    if (!p.out.bytes.empty() && p.out.view.data == p.out.bytes.data() && !p.lse.empty()) {
      p.out.for_each_index([&](auto a, auto b, auto c, auto d) {
        ASSERT_TRUE(std::isnan(p.out.at(a, b, c, d))) << "out written despite the error";
      });
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Attention, BadInput, ::testing::ValuesIn(bad_cases()),
                         [](const auto& info) { return info.param.name; });

// lse is written like out: it may overlap none of the inputs either (q, k, v; out is a BadInput
// case), on every path, and nothing is written when it does.
TEST(Validation, LseOverlappingAnInputIsRefused) {
  for (const char* input : {"q", "k", "v"}) {
    for (AttentionImpl impl :
         {AttentionImpl::flash, AttentionImpl::standard, AttentionImpl::reference}) {
      Problem p;
      Tensor& target = *input == 'q' ? p.q : *input == 'k' ? p.k : p.v;
      const std::vector<std::uint8_t> before = target.bytes;
      try {
        attention_forward(impl, p.q.view, p.k.view, p.v.view, p.out.view,
                          static_cast<float*>(target.view.data), p.options);
        ADD_FAILURE() << impl_name(impl) << ": no error raised for lse on " << input;
      } catch (const Error& error) {
        EXPECT_NE(std::string(error.what())
                      .find(std::string("lse: expected memory disjoint from ") + input),
                  std::string::npos)
            << error.what();
      }
      EXPECT_EQ(target.bytes, before) << input << " written despite the error";
      p.out.for_each_index([&](auto a, auto b, auto c, auto d) {
        ASSERT_TRUE(std::isnan(p.out.at(a, b, c, d))) << "out written despite the error";
      });
    }
  }
}

TEST(Validation, ErrorIsAnInvalidArgument) {
  Problem p;
  p.options.softmax_scale = 0.0f;
  EXPECT_THROW(
      flash_attention_forward(p.q.view, p.k.view, p.v.view, p.out.view, nullptr, p.options),
      std::invalid_argument);
}

TEST(Validation, MessageNamesTheEntryPoint) {
  Problem p;
  p.options.window_left = -3;
  try {
    standard_attention_forward(p.q.view, p.k.view, p.v.view, p.out.view, nullptr, p.options);
    FAIL() << "no error raised";
  } catch (const Error& error) {
    EXPECT_EQ(std::string(error.what()).rfind("standard_attention_forward: ", 0), 0u)
        << error.what();
  }
}

// The names before 0.2 stay for one release as deprecated aliases of the same paths.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
TEST(Validation, DeprecatedNamesRunTheSamePaths) {
  const auto same_bits = [](const Tensor& a, const Tensor& b) {
    return a.bytes.size() == b.bytes.size() &&
           std::memcmp(a.bytes.data(), b.bytes.data(), a.bytes.size()) == 0;
  };
  Problem p;
  p.options.causal = true;
  Tensor old_out{DType::f32, p.out.view.shape};
  std::vector<float> lse(p.lse.size());
  standard_attention_forward(p.q.view, p.k.view, p.v.view, p.out.view, lse.data(), p.options);
  attention_standard(p.q.view, p.k.view, p.v.view, old_out.view, nullptr, p.options);
  EXPECT_TRUE(same_bits(p.out, old_out));
  reference_attention_forward(p.q.view, p.k.view, p.v.view, p.out.view, lse.data(), p.options);
  attention_reference(p.q.view, p.k.view, p.v.view, old_out.view, nullptr, p.options);
  EXPECT_TRUE(same_bits(p.out, old_out));

  Tensor dout{DType::f32, p.out.view.shape};
  std::mt19937_64 rng(2);
  dout.fill_normal(rng);
  Tensor dq{DType::f32, p.q.view.shape}, dk{DType::f32, p.k.view.shape},
      dv{DType::f32, p.v.view.shape};
  Tensor old_dq{DType::f32, p.q.view.shape}, old_dk{DType::f32, p.k.view.shape},
      old_dv{DType::f32, p.v.view.shape};
  standard_attention_backward(dout.view, p.q.view, p.k.view, p.v.view, p.out.view, lse.data(),
                              dq.view, dk.view, dv.view, p.options);
  attention_backward_standard(dout.view, p.q.view, p.k.view, p.v.view, p.out.view, lse.data(),
                              old_dq.view, old_dk.view, old_dv.view, p.options);
  EXPECT_TRUE(same_bits(dq, old_dq) && same_bits(dk, old_dk) && same_bits(dv, old_dv));
  reference_attention_backward(dout.view, p.q.view, p.k.view, p.v.view, p.out.view, lse.data(),
                               dq.view, dk.view, dv.view, p.options);
  attention_backward_reference(dout.view, p.q.view, p.k.view, p.v.view, p.out.view, lse.data(),
                               old_dq.view, old_dk.view, old_dv.view, p.options);
  EXPECT_TRUE(same_bits(dq, old_dq) && same_bits(dk, old_dk) && same_bits(dv, old_dv));
}
#pragma GCC diagnostic pop

TEST(Validation, VisiblePairsCountsTheMaskExactly) {
  AttentionOptions causal;
  causal.causal = true;
  EXPECT_EQ(visible_pairs(4, 4, {}), 16);
  EXPECT_EQ(visible_pairs(4, 4, causal), 10);     // 1 + 2 + 3 + 4
  EXPECT_EQ(visible_pairs(2, 5, causal), 4 + 5);  // bottom-right: rows see 4 and 5 keys
  EXPECT_EQ(visible_pairs(5, 2, causal), 1 + 2);  // the first three rows see nothing
  AttentionOptions window;
  window.window_left = 1;
  window.window_right = 0;
  EXPECT_EQ(visible_pairs(4, 4, window), 1 + 2 + 2 + 2);
  EXPECT_DOUBLE_EQ(attention_flops(2, 3, 4, 4, 8, causal), 4.0 * 2 * 3 * 8 * 10);
}

}  // namespace
}  // namespace flashattn::testing
