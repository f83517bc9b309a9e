// What the machine is and what it can do, for `flashattn bench`.

#include "machine.hpp"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>

#include "flashattn/introspect.hpp"
#include "openblas_core.hpp"

namespace flashattn::cli {
namespace {

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

std::string today() {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char text[16];
  std::strftime(text, sizeof(text), "%Y-%m-%d", &local);
  return text;
}

}  // namespace

Machine describe_machine(int threads) {
  const char* coretype = std::getenv("OPENBLAS_CORETYPE");
  return {.date = today(),
          .host = host_name(),
          .cpu_model = cpu_model(),
          .simd_target = simd_target(),
          .bf16_products = bf16_products(),
          .openblas_core = bench::openblas_core(),
          .openblas_coretype = coretype != nullptr ? coretype : "",
          .openblas_warning = bench::openblas_fallback_warning(),
          .threads = threads};
}

std::string file_name_safe(std::string text) {
  for (char& c : text) {
    const bool keep = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                      c == '.' || c == '-' || c == '_';
    if (!keep) c = '_';
  }
  return text;
}

double peak_for(const Ceilings& ceilings, DType dtype) {
  double peak = ceilings.fma_gflops;
  if (dtype == DType::bf16) {
    peak =
        std::max({peak, ceilings.bf16_dot_gflops.value_or(0.0), ceilings.amx_gflops.value_or(0.0)});
  }
  return peak;
}

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
  if (amx_supported()) {
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

}  // namespace flashattn::cli
