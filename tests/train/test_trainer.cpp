// The streaming trainer on the CPU backend: the same losses as a plain loop, independent of
// timing and thread scheduling, deterministic, with user stages and every mode.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <cstring>
#include <limits>
#include <map>
#include <thread>
#include <mutex>
#include <random>

#include "megatrain/train/cpu_trainer.hpp"
#include "reference_loop.hpp"
#include "trainer_test_util.hpp"
#include "timeline_check.hpp"

using namespace megatrain;
using namespace megatrain::test;

namespace {

/// `batch` (when given) makes each step's batch from the generator instead of random_batch.
std::vector<StepStats> run(const ModelConfig& cfg, const TrainerOptions& o, int steps, std::vector<float>* weights = nullptr,
                           const std::function<Batch(std::mt19937&)>& batch = {}) {
  DecoderModel<> model(cfg);
  HostParamStore<float> store(model.units(), store_opts(o));
  CpuBackend<float> be;
  Trainer<CpuBackend<float>> trainer(model, store, be, o);
  if (o.device_units != TrainerOptions::kAutoDeviceUnits) REQUIRE(trainer.device_units() == static_cast<std::size_t>(o.device_units));
  std::mt19937 rng(5);
  std::vector<StepStats> out;
  for (int s = 0; s < steps; ++s) {
    auto b = batch ? batch(rng) : random_batch(rng, o.batch_rows, o.seq_len, static_cast<std::int32_t>(cfg.vocab_size));
    out.push_back(trainer.step(b.ids, b.labels, {}, b.mask));
  }
  trainer.finish_update();  // (with resident gradients the last update may still be in flight)
  if (weights)
    for (const auto& u : store.units()) weights->insert(weights->end(), u.master().begin(), u.master().end());
  return out;
}

/// What a user stage that reads the landed gradients needs besides its run().
struct GradientReaderStage {
  GradientView view;
  HostExecutor exec;
  explicit GradientReaderStage(GradientView v) : view(std::move(v)) {}
  HostExecutor& executor() { return exec; }
  bool applies(const TrainItem& it) const { return it.carries_gradient(); }
  std::size_t ring_slots() const { return 0; }
  UnitAccess unit_access() const { return UnitAccess::none; }
};

/// Runs the plain loop over run()'s batches and checks each step's loss and gradient norm
/// against `stats` (rel 1e-5 and 1e-4); returns the largest relative difference of any master
/// weight from `weights` (what run() left).
double against_plain_loop(const ModelConfig& cfg, const TrainerOptions& o, const std::vector<StepStats>& stats,
                          const std::vector<float>& weights, const std::function<Batch(std::mt19937&)>& batch = {}) {
  DecoderModel<> model(cfg);
  HostParamStore<float> store(model.units(), store_opts(o));
  const bool stale = o.clip_mode == ClipMode::stale;
  test::ReferenceLoop ref{model, store, o.adamw, o.schedule, stale ? 0.0 : o.clip_norm, o.batch_rows, o.seq_len, {}};
  std::mt19937 rng(5);
  std::optional<double> last_norm;
  for (std::size_t s = 0; s < stats.size(); ++s) {
    auto b = batch ? batch(rng) : random_batch(rng, o.batch_rows, o.seq_len, static_cast<std::int32_t>(cfg.vocab_size));
    if (stale && o.clip_norm > 0) ref.clip_coef = last_norm ? clip_coefficient(*last_norm, o.clip_norm) : 1.0;
    ref.attention_mask = b.mask;
    const auto r = ref.step(b.ids, b.labels);
    last_norm = r.grad_norm;
    CAPTURE(s);
    CHECK(stats[s].loss == doctest::Approx(r.loss).epsilon(1e-5));
    CHECK(stats[s].grad_norm == doctest::Approx(r.grad_norm).epsilon(1e-4));
    CHECK(stats[s].aux_loss == doctest::Approx(r.aux_loss).epsilon(1e-6));
  }
  std::vector<float> want;
  for (const auto& u : store.units()) want.insert(want.end(), u.master().begin(), u.master().end());
  REQUIRE(want.size() == weights.size());
  double worst = 0;
  for (std::size_t i = 0; i < want.size(); ++i)
    worst = std::max(worst, std::fabs(static_cast<double>(weights[i]) - want[i]) / (std::fabs(static_cast<double>(want[i])) + 1e-3));
  return worst;
}

}  // namespace

TEST_CASE("the streaming trainer follows a plain loop over the same ops (fp32, rel 1e-5)") {
  struct Case {
    const char* name;
    bool tied;
    std::int64_t chunk_rows, micro;
    double clip;
    ClipMode mode;
  };
  for (const Case& k : {Case{"tied, one chunk", true, 0, 1, 0.0, ClipMode::exact},
                        Case{"untied, chunks of 2", false, 2, 1, 0.0, ClipMode::exact},
                        Case{"tied, chunks of 3 (uneven), exact clipping", true, 3, 1, 0.05, ClipMode::exact},
                        Case{"untied, 2 micro-batches", false, 0, 2, 0.0, ClipMode::exact},
                        Case{"tied, 4 micro-batches, chunks of 1, exact clipping", true, 1, 4, 0.05, ClipMode::exact}}) {
    CAPTURE(std::string(k.name));
    const auto cfg = tiny(k.tied);
    auto o = options(4, 11);
    o.chunk_rows = k.chunk_rows;
    o.micro_batches = k.micro;
    o.clip_norm = k.clip;
    o.clip_mode = k.mode;
    const auto stats = run(cfg, o, 6);

    DecoderModel<> model(cfg);
    StoreOptions so = store_opts(o);
    HostParamStore<float> store(model.units(), so);
    test::ReferenceLoop ref{model, store, o.adamw, o.schedule, k.clip, 4, 11, {}};
    std::mt19937 rng(5);
    for (int s = 0; s < 6; ++s) {
      auto b = random_batch(rng, 4, 11, static_cast<std::int32_t>(cfg.vocab_size));
      const auto r = ref.step(b.ids, b.labels);
      CAPTURE(s);
      CHECK(stats[s].loss == doctest::Approx(r.loss).epsilon(1e-5));
      CHECK(stats[s].grad_norm == doctest::Approx(r.grad_norm).epsilon(1e-4));
      if (k.clip > 0) CHECK(stats[s].clip_coef < 1.0);
    }
  }
}

TEST_CASE("a large vocabulary lands in pieces and still follows the plain loop (every weight, rel 1e-6)") {
  // Vocabulary 1111 x hidden 32 is about 3.3 blocks: the embedding's untouched rows come in
  // 4 pieces, an untied head in 4, and 8 x 64 tokens use ~500 distinct rows, 2 pieces of them.
  for (const bool tied : {true, false}) {
    for (const double clip : {0.0, 0.05}) {
      CAPTURE(tied);
      CAPTURE(clip);
      const auto cfg = tiny(tied, 1111);
      auto o = options(8, 64);  // one chunk, as the plain loop: the same sums in the same order
      o.clip_norm = clip;
      o.clip_mode = ClipMode::stale;  // streamed either way (no resident gradients)
      DecoderModel<> model(cfg);
      const auto so = store_opts(o);
      const auto fp = HostParamStore<float>::footprint(model.units(), so);
      REQUIRE(fp.grad_slot_numel < cfg.vocab_size * cfg.hidden_size / 3);  // pieces do happen
      std::vector<float> weights;
      const auto stats = run(cfg, o, 4, &weights);
      CHECK(against_plain_loop(cfg, o, stats, weights) < 1e-6);  // every weight after 4 steps
    }
  }
}

TEST_CASE("wherever gradients wait and wherever AdamW runs, the update is the plain loop's (bit for bit alike in exact mode)") {
  // GradientHome device / host, and device units none, the embedding and a block, or all (the
  // embedding, 3 blocks and the head): the update is the same formula on the same gradients.
  // The vocabulary is large enough that the embedding and an untied head land in pieces.
  struct Mode {
    const char* name;
    double clip;
    ClipMode mode;
    std::int64_t micro;
  };
  for (const bool tied : {true, false}) {
    for (const Mode& k : {Mode{"no clipping", 0.0, ClipMode::exact, 1}, Mode{"exact clipping", 0.05, ClipMode::exact, 1},
                          Mode{"stale clipping", 0.05, ClipMode::stale, 1}, Mode{"exact, 2 micro-batches", 0.05, ClipMode::exact, 2}}) {
      CAPTURE(tied);
      CAPTURE(std::string(k.name));
      const auto cfg = tiny(tied, 1111);
      DecoderModel<> model(cfg);
      std::vector<std::vector<float>> all_weights;
      std::vector<std::vector<StepStats>> all_stats;
      for (const GradientHome home : {GradientHome::device, GradientHome::host}) {
        for (const std::int64_t units : {std::int64_t{0}, std::int64_t{2}, static_cast<std::int64_t>(model.num_units())}) {
          CAPTURE(home == GradientHome::device ? "gradients on the device" : "gradients in host memory");
          CAPTURE(units);
          auto o = options(8, 64);
          o.clip_norm = k.clip;
          o.clip_mode = k.mode;
          o.micro_batches = k.micro;
          o.gradient_home = home;
          o.device_units = units;
          o.jitter_us = 50;
          std::vector<float> weights;
          const auto stats = run(cfg, o, 4, &weights);
          // Every weight after 4 steps. Micro-batches add the gradient up in another order than
          // the whole batch; AdamW divides by sqrt(v), so a rounding difference in a gradient
          // element near zero moves that weight by up to a step size (lr 3e-3) of a few steps.
          CHECK(against_plain_loop(cfg, o, stats, weights) < (k.micro > 1 ? 2e-3 : 1e-6));
          all_weights.push_back(std::move(weights));
          all_stats.push_back(stats);
        }
      }
      // One gradient, one formula: placements change no bit where nothing is summed in another
      // order (exact clipping sums each unit on the device wherever it waits; without clipping
      // the norm only reports). Stale clipping's norm sums device units apart, and micro-batches
      // added up in host memory come in another order than in device accumulators: rounding
      // apart there (the first three runs keep gradients on the device).
      if (k.mode == ClipMode::exact) {
        for (std::size_t r = 1; r < (k.micro > 1 ? 3 : all_weights.size()); ++r) {
          CAPTURE(r);
          CHECK(all_weights[r] == all_weights[0]);
          for (std::size_t s = 0; s < all_stats[0].size(); ++s) {
            CHECK(all_stats[r][s].loss == all_stats[0][s].loss);
            if (k.clip > 0) CHECK(all_stats[r][s].grad_norm == all_stats[0][s].grad_norm);
          }
        }
      }
    }
  }
}

TEST_CASE("device units: the store is stale until finish_update(), which hands it back; edits to it then count") {
  const auto cfg = tiny(false);
  for (const std::int64_t units : {std::int64_t{0}, std::int64_t{3}}) {
    CAPTURE(units);
    std::vector<float> final_weights;
    std::vector<double> losses;
    for (int run_no = 0; run_no < 2; ++run_no) {  // twice: the same bits
      auto o = options(2, 9);
      o.device_units = units;
      DecoderModel<> model(cfg);
      HostParamStore<float> store(model.units(), store_opts(o));
      CpuBackend<float> be;
      Trainer<CpuBackend<float>> trainer(model, store, be, o);
      REQUIRE(trainer.device_units() == static_cast<std::size_t>(units));
      std::mt19937 rng(2);
      auto b = random_batch(rng, 2, 9, 53);
      // Loaded at the first step, not at construction: an edit made before it counts.
      for (auto& x : store.unit(1).master()) x *= 0.5f;
      store.sync_compute(store.unit(1));
      losses.push_back(trainer.step(b.ids, b.labels).loss);
      if (units > 0) CHECK_THROWS_WITH_AS(store.check_settled("exporting"), doctest::Contains("call trainer.finish_update() first"), Error);
      trainer.finish_update();
      store.check_settled("exporting");
      // An evaluation takes the device units back from the store: the store is not to be edited
      // (a loader refuses) until finish_update() hands it over again.
      (void)trainer.evaluate(b.ids, b.labels, 2);
      if (units > 0) CHECK_THROWS_WITH_AS(store.check_settled("loading"), doctest::Contains("call trainer.finish_update() first"), Error);
      trainer.finish_update();
      store.check_settled("loading");
      // The store holds the device units' state after the step: edit it; the next step uses the edit.
      for (auto& x : store.unit(2).master()) x = -x;
      for (auto& x : store.unit(2).adam_m()) x *= 2.0f;
      store.sync_compute(store.unit(2));
      b = random_batch(rng, 2, 9, 53);
      losses.push_back(trainer.step(b.ids, b.labels).loss);
      trainer.finish_update();
      std::vector<float> w;
      for (const auto& u : store.units())
        for (auto sl : {u.master(), u.adam_m(), u.adam_v()}) w.insert(w.end(), sl.begin(), sl.end());
      if (run_no == 0) final_weights = w;
      else CHECK(w == final_weights);
    }
    static std::vector<double> losses_without;
    static std::vector<float> weights_without;
    if (units == 0) {
      losses_without = losses;
      weights_without = final_weights;
    } else {  // the same as without device units, bit for bit
      CHECK(losses == losses_without);
      CHECK(final_weights == weights_without);
    }
  }
}

namespace {
// Adds up the landed pieces of every unit's gradient where they belong (placement).
struct PlacedGrads : GradientReaderStage {
  struct Shared {
    std::mutex m;
    std::map<std::size_t, std::vector<double>> grad;
    std::map<std::size_t, std::vector<int>> hits;
  };
  static inline std::shared_ptr<Shared> shared = std::make_shared<Shared>();
  static inline std::vector<std::int64_t> numel;
  using GradientReaderStage::GradientReaderStage;
  void run(const TrainItem& it, const StageSlots& s) {
    const auto g = view.gradient(it, s);
    const GradientPiece p = view.placement(it);
    REQUIRE(p.rows.empty());
    std::lock_guard lock(shared->m);
    auto& acc = shared->grad[it.unit];
    auto& hits = shared->hits[it.unit];
    acc.resize(static_cast<std::size_t>(numel[it.unit]));
    hits.resize(acc.size());
    for (std::size_t i = 0; i < g.size(); ++i) {
      acc[p.offset + i] += g[i];
      ++hits[p.offset + i];
    }
  }
};
}  // namespace

TEST_CASE("with gradients waiting on the device a user stage sees each unit's whole gradient in the AdamW pass") {
  // Vocabulary 1111: the embedding's and the head's gradients come in several pieces.
  const auto cfg = tiny(false, 1111);
  auto o = options(4, 16);
  o.clip_norm = 0.05;
  o.micro_batches = 2;
  o.jitter_us = 100;
  DecoderModel<> model(cfg);
  HostParamStore<float> store(model.units(), store_opts(o));
  PlacedGrads::shared = std::make_shared<PlacedGrads::Shared>();
  PlacedGrads::numel.clear();
  for (const auto& u : store.units()) PlacedGrads::numel.push_back(u.numel());
  CpuBackend<float> be;
  Trainer<CpuBackend<float>, DecoderBlock, PlacedGrads> trainer(model, store, be, o);
  std::mt19937 rng(6);
  auto b = random_batch(rng, 4, 16, 1111);
  const StepStats st = trainer.step(b.ids, b.labels);
  trainer.finish_update();
  double sumsq = 0;
  for (std::size_t u = 0; u < store.num_units(); ++u) {
    CAPTURE(u);
    const auto& hits = PlacedGrads::shared->hits.at(u);
    CHECK(std::all_of(hits.begin(), hits.end(), [](int h) { return h == 1; }));  // every element once
    for (double x : PlacedGrads::shared->grad.at(u)) sumsq += x * x;
  }
  // The micro-batches' sum, before clipping: its norm is the step's.
  CHECK(std::sqrt(sumsq) == doctest::Approx(st.grad_norm).epsilon(1e-12));
  CHECK(st.clip_coef < 1.0);
}

TEST_CASE("stages that sleep for random times change nothing (bit-identical), in every mode") {
  struct Case {
    const char* name;
    std::int64_t micro;
    double clip;
    ClipMode mode;
    GradientHome home = GradientHome::device;
  };
  for (const Case& k : {Case{"streamed, pieces, stale clipping", 1, 0.05, ClipMode::stale},
                        Case{"streamed, pieces, no clipping", 1, 0.0, ClipMode::stale},
                        Case{"exact clipping (resident, norms on the backend)", 1, 0.05, ClipMode::exact},
                        Case{"exact clipping, gradients in host memory", 1, 0.05, ClipMode::exact, GradientHome::host},
                        Case{"2 micro-batches (added up on the device)", 2, 0.0, ClipMode::exact},
                        Case{"2 micro-batches, exact clipping", 2, 0.05, ClipMode::exact},
                        Case{"2 micro-batches in host memory (staged, added up by the optimizer stage)", 2, 0.0,
                             ClipMode::exact, GradientHome::host},
                        Case{"4 micro-batches in host memory, exact clipping", 4, 0.05, ClipMode::exact,
                             GradientHome::host}}) {
    for (const bool tied : {true, false}) {
      CAPTURE(std::string(k.name));
      CAPTURE(tied);
      auto o = options(4, 7);
      o.chunk_rows = 1;
      o.micro_batches = k.micro;
      o.clip_norm = k.clip;
      o.clip_mode = k.mode;
      o.gradient_home = k.home;
      std::vector<float> w0, w1;
      const auto a = run(tiny(tied, 700), o, 3, &w0);  // a vocabulary that lands in pieces (streamed)
      o.jitter_us = 400;
      const auto b = run(tiny(tied, 700), o, 3, &w1);
      for (std::size_t s = 0; s < a.size(); ++s) {
        CHECK(a[s].loss == b[s].loss);
        CHECK(a[s].grad_norm == b[s].grad_norm);
        CHECK(a[s].clip_coef == b[s].clip_coef);
      }
      CHECK(w0 == w1);
    }
  }
  // Micro-batches chosen by max_micro_rows, and evaluation, under the same delays.
  auto o = options(4, 7);
  o.max_micro_rows = 2;
  std::vector<float> w0, w1;
  const auto a = run(tiny(false, 700), o, 3, &w0);
  o.jitter_us = 400;
  const auto b = run(tiny(false, 700), o, 3, &w1);
  for (std::size_t s = 0; s < a.size(); ++s) CHECK(a[s].loss == b[s].loss);
  CHECK(w0 == w1);
  double eval[2];
  for (int j = 0; j < 2; ++j) {
    auto e = options(2, 7);
    e.jitter_us = j * 400;
    const auto cfg = tiny(true, 700);
    DecoderModel<> model(cfg);
    HostParamStore<float> store(model.units(), store_opts(e));
    CpuBackend<float> be;
    Trainer<CpuBackend<float>> trainer(model, store, be, e);
    std::mt19937 rng(9);
    auto batch = random_batch(rng, 6, 7, 700);
    eval[j] = trainer.evaluate(batch.ids, batch.labels, 6);
  }
  CHECK(eval[0] == eval[1]);
}

TEST_CASE("the AdamW pass of step t, run ahead of step t+1's forward, changes no bit") {
  // Resident gradients: exact clipping, micro-batches, both. overlap_update true (the default)
  // against false (the update applied before step() returns), with random delays in every stage.
  struct Case {
    const char* name;
    std::int64_t micro;
    double clip;
  };
  for (const Case& k : {Case{"exact clipping", 1, 0.05}, Case{"2 micro-batches", 2, 0.0},
                        Case{"2 micro-batches, exact clipping", 2, 0.05}}) {
    for (const bool tied : {true, false}) {
      CAPTURE(std::string(k.name));
      CAPTURE(tied);
      const auto cfg = tiny(tied, 700);
      std::vector<std::vector<float>> weights;
      std::vector<std::vector<double>> seen;  // losses, norms, and evaluations between steps
      for (const bool overlap : {false, true}) {
        auto o = options(4, 7);
        o.chunk_rows = 2;
        o.micro_batches = k.micro;
        o.clip_norm = k.clip;
        o.clip_mode = ClipMode::exact;
        o.overlap_update = overlap;
        o.jitter_us = overlap ? 300 : 0;
        DecoderModel<> model(cfg);
        HostParamStore<float> store(model.units(), store_opts(o));
        CpuBackend<float> be;
        Trainer<CpuBackend<float>> trainer(model, store, be, o);
        std::mt19937 rng(5);
        std::vector<double> out;
        for (int s = 0; s < 4; ++s) {
          auto b = random_batch(rng, 4, 7, 700);
          const auto st = trainer.step(b.ids, b.labels);
          out.insert(out.end(), {st.loss, st.grad_norm, st.clip_coef});
          CHECK(trainer.update_pending() == overlap);
          CHECK(store.update_in_flight() == overlap);
          if (overlap && s == 1) {  // the store's readers refuse until the update is applied
            CHECK_THROWS_WITH_AS(store.check_settled("exporting"), doctest::Contains("call trainer.finish_update() first"),
                                 Error);
          }
          if (s == 2) out.push_back(trainer.evaluate(b.ids, b.labels, 4));  // sees the updated weights
          if (s == 2) CHECK_FALSE(trainer.update_pending());
        }
        trainer.finish_update();
        CHECK_FALSE(trainer.update_pending());
        CHECK_FALSE(store.update_in_flight());
        std::vector<float> w;
        for (const auto& u : store.units())
          for (auto x : {u.master(), u.adam_m(), u.adam_v()}) w.insert(w.end(), x.begin(), x.end());
        weights.push_back(std::move(w));
        seen.push_back(std::move(out));
      }
      CHECK(seen[0] == seen[1]);
      CHECK(weights[0] == weights[1]);
    }
  }
}

TEST_CASE("two runs with the same seed give identical results") {
  for (const ClipMode mode : {ClipMode::stale, ClipMode::exact}) {
    auto o = options(2, 9);
    o.clip_norm = 0.1;
    o.clip_mode = mode;
    std::vector<float> w0, w1;
    const auto a = run(tiny(false), o, 3, &w0);
    const auto b = run(tiny(false), o, 3, &w1);
    for (std::size_t s = 0; s < a.size(); ++s) {  // every reported figure but the time
      CHECK(a[s].step == b[s].step);
      CHECK(a[s].loss == b[s].loss);
      CHECK(a[s].lr == b[s].lr);
      CHECK(a[s].grad_norm == b[s].grad_norm);
      CHECK(a[s].clip_coef == b[s].clip_coef);
      CHECK(a[s].tokens == b[s].tokens);
    }
    CHECK(w0 == w1);
  }
}

TEST_CASE("a batch larger than max_micro_rows runs as gradient accumulation") {
  auto o = options(6, 9);
  CHECK(o.resolved().micro_batches == 1);
  o.max_micro_rows = 4;  // 6 rows: 2 micro-batches of 3
  CHECK(o.resolved().micro_batches == 2);
  o.max_micro_rows = 2;  // 3 of 2
  CHECK(o.resolved().micro_batches == 3);
  o.max_micro_rows = 5;
  o.micro_batches = 3;  // already within the limit: kept
  CHECK(o.resolved().micro_batches == 3);
  auto prime = options(7, 9);
  prime.max_micro_rows = 3;  // 7 has no divisor in between: sequence by sequence
  CHECK(prime.resolved().micro_batches == 7);

  // The trainer runs the resolved split: the same results as asking for it by hand.
  auto automatic = options(4, 9);
  automatic.max_micro_rows = 2;
  auto manual = options(4, 9);
  manual.micro_batches = 2;
  // The micro-batches add up in device accumulators (the store keeps none), or in host memory.
  CHECK(!Trainer<CpuBackend<float>>::store_options(automatic).resident_gradients);
  auto on_host = automatic;
  on_host.gradient_home = GradientHome::host;
  CHECK(Trainer<CpuBackend<float>>::store_options(on_host).resident_gradients);
  std::vector<float> wa, wm;
  const auto a = run(tiny(true), automatic, 3, &wa);
  const auto m = run(tiny(true), manual, 3, &wm);
  for (std::size_t s = 0; s < a.size(); ++s) CHECK(a[s].loss == m[s].loss);
  CHECK(wa == wm);
  // ... and it differs from the unsplit batch only by rounding (the sums are split).
  const auto whole = run(tiny(true), options(4, 9), 3);
  for (std::size_t s = 0; s < a.size(); ++s) CHECK(a[s].loss == doctest::Approx(whole[s].loss).epsilon(1e-5));
}

TEST_CASE("stale clipping uses the previous step's norm (none at step 1)") {
  auto o = options(2, 9);
  o.clip_norm = 0.05;
  o.clip_mode = ClipMode::stale;
  const auto s = run(tiny(true), o, 3);
  CHECK(s[0].clip_coef == 1.0);
  CHECK(s[1].clip_coef == doctest::Approx(clip_coefficient(s[0].grad_norm, 0.05)));
  CHECK(s[2].clip_coef == doctest::Approx(clip_coefficient(s[1].grad_norm, 0.05)));
}

namespace {
// A user-defined stage: records every unit's landed gradient norm, between offload and the optimizer.
struct GradStats {
  struct Shared {
    std::mutex m;
    std::map<std::pair<std::int64_t, std::string>, double> norms;  // (step, unit) -> sum of squares
  };
  static inline std::shared_ptr<Shared> shared = std::make_shared<Shared>();
  GradientView view;
  HostExecutor exec;
  explicit GradStats(GradientView v) : view(std::move(v)) {}
  HostExecutor& executor() { return exec; }
  bool applies(const TrainItem& it) const { return it.carries_gradient(); }
  std::size_t ring_slots() const { return 0; }
  UnitAccess unit_access() const { return UnitAccess::none; }
  void run(const TrainItem& it, const StageSlots& s) {  // a unit's gradient may come in pieces: sum them
    const double sumsq = grad_sum_squares<float>(view.gradient(it, s));
    std::lock_guard lock(shared->m);
    shared->norms[{view.step(), view.unit_name(it.unit)}] += sumsq;
  }
};
}  // namespace

TEST_CASE("a user stage sees each unit's landed gradient") {
  const auto cfg = tiny(true);
  auto o = options(2, 9);
  DecoderModel<> model(cfg);
  HostParamStore<float> store(model.units(), store_opts(o));
  CpuBackend<float> be;
  Trainer<CpuBackend<float>, DecoderBlock, GradStats> trainer(model, store, be, o);
  std::mt19937 rng(3);
  double total = 0;
  for (int s = 0; s < 2; ++s) {
    auto b = random_batch(rng, 2, 9, 53);
    const auto st = trainer.step(b.ids, b.labels);
    double sumsq = 0;
    for (const auto& u : store.units()) {
      sumsq += GradStats::shared->norms.at({st.step, u.name()});
    }
    CHECK(std::sqrt(sumsq) == doctest::Approx(st.grad_norm).epsilon(1e-9));
    total += sumsq;
  }
  CHECK(GradStats::shared->norms.size() == 2 * store.num_units());
  CHECK(total > 0);
}

TEST_CASE("bad batches and options are refused before anything changes") {
  const auto cfg = tiny(true);
  auto o = options(2, 9);
  DecoderModel<> model(cfg);
  HostParamStore<float> store(model.units(), store_opts(o));
  std::vector<float> before(store.unit(1).master().begin(), store.unit(1).master().end());
  CpuBackend<float> be;
  Trainer<CpuBackend<float>> trainer(model, store, be, o);
  std::vector<std::int32_t> ids(18, 1), labels(18, 2);
  ids[5] = 53;
  CHECK_THROWS_WITH_AS(trainer.step(ids, labels), doctest::Contains("outside the vocabulary"), Error);
  ids[5] = 1;
  labels.assign(18, kIgnoreIndex);
  CHECK_THROWS_WITH_AS(trainer.step(ids, labels), doctest::Contains("no token with a label"), Error);
  CHECK_THROWS_AS(trainer.step(std::span<const std::int32_t>(ids).first(17), std::span<const std::int32_t>(labels).first(17)), Error);
  CHECK(std::equal(before.begin(), before.end(), store.unit(1).master().begin()));
  CHECK(trainer.steps_done() == 0);

  auto bad = o;
  bad.micro_batches = 3;
  CHECK_THROWS_WITH_AS((Trainer<CpuBackend<float>>(model, store, be, bad)), doctest::Contains("do not divide"), Error);
  bad = o;
  bad.clip_norm = 1.0;  // exact clipping with gradients in host memory needs resident ones; this store has a ring
  bad.gradient_home = GradientHome::host;
  CHECK_THROWS_WITH_AS((Trainer<CpuBackend<float>>(model, store, be, bad)), doctest::Contains("resident gradients"), Error);
  bad = o;
  bad.weight_slots = 1;
  CHECK_THROWS_AS((Trainer<CpuBackend<float>>(model, store, be, bad)), Error);
  bad = o;
  bad.grad_slots = 1;  // a ring needs two slots
  CHECK_THROWS_WITH_AS((Trainer<CpuBackend<float>>(model, store, be, bad)), doctest::Contains("grad_slots must be >= 2"), Error);
  bad = o;
  bad.max_micro_rows = -1;
  CHECK_THROWS_WITH_AS((Trainer<CpuBackend<float>>(model, store, be, bad)), doctest::Contains("max_micro_rows"), Error);
}

namespace {
struct RingStage {  // a user stage that (wrongly) asks for a ring of its own
  GradientView view;
  HostExecutor exec;
  explicit RingStage(GradientView v) : view(std::move(v)) {}
  HostExecutor& executor() { return exec; }
  bool applies(const TrainItem& it) const { return it.carries_gradient(); }
  std::size_t ring_slots() const { return 2; }
  UnitAccess unit_access() const { return UnitAccess::none; }
  void run(const TrainItem&, const StageSlots&) {}
};
}  // namespace

TEST_CASE("a user stage that writes a ring is refused") {
  const auto cfg = tiny(true);
  auto o = options(2, 9);
  DecoderModel<> model(cfg);
  HostParamStore<float> store(model.units(), store_opts(o));
  CpuBackend<float> be;
  CHECK_THROWS_WITH_AS((Trainer<CpuBackend<float>, DecoderBlock, RingStage>(model, store, be, o)),
                       doctest::Contains("may write no ring"), Error);
}

TEST_CASE("evaluate gives the head's mean loss and leaves the weights alone") {
  const auto cfg = tiny(false);
  auto o = options(2, 9);
  DecoderModel<> model(cfg);
  HostParamStore<float> store(model.units(), store_opts(o));
  CpuBackend<float> be;
  Trainer<CpuBackend<float>> trainer(model, store, be, o);
  std::mt19937 rng(8);
  auto b = random_batch(rng, 4, 9, 53);
  std::vector<float> before(store.unit(2).master().begin(), store.unit(2).master().end());
  const double l = trainer.evaluate(b.ids, b.labels, 4);
  CHECK(std::equal(before.begin(), before.end(), store.unit(2).master().begin()));
  CHECK(l == doctest::Approx(std::log(53.0)).epsilon(0.1));
  // The same batch as a training step reports the same loss (computed before the update).
  auto first = b;
  first.ids.resize(18);
  first.labels.resize(18);
  const double l2 = trainer.evaluate(first.ids, first.labels, 2);
  CHECK(trainer.step(first.ids, first.labels).loss == doctest::Approx(l2).epsilon(1e-6));
}

namespace {
// Keeps every micro-batch's landed gradient of every unit, to add them up in the test.
struct MicroGrads : GradientReaderStage {
  struct Shared {
    std::mutex m;
    std::map<std::size_t, std::vector<double>> sum;  // unit -> sum over the step's micro-batches
    std::map<std::size_t, int> pieces;
  };
  static inline std::shared_ptr<Shared> shared = std::make_shared<Shared>();
  using GradientReaderStage::GradientReaderStage;
  void run(const TrainItem& it, const StageSlots& s) {
    const auto g = view.gradient(it, s);
    std::lock_guard lock(shared->m);
    auto& acc = shared->sum[it.unit];
    acc.resize(g.size());
    for (std::size_t i = 0; i < g.size(); ++i) acc[i] += g[i];
    ++shared->pieces[it.unit];
  }
};
}  // namespace

TEST_CASE("with micro-batches added up in host memory a user stage sees each micro-batch's own gradient") {
  for (const std::int64_t micro : {2, 3}) {
    CAPTURE(micro);
    MicroGrads::shared = std::make_shared<MicroGrads::Shared>();
    const auto cfg = tiny(false);
    auto o = options(6, 9);
    o.micro_batches = micro;
    o.gradient_home = GradientHome::host;
    o.jitter_us = 200;
    DecoderModel<> model(cfg);
    HostParamStore<float> store(model.units(), store_opts(o));
    CpuBackend<float> be;
    Trainer<CpuBackend<float>, DecoderBlock, MicroGrads> trainer(model, store, be, o);
    std::mt19937 rng(4);
    auto b = random_batch(rng, 6, 9, 53);
    trainer.step(b.ids, b.labels);
    // The store's resident gradient is the sum of the micro-batches' gradients.
    for (std::size_t u = 0; u < store.num_units(); ++u) {
      CAPTURE(u);
      CHECK(MicroGrads::shared->pieces.at(u) == micro);
      const auto g = store.unit(u).grad();
      const auto& sum = MicroGrads::shared->sum.at(u);
      REQUIRE(sum.size() == g.size());
      double worst = 0, scale = 0;
      for (std::size_t i = 0; i < g.size(); ++i) {
        worst = std::max(worst, std::fabs(sum[i] - g[i]));
        scale = std::max(scale, std::fabs(sum[i]));
      }
      CHECK(scale > 0);
      CHECK(worst <= 1e-5 * scale);
    }
  }
}

namespace {
// A decoder block that counts its backward passes (to see what the compute stage has done).
std::atomic<int> g_backwards{0};
struct CountingBlock : DecoderBlock {
  using DecoderBlock::DecoderBlock;
  template <class B>
  void backward(B& be, ChunkShape c, const Weights<const typename B::Weight>& w, View<const typename B::Act> x,
                View<const typename B::Act> dy, View<typename B::Act> dx, const Weights<typename B::Acc>& g,
                Arena& scratch) const {
    DecoderBlock::backward(be, c, w, x, dy, dx, g, scratch);
    ++g_backwards;
  }
};
// Holds up the head's gradient (the first to land) for a while, then notes how many blocks the
// compute stage has backpropagated meanwhile; the optimizer steps the head right after.
struct SlowHeadStage {
  static inline std::atomic<int> seen_at_head{-1};
  GradientView view;
  HostExecutor exec;
  explicit SlowHeadStage(GradientView v) : view(std::move(v)) {}
  HostExecutor& executor() { return exec; }
  bool applies(const TrainItem& it) const { return it.kind == TrainItem::Kind::head; }
  std::size_t ring_slots() const { return 0; }
  UnitAccess unit_access() const { return UnitAccess::none; }
  void run(const TrainItem&, const StageSlots&) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    seen_at_head = g_backwards.load();
  }
};
}  // namespace

TEST_CASE("the backward of the blocks goes on while the head's gradient is offloaded and stepped") {
  // Stale clipping: each unit is stepped as its gradient lands. While the head's gradient sits
  // in the stages after the offload, the compute stage backpropagates the blocks (as far as its
  // two gradient accumulators and the two landing slots allow): the pipeline overlaps them.
  auto cfg_json = nlohmann::json::parse(R"({"architectures":["LlamaForCausalLM"],"hidden_size":32,"intermediate_size":64,
    "num_hidden_layers":6,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":53,"tie_word_embeddings":true})");
  const auto cfg = ModelConfig::from_json(cfg_json);
  auto o = options(2, 9);
  o.clip_norm = 1.0;
  o.clip_mode = ClipMode::stale;
  DecoderModel<CountingBlock> model(cfg);
  HostParamStore<float> store(model.units(), store_opts(o));
  CpuBackend<float> be;
  Trainer<CpuBackend<float>, CountingBlock, SlowHeadStage> trainer(model, store, be, o);
  std::mt19937 rng(2);
  auto b = random_batch(rng, 2, 9, 53);
  g_backwards = 0;
  trainer.step(b.ids, b.labels);
  CHECK(g_backwards.load() == 6);
  MESSAGE("blocks backpropagated while the head's gradient was held: " << SlowHeadStage::seen_at_head.load());
  CHECK(SlowHeadStage::seen_at_head.load() >= 2);  // a serial schedule would show 0
}

TEST_CASE("a step's loss is the mean over its labelled tokens (PyTorch's cross_entropy with ignore_index=-100), however it is split") {
  // Prompt-masked fine-tuning: most labels ignored, and unevenly so: the first two rows carry
  // 1 labelled token, the last two 15. PyTorch's F.cross_entropy(logits, labels,
  // ignore_index=-100) takes the mean over the labelled tokens of the whole batch; a mean of
  // per-micro-batch means would weigh that one token as much as the other 15.
  const auto cfg = tiny(false);
  const std::int64_t rows = 4, seq = 9;
  std::mt19937 rng(21);
  auto b = random_batch(rng, rows, seq, 53);
  std::fill(b.labels.begin(), b.labels.end(), kIgnoreIndex);
  b.labels[4] = 7;  // row 0: one label
  for (std::int64_t t = 2 * seq; t < rows * seq; ++t)
    if (t % seq != 0) b.labels[static_cast<std::size_t>(t)] = static_cast<std::int32_t>(rng() % 53);  // rows 2-3: 16
  const auto count = std::count_if(b.labels.begin(), b.labels.end(), [](std::int32_t l) { return l != kIgnoreIndex; });
  REQUIRE(count == 17);

  struct Result {
    double loss, grad_norm, mean_of_halves;
  };
  const auto step = [&](std::int64_t micro) {
    auto o = options(rows, seq);
    o.micro_batches = micro;
    DecoderModel<> model(cfg);
    HostParamStore<float> store(model.units(), store_opts(o));
    CpuBackend<float> be;
    Trainer<CpuBackend<float>> trainer(model, store, be, o);
    // the per-row means, from the weights before the step: the mean over all labelled tokens is
    // their average weighted by each row's labels
    const auto mean_of_rows = [&](std::int64_t first, std::int64_t last, std::int64_t* n_out) {
      std::vector<std::int32_t> only(b.labels.size(), kIgnoreIndex);  // those rows' labels alone
      for (std::int64_t t = first * seq; t < last * seq; ++t) only[static_cast<std::size_t>(t)] = b.labels[static_cast<std::size_t>(t)];
      *n_out = std::count_if(only.begin(), only.end(), [](std::int32_t l) { return l != kIgnoreIndex; });
      return *n_out > 0 ? trainer.evaluate(b.ids, only, rows) : 0.0;
    };
    double weighted = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      std::int64_t n = 0;
      weighted += mean_of_rows(r, r + 1, &n) * static_cast<double>(n);
    }
    std::int64_t n0 = 0, n1 = 0;
    const double halves = (mean_of_rows(0, 2, &n0) + mean_of_rows(2, 4, &n1)) / 2;
    const StepStats st = trainer.step(b.ids, b.labels);
    CHECK(st.loss == doctest::Approx(weighted / static_cast<double>(count)).epsilon(1e-6));
    trainer.finish_update();
    return Result{st.loss, st.grad_norm, halves};
  };
  const Result whole = step(1);
  for (const std::int64_t micro : {2, 4}) {
    CAPTURE(micro);
    const Result split = step(micro);
    CHECK(split.loss == doctest::Approx(whole.loss).epsilon(1e-6));
    // the gradient too: its norm (the sum over micro-batches, each scaled by 1 / 17)
    CHECK(split.grad_norm == doctest::Approx(whole.grad_norm).epsilon(1e-5));
  }
  // (the case tells the two apart: the mean of the two halves' means is another number)
  CHECK(std::fabs(whole.mean_of_halves - whole.loss) > 0.005 * whole.loss);
}

TEST_CASE("packed rows train exactly as the same examples one to a row (positions restart, attention within each)") {
  // Examples of awkward random lengths, each with its own labels: one per row (padded), or
  // packed several to a row with positions restarting at 0 and a padding sequence in the free
  // tail. Attention within each example and rotary positions from 0 make every example's
  // logits the same either way, so the step's loss, gradient norm and update are the same.
  const auto cfg = tiny(true);
  const std::int64_t seq = 13;
  std::mt19937 rng(31);
  struct Example {
    std::vector<std::int32_t> ids, labels;
  };
  std::vector<Example> ex;
  for (int e = 0; e < 9; ++e) {
    Example x;
    const auto n = 1 + static_cast<std::int64_t>(rng() % 7);  // 1..7 tokens of a row
    for (std::int64_t t = 0; t < n; ++t) {
      x.ids.push_back(static_cast<std::int32_t>(rng() % 53));
      x.labels.push_back(rng() % 3 == 0 ? kIgnoreIndex : static_cast<std::int32_t>(rng() % 53));
    }
    x.labels.back() = static_cast<std::int32_t>(rng() % 53);  // at least one label each
    ex.push_back(std::move(x));
  }
  // one to a row
  Batch one;
  for (const auto& x : ex)
    for (std::int64_t t = 0; t < seq; ++t) {
      const bool in = t < static_cast<std::int64_t>(x.ids.size());
      one.ids.push_back(in ? x.ids[static_cast<std::size_t>(t)] : 0);
      one.labels.push_back(in ? x.labels[static_cast<std::size_t>(t)] : kIgnoreIndex);
    }
  // packed in order, a new row when the next does not fit; the tail is padding
  Batch packed;
  std::vector<std::int32_t> positions;
  std::int64_t col = 0;
  auto pad_row = [&] {
    for (std::int32_t p = 0; col < seq; ++col, ++p) {
      packed.ids.push_back(static_cast<std::int32_t>(rng() % 53));  // (any id: its labels are ignored)
      packed.labels.push_back(kIgnoreIndex);
      positions.push_back(p);
    }
    col = 0;
  };
  for (const auto& x : ex) {
    if (col + static_cast<std::int64_t>(x.ids.size()) > seq) pad_row();
    for (std::size_t t = 0; t < x.ids.size(); ++t, ++col) {
      packed.ids.push_back(x.ids[t]);
      packed.labels.push_back(x.labels[t]);
      positions.push_back(static_cast<std::int32_t>(t));
    }
  }
  pad_row();
  const auto rows_one = static_cast<std::int64_t>(ex.size()), rows_packed = static_cast<std::int64_t>(packed.ids.size()) / seq;
  REQUIRE(rows_packed < rows_one - 2);

  const auto train = [&](const Batch& b, std::int64_t rows, const std::vector<std::int32_t>& pos, std::int64_t micro,
                         std::int64_t chunk, std::vector<float>* weights) {
    auto o = options(rows, seq);
    o.packed = !pos.empty();
    o.micro_batches = micro;
    o.chunk_rows = chunk;
    o.clip_norm = 0.5;
    o.adamw.eps = 1e-4;  // (so that Adam does not blow float noise in near-zero gradients up to +-lr)
    DecoderModel<> model(cfg);
    HostParamStore<float> store(model.units(), store_opts(o));
    CpuBackend<float> be;
    Trainer<CpuBackend<float>> trainer(model, store, be, o);
    const double before = trainer.evaluate(b.ids, b.labels, rows, pos);
    std::vector<StepStats> st;
    for (int s = 0; s < 2; ++s) st.push_back(trainer.step(b.ids, b.labels, pos));
    trainer.finish_update();
    for (const auto& u : store.units()) weights->insert(weights->end(), u.master().begin(), u.master().end());
    return std::pair{before, st};
  };
  std::vector<float> w_one;
  const auto [eval_one, st_one] = train(one, rows_one, {}, 1, 0, &w_one);
  for (const auto& [micro, chunk] : {std::pair<std::int64_t, std::int64_t>{1, 0}, {1, 1}, {rows_packed, 0}}) {
    CAPTURE(micro);
    CAPTURE(chunk);
    std::vector<float> w;
    const auto [eval, st] = train(packed, rows_packed, positions, micro, chunk, &w);
    CHECK(eval == doctest::Approx(eval_one).epsilon(1e-5));
    for (std::size_t s = 0; s < st.size(); ++s) {
      CHECK(st[s].loss == doctest::Approx(st_one[s].loss).epsilon(1e-5));
      CHECK(st[s].grad_norm == doctest::Approx(st_one[s].grad_norm).epsilon(1e-4));
    }
    double worst = 0;
    for (std::size_t i = 0; i < w.size(); ++i)
      worst = std::max(worst, std::fabs(static_cast<double>(w[i]) - w_one[i]) / (std::fabs(static_cast<double>(w_one[i])) + 1e-3));
    CHECK(worst < 1e-4);
  }
  // Without the positions (each packed row one sequence) the examples see each other: another loss.
  std::vector<float> w;
  const auto [eval_plain, st_plain] = train(packed, rows_packed, {}, 1, 0, &w);
  CHECK(std::fabs(eval_plain - eval_one) > 1e-3 * eval_one);
}

TEST_CASE("positions are checked before anything changes") {
  const auto cfg = tiny(false);
  auto o = options(2, 5);
  DecoderModel<> model(cfg);
  HostParamStore<float> store(model.units(), store_opts(o));
  CpuBackend<float> be;
  std::mt19937 rng(3);
  const auto b = random_batch(rng, 2, 5, 53);
  {
    Trainer<CpuBackend<float>> plain(model, store, be, o);
    CHECK_THROWS_WITH_AS(plain.step(b.ids, b.labels, std::vector<std::int32_t>(10, 0)),
                         doctest::Contains("not made for packed rows"), Error);
  }
  o.packed = true;
  Trainer<CpuBackend<float>> trainer(model, store, be, o);
  CHECK_THROWS_WITH_AS(trainer.step(b.ids, b.labels, std::vector<std::int32_t>{0, 1, 2, 0, 1, 1, 2, 3, 4, 5}),
                       doctest::Contains("position 1 at token 5 (row 1, column 0)"), Error);
  CHECK_THROWS_WITH_AS(trainer.step(b.ids, b.labels, std::vector<std::int32_t>{0, 1, 3, 0, 1, 0, 1, 2, 3, 4}),
                       doctest::Contains("position 3 at token 2"), Error);
  CHECK_THROWS_WITH_AS(trainer.step(b.ids, b.labels, std::vector<std::int32_t>{0, 1, 2}),
                       doctest::Contains("3 positions for 2 sequences x 5 tokens"), Error);
  CHECK(trainer.steps_done() == 0);
  const auto st = trainer.step(b.ids, b.labels, std::vector<std::int32_t>{0, 1, 2, 0, 1, 0, 0, 1, 2, 3});
  CHECK(std::isfinite(st.loss));
}

TEST_CASE("token blocks (TrainerOptions::token_chunk) change the step only by rounding") {
  const auto cfg = tiny(true);
  auto o = options(4, 11);
  o.chunk_rows = 3;
  const auto whole = run(cfg, o, 4);
  for (const std::int64_t block : {7, 16}) {
    CAPTURE(block);
    o.token_chunk = block;  // across rows of 11, and a last chunk of 1 row
    const auto blocked = run(cfg, o, 4);
    for (std::size_t s = 0; s < whole.size(); ++s) {
      CAPTURE(s);
      CHECK(blocked[s].loss == doctest::Approx(whole[s].loss).epsilon(1e-5));
      CHECK(blocked[s].grad_norm == doctest::Approx(whole[s].grad_norm).epsilon(1e-4));
    }
  }
  o.token_chunk = -1;
  CHECK_THROWS_WITH_AS(run(cfg, o, 1), doctest::Contains("token_chunk must be >= 0"), Error);
}

TEST_CASE("TrainerOptions::profile gives each step's compute timeline (every unit's items, in order)") {
  const auto cfg = tiny(true);
  for (const ClipMode mode : {ClipMode::stale, ClipMode::exact}) {
    CAPTURE(static_cast<int>(mode));
    auto o = options(2, 8);
    o.clip_mode = mode;
    o.profile = true;
    const auto st = run(cfg, o, 2);
    for (const auto& s : st) test::check_timeline(s, static_cast<std::size_t>(cfg.num_hidden_layers));
  }
}

TEST_CASE("a padding row (pad_token_id) gets no gradient from the lookup, the embedding streamed or on the device") {
  // The plain loop skips the padding row by its id; the trainer, where the embedding streams,
  // by its index among the batch's distinct rows. The padding id is one the batches use.
  std::mt19937 first(5);
  const std::int32_t pad = random_batch(first, 4, 11, 53).ids.at(0);
  for (const bool tied : {true, false}) {
    for (const std::int64_t units : {std::int64_t{0}, std::int64_t{5}}) {
      CAPTURE(tied);
      CAPTURE(units);
      auto cfg = tiny(tied);
      cfg.pad_token_id = pad;
      cfg.validate();
      auto o = options(4, 11);
      o.device_units = units;  // 0: everything streams (compact rows); 5: the embedding is a device unit
      std::vector<float> weights;
      const auto stats = run(cfg, o, 4, &weights);
      CHECK(against_plain_loop(cfg, o, stats, weights) <= 1e-5);
      // and an untied table's padding row gets no gradient at all: AdamW's decoupled decay alone
      // moves it (at most 4 steps x lr 3e-3 x 0.1 = 1.2e-3 of itself), where a trained row moves
      // by about lr a step
      if (!tied) {
        DecoderModel<> model(cfg);
        HostParamStore<float> fresh(model.units(), store_opts(o));
        const auto before = fresh.master(Embedding::kTable).span();
        const std::size_t d = static_cast<std::size_t>(cfg.hidden_size), row = static_cast<std::size_t>(pad) * d;
        double rel = 0;
        for (std::size_t c = 0; c < d; ++c)
          rel = std::max(rel, std::fabs(static_cast<double>(weights[row + c]) - before[row + c]) / std::fabs(before[row + c]));
        CHECK(rel <= 1.2e-3 + 1e-6);
      }
    }
  }
}

/// A family's model trained for `steps` steps with exact clipping: equal to the plain loop in one
/// chunk; in chunks of 3 rows, kept activations (each count of `kept`) give the same bits as
/// recomputing, and token blocks of 7 the same step up to rounding.
static void check_family_trains(const ModelConfig& cfg, int steps, std::initializer_list<std::int64_t> kept_counts,
                                const std::function<Batch(std::mt19937&)>& batch = {}) {
  auto o = options(4, 11);
  o.clip_norm = 0.05;
  o.clip_mode = ClipMode::exact;
  {  // one chunk: the plain loop's order of sums, so its weights (measured: bit for bit)
    std::vector<float> w;
    const auto stats = run(cfg, o, steps, &w, batch);
    CHECK(against_plain_loop(cfg, o, stats, w, batch) <= 1e-6);
  }
  o.chunk_rows = 3;  // (chunks add weight gradients in another order: rounding, which Adam magnifies on tiny ones)
  std::vector<float> w;
  const auto stats = run(cfg, o, steps, &w, batch);
  for (const std::int64_t kept : kept_counts) {
    CAPTURE(kept);
    auto k = o;
    k.kept_blocks = kept;
    std::vector<float> wk;
    const auto sk = run(cfg, k, steps, &wk, batch);
    CHECK(wk == w);
    for (std::size_t s = 0; s < stats.size(); ++s) CHECK(sk[s].loss == stats[s].loss);
  }
  auto b = o;
  b.token_chunk = 7;
  const auto blocked = run(cfg, b, steps, nullptr, batch);
  for (std::size_t s = 0; s < stats.size(); ++s) {
    CAPTURE(s);
    CHECK(blocked[s].loss == doctest::Approx(stats[s].loss).epsilon(1e-5));
    CHECK(blocked[s].grad_norm == doctest::Approx(stats[s].grad_norm).epsilon(1e-4));
    CHECK(blocked[s].aux_loss == doctest::Approx(stats[s].aux_loss).epsilon(1e-5));
  }
}

TEST_CASE("the hybrid families (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) train as the plain loop, kept activations and chunks alike") {
  // Three layers: linear attention, gated full attention, linear attention; the MoE families with a
  // shared expert on every sparse layer (Qwen3-Next's middle layer dense).
  const auto common = nlohmann::json::parse(R"({"hidden_size":24,"intermediate_size":40,"num_hidden_layers":3,
    "num_attention_heads":4,"num_key_value_heads":2,"head_dim":8,"vocab_size":53,"linear_num_key_heads":2,
    "linear_num_value_heads":4,"linear_key_head_dim":6,"linear_value_head_dim":5,
    "layer_types":["linear_attention","full_attention","linear_attention"],"num_experts":5,"num_experts_per_tok":2,
    "moe_intermediate_size":12,"shared_expert_intermediate_size":10})");
  for (const char* arch : {"Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM"}) {
    CAPTURE(arch);
    auto j = common;
    j["architectures"] = {arch};
    if (std::string_view(arch) == "Qwen3NextForCausalLM") j["mlp_only_layers"] = {1};
    const auto cfg = ModelConfig::from_json(j, "hybrid test");
    check_family_trains(cfg, 3, {1, 2});
  }
}

TEST_CASE("Gemma 3 (sandwich norms, sliding windows, GeGLU) trains as the plain loop, its kept activations the same bits") {
  // Three layers, the middle one full, the others sliding over 5 of the 11 tokens; tied; a
  // padding id. Kept activations (the post-norms' inputs kept too) must give the bits of
  // recomputing, and token blocks the same step up to rounding.
  auto j = nlohmann::json::parse(R"({"architectures":["Gemma3ForCausalLM"],"hidden_size":32,"intermediate_size":72,
    "num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"vocab_size":53,
    "query_pre_attn_scalar":12,"sliding_window":5,"pad_token_id":4,
    "layer_types":["sliding_attention","full_attention","sliding_attention"]})");
  const auto cfg = ModelConfig::from_json(j, "gemma3 test");
  check_family_trains(cfg, 5, {1, 3});
}

TEST_CASE("a router that sends every token to the same experts: the tokens per expert and the auxiliary loss, exactly") {
  // A zero router gives every expert the same logit: the top 2 are experts 0 and 1 (ties go to the
  // lower index) for every token, so each sparse layer's busiest expert gets all 44 tokens and the
  // idlest none; the probabilities are uniform, so the auxiliary loss is top_k = 2 whatever the
  // assignment (transformers' load_balancing_loss_func: E x sum of 1/E x the tokens' shares).
  const auto cfg = ModelConfig::from_json(nlohmann::json::parse(
      R"({"architectures":["Qwen3MoeForCausalLM"],"hidden_size":32,"intermediate_size":40,"moe_intermediate_size":24,
          "num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"vocab_size":53,
          "num_experts":5,"num_experts_per_tok":2,"norm_topk_prob":true,"mlp_only_layers":[1],
          "output_router_logits":true,"router_aux_loss_coef":0.3})"), "zero router");
  const TrainerOptions o = options(4, 11);
  DecoderModel<> model(cfg);
  HostParamStore<float> store(model.units(), store_opts(o));
  int zeroed = 0;
  for (auto& u : store.units()) {
    for (const auto& p : u.params())
      if (p.spec.name.ends_with("mlp.gate.weight")) {
        std::ranges::fill(store.master(p.spec.name).span(), 0.0f);
        ++zeroed;
      }
    store.sync_compute(u);
  }
  REQUIRE(zeroed == 2);
  CpuBackend<float> be;
  Trainer<CpuBackend<float>> trainer(model, store, be, o);
  std::mt19937 rng(5);
  const auto b = random_batch(rng, 4, 11, 53);
  const StepStats s = trainer.step(b.ids, b.labels, {}, b.mask);
  trainer.finish_update();
  REQUIRE(s.expert_load.size() == 2);
  for (const auto& l : s.expert_load) {
    CAPTURE(l.layer);
    CHECK(l.min == 0);
    CHECK(l.max == 44);
  }
  CHECK(s.expert_load[0].layer == 0);
  CHECK(s.expert_load[1].layer == 2);
  CHECK(s.aux_loss == doctest::Approx(2.0).epsilon(1e-6));
}

TEST_CASE("mixtures of experts (Qwen3-MoE, Mixtral, OLMoE) train as the plain loop, kept activations and chunks alike") {
  static_assert(MoeBackend<CpuBackend<float>>, "the CPU backend runs MoeMlp");
  const char* configs[] = {
      // Qwen3-MoE: a dense layer (mlp_only_layers) between two sparse ones, renormalised top 2 of 5
      R"({"architectures":["Qwen3MoeForCausalLM"],"hidden_size":32,"intermediate_size":40,"moe_intermediate_size":24,
          "num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"vocab_size":53,
          "num_experts":5,"num_experts_per_tok":2,"norm_topk_prob":true,"mlp_only_layers":[1]})",
      // Mixtral: top 2 of 3, always renormalised
      R"({"architectures":["MixtralForCausalLM"],"hidden_size":32,"intermediate_size":24,"num_hidden_layers":2,
          "num_attention_heads":4,"num_key_value_heads":2,"vocab_size":53,"num_local_experts":3,"num_experts_per_tok":2})",
      // OLMoE: top 3 of 7, not renormalised, whole-projection q/k norms, a padding id
      R"({"architectures":["OlmoeForCausalLM"],"hidden_size":32,"intermediate_size":24,"num_hidden_layers":2,
          "num_attention_heads":4,"num_key_value_heads":4,"vocab_size":53,"num_experts":7,"num_experts_per_tok":3,
          "pad_token_id":4})"};
  for (const char* text : configs) {
    const auto cfg = ModelConfig::from_json(nlohmann::json::parse(text), "moe test");
    CAPTURE(cfg.architecture_name());
    check_family_trains(cfg, 4, {1, 2});  // (the experts' activations are recomputed: the same bits)
  }
  // The auxiliary load-balancing loss (output_router_logits), trained as the plain loop trains it;
  // StepStats's routing statistics: the loss, and each sparse layer's fewest and most tokens per
  // expert (44 tokens x top 2 = 88 assignments over 5 experts).
  const auto aux = ModelConfig::from_json(nlohmann::json::parse(
      R"({"architectures":["Qwen3MoeForCausalLM"],"hidden_size":32,"intermediate_size":40,"moe_intermediate_size":24,
          "num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"vocab_size":53,
          "num_experts":5,"num_experts_per_tok":2,"norm_topk_prob":true,"mlp_only_layers":[1],
          "output_router_logits":true,"router_aux_loss_coef":0.3})"), "moe aux test");
  check_family_trains(aux, 4, {1, 2});
  for (const auto& s : run(aux, options(4, 11), 2)) {
    CHECK(std::isfinite(s.aux_loss));
    CHECK(s.aux_loss > 0);  // (k = 2 where the routing is perfectly balanced)
    REQUIRE(s.expert_load.size() == 2);
    CHECK(s.expert_load[0].layer == 0);
    CHECK(s.expert_load[1].layer == 2);
    for (const auto& l : s.expert_load) {
      CHECK(l.min <= l.max);
      CHECK(l.max <= 44);
      CHECK(l.min * 5 <= 88);
      CHECK(l.max * 5 >= 88);
    }
  }
  CHECK(run(ModelConfig::from_json(nlohmann::json::parse(configs[0]), "moe test"), options(4, 11), 1)[0].aux_loss > 0);

  // Micro-batches: the auxiliary loss per micro-batch (transformers' per forward), the step's their
  // mean. A batch of two identical halves in two micro-batches is then the step of one half alone:
  // the same losses and weights up to the rounding of sums taken in another order (which Adam
  // magnifies on tiny gradients).
  const auto doubled = [](std::mt19937& rng) {  // two rows, then the same two again
    auto b = random_batch(rng, 2, 11, 53);
    const auto ids = b.ids, labels = b.labels;
    b.ids.insert(b.ids.end(), ids.begin(), ids.end());
    b.labels.insert(b.labels.end(), labels.begin(), labels.end());
    return b;
  };
  auto twice = options(4, 11);
  twice.max_micro_rows = 2;
  std::vector<float> w_half, w_twice;
  const auto half_stats = run(aux, options(2, 11), 3, &w_half);
  const auto twice_stats = run(aux, twice, 3, &w_twice, doubled);
  REQUIRE(twice_stats.size() == half_stats.size());
  for (std::size_t s = 0; s < half_stats.size(); ++s) {
    CAPTURE(s);
    CHECK(twice_stats[s].aux_loss == doctest::Approx(half_stats[s].aux_loss).epsilon(1e-6));
    CHECK(twice_stats[s].loss == doctest::Approx(half_stats[s].loss).epsilon(1e-6));
    REQUIRE(twice_stats[s].expert_load.size() == half_stats[s].expert_load.size());
    for (std::size_t l = 0; l < half_stats[s].expert_load.size(); ++l) {  // (counted over both micro-batches)
      CHECK(twice_stats[s].expert_load[l].min == 2 * half_stats[s].expert_load[l].min);
      CHECK(twice_stats[s].expert_load[l].max == 2 * half_stats[s].expert_load[l].max);
    }
  }
  double worst = 0;
  for (std::size_t i = 0; i < w_half.size(); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(w_twice[i]) - w_half[i]) / std::max(1e-3, std::abs(static_cast<double>(w_half[i]))));
  CHECK(worst <= 1e-4);
}

TEST_CASE("an attention mask leaves padding out of the auxiliary loss, as the plain loop and transformers do") {
  // Rows padded at their end (labels -100 there), the mask 0 on the padding: the trainer's step is
  // the plain loop's given the same mask (which transformers' own fixture qwen3_moe_aux_mask
  // checks in test_model_families), and differs from the step that counts the padding.
  const auto aux = ModelConfig::from_json(nlohmann::json::parse(
      R"({"architectures":["Qwen3MoeForCausalLM"],"hidden_size":32,"intermediate_size":40,"moe_intermediate_size":24,
          "num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"vocab_size":53,
          "num_experts":5,"num_experts_per_tok":2,"norm_topk_prob":true,"mlp_only_layers":[1],
          "output_router_logits":true,"router_aux_loss_coef":0.3})"), "moe aux test");
  auto o = options(4, 11);
  o.clip_norm = 0.05;
  o.clip_mode = ClipMode::exact;
  const auto padded = [&](std::mt19937& rng) {
    auto b = random_batch(rng, o.batch_rows, o.seq_len, 53);
    b.mask.assign(b.ids.size(), 1);
    for (std::int64_t r = 0; r < o.batch_rows; ++r)  // (row r: (3 r) % 5 tokens of padding)
      for (std::int64_t c = o.seq_len - (3 * r) % 5; c < o.seq_len; ++c) {
        const auto i = static_cast<std::size_t>(r * o.seq_len + c);
        b.mask[i] = 0;
        b.labels[i] = kIgnoreIndex;
      }
    return b;
  };
  const auto ones_only = [&](std::mt19937& rng) {  // (the same batches, their mask all ones)
    auto b = padded(rng);
    std::fill(b.mask.begin(), b.mask.end(), std::uint8_t{1});
    return b;
  };
  const auto unmasked_batch = [&](std::mt19937& rng) {  // (... and none)
    auto b = padded(rng);
    b.mask.clear();
    return b;
  };
  std::vector<float> w_mask, w_none, w_ones;
  const auto masked = run(aux, o, 3, &w_mask, padded);
  const auto unmasked = run(aux, o, 3, &w_none, unmasked_batch);
  const auto ones = run(aux, o, 3, &w_ones, ones_only);
  CHECK(against_plain_loop(aux, o, masked, w_mask, padded) <= 1e-6);  // (the plain loop given the mask)
  for (std::size_t s = 0; s < masked.size(); ++s) {
    CAPTURE(s);
    CHECK(std::abs(masked[s].aux_loss - unmasked[s].aux_loss) > 1e-6);  // (the padding counted: another loss)
    CHECK(ones[s].aux_loss == unmasked[s].aux_loss);                   // (a mask of ones: no mask)
    for (const auto& l : masked[s].expert_load) CHECK(l.max <= 36);  // (36 tokens kept, each to 2 experts)
  }
  CHECK(w_ones == w_none);
  CHECK(w_mask != w_none);
  // ... in chunks of rows, token blocks and kept blocks (the mask's rows follow each): the plain
  // loop's in one chunk, kept = recomputed bits, token blocks to rounding
  check_family_trains(aux, 3, {1, 2}, padded);
  // ... and in micro-batches: a batch of two padded rows twice, in two micro-batches, is the step
  // of the two rows alone (the auxiliary loss per micro-batch, each counting its own tokens)
  const auto half = [&](std::mt19937& rng) {
    auto b = padded(rng);
    const auto n = static_cast<std::ptrdiff_t>(2 * o.seq_len);
    b.ids.resize(static_cast<std::size_t>(n));
    b.labels.resize(static_cast<std::size_t>(n));
    b.mask.resize(static_cast<std::size_t>(n));  // (rows 0 and 1: no padding, and 3 tokens of it)
    return b;
  };
  const auto doubled = [&](std::mt19937& rng) {
    auto b = half(rng);
    for (auto* v : {&b.ids, &b.labels}) v->insert(v->end(), v->begin(), v->end());
    b.mask.insert(b.mask.end(), b.mask.begin(), b.mask.end());
    return b;
  };
  auto two = o;
  two.max_micro_rows = 2;
  auto one = o;
  one.batch_rows = 2;
  const auto alone = run(aux, one, 3, nullptr, half);
  const auto twice = run(aux, two, 3, nullptr, doubled);
  for (std::size_t s = 0; s < alone.size(); ++s) {
    CAPTURE(s);
    CHECK(twice[s].aux_loss == doctest::Approx(alone[s].aux_loss).epsilon(1e-6));
    CHECK(twice[s].loss == doctest::Approx(alone[s].loss).epsilon(1e-6));
  }

  // A malformed mask is refused before anything changes.
  DecoderModel<> m2(aux);
  HostParamStore<float> s2(m2.units(), store_opts(o));
  CpuBackend<float> be;
  Trainer<CpuBackend<float>> trainer(m2, s2, be, o);
  std::mt19937 r2(5);
  const auto b = padded(r2);
  const auto& mask = b.mask;
  auto bad = mask;
  bad[3] = 0;  // (row 0: a token after padding)
  CHECK_THROWS_WITH_AS(trainer.step(b.ids, b.labels, {}, bad), doctest::Contains("right padding"), Error);
  bad = mask;
  bad[0] = 2;
  CHECK_THROWS_WITH_AS(trainer.step(b.ids, b.labels, {}, bad), doctest::Contains("attention mask value 2"), Error);
  CHECK_THROWS_WITH_AS(trainer.step(b.ids, b.labels, {}, std::span(mask).first(5)), doctest::Contains("attention mask of 5"),
                       Error);
  // a label on padding (its logits are not transformers': padding attends to padding here)
  const auto pad = static_cast<std::size_t>(std::find(mask.begin(), mask.end(), std::uint8_t{0}) - mask.begin());
  REQUIRE(pad < mask.size());
  auto labelled = b.labels;
  labelled[pad] = 7;
  const std::string names = fmt::format("token {} (row {}, column {}) is padding", pad, pad / static_cast<std::size_t>(o.seq_len),
                                        pad % static_cast<std::size_t>(o.seq_len));
  CHECK_THROWS_WITH_AS(trainer.step(b.ids, labelled, {}, mask), doctest::Contains(names.c_str()), Error);
  CHECK(trainer.steps_done() == 0);
  trainer.step(b.ids, b.labels, {}, mask);  // (the well-formed batch trains)
  CHECK(trainer.steps_done() == 1);
}

TEST_CASE("a sequence longer than max_position_embeddings trains with a warning naming both numbers") {
  auto j = nlohmann::json::parse(R"({"architectures":["Qwen2ForCausalLM"],"hidden_size":32,"intermediate_size":72,
    "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":53,"max_position_embeddings":8})");
  const auto cfg = ModelConfig::from_json(j, "test");
  std::vector<std::string> warnings;
  const auto old = set_log_sink([&](LogLevel level, std::string_view m) {
    if (level == LogLevel::warning) warnings.emplace_back(m);
  });
  (void)run(cfg, options(2, 8), 1);
  const auto at_limit = warnings.size();
  (void)run(cfg, options(2, 11), 1);
  set_log_sink(old);
  CHECK(at_limit == 0);
  REQUIRE(warnings.size() == 1);
  CHECK(warnings[0].find("sequence length 11") != std::string::npos);
  CHECK(warnings[0].find("max_position_embeddings 8") != std::string::npos);
}

