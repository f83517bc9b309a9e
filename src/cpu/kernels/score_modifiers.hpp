#pragma once

// The score modifiers of options.hpp on one row of a score tile, the step every fast path runs
// between its q·k product and its softmax when the logits are not plain scale·q·k
// (ScoreModifiers::change_logits). Compiled once per SIMD target in tile_kernels.cpp, beside the
// softmax whose exp it shares. The fp64 definition is reference/logits.hpp.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "api/params.hpp"

namespace flashattn::detail::cpu {

// One row's modifiers: its query head's softcap and ALiBi slope, and the distance from the
// diagonal of the row's first key in the tile (row + seqlen_kv − seqlen_q − key).
struct RowModifiers {
  float softcap;
  float slope;
  std::int64_t first_distance;
};

// The modifiers of query row `row` of (batch b, query head h) for a tile whose first key is
// `key_begin`, in a problem whose keys number `seqlen_kv` (a serving batch entry's own).
inline RowModifiers row_modifiers(const AttentionParams& p, std::int64_t b, std::int64_t h,
                                  std::int64_t row, std::int64_t key_begin,
                                  std::int64_t seqlen_kv) {
  return {p.modifiers.softcap, p.modifiers.alibi_slope(b, h),
          row + seqlen_kv - p.seqlen_q - key_begin};
}

// In place, for j < n: x = scale·scores[j], then softcap·tanh(x / softcap) (softcap > 0), then
// − slope·|first_distance − j| (slope != 0). With `derivative` not null, derivative[j] receives
// d logit / dx: 1 − tanh²(x / softcap), or 1 without a softcap (the backward's chain rule). n
// need not be a whole number of vectors. Distances beyond 2^24 round to fp32.
void modify_scores(float* scores, float* derivative, std::int64_t n, float scale,
                   const RowModifiers& row);

// The epilogue of one row of an online softmax: what its accumulator is multiplied by, and its
// lse. `row_max` is the largest logit the row saw (-inf when none), `sum` Σ exp(logit − row_max),
// `sink` the query head's sink logit (-inf without sinks), which joins the normalizer on the
// larger of the two maxima. A row that sees no key gets 0 and lse = sink; one whose visible logits
// are all -inf (an infinite input) gets 0/0 = NaN without a sink, as the reference does.
struct RowNormalizer {
  float inverse_sum;
  float lse;
};
inline RowNormalizer normalize_row(float row_max, float sum, bool no_key_seen, float sink) {
  constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();
  if (no_key_seen) return {0.0f, sink};
  if (sink == kNegativeInfinity) {
    return {1.0f / sum, (row_max == kNegativeInfinity ? 0.0f : row_max) + std::log(sum)};
  }
  const float max = std::max(row_max, sink);
  const float rescale = row_max == kNegativeInfinity ? 0.0f : std::exp(row_max - max);
  const float total = sum * rescale + std::exp(sink - max);
  return {rescale / total, max + std::log(total)};
}

// Query head h's sink logit, or -inf without sinks.
inline float sink_logit(const AttentionParams& p, std::int64_t h) {
  return p.modifiers.sinks ? p.modifiers.sinks[h] : -std::numeric_limits<float>::infinity();
}

}  // namespace flashattn::detail::cpu
