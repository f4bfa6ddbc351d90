// Each chunk's q, k, g and beta gradients on the GPU (delta_rule.cuh), from the chunk's starting
// state S, its end-state gradient dS', delta and dr (the walks of delta_rule.cu) and dO; the
// CPU's Chunk::backward (backend/cpu/delta_rule.hpp) term for term. A block a chunk and value
// head; the value columns a tile of 32 at a time, their sums over the tiles kept in registers
// ([C, dk] products) and shared memory ([C, C] ones). The products run on the tensor cores
// (delta_rule_chunk.cuh: tf32 operands, fp32 sums).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "delta_rule_chunk.cuh"

namespace megatrain::cuda::delta_rule {
namespace {

using namespace detail;

std::size_t chunk_grad_smem(int dk) {
  return (chunk_floats(dk) + 2 * static_cast<std::size_t>(dk) * VS + 4 * C * VS + 4 * C * CS + 5 * C + NT) * 4;
}

// A [C, dk] sum over the slices: S dO_i, dS delta_i or S dr_i (row i, key element x), and then
// dq or dk. Two warps share each row (row_dots relies on it).
using RowTile = MmaTile<C, DK>;
static_assert(RowTile::WN == 2, "row_dots adds two warps' parts of a row, an order-free sum");

// chunk_grad_kernel's shared memory beside the chunk's: the tiles of a column slice, the chunk's
// matrices, the sums over the slices (DD = dO delta^T, DA = -dr delta^T, per-row sums).
struct GradSmem {
  float *St, *dSt, *Dl, *Rr, *DOt, *SK;  // S, dS ([dk, BV]); delta, dr, dO, K S ([C, BV])
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
  g.SK = g.DOt + C * VS;
  g.EK = g.SK + C * VS;
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

// One slice of value columns (its tiles loaded): S dO_i, dS delta_i and S dr_i added to the row
// tiles, DD and DA, the rows' dr.(v - exp(G) S^T k) and dr.S^T k, <S, dS>.
__device__ void slice_products(const Rule& r, const ChunkSmem& m, const GradSmem& g, i64 t0, int n, int h, int col0,
                               RowTile& aq, RowTile& ap, RowTile& ar, float& sds) {
  const int tid = threadIdx.x, ks = r.dk + 1;
  const auto s_t = [&](int y, int x) { return x < r.dk ? g.St[x * VS + y] : 0.0f; };
  mma_add(aq, BV, [&](int i, int y) { return g.DOt[i * VS + y]; }, s_t);
  mma_add(ap, BV, [&](int i, int y) { return g.Dl[i * VS + y]; }, [&](int y, int x) { return x < r.dk ? g.dSt[x * VS + y] : 0.0f; });
  mma_add(ar, BV, [&](int i, int y) { return g.Rr[i * VS + y]; }, s_t);
  const auto delta_t = [&](int y, int j) { return g.Dl[j * VS + y]; };
  block_mma<C, C>(  // DD += dO delta^T (j <= i)
      BV, [&](int i, int y) { return g.DOt[i * VS + y]; }, delta_t, [&](int i, int j, float v) {
        if (i < n && j <= i) g.DD[i * CS + j] += v;
      });
  block_mma<C, C>(  // DA -= dr delta^T (j < i)
      BV, [&](int i, int y) { return g.Rr[i * VS + y]; }, delta_t, [&](int i, int j, float v) {
        if (i < n && j < i) g.DA[i * CS + j] -= v;
      });
  block_mma<C, BV>(  // SK = K S
      r.dk, [&](int i, int x) { return m.K[i * ks + x]; }, [&](int x, int y) { return g.St[x * VS + y]; },
      [&](int i, int y, float v) { g.SK[i * VS + y] = v; });
  __syncthreads();
  for (int q = tid; q < C * BV; q += NT) {  // a warp a row: dr_i . (v_i - exp(G_i) S^T k_i), dr_i . S^T k_i
    const int i = q / BV, y = q % BV;
    float c1 = 0, c2 = 0;
    if (i < n && col0 + y < r.dv) {
      const float sk = g.SK[i * VS + y];
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

// out[i] = sum_x f(i, x) acc(i, x) for the tile's rows (out zeroed before): a thread's part of
// its two rows, the four lanes of a row summed, the two warps of a row added (in either order,
// the same sum).
template <class F>
__device__ void row_dots(RowTile& acc, F f, float* out) {
  const int r0 = RowTile::row0();
  float lo = 0, hi = 0;
  acc.each([&](int i, int x, float& v) { (i == r0 ? lo : hi) += f(i, x) * v; });
  lo += __shfl_xor_sync(kFull, lo, 1);
  lo += __shfl_xor_sync(kFull, lo, 2);
  hi += __shfl_xor_sync(kFull, hi, 1);
  hi += __shfl_xor_sync(kFull, hi, 2);
  if (threadIdx.x % 4 == 0) {
    atomicAdd(&out[r0], lo);
    atomicAdd(&out[r0 + 8], hi);
  }
}

// dq_i = scale exp(G_i) S dO_i + sum_j D_ij k_j, D_ij = scale exp(G_i - G_j) dO_i.delta_j (j <= i);
// dk_r = exp(G_last - G_r) dS delta_r - beta_r exp(G_r) S dr_r + sum_i D_ir q_i + sum_j (E + E^T)_rj k_j,
// E_ij = DA_ij beta_i exp(G_i - G_j) (j < i). The tiles' elements as the threads hold them.
__device__ void write_dq_dk(const Rule& r, const ChunkSmem& m, const GradSmem& g, i64 t0, int n, int h, RowTile& aq,
                            RowTile& ap, const RowTile& ar, float* dq, float* dk) {
  const int ks = r.dk + 1, r0 = RowTile::row0();
#pragma unroll
  for (int c = 0; c < RowTile::TPW; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // (the same element of each tile: its row r0, or r0 + 8 for e >= 2)
      const int i = e < 2 ? r0 : r0 + 8;
      aq.v[c][e] *= r.scale * m.eG[i];
      ap.v[c][e] = m.eL[i] * ap.v[c][e] - m.bt[i] * m.eG[i] * ar.v[c][e];
    }
  // (the decays' exponents only where they are <= 0: G falls along the chunk)
  const auto k_of = [&](int j, int x) { return x < r.dk ? m.K[j * ks + x] : 0.0f; };
  mma_add(aq, C, [&](int i, int j) { return j <= i ? r.scale * expf(m.G[i] - m.G[j]) * g.DD[i * CS + j] : 0.0f; }, k_of);
  mma_add(ap, C, [&](int i, int j) { return i <= j ? r.scale * expf(m.G[j] - m.G[i]) * g.DD[j * CS + i] : 0.0f; },
          [&](int j, int x) { return x < r.dk ? m.Q[j * ks + x] : 0.0f; });
  mma_add(ap, C, [&](int i, int j) {  // (E + E^T)_ij
    return j < i ? g.DA[i * CS + j] * m.bt[i] * expf(m.G[i] - m.G[j]) : i < j ? g.DA[j * CS + i] * m.bt[j] * expf(m.G[j] - m.G[i]) : 0.0f;
  }, k_of);
  const auto row = [&](float* out, int i) { return out + ((t0 + i) * r.Hv + h) * static_cast<i64>(r.dk); };
  aq.each([&](int i, int x, float& v) {
    if (i < n && x < r.dk) row(dq, i)[x] = v;
  });
  ap.each([&](int i, int x, float& v) {
    if (i < n && x < r.dk) row(dk, i)[x] = v;
  });
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
  const int n = sp.n, h = blockIdx.y, ks = r.dk + 1, tid = threadIdx.x;
  load_chunk(r, h, t0, n, m);
  chunk_matrices(r, n, m, g.EK, g.M);
  for (int q = tid; q < C * CS; q += NT) g.DD[q] = g.DA[q] = 0;
  if (tid < C) g.dbp[tid] = g.dskp[tid] = 0;
  RowTile aq, ap, ar;  // S dO_i, dS delta_i, S dr_i
  float sds = 0;       // <S, dS>
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
  if (tid < C) g.inter[tid] = g.kt[tid] = 0;
  __syncthreads();
  // q_i . (S dO_i) and k_i . (dS delta_i)
  row_dots(aq, [&](int i, int x) { return x < r.dk ? m.Q[i * ks + x] : 0.0f; }, g.inter);
  row_dots(ap, [&](int i, int x) { return x < r.dk ? m.K[i * ks + x] : 0.0f; }, g.kt);
  if (tid == 0) {
    float sum = 0;
    for (int q = 0; q < NT; ++q) sum += g.red[q];
    g.red[0] = sum;
  }
  __syncthreads();
  write_dq_dk(r, m, g, t0, n, h, aq, ap, ar, dq, dk);
  if (tid < C) gate_grads(r, m, g, t0, n, h, tid, dbeta);  // (a thread a row)
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
