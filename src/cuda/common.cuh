// What megatrain's CUDA translation units share (kernels.cu, moe.cu): element types, the grid of
// a grid-stride loop, and the warp reductions. Internal: not installed.
//
// Warp sums use the xor butterfly: each step adds a pair of values, and float addition is
// commutative, so every lane ends with the same bits, in an order fixed by the warp alone.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "megatrain/core/dtype.hpp"
#include "megatrain/core/error.hpp"

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

// ---- host helpers ------------------------------------------------------------------------------

constexpr std::size_t kWorkspaceAlign = 256;
inline std::size_t align_up(std::size_t n, std::size_t a = kWorkspaceAlign) { return (n + a - 1) / a * a; }

/// Carves aligned pieces out of a caller's workspace (which need not itself be aligned: every
/// workspace size below includes kWorkspaceAlign bytes of slack for that).
class Carver {
 public:
  Carver(void* base, std::size_t bytes) {
    const auto b = reinterpret_cast<std::uintptr_t>(base);
    const std::uintptr_t a = (b + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
    p_ = reinterpret_cast<char*>(a);
    left_ = bytes >= a - b ? bytes - (a - b) : 0;
  }
  template <class T>
  T* take(std::size_t n) {
    const std::size_t bytes = align_up(n * sizeof(T));
    MT_CHECK(bytes <= left_, "workspace too small: {} more bytes needed, {} left", bytes, left_);
    T* r = reinterpret_cast<T*>(p_);
    p_ += bytes;
    left_ -= bytes;
    return r;
  }
  std::size_t left() const { return left_; }
  void* here() const { return p_; }

 private:
  char* p_;
  std::size_t left_;
};

}  // namespace megatrain::cuda::common
