#pragma once

// One case run: each path verified against the fp64 reference, then timed beside the peak loop
// or the plain read of K and V; with --backward its backward too. The results of a case.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "backward_check.hpp"
#include "cases.hpp"
#include "flashattn/attention.hpp"
#include "machine.hpp"
#include "verify.hpp"

namespace flashattn::cli {

// A forward path's timed calls, each right after a run of the peak loop of its dtype (PeakRun,
// `peak_flops` a run): the median seconds of those runs and the median over the pairs of call
// time / run time.
struct PeakPairs {
  double peak_flops = 0.0, peak_seconds = 0.0, over_peak = 0.0;

  // The peak loop's GFLOP/s in those runs.
  std::optional<double> peak_gflops() const {
    if (peak_seconds <= 0.0) return std::nullopt;
    return peak_flops / peak_seconds * 1e-9;
  }
  // The median over the pairs of the call's GFLOP/s over the run's, for calls of `flops`.
  std::optional<double> ratio(double flops) const {
    if (peak_flops <= 0.0 || over_peak <= 0.0) return std::nullopt;
    return flops / peak_flops / over_peak;
  }
};

// One path's backward: verified then timed, failed (not timed), or skipped (not run, `reason`
// says why).
struct BackwardResult {
  enum class Status { verified, failed, skipped };
  Status status = Status::skipped;
  std::string oracle, reason;
  BackwardChecks checks;
  std::optional<double> seconds, cpu_share;
  // Timed alternately with the path's forward (round_robin_seconds): that forward's median
  // seconds and the median of backward / forward over the pairs.
  std::optional<double> forward_seconds, over_forward;
  // The forward's runs against the peak loop's run before each (PathResult::peak).
  std::optional<PeakPairs> peak;
};

// "yes", "no" or "skipped", as the CSV and the table write a backward's status.
const char* status_name(BackwardResult::Status status);

struct PathResult {
  AttentionImpl impl = AttentionImpl::flash;
  bool verified = false;
  PathErrors errors;
  Tolerance tolerance;
  std::optional<double> seconds;  // empty: not timed (failed verification)
  // CPU time this process used during the timed calls over their wall time times the threads:
  // about 1 when the threads had the cores to themselves, less when another process took some.
  std::optional<double> cpu_share;
  std::optional<BackwardResult> backward;  // with --backward
  // Decode cases: each call alternated with a read of the same K and V on the same threads
  // (bench::MemoryRead): that read's median seconds and the median over the pairs of read time /
  // call time, the call's bandwidth as a fraction of that ceiling in the same stretch of load.
  std::optional<double> read_seconds, over_read;
  // The other cases: each timed call right after a run of the dtype's peak loop (PeakRun).
  std::optional<PeakPairs> peak;
  // Flash on the seed shape (every forward case with --scaling) and more than one thread: calls
  // on one thread alternated with calls on all of them, the median seconds of the one-thread
  // calls and the median over the pairs of one-thread time / all-threads time, the speed-up.
  std::optional<double> one_thread_seconds, speedup_over_one_thread;
};

struct CaseResult {
  Case shape;
  double flops = 0.0;
  double backward_flops = 0.0;    // 2.5 x flops, attention_backward_flops
  std::vector<PathResult> paths;  // the timed ones, in --impls order

  const PathResult* find(AttentionImpl impl) const {
    for (const PathResult& path : paths) {
      if (path.impl == impl) return &path;
    }
    return nullptr;
  }
  std::optional<double> gflops(AttentionImpl impl) const {
    const PathResult* path = find(impl);
    if (path == nullptr || !path->seconds || *path->seconds <= 0.0) return std::nullopt;
    return flops / *path->seconds * 1e-9;
  }
  // Decode cases: K and V bytes read per second, in GB/s.
  std::optional<double> kv_gbps(AttentionImpl impl) const {
    const PathResult* path = find(impl);
    if (!shape.decode || path == nullptr || !path->seconds || *path->seconds <= 0.0) {
      return std::nullopt;
    }
    return shape.kv_bytes() / *path->seconds * 1e-9;
  }
  // Decode cases: the read ceiling timed with `impl`'s calls, in GB/s.
  std::optional<double> read_gbps(AttentionImpl impl) const {
    const PathResult* path = find(impl);
    if (path == nullptr || !path->read_seconds || *path->read_seconds <= 0.0) return std::nullopt;
    return shape.kv_bytes() / *path->read_seconds * 1e-9;
  }
  std::optional<double> backward_gflops(AttentionImpl impl) const {
    const PathResult* path = find(impl);
    if (path == nullptr || !path->backward || !path->backward->seconds ||
        *path->backward->seconds <= 0.0) {
      return std::nullopt;
    }
    return backward_flops / *path->backward->seconds * 1e-9;
  }
  // Backward time over the same path's forward time.
  std::optional<double> backward_over_forward(AttentionImpl impl) const {
    const PathResult* path = find(impl);
    if (path == nullptr || !path->seconds || *path->seconds <= 0.0 || !path->backward ||
        !path->backward->seconds) {
      return std::nullopt;
    }
    if (path->backward->over_forward) return path->backward->over_forward;
    return *path->backward->seconds / *path->seconds;
  }
};

// Runs one case: the standard path first (its error against the reference is the baseline of
// the flash tolerance, so it runs even when only flash is timed), then flash; each path's first
// call is verified and doubles as the warm-up of its timed calls. With --backward, each path's
// backward runs right after its forward, while `out` and `lse` still hold that forward's outputs,
// and a verified backward is timed in alternation with the forward, whose time comes from those
// runs (backward / forward then compares calls made back to back on a machine whose load drifts).
CaseResult run_case(const Case& shape, const BenchOptions& options, int threads,
                    const PeakRun& peak);

}  // namespace flashattn::cli
