#include "cli_common.hpp"

#include <omp.h>

namespace flashattn::cli {

int resolved_threads(int requested) { return requested > 0 ? requested : omp_get_max_threads(); }

}  // namespace flashattn::cli
