// The bench's read ceiling (bench/ceilings.hpp) must read every byte of its buffers once, on any
// thread count and from any alignment: a decode call's bandwidth is reported as a fraction of it.

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "ceilings.hpp"

namespace {

// The checksum MemoryRead documents, one byte at a time.
std::uint64_t placed_xor(std::span<const std::byte> bytes) {
  std::uint64_t sum = 0;
  for (const std::byte& byte : bytes) {
    sum ^= std::to_integer<std::uint64_t>(byte)
           << (8 * (reinterpret_cast<std::uintptr_t>(&byte) % 8));
  }
  return sum;
}

TEST(MemoryRead, ReadsEveryByteOnceOnAnyThreadCountAndAlignment) {
  std::mt19937 rng(20261201);
  std::vector<std::byte> storage(30000);
  for (std::byte& byte : storage) byte = static_cast<std::byte>(rng() % 255 + 1);  // never 0
  for (const std::size_t first_size : {0, 1, 7, 8, 9, 63, 100, 4097}) {
    for (const std::size_t offset : {0, 1, 3, 8, 13}) {
      for (const int threads : {1, 2, 3, 7}) {
        // Two buffers, as K and V: the second one past the first in the same storage.
        const std::span<const std::byte> first(storage.data() + offset, first_size);
        const std::span<const std::byte> second(storage.data() + 10000 + offset,
                                                3 * first_size + 5);
        flashattn::bench::MemoryRead read(threads, {first, second});
        EXPECT_EQ(read.work_per_unit(), static_cast<double>(first.size() + second.size()));
        const std::uint64_t expected = placed_xor(first) ^ placed_xor(second);
        for (const std::int64_t passes : {1, 2}) {
          read.run(passes);
          EXPECT_EQ(read.checksum(), expected)
              << "size " << first_size << ", offset " << offset << ", " << threads << " threads, "
              << passes << " passes";
        }
      }
    }
  }
}

}  // namespace
