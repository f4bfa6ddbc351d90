# Install rules: headers, the library, a config-file package `megatrain` with a version file,
# exporting megatrain::megatrain and megatrain::text (the tokenizer), megatrain::mpi and megatrain::nccl
# (the collectives of several processes, where MPI and NCCL were found), and the megatrain-train,
# megatrain-plan, megatrain-tokenize, megatrain-report and megatrain-generate programs where they are built.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/megatrain" DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")
set(_megatrain_libraries megatrain megatrain_text)
foreach(_optional megatrain_mpi megatrain_nccl)
  if(TARGET ${_optional})
    list(APPEND _megatrain_libraries ${_optional})
  endif()
endforeach()
if(TARGET megatrain_mpi)
  set(MEGATRAIN_MPI ON)
else()
  set(MEGATRAIN_MPI OFF)
endif()
install(TARGETS ${_megatrain_libraries} EXPORT megatrainTargets
        ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}"
        LIBRARY DESTINATION "${CMAKE_INSTALL_LIBDIR}"
        RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}"
        INCLUDES DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")
set(_megatrain_cmake_dir "${CMAKE_INSTALL_LIBDIR}/cmake/megatrain")
install(EXPORT megatrainTargets NAMESPACE megatrain:: DESTINATION "${_megatrain_cmake_dir}")
configure_package_config_file("${PROJECT_SOURCE_DIR}/cmake/megatrainConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/megatrainConfig.cmake" INSTALL_DESTINATION "${_megatrain_cmake_dir}")
write_basic_package_version_file("${PROJECT_BINARY_DIR}/megatrainConfigVersion.cmake"
  COMPATIBILITY SameMinorVersion)
install(FILES "${PROJECT_BINARY_DIR}/megatrainConfig.cmake" "${PROJECT_BINARY_DIR}/megatrainConfigVersion.cmake"
        DESTINATION "${_megatrain_cmake_dir}")
if(TARGET megatrain-train)
  install(TARGETS megatrain-train megatrain-plan megatrain-tokenize megatrain-report megatrain-generate RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}")
endif()
