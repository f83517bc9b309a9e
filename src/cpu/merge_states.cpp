// Merging two partial attention states (flashattn/merge.hpp), row by row:
//   m = max(lse_a, lse_b), w_a = exp(lse_a − m), w_b = exp(lse_b − m), s = w_a + w_b
//   out = (w_a·out_a + w_b·out_b) / s,  lse = m + log(s)
// in fp32, as the flash forward's epilogue and the decode path's chunk merge compute. A task is a
// block of rows; each row is read once and written once, so the work is bound by memory.

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "api/backends.hpp"
#include "util/convert.hpp"
#include "util/parallel.hpp"

namespace flashattn::detail {
namespace {

constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

// Rows per task: enough that a task's overhead is small against reading 2 x 64 rows.
constexpr std::int64_t kRowsPerTask = 64;

// The weights of the two sides, and the merged lse, of one row.
struct RowWeights {
  float a, b, lse;
};

RowWeights row_weights(float lse_a, float lse_b) {
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  if (std::isnan(lse_a) || std::isnan(lse_b)) return {kNaN, kNaN, kNaN};
  const float max = lse_a > lse_b ? lse_a : lse_b;
  // Neither side saw a key: both weigh 0 (0·out keeps a non-finite out row visible).
  if (max == kNegativeInfinity) return {0.0f, 0.0f, kNegativeInfinity};
  const float a = lse_a == max ? 1.0f : std::exp(lse_a - max);
  const float b = lse_b == max ? 1.0f : std::exp(lse_b - max);
  const float sum = a + b;
  return {a / sum, b / sum, max + std::log(sum)};
}

}  // namespace

void merge_states(const MergeParams& p) {
  const std::int64_t D = p.head_dim;
  const std::int64_t rows = p.batch * p.seqlen * p.heads;
  const std::int64_t tasks = (rows + kRowsPerTask - 1) / kRowsPerTask;
  // A row is (b, s, h) in the order of [batch, seqlen, heads]: the outputs' memory order.
  auto run_task = [&](std::vector<float>& merged, std::int64_t task) {
    const std::int64_t end = std::min(rows, (task + 1) * kRowsPerTask);
    for (std::int64_t row = task * kRowsPerTask; row < end; ++row) {
      const std::int64_t h = row % p.heads, s = row / p.heads % p.seqlen,
                         b = row / p.heads / p.seqlen;
      const std::int64_t index = p.lse_index(b, h, s);
      const RowWeights w = row_weights(p.lse_a[index], p.lse_b[index]);
      const float* a = p.out_a + p.a_strides.offset(b, s, h);
      const float* bside = p.out_b + p.b_strides.offset(b, s, h);
      for (std::int64_t d = 0; d < D; ++d) merged[d] = w.a * a[d] + w.b * bside[d];
      store_row_f32(p.out, p.out_dtype, p.out_strides.offset(b, s, h), merged.data(), D);
      if (p.lse) p.lse[index] = w.lse;
    }
  };
  parallel_tasks(
      p.num_threads, tasks, [&] { return std::vector<float>(static_cast<std::size_t>(D)); },
      run_task);
}

}  // namespace flashattn::detail
