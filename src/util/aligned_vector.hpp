#pragma once

// std::vector whose storage starts on a 64-byte boundary: a cache line, one AVX-512 vector.
// malloc gives 16-byte alignment, so every full-vector load from a packed panel or tile in a
// plain std::vector straddled two cache lines (docs/tuning.md).

#include <cstddef>
#include <new>
#include <vector>

namespace flashattn::detail {

inline constexpr std::size_t kCacheLineBytes = 64;

template <class T>
struct CacheLineAllocator {
  using value_type = T;

  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}

  T* allocate(std::size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{kCacheLineBytes}));
  }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t{kCacheLineBytes}); }

  template <class U>
  bool operator==(const CacheLineAllocator<U>&) const {
    return true;
  }
};

template <class T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

}  // namespace flashattn::detail
