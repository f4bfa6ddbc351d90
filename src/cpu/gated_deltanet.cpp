// Gated DeltaNet's element-wise parts on the CPU (backend/cpu/gated_deltanet.hpp).
#include "megatrain/backend/cpu/gated_deltanet.hpp"

#include <oneapi/tbb/parallel_for.h>

#include <cmath>
#include <cstddef>

namespace megatrain::cpu {

namespace {

using i64 = std::int64_t;

template <class T>
T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}
template <class T>
T silu(T x) {
  return x * sigmoid(x);
}
template <class T>
T silu_grad(T x) {  // d silu / dx = s (1 + x (1 - s))
  const T s = sigmoid(x);
  return s * (T(1) + x * (T(1) - s));
}
template <class T>
T softplus(T x) {  // (torch's threshold: x above 20 passes through)
  return x > T(20) ? x : std::log1p(std::exp(x));
}

template <class F>
void parallel(i64 n, F&& f) {
  tbb::parallel_for(tbb::blocked_range<i64>(0, n), [&](const auto& r) {
    for (i64 i = r.begin(); i < r.end(); ++i) f(i);
  });
}

// The pre-activation p[t, c] of the convolution, the sequence [t0, t1) holding t.
template <class T>
T conv_at(const T* x, i64 xs, const T* w, i64 taps, i64 c, i64 t, i64 t0) {
  T p = 0;
  for (i64 j = 0; j < taps; ++j) {
    const i64 s = t - taps + 1 + j;
    if (s >= t0) p += w[c * taps + j] * x[s * xs + c];
  }
  return p;
}

}  // namespace

template <class T>
void causal_conv_silu(const T* x, i64 xs, const T* w, i64 channels, i64 taps, std::span<const std::int32_t> starts, T* y,
                      i64 ys) {
  parallel(channels, [&](i64 c) {
    for (std::size_t q = 0; q + 1 < starts.size(); ++q)
      for (i64 t = starts[q]; t < starts[q + 1]; ++t) y[t * ys + c] = silu(conv_at(x, xs, w, taps, c, t, starts[q]));
  });
}

template <class T>
void causal_conv_silu_backward(const T* x, i64 xs, const T* w, i64 channels, i64 taps, std::span<const std::int32_t> starts,
                               const T* dy, i64 ys, T* dx, T* dw) {
  parallel(channels, [&](i64 c) {
    for (std::size_t q = 0; q + 1 < starts.size(); ++q) {
      const i64 t0 = starts[q], t1 = starts[q + 1];
      for (i64 t = t0; t < t1; ++t) dx[t * xs + c] = 0;
      for (i64 t = t0; t < t1; ++t) {
        const T dp = dy[t * ys + c] * silu_grad(conv_at(x, xs, w, taps, c, t, t0));
        for (i64 j = 0; j < taps; ++j) {
          const i64 s = t - taps + 1 + j;
          if (s < t0) continue;
          dx[s * xs + c] += w[c * taps + j] * dp;
          dw[c * taps + j] += x[s * xs + c] * dp;
        }
      }
    }
  });
}

template <class T>
void l2norm_heads(const T* x, i64 xs, i64 tokens, i64 heads, i64 dim, double eps, T* y, T* inv) {
  parallel(tokens * heads, [&](i64 r) {
    const T* xr = x + (r / heads) * xs + (r % heads) * dim;
    T s = 0;
    for (i64 i = 0; i < dim; ++i) s += xr[i] * xr[i];
    const T k = T(1) / std::sqrt(s + static_cast<T>(eps));
    inv[r] = k;
    for (i64 i = 0; i < dim; ++i) y[r * dim + i] = xr[i] * k;
  });
}

template <class T>
void l2norm_heads_backward(const T* y, const T* inv, const T* dy, i64 tokens, i64 heads, i64 dim, T* dx, i64 xs) {
  parallel(tokens * heads, [&](i64 r) {
    T yd = 0;
    for (i64 i = 0; i < dim; ++i) yd += y[r * dim + i] * dy[r * dim + i];
    T* dxr = dx + (r / heads) * xs + (r % heads) * dim;
    for (i64 i = 0; i < dim; ++i) dxr[i] = inv[r] * (dy[r * dim + i] - y[r * dim + i] * yd);
  });
}

template <class T>
void deltanet_gates(const T* a, i64 as, const T* b, i64 bs, const T* A_log, const T* dt_bias, i64 tokens, i64 heads, T* g,
                    T* beta) {
  parallel(tokens, [&](i64 t) {
    for (i64 h = 0; h < heads; ++h) {
      g[t * heads + h] = -std::exp(A_log[h]) * softplus(a[t * as + h] + dt_bias[h]);
      beta[t * heads + h] = sigmoid(b[t * bs + h]);
    }
  });
}

template <class T>
void deltanet_gates_backward(const T* a, i64 as, i64 bs, const T* A_log, const T* dt_bias, const T* g, const T* beta, const T* dg,
                             const T* dbeta, i64 tokens, i64 heads, T* da, T* db, T* dA_log, T* ddt_bias) {
  parallel(heads, [&](i64 h) {  // (the heads' parameters summed over the tokens in order)
    const T e = std::exp(A_log[h]);
    for (i64 t = 0; t < tokens; ++t) {
      const i64 i = t * heads + h;
      const T u = a[t * as + h] + dt_bias[h];
      const T du = dg[i] * -e * (u > T(20) ? T(1) : sigmoid(u));  // d softplus / du = sigmoid(u)
      da[t * as + h] = du;
      ddt_bias[h] += du;
      dA_log[h] += dg[i] * g[i];  // (g = -exp(A_log) softplus: d g / d A_log = g)
      db[t * bs + h] = dbeta[i] * beta[i] * (T(1) - beta[i]);
    }
  });
}

template <class T>
void gated_rmsnorm(const T* x, const T* z, i64 zs, const T* w, i64 tokens, i64 heads, i64 dim, double eps, T* y, T* rstd) {
  parallel(tokens * heads, [&](i64 r) {
    const T* xr = x + r * dim;
    const T* zr = z + (r / heads) * zs + (r % heads) * dim;
    T s = 0;
    for (i64 i = 0; i < dim; ++i) s += xr[i] * xr[i];
    const T k = T(1) / std::sqrt(s / static_cast<T>(dim) + static_cast<T>(eps));
    rstd[r] = k;
    for (i64 i = 0; i < dim; ++i) y[r * dim + i] = w[i] * (xr[i] * k) * silu(zr[i]);
  });
}

template <class T>
void gated_rmsnorm_backward(const T* x, const T* z, i64 zs, const T* w, const T* rstd, const T* dy, i64 tokens, i64 heads,
                            i64 dim, T* dx, T* dz, T* dw) {
  parallel(tokens * heads, [&](i64 r) {
    const T* xr = x + r * dim;
    const T* zr = z + (r / heads) * zs + (r % heads) * dim;
    T* dzr = dz + (r / heads) * zs + (r % heads) * dim;
    const T k = rstd[r];
    T nd = 0;  // n . dn, n = x k, dn = dy w silu(z)
    for (i64 i = 0; i < dim; ++i) {
      const T n = xr[i] * k;
      nd += n * dy[r * dim + i] * w[i] * silu(zr[i]);
      dzr[i] = dy[r * dim + i] * w[i] * n * silu_grad(zr[i]);
    }
    for (i64 i = 0; i < dim; ++i) {
      const T n = xr[i] * k;
      dx[r * dim + i] = k * (dy[r * dim + i] * w[i] * silu(zr[i]) - n * nd / static_cast<T>(dim));
    }
  });
  for (i64 r = 0; r < tokens * heads; ++r) {  // (the gain's gradient, summed over the rows in order)
    const T* zr = z + (r / heads) * zs + (r % heads) * dim;
    for (i64 i = 0; i < dim; ++i) dw[i] += dy[r * dim + i] * x[r * dim + i] * rstd[r] * silu(zr[i]);
  }
}

#define MT_INSTANTIATE(T)                                                                                                  \
  template void causal_conv_silu<T>(const T*, i64, const T*, i64, i64, std::span<const std::int32_t>, T*, i64);          \
  template void causal_conv_silu_backward<T>(const T*, i64, const T*, i64, i64, std::span<const std::int32_t>, const T*, \
                                             i64, T*, T*);                                                               \
  template void l2norm_heads<T>(const T*, i64, i64, i64, i64, double, T*, T*);                                           \
  template void l2norm_heads_backward<T>(const T*, const T*, const T*, i64, i64, i64, T*, i64);                           \
  template void deltanet_gates<T>(const T*, i64, const T*, i64, const T*, const T*, i64, i64, T*, T*);                   \
  template void deltanet_gates_backward<T>(const T*, i64, i64, const T*, const T*, const T*, const T*, const T*, const T*, \
                                           i64, i64, T*, T*, T*, T*);                                                     \
  template void gated_rmsnorm<T>(const T*, const T*, i64, const T*, i64, i64, i64, double, T*, T*);                      \
  template void gated_rmsnorm_backward<T>(const T*, const T*, i64, const T*, const T*, const T*, i64, i64, i64, T*, T*, T*);
MT_INSTANTIATE(float)
MT_INSTANTIATE(double)
#undef MT_INSTANTIATE

}  // namespace megatrain::cpu
