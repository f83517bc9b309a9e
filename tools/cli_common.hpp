#pragma once

// Pieces shared by the `flashattn` subcommands.

#include <CLI/CLI.hpp>
#include <functional>

namespace flashattn::cli {

// Exit codes of the tool.
constexpr int kExitOk = 0;
constexpr int kExitError = 1;     // invalid input, unreadable or unwritable file
constexpr int kExitUsage = 2;     // bad command line
constexpr int kExitMismatch = 3;  // `demo`: the two paths disagree; `bench`: a path failed
                                  // verification

// Each subcommand adds itself to `app` and returns the action to run once `app` has parsed the
// command line and chosen that subcommand.
using Action = std::function<int()>;
Action add_demo_command(CLI::App& app);
Action add_run_command(CLI::App& app);
Action add_bench_command(CLI::App& app);

// Median wall-clock seconds of `repeat` back-to-back calls (the caller does any warm-up).
double median_seconds(int repeat, const std::function<void()>& call);

// `repeat` rounds of first() then second(), each call timed: the median seconds of each, and the
// median over the rounds of second's time / first's. On a shared machine whose load drifts, two
// medians taken one after the other can fall in different stretches of it; taken alternately
// they sample the same one, and each ratio compares calls made back to back.
struct PairedSeconds {
  double first = 0.0, second = 0.0, second_over_first = 0.0;
};
PairedSeconds paired_median_seconds(int repeat, const std::function<void()>& first,
                                    const std::function<void()>& second);

// The worker threads a call with `requested` threads uses (0 = all that OpenMP offers).
int resolved_threads(int requested);

}  // namespace flashattn::cli
