#pragma once

// What a call will need and what this machine offers, for a caller that plans before it calls:
// the scratch memory of a forward or backward call, the memory limit above which a call is
// refused, the CPU paths the kernels run on (as `flashattn bench` reports them), the library's
// version and its BLAS.

#include <cstdint>

#include "flashattn/attention.hpp"

namespace flashattn {

// The scratch bytes that attention_forward(impl, q, k, v, out, lse, options) allocates at most,
// all threads together (saturating at INT64_MAX). Validates the arguments exactly as that call
// does and raises the same flashattn::Error, prefixed "forward_scratch_bytes"; reads and writes
// no tensor data. The call itself is refused when this exceeds memory_limit_bytes().
std::int64_t forward_scratch_bytes(AttentionImpl impl, const ConstTensorView& q,
                                   const ConstTensorView& k, const ConstTensorView& v,
                                   const TensorView& out, float* lse,
                                   const AttentionOptions& options = {});

// The same for attention_backward(impl, dout, q, k, v, out, lse, dq, dk, dv, options), its
// errors prefixed "backward_scratch_bytes".
std::int64_t backward_scratch_bytes(AttentionImpl impl, const ConstTensorView& dout,
                                    const ConstTensorView& q, const ConstTensorView& k,
                                    const ConstTensorView& v, const ConstTensorView& out,
                                    const float* lse, const TensorView& dq, const TensorView& dk,
                                    const TensorView& dv, const AttentionOptions& options = {});

// The bytes above which a call's scratch is refused: physical memory, lowered by a cgroup
// (v2 or v1) memory limit when one is set. Read once per process; always > 0.
std::int64_t memory_limit_bytes();

// The Highway target the kernels dispatch to on this CPU, e.g. "AVX2", "AVX3" or "AVX3_ZEN4";
// "none" if no compiled target runs here. A static string, the same for the whole process.
const char* simd_target();

// The library's version, "MAJOR.MINOR.PATCH": the project version it was built as (the one
// FLASHATTN_VERSION_STRING of flashattn/version.hpp names for the headers). A static string.
const char* version();

// The BLAS behind the standard path's and the MHA layer's sgemm, as this process runs it: e.g.
// "OpenBLAS 0.3.21 (system, Haswell kernel)", "OpenBLAS 0.3.34.481.3 (scipy-openblas, SkylakeX
// kernel)", or "plain-loop sgemm (FLASHATTN_PLAIN_BLAS)" in the sanitizer builds. A static string.
const char* blas();

// How the tile products of bf16 inputs run now: "widened" (converted to fp32, any CPU),
// "avx512_bf16" (vdpbf16ps) or "amx" (AMX tiles). The environment variable
// FLASHATTN_BF16_PRODUCTS=widened|avx512_bf16|amx picks another supported one. A static string.
const char* bf16_products();

// Whether this CPU and kernel let the process use AMX bf16 tiles (the first call asks the
// kernel for the tile state, as the library's AMX path does).
bool amx_supported();

}  // namespace flashattn
