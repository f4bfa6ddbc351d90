#include "megatrain/core/version.hpp"

namespace megatrain {

std::string_view version() { return MEGATRAIN_VERSION; }

}  // namespace megatrain
