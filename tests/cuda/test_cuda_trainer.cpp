// The streaming trainer on the GPU: it follows the CPU backend's loss curve within bf16
// tolerance over 50 steps of a small model, and a GPU memory cap that forces activation
// checkpoints into host memory changes no bit of the result.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <vector>

#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/backend/cuda/cuda_backend.hpp"
#include "megatrain/data/token_dataset.hpp"
#include "megatrain/train/trainer.hpp"

using namespace megatrain;

namespace {

ModelConfig small() {
  return ModelConfig::from_json(nlohmann::json{{"architectures", {"Qwen2ForCausalLM"}},
                                               {"hidden_size", 128},
                                               {"intermediate_size", 344},
                                               {"num_hidden_layers", 4},
                                               {"num_attention_heads", 4},
                                               {"num_key_value_heads", 2},
                                               {"vocab_size", 256},
                                               {"tie_word_embeddings", true}},
                                "test");
}

TrainerOptions options() {
  TrainerOptions o;
  o.batch_rows = 8;
  o.seq_len = 64;
  o.chunk_rows = 4;
  o.adamw.lr = 2e-3;
  o.adamw.beta2 = 0.95;
  o.schedule = {LrSchedule::Kind::warmup_cosine, 2e-3, 5, 50, 2e-4};
  o.clip_norm = 1.0;
  o.clip_mode = ClipMode::stale;
  return o;
}

template <class B>
std::vector<StepStats> train(B& be, int steps, std::size_t* spilled = nullptr, bool profile = false) {
  const auto cfg = small();
  auto opt = options();
  opt.profile = profile;
  DecoderModel<> model(cfg);
  StoreOptions so;
  so.seed = 3;
  HostParamStore<float> store(model.units(), Trainer<B>::store_options(opt, so));
  Trainer<B> trainer(model, store, be, opt);
  if (spilled) *spilled = trainer.spilled_checkpoints();
  DatasetOptions dopt;
  dopt.vocab_size = 256;
  dopt.seq_len = opt.seq_len;
  dopt.seed = 5;
  TokenDataset data(TokenSource::from_text(builtin_text(1 << 18, 1), "built-in"), dopt);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(opt.batch_rows * opt.seq_len)), labels(ids.size());
  std::vector<StepStats> out;
  for (int s = 0; s < steps; ++s) {
    data.train_batch(s * opt.batch_rows, opt.batch_rows, ids, labels);
    out.push_back(trainer.step(ids, labels));
  }
  return out;
}

}  // namespace

TEST_CASE("the GPU trainer follows the CPU trainer's loss curve over 50 steps") {
  CpuBackend<float> cpu;
  const auto ref = train(cpu, 50);
  CudaBackend gpu;
  const auto got = train(gpu, 50, nullptr, true);
  double worst = 0;
  for (std::size_t s = 0; s < ref.size(); ++s) {
    CAPTURE(s);
    // bf16 rounding perturbs the trajectory a little more each step: allow 2% plus a small
    // absolute term, and require both to learn.
    const double diff = std::fabs(got[s].loss - ref[s].loss);
    worst = std::max(worst, diff / ref[s].loss);
    CHECK(diff <= 0.02 * ref[s].loss + 0.02);
  }
  MESSAGE("largest relative loss difference over 50 steps: " << worst);
  CHECK(ref.back().loss < 0.7 * ref.front().loss);
  CHECK(got.back().loss < 0.7 * got.front().loss);
  REQUIRE(got.back().profile.has_value());
  const auto& p = *got.back().profile;
  CHECK(p.compute_s > 0);
  CHECK(p.upload_bytes > 0);
  CHECK(p.download_bytes > 0);
}

TEST_CASE("a GPU memory cap spills checkpoints to host memory and changes nothing") {
  CudaBackend free_gpu;
  std::size_t none = 0;
  const auto ref = train(free_gpu, 6, &none);
  CHECK(none == 0);
  // The same run with a cap just above what everything but the checkpoints needs.
  const auto cfg = small();
  const auto opt = options();
  const std::size_t ckpt = static_cast<std::size_t>(opt.batch_rows * opt.seq_len * cfg.hidden_size) * sizeof(bf16);
  CudaBackendOptions capped;
  {
    CudaBackend probe;
    DecoderModel<> model(cfg);
    HostParamStore<float> store(model.units(), Trainer<CudaBackend>::store_options(opt));
    Trainer<CudaBackend> t(model, store, probe, opt);
    // Room for all but two and a half checkpoints: the trainer keeps what fits (less a margin)
    // and two staging buffers, and spills the rest.
    capped.memory_limit = probe.allocated_bytes() - 2 * ckpt - ckpt / 2;
  }
  CudaBackend small_gpu(capped);
  std::size_t spilled = 0;
  const auto got = train(small_gpu, 6, &spilled);
  MESSAGE("checkpoints spilled to host memory: " << spilled);
  CHECK(spilled >= 2);
  for (std::size_t s = 0; s < ref.size(); ++s) {
    CHECK(got[s].loss == ref[s].loss);
    CHECK(got[s].grad_norm == ref[s].grad_norm);
  }
}
