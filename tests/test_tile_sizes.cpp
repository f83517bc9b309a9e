// The tile-size choice is a pure function of head_dim and the cache sizes (tile_sizes.hpp).

#include <gtest/gtest.h>

#include "cpu/kernels/tile_kernels.hpp"
#include "cpu/tile_sizes.hpp"

namespace flashattn::detail::cpu {
namespace {

constexpr CacheSizes kServerCore{48 * 1024, 2 * 1024 * 1024};  // e.g. Sapphire Rapids
constexpr CacheSizes kSmallCore{32 * 1024, 256 * 1024};        // e.g. an older client core

TEST(TileSizes, MeasuredChoiceOnALargeL2Core) {
  const TileSizes tiles = choose_tile_sizes(128, 128, kServerCore);
  EXPECT_EQ(tiles.rows, 256);
  EXPECT_EQ(tiles.keys, 128);
  EXPECT_EQ(tiles.blocks_per_task, 4);
}

// The choices measured on the two AMD cores (tile_sizes.cpp): Bc from the L1, Br from the L2.
TEST(TileSizes, MeasuredChoiceOnSmallerL2Cores) {
  const TileSizes zen3 = choose_tile_sizes(128, 128, {32 * 1024, 512 * 1024});
  EXPECT_EQ(zen3.rows, 128);
  EXPECT_EQ(zen3.keys, 80);
  EXPECT_EQ(zen3.blocks_per_task, 8);
  const TileSizes zen5 = choose_tile_sizes(128, 128, {48 * 1024, 1024 * 1024});
  EXPECT_EQ(zen5.rows, 256);
  EXPECT_EQ(zen5.keys, 128);
  EXPECT_EQ(zen5.blocks_per_task, 4);
}

TEST(TileSizes, WorkingSetFitsHalfOfL2AndTilesAreWholeVectors) {
  for (const CacheSizes caches : {kServerCore, kSmallCore, kFallbackCaches}) {
    for (std::int64_t head_dim : {1, 32, 40, 59, 64, 111, 128, 256}) {
      const TileSizes tiles = choose_tile_sizes(head_dim, head_dim, caches);
      const std::int64_t dims = pad_to_lanes(head_dim);
      SCOPED_TRACE(testing::Message() << "head_dim " << head_dim << ", L2 " << caches.l2_bytes);
      EXPECT_EQ(tiles.keys % kTileLanes, 0);
      EXPECT_EQ(tiles.rows % kTileLanes, 0);
      EXPECT_GE(tiles.rows, kTileLanes);
      EXPECT_LE(tiles.rows, 256);
      EXPECT_GE(tiles.keys, 64);
      // The V panel the P·V kernel streams from L1.
      EXPECT_LE(tiles.keys * kPanelWidth * 4, caches.l1d_bytes);
      if (tiles.rows > kTileLanes) {
        const std::int64_t floats = tiles.rows * (2 * dims + tiles.keys) + 2 * tiles.keys * dims;
        EXPECT_LE(floats * 4, caches.l2_bytes / 2);
      }
      // The fewest Q blocks from 4 to 8 that hold 1024 rows (8 where even 8 hold fewer) share
      // each packed K/V block, whatever L2 holds of their tiles.
      EXPECT_GE(tiles.blocks_per_task, 4);
      EXPECT_LE(tiles.blocks_per_task, 8);
      EXPECT_TRUE(tiles.blocks_per_task == 8 || tiles.blocks_per_task * tiles.rows >= 1024);
      EXPECT_TRUE(tiles.blocks_per_task == 4 || (tiles.blocks_per_task - 1) * tiles.rows < 1024);
    }
  }
}

// Q and K rows of head_dim, V and accumulator rows of head_dim_v: the working set counts each.
TEST(TileSizes, UnequalHeadDimsFitHalfOfL2) {
  for (const CacheSizes caches : {kServerCore, kSmallCore, kFallbackCaches}) {
    for (const auto& [d, dv] :
         {std::pair<std::int64_t, std::int64_t>{192, 128}, {576, 512}, {64, 256}, {59, 17}}) {
      const TileSizes tiles = choose_tile_sizes(d, dv, caches);
      const std::int64_t dims = pad_to_lanes(d) + pad_to_lanes(dv);
      SCOPED_TRACE(testing::Message()
                   << "head dims " << d << "/" << dv << ", L2 " << caches.l2_bytes);
      EXPECT_EQ(tiles.rows % kTileLanes, 0);
      if (tiles.rows > kTileLanes) {
        EXPECT_LE((tiles.rows * (dims + tiles.keys) + tiles.keys * dims) * 4, caches.l2_bytes / 2);
      }
      // Equal dims of the mean width give the same tiles.
      if ((pad_to_lanes(d) + pad_to_lanes(dv)) % (2 * kTileLanes) == 0) {
        const std::int64_t mean = (pad_to_lanes(d) + pad_to_lanes(dv)) / 2;
        EXPECT_EQ(tiles.rows, choose_tile_sizes(mean, mean, caches).rows);
      }
    }
  }
}

TEST(TileSizes, SmallerCachesNeverGiveLargerTiles) {
  for (std::int64_t head_dim : {64, 128, 256}) {
    const TileSizes large = choose_tile_sizes(head_dim, head_dim, kServerCore);
    const TileSizes small = choose_tile_sizes(head_dim, head_dim, kSmallCore);
    EXPECT_LE(small.rows, large.rows) << "head_dim " << head_dim;
    EXPECT_LE(small.keys, large.keys) << "head_dim " << head_dim;
  }
}

TEST(TileSizes, DetectedCachesArePlausible) {
  const CacheSizes caches = detect_cache_sizes();
  EXPECT_GE(caches.l1d_bytes, 8 * 1024);
  EXPECT_LE(caches.l1d_bytes, 1024 * 1024);
  EXPECT_GE(caches.l2_bytes, 64 * 1024);
}

}  // namespace
}  // namespace flashattn::detail::cpu
