# Third-party dependencies (docs/design.md, "Dependencies"), all from Debian 12 packages.

find_package(OpenMP REQUIRED)
find_package(hwy REQUIRED)
# Random123 (header-only): the Philox generator of the dropout mask (src/util/dropout.hpp).
find_path(FLASHATTN_RANDOM123_INCLUDE_DIR Random123/philox.h NO_CACHE)
if(NOT FLASHATTN_RANDOM123_INCLUDE_DIR)
  message(FATAL_ERROR "Random123/philox.h not found: install librandom123-dev (Debian)")
endif()

# OpenBLAS: prefer Debian's OpenMP build. Its sgemm, called from inside one of our OpenMP
# parallel regions, runs on the calling thread instead of starting a second thread pool that
# would fight ours for the two cores (the pthread build does exactly that).
find_path(FLASHATTN_CBLAS_INCLUDE_DIR cblas.h
  HINTS /usr/include/x86_64-linux-gnu/openblas-openmp /usr/include/openblas
  NO_CACHE)
if(NOT FLASHATTN_CBLAS_INCLUDE_DIR)
  message(FATAL_ERROR "cblas.h not found: install libopenblas-openmp-dev (Debian) or libopenblas-dev")
endif()
add_library(flashattn_openblas INTERFACE)
target_include_directories(flashattn_openblas INTERFACE "${FLASHATTN_CBLAS_INCLUDE_DIR}")
# Which BLAS the sources are compiled against, for flashattn::blas() (src/api/version.cpp).
if(FLASHATTN_PLAIN_BLAS)
  # The library carries its own instrumented sgemm (src/reference/plain_blas.cpp); only the
  # header comes from OpenBLAS.
  target_compile_definitions(flashattn_openblas INTERFACE FLASHATTN_BLAS_PLAIN)
  message(STATUS "flashattn: plain-loop sgemm instead of OpenBLAS (FLASHATTN_PLAIN_BLAS)")
else()
  target_compile_definitions(flashattn_openblas INTERFACE FLASHATTN_BLAS_SOURCE="system")
  find_library(FLASHATTN_OPENBLAS_LIBRARY openblas
    HINTS /usr/lib/x86_64-linux-gnu/openblas-openmp
    NO_CACHE)
  if(NOT FLASHATTN_OPENBLAS_LIBRARY)
    message(FATAL_ERROR "OpenBLAS not found: install libopenblas-openmp-dev (Debian) or libopenblas-dev")
  endif()
  target_link_libraries(flashattn_openblas INTERFACE "${FLASHATTN_OPENBLAS_LIBRARY}")
  message(STATUS "flashattn: OpenBLAS ${FLASHATTN_OPENBLAS_LIBRARY}")
endif()
