// The product kernels sum long reductions in partial sums (cpu/kernels/tile_kernels.hpp: partial
// sums), on every SIMD target compiled in that this CPU runs. Each test is built so that one chain
// through every term loses the small terms and the partial sums keep them, exactly: a term
// of 2^-24 added to a sum in [1, 2) is half an ulp and rounds away (to even), while 2^k such
// terms summed first from zero make 2^(k-24) exactly, which the sum then takes exactly.

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "cpu/kernels/tile_kernels.hpp"
#include "test_support.hpp"

namespace flashattn::testing {
namespace {

namespace cpu = detail::cpu;

constexpr float kHalfUlpOfOne = 0x1p-24f;

// scores = q · kᵀ over 2 · kDimsPerPartialSum + 64 dims: dim 0 contributes row + 1, each dim of
// the second partial sum 2^-24 (2^-12 · 2^-12), the rest 0. The second partial sum is then
// 256 · 2^-24 = 2^-16 and every score row + 1 + 2^-16; a single chain gives row + 1.
TEST(PartialSums, ScoresKeepTheSecondPartialSumOnEveryTarget) {
  constexpr std::int64_t kHeadDim = 2 * cpu::kDimsPerPartialSum + 64, kRows = 13, kKeys = 48;
  std::vector<float> q(kRows * kHeadDim, 0.0f), k(kKeys * kHeadDim, 0.0f);
  for (std::int64_t row = 0; row < kRows; ++row) {
    q[row * kHeadDim] = static_cast<float>(row + 1);
    for (std::int64_t d = cpu::kDimsPerPartialSum; d < 2 * cpu::kDimsPerPartialSum; ++d)
      q[row * kHeadDim + d] = 0x1p-12f;
  }
  for (std::int64_t key = 0; key < kKeys; ++key) {
    k[key * kHeadDim] = 1.0f;
    for (std::int64_t d = cpu::kDimsPerPartialSum; d < 2 * cpu::kDimsPerPartialSum; ++d)
      k[key * kHeadDim + d] = 0x1p-12f;
  }
  std::vector<float> k_packed(kHeadDim * kKeys), q_packed(kRows * kHeadDim);
  for (std::int64_t key = 0; key < kKeys; ++key)
    for (std::int64_t d = 0; d < kHeadDim; ++d)
      k_packed[cpu::packed_index(d, key, kHeadDim, kKeys)] = k[key * kHeadDim + d];
  for (std::int64_t row = 0; row < kRows; ++row)
    for (std::int64_t d = 0; d < kHeadDim; ++d)
      q_packed[cpu::packed_index(row, d, kRows, kHeadDim)] = q[row * kHeadDim + d];

  on_every_target([&] {
    // q row-major (the forward) and in column panels (the backward's packed Q and dO).
    for (const cpu::RowsOperand& operand : {cpu::RowsOperand{q.data(), kHeadDim},
                                            cpu::RowsOperand{q_packed.data(), kHeadDim, kRows}}) {
      SCOPED_TRACE(operand.packed_rows > 0 ? "q packed" : "q row-major");
      std::vector<float> scores(kRows * kKeys, -1.0f);
      cpu::scores_tile(scores.data(), kKeys, operand, k_packed.data(), kRows, kKeys, kHeadDim);
      for (std::int64_t row = 0; row < kRows; ++row) {
        for (std::int64_t key = 0; key < kKeys; ++key) {
          ASSERT_EQ(scores[row * kKeys + key], static_cast<float>(row + 1) + 0x1p-16f)
              << "row " << row << ", key " << key;
        }
      }
    }
  });
}

// acc = 1 everywhere, then acc += p · V with p = 1 and V = 2^-24: the call's keys summed from
// zero make keys · 2^-24, exact, and acc becomes 1 + keys · 2^-24; summed onto acc one key at a
// time, each 2^-24 would round away and acc stay 1.
TEST(PartialSums, PvAddsEachCallsSumToAccOnEveryTarget) {
  constexpr std::int64_t kRows = 13, kKeys = 80, kDims = 80;
  std::vector<float> v_packed(kKeys * kDims, kHalfUlpOfOne), p(kRows * kKeys, 1.0f);
  on_every_target([&] {
    for (const auto& [key_begin, key_end] :
         {std::pair<std::int64_t, std::int64_t>{0, kKeys}, {16, 80}, {0, 3}}) {
      SCOPED_TRACE("keys [" + std::to_string(key_begin) + ", " + std::to_string(key_end) + ")");
      std::vector<float> acc(kRows * kDims, 1.0f);
      cpu::accumulate_pv_tile(acc.data(), kDims, p.data(), kKeys, v_packed.data(), kKeys, key_begin,
                              key_end, kRows, kDims);
      const float want = 1.0f + static_cast<float>(key_end - key_begin) * kHalfUlpOfOne;
      for (std::int64_t i = 0; i < kRows * kDims; ++i)
        ASSERT_EQ(acc[i], want) << "acc[" << i << "]";
    }
    // The backward's Pᵀ · V: acc [columns x dims] += pᵀ · V over kKeys rows of p.
    std::vector<float> acc(kRows * kDims, 1.0f);
    cpu::accumulate_transposed_pv_tile(acc.data(), kDims, p.data(), kRows, v_packed.data(), kKeys,
                                       kRows, kDims);
    const float want = 1.0f + static_cast<float>(kKeys) * kHalfUlpOfOne;
    for (std::int64_t i = 0; i < kRows * kDims; ++i) ASSERT_EQ(acc[i], want) << "acc[" << i << "]";
  });
}

}  // namespace
}  // namespace flashattn::testing
