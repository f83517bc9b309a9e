// Attention dropout (options.hpp, util/dropout.hpp). The forward and backward of every path
// against the fp64 reference with dropout run on test_score_modifiers.cpp's grid; here: the mask
// itself (Random123's known answer, the SIMD generator of every target against the scalar
// definition bit for bit, the keep fraction), what the mask depends on (seed and offset, never
// the thread count), the varlen batch keyed by sequence, and bad input.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cpu/kernels/dropout.hpp"
#include "test_support.hpp"
#include "util/dropout.hpp"

namespace flashattn::testing {
namespace {

detail::Dropout dropout_of(float p, std::uint64_t seed, std::uint32_t offset) {
  detail::Dropout dropout;
  dropout.p = p;
  dropout.scale = 1.0f / (1.0f - p);
  dropout.threshold = static_cast<std::uint32_t>(std::lround(p * 65536.0));
  dropout.seed = seed;
  dropout.offset = offset;
  return dropout;
}

// Random123's known-answer vector for Philox4x32-10 with counter and key 0 (its kat_vectors):
// 6627e8d5 e169c58d bc57ac4c 9b00dbd8. Key j of block 0 takes word j / 32 of counter j % 16,
// low half below j % 32 = 16: key 0 the low half of word 0, key 16 its high half, key 32 word 1.
TEST(DropoutMask, DrawsAreRandom123sPhilox) {
  const detail::Dropout dropout = dropout_of(0.5f, 0, 0);
  EXPECT_EQ(detail::dropout_draw(dropout, 0, 0, 0), 0xe8d5u);
  EXPECT_EQ(detail::dropout_draw(dropout, 0, 0, 16), 0x6627u);
  EXPECT_EQ(detail::dropout_draw(dropout, 0, 0, 32), 0xc58du);
  EXPECT_EQ(detail::dropout_draw(dropout, 0, 0, 48), 0xe169u);
  EXPECT_EQ(detail::dropout_draw(dropout, 0, 0, 64), 0xac4cu);
  EXPECT_EQ(detail::dropout_draw(dropout, 0, 0, 80), 0xbc57u);
  EXPECT_EQ(detail::dropout_draw(dropout, 0, 0, 96), 0xdbd8u);
  EXPECT_EQ(detail::dropout_draw(dropout, 0, 0, 112), 0x9b00u);
}

// The SIMD generator of every compiled target writes the scalar definition's mask, for ranges
// that start and end anywhere inside a 128-key block and span several.
TEST(DropoutMask, EveryTargetMatchesTheDefinition) {
  std::mt19937_64 rng(test_seed());
  std::uniform_int_distribution<std::int64_t> begin_of(0, 400), length_of(0, 300);
  on_every_target([&] {
    for (int trial = 0; trial < 40; ++trial) {
      const detail::Dropout dropout =
          dropout_of(trial % 3 == 0 ? 0.5f : 0.17f, rng(), static_cast<std::uint32_t>(rng()));
      const detail::cpu::DropoutRow row{&dropout, static_cast<std::uint32_t>(rng()),
                                        static_cast<std::uint32_t>(rng())};
      const std::int64_t key_begin = begin_of(rng), n = length_of(rng);
      std::vector<float> applied(static_cast<std::size_t>(n), 3.0f);
      std::vector<float> multipliers(static_cast<std::size_t>(n), NAN);
      detail::cpu::apply_dropout(applied.data(), key_begin, n, row);
      detail::cpu::dropout_multipliers(multipliers.data(), key_begin, n, row);
      for (std::int64_t i = 0; i < n; ++i) {
        const bool kept =
            detail::dropout_draw(dropout, row.stream, row.row, key_begin + i) >= dropout.threshold;
        ASSERT_EQ(applied[i], kept ? 3.0f * dropout.scale : 0.0f)
            << "key " << key_begin + i << " of [" << key_begin << ", " << key_begin + n << ")";
        ASSERT_EQ(multipliers[i], kept ? dropout.scale : 0.0f) << "key " << key_begin + i;
      }
      // A NaN probability stays NaN where dropped too (0 · NaN), as the reference's weight.
      std::vector<float> nans(static_cast<std::size_t>(n), NAN);
      detail::cpu::apply_dropout(nans.data(), key_begin, n, row);
      for (std::int64_t i = 0; i < n; ++i) ASSERT_TRUE(std::isnan(nans[i])) << "key " << i;
      // A tile of 3 rows of other coordinates in one call, rows ld = n + 5 apart.
      const std::int64_t ld = n + 5;
      std::vector<float> tile(static_cast<std::size_t>(3 * ld), 2.0f);
      const detail::cpu::DropoutRow rows[] = {
          row, {&dropout, row.stream + 1, row.row}, {&dropout, row.stream, row.row + 7}};
      detail::cpu::apply_dropout_rows(tile.data(), ld, rows, 3, key_begin, n);
      for (std::int64_t r = 0; r < 3; ++r) {
        for (std::int64_t i = 0; i < ld; ++i) {
          const bool kept = i < n && detail::dropout_draw(dropout, rows[r].stream, rows[r].row,
                                                          key_begin + i) >= dropout.threshold;
          const float want = i >= n ? 2.0f : (kept ? 2.0f * dropout.scale : 0.0f);
          ASSERT_EQ(tile[r * ld + i], want) << "tile row " << r << ", key " << key_begin + i;
        }
      }
    }
  });
}

// The fraction dropped over n = 2^20 draws is p within 6 standard deviations,
// 6·sqrt(p(1 − p)/n) (< 0.0025), plus the threshold's rounding to 2^-17.
TEST(DropoutMask, DropsTheAskedFraction) {
  for (float p : {0.1f, 0.17f, 0.5f, 0.9f}) {
    const detail::Dropout dropout = dropout_of(p, test_seed(), 7);
    constexpr std::int64_t kRows = 1024, kKeys = 1024;
    std::vector<float> row(kKeys);
    std::int64_t dropped = 0;
    for (std::int64_t r = 0; r < kRows; ++r) {
      detail::cpu::dropout_multipliers(row.data(), 0, kKeys,
                                       {&dropout, 3, static_cast<std::uint32_t>(r)});
      for (float m : row) dropped += m == 0.0f;
    }
    const double n = static_cast<double>(kRows * kKeys);
    EXPECT_NEAR(static_cast<double>(dropped) / n, p,
                6.0 * std::sqrt(p * (1.0 - p) / n) + std::ldexp(1.0, -17))
        << "p = " << p;
  }
}

struct Inputs {
  Tensor q, k, v, dout;
  explicit Inputs(std::array<std::int64_t, 4> q_shape, std::array<std::int64_t, 4> kv_shape,
                  std::uint64_t seed)
      : q(DType::f32, q_shape),
        k(DType::f32, kv_shape),
        v(DType::f32, kv_shape),
        dout(DType::f32, q_shape) {
    std::mt19937_64 rng(seed);
    q.fill_normal(rng);
    k.fill_normal(rng);
    v.fill_normal(rng);
    dout.fill_normal(rng);
  }
};

struct Outputs {
  Tensor out, dq, dk, dv;
  std::vector<float> lse;
};

Outputs flash_forward_backward(const Inputs& in, const AttentionOptions& options) {
  Outputs o{Tensor(DType::f32, in.q.view.shape), Tensor(DType::f32, in.q.view.shape),
            Tensor(DType::f32, in.k.view.shape), Tensor(DType::f32, in.k.view.shape),
            std::vector<float>(static_cast<std::size_t>(in.q.view.shape[0] * in.q.view.shape[2] *
                                                        in.q.view.shape[1]))};
  flash_attention_forward(in.q.view, in.k.view, in.v.view, o.out.view, o.lse.data(), options);
  flash_attention_backward(in.dout.view, in.q.view, in.k.view, in.v.view, o.out.view, o.lse.data(),
                           o.dq.view, o.dk.view, o.dv.view, options);
  return o;
}

bool same_bits(const Tensor& a, const Tensor& b) { return a.bytes == b.bytes; }

// The mask depends on the seed and offset and on nothing else: 1, 2 and 3 threads give the same
// bits, forward and backward; another seed or another offset gives another output.
TEST(DropoutMask, DependsOnSeedAndOffsetNotThreads) {
  const Inputs in({2, 150, 4, 64}, {2, 170, 2, 64}, test_seed());
  AttentionOptions options;
  options.dropout_p = 0.17f;
  options.dropout_seed = 0x1234'5678'9abc'def0u;
  options.dropout_offset = 42;
  options.causal = true;
  options.num_threads = 1;
  const Outputs one = flash_forward_backward(in, options);
  for (int threads : {2, 3}) {
    options.num_threads = threads;
    const Outputs many = flash_forward_backward(in, options);
    EXPECT_TRUE(same_bits(one.out, many.out)) << threads << " threads";
    EXPECT_EQ(one.lse, many.lse) << threads << " threads";
    EXPECT_TRUE(same_bits(one.dq, many.dq)) << threads << " threads";
    EXPECT_TRUE(same_bits(one.dk, many.dk)) << threads << " threads";
    EXPECT_TRUE(same_bits(one.dv, many.dv)) << threads << " threads";
  }
  AttentionOptions other_seed = options;
  other_seed.dropout_seed ^= 1;
  AttentionOptions other_offset = options;
  other_offset.dropout_offset += 1;
  for (const AttentionOptions& changed : {other_seed, other_offset}) {
    const Outputs o = flash_forward_backward(in, changed);
    EXPECT_FALSE(same_bits(one.out, o.out));
    EXPECT_EQ(one.lse, o.lse) << "lse is the softmax's before dropout";
  }
}

// A varlen batch keys sequence b's mask as batch entry b of a dense call: equal lengths give the
// dense reference's output, within the flash path's bound (test_attention_vs_reference.cpp).
TEST(DropoutVarlen, SequencesAreBatchEntries) {
  constexpr std::int64_t B = 3, S = 77, Hq = 4, Hkv = 2, D = 48;
  const Inputs dense({B, S, Hq, D}, {B, S, Hkv, D}, test_seed());
  AttentionOptions options;
  options.dropout_p = 0.3f;
  options.dropout_seed = test_seed();
  options.causal = true;
  Tensor want(DType::f32, dense.q.view.shape);
  reference_attention_forward(dense.q.view, dense.k.view, dense.v.view, want.view, nullptr,
                              options);
  auto packed = [](const Tensor& t) {
    TensorView view = t.view;
    view.shape = {1, t.view.shape[0] * t.view.shape[1], t.view.shape[2], t.view.shape[3]};
    view.strides = contiguous_strides(view.shape);
    return view;
  };
  Tensor got(DType::f32, dense.q.view.shape);
  const std::vector<std::int32_t> cu = {0, S, 2 * S, 3 * S};
  varlen_attention_forward(AttentionImpl::flash, packed(dense.q), packed(dense.k), packed(dense.v),
                           cu.data(), cu.data(), B, packed(got), nullptr, options);
  double worst = 0.0;
  got.for_each_index([&](auto b, auto s, auto h, auto d) {
    worst =
        std::max(worst, std::abs(static_cast<double>(got.at(b, s, h, d)) - want.at(b, s, h, d)));
  });
  // Output elements are weighted means of |v| <= ~5 scaled by 1/(1 − p): 1e-5 is ~100 fp32
  // roundings of them; a mask keyed differently moves them by O(1).
  EXPECT_LT(worst, 1e-5);
}

// dropout_p outside [0, 1), and dropout where a call has none, are refused naming dropout_p.
TEST(DropoutValidation, BadDropoutIsAnErrorNamingIt) {
  const Inputs in({1, 8, 2, 16}, {1, 8, 2, 16}, 1);
  Tensor out(DType::f32, in.q.view.shape);
  for (float p : {-0.1f, 1.0f, 1.5f, NAN, INFINITY}) {
    AttentionOptions options;
    options.dropout_p = p;
    for (AttentionImpl impl :
         {AttentionImpl::flash, AttentionImpl::standard, AttentionImpl::reference}) {
      try {
        attention_forward(impl, in.q.view, in.k.view, in.v.view, out.view, nullptr, options);
        ADD_FAILURE() << "dropout_p " << p << " accepted";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("dropout_p: expected a value in [0, 1)"),
                  std::string::npos)
            << e.what();
      }
    }
  }
  // The KV-cache call: nothing appended, the cache untouched.
  AttentionOptions options;
  options.dropout_p = 0.1f;
  Tensor k_cache(DType::f32, {1, 16, 2, 16}), v_cache(DType::f32, {1, 16, 2, 16});
  k_cache.fill(2.0f);
  const std::vector<std::uint8_t> before = k_cache.bytes;
  const std::int32_t cache_seqlens[] = {4};
  NewKeysValues new_kv{in.k.view, in.v.view};
  try {
    kvcache_attention_forward(in.q.view, {k_cache.view, v_cache.view}, cache_seqlens, new_kv,
                              out.view, nullptr, options);
    ADD_FAILURE() << "dropout accepted by the KV-cache call";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dropout_p: expected 0"), std::string::npos) << e.what();
  }
  EXPECT_EQ(k_cache.bytes, before);
}

// dropout_mask (the public mask) is the definition's, and refuses what it cannot index.
TEST(DropoutMask, PublicMaskIsTheDefinitionsAndRefusesBadInput) {
  AttentionOptions options;
  options.dropout_p = 0.3f;
  options.dropout_seed = test_seed();
  options.dropout_offset = 9;
  constexpr std::int64_t kHeads = 3, kRows = 5, kKeys = 150, kBatchIndex = 2;
  std::vector<std::uint8_t> keep(kHeads * kRows * kKeys, 7);
  dropout_mask(options, kBatchIndex, kHeads, kRows, kKeys, keep.data());
  detail::AttentionParams params;
  params.heads_q = kHeads;
  params.dropout = detail::make_dropout(options);
  for (std::int64_t h = 0; h < kHeads; ++h)
    for (std::int64_t i = 0; i < kRows; ++i)
      for (std::int64_t j = 0; j < kKeys; ++j) {
        ASSERT_EQ(keep[(h * kRows + i) * kKeys + j],
                  detail::dropout_kept(params, kBatchIndex, h, i, j) ? 1 : 0)
            << h << " " << i << " " << j;
      }
  options.dropout_p = 0.0f;
  dropout_mask(options, 0, kHeads, kRows, kKeys, keep.data());
  EXPECT_EQ(std::count(keep.begin(), keep.end(), 1), kHeads * kRows * kKeys);

  auto expect_error = [&](const char* message, auto&& call) {
    try {
      call();
      ADD_FAILURE() << message << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  };
  options.dropout_p = 1.0f;
  expect_error("dropout_p", [&] { dropout_mask(options, 0, 1, 1, 1, keep.data()); });
  options.dropout_p = 0.5f;
  expect_error("heads_q", [&] { dropout_mask(options, 0, 0, 1, 1, keep.data()); });
  expect_error("batch_index", [&] { dropout_mask(options, -1, 1, 1, 1, keep.data()); });
  expect_error("batch_index",
               [&] { dropout_mask(options, std::int64_t{1} << 31, 4, 1, 1, keep.data()); });
  expect_error("seqlen_q", [&] { dropout_mask(options, 0, 1, -1, 1, keep.data()); });
  expect_error("seqlen_kv",
               [&] { dropout_mask(options, 0, 1, 1, (std::int64_t{1} << 32) + 1, keep.data()); });
  expect_error("keep", [&] { dropout_mask(options, 0, 1, 1, 1, nullptr); });
}

}  // namespace
}  // namespace flashattn::testing
