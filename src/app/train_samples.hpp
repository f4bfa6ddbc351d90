// megatrain-train --sample-every N --sample-prompts FILE: greedy completions of fixed prompts by the
// model being trained, every N steps and after the last, so that a user sees it change
// (docs/generation.md). The prompts are read and checked before the run starts (plan_samples);
// TrainSamples makes the completions with the trainer itself (Trainer::next_logits) and appends
// them to samples.jsonl in the run folder, which report.html shows.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "megatrain/generate/generator.hpp"
#include "megatrain/text/tokenizer.hpp"
#include "prompts.hpp"
#include "run_plan.hpp"
#include "settings.hpp"

namespace megatrain::app {

/// The prompts of --sample-prompts, encoded, and what ends a completion.
struct SamplePlan {
  std::shared_ptr<const text::Tokenizer> tokenizer;
  Prompts prompts;
  std::vector<std::string> shown;  // each prompt as report.html shows it: its text, or its last message
  std::vector<std::int32_t> eos;
};

/// --sample-every's prompts, read and checked (the tokenizer: --tokenizer, else --model's, else the
/// resumed checkpoint's); null without --sample-every. Throws megatrain::Error for options that do
/// not go together and for a prompt that is not one or does not fit a row of --seq tokens.
std::shared_ptr<const SamplePlan> plan_samples(const Settings& s, const RunPlan& plan, bool several_processes, bool eval_only);

/// samples.jsonl of a run: a line a prompt at each sampled step.
class TrainSamples {
 public:
  /// A resumed run (first_step > 1) keeps the lines of the steps before it and drops the rest.
  TrainSamples(std::shared_ptr<const SamplePlan> plan, std::filesystem::path file, std::int64_t tokens, std::int64_t first_step);

  /// The completions of step `step` by `trainer` (a Trainer: its rows of seq tokens are the slots),
  /// appended; returns what went wrong writing them ("" if nothing).
  template <class T>
  std::string sample(T& trainer, std::int64_t step, std::int64_t vocab) {
    const generate::SlotShape shape{trainer.options().batch_rows, trainer.options().seq_len, vocab, 0};
    return append(step, generate::generate(trainer, shape, plan_->prompts.ids, options_));
  }
  const std::filesystem::path& file() const { return file_; }
  /// The last sampled step's completions as TensorBoard texts: tag samples/<index>, Markdown.
  const std::vector<std::pair<std::string, std::string>>& texts() const { return texts_; }

 private:
  std::string append(std::int64_t step, const std::vector<generate::Completion>& done);
  std::shared_ptr<const SamplePlan> plan_;
  std::filesystem::path file_;
  generate::GenerationOptions options_;
  std::vector<std::pair<std::string, std::string>> texts_;
};

}  // namespace megatrain::app
