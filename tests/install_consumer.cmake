# Proves that an installed flashattn is usable: installs the build tree into a fresh prefix,
# configures examples/ against that prefix only (find_package(flashattn)), builds `minimal` and
# runs it; then builds the same example with nothing but the flags of the installed flashattn.pc
# (pkg-config) and runs that too. Run as
#   cmake -DBUILD_DIR=... -DSOURCE_DIR=... -DWORK_DIR=... -DGENERATOR=... -DCXX_COMPILER=...
#         -DCONFIG=... -DVERSION=... -DLIBDIR=... [-DCXX_FLAGS=...] -P install_consumer.cmake
# VERSION is CMake's project version: the installed package files and CLI must all say it;
# LIBDIR is CMAKE_INSTALL_LIBDIR.
# CXX_FLAGS are the build's own CMAKE_CXX_FLAGS: a sanitizer build's library needs its runtime
# linked into the consumer too.
# Any failing step stops the script with a FATAL_ERROR, which ctest reports as a failure.

foreach(var BUILD_DIR SOURCE_DIR WORK_DIR GENERATOR CXX_COMPILER CONFIG VERSION LIBDIR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "install_consumer.cmake: expected -D${var}=..., got nothing")
  endif()
endforeach()
include("${CMAKE_CURRENT_LIST_DIR}/consumer_support.cmake")

set(prefix "${WORK_DIR}/prefix")
set(consumer "${WORK_DIR}/consumer")
file(REMOVE_RECURSE "${WORK_DIR}")

run_step("install" "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${prefix}"
  --config "${CONFIG}")

# The one version (issue 53): the package version file and the installed CLI say VERSION.
set(PACKAGE_FIND_VERSION "${VERSION}")
include("${prefix}/${LIBDIR}/cmake/flashattn/flashattnConfigVersion.cmake")
if(NOT PACKAGE_VERSION STREQUAL VERSION OR NOT PACKAGE_VERSION_EXACT)
  message(FATAL_ERROR "flashattnConfigVersion.cmake: expected version ${VERSION}, got "
    "'${PACKAGE_VERSION}'")
endif()
if(EXISTS "${prefix}/bin/flashattn")
  run_step("flashattn --version" "${prefix}/bin/flashattn" --version)
  if(NOT step_output MATCHES "^flashattn ([^\n]*)\nSIMD target [A-Z0-9_]+\nBLAS [^\n]+\n$"
     OR NOT CMAKE_MATCH_1 STREQUAL VERSION)
    message(FATAL_ERROR "flashattn --version: expected 'flashattn ${VERSION}', its SIMD target "
      "and its BLAS on three lines, got:\n${step_output}")
  endif()
endif()

# The package registry and system paths are switched off so that only the fresh prefix can
# satisfy find_package(flashattn).
run_step("configure examples" "${CMAKE_COMMAND}" -S "${SOURCE_DIR}/examples" -B "${consumer}"
  -G "${GENERATOR}" "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" "-DCMAKE_BUILD_TYPE=${CONFIG}"
  "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}"
  "-DCMAKE_PREFIX_PATH=${prefix}" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
  -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF)
file(STRINGS "${consumer}/CMakeCache.txt" found_dir REGEX "^flashattn_DIR:")
string(FIND "${found_dir}" "${prefix}/" at)
if(NOT at GREATER -1)
  message(FATAL_ERROR "find_package(flashattn) expected a config under ${prefix}, got ${found_dir}")
endif()

run_step("build minimal" "${CMAKE_COMMAND}" --build "${consumer}" --config "${CONFIG}")

find_program(minimal minimal PATHS "${consumer}" "${consumer}/${CONFIG}" NO_DEFAULT_PATH
  NO_CACHE REQUIRED)
run_minimal("find_package" "${minimal}")

# pkg-config: only the fresh prefix's flashattn.pc is visible (PKG_CONFIG_LIBDIR replaces the
# system's directories). It says VERSION, and its flags alone build the example; the loader finds
# the installed library through LD_LIBRARY_PATH, as it would in any prefix outside its defaults.
find_program(pkg_config pkg-config NO_CACHE REQUIRED)
set(ENV{PKG_CONFIG_LIBDIR} "${prefix}/${LIBDIR}/pkgconfig")
unset(ENV{PKG_CONFIG_PATH})
run_step("pkg-config --modversion flashattn" "${pkg_config}" --modversion flashattn)
string(STRIP "${step_output}" pc_version)
if(NOT pc_version STREQUAL VERSION)
  message(FATAL_ERROR "flashattn.pc: expected Version ${VERSION}, got '${pc_version}'")
endif()
run_step("pkg-config --cflags --libs flashattn" "${pkg_config}" --cflags --libs flashattn)
separate_arguments(pc_flags UNIX_COMMAND "${step_output}")
separate_arguments(cxx_flags UNIX_COMMAND "${CXX_FLAGS}")
set(pc_minimal "${WORK_DIR}/minimal-pkg-config")
run_step("build minimal with pkg-config" "${CXX_COMPILER}" ${cxx_flags} -std=c++20
  "${SOURCE_DIR}/examples/minimal.cpp" ${pc_flags} -o "${pc_minimal}")
run_minimal("pkg-config" "${pc_minimal}"
  "${CMAKE_COMMAND}" -E env "LD_LIBRARY_PATH=${prefix}/${LIBDIR}")

# The README shows examples/minimal.cpp as its usage example: keep the two identical, so the
# example a reader copies is the one this test compiled and ran.
file(READ "${SOURCE_DIR}/examples/minimal.cpp" example)
file(READ "${SOURCE_DIR}/README.md" readme)
string(FIND "${readme}" "```cpp\n${example}```" at)
if(at EQUAL -1)
  message(FATAL_ERROR "README.md: expected examples/minimal.cpp verbatim in a ```cpp block, "
    "got a different example: copy examples/minimal.cpp into the README")
endif()
