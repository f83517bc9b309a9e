#include "cli_common.hpp"

#include <omp.h>

#include "flashattn/options.hpp"

namespace flashattn::cli {

int resolved_threads(int requested) { return requested > 0 ? requested : omp_get_max_threads(); }

CLI::Option* add_threads_option(CLI::App* command, int* threads) {
  return command->add_option("--threads", *threads, "Worker threads, 0 = all")
      ->check(CLI::Range(0, kMaxThreads));
}

}  // namespace flashattn::cli
