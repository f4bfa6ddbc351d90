// megatrain's own CUDA kernels and their launchers (contract: backend/cuda/kernels.hpp).
//
// Everything here is either memory-bound (elementwise ops, casts, RMSNorm, rotary, embedding,
// cross-entropy, column and norm reductions) or a fallback (attention, for when cuDNN is absent
// or refuses a shape). The memory-bound kernels move 16 bytes per thread per access where the
// pointers and the row length allow it, and fall back to scalar accesses otherwise; all
// arithmetic is in fp32 (double where a norm is summed).
//
// Determinism is a contract, not an accident: no kernel uses floating-point atomics, and every
// reduction has an order fixed by the problem's shape alone (never by timing, nor by the GPU's
// multiprocessor count). Warp sums use the xor butterfly (each step adds a pair of values, and
// float addition is commutative, so every lane ends with the same bits); block sums add warp
// partials in warp order; sums over rows go through per-chunk partials that a second kernel adds
// in chunk order. The embedding backward sorts (id, position) pairs with a stable radix sort
// and lets one block own each run of equal ids.
//
// Attention (CUDA cores, online softmax): the forward and the dq kernel give each warp 8 query
// rows and let its lanes take one key each of a 32-key tile staged in shared memory (scores),
// then split the head dimension (the P·V or dS·K product); the dk/dv kernel mirrors this with
// 32-query tiles and 4 keys per warp, looping over the query heads of its group in order.
// Nothing is written by two blocks, so no atomics are needed.
//
// Out-of-range token ids and labels cannot be reported from a kernel: they stop it with
// __trap(), which the host sees as cudaErrorLaunchFailure at its next synchronisation. The CUDA
// backend validates ids on the host where it can; the trap is the last line of defence against
// reading or writing outside a table.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cub/device/device_radix_sort.cuh>
#include <type_traits>
#include <utility>

#include "megatrain/backend/backend.hpp"  // kIgnoreIndex
#include "megatrain/backend/cuda/kernels.hpp"
#include "common.cuh"
#include "megatrain/core/cuda_check.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/nvtx.hpp"

namespace megatrain::cuda {
namespace {

using namespace common;
using u32 = std::uint32_t;

// ---- host helpers ------------------------------------------------------------------------------

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }
bool aligned4(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 4 == 0; }

void check_workspace(const void* ws, std::size_t have, std::size_t need, const char* what) {
  MT_CHECK(have >= need, "{}: workspace of {} bytes is smaller than the {} bytes required", what, have, need);
  MT_CHECK(need == 0 || ws != nullptr, "{}: workspace is null", what);
}

// ---- device helpers ----------------------------------------------------------------------------

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ float bf_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ u32 pack_bf2(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);  // .x is the low half
  return static_cast<u32>(__bfloat16_as_ushort(h.x)) | (static_cast<u32>(__bfloat16_as_ushort(h.y)) << 16);
}
__device__ __forceinline__ uint4 ld16(const void* p) { return *static_cast<const uint4*>(p); }
__device__ __forceinline__ void st16(void* p, uint4 v) { *static_cast<uint4*>(p) = v; }
__device__ __forceinline__ void unpack8(uint4 u, float (&f)[8]) {
  const u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    f[2 * k] = bf_lo(w[k]);
    f[2 * k + 1] = bf_hi(w[k]);
  }
}
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  return make_uint4(pack_bf2(f[0], f[1]), pack_bf2(f[2], f[3]), pack_bf2(f[4], f[5]), pack_bf2(f[6], f[7]));
}
__device__ __forceinline__ void ld8(const float* p, float (&f)[8]) {  // 8 floats, two 16-byte loads
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}
__device__ __forceinline__ void st8(float* p, const float (&f)[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
}
__device__ __forceinline__ float ldf(const bf* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void stf(bf* p, float v) { *p = __float2bfloat16_rn(v); }
// The same for either element type (fp32 residual stream, bf16 activations).
__device__ __forceinline__ float ldf(const float* p) { return *p; }
__device__ __forceinline__ void stf(float* p, float v) { *p = v; }
__device__ __forceinline__ void ld8(const bf* p, float (&f)[8]) { unpack8(ld16(p), f); }
__device__ __forceinline__ void st8(bf* p, const float (&f)[8]) { st16(p, pack8(f)); }

__device__ __forceinline__ i64 min64(i64 a, i64 b) { return a < b ? a : b; }
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// ---- elementwise -------------------------------------------------------------------------------
// One grid-stride kernel over an op with a vector body (8 consecutive elements, 16-byte bf16
// accesses) and a scalar body (tails, or everything when a pointer is not 16-byte aligned).

constexpr int kMapThreads = 256;

template <class Op>
__global__ void __launch_bounds__(kMapThreads) map_kernel(Op op, i64 n, bool vec) {
  const i64 stride = static_cast<i64>(gridDim.x) * blockDim.x;
  const i64 tid = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x;
  i64 done = 0;
  if (vec) {
    const i64 nv = n / 8;
    for (i64 i = tid; i < nv; i += stride) op.vec8(i * 8);
    done = nv * 8;
  }
  for (i64 i = done + tid; i < n; i += stride) op.one(i);
}

template <class Op>
void launch_map(const char* name, const Op& op, i64 n, bool vec, cudaStream_t stream) {
  MT_CHECK(n >= 0, "{}: negative element count {}", name, n);
  if (n == 0) return;
  const i64 work = vec ? n / 8 + n % 8 : n;
  map_kernel<<<grid_for(work, kMapThreads), kMapThreads, 0, stream>>>(op, n, vec);
  MT_CUDA_CHECK_LAUNCH(name);
}

struct AddOp {
  const bf* x;
  bf* y;  // may alias x
  __device__ void vec8(i64 i) const {
    float a[8], b[8];
    unpack8(ld16(x + i), a);
    unpack8(ld16(y + i), b);
#pragma unroll
    for (int k = 0; k < 8; ++k) b[k] += a[k];
    st16(y + i, pack8(b));
  }
  __device__ void one(i64 i) const { stf(y + i, ldf(x + i) + ldf(y + i)); }
};

struct AddToResidualOp {  // y (fp32) += x (bf16)
  const bf* x;
  float* y;
  __device__ void vec8(i64 i) const {
    float a[8], b[8];
    unpack8(ld16(x + i), a);
    ld8(y + i, b);
#pragma unroll
    for (int k = 0; k < 8; ++k) b[k] += a[k];
    st8(y + i, b);
  }
  __device__ void one(i64 i) const { y[i] += ldf(x + i); }
};

struct AddBiasOp {  // y[r, c] (fp32) += bias[c] (bf16), over the flat index i = r * N + c
  const bf* bias;
  float* y;
  i64 N;
  __device__ void vec8(i64 i) const {  // (N % 8 == 0: 8 elements share a row)
    float a[8], b[8];
    unpack8(ld16(bias + i % N), a);
    ld8(y + i, b);
#pragma unroll
    for (int k = 0; k < 8; ++k) b[k] += a[k];
    st8(y + i, b);
  }
  __device__ void one(i64 i) const { y[i] += ldf(bias + i % N); }
};

struct CastToBf16Op {
  const float* in;
  bf* out;
  __device__ void vec8(i64 i) const {
    const float4 a = *reinterpret_cast<const float4*>(in + i), b = *reinterpret_cast<const float4*>(in + i + 4);
    const float f[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    st16(out + i, pack8(f));
  }
  __device__ void one(i64 i) const { stf(out + i, in[i]); }
};

struct CastToF32Op {
  const bf* in;
  float* out;
  __device__ void vec8(i64 i) const {
    float f[8];
    unpack8(ld16(in + i), f);
    *reinterpret_cast<float4*>(out + i) = make_float4(f[0], f[1], f[2], f[3]);
    *reinterpret_cast<float4*>(out + i + 4) = make_float4(f[4], f[5], f[6], f[7]);
  }
  __device__ void one(i64 i) const { out[i] = ldf(in + i); }
};

// The gate activations: silu (SwiGLU) and GELU's tanh approximation (GeGLU; PyTorch's
// gelu(approximate="tanh"), in fp32), with their derivatives.
constexpr float kGeluBeta = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluKappa = 0.044715f;
template <bool kGelu>
__device__ __forceinline__ float gate_act(float x) {
  if constexpr (kGelu) return 0.5f * x * (1.0f + tanhf(kGeluBeta * (x + kGeluKappa * x * x * x)));
  else return x * sigmoid(x);
}
template <bool kGelu>
__device__ __forceinline__ float gate_act_grad(float x) {
  if constexpr (kGelu) {
    const float t = tanhf(kGeluBeta * (x + kGeluKappa * x * x * x));
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kGeluBeta * (1.0f + 3.0f * kGeluKappa * x * x);
  } else {
    const float sg = sigmoid(x);
    return sg * (1.0f + x * (1.0f - sg));
  }
}

// GPT-OSS's clamped SwiGLU of its experts (act 2): g' = min(g, 7), u' = clamp(u, -7, 7),
// m = (u' + 1) g' sigmoid(1.702 g'); the gradient passes where a clamp is inactive (bounds included).
constexpr float kClampLimit = 7.0f, kClampAlpha = 1.702f;

/// kAct: 0 silu (SwiGLU), 1 tanh GELU (GeGLU), 2 GPT-OSS's clamped SwiGLU.
template <int kAct>
struct GatedForwardOp {
  const bf* g;
  const bf* u;
  bf* m;
  __device__ static float f(float gv, float uv) {
    if constexpr (kAct == 2) {
      const float gc = fminf(gv, kClampLimit), uc = fminf(fmaxf(uv, -kClampLimit), kClampLimit);
      return (uc + 1.0f) * (gc * sigmoid(gc * kClampAlpha));
    } else {
      return gate_act<kAct == 1>(gv) * uv;
    }
  }
  __device__ void vec8(i64 i) const {
    float a[8], b[8];
    unpack8(ld16(g + i), a);
    unpack8(ld16(u + i), b);
#pragma unroll
    for (int k = 0; k < 8; ++k) a[k] = f(a[k], b[k]);
    st16(m + i, pack8(a));
  }
  __device__ void one(i64 i) const { stf(m + i, f(ldf(g + i), ldf(u + i))); }
};

template <int kAct, bool kWithM>
struct GatedBackwardOp {
  const bf* g;
  const bf* u;
  const bf* dm;
  bf* dg;
  bf* du;
  bf* m;  // kWithM: the forward's m = act(g) * u as well (GatedForwardOp's expression: the same bits)
  // du = dm * act(g); dg = dm * u * act'(g) (silu: act' = sigmoid(g) (1 + g (1 - sigmoid(g))))
  __device__ static void f(float gv, float uv, float dmv, float& dgv, float& duv) {
    if constexpr (kAct == 2) {
      const float gc = fminf(gv, kClampLimit), uc = fminf(fmaxf(uv, -kClampLimit), kClampLimit);
      const float sg = sigmoid(gc * kClampAlpha), glu = gc * sg;
      duv = uv >= -kClampLimit && uv <= kClampLimit ? dmv * glu : 0.0f;
      dgv = gv <= kClampLimit ? dmv * (uc + 1.0f) * sg * (1.0f + kClampAlpha * gc * (1.0f - sg)) : 0.0f;
    } else if constexpr (kAct == 1) {
      duv = dmv * gate_act<true>(gv);
      dgv = dmv * uv * gate_act_grad<true>(gv);
    } else {  // (the same operations as before GeGLU existed: the same bits)
      const float sg = sigmoid(gv);
      duv = dmv * gv * sg;
      dgv = dmv * uv * sg * (1.0f + gv * (1.0f - sg));
    }
  }
  __device__ void vec8(i64 i) const {
    float a[8], b[8], c[8], rg[8], ru[8];
    unpack8(ld16(g + i), a);
    unpack8(ld16(u + i), b);
    unpack8(ld16(dm + i), c);
#pragma unroll
    for (int k = 0; k < 8; ++k) f(a[k], b[k], c[k], rg[k], ru[k]);
    st16(dg + i, pack8(rg));
    st16(du + i, pack8(ru));
    if constexpr (kWithM) {
#pragma unroll
      for (int k = 0; k < 8; ++k) a[k] = GatedForwardOp<kAct>::f(a[k], b[k]);
      st16(m + i, pack8(a));
    }
  }
  __device__ void one(i64 i) const {
    float rg, ru;
    const float gv = ldf(g + i), uv = ldf(u + i);
    f(gv, uv, ldf(dm + i), rg, ru);
    stf(dg + i, rg);
    stf(du + i, ru);
    if constexpr (kWithM) stf(m + i, GatedForwardOp<kAct>::f(gv, uv));
  }
};

// ---- embedding ---------------------------------------------------------------------------------

constexpr int kEmbThreads = 128;

template <class T>  // bf (the streamed bf16 table) or float (fp32 master rows)
__global__ void __launch_bounds__(kEmbThreads)
    embedding_forward_kernel(const std::int32_t* __restrict__ ids, const T* __restrict__ table, float* __restrict__ out,
                             i64 M, i64 d, i64 V, bool vec, float scale) {
  for (i64 t = blockIdx.x; t < M; t += gridDim.x) {
    const std::int32_t id = ids[t];
    if (id < 0 || id >= V) __trap();  // no row to read: stop (see the top of this file)
    const T* src = table + static_cast<i64>(id) * d;
    float* dst = out + t * d;
    if constexpr (std::is_same_v<T, float>) {
      for (i64 c = threadIdx.x; c < d; c += blockDim.x) dst[c] = src[c] * scale;
    } else if (vec) {
      for (i64 c = threadIdx.x; c < d / 8; c += blockDim.x) {
        float f[8];
        unpack8(ld16(src + 8 * c), f);
#pragma unroll
        for (int k = 0; k < 8; ++k) f[k] *= scale;
        st8(dst + 8 * c, f);
      }
    } else {
      for (i64 c = threadIdx.x; c < d; c += blockDim.x) dst[c] = ldf(src + c) * scale;
    }
  }
}

__global__ void __launch_bounds__(kEmbThreads)
    take_rows_kernel(const std::int32_t* __restrict__ rows, float* __restrict__ table, float* __restrict__ out, i64 U,
                     i64 d, i64 V, bool vec) {
  for (i64 i = blockIdx.x; i < U; i += gridDim.x) {
    const std::int32_t r = rows[i];
    if (r < 0 || r >= V) __trap();  // no row to move: stop (see the top of this file)
    float* src = table + static_cast<i64>(r) * d;
    float* dst = out + i * d;
    if (vec) {
      for (i64 c = threadIdx.x; c < d / 4; c += blockDim.x) {
        reinterpret_cast<float4*>(dst)[c] = reinterpret_cast<const float4*>(src)[c];
        reinterpret_cast<float4*>(src)[c] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    } else {
      for (i64 c = threadIdx.x; c < d; c += blockDim.x) {
        dst[c] = src[c];
        src[c] = 0.f;
      }
    }
  }
}

/// Sort keys (the ids, checked) and values (the positions 0..M-1).
__global__ void embedding_sort_init_kernel(const std::int32_t* __restrict__ ids, u32* __restrict__ keys,
                                           std::int32_t* __restrict__ pos, i64 M, i64 V) {
  const i64 stride = static_cast<i64>(gridDim.x) * blockDim.x;
  for (i64 i = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; i < M; i += stride) {
    const std::int32_t id = ids[i];
    if (id < 0 || id >= V) __trap();  // no row to write: stop (see the top of this file)
    keys[i] = static_cast<u32>(id);
    pos[i] = static_cast<std::int32_t>(i);
  }
}

/// After a stable sort by id: the block whose x index is the head of a run of equal ids sums
/// the dy rows of the run's positions (ascending) over its column slice, then adds the sum into
/// dtable's row. Rows are fetched 8 at a time so that their loads are in flight together.
template <int W>  // columns per thread: 8 (16-byte accesses) or 1
__global__ void __launch_bounds__(kEmbThreads)
    embedding_accumulate_kernel(const u32* __restrict__ keys, const std::int32_t* __restrict__ pos,
                                const float* __restrict__ dy, float* __restrict__ dtable, i64 M, i64 d, std::int32_t skip_id,
                                float scale) {
  constexpr int kBatch = 8;
  const i64 col = (static_cast<i64>(blockIdx.y) * blockDim.x + threadIdx.x) * W;
  if (col >= d) return;
  for (i64 i = blockIdx.x; i < M; i += gridDim.x) {
    const u32 id = keys[i];
    if (i > 0 && keys[i - 1] == id) continue;  // not the head of its run
    if (static_cast<std::int32_t>(id) == skip_id) continue;  // padding_idx: no gradient from the lookup
    float acc[W] = {};
    for (i64 j = i;; j += kBatch) {
      bool in[kBatch];
      std::int32_t p[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        in[b] = j + b < M && keys[j + b] == id;  // sorted: `in` is a prefix of the batch
        p[b] = in[b] ? pos[j + b] : 0;
      }
      if constexpr (W == 8) {
        float raw[kBatch][8];
#pragma unroll
        for (int b = 0; b < kBatch; ++b)
          if (in[b]) ld8(dy + static_cast<i64>(p[b]) * d + col, raw[b]);
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          if (!in[b]) continue;
#pragma unroll
          for (int k = 0; k < 8; ++k) acc[k] += raw[b][k] * scale;
        }
      } else {
        float v[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) v[b] = in[b] ? dy[static_cast<i64>(p[b]) * d + col] : 0.0f;
#pragma unroll
        for (int b = 0; b < kBatch; ++b)
          if (in[b]) acc[0] += v[b] * scale;
      }
      if (!in[kBatch - 1]) break;
    }
    float* dst = dtable + static_cast<i64>(id) * d + col;
    if constexpr (W == 8) {
      float4* d4 = reinterpret_cast<float4*>(dst);
      float4 a = d4[0], b = d4[1];
      a.x += acc[0], a.y += acc[1], a.z += acc[2], a.w += acc[3];
      b.x += acc[4], b.y += acc[5], b.z += acc[6], b.w += acc[7];
      d4[0] = a;
      d4[1] = b;
    } else {
      dst[0] += acc[0];
    }
  }
}

std::size_t radix_sort_temp_bytes(i64 M, int end_bit) {
  std::size_t bytes = 0;
  cub::DoubleBuffer<u32> keys(nullptr, nullptr);
  cub::DoubleBuffer<std::int32_t> vals(nullptr, nullptr);
  MT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, keys, vals, static_cast<int>(M), 0, end_bit));
  return bytes;
}

// ---- RMSNorm -----------------------------------------------------------------------------------
// A group of kGroup threads owns a row (a warp for short rows, part or all of a block for long
// ones); blocks hold kBlock / kGroup rows. Two passes over the row: its sum (of squares, or of
// dy*w*xhat), then the elementwise result. The second read of x hits L1/L2.

/// Sum over the kGroup threads of a row group, identical in every thread of the group. Every
/// thread of the block must call it (it synchronises when the group spans warps).
template <int kGroup, int kBlock>
__device__ __forceinline__ float group_sum(float v) {
  v = warp_sum(v);
  if constexpr (kGroup == 32) {
    return v;
  } else {
    constexpr int kWarps = kGroup / 32;
    __shared__ float partial[kBlock / 32];
    const int warp = threadIdx.x / 32, first = warp / kWarps * kWarps;
    if (threadIdx.x % 32 == 0) partial[warp] = v;
    __syncthreads();
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < kWarps; ++k) s += partial[first + k];
    return s;
  }
}

// x is the residual stream (fp32) or activations (bf16: q/k norms), w the gain (fp32), y the
// normalised activations (bf16).
template <int kGroup, int kBlock, class X>
__global__ void __launch_bounds__(kBlock)
    rmsnorm_forward_kernel(const X* __restrict__ x, const float* __restrict__ w, bf* __restrict__ y,
                           float* __restrict__ rstd, i64 M, int d, float eps, bool vec, float offset) {
  constexpr int kRows = kBlock / kGroup;
  const int t = threadIdx.x % kGroup;
  const i64 r = static_cast<i64>(blockIdx.x) * kRows + threadIdx.x / kGroup;
  const bool live = r < M;
  const X* xr = x + (live ? r : 0) * d;
  float ss = 0.0f;
  if (live) {
    if (vec) {
      for (int c = t * 8; c < d; c += kGroup * 8) {
        float f[8];
        ld8(xr + c, f);
#pragma unroll
        for (int k = 0; k < 8; ++k) ss = fmaf(f[k], f[k], ss);
      }
    } else {
      for (int c = t; c < d; c += kGroup) ss = fmaf(ldf(xr + c), ldf(xr + c), ss);
    }
  }
  ss = group_sum<kGroup, kBlock>(ss);
  if (!live) return;
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(d) + eps);
  if (t == 0) rstd[r] = inv;
  bf* yr = y + r * d;
  if (vec) {
    for (int c = t * 8; c < d; c += kGroup * 8) {
      float f[8], g[8];
      ld8(xr + c, f);
      ld8(w + c, g);
#pragma unroll
      for (int k = 0; k < 8; ++k) f[k] = f[k] * inv * (g[k] + offset);
      st16(yr + c, pack8(f));
    }
  } else {
    for (int c = t; c < d; c += kGroup) stf(yr + c, ldf(xr + c) * inv * (w[c] + offset));
  }
}

// dx = residual (if any) + the norm's input gradient, in fp32, and dx_act = bf16(dx) (if asked
// for); x fp32 (or bf16: q/k norms), w fp32, dy (the gradient of the bf16 output) bf16, dx fp32 (or
// bf16, without residual and dx_act). residual may be dx itself.
template <int kGroup, int kBlock, class X, class DX>
__global__ void __launch_bounds__(kBlock)
    rmsnorm_backward_dx_kernel(const X* __restrict__ x, const float* __restrict__ w, const float* __restrict__ rstd,
                               const bf* __restrict__ dy, const float* residual, DX* dx, bf* __restrict__ dx_act, i64 M,
                               int d, bool vec, float offset) {
  constexpr int kRows = kBlock / kGroup;
  const int t = threadIdx.x % kGroup;
  const i64 r = static_cast<i64>(blockIdx.x) * kRows + threadIdx.x / kGroup;
  const bool live = r < M;
  const i64 off = (live ? r : 0) * d;
  const float inv = live ? rstd[r] : 0.0f;
  float dot = 0.0f;  // sum_i (dy_i w_i) * xhat_i
  if (live) {
    if (vec) {
      for (int c = t * 8; c < d; c += kGroup * 8) {
        float a[8], b[8], g[8];
        ld8(x + off + c, a);
        unpack8(ld16(dy + off + c), b);
        ld8(w + c, g);
#pragma unroll
        for (int k = 0; k < 8; ++k) dot = fmaf(b[k] * (g[k] + offset), a[k] * inv, dot);
      }
    } else {
      for (int c = t; c < d; c += kGroup) dot = fmaf(ldf(dy + off + c) * (w[c] + offset), ldf(x + off + c) * inv, dot);
    }
  }
  dot = group_sum<kGroup, kBlock>(dot);
  if (!live) return;
  const float mean = dot / static_cast<float>(d);
  if (vec) {
    for (int c = t * 8; c < d; c += kGroup * 8) {
      float a[8], b[8], g[8], o[8];
      ld8(x + off + c, a);
      unpack8(ld16(dy + off + c), b);
      ld8(w + c, g);
      if (residual != nullptr) ld8(residual + off + c, o);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float v = inv * (b[k] * (g[k] + offset) - a[k] * inv * mean);
        o[k] = residual != nullptr ? o[k] + v : v;
      }
      st8(dx + off + c, o);
      if (dx_act != nullptr) st16(dx_act + off + c, pack8(o));
    }
  } else {
    for (int c = t; c < d; c += kGroup) {
      const float v = inv * (ldf(dy + off + c) * (w[c] + offset) - ldf(x + off + c) * inv * mean);
      const float o = residual != nullptr ? residual[off + c] + v : v;
      stf(dx + off + c, o);
      if (dx_act != nullptr) stf(dx_act + off + c, o);
    }
  }
}

/// Picks the row-group size from the row length and launches `K<kGroup, kBlock>`.
template <class F>
void dispatch_row_group(i64 items, F&& f) {
  if (items <= 128) f(std::integral_constant<int, 32>{}, std::integral_constant<int, 256>{});
  else if (items <= 1024) f(std::integral_constant<int, 128>{}, std::integral_constant<int, 256>{});
  else f(std::integral_constant<int, 512>{}, std::integral_constant<int, 512>{});
}

// ---- column reductions (bias gradients, RMSNorm's dw) ------------------------------------------
// out[c] += sum_r f(r, c): a block of threads takes a slice of columns (8 per thread where rows
// allow 16-byte accesses) and a chunk of rows, and writes its column sums to partial[chunk];
// a second kernel adds the chunks' partials in chunk order. The chunking depends on M and N only
// (not on alignment): enough chunks that about kColThreadsWanted threads stream the rows (a
// narrow matrix, such as a key projection's bias of 256 columns, gets more chunks), at least
// kColMinRows rows each.

constexpr int kColThreads = 128;
constexpr i64 kColMinChunks = 128;
constexpr i64 kColMaxChunks = 1024;
constexpr i64 kColMinRows = 32;
constexpr i64 kColThreadsWanted = i64{1} << 17;

i64 column_chunks(i64 M, i64 N) {
  const i64 threads_per_chunk = std::max<i64>(1, (N + 7) / 8);
  const i64 most = std::clamp<i64>(kColThreadsWanted / threads_per_chunk, kColMinChunks, kColMaxChunks);
  return std::clamp<i64>((M + kColMinRows - 1) / kColMinRows, 1, most);
}

struct ColumnOfBf16 {
  const bf* x;
  i64 N;
  __device__ void add8(i64 r, i64 c, float (&acc)[8]) const {
    float f[8];
    unpack8(ld16(x + r * N + c), f);
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[k] += f[k];
  }
  __device__ float one(i64 r, i64 c) const { return ldf(x + r * N + c); }
};

template <class X>
struct RmsNormDw {  // dy[r, c] * x[r, c] * rstd[r]
  const bf* dy;
  const X* x;
  const float* rstd;
  i64 N;
  __device__ void add8(i64 r, i64 c, float (&acc)[8]) const {
    float a[8], b[8];
    unpack8(ld16(dy + r * N + c), a);
    ld8(x + r * N + c, b);
    const float s = rstd[r];
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[k] = fmaf(a[k] * b[k], s, acc[k]);
  }
  __device__ float one(i64 r, i64 c) const { return ldf(dy + r * N + c) * ldf(x + r * N + c) * rstd[r]; }
};

template <class F>
__global__ void __launch_bounds__(kColThreads)
    column_partial_kernel(F f, i64 M, i64 N, i64 rows_per_chunk, float* __restrict__ partial, bool vec) {
  const i64 W = vec ? 8 : 1;
  const i64 col = (static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x) * W;
  if (col >= N) return;
  const i64 r0 = blockIdx.y * rows_per_chunk, r1 = min64(M, r0 + rows_per_chunk);
  float* dst = partial + static_cast<i64>(blockIdx.y) * N + col;
  if (vec) {
    float acc[8] = {};
    for (i64 r = r0; r < r1; ++r) f.add8(r, col, acc);
    reinterpret_cast<float4*>(dst)[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    reinterpret_cast<float4*>(dst)[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
  } else {
    float acc = 0.0f;
    for (i64 r = r0; r < r1; ++r) acc += f.one(r, col);
    *dst = acc;
  }
}

// out[c] += the chunks' partials of column c: a block takes 32 columns; its 8 rows of threads each
// add every 8th chunk (in chunk order), then thread row 0 adds the 8 sums in order.
constexpr int kColFinalRows = 8;
__global__ void __launch_bounds__(32 * kColFinalRows)
    column_finalize_kernel(const float* __restrict__ partial, int chunks, i64 N, float* __restrict__ out) {
  __shared__ float sums[kColFinalRows][32];
  const i64 c = static_cast<i64>(blockIdx.x) * 32 + threadIdx.x;
  float s = 0.0f;
  if (c < N)
    for (int k = static_cast<int>(threadIdx.y); k < chunks; k += kColFinalRows) s += partial[k * N + c];
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < N) {
    float t = 0.0f;
#pragma unroll
    for (int j = 0; j < kColFinalRows; ++j) t += sums[j][threadIdx.x];
    out[c] += t;
  }
}

/// Workspace for a reduction of [M, n] for every n <= N (a narrower matrix may take more chunks:
/// chunks x n is at most kColThreadsWanted x 8, or kColMinChunks x n).
std::size_t column_reduce_bytes(i64 M, i64 N) {
  const i64 most = std::min((M + kColMinRows - 1) / kColMinRows * N, std::max(kColThreadsWanted * 8, kColMinChunks * N));
  return kWorkspaceAlign + align_up(static_cast<std::size_t>(std::max<i64>(most, column_chunks(M, N) * N)) * sizeof(float));
}

/// Both passes of out[c] += sum_r f(r, c) over [M, N]; `vec` when f's rows allow 16-byte loads.
template <class F>
void column_reduce(const char* name, const F& f, i64 M, i64 N, bool vec, float* out, void* workspace, std::size_t bytes,
                   cudaStream_t stream) {
  if (M == 0 || N == 0) return;
  vec = vec && N % 8 == 0;
  const i64 chunks = column_chunks(M, N), rows_per_chunk = (M + chunks - 1) / chunks;
  Carver carve(workspace, bytes);
  float* partial = carve.take<float>(static_cast<std::size_t>(chunks * N));
  const i64 per_block = kColThreads * (vec ? 8 : 1);
  const i64 col_blocks = (N + per_block - 1) / per_block;
  MT_CHECK(col_blocks <= INT_MAX, "{}: {} columns are too many", name, N);
  column_partial_kernel<<<dim3(static_cast<unsigned>(col_blocks), static_cast<unsigned>(chunks)), kColThreads, 0,
                          stream>>>(f, M, N, rows_per_chunk, partial, vec);
  MT_CUDA_CHECK_LAUNCH(name);
  MT_CHECK((N + 31) / 32 <= INT_MAX, "{}: {} columns are too many", name, N);
  column_finalize_kernel<<<static_cast<unsigned>((N + 31) / 32), dim3(32, kColFinalRows), 0, stream>>>(
      partial, static_cast<int>(chunks), N, out);
  MT_CUDA_CHECK_LAUNCH(name);
}

// ---- sum of squares ----------------------------------------------------------------------------

constexpr int kSsThreads = 256;
constexpr i64 kSsMaxBlocks = 1024;

i64 sum_squares_blocks(i64 n) { return std::clamp<i64>((n + kSsThreads * 16 - 1) / (kSsThreads * 16), 1, kSsMaxBlocks); }

/// Block sum in fixed order (warp butterflies, then warps in order); the result is in thread 0.
__device__ double block_sum(double v) {
  __shared__ double partial[32];
  v = warp_sum(v);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  double s = 0.0;
  if (threadIdx.x == 0)
    for (unsigned k = 0; k < blockDim.x / 32; ++k) s += partial[k];
  return s;
}

__global__ void __launch_bounds__(kSsThreads)
    sum_squares_partial_kernel(const float* __restrict__ x, i64 n, double* __restrict__ partial, bool vec) {
  const i64 stride = static_cast<i64>(gridDim.x) * blockDim.x;
  const i64 tid = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x;
  double acc = 0.0;
  i64 done = 0;
  if (vec) {
    const i64 nv = n / 4;
    for (i64 i = tid; i < nv; i += stride) {
      const float4 a = reinterpret_cast<const float4*>(x)[i];
      acc += static_cast<double>(a.x) * a.x;  // exact: a float's square fits a double
      acc += static_cast<double>(a.y) * a.y;
      acc += static_cast<double>(a.z) * a.z;
      acc += static_cast<double>(a.w) * a.w;
    }
    done = nv * 4;
  }
  for (i64 i = done + tid; i < n; i += stride) acc += static_cast<double>(x[i]) * x[i];
  const double s = block_sum(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__global__ void __launch_bounds__(kSsThreads)
    sum_squares_final_kernel(const double* __restrict__ partial, int blocks, double* __restrict__ out) {
  double acc = 0.0;
  for (int i = threadIdx.x; i < blocks; i += blockDim.x) acc += partial[i];
  const double s = block_sum(acc);
  if (threadIdx.x == 0) *out = s;
}

// ---- cross-entropy -----------------------------------------------------------------------------
// One block per row. Pass 1: each thread keeps an online (max, sum of exp) over its elements;
// the block merges them in fixed order. Pass 2 (if dlogits is wanted) re-reads the row (L2).

constexpr int kCeMaxThreads = 512;

struct MaxSum {
  float m, s;  // running max, sum of exp(z - m)
};
__device__ __forceinline__ void online_add(MaxSum& a, float z) {
  if (z > a.m) {
    a.s = a.s * expf(a.m - z) + 1.0f;
    a.m = z;
  } else if (a.m != -INFINITY) {
    a.s += expf(z - a.m);
  }
}
__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.0f};
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

__global__ void __launch_bounds__(kCeMaxThreads)
    cross_entropy_kernel(const float* __restrict__ logits, const std::int32_t* __restrict__ labels, float* __restrict__ loss,
                         bf* __restrict__ dlogits, float scale, const float* __restrict__ weights, i64 V, bool vec_in,
                         bool vec_out) {
  __shared__ MaxSum warp_part[kCeMaxThreads / 32];
  const i64 r = blockIdx.x;
  const float* z = logits + r * V;
  const std::int32_t y = labels[r];
  const bool ignored = y == kIgnoreIndex;
  if (!ignored && (y < 0 || y >= V)) __trap();  // no logit to read: stop (see the top of this file)

  MaxSum ms{-INFINITY, 0.0f};
  if (vec_in) {
    for (i64 c = threadIdx.x; c < V / 4; c += blockDim.x) {
      const float4 a = reinterpret_cast<const float4*>(z)[c];
      online_add(ms, a.x);
      online_add(ms, a.y);
      online_add(ms, a.z);
      online_add(ms, a.w);
    }
    for (i64 c = V / 4 * 4 + threadIdx.x; c < V; c += blockDim.x) online_add(ms, z[c]);
  } else {
    for (i64 c = threadIdx.x; c < V; c += blockDim.x) online_add(ms, z[c]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ms = merge(ms, {__shfl_xor_sync(kFull, ms.m, o), __shfl_xor_sync(kFull, ms.s, o)});
  if (threadIdx.x % 32 == 0) warp_part[threadIdx.x / 32] = ms;
  __syncthreads();
  ms = warp_part[0];
  for (unsigned k = 1; k < blockDim.x / 32; ++k) ms = merge(ms, warp_part[k]);
  const float lse = ms.m + logf(ms.s);
  if (threadIdx.x == 0) loss[r] = ignored ? 0.0f : lse - z[y];
  if (dlogits == nullptr) return;

  bf* dl = dlogits + r * V;
  const float g = ignored ? 0.0f : weights == nullptr ? scale : scale * weights[r];  // ignored rows get zeros
  auto grad = [&](i64 c, float zc) { return g * expf(zc - lse) - (c == y ? g : 0.0f); };
  if (vec_out) {  // 4 logits in, 4 bf16 (8 bytes) out
    for (i64 c = threadIdx.x; c < V / 4; c += blockDim.x) {
      const float4 a = reinterpret_cast<const float4*>(z)[c];
      const i64 e = c * 4;
      reinterpret_cast<uint2*>(dl)[c] =
          make_uint2(pack_bf2(grad(e, a.x), grad(e + 1, a.y)), pack_bf2(grad(e + 2, a.z), grad(e + 3, a.w)));
    }
    for (i64 c = V / 4 * 4 + threadIdx.x; c < V; c += blockDim.x) stf(dl + c, grad(c, z[c]));
  } else {
    for (i64 c = threadIdx.x; c < V; c += blockDim.x) stf(dl + c, grad(c, z[c]));
  }
}

// ---- rotary ------------------------------------------------------------------------------------
// A block per token (grid-stride): the token's cos/sin table (half entries, fp32, the angle
// formed in fp32 as Hugging Face does) goes to shared memory, then the block rotates every head.

constexpr int kRopeThreads = 128;

__global__ void __launch_bounds__(kRopeThreads)
    rope_kernel(bf* __restrict__ x, const std::int32_t* __restrict__ positions, i64 M, int heads, int D, i64 seq,
                const __grid_constant__ RopeFreqs freqs, bool inverse, bool vec) {
  __shared__ float cs[RopeFreqs::kMax], sn[RopeFreqs::kMax];
  const int half = freqs.half;
  const int W = vec ? 8 : 1;
  const int per_head = half / W, items = heads * per_head;
  for (i64 t = blockIdx.x; t < M; t += gridDim.x) {
    const float pos = static_cast<float>(positions ? positions[t] : t % seq);
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
      float s, c;
      sincosf(pos * freqs.inv_freq[i], &s, &c);
      cs[i] = c * freqs.scale;
      sn[i] = (inverse ? -s : s) * freqs.scale;
    }
    __syncthreads();
    bf* xt = x + t * heads * D;
    for (int it = threadIdx.x; it < items; it += blockDim.x) {
      const int h = it / per_head, i0 = (it - h * per_head) * W;
      bf* p = xt + h * D + i0;
      if (vec) {
        float a[8], b[8];
        unpack8(ld16(p), a);
        unpack8(ld16(p + half), b);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const float c = cs[i0 + k], s = sn[i0 + k], ak = a[k];
          a[k] = ak * c - b[k] * s;
          b[k] = b[k] * c + ak * s;
        }
        st16(p, pack8(a));
        st16(p + half, pack8(b));
      } else {
        const float a = ldf(p), b = ldf(p + half), c = cs[i0], s = sn[i0];
        stf(p, a * c - b * s);
        stf(p + half, b * c + a * s);
      }
    }
    __syncthreads();
  }
}

// ---- attention ---------------------------------------------------------------------------------
// Layouts: q, out, dout, dq [rows*S, H*D]; k, v, dk, dv [rows*S, Hkv*D]; lse, delta [rows, H, S].
// Shared-memory tiles hold kTile rows of one head, either as bf16 pairs (u32 words, row stride
// `ks` odd, so that lanes reading one row each hit distinct banks) or as fp32 (row stride Dp,
// read by all lanes at one address: a broadcast). Dp = D rounded up to 4; padding is zero.

constexpr int kTile = 32;                       // keys (forward, dq) or queries (dk/dv) per tile
constexpr int kQWarps = 4, kQRows = 8;          // forward and dq: 4 warps x 8 query rows
constexpr int kKvWarps = 8, kKvRows = 4;        // dk/dv: 8 warps x 4 key rows
static_assert(kQWarps * kQRows == kTile && kKvWarps * kKvRows == kTile);

struct AttnParams {
  int S, H, Hkv, G, D;
  int Dp;          ///< D rounded up to a multiple of 4
  int Dw;          ///< Dp / 2: bf16 pairs per padded row
  int ks;          ///< row stride of a pair tile, in words: Dw + 1 (odd)
  float scale;     ///< the softmax scale: 1 / sqrt(D) unless the dims give one
  float scale_log2;  ///< scale * log2(e): scores go straight to exp2
  int window;      ///< query i sees keys from i - window + 1 on; 0: no window
  /// Packed rows: each token's position within its sequence ([rows*S]), or null (a row is one
  /// sequence). Query i of a row sees keys i - pos[i] .. i; i - pos[i] never decreases along a row.
  const std::int32_t* pos;
  /// GPT-OSS's sink logit per query head ([H], unscaled; joins every query's softmax, carries no
  /// value), or null.
  const float* sinks;
};

/// The first key query i of the row at `base` sees.
/// (Its sequence's first token where rows are packed, and no earlier than the window allows.)
__device__ __forceinline__ int first_key(const AttnParams& p, i64 base, int i) {
  const int f = p.pos ? i - p.pos[base + i] : 0;
  return p.window > 0 ? max(f, i - p.window + 1) : f;
}

/// Rows [tok0, tok0 + kTile) of head `hh` (of `nh`) of sequence `base`, as bf16 pairs.
__device__ __forceinline__ void load_pair_tile(u32* __restrict__ dst, const bf* __restrict__ src, i64 base, int tok0, int hh,
                                               int nh, const AttnParams& p) {
  for (int idx = threadIdx.x; idx < kTile * p.Dw; idx += blockDim.x) {
    const int j = idx / p.Dw, w = idx - j * p.Dw, tok = tok0 + j;
    u32 v = 0;
    if (tok < p.S && 2 * w < p.D) v = *reinterpret_cast<const u32*>(src + ((base + tok) * nh + hh) * p.D + 2 * w);
    dst[j * p.ks + w] = v;
  }
}

/// The same rows as fp32, times `mul`.
__device__ __forceinline__ void load_float_tile(float* __restrict__ dst, const bf* __restrict__ src, i64 base, int tok0,
                                                int hh, int nh, const AttnParams& p, float mul) {
  for (int idx = threadIdx.x; idx < kTile * p.Dw; idx += blockDim.x) {
    const int j = idx / p.Dw, w = idx - j * p.Dw, tok = tok0 + j;
    u32 v = 0;
    if (tok < p.S && 2 * w < p.D) v = *reinterpret_cast<const u32*>(src + ((base + tok) * nh + hh) * p.D + 2 * w);
    *reinterpret_cast<float2*>(dst + j * p.Dp + 2 * w) = make_float2(bf_lo(v) * mul, bf_hi(v) * mul);
  }
}

__device__ __forceinline__ float dot4(float4 a, u32 w01, u32 w23, float acc) {
  acc = fmaf(a.x, bf_lo(w01), acc);
  acc = fmaf(a.y, bf_hi(w01), acc);
  acc = fmaf(a.z, bf_lo(w23), acc);
  return fmaf(a.w, bf_hi(w23), acc);
}
__device__ __forceinline__ float get(const float4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

/// Forward. Block: one 32-query tile of one (sequence, head); the heaviest tiles launch first.
/// kPairs = ceil(Dw / 32): the bf16 pairs of the head dimension each lane owns in P·V.
template <int kPairs>
__global__ void __launch_bounds__(kQWarps * 32)
    attention_forward_kernel(const bf* __restrict__ q, const bf* __restrict__ k, const bf* __restrict__ v,
                             bf* __restrict__ out, float* __restrict__ lse, const AttnParams p) {
  extern __shared__ float4 smem[];
  float* Ps = reinterpret_cast<float*>(smem);   // [kQWarps][kQRows][32] probabilities
  float* Qs = Ps + kQWarps * kQRows * 32;       // [kTile][Dp], pre-scaled by scale*log2(e)
  u32* Ks = reinterpret_cast<u32*>(Qs + kTile * p.Dp);  // [kTile][ks]
  u32* Vs = Ks + kTile * p.ks;                           // [kTile][ks]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int qt = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, kh = h / p.G;
  const i64 base = static_cast<i64>(blockIdx.z) * p.S;
  const int q0 = qt * kTile + warp * kQRows;  // this warp's first query
  const int dp4 = p.Dp / 4;
  load_float_tile(Qs, q, base, qt * kTile, h, p.H, p, p.scale_log2);

  float m[kQRows], l[kQRows], o[kQRows][2 * kPairs];
  int k_first[kQRows];
  // (a sink starts each query's running max at its logit and the sum at its exp2(0) = 1, on lane 0:
  // the lanes' partial sums are added at the end)
  const float sink2 = p.sinks ? p.sinks[h] * kLog2e : -INFINITY;
#pragma unroll
  for (int r = 0; r < kQRows; ++r) {
    m[r] = sink2;
    l[r] = p.sinks && lane == 0 ? 1.0f : 0.0f;
    k_first[r] = q0 + r < p.S ? first_key(p, base, q0 + r) : 0;
#pragma unroll
    for (int e = 0; e < 2 * kPairs; ++e) o[r][e] = 0.0f;
  }
  const float4* Qw = reinterpret_cast<const float4*>(Qs) + warp * kQRows * dp4;
  float* Pw = Ps + warp * kQRows * 32;

  for (int kt = first_key(p, base, qt * kTile) / kTile; kt <= qt; ++kt) {
    load_pair_tile(Ks, k, base, kt * kTile, kh, p.Hkv, p);
    load_pair_tile(Vs, v, base, kt * kTile, kh, p.Hkv, p);
    __syncthreads();
    // Scores: lane j takes key kt*32 + j against the warp's 8 queries.
    float s[kQRows] = {};
    const u32* kr = Ks + lane * p.ks;
#pragma unroll 2
    for (int c = 0; c < dp4; ++c) {
      const u32 w01 = kr[2 * c], w23 = kr[2 * c + 1];
#pragma unroll
      for (int r = 0; r < kQRows; ++r) s[r] = dot4(Qw[r * dp4 + c], w01, w23, s[r]);
    }
    const int key = kt * kTile + lane;
#pragma unroll
    for (int r = 0; r < kQRows; ++r) {
      const float sv = (key <= q0 + r && key < p.S && key >= k_first[r]) ? s[r] : -INFINITY;
      const float mx = fmaxf(m[r], warp_max(sv));  // -inf only while a packed query's sequence starts later
      const float mref = mx == -INFINITY ? 0.0f : mx;
      const float corr = exp2f(m[r] - mref), pr = exp2f(sv - mref);
      l[r] = fmaf(l[r], corr, pr);  // per-lane partial; the lanes are summed at the end
      m[r] = mx;
#pragma unroll
      for (int e = 0; e < 2 * kPairs; ++e) o[r][e] *= corr;
      Pw[r * 32 + lane] = pr;
    }
    __syncwarp();
    // O += P V: lane owns pairs lane + 32 i of the head dimension.
#pragma unroll 2
    for (int j = 0; j < kTile; j += 4) {
      float4 pr[kQRows];
#pragma unroll
      for (int r = 0; r < kQRows; ++r) pr[r] = reinterpret_cast<const float4*>(Pw + r * 32)[j / 4];
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const u32* vr = Vs + (j + jj) * p.ks;
#pragma unroll
        for (int i = 0; i < kPairs; ++i) {
          const u32 vw = vr[min(lane + 32 * i, p.Dw - 1)];  // clamped lanes compute values never stored
          const float v0 = bf_lo(vw), v1 = bf_hi(vw);
#pragma unroll
          for (int r = 0; r < kQRows; ++r) {
            const float pj = get(pr[r], jj);
            o[r][2 * i] = fmaf(pj, v0, o[r][2 * i]);
            o[r][2 * i + 1] = fmaf(pj, v1, o[r][2 * i + 1]);
          }
        }
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int r = 0; r < kQRows; ++r) {
    const float lt = warp_sum(l[r]);
    const int qi = q0 + r;
    if (qi >= p.S) continue;
    const float inv = 1.0f / lt;
    bf* orow = out + ((base + qi) * p.H + h) * p.D;
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
      const int w = lane + 32 * i;
      if (2 * w < p.D) *reinterpret_cast<u32*>(orow + 2 * w) = pack_bf2(o[r][2 * i] * inv, o[r][2 * i + 1] * inv);
    }
    if (lane == 0) lse[(static_cast<i64>(blockIdx.z) * p.H + h) * p.S + qi] = (m[r] + log2f(lt)) * kLn2;
  }
}

/// delta[row, h, i] = sum_d dout * out (fp32), a warp per (token, head).
__global__ void __launch_bounds__(256)
    attention_delta_kernel(const bf* __restrict__ out, const bf* __restrict__ dout, float* __restrict__ delta, i64 tokens,
                           const AttnParams p) {
  const i64 warps = static_cast<i64>(gridDim.x) * (blockDim.x / 32);
  const int lane = threadIdx.x % 32;
  for (i64 gw = static_cast<i64>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; gw < tokens * p.H; gw += warps) {
    const i64 t = gw / p.H;
    const int h = static_cast<int>(gw - t * p.H);
    const bf* o = out + gw * p.D;
    const bf* g = dout + gw * p.D;
    float acc = 0.0f;
    for (int w = lane; 2 * w < p.D; w += 32) {
      const u32 a = *reinterpret_cast<const u32*>(o + 2 * w), b = *reinterpret_cast<const u32*>(g + 2 * w);
      acc = fmaf(bf_lo(a), bf_lo(b), acc);
      acc = fmaf(bf_hi(a), bf_hi(b), acc);
    }
    acc = warp_sum(acc);
    const i64 row = t / p.S, i = t - row * p.S;
    if (lane == 0) delta[(row * p.H + h) * p.S + i] = acc;
  }
}

/// dsinks[h] += -sum over the rows and queries of exp(sink_h - lse) * delta (the sink's probability
/// times the gradient of its logit, 0 - delta: it carries no value). A block per head, each thread
/// its strided queries in order, then the block's fixed-order sum: deterministic.
__global__ void __launch_bounds__(kSsThreads)
    attention_sinks_grad_kernel(const float* __restrict__ lse, const float* __restrict__ delta, i64 rows,
                                float* __restrict__ dsinks, const AttnParams p) {
  const int h = blockIdx.x;
  const float sink = p.sinks[h];
  double acc = 0.0;
  for (i64 row = 0; row < rows; ++row) {
    const i64 at = (row * p.H + h) * p.S;
    for (int i = threadIdx.x; i < p.S; i += blockDim.x)
      acc -= static_cast<double>(expf(sink - lse[at + i])) * static_cast<double>(delta[at + i]);
  }
  const double s = block_sum(acc);
  if (threadIdx.x == 0) dsinks[h] += static_cast<float>(s);
}

/// Sinks added after an attention without them (cuDNN's): with l the query's log-sum-exp and s its
/// head's sink, l' = log(exp(l) + exp(s)); the output times exp(l - l') (the probabilities the sink
/// takes), lse = l'. A warp per (token, head).
__global__ void __launch_bounds__(256)
    attention_add_sinks_kernel(bf* __restrict__ out, float* __restrict__ lse, i64 tokens, const AttnParams p) {
  const i64 warps = static_cast<i64>(gridDim.x) * (blockDim.x / 32);
  const int lane = threadIdx.x % 32;
  for (i64 gw = static_cast<i64>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; gw < tokens * p.H; gw += warps) {
    const i64 t = gw / p.H;
    const int h = static_cast<int>(gw - t * p.H);
    const i64 row = t / p.S, i = t - row * p.S;
    float* l = lse + (row * p.H + h) * p.S + i;
    const float lv = *l, sv = p.sinks[h], mx = fmaxf(lv, sv);
    const float l2 = mx + logf(expf(lv - mx) + expf(sv - mx)), f = expf(lv - l2);
    bf* o = out + gw * p.D;
    for (int w = lane; 2 * w < p.D; w += 32) {
      const u32 a = *reinterpret_cast<const u32*>(o + 2 * w);
      *reinterpret_cast<u32*>(o + 2 * w) = pack_bf2(bf_lo(a) * f, bf_hi(a) * f);
    }
    __syncwarp();
    if (lane == 0) *l = l2;
  }
}

/// dq for one 32-query tile of one (sequence, head): dq_i = scale sum_j P_ij (dP_ij - delta_i) k_j,
/// with P recomputed from lse and dP_ij = dout_i . v_j.
template <int kPairs>
__global__ void __launch_bounds__(kQWarps * 32)
    attention_dq_kernel(const bf* __restrict__ q, const bf* __restrict__ k, const bf* __restrict__ v,
                        const bf* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                        bf* __restrict__ dq, const AttnParams p) {
  extern __shared__ float4 smem[];
  float* Ds = reinterpret_cast<float*>(smem);  // [kQWarps][kQRows][32] dS
  float* Qs = Ds + kQWarps * kQRows * 32;      // [kTile][Dp], pre-scaled by scale*log2(e)
  float* Gs = Qs + kTile * p.Dp;               // [kTile][Dp] dout
  u32* Ks = reinterpret_cast<u32*>(Gs + kTile * p.Dp);
  u32* Vs = Ks + kTile * p.ks;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int qt = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, kh = h / p.G;
  const i64 base = static_cast<i64>(blockIdx.z) * p.S;
  const i64 stat = (static_cast<i64>(blockIdx.z) * p.H + h) * p.S;  // lse / delta row
  const int q0 = qt * kTile + warp * kQRows;
  const int dp4 = p.Dp / 4;
  load_float_tile(Qs, q, base, qt * kTile, h, p.H, p, p.scale_log2);
  load_float_tile(Gs, dout, base, qt * kTile, h, p.H, p, 1.0f);

  float lse2[kQRows], dl[kQRows], acc[kQRows][2 * kPairs];
  int k_first[kQRows];
#pragma unroll
  for (int r = 0; r < kQRows; ++r) {
    const bool ok = q0 + r < p.S;
    lse2[r] = ok ? lse[stat + q0 + r] * kLog2e : 0.0f;
    dl[r] = ok ? delta[stat + q0 + r] : 0.0f;
    k_first[r] = ok ? first_key(p, base, q0 + r) : 0;
#pragma unroll
    for (int e = 0; e < 2 * kPairs; ++e) acc[r][e] = 0.0f;
  }
  const float4* Qw = reinterpret_cast<const float4*>(Qs) + warp * kQRows * dp4;
  const float4* Gw = reinterpret_cast<const float4*>(Gs) + warp * kQRows * dp4;
  float* Dw = Ds + warp * kQRows * 32;

  for (int kt = first_key(p, base, qt * kTile) / kTile; kt <= qt; ++kt) {
    load_pair_tile(Ks, k, base, kt * kTile, kh, p.Hkv, p);
    load_pair_tile(Vs, v, base, kt * kTile, kh, p.Hkv, p);
    __syncthreads();
    float s[kQRows] = {}, dp[kQRows] = {};
    const u32* kr = Ks + lane * p.ks;
    const u32* vr = Vs + lane * p.ks;
    for (int c = 0; c < dp4; ++c) {
      const u32 k01 = kr[2 * c], k23 = kr[2 * c + 1], v01 = vr[2 * c], v23 = vr[2 * c + 1];
#pragma unroll
      for (int r = 0; r < kQRows; ++r) {
        s[r] = dot4(Qw[r * dp4 + c], k01, k23, s[r]);
        dp[r] = dot4(Gw[r * dp4 + c], v01, v23, dp[r]);
      }
    }
    const int key = kt * kTile + lane;
#pragma unroll
    for (int r = 0; r < kQRows; ++r) {
      const float pr = (key <= q0 + r && key < p.S && key >= k_first[r]) ? exp2f(s[r] - lse2[r]) : 0.0f;
      Dw[r * 32 + lane] = pr * (dp[r] - dl[r]);
    }
    __syncwarp();
#pragma unroll 2
    for (int j = 0; j < kTile; j += 4) {
      float4 ds[kQRows];
#pragma unroll
      for (int r = 0; r < kQRows; ++r) ds[r] = reinterpret_cast<const float4*>(Dw + r * 32)[j / 4];
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const u32* krow = Ks + (j + jj) * p.ks;
#pragma unroll
        for (int i = 0; i < kPairs; ++i) {
          const u32 kw = krow[min(lane + 32 * i, p.Dw - 1)];
          const float k0 = bf_lo(kw), k1 = bf_hi(kw);
#pragma unroll
          for (int r = 0; r < kQRows; ++r) {
            const float dj = get(ds[r], jj);
            acc[r][2 * i] = fmaf(dj, k0, acc[r][2 * i]);
            acc[r][2 * i + 1] = fmaf(dj, k1, acc[r][2 * i + 1]);
          }
        }
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int r = 0; r < kQRows; ++r) {
    const int qi = q0 + r;
    if (qi >= p.S) continue;
    bf* row = dq + ((base + qi) * p.H + h) * p.D;
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
      const int w = lane + 32 * i;
      if (2 * w < p.D) *reinterpret_cast<u32*>(row + 2 * w) = pack_bf2(acc[r][2 * i] * p.scale, acc[r][2 * i + 1] * p.scale);
    }
  }
}

/// dk, dv for one 32-key tile of one (sequence, kv head): loops over the group's query heads in
/// order and over the query tiles at or after the key tile; lanes take one query each for the
/// scores, then split the head dimension for dv += P^T dout and dk += dS^T q.
template <int kPairs>
__global__ void __launch_bounds__(kKvWarps * 32)
    attention_dkdv_kernel(const bf* __restrict__ q, const bf* __restrict__ k, const bf* __restrict__ v,
                          const bf* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                          bf* __restrict__ dk, bf* __restrict__ dv, const AttnParams p) {
  extern __shared__ float4 smem[];
  float* Ps = reinterpret_cast<float*>(smem);   // [kKvWarps][kKvRows][32] P
  float* Ds = Ps + kKvWarps * kKvRows * 32;     // [kKvWarps][kKvRows][32] dS
  float* Kf = Ds + kKvWarps * kKvRows * 32;     // [kTile][Dp], pre-scaled by scale*log2(e)
  float* Vf = Kf + kTile * p.Dp;                // [kTile][Dp]
  u32* Qs = reinterpret_cast<u32*>(Vf + kTile * p.Dp);  // [kTile][ks]
  u32* Gs = Qs + kTile * p.ks;                           // [kTile][ks] dout

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kt = blockIdx.x, kh = blockIdx.y;
  const i64 base = static_cast<i64>(blockIdx.z) * p.S;
  const int k0 = kt * kTile + warp * kKvRows;  // this warp's first key
  const int dp4 = p.Dp / 4;
  const int tiles = (p.S + kTile - 1) / kTile;
  load_float_tile(Kf, k, base, kt * kTile, kh, p.Hkv, p, p.scale_log2);
  load_float_tile(Vf, v, base, kt * kTile, kh, p.Hkv, p, 1.0f);

  float ak[kKvRows][2 * kPairs], av[kKvRows][2 * kPairs];
#pragma unroll
  for (int r = 0; r < kKvRows; ++r)
#pragma unroll
    for (int e = 0; e < 2 * kPairs; ++e) ak[r][e] = av[r][e] = 0.0f;
  const float4* Kw = reinterpret_cast<const float4*>(Kf) + warp * kKvRows * dp4;
  const float4* Vw = reinterpret_cast<const float4*>(Vf) + warp * kKvRows * dp4;
  float* Pw = Ps + warp * kKvRows * 32;
  float* Dw = Ds + warp * kKvRows * 32;

  for (int hh = 0; hh < p.G; ++hh) {
    const int h = kh * p.G + hh;
    const i64 stat = (static_cast<i64>(blockIdx.z) * p.H + h) * p.S;
    for (int qt = kt; qt < tiles; ++qt) {
      if (first_key(p, base, qt * kTile) >= (kt + 1) * kTile) break;  // packed: later queries see none of these keys
      load_pair_tile(Qs, q, base, qt * kTile, h, p.H, p);
      load_pair_tile(Gs, dout, base, qt * kTile, h, p.H, p);
      const int qi = qt * kTile + lane;
      const bool qok = qi < p.S;
      const float lse2 = qok ? lse[stat + qi] * kLog2e : 0.0f;
      const float dl = qok ? delta[stat + qi] : 0.0f;
      const int qk_first = qok ? first_key(p, base, qi) : 0;
      __syncthreads();
      float s[kKvRows] = {}, dp[kKvRows] = {};
      const u32* qr = Qs + lane * p.ks;
      const u32* gr = Gs + lane * p.ks;
      for (int c = 0; c < dp4; ++c) {
        const u32 q01 = qr[2 * c], q23 = qr[2 * c + 1], g01 = gr[2 * c], g23 = gr[2 * c + 1];
#pragma unroll
        for (int r = 0; r < kKvRows; ++r) {
          s[r] = dot4(Kw[r * dp4 + c], q01, q23, s[r]);
          dp[r] = dot4(Vw[r * dp4 + c], g01, g23, dp[r]);
        }
      }
#pragma unroll
      for (int r = 0; r < kKvRows; ++r) {
        const float pr = (qok && qi >= k0 + r && k0 + r >= qk_first) ? exp2f(s[r] - lse2) : 0.0f;
        Pw[r * 32 + lane] = pr;
        Dw[r * 32 + lane] = pr * (dp[r] - dl);
      }
      __syncwarp();
#pragma unroll 2
      for (int j = 0; j < kTile; j += 4) {
        float4 pj[kKvRows], dj[kKvRows];
#pragma unroll
        for (int r = 0; r < kKvRows; ++r) {
          pj[r] = reinterpret_cast<const float4*>(Pw + r * 32)[j / 4];
          dj[r] = reinterpret_cast<const float4*>(Dw + r * 32)[j / 4];
        }
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          const u32* qrow = Qs + (j + jj) * p.ks;
          const u32* grow = Gs + (j + jj) * p.ks;
#pragma unroll
          for (int i = 0; i < kPairs; ++i) {
            const int w = min(lane + 32 * i, p.Dw - 1);
            const u32 qw = qrow[w], gw = grow[w];
            const float q0v = bf_lo(qw), q1v = bf_hi(qw), g0v = bf_lo(gw), g1v = bf_hi(gw);
#pragma unroll
            for (int r = 0; r < kKvRows; ++r) {
              const float pv = get(pj[r], jj), dsv = get(dj[r], jj);
              av[r][2 * i] = fmaf(pv, g0v, av[r][2 * i]);
              av[r][2 * i + 1] = fmaf(pv, g1v, av[r][2 * i + 1]);
              ak[r][2 * i] = fmaf(dsv, q0v, ak[r][2 * i]);
              ak[r][2 * i + 1] = fmaf(dsv, q1v, ak[r][2 * i + 1]);
            }
          }
        }
      }
      __syncthreads();
    }
  }

#pragma unroll
  for (int r = 0; r < kKvRows; ++r) {
    const int key = k0 + r;
    if (key >= p.S) continue;
    const i64 off = ((base + key) * p.Hkv + kh) * p.D;
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
      const int w = lane + 32 * i;
      if (2 * w >= p.D) continue;
      *reinterpret_cast<u32*>(dk + off + 2 * w) = pack_bf2(ak[r][2 * i] * p.scale, ak[r][2 * i + 1] * p.scale);
      *reinterpret_cast<u32*>(dv + off + 2 * w) = pack_bf2(av[r][2 * i], av[r][2 * i + 1]);
    }
  }
}

AttnParams attention_params(const AttentionDims& d, const char* what) {
  MT_CHECK(d.rows > 0 && d.seq > 0 && d.heads > 0 && d.kv_heads > 0 && d.heads % d.kv_heads == 0,
           "{}: invalid shape: {} rows x {} tokens, {} heads, {} kv heads", what, d.rows, d.seq, d.heads, d.kv_heads);
  MT_CHECK(d.head_dim > 0 && d.head_dim % 2 == 0 && d.head_dim <= 256, "{}: head_dim {} must be even and at most 256", what,
           d.head_dim);
  MT_CHECK(d.heads <= 65535 && d.rows <= 65535 && d.seq <= (INT_MAX / 2), "{}: {} rows x {} tokens x {} heads is too large",
           what, d.rows, d.seq, d.heads);
  AttnParams p{};
  p.S = static_cast<int>(d.seq);
  p.H = static_cast<int>(d.heads);
  p.Hkv = static_cast<int>(d.kv_heads);
  p.G = p.H / p.Hkv;
  p.D = static_cast<int>(d.head_dim);
  p.Dp = (p.D + 3) / 4 * 4;
  p.Dw = p.Dp / 2;
  p.ks = p.Dw + 1;
  MT_CHECK(d.window >= 0 && d.window <= INT_MAX && d.scale >= 0, "{}: invalid window {} or scale {}", what, d.window, d.scale);
  p.window = static_cast<int>(d.window);
  const double scale = d.scale > 0 ? d.scale : 1.0 / std::sqrt(static_cast<double>(d.head_dim));
  p.scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  return p;
}

/// Calls f(std::integral_constant<int, kPairs>) for kPairs = ceil(Dw / 32) in 1..4.
template <class F>
void dispatch_pairs(const AttnParams& p, F&& f) {
  switch ((p.Dw + 31) / 32) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    default: MT_FAIL("head_dim {} is not supported", p.D);
  }
}

/// Raises a kernel's dynamic shared-memory limit when it needs more than the default 48 KiB.
template <class Kernel>
void allow_smem(Kernel kernel, std::size_t bytes) {
  if (bytes <= 48 * 1024) return;
  MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

void check_aligned4(const void* ptr, const char* name, const char* what) {
  MT_CHECK(ptr != nullptr && aligned4(ptr), "{}: {} must be a non-null, 4-byte aligned device pointer", what, name);
}

}  // namespace

// ---- AdamW -------------------------------------------------------------------------------------
// The update of optim/adamw.hpp, each operation written as its IEEE-rounded intrinsic so that
// the compiler contracts nothing into a fused multiply-add the CPU path does not have: the
// result is bit for bit the CPU's (tests/cuda/test_kernels.cpp checks it).
namespace {

__device__ __forceinline__ float adamw_one(const AdamWArgs& s, float& p, float& m, float& v, float g) {
  const float gi = __fmul_rn(g, s.grad_scale);
  const float pi = __fmul_rn(p, s.decay);
  const float mi = __fmaf_rn(s.one_minus_b1, __fsub_rn(gi, m), m);
  const float vi = __fmaf_rn(s.one_minus_b2, __fmul_rn(gi, gi), __fmul_rn(v, s.beta2));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), s.bc2_sqrt), s.eps);
  p = __fmaf_rn(-s.step_size, __fdiv_rn(mi, denom), pi);
  m = mi;
  v = vi;
  return p;
}

struct AdamWOp {
  AdamWArgs s;
  float* p;
  float* m;
  float* v;
  const float* g;
  bf* w;  // (null: no bf16 copy, the caller makes it from p where needed)
  __device__ void one(i64 i) const {
    const float pi = adamw_one(s, p[i], m[i], v[i], g[i]);
    if (w != nullptr) stf(w + i, pi);
  }
  __device__ void vec8(i64 i) const {
    float out[8];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float4 pp = *reinterpret_cast<const float4*>(p + i + 4 * h), mm = *reinterpret_cast<const float4*>(m + i + 4 * h);
      float4 vv = *reinterpret_cast<const float4*>(v + i + 4 * h);
      const float4 gg = *reinterpret_cast<const float4*>(g + i + 4 * h);
      out[4 * h + 0] = adamw_one(s, pp.x, mm.x, vv.x, gg.x);
      out[4 * h + 1] = adamw_one(s, pp.y, mm.y, vv.y, gg.y);
      out[4 * h + 2] = adamw_one(s, pp.z, mm.z, vv.z, gg.z);
      out[4 * h + 3] = adamw_one(s, pp.w, mm.w, vv.w, gg.w);
      *reinterpret_cast<float4*>(p + i + 4 * h) = pp;
      *reinterpret_cast<float4*>(m + i + 4 * h) = mm;
      *reinterpret_cast<float4*>(v + i + 4 * h) = vv;
    }
    if (w != nullptr) st16(w + i, pack8(out));
  }
};

}  // namespace

// ================================================================================================
// launchers
// ================================================================================================

void launch_add(const bf16* x, bf16* y, std::int64_t n, cudaStream_t stream) {
  MT_NVTX_RANGE("launch_add");
  launch_map("add_kernel", AddOp{dev(x), dev(y)}, n, aligned16(x) && aligned16(y), stream);
}

void launch_add(const bf16* x, float* y, std::int64_t n, cudaStream_t stream) {
  MT_NVTX_RANGE("launch_add residual");
  launch_map("add_to_residual_kernel", AddToResidualOp{dev(x), y}, n, aligned16(x) && aligned16(y), stream);
}

void launch_add_bias(const bf16* bias, float* y, std::int64_t M, std::int64_t N, cudaStream_t stream) {
  MT_NVTX_RANGE("launch_add_bias");
  MT_CHECK(M >= 0 && N > 0, "add_bias: invalid sizes M {}, N {}", M, N);
  launch_map("add_bias_kernel", AddBiasOp{dev(bias), y, N}, M * N, N % 8 == 0 && aligned16(bias) && aligned16(y), stream);
}

void launch_cast(const float* in, bf16* out, std::int64_t n, cudaStream_t stream) {
  MT_NVTX_RANGE("launch_cast f32->bf16");
  launch_map("cast_to_bf16_kernel", CastToBf16Op{in, dev(out)}, n, aligned16(in) && aligned16(out), stream);
}

void launch_cast(const bf16* in, float* out, std::int64_t n, cudaStream_t stream) {
  MT_NVTX_RANGE("launch_cast bf16->f32");
  launch_map("cast_to_f32_kernel", CastToF32Op{dev(in), out}, n, aligned16(in) && aligned16(out), stream);
}

void launch_swiglu_forward(const bf16* g, const bf16* u, bf16* m, std::int64_t n, cudaStream_t stream, int act) {
  MT_NVTX_RANGE("launch_swiglu_forward");
  MT_CHECK(act >= 0 && act <= 2, "swiglu_forward: unknown activation {}", act);
  const bool vec = aligned16(g) && aligned16(u) && aligned16(m);
  if (act == 1) launch_map("geglu_forward_kernel", GatedForwardOp<1>{dev(g), dev(u), dev(m)}, n, vec, stream);
  else if (act == 2) launch_map("clamped_swiglu_forward_kernel", GatedForwardOp<2>{dev(g), dev(u), dev(m)}, n, vec, stream);
  else launch_map("swiglu_forward_kernel", GatedForwardOp<0>{dev(g), dev(u), dev(m)}, n, vec, stream);
}

void launch_swiglu_backward(const bf16* g, const bf16* u, const bf16* dm, bf16* dg, bf16* du, std::int64_t n,
                            cudaStream_t stream, int act, bf16* m) {
  MT_NVTX_RANGE("launch_swiglu_backward");
  MT_CHECK(act >= 0 && act <= 2, "swiglu_backward: unknown activation {}", act);
  const bool vec = aligned16(g) && aligned16(u) && aligned16(dm) && aligned16(dg) && aligned16(du) && aligned16(m);
  const auto op = [&](auto act_t, auto with_m_t) {
    return GatedBackwardOp<decltype(act_t)::value, decltype(with_m_t)::value>{dev(g),  dev(u),  dev(dm),
                                                                              dev(dg), dev(du), dev(m)};
  };
  using yes = std::true_type;
  using no = std::false_type;
  using silu = std::integral_constant<int, 0>;
  using gelu = std::integral_constant<int, 1>;
  using clamped = std::integral_constant<int, 2>;
  if (m == nullptr) {
    if (act == 1) launch_map("geglu_backward_kernel", op(gelu{}, no{}), n, vec, stream);
    else if (act == 2) launch_map("clamped_swiglu_backward_kernel", op(clamped{}, no{}), n, vec, stream);
    else launch_map("swiglu_backward_kernel", op(silu{}, no{}), n, vec, stream);
  } else {
    if (act == 1) launch_map("geglu_backward_kernel (with m)", op(gelu{}, yes{}), n, vec, stream);
    else if (act == 2) launch_map("clamped_swiglu_backward_kernel (with m)", op(clamped{}, yes{}), n, vec, stream);
    else launch_map("swiglu_backward_kernel (with m)", op(silu{}, yes{}), n, vec, stream);
  }
}

void launch_embedding_forward(const std::int32_t* ids, const bf16* table, float* out, std::int64_t M, std::int64_t d,
                              std::int64_t V, cudaStream_t stream, float scale) {
  MT_NVTX_RANGE("launch_embedding_forward");
  MT_CHECK(M >= 0 && d > 0 && V > 0, "embedding_forward: invalid sizes M {}, d {}, V {}", M, d, V);
  if (M == 0) return;
  const bool vec = d % 8 == 0 && aligned16(table) && aligned16(out);
  embedding_forward_kernel<<<static_cast<unsigned>(std::min<i64>(M, 65536)), kEmbThreads, 0, stream>>>(
      ids, dev(table), out, M, d, V, vec, scale);
  MT_CUDA_CHECK_LAUNCH("embedding_forward_kernel");
}

void launch_embedding_forward(const std::int32_t* ids, const float* table, float* out, std::int64_t M, std::int64_t d,
                              std::int64_t V, cudaStream_t stream, float scale) {
  MT_NVTX_RANGE("launch_embedding_forward");
  MT_CHECK(M >= 0 && d > 0 && V > 0, "embedding_forward: invalid sizes M {}, d {}, V {}", M, d, V);
  if (M == 0) return;
  embedding_forward_kernel<<<static_cast<unsigned>(std::min<i64>(M, 65536)), kEmbThreads, 0, stream>>>(
      ids, table, out, M, d, V, false, scale);
  MT_CUDA_CHECK_LAUNCH("embedding_forward_kernel (fp32 rows)");
}

void launch_take_rows(const std::int32_t* rows, float* table, float* out, std::int64_t U, std::int64_t d, std::int64_t V,
                      cudaStream_t stream) {
  MT_NVTX_RANGE("launch_take_rows");
  MT_CHECK(U >= 0 && d > 0 && V > 0, "take_rows: invalid sizes U {}, d {}, V {}", U, d, V);
  if (U == 0) return;
  const bool vec = d % 4 == 0 && aligned16(table) && aligned16(out);
  take_rows_kernel<<<static_cast<unsigned>(std::min<i64>(U, 65536)), kEmbThreads, 0, stream>>>(rows, table, out, U, d, V, vec);
  MT_CUDA_CHECK_LAUNCH("take_rows_kernel");
}

std::size_t embedding_backward_workspace_bytes(std::int64_t M) {
  MT_CHECK(M >= 0 && M <= INT_MAX, "embedding_backward: {} tokens is out of range", M);
  if (M == 0) return 0;
  const std::size_t arr = align_up(static_cast<std::size_t>(M) * 4);
  // The sort's scratch is largest for full 32-bit keys; the launch sorts only log2(V) bits.
  return kWorkspaceAlign + 4 * arr + align_up(radix_sort_temp_bytes(M, 32));
}

void launch_embedding_backward(const std::int32_t* ids, const float* dy, float* dtable, std::int64_t M, std::int64_t d,
                               std::int64_t V, void* workspace, std::size_t workspace_bytes, cudaStream_t stream,
                               std::int32_t skip_id, float scale) {
  MT_NVTX_RANGE("launch_embedding_backward");
  MT_CHECK(M >= 0 && M <= INT_MAX && d > 0 && V > 0 && V <= INT_MAX, "embedding_backward: invalid sizes M {}, d {}, V {}",
           M, d, V);
  if (M == 0) return;
  check_workspace(workspace, workspace_bytes, embedding_backward_workspace_bytes(M), "embedding_backward");
  Carver carve(workspace, workspace_bytes);
  u32* keys0 = carve.take<u32>(static_cast<std::size_t>(M));
  u32* keys1 = carve.take<u32>(static_cast<std::size_t>(M));
  auto* pos0 = carve.take<std::int32_t>(static_cast<std::size_t>(M));
  auto* pos1 = carve.take<std::int32_t>(static_cast<std::size_t>(M));

  embedding_sort_init_kernel<<<grid_for(M, 256), 256, 0, stream>>>(ids, keys0, pos0, M, V);
  MT_CUDA_CHECK_LAUNCH("embedding_sort_init_kernel");

  int end_bit = 1;
  while (end_bit < 32 && (static_cast<i64>(1) << end_bit) < V) ++end_bit;
  const std::size_t temp = radix_sort_temp_bytes(M, end_bit);
  MT_CHECK(temp <= carve.left(), "embedding_backward: sort needs {} bytes of workspace, {} left", temp, carve.left());
  cub::DoubleBuffer<u32> keys(keys0, keys1);  // the sort ping-pongs; Current() is the result
  cub::DoubleBuffer<std::int32_t> pos(pos0, pos1);
  // Stable: equal ids keep their positions in ascending order, which fixes the summation order.
  std::size_t temp_bytes = carve.left();
  MT_CUDA_CHECK(
      cub::DeviceRadixSort::SortPairs(carve.here(), temp_bytes, keys, pos, static_cast<int>(M), 0, end_bit, stream));

  const bool vec = d % 8 == 0 && aligned16(dy) && aligned16(dtable);
  const i64 per_block = kEmbThreads * (vec ? 8 : 1);
  const i64 col_blocks = (d + per_block - 1) / per_block;
  MT_CHECK(col_blocks <= 65535, "embedding_backward: row length {} is too large", d);
  const dim3 grid(static_cast<unsigned>(std::min<i64>(M, 65536)), static_cast<unsigned>(col_blocks));
  if (vec) embedding_accumulate_kernel<8><<<grid, kEmbThreads, 0, stream>>>(keys.Current(), pos.Current(), dy, dtable, M, d, skip_id, scale);
  else embedding_accumulate_kernel<1><<<grid, kEmbThreads, 0, stream>>>(keys.Current(), pos.Current(), dy, dtable, M, d, skip_id, scale);
  MT_CUDA_CHECK_LAUNCH("embedding_accumulate_kernel");
}

/// Both RMSNorm forwards: x the fp32 residual stream or bf16 activation rows (q/k norms).
template <class X>
void rmsnorm_forward(const char* name, const X* x, const float* w, bf16* y, float* rstd, std::int64_t M, std::int64_t d,
                     float eps, cudaStream_t stream, float offset) {
  MT_CHECK(M >= 0 && d > 0 && d <= INT_MAX / 8, "{}: invalid sizes M {}, d {}", name, M, d);
  if (M == 0) return;
  const bool vec = d % 8 == 0 && aligned16(x) && aligned16(w) && aligned16(y);
  dispatch_row_group(vec ? d / 8 : d, [&](auto group, auto block) {
    constexpr int kGroup = decltype(group)::value, kBlock = decltype(block)::value, kRows = kBlock / kGroup;
    rmsnorm_forward_kernel<kGroup, kBlock, X><<<static_cast<unsigned>((M + kRows - 1) / kRows), kBlock, 0, stream>>>(
        x, w, dev(y), rstd, M, static_cast<int>(d), eps, vec, offset);
  });
  MT_CUDA_CHECK_LAUNCH(name);
}

void launch_rmsnorm_forward(const float* x, const float* w, bf16* y, float* rstd, std::int64_t M, std::int64_t d, float eps,
                            cudaStream_t stream, float offset) {
  MT_NVTX_RANGE("launch_rmsnorm_forward");
  rmsnorm_forward("rmsnorm_forward", x, w, y, rstd, M, d, eps, stream, offset);
}

std::size_t rmsnorm_backward_workspace_bytes(std::int64_t M, std::int64_t d) {
  MT_CHECK(M >= 0 && d > 0, "rmsnorm_backward: invalid sizes M {}, d {}", M, d);
  return column_reduce_bytes(M, d);
}

void launch_rmsnorm_backward(const float* x, const float* w, const float* rstd, const bf16* dy, const float* residual,
                             float* dx, bf16* dx_act, float* dw, std::int64_t M, std::int64_t d, void* workspace,
                             std::size_t workspace_bytes, cudaStream_t stream, float offset) {
  MT_NVTX_RANGE("launch_rmsnorm_backward");
  MT_CHECK(M >= 0 && d > 0 && d <= INT_MAX / 8, "rmsnorm_backward: invalid sizes M {}, d {}", M, d);
  if (M == 0) return;
  check_workspace(workspace, workspace_bytes, rmsnorm_backward_workspace_bytes(M, d), "rmsnorm_backward");
  const bool vec = d % 8 == 0 && aligned16(x) && aligned16(w) && aligned16(dy) && aligned16(dx) &&
                   (residual == nullptr || aligned16(residual)) && (dx_act == nullptr || aligned16(dx_act));
  dispatch_row_group(vec ? d / 8 : d, [&](auto group, auto block) {
    constexpr int kGroup = decltype(group)::value, kBlock = decltype(block)::value, kRows = kBlock / kGroup;
    rmsnorm_backward_dx_kernel<kGroup, kBlock, float, float><<<static_cast<unsigned>((M + kRows - 1) / kRows), kBlock, 0, stream>>>(
        x, w, rstd, dev(dy), residual, dx, dx_act ? dev(dx_act) : nullptr, M, static_cast<int>(d), vec, offset);
  });
  MT_CUDA_CHECK_LAUNCH("rmsnorm_backward_dx_kernel");
  column_reduce("rmsnorm_dw_kernel", RmsNormDw<float>{dev(dy), x, rstd, d}, M, d, aligned16(dy) && aligned16(x), dw, workspace,
                workspace_bytes, stream);
}

void launch_head_rmsnorm_forward(const bf16* x, const float* w, bf16* y, float* rstd, std::int64_t M, std::int64_t d,
                                 float eps, cudaStream_t stream, float offset) {
  MT_NVTX_RANGE("launch_head_rmsnorm_forward");
  rmsnorm_forward("head_rmsnorm_forward", dev(x), w, y, rstd, M, d, eps, stream, offset);
}

void launch_head_rmsnorm_backward(const bf16* x, const float* w, const float* rstd, const bf16* dy, bf16* dx, float* dw,
                                  std::int64_t M, std::int64_t d, void* workspace, std::size_t workspace_bytes,
                                  cudaStream_t stream, float offset) {
  MT_NVTX_RANGE("launch_head_rmsnorm_backward");
  MT_CHECK(M >= 0 && d > 0 && d <= INT_MAX / 8, "head_rmsnorm_backward: invalid sizes M {}, d {}", M, d);
  if (M == 0) return;
  check_workspace(workspace, workspace_bytes, rmsnorm_backward_workspace_bytes(M, d), "head_rmsnorm_backward");
  const bool vec = d % 8 == 0 && aligned16(x) && aligned16(w) && aligned16(dy) && aligned16(dx);
  dispatch_row_group(vec ? d / 8 : d, [&](auto group, auto block) {
    constexpr int kGroup = decltype(group)::value, kBlock = decltype(block)::value, kRows = kBlock / kGroup;
    rmsnorm_backward_dx_kernel<kGroup, kBlock, bf, bf><<<static_cast<unsigned>((M + kRows - 1) / kRows), kBlock, 0, stream>>>(
        dev(x), w, rstd, dev(dy), nullptr, dev(dx), nullptr, M, static_cast<int>(d), vec, offset);
  });
  MT_CUDA_CHECK_LAUNCH("rmsnorm_backward_dx_kernel (head)");
  column_reduce("head_rmsnorm_dw_kernel", RmsNormDw<bf>{dev(dy), dev(x), rstd, d}, M, d, aligned16(dy) && aligned16(x), dw,
                workspace, workspace_bytes, stream);
}

void launch_rope(bf16* x, const std::int32_t* positions, std::int64_t M, std::int64_t heads, std::int64_t head_dim,
                 std::int64_t seq, const RopeFreqs& freqs, bool inverse, cudaStream_t stream) {
  MT_NVTX_RANGE("launch_rope");
  MT_CHECK(M >= 0 && heads > 0 && head_dim > 0 && head_dim % 2 == 0 && seq > 0 && M % seq == 0,
           "rope: {} tokens, {} heads of {}, sequences of {} do not fit", M, heads, head_dim, seq);
  // (fewer frequencies than head_dim / 2: partial rotary, the rest of each head untouched)
  MT_CHECK(freqs.half > 0 && 2 * freqs.half <= head_dim && freqs.half <= RopeFreqs::kMax && heads * head_dim <= INT_MAX,
           "rope: {} frequencies for head_dim {} (at most {} supported)", freqs.half, head_dim, 2 * RopeFreqs::kMax);
  if (M == 0) return;
  const bool vec = freqs.half % 8 == 0 && head_dim % 8 == 0 && aligned16(x);
  rope_kernel<<<static_cast<unsigned>(std::min<i64>(M, 65536)), kRopeThreads, 0, stream>>>(
      dev(x), positions, M, static_cast<int>(heads), static_cast<int>(head_dim), seq, freqs, inverse, vec);
  MT_CUDA_CHECK_LAUNCH("rope_kernel");
}

std::size_t column_sum_workspace_bytes(std::int64_t M, std::int64_t N) {
  MT_CHECK(M >= 0 && N >= 0, "column_sum: invalid sizes M {}, N {}", M, N);
  return column_reduce_bytes(M, N);
}

void launch_column_sum(const bf16* x, float* out, std::int64_t M, std::int64_t N, void* workspace, std::size_t workspace_bytes,
                       cudaStream_t stream) {
  MT_NVTX_RANGE("launch_column_sum");
  MT_CHECK(M >= 0 && N >= 0, "column_sum: invalid sizes M {}, N {}", M, N);
  if (M == 0 || N == 0) return;
  check_workspace(workspace, workspace_bytes, column_sum_workspace_bytes(M, N), "column_sum");
  column_reduce("column_sum_kernel", ColumnOfBf16{dev(x), N}, M, N, aligned16(x), out, workspace, workspace_bytes, stream);
}

std::size_t sum_squares_workspace_bytes(std::int64_t n) {
  MT_CHECK(n >= 0, "sum_squares: negative count {}", n);
  return kWorkspaceAlign + align_up(static_cast<std::size_t>(sum_squares_blocks(n)) * sizeof(double));
}

void launch_sum_squares(const float* x, std::int64_t n, double* out, void* workspace, std::size_t workspace_bytes,
                        cudaStream_t stream) {
  MT_NVTX_RANGE("launch_sum_squares");
  MT_CHECK(n >= 0 && out != nullptr, "sum_squares: invalid arguments (n {}, out {})", n, static_cast<void*>(out));
  check_workspace(workspace, workspace_bytes, sum_squares_workspace_bytes(n), "sum_squares");
  const i64 blocks = sum_squares_blocks(n);
  Carver carve(workspace, workspace_bytes);
  double* partial = carve.take<double>(static_cast<std::size_t>(blocks));
  if (n > 0) {
    sum_squares_partial_kernel<<<static_cast<unsigned>(blocks), kSsThreads, 0, stream>>>(x, n, partial, aligned16(x));
    MT_CUDA_CHECK_LAUNCH("sum_squares_partial_kernel");
  }
  sum_squares_final_kernel<<<1, kSsThreads, 0, stream>>>(partial, n > 0 ? static_cast<int>(blocks) : 0, out);
  MT_CUDA_CHECK_LAUNCH("sum_squares_final_kernel");
}

__global__ void spin_kernel(unsigned long long ns) {
  unsigned long long start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

void launch_spin(std::int64_t nanoseconds, cudaStream_t stream) {
  if (nanoseconds <= 0) return;
  spin_kernel<<<1, 1, 0, stream>>>(static_cast<unsigned long long>(nanoseconds));
  MT_CUDA_CHECK_LAUNCH("spin_kernel");
}

void launch_cross_entropy(const float* logits, const std::int32_t* labels, float* loss, bf16* dlogits, float scale,
                          const float* weights, std::int64_t n, std::int64_t V, cudaStream_t stream) {
  MT_NVTX_RANGE("launch_cross_entropy");
  MT_CHECK(n >= 0 && n <= INT_MAX && V > 0, "cross_entropy: invalid sizes n {}, V {}", n, V);
  MT_CHECK(n == 0 || (logits != nullptr && labels != nullptr && loss != nullptr), "cross_entropy: null logits, labels or loss");
  if (n == 0) return;
  const bool vec_in = V % 4 == 0 && aligned16(logits);
  const bool vec_out = vec_in && (dlogits == nullptr || reinterpret_cast<std::uintptr_t>(dlogits) % 8 == 0);
  const int threads = V >= 16384 ? kCeMaxThreads : V >= 2048 ? 256 : 128;
  cross_entropy_kernel<<<static_cast<unsigned>(n), threads, 0, stream>>>(logits, labels, loss, dev(dlogits), scale, weights, V,
                                                                        vec_in, vec_out);
  MT_CUDA_CHECK_LAUNCH("cross_entropy_kernel");
}

__global__ void packed_offsets_kernel(const std::int32_t* __restrict__ starts, i64 count, i64 padded, i64 qo_mul, i64 kv_mul,
                                      i64 st_mul, i64* __restrict__ qo, i64* __restrict__ kv, i64* __restrict__ st,
                                      std::int32_t* __restrict__ len) {
  for (i64 i = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; i <= padded; i += static_cast<i64>(gridDim.x) * blockDim.x) {
    const i64 at = static_cast<i64>(starts[min(i, count)]) - starts[0];
    qo[i] = qo_mul * at;
    kv[i] = kv_mul * at;
    st[i] = st_mul * at;
    if (i < padded) len[i] = i < count ? starts[i + 1] - starts[i] : 0;
  }
}

void launch_packed_offsets(const std::int32_t* starts, std::int64_t count, std::int64_t padded, std::int64_t qo_mul,
                           std::int64_t kv_mul, std::int64_t st_mul, std::int64_t* qo, std::int64_t* kv, std::int64_t* st,
                           std::int32_t* len, cudaStream_t stream) {
  MT_CHECK(starts && qo && kv && st && len && count > 0 && padded >= count, "packed_offsets: bad arguments ({} of {})", count,
           padded);
  packed_offsets_kernel<<<grid_for(padded + 1, 256, 1024), 256, 0, stream>>>(starts, count, padded, qo_mul, kv_mul, st_mul,
                                                                             qo, kv, st, len);
  MT_CUDA_CHECK_LAUNCH("packed_offsets_kernel");
}

void launch_attention_forward(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, const AttentionDims& dims,
                              cudaStream_t stream, const std::int32_t* positions, const float* sinks) {
  MT_NVTX_RANGE("launch_attention_forward");
  AttnParams p = attention_params(dims, "attention_forward");
  p.pos = positions;
  p.sinks = sinks;
  check_aligned4(q, "q", "attention_forward");
  check_aligned4(k, "k", "attention_forward");
  check_aligned4(v, "v", "attention_forward");
  check_aligned4(out, "out", "attention_forward");
  MT_CHECK(lse != nullptr, "attention_forward: lse is null");
  const std::size_t smem = sizeof(float) * (kQWarps * kQRows * 32 + kTile * p.Dp) + sizeof(u32) * 2 * kTile * p.ks;
  const dim3 grid(static_cast<unsigned>((p.S + kTile - 1) / kTile), static_cast<unsigned>(p.H),
                  static_cast<unsigned>(dims.rows));
  dispatch_pairs(p, [&](auto pairs) {
    constexpr int kP = decltype(pairs)::value;
    allow_smem(attention_forward_kernel<kP>, smem);
    attention_forward_kernel<kP><<<grid, kQWarps * 32, smem, stream>>>(dev(q), dev(k), dev(v), dev(out), lse, p);
  });
  MT_CUDA_CHECK_LAUNCH("attention_forward_kernel");
}

std::size_t attention_backward_workspace_bytes(const AttentionDims& dims) {
  (void)attention_params(dims, "attention_backward");  // validates
  return kWorkspaceAlign + align_up(static_cast<std::size_t>(dims.rows * dims.heads * dims.seq) * sizeof(float));
}

void launch_attention_backward(const bf16* q, const bf16* k, const bf16* v, const bf16* out, const float* lse,
                               const bf16* dout, bf16* dq, bf16* dk, bf16* dv, const AttentionDims& dims, void* workspace,
                               std::size_t workspace_bytes, cudaStream_t stream, const std::int32_t* positions,
                               const float* sinks, float* dsinks) {
  MT_NVTX_RANGE("launch_attention_backward");
  AttnParams p = attention_params(dims, "attention_backward");
  p.pos = positions;
  p.sinks = sinks;
  MT_CHECK((sinks == nullptr) == (dsinks == nullptr), "attention_backward: sinks and their gradient come together");
  const std::pair<const void*, const char*> tensors[] = {{q, "q"},       {k, "k"},   {v, "v"},   {out, "out"},
                                                         {dout, "dout"}, {dq, "dq"}, {dk, "dk"}, {dv, "dv"}};
  for (const auto& [ptr, name] : tensors) check_aligned4(ptr, name, "attention_backward");
  MT_CHECK(lse != nullptr, "attention_backward: lse is null");
  check_workspace(workspace, workspace_bytes, attention_backward_workspace_bytes(dims), "attention_backward");
  Carver carve(workspace, workspace_bytes);
  const i64 tokens = dims.rows * dims.seq;
  float* delta = carve.take<float>(static_cast<std::size_t>(tokens * dims.heads));

  attention_delta_kernel<<<grid_for(tokens * p.H, 8, 65536), 256, 0, stream>>>(dev(out), dev(dout), delta, tokens, p);
  MT_CUDA_CHECK_LAUNCH("attention_delta_kernel");
  if (sinks != nullptr) {
    attention_sinks_grad_kernel<<<static_cast<unsigned>(p.H), kSsThreads, 0, stream>>>(lse, delta, dims.rows, dsinks, p);
    MT_CUDA_CHECK_LAUNCH("attention_sinks_grad_kernel");
  }

  const unsigned tiles = static_cast<unsigned>((p.S + kTile - 1) / kTile);
  const std::size_t smem_dq = sizeof(float) * (kQWarps * kQRows * 32 + 2 * kTile * p.Dp) + sizeof(u32) * 2 * kTile * p.ks;
  const std::size_t smem_kv = sizeof(float) * (2 * kKvWarps * kKvRows * 32 + 2 * kTile * p.Dp) + sizeof(u32) * 2 * kTile * p.ks;
  dispatch_pairs(p, [&](auto pairs) {
    constexpr int kP = decltype(pairs)::value;
    allow_smem(attention_dq_kernel<kP>, smem_dq);
    attention_dq_kernel<kP><<<dim3(tiles, static_cast<unsigned>(p.H), static_cast<unsigned>(dims.rows)), kQWarps * 32, smem_dq,
                              stream>>>(dev(q), dev(k), dev(v), dev(dout), lse, delta, dev(dq), p);
    MT_CUDA_CHECK_LAUNCH("attention_dq_kernel");
    allow_smem(attention_dkdv_kernel<kP>, smem_kv);
    attention_dkdv_kernel<kP><<<dim3(tiles, static_cast<unsigned>(p.Hkv), static_cast<unsigned>(dims.rows)), kKvWarps * 32,
                                smem_kv, stream>>>(dev(q), dev(k), dev(v), dev(dout), lse, delta, dev(dk), dev(dv), p);
    MT_CUDA_CHECK_LAUNCH("attention_dkdv_kernel");
  });
}

void launch_attention_add_sinks(bf16* out, float* lse, const float* sinks, const AttentionDims& dims, cudaStream_t stream) {
  MT_NVTX_RANGE("launch_attention_add_sinks");
  AttnParams p = attention_params(dims, "attention_add_sinks");
  MT_CHECK(dims.sequences == 0, "attention_add_sinks: packed rows are not supported (their lse is laid out by sequence)");
  MT_CHECK(out && lse && sinks, "attention_add_sinks: null out, lse or sinks");
  check_aligned4(out, "out", "attention_add_sinks");
  p.sinks = sinks;
  const i64 tokens = dims.rows * dims.seq;
  attention_add_sinks_kernel<<<grid_for(tokens * p.H, 8, 65536), 256, 0, stream>>>(dev(out), lse, tokens, p);
  MT_CUDA_CHECK_LAUNCH("attention_add_sinks_kernel");
}

void launch_attention_sinks_grad(const bf16* out, const bf16* dout, const float* lse, const float* sinks, float* dsinks,
                                 const AttentionDims& dims, void* workspace, std::size_t workspace_bytes,
                                 cudaStream_t stream) {
  MT_NVTX_RANGE("launch_attention_sinks_grad");
  AttnParams p = attention_params(dims, "attention_sinks_grad");
  MT_CHECK(dims.sequences == 0, "attention_sinks_grad: packed rows are not supported (their lse is laid out by sequence)");
  MT_CHECK(out && dout && lse && sinks && dsinks, "attention_sinks_grad: a null argument");
  check_aligned4(out, "out", "attention_sinks_grad");
  check_aligned4(dout, "dout", "attention_sinks_grad");
  check_workspace(workspace, workspace_bytes, attention_backward_workspace_bytes(dims), "attention_sinks_grad");
  p.sinks = sinks;
  Carver carve(workspace, workspace_bytes);
  const i64 tokens = dims.rows * dims.seq;
  float* delta = carve.take<float>(static_cast<std::size_t>(tokens * dims.heads));
  attention_delta_kernel<<<grid_for(tokens * p.H, 8, 65536), 256, 0, stream>>>(dev(out), dev(dout), delta, tokens, p);
  MT_CUDA_CHECK_LAUNCH("attention_delta_kernel");
  attention_sinks_grad_kernel<<<static_cast<unsigned>(p.H), kSsThreads, 0, stream>>>(lse, delta, dims.rows, dsinks, p);
  MT_CUDA_CHECK_LAUNCH("attention_sinks_grad_kernel");
}

void launch_adamw(const AdamWArgs& s, float* p, float* m, float* v, const float* g, bf16* w, std::int64_t n,
                  cudaStream_t stream) {
  MT_NVTX_RANGE("launch_adamw");
  launch_map("adamw_kernel", AdamWOp{s, p, m, v, g, dev(w)}, n,
             aligned16(p) && aligned16(m) && aligned16(v) && aligned16(g) && aligned16(w), stream);
}

}  // namespace megatrain::cuda
