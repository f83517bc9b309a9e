// The dropout mask with SIMD, compiled once per Highway target (foreach_target re-includes this
// file). Philox4x32-10 runs on a vector of counters (l = 0..15 of a 128-key block, as many as the
// vector holds); after its 10 rounds, the low and high halves of output word w hold the draws of
// keys 32·w + l and 32·w + 16 + l (util/dropout.hpp), consecutive keys in consecutive lanes, so
// each half masks a vector of probabilities as it is. tests/test_dropout.cpp checks every target
// against Random123's scalar Philox bit for bit.

// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/kernels/dropout.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
// clang-format on

#include "cpu/kernels/dropout.hpp"

#include <algorithm>

#include "util/dropout.hpp"

HWY_BEFORE_NAMESPACE();
namespace flashattn::detail::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// At most 16 lanes: a block's 16 counters fill one vector or split evenly across several.
using DU = hn::CappedTag<std::uint32_t, kDropoutCounters>;
using DF = hn::Rebind<float, DU>;
using VU = hn::Vec<DU>;

#if HWY_TARGET != HWY_SCALAR

// Philox's constants (Salmon et al. 2011, as Random123's philox.h).
constexpr std::uint32_t kMultiplier0 = 0xD2511F53u, kMultiplier1 = 0xCD9E8D57u;
constexpr std::uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;

// hi:lo = a · m, lane by lane, from two 32 x 32 -> 64-bit products per lane pair.
HWY_INLINE void MulHiLo(VU a, std::uint32_t m, VU& hi, VU& lo) {
  const DU du;
  const hn::RepartitionToWide<DU> dw;
  const VU multiplier = hn::Set(du, m);
  const auto even = hn::MulEven(a, multiplier);
  const auto odd = hn::MulEven(hn::BitCast(du, hn::ShiftRight<32>(hn::BitCast(dw, a))), multiplier);
  lo = hn::OddEven(hn::BitCast(du, hn::ShiftLeft<32>(odd)), hn::BitCast(du, even));
  hi = hn::OddEven(hn::BitCast(du, odd), hn::BitCast(du, hn::ShiftRight<32>(even)));
}

// The four output words of Philox4x32-10 for counters (c0 lane by lane, c1, c2, c3).
HWY_INLINE void Philox(VU& c0, VU& c1, VU& c2, VU& c3, std::uint64_t seed) {
  const DU du;
  std::uint32_t k0 = static_cast<std::uint32_t>(seed), k1 = static_cast<std::uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kWeyl0;
      k1 += kWeyl1;
    }
    VU hi0, lo0, hi1, lo1;
    MulHiLo(c0, kMultiplier0, hi0, lo0);
    MulHiLo(c2, kMultiplier1, hi1, lo1);
    c0 = hn::Xor(hn::Xor(hi1, c1), hn::Set(du, k0));
    c1 = lo1;
    c2 = hn::Xor(hn::Xor(hi0, c3), hn::Set(du, k1));
    c3 = lo0;
  }
}

// For each vector of keys [key_begin, key_begin + n): op(df, pointer, kept-mask) on the whole
// vectors, and op_one(index, kept) on the keys of vectors the range cuts.
template <class Op, class OpOne>
HWY_INLINE void ForEachKeyVector(std::int64_t key_begin, std::int64_t n, const DropoutRow& row,
                                 const Op& op, const OpOne& op_one) {
  const DU du;
  const DF df;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(du));
  const Dropout& dropout = *row.dropout;
  // Draws and the threshold lie in [0, 2^16]: compared as signed lanes (draw > threshold − 1),
  // which every target has.
  const hn::RebindToSigned<DU> di;
  const auto below_kept = hn::Set(di, static_cast<std::int32_t>(dropout.threshold) - 1);
  const VU low_half = hn::Set(du, 0xffffu);
  const std::int64_t key_end = key_begin + n;
  HWY_ALIGN std::uint32_t draws[kDropoutCounters];
  for (std::int64_t block = key_begin / kDropoutBlockKeys; block * kDropoutBlockKeys < key_end;
       ++block) {
    const std::int64_t block_key = block * kDropoutBlockKeys;
    for (std::int64_t lane0 = 0; lane0 < kDropoutCounters; lane0 += N) {
      VU words[4] = {
          hn::Add(hn::Iota(du, 0),
                  hn::Set(du, static_cast<std::uint32_t>(block * kDropoutCounters + lane0))),
          hn::Set(du, row.row), hn::Set(du, row.stream), hn::Set(du, dropout.offset)};
      Philox(words[0], words[1], words[2], words[3], dropout.seed);
      for (int half = 0; half < 8; ++half) {
        const VU word = words[half / 2];
        const VU draw = half % 2 == 0 ? hn::And(word, low_half) : hn::ShiftRight<16>(word);
        const std::int64_t first = block_key + 16 * half + lane0;  // the key in lane 0
        if (first >= key_begin && first + N <= key_end) {
          op(df, first - key_begin, hn::RebindMask(df, hn::Gt(hn::BitCast(di, draw), below_kept)));
        } else if (first + N > key_begin && first < key_end) {
          hn::Store(draw, du, draws);
          for (std::int64_t lane = 0; lane < N; ++lane) {
            if (first + lane >= key_begin && first + lane < key_end) {
              op_one(first + lane - key_begin, draws[lane] >= dropout.threshold);
            }
          }
        }
      }
    }
  }
}

void ApplyDropout(float* values, std::int64_t key_begin, std::int64_t n, const DropoutRow& row) {
  const float scale = row.dropout->scale;
  const DF df;
  const auto scales = hn::Set(df, scale);
  ForEachKeyVector(
      key_begin, n, row,
      [&](DF d, std::int64_t i, hn::Mask<DF> kept) {
        hn::StoreU(hn::Mul(hn::LoadU(d, values + i), hn::IfThenElseZero(kept, scales)), d,
                   values + i);
      },
      [&](std::int64_t i, bool kept) { values[i] *= kept ? scale : 0.0f; });
}

#else  // HWY_SCALAR: one lane, no 64-bit view of it; the scalar definition itself.

void ApplyDropout(float* values, std::int64_t key_begin, std::int64_t n, const DropoutRow& row) {
  for (std::int64_t i = 0; i < n; ++i) {
    const bool kept =
        dropout_draw(*row.dropout, row.stream, row.row, key_begin + i) >= row.dropout->threshold;
    values[i] *= kept ? row.dropout->scale : 0.0f;
  }
}

#endif  // HWY_TARGET != HWY_SCALAR

void ApplyDropoutRows(float* values, std::int64_t ld, const DropoutRow* rows, std::int64_t count,
                      std::int64_t key_begin, std::int64_t n) {
  for (std::int64_t r = 0; r < count; ++r) ApplyDropout(values + r * ld, key_begin, n, rows[r]);
}

}  // namespace HWY_NAMESPACE
}  // namespace flashattn::detail::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace flashattn::detail::cpu {

HWY_EXPORT(ApplyDropout);
HWY_EXPORT(ApplyDropoutRows);

void apply_dropout(float* values, std::int64_t key_begin, std::int64_t n, const DropoutRow& row) {
  HWY_DYNAMIC_DISPATCH(ApplyDropout)(values, key_begin, n, row);
}

void apply_dropout_rows(float* values, std::int64_t ld, const DropoutRow* rows, std::int64_t count,
                        std::int64_t key_begin, std::int64_t n) {
  HWY_DYNAMIC_DISPATCH(ApplyDropoutRows)(values, ld, rows, count, key_begin, n);
}

void dropout_multipliers(float* values, std::int64_t key_begin, std::int64_t n,
                         const DropoutRow& row) {
  std::fill_n(values, n, 1.0f);  // 1 · scale is scale exactly
  HWY_DYNAMIC_DISPATCH(ApplyDropout)(values, key_begin, n, row);
}

}  // namespace flashattn::detail::cpu
#endif  // HWY_ONCE
