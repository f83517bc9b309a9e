// The `flashattn` command-line tool, run as a subprocess in a fresh directory per test: results
// of `run` against the library's reference, its JSON line, every bad input (each must fail with
// one line on stderr and leave no file behind), `demo` on a small shape, and --help.

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli_test_support.hpp"
#include "flashattn/attention.hpp"
#include "flashattn/backward.hpp"
#include "flashattn/dtype.hpp"
#include "flashattn/introspect.hpp"
#include "npy.hpp"
#include "openblas_core.hpp"

namespace {

namespace fs = std::filesystem;
using flashattn::AttentionImpl;
using flashattn::AttentionOptions;
using flashattn::DType;
using flashattn::testing::Completed;
using flashattn::testing::parse_json_line;
using flashattn::testing::read_text;
using Shape = std::array<std::int64_t, 4>;

// One attention operand: values held in its dtype (f32 or f16), savable as .npy.
struct Operand {
  DType dtype = DType::f32;
  Shape shape{};
  std::vector<float> f32;
  std::vector<std::uint16_t> f16;

  std::int64_t numel() const { return shape[0] * shape[1] * shape[2] * shape[3]; }
  const void* data() const {
    return dtype == DType::f32 ? static_cast<const void*>(f32.data())
                               : static_cast<const void*>(f16.data());
  }
  flashattn::ConstTensorView view() const {
    return flashattn::contiguous_view(data(), dtype, shape);
  }
  float at(std::int64_t i) const { return load_f32(data(), dtype, i); }

  void save(const fs::path& path) const {
    if (dtype == DType::f32) {
      flashattn::npy::write_npy(path, f32.data(), shape);
      return;
    }
    std::ofstream file(path, std::ios::binary);
    file << flashattn::npy::make_header("<f2", shape);
    file.write(reinterpret_cast<const char*>(f16.data()),
               static_cast<std::streamsize>(f16.size() * sizeof(std::uint16_t)));
  }
};

Operand random_operand(DType dtype, Shape shape, std::mt19937_64& rng) {
  Operand operand{dtype, shape, {}, {}};
  std::normal_distribution<float> normal;
  for (std::int64_t i = 0; i < operand.numel(); ++i) {
    if (dtype == DType::f32) {
      operand.f32.push_back(normal(rng));
    } else {
      operand.f16.push_back(flashattn::f16_from_f32(normal(rng)));
    }
  }
  return operand;
}

struct Outputs {
  std::vector<float> out, lse;  // out widened to f32
};

Outputs compute(AttentionImpl impl, const Operand& q, const Operand& k, const Operand& v,
                const AttentionOptions& options) {
  Operand out{q.dtype, q.shape, {}, {}};
  out.f32.resize(q.dtype == DType::f32 ? q.numel() : 0);
  out.f16.resize(q.dtype == DType::f16 ? q.numel() : 0);
  Outputs outputs;
  outputs.lse.resize(static_cast<std::size_t>(q.shape[0] * q.shape[2] * q.shape[1]));
  const flashattn::TensorView out_view{const_cast<void*>(out.data()), out.dtype, out.shape,
                                       flashattn::contiguous_strides(out.shape)};
  flashattn::attention_forward(impl, q.view(), k.view(), v.view(), out_view, outputs.lse.data(),
                               options);
  for (std::int64_t i = 0; i < out.numel(); ++i) outputs.out.push_back(out.at(i));
  return outputs;
}

// Largest |value - reference| with where it happened; NaN counts as infinitely wrong and equal
// infinities (-inf lse of fully masked rows) as exact.
struct MaxError {
  double error = 0.0;
  std::size_t index = 0;
  double value = 0.0, reference = 0.0;
};

MaxError max_error(const std::vector<float>& values, const std::vector<float>& reference) {
  MaxError worst;
  if (values.size() != reference.size()) {
    worst.error = INFINITY;
    return worst;
  }
  for (std::size_t i = 0; i < values.size(); ++i) {
    double error = values[i] == reference[i] ? 0.0 : std::fabs(double{values[i]} - reference[i]);
    if (std::isnan(error)) error = INFINITY;
    if (error > worst.error) worst = {error, i, values[i], reference[i]};
  }
  return worst;
}

double max_abs(const std::vector<float>& values) {
  double largest = 0.0;
  for (const float value : values) {
    if (std::isfinite(value)) largest = std::max(largest, std::fabs(double{value}));
  }
  return largest;
}

// The tolerance rule of docs/design.md, "How correctness is checked": the tool's error against
// the fp64 reference may be at most
// 4x the standard path's error on the same inputs, plus a floor for when that error is ~0: one
// ulp of the input dtype at max|v| for out (each output is a convex combination of v rows), four
// fp32 ulps of max|lse| for lse (always fp32).
void expect_close_to_reference(const Outputs& tool, const Outputs& reference,
                               const Outputs& standard, const Operand& v, const std::string& what) {
  const double epsilon = v.dtype == DType::f32 ? 0x1p-23 : 0x1p-10;
  std::vector<float> v_values(static_cast<std::size_t>(v.numel()));
  for (std::int64_t i = 0; i < v.numel(); ++i) v_values[i] = v.at(i);

  const MaxError out_error = max_error(tool.out, reference.out);
  const double out_tolerance =
      4.0 * max_error(standard.out, reference.out).error + epsilon * max_abs(v_values);
  EXPECT_LE(out_error.error, out_tolerance)
      << what << ": out[" << out_error.index << "] = " << out_error.value << ", reference "
      << out_error.reference;

  if (tool.lse.empty()) return;
  const MaxError lse_error = max_error(tool.lse, reference.lse);
  const double lse_tolerance = 4.0 * max_error(standard.lse, reference.lse).error +
                               4.0 * 0x1p-23 * std::max(1.0, max_abs(reference.lse));
  EXPECT_LE(lse_error.error, lse_tolerance)
      << what << ": lse[" << lse_error.index << "] = " << lse_error.value << ", reference "
      << lse_error.reference;
}

class CliTest : public flashattn::testing::CliFixture {
 protected:
  CliTest() : CliFixture("flashattn_cli") {}

  // Saves q, k, v as q.npy, k.npy, v.npy.
  void save_inputs(const Operand& q, const Operand& k, const Operand& v) const {
    q.save(path("q.npy"));
    k.save(path("k.npy"));
    v.save(path("v.npy"));
  }

  std::vector<std::string> run_args(const std::string& out = "out.npy") const {
    return {"run", "--q",         path("q.npy"), "--k",    path("k.npy"),
            "--v", path("v.npy"), "--out",       path(out)};
  }
};

TEST_F(CliTest, RunFlashMatchesReferenceAndPrintsOneJsonLine) {
  // GQA, seqlen_q != seqlen_kv, no mask: shapes that do not divide any tile size.
  std::mt19937_64 rng(1);
  const Operand q = random_operand(DType::f32, {2, 37, 4, 24}, rng);
  const Operand k = random_operand(DType::f32, {2, 53, 2, 24}, rng);
  const Operand v = random_operand(DType::f32, {2, 53, 2, 24}, rng);
  save_inputs(q, k, v);

  std::vector<std::string> args = run_args();
  args.insert(args.end(), {"--lse", path("lse.npy"), "--threads", "2", "--repeat", "2"});
  const Completed completed = run(args);
  ASSERT_EQ(completed.exit_code, 0) << completed.err;
  EXPECT_EQ(completed.err, "");

  ASSERT_FALSE(completed.out.empty());
  EXPECT_EQ(completed.out.back(), '\n');
  EXPECT_EQ(std::count(completed.out.begin(), completed.out.end(), '\n'), 1) << completed.out;
  const auto json = parse_json_line(completed.out.substr(0, completed.out.size() - 1));
  EXPECT_EQ(json.at("impl"), "flash");
  EXPECT_EQ(json.at("dtype"), "f32");
  EXPECT_EQ(json.at("batch"), "2");
  EXPECT_EQ(json.at("seqlen_q"), "37");
  EXPECT_EQ(json.at("seqlen_kv"), "53");
  EXPECT_EQ(json.at("heads_q"), "4");
  EXPECT_EQ(json.at("heads_kv"), "2");
  EXPECT_EQ(json.at("head_dim"), "24");
  EXPECT_EQ(json.at("causal"), "false");
  EXPECT_EQ(json.at("window"), "[-1, -1]");
  EXPECT_EQ(json.at("threads"), "2");
  EXPECT_EQ(json.at("repeat"), "2");
  EXPECT_NEAR(std::stod(json.at("scale")), 1.0 / std::sqrt(24.0), 1e-7);
  const double seconds = std::stod(json.at("seconds"));
  EXPECT_TRUE(std::isfinite(seconds) && seconds > 0.0) << seconds;
  EXPECT_DOUBLE_EQ(std::stod(json.at("flops")),
                   flashattn::attention_flops(2, 4, 37, 53, 24, AttentionOptions{}));
  EXPECT_GT(std::stod(json.at("gflops")), 0.0);

  const flashattn::npy::Array out = flashattn::npy::read_npy(path("out.npy"));
  const flashattn::npy::Array lse = flashattn::npy::read_npy(path("lse.npy"));
  EXPECT_EQ(out.dtype, DType::f32);
  EXPECT_EQ(out.shape, (std::vector<std::int64_t>{2, 37, 4, 24}));
  EXPECT_EQ(lse.shape, (std::vector<std::int64_t>{2, 4, 37}));
  const AttentionOptions options;
  expect_close_to_reference({out.f32, lse.f32}, compute(AttentionImpl::reference, q, k, v, options),
                            compute(AttentionImpl::standard, q, k, v, options), v,
                            "flash, no mask");
  EXPECT_EQ(entries(), (std::vector<std::string>{"k.npy", "lse.npy", "out.npy", "q.npy", "v.npy"}));
}

class CliImplTest : public CliTest, public ::testing::WithParamInterface<const char*> {};

TEST_P(CliImplTest, CausalWindowAndScaleMatchReference) {
  // seqlen_q < seqlen_kv: the bottom-right causal alignment matters; the window cuts the left.
  std::mt19937_64 rng(2);
  const Operand q = random_operand(DType::f32, {1, 29, 3, 16}, rng);
  const Operand k = random_operand(DType::f32, {1, 41, 3, 16}, rng);
  const Operand v = random_operand(DType::f32, {1, 41, 3, 16}, rng);
  save_inputs(q, k, v);

  std::vector<std::string> args = run_args();
  args.insert(args.end(), {"--lse", path("lse.npy"), "--causal", "--window", "8,0", "--scale",
                           "0.3", "--impl", GetParam(), "--repeat", "1"});
  const Completed completed = run(args);
  ASSERT_EQ(completed.exit_code, 0) << completed.err;
  const auto json = parse_json_line(completed.out.substr(0, completed.out.find('\n')));
  EXPECT_EQ(json.at("impl"), GetParam());
  EXPECT_EQ(json.at("causal"), "true");
  EXPECT_EQ(json.at("window"), "[8, 0]");
  EXPECT_NEAR(std::stod(json.at("scale")), 0.3, 1e-7);

  AttentionOptions options;
  options.causal = true;
  options.window_left = 8;
  options.window_right = 0;
  options.softmax_scale = 0.3f;
  expect_close_to_reference({flashattn::npy::read_npy(path("out.npy")).f32,
                             flashattn::npy::read_npy(path("lse.npy")).f32},
                            compute(AttentionImpl::reference, q, k, v, options),
                            compute(AttentionImpl::standard, q, k, v, options), v,
                            std::string(GetParam()) + ", causal, window 8,0");
}

INSTANTIATE_TEST_SUITE_P(EveryImpl, CliImplTest,
                         ::testing::Values("flash", "standard", "reference"),
                         [](const auto& info) { return std::string(info.param); });

TEST_F(CliTest, RunFloat16InputsRunAsF16AndWriteFloat32) {
  std::mt19937_64 rng(3);
  const Operand q = random_operand(DType::f16, {2, 19, 2, 40}, rng);
  const Operand k = random_operand(DType::f16, {2, 19, 2, 40}, rng);
  const Operand v = random_operand(DType::f16, {2, 19, 2, 40}, rng);
  save_inputs(q, k, v);

  std::vector<std::string> args = run_args();
  args.insert(args.end(), {"--lse", path("lse.npy"), "--causal", "--repeat", "1"});
  const Completed completed = run(args);
  ASSERT_EQ(completed.exit_code, 0) << completed.err;
  EXPECT_EQ(parse_json_line(completed.out.substr(0, completed.out.find('\n'))).at("dtype"), "f16");

  const flashattn::npy::Array out = flashattn::npy::read_npy(path("out.npy"));
  EXPECT_EQ(out.dtype, DType::f32);
  // The library computed in f16: every output value is exactly representable in binary16.
  for (const float value : out.f32) {
    EXPECT_EQ(flashattn::f32_from_f16(flashattn::f16_from_f32(value)), value);
  }
  AttentionOptions options;
  options.causal = true;
  expect_close_to_reference({out.f32, flashattn::npy::read_npy(path("lse.npy")).f32},
                            compute(AttentionImpl::reference, q, k, v, options),
                            compute(AttentionImpl::standard, q, k, v, options), v, "flash, f16");
}

// --device cuda, forward and backward: on a GPU, out within the f16 bound of tests/cuda (P
// rounded to f16 as the operand of P·V: u·max|v|; out rounded: u·|out|; u = 2^-11) and each
// gradient within 8 u of the reference norm-wise (tests/cuda holds them element by element);
// without a GPU, or in a build without the CUDA backend, one error line naming --device cuda and
// no file.
TEST_F(CliTest, RunOnCudaComputesThereOrFailsCleanly) {
  std::mt19937_64 rng(6);
  const Operand q = random_operand(DType::f16, {1, 70, 2, 64}, rng);
  const Operand k = random_operand(DType::f16, {1, 70, 2, 64}, rng);
  const Operand v = random_operand(DType::f16, {1, 70, 2, 64}, rng);
  const Operand dout = random_operand(DType::f16, {1, 70, 2, 64}, rng);
  save_inputs(q, k, v);
  dout.save(path("dout.npy"));
  std::vector<std::string> args = run_args();
  args.insert(args.end(),
              {"--lse", path("lse.npy"), "--causal", "--device", "cuda", "--dout", path("dout.npy"),
               "--dq", path("dq.npy"), "--dk", path("dk.npy"), "--dv", path("dv.npy")});
  const Completed completed = run(args);
  if (completed.exit_code != 0) {
    EXPECT_TRUE(completed.exit_code == 1 || completed.exit_code == 2) << completed.exit_code;
    EXPECT_NE(completed.err.find("--device cuda"), std::string::npos) << completed.err;
    EXPECT_EQ(entries(), (std::vector<std::string>{"dout.npy", "k.npy", "q.npy", "v.npy"}));
    return;
  }
  EXPECT_EQ(parse_json_line(completed.out.substr(0, completed.out.find('\n'))).at("device"),
            "cuda");
  AttentionOptions options;
  options.causal = true;
  const Outputs reference = compute(AttentionImpl::reference, q, k, v, options);
  const std::vector<float> out = flashattn::npy::read_npy(path("out.npy")).f32;
  std::vector<float> v_values;
  for (std::int64_t i = 0; i < v.numel(); ++i) v_values.push_back(v.at(i));
  const double u = std::ldexp(1.0, -11), max_v = max_abs(v_values);
  ASSERT_EQ(out.size(), reference.out.size());
  for (std::size_t i = 0; i < out.size(); ++i) {
    ASSERT_NEAR(out[i], reference.out[i], u * (max_v + std::fabs(reference.out[i])) + 1e-5)
        << "element " << i;
  }

  Operand ref_out{DType::f16, q.shape, {}, std::vector<std::uint16_t>(out.size())};
  for (std::size_t i = 0; i < out.size(); ++i) {
    ref_out.f16[i] = flashattn::f16_from_f32(reference.out[i]);
  }
  std::vector<std::uint16_t> ref_grads[3];
  for (auto& g : ref_grads) g.resize(static_cast<std::size_t>(q.numel()));
  auto f16_view = [&](std::vector<std::uint16_t>& data) {
    return flashattn::TensorView{data.data(), DType::f16, q.shape,
                                 flashattn::contiguous_strides(q.shape)};
  };
  flashattn::reference_attention_backward(dout.view(), q.view(), k.view(), v.view(), ref_out.view(),
                                          reference.lse.data(), f16_view(ref_grads[0]),
                                          f16_view(ref_grads[1]), f16_view(ref_grads[2]), options);
  const char* names[3] = {"dq.npy", "dk.npy", "dv.npy"};
  for (int g = 0; g < 3; ++g) {
    const std::vector<float> got = flashattn::npy::read_npy(path(names[g])).f32;
    double error = 0, norm = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      const double expected = flashattn::f32_from_f16(ref_grads[g][i]);
      error += (got[i] - expected) * (got[i] - expected);
      norm += expected * expected;
    }
    EXPECT_LE(std::sqrt(error / norm), 8 * u) << names[g];
  }
}

TEST_F(CliTest, RunWithoutLseWritesOnlyOut) {
  std::mt19937_64 rng(4);
  const Operand q = random_operand(DType::f32, {1, 5, 1, 8}, rng);
  save_inputs(q, q, q);
  const Completed completed = run(run_args());
  ASSERT_EQ(completed.exit_code, 0) << completed.err;
  EXPECT_EQ(entries(), (std::vector<std::string>{"k.npy", "out.npy", "q.npy", "v.npy"}));
}

// Bad inputs: each must exit non-zero with exactly one line "flashattn: error: ..." on stderr,
// nothing on stdout, and leave the work directory as it was (no output, no temporary file).
class CliErrorTest : public CliTest {
 protected:
  // Valid f32 inputs: q [2, 7, 4, 8], k and v [2, 9, 2, 8].
  void save_valid_inputs() const {
    std::mt19937_64 rng(5);
    save_inputs(random_operand(DType::f32, {2, 7, 4, 8}, rng),
                random_operand(DType::f32, {2, 9, 2, 8}, rng),
                random_operand(DType::f32, {2, 9, 2, 8}, rng));
  }

  // A file `name` holding `header` followed by `data_bytes` zero bytes.
  void save_raw(const std::string& name, const std::string& header, std::size_t data_bytes) const {
    std::ofstream file(path(name), std::ios::binary);
    file << header << std::string(data_bytes, '\0');
  }

  void expect_clean_failure(const std::vector<std::string>& args,
                            const std::string& message) const {
    const std::vector<std::string> before = entries();
    const Completed completed = run(args);
    std::string command;
    for (const std::string& arg : args) command += " " + arg;
    EXPECT_GT(completed.exit_code, 0) << command;
    flashattn::testing::expect_one_error_line(completed, command, message);
    EXPECT_EQ(entries(), before) << command;
  }

  std::vector<std::string> with(std::vector<std::string> args,
                                const std::vector<std::string>& extra) const {
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  }
};

TEST_F(CliErrorTest, MissingInputFile) {
  save_valid_inputs();
  fs::remove(path("k.npy"));
  expect_clean_failure(run_args(), path("k.npy") + ": cannot open: No such file or directory");
}

TEST_F(CliErrorTest, TruncatedHeader) {
  save_valid_inputs();
  const std::string whole = read_text(path("q.npy"));
  std::ofstream(path("q.npy"), std::ios::binary) << whole.substr(0, 40);
  expect_clean_failure(run_args(), "truncated header");
}

TEST_F(CliErrorTest, MalformedHeader) {
  save_valid_inputs();
  std::string header = flashattn::npy::make_header("<f4", std::vector<std::int64_t>{2, 7, 4, 8});
  header[header.find('}')] = ' ';
  save_raw("q.npy", header, 2 * 7 * 4 * 8 * 4);
  expect_clean_failure(run_args(), "malformed header");
}

TEST_F(CliErrorTest, UnsupportedDtypesAndLayouts) {
  save_valid_inputs();
  const std::vector<std::int64_t> shape = {2, 7, 4, 8};
  save_raw("q.npy", flashattn::npy::make_header("<f8", shape), 2 * 7 * 4 * 8 * 8);
  expect_clean_failure(run_args(),
                       "unsupported dtype '<f8' (float64): accepted dtypes are float32");
  save_raw("q.npy", flashattn::npy::make_header("<i4", shape), 2 * 7 * 4 * 8 * 4);
  expect_clean_failure(run_args(), "unsupported dtype '<i4' (int32)");
  save_raw("q.npy", flashattn::npy::make_header(">f4", shape), 2 * 7 * 4 * 8 * 4);
  expect_clean_failure(run_args(), "big-endian");
  save_raw("q.npy", flashattn::npy::make_header("<f4", shape, true), 2 * 7 * 4 * 8 * 4);
  expect_clean_failure(run_args(), "fortran_order True is not supported");
  save_raw("q.npy", flashattn::npy::make_header("<f4", shape), 2 * 7 * 4 * 8 * 4 - 4);
  expect_clean_failure(run_args(), "truncated data");
}

TEST_F(CliErrorTest, UnwritableOutputFailsBeforeAnyWork) {
  save_valid_inputs();
  expect_clean_failure(run_args("missing_dir/out.npy"),
                       path("missing_dir/out.npy") + ": cannot write: No such file or directory");
  expect_clean_failure(with(run_args(), {"--lse", path("missing_dir/lse.npy")}),
                       path("missing_dir/lse.npy") + ": cannot write");
  expect_clean_failure(with(run_args(), {"--lse", path("out.npy")}), "--lse");
  // The outputs are opened before the inputs are read: a bad output path wins over a bad input.
  fs::remove(path("q.npy"));
  expect_clean_failure(run_args("missing_dir/out.npy"), path("missing_dir/out.npy"));
  fs::create_directory(path("a_directory"));
  expect_clean_failure(run_args("a_directory"), "is a directory");
}

TEST_F(CliErrorTest, ShapesThatDoNotFit) {
  std::mt19937_64 rng(6);
  const Operand q = random_operand(DType::f32, {2, 7, 4, 8}, rng);
  const Operand kv = random_operand(DType::f32, {2, 9, 2, 8}, rng);

  save_inputs(q, random_operand(DType::f32, {3, 9, 2, 8}, rng), kv);
  expect_clean_failure(run_args(), "k: expected batch 2 (as q), got 3");
  save_inputs(q, random_operand(DType::f32, {2, 9, 2, 16}, rng), kv);
  expect_clean_failure(run_args(), "k: expected head_dim 8 (as q), got 16");
  save_inputs(q, kv, random_operand(DType::f32, {2, 10, 2, 8}, rng));
  expect_clean_failure(run_args(), "v: expected shape");
  save_inputs(q, random_operand(DType::f32, {2, 9, 3, 8}, rng),
              random_operand(DType::f32, {2, 9, 3, 8}, rng));
  expect_clean_failure(run_args(), "heads_kv");
  save_inputs(q, kv, kv);
  flashattn::npy::write_npy(path("q.npy"), q.f32.data(), std::vector<std::int64_t>{2, 7, 32});
  expect_clean_failure(run_args(), "q: expected a rank-4 array");
  save_inputs(random_operand(DType::f16, {2, 7, 4, 8}, rng), kv, kv);
  expect_clean_failure(run_args(), "dtype");
}

TEST_F(CliErrorTest, BadOptionValues) {
  save_valid_inputs();
  for (const char* window : {"3", "a,b", "1,2,3", "-2,0", "0,-5", ",", "1.5,2"}) {
    expect_clean_failure(with(run_args(), {"--window", window}), "--window");
  }
  for (const char* scale : {"0", "-1", "nan", "inf", "abc", ""}) {
    expect_clean_failure(with(run_args(), {"--scale", scale}), "--scale");
  }
  expect_clean_failure(with(run_args(), {"--impl", "fast"}),
                       "--impl: expected flash, standard or reference, got 'fast'");
  expect_clean_failure(with(run_args(), {"--repeat", "0"}), "--repeat");
  expect_clean_failure(with(run_args(), {"--threads", "-3"}), "--threads");
  expect_clean_failure(with(run_args(), {"--threads", "1025"}), "--threads");
  expect_clean_failure({"run", "--q", path("q.npy"), "--k", path("k.npy"), "--v", path("v.npy")},
                       "--out is required");
  expect_clean_failure({}, "subcommand");
  expect_clean_failure({"frobnicate"}, "frobnicate");
}

TEST_F(CliTest, DemoOnSmallShapesAgrees) {
  const Completed f32 =
      run({"demo", "--seqlen", "64", "--heads", "2", "--head-dim", "32", "--repeat", "1"});
  EXPECT_EQ(f32.exit_code, 0) << f32.out << f32.err;
  EXPECT_NE(f32.out.find("\nagree: yes"), std::string::npos) << f32.out;
  EXPECT_NE(
      f32.out.find("batch 2, heads 2 (kv heads 2), seqlen 64 (kv 64), head_dim 32, causal, f32"),
      std::string::npos)
      << f32.out;

  const Completed f16 =
      run({"demo", "--seqlen", "33", "--seqlen-kv", "47", "--heads", "4", "--kv-heads", "2",
           "--head-dim", "40", "--no-causal", "--dtype", "f16", "--repeat", "1"});
  EXPECT_EQ(f16.exit_code, 0) << f16.out << f16.err;
  EXPECT_NE(f16.out.find("\nagree: yes"), std::string::npos) << f16.out;
  EXPECT_NE(f16.out.find("no mask, f16"), std::string::npos) << f16.out;

  // Sliding windows, both sides (a reference row against the keys up to its diagonal only put
  // both paths ~1 off the reference and let them "agree"; the standard path's own bound now
  // catches that).
  for (const std::vector<std::string>& mask :
       {std::vector<std::string>{"--no-causal", "--window", "64,64"},
        std::vector<std::string>{"--window", "16,8"}}) {
    std::vector<std::string> args = {
        "demo",       "--seqlen", "300",      "--seqlen-kv", "280",          "--heads", "2",
        "--head-dim", "40",       "--repeat", "1",           "--check-rows", "300"};
    args.insert(args.end(), mask.begin(), mask.end());
    const Completed windowed = run(args);
    EXPECT_EQ(windowed.exit_code, 0) << windowed.out << windowed.err;
    EXPECT_NE(windowed.out.find(mask.size() == 3 ? "head_dim 40, window (64, 64), f32"
                                                 : "head_dim 40, causal, window (16, 8), f32"),
              std::string::npos)
        << windowed.out;
    EXPECT_NE(windowed.out.find("(within its worst-case bound"), std::string::npos) << windowed.out;
    EXPECT_NE(windowed.out.find("\nagree: yes"), std::string::npos) << windowed.out;
  }

  // Decoding: one query position against a cache; K and V each hold 2·300·2·64 bf16 (150 KiB).
  const Completed decode =
      run({"demo", "--seqlen", "1", "--seqlen-kv", "300", "--heads", "8", "--kv-heads", "2",
           "--head-dim", "64", "--dtype", "bf16", "--repeat", "1"});
  EXPECT_EQ(decode.exit_code, 0) << decode.out << decode.err;
  EXPECT_NE(decode.out.find("\nagree: yes"), std::string::npos) << decode.out;
  EXPECT_NE(decode.out.find("K+V GB/s: bytes of k and v (300.00 KiB) / time"), std::string::npos)
      << decode.out;
}

// OPENBLAS_CORETYPE set for this process and the children it starts, restored on leaving.
class ScopedCoretype {
 public:
  explicit ScopedCoretype(const char* value) {
    if (const char* old = std::getenv("OPENBLAS_CORETYPE")) old_ = old;
    ::setenv("OPENBLAS_CORETYPE", value, 1);
  }
  ~ScopedCoretype() {
    if (old_) {
      ::setenv("OPENBLAS_CORETYPE", old_->c_str(), 1);
    } else {
      ::unsetenv("OPENBLAS_CORETYPE");
    }
  }
  ScopedCoretype(const ScopedCoretype&) = delete;
  ScopedCoretype& operator=(const ScopedCoretype&) = delete;

 private:
  std::optional<std::string> old_;
};

// demo times the standard path, whose products are OpenBLAS's sgemm: on an SSE-only kernel it
// warns, naming the setting that fits the CPU, and on a kernel that fits it stays silent.
// OPENBLAS_CORETYPE forces both cases on any CPU with AVX2.
TEST_F(CliTest, DemoWarnsWhereOpenblasRunsAnSseKernel) {
  if (flashattn::bench::openblas_core() == flashattn::bench::kOpenblasNotLinked) {
    GTEST_SKIP() << "this build links the plain-loop sgemm, not OpenBLAS";
  }
  if (!__builtin_cpu_supports("avx2")) GTEST_SKIP() << "an SSE kernel is this CPU's own";
  const std::vector<std::string> args = {"demo",       "--seqlen", "32",       "--heads", "2",
                                         "--head-dim", "32",       "--repeat", "1"};
  const char* fitting = __builtin_cpu_supports("avx512f") ? "SkylakeX" : "Haswell";
  {
    const ScopedCoretype prescott("Prescott");
    const Completed slow = run(args);
    EXPECT_EQ(slow.exit_code, 0) << slow.out << slow.err;
    EXPECT_NE(slow.out.find("\nwarning  OpenBLAS runs its Prescott kernel"), std::string::npos)
        << slow.out;
    EXPECT_NE(slow.out.find("OPENBLAS_CORETYPE=Prescott pins that kernel"), std::string::npos)
        << slow.out;
    EXPECT_NE(slow.out.find(std::string("OPENBLAS_CORETYPE=") + fitting), std::string::npos)
        << slow.out;
  }
  {
    const ScopedCoretype fits(fitting);
    const Completed fast = run(args);
    EXPECT_EQ(fast.exit_code, 0) << fast.out << fast.err;
    EXPECT_NE(fast.out.find("\nagree: yes"), std::string::npos) << fast.out;
    EXPECT_EQ(fast.out.find("warning"), std::string::npos) << fast.out;
  }
}

TEST_F(CliTest, DemoRejectsBadArguments) {
  const Completed gqa = run({"demo", "--seqlen", "8", "--heads", "3", "--kv-heads", "2"});
  EXPECT_EQ(gqa.exit_code, 1);
  EXPECT_NE(gqa.err.find("flashattn: error: "), std::string::npos) << gqa.err;
  EXPECT_NE(gqa.err.find("heads_kv"), std::string::npos) << gqa.err;

  const Completed dtype = run({"demo", "--dtype", "f64"});
  EXPECT_EQ(dtype.exit_code, 2);
  EXPECT_EQ(dtype.err.rfind("flashattn: error: --dtype", 0), 0u) << dtype.err;

  const Completed window = run({"demo", "--window", "3"});
  EXPECT_EQ(window.exit_code, 2);
  EXPECT_EQ(window.err.rfind("flashattn: error: --window", 0), 0u) << window.err;

  const Completed threads = run({"demo", "--threads", "1025"});
  EXPECT_EQ(threads.exit_code, 2);
  EXPECT_EQ(threads.err.rfind("flashattn: error: --threads", 0), 0u) << threads.err;

  // Inputs beyond the machine's memory: refused before any allocation, naming the options.
  const Completed huge = run({"demo", "--batch", "1048576", "--heads", "1048576"});
  EXPECT_EQ(huge.exit_code, 1);
  EXPECT_NE(huge.err.find("flashattn: error: demo: --batch, --heads, --kv-heads, --seqlen, "
                          "--seqlen-kv, --head-dim: expected a problem whose q, k, v and two "
                          "outputs fit in the "),
            std::string::npos)
      << huge.err;
  EXPECT_EQ(huge.out.find("path "), std::string::npos) << huge.out;
}

// Where the standard path's score matrix cannot fit in memory (the library refuses it), the demo
// runs flash alone and holds it to the worst-case fp32 bound. Sq rows against 4096 keys at
// head_dim 1 on one thread: the standard path needs ~Sq x 16 KiB, here 1.25x the machine's
// memory; causal, so that only the last 4096 query rows see any key and flash takes well under
// a second.
TEST_F(CliTest, DemoRunsFlashAloneWhereTheStandardPathCannotFit) {
  const std::int64_t seqlen_q = flashattn::memory_limit_bytes() / (16 << 10) / 4 * 5;
  if (seqlen_q > (std::int64_t{1} << 24)) GTEST_SKIP() << "more memory than a test should fill";
  const Completed alone =
      run({"demo", "--batch", "1", "--heads", "1", "--seqlen", std::to_string(seqlen_q),
           "--seqlen-kv", "4096", "--head-dim", "1", "--threads", "1", "--repeat", "1"});
  EXPECT_EQ(alone.exit_code, 0) << alone.out << alone.err;
  EXPECT_NE(alone.out.find("\nstandard   skipped: its score matrices need "), std::string::npos)
      << alone.out;
  EXPECT_NE(alone.out.find("\n  standard  skipped\n"), std::string::npos) << alone.out;
  EXPECT_NE(alone.out.find("\nflash within the bound: yes"), std::string::npos) << alone.out;
  EXPECT_EQ(alone.out.find("flash vs standard"), std::string::npos) << alone.out;
}

TEST_F(CliTest, HelpAndVersion) {
  for (const auto& [args, usage] :
       {std::pair{std::vector<std::string>{"--help"}, "Usage: "},
        std::pair{std::vector<std::string>{"demo", "--help"}, "demo [OPTIONS]"},
        std::pair{std::vector<std::string>{"run", "--help"}, "run [OPTIONS]"}}) {
    const Completed completed = run(args);
    EXPECT_EQ(completed.exit_code, 0) << args.front();
    EXPECT_NE(completed.out.find(usage), std::string::npos) << completed.out;
    EXPECT_NE(completed.out.find("--"), std::string::npos);
  }
  const Completed version = run({"--version"});
  EXPECT_EQ(version.exit_code, 0);
  EXPECT_EQ(version.out.rfind("flashattn ", 0), 0u) << version.out;
  EXPECT_EQ(entries(), std::vector<std::string>{});
}

}  // namespace
