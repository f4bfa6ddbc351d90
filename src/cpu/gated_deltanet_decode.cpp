// Gated DeltaNet's one-token step on the CPU (backend/cpu/gated_deltanet_decode.hpp).
#include "megatrain/backend/cpu/gated_deltanet_decode.hpp"

#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "megatrain/backend/cpu/gated_deltanet.hpp"
#include "megatrain/core/error.hpp"

namespace megatrain::cpu {

namespace {

using i64 = std::int64_t;
constexpr double kL2NormEps = 1e-6;  // (as the chunked mixing's)

std::size_t sz(i64 n) { return static_cast<std::size_t>(n); }

template <class T>
T silu(T x) {
  return x / (T(1) + std::exp(-x));
}

}  // namespace

template <class T>
void gated_deltanet_decode(const GatedDeltaNetMix<T>& m, std::span<const std::int32_t> positions, i64 first, T* taps, T* state,
                           T* y) {
  m.check();
  const i64 R = m.tokens(), cd = m.conv_dim(), kd = m.key_dim(), vd = m.value_dim(), hv = m.value_heads, K = m.taps;
  MT_CHECK(static_cast<i64>(positions.size()) == R && first >= 0 && taps && state && y,
           "Gated DeltaNet decoding: {} positions for {} rows", positions.size(), R);
  for (i64 r = 0; r < R; ++r)
    MT_CHECK(m.starts[sz(r) + 1] == r + 1 && positions[sz(r)] >= 0,
             "Gated DeltaNet decoding: one token a row at a position of 0 or more (row {}: position {})", r, positions[sz(r)]);
  const i64 tap_row = deltanet_taps_elements(cd, K), state_row = deltanet_state_elements(hv, m.dk, m.dv);
  // the convolution over each row's last K - 1 inputs and its new one; then the taps move on
  std::vector<T> c(sz(R * cd));
  tbb::parallel_for(i64{0}, R, [&](i64 r) {
    T* tp = taps + (first + r) * tap_row;
    T* st = state + (first + r) * state_row;
    if (positions[sz(r)] == 0) {  // (a new sequence: nothing before it)
      std::fill_n(tp, tap_row, T{});
      std::fill_n(st, state_row, T{});
    }
    const T* x = m.mixed + r * cd;
    for (i64 ch = 0; ch < cd; ++ch) {
      T p = 0;
      for (i64 j = 0; j + 1 < K; ++j) p += m.conv[ch * K + j] * tp[j * cd + ch];
      p += m.conv[ch * K + K - 1] * x[ch];
      c[sz(r * cd + ch)] = silu(p);
    }
    if (K > 1) {
      std::copy(tp + cd, tp + tap_row, tp);
      std::copy_n(x, cd, tp + (K - 2) * cd);
    }
  });
  std::vector<T> q(sz(R * kd)), k(sz(R * kd)), inv(sz(R * m.key_heads)), g(sz(R * hv)), beta(sz(R * hv)), o(sz(R * vd)),
      rstd(sz(R * hv));
  l2norm_heads(c.data(), cd, R, m.key_heads, m.dk, kL2NormEps, q.data(), inv.data());
  l2norm_heads(c.data() + kd, cd, R, m.key_heads, m.dk, kL2NormEps, k.data(), inv.data());
  deltanet_gates(m.a, hv, m.b, hv, m.A_log, m.dt_bias, R, hv, g.data(), beta.data());
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(m.dk)));
  const i64 per_key = hv / m.key_heads;
  tbb::parallel_for(i64{0}, R * hv, [&](i64 task) {
    const i64 r = task / hv, h = task % hv, kh = h / per_key;
    T* S = state + (first + r) * state_row + h * m.dk * m.dv;
    const T* qh = q.data() + r * kd + kh * m.dk;
    const T* kk = k.data() + r * kd + kh * m.dk;
    const T* v = c.data() + r * cd + 2 * kd + h * m.dv;
    const T decay = std::exp(g[sz(task)]), b = beta[sz(task)];
    std::vector<T> delta(sz(m.dv));
    for (i64 i = 0; i < m.dk * m.dv; ++i) S[i] *= decay;
    for (i64 j = 0; j < m.dv; ++j) {
      T kv = 0;
      for (i64 i = 0; i < m.dk; ++i) kv += S[i * m.dv + j] * kk[i];
      delta[sz(j)] = b * (v[j] - kv);
    }
    T* oh = o.data() + r * vd + h * m.dv;
    for (i64 j = 0; j < m.dv; ++j) oh[j] = 0;
    for (i64 i = 0; i < m.dk; ++i)
      for (i64 j = 0; j < m.dv; ++j) {
        S[i * m.dv + j] += kk[i] * delta[sz(j)];
        oh[j] += S[i * m.dv + j] * qh[i];
      }
    for (i64 j = 0; j < m.dv; ++j) oh[j] *= scale;
  });
  gated_rmsnorm(o.data(), m.z, vd, m.norm, R, hv, m.dv, m.norm_eps, y, rstd.data());
}

template void gated_deltanet_decode<float>(const GatedDeltaNetMix<float>&, std::span<const std::int32_t>, i64, float*, float*,
                                           float*);
template void gated_deltanet_decode<double>(const GatedDeltaNetMix<double>&, std::span<const std::int32_t>, i64, double*,
                                            double*, double*);

}  // namespace megatrain::cpu
