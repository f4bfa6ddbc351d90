// Gated DeltaNet's mixing on the GPU (contract: backend/cuda/gated_deltanet.hpp): the element-wise
// parts (the causal convolution with SiLU, the L2 norms, the gates, the gated RMSNorm, Qwen3-Next's
// fused layout; the math of backend/cpu/gated_deltanet.hpp) and the windows over which the delta
// rule's kernels (delta_rule.cuh) run. All arithmetic in fp32; no float atomics.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "common.cuh"
#include "delta_rule.cuh"
#include "megatrain/backend/cuda/gated_deltanet.hpp"
#include "megatrain/core/cuda_check.hpp"
#include "megatrain/core/error.hpp"

namespace megatrain::cuda {
namespace {

using namespace common;

constexpr int C = static_cast<int>(kDeltaRuleChunk);
constexpr int DK = static_cast<int>(kDeltaRuleMaxKeyDim);
constexpr int kMaxTaps = static_cast<int>(kDeltaNetMaxTaps);

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float silu(float x) { return x * sigmoid(x); }
__device__ __forceinline__ float silu_grad(float x) {
  const float s = sigmoid(x);
  return s * (1.0f + x * (1.0f - s));
}
__device__ __forceinline__ float ld(const bf* p) { return __bfloat162float(*p); }
__device__ __forceinline__ i64 imin(i64 a, i64 b) { return a < b ? a : b; }

// ---- sequences ---------------------------------------------------------------------------------

// Where a window's tokens sit in their sequences. Token t of the window is token offset + t of the
// mixing; positions (if not null) is already at the window's first token.
struct Seqs {
  const std::int32_t* positions;  // [tokens] or null: (offset + t) % seq
  i64 seq, offset;
  __device__ i64 position(i64 t) const { return positions ? positions[t] : (offset + t) % seq; }
};

// The window's pieces of sequences: st[p] = where piece p starts in the window (then the window's
// end), cf[p] = its first chunk (then the window's chunks). Sequences first .. first + pieces - 1
// cross the window [w0, w1); starts: theirs less base, or null (rows of seq).
__global__ void sequence_table_kernel(const std::int32_t* starts, std::int32_t base, i64 seq, i64 first, i64 pieces, i64 w0,
                                      i64 w1, std::int32_t* st, std::int32_t* cf) {
  const auto start = [&](i64 s) { return starts ? static_cast<i64>(starts[s] - base) : s * seq; };
  std::int32_t chunks = 0;
  for (i64 p = 0; p < pieces; ++p) {
    const i64 a = (p == 0 ? (start(first) > w0 ? start(first) : w0) : start(first + p)) - w0;
    const i64 end = start(first + p + 1), b = (end < w1 ? end : w1) - w0;
    st[p] = static_cast<std::int32_t>(a);
    cf[p] = chunks;
    chunks += static_cast<std::int32_t>((b - a + C - 1) / C);
  }
  st[pieces] = static_cast<std::int32_t>(w1 - w0);
  cf[pieces] = chunks;
}

// ---- element-wise parts ------------------------------------------------------------------------

// The convolution's pre-activation at token t (of a sequence from `first`), channel ch.
__device__ __forceinline__ float conv_pre(const bf* x, const bf* w, i64 t, i64 first, i64 ch, i64 cd, int K) {
  float p = 0;
  for (int j = 0; j < K; ++j) {
    const i64 s = t - K + 1 + j;
    if (s >= first) p += ld(w + ch * K + j) * ld(x + s * cd + ch);
  }
  return p;
}

// c[t, ch] = silu(sum_j w[ch, j] x[t - K + 1 + j, ch]) within t's sequence; grad: dpre (in place of
// dc) = dc * silu'(pre), the pre-activation recomputed. A block a token at a time, its threads over
// the channels (the token's sequence found once, no division an element).
template <bool kGrad>
__global__ void conv_silu_kernel(const bf* x, const bf* w, i64 T, i64 cd, int K, Seqs q, float* c) {
  for (i64 t = blockIdx.x; t < T; t += gridDim.x) {
    const i64 first = t - q.position(t);
    for (i64 ch = threadIdx.x; ch < cd; ch += blockDim.x) {
      const float p = conv_pre(x, w, t, first, ch, cd, K);
      if constexpr (kGrad) c[t * cd + ch] *= silu_grad(p);
      else c[t * cd + ch] = silu(p);
    }
  }
}

// dx[t, ch] = sum_j w[ch, j] dpre[t + K - 1 - j, ch] over the taps that stay in t's sequence; the
// rows past the window's T (up to K - 1 of them, while the mixing has them: rest) come from tail.
// A block a token at a time, as above.
__global__ void conv_input_grad_kernel(const float* dpre, const float* tail, const bf* w, i64 T, i64 rest, i64 cd, int K,
                                       Seqs q, bf* dx) {
  for (i64 t = blockIdx.x; t < T; t += gridDim.x) {
    const i64 first = t - q.position(t);
    bool tap[kMaxTaps];  // (whether tap j's row is in t's sequence and within reach)
#pragma unroll
    for (int j = 0; j < kMaxTaps; ++j) {
      const i64 s = t + K - 1 - j;
      tap[j] = j < K && s < rest && s - q.position(s) == first;
    }
    for (i64 ch = threadIdx.x; ch < cd; ch += blockDim.x) {
      float d = 0;
#pragma unroll
      for (int j = 0; j < kMaxTaps; ++j) {
        const i64 s = t + K - 1 - j;
        if (tap[j]) d += ld(w + ch * K + j) * (s < T ? dpre[s * cd + ch] : tail[(s - T) * cd + ch]);
      }
      dx[t * cd + ch] = __float2bfloat16(d);
    }
  }
}

// partial[seg, ch * K + j] = sum over the segment's tokens t of dpre[t, ch] x[t - K + 1 + j, ch].
__global__ void conv_weight_grad_kernel(const float* dpre, const bf* x, i64 T, i64 cd, int K, Seqs q, float* partial) {
  const i64 ch = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x, seg = blockIdx.y;
  if (ch >= cd) return;
  float acc[kMaxTaps] = {};
  const i64 t1 = imin(T, (seg + 1) * kDeltaNetSegment);
  for (i64 t = seg * kDeltaNetSegment; t < t1; ++t) {
    const i64 first = t - q.position(t);
    const float d = dpre[t * cd + ch];
#pragma unroll
    for (int j = 0; j < kMaxTaps; ++j) {
      const i64 s = t - K + 1 + j;
      if (j < K && s >= first) acc[j] += d * ld(x + s * cd + ch);
    }
  }
  for (int j = 0; j < K; ++j) partial[seg * cd * K + ch * K + j] = acc[j];
}

// out[k] += sum_s partial[s, k], the segments in order.
__global__ void sum_segments_kernel(const float* partial, i64 segments, i64 n, float* out) {
  for (i64 k = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; k < n; k += static_cast<i64>(gridDim.x) * blockDim.x) {
    float s = 0;
    for (i64 g = 0; g < segments; ++g) s += partial[g * n + k];
    out[k] += s;
  }
}

// Each head's vector of c's q and k parts (2 key_heads of them a token) scaled to unit length in
// place; inv keeps the scale. A warp a vector.
__global__ void l2norm_kernel(float* c, i64 T, i64 cd, int heads2, int dk, float eps, float* inv) {
  const i64 warps = static_cast<i64>(gridDim.x) * (blockDim.x / 32);
  for (i64 r = blockIdx.x * static_cast<i64>(blockDim.x / 32) + threadIdx.x / 32; r < T * heads2; r += warps) {
    float* v = c + (r / heads2) * cd + (r % heads2) * dk;
    float s = 0;
    for (int x = threadIdx.x % 32; x < dk; x += 32) s += v[x] * v[x];
    const float k = 1.0f / sqrtf(warp_sum(s) + eps);
    for (int x = threadIdx.x % 32; x < dk; x += 32) v[x] *= k;
    if (threadIdx.x % 32 == 0) inv[r] = k;
  }
}

// dc (in place of the normalised vectors y) = inv (dy - y (y . dy)), dy the sum of the value heads'
// gradients of this key head (dq or dk per value head: [T, Hv, dk]).
__global__ void l2norm_grad_kernel(float* c, const float* inv, const float* dq, const float* dk_, i64 T, i64 cd, int Hk,
                                   int Hv, int dk) {
  const int ratio = Hv / Hk;
  const i64 warps = static_cast<i64>(gridDim.x) * (blockDim.x / 32);
  for (i64 r = blockIdx.x * static_cast<i64>(blockDim.x / 32) + threadIdx.x / 32; r < T * 2 * Hk; r += warps) {
    const i64 t = r / (2 * Hk);
    const int hh = static_cast<int>(r % (2 * Hk)), hk = hh % Hk;
    const float* g = (hh < Hk ? dq : dk_) + (t * Hv + static_cast<i64>(hk) * ratio) * dk;
    float* y = c + t * cd + static_cast<i64>(hh) * dk;
    float d[DK / 32];
    float yd = 0;
#pragma unroll
    for (int m = 0; m < DK / 32; ++m) {
      const int x = threadIdx.x % 32 + 32 * m;
      d[m] = 0;
      if (x < dk) {
        for (int h = 0; h < ratio; ++h) d[m] += g[static_cast<i64>(h) * dk + x];
        yd += y[x] * d[m];
      }
    }
    yd = warp_sum(yd);
    const float k = inv[r];
#pragma unroll
    for (int m = 0; m < DK / 32; ++m) {
      const int x = threadIdx.x % 32 + 32 * m;
      if (x < dk) y[x] = k * (d[m] - y[x] * yd);
    }
  }
}

// c's v part (in place) = beta * dr: the gradient of v.
__global__ void value_grad_kernel(float* c, const float* dr, const float* beta, i64 T, i64 cd, i64 kd, int Hv, int dv) {
  const i64 vd = static_cast<i64>(Hv) * dv;
  for (i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; i < T * vd; i += static_cast<i64>(gridDim.x) * blockDim.x) {
    const i64 t = i / vd, hv = i % vd;
    c[t * cd + 2 * kd + hv] = beta[t * Hv + hv / dv] * dr[i];
  }
}

__device__ __forceinline__ float softplus(float u) { return u > 20.0f ? u : log1pf(expf(u)); }

__global__ void gates_kernel(const bf* a, const bf* b, const float* A_log, const float* dt_bias, i64 T, int Hv, float* g,
                             float* beta) {
  for (i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; i < T * Hv; i += static_cast<i64>(gridDim.x) * blockDim.x) {
    const int h = static_cast<int>(i % Hv);
    g[i] = -expf(A_log[h]) * softplus(ld(a + i) + dt_bias[h]);
    beta[i] = sigmoid(ld(b + i));
  }
}

__global__ void gates_grad_kernel(const bf* a, const float* A_log, const float* dt_bias, const float* beta, const float* dg,
                                  const float* dbeta, i64 T, int Hv, bf* da, bf* db) {
  for (i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; i < T * Hv; i += static_cast<i64>(gridDim.x) * blockDim.x) {
    const int h = static_cast<int>(i % Hv);
    const float u = ld(a + i) + dt_bias[h];
    da[i] = __float2bfloat16(dg[i] * -expf(A_log[h]) * (u > 20.0f ? 1.0f : sigmoid(u)));
    db[i] = __float2bfloat16(dbeta[i] * beta[i] * (1.0f - beta[i]));
  }
}

// partial[seg, h] = the segment's sum of dg g (d / dA_log), partial[segments + seg, h] of d / du.
__global__ void gates_weight_grad_kernel(const bf* a, const float* A_log, const float* dt_bias, const float* g,
                                         const float* dg, i64 T, int Hv, i64 segments, float* partial) {
  const int h = threadIdx.x;
  const i64 seg = blockIdx.x;
  if (h >= Hv) return;
  float pa = 0, pd = 0;
  const float e = expf(A_log[h]);
  const i64 t1 = imin(T, (seg + 1) * kDeltaNetSegment);
  for (i64 t = seg * kDeltaNetSegment; t < t1; ++t) {
    const i64 i = t * Hv + h;
    const float u = ld(a + i) + dt_bias[h];
    pd += dg[i] * -e * (u > 20.0f ? 1.0f : sigmoid(u));
    pa += dg[i] * g[i];
  }
  partial[seg * Hv + h] = pa;
  partial[(segments + seg) * Hv + h] = pd;
}

// y = w rmsnorm(o) silu(z) per (token, value head), rstd kept. A warp a row.
__global__ void gated_norm_kernel(const bf* o, const bf* z, const float* w, i64 rows, int dv, float eps, bf* y, float* rstd) {
  const i64 warps = static_cast<i64>(gridDim.x) * (blockDim.x / 32);
  for (i64 r = blockIdx.x * static_cast<i64>(blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps) {
    const bf* x = o + r * dv;
    float s = 0;
    for (int j = threadIdx.x % 32; j < dv; j += 32) s += ld(x + j) * ld(x + j);
    const float k = 1.0f / sqrtf(warp_sum(s) / static_cast<float>(dv) + eps);
    for (int j = threadIdx.x % 32; j < dv; j += 32)
      y[r * dv + j] = __float2bfloat16(w[j] * (ld(x + j) * k) * silu(ld(z + r * dv + j)));
    if (threadIdx.x % 32 == 0) rstd[r] = k;
  }
}

__global__ void gated_norm_grad_kernel(const bf* o, const bf* z, const float* w, const float* rstd, const bf* dy, i64 rows,
                                       int dv, float* dx, bf* dz) {
  const i64 warps = static_cast<i64>(gridDim.x) * (blockDim.x / 32);
  for (i64 r = blockIdx.x * static_cast<i64>(blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps) {
    const float k = rstd[r];
    float nd = 0;
    for (int j = threadIdx.x % 32; j < dv; j += 32) {
      const i64 i = r * dv + j;
      const float n = ld(o + i) * k, zz = ld(z + i), d = ld(dy + i);
      nd += n * d * w[j] * silu(zz);
      dz[i] = __float2bfloat16(d * w[j] * n * silu_grad(zz));
    }
    nd = warp_sum(nd);
    for (int j = threadIdx.x % 32; j < dv; j += 32) {
      const i64 i = r * dv + j;
      const float n = ld(o + i) * k;
      dx[i] = k * (ld(dy + i) * w[j] * silu(ld(z + i)) - n * nd / static_cast<float>(dv));
    }
  }
}

// The gated norm's gain gradient, sum over rows of dy o rstd silu(z), in parts of kDeltaNetNormRows
// rows: a block a part, 4 row lanes of 64 columns, their sums added in a fixed order.
__global__ void __launch_bounds__(256) gated_norm_weight_grad_kernel(const bf* o, const bf* z, const float* rstd,
                                                                     const bf* dy, i64 rows, int dv, float* partial) {
  __shared__ float red[4][64];
  const int tx = threadIdx.x % 64, ty = threadIdx.x / 64;
  const i64 r0 = blockIdx.x * kDeltaNetNormRows, r1 = imin(rows, r0 + kDeltaNetNormRows);
  for (int j0 = 0; j0 < dv; j0 += 64) {
    const int j = j0 + tx;
    float s = 0;
    if (j < dv)
      for (i64 r = r0 + ty; r < r1; r += 4) {
        const i64 i = r * dv + j;
        s += ld(dy + i) * ld(o + i) * rstd[r] * silu(ld(z + i));
      }
    red[ty][tx] = s;
    __syncthreads();
    if (ty == 0 && j < dv) partial[blockIdx.x * static_cast<i64>(dv) + j] = (red[0][tx] + red[1][tx]) + (red[2][tx] + red[3][tx]);
    __syncthreads();
  }
}

// ---- Qwen3-Next's fused projections ------------------------------------------------------------

// Element e of a fused row to its place in the separate layout (gated_deltanet.hpp's top comment):
// in_proj_qkvz's row holds, per key head, its q, k, then its value heads' v and z; in_proj_ba's,
// per key head, its value heads' b then a. `part` 0: mixed, 1: z, 2: b, 3: a.
struct Unfused {
  int part;
  i64 col;
};
__device__ Unfused qkvz_place(i64 e, int dk, int Hk, int r, int dv) {
  const i64 rv = static_cast<i64>(r) * dv, per_head = 2 * dk + 2 * rv, kd = static_cast<i64>(Hk) * dk;
  const i64 h = e / per_head, off = e % per_head;
  if (off < dk) return {0, h * dk + off};
  if (off < 2 * dk) return {0, kd + h * dk + off - dk};
  if (off < 2 * dk + rv) return {0, 2 * kd + h * rv + off - 2 * dk};
  return {1, h * rv + off - 2 * dk - rv};
}
__device__ Unfused ba_place(i64 e, int r) {
  const i64 h = e / (2 * r), off = e % (2 * r);
  return off < r ? Unfused{2, h * r + off} : Unfused{3, h * r + off - r};
}

// to_fused false: mixed, z, b, a (rows of n tokens) from qkvz and ba; true: the inverse.
__global__ void fused_layout_kernel(bf* qkvz, bf* ba, i64 n, int dk, int Hk, int Hv, int dv, bf* mixed, bf* z, bf* b,
                                    bf* a, bool to_fused) {
  const int r = Hv / Hk;
  const i64 vd = static_cast<i64>(Hv) * dv, cd = 2 * static_cast<i64>(Hk) * dk + vd, wq = cd + vd, wb = 2 * static_cast<i64>(Hv);
  const i64 widths[4] = {cd, vd, Hv, Hv};
  bf* parts[4] = {mixed, z, b, a};
  for (i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; i < n * (wq + wb);
       i += static_cast<i64>(gridDim.x) * blockDim.x) {
    const i64 t = i / (wq + wb), e = i % (wq + wb);
    const Unfused u = e < wq ? qkvz_place(e, dk, Hk, r, dv) : ba_place(e - wq, r);
    bf* fused = e < wq ? qkvz + t * wq + e : ba + t * wb + (e - wq);
    bf* sep = parts[u.part] + t * widths[u.part] + u.col;
    if (to_fused) *fused = *sep;
    else *sep = *fused;
  }
}

// ---- windows -----------------------------------------------------------------------------------

// A window of tokens [w0, w1): the sequences first .. first + pieces - 1 cross it; the first
// continues one begun before it (carry_in), the last goes on after it (carry_out).
struct Window {
  i64 w0, w1, first, pieces, chunks;
  bool carry_in, carry_out;
  i64 tokens() const { return w1 - w0; }
};

std::vector<Window> plan_windows(const DeltaNetShape& s, const DeltaNetSequences& q) {
  std::vector<std::int32_t> rows;  // (unpacked: the rows' starts)
  std::span<const std::int32_t> hs = q.host_starts;
  if (q.starts == nullptr) {
    for (i64 r = 0; r <= q.count; ++r) rows.push_back(static_cast<std::int32_t>(r * q.seq));
    hs = rows;
  }
  MT_CHECK(static_cast<i64>(hs.size()) == q.count + 1 && hs.back() - hs.front() == q.tokens,
           "Gated DeltaNet: {} sequence starts for {} sequences of {} tokens", hs.size(), q.count, q.tokens);
  const auto start = [&](i64 k) { return static_cast<i64>(hs[static_cast<std::size_t>(k)] - hs.front()); };
  const auto holding = [&](i64 t) {  // the sequence holding token t
    return static_cast<i64>(std::upper_bound(hs.begin(), hs.end(), static_cast<std::int32_t>(t + hs.front())) - hs.begin()) - 1;
  };
  const i64 W = delta_net_window_tokens(s, q.tokens, q.window);
  std::vector<Window> out;
  for (i64 w0 = 0; w0 < q.tokens;) {
    i64 w1 = std::min(q.tokens, w0 + W);
    if (w1 < q.tokens) {  // end where a chunk of the sequence holding w1 ends
      const i64 k = holding(w1), a = start(k);
      w1 = std::max(a, a + (w1 - a) / C * C);
      if (w1 <= w0) w1 = a + ((w0 - a) / C + 1) * C;  // (a window of at least one chunk)
    }
    Window w{w0, w1, holding(w0), 0, 0, false, false};
    const i64 last = holding(w1 - 1);
    w.pieces = last - w.first + 1;
    w.carry_in = start(w.first) < w0;
    w.carry_out = start(last + 1) > w1;
    for (i64 k = w.first; k <= last; ++k)
      w.chunks += (std::min(start(k + 1), w1) - std::max(start(k), w0) + C - 1) / C;
    out.push_back(w);
    w0 = w1;
  }
  MT_CHECK(static_cast<i64>(out.size()) <= delta_net_windows(s, q.tokens, q.window),
           "Gated DeltaNet: {} windows, more than the {} planned", out.size(), delta_net_windows(s, q.tokens, q.window));
  return out;
}

// The workspace, for a window of up to W tokens and `windows` windows.
struct Work {
  std::int32_t *starts, *chunk_first;
  float *c, *inv, *g, *beta;
  float* window_states;  // [windows + 1, Hv, dk, dv]: the state where each window starts
  delta_rule::Scratch rule;
  float *states, *delta;  // [chunks, Hv, dk, dv], [T, vd]
  float *dstates = nullptr, *dr = nullptr, *dO = nullptr;
  float *dq = nullptr, *dk = nullptr, *dg = nullptr, *dbeta = nullptr;
  float *pconv = nullptr, *pnorm = nullptr, *pgate = nullptr;
  float *dcarry[2] = {nullptr, nullptr}, *tail = nullptr;
};

Work carve_work(const DeltaNetShape& s, const DeltaNetSequences& q, std::size_t windows, void* ws, std::size_t bytes,
                bool backward) {
  const std::size_t need = delta_net_workspace_bytes(s, q.tokens, q.count, backward, q.window);
  MT_CHECK(bytes >= need && ws != nullptr, "Gated DeltaNet: a workspace of {} bytes is smaller than the {} required", bytes, need);
  Carver cv(ws, bytes);
  const i64 W = delta_net_window_tokens(s, q.tokens, q.window), pieces = std::min(q.count, W);
  const auto T = static_cast<std::size_t>(W), seqs = static_cast<std::size_t>(pieces) + 1;
  const auto Hv = static_cast<std::size_t>(s.value_heads), vd = static_cast<std::size_t>(s.value_dim());
  const std::size_t state = Hv * static_cast<std::size_t>(s.dk * s.dv);
  Work w{};
  w.starts = cv.take<std::int32_t>(seqs);
  w.chunk_first = cv.take<std::int32_t>(seqs);
  w.c = cv.take<float>(T * static_cast<std::size_t>(s.conv_dim()));
  w.inv = cv.take<float>(T * 2 * static_cast<std::size_t>(s.key_heads));
  w.g = cv.take<float>(T * Hv);
  w.beta = cv.take<float>(T * Hv);
  w.window_states = cv.take<float>((windows + 1) * state);
  const auto chunks = static_cast<std::size_t>((W + C - 1) / C + pieces);
  w.rule.W = cv.take<float>(T * Hv * static_cast<std::size_t>(s.dk));
  w.rule.U = cv.take<float>(T * vd);
  w.rule.T = cv.take<float>(chunks * Hv * static_cast<std::size_t>(C * C));
  w.states = cv.take<float>(chunks * state);
  w.delta = cv.take<float>(T * vd);
  if (backward) {
    const auto segments = static_cast<std::size_t>((W + kDeltaNetSegment - 1) / kDeltaNetSegment);
    w.dstates = cv.take<float>(chunks * state);
    w.dr = cv.take<float>(T * vd);
    w.dO = cv.take<float>(T * vd);
    w.dq = cv.take<float>(T * Hv * static_cast<std::size_t>(s.dk));
    w.dk = cv.take<float>(T * Hv * static_cast<std::size_t>(s.dk));
    w.dg = cv.take<float>(T * Hv);
    w.dbeta = cv.take<float>(T * Hv);
    w.pconv = cv.take<float>(segments * static_cast<std::size_t>(s.conv_dim() * s.taps));
    w.pnorm = cv.take<float>(static_cast<std::size_t>(delta_net_norm_parts(s, W)) * static_cast<std::size_t>(s.dv));
    w.pgate = cv.take<float>(segments * 2 * Hv);
    w.dcarry[0] = cv.take<float>(state);
    w.dcarry[1] = cv.take<float>(state);
    w.tail = cv.take<float>(static_cast<std::size_t>(std::max<i64>(s.taps - 1, 1) * s.conv_dim()));
  }
  return w;
}

Seqs seqs_of(const DeltaNetSequences& q, const Window& win) {
  return {q.positions ? q.positions + win.w0 : nullptr, q.seq, win.w0};
}

// The window's operands: the inputs' rows from its first token.
DeltaNetInputs window_inputs(const DeltaNetShape& s, const DeltaNetInputs& in, const Window& win) {
  DeltaNetInputs r = in;
  r.mixed += win.w0 * s.conv_dim();
  r.z += win.w0 * s.value_dim();
  r.a += win.w0 * s.value_heads;
  r.b += win.w0 * s.value_heads;
  return r;
}

// The window's sequence table, c (convolved, q and k normalised) and the gates; the rule over it
// with its carries: the state at its start is window_states[index], at its end window_states[index + 1].
delta_rule::Rule prepare_rule(const DeltaNetShape& s, const DeltaNetSequences& q, const DeltaNetInputs& in, const Work& w,
                              const Window& win, std::size_t index, cudaStream_t stream) {
  const i64 T = win.tokens(), cd = s.conv_dim();
  const DeltaNetInputs wi = window_inputs(s, in, win);
  sequence_table_kernel<<<1, 1, 0, stream>>>(q.starts, q.base, q.seq, win.first, win.pieces, win.w0, win.w1, w.starts,
                                             w.chunk_first);
  MT_CUDA_CHECK_LAUNCH("sequence_table_kernel");
  conv_silu_kernel<false><<<grid_for(T, 1), 256, 0, stream>>>(dev(wi.mixed), dev(wi.conv), T, cd, static_cast<int>(s.taps),
                                                               seqs_of(q, win), w.c);
  MT_CUDA_CHECK_LAUNCH("conv_silu_kernel");
  l2norm_kernel<<<grid_for(T * 2 * s.key_heads, 8), 256, 0, stream>>>(w.c, T, cd, static_cast<int>(2 * s.key_heads),
                                                                       static_cast<int>(s.dk), 1e-6f, w.inv);
  MT_CUDA_CHECK_LAUNCH("l2norm_kernel");
  gates_kernel<<<grid_for(T * s.value_heads, 256), 256, 0, stream>>>(dev(wi.a), dev(wi.b), in.A_log, in.dt_bias, T,
                                                                      static_cast<int>(s.value_heads), w.g, w.beta);
  MT_CUDA_CHECK_LAUNCH("gates_kernel");
  const std::size_t state = static_cast<std::size_t>(s.value_heads * s.dk * s.dv);
  return {static_cast<int>(s.key_heads), static_cast<int>(s.value_heads), static_cast<int>(s.dk), static_cast<int>(s.dv),
          s.key_dim(), cd, static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.dk))), w.c, w.g, w.beta, w.starts,
          w.chunk_first, win.pieces, win.carry_in, win.carry_out, w.window_states + index * state,
          w.window_states + (index + 1) * state};
}

void sum_segments(const float* partial, i64 segments, i64 n, float* out, cudaStream_t stream) {
  sum_segments_kernel<<<grid_for(n, 256), 256, 0, stream>>>(partial, segments, n, out);
  MT_CUDA_CHECK_LAUNCH("sum_segments_kernel");
}

// One window of the backward (the windows in reverse): the rule recomputed from the state at its
// start, then every gradient of its tokens; dcarry_in: the gradient of the state at its end (from
// the window after it), dcarry_out: at its start; tail: the next window's first taps - 1 rows of
// the convolution's pre-activation gradient, replaced by this window's.
void backward_window(const DeltaNetShape& s, const DeltaNetSequences& q, const DeltaNetInputs& in, const bf16* o,
                     const float* rstd, const bf16* dy, const DeltaNetGrads& g, const Work& w, const Window& win,
                     std::size_t index, const float* dcarry_in, float* dcarry_out, cudaStream_t stream) {
  const i64 T = win.tokens(), cd = s.conv_dim(), rows = T * s.value_heads, vd = s.value_dim();
  const i64 segments = (T + kDeltaNetSegment - 1) / kDeltaNetSegment;
  const int Hv = static_cast<int>(s.value_heads), dv = static_cast<int>(s.dv), K = static_cast<int>(s.taps);
  const DeltaNetInputs wi = window_inputs(s, in, win);
  const bf* wo = dev(o) + win.w0 * vd;
  const bf* wdy = dev(dy) + win.w0 * vd;
  const float* wrstd = rstd + win.w0 * s.value_heads;
  delta_rule::Rule r = prepare_rule(s, q, in, w, win, index, stream);
  r.carry_out = false;  // (the state at the window's end is known already)
  delta_rule::forward(r, win.chunks, w.rule, nullptr, w.states, w.delta, stream);
  // the gated norm: dO (fp32), dz, the gain's gradient
  gated_norm_grad_kernel<<<grid_for(rows, 8), 256, 0, stream>>>(wo, dev(wi.z), in.norm, wrstd, wdy, rows, dv, w.dO,
                                                                 dev(g.z) + win.w0 * vd);
  MT_CUDA_CHECK_LAUNCH("gated_norm_grad_kernel");
  const i64 norm_parts = delta_net_norm_parts(s, T);
  gated_norm_weight_grad_kernel<<<static_cast<unsigned>(norm_parts), 256, 0, stream>>>(wo, dev(wi.z), wrstd, wdy, rows, dv,
                                                                                        w.pnorm);
  MT_CUDA_CHECK_LAUNCH("gated_norm_weight_grad_kernel");
  sum_segments(w.pnorm, norm_parts, dv, g.norm, stream);
  // the delta rule: the state's gradient walked back, then each chunk's
  r.carry_out = win.carry_out;
  r.state_in = dcarry_in;
  r.state_out = dcarry_out;
  delta_rule::state_grad(r, win.chunks, w.rule, w.dO, w.dstates, w.dr, stream);
  delta_rule::chunk_grad(r, win.chunks, w.states, w.dstates, w.delta, w.dr, w.dO, w.dq, w.dk, w.dg, w.dbeta, stream);
  // back through the norms and the convolution
  l2norm_grad_kernel<<<grid_for(T * 2 * s.key_heads, 8), 256, 0, stream>>>(w.c, w.inv, w.dq, w.dk, T, cd,
                                                                            static_cast<int>(s.key_heads), Hv,
                                                                            static_cast<int>(s.dk));
  MT_CUDA_CHECK_LAUNCH("l2norm_grad_kernel");
  value_grad_kernel<<<grid_for(T * vd, 256), 256, 0, stream>>>(w.c, w.dr, w.beta, T, cd, s.key_dim(), Hv, dv);
  MT_CUDA_CHECK_LAUNCH("value_grad_kernel");
  const Seqs sq = seqs_of(q, win);
  conv_silu_kernel<true><<<grid_for(T, 1), 256, 0, stream>>>(dev(wi.mixed), dev(wi.conv), T, cd, K, sq, w.c);
  MT_CUDA_CHECK_LAUNCH("conv_silu_kernel (grad)");
  conv_input_grad_kernel<<<grid_for(T, 1), 256, 0, stream>>>(w.c, w.tail, dev(wi.conv), T, q.tokens - win.w0, cd, K,
                                                                     sq, dev(g.mixed) + win.w0 * cd);
  MT_CUDA_CHECK_LAUNCH("conv_input_grad_kernel");
  if (K > 1)  // (the window before reads these rows)
    MT_CUDA_CHECK(cudaMemcpyAsync(w.tail, w.c, static_cast<std::size_t>(std::min<i64>(K - 1, T) * cd) * sizeof(float),
                                  cudaMemcpyDeviceToDevice, stream));
  conv_weight_grad_kernel<<<dim3(static_cast<unsigned>((cd + 127) / 128), static_cast<unsigned>(segments)), 128, 0, stream>>>(
      w.c, dev(wi.mixed), T, cd, K, sq, w.pconv);
  MT_CUDA_CHECK_LAUNCH("conv_weight_grad_kernel");
  sum_segments(w.pconv, segments, cd * K, g.conv, stream);
  // the gates
  gates_grad_kernel<<<grid_for(rows, 256), 256, 0, stream>>>(dev(wi.a), in.A_log, in.dt_bias, w.beta, w.dg, w.dbeta, T, Hv,
                                                              dev(g.a) + win.w0 * Hv, dev(g.b) + win.w0 * Hv);
  MT_CUDA_CHECK_LAUNCH("gates_grad_kernel");
  gates_weight_grad_kernel<<<static_cast<unsigned>(segments), static_cast<unsigned>(std::max(32, (Hv + 31) / 32 * 32)), 0,
                             stream>>>(dev(wi.a), in.A_log, in.dt_bias, w.g, w.dg, T, Hv, segments, w.pgate);
  MT_CUDA_CHECK_LAUNCH("gates_weight_grad_kernel");
  sum_segments(w.pgate, segments, Hv, g.A_log, stream);
  sum_segments(w.pgate + segments * Hv, segments, Hv, g.dt_bias, stream);
}

}  // namespace

void check_delta_net_shape(const DeltaNetShape& s) {
  MT_CHECK(s.key_heads > 0 && s.value_heads > 0 && s.value_heads % s.key_heads == 0 && s.dk > 0 && s.dv > 0 && s.taps > 0,
           "Gated DeltaNet: {} key heads, {} value heads (a multiple of them), head dims {} and {}, {} taps", s.key_heads,
           s.value_heads, s.dk, s.dv, s.taps);
  MT_CHECK(s.dk <= kDeltaRuleMaxKeyDim, "Gated DeltaNet: linear_key_head_dim {} is wider than the {} the GPU kernels take; "
           "train this model with --backend cpu", s.dk, kDeltaRuleMaxKeyDim);
  MT_CHECK(s.taps <= kMaxTaps, "Gated DeltaNet: linear_conv_kernel_dim {} is longer than the {} the GPU kernels take; "
           "train this model with --backend cpu", s.taps, kMaxTaps);
  MT_CHECK(s.value_heads <= 1024 && s.dv <= 65536, "Gated DeltaNet: {} value heads of {} exceed the GPU kernels' limits",
           s.value_heads, s.dv);
}

void launch_delta_net_forward(const DeltaNetShape& s, const DeltaNetSequences& q, const DeltaNetInputs& in, bf16* o,
                              float* rstd, bf16* y, void* workspace, std::size_t bytes, cudaStream_t stream) {
  check_delta_net_shape(s);
  if (q.tokens == 0) return;
  const auto windows = plan_windows(s, q);
  const Work w = carve_work(s, q, windows.size(), workspace, bytes, false);
  for (std::size_t i = 0; i < windows.size(); ++i) {
    const Window& win = windows[i];
    const i64 vd = s.value_dim(), rows = win.tokens() * s.value_heads;
    const delta_rule::Rule r = prepare_rule(s, q, in, w, win, i, stream);
    delta_rule::forward(r, win.chunks, w.rule, dev(o) + win.w0 * vd, w.states, w.delta, stream);
    gated_norm_kernel<<<grid_for(rows, 8), 256, 0, stream>>>(dev(o) + win.w0 * vd, dev(in.z) + win.w0 * vd, in.norm, rows,
                                                              static_cast<int>(s.dv), static_cast<float>(s.norm_eps),
                                                              dev(y) + win.w0 * vd, rstd + win.w0 * s.value_heads);
    MT_CUDA_CHECK_LAUNCH("gated_norm_kernel");
  }
}

void launch_delta_net_backward(const DeltaNetShape& s, const DeltaNetSequences& q, const DeltaNetInputs& in,
                               const bf16* o, const float* rstd, const bf16* dy, const DeltaNetGrads& g, void* workspace,
                               std::size_t bytes, cudaStream_t stream) {
  check_delta_net_shape(s);
  if (q.tokens == 0) return;
  const auto windows = plan_windows(s, q);
  const Work w = carve_work(s, q, windows.size(), workspace, bytes, true);
  for (std::size_t i = 0; i + 1 < windows.size(); ++i) {  // each window's starting state, in order
    const delta_rule::Rule r = prepare_rule(s, q, in, w, windows[i], i, stream);
    if (r.carry_out) delta_rule::forward(r, windows[i].chunks, w.rule, nullptr, nullptr, nullptr, stream);
  }
  for (std::size_t i = windows.size(); i-- > 0;)
    backward_window(s, q, in, o, rstd, dy, g, w, windows[i], i, w.dcarry[(i + 1) % 2], w.dcarry[i % 2], stream);
}

void launch_delta_net_fused_layout(const DeltaNetShape& s, std::int64_t n, bf16* qkvz, bf16* ba, bf16* mixed, bf16* z, bf16* b,
                                   bf16* a, bool to_fused, cudaStream_t stream) {
  check_delta_net_shape(s);
  if (n == 0) return;
  const i64 work = n * (2 * s.conv_dim() - 2 * s.key_dim() + 2 * s.value_heads);
  fused_layout_kernel<<<grid_for(work, 256), 256, 0, stream>>>(dev(qkvz), dev(ba), n, static_cast<int>(s.dk),
                                                               static_cast<int>(s.key_heads), static_cast<int>(s.value_heads),
                                                               static_cast<int>(s.dv), dev(mixed), dev(z), dev(b), dev(a),
                                                               to_fused);
  MT_CUDA_CHECK_LAUNCH("fused_layout_kernel");
}

}  // namespace megatrain::cuda
