#include "cli_common.hpp"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <vector>

namespace flashattn::cli {

double median_seconds(int repeat, const std::function<void()>& call) {
  std::vector<double> seconds;
  for (int i = 0; i < repeat; ++i) {
    const auto start = std::chrono::steady_clock::now();
    call();
    seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  if (seconds.empty()) return 0.0;
  std::sort(seconds.begin(), seconds.end());
  const std::size_t middle = seconds.size() / 2;
  return seconds.size() % 2 == 1 ? seconds[middle] : 0.5 * (seconds[middle - 1] + seconds[middle]);
}

int resolved_threads(int requested) { return requested > 0 ? requested : omp_get_max_threads(); }

}  // namespace flashattn::cli
