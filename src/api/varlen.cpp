// Public entry points of varlen attention: validate the packed views once (as one batch entry of
// total rows) and the sequence offsets, then run each sequence as its own problem on all threads:
// its rows are a view into the packed tensors, its lse a slice of [heads_q, total_q] whose head
// stride is total_q. With K and V in pages (PagedKVView) a sequence's keys are found through its
// row of the block table, and it runs as a KV cache's batch entry does (layers/kv_cache.cpp).

#include "flashattn/varlen.hpp"

#include <algorithm>
#include <new>
#include <string>
#include <type_traits>
#include <vector>

#include "api/backends.hpp"
#include "api/fail.hpp"
#include "api/memory.hpp"
#include "api/params.hpp"
#include "layers/kv_cache.hpp"

namespace flashattn {
namespace {

using detail::AttentionParams;
using detail::BackwardParams;
using detail::fail;

void check_packed(const char* caller, const char* name, const ConstTensorView& view) {
  if (view.shape[0] != 1) {
    fail(caller, name,
         ": expected a packed [1, total, heads, head_dim] view, got dim 0 = ", view.shape[0]);
  }
}

// cu_seqlens: batch + 1 offsets from 0, never decreasing, ending at `total` (anywhere when
// kAnyTotal).
constexpr std::int64_t kAnyTotal = -1;
void check_offsets(const char* caller, const char* name, const std::int32_t* offsets,
                   std::int64_t batch, std::int64_t total) {
  if (offsets == nullptr) fail(caller, name, ": expected ", batch + 1, " int32 offsets, got null");
  if (offsets[0] != 0) fail(caller, name, "[0]: expected 0, got ", offsets[0]);
  for (std::int64_t b = 1; b <= batch; ++b) {
    if (offsets[b] < offsets[b - 1]) {
      fail(caller, name, "[", b, "]: expected >= ", name, "[", b - 1, "] = ", offsets[b - 1],
           " (offsets never decrease), got ", offsets[b]);
    }
  }
  if (total != kAnyTotal && offsets[batch] != total) {
    fail(caller, name, "[", batch, "]: expected ", total, " (the packed rows), got ",
         offsets[batch]);
  }
}

void check_batch(const char* caller, std::int64_t batch) {
  if (batch < 0) fail(caller, "batch: expected >= 0, got ", batch);
}

template <class Pointer>
Pointer at_row(Pointer base, DType dtype, std::int64_t row, std::int64_t row_stride) {
  if (row == 0) return base;
  using Byte =
      std::conditional_t<std::is_const_v<std::remove_pointer_t<Pointer>>, const char, char>;
  return static_cast<Byte*>(base) + row * row_stride * static_cast<std::int64_t>(dtype_size(dtype));
}

// Sequence b of the packed problem `whole` as a problem of its own.
AttentionParams sequence(const AttentionParams& whole, const std::int32_t* cu_q,
                         const std::int32_t* cu_k, std::int64_t b) {
  AttentionParams s = whole;
  const std::int64_t q_begin = cu_q[b], k_begin = cu_k[b];
  s.seqlen_q = cu_q[b + 1] - q_begin;
  s.seqlen_kv = cu_k[b + 1] - k_begin;
  s.q = at_row(whole.q, whole.q_dtype, q_begin, whole.q_strides.seq);
  s.out = at_row(whole.out, whole.q_dtype, q_begin, whole.out_strides.seq);
  if (whole.block_table != nullptr) {
    s.block_table = whole.block_table + b * whole.block_table_stride;  // k, v: the pages
  } else {
    s.k = at_row(whole.k, whole.dtype, k_begin, whole.k_strides.seq);
    s.v = at_row(whole.v, whole.dtype, k_begin, whole.v_strides.seq);
  }
  if (whole.lse != nullptr && q_begin > 0) s.lse = whole.lse + q_begin;
  s.lse_head_stride = whole.seqlen_q;
  if (s.modifiers.alibi_slopes) s.modifiers.alibi_slopes += b * whole.modifiers.alibi_batch_stride;
  s.dropout.first_batch = b;
  return s;
}

void (*forward_backend(AttentionImpl impl))(const AttentionParams&) {
  switch (impl) {
    case AttentionImpl::flash:
      return detail::flash_forward;
    case AttentionImpl::standard:
      return detail::standard_forward;
    case AttentionImpl::reference:
      return detail::reference_forward;
  }
  return nullptr;
}

void (*backward_backend(AttentionImpl impl))(const BackwardParams&) {
  switch (impl) {
    case AttentionImpl::flash:
      return detail::flash_backward;
    case AttentionImpl::standard:
      return detail::standard_backward;
    case AttentionImpl::reference:
      return detail::reference_backward;
  }
  return nullptr;
}

[[noreturn]] void out_of_memory(const char* caller, std::int64_t needed) {
  fail(caller, "out of memory: could not allocate the scratch buffers (", needed,
       " bytes at most); the outputs may be partly written");
}

// The forward of every sequence of the checked call `whole`, one after the other: `run` on each
// sequence with queries, once `scratch` (the bytes `run` allocates for a sequence) fits for all.
template <class Scratch, class Run>
void forward_sequences(const char* caller, AttentionImpl impl, const AttentionParams& whole,
                       const std::int32_t* cu_q, const std::int32_t* cu_k, std::int64_t batch,
                       const Scratch& scratch, const Run& run) {
  std::int64_t needed = 0;
  for (std::int64_t b = 0; b < batch; ++b) {
    needed = std::max(needed, scratch(sequence(whole, cu_q, cu_k, b)));
  }
  detail::check_scratch_fits(caller, impl, whole, needed);
  try {
    for (std::int64_t b = 0; b < batch; ++b) {
      const AttentionParams s = sequence(whole, cu_q, cu_k, b);
      if (s.seqlen_q > 0) run(s);
    }
  } catch (const std::bad_alloc&) {
    out_of_memory(caller, needed);
  }
}

}  // namespace

void varlen_attention_forward(AttentionImpl impl, const ConstTensorView& q,
                              const ConstTensorView& k, const ConstTensorView& v,
                              const std::int32_t* cu_seqlens_q, const std::int32_t* cu_seqlens_k,
                              std::int64_t batch, const TensorView& out, float* lse,
                              const AttentionOptions& options) {
  constexpr const char* caller = "varlen_attention_forward";
  detail::out_of_memory_as_error(caller, [&] {
    const auto backend = forward_backend(impl);
    if (backend == nullptr) fail(caller, "impl: expected flash, standard or reference");
    for (const auto& [name, view] :
         {std::pair{"q", q}, {"k", k}, {"v", v}, {"out", ConstTensorView(out)}}) {
      check_packed(caller, name, view);
    }
    check_batch(caller, batch);
    const AttentionParams whole = detail::make_params(caller, q, k, v, out, lse, options, batch);
    check_offsets(caller, "cu_seqlens_q", cu_seqlens_q, batch, whole.seqlen_q);
    check_offsets(caller, "cu_seqlens_k", cu_seqlens_k, batch, whole.seqlen_kv);
    forward_sequences(
        caller, impl, whole, cu_seqlens_q, cu_seqlens_k, batch,
        [&](const AttentionParams& s) { return detail::scratch_bytes(impl, s); }, backend);
  });
}

void varlen_attention_forward(AttentionImpl impl, const ConstTensorView& q, const PagedKVView& kv,
                              const std::int32_t* cu_seqlens_q, const std::int32_t* cu_seqlens_k,
                              std::int64_t batch, const TensorView& out, float* lse,
                              const AttentionOptions& options) {
  constexpr const char* caller = "varlen_attention_forward";
  detail::out_of_memory_as_error(caller, [&] {
    if (forward_backend(impl) == nullptr) {
      fail(caller, "impl: expected flash, standard or reference");
    }
    check_packed(caller, "q", q);
    check_packed(caller, "out", out);
    check_batch(caller, batch);
    check_offsets(caller, "cu_seqlens_k", cu_seqlens_k, batch, kAnyTotal);
    const AttentionParams whole =
        detail::make_paged_varlen_params(caller, q, kv, cu_seqlens_k, batch, out, lse, options);
    check_offsets(caller, "cu_seqlens_q", cu_seqlens_q, batch, whole.seqlen_q);
    forward_sequences(
        caller, impl, whole, cu_seqlens_q, cu_seqlens_k, batch,
        [&](const AttentionParams& s) { return detail::kvcache_scratch_bytes(impl, s); },
        [&](const AttentionParams& s) { detail::attend_to_cache(impl, s); });
  });
}

void varlen_attention_backward(AttentionImpl impl, const ConstTensorView& dout,
                               const ConstTensorView& q, const ConstTensorView& k,
                               const ConstTensorView& v, const ConstTensorView& out,
                               const float* lse, const std::int32_t* cu_seqlens_q,
                               const std::int32_t* cu_seqlens_k, std::int64_t batch,
                               const TensorView& dq, const TensorView& dk, const TensorView& dv,
                               const AttentionOptions& options,
                               const ModifierGradients& modifier_gradients) {
  constexpr const char* caller = "varlen_attention_backward";
  detail::out_of_memory_as_error(caller, [&] {
    const auto backend = backward_backend(impl);
    if (backend == nullptr) fail(caller, "impl: expected flash, standard or reference");
    for (const auto& [name, view] : {std::pair{"dout", dout},
                                     {"q", q},
                                     {"k", k},
                                     {"v", v},
                                     {"out", out},
                                     {"dq", ConstTensorView(dq)},
                                     {"dk", ConstTensorView(dk)},
                                     {"dv", ConstTensorView(dv)}}) {
      check_packed(caller, name, view);
    }
    check_batch(caller, batch);
    const BackwardParams whole = detail::make_backward_params(
        caller, dout, q, k, v, out, lse, dq, dk, dv, options, modifier_gradients, batch);
    check_offsets(caller, "cu_seqlens_q", cu_seqlens_q, batch, whole.forward.seqlen_q);
    check_offsets(caller, "cu_seqlens_k", cu_seqlens_k, batch, whole.forward.seqlen_kv);
    auto sequence_backward = [&](std::int64_t b) {
      BackwardParams s = whole;
      s.forward = sequence(whole.forward, cu_seqlens_q, cu_seqlens_k, b);
      const DType dtype = whole.forward.dtype;
      s.dout = at_row(whole.dout, dtype, cu_seqlens_q[b], whole.dout_strides.seq);
      s.dq = at_row(whole.dq, dtype, cu_seqlens_q[b], whole.dq_strides.seq);
      s.dk = at_row(whole.dk, dtype, cu_seqlens_k[b], whole.dk_strides.seq);
      s.dv = at_row(whole.dv, dtype, cu_seqlens_k[b], whole.dv_strides.seq);
      s.dsinks = nullptr;  // summed over the sequences below
      return s;
    };
    std::int64_t needed = 0;
    for (std::int64_t b = 0; b < batch; ++b) {
      needed = std::max(needed, detail::backward_scratch_bytes(impl, sequence_backward(b)));
    }
    detail::check_scratch_fits(caller, impl, whole.forward, needed);
    // Every sequence runs, one without queries too: its dk and dv rows are written (0).
    try {
      std::vector<double> sink_sums(whole.dsinks ? static_cast<std::size_t>(whole.forward.heads_q)
                                                 : 0);
      for (std::int64_t b = 0; b < batch; ++b) {
        const BackwardParams s = sequence_backward(b);
        backend(s);
        if (whole.dsinks != nullptr) detail::add_sink_gradients(s, sink_sums.data());
      }
      for (std::size_t h = 0; h < sink_sums.size(); ++h) {
        whole.dsinks[h] = static_cast<float>(sink_sums[h]);
      }
    } catch (const std::bad_alloc&) {
      out_of_memory(caller, needed);
    }
  });
}

}  // namespace flashattn
