// Finite-difference gradient checks in float64, and the small helpers the layer tests share.
//
// Method. A function with outputs `out` becomes the scalar L = sum_i out_i R_i with a fresh
// random R (contract()); the backward run with dy = R gives the analytic gradient of L for
// every input and weight. For each checked coordinate x_j the central difference
//
//     num_j = (L(x_j + h) - L(x_j - h)) / 2h
//
// is compared with the analytic value ana_j:   |num_j - ana_j| <= atol + rtol |ana_j|.
// Every coordinate of a small tensor is checked; for a large one, its first and last element
// and a random sample of the rest (GradcheckOptions::samples).
//
// Tolerance. The difference quotient is off the true derivative by
//   truncation   h^2 / 6 |d3L/dx_j3|           (zero for a function linear in x_j), and
//   rounding     ~ eps |L|_abs / h             (each evaluation of L rounds at ~eps |L|_abs),
// where |L|_abs = sum_i |out_i R_i|. L is summed with compensation, so the sum adds only
// ~eps |L|_abs; the rest is the primitives' own rounding, which is identical in both
// evaluations wherever an output does not depend on x_j. The tests draw inputs and weights
// so that every activation is O(1); then third derivatives, too, are bounded by a modest
// multiple of
//   S = sum_i |R_i| (1 + |out_i|)   (>= |L|_abs),
// and the absolute tolerance is
//   atol = S (kTruncation h^2 + kRounding eps / h),   kTruncation = 16, kRounding = 8,
// with h = 4e-6, the step that minimises atol ((kRounding eps / 2 kTruncation)^(1/3)); then
// atol ~ 7e-10 S. Measured over 40 seeds (MEGATRAIN_TEST_SEED=1..40), the worst error of any
// check is 0.16 atol (a whole two-block model, whose truncation error reaches ~3 S h^2) and
// 0.07 atol for single primitives and ops; MEGATRAIN_TEST_VERBOSE=1 prints each
// check's worst err / atol and err / tol. rtol = 1e-6 covers large gradients. A real bug (a
// wrong scale, mask, head mapping or sign, a dropped term, = instead of +=) moves a gradient
// by orders of magnitude more than this tolerance.
// A tensor whose checked gradients all vanish makes the check vacuous, so that is a failure
// unless the tensor says `may_vanish`.
//
// Seeds are fixed per test; MEGATRAIN_TEST_SEED (an integer) mixes into all of them to try
// other draws. Failures print the seed.
#pragma once

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <unordered_set>
#include <vector>

#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/core/tensor.hpp"
#include "megatrain/layers/layer_template.hpp"
#include "megatrain/model/config.hpp"
#include "megatrain/model/unit_layout.hpp"

namespace megatrain::test {

// ---- random numbers ------------------------------------------------------------------------

/// The seed a test uses: `base`, mixed with MEGATRAIN_TEST_SEED when that is set.
inline std::uint64_t test_seed(std::uint64_t base) {
  const char* env = std::getenv("MEGATRAIN_TEST_SEED");
  if (env == nullptr || *env == '\0') return base;
  return base ^ (std::strtoull(env, nullptr, 10) * 0x9e3779b97f4a7c15ull);
}

/// A small deterministic generator (splitmix64): the same draws on every platform, unlike
/// the <random> distributions.
class Random {
 public:
  explicit Random(std::uint64_t seed) : seed_(seed), state_(seed) {}

  std::uint64_t seed() const { return seed_; }
  std::uint64_t bits() {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  /// Uniform in [lo, hi).
  double uniform(double lo, double hi) { return lo + (hi - lo) * static_cast<double>(bits() >> 11) * 0x1p-53; }
  /// Uniform integer in [0, n).
  std::int64_t index(std::int64_t n) { return static_cast<std::int64_t>(bits() % static_cast<std::uint64_t>(n)); }

  /// n values uniform in [lo, hi), converted to T.
  template <class T = double>
  std::vector<T> vector(std::int64_t n, double lo, double hi) {
    std::vector<T> v(static_cast<std::size_t>(n));
    fill(std::span<T>(v), lo, hi);
    return v;
  }
  template <class T>
  void fill(std::span<T> v, double lo, double hi) {
    for (auto& x : v) x = static_cast<T>(uniform(lo, hi));
  }

 private:
  std::uint64_t seed_, state_;
};

// ---- views over test buffers ---------------------------------------------------------------

template <class T>
View<T> view(std::vector<T>& v, Shape s) {
  return View<T>(std::span<T>(v), s);
}
template <class T>
View<const T> cview(const std::vector<T>& v, Shape s) {
  return View<const T>(std::span<const T>(v), s);
}
/// A contiguous view of `s` starting at element `offset` of `v` (a chunk of a batch).
template <class T>
View<T> view_at(std::vector<T>& v, std::int64_t offset, Shape s) {
  return View<T>(std::span<T>(v).subspan(static_cast<std::size_t>(offset), static_cast<std::size_t>(s.numel())), s);
}
template <class T>
View<const T> cview_at(const std::vector<T>& v, std::int64_t offset, Shape s) {
  return View<const T>(
      std::span<const T>(v).subspan(static_cast<std::size_t>(offset), static_cast<std::size_t>(s.numel())), s);
}

// ---- small models with O(1) activations --------------------------------------------------

/// The fields of a test model's config.json that the tests vary.
struct TestModel {
  const char* arch;  ///< "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"
  std::int64_t hidden, intermediate, heads, kv_heads, head_dim;
  bool attention_bias = false;  ///< Llama only: q/k/v and o biases
  bool mlp_bias = false;        ///< Llama only
  double rope_theta = 10000.0;
  std::int64_t vocab = 37;
  bool tied = false;
  std::int64_t layers = 1;
};

inline ModelConfig make_config(const TestModel& s) {
  nlohmann::json j{
      {"architectures", {s.arch}},     {"hidden_size", s.hidden},        {"intermediate_size", s.intermediate},
      {"num_hidden_layers", s.layers}, {"num_attention_heads", s.heads}, {"num_key_value_heads", s.kv_heads},
      {"head_dim", s.head_dim},        {"vocab_size", s.vocab},          {"rms_norm_eps", 1e-5},
      {"rope_theta", s.rope_theta},    {"tie_word_embeddings", s.tied}};
  if (std::string(s.arch) == "LlamaForCausalLM") {
    j["attention_bias"] = s.attention_bias;
    j["mlp_bias"] = s.mlp_bias;
  }
  return ModelConfig::from_json(j, "test config");
}

/// A slab for `layout` that keeps every activation O(1): norm weights in [0.6, 1.4], biases in
/// [-0.3, 0.3], matrices [out, in] uniform with variance 1 / in. Alignment gaps stay zero.
template <class T = double>
std::vector<T> random_weights(const UnitLayout& layout, Random& rng) {
  std::vector<T> slab(static_cast<std::size_t>(layout.numel()), T(0));
  for (const auto& e : layout.entries()) {
    auto t = std::span<T>(slab).subspan(static_cast<std::size_t>(e.offset), static_cast<std::size_t>(e.numel()));
    switch (e.spec.init) {
      case ParamInit::ones:
        rng.fill(t, 0.6, 1.4);
        break;
      case ParamInit::zeros:
        rng.fill(t, -0.3, 0.3);
        break;
      case ParamInit::normal: {  // (fan-in: the elements of a row; a convolution's taps)
        const double a = std::sqrt(3.0 / static_cast<double>(e.numel() / e.spec.shape[0]));
        rng.fill(t, -a, a);
        break;
      }
      case ParamInit::a_log:  // (decays exp(A_log) softplus(.) of order 1)
        rng.fill(t, -1.0, 0.7);
        break;
    }
  }
  return slab;
}

// ---- comparisons ---------------------------------------------------------------------------

/// Checks |got_i - want_i| <= atol + rtol |want_i| for all i; reports the first few misses and
/// returns the worst ratio |got - want| / tolerance (NaN counts as a miss).
template <class A, class B>
double check_close(const std::string& what, std::span<const A> got, std::span<const B> want, double rtol, double atol) {
  REQUIRE_MESSAGE(got.size() == want.size(), what, ": sizes differ");
  double worst = 0;
  int bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = static_cast<double>(got[i]), w = static_cast<double>(want[i]);
    const double tol = atol + rtol * std::abs(w), err = std::abs(g - w);
    if (!(err <= tol)) {
      if (++bad <= 5)
        FAIL_CHECK(fmt::format("{}[{}]: got {:.17g}, want {:.17g} (error {:.3g} > tolerance {:.3g})", what, i, g, w,
                               err, tol));
      worst = std::numeric_limits<double>::infinity();
    } else if (tol > 0) {
      worst = std::max(worst, err / tol);
    }
  }
  if (bad > 5) FAIL_CHECK(fmt::format("{}: {} of {} elements out of tolerance", what, bad, got.size()));
  return worst;
}
template <class A, class B>
double check_close(const std::string& what, const std::vector<A>& got, const std::vector<B>& want, double rtol,
                   double atol) {
  return check_close(what, std::span<const A>(got), std::span<const B>(want), rtol, atol);
}

/// a - b, elementwise (the increment of an accumulated gradient).
template <class T>
std::vector<T> minus(const std::vector<T>& a, const std::vector<T>& b) {
  std::vector<T> d(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) d[i] = a[i] - b[i];
  return d;
}

/// Root mean square of v (a scale for absolute tolerances).
template <class T>
double rms(std::span<const T> v) {
  double s = 0;
  for (T x : v) s += static_cast<double>(x) * static_cast<double>(x);
  return v.empty() ? 0.0 : std::sqrt(s / static_cast<double>(v.size()));
}
template <class T>
double rms(const std::vector<T>& v) {
  return rms(std::span<const T>(v));
}

// ---- the gradient check --------------------------------------------------------------------

/// The scalar a gradient check differentiates, and its magnitude S (see the top of the file).
struct Objective {
  double value = 0;
  double scale = 0;
};

/// Neumaier-compensated sum: the rounding of the sum itself stays ~eps sum|terms|.
class CompensatedSum {
 public:
  void add(double x) {
    const double t = sum_ + x;
    comp_ += std::abs(sum_) >= std::abs(x) ? (sum_ - t) + x : (x - t) + sum_;
    sum_ = t;
  }
  double value() const { return sum_ + comp_; }

 private:
  double sum_ = 0, comp_ = 0;
};

/// L = sum_i out_i r_i and S = sum_i |r_i| (1 + |out_i|).
template <class T>
Objective contract(std::span<const T> out, std::span<const double> r) {
  REQUIRE(out.size() == r.size());
  CompensatedSum l, s;
  for (std::size_t i = 0; i < out.size(); ++i) {
    const double o = static_cast<double>(out[i]);
    l.add(o * r[i]);
    s.add(std::abs(r[i]) * (1 + std::abs(o)));
  }
  return {l.value(), s.value()};
}
template <class T>
Objective contract(const std::vector<T>& out, const std::vector<double>& r) {
  return contract(std::span<const T>(out), std::span<const double>(r));
}
inline Objective operator+(Objective a, Objective b) { return {a.value + b.value, a.scale + b.scale}; }

/// One tensor whose gradient is checked.
struct GradTensor {
  std::string name;
  std::span<double> value;       ///< perturbed in place (and restored); the objective must read it
  std::span<const double> grad;  ///< the analytic dL/dvalue
  bool may_vanish = false;       ///< an all-zero gradient is expected (else it fails as vacuous)
};

struct GradcheckOptions {
  static constexpr double kTruncation = 16.0;
  static constexpr double kRounding = 8.0;
  double step = 4e-6;
  double rtol = 1e-6;
  std::int64_t exhaustive_limit = 64;  ///< tensors up to this size: every coordinate
  std::int64_t samples = 48;           ///< larger ones: first, last and this many random others
};

struct GradcheckResult {
  std::int64_t checked = 0;  ///< coordinates compared
  std::int64_t failed = 0;
  double worst_ratio = 0;      ///< max |num - ana| / tolerance over all coordinates (< 1 passes)
  double worst_abs_ratio = 0;  ///< max |num - ana| / atol: how much of the absolute part is used
};

/// The coordinates of an n-element tensor a check visits, in increasing order.
inline std::vector<std::int64_t> pick_coordinates(std::int64_t n, const GradcheckOptions& opt, Random& rng) {
  std::vector<std::int64_t> idx;
  if (n <= opt.exhaustive_limit || n <= opt.samples + 2) {
    for (std::int64_t i = 0; i < n; ++i) idx.push_back(i);
    return idx;
  }
  std::unordered_set<std::int64_t> seen{0, n - 1};
  while (static_cast<std::int64_t>(seen.size()) < opt.samples + 2) seen.insert(rng.index(n));
  idx.assign(seen.begin(), seen.end());
  std::sort(idx.begin(), idx.end());
  return idx;
}

/// Compares each tensor's analytic gradient with central differences of `objective`, which
/// recomputes L from the tensors' current values. Reports misses through doctest.
inline GradcheckResult gradcheck(const std::function<Objective()>& objective, const std::vector<GradTensor>& tensors,
                                 Random& rng, const GradcheckOptions& opt = {}) {
  constexpr double eps = std::numeric_limits<double>::epsilon();
  const Objective base = objective();
  REQUIRE_MESSAGE(std::isfinite(base.value), "objective is not finite at the base point (seed ", rng.seed(), ")");
  GradcheckResult res;
  for (const auto& t : tensors) {
    REQUIRE_MESSAGE(t.value.size() == t.grad.size(), t.name, ": value and gradient sizes differ");
    const auto n = static_cast<std::int64_t>(t.value.size());
    std::int64_t bad = 0;
    double largest_num = 0, largest_atol = 0;
    for (const std::int64_t j : pick_coordinates(n, opt, rng)) {
      auto& x = t.value[j];
      const double x0 = x;
      x = x0 + opt.step;
      const double hp = x - x0;  // the step actually taken (x0 + h rounds)
      const Objective p = objective();
      x = x0 - opt.step;
      const double hm = x0 - x;
      const Objective m = objective();
      x = x0;
      const double num = (p.value - m.value) / (hp + hm);
      const double ana = t.grad[j];
      const double s = std::max({base.scale, p.scale, m.scale});
      const double atol =
          s * (GradcheckOptions::kTruncation * opt.step * opt.step + GradcheckOptions::kRounding * eps / opt.step);
      const double tol = atol + opt.rtol * std::abs(ana), err = std::abs(num - ana);
      ++res.checked;
      res.worst_abs_ratio = std::max(res.worst_abs_ratio, err / atol);
      largest_num = std::max(largest_num, std::abs(num));
      largest_atol = std::max(largest_atol, atol);
      if (!(err <= tol)) {
        ++res.failed;
        res.worst_ratio = std::numeric_limits<double>::infinity();
        if (++bad <= 5)
          FAIL_CHECK(
              fmt::format("{}[{}]: numerical {:.12g}, analytic {:.12g}, error {:.3g} > tolerance {:.3g} (seed {})",
                          t.name, j, num, ana, err, tol, rng.seed()));
      } else {
        res.worst_ratio = std::max(res.worst_ratio, err / tol);
      }
    }
    if (bad > 5) FAIL_CHECK(fmt::format("{}: {} coordinates out of tolerance", t.name, bad));
    if (!t.may_vanish)
      CHECK_MESSAGE(largest_num > 100 * largest_atol, t.name,
                    ": L does not depend on this tensor at the checked coordinates, so the check proves nothing");
  }
  return res;
}

/// Fails the test case if any coordinate failed; with MEGATRAIN_TEST_VERBOSE set, prints the margin.
inline void report(const std::string& what, const GradcheckResult& r) {
  CHECK_MESSAGE(r.failed == 0, what, ": ", r.failed, " of ", r.checked, " coordinates out of tolerance");
  if (std::getenv("MEGATRAIN_TEST_VERBOSE") != nullptr)
    MESSAGE(fmt::format("{}: {} coordinates, worst error / tolerance {:.3g}, worst error / atol {:.3g}", what,
                        r.checked, r.worst_ratio, r.worst_abs_ratio));
}

// ---- a whole layer ---------------------------------------------------------------------------

/// The backward of `layer` (a [tokens, hidden] op) against central differences of its forward,
/// for the input and every weight (gradcheck.hpp).
/// `may_vanish(name)`: a tensor whose gradient may vanish on these inputs.
template <class Op>
void gradcheck_layer(const LayerTemplate<Op>& layer, ChunkShape c, std::uint64_t seed, const std::string& what,
                     bool (*may_vanish)(const std::string&) = nullptr) {
  using Be = CpuBackend<double>;
  using Vec = std::vector<double>;
  CAPTURE(what);
  Random rng(test_seed(seed));
  Be be;
  const std::int64_t M = c.tokens(), d = layer.op().hidden_size();
  Vec slab = random_weights(layer.layout(), rng);
  Vec x = rng.vector(M * d, -1, 1);
  const Vec r = rng.vector(M * d, -1, 1);
  std::vector<std::byte> mem(layer.op().template scratch_bytes<Be>(c));
  Arena arena{std::span<std::byte>(mem)};
  const auto w = layer.bind(std::span<const double>(slab));
  Vec y(x.size());
  auto objective = [&] {
    layer.op().forward(be, c, w, cview(x, {M, d}), view(y, {M, d}), arena);
    return contract(y, r);
  };
  const Vec g0 = rng.vector(layer.layout().numel(), -1, 1);
  Vec g = g0, dx(x.size(), std::numeric_limits<double>::quiet_NaN());
  layer.op().backward(be, c, w, cview(x, {M, d}), cview(r, {M, d}), view(dx, {M, d}), layer.bind(std::span<double>(g)), arena);
  const Vec inc = minus(g, g0);
  std::vector<GradTensor> t{{"x", x, dx}};
  for (const auto& e : layer.layout().entries()) {
    const auto off = static_cast<std::size_t>(e.offset), n = static_cast<std::size_t>(e.numel());
    t.push_back({e.spec.name, std::span<double>(slab).subspan(off, n), std::span<const double>(inc).subspan(off, n),
                 may_vanish != nullptr && may_vanish(e.spec.name)});
  }
  report(what, gradcheck(objective, t, rng));
}

}  // namespace megatrain::test
