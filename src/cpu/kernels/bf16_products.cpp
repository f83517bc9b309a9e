#include "cpu/kernels/bf16_products.hpp"

#include <atomic>
#include <cstdlib>
#include <string_view>

#include "cpu/kernels/tile_kernels_amx.hpp"
#include "cpu/kernels/tile_kernels_bf16.hpp"

namespace flashattn::detail::cpu {

bool amx_supported() {
  static const bool supported = bf16_products_supported() && amx_tiles_usable();
  return supported;
}

const char* bf16_products_name(Bf16Products products) {
  switch (products) {
    case Bf16Products::widened:
      return "widened";
    case Bf16Products::avx512_bf16:
      return "avx512_bf16";
    case Bf16Products::amx:
      return "amx";
  }
  return "unknown";
}

std::vector<Bf16Products> supported_bf16_products() {
  std::vector<Bf16Products> supported{Bf16Products::widened};
  if (bf16_products_supported()) supported.push_back(Bf16Products::avx512_bf16);
  if (amx_supported()) supported.push_back(Bf16Products::amx);
  return supported;
}

namespace {

// AMX where the CPU has it. Else vdpbf16ps on AMD CPUs, widening on Intel ones: the rate of a
// 512-bit vdpbf16ps against an fp32 FMA is a property of the core, twice the FLOPs of an FMA on
// Zen 5, half of them on Sapphire Rapids (docs/tuning.md). Decided by the vendor rather than
// timed at start-up, so that the choice, and with it the rounding of the results, is the same
// in every process on one machine.
Bf16Products default_bf16_products() {
  const std::vector<Bf16Products> supported = supported_bf16_products();
  if (const char* setting = std::getenv("FLASHATTN_BF16_PRODUCTS")) {
    for (Bf16Products products : supported) {
      if (std::string_view(setting) == bf16_products_name(products)) return products;
    }
  }
  if (supported.back() == Bf16Products::amx) return Bf16Products::amx;
  if (supported.back() == Bf16Products::avx512_bf16 && __builtin_cpu_is("amd")) {
    return Bf16Products::avx512_bf16;
  }
  return Bf16Products::widened;
}

constexpr int kDefault = -1;
std::atomic<int> forced_bf16_products{kDefault};

}  // namespace

Bf16Products active_bf16_products() {
  static const Bf16Products default_products = default_bf16_products();
  const int forced = forced_bf16_products.load(std::memory_order_relaxed);
  return forced == kDefault ? default_products : static_cast<Bf16Products>(forced);
}

void force_bf16_products(std::optional<Bf16Products> products) {
  forced_bf16_products.store(products ? static_cast<int>(*products) : kDefault,
                             std::memory_order_relaxed);
}

void bf16_tile_product(Bf16Products products, float* c, std::int64_t ld_c, bool accumulate,
                       const std::uint16_t* a, std::int64_t ld_a, const std::uint16_t* b_packed,
                       std::int64_t rows, std::int64_t columns, std::int64_t reduction) {
  if (products == Bf16Products::amx) {
    amx_product(c, ld_c, accumulate, a, ld_a, b_packed, rows, columns, reduction);
  } else if (accumulate) {
    accumulate_pv_tile_bf16(c, ld_c, a, ld_a, b_packed, reduction, rows, columns);
  } else {
    scores_tile_bf16(c, ld_c, a, ld_a, b_packed, rows, columns, reduction, 1.0f);
  }
}

}  // namespace flashattn::detail::cpu
