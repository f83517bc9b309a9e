#pragma once

// The machine's own ceilings, measured on the same OpenMP threads as the attention paths
// (docs/design.md, "How speed is measured"): the f32 FMA peak, the bf16 dot-product peak
// (AVX512-BF16 CPUs), OpenBLAS sgemm on attention-shaped products, memory copy bandwidth, and the
// read bandwidth of given buffers (a decode call's K and V). Each is a Workload; best_rate() times
// it.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace flashattn::bench {

// A fixed amount of work per unit, repeated `count` times by run(), on the threads given at
// construction.
class Workload {
 public:
  virtual ~Workload() = default;
  virtual void run(std::int64_t count) = 0;
  // FLOPs or bytes of one unit, all threads together.
  virtual double work_per_unit() const = 0;
};

// Best work per second over `trials` timed runs of `workload`, each of about `seconds`: the count
// per run is calibrated first (the calibration runs double as the warm-up). The best, not the
// median, because a ceiling is what the machine can do when nothing else is running.
double best_rate(Workload& workload, double seconds, int trials);

// Independent FMA chains (more than the FMA latency times the FMA ports, so that they never
// wait on each other) on every thread, in the best SIMD target Highway finds on this CPU. One
// unit: 2^16 FMAs per chain per thread.
class FmaPeak final : public Workload {
 public:
  explicit FmaPeak(int threads);
  void run(std::int64_t count) override;
  double work_per_unit() const override;
  // The Highway target the loop runs in, e.g. "AVX3".
  static std::string target();

 private:
  int threads_;
  float sink_ = 0.0f;
};

// As FmaPeak, with vdpbf16ps (2 bf16 products per fp32 lane per instruction). One unit: 2^16
// instructions per chain per thread.
class Bf16DotPeak final : public Workload {
 public:
  explicit Bf16DotPeak(int threads);
  // Whether this CPU has AVX512-BF16 (and the build can emit it); run() requires it.
  static bool supported();
  void run(std::int64_t count) override;
  double work_per_unit() const override;

 private:
  int threads_;
  float sink_ = 0.0f;
};

// As FmaPeak, with AMX tiles: TDPBF16PS into four independent 16 x 16 fp32 accumulator tiles
// from operand tiles held in registers (16·16·32 bf16 products per instruction). One unit: 2^12
// instructions per accumulator per thread.
// Run only where flashattn::amx_supported() (flashattn/introspect.hpp) holds: it checks the CPU and
// asks Linux for the tile state, once for the whole process.
class AmxPeak final : public Workload {
 public:
  explicit AmxPeak(int threads);
  void run(std::int64_t count) override;
  double work_per_unit() const override;

 private:
  int threads_;
  float sink_ = 0.0f;
};

// The two products of standard attention for one head, by OpenBLAS sgemm on each thread's own
// buffers: S = Q·Kᵀ ([seqlen x head_dim]·[head_dim x seqlen]) and O = S·V ([seqlen x seqlen]·
// [seqlen x head_dim]), the way the standard path calls it (one head per thread; the OpenMP
// build of OpenBLAS runs single-threaded inside a parallel region). One unit: one pair per
// thread, 4·seqlen²·head_dim FLOPs each.
class SgemmPairs final : public Workload {
 public:
  SgemmPairs(int threads, std::int64_t seqlen, std::int64_t head_dim);
  void run(std::int64_t count) override;
  double work_per_unit() const override;

 private:
  struct Buffers {
    std::vector<float> q, k, v, scores, out;
  };
  int threads_;
  std::int64_t seqlen_, head_dim_;
  std::vector<Buffers> buffers_;  // one set per thread
};

// memcpy of `bytes` into another buffer, each thread copying its own slice. One unit: one pass;
// its work is 2·bytes (read + written, the STREAM convention), so the rate is in bytes/s.
class MemoryCopy final : public Workload {
 public:
  MemoryCopy(int threads, std::size_t bytes);
  void run(std::int64_t count) override;
  double work_per_unit() const override;

 private:
  int threads_;
  std::size_t bytes_;
  std::unique_ptr<char[]> source_, destination_;
};

// Reads the given buffers once per unit, each thread its own slice of each, as the decode path
// reads K and V: the least time a call that must read those bytes can take on these threads.
// One unit: one pass; its work is the bytes read.
class MemoryRead final : public Workload {
 public:
  MemoryRead(int threads, std::vector<std::span<const std::byte>> buffers);
  void run(std::int64_t count) override;
  double work_per_unit() const override;
  // What the last run read: the XOR of every byte of the buffers, each shifted to its place
  // (its address mod 8) in a little-endian 64-bit word. Proof that each byte was read once.
  std::uint64_t checksum() const { return checksum_; }

 private:
  int threads_;
  std::vector<std::span<const std::byte>> buffers_;
  std::uint64_t checksum_ = 0;
};

// Copy buffers large enough to defeat the caches: twice the last-level cache (as sysconf reports
// it), at least 256 MiB, at most 1 GiB.
std::size_t default_copy_bytes();

}  // namespace flashattn::bench
