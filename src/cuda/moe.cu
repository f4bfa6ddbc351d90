// The routing and data movement of a mixture-of-experts layer on the GPU (contract:
// backend/cuda/kernels.hpp, "mixture of experts"); the experts' products are grouped GEMMs
// (gemm.cpp). The CPU backend's moe_* primitives are the reference these follow.
//
// Deterministic like the rest of megatrain's kernels: no floating-point atomics; the grouping of
// assignments by expert is a stable counting sort (per-chunk histograms with integer atomics,
// whose counts do not depend on order, a scan in chunk order, then one warp per chunk placing its
// assignments in order), so `order`, `slot` and `offsets` are the CPU's exactly; every sum has an
// order fixed by the shapes (a token's experts in increasing index, as transformers adds them).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "megatrain/backend/cuda/kernels.hpp"
#include "common.cuh"
#include "megatrain/core/cuda_check.hpp"
#include "megatrain/core/error.hpp"

namespace megatrain::cuda {
namespace {

using namespace common;

// ---- routing: softmax and top-k, one warp per token ---------------------------------------------
constexpr int kPerLane = kMoeMaxExperts / 32;

__global__ void __launch_bounds__(256) moe_topk_kernel(const bf* __restrict__ logits, i64 M, int E, int k, bool renorm,
                                                       float* __restrict__ probs, std::int32_t* __restrict__ experts,
                                                       float* __restrict__ weights) {
  const int lane = threadIdx.x % 32;
  const i64 warps = static_cast<i64>(gridDim.x) * (blockDim.x / 32);
  for (i64 t = static_cast<i64>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; t < M; t += warps) {
    const bf* l = logits + t * E;
    float v[kPerLane];
    float mx = -INFINITY;
#pragma unroll
    for (int s = 0; s < kPerLane; ++s) {
      const int i = lane + 32 * s;
      v[s] = i < E ? __bfloat162float(l[i]) : -INFINITY;
      mx = fmaxf(mx, v[s]);
    }
    mx = warp_max(mx);
    float sum = 0.0f;
#pragma unroll
    for (int s = 0; s < kPerLane; ++s) {
      const int i = lane + 32 * s;
      v[s] = i < E ? expf(v[s] - mx) : 0.0f;
      sum += v[s];
    }
    sum = warp_sum(sum);
    // sel: what the top-k compares (a NaN probability ranks below every number, so the chosen
    // experts are always valid and distinct; the NaN itself still reaches the weights and the loss).
    float sel[kPerLane];
#pragma unroll
    for (int s = 0; s < kPerLane; ++s) {
      const int i = lane + 32 * s;
      if (i < E) {
        v[s] = v[s] / sum;
        probs[t * E + i] = v[s];
        sel[s] = isnan(v[s]) ? -0.5f : v[s];
      } else {
        sel[s] = -1.0f;
      }
    }
    float mine = 0.0f, chosen = 0.0f;
    int mine_i = 0;
    for (int j = 0; j < k; ++j) {
      float bv = -1.0f, pv = 0.0f;
      int bi = INT_MAX;
#pragma unroll
      for (int s = 0; s < kPerLane; ++s)  // a lane's indices increase with s: > keeps the lowest of equals
        if (sel[s] > bv) bv = sel[s], pv = v[s], bi = lane + 32 * s;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(kFull, bv, o), op = __shfl_xor_sync(kFull, pv, o);
        const int oi = __shfl_xor_sync(kFull, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) bv = ov, pv = op, bi = oi;
      }
#pragma unroll
      for (int s = 0; s < kPerLane; ++s)
        if (lane + 32 * s == bi) sel[s] = -1.0f;
      chosen += pv;  // the chosen probabilities summed in top-k order, as the CPU does
      if (lane == j) mine = pv, mine_i = bi;
    }
    if (lane < k) {
      experts[t * k + lane] = mine_i;
      weights[t * k + lane] = renorm ? mine / chosen : mine;
    }
  }
}

// ---- grouping the assignments by expert (a stable counting sort) -------------------------------
// counts: [chunks, E] in the workspace. Kernel 1: each chunk's histogram.
__global__ void __launch_bounds__(256) moe_chunk_count_kernel(const std::int32_t* __restrict__ experts, i64 N, int E,
                                                              i64 chunk, int* __restrict__ counts) {
  extern __shared__ int hist[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const i64 a0 = static_cast<i64>(blockIdx.x) * chunk, a1 = min(N, a0 + chunk);
  for (i64 a = a0 + threadIdx.x; a < a1; a += blockDim.x) {
    const int e = experts[a];
    if (e < 0 || e >= E) __trap();
    atomicAdd(&hist[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) counts[static_cast<i64>(blockIdx.x) * E + e] = hist[e];
}

// Kernel 2 (one block): offsets[e] from the totals, and counts[c, e] turned into the first row of
// chunk c's assignments of expert e.
__global__ void __launch_bounds__(1024) moe_chunk_scan_kernel(int* __restrict__ counts, int chunks, int E,
                                                              i64* __restrict__ offsets) {
  extern __shared__ i64 total[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    i64 s = 0;
    for (int c = 0; c < chunks; ++c) s += counts[static_cast<i64>(c) * E + e];
    total[e] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    i64 run = 0;
    for (int e = 0; e < E; ++e) {
      offsets[e] = run;
      run += total[e];
      total[e] = offsets[e];
    }
    offsets[E] = run;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    i64 run = total[e];
    for (int c = 0; c < chunks; ++c) {
      const i64 at = static_cast<i64>(c) * E + e;
      const int n = counts[at];
      counts[at] = static_cast<int>(run);  // (rows fit in int: N < 2^31 is checked on the host)
      run += n;
    }
  }
}

// Kernel 3: one warp per chunk places its assignments in order.
__global__ void __launch_bounds__(32) moe_place_kernel(const std::int32_t* __restrict__ experts, i64 N, int E, i64 chunk,
                                                       const int* __restrict__ base, std::int32_t* __restrict__ order,
                                                       std::int32_t* __restrict__ slot) {
  extern __shared__ int next[];
  const int* b = base + static_cast<i64>(blockIdx.x) * E;
  for (int e = threadIdx.x; e < E; e += 32) next[e] = b[e];
  __syncwarp();
  const int lane = threadIdx.x;
  const unsigned lower = (1u << lane) - 1u;
  const i64 a0 = static_cast<i64>(blockIdx.x) * chunk, a1 = min(N, a0 + chunk);
  for (i64 s = a0; s < a1; s += 32) {
    const i64 a = s + lane;
    const bool live = a < a1;
    const unsigned act = __ballot_sync(kFull, live);
    const int e = live ? experts[a] : -1 - lane;  // (distinct dummies match nobody)
    const unsigned peers = __match_any_sync(kFull, e) & act;
    if (live) {
      const int r = next[e] + __popc(peers & lower);
      order[r] = static_cast<std::int32_t>(a);
      slot[a] = r;
    }
    __syncwarp();
    if (live && (peers >> lane) == 1u) next[e] += __popc(peers);  // the group's last lane moves its counter
    __syncwarp();
  }
}

// ---- rows in and out of the grouped layout ------------------------------------------------------
// xs[r] = x[order[r] / k], a row of d bf16 per block-stride step.
__global__ void __launch_bounds__(256) moe_gather_kernel(const bf* __restrict__ x, const std::int32_t* __restrict__ order,
                                                         int k, i64 N, i64 d, bf* __restrict__ xs) {
  for (i64 r = blockIdx.x; r < N; r += gridDim.x) {
    const bf* src = x + static_cast<i64>(order[r] / k) * d;
    bf* dst = xs + r * d;
    for (i64 c = threadIdx.x; c < d; c += blockDim.x) dst[c] = src[c];
  }
}

// A token's k choices sorted by their row (so by expert), in shared memory.
__device__ __forceinline__ void sorted_choices(const std::int32_t* slot, const float* weights, i64 t, int k, int* js,
                                               float* ws) {
  if (threadIdx.x == 0) {
    for (int j = 0; j < k; ++j) {
      const int r = slot[t * k + j];
      const float w = weights ? weights[t * k + j] : 0.0f;
      int at = j;
      while (at > 0 && js[at - 1] > r) {
        js[at] = js[at - 1];
        ws[at] = ws[at - 1];
        --at;
      }
      js[at] = r;
      ws[at] = w;
    }
  }
  __syncthreads();
}

// y[t] = base[t] + the sum over the token's rows, in increasing index (the experts' order), of
// weight x rows[row] (weights null: 1), in fp32; y may be base. The weighted sum into the residual
// stream (moe_combine: fp32) and the rows' input gradients into a token's (moe_scatter_add: bf16).
__device__ __forceinline__ float ld(const float* p) { return *p; }
__device__ __forceinline__ float ld(const bf* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void st(float* p, float v) { *p = v; }
__device__ __forceinline__ void st(bf* p, float v) { *p = __float2bfloat16_rn(v); }
template <class T>
__global__ void __launch_bounds__(256) moe_sum_rows_kernel(const bf* __restrict__ rows, const std::int32_t* __restrict__ slot,
                                                           const float* __restrict__ weights, int k, const T* base, T* y,
                                                           i64 M, i64 d) {
  __shared__ int js[kMoeMaxTopK];
  __shared__ float ws[kMoeMaxTopK];
  for (i64 t = blockIdx.x; t < M; t += gridDim.x) {
    sorted_choices(slot, weights, t, k, js, ws);
    for (i64 c = threadIdx.x; c < d; c += blockDim.x) {
      float s = 0.0f;
      for (int j = 0; j < k; ++j) {
        const float v = __bfloat162float(rows[static_cast<i64>(js[j]) * d + c]);
        s += weights ? v * ws[j] : v;
      }
      st(y + t * d + c, ld(base + t * d + c) + s);
    }
    __syncthreads();
  }
}

// One warp per assignment (t, j): dout[row] = bf16(dy[t] * w), dweights = <dy[t], out[row]>.
__global__ void __launch_bounds__(256) moe_combine_backward_kernel(const bf* __restrict__ dy, const bf* __restrict__ out,
                                                                   const std::int32_t* __restrict__ slot,
                                                                   const float* __restrict__ weights, int k, i64 M, i64 d,
                                                                   bf* __restrict__ dout, float* __restrict__ dweights) {
  const int lane = threadIdx.x % 32;
  const i64 warps = static_cast<i64>(gridDim.x) * (blockDim.x / 32);
  for (i64 a = static_cast<i64>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; a < M * k; a += warps) {
    const i64 t = a / k, r = slot[a];
    const float w = weights[a];
    const bf* g = dy + t * d;
    const bf* o = out + r * d;
    bf* go = dout + r * d;
    float dot = 0.0f;
    for (i64 c = lane; c < d; c += 32) {
      const float gc = __bfloat162float(g[c]);
      go[c] = __float2bfloat16_rn(gc * w);
      dot += gc * __bfloat162float(o[c]);
    }
    dot = warp_sum(dot);
    if (lane == 0) dweights[a] = dot;
  }
}

// The auxiliary load-balancing loss's gradient at expert i's probability: aux_scale times the
// assignments to i summed over the sparse layers (in layer order).
__device__ __forceinline__ float aux_term(const i64* counts, int layers, double scale, int E, int i) {
  i64 c = 0;
  for (int l = 0; l < layers; ++l) c += counts[static_cast<i64>(l) * E + i];
  return static_cast<float>(scale * static_cast<double>(c));
}

// One block per expert: counts[e] += the rows routed to e; prob_sums[e] += the sum over tokens
// of probs[t, e] (in double, threads' partial sums added in a fixed tree). With `valid` (not null)
// only the tokens it flags: their probabilities, and their assignments to e (experts [M, k]).
constexpr int kRecordThreads = 256;
__global__ void __launch_bounds__(kRecordThreads) moe_record_kernel(const float* __restrict__ probs,
                                                                    const std::int32_t* __restrict__ experts, int k,
                                                                    const i64* __restrict__ offsets,
                                                                    const std::uint8_t* __restrict__ valid, i64 M, int E,
                                                                    i64* __restrict__ counts, double* __restrict__ prob_sums) {
  __shared__ double part[kRecordThreads];
  __shared__ i64 hits[kRecordThreads];
  const int e = blockIdx.x;
  double s = 0;
  i64 c = 0;
  for (i64 t = threadIdx.x; t < M; t += kRecordThreads) {
    if (valid && valid[t] == 0) continue;
    s += static_cast<double>(probs[t * E + e]);
    if (valid)
      for (int j = 0; j < k; ++j) c += experts[t * k + j] == e;
  }
  part[threadIdx.x] = s;
  hits[threadIdx.x] = c;
  __syncthreads();
  for (int w = kRecordThreads / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) {
      part[threadIdx.x] += part[threadIdx.x + w];
      hits[threadIdx.x] += hits[threadIdx.x + w];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    prob_sums[e] += part[0];
    counts[e] += valid ? hits[0] : offsets[e + 1] - offsets[e];
  }
}

// One warp per token: dlogits through the renormalisation (where asked) and the softmax.
__global__ void __launch_bounds__(256) moe_route_backward_kernel(const float* __restrict__ probs,
                                                                 const std::int32_t* __restrict__ experts,
                                                                 const float* __restrict__ weights,
                                                                 const float* __restrict__ dweights, int k, bool renorm,
                                                                 const i64* __restrict__ aux_counts, int aux_layers,
                                                                 double aux_scale, const std::uint8_t* __restrict__ valid,
                                                                 i64 M, int E, bf* __restrict__ dlogits) {
  const int lane = threadIdx.x % 32;
  const i64 warps = static_cast<i64>(gridDim.x) * (blockDim.x / 32);
  for (i64 t = static_cast<i64>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; t < M; t += warps) {
    const float* p = probs + t * E;
    const std::int32_t* ex = experts + t * k;
    const float* w = weights + t * k;
    const float* dw = dweights + t * k;
    // (the auxiliary loss's share at the tokens that count: those `valid` flags, or every token)
    const i64* aux = aux_counts != nullptr && (valid == nullptr || valid[t] != 0) ? aux_counts : nullptr;
    float chosen = 0.0f, dot = 0.0f;  // (every lane computes the same scalars, in the CPU's order)
    if (renorm)
      for (int j = 0; j < k; ++j) {
        chosen += p[ex[j]];
        dot += dw[j] * w[j];
      }
    // dp_i: the routing weights' share at the chosen experts, plus the auxiliary loss's at every
    // expert; the softmax's sum_i p_i dp_i in index order (the CPU's), a warp's partial sums
    // added in a fixed order where the auxiliary loss makes every term nonzero.
    const auto dp_of = [&](int i) {
      float dp = aux ? aux_term(aux, aux_layers, aux_scale, E, i) : 0.0f;
      for (int j = 0; j < k; ++j)
        if (ex[j] == i) dp += renorm ? (dw[j] - dot) / chosen : dw[j];
      return dp;
    };
    float sdot = 0.0f;
    if (aux) {
      for (int i = lane; i < E; i += 32) sdot += p[i] * dp_of(i);
      sdot = warp_sum(sdot);
    } else {  // only the chosen are nonzero: added in increasing index
      int last = -1;
      for (int n = 0; n < k; ++n) {  // (the chosen are distinct)
        int bj = -1;
        for (int j = 0; j < k; ++j)
          if (ex[j] > last && (bj < 0 || ex[j] < ex[bj])) bj = j;
        last = ex[bj];
        sdot += p[last] * dp_of(last);
      }
    }
    for (int i = lane; i < E; i += 32) dlogits[t * E + i] = __float2bfloat16_rn(p[i] * (dp_of(i) - sdot));
  }
}

// ---- the experts' biases (GPT-OSS) ------------------------------------------------------------
/// The expert whose rows hold row r: the last e with offsets[e] <= r (offsets [E + 1], increasing).
__device__ __forceinline__ int expert_of(const std::int64_t* __restrict__ offsets, int E, i64 r) {
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= r) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

/// y[r] = bf16(y[r] + bias_e) for the rows [offsets[0], offsets[E]), bias_e = bias0 + e * stride:
/// a block per row at a time.
__global__ void __launch_bounds__(256) moe_bias_add_kernel(bf* __restrict__ y, int N, const std::int64_t* __restrict__ offsets,
                                                           int E, const bf* __restrict__ bias0, i64 stride) {
  const i64 r0 = offsets[0], r1 = offsets[E];
  for (i64 r = r0 + blockIdx.x; r < r1; r += gridDim.x) {
    const bf* b = bias0 + static_cast<i64>(expert_of(offsets, E, r)) * stride;
    bf* row = y + r * N;
    for (int c = threadIdx.x; c < N; c += blockDim.x)
      row[c] = __float2bfloat16(__bfloat162float(row[c]) + __bfloat162float(b[c]));
  }
}

/// dbias_e += the column sums of dy's rows of expert e (blockIdx.y), each column summed by one
/// thread in row order (in double, then rounded once): deterministic.
__global__ void __launch_bounds__(256) moe_bias_grad_kernel(const bf* __restrict__ dy, int N,
                                                            const std::int64_t* __restrict__ offsets,
                                                            float* __restrict__ dbias0, i64 stride) {
  const int e = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= N) return;
  double acc = 0.0;
  for (i64 r = offsets[e]; r < offsets[e + 1]; ++r) acc += static_cast<double>(__bfloat162float(dy[r * N + c]));
  dbias0[static_cast<i64>(e) * stride + c] += static_cast<float>(acc);
}

}  // namespace

void launch_moe_bias_add(bf16* y, std::int64_t rows, std::int64_t N, const std::int64_t* offsets, std::int64_t E,
                         const bf16* bias0, std::int64_t stride, cudaStream_t stream) {
  MT_CHECK(N > 0 && N <= INT_MAX && E > 0 && E <= kMoeMaxExperts && rows >= 0, "moe_bias_add: {} columns, {} experts", N, E);
  if (rows == 0) return;
  const auto blocks = static_cast<unsigned>(std::min<std::int64_t>(rows, 8192));
  moe_bias_add_kernel<<<blocks, 256, 0, stream>>>(dev(y), static_cast<int>(N), offsets, static_cast<int>(E), dev(bias0),
                                                  stride);
  MT_CUDA_CHECK_LAUNCH("moe_bias_add_kernel");
}

void launch_moe_bias_grad(const bf16* dy, std::int64_t N, const std::int64_t* offsets, std::int64_t E, float* dbias0,
                          std::int64_t stride, cudaStream_t stream) {
  MT_CHECK(N > 0 && N <= INT_MAX && E > 0 && E <= 65535, "moe_bias_grad: {} columns, {} experts", N, E);
  const dim3 grid(static_cast<unsigned>((N + 255) / 256), static_cast<unsigned>(E));
  moe_bias_grad_kernel<<<grid, 256, 0, stream>>>(dev(dy), static_cast<int>(N), offsets, dbias0, stride);
  MT_CUDA_CHECK_LAUNCH("moe_bias_grad_kernel");
}

void launch_moe_route(const bf16* logits, std::int64_t M, std::int64_t E, std::int64_t k, bool renormalize, float* probs,
                      std::int32_t* experts, float* weights, std::int32_t* order, std::int32_t* slot, std::int64_t* offsets,
                      void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  MT_CHECK(E >= 1 && E <= kMoeMaxExperts && k >= 1 && k <= std::min<std::int64_t>(E, kMoeMaxTopK),
           "mixture of experts: {} experts, {} per token: the CUDA backend routes at most {} experts and {} per token", E, k,
           kMoeMaxExperts, kMoeMaxTopK);
  const i64 N = M * k;
  MT_CHECK(M >= 0 && N < (i64{1} << 31), "mixture of experts: {} assignments in one token block exceed 2^31", N);
  if (M == 0) return;
  moe_topk_kernel<<<grid_for(M * 32, 256), 256, 0, stream>>>(dev(logits), M, static_cast<int>(E), static_cast<int>(k),
                                                                  renormalize, probs, experts, weights);
  MT_CUDA_CHECK_LAUNCH("moe_topk_kernel");
  // Chunks of assignments: as few as the workspace's [chunks, E] counts allow, at least 1,024 long.
  const i64 cap = static_cast<i64>(workspace_bytes / sizeof(int)) / E;
  MT_CHECK(workspace != nullptr && cap >= 1, "mixture of experts: the routing workspace of {} bytes holds no chunk of {} experts",
           workspace_bytes, E);
  const i64 chunk = std::max<i64>(1024, (N + cap - 1) / cap), chunks = (N + chunk - 1) / chunk;
  int* counts = static_cast<int*>(workspace);
  const auto e32 = static_cast<int>(E);
  moe_chunk_count_kernel<<<static_cast<unsigned>(chunks), 256, E * sizeof(int), stream>>>(experts, N, e32, chunk, counts);
  MT_CUDA_CHECK_LAUNCH("moe_chunk_count_kernel");
  moe_chunk_scan_kernel<<<1, 1024, E * sizeof(i64), stream>>>(counts, static_cast<int>(chunks), e32, offsets);
  MT_CUDA_CHECK_LAUNCH("moe_chunk_scan_kernel");
  moe_place_kernel<<<static_cast<unsigned>(chunks), 32, E * sizeof(int), stream>>>(experts, N, e32, chunk, counts, order, slot);
  MT_CUDA_CHECK_LAUNCH("moe_place_kernel");
}

void launch_moe_gather(const bf16* x, const std::int32_t* order, std::int64_t k, std::int64_t N, std::int64_t d, bf16* xs,
                       cudaStream_t stream) {
  if (N == 0) return;
  moe_gather_kernel<<<grid_for(N, 1), 256, 0, stream>>>(dev(x), order, static_cast<int>(k), N, d, dev(xs));
  MT_CUDA_CHECK_LAUNCH("moe_gather_kernel");
}

void launch_moe_combine(const bf16* out, const std::int32_t* slot, const float* weights, std::int64_t k, const float* h,
                        float* y, std::int64_t M, std::int64_t d, cudaStream_t stream) {
  MT_CHECK(k >= 1 && k <= kMoeMaxTopK, "moe_combine: {} experts per token (at most {})", k, kMoeMaxTopK);
  if (M == 0) return;
  moe_sum_rows_kernel<float><<<grid_for(M, 1), 256, 0, stream>>>(dev(out), slot, weights, static_cast<int>(k), h, y, M, d);
  MT_CUDA_CHECK_LAUNCH("moe_sum_rows_kernel (combine)");
}

void launch_moe_combine_backward(const bf16* dy, const bf16* out, const std::int32_t* slot, const float* weights,
                                 std::int64_t k, std::int64_t M, std::int64_t d, bf16* dout, float* dweights,
                                 cudaStream_t stream) {
  if (M == 0) return;
  moe_combine_backward_kernel<<<grid_for(M * k * 32, 256), 256, 0, stream>>>(dev(dy), dev(out), slot, weights,
                                                                                 static_cast<int>(k), M, d, dev(dout), dweights);
  MT_CUDA_CHECK_LAUNCH("moe_combine_backward_kernel");
}

void launch_moe_route_backward(const float* probs, const std::int32_t* experts, const float* weights, const float* dweights,
                               std::int64_t k, bool renormalize, const std::int64_t* aux_counts, std::int64_t aux_layers,
                               double aux_scale, const std::uint8_t* valid, std::int64_t M, std::int64_t E, bf16* dlogits,
                               cudaStream_t stream) {
  if (M == 0) return;
  moe_route_backward_kernel<<<grid_for(M * 32, 256), 256, 0, stream>>>(
      probs, experts, weights, dweights, static_cast<int>(k), renormalize, aux_counts, static_cast<int>(aux_layers), aux_scale,
      valid, M, static_cast<int>(E), dev(dlogits));
  MT_CUDA_CHECK_LAUNCH("moe_route_backward_kernel");
}

void launch_moe_record(const float* probs, const std::int32_t* experts, std::int64_t k, const std::int64_t* offsets,
                       const std::uint8_t* valid, std::int64_t M, std::int64_t E, std::int64_t* counts, double* prob_sums,
                       cudaStream_t stream) {
  if (M == 0) return;
  moe_record_kernel<<<static_cast<unsigned>(E), kRecordThreads, 0, stream>>>(probs, experts, static_cast<int>(k), offsets,
                                                                               valid, M, static_cast<int>(E), counts, prob_sums);
  MT_CUDA_CHECK_LAUNCH("moe_record_kernel");
}

void launch_moe_scatter_add(const bf16* dxs, const std::int32_t* slot, std::int64_t k, bf16* dx, std::int64_t M,
                            std::int64_t d, cudaStream_t stream) {
  MT_CHECK(k >= 1 && k <= kMoeMaxTopK, "moe_scatter_add: {} experts per token (at most {})", k, kMoeMaxTopK);
  if (M == 0) return;
  moe_sum_rows_kernel<bf><<<grid_for(M, 1), 256, 0, stream>>>(dev(dxs), slot, nullptr, static_cast<int>(k), dev(dx),
                                                                  dev(dx), M, d);
  MT_CUDA_CHECK_LAUNCH("moe_sum_rows_kernel (scatter_add)");
}

}  // namespace megatrain::cuda
