# Third-party dependencies, all through find_package: nothing is downloaded at configure time.
# On Debian 12: libtbb-dev libfmt-dev libeigen3-dev nlohmann-json3-dev (library),
# doctest-dev libbenchmark-dev libcli11-dev (tests, benchmarks, the main program).
find_package(Threads REQUIRED)
find_package(TBB 2021 REQUIRED COMPONENTS tbb)
find_package(fmt 9 REQUIRED)
find_package(Eigen3 3.4 REQUIRED NO_MODULE)
find_package(nlohmann_json 3.10 REQUIRED)
