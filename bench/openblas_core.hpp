#pragma once

// Which kernel OpenBLAS runs, and whether it is one far older than the CPU. An OpenBLAS that
// predates a CPU model does not recognize it and falls back to a generic SSE kernel: Debian 12's
// OpenBLAS 0.3.21 runs Prescott on an Emerald Rapids-class Xeon (family 6 model 207), where its
// sgemm at head_dim 128 ran 63 GFLOP/s against 280 with OPENBLAS_CORETYPE=SkylakeX
// (bench/RESULTS.md, 2026-12-06). The standard path, the MHA projections and the sgemm ceiling all
// slow down by as much, so `flashattn demo` and `flashattn bench` say so, with the setting that
// fixes it.

#include <optional>
#include <string>
#include <string_view>

namespace flashattn::bench {

// What openblas_core() names in the builds that link the plain-loop sgemm instead of OpenBLAS.
inline constexpr std::string_view kOpenblasNotLinked = "none (OpenBLAS not linked)";

// The name of the kernel OpenBLAS chose (openblas_get_corename), or kOpenblasNotLinked.
std::string openblas_core();

// The warning for OpenBLAS running an SSE-only kernel (`core`) on a CPU with AVX-512F or AVX2,
// naming the OPENBLAS_CORETYPE that selects a kernel of the CPU's width (SkylakeX, Haswell).
// `coretype_env` is the variable's value, empty where it is not set: a pinned kernel is the
// user's choice, and the warning says so instead of blaming the CPU's detection. Nothing for a
// kernel that uses the CPU's vectors, for any kernel on a CPU without AVX2, and for the builds
// without OpenBLAS.
std::optional<std::string> openblas_fallback_warning(std::string_view core,
                                                     std::string_view coretype_env, bool avx512f,
                                                     bool avx2);

// The same for this process: its OpenBLAS, its environment and its CPU. Nothing in the builds
// against PyPI's scipy-openblas32 (FLASHATTN_BLAS=scipy-openblas), whose OpenBLAS is current.
std::optional<std::string> openblas_fallback_warning();

// Prints `text` to stdout as the tables' headers print their lines: "warning  " and then the
// text in lines of at most 100 columns, each further line indented as far.
void print_warning(std::string_view text);

}  // namespace flashattn::bench
