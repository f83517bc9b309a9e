// `flashattn run --dout dO.npy --dq dQ.npy --dk dK.npy --dv dV.npy`, run as a subprocess in a
// fresh directory per test: the gradients against reference_attention_backward on the same
// inputs, the JSON line's backward fields, and the bad inputs (each must fail with one line on
// stderr and leave no file behind).

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "cli_test_support.hpp"
#include "flashattn/flashattn.hpp"
#include "npy.hpp"
#include "test_support.hpp"

namespace flashattn::testing {
namespace {

namespace fs = std::filesystem;
using Shape = std::array<std::int64_t, 4>;

// Writes a contiguous f32 or f16 tensor as .npy in its own dtype.
void save(const Tensor& tensor, const fs::path& path) {
  const Shape& shape = tensor.view.shape;
  if (tensor.view.dtype == DType::f32) {
    npy::write_npy(path, reinterpret_cast<const float*>(tensor.bytes.data()), shape);
    return;
  }
  std::ofstream file(path, std::ios::binary);
  file << npy::make_header("<f2", shape);
  file.write(reinterpret_cast<const char*>(tensor.bytes.data()),
             static_cast<std::streamsize>(tensor.view.numel() * 2));
}

// A tensor's values widened to double, in C order.
std::vector<double> values_of(const Tensor& tensor) {
  std::vector<double> values;
  tensor.for_each_index(
      [&](auto a, auto b, auto c, auto d) { values.push_back(tensor.at(a, b, c, d)); });
  return values;
}

double max_abs(const std::vector<double>& values) {
  double largest = 0;
  for (const double value : values) largest = std::max(largest, std::abs(value));
  return largest;
}

// Largest |got - want|, NaN counting as infinitely wrong; where it happened.
struct MaxError {
  double error = 0;
  std::size_t index = 0;
};

MaxError max_error(const std::vector<double>& got, const std::vector<double>& want) {
  if (got.size() != want.size()) return {INFINITY, 0};
  MaxError worst;
  for (std::size_t i = 0; i < got.size(); ++i) {
    double error = std::abs(got[i] - want[i]);
    if (std::isnan(error)) error = INFINITY;
    if (error > worst.error) worst = {error, i};
  }
  return worst;
}

// Inputs and dO in one dtype, with the forward's out and lse (by the reference).
struct Problem {
  AttentionOptions options;
  Tensor q, k, v, dout, out;
  std::vector<float> lse;

  Problem(DType dtype, Shape q_shape, Shape kv_shape, const AttentionOptions& options_,
          std::uint64_t seed)
      : options(options_),
        q(dtype, q_shape),
        k(dtype, kv_shape),
        v(dtype, kv_shape),
        dout(dtype, q_shape),
        out(dtype, q_shape),
        lse(static_cast<std::size_t>(q_shape[0] * q_shape[2] * q_shape[1])) {
    std::mt19937_64 rng(seed);
    q.fill_normal(rng);
    k.fill_normal(rng);
    v.fill_normal(rng);
    dout.fill_normal(rng);
    reference_attention_forward(q.view, k.view, v.view, out.view, lse.data(), options);
  }

  struct Gradients {
    std::vector<double> dq, dk, dv;
  };
  Gradients gradients(AttentionImpl impl) const {
    Tensor dq(q.view.dtype, q.view.shape), dk(k.view.dtype, k.view.shape),
        dv(k.view.dtype, k.view.shape);
    attention_backward(impl, dout.view, q.view, k.view, v.view, out.view, lse.data(), dq.view,
                       dk.view, dv.view, options);
    return {values_of(dq), values_of(dk), values_of(dv)};
  }
};

// The rule of docs/design.md, "How correctness is checked": the tool's error against the
// reference may be 4x the standard
// backward's error on the same inputs in the same precision, plus a floor for when that error
// is ~0: four roundings of the dtype at G = max|reference gradient| + max|dO|·max|v|, the size
// of the products each gradient sums (the floor covers the reference's own rounding into the
// dtype and the tool's, each at most half an ulp, twice over). (Measured: the largest error is
// below 0.15x this tolerance for every impl and dtype.)
void expect_close(const std::vector<double>& got, const std::vector<double>& reference,
                  const std::vector<double>& standard, const Problem& p, const char* name) {
  const double unit = unit_roundoff(p.q.view.dtype);
  const double scale = max_abs(reference) + max_abs(values_of(p.dout)) * max_abs(values_of(p.v));
  const double tolerance = 4 * max_error(standard, reference).error + 4 * unit * scale;
  const MaxError error = max_error(got, reference);
  EXPECT_LE(error.error, tolerance) << name << "[" << error.index << "] = " << got[error.index]
                                    << ", reference " << reference[error.index];
}

class CliBackwardTest : public CliFixture {
 protected:
  CliBackwardTest() : CliFixture("flashattn_cli_backward") {}

  void save_inputs(const Problem& p) const {
    save(p.q, path("q.npy"));
    save(p.k, path("k.npy"));
    save(p.v, path("v.npy"));
    save(p.dout, path("do.npy"));
  }

  // `run` with the forward inputs and every backward flag; `drop` leaves one flag out.
  std::vector<std::string> args(const std::string& drop = "") const {
    const std::vector<std::pair<std::string, std::string>> flags = {
        {"--q", "q.npy"},     {"--k", "k.npy"},   {"--v", "v.npy"},   {"--out", "out.npy"},
        {"--dout", "do.npy"}, {"--dq", "dq.npy"}, {"--dk", "dk.npy"}, {"--dv", "dv.npy"}};
    std::vector<std::string> all = {"run"};
    for (const auto& [flag, file] : flags) {
      if (flag == drop) continue;
      all.push_back(flag);
      all.push_back(path(file));
    }
    return all;
  }
};

class CliBackwardImplTest : public CliBackwardTest,
                            public ::testing::WithParamInterface<const char*> {};

TEST_P(CliBackwardImplTest, GradientsMatchReferenceAndJsonHasBackwardFields) {
  // GQA, seqlen_q < seqlen_kv with a bottom-right causal mask and a window, custom scale, on
  // shapes that do not divide any tile size.
  AttentionOptions options;
  options.causal = true;
  options.window_left = 9;
  options.softmax_scale = 0.3f;
  const Problem p(DType::f32, {2, 13, 4, 24}, {2, 21, 2, 24}, options, 1);
  save_inputs(p);

  std::vector<std::string> command = args();
  command.insert(command.end(), {"--causal", "--window", "9,-1", "--scale", "0.3", "--impl",
                                 GetParam(), "--threads", "2", "--repeat", "3"});
  const Completed completed = run(command);
  ASSERT_EQ(completed.exit_code, 0) << completed.err;
  EXPECT_EQ(completed.err, "");
  ASSERT_FALSE(completed.out.empty());
  EXPECT_EQ(std::count(completed.out.begin(), completed.out.end(), '\n'), 1) << completed.out;

  const auto json = parse_json_line(completed.out.substr(0, completed.out.size() - 1));
  EXPECT_EQ(json.at("impl"), GetParam());
  EXPECT_EQ(json.at("repeat"), "3");
  const double seconds = std::stod(json.at("seconds"));
  EXPECT_TRUE(std::isfinite(seconds) && seconds > 0) << seconds;
  const double backward_seconds = std::stod(json.at("backward_seconds"));
  EXPECT_TRUE(std::isfinite(backward_seconds) && backward_seconds > 0) << backward_seconds;
  const double backward_flops = std::stod(json.at("backward_flops"));
  EXPECT_DOUBLE_EQ(backward_flops, attention_backward_flops(2, 4, 13, 21, 24, options));
  EXPECT_DOUBLE_EQ(backward_flops, 2.5 * std::stod(json.at("flops")));
  // backward_gflops is printed with 6 significant digits.
  EXPECT_NEAR(std::stod(json.at("backward_gflops")), backward_flops / backward_seconds * 1e-9,
              1e-5 * backward_flops / backward_seconds * 1e-9);

  EXPECT_EQ(entries(), (std::vector<std::string>{"dk.npy", "do.npy", "dq.npy", "dv.npy", "k.npy",
                                                 "out.npy", "q.npy", "v.npy"}));
  const npy::Array dq = npy::read_npy(path("dq.npy")), dk = npy::read_npy(path("dk.npy")),
                   dv = npy::read_npy(path("dv.npy"));
  EXPECT_EQ(dq.dtype, DType::f32);
  EXPECT_EQ(dq.shape, (std::vector<std::int64_t>{2, 13, 4, 24}));
  EXPECT_EQ(dk.shape, (std::vector<std::int64_t>{2, 21, 2, 24}));
  EXPECT_EQ(dv.shape, (std::vector<std::int64_t>{2, 21, 2, 24}));

  const Problem::Gradients reference = p.gradients(AttentionImpl::reference);
  const Problem::Gradients standard = p.gradients(AttentionImpl::standard);
  const auto widened = [](const npy::Array& array) {
    return std::vector<double>(array.f32.begin(), array.f32.end());
  };
  expect_close(widened(dq), reference.dq, standard.dq, p, "dq");
  expect_close(widened(dk), reference.dk, standard.dk, p, "dk");
  expect_close(widened(dv), reference.dv, standard.dv, p, "dv");
}

INSTANTIATE_TEST_SUITE_P(EveryImpl, CliBackwardImplTest,
                         ::testing::Values("flash", "standard", "reference"),
                         [](const auto& info) { return std::string(info.param); });

TEST_F(CliBackwardTest, Float16InputsRunTheBackwardInF16) {
  AttentionOptions options;
  const Problem p(DType::f16, {1, 17, 2, 40}, {1, 17, 2, 40}, options, 2);
  save_inputs(p);
  std::vector<std::string> command = args();
  command.insert(command.end(), {"--repeat", "1"});
  const Completed completed = run(command);
  ASSERT_EQ(completed.exit_code, 0) << completed.err;
  EXPECT_EQ(parse_json_line(completed.out.substr(0, completed.out.find('\n'))).at("dtype"), "f16");

  const Problem::Gradients reference = p.gradients(AttentionImpl::reference);
  const Problem::Gradients standard = p.gradients(AttentionImpl::standard);
  for (const auto& [name, want, baseline] : {std::tuple{"dq", &reference.dq, &standard.dq},
                                             std::tuple{"dk", &reference.dk, &standard.dk},
                                             std::tuple{"dv", &reference.dv, &standard.dv}}) {
    const npy::Array array = npy::read_npy(path(std::string(name) + ".npy"));
    EXPECT_EQ(array.dtype, DType::f32);
    // The library wrote the gradients in f16: every value is exactly representable in binary16.
    for (const float value : array.f32) {
      ASSERT_EQ(f32_from_f16(f16_from_f32(value)), value) << name;
    }
    expect_close(std::vector<double>(array.f32.begin(), array.f32.end()), *want, *baseline, p,
                 name);
  }
}

TEST_F(CliBackwardTest, WithoutDoutOnlyTheForwardRuns) {
  const Problem p(DType::f32, {1, 5, 1, 8}, {1, 5, 1, 8}, {}, 3);
  save_inputs(p);
  const Completed completed = run({"run", "--q", path("q.npy"), "--k", path("k.npy"), "--v",
                                   path("v.npy"), "--out", path("out.npy"), "--repeat", "1"});
  ASSERT_EQ(completed.exit_code, 0) << completed.err;
  const auto json = parse_json_line(completed.out.substr(0, completed.out.find('\n')));
  EXPECT_EQ(json.count("backward_seconds"), 0u);
  EXPECT_EQ(json.count("backward_gflops"), 0u);
  EXPECT_EQ(entries(), (std::vector<std::string>{"do.npy", "k.npy", "out.npy", "q.npy", "v.npy"}));
}

TEST_F(CliBackwardTest, HelpNamesTheBackwardFlags) {
  const Completed completed = run({"run", "--help"});
  EXPECT_EQ(completed.exit_code, 0);
  for (const char* text : {"--dout", "--dq", "--dk", "--dv", "backward_seconds"}) {
    EXPECT_NE(completed.out.find(text), std::string::npos) << text;
  }
}

// Bad inputs: each must exit non-zero with exactly one line "flashattn: error: ..." on stderr,
// nothing on stdout, and leave the work directory as it was (no output, no temporary file).
class CliBackwardErrorTest : public CliBackwardTest {
 protected:
  // Valid f32 inputs: q and dO [2, 7, 4, 8], k and v [2, 9, 2, 8].
  void SetUp() override {
    CliBackwardTest::SetUp();
    save_inputs(Problem(DType::f32, {2, 7, 4, 8}, {2, 9, 2, 8}, {}, 4));
  }

  void expect_clean_failure(const std::vector<std::string>& command, int exit_code,
                            const std::string& message) const {
    const std::vector<std::string> before = entries();
    const Completed completed = run(command);
    std::string line;
    for (const std::string& arg : command) line += " " + arg;
    EXPECT_EQ(completed.exit_code, exit_code) << line << "\n" << completed.err;
    expect_one_error_line(completed, line, message);
    EXPECT_EQ(entries(), before) << line;
  }
};

TEST_F(CliBackwardErrorTest, BackwardFlagsGoTogether) {
  // A partial set is a command-line error (exit 2) naming what is missing.
  for (const char* flag : {"--dout", "--dq", "--dk", "--dv"}) {
    expect_clean_failure(args(flag), 2,
                         std::string("--dout, --dq, --dk and --dv go together: missing ") + flag);
  }
  expect_clean_failure({"run", "--q", path("q.npy"), "--k", path("k.npy"), "--v", path("v.npy"),
                        "--out", path("out.npy"), "--dout", path("do.npy")},
                       2, "go together: missing --dq, --dk, --dv");
}

TEST_F(CliBackwardErrorTest, DoutThatDoesNotFitQ) {
  std::mt19937_64 rng(5);
  Tensor wrong(DType::f32, {2, 7, 4, 9});
  wrong.fill_normal(rng);
  save(wrong, path("do.npy"));
  expect_clean_failure(args(), 1,
                       "dout: expected shape (2, 7, 4, 8) (as out: q's leading dims, v's "
                       "head_dim_v), got (2, 7, 4, 9) in " +
                           path("do.npy"));

  Tensor half(DType::f16, {2, 7, 4, 8});
  half.fill_normal(rng);
  save(half, path("do.npy"));
  expect_clean_failure(args(), 1, "dout: expected dtype f32 (as q), got f16");

  npy::write_npy(path("do.npy"), std::vector<float>(2 * 7 * 32).data(),
                 std::vector<std::int64_t>{2, 7, 32});
  expect_clean_failure(args(), 1, "dout: expected a rank-4 array");

  fs::remove(path("do.npy"));
  expect_clean_failure(args(), 1, path("do.npy") + ": cannot open: No such file or directory");
}

TEST_F(CliBackwardErrorTest, UnwritableGradientFailsBeforeAnyWork) {
  std::vector<std::string> command = args();
  const auto dq = std::find(command.begin(), command.end(), path("dq.npy"));
  ASSERT_NE(dq, command.end());
  *dq = path("missing_dir/dq.npy");
  expect_clean_failure(command, 1,
                       path("missing_dir/dq.npy") + ": cannot write: No such file or directory");
  // The outputs are opened before the inputs are read: a bad gradient path wins over a bad dO.
  fs::rename(path("do.npy"), path("do.moved"));
  expect_clean_failure(command, 1, path("missing_dir/dq.npy"));
  fs::rename(path("do.moved"), path("do.npy"));

  fs::create_directory(path("a_directory"));
  *dq = path("a_directory");
  expect_clean_failure(command, 1, "is a directory");
}

TEST_F(CliBackwardErrorTest, EveryOutputNeedsItsOwnPath) {
  std::vector<std::string> command = args();
  *std::find(command.begin(), command.end(), path("dq.npy")) = path("out.npy");
  expect_clean_failure(command, 1,
                       "--dq: expected a path different from --out, got " + path("out.npy"));
  command = args();
  *std::find(command.begin(), command.end(), path("dv.npy")) = path("./dk.npy");
  expect_clean_failure(command, 1, "--dv: expected a path different from --dk");
  command = args();
  command.insert(command.end(), {"--lse", path("dk.npy")});
  expect_clean_failure(command, 1, "--dk: expected a path different from --lse");
}

}  // namespace
}  // namespace flashattn::testing
