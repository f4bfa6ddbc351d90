// The gated delta rule on the CPU (backend/cpu/delta_rule.hpp): the chunked form, forward and
// backward, in the precision of T (the state too), one (sequence, key head) pair a task.
#include "megatrain/backend/cpu/delta_rule.hpp"

#include <string_view>

#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "megatrain/core/error.hpp"

namespace megatrain::cpu {

namespace {

using i64 = std::int64_t;

template <class T>
T dot(const T* a, const T* b, i64 n) {
  T s = 0;
  for (i64 i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// One chunk of one value head: tokens [c0, c0 + n) of the sequence, its starting state S.
template <class T>
class Chunk {
 public:
  Chunk(const DeltaRule<T>& a, i64 h) : a_(a), h_(h), hk_(h / (a.value_heads / a.key_heads)) {}

  // The chunk's matrices (G, A, T = (I + A)^-1, S^T k, r, delta) from its state S.
  void prepare(i64 c0, i64 n, const T* S) {
    c0_ = c0;
    n_ = n;
    const i64 dv = a_.dv;
    G.assign(static_cast<std::size_t>(n), 0);
    for (i64 i = 0; i < n; ++i) G[u(i)] = (i > 0 ? G[u(i - 1)] : T(0)) + g(i);
    A.assign(u(n * n), 0);
    kk.assign(u(n * n), 0);
    for (i64 i = 0; i < n; ++i)
      for (i64 j = 0; j < i; ++j) {
        kk[u(i * n + j)] = dot(k(i), k(j), a_.dk);
        A[u(i * n + j)] = beta(i) * decay(i, j) * kk[u(i * n + j)];
      }
    // T = (I + A)^-1, lower triangular: row i = e_i - sum_{l < i} A_il row l
    Tm.assign(u(n * n), 0);
    for (i64 i = 0; i < n; ++i) {
      Tm[u(i * n + i)] = 1;
      for (i64 j = 0; j < i; ++j) {
        T s = 0;
        for (i64 l = j; l < i; ++l) s += A[u(i * n + l)] * Tm[u(l * n + j)];
        Tm[u(i * n + j)] = -s;
      }
    }
    Sk.assign(u(n * dv), 0);
    r.assign(u(n * dv), 0);
    for (i64 i = 0; i < n; ++i) {
      T* sk = &Sk[u(i * dv)];
      const T* ki = k(i);
      for (i64 x = 0; x < a_.dk; ++x)
        for (i64 y = 0; y < dv; ++y) sk[y] += S[x * dv + y] * ki[x];
      const T gi = std::exp(G[u(i)]);
      for (i64 y = 0; y < dv; ++y) r[u(i * dv + y)] = beta(i) * (v(i)[y] - gi * sk[y]);
    }
    delta.assign(u(n * dv), 0);
    for (i64 i = 0; i < n; ++i)
      for (i64 l = 0; l <= i; ++l) {
        const T t = Tm[u(i * n + l)];
        for (i64 y = 0; y < dv; ++y) delta[u(i * dv + y)] += t * r[u(l * dv + y)];
      }
  }

  // The chunk's outputs into o (rows of value_heads * dv), and S advanced to the chunk's end.
  void forward(T* o, T* S) const {
    const i64 dv = a_.dv, dk = a_.dk, n = n_;
    const T scale = static_cast<T>(a_.scale);
    for (i64 i = 0; i < n; ++i) {
      T* oi = o + (c0_ + i) * a_.value_heads * dv + h_ * dv;
      const T gi = std::exp(G[u(i)]);
      for (i64 y = 0; y < dv; ++y) oi[y] = 0;
      for (i64 x = 0; x < dk; ++x) {
        const T qx = gi * q(i)[x];
        for (i64 y = 0; y < dv; ++y) oi[y] += qx * S[x * dv + y];
      }
      for (i64 j = 0; j <= i; ++j) {
        const T m = decay(i, j) * dot(q(i), k(j), dk);
        for (i64 y = 0; y < dv; ++y) oi[y] += m * delta[u(j * dv + y)];
      }
      for (i64 y = 0; y < dv; ++y) oi[y] *= scale;
    }
    const T last = std::exp(G[u(n - 1)]);
    for (i64 x = 0; x < dk * dv; ++x) S[x] *= last;
    for (i64 j = 0; j < n; ++j) {
      const T e = decay(n - 1, j);
      for (i64 x = 0; x < dk; ++x) {
        const T kx = e * k(j)[x];
        for (i64 y = 0; y < dv; ++y) S[x * dv + y] += kx * delta[u(j * dv + y)];
      }
    }
  }

  // Where the chunk's backward writes: dq and dk (this key head's, dense rows of key_heads * dk,
  // added to), dv, dg and dbeta (this value head's, written).
  struct Grads {
    const T* dout;
    T *dq, *dk, *dv, *dg, *dbeta;
  };

  // The chunk's backward: from the outputs' gradient and dS, the gradient of the state at its
  // end, which becomes that of the state at its start (S).
  void backward(const T* S, T* dS, const Grads& out) {
    dG.assign(u(n_), 0);
    ddelta.assign(u(n_ * a_.dv), 0);
    state_update_backward(S, dS, out);
    outputs_backward(S, out);
    system_backward(out);
    std::vector<T> dS_in = inputs_backward(S, out);
    const T gam_last = std::exp(G[u(n_ - 1)]);
    for (i64 x = 0; x < a_.dk * a_.dv; ++x) dS[x] = gam_last * dS[x] + dS_in[u(x)];
    T acc = 0;  // G = cumsum(g): dg_i = sum_{l >= i} dG_l
    for (i64 i = n_ - 1; i >= 0; --i) {
      acc += dG[u(i)];
      out.dg[(c0_ + i) * a_.value_heads + h_] = acc;
    }
  }

 private:
  const T* dO(const Grads& o, i64 i) const { return o.dout + (c0_ + i) * a_.value_heads * a_.dv + h_ * a_.dv; }
  T* DQ(const Grads& o, i64 i) const { return o.dq + (c0_ + i) * a_.key_heads * a_.dk + hk_ * a_.dk; }
  T* DK(const Grads& o, i64 i) const { return o.dk + (c0_ + i) * a_.key_heads * a_.dk + hk_ * a_.dk; }

  // S' = exp(G_last) S + sum_j exp(G_last - G_j) k_j delta_j^T: its share of ddelta, dk and dG.
  void state_update_backward(const T* S, const T* dS, const Grads& out) {
    const i64 dv = a_.dv, dk = a_.dk, n = n_;
    std::vector<T> dSd(u(dk));  // dS delta_j
    for (i64 j = 0; j < n; ++j) {
      const T e = decay(n - 1, j);
      std::fill(dSd.begin(), dSd.end(), T(0));
      for (i64 x = 0; x < dk; ++x)
        for (i64 y = 0; y < dv; ++y) {
          dSd[u(x)] += dS[x * dv + y] * delta[u(j * dv + y)];
          ddelta[u(j * dv + y)] += e * dS[x * dv + y] * k(j)[x];
        }
      T kt = 0;  // e k_j . (dS delta_j): d/dG_last, and minus it d/dG_j
      for (i64 x = 0; x < dk; ++x) {
        kt += k(j)[x] * dSd[u(x)];
        DK(out, j)[x] += e * dSd[u(x)];
      }
      dG[u(n - 1)] += e * kt;
      dG[u(j)] -= e * kt;
    }
    T sdS = 0;  // <S, dS>, through exp(G_last) S
    for (i64 x = 0; x < dk * dv; ++x) sdS += S[x] * dS[x];
    dG[u(n - 1)] += std::exp(G[u(n - 1)]) * sdS;
  }

  // O = scale (diag(exp G) Q S + M delta), M_ij = exp(G_i - G_j) q_i.k_j (j <= i).
  void outputs_backward(const T* S, const Grads& out) {
    const i64 dv = a_.dv, dk = a_.dk, n = n_;
    const T scale = static_cast<T>(a_.scale);
    for (i64 i = 0; i < n; ++i) {
      const T gi = std::exp(G[u(i)]);
      const T* doi = dO(out, i);
      T inter = 0;  // dO_i . S^T q_i
      for (i64 x = 0; x < dk; ++x) {
        T sd = 0;  // (S dO_i)_x
        for (i64 y = 0; y < dv; ++y) sd += S[x * dv + y] * doi[y];
        DQ(out, i)[x] += scale * gi * sd;
        inter += q(i)[x] * sd;
      }
      dG[u(i)] += scale * gi * inter;
      for (i64 j = 0; j <= i; ++j) {
        const T e = decay(i, j), qk = dot(q(i), k(j), dk);
        const T dd = dot(doi, &delta[u(j * dv)], dv);  // dO_i . delta_j
        for (i64 y = 0; y < dv; ++y) ddelta[u(j * dv + y)] += scale * e * qk * doi[y];
        for (i64 x = 0; x < dk; ++x) {
          DQ(out, i)[x] += scale * e * dd * k(j)[x];
          DK(out, j)[x] += scale * e * dd * q(i)[x];
        }
        dG[u(i)] += scale * e * qk * dd;
        dG[u(j)] -= scale * e * qk * dd;
      }
    }
  }

  // delta = T r, T = (I + A)^-1: dr = T^T ddelta; dA_ij = -dr_i . delta_j (j < i), with
  // A_ij = beta_i exp(G_i - G_j) k_i.k_j.
  void system_backward(const Grads& out) {
    const i64 dv = a_.dv, dk = a_.dk, n = n_;
    dr.assign(u(n * dv), 0);
    for (i64 l = 0; l < n; ++l)
      for (i64 i = l; i < n; ++i)
        for (i64 y = 0; y < dv; ++y) dr[u(l * dv + y)] += Tm[u(i * n + l)] * ddelta[u(i * dv + y)];
    for (i64 i = 0; i < n; ++i)
      for (i64 j = 0; j < i; ++j) {
        const T da = -dot(&dr[u(i * dv)], &delta[u(j * dv)], dv);
        const T e = decay(i, j), w = da * beta(i) * e;
        out.dbeta[(c0_ + i) * a_.value_heads + h_] += da * e * kk[u(i * n + j)];
        for (i64 x = 0; x < dk; ++x) {
          DK(out, i)[x] += w * k(j)[x];
          DK(out, j)[x] += w * k(i)[x];
        }
        dG[u(i)] += da * A[u(i * n + j)];
        dG[u(j)] -= da * A[u(i * n + j)];
      }
  }

  // r_i = beta_i (v_i - exp(G_i) S^T k_i): dv, dbeta, dk and dG; returns dS's share from the
  // chunk's inputs and outputs (the start state's gradient less exp(G_last) dS).
  std::vector<T> inputs_backward(const T* S, const Grads& out) {
    const i64 dv = a_.dv, dk = a_.dk, n = n_, Hv = a_.value_heads;
    const T scale = static_cast<T>(a_.scale);
    std::vector<T> dS_in(u(dk * dv), 0);
    for (i64 i = 0; i < n; ++i) {
      const T gi = std::exp(G[u(i)]), b = beta(i);
      const T* dri = &dr[u(i * dv)];
      T* dvi = out.dv + (c0_ + i) * Hv * dv + h_ * dv;
      T db = 0, dsk = 0;
      for (i64 y = 0; y < dv; ++y) {
        dvi[y] = b * dri[y];
        db += dri[y] * (v(i)[y] - gi * Sk[u(i * dv + y)]);
        dsk += dri[y] * Sk[u(i * dv + y)];
      }
      out.dbeta[(c0_ + i) * Hv + h_] += db;
      dG[u(i)] -= b * gi * dsk;
      for (i64 x = 0; x < dk; ++x) {
        T sdr = 0;  // (S dr_i)_x
        for (i64 y = 0; y < dv; ++y) {
          sdr += S[x * dv + y] * dri[y];
          dS_in[u(x * dv + y)] += scale * gi * q(i)[x] * dO(out, i)[y] - b * gi * k(i)[x] * dri[y];
        }
        DK(out, i)[x] -= b * gi * sdr;
      }
    }
    return dS_in;
  }

  static std::size_t u(i64 i) { return static_cast<std::size_t>(i); }
  const T* q(i64 i) const { return a_.q + (c0_ + i) * a_.q_stride + hk_ * a_.dk; }
  const T* k(i64 i) const { return a_.k + (c0_ + i) * a_.k_stride + hk_ * a_.dk; }
  const T* v(i64 i) const { return a_.v + (c0_ + i) * a_.v_stride + h_ * a_.dv; }
  T g(i64 i) const { return a_.g[(c0_ + i) * a_.value_heads + h_]; }
  T beta(i64 i) const { return a_.beta[(c0_ + i) * a_.value_heads + h_]; }
  T decay(i64 i, i64 j) const { return std::exp(G[u(i)] - G[u(j)]); }

  const DeltaRule<T>& a_;
  i64 h_, hk_, c0_ = 0, n_ = 0;

 public:
  std::vector<T> G, kk, A, Tm, Sk, r, delta;
  std::vector<T> dG, ddelta, dr;  // (the backward's)
};

// Each sequence's first chunk among all sequences' chunks, then the total.
std::vector<i64> chunk_offsets(std::span<const std::int32_t> starts, i64 chunk) {
  std::vector<i64> off{0};
  for (std::size_t s = 0; s + 1 < starts.size(); ++s) off.push_back(off.back() + (starts[s + 1] - starts[s] + chunk - 1) / chunk);
  return off;
}

// f(sequence, key head) for every pair, in parallel.
template <class F>
void each_pair(const std::vector<i64>& offsets, i64 key_heads, F&& f) {
  const i64 seqs = static_cast<i64>(offsets.size()) - 1;
  tbb::parallel_for(tbb::blocked_range<i64>(0, seqs * key_heads), [&](const auto& range) {
    for (i64 p = range.begin(); p < range.end(); ++p) f(p / key_heads, p % key_heads);
  });
}

}  // namespace

template <class T>
std::int64_t DeltaRule<T>::chunks() const {
  return chunk_offsets(starts, chunk).back();
}

void check_sequence_starts(std::span<const std::int32_t> starts, std::string_view what) {
  MT_CHECK(!starts.empty() && starts.front() == 0, "{}: the sequences' starts must begin at 0", what);
  for (std::size_t s = 1; s < starts.size(); ++s)
    MT_CHECK(starts[s] > starts[s - 1], "{}: sequence {} is empty or its start goes back ({} then {})", what, s - 1,
             starts[s - 1], starts[s]);
}

template <class T>
void DeltaRule<T>::check() const {
  MT_CHECK(key_heads > 0 && value_heads > 0 && value_heads % key_heads == 0 && dk > 0 && dv > 0 && chunk > 0,
           "delta rule: {} key heads, {} value heads (a multiple of them), dk {}, dv {}, chunk {}", key_heads, value_heads, dk,
           dv, chunk);
  check_sequence_starts(starts, "delta rule");
  MT_CHECK(q_stride >= key_heads * dk && k_stride >= key_heads * dk && v_stride >= value_heads * dv,
           "delta rule: row strides q {}, k {}, v {} shorter than the heads' widths", q_stride, k_stride, v_stride);
}

template <class T>
void delta_rule_forward(const DeltaRule<T>& a, T* o, T* states) {
  a.check();
  const auto offsets = chunk_offsets(a.starts, a.chunk);
  const i64 ratio = a.value_heads / a.key_heads, state = a.dk * a.dv;
  each_pair(offsets, a.key_heads, [&](i64 s, i64 hk) {
    for (i64 h = hk * ratio; h < (hk + 1) * ratio; ++h) {
      Chunk<T> c(a, h);
      std::vector<T> S(static_cast<std::size_t>(state), T(0));
      i64 idx = offsets[static_cast<std::size_t>(s)];
      for (i64 c0 = a.starts[static_cast<std::size_t>(s)]; c0 < a.starts[static_cast<std::size_t>(s) + 1]; c0 += a.chunk, ++idx) {
        std::copy(S.begin(), S.end(), states + (idx * a.value_heads + h) * state);
        c.prepare(c0, std::min<i64>(a.chunk, a.starts[static_cast<std::size_t>(s) + 1] - c0), S.data());
        c.forward(o, S.data());
      }
    }
  });
}

template <class T>
void delta_rule_backward(const DeltaRule<T>& a, const T* states, const T* dout, T* dq, T* dk, T* dv, T* dg, T* dbeta) {
  a.check();
  const auto offsets = chunk_offsets(a.starts, a.chunk);
  const i64 ratio = a.value_heads / a.key_heads, state = a.dk * a.dv;
  each_pair(offsets, a.key_heads, [&](i64 s, i64 hk) {
    const i64 t0 = a.starts[static_cast<std::size_t>(s)], t1 = a.starts[static_cast<std::size_t>(s) + 1];
    for (i64 t = t0; t < t1; ++t) {  // (this pair's rows: dq, dk added to over the value heads)
      std::fill_n(dq + t * a.key_heads * a.dk + hk * a.dk, a.dk, T(0));
      std::fill_n(dk + t * a.key_heads * a.dk + hk * a.dk, a.dk, T(0));
      for (i64 h = hk * ratio; h < (hk + 1) * ratio; ++h) dbeta[t * a.value_heads + h] = 0;
    }
    for (i64 h = hk * ratio; h < (hk + 1) * ratio; ++h) {
      Chunk<T> c(a, h);
      std::vector<T> dS(static_cast<std::size_t>(state), T(0));
      const i64 first = offsets[static_cast<std::size_t>(s)], count = offsets[static_cast<std::size_t>(s) + 1] - first;
      for (i64 j = count - 1; j >= 0; --j) {
        const i64 c0 = t0 + j * a.chunk;
        const T* S = states + ((first + j) * a.value_heads + h) * state;
        c.prepare(c0, std::min<i64>(a.chunk, t1 - c0), S);
        c.backward(S, dS.data(), {dout, dq, dk, dv, dg, dbeta});
      }
    }
  });
}

template struct DeltaRule<float>;
template struct DeltaRule<double>;
template void delta_rule_forward<float>(const DeltaRule<float>&, float*, float*);
template void delta_rule_forward<double>(const DeltaRule<double>&, double*, double*);
template void delta_rule_backward<float>(const DeltaRule<float>&, const float*, const float*, float*, float*, float*, float*,
                                         float*);
template void delta_rule_backward<double>(const DeltaRule<double>&, const double*, const double*, double*, double*, double*,
                                          double*, double*);

}  // namespace megatrain::cpu
