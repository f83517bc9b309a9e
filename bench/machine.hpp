#pragma once

// The machine `flashattn bench` runs on: what it is (host, CPU, the library's SIMD target and
// bf16 path, OpenBLAS's kernel) and what it can do (its ceilings, measured before the cases, and
// the peak loops re-run beside each timed call).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>

#include "ceilings.hpp"
#include "flashattn/dtype.hpp"

namespace flashattn::cli {

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

struct Machine {
  std::string date, host, cpu_model, simd_target, bf16_products, openblas_core, openblas_coretype;
  // OpenBLAS on an SSE-only kernel where the CPU has AVX2 or AVX-512 (openblas_core.hpp).
  std::optional<std::string> openblas_warning;
  int threads = 0;
};

// The machine's description, for `threads` threads, dated today.
Machine describe_machine(int threads);

// The host name as it goes into a file name: letters, digits, '.', '-' and '_' only.
std::string file_name_safe(std::string text);

// The peak that bounds a dtype's tile products: the f32 FMA peak, and for bf16 the largest of
// that, the vdpbf16ps peak and the AMX peak, as bf16 products may run any of those ways.
double peak_for(const Ceilings& ceilings, DType dtype);

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

// Measures the ceilings on `threads` threads, the sgemm one at each of `head_dims`, progress on
// stderr.
Ceilings measure_ceilings(int threads, const std::set<std::int64_t>& head_dims,
                          const CeilingBudget& budget);

}  // namespace flashattn::cli
