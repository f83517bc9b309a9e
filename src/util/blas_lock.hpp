#pragma once

#include <mutex>

namespace flashattn::detail {

// Held by every library call that reaches OpenBLAS. Debian's OpenMP build of OpenBLAS picks its
// work buffers by OpenMP thread number, so two user threads each running sgemm as thread 0 of
// their own team can share a buffer and corrupt each other's result (seen as wrong standard-path
// outputs in the 8-user-thread test). Calls from one library call's own team have distinct
// thread numbers and need no lock; concurrent library calls take turns.
inline std::mutex& blas_mutex() {
  static std::mutex mutex;
  return mutex;
}

}  // namespace flashattn::detail
