// Public backward entry points: validate once, then hand the parameters to a backend.

#include "flashattn/backward.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "api/backends.hpp"
#include "api/block_attention.hpp"
#include "api/fail.hpp"
#include "api/memory.hpp"
#include "cpu/kernels/score_modifiers.hpp"
#include "util/convert.hpp"
#include "util/parallel.hpp"
#include "util/rows.hpp"

namespace flashattn {

namespace detail {

void add_sink_gradients(const BackwardParams& bp, double* sums) {
  const AttentionParams& p = bp.forward;
  std::vector<double> head_sums(static_cast<std::size_t>(p.heads_q), 0.0);
  parallel_tasks(
      p.num_threads, p.heads_q,
      [&] { return std::vector<float>(static_cast<std::size_t>(p.seqlen_q)); },
      [&](std::vector<float>& deltas, std::int64_t h) {
        const double sink = p.modifiers.sinks[h];
        double sum = 0.0;
        for (std::int64_t b = 0; b < p.batch; ++b) {
          row_deltas(deltas.data(), bp.dout, bp.dout_strides, p.out, p.out_strides, p.q_dtype, b, h,
                     0, p.seqlen_q, p.head_dim_v);
          for (std::int64_t row = 0; row < p.seqlen_q; ++row) {
            // A row that sees no key (or whose keys a bias or mask masked) has output 0 and adds
            // nothing, whatever its dO holds.
            if (p.key_range(row).empty()) continue;
            const double lse = p.lse[p.lse_index(b, h, row)];
            if (cpu::row_fully_masked(p, b, h, row, static_cast<float>(lse))) continue;
            sum -= std::exp(sink - lse) * static_cast<double>(deltas[row]);
          }
        }
        head_sums[h] = sum;
      });
  for (std::int64_t h = 0; h < p.heads_q; ++h) sums[h] += head_sums[h];
}

namespace {

template <class T>
void store_bias_gradient_of(const BackwardParams& bp, const T* dlogits) {
  const AttentionParams& p = bp.forward;
  const TensorView& dbias = bp.dbias;
  const std::int64_t Sq = p.seqlen_q, Skv = p.seqlen_kv;
  const std::int64_t bias_batch = dbias.shape[0], bias_heads = dbias.shape[1];
  // dbias[bb, hb, i, j] sums the (b, h) that read it: every b when the bias has batch 1 (bb = 0),
  // else b = bb; likewise for the heads. Row by row, each (b, h)'s row added whole in turn: the
  // rows lie Sq·Skv floats apart, too far to gather element by element.
  parallel_tasks(
      p.num_threads, bias_batch * bias_heads * Sq,
      [&] { return std::vector<double>(static_cast<std::size_t>(Skv)); },
      [&](std::vector<double>& sums, std::int64_t task) {
        const std::int64_t bb = task / (bias_heads * Sq), hb = task / Sq % bias_heads,
                           i = task % Sq;
        const std::int64_t b_begin = bias_batch == 1 ? 0 : bb,
                           b_end = bias_batch == 1 ? p.batch : bb + 1;
        const std::int64_t h_begin = bias_heads == 1 ? 0 : hb,
                           h_end = bias_heads == 1 ? p.heads_q : hb + 1;
        std::fill(sums.begin(), sums.end(), 0.0);
        for (std::int64_t b = b_begin; b < b_end; ++b) {
          for (std::int64_t h = h_begin; h < h_end; ++h) {
            const T* row = dlogits + ((b * p.heads_q + h) * Sq + i) * Skv;
            for (std::int64_t j = 0; j < Skv; ++j) sums[j] += static_cast<double>(row[j]);
          }
        }
        store_bias_gradient_row(dbias, bb, hb, i, sums.data());
      });
}

}  // namespace

void store_bias_gradient_row(const TensorView& dbias, std::int64_t bb, std::int64_t hb,
                             std::int64_t i, const double* sums) {
  for (std::int64_t j = 0; j < dbias.shape[3]; ++j) {
    const std::int64_t offset =
        bb * dbias.strides[0] + hb * dbias.strides[1] + i * dbias.strides[2] + j * dbias.strides[3];
    store_f32(dbias.data, dbias.dtype, offset, static_cast<float>(sums[j]));
  }
}

void store_bias_gradient(const BackwardParams& bp, const float* dlogits) {
  store_bias_gradient_of(bp, dlogits);
}
void store_bias_gradient(const BackwardParams& bp, const double* dlogits) {
  store_bias_gradient_of(bp, dlogits);
}

}  // namespace detail

namespace {

// Validates, refuses a problem whose scratch memory cannot fit, then runs the backend; a failed
// scratch allocation surfaces as Error (the gradients may then be partly written).
// `block_offset`: the call is a block of a longer sequence (block_attention.hpp).
void run_backward(const char* caller, AttentionImpl impl,
                  void (*backend)(const detail::BackwardParams&), const ConstTensorView& dout,
                  const ConstTensorView& q, const ConstTensorView& k, const ConstTensorView& v,
                  const ConstTensorView& out, const float* lse, const TensorView& dq,
                  const TensorView& dk, const TensorView& dv, const AttentionOptions& options,
                  const ModifierGradients& modifier_gradients,
                  std::optional<std::int64_t> block_offset = std::nullopt) {
  detail::out_of_memory_as_error(caller, [&] {
    detail::BackwardParams params = detail::make_backward_params(
        caller, dout, q, k, v, out, lse, dq, dk, dv, options, modifier_gradients);
    if (block_offset) detail::place_block(caller, params.forward, options, *block_offset);
    const detail::AttentionParams& f = params.forward;
    // dbias on the standard path: the logits' gradient of every (batch, head, row, key), summed
    // after the backend (the reference keeps its own in fp64). The flash backward sums dbias as
    // it goes (cpu/flash_backward.cpp) and needs no such scratch.
    const bool dlogits_scratch = params.dbias.data != nullptr && impl == AttentionImpl::standard;
    std::int64_t dlogits_count = 0;
    if (params.dbias.data != nullptr && impl != AttentionImpl::flash &&
        (__builtin_mul_overflow(f.batch * f.heads_q, f.seqlen_q, &dlogits_count) ||
         __builtin_mul_overflow(dlogits_count, f.seqlen_kv, &dlogits_count) ||
         dlogits_count > std::numeric_limits<std::int64_t>::max() / 8)) {
      throw Error(std::string(caller) +
                  ": dbias: the [batch, heads_q, seqlen_q, seqlen_kv] scratch " +
                  "it needs overflows a 64-bit byte count");
    }
    const std::int64_t backend_bytes = detail::backward_scratch_bytes(impl, params);
    const std::int64_t dlogits_bytes = dlogits_count * (dlogits_scratch ? 4 : 8);
    const std::int64_t needed =
        backend_bytes > std::numeric_limits<std::int64_t>::max() - dlogits_bytes
            ? std::numeric_limits<std::int64_t>::max()
            : backend_bytes + dlogits_bytes;
    detail::check_scratch_fits(caller, impl, f, needed);
    try {
      // The backends write every (row, key) of every block, zeros for the blocks a bias or mask
      // masks entirely, except the rows the causal mask or a window keeps from a block: then the
      // whole scratch is zeroed first (in parallel: 4·B·Hq·Sq·Skv bytes).
      std::unique_ptr<float[]> dlogits(
          dlogits_scratch ? new float[static_cast<std::size_t>(dlogits_count)] : nullptr);
      const bool skips_blocks = f.causal || f.window_left >= 0 || f.window_right >= 0;
      if (dlogits_scratch && skips_blocks) {
        constexpr std::int64_t kChunk = std::int64_t{1} << 20;
        detail::parallel_tasks(
            f.num_threads, (dlogits_count + kChunk - 1) / kChunk, [] { return 0; },
            [&](int&, std::int64_t chunk) {
              const std::int64_t begin = chunk * kChunk;
              std::fill_n(dlogits.get() + begin, std::min(kChunk, dlogits_count - begin), 0.0f);
            });
      }
      params.dlogits = dlogits.get();
      backend(params);
      if (dlogits_scratch) detail::store_bias_gradient(params, dlogits.get());
      // The reference derives its own from the P it recomputes.
      if (params.dsinks != nullptr && impl != AttentionImpl::reference) {
        std::vector<double> sums(static_cast<std::size_t>(params.forward.heads_q), 0.0);
        detail::add_sink_gradients(params, sums.data());
        for (std::size_t h = 0; h < sums.size(); ++h) {
          params.dsinks[h] = static_cast<float>(sums[h]);
        }
      }
    } catch (const std::bad_alloc&) {
      throw Error(std::string(caller) +
                  ": out of memory: could not allocate the scratch buffers (" +
                  std::to_string(needed) + " bytes at most)");
    }
  });
}

}  // namespace

void flash_attention_backward(const ConstTensorView& dout, const ConstTensorView& q,
                              const ConstTensorView& k, const ConstTensorView& v,
                              const ConstTensorView& out, const float* lse, const TensorView& dq,
                              const TensorView& dk, const TensorView& dv,
                              const AttentionOptions& options,
                              const ModifierGradients& modifier_gradients) {
  run_backward("flash_attention_backward", AttentionImpl::flash, detail::flash_backward, dout, q, k,
               v, out, lse, dq, dk, dv, options, modifier_gradients);
}

void standard_attention_backward(const ConstTensorView& dout, const ConstTensorView& q,
                                 const ConstTensorView& k, const ConstTensorView& v,
                                 const ConstTensorView& out, const float* lse, const TensorView& dq,
                                 const TensorView& dk, const TensorView& dv,
                                 const AttentionOptions& options,
                                 const ModifierGradients& modifier_gradients) {
  run_backward("standard_attention_backward", AttentionImpl::standard, detail::standard_backward,
               dout, q, k, v, out, lse, dq, dk, dv, options, modifier_gradients);
}

void reference_attention_backward(const ConstTensorView& dout, const ConstTensorView& q,
                                  const ConstTensorView& k, const ConstTensorView& v,
                                  const ConstTensorView& out, const float* lse,
                                  const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                  const AttentionOptions& options,
                                  const ModifierGradients& modifier_gradients) {
  run_backward("reference_attention_backward", AttentionImpl::reference, detail::reference_backward,
               dout, q, k, v, out, lse, dq, dk, dv, options, modifier_gradients);
}

namespace detail {

void block_attention_backward(AttentionImpl impl, const ConstTensorView& dout,
                              const ConstTensorView& q, const ConstTensorView& k,
                              const ConstTensorView& v, const ConstTensorView& out,
                              const float* lse, const TensorView& dq, const TensorView& dk,
                              const TensorView& dv, const AttentionOptions& options,
                              std::int64_t query_minus_key_offset) {
  if (impl == AttentionImpl::reference) {
    throw Error(
        "block_attention_backward: impl: expected flash or standard, got reference (it recomputes "
        "the block's own softmax instead of reading the whole sequence's lse)");
  }
  const auto backend = impl == AttentionImpl::flash ? flash_backward : standard_backward;
  run_backward("block_attention_backward", impl, backend, dout, q, k, v, out, lse, dq, dk, dv,
               options, {}, query_minus_key_offset);
}

}  // namespace detail

void attention_backward(AttentionImpl impl, const ConstTensorView& dout, const ConstTensorView& q,
                        const ConstTensorView& k, const ConstTensorView& v,
                        const ConstTensorView& out, const float* lse, const TensorView& dq,
                        const TensorView& dk, const TensorView& dv, const AttentionOptions& options,
                        const ModifierGradients& modifier_gradients) {
  switch (impl) {
    case AttentionImpl::flash:
      return flash_attention_backward(dout, q, k, v, out, lse, dq, dk, dv, options,
                                      modifier_gradients);
    case AttentionImpl::standard:
      return standard_attention_backward(dout, q, k, v, out, lse, dq, dk, dv, options,
                                         modifier_gradients);
    case AttentionImpl::reference:
      return reference_attention_backward(dout, q, k, v, out, lse, dq, dk, dv, options,
                                          modifier_gradients);
  }
  throw Error("attention_backward: impl: expected flash, standard or reference");
}

double attention_backward_flops(std::int64_t batch, std::int64_t heads_q, std::int64_t seqlen_q,
                                std::int64_t seqlen_kv, std::int64_t head_dim,
                                const AttentionOptions& options) {
  return 2.5 * attention_flops(batch, heads_q, seqlen_q, seqlen_kv, head_dim, options);
}

}  // namespace flashattn
