// Public entry points: validate once, then hand the plain parameter struct to a backend.

#include "flashattn/attention.hpp"

#include <omp.h>

#include <limits>
#include <new>
#include <string>

#include "api/backends.hpp"
#include "api/memory.hpp"
#include "cpu/tile_kernels.hpp"
#include "cpu/tile_sizes.hpp"

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
  const detail::AttentionParams params = detail::make_params(caller, q, k, v, out, lse, options);
  detail::check_scratch_fits(caller, impl, params, detail::scratch_bytes(impl, params));
  try {
    backend(params);
  } catch (const std::bad_alloc&) {
    throw Error(std::string(caller) + ": out of memory: could not allocate the scratch buffers (" +
                std::to_string(detail::scratch_bytes(impl, params)) + " bytes at most)");
  }
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

std::int64_t score_buffer_bytes(AttentionImpl impl, std::int64_t seqlen_q, std::int64_t seqlen_kv,
                                std::int64_t head_dim, const AttentionOptions& options) {
  constexpr const char* caller = "score_buffer_bytes";
  for (const auto& [name, value] : {std::pair{"seqlen_q", seqlen_q}, {"seqlen_kv", seqlen_kv}}) {
    if (value < 0 || value > (std::int64_t{1} << 61)) {
      throw Error(std::string(caller) + ": " + name + ": expected 0..2^61, got " +
                  std::to_string(value));
    }
  }
  if (head_dim < 1 || head_dim > (std::int64_t{1} << 61)) {
    throw Error(std::string(caller) + ": head_dim: expected 1..2^61, got " +
                std::to_string(head_dim));
  }
  if (options.num_threads < 0) {
    throw Error(std::string(caller) + ": num_threads: expected >= 0 (0 = all), got " +
                std::to_string(options.num_threads));
  }
  const __int128 threads = options.num_threads > 0 ? options.num_threads : omp_get_max_threads();
  __int128 bytes = 0;
  switch (impl) {
    case AttentionImpl::flash: {
      const detail::cpu::TileSizes tiles = detail::cpu::flash_tiles(head_dim);
      bytes = threads * tiles.rows * tiles.keys * sizeof(float);
      break;
    }
    case AttentionImpl::standard:
      bytes = threads * seqlen_q * detail::cpu::pad_to_lanes(seqlen_kv) * sizeof(float);
      break;
    case AttentionImpl::reference:
      bytes = threads * seqlen_kv * sizeof(double);
      break;
  }
  if (bytes > std::numeric_limits<std::int64_t>::max()) {
    throw Error(std::string(caller) + ": seqlen_q " + std::to_string(seqlen_q) + " x seqlen_kv " +
                std::to_string(seqlen_kv) + " overflows a 64-bit byte count");
  }
  return static_cast<std::int64_t>(bytes);
}

}  // namespace flashattn
