// The CLI's timing helpers: which call runs when, and what each median and ratio belongs to.
// No assertion here is about how long anything takes.

#include <gtest/gtest.h>

#include <vector>

#include "timing.hpp"

namespace {

using flashattn::cli::paired_median_seconds;
using flashattn::cli::round_robin_seconds;

// `bench` times each forward right after a run of the peak loop and, with --backward, each
// backward right after that forward: the calls must go round in the order given.
TEST(RoundRobinSeconds, RunsTheCallsInTheirOrderEveryRound) {
  std::vector<int> order;
  const auto rounds = round_robin_seconds(
      4, {[&] { order.push_back(0); }, [&] { order.push_back(1); }, [&] { order.push_back(2); }});
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2}));
  ASSERT_EQ(rounds.median.size(), 3u);
  ASSERT_EQ(rounds.over_previous.size(), 3u);
  EXPECT_EQ(rounds.over_previous[0], 0.0);  // nothing before the first call
  for (const double seconds : rounds.median) EXPECT_GE(seconds, 0.0);
}

TEST(RoundRobinSeconds, NoRoundsRunNothing) {
  int calls = 0;
  const auto rounds = round_robin_seconds(0, {[&] { ++calls; }, [&] { ++calls; }});
  EXPECT_EQ(calls, 0);
  EXPECT_EQ(rounds.median, (std::vector<double>{0.0, 0.0}));
  EXPECT_EQ(rounds.over_previous, (std::vector<double>{0.0, 0.0}));
}

TEST(PairedMedianSeconds, AlternatesFirstAndSecond) {
  std::vector<char> order;
  const auto times = paired_median_seconds(
      3, [&] { order.push_back('a'); }, [&] { order.push_back('b'); });
  EXPECT_EQ(order, (std::vector<char>{'a', 'b', 'a', 'b', 'a', 'b'}));
  EXPECT_GE(times.first, 0.0);
  EXPECT_GE(times.second, 0.0);
}

}  // namespace
