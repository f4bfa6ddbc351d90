// AdamW: against a float64 evaluation of torch.optim.AdamW's formula over many steps of random
// gradients; every vector path against the scalar one; clipping with clip_grad_norm_ semantics.
#include <doctest/doctest.h>

#include <oneapi/tbb/global_control.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "megatrain/optim/adamw.hpp"

using namespace megatrain;

namespace {

std::vector<UnitSpec> units() {
  return {{"a", {ParamSpec::matrix("a.w", Shape{37, 29}, 0.5f), ParamSpec::norm("a.norm", 29), ParamSpec::bias("a.b", 37)}},
          {"b", {ParamSpec::matrix("b.w", Shape{101, 13}, 0.2f)}}};
}

StoreOptions opts() {
  StoreOptions o;
  o.seed = 3;
  o.pinning = Pinning::never;
  return o;
}

// PyTorch's _single_tensor_adamw in float64, one parameter tensor at a time.
struct RefParam {
  std::vector<double> p, m, v;
  double wd;
};
void ref_step(RefParam& r, const std::vector<double>& g, const AdamWConfig& c, int t, double lr, double scale) {
  const double bc1 = 1 - std::pow(c.beta1, t), bc2 = 1 - std::pow(c.beta2, t);
  for (std::size_t i = 0; i < r.p.size(); ++i) {
    const double gi = g[i] * scale;
    r.p[i] *= 1 - lr * r.wd;
    r.m[i] += (1 - c.beta1) * (gi - r.m[i]);
    r.v[i] = r.v[i] * c.beta2 + (1 - c.beta2) * gi * gi;
    const double denom = std::sqrt(r.v[i]) / std::sqrt(bc2) + c.eps;
    r.p[i] -= lr / bc1 * r.m[i] / denom;
  }
}

template <class T>
std::vector<RefParam> snapshot(const HostParamStore<T>& s, const AdamWConfig& c) {
  std::vector<RefParam> out;
  for (const auto& u : s.units())
    for (const auto& p : u.params()) {
      RefParam r;
      auto v = u.tensor(u.master(), p).span();
      r.p.assign(v.begin(), v.end());
      r.m.assign(v.size(), 0.0);
      r.v.assign(v.size(), 0.0);
      r.wd = p.spec.weight_decay ? c.weight_decay : 0.0;
      out.push_back(std::move(r));
    }
  return out;
}

// Runs `steps` steps on a store and the float64 reference with the same gradients (random
// normal with a per-step scale spanning four orders of magnitude, a varying learning rate,
// and clipping every other step). Returns the largest error relative to the tolerance.
template <class T>
double run_against_reference(int steps, double rtol, double atol_per_lr) {
  HostParamStore<T> s(units(), opts());
  AdamWConfig cfg;
  cfg.weight_decay = 0.1;
  auto ref = snapshot(s, cfg);
  std::mt19937_64 rng(42);
  std::normal_distribution<double> normal;
  double worst = 0;
  for (int t = 1; t <= steps; ++t) {
    const double lr = 1e-3 * (1.0 + 0.5 * std::sin(t));
    const double gscale = std::pow(10.0, -3.0 + 4.0 * std::uniform_real_distribution<double>(0, 1)(rng));
    // Gradients for all units first (clipping needs the global norm).
    std::vector<std::vector<T>> grads;
    double sumsq = 0;
    for (const auto& u : s.units()) {
      std::vector<T> g(static_cast<std::size_t>(u.numel()), T(0));
      for (const auto& p : u.params())
        for (std::int64_t i = 0; i < p.numel(); ++i) g[static_cast<std::size_t>(p.offset + i)] = static_cast<T>(gscale * normal(rng));
      sumsq += grad_sum_squares<T>(g);
      grads.push_back(std::move(g));
    }
    const double coef = (t % 2 == 0) ? clip_coefficient(std::sqrt(sumsq), 0.5 * std::sqrt(sumsq)) : 1.0;
    std::size_t ri = 0;
    for (const auto& u : s.units()) {
      adamw_step<T>(u, grads[u.index()], cfg, t, lr, coef);
      for (const auto& p : u.params()) {
        auto& r = ref[ri++];
        std::vector<double> g(r.p.size());
        for (std::size_t i = 0; i < g.size(); ++i)
          g[i] = static_cast<double>(static_cast<T>(grads[u.index()][static_cast<std::size_t>(p.offset) + i] * static_cast<T>(coef)));
        ref_step(r, g, cfg, t, lr, 1.0);
        auto pm = u.tensor(u.master(), p).span();
        for (std::size_t i = 0; i < g.size(); ++i) {
          const double tol = atol_per_lr * lr * t + rtol * t * std::fabs(r.p[i]);
          worst = std::max(worst, std::fabs(static_cast<double>(pm[i]) - r.p[i]) / tol);
        }
      }
      // The bf16 copy is exactly the rounded master.
      for (std::size_t i = 0; i < u.master().size(); ++i) REQUIRE(u.compute()[i] == bf16(static_cast<float>(u.master()[i])));
    }
  }
  return worst;
}

}  // namespace

TEST_CASE("fp32 AdamW follows a float64 evaluation of PyTorch's formula over 300 steps") {
  // One fp32 step rounds p several times (a few ulp of |p|) and the update m/denom to a few
  // ulp of lr; both drift linearly with the step count. Tolerance per element after t steps:
  //   t * (8 eps |p| + 8 eps lr), eps = 2^-23.
  const double eps = std::numeric_limits<float>::epsilon();
  const double worst = run_against_reference<float>(300, 8 * eps, 8 * eps);
  MESSAGE("largest fp32 error / tolerance: " << worst);
  CHECK(worst <= 1.0);
}

TEST_CASE("float64 AdamW (the store's check precision) matches the reference to float64 rounding") {
  const double eps = std::numeric_limits<double>::epsilon();
  const double worst = run_against_reference<double>(300, 8 * eps, 8 * eps);
  CHECK(worst <= 1.0);
}

// Random weights, moments and gradients (of magnitudes 1e-4 to 1e2) for a vector path's check.
static void random_state(std::mt19937& rng, std::vector<float>& p, std::vector<float>& m, std::vector<float>& v,
                  std::vector<float>& g) {
  std::normal_distribution<float> nd;
  for (std::size_t i = 0; i < p.size(); ++i) {
    p[i] = nd(rng);
    m[i] = 0.1f * nd(rng);
    v[i] = 0.01f * std::fabs(nd(rng));
    g[i] = nd(rng) * std::pow(10.0f, static_cast<float>(static_cast<int>(i % 7) - 4));
  }
}

TEST_CASE("every vector path is bit-identical to the scalar path") {
  std::mt19937 rng(7);
  for (std::size_t n : {1u, 7u, 15u, 16u, 17u, 33u, 1000u, 65537u}) {
    for (SimdLevel level : {SimdLevel::avx2, SimdLevel::avx512}) {
      if (detect_simd_level() < level) {
        MESSAGE(simd_level_name(level) << " is not available on this CPU: its path is not checked here");
        continue;
      }
      CAPTURE(n);
      CAPTURE(simd_level_name(level));
      std::vector<float> p(n), m(n), v(n), g(n);
      random_state(rng, p, m, v, g);
      if (n > 3) v[3] = 0;  // denominator dominated by eps
      auto p2 = p, m2 = m, v2 = v;
      std::vector<bf16> o1(n), o2(n);
      AdamWConfig cfg;
      for (int t = 1; t <= 3; ++t) {
        const auto s = AdamWScalars<float>::make(cfg, t, 3e-4, 0.05, 0.7);
        detail::adamw_f32(SimdLevel::scalar, s, p.data(), m.data(), v.data(), g.data(), o1.data(), n);
        detail::adamw_f32(level, s, p2.data(), m2.data(), v2.data(), g.data(), o2.data(), n);
      }
      CHECK(std::memcmp(p.data(), p2.data(), n * 4) == 0);
      CHECK(std::memcmp(m.data(), m2.data(), n * 4) == 0);
      CHECK(std::memcmp(v.data(), v2.data(), n * 4) == 0);
      CHECK(std::memcmp(o1.data(), o2.data(), n * 2) == 0);
      const double ss = detail::sum_squares_f32(SimdLevel::scalar, g.data(), n);
      // Only the order of double additions differs: n * 2^-52 relative at most.
      CHECK(detail::sum_squares_f32(level, g.data(), n) == doctest::Approx(ss).epsilon(static_cast<double>(n) * 0x1p-52));
    }
  }
}

TEST_CASE("weight decay skips norm weights and biases; zero lr leaves masters untouched") {
  HostParamStore<float> s(units(), opts());
  auto& u = s.unit(0);
  std::vector<float> before(u.master().begin(), u.master().end());
  std::vector<float> g(static_cast<std::size_t>(u.numel()), 0.0f);
  AdamWConfig cfg;
  cfg.weight_decay = 0.5;
  adamw_step<float>(u, g, cfg, 1, 0.1);  // zero gradient: only decay moves p
  const auto& w = u.param("a.w");
  const auto& norm = u.param("a.norm");
  CHECK(u.master()[static_cast<std::size_t>(w.offset)] == doctest::Approx(before[static_cast<std::size_t>(w.offset)] * 0.95));
  CHECK(u.master()[static_cast<std::size_t>(norm.offset)] == 1.0f);
  for (auto& x : g) x = 1.0f;
  std::vector<float> mid(u.master().begin(), u.master().end());
  adamw_step<float>(u, g, cfg, 2, 0.0);
  CHECK(std::equal(mid.begin(), mid.end(), u.master().begin()));
}

TEST_CASE("grad_sum_squares: exact enough and independent of the thread count") {
  std::vector<float> g(3'000'001);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  double ref = 0;
  for (auto& x : g) {
    x = nd(rng);
    ref += static_cast<double>(x) * x;
  }
  const double all = grad_sum_squares<float>(g);
  double one;
  {
    tbb::global_control limit(tbb::global_control::max_allowed_parallelism, 1);
    one = grad_sum_squares<float>(g);
  }
  CHECK(all == one);
  CHECK(all == doctest::Approx(ref).epsilon(1e-12));
}

TEST_CASE("clip_coefficient has clip_grad_norm_'s semantics") {
  CHECK(clip_coefficient(0.5, 1.0) == 1.0);
  CHECK(clip_coefficient(1.0, 1.0) == 1.0 / (1.0 + 1e-6));  // just below 1: PyTorch scales at the limit too
  CHECK(clip_coefficient(4.0, 1.0) == doctest::Approx(1.0 / (4.0 + 1e-6)).epsilon(1e-15));
  CHECK(std::isnan(clip_coefficient(std::numeric_limits<double>::quiet_NaN(), 1.0)));
  CHECK(clip_coefficient(std::numeric_limits<double>::infinity(), 1.0) == 0.0);
  CHECK_THROWS_AS(clip_coefficient(1.0, 0.0), Error);
}

TEST_CASE("clip_grad_norm over several units: clip_grad_norm_'s total norm and coefficient") {
  // Four "units" of awkward sizes (one element, across the 64k summation block, ...), random
  // gradients of different magnitudes; the reference is clip_grad_norm_ evaluated in float64
  // directly from the elements.
  std::mt19937 rng(17);
  std::normal_distribution<float> nd;
  std::vector<std::vector<float>> g;
  const std::size_t sizes[] = {1, 65537, 300'007, 4099};
  const float scales[] = {3.0f, 1e-2f, 1e-3f, 0.5f};
  for (std::size_t k = 0; k < 4; ++k) {
    g.emplace_back(sizes[k]);
    for (auto& x : g.back()) x = scales[k] * nd(rng);
  }
  const auto spans = [&] {
    std::vector<std::span<const float>> s;
    for (const auto& x : g) s.emplace_back(x);
    return s;
  };
  double ref_sumsq = 0;
  for (const auto& x : g)
    for (float e : x) ref_sumsq += static_cast<double>(e) * static_cast<double>(e);
  const double ref_norm = std::sqrt(ref_sumsq);
  REQUIRE(ref_norm > 1.0);
  const auto ref_coef = [&](double max_norm) { return std::min(1.0, max_norm / (ref_norm + 1e-6)); };

  SUBCASE("norm above max_norm: coef < 1, and the clipped gradients have norm max_norm") {
    const double max_norm = 0.3 * ref_norm;
    const GradClip c = clip_grad_norm<float>(spans(), max_norm);
    CHECK(c.total_norm == doctest::Approx(ref_norm).epsilon(1e-12));
    CHECK(c.coef == doctest::Approx(ref_coef(max_norm)).epsilon(1e-12));
    CHECK(c.coef < 1.0);
    double clipped = 0;
    for (const auto& x : g)
      for (float e : x) clipped += (e * c.coef) * (e * c.coef);
    // max_norm, less the 1e-6 that clip_grad_norm_ adds to the norm.
    CHECK(std::sqrt(clipped) == doctest::Approx(max_norm * ref_norm / (ref_norm + 1e-6)).epsilon(1e-12));
    // The same at one thread, bit for bit.
    tbb::global_control limit(tbb::global_control::max_allowed_parallelism, 1);
    const GradClip one = clip_grad_norm<float>(spans(), max_norm);
    CHECK(one.total_norm == c.total_norm);
    CHECK(one.coef == c.coef);
  }
  SUBCASE("norm below max_norm: coef is exactly 1") {
    const GradClip c = clip_grad_norm<float>(spans(), 2.0 * ref_norm);
    CHECK(c.total_norm == doctest::Approx(ref_norm).epsilon(1e-12));
    CHECK(c.coef == 1.0);
  }
  SUBCASE("non-finite gradients give a non-finite coefficient, as PyTorch's error_if_nonfinite=False") {
    g[2][12345] = std::numeric_limits<float>::infinity();
    GradClip c = clip_grad_norm<float>(spans(), 1.0);
    CHECK(std::isinf(c.total_norm));
    CHECK(c.coef == 0.0);
    g[1][7] = std::numeric_limits<float>::quiet_NaN();
    c = clip_grad_norm<float>(spans(), 1.0);
    CHECK(std::isnan(c.total_norm));
    CHECK(std::isnan(c.coef));
  }
  SUBCASE("no gradients: norm 0, coef 1; a bad max_norm is refused") {
    const GradClip c = clip_grad_norm<float>({}, 1.0);
    CHECK(c.total_norm == 0.0);
    CHECK(c.coef == 1.0);
    CHECK_THROWS_WITH_AS(clip_grad_norm<float>(spans(), 0.0), doctest::Contains("max_norm"), Error);
    CHECK_THROWS_AS(clip_grad_norm<float>(spans(), std::numeric_limits<double>::infinity()), Error);
  }
}

TEST_CASE("a clipped step equals a step on pre-scaled gradients, bit for bit") {
  HostParamStore<float> a(units(), opts()), b(units(), opts());
  std::mt19937 rng(9);
  std::normal_distribution<float> nd;
  AdamWConfig cfg;
  for (int t = 1; t <= 5; ++t) {
    for (std::size_t ui = 0; ui < 2; ++ui) {
      std::vector<float> g(static_cast<std::size_t>(a.unit(ui).numel()));
      for (auto& x : g) x = nd(rng);
      const float coef = 0.3f;
      std::vector<float> gs(g);
      for (auto& x : gs) x *= coef;
      adamw_step<float>(a.unit(ui), g, cfg, t, 1e-2, coef);
      adamw_step<float>(b.unit(ui), gs, cfg, t, 1e-2, 1.0);
      CHECK(std::equal(a.unit(ui).master().begin(), a.unit(ui).master().end(), b.unit(ui).master().begin()));
    }
  }
}

TEST_CASE("bad arguments are refused before anything changes") {
  HostParamStore<float> s(units(), opts());
  auto& u = s.unit(1);
  std::vector<float> before(u.master().begin(), u.master().end());
  std::vector<float> g(static_cast<std::size_t>(u.numel()), 1.0f);
  AdamWConfig bad;
  bad.beta1 = 1.0;
  CHECK_THROWS_WITH_AS(adamw_step<float>(u, g, bad, 1, 1e-3), doctest::Contains("beta1"), Error);
  bad = {};
  bad.eps = 0;
  CHECK_THROWS_WITH_AS(adamw_step<float>(u, g, bad, 1, 1e-3), doctest::Contains("eps"), Error);
  CHECK_THROWS_WITH_AS(adamw_step<float>(u, g, AdamWConfig{}, 0, 1e-3), doctest::Contains("step must be >= 1"), Error);
  CHECK_THROWS_AS(adamw_step<float>(u, g, AdamWConfig{}, 1, std::nan("")), Error);
  std::vector<float> short_g(g.size() - 1, 1.0f);
  CHECK_THROWS_WITH_AS(adamw_step<float>(u, short_g, AdamWConfig{}, 1, 1e-3), doctest::Contains("is shorter than unit 'b'"),
                       Error);
  CHECK(std::equal(before.begin(), before.end(), u.master().begin()));
}

TEST_CASE("adamw_segments over pieces that cover a unit once equals adamw_step, bit for bit") {
  // Unit "a" has three tensors with alignment gaps between them; cut it at awkward places
  // (inside tensors, across gaps), step the pieces in shuffled order, some with a null gradient
  // standing for zeros, and compare with whole-unit steps on the same gradients.
  HostParamStore<float> a(units(), opts()), b(units(), opts());
  const auto& ua = a.unit(0);
  const auto& ub = b.unit(0);
  const auto n = static_cast<std::size_t>(ua.numel());
  std::mt19937 rng(21);
  std::normal_distribution<float> nd;
  AdamWConfig cfg;
  cfg.weight_decay = 0.1;
  for (int t = 1; t <= 4; ++t) {
    std::vector<float> g(n);
    for (auto& x : g) x = nd(rng);
    std::vector<std::size_t> cuts = {0, n};
    for (int k = 0; k < 7; ++k) cuts.push_back(rng() % n);
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    std::vector<AdamWSegment<float>> segs;
    for (std::size_t k = 0; k + 1 < cuts.size(); ++k) {
      const bool zero = k % 3 == 1;  // these pieces get a zero gradient, passed as null
      if (zero) std::fill(g.begin() + static_cast<std::ptrdiff_t>(cuts[k]), g.begin() + static_cast<std::ptrdiff_t>(cuts[k + 1]), 0.0f);
      segs.push_back({cuts[k], cuts[k + 1] - cuts[k], zero ? nullptr : g.data() + cuts[k]});
    }
    std::shuffle(segs.begin(), segs.end(), rng);
    adamw_segments<float>(ua, segs, cfg, t, 1e-2, 0.7);
    adamw_step<float>(ub, g, cfg, t, 1e-2, 0.7);
    CHECK(std::equal(ua.master().begin(), ua.master().end(), ub.master().begin()));
    CHECK(std::equal(ua.adam_m().begin(), ua.adam_m().end(), ub.adam_m().begin()));
    CHECK(std::equal(ua.adam_v().begin(), ua.adam_v().end(), ub.adam_v().begin()));
    CHECK(std::equal(ua.compute().begin(), ua.compute().end(), ub.compute().begin(),
                     [](bf16 x, bf16 y) { return x.bits == y.bits; }));
  }
  // A segment outside the unit is refused before anything changes.
  std::vector<float> before(ua.master().begin(), ua.master().end());
  std::vector<float> g(8, 1.0f);
  const std::vector<AdamWSegment<float>> bad = {{0, 8, g.data()}, {n - 4, 8, g.data()}};
  CHECK_THROWS_WITH_AS(adamw_segments<float>(ua, bad, cfg, 5, 1e-2), doctest::Contains("is outside unit 'a'"), Error);
  CHECK(std::equal(before.begin(), before.end(), ua.master().begin()));
}

TEST_CASE("adamw_segments returns the gradient's sum of squares over its segments") {
  HostParamStore<float> a(units(), opts());
  const auto& u = a.unit(0);
  const auto n = static_cast<std::size_t>(u.numel());
  std::mt19937 rng(33);
  std::normal_distribution<float> nd;
  std::vector<float> g(n, 0.0f);  // the gaps between tensors hold zeros, as a landed gradient does
  for (const auto& p : u.params())
    for (std::int64_t i = 0; i < p.numel(); ++i) g[static_cast<std::size_t>(p.offset + i)] = nd(rng);
  const std::size_t cut = n / 3;
  const std::vector<AdamWSegment<float>> segs = {{0, cut, g.data()}, {cut, n - cut, g.data() + cut}};
  const double got = adamw_segments<float>(u, segs, AdamWConfig{}, 1, 1e-3, 0.5);  // scale does not enter
  const double want = grad_sum_squares<float>(g);
  CHECK(got == doctest::Approx(want).epsilon(1e-12));
  CHECK(got > 0);
  // A null gradient contributes nothing; part of a unit sums only that part.
  const std::vector<AdamWSegment<float>> part = {{0, cut, nullptr}, {cut, n - cut, g.data() + cut}};
  const double tail = grad_sum_squares<float>(std::span<const float>(g).subspan(cut));
  CHECK(adamw_segments<float>(u, part, AdamWConfig{}, 2, 1e-3) == doctest::Approx(tail).epsilon(1e-12));
}

TEST_CASE("a store without a bf16 copy steps the same masters and moments, on every vector path") {
  // (StoreOptions::bf16_copy false: the update writes no copy; the GPU rounds the masters instead)
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  StoreOptions no_copy = opts();
  no_copy.bf16_copy = false;
  HostParamStore<float> a(units(), opts()), b(units(), no_copy);
  REQUIRE(b.unit(0).compute().empty());
  AdamWConfig cfg;
  for (int t = 1; t <= 4; ++t)
    for (std::size_t ui = 0; ui < a.num_units(); ++ui) {
      std::vector<float> g(static_cast<std::size_t>(a.unit(ui).numel()));
      for (auto& x : g) x = nd(rng);
      adamw_step<float>(a.unit(ui), g, cfg, t, 1e-2, 0.9);
      adamw_step<float>(b.unit(ui), g, cfg, t, 1e-2, 0.9);
    }
  for (std::size_t ui = 0; ui < a.num_units(); ++ui) {
    const auto& ua = a.unit(ui);
    const auto& ub = b.unit(ui);
    CHECK(std::memcmp(ua.master().data(), ub.master().data(), ua.master().size_bytes()) == 0);
    CHECK(std::memcmp(ua.adam_m().data(), ub.adam_m().data(), ua.adam_m().size_bytes()) == 0);
    CHECK(std::memcmp(ua.adam_v().data(), ub.adam_v().data(), ua.adam_v().size_bytes()) == 0);
    for (std::size_t i = 0; i < ua.compute().size(); ++i) {  // (the copy is the masters rounded, as the GPU rounds them)
      const bf16 rounded(ub.master()[i]);
      REQUIRE(std::memcmp(&ua.compute()[i], &rounded, sizeof(bf16)) == 0);
    }
  }
  // each vector path without an output equals the scalar path with one
  for (std::size_t n : {5u, 16u, 47u, 4099u})
    for (SimdLevel level : {SimdLevel::scalar, SimdLevel::avx2, SimdLevel::avx512}) {
      if (detect_simd_level() < level) continue;
      CAPTURE(n);
      CAPTURE(simd_level_name(level));
      std::vector<float> p(n), m(n), v(n), g(n);
      random_state(rng, p, m, v, g);
      auto p2 = p, m2 = m, v2 = v;
      std::vector<bf16> o(n);
      const auto s = AdamWScalars<float>::make(cfg, 2, 3e-4, 0.05, 0.7);
      detail::adamw_f32(SimdLevel::scalar, s, p.data(), m.data(), v.data(), g.data(), o.data(), n);
      detail::adamw_f32(level, s, p2.data(), m2.data(), v2.data(), g.data(), nullptr, n);
      CHECK(std::memcmp(p.data(), p2.data(), n * 4) == 0);
      CHECK(std::memcmp(m.data(), m2.data(), n * 4) == 0);
      CHECK(std::memcmp(v.data(), v2.data(), n * 4) == 0);
    }
}
