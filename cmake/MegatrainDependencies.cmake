# Third-party dependencies, through find_package: by default nothing is downloaded at configure
# time. On Debian 12: libtbb-dev libfmt-dev libeigen3-dev nlohmann-json3-dev (library),
# doctest-dev libbenchmark-dev libcli11-dev (tests, benchmarks, the main program).
#
# MEGATRAIN_FETCH_DEPENDENCIES (OFF by default) is a fallback for consumers whose machines have
# internet but lack a package: a dependency that find_package does not find is then downloaded
# with FetchContent at the version Debian 12 ships, and built as part of the project. What
# find_package finds is always used first.
include_guard(GLOBAL)
option(MEGATRAIN_FETCH_DEPENDENCIES
       "Download dependencies that find_package does not find (FetchContent; needs internet)" OFF)

# megatrain_dependency(<package> URL <archive> [FIND_ARGS <find_package args>...]
#                      [CACHE_OFF <option>...])
# find_package(<package> <FIND_ARGS>) REQUIRED; or, with MEGATRAIN_FETCH_DEPENDENCIES, the
# archive's CMake project when the package is missing (its own tests, docs and install rules
# switched off through the CACHE_OFF options). A macro, so the package's variables land in the
# caller's scope as find_package's would.
macro(megatrain_dependency _md_name)
  cmake_parse_arguments(_md "" "URL" "FIND_ARGS;CACHE_OFF" ${ARGN})
  if(MEGATRAIN_FETCH_DEPENDENCIES)
    find_package(${_md_name} ${_md_FIND_ARGS} QUIET)
    if(NOT ${_md_name}_FOUND)
      include(FetchContent)
      message(STATUS "megatrain: ${_md_name} not found; fetching ${_md_URL}")
      foreach(_md_opt IN LISTS _md_CACHE_OFF)
        set(${_md_opt} OFF CACHE BOOL "" FORCE)
      endforeach()
      FetchContent_Declare(megatrain_dep_${_md_name} URL "${_md_URL}" DOWNLOAD_EXTRACT_TIMESTAMP ON)
      FetchContent_MakeAvailable(megatrain_dep_${_md_name})
      set_property(GLOBAL APPEND PROPERTY MEGATRAIN_FETCHED_DEPENDENCIES ${_md_name})
    endif()
  else()
    find_package(${_md_name} ${_md_FIND_ARGS} REQUIRED)
  endif()
endmacro()

# The archives hold the versions Debian 12 ships (the versions megatrain is tested with). Each
# project defines, when added as a subdirectory, the same target names its package exports
# (TBB::tbb, fmt::fmt, Eigen3::Eigen, nlohmann_json::nlohmann_json, doctest::doctest,
# CLI11::CLI11, benchmark::benchmark).
set(MEGATRAIN_URL_TBB "https://github.com/uxlfoundation/oneTBB/archive/refs/tags/v2021.8.0.tar.gz")
set(MEGATRAIN_URL_fmt "https://github.com/fmtlib/fmt/archive/refs/tags/9.1.0.tar.gz")
set(MEGATRAIN_URL_Eigen3 "https://gitlab.com/libeigen/eigen/-/archive/3.4.0/eigen-3.4.0.tar.gz")
set(MEGATRAIN_URL_nlohmann_json "https://github.com/nlohmann/json/releases/download/v3.11.2/json.tar.xz")
set(MEGATRAIN_URL_doctest "https://github.com/doctest/doctest/archive/refs/tags/v2.4.9.tar.gz")
set(MEGATRAIN_URL_CLI11 "https://github.com/CLIUtils/CLI11/archive/refs/tags/v2.1.2.tar.gz")
set(MEGATRAIN_URL_benchmark "https://github.com/google/benchmark/archive/refs/tags/v1.7.1.tar.gz")

find_package(Threads REQUIRED)
megatrain_dependency(TBB URL "${MEGATRAIN_URL_TBB}" FIND_ARGS 2021 COMPONENTS tbb
                     CACHE_OFF TBB_TEST TBB_EXAMPLES TBB_STRICT TBBMALLOC_BUILD TBBMALLOC_PROXY_BUILD)
megatrain_dependency(fmt URL "${MEGATRAIN_URL_fmt}" FIND_ARGS 9 CACHE_OFF FMT_TEST FMT_DOC)
megatrain_dependency(Eigen3 URL "${MEGATRAIN_URL_Eigen3}" FIND_ARGS 3.4 NO_MODULE
                     CACHE_OFF EIGEN_BUILD_DOC EIGEN_BUILD_PKGCONFIG)
megatrain_dependency(nlohmann_json URL "${MEGATRAIN_URL_nlohmann_json}" FIND_ARGS 3.10
                     CACHE_OFF JSON_BuildTests)

# xxHash's header (XXH3 checksums of checkpoint files), inlined into the compiled library: a
# build-time dependency only, nothing to link or to ship.
find_path(MEGATRAIN_XXHASH_INCLUDE_DIR xxhash.h HINTS ENV XXHASH_ROOT PATH_SUFFIXES include)
if(NOT MEGATRAIN_XXHASH_INCLUDE_DIR)
  message(FATAL_ERROR "megatrain: xxhash.h not found (Debian: apt-get install libxxhash-dev; or set XXHASH_ROOT)")
endif()

# megatrain::text (the tokenizer): PCRE2 for Unicode regular expressions, utf8proc for Unicode
# normalization, both through pkg-config (Debian: libpcre2-dev libutf8proc-dev pkg-config).
find_package(PkgConfig)
if(PKG_CONFIG_FOUND)
  pkg_check_modules(MEGATRAIN_PCRE2 IMPORTED_TARGET libpcre2-8)
  pkg_check_modules(MEGATRAIN_UTF8PROC IMPORTED_TARGET libutf8proc)
endif()
if(NOT TARGET PkgConfig::MEGATRAIN_PCRE2 OR NOT TARGET PkgConfig::MEGATRAIN_UTF8PROC)
  message(FATAL_ERROR "megatrain: PCRE2 or utf8proc not found through pkg-config (Debian: apt-get install "
                      "pkg-config libpcre2-dev libutf8proc-dev)")
endif()

get_property(_megatrain_fetched GLOBAL PROPERTY MEGATRAIN_FETCHED_DEPENDENCIES)
if(_megatrain_fetched AND MEGATRAIN_INSTALL)
  # An installed megatrain package names its dependencies for find_dependency; a dependency that
  # was built inside this project is not installed with it, so the package would not load.
  message(WARNING "megatrain: install rules are off because these dependencies were downloaded "
                  "rather than found: ${_megatrain_fetched}. Install them to install megatrain.")
  set(MEGATRAIN_INSTALL OFF)
endif()
