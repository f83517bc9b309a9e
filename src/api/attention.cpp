// Public entry points: validate once, then hand the plain parameter struct to a backend.

#include "flashattn/attention.hpp"

#include <omp.h>

#include "api/backends.hpp"
#include "cpu/tile_kernels.hpp"

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

void flash_attention_forward(const ConstTensorView& q, const ConstTensorView& k,
                             const ConstTensorView& v, const TensorView& out, float* lse,
                             const AttentionOptions& options) {
  detail::flash_forward(detail::make_params("flash_attention_forward", q, k, v, out, lse, options));
}

void attention_standard(const ConstTensorView& q, const ConstTensorView& k,
                        const ConstTensorView& v, const TensorView& out, float* lse,
                        const AttentionOptions& options) {
  detail::standard_forward(detail::make_params("attention_standard", q, k, v, out, lse, options));
}

void attention_reference(const ConstTensorView& q, const ConstTensorView& k,
                         const ConstTensorView& v, const TensorView& out, float* lse,
                         const AttentionOptions& options) {
  detail::reference_forward(detail::make_params("attention_reference", q, k, v, out, lse, options));
}

void attention_forward(AttentionImpl impl, const ConstTensorView& q, const ConstTensorView& k,
                       const ConstTensorView& v, const TensorView& out, float* lse,
                       const AttentionOptions& options) {
  switch (impl) {
    case AttentionImpl::flash:
      return flash_attention_forward(q, k, v, out, lse, options);
    case AttentionImpl::standard:
      return attention_standard(q, k, v, out, lse, options);
    case AttentionImpl::reference:
      return attention_reference(q, k, v, out, lse, options);
  }
  throw Error("attention_forward: impl: expected flash, standard or reference");
}

std::int64_t score_buffer_bytes(AttentionImpl impl, std::int64_t seqlen_q, std::int64_t seqlen_kv,
                                std::int64_t head_dim, const AttentionOptions& options) {
  const std::int64_t threads =
      options.num_threads > 0 ? options.num_threads : omp_get_max_threads();
  switch (impl) {
    case AttentionImpl::flash: {
      const detail::FlashTiles tiles = detail::flash_tiles(head_dim);
      return threads * tiles.rows * tiles.keys * static_cast<std::int64_t>(sizeof(float));
    }
    case AttentionImpl::standard:
      return threads * seqlen_q * detail::cpu::pad_to_lanes(seqlen_kv) *
             static_cast<std::int64_t>(sizeof(float));
    case AttentionImpl::reference:
      return threads * seqlen_kv * static_cast<std::int64_t>(sizeof(double));
  }
  return 0;
}

}  // namespace flashattn
