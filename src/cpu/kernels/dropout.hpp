#pragma once

// The dropout mask of util/dropout.hpp on one row of a probability tile, generated with SIMD
// (Philox on a vector of counters, one Highway target per CPU) and applied as it is generated.

#include <cstdint>

#include "api/params.hpp"

namespace flashattn::detail::cpu {

// One row's coordinates in the mask: its stream ((first_batch + b) · heads_q + h) and row.
struct DropoutRow {
  const Dropout* dropout;
  std::uint32_t stream, row;
};

// The row's mask on keys [key_begin, key_begin + n), values[i] holding key key_begin + i:
//   apply_dropout:        values[i] ·= kept ? scale : 0  (a NaN stays NaN, as the reference's)
//   dropout_multipliers:  values[i] = kept ? scale : 0
void apply_dropout(float* values, std::int64_t key_begin, std::int64_t n, const DropoutRow& row);
void dropout_multipliers(float* values, std::int64_t key_begin, std::int64_t n,
                         const DropoutRow& row);

// apply_dropout on `count` rows of a tile, row r at values + r·ld with coordinates rows[r], in
// one call (a call per row cost the forward as much as a third of the mask's time).
void apply_dropout_rows(float* values, std::int64_t ld, const DropoutRow* rows, std::int64_t count,
                        std::int64_t key_begin, std::int64_t n);

}  // namespace flashattn::detail::cpu
