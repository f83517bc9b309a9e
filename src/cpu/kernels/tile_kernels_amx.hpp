#pragma once

// bf16 tile products on Intel AMX (Advanced Matrix Extensions, Sapphire Rapids and later): one
// TDPBF16PS multiplies a 16 x 32 bf16 tile by a 32 x 16 bf16 tile into 16 x 16 fp32
// accumulators, 8192 multiply-adds per instruction (per-core rates against fp32 FMAs and
// vdpbf16ps: docs/tuning.md). Neither GCC's vectorizer nor Highway emits it, so the one kernel is
// written with the AMX intrinsics in functions compiled for that ISA (docs/design.md,
// "Dependencies").
//
// Operands are bf16 bit patterns. The left operand `a` is row-major [rows x reduction]; the
// right operand is packed as in tile_kernels_bf16.hpp: column panels of 64, each the pairs of
// the reduction dimension, then the column, then the element of the pair, which is exactly the
// row layout of an AMX right-hand tile (16 columns x 2 bf16 per 64-byte row), read with the
// panel's width as stride. Accumulation is fp32. Subnormal bf16 inputs count as zero, as they do
// for vdpbf16ps.

#include <cstdint>

namespace flashattn::detail::cpu {

// The reduction dimension of the AMX products must be a multiple of this many bf16 (one tile's
// row of 64 bytes); callers zero-pad it.
inline constexpr std::int64_t kAmxReduction = 32;

constexpr std::int64_t pad_to_amx_reduction(std::int64_t n) {
  return (n + kAmxReduction - 1) / kAmxReduction * kAmxReduction;
}

// Whether this CPU has AMX-TILE and AMX-BF16 and the kernel lets this process use the tile
// registers: Linux hands out the 8 KiB of tile state only on request (arch_prctl
// ARCH_REQ_XCOMP_PERM), which the first call makes. The AMX path also needs AVX512-BF16 to round
// the probabilities: amx_supported (bf16_products.hpp) checks both.
bool amx_tiles_usable();

// c[rows x columns] = a · B (accumulate false) or c += a · B (accumulate true), fp32 c row-major
// with leading dimension ld_c; a [rows x reduction] bf16 row-major (ld_a); b_packed the
// [reduction x columns] right operand in panels of 64 columns (bf16_key_index layout with
// dims_padded = reduction, or bf16_value_index with keys_even = reduction). columns is a
// multiple of 16, reduction of kAmxReduction. Each thread's tile registers are configured on
// entry and released on return.
void amx_product(float* c, std::int64_t ld_c, bool accumulate, const std::uint16_t* a,
                 std::int64_t ld_a, const std::uint16_t* b_packed, std::int64_t rows,
                 std::int64_t columns, std::int64_t reduction);

}  // namespace flashattn::detail::cpu
