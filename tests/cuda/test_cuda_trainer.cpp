// The streaming trainer on the GPU: it follows the CPU backend's loss curve within bf16
// tolerance over 50 steps of a small model, a GPU memory cap that forces activation
// checkpoints into host memory changes no bit of the result, and neither does where AdamW runs
// (host or device units) or where gradients wait for the norm.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <stdlib.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/backend/cuda/cuda_backend.hpp"
#include "megatrain/train/cuda_trainer.hpp"
#include "megatrain/data/token_dataset.hpp"
#include "megatrain/train/cpu_trainer.hpp"
#include "../train/pair_preference.hpp"
#include "../train/timeline_check.hpp"
#include "../train/trainer_test_util.hpp"

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
  o.device_units = 0;  // the streaming paths (the placement test below sets its own)
  return o;
}

// The built-in text's bytes in sequences of seq tokens.
TokenDataset builtin_data(std::int64_t seq) {
  DatasetOptions dopt;
  dopt.vocab_size = 256;
  dopt.seq_len = seq;
  dopt.seed = 5;
  return TokenDataset(TokenSource::from_text(builtin_text(1 << 18, 1), "built-in"), dopt);
}

template <class B>
std::vector<StepStats> train(B& be, int steps, std::size_t* spilled = nullptr, bool profile = false,
                             TrainerOptions opt = options(), std::vector<float>* weights = nullptr,
                             std::size_t* device_units = nullptr, const ModelConfig& cfg = small(), bool padded = false) {
  opt.profile = profile;
  DecoderModel<> model(cfg);
  StoreOptions so;
  so.seed = 3;
  HostParamStore<float> store(model.units(), Trainer<B>::store_options(opt, so));
  Trainer<B> trainer(model, store, be, opt);
  if (spilled) *spilled = trainer.spilled_checkpoints();
  TokenDataset data = builtin_data(opt.seq_len);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(opt.batch_rows * opt.seq_len)), labels(ids.size());
  std::vector<StepStats> out;
  std::vector<std::uint8_t> mask(padded ? ids.size() : 0, 1);
  for (int s = 0; s < steps; ++s) {
    data.train_batch(s * opt.batch_rows, opt.batch_rows, ids, labels);
    if (padded)  // (row r ends in (3 r + s) % 5 tokens of padding: no label, 0 in the attention mask)
      for (std::int64_t r = 0; r < opt.batch_rows; ++r)
        for (std::int64_t c = 0; c < opt.seq_len; ++c) {
          const auto i = static_cast<std::size_t>(r * opt.seq_len + c);
          mask[i] = c < opt.seq_len - (3 * r + s) % 5 ? 1 : 0;
          if (mask[i] == 0) labels[i] = kIgnoreIndex;
        }
    out.push_back(trainer.step(ids, labels, {}, mask));
  }
  if (device_units) *device_units = trainer.device_units();
  trainer.finish_update();
  if (weights)  // (the state, and the bf16 copy: a device block's is made from its masters when saved;
                // without a copy in host memory, the masters rounded as the GPU rounds them)
    for (const auto& u : store.units()) {
      for (auto sl : {u.master(), u.adam_m(), u.adam_v()}) weights->insert(weights->end(), sl.begin(), sl.end());
      if (u.compute().empty())
        for (const float x : u.master()) weights->push_back(static_cast<float>(bf16(x)));
      for (const bf16 x : u.compute()) weights->push_back(static_cast<float>(x));
    }
  return out;
}

// Steps that alternate two objectives (train/objective.hpp): an advantage-like weight per token
// (each row's own, positive), and a preference between the rows of each pair, which reads the
// step's log-probabilities. At step 5 the batch is scored first (Trainer::score), and the
// step's own log-probabilities kept.
template <class B>
std::vector<StepStats> train_objectives(B& be, std::vector<double>& scored, std::vector<double>& trained) {
  auto opt = options();
  opt.token_weights = opt.log_prob_objective = true;
  opt.clip_mode = ClipMode::exact;
  opt.micro_batches = 2;
  DecoderModel<> model(small());
  StoreOptions so;
  so.seed = 3;
  HostParamStore<float> store(model.units(), Trainer<B>::store_options(opt, so));
  Trainer<B> trainer(model, store, be, opt);
  TokenDataset data = builtin_data(opt.seq_len);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(opt.batch_rows * opt.seq_len)), labels(ids.size());
  const test::PairPreference preference(opt.batch_rows);
  std::vector<StepStats> out;
  for (int s = 0; s < 10; ++s) {
    data.train_batch(s * opt.batch_rows, opt.batch_rows, ids, labels);
    if (s == 5) scored = trainer.score(ids, labels, opt.batch_rows);
    std::vector<float> w(ids.size());
    for (std::size_t t = 0; t < w.size(); ++t)
      w[t] = static_cast<float>(1 + (t / static_cast<std::size_t>(opt.seq_len)) % 3) / static_cast<float>(2 * w.size());
    out.push_back(s % 2 == 0 ? trainer.step(TokenWeighted(w), ids, labels) : trainer.step(preference, ids, labels));
    if (s == 5) trained = trainer.last_log_probs();
  }
  trainer.finish_update();
  return out;
}

/// 6 steps of cfg on the CPU, and twice on the GPU (the second keeping `kept` blocks' activations,
/// o.kept_blocks): the GPU's losses finite, within 2% of the CPU's (bf16, and a few tokens routed
/// differently) and falling; the two GPU runs the same bits. Returns the CPU's steps and the GPU's.
std::pair<std::vector<StepStats>, std::vector<StepStats>> follows_cpu(const ModelConfig& cfg, std::int64_t kept) {
  auto opt = options();
  opt.clip_mode = ClipMode::exact;
  CpuBackend<float> cpu;
  const auto want = train(cpu, 6, nullptr, false, opt, nullptr, nullptr, cfg);
  CudaBackend gpu;
  std::vector<float> w1, w2;
  const auto got = train(gpu, 6, nullptr, false, opt, &w1, nullptr, cfg);
  for (std::size_t s = 0; s < want.size(); ++s) {
    CAPTURE(s);
    CHECK(std::isfinite(got[s].loss));
    CHECK(got[s].loss == doctest::Approx(want[s].loss).epsilon(0.02));
  }
  CHECK(got.back().loss < got.front().loss);
  auto o = opt;
  o.kept_blocks = kept;
  CudaBackend again;
  const auto rerun = train(again, 6, nullptr, false, o, &w2, nullptr, cfg);
  CHECK(w2 == w1);
  for (std::size_t s = 0; s < got.size(); ++s) CHECK(rerun[s].loss == got[s].loss);
  return {want, got};
}

}  // namespace

TEST_CASE("objectives on the GPU: a weighted and a preference objective follow the CPU; score() is the step's forward bit for bit") {
  std::vector<double> cpu_scored, cpu_trained, scored, trained;
  CpuBackend<float> cpu;
  const auto ref = train_objectives(cpu, cpu_scored, cpu_trained);
  CudaBackend gpu;
  const auto got = train_objectives(gpu, scored, trained);
  for (std::size_t s = 0; s < ref.size(); ++s) {
    CAPTURE(s);
    CHECK(std::fabs(got[s].loss - ref[s].loss) <= 0.02 * std::fabs(ref[s].loss) + 0.02);
  }
  CHECK(ref.back().loss < ref[1].loss);  // (the preference's loss falls)
  REQUIRE(scored.size() == trained.size());
  CHECK(std::memcmp(scored.data(), trained.data(), scored.size() * sizeof(double)) == 0);
  REQUIRE(cpu_scored.size() == cpu_trained.size());
  CHECK(std::memcmp(cpu_scored.data(), cpu_trained.data(), cpu_scored.size() * sizeof(double)) == 0);
  double worst = 0;  // the GPU's log-probabilities near the CPU's (bf16 weights and activations)
  for (std::size_t t = 0; t < scored.size(); ++t) worst = std::max(worst, std::fabs(scored[t] - cpu_scored[t]));
  MESSAGE("largest difference of a token's log-probability, GPU vs CPU: " << worst);
  CHECK(worst < 8 * 0x1p-8);  // (8 x bf16's epsilon; measured 0.0059 on an H100)
}

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
  test::check_timeline(got.back(), static_cast<std::size_t>(small().num_hidden_layers));
}

TEST_CASE("exact clipping and gradient accumulation on the GPU follow the CPU") {
  // Exact clipping: every gradient kept until the norm is known, each unit's norm summed on the
  // GPU (sum_squares). Gradients wait on the GPU (micro-batches add up there), or in host memory
  // (later micro-batches staged on the host and added up by the optimizer stage).
  for (const std::int64_t micro : {1, 2})
  for (const GradientHome home : {GradientHome::device, GradientHome::host}) {
    CAPTURE(micro);
    CAPTURE(home == GradientHome::device);
    auto o = options();
    o.clip_mode = ClipMode::exact;
    o.clip_norm = 0.5;
    o.micro_batches = micro;
    o.gradient_home = home;
    CpuBackend<float> cpu;
    const auto ref = train(cpu, 8, nullptr, false, o);
    CudaBackend gpu;
    const auto got = train(gpu, 8, nullptr, false, o);
    for (std::size_t s = 0; s < ref.size(); ++s) {
      CAPTURE(s);
      CHECK(std::fabs(got[s].loss - ref[s].loss) <= 0.02 * ref[s].loss + 0.02);
      CHECK(got[s].grad_norm == doctest::Approx(ref[s].grad_norm).epsilon(0.05));
      CHECK(got[s].clip_coef == doctest::Approx(ref[s].clip_coef).epsilon(0.05));
    }
    CHECK(ref.front().clip_coef < 1.0);  // clipping bites
    CHECK(got.back().loss < got.front().loss);
  }
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

TEST_CASE("a large vocabulary (gradients landing in pieces) trains the same on the GPU as on the CPU") {
  // Vocabulary 6007 x hidden 128 is about 3.8 decoder blocks: the embedding's untouched rows and
  // an untied head land in several pieces, and 8 x 512 tokens drawn from ~4900 ids touch about
  // 2900 rows, two pieces of them. Ids are text bytes spread by position, so there is a
  // pattern to learn.
  for (const bool tied : {true, false}) {
    CAPTURE(tied);
    auto cfg_json = nlohmann::json{{"architectures", {"LlamaForCausalLM"}}, {"hidden_size", 128}, {"intermediate_size", 344},
                                   {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                                   {"vocab_size", 6007}, {"tie_word_embeddings", tied}};
    const auto cfg = ModelConfig::from_json(cfg_json, "test");
    auto opt = options();
    opt.seq_len = 512;
    opt.chunk_rows = 0;
    const std::string text = builtin_text(1 << 16, 2);
    auto run = [&](auto& be, std::size_t* slot_numel) {
      using B = std::remove_reference_t<decltype(be)>;
      DecoderModel<> model(cfg);
      StoreOptions so;
      so.seed = 9;
      HostParamStore<float> store(model.units(), Trainer<B>::store_options(opt, so));
      *slot_numel = static_cast<std::size_t>(store.grad_slot_numel());
      Trainer<B> trainer(model, store, be, opt);
      const auto n = static_cast<std::size_t>(opt.batch_rows * opt.seq_len);
      std::vector<std::int32_t> ids(n), labels(n);
      std::vector<StepStats> out;
      for (int s = 0; s < 8; ++s) {
        for (std::size_t i = 0; i < n; ++i) {
          auto tok = [&](std::size_t k) {
            const auto at = (static_cast<std::size_t>(s) * n + k) % text.size();
            return static_cast<std::int32_t>(static_cast<unsigned char>(text[at]) + 256 * (k % 19));
          };
          ids[i] = tok(i);
          labels[i] = tok(i + 1);
        }
        out.push_back(trainer.step(ids, labels));
      }
      return out;
    };
    std::size_t cpu_slot = 0, gpu_slot = 0;
    CpuBackend<float> cpu;
    const auto ref = run(cpu, &cpu_slot);
    CudaBackend gpu;
    const auto got = run(gpu, &gpu_slot);
    CHECK(gpu_slot == cpu_slot);
    CHECK(gpu_slot * 3 < static_cast<std::size_t>(cfg.vocab_size * cfg.hidden_size));  // pieces do happen
    for (std::size_t s = 0; s < ref.size(); ++s) {
      CAPTURE(s);
      CHECK(std::fabs(got[s].loss - ref[s].loss) <= 0.02 * ref[s].loss + 0.02);
      CHECK(got[s].grad_norm == doctest::Approx(ref[s].grad_norm).epsilon(0.05));
    }
    CHECK(got.back().loss < got.front().loss);
  }
}

TEST_CASE("where AdamW runs and where gradients wait change no bit on the GPU") {
  // Gradients on the GPU or in host memory; AdamW on the host for every unit, for the first
  // three, or (auto, which on a GPU of this size takes them all) for every unit on the GPU. The
  // gradients are the same fp32 numbers, each unit's norm is summed on the GPU either way, and
  // the GPU's AdamW is the host's bit for bit: exact clipping and no clipping give the same
  // bits everywhere (stale clipping sums the norm in another order when units are on the GPU).
  for (const double clip : {0.5, 0.0}) {
    CAPTURE(clip);
    std::vector<std::vector<StepStats>> stats;
    std::vector<std::vector<float>> weights;
    struct Placement {
      GradientHome home;
      std::int64_t units;
    };
    for (const Placement pl : {Placement{GradientHome::device, 0}, Placement{GradientHome::device, 3},
                               Placement{GradientHome::device, TrainerOptions::kAutoDeviceUnits},
                               Placement{GradientHome::host, 0}, Placement{GradientHome::host, 3}}) {
      CAPTURE(pl.home == GradientHome::device);
      CAPTURE(pl.units);
      auto o = options();
      o.clip_mode = ClipMode::exact;
      o.clip_norm = clip;
      o.gradient_home = pl.home;
      o.device_units = pl.units;
      CudaBackend gpu;
      std::vector<float> w;
      std::size_t units = 0;
      stats.push_back(train(gpu, 6, nullptr, false, o, &w, &units));
      if (pl.units == TrainerOptions::kAutoDeviceUnits) CHECK(units == static_cast<std::size_t>(small().num_hidden_layers + 2));
      else CHECK(units == static_cast<std::size_t>(pl.units));
      weights.push_back(std::move(w));
    }
    for (std::size_t r = 1; r < stats.size(); ++r) {
      CAPTURE(r);
      CHECK(weights[r] == weights[0]);
      for (std::size_t s = 0; s < stats[0].size(); ++s) {
        CHECK(stats[r][s].loss == stats[0][s].loss);
        if (clip > 0) CHECK(stats[r][s].grad_norm == stats[0][s].grad_norm);
      }
    }
    if (clip > 0) CHECK(stats[0].front().clip_coef < 1.0);
  }
}

TEST_CASE("without a bf16 copy in host memory the GPU rounds the streamed masters: the same bits") {
  // TrainerOptions::host_bf16_copy false: each unit's fp32 masters cross PCIe in pieces of
  // plan::kMasterStagingElements through a staging buffer and are rounded there; the host's copy
  // was the same rounding. A vocabulary of 17,011 at hidden 1,024 makes the head's and the tied
  // embedding's units longer than one piece (17.4M elements), so they arrive in two.
  const ModelConfig wide = ModelConfig::from_json(nlohmann::json{{"architectures", {"Qwen2ForCausalLM"}},
                                                                 {"hidden_size", 1024},
                                                                 {"intermediate_size", 2816},
                                                                 {"num_hidden_layers", 3},
                                                                 {"num_attention_heads", 8},
                                                                 {"num_key_value_heads", 2},
                                                                 {"vocab_size", 17011},
                                                                 {"tie_word_embeddings", true}},
                                                  "test");
  REQUIRE(static_cast<std::size_t>(wide.vocab_size * wide.hidden_size) > plan::kMasterStagingElements);
  struct Mode {
    const char* name;
    ClipMode clip;
    GradientHome home;
    std::int64_t units;
  };
  for (const Mode m : {Mode{"stale clipping, every unit streamed", ClipMode::stale, GradientHome::device, 0},
                       Mode{"exact clipping, 2 device units", ClipMode::exact, GradientHome::device, 2},
                       Mode{"exact clipping, gradients in host memory", ClipMode::exact, GradientHome::host, 0}}) {
    CAPTURE(m.name);
    std::vector<std::vector<StepStats>> stats;
    std::vector<std::vector<float>> weights;
    for (const bool copy : {true, false}) {
      auto o = options();
      o.batch_rows = 4;
      o.seq_len = 32;
      o.chunk_rows = 0;
      o.clip_mode = m.clip;
      o.gradient_home = m.home;
      o.device_units = m.units;
      o.host_bf16_copy = copy;
      CudaBackend gpu;
      std::vector<float> w;
      stats.push_back(train(gpu, 4, nullptr, false, o, &w, nullptr, wide));
      weights.push_back(std::move(w));
    }
    CHECK(weights[1] == weights[0]);
    for (std::size_t s = 0; s < stats[0].size(); ++s) CHECK(stats[1][s].loss == stats[0][s].loss);
  }
}

TEST_CASE("packed rows (examples of mixed lengths, attention within each) train on the GPU as on the CPU") {
  // Examples cut from the built-in text at random lengths, packed in order into rows of 64 with
  // a padding sequence in each row's free tail; the same batches on both backends.
  const std::string text = builtin_text(1 << 16, 2);
  std::mt19937 rng(9);
  auto opt = options();
  opt.packed = true;
  const auto seq = static_cast<std::size_t>(opt.seq_len), rows = static_cast<std::size_t>(opt.batch_rows);
  struct Batch {
    std::vector<std::int32_t> ids, labels, positions;
  };
  std::vector<Batch> batches;
  std::size_t at = 0;
  for (int b = 0; b < 30; ++b) {
    Batch x;
    while (x.ids.size() < rows * seq) {
      const std::size_t col = x.ids.size() % seq, n = 2 + rng() % 40;  // an example of n + 1 tokens
      if (col + n > seq) {  // no room: the rest of the row is padding
        for (std::size_t t = 0; col + t < seq; ++t) {
          x.ids.push_back(0);
          x.labels.push_back(kIgnoreIndex);
          x.positions.push_back(static_cast<std::int32_t>(t));
        }
        continue;
      }
      for (std::size_t t = 0; t < n; ++t) {
        x.ids.push_back(static_cast<unsigned char>(text[at + t]));
        x.labels.push_back(static_cast<unsigned char>(text[at + t + 1]));
        x.positions.push_back(static_cast<std::int32_t>(t));
      }
      at += n + 1;
    }
    batches.push_back(std::move(x));
  }
  const auto run = [&](auto& be) {
    DecoderModel<> model(small());
    StoreOptions so;
    so.seed = 3;
    using B = std::remove_reference_t<decltype(be)>;
    HostParamStore<float> store(model.units(), Trainer<B>::store_options(opt, so));
    Trainer<B> trainer(model, store, be, opt);
    std::vector<double> loss;
    for (const auto& b : batches) loss.push_back(trainer.step(b.ids, b.labels, b.positions).loss);
    loss.push_back(trainer.evaluate(batches[0].ids, batches[0].labels, opt.batch_rows, batches[0].positions));
    return loss;
  };
  CpuBackend<float> cpu;
  const auto ref = run(cpu);
  CudaBackend gpu;
  const auto got = run(gpu);
  double worst = 0;
  for (std::size_t s = 0; s < ref.size(); ++s) {
    CAPTURE(s);
    const double diff = std::fabs(got[s] - ref[s]);
    worst = std::max(worst, diff / ref[s]);
    CHECK(diff <= 0.02 * ref[s] + 0.02);
  }
  MESSAGE("packed rows: largest relative loss difference over 30 steps: " << worst);
  CHECK(ref[29] < 0.8 * ref[0]);
  CHECK(got[29] < 0.8 * got[0]);
}

TEST_CASE("GPU memory for a step grows linearly with the sequence length (token blocks, atomic-dQ attention)") {
  // One sequence of 2k..8k tokens: what the trainer allocates on the device grows by the same
  // amount for each 2k more (checkpoints, h, q/k/v and their gradients, attention workspace),
  // nothing grows with the square; a step runs at the longest.
  std::vector<double> bytes;
  for (const std::int64_t seq : {2048, 4096, 6144, 8192}) {
    CudaBackendOptions bo;
    bo.deterministic_attention_workspace = 0;  // (the deterministic backward's dP buffer is quadratic)
    CudaBackend be(bo);
    auto opt = options();
    opt.batch_rows = 1;
    opt.seq_len = seq;
    opt.chunk_rows = 0;
    opt.token_chunk = 512;
    opt.kept_blocks = 4;  // (fixed: the plan's choice may change with the length; kept activations grow linearly too)
    DecoderModel<> model(small());
    StoreOptions so;
    so.seed = 3;
    HostParamStore<float> store(model.units(), Trainer<CudaBackend>::store_options(opt, so));
    const std::size_t before = be.allocated_bytes();
    Trainer<CudaBackend> trainer(model, store, be, opt);
    bytes.push_back(static_cast<double>(be.allocated_bytes() - before));
    CHECK(be.allocated_bytes() - before == trainer.memory_plan().device_total());
    if (seq == 8192) {
      std::vector<std::int32_t> ids(static_cast<std::size_t>(seq)), labels(ids.size());
      for (std::size_t i = 0; i < ids.size(); ++i) {
        ids[i] = static_cast<std::int32_t>((i * 7) % 256);
        labels[i] = static_cast<std::int32_t>((i * 7 + 7) % 256);
      }
      CHECK(std::isfinite(trainer.step(ids, labels).loss));
    }
  }
  MESSAGE("device bytes at 2k/4k/6k/8k tokens: " << bytes[0] << " " << bytes[1] << " " << bytes[2] << " " << bytes[3]);
  const double step = bytes[1] - bytes[0];
  CHECK(step > 0);
  for (std::size_t i = 2; i < bytes.size(); ++i) CHECK(bytes[i] - bytes[i - 1] == doctest::Approx(step).epsilon(0.02));
}

TEST_CASE("the memory plan is the GPU trainer's allocation, byte for byte, and is known before it") {
  // What plan::plan_memory says before the store and the trainer exist (what megatrain-train and
  // megatrain-plan print) is what the trainer then allocates on the GPU, in every mode: cuDNN's
  // workspaces are the backend's own figure (CudaBackend::prepare_bytes).
  struct Case {
    const char* name;
    std::function<void(TrainerOptions&)> set;
  };
  const std::vector<Case> cases{
      {"stale clipping, every unit streamed", [](TrainerOptions&) {}},
      {"exact clipping, device units auto", [](TrainerOptions& o) {
         o.clip_mode = ClipMode::exact;
         o.device_units = TrainerOptions::kAutoDeviceUnits;
       }},
      {"exact clipping, gradients in host memory, 2 device units", [](TrainerOptions& o) {
         o.clip_mode = ClipMode::exact;
         o.gradient_home = GradientHome::host;
         o.device_units = 2;
       }},
      {"packed rows, micro-batches", [](TrainerOptions& o) {
         o.packed = true;
         o.micro_batches = 2;
       }},
      {"one long sequence in token blocks", [](TrainerOptions& o) {
         o.batch_rows = 1;
         o.seq_len = 4096;
         o.chunk_rows = 0;
         o.token_chunk = 1024;
       }},
      {"no bf16 copy in host memory (the masters rounded on the GPU), exact clipping, 2 device units",
       [](TrainerOptions& o) {
         o.clip_mode = ClipMode::exact;
         o.host_bf16_copy = false;
         o.device_units = 2;
       }},
      {"exact clipping, 3 blocks keep their activations", [](TrainerOptions& o) {
         o.clip_mode = ClipMode::exact;
         o.kept_blocks = 3;
       }},
      {"exact clipping, 1 block keeps its activations, 2 spill theirs to host memory", [](TrainerOptions& o) {
         o.clip_mode = ClipMode::exact;
         o.kept_blocks = 1;
         o.spilled_blocks = 2;
       }},
  };
  for (const Case& c : cases) {
    CAPTURE(c.name);
    auto opt = options();
    c.set(opt);
    CudaBackend be;
    DecoderModel<> model(small());
    const plan::HostBudget host{available_host_memory(), "test"};
    const plan::MemoryPlan before = plan::plan_memory<CudaBackend>(model, opt, plan::device_budget(be), host);
    REQUIRE(before.fits);
    StoreOptions so;
    so.seed = 3;
    HostParamStore<float> store(model.units(), Trainer<CudaBackend>::store_options(opt, so));
    const std::size_t b0 = be.allocated_bytes();
    Trainer<CudaBackend> trainer(model, store, be, opt);
    CHECK(be.allocated_bytes() - b0 == trainer.memory_plan().device_total());
    CHECK(trainer.memory_plan().device_total() == before.device_total());
    CHECK(trainer.device_units() == before.buffers.device_units);
    CHECK(trainer.memory_plan().buffers.kept_blocks == before.buffers.kept_blocks);
    CHECK(trainer.memory_plan().buffers.spilled_blocks == before.buffers.spilled_blocks);
  }
}

TEST_CASE("checkpoints every 2 or 3 blocks train the same bits on the GPU") {
  // The outputs between checkpoints are recomputed before the backward by the same kernels from
  // the same input: the same bits. (cuDNN's attention backward is deterministic at this size;
  // tests/plan covers checkpoints every k blocks in host memory.)
  auto opt = options();
  opt.clip_mode = ClipMode::exact;
  opt.checkpoint_every = 1;
  CudaBackend ref_gpu;
  std::vector<float> ref_w;
  const auto ref = train(ref_gpu, 4, nullptr, false, opt, &ref_w);
  for (const std::int64_t k : {2, 3}) {
    CAPTURE(k);
    auto o = opt;
    o.checkpoint_every = k;
    CudaBackend gpu;
    std::vector<float> w;
    const auto got = train(gpu, 4, nullptr, false, o, &w);
    CHECK(w == ref_w);
    for (std::size_t s = 0; s < ref.size(); ++s) {
      CHECK(got[s].loss == ref[s].loss);
      CHECK(got[s].grad_norm == ref[s].grad_norm);
    }
  }
}

TEST_CASE("blocks that keep their activations (on the GPU or spilled to host memory) train the same bits as blocks that recompute") {
  // Kept activations (TrainerOptions::kept_blocks): the backward reads the forward's q, k, v,
  // attention output, h, gate and up instead of computing them again, and recomputes only the
  // norms and SwiGLU's product with the same kernels: the same bits, in every layout. Spilled
  // ones (spilled_blocks) go to host memory and come back on streams of their own, through two
  // staging buffers: the same bits again (4 spilled blocks: each staging buffer reused by the
  // next block but one, its copies racing the compute if the ordering were wrong).
  struct Case {
    const char* name;
    std::function<void(TrainerOptions&)> set;
  };
  const std::vector<Case> cases{
      {"exact clipping, chunks", [](TrainerOptions& o) { o.clip_mode = ClipMode::exact; }},
      {"stale clipping, micro-batches, device units", [](TrainerOptions& o) {
         o.micro_batches = 2;
         o.device_units = 3;
       }},
      {"one long sequence in token blocks", [](TrainerOptions& o) {
         o.batch_rows = 1;
         o.seq_len = 4096;
         o.chunk_rows = 0;
         o.token_chunk = 1000;
       }},
  };
  for (const Case& c : cases) {
    CAPTURE(c.name);
    auto opt = options();
    c.set(opt);
    opt.kept_blocks = 0;
    opt.spilled_blocks = 0;
    CudaBackend ref_gpu;
    std::vector<float> ref_w;
    const auto ref = train(ref_gpu, 4, nullptr, false, opt, &ref_w);
    for (const auto& [n, spilled] : {std::pair<std::int64_t, std::int64_t>{2, 0}, {4, 0}, {0, 4}, {1, 2}}) {
      CAPTURE(n);
      CAPTURE(spilled);
      auto o = opt;
      o.kept_blocks = n;
      o.spilled_blocks = spilled;
      CudaBackend gpu;
      DecoderModel<> model(small());
      const plan::MemoryPlan p =
          plan::plan_memory<CudaBackend>(model, o, plan::device_budget(gpu), {available_host_memory(), "test"});
      REQUIRE(p.buffers.kept_blocks == static_cast<std::size_t>(n));
      REQUIRE(p.buffers.spilled_blocks == static_cast<std::size_t>(spilled));
      // (exact clipping: a kept block's activations lie over the waiting gradients of blocks below it)
      if (o.clip_mode == ClipMode::exact && n >= 2) CHECK(p.buffers.kept_over_gradients > 0);
      // (spilled: also with every copy held back 3 ms on its stream, so that the compute stream
      // would read or overwrite a staging buffer early were any wait missing)
      for (const bool delayed : {false, true}) {
        if (delayed && spilled == 0) continue;
        CAPTURE(delayed);
        if (delayed) ::setenv("MEGATRAIN_FAULTS", "delay@spill=3000", 1);
        std::vector<float> w;
        const auto got = train(gpu, 4, nullptr, false, o, &w);
        ::unsetenv("MEGATRAIN_FAULTS");
        CHECK(w == ref_w);
        for (std::size_t s = 0; s < ref.size(); ++s) {
          CHECK(got[s].loss == ref[s].loss);
          CHECK(got[s].grad_norm == ref[s].grad_norm);
        }
      }
    }
  }
}

TEST_CASE("Gemma 3 on the GPU: sliding and full layers, kept activations the same bits, losses near the CPU's") {
  // 4 layers, sliding (window 16 of 64 tokens) except the last; sandwich (1 + w) norms, GeGLU, the
  // scaled embedding, query_pre_attn_scalar. Kept activations must repeat the recomputing run's
  // bits (weights and AdamW states); bf16 keeps the losses within 2% of the fp32 CPU's.
  const auto gemma = ModelConfig::from_json(
      nlohmann::json{{"architectures", {"Gemma3ForCausalLM"}}, {"hidden_size", 128}, {"intermediate_size", 344},
                     {"num_hidden_layers", 4}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"head_dim", 32},
                     {"vocab_size", 256}, {"query_pre_attn_scalar", 48}, {"sliding_window", 16},
                     {"layer_types", {"sliding_attention", "sliding_attention", "sliding_attention", "full_attention"}}},
      "gemma3 test");
  auto opt = options();
  opt.clip_mode = ClipMode::exact;
  CpuBackend<float> cpu;
  const auto want = train(cpu, 6, nullptr, false, opt, nullptr, nullptr, gemma);
  CudaBackend ref_gpu;
  std::vector<float> ref_w;
  const auto ref = train(ref_gpu, 6, nullptr, false, opt, &ref_w, nullptr, gemma);
  for (std::size_t s = 0; s < want.size(); ++s) {
    CAPTURE(s);
    CHECK(std::isfinite(ref[s].loss));
    CHECK(ref[s].loss == doctest::Approx(want[s].loss).epsilon(0.02));
  }
  CHECK(ref.back().loss < ref.front().loss);
  auto o = opt;
  o.kept_blocks = 3;
  CudaBackend gpu;
  std::vector<float> w;
  const auto got = train(gpu, 6, nullptr, false, o, &w, nullptr, gemma);
  CHECK(w == ref_w);
  for (std::size_t s = 0; s < ref.size(); ++s) CHECK(got[s].loss == ref[s].loss);
}

TEST_CASE("Qwen3.5, Qwen3.5-MoE and Qwen3-Next on the GPU: losses near the CPU's, kept activations the same bits") {
  // 4 layers, linear attention (Gated DeltaNet) on 0, 1 and 2, gated full attention on 3; the
  // MoE variants' every layer a mixture of 6 experts (top 2) with a shared expert; Qwen3-Next's
  // linear attention with its fused projections.
  const auto hybrid = [](const char* arch) {
    const bool moe = std::string(arch) != "Qwen3_5ForCausalLM";
    nlohmann::json j{{"architectures", {arch}}, {"hidden_size", 128},
                     {"intermediate_size", 344}, {"num_hidden_layers", 4}, {"num_attention_heads", 4},
                     {"num_key_value_heads", 2}, {"head_dim", 32}, {"vocab_size", 256}, {"linear_num_key_heads", 2},
                     {"linear_num_value_heads", 4}, {"linear_key_head_dim", 32}, {"linear_value_head_dim", 48},
                     {"linear_conv_kernel_dim", 4}, {"full_attention_interval", 4}, {"partial_rotary_factor", 0.25}};
    if (moe)
      j.update({{"num_experts", 6}, {"num_experts_per_tok", 2}, {"moe_intermediate_size", 72},
                {"shared_expert_intermediate_size", 96}});
    return ModelConfig::from_json(j, "qwen3.5 test");
  };
  for (const char* arch : {"Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM"}) {
    CAPTURE(arch);
    follows_cpu(hybrid(arch), 2);
  }
}

TEST_CASE("next_logits on the GPU: each row's logits after its position near the CPU trainer's, dense and hybrid") {
  // (megatrain-generate's source of logits: the streaming forward, the head at one position a row)
  nlohmann::json hybrid{{"architectures", {"Qwen3_5ForCausalLM"}}, {"hidden_size", 128}, {"intermediate_size", 344},
                        {"num_hidden_layers", 4}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"head_dim", 32},
                        {"vocab_size", 301}, {"linear_num_key_heads", 2}, {"linear_num_value_heads", 4},
                        {"linear_key_head_dim", 32}, {"linear_value_head_dim", 48}, {"linear_conv_kernel_dim", 4},
                        {"full_attention_interval", 4}, {"partial_rotary_factor", 0.25}, {"tie_word_embeddings", false}};
  for (const ModelConfig& cfg : {small(), ModelConfig::from_json(hybrid, "qwen3.5 test")}) {
    CAPTURE(cfg.architecture_name());
    TrainerOptions o = options();
    o.batch_rows = 3;
    o.seq_len = 37;
    o.chunk_rows = 0;
    std::mt19937 g(23);
    std::vector<std::int32_t> ids(3 * 37);
    for (auto& id : ids) id = static_cast<std::int32_t>(g() % static_cast<unsigned>(cfg.vocab_size));
    const std::vector<std::int64_t> at{36, 0, 17};
    const auto logits = [&](auto& be) {
      using B = std::remove_reference_t<decltype(be)>;
      DecoderModel<> model(cfg);
      HostParamStore<float> store(model.units(), Trainer<B>::store_options(o, test::store_opts(o)));
      Trainer<B> trainer(model, store, be, o);
      return trainer.next_logits(ids, 3, at);
    };
    CpuBackend<float> cpu;
    CudaBackend gpu;
    const std::vector<float> want = logits(cpu), got = logits(gpu);
    REQUIRE(got.size() == want.size());
    double num = 0, den = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      REQUIRE(std::isfinite(got[i]));
      num += (got[i] - want[i]) * (got[i] - want[i]);
      den += static_cast<double>(want[i]) * want[i];
    }
    CHECK(std::sqrt(num / den) < 8 * 0x1p-8);  // (bf16's epsilon: its matrices and activations)
    CHECK(den > 0);
  }
}

TEST_CASE("mixtures of experts (GPT-OSS too) on the GPU: losses near the CPU's, the same bits on every run") {
  // Qwen3-MoE (a dense layer among sparse ones, renormalised top 2 of 8) and Mixtral (top 2 of 6),
  // 4 layers. The routing of a few tokens may differ between bf16 and fp32, so the losses are
  // compared within 2%; two GPU runs (and kept activations) must give the same bits.
  // The third: Qwen3-MoE with the auxiliary load-balancing loss (output_router_logits). The
  // fourth: GPT-OSS (attention sinks, sliding and full layers, biased router and experts, the
  // clamped SwiGLU; top 2 of 6).
  const auto moe = [](const std::string& arch, bool aux) {
    nlohmann::json j{{"architectures", {arch}}, {"hidden_size", 128}, {"intermediate_size", 200},
                     {"num_hidden_layers", 4}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"head_dim", 32},
                     {"vocab_size", 256}, {"num_experts_per_tok", 2}};
    if (arch == "Qwen3MoeForCausalLM")
      j.update({{"num_experts", 8}, {"moe_intermediate_size", 72}, {"norm_topk_prob", true}, {"mlp_only_layers", {2}}});
    else if (arch == "GptOssForCausalLM")
      j.update({{"num_local_experts", 6}, {"intermediate_size", 88}, {"sliding_window", 12}});
    else
      j.update({{"num_local_experts", 6}, {"intermediate_size", 88}});
    if (aux) j.update({{"output_router_logits", true}, {"router_aux_loss_coef", 0.1}});
    return ModelConfig::from_json(j, "moe test");
  };
  for (const auto& [arch, aux] : {std::pair{"Qwen3MoeForCausalLM", false}, std::pair{"MixtralForCausalLM", false},
                                  std::pair{"Qwen3MoeForCausalLM", true}, std::pair{"GptOssForCausalLM", false}}) {
    CAPTURE(arch);
    CAPTURE(aux);
    const auto [want, got] = follows_cpu(moe(arch, aux), 2);
    for (std::size_t s = 0; s < want.size(); ++s) {
      CAPTURE(s);
      CHECK(got[s].aux_loss == doctest::Approx(want[s].aux_loss).epsilon(0.02));
      REQUIRE(got[s].expert_load.size() == want[s].expert_load.size());
    }
  }
  // Rows padded at their end, the padding left out of the auxiliary loss by the attention mask:
  // near the CPU's (the mask's exact semantics are the CPU's, checked against transformers), and
  // not the loss that counts the padding.
  const auto cfg = moe("Qwen3MoeForCausalLM", true);
  auto opt = options();
  opt.clip_mode = ClipMode::exact;
  CpuBackend<float> cpu;
  const auto want = train(cpu, 6, nullptr, false, opt, nullptr, nullptr, cfg, true);
  CudaBackend gpu;
  const auto got = train(gpu, 6, nullptr, false, opt, nullptr, nullptr, cfg, true);
  CudaBackend gpu2;
  const auto unpadded = train(gpu2, 6, nullptr, false, opt, nullptr, nullptr, cfg);
  for (std::size_t s = 0; s < want.size(); ++s) {
    CAPTURE(s);
    CHECK(got[s].loss == doctest::Approx(want[s].loss).epsilon(0.02));
    CHECK(got[s].aux_loss == doctest::Approx(want[s].aux_loss).epsilon(0.02));
    CHECK(got[s].aux_loss != unpadded[s].aux_loss);
  }
}

namespace {
/// The GPU backend with a NaN planted in the embedding's gradient while `armed` (a gradient gone
/// non-finite in the backward while the loss is finite).
struct NanGradientCuda : CudaBackend {
  bool armed = false;
  void embedding_backward(View<const std::int32_t> ids, View<const Res> dy, View<Acc> dtable, std::int32_t skip_id = -1,
                          double scale = 1.0) {
    CudaBackend::embedding_backward(ids, dy, dtable, skip_id, scale);
    static const float nan = std::numeric_limits<float>::quiet_NaN();
    if (armed)
      MT_CUDA_CHECK(cudaMemcpyAsync(dtable.data() + dtable.numel() / 2, &nan, sizeof nan, cudaMemcpyHostToDevice, stream()));
  }
};
}  // namespace

TEST_CASE("a non-finite gradient on the GPU changes no weight and no AdamW state: stop, or skip as if the batch were left out") {
  const auto cfg = small();
  DatasetOptions dopt;
  dopt.vocab_size = 256;
  dopt.seq_len = options().seq_len;
  dopt.seed = 5;
  TokenDataset data(TokenSource::from_text(builtin_text(1 << 18, 1), "built-in"), dopt);
  const auto batch = [&](int i) {
    std::vector<std::int32_t> ids(static_cast<std::size_t>(options().batch_rows * options().seq_len)), labels(ids.size());
    data.train_batch(i * options().batch_rows, options().batch_rows, ids, labels);
    return std::pair{ids, labels};
  };
  for (const std::int64_t units : {std::int64_t{0}, TrainerOptions::kAutoDeviceUnits}) {
    CAPTURE(units);
    auto o = options();
    o.clip_mode = ClipMode::exact;
    o.device_units = units;
    o.schedule = {LrSchedule::Kind::constant, 2e-3, 0, 0, 0.0};
    DecoderModel<> model(cfg);
    StoreOptions so;
    so.seed = 3;
    // stop: the state after step 2 stays, bit for bit
    {
      HostParamStore<float> store(model.units(), Trainer<NanGradientCuda>::store_options(o, so));
      NanGradientCuda gpu;
      Trainer<NanGradientCuda> trainer(model, store, gpu, o);
      for (int i = 0; i < 2; ++i) {
        const auto [ids, labels] = batch(i);
        (void)trainer.step(ids, labels);
      }
      trainer.finish_update();
      const auto good = megatrain::test::state_of(store);
      gpu.armed = true;
      const auto [ids, labels] = batch(2);
      CHECK_THROWS_WITH_AS(trainer.step(ids, labels), doctest::Contains("step 3: the gradient is not finite"), Error);
      CHECK(trainer.stopped_with_last_good_state());
      trainer.finish_update();
      CHECK(megatrain::test::state_of(store) == good);
    }
    // skip: steps 1, 2, (3 skipped), 4, 5 are bit for bit steps 1, 2, 4, 5 without batch 3
    std::vector<std::vector<float>> finals;
    for (const bool with_skip : {true, false}) {
      auto q = o;
      q.on_nonfinite = NonFinite::skip;
      HostParamStore<float> store(model.units(), Trainer<NanGradientCuda>::store_options(q, so));
      NanGradientCuda gpu;
      Trainer<NanGradientCuda> trainer(model, store, gpu, q);
      for (int i = 0; i < 5; ++i) {
        if (!with_skip && i == 2) continue;
        gpu.armed = with_skip && i == 2;
        const auto [ids, labels] = batch(i);
        const StepStats st = trainer.step(ids, labels);
        CHECK(st.skipped == gpu.armed);
      }
      trainer.finish_update();
      CHECK(trainer.skipped_steps() == (with_skip ? 1 : 0));
      finals.push_back(megatrain::test::state_of(store));
    }
    CHECK(finals[0] == finals[1]);
  }
}
