// Gated DeltaNet's mixing on the CPU (backend/cpu/gated_deltanet_mix.hpp): its parts in order.
#include "megatrain/backend/cpu/gated_deltanet_mix.hpp"

#include <cmath>
#include <cstddef>
#include <vector>

#include "megatrain/backend/cpu/delta_rule.hpp"
#include "megatrain/backend/cpu/gated_deltanet.hpp"
#include "megatrain/core/error.hpp"

namespace megatrain::cpu {

namespace {

using i64 = std::int64_t;
constexpr double kL2NormEps = 1e-6;  // (transformers' l2norm in its delta-rule functions)

std::size_t sz(i64 n) { return static_cast<std::size_t>(n); }

/// What the forward makes before the delta rule, recomputed by the backward: the convolution's
/// output, the normalised q and k (and their scales), the gates.
template <class T>
struct Inner {
  std::vector<T> c, q, k, inv_q, inv_k, g, beta;

  explicit Inner(const GatedDeltaNetMix<T>& m) {
    const i64 n = m.tokens(), cd = m.conv_dim(), kd = m.key_dim(), hv = m.value_heads;
    c.resize(sz(n * cd));
    q.resize(sz(n * kd));
    k.resize(sz(n * kd));
    inv_q.resize(sz(n * m.key_heads));
    inv_k.resize(sz(n * m.key_heads));
    g.resize(sz(n * hv));
    beta.resize(sz(n * hv));
    causal_conv_silu(m.mixed, cd, m.conv, cd, m.taps, m.starts, c.data(), cd);
    l2norm_heads(c.data(), cd, n, m.key_heads, m.dk, kL2NormEps, q.data(), inv_q.data());
    l2norm_heads(c.data() + kd, cd, n, m.key_heads, m.dk, kL2NormEps, k.data(), inv_k.data());
    deltanet_gates(m.a, hv, m.b, hv, m.A_log, m.dt_bias, n, hv, g.data(), beta.data());
  }

  DeltaRule<T> rule(const GatedDeltaNetMix<T>& m) const {
    DeltaRule<T> r;
    r.key_heads = m.key_heads;
    r.value_heads = m.value_heads;
    r.dk = m.dk;
    r.dv = m.dv;
    r.chunk = m.chunk;
    r.starts = m.starts;
    r.q = q.data();
    r.k = k.data();
    r.v = c.data() + 2 * m.key_dim();
    r.q_stride = r.k_stride = m.key_dim();
    r.v_stride = m.conv_dim();
    r.g = g.data();
    r.beta = beta.data();
    r.scale = 1.0 / std::sqrt(static_cast<double>(m.dk));
    return r;
  }
};

}  // namespace

template <class T>
void GatedDeltaNetMix<T>::check() const {
  MT_CHECK(key_heads > 0 && value_heads > 0 && value_heads % key_heads == 0 && dk > 0 && dv > 0 && taps > 0 && chunk > 0,
           "Gated DeltaNet: {} key heads, {} value heads (a multiple of them), dk {}, dv {}, {} taps, chunk {}", key_heads,
           value_heads, dk, dv, taps, chunk);
  check_sequence_starts(starts, "Gated DeltaNet");
  MT_CHECK(mixed && z && a && b && conv && A_log && dt_bias && norm, "Gated DeltaNet: an operand is missing");
}

template <class T>
void gated_deltanet_mix(const GatedDeltaNetMix<T>& m, T* o, T* rstd, T* y) {
  m.check();
  const Inner<T> in(m);
  const DeltaRule<T> rule = in.rule(m);
  std::vector<T> states(sz(rule.chunks() * m.value_heads * m.dk * m.dv));
  delta_rule_forward(rule, o, states.data());
  gated_rmsnorm(o, m.z, m.value_dim(), m.norm, m.tokens(), m.value_heads, m.dv, m.norm_eps, y, rstd);
}

template <class T>
void gated_deltanet_mix_backward(const GatedDeltaNetMix<T>& m, const T* o, const T* rstd, const T* dy,
                                 const GatedDeltaNetMixGrads<T>& g) {
  m.check();
  const i64 n = m.tokens(), cd = m.conv_dim(), kd = m.key_dim(), vd = m.value_dim(), hv = m.value_heads;
  const Inner<T> in(m);
  const DeltaRule<T> rule = in.rule(m);
  std::vector<T> states(sz(rule.chunks() * hv * m.dk * m.dv));
  std::vector<T> o_again(sz(n * vd));
  delta_rule_forward(rule, o_again.data(), states.data());
  // the gated norm: do and dz
  std::vector<T> d_o(sz(n * vd));
  gated_rmsnorm_backward(o, m.z, vd, m.norm, rstd, dy, n, hv, m.dv, d_o.data(), g.z, g.norm);
  // the delta rule: dq, dk (normalised), dv, dg, dbeta
  std::vector<T> dq(sz(n * kd)), dk(sz(n * kd)), dv(sz(n * vd)), dgate(sz(n * hv)), dbeta(sz(n * hv));
  delta_rule_backward(rule, states.data(), d_o.data(), dq.data(), dk.data(), dv.data(), dgate.data(), dbeta.data());
  // into the convolution's output: q and k through their norms, v as it is
  std::vector<T> dc(sz(n * cd));
  l2norm_heads_backward(in.q.data(), in.inv_q.data(), dq.data(), n, m.key_heads, m.dk, dc.data(), cd);
  l2norm_heads_backward(in.k.data(), in.inv_k.data(), dk.data(), n, m.key_heads, m.dk, dc.data() + kd, cd);
  for (i64 t = 0; t < n; ++t)
    for (i64 j = 0; j < vd; ++j) dc[sz(t * cd + 2 * kd + j)] = dv[sz(t * vd + j)];
  deltanet_gates_backward(m.a, hv, hv, m.A_log, m.dt_bias, in.g.data(), in.beta.data(), dgate.data(), dbeta.data(), n, hv,
                          g.a, g.b, g.A_log, g.dt_bias);
  causal_conv_silu_backward(m.mixed, cd, m.conv, cd, m.taps, m.starts, dc.data(), cd, g.mixed, g.conv);
}

template struct GatedDeltaNetMix<float>;
template struct GatedDeltaNetMix<double>;
template void gated_deltanet_mix<float>(const GatedDeltaNetMix<float>&, float*, float*, float*);
template void gated_deltanet_mix<double>(const GatedDeltaNetMix<double>&, double*, double*, double*);
template void gated_deltanet_mix_backward<float>(const GatedDeltaNetMix<float>&, const float*, const float*, const float*,
                                                 const GatedDeltaNetMixGrads<float>&);
template void gated_deltanet_mix_backward<double>(const GatedDeltaNetMix<double>&, const double*, const double*,
                                                  const double*, const GatedDeltaNetMixGrads<double>&);

}  // namespace megatrain::cpu
