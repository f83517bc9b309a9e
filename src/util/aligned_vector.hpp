#pragma once

// std::vector whose storage starts on a 64-byte boundary: a cache line, one AVX-512 vector.
// malloc gives 16-byte alignment, so every full-vector load from a packed panel or tile in a
// plain std::vector straddled two cache lines (docs/tuning.md).

#include <cstddef>
#include <new>
#include <type_traits>
#include <utility>
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

// The same allocation with elements default-initialized: a vector of floats sized without the
// zero fill that value-initialization writes, for buffers every element of which is written
// before it is read (the decode path's per-chunk statistics, filled as each chunk starts).
template <class T>
struct UninitializedCacheLineAllocator : CacheLineAllocator<T> {
  template <class U>
  struct rebind {
    using other = UninitializedCacheLineAllocator<U>;
  };
  UninitializedCacheLineAllocator() = default;
  template <class U>
  UninitializedCacheLineAllocator(const UninitializedCacheLineAllocator<U>&) {}

  template <class U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

template <class T>
using UninitializedAlignedVector = std::vector<T, UninitializedCacheLineAllocator<T>>;

}  // namespace flashattn::detail
