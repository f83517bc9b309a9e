// What the libFuzzer targets of the attention API share: tensors in fuzzed memory layouts, the
// fuzzed values, sentinel-marked outputs and the unit roundoffs of the dtypes.
#pragma once

#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "api/params.hpp"
#include "flashattn/dtype.hpp"
#include "flashattn/flashattn.hpp"

namespace fuzz_support {

using flashattn::DType;
using Shape = std::array<std::int64_t, 4>;

constexpr double kU32 = 0x1p-24;
constexpr std::uint8_t kSentinelByte = 0xA5;  // fills every output before a call

struct Buffer {
  std::vector<std::uint8_t> bytes;  // exactly the extent of the view, so ASan sees overruns
  std::vector<bool> in_view;        // which elements the view covers (outputs only)
};

struct Tensor {
  Buffer buffer;
  Shape shape{}, strides{};
  std::int64_t elements = 0;  // extent of the view in elements

  std::int64_t offset(std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t d) const {
    return a * strides[0] + b * strides[1] + c * strides[2] + d * strides[3];
  }
};

// A [B, S, H, D] tensor laid out with its first three dims in `order` (outermost first), `pad`
// spare elements after each D-row and each of the three dims, and optionally dim `broadcast`
// given stride 0.
inline Tensor make_tensor(DType dtype, Shape shape, int order_index, std::array<int, 4> pad,
                          int broadcast) {
  static constexpr std::array<std::array<int, 3>, 6> kOrders = {
      {{0, 1, 2}, {0, 2, 1}, {1, 0, 2}, {1, 2, 0}, {2, 0, 1}, {2, 1, 0}}};
  const auto& order = kOrders[static_cast<std::size_t>(order_index)];
  Tensor t;
  t.shape = shape;
  t.strides[3] = 1;
  std::int64_t next = shape[3] + pad[3];
  for (int i = 2; i >= 0; --i) {
    const int dim = order[static_cast<std::size_t>(i)];
    t.strides[dim] = next;
    next = next * shape[dim] + pad[static_cast<std::size_t>(i)];
  }
  if (broadcast >= 0) t.strides[broadcast] = 0;
  bool empty = false;
  std::int64_t last = 0;
  for (int d = 0; d < 4; ++d) {
    empty = empty || shape[d] == 0;
    last += (shape[d] - 1) * t.strides[d];
  }
  t.elements = empty ? 0 : last + 1;
  t.buffer.bytes.assign(static_cast<std::size_t>(std::max<std::int64_t>(t.elements, 1)) *
                            flashattn::dtype_size(dtype),
                        kSentinelByte);
  return t;
}

// Reports what a target found about the call `description` and aborts, which makes libFuzzer
// keep the input.
[[noreturn]] inline void report_finding(const char* target, const std::string& description,
                                        const std::string& what) {
  std::fprintf(stderr, "%s: %s\n  call: %s\n", target, what.c_str(), description.c_str());
  std::abort();
}

// The path and dtype of a call, picked by the input.
inline flashattn::AttentionImpl fuzzed_impl(FuzzedDataProvider& in) {
  return in.PickValueInArray({flashattn::AttentionImpl::flash, flashattn::AttentionImpl::standard,
                              flashattn::AttentionImpl::reference});
}
inline DType fuzzed_dtype(FuzzedDataProvider& in) {
  return in.PickValueInArray({DType::f32, DType::f16, DType::bf16});
}

// A small problem shape picked by the input, at most `max_multiply_adds` of the forward's
// score products (batch · heads_q · seqlen_q · seqlen_kv · head_dim) so that the fuzzer stays
// fast under ASan: the head dim is halved first, then the longer sequence. v's and out's head
// dim (head_dim_v) is picked on its own, mostly head_dim's.
struct FuzzedShape {
  std::int64_t batch, seqlen_q, seqlen_kv, heads_kv, group, head_dim, head_dim_v;

  Shape q() const { return {batch, seqlen_q, heads_kv * group, head_dim}; }
  Shape kv() const { return {batch, seqlen_kv, heads_kv, head_dim}; }
  Shape v() const { return {batch, seqlen_kv, heads_kv, head_dim_v}; }
  Shape out() const { return {batch, seqlen_q, heads_kv * group, head_dim_v}; }
  std::int64_t lse_elements() const { return batch * heads_kv * group * seqlen_q; }
};

inline FuzzedShape fuzzed_shape(FuzzedDataProvider& in, std::int64_t max_multiply_adds) {
  const bool long_sequences = in.ConsumeIntegralInRange(0, 7) == 0;
  const std::int64_t max_seq = long_sequences ? 300 : 40;
  FuzzedShape s{};
  s.batch = in.ConsumeIntegralInRange(0, 2);
  s.seqlen_q = in.ConsumeIntegralInRange<std::int64_t>(0, max_seq);
  s.seqlen_kv = in.ConsumeIntegralInRange<std::int64_t>(0, max_seq);
  s.heads_kv = in.ConsumeIntegralInRange(1, 3);
  s.group = in.PickValueInArray({1, 1, 2, 3, 8});
  s.head_dim = in.PickValueInArray({1, 2, 3, 8, 16, 17, 32, 40, 64, 80});
  // 0: head_dim's (the first value is what an exhausted input picks).
  s.head_dim_v = in.PickValueInArray({0, 0, 0, 1, 5, 16, 24, 33});
  while (s.batch * s.heads_kv * s.group * s.seqlen_q * s.seqlen_kv * s.head_dim >
         max_multiply_adds) {
    if (s.head_dim > 1) {
      s.head_dim /= 2;
    } else if (s.seqlen_kv > s.seqlen_q) {
      s.seqlen_kv /= 2;
    } else {
      s.seqlen_q /= 2;
    }
  }
  if (s.head_dim_v == 0) s.head_dim_v = s.head_dim;
  return s;
}

// Options picked by the input: causal, windows, a scale of 2^-60 to 2^60, 0 (all) to 3 threads.
inline flashattn::AttentionOptions fuzzed_options(FuzzedDataProvider& in) {
  flashattn::AttentionOptions options;
  options.causal = in.ConsumeBool();
  if (in.ConsumeBool()) options.window_left = in.ConsumeIntegralInRange<std::int64_t>(-1, 50);
  if (in.ConsumeBool()) options.window_right = in.ConsumeIntegralInRange<std::int64_t>(-1, 50);
  if (in.ConsumeBool()) {
    options.softmax_scale =
        std::ldexp(in.PickValueInArray({1.0f, 1.5f, 1.25f}), in.ConsumeIntegralInRange(-60, 60));
  }
  options.num_threads = in.ConsumeIntegralInRange(0, 3);
  return options;
}

inline void describe_tensor(std::ostream& text, const char* name, const Tensor& t) {
  text << " " << name << " [" << t.shape[0] << "," << t.shape[1] << "," << t.shape[2] << ","
       << t.shape[3] << "] strides [" << t.strides[0] << "," << t.strides[1] << "," << t.strides[2]
       << "," << t.strides[3] << "]";
}

inline void describe_options(std::ostream& text, const flashattn::AttentionOptions& options) {
  text << " causal " << options.causal << " window (" << options.window_left << ", "
       << options.window_right << ") scale "
       << (options.softmax_scale ? *options.softmax_scale : 0.0f) << " threads "
       << options.num_threads;
}

// A layout picked by the input: dim order, padding, and for inputs sometimes a stride-0 dim.
inline Tensor fuzzed_layout(FuzzedDataProvider& in, DType dtype, const Shape& shape, bool input) {
  const int order = in.ConsumeIntegralInRange(0, 5);
  std::array<int, 4> pad{};
  if (in.ConsumeBool()) {
    for (int& extra : pad) extra = in.ConsumeIntegralInRange(0, 3);
  }
  const int broadcast =
      input && in.ConsumeIntegralInRange(0, 7) == 0 ? in.ConsumeIntegralInRange(0, 2) : -1;
  return make_tensor(dtype, shape, order, pad, broadcast);
}

template <class Fn>
void for_each_index(const Shape& s, Fn&& fn) {
  for (std::int64_t a = 0; a < s[0]; ++a)
    for (std::int64_t b = 0; b < s[1]; ++b)
      for (std::int64_t c = 0; c < s[2]; ++c)
        for (std::int64_t d = 0; d < s[3]; ++d) fn(a, b, c, d);
}

// Special values an input byte can stand for: the non-finite ones first.
inline constexpr float kSpecials[] = {std::numeric_limits<float>::quiet_NaN(),
                                      std::numeric_limits<float>::infinity(),
                                      -std::numeric_limits<float>::infinity(),
                                      std::numeric_limits<float>::denorm_min(),
                                      -0x1p-130f,
                                      0x1p-140f,
                                      -0.0f,
                                      0.0f};
inline constexpr int kNonFiniteSpecials = 3;

// One input value: mostly a small integer times 2^exponent, sometimes a special value (only the
// finite ones unless `non_finite`).
inline float value_from(std::uint8_t byte, int exponent, bool specials, bool non_finite) {
  if (specials && byte >= 0xF8) {
    const int index = byte - 0xF8;
    return kSpecials[non_finite || index >= kNonFiniteSpecials ? index : index + 3];
  }
  return std::ldexp(static_cast<float>(static_cast<std::int8_t>(byte)), exponent - 4);
}

inline void fill(Tensor& t, DType dtype, FuzzedDataProvider& in, int exponent, bool specials,
                 bool non_finite) {
  for_each_index(t.shape, [&](auto a, auto b, auto c, auto d) {
    store_f32(t.buffer.bytes.data(), dtype, t.offset(a, b, c, d),
              value_from(in.ConsumeIntegral<std::uint8_t>(), exponent, specials, non_finite));
  });
}

// Marks the elements of an output view, so that writes around it can be detected.
inline void mark_view(Tensor& t) {
  t.buffer.in_view.assign(static_cast<std::size_t>(std::max<std::int64_t>(t.elements, 1)), false);
  for_each_index(t.shape, [&](auto a, auto b, auto c, auto d) {
    t.buffer.in_view[static_cast<std::size_t>(t.offset(a, b, c, d))] = true;
  });
}

// The index of the first element around the view of t that no longer holds the sentinel, or -1.
inline std::int64_t written_around_view(const Tensor& t, DType dtype) {
  const std::size_t element = flashattn::dtype_size(dtype);
  for (std::size_t i = 0; i < t.buffer.in_view.size(); ++i) {
    if (t.buffer.in_view[i]) continue;
    for (std::size_t byte = 0; byte < element; ++byte) {
      if (t.buffer.bytes[i * element + byte] != kSentinelByte) return static_cast<std::int64_t>(i);
    }
  }
  return -1;
}

inline double half_smallest_denormal(DType dtype) {
  return dtype == DType::f32 ? 0x1p-150 : dtype == DType::f16 ? 0x1p-25 : 0x1p-134;
}

inline double unit_roundoff(DType dtype) {
  return std::ldexp(1.0, -flashattn::dtype_traits(dtype).significand_bits);
}

// The elements of a [batch, seq, heads, D] operand in fp64, contiguous.
inline std::vector<double> to_f64(const void* base, DType dtype,
                                  const flashattn::detail::Strides& strides, std::int64_t batch,
                                  std::int64_t seq, std::int64_t heads, std::int64_t D) {
  std::vector<double> result(static_cast<std::size_t>(batch * seq * heads * D));
  std::size_t i = 0;
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t s = 0; s < seq; ++s)
      for (std::int64_t h = 0; h < heads; ++h)
        for (std::int64_t d = 0; d < D; ++d)
          result[i++] = load_f32(base, dtype, strides.offset(b, s, h) + d);
  return result;
}

// |x| of the same, non-finite values as 0 (they are judged by kind, not by a bound).
inline std::vector<double> finite_magnitudes(const void* base, DType dtype,
                                             const flashattn::detail::Strides& strides,
                                             std::int64_t batch, std::int64_t seq,
                                             std::int64_t heads, std::int64_t D) {
  std::vector<double> result = to_f64(base, dtype, strides, batch, seq, heads, D);
  for (double& x : result) x = std::isfinite(x) ? std::abs(x) : 0.0;
  return result;
}

// An additive bias and a boolean mask (options.hpp) picked by the input, decoded after
// everything else so that older corpus inputs decode as before (both off). Each is on for a
// quarter of the inputs that reach it; one in eight of those is given a shape the API must
// refuse. The bias: [B|1, Hq|1, Sq, Skv] of f32, f16 or bf16 in a fuzzed layout (a stride-0
// dim included), small integers times 2^e, −inf for about one entry in sixteen when the input
// says so. The mask: the same shapes, contiguous, with a key stride of 2, or one row for all
// (row stride 0); each byte keeps its key with a fuzzed density.
struct FuzzedLogitViews {
  Tensor bias;
  DType bias_dtype = DType::f32;
  bool has_bias = false;
  std::vector<std::uint8_t> mask_bytes;
  Shape mask_shape{}, mask_strides{};
  bool has_mask = false;
  bool refused = false;

  void apply(flashattn::AttentionOptions& options) const {
    if (has_bias) {
      options.bias = {bias.buffer.bytes.data(), bias_dtype, bias.shape, bias.strides};
    }
    if (has_mask) {
      options.mask = {reinterpret_cast<const bool*>(mask_bytes.data()), mask_shape, mask_strides};
    }
  }

  void describe(std::ostream& text) const {
    text << " bias";
    if (has_bias) {
      text << " " << flashattn::dtype_name(bias_dtype) << " [" << bias.shape[0] << ", "
           << bias.shape[1] << ", " << bias.shape[2] << ", " << bias.shape[3] << "] strides ["
           << bias.strides[0] << ", " << bias.strides[1] << ", " << bias.strides[2] << ", "
           << bias.strides[3] << "]";
    } else {
      text << " none";
    }
    text << " mask";
    if (has_mask) {
      text << " [" << mask_shape[0] << ", " << mask_shape[1] << ", " << mask_shape[2] << ", "
           << mask_shape[3] << "] strides [" << mask_strides[0] << ", " << mask_strides[1] << ", "
           << mask_strides[2] << ", " << mask_strides[3] << "]";
    } else {
      text << " none";
    }
    if (refused) text << " (refused shape)";
  }
};

inline FuzzedLogitViews fuzzed_logit_views(FuzzedDataProvider& in, const FuzzedShape& shape) {
  FuzzedLogitViews views;
  const std::int64_t heads_q = shape.heads_kv * shape.group;
  // [B | 1, Hq | 1, Sq, Skv], or for a refused one a dim the API does not accept.
  auto logit_shape = [&](bool refused) -> Shape {
    Shape dims{in.ConsumeBool() ? shape.batch : 1, in.ConsumeBool() ? heads_q : 1, shape.seqlen_q,
               shape.seqlen_kv};
    if (refused) {
      switch (in.ConsumeIntegralInRange(0, 2)) {
        case 0:
          dims[2] += 1;
          break;
        case 1:
          dims[3] += 1;
          break;
        default:
          dims[1] = heads_q + 1;
          break;
      }
    }
    return dims;
  };
  if (in.ConsumeIntegralInRange(0, 3) == 0) {
    const bool refused = in.ConsumeIntegralInRange(0, 7) == 0;
    views.has_bias = true;
    views.refused = views.refused || refused;
    views.bias_dtype = fuzzed_dtype(in);
    views.bias = fuzzed_layout(in, views.bias_dtype, logit_shape(refused), true);
    const int exponent = in.ConsumeIntegralInRange(-8, 6);
    const bool minus_infinity = in.ConsumeBool();
    for_each_index(views.bias.shape, [&](auto a, auto b, auto c, auto d) {
      const std::uint8_t byte = in.ConsumeIntegral<std::uint8_t>();
      const float value = minus_infinity && byte < 16 ? -std::numeric_limits<float>::infinity()
                                                      : value_from(byte, exponent, false, false);
      store_f32(views.bias.buffer.bytes.data(), views.bias_dtype, views.bias.offset(a, b, c, d),
                value);
    });
  }
  if (in.ConsumeIntegralInRange(0, 3) == 0) {
    const bool refused = in.ConsumeIntegralInRange(0, 7) == 0;
    views.has_mask = true;
    views.refused = views.refused || refused;
    views.mask_shape = logit_shape(refused);
    const Shape& dims = views.mask_shape;
    const int layout = in.ConsumeIntegralInRange(0, 2);
    const std::int64_t key_stride = layout == 1 ? 2 : 1;
    views.mask_strides = {dims[1] * dims[2] * dims[3] * key_stride, dims[2] * dims[3] * key_stride,
                          layout == 2 ? 0 : dims[3] * key_stride, key_stride};
    bool empty = false;
    std::int64_t extent = 1;
    for (int d = 0; d < 4; ++d) {
      empty = empty || dims[d] == 0;
      extent += (dims[d] - 1) * views.mask_strides[d];
    }
    views.mask_bytes.assign(static_cast<std::size_t>(empty ? 1 : extent), 0);
    const int density = in.ConsumeIntegralInRange(0, 4);  // keeps density / 4 of the keys
    for_each_index(dims, [&](auto a, auto b, auto c, auto d) {
      const std::int64_t at = a * views.mask_strides[0] + b * views.mask_strides[1] +
                              c * views.mask_strides[2] + d * views.mask_strides[3];
      views.mask_bytes[static_cast<std::size_t>(at)] =
          in.ConsumeIntegralInRange(0, 3) < density ? 1 : 0;
    });
  }
  return views;
}

}  // namespace fuzz_support
