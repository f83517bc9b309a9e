// The cases `flashattn bench` runs, from its options.

#include "cases.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "flashattn/attention.hpp"
#include "verify.hpp"

namespace flashattn::cli {

std::vector<Case> make_cases(const BenchOptions& options, const std::vector<bool>& seed_masks,
                             const std::vector<bool>& sweep_masks) {
  std::vector<Case> cases;
  for (const std::string& dtype_text : options.dtypes) {
    const DType dtype = parse_dtype(dtype_text);
    if (!options.no_seed_shape) {
      for (const bool causal : seed_masks) {
        cases.push_back({dtype, 2, 32, 1024, 128, causal, true});
      }
    }
    for (const std::int64_t head_dim :
         options.no_sweep ? std::vector<std::int64_t>{} : options.head_dims) {
      for (const std::int64_t seqlen : options.seqlens) {
        for (const bool causal : sweep_masks) {
          AttentionOptions mask;
          mask.causal = causal;
          const double per_head = attention_flops(1, 1, seqlen, seqlen, head_dim, mask);
          const auto heads =
              std::max<std::int64_t>(1, std::llround(options.work_gflop * 1e9 / per_head));
          cases.push_back({dtype, 1, heads, seqlen, head_dim, causal, false});
        }
      }
    }
  }
  if (!options.no_decode) {
    for (const std::string& dtype_text : options.dtypes) {
      for (const std::int64_t seqlen : options.decode_seqlens) {
        cases.push_back({.dtype = parse_dtype(dtype_text),
                         .heads = kDecodeHeadsQ,
                         .seqlen = seqlen,
                         .head_dim = kDecodeHeadDim,
                         .decode = true,
                         .heads_kv = kDecodeHeadsKv});
      }
    }
  }
  return cases;
}

std::string case_label(const Case& shape) {
  char text[160];
  if (shape.decode) {
    std::snprintf(text, sizeof(text), "%s decode B=%lld Hq=%lld Hkv=%lld Skv=%lld D=%lld",
                  dtype_name(shape.dtype), static_cast<long long>(shape.batch),
                  static_cast<long long>(shape.heads), static_cast<long long>(shape.kv_heads()),
                  static_cast<long long>(shape.seqlen), static_cast<long long>(shape.head_dim));
    return text;
  }
  std::snprintf(text, sizeof(text), "%s %s B=%lld H=%lld S=%lld D=%lld%s", dtype_name(shape.dtype),
                shape.causal ? "causal" : "non-causal", static_cast<long long>(shape.batch),
                static_cast<long long>(shape.heads), static_cast<long long>(shape.seqlen),
                static_cast<long long>(shape.head_dim), shape.seed_shape ? " (seed shape)" : "");
  return text;
}

}  // namespace flashattn::cli
