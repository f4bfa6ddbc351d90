// example-objective: objectives at the head and the scoring pass (docs/training.md#objectives).
//
// A tiny model on the CPU backend. Two rows hold two answers to the same prompt. The example
// scores both (Trainer::score), then trains with two objectives of the library's interface:
//   1. TokenWeighted: an advantage-weighted policy gradient, +1 for the first answer's tokens and
//      -1 for the second's (divided by the tokens counted);
//   2. PreferFirst, defined below: a preference between the rows, L = softplus(-(S_0 - S_1)) with
//      S_r the sum of row r's log-probabilities; its weights need the step's own log p.
// Each must raise the first answer's log-probability above the second's; the example exits with
// status 1 if one does not.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/train/cpu_trainer.hpp"
#include "megatrain/train/objective.hpp"

using namespace megatrain;

namespace {

// Rows 0 and 1: a preferred and a rejected answer.
class PreferFirst final : public Objective {
 public:
  std::string name() const override { return "prefer-first"; }
  bool needs_log_probs() const override { return true; }
  void weights(const ObjectiveRows& r, std::span<float> w) const override {
    const double s = 1 / (1 + std::exp(margin(r)));  // -dL/dS_0 = sigmoid(-(S_0 - S_1)) = dL/dS_1
    for (std::size_t t = 0; t < w.size(); ++t)
      w[t] = r.labels[t] == kIgnoreIndex ? 0.0f : static_cast<float>(t < static_cast<std::size_t>(r.seq_len) ? s : -s);
  }
  double value(const ObjectiveRows& r) const override { return std::log1p(std::exp(-margin(r))); }

 private:
  static double margin(const ObjectiveRows& r) {  // S_0 - S_1
    double m = 0;
    for (std::size_t t = 0; t < r.log_probs.size(); ++t) m += t < static_cast<std::size_t>(r.seq_len) ? r.log_probs[t] : -r.log_probs[t];
    return m;
  }
};

// The sum of each row's log-probabilities.
std::vector<double> row_sums(const std::vector<double>& lp, std::int64_t seq) {
  std::vector<double> s(lp.size() / static_cast<std::size_t>(seq), 0.0);
  for (std::size_t t = 0; t < lp.size(); ++t) s[t / static_cast<std::size_t>(seq)] += lp[t];
  return s;
}

}  // namespace

int main() {
  const auto cfg = ModelConfig::from_json(nlohmann::json::parse(R"({"architectures":["Qwen2ForCausalLM"],
    "hidden_size":32,"intermediate_size":64,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
    "vocab_size":64,"rope_theta":10000.0,"tie_word_embeddings":true})"));
  constexpr std::int64_t kSeq = 12, kPrompt = 4;
  TrainerOptions opt;
  opt.batch_rows = 2;
  opt.seq_len = kSeq;
  opt.token_weights = opt.log_prob_objective = true;  // (objectives with a weight per token, one from its log p)
  opt.adamw.lr = 1e-2;
  opt.schedule = {LrSchedule::Kind::constant, 1e-2, 0, 0, 0};
  DecoderModel<> model(cfg);
  StoreOptions so;
  so.seed = 3;
  HostParamStore<float> store(model.units(), Trainer<CpuBackend<float>>::store_options(opt, so));
  CpuBackend<float> backend;
  Trainer<CpuBackend<float>> trainer(model, store, backend, opt);

  // The same prompt, then two answers; labels on the answers only (the next token).
  std::mt19937 rng(11);
  std::vector<std::int32_t> ids(2 * kSeq), labels(2 * kSeq, kIgnoreIndex);
  for (std::int64_t c = 0; c < kSeq; ++c) ids[c] = ids[kSeq + c] = static_cast<std::int32_t>(rng() % 64);
  for (std::int64_t c = kPrompt; c < kSeq; ++c) ids[kSeq + c] = static_cast<std::int32_t>(rng() % 64);
  for (std::int64_t r = 0; r < 2; ++r)
    for (std::int64_t c = kPrompt - 1; c + 1 < kSeq; ++c) labels[r * kSeq + c] = ids[r * kSeq + c + 1];

  const auto margin = [&] {
    const auto s = row_sums(trainer.score(ids, labels, 2), kSeq);
    return s[0] - s[1];
  };
  bool ok = true;
  const auto report = [&](const char* what, double before, double after) {
    std::printf("%-34s S_0 - S_1: %+8.3f -> %+8.3f\n", what, before, after);
    ok = ok && after > before + 1.0;
  };

  // 1. An advantage-weighted policy gradient: +1 for the first answer, -1 for the second.
  std::vector<float> adv(ids.size(), 0.0f);
  for (std::size_t t = 0; t < adv.size(); ++t)
    if (labels[t] != kIgnoreIndex) adv[t] = (t < static_cast<std::size_t>(kSeq) ? 1.0f : -1.0f) / (2.0f * (kSeq - kPrompt));
  double before = margin();
  for (int s = 0; s < 10; ++s) trainer.step(TokenWeighted(adv), ids, labels);
  report("advantage-weighted (TokenWeighted)", before, margin());

  // 2. A preference objective of our own, from the step's own log-probabilities.
  before = margin();
  double loss = 0;
  for (int s = 0; s < 10; ++s) loss = trainer.step(PreferFirst{}, ids, labels).loss;
  report("preference (PreferFirst)", before, margin());
  std::printf("last preference loss %.4f (softplus of minus the margin before that step)\n", loss);
  trainer.finish_update();
  if (!ok) std::printf("FAILED: an objective did not raise the first answer's log-probability\n");
  return ok ? 0 : 1;
}
