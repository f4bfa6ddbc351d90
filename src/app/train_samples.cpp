// --sample-every's prompts and samples.jsonl (see train_samples.hpp).
#include "train_samples.hpp"

#include <fmt/format.h>

#include <fstream>

#include "megatrain/core/error.hpp"
#include "megatrain/io/detail/atomic_files.hpp"
#include "grpo_plan.hpp"  // run_tokenizer_source

namespace megatrain::app {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

/// A prompt as report.html shows it: its text, or the content of its conversation's last message.
std::string shown(const nlohmann::ordered_json& r) {
  if (r.contains("prompt")) return r["prompt"].get<std::string>();
  const auto& list = r.contains("messages") ? r["messages"] : r["conversations"];
  const auto& last = list.back();
  return last.value("content", last.value("value", std::string()));
}

}  // namespace

std::shared_ptr<const SamplePlan> plan_samples(const Settings& s, const RunPlan& plan, bool several_processes, bool eval_only) {
  MT_CHECK(s.sample_prompts.empty() || s.sample_every > 0, "--sample-prompts needs --sample-every N (every how many steps)");
  if (s.sample_every == 0) return nullptr;
  MT_CHECK(!s.sample_prompts.empty(), "--sample-every needs --sample-prompts FILE (JSONL: {{\"prompt\": text}} a line)");
  MT_CHECK(!eval_only, "--sample-every samples during training; with --steps 0 there is none (use megatrain-generate)");
  MT_CHECK(!several_processes, "--sample-every with several processes is not supported yet: sample the checkpoints with "
           "megatrain-generate --checkpoint");
  const fs::path dir = run_tokenizer_source(s, plan);
  std::error_code ec;
  MT_CHECK(!dir.empty(), "--sample-prompts needs the model's tokenizer: --model DIR (with tokenizer.json) or --tokenizer");
  auto sp = std::make_shared<SamplePlan>();
  sp->tokenizer = std::make_shared<const text::Tokenizer>(fs::is_directory(dir, ec) ? text::Tokenizer::from_folder(dir)
                                                                                     : text::Tokenizer::from_file(dir));
  sp->prompts = read_prompts(s.sample_prompts, "--sample-prompts", *sp->tokenizer, s.chat_format);
  for (std::size_t i = 0; i < sp->prompts.ids.size(); ++i) {
    MT_CHECK(static_cast<std::int64_t>(sp->prompts.ids[i].size()) < s.seq, "--sample-prompts '{}': prompt {} has {} tokens, "
             "and a row holds {} (--seq), its completion at least one more: shorten it", s.sample_prompts, i + 1,
             sp->prompts.ids[i].size(), s.seq);
    sp->shown.push_back(shown(sp->prompts.records[i]));
  }
  sp->eos = eos_ids(fs::is_directory(dir, ec) ? dir : dir.parent_path(), *sp->tokenizer);
  return sp;
}

TrainSamples::TrainSamples(std::shared_ptr<const SamplePlan> plan, fs::path file, std::int64_t tokens, std::int64_t first_step)
    : plan_(std::move(plan)), file_(std::move(file)) {
  options_.max_new_tokens = tokens;
  options_.sampling.temperature = 0;  // (greedy: the steps' samples differ only where the model does)
  options_.eos = plan_->eos;
  std::error_code ec;
  if (first_step <= 1 || !fs::exists(file_, ec)) return;
  std::ifstream in(file_);
  std::string kept, line;
  while (std::getline(in, line)) {
    const json j = json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.is_object() && j.value("step", first_step) < first_step) kept += line + "\n";
  }
  io::detail::write_file_atomically(file_, kept);
}

std::string TrainSamples::append(std::int64_t step, const std::vector<generate::Completion>& done) {
  std::string lines;
  texts_.clear();
  for (std::size_t i = 0; i < done.size(); ++i) {
    const std::string text = completion_text(done[i], *plan_->tokenizer, {});
    lines += nlohmann::ordered_json{{"step", step},
                                    {"index", i},
                                    {"prompt", plan_->shown[i]},
                                    {"completion", text},
                                    {"completion_tokens", done[i].tokens.size()},
                                    {"finish_reason", generate::finish_name(done[i].finish)}}
                 .dump() + "\n";
    texts_.emplace_back(fmt::format("samples/{}", i), fmt::format("**prompt:** {}\n\n**completion:** {}", plan_->shown[i], text));
  }
  std::ofstream out(file_, std::ios::app);
  out << lines;
  out.flush();
  return out.good() ? std::string() : fmt::format("'{}' could not be written", file_.string());
}

}  // namespace megatrain::app
