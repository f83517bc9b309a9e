// Size limits: element counts, offsets and byte counts are computed in 64 bits with overflow
// checks; a problem whose scratch memory cannot fit is refused before anything is allocated or
// written; a scratch allocation that fails anyway raises Error instead of terminating. Large
// logical tensors cost nothing here: inputs may broadcast with stride 0.

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <string>

#include "test_support.hpp"

#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define FLASHATTN_TEST_SANITIZED 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define FLASHATTN_TEST_SANITIZED 1
#endif

namespace flashattn::testing {
namespace {

constexpr AttentionImpl kAllImpls[] = {AttentionImpl::flash, AttentionImpl::standard,
                                       AttentionImpl::reference};
constexpr std::int64_t kTwo40 = std::int64_t{1} << 40;

// A view of `shape` over a single element repeated everywhere (every stride 0 but the last dim's,
// over a buffer of head_dim elements): any size, for inputs only.
ConstTensorView broadcast(const std::vector<float>& row, std::array<std::int64_t, 4> shape) {
  return {row.data(), DType::f32, shape, {0, 0, 0, 1}};
}

// Runs every path on the views and expects an Error naming `part`, with out and lse untouched.
void expect_refused(const ConstTensorView& q, const ConstTensorView& k, const ConstTensorView& v,
                    const TensorView& out, const std::string& part,
                    const std::vector<AttentionImpl>& impls = {std::begin(kAllImpls),
                                                               std::end(kAllImpls)}) {
  for (AttentionImpl impl : impls) {
    // A real lse buffer where its size is sane; none for the shapes that overflow.
    std::int64_t lse_count = 0;
    const bool sane = !__builtin_mul_overflow(out.shape[0], out.shape[1], &lse_count) &&
                      !__builtin_mul_overflow(lse_count, out.shape[2], &lse_count) &&
                      lse_count <= (1 << 20);
    std::vector<float> lse(sane ? static_cast<std::size_t>(lse_count) : 0, NAN);
    try {
      attention_forward(impl, q, k, v, out, sane ? lse.data() : nullptr);
      ADD_FAILURE() << impl_name(impl) << ": no error raised";
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find(part), std::string::npos)
          << impl_name(impl) << ": \"" << error.what() << "\" lacks \"" << part << "\"";
    }
    for (float x : lse) EXPECT_TRUE(std::isnan(x)) << impl_name(impl) << ": lse written";
  }
}

TEST(SizeLimits, ElementCountThatOverflowsIsAnError) {
  std::vector<float> row(8, 1.0f), out_buffer(64, NAN);
  const std::array<std::int64_t, 4> huge{std::int64_t{1} << 21, std::int64_t{1} << 21,
                                         std::int64_t{1} << 21, 8};
  const TensorView out{out_buffer.data(), DType::f32, huge, contiguous_strides(huge)};
  expect_refused(broadcast(row, huge), broadcast(row, {huge[0], 4, 1, 8}),
                 broadcast(row, {huge[0], 4, 1, 8}), out, "overflows a 64-bit element count");
  for (float x : out_buffer) ASSERT_TRUE(std::isnan(x)) << "out written";
}

TEST(SizeLimits, OffsetThatOverflowsIsAnError) {
  std::vector<float> data(64, 1.0f), out_buffer(2 * 4 * 8, NAN);
  const TensorView out = contiguous_view(out_buffer.data(), {2, 4, 1, 8});
  ConstTensorView k = contiguous_view(data.data(), {2, 4, 1, 8});
  k.strides[0] = std::numeric_limits<std::int64_t>::max() / 2 + 1;
  expect_refused(contiguous_view(data.data(), {2, 4, 1, 8}), k,
                 contiguous_view(data.data(), {2, 4, 1, 8}), out, "overflows a 64-bit");
  for (float x : out_buffer) ASSERT_TRUE(std::isnan(x)) << "out written";
}

TEST(SizeLimits, DimsAbove2To61AreAnError) {
  std::vector<float> row(8, 1.0f), out_buffer(4 * 8, NAN);
  const std::int64_t too_long = (std::int64_t{1} << 61) + 1;
  expect_refused(broadcast(row, {1, 4, 1, 8}), broadcast(row, {1, too_long, 1, 8}),
                 broadcast(row, {1, too_long, 1, 8}),
                 contiguous_view(out_buffer.data(), {1, 4, 1, 8}), "expected dims <= 2^61");
}

// 2^17 queries against 2^24 keys: the standard path's score matrix alone would be 8 TiB. The
// reference's per-thread row of 2^40 fp64 scores, 8 TiB too. Both are refused up front, with
// the bytes and the shape in the message; out (4 MiB, real) stays untouched.
TEST(SizeLimits, ScratchThatCannotFitIsRefusedBeforeAnyWrite) {
  std::vector<float> row(8, 0.5f);
  const std::int64_t queries = std::int64_t{1} << 17;
  std::vector<float> out_buffer(static_cast<std::size_t>(queries * 8), NAN);
  const TensorView out = contiguous_view(out_buffer.data(), {1, queries, 1, 8});
  expect_refused(broadcast(row, {1, queries, 1, 8}), broadcast(row, {1, 1 << 24, 1, 8}),
                 broadcast(row, {1, 1 << 24, 1, 8}), out, "scratch memory",
                 {AttentionImpl::standard});
  const TensorView few = contiguous_view(out_buffer.data(), {1, 4, 1, 8});
  expect_refused(broadcast(row, {1, 4, 1, 8}), broadcast(row, {1, kTwo40, 1, 8}),
                 broadcast(row, {1, kTwo40, 1, 8}), few, "seqlen_kv 1099511627776",
                 {AttentionImpl::standard, AttentionImpl::reference});
  for (float x : out_buffer) ASSERT_TRUE(std::isnan(x)) << "out written";
}

// The flash backward's dbias sums (fp64, one per element of the bias) count against the limit:
// a [1, 1, 2^16, 2^16] bias needs 32 GiB of them, and the call is refused before any write. dbias
// itself is address space reserved without access (mmap PROT_NONE), so a write there would crash.
TEST(SizeLimits, FlashDbiasSumsCountAgainstTheLimit) {
  const std::int64_t S = std::int64_t{1} << 16;
  ASSERT_LT(memory_limit_bytes(), 8 * S * S) << "a machine with more than 32 GiB: pick a larger S";
  std::vector<float> row(8, 0.5f), lse(static_cast<std::size_t>(S), 0.0f);
  std::vector<float> out(static_cast<std::size_t>(S * 8)), dq(out.size(), NAN), dk(out.size(), NAN),
      dv(out.size(), NAN);
  const std::size_t dbias_bytes = static_cast<std::size_t>(S * S) * sizeof(float);
  void* reserved =
      mmap(nullptr, dbias_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  ASSERT_NE(reserved, MAP_FAILED);
  AttentionOptions options;
  options.bias = {row.data(), DType::f32, {1, 1, S, S}, {0, 0, 0, 0}};
  ModifierGradients gradients;
  gradients.dbias = contiguous_view(static_cast<float*>(reserved), {1, 1, S, S});
  try {
    flash_attention_backward(
        broadcast(row, {1, S, 1, 8}), broadcast(row, {1, S, 1, 8}), broadcast(row, {1, S, 1, 8}),
        broadcast(row, {1, S, 1, 8}), contiguous_view(out.data(), {1, S, 1, 8}), lse.data(),
        contiguous_view(dq.data(), {1, S, 1, 8}), contiguous_view(dk.data(), {1, S, 1, 8}),
        contiguous_view(dv.data(), {1, S, 1, 8}), options, gradients);
    ADD_FAILURE() << "no error raised";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("scratch memory fits"), std::string::npos)
        << error.what();
  }
  munmap(reserved, dbias_bytes);
  for (const std::vector<float>* gradient : {&dq, &dk, &dv}) {
    for (float x : *gradient) ASSERT_TRUE(std::isnan(x)) << "a gradient written";
  }
}

TEST(SizeLimits, ScoreBufferBytesRefusesOverflowAndNegativeSizes) {
  EXPECT_THROW(score_buffer_bytes(AttentionImpl::standard, kTwo40, kTwo40, 8), Error);
  EXPECT_THROW(score_buffer_bytes(AttentionImpl::standard, -1, 8, 8), Error);
  EXPECT_THROW(score_buffer_bytes(AttentionImpl::flash, 8, 8, 0), Error);
  AttentionOptions one_thread;
  one_thread.num_threads = 1;
  EXPECT_EQ(score_buffer_bytes(AttentionImpl::standard, 1 << 20, 1 << 20, 8, one_thread),
            std::int64_t{4} << 40);
}

// visible_pairs counts in closed form: the same as row by row on every small case, exact where
// the row loop would take hours, and an Error where the count exceeds 64 bits.
TEST(SizeLimits, VisiblePairsIsExactAtAnySize) {
  for (std::int64_t sq = 0; sq <= 9; ++sq) {
    for (std::int64_t skv = 0; skv <= 9; ++skv) {
      for (bool causal : {false, true}) {
        for (std::int64_t left : {-1, 0, 1, 3, 20}) {
          for (std::int64_t right : {-1, 0, 2, 20}) {
            AttentionOptions options;
            options.causal = causal;
            options.window_left = left;
            options.window_right = right;
            detail::AttentionParams rows;
            rows.seqlen_q = sq;
            rows.seqlen_kv = skv;
            rows.causal = causal;
            rows.window_left = left;
            rows.window_right = right;
            std::int64_t expected = 0;
            for (std::int64_t i = 0; i < sq; ++i) {
              const detail::KeyRange keys = rows.key_range(i);
              expected += keys.end - keys.begin;
            }
            EXPECT_EQ(visible_pairs(sq, skv, options), expected)
                << "Sq " << sq << " Skv " << skv << " causal " << causal << " window " << left
                << "," << right;
          }
        }
      }
    }
  }
  AttentionOptions causal;
  causal.causal = true;
  const std::int64_t n = std::int64_t{1} << 31;
  EXPECT_EQ(visible_pairs(n, n, causal), n * (n + 1) / 2);
  EXPECT_THROW(visible_pairs(kTwo40, kTwo40, {}), Error);
  EXPECT_THROW(visible_pairs(-1, 4, {}), Error);
}

// A window wider than both sequences is the unbounded window, with no overflow on the way
// (the mask arithmetic adds the window to the diagonal).
TEST(SizeLimits, HugeWindowsActAsUnbounded) {
  std::mt19937_64 rng(test_seed());
  Tensor q(DType::f32, {2, 9, 2, 8}), k(DType::f32, {2, 13, 2, 8}), v(DType::f32, {2, 13, 2, 8});
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  for (AttentionImpl impl : kAllImpls) {
    for (bool causal : {false, true}) {
      AttentionOptions unbounded, huge;
      unbounded.causal = huge.causal = causal;
      huge.window_left = huge.window_right = std::numeric_limits<std::int64_t>::max();
      Tensor expected(DType::f32, q.view.shape), got(DType::f32, q.view.shape);
      attention_forward(impl, q.view, k.view, v.view, expected.view, nullptr, unbounded);
      attention_forward(impl, q.view, k.view, v.view, got.view, nullptr, huge);
      EXPECT_EQ(got.bytes, expected.bytes) << impl_name(impl) << " causal " << causal;
    }
  }
  AttentionOptions huge;
  huge.window_left = huge.window_right = std::numeric_limits<std::int64_t>::max();
  EXPECT_EQ(visible_pairs(9, 13, huge), 9 * 13);
}

// One call per path whose scratch memory passes the up-front check (well below physical memory)
// but not a 256 MiB cap: flash holds a whole GQA group of 2^20 query heads in its one task;
// standard holds a 4096 x 2^17 score matrix (2 GiB) per head in flight, one head (a serial loop) or
// four (an OpenMP region); the reference holds a row of 2^28 fp64 scores (2 GiB) per thread.
struct AllocationCase {
  const char* name;
  AttentionImpl impl;
  std::int64_t seqlen_q, seqlen_kv, heads_q;
};

void PrintTo(const AllocationCase& c, std::ostream* os) { *os << c.name; }

constexpr AllocationCase kAllocationCases[] = {
    {"flash", AttentionImpl::flash, 1, 4, std::int64_t{1} << 20},
    {"standard_OneHead", AttentionImpl::standard, 4096, 1 << 17, 1},
    {"standard_FourHeads", AttentionImpl::standard, 4096, 1 << 17, 4},
    {"reference", AttentionImpl::reference, 4, std::int64_t{1} << 28, 1},
};

#ifndef FLASHATTN_TEST_SANITIZED
std::int64_t address_space_in_use() {
  std::ifstream statm("/proc/self/statm");
  std::int64_t pages = 0;
  statm >> pages;
  return pages * ::sysconf(_SC_PAGESIZE);
}
#endif

// In a child process with the address space capped 256 MiB above what it already uses, the
// failed scratch allocation must raise Error, not std::bad_alloc and not std::terminate.
// Sanitizer runtimes reserve terabytes of address space and abort on allocation failure, so
// these tests need a plain build. The child runs warm_up() first, which starts the thread pools
// (OpenMP, OpenBLAS), then caps itself and runs call(); its exit status says what happened.
template <class WarmUp, class Call>
void expect_out_of_memory_error(WarmUp&& warm_up, Call&& call) {
#ifdef FLASHATTN_TEST_SANITIZED
  (void)warm_up;
  (void)call;
  GTEST_SKIP() << "RLIMIT_AS cannot cap a sanitized process";
#else
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto capped_call = [&] {
    warm_up();
    const rlimit cap{static_cast<rlim_t>(address_space_in_use() + (256 << 20)), RLIM_INFINITY};
    ::setrlimit(RLIMIT_AS, &cap);
    try {
      call();
    } catch (const Error& error) {
      std::_Exit(std::string(error.what()).find("out of memory") != std::string::npos ? 0 : 4);
    } catch (...) {
      std::_Exit(2);
    }
    std::_Exit(3);
  };
  EXPECT_EXIT(capped_call(), ::testing::ExitedWithCode(0), "");
#endif
}

class AllocationFailureDeathTest : public ::testing::TestWithParam<AllocationCase> {};

TEST_P(AllocationFailureDeathTest, RaisesErrorNotTerminate) {
  const AllocationCase& c = GetParam();
  std::vector<float> row(8, 0.25f);
  std::vector<float> out_buffer(static_cast<std::size_t>(c.seqlen_q * c.heads_q * 8), NAN);
  const TensorView out = contiguous_view(out_buffer.data(), {1, c.seqlen_q, c.heads_q, 8});
  AttentionOptions options;
  options.num_threads = 2;
  expect_out_of_memory_error(
      [&] {
        Tensor q(DType::f32, {1, 4, 1, 8}), o(DType::f32, {1, 4, 1, 8});
        attention_forward(c.impl, q.view, q.view, q.view, o.view, nullptr, options);
      },
      [&] {
        attention_forward(c.impl, broadcast(row, {1, c.seqlen_q, c.heads_q, 8}),
                          broadcast(row, {1, c.seqlen_kv, 1, 8}),
                          broadcast(row, {1, c.seqlen_kv, 1, 8}), out, nullptr, options);
      });
}

INSTANTIATE_TEST_SUITE_P(AllPaths, AllocationFailureDeathTest,
                         ::testing::ValuesIn(kAllocationCases),
                         [](const auto& info) { return std::string(info.param.name); });

// The same for the backward: flash, with one K/V chunk per group, lays out a whole GQA group of
// 2^17 query heads (Q and dO panels, 1 GiB) in each thread's scratch; standard holds P and dS of
// a 4096 x 2^16 head (2 GiB). out and the gradients are real memory, allocated before the cap.
constexpr AllocationCase kBackwardAllocationCases[] = {
    {"flash", AttentionImpl::flash, 1, 4, std::int64_t{1} << 17},
    {"standard", AttentionImpl::standard, 4096, 1 << 16, 1},
};

class BackwardAllocationFailureDeathTest : public ::testing::TestWithParam<AllocationCase> {};

TEST_P(BackwardAllocationFailureDeathTest, RaisesErrorNotTerminate) {
  const AllocationCase& c = GetParam();
  std::vector<float> row(8, 0.25f);
  std::vector<float> lse(static_cast<std::size_t>(c.seqlen_q * c.heads_q), 0.0f);
  Tensor out(DType::f32, {1, c.seqlen_q, c.heads_q, 8});  // a forward's output: real memory
  Tensor dq(DType::f32, {1, c.seqlen_q, c.heads_q, 8});
  Tensor dk(DType::f32, {1, c.seqlen_kv, 1, 8}), dv(DType::f32, {1, c.seqlen_kv, 1, 8});
  AttentionOptions options;
  options.num_threads = 2;
  expect_out_of_memory_error(
      [&] {
        Tensor q(DType::f32, {1, 4, 1, 8}), o(DType::f32, {1, 4, 1, 8});
        Tensor small_dq(DType::f32, {1, 4, 1, 8}), small_dk(DType::f32, {1, 4, 1, 8}),
            small_dv(DType::f32, {1, 4, 1, 8});
        std::vector<float> small_lse(4, 0.0f);
        attention_backward(c.impl, q.view, q.view, q.view, q.view, o.view, small_lse.data(),
                           small_dq.view, small_dk.view, small_dv.view, options);
      },
      [&] {
        const ConstTensorView q_shaped = broadcast(row, {1, c.seqlen_q, c.heads_q, 8});
        const ConstTensorView kv_shaped = broadcast(row, {1, c.seqlen_kv, 1, 8});
        attention_backward(c.impl, q_shaped, q_shaped, kv_shaped, kv_shaped, out.view, lse.data(),
                           dq.view, dk.view, dv.view, options);
      });
}

INSTANTIATE_TEST_SUITE_P(BothPaths, BackwardAllocationFailureDeathTest,
                         ::testing::ValuesIn(kBackwardAllocationCases),
                         [](const auto& info) { return std::string(info.param.name); });

// The layer's own buffers too: its weights (hidden 8192: 1 GiB), the activations a forward
// keeps and the gradients of a backward ([32768, 512] rows: 64 MiB per matrix, x and y and dy
// real memory allocated before the cap) raise Error, not std::bad_alloc.
TEST(MultiHeadAttentionAllocationFailureDeathTest, RaisesErrorNotTerminate) {
#ifdef FLASHATTN_TEST_SANITIZED
  // Each check below is skipped there (expect_out_of_memory_error says why), and the forward the
  // last one needs first, [8, 4096, 512] with the plain-loop sgemm of the sanitizer builds, ran
  // past CTest's 600 s under ThreadSanitizer on a Zen 3 guest.
  GTEST_SKIP() << "RLIMIT_AS cannot cap a sanitized process";
#endif
  constexpr std::int64_t kHidden = 512, kBatch = 8, kSeq = 4096;
  auto warm_up = [] {
    MultiHeadAttention small({16, 2});
    small.init_random(1);
    std::vector<float> x(4 * 16, 0.5f), y(x.size());
    MultiHeadAttention::Activations saved;
    small.forward(x.data(), 1, 4, y.data(), saved);
    small.backward(y.data(), saved);
  };
  expect_out_of_memory_error(warm_up, [] { MultiHeadAttention layer({8192, 64}); });

  MultiHeadAttention layer({kHidden, 8});
  layer.init_random(1);
  std::vector<float> x(static_cast<std::size_t>(kBatch * kSeq * kHidden), 0.25f), y(x.size());
  expect_out_of_memory_error(warm_up, [&] {
    MultiHeadAttention::Activations saved;
    layer.forward(x.data(), kBatch, kSeq, y.data(), saved);
  });
  // A forward's activations, kept before the cap: then the backward's gradients do not fit.
  MultiHeadAttention::Activations saved;
  layer.forward(x.data(), kBatch, kSeq, y.data(), saved);
  expect_out_of_memory_error(warm_up, [&] { layer.backward(y.data(), saved); });
}

}  // namespace
}  // namespace flashattn::testing
