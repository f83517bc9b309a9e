// Google Benchmark microbenchmarks for developers (not run by the tests): the flash and standard
// paths at a few shapes, decoding against a KV cache, merging states, and the ceilings they are
// measured against, each with a FLOP/s or bytes/s counter. All use every OpenMP thread, so they
// report wall time (UseRealTime). For the verified, recorded comparison use `flashattn bench`.
//
//   ./flashattn_benchmark --benchmark_filter='Attention/flash'

#include <benchmark/benchmark.h>
#include <omp.h>

#include <array>
#include <cstdint>
#include <random>
#include <vector>

#include "cache_aligned.hpp"
#include "ceilings.hpp"
#include "flashattn/attention.hpp"
#include "flashattn/dtype.hpp"
#include "flashattn/merge.hpp"

namespace {

using flashattn::AttentionImpl;
using flashattn::DType;

// Inputs in the storage dtype: bf16 as raw bits, rounded from the same normal(0, 1) values; on
// a 64-byte boundary, as `flashattn bench` allocates them (verify.hpp says why).
struct Inputs {
  std::array<std::int64_t, 4> shape;
  DType dtype;
  flashattn::bench::CacheAlignedVector<float> f32;
  flashattn::bench::CacheAlignedVector<std::uint16_t> bf16;

  Inputs(std::array<std::int64_t, 4> shape_, DType dtype_) : shape(shape_), dtype(dtype_) {
    const auto count = static_cast<std::size_t>(shape[0] * shape[1] * shape[2] * shape[3]);
    std::mt19937 rng(7);
    std::normal_distribution<float> normal;
    f32.resize(count);
    for (float& x : f32) x = normal(rng);
    if (dtype == DType::bf16) {
      for (const float x : f32) bf16.push_back(flashattn::bf16_from_f32(x));
    }
  }
  void* data() {
    return dtype == DType::f32 ? static_cast<void*>(f32.data()) : static_cast<void*>(bf16.data());
  }
};

// Args: seqlen, head_dim, causal, heads; batch 1.
template <AttentionImpl kImpl, DType kDtype>
void BM_Attention(benchmark::State& state) {
  const std::int64_t seqlen = state.range(0), head_dim = state.range(1), heads = state.range(3);
  const std::array<std::int64_t, 4> shape = {1, seqlen, heads, head_dim};
  Inputs q(shape, kDtype), k(shape, kDtype), v(shape, kDtype), out(shape, kDtype);
  std::vector<float> lse(static_cast<std::size_t>(heads * seqlen));
  flashattn::AttentionOptions options;
  options.causal = state.range(2) != 0;
  const auto view = [&](Inputs& tensor) {
    return flashattn::contiguous_view(tensor.data(), kDtype, shape);
  };
  for (auto _ : state) {
    flashattn::attention_forward(kImpl, view(q), view(k), view(v), view(out), lse.data(), options);
    benchmark::ClobberMemory();
  }
  state.counters["FLOP/s"] = benchmark::Counter(
      flashattn::attention_flops(1, heads, seqlen, seqlen, head_dim, options),
      benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}

// The seed shape's work ([2, 32, 1024, 128] = 64 heads of 1024) and longer sequences with fewer
// heads, causal and not.
void Shapes(benchmark::internal::Benchmark* benchmark) {
  benchmark->ArgNames({"S", "D", "causal", "H"});
  for (const int causal : {1, 0}) {
    benchmark->Args({1024, 128, causal, 64});
    benchmark->Args({1024, 64, causal, 64});
    benchmark->Args({4096, 128, causal, 4});
  }
  benchmark->Args({16384, 128, 1, 1});
  benchmark->UseRealTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_Attention<AttentionImpl::flash, DType::f32>)
    ->Name("Attention/flash/f32")
    ->Apply(Shapes);
BENCHMARK(BM_Attention<AttentionImpl::standard, DType::f32>)
    ->Name("Attention/standard/f32")
    ->Apply(Shapes);
BENCHMARK(BM_Attention<AttentionImpl::flash, DType::bf16>)
    ->Name("Attention/flash/bf16")
    ->Apply(Shapes);

// Decoding: one query position of 32 heads against a KV cache, counted as bytes of K and V read
// per second. Args: Skv, KV heads; head_dim 128.
template <DType kDtype>
void BM_Decode(benchmark::State& state) {
  constexpr std::int64_t kHeads = 32, kHeadDim = 128;
  const std::int64_t seqlen_kv = state.range(0), heads_kv = state.range(1);
  const std::array<std::int64_t, 4> q_shape = {1, 1, kHeads, kHeadDim};
  const std::array<std::int64_t, 4> kv_shape = {1, seqlen_kv, heads_kv, kHeadDim};
  Inputs q(q_shape, kDtype), k(kv_shape, kDtype), v(kv_shape, kDtype), out(q_shape, kDtype);
  const flashattn::AttentionOptions options;
  for (auto _ : state) {
    flashattn::flash_attention_forward(flashattn::contiguous_view(q.data(), kDtype, q_shape),
                                       flashattn::contiguous_view(k.data(), kDtype, kv_shape),
                                       flashattn::contiguous_view(v.data(), kDtype, kv_shape),
                                       flashattn::contiguous_view(out.data(), kDtype, q_shape),
                                       nullptr, options);
    benchmark::ClobberMemory();
  }
  state.counters["bytes/s"] = benchmark::Counter(
      2.0 * static_cast<double>(seqlen_kv * heads_kv * kHeadDim * flashattn::dtype_size(kDtype)),
      benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}

// GQA groups of 4 (the bench's decode cases), of 1 (MHA) and of 16.
void DecodeShapes(benchmark::internal::Benchmark* benchmark) {
  benchmark->ArgNames({"Skv", "Hkv"});
  for (const int heads_kv : {8, 32, 2}) benchmark->Args({16384, heads_kv});
  benchmark->UseRealTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_Decode<DType::f32>)->Name("Decode/flash/f32")->Apply(DecodeShapes);
BENCHMARK(BM_Decode<DType::bf16>)->Name("Decode/flash/bf16")->Apply(DecodeShapes);

// merge_attention_states of two fp32 states into a third of kDtype, in bytes moved per second
// (both states and lses read, the output and its lse written), against BM_MemoryCopy: the merge
// reads and writes each byte once. Args: seqlen, heads; batch 1, head_dim 128.
template <DType kDtype>
void BM_MergeStates(benchmark::State& state) {
  const std::array<std::int64_t, 4> shape = {1, state.range(0), state.range(1), 128};
  Inputs out_a(shape, DType::f32), out_b(shape, DType::f32), out(shape, kDtype);
  const std::int64_t rows = shape[1] * shape[2];
  std::vector<float> lse_a(static_cast<std::size_t>(rows), 0.5f), lse(lse_a.size());
  std::vector<float> lse_b(lse_a.size(), -0.25f);
  for (auto _ : state) {
    flashattn::merge_attention_states(
        flashattn::contiguous_view(out_a.data(), DType::f32, shape), lse_a.data(),
        flashattn::contiguous_view(out_b.data(), DType::f32, shape), lse_b.data(),
        flashattn::contiguous_view(out.data(), kDtype, shape), lse.data());
    benchmark::ClobberMemory();
  }
  const double elements = static_cast<double>(rows * shape[3]);
  state.counters["bytes/s"] = benchmark::Counter(
      elements * (8.0 + static_cast<double>(flashattn::dtype_size(kDtype))) + 12.0 * rows,
      benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_MergeStates<DType::f32>)
    ->Name("MergeStates/f32")
    ->ArgNames({"S", "H"})
    ->Args({16384, 32})
    ->Args({524288, 1})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MergeStates<DType::bf16>)
    ->Name("MergeStates/bf16")
    ->ArgNames({"S", "H"})
    ->Args({16384, 32})
    ->Args({524288, 1})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// One unit of a ceiling workload per iteration, counted as FLOP/s or bytes/s.
template <class Workload, class... Args>
void RunCeiling(benchmark::State& state, const char* counter, std::int64_t units, Args... args) {
  Workload workload(omp_get_max_threads(), args...);
  for (auto _ : state) workload.run(units);
  state.counters[counter] = benchmark::Counter(
      workload.work_per_unit() * static_cast<double>(units),
      benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}

void BM_FmaPeak(benchmark::State& state) {
  RunCeiling<flashattn::bench::FmaPeak>(state, "FLOP/s", 64);
  state.SetLabel(flashattn::bench::FmaPeak::target());
}
BENCHMARK(BM_FmaPeak)->UseRealTime();

void BM_Bf16DotPeak(benchmark::State& state) {
  if (!flashattn::bench::Bf16DotPeak::supported()) {
    state.SkipWithError("this CPU has no AVX512-BF16");
    return;
  }
  RunCeiling<flashattn::bench::Bf16DotPeak>(state, "FLOP/s", 64);
}
BENCHMARK(BM_Bf16DotPeak)->UseRealTime();

// Args: seqlen, head_dim of the attention-shaped sgemm pair on every thread.
void BM_SgemmPairs(benchmark::State& state) {
  RunCeiling<flashattn::bench::SgemmPairs>(state, "FLOP/s", 1, state.range(0), state.range(1));
}
BENCHMARK(BM_SgemmPairs)
    ->ArgNames({"S", "D"})
    ->Args({1024, 64})
    ->Args({1024, 128})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

void BM_MemoryCopy(benchmark::State& state) {
  RunCeiling<flashattn::bench::MemoryCopy>(state, "bytes/s", 1,
                                           flashattn::bench::default_copy_bytes());
}
BENCHMARK(BM_MemoryCopy)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
