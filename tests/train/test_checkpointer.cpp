// Saving and resuming a run on the CPU backend: N steps straight equal N/2 steps, a save, a
// fresh trainer loaded from it, and N/2 more steps, bit for bit (every loss, every gradient norm,
// every master weight and Adam moment), in every clipping mode, tied and untied, with gradient
// accumulation; and saving while training (overlap, with random delays in every stage) changes
// nothing either.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <stdlib.h>

#include <cstring>
#include <random>

#include "../io/io_test_util.hpp"
#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/train/checkpointer.hpp"
#include "megatrain/train/cpu_trainer.hpp"

#include "trainer_test_util.hpp"

using namespace megatrain;
namespace fs = std::filesystem;

namespace {

using CpuTrainer = Trainer<CpuBackend<float>>;
using megatrain::test::same_bits;
using megatrain::test::state_of;
using megatrain::test::tiny;

struct Batch {
  std::vector<std::int32_t> ids, labels;
};
std::vector<Batch> batches(std::uint64_t seed, int steps, std::int64_t tokens, std::int32_t vocab) {
  std::mt19937_64 rng(seed);
  std::vector<Batch> out(static_cast<std::size_t>(steps));
  for (auto& b : out)
    for (std::int64_t i = 0; i < tokens; ++i) {
      b.ids.push_back(static_cast<std::int32_t>(rng() % vocab));
      b.labels.push_back(rng() % 7 == 0 ? kIgnoreIndex : static_cast<std::int32_t>(rng() % vocab));
    }
  return out;
}

struct Run {
  ModelConfig cfg;
  TrainerOptions opt;
  DecoderModel<> model;
  HostParamStore<float> store;
  CpuBackend<float> be;
  CpuTrainer trainer;
  Run(const ModelConfig& c, const TrainerOptions& o, std::uint64_t seed)
      : cfg(c), opt(o), model(c), store(model.units(), store_options(o, seed)), trainer(model, store, be, o) {}
  static StoreOptions store_options(const TrainerOptions& o, std::uint64_t seed) {
    StoreOptions s;
    s.seed = seed;
    s.pinning = Pinning::never;
    return CpuTrainer::store_options(o, s);
  }
  /// A step, its update applied (the tests read the store between steps).
  StepStats step(const Batch& b) {
    const StepStats st = trainer.step(b.ids, b.labels);
    trainer.finish_update();
    return st;
  }
};

void check_same(const StepStats& a, const StepStats& b) {
  CHECK(a.step == b.step);
  CHECK(std::memcmp(&a.loss, &b.loss, sizeof(double)) == 0);
  CHECK(std::memcmp(&a.grad_norm, &b.grad_norm, sizeof(double)) == 0);
  CHECK(std::memcmp(&a.clip_coef, &b.clip_coef, sizeof(double)) == 0);
  CHECK(a.lr == b.lr);
}

}  // namespace

TEST_CASE("a resumed run equals the uninterrupted one bit for bit, in every mode") {
  struct Case {
    const char* name;
    bool tied;
    std::int64_t vocab, micro;
    double clip;
    ClipMode mode;
    std::int64_t device_units = 0;
    GradientHome home = GradientHome::device;
  };
  const Case cases[] = {
      {"tied, no clipping", true, 53, 1, 0.0, ClipMode::exact},
      {"untied, stale clipping", false, 53, 1, 0.05, ClipMode::stale},
      {"tied, exact clipping", true, 53, 1, 0.05, ClipMode::exact},
      {"tied, exact clipping, gradients in host memory", true, 53, 1, 0.05, ClipMode::exact, 0, GradientHome::host},
      {"untied, 2 micro-batches, exact clipping", false, 53, 2, 0.05, ClipMode::exact},
      {"tied, large vocabulary (pieces), stale clipping", true, 1111, 1, 0.05, ClipMode::stale},
      {"untied, exact clipping, the embedding and a block on the device", false, 53, 1, 0.05, ClipMode::exact, 2},
      {"tied, large vocabulary, stale clipping, every unit on the device", true, 1111, 1, 0.05, ClipMode::stale, 5},
  };
  test::TempDir dir("megatrain-resume");
  for (const Case& k : cases) {
    CAPTURE(std::string(k.name));
    const ModelConfig cfg = tiny(k.tied, k.vocab);
    TrainerOptions o;
    o.batch_rows = 4;
    o.seq_len = 11;
    o.micro_batches = k.micro;
    o.adamw.weight_decay = 0.1;
    o.schedule = {LrSchedule::Kind::warmup_cosine, 3e-3, 2, 10, 3e-4};
    o.clip_norm = k.clip;
    o.clip_mode = k.mode;
    o.device_units = k.device_units;
    o.gradient_home = k.home;
    constexpr int kSteps = 6, kHalf = 3;
    const auto data = batches(11, kSteps, o.batch_rows * o.seq_len, static_cast<std::int32_t>(cfg.vocab_size));

    // Straight through.
    Run straight(cfg, o, 7);
    std::vector<StepStats> want;
    std::vector<float> want_half;
    for (int s = 0; s < kSteps; ++s) {
      want.push_back(straight.step(data[s]));
      if (s + 1 == kHalf) want_half = state_of(straight.store);
    }
    const auto want_final = state_of(straight.store);

    // Half, a save overlapped with the next steps (random delays in every stage), the rest.
    const fs::path folder = dir / k.name;
    {
      TrainerOptions jittery = o;
      jittery.jitter_us = 200;
      Run first(cfg, jittery, 7);
      Checkpointer ckpt(folder, {});
      ::setenv("MEGATRAIN_FAULTS", "delay@write:tensor=3000", 1);  // a slow disk: the next steps wait for it (3 ms a tensor: slower than the steps even on a loaded 2-core machine)
      // (Updates left in flight between steps, as a training loop leaves them: save() applies the
      // last one before writing, and the next ones wait for the writer unit by unit.)
      for (int s = 0; s < kSteps; ++s) {
        check_same(first.trainer.step(data[s].ids, data[s].labels), want[s]);
        if (s + 1 == kHalf) ckpt.save(first.trainer, first.store, DataPosition{1, 0, kHalf * 4, 100});
      }
      first.trainer.finish_update();
      const auto done = ckpt.wait();
      ::unsetenv("MEGATRAIN_FAULTS");
      REQUIRE(done.size() == 1);
      const SaveResult& r = done[0];
      CHECK_MESSAGE(r.ok, r.error);
      CHECK(r.step == kHalf);
      CHECK(r.stall_seconds > 0);  // the optimizer did wait for the writer
      CHECK(ckpt.wait().empty());
      CHECK(same_bits(state_of(first.store), want_final));
    }

    // A fresh process's view: a new store (another seed: everything must come from the file).
    Run resumed(cfg, o, 12345);
    const auto latest = io::CheckpointFolder(folder).latest();
    REQUIRE(latest.has_value());
    CHECK(latest->filename() == "step-00000003");
    const TrainState st = load_train_state(*latest, resumed.trainer, resumed.store);
    CHECK(st.step == kHalf);
    CHECK(resumed.trainer.steps_done() == kHalf);
    REQUIRE(st.data.has_value());
    CHECK(*st.data == DataPosition{1, 0, kHalf * 4, 100});
    CHECK(same_bits(state_of(resumed.store), want_half));
    for (int s = kHalf; s < kSteps; ++s) check_same(resumed.step(data[s]), want[s]);
    CHECK(same_bits(state_of(resumed.store), want_final));
  }
}

TEST_CASE("a resume with other update options or another model is refused before anything changes") {
  test::TempDir dir("megatrain-resume");
  const ModelConfig cfg = tiny(true, 53);
  TrainerOptions o;
  o.batch_rows = 2;
  o.seq_len = 8;
  o.schedule = {LrSchedule::Kind::constant, 1e-3, 0, 0, 0.0};
  const auto data = batches(3, 1, o.batch_rows * o.seq_len, 53);
  {
    Run r(cfg, o, 1);
    r.step(data[0]);
    CheckpointerOptions co;
    co.overlap = false;
    Checkpointer ckpt(dir.path(), co);
    ckpt.save(r.trainer, r.store);
    const auto res = ckpt.wait();
    REQUIRE(res.size() == 1);
    REQUIRE(res[0].ok);
  }
  const fs::path ck = dir / "step-00000001";
  SUBCASE("another learning rate") {
    TrainerOptions other = o;
    other.schedule.lr = 2e-3;
    Run r(cfg, other, 1);
    const auto before = state_of(r.store);
    CHECK_ERROR_MENTIONS(load_train_state(ck, r.trainer, r.store), "schedule.lr: 0.001 vs 0.002", "change the update");
    CHECK(same_bits(state_of(r.store), before));
    CHECK(r.trainer.steps_done() == 0);
  }
  SUBCASE("another batch") {
    TrainerOptions other = o;
    other.batch_rows = 4;
    Run r(cfg, other, 1);
    CHECK_ERROR_MENTIONS(load_train_state(ck, r.trainer, r.store), "batch_rows: 2 vs 4");
  }
  SUBCASE("another model") {
    Run r(tiny(false, 53), o, 1);
    CHECK_ERROR_MENTIONS(load_train_state(ck, r.trainer, r.store), "another model", "tie_word_embeddings");
  }
  SUBCASE("micro-batches may change (the update is the same, to rounding)") {
    TrainerOptions other = o;
    other.micro_batches = 2;
    Run r(cfg, other, 1);
    CHECK(load_train_state(ck, r.trainer, r.store).step == 1);
  }
}

TEST_CASE("saves asked for while one is still written: every result is reported, oldest first") {
  test::TempDir dir("megatrain-resume");
  const ModelConfig cfg = tiny(false, 53);
  TrainerOptions o;
  o.batch_rows = 2;
  o.seq_len = 8;
  o.schedule = {LrSchedule::Kind::constant, 1e-3, 0, 0, 0.0};
  const auto data = batches(5, 3, o.batch_rows * o.seq_len, 53);
  Run r(cfg, o, 3);
  CheckpointerOptions co;
  co.keep = 0;
  Checkpointer ckpt(dir.path(), co);
  ::setenv("MEGATRAIN_FAULTS", "delay@write:tensor=2000", 1);  // each save outlasts a step
  for (int s = 0; s < 3; ++s) {
    r.step(data[s]);
    ckpt.save(r.trainer, r.store);  // waits for the previous save, keeps its result
    CHECK(ckpt.in_flight());
  }
  const auto polled = ckpt.poll();  // at most the saves already finished, and never the one in flight
  const auto rest = ckpt.wait();
  ::unsetenv("MEGATRAIN_FAULTS");
  std::vector<std::int64_t> steps;
  for (const auto* list : {&polled, &rest})
    for (const SaveResult& x : *list) {
      CHECK_MESSAGE(x.ok, x.error);
      steps.push_back(x.step);
    }
  CHECK_MESSAGE((steps == std::vector<std::int64_t>{1, 2, 3}), fmt::format("{}", fmt::join(steps, ",")));
  CHECK(ckpt.wait().empty());
  CHECK(ckpt.poll().empty());
  CHECK(io::CheckpointFolder(dir.path()).list().size() == 3);
}

TEST_CASE("train_state.json: whole-number fields as floats or out of their range are refused (found by fuzzing)") {
  // (nlohmann's get<int64_t>() of 1e300, or get<size_t>() of -1.0, is undefined behaviour)
  TrainState s;
  s.step = 7;
  s.options = megatrain::test::options(2, 8);
  s.data = DataPosition{42, 1, 3, 10};
  s.model = tiny(false).to_json();
  const nlohmann::json good = to_json(s);
  REQUIRE(train_state_from_json(good, "train_state.json").step == 7);
  const std::pair<std::vector<std::string>, nlohmann::json> cases[] = {
      {{"step"}, 1e300},          {{"trainer", "weight_slots"}, -1.0}, {{"trainer", "batch_rows"}, 2.5},
      {{"skipped_steps"}, -1e19}, {{"trainer", "grad_slots"}, -2},    {{"data", "seed"}, -1},
      {{"format_version"}, 1e10}, {{"trainer", "schedule", "warmup_steps"}, 1.0}};
  for (const auto& [path, value] : cases) {
    CAPTURE(path.back());
    nlohmann::json j = good;
    nlohmann::json* at = &j;
    for (const auto& k : path) at = &(*at)[k];
    *at = value;
    std::string e;
    try {
      (void)train_state_from_json(j, "run/step-7/train_state.json");
    } catch (const Error& err) {
      e = err.what();
    }
    CHECK(e.find("run/step-7/train_state.json") != std::string::npos);
    CHECK(e.find(path.back() + "' must be a whole number") != std::string::npos);
    CHECK(e.find(value.dump()) != std::string::npos);
  }
}
