// The FlashAttention path and the standard path against the fp64 reference on fresh random
// inputs, over a grid of shapes that breaks tiling (docs/design.md, "How correctness is checked").
//
// Tolerance, derived rather than guessed:
//  * The standard path must stay inside the first-order forward error bound of fp32 attention:
//    the scores carry u·scale·D·max|q|·max|k| (dot products of length D), the softmax sum and
//    P·V another u·Skv relative (naive sums of Skv terms), each scaled by max|v|; plus one
//    rounding of the output to its dtype. Bound: u32·max|v|·(4·scale·D·max|q|·max|k| + 2·Skv + 16)
//    + u_dtype·max|ref|. It is loose, but any indexing or masking bug is orders of magnitude
//    above it.
//  * The flash path must be within 4x the standard path's measured max error, plus a floor: two
//    roundings of the output dtype at the largest output (both paths end with that rounding, so
//    the standard path can be lucky where the flash path is not), and 4 typical roundings of a
//    score, u32·scale·sqrt(D)·max|q|·max|k| (a length-D fp32 dot product summed in another
//    order), carried to the output by max|v|.
//  * lse: the same rule, with 4 fp32 roundings of |lse| and 4 score roundings as the floor;
//    fully masked rows must be exactly -inf.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>

#include "cpu/flash_decode.hpp"
#include "cpu/kernels/bf16_products.hpp"
#include "cpu/kernels/tile_kernels.hpp"
#include "cpu/kernels/tile_kernels_bf16.hpp"
#include "cpu/tile_sizes.hpp"
#include "test_support.hpp"

namespace flashattn::testing {
namespace {

enum class Layout {
  bshd,    // [B, S, H, D] contiguous
  bhsd,    // the seed's [B, H, S, D] memory seen as [B, S, H, D]
  padded,  // [B, S, H, D] with each (s, h) row padded by 8 elements
};

struct Case {
  std::int64_t batch, seqlen_q, seqlen_kv, heads_q, heads_kv, head_dim;
  bool causal = false;
  std::int64_t window_left = -1, window_right = -1;
  DType dtype = DType::f32;
  int threads = 2;
  Layout layout = Layout::bshd;
  std::int64_t head_dim_v = 0;  // v's and out's head dim; 0: head_dim

  std::int64_t value_dims() const { return head_dim_v > 0 ? head_dim_v : head_dim; }
};

std::string describe(const Case& c) {
  static const char* layouts[] = {"bshd", "bhsd", "padded"};
  std::ostringstream text;
  text << "B" << c.batch << "_Sq" << c.seqlen_q << "_Skv" << c.seqlen_kv << "_Hq" << c.heads_q
       << "_Hkv" << c.heads_kv << "_D" << c.head_dim
       << (c.head_dim_v > 0 ? "_Dv" + std::to_string(c.head_dim_v) : "")
       << (c.causal ? "_causal" : "")
       << (c.window_left >= 0 || c.window_right >= 0
               ? "_win" + std::to_string(c.window_left) + "," + std::to_string(c.window_right)
               : "")
       << "_" << dtype_name(c.dtype) << "_t" << c.threads << "_"
       << layouts[static_cast<int>(c.layout)];
  return text.str();
}

std::array<std::int64_t, 4> strides_for(Layout layout, std::array<std::int64_t, 4> shape) {
  const auto [B, S, H, D] = shape;
  switch (layout) {
    case Layout::bshd:
      return contiguous_strides(shape);
    case Layout::bhsd:
      return {H * S * D, D, S * D, 1};
    case Layout::padded:
      return {S * H * (D + 8), H * (D + 8), D + 8, 1};
  }
  return contiguous_strides(shape);
}

std::vector<Case> make_grid() {
  std::vector<Case> grid;
  const std::int64_t seqlens[] = {1, 2, 3, 7, 64, 113, 127, 128, 129, 203, 255, 1023, 1025};
  const std::int64_t head_dims[] = {32, 40, 59, 64, 80, 96, 111, 128, 256};
  const int thread_counts[] = {1, 2, 3};
  const DType dtypes[] = {DType::f32, DType::f16, DType::bf16};
  const Layout layouts[] = {Layout::bshd, Layout::bhsd, Layout::padded};

  // Square self-attention at every seqlen; head dims, threads, layouts and dtypes rotate so
  // every value of each appears, with and without the causal mask.
  int n = 0;
  for (std::int64_t s : seqlens) {
    for (bool causal : {false, true}) {
      const bool long_sequence = s > 1000;
      Case c{long_sequence ? 1 : 2, s, s, 2, 2, head_dims[n % 9]};
      c.causal = causal;
      c.threads = thread_counts[n % 3];
      c.dtype = dtypes[(n / 3) % 3];
      c.layout = layouts[(n / 2) % 3];
      if (long_sequence) c.head_dim = std::min<std::int64_t>(c.head_dim, 64);
      grid.push_back(c);
      ++n;
    }
  }
  // Every head dim at an awkward seqlen.
  for (std::int64_t d : head_dims) {
    Case c{1, 129, 129, 2, 1, d};
    c.causal = d % 2 == 0;
    c.threads = thread_counts[d % 3];
    grid.push_back(c);
  }
  // seqlen_q != seqlen_kv both ways: a query block against a long KV cache and the reverse,
  // where the bottom-right causal alignment leaves the first rows fully masked.
  const std::pair<std::int64_t, std::int64_t> uneven[] = {
      {113, 203}, {203, 113}, {1, 239}, {799, 3}, {3, 799}, {1, 1025}, {64, 129}, {129, 64}};
  for (const auto& [sq, skv] : uneven) {
    for (bool causal : {false, true}) {
      Case c{1, sq, skv, 4, 2, 64};
      c.causal = causal;
      c.threads = causal ? 3 : 1;
      c.layout = causal ? Layout::bhsd : Layout::bshd;
      grid.push_back(c);
    }
  }
  // Sliding windows, alone and with the causal mask, on square and uneven shapes.
  const std::pair<std::int64_t, std::int64_t> windows[] = {{0, 0},  {16, 0}, {32, 8},
                                                           {-1, 4}, {7, -1}, {200, 200}};
  int w = 0;
  for (const auto& [left, right] : windows) {
    for (const auto& [sq, skv] : {std::pair<std::int64_t, std::int64_t>{255, 255}, {113, 203}}) {
      Case c{1, sq, skv, 2, 2, 40};
      c.window_left = left;
      c.window_right = right;
      c.causal = w % 2 == 1;
      c.threads = thread_counts[w % 3];
      c.dtype = dtypes[w % 3];
      grid.push_back(c);
      ++w;
    }
  }
  // A window under GQA over several Q blocks: the chunks of a partly visible block start and
  // stop inside each query head's rows, and each computes its own range of keys.
  for (const auto& [left, right] : {std::pair<std::int64_t, std::int64_t>{40, 0}, {23, 17}}) {
    Case c{1, 300, 300, 6, 2, 64};
    c.window_left = left;
    c.window_right = right;
    c.threads = 3;
    grid.push_back(c);
  }
  // GQA and MQA.
  for (const auto& [hq, hkv] :
       {std::pair<std::int64_t, std::int64_t>{4, 2}, {6, 1}, {8, 8}, {8, 4}}) {
    Case c{2, 127, 130, hq, hkv, 64};
    c.causal = hq != hkv;
    c.threads = 3;
    c.layout = Layout::padded;
    grid.push_back(c);
  }
  // A value head dim unlike the key head dim (DeepSeek's MLA: 192/128 in prefill, 576/512 in
  // decode), smaller and larger, whole and ragged numbers of vectors, every dtype and layout,
  // causal both alignments, windows and GQA.
  const std::pair<std::int64_t, std::int64_t> value_dims[] = {
      {192, 128}, {128, 64}, {64, 128}, {40, 59}, {59, 17}, {96, 40}, {16, 111}, {576, 512}};
  int v = 0;
  for (const auto& [d, dv] : value_dims) {
    for (const auto& [sq, skv] :
         {std::pair<std::int64_t, std::int64_t>{129, 129}, {70, 203}, {203, 70}}) {
      Case c{v % 2 == 0 ? 2 : 1, sq, skv, 4, v % 3 == 0 ? 1 : 2, d};
      c.head_dim_v = dv;
      c.causal = v % 4 != 3;
      if (v % 5 == 4) {
        c.window_left = 23;
        c.window_right = 5;
      }
      c.threads = thread_counts[v % 3];
      c.dtype = dtypes[(v / 2) % 3];
      c.layout = layouts[v % 3];
      if (d == 576) {
        c.seqlen_q = std::min<std::int64_t>(sq, 70);
        c.seqlen_kv = std::min<std::int64_t>(skv, 129);
      }
      grid.push_back(c);
      ++v;
    }
  }
  // Few Q blocks against many keys: the keys cut into chunks merged at the end
  // (flash_forward.cpp). MLA's absorbed decode (128 query heads on one latent KV head, 576/512,
  // one and two positions), a GQA group beyond the decode path, a causal prefill with a window.
  {
    Case mla{1, 1, 3000, 128, 1, 576};
    mla.head_dim_v = 512;
    mla.dtype = DType::bf16;
    grid.push_back(mla);
    mla.seqlen_q = 2;
    mla.seqlen_kv = 1300;
    mla.causal = true;
    mla.dtype = DType::f32;
    mla.threads = 3;
    grid.push_back(mla);
    Case group{1, 1, 2100, 64, 2, 96};
    group.head_dim_v = 40;
    group.dtype = DType::f16;
    grid.push_back(group);
    Case prefill{1, 200, 2200, 1, 1, 48};
    prefill.causal = true;
    prefill.window_left = 1500;
    prefill.window_right = 0;
    prefill.layout = Layout::bhsd;
    grid.push_back(prefill);
  }
  return grid;
}

MaxError max_lse_error(const std::vector<float>& lse, const ReferenceResult& ref) {
  MaxError worst;
  for (std::size_t i = 0; i < lse.size(); ++i) {
    const double got = lse[i], want = ref.lse[i];
    double error = std::abs(got - want);
    if (std::isinf(want)) error = got == want ? 0.0 : INFINITY;
    if (std::isnan(got)) error = INFINITY;
    if (error > worst.value || worst.index < 0)
      worst = {error, static_cast<std::int64_t>(i), got, want};
  }
  return worst;
}

void check_against_reference(const Case& c) {
  const std::uint64_t seed = test_seed() ^ std::hash<std::string>{}(describe(c));
  std::mt19937_64 rng(seed);
  const std::array<std::int64_t, 4> q_shape{c.batch, c.seqlen_q, c.heads_q, c.head_dim};
  const std::array<std::int64_t, 4> kv_shape{c.batch, c.seqlen_kv, c.heads_kv, c.head_dim};
  const std::array<std::int64_t, 4> v_shape{c.batch, c.seqlen_kv, c.heads_kv, c.value_dims()};
  const std::array<std::int64_t, 4> out_shape{c.batch, c.seqlen_q, c.heads_q, c.value_dims()};
  Tensor q(c.dtype, q_shape, strides_for(c.layout, q_shape));
  Tensor k(c.dtype, kv_shape, strides_for(c.layout, kv_shape));
  Tensor v(c.dtype, v_shape, strides_for(c.layout, v_shape));
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);

  AttentionOptions options;
  options.causal = c.causal;
  options.window_left = c.window_left;
  options.window_right = c.window_right;
  options.num_threads = c.threads;
  const ReferenceResult ref = reference(q, k, v, options);

  auto run = [&](AttentionImpl impl, std::vector<float>& lse) {
    Tensor out(c.dtype, out_shape, strides_for(c.layout, out_shape));
    out.poison();
    lse.assign(static_cast<std::size_t>(c.batch * c.heads_q * c.seqlen_q), NAN);
    attention_forward(impl, q.view, k.view, v.view, out.view, lse.data(), options);
    return out;
  };
  std::vector<float> standard_lse, flash_lse;
  const Tensor standard_out = run(AttentionImpl::standard, standard_lse);
  const Tensor flash_out = run(AttentionImpl::flash, flash_lse);

  const double u32 = unit_roundoff(DType::f32), u_out = unit_roundoff(c.dtype);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  const double max_out = max_abs_finite(ref.out), max_lse = max_abs_finite(ref.lse);
  const double standard_bound =
      u32 * max_abs(v) *
          (4.0 * scale * c.head_dim * max_abs(q) * max_abs(k) + 2.0 * c.seqlen_kv + 16.0) +
      u_out * max_out;

  const MaxError standard_error = max_error(standard_out, ref.out);
  const MaxError flash_error = max_error(flash_out, ref.out);
  const double score_rounding =
      u32 * scale * std::sqrt(static_cast<double>(c.head_dim)) * max_abs(q) * max_abs(k);
  const double flash_bound = 4.0 * standard_error.value + 2.0 * u_out * max_out +
                             4.0 * score_rounding * max_abs(v) +
                             probability_rounding_bound(c.dtype, max_abs(v));
  const std::string context = describe(c) + " seed " + std::to_string(seed);

  EXPECT_LE(standard_error.value, standard_bound)
      << context << ": standard out[" << standard_error.index << "] = " << standard_error.got
      << ", reference " << standard_error.want;
  EXPECT_LE(flash_error.value, flash_bound)
      << context << ": flash out[" << flash_error.index << "] = " << flash_error.got
      << ", reference " << flash_error.want << " (standard max error " << standard_error.value
      << ")";

  const MaxError standard_lse_error = max_lse_error(standard_lse, ref);
  const MaxError flash_lse_error = max_lse_error(flash_lse, ref);
  EXPECT_LE(standard_lse_error.value, standard_bound + 4.0 * u32 * max_lse)
      << context << ": standard lse[" << standard_lse_error.index
      << "] = " << standard_lse_error.got << ", reference " << standard_lse_error.want;
  EXPECT_LE(flash_lse_error.value,
            4.0 * standard_lse_error.value + 4.0 * u32 * max_lse + 4.0 * score_rounding)
      << context << ": flash lse[" << flash_lse_error.index << "] = " << flash_lse_error.got
      << ", reference " << flash_lse_error.want;
}

// A test name from a case: describe() with every non-alphanumeric character as '_'.
std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string name = describe(info.param);
  std::replace_if(
      name.begin(), name.end(), [](char ch) { return !std::isalnum(ch); }, '_');
  return name;
}

class AttentionVsReference : public ::testing::TestWithParam<Case> {};

TEST_P(AttentionVsReference, FlashAndStandardMatchFp64Reference) {
  check_against_reference(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Grid, AttentionVsReference, ::testing::ValuesIn(make_grid()), case_name);

// Every SIMD target compiled into the library that this CPU runs, forced in turn, on shapes
// with ragged edges in every tile dimension (rows, keys and head_dim not multiples of 4 or 16).
TEST(AttentionVsReferencePerTarget, EveryCompiledTargetMatches) {
  detail::cpu::force_simd_target(0);
  const std::vector<detail::cpu::SimdTarget> targets = detail::cpu::supported_simd_targets();
  ASSERT_FALSE(targets.empty());
  for (const auto& target : targets) {
    SCOPED_TRACE("SIMD target " + target.name);
    detail::cpu::force_simd_target(target.id);
    ASSERT_EQ(detail::cpu::active_simd_target(), target.name);
    Case ragged{2, 131, 203, 4, 2, 59};
    ragged.causal = true;
    ragged.threads = 3;
    check_against_reference(ragged);
    Case windowed{1, 67, 67, 2, 1, 111};
    windowed.window_left = 9;
    windowed.window_right = 3;
    windowed.dtype = DType::bf16;
    windowed.layout = Layout::padded;
    check_against_reference(windowed);
    Case wide{1, 70, 40, 2, 2, 256};
    wide.dtype = DType::f16;
    check_against_reference(wide);
    Case value_dims{1, 77, 150, 4, 2, 59};
    value_dims.head_dim_v = 37;
    value_dims.causal = true;
    check_against_reference(value_dims);
  }
  detail::cpu::force_simd_target(0);
}

// bf16 inputs run through AMX tiles, vdpbf16ps or the widening fp32 kernels, whichever this CPU
// supports (the grid above takes the default): check every one.
TEST(AttentionVsReferenceBf16, EveryProductPathMatches) {
  for (detail::cpu::Bf16Products products : detail::cpu::supported_bf16_products()) {
    detail::cpu::force_bf16_products(products);
    SCOPED_TRACE(detail::cpu::bf16_products_name(products));
    Case ragged{2, 131, 203, 4, 2, 59};
    ragged.causal = true;
    ragged.dtype = DType::bf16;
    ragged.threads = 3;
    check_against_reference(ragged);
    Case windowed{1, 129, 64, 2, 2, 128};
    windowed.window_left = 17;
    windowed.window_right = 5;
    windowed.dtype = DType::bf16;
    windowed.layout = Layout::bhsd;
    check_against_reference(windowed);
    // head_dim 80 and 17 keys: reductions that are not whole AMX tile rows (32 bf16), a last
    // row block of 1..16 rows, and keys that end inside a 16-column tile.
    Case ragged_tiles{1, 49, 17, 3, 1, 80};
    ragged_tiles.dtype = DType::bf16;
    check_against_reference(ragged_tiles);
    Case long_keys{1, 33, 301, 1, 1, 96};
    long_keys.dtype = DType::bf16;
    long_keys.causal = true;
    check_against_reference(long_keys);
    // head_dim 1 padded to a whole tile row of 32 (the fuzzer's finding of the P rounding,
    // fuzz/corpus/attention/regression_bf16_amx_rounded_probabilities).
    Case one_dim{2, 12, 39, 2, 2, 1};
    one_dim.dtype = DType::bf16;
    check_against_reference(one_dim);
  }
  detail::cpu::force_bf16_products(std::nullopt);
}

// An infinite value poisons only the rows that see its key, on every bf16 product path (the
// masked blocks of the others must not compute 0 · inf).
TEST(AttentionVsReferenceBf16, InfiniteValueReachesOnlyRowsThatSeeIt) {
  std::mt19937_64 rng(test_seed());
  const std::int64_t S = 300, D = 32, bad_key = 140;
  Tensor q(DType::bf16, {1, S, 1, D}), k(DType::bf16, {1, S, 1, D}), v(DType::bf16, {1, S, 1, D});
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  v.set(0, bad_key, 0, 3, INFINITY);
  AttentionOptions options;
  options.causal = true;
  for (detail::cpu::Bf16Products products : detail::cpu::supported_bf16_products()) {
    detail::cpu::force_bf16_products(products);
    Tensor out(DType::bf16, {1, S, 1, D});
    out.poison();
    flash_attention_forward(q.view, k.view, v.view, out.view, nullptr, options);
    for (std::int64_t row = 0; row < S; ++row) {
      EXPECT_EQ(std::isfinite(out.at(0, row, 0, 3)), row < bad_key)
          << "row " << row << " (" << detail::cpu::bf16_products_name(products) << ")";
      EXPECT_TRUE(std::isfinite(out.at(0, row, 0, 4))) << "row " << row;
    }
  }
  detail::cpu::force_bf16_products(std::nullopt);
}

// The bf16 products (AMX, vdpbf16ps) count a subnormal bf16 as zero; the flash path multiplies
// each pair of a Q block and a K/V block where either holds one in fp32 instead, so denormals
// are used (README). Here only some blocks hold them, so both kinds of tiles meet in one call:
//  * v subnormal on keys [256, 384) and 0 elsewhere: the outputs are denormal, 0 if flushed
//    (384 positions: no later K/V block follows whose bf16 products would flush the
//    accumulator's denormal sums, which README allows);
//  * q subnormal at positions [300, 340) against k near 2^125 (q elsewhere near 2^-120, so no
//    score overflows): scores of order 1 there, uniform weights if flushed.
// Every product path, against the reference, and bitwise identical for 1, 2, 3, 7 threads.
TEST(AttentionVsReferenceBf16, SubnormalsInSomeBlocksAreNotFlushed) {
  std::mt19937_64 rng(test_seed() ^ 31);
  std::uniform_int_distribution<int> integer(-100, 100);
  const std::int64_t S = 700, H = 2, D = 64;
  const double smallest_subnormal = 0x1p-133;
  Tensor q(DType::bf16, {1, S, H, D}), k(DType::bf16, {1, S, H, D}), v(DType::bf16, {1, S, H, D});
  Tensor q_scaled(DType::bf16, {1, S, H, D}), k_scaled(DType::bf16, {1, S, H, D});
  Tensor v_subnormal(DType::bf16, {1, S, H, D});
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  q.for_each_index([&](auto a, auto pos, auto h, auto d) {
    const bool subnormal = pos >= 300 && pos < 340;
    q_scaled.set(a, pos, h, d,
                 subnormal ? static_cast<float>(integer(rng) * smallest_subnormal)
                           : std::ldexp(q.at(a, pos, h, d), -120));
    k_scaled.set(a, pos, h, d, std::ldexp(k.at(a, pos, h, d), 125));
    v_subnormal.set(
        a, pos, h, d,
        pos >= 256 && pos < 384 ? static_cast<float>(integer(rng) * smallest_subnormal) : 0.0f);
  });
  struct Problem {
    const Tensor &q, &k, &v;
    const char* what;
  };
  const std::int64_t S_v = 384;
  Tensor q_short(DType::bf16, {1, S_v, H, D}), k_short(DType::bf16, {1, S_v, H, D}),
      v_short(DType::bf16, {1, S_v, H, D});
  q_short.for_each_index([&](auto a, auto pos, auto h, auto d) {
    q_short.set(a, pos, h, d, q.at(a, pos, h, d));
    k_short.set(a, pos, h, d, k.at(a, pos, h, d));
    v_short.set(a, pos, h, d, v_subnormal.at(a, pos, h, d));
  });
  const Problem problems[] = {{q_short, k_short, v_short, "subnormal v"},
                              {q_scaled, k_scaled, v, "subnormal q"}};
  AttentionOptions options;
  options.causal = true;
  for (const Problem& problem : problems) {
    const ReferenceResult ref = reference(problem.q, problem.k, problem.v, options);
    double max_q = 0.0, max_k = 0.0, max_v = 0.0;
    for (auto [tensor, largest] :
         {std::pair{&problem.q, &max_q}, {&problem.k, &max_k}, {&problem.v, &max_v}}) {
      tensor->for_each_index([&, t = tensor, m = largest](auto a, auto b, auto h, auto d) {
        *m = std::max<double>(*m, std::abs(t->at(a, b, h, d)));
      });
    }
    const double u32 = unit_roundoff(DType::f32), u_out = unit_roundoff(DType::bf16);
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    const double Skv = static_cast<double>(problem.k.view.shape[1]);
    const double bound = u32 * max_v * (4.0 * scale * D * max_q * max_k + 2.0 * Skv + 16.0) +
                         probability_rounding_bound(DType::bf16, max_v) +
                         (Skv + D + 16.0) * 0x1p-149 + 0x1p-134;  // fp32 and bf16 denormal floors
    for (detail::cpu::Bf16Products products : detail::cpu::supported_bf16_products()) {
      detail::cpu::force_bf16_products(products);
      std::vector<float> first;
      for (int threads : {1, 2, 3, 7}) {
        options.num_threads = threads;
        Tensor out(DType::bf16, problem.q.view.shape);
        out.poison();
        flash_attention_forward(problem.q.view, problem.k.view, problem.v.view, out.view, nullptr,
                                options);
        std::vector<float> got;
        std::int64_t flat = 0, mismatches = 0;
        out.for_each_index([&](auto a, auto b, auto h, auto d) {
          const double want = ref.out[flat++];
          got.push_back(out.at(a, b, h, d));
          if (!(std::abs(got.back() - want) <= bound + u_out * std::abs(want)) &&
              ++mismatches <= 3) {
            ADD_FAILURE() << problem.what << " (" << detail::cpu::bf16_products_name(products)
                          << ", " << threads << " threads): out[" << flat - 1
                          << "] = " << got.back() << ", reference " << want;
          }
        });
        if (first.empty()) first = got;
        EXPECT_EQ(0, std::memcmp(got.data(), first.data(), got.size() * sizeof(float)))
            << problem.what << " (" << detail::cpu::bf16_products_name(products) << "): " << threads
            << " threads differ from 1";
      }
    }
  }
  detail::cpu::force_bf16_products(std::nullopt);
}

// A task of the flash path holds up to 4 Q blocks that share each packed K/V block; with one
// thread and few heads the tasks take several blocks each, blocks that see different key ranges
// under a causal mask or a window (and, with 128 positions per block of a GQA pair, Sq = 700
// makes 6 blocks of which the last is ragged).
TEST(AttentionVsReferenceFlash, TasksOfSeveralQueryBlocks) {
  Case causal{1, 700, 900, 4, 2, 64};
  causal.causal = true;
  causal.threads = 1;
  check_against_reference(causal);
  Case windowed{1, 700, 900, 4, 2, 40};
  windowed.window_left = 300;
  windowed.window_right = 40;
  windowed.threads = 1;
  windowed.dtype = DType::bf16;
  check_against_reference(windowed);
}

// Long reductions: scores of 16384 head dims, rows of 65536 keys. The product kernels sum them
// in partial sums (cpu/kernels/tile_kernels.hpp), and the flash path must then be as accurate as
// the standard path to within the grid's factor 4 with a floor of only one rounding of the output
// (u·max|out|) and of lse: the grid's floor, which carries 4 score roundings to the output by
// max|v|, would let pass what one chain through every key did (`flashattn demo`, 262144 keys:
// 2.25e-7 against the standard path's 2.3e-8, with max|out| near 0.01).
void expect_as_accurate_as_standard(const std::array<std::int64_t, 4>& q_shape,
                                    const std::array<std::int64_t, 4>& kv_shape) {
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("FLASHATTN_TEST_SEED=" + std::to_string(seed) + ", D " + std::to_string(q_shape[3]) +
               ", Skv " + std::to_string(kv_shape[1]));
  std::mt19937_64 rng(seed);
  Tensor q(DType::f32, q_shape), k(DType::f32, kv_shape), v(DType::f32, kv_shape);
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  const AttentionOptions options;
  const ReferenceResult ref = reference(q, k, v, options);
  const double u32 = unit_roundoff(DType::f32);
  auto run = [&](AttentionImpl impl, std::vector<float>& lse) {
    Tensor out(DType::f32, q_shape);
    out.poison();
    lse.assign(static_cast<std::size_t>(q_shape[0] * q_shape[2] * q_shape[1]), NAN);
    attention_forward(impl, q.view, k.view, v.view, out.view, lse.data(), options);
    return out;
  };
  std::vector<float> standard_lse, flash_lse;
  const MaxError standard_error = max_error(run(AttentionImpl::standard, standard_lse), ref.out);
  const MaxError flash_error = max_error(run(AttentionImpl::flash, flash_lse), ref.out);
  EXPECT_LE(flash_error.value, 4.0 * standard_error.value + u32 * max_abs_finite(ref.out))
      << "flash out[" << flash_error.index << "] = " << flash_error.got << ", reference "
      << flash_error.want << " (standard max error " << standard_error.value << ")";
  const MaxError standard_lse_error = max_lse_error(standard_lse, ref);
  const MaxError flash_lse_error = max_lse_error(flash_lse, ref);
  EXPECT_LE(flash_lse_error.value,
            4.0 * standard_lse_error.value + 4.0 * u32 * max_abs_finite(ref.lse))
      << "flash lse[" << flash_lse_error.index << "] = " << flash_lse_error.got << ", reference "
      << flash_lse_error.want << " (standard max error " << standard_lse_error.value << ")";
}

TEST(AttentionVsReferenceFlash, LongReductionsAsAccurateAsTheStandardPath) {
  expect_as_accurate_as_standard({1, 64, 2, 16384}, {1, 64, 2, 16384});
  expect_as_accurate_as_standard({1, 48, 2, 64}, {1, 65536, 2, 64});
}

// The flash forward's out and lse on the same inputs with 1, 2, 3 and 7 threads: the same bits.
void expect_same_bits_for_any_thread_count(const std::array<std::int64_t, 4>& q_shape,
                                           const std::array<std::int64_t, 4>& kv_shape,
                                           AttentionOptions options) {
  std::mt19937_64 rng(test_seed());
  Tensor q(DType::f32, q_shape), k(DType::f32, kv_shape), v(DType::f32, kv_shape);
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  std::vector<std::vector<std::uint8_t>> outputs;
  std::vector<std::vector<float>> lses;
  for (int threads : {1, 2, 3, 7}) {
    Tensor out(DType::f32, q_shape);
    out.poison();
    std::vector<float> lse(static_cast<std::size_t>(q_shape[0] * q_shape[1] * q_shape[2]), NAN);
    options.num_threads = threads;
    flash_attention_forward(q.view, k.view, v.view, out.view, lse.data(), options);
    outputs.push_back(out.bytes);
    lses.push_back(lse);
  }
  for (std::size_t i = 1; i < outputs.size(); ++i) {
    EXPECT_EQ(outputs[i], outputs[0]) << "output differs for thread-count run " << i;
    EXPECT_EQ(0, std::memcmp(lses[i].data(), lses[0].data(), lses[0].size() * sizeof(float)))
        << "lse differs for thread-count run " << i;
  }
}

// Each task owns its output rows, so the thread count must not change a single bit. The thread
// count also sets how many Q blocks share a task here (3, 2 and 1 block for 1, 2 and 3+
// threads), which must not matter either.
TEST(FlashDeterminism, BitwiseIdenticalForAnyThreadCount) {
  AttentionOptions causal;
  causal.causal = true;
  SCOPED_TRACE("causal");
  expect_same_bits_for_any_thread_count({2, 301, 4, 72}, {2, 517, 2, 72}, causal);
  AttentionOptions windowed;
  windowed.window_left = 200;
  windowed.window_right = 30;
  SCOPED_TRACE("window (200, 30)");
  expect_same_bits_for_any_thread_count({2, 301, 4, 72}, {2, 517, 2, 72}, windowed);
}

// A call of few Q blocks against many keys cuts its keys into chunks, merged at the end
// (flash_forward.cpp): from the shape, not the threads. 48 query heads on one KV head (MLA's
// absorbed decode, more rows per KV head than the decode path takes), and a short prefill.
TEST(FlashDeterminism, KeyChunksBitwiseIdenticalForAnyThreadCount) {
  Tensor q(DType::f32, {1, 1, 48, 64}), kv(DType::f32, {1, 3000, 1, 64}),
      out(DType::f32, {1, 1, 48, 64});
  ASSERT_GT(detail::cpu::flash_forward_key_chunks(
                detail::make_params("test", q.view, kv.view, kv.view, out.view, nullptr, {})),
            1);
  expect_same_bits_for_any_thread_count({1, 1, 48, 64}, {1, 3000, 1, 64}, {});
  AttentionOptions causal;
  causal.causal = true;
  SCOPED_TRACE("causal prefill");
  expect_same_bits_for_any_thread_count({1, 300, 1, 32}, {1, 2500, 1, 32}, causal);
}

// Decoding: a few query rows per KV head (group · Sq <= 32) go through cpu/flash_decode.cpp,
// which reads K and V in memory order and splits the keys into chunks of 128 or more (up to 16
// per batch entry), merged at the end. Every mask, GQA groups of 1 to 8, every dtype, ragged head
// dims and padded rows; one key, fewer keys than a score tile, several tiles, several chunks; 1 to
// 32 rows per KV head.
std::vector<Case> make_decode_grid() {
  struct Heads {
    std::int64_t q, kv;
  };
  const Heads heads[] = {{2, 2}, {8, 2}, {6, 2}, {8, 1}, {32, 1}};
  const std::int64_t key_counts[] = {1, 19, 700, 5000};
  const std::int64_t head_dims[] = {59, 128, 40, 96};
  const int thread_counts[] = {1, 2, 3};
  const DType dtypes[] = {DType::f32, DType::f16, DType::bf16};
  const Layout layouts[] = {Layout::bshd, Layout::bhsd, Layout::padded};
  std::vector<Case> grid;
  int n = 0;
  for (const std::int64_t sq : {1, 2, 3}) {
    for (const Heads h : heads) {
      if (h.q / h.kv * sq > 32) continue;
      for (const std::int64_t skv : key_counts) {
        Case c{sq == 1 ? 2 : 1, sq, skv, h.q, h.kv, head_dims[n % 4]};
        switch (n % 4) {
          case 1:
            c.causal = true;
            break;
          case 2:
            c.window_left = 100;
            c.window_right = 0;
            break;
          case 3:
            c.window_left = 30;
            c.window_right = 5;
            break;
        }
        c.threads = thread_counts[n % 3];
        c.dtype = dtypes[(n / 3) % 3];
        c.layout = layouts[(n / 2) % 3];
        grid.push_back(c);
        ++n;
      }
    }
  }
  // Value head dims unlike the key head dim: MLA's absorbed decode (576/512, every query head on
  // one KV head), and ragged pairs either way.
  const std::pair<std::int64_t, std::int64_t> value_dims[] = {{576, 512}, {59, 96}, {128, 40}};
  for (const auto& [d, dv] : value_dims) {
    for (const std::int64_t sq : {1, 2}) {
      Case c{1, sq, sq == 1 ? 700 : 5000, d == 576 ? 16 : 8, d == 576 ? 1 : 2, d};
      c.head_dim_v = dv;
      c.causal = sq == 2;
      c.threads = thread_counts[n % 3];
      c.dtype = dtypes[n % 3];
      c.layout = layouts[n % 3];
      grid.push_back(c);
      ++n;
    }
  }
  return grid;
}

class DecodeVsReference : public ::testing::TestWithParam<Case> {};

TEST_P(DecodeVsReference, FlashAndStandardMatchFp64Reference) {
  const Case& c = GetParam();
  // The case takes the decode path: this test's coverage must not slip away unnoticed.
  Tensor q(c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.head_dim});
  Tensor k(c.dtype, {c.batch, c.seqlen_kv, c.heads_kv, c.head_dim});
  Tensor v(c.dtype, {c.batch, c.seqlen_kv, c.heads_kv, c.value_dims()});
  Tensor out(c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.value_dims()});
  AttentionOptions options;
  options.causal = c.causal;
  options.window_left = c.window_left;
  options.window_right = c.window_right;
  ASSERT_TRUE(detail::cpu::use_flash_decode(
      detail::make_params("test", q.view, k.view, v.view, out.view, nullptr, options)));
  check_against_reference(c);
}

INSTANTIATE_TEST_SUITE_P(Grid, DecodeVsReference, ::testing::ValuesIn(make_decode_grid()),
                         case_name);

// The decode path on every SIMD target: dot_rows and axpy_rows on fp32, bf16 and f16 rows
// (widened in registers, or by the scalar conversion for f16 without F16C), ragged head dims.
TEST(DecodeVsReferencePerTarget, EveryCompiledTargetMatches) {
  on_every_target([] {
    Case gqa{2, 1, 1300, 8, 2, 59};
    gqa.threads = 3;
    check_against_reference(gqa);
    Case causal{1, 2, 700, 4, 4, 128};
    causal.causal = true;
    causal.dtype = DType::bf16;
    check_against_reference(causal);
    Case half{2, 1, 900, 8, 2, 64};
    half.dtype = DType::f16;
    half.layout = Layout::bhsd;
    check_against_reference(half);
    Case latent{1, 1, 600, 16, 1, 576};
    latent.head_dim_v = 512;
    latent.dtype = DType::bf16;
    check_against_reference(latent);
    Case ragged_values{1, 1, 400, 4, 2, 64};
    ragged_values.head_dim_v = 45;
    check_against_reference(ragged_values);
  });
}

// The decode path's chunks follow from the shape, not the threads: the same bits for any
// thread count, with GQA, a window and a causal mask on two positions.
TEST(FlashDeterminism, DecodeBitwiseIdenticalForAnyThreadCount) {
  AttentionOptions causal;
  causal.causal = true;
  SCOPED_TRACE("causal");
  expect_same_bits_for_any_thread_count({1, 2, 8, 64}, {1, 3000, 2, 64}, causal);
  AttentionOptions windowed;
  windowed.window_left = 1700;
  windowed.window_right = 0;
  SCOPED_TRACE("window (1700, 0)");
  expect_same_bits_for_any_thread_count({1, 2, 8, 64}, {1, 3000, 2, 64}, windowed);
}

// Decoding against a cache allocated for more tokens than it holds: k and v are views of the
// first S of Smax rows, with the strides of the whole buffer, and the rows past S are NaN. The
// decode path must read the S rows and no other: the same bits as on contiguous copies of them.
TEST(FlashDecode, PreallocatedCacheReadsOnlyTheFilledRows) {
  std::mt19937_64 rng(test_seed());
  constexpr std::int64_t kBatch = 2, kHeadsQ = 8, kHeadsKv = 2, kFilled = 517, kCapacity = 600;
  for (const DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    for (const std::int64_t head_dim : {std::int64_t{64}, std::int64_t{59}}) {
      SCOPED_TRACE(::testing::Message()
                   << dtype_name(dtype) << ", head_dim " << head_dim << ", seed " << test_seed());
      const std::array<std::int64_t, 4> q_shape{kBatch, 1, kHeadsQ, head_dim};
      const std::array<std::int64_t, 4> filled{kBatch, kFilled, kHeadsKv, head_dim};
      Tensor q(dtype, q_shape);
      q.fill_normal(rng);
      Tensor k_cache(dtype, {kBatch, kCapacity, kHeadsKv, head_dim});
      Tensor v_cache(dtype, {kBatch, kCapacity, kHeadsKv, head_dim});
      Tensor k(dtype, filled), v(dtype, filled);
      for (Tensor* cache : {&k_cache, &v_cache}) {
        cache->fill_normal(rng);
        cache->for_each_index([&](auto b, auto s, auto h, auto d) {
          if (s >= kFilled) cache->set(b, s, h, d, NAN);
        });
      }
      k.for_each_index([&](auto b, auto s, auto h, auto d) {
        k.set(b, s, h, d, k_cache.at(b, s, h, d));
        v.set(b, s, h, d, v_cache.at(b, s, h, d));
      });
      const ConstTensorView k_view{k_cache.view.data, dtype, filled, k_cache.view.strides};
      const ConstTensorView v_view{v_cache.view.data, dtype, filled, v_cache.view.strides};

      AttentionOptions options;
      options.causal = true;
      Tensor out_cache(dtype, q_shape), out(dtype, q_shape);
      out_cache.poison();
      out.poison();
      std::vector<float> lse_cache(kBatch * kHeadsQ, NAN), lse(kBatch * kHeadsQ, NAN);
      ASSERT_TRUE(detail::cpu::use_flash_decode(
          detail::make_params("test", q.view, k_view, v_view, out_cache.view, nullptr, options)));
      flash_attention_forward(q.view, k_view, v_view, out_cache.view, lse_cache.data(), options);
      flash_attention_forward(q.view, k.view, v.view, out.view, lse.data(), options);
      EXPECT_EQ(out_cache.bytes, out.bytes);
      EXPECT_EQ(std::memcmp(lse_cache.data(), lse.data(), lse.size() * sizeof(float)), 0);
      EXPECT_FALSE(std::isnan(out.at(0, 0, 0, 0)));
    }
  }
}

}  // namespace
}  // namespace flashattn::testing
