// The CPU reference backend's primitives, in float64: every backward against central
// differences of its forward (method and tolerances in gradcheck.hpp), and the forwards of
// attention, RMSNorm, RoPE, the LM-head loss (and the simple ones) against naive formulas.
//
// Sizes sit off the round numbers: odd sequence lengths (1, 7, 13), GQA ratios 1, 2, 4, 7 (with
// more than one key/value head where that tells head mappings apart), head_dim 6, 10, 12, 24,
// vocabularies of 37, 45 and 101, several sequences per chunk, and row counts that cross the
// backend's parallel blocks (64 rows, 256-row reduction blocks). Tensors the backward
// overwrites start as NaN (an accidental += shows); tensors it accumulates into start random
// (the increment is what is checked).
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "gradcheck.hpp"
#include "megatrain/backend/cpu/cpu_backend.hpp"

using namespace megatrain;
using namespace megatrain::test;

namespace {

using Be = CpuBackend<double>;
using Vec = std::vector<double>;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Forward references are float64 too; they differ from the backend only in summation order.
constexpr double kFwdRtol = 1e-12, kFwdAtol = 1e-13;

Vec nans(std::int64_t n) { return Vec(static_cast<std::size_t>(n), kNaN); }
View<const double> none() { return {}; }

// ---- naive float64 references --------------------------------------------------------------

/// softmax(Q K^T / sqrt(D) + causal mask) V, head h reading key/value head h / (H / Hkv);
/// also the log-sum-exp of each query's masked, scaled scores.
/// With `sinks` (one logit per query head, GPT-OSS's): each joins its head's softmaxes, unscaled,
/// and carries no value.
void naive_attention(const Vec& q, const Vec& k, const Vec& v, const AttentionShape& s, Vec& out, Vec& lse,
                     const Vec* sinks = nullptr) {
  const std::int64_t H = s.heads, Hkv = s.kv_heads, D = s.head_dim, S = s.seq;
  out.assign(static_cast<std::size_t>(s.rows * S * H * D), 0.0);
  lse.assign(static_cast<std::size_t>(s.rows * H * S), 0.0);
  auto at = [](const Vec& t, std::int64_t row, std::int64_t width, std::int64_t col) { return t[row * width + col]; };
  for (std::int64_t r = 0; r < s.rows; ++r)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t kh = h / (H / Hkv);
      for (std::int64_t i = 0; i < S; ++i) {
        Vec score(static_cast<std::size_t>(S));
        double mx = -std::numeric_limits<double>::infinity();
        for (std::int64_t j = 0; j < S; ++j) {
          double dot = 0;
          for (std::int64_t c = 0; c < D; ++c)
            dot += at(q, r * S + i, H * D, h * D + c) * at(k, r * S + j, Hkv * D, kh * D + c);
          // causal, and packed rows: not before the query's own sequence
          const std::int64_t first = s.packed.empty() ? 0 : i - s.packed.positions.data()[r * S + i];
          const double mask = j > i || j < first ? -std::numeric_limits<double>::infinity() : 0.0;
          score[j] = dot / std::sqrt(static_cast<double>(D)) + mask;
          mx = std::max(mx, score[j]);
        }
        if (sinks) mx = std::max(mx, (*sinks)[h]);
        double z = sinks ? std::exp((*sinks)[h] - mx) : 0.0;
        for (double sc : score) z += std::exp(sc - mx);
        lse[(r * H + h) * S + i] = mx + std::log(z);
        for (std::int64_t c = 0; c < D; ++c) {
          double acc = 0;
          for (std::int64_t j = 0; j < S; ++j)
            acc += std::exp(score[j] - mx) / z * at(v, r * S + j, Hkv * D, kh * D + c);
          out[(r * S + i) * H * D + h * D + c] = acc;
        }
      }
    }
}

/// Hugging Face's rotate-half RoPE: for i < D/2, out_i = x_i cos - x_{i+D/2} sin and
/// out_{i+D/2} = x_{i+D/2} cos + x_i sin, angle = (token % seq) * inv_freq_i.
Vec naive_rope(const Vec& x, std::int64_t heads, std::int64_t seq, const Vec& inv_freq) {
  const auto half = static_cast<std::int64_t>(inv_freq.size()), D = 2 * half;
  const std::int64_t M = static_cast<std::int64_t>(x.size()) / (heads * D);
  Vec out(x.size());
  for (std::int64_t t = 0; t < M; ++t)
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t i = 0; i < half; ++i) {
        const double ang = static_cast<double>(t % seq) * inv_freq[i];
        const auto lo = static_cast<std::size_t>(t * heads * D + h * D + i), hi = lo + static_cast<std::size_t>(half);
        out[lo] = x[lo] * std::cos(ang) - x[hi] * std::sin(ang);
        out[hi] = x[hi] * std::cos(ang) + x[lo] * std::sin(ang);
      }
  return out;
}

Vec rope_freqs(std::int64_t head_dim, double theta) {
  Vec f(static_cast<std::size_t>(head_dim / 2));
  for (std::size_t i = 0; i < f.size(); ++i)
    f[i] = 1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(head_dim));
  return f;
}

// ---- per-primitive checks ------------------------------------------------------------------

void check_linear(std::int64_t M, std::int64_t K, std::int64_t N, bool bias, bool accumulate_dx, std::uint64_t seed) {
  CAPTURE(M);
  CAPTURE(K);
  CAPTURE(N);
  CAPTURE(bias);
  CAPTURE(accumulate_dx);
  Random rng(test_seed(seed));
  Be be;
  Vec x = rng.vector(M * K, -1, 1), w = rng.vector(N * K, -1, 1), b = rng.vector(bias ? N : 0, -1, 1);
  const Vec r = rng.vector(M * N, -1, 1);
  const auto bv = [&] { return bias ? cview(b, {N}) : none(); };
  Vec y(static_cast<std::size_t>(M * N));
  auto objective = [&] {
    be.linear(cview(x, {M, K}), cview(w, {N, K}), bv(), view(y, {M, N}));
    return contract(y, r);
  };
  // Naive forward.
  objective();
  Vec want(y.size());
  for (std::int64_t i = 0; i < M; ++i)
    for (std::int64_t j = 0; j < N; ++j) {
      double acc = bias ? b[j] : 0.0;
      for (std::int64_t c = 0; c < K; ++c) acc += x[i * K + c] * w[j * K + c];
      want[i * N + j] = acc;
    }
  check_close("linear forward", y, want, kFwdRtol, kFwdAtol);

  const Vec dx0 = accumulate_dx ? rng.vector(M * K, -1, 1) : nans(M * K), dw0 = rng.vector(N * K, -1, 1),
            db0 = rng.vector(bias ? N : 0, -1, 1);
  Vec dx = dx0, dw = dw0, db = db0;
  be.linear_backward(cview(x, {M, K}), cview(w, {N, K}), cview(r, {M, N}), view(dx, {M, K}), accumulate_dx,
                     view(dw, {N, K}), bias ? view(db, {N}) : View<double>{});
  const Vec gx = accumulate_dx ? minus(dx, dx0) : dx, gw = minus(dw, dw0), gb = minus(db, db0);
  std::vector<GradTensor> t{{"x", x, gx}, {"w", w, gw}};
  if (bias) t.push_back({"b", b, gb});
  report("linear", gradcheck(objective, t, rng));

  // Without dx (a first layer's input needs none) the weight gradients are the same.
  Vec dw2 = dw0, db2 = db0;
  be.linear_backward(cview(x, {M, K}), cview(w, {N, K}), cview(r, {M, N}), View<double>{}, false, view(dw2, {N, K}),
                     bias ? view(db2, {N}) : View<double>{});
  CHECK(dw2 == dw);
  CHECK(db2 == db);

  // Without dw (and db): the input gradient alone, the same; x is not read
  Vec dx3 = dx0;
  const Vec x_nan = nans(M * K);
  be.linear_backward(cview(x_nan, {M, K}), cview(w, {N, K}), cview(r, {M, N}), view(dx3, {M, K}), accumulate_dx,
                     View<double>{}, View<double>{});
  CHECK(dx3 == dx);
  if (bias)  // (a bias gradient without the weight's is refused)
    CHECK_THROWS(be.linear_backward(cview(x, {M, K}), cview(w, {N, K}), cview(r, {M, N}), view(dx3, {M, K}), true,
                                    View<double>{}, view(db2, {N})));
}

void check_rmsnorm(std::int64_t M, std::int64_t d, double eps, double x_amp, bool accumulate_dx, std::uint64_t seed) {
  CAPTURE(M);
  CAPTURE(d);
  CAPTURE(eps);
  CAPTURE(accumulate_dx);
  Random rng(test_seed(seed));
  Be be;
  Vec x = rng.vector(M * d, -x_amp, x_amp), w = rng.vector(d, -1.5, 1.5);
  const Vec r = rng.vector(M * d, -1, 1);
  Vec y(x.size()), rstd(static_cast<std::size_t>(M));
  auto objective = [&] {
    be.rmsnorm(cview(x, {M, d}), cview(w, {d}), eps, view(y, {M, d}), view(rstd, {M}));
    return contract(y, r);
  };
  objective();
  Vec want(y.size()), want_rstd(rstd.size());
  for (std::int64_t i = 0; i < M; ++i) {
    double ss = 0;
    for (std::int64_t c = 0; c < d; ++c) ss += x[i * d + c] * x[i * d + c];
    want_rstd[i] = 1.0 / std::sqrt(ss / static_cast<double>(d) + eps);
    for (std::int64_t c = 0; c < d; ++c)
      want[i * d + c] = x[i * d + c] / std::sqrt(ss / static_cast<double>(d) + eps) * w[c];
  }
  check_close("rmsnorm forward", y, want, kFwdRtol, kFwdAtol);
  check_close("rmsnorm rstd", rstd, want_rstd, kFwdRtol, 0.0);

  // dx = residual + gradient (the residual in place: dx itself), and its activation copy.
  const Vec dx0 = accumulate_dx ? rng.vector(M * d, -1, 1) : nans(M * d), dw0 = rng.vector(d, -1, 1);
  Vec dx = dx0, dw = dw0, dx_act = nans(M * d);
  be.rmsnorm_backward(cview(x, {M, d}), cview(w, {d}), cview(rstd, {M}), cview(r, {M, d}),
                      accumulate_dx ? cview(dx, {M, d}) : View<const double>{}, view(dx, {M, d}), view(dx_act, {M, d}),
                      view(dw, {d}));
  CHECK(dx_act == dx);
  const Vec gx = accumulate_dx ? minus(dx, dx0) : dx, gw = minus(dw, dw0);
  report("rmsnorm", gradcheck(objective, {{"x", x, gx}, {"w", w, gw}}, rng));
}

void check_rope(std::int64_t rows, std::int64_t seq, std::int64_t heads, std::int64_t D, double theta,
                std::uint64_t seed) {
  CAPTURE(rows);
  CAPTURE(seq);
  CAPTURE(heads);
  CAPTURE(D);
  Random rng(test_seed(seed));
  Be be;
  const std::int64_t M = rows * seq, W = heads * D;
  const Vec f = rope_freqs(D, theta);
  const std::span<const double> freqs(f);
  Vec x = rng.vector(M * W, -1, 1);
  const Vec r = rng.vector(M * W, -1, 1);
  Vec y(x.size());
  auto objective = [&] {
    y = x;
    be.rope(view(y, {M, W}), heads, seq, freqs);
    return contract(y, r);
  };
  objective();
  check_close("rope forward", y, naive_rope(x, heads, seq, f), kFwdRtol, kFwdAtol);
  // rope_backward is the inverse rotation.
  Vec back = y;
  be.rope_backward(view(back, {M, W}), heads, seq, freqs);
  check_close("rope_backward(rope(x))", back, x, 0.0, 1e-15);
  Vec g = r;
  be.rope_backward(view(g, {M, W}), heads, seq, freqs);
  report("rope", gradcheck(objective, {{"x", x, g}}, rng));
}

void check_attention(AttentionShape s, std::uint64_t seed, const std::vector<int>& lengths = {}, bool with_sinks = false) {
  // Packed rows: sequences of `lengths` laid end to end (each row's add up to seq).
  std::vector<std::int32_t> positions, starts;
  for (const int n : lengths) {
    starts.push_back(static_cast<std::int32_t>(positions.size()));
    for (int t = 0; t < n; ++t) positions.push_back(t);
  }
  if (!lengths.empty()) {
    starts.push_back(static_cast<std::int32_t>(positions.size()));
    REQUIRE(static_cast<std::int64_t>(positions.size()) == s.rows * s.seq);
    s.packed.positions = View<const std::int32_t>(std::span<const std::int32_t>(positions), Shape{s.rows * s.seq});
    s.packed.starts = View<const std::int32_t>(std::span<const std::int32_t>(starts), Shape{static_cast<std::int64_t>(starts.size())});
    s.packed.host_starts = starts;
  }
  CAPTURE(lengths.size());
  CAPTURE(s.rows);
  CAPTURE(s.seq);
  CAPTURE(s.heads);
  CAPTURE(s.kv_heads);
  CAPTURE(s.head_dim);
  Random rng(test_seed(seed));
  Be be;
  const std::int64_t M = s.rows * s.seq, QW = s.heads * s.head_dim, KW = s.kv_heads * s.head_dim;
  // Entries of +-1.5 give scaled scores of spread ~0.75: attention far from uniform.
  Vec q = rng.vector(M * QW, -1.5, 1.5), k = rng.vector(M * KW, -1.5, 1.5), v = rng.vector(M * KW, -1, 1);
  const Vec r = rng.vector(M * QW, -1, 1);
  // GPT-OSS's sinks: logits about as large as the scores, so that they take a fair share
  Vec sinks = with_sinks ? rng.vector(s.heads, -1.5, 1.5) : Vec{};
  const auto sv = [&] { return with_sinks ? cview(sinks, {s.heads}) : View<const double>{}; };
  Vec out(q.size()), lse(static_cast<std::size_t>(s.rows * s.heads * s.seq));
  auto objective = [&] {
    be.attention(cview(q, {M, QW}), cview(k, {M, KW}), cview(v, {M, KW}), view(out, {M, QW}),
                 view(lse, {s.rows, s.heads, s.seq}), s, sv());
    return contract(out, r);
  };
  objective();
  Vec want, want_lse;
  naive_attention(q, k, v, s, want, want_lse, with_sinks ? &sinks : nullptr);
  check_close("attention forward", out, want, kFwdRtol, kFwdAtol);
  check_close("attention lse", lse, want_lse, kFwdRtol, kFwdAtol);

  Vec dq = nans(M * QW), dk = nans(M * KW), dv = nans(M * KW);
  const Vec dsinks0 = with_sinks ? rng.vector(s.heads, -1, 1) : Vec{};  // (added to: starts anywhere)
  Vec dsinks = dsinks0;
  be.attention_backward(cview(q, {M, QW}), cview(k, {M, KW}), cview(v, {M, KW}), cview(out, {M, QW}),
                        cview(lse, {s.rows, s.heads, s.seq}), cview(r, {M, QW}), view(dq, {M, QW}), view(dk, {M, KW}),
                        view(dv, {M, KW}), s, sv(), with_sinks ? view(dsinks, {s.heads}) : View<double>{});
  // With one token per sequence a query sees one key: the output is v whatever q and k are (and
  // without sinks, whatever q and k are).
  const bool trivial = s.seq == 1 && !with_sinks;
  if (!with_sinks) {
    report("attention", gradcheck(objective, {{"q", q, dq, trivial}, {"k", k, dk, trivial}, {"v", v, dv}}, rng));
    return;
  }
  const Vec gsinks = minus(dsinks, dsinks0);
  report("attention with sinks",
         gradcheck(objective, {{"q", q, dq, trivial}, {"k", k, dk, trivial}, {"v", v, dv}, {"sinks", sinks, gsinks}}, rng));
}

void check_lm_head(std::int64_t M, std::int64_t d, std::int64_t V, std::int64_t block, double h_amp,
                   std::uint64_t seed) {
  CAPTURE(M);
  CAPTURE(d);
  CAPTURE(V);
  CAPTURE(block);
  Random rng(test_seed(seed));
  Be be;
  be.logits_block = block;
  Vec h = rng.vector(M * d, -h_amp, h_amp),
      w = rng.vector(V * d, -3 / std::sqrt(static_cast<double>(d)), 3 / std::sqrt(static_cast<double>(d)));
  // Labels cover both ends of the vocabulary; about a quarter are ignored (never all).
  std::vector<std::int32_t> labels(static_cast<std::size_t>(M));
  for (auto& l : labels) l = static_cast<std::int32_t>(rng.index(V));
  labels.front() = static_cast<std::int32_t>(V - 1);
  for (std::size_t t = 1; t < labels.size(); ++t)
    if (rng.uniform(0, 1) < 0.25) labels[t] = kIgnoreIndex;
  if (labels.size() > 2) labels[1] = 0, labels.back() = kIgnoreIndex;
  const double loss_scale = 0.37;
  const Vec r(static_cast<std::size_t>(M), loss_scale);  // L = loss_scale * sum_t loss_t
  const auto lv = View<const std::int32_t>(std::span<const std::int32_t>(labels), Shape{M});
  Vec loss(static_cast<std::size_t>(M));
  auto objective = [&] {
    be.lm_head_loss(cview(h, {M, d}), cview(w, {V, d}), lv, 0.0, view(loss, {M}), View<double>{}, View<double>{});
    return contract(loss, r);
  };
  objective();
  Vec want(loss.size());
  for (std::int64_t t = 0; t < M; ++t) {
    const std::int32_t y = labels[t];
    if (y == kIgnoreIndex) continue;
    Vec z(static_cast<std::size_t>(V));
    for (std::int64_t c = 0; c < V; ++c)
      for (std::int64_t i = 0; i < d; ++i) z[c] += h[t * d + i] * w[c * d + i];
    const double mx = *std::max_element(z.begin(), z.end());
    double sum = 0;
    for (double zc : z) sum += std::exp(zc - mx);
    want[t] = mx + std::log(sum) - z[y];
  }
  check_close("lm_head_loss forward", loss, want, kFwdRtol, kFwdAtol);
  for (std::int64_t t = 0; t < M; ++t)
    if (labels[t] == kIgnoreIndex) CHECK(loss[t] == 0.0);

  const Vec fwd_loss = loss, dw0 = rng.vector(V * d, -1, 1);
  Vec dh = nans(M * d), dw = dw0;
  be.lm_head_loss(cview(h, {M, d}), cview(w, {V, d}), lv, loss_scale, view(loss, {M}), view(dh, {M, d}),
                  view(dw, {V, d}));
  CHECK(loss == fwd_loss);  // the fused backward reports the same losses
  for (std::int64_t t = 0; t < M; ++t)
    if (labels[t] == kIgnoreIndex)
      for (std::int64_t i = 0; i < d; ++i) CHECK(dh[t * d + i] == 0.0);
  const Vec gw = minus(dw, dw0);
  report("lm_head_loss", gradcheck(objective, {{"h", h, dh}, {"w", w, gw}}, rng));

  // dw may be left out (nothing to accumulate into): dh is unchanged.
  Vec dh2 = nans(M * d);
  be.lm_head_loss(cview(h, {M, d}), cview(w, {V, d}), lv, loss_scale, view(loss, {M}), view(dh2, {M, d}),
                  View<double>{});
  CHECK(dh2 == dh);
}

}  // namespace

TEST_CASE("gradcheck: linear, with and without bias, dx overwritten or accumulated") {
  std::uint64_t seed = 100;
  for (auto [M, K, N] : {std::array<std::int64_t, 3>{1, 5, 3}, {7, 10, 13}, {130, 12, 37}})
    for (bool bias : {false, true})
      for (bool acc : {false, true}) check_linear(M, K, N, bias, acc, ++seed);
  check_linear(300, 6, 5, true, false, ++seed);  // the bias gradient crosses the 256-row reduction blocks
}

TEST_CASE("gradcheck: rmsnorm") {
  check_rmsnorm(1, 8, 1e-6, 1.0, false, 200);
  check_rmsnorm(7, 13, 1e-6, 1.0, true, 201);
  check_rmsnorm(5, 6, 0.5, 0.3, false, 202);    // small rows and a large eps: eps matters
  check_rmsnorm(300, 7, 1e-5, 1.0, true, 203);  // crosses the 256-row reduction blocks
}

TEST_CASE("gradcheck: rope is a rotation, its backward the inverse rotation") {
  check_rope(2, 7, 3, 6, 100.0, 300);
  check_rope(1, 13, 2, 10, 10000.0, 301);
  check_rope(3, 1, 1, 24, 100.0, 302);  // position 0 only: the identity
  check_rope(5, 13, 2, 12, 50.0, 303);  // 65 tokens: two row blocks
}

TEST_CASE("gradcheck: causal grouped-query attention") {
  check_attention({2, 7, 2, 2, 6}, 400);    // ratio 1
  check_attention({2, 13, 4, 2, 10}, 401);  // ratio 2, two kv heads
  check_attention({3, 5, 4, 1, 12}, 402);   // ratio 4
  check_attention({2, 7, 7, 1, 6}, 403);    // ratio 7
  check_attention({1, 13, 14, 2, 6}, 404);  // ratio 7, two kv heads
  check_attention({3, 1, 2, 1, 24}, 405);   // one token per sequence
  check_attention({2, 6, 12, 3, 10}, 406);  // ratio 4, three kv heads
  check_attention({2, 150, 4, 2, 8}, 407);  // three blocks of queries (64, 64, 22)
  // packed rows: sequences across the blocks' edges, one of one token, one the whole row
  check_attention({2, 150, 4, 2, 8}, 408, {40, 30, 1, 79, 150});
  check_attention({3, 9, 4, 1, 6}, 409, {2, 7, 9, 1, 1, 1, 6});
}

TEST_CASE("gradcheck: attention with sinks (GPT-OSS)") {
  check_attention({2, 7, 2, 2, 6}, 420, {}, true);
  check_attention({2, 13, 4, 2, 10}, 421, {}, true);   // grouped: ratio 2
  check_attention({3, 1, 2, 1, 24}, 422, {}, true);    // one token: the sink still takes its share
  check_attention({2, 150, 4, 2, 8}, 423, {}, true);   // three blocks of queries
  check_attention({2, 150, 4, 2, 8}, 424, {40, 30, 1, 79, 150}, true);  // packed rows
}

TEST_CASE("gradcheck: GPT-OSS's clamped swiglu") {
  Random rng(test_seed(510));
  Be be;
  const std::int64_t M = 9, F = 13;
  // values on both sides of the clamps at +-7, none within the finite differences' reach of them
  const auto away = [](Vec v) {
    for (auto& x : v)
      if (std::abs(std::abs(x) - 7.0) < 0.05) x += 0.1;
    return v;
  };
  Vec g = away(rng.vector(M * F, -10, 10)), u = away(rng.vector(M * F, -10, 10));
  const Vec r = rng.vector(M * F, -1, 1);
  Vec m(g.size());
  auto objective = [&] {
    be.swiglu(cview(g, {M, F}), cview(u, {M, F}), view(m, {M, F}), Activation::clamped_swiglu);
    return contract(m, r);
  };
  objective();
  Vec want(m.size());
  int clamped = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double gc = std::min(g[i], 7.0), uc = std::clamp(u[i], -7.0, 7.0);
    clamped += (g[i] > 7.0) + (std::abs(u[i]) > 7.0);
    want[i] = (uc + 1) * gc / (1 + std::exp(-1.702 * gc));
  }
  CHECK(clamped > 10);  // (the clamps are exercised)
  check_close("clamped swiglu forward", m, want, kFwdRtol, kFwdAtol);
  Vec dg = nans(M * F), du = nans(M * F), m_bwd = nans(M * F);
  be.swiglu_backward(cview(g, {M, F}), cview(u, {M, F}), cview(r, {M, F}), view(dg, {M, F}), view(du, {M, F}),
                     Activation::clamped_swiglu, view(m_bwd, {M, F}));
  CHECK(m_bwd == m);  // the backward's m: the forward's bits
  for (std::size_t i = 0; i < g.size(); ++i) {
    if (g[i] > 7.0) CHECK(dg[i] == 0.0);
    if (std::abs(u[i]) > 7.0) CHECK(du[i] == 0.0);
  }
  report("clamped swiglu", gradcheck(objective, {{"g", g, dg}, {"u", u, du}}, rng));
}

TEST_CASE("gradcheck: sigmoid_gate, a gate per element, per group of features and per row") {
  Random rng(test_seed(520));
  Be be;
  const std::int64_t M = 7, D = 15;
  for (const std::int64_t G : {D, std::int64_t{5}, std::int64_t{1}}) {  // (features per gate: 1, 3, 15)
    CAPTURE(G);
    Vec x = rng.vector(M * D, -1.5, 1.5), gate = rng.vector(M * G, -4, 4);
    const Vec r = rng.vector(M * D, -1, 1);
    Vec y(x.size());
    auto objective = [&] {
      be.sigmoid_gate(cview(x, {M, D}), cview(gate, {M, G}), view(y, {M, D}));
      return contract(y, r);
    };
    objective();
    Vec want(y.size());
    for (std::int64_t t = 0; t < M; ++t)
      for (std::int64_t j = 0; j < D; ++j)
        want[t * D + j] = x[t * D + j] / (1 + std::exp(-gate[t * G + j / (D / G)]));
    check_close("sigmoid_gate forward", y, want, kFwdRtol, kFwdAtol);
    Vec dx = nans(M * D), dgate = nans(M * G);
    be.sigmoid_gate_backward(cview(x, {M, D}), cview(gate, {M, G}), cview(r, {M, D}), view(dx, {M, D}), view(dgate, {M, G}));
    report(fmt::format("sigmoid_gate, {} features a gate", D / G), gradcheck(objective, {{"x", x, dx}, {"gate", gate, dgate}}, rng));
  }
  Vec x(12), gate(5), y(12);  // (a gate whose columns do not divide the features: refused)
  CHECK_THROWS_WITH_AS(be.sigmoid_gate(cview(x, {2, 6}), cview(gate, {1, 5}), view(y, {2, 6})),
                       doctest::Contains("must have the rows of [2, 6] and a number of columns that divides x's"), Error);
}

TEST_CASE("gradcheck: swiglu") {
  Random rng(test_seed(500));
  Be be;
  const std::int64_t M = 7, F = 13;
  Vec g = rng.vector(M * F, -4, 4), u = rng.vector(M * F, -1.5, 1.5);
  const Vec r = rng.vector(M * F, -1, 1);
  Vec m(g.size());
  auto objective = [&] {
    be.swiglu(cview(g, {M, F}), cview(u, {M, F}), view(m, {M, F}));
    return contract(m, r);
  };
  objective();
  Vec want(m.size());
  for (std::size_t i = 0; i < want.size(); ++i) want[i] = g[i] / (1 + std::exp(-g[i])) * u[i];
  check_close("swiglu forward", m, want, kFwdRtol, kFwdAtol);
  Vec dg = nans(M * F), du = nans(M * F);
  be.swiglu_backward(cview(g, {M, F}), cview(u, {M, F}), cview(r, {M, F}), view(dg, {M, F}), view(du, {M, F}));
  // the backward that makes m as well: the forward's m bit for bit, the same dg and du
  for (const auto act : {Activation::silu, Activation::gelu_tanh}) {
    CAPTURE(act == Activation::gelu_tanh);
    Vec m_fwd(g.size()), m_bwd = nans(M * F), dg1 = nans(M * F), du1 = nans(M * F), dg2 = nans(M * F), du2 = nans(M * F);
    be.swiglu(cview(g, {M, F}), cview(u, {M, F}), view(m_fwd, {M, F}), act);
    be.swiglu_backward(cview(g, {M, F}), cview(u, {M, F}), cview(r, {M, F}), view(dg1, {M, F}), view(du1, {M, F}), act);
    be.swiglu_backward(cview(g, {M, F}), cview(u, {M, F}), cview(r, {M, F}), view(dg2, {M, F}), view(du2, {M, F}), act,
                       view(m_bwd, {M, F}));
    CHECK(m_bwd == m_fwd);
    CHECK(dg2 == dg1);
    CHECK(du2 == du1);
  }
  report("swiglu", gradcheck(objective, {{"g", g, dg}, {"u", u, du}}, rng));
}

TEST_CASE("gradcheck: embedding with repeated ids") {
  std::uint64_t seed = 600;
  for (auto [V, d, M] : {std::array<std::int64_t, 3>{37, 10, 20}, {101, 70, 33}}) {
    CAPTURE(V);
    CAPTURE(d);
    CAPTURE(M);
    Random rng(test_seed(++seed));
    Be be;
    std::vector<std::int32_t> ids(static_cast<std::size_t>(M));
    for (auto& id : ids) id = static_cast<std::int32_t>(rng.index(8));  // few distinct ids: many repeats
    ids[1] = static_cast<std::int32_t>(V - 1);
    ids[4] = ids[M - 1] = 0;
    const auto iv = View<const std::int32_t>(std::span<const std::int32_t>(ids), Shape{M});
    Vec table = rng.vector(V * d, -1, 1);
    const Vec r = rng.vector(M * d, -1, 1);
    Vec y(static_cast<std::size_t>(M * d));
    auto objective = [&] {
      be.embedding(iv, cview(table, {V, d}), view(y, {M, d}));
      return contract(y, r);
    };
    objective();
    for (std::int64_t t = 0; t < M; ++t)
      for (std::int64_t c = 0; c < d; ++c) CHECK(y[t * d + c] == table[ids[static_cast<std::size_t>(t)] * d + c]);
    const Vec g0 = rng.vector(V * d, -1, 1);
    Vec g = g0;
    be.embedding_backward(iv, cview(r, {M, d}), view(g, {V, d}));
    GradcheckOptions opt;
    opt.samples = 200;  // most rows are unused: sample enough to hit the used ones
    report("embedding", gradcheck(objective, {{"table", table, minus(g, g0)}}, rng, opt));
    // An id outside the vocabulary is an error, not a wild read.
    ids[2] = static_cast<std::int32_t>(V);
    CHECK_THROWS_AS(be.embedding(iv, cview(table, {V, d}), view(y, {M, d})), Error);
  }
}

TEST_CASE("gradcheck: lm_head_loss with ignored labels") {
  check_lm_head(13, 12, 37, 4, 1.0, 700);    // blocks of 4, 4, 4, 1 tokens
  check_lm_head(7, 10, 101, 256, 1.0, 701);  // one block
  check_lm_head(1, 6, 37, 256, 1.0, 702);    // a single token
  check_lm_head(300, 8, 45, 256, 1.0, 703);  // two blocks of the default size
  check_lm_head(9, 16, 37, 5, 8.0, 704);     // logits up to ~+-50: stable log-sum-exp
}
