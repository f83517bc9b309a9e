// The backward oracle: the gradients of the seed's attention in plain loops with fp64
// accumulation, P recomputed from q and k (the forward's out and lse are not trusted here).
// Per query row i of head h with visible keys j, logits z_ij of x_ij = scale · q_i·k_j
// (reference/logits.hpp) and the sink's logit σ_h:
//   P_ij = exp(z_ij − lse_i), lse_i = log(exp(σ_h) + Σ_j exp(z_ij))
//   dP_ij = dO_i·v_j        D_i = Σ_j P_ij dP_ij    dS_ij = P_ij (dP_ij − D_i) · dz_ij/dx_ij
//   dq_i = scale Σ_j dS_ij k_j      dk_j += scale dS_ij q_i      dv_j += P_ij dO_i
//   dσ_h −= exp(σ_h − lse_i) · D_i      dbias_ij = P_ij (dP_ij − D_i)
// (dk, dv summed over the GQA group; dz/dx = 1 − tanh² under a softcap, else 1). Keys that a
// bias or mask masks are skipped like those outside the causal range. With dropout, M_ij the
// forward's multiplier (1 / (1 − p) where kept, 0 where dropped): dP_ij = M_ij dO_i·v_j and
// dv_j += P_ij M_ij dO_i; D_i = Σ_j P_ij dP_ij is still rowsum(dO_i ∘ O_i).

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

// Per-thread buffers: P, dP and dz/dx of one row.
struct RowBuffers {
  std::vector<double> probabilities, dprobabilities, derivatives;
};

// Element (j, d) of one (batch, KV head) group's dK lies at [k_base + j · k_row + d], of its dV
// at [v_base + j · v_row + d]. Indices, not pointers: with Skv = 0 the arrays may be null, and
// null plus an offset is undefined behaviour (the backward fuzzer's UBSan found it).
struct GroupGradients {
  double* dk;
  double* dv;
  std::int64_t k_base, k_row, v_base, v_row;
};

// Query row `row` of (batch b, query head h): writes dq[0, D) and, when not null, the logits'
// gradient dlogits[0, seqlen_kv), adds its terms to the group's dK and dV rows, and returns its
// term of dσ_h.
double reference_backward_row(const BackwardParams& bp, std::int64_t b, std::int64_t h,
                              std::int64_t row, RowBuffers& buffers, double* dq, double* dlogits,
                              const GroupGradients& group) {
  const AttentionParams& p = bp.forward;
  const std::int64_t D = p.head_dim, Dv = p.head_dim_v, h_kv = p.kv_head(h);
  const double scale = p.scale;
  auto read = [&](const void* base, const Strides& strides, std::int64_t s, std::int64_t head,
                  std::int64_t d) {
    return static_cast<double>(load_f32(base, p.dtype, strides.offset(b, s, head) + d));
  };
  for (std::int64_t d = 0; d < D; ++d) dq[d] = 0.0;
  if (dlogits != nullptr) {
    for (std::int64_t j = 0; j < p.seqlen_kv; ++j) dlogits[j] = 0.0;
  }
  const KeyRange keys = p.key_range(row);
  if (keys.empty()) return 0.0;

  std::vector<double>& probabilities = buffers.probabilities;
  std::vector<double>& dprobabilities = buffers.dprobabilities;
  std::vector<double>& derivatives = buffers.derivatives;
  const double sink = reference_sink(p, h);
  double max_score = sink;
  for (std::int64_t j = keys.begin; j < keys.end; ++j) {
    double dot = 0.0;
    for (std::int64_t d = 0; d < D; ++d) {
      dot += read(p.q, p.q_strides, row, h, d) * read(p.k, p.k_strides, j, h_kv, d);
    }
    probabilities[j] = reference_logit(p, b, h, row, j, dot * scale, &derivatives[j]);
    if (probabilities[j] > max_score) max_score = probabilities[j];
  }
  const double shift = std::isinf(max_score) && max_score < 0 ? 0.0 : max_score;
  double sum = std::exp(sink - shift);
  for (std::int64_t j = keys.begin; j < keys.end; ++j) {
    probabilities[j] = std::exp(probabilities[j] - shift);
    sum += probabilities[j];
  }
  // A row whose every key a bias or mask masks adds nothing to any gradient, dsinks included.
  if (p.keys_all_masked(b, h, row)) return 0.0;
  auto dropped = [&](std::int64_t j) { return p.key_masked(b, h, row, j); };
  auto multiplier = [&](std::int64_t j) {
    if (!p.dropout.on()) return 1.0;
    return dropout_kept(p, b, h, row, j) ? double{p.dropout.scale} : 0.0;
  };
  double row_delta = 0.0;  // D_i
  for (std::int64_t j = keys.begin; j < keys.end; ++j) {
    if (dropped(j)) continue;
    probabilities[j] /= sum;
    double dot = 0.0;
    for (std::int64_t d = 0; d < Dv; ++d) {
      dot += read(bp.dout, bp.dout_strides, row, h, d) * read(p.v, p.v_strides, j, h_kv, d);
    }
    dprobabilities[j] = dot * multiplier(j);
    row_delta += probabilities[j] * dprobabilities[j];
  }
  for (std::int64_t j = keys.begin; j < keys.end; ++j) {
    if (dropped(j)) continue;
    const double dlogit = probabilities[j] * (dprobabilities[j] - row_delta);
    if (dlogits != nullptr) dlogits[j] = dlogit;
    const double dscore = dlogit * derivatives[j];
    const std::int64_t k_row = group.k_base + j * group.k_row;
    const std::int64_t v_row = group.v_base + j * group.v_row;
    const double kept_probability = probabilities[j] * multiplier(j);
    for (std::int64_t d = 0; d < D; ++d) {
      dq[d] += scale * dscore * read(p.k, p.k_strides, j, h_kv, d);
      group.dk[k_row + d] += scale * dscore * read(p.q, p.q_strides, row, h, d);
    }
    for (std::int64_t d = 0; d < Dv; ++d) {
      group.dv[v_row + d] += kept_probability * read(bp.dout, bp.dout_strides, row, h, d);
    }
  }
  return -std::exp(sink - shift) / sum * row_delta;
}

}  // namespace

void reference_backward_f64(const BackwardParams& bp, double* dq_f64, double* dk_f64,
                            double* dv_f64, double* dsinks_f64, double* dlogits_f64) {
  const AttentionParams& p = bp.forward;
  const std::int64_t D = p.head_dim, Dv = p.head_dim_v, Skv = p.seqlen_kv;
  auto make_buffers = [&] {
    return RowBuffers{std::vector<double>(static_cast<std::size_t>(Skv)),
                      std::vector<double>(static_cast<std::size_t>(Skv)),
                      std::vector<double>(static_cast<std::size_t>(Skv))};
  };
  // Each row's term of dσ, [batch, heads_q, seqlen_q], summed in a fixed order at the end.
  std::vector<double> sink_terms(
      dsinks_f64 ? static_cast<std::size_t>(p.batch * p.heads_q * p.seqlen_q) : 0);
  // A task: one (batch, KV head) group, which owns its dK and dV rows.
  auto run_task = [&](RowBuffers& buffers, std::int64_t task) {
    const std::int64_t b = task / p.heads_kv, h_kv = task % p.heads_kv;
    const GroupGradients group{dk_f64,
                               dv_f64,
                               (b * Skv * p.heads_kv + h_kv) * D,
                               p.heads_kv * D,
                               (b * Skv * p.heads_kv + h_kv) * Dv,
                               p.heads_kv * Dv};
    for (std::int64_t j = 0; j < Skv; ++j) {
      for (std::int64_t d = 0; d < D; ++d) group.dk[group.k_base + j * group.k_row + d] = 0.0;
      for (std::int64_t d = 0; d < Dv; ++d) group.dv[group.v_base + j * group.v_row + d] = 0.0;
    }
    for (std::int64_t h = h_kv * p.group_size(); h < (h_kv + 1) * p.group_size(); ++h) {
      for (std::int64_t row = 0; row < p.seqlen_q; ++row) {
        double* dq = dq_f64 + ((b * p.seqlen_q + row) * p.heads_q + h) * D;
        double* dlogits =
            dlogits_f64 ? dlogits_f64 + ((b * p.heads_q + h) * p.seqlen_q + row) * Skv : nullptr;
        const double sink_term = reference_backward_row(bp, b, h, row, buffers, dq, dlogits, group);
        if (dsinks_f64) sink_terms[(b * p.heads_q + h) * p.seqlen_q + row] = sink_term;
      }
    }
  };
  parallel_tasks(p.num_threads, p.batch * p.heads_kv, make_buffers, run_task);
  if (dsinks_f64 == nullptr) return;
  for (std::int64_t h = 0; h < p.heads_q; ++h) {
    dsinks_f64[h] = 0.0;
    for (std::int64_t b = 0; b < p.batch; ++b) {
      for (std::int64_t row = 0; row < p.seqlen_q; ++row) {
        dsinks_f64[h] += sink_terms[(b * p.heads_q + h) * p.seqlen_q + row];
      }
    }
  }
}

void reference_backward(const BackwardParams& bp) {
  const AttentionParams& p = bp.forward;
  const std::int64_t D = p.head_dim, Dv = p.head_dim_v;
  std::vector<double> dq(static_cast<std::size_t>(p.batch * p.seqlen_q * p.heads_q * D));
  std::vector<double> dk(static_cast<std::size_t>(p.batch * p.seqlen_kv * p.heads_kv * D));
  std::vector<double> dv(static_cast<std::size_t>(p.batch * p.seqlen_kv * p.heads_kv * Dv));
  std::vector<double> dsinks(bp.dsinks ? static_cast<std::size_t>(p.heads_q) : 0);
  std::vector<double> dlogits(
      bp.dbias.data ? static_cast<std::size_t>(p.batch * p.heads_q * p.seqlen_q * p.seqlen_kv) : 0);
  reference_backward_f64(bp, dq.data(), dk.data(), dv.data(), bp.dsinks ? dsinks.data() : nullptr,
                         bp.dbias.data ? dlogits.data() : nullptr);
  for (std::size_t h = 0; h < dsinks.size(); ++h) bp.dsinks[h] = static_cast<float>(dsinks[h]);
  if (bp.dbias.data) store_bias_gradient(bp, dlogits.data());

  auto store = [&](void* base, const Strides& strides, const std::vector<double>& values,
                   std::int64_t seqlen, std::int64_t heads, std::int64_t dims) {
    for (std::int64_t b = 0; b < p.batch; ++b)
      for (std::int64_t s = 0; s < seqlen; ++s)
        for (std::int64_t h = 0; h < heads; ++h) {
          const double* src = values.data() + ((b * seqlen + s) * heads + h) * dims;
          for (std::int64_t d = 0; d < dims; ++d) {
            store_f32(base, p.dtype, strides.offset(b, s, h) + d, static_cast<float>(src[d]));
          }
        }
  };
  store(bp.dq, bp.dq_strides, dq, p.seqlen_q, p.heads_q, D);
  store(bp.dk, bp.dk_strides, dk, p.seqlen_kv, p.heads_kv, D);
  store(bp.dv, bp.dv_strides, dv, p.seqlen_kv, p.heads_kv, Dv);
}

}  // namespace flashattn::detail
