#pragma once

// Offers the 2 MiB-aligned interior of a fresh allocation to the kernel for transparent huge
// pages, before anything touches it: a gather buffer of tens of MiB, allocated per call, paid one
// page fault per 4 KiB, which in a guest cost the paged KV cache's gather more than the copy
// itself (docs/tuning.md). A no-op where the kernel offers none (other systems, THP "never").

#include <cstddef>
#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace flashattn::detail {

inline void advise_huge_pages(void* data, std::size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr std::uintptr_t kHugePage = std::uintptr_t{2} << 20;
  const auto first = reinterpret_cast<std::uintptr_t>(data);
  const std::uintptr_t begin = (first + kHugePage - 1) & ~(kHugePage - 1);
  const std::uintptr_t end = (first + bytes) & ~(kHugePage - 1);
  // Advice only: a refusal (EINVAL where THP is off) changes nothing but the speed.
  if (end > begin)
    static_cast<void>(madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE));
#else
  static_cast<void>(data);
  static_cast<void>(bytes);
#endif
}

}  // namespace flashattn::detail
