// GRPO (train/grpo.hpp): the advantages, each loss's value and per-token weights against a
// long-double transcription of TRL's formulas and central differences, on fresh random
// log-probabilities with ratios clipped on both sides, with and without the KL term, at awkward
// sizes; micro-batches adding up to the step; TRL's clip statistics; what is refused; and GRPO
// with megatrain's sampler teaching a tiny model on the CPU backend to say the rewarded token.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "../io/io_test_util.hpp"
#include "megatrain/generate/generator.hpp"
#include "megatrain/train/grpo.hpp"
#include "trainer_test_util.hpp"

using namespace megatrain;
using megatrain::test::rng;

namespace {

/// TRL's advantages, written from its formulas (torch's nanmean, its nanstd with Bessel's
/// correction), and the divisor each was scaled by.
struct TrlAdvantages {
  std::vector<long double> values, divisors;
};
TrlAdvantages trl_advantages(const std::vector<double>& r, std::size_t g, RewardScale scale) {
  const auto stats = [](auto first, auto last) {
    long double m = 0, n = static_cast<long double>(last - first), ss = 0;
    for (auto it = first; it != last; ++it) m += *it;
    m /= n;
    for (auto it = first; it != last; ++it) ss += (*it - m) * (*it - m);
    return std::pair<long double, long double>{m, n > 1 ? std::sqrt(ss / (n - 1)) : 0};
  };
  const long double batch_std = stats(r.begin(), r.end()).second;
  TrlAdvantages a{std::vector<long double>(r.size()), std::vector<long double>(r.size(), 1)};
  for (std::size_t i = 0; i < r.size(); ++i) {
    const std::size_t first = i / g * g;
    const auto [m, s] = stats(r.begin() + static_cast<std::ptrdiff_t>(first), r.begin() + static_cast<std::ptrdiff_t>(first + g));
    if (scale != RewardScale::none) a.divisors[i] = (scale == RewardScale::group ? s : batch_std) + 1e-4L;
    a.values[i] = (r[i] - m) / a.divisors[i];
  }
  return a;
}

struct Batch {
  std::int64_t rows = 0, seq = 0, labelled = 0;
  std::vector<std::int32_t> labels;
  std::vector<double> log_probs, old, ref, adv;
  ObjectiveRows view(std::int64_t first = 0, std::int64_t n = -1) const {
    if (n < 0) n = rows;
    const auto at = static_cast<std::size_t>(first * seq), len = static_cast<std::size_t>(n * seq);
    return {first, n, seq, std::span<const std::int32_t>(labels).subspan(at, len),
            std::span<const double>(log_probs).subspan(at, len), labelled};
  }
};

/// Rows of a prompt (no labels) then completion tokens; old log-probabilities up to 0.6 away, so
/// that ratios fall beyond both clips, each at least 1e-3 from a clip (no kink within the
/// central differences' step); advantages of both signs; one row with no completion token.
/// Whatever the seed, row 0 (advantage above 0) starts past the upper clip and row 2 (below 0)
/// past the lower one, so both clip statistics count at least one token.
Batch random_batch(std::int64_t rows, std::int64_t seq, const GrpoOptions& o) {
  Batch b{rows, seq, 0, {}, {}, {}, {}, {}};
  std::uniform_int_distribution<std::int64_t> prompt(1, seq - 1);
  std::uniform_real_distribution<double> lp(-5.0, -0.05), drift(-0.6, 0.6), adv(-2.0, 2.0), far(0.3, 0.6), size(0.2, 2.0);
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t p = r == 1 ? seq : r == 0 || r == 2 ? 1 : prompt(rng());
    for (std::int64_t t = 0; t < seq; ++t) {
      const bool on = t >= p;
      b.labels.push_back(on ? 3 : kIgnoreIndex);
      b.labelled += on;
      const double x = on ? lp(rng()) : 0.0;
      double old = x;
      for (;;) {
        // ratio exp(x - old): above 1.34 for row 0's first completion token, below 0.75 for row 2's
        old = x + (t == p && r == 0 ? -far(rng()) : t == p && r == 2 ? far(rng()) : drift(rng()));
        const double ratio = std::exp(x - old);
        if (std::abs(ratio - (1 - o.epsilon)) > 1e-3 && std::abs(ratio - (1 + o.epsilon_high)) > 1e-3) break;
      }
      b.log_probs.push_back(x);
      b.old.push_back(on ? old : 0.0);
      b.ref.push_back(on ? x + drift(rng()) : 0.0);
    }
    b.adv.push_back(r == 0 ? size(rng()) : r == 2 ? -size(rng()) : adv(rng()));
  }
  return b;
}

/// TRL's loss over the whole batch, written from its formulas (one micro-batch, one process).
long double trl_loss(const GrpoOptions& o, const Batch& b, const std::vector<double>& lp) {
  long double total = 0, tokens = 0;
  for (std::int64_t r = 0; r < b.rows; ++r) {
    long double row = 0, n = 0;
    for (std::int64_t t = 0; t < b.seq; ++t) {
      const auto i = static_cast<std::size_t>(r * b.seq + t);
      if (b.labels[i] == kIgnoreIndex) continue;
      const long double coef1 = std::exp(static_cast<long double>(lp[i]) - b.old[i]);
      const long double coef2 = std::clamp<long double>(coef1, 1 - o.epsilon, 1 + o.epsilon_high);
      const long double a = b.adv[static_cast<std::size_t>(r)];
      long double l = -std::min(coef1 * a, coef2 * a);
      if (o.beta != 0) {
        const long double d = static_cast<long double>(b.ref[i]) - lp[i];
        l += o.beta * (std::exp(d) - d - 1);
      }
      row += l;
      ++n;
    }
    total += o.loss == GrpoLoss::grpo ? row / std::max<long double>(n, 1) : row;
    tokens += n;
  }
  switch (o.loss) {
    case GrpoLoss::grpo: return total / static_cast<long double>(b.rows);
    case GrpoLoss::dapo: return total / tokens;
    case GrpoLoss::dr_grpo: return total / (static_cast<long double>(b.rows) * o.max_completion_length);
  }
  return 0;
}

}  // namespace

TEST_CASE("group advantages as TRL computes them: each scaling, groups of one, equal groups counted") {
  std::uniform_real_distribution<double> reward(-1.0, 3.0);
  for (const RewardScale scale : {RewardScale::group, RewardScale::batch, RewardScale::none}) {
    for (const std::int64_t g : {1, 2, 5, 8}) {
      CAPTURE(reward_scale_name(scale));
      CAPTURE(g);
      std::vector<double> r(static_cast<std::size_t>(3 * g));
      for (auto& x : r) x = reward(rng());
      std::fill(r.begin(), r.begin() + g, 0.5);  // (the first group: every reward equal)
      const Advantages a = group_advantages(r, g, scale);
      const auto want = trl_advantages(r, static_cast<std::size_t>(g), scale);
      CHECK(a.groups == 3);
      CHECK(a.equal_groups == (g == 1 ? 3 : 1));
      REQUIRE(a.equal.size() == 3);
      REQUIRE(a.group_std.size() == 3);
      for (std::size_t k = 0; k < 3; ++k) {  // (each group's flag, and its standard deviation in long double)
        CHECK(a.equal[k] == (g == 1 || k == 0 ? 1 : 0));
        long double mean = 0, ss = 0;
        for (std::int64_t i = 0; i < g; ++i) mean += r[k * static_cast<std::size_t>(g) + static_cast<std::size_t>(i)];
        mean /= static_cast<long double>(g);
        for (std::int64_t i = 0; i < g; ++i) {
          const long double d = r[k * static_cast<std::size_t>(g) + static_cast<std::size_t>(i)] - mean;
          ss += d * d;
        }
        const long double sd = g > 1 ? std::sqrt(ss / static_cast<long double>(g - 1)) : 0;
        CHECK(std::abs(a.group_std[k] - sd) <= 8 * std::numeric_limits<double>::epsilon() * (1 + sd));
      }
      // r - mean cancels where a group's rewards are close: the mean's rounding (a few ulps of the
      // rewards' size) over the divisor bounds the error, not the advantage's own size
      const long double largest = std::abs(*std::max_element(r.begin(), r.end(), [](double x, double y) {
        return std::abs(x) < std::abs(y);
      }));
      for (std::size_t i = 0; i < r.size(); ++i) {
        const long double bound = 8 * std::numeric_limits<double>::epsilon() *
                                  (std::abs(want.values[i]) + largest / want.divisors[i]);
        CHECK(std::abs(static_cast<long double>(a.values[i]) - want.values[i]) <= bound);
      }
      for (std::int64_t i = 0; i < g; ++i) CHECK(a.values[static_cast<std::size_t>(i)] == 0.0);  // (the equal group)
    }
  }
  CHECK_THROWS_WITH_AS(group_advantages(std::vector<double>{1, 2, 3}, 2, RewardScale::group), doctest::Contains("whole groups of 2"), Error);
  CHECK_THROWS_WITH_AS(group_advantages(std::vector<double>{1, std::nan("")}, 2, RewardScale::group),
                       doctest::Contains("completion 1's reward is nan"), Error);
}

TEST_CASE("each GRPO loss: its value and weights against TRL's formulas and central differences; micro-batches add up") {
  for (const GrpoLoss loss : {GrpoLoss::grpo, GrpoLoss::dapo, GrpoLoss::dr_grpo}) {
    for (const double beta : {0.0, 0.04}) {
      CAPTURE(grpo_loss_name(loss));
      CAPTURE(beta);
      GrpoOptions o;
      o.loss = loss;
      o.epsilon = 0.2;
      o.epsilon_high = 0.28;  // (DAPO's clip-higher)
      o.beta = beta;
      o.max_completion_length = 23;
      const Batch b = random_batch(7, 23, o);
      const Grpo grpo(o, b.adv, b.old, beta > 0 ? b.ref : std::vector<double>{}, b.rows);
      const long double want = trl_loss(o, b, b.log_probs);
      CHECK(grpo.value(b.view()) == doctest::Approx(static_cast<double>(want)).epsilon(1e-13));
      std::vector<float> w(b.labels.size());
      grpo.weights(b.view(), w);
      // w_t = -dL/d(log p_t), by central differences of TRL's loss
      const double h = 1e-6;
      double worst = 0, largest = 0;
      for (std::size_t t = 0; t < w.size(); ++t) {
        if (b.labels[t] == kIgnoreIndex) {
          CHECK(w[t] == 0.0f);
          continue;
        }
        std::vector<double> up = b.log_probs, down = b.log_probs;
        up[t] += h;
        down[t] -= h;
        const double d = static_cast<double>((trl_loss(o, b, up) - trl_loss(o, b, down)) / (2 * h));
        worst = std::max(worst, std::abs(-d - static_cast<double>(w[t])));
        largest = std::max(largest, std::abs(d));
      }
      CHECK(largest > 0);
      CHECK(worst <= 1e-6 * largest + 4 * std::numeric_limits<float>::epsilon() * largest);
      // two micro-batches of 3 and 4 rows: the same value and weights
      const double parts = grpo.value(b.view(0, 3)) + grpo.value(b.view(3, 4));
      CHECK(parts == doctest::Approx(grpo.value(b.view())).epsilon(1e-14));
      std::vector<float> w1(static_cast<std::size_t>(3 * b.seq)), w2(static_cast<std::size_t>(4 * b.seq));
      grpo.weights(b.view(0, 3), w1);
      grpo.weights(b.view(3, 4), w2);
      w1.insert(w1.end(), w2.begin(), w2.end());
      CHECK(w1 == w);
      // the clip statistics: tokens past each clip, counted as TRL does
      const GrpoStats st = grpo.stats(b.view());
      std::int64_t low = 0, high = 0;
      for (std::size_t t = 0; t < w.size(); ++t) {
        if (b.labels[t] == kIgnoreIndex) continue;
        const double ratio = std::exp(b.log_probs[t] - b.old[t]), a = b.adv[t / static_cast<std::size_t>(b.seq)];
        low += ratio < 1 - o.epsilon && a < 0;
        high += ratio > 1 + o.epsilon_high && a > 0;
      }
      CHECK(st.tokens == b.labelled);
      CHECK(st.low_clipped == static_cast<double>(low));
      CHECK(st.high_clipped == static_cast<double>(high));
      CHECK(low > 0);
      CHECK(high > 0);
      CHECK((beta > 0) == (st.kl > 0));
    }
  }
}

TEST_CASE("the first update of a batch (no old log-probabilities): the advantage-weighted policy gradient") {
  GrpoOptions o;
  o.loss = GrpoLoss::grpo;
  const Batch b = random_batch(5, 17, o);
  const Grpo grpo(o, b.adv, {}, {}, b.rows);
  std::vector<float> w(b.labels.size());
  grpo.weights(b.view(), w);
  double value = 0;
  for (std::int64_t r = 0; r < b.rows; ++r) {
    std::int64_t n = 0;
    for (std::int64_t t = 0; t < b.seq; ++t) n += b.labels[static_cast<std::size_t>(r * b.seq + t)] != kIgnoreIndex;
    const double a = b.adv[static_cast<std::size_t>(r)], s = 1.0 / (static_cast<double>(std::max<std::int64_t>(n, 1)) * 5);
    for (std::int64_t t = 0; t < b.seq; ++t) {
      const auto i = static_cast<std::size_t>(r * b.seq + t);
      CHECK(w[i] == static_cast<float>(b.labels[i] == kIgnoreIndex ? 0.0 : a * s));
    }
    value -= n > 0 ? a / 5 : 0.0;
  }
  CHECK(grpo.value(b.view()) == doctest::Approx(value).epsilon(1e-14));
}

TEST_CASE("GRPO refuses options out of range, a KL without the reference, rows without an advantage") {
  GrpoOptions o;
  o.epsilon = 1.0;
  CHECK_THROWS_WITH_AS(o.check(), doctest::Contains("epsilon must be in (0, 1)"), Error);
  o = {};
  o.loss = GrpoLoss::dr_grpo;
  CHECK_THROWS_WITH_AS(o.check(), doctest::Contains("max_completion_length"), Error);
  o = {};
  o.beta = 0.1;
  CHECK_THROWS_WITH_AS(Grpo(o, {1.0}, {}, {}, 1), doctest::Contains("give the reference's log-probabilities"), Error);
  const Batch b = random_batch(3, 9, GrpoOptions{});
  const Grpo short_of_rows(GrpoOptions{}, {0.5, -0.5}, {}, {}, 3);
  std::vector<float> w(b.labels.size());
  CHECK_THROWS_WITH_AS(short_of_rows.weights(b.view(), w), doctest::Contains("the advantages cover 2 rows; row 2 has none"),
                       Error);
  CHECK_THROWS_WITH_AS(grpo_loss("ppo"), doctest::Contains("grpo, dapo or dr_grpo"), Error);
  CHECK_THROWS_WITH_AS(reward_scale("max"), doctest::Contains("group, batch or none"), Error);
}

TEST_CASE("GRPO with megatrain's sampler teaches a tiny model to say the rewarded token") {
  constexpr std::int64_t kPrompts = 2, kGroup = 4, kPrompt = 3, kNew = 6, kSeq = kPrompt + kNew, kVocab = 29;
  constexpr std::int32_t kTarget = 11;
  constexpr std::int64_t kRows = kPrompts * kGroup;
  TrainerOptions opt = test::options(kRows, kSeq);
  opt.token_weights = opt.log_prob_objective = true;
  opt.schedule = {LrSchedule::Kind::constant, 1e-2, 0, 0, 0};
  DecoderModel<> model(test::tiny(false, kVocab));
  HostParamStore<float> store(model.units(), test::store_opts(opt));
  CpuBackend<float> backend;
  Trainer<CpuBackend<float>> trainer(model, store, backend, opt);
  std::vector<std::vector<std::int32_t>> prompts;
  for (std::int64_t p = 0; p < kPrompts; ++p)
    for (std::int64_t k = 0; k < kGroup; ++k) prompts.push_back({static_cast<std::int32_t>(1 + p), 4, 7});
  generate::GenerationOptions gen;
  gen.max_new_tokens = kNew;
  const generate::SlotShape shape{kRows, kSeq, kVocab, 0};
  GrpoOptions o;  // (dapo, epsilon 0.2, no KL)
  const auto mean_reward = [](const std::vector<double>& r) {
    double s = 0;
    for (const double x : r) s += x;
    return s / static_cast<double>(r.size());
  };
  double first = -1, last = -1;
  for (int step = 0; step < 40; ++step) {
    gen.sampling.seed = static_cast<std::uint64_t>(step);
    const auto done = generate::generate(trainer, shape, prompts, gen);
    std::vector<std::int32_t> ids(static_cast<std::size_t>(kRows * kSeq), 0), labels(ids.size(), kIgnoreIndex);
    std::vector<double> rewards;
    for (std::int64_t r = 0; r < kRows; ++r) {
      const auto& c = done[static_cast<std::size_t>(r)].tokens;
      REQUIRE(static_cast<std::int64_t>(c.size()) == kNew);
      rewards.push_back(static_cast<double>(std::count(c.begin(), c.end(), kTarget)) / kNew);
      const auto row = static_cast<std::size_t>(r * kSeq);
      std::copy(prompts[static_cast<std::size_t>(r)].begin(), prompts[static_cast<std::size_t>(r)].end(), ids.begin() + static_cast<std::ptrdiff_t>(row));
      for (std::int64_t t = 0; t < kNew; ++t) {
        ids[row + static_cast<std::size_t>(kPrompt + t)] = c[static_cast<std::size_t>(t)];
        labels[row + static_cast<std::size_t>(kPrompt - 1 + t)] = c[static_cast<std::size_t>(t)];
      }
    }
    if (step == 0) first = mean_reward(rewards);
    last = mean_reward(rewards);
    const Advantages adv = group_advantages(rewards, kGroup, RewardScale::group);
    trainer.step(Grpo(o, adv.values, {}, {}, kRows), ids, labels);
  }
  trainer.finish_update();
  CAPTURE(first);
  CAPTURE(last);
  CHECK(first < 0.2);  // (about 1 in 29 tokens at the start)
  CHECK(last >= 0.6);
}
