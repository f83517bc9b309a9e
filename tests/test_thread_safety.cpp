// Concurrent calls from many user threads, each on its own outputs: the library keeps no
// mutable global state after initialization, so every call must give the result it gives alone.
// Run under ThreadSanitizer in CI (the `tsan` preset), where a data race fails the test.

#include <gtest/gtest.h>
#include <omp.h>

#include <latch>
#include <sstream>
#include <string>
#include <thread>

#include "test_support.hpp"

namespace flashattn::testing {
namespace {

struct Call {
  std::int64_t batch, seqlen_q, seqlen_kv, heads_q, heads_kv, head_dim;
};

constexpr Call kShapes[] = {{1, 37, 53, 4, 2, 32},  {2, 64, 64, 2, 2, 16},  {1, 1, 129, 8, 1, 64},
                            {3, 17, 9, 3, 3, 8},    {1, 130, 70, 2, 1, 40}, {2, 5, 300, 4, 4, 24},
                            {1, 200, 200, 1, 1, 16}};
constexpr AttentionImpl kImpls[] = {AttentionImpl::flash, AttentionImpl::standard,
                                    AttentionImpl::reference};
constexpr DType kDtypes[] = {DType::f32, DType::f16, DType::bf16};

// One call and its check against the fp64 reference; an empty string when it passes. The
// bound is the first-order forward error bound of test_attention_vs_reference.cpp.
std::string checked_call(int user_thread, int call_index) {
  const int n = user_thread * 5 + call_index;
  const Call& c = kShapes[n % std::size(kShapes)];
  const AttentionImpl impl = kImpls[(user_thread + call_index) % 3];
  const DType dtype = kDtypes[n % 3];
  AttentionOptions options;
  options.causal = n % 2 == 0;
  if (n % 4 == 1) options.window_left = 7;
  options.num_threads = 1 + n % 3;

  std::mt19937_64 rng(test_seed() ^ static_cast<std::uint64_t>(n));
  const std::array<std::int64_t, 4> q_shape{c.batch, c.seqlen_q, c.heads_q, c.head_dim};
  const std::array<std::int64_t, 4> kv_shape{c.batch, c.seqlen_kv, c.heads_kv, c.head_dim};
  Tensor q(dtype, q_shape), k(dtype, kv_shape), v(dtype, kv_shape), out(dtype, q_shape);
  q.fill_normal(rng);
  k.fill_normal(rng);
  v.fill_normal(rng);
  out.poison();
  std::vector<float> lse(static_cast<std::size_t>(c.batch * c.heads_q * c.seqlen_q), NAN);
  attention_forward(impl, q.view, k.view, v.view, out.view, lse.data(), options);
  const ReferenceResult ref = reference(q, k, v, options);

  double max_q = 0, max_k = 0, max_v = 0;
  for (auto [tensor, largest] : {std::pair{&q, &max_q}, {&k, &max_k}, {&v, &max_v}}) {
    tensor->for_each_index([&, t = tensor, m = largest](auto a, auto b, auto h, auto d) {
      *m = std::max<double>(*m, std::abs(t->at(a, b, h, d)));
    });
  }
  const double u32 = unit_roundoff(DType::f32), u_out = unit_roundoff(dtype);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  const double mixing = u32 * (4.0 * scale * c.head_dim * max_q * max_k + 2.0 * c.seqlen_kv + 16);

  std::ostringstream failure;
  std::int64_t flat = 0;
  out.for_each_index([&](auto a, auto b, auto h, auto d) {
    const double got = out.at(a, b, h, d), want = ref.out[flat++];
    if (!(std::abs(got - want) <=
          mixing * max_v + probability_rounding_bound(dtype, max_v) + u_out * std::abs(want)) &&
        failure.tellp() == 0) {
      failure << "out[" << flat - 1 << "] = " << got << ", reference " << want;
    }
  });
  for (std::size_t i = 0; i < lse.size(); ++i) {
    const bool both_minus_inf = std::isinf(ref.lse[i]) && lse[i] == ref.lse[i];
    if (!both_minus_inf &&
        !(std::abs(lse[i] - ref.lse[i]) <= mixing + 4 * u32 * std::abs(ref.lse[i])) &&
        failure.tellp() == 0) {
      failure << "lse[" << i << "] = " << lse[i] << ", reference " << ref.lse[i];
    }
  }
  if (failure.tellp() == 0) return {};
  return std::string(impl_name(impl)) + " " + dtype_name(dtype) + " call " +
         std::to_string(call_index) + ": " + failure.str();
}

// Eight user threads, started together, each making five calls that rotate through shapes,
// paths, dtypes, masks and OpenMP thread counts. Each thread also sets its own OpenMP thread
// count first and checks that no call changes it: the standard path adjusts the calling
// thread's count for OpenBLAS and must put it back, and that count is per thread.
TEST(ThreadSafety, EightUserThreadsCallingConcurrentlyGetCorrectResults) {
  constexpr int kUserThreads = 8, kCallsPerThread = 5;
  std::vector<std::string> failures(kUserThreads);
  std::latch start(kUserThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kUserThreads; ++t) {
    threads.emplace_back([&, t] {
      omp_set_num_threads(1 + t % 4);
      start.arrive_and_wait();
      for (int call = 0; call < kCallsPerThread && failures[t].empty(); ++call) {
        try {
          failures[t] = checked_call(t, call);
        } catch (const std::exception& error) {
          failures[t] = std::string("call ") + std::to_string(call) + " threw " + error.what();
        }
        if (failures[t].empty() && omp_get_max_threads() != 1 + t % 4) {
          failures[t] = "call " + std::to_string(call) + " changed this thread's OpenMP count";
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kUserThreads; ++t) {
    EXPECT_TRUE(failures[t].empty())
        << "user thread " << t << ": " << failures[t] << " (seed " << test_seed() << ")";
  }
}

// One const MultiHeadAttention shared by four threads: forward keeps no per-call state in the
// layer, so concurrent calls give the same outputs as one call alone.
TEST(ThreadSafety, SharedLayerForwardFromFourThreads) {
  MultiHeadAttention layer({64, 4, 2, true});
  layer.init_random(7);
  const std::int64_t batch = 2, seqlen = 33;
  std::vector<float> x(static_cast<std::size_t>(batch * seqlen * 64));
  std::mt19937_64 rng(test_seed());
  std::normal_distribution<float> normal;
  for (float& value : x) value = normal(rng);
  AttentionOptions options;
  options.causal = true;
  options.num_threads = 2;

  std::vector<float> alone(x.size());
  layer.forward(x.data(), batch, seqlen, alone.data(), options);
  std::vector<std::vector<float>> outputs(4, std::vector<float>(x.size(), NAN));
  std::latch start(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      start.arrive_and_wait();
      layer.forward(x.data(), batch, seqlen, outputs[t].data(), options,
                    t % 2 == 0 ? AttentionImpl::flash : AttentionImpl::standard);
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < 4; ++t) {
    for (std::size_t i = 0; i < x.size(); ++i) {
      ASSERT_NEAR(outputs[t][i], alone[i], 1e-5 * (1 + std::abs(alone[i])))
          << "thread " << t << " element " << i;
    }
  }
}

}  // namespace
}  // namespace flashattn::testing
