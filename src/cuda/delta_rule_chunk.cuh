// What the delta rule's kernels share (delta_rule.cu: the walks and the chunks' own products;
// delta_rule_grad.cu: each chunk's q, k, g and beta gradients): a chunk's tokens in shared memory,
// its matrices, tiles of value columns, and a block's products on the tensor cores.
// Internal: not installed.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "delta_rule.cuh"
#include "megatrain/core/cuda_check.hpp"

namespace megatrain::cuda::delta_rule::detail {

using namespace common;

inline constexpr int C = static_cast<int>(kDeltaRuleChunk);
inline constexpr int BV = 32;   // value columns a tile
inline constexpr int NT = 256;  // threads a block
inline constexpr int DK = static_cast<int>(kDeltaRuleMaxKeyDim);
inline constexpr int VS = BV + 1;  // row stride of a [rows, BV] tile in shared memory
inline constexpr int CS = C + 1;   // row stride of a [C, C] matrix

__device__ __forceinline__ i64 imin(i64 a, i64 b) { return a < b ? a : b; }

// dst[i ds + x] = (i < n ? scale(i) src[i ss + x] : 0) for i < rows, x < cols: a thread's loads
// 16 at a time, so that their latencies overlap (the blocks of a walk are few, and a load from
// memory waits far longer than a chunk's products take); its (i, x) stepped, not divided.
template <class Scale>
__device__ __forceinline__ void stage(float* dst, int ds, const float* src, i64 ss, int rows, int n, int cols, Scale scale) {
  constexpr int kBatch = 16;
  const int di = NT / cols, dx = NT % cols;
  int i = threadIdx.x / cols, x = threadIdx.x % cols;
  while (i < rows) {
    float v[kBatch];
    int at_i[kBatch], at_x[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      at_i[u] = i;
      at_x[u] = x;
      v[u] = i < n && i < rows ? src[i * ss + x] : 0.0f;
      i += di;
      x += dx;
      if (x >= cols) {
        x -= cols;
        ++i;
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
      if (at_i[u] < rows) dst[at_i[u] * ds + at_x[u]] = at_i[u] < n ? scale(at_i[u]) * v[u] : 0.0f;
  }
}
__device__ __forceinline__ void stage(float* dst, int ds, const float* src, i64 ss, int rows, int n, int cols) {
  stage(dst, ds, src, ss, rows, n, cols, [](int) { return 1.0f; });
}

// An M x N fp32 result spread over the block's warps as mma.sync m16n8k8 holds it: warp w holds
// the 16 rows 16 (w % (M / 16)) + 0..15 and the column tiles of 8 w / (M / 16) + (8 / (M / 16)) c;
// lane l its rows l / 4 and l / 4 + 8 there, columns 2 (l % 4) and 2 (l % 4) + 1 of each tile.
template <int M, int N>
struct MmaTile {
  static constexpr int MT = M / 16, NTL = N / 8, WN = NT / 32 / MT, TPW = NTL / WN;
  static_assert(MT * 16 == M && NTL * 8 == N && WN * MT == NT / 32 && TPW * WN == NTL, "MmaTile: the tiles do not divide the block");
  float v[TPW][4] = {};
  __device__ static int row0() { return 16 * (threadIdx.x / 32 % MT) + threadIdx.x % 32 / 4; }  // (and row0() + 8)
  __device__ static int warp_column() { return threadIdx.x / 32 / MT; }                          // (of WN)
  // f(i, j, v&) for each element the thread holds.
  template <class F>
  __device__ __forceinline__ void each(F f) {
    const int r = row0(), c0 = warp_column(), t = threadIdx.x % 4;
#pragma unroll
    for (int c = 0; c < TPW; ++c) {
      const int col = 8 * (c0 + WN * c) + 2 * t;
      f(r, col, v[c][0]);
      f(r, col + 1, v[c][1]);
      f(r + 8, col, v[c][2]);
      f(r + 8, col + 1, v[c][3]);
    }
  }
};

__device__ __forceinline__ unsigned tf32(float v) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
  return r;
}

// acc += a b, a(i, k) for i < M and b(k, j) for j < N read at k < K only (K need not be a
// multiple of 8), on the tensor cores: mma.sync m16n8k8 with tf32 operands (10-bit mantissas,
// rounded to nearest) and fp32 sums. Shared-memory strides: a row-major a(i, k) and a
// column-major b(k, j) read without bank conflicts at 4 mod 32, a column-major a and a row-major
// b at 8 mod 32.
template <int M, int N, class A, class B>
__device__ __forceinline__ void mma_add(MmaTile<M, N>& acc, int K, A a, B b) {
  using Tile = MmaTile<M, N>;
  const int r = Tile::row0(), c0 = Tile::warp_column(), g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  for (int k0 = 0; k0 < K; k0 += 8) {
    const bool v0 = k0 + t < K, v1 = k0 + t + 4 < K;
    const int k_0 = v0 ? k0 + t : K - 1, k_1 = v1 ? k0 + t + 4 : K - 1;  // (in range: read, then dropped)
    const unsigned a0 = tf32(v0 ? a(r, k_0) : 0.0f), a1 = tf32(v0 ? a(r + 8, k_0) : 0.0f);
    const unsigned a2 = tf32(v1 ? a(r, k_1) : 0.0f), a3 = tf32(v1 ? a(r + 8, k_1) : 0.0f);
#pragma unroll
    for (int c = 0; c < Tile::TPW; ++c) {
      const int col = 8 * (c0 + Tile::WN * c) + g;
      const unsigned b0 = tf32(v0 ? b(k_0, col) : 0.0f), b1 = tf32(v1 ? b(k_1, col) : 0.0f);
      asm volatile(
          "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
          "{%0, %1, %2, %3};\n"
          : "+f"(acc.v[c][0]), "+f"(acc.v[c][1]), "+f"(acc.v[c][2]), "+f"(acc.v[c][3])
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
  }
}

// out(i, j, sum_k a(i, k) b(k, j)) for i < M, j < N, k < K (mma_add's), each element once.
template <int M, int N, class A, class B, class Out>
__device__ __forceinline__ void block_mma(int K, A a, B b, Out out) {
  MmaTile<M, N> acc;
  mma_add(acc, K, a, b);
  acc.each([&](int i, int j, float& v) { out(i, j, v); });
}

// Where a window's chunk lies: its piece of a sequence, first token and length.
struct Span {
  i64 s, t0;
  int n;
};
// The piece holding window chunk `chunk`: the last with chunk_first <= chunk.
__device__ inline Span span_of(const Rule& r, i64 chunk) {
  i64 lo = 0, hi = r.sequences - 1;
  while (lo < hi) {
    const i64 mid = (lo + hi + 1) / 2;
    if (r.chunk_first[mid] <= chunk) lo = mid;
    else hi = mid - 1;
  }
  const i64 t0 = r.starts[lo] + (chunk - r.chunk_first[lo]) * C;
  return {lo, t0, static_cast<int>(imin(C, r.starts[lo + 1] - t0))};
}

// Shared memory of a chunk: K and Q rows ([C, dk + 1]), the cumulative decay G, exp(G),
// exp(G_last - G) and beta.
struct ChunkSmem {
  float *K, *Q, *G, *eG, *eL, *bt;
};
inline std::size_t chunk_floats(int dk, bool with_q = true) {
  return (with_q ? 2 : 1) * static_cast<std::size_t>(C) * (dk + 1) + 4 * C;
}
__device__ inline ChunkSmem carve_chunk(float*& p, int dk, bool with_q = true) {
  ChunkSmem m;
  m.K = p;
  m.Q = with_q ? m.K + C * (dk + 1) : nullptr;
  m.G = m.K + (with_q ? 2 : 1) * C * (dk + 1);
  m.eG = m.G + C;
  m.eL = m.eG + C;
  m.bt = m.eL + C;
  p = m.bt + C;
  return m;
}

// The decays of tokens [t0, t0 + n) of head h (zeros past n): g summed into G, exp(G),
// exp(G_last - G), beta. Ends synchronised.
__device__ inline void load_decays(const Rule& r, int h, i64 t0, int n, const ChunkSmem& m) {
  const int tid = threadIdx.x;
  if (tid < C) {
    m.G[tid] = tid < n ? r.g[(t0 + tid) * r.Hv + h] : 0.0f;
    m.bt[tid] = tid < n ? r.beta[(t0 + tid) * r.Hv + h] : 0.0f;
  }
  __syncthreads();
  if (tid < 32) {  // G = the inclusive prefix sums of g, a warp's scan of two halves
    float lo = m.G[tid], hi = m.G[tid + 32];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float a = __shfl_up_sync(kFull, lo, o), b = __shfl_up_sync(kFull, hi, o);
      if (tid >= o) {
        lo += a;
        hi += b;
      }
    }
    hi += __shfl_sync(kFull, lo, 31);
    m.G[tid] = lo;
    m.G[tid + 32] = hi;
  }
  __syncthreads();
  if (tid < C) {
    m.eG[tid] = expf(m.G[tid]);
    m.eL[tid] = expf(m.G[n - 1] - m.G[tid]);
  }
  __syncthreads();
}

// Head h's q (if q) or k rows of tokens [t0, t0 + n), row i times scale(i), into dst ([C, ds],
// zeros past n).
template <class Scale>
__device__ inline void stage_keys(const Rule& r, int h, i64 t0, int n, bool q, float* dst, int ds, Scale scale) {
  stage(dst, ds, r.c + t0 * r.cd + (q ? 0 : r.kd) + static_cast<i64>(r.key_head(h)) * r.dk, r.cd, C, n, r.dk, scale);
}

// Loads tokens [t0, t0 + n) of head h: K, Q (if with_q) and the decays. Ends synchronised.
__device__ inline void load_chunk(const Rule& r, int h, i64 t0, int n, const ChunkSmem& m, bool with_q = true) {
  const auto one = [](int) { return 1.0f; };
  if (with_q) stage_keys(r, h, t0, n, true, m.Q, r.dk + 1, one);
  stage_keys(r, h, t0, n, false, m.K, r.dk + 1, one);
  load_decays(r, h, t0, n, m);
}

// EK_ij = exp(G_i - G_j) k_i.k_j (j < i), M_ij = exp(G_i - G_j) q_i.k_j (j <= i); zero elsewhere
// and past n. A_ij = beta_i EK_ij. Either may be null. Ends synchronised.
__device__ inline void chunk_matrices(const Rule& r, int n, const ChunkSmem& m, float* EK, float* M) {
  const int ks = r.dk + 1;
  if (EK)
    block_mma<C, C>(
        r.dk, [&](int i, int x) { return m.K[i * ks + x]; }, [&](int x, int j) { return m.K[j * ks + x]; },
        [&](int i, int j, float v) { EK[i * CS + j] = i < n && j < i ? expf(m.G[i] - m.G[j]) * v : 0.0f; });
  if (M)
    block_mma<C, C>(
        r.dk, [&](int i, int x) { return m.Q[i * ks + x]; }, [&](int x, int j) { return m.K[j * ks + x]; },
        [&](int i, int j, float v) { M[i * CS + j] = i < n && j <= i ? expf(m.G[i] - m.G[j]) * v : 0.0f; });
  __syncthreads();
}

// Tile D ([C, BV], columns col0..) to or from rows t0.. of src/dst ([T, vd], head h's columns).
__device__ inline void store_tile(const Rule& r, const float* D, i64 t0, int n, int h, int col0, float* dst, int ds = VS) {
  for (int p = threadIdx.x; p < n * BV; p += NT) {
    const int i = p / BV, y = p % BV;
    if (col0 + y < r.dv) dst[(t0 + i) * r.vd() + static_cast<i64>(h) * r.dv + col0 + y] = D[i * ds + y];
  }
}
__device__ inline void load_tile(const Rule& r, const float* src, i64 t0, int n, int h, int col0, float* D, int ds = VS) {
  const int cols = r.dv - col0 < BV ? r.dv - col0 : BV;
  stage(D, ds, src + t0 * r.vd() + static_cast<i64>(h) * r.dv + col0, r.vd(), C, n, cols);
  if (cols < BV)
    for (int p = threadIdx.x; p < C * (BV - cols); p += NT) D[(p / (BV - cols)) * ds + cols + p % (BV - cols)] = 0.0f;
}
// A [dk, BV] state tile to or from states[chunk, h] ([dk, dv] each).
__device__ inline float* state_at(const Rule& r, float* states, i64 chunk, int h) {
  return states + (chunk * r.Hv + h) * static_cast<i64>(r.dk) * r.dv;
}
__device__ inline void store_state(const Rule& r, const float* S, int col0, float* dst, int ds = VS) {
  for (int p = threadIdx.x; p < r.dk * BV; p += NT) {
    const int x = p / BV, y = p % BV;
    if (col0 + y < r.dv) dst[static_cast<i64>(x) * r.dv + col0 + y] = S[x * ds + y];
  }
}
__device__ inline void load_state(const Rule& r, const float* src, int col0, float* S, int ds = VS) {
  const int cols = r.dv - col0 < BV ? r.dv - col0 : BV;
  stage(S, ds, src + col0, r.dv, r.dk, r.dk, cols);
  if (cols < BV)
    for (int p = threadIdx.x; p < r.dk * (BV - cols); p += NT) S[(p / (BV - cols)) * ds + cols + p % (BV - cols)] = 0.0f;
}

template <class K>
void allow_smem(K kernel, std::size_t bytes) {
  MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

}  // namespace megatrain::cuda::delta_rule::detail
