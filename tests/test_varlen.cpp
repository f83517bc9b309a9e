// varlen_attention_forward and _backward (flashattn/varlen.hpp): a packed ragged batch gives, for
// every sequence, bit for bit what the same path gives on that sequence alone, and the forward
// matches the fp64 reference; sequences without queries or without keys; bad offsets.
//
// Tolerance of the reference check: test_attention_vs_reference.cpp's bound for the standard
// path, u32·max|v|·(4·scale·D·max|q|·max|k| + 2·Skv + 16), plus one rounding of the output to
// its dtype and the rounding of the probabilities to a 16-bit input dtype
// (probability_rounding_bound); lse: the scores' and the sum's roundings, and 4 of |lse|.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "flashattn/varlen.hpp"
#include "test_support.hpp"

namespace flashattn::testing {
namespace {

constexpr double kU32 = 0x1p-24;
constexpr std::uint8_t kSentinel = 0xA5;

struct VarlenCase {
  std::vector<std::int32_t> q_lengths, k_lengths;
  std::int64_t heads_q, heads_kv, head_dim;
  bool causal = false;
  std::int64_t window_left = -1, window_right = -1;
  DType dtype = DType::f32;
  AttentionImpl impl = AttentionImpl::flash;
  bool padded = false;  // rows of the packed tensors padded by 8 elements
};

std::string case_name(const VarlenCase& c) {
  std::ostringstream name;
  name << "B" << c.q_lengths.size() << "_q";
  for (auto length : c.q_lengths) name << length << "_";
  name << "k";
  for (auto length : c.k_lengths) name << length << "_";
  name << "Hq" << c.heads_q << "_Hkv" << c.heads_kv << "_D" << c.head_dim
       << (c.causal ? "_causal" : "");
  if (c.window_left >= 0 || c.window_right >= 0) {
    name << "_win" << c.window_left << "_" << c.window_right;
  }
  name << "_" << dtype_name(c.dtype) << "_" << impl_name(c.impl) << (c.padded ? "_padded" : "");
  return name.str();
}

void PrintTo(const VarlenCase& c, std::ostream* os) { *os << case_name(c); }

std::vector<std::int32_t> offsets_of(const std::vector<std::int32_t>& lengths) {
  std::vector<std::int32_t> offsets = {0};
  for (auto length : lengths) offsets.push_back(offsets.back() + length);
  return offsets;
}

Tensor packed(DType dtype, std::int64_t total, std::int64_t heads, std::int64_t D, bool padded) {
  if (!padded) return Tensor(dtype, {1, total, heads, D});
  const std::int64_t row = D + 8;
  return Tensor(dtype, {1, total, heads, D}, {total * heads * row, heads * row, row, 1});
}

// Rows [begin, begin + count) of a packed tensor as a dense [1, count, H, D] tensor.
Tensor rows_of(const Tensor& t, std::int64_t begin, std::int64_t count) {
  Tensor part(t.view.dtype, {1, count, t.view.shape[2], t.view.shape[3]});
  part.for_each_index(
      [&](auto, auto s, auto h, auto d) { part.set(0, s, h, d, t.at(0, begin + s, h, d)); });
  return part;
}

bool same_rows(const Tensor& packed_tensor, std::int64_t begin, const Tensor& alone) {
  bool same = true;
  alone.for_each_index([&](auto, auto s, auto h, auto d) {
    const float a = packed_tensor.at(0, begin + s, h, d), b = alone.at(0, s, h, d);
    same = same && std::memcmp(&a, &b, sizeof(float)) == 0;
  });
  return same;
}

class VarlenAgainstEachSequence : public ::testing::TestWithParam<VarlenCase> {};

TEST_P(VarlenAgainstEachSequence, ForwardAndBackwardAreEachSequenceAlone) {
  const VarlenCase c = GetParam();
  std::mt19937_64 rng(test_seed());
  SCOPED_TRACE(case_name(c) + ", seed " + std::to_string(test_seed()));
  const std::int64_t B = static_cast<std::int64_t>(c.q_lengths.size()), D = c.head_dim;
  const std::vector<std::int32_t> cu_q = offsets_of(c.q_lengths), cu_k = offsets_of(c.k_lengths);
  const std::int64_t total_q = cu_q.back(), total_k = cu_k.back();
  Tensor q = packed(c.dtype, total_q, c.heads_q, D, c.padded);
  Tensor k = packed(c.dtype, total_k, c.heads_kv, D, c.padded);
  Tensor v = packed(c.dtype, total_k, c.heads_kv, D, c.padded);
  Tensor dout = packed(c.dtype, total_q, c.heads_q, D, c.padded);
  Tensor out = packed(c.dtype, total_q, c.heads_q, D, c.padded);
  Tensor dq = packed(c.dtype, total_q, c.heads_q, D, c.padded);
  Tensor dk = packed(c.dtype, total_k, c.heads_kv, D, c.padded);
  Tensor dv = packed(c.dtype, total_k, c.heads_kv, D, c.padded);
  for (Tensor* t : {&q, &k, &v, &dout}) t->fill_normal(rng);
  // Outputs: a sentinel byte everywhere (the padding keeps it), NaN in the view.
  for (Tensor* t : {&out, &dq, &dk, &dv}) {
    std::fill(t->bytes.begin(), t->bytes.end(), kSentinel);
    t->poison();
  }
  std::vector<float> lse(static_cast<std::size_t>(c.heads_q * total_q), NAN);
  AttentionOptions options;
  options.causal = c.causal;
  options.window_left = c.window_left;
  options.window_right = c.window_right;

  varlen_attention_forward(c.impl, q.view, k.view, v.view, cu_q.data(), cu_k.data(), B, out.view,
                           lse.data(), options);
  varlen_attention_backward(c.impl, dout.view, q.view, k.view, v.view, out.view, lse.data(),
                            cu_q.data(), cu_k.data(), B, dq.view, dk.view, dv.view, options);

  for (std::int64_t b = 0; b < B; ++b) {
    SCOPED_TRACE("sequence " + std::to_string(b));
    const std::int64_t q0 = cu_q[b], Lq = c.q_lengths[b], k0 = cu_k[b], Lk = c.k_lengths[b];
    const Tensor q_b = rows_of(q, q0, Lq), k_b = rows_of(k, k0, Lk), v_b = rows_of(v, k0, Lk);
    const Tensor dout_b = rows_of(dout, q0, Lq);
    Tensor out_b(c.dtype, q_b.view.shape), dq_b(c.dtype, q_b.view.shape);
    Tensor dk_b(c.dtype, k_b.view.shape), dv_b(c.dtype, k_b.view.shape);
    std::vector<float> lse_b(static_cast<std::size_t>(c.heads_q * Lq));
    attention_forward(c.impl, q_b.view, k_b.view, v_b.view, out_b.view, lse_b.data(), options);
    attention_backward(c.impl, dout_b.view, q_b.view, k_b.view, v_b.view, out_b.view, lse_b.data(),
                       dq_b.view, dk_b.view, dv_b.view, options);
    EXPECT_TRUE(same_rows(out, q0, out_b)) << "out";
    EXPECT_TRUE(same_rows(dq, q0, dq_b)) << "dq";
    EXPECT_TRUE(same_rows(dk, k0, dk_b)) << "dk";
    EXPECT_TRUE(same_rows(dv, k0, dv_b)) << "dv";
    for (std::int64_t h = 0; h < c.heads_q; ++h) {
      for (std::int64_t i = 0; i < Lq; ++i) {
        const float packed_lse = lse[h * total_q + q0 + i], alone = lse_b[h * Lq + i];
        EXPECT_EQ(std::memcmp(&packed_lse, &alone, sizeof(float)), 0)
            << "lse head " << h << " row " << i << ": " << packed_lse << " vs " << alone;
      }
    }
    if (Lq == 0) {
      // Keys no query sees get zero gradients.
      EXPECT_EQ(max_abs(dk_b), 0.0);
      EXPECT_EQ(max_abs(dv_b), 0.0);
    }

    // The forward against the fp64 reference.
    const ReferenceResult want = reference(q_b, k_b, v_b, options);
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    const double max_v = max_abs(v_b);
    const double scores = scale * static_cast<double>(D) * max_abs(q_b) * max_abs(k_b);
    const double tolerance = kU32 * max_v * (4.0 * scores + 2.0 * static_cast<double>(Lk) + 16.0) +
                             unit_roundoff(c.dtype) * max_v +
                             probability_rounding_bound(c.dtype, max_v) + 1e-30;
    const MaxError error = max_error(out_b, want.out);
    EXPECT_LE(error.value, tolerance)
        << "out index " << error.index << ": got " << error.got << ", want " << error.want;
    const double lse_tolerance =
        kU32 * (4.0 * scores + 2.0 * static_cast<double>(Lk) + 4.0 * max_abs_finite(want.lse));
    for (std::size_t i = 0; i < want.lse.size(); ++i) {
      if (std::isinf(want.lse[i])) {
        EXPECT_EQ(lse_b[i], -INFINITY) << "lse " << i;
      } else {
        EXPECT_NEAR(lse_b[i], want.lse[i], lse_tolerance) << "lse " << i;
      }
    }
  }
  // Padding between rows is never written.
  if (c.padded) {
    for (const Tensor* t : {&out, &dq, &dk, &dv}) {
      const std::int64_t heads = t->view.shape[2], total = t->view.shape[1];
      for (std::int64_t s = 0; s < total; ++s) {
        for (std::int64_t h = 0; h < heads; ++h) {
          const std::size_t size = dtype_size(t->view.dtype);
          const std::size_t first = (t->offset(0, s, h, 0) + D) * size;
          if (first + 8 * size > t->bytes.size()) continue;  // the last row's is not allocated
          const auto begin = t->bytes.begin() + static_cast<std::ptrdiff_t>(first);
          ASSERT_TRUE(std::all_of(begin, begin + 8 * size, [](auto x) { return x == kSentinel; }))
              << "padding written at row " << s << " head " << h;
        }
      }
    }
  }
}

std::vector<VarlenCase> varlen_cases() {
  std::vector<VarlenCase> cases;
  // Very different lengths, empty sequences of either side, causal with Sq < Skv and Sq > Skv.
  const std::vector<std::int32_t> q_lengths = {5, 0, 130, 1, 64, 3};
  const std::vector<std::int32_t> k_lengths = {5, 7, 200, 0, 64, 1};
  for (const AttentionImpl impl :
       {AttentionImpl::flash, AttentionImpl::standard, AttentionImpl::reference}) {
    cases.push_back({q_lengths, k_lengths, 4, 2, 40, true, -1, -1, DType::f32, impl});
  }
  cases.push_back({q_lengths, k_lengths, 4, 2, 64, false, 16, 4, DType::f32});
  cases.push_back({q_lengths, k_lengths, 4, 2, 64, true, -1, -1, DType::bf16});
  cases.push_back(
      {q_lengths, k_lengths, 2, 2, 32, true, -1, -1, DType::f16, AttentionImpl::flash, true});
  cases.push_back({{300, 17}, {300, 900}, 2, 1, 128, true, -1, -1, DType::f32});
  cases.push_back({{}, {}, 2, 1, 16});  // an empty batch
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, VarlenAgainstEachSequence, ::testing::ValuesIn(varlen_cases()),
                         [](const auto& info) { return case_name(info.param); });

// Bad input: a corruption of a valid call each, the start of the message it must raise, and
// nothing written.
struct VarlenCall {
  Tensor q{DType::f32, {1, 6, 2, 8}}, k{DType::f32, {1, 9, 1, 8}}, v{DType::f32, {1, 9, 1, 8}};
  Tensor out{DType::f32, {1, 6, 2, 8}};
  std::vector<std::int32_t> cu_q = {0, 2, 6}, cu_k = {0, 4, 9};
  std::vector<float> lse = std::vector<float>(12, 1.0f);
  TensorView q_view = q.view, out_view = out.view;
  std::int64_t batch = 2;
  const std::int32_t* cu_q_ptr = cu_q.data();
  AttentionImpl impl = AttentionImpl::flash;
  VarlenCall() { out.fill(2.0f); }
};

struct BadVarlen {
  const char* name;
  std::function<void(VarlenCall&)> corrupt;
  std::string message;
};

void PrintTo(const BadVarlen& bad, std::ostream* os) { *os << bad.name; }

class VarlenBadInput : public ::testing::TestWithParam<BadVarlen> {};

TEST_P(VarlenBadInput, RaisesANamedErrorAndWritesNothing) {
  VarlenCall call;
  GetParam().corrupt(call);
  const std::vector<std::uint8_t> out_before = call.out.bytes;
  const std::vector<float> lse_before = call.lse;
  try {
    varlen_attention_forward(call.impl, call.q_view, call.k.view, call.v.view, call.cu_q_ptr,
                             call.cu_k.data(), call.batch, call.out_view, call.lse.data());
    FAIL() << "no error raised";
  } catch (const Error& error) {
    const std::string what = error.what();
    EXPECT_EQ(what.rfind("varlen_attention_forward: " + GetParam().message, 0), 0u) << what;
  }
  EXPECT_EQ(call.out.bytes, out_before);
  EXPECT_EQ(0, std::memcmp(call.lse.data(), lse_before.data(), lse_before.size() * sizeof(float)));
}

std::vector<BadVarlen> bad_varlen() {
  return {
      {"first_offset", [](VarlenCall& c) { c.cu_q[0] = 1; }, "cu_seqlens_q[0]: expected 0, got 1"},
      {"decreasing",
       [](VarlenCall& c) {
         c.cu_k = {0, 5, 4};
       },
       "cu_seqlens_k[2]: expected >= cu_seqlens_k[1] = 5"},
      {"short_total", [](VarlenCall& c) { c.cu_q[2] = 5; },
       "cu_seqlens_q[2]: expected 6 (the packed rows), got 5"},
      {"null_offsets", [](VarlenCall& c) { c.cu_q_ptr = nullptr; },
       "cu_seqlens_q: expected 3 int32 offsets, got null"},
      {"negative_batch", [](VarlenCall& c) { c.batch = -1; }, "batch: expected >= 0, got -1"},
      {"unpacked_q",
       [](VarlenCall& c) {
         c.q_view.shape = {2, 3, 2, 8};
       },
       "q: expected a packed [1, total, heads, head_dim] view, got dim 0 = 2"},
      {"out_overlaps_q", [](VarlenCall& c) { c.out_view.data = c.q.view.data; },
       "out: expected memory disjoint from q"},
      {"impl", [](VarlenCall& c) { c.impl = static_cast<AttentionImpl>(7); },
       "impl: expected flash, standard or reference"},
  };
}

INSTANTIATE_TEST_SUITE_P(Calls, VarlenBadInput, ::testing::ValuesIn(bad_varlen()),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(Varlen, BackwardRequiresTheLse) {
  VarlenCall call;
  Tensor dq(DType::f32, {1, 6, 2, 8}), dk(DType::f32, {1, 9, 1, 8}), dv(DType::f32, {1, 9, 1, 8});
  try {
    varlen_attention_backward(AttentionImpl::flash, call.out.view, call.q.view, call.k.view,
                              call.v.view, call.out.view, nullptr, call.cu_q.data(),
                              call.cu_k.data(), 2, dq.view, dk.view, dv.view);
    FAIL() << "no error raised";
  } catch (const Error& error) {
    EXPECT_EQ(std::string(error.what()).rfind("varlen_attention_backward: lse: expected", 0), 0u)
        << error.what();
  }
}

}  // namespace
}  // namespace flashattn::testing
