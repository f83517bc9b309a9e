// Public entry points: validate once, then hand the plain parameter struct to a backend.

#include "flashattn/attention.hpp"

#include <new>
#include <string>

#include "api/backends.hpp"
#include "api/fail.hpp"
#include "api/memory.hpp"

namespace flashattn {

const char* impl_name(AttentionImpl impl) {
  switch (impl) {
    case AttentionImpl::flash:
      return "flash";
    case AttentionImpl::standard:
      return "standard";
    case AttentionImpl::reference:
      return "reference";
  }
  return "unknown";
}

namespace {

// Validates, refuses a problem whose scratch memory cannot fit, then runs the backend. A failed
// scratch allocation (the memory is there but taken) surfaces as Error too, never as
// std::bad_alloc; the output may then be partly written.
void run_backend(const char* caller, AttentionImpl impl,
                 void (*backend)(const detail::AttentionParams&), const ConstTensorView& q,
                 const ConstTensorView& k, const ConstTensorView& v, const TensorView& out,
                 float* lse, const AttentionOptions& options) {
  detail::out_of_memory_as_error(caller, [&] {
    const detail::AttentionParams params = detail::make_params(caller, q, k, v, out, lse, options);
    detail::check_scratch_fits(caller, impl, params, detail::scratch_bytes(impl, params));
    try {
      backend(params);
    } catch (const std::bad_alloc&) {
      throw Error(std::string(caller) +
                  ": out of memory: could not allocate the scratch buffers (" +
                  std::to_string(detail::scratch_bytes(impl, params)) + " bytes at most)");
    }
  });
}

}  // namespace

void flash_attention_forward(const ConstTensorView& q, const ConstTensorView& k,
                             const ConstTensorView& v, const TensorView& out, float* lse,
                             const AttentionOptions& options) {
  run_backend("flash_attention_forward", AttentionImpl::flash, detail::flash_forward, q, k, v, out,
              lse, options);
}

void standard_attention_forward(const ConstTensorView& q, const ConstTensorView& k,
                                const ConstTensorView& v, const TensorView& out, float* lse,
                                const AttentionOptions& options) {
  run_backend("standard_attention_forward", AttentionImpl::standard, detail::standard_forward, q, k,
              v, out, lse, options);
}

void reference_attention_forward(const ConstTensorView& q, const ConstTensorView& k,
                                 const ConstTensorView& v, const TensorView& out, float* lse,
                                 const AttentionOptions& options) {
  run_backend("reference_attention_forward", AttentionImpl::reference, detail::reference_forward, q,
              k, v, out, lse, options);
}

void attention_forward(AttentionImpl impl, const ConstTensorView& q, const ConstTensorView& k,
                       const ConstTensorView& v, const TensorView& out, float* lse,
                       const AttentionOptions& options) {
  switch (impl) {
    case AttentionImpl::flash:
      return flash_attention_forward(q, k, v, out, lse, options);
    case AttentionImpl::standard:
      return standard_attention_forward(q, k, v, out, lse, options);
    case AttentionImpl::reference:
      return reference_attention_forward(q, k, v, out, lse, options);
  }
  throw Error("attention_forward: impl: expected flash, standard or reference");
}

}  // namespace flashattn
