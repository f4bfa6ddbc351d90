// The chunked delta rule on the GPU (delta_rule.cuh; the math: backend/cpu/delta_rule.hpp, whose
// names these kernels keep). Chunk by chunk (C = 64 tokens), with G the chunk's cumulative decay,
// A_ij = beta_i exp(G_i - G_j) k_i.k_j (j < i) and M_ij = exp(G_i - G_j) q_i.k_j (j <= i):
//
//   forward     delta = (I + A)^-1 (beta (v - exp(G) K S))        forward substitution
//               o     = scale (exp(G) Q S + M delta)
//               S'    = exp(G_last) S + sum_j exp(G_last - G_j) k_j delta_j^T
//   state grad  ddelta = exp(G_last - G) K dS' + scale M^T dO,  dr = (I + A)^-T ddelta (back
//               substitution), dS = exp(G_last) dS' + scale Q^T (exp(G) dO) - K^T (beta exp(G) dr)
//   the rest    dq, dk, dg, dbeta of each chunk from its S, dS', delta and dr, summed over the
//               value columns a tile of 32 at a time (the CPU's Chunk::backward, term for term)
//
// The value columns are independent in the forward and the state's gradient, so those walks give
// a block each 32 columns of one head of one sequence; the state (dk x 32, fp32) stays in shared
// memory. CUDA cores in fp32 throughout: the products are small (64 x 64 x 128 a chunk).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "delta_rule.cuh"
#include "megatrain/core/cuda_check.hpp"

namespace megatrain::cuda::delta_rule {
namespace {

using namespace common;

constexpr int C = static_cast<int>(kDeltaRuleChunk);
constexpr int BV = 32;   // value columns a block (or a tile) of the delta rule
constexpr int NT = 256;  // threads a delta-rule block: 8 warps, 4 columns of the substitutions each
constexpr int DK = static_cast<int>(kDeltaRuleMaxKeyDim);
constexpr int VS = BV + 1;  // row stride of a [rows, BV] tile in shared memory
constexpr int CS = C + 1;   // row stride of a [C, C] matrix

__device__ __forceinline__ i64 imin(i64 a, i64 b) { return a < b ? a : b; }


// Shared memory of a chunk: K and Q rows, the cumulative decay and its exponentials, beta.
struct ChunkSmem {
  float *K, *Q, *G, *eG, *eL, *bt;
};

// Loads tokens [t0, t0 + n) of head h (zeros past n) and the decays; ends synchronised.
__device__ void load_chunk(const Rule& r, int h, i64 t0, int n, const ChunkSmem& m) {
  const int hk = r.key_head(h), ks = r.dk + 1, tid = threadIdx.x;
  for (int p = tid; p < C * r.dk; p += NT) {
    const int i = p / r.dk, x = p % r.dk;
    float qv = 0, kv = 0;
    if (i < n) {
      const float* row = r.c + (t0 + i) * r.cd;
      qv = row[hk * r.dk + x];
      kv = row[r.kd + hk * r.dk + x];
    }
    m.Q[i * ks + x] = qv;
    m.K[i * ks + x] = kv;
  }
  if (tid < C) {
    m.G[tid] = tid < n ? r.g[(t0 + tid) * r.Hv + h] : 0.0f;
    m.bt[tid] = tid < n ? r.beta[(t0 + tid) * r.Hv + h] : 0.0f;
  }
  __syncthreads();
  if (tid == 0) {
    float acc = 0;
    for (int i = 0; i < C; ++i) m.G[i] = acc += m.G[i];
  }
  __syncthreads();
  if (tid < C) {
    m.eG[tid] = expf(m.G[tid]);
    m.eL[tid] = expf(m.G[n - 1] - m.G[tid]);
  }
  __syncthreads();
}

// EK_ij = exp(G_i - G_j) k_i.k_j (j < i), M_ij = exp(G_i - G_j) q_i.k_j (j <= i); zero elsewhere.
// A_ij = beta_i EK_ij. Ends synchronised.
__device__ void chunk_matrices(const Rule& r, int n, const ChunkSmem& m, float* EK, float* M) {
  const int ks = r.dk + 1;
  for (int p = threadIdx.x; p < C * C; p += NT) {
    const int i = p / C, j = p % C;
    float ek = 0, mm = 0;
    if (i < n && j <= i) {
      float qk = 0, kk = 0;
      for (int x = 0; x < r.dk; ++x) {
        const float kj = m.K[j * ks + x];
        qk += m.Q[i * ks + x] * kj;
        kk += m.K[i * ks + x] * kj;
      }
      const float e = expf(m.G[i] - m.G[j]);
      mm = e * qk;
      if (j < i) ek = e * kk;
    }
    EK[i * CS + j] = ek;
    M[i * CS + j] = mm;
  }
  __syncthreads();
}

// The substitutions over a [C, BV] tile D, 8 threads a column (one warp holds 4 whole columns):
// lower: D := (I + A)^-1 D; upper: D := (I + A)^-T D.
__device__ void solve_lower(int n, const float* EK, const float* bt, float* D) {
  const int lane = threadIdx.x % 32, y = (threadIdx.x / 32) * 4 + lane / 8, part = lane % 8;
  for (int i = 1; i < n; ++i) {
    float s = 0;
    for (int l = part; l < i; l += 8) s += EK[i * CS + l] * D[l * VS + y];
    s += __shfl_xor_sync(kFull, s, 1);
    s += __shfl_xor_sync(kFull, s, 2);
    s += __shfl_xor_sync(kFull, s, 4);
    if (part == 0) D[i * VS + y] -= bt[i] * s;
    __syncwarp();
  }
}
__device__ void solve_upper(int n, const float* EK, const float* bt, float* D) {
  const int lane = threadIdx.x % 32, y = (threadIdx.x / 32) * 4 + lane / 8, part = lane % 8;
  for (int l = n - 2; l >= 0; --l) {
    float s = 0;
    for (int i = l + 1 + part; i < n; i += 8) s += bt[i] * EK[i * CS + l] * D[i * VS + y];
    s += __shfl_xor_sync(kFull, s, 1);
    s += __shfl_xor_sync(kFull, s, 2);
    s += __shfl_xor_sync(kFull, s, 4);
    if (part == 0) D[l * VS + y] -= s;
    __syncwarp();
  }
}

// Writes rows [0, n) of tile D (columns col0..) to dst ([T, vd], head h's columns), or loads them.
__device__ void store_tile(const Rule& r, const float* D, i64 t0, int n, int h, int col0, float* dst) {
  for (int p = threadIdx.x; p < n * BV; p += NT) {
    const int i = p / BV, y = p % BV;
    if (col0 + y < r.dv) dst[(t0 + i) * r.vd() + static_cast<i64>(h) * r.dv + col0 + y] = D[i * VS + y];
  }
}
__device__ void load_tile(const Rule& r, const float* src, i64 t0, int n, int h, int col0, float* D) {
  for (int p = threadIdx.x; p < C * BV; p += NT) {
    const int i = p / BV, y = p % BV;
    D[i * VS + y] = i < n && col0 + y < r.dv ? src[(t0 + i) * r.vd() + static_cast<i64>(h) * r.dv + col0 + y] : 0.0f;
  }
}
// A [dk, BV] state tile to or from states[chunk, h] ([dk, dv] each).
__device__ float* state_at(const Rule& r, float* states, i64 chunk, int h) {
  return states + (chunk * r.Hv + h) * static_cast<i64>(r.dk) * r.dv;
}
__device__ void store_state(const Rule& r, const float* S, int col0, float* dst) {
  for (int p = threadIdx.x; p < r.dk * BV; p += NT) {
    const int x = p / BV, y = p % BV;
    if (col0 + y < r.dv) dst[static_cast<i64>(x) * r.dv + col0 + y] = S[x * VS + y];
  }
}
__device__ void load_state(const Rule& r, const float* src, int col0, float* S) {
  for (int p = threadIdx.x; p < r.dk * BV; p += NT) {
    const int x = p / BV, y = p % BV;
    S[x * VS + y] = col0 + y < r.dv ? src[static_cast<i64>(x) * r.dv + col0 + y] : 0.0f;
  }
}

std::size_t chunk_floats(int dk) { return 2 * static_cast<std::size_t>(C) * (dk + 1) + 4 * C; }
__device__ ChunkSmem carve_chunk(float*& p, int dk) {
  ChunkSmem m;
  m.K = p;
  m.Q = m.K + C * (dk + 1);
  m.G = m.Q + C * (dk + 1);
  m.eG = m.G + C;
  m.eL = m.eG + C;
  m.bt = m.eL + C;
  p = m.bt + C;
  return m;
}

std::size_t forward_smem(int dk) { return (chunk_floats(dk) + static_cast<std::size_t>(dk) * VS + C * VS + 2 * C * CS) * 4; }

// Block (sequence, value head, 32 columns): o (bf16, if not null), each chunk's starting state
// (if not null) and delta (if not null).
__global__ void __launch_bounds__(NT) delta_forward_kernel(Rule r, bf* o, float* states, float* delta) {
  extern __shared__ float sm[];
  float* p = sm;
  const ChunkSmem m = carve_chunk(p, r.dk);
  float *S = p, *D = S + r.dk * VS, *EK = D + C * VS, *M = EK + C * CS;
  const int s = blockIdx.x, h = blockIdx.y, col0 = blockIdx.z * BV, ks = r.dk + 1;
  for (int q = threadIdx.x; q < r.dk * VS; q += NT) S[q] = 0;
  __syncthreads();
  if (r.carry_in && s == 0) load_state(r, r.state_in + static_cast<i64>(h) * r.dk * r.dv, col0, S);
  const i64 t_end = r.starts[s + 1];
  i64 chunk = r.chunk_first[s];
  for (i64 t0 = r.starts[s]; t0 < t_end; t0 += C, ++chunk) {
    const int n = static_cast<int>(imin(C, t_end - t0));
    __syncthreads();
    if (states) store_state(r, S, col0, state_at(r, states, chunk, h));
    load_chunk(r, h, t0, n, m);
    chunk_matrices(r, n, m, EK, M);
    for (int q = threadIdx.x; q < C * BV; q += NT) {  // r = beta (v - exp(G) K S)
      const int i = q / BV, y = q % BV;
      float rv = 0;
      if (i < n && col0 + y < r.dv) {
        float sk = 0;
        for (int x = 0; x < r.dk; ++x) sk += m.K[i * ks + x] * S[x * VS + y];
        const float v = r.c[(t0 + i) * r.cd + 2 * r.kd + static_cast<i64>(h) * r.dv + col0 + y];
        rv = m.bt[i] * (v - m.eG[i] * sk);
      }
      D[i * VS + y] = rv;
    }
    __syncthreads();
    solve_lower(n, EK, m.bt, D);
    __syncthreads();
    if (delta) store_tile(r, D, t0, n, h, col0, delta);
    if (o) {
      for (int q = threadIdx.x; q < n * BV; q += NT) {
        const int i = q / BV, y = q % BV;
        if (col0 + y >= r.dv) continue;
        float qs = 0;
        for (int x = 0; x < r.dk; ++x) qs += m.Q[i * ks + x] * S[x * VS + y];
        float acc = m.eG[i] * qs;
        for (int j = 0; j <= i; ++j) acc += M[i * CS + j] * D[j * VS + y];
        o[(t0 + i) * r.vd() + static_cast<i64>(h) * r.dv + col0 + y] = __float2bfloat16(r.scale * acc);
      }
    }
    __syncthreads();
    for (int q = threadIdx.x; q < r.dk * BV; q += NT) {  // S' = exp(G_last) S + sum_j exp(G_last - G_j) k_j delta_j
      const int x = q / BV, y = q % BV;
      float acc = m.eG[n - 1] * S[x * VS + y];
      for (int j = 0; j < n; ++j) acc += m.eL[j] * m.K[j * ks + x] * D[j * VS + y];
      S[x * VS + y] = acc;
    }
  }
  __syncthreads();
  if (r.carry_out && s == r.sequences - 1) store_state(r, S, col0, r.state_out + static_cast<i64>(h) * r.dk * r.dv);
}

std::size_t state_grad_smem(int dk) { return (chunk_floats(dk) + static_cast<std::size_t>(dk) * VS + 2 * C * VS + 2 * C * CS) * 4; }

// Block (sequence, value head, 32 columns), the chunks in reverse: each chunk's end-state
// gradient into dstates, dr into dr. (Carries: state_in is the gradient of the state at the
// window's end, state_out that at its start.)
__global__ void __launch_bounds__(NT) delta_state_grad_kernel(Rule r, const float* dO, float* dstates, float* dr) {
  extern __shared__ float sm[];
  float* p = sm;
  const ChunkSmem m = carve_chunk(p, r.dk);
  float *dS = p, *DO = dS + r.dk * VS, *DD = DO + C * VS, *EK = DD + C * VS, *M = EK + C * CS;
  const int s = blockIdx.x, h = blockIdx.y, col0 = blockIdx.z * BV, ks = r.dk + 1;
  for (int q = threadIdx.x; q < r.dk * VS; q += NT) dS[q] = 0;
  __syncthreads();
  if (r.carry_out && s == r.sequences - 1) load_state(r, r.state_in + static_cast<i64>(h) * r.dk * r.dv, col0, dS);
  const i64 t_begin = r.starts[s], t_end = r.starts[s + 1];
  const i64 count = (t_end - t_begin + C - 1) / C;
  for (i64 jc = count - 1; jc >= 0; --jc) {
    const i64 t0 = t_begin + jc * C;
    const int n = static_cast<int>(imin(C, t_end - t0));
    __syncthreads();
    store_state(r, dS, col0, state_at(r, dstates, r.chunk_first[s] + jc, h));
    load_chunk(r, h, t0, n, m);
    chunk_matrices(r, n, m, EK, M);
    load_tile(r, dO, t0, n, h, col0, DO);
    __syncthreads();
    for (int q = threadIdx.x; q < C * BV; q += NT) {  // ddelta = exp(G_last - G) K dS + scale M^T dO
      const int j = q / BV, y = q % BV;
      float acc = 0;
      if (j < n) {
        float kd = 0, md = 0;
        for (int x = 0; x < r.dk; ++x) kd += m.K[j * ks + x] * dS[x * VS + y];
        for (int i = j; i < n; ++i) md += M[i * CS + j] * DO[i * VS + y];
        acc = m.eL[j] * kd + r.scale * md;
      }
      DD[j * VS + y] = acc;
    }
    __syncthreads();
    solve_upper(n, EK, m.bt, DD);
    __syncthreads();
    store_tile(r, DD, t0, n, h, col0, dr);
    for (int q = threadIdx.x; q < r.dk * BV; q += NT) {  // dS = exp(G_last) dS' + Q^T (scale exp(G) dO) - K^T (beta exp(G) dr)
      const int x = q / BV, y = q % BV;
      float acc = m.eG[n - 1] * dS[x * VS + y];
      for (int i = 0; i < n; ++i)
        acc += m.eG[i] * (r.scale * m.Q[i * ks + x] * DO[i * VS + y] - m.bt[i] * m.K[i * ks + x] * DD[i * VS + y]);
      dS[x * VS + y] = acc;
    }
  }
  __syncthreads();
  if (r.carry_in && s == 0) store_state(r, dS, col0, r.state_out + static_cast<i64>(h) * r.dk * r.dv);
}

std::size_t chunk_grad_smem(int dk) {
  return (chunk_floats(dk) + 2 * static_cast<std::size_t>(dk) * VS + 3 * C * VS + 4 * C * CS + 5 * C + NT) * 4;
}

constexpr int kRegs = DK / 4;  // key elements a thread of chunk_grad_kernel holds (x = lane % 4 + 4 m)

// chunk_grad_kernel's shared memory beside the chunk's: the tiles of a column slice, the chunk's
// matrices, the sums over the slices (DD = dO delta^T, DA = -dr delta^T, per-row sums).
struct GradSmem {
  float *St, *dSt, *Dl, *Rr, *DOt;  // S, dS ([dk, BV]); delta, dr, dO ([C, BV])
  float *EK, *M, *DD, *DA;          // [C, C]
  float *dbp, *dskp, *inter, *kt, *dG, *red;
};
__device__ GradSmem carve_grad(float* p, int dk) {
  GradSmem g;
  g.St = p;
  g.dSt = g.St + dk * VS;
  g.Dl = g.dSt + dk * VS;
  g.Rr = g.Dl + C * VS;
  g.DOt = g.Rr + C * VS;
  g.EK = g.DOt + C * VS;
  g.M = g.EK + C * CS;
  g.DD = g.M + C * CS;
  g.DA = g.DD + C * CS;
  g.dbp = g.DA + C * CS;
  g.dskp = g.dbp + C;
  g.inter = g.dskp + C;
  g.kt = g.inter + C;
  g.dG = g.kt + C;
  g.red = g.dG + C;
  return g;
}

// The sequence holding window chunk `chunk`: the last with chunk_first <= chunk.
__device__ i64 sequence_of(const Rule& r, i64 chunk) {
  i64 lo = 0, hi = r.sequences - 1;
  while (lo < hi) {
    const i64 mid = (lo + hi + 1) / 2;
    if (r.chunk_first[mid] <= chunk) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// One slice of value columns (its tiles loaded): S dO_i, dS delta_i and S dr_i into a thread's
// registers (its row, x = xo + 4 k), DD and DA, the rows' dr.(v - exp(G) S^T k) and dr.S^T k, <S, dS>.
__device__ void slice_products(const Rule& r, const ChunkSmem& m, const GradSmem& g, i64 t0, int n, int h, int col0,
                               float (&aq)[kRegs], float (&ap)[kRegs], float (&ar)[kRegs], float& sds) {
  const int tid = threadIdx.x, row = tid / 4, xo = tid % 4, ks = r.dk + 1;
  for (int y = 0; y < BV; ++y) {
    const float o_ = g.DOt[row * VS + y], d_ = g.Dl[row * VS + y], r_ = g.Rr[row * VS + y];
#pragma unroll
    for (int k = 0; k < kRegs; ++k) {
      const int x = xo + 4 * k;
      if (x < r.dk) {
        const float sv = g.St[x * VS + y];
        aq[k] += o_ * sv;
        ap[k] += d_ * g.dSt[x * VS + y];
        ar[k] += r_ * sv;
      }
    }
  }
  for (int q = tid; q < C * C; q += NT) {  // DD += dO delta^T (j <= i), DA -= dr delta^T (j < i)
    const int i = q / C, j = q % C;
    if (i >= n || j > i) continue;
    float dd = 0, da = 0;
    for (int y = 0; y < BV; ++y) {
      dd += g.DOt[i * VS + y] * g.Dl[j * VS + y];
      da += g.Rr[i * VS + y] * g.Dl[j * VS + y];
    }
    g.DD[i * CS + j] += dd;
    if (j < i) g.DA[i * CS + j] -= da;
  }
  for (int q = tid; q < C * BV; q += NT) {  // a warp a row: dr_i . (v_i - exp(G_i) S^T k_i), dr_i . S^T k_i
    const int i = q / BV, y = q % BV;
    float c1 = 0, c2 = 0;
    if (i < n && col0 + y < r.dv) {
      float sk = 0;
      for (int x = 0; x < r.dk; ++x) sk += m.K[i * ks + x] * g.St[x * VS + y];
      const float v = r.c[(t0 + i) * r.cd + 2 * r.kd + static_cast<i64>(h) * r.dv + col0 + y];
      c1 = g.Rr[i * VS + y] * (v - m.eG[i] * sk);
      c2 = g.Rr[i * VS + y] * sk;
    }
    c1 = warp_sum(c1);
    c2 = warp_sum(c2);
    if (y == 0) {
      g.dbp[i] += c1;
      g.dskp[i] += c2;
    }
  }
  for (int q = tid; q < r.dk * BV; q += NT) sds += g.St[(q / BV) * VS + q % BV] * g.dSt[(q / BV) * VS + q % BV];
}

// dq_i = scale exp(G_i) S dO_i + sum_j D_ij k_j, D_ij = scale exp(G_i - G_j) dO_i.delta_j (j <= i);
// dk_r = exp(G_last - G_r) dS delta_r - beta_r exp(G_r) S dr_r + sum_i D_ir q_i + sum_j (E + E^T)_rj k_j,
// E_ij = DA_ij beta_i exp(G_i - G_j) (j < i). Written for the thread's row (its 4 lanes' elements).
__device__ void write_dq_dk(const Rule& r, const ChunkSmem& m, const GradSmem& g, i64 t0, int n, int h,
                            float (&aq)[kRegs], float (&ap)[kRegs], const float (&ar)[kRegs], float* dq, float* dk) {
  const int i = threadIdx.x / 4, xo = threadIdx.x % 4, ks = r.dk + 1;
#pragma unroll
  for (int k = 0; k < kRegs; ++k) {
    aq[k] *= r.scale * m.eG[i];
    ap[k] = m.eL[i] * ap[k] - m.bt[i] * m.eG[i] * ar[k];
  }
  for (int j = 0; j < n; ++j) {
    const float e_ij = j <= i ? expf(m.G[i] - m.G[j]) : 0.0f, e_ji = i <= j ? expf(m.G[j] - m.G[i]) : 0.0f;
    const float d_ij = r.scale * e_ij * g.DD[i * CS + j];                          // D_ij (j <= i)
    const float d_ji = r.scale * e_ji * g.DD[j * CS + i];                          // D_ji (i <= j)
    const float e = g.DA[i * CS + j] * m.bt[i] * e_ij + g.DA[j * CS + i] * m.bt[j] * e_ji;  // (E + E^T)_ij
#pragma unroll
    for (int k = 0; k < kRegs; ++k) {
      const int x = xo + 4 * k;
      if (x < r.dk) {
        const float kj = m.K[j * ks + x];
        aq[k] += d_ij * kj;
        ap[k] += d_ji * m.Q[j * ks + x] + e * kj;
      }
    }
  }
  if (i >= n) return;
  float* dqr = dq + ((t0 + i) * r.Hv + h) * static_cast<i64>(r.dk);
  float* dkr = dk + ((t0 + i) * r.Hv + h) * static_cast<i64>(r.dk);
#pragma unroll
  for (int k = 0; k < kRegs; ++k) {
    const int x = xo + 4 * k;
    if (x < r.dk) {
      dqr[x] = aq[k];
      dkr[x] = ap[k];
    }
  }
}

// dG and dbeta of row ir (a thread a row), from the sums over the slices; g.red[0] = <S, dS>.
__device__ void gate_grads(const Rule& r, const ChunkSmem& m, const GradSmem& g, i64 t0, int n, int h, int ir,
                           float* dbeta) {
  float dgi = 0, dbi = g.dbp[ir];
  if (ir < n) {
    dgi = r.scale * m.eG[ir] * g.inter[ir] - m.bt[ir] * m.eG[ir] * g.dskp[ir] - m.eL[ir] * g.kt[ir];
    for (int j = 0; j < n; ++j) {
      if (j <= ir) dgi += r.scale * g.DD[ir * CS + j] * g.M[ir * CS + j];  // W_ij = D_ij q_i.k_j
      if (j >= ir) dgi -= r.scale * g.DD[j * CS + ir] * g.M[j * CS + ir];
      if (j < ir) {
        dgi += g.DA[ir * CS + j] * m.bt[ir] * g.EK[ir * CS + j];  // DA_ij A_ij
        dbi += g.DA[ir * CS + j] * g.EK[ir * CS + j];
      }
      if (j > ir) dgi -= g.DA[j * CS + ir] * m.bt[j] * g.EK[j * CS + ir];
    }
    if (ir == n - 1) {
      for (int j = 0; j < n; ++j) dgi += m.eL[j] * g.kt[j];
      dgi += m.eG[n - 1] * g.red[0];
    }
    dbeta[(t0 + ir) * r.Hv + h] = dbi;
  }
  g.dG[ir] = dgi;
}

// Block (chunk, value head): dq and dk of this value head ([T, Hv, dk] each), dg and dbeta.
__global__ void __launch_bounds__(NT) chunk_grad_kernel(Rule r, const float* states, const float* dstates,
                                                         const float* delta, const float* dr, const float* dO, float* dq,
                                                         float* dk, float* dg, float* dbeta) {
  extern __shared__ float sm[];
  float* p = sm;
  const ChunkSmem m = carve_chunk(p, r.dk);
  const GradSmem g = carve_grad(p, r.dk);
  const i64 chunk = blockIdx.x, s = sequence_of(r, chunk);
  const int h = blockIdx.y, ks = r.dk + 1, tid = threadIdx.x, row = tid / 4, xo = tid % 4;
  const i64 t0 = r.starts[s] + (chunk - r.chunk_first[s]) * C;
  const int n = static_cast<int>(imin(C, r.starts[s + 1] - t0));
  load_chunk(r, h, t0, n, m);
  chunk_matrices(r, n, m, g.EK, g.M);
  for (int q = tid; q < C * CS; q += NT) g.DD[q] = g.DA[q] = 0;
  if (tid < C) g.dbp[tid] = g.dskp[tid] = 0;
  float aq[kRegs], ap[kRegs], ar[kRegs];  // S dO_i, dS delta_i, S dr_i at x = xo + 4 k
#pragma unroll
  for (int k = 0; k < kRegs; ++k) aq[k] = ap[k] = ar[k] = 0;
  float sds = 0;  // <S, dS>
  for (int col0 = 0; col0 < r.dv; col0 += BV) {
    __syncthreads();
    load_state(r, state_at(r, const_cast<float*>(states), chunk, h), col0, g.St);
    load_state(r, state_at(r, const_cast<float*>(dstates), chunk, h), col0, g.dSt);
    load_tile(r, delta, t0, n, h, col0, g.Dl);
    load_tile(r, dr, t0, n, h, col0, g.Rr);
    load_tile(r, dO, t0, n, h, col0, g.DOt);
    __syncthreads();
    slice_products(r, m, g, t0, n, h, col0, aq, ap, ar, sds);
  }
  g.red[tid] = sds;
  __syncthreads();
  // q_i . (S dO_i) and k_i . (dS delta_i): the 4 lanes of a row hold its key elements.
  float it = 0, kt_ = 0;
#pragma unroll
  for (int k = 0; k < kRegs; ++k) {
    const int x = xo + 4 * k;
    if (x < r.dk) {
      it += m.Q[row * ks + x] * aq[k];
      kt_ += m.K[row * ks + x] * ap[k];
    }
  }
  it += __shfl_xor_sync(kFull, it, 1);
  it += __shfl_xor_sync(kFull, it, 2);
  kt_ += __shfl_xor_sync(kFull, kt_, 1);
  kt_ += __shfl_xor_sync(kFull, kt_, 2);
  if (xo == 0) {
    g.inter[row] = it;
    g.kt[row] = kt_;
  }
  if (tid == 0) {
    float sum = 0;
    for (int q = 0; q < NT; ++q) sum += g.red[q];
    g.red[0] = sum;
  }
  __syncthreads();
  write_dq_dk(r, m, g, t0, n, h, aq, ap, ar, dq, dk);
  if (tid < C) gate_grads(r, m, g, t0, n, h, tid, dbeta);  // (a thread a row, not the 4-lane rows above)
  __syncthreads();
  if (tid == 0) {  // dg = the suffix sums of dG (G = cumsum(g))
    float acc = 0;
    for (int q = n - 1; q >= 0; --q) {
      acc += g.dG[q];
      dg[(t0 + q) * r.Hv + h] = acc;
    }
  }
}

template <class K>
void allow_smem(K kernel, std::size_t bytes) {
  MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

dim3 walk_grid(const Rule& r) {
  return dim3(static_cast<unsigned>(r.sequences), static_cast<unsigned>(r.Hv), static_cast<unsigned>((r.dv + BV - 1) / BV));
}

}  // namespace

void forward(const Rule& r, bf* o, float* states, float* delta, cudaStream_t stream) {
  const std::size_t smem = forward_smem(r.dk);
  allow_smem(delta_forward_kernel, smem);
  delta_forward_kernel<<<walk_grid(r), NT, smem, stream>>>(r, o, states, delta);
  MT_CUDA_CHECK_LAUNCH("delta_forward_kernel");
}

void state_grad(const Rule& r, const float* dO, float* dstates, float* dr, cudaStream_t stream) {
  const std::size_t smem = state_grad_smem(r.dk);
  allow_smem(delta_state_grad_kernel, smem);
  delta_state_grad_kernel<<<walk_grid(r), NT, smem, stream>>>(r, dO, dstates, dr);
  MT_CUDA_CHECK_LAUNCH("delta_state_grad_kernel");
}

void chunk_grad(const Rule& r, i64 chunks, const float* states, const float* dstates, const float* delta, const float* dr,
                const float* dO, float* dq, float* dk, float* dg, float* dbeta, cudaStream_t stream) {
  const std::size_t smem = chunk_grad_smem(r.dk);
  allow_smem(chunk_grad_kernel, smem);
  chunk_grad_kernel<<<dim3(static_cast<unsigned>(chunks), static_cast<unsigned>(r.Hv)), NT, smem, stream>>>(
      r, states, dstates, delta, dr, dO, dq, dk, dg, dbeta);
  MT_CUDA_CHECK_LAUNCH("chunk_grad_kernel");
}

}  // namespace megatrain::cuda::delta_rule
