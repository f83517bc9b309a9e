// Public entry point of attention against a KV cache: validate everything (the cache's pages and
// lengths included) and check the scratch fits, then append and attend.

#include "flashattn/kvcache.hpp"

#include <cstdint>
#include <limits>
#include <new>
#include <string>

#include "api/fail.hpp"
#include "api/memory.hpp"
#include "api/params.hpp"
#include "layers/kv_cache.hpp"
#include "util/aligned_vector.hpp"

namespace flashattn {

void kvcache_attention_forward(const ConstTensorView& q, const KVCacheView& cache,
                               const std::int32_t* cache_seqlens, const NewKeysValues& new_kv,
                               const TensorView& out, float* lse, const AttentionOptions& options,
                               AttentionImpl impl) {
  kvcache_attention_forward(q, cache, cache_seqlens, new_kv, KVCacheOptions{}, out, lse, options,
                            impl);
}

void kvcache_attention_forward(const ConstTensorView& q, const KVCacheView& cache,
                               const std::int32_t* cache_seqlens, const NewKeysValues& new_kv,
                               const KVCacheOptions& cache_options, const TensorView& out,
                               float* lse, const AttentionOptions& options, AttentionImpl impl) {
  constexpr const char* caller = "kvcache_attention_forward";
  detail::out_of_memory_as_error(caller, [&] {
    if (impl != AttentionImpl::flash && impl != AttentionImpl::standard &&
        impl != AttentionImpl::reference) {
      throw Error(std::string(caller) + ": impl: expected flash, standard or reference");
    }
    detail::KVCacheParams params = detail::make_kvcache_params(
        caller, q, cache, cache_seqlens, new_kv, cache_options, out, lse, options);
    const std::int64_t rotated_bytes = detail::rotated_q_bytes(params);
    const std::int64_t attention_bytes = detail::kvcache_scratch_bytes(impl, params.attention);
    const std::int64_t needed =
        attention_bytes > std::numeric_limits<std::int64_t>::max() - rotated_bytes
            ? std::numeric_limits<std::int64_t>::max()
            : attention_bytes + rotated_bytes;
    detail::check_scratch_fits(caller, impl, params.attention, needed);
    // Allocated before the append, so that running out of memory here leaves the cache as it was.
    detail::AlignedVector<std::uint8_t> rotated_q(static_cast<std::size_t>(rotated_bytes));
    detail::append_to_cache(params);
    detail::rotate_queries(params, rotated_q.data());
    try {
      detail::attend_to_cache(impl, params.attention);
    } catch (const std::bad_alloc&) {
      throw Error(std::string(caller) +
                  ": out of memory: could not allocate the scratch buffers (" +
                  std::to_string(needed) + " bytes at most); the new rows are in the cache, out " +
                  "may be partly written");
    }
  });
}

void quantize_kv(const ConstTensorView& values, const TensorView& cache, const TensorView& scales,
                 int num_threads) {
  constexpr const char* caller = "quantize_kv";
  detail::out_of_memory_as_error(caller, [&] {
    detail::quantize_rows(detail::make_quantize_params(caller, values, cache, scales, num_threads));
  });
}

}  // namespace flashattn
