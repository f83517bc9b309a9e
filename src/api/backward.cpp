// Public backward entry points: validate once, then hand the parameters to a backend.

#include "flashattn/backward.hpp"

#include <new>
#include <string>

#include "api/backends.hpp"
#include "api/memory.hpp"

namespace flashattn {

namespace {

// Validates, refuses a problem whose scratch memory cannot fit, then runs the backend; a failed
// scratch allocation surfaces as Error (the gradients may then be partly written).
void run_backward(const char* caller, AttentionImpl impl,
                  void (*backend)(const detail::BackwardParams&), const ConstTensorView& dout,
                  const ConstTensorView& q, const ConstTensorView& k, const ConstTensorView& v,
                  const ConstTensorView& out, const float* lse, const TensorView& dq,
                  const TensorView& dk, const TensorView& dv, const AttentionOptions& options) {
  const detail::BackwardParams params =
      detail::make_backward_params(caller, dout, q, k, v, out, lse, dq, dk, dv, options);
  const std::int64_t needed = detail::backward_scratch_bytes(impl, params);
  detail::check_scratch_fits(caller, impl, params.forward, needed);
  try {
    backend(params);
  } catch (const std::bad_alloc&) {
    throw Error(std::string(caller) + ": out of memory: could not allocate the scratch buffers (" +
                std::to_string(needed) + " bytes at most)");
  }
}

}  // namespace

void flash_attention_backward(const ConstTensorView& dout, const ConstTensorView& q,
                              const ConstTensorView& k, const ConstTensorView& v,
                              const ConstTensorView& out, const float* lse, const TensorView& dq,
                              const TensorView& dk, const TensorView& dv,
                              const AttentionOptions& options) {
  run_backward("flash_attention_backward", AttentionImpl::flash, detail::flash_backward, dout, q, k,
               v, out, lse, dq, dk, dv, options);
}

void standard_attention_backward(const ConstTensorView& dout, const ConstTensorView& q,
                                 const ConstTensorView& k, const ConstTensorView& v,
                                 const ConstTensorView& out, const float* lse, const TensorView& dq,
                                 const TensorView& dk, const TensorView& dv,
                                 const AttentionOptions& options) {
  run_backward("standard_attention_backward", AttentionImpl::standard, detail::standard_backward,
               dout, q, k, v, out, lse, dq, dk, dv, options);
}

void reference_attention_backward(const ConstTensorView& dout, const ConstTensorView& q,
                                  const ConstTensorView& k, const ConstTensorView& v,
                                  const ConstTensorView& out, const float* lse,
                                  const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                  const AttentionOptions& options) {
  run_backward("reference_attention_backward", AttentionImpl::reference, detail::reference_backward,
               dout, q, k, v, out, lse, dq, dk, dv, options);
}

void attention_backward(AttentionImpl impl, const ConstTensorView& dout, const ConstTensorView& q,
                        const ConstTensorView& k, const ConstTensorView& v,
                        const ConstTensorView& out, const float* lse, const TensorView& dq,
                        const TensorView& dk, const TensorView& dv,
                        const AttentionOptions& options) {
  switch (impl) {
    case AttentionImpl::flash:
      return flash_attention_backward(dout, q, k, v, out, lse, dq, dk, dv, options);
    case AttentionImpl::standard:
      return standard_attention_backward(dout, q, k, v, out, lse, dq, dk, dv, options);
    case AttentionImpl::reference:
      return reference_attention_backward(dout, q, k, v, out, lse, dq, dk, dv, options);
  }
  throw Error("attention_backward: impl: expected flash, standard or reference");
}

double attention_backward_flops(std::int64_t batch, std::int64_t heads_q, std::int64_t seqlen_q,
                                std::int64_t seqlen_kv, std::int64_t head_dim,
                                const AttentionOptions& options) {
  return 2.5 * attention_flops(batch, heads_q, seqlen_q, seqlen_kv, head_dim, options);
}

}  // namespace flashattn
