# Conan 2 recipe for megatrain. Untested on the project's machines (Conan cannot be installed
# there); it mirrors the CMake build: the same targets (megatrain::megatrain) and options.
import os

from conan import ConanFile
from conan.tools.cmake import CMake, CMakeDeps, CMakeToolchain, cmake_layout
from conan.tools.files import copy


class MegatrainConan(ConanFile):
    name = "megatrain"
    version = "0.1.0"
    description = "Train decoder-only LLMs far larger than GPU memory on one GPU"
    settings = "os", "arch", "compiler", "build_type"
    options = {"shared": [True, False], "fPIC": [True, False], "cuda": [True, False], "program": [True, False]}
    default_options = {"shared": False, "fPIC": True, "cuda": False, "program": True}
    exports_sources = "CMakeLists.txt", "cmake/*", "include/*", "src/*", "examples/*"

    def requirements(self):
        self.requires("onetbb/2021.10.0", transitive_headers=True)
        self.requires("fmt/9.1.0", transitive_headers=True)
        self.requires("eigen/3.4.0", transitive_headers=True)
        self.requires("nlohmann_json/3.11.3", transitive_headers=True)
        self.requires("xxhash/0.8.2")  # compiled into the library (header, inlined)
        if self.options.program:
            self.requires("cli11/2.3.2", visible=False)  # megatrain-train's command line (header-only)

    def layout(self):
        cmake_layout(self)

    def generate(self):
        CMakeDeps(self).generate()
        tc = CMakeToolchain(self)
        tc.variables["MEGATRAIN_CUDA"] = bool(self.options.cuda)
        tc.variables["MEGATRAIN_BUILD_TESTS"] = False
        tc.variables["MEGATRAIN_BUILD_BENCHMARKS"] = False
        tc.variables["MEGATRAIN_BUILD_EXAMPLES"] = False
        tc.variables["MEGATRAIN_BUILD_PROGRAM"] = bool(self.options.program)  # bin/megatrain-train, -tokenize, -report
        tc.variables["MEGATRAIN_INSTALL"] = True
        tc.variables["MEGATRAIN_WERROR"] = False
        tc.generate()

    def build(self):
        cmake = CMake(self)
        cmake.configure()
        cmake.build()

    def package(self):
        CMake(self).install()

    def package_info(self):
        # Consumers use the config-file package that `cmake --install` wrote.
        self.cpp_info.set_property("cmake_find_mode", "none")
        self.cpp_info.builddirs.append("lib/cmake/megatrain")
        if self.options.program:
            self.buildenv_info.prepend_path("PATH", os.path.join(self.package_folder, "bin"))
            self.runenv_info.prepend_path("PATH", os.path.join(self.package_folder, "bin"))
