// AMX bf16 tile products (see tile_kernels_amx.hpp). The eight tile registers hold a 32 x 32
// block of c as four 16 x 16 accumulators, two 16-row tiles of a and two 16-column tiles of b;
// per 32-element step of the reduction, 4 tile loads feed 4 TDPBF16PS. A ragged last row block
// is run with tiles of fewer rows (a new configuration), a ragged last column block with one
// column tile, so c is never read or written outside [rows x columns].

#include "cpu/kernels/tile_kernels_amx.hpp"

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "cpu/kernels/tile_kernels.hpp"

#define FLASHATTN_AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))

namespace flashattn::detail::cpu {
namespace {

// Tile registers (the intrinsics take the register number as a literal): tmm0, tmm1 accumulate
// the block's upper 16 rows (left, right column tile), tmm2, tmm3 its lower rows; tmm4, tmm5
// hold a's upper and lower row tiles, tmm6, tmm7 b's left and right column tiles.
enum Tile {
  kUpperLeft = 0,
  kUpperRight,
  kLowerLeft,
  kLowerRight,
  kUpperA,
  kLowerA,
  kLeftB,
  kRightB
};

constexpr int kTileRows = 16;
constexpr int kTileBytes = 64;  // per tile row: 16 fp32, or 32 bf16

// The 64-byte operand of LDTILECFG (palette 1).
struct TileConfig {
  std::uint8_t palette = 1;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t bytes_per_row[16] = {};
  std::uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64);

// Tiles for a block of upper + lower rows (upper in 1..16, lower in 0..16); unused tiles stay
// unconfigured (0 rows, 0 bytes).
FLASHATTN_AMX_TARGET void configure(int upper, int lower) {
  TileConfig config;
  auto set = [&](Tile tile, int rows) {
    config.rows[tile] = static_cast<std::uint8_t>(rows);
    config.bytes_per_row[tile] = rows > 0 ? kTileBytes : 0;
  };
  set(kUpperLeft, upper);
  set(kUpperRight, upper);
  set(kUpperA, upper);
  set(kLowerLeft, lower);
  set(kLowerRight, lower);
  set(kLowerA, lower);
  set(kLeftB, kTileRows);
  set(kRightB, kTileRows);
  // The stores into `config` have no other reader than LDTILECFG, which GCC 12 does not always
  // count as one: in a standalone build at -O2 it kept the palette byte alone and the first tile
  // instruction then faulted (SIGILL). The empty asm statement reads all of `config`.
  asm volatile("" : : "m"(config) : "memory");
  _tile_loadconfig(&config);
}

// One block: c[up to 32 rows x up to 32 columns] (+)= a · b over `steps` 32-element steps.
// b points at the block's first column in its panel; b_step elements apart per step.
template <bool kLower, bool kRight>
FLASHATTN_AMX_TARGET inline void product_block(float* c, std::int64_t ld_c, bool accumulate,
                                               const std::uint16_t* a, std::int64_t ld_a,
                                               const std::uint16_t* b, std::int64_t ld_b_bytes,
                                               std::int64_t b_step, std::int64_t steps) {
  const std::int64_t c_stride = ld_c * sizeof(float), a_stride = ld_a * sizeof(std::uint16_t);
  float* c_lower = c + kTileRows * ld_c;
  const std::uint16_t* a_lower = a + kTileRows * ld_a;
  constexpr std::int64_t kRightColumns = 2 * kTileRows;  // bf16 of 16 column pairs
  if (accumulate) {
    _tile_loadd(0, c, c_stride);
    if (kRight) _tile_loadd(1, c + kTileRows, c_stride);
    if (kLower) _tile_loadd(2, c_lower, c_stride);
    if (kLower && kRight) _tile_loadd(3, c_lower + kTileRows, c_stride);
  } else {
    _tile_zero(0);
    if (kRight) _tile_zero(1);
    if (kLower) _tile_zero(2);
    if (kLower && kRight) _tile_zero(3);
  }
  for (std::int64_t s = 0; s < steps; ++s) {
    const std::uint16_t* b_s = b + s * b_step;
    _tile_loadd(4, a + s * kAmxReduction, a_stride);
    _tile_loadd(6, b_s, ld_b_bytes);
    _tile_dpbf16ps(0, 4, 6);
    if (kRight) {
      _tile_loadd(7, b_s + kRightColumns, ld_b_bytes);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (kLower) {
      _tile_loadd(5, a_lower + s * kAmxReduction, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      if (kRight) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, c_stride);
  if (kRight) _tile_stored(1, c + kTileRows, c_stride);
  if (kLower) _tile_stored(2, c_lower, c_stride);
  if (kLower && kRight) _tile_stored(3, c_lower + kTileRows, c_stride);
}

FLASHATTN_AMX_TARGET void release_tiles() { _tile_release(); }

// Linux keeps the AMX tile state off until a process asks for it (arch/x86 XSTATE permission).
bool request_tile_permission() {
  constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
  constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
  return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
}

// CPUID leaf 7: AMX-BF16 is EDX bit 22, AMX-TILE bit 24. (__builtin_cpu_supports knows them in
// g++ 12 but not in clang 14, which the tsan build uses.)
bool cpu_has_amx_bf16() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
  constexpr unsigned kAmxBf16 = 1u << 22, kAmxTile = 1u << 24;
  return (edx & kAmxBf16) != 0 && (edx & kAmxTile) != 0;
}

}  // namespace

bool amx_tiles_usable() { return cpu_has_amx_bf16() && request_tile_permission(); }

FLASHATTN_AMX_TARGET void amx_product(float* c, std::int64_t ld_c, bool accumulate,
                                      const std::uint16_t* a, std::int64_t ld_a,
                                      const std::uint16_t* b_packed, std::int64_t rows,
                                      std::int64_t columns, std::int64_t reduction) {
  constexpr std::int64_t kBlock = 2 * kTileRows;
  const std::int64_t steps = reduction / kAmxReduction;
  int configured_rows = -1;
  for (std::int64_t r = 0; r < rows; r += kBlock) {
    const int block_rows = static_cast<int>(std::min(kBlock, rows - r));
    if (block_rows != configured_rows) {
      configure(std::min(block_rows, kTileRows), std::max(block_rows - kTileRows, 0));
      configured_rows = block_rows;
    }
    const bool lower = block_rows > kTileRows;
    for (std::int64_t j = 0; j < columns; j += kBlock) {
      const std::int64_t panel_begin = j / kPanelWidth * kPanelWidth;
      const std::int64_t width = std::min(kPanelWidth, columns - panel_begin);
      const std::uint16_t* b = b_packed + panel_begin * reduction + (j - panel_begin) * 2;
      // A step of 32 reduction elements is 16 pairs, each a row of `width` pairs in the panel.
      const std::int64_t b_step = kAmxReduction / 2 * width * 2;
      const std::int64_t ld_b_bytes = width * 2 * sizeof(std::uint16_t);
      float* c_block = c + r * ld_c + j;
      const std::uint16_t* a_block = a + r * ld_a;
      const bool right = j + kTileRows < columns;
      if (lower && right) {
        product_block<true, true>(c_block, ld_c, accumulate, a_block, ld_a, b, ld_b_bytes, b_step,
                                  steps);
      } else if (lower) {
        product_block<true, false>(c_block, ld_c, accumulate, a_block, ld_a, b, ld_b_bytes, b_step,
                                   steps);
      } else if (right) {
        product_block<false, true>(c_block, ld_c, accumulate, a_block, ld_a, b, ld_b_bytes, b_step,
                                   steps);
      } else {
        product_block<false, false>(c_block, ld_c, accumulate, a_block, ld_a, b, ld_b_bytes, b_step,
                                    steps);
      }
    }
  }
  release_tiles();
}

}  // namespace flashattn::detail::cpu
