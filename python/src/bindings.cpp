// flashattn._flashattn: the C++ library seen from Python through nanobind.
//
// This layer only turns arrays into views and back: every array (numpy through the buffer
// protocol or DLPack, torch through its own attributes: array_arg.hpp) is read where it lies,
// with its own strides, and outputs are arrays the caller allocated (python/flashattn/_api.py
// allocates them in the input's framework). The GIL is released while the library computes. The
// library validates everything else and raises flashattn::Error, which becomes ValueError with the
// same message.
//
// Arrays of fewer than 4 dims (varlen's [total, heads, dim]) are seen as 4-d views with leading
// dims of 1. bf16 arrays arrive either as bfloat16 (torch) or as uint16 (numpy arrays of
// ml_dtypes.bfloat16, which the buffer protocol cannot describe, viewed as uint16 by the Python
// layer): both read as bf16.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "array_arg.hpp"
#include "ceilings.hpp"
#include "flashattn/flashattn.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using flashattn::AttentionImpl;
using flashattn::AttentionOptions;
using flashattn::ConstTensorView;
using flashattn::DType;
using flashattn::Error;
using flashattn::MaskView;
using flashattn::TensorView;

using flashattn::python::InArray;
using flashattn::python::OutArray;

template <class... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  throw Error(message.str());
}

std::string describe(nb::dlpack::dtype dtype) {
  const char* kinds[] = {"int", "uint", "float", "opaque", "bfloat", "complex", "bool"};
  const std::string kind =
      dtype.code < 7 ? kinds[dtype.code] : "code " + std::to_string(dtype.code);
  return kind + std::to_string(dtype.bits);
}

bool is(nb::dlpack::dtype dtype, nb::dlpack::dtype_code code, int bits) {
  return dtype.code == static_cast<std::uint8_t>(code) && dtype.bits == bits && dtype.lanes == 1;
}

DType element_type(nb::dlpack::dtype dtype, const char* name) {
  using Code = nb::dlpack::dtype_code;
  if (is(dtype, Code::Float, 32)) return DType::f32;
  if (is(dtype, Code::Float, 16)) return DType::f16;
  if (is(dtype, Code::Bfloat, 16) || is(dtype, Code::UInt, 16)) return DType::bf16;
  fail(name, ": expected dtype float32, float16 or bfloat16, got ", describe(dtype));
}

// The shape and element strides of `array` as 4 dims, leading dims of 1 added in front.
template <class Array>
void dims4(const Array& array, const char* name, std::array<std::int64_t, 4>& shape,
           std::array<std::int64_t, 4>& strides) {
  const auto ndim = static_cast<std::int64_t>(array.ndim());
  if (ndim < 1 || ndim > 4) fail(name, ": expected 1 to 4 dims, got ", ndim);
  const std::int64_t pad = 4 - ndim;
  for (std::int64_t i = 0; i < 4; ++i) {
    shape[i] = i < pad ? 1 : static_cast<std::int64_t>(array.shape(i - pad));
    strides[i] = i < pad ? 0 : array.stride(i - pad);
  }
  // An empty array's strides are whatever its producer chose (numpy gives 0): none is read.
  if (array.size() == 0) strides = flashattn::contiguous_strides(shape);
}

template <class View, class Array>
View view_of(const Array& array, const char* name) {
  View view;
  view.data = array.data();
  view.dtype = element_type(array.dtype(), name);
  dims4(array, name, view.shape, view.strides);
  return view;
}

ConstTensorView in_view(const InArray& array, const char* name) {
  return view_of<ConstTensorView>(array, name);
}
TensorView out_view(const OutArray& array, const char* name) {
  return view_of<TensorView>(array, name);
}

ConstTensorView in_view(const std::optional<InArray>& array, const char* name) {
  return array ? in_view(*array, name) : ConstTensorView{};
}
TensorView out_view(const std::optional<OutArray>& array, const char* name) {
  return array ? out_view(*array, name) : TensorView{};
}

template <class Array>
bool c_contiguous(const Array& array) {
  if (array.size() == 0) return true;
  std::int64_t expected = 1;
  for (std::int64_t i = static_cast<std::int64_t>(array.ndim()) - 1; i >= 0; --i) {
    if (array.shape(i) != 1 && array.stride(i) != expected) return false;
    expected *= static_cast<std::int64_t>(array.shape(i));
  }
  return true;
}

// A contiguous buffer of `count` elements of type T (float32 or int32), for lse, lengths and
// tables, whose layout the library fixes.
template <class T, class Array>
T* buffer(const Array& array, const char* name, std::int64_t count) {
  using Code = nb::dlpack::dtype_code;
  const bool floating = std::is_same_v<std::remove_const_t<T>, float>;
  if (!is(array.dtype(), floating ? Code::Float : Code::Int, 32)) {
    fail(name, ": expected dtype ", floating ? "float32" : "int32", ", got ",
         describe(array.dtype()));
  }
  if (!c_contiguous(array)) fail(name, ": expected a contiguous array");
  if (static_cast<std::int64_t>(array.size()) != count) {
    fail(name, ": expected ", count, " elements, got ", array.size());
  }
  return static_cast<T*>(const_cast<void*>(static_cast<const void*>(array.data())));
}

// The score modifiers and the rest of AttentionOptions, from the Python layer's keywords. The
// arrays stay referenced by this struct for the whole call.
struct Options {
  AttentionOptions options;
  std::optional<InArray> alibi, sinks, bias, mask;
};

Options make_options(std::optional<float> scale, bool causal, std::int64_t window_left,
                     std::int64_t window_right, float softcap, std::optional<InArray> alibi,
                     std::optional<InArray> sinks, std::optional<InArray> bias,
                     std::optional<InArray> mask, int num_threads, float dropout_p,
                     std::uint64_t dropout_seed, std::uint32_t dropout_offset) {
  Options o{{}, std::move(alibi), std::move(sinks), std::move(bias), std::move(mask)};
  AttentionOptions& opt = o.options;
  opt.softmax_scale = scale;
  opt.causal = causal;
  opt.window_left = window_left;
  opt.window_right = window_right;
  opt.softcap = softcap;
  opt.num_threads = num_threads;
  opt.dropout_p = dropout_p;
  opt.dropout_seed = dropout_seed;
  opt.dropout_offset = dropout_offset;
  if (o.alibi) {
    opt.alibi_slopes = {buffer<const float>(*o.alibi, "alibi_slopes", o.alibi->size()),
                        o.alibi->size()};
  }
  if (o.sinks) {
    opt.sinks = {buffer<const float>(*o.sinks, "sinks", o.sinks->size()), o.sinks->size()};
  }
  if (o.bias) opt.bias = in_view(*o.bias, "attn_bias");
  if (o.mask) {
    using Code = nb::dlpack::dtype_code;
    if (!is(o.mask->dtype(), Code::Bool, 8) && !is(o.mask->dtype(), Code::UInt, 8)) {
      fail("attn_mask: expected dtype bool, got ", describe(o.mask->dtype()));
    }
    ConstTensorView dims;
    dims4(*o.mask, "attn_mask", dims.shape, dims.strides);
    opt.mask = MaskView{static_cast<const bool*>(o.mask->data()), dims.shape, dims.strides};
  }
  return o;
}

AttentionImpl impl_of(const std::string& name) {
  for (AttentionImpl impl :
       {AttentionImpl::flash, AttentionImpl::standard, AttentionImpl::reference}) {
    if (name == flashattn::impl_name(impl)) return impl;
  }
  fail("impl: expected 'flash', 'standard' or 'reference', got '", name, "'");
}

// The modifier-gradient outputs, when asked for.
flashattn::ModifierGradients modifier_gradients(const std::optional<OutArray>& dsinks,
                                                const std::optional<OutArray>& dbias,
                                                std::int64_t heads_q) {
  flashattn::ModifierGradients grads;
  if (dsinks) grads.dsinks = buffer<float>(*dsinks, "dsinks", heads_q);
  grads.dbias = out_view(dbias, "dbias");
  return grads;
}

// Every entry point takes the same option keywords. nanobind names keyword arguments per
// parameter, so the options are spelled out as parameters once here, then made an Options by
// FLASHATTN_OPTIONS and named by FLASHATTN_OPTION_NAMES.
#define FLASHATTN_OPTION_ARGS                                                                   \
  std::optional<float> scale, bool causal, std::int64_t window_left, std::int64_t window_right, \
      float softcap, std::optional<InArray> alibi_slopes, std::optional<InArray> sinks,         \
      std::optional<InArray> attn_bias, std::optional<InArray> attn_mask, int num_threads,      \
      float dropout_p, std::uint64_t dropout_seed, std::uint32_t dropout_offset
#define FLASHATTN_OPTIONS                                                                  \
  make_options(scale, causal, window_left, window_right, softcap, std::move(alibi_slopes), \
               std::move(sinks), std::move(attn_bias), std::move(attn_mask), num_threads,  \
               dropout_p, dropout_seed, dropout_offset)
#define FLASHATTN_OPTION_NAMES                                                               \
  "scale"_a.none(), "causal"_a, "window_left"_a, "window_right"_a, "softcap"_a,              \
      "alibi_slopes"_a.none(), "sinks"_a.none(), "attn_bias"_a.none(), "attn_mask"_a.none(), \
      "num_threads"_a, "dropout_p"_a = 0.0f, "dropout_seed"_a = 0, "dropout_offset"_a = 0

// flashattn::dropout_mask of one batch entry into keep, uint8 [heads_q, seqlen_q, seqlen_kv].
void dropout_mask(float dropout_p, std::uint64_t dropout_seed, std::uint32_t dropout_offset,
                  std::int64_t batch_index, const OutArray& keep) {
  using Code = nb::dlpack::dtype_code;
  if (keep.ndim() != 3 || !is(keep.dtype(), Code::UInt, 8) || !c_contiguous(keep)) {
    fail("keep: expected a contiguous uint8 array [heads_q, seqlen_q, seqlen_kv], got ",
         keep.ndim(), " dims of ", describe(keep.dtype()));
  }
  AttentionOptions options;
  options.dropout_p = dropout_p;
  options.dropout_seed = dropout_seed;
  options.dropout_offset = dropout_offset;
  flashattn::dropout_mask(options, batch_index, static_cast<std::int64_t>(keep.shape(0)),
                          static_cast<std::int64_t>(keep.shape(1)),
                          static_cast<std::int64_t>(keep.shape(2)),
                          static_cast<std::uint8_t*>(keep.data()));
}

void forward(const std::string& impl, const InArray& q, const InArray& k, const InArray& v,
             const OutArray& out, const std::optional<OutArray>& lse, FLASHATTN_OPTION_ARGS) {
  const Options o = FLASHATTN_OPTIONS;
  const ConstTensorView qv = in_view(q, "q"), kv = in_view(k, "k"), vv = in_view(v, "v");
  const TensorView ov = out_view(out, "out");
  float* lse_data =
      lse ? buffer<float>(*lse, "lse", qv.shape[0] * qv.shape[1] * qv.shape[2]) : nullptr;
  const AttentionImpl path = impl_of(impl);
  nb::gil_scoped_release release;
  flashattn::attention_forward(path, qv, kv, vv, ov, lse_data, o.options);
}

void backward(const std::string& impl, const InArray& dout, const InArray& q, const InArray& k,
              const InArray& v, const InArray& out, const InArray& lse, const OutArray& dq,
              const OutArray& dk, const OutArray& dv, const std::optional<OutArray>& dsinks,
              const std::optional<OutArray>& dbias, FLASHATTN_OPTION_ARGS) {
  const Options o = FLASHATTN_OPTIONS;
  const ConstTensorView qv = in_view(q, "q");
  const float* lse_data = buffer<const float>(lse, "lse", qv.shape[0] * qv.shape[1] * qv.shape[2]);
  const auto grads = modifier_gradients(dsinks, dbias, qv.shape[2]);
  const ConstTensorView dov = in_view(dout, "dout"), kv = in_view(k, "k"), vv = in_view(v, "v"),
                        ov = in_view(out, "out");
  const TensorView dqv = out_view(dq, "dq"), dkv = out_view(dk, "dk"), dvv = out_view(dv, "dv");
  const AttentionImpl path = impl_of(impl);
  nb::gil_scoped_release release;
  flashattn::attention_backward(path, dov, qv, kv, vv, ov, lse_data, dqv, dkv, dvv, o.options,
                                grads);
}

// Batch entries of a cu_seqlens array: its length − 1.
std::int64_t entries(const InArray& cu_seqlens, const char* name) {
  if (cu_seqlens.ndim() != 1 || cu_seqlens.shape(0) < 1) {
    fail(name, ": expected a 1-d array of batch + 1 >= 1 offsets");
  }
  return static_cast<std::int64_t>(cu_seqlens.shape(0)) - 1;
}

void varlen_forward(const std::string& impl, const InArray& q, const InArray& k, const InArray& v,
                    const InArray& cu_seqlens_q, const InArray& cu_seqlens_k, const OutArray& out,
                    const std::optional<OutArray>& lse, FLASHATTN_OPTION_ARGS) {
  const Options o = FLASHATTN_OPTIONS;
  const std::int64_t batch = entries(cu_seqlens_q, "cu_seqlens_q");
  const auto* cu_q = buffer<const std::int32_t>(cu_seqlens_q, "cu_seqlens_q", batch + 1);
  const auto* cu_k = buffer<const std::int32_t>(cu_seqlens_k, "cu_seqlens_k", batch + 1);
  const ConstTensorView qv = in_view(q, "q"), kv = in_view(k, "k"), vv = in_view(v, "v");
  const TensorView ov = out_view(out, "out");
  float* lse_data = lse ? buffer<float>(*lse, "lse", qv.shape[1] * qv.shape[2]) : nullptr;
  const AttentionImpl path = impl_of(impl);
  nb::gil_scoped_release release;
  flashattn::varlen_attention_forward(path, qv, kv, vv, cu_q, cu_k, batch, ov, lse_data, o.options);
}

// A quantized cache's dtype by name ("" for none), as the Python layer passes a cache of fp8
// codes: seen as uint8 (DLPack has no fp8 every producer exports).
DType cache_dtype_of(const std::string& name) {
  for (const DType dtype : {DType::int8, DType::fp8_e4m3, DType::fp8_e5m2}) {
    if (name == flashattn::dtype_name(dtype)) return dtype;
  }
  fail("cache_dtype: expected int8, fp8_e4m3 or fp8_e5m2, got ", name);
}

// A cache array: an int8 one as it is, uint8 codes as `cache_dtype` says.
template <class Array>
TensorView cache_view(const Array& array, const char* name, const std::string& cache_dtype) {
  using Code = nb::dlpack::dtype_code;
  TensorView view;
  view.data = array.data();
  if (!cache_dtype.empty()) {
    view.dtype = cache_dtype_of(cache_dtype);
    const bool bytes = is(array.dtype(), Code::UInt, 8) || is(array.dtype(), Code::Int, 8);
    if (!bytes) {
      fail(name, ": expected the bytes of ", cache_dtype, " codes (uint8 or int8), got ",
           describe(array.dtype()));
    }
  } else if (is(array.dtype(), Code::Int, 8)) {
    view.dtype = DType::int8;
  } else {
    view.dtype = element_type(array.dtype(), name);
  }
  dims4(array, name, view.shape, view.strides);
  return view;
}

// A quantized cache's scales: read as an input, so that a broadcast (read-only) numpy view
// passes; the library writes only int8 scales with an element per row, which the Python layer
// checks are writable.
TensorView scale_view(const std::optional<InArray>& scales, const char* name) {
  const ConstTensorView view = in_view(scales, name);
  return {const_cast<void*>(view.data), view.dtype, view.shape, view.strides};
}

// K and V in a paged cache [num_pages, page_size, Hkv, D] read through block_table
// [batch, pages_per_sequence]; cu_seqlens_k counts each sequence's keys.
void varlen_paged_forward(const std::string& impl, const InArray& q, const InArray& k_cache,
                          const InArray& v_cache, const std::string& cache_dtype,
                          const std::optional<InArray>& k_scale,
                          const std::optional<InArray>& v_scale, const InArray& block_table,
                          const InArray& cu_seqlens_q, const InArray& cu_seqlens_k,
                          const OutArray& out, const std::optional<OutArray>& lse,
                          FLASHATTN_OPTION_ARGS) {
  const Options o = FLASHATTN_OPTIONS;
  const std::int64_t batch = entries(cu_seqlens_q, "cu_seqlens_q");
  const auto* cu_q = buffer<const std::int32_t>(cu_seqlens_q, "cu_seqlens_q", batch + 1);
  const auto* cu_k = buffer<const std::int32_t>(cu_seqlens_k, "cu_seqlens_k", batch + 1);
  if (block_table.ndim() != 2 || static_cast<std::int64_t>(block_table.shape(0)) != batch) {
    fail("block_table: expected an int32 array [batch = ", batch, ", pages_per_sequence]");
  }
  flashattn::PagedKVView kv{cache_view(k_cache, "k", cache_dtype),
                            cache_view(v_cache, "v", cache_dtype),
                            nullptr,
                            static_cast<std::int64_t>(block_table.shape(1)),
                            in_view(k_scale, "k_scale"),
                            in_view(v_scale, "v_scale")};
  // The library needs a non-null table even with no page (varlen.hpp): one int32 stands in.
  static const std::int32_t no_page = 0;
  kv.block_table =
      kv.pages_per_sequence == 0
          ? &no_page
          : buffer<const std::int32_t>(block_table, "block_table", batch * kv.pages_per_sequence);
  const ConstTensorView qv = in_view(q, "q");
  const TensorView ov = out_view(out, "out");
  float* lse_data = lse ? buffer<float>(*lse, "lse", qv.shape[1] * qv.shape[2]) : nullptr;
  const AttentionImpl path = impl_of(impl);
  nb::gil_scoped_release release;
  flashattn::varlen_attention_forward(path, qv, kv, cu_q, cu_k, batch, ov, lse_data, o.options);
}

void varlen_backward(const std::string& impl, const InArray& dout, const InArray& q,
                     const InArray& k, const InArray& v, const InArray& out, const InArray& lse,
                     const InArray& cu_seqlens_q, const InArray& cu_seqlens_k, const OutArray& dq,
                     const OutArray& dk, const OutArray& dv, const std::optional<OutArray>& dsinks,
                     FLASHATTN_OPTION_ARGS) {
  const Options o = FLASHATTN_OPTIONS;
  const std::int64_t batch = entries(cu_seqlens_q, "cu_seqlens_q");
  const auto* cu_q = buffer<const std::int32_t>(cu_seqlens_q, "cu_seqlens_q", batch + 1);
  const auto* cu_k = buffer<const std::int32_t>(cu_seqlens_k, "cu_seqlens_k", batch + 1);
  const ConstTensorView qv = in_view(q, "q");
  const float* lse_data = buffer<const float>(lse, "lse", qv.shape[1] * qv.shape[2]);
  const auto grads = modifier_gradients(dsinks, std::nullopt, qv.shape[2]);
  const ConstTensorView dov = in_view(dout, "dout"), kv = in_view(k, "k"), vv = in_view(v, "v"),
                        ov = in_view(out, "out");
  const TensorView dqv = out_view(dq, "dq"), dkv = out_view(dk, "dk"), dvv = out_view(dv, "dv");
  const AttentionImpl path = impl_of(impl);
  nb::gil_scoped_release release;
  flashattn::varlen_attention_backward(path, dov, qv, kv, vv, ov, lse_data, cu_q, cu_k, batch, dqv,
                                       dkv, dvv, o.options, grads);
}

void kvcache_forward(const std::string& impl, const InArray& q, const OutArray& k_cache,
                     const OutArray& v_cache, const std::string& cache_dtype,
                     const std::optional<InArray>& k_scale, const std::optional<InArray>& v_scale,
                     const InArray& cache_seqlens, const std::optional<InArray>& block_table,
                     const std::optional<InArray>& k_new, const std::optional<InArray>& v_new,
                     const OutArray& out, const std::optional<OutArray>& lse,
                     const std::optional<InArray>& rotary_cos,
                     const std::optional<InArray>& rotary_sin, bool rotary_interleaved,
                     const std::optional<InArray>& cache_leftpad,
                     const std::optional<InArray>& cache_batch_idx, FLASHATTN_OPTION_ARGS) {
  const Options o = FLASHATTN_OPTIONS;
  const ConstTensorView qv = in_view(q, "q");
  const std::int64_t batch = qv.shape[0];
  // The rest of flash_attn_with_kvcache's arguments (flashattn::KVCacheOptions): a rotary table
  // float32 [positions, rotary_dim / 2] each, int32 [batch] vectors.
  flashattn::KVCacheOptions cache_options;
  if (rotary_cos || rotary_sin) {
    if (!rotary_cos || !rotary_sin)
      fail("rotary_cos, rotary_sin: expected both tables, or neither");
    for (const auto& [name, table] :
         {std::pair{"rotary_cos", &*rotary_cos}, {"rotary_sin", &*rotary_sin}}) {
      if (table->ndim() != 2) {
        fail(name, ": expected a float32 array [seqlen_ro, rotary_dim / 2], got ", table->ndim(),
             " dims");
      }
    }
    if (rotary_sin->shape(0) != rotary_cos->shape(0) ||
        rotary_sin->shape(1) != rotary_cos->shape(1)) {
      fail("rotary_sin: expected shape [", rotary_cos->shape(0), ", ", rotary_cos->shape(1),
           "] (as rotary_cos), got [", rotary_sin->shape(0), ", ", rotary_sin->shape(1), "]");
    }
    const auto positions = static_cast<std::int64_t>(rotary_cos->shape(0));
    const auto half = static_cast<std::int64_t>(rotary_cos->shape(1));
    cache_options.rotary = {buffer<const float>(*rotary_cos, "rotary_cos", positions * half),
                            buffer<const float>(*rotary_sin, "rotary_sin", positions * half),
                            positions, 2 * half, rotary_interleaved};
  }
  if (cache_leftpad) {
    cache_options.cache_leftpad =
        buffer<const std::int32_t>(*cache_leftpad, "cache_leftpad", batch);
  }
  if (cache_batch_idx) {
    cache_options.cache_batch_idx =
        buffer<const std::int32_t>(*cache_batch_idx, "cache_batch_idx", batch);
  }
  flashattn::KVCacheView cache{cache_view(k_cache, "k_cache", cache_dtype),
                               cache_view(v_cache, "v_cache", cache_dtype), nullptr, 0};
  cache.k_scale = scale_view(k_scale, "k_scale");
  cache.v_scale = scale_view(v_scale, "v_scale");
  if (block_table) {
    if (block_table->ndim() != 2 || static_cast<std::int64_t>(block_table->shape(0)) != batch) {
      fail("block_table: expected an int32 array [batch = ", batch, ", pages_per_sequence]");
    }
    cache.pages_per_sequence = static_cast<std::int64_t>(block_table->shape(1));
    // The library needs a non-null table even with no page (kvcache.hpp): one int32 stands in.
    static const std::int32_t no_page = 0;
    cache.block_table = cache.pages_per_sequence == 0
                            ? &no_page
                            : buffer<const std::int32_t>(*block_table, "block_table",
                                                         batch * cache.pages_per_sequence);
  }
  const auto* lengths = buffer<const std::int32_t>(cache_seqlens, "cache_seqlens", batch);
  const flashattn::NewKeysValues new_kv{in_view(k_new, "k"), in_view(v_new, "v")};
  const TensorView ov = out_view(out, "out");
  float* lse_data = lse ? buffer<float>(*lse, "lse", batch * qv.shape[2] * qv.shape[1]) : nullptr;
  const AttentionImpl path = impl_of(impl);
  nb::gil_scoped_release release;
  flashattn::kvcache_attention_forward(qv, cache, lengths, new_kv, cache_options, ov, lse_data,
                                       o.options, path);
}

void quantize_kv(const InArray& values, const OutArray& cache, const std::string& cache_dtype,
                 const InArray& scales, int num_threads) {
  const ConstTensorView from = in_view(values, "values");
  const TensorView to = cache_view(cache, "cache", cache_dtype);
  const TensorView scales_view = scale_view(scales, "scales");
  nb::gil_scoped_release release;
  flashattn::quantize_kv(from, to, scales_view, num_threads);
}

void merge_states(const InArray& out_a, const InArray& lse_a, const InArray& out_b,
                  const InArray& lse_b, const OutArray& out, const std::optional<OutArray>& lse,
                  int num_threads) {
  const ConstTensorView a = in_view(out_a, "out_a"), b = in_view(out_b, "out_b");
  const std::int64_t rows = a.shape[0] * a.shape[1] * a.shape[2];
  const float* lse_a_data = buffer<const float>(lse_a, "lse_a", rows);
  const float* lse_b_data = buffer<const float>(lse_b, "lse_b", rows);
  const TensorView ov = out_view(out, "out");
  float* lse_data = lse ? buffer<float>(*lse, "lse", rows) : nullptr;
  nb::gil_scoped_release release;
  flashattn::merge_attention_states(a, lse_a_data, b, lse_b_data, ov, lse_data, num_threads);
}

// MultiHeadAttention's weights as numpy arrays that view the layer's own storage.
nb::ndarray<nb::numpy, float> weights(nb::handle owner, std::span<float> data, std::size_t rows) {
  const std::size_t cols = rows == 0 ? 0 : data.size() / rows;
  if (rows == 0) return nb::ndarray<nb::numpy, float>(data.data(), {data.size()}, owner);
  return nb::ndarray<nb::numpy, float>(data.data(), {rows, cols}, owner);
}

// A contiguous fp32 [batch, seqlen, hidden] array: its data and dims.
template <class Array>
auto* activations(const Array& x, const char* name, std::int64_t hidden, std::int64_t& batch,
                  std::int64_t& seqlen) {
  if (x.ndim() != 3 || static_cast<std::int64_t>(x.shape(2)) != hidden) {
    fail(name, ": expected float32 [batch, seqlen, hidden = ", hidden, "]");
  }
  if (!c_contiguous(x)) fail(name, ": expected a contiguous array");
  batch = static_cast<std::int64_t>(x.shape(0));
  seqlen = static_cast<std::int64_t>(x.shape(1));
  return x.data();
}

}  // namespace

NB_MODULE(_flashattn, m) {
  m.doc() = "flashattn's C++ library; call it through the flashattn package, not directly.";
  // The library's own version (CMake's project version), which flashattn.__version__ is.
  m.attr("__version__") = flashattn::version();
  m.def("simd_target", &flashattn::simd_target, "The Highway target the kernels run on here.");
  m.def("blas", &flashattn::blas, "The BLAS behind the standard path and the projections.");
  nb::register_exception_translator([](const std::exception_ptr& error, void*) {
    try {
      std::rethrow_exception(error);
    } catch (const Error& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  m.def("dropout_mask", &dropout_mask, "dropout_p"_a, "dropout_seed"_a, "dropout_offset"_a,
        "batch_index"_a, "keep"_a,
        "The dropout mask of one batch entry into keep, uint8 [heads_q, seqlen_q, seqlen_kv].");
  m.def("forward", &forward, "impl"_a, "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a.none(),
        FLASHATTN_OPTION_NAMES,
        "Attention forward of [B, S, H, D] views into out (and lse [B, H, Sq] when given).");
  m.def("backward", &backward, "impl"_a, "dout"_a, "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a, "dq"_a,
        "dk"_a, "dv"_a, "dsinks"_a.none(), "dbias"_a.none(), FLASHATTN_OPTION_NAMES,
        "Attention backward into dq, dk, dv (and dsinks, dbias when given).");
  m.def("varlen_forward", &varlen_forward, "impl"_a, "q"_a, "k"_a, "v"_a, "cu_seqlens_q"_a,
        "cu_seqlens_k"_a, "out"_a, "lse"_a.none(), FLASHATTN_OPTION_NAMES,
        "Packed-batch forward: q [total_q, Hq, D], k, v [total_k, Hkv, D], lse [Hq, total_q].");
  m.def("varlen_paged_forward", &varlen_paged_forward, "impl"_a, "q"_a, "k_cache"_a, "v_cache"_a,
        "cache_dtype"_a, "k_scale"_a.none(), "v_scale"_a.none(), "block_table"_a, "cu_seqlens_q"_a,
        "cu_seqlens_k"_a, "out"_a, "lse"_a.none(), FLASHATTN_OPTION_NAMES,
        "Packed-batch forward with K, V in pages [num_pages, page_size, Hkv, D] read through "
        "block_table [B, pages]; cu_seqlens_k counts each sequence's keys.");
  m.def("varlen_backward", &varlen_backward, "impl"_a, "dout"_a, "q"_a, "k"_a, "v"_a, "out"_a,
        "lse"_a, "cu_seqlens_q"_a, "cu_seqlens_k"_a, "dq"_a, "dk"_a, "dv"_a, "dsinks"_a.none(),
        FLASHATTN_OPTION_NAMES, "Packed-batch backward.");
  m.def("kvcache_forward", &kvcache_forward, "impl"_a, "q"_a, "k_cache"_a, "v_cache"_a,
        "cache_dtype"_a, "k_scale"_a.none(), "v_scale"_a.none(), "cache_seqlens"_a,
        "block_table"_a.none(), "k_new"_a.none(), "v_new"_a.none(), "out"_a, "lse"_a.none(),
        "rotary_cos"_a.none(), "rotary_sin"_a.none(), "rotary_interleaved"_a,
        "cache_leftpad"_a.none(), "cache_batch_idx"_a.none(), FLASHATTN_OPTION_NAMES,
        "Appends k_new, v_new into the (dense or paged) cache in place (rotated by rotary_cos, "
        "rotary_sin when given), then attends.");
  m.def("quantize_kv", &quantize_kv, "values"_a, "cache"_a, "cache_dtype"_a, "scales"_a,
        "num_threads"_a, "Quantizes values into an int8 or fp8 cache (int8 writes the scales).");
  m.def("merge_states", &merge_states, "out_a"_a, "lse_a"_a, "out_b"_a, "lse_b"_a, "out"_a,
        "lse"_a.none(), "num_threads"_a, "Exact merge of two attention states over disjoint keys.");
  m.def(
      "visible_pairs",
      [](std::int64_t seqlen_q, std::int64_t seqlen_kv, bool causal, std::int64_t window_left,
         std::int64_t window_right) {
        AttentionOptions options;
        options.causal = causal;
        options.window_left = window_left;
        options.window_right = window_right;
        return flashattn::visible_pairs(seqlen_q, seqlen_kv, options);
      },
      "seqlen_q"_a, "seqlen_kv"_a, "causal"_a = false, "window_left"_a = -1, "window_right"_a = -1,
      "(query, key) pairs the causal mask and window leave visible in one (batch, head).");

  m.def(
      "fma_peak_gflops",
      [](int threads, double seconds, int trials) {
        flashattn::bench::FmaPeak peak(threads);
        nb::gil_scoped_release release;
        return flashattn::bench::best_rate(peak, seconds, trials) / 1e9;
      },
      "threads"_a, "seconds"_a = 0.2, "trials"_a = 3,
      "The f32 FMA peak of `threads` threads in GFLOP/s (bench/ceilings.hpp), for benchmarks.");
  m.def(
      "sgemm_pairs_gflops",
      [](int threads, std::int64_t seqlen, std::int64_t head_dim, double seconds, int trials) {
        flashattn::bench::SgemmPairs pairs(threads, seqlen, head_dim);
        nb::gil_scoped_release release;
        return flashattn::bench::best_rate(pairs, seconds, trials) / 1e9;
      },
      "threads"_a, "seqlen"_a, "head_dim"_a, "seconds"_a = 0.2, "trials"_a = 3,
      "The BLAS's sgemm ceiling on the standard path's products (Q·Kᵀ and S·V of one head per "
      "thread, bench/ceilings.hpp) in GFLOP/s, for benchmarks.");
  m.def(
      "bf16_dot_peak_gflops",
      [](int threads, double seconds, int trials) -> std::optional<double> {
        if (!flashattn::bench::Bf16DotPeak::supported()) return std::nullopt;
        flashattn::bench::Bf16DotPeak peak(threads);
        nb::gil_scoped_release release;
        return flashattn::bench::best_rate(peak, seconds, trials) / 1e9;
      },
      "threads"_a, "seconds"_a = 0.2, "trials"_a = 3,
      "The bf16 vdpbf16ps peak in GFLOP/s, or None on CPUs without AVX512-BF16.");

  using Layer = flashattn::MultiHeadAttention;
  nb::class_<Layer> layer(m, "MultiHeadAttentionLayer");
  // The weights (matrices [in, out]: in = hidden, or num_heads · value_head_dim for w_o) and
  // biases (vectors; empty without bias), as views.
  enum class Rows { hidden, attention, vector };
  struct WeightProperty {
    const char* name;
    std::span<float> (Layer::*get)();
    Rows rows;
  };
  for (const WeightProperty w : {WeightProperty{"w_q", &Layer::w_q, Rows::hidden},
                                 {"w_k", &Layer::w_k, Rows::hidden},
                                 {"w_v", &Layer::w_v, Rows::hidden},
                                 {"w_o", &Layer::w_o, Rows::attention},
                                 {"b_q", &Layer::b_q, Rows::vector},
                                 {"b_k", &Layer::b_k, Rows::vector},
                                 {"b_v", &Layer::b_v, Rows::vector},
                                 {"b_o", &Layer::b_o, Rows::vector}}) {
    layer.def_prop_ro(
        w.name,
        [w](nb::handle self) {
          Layer& l = nb::cast<Layer&>(self);
          const std::int64_t rows = w.rows == Rows::hidden      ? l.config().hidden
                                    : w.rows == Rows::attention ? l.attention_width()
                                                                : 0;
          return weights(self, (l.*w.get)(), static_cast<std::size_t>(rows));
        },
        nb::rv_policy::reference_internal);
  }
  layer
      .def(
          "__init__",
          [](Layer* self, std::int64_t hidden, std::int64_t num_heads, std::int64_t num_kv_heads,
             bool bias, std::uint64_t seed, std::int64_t value_head_dim) {
            new (self) Layer({hidden, num_heads, num_kv_heads, bias, value_head_dim});
            self->init_random(seed);
          },
          "hidden"_a, "num_heads"_a, "num_kv_heads"_a = 0, "bias"_a = false, "seed"_a = 0,
          "value_head_dim"_a = 0)
      .def_prop_ro("hidden", [](const Layer& l) { return l.config().hidden; })
      .def_prop_ro("num_heads", [](const Layer& l) { return l.config().num_heads; })
      .def_prop_ro("num_kv_heads", [](const Layer& l) { return l.num_kv_heads(); })
      .def_prop_ro("head_dim", [](const Layer& l) { return l.head_dim(); })
      .def_prop_ro("value_head_dim", [](const Layer& l) { return l.value_head_dim(); })
      .def(
          "forward",
          [](const Layer& layer, const nb::ndarray<nb::ro, float, nb::device::cpu>& x,
             std::optional<nb::ndarray<nb::ro, float, nb::device::cpu>> context,
             nb::ndarray<float, nb::device::cpu> y, bool causal, const std::string& impl,
             int num_threads) {
            std::int64_t batch = 0, seqlen_q = 0, context_batch = 0, seqlen_kv = 0;
            const float* x_data = activations(x, "x", layer.config().hidden, batch, seqlen_q);
            const float* context_data =
                context ? activations(*context, "context", layer.config().hidden, context_batch,
                                      seqlen_kv)
                        : nullptr;
            if (context && context_batch != batch) {
              fail("context: expected batch ", batch, " (as x), got ", context_batch);
            }
            std::int64_t y_batch = 0, y_seqlen = 0;
            float* y_data = activations(y, "y", layer.config().hidden, y_batch, y_seqlen);
            if (y_batch != batch || y_seqlen != seqlen_q) {
              fail("y: expected [", batch, ", ", seqlen_q, ", ", layer.config().hidden, "]");
            }
            AttentionOptions options;
            options.causal = causal;
            options.num_threads = num_threads;
            const AttentionImpl path = impl_of(impl);
            nb::gil_scoped_release release;
            if (context_data) {
              layer.forward(x_data, batch, seqlen_q, context_data, seqlen_kv, y_data, options,
                            path);
            } else {
              layer.forward(x_data, batch, seqlen_q, y_data, options, path);
            }
          },
          "x"_a, "context"_a.none(), "y"_a, "causal"_a, "impl"_a, "num_threads"_a,
          "y = the layer applied to x (self-attention) or to x and context (cross-attention).");
}
