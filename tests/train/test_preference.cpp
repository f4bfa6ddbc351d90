// Preference objectives (train/preference.hpp): each loss, its value and its per-token weights
// against a float64 transcription of TRL's formulas and central differences, at awkward sizes on
// fresh random log-probabilities; micro-batches adding up to the step; TRL's statistics; what is
// refused; and DPO training a tiny model on the CPU backend, the training pairs' preference
// accuracy going from about one half to at least 0.9.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "../io/io_test_util.hpp"
#include "megatrain/train/preference.hpp"
#include "trainer_test_util.hpp"

using namespace megatrain;
using megatrain::test::rng;

namespace {

struct Batch {
  std::int64_t rows = 0, seq = 0;
  std::vector<std::int32_t> labels;
  std::vector<double> log_probs, reference;  // (reference: one a row)
  ObjectiveRows view(std::int64_t first = 0, std::int64_t rows_in = -1) const {
    const std::int64_t n = rows_in < 0 ? rows : rows_in;
    const auto at = static_cast<std::size_t>(first * seq), len = static_cast<std::size_t>(n * seq);
    return {first, n, seq, std::span<const std::int32_t>(labels).subspan(at, len),
            std::span<const double>(log_probs).subspan(at, len), 0};
  }
};

/// Pairs of rows with a prompt (no labels) of random length, then labelled answer tokens.
Batch random_batch(std::int64_t pairs, std::int64_t seq) {
  Batch b{2 * pairs, seq, {}, {}, {}};
  std::uniform_int_distribution<std::int64_t> prompt(0, seq - 1);
  std::uniform_real_distribution<double> lp(-6.0, -0.01), ref(-30.0, -1.0);
  for (std::int64_t r = 0; r < b.rows; ++r) {
    const std::int64_t p = prompt(rng());
    for (std::int64_t t = 0; t < seq; ++t) {
      b.labels.push_back(t < p ? kIgnoreIndex : 7);
      b.log_probs.push_back(t < p ? 0.0 : lp(rng()));
    }
    b.reference.push_back(ref(rng()));
  }
  return b;
}

/// TRL's loss of one pair, written from its formulas.
long double trl_loss(const PreferenceOptions& o, long double pc, long double pr, long double rc, long double rr) {
  const long double logits = (pc - rc) - (pr - rr), b = o.beta, e = o.label_smoothing;
  switch (o.loss) {
    case PreferenceLoss::sigmoid:
      return -std::log(1 / (1 + std::exp(-b * logits))) * (1 - e) - std::log(1 / (1 + std::exp(b * logits))) * e;
    case PreferenceLoss::hinge: return std::max<long double>(0, 1 - b * logits);
    case PreferenceLoss::ipo: return (logits - 1 / (2 * b)) * (logits - 1 / (2 * b));
  }
  return 0;
}

/// The mean over the batch's pairs of TRL's loss (IPO on per-token means).
double trl_value(const PreferenceOptions& o, const Batch& b) {
  long double total = 0;
  for (std::int64_t i = 0; i < b.rows / 2; ++i) {
    long double s[2] = {0, 0}, n[2] = {0, 0};
    for (int k = 0; k < 2; ++k)
      for (std::int64_t t = 0; t < b.seq; ++t) {
        const auto at = static_cast<std::size_t>((2 * i + k) * b.seq + t);
        if (b.labels[at] == kIgnoreIndex) continue;
        s[k] += b.log_probs[at];
        n[k] += 1;
      }
    long double rc = b.reference[static_cast<std::size_t>(2 * i)], rr = b.reference[static_cast<std::size_t>(2 * i + 1)];
    if (o.loss == PreferenceLoss::ipo) {
      s[0] /= n[0], s[1] /= n[1], rc /= n[0], rr /= n[1];
    }
    total += trl_loss(o, s[0], s[1], rc, rr);
  }
  return static_cast<double>(total / static_cast<long double>(b.rows / 2));
}

std::vector<PreferenceOptions> every_loss() {
  return {{PreferenceLoss::sigmoid, 0.1, 0.0}, {PreferenceLoss::sigmoid, 0.5, 0.2}, {PreferenceLoss::hinge, 0.3, 0.0},
          {PreferenceLoss::ipo, 0.1, 0.0}, {PreferenceLoss::ipo, 2.0, 0.0}};
}

}  // namespace

TEST_CASE("each loss and its weights: TRL's formulas in float64, and central differences") {
  for (const PreferenceOptions& o : every_loss()) {
    for (const auto& [pairs, seq] : {std::pair<std::int64_t, std::int64_t>{1, 1}, {3, 7}, {5, 64}}) {
      CAPTURE(preference_loss_name(o.loss));
      CAPTURE(o.beta);
      CAPTURE(pairs);
      CAPTURE(seq);
      Batch b = random_batch(pairs, seq);
      const Dpo dpo(o, b.reference, pairs);
      CHECK(dpo.value(b.view()) == doctest::Approx(trl_value(o, b)).epsilon(1e-12));
      std::vector<float> w(b.labels.size());
      dpo.weights(b.view(), w);
      // w_t = -dL/d(log p_t): central differences of the float64 value
      for (std::size_t t = 0; t < w.size(); ++t) {
        CAPTURE(t);
        if (b.labels[t] == kIgnoreIndex) {
          CHECK(w[t] == 0.0f);
          continue;
        }
        const double h = 1e-5, keep = b.log_probs[t];
        b.log_probs[t] = keep + h;
        const double up = trl_value(o, b);
        b.log_probs[t] = keep - h;
        const double down = trl_value(o, b);
        b.log_probs[t] = keep;
        const double want = -(up - down) / (2 * h);
        // (float weights; the differences' own error, about 1e-16 |L| / h, bounds the absolute
        // term; the hinge's kink is never within h of a random margin)
        CHECK(std::abs(static_cast<double>(w[t]) - want) <= 1e-5 * std::abs(want) + 1e-8);
      }
    }
  }
}

TEST_CASE("micro-batches of whole pairs add up to the step; TRL's statistics") {
  const PreferenceOptions o{PreferenceLoss::sigmoid, 0.25, 0.0};
  const Batch b = random_batch(6, 11);
  const Dpo dpo(o, b.reference, 6);
  const double whole = dpo.value(b.view());
  CHECK(dpo.value(b.view(0, 4)) + dpo.value(b.view(4, 8)) == doctest::Approx(whole).epsilon(1e-14));
  std::vector<float> all(b.labels.size()), part(b.labels.size());
  dpo.weights(b.view(), all);
  dpo.weights(b.view(0, 4), std::span<float>(part).first(44));
  dpo.weights(b.view(4, 8), std::span<float>(part).subspan(44));
  CHECK(all == part);
  // statistics: hand-made pairs, one that prefers the chosen answer and one that does not
  Batch h{4, 2, {kIgnoreIndex, 1, kIgnoreIndex, 1, 1, 1, 1, 1}, {0, -1.0, 0, -3.0, -2.0, -2.0, -1.0, -0.5},
          {-2.0, -2.0, -5.0, -1.0}};
  const PreferenceStats s = Dpo(o, h.reference, 2).stats(h.view());
  // pair 0: chosen -1 (ref -2): reward 0.25; rejected -3 (ref -2): -0.25. pair 1: chosen -4 (ref -5):
  // 0.25; rejected -1.5 (ref -1): -0.125
  CHECK(s.pairs == 2);
  CHECK(s.rewards_chosen == doctest::Approx(0.5));
  CHECK(s.rewards_rejected == doctest::Approx(-0.375));
  CHECK(s.margins == doctest::Approx(0.875));
  CHECK(s.accuracies == 2.0);
  CHECK(s.logps_chosen == doctest::Approx(-5.0));
  CHECK(s.logps_rejected == doctest::Approx(-4.5));
  PreferenceStats twice = s;
  twice += s;
  CHECK(twice.pairs == 4);
  CHECK(twice.margins == doctest::Approx(1.75));
}

TEST_CASE("packed rows of whole pairs: the value, weights and statistics of the same pairs an answer a row") {
  // Five pairs of 9-token answer rows, packed two pairs a row of 40 tokens (the padding after
  // them one more sequence, without a label), the last row one pair; micro-batches of rows.
  for (const PreferenceOptions& o : every_loss()) {
    CAPTURE(preference_loss_name(o.loss));
    const Batch b = random_batch(5, 9);
    const std::int64_t S = 40;
    std::vector<std::int32_t> labels, positions;
    std::vector<double> lp;
    std::vector<std::int64_t> row_first;
    std::vector<std::size_t> from;  // each packed token's place in the unpacked batch (or none: padding)
    for (std::int64_t p = 0; p < 5; p += 2) {
      row_first.push_back(2 * p);
      for (std::int64_t a = 2 * p; a < std::min<std::int64_t>(2 * p + 4, 10); ++a)
        for (std::int64_t t = 0; t < 9; ++t) {
          const auto at = static_cast<std::size_t>(a * 9 + t);
          labels.push_back(b.labels[at]);
          lp.push_back(b.log_probs[at]);
          positions.push_back(static_cast<std::int32_t>(t));
          from.push_back(at);
        }
      for (std::int32_t t = 0; labels.size() % S != 0; ++t) {
        labels.push_back(kIgnoreIndex);
        lp.push_back(0);
        positions.push_back(t);
        from.push_back(SIZE_MAX);
      }
    }
    REQUIRE(labels.size() == 3 * S);
    const auto rows = [&](std::int64_t first, std::int64_t n) {
      const auto at = static_cast<std::size_t>(first * S), len = static_cast<std::size_t>(n * S);
      ObjectiveRows r{first, n, S, std::span<const std::int32_t>(labels).subspan(at, len),
                      std::span<const double>(lp).subspan(at, len), 0};
      r.positions = std::span<const std::int32_t>(positions).subspan(at, len);
      return r;
    };
    const Dpo unpacked(o, b.reference, 5), packed(o, b.reference, 5, row_first);
    CHECK(packed.value(rows(0, 3)) == unpacked.value(b.view()));
    CHECK(packed.value(rows(0, 2)) + packed.value(rows(2, 1)) == doctest::Approx(unpacked.value(b.view())).epsilon(1e-14));
    std::vector<float> want(b.labels.size()), got(labels.size());
    unpacked.weights(b.view(), want);
    packed.weights(rows(0, 2), std::span<float>(got).first(2 * S));
    packed.weights(rows(2, 1), std::span<float>(got).subspan(2 * S));
    for (std::size_t t = 0; t < got.size(); ++t) CHECK(got[t] == (from[t] == SIZE_MAX ? 0.0f : want[from[t]]));
    const PreferenceStats a = packed.stats(rows(0, 3)), c = unpacked.stats(b.view());
    CHECK(a.pairs == 5);
    CHECK(a.margins == c.margins);
    CHECK(a.accuracies == c.accuracies);
    // a row that splits a pair, and a row without where its references start
    std::vector<std::int32_t> odd = positions;
    odd[static_cast<std::size_t>(S + 9)] = 1;  // (row 1's first pair merged into one answer: three answers)
    ObjectiveRows r = rows(1, 1);
    r.positions = std::span<const std::int32_t>(odd).subspan(static_cast<std::size_t>(S), static_cast<std::size_t>(S));
    CHECK_ERROR_MENTIONS(packed.value(r), "packed row 1 holds 3 answers: a row must hold whole pairs");
    CHECK_ERROR_MENTIONS(Dpo(o, b.reference, 5, {0}).value(rows(0, 3)), "row 1 has none");
  }
}

TEST_CASE("refused: options out of range, pairs split or without answers, references short") {
  CHECK_ERROR_MENTIONS(preference_loss("kto"), "'kto' is not a preference loss: sigmoid (DPO), hinge or ipo");
  CHECK(preference_loss("ipo") == PreferenceLoss::ipo);
  const std::vector<double> ref(4, -1.0);
  CHECK_ERROR_MENTIONS(Dpo({PreferenceLoss::sigmoid, 0.0, 0.0}, ref, 2), "beta must be > 0");
  CHECK_ERROR_MENTIONS(Dpo({PreferenceLoss::sigmoid, 0.1, 0.5}, ref, 2), "label_smoothing must be in [0, 0.5)");
  CHECK_ERROR_MENTIONS(Dpo({PreferenceLoss::hinge, 0.1, 0.1}, ref, 2), "label_smoothing applies to the sigmoid loss");
  const Dpo dpo({}, ref, 2);
  Batch b = random_batch(2, 5);
  std::vector<float> w(b.labels.size());
  CHECK_ERROR_MENTIONS(dpo.weights(b.view(1, 2), std::span<float>(w).first(10)), "splits a pair");
  CHECK_ERROR_MENTIONS(dpo.value(b.view(0, 3)), "splits a pair");
  for (std::size_t t = 5; t < 10; ++t) b.labels[t] = kIgnoreIndex;
  CHECK_ERROR_MENTIONS(dpo.value(b.view()), "pair 0's rejected answer (row 1) has no labelled token");
  const Batch c = random_batch(2, 5);
  CHECK_ERROR_MENTIONS(Dpo({}, std::vector<double>(3, -1.0), 2).value(c.view()),
                       "the reference's log-probabilities cover 3 answers; answer 3 has none");
}

TEST_CASE("DPO trains a tiny model: the training pairs' preference accuracy from about a half to at least 0.9") {
  constexpr std::int64_t kPairs = 8, kSeq = 13, kPrompt = 5;
  TrainerOptions opt = test::options(2 * kPairs, kSeq);
  opt.token_weights = opt.log_prob_objective = true;
  opt.micro_batches = 2;  // (4 pairs each)
  opt.schedule = {LrSchedule::Kind::constant, 3e-3, 0, 0, 0};
  DecoderModel<> model(test::tiny(false, 61));
  HostParamStore<float> store(model.units(), test::store_opts(opt));
  CpuBackend<float> backend;
  Trainer<CpuBackend<float>> trainer(model, store, backend, opt);
  // Each pair: a prompt, then two answers; labels on the answers (the next token).
  std::mt19937 g(17);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(2 * kPairs * kSeq)), labels(ids.size(), kIgnoreIndex);
  for (std::int64_t i = 0; i < kPairs; ++i)
    for (std::int64_t c = 0; c < kSeq; ++c) {
      const auto a = static_cast<std::size_t>(2 * i * kSeq + c), r = a + static_cast<std::size_t>(kSeq);
      ids[a] = static_cast<std::int32_t>(g() % 61);
      ids[r] = c < kPrompt ? ids[a] : static_cast<std::int32_t>(g() % 61);
    }
  for (std::int64_t row = 0; row < 2 * kPairs; ++row)
    for (std::int64_t c = kPrompt - 1; c + 1 < kSeq; ++c)
      labels[static_cast<std::size_t>(row * kSeq + c)] = ids[static_cast<std::size_t>(row * kSeq + c + 1)];
  // the reference: the scoring pass of the initial weights, summed a row
  const auto row_sums = [&] {
    const auto lp = trainer.score(ids, labels, 2 * kPairs);
    std::vector<double> s(static_cast<std::size_t>(2 * kPairs), 0.0);
    for (std::size_t t = 0; t < lp.size(); ++t) s[t / kSeq] += lp[t];
    return s;
  };
  const std::vector<double> reference = row_sums();
  const Dpo dpo({PreferenceLoss::sigmoid, 0.5, 0.0}, reference, kPairs);
  const auto accuracy = [&] {
    const auto lp = trainer.score(ids, labels, 2 * kPairs);
    const ObjectiveRows rows{0, 2 * kPairs, kSeq, labels, lp, 0};
    const PreferenceStats s = dpo.stats(rows);
    return s.accuracies / static_cast<double>(s.pairs);
  };
  const double before = accuracy();
  CHECK(before == 0.0);  // (the policy is the reference: no pair's reward is above the other's)
  double first_loss = 0, loss = 0;
  for (int step = 0; step < 30; ++step) {
    loss = trainer.step(dpo, ids, labels).loss;
    if (step == 0) first_loss = loss;
  }
  trainer.finish_update();
  CHECK(first_loss == doctest::Approx(std::log(2.0)).epsilon(1e-6));  // (h = 0 for every pair at the start)
  CHECK(loss < first_loss);
  CHECK(accuracy() >= 0.9);
}
