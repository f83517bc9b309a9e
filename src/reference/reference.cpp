// The oracle: the seed's standard attention in plain loops with fp64 accumulation. It never gets
// fast and never goes away; every other path is tested against it. With dropout, each kept
// probability is multiplied by the fp32 scale 1 / (1 − p) that the fast paths use.

#include <cmath>
#include <limits>
#include <vector>

#include "api/backends.hpp"
#include "flashattn/dtype.hpp"
#include "reference/logits.hpp"
#include "util/dropout.hpp"
#include "util/parallel.hpp"

namespace flashattn::detail {

namespace {

// Per-thread buffers: the scores of one row, then its output before rounding.
struct RowBuffers {
  std::vector<double> scores, output;
};

// Query row `row` of (batch b, query head h): out_row[0, Dv) and *lse (when not null).
void reference_row(const AttentionParams& p, std::int64_t b, std::int64_t h, std::int64_t row,
                   RowBuffers& buffers, double* out_row, double* lse) {
  const std::int64_t D = p.head_dim, Dv = p.head_dim_v, h_kv = p.kv_head(h);
  const double scale = p.scale;
  const KeyRange keys = p.key_range(row);
  const double sink = reference_sink(p, h);
  if (keys.empty()) {
    for (std::int64_t d = 0; d < Dv; ++d) out_row[d] = 0.0;
    if (lse) *lse = sink;
    return;
  }
  // Logits of the visible keys and their maximum (the sink's among them). A NaN score is skipped
  // by the max but flows through exp() into the sum, so the whole row becomes NaN.
  std::vector<double>& scores = buffers.scores;
  const std::int64_t q_offset = p.q_strides.offset(b, row, h);
  double max_score = sink;
  for (std::int64_t j = keys.begin; j < keys.end; ++j) {
    const std::int64_t k_offset = p.k_strides.offset(b, j, h_kv);
    double dot = 0.0;
    for (std::int64_t d = 0; d < D; ++d) {
      dot += static_cast<double>(load_f32(p.q, p.dtype, q_offset + d)) *
             static_cast<double>(load_f32(p.k, p.dtype, k_offset + d));
    }
    scores[j] = reference_logit(p, b, h, row, j, dot * scale);
    if (scores[j] > max_score) max_score = scores[j];
  }
  // A row whose every key a bias or mask masks: output 0, lse its sink (−inf without sinks), as
  // a row outside the causal mask.
  if (p.keys_all_masked(b, h, row)) {
    for (std::int64_t d = 0; d < Dv; ++d) out_row[d] = 0.0;
    if (lse) *lse = sink;
    return;
  }
  // All scores -inf (only reachable with infinite inputs): subtract 0 instead of -inf.
  const double shift = std::isinf(max_score) && max_score < 0 ? 0.0 : max_score;
  double sum = std::exp(sink - shift);
  std::vector<double>& output = buffers.output;
  for (std::int64_t d = 0; d < Dv; ++d) output[d] = 0.0;
  for (std::int64_t j = keys.begin; j < keys.end; ++j) {
    if (p.key_masked(b, h, row, j)) continue;  // as if outside the range
    double weight = std::exp(scores[j] - shift);
    sum += weight;
    // Dropout scales the kept probabilities after the softmax, whose sum it leaves alone.
    if (p.dropout.on()) weight *= dropout_kept(p, b, h, row, j) ? double{p.dropout.scale} : 0.0;
    const std::int64_t v_offset = p.v_strides.offset(b, j, h_kv);
    for (std::int64_t d = 0; d < Dv; ++d) {
      output[d] += weight * static_cast<double>(load_f32(p.v, p.dtype, v_offset + d));
    }
  }
  for (std::int64_t d = 0; d < Dv; ++d) out_row[d] = output[d] / sum;
  if (lse) *lse = shift + std::log(sum);
}

}  // namespace

void reference_forward_f64(const AttentionParams& p, double* out_f64, double* lse_f64) {
  const std::int64_t Dv = p.head_dim_v;
  auto make_buffers = [&] {
    return RowBuffers{std::vector<double>(static_cast<std::size_t>(p.seqlen_kv)),
                      std::vector<double>(static_cast<std::size_t>(Dv))};
  };
  // A task: every row of one (batch, query head).
  auto run_task = [&](RowBuffers& buffers, std::int64_t task) {
    const std::int64_t b = task / p.heads_q, h = task % p.heads_q;
    for (std::int64_t row = 0; row < p.seqlen_q; ++row) {
      double* out_row = out_f64 + ((b * p.seqlen_q + row) * p.heads_q + h) * Dv;
      double* lse = lse_f64 ? lse_f64 + (b * p.heads_q + h) * p.seqlen_q + row : nullptr;
      reference_row(p, b, h, row, buffers, out_row, lse);
    }
  };
  parallel_tasks(p.num_threads, p.batch * p.heads_q, make_buffers, run_task);
}

void reference_forward(const AttentionParams& p) {
  const std::int64_t Dv = p.head_dim_v;
  std::vector<double> out(static_cast<std::size_t>(p.batch * p.seqlen_q * p.heads_q * Dv));
  std::vector<double> lse(p.lse ? static_cast<std::size_t>(p.batch * p.heads_q * p.seqlen_q) : 0);
  reference_forward_f64(p, out.data(), p.lse ? lse.data() : nullptr);

  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t row = 0; row < p.seqlen_q; ++row) {
      for (std::int64_t h = 0; h < p.heads_q; ++h) {
        const double* src = out.data() + ((b * p.seqlen_q + row) * p.heads_q + h) * Dv;
        const std::int64_t dst = p.out_strides.offset(b, row, h);
        for (std::int64_t d = 0; d < Dv; ++d) {
          store_f32(p.out, p.dtype, dst + d, static_cast<float>(src[d]));
        }
      }
    }
  }
  if (p.lse == nullptr) return;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t h = 0; h < p.heads_q; ++h) {
      for (std::int64_t row = 0; row < p.seqlen_q; ++row) {
        p.lse[p.lse_index(b, h, row)] = static_cast<float>(
            lse[static_cast<std::size_t>((b * p.heads_q + h) * p.seqlen_q + row)]);
      }
    }
  }
}

}  // namespace flashattn::detail
