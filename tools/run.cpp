// `flashattn run`: attention on .npy inputs, .npy outputs, one JSON line of timing on stdout.
// With --dout (and --dq, --dk, --dv) the backward follows the forward on the same inputs.

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "cli_common.hpp"
#include "flashattn/attention.hpp"
#include "flashattn/backward.hpp"
#include "flashattn/dtype.hpp"
#include "flashattn/error.hpp"
#include "npy.hpp"
#ifdef FLASHATTN_WITH_CUDA
#include "cuda_run.hpp"
#endif

namespace flashattn::cli {
namespace {

struct RunOptions {
  std::string q_path, k_path, v_path, out_path, lse_path;
  std::string dout_path, dq_path, dk_path, dv_path;  // all empty or all set
  std::string alibi_path, sinks_path, dsinks_path;   // score modifiers; dsinks needs both
  std::string bias_path, mask_path, dbias_path;      // dbias needs the bias and the backward
  std::string softcap = "0";
  bool causal = false;
  std::string window = "-1,-1";
  std::string scale;  // empty: 1/sqrt(head_dim)
  std::string impl = "flash";
  std::string device = "cpu";
  int threads = 0;
  int repeat = 3;
  std::string dropout = "0";  // dropout_p, with the mask's seed
  std::uint64_t seed = 0;
};

std::optional<float> parse_dropout(const std::string& text) {
  float p = 0.0f;
  if (!parse_number(std::string_view(text), p) || !(p >= 0.0f && p < 1.0f)) return std::nullopt;
  return p;
}

std::optional<float> parse_scale(const std::string& text) {
  float scale = 0.0f;
  if (!parse_number(std::string_view(text), scale) || !std::isfinite(scale) || scale <= 0.0f) {
    return std::nullopt;
  }
  return scale;
}

std::optional<AttentionImpl> parse_impl(const std::string& text) {
  for (const AttentionImpl impl :
       {AttentionImpl::flash, AttentionImpl::standard, AttentionImpl::reference}) {
    if (text == impl_name(impl)) return impl;
  }
  return std::nullopt;
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string text = "(";
  for (std::size_t d = 0; d < shape.size(); ++d) {
    text += (d > 0 ? ", " : "") + std::to_string(shape[d]);
  }
  return text + (shape.size() == 1 ? ",)" : ")");
}

npy::Array read_operand(const char* name, const char* layout, const std::string& path) {
  npy::Array array = npy::read_npy(path);
  if (array.shape.size() != 4) {
    throw Error(std::string(name) + ": expected a rank-4 array " + layout + ", got shape " +
                shape_text(array.shape) + " in " + path);
  }
  return array;
}

// A modifier's fp32 values from `path` (float32 or float16), whose shape must be one of
// `shapes` (each written out in `expected`).
std::vector<float> read_modifier(const char* flag, const std::string& path,
                                 const std::vector<std::vector<std::int64_t>>& shapes,
                                 const std::string& expected) {
  const npy::Array array = npy::read_npy(path);
  if (std::find(shapes.begin(), shapes.end(), array.shape) == shapes.end()) {
    throw Error(std::string(flag) + ": expected shape " + expected + ", got " +
                shape_text(array.shape) + " in " + path);
  }
  return array.to_f32();
}

// A bias or mask file must be 2-d [seqlen_q, seqlen_kv] or 4-d.
void check_logit_rank(const char* flag, const std::vector<std::int64_t>& shape,
                      const std::string& path) {
  if (shape.size() != 2 && shape.size() != 4) {
    throw Error(std::string(flag) + ": expected a rank-2 array [seqlen_q, seqlen_kv] or rank-4 " +
                "[batch | 1, heads_q | 1, seqlen_q, seqlen_kv], got shape " + shape_text(shape) +
                " in " + path);
  }
}

// A 2-d bias or mask seen as [1, 1, seqlen_q, seqlen_kv].
std::array<std::int64_t, 4> logit_shape(const std::vector<std::int64_t>& shape) {
  if (shape.size() == 2) return {1, 1, shape[0], shape[1]};
  return {shape[0], shape[1], shape[2], shape[3]};
}

ConstTensorView view_of(const npy::Array& array) {
  return contiguous_view(array.data(), array.dtype,
                         {array.shape[0], array.shape[1], array.shape[2], array.shape[3]});
}

std::filesystem::path normalized(const std::string& path) {
  return std::filesystem::absolute(path).lexically_normal();
}

// A tensor that the library writes in the inputs' dtype, widened to float32 for its file.
class Output {
 public:
  Output(DType dtype, const std::array<std::int64_t, 4>& shape)
      : dtype_(dtype),
        shape_(shape),
        f32_(dtype == DType::f32 ? numel() : 0),
        f16_(dtype == DType::f16 ? numel() : 0) {}

  TensorView view() {
    void* data =
        dtype_ == DType::f32 ? static_cast<void*>(f32_.data()) : static_cast<void*>(f16_.data());
    return contiguous_view(data, dtype_, shape_);
  }

  void write(npy::Writer& writer) { write(writer, shape_); }

  // The same elements under another shape of as many (a 2-d bias's gradient).
  void write(npy::Writer& writer, std::span<const std::int64_t> shape) {
    if (dtype_ == DType::f16) {
      f32_.resize(f16_.size());
      for (std::size_t i = 0; i < f16_.size(); ++i) f32_[i] = f32_from_f16(f16_[i]);
    }
    writer.write(f32_.data(), shape);
  }

 private:
  std::size_t numel() const {
    return static_cast<std::size_t>(shape_[0] * shape_[1] * shape_[2] * shape_[3]);
  }

  DType dtype_;
  std::array<std::int64_t, 4> shape_;
  std::vector<float> f32_;
  std::vector<std::uint16_t> f16_;
};

// Every output is renamed into place at the end: two flags naming one file would race.
void check_distinct(const std::vector<std::pair<const char*, std::string>>& outputs) {
  for (std::size_t i = 1; i < outputs.size(); ++i) {
    for (std::size_t j = 0; j < i; ++j) {
      if (normalized(outputs[i].second) == normalized(outputs[j].second)) {
        throw Error(std::string(outputs[i].first) + ": expected a path different from " +
                    outputs[j].first + ", got " + outputs[i].second);
      }
    }
  }
}

// The score modifiers that are on, as JSON strings: "softcap", "alibi", "sinks", "bias", "mask".
std::string modifier_names(const AttentionOptions& options) {
  std::string names;
  auto add = [&](bool on, const char* name) {
    if (on) names += (names.empty() ? "\"" : ", \"") + std::string(name) + "\"";
  };
  add(options.softcap > 0.0f, "softcap");
  add(!options.alibi_slopes.empty(), "alibi");
  add(!options.sinks.empty(), "sinks");
  add(options.bias.data != nullptr, "bias");
  add(options.mask.data != nullptr, "mask");
  return names;
}

int run_attention(const RunOptions& options) {
  const AttentionImpl impl = *parse_impl(options.impl);
  const std::array<std::int64_t, 2> window = *parse_window(options.window);
  const bool backward = !options.dout_path.empty();
  const bool dsinks = !options.dsinks_path.empty();
  const bool dbias = !options.dbias_path.empty();

  // Open the outputs first, so that an unwritable destination fails before any work is done.
  std::vector<std::pair<const char*, std::string>> outputs = {{"--out", options.out_path}};
  if (!options.lse_path.empty()) outputs.emplace_back("--lse", options.lse_path);
  if (backward) {
    outputs.emplace_back("--dq", options.dq_path);
    outputs.emplace_back("--dk", options.dk_path);
    outputs.emplace_back("--dv", options.dv_path);
  }
  if (dsinks) outputs.emplace_back("--dsinks", options.dsinks_path);
  if (dbias) outputs.emplace_back("--dbias", options.dbias_path);
  check_distinct(outputs);
  npy::Writer out_writer(options.out_path);
  std::unique_ptr<npy::Writer> lse_writer, dq_writer, dk_writer, dv_writer;
  if (!options.lse_path.empty()) lse_writer = std::make_unique<npy::Writer>(options.lse_path);
  if (backward) {
    dq_writer = std::make_unique<npy::Writer>(options.dq_path);
    dk_writer = std::make_unique<npy::Writer>(options.dk_path);
    dv_writer = std::make_unique<npy::Writer>(options.dv_path);
  }
  std::unique_ptr<npy::Writer> dsinks_writer;
  if (dsinks) dsinks_writer = std::make_unique<npy::Writer>(options.dsinks_path);
  std::unique_ptr<npy::Writer> dbias_writer;
  if (dbias) dbias_writer = std::make_unique<npy::Writer>(options.dbias_path);

  const npy::Array q = read_operand("q", "[batch, seqlen_q, heads_q, head_dim]", options.q_path);
  const npy::Array k = read_operand("k", "[batch, seqlen_kv, heads_kv, head_dim]", options.k_path);
  const npy::Array v =
      read_operand("v", "[batch, seqlen_kv, heads_kv, head_dim_v]", options.v_path);
  npy::Array dout;
  if (backward) {
    // Checked here rather than by the library, so that a bad dO fails before the forward runs.
    // out's shape: q's [batch, seqlen_q, heads_q] and v's head dim.
    dout = read_operand("dout", "[batch, seqlen_q, heads_q, head_dim_v]", options.dout_path);
    const std::vector<std::int64_t> out_shape{q.shape[0], q.shape[1], q.shape[2], v.shape[3]};
    if (dout.shape != out_shape) {
      throw Error("dout: expected shape " + shape_text(out_shape) + " (as out: q's leading dims, " +
                  "v's head_dim_v), got " + shape_text(dout.shape) + " in " + options.dout_path);
    }
    if (dout.dtype != q.dtype) {
      throw Error(std::string("dout: expected dtype ") + dtype_name(q.dtype) + " (as q), got " +
                  dtype_name(dout.dtype) + " in " + options.dout_path);
    }
  }

  // The score modifiers, shaped by q: slopes [heads_q] or [batch, heads_q], sinks [heads_q].
  const std::int64_t batch_q = q.shape[0], heads = q.shape[2];
  const std::string heads_text = "(" + std::to_string(heads) + ",)";
  std::vector<float> slopes, sinks;
  if (!options.alibi_path.empty()) {
    slopes = read_modifier("alibi", options.alibi_path, {{heads}, {batch_q, heads}},
                           heads_text + " ([heads_q]) or (" + std::to_string(batch_q) + ", " +
                               std::to_string(heads) + ") ([batch, heads_q])");
  }
  if (!options.sinks_path.empty()) {
    sinks = read_modifier("sinks", options.sinks_path, {{heads}}, heads_text + " ([heads_q])");
  }

  // Bias (float32 or float16) and mask (bool): [seqlen_q, seqlen_kv], or
  // [batch | 1, heads_q | 1, seqlen_q, seqlen_kv]; the library checks the dims against q and k.
  npy::Array bias;
  if (!options.bias_path.empty()) {
    bias = npy::read_npy(options.bias_path);
    check_logit_rank("bias", bias.shape, options.bias_path);
  }
  npy::BoolArray mask;
  if (!options.mask_path.empty()) {
    mask = npy::read_npy_bool(options.mask_path);
    check_logit_rank("mask", mask.shape, options.mask_path);
  }

  AttentionOptions attention;
  if (!bias.shape.empty()) {
    const std::array<std::int64_t, 4> shape = logit_shape(bias.shape);
    attention.bias = contiguous_view(bias.data(), bias.dtype, shape);
  }
  if (!mask.shape.empty()) {
    const std::array<std::int64_t, 4> shape = logit_shape(mask.shape);
    attention.mask = MaskView{reinterpret_cast<const bool*>(mask.values.data()), shape,
                              contiguous_strides(shape)};
  }
  if (!options.scale.empty()) attention.softmax_scale = *parse_scale(options.scale);
  attention.softcap = *parse_softcap(options.softcap);
  attention.alibi_slopes = slopes;
  attention.sinks = sinks;
  attention.causal = options.causal;
  attention.window_left = window[0];
  attention.window_right = window[1];
  attention.num_threads = options.threads;
  attention.dropout_p = *parse_dropout(options.dropout);  // checked when parsed
  attention.dropout_seed = options.seed;

  const std::int64_t batch = q.shape[0], seqlen_q = q.shape[1], heads_q = q.shape[2],
                     head_dim = q.shape[3], seqlen_kv = k.shape[1], heads_kv = k.shape[2];
  const std::int64_t head_dim_v = v.shape[3];
  const std::array<std::int64_t, 4> q_shape{batch, seqlen_q, heads_q, head_dim};
  const std::array<std::int64_t, 4> kv_shape{batch, seqlen_kv, heads_kv, head_dim};
  const std::array<std::int64_t, 4> v_shape{batch, seqlen_kv, heads_kv, head_dim_v};
  Output out(q.dtype, {batch, seqlen_q, heads_q, head_dim_v});
  std::vector<float> lse(static_cast<std::size_t>(batch * heads_q * seqlen_q));

  double seconds = 0.0;
#ifdef FLASHATTN_WITH_CUDA
  std::optional<CudaRun> gpu;  // --device cuda
#endif
  if (options.device == "cuda") {
#ifdef FLASHATTN_WITH_CUDA
    gpu.emplace(view_of(q), view_of(k), view_of(v), attention);
    gpu->forward();  // warm-up; also where invalid shapes are rejected
    seconds = median_seconds(options.repeat, [&] { gpu->forward(); });
    gpu->copy_forward_out(out.view(), lse.data());
#endif
  } else {
    auto compute = [&] {
      attention_forward(impl, view_of(q), view_of(k), view_of(v), out.view(), lse.data(),
                        attention);
    };
    compute();  // warm-up; also where invalid shapes are rejected
    seconds = median_seconds(options.repeat, compute);
  }

  // The gradients have the inputs' dtype, as the forward's output; allocated only when asked.
  std::optional<Output> dq, dk, dv;
  std::vector<float> sink_gradients(dsinks ? sinks.size() : 0);
  std::optional<Output> bias_gradient;
  double backward_seconds = 0.0;
  if (backward) {
    dq.emplace(q.dtype, q_shape);
    dk.emplace(q.dtype, kv_shape);
    dv.emplace(q.dtype, v_shape);
    ModifierGradients modifier_gradients;
    if (dsinks) modifier_gradients.dsinks = sink_gradients.data();
    if (dbias) {
      bias_gradient.emplace(bias.dtype, logit_shape(bias.shape));
      modifier_gradients.dbias = bias_gradient->view();
    }
    std::function<void()> compute_backward = [&] {
      attention_backward(impl, view_of(dout), view_of(q), view_of(k), view_of(v), out.view(),
                         lse.data(), dq->view(), dk->view(), dv->view(), attention,
                         modifier_gradients);
    };
#ifdef FLASHATTN_WITH_CUDA
    if (gpu) {
      gpu->set_dout(view_of(dout));
      compute_backward = [&] { gpu->backward(); };
    }
#endif
    compute_backward();  // warm-up
    backward_seconds = median_seconds(options.repeat, compute_backward);
#ifdef FLASHATTN_WITH_CUDA
    if (gpu) gpu->copy_gradients(dq->view(), dk->view(), dv->view());
#endif
  }

  out.write(out_writer);
  if (lse_writer) {
    lse_writer->write(lse.data(), std::array<std::int64_t, 3>{batch, heads_q, seqlen_q});
  }
  if (backward) {
    dq->write(*dq_writer);
    dk->write(*dk_writer);
    dv->write(*dv_writer);
  }
  if (dbias) bias_gradient->write(*dbias_writer, bias.shape);
  if (dsinks) {
    dsinks_writer->write(sink_gradients.data(),
                         std::array<std::int64_t, 1>{static_cast<std::int64_t>(sinks.size())});
  }

  const double flops = attention_flops(batch, heads_q, seqlen_q, seqlen_kv, head_dim, attention);
  const double gflops = seconds > 0.0 ? flops / seconds * 1e-9 : 0.0;
  const float scale =
      attention.softmax_scale.value_or(1.0f / std::sqrt(static_cast<float>(head_dim)));
  std::printf(
      "{\"impl\": \"%s\", \"device\": \"%s\", \"dtype\": \"%s\", \"batch\": %lld, "
      "\"seqlen_q\": %lld, "
      "\"seqlen_kv\": %lld, \"heads_q\": %lld, \"heads_kv\": %lld, \"head_dim\": %lld, "
      "\"causal\": %s, \"window\": [%lld, %lld], \"scale\": %.9g, \"threads\": %d, "
      "\"softcap\": %.9g, \"modifiers\": [%s], \"dropout\": %.9g, \"seed\": %llu, "
      "\"repeat\": %d, \"seconds\": %.9g, \"flops\": %.17g, \"gflops\": %.6g",
      impl_name(impl), options.device.c_str(), dtype_name(q.dtype), static_cast<long long>(batch),
      static_cast<long long>(seqlen_q), static_cast<long long>(seqlen_kv),
      static_cast<long long>(heads_q), static_cast<long long>(heads_kv),
      static_cast<long long>(head_dim), options.causal ? "true" : "false",
      static_cast<long long>(window[0]), static_cast<long long>(window[1]),
      static_cast<double>(scale), resolved_threads(options.threads),
      static_cast<double>(attention.softcap), modifier_names(attention).c_str(),
      static_cast<double>(attention.dropout_p), static_cast<unsigned long long>(options.seed),
      options.repeat, seconds, flops, gflops);
  if (backward) {
    const double backward_flops =
        attention_backward_flops(batch, heads_q, seqlen_q, seqlen_kv, head_dim, attention);
    const double backward_gflops =
        backward_seconds > 0.0 ? backward_flops / backward_seconds * 1e-9 : 0.0;
    std::printf(
        ", \"backward_seconds\": %.9g, \"backward_flops\": %.17g, \"backward_gflops\": %.6g",
        backward_seconds, backward_flops, backward_gflops);
  }
  std::printf("}\n");
  return kExitOk;
}

}  // namespace

Action add_run_command(CLI::App& app) {
  auto options = std::make_shared<RunOptions>();
  CLI::App* command =
      app.add_subcommand("run", "Attention on .npy files; prints one JSON line of timing");
  command->footer(
      "Inputs: q [batch, seqlen_q, heads_q, head_dim], k and v [batch, seqlen_kv, heads_kv, "
      "head_dim], all float32 or all float16 (float16 runs as f16). Outputs, float32: out "
      "[batch, seqlen_q, heads_q, head_dim], lse [batch, heads_q, seqlen_q]. With --dout (shaped "
      "as q) the backward runs after the forward, on the same inputs and --impl, and writes dq, "
      "dk and dv in the shapes of q, k and v (float32); the JSON line adds backward_seconds and "
      "backward_gflops (2.5x the forward's FLOPs). Score modifiers (docs/semantics.md): "
      "--softcap C caps each scaled score at C·tanh(s / C); --alibi SLOPES.npy (float32, "
      "[heads_q] or [batch, heads_q]) adds -slope·|i + seqlen_kv - seqlen_q - j|; --sinks "
      "SINKS.npy (float32 [heads_q]) adds each head's sink logit to the softmax's normalizer, and "
      "with the backward --dsinks OUT.npy writes its gradient; --bias BIAS.npy (float32 or "
      "float16, [seqlen_q, seqlen_kv] or [batch | 1, heads_q | 1, seqlen_q, seqlen_kv]) is added "
      "to the logits, and with the backward --dbias OUT.npy writes its gradient in its shape; "
      "--mask MASK.npy (numpy bool, the same shapes) keeps the keys that are true. --dropout P "
      "drops each probability with probability P and scales the rest by 1/(1 - P), the mask "
      "drawn from --seed N (the same seed, the same mask, forward and backward). Nothing is "
      "written unless the run succeeds."
      "\nExit codes: 0 success, 1 invalid input or file error, 2 bad command line.");
  command->add_option("--q", options->q_path, "Queries .npy")->required();
  command->add_option("--k", options->k_path, "Keys .npy")->required();
  command->add_option("--v", options->v_path, "Values .npy")->required();
  command->add_option("--out", options->out_path, "Output .npy (float32)")->required();
  command->add_option("--lse", options->lse_path, "Logsumexp output .npy (float32)");
  command->add_option("--dout", options->dout_path,
                      "Gradient of the output .npy, shaped as q: runs the backward too");
  command->add_option("--dq", options->dq_path, "Gradient of q output .npy (float32)");
  command->add_option("--dk", options->dk_path, "Gradient of k output .npy (float32)");
  command->add_option("--dv", options->dv_path, "Gradient of v output .npy (float32)");
  add_softcap_option(command, &options->softcap)->capture_default_str();
  command->add_option("--alibi", options->alibi_path,
                      "ALiBi slopes .npy, [heads_q] or [batch, heads_q]");
  command->add_option("--sinks", options->sinks_path, "Attention sink logits .npy, [heads_q]");
  command->add_option("--dsinks", options->dsinks_path,
                      "Gradient of the sinks output .npy (float32, [heads_q]); with --sinks and "
                      "the backward");
  command->add_option("--bias", options->bias_path,
                      "Additive bias .npy (float32/float16), [seqlen_q, seqlen_kv] or "
                      "[batch|1, heads_q|1, seqlen_q, seqlen_kv]");
  command->add_option("--mask", options->mask_path,
                      "Boolean mask .npy (numpy bool, true = keep), shaped as a bias");
  command->add_option("--dbias", options->dbias_path,
                      "Gradient of the bias output .npy (float32, the bias's shape); with --bias "
                      "and the backward");
  command->add_flag("--causal", options->causal, "Causal mask, aligned to the bottom-right corner");
  command->add_option("--dropout", options->dropout, "Attention dropout probability, in [0, 1)")
      ->capture_default_str()
      ->check([](const std::string& text) -> std::string {
        return parse_dropout(text) ? "" : "expected a number in [0, 1), got '" + text + "'";
      });
  command->add_option("--seed", options->seed, "Seed of the dropout mask (any 64-bit integer)")
      ->capture_default_str();
  add_window_option(command, &options->window);
  command->add_option("--scale", options->scale, "Softmax scale (default 1/sqrt(head_dim))")
      ->check([](const std::string& text) -> std::string {
        return parse_scale(text) ? "" : "expected a finite number > 0, got '" + text + "'";
      });
  command->add_option("--impl", options->impl, "flash, standard or reference")
      ->capture_default_str()
      ->check([](const std::string& text) -> std::string {
        return parse_impl(text) ? "" : "expected flash, standard or reference, got '" + text + "'";
      });
  command
      ->add_option("--device", options->device,
                   "cpu, or cuda: the current GPU (float16 inputs, --impl flash, no score "
                   "modifiers yet; timed with the copies left out)")
      ->capture_default_str()
      ->check(CLI::IsMember({"cpu", "cuda"}));
  add_threads_option(command, &options->threads)->capture_default_str();
  command->add_option("--repeat", options->repeat, "Timed runs after one warm-up (median)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  // After parsing, so that a partial set of backward flags is a command-line error (exit 2).
  command->callback([options] {
    const std::pair<const char*, const std::string*> flags[] = {{"--dout", &options->dout_path},
                                                                {"--dq", &options->dq_path},
                                                                {"--dk", &options->dk_path},
                                                                {"--dv", &options->dv_path}};
    std::string missing;
    int given = 0;
    for (const auto& [flag, path] : flags) {
      if (!path->empty()) {
        ++given;
      } else {
        missing += std::string(missing.empty() ? "" : ", ") + flag;
      }
    }
    if (given > 0 && given < 4) {
      throw CLI::ValidationError("--dout, --dq, --dk and --dv go together: missing " + missing);
    }
    if (!options->dsinks_path.empty() && (options->sinks_path.empty() || given == 0)) {
      throw CLI::ValidationError(
          "--dsinks: expected --sinks and the backward's --dout, --dq, --dk, --dv with it");
    }
    if (!options->dbias_path.empty() && (options->bias_path.empty() || given == 0)) {
      throw CLI::ValidationError(
          "--dbias: expected --bias and the backward's --dout, --dq, --dk, --dv with it");
    }
    if (options->device == "cuda") {
#ifndef FLASHATTN_WITH_CUDA
      throw CLI::ValidationError(
          "--device cuda: this flashattn was built without its CUDA backend (FLASHATTN_CUDA)");
#endif
      if (options->impl != "flash") {
        throw CLI::ValidationError("--device cuda: expected --impl flash, got --impl " +
                                   options->impl);
      }
    }
  });
  return [options] { return run_attention(*options); };
}

}  // namespace flashattn::cli
