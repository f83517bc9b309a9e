#pragma once

// What the ring (ring.cpp) and the shard scatter and gather (scatter.cpp) share: an MPI datatype
// for one row of a shard, and a wait that gives up instead of hanging.

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "flashattn/dist.hpp"

namespace flashattn::dist::transport {

// An MPI datatype of `bytes` contiguous bytes (one (batch, row) of a shard: heads x dim
// elements), freed on scope exit: counts of rows stay far below MPI's int limit where counts of
// bytes would not.
class RowType {
 public:
  explicit RowType(std::int64_t bytes) {
    MPI_Type_contiguous(static_cast<int>(bytes), MPI_BYTE, &type_);
    MPI_Type_commit(&type_);
  }
  ~RowType() { MPI_Type_free(&type_); }
  RowType(const RowType&) = delete;
  RowType& operator=(const RowType&) = delete;
  MPI_Datatype get() const { return type_; }

 private:
  MPI_Datatype type_ = MPI_DATATYPE_NULL;
};

// Waits for every request, at most timeout_seconds: a peer that never comes (dead, or stopped
// calling) makes this rank raise RingAborted("<caller>: rank <rank>: <what> ...") instead of
// hanging. Sleeps between polls once the wait has lasted a while, so that a waiting thread does
// not take a core from the compute threads.
inline void wait_bounded(std::vector<MPI_Request>& requests, double timeout_seconds,
                         const char* caller, int rank, const std::string& what) {
  const auto start = std::chrono::steady_clock::now();
  for (int polls = 0;; ++polls) {
    int done = 0;
    MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done, MPI_STATUSES_IGNORE);
    if (done) return;
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited > timeout_seconds) {
      throw RingAborted(std::string(caller) + ": rank " + std::to_string(rank) + ": " + what +
                        " within timeout_seconds = " + std::to_string(timeout_seconds) +
                        " (a rank died or stopped calling)");
    }
    if (polls > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

}  // namespace flashattn::dist::transport
