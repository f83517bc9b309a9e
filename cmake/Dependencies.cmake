# Third-party dependencies (docs/design.md, "Dependencies"), all from Debian 12 packages.

find_package(OpenMP REQUIRED)
find_package(hwy REQUIRED)
# Random123 (header-only): the Philox generator of the dropout mask (src/util/dropout.hpp).
find_path(FLASHATTN_RANDOM123_INCLUDE_DIR Random123/philox.h NO_CACHE)
if(NOT FLASHATTN_RANDOM123_INCLUDE_DIR)
  message(FATAL_ERROR "Random123/philox.h not found: install librandom123-dev (Debian)")
endif()

# BLAS for the standard path and the layer's projections: OpenBLAS, the system's (Debian's; the
# default) or PyPI's scipy-openblas32 (the wheel: a current OpenBLAS that knows CPUs newer than
# Debian 12's 0.3.21, its headers and library from that Python package). The target
# flashattn_openblas also says which, for flashattn::blas() (src/api/version.cpp).
set(FLASHATTN_BLAS system CACHE STRING
  "The OpenBLAS to link: system (Debian's OpenMP build) or scipy-openblas (PyPI's scipy-openblas32)")
set_property(CACHE FLASHATTN_BLAS PROPERTY STRINGS system scipy-openblas)
add_library(flashattn_openblas INTERFACE)
if(FLASHATTN_PLAIN_BLAS)
  # The library carries its own instrumented sgemm (src/reference/plain_blas.cpp); only the
  # header comes from OpenBLAS.
  find_path(FLASHATTN_CBLAS_INCLUDE_DIR cblas.h
    HINTS /usr/include/x86_64-linux-gnu/openblas-openmp /usr/include/openblas
    NO_CACHE REQUIRED)
  target_include_directories(flashattn_openblas INTERFACE "${FLASHATTN_CBLAS_INCLUDE_DIR}")
  target_compile_definitions(flashattn_openblas INTERFACE FLASHATTN_BLAS_PLAIN)
  message(STATUS "flashattn: plain-loop sgemm instead of OpenBLAS (FLASHATTN_PLAIN_BLAS)")
elseif(FLASHATTN_BLAS STREQUAL "system")
  # Debian's OpenMP build preferred. Its sgemm, called from inside one of our OpenMP parallel
  # regions, runs on the calling thread instead of starting a second thread pool that would
  # fight ours for the two cores (the pthread build does exactly that).
  find_path(FLASHATTN_CBLAS_INCLUDE_DIR cblas.h
    HINTS /usr/include/x86_64-linux-gnu/openblas-openmp /usr/include/openblas
    NO_CACHE)
  find_library(FLASHATTN_OPENBLAS_LIBRARY openblas
    HINTS /usr/lib/x86_64-linux-gnu/openblas-openmp
    NO_CACHE)
  if(NOT FLASHATTN_CBLAS_INCLUDE_DIR OR NOT FLASHATTN_OPENBLAS_LIBRARY)
    message(FATAL_ERROR "OpenBLAS not found: install libopenblas-openmp-dev (Debian) or libopenblas-dev")
  endif()
  target_include_directories(flashattn_openblas INTERFACE "${FLASHATTN_CBLAS_INCLUDE_DIR}")
  target_compile_definitions(flashattn_openblas INTERFACE FLASHATTN_BLAS_SOURCE="system")
  target_link_libraries(flashattn_openblas INTERFACE "${FLASHATTN_OPENBLAS_LIBRARY}")
  message(STATUS "flashattn: OpenBLAS ${FLASHATTN_OPENBLAS_LIBRARY}")
elseif(FLASHATTN_BLAS STREQUAL "scipy-openblas")
  # Its symbols carry a scipy_ prefix, and it is the pthread build: cmake/scipy-openblas/cblas.h
  # maps the names the sources use and gives each sgemm the thread count the OpenMP build would
  # take.
  find_package(Python 3.9 COMPONENTS Interpreter REQUIRED)
  execute_process(COMMAND "${Python_EXECUTABLE}" -c
      "import scipy_openblas32 as s; print(s.get_include_dir()); print(s.get_lib_dir()); print(s.get_library())"
    OUTPUT_VARIABLE scipy_openblas OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE scipy_openblas_missing ERROR_QUIET)
  if(scipy_openblas_missing)
    message(FATAL_ERROR "FLASHATTN_BLAS=scipy-openblas: ${Python_EXECUTABLE} cannot import "
      "scipy_openblas32: python3 -m pip install scipy-openblas32")
  endif()
  string(REPLACE "\n" ";" scipy_openblas "${scipy_openblas}")
  list(GET scipy_openblas 0 scipy_openblas_include)
  list(GET scipy_openblas 1 scipy_openblas_libdir)
  list(GET scipy_openblas 2 scipy_openblas_name)
  set(FLASHATTN_OPENBLAS_LIBRARY "${scipy_openblas_libdir}/lib${scipy_openblas_name}.so")
  target_include_directories(flashattn_openblas INTERFACE
    "${CMAKE_CURRENT_LIST_DIR}/scipy-openblas" "${scipy_openblas_include}")
  target_compile_definitions(flashattn_openblas INTERFACE
    FLASHATTN_BLAS_SOURCE="scipy-openblas" FLASHATTN_BLAS_SCIPY_OPENBLAS)
  target_link_libraries(flashattn_openblas INTERFACE "${FLASHATTN_OPENBLAS_LIBRARY}")
  message(STATUS "flashattn: OpenBLAS ${FLASHATTN_OPENBLAS_LIBRARY} (scipy-openblas32)")
else()
  message(FATAL_ERROR "FLASHATTN_BLAS: expected system or scipy-openblas, got ${FLASHATTN_BLAS}")
endif()
