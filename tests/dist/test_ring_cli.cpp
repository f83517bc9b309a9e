// `flashattn ring` under mpirun, as a user runs it: .npy files in, the gathered outputs against
// the fp64 reference (assembled_tolerance, test_support.hpp), the JSON line; rank 0's bad input
// failing the job with one line and no file; a rank killed mid-run ending the job instead of
// hanging it; the command line's own errors.

#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cli_test_support.hpp"
#include "flashattn/flashattn.hpp"
#include "npy.hpp"
#include "test_support.hpp"

namespace flashattn::testing {
namespace {

namespace fs = std::filesystem;

class RingCli : public CliFixture {
 protected:
  RingCli() : CliFixture("flashattn_ring_cli") {
    // Open MPI refuses to start as root (CI's containers) unless told twice.
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 0);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 0);
  }

  // mpirun -q -np `ranks` --oversubscribe flashattn ring `args`.
  std::vector<std::string> mpirun_args(int ranks, const std::vector<std::string>& args) const {
    std::vector<std::string> all = {
        "-q", "-np", std::to_string(ranks), "--oversubscribe", FLASHATTN_CLI_PATH, "ring"};
    all.insert(all.end(), args.begin(), args.end());
    return all;
  }
  Completed mpirun(int ranks, const std::vector<std::string>& args) const {
    return run_program(FLASHATTN_MPIEXEC, mpirun_args(ranks, args), capture_);
  }
};

void save(const Tensor& tensor, const fs::path& path) {
  npy::write_npy(path, reinterpret_cast<const float*>(tensor.bytes.data()), tensor.view.shape);
}

Tensor load(const fs::path& path) {
  const npy::Array array = npy::read_npy(path);
  Tensor tensor(DType::f32, {array.shape[0], array.shape[1], array.shape[2], array.shape[3]});
  std::copy(array.f32.begin(), array.f32.end(), reinterpret_cast<float*>(tensor.bytes.data()));
  return tensor;
}

TEST_F(RingCli, FilesInGatheredOutputsMatchTheReference) {
  // Causal, zigzag, GQA, a length that no count of ranks divides evenly.
  const std::int64_t seqlen = 101, heads_q = 4, heads_kv = 2, dim = 32;
  std::mt19937_64 rng(test_seed());
  SCOPED_TRACE("seed " + std::to_string(test_seed()));
  Tensor q(DType::f32, {1, seqlen, heads_q, dim}), k(DType::f32, {1, seqlen, heads_kv, dim}),
      v(DType::f32, {1, seqlen, heads_kv, dim}), dout(DType::f32, {1, seqlen, heads_q, dim});
  for (Tensor* t : {&q, &k, &v, &dout}) t->fill_normal(rng);
  save(q, path("q.npy"));
  save(k, path("k.npy"));
  save(v, path("v.npy"));
  save(dout, path("dout.npy"));

  const Completed run =
      mpirun(3, {"--q", path("q.npy"), "--k", path("k.npy"), "--v", path("v.npy"), "--out",
                 path("out.npy"), "--dout", path("dout.npy"), "--dq", path("dq.npy"), "--dk",
                 path("dk.npy"), "--dv", path("dv.npy"), "--causal", "--check"});
  ASSERT_EQ(run.exit_code, 0) << run.err;
  const auto fields = parse_json_line(run.out.substr(0, run.out.find('\n')));
  EXPECT_EQ(fields.at("ranks"), "3");
  EXPECT_EQ(fields.at("sharding"), "zigzag");
  EXPECT_LT(std::stod(fields.at("max_error_vs_single_process")), 1e-4);
  const double hidden = std::stod(fields.at("hidden_fraction"));
  EXPECT_GE(hidden, 0.0);
  EXPECT_LE(hidden, 1.0);

  AttentionOptions options;
  options.causal = true;
  const ReferenceResult want = reference(q, k, v, options);
  Tensor single(DType::f32, q.view.shape);
  flash_attention_forward(q.view, k.view, v.view, single.view, nullptr, options);
  const double score_rounding = 0x1p-24 * max_abs(q) * max_abs(k);
  const double tolerance =
      assembled_tolerance(max_error(single, want.out).value, DType::f32, 7, score_rounding,
                          max_abs_finite(want.out) + max_abs(v));
  EXPECT_LE(max_error(load(path("out.npy")), want.out).value, tolerance);

  // The gradients: the fp64 reference's, within the same rule around the single-process flash
  // backward's own error.
  Tensor out(DType::f32, q.view.shape);
  std::vector<float> lse(static_cast<std::size_t>(heads_q * seqlen));
  flash_attention_forward(q.view, k.view, v.view, out.view, lse.data(), options);
  const GradientOracle want_grads = gradient_oracle(dout, q, k, v, out, lse.data(), options);
  const double gradient_tolerance = assembled_tolerance(want_grads.single_flash_error, DType::f32,
                                                        7, score_rounding, want_grads.scale_g);
  EXPECT_LE(max_error(load(path("dq.npy")), want_grads.dq).value, gradient_tolerance);
  EXPECT_LE(max_error(load(path("dk.npy")), want_grads.dk).value, gradient_tolerance);
  EXPECT_LE(max_error(load(path("dv.npy")), want_grads.dv).value, gradient_tolerance);
}

TEST_F(RingCli, RankZerosBadInputFailsEveryRankWithOneLineAndNoFile) {
  Tensor q(DType::f32, {1, 10, 2, 16}), k(DType::f32, {1, 11, 2, 16});
  q.fill(1.0f);
  k.fill(1.0f);
  save(q, path("q.npy"));
  save(k, path("k.npy"));
  const Completed mismatched = mpirun(3, {"--q", path("q.npy"), "--k", path("k.npy"), "--v",
                                          path("k.npy"), "--out", path("o.npy")});
  EXPECT_EQ(mismatched.exit_code, 1);
  expect_one_error_line(mismatched, "seqlen_kv != seqlen_q", "--k: expected [1, 10, heads_kv, 16]");
  const Completed missing = mpirun(2, {"--q", path("q.npy"), "--k", path("nothing.npy"), "--v",
                                       path("k.npy"), "--out", path("o.npy")});
  EXPECT_EQ(missing.exit_code, 1);
  expect_one_error_line(missing, "missing --k", "--k: ");
  EXPECT_EQ(entries(), (std::vector<std::string>{"k.npy", "q.npy"}));
}

// A rank killed mid-run: the job ends (Open MPI's runtime stops the others), with a failing
// status and no output file, well within the time the run would have taken.
TEST_F(RingCli, AKilledRankEndsTheJobInsteadOfHangingIt) {
  const pid_t job = spawn_program(
      FLASHATTN_MPIEXEC,
      mpirun_args(2, {"--shape", "1,32768,8,8,64", "--threads", "1", "--out", path("o.npy")}),
      capture_);
  ASSERT_GT(job, 0);
  // Find rank 1: a child of mpirun running flashattn with OMPI_COMM_WORLD_RANK=1. (Rank 0 holds
  // the output's temporary file, which no process can remove on SIGKILL; rank 1's death makes
  // mpirun stop rank 0 with SIGTERM, on which it does.)
  pid_t rank = -1;
  const auto start = std::chrono::steady_clock::now();
  while (rank < 0 && std::chrono::steady_clock::now() - start < std::chrono::seconds(20)) {
    for (const auto& entry : fs::directory_iterator("/proc")) {
      const std::string name = entry.path().filename().string();
      if (name.find_first_not_of("0123456789") != std::string::npos) continue;
      std::ifstream stat(entry.path() / "stat");
      std::string pid, command, state;
      long parent = 0;
      stat >> pid >> command >> state >> parent;
      if (parent != job || command != "(flashattn)") continue;
      const std::string environment = read_text(entry.path() / "environ");
      if (environment.find(std::string("OMPI_COMM_WORLD_RANK=1") + '\0') != std::string::npos) {
        rank = static_cast<pid_t>(std::stol(pid));
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_GT(rank, 0) << "rank 1 of the job not found";
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  kill(rank, SIGKILL);
  const Completed completed = wait_program(job, capture_);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(completed.exit_code, 0) << completed.err;
  EXPECT_LT(seconds, 60.0);
  EXPECT_EQ(entries(), std::vector<std::string>{});
}

TEST_F(RingCli, CommandLineErrors) {
  const Completed both = run({"ring", "--shape", "1,8,2,2,16", "--q", path("q.npy")});
  EXPECT_EQ(both.exit_code, 2);
  EXPECT_NE(both.err.find("either --q, --k and --v (files) or --shape"), std::string::npos)
      << both.err;
  const Completed shape = run({"ring", "--shape", "1,8,3,2,16"});
  EXPECT_EQ(shape.exit_code, 2);
  EXPECT_NE(shape.err.find("Hkv dividing Hq"), std::string::npos) << shape.err;
  const Completed sharding = run({"ring", "--shape", "1,8,2,2,16", "--sharding", "striped"});
  EXPECT_EQ(sharding.exit_code, 2);
  EXPECT_NE(sharding.err.find("expected zigzag or contiguous"), std::string::npos) << sharding.err;
}

// Without mpirun the tool is a ring of one (MPI's singleton start).
TEST_F(RingCli, RunsAsOneRankWithoutMpirun) {
  const Completed single = run({"ring", "--shape", "1,64,2,1,16", "--causal", "--check"});
  ASSERT_EQ(single.exit_code, 0) << single.err;
  const auto fields = parse_json_line(single.out.substr(0, single.out.find('\n')));
  EXPECT_EQ(fields.at("ranks"), "1");
  EXPECT_LT(std::stod(fields.at("max_error_vs_single_process")), 1e-5);
}

}  // namespace
}  // namespace flashattn::testing
