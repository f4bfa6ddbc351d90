// Decoding with caches on the GPU (contract: backend/cuda/decode.hpp). A block a row and head:
// few tokens, so the kernels are latency-bound; fp32 arithmetic throughout.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "common.cuh"
#include "megatrain/backend/cuda/decode.hpp"
#include "megatrain/core/cuda_check.hpp"

namespace megatrain::cuda {
namespace {

using namespace common;

constexpr int kWarps = 4;          // (attention: a key a warp at a time)
constexpr int kMaxLaneDims = 8;    // (head_dim / 32 per lane: head_dim at most 256)

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float silu(float x) { return x * sigmoid(x); }
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// The rows' keys and values into the caches at their positions.
__global__ void append_kernel(const bf* k, const bf* v, bf* kc, bf* vc, const std::int32_t* pos, i64 rows, i64 first,
                              i64 capacity, i64 width) {
  for (i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; i < rows * width;
       i += static_cast<i64>(gridDim.x) * blockDim.x) {
    const i64 r = i / width, c = i % width, at = ((first + r) * capacity + pos[r]) * width + c;
    kc[at] = k[i];
    vc[at] = v[i];
  }
}

// Block (row, head): each warp keeps a running softmax over its keys (every kWarps-th), each
// lane head_dim / 32 of the output; the warps' parts are joined at the end, the sink with them.
__global__ void __launch_bounds__(32 * kWarps) attend_kernel(const bf* q, const bf* kc, const bf* vc, const std::int32_t* pos,
                                                               i64 first, i64 capacity, i64 heads, i64 kv_heads, i64 D,
                                                               float scale, i64 window, const float* sinks, bf* out) {
  const i64 r = blockIdx.x, h = blockIdx.y, kh = h / (heads / kv_heads), p = pos[r];
  const i64 lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0, width = kv_heads * D;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, L = static_cast<int>(D / 32);
  float qv[kMaxLaneDims], acc[kMaxLaneDims];
  for (int e = 0; e < L; ++e) {
    qv[e] = __bfloat162float(q[(r * heads + h) * D + lane * L + e]) * scale;
    acc[e] = 0;
  }
  float m = -INFINITY, l = 0;
  for (i64 j = lo + warp; j <= p; j += kWarps) {
    const i64 at = ((first + r) * capacity + j) * width + kh * D + lane * L;
    float s = 0;
    for (int e = 0; e < L; ++e) s += qv[e] * __bfloat162float(kc[at + e]);
    s = warp_sum(s);
    const float mn = fmaxf(m, s), old = expf(m - mn), w = expf(s - mn);
    l = l * old + w;
    for (int e = 0; e < L; ++e) acc[e] = acc[e] * old + w * __bfloat162float(vc[at + e]);
    m = mn;
  }
  __shared__ float sm[kWarps], sl[kWarps], sacc[kWarps][32 * kMaxLaneDims];
  if (lane == 0) {
    sm[warp] = m;
    sl[warp] = l;
  }
  for (int e = 0; e < L; ++e) sacc[warp][lane * L + e] = acc[e];
  __syncthreads();
  float M = sinks ? sinks[h] : -INFINITY;
  for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sm[w]);
  float total = sinks ? expf(sinks[h] - M) : 0.0f;
  for (int w = 0; w < kWarps; ++w) total += sl[w] * expf(sm[w] - M);  // (a warp without keys: l 0)
  for (i64 d = threadIdx.x; d < D; d += blockDim.x) {
    float o = 0;
    for (int w = 0; w < kWarps; ++w) o += sacc[w][d] * expf(sm[w] - M);
    out[(r * heads + h) * D + d] = __float2bfloat16(o / total);
  }
}

// DeltaNetDecodeArgs with CUDA's element type.
struct Step {
  i64 rows, first, key_heads, value_heads, dk, dv, taps;
  float norm_eps;
  const std::int32_t* positions;
  const bf *mixed, *z, *a, *b, *conv;
  const float *A_log, *dt_bias, *norm;
  bf* taps_cache;
  float* state;
  bf* y;
};

// The sum of `v` over the block (every thread gets it); `part` holds a float a warp.
__device__ float block_sum(float v, float* part) {
  v = warp_sum(v);
  __syncthreads();
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  float s = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x + 31) / 32; ++w) s += part[w];
  return s;
}

// Channel ch's convolution with SiLU for row r: its taps - 1 cached inputs (zeros at position 0)
// and the row's new one.
__device__ float conv_silu(const Step& m, i64 r, i64 ch, bool fresh) {
  const i64 cd = 2 * m.key_heads * m.dk + m.value_heads * m.dv, K = m.taps;
  const bf* tap = m.taps_cache + (m.first + r) * (K - 1) * cd;
  float acc = 0;
  if (!fresh)
    for (i64 j = 0; j + 1 < K; ++j) acc += __bfloat162float(m.conv[ch * K + j]) * __bfloat162float(tap[j * cd + ch]);
  acc += __bfloat162float(m.conv[ch * K + K - 1]) * __bfloat162float(m.mixed[r * cd + ch]);
  return silu(acc);
}

// Block (row, value head), a thread a value column: q and k of its key head normalised, the
// gates, the rule's step on its column of the state, the gated RMSNorm of the head's output.
__global__ void deltanet_step_kernel(Step m) {
  extern __shared__ float smem[];
  const i64 r = blockIdx.x, h = blockIdx.y, dk = m.dk, dv = m.dv, kd = m.key_heads * dk;
  const i64 kh = h / (m.value_heads / m.key_heads);
  const bool fresh = m.positions[r] == 0;
  float* qs = smem;          // [dk]
  float* ks = smem + dk;     // [dk]
  float* part = ks + dk;     // [warps]
  float sq = 0, sk = 0;
  for (i64 i = threadIdx.x; i < dk; i += blockDim.x) {
    qs[i] = conv_silu(m, r, kh * dk + i, fresh);
    ks[i] = conv_silu(m, r, kd + kh * dk + i, fresh);
    sq += qs[i] * qs[i];
    sk += ks[i] * ks[i];
  }
  const float nq = rsqrtf(block_sum(sq, part) + 1e-6f), nk = rsqrtf(block_sum(sk, part) + 1e-6f);
  const float g = -expf(m.A_log[h]) * softplus(__bfloat162float(m.a[r * m.value_heads + h]) + m.dt_bias[h]);
  const float beta = sigmoid(__bfloat162float(m.b[r * m.value_heads + h])), decay = expf(g);
  const float scale = rsqrtf(static_cast<float>(dk));
  const i64 j = threadIdx.x;
  float o = 0;
  if (j < dv) {
    float* S = m.state + (((m.first + r) * m.value_heads + h) * dk) * dv + j;
    const float v = conv_silu(m, r, 2 * kd + h * dv + j, fresh);
    float kv = 0;
    for (i64 i = 0; i < dk; ++i) kv += (fresh ? 0.0f : S[i * dv]) * decay * ks[i] * nk;
    const float delta = beta * (v - kv);
    for (i64 i = 0; i < dk; ++i) {
      const float s = (fresh ? 0.0f : S[i * dv]) * decay + ks[i] * nk * delta;
      S[i * dv] = s;
      o += s * qs[i] * nq;
    }
    o = __bfloat162float(__float2bfloat16(o * scale));  // (the rule's output is bf16, as the chunked forward keeps it)
  }
  const float rstd = rsqrtf(block_sum(j < dv ? o * o : 0.0f, part) / static_cast<float>(dv) + m.norm_eps);
  if (j < dv) {
    const i64 at = r * m.value_heads * dv + h * dv + j;
    m.y[at] = __float2bfloat16(m.norm[j] * o * rstd * silu(__bfloat162float(m.z[at])));
  }
}

// After the step: each row's taps move on by its new input (from zeros at position 0).
__global__ void taps_kernel(Step m) {
  const i64 cd = 2 * m.key_heads * m.dk + m.value_heads * m.dv, K = m.taps;
  for (i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; i < m.rows * cd;
       i += static_cast<i64>(gridDim.x) * blockDim.x) {
    const i64 r = i / cd, ch = i % cd;
    bf* tap = m.taps_cache + (m.first + r) * (K - 1) * cd;
    const bool fresh = m.positions[r] == 0;
    for (i64 j = 0; j + 2 < K; ++j) tap[j * cd + ch] = fresh ? __float2bfloat16(0.0f) : tap[(j + 1) * cd + ch];
    if (K > 1) tap[(K - 2) * cd + ch] = m.mixed[r * cd + ch];
  }
}

}  // namespace

void launch_attention_decode(const bf16* q, const bf16* k, const bf16* v, bf16* kcache, bf16* vcache,
                             const std::int32_t* positions, std::int64_t rows, std::int64_t first, std::int64_t capacity,
                             std::int64_t heads, std::int64_t kv_heads, std::int64_t head_dim, float scale, std::int64_t window,
                             const float* sinks, bf16* out, cudaStream_t stream) {
  if (rows == 0) return;
  MT_CHECK(head_dim % 32 == 0 && head_dim <= 32 * kMaxLaneDims && heads % kv_heads == 0,
           "attention decoding on the GPU: head_dim {} must be a multiple of 32 up to {} ({} heads, {} kv heads)", head_dim,
           32 * kMaxLaneDims, heads, kv_heads);
  const i64 width = kv_heads * head_dim;
  append_kernel<<<grid_for(rows * width, 256), 256, 0, stream>>>(dev(k), dev(v), dev(kcache), dev(vcache), positions, rows,
                                                                  first, capacity, width);
  MT_CUDA_CHECK_LAUNCH("append_kernel");
  attend_kernel<<<dim3(static_cast<unsigned>(rows), static_cast<unsigned>(heads)), 32 * kWarps, 0, stream>>>(
      dev(q), dev(kcache), dev(vcache), positions, first, capacity, heads, kv_heads, head_dim, scale, window, sinks, dev(out));
  MT_CUDA_CHECK_LAUNCH("attend_kernel");
}

void launch_deltanet_decode(const DeltaNetDecodeArgs& args, cudaStream_t stream) {
  if (args.rows == 0) return;
  const Step m{args.rows,      args.first,    args.key_heads,    args.value_heads, args.dk,      args.dv,
               args.taps,      static_cast<float>(args.norm_eps), args.positions, dev(args.mixed), dev(args.z), dev(args.a),
               dev(args.b),    dev(args.conv), args.A_log,        args.dt_bias,     args.norm,    dev(args.taps_cache),
               args.state,     dev(args.y)};
  MT_CHECK(m.key_heads > 0 && m.value_heads % m.key_heads == 0 && m.dv <= 1024 && m.taps >= 1,
           "Gated DeltaNet decoding on the GPU: {} key heads, {} value heads, dv {} (at most 1024)", m.key_heads,
           m.value_heads, m.dv);
  const unsigned threads = static_cast<unsigned>((m.dv + 31) / 32 * 32);
  const std::size_t shared = (2 * static_cast<std::size_t>(m.dk) + 32) * sizeof(float);
  deltanet_step_kernel<<<dim3(static_cast<unsigned>(m.rows), static_cast<unsigned>(m.value_heads)), threads, shared, stream>>>(m);
  MT_CUDA_CHECK_LAUNCH("deltanet_step_kernel");
  const i64 cd = 2 * m.key_heads * m.dk + m.value_heads * m.dv;
  taps_kernel<<<grid_for(m.rows * cd, 256), 256, 0, stream>>>(m);
  MT_CUDA_CHECK_LAUNCH("taps_kernel");
}

}  // namespace megatrain::cuda
