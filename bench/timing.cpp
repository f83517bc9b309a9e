#include "timing.hpp"

#include <algorithm>
#include <chrono>

namespace flashattn::cli {

namespace {

double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const std::size_t middle = values.size() / 2;
  return values.size() % 2 == 1 ? values[middle] : 0.5 * (values[middle - 1] + values[middle]);
}

double seconds_of(const std::function<void()>& call) {
  const auto start = std::chrono::steady_clock::now();
  call();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

double median_seconds(int repeat, const std::function<void()>& call) {
  std::vector<double> seconds;
  for (int i = 0; i < repeat; ++i) seconds.push_back(seconds_of(call));
  return median(seconds);
}

RoundSeconds round_robin_seconds(int repeat, const std::vector<std::function<void()>>& calls) {
  const std::size_t count = calls.size();
  std::vector<std::vector<double>> seconds(count), ratios(count);
  for (int round = 0; round < repeat; ++round) {
    for (std::size_t i = 0; i < count; ++i) {
      seconds[i].push_back(seconds_of(calls[i]));
      if (i > 0 && seconds[i - 1].back() > 0.0) {
        ratios[i].push_back(seconds[i].back() / seconds[i - 1].back());
      }
    }
  }
  RoundSeconds result;
  for (std::size_t i = 0; i < count; ++i) {
    result.median.push_back(median(seconds[i]));
    result.over_previous.push_back(median(ratios[i]));
  }
  return result;
}

PairedSeconds paired_median_seconds(int repeat, const std::function<void()>& first,
                                    const std::function<void()>& second) {
  const RoundSeconds rounds = round_robin_seconds(repeat, {first, second});
  return {rounds.median[0], rounds.median[1], rounds.over_previous[1]};
}

}  // namespace flashattn::cli
