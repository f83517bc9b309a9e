#include "openblas_core.hpp"

#include <cblas.h>  // in a scipy-openblas build, maps openblas_get_corename to its prefixed name

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <sstream>

// Weak: the sanitizer builds (FLASHATTN_PLAIN_BLAS) link a plain-loop sgemm instead of OpenBLAS,
// and there the function does not exist.
extern "C" char* openblas_get_corename(void) __attribute__((weak));

namespace flashattn::bench {

std::string openblas_core() {
  const char* core = openblas_get_corename != nullptr ? openblas_get_corename() : nullptr;
  return std::string(core != nullptr ? std::string_view(core) : kOpenblasNotLinked);
}

std::optional<std::string> openblas_fallback_warning(std::string_view core,
                                                     std::string_view coretype_env, bool avx512f,
                                                     bool avx2) {
  // OpenBLAS's x86-64 kernels without AVX (its names, as openblas_get_corename gives them).
  constexpr std::array<std::string_view, 14> kSseOnlyCores = {
      "Katmai", "Coppermine", "Northwood", "Prescott", "Banias",        "Atom",      "Core2",
      "Penryn", "Dunnington", "Nehalem",   "Opteron",  "Opteron(SSE3)", "Barcelona", "Nano"};
  const bool sse_only = std::ranges::find(kSseOnlyCores, core) != kSseOnlyCores.end();
  if (!sse_only || !(avx512f || avx2)) return std::nullopt;

  const std::string width = avx512f ? "AVX-512" : "AVX2";
  const std::string fitting = avx512f ? "SkylakeX" : "Haswell";
  std::string text =
      "OpenBLAS runs its " + std::string(core) + " kernel (SSE only) on a CPU with " + width + ": ";
  text += coretype_env.empty()
              ? "this OpenBLAS does not recognize the CPU's model (it predates it). "
              : "OPENBLAS_CORETYPE=" + std::string(coretype_env) + " pins that kernel. ";
  text +=
      "Its sgemm (the standard path's products, the MHA layer's projections, bench's sgemm "
      "ceiling) may run several times slower than the CPU allows; OPENBLAS_CORETYPE=" +
      fitting + " selects its " + width + " kernel.";
  return text;
}

std::optional<std::string> openblas_fallback_warning() {
#ifdef FLASHATTN_BLAS_SCIPY_OPENBLAS
  // scipy-openblas32 (the wheel's, FLASHATTN_BLAS=scipy-openblas) is a current OpenBLAS that knows
  // the CPUs the system's falls back on: the warning is for builds against the system's.
  return std::nullopt;
#else
  const char* coretype = std::getenv("OPENBLAS_CORETYPE");
  return openblas_fallback_warning(openblas_core(), coretype != nullptr ? coretype : "",
                                   __builtin_cpu_supports("avx512f"),
                                   __builtin_cpu_supports("avx2"));
#endif
}

void print_warning(std::string_view text) {
  constexpr std::size_t kColumns = 100;
  std::string line = "warning ";
  std::istringstream words{std::string(text)};
  std::string word;
  while (words >> word) {
    if (line.size() + 1 + word.size() > kColumns) {
      std::printf("%s\n", line.c_str());
      line = std::string(8, ' ');
    }
    line += ' ' + word;
  }
  std::printf("%s\n", line.c_str());
}

}  // namespace flashattn::bench
