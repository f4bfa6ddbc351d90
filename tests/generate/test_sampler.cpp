// The next token's choice (megatrain/generate/sampler.hpp): each processor against an independent
// float64 transcription of transformers' (generation/logits_process.py) on fresh random logits at
// awkward vocabulary sizes, and on hand-built distributions whose kept tokens are worked out by
// hand; their order; ties; greedy; the draw's frequencies; a seed that repeats a run.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "../io/io_test_util.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/generate/sampler.hpp"

using namespace megatrain;
using namespace megatrain::generate;
using megatrain::test::rng;

namespace {

std::vector<float> random_logits(std::size_t n, float scale = 3.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> x(n);
  for (float& v : x) v = d(rng());
  return x;
}

/// Logits whose softmax is `p` (up to the float rounding of the logs).
std::vector<float> logits_of(std::initializer_list<double> p) {
  std::vector<float> x;
  for (const double v : p) x.push_back(static_cast<float>(std::log(v)));
  return x;
}

std::vector<double> softmax(const std::vector<double>& x) {
  const double top = *std::max_element(x.begin(), x.end());
  std::vector<double> p(x.size());
  double s = 0;
  for (std::size_t i = 0; i < x.size(); ++i) s += p[i] = std::isinf(x[i]) ? 0.0 : std::exp(x[i] - top);
  for (double& v : p) v /= s;
  return p;
}

/// transformers' warpers in float64, as written there: scores masked to -inf.
struct Reference {
  std::vector<double> x;
  void top_k(std::int64_t k) {
    std::vector<double> sorted = x;
    std::sort(sorted.begin(), sorted.end(), std::greater<>());
    const double kth = sorted[static_cast<std::size_t>(std::min<std::int64_t>(k, static_cast<std::int64_t>(x.size())) - 1)];
    for (double& v : x)
      if (v < kth) v = -INFINITY;
  }
  void top_p(double p) {  // ascending by score (ties: the higher id first), cumulative softmax, <= 1 - p removed, last kept
    std::vector<std::size_t> asc(x.size());
    std::iota(asc.begin(), asc.end(), 0);
    std::sort(asc.begin(), asc.end(), [&](std::size_t a, std::size_t b) { return x[a] < x[b] || (x[a] == x[b] && a > b); });
    const std::vector<double> prob = softmax(x);
    double cum = 0;
    std::vector<bool> remove(x.size(), false);
    for (std::size_t i = 0; i < asc.size(); ++i) {
      cum += prob[asc[i]];
      remove[asc[i]] = cum <= 1 - p && i + 1 < asc.size();
    }
    for (std::size_t i = 0; i < x.size(); ++i)
      if (remove[i]) x[i] = -INFINITY;
  }
  void min_p(double m) {
    const std::vector<double> prob = softmax(x);
    const double top = *std::max_element(prob.begin(), prob.end());
    for (std::size_t i = 0; i < x.size(); ++i)
      if (prob[i] < m * top) x[i] = -INFINITY;
  }
};

std::set<std::size_t> kept(const std::vector<double>& p) {
  std::set<std::size_t> s;
  for (std::size_t i = 0; i < p.size(); ++i)
    if (p[i] > 0) s.insert(i);
  return s;
}

void check_close(const std::vector<double>& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    if (want[i] == 0)
      CHECK(got[i] == 0);
    else
      CHECK(got[i] == doctest::Approx(want[i]).epsilon(1e-12));
  }
}

}  // namespace

TEST_CASE("options out of range are refused, naming the field") {
  const auto refused = [](SamplingOptions o, const char* field) { CHECK_ERROR_MENTIONS(Sampler(o, 10), field); };
  SamplingOptions o;
  o.temperature = -0.5;
  refused(o, "temperature must be >= 0");
  o = {};
  o.top_k = -1;
  refused(o, "top_k must be >= 0");
  for (const double p : {0.0, 1.5, -0.1}) {
    o = {};
    o.top_p = p;
    refused(o, "top_p must be in (0, 1]");
  }
  o = {};
  o.min_p = 1.01;
  refused(o, "min_p must be in [0, 1]");
  o = {};
  o.repetition_penalty = 0;
  refused(o, "repetition_penalty must be > 0");
  const Sampler s({}, 10);
  const std::vector<float> short_logits(9, 0.0f);
  CHECK_ERROR_MENTIONS(s.distribution(short_logits, {}), "9 logits for a vocabulary of 10");
  const std::vector<float> x(10, 0.0f);
  const std::vector<std::int32_t> bad{3, 10};
  SamplingOptions pen;
  pen.repetition_penalty = 1.3;
  CHECK_ERROR_MENTIONS(Sampler(pen, 10).distribution(x, bad), "token 10 of the sequence is outside the vocabulary of 10");
}

TEST_CASE("greedy: the first largest logit, after the repetition penalty; its log-probability the model's") {
  SamplingOptions o;
  o.temperature = 0;
  const Sampler s(o, 6);
  const std::vector<float> x{0.5f, 2.0f, -1.0f, 2.0f, 1.9f, 0.0f};
  SequenceRng r(1, 0);
  const Choice c = s.choose(x, {}, r);
  CHECK(c.token == 1);  // (tied with 3: the lower id)
  double z = 0;
  for (const float v : x) z += std::exp(static_cast<double>(v));
  CHECK(c.logprob == doctest::Approx(2.0 - std::log(z)).epsilon(1e-12));
  const auto p = s.distribution(x, {});
  CHECK(kept(p) == std::set<std::size_t>{1});
  // penalised, tokens 1 and 3 fall below 4 (1.9): 2.0 / 1.1 = 1.82
  o.repetition_penalty = 1.1;
  const std::vector<std::int32_t> seen{3, 1, 1};
  CHECK(Sampler(o, 6).choose(x, seen, r).token == 4);
}

TEST_CASE("temperature and the repetition penalty: the softmax of the logits they make") {
  for (const std::size_t V : {std::size_t{1}, std::size_t{97}, std::size_t{1000}}) {
    CAPTURE(V);
    const auto x = random_logits(V);
    std::vector<std::int32_t> seen;
    std::uniform_int_distribution<std::int32_t> id(0, static_cast<std::int32_t>(V) - 1);
    for (int i = 0; i < 20; ++i) seen.push_back(id(rng()));
    for (const double t : {1.0, 0.7, 1.6}) {
      for (const double pen : {1.0, 1.3, 0.8}) {
        CAPTURE(t);
        CAPTURE(pen);
        SamplingOptions o;
        o.temperature = t;
        o.repetition_penalty = pen;
        std::vector<double> want(x.begin(), x.end());
        std::set<std::int32_t> unique(seen.begin(), seen.end());
        for (const std::int32_t k : unique) {
          double& v = want[static_cast<std::size_t>(k)];
          v = v < 0 ? v * pen : v / pen;
        }
        for (double& v : want) v /= t;
        check_close(Sampler(o, static_cast<std::int64_t>(V)).distribution(x, seen), softmax(want));
      }
    }
  }
}

TEST_CASE("top-k, top-p and min-p, alone and together, against transformers' warpers in float64") {
  for (const std::size_t V : {std::size_t{2}, std::size_t{61}, std::size_t{1024}}) {
    for (int trial = 0; trial < 20; ++trial) {
      auto x = random_logits(V, trial % 2 ? 1.0f : 4.0f);
      // ties: a few logits repeated
      for (std::size_t i = 0; i + 3 < V; i += 7) x[i + 3] = x[i];
      std::uniform_int_distribution<std::int64_t> kd(1, static_cast<std::int64_t>(V) + 2);
      std::uniform_real_distribution<double> pd(0.05, 1.0), md(0.0, 0.5);
      SamplingOptions o;
      o.temperature = 0.9;
      o.top_k = trial % 3 == 0 ? 0 : kd(rng());
      o.top_p = trial % 4 == 1 ? 1.0 : pd(rng());
      o.min_p = trial % 5 == 2 ? 0.0 : md(rng());
      CAPTURE(V);
      CAPTURE(o.top_k);
      CAPTURE(o.top_p);
      CAPTURE(o.min_p);
      Reference ref{std::vector<double>(x.begin(), x.end())};
      for (double& v : ref.x) v /= o.temperature;
      if (o.top_k > 0) ref.top_k(o.top_k);
      if (o.top_p < 1) ref.top_p(o.top_p);
      if (o.min_p > 0) ref.min_p(o.min_p);
      check_close(Sampler(o, static_cast<std::int64_t>(V)).distribution(x, {}), softmax(ref.x));
    }
  }
}

TEST_CASE("the kept tokens of hand-built distributions") {
  // probabilities 1/2, 1/4, 1/8, 1/16, 1/16 (ids 3 and 4 tie)
  const auto x = logits_of({0.5, 0.25, 0.125, 0.0625, 0.0625});
  const auto keeps = [&](SamplingOptions o) { return kept(Sampler(o, 5).distribution(x, {})); };
  SamplingOptions o;
  o.top_p = 0.7;  // (from the least likely: 1/16 + 1/16 + 1/8 = 1/4 <= 0.3 go; with 1/4 more, 1/2 > 0.3)
  CHECK(keeps(o) == std::set<std::size_t>{0, 1});
  o.top_p = 0.9;  // (1/16 <= 0.1 goes; 1/8 > 0.1 stays)
  CHECK(keeps(o) == std::set<std::size_t>{0, 1, 2, 3});  // (of the tie, the higher id went)
  o.top_p = 0.95;  // (1/16 > 0.05: nothing goes)
  CHECK(keeps(o).size() == 5);
  o.top_p = 0.01;  // (the most likely always stays)
  CHECK(keeps(o) == std::set<std::size_t>{0});
  o = {};
  o.top_k = 4;  // (the 4th largest is 1/16: both of the tie stay)
  CHECK(keeps(o).size() == 5);
  o.top_k = 3;
  CHECK(keeps(o) == std::set<std::size_t>{0, 1, 2});
  o = {};
  o.min_p = 0.24;  // (at least 0.12: 1/8 stays)
  CHECK(keeps(o) == std::set<std::size_t>{0, 1, 2});
  o.min_p = 0.26;  // (at least 0.13: 1/8 goes)
  CHECK(keeps(o) == std::set<std::size_t>{0, 1});
  // the order: top-p reads the distribution top-k left. 0.4, 0.3, 0.2, 0.1 with top_k 2 leaves
  // 4/7, 3/7; top_p 0.5 then removes 3/7 (<= 0.5). Top-p first would have kept ids 0 and 1.
  const auto y = logits_of({0.4, 0.3, 0.2, 0.1});
  o = {};
  o.top_k = 2;
  o.top_p = 0.5;
  const auto p = Sampler(o, 4).distribution(y, {});
  CHECK(kept(p) == std::set<std::size_t>{0});
  CHECK(p[0] == 1.0);
}

TEST_CASE("draws follow the processed distribution; a seed repeats them, each sequence its own stream") {
  const auto x = logits_of({0.3, 0.05, 0.25, 0.15, 0.1, 0.1, 0.05});
  SamplingOptions o;
  o.top_k = 5;
  o.seed = 20261207;
  const Sampler s(o, 7);
  const auto p = s.distribution(x, {});
  const int n = 200000;
  std::vector<int> count(7, 0);
  SequenceRng r(o.seed, 0);
  for (int i = 0; i < n; ++i) ++count[static_cast<std::size_t>(s.choose(x, {}, r).token)];
  for (std::size_t i = 0; i < 7; ++i) {
    CAPTURE(i);
    const double sigma = std::sqrt(n * p[i] * (1 - p[i]));
    CHECK(std::abs(count[i] - n * p[i]) <= 5 * sigma + 1e-9);
    CHECK((count[i] > 0) == (p[i] > 0));
  }
  // the same seed and sequence: the same tokens; another seed or sequence: others
  const auto run = [&](std::uint64_t seed, std::uint64_t seq) {
    SequenceRng g(seed, seq);
    std::vector<std::int32_t> t;
    for (int i = 0; i < 64; ++i) t.push_back(s.choose(x, {}, g).token);
    return t;
  };
  CHECK(run(7, 0) == run(7, 0));
  CHECK(run(7, 0) != run(8, 0));
  CHECK(run(7, 0) != run(7, 1));
  // the stream is SplitMix64's, pinned: a run repeats on any machine and in later versions
  SequenceRng g(0, 0);
  std::uint64_t state = 0x9E3779B97F4A7C15ull;  // (0 ^ golden x (0 + 1))
  const auto splitmix = [&state] {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  (void)splitmix();
  for (int i = 0; i < 4; ++i) CHECK(g.next() == splitmix());
  SequenceRng u(3, 2);
  for (int i = 0; i < 1000; ++i) {
    const double v = u.uniform();
    CHECK((v >= 0 && v < 1));
  }
}
