#pragma once

// Wall-clock timing for the `flashattn` subcommands: medians of repeated calls, and calls timed
// in alternation so that their medians and ratios sample the same stretch of a shared machine's
// load.

#include <functional>
#include <vector>

namespace flashattn::cli {

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

// `repeat` rounds of calls[0], calls[1], ..., each call timed: the median seconds of each, and
// for each call after the first the median over the rounds of its time / the time of the call
// before it in the same round (over_previous[0] is 0). paired_median_seconds is the two-call case.
struct RoundSeconds {
  std::vector<double> median, over_previous;
};
RoundSeconds round_robin_seconds(int repeat, const std::vector<std::function<void()>>& calls);

}  // namespace flashattn::cli
