// Ring attention (flashattn/dist.hpp) under mpirun: every rank runs every test, collectively.
// Each rank builds the same whole problem from a seed that rank 0 chose, runs the single-process
// flash path and the fp64 reference on it, runs the ring on its shard, and checks its rows
// against the reference with assembled_tolerance (test_support.hpp): 4x the single-process flash
// error plus a floor that grows with the number of partial states merged. The verdicts are
// reduced over the ranks, so that a wrong row on any rank fails the test on every rank.
//
// FLASHATTN_TEST_MPI_THREAD=single initializes MPI without thread support: the transfers then
// progress on the compute thread (the other code path of dist/ring.cpp).

#include <gtest/gtest.h>
#include <mpi.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "flashattn/dist.hpp"
#include "test_support.hpp"

namespace flashattn::testing {
namespace {

int world_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}
int world_size() {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

// The same seed on every rank: rank 0's.
std::uint64_t shared_seed() {
  std::uint64_t seed = test_seed();
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  return seed;
}

double max_over_ranks(double value) {
  double result = 0.0;
  MPI_Allreduce(&value, &result, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return result;
}

struct RingCase {
  std::int64_t batch, seqlen, heads_q, heads_kv, head_dim;
  bool causal = false;
  std::int64_t window_left = -1, window_right = -1;
  dist::Sharding sharding = dist::Sharding::contiguous;
  DType dtype = DType::f32;
  std::int64_t head_dim_v = 0;  // v's, out's and dO's head dim; 0: head_dim

  std::int64_t value_dims() const { return head_dim_v > 0 ? head_dim_v : head_dim; }
};

std::string describe(const RingCase& c) {
  std::ostringstream text;
  text << "B" << c.batch << "_S" << c.seqlen << "_Hq" << c.heads_q << "_Hkv" << c.heads_kv << "_D"
       << c.head_dim << "_Dv" << c.value_dims() << (c.causal ? "_causal" : "") << "_win"
       << c.window_left << "_" << c.window_right << "_" << dist::sharding_name(c.sharding) << "_"
       << dtype_name(c.dtype);
  std::string name = text.str();
  for (char& ch : name) {
    if (ch == '-') ch = 'm';
  }
  return name;
}

// The whole problem, the same on every rank, and this rank's shards of it.
struct Problem {
  RingCase c;
  AttentionOptions options;
  Tensor q, k, v, dout;
  Tensor q_local, k_local, v_local, dout_local;
  int ranks, rank;

  explicit Problem(const RingCase& ring_case)
      : c(ring_case),
        q(c.dtype, {c.batch, c.seqlen, c.heads_q, c.head_dim}),
        k(c.dtype, {c.batch, c.seqlen, c.heads_kv, c.head_dim}),
        v(c.dtype, {c.batch, c.seqlen, c.heads_kv, c.value_dims()}),
        dout(c.dtype, {c.batch, c.seqlen, c.heads_q, c.value_dims()}),
        q_local(c.dtype, local_shape(c.heads_q)),
        k_local(c.dtype, local_shape(c.heads_kv)),
        v_local(c.dtype, local_shape(c.heads_kv, c.value_dims())),
        dout_local(c.dtype, local_shape(c.heads_q, c.value_dims())),
        ranks(world_size()),
        rank(world_rank()) {
    std::mt19937_64 rng(shared_seed());
    q.fill_normal(rng);
    k.fill_normal(rng);
    v.fill_normal(rng);
    dout.fill_normal(rng);
    options.causal = c.causal;
    options.window_left = c.window_left;
    options.window_right = c.window_right;
    options.num_threads = 1;
    dist::shard(q.view, c.sharding, ranks, rank, q_local.view);
    dist::shard(k.view, c.sharding, ranks, rank, k_local.view);
    dist::shard(v.view, c.sharding, ranks, rank, v_local.view);
    dist::shard(dout.view, c.sharding, ranks, rank, dout_local.view);
  }

  // This rank's rows of `heads` heads of `dims` (head_dim unless given).
  std::array<std::int64_t, 4> local_shape(std::int64_t heads, std::int64_t dims = 0) const {
    return {c.batch, dist::shard_length(c.sharding, c.seqlen, world_size(), world_rank()), heads,
            dims > 0 ? dims : c.head_dim};
  }

  dist::RingOptions ring() const { return {.sharding = c.sharding, .timeout_seconds = 120.0}; }

  double score_rounding() const {
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
    return 0x1p-24 * scale * std::sqrt(static_cast<double>(c.head_dim)) * max_abs(q) * max_abs(k);
  }

  // Partial states merged per query row: at most two segments per key shard.
  std::int64_t pieces() const { return 2 * static_cast<std::int64_t>(ranks) + 1; }
};

// A whole tensor holding this rank's rows of `local` and zeros elsewhere, and which whole rows
// this rank holds.
struct Placed {
  Tensor whole;
  std::vector<bool> mine;
};
Placed placed(const Problem& p, const Tensor& local, std::int64_t heads) {
  Placed result{Tensor(local.view.dtype, {p.c.batch, p.c.seqlen, heads, local.view.shape[3]}),
                std::vector<bool>(static_cast<std::size_t>(p.c.seqlen), false)};
  dist::unshard(local.view, p.c.sharding, p.ranks, p.rank, result.whole.view);
  for (const dist::Segment& s : dist::shard_segments(p.c.sharding, p.c.seqlen, p.ranks, p.rank)) {
    for (std::int64_t row = s.begin; row < s.begin + s.length; ++row) {
      result.mine[static_cast<std::size_t>(row)] = true;
    }
  }
  return result;
}

// The largest error over the rows this rank holds, of a [batch, seqlen, heads, dim] result.
double local_error(const Placed& got, const std::vector<double>& want) {
  double worst = 0.0;
  std::int64_t flat = 0;
  got.whole.for_each_index([&](auto b, auto s, auto h, auto d) {
    const double value = got.whole.at(b, s, h, d);
    if (got.mine[static_cast<std::size_t>(s)]) {
      worst = std::max(worst, std::isnan(value) ? INFINITY : std::abs(value - want[flat]));
    }
    ++flat;
  });
  return worst;
}

void check_forward(const RingCase& ring_case) {
  const Problem p(ring_case);
  SCOPED_TRACE(describe(p.c) + ", " + std::to_string(p.ranks) + " ranks, seed " +
               std::to_string(shared_seed()));
  const ReferenceResult want = reference(p.q, p.k, p.v, p.options);
  Tensor single(p.c.dtype, p.dout.view.shape);
  flash_attention_forward(p.q.view, p.k.view, p.v.view, single.view, nullptr, p.options);
  const double single_error = max_error(single, want.out).value;

  Tensor out_local(p.c.dtype, p.local_shape(p.c.heads_q, p.c.value_dims()));
  out_local.poison();
  const std::int64_t rows = out_local.view.shape[1];
  std::vector<float> lse_local(static_cast<std::size_t>(p.c.batch * p.c.heads_q * rows),
                               std::nanf(""));
  const dist::RingStats stats =
      dist::ring_attention_forward(MPI_COMM_WORLD, p.q_local.view, p.k_local.view, p.v_local.view,
                                   out_local.view, lse_local.data(), p.options, p.ring());

  const double error = max_over_ranks(local_error(placed(p, out_local, p.c.heads_q), want.out));
  const double g = max_abs_finite(want.out) + max_abs(p.v);
  EXPECT_LE(error, assembled_tolerance(single_error, p.c.dtype, p.pieces(), p.score_rounding(), g))
      << "single-process flash error " << single_error;

  // lse: each local row against the reference's row at its global position.
  double lse_error = 0.0;
  std::int64_t local_row = 0;
  for (const dist::Segment& s : dist::shard_segments(p.c.sharding, p.c.seqlen, p.ranks, p.rank)) {
    for (std::int64_t i = 0; i < s.length; ++i, ++local_row) {
      for (std::int64_t bh = 0; bh < p.c.batch * p.c.heads_q; ++bh) {
        const double expected = want.lse[static_cast<std::size_t>(bh * p.c.seqlen + s.begin + i)];
        const double got = lse_local[static_cast<std::size_t>(bh * rows + local_row)];
        if (std::isinf(expected)) {
          if (got != -INFINITY) lse_error = INFINITY;
        } else {
          lse_error = std::max(lse_error, std::abs(got - expected) / (1.0 + std::abs(expected)));
        }
      }
    }
  }
  EXPECT_LE(max_over_ranks(lse_error), 1e-5);
  // Every row sees at least its own key, so a rank with rows computes at least one block.
  EXPECT_EQ(stats.blocks_computed > 0, rows > 0);
}

void check_backward(const RingCase& ring_case) {
  const Problem p(ring_case);
  SCOPED_TRACE(describe(p.c) + ", " + std::to_string(p.ranks) + " ranks, seed " +
               std::to_string(shared_seed()));
  // The whole sequence's forward and its reference gradients.
  Tensor out(p.c.dtype, p.dout.view.shape);
  std::vector<float> lse(static_cast<std::size_t>(p.c.batch * p.c.heads_q * p.c.seqlen));
  flash_attention_forward(p.q.view, p.k.view, p.v.view, out.view, lse.data(), p.options);
  const GradientOracle want = gradient_oracle(p.dout, p.q, p.k, p.v, out, lse.data(), p.options);

  // The ring's forward, then its backward from what the forward wrote.
  Tensor out_local(p.c.dtype, p.local_shape(p.c.heads_q, p.c.value_dims()));
  const std::int64_t rows = out_local.view.shape[1];
  std::vector<float> lse_local(static_cast<std::size_t>(p.c.batch * p.c.heads_q * rows));
  dist::ring_attention_forward(MPI_COMM_WORLD, p.q_local.view, p.k_local.view, p.v_local.view,
                               out_local.view, lse_local.data(), p.options, p.ring());
  Tensor dq_local(p.c.dtype, p.local_shape(p.c.heads_q));
  Tensor dk_local(p.c.dtype, p.local_shape(p.c.heads_kv));
  Tensor dv_local(p.c.dtype, p.local_shape(p.c.heads_kv, p.c.value_dims()));
  dq_local.poison();
  dk_local.poison();
  dv_local.poison();
  dist::ring_attention_backward(MPI_COMM_WORLD, p.dout_local.view, p.q_local.view, p.k_local.view,
                                p.v_local.view, out_local.view, lse_local.data(), dq_local.view,
                                dk_local.view, dv_local.view, p.options, p.ring());

  const double tolerance = assembled_tolerance(want.single_flash_error, p.c.dtype, p.pieces(),
                                               p.score_rounding(), want.scale_g);
  EXPECT_LE(max_over_ranks(local_error(placed(p, dq_local, p.c.heads_q), want.dq)), tolerance)
      << "dq; single-process flash error " << want.single_flash_error;
  EXPECT_LE(max_over_ranks(local_error(placed(p, dk_local, p.c.heads_kv), want.dk)), tolerance)
      << "dk; single-process flash error " << want.single_flash_error;
  EXPECT_LE(max_over_ranks(local_error(placed(p, dv_local, p.c.heads_kv), want.dv)), tolerance)
      << "dv; single-process flash error " << want.single_flash_error;
}

class RingAttention : public ::testing::TestWithParam<RingCase> {};

TEST_P(RingAttention, ForwardMatchesTheReference) { check_forward(GetParam()); }

TEST_P(RingAttention, BackwardMatchesTheReference) { check_backward(GetParam()); }

using dist::Sharding;

// Random cases, the same on every rank (rank 0's seed): lengths, heads, dims, masks, windows,
// sharding and dtypes drawn afresh each run, forward and backward.
TEST(RingAttentionProperty, RandomCasesMatchTheReference) {
  std::mt19937_64 draw(shared_seed() ^ 0x5eed);
  const auto pick = [&](std::int64_t low, std::int64_t high) {
    return std::uniform_int_distribution<std::int64_t>(low, high)(draw);
  };
  for (int trial = 0; trial < 8; ++trial) {
    RingCase c{pick(1, 2), pick(1, 150), 0, pick(1, 2), pick(1, 72)};
    c.heads_q = c.heads_kv * pick(1, 3);
    c.causal = pick(0, 1) == 1;
    c.window_left = pick(0, 2) == 0 ? pick(0, c.seqlen) : -1;
    c.window_right = pick(0, 2) == 0 ? pick(0, c.seqlen) : -1;
    c.sharding = pick(0, 1) == 1 ? Sharding::zigzag : Sharding::contiguous;
    c.dtype = std::array{DType::f32, DType::f32, DType::f16, DType::bf16}[pick(0, 3)];
    if (pick(0, 3) == 0) c.head_dim_v = pick(1, 72);
    SCOPED_TRACE("trial " + std::to_string(trial) + ": " + describe(c));
    check_forward(c);
    check_backward(c);
    if (::testing::Test::HasFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Grid, RingAttention,
    ::testing::Values(RingCase{1, 129, 4, 2, 64, true}, RingCase{1, 129, 4, 2, 64, false},
                      RingCase{2, 203, 2, 2, 59, true, -1, -1, Sharding::zigzag},
                      RingCase{1, 255, 4, 1, 40, false, -1, -1, Sharding::zigzag},
                      RingCase{1, 203, 2, 2, 32, true, 50, -1, Sharding::contiguous},
                      RingCase{1, 203, 2, 2, 32, false, 17, 33, Sharding::zigzag},
                      RingCase{1, 7, 2, 2, 16, true, -1, -1, Sharding::zigzag},
                      RingCase{1, 1, 2, 2, 16, true},
                      RingCase{1, 150, 4, 2, 64, true, -1, -1, Sharding::zigzag, DType::bf16},
                      RingCase{1, 150, 4, 2, 64, false, 30, 0, Sharding::contiguous, DType::f16},
                      // A value head dim of its own (MLA's 192/128, scaled down), both ways.
                      RingCase{1, 150, 4, 2, 48, true, -1, -1, Sharding::zigzag, DType::f32, 32},
                      RingCase{2, 97, 2, 1, 24, false, 20, 3, Sharding::contiguous, DType::bf16,
                               40}),
    [](const auto& info) { return describe(info.param); });

// A rank whose input is wrong stops every rank with the same Error, before any message moves.
TEST(RingAttentionErrors, OneRanksBadInputRaisesTheSameErrorEverywhere) {
  const int ranks = world_size(), rank = world_rank();
  const std::int64_t seqlen = 4 * ranks + 3;
  const std::int64_t rows = dist::shard_length(Sharding::contiguous, seqlen, ranks, rank);
  // The last rank's k has the wrong head_dim.
  const std::int64_t k_dim = rank == ranks - 1 ? 8 : 16;
  Tensor q(DType::f32, {1, rows, 2, 16}), k(DType::f32, {1, rows, 2, k_dim}),
      v(DType::f32, {1, rows, 2, k_dim}), out(DType::f32, {1, rows, 2, 16});
  q.fill(1.0f);
  out.fill(7.0f);
  std::string message;
  try {
    dist::ring_attention_forward(MPI_COMM_WORLD, q.view, k.view, v.view, out.view, nullptr);
  } catch (const Error& error) {
    message = error.what();
  }
  EXPECT_NE(message.find("ring_attention_forward: rank " + std::to_string(ranks - 1) + ": "),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("head_dim"), std::string::npos) << message;
  // Every rank got the same message: compare lengths and a checksum with rank 0's.
  std::uint64_t length = message.size(), checksum = 0;
  for (char ch : message) checksum = checksum * 31 + static_cast<unsigned char>(ch);
  std::uint64_t zero[2] = {length, checksum};
  MPI_Bcast(zero, 2, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  EXPECT_EQ(length, zero[0]);
  EXPECT_EQ(checksum, zero[1]);
  EXPECT_EQ(out.at(0, 0, 0, 0), 7.0f) << "out written despite the error";
}

// Ranks that disagree on the shape of the whole problem (a rank holding the wrong number of
// rows, other heads) get one clear Error.
TEST(RingAttentionErrors, RanksThatDisagreeAreRefused) {
  const int ranks = world_size(), rank = world_rank();
  const std::int64_t rows = rank == 0 ? 5 + ranks : 5;  // rank 0 holds too many rows
  Tensor q(DType::f32, {1, rows, 2, 16}), k(DType::f32, {1, rows, 2, 16}),
      v(DType::f32, {1, rows, 2, 16}), out(DType::f32, {1, rows, 2, 16});
  std::string message;
  try {
    dist::ring_attention_forward(MPI_COMM_WORLD, q.view, k.view, v.view, out.view, nullptr);
  } catch (const Error& error) {
    message = error.what();
  }
  if (ranks == 1) {
    EXPECT_EQ(message, "") << "one rank holds the whole sequence, whatever its length";
  } else {
    EXPECT_NE(message.find("rows (its contiguous shard of"), std::string::npos) << message;
  }
}

// A rank that stops calling: the others give up after the timeout with RingAborted, instead of
// waiting forever. It leaves messages in flight, so it runs alone, in its own mpirun
// (tests/CMakeLists.txt: dist.ring.silent_rank), and ends the job with MPI_Abort, whose code is
// the verdict of the ranks that waited (0: each gave up in time).
TEST(RingAttentionFailures, DISABLED_PeersOfASilentRankGiveUpAfterTheTimeout) {
  const int ranks = world_size(), rank = world_rank();
  ASSERT_GE(ranks, 2) << "needs two ranks";
  MPI_Comm waiting;
  MPI_Comm_split(MPI_COMM_WORLD, rank == 1 ? 1 : 0, rank, &waiting);
  const std::int64_t rows = dist::shard_length(Sharding::contiguous, 64 * ranks, ranks, rank);
  Tensor q(DType::f32, {1, rows, 2, 16}), k(DType::f32, {1, rows, 2, 16}),
      v(DType::f32, {1, rows, 2, 16}), out(DType::f32, {1, rows, 2, 16});
  q.fill(0.5f);
  k.fill(0.5f);
  v.fill(0.5f);
  if (rank == 1) {
    // Silent from here on: its peers must not hang. The job ends by their MPI_Abort.
    std::this_thread::sleep_for(std::chrono::seconds(60));
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  const auto start = std::chrono::steady_clock::now();
  std::string message;
  try {
    dist::ring_attention_forward(MPI_COMM_WORLD, q.view, k.view, v.view, out.view, nullptr, {},
                                 {.sharding = Sharding::contiguous, .timeout_seconds = 2.0});
  } catch (const dist::RingAborted& error) {
    message = error.what();
  }
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(message.find("within timeout_seconds = 2"), std::string::npos) << message;
  EXPECT_LT(waited, 10.0);
  int failed = ::testing::Test::HasFailure() ? 1 : 0, any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, waiting);
  std::printf("rank %d: gave up after %.1f s: %s\n", rank, waited, message.c_str());
  std::fflush(stdout);
  if (rank == 0) MPI_Abort(MPI_COMM_WORLD, any_failed);
  std::this_thread::sleep_for(std::chrono::seconds(60));
}

// scatter_shards then gather_shards gives the whole back, bit for bit, from either end of the
// communicator as root, each rank holding exactly its rows.
TEST(Sharding, ScatterThenGatherIsTheIdentity) {
  const int ranks = world_size(), rank = world_rank();
  std::mt19937_64 rng(shared_seed());
  for (Sharding sharding : {Sharding::contiguous, Sharding::zigzag}) {
    for (int root : {0, ranks - 1}) {
      const std::int64_t seqlen = 4 * ranks + 3;
      Tensor whole(DType::bf16, {2, seqlen, 3, 8});
      whole.fill_normal(rng);
      Tensor local(DType::bf16, {2, dist::shard_length(sharding, seqlen, ranks, rank), 3, 8});
      dist::scatter_shards(MPI_COMM_WORLD, root, whole.view, sharding, local.view);
      Tensor expected(DType::bf16, local.view.shape);
      dist::shard(whole.view, sharding, ranks, rank, expected.view);
      EXPECT_EQ(local.bytes, expected.bytes) << dist::sharding_name(sharding) << ", root " << root;
      Tensor back(DType::bf16, whole.view.shape);
      back.poison();
      dist::gather_shards(MPI_COMM_WORLD, root, local.view, sharding, back.view);
      if (rank == root) {
        EXPECT_EQ(back.bytes, whole.bytes) << dist::sharding_name(sharding) << ", root " << root;
      }
    }
  }
}

TEST(Sharding, ZigzagShardsCoverTheSequenceOnce) {
  for (int ranks = 1; ranks <= 5; ++ranks) {
    for (std::int64_t seqlen : {0, 1, 7, 10, 129}) {
      for (Sharding sharding : {Sharding::contiguous, Sharding::zigzag}) {
        std::vector<int> owners(static_cast<std::size_t>(seqlen), 0);
        std::int64_t total = 0;
        for (int rank = 0; rank < ranks; ++rank) {
          for (const dist::Segment& s : dist::shard_segments(sharding, seqlen, ranks, rank)) {
            for (std::int64_t row = s.begin; row < s.begin + s.length; ++row) {
              ++owners[static_cast<std::size_t>(row)];
            }
          }
          total += dist::shard_length(sharding, seqlen, ranks, rank);
          const std::int64_t longest = (seqlen + ranks - 1) / ranks + 1;
          EXPECT_LE(dist::shard_length(sharding, seqlen, ranks, rank), longest);
        }
        EXPECT_EQ(total, seqlen);
        for (int count : owners) EXPECT_EQ(count, 1) << dist::sharding_name(sharding);
      }
    }
  }
  // Rank r of P holds chunks r and 2P − 1 − r of 2P.
  const auto segments = dist::shard_segments(Sharding::zigzag, 16, 4, 1);
  ASSERT_EQ(segments.size(), 2u);
  EXPECT_EQ(segments[0].begin, 2);
  EXPECT_EQ(segments[1].begin, 12);
}

}  // namespace
}  // namespace flashattn::testing

namespace {

// On ranks other than 0: only the failures, named with the rank.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestStart(const ::testing::TestInfo& test) override {
    test_ = std::string(test.test_suite_name()) + "." + test.name();
  }
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "rank %d: %s failed at %s:%d\n%s\n", rank_, test_.c_str(),
                 result.file_name() ? result.file_name() : "?", result.line_number(),
                 result.message());
  }

 private:
  int rank_;
  std::string test_;
};

}  // namespace

// MPI around GoogleTest: rank 0 prints, the other ranks their failures; every rank runs every
// test (they are collective), and the exit status is the worst over the ranks.
int main(int argc, char** argv) {
  const char* level = std::getenv("FLASHATTN_TEST_MPI_THREAD");
  const int wanted = level != nullptr && std::strcmp(level, "single") == 0 ? MPI_THREAD_SINGLE
                                                                           : MPI_THREAD_SERIALIZED;
  int provided = 0;
  MPI_Init_thread(&argc, &argv, wanted, &provided);
  ::testing::InitGoogleTest(&argc, argv);
  if (flashattn::testing::world_rank() != 0) {
    ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(flashattn::testing::world_rank()));
  }
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0, any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any_failed;
}
