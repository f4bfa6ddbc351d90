// Objectives at the head (train/objective.hpp) and the scoring pass (Trainer::score): a weighted
// objective and one that reads the step's log-probabilities follow the plain loop with the same
// weights; the scoring pass gives the training forward's log-probabilities bit for bit.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "pair_preference.hpp"
#include "reference_loop.hpp"
#include "trainer_test_util.hpp"

using namespace megatrain;
using namespace megatrain::test;

namespace {

std::vector<float> random_weights(std::mt19937& rng, const std::vector<std::int32_t>& labels) {
  std::uniform_real_distribution<float> u(-1.5f, 1.5f);  // advantages of either sign
  std::vector<float> w(labels.size());
  for (std::size_t t = 0; t < w.size(); ++t) w[t] = labels[t] == kIgnoreIndex ? 0.0f : u(rng) / static_cast<float>(w.size());
  return w;
}

std::vector<float> masters(const HostParamStore<float>& store) {
  store.check_settled("reading the store in a test");
  std::vector<float> out;
  for (const auto& u : store.units()) out.insert(out.end(), u.master().begin(), u.master().end());
  return out;
}

// Options whose update is linear in the gradient: AdamW's eps far above sqrt(v), so a step moves
// each weight by about -lr * (its momentum), and no weight decay. Two runs' weight changes then
// differ as their gradients do (Adam's sign-like steps would amplify the rounding of gradients
// near zero).
TrainerOptions linear_update(std::int64_t rows, std::int64_t seq) {
  auto o = options(rows, seq);
  o.adamw.eps = 1.0;
  o.adamw.weight_decay = 0.0;
  o.adamw.lr = 1.0;
  o.schedule = {LrSchedule::Kind::constant, 1.0, 0, 0, 0.0};
  return o;
}

// The largest difference between two runs' changes of any weight, relative to the largest change.
double update_difference(const std::vector<float>& start, const HostParamStore<float>& a, const HostParamStore<float>& b) {
  const auto x = masters(a), y = masters(b);
  double worst = 0, largest = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    worst = std::max(worst, std::fabs(static_cast<double>(x[i]) - y[i]));
    largest = std::max(largest, std::fabs(static_cast<double>(y[i]) - start[i]));
  }
  REQUIRE(largest > 0);
  return worst / largest;
}

}  // namespace

TEST_CASE("an advantage-weighted objective trains as the plain loop with the same weights per token") {
  for (const std::int64_t micro : {1, 2}) {
    CAPTURE(micro);
    const auto cfg = tiny(true);
    auto o = linear_update(4, 13);
    o.micro_batches = micro;
    o.chunk_rows = 1;
    o.clip_norm = 0.05;
    o.token_weights = true;
    DecoderModel<> model(cfg);
    HostParamStore<float> store(model.units(), store_opts(o)), ref_store(model.units(), store_opts(o));
    CpuBackend<float> be;
    Trainer<CpuBackend<float>> trainer(model, store, be, o);
    test::ReferenceLoop ref{model, ref_store, o.adamw, o.schedule, o.clip_norm, 4, 13, {}};
    const auto start = masters(store);
    std::mt19937 rng(21);
    for (int s = 0; s < 4; ++s) {
      CAPTURE(s);
      const auto b = random_batch(rng, 4, 13, 53);
      ref.token_weights = random_weights(rng, b.labels);
      const auto r = ref.step(b.ids, b.labels);
      const auto st = trainer.step(TokenWeighted(ref.token_weights), b.ids, b.labels);
      CHECK(st.loss == doctest::Approx(r.loss).epsilon(1e-5));
      CHECK(st.grad_norm == doctest::Approx(r.grad_norm).epsilon(1e-4));
      trainer.finish_update();
      CHECK(update_difference(start, store, ref_store) < 1e-5);
    }
  }
}

TEST_CASE("cross-entropy as weights (1 / labelled tokens each) is the cross-entropy step within float rounding") {
  const auto cfg = tiny(false);
  auto o = linear_update(4, 11);
  o.token_weights = true;
  DecoderModel<> model(cfg);
  HostParamStore<float> a(model.units(), store_opts(o)), b(model.units(), store_opts(o));
  const auto start = masters(a);
  CpuBackend<float> be;
  Trainer<CpuBackend<float>> ta(model, a, be, o), tb(model, b, be, o);
  std::mt19937 rng(4);
  for (int s = 0; s < 3; ++s) {
    const auto batch = random_batch(rng, 4, 11, 53);
    std::int64_t valid = 0;
    for (const auto y : batch.labels) valid += y != kIgnoreIndex;
    std::vector<float> w(batch.labels.size());
    for (std::size_t t = 0; t < w.size(); ++t)
      w[t] = batch.labels[t] == kIgnoreIndex ? 0.0f : static_cast<float>(1.0 / static_cast<double>(valid));
    const auto sa = ta.step(batch.ids, batch.labels);
    const auto lp = ta.last_log_probs();
    const auto sb = tb.step(TokenWeighted(w), batch.ids, batch.labels);
    CHECK(sb.loss == doctest::Approx(sa.loss).epsilon(8 * 1.2e-7));
    // CrossEntropy's own weights and value (what a weighted path would use) are the same objective
    const ObjectiveRows rows{0, 4, 11, batch.labels, lp, valid};
    std::vector<float> ce(w.size());
    CrossEntropy{}.weights(rows, ce);
    CHECK(ce == w);
    CHECK(CrossEntropy{}.value(rows) == doctest::Approx(sa.loss).epsilon(1e-12));
    CHECK(sb.grad_norm == doctest::Approx(sa.grad_norm).epsilon(1e-5));
  }
  ta.finish_update();
  tb.finish_update();
  CHECK(update_difference(start, b, a) < 1e-6);
}

TEST_CASE("an objective that reads the step's log-probabilities (a preference pair) trains as the plain loop") {
  struct Case {
    std::int64_t micro, chunk_rows;
    double clip;  // (0 with one micro-batch: each unit stepped as its gradient lands)
  };
  for (const Case k : {Case{1, 0, 0.05}, Case{2, 1, 0.05}, Case{1, 2, 0.0}}) {
    CAPTURE(k.micro);
    CAPTURE(k.chunk_rows);
    const auto cfg = tiny(k.micro == 1);
    auto o = linear_update(4, 9);
    o.micro_batches = k.micro;
    o.chunk_rows = k.chunk_rows;
    o.clip_norm = k.clip;
    o.token_weights = o.log_prob_objective = true;
    DecoderModel<> model(cfg);
    HostParamStore<float> store(model.units(), store_opts(o)), ref_store(model.units(), store_opts(o));
    CpuBackend<float> be;
    Trainer<CpuBackend<float>> trainer(model, store, be, o);
    test::ReferenceLoop ref{model, ref_store, o.adamw, o.schedule, o.clip_norm, 4, 9, {}};
    const test::PairPreference pref(4);
    const auto start = masters(store);
    double want = 0;
    std::vector<std::int32_t> ref_labels;
    ref.weigh = [&](const std::vector<float>& losses) {  // the whole batch's, its pairs one after the other
      std::vector<double> lp(losses.size());
      for (std::size_t t = 0; t < lp.size(); ++t) lp[t] = -static_cast<double>(losses[t]);
      const ObjectiveRows rows{0, 4, 9, ref_labels, lp, 0};
      std::vector<float> w(losses.size());
      pref.weights(rows, w);
      want = pref.value(rows);
      return w;
    };
    std::mt19937 rng(12);
    for (int s = 0; s < 4; ++s) {
      CAPTURE(s);
      const auto b = random_batch(rng, 4, 9, 53);
      ref_labels = b.labels;
      const auto r = ref.step(b.ids, b.labels);
      const auto st = trainer.step(pref, b.ids, b.labels);
      CHECK(st.loss == doctest::Approx(want).epsilon(1e-5));
      CHECK(st.grad_norm == doctest::Approx(r.grad_norm).epsilon(1e-4));
      trainer.finish_update();
      CHECK(update_difference(start, store, ref_store) < 1e-5);
    }
  }
}

TEST_CASE("score() gives the training forward's log-probabilities bit for bit, and changes nothing") {
  for (const std::int64_t micro : {1, 2}) {
    CAPTURE(micro);
    const auto cfg = tiny(micro == 2);
    auto o = options(4, 10);
    o.micro_batches = micro;
    o.chunk_rows = 1;
    DecoderModel<> model(cfg);
    HostParamStore<float> store(model.units(), store_opts(o));
    CpuBackend<float> be;
    Trainer<CpuBackend<float>> trainer(model, store, be, o);
    std::mt19937 rng(30);
    trainer.step(random_batch(rng, 4, 10, 53).ids, random_batch(rng, 4, 10, 53).labels);
    trainer.finish_update();
    const auto b = random_batch(rng, 4, 10, 53);
    const auto before = state_of(store);
    const auto scored = trainer.score(b.ids, b.labels, 4);
    trainer.finish_update();
    CHECK(same_bits(before, state_of(store)));
    const auto st = trainer.step(b.ids, b.labels);
    const auto trained = trainer.last_log_probs();
    REQUIRE(scored.size() == trained.size());
    CHECK(std::memcmp(scored.data(), trained.data(), scored.size() * sizeof(double)) == 0);
    double nll = 0;
    std::int64_t valid = 0;
    for (std::size_t t = 0; t < scored.size(); ++t) {
      if (b.labels[t] == kIgnoreIndex) {
        CHECK(scored[t] == 0.0);
        continue;
      }
      CHECK(scored[t] < 0.0);
      nll -= scored[t];
      ++valid;
    }
    CHECK(st.loss == doctest::Approx(nll / static_cast<double>(valid)).epsilon(1e-12));
  }
}

TEST_CASE("a weighted objective without TrainerOptions::token_weights, or with too few weights, is refused before anything changes") {
  const auto cfg = tiny(true);
  auto o = options(2, 8);
  DecoderModel<> model(cfg);
  HostParamStore<float> store(model.units(), store_opts(o));
  CpuBackend<float> be;
  std::mt19937 rng(3);
  const auto b = random_batch(rng, 2, 8, 53);
  for (const bool buffers : {false, true}) {
    CAPTURE(buffers);
    o.token_weights = buffers;
    Trainer<CpuBackend<float>> trainer(model, store, be, o);
    const auto before = state_of(store);
    const std::size_t given = buffers ? 15 : 16;  // (with the buffers: one weight short)
    CHECK_THROWS_WITH_AS(trainer.step(TokenWeighted(std::vector<float>(given, 0.1f)), b.ids, b.labels),
                         doctest::Contains(buffers ? "15 weights were given" : "TrainerOptions::token_weights"), Error);
    CHECK(same_bits(before, state_of(store)));
    CHECK(trainer.steps_done() == 0);
  }
  Trainer<CpuBackend<float>> trainer(model, store, be, o);
  // (an objective that reads the log-probabilities: refused without log_prob_objective, which the plan prices)
  const auto before = state_of(store);
  CHECK_THROWS_WITH_AS(trainer.step(test::PairPreference(2), b.ids, b.labels),
                       doctest::Contains("TrainerOptions::log_prob_objective"), Error);
  CHECK(same_bits(before, state_of(store)));
  trainer.step(TokenWeighted(std::vector<float>(16, 0.1f)), b.ids, b.labels);  // (with as many weights as tokens, it trains)
  CHECK(trainer.steps_done() == 1);
  o.log_prob_objective = true;
  o.token_weights = false;
  CHECK_THROWS_WITH_AS(o.validate(), doctest::Contains("set token_weights too"), Error);
}
