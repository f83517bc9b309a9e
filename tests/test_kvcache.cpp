// kvcache_attention_forward (flashattn/kvcache.hpp): ragged batches against a dense and a paged
// cache with rows appended in place, against the fp64 reference over each sequence's keys; dense
// and paged bitwise the same; the cache written where it should be and nowhere else; bad input.
//
// Tolerance: as test_attention_vs_reference.cpp's bound for the standard path, per sequence:
// u32·max|v|·(4·scale·D·max|q|·max|k| + 2·L + 16) on top of one rounding of the output to its
// dtype (u_out·max|ref|), plus the rounding of the probabilities to a 16-bit q's dtype where the
// products take them in it (probability_rounding_bound). The lse: the scores' roundings
// (4u32·scale·D·max|q|·max|k|), the sum's (2u32·L) and 4 roundings of |lse|. Rows that see no
// key must be exactly 0 with lse −inf.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "flashattn/kvcache.hpp"
#include "test_support.hpp"

namespace flashattn::testing {
namespace {

constexpr double kU32 = 0x1p-24;

struct CacheCase {
  std::vector<std::int32_t> cached;  // cache_seqlens, one per sequence
  std::int64_t seqlen_q, seqlen_new, heads_q, heads_kv, head_dim, capacity;
  std::int64_t page_size;  // of the paged copy
  bool causal = false;
  std::int64_t window_left = -1, window_right = -1;
  DType q_dtype = DType::f32, cache_dtype = DType::f32, new_dtype = DType::f32;
  AttentionImpl impl = AttentionImpl::flash;
};

std::string case_name(const CacheCase& c) {
  std::ostringstream name;
  name << "B" << c.cached.size() << "_Sq" << c.seqlen_q << "_new" << c.seqlen_new << "_Hq"
       << c.heads_q << "_Hkv" << c.heads_kv << "_D" << c.head_dim << "_page" << c.page_size
       << (c.causal ? "_causal" : "");
  if (c.window_left >= 0 || c.window_right >= 0) {
    name << "_win" << c.window_left << "_" << c.window_right;
  }
  name << "_q" << dtype_name(c.q_dtype) << "_cache" << dtype_name(c.cache_dtype) << "_new"
       << dtype_name(c.new_dtype) << "_" << impl_name(c.impl);
  return name.str();
}

// A cache of `batch` sequences of `capacity` rows: dense [batch, capacity, Hkv, D] and the same
// rows in pages of page_size, the pages of all sequences shuffled. Rows past a sequence's cached
// length hold NaN, so that a read of a key no row sees shows in the output.
struct CachePair {
  Tensor dense_k, dense_v, paged_k, paged_v;
  std::vector<std::int32_t> block_table;
  std::int64_t pages_per_sequence;

  CachePair(const CacheCase& c, std::mt19937_64& rng)
      : dense_k(c.cache_dtype, {batch(c), c.capacity, c.heads_kv, c.head_dim}),
        dense_v(c.cache_dtype, {batch(c), c.capacity, c.heads_kv, c.head_dim}),
        paged_k(c.cache_dtype, {pages(c) * batch(c) + 1, c.page_size, c.heads_kv, c.head_dim}),
        paged_v(c.cache_dtype, {pages(c) * batch(c) + 1, c.page_size, c.heads_kv, c.head_dim}),
        pages_per_sequence(pages(c)) {
    // One spare page that no sequence uses, and a shuffled page order.
    std::vector<std::int32_t> order(static_cast<std::size_t>(pages(c) * batch(c) + 1));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    block_table.assign(order.begin(), order.end() - 1);
    paged_k.poison();
    paged_v.poison();
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    dense_k.for_each_index([&](auto b, auto j, auto h, auto d) {
      const bool cached = j < c.cached[b];
      dense_k.set(b, j, h, d, cached ? normal(rng) : nan);
      dense_v.set(b, j, h, d, cached ? normal(rng) : nan);
      const std::int64_t page = block_table[b * pages_per_sequence + j / c.page_size];
      paged_k.set(page, j % c.page_size, h, d, dense_k.at(b, j, h, d));
      paged_v.set(page, j % c.page_size, h, d, dense_v.at(b, j, h, d));
    });
  }

  // Row (b, j) of the paged cache's K or V, as (page, row in page).
  std::pair<std::int64_t, std::int64_t> paged_row(std::int64_t b, std::int64_t j,
                                                  std::int64_t page_size) const {
    return {block_table[b * pages_per_sequence + j / page_size], j % page_size};
  }

  static std::int64_t batch(const CacheCase& c) {
    return static_cast<std::int64_t>(c.cached.size());
  }
  static std::int64_t pages(const CacheCase& c) {
    return (c.capacity + c.page_size - 1) / c.page_size;
  }
};

struct Outputs {
  Tensor out;
  std::vector<float> lse;
};

Outputs run(const CacheCase& c, const Tensor& q, KVCacheView cache, const Tensor& k_new,
            const Tensor& v_new, int threads) {
  Outputs result{
      Tensor(c.q_dtype, q.view.shape),
      std::vector<float>(static_cast<std::size_t>(q.view.shape[0] * c.heads_q * c.seqlen_q), NAN)};
  result.out.poison();
  AttentionOptions options;
  options.causal = c.causal;
  options.window_left = c.window_left;
  options.window_right = c.window_right;
  options.num_threads = threads;
  NewKeysValues new_kv;
  if (c.seqlen_new > 0) new_kv = {k_new.view, v_new.view};
  kvcache_attention_forward(q.view, cache, c.cached.data(), new_kv, result.out.view,
                            result.lse.data(), options, c.impl);
  return result;
}

Tensor copy_of(const Tensor& source) {
  Tensor copy(source.view.dtype, source.view.shape, source.view.strides);
  std::memcpy(copy.bytes.data(), source.bytes.data(), source.bytes.size());
  return copy;
}

bool same_bits(const Outputs& a, const Outputs& b) {
  return a.out.bytes == b.out.bytes &&
         std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)) == 0;
}

// Batch entry b of a call's outputs (q's dtype) against the fp64 reference of q[b] over rows
// [first, first + L) of row `cache_row` of a dense cache.
void expect_sequence_matches_reference(const Tensor& q, std::int64_t b, const Tensor& k_cache,
                                       const Tensor& v_cache, std::int64_t cache_row,
                                       std::int64_t first, std::int64_t L, const Outputs& got,
                                       const AttentionOptions& options) {
  const std::int64_t seqlen_q = q.view.shape[1], heads_q = q.view.shape[2], D = q.view.shape[3];
  const std::int64_t Hkv = k_cache.view.shape[2];
  const DType q_dtype = q.view.dtype;
  Tensor q_b(DType::f32, {1, seqlen_q, heads_q, D}), out_b(q_dtype, q_b.view.shape);
  Tensor k_b(DType::f32, {1, L, Hkv, D}), v_b(DType::f32, {1, L, Hkv, D});
  q_b.for_each_index([&](auto, auto i, auto h, auto d) {
    q_b.set(0, i, h, d, q.at(b, i, h, d));
    out_b.set(0, i, h, d, got.out.at(b, i, h, d));
  });
  k_b.for_each_index([&](auto, auto j, auto h, auto d) {
    k_b.set(0, j, h, d, k_cache.at(cache_row, first + j, h, d));
    v_b.set(0, j, h, d, v_cache.at(cache_row, first + j, h, d));
  });
  const ReferenceResult want = reference(q_b, k_b, v_b, options);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const double max_q = max_abs(q_b), max_k = max_abs(k_b), max_v = max_abs(v_b);
  const double scores = scale * static_cast<double>(D) * max_q * max_k;
  const double out_tolerance = kU32 * max_v * (4.0 * scores + 2.0 * static_cast<double>(L) + 16.0) +
                               unit_roundoff(q_dtype) * max_v +
                               probability_rounding_bound(q_dtype, max_v) + 1e-30;
  const MaxError error = max_error(out_b, want.out);
  EXPECT_LE(error.value, out_tolerance)
      << "out index " << error.index << ": got " << error.got << ", want " << error.want;
  const double lse_tolerance =
      kU32 * (4.0 * scores + 2.0 * static_cast<double>(L) + 4.0 * max_abs_finite(want.lse));
  for (std::int64_t h = 0; h < heads_q; ++h) {
    for (std::int64_t i = 0; i < seqlen_q; ++i) {
      const double wanted = want.lse[h * seqlen_q + i];
      const float lse = got.lse[(b * heads_q + h) * seqlen_q + i];
      if (std::isinf(wanted)) {
        EXPECT_EQ(lse, -INFINITY) << "lse head " << h << " row " << i;
      } else {
        EXPECT_NEAR(lse, wanted, lse_tolerance) << "lse head " << h << " row " << i;
      }
    }
  }
}

void PrintTo(const CacheCase& c, std::ostream* os) { *os << case_name(c); }

class KVCacheAgainstReference : public ::testing::TestWithParam<CacheCase> {};

TEST_P(KVCacheAgainstReference, DenseAndPagedMatchTheReferenceAndEachOther) {
  const CacheCase c = GetParam();
  std::mt19937_64 rng(test_seed());
  SCOPED_TRACE(case_name(c) + ", seed " + std::to_string(test_seed()));
  const std::int64_t B = CachePair::batch(c), Hkv = c.heads_kv, D = c.head_dim;
  Tensor q(c.q_dtype, {B, c.seqlen_q, c.heads_q, D});
  Tensor k_new(c.new_dtype, {B, c.seqlen_new, Hkv, D});
  Tensor v_new(c.new_dtype, {B, c.seqlen_new, Hkv, D});
  q.fill_normal(rng);
  k_new.fill_normal(rng);
  v_new.fill_normal(rng);
  CachePair cache(c, rng);
  const Tensor k_before = copy_of(cache.dense_k), v_before = copy_of(cache.dense_v);

  const KVCacheView dense{cache.dense_k.view, cache.dense_v.view};
  const KVCacheView paged{cache.paged_k.view, cache.paged_v.view, cache.block_table.data(),
                          cache.pages_per_sequence};
  const Outputs from_dense = run(c, q, dense, k_new, v_new, 2);
  const Outputs from_paged = run(c, q, paged, k_new, v_new, 2);
  EXPECT_TRUE(same_bits(from_dense, from_paged)) << "dense and paged caches disagree";

  // The cache after the call: new rows (in the cache's dtype) at cached .. cached + Snew − 1,
  // every other row as before, in both copies.
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t j = 0; j < c.capacity; ++j) {
      const bool appended = j >= c.cached[b] && j < c.cached[b] + c.seqlen_new;
      const auto [page, row] = cache.paged_row(b, j, c.page_size);
      for (std::int64_t h = 0; h < Hkv; ++h) {
        for (std::int64_t d = 0; d < D; ++d) {
          // Appended: the new value rounded to the cache's dtype; else as before (NaN or not).
          Tensor want(c.cache_dtype, {1, 1, 1, 2});
          want.set(0, 0, 0, 0,
                   appended ? k_new.at(b, j - c.cached[b], h, d) : k_before.at(b, j, h, d));
          want.set(0, 0, 0, 1,
                   appended ? v_new.at(b, j - c.cached[b], h, d) : v_before.at(b, j, h, d));
          const auto same = [](float got, float wanted) {
            return std::isnan(wanted) ? std::isnan(got) : got == wanted;
          };
          ASSERT_TRUE(same(cache.dense_k.at(b, j, h, d), want.at(0, 0, 0, 0)) &&
                      same(cache.paged_k.at(page, row, h, d), want.at(0, 0, 0, 0)) &&
                      same(cache.dense_v.at(b, j, h, d), want.at(0, 0, 0, 1)) &&
                      same(cache.paged_v.at(page, row, h, d), want.at(0, 0, 0, 1)))
              << "sequence " << b << " row " << j << " head " << h << " dim " << d
              << (appended ? " (appended)" : " (not appended)");
        }
      }
    }
  }

  // The result does not depend on the thread count (bitwise), with a cache that already holds
  // the new rows and no append.
  CacheCase no_append = c;
  for (std::int64_t b = 0; b < B; ++b)
    no_append.cached[b] += static_cast<std::int32_t>(c.seqlen_new);
  no_append.seqlen_new = 0;
  EXPECT_TRUE(same_bits(from_paged, run(no_append, q, paged, k_new, v_new, 1)))
      << "1 thread and 2 threads disagree";

  // Each sequence against the fp64 reference over its own keys, read back from the dense cache.
  AttentionOptions options;
  options.causal = c.causal;
  options.window_left = c.window_left;
  options.window_right = c.window_right;
  for (std::int64_t b = 0; b < B; ++b) {
    SCOPED_TRACE("sequence " + std::to_string(b));
    expect_sequence_matches_reference(q, b, cache.dense_k, cache.dense_v, b, 0, no_append.cached[b],
                                      from_dense, options);
  }
}

std::vector<CacheCase> cache_cases() {
  std::vector<CacheCase> cases;
  const std::vector<std::int32_t> ragged = {37, 0, 300};
  // Decode, one new token per sequence, every page size, GQA 4:1; f32 and a 16-bit cache.
  for (const std::int64_t page : {1, 7, 16}) {
    cases.push_back({ragged, 1, 1, 8, 2, 64, 320, page});
    CacheCase bf16 = {ragged, 1, 1, 8, 2, 64, 320, page};
    bf16.cache_dtype = DType::bf16;  // f32 q and new rows, bf16 cache
    cases.push_back(bf16);
  }
  // An f16 cache on pages of 8 rows: every 16-key group of the decode path crosses a page.
  {
    CacheCase c = {ragged, 1, 1, 8, 2, 64, 320, 8};
    c.cache_dtype = DType::f16;
    cases.push_back(c);
  }
  // Nothing appended; an empty sequence stays empty (out 0, lse −inf).
  cases.push_back({{0, 129, 513}, 1, 0, 4, 4, 32, 520, 16});
  // f16 cache and f16 new rows under an f32 q; head_dim not a whole number of vectors.
  {
    CacheCase c = {{5, 70}, 1, 2, 6, 2, 40, 80, 7};
    c.cache_dtype = c.new_dtype = DType::f16;
    cases.push_back(c);
  }
  // Speculative decode: 3 new tokens, causal, with a window; bf16 throughout.
  {
    CacheCase c = {{17, 200, 63}, 3, 3, 8, 2, 64, 210, 16, true, 32, 0};
    c.q_dtype = c.cache_dtype = c.new_dtype = DType::bf16;
    cases.push_back(c);
  }
  // The causal diagonal past the start for short caches: rows that see nothing.
  cases.push_back({{0, 2}, 4, 1, 2, 1, 16, 8, 3, true});
  // Chunked prefill: more rows than the decode path takes, so each sequence is gathered.
  for (const DType dtype : {DType::f32, DType::f16}) {
    CacheCase c = {{0, 150}, 40, 40, 4, 2, 64, 200, 16, true};
    c.q_dtype = c.cache_dtype = c.new_dtype = dtype;
    cases.push_back(c);
  }
  {
    CacheCase c = {{90}, 40, 24, 4, 2, 48, 128, 7, true};
    c.cache_dtype = DType::bf16;
    cases.push_back(c);
  }
  // The standard and reference paths, decode and prefill sized.
  for (const AttentionImpl impl : {AttentionImpl::standard, AttentionImpl::reference}) {
    CacheCase decode = {ragged, 1, 1, 8, 2, 64, 320, 7};
    decode.impl = impl;
    decode.cache_dtype = DType::bf16;
    cases.push_back(decode);
    CacheCase prefill = {{10, 60}, 33, 33, 4, 2, 32, 100, 16, true};
    prefill.impl = impl;
    cases.push_back(prefill);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, KVCacheAgainstReference, ::testing::ValuesIn(cache_cases()),
                         [](const auto& info) { return case_name(info.param); });

// Appends that cross a page boundary, several steps in a row: the cache built token by token
// holds what one append of all of them would, and each step's output matches the dense cache's.
TEST(KVCache, StepByStepAppendsMatchADenseCache) {
  std::mt19937_64 rng(test_seed());
  SCOPED_TRACE("seed " + std::to_string(test_seed()));
  CacheCase c = {{3, 14}, 1, 1, 4, 2, 32, 24, 5};
  c.cache_dtype = DType::bf16;
  CachePair cache(c, rng);
  const KVCacheView dense{cache.dense_k.view, cache.dense_v.view};
  const KVCacheView paged{cache.paged_k.view, cache.paged_v.view, cache.block_table.data(),
                          cache.pages_per_sequence};
  for (int step = 0; step < 8; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    Tensor q(DType::f32, {2, 1, 4, 32}), k_new(DType::f32, {2, 1, 2, 32}),
        v_new(DType::f32, {2, 1, 2, 32});
    q.fill_normal(rng);
    k_new.fill_normal(rng);
    v_new.fill_normal(rng);
    EXPECT_TRUE(same_bits(run(c, q, dense, k_new, v_new, 2), run(c, q, paged, k_new, v_new, 2)));
    for (auto& length : c.cached) ++length;  // the caller's update
  }
}

// The same rows with each KV head's rows together in memory (dense [B, Hkv, capacity, D], pages
// [pages, Hkv, page_size, D]: FlashInfer's HND), passed as the usual dims through strides: the
// same results bit for bit as the row-major caches, and the appended rows land where they should.
Tensor head_major_copy(const Tensor& source) {
  const auto& s = source.view.shape;
  Tensor copy(source.view.dtype, s, {s[2] * s[1] * s[3], s[3], s[1] * s[3], 1});
  copy.for_each_index(
      [&](auto a, auto b, auto c, auto d) { copy.set(a, b, c, d, source.at(a, b, c, d)); });
  return copy;
}

bool same_values(const Tensor& a, const Tensor& b) {
  bool same = true;
  a.for_each_index([&](auto i, auto j, auto h, auto d) {
    const float x = a.at(i, j, h, d), y = b.at(i, j, h, d);
    same = same && (std::memcmp(&x, &y, sizeof x) == 0 || (std::isnan(x) && std::isnan(y)));
  });
  return same;
}

TEST(KVCache, HeadMajorCachesMatchRowMajorCaches) {
  std::mt19937_64 rng(test_seed());
  SCOPED_TRACE("seed " + std::to_string(test_seed()));
  for (const DType dtype : {DType::f32, DType::bf16}) {
    for (const std::int64_t seqlen_q : {1, 3}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " Sq " + std::to_string(seqlen_q));
      CacheCase c = {{19, 0, 40}, seqlen_q, 2, 8, 2, 64, 48, 7};
      c.causal = seqlen_q > 1;
      c.cache_dtype = dtype;
      CachePair cache(c, rng);
      Tensor dense_k = head_major_copy(cache.dense_k), dense_v = head_major_copy(cache.dense_v);
      Tensor paged_k = head_major_copy(cache.paged_k), paged_v = head_major_copy(cache.paged_v);
      Tensor q(DType::f32, {3, seqlen_q, 8, 64}), k_new(DType::f32, {3, 2, 2, 64}),
          v_new(DType::f32, {3, 2, 2, 64});
      q.fill_normal(rng);
      k_new.fill_normal(rng);
      v_new.fill_normal(rng);
      const Outputs want = run(c, q, {cache.dense_k.view, cache.dense_v.view}, k_new, v_new, 2);
      EXPECT_TRUE(same_bits(want, run(c, q, {dense_k.view, dense_v.view}, k_new, v_new, 2)));
      EXPECT_TRUE(same_bits(want, run(c, q,
                                      {paged_k.view, paged_v.view, cache.block_table.data(),
                                       cache.pages_per_sequence},
                                      k_new, v_new, 2)));
      EXPECT_TRUE(same_values(cache.dense_k, dense_k) && same_values(cache.dense_v, dense_v));
      run(c, q,
          {cache.paged_k.view, cache.paged_v.view, cache.block_table.data(),
           cache.pages_per_sequence},
          k_new, v_new, 2);
      EXPECT_TRUE(same_values(cache.paged_k, paged_k) && same_values(cache.paged_v, paged_v));
    }
  }
}

// --- Rotary embedding, left padding, batch index (KVCacheOptions) --------------------------------

// A random rotary table: `positions` rows of rotary_dim / 2 angles.
struct RotaryTable {
  std::vector<float> cos, sin;
  RotaryEmbedding embedding;

  RotaryTable(std::int64_t positions, std::int64_t rotary_dim, bool interleaved,
              std::mt19937_64& rng) {
    std::uniform_real_distribution<double> angle(0.0, 2.0 * M_PI);
    for (std::int64_t i = 0; i < positions * rotary_dim / 2; ++i) {
      const double a = angle(rng);
      cos.push_back(static_cast<float>(std::cos(a)));
      sin.push_back(static_cast<float>(std::sin(a)));
    }
    embedding = {cos.data(), sin.data(), positions, rotary_dim, interleaved};
  }
};

// Row (b, i) of x, every head, rotated at `position` as kvcache.hpp defines it: in fp64, rounded
// once to x's dtype (through fp32); dims from rotary_dim on untouched.
void rotate_row_in_place(Tensor& x, std::int64_t b, std::int64_t i, std::int64_t position,
                         const RotaryEmbedding& r) {
  const std::int64_t half = r.rotary_dim / 2;
  for (std::int64_t h = 0; h < x.view.shape[2]; ++h) {
    for (std::int64_t p = 0; p < half; ++p) {
      const std::int64_t first = r.interleaved ? 2 * p : p;
      const std::int64_t second = r.interleaved ? 2 * p + 1 : p + half;
      const double x1 = x.at(b, i, h, first), x2 = x.at(b, i, h, second);
      const double c = r.cos[position * half + p], s = r.sin[position * half + p];
      x.set(b, i, h, first, static_cast<float>(x1 * c - x2 * s));
      x.set(b, i, h, second, static_cast<float>(x2 * c + x1 * s));
    }
  }
}

// A dense cache [batch_cache, capacity, Hkv, D]: row r holds values in [first[r], cached[r]) and
// NaN elsewhere, so that a read of a key outside a sequence shows in the output.
Tensor sparse_cache(DType dtype, std::int64_t batch_cache, std::int64_t capacity, std::int64_t Hkv,
                    std::int64_t D, const std::vector<std::int64_t>& first,
                    const std::vector<std::int64_t>& cached, std::mt19937_64& rng) {
  Tensor t(dtype, {batch_cache, capacity, Hkv, D});
  std::normal_distribution<float> normal(0.0f, 1.0f);
  t.for_each_index([&](auto r, auto j, auto h, auto d) {
    const bool held = j >= first[r] && j < cached[r];
    t.set(r, j, h, d, held ? normal(rng) : std::numeric_limits<float>::quiet_NaN());
  });
  return t;
}

Outputs run_kvcache(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                    const std::vector<std::int32_t>& cached, const Tensor* k_new,
                    const Tensor* v_new, const KVCacheOptions& cache_options,
                    const AttentionOptions& options, AttentionImpl impl) {
  const auto& s = q.view.shape;
  Outputs result{Tensor(q.view.dtype, s),
                 std::vector<float>(static_cast<std::size_t>(s[0] * s[2] * s[1]), NAN)};
  result.out.poison();
  NewKeysValues new_kv;
  if (k_new != nullptr) new_kv = {k_new->view, v_new->view};
  kvcache_attention_forward(q.view, {k_cache.view, v_cache.view}, cached.data(), new_kv,
                            cache_options, result.out.view, result.lse.data(), options, impl);
  return result;
}

struct RotaryCase {
  const char* name;
  std::int64_t seqlen_q, seqlen_new;
  bool causal;
  std::int64_t window_left;
  DType cache_dtype;
  AttentionImpl impl;
};

// The rotary call against the plain call on q and k_new rotated in the test: the same cache bit
// for bit and the same outputs bit for bit; and each sequence against the fp64 reference over the
// rotated keys. GPT-J and NeoX pairs, rotary_dim the whole head or half of it; with left padding
// and a batch index, whose positions stay the cache's rows.
TEST(KVCache, RotaryEmbeddingIsRotateThenAttend) {
  std::mt19937_64 rng(test_seed());
  SCOPED_TRACE("seed " + std::to_string(test_seed()));
  const std::int64_t Hq = 4, Hkv = 2, D = 32, capacity = 96;
  const RotaryCase cases[] = {
      {"decode_noncausal", 2, 1, false, -1, DType::f32, AttentionImpl::flash},
      {"speculative_causal", 3, 3, true, -1, DType::bf16, AttentionImpl::flash},
      {"window", 3, 3, false, 8, DType::f32, AttentionImpl::flash},
      {"prefill_gathered", 40, 40, true, -1, DType::f32, AttentionImpl::flash},
      {"reference", 3, 2, true, -1, DType::f32, AttentionImpl::reference},
  };
  for (const RotaryCase& c : cases) {
    for (const bool interleaved : {true, false}) {
      for (const std::int64_t rotary_dim : {D, D / 2}) {
        for (const bool padded : {false, true}) {
          SCOPED_TRACE(std::string(c.name) + (interleaved ? " interleaved" : " neox") +
                       " rotary_dim " + std::to_string(rotary_dim) +
                       (padded ? " leftpad+batch_idx" : ""));
          // Two sequences in rows 2 and 0 of a 3-row cache when padded, else rows 0 and 1.
          const std::vector<std::int32_t> cached = {13, 37};
          const std::vector<std::int32_t> leftpad = {4, 0}, batch_idx = {2, 0};
          const std::int64_t batch_cache = padded ? 3 : 2;
          std::vector<std::int64_t> first(static_cast<std::size_t>(batch_cache), 0),
              held(static_cast<std::size_t>(batch_cache), 0);
          for (std::size_t b = 0; b < 2; ++b) {
            const std::size_t row = padded ? static_cast<std::size_t>(batch_idx[b]) : b;
            first[row] = padded ? leftpad[b] : 0;
            held[row] = cached[b];
          }
          const Tensor k_cache =
              sparse_cache(c.cache_dtype, batch_cache, capacity, Hkv, D, first, held, rng);
          const Tensor v_cache =
              sparse_cache(c.cache_dtype, batch_cache, capacity, Hkv, D, first, held, rng);
          Tensor k_a = copy_of(k_cache), v_a = copy_of(v_cache), k_b = copy_of(k_cache),
                 v_b = copy_of(v_cache);
          Tensor q(DType::f32, {2, c.seqlen_q, Hq, D}),
              k_new(DType::f32, {2, c.seqlen_new, Hkv, D}),
              v_new(DType::f32, {2, c.seqlen_new, Hkv, D});
          q.fill_normal(rng);
          k_new.fill_normal(rng);
          v_new.fill_normal(rng);
          const RotaryTable table(cached[1] + c.seqlen_q, rotary_dim, interleaved, rng);

          AttentionOptions options;
          options.causal = c.causal;
          options.window_left = c.window_left;
          options.num_threads = 2;
          KVCacheOptions plain;
          if (padded) {
            plain.cache_leftpad = leftpad.data();
            plain.cache_batch_idx = batch_idx.data();
          }
          KVCacheOptions rotary = plain;
          rotary.rotary = table.embedding;
          const Outputs got =
              run_kvcache(q, k_a, v_a, cached, &k_new, &v_new, rotary, options, c.impl);

          // The test's rotation: keys at cached[b] + i, queries there too when causal or
          // windowed, else all at cached[b].
          Tensor q_rot = copy_of(q), k_rot = copy_of(k_new);
          const bool advance = c.causal || c.window_left >= 0;
          for (std::int64_t b = 0; b < 2; ++b) {
            for (std::int64_t i = 0; i < c.seqlen_q; ++i) {
              rotate_row_in_place(q_rot, b, i, cached[b] + (advance ? i : 0), table.embedding);
            }
            for (std::int64_t i = 0; i < c.seqlen_new; ++i) {
              rotate_row_in_place(k_rot, b, i, cached[b] + i, table.embedding);
            }
          }
          const Outputs want =
              run_kvcache(q_rot, k_b, v_b, cached, &k_rot, &v_new, plain, options, c.impl);
          EXPECT_TRUE(same_values(k_a, k_b) && same_values(v_a, v_b))
              << "the cache differs from the one of rotate-then-append";
          EXPECT_TRUE(same_bits(got, want)) << "out or lse differs from rotate-then-attend";
          for (std::int64_t b = 0; b < 2; ++b) {
            SCOPED_TRACE("sequence " + std::to_string(b));
            const std::int64_t row = padded ? batch_idx[b] : b, start = padded ? leftpad[b] : 0;
            expect_sequence_matches_reference(q_rot, b, k_b, v_b, row, start,
                                              cached[b] + c.seqlen_new - start, got, options);
          }
        }
      }
    }
  }
}

// cache_leftpad and cache_batch_idx against the same sequences sliced out of the cache by the
// test into a cache of their own: the same outputs bit for bit (ALiBi and the causal mask count
// from each sequence's first key), the new rows in the right cache rows, every other row as it
// was (an unused cache row included).
TEST(KVCache, LeftPaddingAndBatchIndexMatchASlicedCache) {
  std::mt19937_64 rng(test_seed());
  SCOPED_TRACE("seed " + std::to_string(test_seed()));
  const std::int64_t Hq = 4, Hkv = 2, D = 32, capacity = 48, Snew = 2;
  const std::vector<std::int32_t> cached = {20, 9, 17}, leftpad = {5, 0, 17}, batch_idx = {2, 0, 3};
  const std::vector<std::int64_t> first = {0, 3, 5, 17}, held = {9, 30, 20, 17};
  const std::vector<float> slopes = {0.5f, 0.25f, 0.125f, 0.0625f};
  for (const auto& [seqlen_q, impl] : {std::pair{std::int64_t{2}, AttentionImpl::flash},
                                       {std::int64_t{40}, AttentionImpl::flash},
                                       {std::int64_t{2}, AttentionImpl::reference}}) {
    SCOPED_TRACE("Sq " + std::to_string(seqlen_q) + " " + impl_name(impl));
    Tensor k_cache = sparse_cache(DType::f32, 4, capacity, Hkv, D, first, held, rng);
    Tensor v_cache = sparse_cache(DType::f32, 4, capacity, Hkv, D, first, held, rng);
    const Tensor k_before = copy_of(k_cache), v_before = copy_of(v_cache);
    // The sliced cache: sequence b's keys from row 0 of its own row b.
    Tensor k_sliced(DType::f32, {3, capacity, Hkv, D}), v_sliced(DType::f32, {3, capacity, Hkv, D});
    std::vector<std::int32_t> sliced_cached(3);
    k_sliced.for_each_index([&](auto b, auto j, auto h, auto d) {
      const std::int64_t length = cached[b] - leftpad[b];
      const float nan = std::numeric_limits<float>::quiet_NaN();
      k_sliced.set(b, j, h, d, j < length ? k_cache.at(batch_idx[b], leftpad[b] + j, h, d) : nan);
      v_sliced.set(b, j, h, d, j < length ? v_cache.at(batch_idx[b], leftpad[b] + j, h, d) : nan);
    });
    for (std::size_t b = 0; b < 3; ++b) sliced_cached[b] = cached[b] - leftpad[b];
    Tensor q(DType::f32, {3, seqlen_q, Hq, D}), k_new(DType::f32, {3, Snew, Hkv, D}),
        v_new(DType::f32, {3, Snew, Hkv, D});
    q.fill_normal(rng);
    k_new.fill_normal(rng);
    v_new.fill_normal(rng);
    AttentionOptions options;
    options.causal = true;
    options.alibi_slopes = slopes;
    options.num_threads = 2;
    KVCacheOptions cache_options;
    cache_options.cache_leftpad = leftpad.data();
    cache_options.cache_batch_idx = batch_idx.data();
    const Outputs got =
        run_kvcache(q, k_cache, v_cache, cached, &k_new, &v_new, cache_options, options, impl);
    const Outputs want =
        run_kvcache(q, k_sliced, v_sliced, sliced_cached, &k_new, &v_new, {}, options, impl);
    EXPECT_TRUE(same_bits(got, want)) << "out or lse differs from the sliced cache's";
    bool as_expected = true;
    k_cache.for_each_index([&](auto r, auto j, auto h, auto d) {
      const auto entry = std::find(batch_idx.begin(), batch_idx.end(), r) - batch_idx.begin();
      const bool appended = entry < 3 && j >= cached[entry] && j < cached[entry] + Snew;
      const auto same = [](float x, float y) {
        return std::memcmp(&x, &y, sizeof x) == 0 || (std::isnan(x) && std::isnan(y));
      };
      const float k_want =
          appended ? k_new.at(entry, j - cached[entry], h, d) : k_before.at(r, j, h, d);
      const float v_want =
          appended ? v_new.at(entry, j - cached[entry], h, d) : v_before.at(r, j, h, d);
      if (!same(k_cache.at(r, j, h, d), k_want) || !same(v_cache.at(r, j, h, d), v_want)) {
        if (as_expected)
          ADD_FAILURE() << "cache row " << r << " key " << j << " head " << h << " dim " << d;
        as_expected = false;
      }
    });
  }
}

// Without new rows, batch entries may share a cache row.
TEST(KVCache, BatchEntriesMayShareACacheRowWhenNotAppending) {
  std::mt19937_64 rng(test_seed());
  const std::vector<std::int32_t> cached = {11, 11}, batch_idx = {1, 1};
  const std::vector<std::int64_t> first = {0, 0}, held = {0, 11};
  const Tensor k_cache = sparse_cache(DType::f32, 2, 16, 1, 16, first, held, rng);
  const Tensor v_cache = sparse_cache(DType::f32, 2, 16, 1, 16, first, held, rng);
  Tensor one(DType::f32, {1, 1, 2, 16});
  one.fill_normal(rng);
  Tensor q(DType::f32, {2, 1, 2, 16});
  q.for_each_index([&](auto, auto, auto h, auto d) { q.set(0, 0, h, d, one.at(0, 0, h, d)); });
  q.for_each_index([&](auto, auto, auto h, auto d) { q.set(1, 0, h, d, one.at(0, 0, h, d)); });
  KVCacheOptions cache_options;
  cache_options.cache_batch_idx = batch_idx.data();
  const Outputs got = run_kvcache(q, k_cache, v_cache, cached, nullptr, nullptr, cache_options, {},
                                  AttentionImpl::flash);
  for (std::int64_t d = 0; d < 16; ++d) {
    ASSERT_EQ(got.out.at(0, 0, 1, d), got.out.at(1, 0, 1, d));
    ASSERT_FALSE(std::isnan(got.out.at(0, 0, 1, d)));
  }
}

// Bad input: one corruption of a valid decode call each, with the start of the message it must
// raise; nothing may be written, neither out nor lse nor the cache.
struct Call {
  Tensor q{DType::f32, {2, 1, 4, 16}}, out{DType::f32, {2, 1, 4, 16}};
  Tensor k_cache{DType::f32, {6, 4, 2, 16}}, v_cache{DType::f32, {6, 4, 2, 16}};
  Tensor k_new{DType::f32, {2, 1, 2, 16}}, v_new{DType::f32, {2, 1, 2, 16}};
  std::vector<std::int32_t> block_table = {0, 1, 2, 3, 4, 5};  // 3 pages per sequence
  std::vector<std::int32_t> seqlens = {5, 9};
  std::vector<float> lse = std::vector<float>(8, 1.0f);
  KVCacheView cache{k_cache.view, v_cache.view, block_table.data(), 3};
  NewKeysValues new_kv{k_new.view, v_new.view};
  TensorView q_view = q.view, out_view = out.view;
  const std::int32_t* seqlens_ptr = seqlens.data();
  float* lse_ptr = lse.data();
  AttentionOptions options;
  // For the KVCacheOptions corruptions: a table of 16 positions, rotary_dim 16, and an index and
  // left padding for a dense cache (`dense` makes the cache [6, 4, 2, 16] dense).
  std::vector<float> cos = std::vector<float>(16 * 8, 1.0f), sin = std::vector<float>(16 * 8, 0.0f);
  std::vector<std::int32_t> leftpad = {0, 0}, batch_idx = {4, 1};
  KVCacheOptions cache_options;

  void rotary() { cache_options.rotary = {cos.data(), sin.data(), 16, 16, true}; }
  void dense() {
    cache.block_table = nullptr;
    cache.pages_per_sequence = 0;
    seqlens = {1, 2};
    cache_options.cache_batch_idx = batch_idx.data();
  }

  Call() {
    out.fill(2.0f);
    k_cache.fill(3.0f);
    v_cache.fill(4.0f);
  }
};

struct BadCall {
  const char* name;
  std::function<void(Call&)> corrupt;
  std::string message;
};

void PrintTo(const BadCall& bad, std::ostream* os) { *os << bad.name; }

class KVCacheBadInput : public ::testing::TestWithParam<BadCall> {};

TEST_P(KVCacheBadInput, RaisesANamedErrorAndWritesNothing) {
  Call call;
  GetParam().corrupt(call);
  const std::vector<std::uint8_t> out_before = call.out.bytes, k_before = call.k_cache.bytes,
                                  v_before = call.v_cache.bytes;
  const std::vector<float> lse_before = call.lse;
  try {
    kvcache_attention_forward(call.q_view, call.cache, call.seqlens_ptr, call.new_kv,
                              call.cache_options, call.out_view, call.lse_ptr, call.options);
    FAIL() << "no error raised";
  } catch (const Error& error) {
    const std::string what = error.what();
    EXPECT_EQ(what.rfind("kvcache_attention_forward: " + GetParam().message, 0), 0u) << what;
  }
  EXPECT_EQ(call.out.bytes, out_before) << "out written despite the error";
  EXPECT_EQ(call.k_cache.bytes, k_before) << "k_cache written despite the error";
  EXPECT_EQ(call.v_cache.bytes, v_before) << "v_cache written despite the error";
  EXPECT_EQ(0, std::memcmp(call.lse.data(), lse_before.data(), lse_before.size() * sizeof(float)));
}

std::vector<BadCall> bad_calls() {
  return {
      {"bf16_q_over_f16_cache",
       [](Call& c) {
         c.q_view.dtype = c.out_view.dtype = DType::bf16;
         c.cache.k.dtype = c.cache.v.dtype = DType::f16;
       },
       "k_cache: expected dtype bf16"},
      {"out_dtype", [](Call& c) { c.out_view.dtype = DType::bf16; }, "out: expected dtype f32"},
      {"v_cache_dtype", [](Call& c) { c.cache.v.dtype = DType::bf16; },
       "v_cache: expected dtype f32"},
      {"new_rows_dtype",
       [](Call& c) {
         c.cache.k.dtype = c.cache.v.dtype = DType::bf16;
         c.new_kv.k.dtype = c.new_kv.v.dtype = DType::f16;
       },
       "k_new: expected dtype bf16"},
      {"heads_kv", [](Call& c) { c.q_view.shape[2] = c.out_view.shape[2] = 3; },
       "k_cache: expected heads_kv dividing"},
      {"page_size_zero", [](Call& c) { c.cache.k.shape[1] = c.cache.v.shape[1] = 0; },
       "k_cache: expected page_size"},
      {"dense_batch",
       [](Call& c) {
         c.cache.block_table = nullptr;
         c.cache.pages_per_sequence = 0;
         c.cache.k.shape[0] = c.cache.v.shape[0] = 3;
       },
       "k_cache: expected batch 2"},
      {"pages_without_table",
       [](Call& c) {
         c.cache.block_table = nullptr;
         c.cache.k.shape[0] = c.cache.v.shape[0] = 2;
       },
       "pages_per_sequence: expected 0"},
      {"seqlens_null", [](Call& c) { c.seqlens_ptr = nullptr; }, "cache_seqlens: expected 2"},
      {"seqlen_negative", [](Call& c) { c.seqlens[1] = -1; }, "cache_seqlens[1]: expected >= 0"},
      {"seqlen_past_capacity", [](Call& c) { c.seqlens[0] = 12; },
       "cache_seqlens[0]: expected at most 11"},
      {"page_out_of_range", [](Call& c) { c.block_table[4] = 6; },
       "block_table[1, 1]: expected a page in [0, 6)"},
      {"page_negative", [](Call& c) { c.block_table[0] = -1; },
       "block_table[0, 0]: expected a page in [0, 6)"},
      {"page_written_twice",
       [](Call& c) {
         c.block_table[5] = 1;
         c.seqlens = {5, 8};
       },
       "block_table[1, 2]: page 1 receives new rows here and at block_table[0, 1]"},
      {"k_new_shape", [](Call& c) { c.new_kv.k.shape[2] = 1; },
       "k_new: expected shape [2, Snew, 2, 16], got [2, 1, 1, 16]"},
      {"v_new_shape", [](Call& c) { c.new_kv.v.shape[1] = 2; }, "v_new: expected shape"},
      {"cache_overlaps_q", [](Call& c) { c.q_view.data = c.k_cache.view.data; },
       "k_cache: expected memory disjoint from q"},
      {"out_overlaps_cache", [](Call& c) { c.out_view.data = c.v_cache.view.data; },
       "out: expected memory disjoint from v_cache"},
      {"lse_overlaps_out", [](Call& c) { c.lse_ptr = static_cast<float*>(c.out.view.data); },
       "out: expected memory disjoint from lse"},
      {"k_new_overlaps_cache", [](Call& c) { c.new_kv.k.data = c.k_cache.view.data; },
       "k_cache: expected memory disjoint from k_new"},
      {"window", [](Call& c) { c.options.window_left = -2; }, "window_left: expected >= -1"},
      {"rotary_cos_too_short",
       [](Call& c) {
         c.rotary();
         c.cache_options.rotary.positions = 9;  // sequence 1 rotates at cache_seqlens[1] = 9
       },
       "rotary_cos: expected more than 9 positions (sequence 1"},
      {"rotary_causal_q_past_the_table",
       [](Call& c) {
         c.rotary();
         c.q_view.shape[1] = c.out_view.shape[1] = 2;  // q rows at 9 and 10 under the mask
         c.q_view.shape[0] = c.out_view.shape[0] = 1;
         c.new_kv.k.shape[0] = c.new_kv.v.shape[0] = 1;
         c.seqlens = {9, 0};
         c.cache_options.rotary.positions = 10;
         c.options.causal = true;
       },
       "rotary_cos: expected more than 10 positions (sequence 0"},
      {"rotary_dim_odd",
       [](Call& c) {
         c.rotary();
         c.cache_options.rotary.rotary_dim = 5;
       },
       "rotary_dim (2 · rotary_cos's columns): expected an even number in [2, head_dim = 16], "
       "got 5"},
      {"rotary_dim_past_head_dim",
       [](Call& c) {
         c.rotary();
         c.cache_options.rotary.rotary_dim = 18;
       },
       "rotary_dim (2 · rotary_cos's columns): expected an even number in [2, head_dim = 16], "
       "got 18"},
      {"rotary_sin_null",
       [](Call& c) {
         c.rotary();
         c.cache_options.rotary.sin = nullptr;
       },
       "rotary_sin: expected a table with rotary_cos, got null"},
      {"rotary_without_new_rows",
       [](Call& c) {
         c.rotary();
         c.new_kv = {};
       },
       "rotary_cos: expected new rows k_new, v_new to rotate"},
      {"rotary_overlaps_out",
       [](Call& c) {
         c.rotary();
         c.out_view.data = c.cos.data();
       },
       "out: expected memory disjoint from rotary_cos"},
      {"leftpad_past_the_length",
       [](Call& c) {
         c.dense();
         c.leftpad = {0, 3};
         c.cache_options.cache_leftpad = c.leftpad.data();
       },
       "cache_leftpad[1]: expected in [0, cache_seqlens[1] = 2], got 3"},
      {"leftpad_negative",
       [](Call& c) {
         c.dense();
         c.leftpad = {-1, 0};
         c.cache_options.cache_leftpad = c.leftpad.data();
       },
       "cache_leftpad[0]: expected in [0, cache_seqlens[0] = 1], got -1"},
      {"leftpad_paged", [](Call& c) { c.cache_options.cache_leftpad = c.leftpad.data(); },
       "cache_leftpad: expected null with a block_table"},
      {"batch_idx_out_of_range",
       [](Call& c) {
         c.dense();
         c.batch_idx = {0, 6};
       },
       "cache_batch_idx[1]: expected a cache row in [0, 6), got 6"},
      {"batch_idx_negative",
       [](Call& c) {
         c.dense();
         c.batch_idx = {-1, 0};
       },
       "cache_batch_idx[0]: expected a cache row in [0, 6), got -1"},
      {"batch_idx_repeated_when_appending",
       [](Call& c) {
         c.dense();
         c.batch_idx = {3, 3};
       },
       "cache_batch_idx[1]: expected distinct rows when appending, got 3 as cache_batch_idx[0] "
       "too"},
      {"batch_idx_paged", [](Call& c) { c.cache_options.cache_batch_idx = c.batch_idx.data(); },
       "cache_batch_idx: expected null with a block_table"},
      {"dense_batch_without_index",
       [](Call& c) {
         c.dense();
         c.cache_options.cache_batch_idx = nullptr;
       },
       "k_cache: expected batch 2"},
  };
}

INSTANTIATE_TEST_SUITE_P(Calls, KVCacheBadInput, ::testing::ValuesIn(bad_calls()),
                         [](const auto& info) { return std::string(info.param.name); });

// The valid call the bad ones corrupt runs, and appends; so do its rotary and dense variants.
TEST(KVCache, TheBadInputBaselineIsValid) {
  Call call;
  kvcache_attention_forward(call.q_view, call.cache, call.seqlens.data(), call.new_kv,
                            call.out_view, call.lse_ptr, call.options);
  EXPECT_EQ(call.k_cache.at(1, 1, 0, 0), 0.0f);  // sequence 0's row 5: page 1, row 1
  EXPECT_EQ(call.k_cache.at(5, 1, 1, 3), 0.0f);  // sequence 1's row 9: page 5, row 1
  EXPECT_EQ(call.k_cache.at(1, 2, 0, 0), 3.0f);  // untouched

  Call rotary;
  rotary.rotary();
  kvcache_attention_forward(rotary.q_view, rotary.cache, rotary.seqlens.data(), rotary.new_kv,
                            rotary.cache_options, rotary.out_view, rotary.lse_ptr, rotary.options);
  Call dense;
  dense.dense();
  dense.cache_options.cache_leftpad = dense.leftpad.data();
  kvcache_attention_forward(dense.q_view, dense.cache, dense.seqlens.data(), dense.new_kv,
                            dense.cache_options, dense.out_view, dense.lse_ptr, dense.options);
  EXPECT_EQ(dense.k_cache.at(4, 1, 0, 0), 0.0f);  // entry 0's row 1 in cache row 4
  EXPECT_EQ(dense.k_cache.at(1, 2, 1, 3), 0.0f);  // entry 1's row 2 in cache row 1
  EXPECT_EQ(dense.k_cache.at(0, 1, 0, 0), 3.0f);  // untouched
}

}  // namespace
}  // namespace flashattn::testing
