// Block attention (api/block_attention.hpp), the seam of ring attention: a whole sequence cut
// into query blocks and key blocks of uneven sizes, each pair attended with its offset on the
// whole sequence's diagonal, the partial states merged (forward) or the partial gradients summed
// (backward), must give the whole sequence's attention: against the fp64 reference with
// assembled_tolerance (test_support.hpp), relative to the single-call flash path's own error.
// Pairs the mask hides entirely are computed too (rows with lse −inf), which the merge must
// absorb.

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "api/block_attention.hpp"
#include "test_support.hpp"

namespace flashattn::testing {
namespace {

struct BlockCase {
  std::int64_t seqlen, heads_q, heads_kv, head_dim;
  std::vector<std::int64_t> cuts;  // block boundaries inside (0, seqlen)
  bool causal = false;
  std::int64_t window_left = -1, window_right = -1;
  bool alibi = false;
  float softcap = 0.0f;
  DType dtype = DType::f32;
};

std::string describe(const BlockCase& c) {
  std::ostringstream text;
  text << "S" << c.seqlen << "_Hq" << c.heads_q << "_Hkv" << c.heads_kv << "_D" << c.head_dim
       << "_cuts";
  for (std::int64_t cut : c.cuts) text << "_" << cut;
  text << (c.causal ? "_causal" : "") << "_win" << c.window_left << "_" << c.window_right
       << (c.alibi ? "_alibi" : "") << (c.softcap > 0 ? "_softcap" : "") << "_"
       << dtype_name(c.dtype);
  std::string name = text.str();
  for (char& ch : name) {
    if (ch == '-') ch = 'm';
  }
  return name;
}

struct Blocks {
  std::vector<std::int64_t> begin, length;
};
Blocks blocks_of(const BlockCase& c) {
  Blocks blocks;
  std::int64_t previous = 0;
  std::vector<std::int64_t> cuts = c.cuts;
  cuts.push_back(c.seqlen);
  for (std::int64_t cut : cuts) {
    blocks.begin.push_back(previous);
    blocks.length.push_back(cut - previous);
    previous = cut;
  }
  return blocks;
}

// One case's random inputs and options.
struct BlockProblem {
  explicit BlockProblem(const BlockCase& block_case, std::uint64_t seed)
      : c(block_case),
        rng(seed),
        q(c.dtype, {1, c.seqlen, c.heads_q, c.head_dim}),
        k(c.dtype, {1, c.seqlen, c.heads_kv, c.head_dim}),
        v(c.dtype, {1, c.seqlen, c.heads_kv, c.head_dim}) {
    q.fill_normal(rng);
    k.fill_normal(rng);
    v.fill_normal(rng);
    options.causal = c.causal;
    options.window_left = c.window_left;
    options.window_right = c.window_right;
    options.softcap = c.softcap;
    for (std::int64_t h = 0; h < c.heads_q; ++h) {
      slopes.push_back(0.25f / static_cast<float>(h + 1));
    }
    if (c.alibi) options.alibi_slopes = slopes;
  }

  double score_rounding() const {
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
    return 0x1p-24 * scale * std::sqrt(static_cast<double>(c.head_dim)) * max_abs(q) * max_abs(k);
  }

  BlockCase c;
  std::mt19937_64 rng;
  Tensor q, k, v;
  std::vector<float> slopes;
  AttentionOptions options;
};

void check_merged_forward(BlockProblem& p) {
  const BlockCase& c = p.c;
  const Tensor &q = p.q, &k = p.k, &v = p.v;
  const AttentionOptions& options = p.options;
  const Blocks blocks = blocks_of(c);
  const ReferenceResult want = reference(q, k, v, options);

  Tensor whole(c.dtype, q.view.shape);
  flash_attention_forward(q.view, k.view, v.view, whole.view, nullptr, options);
  const double single_error = max_error(whole, want.out).value;

  Tensor assembled(c.dtype, q.view.shape);
  assembled.poison();
  std::vector<float> assembled_lse(static_cast<std::size_t>(c.heads_q * c.seqlen));
  for (std::size_t i = 0; i < blocks.begin.size(); ++i) {
    const std::int64_t rows = blocks.length[i];
    Tensor state(DType::f32, {1, rows, c.heads_q, c.head_dim});
    std::vector<float> state_lse(static_cast<std::size_t>(c.heads_q * rows),
                                 -std::numeric_limits<float>::infinity());
    for (std::size_t j = 0; j < blocks.begin.size(); ++j) {
      Tensor part(c.dtype, {1, rows, c.heads_q, c.head_dim});
      part.poison();
      std::vector<float> part_lse(state_lse.size());
      detail::block_attention_forward(
          AttentionImpl::flash, sequence_slice(q.view, blocks.begin[i], rows),
          sequence_slice(k.view, blocks.begin[j], blocks.length[j]),
          sequence_slice(v.view, blocks.begin[j], blocks.length[j]), part.view, part_lse.data(),
          options, blocks.begin[i] - blocks.begin[j]);
      Tensor part_f32(DType::f32, part.view.shape);
      part.for_each_index(
          [&](auto a, auto s, auto h, auto d) { part_f32.set(a, s, h, d, part.at(a, s, h, d)); });
      merge_attention_states(state.view, state_lse.data(), part_f32.view, part_lse.data(),
                             state.view, state_lse.data());
    }
    state.for_each_index([&](auto a, auto s, auto h, auto d) {
      assembled.set(a, blocks.begin[i] + s, h, d, state.at(a, s, h, d));
    });
    for (std::int64_t h = 0; h < c.heads_q; ++h) {
      for (std::int64_t s = 0; s < rows; ++s) {
        assembled_lse[static_cast<std::size_t>(h * c.seqlen + blocks.begin[i] + s)] =
            state_lse[static_cast<std::size_t>(h * rows + s)];
      }
    }
  }

  const MaxError error = max_error(assembled, want.out);
  const double g = max_abs_finite(want.out) + max_abs(v);
  const double tolerance = assembled_tolerance(
      single_error, c.dtype, static_cast<std::int64_t>(blocks.begin.size()), p.score_rounding(), g);
  EXPECT_LE(error.value, tolerance)
      << "at flat index " << error.index << ": got " << error.got << ", want " << error.want
      << "; single-call flash error " << single_error;
  for (std::size_t i = 0; i < assembled_lse.size(); ++i) {
    const double expected = want.lse[i];
    if (std::isinf(expected)) {
      ASSERT_EQ(assembled_lse[i], -std::numeric_limits<float>::infinity()) << "lse index " << i;
    } else {
      ASSERT_NEAR(assembled_lse[i], expected, 1e-5 * (1.0 + std::abs(expected)))
          << "lse index " << i;
    }
  }
}

void check_summed_backward(BlockProblem& p) {
  const BlockCase& c = p.c;
  const Tensor &q = p.q, &k = p.k, &v = p.v;
  const AttentionOptions& options = p.options;
  std::mt19937_64& rng = p.rng;
  const Blocks blocks = blocks_of(c);
  Tensor dout(c.dtype, q.view.shape), out(c.dtype, q.view.shape);
  dout.fill_normal(rng);
  std::vector<float> lse(static_cast<std::size_t>(c.heads_q * c.seqlen));
  flash_attention_forward(q.view, k.view, v.view, out.view, lse.data(), options);

  const GradientOracle want = gradient_oracle(dout, q, k, v, out, lse.data(), options);

  std::vector<double> sum_dq(want.dq.size(), 0.0), sum_dk(want.dk.size(), 0.0),
      sum_dv(want.dk.size(), 0.0);
  const std::int64_t heads_kv = c.heads_kv;
  for (std::size_t i = 0; i < blocks.begin.size(); ++i) {
    const std::int64_t rows = blocks.length[i];
    std::vector<float> block_lse(static_cast<std::size_t>(c.heads_q * rows));
    for (std::int64_t h = 0; h < c.heads_q; ++h) {
      for (std::int64_t s = 0; s < rows; ++s) {
        block_lse[static_cast<std::size_t>(h * rows + s)] =
            lse[static_cast<std::size_t>(h * c.seqlen + blocks.begin[i] + s)];
      }
    }
    for (std::size_t j = 0; j < blocks.begin.size(); ++j) {
      const std::int64_t keys = blocks.length[j];
      Tensor part_dq(c.dtype, {1, rows, c.heads_q, c.head_dim});
      Tensor part_dk(c.dtype, {1, keys, heads_kv, c.head_dim});
      Tensor part_dv(c.dtype, {1, keys, heads_kv, c.head_dim});
      part_dq.poison();
      part_dk.poison();
      part_dv.poison();
      detail::block_attention_backward(
          AttentionImpl::flash, sequence_slice(dout.view, blocks.begin[i], rows),
          sequence_slice(q.view, blocks.begin[i], rows),
          sequence_slice(k.view, blocks.begin[j], keys),
          sequence_slice(v.view, blocks.begin[j], keys),
          sequence_slice(out.view, blocks.begin[i], rows), block_lse.data(), part_dq.view,
          part_dk.view, part_dv.view, options, blocks.begin[i] - blocks.begin[j]);
      part_dq.for_each_index([&](auto, auto s, auto h, auto d) {
        sum_dq[static_cast<std::size_t>(((blocks.begin[i] + s) * c.heads_q + h) * c.head_dim +
                                        d)] += part_dq.at(0, s, h, d);
      });
      part_dk.for_each_index([&](auto, auto s, auto h, auto d) {
        const auto at =
            static_cast<std::size_t>(((blocks.begin[j] + s) * heads_kv + h) * c.head_dim + d);
        sum_dk[at] += part_dk.at(0, s, h, d);
        sum_dv[at] += part_dv.at(0, s, h, d);
      });
    }
  }
  const double tolerance = assembled_tolerance(want.single_flash_error, c.dtype,
                                               static_cast<std::int64_t>(blocks.begin.size()),
                                               p.score_rounding(), want.scale_g);
  for (const auto& [name, got, expected] : {std::tuple{"dq", &sum_dq, &want.dq},
                                            {"dk", &sum_dk, &want.dk},
                                            {"dv", &sum_dv, &want.dv}}) {
    double worst = 0.0;
    std::size_t where = 0;
    for (std::size_t e = 0; e < got->size(); ++e) {
      const double error = std::isnan((*got)[e]) ? INFINITY : std::abs((*got)[e] - (*expected)[e]);
      if (error > worst) {
        worst = error;
        where = e;
      }
    }
    EXPECT_LE(worst, tolerance) << name << " at flat index " << where << ": got " << (*got)[where]
                                << ", want " << (*expected)[where] << "; single-call flash error "
                                << want.single_flash_error;
  }
}

class BlockAttention : public ::testing::TestWithParam<BlockCase> {};

TEST_P(BlockAttention, MergedBlocksMatchTheWholeSequence) {
  SCOPED_TRACE(describe(GetParam()) + ", seed " + std::to_string(test_seed()));
  BlockProblem problem(GetParam(), test_seed());
  check_merged_forward(problem);
}

TEST_P(BlockAttention, SummedBlockGradientsMatchTheWholeSequence) {
  SCOPED_TRACE(describe(GetParam()) + ", seed " + std::to_string(test_seed()));
  BlockProblem problem(GetParam(), test_seed());
  check_summed_backward(problem);
}

INSTANTIATE_TEST_SUITE_P(
    Grid, BlockAttention,
    ::testing::Values(BlockCase{129, 4, 2, 64, {37, 80}, true},
                      BlockCase{129, 4, 2, 64, {37, 80}, false},
                      BlockCase{203, 2, 2, 59, {64, 65, 128}, false, 50, 9},
                      BlockCase{203, 2, 1, 40, {100}, true, 30, -1},
                      BlockCase{113, 2, 2, 32, {7, 60}, true, -1, -1, true},
                      BlockCase{113, 2, 2, 32, {56}, false, 20, 20, true, 5.0f},
                      BlockCase{150, 4, 2, 64, {50, 100}, true, -1, -1, false, 0.0f, DType::bf16},
                      BlockCase{150, 4, 2, 64, {75}, false, 30, 0, false, 0.0f, DType::f16}),
    [](const auto& info) { return describe(info.param); });

// Random cases: lengths, cuts, heads, dims, masks, windows, ALiBi, softcap and dtypes drawn
// afresh each run (FLASHATTN_TEST_SEED replays one), forward and backward.
TEST(BlockAttentionProperty, RandomCasesMatchTheWholeSequence) {
  std::mt19937_64 draw(test_seed());
  const auto pick = [&](std::int64_t low, std::int64_t high) {
    return std::uniform_int_distribution<std::int64_t>(low, high)(draw);
  };
  for (int trial = 0; trial < 24; ++trial) {
    BlockCase c;
    c.seqlen = pick(1, 160);
    c.heads_kv = pick(1, 2);
    c.heads_q = c.heads_kv * pick(1, 3);
    c.head_dim = pick(1, 80);
    for (std::int64_t cuts = pick(0, 4); cuts > 0; --cuts) c.cuts.push_back(pick(0, c.seqlen));
    std::sort(c.cuts.begin(), c.cuts.end());
    c.causal = pick(0, 1) == 1;
    c.window_left = pick(0, 2) == 0 ? pick(0, c.seqlen) : -1;
    c.window_right = pick(0, 2) == 0 ? pick(0, c.seqlen) : -1;
    c.alibi = pick(0, 3) == 0;
    c.softcap = pick(0, 3) == 0 ? 4.0f : 0.0f;
    c.dtype = std::array{DType::f32, DType::f32, DType::f16, DType::bf16}[pick(0, 3)];
    const std::uint64_t seed = draw();
    SCOPED_TRACE("trial " + std::to_string(trial) + ": " + describe(c) + ", seed " +
                 std::to_string(test_seed()));
    BlockProblem forward(c, seed);
    check_merged_forward(forward);
    BlockProblem backward(c, seed);
    check_summed_backward(backward);
    if (::testing::Test::HasFailure()) return;
  }
}

// The largest shift of the diagonal the API takes, either way, on every path: under a causal
// mask the keys then lie far behind every row, which sees them all (the plain non-causal result);
// with a window as well, or shifted the other way, far from every row, which sees none (out 0,
// lse −inf; the window's start then lies past the last key, which the standard path once filled
// up to: a fuzz finding). One past the limit is refused before anything is written.
TEST(BlockAttentionEdges, TheLargestShiftsSeeEverythingOrNothing) {
  constexpr std::int64_t kMaxShift = std::int64_t{1} << 59;
  std::mt19937_64 rng(test_seed());
  Tensor q(DType::f32, {1, 9, 2, 16}), k(DType::f32, {1, 13, 2, 16}), v(DType::f32, {1, 13, 2, 16});
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  const std::int64_t lengths = 9 - 13;  // seqlen_q − seqlen_kv
  AttentionOptions causal;
  causal.causal = true;
  AttentionOptions banded = causal;
  banded.window_left = 1000;
  Tensor out(DType::f32, q.view.shape), plain(DType::f32, q.view.shape);
  std::vector<float> lse(18), plain_lse(18);
  for (AttentionImpl impl :
       {AttentionImpl::flash, AttentionImpl::standard, AttentionImpl::reference}) {
    SCOPED_TRACE(impl_name(impl));
    attention_forward(impl, q.view, k.view, v.view, plain.view, plain_lse.data());
    detail::block_attention_forward(impl, q.view, k.view, v.view, out.view, lse.data(), causal,
                                    kMaxShift - lengths);
    EXPECT_EQ(out.bytes, plain.bytes) << "far behind the rows: every key visible";
    EXPECT_EQ(lse, plain_lse);
    for (const std::int64_t offset : {kMaxShift - lengths, -kMaxShift - lengths}) {
      out.poison();
      detail::block_attention_forward(impl, q.view, k.view, v.view, out.view, lse.data(), banded,
                                      offset);
      out.for_each_index(
          [&](auto a, auto s, auto h, auto d) { ASSERT_EQ(out.at(a, s, h, d), 0.0f) << offset; });
      for (float value : lse) ASSERT_EQ(value, -std::numeric_limits<float>::infinity()) << offset;
    }
  }

  out.fill(7.0f);
  for (const std::int64_t refused : {kMaxShift - lengths + 1, -kMaxShift - lengths - 1,
                                     std::numeric_limits<std::int64_t>::max()}) {
    try {
      detail::block_attention_forward(AttentionImpl::flash, q.view, k.view, v.view, out.view,
                                      lse.data(), banded, refused);
      FAIL() << "offset " << refused << " accepted";
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find("query_minus_key_offset"), std::string::npos)
          << error.what();
    }
    EXPECT_EQ(out.at(0, 0, 0, 0), 7.0f) << "written before the error";
  }
}

TEST(BlockAttentionErrors, RefusesWhatBelongsToTheWholeSequence) {
  Tensor q(DType::f32, {1, 8, 2, 16}), k(DType::f32, {1, 8, 2, 16}), v(DType::f32, {1, 8, 2, 16});
  Tensor out(DType::f32, {1, 8, 2, 16});
  std::vector<float> lse(16);
  const std::vector<float> sinks{0.5f, 0.5f};
  AttentionOptions with_sinks;
  with_sinks.sinks = sinks;
  try {
    detail::block_attention_forward(AttentionImpl::flash, q.view, k.view, v.view, out.view,
                                    lse.data(), with_sinks, 8);
    FAIL() << "sinks accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("sinks"), std::string::npos) << error.what();
  }
  try {
    detail::block_attention_backward(AttentionImpl::reference, out.view, q.view, k.view, v.view,
                                     out.view, lse.data(), q.view, k.view, v.view, {}, 0);
    FAIL() << "reference accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("impl: expected flash or standard"), std::string::npos)
        << error.what();
  }
}

}  // namespace
}  // namespace flashattn::testing
