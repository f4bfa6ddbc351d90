// A step whose loss or gradient is not finite (NaN or an infinity), on the CPU backend: found
// before any update (exact clipping), the run stops with the last good state or skips the step,
// and a NaN never changes a weight or an AdamW state.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <unistd.h>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "megatrain/train/checkpointer.hpp"
#include "megatrain/train/cpu_trainer.hpp"
#include "trainer_test_util.hpp"

using namespace megatrain;
using namespace megatrain::test;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

/// The CPU backend with a NaN planted in the embedding's gradient while `armed`: a gradient gone
/// non-finite in the backward while the loss is finite (an overflow, as a test stage makes it).
struct NanGradientBackend : CpuBackend<float> {
  bool armed = false;
  void embedding_backward(View<const std::int32_t> ids, View<const Act> dy, View<Acc> dtable, std::int32_t skip_id = -1,
                          double scale = 1.0) {
    CpuBackend<float>::embedding_backward(ids, dy, dtable, skip_id, scale);
    if (armed) dtable.data()[dtable.numel() / 2] = kNaN;
  }
};


TrainerOptions exact_options() {
  auto o = options(4, 11);
  o.clip_norm = 1.0;
  o.clip_mode = ClipMode::exact;
  return o;
}

/// A trainer on `cfg` with the NaN-planting backend.
struct Rig {
  DecoderModel<> model;
  HostParamStore<float> store;
  NanGradientBackend be;
  Trainer<NanGradientBackend> trainer;
  Rig(const ModelConfig& cfg, const TrainerOptions& o)
      : model(cfg), store(model.units(), store_opts(o)), trainer(model, store, be, o) {}
};

std::vector<Batch> batches(const ModelConfig& cfg, const TrainerOptions& o, int n, unsigned seed = 5) {
  std::mt19937 rng(seed);
  std::vector<Batch> out;
  for (int i = 0; i < n; ++i)
    out.push_back(random_batch(rng, o.batch_rows, o.seq_len, static_cast<std::int32_t>(cfg.vocab_size)));
  return out;
}

}  // namespace

TEST_CASE("a non-finite gradient stops the step before any weight or AdamW state changes, naming the step and unit") {
  const auto cfg = tiny(false);
  for (const std::int64_t device_units : {std::int64_t{0}, std::int64_t{2}}) {
    CAPTURE(device_units);
    auto o = exact_options();
    o.device_units = device_units;  // (device units: their state comes back to the store, unchanged)
    Rig r(cfg, o);
    const auto b = batches(cfg, o, 3);
    (void)r.trainer.step(b[0].ids, b[0].labels);
    (void)r.trainer.step(b[1].ids, b[1].labels);
    r.trainer.finish_update();
    const auto before = state_of(r.store);
    r.be.armed = true;
    CHECK_THROWS_WITH_AS(r.trainer.step(b[2].ids, b[2].labels),
                         doctest::Contains("step 3: the gradient is not finite (loss "), Error);
    CHECK(r.trainer.stopped_because().find("unit 'embed' is the first to go non-finite") != std::string::npos);
    CHECK(r.trainer.stopped_because().find("they are those of step 2") != std::string::npos);
    CHECK(r.trainer.stopped_with_last_good_state());
    CHECK(r.trainer.steps_done() == 2);
    r.trainer.finish_update();
    CHECK(same_bits(state_of(r.store), before));
    r.be.armed = false;
    CHECK_THROWS_WITH_AS(r.trainer.step(b[2].ids, b[2].labels), doctest::Contains("takes no further step"), Error);
  }
}

TEST_CASE("a NaN weight: the step stops before any update, naming the tensor that holds it") {
  const auto cfg = tiny(true);
  for (const auto policy : {NonFinite::stop, NonFinite::skip}) {
    auto o = exact_options();
    o.device_units = 0;  // (every unit's state in the store, where the test plants the NaN)
    o.on_nonfinite = policy;
    Rig r(cfg, o);
    const auto b = batches(cfg, o, 2);
    (void)r.trainer.step(b[0].ids, b[0].labels);
    r.trainer.finish_update();
    // A NaN in layer 1's MLP (its master and the copy the ops read): the forward carries it to the loss.
    const auto w = r.store.master("model.layers.1.mlp.down_proj.weight");
    w.data()[3] = kNaN;
    r.store.sync_compute(r.store.unit(2));
    const auto before = state_of(r.store);
    // (skipping cannot help: the weights themselves are not finite, so the run stops either way)
    CHECK_THROWS_WITH_AS(r.trainer.step(b[1].ids, b[1].labels),
                         doctest::Contains("step 2: the loss and the gradient are not finite"), Error);
    CHECK(r.trainer.stopped_because().find(
              "the weights are not finite: 'model.layers.1.mlp.down_proj.weight' holds 1 non-finite value(s) (the first, "
              "element 3, is nan)") != std::string::npos);
    r.trainer.finish_update();
    CHECK(same_bits(state_of(r.store), before));  // bit for bit, the planted NaN included: nothing was updated
    CHECK(r.trainer.skipped_steps() == 0);
  }
}

TEST_CASE("skip: a non-finite step changes nothing, and the run goes on as if its batch had been left out") {
  const auto cfg = tiny(true);
  auto o = exact_options();
  o.schedule = {LrSchedule::Kind::constant, 3e-3, 0, 0, 0.0};  // (the same lr at every step: comparable)
  o.on_nonfinite = NonFinite::skip;
  const auto b = batches(cfg, o, 5);
  for (const std::int64_t device_units : {std::int64_t{0}, std::int64_t{2}}) {
    CAPTURE(device_units);
    o.device_units = device_units;
    // A: five steps, the third's gradient non-finite (skipped).
    Rig a(cfg, o);
    std::vector<StepStats> sa;
    std::vector<float> after_two;
    for (int i = 0; i < 5; ++i) {
      a.be.armed = i == 2;
      if (i == 2) {
        a.trainer.finish_update();
        after_two = state_of(a.store);
      }
      sa.push_back(a.trainer.step(b[i].ids, b[i].labels));
      if (i == 2) {
        a.trainer.finish_update();
        CHECK(same_bits(state_of(a.store), after_two));  // the skipped step changed nothing
      }
    }
    a.trainer.finish_update();
    REQUIRE(sa.size() == 5);
    CHECK(sa[2].skipped);
    CHECK(std::isfinite(sa[2].loss));
    CHECK(!std::isfinite(sa[2].grad_norm));
    CHECK(sa[2].step == 3);
    CHECK(!sa[3].skipped);
    CHECK(a.trainer.steps_done() == 5);
    CHECK(a.trainer.skipped_steps() == 1);
    CHECK(a.trainer.skipped_in_a_row() == 0);
    CHECK(a.trainer.last_grad_norm() == sa[4].grad_norm);
    // B: the same batches without the third, four steps: AdamW counts only the updates applied
    // (as PyTorch's GradScaler skipping optimizer.step()), so A's steps 4 and 5 are B's 3 and 4.
    Rig c(cfg, o);
    std::vector<StepStats> sb;
    for (int i : {0, 1, 3, 4}) sb.push_back(c.trainer.step(b[i].ids, b[i].labels));
    c.trainer.finish_update();
    CHECK(same_bits(state_of(a.store), state_of(c.store)));
    CHECK(sa[3].loss == sb[2].loss);
    CHECK(sa[4].loss == sb[3].loss);
    CHECK(sa[4].grad_norm == sb[3].grad_norm);
  }
}

TEST_CASE("skip: after max_nonfinite_skips non-finite steps in a row the trainer stops with the last good state") {
  const auto cfg = tiny(false);
  auto o = exact_options();
  o.device_units = 0;
  o.on_nonfinite = NonFinite::skip;
  o.max_nonfinite_skips = 2;
  Rig r(cfg, o);
  const auto b = batches(cfg, o, 6);
  (void)r.trainer.step(b[0].ids, b[0].labels);
  r.trainer.finish_update();
  const auto good = state_of(r.store);
  r.be.armed = true;
  CHECK(r.trainer.step(b[1].ids, b[1].labels).skipped);
  r.be.armed = false;
  CHECK(!r.trainer.step(b[2].ids, b[2].labels).skipped);  // a good step resets the count
  CHECK(r.trainer.skipped_in_a_row() == 0);
  r.trainer.finish_update();
  const auto good3 = state_of(r.store);
  CHECK(!same_bits(good3, good));
  r.be.armed = true;
  CHECK(r.trainer.step(b[3].ids, b[3].labels).skipped);
  CHECK(r.trainer.step(b[4].ids, b[4].labels).skipped);
  CHECK(r.trainer.skipped_in_a_row() == 2);
  CHECK_THROWS_WITH_AS(r.trainer.step(b[5].ids, b[5].labels),
                       doctest::Contains("(3 non-finite steps in a row, more than max_nonfinite_skips 2)"), Error);
  CHECK(r.trainer.stopped_because().find("they are those of step 5") != std::string::npos);
  CHECK(r.trainer.steps_done() == 5);
  CHECK(r.trainer.skipped_steps() == 3);
  CHECK(r.trainer.skipped_in_a_row() == 2);
  r.trainer.finish_update();
  CHECK(same_bits(state_of(r.store), good3));
}

TEST_CASE("skip: the skipped counts are part of the train state; a resumed run is bit for bit the uninterrupted one") {
  const auto cfg = tiny(true);
  auto o = exact_options();
  o.device_units = 1;
  o.on_nonfinite = NonFinite::skip;
  const auto b = batches(cfg, o, 6);
  const auto arm = [](int i) { return i == 1 || i == 2; };  // steps 2 and 3 skipped
  Rig whole(cfg, o);
  for (int i = 0; i < 6; ++i) {
    whole.be.armed = arm(i);
    (void)whole.trainer.step(b[i].ids, b[i].labels);
  }
  whole.trainer.finish_update();
  REQUIRE(whole.trainer.skipped_steps() == 2);

  const auto dir = std::filesystem::temp_directory_path() / ("megatrain_nonfinite_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  {
    Rig first(cfg, o);
    for (int i = 0; i < 3; ++i) {
      first.be.armed = arm(i);
      (void)first.trainer.step(b[i].ids, b[i].labels);
    }
    CheckpointerOptions co;
    co.overlap = false;
    Checkpointer ck(dir, co);
    ck.save(first.trainer, first.store);
    for (const auto& res : ck.wait()) REQUIRE(res.ok);
  }
  Rig second(cfg, o);
  const TrainState st = load_train_state(io::CheckpointFolder(dir).latest().value(), second.trainer, second.store);
  CHECK(st.step == 3);
  CHECK(st.skipped_steps == 2);
  CHECK(st.skipped_in_a_row == 2);
  CHECK(second.trainer.skipped_in_a_row() == 2);
  for (int i = 3; i < 6; ++i) (void)second.trainer.step(b[i].ids, b[i].labels);
  second.trainer.finish_update();
  CHECK(same_bits(state_of(second.store), state_of(whole.store)));
  std::filesystem::remove_all(dir);
}

TEST_CASE("skipping needs the whole gradient first; streamed updates that went non-finite say the model was changed") {
  const auto cfg = tiny(false);
  auto o = exact_options();
  o.on_nonfinite = NonFinite::skip;
  o.clip_mode = ClipMode::stale;
  CHECK_THROWS_WITH_AS(o.validate(), doctest::Contains("needs the whole gradient before any update"), Error);
  o.clip_norm = 0;
  CHECK_THROWS_AS(o.validate(), Error);
  o.micro_batches = 2;  // (micro-batches hold the gradient too)
  CHECK_NOTHROW(o.validate());
  o.max_nonfinite_skips = 0;
  CHECK_THROWS_WITH_AS(o.validate(), doctest::Contains("max_nonfinite_skips must be >= 1"), Error);

  auto s = exact_options();
  s.clip_mode = ClipMode::stale;
  s.device_units = 0;
  Rig r(cfg, s);
  const auto b = batches(cfg, s, 2);
  (void)r.trainer.step(b[0].ids, b[0].labels);
  r.be.armed = true;
  CHECK_THROWS_WITH_AS(r.trainer.step(b[1].ids, b[1].labels), doctest::Contains("the model was updated with it"), Error);
  CHECK(!r.trainer.stopped_with_last_good_state());
  CHECK_THROWS_WITH_AS(r.trainer.step(b[1].ids, b[1].labels), doctest::Contains("takes no further step"), Error);
}
