// Attention of one new token a row over its sequence's cached keys and values, on the CPU: the
// decoding step of a KV cache (ChunkShape::decode), the reference of any device's.
//
// Row r's token is at position p = positions[r] of its sequence. Its key and value go into the
// cache at p; its query then attends to the cached keys 0 .. p (a sliding window: the last
// `window` of them), with the same softmax as the CPU backend's attention() (a sink's logit in
// its denominator where given).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <oneapi/tbb/parallel_for.h>

#include "megatrain/backend/backend.hpp"
#include "megatrain/core/error.hpp"

namespace megatrain::cpu {

/// q, out: [rows, heads * head_dim]; k, v: [rows, kv_heads * head_dim]; kcache, vcache:
/// [d.rows, d.capacity, kv_heads * head_dim], the chunk's row r being cache row d.first + r;
/// sinks: [heads] or null. s gives the heads, head_dim, scale and window (s.rows, s.seq unused).
template <class T, class S>
void attention_decode(View<const T> q, View<const T> k, View<const T> v, View<T> kcache, View<T> vcache, const DecodeRows& d,
                      View<T> out, const AttentionShape& s, View<const S> sinks) {
  const std::int64_t rows = q.rank() == 2 ? q.size(0) : 0, H = s.heads, KV = s.kv_heads, D = s.head_dim, G = H / KV;
  MT_CHECK(H > 0 && KV > 0 && D > 0 && H % KV == 0 && q.rank() == 2 && q.size(1) == H * D && out.shape() == q.shape() &&
               k.rank() == 2 && k.size(0) == rows && k.size(1) == KV * D && v.shape() == k.shape(),
           "attention_decode: q {} and out {} must be [rows, {}], k {} and v {} [rows, {}]", q.shape().str(),
           out.shape().str(), H * D, k.shape().str(), v.shape().str(), KV * D);
  MT_CHECK(d.active() && d.first >= 0 && d.first + rows <= d.rows && static_cast<std::int64_t>(d.host_positions.size()) == rows &&
               kcache.numel() == d.rows * d.capacity * KV * D && vcache.numel() == kcache.numel(),
           "attention_decode: rows [{}, {}) of a cache of {} rows x {} tokens ({} and {} elements for {} a token)", d.first,
           d.first + rows, d.rows, d.capacity, kcache.numel(), vcache.numel(), KV * D);
  MT_CHECK(sinks.is_null() || sinks.numel() == H, "attention_decode: sinks [{}] for {} heads", sinks.numel(), H);
  const std::int64_t width = KV * D;
  const auto at = [&](std::int64_t r, std::int64_t p) { return ((d.first + r) * d.capacity + p) * width; };
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t p = d.host_positions[static_cast<std::size_t>(r)];
    MT_CHECK(p >= 0 && p < d.capacity, "attention_decode: row {}'s position {} is outside its cache of {} tokens", r, p,
             d.capacity);
    std::copy_n(k.data() + r * width, width, kcache.data() + at(r, p));
    std::copy_n(v.data() + r * width, width, vcache.data() + at(r, p));
  }
  const T scale = static_cast<T>(s.softmax_scale());
  tbb::parallel_for(std::int64_t{0}, rows * H, [&](std::int64_t task) {
    const std::int64_t r = task / H, h = task % H, kh = h / G, p = d.host_positions[static_cast<std::size_t>(r)];
    const std::int64_t lo = s.window > 0 ? std::max<std::int64_t>(0, p - s.window + 1) : 0;
    const T* qh = q.data() + r * H * D + h * D;
    std::vector<T> w(static_cast<std::size_t>(p + 1 - lo));
    T mx = sinks.is_null() ? -std::numeric_limits<T>::infinity() : static_cast<T>(sinks.data()[h]);
    for (std::int64_t j = lo; j <= p; ++j) {
      const T* kj = kcache.data() + at(r, j) + kh * D;
      T dot = 0;
      for (std::int64_t i = 0; i < D; ++i) dot += qh[i] * kj[i];
      w[static_cast<std::size_t>(j - lo)] = dot * scale;
      mx = std::max(mx, dot * scale);
    }
    double sum = sinks.is_null() ? 0.0 : static_cast<double>(std::exp(static_cast<T>(sinks.data()[h]) - mx));
    for (T& x : w) sum += (x = std::exp(x - mx));
    T* o = out.data() + r * H * D + h * D;
    std::fill_n(o, D, T{});
    for (std::int64_t j = lo; j <= p; ++j) {
      const T pj = static_cast<T>(w[static_cast<std::size_t>(j - lo)] / sum);
      const T* vj = vcache.data() + at(r, j) + kh * D;
      for (std::int64_t i = 0; i < D; ++i) o[i] += pj * vj[i];
    }
  });
}

}  // namespace megatrain::cpu
