// The version of the megatrain library a program was built with.
#pragma once

#include <string_view>

namespace megatrain {

/// "MAJOR.MINOR.PATCH", from the CMake project (what a train state records as its writer).
std::string_view version();

}  // namespace megatrain
