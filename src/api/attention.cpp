// Public entry points: validate once, then hand the plain parameter struct to a backend.

#include "flashattn/attention.hpp"

#include <new>
#include <optional>
#include <string>

#include "api/backends.hpp"
#include "api/block_attention.hpp"
#include "api/fail.hpp"
#include "api/memory.hpp"
#include "util/dropout.hpp"

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

void dropout_mask(const AttentionOptions& options, std::int64_t batch_index, std::int64_t heads_q,
                  std::int64_t seqlen_q, std::int64_t seqlen_kv, std::uint8_t* keep) {
  constexpr const char* caller = "dropout_mask";
  constexpr std::int64_t kLimit = std::int64_t{1} << 32;
  if (!(options.dropout_p >= 0.0f && options.dropout_p < 1.0f)) {
    detail::fail(caller, "dropout_p: expected a value in [0, 1) (0 = off), got ",
                 options.dropout_p);
  }
  if (heads_q < 1) detail::fail(caller, "heads_q: expected >= 1, got ", heads_q);
  if (batch_index < 0 || (batch_index + 1) * heads_q > kLimit) {
    detail::fail(caller, "batch_index: expected 0 <= batch_index and (batch_index + 1) x heads_q ",
                 "<= 2^32, got ", batch_index, " with heads_q ", heads_q);
  }
  if (seqlen_q < 0 || seqlen_q > kLimit) {
    detail::fail(caller, "seqlen_q: expected 0..2^32, got ", seqlen_q);
  }
  if (seqlen_kv < 0 || seqlen_kv > kLimit) {
    detail::fail(caller, "seqlen_kv: expected 0..2^32, got ", seqlen_kv);
  }
  if (keep == nullptr && seqlen_q > 0 && seqlen_kv > 0) {
    detail::fail(caller, "keep: expected heads_q x seqlen_q x seqlen_kv bytes, got null");
  }
  detail::AttentionParams params;
  params.heads_q = heads_q;
  params.dropout = detail::make_dropout(options);
  params.dropout.first_batch = batch_index;
  for (std::int64_t h = 0; h < heads_q; ++h) {
    for (std::int64_t i = 0; i < seqlen_q; ++i) {
      for (std::int64_t j = 0; j < seqlen_kv; ++j) {
        keep[(h * seqlen_q + i) * seqlen_kv + j] =
            !params.dropout.on() || detail::dropout_kept(params, 0, h, i, j);
      }
    }
  }
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
