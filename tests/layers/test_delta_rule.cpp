// Gated DeltaNet on the CPU. The chunked gated delta rule (backend/cpu/delta_rule.hpp) against the recurrence
// itself, token by token, in long double: forward and backward (back-propagation through time),
// at awkward lengths (1, 63, 64, 65, 1000) with chunks of 64 and 16, several key heads and value
// heads sharing them, and sequences packed one after the other (the state restarting at each).
// The backward is also checked against central differences of the chunked forward in double.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "megatrain/backend/cpu/delta_rule.hpp"
#include "megatrain/backend/cpu/gated_deltanet.hpp"

using megatrain::cpu::DeltaRule;
using i64 = std::int64_t;
using LD = long double;

namespace {

struct Inputs {
  i64 Hk, Hv, dk, dv;
  std::vector<std::int32_t> starts;
  std::vector<double> q, k, v, g, beta, dout;
  i64 tokens() const { return starts.back(); }
};

// Random operands: q and k L2-normalised per head (as Gated DeltaNet gives them), g in
// [-1.5, -0.01] (exp(g) a decay), beta in (0, 1).
Inputs random_inputs(std::mt19937_64& rng, std::vector<std::int32_t> lengths, i64 Hk, i64 Hv, i64 dk, i64 dv) {
  std::uniform_real_distribution<double> u(-1, 1), ug(-1.5, -0.01), ub(0.05, 0.95);
  Inputs in{Hk, Hv, dk, dv, {0}, {}, {}, {}, {}, {}, {}};
  for (const auto len : lengths) in.starts.push_back(in.starts.back() + len);
  const i64 T = in.tokens();
  for (auto* x : {&in.q, &in.k}) {
    x->resize(static_cast<std::size_t>(T * Hk * dk));
    for (auto& e : *x) e = u(rng);
    for (i64 r = 0; r < T * Hk; ++r) {  // (each head's vector to unit length)
      double n = 0;
      for (i64 i = 0; i < dk; ++i) n += (*x)[static_cast<std::size_t>(r * dk + i)] * (*x)[static_cast<std::size_t>(r * dk + i)];
      for (i64 i = 0; i < dk; ++i) (*x)[static_cast<std::size_t>(r * dk + i)] /= std::sqrt(n);
    }
  }
  in.v.resize(static_cast<std::size_t>(T * Hv * dv));
  in.dout.resize(in.v.size());
  for (auto& e : in.v) e = u(rng);
  for (auto& e : in.dout) e = u(rng);
  in.g.resize(static_cast<std::size_t>(T * Hv));
  in.beta.resize(in.g.size());
  for (auto& e : in.g) e = ug(rng);
  for (auto& e : in.beta) e = ub(rng);
  return in;
}

template <class T>
std::vector<T> as(const std::vector<double>& x) {
  return std::vector<T>(x.begin(), x.end());
}

template <class T>
struct Run {
  std::vector<T> q, k, v, g, beta, dout;
  DeltaRule<T> rule;
  std::vector<T> o, states, dq, dk, dv, dg, dbeta;
  Run(const Inputs& in, i64 chunk)
      : q(as<T>(in.q)), k(as<T>(in.k)), v(as<T>(in.v)), g(as<T>(in.g)), beta(as<T>(in.beta)), dout(as<T>(in.dout)) {
    rule.key_heads = in.Hk;
    rule.value_heads = in.Hv;
    rule.dk = in.dk;
    rule.dv = in.dv;
    rule.chunk = chunk;
    rule.starts = in.starts;
    rule.q = q.data();
    rule.k = k.data();
    rule.v = v.data();
    rule.q_stride = rule.k_stride = in.Hk * in.dk;
    rule.v_stride = in.Hv * in.dv;
    rule.g = g.data();
    rule.beta = beta.data();
    rule.scale = 1.0 / std::sqrt(static_cast<double>(in.dk));
    forward();
  }
  void forward() {
    o.assign(v.size(), T(0));
    states.assign(static_cast<std::size_t>(rule.chunks() * rule.value_heads * rule.dk * rule.dv), T(0));
    megatrain::cpu::delta_rule_forward(rule, o.data(), states.data());
  }
  void backward() {
    dq.assign(q.size(), T(0));
    dk.assign(k.size(), T(0));
    dv.assign(v.size(), T(0));
    dg.assign(g.size(), T(0));
    dbeta.assign(beta.size(), T(0));
    megatrain::cpu::delta_rule_backward(rule, states.data(), dout.data(), dq.data(), dk.data(), dv.data(), dg.data(),
                                        dbeta.data());
  }
};

// The recurrence token by token in long double, then back-propagation through it.
struct Reference {
  std::vector<LD> o, gq, gk, gv, gg, gbeta;  // the outputs; the gradients of q, k, v, g, beta
  explicit Reference(const Inputs& in) {
    const i64 T = in.tokens(), Hk = in.Hk, Hv = in.Hv, dk = in.dk, dv = in.dv, ratio = Hv / Hk;
    const LD scale = 1 / std::sqrt(static_cast<LD>(dk));
    o.assign(static_cast<std::size_t>(T * Hv * dv), 0);
    gv.assign(o.size(), 0);
    gq.assign(static_cast<std::size_t>(T * Hk * dk), 0);
    gk.assign(gq.size(), 0);
    gg.assign(static_cast<std::size_t>(T * Hv), 0);
    gbeta.assign(gg.size(), 0);
    const auto at = [](i64 t, i64 heads, i64 h, i64 d) { return static_cast<std::size_t>((t * heads + h) * d); };
    for (std::size_t s = 0; s + 1 < in.starts.size(); ++s)
      for (i64 h = 0; h < Hv; ++h) {
        const i64 hk = h / ratio, t0 = in.starts[s], t1 = in.starts[s + 1];
        std::vector<std::vector<LD>> St, Sp;  // S_t and exp(g_t) S_{t-1}, per token
        std::vector<std::vector<LD>> kvs;
        std::vector<LD> S(static_cast<std::size_t>(dk * dv), 0);
        for (i64 t = t0; t < t1; ++t) {
          const LD e = std::exp(static_cast<LD>(in.g[static_cast<std::size_t>(t * Hv + h)]));
          const LD b = in.beta[static_cast<std::size_t>(t * Hv + h)];
          const double* kt = &in.k[at(t, Hk, hk, dk)];
          const double* vt = &in.v[at(t, Hv, h, dv)];
          const double* qt = &in.q[at(t, Hk, hk, dk)];
          for (auto& x : S) x *= e;
          Sp.push_back(S);
          std::vector<LD> kv(static_cast<std::size_t>(dv), 0);
          for (i64 x = 0; x < dk; ++x)
            for (i64 y = 0; y < dv; ++y) kv[static_cast<std::size_t>(y)] += S[static_cast<std::size_t>(x * dv + y)] * kt[x];
          kvs.push_back(kv);
          for (i64 x = 0; x < dk; ++x)
            for (i64 y = 0; y < dv; ++y)
              S[static_cast<std::size_t>(x * dv + y)] += kt[x] * b * (vt[y] - kv[static_cast<std::size_t>(y)]);
          St.push_back(S);
          for (i64 y = 0; y < dv; ++y) {
            LD acc = 0;
            for (i64 x = 0; x < dk; ++x) acc += S[static_cast<std::size_t>(x * dv + y)] * qt[x];
            o[at(t, Hv, h, dv) + static_cast<std::size_t>(y)] = scale * acc;
          }
        }
        std::vector<LD> dS(static_cast<std::size_t>(dk * dv), 0);
        for (i64 t = t1 - 1; t >= t0; --t) {
          const auto l = static_cast<std::size_t>(t - t0);
          const LD e = std::exp(static_cast<LD>(in.g[static_cast<std::size_t>(t * Hv + h)]));
          const LD b = in.beta[static_cast<std::size_t>(t * Hv + h)];
          const double* kt = &in.k[at(t, Hk, hk, dk)];
          const double* vt = &in.v[at(t, Hv, h, dv)];
          const double* qt = &in.q[at(t, Hk, hk, dk)];
          const double* dot = &in.dout[at(t, Hv, h, dv)];
          for (i64 x = 0; x < dk; ++x)
            for (i64 y = 0; y < dv; ++y) {
              dS[static_cast<std::size_t>(x * dv + y)] += scale * qt[x] * dot[y];
              gq[at(t, Hk, hk, dk) + static_cast<std::size_t>(x)] += scale * St[l][static_cast<std::size_t>(x * dv + y)] * dot[y];
            }
          std::vector<LD> ddelta(static_cast<std::size_t>(dv), 0);
          for (i64 x = 0; x < dk; ++x)
            for (i64 y = 0; y < dv; ++y) {
              const LD delta = b * (vt[y] - kvs[l][static_cast<std::size_t>(y)]);
              gk[at(t, Hk, hk, dk) + static_cast<std::size_t>(x)] += dS[static_cast<std::size_t>(x * dv + y)] * delta;
              ddelta[static_cast<std::size_t>(y)] += dS[static_cast<std::size_t>(x * dv + y)] * kt[x];
            }
          for (i64 y = 0; y < dv; ++y) {
            const auto yy = static_cast<std::size_t>(y);
            gv[at(t, Hv, h, dv) + yy] = b * ddelta[yy];
            gbeta[static_cast<std::size_t>(t * Hv + h)] += ddelta[yy] * (vt[y] - kvs[l][yy]);
          }
          for (i64 x = 0; x < dk; ++x)  // kv = S'^T k: dS' += k (-b ddelta)^T, dk += S' (-b ddelta)
            for (i64 y = 0; y < dv; ++y) {
              const LD dkv = -b * ddelta[static_cast<std::size_t>(y)];
              dS[static_cast<std::size_t>(x * dv + y)] += kt[x] * dkv;
              gk[at(t, Hk, hk, dk) + static_cast<std::size_t>(x)] += Sp[l][static_cast<std::size_t>(x * dv + y)] * dkv;
            }
          LD dgt = 0;
          for (std::size_t x = 0; x < dS.size(); ++x) dgt += Sp[l][x] * dS[x];
          gg[static_cast<std::size_t>(t * Hv + h)] = dgt;
          for (auto& x : dS) x *= e;
        }
      }
  }
};

// Largest |a - b| relative to the largest |b|.
template <class A, class B>
double rel(const std::vector<A>& a, const std::vector<B>& b) {
  double worst = 0, largest = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, static_cast<double>(std::fabs(static_cast<LD>(a[i]) - static_cast<LD>(b[i]))));
    largest = std::max(largest, static_cast<double>(std::fabs(static_cast<LD>(b[i]))));
  }
  return largest > 0 ? worst / largest : worst;
}

struct Case {
  std::vector<std::int32_t> lengths;
  i64 Hk, Hv, dk, dv, chunk;
};

}  // namespace

TEST_CASE("the chunked delta rule equals the recurrence, forward and backward (double to 1e-12, float to its epsilon)") {
  std::mt19937_64 rng(7);
  const Case cases[] = {{{1}, 1, 1, 8, 8, 64},        {{63}, 2, 2, 16, 8, 64},           {{64}, 1, 2, 8, 12, 64},
                        {{65}, 2, 4, 8, 8, 64},       {{1000}, 1, 2, 16, 16, 64},        {{70}, 1, 1, 8, 8, 16},
                        {{5, 64, 1, 33}, 2, 4, 8, 8, 16}, {{17, 130, 2}, 1, 3, 12, 6, 64}};
  for (const Case& c : cases) {
    CAPTURE(c.lengths.size());
    CAPTURE(c.lengths.front());
    CAPTURE(c.Hv);
    CAPTURE(c.chunk);
    const Inputs in = random_inputs(rng, c.lengths, c.Hk, c.Hv, c.dk, c.dv);
    const Reference ref(in);
    Run<double> d(in, c.chunk);
    d.backward();
    CHECK(rel(d.o, ref.o) < 1e-12);
    CHECK(rel(d.dq, ref.gq) < 1e-12);
    CHECK(rel(d.dk, ref.gk) < 1e-12);
    CHECK(rel(d.dv, ref.gv) < 1e-12);
    CHECK(rel(d.dg, ref.gg) < 1e-12);
    CHECK(rel(d.dbeta, ref.gbeta) < 1e-12);
    Run<float> f(in, c.chunk);
    f.backward();
    const double eps = 0x1p-23;  // float's
    CHECK(rel(f.o, ref.o) < 64 * eps);
    CHECK(rel(f.dq, ref.gq) < 256 * eps);
    CHECK(rel(f.dk, ref.gk) < 256 * eps);
    CHECK(rel(f.dv, ref.gv) < 256 * eps);
    CHECK(rel(f.dg, ref.gg) < 256 * eps);
    CHECK(rel(f.dbeta, ref.gbeta) < 256 * eps);
  }
}

TEST_CASE("the delta rule's backward agrees with central differences of its forward (double)") {
  std::mt19937_64 rng(11);
  const Inputs in = random_inputs(rng, {9, 40}, 1, 2, 6, 5);
  Run<double> r(in, 16);
  r.backward();
  const auto loss = [&] {
    r.forward();
    double l = 0;
    for (std::size_t i = 0; i < r.o.size(); ++i) l += r.o[i] * r.dout[i];
    return l;
  };
  double worst = 0;
  for (auto [x, dx] : {std::pair{&r.q, &r.dq}, {&r.k, &r.dk}, {&r.v, &r.dv}, {&r.g, &r.dg}, {&r.beta, &r.dbeta}}) {
    for (std::size_t i = 3; i < x->size(); i += x->size() / 7 + 1) {
      const double saved = (*x)[i], h = 1e-5;
      (*x)[i] = saved + h;
      const double lp = loss();
      (*x)[i] = saved - h;
      const double lm = loss();
      (*x)[i] = saved;
      const double numeric = (lp - lm) / (2 * h);
      worst = std::max(worst, std::fabs(numeric - (*dx)[i]) / std::max(1e-3, std::fabs(numeric) + std::fabs((*dx)[i])));
    }
  }
  MESSAGE("worst relative difference from central differences: " << worst);
  CHECK(worst < 1e-7);  // (central differences with h = 1e-5: their own error is about 1e-9 here)
}

TEST_CASE("the delta rule refuses heads, sizes and sequence starts that do not fit") {
  std::vector<double> x(64, 0.1);
  const std::vector<std::int32_t> starts{0, 4, 4};
  DeltaRule<double> a;
  a.key_heads = 2;
  a.value_heads = 3;
  a.dk = a.dv = 2;
  a.starts = starts;
  a.q = a.k = a.v = a.g = a.beta = x.data();
  a.q_stride = a.k_stride = 4;
  a.v_stride = 6;
  CHECK_THROWS_WITH(a.check(), doctest::Contains("a multiple of them"));
  a.value_heads = 4;
  a.v_stride = 8;
  CHECK_THROWS_WITH(a.check(), doctest::Contains("sequence 1 is empty"));
}

// ---- the layer's element-wise parts (backend/cpu/gated_deltanet.hpp) --------------------------------

namespace {

// Central differences of sum(r * f()) with respect to every `stride`-th element of x, against g.
template <class F>
double worst_difference(std::vector<double>& x, const std::vector<double>& g, F&& loss, std::size_t stride = 1) {
  double worst = 0;
  for (std::size_t i = 0; i < x.size(); i += stride) {
    const double saved = x[i], h = 1e-5;
    x[i] = saved + h;
    const double lp = loss();
    x[i] = saved - h;
    const double lm = loss();
    x[i] = saved;
    const double numeric = (lp - lm) / (2 * h);
    worst = std::max(worst, std::fabs(numeric - g[i]) / std::max(1e-3, std::fabs(numeric) + std::fabs(g[i])));
  }
  return worst;
}

std::vector<double> uniform(std::mt19937_64& rng, std::size_t n, double lo, double hi) {
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<double> v(n);
  for (auto& e : v) e = u(rng);
  return v;
}

double weighted_sum(const std::vector<double>& y, const std::vector<double>& r, std::int64_t ys = 0, std::int64_t width = 0) {
  double l = 0;
  if (ys == 0) {
    for (std::size_t i = 0; i < y.size(); ++i) l += r[i] * y[i];
    return l;
  }
  for (std::size_t t = 0; t * static_cast<std::size_t>(ys) < y.size(); ++t)
    for (std::int64_t c = 0; c < width; ++c) l += r[t * static_cast<std::size_t>(width) + static_cast<std::size_t>(c)] * y[t * static_cast<std::size_t>(ys) + static_cast<std::size_t>(c)];
  return l;
}

}  // namespace

TEST_CASE("Gated DeltaNet's causal convolution: each packed sequence alone, as a zero-padded conv1d; its backward by differences") {
  std::mt19937_64 rng(3);
  const std::int64_t C = 5, K = 4, xs = 7;  // (x a slice of rows of 7: the projection's wider output)
  const std::vector<std::int32_t> starts{0, 2, 9, 10, 16};
  const std::int64_t T = starts.back();
  auto x = uniform(rng, static_cast<std::size_t>(T * xs), -1, 1), w = uniform(rng, static_cast<std::size_t>(C * K), -1, 1);
  const auto r = uniform(rng, static_cast<std::size_t>(T * C), -1, 1);
  std::vector<double> y(static_cast<std::size_t>(T * C));
  megatrain::cpu::causal_conv_silu(x.data(), xs, w.data(), C, K, starts, y.data(), C);
  double worst = 0;  // each sequence as torch's conv1d with K - 1 zeros before it, then SiLU
  for (std::size_t q = 0; q + 1 < starts.size(); ++q)
    for (std::int64_t t = starts[q]; t < starts[q + 1]; ++t)
      for (std::int64_t c = 0; c < C; ++c) {
        double p = 0;
        for (std::int64_t j = 0; j < K; ++j) {
          const std::int64_t s = t - (K - 1) + j;
          p += w[static_cast<std::size_t>(c * K + j)] * (s >= starts[q] ? x[static_cast<std::size_t>(s * xs + c)] : 0.0);
        }
        worst = std::max(worst, std::fabs(y[static_cast<std::size_t>(t * C + c)] - p / (1 + std::exp(-p))));
      }
  CHECK(worst < 1e-15);
  std::vector<double> dx(x.size(), 0), dw(w.size(), 0);
  megatrain::cpu::causal_conv_silu_backward(x.data(), xs, w.data(), C, K, starts, r.data(), C, dx.data(), dw.data());
  const auto loss = [&] {
    megatrain::cpu::causal_conv_silu(x.data(), xs, w.data(), C, K, starts, y.data(), C);
    return weighted_sum(y, r);
  };
  for (std::int64_t t = 0; t < T; ++t)  // (the columns beyond the channels get no gradient: zero both)
    for (std::int64_t c = C; c < xs; ++c) dx[static_cast<std::size_t>(t * xs + c)] = 0;
  CHECK(worst_difference(x, dx, loss) < 1e-7);
  CHECK(worst_difference(w, dw, loss) < 1e-7);
}

TEST_CASE("Gated DeltaNet's L2 norm, gates and gated RMSNorm: their formulas, and their backward by differences") {
  std::mt19937_64 rng(5);
  const std::int64_t T = 6, H = 3, D = 5;
  // L2 norm of each head's vector, from rows of 17 (a slice)
  auto x = uniform(rng, static_cast<std::size_t>(T * 17), -1, 1);
  const auto r = uniform(rng, static_cast<std::size_t>(T * H * D), -1, 1);
  std::vector<double> y(static_cast<std::size_t>(T * H * D)), inv(static_cast<std::size_t>(T * H));
  const auto l2 = [&] {
    megatrain::cpu::l2norm_heads(x.data(), 17, T, H, D, 1e-6, y.data(), inv.data());
    return weighted_sum(y, r);
  };
  (void)l2();
  double n = 0;
  for (std::int64_t i = 0; i < D; ++i) n += x[static_cast<std::size_t>(17 + 2 * D + i)] * x[static_cast<std::size_t>(17 + 2 * D + i)];
  CHECK(y[static_cast<std::size_t>((1 * H + 2) * D)] == doctest::Approx(x[static_cast<std::size_t>(17 + 2 * D)] / std::sqrt(n + 1e-6)).epsilon(1e-15));
  std::vector<double> dx(x.size(), 0);
  megatrain::cpu::l2norm_heads_backward(y.data(), inv.data(), r.data(), T, H, D, dx.data(), 17);
  CHECK(worst_difference(x, dx, l2) < 1e-7);

  // gates: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b); a and b slices of rows of 8
  auto a = uniform(rng, static_cast<std::size_t>(T * 8), -3, 3), b = a;
  for (auto& e : b) e = -e * 0.7;
  a[8 * 1 + 2] = 25;  // (token 1, head 2: softplus beyond its threshold, the input itself)
  auto A_log = uniform(rng, static_cast<std::size_t>(H), -1, 2), dt = uniform(rng, static_cast<std::size_t>(H), -1, 1);
  const auto rg = uniform(rng, static_cast<std::size_t>(T * H), -1, 1), rb = uniform(rng, static_cast<std::size_t>(T * H), -1, 1);
  std::vector<double> g(static_cast<std::size_t>(T * H)), beta(g.size());
  const auto gates = [&] {
    megatrain::cpu::deltanet_gates(a.data(), 8, b.data(), 8, A_log.data(), dt.data(), T, H, g.data(), beta.data());
    return weighted_sum(g, rg) + weighted_sum(beta, rb);
  };
  (void)gates();
  CHECK(g[2 * H + 1] == doctest::Approx(-std::exp(A_log[1]) * std::log1p(std::exp(a[8 * 2 + 1] + dt[1]))).epsilon(1e-15));
  CHECK(g[1 * H + 2] == doctest::Approx(-std::exp(A_log[2]) * (a[8 * 1 + 2] + dt[2])).epsilon(1e-15));
  CHECK(beta[1 * H + 1] == doctest::Approx(1 / (1 + std::exp(-b[8 * 1 + 1]))).epsilon(1e-15));
  std::vector<double> da(a.size(), 0), db(b.size(), 0), dA(A_log.size(), 0), ddt(dt.size(), 0);
  megatrain::cpu::deltanet_gates_backward(a.data(), 8, 8, A_log.data(), dt.data(), g.data(), beta.data(), rg.data(), rb.data(), T,
                                          H, da.data(), db.data(), dA.data(), ddt.data());
  CHECK(worst_difference(a, da, gates) < 1e-7);
  CHECK(worst_difference(b, db, gates) < 1e-7);
  CHECK(worst_difference(A_log, dA, gates) < 1e-7);
  CHECK(worst_difference(dt, ddt, gates) < 1e-7);

  // gated RMSNorm: w * x / sqrt(mean x^2 + eps) * silu(z), z a slice of rows of 19
  auto xn = uniform(rng, static_cast<std::size_t>(T * H * D), -1, 1), z = uniform(rng, static_cast<std::size_t>(T * 19), -2, 2);
  auto wn = uniform(rng, static_cast<std::size_t>(D), 0.5, 1.5);
  std::vector<double> yn(xn.size()), rstd(static_cast<std::size_t>(T * H));
  const auto norm = [&] {
    megatrain::cpu::gated_rmsnorm(xn.data(), z.data(), 19, wn.data(), T, H, D, 1e-6, yn.data(), rstd.data());
    return weighted_sum(yn, r);
  };
  (void)norm();
  double ms = 0;
  for (std::int64_t i = 0; i < D; ++i) ms += xn[static_cast<std::size_t>(D + i)] * xn[static_cast<std::size_t>(D + i)] / D;
  const double z0 = z[static_cast<std::size_t>(D)];
  CHECK(yn[static_cast<std::size_t>(D)] ==
        doctest::Approx(wn[0] * xn[static_cast<std::size_t>(D)] / std::sqrt(ms + 1e-6) * z0 / (1 + std::exp(-z0))).epsilon(1e-14));
  std::vector<double> dxn(xn.size(), 0), dz(z.size(), 0), dwn(wn.size(), 0);
  megatrain::cpu::gated_rmsnorm_backward(xn.data(), z.data(), 19, wn.data(), rstd.data(), r.data(), T, H, D, dxn.data(),
                                         dz.data(), dwn.data());
  CHECK(worst_difference(xn, dxn, norm) < 1e-7);
  CHECK(worst_difference(z, dz, norm) < 1e-7);
  CHECK(worst_difference(wn, dwn, norm) < 1e-7);
}
