// Status check for cuDNN calls (CUDA builds with cuDNN only); used through MT_CUDA_CHECK.
#pragma once

#include <cudnn.h>

#include "megatrain/core/cuda_check.hpp"

namespace megatrain::detail {
inline void check_status(cudnnStatus_t st, const char* expr, const SourceLoc& where) {
  if (st != CUDNN_STATUS_SUCCESS) [[unlikely]] {
    char detail[512] = {0};
    cudnnGetLastErrorString(detail, sizeof detail);
    throw_status(expr, fmt::format("returned {}{}{}", cudnnGetErrorString(st), detail[0] ? ": " : "", detail), where);
  }
}
}  // namespace megatrain::detail
