// flashattn/introspect.hpp: the scratch estimates are what the calls check and refuse with,
// validation names the argument as the calls do, and the CPU queries name known paths.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "flashattn/backward.hpp"
#include "flashattn/error.hpp"
#include "flashattn/introspect.hpp"
#include "flashattn/version.hpp"
#include "test_support.hpp"

namespace flashattn::testing {
namespace {

// The bytes a refusal says the call needs: "... got one that needs <bytes> bytes (...".
std::int64_t bytes_in_refusal(const std::string& message) {
  const std::string marker = "got one that needs ";
  const std::size_t at = message.find(marker);
  if (at == std::string::npos) return -1;
  return std::stoll(message.substr(at + marker.size()));
}

// Runs `call`, expects an Error whose message holds every one of `parts`.
template <class Call>
void expect_error(Call call, const std::vector<std::string>& parts) {
  try {
    call();
    ADD_FAILURE() << "no error raised";
  } catch (const Error& error) {
    for (const std::string& part : parts) {
      EXPECT_NE(std::string(error.what()).find(part), std::string::npos)
          << "\"" << error.what() << "\" lacks \"" << part << "\"";
    }
  }
}

// The standard path's score matrix of 2^17 queries against 2^24 keys, 8 TiB: the call refuses
// it, and the bytes it gives are forward_scratch_bytes'. The inputs are one row broadcast.
TEST(Introspect, ForwardScratchIsWhatARefusedCallNeeds) {
  std::vector<float> row(8, 0.5f);
  const std::int64_t queries = std::int64_t{1} << 17, keys = std::int64_t{1} << 24;
  const ConstTensorView q{row.data(), DType::f32, {1, queries, 1, 8}, {0, 0, 0, 1}};
  const ConstTensorView kv{row.data(), DType::f32, {1, keys, 1, 8}, {0, 0, 0, 1}};
  std::vector<float> out_buffer(static_cast<std::size_t>(queries * 8));
  const TensorView out = contiguous_view(out_buffer.data(), {1, queries, 1, 8});
  const std::int64_t needed =
      forward_scratch_bytes(AttentionImpl::standard, q, kv, kv, out, nullptr);
  EXPECT_GT(needed, memory_limit_bytes());
  std::int64_t refused = -1;
  try {
    standard_attention_forward(q, kv, kv, out, nullptr);
  } catch (const Error& error) {
    refused = bytes_in_refusal(error.what());
  }
  EXPECT_EQ(refused, needed);
}

TEST(Introspect, ScratchIsPositiveAndGrowsWithSeqlenForTheStandardPath) {
  std::int64_t previous_forward = 0, previous_backward = 0;
  for (const std::int64_t seqlen : {64, 128, 256}) {
    Tensor q(DType::f32, {1, seqlen, 2, 16}), out(DType::f32, {1, seqlen, 2, 16});
    Tensor dq(DType::f32, {1, seqlen, 2, 16}), dk(DType::f32, {1, seqlen, 2, 16});
    Tensor dv(DType::f32, {1, seqlen, 2, 16});
    std::vector<float> lse(static_cast<std::size_t>(2 * seqlen));
    const std::int64_t forward = forward_scratch_bytes(AttentionImpl::standard, q.view, q.view,
                                                       q.view, out.view, lse.data());
    const std::int64_t backward =
        backward_scratch_bytes(AttentionImpl::standard, out.view, q.view, q.view, q.view, out.view,
                               lse.data(), dq.view, dk.view, dv.view);
    EXPECT_GT(forward, previous_forward) << "seqlen " << seqlen;
    EXPECT_GT(backward, previous_backward) << "seqlen " << seqlen;
    previous_forward = forward;
    previous_backward = backward;
    for (const AttentionImpl impl : {AttentionImpl::flash, AttentionImpl::reference}) {
      EXPECT_GT(forward_scratch_bytes(impl, q.view, q.view, q.view, out.view, lse.data()), 0)
          << impl_name(impl);
      EXPECT_GT(backward_scratch_bytes(impl, out.view, q.view, q.view, q.view, out.view, lse.data(),
                                       dq.view, dk.view, dv.view),
                0)
          << impl_name(impl);
    }
  }
}

TEST(Introspect, BadArgumentsRaiseErrorNamingThem) {
  Tensor q(DType::f32, {1, 5, 4, 8}), out(DType::f32, {1, 5, 4, 8});
  Tensor k(DType::f32, {1, 7, 2, 16}), v(DType::f32, {1, 7, 2, 8});
  Tensor dq(DType::f32, {1, 5, 4, 8}), dk(DType::f32, {1, 7, 2, 8}), dv(DType::f32, {1, 7, 2, 8});
  std::vector<float> lse(4 * 5);
  expect_error(
      [&] {
        forward_scratch_bytes(AttentionImpl::flash, q.view, k.view, v.view, out.view, lse.data());
      },
      {"forward_scratch_bytes: ", "k: expected head_dim 8 (as q), got 16"});
  expect_error(
      [&] {
        backward_scratch_bytes(AttentionImpl::flash, out.view, q.view, v.view, v.view, out.view,
                               nullptr, dq.view, dk.view, dv.view);
      },
      {"backward_scratch_bytes: ", "lse"});
  const Tensor wrong_dq(DType::f32, {1, 5, 4, 4});
  expect_error(
      [&] {
        backward_scratch_bytes(AttentionImpl::standard, out.view, q.view, v.view, v.view, out.view,
                               lse.data(), wrong_dq.view, dk.view, dv.view);
      },
      {"backward_scratch_bytes: ", "dq"});
  expect_error(
      [&] {
        forward_scratch_bytes(static_cast<AttentionImpl>(7), q.view, v.view, v.view, out.view,
                              lse.data());
      },
      {"forward_scratch_bytes: impl: expected flash, standard or reference"});
}

TEST(Introspect, MemoryLimitIsPositive) { EXPECT_GT(memory_limit_bytes(), 0); }

TEST(Introspect, CpuQueriesNameKnownPaths) {
  const std::set<std::string> simd_targets = {"none",    "SCALAR",    "EMU128",   "SSE2",
                                              "SSSE3",   "SSE4",      "AVX2",     "AVX3",
                                              "AVX3_DL", "AVX3_ZEN4", "AVX3_SPR", "AVX10_2"};
  EXPECT_EQ(simd_targets.count(simd_target()), 1u) << simd_target();
  EXPECT_EQ(std::string(simd_target()), simd_target()) << "the same name on every call";
  const std::string products = bf16_products();
  EXPECT_TRUE(products == "widened" || products == "avx512_bf16" || products == "amx") << products;
  if (!amx_supported()) {
    EXPECT_NE(products, "amx");
  }
}

TEST(Introspect, VersionAndBlasDescribeThisBuild) {
  // The library's version is the one its headers were generated with: CMake's project version.
  EXPECT_STREQ(version(), FLASHATTN_VERSION_STRING);
  EXPECT_EQ(std::string(version()), std::to_string(FLASHATTN_VERSION_MAJOR) + "." +
                                        std::to_string(FLASHATTN_VERSION_MINOR) + "." +
                                        std::to_string(FLASHATTN_VERSION_PATCH));
  const std::string name = blas();
  EXPECT_TRUE(name.starts_with("OpenBLAS ") || name == "plain-loop sgemm (FLASHATTN_PLAIN_BLAS)")
      << name;
  EXPECT_EQ(std::string(blas()), name) << "the same text on every call";
}

}  // namespace
}  // namespace flashattn::testing
