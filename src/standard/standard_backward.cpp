// The standard backward, as a user would write it on top of BLAS: per (batch, query head) the
// full matrices
//   P  = exp(Z − lse)                   [Sq x Skv]   Z = modifiers(scale · Q·Kᵀ) (sgemm, then the
//                                                    score modifiers and the mask)
//   dV += Pᵀ·dO                          [Skv x D]    (sgemm)
//   dP = dO·Vᵀ                           [Sq x Skv]   (sgemm)
//   dS = scale · P ∘ (dP − rowsum(dO∘O)) ∘ dZ/dX  [Sq x Skv]  (dZ/dX = 1 − tanh² under a softcap)
//   dQ = dS·K,  dK += dSᵀ·Q              (sgemm)
// With dropout (M: 1/(1 − p) where the forward kept a key, else 0) dV takes P ∘ M and dP is
// multiplied by M before dS.
// A task is one (batch, KV head): the query heads of its GQA group add into its dK and dV in a
// fixed order, so the result does not depend on the thread count.
//
// Memory: per thread two Sq x Skv fp32 matrices (P and dP/dS: 2 GiB at S = 16384; four with
// dropout, M and P ∘ M), fp32 dK and dV accumulators for one KV head, and fp32 copies of operands
// sgemm cannot read in place.

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "api/backends.hpp"
#include "cpu/kernels/dropout.hpp"
#include "cpu/kernels/score_modifiers.hpp"
#include "cpu/kernels/tile_kernels.hpp"
#include "cpu/kernels/visible_gradients.hpp"
#include "util/blas_lock.hpp"
#include "util/dropout.hpp"
#include "util/omp_threads.hpp"
#include "util/parallel.hpp"
#include "util/rows.hpp"

namespace flashattn::detail {
namespace {

constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

struct BackwardScratch {
  std::vector<float> probabilities, dscores, dk, dv, dq, delta, lse;
  std::vector<float> softcap_derivative;  // d logit / dx, [Sq x width], under a softcap only
  // With dropout only, [Sq x width] each: the mask M (1/(1 − p) where kept, else 0) and P ∘ M.
  std::vector<float> dropout_multipliers, kept_probabilities;
  std::vector<float> q_copy, k_copy, v_copy, dout_copy;
};

void standard_backward_group(const BackwardParams& bp, std::int64_t b, std::int64_t h_kv,
                             BackwardScratch& t) {
  const AttentionParams& p = bp.forward;
  const std::int64_t Sq = p.seqlen_q, Skv = p.seqlen_kv, D = p.head_dim, Dv = p.head_dim_v;
  const std::int64_t width = cpu::pad_to_lanes(Skv);
  t.probabilities.assign(static_cast<std::size_t>(Sq * width), 0.0f);
  t.dscores.assign(static_cast<std::size_t>(Sq * width), 0.0f);
  t.dk.assign(static_cast<std::size_t>(Skv * D), 0.0f);
  t.dv.assign(static_cast<std::size_t>(Skv * Dv), 0.0f);
  t.dq.resize(static_cast<std::size_t>(Sq * D));
  t.delta.resize(static_cast<std::size_t>(Sq));
  t.lse.resize(static_cast<std::size_t>(Sq));
  const bool capped = p.modifiers.softcap > 0.0f;
  if (capped) t.softcap_derivative.assign(static_cast<std::size_t>(Sq * width), 0.0f);
  if (p.dropout.on()) {
    t.dropout_multipliers.assign(static_cast<std::size_t>(Sq * width), 0.0f);
    t.kept_probabilities.assign(static_cast<std::size_t>(Sq * width), 0.0f);
  }
  // What dV += Pᵀ·dO takes: P ∘ M with dropout.
  const float* value_probabilities =
      p.dropout.on() ? t.kept_probabilities.data() : t.probabilities.data();
  const Matrix k = gather_rows(t.k_copy, p.k, p.dtype, p.k_strides, b, h_kv, Skv, D);
  const Matrix v = gather_rows(t.v_copy, p.v, p.dtype, p.v_strides, b, h_kv, Skv, Dv);

  for (std::int64_t h = h_kv * p.group_size(); h < (h_kv + 1) * p.group_size(); ++h) {
    const Matrix q = gather_rows(t.q_copy, p.q, p.dtype, p.q_strides, b, h, Sq, D);
    const Matrix dout = gather_rows(t.dout_copy, bp.dout, p.dtype, bp.dout_strides, b, h, Sq, Dv);
    row_deltas(t.delta.data(), bp.dout, bp.dout_strides, p.out, p.out_strides, p.dtype, b, h, 0, Sq,
               Dv);
    backward_row_lse(t.lse.data(), p, b, h, 0, Sq);
    // With an infinity or a NaN in an operand, masked pairs (P = dS = 0) must not enter the
    // products (0·inf = NaN): the gradients then add over the visible pairs only.
    const bool visible_only = !(all_finite(q, Sq, D) && all_finite(dout, Sq, Dv) &&
                                all_finite(k, Skv, D) && all_finite(v, Skv, Dv) &&
                                cpu::all_finite(t.delta.data(), Sq) && !any_nan(t.lse.data(), Sq));

    if (Skv > 0) {
      // P = exp(scale · Q·Kᵀ − lse), masked keys 0                  [Sq x Skv]
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, Sq, Skv, D, p.scale, q.data, q.stride,
                  k.data, k.stride, 0.0f, t.probabilities.data(), width);
      for (std::int64_t row = 0; row < Sq; ++row) {
        float* s = t.probabilities.data() + row * width;
        if (p.modifiers.change_logits()) {
          cpu::modify_scores(s, capped ? t.softcap_derivative.data() + row * width : nullptr, Skv,
                             1.0f, cpu::row_modifiers(p, b, h, row, 0, Skv));
        }
        const KeyRange keys = p.key_range(row);
        std::fill(s, s + keys.begin, kNegativeInfinity);
        std::fill(s + keys.end, s + width, kNegativeInfinity);
      }
      cpu::probabilities_from_lse_tile(t.probabilities.data(), width, 1.0f, t.lse.data(), Sq,
                                       width);
      if (p.dropout.on()) {
        for (std::int64_t row = 0; row < Sq; ++row) {
          float* multipliers = t.dropout_multipliers.data() + row * width;
          cpu::dropout_multipliers(
              multipliers, 0, Skv,
              {&p.dropout, dropout_stream(p, b, h), static_cast<std::uint32_t>(row)});
          for (std::int64_t j = 0; j < Skv; ++j) {
            t.kept_probabilities[row * width + j] =
                t.probabilities[row * width + j] * multipliers[j];
          }
        }
      }
      // dV += Pᵀ·dO                                                [Skv x Dv]
      if (!visible_only) {
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, Skv, Dv, Sq, 1.0f, value_probabilities,
                    width, dout.data, dout.stride, 1.0f, t.dv.data(), Dv);
      }
      // dP = dO·Vᵀ, then dS = scale · P ∘ (dP − D_i)                 [Sq x Skv]
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, Sq, Skv, Dv, 1.0f, dout.data,
                  dout.stride, v.data, v.stride, 0.0f, t.dscores.data(), width);
      if (p.dropout.on()) {
        for (std::int64_t i = 0; i < Sq * width; ++i) t.dscores[i] *= t.dropout_multipliers[i];
      }
      cpu::softmax_gradient_tile(t.dscores.data(), width, t.probabilities.data(), width,
                                 t.delta.data(), bp.dlogits ? 1.0f : p.scale, Sq, width);
      if (bp.dlogits != nullptr) {
        // dbias: the logits' gradient P ∘ (dP − D_i) out, then dS scaled as above.
        for (std::int64_t row = 0; row < Sq; ++row) {
          float* ds = t.dscores.data() + row * width;
          cpu::store_dlogits_row(p, b, h, row, 0, Skv, ds, t.lse[row],
                                 bp.dlogits + ((b * p.heads_q + h) * Sq + row) * Skv);
          for (std::int64_t j = 0; j < width; ++j) ds[j] *= p.scale;
        }
      }
      if (capped) {
        for (std::int64_t row = 0; row < Sq; ++row) {
          float* ds = t.dscores.data() + row * width;
          const float* derivative = t.softcap_derivative.data() + row * width;
          for (std::int64_t j = 0; j < Skv; ++j) ds[j] *= derivative[j];
        }
      }
      // dQ = dS·K, dK += dSᵀ·Q                                       [Sq x D], [Skv x D]
      if (visible_only) {
        std::fill(t.dq.begin(), t.dq.end(), 0.0f);
        cpu::add_visible_gradients(p, {b,
                                       h,
                                       0,
                                       Sq,
                                       0,
                                       Skv,
                                       D,
                                       Dv,
                                       t.lse.data(),
                                       value_probabilities,
                                       t.dscores.data(),
                                       width,
                                       q.data,
                                       q.stride,
                                       dout.data,
                                       dout.stride,
                                       k.data,
                                       k.stride,
                                       t.dq.data(),
                                       D,
                                       t.dk.data(),
                                       D,
                                       t.dv.data(),
                                       Dv});
      } else {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, Sq, D, Skv, 1.0f, t.dscores.data(),
                    width, k.data, k.stride, 0.0f, t.dq.data(), D);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, Skv, D, Sq, 1.0f, t.dscores.data(),
                    width, q.data, q.stride, 1.0f, t.dk.data(), D);
      }
    } else {
      std::fill(t.dq.begin(), t.dq.end(), 0.0f);
    }
    scatter_rows(bp.dq, p.dtype, bp.dq_strides, b, h, t.dq.data(), Sq, D);
  }
  scatter_rows(bp.dk, p.dtype, bp.dk_strides, b, h_kv, t.dk.data(), Skv, D);
  scatter_rows(bp.dv, p.dtype, bp.dv_strides, b, h_kv, t.dv.data(), Skv, Dv);
}

}  // namespace

void standard_backward(const BackwardParams& bp) {
  const AttentionParams& p = bp.forward;
  const std::int64_t tasks = p.batch * p.heads_kv;
  const std::lock_guard blas_lock(blas_mutex());
  const ScopedOmpThreads blas_threads(p.num_threads);
  parallel_tasks(
      p.num_threads, tasks, [] { return BackwardScratch(); },
      [&](BackwardScratch& scratch, std::int64_t task) {
        standard_backward_group(bp, task / p.heads_kv, task % p.heads_kv, scratch);
      });
}

}  // namespace flashattn::detail
