// kvcache_attention_forward's two steps: append the new rows where each sequence's cache ends,
// then attend (the step that varlen_attention_forward over a paged cache takes too, a sequence
// at a time). The flash path reads the cache where it lies for decode-sized calls
// (cpu/flash_decode.cpp takes per-sequence lengths and block tables); every other call gathers
// one sequence at a time into a contiguous [1, L_b, Hkv, D] buffer in q's dtype and runs the
// dense path on it. The gather costs one pass over the sequence's K/V against at least 32 query
// rows of products per KV head, and makes a dense and a paged cache the same input.

#include "layers/kv_cache.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "api/backends.hpp"
#include "api/memory.hpp"
#include "cpu/flash_decode.hpp"
#include "util/aligned_vector.hpp"
#include "util/parallel.hpp"

namespace flashattn::detail {
namespace {

bool reads_cache_in_place(AttentionImpl impl, const AttentionParams& p) {
  return impl == AttentionImpl::flash && cpu::use_flash_decode(p);
}

// One row of head_dim elements from `src` (dtype src_dtype, element offset src_offset) to `dst`
// (dst_dtype, dst_offset): copied when the dtypes agree, else widened or rounded to nearest even.
void copy_row(void* dst, DType dst_dtype, std::int64_t dst_offset, const void* src, DType src_dtype,
              std::int64_t src_offset, std::int64_t n) {
  if (dst_dtype == src_dtype) {
    const std::size_t bytes = dtype_size(dst_dtype);
    std::memcpy(static_cast<char*>(dst) + dst_offset * static_cast<std::int64_t>(bytes),
                static_cast<const char*>(src) + src_offset * static_cast<std::int64_t>(bytes),
                static_cast<std::size_t>(n) * bytes);
    return;
  }
  for (std::int64_t d = 0; d < n; ++d) {
    store_f32(dst, dst_dtype, dst_offset + d, load_f32(src, src_dtype, src_offset + d));
  }
}

// One row as copy_row, its first rotary_dim dims rotated at `position` (kvcache.hpp,
// RotaryEmbedding): in fp64, where the products of fp32 values are exact, so the result does not
// depend on how the compiler contracts them; rounded once to dst_dtype through fp32.
void rotate_row(void* dst, DType dst_dtype, std::int64_t dst_offset, const void* src,
                DType src_dtype, std::int64_t src_offset, std::int64_t n,
                const RotaryEmbedding& rotary, std::int64_t position) {
  const std::int64_t half = rotary.rotary_dim / 2;
  const float* cos = rotary.cos + position * half;
  const float* sin = rotary.sin + position * half;
  for (std::int64_t i = 0; i < half; ++i) {
    const std::int64_t first = rotary.interleaved ? 2 * i : i;
    const std::int64_t second = rotary.interleaved ? 2 * i + 1 : i + half;
    const double x1 = load_f32(src, src_dtype, src_offset + first);
    const double x2 = load_f32(src, src_dtype, src_offset + second);
    const double c = cos[i], s = sin[i];
    store_f32(dst, dst_dtype, dst_offset + first, static_cast<float>(x1 * c - x2 * s));
    store_f32(dst, dst_dtype, dst_offset + second, static_cast<float>(x2 * c + x1 * s));
  }
  copy_row(dst, dst_dtype, dst_offset + rotary.rotary_dim, src, src_dtype,
           src_offset + rotary.rotary_dim, n - rotary.rotary_dim);
}

// The dense problem of sequence b, its K and V gathered into `keys` and `values`.
AttentionParams sequence_problem(const AttentionParams& p, std::int64_t b, void* keys,
                                 void* values) {
  AttentionParams s = p;
  const std::int64_t length = p.kv_length(b);
  const auto q_bytes = static_cast<std::int64_t>(dtype_size(p.q_dtype));
  s.q = static_cast<const char*>(p.q) + p.q_strides.batch * b * q_bytes;
  s.out = static_cast<char*>(p.out) + p.out_strides.batch * b * q_bytes;
  if (p.lse) s.lse = p.lse + b * p.heads_q * p.seqlen_q;
  s.k = keys;
  s.v = values;
  s.dtype = p.q_dtype;
  s.batch = 1;
  s.seqlen_kv = length;
  s.k_strides =
      s.v_strides = {length * p.heads_kv * p.head_dim, p.heads_kv * p.head_dim, p.head_dim};
  s.kv_lengths = nullptr;
  s.kv_batch_index = s.kv_first_row = nullptr;
  s.block_table = nullptr;
  s.block_table_stride = s.page_size = 0;
  if (s.modifiers.alibi_slopes) s.modifiers.alibi_slopes += b * p.modifiers.alibi_batch_stride;
  return s;
}

// K and V of sequence b in q's dtype; saturates at INT64_MAX.
std::int64_t gathered_bytes(const AttentionParams& p, std::int64_t b) {
  const __int128 bytes = static_cast<__int128>(2) * p.kv_length(b) * p.heads_kv * p.head_dim *
                         static_cast<__int128>(dtype_size(p.q_dtype));
  return bytes > std::numeric_limits<std::int64_t>::max() ? std::numeric_limits<std::int64_t>::max()
                                                          : static_cast<std::int64_t>(bytes);
}

void gather_sequence(const AttentionParams& p, std::int64_t b, const void* cache,
                     const Strides& strides, void* dst) {
  const std::int64_t length = p.kv_length(b), D = p.head_dim;
  parallel_tasks(
      p.num_threads, length, [] { return 0; },
      [&](int, std::int64_t j) {
        for (std::int64_t h = 0; h < p.heads_kv; ++h) {
          copy_row(dst, p.q_dtype, (j * p.heads_kv + h) * D, cache, p.dtype,
                   p.kv_offset(strides, b, j, h), D);
        }
      });
}

void run_dense(AttentionImpl impl, const AttentionParams& p) {
  switch (impl) {
    case AttentionImpl::flash:
      return flash_forward(p);
    case AttentionImpl::standard:
      return standard_forward(p);
    case AttentionImpl::reference:
      return reference_forward(p);
  }
}

}  // namespace

std::int64_t kvcache_scratch_bytes(AttentionImpl impl, const AttentionParams& p) {
  if (p.seqlen_q == 0) return 0;
  if (reads_cache_in_place(impl, p)) return scratch_bytes(impl, p);
  std::int64_t most = 0;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const std::int64_t bytes = scratch_bytes(impl, sequence_problem(p, b, nullptr, nullptr));
    const std::int64_t gathered = gathered_bytes(p, b);
    const std::int64_t total = bytes > std::numeric_limits<std::int64_t>::max() - gathered
                                   ? std::numeric_limits<std::int64_t>::max()
                                   : bytes + gathered;
    most = std::max(most, total);
  }
  return most;
}

void append_to_cache(const KVCacheParams& params) {
  const AttentionParams& p = params.attention;
  const std::int64_t D = p.head_dim;
  const bool rotating = params.rotary.cos != nullptr;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    // kv_offset counts keys from the sequence's first row (cache_leftpad), rotary from row 0.
    const std::int64_t first_key = p.kv_length(b) - params.seqlen_new;
    for (std::int64_t i = 0; i < params.seqlen_new; ++i) {
      const std::int64_t key = first_key + i, position = params.cache_seqlens[b] + i;
      for (std::int64_t h = 0; h < p.heads_kv; ++h) {
        const std::int64_t k_offset = p.kv_offset(p.k_strides, b, key, h);
        const std::int64_t k_new_offset = params.k_new_strides.offset(b, i, h);
        if (rotating) {
          rotate_row(params.k_cache, p.dtype, k_offset, params.k_new, params.new_dtype,
                     k_new_offset, D, params.rotary, position);
        } else {
          copy_row(params.k_cache, p.dtype, k_offset, params.k_new, params.new_dtype, k_new_offset,
                   D);
        }
        copy_row(params.v_cache, p.dtype, p.kv_offset(p.v_strides, b, key, h), params.v_new,
                 params.new_dtype, params.v_new_strides.offset(b, i, h), D);
      }
    }
  }
}

std::int64_t rotated_q_bytes(const KVCacheParams& params) {
  const AttentionParams& p = params.attention;
  if (params.rotary.cos == nullptr) return 0;
  return p.batch * p.seqlen_q * p.heads_q * p.head_dim *
         static_cast<std::int64_t>(dtype_size(p.q_dtype));
}

void rotate_queries(KVCacheParams& params, void* rotated) {
  AttentionParams& p = params.attention;
  if (params.rotary.cos == nullptr) return;
  const std::int64_t D = p.head_dim;
  const Strides strides{p.seqlen_q * p.heads_q * D, p.heads_q * D, D};
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t i = 0; i < p.seqlen_q; ++i) {
      const std::int64_t position = params.cache_seqlens[b] + (params.q_positions_advance ? i : 0);
      for (std::int64_t h = 0; h < p.heads_q; ++h) {
        rotate_row(rotated, p.q_dtype, strides.offset(b, i, h), p.q, p.q_dtype,
                   p.q_strides.offset(b, i, h), D, params.rotary, position);
      }
    }
  }
  p.q = rotated;
  p.q_strides = strides;
}

void attend_to_cache(AttentionImpl impl, const AttentionParams& p) {
  if (p.seqlen_q == 0) return;
  if (reads_cache_in_place(impl, p)) return cpu::flash_decode(p);
  AlignedVector<std::uint8_t> keys, values;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const std::int64_t bytes = gathered_bytes(p, b) / 2;
    keys.resize(static_cast<std::size_t>(bytes));
    values.resize(static_cast<std::size_t>(bytes));
    gather_sequence(p, b, p.k, p.k_strides, keys.data());
    gather_sequence(p, b, p.v, p.v_strides, values.data());
    run_dense(impl, sequence_problem(p, b, keys.data(), values.data()));
  }
}

}  // namespace flashattn::detail
