// SIMD tile kernels, compiled once per Highway target (foreach_target re-includes this file)
// and dispatched at run time.
//
// Both products are register-blocked the same way: R rows x C vectors of accumulators stay in
// registers while the reduction dimension streams (head_dim for the scores, keys for P·V). Per
// step that is C vector loads and R broadcasts for R·C FMAs: 6 x 4 on AVX-512 (24 of 32 zmm
// registers, 10 loads per 24 FMAs), 6 x 2 on AVX2 and SSE (12 of 16 registers); 6 rows beat 4
// on both (docs/tuning.md).

// Highway's order: foreach_target.h first, then highway.h, then the contrib headers.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/kernels/tile_kernels.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include <hwy/contrib/math/math-inl.h>
#include "cpu/kernels/codes-inl.hpp"
// clang-format on

#include "cpu/kernels/tile_kernels.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/kernels/score_modifiers.hpp"
#include "flashattn/dtype.hpp"
#include "util/memory_hints.hpp"

HWY_BEFORE_NAMESPACE();
namespace flashattn::detail::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using Tag = hn::ScalableTag<float>;
using Vec = hn::Vec<Tag>;

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
constexpr int kBlockVectors = 4;
#else
constexpr int kBlockVectors = 2;
#endif
constexpr int kBlockRows = 6;

// The rows left after the blocks of kBlockRows (at most 5), in blocks of 4, 2 and 1: one row at
// a time costs C loads and a broadcast per C FMAs, half the FMA rate, and a 64-row tile of the
// backward has 4 such rows.
template <class Block>
HWY_INLINE void RemainderRows(std::int64_t i, std::int64_t rows, const Block& block) {
  if (rows - i >= 4) {
    block(std::integral_constant<int, 4>(), i);
    i += 4;
  }
  if (rows - i >= 2) {
    block(std::integral_constant<int, 2>(), i);
    i += 2;
  }
  if (rows - i >= 1) block(std::integral_constant<int, 1>(), i);
}

constexpr float kLog2e = 1.44269504088896341f;

// 2^t for the softmax, whose arguments are (score - row max) · scale · log2 e in the forward, or
// (scale · score - the row's lse) · log2 e in the backward, there clamped to 127 at most: t <= 0
// up to rounding, -inf or NaN, and never above 127.
// 2^t = 2^n · 2^f with n = round(t) and f in [-1/2, 1/2], 2^f by its degree-6 Taylor polynomial
// (truncation at most 1.2e-7 absolute, about one ulp; a degree-5 minimax polynomial that keeps
// 2^0 = 1 exactly is off by 4.3e-7), then 2^n applied. Results below 2^-125 (t < -125) are
// flushed to 0 on every target, so that 2^n·p never underflows to a denormal; masked -inf gives
// an exact 0; NaN stays NaN; t = 0 gives exactly 1. Half the operations of Highway's general
// Exp, which also handles large positive arguments (docs/tuning.md).
HWY_INLINE Vec Exp2Softmax(Tag tag, Vec t) {
  constexpr float kFlushBelow = -125.0f;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  // AVX-512: vscalefps computes p·2^n in one instruction and, zero-masked, also does the flush:
  // 10 operations per vector, against 17 for the exponent-bit arithmetic below. A lane with
  // t < -125 is never scaled: an underflowing vscalefps takes a microcode assist (~100 cycles)
  // when denormals are not flushed, and every masked -inf lane did once (docs/tuning.md). The
  // mask is "not t < -125", true for NaN.
  const Vec n = hn::Round(t);
  const Vec f = hn::Sub(t, n);
#else
  // Rounding by the adder: for t in [-2^21, 2^21], t + (1.5·2^23 + 127) lands in [2^23, 2^24),
  // where the float spacing is 1, so the sum is round(t) + 1.5·2^23 + 127 (ties to even, as
  // roundps) and its low 9 mantissa bits are n + 127, the biased exponent of 2^n, for n in
  // [-127, 128]. 13 operations per vector where the clamp, round, the conversion of n with
  // Highway's overflow fix-up and the NaN select took 21 (docs/tuning.md).
  const Vec rounding_shift = hn::Set(tag, 12583039.0f);  // 1.5·2^23 + 127
  const Vec shifted = hn::Add(t, rounding_shift);
  const Vec n = hn::Sub(shifted, rounding_shift);
  const Vec f = hn::Sub(t, n);
#endif
  // Horner on ln2^k / k!, k = 6 .. 0
  Vec p = hn::Set(tag, 1.5403530393381606e-4f);
  p = hn::MulAdd(p, f, hn::Set(tag, 1.3333558146428443e-3f));
  p = hn::MulAdd(p, f, hn::Set(tag, 9.6181291076284772e-3f));
  p = hn::MulAdd(p, f, hn::Set(tag, 5.5504108664821580e-2f));
  p = hn::MulAdd(p, f, hn::Set(tag, 2.4022650695910071e-1f));
  p = hn::MulAdd(p, f, hn::Set(tag, 6.9314718055994531e-1f));
  p = hn::MulAdd(p, f, hn::Set(tag, 1.0f));
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  const __mmask16 kept = _mm512_cmp_ps_mask(t.raw, _mm512_set1_ps(kFlushBelow), _CMP_NLT_UQ);
  return Vec{_mm512_maskz_scalef_ps(kept, p.raw, n.raw)};
#else
  // Shifted left by 23, the sum's bits are 2^n as a float (sign and mantissa 0). p·2^n is exact
  // for t >= -125 and, unlike adding n to p's exponent bits, keeps a NaN p NaN whatever its
  // payload. Where t < -125 (-inf among them, whose f and p are NaN) the result is flushed.
  const hn::RebindToUnsigned<Tag> bits_tag;
  const Vec power = hn::BitCast(tag, hn::ShiftLeft<23>(hn::BitCast(bits_tag, shifted)));
  return hn::IfThenZeroElse(hn::Lt(t, hn::Set(tag, kFlushBelow)), hn::Mul(p, power));
#endif
}

// scores[R x C·N] = q[R x D] · k_packed[D x C·N]. Unscaled: with a scale vector live across the
// loop, GCC ran out of the 32 zmm registers (24 sums, 4 keys, a broadcast) and spilled a key
// vector (docs/tuning.md). The softmax steps apply the scale.
// The dims go in partial sums of kDimsPerPartialSum (tile_kernels.hpp says why), each read in
// segments that lie row-major in q: the partial sum's dims for a row-major q, one column panel at
// a time for a packed one.
template <int R, int C>
HWY_INLINE void ScoresBlock(Tag tag, float* HWY_RESTRICT scores, std::int64_t ld_scores,
                            const RowsOperand& q, std::int64_t row,
                            const float* HWY_RESTRICT k_packed, std::int64_t ld_k,
                            std::int64_t head_dim) {
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(tag));
  const std::int64_t segment = q.packed_rows > 0 ? kPanelWidth : kDimsPerPartialSum;
  for (std::int64_t sum_begin = 0; sum_begin < head_dim; sum_begin += kDimsPerPartialSum) {
    const std::int64_t sum_end = std::min(sum_begin + kDimsPerPartialSum, head_dim);
    Vec acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = hn::Zero(tag);
    for (std::int64_t d0 = sum_begin; d0 < sum_end; d0 += segment) {
      // Element (row, d) of this segment at rows[row · ld + d].
      const std::int64_t ld = q.packed_rows > 0 ? std::min(kPanelWidth, q.ld - d0) : q.ld;
      const float* HWY_RESTRICT rows =
          (q.packed_rows > 0 ? q.data + d0 * q.packed_rows - d0 : q.data) + row * ld;
      const std::int64_t d_end = std::min(d0 + segment, sum_end);
      // Unrolled by 8, so that the loop's counter, compare and branch come once per 8 dims
      // instead of once per 12 FMAs (the 6 x 2 block on AVX2), as P·V's loop (PvBlock)
      // (docs/tuning.md).
      HWY_UNROLL(8)
      for (std::int64_t d = d0; d < d_end; ++d) {
        Vec keys[C];
        for (int c = 0; c < C; ++c) keys[c] = hn::LoadU(tag, k_packed + d * ld_k + c * N);
        for (int r = 0; r < R; ++r) {
          const Vec query = hn::Set(tag, rows[r * ld + d]);
          for (int c = 0; c < C; ++c) acc[r][c] = hn::MulAdd(query, keys[c], acc[r][c]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) {
        float* HWY_RESTRICT out = scores + r * ld_scores + c * N;
        hn::StoreU(sum_begin == 0 ? acc[r][c] : hn::Add(hn::LoadU(tag, out), acc[r][c]), tag, out);
      }
    }
  }
}

// All rows against the key columns [0, width) of one packed panel (head_dim rows of `ld_panel`
// floats, contiguous: 32 KiB at D = 128). The panel stays in L1 while every row block passes
// over it; a strided Kᵀ (rows 512 bytes apart) would lose half of L1 to set conflicts
// (docs/tuning.md).
HWY_INLINE void ScoresPanel(Tag tag, float* HWY_RESTRICT scores, std::int64_t ld_scores,
                            const RowsOperand& q, const float* HWY_RESTRICT panel,
                            std::int64_t ld_panel, std::int64_t width, std::int64_t rows,
                            std::int64_t head_dim) {
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(tag));
  // Every row against the C vectors of key columns from j.
  auto columns = [&](auto vectors, std::int64_t j) HWY_ATTR {
    constexpr int C = decltype(vectors)::value;
    std::int64_t i = 0;
    for (; i + kBlockRows <= rows; i += kBlockRows) {
      ScoresBlock<kBlockRows, C>(tag, scores + i * ld_scores + j, ld_scores, q, i, panel + j,
                                 ld_panel, head_dim);
    }
    RemainderRows(i, rows, [&](auto block_rows, std::int64_t row) {
      ScoresBlock<decltype(block_rows)::value, C>(tag, scores + row * ld_scores + j, ld_scores, q,
                                                  row, panel + j, ld_panel, head_dim);
    });
  };
  std::int64_t j = 0;
  for (; j + kBlockVectors * N <= width; j += kBlockVectors * N) {
    columns(std::integral_constant<int, kBlockVectors>(), j);
  }
  // The columns that a chunk of a partly visible block computes (flash_forward.cpp) need not
  // fill whole blocks of kBlockVectors: two vectors at a time keep 12 FMA chains in flight
  // where one would keep 6.
  if constexpr (kBlockVectors > 2) {
    for (; j + 2 * N <= width; j += 2 * N) columns(std::integral_constant<int, 2>(), j);
  }
  for (; j < width; j += N) columns(std::integral_constant<int, 1>(), j);
}

void ScoresTile(float* HWY_RESTRICT scores, std::int64_t ld_scores, const RowsOperand& q,
                const float* HWY_RESTRICT k_packed, std::int64_t rows, std::int64_t keys_padded,
                std::int64_t head_dim, std::int64_t column_begin, std::int64_t column_end) {
  const Tag tag;
  for (std::int64_t j = column_begin / kPanelWidth * kPanelWidth; j < column_end;
       j += kPanelWidth) {
    const std::int64_t ld_panel = std::min(kPanelWidth, keys_padded - j);
    const std::int64_t first = std::max(column_begin - j, std::int64_t{0});
    ScoresPanel(tag, scores + j + first, ld_scores, q, k_packed + j * head_dim + first, ld_panel,
                std::min(ld_panel, column_end - j) - first, rows, head_dim);
  }
}

void OnlineSoftmaxTile(float* HWY_RESTRICT scores, std::int64_t ld_scores, float scale,
                       float* HWY_RESTRICT row_max, float* HWY_RESTRICT row_sum,
                       float* HWY_RESTRICT acc, std::int64_t ld_acc, std::int64_t rows,
                       std::int64_t keys_padded, std::int64_t dims_padded) {
  constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();
  const Tag tag;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(tag));
  // The exponent in base 2: scale > 0 (validated) folds into one multiplier.
  const Vec exponent_scale = hn::Set(tag, scale * kLog2e);
  // Rows go in groups, each of the three steps over the whole group before the next: one row
  // alone is a chain of dependent steps (max, its horizontal reduction, the exp with that max,
  // the sum and its reduction), and a row at a time the tile ran at the chain's pace; a group's
  // rows overlap. The max and the sum also run as two chains over alternate vectors
  // (docs/tuning.md).
  constexpr std::int64_t kGroupRows = 8;
  float new_max[kGroupRows], tile_sum[kGroupRows];
  for (std::int64_t first = 0; first < rows; first += kGroupRows) {
    const std::int64_t group = std::min(kGroupRows, rows - first);
    // 1. m_new = max(m, rowmax(s))
    for (std::int64_t r = 0; r < group; ++r) {
      const float* HWY_RESTRICT s = scores + (first + r) * ld_scores;
      Vec max_even = hn::Set(tag, kNegativeInfinity), max_odd = max_even;
      std::int64_t j = 0;
      for (; j + 2 * N <= keys_padded; j += 2 * N) {
        max_even = hn::Max(max_even, hn::LoadU(tag, s + j));
        max_odd = hn::Max(max_odd, hn::LoadU(tag, s + j + N));
      }
      if (j < keys_padded) max_even = hn::Max(max_even, hn::LoadU(tag, s + j));
      const float tile_max = hn::GetLane(hn::MaxOfLanes(tag, hn::Max(max_even, max_odd)));
      new_max[r] = tile_max > row_max[first + r] ? tile_max : row_max[first + r];
    }

    // 2. p = 2^((s - m_new)·scale·log2 e) in place, and rowsum(p). A masked score (-inf) gives an
    // exact 0, a NaN score keeps its lane NaN (Exp2Softmax). The row's largest score gets s - m =
    // 0, so p = 1 exactly: a row that sees one key returns that key's value row bit for bit.
    for (std::int64_t r = 0; r < group; ++r) {
      float* HWY_RESTRICT s = scores + (first + r) * ld_scores;
      const Vec shift = hn::Set(tag, new_max[r] == kNegativeInfinity ? 0.0f : new_max[r]);
      auto probabilities = [&](std::int64_t at) {
        const Vec p =
            Exp2Softmax(tag, hn::Mul(hn::Sub(hn::LoadU(tag, s + at), shift), exponent_scale));
        hn::StoreU(p, tag, s + at);
        return p;
      };
      Vec sum_even = hn::Zero(tag), sum_odd = sum_even;
      std::int64_t j = 0;
      for (; j + 2 * N <= keys_padded; j += 2 * N) {
        sum_even = hn::Add(sum_even, probabilities(j));
        sum_odd = hn::Add(sum_odd, probabilities(j + N));
      }
      if (j < keys_padded) sum_even = hn::Add(sum_even, probabilities(j));
      tile_sum[r] = hn::GetLane(hn::SumOfLanes(tag, hn::Add(sum_even, sum_odd)));
    }

    // 3. l = l·exp(scale·(m - m_new)) + rowsum(p), the accumulator row rescaled if m grew
    for (std::int64_t r = 0; r < group; ++r) {
      const std::int64_t i = first + r;
      const float old_max = row_max[i];
      if (new_max[r] > old_max) {
        const float correction =
            old_max == kNegativeInfinity ? 0.0f : std::exp(scale * old_max - scale * new_max[r]);
        const Vec correction_vec = hn::Set(tag, correction);
        float* HWY_RESTRICT acc_row = acc + i * ld_acc;
        for (std::int64_t d = 0; d < dims_padded; d += N) {
          hn::StoreU(hn::Mul(hn::LoadU(tag, acc_row + d), correction_vec), tag, acc_row + d);
        }
        row_sum[i] = row_sum[i] * correction + tile_sum[r];
        row_max[i] = new_max[r];
      } else {
        row_sum[i] += tile_sum[r];
      }
    }
  }
}

// Where the weights of a P·V product live: element (row r, key j) at p[r · row + j · key].
// Row-major P has (ld, 1); the backward's Pᵀ and dSᵀ products read P and dS as (1, ld), with
// no transposed copy.
struct WeightStrides {
  std::int64_t row, key;
};

// One vector of fp32 lanes from values of the input dtype: fp32 as they are, bf16 and (where
// F16C converts it, see util/widen.cpp) f16 widened in registers, exactly.
HWY_INLINE Vec LoadWidened(Tag tag, const float* HWY_RESTRICT values) {
  return hn::LoadU(tag, values);
}
HWY_INLINE Vec LoadWidened(Tag tag, const hwy::bfloat16_t* HWY_RESTRICT values) {
  return hn::PromoteTo(tag, hn::LoadU(hn::Rebind<hwy::bfloat16_t, Tag>(), values));
}
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
constexpr bool kWidensF16 = true;
HWY_INLINE Vec LoadWidened(Tag tag, const hwy::float16_t* HWY_RESTRICT values) {
  return hn::PromoteTo(tag, hn::LoadU(hn::Rebind<hwy::float16_t, Tag>(), values));
}
#else
constexpr bool kWidensF16 = false;
#endif
// Quantized cache codes, unscaled (cpu/kernels/codes-inl.hpp): the decode path multiplies each
// key's scores, and weights each value row, by its scale.
struct Fp8E4M3Code {
  std::uint8_t bits;
};
struct Fp8E5M2Code {
  std::uint8_t bits;
};
HWY_INLINE Vec LoadWidened(Tag tag, const std::int8_t* HWY_RESTRICT codes) {
  return WidenInt8Codes(tag, codes);
}
HWY_INLINE Vec LoadWidened(Tag tag, const Fp8E4M3Code* HWY_RESTRICT codes) {
  return WidenFp8E4M3Codes(tag, reinterpret_cast<const std::uint8_t*>(codes));
}
HWY_INLINE Vec LoadWidened(Tag tag, const Fp8E5M2Code* HWY_RESTRICT codes) {
  return WidenFp8E5M2Codes(tag, reinterpret_cast<const std::uint8_t*>(codes));
}

// How a product reads rows of its second operand: Widened<T> one vector of T at a time, widened
// to fp32 in the order of the dims; Bf16Pairs (the decode path's bf16 rows) 2N bf16 values at a
// time as N 32-bit pairs, whose even elements are the pairs shifted left by 16 bits and odd ones
// the pairs with the low 16 bits cleared. That is 2 operations for 2 vectors where PromoteTo
// takes a widening shuffle and a shift for each, and the fp32 operand then holds each chunk
// of 2N dims in bf16 pair order (tile_kernels.hpp; cycles per key: docs/tuning.md).
template <class T>
struct Widened {
  using Element = T;
  static constexpr int kVectors = 1;
  static HWY_INLINE void Load(Tag tag, const T* HWY_RESTRICT x, Vec* HWY_RESTRICT vectors) {
    vectors[0] = LoadWidened(tag, x);
  }
};
struct Bf16Pairs {
  using Element = hwy::bfloat16_t;
  static constexpr int kVectors = 2;
  static HWY_INLINE void Load(Tag tag, const hwy::bfloat16_t* HWY_RESTRICT x,
                              Vec* HWY_RESTRICT vectors) {
    const hn::RebindToUnsigned<Tag> pairs_tag;
    const auto pairs = hn::LoadU(pairs_tag, reinterpret_cast<const std::uint32_t*>(x));
    vectors[0] = hn::BitCast(tag, hn::ShiftLeft<16>(pairs));
    vectors[1] = hn::BitCast(tag, hn::And(pairs, hn::Set(pairs_tag, 0xFFFF0000u)));
  }
};

// Where the rows of a product's second operand lie: StridedRows `ld` elements apart (the packed
// tiles, the decode path's K and V rows within a page), OffsetRows, from element `column` of
// each on, each at its own byte offset from a base (the decode path's rows of a key group that
// crosses a page of a paged cache: ScatteredRows). Null rows are none (the rows ahead that a
// decode product may be given).
template <class T>
struct StridedRows {
  using Element = T;
  const T* first = nullptr;
  std::int64_t ld = 0;
  bool into_l2 = false;  // ScatteredRows::into_l2
  HWY_INLINE bool present() const { return first != nullptr; }
  HWY_INLINE const T* row(std::int64_t k) const { return first + k * ld; }
  HWY_INLINE StridedRows from_row(std::int64_t k) const {
    return {present() ? row(k) : nullptr, ld, into_l2};
  }
  HWY_INLINE StridedRows from_column(std::int64_t d) const {
    return {present() ? first + d : nullptr, ld, into_l2};
  }
};
template <class T>
struct OffsetRows {
  using Element = T;
  const char* base = nullptr;
  const std::int64_t* offsets = nullptr;  // bytes
  std::int64_t column = 0;
  bool into_l2 = false;  // ScatteredRows::into_l2
  OffsetRows() = default;
  OffsetRows(const char* base_, const std::int64_t* offsets_, std::int64_t column_, bool into_l2_)
      : base(base_), offsets(offsets_), column(column_), into_l2(into_l2_) {}
  explicit OffsetRows(const ScatteredRows& rows)
      : base(static_cast<const char*>(rows.base)),
        offsets(rows.byte_offsets),
        into_l2(rows.into_l2) {}
  HWY_INLINE bool present() const { return base != nullptr; }
  HWY_INLINE const T* row(std::int64_t k) const {
    return reinterpret_cast<const T*>(base + offsets[k]) + column;
  }
  HWY_INLINE OffsetRows from_row(std::int64_t k) const {
    return {base, present() ? offsets + k : nullptr, column, into_l2};
  }
  HWY_INLINE OffsetRows from_column(std::int64_t d) const {
    return {base, offsets, column + d, into_l2};
  }
};

// Asks for the lines of `count` rows that start at byte offsets of each row in [begin, end)
// elements: a decode product, reading elements [begin, end) of its own rows, asks for the same
// part of the rows a later call takes (InputRows::ahead in flash_decode.cpp).
template <class Rows>
HWY_INLINE void PrefetchAhead(const Rows& rows, int count, std::int64_t begin, std::int64_t end) {
  constexpr std::int64_t kLineBytes = 64;
  constexpr auto kBytes = static_cast<std::int64_t>(sizeof(typename Rows::Element));
  const std::int64_t first = (begin * kBytes + kLineBytes - 1) / kLineBytes * kLineBytes;
  for (int k = 0; k < count; ++k) {
    const char* row = reinterpret_cast<const char*>(rows.row(k));
    for (std::int64_t byte = first; byte < end * kBytes; byte += kLineBytes) {
      prefetch_line(row + byte, rows.into_l2);
    }
  }
}

// acc[R x C·N] += p[R x keys] · v[keys x C·N]; v of fp32 (the tiles) or of an input dtype (the
// decode path's rows), read by Reader (C a multiple of its kVectors). `ahead`, if present:
// rows whose same C·N elements are asked for, one row per key (PrefetchAhead).
// The block's products are summed from zero and the sum then added to acc (tile_kernels.hpp:
// partial sums).
template <int R, int C, class Reader = Widened<float>, bool kUnrollKeys = true,
          class Rows = StridedRows<typename Reader::Element>>
HWY_INLINE void PvBlock(Tag tag, float* HWY_RESTRICT acc, std::int64_t ld_acc,
                        const float* HWY_RESTRICT p, WeightStrides ps, Rows v, std::int64_t keys,
                        Rows ahead = {}) {
  static_assert(C % Reader::kVectors == 0);
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(tag));
  Vec sums[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sums[r][c] = hn::Zero(tag);
  auto key = [&](std::int64_t j) HWY_ATTR {
    if (ahead.present()) PrefetchAhead(ahead.from_row(j), 1, 0, C * N);
    const typename Reader::Element* HWY_RESTRICT v_row = v.row(j);
    Vec values[C];
    for (int c = 0; c < C; c += Reader::kVectors) Reader::Load(tag, v_row + c * N, values + c);
    const float* HWY_RESTRICT weights = p + j * ps.key;
    for (int r = 0; r < R; ++r) {
      const Vec weight = hn::Set(tag, weights[r * ps.row]);
      for (int c = 0; c < C; ++c) sums[r][c] = hn::MulAdd(weight, values[c], sums[r][c]);
    }
  };
  // Unrolled as the scores' loop (ScoresBlock says why). The decode path's calls take 8 keys:
  // its bf16 pairs' loop unrolled keeps up with a hand-written 8-key loop, while its fp32 rows
  // ran slower unrolled and stay rolled, as do the f16 ones (docs/tuning.md).
  if constexpr (kUnrollKeys) {
    HWY_UNROLL(8)
    for (std::int64_t j = 0; j < keys; ++j) key(j);
  } else {
    for (std::int64_t j = 0; j < keys; ++j) key(j);
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      float* HWY_RESTRICT out = acc + r * ld_acc + c * N;
      hn::StoreU(hn::Add(hn::LoadU(tag, out), sums[r][c]), tag, out);
    }
  }
}

// All rows against one packed panel of value dims (keys rows of `width` floats, contiguous:
// 32 KiB for 128 keys), kept in L1 while every row block passes over it; as for the scores.
template <int C, class Reader = Widened<float>, bool kUnrollKeys = true,
          class Rows = StridedRows<typename Reader::Element>>
HWY_INLINE void PvColumns(Tag tag, float* HWY_RESTRICT acc, std::int64_t ld_acc,
                          const float* HWY_RESTRICT p, WeightStrides ps, Rows panel,
                          std::int64_t rows, std::int64_t keys, Rows ahead = {}) {
  // The rows ahead are asked for by the first row block only.
  std::int64_t i = 0;
  for (; i + kBlockRows <= rows; i += kBlockRows) {
    PvBlock<kBlockRows, C, Reader, kUnrollKeys>(tag, acc + i * ld_acc, ld_acc, p + i * ps.row, ps,
                                                panel, keys, i == 0 ? ahead : Rows{});
  }
  RemainderRows(i, rows, [&](auto block_rows, std::int64_t row) {
    PvBlock<decltype(block_rows)::value, C, Reader, kUnrollKeys>(tag, acc + row * ld_acc, ld_acc,
                                                                 p + row * ps.row, ps, panel, keys,
                                                                 row == 0 ? ahead : Rows{});
  });
}

// acc[rows x dims_padded] += p[rows x keys in key_begin..key_end] · V[key_begin..key_end]
void PvTile(float* HWY_RESTRICT acc, std::int64_t ld_acc, const float* HWY_RESTRICT p,
            WeightStrides ps, const float* HWY_RESTRICT v_packed, std::int64_t packed_keys,
            std::int64_t key_begin, std::int64_t key_end, std::int64_t rows,
            std::int64_t dims_padded) {
  const Tag tag;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(tag));
  const std::int64_t keys = key_end - key_begin;
  p += key_begin * ps.key;
  for (std::int64_t d0 = 0; d0 < dims_padded; d0 += kPanelWidth) {
    const std::int64_t width = std::min(kPanelWidth, dims_padded - d0);
    const float* HWY_RESTRICT panel = v_packed + d0 * packed_keys + key_begin * width;
    std::int64_t d = 0;
    for (; d + kBlockVectors * N <= width; d += kBlockVectors * N) {
      PvColumns<kBlockVectors>(tag, acc + d0 + d, ld_acc, p, ps,
                               StridedRows<float>{panel + d, width}, rows, keys);
    }
    for (; d < width; d += N) {
      PvColumns<1>(tag, acc + d0 + d, ld_acc, p, ps, StridedRows<float>{panel + d, width}, rows,
                   keys);
    }
  }
}

void AccumulatePvTile(float* HWY_RESTRICT acc, std::int64_t ld_acc, const float* HWY_RESTRICT p,
                      std::int64_t ld_p, const float* HWY_RESTRICT v_packed,
                      std::int64_t packed_keys, std::int64_t key_begin, std::int64_t key_end,
                      std::int64_t rows, std::int64_t dims_padded) {
  PvTile(acc, ld_acc, p, {ld_p, 1}, v_packed, packed_keys, key_begin, key_end, rows, dims_padded);
}

void AccumulateTransposedPvTile(float* HWY_RESTRICT acc, std::int64_t ld_acc,
                                const float* HWY_RESTRICT p, std::int64_t ld_p,
                                const float* HWY_RESTRICT v_packed, std::int64_t packed_rows,
                                std::int64_t columns, std::int64_t dims_padded) {
  PvTile(acc, ld_acc, p, {1, ld_p}, v_packed, packed_rows, 0, packed_rows, columns, dims_padded);
}

void ProbabilitiesFromLseTile(float* HWY_RESTRICT scores, std::int64_t ld_scores, float scale,
                              const float* HWY_RESTRICT lse, std::int64_t rows,
                              std::int64_t keys_padded) {
  constexpr float kInfinity = std::numeric_limits<float>::infinity();
  const Tag tag;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(tag));
  const Vec scale_vec = hn::Set(tag, scale), log2e = hn::Set(tag, kLog2e);
  const Vec max_exponent = hn::Set(tag, 127.0f);
  for (std::int64_t i = 0; i < rows; ++i) {
    float* HWY_RESTRICT s = scores + i * ld_scores;
    // lse = -inf: subtracting +inf sends every (masked, -inf or finite) score to exp(-inf) = 0.
    const Vec shift = hn::Set(tag, lse[i] == -kInfinity ? kInfinity : lse[i]);
    for (std::int64_t j = 0; j < keys_padded; j += N) {
      const Vec x = hn::Mul(hn::Sub(hn::Mul(hn::LoadU(tag, s + j), scale_vec), shift), log2e);
      // An exponent above 127 (a caller's lse far below the row's scores) would not fit 2^n.
      hn::StoreU(Exp2Softmax(tag, hn::IfThenElse(hn::Gt(x, max_exponent), max_exponent, x)), tag,
                 s + j);
    }
  }
}

void SoftmaxGradientTile(float* HWY_RESTRICT dp, std::int64_t ld_dp, const float* HWY_RESTRICT p,
                         std::int64_t ld_p, const float* HWY_RESTRICT row_delta, float scale,
                         std::int64_t rows, std::int64_t keys_padded) {
  const Tag tag;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(tag));
  const Vec scale_vec = hn::Set(tag, scale);
  for (std::int64_t i = 0; i < rows; ++i) {
    const Vec delta = hn::Set(tag, row_delta[i]);
    for (std::int64_t j = 0; j < keys_padded; j += N) {
      const Vec probability = hn::Mul(hn::LoadU(tag, p + i * ld_p + j), scale_vec);
      const Vec centered = hn::Sub(hn::LoadU(tag, dp + i * ld_dp + j), delta);
      hn::StoreU(hn::Mul(probability, centered), tag, dp + i * ld_dp + j);
    }
  }
}

// The score modifiers on one row (score_modifiers.hpp): here beside the softmax, whose exp
// the softcap's tanh uses.
void ModifyScores(float* HWY_RESTRICT scores, float* HWY_RESTRICT derivative, std::int64_t n,
                  float scale, const RowModifiers& row) {
  const float softcap = row.softcap, slope = row.slope;
  const std::int64_t first_distance = row.first_distance;
  const Tag tag;
  const auto N = static_cast<std::int64_t>(hn::Lanes(tag));
  const Vec scale_vec = hn::Set(tag, scale);
  const bool capped = softcap > 0.0f;
  const Vec cap = hn::Set(tag, softcap), inverse_cap = hn::Set(tag, capped ? 1.0f / softcap : 0.0f);
  const Vec minus_two_log2e_over_cap = hn::Mul(inverse_cap, hn::Set(tag, -2.0f * kLog2e));
  const Vec one = hn::Set(tag, 1.0f), slope_vec = hn::Set(tag, slope);
  const Vec lane_offsets = hn::Iota(tag, 0.0f);
  // The last vector's lanes past n: through a buffer, so that n need not be a whole vector.
  HWY_ALIGN float tail_scores[hn::MaxLanes(tag)];
  HWY_ALIGN float tail_derivative[hn::MaxLanes(tag)];
  // A bias that is not contiguous fp32, and any mask, go through these one vector at a time.
  HWY_ALIGN float bias_lanes[hn::MaxLanes(tag)];
  HWY_ALIGN std::uint32_t keep_lanes[hn::MaxLanes(tag)];
  const bool contiguous_bias = row.bias_dtype == DType::f32 && row.bias_stride == 1;
  const hn::RebindToUnsigned<Tag> utag;
  const hn::Rebind<std::uint8_t, Tag> bytes_tag;  // one mask byte per lane
  const Vec minus_infinity = hn::Set(tag, -std::numeric_limits<float>::infinity());
  for (std::int64_t j = 0; j < n; j += N) {
    const std::int64_t count = n - j < N ? n - j : N;
    float* s = scores + j;
    float* ds = derivative ? derivative + j : nullptr;
    if (count < N) {
      hn::Store(hn::Zero(tag), tag, tail_scores);
      for (std::int64_t i = 0; i < count; ++i) tail_scores[i] = s[i];
      s = tail_scores;
      if (ds) ds = tail_derivative;
    }
    Vec logit = hn::Mul(hn::LoadU(tag, s), scale_vec);
    if (capped) {
      // tanh |y| = (1 − e) / (1 + e) with e = 2^(−2|y|·log2 e) <= 1, by the softmax's own
      // exp (half the operations of Highway's Exp and Tanh), within a few fp32 roundings of 1 in
      // absolute terms, which is what the logit c·tanh needs; e flushed to 0 gives 1, and a NaN
      // stays NaN. The sign is put back after.
      const Vec e = Exp2Softmax(tag, hn::Mul(hn::Abs(logit), minus_two_log2e_over_cap));
      const Vec t = hn::CopySign(hn::Div(hn::Sub(one, e), hn::Add(one, e)), logit);
      logit = hn::Mul(cap, t);
      if (ds) hn::StoreU(hn::NegMulAdd(t, t, one), tag, ds);
    } else if (ds) {
      hn::StoreU(one, tag, ds);
    }
    if (slope != 0.0f) {
      // |first_distance − j − lane|, exact in fp32 up to 2^24.
      const Vec distance =
          hn::Sub(hn::Set(tag, static_cast<float>(first_distance - j)), lane_offsets);
      logit = hn::NegMulAdd(slope_vec, hn::Abs(distance), logit);
    }
    if (row.bias != nullptr) {
      Vec bias;
      if (contiguous_bias && count == N) {
        bias = hn::LoadU(tag, static_cast<const float*>(row.bias) + j);
      } else {
        for (std::int64_t i = 0; i < N; ++i) {
          bias_lanes[i] =
              i < count ? load_f32(row.bias, row.bias_dtype, (j + i) * row.bias_stride) : 0.0f;
        }
        bias = hn::Load(tag, bias_lanes);
      }
      // A −inf bias masks its key: −inf even where the score is +inf (inf − inf would be NaN).
      logit = hn::IfThenElse(hn::Eq(bias, minus_infinity), minus_infinity, hn::Add(logit, bias));
    }
    if (row.mask != nullptr) {
      hn::Vec<decltype(utag)> keep;
      if (row.mask_stride == 1 && count == N) {
        keep = hn::PromoteTo(utag, hn::LoadU(bytes_tag, row.mask + j));
      } else {
        for (std::int64_t i = 0; i < N; ++i) {
          keep_lanes[i] = i < count ? row.mask[(j + i) * row.mask_stride] : 1u;
        }
        keep = hn::Load(utag, keep_lanes);
      }
      const auto dropped = hn::RebindMask(tag, hn::Eq(keep, hn::Zero(utag)));
      logit = hn::IfThenElse(dropped, minus_infinity, logit);
    }
    hn::StoreU(logit, tag, s);
    if (count < N) {
      for (std::int64_t i = 0; i < count; ++i) scores[j + i] = tail_scores[i];
      if (ds) {
        for (std::int64_t i = 0; i < count; ++i) derivative[j + i] = tail_derivative[i];
      }
    }
  }
}

// The sum of v's lanes, as a scalar: the halves added down to 128 bits first, then
// SumOfLanes, whose shuffles on AVX2 and AVX-512 span the whole vector (faster in the bf16
// decode path: docs/tuning.md).
template <class D>
HWY_INLINE float SumOfLanesToScalar(D d, hn::VFromD<D> v) {
#if HWY_TARGET != HWY_SCALAR
  if constexpr (hn::MaxLanes(D()) * sizeof(float) > 16) {
    const hn::Half<D> half;
    return SumOfLanesToScalar(half, hn::Add(hn::LowerHalf(half, v), hn::UpperHalf(half, v)));
  }
#endif
  return hn::GetLane(hn::SumOfLanes(d, v));
}

// Decode: the dot products of R rows with K vectors as R·K vectors of partial sums, R·K chains
// of FMAs (8 or 16 in the blocks DotRows picks, enough to cover the FMA latency). `ahead`, if
// present: K rows whose lines are asked for as the same ones of x are read.
template <int R, int K, class Reader, class Rows>
HWY_INLINE void DotSums(Tag tag, Vec (&sums)[R][K], const float* HWY_RESTRICT rows,
                        std::int64_t ld_rows, Rows x, std::int64_t n, Rows ahead) {
  constexpr int V = Reader::kVectors;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(tag));
  const typename Reader::Element* HWY_RESTRICT x_rows[K];
  for (int k = 0; k < K; ++k) x_rows[k] = x.row(k);
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < K; ++k) sums[r][k] = hn::Zero(tag);
  // Where a step reads one line of each row (64-byte vectors of fp32, or bf16 pairs), the line
  // of each row ahead is asked for directly, not by PrefetchAhead's loop over lines.
  constexpr auto kElementBytes = static_cast<std::int64_t>(sizeof(typename Reader::Element));
  const bool line_per_step = V * N * kElementBytes == 64;
  const char* ahead_rows[K];
  for (int k = 0; k < K; ++k) {
    ahead_rows[k] = ahead.present() ? reinterpret_cast<const char*>(ahead.row(k)) : nullptr;
  }
  for (std::int64_t d = 0; d < n; d += V * N) {
    if (ahead.present()) {
      if (line_per_step) {
        for (int k = 0; k < K; ++k) prefetch_line(ahead_rows[k] + d * kElementBytes, ahead.into_l2);
      } else {
        PrefetchAhead(ahead, K, d, d + V * N);
      }
    }
    Vec xs[K][V];
    for (int k = 0; k < K; ++k) Reader::Load(tag, x_rows[k] + d, xs[k]);
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < V; ++v) {
        const Vec row = hn::LoadU(tag, rows + r * ld_rows + d + v * N);
        for (int k = 0; k < K; ++k) sums[r][k] = hn::MulAdd(row, xs[k][v], sums[r][k]);
      }
    }
  }
}

// The same products, one horizontal sum each.
template <int R, int K, class Reader, class Rows>
HWY_INLINE void DotRowsBlock(Tag tag, float* HWY_RESTRICT out, std::int64_t out_stride,
                             const float* HWY_RESTRICT rows, std::int64_t ld_rows, Rows x,
                             std::int64_t n, Rows ahead) {
  Vec sums[R][K];
  DotSums<R, K, Reader, Rows>(tag, sums, rows, ld_rows, x, n, ahead);
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < K; ++k) {
      out[r * out_stride + k] = SumOfLanesToScalar(tag, sums[r][k]);
    }
}

// R rows against the x vectors [0, x_count): K of them at a time, the last ones one by one.
template <int R, int K, class Reader, class Rows>
HWY_INLINE void DotRowsAgainst(Tag tag, float* HWY_RESTRICT out, std::int64_t out_stride,
                               const float* HWY_RESTRICT rows, std::int64_t ld_rows, Rows x,
                               std::int64_t x_count, std::int64_t n, Rows ahead) {
  std::int64_t k = 0;
  for (; k + K <= x_count; k += K) {
    DotRowsBlock<R, K, Reader, Rows>(tag, out + k, out_stride, rows, ld_rows, x.from_row(k), n,
                                     ahead.from_row(k));
  }
  for (; k < x_count; ++k) {
    DotRowsBlock<R, 1, Reader, Rows>(tag, out + k, out_stride, rows, ld_rows, x.from_row(k), n,
                                     ahead.from_row(k));
  }
}

#if HWY_ARCH_X86 && (HWY_TARGET == HWY_AVX2 || HWY_TARGET <= HWY_AVX3)
// Four vectors to one whose lane j of each 128-bit block is that block's sum of the lanes of
// v[j]: lanes summed two by two (32-bit interleaves), then the pairs (64-bit interleaves).
HWY_INLINE Vec BlockSumsOfFour(Tag tag, const Vec* HWY_RESTRICT v) {
  const hn::Repartition<double, Tag> pairs;
  const auto low = hn::BitCast(
      pairs, hn::Add(hn::InterleaveLower(tag, v[0], v[1]), hn::InterleaveUpper(tag, v[0], v[1])));
  const auto high = hn::BitCast(
      pairs, hn::Add(hn::InterleaveLower(tag, v[2], v[3]), hn::InterleaveUpper(tag, v[2], v[3])));
  return hn::Add(hn::BitCast(tag, hn::InterleaveLower(pairs, low, high)),
                 hn::BitCast(tag, hn::InterleaveUpper(pairs, low, high)));
}
#endif

// Eight vectors of eight lanes to one whose lane i is the sum of the lanes of v[i], in three
// rounds of pairwise sums (within 128-bit blocks by 32 and 64 bits, then across the halves):
// 14 shuffles and 7 additions, against 8 horizontal sums of 6 operations and a store each.
#if HWY_ARCH_X86 && HWY_TARGET == HWY_AVX2
HWY_INLINE Vec SumsOfEight(Tag tag, const Vec (&v)[8]) {
  const Vec low = BlockSumsOfFour(tag, v), high = BlockSumsOfFour(tag, v + 4);
  return hn::Add(hn::ConcatLowerLower(tag, high, low), hn::ConcatUpperUpper(tag, high, low));
}

// One row against 8 fp32 x vectors: each x vector loaded once and used once, the row kept in a
// register, 9 loads per 8 FMAs. The 4 x 2 blocks load each row vector twice where the compiler
// folds the loads into the FMAs (GCC 12 does), 10 loads per 8 FMAs, and end in 8 horizontal sums
// instead of one SumsOfEight (docs/tuning.md). Not for bf16 and f16: the 4 x 2 blocks widen each
// x vector once, these once per row, which made the decode path slower on bf16.
template <class Rows>
HWY_INLINE void DotRowEightVectors(Tag tag, float* HWY_RESTRICT out, const float* HWY_RESTRICT row,
                                   Rows x, std::int64_t n, Rows ahead) {
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(tag));
  const float* HWY_RESTRICT x_rows[8];
  for (int k = 0; k < 8; ++k) x_rows[k] = x.row(k);
  Vec sums[8];
  for (int k = 0; k < 8; ++k) sums[k] = hn::Zero(tag);
  for (std::int64_t d = 0; d < n; d += N) {
    if (ahead.present()) PrefetchAhead(ahead, 8, d, d + N);
    const Vec row_d = hn::LoadU(tag, row + d);
    for (int k = 0; k < 8; ++k) sums[k] = hn::MulAdd(row_d, hn::LoadU(tag, x_rows[k] + d), sums[k]);
  }
  hn::StoreU(SumsOfEight(tag, sums), tag, out);
}
#endif

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
// Sixteen vectors of 16 lanes to one whose lane 4i + j is the sum of the lanes of v[i][j], in
// four rounds of pairwise sums: within 128-bit blocks by 32 and by 64 bits, then across the
// 256-bit halves, then across adjacent blocks. 45 operations for 16 sums, against 9 and a scalar
// store for each sum on its own (docs/tuning.md).
HWY_INLINE Vec SumsOfSixteen(Tag tag, const Vec (&v)[4][4]) {
  // Lane j of each 128-bit block of block_sums[i]: that block's sum of v[i][j].
  Vec block_sums[4];
  for (int i = 0; i < 4; ++i) block_sums[i] = BlockSumsOfFour(tag, v[i]);
  // Blocks [x0 + x2, x1 + x3] of block_sums[i] in the low half, of block_sums[i + 2] in the high.
  Vec halves[2];
  for (int i = 0; i < 2; ++i) {
    halves[i] = hn::Add(hn::ConcatLowerLower(tag, block_sums[i + 2], block_sums[i]),
                        hn::ConcatUpperUpper(tag, block_sums[i + 2], block_sums[i]));
  }
  // Adjacent blocks added: [a0 + a1, b0 + b1, a2 + a3, b2 + b3] for a, b = halves[0], halves[1],
  // which puts block_sums[0], [1], [2], [3] in blocks 0 to 3.
  return hn::Add(
      hn::OddEvenBlocks(halves[1], halves[0]),
      hn::OddEvenBlocks(hn::SwapAdjacentBlocks(halves[1]), hn::SwapAdjacentBlocks(halves[0])));
}

// Four rows against four x vectors: the 16 products of DotSums<4, 4>, summed by SumsOfSixteen,
// row r's four in block r.
template <class Reader, class Rows>
HWY_INLINE void DotFourByFour(Tag tag, float* HWY_RESTRICT out, std::int64_t out_stride,
                              const float* HWY_RESTRICT rows, std::int64_t ld_rows, Rows x,
                              std::int64_t n, Rows ahead) {
  Vec sums[4][4];
  DotSums<4, 4, Reader, Rows>(tag, sums, rows, ld_rows, x, n, ahead);
  HWY_ALIGN float all[16];
  hn::Store(SumsOfSixteen(tag, sums), tag, all);
  const hn::Full128<float> block;
  for (int r = 0; r < 4; ++r) hn::StoreU(hn::Load(block, all + 4 * r), block, out + r * out_stride);
}

// R rows against K x vectors, R·K <= 16: the products in one SumsOfSixteen (padded with zeros),
// row r's K in lanes r·K to r·K + K - 1. For 3 and 5-7 rows (GQA groups of 3 and 5-7 query
// heads): each x vector is then loaded and widened once for all rows, where DotFourByFour's
// blocks of 4 rows and those of 2 and 1 after them widen it once per block and sum the 2- and
// 1-row blocks' products one by one (docs/tuning.md). Not for 8 rows: 8 x 2 ran 1.03-1.13x the
// time of two 4 x 4 blocks.
template <int R, int K, class Reader, class Rows>
HWY_INLINE void DotRowsSummedTogether(Tag tag, float* HWY_RESTRICT out, std::int64_t out_stride,
                                      const float* HWY_RESTRICT rows, std::int64_t ld_rows, Rows x,
                                      std::int64_t n, Rows ahead) {
  static_assert(R * K <= 16);
  Vec sums[R][K];
  DotSums<R, K, Reader, Rows>(tag, sums, rows, ld_rows, x, n, ahead);
  Vec padded[4][4];
  for (int i = 0; i < 16; ++i) {
    padded[i / 4][i % 4] = i < R * K ? sums[i / K][i % K] : hn::Zero(tag);
  }
  HWY_ALIGN float all[16];
  hn::Store(SumsOfSixteen(tag, padded), tag, all);
  for (int r = 0; r < R; ++r) {
    for (int k = 0; k < K; ++k) out[r * out_stride + k] = all[r * K + k];
  }
}

// R rows against the x vectors [0, x_count), K at a time, the last ones one by one.
template <int R, int K, class Reader, class Rows>
HWY_INLINE void DotAllRows(Tag tag, float* HWY_RESTRICT out, std::int64_t out_stride,
                           const float* HWY_RESTRICT rows, std::int64_t ld_rows, Rows x,
                           std::int64_t x_count, std::int64_t n, Rows ahead) {
  const std::int64_t whole = x_count / K * K;
  for (std::int64_t k = 0; k < whole; k += K) {
    DotRowsSummedTogether<R, K, Reader, Rows>(tag, out + k, out_stride, rows, ld_rows,
                                              x.from_row(k), n, ahead.from_row(k));
  }
  DotRowsAgainst<R, 1, Reader, Rows>(tag, out + whole, out_stride, rows, ld_rows, x.from_row(whole),
                                     x_count - whole, n, ahead.from_row(whole));
}
#endif

// `ahead`: as for DotSums, x_count rows; asked for by the first block of rows only.
template <class Reader, class Rows>
void DotRowsOf(float* HWY_RESTRICT out, std::int64_t out_stride, const float* HWY_RESTRICT rows,
               std::int64_t ld_rows, std::int64_t count, Rows x, std::int64_t x_count,
               std::int64_t n, Rows ahead) {
  const Tag tag;
  auto ahead_of = [&](std::int64_t r, std::int64_t k) {
    return r == 0 ? ahead.from_row(k) : Rows{};
  };
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  // GQA groups of 3 and 5-7 query heads: all rows in one block (DotRowsSummedTogether).
  auto all_rows = [&](auto block_rows, auto block_keys) {
    DotAllRows<decltype(block_rows)::value, decltype(block_keys)::value, Reader, Rows>(
        tag, out, out_stride, rows, ld_rows, x, x_count, n, ahead);
  };
  using Four = std::integral_constant<int, 4>;
  using Two = std::integral_constant<int, 2>;
  switch (count) {
    case 3:
      return all_rows(std::integral_constant<int, 3>(), Four());
    case 5:
      return all_rows(std::integral_constant<int, 5>(), Two());
    case 6:
      return all_rows(std::integral_constant<int, 6>(), Two());
    case 7:
      return all_rows(std::integral_constant<int, 7>(), Two());
    default:
      break;
  }
#endif
#if HWY_ARCH_X86 && HWY_TARGET == HWY_AVX2
  if constexpr (std::is_same_v<Reader, Widened<float>>) {
    // Groups of 8 x vectors row by row, the group staying in L1 while the rows pass over it.
    std::int64_t first = 0;
    for (; first + 8 <= x_count; first += 8) {
      for (std::int64_t r = 0; r < count; ++r) {
        DotRowEightVectors<Rows>(tag, out + r * out_stride + first, rows + r * ld_rows,
                                 x.from_row(first), n, ahead_of(r, first));
      }
    }
    out += first;
    x = x.from_row(first);
    ahead = ahead.from_row(first);
    x_count -= first;
  }
#endif
  std::int64_t r = 0;
  for (; r + 4 <= count; r += 4) {
    std::int64_t k = 0;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
    for (; k + 4 <= x_count; k += 4) {
      DotFourByFour<Reader, Rows>(tag, out + r * out_stride + k, out_stride, rows + r * ld_rows,
                                  ld_rows, x.from_row(k), n, ahead_of(r, k));
    }
#endif
    DotRowsAgainst<4, 2, Reader, Rows>(tag, out + r * out_stride + k, out_stride,
                                       rows + r * ld_rows, ld_rows, x.from_row(k), x_count - k, n,
                                       ahead_of(r, k));
  }
  if (count - r >= 2) {
    DotRowsAgainst<2, 4, Reader, Rows>(tag, out + r * out_stride, out_stride, rows + r * ld_rows,
                                       ld_rows, x, x_count, n, ahead_of(r, 0));
    r += 2;
  }
  if (count - r >= 1) {
    DotRowsAgainst<1, 8, Reader, Rows>(tag, out + r * out_stride, out_stride, rows + r * ld_rows,
                                       ld_rows, x, x_count, n, ahead_of(r, 0));
  }
}

// Whether the decode path's P·V blocks unroll their key loop (PvBlock says why only for pairs).
template <class Reader>
constexpr bool kDecodeUnroll = std::is_same_v<Reader, Bf16Pairs>;

// Decode: acc += weights · x for unpacked x rows, the P·V blocks of PvTile on them.
// One or two rows take wider blocks: a block's accumulators are its FMA chains, and the FMA
// latency needs 8 of them in flight (4 cycles x 2 pipes on Zen 3 and on Sapphire Rapids),
// which 1 x kBlockVectors or 2 x 2 accumulators are not (docs/tuning.md).
template <int R, int C, class Reader, class Rows>
HWY_INLINE void AxpyFewRows(Tag tag, float* HWY_RESTRICT acc, std::int64_t ld_acc,
                            const float* HWY_RESTRICT weights, WeightStrides ps, Rows x,
                            std::int64_t x_count, std::int64_t n, Rows ahead) {
  constexpr int V = Reader::kVectors;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(tag));
  std::int64_t d = 0;
  for (; d + C * N <= n; d += C * N) {
    PvBlock<R, C, Reader, kDecodeUnroll<Reader>, Rows>(
        tag, acc + d, ld_acc, weights, ps, x.from_column(d), x_count, ahead.from_column(d));
  }
  for (; d < n; d += V * N) {
    PvBlock<R, V, Reader, kDecodeUnroll<Reader>, Rows>(
        tag, acc + d, ld_acc, weights, ps, x.from_column(d), x_count, ahead.from_column(d));
  }
}

// `ahead`: as for PvBlock, x_count rows.
template <class Reader, class Rows>
void AxpyRowsOf(float* HWY_RESTRICT acc, std::int64_t ld_acc, const float* HWY_RESTRICT weights,
                std::int64_t weight_stride, std::int64_t count, Rows x, std::int64_t x_count,
                std::int64_t n, Rows ahead) {
  const Tag tag;
  const WeightStrides ps{weight_stride, 1};
  if (count == 1) {
    return AxpyFewRows<1, 8, Reader, Rows>(tag, acc, ld_acc, weights, ps, x, x_count, n, ahead);
  }
  if (count == 2) {
    return AxpyFewRows<2, 4, Reader, Rows>(tag, acc, ld_acc, weights, ps, x, x_count, n, ahead);
  }
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  // GQA groups of 3, 5 and 7 query heads in one block of rows, each x row loaded and widened once
  // for all of them, where blocks of kBlockRows (6), 4, 2 and 1 rows load it once per block
  // (docs/tuning.md).
  if (count == 3) {
    return AxpyFewRows<3, 4, Reader, Rows>(tag, acc, ld_acc, weights, ps, x, x_count, n, ahead);
  }
  if (count == 5) {
    return AxpyFewRows<5, 4, Reader, Rows>(tag, acc, ld_acc, weights, ps, x, x_count, n, ahead);
  }
  if (count == 7) {
    return AxpyFewRows<7, 2, Reader, Rows>(tag, acc, ld_acc, weights, ps, x, x_count, n, ahead);
  }
#endif
  constexpr int V = Reader::kVectors;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(tag));
  std::int64_t d = 0;
  for (; d + kBlockVectors * N <= n; d += kBlockVectors * N) {
    PvColumns<kBlockVectors, Reader, kDecodeUnroll<Reader>, Rows>(
        tag, acc + d, ld_acc, weights, ps, x.from_column(d), count, x_count, ahead.from_column(d));
  }
  for (; d < n; d += V * N) {
    PvColumns<V, Reader, kDecodeUnroll<Reader>, Rows>(
        tag, acc + d, ld_acc, weights, ps, x.from_column(d), count, x_count, ahead.from_column(d));
  }
}

// Calls kernel(x_rows, ahead_rows) with the rows as StridedRows or, where their offsets are
// given, OffsetRows of Element. Rows ahead given in the other form are not asked for.
template <class Element, class Kernel>
HWY_INLINE void WithRowsOf(const ScatteredRows& x, const ScatteredRows& ahead,
                           const Kernel& kernel) {
  const bool ahead_alike = (ahead.byte_offsets == nullptr) == (x.byte_offsets == nullptr);
  if (x.byte_offsets == nullptr) {
    using Rows = StridedRows<Element>;
    kernel(Rows{static_cast<const Element*>(x.base), x.ld},
           ahead_alike ? Rows{static_cast<const Element*>(ahead.base), ahead.ld, ahead.into_l2}
                       : Rows{});
  } else {
    using Rows = OffsetRows<Element>;
    kernel(Rows(x), ahead_alike ? Rows(ahead) : Rows{});
  }
}

// Calls kernel(x_rows, ahead_rows, count, first) with the x rows [first, first + count) of the
// input dtype's element type: all of them, or, for f16 on targets without F16C, one at a time
// widened by the scalar conversion (the portable targets), with no rows ahead.
template <class Kernel>
HWY_INLINE void WithInputRows(const ScatteredRows& x, const ScatteredRows& ahead, DType x_dtype,
                              std::int64_t x_count, std::int64_t n, const Kernel& kernel) {
  auto all_rows = [&](auto rows, auto ahead_rows) { kernel(rows, ahead_rows, x_count, 0); };
  switch (x_dtype) {
    case DType::f32:
      WithRowsOf<float>(x, ahead, all_rows);
      return;
    case DType::bf16:
      WithRowsOf<hwy::bfloat16_t>(x, ahead, all_rows);
      return;
    case DType::f16:
      if constexpr (kWidensF16) {
        WithRowsOf<hwy::float16_t>(x, ahead, all_rows);
      } else {
        std::vector<float> row(static_cast<std::size_t>(n));
        WithRowsOf<std::uint16_t>(x, {}, [&](auto bits, auto) {
          for (std::int64_t k = 0; k < x_count; ++k) {
            for (std::int64_t d = 0; d < n; ++d) row[d] = f32_from_f16(bits.row(k)[d]);
            kernel(StridedRows<float>{row.data(), n}, StridedRows<float>{}, 1, k);
          }
        });
      }
      return;
    case DType::int8:
      WithRowsOf<std::int8_t>(x, ahead, all_rows);
      return;
    case DType::fp8_e4m3:
      WithRowsOf<Fp8E4M3Code>(x, ahead, all_rows);
      return;
    case DType::fp8_e5m2:
      WithRowsOf<Fp8E5M2Code>(x, ahead, all_rows);
      return;
  }
}

void DotRows(float* HWY_RESTRICT out, std::int64_t out_stride, const float* HWY_RESTRICT rows,
             std::int64_t ld_rows, std::int64_t count, const ScatteredRows& x, DType x_dtype,
             std::int64_t x_count, std::int64_t n, const ScatteredRows& ahead) {
  WithInputRows(x, ahead, x_dtype, x_count, n,
                [&](auto typed, auto typed_ahead, std::int64_t typed_count, std::int64_t first) {
                  using Rows = decltype(typed);
                  DotRowsOf<Widened<typename Rows::Element>, Rows>(out + first, out_stride, rows,
                                                                   ld_rows, count, typed,
                                                                   typed_count, n, typed_ahead);
                });
}

void DotRowsBf16Pairs(float* HWY_RESTRICT out, std::int64_t out_stride,
                      const float* HWY_RESTRICT rows, std::int64_t ld_rows, std::int64_t count,
                      const ScatteredRows& x, std::int64_t x_count, std::int64_t n,
                      const ScatteredRows& ahead) {
  WithRowsOf<hwy::bfloat16_t>(x, ahead, [&](auto typed, auto typed_ahead) {
    DotRowsOf<Bf16Pairs, decltype(typed)>(out, out_stride, rows, ld_rows, count, typed, x_count, n,
                                          typed_ahead);
  });
}

void AxpyRows(float* HWY_RESTRICT acc, std::int64_t ld_acc, const float* HWY_RESTRICT weights,
              std::int64_t weight_stride, std::int64_t count, const ScatteredRows& x, DType x_dtype,
              std::int64_t x_count, std::int64_t n, const ScatteredRows& ahead) {
  WithInputRows(x, ahead, x_dtype, x_count, n,
                [&](auto typed, auto typed_ahead, std::int64_t typed_count, std::int64_t first) {
                  using Rows = decltype(typed);
                  AxpyRowsOf<Widened<typename Rows::Element>, Rows>(acc, ld_acc, weights + first,
                                                                    weight_stride, count, typed,
                                                                    typed_count, n, typed_ahead);
                });
}

void AxpyRowsBf16Pairs(float* HWY_RESTRICT acc, std::int64_t ld_acc,
                       const float* HWY_RESTRICT weights, std::int64_t weight_stride,
                       std::int64_t count, const ScatteredRows& x, std::int64_t x_count,
                       std::int64_t n, const ScatteredRows& ahead) {
  WithRowsOf<hwy::bfloat16_t>(x, ahead, [&](auto typed, auto typed_ahead) {
    AxpyRowsOf<Bf16Pairs, decltype(typed)>(acc, ld_acc, weights, weight_stride, count, typed,
                                           x_count, n, typed_ahead);
  });
}

std::int64_t Bf16PairChunk() { return 2 * static_cast<std::int64_t>(hn::Lanes(Tag())); }

// Transposes the kLanes x kLanes block v in log2(kLanes) rounds, each splitting every pair of
// rows into their even and odd lanes (ConcatEven, ConcatOdd): a round moves the lowest column
// bit of each element's position to the top of its row index and the lowest row bit to the top
// of its column index, so after log2(kLanes) rounds row and column have traded places.
#if HWY_TARGET != HWY_SCALAR
template <std::size_t kLanes>
HWY_INLINE void TransposeBlock(Tag tag, Vec (&v)[kLanes]) {
  for (std::size_t round = 1; round < kLanes; round *= 2) {
    Vec next[kLanes];
    for (std::size_t i = 0; i < kLanes / 2; ++i) {
      next[i] = hn::ConcatEven(tag, v[2 * i + 1], v[2 * i]);
      next[i + kLanes / 2] = hn::ConcatOdd(tag, v[2 * i + 1], v[2 * i]);
    }
    for (std::size_t i = 0; i < kLanes; ++i) v[i] = next[i];
  }
}
#endif

// By blocks of kLanes x kLanes in registers rather than element by element: fewer cycles per
// element, though in the forward the packing mostly waits for memory (docs/tuning.md).
void TransposeRows(float* HWY_RESTRICT dst, std::int64_t ld_dst, const float* const* rows,
                   std::int64_t count, std::int64_t n) {
  constexpr std::size_t kLanes = HWY_LANES(float);
  for (std::int64_t r0 = 0; r0 < kTileLanes; r0 += static_cast<std::int64_t>(kLanes)) {
    std::int64_t d = 0;
#if HWY_TARGET != HWY_SCALAR
    const Tag tag;
    for (; d + static_cast<std::int64_t>(kLanes) <= n; d += static_cast<std::int64_t>(kLanes)) {
      Vec block[kLanes];
      for (std::size_t i = 0; i < kLanes; ++i) {
        const std::int64_t r = r0 + static_cast<std::int64_t>(i);
        block[i] = r < count ? hn::LoadU(tag, rows[r] + d) : hn::Zero(tag);
      }
      TransposeBlock<kLanes>(tag, block);
      for (std::size_t k = 0; k < kLanes; ++k) {
        hn::StoreU(block[k], tag, dst + (d + static_cast<std::int64_t>(k)) * ld_dst + r0);
      }
    }
#endif
    for (; d < n; ++d) {
      for (std::int64_t r = r0; r < r0 + static_cast<std::int64_t>(kLanes); ++r) {
        dst[d * ld_dst + r] = r < count ? rows[r][d] : 0.0f;
      }
    }
  }
}

bool AllFinite(const float* HWY_RESTRICT values, std::int64_t n) {
  const Tag tag;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(tag));
  Vec non_finite = hn::Zero(tag);
  std::int64_t i = 0;
  for (; i + N <= n; i += N) {
    non_finite =
        hn::Or(non_finite, hn::VecFromMask(tag, hn::Not(hn::IsFinite(hn::LoadU(tag, values + i)))));
  }
  bool finite = hn::AllFalse(tag, hn::MaskFromVec(non_finite));
  for (; i < n; ++i) finite = finite && std::isfinite(values[i]);
  return finite;
}

bool AllFiniteBf16(const std::uint16_t* HWY_RESTRICT values, std::int64_t n) {
  const hn::ScalableTag<std::uint16_t> tag;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(tag));
  constexpr std::uint16_t kExponent = 0x7f80;  // all ones: inf or NaN
  const auto exponent = hn::Set(tag, kExponent);
  auto non_finite = hn::Zero(tag);
  std::int64_t i = 0;
  for (; i + N <= n; i += N) {
    const auto bits = hn::And(hn::LoadU(tag, values + i), exponent);
    non_finite = hn::Or(non_finite, hn::VecFromMask(tag, hn::Eq(bits, exponent)));
  }
  bool finite = hn::AllFalse(tag, hn::MaskFromVec(non_finite));
  for (; i < n; ++i) finite = finite && (values[i] & kExponent) != kExponent;
  return finite;
}

}  // namespace HWY_NAMESPACE
}  // namespace flashattn::detail::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace flashattn::detail::cpu {

HWY_EXPORT(ScoresTile);
HWY_EXPORT(OnlineSoftmaxTile);
HWY_EXPORT(AccumulatePvTile);
HWY_EXPORT(AccumulateTransposedPvTile);
HWY_EXPORT(ProbabilitiesFromLseTile);
HWY_EXPORT(SoftmaxGradientTile);
HWY_EXPORT(ModifyScores);
HWY_EXPORT(TransposeRows);
HWY_EXPORT(DotRows);
HWY_EXPORT(AxpyRows);
HWY_EXPORT(DotRowsBf16Pairs);
HWY_EXPORT(AxpyRowsBf16Pairs);
HWY_EXPORT(Bf16PairChunk);
HWY_EXPORT(AllFinite);
HWY_EXPORT(AllFiniteBf16);

void scores_tile(float* scores, std::int64_t ld_scores, const RowsOperand& q, const float* k_packed,
                 std::int64_t rows, std::int64_t keys_padded, std::int64_t head_dim) {
  HWY_DYNAMIC_DISPATCH(ScoresTile)
  (scores, ld_scores, q, k_packed, rows, keys_padded, head_dim, 0, keys_padded);
}

void scores_tile_columns(float* scores, std::int64_t ld_scores, const RowsOperand& q,
                         const float* k_packed, std::int64_t rows, std::int64_t keys_padded,
                         std::int64_t head_dim, std::int64_t column_begin,
                         std::int64_t column_end) {
  HWY_DYNAMIC_DISPATCH(ScoresTile)
  (scores, ld_scores, q, k_packed, rows, keys_padded, head_dim, column_begin, column_end);
}

void online_softmax_tile(float* scores, std::int64_t ld_scores, float scale, float* row_max,
                         float* row_sum, float* acc, std::int64_t ld_acc, std::int64_t rows,
                         std::int64_t keys_padded, std::int64_t dims_padded) {
  HWY_DYNAMIC_DISPATCH(OnlineSoftmaxTile)
  (scores, ld_scores, scale, row_max, row_sum, acc, ld_acc, rows, keys_padded, dims_padded);
}

void accumulate_pv_tile(float* acc, std::int64_t ld_acc, const float* p, std::int64_t ld_p,
                        const float* v_packed, std::int64_t packed_keys, std::int64_t key_begin,
                        std::int64_t key_end, std::int64_t rows, std::int64_t dims_padded) {
  HWY_DYNAMIC_DISPATCH(AccumulatePvTile)
  (acc, ld_acc, p, ld_p, v_packed, packed_keys, key_begin, key_end, rows, dims_padded);
}

void accumulate_transposed_pv_tile(float* acc, std::int64_t ld_acc, const float* p,
                                   std::int64_t ld_p, const float* v_packed,
                                   std::int64_t packed_rows, std::int64_t columns,
                                   std::int64_t dims_padded) {
  HWY_DYNAMIC_DISPATCH(AccumulateTransposedPvTile)
  (acc, ld_acc, p, ld_p, v_packed, packed_rows, columns, dims_padded);
}

void probabilities_from_lse_tile(float* scores, std::int64_t ld_scores, float scale,
                                 const float* lse, std::int64_t rows, std::int64_t keys_padded) {
  HWY_DYNAMIC_DISPATCH(ProbabilitiesFromLseTile)(scores, ld_scores, scale, lse, rows, keys_padded);
}

void softmax_gradient_tile(float* dp, std::int64_t ld_dp, const float* p, std::int64_t ld_p,
                           const float* row_delta, float scale, std::int64_t rows,
                           std::int64_t keys_padded) {
  HWY_DYNAMIC_DISPATCH(SoftmaxGradientTile)
  (dp, ld_dp, p, ld_p, row_delta, scale, rows, keys_padded);
}

void modify_scores(float* scores, float* derivative, std::int64_t n, float scale,
                   const RowModifiers& row) {
  HWY_DYNAMIC_DISPATCH(ModifyScores)
  (scores, derivative, n, scale, row);
}

void transpose_rows(float* dst, std::int64_t ld_dst, const float* const* rows, std::int64_t count,
                    std::int64_t n) {
  HWY_DYNAMIC_DISPATCH(TransposeRows)(dst, ld_dst, rows, count, n);
}

void dot_rows(float* out, std::int64_t out_stride, const float* rows, std::int64_t ld_rows,
              std::int64_t count, const ScatteredRows& x, DType x_dtype, std::int64_t x_count,
              std::int64_t n, const ScatteredRows& ahead) {
  HWY_DYNAMIC_DISPATCH(DotRows)
  (out, out_stride, rows, ld_rows, count, x, x_dtype, x_count, n, ahead);
}

void axpy_rows(float* acc, std::int64_t ld_acc, const float* weights, std::int64_t weight_stride,
               std::int64_t count, const ScatteredRows& x, DType x_dtype, std::int64_t x_count,
               std::int64_t n, const ScatteredRows& ahead) {
  HWY_DYNAMIC_DISPATCH(AxpyRows)
  (acc, ld_acc, weights, weight_stride, count, x, x_dtype, x_count, n, ahead);
}

std::int64_t bf16_pair_chunk() { return HWY_DYNAMIC_DISPATCH(Bf16PairChunk)(); }

void to_bf16_pair_order(float* dst, const float* src, std::int64_t n) {
  const std::int64_t chunk = bf16_pair_chunk(), half = chunk / 2;
  for (std::int64_t first = 0; first < n; first += chunk) {
    for (std::int64_t i = 0; i < half; ++i) {
      dst[first + i] = src[first + 2 * i];
      dst[first + half + i] = src[first + 2 * i + 1];
    }
  }
}

void from_bf16_pair_order(float* dst, const float* src, std::int64_t n) {
  const std::int64_t chunk = bf16_pair_chunk(), half = chunk / 2;
  for (std::int64_t first = 0; first < n; first += chunk) {
    for (std::int64_t i = 0; i < half; ++i) {
      dst[first + 2 * i] = src[first + i];
      dst[first + 2 * i + 1] = src[first + half + i];
    }
  }
}

void dot_rows_bf16_pairs(float* out, std::int64_t out_stride, const float* rows,
                         std::int64_t ld_rows, std::int64_t count, const ScatteredRows& x,
                         std::int64_t x_count, std::int64_t n, const ScatteredRows& ahead) {
  HWY_DYNAMIC_DISPATCH(DotRowsBf16Pairs)
  (out, out_stride, rows, ld_rows, count, x, x_count, n, ahead);
}

void axpy_rows_bf16_pairs(float* acc, std::int64_t ld_acc, const float* weights,
                          std::int64_t weight_stride, std::int64_t count, const ScatteredRows& x,
                          std::int64_t x_count, std::int64_t n, const ScatteredRows& ahead) {
  HWY_DYNAMIC_DISPATCH(AxpyRowsBf16Pairs)
  (acc, ld_acc, weights, weight_stride, count, x, x_count, n, ahead);
}

bool all_finite(const float* values, std::int64_t n) {
  return HWY_DYNAMIC_DISPATCH(AllFinite)(values, n);
}

bool all_finite_bf16(const std::uint16_t* values, std::int64_t n) {
  return HWY_DYNAMIC_DISPATCH(AllFiniteBf16)(values, n);
}

std::vector<SimdTarget> supported_simd_targets() {
  std::vector<SimdTarget> targets;
  for (std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
    targets.push_back({target, hwy::TargetName(target)});
  }
  return targets;
}

void force_simd_target(std::int64_t id) {
  hwy::SetSupportedTargetsForTest(id);
  // Dispatch tables re-resolve on the next call after the chosen target is reset.
  hwy::GetChosenTarget().Update(hwy::SupportedTargets());
}

std::string active_simd_target() {
  const std::vector<std::int64_t> targets = hwy::SupportedAndGeneratedTargets();
  return targets.empty() ? "none" : hwy::TargetName(targets.front());
}

}  // namespace flashattn::detail::cpu
#endif  // HWY_ONCE
