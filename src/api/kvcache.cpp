// Public entry point of attention against a KV cache: validate everything (the cache's pages and
// lengths included) and check the scratch fits, then append and attend.

#include "flashattn/kvcache.hpp"

#include <new>
#include <string>

#include "api/fail.hpp"
#include "api/memory.hpp"
#include "api/params.hpp"
#include "layers/kv_cache.hpp"

namespace flashattn {

void kvcache_attention_forward(const ConstTensorView& q, const KVCacheView& cache,
                               const std::int32_t* cache_seqlens, const NewKeysValues& new_kv,
                               const TensorView& out, float* lse, const AttentionOptions& options,
                               AttentionImpl impl) {
  constexpr const char* caller = "kvcache_attention_forward";
  detail::out_of_memory_as_error(caller, [&] {
    if (impl != AttentionImpl::flash && impl != AttentionImpl::standard &&
        impl != AttentionImpl::reference) {
      throw Error(std::string(caller) + ": impl: expected flash, standard or reference");
    }
    const detail::KVCacheParams params =
        detail::make_kvcache_params(caller, q, cache, cache_seqlens, new_kv, out, lse, options);
    const std::int64_t needed = detail::kvcache_scratch_bytes(impl, params.attention);
    detail::check_scratch_fits(caller, impl, params.attention, needed);
    detail::append_to_cache(params);
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

}  // namespace flashattn
