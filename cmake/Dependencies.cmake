# Third-party dependencies (docs/design.md, "Dependencies"), from Debian 12 packages where they
# are installed.

find_package(OpenMP REQUIRED)

# Highway and Random123 are not on PyPI: where the system has no copy (an sdist built on a
# machine with only a compiler and CMake), the release Debian 12 ships is downloaded and checked
# against its SHA-256 (the sums of the archives GitHub serves for those tags). Highway is then
# built as a static library inside libflashattn. FLASHATTN_DEPENDENCY_MIRROR, a folder or URL
# prefix holding the same archives under the names below, is tried first (machines that cannot
# reach GitHub); -DFETCHCONTENT_TRY_FIND_PACKAGE_MODE=NEVER ignores the system's copies.
include(FetchContent)
set(FLASHATTN_DEPENDENCY_MIRROR "" CACHE STRING
  "A folder or URL prefix tried before GitHub for highway-1.0.3.tar.gz and random123-1.14.0.tar.gz")
function(flashattn_dependency_urls out archive upstream)
  set(urls "${upstream}")
  if(FLASHATTN_DEPENDENCY_MIRROR MATCHES "^[a-z]+://")
    list(PREPEND urls "${FLASHATTN_DEPENDENCY_MIRROR}/${archive}")
  elseif(EXISTS "${FLASHATTN_DEPENDENCY_MIRROR}/${archive}")
    # Alone: ExternalProject takes a local path only as the one URL, never in a list.
    get_filename_component(urls "${FLASHATTN_DEPENDENCY_MIRROR}/${archive}" ABSOLUTE)
  endif()
  set(${out} "${urls}" PARENT_SCOPE)
endfunction()

flashattn_dependency_urls(hwy_urls highway-1.0.3.tar.gz
  https://github.com/google/highway/archive/refs/tags/1.0.3.tar.gz)
# Only the library: none of Highway's tests, examples, contrib or install rules.
set(HWY_ENABLE_TESTS OFF CACHE BOOL "Highway's tests (flashattn builds none)")
set(HWY_ENABLE_EXAMPLES OFF CACHE BOOL "Highway's examples (flashattn builds none)")
set(HWY_ENABLE_CONTRIB OFF CACHE BOOL "Highway's contrib (flashattn uses none)")
set(HWY_ENABLE_INSTALL OFF CACHE BOOL "Highway's install rules (it is inside libflashattn)")
FetchContent_Declare(hwy
  URL ${hwy_urls}
  URL_HASH SHA256=566fc77315878473d9a6bd815f7de78c73734acdcb745c3dde8579560ac5440e
  DOWNLOAD_EXTRACT_TIMESTAMP ON
  FIND_PACKAGE_ARGS)
FetchContent_MakeAvailable(hwy)
# FLASHATTN_THIRD_PARTY_NOTICES: (file, name) pairs, the license notices a binary package must
# carry for the code of these two that libflashattn holds (python/CMakeLists.txt installs them).
if(TARGET hwy::hwy)
  set(FLASHATTN_THIRD_PARTY_NOTICES
    /usr/share/doc/libhwy1/copyright highway-copyright
    /usr/share/common-licenses/Apache-2.0 highway-Apache-2.0)
else()
  add_library(hwy::hwy ALIAS hwy)
  set(FLASHATTN_THIRD_PARTY_NOTICES "${hwy_SOURCE_DIR}/LICENSE" highway-Apache-2.0)
  message(STATUS "flashattn: Highway 1.0.3 built from ${hwy_SOURCE_DIR}")
endif()

# Random123 (header-only): the Philox generator of the dropout mask (src/util/dropout.hpp).
if(NOT FETCHCONTENT_TRY_FIND_PACKAGE_MODE STREQUAL "NEVER")
  find_path(FLASHATTN_RANDOM123_INCLUDE_DIR Random123/philox.h NO_CACHE)
endif()
if(NOT FLASHATTN_RANDOM123_INCLUDE_DIR)
  flashattn_dependency_urls(random123_urls random123-1.14.0.tar.gz
    https://github.com/DEShawResearch/random123/archive/refs/tags/v1.14.0.tar.gz)
  FetchContent_Declare(random123
    URL ${random123_urls}
    URL_HASH SHA256=effafd8656b18030b2a5b995cd3650c51a7c45052e6e1c21e48b9fa7a59d926e
    DOWNLOAD_EXTRACT_TIMESTAMP ON)
  FetchContent_MakeAvailable(random123)  # headers only: no CMakeLists.txt to add
  set(FLASHATTN_RANDOM123_INCLUDE_DIR "${random123_SOURCE_DIR}/include")
  list(APPEND FLASHATTN_THIRD_PARTY_NOTICES "${random123_SOURCE_DIR}/LICENSE" random123-LICENSE)
  message(STATUS "flashattn: Random123 1.14.0 from ${random123_SOURCE_DIR}")
else()
  list(APPEND FLASHATTN_THIRD_PARTY_NOTICES
    /usr/share/doc/librandom123-dev/copyright random123-copyright)
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
