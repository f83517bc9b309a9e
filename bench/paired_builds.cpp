// Paired A/B of two builds of the library, for developers (not run by the tests): a change's
// effect on speed, measured where the host's load drifts faster than a benchmark runs.
//
//   flashattn_paired_builds BASE.so NEW.so [--pass forward|backward|kvcache] [shape options]
//
// kvcache: kvcache_attention_forward with f32 queries against a cache of --dtype, dense or in
// pages of --page-size rows handed out in shuffled order (a serving cache), every sequence
// --seqlen-kv keys long, --seqlen query rows each (1: decoding). A quantized cache (int8, fp8)
// holds the codes of normal(0, 1) values with a scale of 1/64 per row and KV head.
//
// Both builds are loaded into one process (dlopen, RTLD_LOCAL) and their calls alternate on the
// same inputs, base-new then new-base round by round, so that both see the same stretch of the
// host's load; the figure is the median over the rounds of new time / base time. Which build is
// loaded first moves that figure by itself, even between two copies of one build, so the tool
// runs the pairs twice, in a child process per load order, and reports the geometric mean of the
// two orders.
//
// This tool must not link the library: the copies it loads export the same symbols, and a
// linked copy would take their calls to one another (ELF interposition).

#include <dlfcn.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cache_aligned.hpp"
#include "flashattn/attention.hpp"
#include "flashattn/backward.hpp"
#include "flashattn/dtype.hpp"
#include "flashattn/kvcache.hpp"

extern char** environ;

namespace {

using flashattn::AttentionOptions;
using flashattn::ConstTensorView;
using flashattn::DType;
using flashattn::KVCacheView;
using flashattn::NewKeysValues;
using flashattn::TensorView;

using Forward = void (*)(const ConstTensorView&, const ConstTensorView&, const ConstTensorView&,
                         const TensorView&, float*, const AttentionOptions&);
using Backward = void (*)(const ConstTensorView&, const ConstTensorView&, const ConstTensorView&,
                          const ConstTensorView&, const ConstTensorView&, const float*,
                          const TensorView&, const TensorView&, const TensorView&,
                          const AttentionOptions&, const flashattn::ModifierGradients&);
using KVCacheForward = void (*)(const ConstTensorView&, const KVCacheView&, const std::int32_t*,
                                const NewKeysValues&, const TensorView&, float*,
                                const AttentionOptions&, flashattn::AttentionImpl);
// Itanium-mangled names of flashattn::flash_attention_forward and flash_attention_backward
// (include/flashattn/attention.hpp, backward.hpp). When a signature changes, dlsym says so;
// `nm -D --defined-only libflashattn.so | grep flash_attention_` gives the new names.
constexpr const char* kForwardSymbol =
    "_ZN9flashattn23flash_attention_forwardERKNS_15BasicTensorViewIPKvEES5_S5_RKNS0_IPvEEPfRKNS_"
    "16AttentionOptionsE";
constexpr const char* kBackwardSymbol =
    "_ZN9flashattn24flash_attention_backwardERKNS_15BasicTensorViewIPKvEES5_S5_S5_S5_PKfRKNS0_"
    "IPvEESB_SB_RKNS_16AttentionOptionsERKNS_17ModifierGradientsE";
constexpr const char* kKVCacheSymbol =
    "_ZN9flashattn25kvcache_attention_forwardERKNS_15BasicTensorViewIPKvEERKNS_11KVCacheViewEPKiRK"
    "NS_13NewKeysValuesERKNS0_IPvEEPfRKNS_16AttentionOptionsENS_13AttentionImplE";

struct Options {
  std::string base, candidate, pass = "forward", dtype = "f32", window;
  std::int64_t batch = 2, heads = 32, kv_heads = 0, seqlen = 1024, seqlen_kv = 0, head_dim = 128;
  std::int64_t page_size = 0;  // kvcache: 0 = dense
  bool causal = false;
  int pairs = 15, threads = 0;
  std::string new_first;  // internal: set in the child that loads the new build first
};

struct Build {
  Forward forward;
  Backward backward;
  KVCacheForward kvcache;
};

Build load(const std::string& path) {
  // A name without a slash would send dlopen to the library search path, not to this file.
  const std::string file = path.find('/') == std::string::npos ? "./" + path : path;
  void* handle = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) throw std::runtime_error("cannot load " + path + ": " + dlerror());
  auto symbol = [&](const char* name) {
    void* address = dlsym(handle, name);
    if (!address) throw std::runtime_error(path + " has no " + name + " (a changed signature?)");
    return address;
  };
  return {reinterpret_cast<Forward>(symbol(kForwardSymbol)),
          reinterpret_cast<Backward>(symbol(kBackwardSymbol)),
          reinterpret_cast<KVCacheForward>(symbol(kKVCacheSymbol))};
}

// A [B, S, H, D] tensor of normal(0, 1) values rounded to `dtype`, kept as raw bytes.
struct Tensor {
  DType dtype;
  std::array<std::int64_t, 4> shape;
  flashattn::bench::CacheAlignedVector<std::uint8_t> bytes;  // as a framework's tensors
  Tensor(DType dtype_, std::array<std::int64_t, 4> shape_, std::mt19937_64& rng)
      : dtype(dtype_), shape(shape_) {
    const std::int64_t count = shape[0] * shape[1] * shape[2] * shape[3];
    bytes.resize(static_cast<std::size_t>(count) * flashattn::dtype_size(dtype));
    std::normal_distribution<float> normal;
    for (std::int64_t i = 0; i < count; ++i) store_f32(bytes.data(), dtype, i, normal(rng));
  }
  ConstTensorView view() const { return flashattn::contiguous_view(bytes.data(), dtype, shape); }
  TensorView view() { return flashattn::contiguous_view(bytes.data(), dtype, shape); }
  float at(std::int64_t i) const { return load_f32(bytes.data(), dtype, i); }
};

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// One load order: prints "base_median new_median ratio_median max_abs_difference".
int run_pairs(const Options& options) {
  const bool new_first = options.new_first == "yes";
  Build builds[2];
  builds[new_first ? 1 : 0] = load(new_first ? options.candidate : options.base);
  builds[new_first ? 0 : 1] = load(new_first ? options.base : options.candidate);

  DType dtype = DType::f32;
  for (const DType candidate :
       {DType::f32, DType::f16, DType::bf16, DType::int8, DType::fp8_e4m3, DType::fp8_e5m2}) {
    if (options.dtype == flashattn::dtype_name(candidate)) dtype = candidate;
  }
  const std::int64_t kv_heads = options.kv_heads > 0 ? options.kv_heads : options.heads;
  const std::int64_t seqlen_kv = options.seqlen_kv > 0 ? options.seqlen_kv : options.seqlen;
  const std::array<std::int64_t, 4> q_shape{options.batch, options.seqlen, options.heads,
                                            options.head_dim};
  const std::array<std::int64_t, 4> kv_shape{options.batch, seqlen_kv, kv_heads, options.head_dim};
  std::mt19937_64 rng(42);
  const bool kvcache = options.pass == "kvcache";
  // The cache: [B, Skv, Hkv, D], or its rows in pages [pages, page_size, Hkv, D] whose block
  // table hands them out in shuffled order.
  const std::int64_t page_size = options.page_size,
                     pages_per_sequence =
                         page_size > 0 ? (seqlen_kv + page_size - 1) / page_size : 0;
  const std::array<std::int64_t, 4> cache_shape =
      page_size > 0 ? std::array<std::int64_t, 4>{options.batch * pages_per_sequence, page_size,
                                                  kv_heads, options.head_dim}
                    : kv_shape;
  std::vector<std::int32_t> block_table(
      static_cast<std::size_t>(options.batch * pages_per_sequence));
  for (std::size_t i = 0; i < block_table.size(); ++i)
    block_table[i] = static_cast<std::int32_t>(i);
  std::shuffle(block_table.begin(), block_table.end(), rng);
  const std::vector<std::int32_t> cache_seqlens(static_cast<std::size_t>(options.batch),
                                                static_cast<std::int32_t>(seqlen_kv));
  const DType q_dtype = kvcache ? DType::f32 : dtype;
  const std::array<std::int64_t, 4> scale_shape{cache_shape[0], cache_shape[1], kv_heads, 1};
  std::vector<float> scales(
      flashattn::is_quantized(dtype)
          ? static_cast<std::size_t>(scale_shape[0] * scale_shape[1] * kv_heads)
          : 0,
      1.0f / 64.0f);
  const Tensor q(q_dtype, q_shape, rng), k(dtype, kvcache ? cache_shape : kv_shape, rng),
      v(dtype, kvcache ? cache_shape : kv_shape, rng);
  const Tensor dout(dtype, q_shape, rng);
  AttentionOptions attention;
  attention.causal = options.causal;
  attention.num_threads = options.threads;
  if (!options.window.empty()) {  // checked when parsed
    std::sscanf(options.window.c_str(), "%ld,%ld", &attention.window_left, &attention.window_right);
  }
  const bool backward = options.pass == "backward";
  const std::size_t lse_count = static_cast<std::size_t>(q_shape[0] * q_shape[1] * q_shape[2]);

  // Each build's outputs, compared once: a change that moves the results should say by how much.
  std::vector<Tensor> out(2, Tensor(q_dtype, q_shape, rng)), grads;
  std::vector<std::vector<float>> lse(2, std::vector<float>(lse_count));
  for (int i = 0; i < 2; ++i) {
    grads.emplace_back(dtype, q_shape, rng);
    grads.emplace_back(dtype, kv_shape, rng);
    grads.emplace_back(dtype, kv_shape, rng);
  }
  auto call = [&](int build) {
    if (kvcache) {
      KVCacheView cache{
          flashattn::contiguous_view(const_cast<std::uint8_t*>(k.bytes.data()), dtype, cache_shape),
          flashattn::contiguous_view(const_cast<std::uint8_t*>(v.bytes.data()), dtype,
                                     cache_shape)};
      if (flashattn::is_quantized(dtype)) {
        cache.k_scale = flashattn::contiguous_view(scales.data(), scale_shape);
        cache.v_scale = cache.k_scale;
      }
      if (page_size > 0) {
        cache.block_table = block_table.data();
        cache.pages_per_sequence = pages_per_sequence;
      }
      builds[build].kvcache(q.view(), cache, cache_seqlens.data(), {}, out[build].view(),
                            lse[build].data(), attention, flashattn::AttentionImpl::flash);
      return;
    }
    if (!backward) {
      builds[build].forward(q.view(), k.view(), v.view(), out[build].view(), lse[build].data(),
                            attention);
      return;
    }
    builds[build].backward(dout.view(), q.view(), k.view(), v.view(), out[0].view(), lse[0].data(),
                           grads[3 * build].view(), grads[3 * build + 1].view(),
                           grads[3 * build + 2].view(), attention, {});
  };
  // The backward of both builds reads the base build's forward.
  if (backward)
    builds[0].forward(q.view(), k.view(), v.view(), out[0].view(), lse[0].data(), attention);
  for (int build = 0; build < 2; ++build) call(build);  // warm-up, and the outputs compared
  double difference = 0.0;
  auto compare = [&](const Tensor& a, const Tensor& b) {
    for (std::size_t i = 0; i < a.bytes.size() / flashattn::dtype_size(a.dtype); ++i) {
      difference =
          std::max(difference, static_cast<double>(std::abs(a.at(static_cast<std::int64_t>(i)) -
                                                            b.at(static_cast<std::int64_t>(i)))));
    }
  };
  if (backward) {
    for (int g = 0; g < 3; ++g) compare(grads[g], grads[3 + g]);
  } else {
    compare(out[0], out[1]);
  }

  std::vector<double> seconds[2], ratios;
  for (int round = 0; round < options.pairs; ++round) {
    for (int slot = 0; slot < 2; ++slot) {
      const int build = round % 2 == 0 ? slot : 1 - slot;
      const auto start = std::chrono::steady_clock::now();
      call(build);
      seconds[build].push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    ratios.push_back(seconds[1].back() / seconds[0].back());
  }
  std::printf("%.9g %.9g %.9g %.9g\n", median(seconds[0]), median(seconds[1]), median(ratios),
              difference);
  return 0;
}

// Runs this tool again with `args` (argv[0] first) and returns its standard output.
std::string run_child(const std::vector<std::string>& args) {
  int pipe_fds[2];
  if (pipe(pipe_fds) != 0) throw std::runtime_error("pipe failed");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], 1);
  posix_spawn_file_actions_addclose(&actions, pipe_fds[0]);
  std::vector<std::string> all = args;
  std::vector<char*> argv;
  for (std::string& arg : all) argv.push_back(arg.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int spawned = posix_spawn(&pid, "/proc/self/exe", &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(pipe_fds[1]);
  if (spawned != 0) throw std::runtime_error("cannot start /proc/self/exe");
  std::string text;
  char buffer[256];
  ssize_t got = 0;
  while ((got = read(pipe_fds[0], buffer, sizeof(buffer))) > 0)
    text.append(buffer, static_cast<std::size_t>(got));
  close(pipe_fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw std::runtime_error("the child run failed: " + text);
  return text;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Paired A/B of two library builds: new time / base time, both load orders"};
  Options options;
  app.add_option("base", options.base, "Base build (libflashattn.so.0)")
      ->required()
      ->check(CLI::ExistingFile);
  app.add_option("new", options.candidate, "New build")->required()->check(CLI::ExistingFile);
  app.add_option("--pass", options.pass,
                 "forward, backward (flash path) or kvcache (f32 q, cache of --dtype)")
      ->check(CLI::IsMember({"forward", "backward", "kvcache"}))
      ->capture_default_str();
  app.add_option("--dtype", options.dtype, "int8, fp8_e4m3 and fp8_e5m2: kvcache only")
      ->check(CLI::IsMember({"f32", "f16", "bf16", "int8", "fp8_e4m3", "fp8_e5m2"}));
  app.add_option("--batch", options.batch)->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--heads", options.heads)->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--kv-heads", options.kv_heads, "0 = as --heads")->check(CLI::NonNegativeNumber);
  app.add_option("--seqlen", options.seqlen)->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--seqlen-kv", options.seqlen_kv, "0 = as --seqlen")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--head-dim", options.head_dim)->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--page-size", options.page_size,
                 "kvcache: rows per page, pages in shuffled order (0 = a dense cache)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--causal", options.causal);
  app.add_option("--window", options.window, "L,R (-1 = unbounded)")
      ->check([](const std::string& text) -> std::string {
        long left = 0, right = 0;
        return std::sscanf(text.c_str(), "%ld,%ld", &left, &right) == 2 ? "" : "expected L,R";
      });
  app.add_option("--pairs", options.pairs, "Rounds of one call of each build")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--threads", options.threads, "0 = all")
      ->check(CLI::Range(0, flashattn::kMaxThreads));
  app.add_option("--new-first", options.new_first)->group("");  // internal: the child runs
  CLI11_PARSE(app, argc, argv);
  const bool quantized = options.dtype == "int8" || options.dtype.starts_with("fp8");
  if (quantized && options.pass != "kvcache") {
    std::fprintf(stderr,
                 "--dtype: %s is a cache dtype, which only --pass kvcache takes, got --pass %s\n",
                 options.dtype.c_str(), options.pass.c_str());
    return 2;
  }

  try {
    if (!options.new_first.empty()) return run_pairs(options);
    std::printf(
        "%s, %s%s, B %ld, H %ld/%ld, S %ld/%ld, D %ld%s%s, %d pairs per load order\n",
        options.pass.c_str(), options.dtype.c_str(),
        options.pass != "kvcache" ? ""
        : options.page_size > 0
            ? (" cache in pages of " + std::to_string(options.page_size)).c_str()
            : " dense cache",
        options.batch, options.heads, options.kv_heads > 0 ? options.kv_heads : options.heads,
        options.seqlen, options.seqlen_kv > 0 ? options.seqlen_kv : options.seqlen,
        options.head_dim, options.causal ? ", causal" : "",
        options.window.empty() ? "" : (", window " + options.window).c_str(), options.pairs);
    std::printf("%-12s %16s %16s %18s %14s\n", "loaded first", "base median (ms)",
                "new median (ms)", "new / base pairs", "max |new-base|");
    double log_ratio = 0.0;
    for (const char* new_first : {"no", "yes"}) {
      std::vector<std::string> args(argv, argv + argc);
      args[0] = "flashattn_paired_builds";
      args.insert(args.end(), {"--new-first", new_first});
      std::istringstream result(run_child(args));
      double base = 0, candidate = 0, ratio = 0, difference = 0;
      result >> base >> candidate >> ratio >> difference;
      std::printf("%-12s %16.3f %16.3f %18.3f %14.3g\n",
                  std::string(new_first) == "yes" ? "new" : "base", base * 1e3, candidate * 1e3,
                  ratio, difference);
      log_ratio += std::log(ratio) / 2.0;
    }
    std::printf("new / base time: %.3f (geometric mean of the two load orders)\n",
                std::exp(log_ratio));
  } catch (const std::exception& error) {
    std::fprintf(stderr, "flashattn_paired_builds: error: %s\n", error.what());
    return 1;
  }
  return 0;
}
