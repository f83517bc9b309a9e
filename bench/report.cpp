// The CSV and the printed tables of `flashattn bench`.

#include "report.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>

#include "openblas_core.hpp"

namespace flashattn::cli {

namespace {

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
    cpu_share += std::string(cpu_share.empty() ? "" : "/") + cell(path->cpu_share, "%.2f");
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

}  // namespace

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
          // Rates and ratios in significant digits, not decimals: the sanitized builds run so
          // slowly that fixed decimals wrote some of their rates and ratios as 0.
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

void print_header(const Machine& machine, const Ceilings& ceilings, const BenchOptions& options,
                  bool sweep_table) {
  std::printf("flashattn bench: flash and standard attention against the machine's ceilings\n");
  std::printf("machine  %s, %s; %d threads; library SIMD target %s, bf16 products %s\n",
              machine.host.c_str(), machine.cpu_model.c_str(), machine.threads,
              machine.simd_target.c_str(), machine.bf16_products.c_str());
  std::printf("openblas core %s%s%s\n", machine.openblas_core.c_str(),
              machine.openblas_coretype.empty() ? "" : ", OPENBLAS_CORETYPE=",
              machine.openblas_coretype.c_str());
  if (machine.openblas_warning) {
    bench::print_warning(*machine.openblas_warning);
  } else if (!machine.openblas_coretype.empty()) {
    // A pinned kernel can run sgemm far slower than OpenBLAS's own choice for this CPU, which
    // lowers the sgemm ceiling and the standard path alike.
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

}  // namespace flashattn::cli
