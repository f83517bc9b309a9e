#pragma once

// Rows of one head as the paths share them: an operand's rows as an fp32 matrix for sgemm
// (gather_rows, scatter_rows), and the backward's per-row inputs, D_i = rowsum(dO ∘ O)
// (row_deltas) and the forward's lse as the backward reads it (backward_row_lse), which the
// standard and the flash backward both use.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "api/params.hpp"
#include "util/convert.hpp"
#include "util/dot.hpp"

namespace flashattn::detail {

// An fp32 matrix of rows of contiguous elements, `stride` elements apart: either the caller's
// memory (f32 inputs) or a converted copy.
struct Matrix {
  const float* data;
  std::int64_t stride;
};

// Rows [0, rows) of head h in batch b, `cols` elements each, as sgemm can read them.
inline Matrix gather_rows(std::vector<float>& storage, const void* base, DType dtype,
                          const Strides& strides, std::int64_t b, std::int64_t h, std::int64_t rows,
                          std::int64_t cols) {
  // No rows: the tensor may be empty with a null base, which takes no offset.
  if (rows == 0) return {nullptr, cols};
  // sgemm reads f32 rows in place when they do not overlap (its leading dimension must be
  // >= cols); a single row may have any stride.
  if (dtype == DType::f32 && (rows <= 1 || strides.seq >= cols)) {
    return {static_cast<const float*>(base) + strides.offset(b, 0, h),
            rows <= 1 ? cols : strides.seq};
  }
  storage.resize(static_cast<std::size_t>(rows * cols));
  for (std::int64_t r = 0; r < rows; ++r) {
    load_row_f32(storage.data() + r * cols, base, dtype, strides.offset(b, r, h), cols);
  }
  return {storage.data(), cols};
}

// Whether every element of the first `cols` columns of `rows` rows is finite.
inline bool all_finite(const Matrix& m, std::int64_t rows, std::int64_t cols) {
  bool finite = true;
  for (std::int64_t r = 0; r < rows && finite; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) finite &= std::isfinite(m.data[r * m.stride + c]);
  }
  return finite;
}

// Writes rows x cols contiguous fp32 values to head h of batch b in the operand's dtype.
inline void scatter_rows(void* base, DType dtype, const Strides& strides, std::int64_t b,
                         std::int64_t h, const float* values, std::int64_t rows,
                         std::int64_t cols) {
  for (std::int64_t r = 0; r < rows; ++r) {
    store_row_f32(base, dtype, strides.offset(b, r, h), values + r * cols, cols);
  }
}

// rowsum(dO ∘ O) of each of `rows` query rows of head h: the D_i of the softmax gradient.
// f16/bf16 rows are widened kChunk elements at a time.
inline void row_deltas(float* delta, const void* dout, const Strides& dout_strides, const void* out,
                       const Strides& out_strides, DType dtype, std::int64_t b, std::int64_t h,
                       std::int64_t row_begin, std::int64_t rows, std::int64_t head_dim) {
  constexpr std::int64_t kChunk = 256;
  float dout_row[kChunk], out_row[kChunk];
  for (std::int64_t r = 0; r < rows; ++r) {
    if (r + kRowsAhead < rows) {
      prefetch_row(dout, dtype, dout_strides.offset(b, row_begin + r + kRowsAhead, h), head_dim);
      prefetch_row(out, dtype, out_strides.offset(b, row_begin + r + kRowsAhead, h), head_dim);
    }
    const std::int64_t dout_offset = dout_strides.offset(b, row_begin + r, h);
    const std::int64_t out_offset = out_strides.offset(b, row_begin + r, h);
    if (dtype == DType::f32) {
      delta[r] = dot_f32(static_cast<const float*>(dout) + dout_offset,
                         static_cast<const float*>(out) + out_offset, head_dim);
      continue;
    }
    float sum = 0.0f;
    for (std::int64_t d = 0; d < head_dim; d += kChunk) {
      const std::int64_t n = std::min(kChunk, head_dim - d);
      load_row_f32(dout_row, dout, dtype, dout_offset + d, n);
      load_row_f32(out_row, out, dtype, out_offset + d, n);
      sum += dot_f32(dout_row, out_row, n);
    }
    delta[r] = sum;
  }
}

// The forward's lse of `rows` query rows of head h from row_begin, as the backward uses it. A
// row that sees keys but whose visible scores were all -inf got out NaN (0/0) and lse -inf;
// its lse becomes NaN so that P, and with it the row's gradients, are NaN as the reference's
// are, while a fully masked row (by the causal mask, or by a bias or mask:
// AttentionParams::keys_all_masked) keeps -inf: P = 0 and zero gradients.
inline void backward_row_lse(float* lse, const AttentionParams& p, std::int64_t b, std::int64_t h,
                             std::int64_t row_begin, std::int64_t rows) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const float value = p.lse[p.lse_index(b, h, row_begin + r)];
    const bool sees_keys = value == -std::numeric_limits<float>::infinity() &&
                           !p.key_range(row_begin + r).empty() &&
                           !p.keys_all_masked(b, h, row_begin + r);
    lse[r] = value == -std::numeric_limits<float>::infinity() && sees_keys
                 ? std::numeric_limits<float>::quiet_NaN()
                 : value;
  }
}

// Whether some element of values[0, n) is NaN.
inline bool any_nan(const float* values, std::int64_t n) {
  return std::any_of(values, values + n, [](float x) { return std::isnan(x); });
}

}  // namespace flashattn::detail
