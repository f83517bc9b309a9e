// Public entry point of state merging: validate once, then merge.

#include "flashattn/merge.hpp"

#include <new>
#include <string>

#include "api/backends.hpp"
#include "api/fail.hpp"
#include "api/params.hpp"

namespace flashattn {

void merge_attention_states(const ConstTensorView& out_a, const float* lse_a,
                            const ConstTensorView& out_b, const float* lse_b, const TensorView& out,
                            float* lse, int num_threads) {
  constexpr const char* caller = "merge_attention_states";
  detail::out_of_memory_as_error(caller, [&] {
    const detail::MergeParams params =
        detail::make_merge_params(caller, out_a, lse_a, out_b, lse_b, out, lse, num_threads);
    try {
      detail::merge_states(params);
    } catch (const std::bad_alloc&) {
      throw Error(std::string(caller) +
                  ": out of memory: could not allocate one row per thread; the output may be "
                  "partly written");
    }
  });
}

}  // namespace flashattn
