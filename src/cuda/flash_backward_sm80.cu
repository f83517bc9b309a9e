// FlashAttention backward on the tensor cores of sm80 and later (FlashAttention-2's scheme: the
// key blocks are the outer loop, P is recomputed from lse, dK and dV stay in registers, dQ is
// summed in fp32 in device memory).
//
// Three launches:
//   row_dot      D_i = Σ_d dO_id · O_id per query row (fp32), the softmax backward's row term
//   backward     one thread block per (key block of 64 keys, KV head, batch entry); each warp
//                owns 16 keys. For every query head of the KV head's group and every step of
//                64 query rows (32 for head_dim 128) that sees these keys (Q and dO
//                double-buffered by cp.async):
//                  Sᵀ  = K·Qᵀ                        [16 keys, the step's rows] per warp
//                  Pᵀ  = exp2(Sᵀ·scale·log2 e − lse·log2 e), 0 where masked
//                  dV += Pᵀ·dO                       P rounded to the dtype as the A operand
//                  dPᵀ = V·dOᵀ
//                  dSᵀ = Pᵀ ∘ (dPᵀ − D)
//                  dK += dSᵀ·Q                       dS rounded to the dtype as the A operand
//                  dQ += dS·K                        through shared memory (dSᵀ transposed by
//                                                    ldmatrix), fp32 atomics into dq_sum
//                then dK·scale and dV are written once. A KV head's block loops over all the
//                query heads that read it, so GQA needs no atomics for dK and dV.
//   dq           dq = scale · dq_sum, rounded once.
//
// head_dim up to 128 (64 or 128 tiles): a warp holds 16 keys' dK and dV in fp32, head_dim / 2
// registers each (64 for 128), which for 256 would leave no room (FlashAttention-2 splits its warps
// differently there; not done here). Shared memory for 128: K, V 32 KiB, two stages of Q and dO
// (32 rows) 32 KiB, dSᵀ 4 KiB, lse and D 0.5 KiB: 68.5 KiB.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/kernel_params.hpp"
#include "cuda/launch.hpp"
#include "cuda/mma_sm80.cuh"

namespace flashattn::cuda::detail {
namespace {

constexpr int kKeysPerBlock = 16 * kWarps;  // 64: each warp owns 16 keys
// Query rows per step of the inner loop: 64, and 32 for head_dim 128, whose 16 keys' dK and dV
// take 128 of a thread's 255 registers (with 64 rows, Sᵀ and dPᵀ took 64 more and it spilled).
template <int kHeadDim>
constexpr int kRowsPerStepFor = kHeadDim <= 64 ? 64 : 32;
constexpr float kLog2e = 1.44269504088896341f;

template <int kHeadDim, int kRowsPerStep = kRowsPerStepFor<kHeadDim>>
constexpr int kBackwardSharedBytes = (2 * kKeysPerBlock + 4 * kRowsPerStep) * kHeadDim *
                                         2  // K, V; 2 stages of Q and dO
                                     + kKeysPerBlock* kRowsPerStep * 2  // dSᵀ
                                     + 2 * 2 * kRowsPerStep * 4;  // 2 stages of lse·log2 e and D

// D_i = Σ_d dO_id · O_id, one warp per row (batch, query head, row), fp32.
template <Element E>
__global__ void __launch_bounds__(kThreads)
    row_dot_kernel(const __grid_constant__ BackwardParams b) {
  using Scalar = typename ElementTraits<E>::Scalar;
  const ForwardParams& p = b.forward;
  const std::int64_t row_index =
      static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;  // (batch·Hq + h)·Sq + i
  const std::int64_t rows = static_cast<std::int64_t>(p.batch) * p.heads_q * p.seqlen_q;
  if (row_index >= rows) return;
  const std::int64_t row = row_index % p.seqlen_q;
  const std::int64_t head = (row_index / p.seqlen_q) % p.heads_q;
  const std::int64_t batch = row_index / (p.seqlen_q * p.heads_q);
  const Scalar* out =
      static_cast<const Scalar*>(p.out) + batch * p.out_batch + row * p.out_seq + head * p.out_head;
  const Scalar* dout = static_cast<const Scalar*>(b.dout) + batch * b.dout_batch +
                       row * b.dout_seq + head * b.dout_head;
  float sum = 0.0f;
  for (int d = threadIdx.x % 32; d < p.head_dim; d += 32) {
    sum += static_cast<float>(out[d]) * static_cast<float>(dout[d]);
  }
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (threadIdx.x % 32 == 0) b.row_dot[row_index] = sum;
}

// dq = scale · dq_sum, rounded once; one thread per element of [batch, seqlen_q, heads_q,
// head_dim] (dq_sum contiguous in that order).
template <Element E>
__global__ void __launch_bounds__(kThreads) dq_kernel(const __grid_constant__ BackwardParams b) {
  using Scalar = typename ElementTraits<E>::Scalar;
  const ForwardParams& p = b.forward;
  const std::int64_t index = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const std::int64_t count =
      static_cast<std::int64_t>(p.batch) * p.seqlen_q * p.heads_q * p.head_dim;
  if (index >= count) return;
  const std::int64_t d = index % p.head_dim;
  const std::int64_t head = (index / p.head_dim) % p.heads_q;
  const std::int64_t row =
      (index / (static_cast<std::int64_t>(p.head_dim) * p.heads_q)) % p.seqlen_q;
  const std::int64_t batch =
      index / (static_cast<std::int64_t>(p.head_dim) * p.heads_q * p.seqlen_q);
  Scalar* dq = static_cast<Scalar*>(b.dq) + batch * b.dq_batch + row * b.dq_seq + head * b.dq_head;
  dq[d] = ElementTraits<E>::from_float(b.scale * b.dq_sum[index]);
}

// Grid: x key blocks, y KV heads, z batch entries.
template <int kHeadDim, Element E>
__global__ void __launch_bounds__(kThreads, 1)
    flash_backward_kernel(const __grid_constant__ BackwardParams b) {
  using Traits = ElementTraits<E>;
  using Scalar = typename Traits::Scalar;
  constexpr int kRowsPerStep = kRowsPerStepFor<kHeadDim>;
  constexpr int kSteps = kHeadDim / 16;         // k-steps over head_dim
  constexpr int kRowGroups = kRowsPerStep / 8;  // 8-row accumulator blocks of Sᵀ and dPᵀ
  constexpr int kDimGroups = kHeadDim / 8;      // 8-column accumulator blocks of dK, dV
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim 64 or 128 tiles");
  const ForwardParams& p = b.forward;

  extern __shared__ __align__(128) unsigned char shared[];
  Scalar* k_tile = reinterpret_cast<Scalar*>(shared);          // [64 keys, kHeadDim]
  Scalar* v_tile = k_tile + kKeysPerBlock * kHeadDim;          // [64 keys, kHeadDim]
  Scalar* q_tiles = v_tile + kKeysPerBlock * kHeadDim;         // [2][rows, kHeadDim]
  Scalar* dout_tiles = q_tiles + 2 * kRowsPerStep * kHeadDim;  // [2][rows, kHeadDim]
  Scalar* ds_tile = dout_tiles + 2 * kRowsPerStep * kHeadDim;  // dSᵀ [64 keys, rows]
  float* lse_tiles = reinterpret_cast<float*>(ds_tile + kKeysPerBlock * kRowsPerStep);  // [2][rows]
  float* dot_tiles = lse_tiles + 2 * kRowsPerStep;                                      // [2][rows]

  const std::int64_t key_begin = static_cast<std::int64_t>(blockIdx.x) * kKeysPerBlock;
  const int kv_head = blockIdx.y, batch = blockIdx.z;
  const int group_size = p.heads_q / p.heads_kv;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = lane / 4, in_group = lane % 4;

  const Scalar* k = static_cast<const Scalar*>(p.k) + batch * p.k_batch + kv_head * p.k_head;
  const Scalar* v = static_cast<const Scalar*>(p.v) + batch * p.v_batch + kv_head * p.v_head;

  // The steps: every (query head of the group, block of kRowsPerStep rows that sees these keys).
  const RowInterval seen_by = query_rows(p, key_begin, min(key_begin + kKeysPerBlock, p.seqlen_kv));
  const std::int64_t first_step_row = seen_by.first / kRowsPerStep * kRowsPerStep;
  const std::int64_t row_steps =
      seen_by.last > seen_by.first
          ? (seen_by.last - first_step_row + kRowsPerStep - 1) / kRowsPerStep
          : 0;
  const std::int64_t steps = row_steps * group_size;

  // Queues step `step`'s Q and dO tiles into stage `stage`, and its lse·log2 e and D (+inf and 0
  // for rows past seqlen_q: their P is exp2(-inf) = 0).
  auto load_step = [&](std::int64_t step, int stage) {
    const int head = kv_head * group_size + static_cast<int>(step / row_steps);
    const std::int64_t row_begin = first_step_row + (step % row_steps) * kRowsPerStep;
    const Scalar* q = static_cast<const Scalar*>(p.q) + batch * p.q_batch + head * p.q_head;
    const Scalar* dout =
        static_cast<const Scalar*>(b.dout) + batch * b.dout_batch + head * b.dout_head;
    load_tile<kHeadDim, kRowsPerStep>(q_tiles + stage * kRowsPerStep * kHeadDim, q, p.q_seq,
                                      row_begin, p.seqlen_q, p.head_dim);
    load_tile<kHeadDim, kRowsPerStep>(dout_tiles + stage * kRowsPerStep * kHeadDim, dout,
                                      b.dout_seq, row_begin, p.seqlen_q, p.head_dim);
    if (threadIdx.x < kRowsPerStep) {
      const std::int64_t row = row_begin + threadIdx.x;
      const std::int64_t index =
          (static_cast<std::int64_t>(batch) * p.heads_q + head) * p.seqlen_q + row;
      // A row without keys has lse -inf; +inf then makes each of its P exp2(-inf) = 0 too.
      const float lse = row < p.seqlen_q ? p.lse[index] : -INFINITY;
      lse_tiles[stage * kRowsPerStep + threadIdx.x] = lse == -INFINITY ? INFINITY : lse * kLog2e;
      dot_tiles[stage * kRowsPerStep + threadIdx.x] = row < p.seqlen_q ? b.row_dot[index] : 0.0f;
    }
  };

  // ---- prologue: K, V and the first step in flight ----
  float dk[kDimGroups][4] = {};  // dK / scale   [16 keys, kHeadDim] per warp
  float dv[kDimGroups][4] = {};  // dV           [16 keys, kHeadDim] per warp
  load_tile<kHeadDim, kKeysPerBlock>(k_tile, k, p.k_seq, key_begin, p.seqlen_kv, p.head_dim);
  load_tile<kHeadDim, kKeysPerBlock>(v_tile, v, p.v_seq, key_begin, p.seqlen_kv, p.head_dim);
  if (steps > 0) load_step(0, 0);
  commit_copies();

  // This thread's keys in the accumulators' rows: the warp's key `group` and `group` + 8.
  const std::int64_t first_key = key_begin + warp * 16 + group;

  for (std::int64_t step = 0; step < steps; ++step) {
    const int stage = static_cast<int>(step & 1);
    if (step + 1 < steps) {
      load_step(step + 1, stage ^ 1);
      commit_copies();
      wait_copies<1>();
    } else {
      wait_copies<0>();
    }
    __syncthreads();
    const int head = kv_head * group_size + static_cast<int>(step / row_steps);
    const std::int64_t row_begin = first_step_row + (step % row_steps) * kRowsPerStep;
    const Scalar* q_tile = q_tiles + stage * kRowsPerStep * kHeadDim;
    const Scalar* dout_tile = dout_tiles + stage * kRowsPerStep * kHeadDim;
    const float* lse_log2 = lse_tiles + stage * kRowsPerStep;
    const float* row_dot = dot_tiles + stage * kRowsPerStep;

    // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ                         [16 keys, kRowsPerStep rows] per warp
    float s[kRowGroups][4] = {};
    float dp[kRowGroups][4] = {};
    // Not unrolled: the accumulators are indexed by `pair` only, and an unrolled step_d would
    // keep every step's shared-memory addresses in registers (the kernel spilled with it).
#pragma unroll 1
    for (int step_d = 0; step_d < kSteps; ++step_d) {
      // A: the warp's 16 keys of K (then V), columns step_d·16 + 0-7 / 8-15.
      const int a_row = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
      const int a_column = step_d * 16 + (lane >> 4) * 8;
      std::uint32_t a_k[4], a_v[4];
      load_matrices(a_k, shared_address(k_tile + swizzled<kHeadDim>(a_row, a_column)));
      load_matrices(a_v, shared_address(v_tile + swizzled<kHeadDim>(a_row, a_column)));
#pragma unroll
      for (int pair = 0; pair < kRowGroups / 2; ++pair) {
        // B: rows pair·16 + 0-7 and + 8-15 of Q (then dO), non-transposed (n = row, k = dim).
        const int b_row = pair * 16 + (lane & 7) + (lane >> 4) * 8;
        const int b_column = step_d * 16 + ((lane >> 3) & 1) * 8;
        std::uint32_t b_q[4], b_dout[4];
        load_matrices(b_q, shared_address(q_tile + swizzled<kHeadDim>(b_row, b_column)));
        load_matrices(b_dout, shared_address(dout_tile + swizzled<kHeadDim>(b_row, b_column)));
        Traits::mma(s[2 * pair], a_k, b_q[0], b_q[1]);
        Traits::mma(s[2 * pair + 1], a_k, b_q[2], b_q[3]);
        Traits::mma(dp[2 * pair], a_v, b_dout[0], b_dout[1]);
        Traits::mma(dp[2 * pair + 1], a_v, b_dout[2], b_dout[3]);
      }
    }

    // Pᵀ (masked: 0) and dSᵀ = Pᵀ ∘ (dPᵀ − D), rounded to the dtype at once as the A operands
    // of the products below (and dSᵀ's store), packed two to a register like the accumulators:
    // [g][half] holds rows (keys) group + 8·half, columns (queries) g·8 + 2·in_group, + 1.
    const std::int64_t row_end = min(row_begin + kRowsPerStep, p.seqlen_q);
    const bool masked =
        !block_fully_visible(p, row_begin, row_end, key_begin, key_begin + kKeysPerBlock);
    const int rows_in_step = static_cast<int>(row_end - row_begin);
    const int my_key = warp * 16 + group;  // this thread's keys: my_key and + 8 of the block
    std::uint32_t p_packed[kRowGroups][2], ds_packed[kRowGroups][2];
#pragma unroll
    for (int g = 0; g < kRowGroups; ++g) {
      float probability[2][2], ds[2][2];  // [half][e]
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int local_row = g * 8 + 2 * in_group + e;
        // The row's visible keys relative to the block, clamped to it (32-bit from here on).
        int seen_begin = 0, seen_end = kKeysPerBlock;
        if (masked) {
          const KeyInterval seen = row_keys(p, min(row_begin + local_row, p.seqlen_q - 1));
          seen_begin = static_cast<int>(
              max(min(seen.begin - key_begin, std::int64_t{kKeysPerBlock}), std::int64_t{0}));
          seen_end = static_cast<int>(
              max(min(seen.end - key_begin, std::int64_t{kKeysPerBlock}), std::int64_t{0}));
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int key = my_key + 8 * half;
          const bool visible = local_row < rows_in_step && key >= seen_begin && key < seen_end;
          // Rounded product, then the difference (see the forward: no FMA across them).
          probability[half][e] = visible
                                     ? exp2f(__fsub_rn(__fmul_rn(s[g][2 * half + e], p.scale_log2),
                                                       lse_log2[local_row]))
                                     : 0.0f;
          ds[half][e] = probability[half][e] * (dp[g][2 * half + e] - row_dot[local_row]);
        }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        p_packed[g][half] = Traits::pack(probability[half][0], probability[half][1]);
        ds_packed[g][half] = Traits::pack(ds[half][0], ds[half][1]);
      }
    }

    // dV += Pᵀ·dO and dK += dSᵀ·Q                                   [16 keys, kHeadDim] per warp
#pragma unroll
    for (int row_step = 0; row_step < kRowsPerStep / 16; ++row_step) {
      const std::uint32_t a_p[4] = {p_packed[2 * row_step][0], p_packed[2 * row_step][1],
                                    p_packed[2 * row_step + 1][0], p_packed[2 * row_step + 1][1]};
      const std::uint32_t a_ds[4] = {ds_packed[2 * row_step][0], ds_packed[2 * row_step][1],
                                     ds_packed[2 * row_step + 1][0],
                                     ds_packed[2 * row_step + 1][1]};
#pragma unroll
      for (int pair = 0; pair < kDimGroups / 2; ++pair) {
        // Transposed: rows row_step·16 + 0-7 / 8-15 (k), columns pair·16 + 0-7, + 8-15 (n).
        const int b_row = row_step * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        const int b_column = pair * 16 + (lane >> 4) * 8;
        std::uint32_t b_dout[4], b_q[4];
        load_matrices_transposed(b_dout,
                                 shared_address(dout_tile + swizzled<kHeadDim>(b_row, b_column)));
        load_matrices_transposed(b_q, shared_address(q_tile + swizzled<kHeadDim>(b_row, b_column)));
        Traits::mma(dv[2 * pair], a_p, b_dout[0], b_dout[1]);
        Traits::mma(dv[2 * pair + 1], a_p, b_dout[2], b_dout[3]);
        Traits::mma(dk[2 * pair], a_ds, b_q[0], b_q[1]);
        Traits::mma(dk[2 * pair + 1], a_ds, b_q[2], b_q[3]);
      }
    }

    // dSᵀ to shared memory (keys × rows, rows swizzled in 16-byte chunks like the other tiles),
    // for dQ, whose rows are queries.
#pragma unroll
    for (int g = 0; g < kRowGroups; ++g) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int key_row = warp * 16 + group + 8 * half;
        *reinterpret_cast<std::uint32_t*>(
            ds_tile + swizzled<kRowsPerStep>(key_row, g * 8 + 2 * in_group)) = ds_packed[g][half];
      }
    }
    __syncthreads();

    // dQ += dS·K: each warp takes 16 query rows of the step and, when the step has fewer than
    // 16 per warp, its share of the columns; 16 columns at a time, added to dq_sum.
    constexpr int kRowWarps = kRowsPerStep / 16;  // warps across the rows
    constexpr int kPairsPerWarp = kDimGroups / 2 / (kWarps / kRowWarps);
    const int dq_warp_row = (warp % kRowWarps) * 16;
    const int first_pair = (warp / kRowWarps) * kPairsPerWarp;
    const std::int64_t dq_row = row_begin + dq_warp_row + group;
#pragma unroll 1
    for (int pair = first_pair; pair < first_pair + kPairsPerWarp; ++pair) {
      float dq[2][4] = {};
#pragma unroll
      for (int key_step = 0; key_step < kKeysPerBlock / 16; ++key_step) {
        // A = dS (rows: queries, k: keys) from dSᵀ transposed: matrix m holds keys
        // key_step·16 + (m / 2)·8 + 0-7 and the warp's queries + (m % 2)·8 + 0-7.
        const int matrix = lane >> 3;
        std::uint32_t a[4];
        load_matrices_transposed(
            a, shared_address(ds_tile +
                              swizzled<kRowsPerStep>(key_step * 16 + (lane & 7) + (matrix >> 1) * 8,
                                                     dq_warp_row + (matrix & 1) * 8)));
        // B = K (k: keys, n: columns), transposed as V in the forward.
        const int b_row = key_step * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        std::uint32_t b_k[4];
        load_matrices_transposed(
            b_k, shared_address(k_tile + swizzled<kHeadDim>(b_row, pair * 16 + (lane >> 4) * 8)));
        Traits::mma(dq[0], a, b_k[0], b_k[1]);
        Traits::mma(dq[1], a, b_k[2], b_k[3]);
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const std::int64_t row = dq_row + 8 * half;
        if (row >= p.seqlen_q) continue;
        float* sum =
            b.dq_sum +
            ((static_cast<std::int64_t>(batch) * p.seqlen_q + row) * p.heads_q + head) * p.head_dim;
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          const int column = pair * 16 + n * 8 + 2 * in_group;
          if (column < p.head_dim) {
            atomicAdd(sum + column, dq[n][2 * half]);
            atomicAdd(sum + column + 1, dq[n][2 * half + 1]);
          }
        }
      }
    }
    __syncthreads();  // the stage and dSᵀ are free for the next step's loads and writes
  }
  wait_copies<0>();  // K and V were still in flight if no step ran

  // ---- epilogue: dK = scale · (dSᵀ·Q), dV, rounded once ----
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const std::int64_t key = first_key + 8 * half;
    if (key >= p.seqlen_kv) continue;
    Scalar* dk_row =
        static_cast<Scalar*>(b.dk) + batch * b.dk_batch + key * b.dk_seq + kv_head * b.dk_head;
    Scalar* dv_row =
        static_cast<Scalar*>(b.dv) + batch * b.dv_batch + key * b.dv_seq + kv_head * b.dv_head;
#pragma unroll
    for (int d = 0; d < kDimGroups; ++d) {
      const int column = d * 8 + 2 * in_group;
      if (column < p.head_dim) {
        *reinterpret_cast<std::uint32_t*>(dk_row + column) =
            Traits::pack(b.scale * dk[d][2 * half], b.scale * dk[d][2 * half + 1]);
        *reinterpret_cast<std::uint32_t*>(dv_row + column) =
            Traits::pack(dv[d][2 * half], dv[d][2 * half + 1]);
      }
    }
  }
}

template <int kHeadDim, Element E>
cudaError_t launch_backward_for(const BackwardParams& b, cudaStream_t stream) {
  const ForwardParams& p = b.forward;
  const std::int64_t rows = static_cast<std::int64_t>(p.batch) * p.heads_q * p.seqlen_q;
  if (rows > 0) {
    row_dot_kernel<E>
        <<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), kThreads, 0, stream>>>(b);
    const cudaError_t status = cudaGetLastError();
    if (status != cudaSuccess) return status;
  }

  // Every key block runs, those no row sees included: they write dK = dV = 0.
  const unsigned key_blocks =
      static_cast<unsigned>((p.seqlen_kv + kKeysPerBlock - 1) / kKeysPerBlock);
  if (key_blocks > 0) {
    constexpr int kBytes = kBackwardSharedBytes<kHeadDim>;
    cudaError_t status = cudaFuncSetAttribute(flash_backward_kernel<kHeadDim, E>,
                                              cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
    if (status != cudaSuccess) return status;
    const dim3 grid(key_blocks, static_cast<unsigned>(p.heads_kv), static_cast<unsigned>(p.batch));
    flash_backward_kernel<kHeadDim, E><<<grid, kThreads, kBytes, stream>>>(b);
    status = cudaGetLastError();
    if (status != cudaSuccess) return status;
  }

  const std::int64_t elements = rows * p.head_dim;
  if (elements > 0) {
    dq_kernel<E>
        <<<static_cast<unsigned>((elements + kThreads - 1) / kThreads), kThreads, 0, stream>>>(b);
  }
  return cudaGetLastError();
}

template <Element E>
cudaError_t launch_backward_for_element(const BackwardParams& b, cudaStream_t stream) {
  if (b.forward.head_dim <= 64) return launch_backward_for<64, E>(b, stream);
  return launch_backward_for<128, E>(b, stream);
}

}  // namespace

cudaError_t launch_flash_backward(const BackwardParams& b, cudaStream_t stream) {
  return b.forward.element == Element::bf16 ? launch_backward_for_element<Element::bf16>(b, stream)
                                            : launch_backward_for_element<Element::f16>(b, stream);
}

}  // namespace flashattn::cuda::detail
