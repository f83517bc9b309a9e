// FlashAttention forward on the tensor cores of sm80 and later (FlashAttention-2's scheme), and
// the merge of split-KV partial results.
//
// One thread block of 4 warps attends kBlockM = 64 query rows of one (batch entry, query head):
// each warp owns 16 rows, so a warp's softmax statistics never leave its registers. Per key
// block of kBlockN keys, the block's K and V tiles arrive in shared memory by cp.async while the
// previous block is computed (two stages), then each warp
//   S   = Q·Kᵀ           mma.sync m16n8k16, fp32 accumulators      [16, kBlockN] per warp
//   S   = mask(S)        only on blocks the mask cuts
//   m,l = online softmax  exp2 of S·scale·log2(e) − m, rescale O    per row (4 lanes share one)
//   O  += P·V            P rounded to the input dtype as the A operand, straight from the
//                        accumulator registers (their layout is the A fragment's)
// and at the end O/l goes to out and m + log2(l) to lse.
//
// Bytes: Q is read once, K and V once per query block (ceil(Sq/64) times), out written once. For
// head_dim 128 a block's shared memory is Q 16 KiB + two stages of K and V 64 KiB = 80 KiB, so two
// blocks fit on an A100 (164 KiB) or H100 (228 KiB) multiprocessor; head_dim 256 halves kBlockN
// to keep that (96 KiB). Shared-memory rows are swizzled in 16-byte chunks (chunk ^ row % 8) so
// that ldmatrix's eight row reads of one 8x8 matrix hit eight different bank groups.
//
// A head_dim below the template's (a multiple of 8) is zero-filled by cp.async on the way in and
// not stored on the way out: zero columns add nothing to q·k and produce columns nobody reads.

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

constexpr int kBlockM = 16 * kWarps;  // query rows per thread block: 16 per warp

// Keys per block: 64, and 32 for head_dim 256 to keep its tiles in 96 KiB.
template <int kHeadDim>
constexpr int kBlockNFor = kHeadDim <= 128 ? 64 : 32;

// Q, then 2 stages of K and V, 2 bytes an element.
template <int kHeadDim>
constexpr int kSharedBytesFor = (kBlockM + 4 * kBlockNFor<kHeadDim>)*kHeadDim * 2;

// ---- the kernel ------------------------------------------------------------------------------

// Grid: x query blocks, y query heads, z batch entries × splits.
template <int kHeadDim, Element E>
__global__ void __launch_bounds__(kThreads, 2)
    flash_forward_kernel(const __grid_constant__ ForwardParams p) {
  using Traits = ElementTraits<E>;
  using Scalar = typename Traits::Scalar;
  constexpr int kBlockN = kBlockNFor<kHeadDim>;
  constexpr int kSteps = kHeadDim / 16;     // k-steps of Q·Kᵀ
  constexpr int kKeyGroups = kBlockN / 8;   // 8-key accumulator blocks of S
  constexpr int kDimGroups = kHeadDim / 8;  // 8-column accumulator blocks of O
  static_assert(kHeadDim % 64 == 0 && kHeadDim <= 256, "head_dim 64, 128 or 256");
  static_assert(kBlockN % 16 == 0, "P·V takes keys 16 at a time");

  extern __shared__ __align__(128) unsigned char shared[];
  Scalar* q_tile = reinterpret_cast<Scalar*>(shared);  // [kBlockM, kHeadDim]
  Scalar* k_tiles = q_tile + kBlockM * kHeadDim;       // [2][kBlockN, kHeadDim]
  Scalar* v_tiles = k_tiles + 2 * kBlockN * kHeadDim;  // [2][kBlockN, kHeadDim]

  const int m_block = blockIdx.x, head = blockIdx.y;
  const int batch = blockIdx.z % p.batch, split = blockIdx.z / p.batch;
  const int kv_head = head / (p.heads_q / p.heads_kv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = lane / 4, in_group = lane % 4;  // mma fragment coordinates

  const std::int64_t row_begin = static_cast<std::int64_t>(m_block) * kBlockM;
  const std::int64_t row_end = min(row_begin + kBlockM, p.seqlen_q);
  BlockInterval blocks = key_blocks(p, row_begin, row_end, kBlockN);
  if (p.num_splits > 1) {
    blocks.first = max(blocks.first, static_cast<std::int64_t>(split) * p.blocks_per_split);
    blocks.last = min(blocks.last, static_cast<std::int64_t>(split + 1) * p.blocks_per_split);
  }

  const Scalar* q = static_cast<const Scalar*>(p.q) + batch * p.q_batch + head * p.q_head;
  const Scalar* k = static_cast<const Scalar*>(p.k) + batch * p.k_batch + kv_head * p.k_head;
  const Scalar* v = static_cast<const Scalar*>(p.v) + batch * p.v_batch + kv_head * p.v_head;

  // This thread's two rows of every accumulator: the warp's row `group` and `group` + 8.
  const std::int64_t first_row = row_begin + warp * 16 + group;  // the other is first_row + 8
  float o[kDimGroups][4] = {};                // O, unnormalized   [16, kHeadDim] per warp
  float row_max[2] = {kMinusInf, kMinusInf};  // m, in units of log2 (scores · scale · log2 e)
  float row_sum[2] = {0.0f, 0.0f};            // l, this lane's part of the row

  // ---- prologue: Q and the first K/V block in flight ----
  if (blocks.first < blocks.last) {
    load_tile<kHeadDim, kBlockM>(q_tile, q, p.q_seq, row_begin, p.seqlen_q, p.head_dim);
    load_tile<kHeadDim, kBlockN>(k_tiles, k, p.k_seq, blocks.first * kBlockN, p.seqlen_kv,
                                 p.head_dim);
    load_tile<kHeadDim, kBlockN>(v_tiles, v, p.v_seq, blocks.first * kBlockN, p.seqlen_kv,
                                 p.head_dim);
    commit_copies();
  }

  // ---- main loop over the key blocks the rows see ----
  for (std::int64_t n_block = blocks.first; n_block < blocks.last; ++n_block) {
    const int stage = static_cast<int>((n_block - blocks.first) & 1);
    if (n_block + 1 < blocks.last) {
      const std::int64_t next_key = (n_block + 1) * kBlockN;
      load_tile<kHeadDim, kBlockN>(k_tiles + (stage ^ 1) * kBlockN * kHeadDim, k, p.k_seq, next_key,
                                   p.seqlen_kv, p.head_dim);
      load_tile<kHeadDim, kBlockN>(v_tiles + (stage ^ 1) * kBlockN * kHeadDim, v, p.v_seq, next_key,
                                   p.seqlen_kv, p.head_dim);
      commit_copies();
      wait_copies<1>();  // this block's copies (and Q) done, the next block's may be in flight
    } else {
      wait_copies<0>();
    }
    __syncthreads();
    const Scalar* k_tile = k_tiles + stage * kBlockN * kHeadDim;
    const Scalar* v_tile = v_tiles + stage * kBlockN * kHeadDim;

    // S = Q·Kᵀ                                                        [16, kBlockN] per warp
    float s[kKeyGroups][4] = {};
#pragma unroll
    for (int step = 0; step < kSteps; ++step) {
      std::uint32_t a[4];
      // Matrices: rows 0-7 / 8-15 of the warp's 16, columns step·16 + 0-7 / 8-15.
      const int a_row = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
      load_matrices(
          a, shared_address(q_tile + swizzled<kHeadDim>(a_row, step * 16 + (lane >> 4) * 8)));
#pragma unroll
      for (int pair = 0; pair < kKeyGroups / 2; ++pair) {
        // Matrices: keys pair·16 + 0-7 (columns 0-7, 8-15), keys pair·16 + 8-15 (the same).
        std::uint32_t b[4];
        const int b_row = pair * 16 + (lane & 7) + (lane >> 4) * 8;
        load_matrices(b, shared_address(k_tile + swizzled<kHeadDim>(
                                                     b_row, step * 16 + ((lane >> 3) & 1) * 8)));
        Traits::mma(s[2 * pair], a, b[0], b[1]);
        Traits::mma(s[2 * pair + 1], a, b[2], b[3]);
      }
    }

    // Mask: keys outside a row's interval (and past seqlen_kv) get -inf.
    const std::int64_t key_begin = n_block * kBlockN;
    if (!block_fully_visible(p, row_begin, row_end, key_begin, key_begin + kBlockN)) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const KeyInterval seen = row_keys(p, min(first_row + 8 * half, p.seqlen_q - 1));
#pragma unroll
        for (int g = 0; g < kKeyGroups; ++g) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const std::int64_t key = key_begin + g * 8 + 2 * in_group + e;
            if (key < seen.begin || key >= seen.end) s[g][2 * half + e] = kMinusInf;
          }
        }
      }
    }

    // Online softmax: new row maxima, rescale O and l, P = exp2(S·scale·log2 e − m).
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float block_max = kMinusInf;
#pragma unroll
      for (int g = 0; g < kKeyGroups; ++g) {
        block_max = fmaxf(block_max, fmaxf(s[g][2 * half], s[g][2 * half + 1]));
      }
      const float new_max = fmaxf(row_max[half], __fmul_rn(quad_max(block_max), p.scale_log2));
      // A row with no visible key so far subtracts 0 instead of -inf (-inf - -inf is NaN).
      const float subtract = new_max == kMinusInf ? 0.0f : new_max;
      const float rescale = exp2f(row_max[half] - subtract);
      row_max[half] = new_max;
      row_sum[half] *= rescale;
#pragma unroll
      for (int d = 0; d < kDimGroups; ++d) {
        o[d][2 * half] *= rescale;
        o[d][2 * half + 1] *= rescale;
      }
#pragma unroll
      for (int g = 0; g < kKeyGroups; ++g) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          // Rounded product, then the difference: fused into one FMA, the product's rounding
          // error (1e22 for scores near 1e30) would reach exp2 and give the row maximum inf.
          const float probability =
              exp2f(__fsub_rn(__fmul_rn(s[g][2 * half + e], p.scale_log2), subtract));
          s[g][2 * half + e] = probability;
          row_sum[half] += probability;
        }
      }
    }

    // O += P·V                                                        [16, kHeadDim] per warp
#pragma unroll
    for (int key_step = 0; key_step < kBlockN / 16; ++key_step) {
      // P's A fragment is S's accumulators of key groups 2·key_step and 2·key_step + 1.
      const std::uint32_t a[4] = {Traits::pack(s[2 * key_step][0], s[2 * key_step][1]),
                                  Traits::pack(s[2 * key_step][2], s[2 * key_step][3]),
                                  Traits::pack(s[2 * key_step + 1][0], s[2 * key_step + 1][1]),
                                  Traits::pack(s[2 * key_step + 1][2], s[2 * key_step + 1][3])};
#pragma unroll
      for (int pair = 0; pair < kDimGroups / 2; ++pair) {
        // Transposed matrices: keys 0-7 / 8-15 of the step, columns pair·16 + 0-7, then + 8-15.
        std::uint32_t b[4];
        const int v_row = key_step * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        load_matrices_transposed(
            b, shared_address(v_tile + swizzled<kHeadDim>(v_row, pair * 16 + (lane >> 4) * 8)));
        Traits::mma(o[2 * pair], a, b[0], b[1]);
        Traits::mma(o[2 * pair + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();  // every warp is done with this stage before the next loads overwrite it
  }

  // ---- epilogue: O / l to out (or the split's fp32 partial), m + log2 l to lse ----
  const bool partial = p.num_splits > 1;
  // Every lane shuffles (rows past seqlen_q included) before any lane leaves.
  row_sum[0] = quad_sum(row_sum[0]);
  row_sum[1] = quad_sum(row_sum[1]);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const std::int64_t row = first_row + 8 * half;
    if (row >= p.seqlen_q) continue;  // past the last query row (after the shuffles above)
    const float sum = row_sum[half];
    // No visible key: out 0, lse -inf (a split without keys the same, which the merge skips).
    const float inverse = sum > 0.0f ? 1.0f / sum : 0.0f;
    const float lse = sum > 0.0f ? (row_max[half] + log2f(sum)) * kLn2 : kMinusInf;
    const std::int64_t lse_index =
        (static_cast<std::int64_t>(batch) * p.heads_q + head) * p.seqlen_q + row;
    if (partial) {
      const std::int64_t split_row =
          static_cast<std::int64_t>(split) * p.batch * p.heads_q * p.seqlen_q + lse_index;
      float* out_row = p.split_out + split_row * p.head_dim;
#pragma unroll
      for (int d = 0; d < kDimGroups; ++d) {
        const int column = d * 8 + 2 * in_group;
        if (column < p.head_dim) {
          *reinterpret_cast<float2*>(out_row + column) =
              make_float2(o[d][2 * half] * inverse, o[d][2 * half + 1] * inverse);
        }
      }
      if (in_group == 0) p.split_lse[split_row] = lse;
    } else {
      Scalar* out_row =
          static_cast<Scalar*>(p.out) + batch * p.out_batch + row * p.out_seq + head * p.out_head;
#pragma unroll
      for (int d = 0; d < kDimGroups; ++d) {
        const int column = d * 8 + 2 * in_group;
        if (column < p.head_dim) {
          *reinterpret_cast<std::uint32_t*>(out_row + column) =
              Traits::pack(o[d][2 * half] * inverse, o[d][2 * half + 1] * inverse);
        }
      }
      if (in_group == 0 && p.lse != nullptr) p.lse[lse_index] = lse;
    }
  }
}

// Merges the splits of each row exactly: lse = log Σ exp(lse_s), out = Σ exp(lse_s − lse)·out_s
// (merge.hpp's rule; splits without keys have lse -inf and weight 0). One thread block per row.
template <Element E>
__global__ void __launch_bounds__(kThreads)
    combine_splits_kernel(const __grid_constant__ ForwardParams p) {
  using Scalar = typename ElementTraits<E>::Scalar;
  const std::int64_t row_index = blockIdx.x;  // (batch · heads_q + head) · seqlen_q + row
  const std::int64_t rows = static_cast<std::int64_t>(p.batch) * p.heads_q * p.seqlen_q;
  float max_lse = kMinusInf;
  for (int s = 0; s < p.num_splits; ++s)
    max_lse = fmaxf(max_lse, p.split_lse[s * rows + row_index]);
  float total = 0.0f;
  if (max_lse != kMinusInf) {
    for (int s = 0; s < p.num_splits; ++s)
      total += expf(p.split_lse[s * rows + row_index] - max_lse);
  }
  const float lse = max_lse == kMinusInf ? kMinusInf : max_lse + logf(total);

  const std::int64_t row = row_index % p.seqlen_q;
  const std::int64_t head = (row_index / p.seqlen_q) % p.heads_q;
  const std::int64_t batch = row_index / (p.seqlen_q * p.heads_q);
  Scalar* out_row =
      static_cast<Scalar*>(p.out) + batch * p.out_batch + row * p.out_seq + head * p.out_head;
  for (int column = threadIdx.x; column < p.head_dim; column += kThreads) {
    float value = 0.0f;
    if (lse != kMinusInf) {
      for (int s = 0; s < p.num_splits; ++s) {
        const float weight = expf(p.split_lse[s * rows + row_index] - lse);
        if (weight > 0.0f)
          value += weight * p.split_out[(s * rows + row_index) * p.head_dim + column];
      }
    }
    out_row[column] = ElementTraits<E>::from_float(value);
  }
  if (threadIdx.x == 0 && p.lse != nullptr) p.lse[row_index] = lse;
}

template <int kHeadDim, Element E>
cudaError_t launch_for(const ForwardParams& p, cudaStream_t stream) {
  constexpr int kBytes = kSharedBytesFor<kHeadDim>;
  const cudaError_t attribute = cudaFuncSetAttribute(
      flash_forward_kernel<kHeadDim, E>, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
  if (attribute != cudaSuccess) return attribute;
  const dim3 grid(static_cast<unsigned>((p.seqlen_q + kBlockM - 1) / kBlockM),
                  static_cast<unsigned>(p.heads_q), static_cast<unsigned>(p.batch * p.num_splits));
  flash_forward_kernel<kHeadDim, E><<<grid, kThreads, kBytes, stream>>>(p);
  if (p.num_splits > 1) {
    const cudaError_t launched = cudaGetLastError();
    if (launched != cudaSuccess) return launched;
    const auto rows =
        static_cast<unsigned>(static_cast<std::int64_t>(p.batch) * p.heads_q * p.seqlen_q);
    combine_splits_kernel<E><<<rows, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

template <Element E>
cudaError_t launch_for_element(const ForwardParams& p, cudaStream_t stream) {
  if (p.head_dim <= 64) return launch_for<64, E>(p, stream);
  if (p.head_dim <= 128) return launch_for<128, E>(p, stream);
  return launch_for<256, E>(p, stream);
}

}  // namespace

int forward_block_m() { return kBlockM; }

int forward_block_n(int head_dim) {
  return head_dim <= 64 ? kBlockNFor<64> : head_dim <= 128 ? kBlockNFor<128> : kBlockNFor<256>;
}

cudaError_t launch_flash_forward(const ForwardParams& p, cudaStream_t stream) {
  return p.element == Element::bf16 ? launch_for_element<Element::bf16>(p, stream)
                                    : launch_for_element<Element::f16>(p, stream);
}

}  // namespace flashattn::cuda::detail
