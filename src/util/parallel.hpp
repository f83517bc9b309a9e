#pragma once

// One OpenMP loop over independent tasks, with per-thread scratch, that lets exceptions out.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <optional>

namespace flashattn::detail {

// Runs body(scratch, task) for every task in [0, tasks) on `threads` OpenMP threads with a
// dynamic schedule; each thread builds its scratch once with make_scratch(). The threads claim
// tasks from one counter, so in increasing order: a task may wait for an earlier one (the flash
// backward's dbias sums do), which has then been claimed and runs or ran. An exception thrown
// in a thread, std::bad_alloc while building scratch for one, would call std::terminate if it
// left the parallel region: it is caught there, the remaining tasks are skipped, and the first
// one is rethrown on the calling thread after the region.
template <class MakeScratch, class Body>
void parallel_tasks(int threads, std::int64_t tasks, MakeScratch&& make_scratch, Body&& body) {
  std::exception_ptr failure;
  std::atomic<bool> failed{false};
  std::atomic<std::int64_t> next{0};
  auto record = [&] {
#pragma omp critical(flashattn_parallel_tasks_failure)
    if (!failure) failure = std::current_exception();
    failed.store(true, std::memory_order_relaxed);
  };
  // A team larger than the task count only adds threads to wake: a call with one task (a tiny
  // decode, a single small head) runs on the calling thread without forking.
  const int team =
      static_cast<int>(std::min<std::int64_t>(threads, std::max<std::int64_t>(tasks, 1)));
#pragma omp parallel num_threads(team) if (team > 1)
  {
    std::optional<decltype(make_scratch())> scratch;
    try {
      scratch.emplace(make_scratch());
    } catch (...) {
      record();
    }
    for (std::int64_t task = next.fetch_add(1, std::memory_order_relaxed); task < tasks;
         task = next.fetch_add(1, std::memory_order_relaxed)) {
      if (failed.load(std::memory_order_relaxed)) continue;
      try {
        body(*scratch, task);
      } catch (...) {
        record();
      }
    }
  }
  if (failure) std::rethrow_exception(failure);
}

}  // namespace flashattn::detail
