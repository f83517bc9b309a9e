#pragma once

// The score modifiers of options.hpp on one row of a score tile, the step every fast path runs
// between its q·k product and its softmax when the logits are not plain scale·q·k
// (ScoreModifiers::change_logits). Compiled once per SIMD target in tile_kernels.cpp, beside the
// softmax whose exp it shares. The fp64 definition is reference/logits.hpp.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "api/params.hpp"
#include "cpu/kernels/tile_kernels.hpp"

namespace flashattn::detail::cpu {

// One row's modifiers: its query head's softcap and ALiBi slope, the distance from the
// diagonal of the row's first key in the tile (row + seqlen_kv − seqlen_q − key), and where the
// row's bias and mask start at that key (null when off), with their element strides along keys.
struct RowModifiers {
  float softcap;
  float slope;
  std::int64_t first_distance;
  const void* bias = nullptr;
  DType bias_dtype = DType::f32;
  std::int64_t bias_stride = 0;
  const unsigned char* mask = nullptr;
  std::int64_t mask_stride = 0;
};

// The modifiers of query row `row` of (batch b, query head h) for a tile whose first key is
// `key_begin`, in a problem whose keys number `seqlen_kv` (a serving batch entry's own).
inline RowModifiers row_modifiers(const AttentionParams& p, std::int64_t b, std::int64_t h,
                                  std::int64_t row, std::int64_t key_begin,
                                  std::int64_t seqlen_kv) {
  const ScoreModifiers& m = p.modifiers;
  RowModifiers modifiers{m.softcap, m.alibi_slope(b, h),
                         row + seqlen_kv - p.seqlen_q + p.diagonal_shift - key_begin};
  if (m.bias.data != nullptr) {
    modifiers.bias = static_cast<const char*>(m.bias.data) +
                     m.bias.offset(b, h, row, key_begin) * dtype_size(m.bias.dtype);
    modifiers.bias_dtype = m.bias.dtype;
    modifiers.bias_stride = m.bias.key;
  }
  if (m.mask.data != nullptr) {
    modifiers.mask =
        static_cast<const unsigned char*>(m.mask.data) + m.mask.offset(b, h, row, key_begin);
    modifiers.mask_stride = m.mask.key;
  }
  return modifiers;
}

// Whether some key of [key_begin, key_end) is left unmasked by the bias and mask for some row of
// [row_begin, row_end) of (batch b, query head h): a block they mask entirely is skipped. True
// without either. A bias stops at its first finite entry, a mask is read eight bytes at a time.
inline bool logits_keep_some(const AttentionParams& p, std::int64_t b, std::int64_t h,
                             std::int64_t row_begin, std::int64_t row_end, std::int64_t key_begin,
                             std::int64_t key_end) {
  if (!p.modifiers.masks_logits()) return true;
  const LogitView& mask = p.modifiers.mask;
  if (p.modifiers.bias.data != nullptr) {
    for (std::int64_t row = row_begin; row < row_end; ++row) {
      for (std::int64_t j = key_begin; j < key_end; ++j) {
        if (!p.key_masked(b, h, row, j)) return true;
      }
    }
    return false;
  }
  const auto* bytes = static_cast<const unsigned char*>(mask.data);
  const std::int64_t n = key_end - key_begin;
  for (std::int64_t row = row_begin; row < row_end; ++row) {
    const unsigned char* keys = bytes + mask.offset(b, h, row, key_begin);
    std::int64_t j = 0;
    if (mask.key == 1) {  // eight keys a word
      for (; j + 8 <= n; j += 8) {
        std::uint64_t word;
        std::memcpy(&word, keys + j, sizeof word);
        if (word != 0) return true;
      }
    }
    for (; j < n; ++j) {
      if (keys[j * mask.key] != 0) return true;
    }
  }
  return false;
}

// Calls add(first_run, last_run) for each run of consecutive keys of [first, last) that no bias
// or mask masks for query row `row` of (batch b, query head h); the whole range without them.
// For the P·V of rows whose value rows hold an infinity or a NaN: a masked key's 0·inf must not
// reach the row, as it does not in the reference, which skips masked keys.
template <class Add>
void for_each_kept_run(const AttentionParams& p, std::int64_t b, std::int64_t h, std::int64_t row,
                       std::int64_t first, std::int64_t last, Add&& add) {
  if (!p.modifiers.masks_logits()) {
    if (first < last) add(first, last);
    return;
  }
  std::int64_t j = first;
  while (j < last) {
    while (j < last && p.key_masked(b, h, row, j)) ++j;
    const std::int64_t run = j;
    while (j < last && !p.key_masked(b, h, row, j)) ++j;
    if (run < j) add(run, j);
  }
}

// Whether query row `row` of (batch b, query head h) sees no key: none in its range, or (its
// logits' maximum `row_max` being -inf) a bias or mask masks them all.
inline bool no_key_seen(const AttentionParams& p, std::int64_t b, std::int64_t h, std::int64_t row,
                        float row_max) {
  return p.key_range(row).empty() ||
         (row_max == -std::numeric_limits<float>::infinity() && p.keys_all_masked(b, h, row));
}

// Query head h's sink logit, or -inf without sinks.
inline float sink_logit(const AttentionParams& p, std::int64_t h) {
  return p.modifiers.sinks ? p.modifiers.sinks[h] : -std::numeric_limits<float>::infinity();
}

// Whether query row `row` of (batch b, query head h), whose forward gave `lse`, had every key
// masked by a bias or mask (AttentionParams::keys_all_masked; the forward's epilogue then set
// lse to the sink, -inf without sinks, which is checked first). Such a row adds nothing to any
// gradient, as in the reference; 0·inf from its dO must not reach them.
inline bool row_fully_masked(const AttentionParams& p, std::int64_t b, std::int64_t h,
                             std::int64_t row, float lse) {
  return p.modifiers.masks_logits() && lse == sink_logit(p, h) && p.keys_all_masked(b, h, row);
}

// For dbias: the logits' gradient ds[0, n) of query row `row` of (batch b, query head h), keys
// [key_begin, key_begin + n), into dlogits[0, n); 0 for the keys the row does not see and for a
// fully masked row (`lse`, as row_fully_masked), as in the reference. A key that a bias or mask
// masks has P = 0, so its ds is ±0, which adds nothing to dbias's sums either way, unless dP is
// infinite: that NaN is zeroed (the reference's 0). Only non-finite values look the mask up.
inline void store_dlogits_row(const AttentionParams& p, std::int64_t b, std::int64_t h,
                              std::int64_t row, std::int64_t key_begin, std::int64_t n,
                              const float* ds, float lse, float* dlogits) {
  if (row_fully_masked(p, b, h, row, lse)) {
    std::fill_n(dlogits, n, 0.0f);
    return;
  }
  // The keys the row sees, as offsets into [0, n): copied, the rest 0.
  const KeyRange keys = p.key_range(row);
  const std::int64_t first = std::clamp(keys.begin - key_begin, std::int64_t{0}, n);
  const std::int64_t last = std::clamp(keys.end - key_begin, first, n);
  std::fill_n(dlogits, first, 0.0f);
  std::copy(ds + first, ds + last, dlogits + first);
  std::fill(dlogits + last, dlogits + n, 0.0f);
  if (!p.modifiers.masks_logits() || all_finite(dlogits + first, last - first)) return;
  for (std::int64_t j = first; j < last; ++j) {
    if (!std::isfinite(dlogits[j]) && p.key_masked(b, h, row, key_begin + j)) dlogits[j] = 0.0f;
  }
}

// In place, for j < n: x = scale·scores[j], then softcap·tanh(x / softcap) (softcap > 0), then
// − slope·|first_distance − j| (slope != 0), then + bias[j] (a bias; −inf where it is −inf,
// whatever the score), then −inf where mask[j] is 0 (a mask). With `derivative` not null,
// derivative[j] receives d logit / dx: 1 − tanh²(x / softcap), or 1 without a softcap (the
// backward's chain rule). n need not be a whole number of vectors. Distances beyond 2^24 round to
// fp32.
void modify_scores(float* scores, float* derivative, std::int64_t n, float scale,
                   const RowModifiers& row);

// The epilogue of one row of an online softmax: what its accumulator is multiplied by, and its
// lse. `row_max` is the largest logit the row saw (-inf when none), `sum` Σ exp(logit − row_max),
// `sink` the query head's sink logit (-inf without sinks), which joins the normalizer on the
// larger of the two maxima. A row that sees no key (`no_key_seen`: none in its range, or a bias
// or mask masks them all, fully_masked) gets 0 and lse = sink; one whose visible logits are all
// -inf otherwise (an infinite input) gets 0/0 = NaN without a sink, as the reference does.
// `empty`: the row is of the first kind, whose output is exactly 0 (written as 0, not as acc·0,
// which a non-finite value of a masked key would make NaN).
struct RowNormalizer {
  float inverse_sum;
  float lse;
  bool empty = false;
};
inline RowNormalizer normalize_row(float row_max, float sum, bool no_key_seen, float sink) {
  constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();
  if (no_key_seen) return {0.0f, sink, true};
  if (sink == kNegativeInfinity) {
    return {1.0f / sum, (row_max == kNegativeInfinity ? 0.0f : row_max) + std::log(sum)};
  }
  const float max = std::max(row_max, sink);
  const float rescale = row_max == kNegativeInfinity ? 0.0f : std::exp(row_max - max);
  const float total = sum * rescale + std::exp(sink - max);
  return {rescale / total, max + std::log(total)};
}

}  // namespace flashattn::detail::cpu
