// The standard path, as the seed describes it and as users would otherwise write it: per
// (batch, head) the full seqlen_q x seqlen_kv score matrix A = Q·Kᵀ·scale (OpenBLAS sgemm),
// the score modifiers (softcap, ALiBi), the mask, a row softmax with max subtraction (and the
// sink in its normalizer), dropout when asked for, then O = P·V (sgemm).
//
// Memory: each thread holds one seqlen_q x seqlen_kv fp32 matrix (4 · Sq · Skv bytes, rows
// padded to 16 floats: 4 MiB at S = 1024, 1 GiB at S = 16384) plus fp32 copies of Q, K, V and O for
// one head when the inputs are f16/bf16 or the layout is not one sgemm can read.

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "api/backends.hpp"
#include "cpu/kernels/dropout.hpp"
#include "cpu/kernels/score_modifiers.hpp"
#include "cpu/kernels/tile_kernels.hpp"
#include "util/blas_lock.hpp"
#include "util/convert.hpp"
#include "util/dropout.hpp"
#include "util/omp_threads.hpp"
#include "util/parallel.hpp"
#include "util/rows.hpp"

namespace flashattn::detail {
namespace {

constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

// In place: row of logits -> row of probabilities, zeros outside the visible keys. The row is
// `width` floats (seqlen_kv padded to whole vectors); max, exp and sum run through the SIMD
// softmax kernel of the FlashAttention path, applied to the whole row as one tile. `sink` joins
// the normalizer (-inf: no sink). Row `row` of (batch b, query head h). Returns the row's
// normalizer: its logsumexp (the sink's logit, -inf without one, when no key is visible), and
// whether the row's output is exactly 0 (`empty`, its scores then all 0).
cpu::RowNormalizer softmax_row(const AttentionParams& p, std::int64_t b, std::int64_t h,
                               std::int64_t row, float* scores, std::int64_t width, float sink) {
  const KeyRange keys = p.key_range(row);
  std::fill(scores, scores + keys.begin, kNegativeInfinity);
  std::fill(scores + keys.end, scores + width, kNegativeInfinity);
  float max_score = kNegativeInfinity, sum = 0.0f;
  if (!keys.empty()) {
    cpu::online_softmax_tile(scores, width, 1.0f, &max_score, &sum, nullptr, 0, 1, width, 0);
  }
  const cpu::RowNormalizer normalizer =
      cpu::normalize_row(max_score, sum, cpu::no_key_seen(p, b, h, row, max_score), sink);
  if (normalizer.empty) std::fill(scores, scores + width, 0.0f);
  for (std::int64_t j = keys.begin; j < keys.end; ++j) scores[j] *= normalizer.inverse_sum;
  return normalizer;
}

}  // namespace

namespace {

struct HeadScratch {
  std::vector<float> scores, q_copy, k_copy, v_copy, out_copy;
  std::vector<unsigned char> empty_rows;  // whether each row's output is exactly 0
};

// One (batch, head). `row_threads` > 1 spreads the softmax rows over that many threads (used when
// there are fewer heads than threads; the sgemms then thread inside OpenBLAS).
void standard_head(const AttentionParams& p, std::int64_t b, std::int64_t h, HeadScratch& t,
                   int row_threads) {
  const std::int64_t Sq = p.seqlen_q, Skv = p.seqlen_kv, D = p.head_dim, Dv = p.head_dim_v,
                     h_kv = p.kv_head(h);
  const std::int64_t width = cpu::pad_to_lanes(Skv);  // row stride of the score matrix
  t.scores.resize(static_cast<std::size_t>(Sq * width));
  const Matrix q = gather_rows(t.q_copy, p.q, p.dtype, p.q_strides, b, h, Sq, D);
  const Matrix k = gather_rows(t.k_copy, p.k, p.dtype, p.k_strides, b, h_kv, Skv, D);
  const Matrix v = gather_rows(t.v_copy, p.v, p.dtype, p.v_strides, b, h_kv, Skv, Dv);

  // A = scale · Q·Kᵀ                                           [Sq x Skv]
  if (Skv > 0) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, Sq, Skv, D, p.scale, q.data, q.stride,
                k.data, k.stride, 0.0f, t.scores.data(), width);
  }
  // P = softmax(modifiers(A) + M), row by row                  [Sq x Skv]
  const float sink = cpu::sink_logit(p, h);
  t.empty_rows.assign(static_cast<std::size_t>(Sq), 0);
#pragma omp parallel for num_threads(row_threads) if (row_threads > 1)
  for (std::int64_t row = 0; row < Sq; ++row) {
    float* scores = t.scores.data() + row * width;
    if (p.modifiers.change_logits()) {
      cpu::modify_scores(scores, nullptr, Skv, 1.0f, cpu::row_modifiers(p, b, h, row, 0, Skv));
    }
    const cpu::RowNormalizer normalizer = softmax_row(p, b, h, row, scores, width, sink);
    t.empty_rows[static_cast<std::size_t>(row)] = normalizer.empty;
    if (p.lse) p.lse[p.lse_index(b, h, row)] = normalizer.lse;
    if (p.dropout.on()) {
      cpu::apply_dropout(scores, 0, Skv,
                         {&p.dropout, dropout_stream(p, b, h), static_cast<std::uint32_t>(row)});
    }
  }
  // O = P·V                                                    [Sq x Dv]
  float* out = nullptr;
  std::int64_t out_stride = Dv;
  const bool write_in_place = p.dtype == DType::f32 && (Sq <= 1 || p.out_strides.seq >= Dv);
  if (write_in_place) {
    out = static_cast<float*>(p.out) + p.out_strides.offset(b, 0, h);
    out_stride = Sq <= 1 ? Dv : p.out_strides.seq;
  } else {
    t.out_copy.resize(static_cast<std::size_t>(Sq * Dv));
    out = t.out_copy.data();
  }
  if (Skv > 0 && all_finite(v, Skv, Dv)) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, Sq, Dv, Skv, 1.0f, t.scores.data(),
                width, v.data, v.stride, 0.0f, out, out_stride);
  } else if (Skv > 0) {
    // A masked key has p = 0, but 0 · inf = NaN: with a non-finite value row, each row takes
    // only its visible keys (each run of them that the mask keeps).
    for (std::int64_t row = 0; row < Sq; ++row) {
      const KeyRange keys = p.key_range(row);
      std::fill_n(out + row * out_stride, Dv, 0.0f);
      if (t.empty_rows[static_cast<std::size_t>(row)]) continue;
      // One row of P times the visible rows of V, [1 x n]·[n x Dv], through sgemm (the only BLAS
      // routine the sanitizer builds' plain-loop stand-in provides).
      cpu::for_each_kept_run(
          p, b, h, row, keys.begin, keys.end, [&](std::int64_t first, std::int64_t last) {
            const std::int64_t n = last - first;
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, 1, Dv, n, 1.0f,
                        t.scores.data() + row * width + first, n, v.data + first * v.stride,
                        v.stride, 1.0f, out + row * out_stride, Dv);
          });
    }
  } else {
    for (std::int64_t row = 0; row < Sq; ++row) {
      std::fill_n(out + row * out_stride, Dv, 0.0f);
    }
  }
  if (!write_in_place) {
    for (std::int64_t row = 0; row < Sq; ++row) {
      store_row_f32(p.out, p.dtype, p.out_strides.offset(b, row, h), out + row * Dv, Dv);
    }
  }
}

}  // namespace

void standard_forward(const AttentionParams& p) {
  const std::int64_t tasks = p.batch * p.heads_q;
  const std::lock_guard blas_lock(blas_mutex());
  const ScopedOmpThreads blas_threads(p.num_threads);
  if (tasks >= p.num_threads) {
    // One head per thread at a time; OpenBLAS (OpenMP build) runs each sgemm on the calling
    // thread inside this region.
    parallel_tasks(
        p.num_threads, tasks, [] { return HeadScratch(); },
        [&](HeadScratch& scratch, std::int64_t task) {
          standard_head(p, task / p.heads_q, task % p.heads_q, scratch, 1);
        });
    return;
  }
  // Fewer heads than threads: heads in turn, each sgemm threaded by OpenBLAS.
  HeadScratch scratch;
  for (std::int64_t task = 0; task < tasks; ++task) {
    standard_head(p, task / p.heads_q, task % p.heads_q, scratch, p.num_threads);
  }
}

}  // namespace flashattn::detail
