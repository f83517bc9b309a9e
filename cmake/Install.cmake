# `cmake --install` puts the library, its headers and a package config in place so that
# `find_package(flashattn)` gives the imported target flashattn::flashattn.
include(CMakePackageConfigHelpers)

# The optional libraries, and their headers only where they are built.
set(FLASHATTN_INSTALL_TARGETS flashattn)
set(FLASHATTN_HEADERS_EXCLUDED "")
if(TARGET flashattn_dist)
  list(APPEND FLASHATTN_INSTALL_TARGETS flashattn_dist)
else()
  list(APPEND FLASHATTN_HEADERS_EXCLUDED PATTERN dist.hpp EXCLUDE)
endif()
if(TARGET flashattn_cuda)
  list(APPEND FLASHATTN_INSTALL_TARGETS flashattn_cuda)
else()
  list(APPEND FLASHATTN_HEADERS_EXCLUDED PATTERN cuda.hpp EXCLUDE)
endif()
install(TARGETS ${FLASHATTN_INSTALL_TARGETS} EXPORT flashattnTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY include/flashattn DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
  ${FLASHATTN_HEADERS_EXCLUDED})
install(FILES ${PROJECT_BINARY_DIR}/include/flashattn/version.hpp
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/flashattn)
install(EXPORT flashattnTargets NAMESPACE flashattn::
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/flashattn)
install(FILES LICENSE DESTINATION ${CMAKE_INSTALL_DOCDIR})

# flashattn.pc for pkg-config users, its prefix relative to its own directory (${pcfiledir}), so
# that it is right for any `cmake --install --prefix`.
if(IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}" OR IS_ABSOLUTE "${CMAKE_INSTALL_INCLUDEDIR}")
  message(FATAL_ERROR "flashattn.pc needs CMAKE_INSTALL_LIBDIR and CMAKE_INSTALL_INCLUDEDIR "
    "relative to the prefix, got ${CMAKE_INSTALL_LIBDIR} and ${CMAKE_INSTALL_INCLUDEDIR}")
endif()
file(RELATIVE_PATH FLASHATTN_PC_PREFIX "/prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/prefix")
string(REGEX REPLACE "/$" "" FLASHATTN_PC_PREFIX "${FLASHATTN_PC_PREFIX}")
configure_file(cmake/flashattn.pc.in ${CMAKE_CURRENT_BINARY_DIR}/flashattn.pc @ONLY)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/flashattn.pc
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
if(TARGET flashattn_cli)
  # The installed CLI finds the installed library wherever the prefix is, and OpenBLAS where it
  # was linked from.
  set_target_properties(flashattn_cli PROPERTIES
    INSTALL_RPATH "$ORIGIN/../${CMAKE_INSTALL_LIBDIR}" INSTALL_RPATH_USE_LINK_PATH ON)
  install(TARGETS flashattn_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()

set(FLASHATTN_WITH_DIST ${FLASHATTN_MPI})
configure_package_config_file(cmake/flashattnConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/flashattnConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/flashattn)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/flashattnConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES
  ${CMAKE_CURRENT_BINARY_DIR}/flashattnConfig.cmake
  ${CMAKE_CURRENT_BINARY_DIR}/flashattnConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/flashattn)
