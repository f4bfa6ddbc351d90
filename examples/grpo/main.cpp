// example-grpo: a GRPO loop of one's own with megatrain's pieces (docs/rl.md).
//
// A tiny model over bytes on the CPU backend, from random weights. Each step samples G
// completions of each of two prompts (generate::generate over the trainer), scores them with
// rewards from JSON records (the answer a regular expression finds, and a format), turns the
// rewards into group advantages, and takes a GRPO step. The example prints each step's mean reward
// and exits with status 1 unless the model learns to answer: the mean reward of the last 10 steps
// must exceed the first 10 steps' by at least 0.5 (1.25 is every completion right).
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/generate/generator.hpp"
#include "megatrain/rl/rewards.hpp"
#include "megatrain/rl/rollouts.hpp"
#include "megatrain/train/cpu_trainer.hpp"
#include "megatrain/train/grpo.hpp"

using namespace megatrain;

namespace {
// A completion for the terminal: bytes outside printable ASCII as '?'.
std::string printable(std::string s) {
  for (char& c : s)
    if (c < 32 || c > 126) c = '?';
  return s;
}
}  // namespace

int main() {
  constexpr std::int64_t kGroup = 8, kNew = 4, kVocab = 128;  // (ASCII bytes)
  // The data: records as JSONL gives them, a prompt and the answer the reward compares with.
  const std::vector<nlohmann::json> records = {{{"prompt", "n="}, {"answer", "7"}}, {{"prompt", "k="}, {"answer", "3"}}};
  const auto P = static_cast<std::int64_t>(records.size()), rows = P * kGroup;
  std::int64_t longest = 0;
  for (const auto& r : records) longest = std::max<std::int64_t>(longest, static_cast<std::int64_t>(r["prompt"].get<std::string>().size()));
  const std::int64_t seq = longest + kNew;

  auto cfg = nlohmann::json::parse(R"({"architectures":["Qwen2ForCausalLM"],"hidden_size":48,"intermediate_size":96,
    "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"rope_theta":10000.0,"tie_word_embeddings":false})");
  cfg["vocab_size"] = kVocab;
  DecoderModel<> model(ModelConfig::from_json(cfg, "example"));
  TrainerOptions opt;
  opt.batch_rows = rows;
  opt.seq_len = seq;
  opt.token_weights = opt.log_prob_objective = true;  // (GRPO reads the step's log-probabilities)
  opt.schedule = {LrSchedule::Kind::constant, 5e-3, 0, 0, 0};
  StoreOptions so;
  so.seed = 5;
  HostParamStore<float> store(model.units(), Trainer<CpuBackend<float>>::store_options(opt, so));
  CpuBackend<float> be;
  Trainer<CpuBackend<float>> trainer(model, store, be, opt);

  // The rewards: the answer is the completion's last digit (1), and a completion of digits alone (0.25).
  rl::RewardSum rewards;
  rewards.add(std::make_unique<rl::AnswerReward>("(\\d)"), 1.0);
  rewards.add(std::make_unique<rl::FormatReward>("\\d+"), 0.25);

  std::vector<std::vector<std::int32_t>> prompts;  // each prompt G times
  for (const auto& r : records)
    for (std::int64_t k = 0; k < kGroup; ++k) {
      const std::string p = r["prompt"];
      prompts.emplace_back(p.begin(), p.end());
    }
  generate::GenerationOptions gen;
  gen.max_new_tokens = kNew;
  GrpoOptions grpo;  // (TRL's defaults: dapo, epsilon 0.2, no KL)
  std::vector<double> means;
  for (int step = 0; step < 100; ++step) {
    gen.sampling.seed = static_cast<std::uint64_t>(step);
    const auto done = generate::generate(trainer, {rows, seq, kVocab, 0}, prompts, gen);
    // Score: each completion as text beside its record.
    std::vector<std::string> texts;
    for (const auto& c : done) texts.emplace_back(c.tokens.begin(), c.tokens.end());
    std::vector<rl::Scored> batch;
    for (std::int64_t i = 0; i < rows; ++i) {
      const auto& rec = records[static_cast<std::size_t>(i / kGroup)];
      batch.push_back({&rec, rec["prompt"].get_ref<const std::string&>(), texts[static_cast<std::size_t>(i)]});
    }
    const rl::RewardSum::Scores s = rewards.score(batch);
    // The rows: each prompt and its completion, the completion's tokens as labels.
    std::vector<std::vector<std::int32_t>> completions;
    for (const auto& c : done) completions.push_back(c.tokens);
    const rl::RolloutRows batch_rows = rl::rollout_rows(prompts, completions, seq);
    const Advantages adv = group_advantages(s.total, kGroup, RewardScale::group);
    const StepStats st = trainer.step(Grpo(grpo, adv.values, {}, {}, rows), batch_rows.ids, batch_rows.labels);
    double mean = 0;
    for (const double r : s.total) mean += r / static_cast<double>(rows);
    means.push_back(mean);
    if (step % 20 == 0 || step == 99)
      std::printf("step %2d: mean reward %.3f (groups with equal rewards %lld of %lld), loss %.4f; n= '%s', k= '%s'\n", step,
                  mean, static_cast<long long>(adv.equal_groups), static_cast<long long>(adv.groups), st.loss,
                  printable(texts[0]).c_str(), printable(texts[kGroup]).c_str());
  }
  trainer.finish_update();
  double first = 0, last = 0;
  for (int i = 0; i < 10; ++i) {
    first += means[static_cast<std::size_t>(i)] / 10;
    last += means[means.size() - 1 - static_cast<std::size_t>(i)] / 10;
  }
  std::printf("mean reward: first 10 steps %.3f, last 10 %.3f\n", first, last);
  if (last < first + 0.5) {
    std::printf("FAILED: GRPO did not raise the reward\n");
    return 1;
  }
  return 0;
}
