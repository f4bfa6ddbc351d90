// Each chunk's q, k, g and beta gradients on the GPU (delta_rule.cuh), from the chunk's starting
// state S, its end-state gradient dS', delta and dr (the walks of delta_rule.cu) and dO; the
// CPU's Chunk::backward (backend/cpu/delta_rule.hpp) term for term. A block a chunk and value
// head; the value columns a tile of 32 at a time, their sums over the tiles kept in shared memory.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "delta_rule_chunk.cuh"

namespace megatrain::cuda::delta_rule {
namespace {

using namespace detail;

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
  const i64 chunk = blockIdx.x;
  const Span sp = span_of(r, chunk);
  const i64 t0 = sp.t0;
  const int n = sp.n, h = blockIdx.y, ks = r.dk + 1, tid = threadIdx.x, row = tid / 4, xo = tid % 4;
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

}  // namespace

void chunk_grad(const Rule& r, i64 chunks, const float* states, const float* dstates, const float* delta, const float* dr,
                const float* dO, float* dq, float* dk, float* dg, float* dbeta, cudaStream_t stream) {
  const std::size_t smem = chunk_grad_smem(r.dk);
  allow_smem(chunk_grad_kernel, smem);
  chunk_grad_kernel<<<dim3(static_cast<unsigned>(chunks), static_cast<unsigned>(r.Hv)), NT, smem, stream>>>(
      r, states, dstates, delta, dr, dO, dq, dk, dg, dbeta);
  MT_CUDA_CHECK_LAUNCH("chunk_grad_kernel");
}

}  // namespace megatrain::cuda::delta_rule
