// The score modifiers on the command line: `flashattn run --softcap --alibi --sinks --dsinks
// --bias --mask --dbias` against the library on the same inputs, the JSON line's "softcap" and
// "modifiers", `flashattn demo --softcap --alibi`, and the bad inputs (each one line on stderr, a
// non-zero exit, no file left behind). Run as a subprocess in a fresh directory per test.

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "cli_test_support.hpp"
#include "flashattn/flashattn.hpp"
#include "npy.hpp"
#include "test_support.hpp"

namespace flashattn::testing {
namespace {

using Shape = std::array<std::int64_t, 4>;

// Flags that make a run fail: its exit code, and what its message must say.
struct BadCase {
  std::vector<std::string> flags;
  int exit_code;
  std::string message;
};

class CliModifiersTest : public CliFixture {
 protected:
  CliModifiersTest() : CliFixture("flashattn_cli_modifiers") {}

  // q [2, 3, 4, 8] (also as dO) and k [2, 5, 2, 8] (also as v), random, for the bad cases.
  void save_bad_case_inputs() const {
    Tensor q(DType::f32, {2, 3, 4, 8}), k(DType::f32, {2, 5, 2, 8});
    std::mt19937_64 rng(test_seed());
    q.fill_normal(rng);
    k.fill_normal(rng);
    save(q, "q.npy");
    save(k, "k.npy");
    save(q, "do.npy");
  }
  std::vector<std::string> bad_case_inputs() const {
    return {"run", "--q",         path("q.npy"), "--k",          path("k.npy"),
            "--v", path("k.npy"), "--out",       path("out.npy")};
  }

  // `inputs` plus the case's flags: its exit code, one line on stderr (exit 1) or CLI11's
  // message (exit 2) holding its message, and the work directory as `before`.
  void expect_bad_case(const std::vector<std::string>& inputs, const BadCase& bad,
                       const std::vector<std::string>& before) {
    std::vector<std::string> command = inputs;
    command.insert(command.end(), bad.flags.begin(), bad.flags.end());
    const Completed completed = run(command);
    const std::string text = bad.flags[0] + " " + bad.flags[1];
    EXPECT_EQ(completed.exit_code, bad.exit_code) << text << "\n" << completed.err;
    if (bad.exit_code == 1) {
      expect_one_error_line(completed, text, bad.message);
    } else {
      EXPECT_NE(completed.err.find(bad.message), std::string::npos) << text << completed.err;
    }
    EXPECT_EQ(entries(), before) << text;
  }

  void save(const Tensor& tensor, const std::string& name) const {
    npy::write_npy(path(name), reinterpret_cast<const float*>(tensor.bytes.data()),
                   tensor.view.shape);
  }
  void save(const std::vector<float>& values, std::vector<std::int64_t> shape,
            const std::string& name) const {
    npy::write_npy(path(name), values.data(), shape);
  }
};

// The tool computes what the library computes, through the same path: its files hold the
// library's float32 results bit for bit.
TEST_F(CliModifiersTest, RunWithEveryModifierMatchesTheLibrary) {
  const Shape q_shape{2, 9, 4, 16}, kv_shape{2, 13, 2, 16};
  std::mt19937_64 rng(test_seed());
  Tensor q(DType::f32, q_shape), k(DType::f32, kv_shape), v(DType::f32, kv_shape),
      dout(DType::f32, q_shape);
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  dout.fill_normal(rng);
  const std::vector<float> slopes = {0.5f, 0.25f, 0.125f, 0.0625f, 1.0f, 0.5f, 0.25f, 0.125f};
  const std::vector<float> sinks = {0.5f, -1.0f, 2.0f, 0.0f};
  save(q, "q.npy");
  save(k, "k.npy");
  save(v, "v.npy");
  save(dout, "do.npy");
  save(slopes, {2, 4}, "slopes.npy");
  save(sinks, {4}, "sinks.npy");

  const Completed completed = run({"run",
                                   "--q",
                                   path("q.npy"),
                                   "--k",
                                   path("k.npy"),
                                   "--v",
                                   path("v.npy"),
                                   "--out",
                                   path("out.npy"),
                                   "--lse",
                                   path("lse.npy"),
                                   "--dout",
                                   path("do.npy"),
                                   "--dq",
                                   path("dq.npy"),
                                   "--dk",
                                   path("dk.npy"),
                                   "--dv",
                                   path("dv.npy"),
                                   "--softcap",
                                   "4.5",
                                   "--alibi",
                                   path("slopes.npy"),
                                   "--sinks",
                                   path("sinks.npy"),
                                   "--dsinks",
                                   path("dsinks.npy"),
                                   "--causal",
                                   "--threads",
                                   "2",
                                   "--repeat",
                                   "1"});
  ASSERT_EQ(completed.exit_code, 0) << completed.err;
  const auto json = parse_json_line(completed.out.substr(0, completed.out.size() - 1));
  EXPECT_EQ(json.at("softcap"), "4.5");
  EXPECT_EQ(json.at("modifiers"), "[\"softcap\", \"alibi\", \"sinks\"]");

  AttentionOptions options;
  options.causal = true;
  options.softcap = 4.5f;
  options.alibi_slopes = slopes;
  options.sinks = sinks;
  options.num_threads = 2;
  Tensor out(DType::f32, q_shape), dq(DType::f32, q_shape), dk(DType::f32, kv_shape),
      dv(DType::f32, kv_shape);
  std::vector<float> lse(2 * 4 * 9), dsinks(4);
  flash_attention_forward(q.view, k.view, v.view, out.view, lse.data(), options);
  ModifierGradients gradients;
  gradients.dsinks = dsinks.data();
  flash_attention_backward(dout.view, q.view, k.view, v.view, out.view, lse.data(), dq.view,
                           dk.view, dv.view, options, gradients);

  auto expect_file = [&](const std::string& name, const float* want, std::size_t count) {
    const npy::Array array = npy::read_npy(path(name));
    ASSERT_EQ(array.f32.size(), count) << name;
    for (std::size_t i = 0; i < count; ++i)
      EXPECT_EQ(array.f32[i], want[i]) << name << "[" << i << "]";
  };
  auto data = [](const Tensor& t) { return reinterpret_cast<const float*>(t.bytes.data()); };
  expect_file("out.npy", data(out), out.bytes.size() / 4);
  expect_file("lse.npy", lse.data(), lse.size());
  expect_file("dq.npy", data(dq), dq.bytes.size() / 4);
  expect_file("dk.npy", data(dk), dk.bytes.size() / 4);
  expect_file("dv.npy", data(dv), dv.bytes.size() / 4);
  expect_file("dsinks.npy", dsinks.data(), dsinks.size());
  EXPECT_EQ(npy::read_npy(path("dsinks.npy")).shape, (std::vector<std::int64_t>{4}));
}

// --dropout P --seed N: the library's dropout with that seed (offset 0), bit for bit, forward
// and backward; another seed another output.
TEST_F(CliModifiersTest, RunWithDropoutMatchesTheLibrary) {
  const Shape q_shape{2, 40, 4, 16}, kv_shape{2, 50, 2, 16};
  std::mt19937_64 rng(test_seed());
  Tensor q(DType::f32, q_shape), k(DType::f32, kv_shape), v(DType::f32, kv_shape),
      dout(DType::f32, q_shape);
  for (Tensor* t : {&q, &k, &v, &dout}) t->fill_normal(rng);
  save(q, "q.npy");
  save(k, "k.npy");
  save(v, "v.npy");
  save(dout, "do.npy");
  auto run_with_seed = [&](const std::string& seed, const std::string& out) {
    return run({"run",          "--q",    path("q.npy"),  "--k",      path("k.npy"),  "--v",
                path("v.npy"),  "--out",  path(out),      "--dout",   path("do.npy"), "--dq",
                path("dq.npy"), "--dk",   path("dk.npy"), "--dv",     path("dv.npy"), "--dropout",
                "0.25",         "--seed", seed,           "--causal", "--repeat",     "1"});
  };
  const Completed completed = run_with_seed("18446744073709551615", "out.npy");
  ASSERT_EQ(completed.exit_code, 0) << completed.err;
  const auto json = parse_json_line(completed.out.substr(0, completed.out.size() - 1));
  EXPECT_EQ(json.at("dropout"), "0.25");
  EXPECT_EQ(json.at("seed"), "18446744073709551615");

  AttentionOptions options;
  options.causal = true;
  options.dropout_p = 0.25f;
  options.dropout_seed = ~std::uint64_t{0};
  Tensor out(DType::f32, q_shape), dq(DType::f32, q_shape), dk(DType::f32, kv_shape),
      dv(DType::f32, kv_shape);
  std::vector<float> lse(2 * 4 * 40);
  flash_attention_forward(q.view, k.view, v.view, out.view, lse.data(), options);
  flash_attention_backward(dout.view, q.view, k.view, v.view, out.view, lse.data(), dq.view,
                           dk.view, dv.view, options);
  auto expect_file = [&](const std::string& name, const Tensor& want) {
    const npy::Array array = npy::read_npy(path(name));
    ASSERT_EQ(array.f32.size() * 4, want.bytes.size()) << name;
    EXPECT_EQ(std::memcmp(array.f32.data(), want.bytes.data(), want.bytes.size()), 0) << name;
  };
  expect_file("out.npy", out);
  expect_file("dq.npy", dq);
  expect_file("dk.npy", dk);
  expect_file("dv.npy", dv);

  ASSERT_EQ(run_with_seed("5", "out5.npy").exit_code, 0);
  EXPECT_NE(npy::read_npy(path("out5.npy")).f32, npy::read_npy(path("out.npy")).f32);
}

TEST_F(CliModifiersTest, BadDropoutFailsCleanly) {
  save_bad_case_inputs();
  const std::vector<std::string> inputs = bad_case_inputs();
  const std::vector<std::string> before = entries();
  const BadCase cases[] = {
      {{"--dropout", "1"}, 2, "--dropout"},
      {{"--dropout", "-0.1"}, 2, "--dropout"},
      {{"--dropout", "nan"}, 2, "--dropout"},
      {{"--seed", "abc"}, 2, "--seed"},
  };
  for (const BadCase& bad : cases) expect_bad_case(inputs, bad, before);
}

// A numpy bool array ('|b1') of `shape` from bytes.
void save_mask(const std::string& file, const std::vector<std::uint8_t>& keep,
               std::vector<std::int64_t> shape) {
  std::ofstream out(file, std::ios::binary);
  out << npy::make_header("|b1", shape);
  out.write(reinterpret_cast<const char*>(keep.data()), static_cast<std::streamsize>(keep.size()));
}

// --bias (2-d, broadcast over batch and heads), --mask (4-d, per batch entry) and --dbias: the
// library's results bit for bit, dbias in the bias file's shape.
TEST_F(CliModifiersTest, RunWithBiasAndMaskMatchesTheLibrary) {
  const Shape q_shape{2, 9, 4, 16}, kv_shape{2, 13, 2, 16};
  std::mt19937_64 rng(test_seed());
  Tensor q(DType::f32, q_shape), k(DType::f32, kv_shape), v(DType::f32, kv_shape),
      dout(DType::f32, q_shape), bias(DType::f32, {1, 1, 9, 13});
  for (Tensor* t : {&q, &k, &v, &dout, &bias}) t->fill_normal(rng);
  std::vector<std::uint8_t> keep(2 * 9 * 13);
  std::bernoulli_distribution coin(0.6);
  for (auto& byte : keep) byte = coin(rng);
  save(q, "q.npy");
  save(k, "k.npy");
  save(v, "v.npy");
  save(dout, "do.npy");
  npy::write_npy(path("bias.npy"), reinterpret_cast<const float*>(bias.bytes.data()),
                 std::vector<std::int64_t>{9, 13});
  save_mask(path("mask.npy"), keep, {2, 1, 9, 13});

  const Completed completed = run({"run",
                                   "--q",
                                   path("q.npy"),
                                   "--k",
                                   path("k.npy"),
                                   "--v",
                                   path("v.npy"),
                                   "--out",
                                   path("out.npy"),
                                   "--dout",
                                   path("do.npy"),
                                   "--dq",
                                   path("dq.npy"),
                                   "--dk",
                                   path("dk.npy"),
                                   "--dv",
                                   path("dv.npy"),
                                   "--bias",
                                   path("bias.npy"),
                                   "--mask",
                                   path("mask.npy"),
                                   "--dbias",
                                   path("dbias.npy"),
                                   "--threads",
                                   "2",
                                   "--repeat",
                                   "1"});
  ASSERT_EQ(completed.exit_code, 0) << completed.err;
  const auto json = parse_json_line(completed.out.substr(0, completed.out.size() - 1));
  EXPECT_EQ(json.at("modifiers"), "[\"bias\", \"mask\"]");

  AttentionOptions options;
  options.bias = bias.view;
  options.mask = MaskView{
      reinterpret_cast<const bool*>(keep.data()), {2, 1, 9, 13}, contiguous_strides({2, 1, 9, 13})};
  options.num_threads = 2;
  Tensor out(DType::f32, q_shape), dq(DType::f32, q_shape), dk(DType::f32, kv_shape),
      dv(DType::f32, kv_shape), dbias(DType::f32, {1, 1, 9, 13});
  std::vector<float> lse(2 * 4 * 9);
  flash_attention_forward(q.view, k.view, v.view, out.view, lse.data(), options);
  ModifierGradients gradients;
  gradients.dbias = dbias.view;
  flash_attention_backward(dout.view, q.view, k.view, v.view, out.view, lse.data(), dq.view,
                           dk.view, dv.view, options, gradients);
  auto expect_file = [&](const std::string& name, const Tensor& want) {
    const npy::Array array = npy::read_npy(path(name));
    const auto* values = reinterpret_cast<const float*>(want.bytes.data());
    ASSERT_EQ(array.f32.size(), want.bytes.size() / 4) << name;
    for (std::size_t i = 0; i < array.f32.size(); ++i)
      EXPECT_EQ(array.f32[i], values[i]) << name << "[" << i << "]";
  };
  expect_file("out.npy", out);
  expect_file("dq.npy", dq);
  expect_file("dbias.npy", dbias);
  EXPECT_EQ(npy::read_npy(path("dbias.npy")).shape, (std::vector<std::int64_t>{9, 13}));
}

// Bad biases and masks: one line on stderr, exit 1 or 2, nothing written.
TEST_F(CliModifiersTest, BadBiasesAndMasksFailCleanly) {
  save_bad_case_inputs();
  save(std::vector<float>(15, 0.5f), {3, 5}, "bias.npy");
  save(std::vector<float>(15, 0.5f), {5, 3}, "transposed.npy");
  save(std::vector<float>(15, 0.5f), {15}, "flat.npy");
  save(std::vector<float>(45, 0.5f), {3, 1, 3, 5}, "batch3.npy");
  save_mask(path("mask.npy"), std::vector<std::uint8_t>(15, 1), {3, 5});
  save_mask(path("mask_shape.npy"), std::vector<std::uint8_t>(15, 1), {5, 3});
  save_mask(path("mask_byte.npy"), std::vector<std::uint8_t>(15, 2), {3, 5});
  const std::vector<std::string> inputs = bad_case_inputs();
  const std::vector<std::string> before = entries();
  const BadCase cases[] = {
      {{"--bias", path("transposed.npy")}, 1, "bias: expected shape [2 or 1, 4 or 1, 3, 5]"},
      {{"--bias", path("flat.npy")}, 1, "bias: expected a rank-2 array"},
      {{"--bias", path("batch3.npy")}, 1, "bias: expected shape"},
      {{"--bias", path("mask.npy")}, 1, "unsupported dtype '|b1'"},
      {{"--mask", path("bias.npy")}, 1, "a mask must be numpy bool ('|b1')"},
      {{"--mask", path("mask_shape.npy")}, 1, "mask: expected shape"},
      {{"--mask", path("mask_byte.npy")}, 1, "a numpy bool holds 0 or 1"},
      {{"--dbias", path("db.npy")}, 2, "--dbias: expected --bias"},
      {{"--bias", path("bias.npy"), "--dbias", path("db.npy")}, 2, "--dbias: expected --bias"},
  };
  for (const BadCase& bad : cases) expect_bad_case(inputs, bad, before);
}

TEST_F(CliModifiersTest, RunWithoutModifiersReportsNone) {
  Tensor q(DType::f32, {1, 3, 1, 8});
  std::mt19937_64 rng(test_seed());
  q.fill_normal(rng);
  save(q, "q.npy");
  const Completed completed = run({"run", "--q", path("q.npy"), "--k", path("q.npy"), "--v",
                                   path("q.npy"), "--out", path("out.npy"), "--repeat", "1"});
  ASSERT_EQ(completed.exit_code, 0) << completed.err;
  const auto json = parse_json_line(completed.out.substr(0, completed.out.size() - 1));
  EXPECT_EQ(json.at("softcap"), "0");
  EXPECT_EQ(json.at("modifiers"), "[]");
}

// Each bad modifier: one line on stderr naming it, exit 1 (bad input) or 2 (bad command line),
// and the work directory as it was.
TEST_F(CliModifiersTest, BadModifiersFailCleanly) {
  save_bad_case_inputs();
  save(std::vector<float>(3, 0.5f), {3}, "three.npy");
  save(std::vector<float>(8, 0.5f), {4, 2}, "transposed.npy");
  save({0.5f, NAN, 0.5f, 0.5f}, {4}, "nan.npy");
  {
    std::ofstream file(path("int.npy"), std::ios::binary);
    file << npy::make_header("<i4", std::vector<std::int64_t>{4});
    file.write("\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0", 16);
  }
  const std::vector<std::string> inputs = bad_case_inputs();
  const std::vector<std::string> before = entries();
  const BadCase cases[] = {
      {{"--softcap", "-1"}, 2, "--softcap"},
      {{"--softcap", "nan"}, 2, "--softcap"},
      {{"--softcap", "inf"}, 2, "--softcap"},
      {{"--alibi", path("three.npy")}, 1, "alibi: expected shape (4,) ([heads_q]) or (2, 4)"},
      {{"--alibi", path("transposed.npy")}, 1, "alibi: expected shape"},
      {{"--alibi", path("nan.npy")}, 1, "alibi_slopes[1]: expected a finite value"},
      {{"--alibi", path("int.npy")}, 1, "int.npy"},
      {{"--sinks", path("three.npy")}, 1, "sinks: expected shape (4,)"},
      {{"--sinks", path("nan.npy")}, 1, "sinks[1]: expected a finite value"},
      {{"--dsinks", path("ds.npy")}, 2, "--dsinks: expected --sinks"},
      {{"--sinks", path("nan.npy"), "--dsinks", path("ds.npy")}, 2, "--dsinks: expected --sinks"},
  };
  for (const BadCase& bad : cases) expect_bad_case(inputs, bad, before);
  // --dsinks with the backward but a bad sink: nothing written, the gradients included.
  std::vector<std::string> command = inputs;
  command.insert(command.end(),
                 {"--dout", path("do.npy"), "--dq", path("dq.npy"), "--dk", path("dk.npy"), "--dv",
                  path("dv.npy"), "--sinks", path("nan.npy"), "--dsinks", path("ds.npy")});
  const Completed completed = run(command);
  EXPECT_EQ(completed.exit_code, 1) << completed.err;
  expect_one_error_line(completed, "backward with a NaN sink", "sinks[1]");
  EXPECT_EQ(entries(), before);
}

TEST_F(CliModifiersTest, DemoWithSoftcapAndAlibiAgrees) {
  const Completed completed =
      run({"demo", "--batch", "1", "--heads", "6", "--kv-heads", "2", "--seqlen", "150",
           "--head-dim", "40", "--softcap", "5", "--alibi", "--repeat", "1"});
  ASSERT_EQ(completed.exit_code, 0) << completed.out << completed.err;
  EXPECT_NE(completed.out.find("causal, softcap 5, ALiBi"), std::string::npos) << completed.out;
  EXPECT_NE(completed.out.find("agree: yes"), std::string::npos) << completed.out;
}

TEST_F(CliModifiersTest, DemoRefusesBadModifiers) {
  const Completed non_causal =
      run({"demo", "--seqlen", "16", "--heads", "2", "--alibi", "--no-causal", "--repeat", "1"});
  EXPECT_EQ(non_causal.exit_code, 1);
  expect_one_error_line(non_causal, "--alibi --no-causal", "--alibi: expected the causal mask");
  const Completed negative = run({"demo", "--seqlen", "16", "--softcap", "-2"});
  EXPECT_EQ(negative.exit_code, 2);
  EXPECT_NE(negative.err.find("--softcap"), std::string::npos) << negative.err;
}

}  // namespace
}  // namespace flashattn::testing
