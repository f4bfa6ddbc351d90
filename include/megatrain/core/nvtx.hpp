// NVTX ranges: every pipeline stage and public entry point opens one, so an Nsight Systems
// timeline shows whether copies overlap compute. Free (compiled out) in CPU-only builds.
#pragma once

#if MEGATRAIN_HAS_CUDA
#include <nvtx3/nvToolsExt.h>
#endif

namespace megatrain {

class NvtxRange {
 public:
#if MEGATRAIN_HAS_CUDA
  explicit NvtxRange(const char* name) { nvtxRangePushA(name); }
  ~NvtxRange() { nvtxRangePop(); }
#else
  explicit NvtxRange(const char*) {}
#endif
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

}  // namespace megatrain

#define MT_NVTX_CONCAT_(a, b) a##b
#define MT_NVTX_CONCAT(a, b) MT_NVTX_CONCAT_(a, b)
/// Opens an NVTX range named `name` until the end of the enclosing scope.
#define MT_NVTX_RANGE(name) ::megatrain::NvtxRange MT_NVTX_CONCAT(mt_nvtx_range_, __LINE__)(name)
