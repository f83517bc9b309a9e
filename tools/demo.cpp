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
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cli_common.hpp"
#include "flashattn/attention.hpp"
#include "flashattn/error.hpp"
#include "util/convert.hpp"

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
  std::string dtype = "f32";
  int threads = 0;
  std::uint64_t seed = 42;
  int repeat = 3;
  std::int64_t check_rows = 16;
};

// A contiguous [batch, seq, heads, head_dim] tensor owned in its storage dtype. Allocation
// touches every page, so later memory measurements see only what the library allocates.
struct HostTensor {
  DType dtype = DType::f32;
  std::array<std::int64_t, 4> shape{};
  std::vector<float> f32;
  std::vector<std::uint16_t> bits16;  // f16 or bf16

  HostTensor(DType dtype_, std::array<std::int64_t, 4> shape_) : dtype(dtype_), shape(shape_) {
    const auto count = static_cast<std::size_t>(shape[0] * shape[1] * shape[2] * shape[3]);
    if (dtype == DType::f32) {
      f32.assign(count, 0.0f);
    } else {
      bits16.assign(count, 0);
    }
  }
  std::int64_t numel() const { return shape[0] * shape[1] * shape[2] * shape[3]; }
  void* data() {
    return dtype == DType::f32 ? static_cast<void*>(f32.data()) : static_cast<void*>(bits16.data());
  }
  const void* data() const {
    return dtype == DType::f32 ? static_cast<const void*>(f32.data())
                               : static_cast<const void*>(bits16.data());
  }
  TensorView view() { return contiguous_view(data(), dtype, shape); }
  ConstTensorView view() const { return contiguous_view(data(), dtype, shape); }
  float at(std::int64_t index) const { return detail::load_f32(data(), dtype, index); }
};

DType parse_dtype(const std::string& name) {
  if (name == "f16") return DType::f16;
  if (name == "bf16") return DType::bf16;
  return DType::f32;
}

// Machine epsilon (spacing of values in [1, 2)) of each storage dtype.
double machine_epsilon(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return 0x1p-23;
    case DType::f16:
      return 0x1p-10;
    case DType::bf16:
      return 0x1p-7;
  }
  return 0x1p-23;
}

HostTensor random_tensor(DType dtype, std::array<std::int64_t, 4> shape, std::mt19937_64& rng) {
  HostTensor tensor(dtype, shape);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::int64_t i = 0; i < tensor.numel(); ++i) {
    detail::store_f32(tensor.data(), dtype, i, normal(rng));
  }
  return tensor;
}

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

PathRun run_path(AttentionImpl impl, const HostTensor& q, const HostTensor& k, const HostTensor& v,
                 const AttentionOptions& options, int repeat) {
  PathRun run{
      .impl = impl,
      .out = HostTensor(q.dtype, q.shape),
      .lse = std::vector<float>(static_cast<std::size_t>(q.shape[0] * q.shape[2] * q.shape[1])),
      .seconds = 0.0,
      .peak_extra_bytes = std::nullopt,
      .score_bytes = 0};
  const TensorView out = run.out.view();
  auto call = [&] {
    attention_forward(impl, q.view(), k.view(), v.view(), out, run.lse.data(), options);
  };
  run.peak_extra_bytes = run_measuring_peak(call);  // the first call doubles as the warm-up
  run.seconds = median_seconds(repeat, call);
  run.score_bytes = score_buffer_bytes(impl, q.shape[1], k.shape[1], q.shape[3], options);
  return run;
}

// Starts the OpenMP workers and OpenBLAS on a tiny problem, so that their one-time allocations
// are not charged to the first measured path.
void warm_up_runtime(DType dtype, std::int64_t head_dim, const AttentionOptions& options) {
  const std::int64_t heads = resolved_threads(options.num_threads);
  const HostTensor q(dtype, {1, 16, heads, head_dim});
  HostTensor out(dtype, q.shape);
  std::vector<float> lse(static_cast<std::size_t>(16 * heads));
  for (const AttentionImpl impl : {AttentionImpl::standard, AttentionImpl::flash}) {
    attention_forward(impl, q.view(), q.view(), q.view(), out.view(), lse.data(), options);
  }
}

// Largest |a - b| and largest |b|; NaN or a one-sided infinity counts as an infinite difference,
// and equal infinities (-inf lse of fully masked rows) as none.
struct Difference {
  double max_abs = 0.0;
  double max_reference = 0.0;

  void add(double value, double reference) {
    const double difference = value == reference ? 0.0 : std::fabs(value - reference);
    max_abs = std::max(
        max_abs, std::isnan(difference) ? std::numeric_limits<double>::infinity() : difference);
    if (std::isfinite(reference)) max_reference = std::max(max_reference, std::fabs(reference));
  }
  double relative() const { return max_reference > 0.0 ? max_abs / max_reference : max_abs; }
};

struct ReferenceErrors {
  Difference standard_out, flash_out, standard_lse, flash_lse;
  std::int64_t rows = 0;
};

// `count` distinct query rows (all when seqlen_q <= count): the first, the last, the second and
// the middle one first, as the mask treats the edges differently, then random ones.
std::vector<std::int64_t> sample_rows(std::int64_t seqlen_q, std::int64_t count,
                                      std::mt19937_64& rng) {
  const auto wanted = static_cast<std::size_t>(std::min(count, seqlen_q));
  std::set<std::int64_t> rows;
  for (const std::int64_t row : {std::int64_t{0}, seqlen_q - 1, std::int64_t{1}, seqlen_q / 2}) {
    if (rows.size() < wanted && row < seqlen_q) rows.insert(row);
  }
  std::uniform_int_distribution<std::int64_t> pick(0, seqlen_q - 1);
  while (rows.size() < wanted) rows.insert(pick(rng));
  return {rows.begin(), rows.end()};
}

// The fp64 reference is O(seqlen_q * seqlen_kv * head_dim) scalar work, too slow for whole
// tensors at the default shape, so it runs on single query rows of every (batch, head). Row i
// alone keeps its mask when the keys are cut to those it can see: with the causal mask that is
// keys [0, i + 1 + seqlen_kv - seqlen_q), whose last key is again on the slice's diagonal.
ReferenceErrors check_against_reference(const HostTensor& q, const HostTensor& k,
                                        const HostTensor& v, const AttentionOptions& options,
                                        const PathRun& standard, const PathRun& flash,
                                        const std::vector<std::int64_t>& rows) {
  const auto [batch, seqlen_q, heads_q, head_dim] = q.shape;
  const std::int64_t seqlen_kv = k.shape[1];
  const std::size_t element = dtype_size(q.dtype);
  ReferenceErrors errors;
  errors.rows = static_cast<std::int64_t>(rows.size());
  HostTensor reference_out(q.dtype, {batch, 1, heads_q, head_dim});
  std::vector<float> reference_lse(static_cast<std::size_t>(batch * heads_q));
  const ConstTensorView q_full = q.view(), k_full = k.view(), v_full = v.view();

  for (const std::int64_t row : rows) {
    ConstTensorView q_row = q_full;
    q_row.data = static_cast<const char*>(q_full.data) + row * q_full.strides[1] * element;
    q_row.shape[1] = 1;
    const std::int64_t visible_keys =
        options.causal ? std::clamp<std::int64_t>(row + 1 + seqlen_kv - seqlen_q, 0, seqlen_kv)
                       : seqlen_kv;
    ConstTensorView k_row = k_full, v_row = v_full;
    k_row.shape[1] = visible_keys;
    v_row.shape[1] = visible_keys;
    attention_reference(q_row, k_row, v_row, reference_out.view(), reference_lse.data(), options);

    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t h = 0; h < heads_q; ++h) {
        const std::int64_t lse_full = (b * heads_q + h) * seqlen_q + row;
        const double lse_reference = reference_lse[b * heads_q + h];
        errors.standard_lse.add(standard.lse[lse_full], lse_reference);
        errors.flash_lse.add(flash.lse[lse_full], lse_reference);
        for (std::int64_t d = 0; d < head_dim; ++d) {
          const std::int64_t full = ((b * seqlen_q + row) * heads_q + h) * head_dim + d;
          const double expected = reference_out.at((b * heads_q + h) * head_dim + d);
          errors.standard_out.add(standard.out.at(full), expected);
          errors.flash_out.add(flash.out.at(full), expected);
        }
      }
    }
  }
  return errors;
}

std::string format_bytes(std::int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof(text), unit == 0 ? "%.0f %s" : "%.2f %s", value, units[unit]);
  return text;
}

int run_demo(const DemoOptions& demo) {
  const DType dtype = parse_dtype(demo.dtype);
  const std::int64_t kv_heads = demo.kv_heads > 0 ? demo.kv_heads : demo.heads;
  const std::int64_t seqlen_kv = demo.seqlen_kv > 0 ? demo.seqlen_kv : demo.seqlen;
  AttentionOptions options;
  options.causal = demo.causal;
  options.num_threads = demo.threads;
  const double flops =
      attention_flops(demo.batch, demo.heads, demo.seqlen, seqlen_kv, demo.head_dim, options);

  std::printf(
      "flashattn demo: exact attention, the standard path against the FlashAttention path\n");
  std::printf(
      "shape    batch %lld, heads %lld (kv heads %lld), seqlen %lld (kv %lld), head_dim %lld, %s, "
      "%s\n",
      static_cast<long long>(demo.batch), static_cast<long long>(demo.heads),
      static_cast<long long>(kv_heads), static_cast<long long>(demo.seqlen),
      static_cast<long long>(seqlen_kv), static_cast<long long>(demo.head_dim),
      demo.causal ? "causal" : "no mask", dtype_name(dtype));
  std::printf(
      "threads  %d (OpenMP: max threads %d, %d processors); inputs normal(0, 1), seed %llu\n",
      resolved_threads(demo.threads), omp_get_max_threads(), omp_get_num_procs(),
      static_cast<unsigned long long>(demo.seed));
  std::printf(
      "timing   median of %d runs after 1 warm-up; GFLOP/s = %.3g GFLOP (attention_flops) / "
      "time\n\n",
      demo.repeat, flops * 1e-9);
  std::fflush(stdout);

  std::mt19937_64 rng(demo.seed);
  const HostTensor q =
      random_tensor(dtype, {demo.batch, demo.seqlen, demo.heads, demo.head_dim}, rng);
  const HostTensor k = random_tensor(dtype, {demo.batch, seqlen_kv, kv_heads, demo.head_dim}, rng);
  const HostTensor v = random_tensor(dtype, {demo.batch, seqlen_kv, kv_heads, demo.head_dim}, rng);

  warm_up_runtime(dtype, demo.head_dim, options);
  const PathRun standard = run_path(AttentionImpl::standard, q, k, v, options, demo.repeat);
  const PathRun flash = run_path(AttentionImpl::flash, q, k, v, options, demo.repeat);

  std::printf("%-10s %12s %10s %14s %16s\n", "path", "time (ms)", "GFLOP/s", "score buffer",
              "peak extra RSS");
  for (const PathRun* run : {&standard, &flash}) {
    std::printf("%-10s %12.2f %10.2f %14s %16s\n", impl_name(run->impl), run->seconds * 1e3,
                run->seconds > 0.0 ? flops / run->seconds * 1e-9 : 0.0,
                format_bytes(run->score_bytes).c_str(),
                run->peak_extra_bytes ? format_bytes(*run->peak_extra_bytes).c_str() : "n/a");
  }
  std::printf(
      "score buffer: score_buffer_bytes(); peak extra RSS: rise of the peak resident set "
      "during the first call%s\n",
      standard.peak_extra_bytes ? "" : " (n/a: /proc/self/clear_refs is not writable here)");
  if (flash.seconds > 0.0) {
    std::printf("flash is %.2fx the speed of standard\n", standard.seconds / flash.seconds);
  }

  Difference out_difference, lse_difference;
  for (std::int64_t i = 0; i < q.numel(); ++i)
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

  const std::vector<std::int64_t> rows = sample_rows(demo.seqlen, demo.check_rows, rng);
  const ReferenceErrors errors = check_against_reference(q, k, v, options, standard, flash, rows);
  std::printf(
      "\nvs the fp64 reference (attention_reference) on %lld query row%s of every (batch, head):\n",
      static_cast<long long>(errors.rows), errors.rows == 1 ? "" : "s");
  std::printf("  standard  out max abs err %.3g, lse max abs err %.3g\n",
              errors.standard_out.max_abs, errors.standard_lse.max_abs);
  std::printf("  flash     out max abs err %.3g, lse max abs err %.3g\n", errors.flash_out.max_abs,
              errors.flash_lse.max_abs);

  // Both paths see the same rounded inputs, so the fast path may lose at most a small multiple
  // of the standard path's own error, plus a floor for when that error happens to be ~0: one
  // ulp of the storage dtype at the largest |v| for out (outputs are convex combinations of v
  // rows), four fp32 ulps of the largest |lse| for lse (it is always fp32).
  double max_abs_v = 0.0;
  for (std::int64_t i = 0; i < v.numel(); ++i)
    max_abs_v = std::max(max_abs_v, std::fabs(double{v.at(i)}));
  const double out_floor = machine_epsilon(dtype) * max_abs_v;
  const double lse_floor =
      4.0 * machine_epsilon(DType::f32) * std::max(1.0, errors.standard_lse.max_reference);
  const double out_tolerance = 4.0 * errors.standard_out.max_abs + out_floor;
  const double lse_tolerance = 4.0 * errors.standard_lse.max_abs + lse_floor;
  std::printf(
      "  rule: err(flash) <= 4 x err(standard) + floor; floor = eps(%s) x max|v| = %.3g "
      "(out), 4 x eps(f32) x max(1, max|lse|) = %.3g (lse)\n",
      dtype_name(dtype), out_floor, lse_floor);

  const bool agree =
      errors.flash_out.max_abs <= out_tolerance && errors.flash_lse.max_abs <= lse_tolerance;
  std::printf("\nagree: %s (out err %.3g %s tolerance %.3g, lse err %.3g %s tolerance %.3g)\n",
              agree ? "yes" : "NO", errors.flash_out.max_abs,
              errors.flash_out.max_abs <= out_tolerance ? "<=" : ">", out_tolerance,
              errors.flash_lse.max_abs, errors.flash_lse.max_abs <= lse_tolerance ? "<=" : ">",
              lse_tolerance);
  return agree ? kExitOk : kExitMismatch;
}

}  // namespace

Action add_demo_command(CLI::App& app) {
  auto demo = std::make_shared<DemoOptions>();
  CLI::App* command = app.add_subcommand(
      "demo", "Time both paths on random inputs and check them against the fp64 reference");
  command->footer(
      "Runs the standard path and the FlashAttention path on the same random inputs (default: "
      "the seed example B=2, heads=32, S=1024, Dh=128, causal, f32), times both, measures their "
      "memory and checks them against the fp64 reference.\nExit codes: 0 the paths agree, 1 "
      "invalid arguments, 2 bad command line, 3 the paths disagree.");
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
  command->add_option("--dtype", demo->dtype, "Input dtype")
      ->check(CLI::IsMember({"f32", "f16", "bf16"}));
  command->add_option("--threads", demo->threads, "Worker threads, 0 = all")
      ->check(CLI::NonNegativeNumber);
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
