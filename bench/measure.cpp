// Verifying and timing the paths of one case.

#include "measure.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <functional>
#include <limits>
#include <random>
#include <span>

#include "ceilings.hpp"
#include "flashattn/backward.hpp"
#include "flashattn/introspect.hpp"
#include "timing.hpp"

namespace flashattn::cli {

const char* status_name(BackwardResult::Status status) {
  switch (status) {
    case BackwardResult::Status::verified:
      return "yes";
    case BackwardResult::Status::failed:
      return "no";
    case BackwardResult::Status::skipped:
      return "skipped";
  }
  return "";
}

namespace {

// User + system CPU seconds of this process, all threads.
double process_cpu_seconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  auto seconds = [](const timeval& time) {
    return static_cast<double>(time.tv_sec) + 1e-6 * static_cast<double>(time.tv_usec);
  };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

// NaN everywhere, so that an element a path fails to write cannot pass verification.
void poison(HostTensor& tensor, std::vector<float>& lse) {
  fill_nan(tensor);
  std::fill(lse.begin(), lse.end(), std::numeric_limits<float>::quiet_NaN());
}

// CPU time this process uses while `runs` runs over its wall time times the threads.
std::optional<double> cpu_share_of(int threads, const std::function<void()>& runs) {
  const double cpu_before = process_cpu_seconds();
  const auto start = std::chrono::steady_clock::now();
  runs();
  const double wall =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (wall <= 0.0) return std::nullopt;
  return (process_cpu_seconds() - cpu_before) / (wall * threads);
}

std::span<const std::byte> bytes_of(const HostTensor& tensor) {
  return {static_cast<const std::byte*>(tensor.data()),
          static_cast<std::size_t>(tensor.numel()) * dtype_size(tensor.dtype)};
}

// The backward half of a case: a fixed random dO, the gradients and their oracle. Each path's
// backward reads the out and lse of that path's own forward, which `out` and `lse` hold when run()
// is called right after it.
class BackwardRun {
 public:
  BackwardRun(const HostTensor& q, const HostTensor& k, const HostTensor& v, const HostTensor& out,
              const std::vector<float>& lse, const AttentionOptions& options,
              const std::vector<std::int64_t>& rows, double reference_budget_flops,
              std::mt19937_64& rng)
      : dout_(random_tensor(q.dtype, q.shape, rng)),
        dq_(q.dtype, q.shape),
        dk_(k.dtype, k.shape),
        dv_(v.dtype, v.shape),
        problem_{q, k, v, dout_, out, lse, options},
        oracle_(problem_, rows, reference_budget_flops) {}

  // Checks `impl`'s backward and, when it passes and `timed`, times it (median of `repeat`), in
  // alternation with `forward`, the path's forward, and `peak` before that. The standard path
  // runs even when not timed, on the slice only: its error is the baseline of the flash
  // tolerance, and its dK, dV the oracle where the reference would cost too much.
  BackwardResult run(AttentionImpl impl, bool timed, int repeat, int threads,
                     const std::function<void()>& forward, const PeakRun& peak) {
    BackwardResult result;
    if (impl == AttentionImpl::standard) {
      if (std::optional<std::string> refusal = standard_refusal()) {
        result.reason = *refusal;
        return result;
      }
      if (!timed) {
        oracle_.check_standard(oracle_.run_on_slice(AttentionImpl::standard, threads));
        return result;
      }
    }
    auto call = [&] {
      attention_backward(impl, dout_.view(), problem_.q.view(), problem_.k.view(),
                         problem_.v.view(), problem_.out.view(), problem_.lse.data(), dq_.view(),
                         dk_.view(), dv_.view(), problem_.options);
    };
    fill_nan(dq_);
    fill_nan(dk_);
    fill_nan(dv_);
    call();
    const SliceGradients slice = oracle_.slice_of(dq_, dk_, dv_);
    result.checks = impl == AttentionImpl::standard ? oracle_.check_standard(slice)
                                                    : oracle_.check_flash(slice);
    result.oracle = oracle_.name(impl);
    if (!result.checks.passes()) {
      result.status = BackwardResult::Status::failed;
      return result;
    }
    result.status = BackwardResult::Status::verified;
    // The forward rewrites out and lse with the same values (it is deterministic), so each
    // backward still reads its own forward's outputs.
    RoundSeconds rounds;
    result.cpu_share = cpu_share_of(threads, [&] {
      rounds = round_robin_seconds(repeat, {[&] { peak(); }, forward, call});
    });
    result.peak = PeakPairs{peak.flops(), rounds.median[0], rounds.over_previous[1]};
    result.forward_seconds = rounds.median[1];
    result.seconds = rounds.median[2];
    result.over_forward = rounds.over_previous[2];
    return result;
  }

 private:
  // The standard backward holds two seqlen_q x seqlen_kv fp32 matrices per thread; where the
  // library would refuse that for lack of memory, say so instead of stopping the sweep.
  std::optional<std::string> standard_refusal() {
    const std::int64_t needed = backward_scratch_bytes(
        AttentionImpl::standard, dout_.view(), problem_.q.view(), problem_.k.view(),
        problem_.v.view(), problem_.out.view(), problem_.lse.data(), dq_.view(), dk_.view(),
        dv_.view(), problem_.options);
    const std::int64_t limit = memory_limit_bytes();
    if (needed <= limit) return std::nullopt;
    return "the standard backward needs " + std::to_string(needed >> 20) + " MiB of scratch, " +
           "more than the " + std::to_string(limit >> 20) + " MiB of this machine";
  }

  HostTensor dout_, dq_, dk_, dv_;
  BackwardProblem problem_;
  BackwardOracle oracle_;
};

}  // namespace

CaseResult run_case(const Case& shape, const BenchOptions& options, int threads,
                    const PeakRun& peak) {
  std::mt19937_64 rng(options.seed);
  const std::array<std::int64_t, 4> dims = {shape.batch, shape.seqlen_q(), shape.heads,
                                            shape.head_dim};
  const std::array<std::int64_t, 4> kv_dims = {shape.batch, shape.seqlen, shape.kv_heads(),
                                               shape.head_dim};
  const HostTensor q = random_tensor(shape.dtype, dims, rng);
  const HostTensor k = random_tensor(shape.dtype, kv_dims, rng);
  const HostTensor v = random_tensor(shape.dtype, kv_dims, rng);
  const int repeat = shape.decode ? std::max(options.repeat, kDecodeMinRepeat) : options.repeat;
  AttentionOptions attention;
  attention.causal = shape.causal;
  attention.num_threads = threads;

  CaseResult result;
  result.shape = shape;
  result.flops = attention_flops(shape.batch, shape.heads, shape.seqlen_q(), shape.seqlen,
                                 shape.head_dim, attention);
  result.backward_flops = attention_backward_flops(shape.batch, shape.heads, shape.seqlen_q(),
                                                   shape.seqlen, shape.head_dim, attention);
  const std::vector<std::int64_t> rows = sample_rows(shape.seqlen_q(), options.check_rows, rng);
  const ReferenceRows reference = reference_rows(q, k, v, attention, rows);

  HostTensor out(shape.dtype, dims);
  std::vector<float> lse(static_cast<std::size_t>(shape.batch * shape.heads * shape.seqlen_q()));
  // After the forward's draws, so that --backward leaves the forward's inputs and rows as they
  // were. Decoding has no backward.
  std::optional<BackwardRun> backward;
  if (options.backward && !shape.decode)
    backward.emplace(q, k, v, out, lse, attention, rows, options.backward_reference_gflop * 1e9,
                     rng);
  PathErrors standard_errors;
  bool standard_verified = false;
  for (const AttentionImpl impl : {AttentionImpl::standard, AttentionImpl::flash}) {
    auto call = [&] {
      attention_forward(impl, q.view(), k.view(), v.view(), out.view(), lse.data(), attention);
    };
    poison(out, lse);
    call();
    PathResult path;
    path.impl = impl;
    path.errors = errors_against(reference, out, lse);
    if (impl == AttentionImpl::standard) {
      standard_errors = path.errors;
      path.tolerance = standard_error_bound(q, k, v, attention, rows);
    } else {
      path.tolerance = tolerance_from_standard(standard_errors, shape.dtype, max_abs(v));
    }
    // Flash's tolerance is relative to the standard path's error, so it means nothing when the
    // standard path itself is off.
    path.verified = path.tolerance.admits(path.errors) &&
                    (impl == AttentionImpl::standard || standard_verified);
    if (impl == AttentionImpl::standard) standard_verified = path.verified;
    const bool timed = std::find(options.impls.begin(), options.impls.end(), impl_name(impl)) !=
                       options.impls.end();
    if (backward) {
      if (path.verified) {
        path.backward = backward->run(impl, timed, repeat, threads, call, peak);
        if (path.backward->forward_seconds) {
          path.seconds = path.backward->forward_seconds;
          path.cpu_share = path.backward->cpu_share;
          path.peak = path.backward->peak;
        }
      } else {
        path.backward.emplace();
        path.backward->reason = "its forward failed verification";
      }
    }
    if (timed && path.verified && shape.decode) {
      bench::MemoryRead read(threads, {bytes_of(k), bytes_of(v)});
      PairedSeconds times;
      path.cpu_share = cpu_share_of(threads, [&] {
        times = paired_median_seconds(
            repeat, [&] { read.run(1); }, call);
      });
      path.read_seconds = times.first;
      path.seconds = times.second;
      if (times.second_over_first > 0.0) path.over_read = 1.0 / times.second_over_first;
    }
    if (timed && path.verified && !path.seconds) {
      PairedSeconds times;
      path.cpu_share = cpu_share_of(threads, [&] {
        times = paired_median_seconds(
            repeat, [&] { peak(); }, call);
      });
      path.peak = PeakPairs{peak.flops(), times.first, times.second_over_first};
      path.seconds = times.second;
    }
    if (timed && path.verified && impl == AttentionImpl::flash && !shape.decode && threads > 1 &&
        (shape.seed_shape || options.scaling)) {
      AttentionOptions one_thread = attention;
      one_thread.num_threads = 1;
      const PairedSeconds times = paired_median_seconds(repeat, call, [&] {
        attention_forward(impl, q.view(), k.view(), v.view(), out.view(), lse.data(), one_thread);
      });
      path.one_thread_seconds = times.second;
      path.speedup_over_one_thread = times.second_over_first;
    }
    if (timed) result.paths.push_back(path);
  }
  // --impls order.
  std::stable_sort(result.paths.begin(), result.paths.end(), [&](const auto& a, const auto& b) {
    auto rank = [&](AttentionImpl impl) {
      return std::find(options.impls.begin(), options.impls.end(), impl_name(impl)) -
             options.impls.begin();
    };
    return rank(a.impl) < rank(b.impl);
  });
  return result;
}

}  // namespace flashattn::cli
