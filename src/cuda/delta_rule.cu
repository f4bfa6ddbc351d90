// The chunked delta rule on the GPU (delta_rule.cuh; the math: backend/cpu/delta_rule.hpp, whose
// names these kernels keep). Chunk by chunk (C = 64 tokens), with G the chunk's cumulative decay,
// A_ij = beta_i exp(G_i - G_j) k_i.k_j (j < i), M_ij = exp(G_i - G_j) q_i.k_j (j <= i) and
// T = (I + A)^-1:
//
//   forward     delta = U - W S,  U = T diag(beta) V,  W = T diag(beta exp(G)) K
//               S'    = exp(G_last) S + sum_j exp(G_last - G_j) k_j delta_j^T
//               o     = scale (exp(G) Q S + M delta)
//   state grad  dr    = U' + W' dS',  U' = scale (M T)^T dO,  W' = T^T diag(exp(G_last - G)) K
//               dS    = exp(G_last) dS' + scale Q^T (exp(G) dO) - K^T (beta exp(G) dr)
//
// Only the walks (delta, S'; dr, dS) go from chunk to chunk: W, U, T, o, W' and U' are each
// chunk's own, computed for every chunk at once (a block a chunk and value head). A walk's block
// holds a piece of a sequence, a value head and 32 value columns, its state (dk x 32, fp32) in
// shared memory: two products a chunk (three in the gradient's walk). The products on the tensor
// cores (tf32 operands, fp32 sums: block_mma); the state and every sum in fp32.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "delta_rule_chunk.cuh"

namespace megatrain::cuda::delta_rule {
namespace {

using namespace detail;

// Row i (< n) of token t0 + i, value head h, in a [tokens, Hv, d] array.
__device__ __forceinline__ i64 row_at(const Rule& r, i64 t0, int i, int h, int d) {
  return ((t0 + i) * r.Hv + h) * static_cast<i64>(d);
}

std::size_t prep_smem(int dk) { return (chunk_floats(dk, false) + 3 * static_cast<std::size_t>(C) * CS) * 4; }

// Block (chunk, value head): T = (I + A)^-1 (into Tinv), W and U.
__global__ void __launch_bounds__(NT) prep_kernel(Rule r, float* W, float* U, float* Tinv) {
  extern __shared__ float sm[];
  float* p = sm;
  const ChunkSmem m = carve_chunk(p, r.dk, false);
  float *A = p, *Ti = A + C * CS, *V = Ti + C * CS;
  const i64 chunk = blockIdx.x;
  const Span sp = span_of(r, chunk);
  const int n = sp.n, h = blockIdx.y, ks = r.dk + 1, tid = threadIdx.x;
  load_chunk(r, h, sp.t0, n, m, false);
  chunk_matrices(r, n, m, A, nullptr);  // (EK: A without beta)
  {  // T by columns, 4 lanes a column: T_ij = delta_ij - sum_{j <= l < i} beta_i EK_il T_lj
    const int j = tid / 4, part = tid % 4;
    for (int i = part; i < C; i += 4) Ti[i * CS + j] = i == j ? 1.0f : 0.0f;
    __syncwarp();
    for (int i = 1; i < n; ++i) {
      float s = 0;
      if (i > j)
        for (int l = j + part; l < i; l += 4) s += A[i * CS + l] * Ti[l * CS + j];
      s += __shfl_xor_sync(kFull, s, 1);
      s += __shfl_xor_sync(kFull, s, 2);
      if (i > j && part == 0) Ti[i * CS + j] = -m.bt[i] * s;
      __syncwarp();
    }
  }
  __syncthreads();
  float* tg = Tinv + (chunk * r.Hv + h) * static_cast<i64>(C) * C;
  for (int q = tid; q < C * C; q += NT) tg[q] = Ti[(q / C) * CS + q % C];
  block_mma<C, DK>(
      n, [&](int i, int l) { return Ti[i * CS + l]; },
      [&](int l, int x) { return x < r.dk ? m.bt[l] * m.eG[l] * m.K[l * ks + x] : 0.0f; },
      [&](int i, int x, float v) {
        if (i < n && x < r.dk) W[row_at(r, sp.t0, i, h, r.dk) + x] = v;
      });
  for (int col0 = 0; col0 < r.dv; col0 += C) {  // U, 64 value columns at a time
    __syncthreads();
    stage(V, CS, r.c + sp.t0 * r.cd + 2 * r.kd + static_cast<i64>(h) * r.dv + col0, r.cd, C, n,
          r.dv - col0 < C ? r.dv - col0 : C);  // (columns past dv: not written, not read into U)
    __syncthreads();
    block_mma<C, C>(
        n, [&](int i, int l) { return Ti[i * CS + l]; }, [&](int l, int y) { return m.bt[l] * V[l * CS + y]; },
        [&](int i, int y, float v) {
          if (i < n && col0 + y < r.dv) U[row_at(r, sp.t0, i, h, r.dv) + col0 + y] = v;
        });
  }
}

// The walk's shared-memory strides (block_mma's: no bank conflicts): W's rows (a, row-major),
// the scaled key rows (columns dk.. stay zero; a, column-major) and [rows, BV] tiles (b, row-major).
constexpr int KP = DK + 4, KS = DK + 8, V4 = BV + 8;

std::size_t walk_smem(bool grad) {
  const std::size_t rows = grad ? 2 : 1;
  return (4 * C + static_cast<std::size_t>(DK) * V4 + rows * C * KS + static_cast<std::size_t>(C) * KP + rows * C * V4) * 4;
}

// Block (piece, value head, 32 columns), the piece's chunks in order (forward) or in reverse
// (Grad): D = U + sign W S, stored (if D_out) after S (if states); then
// S := exp(G_last) S + sum_l coef_l k_l D_l^T (+ scale exp(G_l) q_l dO_l^T in the gradient), the
// scaled k (and q) rows staged as one [C (+ C), KS] matrix and D (and dO) as one [C (+ C), V4].
// Carries: forward, state_in is the state at the window's start and state_out at its end; the
// gradient's are the other way round.
template <bool Grad>
__global__ void __launch_bounds__(NT) walk_kernel(Rule r, const float* W, const float* U, const float* dO, float* states,
                                                  float* D_out) {
  extern __shared__ float4 sm4[];
  float* p = reinterpret_cast<float*>(sm4);
  constexpr int R = Grad ? 2 : 1;
  ChunkSmem m{nullptr, nullptr, p, p + C, p + 2 * C, p + 3 * C};
  float *S = p + 4 * C, *Kq = S + DK * V4, *P = Kq + R * C * KS, *D = P + C * KP;
  const int s = blockIdx.x, h = blockIdx.y, col0 = blockIdx.z * BV, tid = threadIdx.x;
  const bool first = Grad ? r.carry_out && s == r.sequences - 1 : r.carry_in && s == 0;
  const bool last = Grad ? r.carry_in && s == 0 : r.carry_out && s == r.sequences - 1;
  for (int q = tid; q < DK * V4; q += NT) S[q] = 0;
  for (int q = tid; q < R * C * KS; q += NT) Kq[q] = 0;
  __syncthreads();
  if (first) load_state(r, r.state_in + static_cast<i64>(h) * r.dk * r.dv, col0, S, V4);
  const i64 t_begin = r.starts[s], t_end = r.starts[s + 1], count = (t_end - t_begin + C - 1) / C;
  for (i64 step = 0; step < count; ++step) {
    const i64 jc = Grad ? count - 1 - step : step, t0 = t_begin + jc * C;
    const int n = static_cast<int>(imin(C, t_end - t0));
    __syncthreads();
    if (states) store_state(r, S, col0, state_at(r, states, r.chunk_first[s] + jc, h), V4);
    load_decays(r, h, t0, n, m);
    stage_keys(r, h, t0, n, false, Kq, KS, [&](int l) { return Grad ? -m.bt[l] * m.eG[l] : m.eL[l]; });
    if (Grad) {
      stage_keys(r, h, t0, n, true, Kq + C * KS, KS, [&](int l) { return r.scale * m.eG[l]; });
      load_tile(r, dO, t0, n, h, col0, D + C * V4, V4);
    }
    stage(P, KP, W + row_at(r, t0, 0, h, r.dk), static_cast<i64>(r.Hv) * r.dk, C, n, r.dk);
    __syncthreads();
    block_mma<C, BV>(
        r.dk, [&](int i, int x) { return P[i * KP + x]; }, [&](int x, int y) { return S[x * V4 + y]; },
        [&](int i, int y, float v) {
          D[i * V4 + y] = i < n && col0 + y < r.dv ? U[row_at(r, t0, i, h, r.dv) + col0 + y] + (Grad ? v : -v) : 0.0f;
        });
    __syncthreads();
    if (D_out) store_tile(r, D, t0, n, h, col0, D_out, V4);
    const float decay = m.eG[n - 1];
    block_mma<DK, BV>(
        Grad ? C + n : n, [&](int x, int l) { return Kq[l * KS + x]; }, [&](int l, int y) { return D[l * V4 + y]; },
        [&](int x, int y, float v) {
          if (x < r.dk) S[x * V4 + y] = decay * S[x * V4 + y] + v;
        });
  }
  __syncthreads();
  if (last) store_state(r, S, col0, r.state_out + static_cast<i64>(h) * r.dk * r.dv, V4);
}

std::size_t output_smem(int dk) {
  return (chunk_floats(dk) + static_cast<std::size_t>(C) * CS + static_cast<std::size_t>(dk) * VS + C * VS) * 4;
}

// Block (chunk, value head): o = scale (exp(G) Q S + M delta), 32 value columns at a time.
__global__ void __launch_bounds__(NT) output_kernel(Rule r, const float* states, const float* delta, bf* o) {
  extern __shared__ float sm[];
  float* p = sm;
  const ChunkSmem m = carve_chunk(p, r.dk);
  float *M = p, *St = M + C * CS, *Dt = St + r.dk * VS;
  const i64 chunk = blockIdx.x;
  const Span sp = span_of(r, chunk);
  const int n = sp.n, h = blockIdx.y, ks = r.dk + 1;
  load_chunk(r, h, sp.t0, n, m);
  chunk_matrices(r, n, m, nullptr, M);
  for (int col0 = 0; col0 < r.dv; col0 += BV) {
    __syncthreads();
    load_state(r, state_at(r, const_cast<float*>(states), chunk, h), col0, St);
    load_tile(r, delta, sp.t0, n, h, col0, Dt);
    __syncthreads();
    block_mma<C, BV>(
        r.dk + n, [&](int i, int k) { return k < r.dk ? m.eG[i] * m.Q[i * ks + k] : M[i * CS + k - r.dk]; },
        [&](int k, int y) { return k < r.dk ? St[k * VS + y] : Dt[(k - r.dk) * VS + y]; },
        [&](int i, int y, float v) {
          if (i < n && col0 + y < r.dv) o[row_at(r, sp.t0, i, h, r.dv) + col0 + y] = __float2bfloat16(r.scale * v);
        });
  }
}

std::size_t grad_prep_smem(int dk) { return (chunk_floats(dk) + 3 * static_cast<std::size_t>(C) * CS + C * VS) * 4; }

// Block (chunk, value head): the gradient's W' = T^T diag(exp(G_last - G)) K and
// U' = scale (M T)^T dO, from forward's T.
__global__ void __launch_bounds__(NT) grad_prep_kernel(Rule r, const float* Tinv, const float* dO, float* W, float* U) {
  extern __shared__ float sm[];
  float* p = sm;
  const ChunkSmem m = carve_chunk(p, r.dk);
  float *M = p, *Ti = M + C * CS, *Z = Ti + C * CS, *DOt = Z + C * CS;
  const i64 chunk = blockIdx.x;
  const Span sp = span_of(r, chunk);
  const int n = sp.n, h = blockIdx.y, ks = r.dk + 1;
  const float* tg = Tinv + (chunk * r.Hv + h) * static_cast<i64>(C) * C;
  stage(Ti, CS, tg, C, C, C, C);
  load_chunk(r, h, sp.t0, n, m);  // (its first barrier covers Ti)
  chunk_matrices(r, n, m, nullptr, M);
  block_mma<C, C>(
      n, [&](int i, int l) { return M[i * CS + l]; }, [&](int l, int j) { return Ti[l * CS + j]; },
      [&](int i, int j, float v) { Z[i * CS + j] = v; });
  block_mma<C, DK>(
      n, [&](int i, int l) { return Ti[l * CS + i]; },
      [&](int l, int x) { return x < r.dk ? m.eL[l] * m.K[l * ks + x] : 0.0f; },
      [&](int i, int x, float v) {
        if (i < n && x < r.dk) W[row_at(r, sp.t0, i, h, r.dk) + x] = v;
      });
  for (int col0 = 0; col0 < r.dv; col0 += BV) {
    __syncthreads();
    load_tile(r, dO, sp.t0, n, h, col0, DOt);
    __syncthreads();
    block_mma<C, BV>(
        n, [&](int i, int l) { return Z[l * CS + i]; }, [&](int l, int y) { return DOt[l * VS + y]; },
        [&](int i, int y, float v) {
          if (i < n && col0 + y < r.dv) U[row_at(r, sp.t0, i, h, r.dv) + col0 + y] = r.scale * v;
        });
  }
}

dim3 chunk_grid(const Rule& r, i64 chunks) { return dim3(static_cast<unsigned>(chunks), static_cast<unsigned>(r.Hv)); }
dim3 walk_grid(const Rule& r) {
  return dim3(static_cast<unsigned>(r.sequences), static_cast<unsigned>(r.Hv), static_cast<unsigned>((r.dv + BV - 1) / BV));
}

}  // namespace

void forward(const Rule& r, i64 chunks, const Scratch& w, bf* o, float* states, float* delta, cudaStream_t stream) {
  MT_CHECK(!o || (states && delta), "delta_rule::forward: o needs the chunks' states and delta");
  std::size_t smem = prep_smem(r.dk);
  allow_smem(prep_kernel, smem);
  prep_kernel<<<chunk_grid(r, chunks), NT, smem, stream>>>(r, w.W, w.U, w.T);
  MT_CUDA_CHECK_LAUNCH("delta_rule prep_kernel");
  smem = walk_smem(false);
  allow_smem(walk_kernel<false>, smem);
  walk_kernel<false><<<walk_grid(r), NT, smem, stream>>>(r, w.W, w.U, nullptr, states, delta);
  MT_CUDA_CHECK_LAUNCH("delta_rule walk_kernel");
  if (!o) return;
  smem = output_smem(r.dk);
  allow_smem(output_kernel, smem);
  output_kernel<<<chunk_grid(r, chunks), NT, smem, stream>>>(r, states, delta, o);
  MT_CUDA_CHECK_LAUNCH("delta_rule output_kernel");
}

void state_grad(const Rule& r, i64 chunks, const Scratch& w, const float* dO, float* dstates, float* dr, cudaStream_t stream) {
  std::size_t smem = grad_prep_smem(r.dk);
  allow_smem(grad_prep_kernel, smem);
  grad_prep_kernel<<<chunk_grid(r, chunks), NT, smem, stream>>>(r, w.T, dO, w.W, w.U);
  MT_CUDA_CHECK_LAUNCH("delta_rule grad_prep_kernel");
  smem = walk_smem(true);
  allow_smem(walk_kernel<true>, smem);
  walk_kernel<true><<<walk_grid(r), NT, smem, stream>>>(r, w.W, w.U, dO, dstates, dr);
  MT_CUDA_CHECK_LAUNCH("delta_rule walk_kernel (gradient)");
}

}  // namespace megatrain::cuda::delta_rule
