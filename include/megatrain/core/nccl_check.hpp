// Status check for NCCL calls (CUDA builds with NCCL only); used through MT_CUDA_CHECK.
#pragma once

#include <nccl.h>

#include "megatrain/core/cuda_check.hpp"

namespace megatrain::detail {
inline void check_status(ncclResult_t st, const char* expr, const SourceLoc& where) {
  if (st != ncclSuccess) [[unlikely]] {
    const char* last = ncclGetLastError(nullptr);
    throw_status(expr, fmt::format("returned {}{}{}", ncclGetErrorString(st), last && *last ? ": " : "", last ? last : ""),
                 where);
  }
}
}  // namespace megatrain::detail
