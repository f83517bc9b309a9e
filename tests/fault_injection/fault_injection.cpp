// Fault injection: every heap allocation of every public entry point made to fail, one at a time.
//
// This executable replaces the global operator new and delete (the C++ way to hook every
// allocation of a process, the library's and its OpenMP workers' included, with no build option
// in the library itself). For each entry point the test first runs the call once to count its
// allocations N and keep its results, then for n = 1..N runs it again with the n-th allocation
// failing (std::bad_alloc from operator new, wherever it happens: the calling thread or a worker).
// Every such call must raise flashattn::Error saying "out of memory" (never std::bad_alloc,
// never a crash), and the next call, with nothing failing, must give the same results bit for
// bit. The outputs are poisoned before each call, so a result left from before cannot pass.
//
// Built a second time with FLASHATTN_FAULT_INJECTION_RING (and MPI) for ring attention, in one
// process without mpirun: a ring of one rank moves no message, so the sweep reaches every other
// allocation of the ring's calls (the plan, the shards, the partial states, the merges). With
// more ranks a failing allocation on one rank is that rank's RingAborted, and its peers' after
// their timeout (tests/dist covers that path); which allocation fails would differ from rank to
// rank, so it is not swept.

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <new>
#include <string>
#include <vector>

#include "flashattn/flashattn.hpp"
#ifdef FLASHATTN_FAULT_INJECTION_RING
#include <mpi.h>

#include "flashattn/dist.hpp"
#endif

namespace {

// -1: nothing fails. n >= 0: the allocation that finds it at 0 fails, later ones do not.
std::atomic<std::int64_t> countdown{-1};
std::atomic<std::int64_t> allocations{0};

void* allocate(std::size_t bytes, std::size_t alignment) {
  allocations.fetch_add(1, std::memory_order_relaxed);
  if (countdown.load(std::memory_order_relaxed) >= 0 &&
      countdown.fetch_sub(1, std::memory_order_relaxed) == 0) {
    return nullptr;
  }
  if (bytes == 0) bytes = 1;
  if (alignment <= alignof(std::max_align_t)) return std::malloc(bytes);
  return std::aligned_alloc(alignment, (bytes + alignment - 1) / alignment * alignment);
}

void* allocate_or_throw(std::size_t bytes, std::size_t alignment) {
  void* p = allocate(bytes, alignment);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

}  // namespace

void* operator new(std::size_t n) { return allocate_or_throw(n, 0); }
void* operator new[](std::size_t n) { return allocate_or_throw(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) {
  return allocate_or_throw(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a) {
  return allocate_or_throw(n, static_cast<std::size_t>(a));
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return allocate(n, 0); }
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept { return allocate(n, 0); }
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return allocate(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return allocate(n, static_cast<std::size_t>(a));
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }

namespace flashattn {
namespace {

// A buffer of floats the calls read or write; outputs are poisoned with NaN before each call.
struct Buffer {
  std::vector<float> data;
  explicit Buffer(std::size_t n, std::uint32_t seed = 0) : data(n) {
    std::uint32_t state = seed * 2654435761u + 1u;
    for (float& x : data) {
      state = state * 1664525u + 1013904223u;
      x = static_cast<float>(state >> 8) / 16777216.0f - 0.5f;
    }
  }
  void poison() { std::fill(data.begin(), data.end(), std::nanf("")); }
  TensorView view(std::array<std::int64_t, 4> shape) { return contiguous_view(data.data(), shape); }
  bool same_bits(const std::vector<float>& other) const {
    return std::memcmp(data.data(), other.data(), data.size() * sizeof(float)) == 0;
  }
};

// One entry point on fixed inputs: run() makes the call, outputs() the buffers it writes.
struct Case {
  std::function<void()> run;
  std::vector<Buffer*> outputs;
};

void sweep(const Case& c) {
  for (Buffer* out : c.outputs) out->poison();
  const std::int64_t before = allocations.load();
  c.run();
  const std::int64_t count = allocations.load() - before;
  ASSERT_GT(count, 0) << "the call allocated nothing: nothing to inject";
  static int sweeps = 0;  // one property per sweep in the XML report
  ::testing::Test::RecordProperty("allocations_" + std::to_string(++sweeps), std::to_string(count));
  std::vector<std::vector<float>> expected;
  for (Buffer* out : c.outputs) expected.push_back(out->data);

  for (std::int64_t n = 0; n < count; ++n) {
    for (Buffer* out : c.outputs) out->poison();
    std::string outcome = "returned normally";  // allocated before the countdown starts
    countdown.store(n);
    try {
      c.run();
    } catch (const Error& e) {
      outcome = std::string("Error: ") + e.what();
    } catch (const std::bad_alloc&) {
      outcome = "std::bad_alloc escaped";
    } catch (const std::exception& e) {
      outcome = std::string("another exception: ") + e.what();
    }
    const bool failed_one = countdown.load() < 0;
    countdown.store(-1);
    // A call may allocate less this time (a worker that found no task), so the n-th allocation
    // may not come: then the call must simply succeed.
    if (failed_one) {
      EXPECT_NE(outcome.find("out of memory"), std::string::npos)
          << "allocation " << n + 1 << " of " << count << " failed: " << outcome;
    } else {
      EXPECT_EQ(outcome, "returned normally") << "allocation " << n + 1 << " never came";
    }
    for (Buffer* out : c.outputs) out->poison();
    ASSERT_NO_THROW(c.run()) << "the call after allocation " << n + 1 << " failed";
    for (std::size_t i = 0; i < c.outputs.size(); ++i) {
      EXPECT_TRUE(c.outputs[i]->same_bits(expected[i]))
          << "output " << i << " differs after allocation " << n + 1 << " failed";
    }
  }
}

constexpr std::int64_t B = 2, Sq = 37, Skv = 70, Hq = 4, Hkv = 2, D = 32;

struct Inputs {
  Buffer q{B * Sq * Hq * D, 1}, k{B * Skv * Hkv * D, 2}, v{B * Skv * Hkv * D, 3};
  Buffer out{B * Sq * Hq * D}, lse{B * Hq * Sq};
  ConstTensorView qv() { return q.view({B, Sq, Hq, D}); }
  ConstTensorView kv() { return k.view({B, Skv, Hkv, D}); }
  ConstTensorView vv() { return v.view({B, Skv, Hkv, D}); }
};

AttentionOptions causal_two_threads() {
  AttentionOptions options;
  options.causal = true;
  options.num_threads = 2;
  return options;
}

class FaultInjection : public ::testing::TestWithParam<AttentionImpl> {};

TEST_P(FaultInjection, Forward) {
  Inputs in;
  const AttentionImpl impl = GetParam();
  sweep({[&] {
           attention_forward(impl, in.qv(), in.kv(), in.vv(), in.out.view({B, Sq, Hq, D}),
                             in.lse.data.data(), causal_two_threads());
         },
         {&in.out, &in.lse}});
}

TEST_P(FaultInjection, ForwardWithBiasAndSinks) {
  Inputs in;
  Buffer bias(Sq * Skv, 4), sinks(Hq, 5);
  AttentionOptions options = causal_two_threads();
  options.bias = bias.view({1, 1, Sq, Skv});
  options.sinks = std::span<const float>(sinks.data);
  const AttentionImpl impl = GetParam();
  sweep({[&] {
           attention_forward(impl, in.qv(), in.kv(), in.vv(), in.out.view({B, Sq, Hq, D}),
                             in.lse.data.data(), options);
         },
         {&in.out, &in.lse}});
}

TEST_P(FaultInjection, Backward) {
  Inputs in;
  Buffer dout(B * Sq * Hq * D, 6), dq(B * Sq * Hq * D), dk(B * Skv * Hkv * D),
      dv(B * Skv * Hkv * D), bias(Sq * Skv, 7), dbias(Sq * Skv);
  AttentionOptions options = causal_two_threads();
  options.bias = bias.view({1, 1, Sq, Skv});
  attention_forward(AttentionImpl::flash, in.qv(), in.kv(), in.vv(), in.out.view({B, Sq, Hq, D}),
                    in.lse.data.data(), options);
  const AttentionImpl impl = GetParam();
  sweep({[&] {
           ModifierGradients grads;
           grads.dbias = dbias.view({1, 1, Sq, Skv});
           attention_backward(impl, dout.view({B, Sq, Hq, D}), in.qv(), in.kv(), in.vv(),
                              in.out.view({B, Sq, Hq, D}), in.lse.data.data(),
                              dq.view({B, Sq, Hq, D}), dk.view({B, Skv, Hkv, D}),
                              dv.view({B, Skv, Hkv, D}), options, grads);
         },
         {&dq, &dk, &dv, &dbias}});
}

TEST_P(FaultInjection, Varlen) {
  const std::vector<std::int32_t> cu_q = {0, 5, 5, 37}, cu_k = {0, 9, 20, 70};
  Buffer q(37 * Hq * D, 8), k(70 * Hkv * D, 9), v(70 * Hkv * D, 10), out(37 * Hq * D), lse(Hq * 37),
      dout(37 * Hq * D, 11), dq(37 * Hq * D), dk(70 * Hkv * D), dv(70 * Hkv * D);
  const AttentionImpl impl = GetParam();
  const AttentionOptions options = causal_two_threads();
  sweep({[&] {
           varlen_attention_forward(impl, q.view({1, 37, Hq, D}), k.view({1, 70, Hkv, D}),
                                    v.view({1, 70, Hkv, D}), cu_q.data(), cu_k.data(), 3,
                                    out.view({1, 37, Hq, D}), lse.data.data(), options);
         },
         {&out, &lse}});
  // The same forward over K and V in shuffled pages of 7 rows (9, 11 and 50 keys): sequence 0
  // reads them in place on the flash path, sequence 2 (32 query rows) gathers them.
  const std::vector<std::int32_t> table = {3,  7,  -1, -1, -1, -1, -1, -1, 1,  10, -1, -1,
                                           -1, -1, -1, -1, 0,  5,  9,  2,  11, 4,  8,  6};
  Buffer k_pages(12 * 7 * Hkv * D, 9), v_pages(12 * 7 * Hkv * D, 10);
  sweep({[&] {
           const PagedKVView paged{k_pages.view({12, 7, Hkv, D}), v_pages.view({12, 7, Hkv, D}),
                                   table.data(), 8};
           varlen_attention_forward(impl, q.view({1, 37, Hq, D}), paged, cu_q.data(), cu_k.data(),
                                    3, out.view({1, 37, Hq, D}), lse.data.data(), options);
         },
         {&out, &lse}});
  sweep({[&] {
           varlen_attention_backward(impl, dout.view({1, 37, Hq, D}), q.view({1, 37, Hq, D}),
                                     k.view({1, 70, Hkv, D}), v.view({1, 70, Hkv, D}),
                                     out.view({1, 37, Hq, D}), lse.data.data(), cu_q.data(),
                                     cu_k.data(), 3, dq.view({1, 37, Hq, D}),
                                     dk.view({1, 70, Hkv, D}), dv.view({1, 70, Hkv, D}), options);
         },
         {&dq, &dk, &dv}});
}

TEST_P(FaultInjection, PagedKVCacheAppend) {
  // Three sequences in pages of 7 rows, shuffled; each step appends 2 rows and attends with
  // them. The cache is written in place, so every call starts from a fresh copy of it.
  constexpr std::int64_t pages = 12, page = 7, per_sequence = 4, Snew = 2, Sq1 = 2;
  const std::vector<std::int32_t> table = {3, 7, 1, 10, 0, 5, 9, 2, 11, 4, 8, 6};
  const std::vector<std::int32_t> lengths = {0, 13, 25};
  Buffer k_start(pages * page * Hkv * D, 12), v_start(pages * page * Hkv * D, 13);
  Buffer k_cache(k_start.data.size()), v_cache(v_start.data.size());
  Buffer q(3 * Sq1 * Hq * D, 14), k_new(3 * Snew * Hkv * D, 15), v_new(3 * Snew * Hkv * D, 16);
  Buffer out(3 * Sq1 * Hq * D), lse(3 * Hq * Sq1);
  const AttentionImpl impl = GetParam();
  sweep({[&] {
           k_cache.data = k_start.data;
           v_cache.data = v_start.data;
           const KVCacheView cache{k_cache.view({pages, page, Hkv, D}),
                                   v_cache.view({pages, page, Hkv, D}), table.data(), per_sequence};
           kvcache_attention_forward(q.view({3, Sq1, Hq, D}), cache, lengths.data(),
                                     {k_new.view({3, Snew, Hkv, D}), v_new.view({3, Snew, Hkv, D})},
                                     out.view({3, Sq1, Hq, D}), lse.data.data(),
                                     causal_two_threads(), impl);
         },
         {&out, &lse, &k_cache, &v_cache}});
}

INSTANTIATE_TEST_SUITE_P(AllPaths, FaultInjection,
                         ::testing::Values(AttentionImpl::flash, AttentionImpl::standard,
                                           AttentionImpl::reference),
                         [](const auto& info) { return std::string(impl_name(info.param)); });

TEST(FaultInjectionMerge, MergeAttentionStates) {
  Buffer out_a(B * Sq * Hq * D, 17), out_b(B * Sq * Hq * D, 18), lse_a(B * Hq * Sq, 19),
      lse_b(B * Hq * Sq, 20), out(B * Sq * Hq * D), lse(B * Hq * Sq);
  sweep({[&] {
           merge_attention_states(out_a.view({B, Sq, Hq, D}), lse_a.data.data(),
                                  out_b.view({B, Sq, Hq, D}), lse_b.data.data(),
                                  out.view({B, Sq, Hq, D}), lse.data.data(), 2);
         },
         {&out, &lse}});
}

TEST(FaultInjectionLayer, MultiHeadAttentionForwardAndBackward) {
  MultiHeadAttention layer({64, 4, 2, true});
  layer.init_random(3);
  Buffer x(2 * 19 * 64, 21), y(2 * 19 * 64), dy(2 * 19 * 64, 22);
  MultiHeadAttention::Activations saved;
  MultiHeadAttention::Gradients grads;
  AttentionOptions options = causal_two_threads();
  sweep({[&] { layer.forward(x.data.data(), 2, 19, y.data.data(), options); }, {&y}});
  layer.forward(x.data.data(), 2, 19, y.data.data(), saved, options);
  Buffer dx(2 * 19 * 64);
  sweep({[&] {
           layer.backward(dy.data.data(), saved, grads);
           dx.data = grads.dx;
         },
         {&dx}});
}

#ifdef FLASHATTN_FAULT_INJECTION_RING
// MPI for the whole process, initialized when the tests start (not when ctest lists them).
class MpiEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
  }
  void TearDown() override { MPI_Finalize(); }
};
const ::testing::Environment* const mpi_environment =
    ::testing::AddGlobalTestEnvironment(new MpiEnvironment);

TEST(FaultInjectionRing, ForwardAndBackwardOnOneRank) {
  constexpr std::int64_t S = 38;  // even: zig-zag cuts one rank's sequence in two segments
  Buffer q(B * S * Hq * D, 23), k(B * S * Hkv * D, 24), v(B * S * Hkv * D, 25), out(B * S * Hq * D),
      lse(B * Hq * S), dout(B * S * Hq * D, 26), dq(B * S * Hq * D), dk(B * S * Hkv * D),
      dv(B * S * Hkv * D);
  const AttentionOptions options = causal_two_threads();
  dist::RingOptions ring;
  ring.sharding = dist::Sharding::zigzag;
  sweep({[&] {
           dist::ring_attention_forward(MPI_COMM_WORLD, q.view({B, S, Hq, D}),
                                        k.view({B, S, Hkv, D}), v.view({B, S, Hkv, D}),
                                        out.view({B, S, Hq, D}), lse.data.data(), options, ring);
         },
         {&out, &lse}});
  sweep({[&] {
           dist::ring_attention_backward(
               MPI_COMM_WORLD, dout.view({B, S, Hq, D}), q.view({B, S, Hq, D}),
               k.view({B, S, Hkv, D}), v.view({B, S, Hkv, D}), out.view({B, S, Hq, D}),
               lse.data.data(), dq.view({B, S, Hq, D}), dk.view({B, S, Hkv, D}),
               dv.view({B, S, Hkv, D}), options, ring);
         },
         {&dq, &dk, &dv}});
}
#endif

}  // namespace
}  // namespace flashattn
