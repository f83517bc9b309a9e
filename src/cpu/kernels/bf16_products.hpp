#pragma once

// Which way the tile products of bf16 inputs run on this CPU, and the one product call that the
// drivers make whichever it is: widened to fp32 (any CPU), vdpbf16ps (tile_kernels_bf16.hpp) or
// AMX tiles (tile_kernels_amx.hpp). The choice follows the CPU, never a timing, so one machine
// always gives the same bits.

#include <cstdint>
#include <optional>
#include <vector>

namespace flashattn::detail::cpu {

// How the tile products of bf16 inputs run: widened to fp32 when packed and multiplied by the
// fp32 kernels (any CPU), with vdpbf16ps (these kernels), or on AMX tiles (tile_kernels_amx.hpp).
enum class Bf16Products { widened, avx512_bf16, amx };

const char* bf16_products_name(Bf16Products products);

// The ways this CPU supports, `widened` first.
std::vector<Bf16Products> supported_bf16_products();

// The way bf16 inputs use now: AMX where supported, else vdpbf16ps on AMD CPUs that have it
// (Zen 5: twice the FLOPs of an fp32 FMA), else widened (an Intel vdpbf16ps retires half of
// them; docs/tuning.md has the figures); the environment variable
// FLASHATTN_BF16_PRODUCTS=widened|avx512_bf16|amx picks another supported one (read once), and
// tests pin one with force_bf16_products (std::nullopt restores the default; not thread-safe
// against concurrent attention calls).
Bf16Products active_bf16_products();
void force_bf16_products(std::optional<Bf16Products> products);

// Whether this CPU has AMX-TILE and AMX-BF16, and AVX512-BF16 for rounding the probabilities,
// and the kernel lets this process use the tile registers (amx_tiles_usable).
bool amx_supported();

// c[rows x columns] = a · B (accumulate false) or c += a · B (accumulate true) with `products`
// (avx512_bf16 or amx), as amx_product (tile_kernels_amx.hpp) states it: a [rows x reduction]
// bf16 row-major (ld_a), B packed in panels of 64 columns, each a pair of the reduction, then the
// column, then the element of the pair (bf16_key_index with dims_padded = reduction, or
// bf16_value_index with keys_even = reduction); columns a multiple of 16, reduction of
// kAmxReduction. Both ways read the same operands.
void bf16_tile_product(Bf16Products products, float* c, std::int64_t ld_c, bool accumulate,
                       const std::uint16_t* a, std::int64_t ld_a, const std::uint16_t* b_packed,
                       std::int64_t rows, std::int64_t columns, std::int64_t reduction);

}  // namespace flashattn::detail::cpu
