// flashattn_soak: user threads calling the public entry points at once, for a set time, with
// random shapes, dtypes, masks, strides and thread counts; every result checked, every input
// checked unchanged afterwards, the process's RSS sampled so that a leak shows as growth.
//
//   flashattn_soak [--seconds 60] [--users 8] [--seed N]
//
// Each call is one of (weights in kinds()):
//   forward    attention_forward, any path and dtype, causal/window, GQA, padded strides, a
//              broadcast bias (−inf entries included) or a boolean mask for half the calls:
//              against the fp64 reference (test_attention_vs_reference.cpp's standard-path
//              bound, 4x for the flash path, plus the dtype's roundings and 4·max|bias|);
//   backward   attention_backward, flash or standard, f32, the same biases and masks: against
//              the fp64 reference backward (test_backward.cpp's standard bound, 5x);
//   varlen     varlen_attention_forward on a packed ragged batch: bit for bit each sequence's
//              attention_forward on the same rows;
//   kvcache    kvcache_attention_forward with appends, dense and paged caches holding the same
//              rows: bit for bit the same, and the first sequence against the reference; one
//              call in three on an int8 (scales per row) or fp8 (one scale per KV head) cache,
//              the reference over its values code · scale (int8: the bound holds the rounding
//              of q to the decode's 16-bit codes as well);
//   merge      merge_attention_states of two key halves: against the reference over all keys.
// A failed check, an exception, or RSS growing by more than --max-rss-growth-mib from the end of
// the first tenth of the run to its end (not judged under ASan or TSan), fails the run (exit 1).
// The report: calls and checks per kind, the largest error as a fraction of its tolerance, RSS at
// warm-up and at the end.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cpu/kernels/int8_products.hpp"
#include "test_support.hpp"

namespace flashattn::testing {
namespace {

constexpr double kU32 = 0x1p-24;

// Under ASan and TSan the RSS grows by design (ASan's quarantine of freed memory, the shadow
// memory of both): it is reported there, not judged.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

enum Kind { kForward, kBackward, kVarlen, kKVCache, kMerge, kKinds };
const char* const kKindNames[kKinds] = {"forward", "backward", "varlen", "kvcache", "merge"};

struct Tally {
  std::atomic<std::int64_t> calls[kKinds] = {};
  std::atomic<std::int64_t> checks[kKinds] = {};
  std::mutex mutex;
  double worst_ratio[kKinds] = {};  // largest error / tolerance
  std::vector<std::string> failures;

  void fail(const std::string& what) {
    std::lock_guard<std::mutex> lock(mutex);
    if (failures.size() < 20) failures.push_back(what);
  }
  void ratio(Kind kind, double value) {
    std::lock_guard<std::mutex> lock(mutex);
    worst_ratio[kind] = std::max(worst_ratio[kind], value);
  }
};

std::int64_t rss_bytes() {
  std::ifstream statm("/proc/self/statm");
  std::int64_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * 4096;
}

// A [B, S, H, D] tensor, contiguous or with each (s, h) row padded, filled with N(0, 1).
Tensor random_tensor(std::mt19937_64& rng, DType dtype, std::array<std::int64_t, 4> shape,
                     bool padded) {
  Tensor t = padded ? Tensor(dtype, shape,
                             {shape[1] * shape[2] * (shape[3] + 3), shape[2] * (shape[3] + 3),
                              shape[3] + 3, 1})
                    : Tensor(dtype, shape);
  t.fill_normal(rng);
  return t;
}

AttentionOptions random_options(std::mt19937_64& rng) {
  AttentionOptions options;
  options.causal = rng() % 2 == 0;
  if (rng() % 4 == 0) options.window_left = static_cast<std::int64_t>(rng() % 40);
  if (rng() % 4 == 0) options.window_right = static_cast<std::int64_t>(rng() % 40);
  options.num_threads = static_cast<int>(rng() % 3);  // 0 = all
  return options;
}

// A bias or a mask for `options` (each for a quarter of the calls), and the storage its view reads:
// [B | 1, Hq | 1, Sq, Skv], a bias f32 N(0, 1) with −inf for one entry in eight in half of them,
// a mask keeping 3 keys in 4.
struct LogitModifiers {
  Tensor bias{DType::f32, {1, 1, 1, 1}};
  std::vector<std::uint8_t> keep;
  double max_bias = 0.0;  // largest finite |bias|

  void pick(std::mt19937_64& rng, AttentionOptions& options, std::int64_t B, std::int64_t Hq,
            std::int64_t Sq, std::int64_t Skv) {
    const std::array<std::int64_t, 4> shape{rng() % 2 ? B : 1, rng() % 2 ? Hq : 1, Sq, Skv};
    const int kind = static_cast<int>(rng() % 4);
    if (kind == 0) {
      bias = Tensor(DType::f32, shape);
      bias.fill_normal(rng);
      const bool minus_infinity = rng() % 2 == 0;
      bias.for_each_index([&](auto a, auto b, auto i, auto j) {
        if (minus_infinity && rng() % 8 == 0) bias.set(a, b, i, j, -INFINITY);
        const double value = std::abs(static_cast<double>(bias.at(a, b, i, j)));
        if (std::isfinite(value)) max_bias = std::max(max_bias, value);
      });
      options.bias = bias.view;
    } else if (kind == 1) {
      keep.resize(static_cast<std::size_t>(shape[0] * shape[1] * Sq * Skv));
      for (auto& byte : keep) byte = rng() % 4 != 0;
      options.mask =
          MaskView{reinterpret_cast<const bool*>(keep.data()), shape, contiguous_strides(shape)};
    }
  }
};

// Checks `got` (any dtype, [B, Sq, Hq, D]) against the fp64 reference's out within the standard
// path's bound times `factor`, plus what rounding q's elements by u_q of the largest before the
// products moves it (the int8 decode's query codes: docs/semantics.md); returns error / tolerance.
double forward_ratio(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& got,
                     const AttentionOptions& options, double factor, DType dtype, double max_bias,
                     double u_q = 0.0) {
  const ReferenceResult want = reference(q, k, v, options);
  const double D = static_cast<double>(q.view.shape[3]);
  const double max_v = max_abs(v);
  const double bound = factor * kU32 * max_v *
                           (4.0 / std::sqrt(D) * D * max_abs(q) * max_abs(k) + 4.0 * max_bias +
                            2.0 * static_cast<double>(k.view.shape[1]) + 16.0) +
                       2.0 * unit_roundoff(dtype) * max_v +
                       probability_rounding_bound(dtype, max_v) +
                       2.0 * u_q * max_v * std::sqrt(D) * max_abs(q) * max_abs(k) + 1e-30;
  return max_error(got, want.out).value / bound;
}

class User {
 public:
  User(Tally& tally, std::uint64_t seed) : tally_(tally), rng_(seed) {}

  void call() {
    const Kind kind = pick();
    tally_.calls[kind]++;
    try {
      switch (kind) {
        case kForward:
          forward();
          break;
        case kBackward:
          backward();
          break;
        case kVarlen:
          varlen();
          break;
        case kKVCache:
          kvcache();
          break;
        case kMerge:
          merge();
          break;
        case kKinds:
          break;
      }
    } catch (const std::exception& error) {
      tally_.fail(std::string(kKindNames[kind]) + ": exception: " + error.what());
    }
  }

 private:
  Kind pick() {
    static constexpr int kWeights[kKinds] = {4, 2, 2, 2, 1};
    int total = 0;
    for (int w : kWeights) total += w;
    int draw = static_cast<int>(rng_() % static_cast<std::uint64_t>(total));
    for (int kind = 0; kind < kKinds; ++kind) {
      if ((draw -= kWeights[kind]) < 0) return static_cast<Kind>(kind);
    }
    return kForward;
  }
  std::int64_t between(std::int64_t low, std::int64_t high) {
    return low + static_cast<std::int64_t>(rng_() % static_cast<std::uint64_t>(high - low + 1));
  }
  DType dtype() { return std::array{DType::f32, DType::f16, DType::bf16}[rng_() % 3]; }

  void check(Kind kind, double ratio, const std::string& what) {
    tally_.checks[kind]++;
    tally_.ratio(kind, ratio);
    if (!(ratio <= 1.0)) tally_.fail(std::string(kKindNames[kind]) + ": " + what);
  }
  void unchanged(Kind kind, const Tensor& t, const std::vector<std::uint8_t>& before,
                 const char* name) {
    tally_.checks[kind]++;
    if (t.bytes != before) tally_.fail(std::string(kKindNames[kind]) + ": " + name + " written");
  }

  void forward() {
    const DType type = dtype();
    const std::int64_t B = between(1, 2), Hkv = between(1, 2), Hq = Hkv * between(1, 4);
    const std::int64_t Sq = between(1, 70), Skv = between(1, 90);
    const std::int64_t D = std::array<std::int64_t, 4>{16, 40, 64, 128}[rng_() % 4];
    // One call in four with a value head dim of its own (head_dim_v).
    const std::int64_t Dv =
        rng_() % 4 == 0 ? std::array<std::int64_t, 3>{8, 24, 96}[rng_() % 3] : D;
    const bool padded = rng_() % 2 == 0;
    const Tensor q = random_tensor(rng_, type, {B, Sq, Hq, D}, padded);
    const Tensor k = random_tensor(rng_, type, {B, Skv, Hkv, D}, padded);
    const Tensor v = random_tensor(rng_, type, {B, Skv, Hkv, Dv}, padded);
    const auto q_before = q.bytes, k_before = k.bytes, v_before = v.bytes;
    Tensor out(type, {B, Sq, Hq, Dv});
    AttentionOptions options = random_options(rng_);
    LogitModifiers logits;
    logits.pick(rng_, options, B, Hq, Sq, Skv);
    const AttentionImpl impl = std::array{AttentionImpl::flash, AttentionImpl::standard,
                                          AttentionImpl::reference}[rng_() % 3];
    attention_forward(impl, q.view, k.view, v.view, out.view, nullptr, options);
    unchanged(kForward, q, q_before, "q");
    unchanged(kForward, k, k_before, "k");
    unchanged(kForward, v, v_before, "v");
    const double factor = impl == AttentionImpl::flash ? 4.0 : 1.0;
    check(kForward, forward_ratio(q, k, v, out, options, factor, type, logits.max_bias),
          std::string(impl_name(impl)) + " out beyond its bound");
  }

  void backward() {
    const std::int64_t B = 1, Hkv = between(1, 2), Hq = Hkv * between(1, 2);
    const std::int64_t Sq = between(1, 50), Skv = between(1, 60), D = between(1, 4) * 16;
    const Tensor q = random_tensor(rng_, DType::f32, {B, Sq, Hq, D}, false);
    const Tensor k = random_tensor(rng_, DType::f32, {B, Skv, Hkv, D}, false);
    const Tensor v = random_tensor(rng_, DType::f32, {B, Skv, Hkv, D}, false);
    const Tensor dout = random_tensor(rng_, DType::f32, {B, Sq, Hq, D}, false);
    AttentionOptions options = random_options(rng_);
    LogitModifiers logits;
    logits.pick(rng_, options, B, Hq, Sq, Skv);
    const AttentionImpl impl = rng_() % 2 ? AttentionImpl::flash : AttentionImpl::standard;
    Tensor out(DType::f32, q.view.shape);
    std::vector<float> lse(static_cast<std::size_t>(B * Hq * Sq));
    attention_forward(impl, q.view, k.view, v.view, out.view, lse.data(), options);
    const auto out_before = out.bytes, dout_before = dout.bytes;
    Tensor dq(DType::f32, q.view.shape), dk(DType::f32, k.view.shape), dv(DType::f32, v.view.shape);
    Tensor rq(DType::f32, q.view.shape), rk(DType::f32, k.view.shape), rv(DType::f32, v.view.shape);
    attention_backward(impl, dout.view, q.view, k.view, v.view, out.view, lse.data(), dq.view,
                       dk.view, dv.view, options);
    reference_attention_backward(dout.view, q.view, k.view, v.view, out.view, lse.data(), rq.view,
                                 rk.view, rv.view, options);
    unchanged(kBackward, out, out_before, "out");
    unchanged(kBackward, dout, dout_before, "dout");
    const double G = std::max({max_abs(rq), max_abs(rk), max_abs(rv)}) + max_abs(dout) * max_abs(v);
    const double bound = 5.0 * kU32 *
                             (4.0 / std::sqrt(static_cast<double>(D)) * static_cast<double>(D) *
                                  max_abs(q) * max_abs(k) +
                              4.0 * logits.max_bias + 2.0 * static_cast<double>(Sq + Skv) + 16.0) *
                             G +
                         1e-30;
    double error = 0.0;
    for (const std::pair<const Tensor*, const Tensor*> pair :
         {std::pair{&dq, &rq}, {&dk, &rk}, {&dv, &rv}}) {
      const Tensor& got = *pair.first;
      const Tensor& want = *pair.second;
      got.for_each_index([&](auto a, auto b, auto c, auto d) {
        error = std::max(error,
                         std::abs(static_cast<double>(got.at(a, b, c, d)) - want.at(a, b, c, d)));
      });
    }
    check(kBackward, error / bound, std::string(impl_name(impl)) + " gradients beyond bound");
  }

  void varlen() {
    const DType type = dtype();
    const std::int64_t batch = between(1, 4), Hkv = between(1, 2), Hq = Hkv * between(1, 2);
    const std::int64_t D = between(1, 4) * 16;
    std::vector<std::int32_t> cu_q = {0}, cu_k = {0};
    for (std::int64_t b = 0; b < batch; ++b) {
      cu_q.push_back(cu_q.back() + static_cast<std::int32_t>(between(0, 40)));
      cu_k.push_back(cu_k.back() + static_cast<std::int32_t>(between(0, 50)));
    }
    const Tensor q = random_tensor(rng_, type, {1, cu_q.back(), Hq, D}, false);
    const Tensor k = random_tensor(rng_, type, {1, cu_k.back(), Hkv, D}, false);
    const Tensor v = random_tensor(rng_, type, {1, cu_k.back(), Hkv, D}, false);
    Tensor out(type, q.view.shape);
    const AttentionOptions options = random_options(rng_);
    const AttentionImpl impl = rng_() % 2 ? AttentionImpl::flash : AttentionImpl::standard;
    varlen_attention_forward(impl, q.view, k.view, v.view, cu_q.data(), cu_k.data(), batch,
                             out.view, nullptr, options);
    bool same = true;
    for (std::int64_t b = 0; b < batch; ++b) {
      const std::int64_t q0 = cu_q[b], Lq = cu_q[b + 1] - q0, k0 = cu_k[b], Lk = cu_k[b + 1] - k0;
      const auto rows = [&](const Tensor& t, std::int64_t begin, std::int64_t count) {
        Tensor part(type, {1, count, t.view.shape[2], D});
        part.for_each_index(
            [&](auto, auto s, auto h, auto d) { part.set(0, s, h, d, t.at(0, begin + s, h, d)); });
        return part;
      };
      const Tensor q_b = rows(q, q0, Lq), k_b = rows(k, k0, Lk), v_b = rows(v, k0, Lk);
      Tensor out_b(type, q_b.view.shape);
      attention_forward(impl, q_b.view, k_b.view, v_b.view, out_b.view, nullptr, options);
      out_b.for_each_index([&](auto, auto s, auto h, auto d) {
        const float a = out.at(0, q0 + s, h, d), c = out_b.at(0, s, h, d);
        same = same && std::memcmp(&a, &c, sizeof(float)) == 0;
      });
    }
    check(kVarlen, same ? 0.0 : INFINITY, "a sequence differs from itself alone");
  }

  void kvcache() {
    const bool quantized = rng_() % 3 == 0;
    const DType cache_type =
        quantized ? std::array{DType::int8, DType::fp8_e4m3, DType::fp8_e5m2}[rng_() % 3] : dtype();
    const DType q_type = quantized ? dtype() : (rng_() % 2 ? DType::f32 : cache_type);
    const DType new_type = quantized ? q_type : cache_type;
    const std::int64_t B = between(1, 3), Hkv = between(1, 2), Hq = Hkv * between(1, 4);
    const std::int64_t D = between(1, 4) * 16, Sq = between(1, 4), Snew = between(0, Sq);
    const std::int64_t page = std::array<std::int64_t, 4>{1, 5, 16, 7}[rng_() % 4];
    std::vector<std::int32_t> cached;
    for (std::int64_t b = 0; b < B; ++b)
      cached.push_back(static_cast<std::int32_t>(between(0, 80)));
    const std::int64_t capacity = *std::max_element(cached.begin(), cached.end()) + Snew;
    const std::int64_t pages = (capacity + page - 1) / page;
    std::vector<std::int32_t> table(static_cast<std::size_t>(B * pages));
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), rng_);
    table.reserve(1);  // a non-null table says "paged", also when no sequence has a page
    Tensor dense_k =
        random_tensor(rng_, quantized ? DType::f32 : cache_type, {B, capacity, Hkv, D}, false);
    Tensor dense_v =
        random_tensor(rng_, quantized ? DType::f32 : cache_type, {B, capacity, Hkv, D}, false);
    // A quantized cache: int8 with a scale per row (quantize_kv writes them), fp8 with one
    // scale per KV head (0 strides) fitted to N(0, 1) values.
    const std::array<std::int64_t, 4> dense_scales{B, capacity, Hkv, 1};
    const std::array<std::int64_t, 4> paged_scales{B * pages, page, Hkv, 1};
    const auto scales_of = [&](const std::array<std::int64_t, 4>& shape) {
      if (cache_type != DType::int8) {
        Tensor per_head(DType::f32, shape, {0, 0, 1, 0});
        for (std::int64_t h = 0; h < Hkv; ++h) {
          per_head.set(0, 0, h, 0, 4.0f / dtype_traits(cache_type).max_code);
        }
        return per_head;
      }
      return Tensor(DType::f32, shape);
    };
    Tensor dense_k_scale = scales_of(dense_scales), dense_v_scale = scales_of(dense_scales);
    Tensor paged_k_scale = scales_of(paged_scales), paged_v_scale = scales_of(paged_scales);
    if (quantized) {
      Tensor k_codes(cache_type, dense_k.view.shape), v_codes(cache_type, dense_v.view.shape);
      quantize_kv(dense_k.view, k_codes.view, dense_k_scale.view);
      quantize_kv(dense_v.view, v_codes.view, dense_v_scale.view);
      dense_k = std::move(k_codes);
      dense_v = std::move(v_codes);
    }
    Tensor paged_k(cache_type, {B * pages, page, Hkv, D}),
        paged_v(cache_type, {B * pages, page, Hkv, D});
    dense_k.for_each_index([&](auto b, auto j, auto h, auto d) {
      const std::int64_t p = table[b * pages + j / page];
      paged_k.set(p, j % page, h, d, dense_k.at(b, j, h, d));
      paged_v.set(p, j % page, h, d, dense_v.at(b, j, h, d));
      if (quantized && cache_type == DType::int8 && d == 0) {
        paged_k_scale.set(p, j % page, h, 0, dense_k_scale.at(b, j, h, 0));
        paged_v_scale.set(p, j % page, h, 0, dense_v_scale.at(b, j, h, 0));
      }
    });
    const Tensor q = random_tensor(rng_, q_type, {B, Sq, Hq, D}, false);
    const Tensor k_new = random_tensor(rng_, new_type, {B, Snew, Hkv, D}, false);
    const Tensor v_new = random_tensor(rng_, new_type, {B, Snew, Hkv, D}, false);
    Tensor out_dense(q_type, q.view.shape), out_paged(q_type, q.view.shape);
    AttentionOptions options = random_options(rng_);
    NewKeysValues new_kv;
    if (Snew > 0) new_kv = {k_new.view, v_new.view};
    KVCacheView dense{dense_k.view, dense_v.view};
    KVCacheView paged{paged_k.view, paged_v.view, table.data(), pages};
    if (quantized) {
      dense.k_scale = dense_k_scale.view;
      dense.v_scale = dense_v_scale.view;
      paged.k_scale = paged_k_scale.view;
      paged.v_scale = paged_v_scale.view;
    }
    kvcache_attention_forward(q.view, dense, cached.data(), new_kv, out_dense.view, nullptr,
                              options);
    kvcache_attention_forward(q.view, paged, cached.data(), new_kv, out_paged.view, nullptr,
                              options);
    check(kKVCache, out_dense.bytes == out_paged.bytes ? 0.0 : INFINITY,
          "dense and paged caches differ");
    // Sequence 0 against the reference over its keys, in q's dtype (the 16-bit ones widen
    // exactly).
    const std::int64_t L = cached[0] + Snew;
    Tensor q0(DType::f32, {1, Sq, Hq, D}), k0(DType::f32, {1, L, Hkv, D}),
        v0(DType::f32, {1, L, Hkv, D}), o0(q_type, {1, Sq, Hq, D});
    q0.for_each_index([&](auto, auto i, auto h, auto d) {
      q0.set(0, i, h, d, q.at(0, i, h, d));
      o0.set(0, i, h, d, out_dense.at(0, i, h, d));
    });
    k0.for_each_index([&](auto, auto j, auto h, auto d) {
      const float k_scale = quantized ? dense_k_scale.at(0, j, h, 0) : 1.0f;
      const float v_scale = quantized ? dense_v_scale.at(0, j, h, 0) : 1.0f;
      k0.set(0, j, h, d, dense_k.at(0, j, h, d) * k_scale);
      v0.set(0, j, h, d, dense_v.at(0, j, h, d) * v_scale);
    });
    const double query_codes = cache_type == DType::int8 ? 0.5 / detail::cpu::kQueryCodeMax : 0.0;
    check(kKVCache, forward_ratio(q0, k0, v0, o0, options, 1.0, q_type, 0.0, query_codes),
          "sequence 0 beyond its bound");
  }

  void merge() {
    const std::int64_t B = between(1, 2), H = between(1, 3), Sq = between(1, 20);
    const std::int64_t Skv = between(2, 80), split = between(1, Skv - 1), D = between(1, 4) * 16;
    const Tensor q = random_tensor(rng_, DType::f32, {B, Sq, H, D}, false);
    const Tensor k = random_tensor(rng_, DType::f32, {B, Skv, H, D}, false);
    const Tensor v = random_tensor(rng_, DType::f32, {B, Skv, H, D}, false);
    const auto part = [&](const Tensor& t, std::int64_t begin, std::int64_t end) {
      Tensor p(DType::f32, {B, end - begin, H, D});
      p.for_each_index(
          [&](auto a, auto s, auto h, auto d) { p.set(a, s, h, d, t.at(a, begin + s, h, d)); });
      return p;
    };
    AttentionOptions options;
    options.num_threads = static_cast<int>(rng_() % 3);
    const Tensor ka = part(k, 0, split), va = part(v, 0, split), kb = part(k, split, Skv),
                 vb = part(v, split, Skv);
    Tensor out_a(DType::f32, q.view.shape), out_b(DType::f32, q.view.shape),
        out(DType::f32, q.view.shape);
    std::vector<float> lse_a(static_cast<std::size_t>(B * H * Sq)), lse_b(lse_a.size());
    flash_attention_forward(q.view, ka.view, va.view, out_a.view, lse_a.data(), options);
    flash_attention_forward(q.view, kb.view, vb.view, out_b.view, lse_b.data(), options);
    merge_attention_states(out_a.view, lse_a.data(), out_b.view, lse_b.data(), out.view, nullptr,
                           options.num_threads);
    // Two flash calls (4x the standard bound each) and the merge's few roundings.
    check(kMerge, forward_ratio(q, k, v, out, options, 8.0, DType::f32, 0.0),
          "merged out beyond bound");
  }

  Tally& tally_;
  std::mt19937_64 rng_;
};

int run(int argc, char** argv) {
  double seconds = 60.0, max_rss_growth_mib = 16.0;
  int users = 8;
  std::uint64_t seed = test_seed();
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto value = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "flashattn_soak: %s: expected a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--seconds") {
      seconds = std::atof(value());
    } else if (arg == "--users") {
      users = std::atoi(value());
    } else if (arg == "--seed") {
      seed = std::strtoull(value(), nullptr, 10);
    } else if (arg == "--max-rss-growth-mib") {
      max_rss_growth_mib = std::atof(value());
    } else {
      std::fprintf(stderr,
                   "flashattn_soak: unknown argument %s (usage: flashattn_soak [--seconds S] "
                   "[--users N] [--seed N] [--max-rss-growth-mib M])\n",
                   arg.c_str());
      return 2;
    }
  }
  if (!(seconds > 0) || users < 1 || users > 256 || !(max_rss_growth_mib >= 0)) {
    std::fprintf(stderr,
                 "flashattn_soak: expected --seconds > 0, --users 1..256, "
                 "--max-rss-growth-mib >= 0\n");
    return 2;
  }
  std::printf("flashattn_soak: %d user threads for %.0f s, seed %llu\n", users, seconds,
              static_cast<unsigned long long>(seed));
  std::fflush(stdout);
  Tally tally;
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (int u = 0; u < users; ++u) {
    threads.emplace_back([&, u] {
      User user(tally, seed + static_cast<std::uint64_t>(u) * 0x9E3779B97F4A7C15ull);
      while (!stop.load(std::memory_order_relaxed)) user.call();
    });
  }
  // RSS after the first tenth of the run (allocators and thread stacks warmed up), then at the end.
  const auto start = std::chrono::steady_clock::now();
  const auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  std::int64_t rss_warm = -1, rss_peak = 0;
  while (elapsed() < seconds) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const std::int64_t rss = rss_bytes();
    rss_peak = std::max(rss_peak, rss);
    if (rss_warm < 0 && elapsed() >= seconds / 10) rss_warm = rss;
  }
  stop = true;
  for (auto& thread : threads) thread.join();
  const std::int64_t rss_end = rss_bytes();
  if (rss_warm < 0) rss_warm = rss_end;

  std::int64_t calls = 0, checks = 0;
  std::printf("%-9s %10s %10s %22s\n", "kind", "calls", "checks", "worst error/tolerance");
  for (int kind = 0; kind < kKinds; ++kind) {
    calls += tally.calls[kind];
    checks += tally.checks[kind];
    std::printf("%-9s %10lld %10lld %22.3g\n", kKindNames[kind],
                static_cast<long long>(tally.calls[kind]),
                static_cast<long long>(tally.checks[kind]), tally.worst_ratio[kind]);
  }
  const double growth_mib = static_cast<double>(rss_end - rss_warm) / (1 << 20);
  std::printf(
      "total     %10lld %10lld; RSS %.1f MiB after warm-up, %.1f MiB at the end "
      "(growth %.1f MiB), peak %.1f MiB; %zu failures\n",
      static_cast<long long>(calls), static_cast<long long>(checks),
      static_cast<double>(rss_warm) / (1 << 20), static_cast<double>(rss_end) / (1 << 20),
      growth_mib, static_cast<double>(rss_peak) / (1 << 20), tally.failures.size());
  for (const std::string& failure : tally.failures) std::printf("FAILED %s\n", failure.c_str());
  if (kSanitized) {
    std::printf(
        "RSS growth not judged: a sanitizer build (its quarantine and shadow memory grow)\n");
  } else if (growth_mib > max_rss_growth_mib) {
    std::printf("FAILED RSS grew by %.1f MiB, more than --max-rss-growth-mib %.1f\n", growth_mib,
                max_rss_growth_mib);
    return 1;
  }
  return tally.failures.empty() && calls > 0 ? 0 : 1;
}

}  // namespace
}  // namespace flashattn::testing

int main(int argc, char** argv) { return flashattn::testing::run(argc, argv); }
