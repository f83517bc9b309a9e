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
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/flash_decode.hpp"
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

// One sequence's forward, out_b [1, Lq, Hq, D] and lse_b [Hq, Lq], against the fp64 reference
// on its rows (the file's tolerance; ALiBi's distances and a softcap widen the scores' bound).
void expect_near_reference(const Tensor& q_b, const Tensor& k_b, const Tensor& v_b,
                           const AttentionOptions& options, const Tensor& out_b,
                           const std::vector<float>& lse_b) {
  const ReferenceResult want = reference(q_b, k_b, v_b, options);
  const DType dtype = out_b.view.dtype;
  const std::int64_t Lq = q_b.view.shape[1], Lk = k_b.view.shape[1], D = q_b.view.shape[3];
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const double max_v = max_abs(v_b);
  double max_slope = 0.0;
  for (const float slope : options.alibi_slopes) max_slope = std::max<double>(max_slope, slope);
  const double scores = scale * static_cast<double>(D) * max_abs(q_b) * max_abs(k_b) +
                        options.softcap + max_slope * static_cast<double>(Lq + Lk);
  const double tolerance = kU32 * max_v * (4.0 * scores + 2.0 * static_cast<double>(Lk) + 16.0) +
                           unit_roundoff(dtype) * max_v + probability_rounding_bound(dtype, max_v) +
                           1e-30;
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

    expect_near_reference(q_b, k_b, v_b, options, out_b, lse_b);
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
  void run() {
    varlen_attention_forward(impl, q_view, k.view, v.view, cu_q_ptr, cu_k.data(), batch, out_view,
                             lse.data());
  }
};

// A corruption of a valid Call (one with out, lse and run()), and the start of the message it
// must raise.
template <class Call>
struct BadCall {
  const char* name;
  std::function<void(Call&)> corrupt;
  std::string message;
};

template <class Call>
void PrintTo(const BadCall<Call>& bad, std::ostream* os) {
  *os << bad.name;
}

// The corrupted call raises its Error and writes neither out nor lse.
template <class Call>
void expect_refused(const BadCall<Call>& bad) {
  Call call;
  bad.corrupt(call);
  const std::vector<std::uint8_t> out_before = call.out.bytes;
  const std::vector<float> lse_before = call.lse;
  try {
    call.run();
    FAIL() << "no error raised";
  } catch (const Error& error) {
    const std::string what = error.what();
    EXPECT_EQ(what.rfind("varlen_attention_forward: " + bad.message, 0), 0u) << what;
  }
  EXPECT_EQ(call.out.bytes, out_before);
  EXPECT_EQ(0, std::memcmp(call.lse.data(), lse_before.data(), lse_before.size() * sizeof(float)));
}

using BadVarlen = BadCall<VarlenCall>;

class VarlenBadInput : public ::testing::TestWithParam<BadVarlen> {};

TEST_P(VarlenBadInput, RaisesANamedErrorAndWritesNothing) { expect_refused(GetParam()); }

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

// ---- K and V in pages (PagedKVView) ----
//
// The paged forward must give the packed forward's bits on the same rows (out and lse), for any
// page size, table order and pool layout, on both of its routes: the decode path reading the
// pages in place (up to 32 query rows per KV head) and the gather into a contiguous buffer.

struct PagedCase {
  std::vector<std::int32_t> q_lengths, k_lengths;
  std::int64_t page_size, heads_q, heads_kv, head_dim;
  bool causal = false;
  DType dtype = DType::f32;
  AttentionImpl impl = AttentionImpl::flash;
  int threads = 1;
  bool decode = false;      // every sequence with queries takes the flash decode path
  bool head_major = false;  // the pool's memory [num_pages, heads_kv, page_size, head_dim]
  bool modifiers = false;   // a window, softcap, ALiBi [batch, heads_q] and sinks
};

std::string case_name(const PagedCase& c) {
  std::ostringstream name;
  name << (c.decode ? "decode" : "prefill") << "_page" << c.page_size << "_Hq" << c.heads_q
       << "_Hkv" << c.heads_kv << "_D" << c.head_dim << (c.causal ? "_causal" : "") << "_"
       << dtype_name(c.dtype) << "_" << impl_name(c.impl) << "_t" << c.threads
       << (c.head_major ? "_head_major" : "") << (c.modifiers ? "_modifiers" : "");
  return name.str();
}

void PrintTo(const PagedCase& c, std::ostream* os) { *os << case_name(c); }

// A ragged batch's keys and values in a pool of pages handed out in shuffled order, sequence 1's
// first page shared with sequence 0 (a common prefix). Pages no sequence holds are NaN, table
// entries past a sequence's keys out of range: neither may be read. k and v are the same rows
// packed [1, total_k, heads_kv, head_dim].
struct PagedBatch {
  Tensor k_pages, v_pages;
  std::vector<std::int32_t> table;
  std::int64_t pages_per_sequence = 0;
  Tensor k, v;

  PagedKVView view() const {
    return {k_pages.view, v_pages.view, table.data(), pages_per_sequence};
  }
};

Tensor page_pool(DType dtype, std::int64_t pages, std::int64_t page_size, std::int64_t heads,
                 std::int64_t D, bool head_major) {
  if (!head_major) return Tensor(dtype, {pages, page_size, heads, D});
  return Tensor(dtype, {pages, page_size, heads, D}, {heads * page_size * D, D, page_size * D, 1});
}

PagedBatch paged_batch(const PagedCase& c, std::mt19937_64& rng) {
  const auto B = static_cast<std::int64_t>(c.k_lengths.size());
  const std::int64_t P = c.page_size, D = c.head_dim;
  std::vector<std::int64_t> pages(static_cast<std::size_t>(B));
  std::int64_t most = 0, all = 0;
  for (std::int64_t b = 0; b < B; ++b) {
    pages[b] = (c.k_lengths[b] + P - 1) / P;
    most = std::max(most, pages[b]);
    all += pages[b];
  }
  const std::int64_t num_pages = all + 3;  // spare pages, never handed out
  std::vector<std::int32_t> free_pages(static_cast<std::size_t>(num_pages));
  std::iota(free_pages.begin(), free_pages.end(), 0);
  std::shuffle(free_pages.begin(), free_pages.end(), rng);

  PagedBatch batch{page_pool(c.dtype, num_pages, P, c.heads_kv, D, c.head_major),
                   page_pool(c.dtype, num_pages, P, c.heads_kv, D, c.head_major),
                   {},
                   most + 1,  // a column no sequence reaches
                   packed(c.dtype, offsets_of(c.k_lengths).back(), c.heads_kv, D, false),
                   packed(c.dtype, offsets_of(c.k_lengths).back(), c.heads_kv, D, false)};
  batch.k_pages.poison();
  batch.v_pages.poison();
  batch.table.resize(static_cast<std::size_t>(B * batch.pages_per_sequence));
  for (std::size_t i = 0; i < batch.table.size(); ++i) {
    batch.table[i] = i % 2 == 0 ? static_cast<std::int32_t>(num_pages + i) : -1;
  }
  std::normal_distribution<float> normal;
  std::size_t next = 0;
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t i = 0; i < pages[b]; ++i) {
      std::int32_t& entry = batch.table[b * batch.pages_per_sequence + i];
      if (b == 1 && i == 0 && pages[0] > 0) {
        entry = batch.table[0];
        continue;
      }
      entry = free_pages[next++];
      for (Tensor* pool : {&batch.k_pages, &batch.v_pages}) {
        for (std::int64_t row = 0; row < P; ++row) {
          for (std::int64_t h = 0; h < c.heads_kv; ++h) {
            for (std::int64_t d = 0; d < D; ++d) pool->set(entry, row, h, d, normal(rng));
          }
        }
      }
    }
  }
  const std::vector<std::int32_t> cu_k = offsets_of(c.k_lengths);
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t j = 0; j < c.k_lengths[b]; ++j) {
      const std::int32_t page = batch.table[b * batch.pages_per_sequence + j / P];
      for (std::int64_t h = 0; h < c.heads_kv; ++h) {
        for (std::int64_t d = 0; d < D; ++d) {
          batch.k.set(0, cu_k[b] + j, h, d, batch.k_pages.at(page, j % P, h, d));
          batch.v.set(0, cu_k[b] + j, h, d, batch.v_pages.at(page, j % P, h, d));
        }
      }
    }
  }
  return batch;
}

class PagedVarlenAgainstPacked : public ::testing::TestWithParam<PagedCase> {};

TEST_P(PagedVarlenAgainstPacked, SameBitsAsThePackedForwardAndNearTheReference) {
  const PagedCase c = GetParam();
  std::mt19937_64 rng(test_seed());
  SCOPED_TRACE(case_name(c) + ", seed " + std::to_string(test_seed()));
  const auto B = static_cast<std::int64_t>(c.q_lengths.size());
  const std::int64_t Hq = c.heads_q, D = c.head_dim;
  const std::vector<std::int32_t> cu_q = offsets_of(c.q_lengths), cu_k = offsets_of(c.k_lengths);
  const std::int64_t total_q = cu_q.back();
  const PagedBatch kv = paged_batch(c, rng);
  Tensor q = packed(c.dtype, total_q, Hq, D, false);
  q.fill_normal(rng);
  Tensor out_packed = packed(c.dtype, total_q, Hq, D, false), out_paged = out_packed;
  out_paged.view.data = out_paged.bytes.data();
  out_packed.poison();
  out_paged.poison();
  std::vector<float> lse_packed(static_cast<std::size_t>(Hq * total_q), NAN),
      lse_paged = lse_packed;

  AttentionOptions options;
  options.causal = c.causal;
  options.num_threads = c.threads;
  std::vector<float> slopes, sinks;
  if (c.modifiers) {
    options.window_left = 24;
    options.window_right = 3;
    options.softcap = 4.0f;
    std::uniform_real_distribution<float> slope(0.01f, 0.5f);
    std::normal_distribution<float> sink;
    for (std::int64_t i = 0; i < B * Hq; ++i) slopes.push_back(slope(rng));
    for (std::int64_t h = 0; h < Hq; ++h) sinks.push_back(sink(rng));
    options.alibi_slopes = slopes;
    options.sinks = sinks;
  }

  varlen_attention_forward(c.impl, q.view, kv.k.view, kv.v.view, cu_q.data(), cu_k.data(), B,
                           out_packed.view, lse_packed.data(), options);
  varlen_attention_forward(c.impl, q.view, kv.view(), cu_q.data(), cu_k.data(), B, out_paged.view,
                           lse_paged.data(), options);
  EXPECT_TRUE(out_paged.bytes == out_packed.bytes) << "out differs from the packed forward's";
  EXPECT_TRUE(lse_paged.empty() || std::memcmp(lse_paged.data(), lse_packed.data(),
                                               lse_paged.size() * sizeof(float)) == 0)
      << "lse differs from the packed forward's";

  for (std::int64_t b = 0; b < B; ++b) {
    const std::int64_t Lq = c.q_lengths[b];
    if (Lq == 0) continue;
    SCOPED_TRACE("sequence " + std::to_string(b));
    const Tensor q_b = rows_of(q, cu_q[b], Lq), out_b = rows_of(out_paged, cu_q[b], Lq);
    const Tensor k_b = rows_of(kv.k, cu_k[b], c.k_lengths[b]);
    const Tensor v_b = rows_of(kv.v, cu_k[b], c.k_lengths[b]);
    std::vector<float> lse_b(static_cast<std::size_t>(Hq * Lq));
    for (std::int64_t h = 0; h < Hq; ++h) {
      std::copy_n(&lse_paged[h * total_q + cu_q[b]], Lq, &lse_b[h * Lq]);
    }
    AttentionOptions options_b = options;
    if (c.modifiers)
      options_b.alibi_slopes =
          std::span(slopes).subspan(static_cast<std::size_t>(b * Hq), static_cast<std::size_t>(Hq));
    if (c.impl == AttentionImpl::flash) {
      Tensor unused(c.dtype, q_b.view.shape);
      const detail::AttentionParams p = detail::make_params("test", q_b.view, k_b.view, v_b.view,
                                                            unused.view, nullptr, options_b);
      EXPECT_EQ(detail::cpu::use_flash_decode(p), c.decode) << "the route this case covers";
    }
    expect_near_reference(q_b, k_b, v_b, options_b, out_b, lse_b);
  }
}

std::vector<PagedCase> paged_cases() {
  std::vector<PagedCase> cases;
  // Ragged lengths with empty sequences of either side; 2 query heads per KV head, so that up to
  // 16 query rows take the decode path.
  const std::vector<std::int32_t> k_lengths = {37, 5, 0, 300, 64, 1};
  const std::vector<std::int32_t> decode_q = {1, 0, 5, 16, 3, 1};
  const std::vector<std::int32_t> prefill_q = {40, 0, 130, 33, 64, 50};
  for (const std::int64_t page_size : {1, 7, 16, 256}) {
    for (const bool decode : {true, false}) {
      for (const DType dtype : {DType::f32, DType::f16, DType::bf16}) {
        for (const AttentionImpl impl :
             {AttentionImpl::flash, AttentionImpl::standard, AttentionImpl::reference}) {
          for (const bool causal : {false, true}) {
            for (const int threads : {1, 3}) {
              cases.push_back({decode ? decode_q : prefill_q, k_lengths, page_size, 4, 2,
                               dtype == DType::f32 ? 40 : 64, causal, dtype, impl, threads,
                               decode});
            }
          }
        }
      }
    }
  }
  // A head-major pool, and the score modifiers, on both routes.
  for (const bool decode : {true, false}) {
    for (const AttentionImpl impl :
         {AttentionImpl::flash, AttentionImpl::standard, AttentionImpl::reference}) {
      for (const DType dtype : {DType::f32, DType::bf16}) {
        PagedCase c{
            decode ? decode_q : prefill_q, k_lengths, 7, 4, 2, 64, true, dtype, impl, 3, decode};
        c.head_major = true;
        cases.push_back(c);
        c.head_major = false;
        c.modifiers = true;
        cases.push_back(c);
      }
    }
  }
  // Multi-query (8 query heads on one KV head: up to 4 decode rows each) and an empty batch.
  cases.push_back(
      {{4, 2, 0}, {129, 16, 3}, 16, 8, 1, 32, true, DType::f32, AttentionImpl::flash, 3, true});
  cases.push_back({{}, {}, 16, 2, 1, 16});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, PagedVarlenAgainstPacked, ::testing::ValuesIn(paged_cases()),
                         [](const auto& info) { return case_name(info.param); });

// Bad input over a valid call: 5 pages of 4 rows; sequence 0 has 3 keys (table entry 1 is
// never read and holds garbage), sequence 1 has 6.
struct PagedCall {
  Tensor q{DType::f32, {1, 6, 2, 8}}, out{DType::f32, {1, 6, 2, 8}};
  Tensor k{DType::f32, {5, 4, 1, 8}}, v{DType::f32, {5, 4, 1, 8}};
  std::vector<std::int32_t> cu_q = {0, 2, 6}, cu_k = {0, 3, 9};
  std::vector<std::int32_t> table = {4, 99, 0, 2};
  std::vector<float> lse = std::vector<float>(12, 1.0f);
  PagedKVView kv{k.view, v.view, table.data(), 2};
  TensorView out_view = out.view;
  ConstTensorView q_view = q.view;
  const std::int32_t* cu_k_ptr = cu_k.data();
  std::int64_t batch = 2;
  AttentionImpl impl = AttentionImpl::flash;
  AttentionOptions options;

  PagedCall() {
    q.fill(0.25f);
    k.fill(0.5f);
    v.fill(1.0f);
    out.poison();
  }
  void run() {
    varlen_attention_forward(impl, q_view, kv, cu_q.data(), cu_k_ptr, batch, out_view, lse.data(),
                             options);
  }
};

TEST(PagedVarlen, TheBadInputSuitesCallIsValid) {
  PagedCall call;
  call.run();
  for (std::int64_t i = 0; i < 6; ++i) EXPECT_EQ(call.out.at(0, i, 1, 7), 1.0f) << "row " << i;
}

using BadPagedVarlen = BadCall<PagedCall>;

class PagedVarlenBadInput : public ::testing::TestWithParam<BadPagedVarlen> {};

TEST_P(PagedVarlenBadInput, RaisesANamedErrorAndWritesNothing) { expect_refused(GetParam()); }

std::vector<BadPagedVarlen> bad_paged_varlen() {
  return {
      {"page_past_the_pool", [](PagedCall& c) { c.table[3] = 5; },
       "block_table[1, 1]: expected a page in [0, 5), got 5"},
      {"negative_page", [](PagedCall& c) { c.table[2] = -1; },
       "block_table[1, 0]: expected a page in [0, 5), got -1"},
      {"length_beyond_capacity", [](PagedCall& c) { c.cu_k[2] = 12; },
       "cu_seqlens_k[2] - cu_seqlens_k[1]: expected at most 8 keys (pages_per_sequence 2 x "
       "page_size 4), got 9"},
      {"null_table", [](PagedCall& c) { c.kv.block_table = nullptr; },
       "block_table: expected int32 pages [batch, pages_per_sequence] = [2, 2], got null"},
      {"page_size_0",
       [](PagedCall& c) {
         c.kv.k.shape[1] = 0;
         c.kv.v.shape[1] = 0;
       },
       "k: expected page_size (dim 1) >= 1, got 0"},
      {"negative_pages_per_sequence", [](PagedCall& c) { c.kv.pages_per_sequence = -1; },
       "pages_per_sequence: expected >= 0, got -1"},
      {"k_head_dim",
       [](PagedCall& c) {
         c.kv.k.shape[3] = 4;
         c.kv.v.shape[3] = 4;
       },
       "k: expected head_dim 8 (as q), got 4"},
      {"v_shape", [](PagedCall& c) { c.kv.v.shape[1] = 2; },
       "v: expected shape [5, 4, 1, head_dim_v] (as k but for its head dim), got [5, 2, 1, 8]"},
      {"heads_kv",
       [](PagedCall& c) {
         c.kv.k.shape[2] = 3;
         c.kv.v.shape[2] = 3;
       },
       "k: expected heads_kv dividing heads_q = 2, got heads_kv 3"},
      {"v_dtype", [](PagedCall& c) { c.kv.v.dtype = DType::f16; },
       "v: expected dtype f32 (as q), got f16"},
      {"out_dtype", [](PagedCall& c) { c.out_view.dtype = DType::bf16; },
       "out: expected dtype f32 (as q), got bf16"},
      {"first_key_offset", [](PagedCall& c) { c.cu_k[0] = 1; },
       "cu_seqlens_k[0]: expected 0, got 1"},
      {"decreasing_key_offsets",
       [](PagedCall& c) {
         c.cu_k = {0, 3, 2};
       },
       "cu_seqlens_k[2]: expected >= cu_seqlens_k[1] = 3"},
      {"null_key_offsets", [](PagedCall& c) { c.cu_k_ptr = nullptr; },
       "cu_seqlens_k: expected 3 int32 offsets, got null"},
      {"short_query_total", [](PagedCall& c) { c.cu_q[2] = 5; },
       "cu_seqlens_q[2]: expected 6 (the packed rows), got 5"},
      {"unpacked_out",
       [](PagedCall& c) {
         c.out_view.shape = {2, 3, 2, 8};
       },
       "out: expected a packed [1, total, heads, head_dim] view, got dim 0 = 2"},
      {"out_overlaps_the_pool", [](PagedCall& c) { c.out_view.data = c.k.view.data; },
       "out: expected memory disjoint from k"},
      {"shared_alibi", [](PagedCall& c) { c.options.alibi_slopes = std::span(c.lse).first(3); },
       "alibi_slopes: expected 2 values ([heads_q]) or 4 ([batch, heads_q] = [2, 2]), got 3"},
      {"impl", [](PagedCall& c) { c.impl = static_cast<AttentionImpl>(7); },
       "impl: expected flash, standard or reference"},
  };
}

INSTANTIATE_TEST_SUITE_P(Calls, PagedVarlenBadInput, ::testing::ValuesIn(bad_paged_varlen()),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace flashattn::testing
