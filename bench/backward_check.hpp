#pragma once

// Checking a backward pass at benchmark shapes, for `flashattn bench --backward`. The fp64
// reference backward is O(seqlen_q * seqlen_kv * head_dim) scalar work on one thread per KV head,
// so it runs on one (batch, KV head) slice: the last batch, its last KV head and the query heads
// of that head's GQA group, seen through strided views of the whole tensors. Where even that slice
// costs more than a budget of FLOPs, the reference runs on single query rows only
// (exact for dQ, whose row i depends on query row i alone) and the flash path's dK and dV are
// compared with the standard path's on the slice.
//
// Score modifiers (options.hpp) are sliced with the heads. Tolerances follow
// tests/test_backward.cpp (and tests/test_score_modifiers.cpp for the modifiers' terms), with G =
// max|reference gradient| + max|dO|·max|v|, u = unit roundoff (fp32: u32; storage dtype: u_out) and
// qk = max|q|·max|k|:
//  * standard: u32·(4·scale·D·qk + 2·(Skv + Sq) + 16)·G, a first-order fp32 bound, plus one
//    rounding to the storage dtype for the standard path and one for the reference (2·u_out·G);
//  * flash: 4x the standard path's measured error on the same gradient, plus
//    (2·u_out + 4·u32·scale·sqrt(D)·qk)·G, the forward's rule (verify.hpp);
//  * flash against the standard path (dK, dV without a reference): |flash − standard| <=
//    |flash − ref| + |standard − ref| <= 4·bound + floor + bound, with the standard bound above.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "verify.hpp"

namespace flashattn::cli {

// The default budget, 2^34 backward FLOPs (2.5 x the forward's): seconds of the one-thread fp64
// reference, so the default sweep runs it up to seqlen 4096.
constexpr double kReferenceBackwardBudgetFlops = 17179869184.0;

// The forward's inputs and outputs and dO, whole, as the timed backward sees them.
struct BackwardProblem {
  const HostTensor& q;
  const HostTensor& k;
  const HostTensor& v;
  const HostTensor& dout;
  const HostTensor& out;
  const std::vector<float>& lse;  // [batch, heads_q, seqlen_q]
  AttentionOptions options;
};

// dQ [1, seqlen_q, group, head_dim], dK and dV [1, seqlen_kv, 1, head_dim] of one slice.
struct SliceGradients {
  HostTensor dq, dk, dv;
};

// One gradient's largest error and its tolerance; empty when the oracle does not check it.
struct GradientCheck {
  std::optional<double> error, tolerance;
  bool passes() const { return !error || (tolerance && *error <= *tolerance); }
};

struct BackwardChecks {
  GradientCheck dq, dk, dv;
  bool passes() const { return dq.passes() && dk.passes() && dv.passes(); }
};

class BackwardOracle {
 public:
  // `rows`: the query rows that the single-row reference checks when the slice's backward costs
  // more than `reference_budget_flops`.
  BackwardOracle(const BackwardProblem& problem, std::vector<std::int64_t> rows,
                 double reference_budget_flops);

  // What `impl`'s gradients were checked against: "reference" (fp64 on the whole slice),
  // "reference-dq-rows" (fp64 dQ on the sampled rows only) or, for flash,
  // "reference-dq-rows+standard" (and dK, dV against the standard path's).
  std::string name(AttentionImpl impl) const;

  // The slice of whole gradients [batch, seqlen, heads, head_dim].
  SliceGradients slice_of(const HostTensor& dq, const HostTensor& dk, const HostTensor& dv) const;

  // Runs `impl`'s backward on the slice views only (for the standard path's baseline when it is
  // not timed).
  SliceGradients run_on_slice(AttentionImpl impl, int threads) const;

  // The standard path against its first-order bound; remembers its gradients and errors as the
  // baseline of the flash tolerance. Without this call the flash tolerance takes the standard
  // bound in place of the standard path's error.
  BackwardChecks check_standard(const SliceGradients& standard);
  BackwardChecks check_flash(const SliceGradients& flash);

 private:
  struct Bounds {
    double first_order = 0.0;  // relative, times G: the standard path's bound
    double floor = 0.0;        // relative, times G: added to the flash tolerance
    double dout_v = 0.0;       // max|dO|·max|v|
  };

  template <class View>
  View slice_view(View whole, std::int64_t first_head, std::int64_t heads) const;
  // The problem's options for the slice: its query heads' ALiBi slopes and sinks.
  AttentionOptions slice_options() const;
  void compute_reference();
  Difference dq_error(const HostTensor& dq) const;

  const BackwardProblem& problem_;
  std::int64_t batch_index_ = 0, kv_head_ = 0, group_ = 1;
  bool whole_slice_ = true;
  std::vector<std::int64_t> rows_;
  Bounds bounds_;
  std::optional<SliceGradients> reference_;      // whole slice
  std::optional<HostTensor> reference_dq_rows_;  // [1, rows, group, head_dim]
  std::optional<SliceGradients> standard_;
  std::optional<BackwardChecks> standard_checks_;
};

}  // namespace flashattn::cli
