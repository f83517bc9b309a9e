// The public introspection functions (flashattn/introspect.hpp): thin wrappers around the
// validation, scratch estimates and CPU queries the entry points use themselves.

#include "flashattn/introspect.hpp"

#include <string>

#include "api/memory.hpp"
#include "api/params.hpp"
#include "cpu/kernels/bf16_products.hpp"
#include "cpu/kernels/tile_kernels.hpp"
#include "flashattn/error.hpp"

namespace flashattn {
namespace {

// attention_forward and attention_backward refuse any other value of `impl` first.
void check_impl(const char* caller, AttentionImpl impl) {
  if (impl != AttentionImpl::flash && impl != AttentionImpl::standard &&
      impl != AttentionImpl::reference) {
    throw Error(std::string(caller) + ": impl: expected flash, standard or reference");
  }
}

}  // namespace

std::int64_t forward_scratch_bytes(AttentionImpl impl, const ConstTensorView& q,
                                   const ConstTensorView& k, const ConstTensorView& v,
                                   const TensorView& out, float* lse,
                                   const AttentionOptions& options) {
  check_impl("forward_scratch_bytes", impl);
  const detail::AttentionParams params =
      detail::make_params("forward_scratch_bytes", q, k, v, out, lse, options);
  return detail::scratch_bytes(impl, params);
}

std::int64_t backward_scratch_bytes(AttentionImpl impl, const ConstTensorView& dout,
                                    const ConstTensorView& q, const ConstTensorView& k,
                                    const ConstTensorView& v, const ConstTensorView& out,
                                    const float* lse, const TensorView& dq, const TensorView& dk,
                                    const TensorView& dv, const AttentionOptions& options) {
  check_impl("backward_scratch_bytes", impl);
  const detail::BackwardParams params = detail::make_backward_params(
      "backward_scratch_bytes", dout, q, k, v, out, lse, dq, dk, dv, options);
  return detail::backward_scratch_bytes(impl, params);
}

std::int64_t memory_limit_bytes() { return detail::memory_limit_bytes(); }

const char* simd_target() {
  static const std::string target = detail::cpu::active_simd_target();
  return target.c_str();
}

const char* bf16_products() {
  return detail::cpu::bf16_products_name(detail::cpu::active_bf16_products());
}

bool amx_supported() { return detail::cpu::amx_supported(); }

}  // namespace flashattn
