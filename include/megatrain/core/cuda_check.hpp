// Status checks for CUDA, cuBLAS(Lt), cuDNN and NCCL calls that raise megatrain::Error, naming
// the call as written, where it was made, and the library's own description of the status.
// Available in CUDA builds only. MEGATRAIN_SYNC_DEBUG=1 in the environment makes
// MT_CUDA_CHECK_LAUNCH synchronise after every kernel launch, so a failing kernel is named by
// the check right after it rather than by some later call.
#pragma once

#include <cublasLt.h>
#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <cstdlib>

#include "megatrain/core/error.hpp"

namespace megatrain::detail {

[[noreturn]] inline void throw_status(const char* expr, std::string reason, const SourceLoc& where) {
  throw_error(expr, std::move(reason), where);
}

inline void check_status(cudaError_t st, const char* expr, const SourceLoc& where) {
  if (st != cudaSuccess) [[unlikely]] {
    (void)cudaGetLastError();  // clear a non-sticky error so that the next call starts clean
    throw_status(expr, fmt::format("returned {} ({})", cudaGetErrorName(st), cudaGetErrorString(st)), where);
  }
}

inline void check_status(cublasStatus_t st, const char* expr, const SourceLoc& where) {
  if (st != CUBLAS_STATUS_SUCCESS) [[unlikely]]
    throw_status(expr, fmt::format("returned {} ({})", cublasGetStatusName(st), cublasGetStatusString(st)), where);
}

inline bool sync_debug_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("MEGATRAIN_SYNC_DEBUG");
    return e != nullptr && *e != '\0' && *e != '0';
  }();
  return on;
}

inline void check_launch(const char* what, const SourceLoc& where) {
  check_status(cudaGetLastError(), what, where);
  if (sync_debug_enabled()) check_status(cudaDeviceSynchronize(), what, where);
}

}  // namespace megatrain::detail

/// Checks a cudaError_t or cublasStatus_t (or, with cudnn_check.hpp / nccl_check.hpp included,
/// a cudnnStatus_t or ncclResult_t).
#define MT_CUDA_CHECK(expr) ::megatrain::detail::check_status((expr), #expr, MT_HERE)

/// After a kernel launch: checks the launch error (and synchronises under MEGATRAIN_SYNC_DEBUG).
#define MT_CUDA_CHECK_LAUNCH(kernel_name) ::megatrain::detail::check_launch(kernel_name, MT_HERE)
