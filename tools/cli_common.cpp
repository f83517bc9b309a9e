#include "cli_common.hpp"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <vector>

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

PairedSeconds paired_median_seconds(int repeat, const std::function<void()>& first,
                                    const std::function<void()>& second) {
  std::vector<double> firsts, seconds, ratios;
  for (int i = 0; i < repeat; ++i) {
    firsts.push_back(seconds_of(first));
    seconds.push_back(seconds_of(second));
    if (firsts.back() > 0.0) ratios.push_back(seconds.back() / firsts.back());
  }
  return {median(firsts), median(seconds), median(ratios)};
}

int resolved_threads(int requested) { return requested > 0 ? requested : omp_get_max_threads(); }

}  // namespace flashattn::cli
