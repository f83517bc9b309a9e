// The bench's read ceiling (bench/ceilings.hpp) must read every byte of its buffers once, on any
// thread count and from any alignment: a decode call's bandwidth is reported as a fraction of it.
// And the warning for an OpenBLAS that runs an SSE kernel on a wider CPU (bench/openblas_core.hpp)
// must name the setting that fits the CPU, and stay silent where nothing is wrong.

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "ceilings.hpp"
#include "openblas_core.hpp"

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

TEST(OpenblasFallbackWarning, NamesTheKernelThatFitsTheCpu) {
  using flashattn::bench::openblas_fallback_warning;
  // Debian 12's OpenBLAS on an Emerald Rapids-class Xeon: Prescott on an AVX-512 CPU.
  const std::optional<std::string> unknown_cpu =
      openblas_fallback_warning("Prescott", "", /*avx512f=*/true, /*avx2=*/true);
  ASSERT_TRUE(unknown_cpu.has_value());
  EXPECT_NE(unknown_cpu->find("runs its Prescott kernel"), std::string::npos) << *unknown_cpu;
  EXPECT_NE(unknown_cpu->find("does not recognize the CPU's model"), std::string::npos)
      << *unknown_cpu;
  EXPECT_NE(unknown_cpu->find("OPENBLAS_CORETYPE=SkylakeX selects its AVX-512 kernel"),
            std::string::npos)
      << *unknown_cpu;

  // Pinned by the user on an AVX2 CPU: the warning says the setting did it, and names Haswell.
  const std::optional<std::string> pinned =
      openblas_fallback_warning("Nehalem", "Nehalem", /*avx512f=*/false, /*avx2=*/true);
  ASSERT_TRUE(pinned.has_value());
  EXPECT_NE(pinned->find("OPENBLAS_CORETYPE=Nehalem pins that kernel"), std::string::npos)
      << *pinned;
  EXPECT_NE(pinned->find("OPENBLAS_CORETYPE=Haswell selects its AVX2 kernel"), std::string::npos)
      << *pinned;
  EXPECT_EQ(pinned->find("recognize"), std::string::npos) << *pinned;
}

TEST(OpenblasFallbackWarning, SilentWhereTheKernelFitsOrNothingWiderExists) {
  using flashattn::bench::openblas_fallback_warning;
  for (const char* core : {"SkylakeX", "Cooperlake", "SapphireRapids", "Haswell", "Zen"}) {
    EXPECT_FALSE(openblas_fallback_warning(core, "", true, true).has_value()) << core;
  }
  // An SSE kernel is the right one on a CPU without AVX2.
  EXPECT_FALSE(openblas_fallback_warning("Prescott", "", false, false).has_value());
  // The sanitizer builds' plain-loop sgemm.
  EXPECT_FALSE(
      openblas_fallback_warning(flashattn::bench::kOpenblasNotLinked, "", true, true).has_value());
}

}  // namespace
