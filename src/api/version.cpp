// flashattn::version() and flashattn::blas() (flashattn/introspect.hpp): what this build of the
// library is.

#include <cblas.h>

#include <sstream>
#include <string>

#include "flashattn/introspect.hpp"
#include "flashattn/version.hpp"

namespace flashattn {

const char* version() { return FLASHATTN_VERSION_STRING; }

const char* blas() {
#ifdef FLASHATTN_BLAS_PLAIN
  return "plain-loop sgemm (FLASHATTN_PLAIN_BLAS)";
#else
  static const std::string description = [] {
    // openblas_get_config() reads e.g. "OpenBLAS 0.3.21 DYNAMIC_ARCH NO_AFFINITY Haswell
    // MAX_THREADS=64": its first two words are the name and the version.
    std::istringstream config(openblas_get_config());
    std::string name, number;
    config >> name >> number;
    return name + " " + number + " (" FLASHATTN_BLAS_SOURCE ", " + openblas_get_corename() +
           " kernel)";
  }();
  return description.c_str();
#endif
}

}  // namespace flashattn
