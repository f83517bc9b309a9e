#pragma once

// Checking a path's output against the fp64 reference on sampled query rows, shared by
// `flashattn demo` and `flashattn bench`: host tensors in any storage dtype, random inputs, the
// reference on single rows, the error measures and the tolerance rules.

#include <array>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cache_aligned.hpp"
#include "flashattn/attention.hpp"
#include "flashattn/tensor.hpp"

namespace flashattn::cli {

// A contiguous [batch, seq, heads, head_dim] tensor owned in its storage dtype. Allocation
// touches every page, so later memory measurements see only what the library allocates.
// Storage starts on a 64-byte boundary, as a framework's tensors do: a large std::vector's
// data lies 16 bytes past one (glibc's mmap chunk header), and then every other 32-byte load
// of an f32 row straddles two cache lines, which slows f32 decoding from memory and from cache
// alike.
struct HostTensor {
  DType dtype = DType::f32;
  std::array<std::int64_t, 4> shape{};
  bench::CacheAlignedVector<float> f32;
  bench::CacheAlignedVector<std::uint16_t> bits16;  // f16 or bf16

  HostTensor(DType dtype_, std::array<std::int64_t, 4> shape_);
  std::int64_t numel() const { return shape[0] * shape[1] * shape[2] * shape[3]; }
  void* data();
  const void* data() const;
  TensorView view() { return contiguous_view(data(), dtype, shape); }
  ConstTensorView view() const { return contiguous_view(data(), dtype, shape); }
  float at(std::int64_t index) const;
};

// "f32", "f16" or "bf16" (callers validate the name first); anything else reads as f32.
DType parse_dtype(const std::string& name);

// Machine epsilon (spacing of values in [1, 2)) of each storage dtype.
double machine_epsilon(DType dtype);

// Elements drawn from normal(0, 1), rounded to `dtype`.
HostTensor random_tensor(DType dtype, std::array<std::int64_t, 4> shape, std::mt19937_64& rng);

// Largest |value| over finite elements.
double max_abs(const HostTensor& tensor);

// NaN in every element, so that an element a path fails to write cannot pass verification.
void fill_nan(HostTensor& tensor);

// Largest |a - b| and largest |b|; NaN or a one-sided infinity counts as an infinite difference,
// and equal infinities (-inf lse of fully masked rows) as none.
struct Difference {
  double max_abs = 0.0;
  double max_reference = 0.0;

  void add(double value, double reference);
  double relative() const { return max_reference > 0.0 ? max_abs / max_reference : max_abs; }
};

// `count` distinct query rows (all when seqlen_q <= count): the first, the last, the second and
// the middle one first, as the mask treats the edges differently, then random ones.
std::vector<std::int64_t> sample_rows(std::int64_t seqlen_q, std::int64_t count,
                                      std::mt19937_64& rng);

// Query row `row` alone against the keys [0, keys), under `options`, sees exactly the keys it
// sees in the whole problem. A one-row problem's diagonal sits on its last key (bottom-right
// alignment), so the keys end at the last one the row sees (its diagonal under the causal mask,
// a window's right edge, or the last key) and the row's first visible key becomes the left edge
// of a window; keys = 0 where the row sees none.
struct RowKeys {
  std::int64_t keys;
  AttentionOptions options;
};
RowKeys row_keys(std::int64_t row, std::int64_t seqlen_q, std::int64_t seqlen_kv,
                 const AttentionOptions& options);

// The fp64 reference on the query rows `rows` of every (batch, head), output rounded to the
// input dtype as reference_attention_forward does. ALiBi measures distances from the row's
// diagonal, which a one-row problem puts on its last key: with ALiBi slopes the options must hold
// the causal mask (the row's last key is then its diagonal), else this raises Error.
struct ReferenceRows {
  std::vector<std::int64_t> rows;
  std::vector<float> out;  // [rows.size(), batch, heads_q, head_dim]
  std::vector<float> lse;  // [rows.size(), batch, heads_q]
};
ReferenceRows reference_rows(const HostTensor& q, const HostTensor& k, const HostTensor& v,
                             const AttentionOptions& options, std::vector<std::int64_t> rows);

// A path's errors against the reference on the reference's rows; `out` and `lse` are the path's
// whole outputs (lse fp32 [batch, heads_q, seqlen_q]).
struct PathErrors {
  Difference out, lse;
};
PathErrors errors_against(const ReferenceRows& reference, const HostTensor& out,
                          const std::vector<float>& lse);

struct Tolerance {
  double out = 0.0, lse = 0.0;
  bool admits(const PathErrors& errors) const {
    return errors.out.max_abs <= out && errors.lse.max_abs <= lse;
  }
};

// docs/design.md, "How correctness is checked", for a fast path: both paths see the same rounded
// inputs, so the fast path may lose at most a small multiple of the standard path's own error, plus
// a floor for when that error happens to be ~0: one ulp of the storage dtype at the largest |v| for
// out (outputs are convex combinations of v rows), four fp32 ulps of the largest |lse| for lse (it
// is always fp32).
Tolerance tolerance_from_standard(const PathErrors& standard, DType dtype, double max_abs_v);

// For the standard path itself, which has no baseline to be compared with: a first-order
// worst-case bound on the error of an fp32 evaluation (any summation order) of the sampled rows.
// Loose by design (it grows with seqlen_kv as the worst case does), it catches a broken result,
// not a lost ulp.
Tolerance standard_error_bound(const HostTensor& q, const HostTensor& k, const HostTensor& v,
                               const AttentionOptions& options,
                               const std::vector<std::int64_t>& rows);

}  // namespace flashattn::cli
