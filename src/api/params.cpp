#include "api/params.hpp"

#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "api/fail.hpp"

namespace flashattn {
namespace detail {
namespace {

std::string shape_string(const std::array<std::int64_t, 4>& shape) {
  std::ostringstream text;
  text << '[' << shape[0] << ", " << shape[1] << ", " << shape[2] << ", " << shape[3] << ']';
  return text.str();
}

// Every dim of every tensor is at most 2^61: then sums of a few seqlens and windows, and the
// padded widths the kernels use, cannot overflow 64 bits. Only a view with stride 0 along a
// dim (k, v) can describe such a length without that much memory.
constexpr std::int64_t kMaxDim = std::int64_t{1} << 61;

// Elements of a view with non-negative dims, or an Error when the count overflows 64 bits.
template <class View>
std::int64_t element_count(const char* caller, const char* name, const View& view) {
  std::int64_t count = 1;
  for (int d = 0; d < 4; ++d) {
    if (view.shape[d] == 0) return 0;
  }
  for (int d = 0; d < 4; ++d) {
    if (__builtin_mul_overflow(count, view.shape[d], &count)) {
      fail(caller, name, ": shape ", shape_string(view.shape), " overflows a 64-bit element count");
    }
  }
  return count;
}

// Bytes [begin, end) that a view can touch, computed with overflow checks. Empty for numel 0.
struct ByteSpan {
  std::uintptr_t begin = 0, end = 0;
  bool overlaps(const ByteSpan& other) const {
    return begin < end && other.begin < other.end && begin < other.end && other.begin < end;
  }
};

template <class Pointer>
std::int64_t element_size(const BasicTensorView<Pointer>& view) {
  return static_cast<std::int64_t>(dtype_size(view.dtype));
}
std::int64_t element_size(const MaskView&) { return 1; }

template <class View>
ByteSpan byte_span(const char* caller, const char* name, const View& view) {
  if (element_count(caller, name, view) == 0) return {};
  std::int64_t last = 0;  // element offset of the last element
  for (int d = 0; d < 4; ++d) {
    std::int64_t term = 0;
    if (__builtin_mul_overflow(view.shape[d] - 1, view.strides[d], &term) ||
        __builtin_add_overflow(last, term, &last)) {
      fail(caller, name, ": shape ", shape_string(view.shape), " with strides ",
           shape_string(view.strides), " overflows a 64-bit offset");
    }
  }
  std::int64_t bytes = 0;
  if (__builtin_mul_overflow(last + 1, element_size(view), &bytes)) {
    fail(caller, name, ": extent of ", last + 1, " elements overflows a 64-bit byte count");
  }
  const auto begin = reinterpret_cast<std::uintptr_t>(view.data);
  std::uintptr_t end = 0;
  if (__builtin_add_overflow(begin, static_cast<std::uintptr_t>(bytes), &end)) {
    fail(caller, name, ": ", bytes, " bytes from address ", view.data,
         " wrap around the address space");
  }
  return {begin, end};
}

// A view's dims, strides and pointer; its dtype a compute dtype (f32, f16, bf16) unless
// `cache` (a KV cache, which also takes the quantized ones: flashattn/dtype.hpp).
template <class View>
void check_view(const char* caller, const char* name, const View& view, bool cache = false) {
  if (is_quantized(view.dtype) && !cache) {
    fail(caller, name, ": expected dtype f32, f16 or bf16, got ", dtype_name(view.dtype),
         " (a cache dtype, which only the KV-cache call takes)");
  }
  for (int d = 0; d < 4; ++d) {
    if (view.shape[d] < 0) {
      fail(caller, name, ": expected non-negative dims, got shape ", shape_string(view.shape));
    }
    if (view.shape[d] > kMaxDim) {
      fail(caller, name, ": expected dims <= 2^61, got shape ", shape_string(view.shape));
    }
    if (view.strides[d] < 0) {
      fail(caller, name, ": expected non-negative strides, got strides ",
           shape_string(view.strides));
    }
  }
  if (view.shape[3] > 1 && view.strides[3] != 1) {
    fail(caller, name, ": expected a contiguous last dim (stride 1), got stride ", view.strides[3]);
  }
  if (element_count(caller, name, view) > 0 && view.data == nullptr) {
    fail(caller, name, ": expected a data pointer, got null for shape ", shape_string(view.shape));
  }
}

// True when two distinct indices of `view` can address the same element (never for an empty
// view, whose contiguous strides may well be 0). Sorting the dims by
// stride, each stride must be at least the extent of everything inside it. An extent past
// 64 bits saturates: no later stride can reach it, which is an overlap, as it should be.
bool self_overlapping(const TensorView& view) {
  if (std::find(view.shape.begin(), view.shape.end(), 0) != view.shape.end()) return false;
  std::array<int, 4> order = {0, 1, 2, 3};  // not a vector: validation allocates nothing
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return view.strides[a] < view.strides[b]; });
  std::int64_t extent = 1;
  for (int d : order) {
    if (view.shape[d] <= 1) continue;
    if (view.strides[d] < extent) return true;
    if (__builtin_mul_overflow(view.strides[d], view.shape[d], &extent)) {
      extent = std::numeric_limits<std::int64_t>::max();
    }
  }
  return false;
}

// Whether an element offset `delta` is Σ_d j_d·strides[d] with |j_d| < shape[d] over the dims
// order[level..3] (strides descending): whether two views of the same shape and strides, `delta`
// elements apart, share an element. With nested strides (not self_overlapping) the inner dims
// reach less than one stride of the outer, so only the two multiples of that stride nearest to
// delta can leave a remainder they reach; both are tried (at most 16 paths).
bool reaches_offset(const TensorView& view, const std::array<int, 4>& order, int level,
                    __int128 delta) {
  if (level == 4) return delta == 0;
  const int d = order[level];
  const __int128 stride = view.strides[d];
  if (view.shape[d] <= 1 || stride == 0) return reaches_offset(view, order, level + 1, delta);
  __int128 low = delta / stride;
  if (delta % stride != 0 && delta < 0) --low;  // floor
  for (const __int128 j : {low, low + 1}) {
    if (j > -view.shape[d] && j < view.shape[d] &&
        reaches_offset(view, order, level + 1, delta - j * stride)) {
      return true;
    }
  }
  return false;
}

// Whether two written views overlap. Views of one dtype with the same shape and strides that
// interleave (dq, dk, dv of one packed gradient, [B, S, 3, H, D]) are disjoint when no element
// of one is an element of the other; other pairs overlap when their byte spans do.
bool written_views_overlap(const TensorView& a, const ByteSpan& a_span, const TensorView& b,
                           const ByteSpan& b_span) {
  if (!a_span.overlaps(b_span)) return false;
  const auto element = static_cast<std::intptr_t>(dtype_size(a.dtype));
  const std::intptr_t bytes = static_cast<const char*>(b.data) - static_cast<const char*>(a.data);
  if (a.dtype != b.dtype || a.shape != b.shape || a.strides != b.strides || self_overlapping(a) ||
      bytes % element != 0) {
    return true;
  }
  std::array<int, 4> order = {0, 1, 2, 3};
  std::sort(order.begin(), order.end(), [&](int x, int y) { return a.strides[x] > a.strides[y]; });
  return reaches_offset(a, order, 0, bytes / element);
}

// A window wider than both sequences together is unbounded in effect; capping it there keeps
// the mask arithmetic (diagonal ± window) inside 64 bits.
std::int64_t cap_window(std::int64_t window, std::int64_t seqlen_q, std::int64_t seqlen_kv) {
  return std::min(window, seqlen_q + seqlen_kv);
}

Strides strides_of(const std::array<std::int64_t, 4>& strides) {
  return {strides[0], strides[1], strides[2]};
}

// The dims that q, k, v and out must share (k and v named `k_name`, `v_name`): both head dims
// and the heads at least 1, k's head_dim q's, v's leading dims k's and its head dim (head_dim_v)
// out's, out's leading dims q's, heads_kv dividing heads_q.
void check_operand_shapes(const char* caller, const char* k_name, const char* v_name,
                          const ConstTensorView& q, const ConstTensorView& k,
                          const ConstTensorView& v, const TensorView& out) {
  const std::int64_t heads_q = q.shape[2], head_dim = q.shape[3], heads_kv = k.shape[2];
  const std::int64_t head_dim_v = v.shape[3];
  if (head_dim == 0) fail(caller, "q: expected head_dim >= 1, got 0");
  if (heads_q == 0) fail(caller, "q: expected heads_q >= 1, got 0");
  if (heads_kv == 0) fail(caller, k_name, ": expected heads_kv >= 1, got 0");
  if (k.shape[3] != head_dim) {
    fail(caller, k_name, ": expected head_dim ", head_dim, " (as q), got ", k.shape[3]);
  }
  if (v.shape[0] != k.shape[0] || v.shape[1] != k.shape[1] || v.shape[2] != k.shape[2]) {
    fail(caller, v_name, ": expected shape [", k.shape[0], ", ", k.shape[1], ", ", k.shape[2],
         ", head_dim_v] (as ", k_name, " but for its head dim), got ", shape_string(v.shape));
  }
  if (head_dim_v == 0) fail(caller, v_name, ": expected head_dim_v >= 1, got 0");
  const std::array<std::int64_t, 4> out_shape{q.shape[0], q.shape[1], heads_q, head_dim_v};
  if (out.shape != out_shape) {
    fail(caller, "out: expected shape ", shape_string(out_shape), " (q's [batch, seqlen_q, ",
         "heads_q] and ", v_name, "'s head_dim_v = ", head_dim_v, "), got ",
         shape_string(out.shape));
  }
  if (heads_q % heads_kv != 0) {
    fail(caller, k_name, ": expected heads_kv dividing heads_q = ", heads_q, ", got heads_kv ",
         heads_kv);
  }
}

// The parameters of checked views and options: k's dtype for k and v, q's for q and out; each
// sequence `seqlen_kv` keys long (a KV cache's capacity), the windows capped by it.
AttentionParams checked_params(const ConstTensorView& q, const ConstTensorView& k,
                               const ConstTensorView& v, const TensorView& out, float* lse,
                               const AttentionOptions& options, float scale,
                               std::int64_t seqlen_kv) {
  AttentionParams params;
  params.q = q.data;
  params.k = k.data;
  params.v = v.data;
  params.out = out.data;
  params.lse = lse;
  params.dtype = k.dtype;
  params.q_dtype = q.dtype;
  params.batch = q.shape[0];
  params.seqlen_q = q.shape[1];
  params.seqlen_kv = seqlen_kv;
  params.heads_q = q.shape[2];
  params.heads_kv = k.shape[2];
  params.head_dim = q.shape[3];
  params.head_dim_v = v.shape[3];
  params.q_strides = strides_of(q.strides);
  params.k_strides = strides_of(k.strides);
  params.v_strides = strides_of(v.strides);
  params.out_strides = strides_of(out.strides);
  params.scale = scale;
  params.causal = options.causal;
  params.window_left = cap_window(options.window_left, params.seqlen_q, seqlen_kv);
  params.window_right = cap_window(options.window_right, params.seqlen_q, seqlen_kv);
  params.num_threads = options.num_threads > 0 ? options.num_threads : omp_get_max_threads();
  params.dropout = make_dropout(options);
  return params;
}

// An Error naming dropout_p where a call has no dropout: `what` says which call.
void refuse_dropout(const char* caller, const AttentionOptions& options, const char* what) {
  if (options.dropout_p != 0.0f) {
    fail(caller, "dropout_p: expected 0, as ", what,
         " has no dropout (a training-only option), got ", options.dropout_p);
  }
}

}  // namespace

Dropout make_dropout(const AttentionOptions& options) {
  Dropout dropout;
  if (options.dropout_p > 0.0f) {
    dropout.p = options.dropout_p;
    dropout.scale = 1.0f / (1.0f - options.dropout_p);
    dropout.threshold = static_cast<std::uint32_t>(std::lround(options.dropout_p * 65536.0));
    dropout.seed = options.dropout_seed;
    dropout.offset = options.dropout_offset;
  }
  return dropout;
}

void place_block(const char* caller, AttentionParams& params, const AttentionOptions& options,
                 std::int64_t query_minus_key_offset) {
  // |shift| <= 2^59 keeps diagonal ± window (each below 2^61 + 2^59 and 2^62 + 2^59) inside 64
  // bits; the first test keeps computing the shift itself inside them.
  constexpr std::int64_t kMaxShift = std::int64_t{1} << 59;
  const std::int64_t lengths = params.seqlen_q - params.seqlen_kv;
  if (query_minus_key_offset < -kMaxDim || query_minus_key_offset > kMaxDim ||
      query_minus_key_offset + lengths < -kMaxShift ||
      query_minus_key_offset + lengths > kMaxShift) {
    fail(caller,
         "query_minus_key_offset: expected the diagonal's shift, offset + seqlen_q - seqlen_kv, "
         "within 2^59 either way, got offset ",
         query_minus_key_offset, " with seqlen_q ", params.seqlen_q, " and seqlen_kv ",
         params.seqlen_kv);
  }
  if (params.modifiers.masks_logits() || params.modifiers.sinks != nullptr) {
    fail(caller,
         "options: expected no bias, mask or sinks for a block of a longer sequence "
         "(they belong to the whole sequence), got ",
         params.modifiers.sinks != nullptr ? "sinks" : "a bias or mask");
  }
  refuse_dropout(caller, options, "a block of a longer sequence");
  const std::int64_t shift = query_minus_key_offset + lengths;
  params.diagonal_shift = shift;
  // The window reaches as far as both sequences plus the shift before it stops mattering.
  const std::int64_t reach = params.seqlen_q + params.seqlen_kv + (shift < 0 ? -shift : shift);
  params.window_left = std::min(options.window_left, reach);
  params.window_right = std::min(options.window_right, reach);
}

namespace {

// Checks the options that every forward shares; returns the softmax scale.
float checked_scale(const char* caller, const AttentionOptions& options, std::int64_t head_dim) {
  float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  if (options.softmax_scale) {
    scale = *options.softmax_scale;
    if (!std::isfinite(scale) || scale <= 0.0f) {
      fail(caller, "softmax_scale: expected a finite value > 0, got ", scale);
    }
  }
  if (options.window_left < -1) {
    fail(caller, "window_left: expected >= -1 (-1 = unbounded), got ", options.window_left);
  }
  if (options.window_right < -1) {
    fail(caller, "window_right: expected >= -1 (-1 = unbounded), got ", options.window_right);
  }
  if (options.num_threads < 0 || options.num_threads > kMaxThreads) {
    fail(caller, "num_threads: expected 0..", kMaxThreads, " (0 = all), got ", options.num_threads);
  }
  if (!(options.dropout_p >= 0.0f && options.dropout_p < 1.0f)) {
    fail(caller, "dropout_p: expected a value in [0, 1) (0 = off), got ", options.dropout_p);
  }
  return scale;
}

// The dropout mask's coordinates are 32-bit (util/dropout.hpp): rows, key blocks and streams.
void check_dropout_coordinates(const char* caller, const AttentionOptions& options,
                               std::int64_t streams, std::int64_t seqlen_q,
                               std::int64_t seqlen_kv) {
  constexpr std::int64_t kLimit = std::int64_t{1} << 32;
  if (options.dropout_p == 0.0f) return;
  if (streams > kLimit || seqlen_q > kLimit || seqlen_kv > kLimit) {
    fail(caller, "dropout_p: the dropout mask takes batch x heads_q, seqlen_q and seqlen_kv up to ",
         "2^32 each, got ", streams, ", ", seqlen_q, " and ", seqlen_kv);
  }
}

// The span of `count` fp32 values at `values` (empty for null), or an Error naming `name`.
ByteSpan float_span(const char* caller, const char* name, const float* values, std::int64_t count) {
  if (values == nullptr) return {};
  std::int64_t bytes = 0;
  if (__builtin_mul_overflow(count, static_cast<std::int64_t>(sizeof(float)), &bytes)) {
    fail(caller, name, ": ", count, " fp32 values overflow a 64-bit byte count");
  }
  const auto begin = reinterpret_cast<std::uintptr_t>(values);
  std::uintptr_t end = 0;
  if (__builtin_add_overflow(begin, static_cast<std::uintptr_t>(bytes), &end)) {
    fail(caller, name, ": ", bytes, " bytes from address ", values,
         " wrap around the address space");
  }
  return {begin, end};
}

using WrittenSpans = std::initializer_list<std::pair<const char*, ByteSpan>>;

// A bias or mask view (`name`) of shape [batch | 1, heads_q | 1, seqlen_q, seqlen_kv], checked
// and seen as the full shape (broadcast dims stride 0); not overlapping `written`.
template <class View>
LogitView checked_logit_view(const char* caller, const char* name, const View& view,
                             const std::array<std::int64_t, 4>& full, WrittenSpans written) {
  for (int d = 0; d < 4; ++d) {
    if (view.strides[d] < 0) {
      fail(caller, name, ": expected non-negative strides, got strides ",
           shape_string(view.strides));
    }
  }
  const std::array<std::int64_t, 4>& shape = view.shape;
  if ((shape[0] != 1 && shape[0] != full[0]) || (shape[1] != 1 && shape[1] != full[1]) ||
      shape[2] != full[2] || shape[3] != full[3]) {
    fail(caller, name, ": expected shape [", full[0], " or 1, ", full[1], " or 1, ", full[2], ", ",
         full[3], "] ([batch | 1, heads_q | 1, seqlen_q, seqlen_kv]), got ", shape_string(shape));
  }
  const ByteSpan span = byte_span(caller, name, view);
  for (const auto& [other, other_span] : written) {
    if (span.overlaps(other_span)) {
      fail(caller, name, ": expected memory disjoint from ", other, ", got overlapping buffers");
    }
  }
  LogitView logits;
  logits.data = view.data;
  logits.batch = shape[0] == 1 ? 0 : view.strides[0];
  logits.head = shape[1] == 1 ? 0 : view.strides[1];
  logits.row = view.strides[2];
  logits.key = view.strides[3];
  return logits;
}

// The score modifiers of `options` for `batch` entries of `heads_q` query heads, checked; their
// arrays must not overlap what the call writes (`written`). `logit_shape` is the
// [batch, heads_q, seqlen_q, seqlen_kv] that a bias or mask covers; null where the call takes
// neither (a varlen batch or a KV cache).
ScoreModifiers checked_modifiers(const char* caller, const AttentionOptions& options,
                                 std::int64_t batch, std::int64_t heads_q, WrittenSpans written,
                                 const std::array<std::int64_t, 4>* logit_shape) {
  ScoreModifiers modifiers;
  if (logit_shape == nullptr) {
    if (options.bias.data != nullptr) {
      fail(caller, "bias: expected none (the dense forward and backward take one), got a ",
           shape_string(options.bias.shape), " view");
    }
    if (options.mask.data != nullptr) {
      fail(caller, "mask: expected none (the dense forward and backward take one), got a ",
           shape_string(options.mask.shape), " view");
    }
  } else {
    if (options.bias.data != nullptr) {
      if (is_quantized(options.bias.dtype)) {
        fail(caller, "bias: expected dtype f32, f16 or bf16, got ", dtype_name(options.bias.dtype));
      }
      modifiers.bias = checked_logit_view(caller, "bias", options.bias, *logit_shape, written);
      modifiers.bias.dtype = options.bias.dtype;
    }
    if (options.mask.data != nullptr) {
      modifiers.mask = checked_logit_view(caller, "mask", options.mask, *logit_shape, written);
    }
  }
  if (!std::isfinite(options.softcap) || options.softcap < 0.0f) {
    fail(caller, "softcap: expected a finite value >= 0 (0 = off), got ", options.softcap);
  }
  modifiers.softcap = options.softcap;
  auto check_values = [&](const char* name, std::span<const float> values) {
    if (!values.empty() && values.data() == nullptr) {
      fail(caller, name, ": expected a data pointer for ", values.size(), " values, got null");
    }
    const ByteSpan span =
        float_span(caller, name, values.data(), static_cast<std::int64_t>(values.size()));
    for (const auto& [other, other_span] : written) {
      if (span.overlaps(other_span)) {
        fail(caller, name, ": expected memory disjoint from ", other, ", got overlapping buffers");
      }
    }
    for (std::size_t i = 0; i < values.size(); ++i) {
      if (!std::isfinite(values[i])) {
        fail(caller, name, "[", i, "]: expected a finite value, got ", values[i]);
      }
    }
  };
  const auto slopes = static_cast<std::int64_t>(options.alibi_slopes.size());
  if (slopes != 0) {
    if (slopes != heads_q && slopes != batch * heads_q) {
      fail(caller, "alibi_slopes: expected ", heads_q, " values ([heads_q]) or ", batch * heads_q,
           " ([batch, heads_q] = [", batch, ", ", heads_q, "]), got ", slopes);
    }
    check_values("alibi_slopes", options.alibi_slopes);
    modifiers.alibi_slopes = options.alibi_slopes.data();
    modifiers.alibi_batch_stride = slopes == heads_q ? 0 : heads_q;
  }
  const auto sinks = static_cast<std::int64_t>(options.sinks.size());
  if (sinks != 0) {
    if (sinks != heads_q) {
      fail(caller, "sinks: expected ", heads_q, " values ([heads_q]), got ", sinks);
    }
    check_values("sinks", options.sinks);
    modifiers.sinks = options.sinks.data();
  }
  return modifiers;
}

// k, v and out in q's dtype.
void check_dtypes_as_q(const char* caller, const ConstTensorView& q, const ConstTensorView& k,
                       const ConstTensorView& v, const TensorView& out) {
  for (const auto& [name, dtype] : {std::pair{"k", k.dtype}, {"v", v.dtype}, {"out", out.dtype}}) {
    if (dtype != q.dtype) {
      fail(caller, name, ": expected dtype ", dtype_name(q.dtype), " (as q), got ",
           dtype_name(dtype));
    }
  }
}

// What a forward writes: out, every element at its own address, and lse (heads_q values per
// query row of q's batch), neither overlapping the other nor q, k or v. Returns their spans.
std::pair<ByteSpan, ByteSpan> checked_output_spans(const char* caller, const ConstTensorView& q,
                                                   const ConstTensorView& k,
                                                   const ConstTensorView& v, const TensorView& out,
                                                   float* lse) {
  const ByteSpan out_span = byte_span(caller, "out", out);
  if (self_overlapping(out)) {
    fail(caller, "out: expected strides that give every element its own address, got strides ",
         shape_string(out.strides), " for shape ", shape_string(out.shape));
  }
  // B·Hq·Sq <= numel(out), which byte_span bounded; float_span checks the 4-byte elements.
  const ByteSpan lse_span = float_span(caller, "lse", lse, q.shape[0] * q.shape[2] * q.shape[1]);
  if (out_span.overlaps(lse_span)) {
    fail(caller, "lse: expected memory disjoint from out, got overlapping buffers");
  }
  for (const auto& [name, span] : {std::pair{"q", byte_span(caller, "q", q)},
                                   {"k", byte_span(caller, "k", k)},
                                   {"v", byte_span(caller, "v", v)}}) {
    if (out_span.overlaps(span)) {
      fail(caller, "out: expected memory disjoint from ", name, ", got overlapping buffers");
    }
    if (lse_span.overlaps(span)) {
      fail(caller, "lse: expected memory disjoint from ", name, ", got overlapping buffers");
    }
  }
  return {out_span, lse_span};
}

// Rows per sequence of a paged cache whose `k_name` holds pages of page_size rows (its dim 1).
std::int64_t paged_capacity(const char* caller, const char* k_name, std::int64_t page_size,
                            std::int64_t pages_per_sequence) {
  if (page_size == 0) fail(caller, k_name, ": expected page_size (dim 1) >= 1, got 0");
  if (pages_per_sequence < 0) {
    fail(caller, "pages_per_sequence: expected >= 0, got ", pages_per_sequence);
  }
  std::int64_t capacity = 0;
  if (__builtin_mul_overflow(pages_per_sequence, page_size, &capacity) || capacity > kMaxDim) {
    fail(caller, "pages_per_sequence: ", pages_per_sequence, " pages of ", page_size,
         " rows exceed 2^61 rows per sequence");
  }
  return capacity;
}

// The first `pages` entries of sequence b's row of the block table: pages in [0, num_pages).
void check_table_row(const char* caller, const std::int32_t* block_table,
                     std::int64_t pages_per_sequence, std::int64_t b, std::int64_t pages,
                     std::int64_t num_pages) {
  for (std::int64_t i = 0; i < pages; ++i) {
    const std::int32_t page = block_table[b * pages_per_sequence + i];
    if (page < 0 || page >= num_pages) {
      fail(caller, "block_table[", b, ", ", i, "]: expected a page in [0, ", num_pages, "), got ",
           page);
    }
  }
}

}  // namespace

AttentionParams make_params(const char* caller, const ConstTensorView& q, const ConstTensorView& k,
                            const ConstTensorView& v, const TensorView& out, float* lse,
                            const AttentionOptions& options, std::int64_t modifier_batch) {
  check_view(caller, "q", q);
  check_view(caller, "k", k);
  check_view(caller, "v", v);
  check_view(caller, "out", out);
  check_dtypes_as_q(caller, q, k, v, out);

  const std::int64_t batch = q.shape[0], seqlen_q = q.shape[1], heads_q = q.shape[2],
                     head_dim = q.shape[3];
  const std::int64_t seqlen_kv = k.shape[1];
  if (k.shape[0] != batch) fail(caller, "k: expected batch ", batch, " (as q), got ", k.shape[0]);
  check_operand_shapes(caller, "k", "v", q, k, v, out);

  const float scale = checked_scale(caller, options, head_dim);
  check_dropout_coordinates(caller, options,
                            (modifier_batch < 0 ? batch : modifier_batch) * heads_q, seqlen_q,
                            seqlen_kv);
  const auto [out_span, lse_span] = checked_output_spans(caller, q, k, v, out, lse);

  AttentionParams params = checked_params(q, k, v, out, lse, options, scale, seqlen_kv);
  // A varlen batch (modifier_batch given) takes no bias or mask: its rows are packed.
  const std::array<std::int64_t, 4> logit_shape = {batch, heads_q, seqlen_q, seqlen_kv};
  params.modifiers = checked_modifiers(caller, options, modifier_batch < 0 ? batch : modifier_batch,
                                       heads_q, {{"out", out_span}, {"lse", lse_span}},
                                       modifier_batch < 0 ? &logit_shape : nullptr);
  return params;
}

BackwardParams make_backward_params(const char* caller, const ConstTensorView& dout,
                                    const ConstTensorView& q, const ConstTensorView& k,
                                    const ConstTensorView& v, const ConstTensorView& out,
                                    const float* lse, const TensorView& dq, const TensorView& dk,
                                    const TensorView& dv, const AttentionOptions& options,
                                    const ModifierGradients& modifier_gradients,
                                    std::int64_t modifier_batch) {
  // The forward's checks cover q, k, v, out and the options; out is only read here.
  const TensorView out_view{const_cast<void*>(out.data), out.dtype, out.shape, out.strides};
  BackwardParams params;
  params.forward =
      make_params(caller, q, k, v, out_view, const_cast<float*>(lse), options, modifier_batch);
  const AttentionParams& f = params.forward;
  if (lse == nullptr && f.batch * f.heads_q * f.seqlen_q > 0) {
    fail(caller, "lse: expected the forward's logsumexp [", f.batch, ", ", f.heads_q, ", ",
         f.seqlen_q, "], got null");
  }

  const std::pair<const char*, const TensorView*> gradients[] = {
      {"dq", &dq}, {"dk", &dk}, {"dv", &dv}};
  const std::pair<const char*, std::array<std::int64_t, 4>> expected_shapes[] = {
      {"dout", out.shape}, {"dq", q.shape}, {"dk", k.shape}, {"dv", v.shape}};
  check_view(caller, "dout", dout);
  for (const auto& [name, view] : gradients) check_view(caller, name, *view);
  const DType dtypes[] = {dout.dtype, dq.dtype, dk.dtype, dv.dtype};
  const std::array<std::int64_t, 4> shapes[] = {dout.shape, dq.shape, dk.shape, dv.shape};
  for (int i = 0; i < 4; ++i) {
    const auto& [name, shape] = expected_shapes[i];
    if (dtypes[i] != q.dtype) {
      fail(caller, name, ": expected dtype ", dtype_name(q.dtype), " (as q), got ",
           dtype_name(dtypes[i]));
    }
    if (shapes[i] != shape) {
      fail(caller, name, ": expected shape ", shape_string(shape), " (as ",
           std::array{"out", "q", "k", "v"}[i], "), got ", shape_string(shapes[i]));
    }
  }

  // Gradients are written: each must address every element once and overlap nothing else.
  std::vector<std::pair<const char*, ByteSpan>> read_spans = {
      {"q", byte_span(caller, "q", q)},
      {"k", byte_span(caller, "k", k)},
      {"v", byte_span(caller, "v", v)},
      {"out", byte_span(caller, "out", out)},
      {"dout", byte_span(caller, "dout", dout)}};
  if (lse != nullptr) {
    const auto begin = reinterpret_cast<std::uintptr_t>(lse);
    read_spans.push_back({"lse",
                          {begin, begin + static_cast<std::uintptr_t>(
                                              f.batch * f.heads_q * f.seqlen_q * sizeof(float))}});
  }
  std::vector<std::pair<const char*, ByteSpan>> written_spans;
  if (modifier_gradients.dsinks != nullptr) {
    if (f.modifiers.sinks == nullptr) {
      fail(caller, "dsinks: expected null without options.sinks (there is no sink to derive)");
    }
    const ByteSpan dsinks_span = float_span(caller, "dsinks", modifier_gradients.dsinks, f.heads_q);
    read_spans.push_back({"sinks", float_span(caller, "sinks", f.modifiers.sinks, f.heads_q)});
    for (const auto& [other, other_span] : read_spans) {
      if (dsinks_span.overlaps(other_span)) {
        fail(caller, "dsinks: expected memory disjoint from ", other, ", got overlapping buffers");
      }
    }
    written_spans.push_back({"dsinks", dsinks_span});
  }
  if (options.bias.data != nullptr) {
    read_spans.push_back({"bias", byte_span(caller, "bias", options.bias)});
  }
  if (options.mask.data != nullptr) {
    read_spans.push_back({"mask", byte_span(caller, "mask", options.mask)});
  }
  const TensorView& dbias = modifier_gradients.dbias;
  if (dbias.data != nullptr) {
    if (f.modifiers.bias.data == nullptr) {
      fail(caller, "dbias: expected none without options.bias (there is no bias to derive)");
    }
    if (dbias.shape != options.bias.shape) {
      fail(caller, "dbias: expected shape ", shape_string(options.bias.shape), " (as bias), got ",
           shape_string(dbias.shape));
    }
    if (dbias.dtype != options.bias.dtype) {
      fail(caller, "dbias: expected dtype ", dtype_name(options.bias.dtype), " (as bias), got ",
           dtype_name(dbias.dtype));
    }
    for (int d = 0; d < 4; ++d) {
      if (dbias.strides[d] < 0) {
        fail(caller, "dbias: expected non-negative strides, got strides ",
             shape_string(dbias.strides));
      }
    }
    if (self_overlapping(dbias)) {
      fail(caller, "dbias: expected strides that give every element its own address, got strides ",
           shape_string(dbias.strides), " for shape ", shape_string(dbias.shape));
    }
    const ByteSpan span = byte_span(caller, "dbias", dbias);
    for (const auto& [other, other_span] : read_spans) {
      if (span.overlaps(other_span)) {
        fail(caller, "dbias: expected memory disjoint from ", other, ", got overlapping buffers");
      }
    }
    for (const auto& [other, other_span] : written_spans) {
      if (span.overlaps(other_span)) {
        fail(caller, "dbias: expected memory disjoint from ", other, ", got overlapping buffers");
      }
    }
    written_spans.push_back({"dbias", span});
  }
  // dq, dk and dv may interleave in one buffer (a packed gradient) as long as no element is
  // shared.
  std::array<ByteSpan, 3> gradient_spans;
  for (std::size_t g = 0; g < 3; ++g) {
    const auto& [name, view] = gradients[g];
    if (self_overlapping(*view)) {
      fail(caller, name, ": expected strides that give every element its own address, got strides ",
           shape_string(view->strides), " for shape ", shape_string(view->shape));
    }
    const ByteSpan span = byte_span(caller, name, *view);
    for (const auto& [other, other_span] : read_spans) {
      if (span.overlaps(other_span)) {
        fail(caller, name, ": expected memory disjoint from ", other, ", got overlapping buffers");
      }
    }
    for (const auto& [other, other_span] : written_spans) {
      if (span.overlaps(other_span)) {
        fail(caller, name, ": expected memory disjoint from ", other, ", got overlapping buffers");
      }
    }
    for (std::size_t other = 0; other < g; ++other) {
      if (written_views_overlap(*view, span, *gradients[other].second, gradient_spans[other])) {
        fail(caller, name, ": expected memory disjoint from ", gradients[other].first,
             ", got overlapping buffers");
      }
    }
    gradient_spans[g] = span;
  }

  params.dout = dout.data;
  params.dq = dq.data;
  params.dk = dk.data;
  params.dv = dv.data;
  params.dout_strides = strides_of(dout.strides);
  params.dq_strides = strides_of(dq.strides);
  params.dk_strides = strides_of(dk.strides);
  params.dv_strides = strides_of(dv.strides);
  params.dsinks = modifier_gradients.dsinks;
  params.dbias = dbias;
  return params;
}

// The scales `name` of a quantized cache `cache` (flashattn/kvcache.hpp, KVCacheView): fp32
// [cache dims 0 and 1, heads_kv, groups], groups dividing head_dim, non-negative strides (0
// broadcasts); when `written` (int8 rows appended), one element per (row, group).
ScaleView checked_scales(const char* caller, const char* name, const TensorView& scales,
                         const ConstTensorView& cache, std::int64_t head_dim, bool written) {
  const std::int64_t groups = scales.shape[3];
  if (scales.shape[0] != cache.shape[0] || scales.shape[1] != cache.shape[1] ||
      scales.shape[2] != cache.shape[2] || groups < 1 || head_dim % groups != 0) {
    fail(caller, name, ": expected shape [", cache.shape[0], ", ", cache.shape[1], ", ",
         cache.shape[2], ", groups] (the cache's leading dims, groups dividing ",
         std::string_view(name) == "v_scale" ? "head_dim_v" : "head_dim", " = ", head_dim,
         "), got ", shape_string(scales.shape));
  }
  if (scales.dtype != DType::f32) {
    fail(caller, name, ": expected dtype f32, got ", dtype_name(scales.dtype));
  }
  for (int d = 0; d < 4; ++d) {
    if (scales.strides[d] < 0) {
      fail(caller, name, ": expected non-negative strides, got strides ",
           shape_string(scales.strides));
    }
  }
  if (scales.data == nullptr && scales.numel() > 0) {
    fail(caller, name, ": expected fp32 scales for the ", dtype_name(cache.dtype),
         " cache, got null");
  }
  if (written && self_overlapping(scales)) {
    fail(caller, name, ": expected one element per (row, KV head, group) (the ",
         dtype_name(cache.dtype), " cache's appended rows write their scales), got strides ",
         shape_string(scales.strides), " for shape ", shape_string(scales.shape));
  }
  return {static_cast<float*>(scales.data), strides_of(scales.strides), scales.strides[3], groups,
          head_dim / groups};
}

KVCacheParams make_kvcache_params(const char* caller, const ConstTensorView& q,
                                  const KVCacheView& cache, const std::int32_t* cache_seqlens,
                                  const NewKeysValues& new_kv, const KVCacheOptions& cache_options,
                                  const TensorView& out, float* lse,
                                  const AttentionOptions& options) {
  const ConstTensorView k_cache = cache.k, v_cache = cache.v;
  check_view(caller, "q", q);
  check_view(caller, "out", out);
  check_view(caller, "k_cache", k_cache, true);
  check_view(caller, "v_cache", v_cache, true);
  const bool paged = cache.block_table != nullptr;

  if (out.dtype != q.dtype) {
    fail(caller, "out: expected dtype ", dtype_name(q.dtype), " (as q), got ",
         dtype_name(out.dtype));
  }
  if (v_cache.dtype != k_cache.dtype) {
    fail(caller, "v_cache: expected dtype ", dtype_name(k_cache.dtype), " (as k_cache), got ",
         dtype_name(v_cache.dtype));
  }
  const DType cache_dtype = k_cache.dtype;
  const bool quantized = is_quantized(cache_dtype);
  if (cache_dtype != q.dtype && q.dtype != DType::f32 && !quantized) {
    fail(caller, "k_cache: expected dtype ", dtype_name(q.dtype), " (as q; only an f32 q takes a ",
         "16-bit cache), got ", dtype_name(cache_dtype));
  }

  const std::int64_t batch = q.shape[0], seqlen_q = q.shape[1], heads_q = q.shape[2],
                     head_dim = q.shape[3];
  const std::int64_t heads_kv = k_cache.shape[2], head_dim_v = v_cache.shape[3];
  check_operand_shapes(caller, "k_cache", "v_cache", q, k_cache, v_cache, out);

  // Capacity of every sequence.
  std::int64_t capacity = 0;
  const std::int64_t page_size = k_cache.shape[1], num_pages = k_cache.shape[0];
  if (paged) {
    capacity = paged_capacity(caller, "k_cache", page_size, cache.pages_per_sequence);
  } else {
    if (k_cache.shape[0] != batch && cache_options.cache_batch_idx == nullptr) {
      fail(caller, "k_cache: expected batch ", batch, " (as q; or a block_table for a paged ",
           "cache, or a cache_batch_idx), got ", k_cache.shape[0]);
    }
    if (cache.pages_per_sequence != 0) {
      fail(caller, "pages_per_sequence: expected 0 without a block_table, got ",
           cache.pages_per_sequence);
    }
    capacity = k_cache.shape[1];
  }

  // The rows to append; k_new alone declares a shared cache (MLA's latent rows), whose values
  // are the first head_dim_v dims of its keys.
  const auto given = [](const ConstTensorView& view) {
    return view.data != nullptr || view.shape != std::array<std::int64_t, 4>{};
  };
  const bool appending = given(new_kv.k) || given(new_kv.v);
  const bool values_in_keys = given(new_kv.k) && !given(new_kv.v);
  std::int64_t seqlen_new = 0;
  if (values_in_keys) {
    // v_cache must be k_cache[..., :head_dim_v]: the same rows, fewer dims.
    const bool view_of_keys = v_cache.data == k_cache.data && v_cache.strides == k_cache.strides &&
                              head_dim_v <= head_dim;
    if (!view_of_keys) {
      fail(caller, "v_cache: expected a view of k_cache's first head_dim_v dims (k_new without ",
           "v_new appends to a shared cache, whose values are in its keys), got ",
           v_cache.data == k_cache.data ? "strides " + shape_string(v_cache.strides) +
                                              " for k_cache's " + shape_string(k_cache.strides)
                                        : std::string("another buffer"),
           " and head_dim_v ", head_dim_v, " with head_dim ", head_dim);
    }
    // The same scales: one per row for both, or v's groups the first of k's, as wide.
    const std::int64_t k_groups = cache.k_scale.shape[3], v_groups = cache.v_scale.shape[3];
    const bool same_groups =
        (k_groups == 1 && v_groups == 1) || v_groups * head_dim == k_groups * head_dim_v;
    if (quantized && (cache.v_scale.data != cache.k_scale.data ||
                      cache.v_scale.strides != cache.k_scale.strides || !same_groups)) {
      fail(caller, "v_scale: expected a view of k_scale's groups over the first head_dim_v dims ",
           "(a shared cache's values are its keys' codes), got ", shape_string(cache.v_scale.shape),
           " for k_scale's ", shape_string(cache.k_scale.shape));
    }
  }
  if (appending) {
    check_view(caller, "k_new", new_kv.k);
    if (!values_in_keys) check_view(caller, "v_new", new_kv.v);
    const std::array<std::int64_t, 4> expected{batch, new_kv.k.shape[1], heads_kv, head_dim};
    if (new_kv.k.shape != expected) {
      fail(caller, "k_new: expected shape [", batch, ", Snew, ", heads_kv, ", ", head_dim,
           "], got ", shape_string(new_kv.k.shape));
    }
    const std::array<std::int64_t, 4> expected_v{batch, new_kv.k.shape[1], heads_kv, head_dim_v};
    if (!values_in_keys && new_kv.v.shape != expected_v) {
      fail(caller, "v_new: expected shape ", shape_string(expected_v),
           " (k_new's rows of v_cache's head_dim_v), got ", shape_string(new_kv.v.shape));
    }
    // Into a quantized cache rows of any compute dtype are quantized (check_view refused the
    // cache dtypes).
    if (!quantized && new_kv.k.dtype != cache_dtype && new_kv.k.dtype != q.dtype) {
      fail(caller, "k_new: expected dtype ", dtype_name(cache_dtype), " (as the cache) or ",
           dtype_name(q.dtype), " (as q), got ", dtype_name(new_kv.k.dtype));
    }
    if (!values_in_keys && new_kv.v.dtype != new_kv.k.dtype) {
      fail(caller, "v_new: expected dtype ", dtype_name(new_kv.k.dtype), " (as k_new), got ",
           dtype_name(new_kv.v.dtype));
    }
    seqlen_new = new_kv.k.shape[1];
  }

  const float scale = checked_scale(caller, options, head_dim);
  refuse_dropout(caller, options, "the KV-cache call (serving)");

  ScaleView k_scale, v_scale;
  if (quantized) {
    const bool written = appending && seqlen_new > 0 && cache_dtype == DType::int8;
    k_scale = checked_scales(caller, "k_scale", cache.k_scale, k_cache, head_dim, written);
    v_scale = checked_scales(caller, "v_scale", cache.v_scale, v_cache, head_dim_v,
                             written && !values_in_keys);
  } else {
    for (const auto& [name, view] :
         {std::pair{"k_scale", &cache.k_scale}, {"v_scale", &cache.v_scale}}) {
      if (view->data != nullptr) {
        fail(caller, name, ": expected none for a ", dtype_name(cache_dtype),
             " cache (scales belong to int8 and fp8 caches), got a ", shape_string(view->shape),
             " view");
      }
    }
  }

  // Every sequence's length, and for a paged cache the pages it reads and writes.
  if (batch > 0 && cache_seqlens == nullptr) {
    fail(caller, "cache_seqlens: expected ", batch, " int32 lengths, got null");
  }
  const std::int32_t* leftpad = cache_options.cache_leftpad;
  const std::int32_t* batch_index = cache_options.cache_batch_idx;
  if (paged && leftpad != nullptr) {
    fail(caller, "cache_leftpad: expected null with a block_table (FlashAttention has no left ",
         "padding in a paged cache), got an array");
  }
  if (paged && batch_index != nullptr) {
    fail(caller, "cache_batch_idx: expected null with a block_table (the table maps each ",
         "sequence to its pages), got an array");
  }
  std::vector<std::int64_t> kv_lengths(static_cast<std::size_t>(batch));
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t cached = cache_seqlens[b];
    if (cached < 0) fail(caller, "cache_seqlens[", b, "]: expected >= 0, got ", cached);
    if (cached > capacity - seqlen_new) {
      fail(caller, "cache_seqlens[", b, "]: expected at most ", capacity - seqlen_new,
           " (capacity ", capacity, " minus ", seqlen_new, " new rows), got ", cached);
    }
    const std::int64_t first = leftpad == nullptr ? 0 : leftpad[b];
    if (first < 0 || first > cached) {
      fail(caller, "cache_leftpad[", b, "]: expected in [0, cache_seqlens[", b, "] = ", cached,
           "], got ", first);
    }
    kv_lengths[b] = cached + seqlen_new - first;
  }
  if (batch_index != nullptr) {
    // The cache row of each batch entry, and the entry that appends to it.
    const std::int64_t batch_cache = k_cache.shape[0];
    std::unordered_map<std::int32_t, std::int64_t> writers;
    for (std::int64_t b = 0; b < batch; ++b) {
      const std::int32_t row = batch_index[b];
      if (row < 0 || row >= batch_cache) {
        fail(caller, "cache_batch_idx[", b, "]: expected a cache row in [0, ", batch_cache,
             "), got ", row);
      }
      if (seqlen_new == 0) continue;
      const auto [writer, inserted] = writers.try_emplace(row, b);
      if (!inserted) {
        fail(caller, "cache_batch_idx[", b, "]: expected distinct rows when appending, got ", row,
             " as cache_batch_idx[", writer->second, "] too");
      }
    }
  }

  // Rotary embedding: the table, and the last position each sequence rotates at.
  const RotaryEmbedding& rotary = cache_options.rotary;
  const bool rotating = rotary.cos != nullptr || rotary.sin != nullptr;
  // FlashAttention's rule: q rows advance with the keys under a causal mask or a window, a side
  // of which counts when it is in [0, capacity) (flash_api.cpp turns wider ones into -1).
  const auto window_side = [&](std::int64_t w) { return w >= 0 && w < capacity; };
  const bool q_positions_advance =
      options.causal || window_side(options.window_left) || window_side(options.window_right);
  if (rotating) {
    if (rotary.cos == nullptr) {
      fail(caller, "rotary_cos: expected a table with rotary_sin, got null");
    }
    if (rotary.sin == nullptr) {
      fail(caller, "rotary_sin: expected a table with rotary_cos, got null");
    }
    if (!appending) {
      fail(caller, "rotary_cos: expected new rows k_new, v_new to rotate (FlashAttention rotates ",
           "only when appending), got none");
    }
    if (rotary.rotary_dim < 2 || rotary.rotary_dim % 2 != 0 || rotary.rotary_dim > head_dim) {
      fail(caller, "rotary_dim (2 · rotary_cos's columns): expected an even number in [2, ",
           "head_dim = ", head_dim, "], got ", rotary.rotary_dim);
    }
    if (rotary.positions < 0 ||
        rotary.positions > std::numeric_limits<std::int64_t>::max() / rotary.rotary_dim) {
      fail(caller, "rotary_cos: expected a count of positions in [0, 2^63 / rotary_dim), got ",
           rotary.positions);
    }
    const std::int64_t q_rows = seqlen_q == 0 ? 0 : (q_positions_advance ? seqlen_q : 1);
    const std::int64_t rows = std::max(seqlen_new, q_rows);
    for (std::int64_t b = 0; b < batch && rows > 0; ++b) {
      const std::int64_t last = cache_seqlens[b] + rows - 1;
      if (last >= rotary.positions) {
        fail(caller, "rotary_cos: expected more than ", last, " positions (sequence ", b,
             " rotates at cache_seqlens[", b, "] = ", cache_seqlens[b], " to ", last, "), got ",
             rotary.positions);
      }
    }
  }
  if (paged) {
    // Written pages and the (sequence, table column) that writes each.
    std::unordered_map<std::int32_t, std::pair<std::int64_t, std::int64_t>> writers;
    for (std::int64_t b = 0; b < batch; ++b) {
      const std::int64_t pages = (kv_lengths[b] + page_size - 1) / page_size;
      const std::int64_t first_written = cache_seqlens[b] / page_size;
      check_table_row(caller, cache.block_table, cache.pages_per_sequence, b, pages, num_pages);
      for (std::int64_t i = 0; i < pages; ++i) {
        const std::int32_t page = cache.block_table[b * cache.pages_per_sequence + i];
        if (seqlen_new == 0 || i < first_written) continue;
        const auto [writer, inserted] = writers.try_emplace(page, b, i);
        if (!inserted) {
          fail(caller, "block_table[", b, ", ", i, "]: page ", page,
               " receives new rows here and at block_table[", writer->second.first, ", ",
               writer->second.second, "]; a page written in a call must belong to one place");
        }
      }
    }
  }

  // Memory: out and lse are written, and so is the cache when rows are appended.
  const ByteSpan out_span = byte_span(caller, "out", out);
  if (self_overlapping(out)) {
    fail(caller, "out: expected strides that give every element its own address, got strides ",
         shape_string(out.strides), " for shape ", shape_string(out.shape));
  }
  const ByteSpan q_span = byte_span(caller, "q", q);
  const ByteSpan k_cache_span = byte_span(caller, "k_cache", k_cache);
  const ByteSpan v_cache_span = byte_span(caller, "v_cache", v_cache);
  const ByteSpan k_new_span = appending ? byte_span(caller, "k_new", new_kv.k) : ByteSpan{};
  const ByteSpan v_new_span =
      appending && !values_in_keys ? byte_span(caller, "v_new", new_kv.v) : ByteSpan{};
  const ByteSpan lse_span = float_span(caller, "lse", lse, batch * heads_q * seqlen_q);
  const std::int64_t rotary_values = rotating ? rotary.positions * (rotary.rotary_dim / 2) : 0;
  const ByteSpan cos_span = float_span(caller, "rotary_cos", rotary.cos, rotary_values);
  const ByteSpan sin_span = float_span(caller, "rotary_sin", rotary.sin, rotary_values);
  const ByteSpan k_scale_span =
      quantized ? byte_span(caller, "k_scale", cache.k_scale) : ByteSpan{};
  const ByteSpan v_scale_span =
      quantized ? byte_span(caller, "v_scale", cache.v_scale) : ByteSpan{};
  const std::pair<const char*, ByteSpan> spans[] = {{"q", q_span},
                                                    {"k_cache", k_cache_span},
                                                    {"v_cache", v_cache_span},
                                                    {"k_new", k_new_span},
                                                    {"v_new", v_new_span},
                                                    {"out", out_span},
                                                    {"lse", lse_span},
                                                    {"rotary_cos", cos_span},
                                                    {"rotary_sin", sin_span},
                                                    {"k_scale", k_scale_span},
                                                    {"v_scale", v_scale_span}};
  auto refuse_overlaps = [&](const char* name, const ByteSpan& span,
                             std::initializer_list<std::string_view> allowed) {
    for (const auto& [other, other_span] : spans) {
      const std::string_view other_name = other;
      const bool skipped = other_name == name ||
                           std::find(allowed.begin(), allowed.end(), other_name) != allowed.end();
      if (!skipped && span.overlaps(other_span)) {
        fail(caller, name, ": expected memory disjoint from ", other, ", got overlapping buffers");
      }
    }
  };
  refuse_overlaps("out", out_span, {});
  refuse_overlaps("lse", lse_span, {});
  // q is only read, but a cache overlapping it is a caller's mistake worth naming.
  refuse_overlaps("k_cache", k_cache_span, {"v_cache", "k_new", "v_new"});
  refuse_overlaps("v_cache", v_cache_span, {"k_cache", "k_new", "v_new"});
  // Read-only scales may be one buffer (a scale per tensor, shared); int8 appends write them.
  refuse_overlaps("k_scale", k_scale_span, {"v_scale"});
  refuse_overlaps("v_scale", v_scale_span, {"k_scale"});
  if (seqlen_new > 0) {
    // A shared cache is one buffer (and its scales another): only its k_new rows are written.
    if (values_in_keys) {
      refuse_overlaps("k_cache", k_cache_span, {"v_cache"});
      refuse_overlaps("v_cache", v_cache_span, {"k_cache"});
    } else {
      refuse_overlaps("k_cache", k_cache_span, {});
      refuse_overlaps("v_cache", v_cache_span, {});
    }
    if (cache_dtype == DType::int8 && values_in_keys) {
      refuse_overlaps("k_scale", k_scale_span, {"v_scale"});
      refuse_overlaps("v_scale", v_scale_span, {"k_scale"});
    } else if (cache_dtype == DType::int8) {
      refuse_overlaps("k_scale", k_scale_span, {});
      refuse_overlaps("v_scale", v_scale_span, {});
    }
    for (const auto& [name, view] : {std::pair{"k_cache", &cache.k}, {"v_cache", &cache.v}}) {
      if (self_overlapping(*view)) {
        fail(caller, name, ": expected strides that give every element its own address (rows ",
             "are appended), got strides ", shape_string(view->strides), " for shape ",
             shape_string(view->shape));
      }
    }
  }

  KVCacheParams params;
  AttentionParams& a = params.attention;
  a = checked_params(q, k_cache, v_cache, out, lse, options, scale, capacity);
  a.modifiers = checked_modifiers(caller, options, batch, heads_q,
                                  {{"out", out_span},
                                   {"lse", lse_span},
                                   {"k_cache", k_cache_span},
                                   {"v_cache", v_cache_span},
                                   {"k_scale", k_scale_span},
                                   {"v_scale", v_scale_span}},
                                  nullptr);
  if (paged) {
    a.block_table = cache.block_table;
    a.block_table_stride = cache.pages_per_sequence;
    a.page_size = page_size;
  }
  a.k_scale = k_scale;
  a.v_scale = v_scale;
  a.kv_batch_index = batch_index;
  a.kv_first_row = leftpad;
  params.kv_lengths = std::move(kv_lengths);
  a.kv_lengths = params.kv_lengths.data();
  params.cache_seqlens = cache_seqlens;
  params.k_new = new_kv.k.data;
  params.v_new = values_in_keys ? nullptr : new_kv.v.data;
  params.values_in_keys = values_in_keys;
  params.new_dtype = new_kv.k.dtype;
  params.k_new_strides = strides_of(new_kv.k.strides);
  params.v_new_strides = strides_of(new_kv.v.strides);
  params.seqlen_new = seqlen_new;
  params.k_cache = cache.k.data;
  params.v_cache = cache.v.data;
  if (rotating) params.rotary = rotary;
  params.q_positions_advance = q_positions_advance;
  return params;
}

AttentionParams make_paged_varlen_params(const char* caller, const ConstTensorView& q,
                                         const PagedKVView& kv, const std::int32_t* cu_seqlens_k,
                                         std::int64_t batch, const TensorView& out, float* lse,
                                         const AttentionOptions& options) {
  const ConstTensorView &k = kv.k, &v = kv.v;
  check_view(caller, "q", q);
  check_view(caller, "k", k, true);
  check_view(caller, "v", v, true);
  check_view(caller, "out", out);
  const bool quantized = is_quantized(k.dtype);
  if (quantized) {
    if (v.dtype != k.dtype) {
      fail(caller, "v: expected dtype ", dtype_name(k.dtype), " (as k), got ", dtype_name(v.dtype));
    }
    if (out.dtype != q.dtype) {
      fail(caller, "out: expected dtype ", dtype_name(q.dtype), " (as q), got ",
           dtype_name(out.dtype));
    }
  } else {
    check_dtypes_as_q(caller, q, k, v, out);
  }
  check_operand_shapes(caller, "k", "v", q, k, v, out);
  const std::int64_t num_pages = k.shape[0], page_size = k.shape[1];
  const std::int64_t capacity = paged_capacity(caller, "k", page_size, kv.pages_per_sequence);
  if (batch > 0 && kv.block_table == nullptr) {
    fail(caller, "block_table: expected int32 pages [batch, pages_per_sequence] = [", batch, ", ",
         kv.pages_per_sequence, "], got null");
  }
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t length = std::int64_t{cu_seqlens_k[b + 1]} - cu_seqlens_k[b];
    if (length > capacity) {
      fail(caller, "cu_seqlens_k[", b + 1, "] - cu_seqlens_k[", b, "]: expected at most ", capacity,
           " keys (pages_per_sequence ", kv.pages_per_sequence, " x page_size ", page_size,
           "), got ", length);
    }
    check_table_row(caller, kv.block_table, kv.pages_per_sequence, b,
                    (length + page_size - 1) / page_size, num_pages);
  }
  const float scale = checked_scale(caller, options, q.shape[3]);
  refuse_dropout(caller, options, "a paged varlen batch (serving)");
  const auto [out_span, lse_span] = checked_output_spans(caller, q, k, v, out, lse);
  // A quantized pool's scales, read only (the checks take a mutable view).
  const auto mutable_view = [](const ConstTensorView& view) {
    return TensorView{const_cast<void*>(view.data), view.dtype, view.shape, view.strides};
  };
  ScaleView k_scale, v_scale;
  if (quantized) {
    k_scale = checked_scales(caller, "k_scale", mutable_view(kv.k_scale), k, k.shape[3], false);
    v_scale = checked_scales(caller, "v_scale", mutable_view(kv.v_scale), v, v.shape[3], false);
    for (const auto& [name, view] : {std::pair{"k_scale", &kv.k_scale}, {"v_scale", &kv.v_scale}}) {
      const ByteSpan span = byte_span(caller, name, *view);
      if (span.overlaps(out_span) || span.overlaps(lse_span)) {
        fail(caller, name, ": expected memory disjoint from out and lse, got overlapping buffers");
      }
    }
  } else {
    for (const auto& [name, view] : {std::pair{"k_scale", &kv.k_scale}, {"v_scale", &kv.v_scale}}) {
      if (view->data != nullptr) {
        fail(caller, name, ": expected none for a ", dtype_name(k.dtype),
             " pool (scales belong to int8 and fp8 caches), got a ", shape_string(view->shape),
             " view");
      }
    }
  }

  AttentionParams params = checked_params(q, k, v, out, lse, options, scale, capacity);
  params.modifiers = checked_modifiers(caller, options, batch, params.heads_q,
                                       {{"out", out_span}, {"lse", lse_span}}, nullptr);
  params.block_table = kv.block_table;
  params.block_table_stride = kv.pages_per_sequence;
  params.page_size = page_size;
  params.k_scale = k_scale;
  params.v_scale = v_scale;
  return params;
}

QuantizeParams make_quantize_params(const char* caller, const ConstTensorView& values,
                                    const TensorView& cache, const TensorView& scales,
                                    int num_threads) {
  check_view(caller, "values", values);
  check_view(caller, "cache", cache, true);
  if (!is_quantized(cache.dtype)) {
    fail(caller, "cache: expected dtype int8, fp8_e4m3 or fp8_e5m2, got ", dtype_name(cache.dtype));
  }
  if (cache.shape != values.shape) {
    fail(caller, "cache: expected shape ", shape_string(values.shape), " (as values), got ",
         shape_string(cache.shape));
  }
  if (num_threads < 0) fail(caller, "num_threads: expected >= 0, got ", num_threads);
  const bool written = cache.dtype == DType::int8;
  const ScaleView scale_view =
      checked_scales(caller, "scales", scales, cache, values.shape[3], written);
  if (self_overlapping(cache)) {
    fail(caller, "cache: expected strides that give every element its own address, got strides ",
         shape_string(cache.strides), " for shape ", shape_string(cache.shape));
  }
  const ByteSpan values_span = byte_span(caller, "values", values);
  const ByteSpan cache_span = byte_span(caller, "cache", cache);
  const ByteSpan scales_span = byte_span(caller, "scales", scales);
  if (cache_span.overlaps(values_span)) {
    fail(caller, "cache: expected memory disjoint from values, got overlapping buffers");
  }
  if (scales_span.overlaps(values_span) || scales_span.overlaps(cache_span)) {
    fail(caller, "scales: expected memory disjoint from values and cache, got overlapping buffers");
  }
  QuantizeParams params;
  params.values = values.data;
  params.values_dtype = values.dtype;
  params.values_strides = strides_of(values.strides);
  params.cache = cache.data;
  params.dtype = cache.dtype;
  params.cache_strides = strides_of(cache.strides);
  params.scales = scale_view;
  params.batch = values.shape[0];
  params.seqlen = values.shape[1];
  params.heads = values.shape[2];
  params.head_dim = values.shape[3];
  params.num_threads = num_threads > 0 ? num_threads : omp_get_max_threads();
  return params;
}

MergeParams make_merge_params(const char* caller, const ConstTensorView& out_a, const float* lse_a,
                              const ConstTensorView& out_b, const float* lse_b,
                              const TensorView& out, float* lse, int num_threads) {
  check_view(caller, "out_a", out_a);
  check_view(caller, "out_b", out_b);
  check_view(caller, "out", out);
  for (const auto& [name, dtype] : {std::pair{"out_a", out_a.dtype}, {"out_b", out_b.dtype}}) {
    if (dtype != DType::f32) {
      fail(caller, name, ": expected dtype f32 (partial states are fp32), got ", dtype_name(dtype));
    }
  }
  for (const auto& [name, shape] : {std::pair{"out_b", out_b.shape}, {"out", out.shape}}) {
    if (shape != out_a.shape) {
      fail(caller, name, ": expected shape ", shape_string(out_a.shape), " (as out_a), got ",
           shape_string(shape));
    }
  }
  if (out_a.shape[3] == 0) fail(caller, "out_a: expected head_dim >= 1, got 0");
  if (num_threads < 0 || num_threads > kMaxThreads) {
    fail(caller, "num_threads: expected 0..", kMaxThreads, " (0 = all), got ", num_threads);
  }
  const std::int64_t batch = out_a.shape[0], seqlen = out_a.shape[1], heads = out_a.shape[2];
  // B·H·S <= numel(out_a), which byte_span bounds; only the 4-byte element can overflow.
  const ByteSpan a_span = byte_span(caller, "out_a", out_a);
  const ByteSpan b_span = byte_span(caller, "out_b", out_b);
  const ByteSpan out_span = byte_span(caller, "out", out);
  const std::int64_t rows = batch * heads * seqlen;
  std::int64_t lse_bytes = 0;
  if (__builtin_mul_overflow(rows, static_cast<std::int64_t>(sizeof(float)), &lse_bytes)) {
    fail(caller, "lse_a: ", rows, " fp32 values overflow a 64-bit byte count");
  }
  auto lse_span = [&](const char* name, const float* values) {
    if (values == nullptr) {
      if (rows > 0 && name != std::string_view("lse")) {
        fail(caller, name, ": expected the logsumexp [", batch, ", ", heads, ", ", seqlen,
             "], got null");
      }
      return ByteSpan{};
    }
    const auto begin = reinterpret_cast<std::uintptr_t>(values);
    std::uintptr_t end = 0;
    if (__builtin_add_overflow(begin, static_cast<std::uintptr_t>(lse_bytes), &end)) {
      fail(caller, name, ": ", lse_bytes, " bytes from address ", values,
           " wrap around the address space");
    }
    return ByteSpan{begin, end};
  };
  const ByteSpan lse_a_span = lse_span("lse_a", lse_a);
  const ByteSpan lse_b_span = lse_span("lse_b", lse_b);
  const ByteSpan merged_lse_span = lse_span("lse", lse);

  // Each output element depends only on the inputs at its own index, so an output may be one of
  // the inputs itself (the same view), and nothing else it overlaps.
  if (self_overlapping(out)) {
    fail(caller, "out: expected strides that give every element its own address, got strides ",
         shape_string(out.strides), " for shape ", shape_string(out.shape));
  }
  auto same_view = [&](const ConstTensorView& input) {
    return out.dtype == DType::f32 && out.data == input.data && out.strides == input.strides;
  };
  // Refuses `output` (its span) overlapping any of `inputs`, an input it may be itself passed as
  // an empty span.
  auto refuse_overlaps = [&](const char* output, const ByteSpan& span,
                             std::initializer_list<std::pair<const char*, ByteSpan>> inputs,
                             const char* allowed) {
    for (const auto& [name, input] : inputs) {
      if (span.overlaps(input)) {
        fail(caller, output, ": expected memory disjoint from ", name, " (or ", allowed,
             " itself), got overlapping buffers");
      }
    }
  };
  refuse_overlaps("out", out_span,
                  {{"out_a", same_view(out_a) ? ByteSpan{} : a_span},
                   {"out_b", same_view(out_b) ? ByteSpan{} : b_span},
                   {"lse_a", lse_a_span},
                   {"lse_b", lse_b_span},
                   {"lse", merged_lse_span}},
                  "out_a or out_b");
  refuse_overlaps("lse", merged_lse_span,
                  {{"lse_a", lse == lse_a ? ByteSpan{} : lse_a_span},
                   {"lse_b", lse == lse_b ? ByteSpan{} : lse_b_span},
                   {"out_a", a_span},
                   {"out_b", b_span}},
                  "lse_a or lse_b");

  return {.out_a = static_cast<const float*>(out_a.data),
          .out_b = static_cast<const float*>(out_b.data),
          .lse_a = lse_a,
          .lse_b = lse_b,
          .out = out.data,
          .lse = lse,
          .out_dtype = out.dtype,
          .batch = batch,
          .seqlen = seqlen,
          .heads = heads,
          .head_dim = out_a.shape[3],
          .a_strides = strides_of(out_a.strides),
          .b_strides = strides_of(out_b.strides),
          .out_strides = strides_of(out.strides),
          .num_threads = num_threads > 0 ? num_threads : omp_get_max_threads()};
}

}  // namespace detail

namespace {

// Σ_{i=0}^{n-1} clamp(i + c, 0, hi), exactly, for n >= 0 and hi >= 0.
__int128 clamped_ramp_sum(std::int64_t n, __int128 c, std::int64_t hi) {
  if (n == 0) return 0;
  const __int128 first = c, last = c + n - 1;
  __int128 sum = 0;
  const __int128 rising_begin = std::max<__int128>(first, 1);
  const __int128 rising_end = std::min<__int128>(last, hi - 1);  // values in (0, hi) count as is
  if (rising_begin <= rising_end) {
    sum += (rising_begin + rising_end) * (rising_end - rising_begin + 1) / 2;
  }
  const __int128 flat_begin = std::max<__int128>(first, hi);  // values >= hi count as hi
  if (flat_begin <= last) sum += (last - flat_begin + 1) * hi;
  return sum;
}

}  // namespace

// Row i sees keys [clamp(b(i)), clamp(e(i))) with b and e both i + constant (or unbounded) and
// e > b, so the count is Σ clamp(e(i)) - Σ clamp(b(i)): two clamped ramps, in closed form.
std::int64_t visible_pairs(std::int64_t seqlen_q, std::int64_t seqlen_kv,
                           const AttentionOptions& options) {
  constexpr const char* caller = "visible_pairs";
  if (seqlen_q < 0) detail::fail(caller, "seqlen_q: expected >= 0, got ", seqlen_q);
  if (seqlen_kv < 0) detail::fail(caller, "seqlen_kv: expected >= 0, got ", seqlen_kv);
  if (options.window_left < -1) {
    detail::fail(caller, "window_left: expected >= -1 (-1 = unbounded), got ", options.window_left);
  }
  if (options.window_right < -1) {
    detail::fail(caller, "window_right: expected >= -1 (-1 = unbounded), got ",
                 options.window_right);
  }
  const __int128 diagonal = static_cast<__int128>(seqlen_kv) - seqlen_q;  // of row 0
  __int128 ends = static_cast<__int128>(seqlen_q) * seqlen_kv;
  if (options.causal || options.window_right >= 0) {
    // The causal bound (diagonal + 1) is never looser than a right window (diagonal + R + 1).
    const std::int64_t right = options.causal ? 0 : options.window_right;
    ends = clamped_ramp_sum(seqlen_q, diagonal + right + 1, seqlen_kv);
  }
  __int128 begins = 0;
  if (options.window_left >= 0) {
    begins = clamped_ramp_sum(seqlen_q, diagonal - options.window_left, seqlen_kv);
  }
  const __int128 pairs = ends - begins;
  if (pairs > std::numeric_limits<std::int64_t>::max()) {
    detail::fail(caller, seqlen_q, " x ", seqlen_kv, " pairs overflow a 64-bit count");
  }
  return static_cast<std::int64_t>(pairs);
}

double attention_flops(std::int64_t batch, std::int64_t heads_q, std::int64_t seqlen_q,
                       std::int64_t seqlen_kv, std::int64_t head_dim,
                       const AttentionOptions& options) {
  return 4.0 * static_cast<double>(batch) * static_cast<double>(heads_q) *
         static_cast<double>(head_dim) *
         static_cast<double>(visible_pairs(seqlen_q, seqlen_kv, options));
}

}  // namespace flashattn
