// The next token (see include/megatrain/generate/sampler.hpp).
#include "megatrain/generate/sampler.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "megatrain/core/error.hpp"

namespace megatrain::generate {

namespace {

constexpr double kRemoved = -std::numeric_limits<double>::infinity();

/// softmax of `x` (removed entries -inf), in place of `p`.
void softmax(const std::vector<double>& x, std::vector<double>& p) {
  const double top = *std::max_element(x.begin(), x.end());
  double sum = 0;
  p.resize(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) sum += p[i] = x[i] == kRemoved ? 0.0 : std::exp(x[i] - top);
  for (double& v : p) v /= sum;
}

/// Token ids from the most likely to the least: by score, ties by the lower id first.
std::vector<std::int32_t> most_likely_first(const std::vector<double>& x) {
  std::vector<std::int32_t> order(x.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) { return x[a] > x[b]; });
  return order;
}

}  // namespace

void SamplingOptions::check() const {
  MT_CHECK(std::isfinite(temperature) && temperature >= 0, "sampling: temperature must be >= 0 (0: greedy), not {}",
           temperature);
  MT_CHECK(top_k >= 0, "sampling: top_k must be >= 0 (0: every token), not {}", top_k);
  MT_CHECK(top_p > 0 && top_p <= 1, "sampling: top_p must be in (0, 1] (1: every token), not {}", top_p);
  MT_CHECK(min_p >= 0 && min_p <= 1, "sampling: min_p must be in [0, 1] (0: every token), not {}", min_p);
  MT_CHECK(std::isfinite(repetition_penalty) && repetition_penalty > 0,
           "sampling: repetition_penalty must be > 0 (1: none), not {}", repetition_penalty);
}

SequenceRng::SequenceRng(std::uint64_t seed, std::uint64_t sequence) : state_(seed) {
  // (the sequence's stream starts where SplitMix64 from the seed would be after mixing in its
  // index: distinct sequences, distinct streams)
  state_ ^= 0x9E3779B97F4A7C15ull * (sequence + 1);
  (void)next();
}

std::uint64_t SequenceRng::next() {
  std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

Sampler::Sampler(const SamplingOptions& options, std::int64_t vocab) : o_(options), vocab_(vocab) {
  o_.check();
  MT_CHECK(vocab > 0 && vocab <= std::numeric_limits<std::int32_t>::max(), "sampling: a vocabulary of {} tokens", vocab);
}

std::vector<double> Sampler::scaled(std::span<const float> logits, std::span<const std::int32_t> seen) const {
  MT_CHECK(static_cast<std::int64_t>(logits.size()) == vocab_, "sampling: {} logits for a vocabulary of {}", logits.size(),
           vocab_);
  std::vector<double> x(logits.begin(), logits.end());
  for (const double v : x) MT_CHECK(!std::isnan(v), "sampling: a logit is NaN");
  if (o_.repetition_penalty != 1) {
    std::vector<char> done(x.size(), 0);
    for (const std::int32_t t : seen) {
      MT_CHECK(t >= 0 && t < vocab_, "sampling: token {} of the sequence is outside the vocabulary of {}", t, vocab_);
      if (done[static_cast<std::size_t>(t)]++) continue;
      double& v = x[static_cast<std::size_t>(t)];
      v = v < 0 ? v * o_.repetition_penalty : v / o_.repetition_penalty;
    }
  }
  if (!o_.greedy() && o_.temperature != 1)
    for (double& v : x) v /= o_.temperature;
  return x;
}

std::vector<double> Sampler::distribution(std::span<const float> logits, std::span<const std::int32_t> seen) const {
  std::vector<double> x = scaled(logits, seen);
  std::vector<double> p(x.size(), 0.0);
  if (o_.greedy()) {  // (the first largest)
    p[static_cast<std::size_t>(std::max_element(x.begin(), x.end()) - x.begin())] = 1;
    return p;
  }
  // (the tokens in order, where top-k or top-p needs it: a sort of the vocabulary)
  const std::vector<std::int32_t> order = (o_.top_k > 0 && o_.top_k < vocab_) || o_.top_p < 1 ? most_likely_first(x)
                                                                                                 : std::vector<std::int32_t>{};
  const auto remove_after = [&](std::size_t keep) {  // (the `keep` most likely stay)
    for (std::size_t i = keep; i < order.size(); ++i) x[static_cast<std::size_t>(order[i])] = kRemoved;
  };
  if (o_.top_k > 0 && o_.top_k < vocab_) {  // (ties with the k-th kept)
    const double kth = x[static_cast<std::size_t>(order[static_cast<std::size_t>(o_.top_k - 1)])];
    std::size_t keep = static_cast<std::size_t>(o_.top_k);
    while (keep < order.size() && x[static_cast<std::size_t>(order[keep])] == kth) ++keep;
    remove_after(keep);
  }
  if (o_.top_p < 1) {  // (from the least likely up: removed while the sum, its own included, is at most 1 - p)
    softmax(x, p);
    double below = 0;
    std::size_t keep = order.size();
    while (keep > 1) {
      below += p[static_cast<std::size_t>(order[keep - 1])];
      if (below > 1 - o_.top_p) break;
      --keep;
    }
    remove_after(keep);
  }
  if (o_.min_p > 0) {  // (the most likely always stays: it is at least min_p times itself)
    softmax(x, p);
    const double floor = o_.min_p * *std::max_element(p.begin(), p.end());
    for (std::size_t i = 0; i < p.size(); ++i)
      if (p[i] < floor) x[i] = kRemoved;
  }
  softmax(x, p);
  return p;
}

Choice Sampler::choose(std::span<const float> logits, std::span<const std::int32_t> seen, SequenceRng& rng) const {
  const std::vector<double> p = distribution(logits, seen);
  Choice c;
  if (o_.greedy()) {
    c.token = static_cast<std::int32_t>(std::max_element(p.begin(), p.end()) - p.begin());
  } else {
    const double u = rng.uniform();
    double sum = 0;
    std::int32_t last = -1;
    for (std::size_t i = 0; i < p.size(); ++i) {
      if (p[i] == 0) continue;
      last = static_cast<std::int32_t>(i);
      sum += p[i];
      if (sum > u) break;
    }
    c.token = last;  // (the last kept token where rounding leaves the sum short of u)
  }
  // log_softmax of the raw logits at the token
  const float top = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (const float v : logits) sum += std::exp(static_cast<double>(v) - top);
  c.logprob = static_cast<double>(logits[static_cast<std::size_t>(c.token)]) - top - std::log(sum);
  return c;
}

}  // namespace megatrain::generate
