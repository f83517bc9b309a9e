// The peak loops are compiled once per Highway target (foreach_target re-includes this file) and
// dispatched at run time, like the library's tile kernels; the rest is compiled once.

// Highway's order: foreach_target.h first, then highway.h.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ceilings.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
// clang-format on

#include "ceilings.hpp"

HWY_BEFORE_NAMESPACE();
namespace flashattn::bench {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// FMA latency (4 cycles) times FMA ports (2) is 8 chains in flight; more hide any scheduling
// slack. AVX-512 has 32 vector registers, narrower targets 16 (2 of them hold the constants).
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
constexpr int kFmaChains = 16;
#else
constexpr int kFmaChains = 12;
#endif

// acc = acc·a + b converges to b / (1 - a) = 1: no overflow, no subnormals. The sum is returned
// so that the compiler cannot drop the loop.
float FmaChains(std::int64_t iterations) {
  const hn::ScalableTag<float> d;
  const auto a = hn::Set(d, 0.999f);
  const auto b = hn::Set(d, 0.001f);
  decltype(hn::Zero(d)) acc[kFmaChains];
  for (int c = 0; c < kFmaChains; ++c) acc[c] = hn::Set(d, static_cast<float>(c));
  for (std::int64_t i = 0; i < iterations; ++i) {
    for (int c = 0; c < kFmaChains; ++c) acc[c] = hn::MulAdd(acc[c], a, b);
  }
  for (int c = 1; c < kFmaChains; ++c) acc[0] = hn::Add(acc[0], acc[c]);
  return hn::GetLane(hn::SumOfLanes(d, acc[0]));
}

std::int64_t FmaFlopsPerIteration() {
  return 2 * kFmaChains * static_cast<std::int64_t>(hn::Lanes(hn::ScalableTag<float>()));
}

const char* FmaTargetName() { return hwy::TargetName(HWY_TARGET); }

// The XOR of `count` words, 4 vectors per step so that the loads, not the XOR chains, set the
// pace: the caller's bytes, each read once.
std::uint64_t XorWords(const std::uint64_t* HWY_RESTRICT words, std::int64_t count) {
  const hn::ScalableTag<std::uint64_t> d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  auto acc0 = hn::Zero(d), acc1 = hn::Zero(d), acc2 = hn::Zero(d), acc3 = hn::Zero(d);
  std::int64_t i = 0;
  for (; i + 4 * N <= count; i += 4 * N) {
    acc0 = hn::Xor(acc0, hn::LoadU(d, words + i));
    acc1 = hn::Xor(acc1, hn::LoadU(d, words + i + N));
    acc2 = hn::Xor(acc2, hn::LoadU(d, words + i + 2 * N));
    acc3 = hn::Xor(acc3, hn::LoadU(d, words + i + 3 * N));
  }
  for (; i + N <= count; i += N) acc0 = hn::Xor(acc0, hn::LoadU(d, words + i));
  const auto acc = hn::Xor(hn::Xor(acc0, acc1), hn::Xor(acc2, acc3));
  std::uint64_t sum = 0;
  for (std::int64_t lane = 0; lane < N; ++lane) sum ^= hn::ExtractLane(acc, lane);
  for (; i < count; ++i) sum ^= words[i];
  return sum;
}

}  // namespace HWY_NAMESPACE
}  // namespace flashattn::bench
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

#include <cblas.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <random>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FLASHATTN_HAVE_BF16_DOT 1
#endif

namespace flashattn::bench {

HWY_EXPORT(FmaChains);
HWY_EXPORT(FmaFlopsPerIteration);
HWY_EXPORT(FmaTargetName);
HWY_EXPORT(XorWords);

namespace {

// Loop iterations per unit of the peak workloads: a unit of ~0.5 ms, much longer than waking the
// threads of a parallel region, so that timing even one unit measures the loop.
constexpr std::int64_t kIterationsPerUnit = std::int64_t{1} << 16;

double seconds_of(Workload& workload, std::int64_t count) {
  const auto start = std::chrono::steady_clock::now();
  workload.run(count);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Each thread's half-open share [begin, end) of `total` items.
std::pair<std::size_t, std::size_t> share(std::size_t total, int thread, int threads) {
  const std::size_t per = total / static_cast<std::size_t>(threads);
  const std::size_t extra = total % static_cast<std::size_t>(threads);
  const auto t = static_cast<std::size_t>(thread);
  const std::size_t begin = t * per + std::min(t, extra);
  return {begin, begin + per + (t < extra ? 1 : 0)};
}

#ifdef FLASHATTN_HAVE_BF16_DOT
constexpr int kBf16Chains = 16;

// As FmaChains, with vdpbf16ps; 0x3a83 is bf16 0.001, so each lane grows by 2e-6 per step.
__attribute__((target("avx512f,avx512bf16"))) float Bf16DotChains(std::int64_t iterations) {
  // A C-style cast: the vector type behind __m512bh differs between compilers.
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3a83);
  __m512 acc[kBf16Chains];
  for (int c = 0; c < kBf16Chains; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(c));
  for (std::int64_t i = 0; i < iterations; ++i) {
    for (int c = 0; c < kBf16Chains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, a);
  }
  for (int c = 1; c < kBf16Chains; ++c) acc[0] = _mm512_add_ps(acc[0], acc[c]);
  // Not _mm512_reduce_add_ps: g++ 12 warns inside it (-Wuninitialized).
  float lanes[16];
  _mm512_storeu_ps(lanes, acc[0]);
  float sum = 0.0f;
  for (const float lane : lanes) sum += lane;
  return sum;
}

constexpr int kAmxAccumulators = 4;
constexpr std::int64_t kAmxStepsPerUnit = 1 << 12;

// The 64-byte LDTILECFG operand: palette 1, every tile 16 rows of 64 bytes.
struct AmxTileConfig {
  std::uint8_t palette = 1;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t bytes_per_row[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  std::uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// tmm0..3 += tmm4·tmm6, tmm4·tmm7, tmm5·tmm6, tmm5·tmm7: four independent accumulators, as the
// library's kernel uses them. Operands of bf16 0.001; returns one accumulator element.
__attribute__((target("amx-tile,amx-bf16"))) float AmxChains(std::int64_t steps) {
  const AmxTileConfig config;
  alignas(64) std::uint16_t operand[16 * 32];
  std::fill(std::begin(operand), std::end(operand), std::uint16_t{0x3a83});
  alignas(64) float result[16 * 16];
  _tile_loadconfig(&config);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, operand, 64);
  _tile_loadd(5, operand, 64);
  _tile_loadd(6, operand, 64);
  _tile_loadd(7, operand, 64);
  for (std::int64_t i = 0; i < steps; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, result, 64);
  _tile_release();
  return result[0];
}
#endif

}  // namespace

double best_rate(Workload& workload, double seconds, int trials) {
  // Double the count until a run at the fastest rate seen so far would take an eighth of the
  // target, then size it to the target. The fastest rate, so that one run slowed down by another
  // process (or by waking the threads) cannot stop the calibration early.
  std::int64_t count = 1;
  double units_per_second = 0.0;
  while (true) {
    units_per_second =
        std::max(units_per_second, static_cast<double>(count) / seconds_of(workload, count));
    if (static_cast<double>(count) / units_per_second >= seconds / 8 ||
        count >= (std::int64_t{1} << 40)) {
      break;
    }
    count *= 2;
  }
  count = std::max<std::int64_t>(1, static_cast<std::int64_t>(units_per_second * seconds));
  double best = 0.0;
  for (int trial = 0; trial < trials; ++trial) {
    const double trial_seconds = seconds_of(workload, count);
    best = std::max(best, workload.work_per_unit() * static_cast<double>(count) / trial_seconds);
  }
  return best;
}

FmaPeak::FmaPeak(int threads) : threads_(threads) {}

void FmaPeak::run(std::int64_t count) {
  float sum = 0.0f;
#pragma omp parallel num_threads(threads_) reduction(+ : sum)
  sum += HWY_DYNAMIC_DISPATCH(FmaChains)(count * kIterationsPerUnit);
  sink_ += sum;
}

double FmaPeak::work_per_unit() const {
  return static_cast<double>(HWY_DYNAMIC_DISPATCH(FmaFlopsPerIteration)()) * kIterationsPerUnit *
         threads_;
}

std::string FmaPeak::target() { return HWY_DYNAMIC_DISPATCH(FmaTargetName)(); }

Bf16DotPeak::Bf16DotPeak(int threads) : threads_(threads) {}

bool Bf16DotPeak::supported() {
#ifdef FLASHATTN_HAVE_BF16_DOT
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

void Bf16DotPeak::run([[maybe_unused]] std::int64_t count) {
#ifdef FLASHATTN_HAVE_BF16_DOT
  float sum = 0.0f;
#pragma omp parallel num_threads(threads_) reduction(+ : sum)
  sum += Bf16DotChains(count * kIterationsPerUnit);
  sink_ += sum;
#endif
}

AmxPeak::AmxPeak(int threads) : threads_(threads) {}

void AmxPeak::run([[maybe_unused]] std::int64_t count) {
#ifdef FLASHATTN_HAVE_BF16_DOT
  float sum = 0.0f;
#pragma omp parallel num_threads(threads_) reduction(+ : sum)
  sum += AmxChains(count * kAmxStepsPerUnit);
  sink_ += sum;
#endif
}

double AmxPeak::work_per_unit() const {
  // 16 x 16 fp32 elements, 32 products and 32 additions each, per instruction.
#ifdef FLASHATTN_HAVE_BF16_DOT
  return 16.0 * 16.0 * 64.0 * kAmxAccumulators * kAmxStepsPerUnit * threads_;
#else
  return 0.0;
#endif
}

double Bf16DotPeak::work_per_unit() const {
  // 16 fp32 lanes, 2 products and 2 additions each, per instruction.
#ifdef FLASHATTN_HAVE_BF16_DOT
  return 16.0 * 4.0 * kBf16Chains * kIterationsPerUnit * threads_;
#else
  return 0.0;
#endif
}

SgemmPairs::SgemmPairs(int threads, std::int64_t seqlen, std::int64_t head_dim)
    : threads_(threads),
      seqlen_(seqlen),
      head_dim_(head_dim),
      buffers_(static_cast<std::size_t>(threads)) {
  // Each thread fills its own buffers, so their pages are first touched where they are used.
#pragma omp parallel num_threads(threads_)
  {
    Buffers& own = buffers_[static_cast<std::size_t>(omp_get_thread_num())];
    std::mt19937 rng(static_cast<unsigned>(omp_get_thread_num()));
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    const auto rows = static_cast<std::size_t>(seqlen_ * head_dim_);
    for (auto* matrix : {&own.q, &own.k, &own.v, &own.out}) {
      matrix->resize(rows);
      for (float& x : *matrix) x = uniform(rng);
    }
    own.scores.assign(static_cast<std::size_t>(seqlen_ * seqlen_), 0.0f);
  }
}

void SgemmPairs::run(std::int64_t count) {
  const auto n = static_cast<int>(seqlen_), d = static_cast<int>(head_dim_);
#pragma omp parallel num_threads(threads_)
  {
    // One single-threaded sgemm per thread. A team of one is not an active parallel region, and
    // there OpenBLAS's OpenMP build would start a team of all cores for each call (--threads 1
    // measured 2 threads' sgemm); the setting holds for this region's task only.
    omp_set_num_threads(1);
    Buffers& own = buffers_[static_cast<std::size_t>(omp_get_thread_num())];
    for (std::int64_t i = 0; i < count; ++i) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, d, 1.0f, own.q.data(), d,
                  own.k.data(), d, 0.0f, own.scores.data(), n);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, d, n, 1.0f, own.scores.data(), n,
                  own.v.data(), d, 0.0f, own.out.data(), d);
    }
  }
}

double SgemmPairs::work_per_unit() const {
  return 4.0 * static_cast<double>(seqlen_) * static_cast<double>(seqlen_) *
         static_cast<double>(head_dim_) * threads_;
}

MemoryCopy::MemoryCopy(int threads, std::size_t bytes)
    : threads_(threads),
      bytes_(bytes),
      source_(std::make_unique_for_overwrite<char[]>(bytes)),
      destination_(std::make_unique_for_overwrite<char[]>(bytes)) {
#pragma omp parallel num_threads(threads_)
  {
    const auto [begin, end] = share(bytes_, omp_get_thread_num(), threads_);
    std::memset(source_.get() + begin, 1, end - begin);
    std::memset(destination_.get() + begin, 0, end - begin);
  }
}

void MemoryCopy::run(std::int64_t count) {
#pragma omp parallel num_threads(threads_)
  {
    const auto [begin, end] = share(bytes_, omp_get_thread_num(), threads_);
    for (std::int64_t i = 0; i < count; ++i) {
      std::memcpy(destination_.get() + begin, source_.get() + begin, end - begin);
    }
  }
}

double MemoryCopy::work_per_unit() const { return 2.0 * static_cast<double>(bytes_); }

MemoryRead::MemoryRead(int threads, std::vector<std::span<const std::byte>> buffers)
    : threads_(threads), buffers_(std::move(buffers)) {}

namespace {

// The XOR of the bytes [first, last), each shifted to its place in the aligned 8-byte word that
// holds it: the whole words by the SIMD loop, the ragged ends byte by byte.
std::uint64_t xor_of_bytes(const std::byte* first, const std::byte* last) {
  auto placed = [](const std::byte* byte) {
    return std::to_integer<std::uint64_t>(*byte)
           << (8 * (reinterpret_cast<std::uintptr_t>(byte) % 8));
  };
  const auto* words =
      reinterpret_cast<const std::byte*>((reinterpret_cast<std::uintptr_t>(first) + 7) / 8 * 8);
  if (words >= last) {
    std::uint64_t sum = 0;
    for (const std::byte* byte = first; byte < last; ++byte) sum ^= placed(byte);
    return sum;
  }
  const std::int64_t word_count = (last - words) / 8;
  std::uint64_t sum =
      HWY_DYNAMIC_DISPATCH(XorWords)(reinterpret_cast<const std::uint64_t*>(words), word_count);
  for (const std::byte* byte = first; byte < words; ++byte) sum ^= placed(byte);
  for (const std::byte* byte = words + word_count * 8; byte < last; ++byte) sum ^= placed(byte);
  return sum;
}

}  // namespace

void MemoryRead::run(std::int64_t count) {
  std::uint64_t checksum = 0;
#pragma omp parallel num_threads(threads_) reduction(^ : checksum)
  {
    std::uint64_t pass_checksum = 0;
    for (std::int64_t i = 0; i < count; ++i) {
      pass_checksum = 0;
      for (const std::span<const std::byte> buffer : buffers_) {
        const auto [begin, end] = share(buffer.size(), omp_get_thread_num(), threads_);
        pass_checksum ^= xor_of_bytes(buffer.data() + begin, buffer.data() + end);
      }
    }
    checksum ^= pass_checksum;
  }
  checksum_ = checksum;
}

double MemoryRead::work_per_unit() const {
  double bytes = 0.0;
  for (const std::span<const std::byte> buffer : buffers_)
    bytes += static_cast<double>(buffer.size());
  return bytes;
}

std::size_t default_copy_bytes() {
  constexpr std::size_t kMiB = std::size_t{1} << 20;
  const long last_level = std::max(sysconf(_SC_LEVEL3_CACHE_SIZE), sysconf(_SC_LEVEL2_CACHE_SIZE));
  const std::size_t twice = last_level > 0 ? 2 * static_cast<std::size_t>(last_level) : 0;
  return std::clamp(twice, 256 * kMiB, 1024 * kMiB);
}

}  // namespace flashattn::bench

#endif  // HWY_ONCE
