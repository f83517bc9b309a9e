#pragma once

#include <omp.h>

namespace flashattn::detail {

// Sets the calling thread's OpenMP thread count for the lifetime of the object. OpenBLAS's
// OpenMP build sizes its team from it when called outside a parallel region, and inside a
// one-thread region (which OpenMP does not count as parallel) it would otherwise start a team
// of all cores: this keeps sgemm to the threads the caller asked for. The setting is per thread
// (an ICV of the calling thread), so concurrent callers do not see each other's.
class ScopedOmpThreads {
 public:
  explicit ScopedOmpThreads(int threads) : saved_(omp_get_max_threads()) {
    omp_set_num_threads(threads);
  }
  ~ScopedOmpThreads() { omp_set_num_threads(saved_); }
  ScopedOmpThreads(const ScopedOmpThreads&) = delete;
  ScopedOmpThreads& operator=(const ScopedOmpThreads&) = delete;

 private:
  int saved_;
};

}  // namespace flashattn::detail
