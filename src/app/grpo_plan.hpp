// megatrain-train --objective grpo (docs/rl.md): what a GRPO run starts from, read and checked
// before anything is written: its prompts (training and validation), the tokenizer that encodes
// them and decodes the completions, the ids that end a completion, the rewards, and the tokens a
// completion may take.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "megatrain/data/token_dataset.hpp"  // DataPosition
#include "megatrain/rl/rewards.hpp"
#include "megatrain/text/tokenizer.hpp"
#include "run_plan.hpp"
#include "settings.hpp"

namespace megatrain::app {

/// Prompts as a GRPO run uses them: each record (the rewards read its fields), its ids, and its text
/// as the rewards see it ("prompt", or the conversation rendered).
struct PromptSet {
  std::vector<nlohmann::json> records;
  std::vector<std::vector<std::int32_t>> ids;
  std::vector<std::string> text;
  std::int64_t size() const { return static_cast<std::int64_t>(ids.size()); }
};

struct GrpoPlan {
  std::shared_ptr<const text::Tokenizer> tokenizer;
  PromptSet train, val;
  std::vector<std::int32_t> eos;
  std::shared_ptr<const rl::RewardSum> rewards;
  std::vector<std::string> reward_names;  // each reward's name in the metrics (rewards/<name>)
  std::int64_t completion_tokens = 0;     // a completion's most tokens
  nlohmann::json identity;                // what the checkpoints record of the prompts
};

/// --objective grpo's inputs (null for another objective). The tokenizer: --tokenizer, else --model's,
/// else the resumed checkpoint's. Throws megatrain::Error naming the option, file and line of
/// whatever does not do: a prompt too long for --seq, a record without the field an answer reward
/// compares with, a regular expression that does not compile, options that do not go together.
std::shared_ptr<const GrpoPlan> plan_grpo(const Settings& s, const RunPlan& plan);

/// What a GRPO run's checkpoints record of its options beyond the trainer's (a resume must give
/// the same): the sampling, the policy loss and the built-in rewards. A reward program and its
/// timeout may change (a program that failed, mended).
nlohmann::json grpo_record(const Settings& s, std::int64_t completion_tokens);

/// Where the prompt order stands once `steps` steps have run (--batch / --generations prompts a
/// step, epoch after epoch of the training prompts, shuffled by --seed): what a checkpoint records.
inline DataPosition grpo_position(const GrpoPlan& g, const Settings& s, std::int64_t steps) {
  const std::int64_t n = g.train.size(), k = steps * (s.batch / s.generations);
  return {s.seed, k / n, k % n, n};
}

/// Where the run's tokenizer comes from: --tokenizer, else --model, else the resumed checkpoint
/// (empty where none is given).
std::string run_tokenizer_source(const Settings& s, const RunPlan& plan);

}  // namespace megatrain::app
