// What megatrain's CUDA translation units share (kernels.cu, moe.cu): element types, the grid of
// a grid-stride loop, and the warp reductions. Internal: not installed.
//
// Warp sums use the xor butterfly: each step adds a pair of values, and float addition is
// commutative, so every lane ends with the same bits, in an order fixed by the warp alone.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "megatrain/core/dtype.hpp"

namespace megatrain::cuda::common {

using bf = __nv_bfloat16;
using i64 = std::int64_t;
inline constexpr unsigned kFull = 0xffffffffu;

inline const bf* dev(const bf16* p) { return reinterpret_cast<const bf*>(p); }
inline bf* dev(bf16* p) { return reinterpret_cast<bf*>(p); }

/// Blocks for a grid-stride loop over `work` items: enough to fill any current GPU, no more.
inline unsigned grid_for(i64 work, int threads, i64 cap = 4096) {
  return static_cast<unsigned>(std::clamp<i64>((work + threads - 1) / threads, 1, cap));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

}  // namespace megatrain::cuda::common
