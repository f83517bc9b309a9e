// `flashattn bench`: the FlashAttention path and the standard path on the same inputs and the same
// threads, each verified against the fp64 reference before it is timed, next to the machine's
// ceilings measured in the same run (docs/design.md, "How speed is measured"). With --backward,
// each path's backward follows its forward on the same inputs, verified on one (batch, KV head)
// slice before it is timed. Decode cases (one query position against a long KV cache) come last,
// timed as K and V bytes read per second against the memory copy ceiling (docs/design.md, "How
// speed is measured": decode is memory-bound). Writes one CSV row per case and path, and a plot of
// GFLOP/s against seqlen (and one of the backward's).
//
// This file holds the command line (flags, their checks, --quick) and the top-level sequence;
// the cases, the machine and its ceilings, the runs, the CSV and tables, and the plots are the
// flashattn_bench library in bench/.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <system_error>
#include <vector>

#include "atomic_file.hpp"
#include "cases.hpp"
#include "cli_common.hpp"
#include "flashattn/error.hpp"
#include "machine.hpp"
#include "measure.hpp"
#include "plots.hpp"
#include "report.hpp"

namespace flashattn::cli {
namespace {

namespace fs = std::filesystem;

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
