// A GRPO run's prompts, tokenizer and rewards (grpo_plan.hpp).
#include "grpo_plan.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <cstdlib>
#include <utility>

#include "megatrain/core/digest.hpp"
#include "megatrain/core/error.hpp"
#include "prompts.hpp"

namespace megatrain::app {

namespace fs = std::filesystem;

std::string run_tokenizer_source(const Settings& s, const RunPlan& plan) {
  if (!s.tokenizer.empty()) return s.tokenizer;
  if (!s.model_dir.empty()) return s.model_dir;
  if (plan.resume) return plan.resume->ckpt.dir().string();
  return {};
}

namespace {

// The prompts of `path` (`option` in messages) as the rewards see them.
PromptSet read_set(const std::string& path, const char* option, const text::Tokenizer& tok, const std::string& chat_format) {
  Prompts p = read_prompts(path, option, tok, chat_format);
  PromptSet out;
  for (std::size_t i = 0; i < p.ids.size(); ++i) {
    const auto& r = p.records[i];
    out.text.push_back(r.contains("prompt") ? r["prompt"].get<std::string>() : text::utf8_lossy(tok.decode(p.ids[i], false)));
    out.records.push_back(nlohmann::json::parse(r.dump()));
  }
  out.ids = std::move(p.ids);
  return out;
}

// The last `n` prompts of `set`, moved out of it.
PromptSet split_tail(PromptSet& set, std::int64_t n) {
  PromptSet tail;
  const auto at = static_cast<std::ptrdiff_t>(set.size() - n);
  tail.records.assign(set.records.begin() + at, set.records.end());
  tail.ids.assign(set.ids.begin() + at, set.ids.end());
  tail.text.assign(set.text.begin() + at, set.text.end());
  set.records.resize(static_cast<std::size_t>(at));
  set.ids.resize(static_cast<std::size_t>(at));
  set.text.resize(static_cast<std::size_t>(at));
  return tail;
}

// The weights of --reward-weights ("1,0.2"), `count` of them (every one 1 where not given).
std::vector<double> reward_weights(const std::string& text, std::size_t count) {
  if (text.empty()) return std::vector<double>(count, 1.0);
  std::vector<double> w;
  std::size_t at = 0;
  while (at <= text.size()) {
    const std::size_t comma = std::min(text.find(',', at), text.size());
    const std::string x = text.substr(at, comma - at);
    char* end = nullptr;
    const double v = std::strtod(x.c_str(), &end);
    MT_CHECK(!x.empty() && end == x.c_str() + x.size() && std::isfinite(v), "--reward-weights '{}': '{}' is not a number "
             "(give one a reward, separated by commas: 1,0.2)", text, x);
    w.push_back(v);
    at = comma + 1;
  }
  MT_CHECK(w.size() == count, "--reward-weights gives {} weights for {} rewards (--reward-answer, --reward-format and "
           "--reward-command, of those given): give one a reward", w.size(), count);
  return w;
}

// The rewards of --reward-answer, --reward-format and --reward-command, weighted by --reward-weights.
void build_rewards(const Settings& s, GrpoPlan& g) {
  std::vector<std::pair<std::string, std::string>> given;  // (kind, argument) in order
  if (!s.reward_answer.empty()) given.emplace_back("answer", s.reward_answer);
  if (!s.reward_format.empty()) given.emplace_back("format", s.reward_format);
  if (!s.reward_command.empty()) given.emplace_back("command", s.reward_command);
  MT_CHECK(!given.empty(), "--objective grpo needs a reward: --reward-answer REGEX (the answer it finds, compared with each "
           "record's \"answer\"), --reward-format REGEX, or --reward-command CMD");
  MT_CHECK(std::isfinite(s.reward_timeout) && s.reward_timeout > 0, "--reward-timeout must be > 0 seconds (got {})",
           s.reward_timeout);
  const std::vector<double> w = reward_weights(s.reward_weights, given.size());
  auto sum = std::make_shared<rl::RewardSum>();
  for (std::size_t i = 0; i < given.size(); ++i) {
    const auto& [kind, arg] = given[i];
    try {
      if (kind == "answer") sum->add(std::make_unique<rl::AnswerReward>(arg), w[i]);
      else if (kind == "format") sum->add(std::make_unique<rl::FormatReward>(arg), w[i]);
      else sum->add(std::make_unique<rl::CommandReward>(arg, s.reward_timeout), w[i]);
    } catch (const Error& e) {
      MT_FAIL("--reward-{} '{}': {}", kind, arg, e.reason());
    }
    g.reward_names.push_back(kind);
  }
  if (!s.reward_answer.empty())
    for (const PromptSet* set : {&g.train, &g.val})
      for (std::size_t k = 0; k < set->records.size(); ++k) {
        const auto& rec = set->records[k];
        MT_CHECK(rec.contains("answer") && (rec["answer"].is_string() || rec["answer"].is_number()),
                 "--reward-answer compares each completion's answer with its record's \"answer\", and {} prompt {} has {}",
                 set == &g.train ? "training" : "validation", k + 1,
                 rec.contains("answer") ? "one that is neither text nor a number" : "none");
      }
  g.rewards = std::move(sum);
}

}  // namespace

nlohmann::json grpo_record(const Settings& s, std::int64_t completion_tokens) {
  return {{"--generations", s.generations},
          {"--max-completion-tokens", completion_tokens},
          {"--top-k", s.top_k},
          {"--top-p", s.top_p},
          {"--min-p", s.min_p},
          {"--clip-eps", s.clip_eps},
          {"--clip-eps-high", s.origins.given("--clip-eps-high") ? s.clip_eps_high : s.clip_eps},
          {"--grpo-loss", s.grpo_loss},
          {"--scale-rewards", s.scale_rewards},
          {"--skip-equal-groups", s.skip_equal_groups},
          {"--reward-answer", s.reward_answer},
          {"--reward-format", s.reward_format},
          {"--reward-weights", s.reward_weights}};
}

std::shared_ptr<const GrpoPlan> plan_grpo(const Settings& s, const RunPlan& plan) {
  if (s.objective != "grpo") return nullptr;
  MT_CHECK(!s.data.empty(), "--objective grpo samples completions of prompts: give --data PROMPTS.jsonl ({{\"prompt\": text, "
           "\"answer\": ...}} or {{\"messages\": [...], ...}} a line)");
  const std::string source = run_tokenizer_source(s, plan);
  MT_CHECK(!source.empty(), "--objective grpo needs the model's tokenizer: --model DIR (with tokenizer.json) or --tokenizer");
  auto g = std::make_shared<GrpoPlan>();
  std::error_code ec;
  const bool folder = fs::is_directory(source, ec);
  g->tokenizer = std::make_shared<const text::Tokenizer>(folder ? text::Tokenizer::from_folder(source)
                                                                : text::Tokenizer::from_file(source));
  MT_CHECK(std::isfinite(s.val_fraction) && s.val_fraction >= 0 && s.val_fraction < 1,
           "--val-fraction must be in [0, 1) (got {})", s.val_fraction);
  g->train = read_set(s.data, "--data", *g->tokenizer, s.chat_format);
  if (!s.val_data.empty()) {
    g->val = read_set(s.val_data, "--val-data", *g->tokenizer, s.chat_format);
  } else if (s.val_fraction > 0 && g->train.size() > 1) {  // (the tail held out: at least one, and one left to train)
    const auto n = std::clamp<std::int64_t>(std::llround(s.val_fraction * static_cast<double>(g->train.size())), 1,
                                            g->train.size() - 1);
    g->val = split_tail(g->train, n);
  }
  MT_CHECK(g->val.size() > 0 || s.eval_every == 0, "--eval-every {} scores validation prompts, and there are none: give "
           "--val-data, a --val-fraction that holds some of --data's back, or --eval-every 0", s.eval_every);
  std::int64_t longest = 0;
  for (const PromptSet* set : {&g->train, &g->val})
    for (const auto& p : set->ids) longest = std::max<std::int64_t>(longest, static_cast<std::int64_t>(p.size()));
  MT_CHECK(longest < s.seq, "the longest prompt (of --data{}) has {} tokens, and a row holds {} (--seq), a completion at "
           "least one more: give a larger --seq", s.val_data.empty() ? "" : " and --val-data", longest, s.seq);
  g->completion_tokens = s.max_completion_tokens > 0 ? s.max_completion_tokens : s.seq - longest;
  MT_CHECK(longest + g->completion_tokens <= s.seq, "--max-completion-tokens {} and the longest prompt's {} tokens are more "
           "than a row's {} (--seq): give a larger --seq or fewer completion tokens", g->completion_tokens, longest, s.seq);
  g->eos = eos_ids(folder ? fs::path(source) : fs::path(source).parent_path(), *g->tokenizer);
  build_rewards(s, *g);
  std::string all;  // (the prompts' identity: their records and ids, training then validation)
  for (const PromptSet* set : {&g->train, &g->val}) {
    for (std::size_t i = 0; i < set->ids.size(); ++i) {
      all += set->records[i].dump();
      all.append(reinterpret_cast<const char*>(set->ids[i].data()), set->ids[i].size() * sizeof(std::int32_t));
    }
    all += '\n';
  }
  g->identity = {{"prompts_digest", digest_of(std::as_bytes(std::span(all.data(), all.size()))).hex()},
                 {"train_prompts", g->train.size()},
                 {"val_prompts", g->val.size()},
                 {"label", s.data},
                 {"grpo", grpo_record(s, g->completion_tokens)}};
  return g;
}

}  // namespace megatrain::app
