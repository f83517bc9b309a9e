// libFuzzer target: kvcache_attention_forward (flashattn/kvcache.hpp). The input bytes choose
// the path, the (q, cache, new rows) dtypes, a ragged batch (each sequence's cached length), the
// rows to append, the page size and the order of the pages, each tensor's memory layout, the
// options, the data (NaN, ±inf and denormals included), for one input in four a rotary table
// (KVCacheOptions) and, for one input in eight, a corruption that makes the call invalid (a
// rotary table too short or of odd width, a cache_leftpad or cache_batch_idx out of range, scales
// of the wrong shape among them). One input in four uses a quantized cache (int8, fp8_e4m3,
// fp8_e5m2: random codes, NaN codes included, and scales per row or per group, NaN, 0 and
// infinity among them), whose new rows are quantized in place.
//
// Every call runs twice, on a dense cache and on a paged cache holding the same rows. Invalid
// calls must raise flashattn::Error and leave out, lse and both caches untouched. Valid calls
// must not throw, and:
//  * dense and paged give the same out and lse bit for bit;
//  * each cache afterwards is its old bytes with the new rows, rounded to the cache's dtype
//    (the keys rotated first, in fp64, when a rotary table is given), at each sequence's cached
//    length, and nothing else changed (padding and spare pages too); a quantized cache's new
//    rows are util/quantize.hpp's quantize_row of them, with their int8 scales;
//  * nothing around out's view is written;
//  * a row that sees no key has out 0 and lse −inf; a finite output lies within the values
//    its row sees: |out| <= Vmax·(1 + (2·L + 16)·u + u_p + u_out) + floor, Vmax the largest
//    |v| (a quantized cache's code · scale) among the row's visible keys (the softmax weights are a
//    convex combination, up to the roundings of their sum, of P to a 16-bit q's dtype (u_p) and of
//    the output (u_out)).
// The value head dim (head_dim_v) is picked on its own, mostly head_dim's. Where it is at most
// head_dim, for an unquantized cache without a rotary table, one valid input in two also runs
// the dense call on a shared cache (MLA's: V a view of K's first head_dim_v dims, k_new appended
// alone), which must give the out and lse of the same call with those dims in a V cache of their
// own, and leave the cache as the appended K.
// The accuracy against the fp64 reference is fuzz_attention's and tests/test_kvcache.cpp's.

#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "flashattn/flashattn.hpp"
#include "fuzz_support.hpp"
#include "util/quantize.hpp"

namespace {

using flashattn::AttentionImpl;
using flashattn::DType;
using namespace fuzz_support;

struct Problem {
  AttentionImpl impl = AttentionImpl::flash;
  DType q_dtype = DType::f32, cache_dtype = DType::f32, new_dtype = DType::f32;
  std::int64_t batch = 0, seqlen_q = 0, seqlen_new = 0, heads_kv = 1, group = 1, head_dim = 1;
  std::int64_t head_dim_v = 1;  // v's and out's
  std::int64_t capacity = 0, page_size = 1, pages_per_sequence = 0, num_pages = 0;
  std::vector<std::int32_t> cached;  // cache_seqlens
  std::vector<std::int32_t> block_table;
  Tensor q, out, k_new, v_new, dense_k, dense_v, paged_k, paged_v;
  // A quantized cache's scales [.., .., Hkv, groups] beside each cache; empty otherwise.
  Tensor dense_k_scale, dense_v_scale, paged_k_scale, paged_v_scale;
  std::int64_t groups = 1;
  bool quantized() const { return flashattn::is_quantized(cache_dtype); }
  std::vector<std::uint8_t> lse_bytes;  // empty: lse = nullptr
  flashattn::AttentionOptions options;
  std::vector<float> cos, sin;                   // [positions, rotary_dim / 2], or empty: no rotary
  std::vector<std::int32_t> leftpad, batch_idx;  // for the corruptions
  flashattn::KVCacheOptions cache_options;
  std::string description;

  std::int64_t heads_q() const { return heads_kv * group; }
  std::int64_t length(std::int64_t b) const { return cached[b] + seqlen_new; }
  float* lse() { return lse_bytes.empty() ? nullptr : reinterpret_cast<float*>(lse_bytes.data()); }
  // Sequence b's key j in the paged cache: (page, row in page).
  std::pair<std::int64_t, std::int64_t> page_row(std::int64_t b, std::int64_t j) const {
    return {block_table[b * pages_per_sequence + j / page_size], j % page_size};
  }
};

[[noreturn]] void finding(const Problem& p, const std::string& what) {
  report_finding("fuzz_kvcache", p.description, what);
}

template <class T>
T* bytes_of(Tensor& t) {
  return reinterpret_cast<T*>(t.buffer.bytes.data());
}

Problem make_problem(FuzzedDataProvider& in) {
  Problem p;
  p.impl = fuzzed_impl(in);
  // The supported (q, cache) pairs.
  constexpr std::array<std::pair<DType, DType>, 5> kPairs = {{{DType::f32, DType::f32},
                                                              {DType::f16, DType::f16},
                                                              {DType::bf16, DType::bf16},
                                                              {DType::f32, DType::f16},
                                                              {DType::f32, DType::bf16}}};
  std::tie(p.q_dtype, p.cache_dtype) = kPairs[in.ConsumeIntegralInRange<std::size_t>(0, 4)];
  p.new_dtype = in.ConsumeBool() ? p.cache_dtype : p.q_dtype;
  if (in.ConsumeIntegralInRange(0, 3) == 0) {
    // A quantized cache under any q; new rows of any compute dtype.
    p.cache_dtype = in.PickValueInArray({DType::int8, DType::fp8_e4m3, DType::fp8_e5m2});
    p.q_dtype = in.PickValueInArray({DType::f32, DType::f16, DType::bf16});
    p.new_dtype = in.PickValueInArray({DType::f32, DType::f16, DType::bf16});
  }
  p.batch = in.ConsumeIntegralInRange(0, 3);
  const bool prefill = in.ConsumeIntegralInRange(0, 7) == 0;
  p.seqlen_q = in.ConsumeIntegralInRange<std::int64_t>(0, prefill ? 40 : 4);
  p.seqlen_new = in.ConsumeIntegralInRange<std::int64_t>(0, prefill ? 40 : 4);
  p.heads_kv = in.ConsumeIntegralInRange(1, 3);
  p.group = in.PickValueInArray({1, 2, 4, 8});
  p.head_dim = in.PickValueInArray({1, 3, 8, 16, 17, 32, 40, 64});
  // v's head dim: mostly head_dim's (0, what an exhausted input picks).
  p.head_dim_v = in.PickValueInArray({0, 0, 0, 1, 6, 24});
  const std::int64_t max_cached = in.ConsumeIntegralInRange(0, 7) == 0 ? 300 : 50;
  // At most 2^17 score products per call, so that the fuzzer stays fast under ASan: the head
  // dim is halved first, then the query rows.
  while (p.batch * p.heads_q() * p.seqlen_q * (max_cached + p.seqlen_new) * p.head_dim >
         (1 << 17)) {
    if (p.head_dim > 1) {
      p.head_dim /= 2;
    } else {
      p.seqlen_q /= 2;
    }
  }
  if (p.head_dim_v == 0) p.head_dim_v = p.head_dim;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    p.cached.push_back(
        static_cast<std::int32_t>(in.ConsumeIntegralInRange<std::int64_t>(0, max_cached)));
  }
  const std::int64_t longest =
      p.cached.empty() ? 0 : *std::max_element(p.cached.begin(), p.cached.end());
  p.capacity = longest + p.seqlen_new + in.ConsumeIntegralInRange(0, 5);
  p.page_size = in.PickValueInArray({1, 2, 3, 5, 7, 16});
  p.pages_per_sequence = (p.capacity + p.page_size - 1) / p.page_size;
  p.num_pages = p.batch * p.pages_per_sequence + in.ConsumeIntegralInRange(0, 2);
  // The pages in an order the input picks (Fisher-Yates), the spare ones last.
  std::vector<std::int32_t> pages(static_cast<std::size_t>(p.num_pages));
  std::iota(pages.begin(), pages.end(), 0);
  for (std::size_t i = pages.size(); i > 1; --i) {
    std::swap(pages[i - 1], pages[in.ConsumeIntegralInRange<std::size_t>(0, i - 1)]);
  }
  p.block_table.assign(pages.begin(), pages.begin() + p.batch * p.pages_per_sequence);
  // The table's pointer says "paged", also for an empty batch.
  p.block_table.reserve(1);

  const Shape q_shape{p.batch, p.seqlen_q, p.heads_q(), p.head_dim};
  const Shape new_shape{p.batch, p.seqlen_new, p.heads_kv, p.head_dim};
  p.q = fuzzed_layout(in, p.q_dtype, q_shape, true);
  p.out = fuzzed_layout(in, p.q_dtype, {p.batch, p.seqlen_q, p.heads_q(), p.head_dim_v}, false);
  mark_view(p.out);
  p.k_new = fuzzed_layout(in, p.new_dtype, new_shape, true);
  p.v_new = fuzzed_layout(in, p.new_dtype, {p.batch, p.seqlen_new, p.heads_kv, p.head_dim_v}, true);
  // The caches are written: no stride-0 dims.
  p.dense_k =
      fuzzed_layout(in, p.cache_dtype, {p.batch, p.capacity, p.heads_kv, p.head_dim}, false);
  p.dense_v =
      fuzzed_layout(in, p.cache_dtype, {p.batch, p.capacity, p.heads_kv, p.head_dim_v}, false);
  p.paged_k =
      fuzzed_layout(in, p.cache_dtype, {p.num_pages, p.page_size, p.heads_kv, p.head_dim}, false);
  p.paged_v =
      fuzzed_layout(in, p.cache_dtype, {p.num_pages, p.page_size, p.heads_kv, p.head_dim_v}, false);
  if (p.quantized()) {
    p.groups = p.head_dim % 2 == 0 && p.head_dim_v % 2 == 0 && in.ConsumeBool() ? 2 : 1;
    const Shape dense_scales{p.batch, p.capacity, p.heads_kv, p.groups};
    const Shape paged_scales{p.num_pages, p.page_size, p.heads_kv, p.groups};
    p.dense_k_scale = fuzzed_layout(in, DType::f32, dense_scales, false);
    p.dense_v_scale = fuzzed_layout(in, DType::f32, dense_scales, false);
    p.paged_k_scale = fuzzed_layout(in, DType::f32, paged_scales, false);
    p.paged_v_scale = fuzzed_layout(in, DType::f32, paged_scales, false);
  }
  if (in.ConsumeBool()) {
    p.lse_bytes.assign(
        static_cast<std::size_t>(std::max<std::int64_t>(p.batch * p.heads_q() * p.seqlen_q, 1)) * 4,
        kSentinelByte);
  }
  p.options = fuzzed_options(in);

  const bool specials = in.ConsumeIntegralInRange(0, 3) == 0;
  fill(p.q, p.q_dtype, in, in.ConsumeIntegralInRange(-12, 12), specials, true);
  const int k_exponent = in.ConsumeIntegralInRange(-12, 12);
  const int v_exponent = in.ConsumeIntegralInRange(-12, 12);
  fill(p.k_new, p.new_dtype, in, k_exponent, specials, true);
  fill(p.v_new, p.new_dtype, in, v_exponent, specials, true);
  // The same rows in both caches: a quantized cache's codes are the input's bytes, its scales
  // |values| of the input.
  // Dims past one cache's head dim belong to the other only.
  const std::int64_t widest = std::max(p.head_dim, p.head_dim_v);
  for_each_index({p.batch, p.capacity, p.heads_kv, widest}, [&](auto b, auto j, auto h, auto d) {
    const auto [page, row] = p.page_row(b, j);
    if (p.quantized()) {
      for (auto [dense, paged] : {std::pair{&p.dense_k, &p.paged_k}, {&p.dense_v, &p.paged_v}}) {
        if (d >= dense->shape[3]) continue;
        const std::uint8_t code = in.ConsumeIntegral<std::uint8_t>();
        dense->buffer.bytes[static_cast<std::size_t>(dense->offset(b, j, h, d))] = code;
        paged->buffer.bytes[static_cast<std::size_t>(paged->offset(page, row, h, d))] = code;
      }
      if (d < p.groups) {
        for (auto [dense, paged, exponent] :
             {std::tuple{&p.dense_k_scale, &p.paged_k_scale, k_exponent - 6},
              {&p.dense_v_scale, &p.paged_v_scale, v_exponent - 6}}) {
          const float scale =
              std::abs(value_from(in.ConsumeIntegral<std::uint8_t>(), exponent, specials, true));
          store_f32(dense->buffer.bytes.data(), DType::f32, dense->offset(b, j, h, d), scale);
          store_f32(paged->buffer.bytes.data(), DType::f32, paged->offset(page, row, h, d), scale);
        }
      }
      return;
    }
    if (d < p.head_dim) {
      const float k = value_from(in.ConsumeIntegral<std::uint8_t>(), k_exponent, specials, true);
      store_f32(p.dense_k.buffer.bytes.data(), p.cache_dtype, p.dense_k.offset(b, j, h, d), k);
      store_f32(p.paged_k.buffer.bytes.data(), p.cache_dtype, p.paged_k.offset(page, row, h, d), k);
    }
    if (d < p.head_dim_v) {
      const float v = value_from(in.ConsumeIntegral<std::uint8_t>(), v_exponent, specials, true);
      store_f32(p.dense_v.buffer.bytes.data(), p.cache_dtype, p.dense_v.offset(b, j, h, d), v);
      store_f32(p.paged_v.buffer.bytes.data(), p.cache_dtype, p.paged_v.offset(page, row, h, d), v);
    }
  });

  // A rotary table for one input in four: every position the call rotates at and a few more.
  if (p.head_dim >= 2 && in.ConsumeIntegralInRange(0, 3) == 0) {
    const std::int64_t rotary_dim = 2 * in.ConsumeIntegralInRange<std::int64_t>(1, p.head_dim / 2);
    const bool advance =
        p.options.causal || p.options.window_left >= 0 || p.options.window_right >= 0;
    const std::int64_t rows = std::max(p.seqlen_new, advance ? p.seqlen_q : 1);
    const std::int64_t positions = longest + rows + in.ConsumeIntegralInRange(0, 3);
    for (std::int64_t i = 0; i < positions * rotary_dim / 2; ++i) {
      const double angle = in.ConsumeIntegral<std::uint8_t>() * (2.0 * M_PI / 256.0);
      p.cos.push_back(static_cast<float>(std::cos(angle)));
      p.sin.push_back(static_cast<float>(std::sin(angle)));
    }
    p.cache_options.rotary = {p.cos.data(), p.sin.data(), positions, rotary_dim, in.ConsumeBool()};
  }

  std::ostringstream text;
  text << flashattn::impl_name(p.impl) << " q " << flashattn::dtype_name(p.q_dtype) << " cache "
       << flashattn::dtype_name(p.cache_dtype) << " new " << flashattn::dtype_name(p.new_dtype)
       << " cached [";
  for (const auto length : p.cached) text << length << " ";
  text << "] new " << p.seqlen_new << " capacity " << p.capacity << " page " << p.page_size
       << " pages " << p.num_pages;
  describe_tensor(text, "q", p.q);
  describe_tensor(text, "out", p.out);
  describe_tensor(text, "dense_k", p.dense_k);
  describe_tensor(text, "paged_k", p.paged_k);
  describe_tensor(text, "paged_v", p.paged_v);
  describe_options(text, p.options);
  text << " lse " << !p.lse_bytes.empty() << " specials " << specials;
  if (p.quantized()) text << " scale groups " << p.groups;
  if (!p.cos.empty()) {
    text << " rotary positions " << p.cache_options.rotary.positions << " dim "
         << p.cache_options.rotary.rotary_dim << " interleaved "
         << p.cache_options.rotary.interleaved;
  }
  p.description = text.str();
  return p;
}

// The arguments of one call, which a corruption may change.
struct Call {
  flashattn::ConstTensorView q;
  flashattn::KVCacheView cache;
  const std::int32_t* cache_seqlens;
  flashattn::NewKeysValues new_kv;
  flashattn::KVCacheOptions cache_options;
  flashattn::TensorView out;
  float* lse;
};

Call make_call(Problem& p, bool paged) {
  auto view = [](Tensor& t, DType dtype) {
    return flashattn::TensorView{t.buffer.bytes.data(), dtype, t.shape, t.strides};
  };
  Call call;
  call.q = view(p.q, p.q_dtype);
  call.cache =
      paged
          ? flashattn::KVCacheView{view(p.paged_k, p.cache_dtype), view(p.paged_v, p.cache_dtype),
                                   p.block_table.data(), p.pages_per_sequence}
          : flashattn::KVCacheView{view(p.dense_k, p.cache_dtype), view(p.dense_v, p.cache_dtype)};
  if (p.quantized()) {
    call.cache.k_scale = view(paged ? p.paged_k_scale : p.dense_k_scale, DType::f32);
    call.cache.v_scale = view(paged ? p.paged_v_scale : p.dense_v_scale, DType::f32);
  }
  call.cache_seqlens = p.cached.data();
  // Passed even with Snew = 0: a [B, 0, Hkv, D] append is valid and appends nothing.
  call.new_kv = {view(p.k_new, p.new_dtype), view(p.v_new, p.new_dtype)};
  call.cache_options = p.cache_options;
  call.out = view(p.out, p.q_dtype);
  call.lse = p.lse();
  return call;
}

// Turns the call invalid; false when this corruption cannot apply to this problem. `paged`
// says which cache the call uses.
bool corrupt(Problem& p, int kind, Call& call, bool& paged) {
  const bool has_output = p.batch * p.heads_q() * p.seqlen_q * p.head_dim_v > 0;
  switch (kind) {
    case 0:
      if (p.batch == 0) return false;
      p.cached[0] = -1;
      return true;
    case 1: {
      // One row past the capacity of the cache the call uses: a paged cache's is whole pages.
      if (p.batch == 0) return false;
      const std::int64_t capacity = paged ? p.pages_per_sequence * p.page_size : p.capacity;
      p.cached[p.batch - 1] = static_cast<std::int32_t>(capacity - p.seqlen_new + 1);
      return true;
    }
    case 2: {
      // A page that a sequence reads, out of range.
      for (std::int64_t b = 0; b < p.batch; ++b) {
        if (p.length(b) == 0) continue;
        paged = true;
        call = make_call(p, true);
        p.block_table[b * p.pages_per_sequence] =
            static_cast<std::int32_t>(p.cached[0] % 2 ? -1 : p.num_pages);
        return true;
      }
      return false;
    }
    case 3: {
      // Two sequences appending into the same page.
      if (p.batch < 2 || p.seqlen_new == 0) return false;
      paged = true;
      call = make_call(p, true);
      const auto page = [&](std::int64_t b) {
        return &p.block_table[b * p.pages_per_sequence + p.cached[b] / p.page_size];
      };
      *page(1) = *page(0);
      return true;
    }
    case 4:
      if (p.q_dtype == DType::f32 || p.quantized()) return false;
      call.cache.k.dtype = call.cache.v.dtype = p.q_dtype == DType::f16 ? DType::bf16 : DType::f16;
      return true;
    case 5:
      call.new_kv.k.shape[2] += 1;
      call.new_kv.v.shape[2] += 1;
      return true;
    case 6:
      if (!has_output) return false;
      call.out.data = call.cache.v.data;
      return (paged ? p.paged_v : p.dense_v).elements > 0;
    case 7:
      if (!has_output || call.lse == nullptr) return false;
      call.lse = static_cast<float*>(call.out.data);
      return true;
    case 8:
      paged = true;
      call = make_call(p, true);
      call.cache.k.shape[1] = call.cache.v.shape[1] = 0;
      return true;
    case 9:
      call.q.shape[2] = call.out.shape[2] = p.heads_kv * p.group + 1;
      return p.heads_kv > 1;  // Hq + 1 is then no multiple of Hkv
    case 10:
      if (p.batch == 0) return false;
      call.cache_seqlens = nullptr;
      return true;
    case 11: {
      // A rotary table one position short: the rule of kvcache.hpp for the rows q rotates at.
      if (p.cos.empty() || p.batch == 0) return false;
      const std::int64_t capacity = paged ? p.pages_per_sequence * p.page_size : p.capacity;
      const auto side = [&](std::int64_t w) { return w >= 0 && w < capacity; };
      const bool advance =
          p.options.causal || side(p.options.window_left) || side(p.options.window_right);
      const std::int64_t q_rows = p.seqlen_q == 0 ? 0 : (advance ? p.seqlen_q : 1);
      const std::int64_t rows = std::max(p.seqlen_new, q_rows);
      if (rows == 0) return false;
      call.cache_options.rotary.positions =
          *std::max_element(p.cached.begin(), p.cached.end()) + rows - 1;
      return true;
    }
    case 12:
      if (p.cos.empty()) return false;
      call.cache_options.rotary.rotary_dim += 1;
      return true;
    case 13:
      // A sequence whose keys would start past its end.
      if (p.batch == 0) return false;
      paged = false;
      call = make_call(p, false);
      p.leftpad.assign(static_cast<std::size_t>(p.batch), 0);
      p.leftpad[p.batch - 1] = p.cached[p.batch - 1] + 1;
      call.cache_options.cache_leftpad = p.leftpad.data();
      return true;
    case 14:
      // A batch index out of the cache's rows.
      if (p.batch == 0) return false;
      paged = false;
      call = make_call(p, false);
      p.batch_idx.resize(static_cast<std::size_t>(p.batch));
      std::iota(p.batch_idx.begin(), p.batch_idx.end(), 0);
      p.batch_idx[0] = static_cast<std::int32_t>(p.cached[0] % 2 ? -1 : p.batch);
      call.cache_options.cache_batch_idx = p.batch_idx.data();
      return true;
    case 15:
      // Scales that do not fit the cache, or scales for a cache that takes none.
      if (p.quantized()) {
        call.cache.v_scale.shape[3] = p.head_dim_v + 1;
      } else {
        call.cache.k_scale = call.cache.k;
        call.cache.k_scale.dtype = DType::f32;
      }
      return true;
    default:
      return false;
  }
}

// Value d of new row (b, i, h) as the cache receives it: rotated at position cached + i when
// `rotate` (kvcache.hpp's rotation, in fp64), else as given.
double new_value(const Problem& p, const Tensor& rows, bool rotate, std::int64_t b, std::int64_t i,
                 std::int64_t h, std::int64_t d) {
  const auto load = [&](std::int64_t dim) {
    return static_cast<double>(
        load_f32(rows.buffer.bytes.data(), p.new_dtype, rows.offset(b, i, h, dim)));
  };
  const flashattn::RotaryEmbedding& r = p.cache_options.rotary;
  if (!rotate || d >= r.rotary_dim) return load(d);
  const std::int64_t half = r.rotary_dim / 2, pair = r.interleaved ? d / 2 : d % half;
  const bool first = r.interleaved ? d % 2 == 0 : d < half;
  const std::int64_t partner =
      r.interleaved ? (first ? d + 1 : d - 1) : (first ? d + half : d - half);
  const double c = r.cos[(p.cached[b] + i) * half + pair];
  const double s = r.sin[(p.cached[b] + i) * half + pair];
  return first ? load(d) * c - load(partner) * s : load(d) * c + load(partner) * s;
}

// What a valid call leaves in a cache: its old bytes with the new rows written in at each
// sequence's cached length (through `row_of` for a paged cache).
template <class RowOf>
std::vector<std::uint8_t> appended(const Problem& p, const Tensor& cache, const Tensor& rows,
                                   bool rotate, RowOf&& row_of) {
  std::vector<std::uint8_t> bytes = cache.buffer.bytes;
  if (p.quantized()) return bytes;  // quantized_appended
  for_each_index({p.batch, p.seqlen_new, p.heads_kv, rows.shape[3]},
                 [&](auto b, auto i, auto h, auto d) {
                   const auto [outer, row] = row_of(b, p.cached[b] + i);
                   store_f32(bytes.data(), p.cache_dtype, cache.offset(outer, row, h, d),
                             static_cast<float>(new_value(p, rows, rotate, b, i, h, d)));
                 });
  return bytes;
}

// A quantized cache's codes and scales after a valid call: the new rows (rotated as `appended`
// does) quantized by util/quantize.hpp's definition at each sequence's cached length.
template <class RowOf>
std::pair<std::vector<std::uint8_t>, std::vector<std::uint8_t>> quantized_appended(
    const Problem& p, const Tensor& cache, const Tensor& scales, const Tensor& rows, bool rotate,
    RowOf&& row_of) {
  std::vector<std::uint8_t> codes = cache.buffer.bytes, scale_bytes = scales.buffer.bytes;
  const std::int64_t dims = rows.shape[3];
  std::vector<float> row(static_cast<std::size_t>(dims));
  for_each_index({p.batch, p.seqlen_new, p.heads_kv, 1}, [&](auto b, auto i, auto h, auto) {
    const auto [outer, key] = row_of(b, p.cached[b] + i);
    for (std::int64_t d = 0; d < dims; ++d) {
      row[static_cast<std::size_t>(d)] = static_cast<float>(new_value(p, rows, rotate, b, i, h, d));
    }
    auto* scale_data = reinterpret_cast<float*>(scale_bytes.data());
    flashattn::detail::quantize_row(codes.data(), p.cache_dtype, cache.offset(outer, key, h, 0),
                                    row.data(), scale_data + scales.offset(outer, key, h, 0),
                                    scales.strides[3], dims / p.groups, dims);
  });
  return {codes, scale_bytes};
}

// Value d of row (b, j, h) of the dense V cache as the call reads it: a quantized cache's
// code · scale.
double dense_value(const Problem& p, std::int64_t b, std::int64_t j, std::int64_t h,
                   std::int64_t d) {
  const double code =
      load_f32(p.dense_v.buffer.bytes.data(), p.cache_dtype, p.dense_v.offset(b, j, h, d));
  if (!p.quantized()) return code;
  return code * load_f32(p.dense_v_scale.buffer.bytes.data(), DType::f32,
                         p.dense_v_scale.offset(b, j, h, d / (p.head_dim_v / p.groups)));
}

// Rows that see no key, and the hull bound on the others, against the dense cache as it is
// after the call.
__attribute__((no_sanitize("coverage"))) void check_bounds(Problem& p) {
  const float* lse = p.lse();
  const double u = kU32, u_out = unit_roundoff(p.q_dtype);
  const double u_p = p.impl == AttentionImpl::reference || p.q_dtype == DType::f32
                         ? 0.0
                         : unit_roundoff(p.q_dtype);
  flashattn::detail::AttentionParams mask;
  mask.seqlen_q = p.seqlen_q;
  mask.causal = p.options.causal;
  mask.window_left = p.options.window_left;
  mask.window_right = p.options.window_right;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const std::int64_t L = p.length(b);
    for (std::int64_t h = 0; h < p.heads_q(); ++h) {
      const std::int64_t h_kv = h / p.group;
      for (std::int64_t row = 0; row < p.seqlen_q; ++row) {
        const flashattn::detail::KeyRange keys = mask.key_range_for_length(row, L);
        double v_max = 0.0;
        bool finite = true;
        for (std::int64_t j = keys.begin; j < keys.end; ++j) {
          for (std::int64_t d = 0; d < p.head_dim_v; ++d) {
            const double v = dense_value(p, b, j, h_kv, d);
            finite = finite && std::isfinite(v);
            v_max = std::max(v_max, std::abs(v));
          }
        }
        const double bound =
            v_max * (1.0 + static_cast<double>(2 * L + 16) * u + u_p + u_out) +
            static_cast<double>(L + std::max(p.head_dim, p.head_dim_v) + 16) * 0x1p-126;
        for (std::int64_t d = 0; d < p.head_dim_v; ++d) {
          const double got =
              load_f32(p.out.buffer.bytes.data(), p.q_dtype, p.out.offset(b, row, h, d));
          std::ostringstream where;
          where << "out[b=" << b << ", row=" << row << ", h=" << h << ", d=" << d << "] = " << got;
          if (keys.empty() && got != 0.0) finding(p, where.str() + " for a row that sees no key");
          if (!keys.empty() && finite && std::isfinite(got) && std::abs(got) > bound) {
            finding(p, where.str() + " outside the values it sees (bound " + std::to_string(bound) +
                           ")");
          }
        }
        if (lse != nullptr && keys.empty() &&
            lse[(b * p.heads_q() + h) * p.seqlen_q + row] != -INFINITY) {
          finding(p, "lse of a row that sees no key is not -inf");
        }
      }
    }
  }
}

// The dense call on a shared cache (K's bytes before the call, V its first head_dim_v dims,
// k_new appended alone) against the same call with those dims copied into a V cache of their own
// and into v_new: the same out and lse bit for bit, and the shared cache left as `k_want`.
void check_shared_cache(Problem& p, const std::vector<std::uint8_t>& k_before,
                        const std::vector<std::uint8_t>& k_want) {
  auto view = [](Tensor& t, DType dtype) {
    return flashattn::TensorView{t.buffer.bytes.data(), dtype, t.shape, t.strides};
  };
  Tensor keys = p.dense_k, own_keys = p.dense_k;
  keys.buffer.bytes = k_before;
  own_keys.buffer.bytes = k_before;
  const std::int64_t Dv = p.head_dim_v;
  Tensor values = make_tensor(p.cache_dtype, {p.batch, p.capacity, p.heads_kv, Dv}, 0, {}, -1);
  Tensor new_values = make_tensor(p.new_dtype, {p.batch, p.seqlen_new, p.heads_kv, Dv}, 0, {}, -1);
  for_each_index(values.shape, [&](auto b, auto j, auto h, auto d) {
    store_f32(values.buffer.bytes.data(), p.cache_dtype, values.offset(b, j, h, d),
              load_f32(keys.buffer.bytes.data(), p.cache_dtype, keys.offset(b, j, h, d)));
  });
  for_each_index(new_values.shape, [&](auto b, auto i, auto h, auto d) {
    store_f32(new_values.buffer.bytes.data(), p.new_dtype, new_values.offset(b, i, h, d),
              load_f32(p.k_new.buffer.bytes.data(), p.new_dtype, p.k_new.offset(b, i, h, d)));
  });
  auto run = [&](const flashattn::KVCacheView& cache, const flashattn::NewKeysValues& new_kv) {
    std::vector<std::uint8_t> out_bytes = p.out.buffer.bytes, lse = p.lse_bytes;
    flashattn::TensorView out = view(p.out, p.q_dtype);
    out.data = out_bytes.data();
    flashattn::kvcache_attention_forward(
        view(p.q, p.q_dtype), cache, p.cached.data(), new_kv, p.cache_options, out,
        lse.empty() ? nullptr : reinterpret_cast<float*>(lse.data()), p.options, p.impl);
    return std::pair{out_bytes, lse};
  };
  flashattn::TensorView shared_values = view(keys, p.cache_dtype);
  shared_values.shape[3] = Dv;
  std::pair<std::vector<std::uint8_t>, std::vector<std::uint8_t>> separate, shared;
  try {
    separate = run({view(own_keys, p.cache_dtype), view(values, p.cache_dtype)},
                   {view(p.k_new, p.new_dtype), view(new_values, p.new_dtype)});
    shared = run({view(keys, p.cache_dtype), shared_values}, {view(p.k_new, p.new_dtype), {}});
  } catch (const flashattn::Error& error) {
    finding(p, std::string("a valid shared-cache call raised Error: ") + error.what());
  }
  if (shared != separate) finding(p, "a shared cache gave other out or lse than a separate one");
  if (keys.buffer.bytes != k_want) {
    finding(p, "the shared cache does not hold the old rows with the new keys appended");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  const int corruption =
      in.ConsumeIntegralInRange(0, 7) == 0 ? in.ConsumeIntegralInRange(0, 15) : -1;
  Problem p = make_problem(in);
  auto run = [&](const Call& call) {
    flashattn::kvcache_attention_forward(call.q, call.cache, call.cache_seqlens, call.new_kv,
                                         call.cache_options, call.out, call.lse, p.options, p.impl);
  };

  if (corruption >= 0) {
    bool paged = in.ConsumeBool();
    Call call = make_call(p, paged);
    if (!corrupt(p, corruption, call, paged)) return 0;
    p.description += " corruption " + std::to_string(corruption) + (paged ? " paged" : " dense");
    const std::vector<std::uint8_t> out_before = p.out.buffer.bytes, lse_before = p.lse_bytes;
    const std::vector<std::uint8_t> k_before =
        paged ? p.paged_k.buffer.bytes : p.dense_k.buffer.bytes;
    const std::vector<std::uint8_t> v_before =
        paged ? p.paged_v.buffer.bytes : p.dense_v.buffer.bytes;
    const std::vector<std::uint8_t> k_scale_before =
        paged ? p.paged_k_scale.buffer.bytes : p.dense_k_scale.buffer.bytes;
    const std::vector<std::uint8_t> v_scale_before =
        paged ? p.paged_v_scale.buffer.bytes : p.dense_v_scale.buffer.bytes;
    try {
      run(call);
    } catch (const flashattn::Error&) {
      const Tensor& k = paged ? p.paged_k : p.dense_k;
      const Tensor& v = paged ? p.paged_v : p.dense_v;
      const Tensor& k_scale = paged ? p.paged_k_scale : p.dense_k_scale;
      const Tensor& v_scale = paged ? p.paged_v_scale : p.dense_v_scale;
      if (p.out.buffer.bytes != out_before || p.lse_bytes != lse_before ||
          k.buffer.bytes != k_before || v.buffer.bytes != v_before ||
          k_scale.buffer.bytes != k_scale_before || v_scale.buffer.bytes != v_scale_before) {
        finding(p, "an invalid call wrote its output or the cache before raising Error");
      }
      return 0;
    }
    finding(p, "an invalid call did not raise flashattn::Error");
  }

  const bool shared = !p.quantized() && p.cos.empty() && p.head_dim_v <= p.head_dim &&
                      p.batch_idx.empty() && p.leftpad.empty() && in.ConsumeBool();
  const std::vector<std::uint8_t> dense_k_before = p.dense_k.buffer.bytes;
  const auto dense_row = [](std::int64_t b, std::int64_t j) { return std::pair{b, j}; };
  const auto paged_row = [&](std::int64_t b, std::int64_t j) { return p.page_row(b, j); };
  const bool rotary = !p.cos.empty();
  const std::vector<std::uint8_t> dense_k_want = appended(p, p.dense_k, p.k_new, rotary, dense_row);
  const std::vector<std::uint8_t> dense_v_want = appended(p, p.dense_v, p.v_new, false, dense_row);
  const std::vector<std::uint8_t> paged_k_want = appended(p, p.paged_k, p.k_new, rotary, paged_row);
  const std::vector<std::uint8_t> paged_v_want = appended(p, p.paged_v, p.v_new, false, paged_row);
  // A quantized cache: its codes and scales.
  std::vector<std::pair<std::vector<std::uint8_t>, std::vector<std::uint8_t>>> quantized_want;
  if (p.quantized()) {
    quantized_want = {quantized_appended(p, p.dense_k, p.dense_k_scale, p.k_new, rotary, dense_row),
                      quantized_appended(p, p.dense_v, p.dense_v_scale, p.v_new, false, dense_row),
                      quantized_appended(p, p.paged_k, p.paged_k_scale, p.k_new, rotary, paged_row),
                      quantized_appended(p, p.paged_v, p.paged_v_scale, p.v_new, false, paged_row)};
  }

  std::vector<std::uint8_t> paged_out, paged_lse;
  try {
    run(make_call(p, true));
    paged_out = p.out.buffer.bytes;
    paged_lse = p.lse_bytes;
    run(make_call(p, false));
  } catch (const flashattn::Error& error) {
    finding(p, std::string("a valid call raised Error: ") + error.what());
  }
  if (p.quantized()) {
    const std::pair<const Tensor*, const Tensor*> caches[] = {{&p.dense_k, &p.dense_k_scale},
                                                              {&p.dense_v, &p.dense_v_scale},
                                                              {&p.paged_k, &p.paged_k_scale},
                                                              {&p.paged_v, &p.paged_v_scale}};
    for (std::size_t i = 0; i < 4; ++i) {
      if (caches[i].first->buffer.bytes != quantized_want[i].first ||
          caches[i].second->buffer.bytes != quantized_want[i].second) {
        finding(p, std::string(i < 2 ? "the dense " : "the paged ") + (i % 2 ? "V" : "K") +
                       " cache does not hold its old codes and scales with the new rows "
                       "quantized in");
      }
    }
  } else {
    if (p.dense_k.buffer.bytes != dense_k_want || p.dense_v.buffer.bytes != dense_v_want) {
      finding(p, "the dense cache does not hold the old rows with the new ones appended");
    }
    if (p.paged_k.buffer.bytes != paged_k_want || p.paged_v.buffer.bytes != paged_v_want) {
      finding(p, "the paged cache does not hold the old rows with the new ones appended");
    }
  }
  if (p.out.buffer.bytes != paged_out || p.lse_bytes != paged_lse) {
    finding(p, "dense and paged caches gave different out or lse");
  }
  const std::int64_t written = written_around_view(p.out, p.q_dtype);
  if (written >= 0) finding(p, "wrote padding element " + std::to_string(written) + " of out");
  check_bounds(p);
  if (shared) check_shared_cache(p, dense_k_before, dense_k_want);
  return 0;
}
