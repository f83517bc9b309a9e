// `flashattn demo`: the seed example (B=2, Nh=32, S=1024, Dh=128, causal) on random inputs,
// run through the standard path and the FlashAttention path, timed, measured and cross-checked
// against the fp64 reference.

#include <malloc.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cli_common.hpp"
#include "flashattn/attention.hpp"
#include "flashattn/error.hpp"
#include "flashattn/introspect.hpp"
#include "openblas_core.hpp"
#include "verify.hpp"

namespace flashattn::cli {
namespace {

struct DemoOptions {
  std::int64_t batch = 2;
  std::int64_t heads = 32;
  std::int64_t kv_heads = 0;  // 0: as heads
  std::int64_t seqlen = 1024;
  std::int64_t seqlen_kv = 0;  // 0: as seqlen
  std::int64_t head_dim = 128;
  bool causal = true;
  std::string window = "-1,-1";
  std::string dtype = "f32";
  int threads = 0;
  std::uint64_t seed = 42;
  int repeat = 3;
  std::int64_t check_rows = 16;
  std::string softcap = "0";  // score modifiers (docs/semantics.md)
  bool alibi = false;
};

// Peak resident memory. Writing "5" to /proc/self/clear_refs resets VmHWM to the current RSS
// (Linux >= 4.0), so the peak after a call minus the RSS before it is what the call added.
std::optional<std::int64_t> status_kib(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field, 0) == 0) return std::stoll(line.substr(field.size()));
  }
  return std::nullopt;
}

bool reset_peak_rss() {
  std::ofstream clear_refs("/proc/self/clear_refs");
  clear_refs << "5";
  clear_refs.flush();
  return clear_refs.good();
}

// Runs `call` once; returns the bytes by which it raised the peak RSS, or nothing when the peak
// cannot be reset or read.
std::optional<std::int64_t> run_measuring_peak(const std::function<void()>& call) {
  // Hand memory freed by earlier calls back to the kernel (glibc keeps it otherwise), so that
  // what this call allocates shows up as new resident pages.
  malloc_trim(0);
  const std::optional<std::int64_t> before = status_kib("VmRSS:");
  const bool measurable = before.has_value() && reset_peak_rss();
  call();
  const std::optional<std::int64_t> peak = status_kib("VmHWM:");
  if (!measurable || !peak) return std::nullopt;
  return std::max<std::int64_t>(0, *peak - *before) * 1024;
}

struct PathRun {
  AttentionImpl impl;
  HostTensor out;
  std::vector<float> lse;
  double seconds = 0.0;
  std::optional<std::int64_t> peak_extra_bytes;
  std::int64_t score_bytes = 0;
};

PathRun make_path(AttentionImpl impl, const HostTensor& q) {
  return PathRun{
      .impl = impl,
      .out = HostTensor(q.dtype, q.shape),
      .lse = std::vector<float>(static_cast<std::size_t>(q.shape[0] * q.shape[2] * q.shape[1])),
      .seconds = 0.0,
      .peak_extra_bytes = std::nullopt,
      .score_bytes = 0};
}

void run_path(PathRun& run, const HostTensor& q, const HostTensor& k, const HostTensor& v,
              const AttentionOptions& options, int repeat) {
  const TensorView out = run.out.view();
  auto call = [&] {
    attention_forward(run.impl, q.view(), k.view(), v.view(), out, run.lse.data(), options);
  };
  // Progress on stderr, since a long sequence can keep a path busy for minutes.
  std::fprintf(stderr, "flashattn demo: the %s path, 1 warm-up and %d timed call%s\n",
               impl_name(run.impl), repeat, repeat == 1 ? "" : "s");
  run.peak_extra_bytes = run_measuring_peak(call);  // the first call doubles as the warm-up
  run.seconds = median_seconds(repeat, call);
  run.score_bytes = score_buffer_bytes(run.impl, q.shape[1], k.shape[1], q.shape[3], options);
}

// Starts the OpenMP workers and OpenBLAS on a tiny problem, so that their one-time allocations
// are not charged to the first measured path.
void warm_up_runtime(DType dtype, std::int64_t head_dim, const AttentionOptions& options) {
  const std::int64_t heads = resolved_threads(options.num_threads);
  const HostTensor q(dtype, {1, 16, heads, head_dim});
  HostTensor out(dtype, q.shape);
  std::vector<float> lse(static_cast<std::size_t>(16 * heads));
  // The problem's own modifiers, with slopes for this one's heads.
  AttentionOptions warm_up = options;
  const std::vector<float> slopes(static_cast<std::size_t>(heads), 0.5f);
  if (!options.alibi_slopes.empty()) warm_up.alibi_slopes = slopes;
  for (const AttentionImpl impl : {AttentionImpl::standard, AttentionImpl::flash}) {
    attention_forward(impl, q.view(), q.view(), q.view(), out.view(), lse.data(), warm_up);
  }
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double value = bytes;
  int unit = 0;
  while (value >= 1024.0 && unit < 6) {
    value /= 1024.0;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof(text), unit == 0 ? "%.0f %s" : "%.2f %s", value, units[unit]);
  return text;
}

// "causal", "window (L, R)", both, or "no mask"; then the score modifiers that are on.
std::string mask_text(const AttentionOptions& options) {
  std::string text = options.causal ? "causal" : "";
  if (options.window_left >= 0 || options.window_right >= 0) {
    text += (text.empty() ? "" : ", ") + std::string("window (") +
            std::to_string(options.window_left) + ", " + std::to_string(options.window_right) + ")";
  }
  text = text.empty() ? "no mask" : text;
  if (options.softcap > 0.0f) {
    std::ostringstream cap;
    cap << ", softcap " << options.softcap;
    text += cap.str();
  }
  if (!options.alibi_slopes.empty()) text += ", ALiBi (the paper's slopes)";
  return text;
}

// q, k, v and the two paths' outputs, which the demo holds at once, must fit in the machine's
// memory; refused before anything is allocated, naming the options that set their size.
void check_inputs_fit(const DemoOptions& demo, DType dtype, std::int64_t kv_heads,
                      std::int64_t seqlen_kv) {
  const double rows = static_cast<double>(demo.batch) * static_cast<double>(demo.heads) *
                      static_cast<double>(demo.seqlen);
  const double kv_rows = static_cast<double>(demo.batch) * static_cast<double>(kv_heads) *
                         static_cast<double>(seqlen_kv);
  const double bytes = (3.0 * rows + 2.0 * kv_rows) * static_cast<double>(demo.head_dim) *
                           static_cast<double>(dtype_size(dtype)) +
                       2.0 * rows * sizeof(float);
  const auto limit = static_cast<double>(memory_limit_bytes());
  if (bytes > limit) {
    throw Error(
        "demo: --batch, --heads, --kv-heads, --seqlen, --seqlen-kv, --head-dim: expected "
        "a problem whose q, k, v and two outputs fit in the " +
        format_bytes(limit) + " of this machine, got one that needs " + format_bytes(bytes));
  }
}

// Why the standard path cannot run this problem, if it cannot: the library refuses a call whose
// scratch (the score matrices of the heads in flight) exceeds the machine's memory. The demo then
// runs the FlashAttention path alone, which is what it is for.
std::optional<std::string> standard_refusal(PathRun& standard, const HostTensor& q,
                                            const HostTensor& k, const HostTensor& v,
                                            const AttentionOptions& options) {
  std::int64_t needed = 0;
  try {
    needed = forward_scratch_bytes(AttentionImpl::standard, q.view(), k.view(), v.view(),
                                   standard.out.view(), standard.lse.data(), options);
  } catch (const Error& error) {
    // An invalid problem (--kv-heads not dividing --heads) is reported as the demo's own error.
    throw Error("demo" + std::string(error.what()).substr(std::strlen("forward_scratch_bytes")));
  }
  const std::int64_t limit = memory_limit_bytes();
  if (needed <= limit) return std::nullopt;
  return "its score matrices need " + format_bytes(static_cast<double>(needed)) +
         " of scratch, more than the " + format_bytes(static_cast<double>(limit)) +
         " of this machine";
}

// The problem's dtype and the K/V sizes that default to the query's.
struct DemoShape {
  DType dtype = DType::f32;
  std::int64_t kv_heads = 0, seqlen_kv = 0;
};

DemoShape resolve_shape(const DemoOptions& demo) {
  return {.dtype = parse_dtype(demo.dtype),
          .kv_heads = demo.kv_heads > 0 ? demo.kv_heads : demo.heads,
          .seqlen_kv = demo.seqlen_kv > 0 ? demo.seqlen_kv : demo.seqlen};
}

// The options of the demo's problem; `slopes` holds the ALiBi slopes they point to.
AttentionOptions attention_options(const DemoOptions& demo, std::vector<float>& slopes) {
  AttentionOptions options;
  options.softcap = *parse_softcap(demo.softcap);  // checked when parsed
  if (demo.alibi) {
    if (!demo.causal) {
      throw Error(
          "demo: --alibi: expected the causal mask (the default; ALiBi models are causal "
          "decoders, and the demo's reference check needs it), got --no-causal");
    }
    slopes = alibi_paper_slopes(demo.heads);
    options.alibi_slopes = slopes;
  }
  options.causal = demo.causal;
  const std::array<std::int64_t, 2> window = *parse_window(demo.window);  // checked when parsed
  options.window_left = window[0];
  options.window_right = window[1];
  options.num_threads = demo.threads;
  return options;
}

// The lines above the table: the shape, the threads and inputs, how the timing is taken.
void print_problem(const DemoOptions& demo, const DemoShape& shape, const AttentionOptions& options,
                   double flops) {
  std::printf(
      "flashattn demo: exact attention, the standard path against the FlashAttention path\n");
  std::printf(
      "shape    batch %lld, heads %lld (kv heads %lld), seqlen %lld (kv %lld), head_dim %lld, %s, "
      "%s\n",
      static_cast<long long>(demo.batch), static_cast<long long>(demo.heads),
      static_cast<long long>(shape.kv_heads), static_cast<long long>(demo.seqlen),
      static_cast<long long>(shape.seqlen_kv), static_cast<long long>(demo.head_dim),
      mask_text(options).c_str(), dtype_name(shape.dtype));
  std::printf(
      "threads  %d (OpenMP: max threads %d, %d processors); inputs normal(0, 1), seed %llu\n",
      resolved_threads(demo.threads), omp_get_max_threads(), omp_get_num_procs(),
      static_cast<unsigned long long>(demo.seed));
  // The standard path's products are OpenBLAS's sgemm: on a fallback kernel the comparison
  // below would flatter flash.
  if (const std::optional<std::string> warning = bench::openblas_fallback_warning()) {
    bench::print_warning(*warning);
  }
  std::printf(
      "timing   median of %d runs after 1 warm-up; GFLOP/s = %.3g GFLOP (attention_flops) / "
      "time\n\n",
      demo.repeat, flops * 1e-9);
  std::fflush(stdout);
}

// Both paths' runs; the standard path's is empty, with the reason, where it cannot fit.
struct DemoRuns {
  PathRun standard, flash;
  std::optional<std::string> standard_skipped;
};

DemoRuns run_paths(const HostTensor& q, const HostTensor& k, const HostTensor& v,
                   const AttentionOptions& options, int repeat) {
  warm_up_runtime(q.dtype, q.shape[3], options);
  PathRun standard = make_path(AttentionImpl::standard, q);
  std::optional<std::string> standard_skipped = standard_refusal(standard, q, k, v, options);
  if (!standard_skipped) run_path(standard, q, k, v, options, repeat);
  PathRun flash = make_path(AttentionImpl::flash, q);
  run_path(flash, q, k, v, options, repeat);
  return {std::move(standard), std::move(flash), std::move(standard_skipped)};
}

// The table of times, rates and memory, and the lines that explain its columns.
void print_timings(const DemoRuns& runs, double flops, double kv_bytes) {
  std::printf("%-10s %12s %10s %10s %14s %16s\n", "path", "time (ms)", "GFLOP/s", "K+V GB/s",
              "score buffer", "peak extra RSS");
  for (const PathRun* run : {&runs.standard, &runs.flash}) {
    if (run == &runs.standard && runs.standard_skipped) {
      std::printf("%-10s skipped: %s\n", impl_name(run->impl), runs.standard_skipped->c_str());
      continue;
    }
    const double seconds = run->seconds;
    std::printf("%-10s %12.2f %10.2f %10.2f %14s %16s\n", impl_name(run->impl), seconds * 1e3,
                seconds > 0.0 ? flops / seconds * 1e-9 : 0.0,
                seconds > 0.0 ? kv_bytes / seconds * 1e-9 : 0.0,
                format_bytes(static_cast<double>(run->score_bytes)).c_str(),
                run->peak_extra_bytes
                    ? format_bytes(static_cast<double>(*run->peak_extra_bytes)).c_str()
                    : "n/a");
  }
  std::printf(
      "K+V GB/s: bytes of k and v (%s) / time, the measure of decoding, where a few query rows "
      "per KV head make GFLOP/s small\n"
      "score buffer: score_buffer_bytes(); peak extra RSS: rise of the peak resident set "
      "during the first call%s\n",
      format_bytes(kv_bytes).c_str(),
      runs.flash.peak_extra_bytes ? "" : " (n/a: /proc/self/clear_refs is not writable here)");
}

// Where both paths ran: flash's speed-up and the two paths' differences over whole tensors.
void print_flash_vs_standard(const DemoRuns& runs) {
  const PathRun &standard = runs.standard, &flash = runs.flash;
  if (flash.seconds > 0.0) {
    std::printf("flash is %.2fx the speed of standard\n", standard.seconds / flash.seconds);
  }
  Difference out_difference, lse_difference;
  for (std::int64_t i = 0; i < flash.out.numel(); ++i)
    out_difference.add(flash.out.at(i), standard.out.at(i));
  for (std::size_t i = 0; i < flash.lse.size(); ++i)
    lse_difference.add(flash.lse[i], standard.lse[i]);
  std::printf(
      "\nflash vs standard, whole tensors (relative diff = max |flash - standard| / max "
      "|standard|):\n");
  std::printf("  out  max abs diff %.3g, max rel diff %.3g\n", out_difference.max_abs,
              out_difference.relative());
  std::printf("  lse  max abs diff %.3g, max rel diff %.3g\n", lse_difference.max_abs,
              lse_difference.relative());
}

// Checks both paths against the fp64 reference on `rows` of every (batch, head), prints the
// errors, the rule and the verdict; true when flash is within its tolerance.
bool check_against_reference(const DemoRuns& runs, const HostTensor& q, const HostTensor& k,
                             const HostTensor& v, const AttentionOptions& options,
                             const std::vector<std::int64_t>& rows) {
  const PathRun &standard = runs.standard, &flash = runs.flash;
  const std::optional<std::string>& standard_skipped = runs.standard_skipped;
  const DType dtype = q.dtype;
  const ReferenceRows reference = reference_rows(q, k, v, options, rows);
  const PathErrors flash_errors = errors_against(reference, flash.out, flash.lse);
  const auto row_count = static_cast<long long>(reference.rows.size());
  std::printf(
      "\nvs the fp64 reference (reference_attention_forward) on %lld query row%s of every (batch, "
      "head):\n",
      row_count, row_count == 1 ? "" : "s");
  Tolerance tolerance;
  // Flash's tolerance is relative to the standard path's error: it means something only while the
  // standard path is itself within the worst-case bound (a wrong reference row, say, would put
  // both paths equally far off and let them "agree").
  bool standard_sound = true;
  if (standard_skipped) {
    // No standard error to compare with: the worst-case bound the standard path itself is held
    // to in `flashattn bench`, loose (it grows with seqlen_kv) but derived.
    tolerance = standard_error_bound(q, k, v, options, reference.rows);
    std::printf("  standard  skipped\n");
    std::printf("  flash     out max abs err %.3g, lse max abs err %.3g\n",
                flash_errors.out.max_abs, flash_errors.lse.max_abs);
    std::printf(
        "  rule: err(flash) <= the first-order worst-case error bound of an fp32 evaluation of "
        "these rows (Higham's gamma_n for the dot products, the softmax sum and P·V), as "
        "`flashattn bench` holds the standard path to\n");
  } else {
    const PathErrors standard_errors = errors_against(reference, standard.out, standard.lse);
    tolerance = tolerance_from_standard(standard_errors, dtype, max_abs(v));
    const Tolerance standard_bound = standard_error_bound(q, k, v, options, reference.rows);
    standard_sound = standard_bound.admits(standard_errors);
    std::printf(
        "  standard  out max abs err %.3g, lse max abs err %.3g (%s its worst-case bound "
        "%.3g, %.3g)\n",
        standard_errors.out.max_abs, standard_errors.lse.max_abs,
        standard_sound ? "within" : "OUTSIDE", standard_bound.out, standard_bound.lse);
    std::printf("  flash     out max abs err %.3g, lse max abs err %.3g\n",
                flash_errors.out.max_abs, flash_errors.lse.max_abs);
    std::printf(
        "  rule: err(flash) <= 4 x err(standard) + floor; floor = eps(%s) x max|v| = %.3g "
        "(out), 4 x eps(f32) x max(1, max|lse|) = %.3g (lse)\n",
        dtype_name(dtype), tolerance.out - 4.0 * standard_errors.out.max_abs,
        tolerance.lse - 4.0 * standard_errors.lse.max_abs);
  }

  const bool agree = standard_sound && tolerance.admits(flash_errors);
  std::printf("\n%s: %s (%sout err %.3g %s tolerance %.3g, lse err %.3g %s tolerance %.3g)\n",
              standard_skipped ? "flash within the bound" : "agree", agree ? "yes" : "NO",
              standard_sound ? "" : "the standard path is outside its bound; ",
              flash_errors.out.max_abs, flash_errors.out.max_abs <= tolerance.out ? "<=" : ">",
              tolerance.out, flash_errors.lse.max_abs,
              flash_errors.lse.max_abs <= tolerance.lse ? "<=" : ">", tolerance.lse);
  return agree;
}

int run_demo(const DemoOptions& demo) {
  const DemoShape shape = resolve_shape(demo);
  check_inputs_fit(demo, shape.dtype, shape.kv_heads, shape.seqlen_kv);
  std::vector<float> slopes;
  const AttentionOptions options = attention_options(demo, slopes);
  const double flops =
      attention_flops(demo.batch, demo.heads, demo.seqlen, shape.seqlen_kv, demo.head_dim, options);
  print_problem(demo, shape, options, flops);

  std::mt19937_64 rng(demo.seed);
  const std::array<std::int64_t, 4> kv_dims = {demo.batch, shape.seqlen_kv, shape.kv_heads,
                                               demo.head_dim};
  const HostTensor q =
      random_tensor(shape.dtype, {demo.batch, demo.seqlen, demo.heads, demo.head_dim}, rng);
  const HostTensor k = random_tensor(shape.dtype, kv_dims, rng);
  const HostTensor v = random_tensor(shape.dtype, kv_dims, rng);
  const DemoRuns runs = run_paths(q, k, v, options, demo.repeat);

  // K and V each read once per call: what bounds decoding (a few query rows per KV head).
  print_timings(runs, flops, 2.0 * static_cast<double>(k.numel()) * dtype_size(shape.dtype));
  if (!runs.standard_skipped) print_flash_vs_standard(runs);
  const std::vector<std::int64_t> rows = sample_rows(demo.seqlen, demo.check_rows, rng);
  return check_against_reference(runs, q, k, v, options, rows) ? kExitOk : kExitMismatch;
}

}  // namespace

Action add_demo_command(CLI::App& app) {
  auto demo = std::make_shared<DemoOptions>();
  CLI::App* command = app.add_subcommand(
      "demo", "Time both paths on random inputs and check them against the fp64 reference");
  command->footer(
      "Runs the standard path and the FlashAttention path on the same random inputs (default: "
      "the seed example B=2, heads=32, S=1024, Dh=128, causal, f32), times both, measures their "
      "memory and checks them against the fp64 reference. Where the standard path's score "
      "matrix cannot fit in memory, flash runs alone, held to the worst-case fp32 error bound."
      "\nExit codes: 0 the paths agree (or flash alone is within the bound), 1 invalid "
      "arguments, 2 bad command line, 3 the paths disagree (or flash alone is not).");
  command->option_defaults()->always_capture_default();
  command->add_option("--batch", demo->batch, "Batch size")->check(CLI::PositiveNumber);
  command->add_option("--heads", demo->heads, "Query heads")->check(CLI::PositiveNumber);
  command->add_option("--kv-heads", demo->kv_heads, "Key/value heads (GQA), 0 = as --heads")
      ->check(CLI::NonNegativeNumber);
  command->add_option("--seqlen", demo->seqlen, "Query sequence length")
      ->check(CLI::PositiveNumber);
  command->add_option("--seqlen-kv", demo->seqlen_kv, "Key/value sequence length, 0 = as --seqlen")
      ->check(CLI::NonNegativeNumber);
  command->add_option("--head-dim", demo->head_dim, "Head dimension")->check(CLI::PositiveNumber);
  command->add_flag("--causal,!--no-causal", demo->causal,
                    "Causal mask (default), aligned to the bottom-right corner");
  add_window_option(command, &demo->window);
  command->add_option("--dtype", demo->dtype, "Input dtype")
      ->check(CLI::IsMember({"f32", "f16", "bf16"}));
  add_softcap_option(command, &demo->softcap);
  command->add_flag("--alibi", demo->alibi,
                    "ALiBi biases with the paper's slopes for the head count (needs causal)");
  add_threads_option(command, &demo->threads);
  command->add_option("--seed", demo->seed, "Random seed of the inputs");
  command->add_option("--repeat", demo->repeat, "Timed runs per path after one warm-up (median)")
      ->check(CLI::PositiveNumber);
  command
      ->add_option("--check-rows", demo->check_rows,
                   "Query rows per (batch, head) checked against the fp64 reference")
      ->check(CLI::PositiveNumber);
  return [demo] { return run_demo(*demo); };
}

}  // namespace flashattn::cli
