// `flashattn serve-bench`: decode steps of a CPU inference server on kvcache_attention_forward.
//
// Part 1, the server: N requests of lengths drawn log-uniform from [--min-len, --max-len] share
// a paged KV cache whose pages lie in shuffled order (as an allocator that has served for a
// while leaves them). Each step appends one token per request and attends with one query row
// per request. The first step is verified against the fp64 reference on sampled requests; then
// --steps steps are timed, each after a plain read of the cache's pages on the same threads:
// tokens/s, GB/s of K and V read, and that over the read's GB/s in the same round (ratio_read,
// the median over the rounds).
//
// Part 2, one sequence: a single request (B = 1) at each --single-seqlens length and cache
// dtype, in a dense and a paged cache holding the same rows; the two must agree bit for bit and
// match the reference, then are timed in rounds of (read dense, dense, paged, read paged): each
// one's GB/s, ratio_read, and paged over dense.
//
// --kv-layout HND keeps each KV head's rows together in the memory of both parts' caches
// ([pages, Hkv, page_size, D], dense [B, Hkv, capacity, D]: FlashInfer's HND), which the
// library reads through the view's strides; the default NHD is kvcache.hpp's [pages, page_size,
// Hkv, D].
//
// Part 3, prefill: a causal ragged batch packed (varlen) against the same batch padded to its
// longest sequence: GFLOP/s of the real FLOPs, and of what each computed.
//
// Writes <out-dir>/<date>-<host>-serve.csv and, with gnuplot, -serve.png (part 2's GB/s against
// the cache length, and the reads) and, given several page sizes, -serve-pages.png (part 1's GB/s
// against the page size, and its reads).

#include <omp.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "atomic_file.hpp"
#include "ceilings.hpp"
#include "cli_common.hpp"
#include "flashattn/flashattn.hpp"
#include "machine.hpp"
#include "plots.hpp"
#include "report.hpp"
#include "timing.hpp"

namespace flashattn::cli {
namespace {

namespace fs = std::filesystem;

struct ServeOptions {
  int requests = 32;
  std::int64_t min_len = 512, max_len = 32768;
  int steps = 16;
  std::vector<std::int64_t> page_sizes = {16};
  bool huge_pages = false;
  std::string kv_layout = "NHD";
  std::int64_t heads_q = 32, heads_kv = 8, head_dim = 128;
  std::string q_dtype = "f32", cache_dtype = "bf16";
  std::vector<std::int64_t> single_seqlens = {4096, 16384, 65536};
  std::vector<std::string> single_dtypes = {"f32", "bf16", "f16", "int8", "fp8_e4m3"};
  bool no_single = false;
  int prefill_sequences = 8;
  std::int64_t prefill_min = 128, prefill_max = 4096;
  bool no_prefill = false;
  int check_requests = 4;
  int threads = 0;
  std::uint64_t seed = 42;
  std::string out_dir = "bench/results";
  bool no_plot = false;
  bool quick = false;
};

// The dtypes by name (flashattn/dtype.hpp's names); the CLI checks the names first.
const std::vector<std::string> kComputeDtypes = {"f32", "f16", "bf16"};
const std::vector<std::string> kCacheDtypes = {"f32",  "f16",      "bf16",
                                               "int8", "fp8_e4m3", "fp8_e5m2"};

DType dtype_from(const std::string& name) {
  for (const DType dtype :
       {DType::f32, DType::f16, DType::bf16, DType::int8, DType::fp8_e4m3, DType::fp8_e5m2}) {
    if (name == dtype_name(dtype)) return dtype;
  }
  return DType::f32;
}

// Fills `count` elements of `dtype` at `data` with values uniform in [-1, 1) from a counter
// hash (splitmix64) of `seed` and the index: fast enough for gigabytes, on every thread.
void fill_uniform(void* data, DType dtype, std::int64_t count, std::uint64_t seed) {
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < count; ++i) {
    std::uint64_t z = seed + static_cast<std::uint64_t>(i) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    store_f32(data, dtype, i, static_cast<float>(z >> 40) * 0x1p-23f - 1.0f);
  }
}

// Bytes of this process's anonymous memory on transparent huge pages (AnonHugePages of
// /proc/self/smaps_rollup), 0 where the kernel does not say.
std::int64_t anon_huge_page_bytes() {
  std::ifstream rollup("/proc/self/smaps_rollup");
  std::string name;
  std::int64_t kib = 0;
  while (rollup >> name) {
    if (name == "AnonHugePages:" && rollup >> kib) return kib * 1024;
    rollup.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  return 0;
}

// An owned [d0, d1, d2, d3] buffer of one dtype, cache-line aligned; with `huge_pages` on 2 MiB
// boundaries and offered to the kernel for transparent huge pages (MADV_HUGEPAGE), as a server
// may hold its KV cache: a TLB entry then covers 512 times the rows (bench/RESULTS.md has what
// it changes).
struct Buffer {
  static constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;
  static constexpr std::align_val_t kHugeAlignment{kHugePageBytes}, kLineAlignment{64};
  static std::byte* allocate(std::size_t bytes, bool huge_pages) {
    return static_cast<std::byte*>(
        ::operator new(bytes, huge_pages ? kHugeAlignment : kLineAlignment));
  }
  DType dtype;
  std::array<std::int64_t, 4> shape;
  std::unique_ptr<std::byte[], void (*)(std::byte*)> bytes;

  Buffer(DType type, std::array<std::int64_t, 4> dims, bool huge_pages = false)
      : dtype(type),
        shape(dims),
        bytes(
            allocate(std::max<std::size_t>(size(), 1), huge_pages),
            huge_pages ? [](std::byte* p) { ::operator delete(p, kHugeAlignment); }
                       : [](std::byte* p) { ::operator delete(p, kLineAlignment); }) {
#if defined(MADV_HUGEPAGE)
    // Advice only: where the kernel declines, the buffer stays on small pages (the run reports
    // the share it got).
    if (huge_pages && size() >= kHugePageBytes) {
      static_cast<void>(
          ::madvise(bytes.get(), size() / kHugePageBytes * kHugePageBytes, MADV_HUGEPAGE));
    }
#else
    static_cast<void>(huge_pages);
#endif
  }
  std::size_t size() const {
    return static_cast<std::size_t>(shape[0] * shape[1] * shape[2] * shape[3]) * dtype_size(dtype);
  }
  TensorView view() { return contiguous_view(bytes.get(), dtype, shape); }
  std::span<const std::byte> span() const { return {bytes.get(), size()}; }
};

// A batch of sequences and their K/V cache, dense [B, capacity, Hkv, D] or in pages of
// page_size rows handed out in shuffled order; `room` rows past each length for appends. With
// `head_major` the memory holds each KV head's rows together ([B, Hkv, capacity, D], or pages of
// [Hkv, page_size, D]: FlashInfer's HND) and the library sees it through strides.
struct Cache {
  std::vector<std::int32_t> lengths;
  std::int64_t page_size = 0;  // 0: dense
  std::int64_t pages_per_sequence = 0;
  bool head_major = false;
  std::int64_t heads_kv = 0, head_dim = 0;
  std::vector<std::int32_t> block_table;
  Buffer k, v;
  // A quantized cache's scales, one per row and KV head ([d0, d1, Hkv, 1] of the library's
  // view, whatever the layout of the codes); empty otherwise.
  Buffer k_scale, v_scale;

  // [dense batch | pages, rows of one, Hkv, D] as the library indexes them.
  static std::array<std::int64_t, 4> shape(const std::vector<std::int32_t>& lengths,
                                           std::int64_t room, std::int64_t page_size,
                                           std::int64_t heads_kv, std::int64_t head_dim) {
    const std::int64_t longest = *std::max_element(lengths.begin(), lengths.end()) + room;
    if (page_size == 0) {
      return {static_cast<std::int64_t>(lengths.size()), longest, heads_kv, head_dim};
    }
    std::int64_t pages = 0;
    for (const std::int32_t length : lengths) pages += (length + room + page_size - 1) / page_size;
    return {pages, page_size, heads_kv, head_dim};
  }
  static std::array<std::int64_t, 4> scale_shape(DType dtype, std::array<std::int64_t, 4> s) {
    if (!is_quantized(dtype)) return {0, 0, 0, 0};
    return {s[0], s[1], s[2], 1};
  }
  // The same dims in the order they lie in memory.
  static std::array<std::int64_t, 4> memory_shape(std::array<std::int64_t, 4> s, bool head_major) {
    if (head_major) std::swap(s[1], s[2]);
    return s;
  }

  Cache(std::vector<std::int32_t> initial, std::int64_t room, std::int64_t page, DType dtype,
        std::int64_t kv_heads, std::int64_t dims, bool huge_pages, bool heads_together,
        std::mt19937_64& rng)
      : lengths(std::move(initial)),
        page_size(page),
        head_major(heads_together),
        heads_kv(kv_heads),
        head_dim(dims),
        k(dtype, memory_shape(shape(lengths, room, page, kv_heads, dims), heads_together),
          huge_pages),
        v(dtype, memory_shape(shape(lengths, room, page, kv_heads, dims), heads_together),
          huge_pages),
        k_scale(DType::f32, scale_shape(dtype, shape(lengths, room, page, kv_heads, dims))),
        v_scale(DType::f32, scale_shape(dtype, shape(lengths, room, page, kv_heads, dims))) {
    if (page_size > 0) {
      const std::int64_t longest = *std::max_element(lengths.begin(), lengths.end()) + room;
      pages_per_sequence = (longest + page_size - 1) / page_size;
      std::vector<std::int32_t> order(static_cast<std::size_t>(k.shape[0]));
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng);
      // Each sequence takes the pages it needs from the shuffled pool; the rest of its row of
      // the table is never read and stays 0.
      block_table.assign(lengths.size() * static_cast<std::size_t>(pages_per_sequence), 0);
      std::size_t next = 0;
      for (std::size_t b = 0; b < lengths.size(); ++b) {
        const std::int64_t pages = (lengths[b] + room + page_size - 1) / page_size;
        for (std::int64_t i = 0; i < pages; ++i) {
          block_table[b * pages_per_sequence + i] = order[next++];
        }
      }
    }
  }

  // The library's [*, rows, Hkv, D] view of a buffer, head-major memory through its strides.
  TensorView view_of(Buffer& buffer) const {
    TensorView view = buffer.view();
    if (head_major) {
      std::swap(view.shape[1], view.shape[2]);
      std::swap(view.strides[1], view.strides[2]);
    }
    return view;
  }

  KVCacheView view() {
    KVCacheView view{view_of(k), view_of(v)};
    if (page_size > 0) {
      view.block_table = block_table.data();
      view.pages_per_sequence = pages_per_sequence;
    }
    if (is_quantized(k.dtype)) {
      view.k_scale = k_scale.view();
      view.v_scale = v_scale.view();
    }
    return view;
  }

  // Fills K and V with values uniform in [-1, 1) (fill_uniform, seeds `seed` and seed + 1): a
  // quantized cache with those values quantized (quantize_kv) a row block at a time, fp8 with
  // scales 1 / its largest code, so that [-1, 1] spans the format.
  void fill(std::uint64_t seed) {
    if (!is_quantized(k.dtype)) {
      fill_uniform(k.bytes.get(), k.dtype,
                   static_cast<std::int64_t>(k.size() / dtype_size(k.dtype)), seed);
      fill_uniform(v.bytes.get(), v.dtype,
                   static_cast<std::int64_t>(v.size() / dtype_size(v.dtype)), seed + 1);
      return;
    }
    const float fp8_scale = 1.0f / dtype_traits(k.dtype).max_code;
    for (Buffer* scales : {&k_scale, &v_scale}) {
      auto* data = reinterpret_cast<float*>(scales->bytes.get());
      std::fill_n(data, scales->size() / sizeof(float), fp8_scale);
    }
    const TensorView k_view = view_of(k), v_view = view_of(v);
    const std::int64_t outer = k_view.shape[0], rows = k_view.shape[1], block = 1024;
    Buffer values(DType::f32, {1, std::min(rows, block), heads_kv, head_dim});
    std::uint64_t chunk = 0;
    for (std::int64_t i = 0; i < outer; ++i) {
      for (std::int64_t j = 0; j < rows; j += block) {
        const std::int64_t count = std::min(block, rows - j);
        for (auto [codes, scales, salt] :
             {std::tuple{k_view, &k_scale, 0}, {v_view, &v_scale, 1}}) {
          fill_uniform(values.bytes.get(), DType::f32, count * heads_kv * head_dim,
                       seed + 2 * chunk + salt);
          TensorView part = codes;
          part.data =
              static_cast<std::uint8_t*>(codes.data) + i * codes.strides[0] + j * codes.strides[1];
          part.shape = {1, count, heads_kv, head_dim};
          TensorView part_scales = scales->view();
          part_scales.data =
              reinterpret_cast<float*>(scales->bytes.get()) + (i * rows + j) * heads_kv;
          part_scales.shape = {1, count, heads_kv, 1};
          TensorView from = values.view();
          from.shape[1] = count;
          quantize_kv(from, part, part_scales);
        }
        ++chunk;
      }
    }
  }

  // Element offset of row j of sequence b, KV head h, in k or v.
  std::int64_t offset(std::int64_t b, std::int64_t j, std::int64_t h) const {
    const std::int64_t outer =
        page_size == 0 ? b : block_table[b * pages_per_sequence + j / page_size];
    const std::int64_t row = page_size == 0 ? j : j % page_size;
    const std::int64_t rows = page_size == 0 ? k.shape[head_major ? 2 : 1] : page_size;
    return (head_major ? (outer * heads_kv + h) * rows + row
                       : (outer * rows + row) * heads_kv + h) *
           head_dim;
  }

  // Element offset of the scale of row j of sequence b, KV head h, in k_scale or v_scale.
  std::int64_t scale_offset(std::int64_t b, std::int64_t j, std::int64_t h) const {
    const std::int64_t outer =
        page_size == 0 ? b : block_table[b * pages_per_sequence + j / page_size];
    const std::int64_t row = page_size == 0 ? j : j % page_size;
    return (outer * k_scale.shape[1] + row) * heads_kv + h;
  }

  // Sequence b's first `rows` rows of K and V into [1, rows, Hkv, D] f32 buffers: a quantized
  // cache's values, code · scale.
  void gather(std::int64_t b, std::int64_t rows, Buffer& keys, Buffer& values) const {
    const std::int64_t heads = heads_kv, D = head_dim;
    const bool quantized = is_quantized(k.dtype);
    const auto* k_scales = reinterpret_cast<const float*>(k_scale.bytes.get());
    const auto* v_scales = reinterpret_cast<const float*>(v_scale.bytes.get());
    for (std::int64_t j = 0; j < rows; ++j) {
      for (std::int64_t h = 0; h < heads; ++h) {
        const float k_factor = quantized ? k_scales[scale_offset(b, j, h)] : 1.0f;
        const float v_factor = quantized ? v_scales[scale_offset(b, j, h)] : 1.0f;
        for (std::int64_t d = 0; d < D; ++d) {
          const std::int64_t to = (j * heads + h) * D + d;
          store_f32(keys.bytes.get(), DType::f32, to,
                    load_f32(k.bytes.get(), k.dtype, offset(b, j, h) + d) * k_factor);
          store_f32(values.bytes.get(), DType::f32, to,
                    load_f32(v.bytes.get(), v.dtype, offset(b, j, h) + d) * v_factor);
        }
      }
    }
  }

  // Bytes of K or V, scales included, of one key (all its KV heads).
  double key_bytes() const {
    const double scale = is_quantized(k.dtype) ? sizeof(float) : 0.0;
    return static_cast<double>(heads_kv) *
           (static_cast<double>(head_dim * dtype_size(k.dtype)) + scale);
  }

  // Bytes of K and V that attending to the current lengths reads.
  double kv_bytes() const {
    return 2.0 * key_bytes() * std::accumulate(lengths.begin(), lengths.end(), 0.0);
  }

  // What a plain read of the cache covers: codes and scales.
  std::vector<std::span<const std::byte>> spans() const {
    std::vector<std::span<const std::byte>> all = {k.span(), v.span()};
    if (is_quantized(k.dtype)) {
      all.push_back(k_scale.span());
      all.push_back(v_scale.span());
    }
    return all;
  }
};

// One query row per sequence, and one new K/V row per sequence to append.
struct Step {
  Buffer q, out, k_new, v_new;
  std::vector<float> lse;
  Step(std::int64_t batch, const ServeOptions& o, std::uint64_t seed)
      : q(dtype_from(o.q_dtype), {batch, 1, o.heads_q, o.head_dim}),
        out(dtype_from(o.q_dtype), {batch, 1, o.heads_q, o.head_dim}),
        k_new(dtype_from(o.q_dtype), {batch, 1, o.heads_kv, o.head_dim}),
        v_new(dtype_from(o.q_dtype), {batch, 1, o.heads_kv, o.head_dim}),
        lse(static_cast<std::size_t>(batch * o.heads_q)) {
    fill_uniform(q.bytes.get(), q.dtype, static_cast<std::int64_t>(q.size() / dtype_size(q.dtype)),
                 seed);
    fill_uniform(k_new.bytes.get(), k_new.dtype,
                 static_cast<std::int64_t>(k_new.size() / dtype_size(k_new.dtype)), seed + 1);
    fill_uniform(v_new.bytes.get(), v_new.dtype,
                 static_cast<std::int64_t>(v_new.size() / dtype_size(v_new.dtype)), seed + 2);
  }

  // Attends with (append) or without appending; the caller advances the lengths after an append.
  void run(Cache& cache, bool append, int threads) {
    AttentionOptions options;
    options.num_threads = threads;
    NewKeysValues new_kv;
    if (append) new_kv = {k_new.view(), v_new.view()};
    kvcache_attention_forward(q.view(), cache.view(), cache.lengths.data(), new_kv, out.view(),
                              lse.data(), options);
  }
};

// The largest error of sequence b's output rows against the fp64 reference over its first
// cache.lengths[b] keys, and the tolerance it must stay in (tests/test_kvcache.cpp's bound).
struct Check {
  double error = 0.0, tolerance = 0.0;
  bool passed() const { return error <= tolerance; }
};

Check check_sequence(const Cache& cache, const Step& step, std::int64_t b, int threads) {
  const std::int64_t L = cache.lengths[b], Hq = step.q.shape[2], D = step.q.shape[3];
  const std::int64_t Hkv = cache.heads_kv;
  Buffer keys(DType::f32, {1, L, Hkv, D}), values(DType::f32, {1, L, Hkv, D});
  Buffer q(DType::f32, {1, 1, Hq, D}), want(DType::f32, {1, 1, Hq, D});
  cache.gather(b, L, keys, values);
  double max_q = 0.0, max_k = 0.0, max_v = 0.0;
  for (std::int64_t i = 0; i < Hq * D; ++i) {
    const float x = load_f32(step.q.bytes.get(), step.q.dtype, b * Hq * D + i);
    store_f32(q.bytes.get(), DType::f32, i, x);
    max_q = std::max(max_q, std::abs(static_cast<double>(x)));
  }
  for (std::int64_t i = 0; i < L * Hkv * D; ++i) {
    max_k =
        std::max(max_k, std::abs(static_cast<double>(load_f32(keys.bytes.get(), DType::f32, i))));
    max_v =
        std::max(max_v, std::abs(static_cast<double>(load_f32(values.bytes.get(), DType::f32, i))));
  }
  AttentionOptions options;
  options.num_threads = threads;
  reference_attention_forward(q.view(), keys.view(), values.view(), want.view(), nullptr, options);
  Check check;
  for (std::int64_t i = 0; i < Hq * D; ++i) {
    const double got = load_f32(step.out.bytes.get(), step.out.dtype, b * Hq * D + i);
    const double error = std::abs(got - load_f32(want.bytes.get(), DType::f32, i));
    check.error = std::isnan(got) ? INFINITY : std::max(check.error, error);
  }
  const double u32 = 0x1p-24, scale = 1.0 / std::sqrt(static_cast<double>(D));
  const double u_q = step.q.dtype == DType::f32   ? 0.0
                     : step.q.dtype == DType::f16 ? 0x1p-11
                                                  : 0x1p-8;
  check.tolerance = u32 * max_v *
                        (4.0 * scale * static_cast<double>(D) * max_q * max_k +
                         2.0 * static_cast<double>(L) + 16.0) +
                    2.0 * u_q * max_v;
  return check;
}

// Progress on stderr: a bar redrawn in place on a terminal, a line per quarter elsewhere.
class Progress {
 public:
  Progress(std::string what, int total)
      : what_(std::move(what)), total_(total), terminal_(::isatty(STDERR_FILENO) != 0) {}
  void update(int done) {
    if (terminal_) {
      const int width = 30, filled = total_ > 0 ? done * width / total_ : width;
      std::fprintf(stderr, "\r%s [%s%s] %d/%d", what_.c_str(), std::string(filled, '#').c_str(),
                   std::string(width - filled, ' ').c_str(), done, total_);
      if (done == total_) std::fprintf(stderr, "\n");
    } else if (done == total_ || (total_ >= 4 && done % (total_ / 4) == 0 && done > 0)) {
      std::fprintf(stderr, "%s: %d/%d\n", what_.c_str(), done, total_);
    }
  }

 private:
  std::string what_;
  int total_;
  bool terminal_;
};

struct Row {
  std::string part, cache, cache_dtype;
  // Part 3: GFLOP/s of the real (unpadded) causal FLOPs, of the FLOPs the call computed (the
  // padded batch's include its padding), and varlen's real over the padded batch's computed.
  std::optional<double> real_gflops, computed_gflops, varlen_over_padded;
  std::int64_t requests = 0, kv_tokens = 0;
  std::int64_t page_size = 0;  // of the paged cache (its dense twin's too); 0 for prefill
  // With --huge-pages: the share of the cache's bytes the kernel put on huge pages.
  std::optional<double> huge_page_share;
  double seconds = 0.0, kv_gbps = 0.0, read_gbps = 0.0, ratio_read = 0.0;
  std::optional<double> paged_over_dense;
  Check check;
};

std::vector<std::int32_t> draw_lengths(const ServeOptions& o, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> uniform(std::log(static_cast<double>(o.min_len)),
                                                 std::log(static_cast<double>(o.max_len)));
  std::vector<std::int32_t> lengths;
  for (int i = 0; i < o.requests; ++i) {
    lengths.push_back(static_cast<std::int32_t>(std::llround(std::exp(uniform(rng)))));
  }
  return lengths;
}

// With --huge-pages, the share of `bytes` (just allocated and written) that went on huge pages
// since `before` (anon_huge_page_bytes()).
std::optional<double> huge_page_share(const ServeOptions& o, std::int64_t before, double bytes) {
  if (!o.huge_pages) return std::nullopt;
  return std::clamp(static_cast<double>(anon_huge_page_bytes() - before) / bytes, 0.0, 1.0);
}

// Part 1: the ragged batch of `lengths` on a cache in pages of `page_size` rows.
Row serve(const ServeOptions& o, const std::vector<std::int32_t>& lengths, std::int64_t page_size,
          int threads, std::mt19937_64& rng, bool& verified) {
  const DType cache_dtype = dtype_from(o.cache_dtype);
  const std::int64_t huge_before = anon_huge_page_bytes();
  Cache cache(lengths, o.steps + 1, page_size, cache_dtype, o.heads_kv, o.head_dim, o.huge_pages,
              o.kv_layout == "HND", rng);
  std::fprintf(stderr, "flashattn serve-bench: filling %.2f GB of K/V in pages of %lld rows\n",
               static_cast<double>(2 * cache.k.size()) * 1e-9, static_cast<long long>(page_size));
  cache.fill(o.seed + 10);
  const std::optional<double> huge_share =
      huge_page_share(o, huge_before, 2.0 * static_cast<double>(cache.k.size()));
  Step step(o.requests, o, o.seed + 20);

  // Verified: the first step, appending, on sampled requests (the shortest, the longest, and
  // others spread over the batch).
  step.run(cache, true, threads);
  for (auto& length : cache.lengths) ++length;
  std::vector<std::int64_t> order(cache.lengths.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](auto a, auto b) { return cache.lengths[a] < cache.lengths[b]; });
  Row row;
  row.part = "serve";
  row.cache = "paged";
  row.cache_dtype = o.cache_dtype;
  row.requests = o.requests;
  row.page_size = page_size;
  row.huge_page_share = huge_share;
  const int checks = std::min<int>(o.check_requests, o.requests);
  for (int i = 0; i < checks; ++i) {
    const std::int64_t b = order[checks == 1 ? 0 : i * (order.size() - 1) / (checks - 1)];
    const Check check = check_sequence(cache, step, b, threads);
    if (!check.passed() || check.error / std::max(check.tolerance, 1e-300) >
                               row.check.error / std::max(row.check.tolerance, 1e-300)) {
      row.check = check;
    }
    verified = verified && check.passed();
  }
  if (!verified) return row;

  bench::MemoryRead read(threads, cache.spans());
  Progress progress("flashattn serve-bench: decode steps", o.steps);
  double bytes = 0.0;
  int done = 0;
  const PairedSeconds times = paired_median_seconds(
      o.steps, [&] { read.run(1); },
      [&] {
        bytes += cache.kv_bytes();
        step.run(cache, true, threads);
        for (auto& length : cache.lengths) ++length;
        progress.update(++done);
      });
  bytes /= o.steps;
  row.kv_tokens = static_cast<std::int64_t>(bytes / (2.0 * cache.key_bytes()));
  row.seconds = times.second;
  row.kv_gbps = bytes / times.second * 1e-9;
  row.read_gbps = read.work_per_unit() / times.first * 1e-9;
  row.ratio_read = bytes / read.work_per_unit() / times.second_over_first;
  return row;
}

// Part 2: one sequence of `length` rows, dense and paged.
std::vector<Row> single(const ServeOptions& o, const std::string& cache_dtype_name,
                        std::int64_t length, int threads, int repeat, std::mt19937_64& rng,
                        bool& verified) {
  const DType dtype = dtype_from(cache_dtype_name);
  const std::vector<std::int32_t> lengths = {static_cast<std::int32_t>(length)};
  const std::int64_t page_size = o.page_sizes.front(), huge_before = anon_huge_page_bytes();
  Cache dense(lengths, 0, 0, dtype, o.heads_kv, o.head_dim, o.huge_pages, o.kv_layout == "HND",
              rng);
  Cache paged(lengths, 0, page_size, dtype, o.heads_kv, o.head_dim, o.huge_pages,
              o.kv_layout == "HND", rng);
  dense.fill(o.seed + 30);
  const std::size_t row_bytes = static_cast<std::size_t>(o.head_dim) * dtype_size(dtype);
  for (std::int64_t j = 0; j < length; ++j) {
    for (std::int64_t h = 0; h < o.heads_kv; ++h) {
      const std::size_t from = static_cast<std::size_t>(dense.offset(0, j, h)) * dtype_size(dtype);
      const std::size_t to = static_cast<std::size_t>(paged.offset(0, j, h)) * dtype_size(dtype);
      std::memcpy(paged.k.bytes.get() + to, dense.k.bytes.get() + from, row_bytes);
      std::memcpy(paged.v.bytes.get() + to, dense.v.bytes.get() + from, row_bytes);
      if (!is_quantized(dtype)) continue;
      const std::size_t scale_from = dense.scale_offset(0, j, h) * sizeof(float);
      const std::size_t scale_to = paged.scale_offset(0, j, h) * sizeof(float);
      std::memcpy(paged.k_scale.bytes.get() + scale_to, dense.k_scale.bytes.get() + scale_from,
                  sizeof(float));
      std::memcpy(paged.v_scale.bytes.get() + scale_to, dense.v_scale.bytes.get() + scale_from,
                  sizeof(float));
    }
  }
  Step dense_step(1, o, o.seed + 40), paged_step(1, o, o.seed + 40);
  dense_step.run(dense, false, threads);
  paged_step.run(paged, false, threads);
  const bool same = std::memcmp(dense_step.out.bytes.get(), paged_step.out.bytes.get(),
                                dense_step.out.size()) == 0;
  Row dense_row;
  dense_row.part = "single";
  dense_row.cache = "dense";
  dense_row.cache_dtype = cache_dtype_name;
  dense_row.requests = 1;
  dense_row.kv_tokens = length;
  dense_row.page_size = page_size;
  dense_row.huge_page_share =
      huge_page_share(o, huge_before, 2.0 * static_cast<double>(dense.k.size() + paged.k.size()));
  dense_row.check = check_sequence(dense, dense_step, 0, threads);
  if (!same) dense_row.check.error = INFINITY;  // dense and paged must agree bit for bit
  Row paged_row = dense_row;
  paged_row.cache = "paged";
  verified = verified && dense_row.check.passed();
  if (!dense_row.check.passed()) return {dense_row, paged_row};

  bench::MemoryRead read_dense(threads, dense.spans());
  bench::MemoryRead read_paged(threads, paged.spans());
  const RoundSeconds times = round_robin_seconds(
      repeat, {[&] { read_dense.run(1); }, [&] { dense_step.run(dense, false, threads); },
               [&] { paged_step.run(paged, false, threads); }, [&] { read_paged.run(1); }});
  const double bytes = dense.kv_bytes();
  dense_row.seconds = times.median[1];
  dense_row.kv_gbps = bytes / times.median[1] * 1e-9;
  dense_row.read_gbps = read_dense.work_per_unit() / times.median[0] * 1e-9;
  dense_row.ratio_read = bytes / read_dense.work_per_unit() / times.over_previous[1];
  paged_row.seconds = times.median[2];
  paged_row.kv_gbps = bytes / times.median[2] * 1e-9;
  paged_row.read_gbps = read_paged.work_per_unit() / times.median[3] * 1e-9;
  paged_row.ratio_read = bytes / read_paged.work_per_unit() * times.over_previous[3];
  paged_row.paged_over_dense = 1.0 / times.over_previous[2];
  return {dense_row, paged_row};
}

// Part 3: a causal prefill of sequences of lengths log-uniform in [prefill_min, prefill_max],
// packed (varlen_attention_forward) and padded to the longest (attention_forward on
// [B, longest, H, D]: with Sq = Skv the causal mask keeps every real row on its own real keys).
// Both are verified on sampled rows against the fp64 reference, then timed in alternation.
std::vector<Row> prefill(const ServeOptions& o, int threads, std::mt19937_64& rng, bool& verified) {
  const DType dtype = dtype_from(o.q_dtype);
  std::uniform_real_distribution<double> uniform(std::log(static_cast<double>(o.prefill_min)),
                                                 std::log(static_cast<double>(o.prefill_max)));
  std::vector<std::int32_t> lengths, offsets = {0};
  for (int i = 0; i < o.prefill_sequences; ++i) {
    lengths.push_back(static_cast<std::int32_t>(std::llround(std::exp(uniform(rng)))));
    offsets.push_back(offsets.back() + lengths.back());
  }
  const std::int64_t B = o.prefill_sequences, total = offsets.back();
  const std::int64_t longest = *std::max_element(lengths.begin(), lengths.end());
  const std::int64_t Hq = o.heads_q, Hkv = o.heads_kv, D = o.head_dim;
  Buffer q(dtype, {1, total, Hq, D}), k(dtype, {1, total, Hkv, D}), v(dtype, {1, total, Hkv, D});
  Buffer out(dtype, {1, total, Hq, D});
  Buffer padded_q(dtype, {B, longest, Hq, D}), padded_k(dtype, {B, longest, Hkv, D});
  Buffer padded_v(dtype, {B, longest, Hkv, D}), padded_out(dtype, {B, longest, Hq, D});
  fill_uniform(q.bytes.get(), dtype, total * Hq * D, o.seed + 50);
  fill_uniform(k.bytes.get(), dtype, total * Hkv * D, o.seed + 51);
  fill_uniform(v.bytes.get(), dtype, total * Hkv * D, o.seed + 52);
  // The padded batch: each sequence's rows first, zeros after.
  const std::size_t element = dtype_size(dtype);
  for (Buffer* buffer : {&padded_q, &padded_k, &padded_v})
    std::memset(buffer->bytes.get(), 0, buffer->size());
  for (std::int64_t b = 0; b < B; ++b) {
    for (const auto& [from, to, heads] :
         {std::tuple{&q, &padded_q, Hq}, std::tuple{&k, &padded_k, Hkv},
          std::tuple{&v, &padded_v, Hkv}}) {
      std::memcpy(to->bytes.get() + b * longest * heads * D * element,
                  from->bytes.get() + offsets[b] * heads * D * element,
                  static_cast<std::size_t>(lengths[b] * heads * D) * element);
    }
  }
  AttentionOptions options;
  options.causal = true;
  options.num_threads = threads;
  auto run_varlen = [&] {
    varlen_attention_forward(AttentionImpl::flash, q.view(), k.view(), v.view(), offsets.data(),
                             offsets.data(), B, out.view(), nullptr, options);
  };
  auto run_padded = [&] {
    attention_forward(AttentionImpl::flash, padded_q.view(), padded_k.view(), padded_v.view(),
                      padded_out.view(), nullptr, options);
  };
  run_varlen();
  run_padded();

  // Sampled rows (each sequence's first, middle and last) against the reference: row i of a
  // causal sequence is one query against keys 0 .. i.
  Row varlen_row;
  varlen_row.part = "prefill";
  varlen_row.cache = "varlen";
  varlen_row.cache_dtype = o.q_dtype;
  varlen_row.requests = B;
  varlen_row.kv_tokens = total;
  Row padded_row = varlen_row;
  padded_row.cache = "padded";
  padded_row.kv_tokens = B * longest;
  for (std::int64_t b = 0; b < B; ++b) {
    const std::int64_t length = lengths[b];
    for (const std::int64_t i : {std::int64_t{0}, length / 2, length - 1}) {
      const std::int64_t keys = i + 1, row = offsets[b] + i;
      Buffer q_row(DType::f32, {1, 1, Hq, D}), want(DType::f32, {1, 1, Hq, D});
      Buffer k_rows(DType::f32, {1, keys, Hkv, D}), v_rows(DType::f32, {1, keys, Hkv, D});
      double max_q = 0.0, max_k = 0.0, max_v = 0.0;
      for (std::int64_t x = 0; x < Hq * D; ++x) {
        const float value = load_f32(q.bytes.get(), dtype, row * Hq * D + x);
        store_f32(q_row.bytes.get(), DType::f32, x, value);
        max_q = std::max(max_q, std::abs(static_cast<double>(value)));
      }
      for (std::int64_t x = 0; x < keys * Hkv * D; ++x) {
        const float kx = load_f32(k.bytes.get(), dtype, offsets[b] * Hkv * D + x);
        const float vx = load_f32(v.bytes.get(), dtype, offsets[b] * Hkv * D + x);
        store_f32(k_rows.bytes.get(), DType::f32, x, kx);
        store_f32(v_rows.bytes.get(), DType::f32, x, vx);
        max_k = std::max(max_k, std::abs(static_cast<double>(kx)));
        max_v = std::max(max_v, std::abs(static_cast<double>(vx)));
      }
      AttentionOptions reference_options;
      reference_options.num_threads = threads;
      reference_attention_forward(q_row.view(), k_rows.view(), v_rows.view(), want.view(), nullptr,
                                  reference_options);
      const double u = dtype == DType::f32 ? 0.0 : dtype == DType::f16 ? 0x1p-11 : 0x1p-8;
      const double tolerance =
          0x1p-24 * max_v *
              (4.0 / std::sqrt(static_cast<double>(D)) * static_cast<double>(D) * max_q * max_k +
               2.0 * static_cast<double>(keys) + 16.0) +
          2.0 * u * max_v;
      for (auto [row_ptr, check, index] :
           {std::tuple{out.bytes.get(), &varlen_row.check, row},
            std::tuple{padded_out.bytes.get(), &padded_row.check, b * longest + i}}) {
        for (std::int64_t x = 0; x < Hq * D; ++x) {
          const double got = load_f32(row_ptr, dtype, index * Hq * D + x);
          const double error = std::isnan(got)
                                   ? INFINITY
                                   : std::abs(got - load_f32(want.bytes.get(), DType::f32, x));
          if (error / tolerance > check->error / std::max(check->tolerance, 1e-300)) {
            *check = {error, tolerance};
          }
        }
      }
    }
  }
  verified = verified && varlen_row.check.passed() && padded_row.check.passed();
  if (!varlen_row.check.passed() || !padded_row.check.passed()) return {varlen_row, padded_row};

  double real_flops = 0.0;
  for (const std::int32_t length : lengths) {
    real_flops += attention_flops(1, Hq, length, length, D, options);
  }
  const double padded_flops = attention_flops(B, Hq, longest, longest, D, options);
  const PairedSeconds times = paired_median_seconds(o.quick ? 1 : 3, run_padded, run_varlen);
  varlen_row.seconds = times.second;
  varlen_row.real_gflops = varlen_row.computed_gflops = real_flops / times.second * 1e-9;
  padded_row.seconds = times.first;
  padded_row.real_gflops = real_flops / times.first * 1e-9;
  padded_row.computed_gflops = padded_flops / times.first * 1e-9;
  // (real / t_varlen) / (padded / t_padded), with the paired ratio of the times.
  varlen_row.varlen_over_padded = real_flops / padded_flops / times.second_over_first;
  return {varlen_row, padded_row};
}

std::string csv_line(const Machine& machine, const ServeOptions& o, double copy_gbps,
                     const Row& row) {
  // Decode columns mean nothing for the prefill rows, and GFLOP/s nothing for decode: empty.
  const bool decode = row.part != "prefill";
  const auto decode_number = [&](const char* pattern, double value) {
    return decode ? format(pattern, value) : std::string();
  };
  std::ostringstream line;
  line << machine.date << ',' << machine.host << ',' << machine.threads << ',' << row.part << ','
       << row.cache << ',' << o.q_dtype << ',' << row.cache_dtype << ',' << row.requests << ','
       << row.kv_tokens << ',' << (decode ? std::to_string(row.page_size) : std::string()) << ','
       << o.heads_q << ',' << o.heads_kv << ',' << o.head_dim << ',' << format("%.6g", row.seconds)
       << ','
       << decode_number("%.1f",
                        row.seconds > 0 ? static_cast<double>(row.requests) / row.seconds : 0.0)
       << ',' << decode_number("%.3f", row.kv_gbps) << ',' << decode_number("%.3f", row.read_gbps)
       << ',' << decode_number("%.3f", row.ratio_read) << ','
       << optional_number("%.3f", row.paged_over_dense) << ',' << format("%.3f", copy_gbps) << ','
       << (row.check.passed() ? "yes" : "no") << ',' << format("%.3g", row.check.error) << ','
       << format("%.3g", row.check.tolerance) << ',' << optional_number("%.2f", row.real_gflops)
       << ',' << optional_number("%.2f", row.computed_gflops) << ','
       << optional_number("%.3f", row.varlen_over_padded) << ','
       << optional_number("%.3f", row.huge_page_share) << ','
       << (decode ? o.kv_layout : std::string()) << '\n';
  return line.str();
}

void print_row(const Row& row) {
  const std::string huge =
      row.huge_page_share ? format(", %.0f%% on huge pages", 100.0 * *row.huge_page_share) : "";
  std::printf(
      "%-7s %-6s %-5s %5lld %8lld %11lld %9.3f %9.1f %8.2f %8.2f %6.2f %8s %s (error %.2g, "
      "tolerance %.2g%s)\n",
      row.part.c_str(), row.cache.c_str(), row.cache_dtype.c_str(),
      static_cast<long long>(row.page_size), static_cast<long long>(row.requests),
      static_cast<long long>(row.kv_tokens), row.seconds * 1e3,
      row.seconds > 0 ? static_cast<double>(row.requests) / row.seconds : 0.0, row.kv_gbps,
      row.read_gbps, row.ratio_read,
      row.paged_over_dense ? format("%.3f", *row.paged_over_dense).c_str() : "",
      row.check.passed() ? "verified" : "FAILED", row.check.error, row.check.tolerance,
      huge.c_str());
}

int run_serve_bench(ServeOptions o, const CLI::App& command) {
  if (o.quick) {
    auto unset = [&](const char* name) { return command.count(name) == 0; };
    if (unset("--requests")) o.requests = 4;
    if (unset("--min-len")) o.min_len = 40;
    if (unset("--max-len")) o.max_len = 600;
    if (unset("--steps")) o.steps = 3;
    if (unset("--single-seqlens")) o.single_seqlens = {300};
    if (unset("--prefill-sequences")) o.prefill_sequences = 3;
    if (unset("--prefill-min")) o.prefill_min = 16;
    if (unset("--prefill-max")) o.prefill_max = 200;
  }
  if (o.min_len > o.max_len) {
    throw Error("--min-len: expected at most --max-len = " + std::to_string(o.max_len) + ", got " +
                std::to_string(o.min_len));
  }
  if (o.prefill_min > o.prefill_max) {
    throw Error("--prefill-min: expected at most --prefill-max = " + std::to_string(o.prefill_max) +
                ", got " + std::to_string(o.prefill_min));
  }
  if (o.heads_q % o.heads_kv != 0) {
    throw Error("--heads-kv: expected a divisor of --heads-q = " + std::to_string(o.heads_q) +
                ", got " + std::to_string(o.heads_kv));
  }
  if (o.q_dtype != "f32" && o.q_dtype != o.cache_dtype &&
      !is_quantized(dtype_from(o.cache_dtype))) {
    throw Error("--cache-dtype: expected " + o.q_dtype + " (as --q-dtype; only an f32 q takes " +
                "another 16-bit cache; any q takes int8 and fp8), got " + o.cache_dtype);
  }
  const int threads = resolved_threads(o.threads);
  const fs::path out_dir = o.out_dir;
  std::error_code error;
  fs::create_directories(out_dir, error);
  if (error) throw Error("--out-dir: cannot create " + out_dir.string() + ": " + error.message());
  const Machine machine = describe_machine(threads);
  const std::string stem =
      machine.date + "-" + file_name_safe(machine.host) + (o.quick ? "-quick" : "") + "-serve";
  AtomicFile csv(out_dir / (stem + ".csv"));
  // Two plots: part 2's sweep of lengths, and part 1's sweep of page sizes where there is one.
  const bool pages_sweep = o.page_sizes.size() > 1;
  std::unique_ptr<AtomicFile> lengths_png, pages_png;
  std::optional<fs::path> gnuplot;
  std::string no_plot_reason;
  if (o.no_plot) {
    no_plot_reason = "--no-plot";
  } else if (o.no_single && !pages_sweep) {
    no_plot_reason =
        "--no-single and one --page-size (the plots show the single-sequence sweep and the "
        "server's sweep of page sizes)";
  } else if (gnuplot = find_on_path("gnuplot"); !gnuplot) {
    no_plot_reason = "gnuplot is not on PATH; install gnuplot-nox (scripts/install-deps.sh)";
  } else {
    if (!o.no_single) lengths_png = std::make_unique<AtomicFile>(out_dir / (stem + ".png"));
    if (pages_sweep) pages_png = std::make_unique<AtomicFile>(out_dir / (stem + "-pages.png"));
  }

  std::fprintf(stderr, "flashattn serve-bench: measuring the memory copy ceiling\n");
  bench::MemoryCopy copy(threads, o.quick ? std::size_t{16} << 20 : bench::default_copy_bytes());
  const double copy_gbps = bench::best_rate(copy, o.quick ? 0.01 : 0.25, o.quick ? 2 : 5) * 1e-9;
  std::printf("flashattn serve-bench on %s (%s), %d threads, %s\n", machine.cpu_model.c_str(),
              machine.host.c_str(), threads, machine.simd_target.c_str());
  std::printf("memory copy %.1f GB/s (read + written); Hq %lld, Hkv %lld, D %lld, q %s%s%s\n\n",
              copy_gbps, static_cast<long long>(o.heads_q), static_cast<long long>(o.heads_kv),
              static_cast<long long>(o.head_dim), o.q_dtype.c_str(),
              o.kv_layout == "HND" ? "; cache HND (each KV head's rows together)" : "",
              o.huge_pages ? "; cache on huge pages where the kernel grants them" : "");
  std::printf("%-7s %-6s %-5s %5s %8s %11s %9s %9s %8s %8s %6s %8s\n", "part", "cache", "dtype",
              "page", "requests", "KV tokens", "step ms", "tokens/s", "GB/s", "read", "/read",
              "paged/dense");

  std::mt19937_64 rng(o.seed);
  bool verified = true;
  std::vector<Row> rows;
  // The same requests at every page size.
  const std::vector<std::int32_t> lengths = draw_lengths(o, rng);
  for (const std::int64_t page_size : o.page_sizes) {
    rows.push_back(serve(o, lengths, page_size, threads, rng, verified));
    print_row(rows.back());
  }
  if (!o.no_single) {
    const int cases = static_cast<int>(o.single_dtypes.size() * o.single_seqlens.size());
    int done = 0;
    Progress progress("flashattn serve-bench: single-sequence cases", cases);
    for (const std::string& dtype : o.single_dtypes) {
      if (o.q_dtype != "f32" && dtype != o.q_dtype && !is_quantized(dtype_from(dtype))) continue;
      for (const std::int64_t length : o.single_seqlens) {
        for (const Row& row : single(o, dtype, length, threads, o.quick ? 3 : 15, rng, verified)) {
          rows.push_back(row);
          print_row(row);
        }
        progress.update(++done);
      }
    }
  }

  if (!o.no_prefill) {
    std::printf("\n%-7s %-6s %-5s %8s %11s %9s %11s %14s %14s\n", "part", "batch", "dtype", "seqs",
                "rows", "ms", "real GF/s", "computed GF/s", "varlen/padded");
    std::fprintf(stderr, "flashattn serve-bench: prefill, packed and padded\n");
    for (const Row& row : prefill(o, threads, rng, verified)) {
      rows.push_back(row);
      std::printf(
          "%-7s %-6s %-5s %8lld %11lld %9.1f %11s %14s %14s %s (error %.2g, tolerance "
          "%.2g)\n",
          row.part.c_str(), row.cache.c_str(), row.cache_dtype.c_str(),
          static_cast<long long>(row.requests), static_cast<long long>(row.kv_tokens),
          row.seconds * 1e3, optional_number("%.1f", row.real_gflops).c_str(),
          optional_number("%.1f", row.computed_gflops).c_str(),
          optional_number("%.3f", row.varlen_over_padded).c_str(),
          row.check.passed() ? "verified" : "FAILED", row.check.error, row.check.tolerance);
    }
  }

  std::string text =
      "date,host,threads,part,cache,q_dtype,cache_dtype,requests,kv_tokens,page_size,heads_q,"
      "heads_kv,head_dim,step_seconds,tokens_per_s,kv_gbps,read_gbps,ratio_read,"
      "paged_over_dense,copy_gbps,verified,max_error,tolerance,real_gflops,computed_gflops,"
      "varlen_over_padded,huge_page_share,kv_layout\n";
  for (const Row& row : rows) text += csv_line(machine, o, copy_gbps, row);
  csv.append(text);
  csv.commit();
  std::printf("\nwrote %s\n", fs::absolute(csv.path()).lexically_normal().c_str());
  // Draws one plot into `png`, or says why not in no_plot_reason.
  const auto draw = [&](AtomicFile& png, const std::vector<GbpsPoint>& points,
                        const std::string& xlabel) {
    const std::optional<std::string> failure = run_gnuplot(
        *gnuplot, serving_plot_script(png.temp_path(), machine, copy_gbps, points, xlabel));
    if (!failure && fs::file_size(png.temp_path(), error) > 0 && !error) {
      png.commit();
      std::printf("wrote %s\n", fs::absolute(png.path()).lexically_normal().c_str());
    } else {
      png.discard();
      no_plot_reason = failure.value_or("gnuplot wrote an empty file");
    }
  };
  const std::string shape = "Hq = " + std::to_string(o.heads_q) +
                            ", Hkv = " + std::to_string(o.heads_kv) +
                            ", D = " + std::to_string(o.head_dim) + ", q " + o.q_dtype;
  if (lengths_png) {
    std::vector<GbpsPoint> points;
    for (const Row& row : rows) {
      if (row.part != "single" || row.seconds == 0.0) continue;
      const int colour = 1 + static_cast<int>(dtype_from(row.cache_dtype));
      points.push_back({row.cache + " " + row.cache_dtype, row.cache == "paged" ? 1 : 2, colour,
                        row.kv_tokens, row.kv_gbps});
      if (row.cache == "dense") {
        points.push_back(
            {"read of K and V, " + row.cache_dtype, 3, colour, row.kv_tokens, row.read_gbps});
      }
    }
    draw(*lengths_png, points,
         "KV cache length (one sequence, one query row, " + shape + ", pages of " +
             std::to_string(o.page_sizes.front()) + ")");
  }
  if (pages_png) {
    // The server's GB/s against its page size, beside the read of the same pages in each round.
    std::vector<GbpsPoint> points;
    for (const Row& row : rows) {
      if (row.part != "serve" || row.seconds == 0.0) continue;
      points.push_back({"server, " + row.cache_dtype + " cache", 1, 1, row.page_size, row.kv_gbps});
      points.push_back({"read of its K and V", 3, 1, row.page_size, row.read_gbps});
    }
    draw(*pages_png, points,
         "rows per page (the server: " + std::to_string(o.requests) + " requests, " +
             std::to_string(rows.front().kv_tokens) + " keys, pages in shuffled order, " + shape +
             (o.huge_pages ? ", on huge pages" : "") + ")");
  }
  if (!no_plot_reason.empty()) std::printf("no plot: %s\n", no_plot_reason.c_str());
  if (!verified) {
    std::printf("verification FAILED: the failing part was not timed (verified = no)\n");
    return kExitMismatch;
  }
  return kExitOk;
}

}  // namespace

Action add_serve_bench_command(CLI::App& app) {
  auto options = std::make_shared<ServeOptions>();
  CLI::App* command = app.add_subcommand(
      "serve-bench", "Decode steps of an inference server: ragged batch, paged KV cache");
  command->footer(
      "Part 1, the server: --requests sequences of lengths log-uniform in [--min-len, --max-len]\n"
      "share a paged KV cache (pages of --page-size rows, handed out in shuffled order). Each\n"
      "step appends one token per request (kvcache_attention_forward with new K/V rows) and\n"
      "attends with one query row per request. The first step is verified against the fp64\n"
      "reference on --check-requests requests (the shortest, the longest, others between); then\n"
      "--steps steps are timed, each after a plain read of the cache's pages on the same threads.\n"
      "Reported: step time (median), tokens/s (requests per step time), GB/s of K and V read\n"
      "(each cached byte once per step), the read's GB/s, and /read: the median over the rounds\n"
      "of the step's GB/s over the read's. Several --page-size values run part 1 once per size\n"
      "on the same requests: small pages scatter the cache, which costs reads on most machines\n"
      "(bench/RESULTS.md), and --huge-pages shows how much of that the TLB takes.\n"
      "Part 2, one sequence: per --single-dtypes cache dtype and --single-seqlens length, one\n"
      "query row against a dense and a paged cache holding the same rows: both verified (and\n"
      "bitwise equal), then timed in rounds of (read dense, dense, paged, read paged): GB/s,\n"
      "/read, and paged/dense, the median over the rounds of the dense call's time over the\n"
      "paged call's.\n"
      "Part 3, prefill: --prefill-sequences causal sequences of lengths log-uniform in\n"
      "[--prefill-min, --prefill-max] in --q-dtype, packed (varlen_attention_forward) and padded\n"
      "to the longest (attention_forward on [B, longest, H, D]); both verified on each\n"
      "sequence's first, middle and last rows, then timed in alternation (median of 3): real\n"
      "GF/s counts the unpadded causal FLOPs, computed GF/s what the call computed (padding\n"
      "included), varlen/padded is varlen's real over the padded batch's computed GF/s.\n"
      "Writes <out-dir>/<YYYY-MM-DD>-<host>-serve.csv (-quick-serve.csv with --quick) and, with\n"
      "gnuplot, -serve.png (part 2's GB/s against the length) and, given several --page-size\n"
      "values, -serve-pages.png (the server's GB/s and its read's against the page size).\n"
      "Progress goes to stderr.\n"
      "Exit codes: 0 verified, 1 invalid arguments or unwritable output, 2 bad command line,\n"
      "3 a part failed verification (then not timed).");
  command->option_defaults()->always_capture_default();
  command->add_option("--requests", options->requests, "Requests in the batch")
      ->check(CLI::Range(1, 1 << 16));
  command->add_option("--min-len", options->min_len, "Shortest cached length")
      ->check(CLI::Range(1, 1 << 24));
  command->add_option("--max-len", options->max_len, "Longest cached length")
      ->check(CLI::Range(1, 1 << 24));
  command->add_option("--steps", options->steps, "Timed decode steps")
      ->check(CLI::Range(1, 100000));
  command
      ->add_option("--page-size", options->page_sizes,
                   "Rows per page; several (16,64,256) run part 1 once per size on the same "
                   "requests, and part 2 takes the first")
      ->delimiter(',')
      ->check(CLI::Range(1, 1 << 20));
  command->add_option("--heads-q", options->heads_q, "Query heads")->check(CLI::Range(1, 1024));
  command->add_option("--heads-kv", options->heads_kv, "KV heads")->check(CLI::Range(1, 1024));
  command->add_option("--head-dim", options->head_dim, "Head dimension")
      ->check(CLI::Range(1, 1024));
  command->add_option("--q-dtype", options->q_dtype, "dtype of q, out and the new rows")
      ->check(CLI::IsMember(kComputeDtypes));
  command
      ->add_option("--cache-dtype", options->cache_dtype,
                   "dtype of the KV cache: int8 and fp8 quantize the values (scales per row and "
                   "KV head; fp8's 1 / its largest code)")
      ->check(CLI::IsMember(kCacheDtypes));
  command
      ->add_option("--single-seqlens", options->single_seqlens,
                   "Lengths of part 2's single sequence")
      ->delimiter(',')
      ->check(CLI::Range(1, 1 << 24));
  command->add_option("--single-dtypes", options->single_dtypes, "Cache dtypes of part 2")
      ->delimiter(',')
      ->check(CLI::IsMember(kCacheDtypes));
  command->add_flag("--no-single", options->no_single, "Leave out part 2");
  command
      ->add_option("--prefill-sequences", options->prefill_sequences,
                   "Sequences of part 3's prefill")
      ->check(CLI::Range(1, 4096));
  command->add_option("--prefill-min", options->prefill_min, "Shortest prefill sequence")
      ->check(CLI::Range(1, 1 << 20));
  command->add_option("--prefill-max", options->prefill_max, "Longest prefill sequence")
      ->check(CLI::Range(1, 1 << 20));
  command->add_flag("--no-prefill", options->no_prefill, "Leave out part 3");
  command
      ->add_option("--check-requests", options->check_requests,
                   "Requests of the first step checked against the fp64 reference")
      ->check(CLI::Range(1, 1 << 16));
  add_threads_option(command, &options->threads);
  command->add_option("--seed", options->seed, "Random seed of the lengths, pages and values");
  command->add_option("--out-dir", options->out_dir, "Directory of the CSV and the plot");
  command->add_flag("--no-plot", options->no_plot, "Write the CSV only");
  command
      ->add_option("--kv-layout", options->kv_layout,
                   "How the cache's memory holds its rows: NHD, each key's heads together "
                   "([pages, page_size, Hkv, D], vLLM's and FlashAttention's layout), or HND, each "
                   "KV head's rows together ([pages, Hkv, page_size, D], FlashInfer's HND)")
      ->check(CLI::IsMember({"NHD", "HND"}))
      ->capture_default_str();
  command->add_flag("--huge-pages", options->huge_pages,
                    "Put the KV caches on transparent huge pages (madvise), as a server may; "
                    "the CSV's huge_page_share says how much the kernel granted");
  command->add_flag("--quick", options->quick,
                    "A tiny run for tests and smoke runs (4 requests of 40..600 rows, 3 steps, "
                    "part 2 at 300 rows); options given explicitly still win");
  return [options, command] { return run_serve_bench(*options, *command); };
}

}  // namespace flashattn::cli
