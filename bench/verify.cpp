#include "verify.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "flashattn/dtype.hpp"

namespace flashattn::cli {

HostTensor::HostTensor(DType dtype_, std::array<std::int64_t, 4> shape_)
    : dtype(dtype_), shape(shape_) {
  const auto count = static_cast<std::size_t>(numel());
  if (dtype == DType::f32) {
    f32.assign(count, 0.0f);
  } else {
    bits16.assign(count, 0);
  }
}

void* HostTensor::data() {
  return dtype == DType::f32 ? static_cast<void*>(f32.data()) : static_cast<void*>(bits16.data());
}

const void* HostTensor::data() const {
  return dtype == DType::f32 ? static_cast<const void*>(f32.data())
                             : static_cast<const void*>(bits16.data());
}

float HostTensor::at(std::int64_t index) const { return load_f32(data(), dtype, index); }

DType parse_dtype(const std::string& name) {
  if (name == "f16") return DType::f16;
  if (name == "bf16") return DType::bf16;
  return DType::f32;
}

double machine_epsilon(DType dtype) {
  return std::ldexp(1.0, 1 - dtype_traits(dtype).significand_bits);
}

HostTensor random_tensor(DType dtype, std::array<std::int64_t, 4> shape, std::mt19937_64& rng) {
  HostTensor tensor(dtype, shape);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::int64_t i = 0; i < tensor.numel(); ++i) {
    store_f32(tensor.data(), dtype, i, normal(rng));
  }
  return tensor;
}

double max_abs(const HostTensor& tensor) {
  double largest = 0.0;
  for (std::int64_t i = 0; i < tensor.numel(); ++i) {
    const double value = std::fabs(double{tensor.at(i)});
    if (std::isfinite(value)) largest = std::max(largest, value);
  }
  return largest;
}

void Difference::add(double value, double reference) {
  const double difference = value == reference ? 0.0 : std::fabs(value - reference);
  max_abs = std::max(max_abs,
                     std::isnan(difference) ? std::numeric_limits<double>::infinity() : difference);
  if (std::isfinite(reference)) max_reference = std::max(max_reference, std::fabs(reference));
}

void fill_nan(HostTensor& tensor) {
  std::fill(tensor.f32.begin(), tensor.f32.end(), std::numeric_limits<float>::quiet_NaN());
  std::fill(tensor.bits16.begin(), tensor.bits16.end(),
            tensor.dtype == DType::f16 ? std::uint16_t{0x7e00} : std::uint16_t{0x7fc0});
}

std::vector<std::int64_t> sample_rows(std::int64_t seqlen_q, std::int64_t count,
                                      std::mt19937_64& rng) {
  const auto wanted = static_cast<std::size_t>(std::min(count, seqlen_q));
  std::set<std::int64_t> rows;
  for (const std::int64_t row : {std::int64_t{0}, seqlen_q - 1, std::int64_t{1}, seqlen_q / 2}) {
    if (rows.size() < wanted && row < seqlen_q) rows.insert(row);
  }
  std::uniform_int_distribution<std::int64_t> pick(0, seqlen_q - 1);
  while (rows.size() < wanted) rows.insert(pick(rng));
  return {rows.begin(), rows.end()};
}

RowKeys row_keys(std::int64_t row, std::int64_t seqlen_q, std::int64_t seqlen_kv,
                 const AttentionOptions& options) {
  const std::int64_t diagonal = row + seqlen_kv - seqlen_q;
  std::int64_t first = 0, last = seqlen_kv - 1;
  if (options.causal) last = std::min(last, diagonal);
  if (options.window_right >= 0) last = std::min(last, diagonal + options.window_right);
  if (options.window_left >= 0) first = std::max(first, diagonal - options.window_left);
  RowKeys row_problem{last >= first ? last + 1 : 0, options};
  row_problem.options.causal = false;
  row_problem.options.window_right = -1;
  row_problem.options.window_left = first > 0 ? last - first : -1;
  return row_problem;
}

// The fp64 reference is O(seqlen_q * seqlen_kv * head_dim) scalar work, too slow for whole
// tensors at benchmark shapes, so it runs on single query rows of every (batch, head).
ReferenceRows reference_rows(const HostTensor& q, const HostTensor& k, const HostTensor& v,
                             const AttentionOptions& options, std::vector<std::int64_t> rows) {
  if (!options.alibi_slopes.empty() && !options.causal) {
    throw Error("reference_rows: ALiBi rows are checked under the causal mask only");
  }
  const auto [batch, seqlen_q, heads_q, head_dim] = q.shape;
  const std::int64_t seqlen_kv = k.shape[1];
  const std::size_t element = dtype_size(q.dtype);
  const std::int64_t per_row_out = batch * heads_q * head_dim, per_row_lse = batch * heads_q;
  ReferenceRows reference;
  reference.out.reserve(rows.size() * static_cast<std::size_t>(per_row_out));
  reference.lse.reserve(rows.size() * static_cast<std::size_t>(per_row_lse));
  HostTensor row_out(q.dtype, {batch, 1, heads_q, head_dim});
  std::vector<float> row_lse(static_cast<std::size_t>(per_row_lse));
  const ConstTensorView q_full = q.view(), k_full = k.view(), v_full = v.view();

  for (const std::int64_t row : rows) {
    ConstTensorView q_row = q_full;
    q_row.data = static_cast<const char*>(q_full.data) + row * q_full.strides[1] * element;
    q_row.shape[1] = 1;
    RowKeys row_problem = row_keys(row, seqlen_q, seqlen_kv, options);
    ConstTensorView k_row = k_full, v_row = v_full;
    k_row.shape[1] = v_row.shape[1] = row_problem.keys;
    // A bias or mask: the row's own, over the same first keys.
    AttentionOptions& row_options = row_problem.options;
    if (options.bias.data != nullptr) {
      row_options.bias.data = static_cast<const char*>(options.bias.data) +
                              row * options.bias.strides[2] * dtype_size(options.bias.dtype);
      row_options.bias.shape[2] = 1;
      row_options.bias.shape[3] = row_problem.keys;
    }
    if (options.mask.data != nullptr) {
      row_options.mask.data = options.mask.data + row * options.mask.strides[2];
      row_options.mask.shape[2] = 1;
      row_options.mask.shape[3] = row_problem.keys;
    }
    reference_attention_forward(q_row, k_row, v_row, row_out.view(), row_lse.data(),
                                row_problem.options);
    // row_out is [batch, 1, heads_q, head_dim]: its flat order is already [batch, heads_q, dim].
    for (std::int64_t i = 0; i < per_row_out; ++i) reference.out.push_back(row_out.at(i));
    reference.lse.insert(reference.lse.end(), row_lse.begin(), row_lse.end());
  }
  reference.rows = std::move(rows);
  return reference;
}

PathErrors errors_against(const ReferenceRows& reference, const HostTensor& out,
                          const std::vector<float>& lse) {
  const auto [batch, seqlen_q, heads_q, head_dim] = out.shape;
  PathErrors errors;
  std::size_t out_index = 0, lse_index = 0;
  for (const std::int64_t row : reference.rows) {
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t h = 0; h < heads_q; ++h) {
        errors.lse.add(lse[(b * heads_q + h) * seqlen_q + row], reference.lse[lse_index++]);
        const std::int64_t base = ((b * seqlen_q + row) * heads_q + h) * head_dim;
        for (std::int64_t d = 0; d < head_dim; ++d) {
          errors.out.add(out.at(base + d), reference.out[out_index++]);
        }
      }
    }
  }
  return errors;
}

Tolerance tolerance_from_standard(const PathErrors& standard, DType dtype, double max_abs_v) {
  const double out_floor = machine_epsilon(dtype) * max_abs_v;
  const double lse_floor =
      4.0 * machine_epsilon(DType::f32) * std::max(1.0, standard.lse.max_reference);
  return {.out = 4.0 * standard.out.max_abs + out_floor,
          .lse = 4.0 * standard.lse.max_abs + lse_floor};
}

Tolerance standard_error_bound(const HostTensor& q, const HostTensor& k, const HostTensor& v,
                               const AttentionOptions& options,
                               const std::vector<std::int64_t>& rows) {
  // Not a structured binding: clang 14 cannot capture those in the lambda below.
  const std::int64_t batch = q.shape[0], seqlen_q = q.shape[1], heads_q = q.shape[2],
                     head_dim = q.shape[3], seqlen_kv = k.shape[1], heads_kv = k.shape[2];
  // Largest L2 norm of a sampled query row and of any key row: by Cauchy-Schwarz their product
  // times the scale bounds every |score|.
  double q_norm = 0.0, k_norm = 0.0;
  auto norm = [&](const HostTensor& tensor, std::int64_t offset) {
    double sum = 0.0;
    for (std::int64_t d = 0; d < head_dim; ++d) {
      const double value = tensor.at(offset + d);
      sum += value * value;
    }
    return std::sqrt(sum);
  };
  for (const std::int64_t row : rows) {
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t h = 0; h < heads_q; ++h) {
        q_norm = std::max(q_norm, norm(q, ((b * seqlen_q + row) * heads_q + h) * head_dim));
      }
    }
  }
  for (std::int64_t i = 0; i < batch * seqlen_kv * heads_kv; ++i) {
    k_norm = std::max(k_norm, norm(k, i * head_dim));
  }
  const double scale =
      options.softmax_scale.value_or(1.0f / std::sqrt(static_cast<float>(head_dim)));
  // The score modifiers (docs/semantics.md): a softcap bounds |score| by the cap and adds its
  // tanh's error (4 ulps of the cap); ALiBi adds up to slope·distance, rounded twice.
  const double softcap = options.softcap;
  double alibi = 0.0;
  for (const float slope : options.alibi_slopes) {
    alibi = std::max(alibi, std::abs(static_cast<double>(slope)) *
                                static_cast<double>(std::max(seqlen_q, seqlen_kv)));
  }
  // A bias adds up to its largest finite |entry|, rounded once (a −inf entry is a masked key).
  double bias = 0.0;
  if (options.bias.data != nullptr) {
    const ConstTensorView& b = options.bias;
    for (std::int64_t i0 = 0; i0 < b.shape[0]; ++i0)
      for (std::int64_t i1 = 0; i1 < b.shape[1]; ++i1)
        for (std::int64_t i2 = 0; i2 < b.shape[2]; ++i2)
          for (std::int64_t i3 = 0; i3 < b.shape[3]; ++i3) {
            const double value = load_f32(
                b.data, b.dtype,
                i0 * b.strides[0] + i1 * b.strides[1] + i2 * b.strides[2] + i3 * b.strides[3]);
            if (std::isfinite(value)) bias = std::max(bias, std::abs(value));
          }
  }
  const double max_score =
      (softcap > 0.0 ? std::min(softcap, scale * q_norm * k_norm) : scale * q_norm * k_norm) +
      alibi + bias;

  // Higham's gamma_n = n·u / (1 - n·u) bounds the relative error of n-term fp32 sums and dot
  // products in any order.
  constexpr double u = 0x1p-24;
  auto gamma = [](double n) { return n * u / (1.0 - n * u); };
  const double keys = static_cast<double>(std::max<std::int64_t>(seqlen_kv, 1));
  // A score: a head_dim-term dot product and the scale.
  const double score_error = gamma(static_cast<double>(head_dim) + 1.0) * scale * q_norm * k_norm +
                             4.0 * u * softcap + 2.0 * u * alibi + u * (max_score + bias);
  // s - max: the two scores' errors, the subtraction's rounding.
  const double argument_error = 2.0 * score_error + 2.0 * u * max_score;
  // Each softmax weight exp(s - max) is then off by this factor at most (exp within 4 ulps).
  const double weight_error = std::expm1(argument_error) + 4.0 * u;
  // Sum of p·v and of p over the keys.
  const double sum_error = gamma(keys + 2.0);
  // Weights off by a factor (1 ± e) move a convex combination of v rows by 2e/(1-e)·max|v|;
  // both the path and the reference round their output once to the dtype.
  const double out = max_abs(v) * (2.0 * weight_error / (1.0 - weight_error) + 2.0 * sum_error +
                                   machine_epsilon(q.dtype));
  // lse = max + log(sum): the perturbed scores, the sum, the log (4 ulps) and the final add,
  // rounded to fp32 by both sides.
  const double log_keys = std::log(keys);
  const double lse = score_error + 2.0 * u * max_score + 4.0 * u + sum_error + 4.0 * u * log_keys +
                     2.0 * u * (max_score + log_keys);
  return {.out = out, .lse = lse};
}

}  // namespace flashattn::cli
