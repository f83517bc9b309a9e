// Public entry points: validate once, then hand the plain parameter struct to a backend.

#include "flashattn/attention.hpp"

#include <new>
#include <optional>
#include <string>

#include "api/backends.hpp"
#include "api/block_attention.hpp"
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
// std::bad_alloc; the output may then be partly written. `block_offset`: the call is a block of
// a longer sequence (block_attention.hpp).
void run_backend(const char* caller, AttentionImpl impl,
                 void (*backend)(const detail::AttentionParams&), const ConstTensorView& q,
                 const ConstTensorView& k, const ConstTensorView& v, const TensorView& out,
                 float* lse, const AttentionOptions& options,
                 std::optional<std::int64_t> block_offset = std::nullopt) {
  detail::out_of_memory_as_error(caller, [&] {
    detail::AttentionParams params = detail::make_params(caller, q, k, v, out, lse, options);
    if (block_offset) detail::place_block(caller, params, options, *block_offset);
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

namespace detail {

void block_attention_forward(AttentionImpl impl, const ConstTensorView& q, const ConstTensorView& k,
                             const ConstTensorView& v, const TensorView& out, float* lse,
                             const AttentionOptions& options, std::int64_t query_minus_key_offset) {
  void (*const backend)(const AttentionParams&) = impl == AttentionImpl::flash ? flash_forward
                                                  : impl == AttentionImpl::standard
                                                      ? standard_forward
                                                      : reference_forward;
  run_backend("block_attention_forward", impl, backend, q, k, v, out, lse, options,
              query_minus_key_offset);
}

}  // namespace detail

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
