// Public backward entry points: validate once, then hand the parameters to a backend.

#include "flashattn/backward.hpp"

#include "api/backends.hpp"

namespace flashattn {

void flash_attention_backward(const ConstTensorView& dout, const ConstTensorView& q,
                              const ConstTensorView& k, const ConstTensorView& v,
                              const ConstTensorView& out, const float* lse, const TensorView& dq,
                              const TensorView& dk, const TensorView& dv,
                              const AttentionOptions& options) {
  detail::flash_backward(detail::make_backward_params("flash_attention_backward", dout, q, k, v,
                                                      out, lse, dq, dk, dv, options));
}

void attention_backward_standard(const ConstTensorView& dout, const ConstTensorView& q,
                                 const ConstTensorView& k, const ConstTensorView& v,
                                 const ConstTensorView& out, const float* lse, const TensorView& dq,
                                 const TensorView& dk, const TensorView& dv,
                                 const AttentionOptions& options) {
  detail::standard_backward(detail::make_backward_params("attention_backward_standard", dout, q, k,
                                                         v, out, lse, dq, dk, dv, options));
}

void attention_backward_reference(const ConstTensorView& dout, const ConstTensorView& q,
                                  const ConstTensorView& k, const ConstTensorView& v,
                                  const ConstTensorView& out, const float* lse,
                                  const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                  const AttentionOptions& options) {
  detail::reference_backward(detail::make_backward_params("attention_backward_reference", dout, q,
                                                          k, v, out, lse, dq, dk, dv, options));
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
      return attention_backward_standard(dout, q, k, v, out, lse, dq, dk, dv, options);
    case AttentionImpl::reference:
      return attention_backward_reference(dout, q, k, v, out, lse, dq, dk, dv, options);
  }
  throw Error("attention_backward: impl: expected flash, standard or reference");
}

double attention_backward_flops(std::int64_t batch, std::int64_t heads_q, std::int64_t seqlen_q,
                                std::int64_t seqlen_kv, std::int64_t head_dim,
                                const AttentionOptions& options) {
  return 2.5 * attention_flops(batch, heads_q, seqlen_q, seqlen_kv, head_dim, options);
}

}  // namespace flashattn
