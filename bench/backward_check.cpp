#include "backward_check.hpp"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "flashattn/backward.hpp"
#include "flashattn/dtype.hpp"

namespace flashattn::cli {
namespace {

// Largest |a - b| over two tensors of the same shape, b the reference.
Difference difference(const HostTensor& value, const HostTensor& reference) {
  Difference result;
  for (std::int64_t i = 0; i < value.numel(); ++i) result.add(value.at(i), reference.at(i));
  return result;
}

template <class View>
View offset_rows(View view, std::int64_t first_row, std::int64_t rows) {
  using Byte = std::conditional_t<std::is_same_v<View, TensorView>, char, const char>;
  view.data = static_cast<Byte*>(view.data) +
              first_row * view.strides[1] * static_cast<std::int64_t>(dtype_size(view.dtype));
  view.shape[1] = rows;
  return view;
}

}  // namespace

BackwardOracle::BackwardOracle(const BackwardProblem& problem, std::vector<std::int64_t> rows,
                               double reference_budget_flops)
    : problem_(problem), rows_(std::move(rows)) {
  const auto [batch, seqlen_q, heads_q, head_dim] = problem.q.shape;
  const std::int64_t seqlen_kv = problem.k.shape[1], heads_kv = problem.k.shape[2];
  batch_index_ = batch - 1;
  kv_head_ = heads_kv - 1;
  group_ = heads_q / heads_kv;
  whole_slice_ = attention_backward_flops(1, group_, seqlen_q, seqlen_kv, head_dim,
                                          problem.options) <= reference_budget_flops;

  const double u32 = machine_epsilon(DType::f32) / 2.0;
  const double u_out = machine_epsilon(problem.q.dtype) / 2.0;
  const double scale =
      problem.options.softmax_scale.value_or(1.0f / std::sqrt(static_cast<float>(head_dim)));
  const double qk = max_abs(problem.q) * max_abs(problem.k);
  const auto dim = static_cast<double>(head_dim);
  // The score modifiers add to a logit's rounding (tests/test_score_modifiers.cpp): 4 ulps of
  // the softcap, two roundings of the ALiBi term A = max slope · max distance.
  const double softcap = problem.options.softcap;
  double alibi = 0.0;
  for (const float slope : problem.options.alibi_slopes) {
    alibi = std::max(alibi, std::abs(static_cast<double>(slope)) *
                                static_cast<double>(std::max(seqlen_q, seqlen_kv)));
  }
  bounds_.first_order = u32 * (4.0 * scale * dim * qk + 4.0 * alibi + 8.0 * softcap +
                               2.0 * static_cast<double>(seqlen_kv + seqlen_q + 1) + 16.0) +
                        2.0 * u_out;
  bounds_.floor =
      2.0 * u_out + 4.0 * u32 * scale * std::sqrt(dim) * qk + 4.0 * u32 * (alibi + softcap);
  bounds_.dout_v = max_abs(problem.dout) * max_abs(problem.v);
}

std::string BackwardOracle::name(AttentionImpl impl) const {
  if (whole_slice_) return "reference";
  return impl == AttentionImpl::flash && standard_ ? "reference-dq-rows+standard"
                                                   : "reference-dq-rows";
}

AttentionOptions BackwardOracle::slice_options() const {
  AttentionOptions options = problem_.options;
  const auto heads_q = static_cast<std::size_t>(problem_.q.shape[2]);
  const auto first_q_head = static_cast<std::size_t>(kv_head_ * group_);
  const auto group = static_cast<std::size_t>(group_);
  if (!options.alibi_slopes.empty()) {
    const std::size_t entry = options.alibi_slopes.size() == heads_q
                                  ? 0
                                  : static_cast<std::size_t>(batch_index_) * heads_q;
    options.alibi_slopes = options.alibi_slopes.subspan(entry + first_q_head, group);
  }
  if (!options.sinks.empty()) options.sinks = options.sinks.subspan(first_q_head, group);
  // A bias or mask: the slice's batch entry and heads where it has them (not where it
  // broadcasts).
  auto slice_logits = [&](auto& view, std::int64_t element) {
    if (view.data == nullptr) return;
    std::int64_t offset = 0;
    if (view.shape[0] > 1) offset += batch_index_ * view.strides[0], view.shape[0] = 1;
    if (view.shape[1] > 1) {
      offset += static_cast<std::int64_t>(first_q_head) * view.strides[1];
      view.shape[1] = group_;
    }
    view.data = reinterpret_cast<decltype(view.data)>(reinterpret_cast<const char*>(view.data) +
                                                      offset * element);
  };
  slice_logits(options.bias, static_cast<std::int64_t>(dtype_size(options.bias.dtype)));
  slice_logits(options.mask, 1);
  return options;
}

template <class View>
View BackwardOracle::slice_view(View whole, std::int64_t first_head, std::int64_t heads) const {
  using Byte = std::conditional_t<std::is_same_v<View, TensorView>, char, const char>;
  whole.data = static_cast<Byte*>(whole.data) +
               (batch_index_ * whole.strides[0] + first_head * whole.strides[2]) *
                   static_cast<std::int64_t>(dtype_size(whole.dtype));
  whole.shape[0] = 1;
  whole.shape[2] = heads;
  return whole;
}

SliceGradients BackwardOracle::slice_of(const HostTensor& dq, const HostTensor& dk,
                                        const HostTensor& dv) const {
  auto copy = [&](const HostTensor& whole, std::int64_t first_head, std::int64_t heads) {
    const auto [batch, seqlen, all_heads, head_dim] = whole.shape;
    HostTensor slice(whole.dtype, {1, seqlen, heads, head_dim});
    std::int64_t index = 0;
    for (std::int64_t s = 0; s < seqlen; ++s) {
      for (std::int64_t h = first_head; h < first_head + heads; ++h) {
        const std::int64_t base = ((batch_index_ * seqlen + s) * all_heads + h) * head_dim;
        for (std::int64_t d = 0; d < head_dim; ++d) {
          store_f32(slice.data(), slice.dtype, index++, whole.at(base + d));
        }
      }
    }
    return slice;
  };
  return {copy(dq, kv_head_ * group_, group_), copy(dk, kv_head_, 1), copy(dv, kv_head_, 1)};
}

SliceGradients BackwardOracle::run_on_slice(AttentionImpl impl, int threads) const {
  const std::int64_t seqlen_q = problem_.q.shape[1], seqlen_kv = problem_.k.shape[1],
                     head_dim = problem_.q.shape[3];
  SliceGradients slice{HostTensor(problem_.q.dtype, {1, seqlen_q, group_, head_dim}),
                       HostTensor(problem_.q.dtype, {1, seqlen_kv, 1, head_dim}),
                       HostTensor(problem_.q.dtype, {1, seqlen_kv, 1, head_dim})};
  fill_nan(slice.dq);
  fill_nan(slice.dk);
  fill_nan(slice.dv);
  AttentionOptions options = slice_options();
  options.num_threads = threads;
  const std::int64_t first_q_head = kv_head_ * group_;
  const float* lse =
      problem_.lse.data() + (batch_index_ * problem_.q.shape[2] + first_q_head) * seqlen_q;
  attention_backward(impl, slice_view(problem_.dout.view(), first_q_head, group_),
                     slice_view(problem_.q.view(), first_q_head, group_),
                     slice_view(problem_.k.view(), kv_head_, 1),
                     slice_view(problem_.v.view(), kv_head_, 1),
                     slice_view(problem_.out.view(), first_q_head, group_), lse, slice.dq.view(),
                     slice.dk.view(), slice.dv.view(), options);
  return slice;
}

// The reference reads out and lse only to validate their shapes, so whichever path's forward
// outputs `problem_` holds will do.
void BackwardOracle::compute_reference() {
  if (reference_ || reference_dq_rows_) return;
  if (whole_slice_) {
    reference_ = run_on_slice(AttentionImpl::reference, problem_.options.num_threads);
    return;
  }
  // dQ row i depends on query row i alone: the reference on that row against its visible keys.
  const auto [batch, seqlen_q, heads_q, head_dim] = problem_.q.shape;
  const std::int64_t seqlen_kv = problem_.k.shape[1], first_q_head = kv_head_ * group_;
  const DType dtype = problem_.q.dtype;
  HostTensor dq_rows(dtype, {1, static_cast<std::int64_t>(rows_.size()), group_, head_dim});
  HostTensor dq_row(dtype, {1, 1, group_, head_dim});
  std::vector<float> lse_row(static_cast<std::size_t>(group_));
  std::int64_t index = 0;
  for (const std::int64_t row : rows_) {
    const RowKeys row_problem = row_keys(row, seqlen_q, seqlen_kv, slice_options());
    const std::int64_t keys = row_problem.keys;
    HostTensor unused_dk(dtype, {1, keys, 1, head_dim}), unused_dv(dtype, {1, keys, 1, head_dim});
    for (std::int64_t g = 0; g < group_; ++g) {
      lse_row[static_cast<std::size_t>(g)] = problem_.lse[static_cast<std::size_t>(
          (batch_index_ * heads_q + first_q_head + g) * seqlen_q + row)];
    }
    reference_attention_backward(
        offset_rows(slice_view(problem_.dout.view(), first_q_head, group_), row, 1),
        offset_rows(slice_view(problem_.q.view(), first_q_head, group_), row, 1),
        offset_rows(slice_view(problem_.k.view(), kv_head_, 1), 0, keys),
        offset_rows(slice_view(problem_.v.view(), kv_head_, 1), 0, keys),
        offset_rows(slice_view(problem_.out.view(), first_q_head, group_), row, 1), lse_row.data(),
        dq_row.view(), unused_dk.view(), unused_dv.view(), row_problem.options);
    for (std::int64_t i = 0; i < dq_row.numel(); ++i) {
      store_f32(dq_rows.data(), dtype, index++, dq_row.at(i));
    }
  }
  reference_dq_rows_ = std::move(dq_rows);
}

// dQ against the reference: on the whole slice, or on the sampled rows.
Difference BackwardOracle::dq_error(const HostTensor& dq) const {
  if (reference_) return difference(dq, reference_->dq);
  Difference error;
  const std::int64_t row_size = group_ * dq.shape[3];
  for (std::size_t r = 0; r < rows_.size(); ++r) {
    for (std::int64_t i = 0; i < row_size; ++i) {
      error.add(dq.at(rows_[r] * row_size + i),
                reference_dq_rows_->at(static_cast<std::int64_t>(r) * row_size + i));
    }
  }
  return error;
}

BackwardChecks BackwardOracle::check_standard(const SliceGradients& standard) {
  compute_reference();
  auto check = [&](const Difference& error) {
    return GradientCheck{error.max_abs,
                         bounds_.first_order * (error.max_reference + bounds_.dout_v)};
  };
  BackwardChecks checks;
  checks.dq = check(dq_error(standard.dq));
  if (reference_) {
    checks.dk = check(difference(standard.dk, reference_->dk));
    checks.dv = check(difference(standard.dv, reference_->dv));
  }
  standard_ = standard;
  standard_checks_ = checks;
  return checks;
}

BackwardChecks BackwardOracle::check_flash(const SliceGradients& flash) {
  compute_reference();
  auto against_reference = [&](const Difference& error, GradientCheck BackwardChecks::*gradient) {
    const double magnitude = error.max_reference + bounds_.dout_v;
    // Without the standard path's measured error, its bound stands in for it.
    const std::optional<double> measured =
        standard_checks_ ? ((*standard_checks_).*gradient).error : std::nullopt;
    const double baseline = measured.value_or(bounds_.first_order * magnitude);
    return GradientCheck{error.max_abs, 4.0 * baseline + bounds_.floor * magnitude};
  };
  auto against_standard = [&](const Difference& error) {
    const double magnitude = error.max_reference + bounds_.dout_v;
    return GradientCheck{error.max_abs, (5.0 * bounds_.first_order + bounds_.floor) * magnitude};
  };
  BackwardChecks checks;
  checks.dq = against_reference(dq_error(flash.dq), &BackwardChecks::dq);
  if (reference_) {
    checks.dk = against_reference(difference(flash.dk, reference_->dk), &BackwardChecks::dk);
    checks.dv = against_reference(difference(flash.dv, reference_->dv), &BackwardChecks::dv);
  } else if (standard_) {
    checks.dk = against_standard(difference(flash.dk, standard_->dk));
    checks.dv = against_standard(difference(flash.dv, standard_->dv));
  }
  return checks;
}

}  // namespace flashattn::cli
