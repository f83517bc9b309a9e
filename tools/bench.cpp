// `flashattn bench`: the FlashAttention path and the standard path on the same inputs and the same
// threads, each verified against the fp64 reference before it is timed, next to the machine's
// ceilings measured in the same run (DESIGN.md §5). With --backward, each path's backward follows
// its forward on the same inputs, verified on one (batch, KV head) slice before it is timed.
// Decode cases (one query position against a long KV cache) come last, timed as K and V bytes
// read per second against the memory copy ceiling (DESIGN.md §5: decode is memory-bound).
// Writes one CSV row per case and path, and a plot of GFLOP/s against seqlen (and one of the
// backward's).

#include <cblas.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "api/memory.hpp"
#include "api/params.hpp"
#include "atomic_file.hpp"
#include "backward_check.hpp"
#include "ceilings.hpp"
#include "cli_common.hpp"
#include "cpu/kernels/bf16_products.hpp"
#include "cpu/kernels/tile_kernels.hpp"
#include "cpu/kernels/tile_kernels_amx.hpp"
#include "cpu/kernels/tile_kernels_bf16.hpp"
#include "flashattn/attention.hpp"
#include "flashattn/backward.hpp"
#include "flashattn/dtype.hpp"
#include "flashattn/error.hpp"
#include "verify.hpp"

extern char** environ;

// Weak: the sanitizer builds (FLASHATTN_PLAIN_BLAS) link a plain-loop sgemm instead of OpenBLAS,
// and there the function does not exist.
#pragma weak openblas_get_corename

namespace flashattn::cli {
namespace {

namespace fs = std::filesystem;

// 2^34 FLOPs, about the seed shape's causal FLOPs (17.2 GFLOP): the work of one sweep point.
constexpr double kDefaultWorkGflop = 17.179869184;

struct BenchOptions {
  std::vector<std::int64_t> seqlens = {512, 1024, 2048, 4096, 8192, 16384};
  std::vector<std::int64_t> head_dims = {64, 128};
  std::vector<std::string> dtypes = {"f32", "bf16"};
  std::vector<std::string> impls = {"flash", "standard"};
  bool causal = false, non_causal = false, both = false;
  bool no_seed_shape = false;
  bool no_sweep = false;
  double work_gflop = kDefaultWorkGflop;
  int threads = 0;
  int repeat = 3;
  std::int64_t check_rows = 8;
  std::uint64_t seed = 42;
  std::string out_dir = "bench/results";
  bool no_plot = false;
  bool quick = false;
  bool backward = false;
  double backward_reference_gflop = kReferenceBackwardBudgetFlops * 1e-9;
  std::vector<std::int64_t> decode_seqlens = {4096, 16384, 65536};
  bool no_decode = false;
  bool scaling = false;  // flash on one thread too for every forward case, not only the seed shape
};

// The decode cases: one new query position per sequence against a KV cache, GQA as in current
// models (32 query heads reading 8 KV heads of 128 dims).
constexpr std::int64_t kDecodeHeadsQ = 32, kDecodeHeadsKv = 8, kDecodeHeadDim = 128;
// Decode calls take milliseconds: more timed runs than a sweep point's for a steady median.
constexpr int kDecodeMinRepeat = 15;

// How long and how often each ceiling is measured.
struct CeilingBudget {
  double seconds = 0.25;
  int trials = 5;
  std::int64_t sgemm_seqlen = 1024;
  std::size_t copy_bytes = 0;  // 0: bench::default_copy_bytes()
};

struct Ceilings {
  double fma_gflops = 0.0;
  std::optional<double> bf16_dot_gflops;
  std::optional<double> amx_gflops;
  std::map<std::int64_t, double> sgemm_gflops;  // by head_dim
  double copy_gbps = 0.0;
  std::string fma_target;
};

struct Case {
  DType dtype = DType::f32;
  std::int64_t batch = 1, heads = 1, seqlen = 0, head_dim = 0;
  bool causal = true;
  bool seed_shape = false;  // the seed's [2, 32, 1024, 128], not a sweep point
  // Decode: one query position against `seqlen` keys and values of heads_kv heads, timed as K
  // and V bytes read per second; the sweep's cases have seqlen_q = seqlen_kv and heads_kv = heads.
  bool decode = false;
  std::int64_t heads_kv = 0;  // 0: heads

  std::int64_t seqlen_q() const { return decode ? 1 : seqlen; }
  std::int64_t kv_heads() const { return heads_kv > 0 ? heads_kv : heads; }
  // The bytes of K and V, each read once by a decode call.
  double kv_bytes() const {
    return 2.0 * static_cast<double>(batch * seqlen * kv_heads() * head_dim) *
           static_cast<double>(dtype_size(dtype));
  }
};

// A forward path's timed calls, each right after a run of the peak loop of its dtype (PeakRun,
// `peak_flops` a run): the median seconds of those runs and the median over the pairs of call
// time / run time.
struct PeakPairs {
  double peak_flops = 0.0, peak_seconds = 0.0, over_peak = 0.0;

  // The peak loop's GFLOP/s in those runs.
  std::optional<double> peak_gflops() const {
    if (peak_seconds <= 0.0) return std::nullopt;
    return peak_flops / peak_seconds * 1e-9;
  }
  // The median over the pairs of the call's GFLOP/s over the run's, for calls of `flops`.
  std::optional<double> ratio(double flops) const {
    if (peak_flops <= 0.0 || over_peak <= 0.0) return std::nullopt;
    return flops / peak_flops / over_peak;
  }
};

// One path's backward: verified then timed, failed (not timed), or skipped (not run, `reason`
// says why).
struct BackwardResult {
  enum class Status { verified, failed, skipped };
  Status status = Status::skipped;
  std::string oracle, reason;
  BackwardChecks checks;
  std::optional<double> seconds, cpu_share;
  // Timed alternately with the path's forward (round_robin_seconds): that forward's median
  // seconds and the median of backward / forward over the pairs.
  std::optional<double> forward_seconds, over_forward;
  // The forward's runs against the peak loop's run before each (PathResult::peak).
  std::optional<PeakPairs> peak;
};

const char* status_name(BackwardResult::Status status) {
  switch (status) {
    case BackwardResult::Status::verified:
      return "yes";
    case BackwardResult::Status::failed:
      return "no";
    case BackwardResult::Status::skipped:
      return "skipped";
  }
  return "";
}

struct PathResult {
  AttentionImpl impl = AttentionImpl::flash;
  bool verified = false;
  PathErrors errors;
  Tolerance tolerance;
  std::optional<double> seconds;  // empty: not timed (failed verification)
  // CPU time this process used during the timed calls over their wall time times the threads:
  // about 1 when the threads had the cores to themselves, less when another process took some.
  std::optional<double> cpu_share;
  std::optional<BackwardResult> backward;  // with --backward
  // Decode cases: each call alternated with a read of the same K and V on the same threads
  // (bench::MemoryRead): that read's median seconds and the median over the pairs of read time /
  // call time, the call's bandwidth as a fraction of that ceiling in the same stretch of load.
  std::optional<double> read_seconds, over_read;
  // The other cases: each timed call right after a run of the dtype's peak loop (PeakRun).
  std::optional<PeakPairs> peak;
  // Flash on the seed shape (every forward case with --scaling) and more than one thread: calls
  // on one thread alternated with calls on all of them, the median seconds of the one-thread
  // calls and the median over the pairs of one-thread time / all-threads time, the speed-up.
  std::optional<double> one_thread_seconds, speedup_over_one_thread;
};

struct CaseResult {
  Case shape;
  double flops = 0.0;
  double backward_flops = 0.0;    // 2.5 x flops, attention_backward_flops
  std::vector<PathResult> paths;  // the timed ones, in --impls order

  const PathResult* find(AttentionImpl impl) const {
    for (const PathResult& path : paths) {
      if (path.impl == impl) return &path;
    }
    return nullptr;
  }
  std::optional<double> gflops(AttentionImpl impl) const {
    const PathResult* path = find(impl);
    if (path == nullptr || !path->seconds || *path->seconds <= 0.0) return std::nullopt;
    return flops / *path->seconds * 1e-9;
  }
  // Decode cases: K and V bytes read per second, in GB/s.
  std::optional<double> kv_gbps(AttentionImpl impl) const {
    const PathResult* path = find(impl);
    if (!shape.decode || path == nullptr || !path->seconds || *path->seconds <= 0.0) {
      return std::nullopt;
    }
    return shape.kv_bytes() / *path->seconds * 1e-9;
  }
  // Decode cases: the read ceiling timed with `impl`'s calls, in GB/s.
  std::optional<double> read_gbps(AttentionImpl impl) const {
    const PathResult* path = find(impl);
    if (path == nullptr || !path->read_seconds || *path->read_seconds <= 0.0) return std::nullopt;
    return shape.kv_bytes() / *path->read_seconds * 1e-9;
  }
  std::optional<double> backward_gflops(AttentionImpl impl) const {
    const PathResult* path = find(impl);
    if (path == nullptr || !path->backward || !path->backward->seconds ||
        *path->backward->seconds <= 0.0) {
      return std::nullopt;
    }
    return backward_flops / *path->backward->seconds * 1e-9;
  }
  // Backward time over the same path's forward time.
  std::optional<double> backward_over_forward(AttentionImpl impl) const {
    const PathResult* path = find(impl);
    if (path == nullptr || !path->seconds || *path->seconds <= 0.0 || !path->backward ||
        !path->backward->seconds) {
      return std::nullopt;
    }
    if (path->backward->over_forward) return path->backward->over_forward;
    return *path->backward->seconds / *path->seconds;
  }
};

struct Machine {
  std::string date, host, cpu_model, simd_target, bf16_products, openblas_core, openblas_coretype;
  int threads = 0;
};

std::string cpu_model() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) {
      const std::size_t colon = line.find(':');
      if (colon != std::string::npos) {
        const std::size_t start = line.find_first_not_of(" \t", colon + 1);
        return start == std::string::npos ? "" : line.substr(start);
      }
    }
  }
  return "unknown";
}

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "unknown-host";
  return name;
}

// The host name as it goes into a file name: letters, digits, '.', '-' and '_' only.
std::string file_name_safe(std::string text) {
  for (char& c : text) {
    const bool keep = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                      c == '.' || c == '-' || c == '_';
    if (!keep) c = '_';
  }
  return text;
}

std::string today() {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char text[16];
  std::strftime(text, sizeof(text), "%Y-%m-%d", &local);
  return text;
}

Machine describe_machine(int threads) {
  const char* coretype = std::getenv("OPENBLAS_CORETYPE");
  const char* core = openblas_get_corename != nullptr ? openblas_get_corename() : nullptr;
  return {.date = today(),
          .host = host_name(),
          .cpu_model = cpu_model(),
          .simd_target = detail::cpu::active_simd_target(),
          .bf16_products = detail::cpu::bf16_products_name(detail::cpu::active_bf16_products()),
          .openblas_core = core != nullptr ? core : "none (OpenBLAS not linked)",
          .openblas_coretype = coretype != nullptr ? coretype : "",
          .threads = threads};
}

std::string format(const char* pattern, double value) {
  char text[64];
  std::snprintf(text, sizeof(text), pattern, value);
  return text;
}

std::string optional_number(const char* pattern, std::optional<double> value) {
  return value ? format(pattern, *value) : "";
}

// The peak that bounds a dtype's tile products: the f32 FMA peak, and for bf16 the largest of
// that, the vdpbf16ps peak and the AMX peak, as bf16 products may run any of those ways.
double peak_for(const Ceilings& ceilings, DType dtype) {
  double peak = ceilings.fma_gflops;
  if (dtype == DType::bf16) {
    peak =
        std::max({peak, ceilings.bf16_dot_gflops.value_or(0.0), ceilings.amx_gflops.value_or(0.0)});
  }
  return peak;
}

// A run of the loop that measured a dtype's peak (peak_for), sized to about kPeakRunSeconds at
// that peak. Each timed forward call follows one, so that the call's GFLOP/s can also be read
// against the peak in the same stretch of a shared machine's load (ratio_peak_paired), besides
// against the best rate measured before the cases (ratio_peak).
constexpr double kPeakRunSeconds = 0.02;

class PeakRun {
 public:
  PeakRun(bench::Workload& workload, double gflops)
      : workload_(&workload),
        count_(std::max<std::int64_t>(
            1, std::llround(kPeakRunSeconds * gflops * 1e9 / workload.work_per_unit()))) {}
  void operator()() const { workload_->run(count_); }
  double flops() const { return workload_->work_per_unit() * static_cast<double>(count_); }

 private:
  bench::Workload* workload_;
  std::int64_t count_;
};

// The peak loops of measure_ceilings, kept for the PeakRuns of the cases.
class PeakLoops {
 public:
  PeakLoops(int threads, const Ceilings& ceilings) : ceilings_(ceilings), fma_(threads) {
    if (ceilings.bf16_dot_gflops) bf16_dot_.emplace(threads);
    if (ceilings.amx_gflops) amx_.emplace(threads);
  }
  PeakRun run_for(DType dtype) {
    const double peak = peak_for(ceilings_, dtype);
    if (dtype == DType::bf16 && amx_ && ceilings_.amx_gflops == peak) return {*amx_, peak};
    if (dtype == DType::bf16 && bf16_dot_ && ceilings_.bf16_dot_gflops == peak) {
      return {*bf16_dot_, peak};
    }
    return {fma_, peak};
  }

 private:
  const Ceilings& ceilings_;
  bench::FmaPeak fma_;
  std::optional<bench::Bf16DotPeak> bf16_dot_;
  std::optional<bench::AmxPeak> amx_;
};

Ceilings measure_ceilings(int threads, const std::set<std::int64_t>& head_dims,
                          const CeilingBudget& budget) {
  Ceilings ceilings;
  ceilings.fma_target = bench::FmaPeak::target();
  std::fprintf(stderr, "flashattn bench: ceilings: f32 FMA peak (%s)\n",
               ceilings.fma_target.c_str());
  bench::FmaPeak fma(threads);
  ceilings.fma_gflops = bench::best_rate(fma, budget.seconds, budget.trials) * 1e-9;
  if (bench::Bf16DotPeak::supported()) {
    std::fprintf(stderr, "flashattn bench: ceilings: bf16 dot peak (vdpbf16ps)\n");
    bench::Bf16DotPeak bf16(threads);
    ceilings.bf16_dot_gflops = bench::best_rate(bf16, budget.seconds, budget.trials) * 1e-9;
  }
  if (detail::cpu::amx_supported()) {
    std::fprintf(stderr, "flashattn bench: ceilings: AMX bf16 peak (tdpbf16ps)\n");
    bench::AmxPeak amx(threads);
    ceilings.amx_gflops = bench::best_rate(amx, budget.seconds, budget.trials) * 1e-9;
  }
  for (const std::int64_t head_dim : head_dims) {
    std::fprintf(stderr, "flashattn bench: ceilings: sgemm pairs %lld x %lld x %lld\n",
                 static_cast<long long>(budget.sgemm_seqlen),
                 static_cast<long long>(budget.sgemm_seqlen), static_cast<long long>(head_dim));
    bench::SgemmPairs sgemm(threads, budget.sgemm_seqlen, head_dim);
    ceilings.sgemm_gflops[head_dim] = bench::best_rate(sgemm, budget.seconds, budget.trials) * 1e-9;
  }
  const std::size_t copy_bytes =
      budget.copy_bytes > 0 ? budget.copy_bytes : bench::default_copy_bytes();
  std::fprintf(stderr, "flashattn bench: ceilings: memory copy of %zu MiB\n", copy_bytes >> 20);
  bench::MemoryCopy copy(threads, copy_bytes);
  ceilings.copy_gbps = bench::best_rate(copy, budget.seconds, budget.trials) * 1e-9;
  return ceilings;
}

// Sweep points: batch 1 and as many heads as bring one call to about `work_gflop` (at least one).
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

// User + system CPU seconds of this process, all threads.
double process_cpu_seconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  auto seconds = [](const timeval& time) {
    return static_cast<double>(time.tv_sec) + 1e-6 * static_cast<double>(time.tv_usec);
  };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

// NaN everywhere, so that an element a path fails to write cannot pass verification.
void poison(HostTensor& tensor, std::vector<float>& lse) {
  fill_nan(tensor);
  std::fill(lse.begin(), lse.end(), std::numeric_limits<float>::quiet_NaN());
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

// CPU time this process uses while `runs` runs over its wall time times the threads.
std::optional<double> cpu_share_of(int threads, const std::function<void()>& runs) {
  const double cpu_before = process_cpu_seconds();
  const auto start = std::chrono::steady_clock::now();
  runs();
  const double wall =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (wall <= 0.0) return std::nullopt;
  return (process_cpu_seconds() - cpu_before) / (wall * threads);
}

std::span<const std::byte> bytes_of(const HostTensor& tensor) {
  return {static_cast<const std::byte*>(tensor.data()),
          static_cast<std::size_t>(tensor.numel()) * dtype_size(tensor.dtype)};
}

// The backward half of a case: a fixed random dO, the gradients and their oracle. Each path's
// backward reads the out and lse of that path's own forward, which `out` and `lse` hold when run()
// is called right after it.
class BackwardRun {
 public:
  BackwardRun(const HostTensor& q, const HostTensor& k, const HostTensor& v, const HostTensor& out,
              const std::vector<float>& lse, const AttentionOptions& options,
              const std::vector<std::int64_t>& rows, double reference_budget_flops,
              std::mt19937_64& rng)
      : dout_(random_tensor(q.dtype, q.shape, rng)),
        dq_(q.dtype, q.shape),
        dk_(k.dtype, k.shape),
        dv_(v.dtype, v.shape),
        problem_{q, k, v, dout_, out, lse, options},
        oracle_(problem_, rows, reference_budget_flops) {}

  // Checks `impl`'s backward and, when it passes and `timed`, times it (median of `repeat`), in
  // alternation with `forward`, the path's forward, and `peak` before that. The standard path
  // runs even when not timed, on the slice only: its error is the baseline of the flash
  // tolerance, and its dK, dV the oracle where the reference would cost too much.
  BackwardResult run(AttentionImpl impl, bool timed, int repeat, int threads,
                     const std::function<void()>& forward, const PeakRun& peak) {
    BackwardResult result;
    if (impl == AttentionImpl::standard) {
      if (std::optional<std::string> refusal = standard_refusal()) {
        result.reason = *refusal;
        return result;
      }
      if (!timed) {
        oracle_.check_standard(oracle_.run_on_slice(AttentionImpl::standard, threads));
        return result;
      }
    }
    auto call = [&] {
      attention_backward(impl, dout_.view(), problem_.q.view(), problem_.k.view(),
                         problem_.v.view(), problem_.out.view(), problem_.lse.data(), dq_.view(),
                         dk_.view(), dv_.view(), problem_.options);
    };
    fill_nan(dq_);
    fill_nan(dk_);
    fill_nan(dv_);
    call();
    const SliceGradients slice = oracle_.slice_of(dq_, dk_, dv_);
    result.checks = impl == AttentionImpl::standard ? oracle_.check_standard(slice)
                                                    : oracle_.check_flash(slice);
    result.oracle = oracle_.name(impl);
    if (!result.checks.passes()) {
      result.status = BackwardResult::Status::failed;
      return result;
    }
    result.status = BackwardResult::Status::verified;
    // The forward rewrites out and lse with the same values (it is deterministic), so each
    // backward still reads its own forward's outputs.
    RoundSeconds rounds;
    result.cpu_share = cpu_share_of(threads, [&] {
      rounds = round_robin_seconds(repeat, {[&] { peak(); }, forward, call});
    });
    result.peak = PeakPairs{peak.flops(), rounds.median[0], rounds.over_previous[1]};
    result.forward_seconds = rounds.median[1];
    result.seconds = rounds.median[2];
    result.over_forward = rounds.over_previous[2];
    return result;
  }

 private:
  // The standard backward holds two seqlen_q x seqlen_kv fp32 matrices per thread; where the
  // library would refuse that for lack of memory, say so instead of stopping the sweep.
  std::optional<std::string> standard_refusal() {
    const detail::BackwardParams params =
        detail::make_backward_params("bench", dout_.view(), problem_.q.view(), problem_.k.view(),
                                     problem_.v.view(), problem_.out.view(), problem_.lse.data(),
                                     dq_.view(), dk_.view(), dv_.view(), problem_.options);
    const std::int64_t needed = detail::backward_scratch_bytes(AttentionImpl::standard, params);
    const std::int64_t limit = detail::memory_limit_bytes();
    if (needed <= limit) return std::nullopt;
    return "the standard backward needs " + std::to_string(needed >> 20) + " MiB of scratch, " +
           "more than the " + std::to_string(limit >> 20) + " MiB of this machine";
  }

  HostTensor dout_, dq_, dk_, dv_;
  BackwardProblem problem_;
  BackwardOracle oracle_;
};

// Runs one case: the standard path first (its error against the reference is the baseline of
// the flash tolerance, so it runs even when only flash is timed), then flash; each path's first
// call is verified and doubles as the warm-up of its timed calls. With --backward, each path's
// backward runs right after its forward, while `out` and `lse` still hold that forward's outputs,
// and a verified backward is timed in alternation with the forward, whose time comes from those
// runs (backward / forward then compares calls made back to back on a machine whose load drifts).
CaseResult run_case(const Case& shape, const BenchOptions& options, int threads,
                    const PeakRun& peak) {
  std::mt19937_64 rng(options.seed);
  const std::array<std::int64_t, 4> dims = {shape.batch, shape.seqlen_q(), shape.heads,
                                            shape.head_dim};
  const std::array<std::int64_t, 4> kv_dims = {shape.batch, shape.seqlen, shape.kv_heads(),
                                               shape.head_dim};
  const HostTensor q = random_tensor(shape.dtype, dims, rng);
  const HostTensor k = random_tensor(shape.dtype, kv_dims, rng);
  const HostTensor v = random_tensor(shape.dtype, kv_dims, rng);
  const int repeat = shape.decode ? std::max(options.repeat, kDecodeMinRepeat) : options.repeat;
  AttentionOptions attention;
  attention.causal = shape.causal;
  attention.num_threads = threads;

  CaseResult result;
  result.shape = shape;
  result.flops = attention_flops(shape.batch, shape.heads, shape.seqlen_q(), shape.seqlen,
                                 shape.head_dim, attention);
  result.backward_flops = attention_backward_flops(shape.batch, shape.heads, shape.seqlen_q(),
                                                   shape.seqlen, shape.head_dim, attention);
  const std::vector<std::int64_t> rows = sample_rows(shape.seqlen_q(), options.check_rows, rng);
  const ReferenceRows reference = reference_rows(q, k, v, attention, rows);

  HostTensor out(shape.dtype, dims);
  std::vector<float> lse(static_cast<std::size_t>(shape.batch * shape.heads * shape.seqlen_q()));
  // After the forward's draws, so that --backward leaves the forward's inputs and rows as they
  // were. Decoding has no backward.
  std::optional<BackwardRun> backward;
  if (options.backward && !shape.decode)
    backward.emplace(q, k, v, out, lse, attention, rows, options.backward_reference_gflop * 1e9,
                     rng);
  PathErrors standard_errors;
  bool standard_verified = false;
  for (const AttentionImpl impl : {AttentionImpl::standard, AttentionImpl::flash}) {
    auto call = [&] {
      attention_forward(impl, q.view(), k.view(), v.view(), out.view(), lse.data(), attention);
    };
    poison(out, lse);
    call();
    PathResult path;
    path.impl = impl;
    path.errors = errors_against(reference, out, lse);
    if (impl == AttentionImpl::standard) {
      standard_errors = path.errors;
      path.tolerance = standard_error_bound(q, k, v, attention, rows);
    } else {
      path.tolerance = tolerance_from_standard(standard_errors, shape.dtype, max_abs(v));
    }
    // Flash's tolerance is relative to the standard path's error, so it means nothing when the
    // standard path itself is off.
    path.verified = path.tolerance.admits(path.errors) &&
                    (impl == AttentionImpl::standard || standard_verified);
    if (impl == AttentionImpl::standard) standard_verified = path.verified;
    const bool timed = std::find(options.impls.begin(), options.impls.end(), impl_name(impl)) !=
                       options.impls.end();
    if (backward) {
      if (path.verified) {
        path.backward = backward->run(impl, timed, repeat, threads, call, peak);
        if (path.backward->forward_seconds) {
          path.seconds = path.backward->forward_seconds;
          path.cpu_share = path.backward->cpu_share;
          path.peak = path.backward->peak;
        }
      } else {
        path.backward.emplace();
        path.backward->reason = "its forward failed verification";
      }
    }
    if (timed && path.verified && shape.decode) {
      bench::MemoryRead read(threads, {bytes_of(k), bytes_of(v)});
      PairedSeconds times;
      path.cpu_share = cpu_share_of(threads, [&] {
        times = paired_median_seconds(
            repeat, [&] { read.run(1); }, call);
      });
      path.read_seconds = times.first;
      path.seconds = times.second;
      if (times.second_over_first > 0.0) path.over_read = 1.0 / times.second_over_first;
    }
    if (timed && path.verified && !path.seconds) {
      PairedSeconds times;
      path.cpu_share = cpu_share_of(threads, [&] {
        times = paired_median_seconds(
            repeat, [&] { peak(); }, call);
      });
      path.peak = PeakPairs{peak.flops(), times.first, times.second_over_first};
      path.seconds = times.second;
    }
    if (timed && path.verified && impl == AttentionImpl::flash && !shape.decode && threads > 1 &&
        (shape.seed_shape || options.scaling)) {
      AttentionOptions one_thread = attention;
      one_thread.num_threads = 1;
      const PairedSeconds times = paired_median_seconds(repeat, call, [&] {
        attention_forward(impl, q.view(), k.view(), v.view(), out.view(), lse.data(), one_thread);
      });
      path.one_thread_seconds = times.second;
      path.speedup_over_one_thread = times.second_over_first;
    }
    if (timed) result.paths.push_back(path);
  }
  // --impls order.
  std::stable_sort(result.paths.begin(), result.paths.end(), [&](const auto& a, const auto& b) {
    auto rank = [&](AttentionImpl impl) {
      return std::find(options.impls.begin(), options.impls.end(), impl_name(impl)) -
             options.impls.begin();
    };
    return rank(a.impl) < rank(b.impl);
  });
  return result;
}

// RFC 4180: fields with a comma, a quote or a line break are quoted, quotes doubled.
std::string csv_field(const std::string& text) {
  if (text.find_first_of(",\"\r\n") == std::string::npos) return text;
  std::string quoted = "\"";
  for (const char c : text) {
    quoted += c;
    if (c == '"') quoted += '"';
  }
  return quoted + "\"";
}

// Machine, case, result, ratios, ceilings; then the backward (empty without --backward):
// backward_flops = 2.5 x flops, backward_over_forward = the median over alternating runs of
// backward time / the same path's forward run just before it, backward_ratio_standard = flash
// backward GFLOP/s / standard backward GFLOP/s; then the KV heads and, for the decode cases, the
// K and V bytes, the GB/s they were read at and that over the memory copy ceiling, the read
// ceiling of the same stretch and that ratio; last, for the other cases, the GFLOP/s of the peak
// loop's runs made right before the path's timed forward calls (PeakRun) and the median over
// those pairs of the path's GFLOP/s over the run's; then, for flash on the seed shape (every
// forward case with --scaling), the median seconds of its calls on one thread, alternated with
// calls on all, and the median over those pairs of one-thread time / all-threads time.
constexpr const char* kCsvHeader =
    "date,host,cpu_model,simd_target,bf16_products,fma_target,openblas_core,openblas_coretype_env,"
    "threads,"
    "repeat,case,dtype,batch,heads,seqlen_q,seqlen_kv,head_dim,causal,impl,flops,seconds,gflops,"
    "cpu_share,verified,out_err,out_tol,lse_err,lse_tol,ratio_peak,ratio_sgemm,ratio_standard,"
    "peak_gflops,fma_peak_gflops,bf16_dot_peak_gflops,amx_peak_gflops,sgemm_gflops,copy_gbps,"
    "backward_flops,backward_seconds,backward_gflops,backward_cpu_share,backward_over_forward,"
    "backward_ratio_standard,backward_verified,backward_oracle,dq_err,dq_tol,dk_err,dk_tol,dv_err,"
    "dv_tol,heads_kv,kv_bytes,kv_gbps,ratio_copy,read_gbps,ratio_read,peak_paired_gflops,"
    "ratio_peak_paired,one_thread_seconds,speedup_over_one_thread\n";

std::string csv_text(const Machine& machine, const Ceilings& ceilings,
                     const std::vector<CaseResult>& results, int repeat) {
  std::string text = kCsvHeader;
  auto append_row = [&text](const std::vector<std::string>& fields) {
    for (std::size_t i = 0; i < fields.size(); ++i) {
      if (i > 0) text += ',';
      text += csv_field(fields[i]);
    }
    text += '\n';
  };
  for (const CaseResult& result : results) {
    const Case& shape = result.shape;
    const double peak = peak_for(ceilings, shape.dtype);
    // The decode cases' head_dim may have no sgemm ceiling: their ceiling is the memory copy.
    const auto sgemm_entry = ceilings.sgemm_gflops.find(shape.head_dim);
    const std::optional<double> sgemm = sgemm_entry == ceilings.sgemm_gflops.end()
                                            ? std::nullopt
                                            : std::optional<double>(sgemm_entry->second);
    const std::optional<double> standard = result.gflops(AttentionImpl::standard);
    const std::optional<double> standard_backward = result.backward_gflops(AttentionImpl::standard);
    for (const PathResult& path : result.paths) {
      const std::optional<double> gflops = result.gflops(path.impl);
      auto ratio = [&](std::optional<double> ceiling) -> std::optional<double> {
        if (!gflops || !ceiling || *ceiling <= 0.0) return std::nullopt;
        return *gflops / *ceiling;
      };
      std::vector<std::string> backward_fields(14);
      if (path.backward) {
        const BackwardResult& backward = *path.backward;
        const std::optional<double> backward_gflops = result.backward_gflops(path.impl);
        std::optional<double> speedup;
        if (path.impl == AttentionImpl::flash && backward_gflops && standard_backward) {
          speedup = *backward_gflops / *standard_backward;
        }
        backward_fields = {format("%.0f", result.backward_flops),
                           optional_number("%.6f", backward.seconds),
                           optional_number("%.5g", backward_gflops),
                           optional_number("%.2f", backward.cpu_share),
                           optional_number("%.4f", result.backward_over_forward(path.impl)),
                           optional_number("%.4f", speedup),
                           status_name(backward.status),
                           backward.oracle,
                           optional_number("%.3g", backward.checks.dq.error),
                           optional_number("%.3g", backward.checks.dq.tolerance),
                           optional_number("%.3g", backward.checks.dk.error),
                           optional_number("%.3g", backward.checks.dk.tolerance),
                           optional_number("%.3g", backward.checks.dv.error),
                           optional_number("%.3g", backward.checks.dv.tolerance)};
      }
      // One CSV column per line, in kCsvHeader's order.
      // clang-format off
      std::vector<std::string> fields = {
          machine.date,
          machine.host,
          machine.cpu_model,
          machine.simd_target,
          machine.bf16_products,
          ceilings.fma_target,
          machine.openblas_core,
          machine.openblas_coretype,
          std::to_string(machine.threads),
          std::to_string(shape.decode ? std::max(repeat, kDecodeMinRepeat) : repeat),
          shape.decode ? "decode" : shape.seed_shape ? "seed" : "sweep",
          dtype_name(shape.dtype),
          std::to_string(shape.batch),
          std::to_string(shape.heads),
          std::to_string(shape.seqlen_q()),
          std::to_string(shape.seqlen),
          std::to_string(shape.head_dim),
          shape.causal ? "true" : "false",
          impl_name(path.impl),
          format("%.0f", result.flops),
          optional_number("%.6f", path.seconds),
          optional_number("%.5g", gflops),
          optional_number("%.2f", path.cpu_share),
          path.verified ? "yes" : "no",
          format("%.3g", path.errors.out.max_abs),
          format("%.3g", path.tolerance.out),
          format("%.3g", path.errors.lse.max_abs),
          format("%.3g", path.tolerance.lse),
          // Rates and ratios in significant digits, not decimals: in a sanitized build a
          // ratio against the AMX peak is ~1e-5, which "%.4f" wrote as 0, and the plain-loop
          // sgemm under ThreadSanitizer on a busy host ran below 0.05 GFLOP/s, which "%.1f"
          // wrote as 0.
          optional_number("%.4g", ratio(peak)),
          optional_number("%.4g", ratio(sgemm)),
          path.impl == AttentionImpl::flash ? optional_number("%.4g", ratio(standard)) : "",
          format("%.5g", peak),
          format("%.5g", ceilings.fma_gflops),
          optional_number("%.5g", ceilings.bf16_dot_gflops),
          optional_number("%.5g", ceilings.amx_gflops),
          optional_number("%.5g", sgemm),
          format("%.5g", ceilings.copy_gbps)};
      // clang-format on
      fields.insert(fields.end(), backward_fields.begin(), backward_fields.end());
      const std::optional<double> kv_gbps = result.kv_gbps(path.impl);
      fields.push_back(std::to_string(shape.kv_heads()));
      fields.push_back(shape.decode ? format("%.0f", shape.kv_bytes()) : "");
      fields.push_back(optional_number("%.5g", kv_gbps));
      fields.push_back(kv_gbps ? format("%.4g", *kv_gbps / ceilings.copy_gbps) : "");
      fields.push_back(optional_number("%.5g", result.read_gbps(path.impl)));
      fields.push_back(optional_number("%.4g", path.over_read));
      fields.push_back(path.peak ? optional_number("%.5g", path.peak->peak_gflops()) : "");
      fields.push_back(path.peak ? optional_number("%.4g", path.peak->ratio(result.flops)) : "");
      fields.push_back(optional_number("%.6f", path.one_thread_seconds));
      fields.push_back(optional_number("%.4g", path.speedup_over_one_thread));
      append_row(fields);
    }
  }
  return text;
}

// gnuplot's single-quoted strings take everything literally except a doubled quote.
std::string gnuplot_string(const std::string& text) {
  std::string quoted = "'";
  for (const char c : text) {
    quoted += c;
    if (c == '\'') quoted += '\'';
  }
  return quoted + "'";
}

// What a plot shows: the sweep's forward or backward GFLOP/s, or the decode cases' GB/s.
enum class Pass { forward, backward, decode };

// The terminal and output lines every plot script starts with.
std::string plot_preamble(const fs::path& png) {
  return "if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {\n"
         "  set terminal pngcairo size 1200,760 noenhanced font ',10'\n"
         "} else {\n"
         "  set terminal png size 1200,760 noenhanced\n"
         "}\n"
         "set output " +
         gnuplot_string(png.string()) + "\n";
}

// The plot title: what ran, where and when.
std::string plot_title(const char* what, const Machine& machine) {
  char title[512];
  std::snprintf(title, sizeof(title), "flashattn bench%s, %s, %s (%s), %d threads, %s", what,
                machine.date.c_str(), machine.cpu_model.c_str(), machine.host.c_str(),
                machine.threads, machine.simd_target.c_str());
  return "set title " + gnuplot_string(title) + "\n";
}

// A line of a plot: its title, dash type, colour (gnuplot's line type; 0: the next one in
// turn) and points (x, y), the data inline as $series<index>.
struct PlotLine {
  std::string title;
  int dash = 1;
  int colour = 0;
  std::vector<std::pair<std::int64_t, double>> points;
};

// The data blocks of `lines` (appended to `script`) and the plot command's clauses for them.
std::string plot_lines(const std::map<std::string, PlotLine>& lines, std::string& script) {
  int index = 0;
  std::string plots;
  for (const auto& [name, line] : lines) {
    std::string block = "$series" + std::to_string(index) + " << EOD\n";
    std::vector<std::pair<std::int64_t, double>> points = line.points;
    std::sort(points.begin(), points.end());
    for (const auto& [x, y] : points) block += std::to_string(x) + " " + format("%.3f", y) + "\n";
    script += block + "EOD\n";
    plots += (plots.empty() ? "" : ", ") + std::string("$series") + std::to_string(index) +
             " using 1:2 with linespoints lw 2 pt 7 dt " + std::to_string(line.dash) +
             (line.colour > 0 ? " lc " + std::to_string(line.colour) : "") + " title " +
             gnuplot_string(line.title);
    ++index;
  }
  return plots;
}

// A horizontal line at `value`, titled with it, for the plot command; `colour` a gnuplot colour
// spec, or empty for the next line type's.
std::string plot_ceiling(double value, const std::string& name, const std::string& colour = "") {
  return ", " + format("%.3f", value) + " with lines lw 2 dt 3" +
         (colour.empty() ? "" : " lc " + colour) + " title " +
         gnuplot_string(name + format(" %.0f", value));
}

// A gnuplot script that draws GFLOP/s of one pass against seqlen: one line per (path, dtype,
// head_dim, mask) over the sweep points, one horizontal line per ceiling. The data are inline, so
// the script is the only input. The backward gets a plot of its own: its lines would cross the
// forward's and double their number.
std::string plot_script(const fs::path& png, const Machine& machine, const Ceilings& ceilings,
                        const std::vector<CaseResult>& results, Pass pass) {
  std::map<std::string, PlotLine> lines;
  std::set<DType> dtypes;
  std::set<std::int64_t> head_dims;
  for (const CaseResult& result : results) {
    if (result.shape.seed_shape || result.shape.decode) continue;
    for (const PathResult& path : result.paths) {
      const std::optional<double> gflops =
          pass == Pass::forward ? result.gflops(path.impl) : result.backward_gflops(path.impl);
      if (!gflops) continue;
      const Case& shape = result.shape;
      char title[96];
      std::snprintf(title, sizeof(title), "%s %s D=%lld%s", impl_name(path.impl),
                    dtype_name(shape.dtype), static_cast<long long>(shape.head_dim),
                    shape.causal ? "" : " non-causal");
      PlotLine& line = lines[title];
      line.title = title;
      line.dash = path.impl == AttentionImpl::flash ? 1 : 2;
      line.points.emplace_back(shape.seqlen, *gflops);
      dtypes.insert(shape.dtype);
      head_dims.insert(shape.head_dim);
    }
  }

  std::string script =
      plot_preamble(png) + plot_title(pass == Pass::forward ? "" : " backward", machine) +
      "set xlabel 'sequence length (causal unless marked; FLOPs count unmasked "
      "pairs)'\n" +
      std::string(pass == Pass::forward ? "set ylabel 'GFLOP/s (log scale)'\n"
                                        : "set ylabel 'backward GFLOP/s, 2.5x the forward FLOPs "
                                          "(log scale)'\n") +
      "set logscale xy 2\n"
      "set format x '%.0f'\n"
      "set format y '%.0f'\n"
      "set grid\n"
      "set key outside right top\n";
  std::string plots = plot_lines(lines, script);
  plots += plot_ceiling(ceilings.fma_gflops, "f32 FMA peak");
  if (ceilings.bf16_dot_gflops && dtypes.count(DType::bf16) > 0) {
    plots += plot_ceiling(*ceilings.bf16_dot_gflops, "bf16 dot peak");
  }
  if (ceilings.amx_gflops && dtypes.count(DType::bf16) > 0) {
    plots += plot_ceiling(*ceilings.amx_gflops, "AMX bf16 peak");
  }
  for (const std::int64_t head_dim : head_dims) {
    plots += plot_ceiling(ceilings.sgemm_gflops.at(head_dim),
                          "sgemm " + std::to_string(head_dim) + "-dim attention products");
  }
  return script + "plot " + plots + "\n";
}

// A gnuplot script that draws the decode cases: GB/s of K and V read against the KV cache
// length, one line per (path, dtype), one dotted line per dtype for the plain reads of the same
// K and V timed with flash's calls, each dtype in a colour of its own, and the memory copy
// ceiling.
std::string decode_plot_script(const fs::path& png, const Machine& machine,
                               const Ceilings& ceilings, const std::vector<CaseResult>& results) {
  std::map<std::string, PlotLine> lines;
  for (const CaseResult& result : results) {
    if (!result.shape.decode) continue;
    const Case& shape = result.shape;
    const int colour = 1 + static_cast<int>(shape.dtype);
    for (const PathResult& path : result.paths) {
      const std::optional<double> gbps = result.kv_gbps(path.impl);
      if (!gbps) continue;
      const std::string title = std::string(impl_name(path.impl)) + " " + dtype_name(shape.dtype);
      PlotLine& line = lines[title];
      line.title = title;
      line.dash = path.impl == AttentionImpl::flash ? 1 : 2;
      line.colour = colour;
      line.points.emplace_back(shape.seqlen, *gbps);
    }
    if (const std::optional<double> read = result.read_gbps(AttentionImpl::flash)) {
      const std::string title = std::string("read of K and V, ") + dtype_name(shape.dtype);
      PlotLine& line = lines[title];
      line.title = title;
      line.dash = 3;
      line.colour = colour;
      line.points.emplace_back(shape.seqlen, *read);
    }
  }
  char xlabel[160];
  std::snprintf(xlabel, sizeof(xlabel),
                "set xlabel 'KV cache length Skv (one query position, Hq = %lld, Hkv = %lld, D "
                "= %lld)'\n",
                static_cast<long long>(kDecodeHeadsQ), static_cast<long long>(kDecodeHeadsKv),
                static_cast<long long>(kDecodeHeadDim));
  std::string script = plot_preamble(png) + plot_title(" decode", machine) + xlabel +
                       "set ylabel 'GB/s of K and V read (log scale)'\n"
                       "set logscale xy 2\n"
                       "set format x '%.0f'\n"
                       "set format y '%.1f'\n"
                       "set grid\n"
                       "set key outside right top\n";
  std::string plots = plot_lines(lines, script);
  plots += plot_ceiling(ceilings.copy_gbps, "memory copy (read + written)", "rgb 'black'");
  return script + "plot " + plots + "\n";
}

std::optional<fs::path> find_on_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  if (path == nullptr) return std::nullopt;
  const std::string directories = path;
  std::size_t start = 0;
  while (start <= directories.size()) {
    const std::size_t end = std::min(directories.find(':', start), directories.size());
    const fs::path candidate =
        fs::path(end > start ? directories.substr(start, end - start) : ".") / program;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
    start = end + 1;
  }
  return std::nullopt;
}

// Feeds `script` to gnuplot on its stdin, its stdout discarded; returns why it failed, or
// nothing on success.
std::optional<std::string> run_gnuplot(const fs::path& gnuplot, const std::string& script) {
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) return "cannot create a pipe to gnuplot";
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[0], 0);
  posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
  std::string program = gnuplot.string();
  char* argv[] = {program.data(), nullptr};
  pid_t pid = 0;
  const int spawned = posix_spawn(&pid, program.c_str(), &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(pipe_fds[0]);
  if (spawned != 0) {
    ::close(pipe_fds[1]);
    return "cannot start " + program;
  }
  const char* bytes = script.data();
  std::size_t left = script.size();
  while (left > 0) {
    const ssize_t written = ::write(pipe_fds[1], bytes, left);
    if (written < 0 && errno == EINTR) continue;
    if (written <= 0) break;
    bytes += written;
    left -= static_cast<std::size_t>(written);
  }
  ::close(pipe_fds[1]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (left > 0) return "gnuplot stopped reading its script";
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return "gnuplot failed (see its messages)";
  return std::nullopt;
}

// The machine, the ceilings and what the columns mean; then the sweep table's header, when there
// are sweep or seed-shape cases (`sweep_table`).
void print_header(const Machine& machine, const Ceilings& ceilings, const BenchOptions& options,
                  bool sweep_table) {
  std::printf("flashattn bench: flash and standard attention against the machine's ceilings\n");
  std::printf("machine  %s, %s; %d threads; library SIMD target %s, bf16 products %s\n",
              machine.host.c_str(), machine.cpu_model.c_str(), machine.threads,
              machine.simd_target.c_str(), machine.bf16_products.c_str());
  std::printf("openblas core %s%s%s\n", machine.openblas_core.c_str(),
              machine.openblas_coretype.empty() ? "" : ", OPENBLAS_CORETYPE=",
              machine.openblas_coretype.c_str());
  if (!machine.openblas_coretype.empty()) {
    // On the AMD EPYC (Zen 5) VM of bench/RESULTS.md the environment set Haswell (AVX2): sgemm
    // at D = 128 ran at 241 GFLOP/s against 444 with OpenBLAS's own choice, Cooperlake.
    std::printf(
        "note     OPENBLAS_CORETYPE pins that kernel for the sgemm ceiling and the standard path;\n"
        "         unset it to compare against the kernel OpenBLAS picks for this CPU\n");
  }
  std::printf("ceilings f32 FMA peak %.1f GFLOP/s (%s)", ceilings.fma_gflops,
              ceilings.fma_target.c_str());
  if (ceilings.bf16_dot_gflops) {
    std::printf(", bf16 dot peak %.1f GFLOP/s", *ceilings.bf16_dot_gflops);
  }
  if (ceilings.amx_gflops) std::printf(", AMX bf16 peak %.1f GFLOP/s", *ceilings.amx_gflops);
  std::printf(", memory copy %.1f GB/s\n", ceilings.copy_gbps);
  for (const auto& [head_dim, gflops] : ceilings.sgemm_gflops) {
    std::printf("         sgemm attention products at head_dim %lld: %.1f GFLOP/s\n",
                static_cast<long long>(head_dim), gflops);
  }
  std::printf(
      "timing   median of %d runs after the verified first run; GFLOP/s = attention_flops "
      "(unmasked pairs) / time\n",
      options.repeat);
  std::printf(
      "ratios   f/peak: flash GFLOP/s over the peak above; f/pk run: the median over the timed "
      "runs of flash GFLOP/s over a %.0f ms run of the peak's loop made just before each (the "
      "same stretch of the host's load)\n",
      kPeakRunSeconds * 1e3);
  std::printf(
      "threads  f x thr: flash on %d threads against flash on one, the median over alternating "
      "pairs of one-thread time / %d-thread time (the seed shape; every case with --scaling)\n",
      machine.threads, machine.threads);
  std::printf(
      "cpu      CPU time / (wall time x threads) of the timed runs, flash/standard: under 1 when "
      "another process took the cores (the row is noise) or the path left threads idle\n");
  if (options.backward) {
    std::printf(
        "backward GFLOP/s = 2.5 x attention_flops / time (the usual convention: five products of "
        "the forward's size, S, dP, dV, dQ, dK, against its two);\n"
        "         forward and backward runs alternate; f b/f, s b/f = median of backward time / "
        "the forward run just before it, of flash, of standard; bwd f/s = flash backward "
        "speed-up over the standard backward\n"
        "         verified on the last (batch, KV head) slice against the fp64 reference "
        "(\"reference\"), or, where that slice's backward exceeds %g GFLOP,\n"
        "         on fp64 dQ of the sampled rows and flash's dK, dV against the standard path's "
        "(\"reference-dq-rows+standard\")\n",
        options.backward_reference_gflop);
  }
  if (!sweep_table) return;
  std::printf("\n%-5s %-10s %2s %4s %6s %4s %10s %10s %8s %8s %8s %8s %8s %9s ", "dtype", "mask",
              "B", "H", "S", "D", "flash", "standard", "f/peak", "f/pk run", "f/sgemm", "f/std",
              "f x thr", "cpu");
  if (options.backward) {
    std::printf("%10s %10s %6s %6s %8s ", "bwd flash", "bwd std", "f b/f", "s b/f", "bwd f/s");
  }
  std::printf("verified\n");
  std::fflush(stdout);
}

// A table cell: the value by `pattern`, or "-" where there is none.
std::string cell(std::optional<double> value, const char* pattern) {
  return value ? format(pattern, *value) : std::string("-");
}

// The cpu column, flash/standard: CPU time over wall time x threads of each path timed.
std::string cpu_share_column(const CaseResult& result) {
  std::string cpu_share;
  for (const AttentionImpl impl : {AttentionImpl::flash, AttentionImpl::standard}) {
    const PathResult* path = result.find(impl);
    if (path == nullptr) continue;
    cpu_share += (cpu_share.empty() ? "" : "/") + cell(path->cpu_share, "%.2f");
  }
  return cpu_share;
}

// The verified column: "flash yes, standard yes", NO for an output the oracle rejected.
std::string verified_column(const CaseResult& result) {
  std::string verified;
  for (const PathResult& path : result.paths) {
    verified += std::string(verified.empty() ? "" : ", ") + impl_name(path.impl) + " " +
                (path.verified ? "yes" : "NO");
  }
  return verified;
}

void print_case(const CaseResult& result, const Ceilings& ceilings, bool backward) {
  const Case& shape = result.shape;
  const std::optional<double> flash = result.gflops(AttentionImpl::flash);
  const std::optional<double> standard = result.gflops(AttentionImpl::standard);
  auto ratio = [&](std::optional<double> denominator) -> std::optional<double> {
    if (!flash || !denominator || *denominator <= 0.0) return std::nullopt;
    return *flash / *denominator;
  };
  const std::string cpu_share = cpu_share_column(result);
  std::string verified = verified_column(result);
  std::string backward_columns, skipped;
  if (backward) {
    const std::optional<double> flash_backward = result.backward_gflops(AttentionImpl::flash);
    const std::optional<double> standard_backward = result.backward_gflops(AttentionImpl::standard);
    std::optional<double> speedup;
    if (flash_backward && standard_backward && *standard_backward > 0.0) {
      speedup = *flash_backward / *standard_backward;
    }
    char text[64];
    std::snprintf(text, sizeof(text), "%10s %10s %6s %6s %8s ",
                  cell(flash_backward, "%.1f").c_str(), cell(standard_backward, "%.1f").c_str(),
                  cell(result.backward_over_forward(AttentionImpl::flash), "%.2f").c_str(),
                  cell(result.backward_over_forward(AttentionImpl::standard), "%.2f").c_str(),
                  cell(speedup, "%.2f").c_str());
    backward_columns = text;
    std::string statuses, oracle;
    for (const PathResult& path : result.paths) {
      if (!path.backward) continue;
      const BackwardResult::Status status = path.backward->status;
      statuses += std::string(statuses.empty() ? "" : ", ") + impl_name(path.impl) + " " +
                  (status == BackwardResult::Status::failed ? "NO" : status_name(status));
      if (oracle.empty() || path.impl == AttentionImpl::flash) oracle = path.backward->oracle;
      if (status == BackwardResult::Status::skipped) {
        skipped += std::string("         ") + impl_name(path.impl) +
                   " backward skipped: " + path.backward->reason + "\n";
      }
    }
    verified += "; backward " + statuses + (oracle.empty() ? "" : " against " + oracle);
  }
  const PathResult* flash_path = result.find(AttentionImpl::flash);
  const std::optional<double> paired_peak =
      flash_path && flash_path->peak ? flash_path->peak->ratio(result.flops) : std::nullopt;
  const std::string thread_speedup =
      flash_path != nullptr ? cell(flash_path->speedup_over_one_thread, "%.2f") : "-";
  std::printf("%-5s %-10s %2lld %4lld %6lld %4lld %10s %10s %8s %8s %8s %8s %8s %9s %s%s\n%s",
              dtype_name(shape.dtype), shape.causal ? "causal" : "non-causal",
              static_cast<long long>(shape.batch), static_cast<long long>(shape.heads),
              static_cast<long long>(shape.seqlen), static_cast<long long>(shape.head_dim),
              cell(flash, "%.1f").c_str(), cell(standard, "%.1f").c_str(),
              cell(ratio(peak_for(ceilings, shape.dtype)), "%.3f").c_str(),
              cell(paired_peak, "%.3f").c_str(),
              cell(ratio(ceilings.sgemm_gflops.at(shape.head_dim)), "%.3f").c_str(),
              cell(ratio(standard), "%.3f").c_str(), thread_speedup.c_str(), cpu_share.c_str(),
              backward_columns.c_str(), verified.c_str(), skipped.c_str());
  std::fflush(stdout);
}

// The decode table's header: printed before its first case, after the sweep's.
void print_decode_header(const BenchOptions& options) {
  std::printf(
      "\ndecode   one query position against a KV cache of Skv keys (B = 1, Hq = %lld, Hkv = %lld, "
      "D = %lld): K and V bytes / time (median of %d runs), each run after a read of the same K "
      "and V on the same threads (read GB/s); f/read = the median over those pairs of flash's "
      "bandwidth over the read's, f/copy = flash over the memory copy ceiling\n",
      static_cast<long long>(kDecodeHeadsQ), static_cast<long long>(kDecodeHeadsKv),
      static_cast<long long>(kDecodeHeadDim), std::max(options.repeat, kDecodeMinRepeat));
  std::printf("%-5s %7s %8s %10s %10s %8s %8s %10s %8s %9s verified\n", "dtype", "Skv", "KV MiB",
              "flash GB/s", "read GB/s", "f/read", "f/copy", "std GB/s", "f/std", "cpu");
  std::fflush(stdout);
}

void print_decode_case(const CaseResult& result, const Ceilings& ceilings) {
  const Case& shape = result.shape;
  const std::optional<double> flash = result.kv_gbps(AttentionImpl::flash);
  const std::optional<double> standard = result.kv_gbps(AttentionImpl::standard);
  std::optional<double> over_copy, over_standard;
  if (flash && ceilings.copy_gbps > 0.0) over_copy = *flash / ceilings.copy_gbps;
  if (flash && standard && *standard > 0.0) over_standard = *flash / *standard;
  const PathResult* flash_path = result.find(AttentionImpl::flash);
  std::optional<double> over_read;
  if (flash_path != nullptr) over_read = flash_path->over_read;
  std::printf("%-5s %7lld %8.1f %10s %10s %8s %8s %10s %8s %9s %s\n", dtype_name(shape.dtype),
              static_cast<long long>(shape.seqlen), shape.kv_bytes() / (1 << 20),
              cell(flash, "%.1f").c_str(),
              cell(result.read_gbps(AttentionImpl::flash), "%.1f").c_str(),
              cell(over_read, "%.3f").c_str(), cell(over_copy, "%.3f").c_str(),
              cell(standard, "%.1f").c_str(), cell(over_standard, "%.3f").c_str(),
              cpu_share_column(result).c_str(), verified_column(result).c_str());
  std::fflush(stdout);
}

// --quick: a tiny sweep for tests and smoke runs; options given explicitly still win.
void apply_quick(BenchOptions& options, CeilingBudget& budget, const CLI::App& command) {
  auto unset = [&](const char* name) { return command.count(name) == 0; };
  if (unset("--seqlens")) options.seqlens = {128, 256};
  if (unset("--head-dims")) options.head_dims = {32};
  if (unset("--work")) options.work_gflop = 0x1p22 * 1e-9;
  if (unset("--repeat")) options.repeat = 1;
  if (unset("--decode-seqlens")) options.decode_seqlens = {300};
  if (unset("--causal") && unset("--non-causal") && unset("--both")) options.both = true;
  options.no_seed_shape = true;
  budget = {.seconds = 0.01, .trials = 2, .sgemm_seqlen = 128, .copy_bytes = 16u << 20};
}

int run_bench(BenchOptions options, const CLI::App& command) {
  CeilingBudget budget;
  if (options.quick) apply_quick(options, budget, command);
  const int threads = resolved_threads(options.threads);

  // Default masks: the seed shape both ways, the sweep causal; a mask option sets both.
  std::vector<bool> seed_masks = {true, false}, sweep_masks = {true};
  if (options.causal) seed_masks = sweep_masks = {true};
  if (options.non_causal) seed_masks = sweep_masks = {false};
  if (options.both) seed_masks = sweep_masks = {true, false};
  const std::vector<Case> cases = make_cases(options, seed_masks, sweep_masks);

  // Outputs are opened before any work, so that an unwritable --out-dir fails at once.
  const fs::path out_dir = options.out_dir;
  std::error_code error;
  fs::create_directories(out_dir, error);
  if (error) {
    throw Error("--out-dir: cannot create " + out_dir.string() + ": " + error.message());
  }
  Machine machine = describe_machine(threads);
  // A --quick run gets its own name: a smoke test must not replace the day's full results.
  const std::string stem =
      machine.date + "-" + file_name_safe(machine.host) + (options.quick ? "-quick" : "");
  AtomicFile csv(out_dir / (stem + ".csv"));
  std::unique_ptr<AtomicFile> png, backward_png, decode_png;
  std::optional<fs::path> gnuplot;
  std::string no_plot_reason;
  const bool sweep_cases = std::any_of(cases.begin(), cases.end(), [](const Case& shape) {
    return !shape.seed_shape && !shape.decode;
  });
  const bool decode_cases =
      std::any_of(cases.begin(), cases.end(), [](const Case& shape) { return shape.decode; });
  if (options.no_plot) {
    no_plot_reason = "--no-plot";
  } else if (!sweep_cases && !decode_cases) {
    no_plot_reason =
        "no sweep or decode case (the plots show the sweep's GFLOP/s against seqlen and the "
        "decode cases' GB/s against Skv)";
  } else if (gnuplot = find_on_path("gnuplot"); !gnuplot) {
    no_plot_reason =
        "gnuplot is not on PATH; install gnuplot-nox (scripts/install-deps.sh) for the plot";
  } else {
    if (sweep_cases) png = std::make_unique<AtomicFile>(out_dir / (stem + ".png"));
    if (sweep_cases && options.backward) {
      backward_png = std::make_unique<AtomicFile>(out_dir / (stem + "-backward.png"));
    }
    if (decode_cases) decode_png = std::make_unique<AtomicFile>(out_dir / (stem + "-decode.png"));
  }

  std::set<std::int64_t> head_dims;
  for (const Case& shape : cases) {
    if (!shape.decode) head_dims.insert(shape.head_dim);
  }
  const Ceilings ceilings = measure_ceilings(threads, head_dims, budget);
  PeakLoops peak_loops(threads, ceilings);
  print_header(machine, ceilings, options, !head_dims.empty());

  std::vector<CaseResult> results;
  bool all_verified = true, decode_header = false;
  for (std::size_t i = 0; i < cases.size(); ++i) {
    std::fprintf(stderr, "flashattn bench: [%zu/%zu] %s\n", i + 1, cases.size(),
                 case_label(cases[i]).c_str());
    results.push_back(run_case(cases[i], options, threads, peak_loops.run_for(cases[i].dtype)));
    for (const PathResult& path : results.back().paths) {
      all_verified &= path.verified;
      if (path.backward) all_verified &= path.backward->status != BackwardResult::Status::failed;
    }
    if (!cases[i].decode) {
      print_case(results.back(), ceilings, options.backward);
      continue;
    }
    if (!decode_header) print_decode_header(options);
    decode_header = true;
    print_decode_case(results.back(), ceilings);
  }

  csv.append(csv_text(machine, ceilings, results, options.repeat));
  csv.commit();
  std::printf("\nwrote %s\n", fs::absolute(csv.path()).lexically_normal().c_str());
  for (const auto& [file, pass] :
       {std::pair{png.get(), Pass::forward}, std::pair{backward_png.get(), Pass::backward},
        std::pair{decode_png.get(), Pass::decode}}) {
    if (file == nullptr) continue;
    // gnuplot writes the temporary file by name; the rename makes it appear whole.
    const std::string script =
        pass == Pass::decode ? decode_plot_script(file->temp_path(), machine, ceilings, results)
                             : plot_script(file->temp_path(), machine, ceilings, results, pass);
    const std::optional<std::string> failure = run_gnuplot(*gnuplot, script);
    if (!failure && fs::file_size(file->temp_path(), error) > 0 && !error) {
      file->commit();
      std::printf("wrote %s\n", fs::absolute(file->path()).lexically_normal().c_str());
    } else {
      file->discard();
      no_plot_reason = failure.value_or("gnuplot wrote an empty file");
    }
  }
  if (!no_plot_reason.empty()) std::printf("no plot: %s\n", no_plot_reason.c_str());
  if (!all_verified) {
    std::printf(
        "verification FAILED for at least one path or backward: it was not timed (verified = no, "
        "backward_verified = no)\n");
    return kExitMismatch;
  }
  return kExitOk;
}

}  // namespace

Action add_bench_command(CLI::App& app) {
  auto options = std::make_shared<BenchOptions>();
  CLI::App* command = app.add_subcommand(
      "bench", "Benchmark flash and standard attention against the machine's ceilings");
  command->footer(
      "Ceilings, measured first on the same threads:\n"
      "  f32 FMA peak     independent FMA chains, best SIMD target (Highway dispatch)\n"
      "  bf16 dot peak    vdpbf16ps chains, on CPUs with AVX512-BF16\n"
      "  AMX bf16 peak    tdpbf16ps on four accumulator tiles, on CPUs with AMX-BF16\n"
      "  sgemm            OpenBLAS, per head_dim: on every thread Q·Kᵀ and P·V of one\n"
      "                   1024-token head (4·1024²·D FLOPs), as the standard path calls it\n"
      "  memory copy      memcpy of buffers beyond the last-level cache, GB/s read + written\n"
      "Cases: the seed shape [B=2, H=32, S=1024, D=128] causal and non-causal; then per head_dim\n"
      "and seqlen a causal point with B=1 and H = max(1, round(W / FLOPs of one head)),\n"
      "W = --work GFLOP (default 2^34 FLOPs, the seed shape's causal work), so that every point\n"
      "does about the same work (where one head exceeds W, one head). --causal, --non-causal or\n"
      "--both set the masks of all cases. Then, per dtype and --decode-seqlens Skv, a decode\n"
      "case: one query position (B = 1, 32 query heads, 8 KV heads, D = 128) against Skv keys,\n"
      "timed as the GB/s of K and V read (each byte once), each run after a plain read of the\n"
      "same K and V on the same threads (CSV read_gbps; ratio_read: the median over those pairs\n"
      "of the call's bandwidth over the read's) and against the memory copy ceiling.\n"
      "Each case runs the standard path, then flash, on the same inputs; each path's first run is\n"
      "verified against the fp64 reference on sampled query rows (flash: within 4x the standard\n"
      "path's error + 1 ulp; standard: within a worst-case fp32 bound), then timed (median).\n"
      "FLOPs: attention_flops, 4·D per unmasked (query, key) pair. Ratios: flash GFLOP/s over the\n"
      "dtype's peak (the f32 FMA peak; bf16: the largest of it, the bf16 dot and AMX peaks), over\n"
      "sgemm at the same head_dim, and over the standard path. Each timed forward call follows a\n"
      "20 ms run of the loop that measured that peak, on the same threads: f/pk run (CSV\n"
      "ratio_peak_paired) is the median over those pairs of the call's GFLOP/s over the run's,\n"
      "the ratio in the same stretch of a shared machine's load. Flash on the seed shape (every\n"
      "forward case with --scaling) also runs on one thread, alternating with the runs on all:\n"
      "f x thr (CSV speedup_over_one_thread) is the median over those pairs of one-thread time /\n"
      "all-threads time.\n"
      "--backward: after each path's forward, its backward on the same inputs, a fixed random dO\n"
      "and the out and lse of that path's own forward; verified, then timed (median) in runs that\n"
      "alternate with the forward's (both medians then sample the same stretch of a shared\n"
      "machine's load; backward/forward is the median over the pairs). FLOPs:\n"
      "2.5x attention_flops, the usual convention (five products of the forward's size: S, dP,\n"
      "dV, dQ, dK; the forward has two). Verified on the last (batch, KV head) slice, its GQA\n"
      "group of query heads, against the fp64 reference backward; where that slice exceeds\n"
      "--backward-reference-work (2^34 backward FLOPs: up to seqlen 4096 causal at D = 128,\n"
      "about 6 s of the one-thread reference on the machine of bench/RESULTS.md), the reference\n"
      "checks dQ on the sampled rows and flash's dK, dV are compared with the standard path's\n"
      "(CSV column backward_oracle). Tolerances (as tests/test_backward.cpp), G =\n"
      "max|reference grad| + max|dO|·max|v|: standard within the first-order fp32 bound\n"
      "u·(4·scale·D·max|q|·max|k| + 2·(Skv + Sq) + 16)·G + 2 roundings of the dtype; flash within\n"
      "4x the standard path's error + (2 roundings of the dtype + 4 score roundings)·G; flash\n"
      "against standard within 5x the standard bound + the same floor. The standard backward\n"
      "holds two S x S fp32 matrices per thread: where the machine's memory cannot, it is\n"
      "skipped with the reason.\n"
      "Writes <out-dir>/<YYYY-MM-DD>-<host>.csv (-quick.csv with --quick; a row per case and\n"
      "path; backward columns empty without --backward) and, with gnuplot, .png (the sweep;\n"
      "with --backward also -backward.png) and -decode.png (GB/s against Skv), each whole or\n"
      "not at all, and prints where. Progress goes to stderr.\n"
      "Exit codes: 0 every path verified, 1 invalid arguments or unwritable output, 2 bad\n"
      "command line, 3 a path or its backward failed verification (then not timed; the CSV says\n"
      "which).");
  command->option_defaults()->always_capture_default();
  command->add_option("--seqlens", options->seqlens, "Sweep sequence lengths")
      ->delimiter(',')
      ->check(CLI::PositiveNumber);
  command->add_option("--head-dims", options->head_dims, "Sweep head dimensions")
      ->delimiter(',')
      ->check(CLI::PositiveNumber);
  command->add_option("--dtypes", options->dtypes, "Input dtypes")
      ->delimiter(',')
      ->check(CLI::IsMember({"f32", "f16", "bf16"}));
  command->add_option("--impls", options->impls, "Paths to time")
      ->delimiter(',')
      ->check(CLI::IsMember({"flash", "standard"}));
  CLI::Option* causal = command->add_flag("--causal", options->causal, "Causal cases only");
  CLI::Option* non_causal =
      command->add_flag("--non-causal", options->non_causal, "Non-causal cases only");
  CLI::Option* both = command->add_flag("--both", options->both, "Causal and non-causal cases");
  causal->excludes(non_causal)->excludes(both);
  non_causal->excludes(both);
  command->add_flag("--no-seed-shape", options->no_seed_shape, "Leave out the seed shape cases");
  command->add_flag("--scaling", options->scaling,
                    "Time flash on one thread too, against all threads, in every forward case "
                    "(by default the seed shape's only)");
  command->add_flag("--no-sweep", options->no_sweep, "Leave out the seqlen sweep");
  command->add_option("--work", options->work_gflop, "GFLOP per sweep point (sets H)")
      ->check(CLI::PositiveNumber);
  add_threads_option(command, &options->threads);
  command->add_option("--repeat", options->repeat, "Timed runs per path (median)")
      ->check(CLI::PositiveNumber);
  command
      ->add_option("--check-rows", options->check_rows,
                   "Query rows per (batch, head) checked against the fp64 reference")
      ->check(CLI::PositiveNumber);
  command->add_option("--seed", options->seed, "Random seed of the inputs");
  command->add_option("--out-dir", options->out_dir, "Directory of the CSV and the plot");
  command->add_flag("--no-plot", options->no_plot, "Write the CSV only");
  command->add_flag("--backward", options->backward,
                    "Also verify and time each path's backward (GFLOP/s at 2.5x the forward's "
                    "FLOPs, backward/forward time)");
  command
      ->add_option("--backward-reference-work", options->backward_reference_gflop,
                   "GFLOP (backward) of the largest slice checked against the fp64 reference as a "
                   "whole")
      ->check(CLI::PositiveNumber);
  command
      ->add_option("--decode-seqlens", options->decode_seqlens,
                   "KV cache lengths of the decode cases")
      ->delimiter(',')
      ->check(CLI::PositiveNumber);
  command->add_flag("--no-decode", options->no_decode, "Leave out the decode cases");
  command->add_flag("--quick", options->quick,
                    "A tiny sweep (seqlens 128,256, head_dim 32, both masks, no seed shape, "
                    "decode at 300 keys, short ceilings) for tests; explicit options still apply");
  // After parsing, so that options that leave no case are a command-line error (exit 2), not a
  // run that measures the ceilings and writes an empty CSV.
  command->callback([options] {
    if ((options->no_seed_shape || options->quick) && options->no_sweep && options->no_decode) {
      throw CLI::ValidationError(
          "--no-seed-shape (implied by --quick), --no-sweep and --no-decode: expected at least "
          "one case to run, got none");
    }
  });
  return [options, command] { return run_bench(*options, *command); };
}

}  // namespace flashattn::cli
