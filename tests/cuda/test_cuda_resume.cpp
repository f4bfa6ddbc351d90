// Saving and resuming on the GPU: a run resumed from a checkpoint equals the uninterrupted run at
// least as closely as two uninterrupted runs equal each other (measured, both printed), in stale
// and exact clipping with gradient accumulation, with AdamW on the GPU (device units) or the
// host; and a save overlapped with the next steps changes nothing in the run that saves.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "../io/io_test_util.hpp"
#include "megatrain/backend/cuda/cuda_backend.hpp"
#include "megatrain/train/cuda_trainer.hpp"
#include "megatrain/data/token_dataset.hpp"
#include "megatrain/train/checkpointer.hpp"
#include "megatrain/train/cpu_trainer.hpp"

using namespace megatrain;

namespace {

using GpuTrainer = Trainer<CudaBackend>;

ModelConfig small(bool tied) {
  return ModelConfig::from_json(nlohmann::json{{"architectures", {"Qwen2ForCausalLM"}},
                                               {"hidden_size", 128},
                                               {"intermediate_size", 344},
                                               {"num_hidden_layers", 3},
                                               {"num_attention_heads", 4},
                                               {"num_key_value_heads", 2},
                                               {"vocab_size", 300},
                                               {"tie_word_embeddings", tied}},
                                "test");
}

struct Run {
  DecoderModel<> model;
  HostParamStore<float> store;
  GpuTrainer trainer;
  TokenDataset data;
  std::vector<std::int32_t> ids, labels;
  Run(const ModelConfig& cfg, CudaBackend& be, const TrainerOptions& o, std::uint64_t seed)
      : model(cfg),
        store(model.units(), GpuTrainer::store_options(o, store_options(seed))),
        trainer(model, store, be, o),
        data(TokenSource::from_text(builtin_text(1 << 18, 1), "built-in"), dataset_options(o)),
        ids(static_cast<std::size_t>(o.batch_rows * o.seq_len)),
        labels(ids.size()) {}
  static StoreOptions store_options(std::uint64_t seed) {
    StoreOptions s;
    s.seed = seed;
    return s;
  }
  static DatasetOptions dataset_options(const TrainerOptions& o) {
    DatasetOptions d;
    d.vocab_size = 300;
    d.seq_len = o.seq_len;
    d.seed = 5;
    return d;
  }
  StepStats step() {
    const std::int64_t rows = trainer.options().batch_rows;
    data.train_batch(trainer.steps_done() * rows, rows, ids, labels);
    return trainer.step(ids, labels);
  }
};

std::vector<float> state_of(const HostParamStore<float>& store) {
  store.check_settled("reading the store in a test");
  std::vector<float> out;
  for (const auto& u : store.units())
    for (auto s : {u.master(), u.adam_m(), u.adam_v()}) out.insert(out.end(), s.begin(), s.end());
  return out;
}

/// The largest difference between two runs: over every step's loss and gradient norm (relative)
/// and every master weight and moment (absolute).
struct Gap {
  double stats = 0, state = 0;
  bool bitwise = true;
};
Gap gap(const std::vector<StepStats>& a, const std::vector<StepStats>& b, const std::vector<float>& sa,
        const std::vector<float>& sb) {
  Gap g;
  REQUIRE(a.size() == b.size());
  REQUIRE(sa.size() == sb.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].step == b[i].step);
    for (auto [x, y] : {std::pair{a[i].loss, b[i].loss}, std::pair{a[i].grad_norm, b[i].grad_norm}})
      g.stats = std::max(g.stats, std::abs(x - y) / std::max(std::abs(x), 1e-30));
    g.bitwise = g.bitwise && std::memcmp(&a[i].loss, &b[i].loss, sizeof(double)) == 0 &&
                std::memcmp(&a[i].grad_norm, &b[i].grad_norm, sizeof(double)) == 0;
  }
  for (std::size_t i = 0; i < sa.size(); ++i) g.state = std::max(g.state, static_cast<double>(std::abs(sa[i] - sb[i])));
  g.bitwise = g.bitwise && std::memcmp(sa.data(), sb.data(), sa.size() * sizeof(float)) == 0;
  return g;
}

}  // namespace

TEST_CASE("a resumed GPU run equals the uninterrupted one as closely as two uninterrupted runs do") {
  struct Case {
    const char* name;
    bool tied;
    std::int64_t micro;
    ClipMode mode;
    std::int64_t device_units = TrainerOptions::kAutoDeviceUnits;  // (auto: every unit of this model on the GPU)
  };
  const Case cases[] = {{"tied, stale clipping", true, 1, ClipMode::stale},
                        {"tied, stale clipping, AdamW on the host", true, 1, ClipMode::stale, 0},
                        {"untied, exact clipping, 2 micro-batches", false, 2, ClipMode::exact},
                        {"untied, exact clipping, 2 micro-batches, AdamW on the host for all but 2 units", false, 2,
                         ClipMode::exact, 2}};
  megatrain::test::TempDir dir("megatrain-gpu-resume");
  CudaBackend be;
  for (const Case& k : cases) {
    CAPTURE(std::string(k.name));
    const ModelConfig cfg = small(k.tied);
    TrainerOptions o;
    o.batch_rows = 8;
    o.seq_len = 96;
    o.chunk_rows = 4;
    o.micro_batches = k.micro;
    o.adamw.weight_decay = 0.1;
    o.schedule = {LrSchedule::Kind::warmup_cosine, 2e-3, 2, 10, 2e-4};
    o.clip_norm = 0.5;
    o.clip_mode = k.mode;
    o.device_units = k.device_units;
    constexpr int kSteps = 8, kHalf = 4;

    // Two uninterrupted runs; the second saves at kHalf while it goes on (a slow disk, so the
    // optimizer of the following steps waits for the writer).
    std::vector<StepStats> a, b;
    std::vector<float> a_final, b_final;
    {
      Run r(cfg, be, o, 7);
      for (int s = 0; s < kSteps; ++s) a.push_back(r.step());
      r.trainer.finish_update();
      a_final = state_of(r.store);
    }
    const auto folder = dir / k.name;
    {
      Run r(cfg, be, o, 7);
      Checkpointer ckpt(folder);
      ::setenv("MEGATRAIN_FAULTS", "delay@write:tensor=1000", 1);
      for (int s = 0; s < kSteps; ++s) {
        b.push_back(r.step());
        if (s + 1 == kHalf) ckpt.save(r.trainer, r.store, r.data.position(kHalf * o.batch_rows));
      }
      r.trainer.finish_update();
      const auto saved = ckpt.wait();
      ::unsetenv("MEGATRAIN_FAULTS");
      REQUIRE(saved.size() == 1);
      CHECK_MESSAGE(saved[0].ok, saved[0].error);
      b_final = state_of(r.store);
    }

    // A fresh trainer and store (another seed: everything must come from the checkpoint).
    std::vector<StepStats> c(a.begin(), a.begin() + kHalf);
    std::vector<float> c_final;
    {
      Run r(cfg, be, o, 999);
      const auto latest = io::CheckpointFolder(folder).latest();
      REQUIRE(latest.has_value());
      const TrainState st = load_train_state(*latest, r.trainer, r.store);
      REQUIRE(st.data.has_value());
      CHECK(*st.data == r.data.position(kHalf * o.batch_rows));
      CHECK(r.trainer.steps_done() == kHalf);
      for (int s = kHalf; s < kSteps; ++s) c.push_back(r.step());
      r.trainer.finish_update();
      c_final = state_of(r.store);
    }
    const Gap twice = gap(a, b, a_final, b_final), resumed = gap(a, c, a_final, c_final);
    const auto bits = [](bool same) { return std::string(same ? " (bit for bit equal)" : ""); };
    const std::string report = std::string(k.name) + ": two uninterrupted runs differ by " + std::to_string(twice.stats) +
                               " (loss, norm) and " + std::to_string(twice.state) + " (weights, moments)" + bits(twice.bitwise) +
                               "; resumed vs uninterrupted: " + std::to_string(resumed.stats) + " and " +
                               std::to_string(resumed.state) + bits(resumed.bitwise);
    MESSAGE(report);
    CHECK(resumed.stats <= twice.stats);
    CHECK(resumed.state <= twice.state);
    CHECK(resumed.bitwise == twice.bitwise);
  }
}

TEST_CASE("tuned matrix products: a run resumed with its checkpoint's algorithms continues bit for bit") {
  megatrain::test::TempDir dir("megatrain-gpu-resume-tuned");
  const ModelConfig cfg = small(false);
  TrainerOptions o;
  o.batch_rows = 8;
  o.seq_len = 96;
  o.chunk_rows = 4;
  o.adamw.weight_decay = 0.1;
  o.schedule = {LrSchedule::Kind::warmup_cosine, 2e-3, 2, 10, 2e-4};
  o.clip_norm = 0.5;
  o.clip_mode = ClipMode::exact;
  constexpr int kSteps = 6, kHalf = 3;
  CudaBackendOptions bo;
  bo.gemm_tuning = true;
  const auto folder = dir / "tuned";
  std::vector<StepStats> a;
  std::vector<float> a_final;
  std::string algorithms;
  {
    CudaBackend be(bo);
    Run r(cfg, be, o, 7);
    Checkpointer ckpt(folder);
    for (int s = 0; s < kSteps; ++s) {
      a.push_back(r.step());
      if (s + 1 == kHalf)
        ckpt.save(r.trainer, r.store, r.data.position(kHalf * o.batch_rows),
                  nlohmann::json{{"gemm_algorithms", be.gemm_algorithms()}});
    }
    r.trainer.finish_update();
    const auto saved = ckpt.wait();
    REQUIRE(saved.size() == 1);
    CHECK_MESSAGE(saved[0].ok, saved[0].error);
    a_final = state_of(r.store);
    algorithms = be.gemm_algorithms();
  }
  // A fresh backend that would tune, and a fresh store: the checkpoint's algorithms replace tuning.
  std::vector<StepStats> c(a.begin(), a.begin() + kHalf);
  std::vector<float> c_final;
  {
    CudaBackend be(bo);
    Run r(cfg, be, o, 999);
    const auto latest = io::CheckpointFolder(folder).latest();
    REQUIRE(latest.has_value());
    const TrainState st = load_train_state(*latest, r.trainer, r.store);
    REQUIRE(be.restore_gemm_algorithms(st.user.at("gemm_algorithms").get<std::string>()));
    for (int s = kHalf; s < kSteps; ++s) c.push_back(r.step());
    r.trainer.finish_update();
    c_final = state_of(r.store);
    CHECK(be.gemm_algorithms() == algorithms);  // (every shape the steps after the save took)
  }
  const Gap resumed = gap(a, c, a_final, c_final);
  CHECK_MESSAGE(resumed.bitwise, "resumed vs uninterrupted: " << resumed.stats << " (loss, norm), " << resumed.state
                                                               << " (weights, moments)");
}
