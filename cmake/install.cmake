# Installs the library, its headers and a CMake package, so that a consumer's
# find_package(pagedattn) gives it pagedattn::pagedattn.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS pagedattn EXPORT pagedattnTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY include/pagedattn DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
if(PAGEDATTN_BUILD_TOOLS)
  install(TARGETS pagedattn_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()

set(PAGEDATTN_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/pagedattn)
install(EXPORT pagedattnTargets NAMESPACE pagedattn:: DESTINATION ${PAGEDATTN_CMAKE_DIR})
configure_package_config_file(cmake/pagedattnConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/pagedattnConfig.cmake INSTALL_DESTINATION ${PAGEDATTN_CMAKE_DIR})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/pagedattnConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/pagedattnConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/pagedattnConfigVersion.cmake
        DESTINATION ${PAGEDATTN_CMAKE_DIR})
