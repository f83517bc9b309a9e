#pragma once

// The dropout mask, defined once (docs/semantics.md, "Dropout"). Each (query row, key) pair of
// a (batch entry, query head) draws 16 random bits from Random123's Philox4x32-10, a
// counter-based generator: the draw is a pure function of its coordinates, so the backward
// regenerates the forward's mask instead of storing it, and neither threads nor tiles change it.
//
// Key k of row i sits in block B = k / 128 at j = k % 128. The 16 counters of a block,
//   (16·B + l, i, stream, offset)  for l = 0..15,  keyed by the 64-bit seed,
// give 4 words each; key j takes word j / 32 of counter l = j % 16, its low half when j % 32 < 16
// and its high half otherwise. So a SIMD generator with up to 16 lanes of counters finds the
// draws of 16 consecutive keys in the low or high halves of one output vector
// (cpu/kernels/dropout.cpp, checked against this definition bit for bit).
// The stream is (first_batch + b) · heads_q + h. A key is dropped when its draw is below
// threshold = round(p · 2^16): the drop probability is p to within 2^-17.

#include <Random123/philox.h>

#include <cstdint>

#include "api/params.hpp"

namespace flashattn::detail {

inline constexpr std::int64_t kDropoutBlockKeys = 128;
inline constexpr std::int64_t kDropoutCounters = 16;  // per block

// The draw of key `key` of row `row` in stream `stream`.
inline std::uint32_t dropout_draw(const Dropout& dropout, std::uint32_t stream, std::uint32_t row,
                                  std::int64_t key) {
  const std::int64_t block = key / kDropoutBlockKeys, j = key % kDropoutBlockKeys;
  const r123::Philox4x32::ctr_type counter = {
      {static_cast<std::uint32_t>(block * kDropoutCounters + j % kDropoutCounters), row, stream,
       dropout.offset}};
  const r123::Philox4x32::key_type seed = {
      {static_cast<std::uint32_t>(dropout.seed), static_cast<std::uint32_t>(dropout.seed >> 32)}};
  const std::uint32_t word = r123::Philox4x32()(counter, seed)[j / 32];
  return j % 32 < 16 ? word & 0xffffu : word >> 16;
}

// The stream of batch entry b, query head h.
inline std::uint32_t dropout_stream(const AttentionParams& p, std::int64_t b, std::int64_t h) {
  return static_cast<std::uint32_t>((p.dropout.first_batch + b) * p.heads_q + h);
}

// Whether key `key` of query row `row` of (batch entry b, query head h) is kept.
inline bool dropout_kept(const AttentionParams& p, std::int64_t b, std::int64_t h, std::int64_t row,
                         std::int64_t key) {
  return dropout_draw(p.dropout, dropout_stream(p, b, h), static_cast<std::uint32_t>(row), key) >=
         p.dropout.threshold;
}

}  // namespace flashattn::detail
