// The attention's output gate on the GPU (Qwen3.5's and Qwen3-Next's q_proj: each head's query
// values then its gate inputs) and the shared expert's gate: sigmoid(gate) scaling groups of
// features (contract: backend/cuda/kernels.hpp). Memory-bound; fp32 arithmetic.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common.cuh"
#include "megatrain/backend/cuda/kernels.hpp"
#include "megatrain/core/cuda_check.hpp"

namespace megatrain::cuda {
namespace {

using namespace common;

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// split: x[h, i] = both[2h, i], gate[h, i] = both[2h + 1, i] (rows of dim); merge: the inverse.
__global__ void halves_kernel(const bf* both_in, const bf* x_in, const bf* gate_in, i64 n, i64 dim, bf* both_out, bf* x_out,
                              bf* gate_out) {
  for (i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; i < n; i += static_cast<i64>(gridDim.x) * blockDim.x) {
    const i64 h = i / dim, j = i % dim, xi = 2 * h * dim + j, gi = (2 * h + 1) * dim + j;
    if (both_in) {
      x_out[i] = both_in[xi];
      gate_out[i] = both_in[gi];
    } else {
      both_out[xi] = x_in[i];
      both_out[gi] = gate_in[i];
    }
  }
}

__global__ void sigmoid_gate_kernel(const bf* x, const bf* gate, i64 n, i64 group, bf* y) {
  for (i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; i < n; i += static_cast<i64>(gridDim.x) * blockDim.x)
    y[i] = __float2bfloat16(__bfloat162float(x[i]) * sigmoid(__bfloat162float(gate[i / group])));
}

// A warp a gate element: dx over its group, dgate = s (1 - s) sum dy x.
__global__ void sigmoid_gate_backward_kernel(const bf* x, const bf* gate, const bf* dy, i64 gates, i64 group, bf* dx,
                                             bf* dgate) {
  const i64 warps = static_cast<i64>(gridDim.x) * (blockDim.x / 32);
  for (i64 g = blockIdx.x * static_cast<i64>(blockDim.x / 32) + threadIdx.x / 32; g < gates; g += warps) {
    const float s = sigmoid(__bfloat162float(gate[g]));
    float dot = 0;
    for (i64 i = g * group + threadIdx.x % 32; i < (g + 1) * group; i += 32) {
      const float d = __bfloat162float(dy[i]);
      dx[i] = __float2bfloat16(d * s);
      dot += d * __bfloat162float(x[i]);
    }
    dot = warp_sum(dot);
    if (threadIdx.x % 32 == 0) dgate[g] = __float2bfloat16(dot * s * (1.0f - s));
  }
}

}  // namespace

void launch_split_halves(const bf16* both, std::int64_t n, std::int64_t dim, bf16* x, bf16* gate, cudaStream_t stream) {
  if (n == 0) return;
  halves_kernel<<<grid_for(n, 256), 256, 0, stream>>>(dev(both), nullptr, nullptr, n, dim, nullptr, dev(x), dev(gate));
  MT_CUDA_CHECK_LAUNCH("halves_kernel");
}
void launch_merge_halves(const bf16* x, const bf16* gate, std::int64_t n, std::int64_t dim, bf16* both, cudaStream_t stream) {
  if (n == 0) return;
  halves_kernel<<<grid_for(n, 256), 256, 0, stream>>>(nullptr, dev(x), dev(gate), n, dim, dev(both), nullptr, nullptr);
  MT_CUDA_CHECK_LAUNCH("halves_kernel");
}
void launch_sigmoid_gate(const bf16* x, const bf16* gate, std::int64_t n, std::int64_t group, bf16* y, cudaStream_t stream) {
  if (n == 0) return;
  sigmoid_gate_kernel<<<grid_for(n, 256), 256, 0, stream>>>(dev(x), dev(gate), n, group, dev(y));
  MT_CUDA_CHECK_LAUNCH("sigmoid_gate_kernel");
}
void launch_sigmoid_gate_backward(const bf16* x, const bf16* gate, const bf16* dy, std::int64_t gates, std::int64_t group,
                                  bf16* dx, bf16* dgate, cudaStream_t stream) {
  if (gates == 0) return;
  sigmoid_gate_backward_kernel<<<grid_for(gates, 8), 256, 0, stream>>>(dev(x), dev(gate), dev(dy), gates, group, dev(dx),
                                                                       dev(dgate));
  MT_CUDA_CHECK_LAUNCH("sigmoid_gate_backward_kernel");
}

}  // namespace megatrain::cuda
