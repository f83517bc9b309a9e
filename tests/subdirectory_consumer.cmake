# Proves that flashattn builds as part of another project (FetchContent, add_subdirectory): the
# project in subdirectory_consumer/ takes this source tree through FetchContent, builds
# `minimal` and the library with it, and the test runs `minimal`. Run as
#   cmake -DSOURCE_DIR=... -DWORK_DIR=... -DGENERATOR=... -DCXX_COMPILER=... [-DCXX_FLAGS=...]
#         [-DPLAIN_BLAS=ON] -P subdirectory_consumer.cmake
# CXX_FLAGS and PLAIN_BLAS are the build's own: a sanitizer build's flags, and the plain-loop
# sgemm that replaces the uninstrumented OpenBLAS there.
# The library is compiled in a Debug build: the test proves that the parts fit together, not
# speed, and without optimization the SIMD kernels compile in a fraction of a Release build's
# time on CI's two cores.

foreach(var SOURCE_DIR WORK_DIR GENERATOR CXX_COMPILER)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "subdirectory_consumer.cmake: expected -D${var}=..., got nothing")
  endif()
endforeach()
include("${CMAKE_CURRENT_LIST_DIR}/consumer_support.cmake")
file(REMOVE_RECURSE "${WORK_DIR}")

# FETCHCONTENT_FULLY_DISCONNECTED: nothing may be downloaded, the declared SOURCE_DIR is used.
run_step("configure the consumer" "${CMAKE_COMMAND}"
  -S "${CMAKE_CURRENT_LIST_DIR}/subdirectory_consumer" -B "${WORK_DIR}" -G "${GENERATOR}"
  "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}"
  -DCMAKE_BUILD_TYPE=Debug "-DFLASHATTN_SOURCE_DIR=${SOURCE_DIR}"
  "-DFLASHATTN_PLAIN_BLAS=${PLAIN_BLAS}"
  -DFETCHCONTENT_FULLY_DISCONNECTED=ON)
# Added to another project, flashattn builds only its library (CMakeLists.txt says so).
file(STRINGS "${WORK_DIR}/CMakeCache.txt" parts
  REGEX "^FLASHATTN_(BUILD_TESTS|BUILD_TOOLS|PYTHON|MPI|CUDA):BOOL=ON")
if(parts)
  message(FATAL_ERROR "flashattn as a subproject: expected its optional parts off, got ${parts}")
endif()
run_step("build minimal" "${CMAKE_COMMAND}" --build "${WORK_DIR}" --target minimal)
run_minimal("FetchContent" "${WORK_DIR}/minimal")
