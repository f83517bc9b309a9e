#pragma once

// The cases `flashattn bench` runs: the options that choose them (the command line's values),
// the seed shape, the sweep points and the decode cases.

#include <cstdint>
#include <string>
#include <vector>

#include "backward_check.hpp"
#include "flashattn/dtype.hpp"

namespace flashattn::cli {

// 2^34 FLOPs, about the seed shape's causal FLOPs (17.2 GFLOP): the work of one sweep point.
constexpr double kDefaultWorkGflop = 17.179869184;

// The options of `flashattn bench`, as its command line sets them (tools/bench.cpp).
struct BenchOptions {
  std::vector<std::int64_t> seqlens = {512, 1024, 2048, 4096, 8192, 16384};
  std::vector<std::int64_t> head_dims = {64, 128};
  std::vector<std::string> dtypes = {"f32", "bf16"};
  std::vector<std::string> impls = {"flash", "standard"};
  bool causal = false, non_causal = false, both = false;
  bool no_seed_shape = false;
  bool no_sweep = false;
  double work_gflop = kDefaultWorkGflop;
  int threads = 0;
  int repeat = 3;
  std::int64_t check_rows = 8;
  std::uint64_t seed = 42;
  std::string out_dir = "bench/results";
  bool no_plot = false;
  bool quick = false;
  bool backward = false;
  double backward_reference_gflop = kReferenceBackwardBudgetFlops * 1e-9;
  std::vector<std::int64_t> decode_seqlens = {4096, 16384, 65536};
  bool no_decode = false;
  bool scaling = false;  // flash on one thread too for every forward case, not only the seed shape
};

// The decode cases: one new query position per sequence against a KV cache, GQA as in current
// models (32 query heads reading 8 KV heads of 128 dims).
constexpr std::int64_t kDecodeHeadsQ = 32, kDecodeHeadsKv = 8, kDecodeHeadDim = 128;
// Decode calls take milliseconds: more timed runs than a sweep point's for a steady median.
constexpr int kDecodeMinRepeat = 15;

struct Case {
  DType dtype = DType::f32;
  std::int64_t batch = 1, heads = 1, seqlen = 0, head_dim = 0;
  bool causal = true;
  bool seed_shape = false;  // the seed's [2, 32, 1024, 128], not a sweep point
  // Decode: one query position against `seqlen` keys and values of heads_kv heads, timed as K
  // and V bytes read per second; the sweep's cases have seqlen_q = seqlen_kv and heads_kv = heads.
  bool decode = false;
  std::int64_t heads_kv = 0;  // 0: heads

  std::int64_t seqlen_q() const { return decode ? 1 : seqlen; }
  std::int64_t kv_heads() const { return heads_kv > 0 ? heads_kv : heads; }
  // The bytes of K and V, each read once by a decode call.
  double kv_bytes() const {
    return 2.0 * static_cast<double>(batch * seqlen * kv_heads() * head_dim) *
           static_cast<double>(dtype_size(dtype));
  }
};

// Sweep points: batch 1 and as many heads as bring one call to about `work_gflop` (at least one).
std::vector<Case> make_cases(const BenchOptions& options, const std::vector<bool>& seed_masks,
                             const std::vector<bool>& sweep_masks);

// One line naming the case, for the progress on stderr.
std::string case_label(const Case& shape);

}  // namespace flashattn::cli
