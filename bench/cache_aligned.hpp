#pragma once

// std::vector storage on a 64-byte boundary, as a framework's tensors have, for the inputs that
// `flashattn bench`, `flashattn demo` and the Google Benchmark target time the library on.

#include <cstddef>
#include <new>
#include <vector>

namespace flashattn::bench {

// Allocates through the aligned forms of operator new and delete; stateless.
template <class T>
struct CacheAligned {
  using value_type = T;
  static constexpr std::align_val_t kAlignment{64};

  CacheAligned() noexcept = default;
  template <class Other>
  CacheAligned(const CacheAligned<Other>&) noexcept {}

  T* allocate(std::size_t count) {
    return static_cast<T*>(::operator new(sizeof(T) * count, kAlignment));
  }
  void deallocate(T* data, std::size_t) noexcept { ::operator delete(data, kAlignment); }
  friend bool operator==(const CacheAligned&, const CacheAligned&) noexcept { return true; }
};

template <class T>
using CacheAlignedVector = std::vector<T, CacheAligned<T>>;

}  // namespace flashattn::bench
