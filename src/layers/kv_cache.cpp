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
#include "cpu/kernels/cache_rows.hpp"
#include "util/aligned_vector.hpp"
#include "util/convert.hpp"
#include "util/huge_pages.hpp"
#include "util/parallel.hpp"

namespace flashattn::detail {
namespace {

bool reads_cache_in_place(AttentionImpl impl, const AttentionParams& p) {
  return impl == AttentionImpl::flash && cpu::use_flash_decode(p);
}

// One row of n elements from `src` (dtype src_dtype, element offset src_offset) to `dst`
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
  s.k_strides = {length * p.heads_kv * p.head_dim, p.heads_kv * p.head_dim, p.head_dim};
  s.v_strides = {length * p.heads_kv * p.head_dim_v, p.heads_kv * p.head_dim_v, p.head_dim_v};
  s.kv_lengths = nullptr;
  s.kv_batch_index = s.kv_first_row = nullptr;
  s.block_table = nullptr;
  s.block_table_stride = s.page_size = 0;
  if (s.modifiers.alibi_slopes) s.modifiers.alibi_slopes += b * p.modifiers.alibi_batch_stride;
  return s;
}

// Whether the dense path reads sequence b's rows where they lie: a dense cache of q's dtype,
// whose rows are already what a gather would copy (the same values, so the same results).
bool reads_rows_in_place(const AttentionParams& p) {
  return p.block_table == nullptr && p.dtype == p.q_dtype;
}

// The dense problem of sequence b over its rows in the cache itself (reads_rows_in_place).
AttentionParams sequence_in_place(const AttentionParams& p, std::int64_t b) {
  AttentionParams s = sequence_problem(p, b, nullptr, nullptr);
  const auto bytes = static_cast<std::int64_t>(dtype_size(p.dtype));
  s.k = static_cast<const char*>(p.k) + p.kv_offset(p.k_strides, b, 0, 0) * bytes;
  s.v = static_cast<const char*>(p.v) + p.kv_offset(p.v_strides, b, 0, 0) * bytes;
  s.k_strides = p.k_strides;
  s.v_strides = p.v_strides;
  return s;
}

// Sequence b's K (dims = head_dim) or V (head_dim_v) in q's dtype; saturates at INT64_MAX.
std::int64_t gathered_bytes(const AttentionParams& p, std::int64_t b, std::int64_t dims) {
  const __int128 bytes = static_cast<__int128>(p.kv_length(b)) * p.heads_kv * dims *
                         static_cast<__int128>(dtype_size(p.q_dtype));
  return bytes > std::numeric_limits<std::int64_t>::max() ? std::numeric_limits<std::int64_t>::max()
                                                          : static_cast<std::int64_t>(bytes);
}

// Sequence b's K or V rows of D dims into dst [L_b, Hkv, D] in q's dtype: copied, widened, or
// (a quantized cache) dequantized to fp32 and rounded to q's dtype.
void gather_sequence(const AttentionParams& p, std::int64_t b, const void* cache,
                     const Strides& strides, const ScaleView& scales, std::int64_t D, void* dst) {
  const std::int64_t length = p.kv_length(b);
  const bool quantized = is_quantized(p.dtype);
  parallel_tasks(
      p.num_threads, length, [&] { return std::vector<float>(quantized ? D : 0); },
      [&](std::vector<float>& row, std::int64_t j) {
        for (std::int64_t h = 0; h < p.heads_kv; ++h) {
          const std::int64_t to = (j * p.heads_kv + h) * D, from = p.kv_offset(strides, b, j, h);
          if (!quantized) {
            copy_row(dst, p.q_dtype, to, cache, p.dtype, from, D);
            continue;
          }
          cpu::dequantize_row(row.data(), static_cast<const std::uint8_t*>(cache) + from, p.dtype,
                              scales.data + p.kv_offset(scales.strides, b, j, h),
                              scales.group_stride, scales.group_dims, D);
          store_row_f32(dst, p.q_dtype, to, row.data(), D);
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
    if (reads_rows_in_place(p)) {
      most = std::max(most, bytes);
      continue;
    }
    // Each term is at most INT64_MAX: their sum fits in 128 bits, saturated once.
    const __int128 total = static_cast<__int128>(bytes) + gathered_bytes(p, b, p.head_dim) +
                           gathered_bytes(p, b, p.head_dim_v);
    most = std::max(most, static_cast<std::int64_t>(
                              std::min<__int128>(total, std::numeric_limits<std::int64_t>::max())));
  }
  return most;
}

// Row (b, key, h) of a quantized cache, `dims` wide, = `row` quantized (util/quantize.hpp's
// definition).
void quantize_into(const AttentionParams& p, void* cache, const Strides& strides,
                   const ScaleView& scales, std::int64_t b, std::int64_t key, std::int64_t h,
                   const float* row, std::int64_t dims) {
  cpu::quantize_row(static_cast<std::uint8_t*>(cache) + p.kv_offset(strides, b, key, h), p.dtype,
                    row, scales.data + p.kv_offset(scales.strides, b, key, h), scales.group_stride,
                    scales.group_dims, dims);
}

void append_to_cache(const KVCacheParams& params) {
  const AttentionParams& p = params.attention;
  const std::int64_t D = p.head_dim, Dv = p.head_dim_v;
  const bool rotating = params.rotary.cos != nullptr;
  const bool quantized = is_quantized(p.dtype);
  // A shared cache's values are its keys' first Dv dims: written with them.
  const bool values = !params.values_in_keys;
  std::vector<float> k_row(quantized ? D : 0), v_row(quantized ? Dv : 0);
  for (std::int64_t b = 0; b < p.batch; ++b) {
    // kv_offset counts keys from the sequence's first row (cache_leftpad), rotary from row 0.
    const std::int64_t first_key = p.kv_length(b) - params.seqlen_new;
    for (std::int64_t i = 0; i < params.seqlen_new; ++i) {
      const std::int64_t key = first_key + i, position = params.cache_seqlens[b] + i;
      for (std::int64_t h = 0; h < p.heads_kv; ++h) {
        const std::int64_t k_new_offset = params.k_new_strides.offset(b, i, h);
        const std::int64_t v_new_offset = params.v_new_strides.offset(b, i, h);
        if (quantized) {
          // The new rows in fp32 (k rotated there), then quantized once.
          if (rotating) {
            rotate_row(k_row.data(), DType::f32, 0, params.k_new, params.new_dtype, k_new_offset, D,
                       params.rotary, position);
          } else {
            load_row_f32(k_row.data(), params.k_new, params.new_dtype, k_new_offset, D);
          }
          quantize_into(p, params.k_cache, p.k_strides, p.k_scale, b, key, h, k_row.data(), D);
          if (!values) continue;
          load_row_f32(v_row.data(), params.v_new, params.new_dtype, v_new_offset, Dv);
          quantize_into(p, params.v_cache, p.v_strides, p.v_scale, b, key, h, v_row.data(), Dv);
          continue;
        }
        const std::int64_t k_offset = p.kv_offset(p.k_strides, b, key, h);
        if (rotating) {
          rotate_row(params.k_cache, p.dtype, k_offset, params.k_new, params.new_dtype,
                     k_new_offset, D, params.rotary, position);
        } else {
          copy_row(params.k_cache, p.dtype, k_offset, params.k_new, params.new_dtype, k_new_offset,
                   D);
        }
        if (!values) continue;
        copy_row(params.v_cache, p.dtype, p.kv_offset(p.v_strides, b, key, h), params.v_new,
                 params.new_dtype, v_new_offset, Dv);
      }
    }
  }
}

void quantize_rows(const QuantizeParams& params) {
  const std::int64_t D = params.head_dim;
  parallel_tasks(
      params.num_threads, params.batch * params.seqlen, [&] { return std::vector<float>(D); },
      [&](std::vector<float>& row, std::int64_t task) {
        const std::int64_t b = task / params.seqlen, i = task % params.seqlen;
        for (std::int64_t h = 0; h < params.heads; ++h) {
          load_row_f32(row.data(), params.values, params.values_dtype,
                       params.values_strides.offset(b, i, h), D);
          const ScaleView& scales = params.scales;
          cpu::quantize_row(
              static_cast<std::uint8_t*>(params.cache) + params.cache_strides.offset(b, i, h),
              params.dtype, row.data(), scales.data + scales.strides.offset(b, i, h),
              scales.group_stride, scales.group_dims, D);
        }
      });
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

// Whether V is K's first head_dim_v dims (a shared cache, flashattn/kvcache.hpp): the same rows,
// and for a quantized cache the same scales over those dims. Its gathered keys then serve as the
// values too.
bool values_are_keys(const AttentionParams& p) {
  const auto same = [](const Strides& a, const Strides& b) {
    return a.batch == b.batch && a.seq == b.seq && a.head == b.head;
  };
  if (p.v != p.k || !same(p.v_strides, p.k_strides) || p.head_dim_v > p.head_dim) return false;
  if (!is_quantized(p.dtype)) return true;
  const ScaleView &k = p.k_scale, &v = p.v_scale;
  return v.data == k.data && same(v.strides, k.strides) && v.group_stride == k.group_stride &&
         (v.group_dims == k.group_dims || (v.groups == 1 && k.groups == 1));
}

void attend_to_cache(AttentionImpl impl, const AttentionParams& p) {
  if (p.seqlen_q == 0) return;
  if (reads_cache_in_place(impl, p)) return cpu::flash_decode(p);
  // Written in full by the gathers before they are read.
  UninitializedAlignedVector<std::uint8_t> keys, values;
  const bool shared = values_are_keys(p);
  for (std::int64_t b = 0; b < p.batch; ++b) {
    if (reads_rows_in_place(p)) {
      run_dense(impl, sequence_in_place(p, b));
      continue;
    }
    keys.resize(static_cast<std::size_t>(gathered_bytes(p, b, p.head_dim)));
    advise_huge_pages(keys.data(), keys.size());
    gather_sequence(p, b, p.k, p.k_strides, p.k_scale, p.head_dim, keys.data());
    if (shared) {
      AttentionParams s = sequence_problem(p, b, keys.data(), keys.data());
      s.v_strides = s.k_strides;
      run_dense(impl, s);
      continue;
    }
    values.resize(static_cast<std::size_t>(gathered_bytes(p, b, p.head_dim_v)));
    advise_huge_pages(values.data(), values.size());
    gather_sequence(p, b, p.v, p.v_strides, p.v_scale, p.head_dim_v, values.data());
    run_dense(impl, sequence_problem(p, b, keys.data(), values.data()));
  }
}

}  // namespace flashattn::detail
