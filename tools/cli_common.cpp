#include "cli_common.hpp"

#include <omp.h>

#include <cmath>

#include "flashattn/options.hpp"

namespace flashattn::cli {

int resolved_threads(int requested) { return requested > 0 ? requested : omp_get_max_threads(); }

CLI::Option* add_threads_option(CLI::App* command, int* threads) {
  return command->add_option("--threads", *threads, "Worker threads, 0 = all")
      ->check(CLI::Range(0, kMaxThreads));
}

std::optional<std::array<std::int64_t, 2>> parse_window(const std::string& text) {
  const std::size_t comma = text.find(',');
  if (comma == std::string::npos) return std::nullopt;
  std::array<std::int64_t, 2> window{};
  const std::string_view all(text);
  if (!parse_number(all.substr(0, comma), window[0]) ||
      !parse_number(all.substr(comma + 1), window[1]) || window[0] < -1 || window[1] < -1) {
    return std::nullopt;
  }
  return window;
}

CLI::Option* add_window_option(CLI::App* command, std::string* window) {
  return command
      ->add_option("--window", *window,
                   "Sliding window L,R around the diagonal, -1 = unbounded on that side")
      ->check([](const std::string& text) -> std::string {
        return parse_window(text) ? "" : "expected L,R with integers >= -1, got '" + text + "'";
      });
}

std::optional<float> parse_softcap(const std::string& text) {
  float softcap = 0.0f;
  if (!parse_number(std::string_view(text), softcap) || !std::isfinite(softcap) || softcap < 0.0f) {
    return std::nullopt;
  }
  return softcap;
}

CLI::Option* add_softcap_option(CLI::App* command, std::string* softcap) {
  return command
      ->add_option("--softcap", *softcap, "Soft cap of the scores, C·tanh(s / C); 0 = off")
      ->check([](const std::string& text) -> std::string {
        return parse_softcap(text) ? "" : "expected a finite number >= 0, got '" + text + "'";
      });
}

std::vector<float> alibi_paper_slopes(std::int64_t heads) {
  std::int64_t n = 1;
  while (n * 2 <= heads) n *= 2;
  std::vector<float> slopes;
  for (std::int64_t h = 1; h <= n; ++h) {
    slopes.push_back(std::exp2(-8.0f * static_cast<float>(h) / static_cast<float>(n)));
  }
  for (std::int64_t h = 1; static_cast<std::int64_t>(slopes.size()) < heads; h += 2) {
    slopes.push_back(std::exp2(-4.0f * static_cast<float>(h) / static_cast<float>(n)));
  }
  return slopes;
}

}  // namespace flashattn::cli
