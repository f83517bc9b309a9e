#pragma once

// Backend entry points. Each takes validated AttentionParams and writes params.out and
// params.lse (when not null).

#include <cstdint>

#include "api/params.hpp"
#include "cpu/tile_kernels_bf16.hpp"

namespace flashattn::detail {

// Plain loops, fp64 accumulation. out_f64 is contiguous [batch, seqlen_q, heads_q, head_dim],
// lse_f64 contiguous [batch, heads_q, seqlen_q] (may be null). Used by the tests as the oracle.
void reference_forward_f64(const AttentionParams& params, double* out_f64, double* lse_f64);
void reference_forward(const AttentionParams& params);

void standard_forward(const AttentionParams& params);

void flash_forward(const AttentionParams& params);
// The FlashAttention forward for decoding, a few query rows per KV head (cpu/flash_decode.cpp):
// flash_forward takes it where use_flash_decode says so.
bool use_flash_decode(const AttentionParams& params);
void flash_decode(const AttentionParams& params);
std::int64_t flash_decode_scratch_bytes(const AttentionParams& params);

// Backward passes: write params.dq, dk, dv. reference_backward_f64 writes contiguous fp64
// dq [batch, seqlen_q, heads_q, head_dim], dk and dv [batch, seqlen_kv, heads_kv, head_dim].
void reference_backward_f64(const BackwardParams& params, double* dq_f64, double* dk_f64,
                            double* dv_f64);
void reference_backward(const BackwardParams& params);
void standard_backward(const BackwardParams& params);
void flash_backward(const BackwardParams& params);

// Tile sizes of the FlashAttention path: Br query rows by Bc keys, and how many Q blocks of Br
// rows at most share each packed K/V block.
struct FlashTiles {
  std::int64_t rows = 0;  // Br
  std::int64_t keys = 0;  // Bc
  std::int64_t blocks_per_task = 1;
};
FlashTiles flash_tiles(std::int64_t head_dim);
// How the flash backward's products run: bf16 inputs as cpu::active_bf16_products says, every
// other dtype widened to fp32.
cpu::Bf16Products backward_bf16_products(const AttentionParams& p);
FlashTiles flash_backward_tiles(const AttentionParams& p);
// How many chunks of K/V blocks the flash backward cuts each (batch, KV head) group into: a
// function of the shape only.
std::int64_t flash_backward_chunks(const AttentionParams& p);

}  // namespace flashattn::detail
