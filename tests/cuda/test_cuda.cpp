// The CUDA forward and backward (flashattn/cuda.hpp). Three parts:
//  - the arithmetic the kernels and the host share (cuda/kernel_params.hpp: each row's key
//    interval, the key blocks a query block visits, the blocks that need no mask, the split
//    count), checked on the CPU against the CPU paths' definitions: these run everywhere;
//  - argument errors that are found before any device is asked for: these run everywhere too;
//  - the kernels against the fp64 reference on the DESIGN.md §4 grid, on fresh random inputs,
//    outputs poisoned first, each element held to a bound derived from the roundings the
//    contract allows: these need a GPU and skip, saying so, where there is none.

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "api/params.hpp"
#include "cuda/kernel_params.hpp"
#include "flashattn/cuda.hpp"
#include "test_support.hpp"

namespace flashattn::testing {
namespace {

using cuda::detail::ForwardParams;

ForwardParams mask_params(std::int64_t seqlen_q, std::int64_t seqlen_kv, bool causal,
                          std::int64_t window_left, std::int64_t window_right) {
  ForwardParams p;
  p.seqlen_q = seqlen_q;
  p.seqlen_kv = seqlen_kv;
  p.causal = causal;
  p.window_left = window_left;
  p.window_right = window_right;
  return p;
}

detail::AttentionParams cpu_params(const ForwardParams& p) {
  detail::AttentionParams c;
  c.seqlen_q = p.seqlen_q;
  c.seqlen_kv = p.seqlen_kv;
  c.causal = p.causal;
  c.window_left = p.window_left;
  c.window_right = p.window_right;
  return c;
}

struct MaskCase {
  std::int64_t seqlen_q, seqlen_kv;
  bool causal;
  std::int64_t window_left, window_right;
};

std::vector<MaskCase> random_mask_cases(std::mt19937_64& rng, int count) {
  std::uniform_int_distribution<std::int64_t> length(0, 300), window(-1, 40);
  std::bernoulli_distribution coin(0.5);
  std::vector<MaskCase> cases;
  for (int i = 0; i < count; ++i) {
    cases.push_back(
        {std::max<std::int64_t>(length(rng), 1), length(rng), coin(rng), window(rng), window(rng)});
  }
  return cases;
}

TEST(CudaMaskArithmetic, RowKeysAreTheCpuPathsIntervals) {
  std::mt19937_64 rng(test_seed());
  for (const MaskCase& c : random_mask_cases(rng, 400)) {
    const ForwardParams p =
        mask_params(c.seqlen_q, c.seqlen_kv, c.causal, c.window_left, c.window_right);
    const detail::AttentionParams cpu = cpu_params(p);
    for (std::int64_t row = 0; row < c.seqlen_q; ++row) {
      const auto gpu = cuda::detail::row_keys(p, row);
      const detail::KeyRange expected = cpu.key_range(row);
      if (expected.empty()) {
        ASSERT_LE(gpu.end, gpu.begin) << "row " << row << " seed " << test_seed();
      } else {
        ASSERT_EQ(gpu.begin, expected.begin) << "row " << row << " seed " << test_seed();
        ASSERT_EQ(gpu.end, expected.end) << "row " << row << " seed " << test_seed();
      }
    }
  }
}

TEST(CudaMaskArithmetic, KeyBlocksHoldEveryVisibleKeyAndUnmaskedBlocksAreFullyVisible) {
  std::mt19937_64 rng(test_seed() + 1);
  for (const MaskCase& c : random_mask_cases(rng, 200)) {
    const ForwardParams p =
        mask_params(c.seqlen_q, c.seqlen_kv, c.causal, c.window_left, c.window_right);
    const detail::AttentionParams cpu = cpu_params(p);
    for (const int block_m : {16, 64}) {
      for (const int block_n : {32, 64}) {
        for (std::int64_t row_begin = 0; row_begin < c.seqlen_q; row_begin += block_m) {
          const std::int64_t row_end = std::min<std::int64_t>(row_begin + block_m, c.seqlen_q);
          const auto blocks = cuda::detail::key_blocks(p, row_begin, row_end, block_n);
          for (std::int64_t row = row_begin; row < row_end; ++row) {
            const detail::KeyRange keys = cpu.key_range(row);
            if (keys.empty()) continue;
            ASSERT_GE(keys.begin, blocks.first * block_n) << "row " << row;
            ASSERT_LE(keys.end, blocks.last * block_n) << "row " << row;
          }
          for (std::int64_t key = 0; key < c.seqlen_kv; key += block_n) {
            if (!cuda::detail::block_fully_visible(p, row_begin, row_end, key, key + block_n)) {
              continue;
            }
            for (std::int64_t row = row_begin; row < row_end; ++row) {
              const detail::KeyRange keys = cpu.key_range(row);
              ASSERT_TRUE(keys.begin <= key && key + block_n <= keys.end)
                  << "block of keys " << key << " called unmasked, row " << row << " sees ["
                  << keys.begin << ", " << keys.end << ")";
            }
          }
        }
      }
    }
  }
}

TEST(CudaMaskArithmetic, QueryRowsHoldEveryRowThatSeesAKeyOfTheBlock) {
  std::mt19937_64 rng(test_seed() + 5);
  for (const MaskCase& c : random_mask_cases(rng, 200)) {
    const ForwardParams p =
        mask_params(c.seqlen_q, c.seqlen_kv, c.causal, c.window_left, c.window_right);
    const detail::AttentionParams cpu = cpu_params(p);
    for (std::int64_t key = 0; key < c.seqlen_kv; key += 64) {
      const std::int64_t key_end = std::min<std::int64_t>(key + 64, c.seqlen_kv);
      const auto rows = cuda::detail::query_rows(p, key, key_end);
      ASSERT_LE(rows.first, rows.last);
      for (std::int64_t row = 0; row < c.seqlen_q; ++row) {
        const detail::KeyRange keys = cpu.key_range(row);
        const bool sees = !keys.empty() && keys.begin < key_end && keys.end > key;
        if (sees) {
          ASSERT_TRUE(rows.first <= row && row < rows.last)
              << "row " << row << " sees keys of [" << key << ", " << key_end << ") but lies "
              << "outside [" << rows.first << ", " << rows.last << ")";
        }
      }
      // Tight at both ends: the first and the last row of the interval see a key of the block.
      if (rows.first < rows.last) {
        for (const std::int64_t row : {rows.first, rows.last - 1}) {
          const detail::KeyRange keys = cpu.key_range(row);
          EXPECT_TRUE(keys.begin < key_end && keys.end > key) << "row " << row;
        }
      }
    }
  }
}

TEST(CudaSplits, FillTheGpuWithinTheirLimits) {
  for (const int multiprocessors : {1, 108, 132}) {
    for (const std::int64_t work : {1, 2, 7, 64, 263, 264, 1000}) {
      for (const std::int64_t key_blocks : {0, 1, 3, 4, 17, 64, 2048, 100000}) {
        const int splits = cuda::detail::choose_splits(work, key_blocks, multiprocessors);
        ASSERT_GE(splits, 1);
        ASSERT_LE(splits, 64);
        if (work >= 2 * multiprocessors) {
          ASSERT_EQ(splits, 1) << "the grid is full already";
        }
        if (splits > 1) {
          ASSERT_LE(splits, key_blocks / 4) << "a split gets 4 key blocks or more";
        }
        if (splits < 64 && splits < key_blocks / 4) {
          ASSERT_GE(work * splits, 2 * multiprocessors)
              << "work " << work << " keys " << key_blocks;
        }
      }
    }
  }
}

// ---- argument errors found before any device is asked for ----

struct HostOperands {
  Tensor q, k, v, out;
  HostOperands(DType dtype, std::int64_t head_dim)
      : q(dtype, {1, 16, 2, head_dim}),
        k(dtype, {1, 16, 2, head_dim}),
        v(dtype, {1, 16, 2, head_dim}),
        out(dtype, {1, 16, 2, head_dim}) {}
  void call(const AttentionOptions& options = {}) {
    cuda::flash_attention_forward(q.view, k.view, v.view, out.view, nullptr, options);
  }
};

void expect_error(HostOperands& operands, const std::string& expected,
                  const AttentionOptions& options = {}) {
  try {
    operands.call(options);
    FAIL() << "no Error; expected one saying: " << expected;
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(expected), std::string::npos) << error.what();
    EXPECT_NE(std::string(error.what()).find("cuda::flash_attention_forward"), std::string::npos)
        << error.what();
  }
}

TEST(CudaValidation, WhatTheTensorCoresCannotTakeIsRefusedByName) {
  HostOperands f32(DType::f32, 64);
  expect_error(f32, "expected dtype f16 or bf16");
  HostOperands odd_dim(DType::bf16, 60);
  expect_error(odd_dim, "expected head_dim a multiple of 8 up to 256, got 60");
  HostOperands wide(DType::bf16, 264);
  expect_error(wide, "expected head_dim a multiple of 8 up to 256, got 264");

  HostOperands strided(DType::f16, 64);
  strided.k.view.strides = {16 * 2 * 68, 2 * 68, 68, 1};
  strided.k.bytes.resize(16 * 2 * 68 * 2);
  strided.k.view.data = strided.k.bytes.data();
  expect_error(strided, "k: expected strides that are multiples of 8 elements");

  HostOperands misaligned(DType::bf16, 64);
  misaligned.v.bytes.resize(misaligned.v.bytes.size() + 16);
  misaligned.v.view.data = misaligned.v.bytes.data() + 2;
  expect_error(misaligned, "v: expected data aligned to 16 bytes");

  HostOperands plain(DType::bf16, 64);
  AttentionOptions softcap;
  softcap.softcap = 30.0f;
  expect_error(plain, "softcap: expected none", softcap);
  const std::vector<float> slopes(2, 0.5f);
  AttentionOptions alibi;
  alibi.alibi_slopes = slopes;
  expect_error(plain, "alibi_slopes: expected none", alibi);
}

TEST(CudaValidation, TheCpuContractIsCheckedToo) {
  HostOperands mismatched(DType::bf16, 64);
  mismatched.v.view.dtype = DType::f16;
  expect_error(mismatched, "v: expected dtype bf16 (as q), got f16");
  HostOperands aliased(DType::bf16, 64);
  aliased.out.view.data = aliased.q.view.data;
  expect_error(aliased, "out: expected memory disjoint from q");
  HostOperands bad_window(DType::bf16, 64);
  AttentionOptions window;
  window.window_left = -2;
  expect_error(bad_window, "window", window);
}

TEST(CudaValidation, HostMemoryIsRefusedOrThereIsNoDevice) {
  HostOperands host(DType::bf16, 64);
  if (cuda::device_available()) {
    expect_error(host, "q: expected device or managed memory");
  } else {
    expect_error(host, "expected a CUDA device");
  }
}

TEST(CudaValidation, AnEmptyCallNeedsNoDevice) {
  HostOperands empty(DType::bf16, 64);
  for (Tensor* t : {&empty.q, &empty.out}) t->view.shape[1] = 0;
  EXPECT_NO_THROW(empty.call());
}

// ---- the kernels against the fp64 reference (GPU only) ----

#define SKIP_WITHOUT_GPU()                                               \
  if (!cuda::device_available()) {                                       \
    GTEST_SKIP() << "no CUDA device of compute capability >= 8.0 here: " \
                 << cuda::device_description();                          \
  }

void check(cudaError_t status, const char* what) {
  ASSERT_EQ(status, cudaSuccess) << what << ": " << cudaGetErrorString(status);
}

// A host tensor's bytes on the device, seen through the same strides.
struct DeviceCopy {
  void* data = nullptr;
  std::size_t bytes = 0;
  explicit DeviceCopy(const Tensor& host) : bytes(host.bytes.size()) {
    check(cudaMalloc(&data, bytes), "cudaMalloc");
    check(cudaMemcpy(data, host.bytes.data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  explicit DeviceCopy(std::size_t size) : bytes(size) {
    check(cudaMalloc(&data, std::max<std::size_t>(bytes, 1)), "cudaMalloc");
    check(cudaMemset(data, 0xff, bytes), "cudaMemset");  // NaN in f32, f16 and bf16 alike
  }
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;
  ~DeviceCopy() { cudaFree(data); }
  TensorView view_of(const Tensor& host) const {
    TensorView view = host.view;
    view.data = data;
    return view;
  }
};

struct GpuCase {
  std::int64_t batch, seqlen_q, seqlen_kv, heads_q, heads_kv, head_dim;
  bool causal = false;
  std::int64_t window_left = -1, window_right = -1;
  bool head_major = false;  // q, k, v and out as [B, H, S, D] memory (non-contiguous views)
};

std::string describe(const GpuCase& c, DType dtype) {
  return std::string(dtype_name(dtype)) + " B" + std::to_string(c.batch) + " Sq" +
         std::to_string(c.seqlen_q) + " Skv" + std::to_string(c.seqlen_kv) + " Hq" +
         std::to_string(c.heads_q) + " Hkv" + std::to_string(c.heads_kv) + " D" +
         std::to_string(c.head_dim) + (c.causal ? " causal" : "") + " window(" +
         std::to_string(c.window_left) + "," + std::to_string(c.window_right) + ")" +
         (c.head_major ? " head-major" : "") + " seed " + std::to_string(test_seed());
}

AttentionOptions options_of(const GpuCase& c) {
  AttentionOptions options;
  options.causal = c.causal;
  options.window_left = c.window_left;
  options.window_right = c.window_right;
  return options;
}

// A 16-bit tensor's values as f32 (exact), contiguous.
Tensor widened(const Tensor& t) {
  Tensor wide(DType::f32, t.view.shape);
  t.for_each_index([&](auto a, auto b, auto h, auto d) { wide.set(a, b, h, d, t.at(a, b, h, d)); });
  return wide;
}

Tensor make_operand(DType dtype, std::int64_t batch, std::int64_t seq, std::int64_t heads,
                    std::int64_t dim, bool head_major) {
  if (!head_major) return Tensor(dtype, {batch, seq, heads, dim});
  return Tensor(dtype, {batch, seq, heads, dim}, {heads * seq * dim, dim, seq * dim, 1});
}

// Runs one case on the GPU and holds every output element to the bound derived in the comment.
void expect_matches_reference(const GpuCase& c, DType dtype, std::mt19937_64& rng) {
  Tensor q = make_operand(dtype, c.batch, c.seqlen_q, c.heads_q, c.head_dim, c.head_major);
  Tensor k = make_operand(dtype, c.batch, c.seqlen_kv, c.heads_kv, c.head_dim, c.head_major);
  Tensor v = make_operand(dtype, c.batch, c.seqlen_kv, c.heads_kv, c.head_dim, c.head_major);
  Tensor out = make_operand(dtype, c.batch, c.seqlen_q, c.heads_q, c.head_dim, c.head_major);
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  const AttentionOptions options = options_of(c);

  // The oracle on the same (16-bit, so exactly f32) inputs, fp64 inside.
  Tensor q32 = widened(q), k32 = widened(k), v32 = widened(v), ref(DType::f32, out.view.shape);
  const std::size_t lse_count = static_cast<std::size_t>(c.batch * c.heads_q * c.seqlen_q);
  std::vector<float> ref_lse(lse_count);
  reference_attention_forward(q32.view, k32.view, v32.view, ref.view, ref_lse.data(), options);

  DeviceCopy dq(q), dk(k), dv(v), dout(out.bytes.size()), dlse(lse_count * sizeof(float));
  cudaStream_t stream = nullptr;
  check(cudaStreamCreate(&stream), "cudaStreamCreate");
  cuda::flash_attention_forward(dq.view_of(q), dk.view_of(k), dv.view_of(v), dout.view_of(out),
                                static_cast<float*>(dlse.data), options, stream);
  check(cudaStreamSynchronize(stream), "the forward");
  check(cudaStreamDestroy(stream), "cudaStreamDestroy");
  check(cudaMemcpy(out.bytes.data(), dout.data, out.bytes.size(), cudaMemcpyDeviceToHost),
        "cudaMemcpy");
  std::vector<float> lse(lse_count);
  check(cudaMemcpy(lse.data(), dlse.data, lse_count * sizeof(float), cudaMemcpyDeviceToHost),
        "cudaMemcpy");

  // Bound, per element. u: the dtype's unit roundoff (2^-8 bf16, 2^-11 f16).
  //  - P is rounded to the dtype as the operand of P·V: each weight within u of its value, so
  //    the weighted sum of v moves by at most u·max|v|;
  //  - out is rounded once: u·|out|;
  //  - the fp32 scores (exact 16-bit products, D terms summed in fp32) are off by at most
  //    D·2^-24·D·max|q|·max|k|·scale, which moves lse by as much and each weight by twice that
  //    relatively: 2·that·max|v| in out.
  const double u = dtype == DType::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  double max_q = 0, max_k = 0, max_v = 0;
  q32.for_each_index([&](auto a, auto b, auto h, auto d) {
    max_q = std::max(max_q, std::abs(double(q32.at(a, b, h, d))));
  });
  k32.for_each_index([&](auto a, auto b, auto h, auto d) {
    max_k = std::max(max_k, std::abs(double(k32.at(a, b, h, d))));
    max_v = std::max(max_v, std::abs(double(v32.at(a, b, h, d))));
  });
  const double dim = static_cast<double>(c.head_dim);
  const double score_error = dim * std::ldexp(1.0, -24) * dim * max_q * max_k / std::sqrt(dim);

  const std::string name = describe(c, dtype);
  for (std::int64_t b = 0; b < c.batch; ++b) {
    for (std::int64_t h = 0; h < c.heads_q; ++h) {
      for (std::int64_t i = 0; i < c.seqlen_q; ++i) {
        const std::size_t li = static_cast<std::size_t>((b * c.heads_q + h) * c.seqlen_q + i);
        if (std::isinf(ref_lse[li])) {
          ASSERT_TRUE(std::isinf(lse[li]) && lse[li] < 0)
              << name << " row " << i << " lse " << lse[li];
        } else {
          ASSERT_NEAR(lse[li], ref_lse[li],
                      score_error + 8 * std::ldexp(1.0, -24) * (1 + std::abs(ref_lse[li])))
              << name << " lse of row " << i << " head " << h;
        }
        for (std::int64_t d = 0; d < c.head_dim; ++d) {
          const double expected = ref.at(b, i, h, d), got = out.at(b, i, h, d);
          ASSERT_FALSE(std::isnan(got)) << name << " unwritten or NaN at row " << i << " d " << d;
          const double bound = u * max_v + u * std::abs(expected) + 2 * score_error * max_v;
          ASSERT_NEAR(got, expected, bound) << name << " row " << i << " head " << h << " d " << d;
        }
      }
    }
  }
}

std::vector<GpuCase> grid_cases() {
  std::vector<GpuCase> cases;
  // DESIGN.md §4's sequence lengths, square, over the head dims (each multiple of 8 of the grid).
  for (const std::int64_t s : {1, 2, 3, 7, 64, 113, 127, 128, 129, 203, 255, 1023, 1025}) {
    for (const bool causal : {false, true}) cases.push_back({1, s, s, 2, 1, 64, causal});
  }
  for (const std::int64_t d : {32, 40, 64, 80, 96, 128, 256}) {
    cases.push_back({2, 129, 129, 4, 2, d, false});
    cases.push_back({1, 203, 203, 2, 2, d, true});
  }
  // seqlen_q != seqlen_kv both ways: bottom-right causal, rows with no key at all.
  for (const auto& [sq, skv] :
       {std::pair<std::int64_t, std::int64_t>{113, 203}, {1, 239}, {799, 3}, {203, 113}}) {
    for (const bool causal : {false, true}) cases.push_back({2, sq, skv, 4, 4, 128, causal});
  }
  // Windows, GQA/MQA, head-major strides.
  cases.push_back({1, 255, 255, 8, 2, 128, false, 17, 5});
  cases.push_back({1, 300, 300, 4, 1, 64, true, 64, -1});
  cases.push_back({1, 64, 1025, 2, 2, 128, false, -1, 0});
  cases.push_back({2, 129, 203, 4, 2, 96, true, -1, -1, true});
  cases.push_back({1, 1023, 1025, 2, 1, 256, true, -1, -1, true});
  return cases;
}

TEST(CudaForward, MatchesTheReferenceOnTheGrid) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed());
  for (const DType dtype : {DType::bf16, DType::f16}) {
    for (const GpuCase& c : grid_cases()) {
      expect_matches_reference(c, dtype, rng);
      if (HasFatalFailure()) return;
    }
  }
}

TEST(CudaForward, DecodingSplitsTheKeysAndMergesExactly) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 2);
  // Few query blocks and many keys: the keys are split across multiprocessors and merged.
  for (const GpuCase& c :
       {GpuCase{1, 1, 16384, 8, 2, 128}, GpuCase{2, 3, 5000, 4, 1, 64, true},
        GpuCase{1, 1, 70000, 2, 2, 256}, GpuCase{1, 5, 9000, 2, 2, 128, true, 300, -1}}) {
    for (const DType dtype : {DType::bf16, DType::f16}) {
      expect_matches_reference(c, dtype, rng);
      if (HasFatalFailure()) return;
    }
  }
}

TEST(CudaForward, EmptyKeySequenceGivesZerosAndMinusInfinity) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 3);
  expect_matches_reference({1, 5, 0, 2, 2, 64}, DType::bf16, rng);
}

// ---- the backward against the fp64 reference (GPU only) ----

// Every gradient element of one case held to a bound built, element by element, from the fp64
// magnitudes of the quantities whose roundings the contract allows (u: the dtype's unit roundoff;
// e = 2^-24, fp32's):
//   P    fp32 scores (D·e·scale·Σ|q||k|), lse in fp32, exp2: relative error e_P; then rounded to
//        the dtype (u) as the operand of dV = Pᵀ·dO
//   D    Σ dO·O from the forward's 16-bit O (u·Σ|dO·O|) in fp32 (D·e·Σ|dO·O|)
//   dP   fp32 sums of exact products: D·e·Σ|dO||v|
//   dS   P·(dP − D): the errors above, then rounded to the dtype (u·|dS|) as the operand of
//        dK = scale·dSᵀ·Q and dQ = scale·dS·K
//   sums fp32 over up to S terms (S·e relative) and each gradient rounded once (u·|g|).
// The bound is twice the first-order sum, for the second-order terms it leaves out.
void expect_backward_matches_reference(const GpuCase& c, DType dtype, std::mt19937_64& rng) {
  auto operand = [&](std::int64_t seq, std::int64_t heads) {
    return make_operand(dtype, c.batch, seq, heads, c.head_dim, c.head_major);
  };
  Tensor q = operand(c.seqlen_q, c.heads_q), k = operand(c.seqlen_kv, c.heads_kv),
         v = operand(c.seqlen_kv, c.heads_kv), dout = operand(c.seqlen_q, c.heads_q),
         out = operand(c.seqlen_q, c.heads_q);
  Tensor dq = operand(c.seqlen_q, c.heads_q), dk = operand(c.seqlen_kv, c.heads_kv),
         dv = operand(c.seqlen_kv, c.heads_kv);
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  dout.fill_normal(rng);
  const AttentionOptions options = options_of(c);
  const std::size_t lse_count = static_cast<std::size_t>(c.batch * c.heads_q * c.seqlen_q);
  std::vector<float> lse(lse_count);
  // The forward's out (16-bit) and lse as the GPU backward reads them: the reference's.
  reference_attention_forward(q.view, k.view, v.view, out.view, lse.data(), options);

  Tensor q32 = widened(q), k32 = widened(k), v32 = widened(v), dout32 = widened(dout),
         out32 = widened(out);
  Tensor dq_ref(DType::f32, q.view.shape), dk_ref(DType::f32, k.view.shape),
      dv_ref(DType::f32, v.view.shape), out_ref(DType::f32, q.view.shape);
  std::vector<float> lse_ref(lse_count);
  reference_attention_forward(q32.view, k32.view, v32.view, out_ref.view, lse_ref.data(), options);
  reference_attention_backward(dout32.view, q32.view, k32.view, v32.view, out_ref.view,
                               lse_ref.data(), dq_ref.view, dk_ref.view, dv_ref.view, options);

  // The bounds, accumulated in the gradients' layouts.
  const double u = dtype == DType::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  const double e = std::ldexp(1.0, -24), dim = static_cast<double>(c.head_dim);
  const double scale = 1.0 / std::sqrt(dim), log2e = 1.4426950408889634;
  const double sum_terms = static_cast<double>(std::max(c.seqlen_q, c.seqlen_kv));
  Tensor dq_bound(DType::f32, q.view.shape), dk_bound(DType::f32, k.view.shape),
      dv_bound(DType::f32, v.view.shape);
  ForwardParams mask =
      mask_params(c.seqlen_q, c.seqlen_kv, c.causal,
                  c.window_left < 0 ? -1 : std::min(c.window_left, c.seqlen_q + c.seqlen_kv),
                  c.window_right < 0 ? -1 : std::min(c.window_right, c.seqlen_q + c.seqlen_kv));
  const detail::AttentionParams keys_of = cpu_params(mask);
  const std::int64_t group = c.heads_q / c.heads_kv;
  for (std::int64_t b = 0; b < c.batch; ++b) {
    for (std::int64_t h = 0; h < c.heads_q; ++h) {
      const std::int64_t hk = h / group;
      for (std::int64_t i = 0; i < c.seqlen_q; ++i) {
        const detail::KeyRange keys = keys_of.key_range(i);
        const double row_lse =
            lse_ref[static_cast<std::size_t>((b * c.heads_q + h) * c.seqlen_q + i)];
        if (keys.empty() || std::isinf(row_lse)) continue;
        double dot = 0, dot_abs = 0;  // D_i and Σ|dO·O|
        for (std::int64_t d = 0; d < c.head_dim; ++d) {
          dot += double(dout32.at(b, i, h, d)) * out_ref.at(b, i, h, d);
          dot_abs += std::abs(double(dout32.at(b, i, h, d)) * out_ref.at(b, i, h, d));
        }
        const double dot_error = (u + dim * e) * dot_abs;
        for (std::int64_t j = keys.begin; j < keys.end; ++j) {
          double score = 0, score_abs = 0, dp = 0, dp_abs = 0;
          for (std::int64_t d = 0; d < c.head_dim; ++d) {
            score += double(q32.at(b, i, h, d)) * k32.at(b, j, hk, d);
            score_abs += std::abs(double(q32.at(b, i, h, d)) * k32.at(b, j, hk, d));
            dp += double(dout32.at(b, i, h, d)) * v32.at(b, j, hk, d);
            dp_abs += std::abs(double(dout32.at(b, i, h, d)) * v32.at(b, j, hk, d));
          }
          const double p = std::exp(score * scale - row_lse);
          const double e_p = dim * e * scale * score_abs +
                             4 * e * (1 + (std::abs(score * scale) + std::abs(row_lse)) * log2e);
          const double ds = p * (dp - dot);
          const double ds_error =
              p * (e_p * std::abs(dp - dot) + dim * e * dp_abs + dot_error) + u * std::abs(ds);
          for (std::int64_t d = 0; d < c.head_dim; ++d) {
            dv_bound.set(
                b, j, hk, d,
                dv_bound.at(b, j, hk, d) + float(p * (u + e_p) * std::abs(dout32.at(b, i, h, d))));
            dk_bound.set(
                b, j, hk, d,
                dk_bound.at(b, j, hk, d) + float(scale * ds_error * std::abs(q32.at(b, i, h, d))));
            dq_bound.set(
                b, i, h, d,
                dq_bound.at(b, i, h, d) + float(scale * ds_error * std::abs(k32.at(b, j, hk, d))));
          }
        }
      }
    }
  }

  DeviceCopy ddout(dout), dq_(q), dk_(k), dv_(v), dout_(out), dlse(lse_count * sizeof(float));
  check(cudaMemcpy(dlse.data, lse.data(), lse_count * sizeof(float), cudaMemcpyHostToDevice),
        "cudaMemcpy");
  DeviceCopy ddq(dq.bytes.size()), ddk(dk.bytes.size()), ddv(dv.bytes.size());
  cuda::flash_attention_backward(ddout.view_of(dout), dq_.view_of(q), dk_.view_of(k),
                                 dv_.view_of(v), dout_.view_of(out),
                                 static_cast<const float*>(dlse.data), ddq.view_of(dq),
                                 ddk.view_of(dk), ddv.view_of(dv), options);
  check(cudaDeviceSynchronize(), "the backward");
  check(cudaMemcpy(dq.bytes.data(), ddq.data, dq.bytes.size(), cudaMemcpyDeviceToHost),
        "cudaMemcpy");
  check(cudaMemcpy(dk.bytes.data(), ddk.data, dk.bytes.size(), cudaMemcpyDeviceToHost),
        "cudaMemcpy");
  check(cudaMemcpy(dv.bytes.data(), ddv.data, dv.bytes.size(), cudaMemcpyDeviceToHost),
        "cudaMemcpy");

  const std::string name = describe(c, dtype);
  auto expect_within = [&](const char* what, const Tensor& got, const Tensor& expected,
                           const Tensor& bound) {
    got.for_each_index([&](auto a, auto s_, auto h, auto d) {
      if (::testing::Test::HasFatalFailure()) return;
      const double g = got.at(a, s_, h, d), x = expected.at(a, s_, h, d);
      const double limit =
          2 * (bound.at(a, s_, h, d) * (1 + sum_terms * e) + u * std::abs(x)) + e * std::abs(x);
      ASSERT_FALSE(std::isnan(g)) << name << " " << what << " unwritten or NaN at " << s_ << ","
                                  << h << "," << d;
      ASSERT_NEAR(g, x, limit) << name << " " << what << " at seq " << s_ << " head " << h << " d "
                               << d;
    });
  };
  expect_within("dq", dq, dq_ref, dq_bound);
  expect_within("dk", dk, dk_ref, dk_bound);
  expect_within("dv", dv, dv_ref, dv_bound);
}

std::vector<GpuCase> backward_cases() {
  std::vector<GpuCase> cases;
  for (const std::int64_t s : {1, 7, 64, 113, 129, 255}) {
    for (const bool causal : {false, true}) cases.push_back({1, s, s, 2, 1, 64, causal});
  }
  for (const std::int64_t d : {32, 40, 64, 80, 96, 128})
    cases.push_back({1, 129, 129, 2, 2, d, true});
  for (const auto& [sq, skv] :
       {std::pair<std::int64_t, std::int64_t>{113, 203}, {1, 239}, {203, 3}, {203, 113}}) {
    for (const bool causal : {false, true}) cases.push_back({2, sq, skv, 4, 2, 128, causal});
  }
  cases.push_back({1, 255, 255, 8, 2, 128, false, 17, 5});
  cases.push_back({1, 64, 300, 2, 2, 64, false, -1, 0});
  cases.push_back({2, 129, 203, 4, 2, 96, true, -1, -1, true});
  cases.push_back({1, 0, 70, 2, 2, 64});  // no queries: dk = dv = 0
  cases.push_back({1, 70, 0, 2, 2, 64});  // no keys: dq = 0
  return cases;
}

TEST(CudaBackward, MatchesTheReferenceWithinTheDerivedBound) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 4);
  for (const DType dtype : {DType::bf16, DType::f16}) {
    for (const GpuCase& c : backward_cases()) {
      expect_backward_matches_reference(c, dtype, rng);
      if (HasFatalFailure()) return;
    }
  }
}

TEST(CudaValidation, TheBackwardRefusesWhatItCannotTake) {
  std::vector<float> lse(32);
  HostOperands f32(DType::f32, 64);
  Tensor dq(DType::f32, f32.q.view.shape), dk(DType::f32, f32.k.view.shape),
      dv(DType::f32, f32.v.view.shape), out(DType::f32, f32.q.view.shape);
  try {
    cuda::flash_attention_backward(f32.q.view, f32.q.view, f32.k.view, f32.v.view, out.view,
                                   lse.data(), dq.view, dk.view, dv.view);
    FAIL() << "no Error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("expected dtype f16 or bf16"), std::string::npos)
        << error.what();
  }
  HostOperands d136(DType::bf16, 136);
  Tensor dq2(DType::bf16, d136.q.view.shape), dk2(DType::bf16, d136.k.view.shape),
      dv2(DType::bf16, d136.v.view.shape), dout2(DType::bf16, d136.q.view.shape);
  try {
    cuda::flash_attention_backward(dout2.view, d136.q.view, d136.k.view, d136.v.view, d136.out.view,
                                   lse.data(), dq2.view, dk2.view, dv2.view);
    FAIL() << "no Error";
  } catch (const Error& error) {
    EXPECT_NE(
        std::string(error.what()).find("expected head_dim a multiple of 8 up to 128, got 136"),
        std::string::npos)
        << error.what();
  }
}

}  // namespace
}  // namespace flashattn::testing
