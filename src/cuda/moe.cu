// The routing and data movement of a mixture-of-experts layer on the GPU (contract:
// backend/cuda/kernels.hpp, "mixture of experts"), and the experts' products as grouped GEMMs
// (below). The CPU backend's moe_* primitives are the reference these follow.
//
// Deterministic like the rest of megatrain's kernels: no floating-point atomics; the grouping of
// assignments by expert is a stable counting sort (per-chunk histograms with integer atomics,
// whose counts do not depend on order, a scan in chunk order, then one warp per chunk placing its
// assignments in order), so `order`, `slot` and `offsets` are the CPU's exactly; every sum has an
// order fixed by the shapes (a token's experts in increasing index, as transformers adds them).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <span>

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

// ---- the experts' products: grouped GEMMs reading the row offsets on the device -------------------
// C = A B per expert, on bf16 tensor cores (mma.sync m16n8k16, fp32 accumulation), in tiles of
// BM x BN with a pipeline of kStages loads of BK (cp.async). A block finds its expert and tile
// from the offsets itself, so the host never waits for the routing: the grid covers the most
// tiles any routing of the rows could need, and blocks beyond the routing's tiles end at once.
//   forward      C[rows of e] (bf16)  = X[rows of e] W_e^T : A = X [m][k], B = W_e [n][k]
//   input grad   C[rows of e] (bf16) (+)= dY[rows of e] W_e : A = dY [m][k], B = W_e [k][n]
//   weight grad  C_e (fp32) += dY[rows of e]^T X[rows of e]: A = dY [k][m], B = X [k][n]
// Each element of C is one block's sum over k in increasing order: deterministic.
namespace grouped {

constexpr int BM = 128;
enum Mode { kForward, kInputGrad, kWeightGrad };

/// A block's tile: BM x BN of the output, kStages loads of BK in flight; kWarpsM x kWarpsN warps,
/// each kWarpM x kWarpN of the tile.
template <int BN_, int BK_, int kStages_, int kWarpsM_, int kWarpsN_>
struct Tile {
  static constexpr int BN = BN_, BK = BK_, kStages = kStages_, kWarpsM = kWarpsM_, kWarpsN = kWarpsN_;
  static constexpr int kThreads = 32 * kWarpsM * kWarpsN;
  static constexpr int kWarpM = BM / kWarpsM, kWarpN = BN / kWarpsN;
  static constexpr int kI = kWarpM / 16, kJ = kWarpN / 8;  // the warp's m16 and n8 tiles
  static constexpr int kABytes = BM * BK * 2, kBBytes = BN * BK * 2, kStageBytes = kABytes + kBBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes;
  // two blocks an SM where their shared memory and accumulators (at most 128 registers a thread
  // at 256 threads) allow
  static constexpr int kMinBlocks = kSmemBytes <= 100 * 1024 && kI * kJ * 4 * kThreads <= 64 * 256 ? 2 : 1;
  static_assert(BM * BK / 8 % kThreads == 0 && BN * BK / 8 % kThreads == 0, "each thread loads whole 16-byte chunks");
  static_assert(kI >= 1 && kJ % 2 == 0 && BK % 16 == 0, "warps of whole m16 x n16 pairs, k in steps of 16");
  static_assert(kMoeMaxExperts % kThreads == 0, "find_row_tile: the experts split evenly over the threads");
};

/// What a launch passes by value (a grid constant): the experts' own pointers (weights, or the
/// weight gradients), the shared operands, the offsets.
struct Args {
  const void* expert[kMoeMaxExperts];
  const bf* a;                // X (forward), dY (input and weight gradient)
  const bf* b;                // X (weight gradient)
  void* c;                    // Y or dX (bf16)
  const std::int64_t* offsets;
  int E, N, K;                // each expert's weight [N, K]
  int col_tiles;              // forward and input gradient: the output's tiles across (a block's index
                              // is row tile x col_tiles + column tile: a row tile's blocks run together)
  bool accumulate;            // input gradient: dX += rather than =
};

// A tile stored in rows of kRowBytes (its contiguous dimension: BK, or the tile's 128 or 256):
// 16-byte chunks swizzled so that ldmatrix's eight rows at one chunk fall in eight different
// bank groups.
template <int kRowBytes>
__device__ __forceinline__ int offset(int row, int chunk) {
  if constexpr (kRowBytes == 64) return row * 64 + ((chunk ^ ((row >> 1) & 3)) << 4);  // (4 chunks a row: pairs of rows)
  else return row * kRowBytes + ((chunk ^ (row & 7)) << 4);
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void mma_bf16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/// One operand's tile of a stage, kRows along m (or n) by BK along k: `Wide` = stored [k][m or n]
/// (its contiguous dimension the tile's kRows), else [m or n][k] (contiguous k). Global element
/// (i, j) of the operand (i along the tile's rows, j along k) is at p[i * ld + j] (not Wide) or
/// p[j * ld + i] (Wide); beyond `rows` (i) or `depth` (j) it loads as zero. `Vec`: 16-byte loads
/// (every contiguous run a multiple of 8 elements, 16-byte aligned), else element by element.
template <int kRows, int BK, int kThreads, bool Wide, bool Vec>
__device__ __forceinline__ void load_tile(unsigned char* tile, const bf* __restrict__ p, i64 ld, int rows, int j0, int depth) {
  constexpr int kChunks = kRows * BK / 8, kPerRow = Wide ? kRows / 8 : BK / 8;
#pragma unroll
  for (int it = 0; it < kChunks / kThreads; ++it) {
    const int q = static_cast<int>(threadIdx.x) + it * kThreads;
    const int srow = q / kPerRow, chunk = q % kPerRow;  // the tile's row and 16-byte chunk
    const int i = Wide ? chunk * 8 : srow, j = j0 + (Wide ? srow : chunk * 8);  // the operand's (i, j) of its first element
    const int off = offset<Wide ? kRows * 2 : BK * 2>(srow, chunk);
    if constexpr (Vec) {
      const bool valid = i < rows && j < depth;
      const bf* src = valid ? (Wide ? p + static_cast<i64>(j) * ld + i : p + static_cast<i64>(i) * ld + j) : p;
      cp_async16(smem_addr(tile + off), src, valid);
    } else {
      alignas(16) bf v[8];
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        const int ii = Wide ? i + t : i, jj = Wide ? j : j + t;
        v[t] = ii < rows && jj < depth ? p[Wide ? static_cast<i64>(jj) * ld + ii : static_cast<i64>(ii) * ld + jj]
                                       : __float2bfloat16_rn(0.0f);
      }
      *reinterpret_cast<uint4*>(tile + off) = *reinterpret_cast<const uint4*>(v);
    }
  }
}

/// acc (this thread's share of the block's BM x BN tile) = A[:M, :depth] B[:depth, :Nc]; A is
/// (m, k) = a[m * lda + k] (or a[k * lda + m] where AWide), B is (k, n) = b[n * ldb + k] (or
/// b[k * ldb + n] where BWide). Sums over k in increasing order.
template <class T, bool AWide, bool BWide, bool Vec>
__device__ __forceinline__ void block_product(float (&acc)[T::kI][T::kJ][4], unsigned char* smem, const bf* __restrict__ a,
                                              i64 lda, int M, const bf* __restrict__ b, i64 ldb, int Nc, int depth) {
  constexpr int kStages = T::kStages, BK = T::BK;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = (warp / T::kWarpsN) * T::kWarpM, wn = (warp % T::kWarpsN) * T::kWarpN;  // the warp's part of the tile
  const int tiles = static_cast<int>((static_cast<i64>(depth) + BK - 1) / BK);
  auto stage = [&](int s) { return smem + s * T::kStageBytes; };
  auto load = [&](int s, int t) {
    load_tile<BM, BK, T::kThreads, AWide, Vec>(stage(s), a, lda, M, t * BK, depth);
    load_tile<T::BN, BK, T::kThreads, BWide, Vec>(stage(s) + T::kABytes, b, ldb, Nc, t * BK, depth);
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < tiles) load(s, s);
    cp_async_commit();
  }
  const int mat = lane / 8, r8 = lane % 8;  // which of ldmatrix's four 8 x 8 matrices this lane addresses, and its row
  for (int t = 0; t < tiles; ++t) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    if (t + kStages - 1 < tiles) load((t + kStages - 1) % kStages, t + kStages - 1);
    cp_async_commit();
    const unsigned char* sa = stage(t % kStages);
    const unsigned char* sb = sa + T::kABytes;
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      unsigned af[T::kI][4], bfr[T::kJ][2];
#pragma unroll
      for (int i = 0; i < T::kI; ++i) {
        const int m = wm + i * 16 + (mat & 1) * 8;  // matrices: (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15)
        const int k = kk * 16 + (mat >> 1) * 8;
        if constexpr (AWide) ldmatrix_x4_trans(af[i], smem_addr(sa + offset<BM * 2>(k + r8, m / 8)));
        else ldmatrix_x4(af[i], smem_addr(sa + offset<BK * 2>(m + r8, k / 8)));
      }
#pragma unroll
      for (int p = 0; p < T::kJ / 2; ++p) {
        const int n = wn + p * 16 + (mat >> 1) * 8;  // matrices: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
        const int k = kk * 16 + (mat & 1) * 8;
        unsigned r[4];
        if constexpr (BWide) ldmatrix_x4_trans(r, smem_addr(sb + offset<T::BN * 2>(k + r8, n / 8)));
        else ldmatrix_x4(r, smem_addr(sb + offset<BK * 2>(n + r8, k / 8)));
        bfr[2 * p][0] = r[0], bfr[2 * p][1] = r[1], bfr[2 * p + 1][0] = r[2], bfr[2 * p + 1][1] = r[3];
      }
#pragma unroll
      for (int i = 0; i < T::kI; ++i)
#pragma unroll
        for (int j = 0; j < T::kJ; ++j) mma_bf16(acc[i][j], af[i], bfr[j][0], bfr[j][1]);
    }
  }
  cp_async_wait<0>();
}

/// f(m, n, v0, v1, pair) for this thread's accumulators inside M x Nc, v1 belonging to column
/// n + 1 (pair: n + 1 < Nc).
template <class T, class F>
__device__ __forceinline__ void for_each_output(const float (&acc)[T::kI][T::kJ][4], int M, int Nc, F&& f) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = (warp / T::kWarpsN) * T::kWarpM, wn = (warp % T::kWarpsN) * T::kWarpN;
#pragma unroll
  for (int i = 0; i < T::kI; ++i)
#pragma unroll
    for (int j = 0; j < T::kJ; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int m = wm + i * 16 + lane / 4 + h * 8, n = wn + j * 8 + (lane % 4) * 2;
        if (m < M && n < Nc) f(m, n, acc[i][j][2 * h], acc[i][j][2 * h + 1], n + 1 < Nc);
      }
}

/// The expert and its tile of rows for row tile `bx` in the forward and input gradient: expert e's
/// rows take ceil(rows_e / BM) consecutive indices, in expert order. -1: none.
template <int kThreads>
__device__ int find_row_tile(const std::int64_t* __restrict__ offsets, int E, int bx, int* tile) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int found[2];
  constexpr int kPer = kMoeMaxExperts / kThreads;
  int count[kPer], local = 0;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int e = threadIdx.x * kPer + j;
    count[j] = e < E ? static_cast<int>((offsets[e + 1] - offsets[e] + BM - 1) / BM) : 0;
    local += count[j];
  }
  if (threadIdx.x == 0) found[0] = -1;
  int first = 0;
  Scan(scan).ExclusiveSum(local, first);
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    if (bx >= first && bx < first + count[j]) found[0] = threadIdx.x * kPer + j, found[1] = bx - first;
    first += count[j];
  }
  __syncthreads();
  *tile = found[1];
  return found[0];
}

template <class T, Mode kMode, bool Vec>
__global__ void __launch_bounds__(T::kThreads, T::kMinBlocks) grouped_gemm_kernel(const __grid_constant__ Args args) {
  extern __shared__ __align__(128) unsigned char smem[];
  float acc[T::kI][T::kJ][4] = {};
  if constexpr (kMode == kWeightGrad) {
    // blockIdx.z: the expert; (y, x): the tile of its [N, K] gradient
    const int e = static_cast<int>(blockIdx.z);
    const i64 r0 = args.offsets[e], rows = args.offsets[e + 1] - r0;
    if (rows == 0) return;
    const int m0 = static_cast<int>(blockIdx.y) * BM, n0 = static_cast<int>(blockIdx.x) * T::BN;
    block_product<T, true, true, Vec>(acc, smem, args.a + r0 * args.N + m0, args.N, args.N - m0, args.b + r0 * args.K + n0,
                                      args.K, args.K - n0, static_cast<int>(rows));
    float* c = static_cast<float*>(const_cast<void*>(args.expert[e])) + static_cast<i64>(m0) * args.K + n0;
    const i64 ldc = args.K;
    for_each_output<T>(acc, args.N - m0, args.K - n0, [&](int m, int n, float v0, float v1, bool pair) {
      float* o = c + m * ldc + n;
      if (pair && Vec) {  // (K even, dW 16-byte aligned)
        float2 old = *reinterpret_cast<float2*>(o);
        old.x += v0, old.y += v1;
        *reinterpret_cast<float2*>(o) = old;
      } else {
        o[0] += v0;
        if (pair) o[1] += v1;
      }
    });
  } else {
    int tile = 0;
    const int bx = static_cast<int>(blockIdx.x);
    const int e = find_row_tile<T::kThreads>(args.offsets, args.E, bx / args.col_tiles, &tile);
    if (e < 0) return;
    const i64 r0 = args.offsets[e] + static_cast<i64>(tile) * BM, left = args.offsets[e + 1] - r0;
    const int M = left < BM ? static_cast<int>(left) : BM;
    const int n0 = (bx % args.col_tiles) * T::BN;
    const bf* w = static_cast<const bf*>(args.expert[e]);
    // forward: A = X [rows, K], B (k, n) = W[n, k]; input gradient: A = dY [rows, N], B (k, n) = W[k, n]
    const int depth = kMode == kForward ? args.K : args.N, Nc = kMode == kForward ? args.N : args.K;
    if constexpr (kMode == kForward)
      block_product<T, false, false, Vec>(acc, smem, args.a + r0 * depth, depth, M, w + static_cast<i64>(n0) * args.K,
                                          args.K, Nc - n0, depth);
    else
      block_product<T, false, true, Vec>(acc, smem, args.a + r0 * depth, depth, M, w + n0, args.K, Nc - n0, depth);
    bf* c = static_cast<bf*>(args.c) + r0 * Nc + n0;
    const bool acc_old = kMode == kInputGrad && args.accumulate;
    for_each_output<T>(acc, M, Nc - n0, [&](int m, int n, float v0, float v1, bool pair) {
      bf* o = c + static_cast<i64>(m) * Nc + n;
      if (pair && Vec) {
        __nv_bfloat162 old = *reinterpret_cast<__nv_bfloat162*>(o);
        if (acc_old) v0 += __bfloat162float(old.x), v1 += __bfloat162float(old.y);
        *reinterpret_cast<__nv_bfloat162*>(o) = __floats2bfloat162_rn(v0, v1);
      } else {
        o[0] = __float2bfloat16_rn(acc_old ? v0 + __bfloat162float(o[0]) : v0);
        if (pair) o[1] = __float2bfloat16_rn(acc_old ? v1 + __bfloat162float(o[1]) : v1);
      }
    });
  }
}

}  // namespace grouped

}  // namespace

namespace {
/// Whether a grouped product may load 16 bytes at a time: every contiguous run a multiple of 8
/// elements and every pointer 16-byte aligned.
bool vector_loads(std::int64_t N, std::int64_t K, std::initializer_list<const void*> shared, std::span<const void* const> expert) {
  const auto aligned = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; };
  if (N % 8 != 0 || K % 8 != 0) return false;
  for (const void* p : shared)
    if (!aligned(p)) return false;
  for (const void* p : expert)
    if (!aligned(p)) return false;
  return true;
}

template <class T, grouped::Mode kMode>
void launch_tile(const grouped::Args& args, dim3 grid, bool vec, cudaStream_t stream) {
  const auto kernel = vec ? grouped::grouped_gemm_kernel<T, kMode, true> : grouped::grouped_gemm_kernel<T, kMode, false>;
  MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes));
  kernel<<<grid, T::kThreads, T::kSmemBytes, stream>>>(args);
  MT_CUDA_CHECK_LAUNCH("grouped_gemm_kernel");
}
/// The forward and input gradient: a block per (row tile, column tile), `row_tiles` the most any
/// routing needs; the weight gradient: (column tile, row tile, expert) of the experts' gradients.
template <grouped::Mode kMode>
void launch_grouped(grouped::Args args, std::int64_t row_tiles, std::int64_t cols, bool vec, cudaStream_t stream) {
  // (measured on an H200, bench_grouped_gemm: 128 x 128 x 64 in 3 stages, eight warps of 64 x 32,
  // two blocks an SM, ahead of 128 x 128 x 32 in 3 or 4 stages, of four warps of 64 x 64 and of
  // 128 x 256 tiles; about 330 TFLOP/s, mma.sync's ceiling here)
  using T = grouped::Tile<128, 64, 3, 2, 4>;
  const std::int64_t col_tiles = (cols + T::BN - 1) / T::BN;
  MT_CHECK(kMode == grouped::kWeightGrad ? col_tiles <= INT_MAX && row_tiles <= 65535 : row_tiles * col_tiles <= INT_MAX,
           "grouped products: {} x {} tiles of 128 exceed the grid a launch may have", row_tiles, col_tiles);
  args.col_tiles = static_cast<int>(col_tiles);
  const dim3 grid = kMode == grouped::kWeightGrad
                        ? dim3(static_cast<unsigned>(args.col_tiles), static_cast<unsigned>(row_tiles),
                               static_cast<unsigned>(args.E))
                        : dim3(static_cast<unsigned>(row_tiles * args.col_tiles));
  launch_tile<T, kMode>(args, grid, vec, stream);
}

grouped::Args grouped_args(std::span<const void* const> expert, const std::int64_t* offsets, std::int64_t rows, std::int64_t N,
                           std::int64_t K, const char* what) {
  const auto E = static_cast<std::int64_t>(expert.size());
  MT_CHECK(E >= 1 && E <= kMoeMaxExperts, "{}: {} experts (the CUDA backend takes 1 to {})", what, E, kMoeMaxExperts);
  MT_CHECK(N >= 1 && K >= 1 && N <= INT_MAX && K <= INT_MAX && rows >= 0 && rows < (std::int64_t{1} << 31) &&
               (N + 127) / 128 <= 65535,
           "{}: {} rows of experts [{}, {}] are beyond the grouped products' limits", what, rows, N, K);
  grouped::Args a{};
  std::copy(expert.begin(), expert.end(), a.expert);
  a.offsets = offsets;
  a.E = static_cast<int>(E), a.N = static_cast<int>(N), a.K = static_cast<int>(K);
  return a;
}
std::span<const void* const> as_void(std::span<const bf16* const> w) {
  return {reinterpret_cast<const void* const*>(w.data()), w.size()};
}
}  // namespace

void launch_grouped_forward(const bf16* x, std::span<const bf16* const> w, bf16* y, const std::int64_t* offsets,
                            std::int64_t rows, std::int64_t N, std::int64_t K, cudaStream_t stream) {
  auto a = grouped_args(as_void(w), offsets, rows, N, K, "grouped_linear");
  if (rows == 0) return;
  a.a = dev(x), a.c = dev(y);
  launch_grouped<grouped::kForward>(a, (rows + grouped::BM - 1) / grouped::BM + a.E, N, vector_loads(N, K, {x, y}, as_void(w)), stream);
}

void launch_grouped_input_grad(const bf16* dy, std::span<const bf16* const> w, bf16* dx, bool accumulate,
                               const std::int64_t* offsets, std::int64_t rows, std::int64_t N, std::int64_t K,
                               cudaStream_t stream) {
  auto a = grouped_args(as_void(w), offsets, rows, N, K, "grouped_linear_backward");
  if (rows == 0) return;
  a.a = dev(dy), a.c = dev(dx), a.accumulate = accumulate;
  launch_grouped<grouped::kInputGrad>(a, (rows + grouped::BM - 1) / grouped::BM + a.E, K, vector_loads(N, K, {dy, dx}, as_void(w)), stream);
}

void launch_grouped_weight_grad(const bf16* dy, const bf16* x, std::span<float* const> dw, const std::int64_t* offsets,
                                std::int64_t rows, std::int64_t N, std::int64_t K, cudaStream_t stream) {
  const std::span<const void* const> g(reinterpret_cast<const void* const*>(dw.data()), dw.size());
  auto a = grouped_args(g, offsets, rows, N, K, "grouped_linear_backward");
  if (rows == 0) return;
  a.a = dev(dy), a.b = dev(x);
  launch_grouped<grouped::kWeightGrad>(a, (N + grouped::BM - 1) / grouped::BM, K, vector_loads(N, K, {dy, x}, g), stream);
}

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
