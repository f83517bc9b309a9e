#pragma once

// The score pipeline of docs/semantics.md ("Score modifiers") in fp64, as the reference forward
// and backward both apply it to one (query row, key) pair: the definition that the fast paths'
// cpu::modify_scores is tested against.

#include <cmath>
#include <cstdint>
#include <limits>

#include "api/params.hpp"

namespace flashattn::detail {

// The logit of key j for query row `row` of (batch b, query head h), from x = scale·q·k:
// softcap·tanh(x / softcap), then − slope·|row + seqlen_kv − seqlen_q − j|, then + bias; −inf
// where a bias or mask masks the key (AttentionParams::key_masked), whatever x is. When
// `softcap_derivative` is given it receives d logit / dx (1 without a softcap).
inline double reference_logit(const AttentionParams& p, std::int64_t b, std::int64_t h,
                              std::int64_t row, std::int64_t j, double x,
                              double* softcap_derivative = nullptr) {
  double logit = x;
  double derivative = 1.0;
  const ScoreModifiers& m = p.modifiers;
  if (m.softcap > 0.0f) {
    const double cap = m.softcap, t = std::tanh(x / cap);
    logit = cap * t;
    derivative = 1.0 - t * t;
  }
  if (m.alibi_slopes != nullptr) {
    const double distance =
        static_cast<double>(row + p.seqlen_kv - p.seqlen_q + p.diagonal_shift - j);
    logit -= static_cast<double>(m.alibi_slope(b, h)) * std::abs(distance);
  }
  if (m.bias.data != nullptr) logit += static_cast<double>(m.bias.bias(b, h, row, j));
  if (p.key_masked(b, h, row, j)) logit = -std::numeric_limits<double>::infinity();
  if (softcap_derivative != nullptr) *softcap_derivative = derivative;
  return logit;
}

// Query head h's sink logit, or -inf without sinks (exp(-inf) = 0 adds nothing).
inline double reference_sink(const AttentionParams& p, std::int64_t h) {
  return p.modifiers.sinks == nullptr ? -std::numeric_limits<double>::infinity()
                                      : static_cast<double>(p.modifiers.sinks[h]);
}

}  // namespace flashattn::detail
