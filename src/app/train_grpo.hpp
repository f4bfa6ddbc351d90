// megatrain-train --objective grpo: reinforcement learning from rewards (docs/rl.md).
//
// Each step takes the next P = --batch / --generations prompts of the shuffled order (epoch after
// epoch, drawn from --seed), samples --generations completions of each with the weights as they
// are (the trainer's own sampler: generate/generator.hpp), scores every completion with the
// rewards (grpo_plan.hpp), turns the rewards into each group's advantages, and minimises
// megatrain::Grpo over the rows of prompt and completion (rl/rollouts.hpp). The draws of step t
// come from (--seed, t) alone, so a resumed run samples what the uninterrupted one did. A reward
// that fails (a program that exits non-zero, hangs or prints a malformed line) throws before the
// step: the weights and the checkpoints stay as they were.
#pragma once

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "megatrain/core/error.hpp"
#include "megatrain/data/shuffle.hpp"
#include "megatrain/data/token_dataset.hpp"  // DataPosition
#include "megatrain/generate/generator.hpp"
#include "megatrain/rl/rollouts.hpp"
#include "megatrain/train/grpo.hpp"
#include "megatrain/train/train_item.hpp"  // StepStats
#include "grpo_plan.hpp"
#include "prompts.hpp"
#include "settings.hpp"

namespace megatrain::app {

inline GrpoOptions grpo_options(const Settings& s, std::int64_t completion_tokens) {
  GrpoOptions o;
  o.loss = grpo_loss(s.grpo_loss);
  o.epsilon = s.clip_eps;
  o.epsilon_high = s.origins.given("--clip-eps-high") ? s.clip_eps_high : s.clip_eps;
  o.beta = s.kl_beta;
  o.max_completion_length = completion_tokens;
  return o;
}

/// Step t's draws: a seed of its own from (--seed, t) (SplitMix64's finaliser).
inline std::uint64_t grpo_step_seed(std::uint64_t seed, std::int64_t step) {
  std::uint64_t z = seed * 0x9e3779b97f4a7c15ull + static_cast<std::uint64_t>(step) + 0x67727030ull;  // ("grp0")
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

template <class T>
class GrpoRun {
 public:
  /// `moe`: the model routes experts (the rows' attention mask then leaves the padding out of its
  /// auxiliary loss).
  GrpoRun(const Settings& s, T& trainer, std::shared_ptr<const GrpoPlan> plan, std::int64_t vocab, std::int32_t pad, bool moe)
      : s_(s), trainer_(trainer), plan_(std::move(plan)), opt_(grpo_options(s, plan_->completion_tokens)), vocab_(vocab),
        pad_(pad), moe_(moe) {
    opt_.check();
  }

  /// Where the prompt order stands once `steps` steps have run (what a checkpoint records).
  DataPosition position(std::int64_t steps) const { return grpo_position(*plan_, s_, steps); }

  /// Step `step` (from 1): sampled, scored, trained.
  StepStats step(std::int64_t step) {
    const std::int64_t G = s_.generations, rows = trainer_.options().batch_rows, P = rows / G;
    std::vector<std::vector<std::int32_t>> prompts;
    std::vector<std::size_t> which;  // (each row's prompt)
    for (std::int64_t i = 0; i < P; ++i) {
      const std::size_t p = prompt_at((step - 1) * P + i);
      for (std::int64_t k = 0; k < G; ++k) prompts.push_back(plan_->train.ids[p]), which.push_back(p);
    }
    generate::GenerationOptions gen;
    gen.max_new_tokens = plan_->completion_tokens;
    gen.sampling.temperature = s_.temperature;
    gen.sampling.top_k = s_.top_k;
    gen.sampling.top_p = s_.top_p;
    gen.sampling.min_p = s_.min_p;
    gen.sampling.seed = grpo_step_seed(s_.seed, step);
    gen.eos = plan_->eos;
    trainer_.finish_update();  // (the completions are the updated weights')
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<generate::Completion> done = sample(prompts, gen);
    sampling_s_ = seconds_since(t0);
    const rl::RewardSum::Scores rewards =
        score(plan_->train, which, done, fmt::format("step {}: the step changed nothing", step));
    const Advantages adv = group_advantages(rewards.total, G, reward_scale(s_.scale_rewards));
    std::vector<std::vector<std::int32_t>> completions;
    for (const auto& c : done) completions.push_back(c.tokens);
    rl::RolloutRows r = rl::rollout_rows(prompts, completions, trainer_.options().seq_len, pad_);
    std::int64_t kept = rows;
    if (s_.skip_equal_groups && adv.equal_groups < adv.groups)  // (equal groups teach nothing: their rows left out)
      for (std::int64_t g = 0; g < P; ++g)
        if (adv.equal[static_cast<std::size_t>(g)] != 0) {
          std::fill_n(r.labels.begin() + g * G * trainer_.options().seq_len, G * trainer_.options().seq_len, kIgnoreIndex);
          kept -= G;
        }
    const Grpo objective(opt_, adv.values, {}, {}, kept);
    const StepStats st = trainer_.step(objective, r.ids, r.labels, {}, moe_ ? std::span<const std::uint8_t>(r.mask)
                                                                              : std::span<const std::uint8_t>());
    const std::vector<double> lp = trainer_.last_log_probs();
    record(rewards, adv, done, objective.stats(ObjectiveRows::whole(r.labels, lp, rows)));
    return st;
  }

  /// The mean reward of greedy completions of the first `rows` validation prompts (all of them
  /// where fewer), after step `step`.
  double validation(std::int64_t rows, std::int64_t step) {
    const std::int64_t n = std::min(rows, plan_->val.size());
    std::vector<std::vector<std::int32_t>> prompts(plan_->val.ids.begin(), plan_->val.ids.begin() + n);
    std::vector<std::size_t> which(static_cast<std::size_t>(n));
    for (std::size_t i = 0; i < which.size(); ++i) which[i] = i;
    generate::GenerationOptions gen;
    gen.max_new_tokens = plan_->completion_tokens;
    gen.sampling.temperature = 0;  // (greedy: the score changes only where the model does)
    gen.eos = plan_->eos;
    trainer_.finish_update();
    const std::vector<double> r =
        score(plan_->val, which, sample(prompts, gen),
              fmt::format("the validation prompts after step {}: the run stops without saving that step (resume from the "
                          "newest checkpoint once the reward works)", step))
            .total;
    double mean = 0;
    for (const double x : r) mean += x / static_cast<double>(r.size());
    return mean;
  }

  /// The last step's mean reward.
  double mean_reward() const { return metrics_.value("reward", 0.0); }
  /// The last step's numbers, with TRL's names (reward, reward_std, rewards/<name>/mean, ...).
  void metrics(nlohmann::json& m) const { m.update(metrics_); }

 private:
  static double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  // Slot k of the prompt order: epoch k / n's shuffle of the n training prompts.
  std::size_t prompt_at(std::int64_t k) {
    const std::int64_t n = plan_->train.size();
    if (k / n != order_epoch_) order_ = shuffled_order(n, s_.seed, order_epoch_ = k / n);
    return static_cast<std::size_t>(order_[static_cast<std::size_t>(k % n)]);
  }
  std::vector<generate::Completion> sample(const std::vector<std::vector<std::int32_t>>& prompts,
                                           const generate::GenerationOptions& gen) {
    const generate::SlotShape shape{trainer_.options().batch_rows, trainer_.options().seq_len, vocab_, pad_};
    return generate::generate(trainer_, shape, prompts, gen);
  }
  // Each completion's rewards, total and each (its prompt: set.records[which[i]]). `when`: what the
  // message of a failing reward says of the run.
  rl::RewardSum::Scores score(const PromptSet& set, const std::vector<std::size_t>& which,
                            const std::vector<generate::Completion>& done, const std::string& when) {
    std::vector<std::string> texts;
    for (const auto& c : done) texts.push_back(completion_text(c, *plan_->tokenizer, {}));
    std::vector<rl::Scored> batch;
    for (std::size_t i = 0; i < done.size(); ++i) batch.push_back({&set.records[which[i]], set.text[which[i]], texts[i]});
    try {
      return plan_->rewards->score(batch);
    } catch (const Error& e) {
      MT_FAIL("{} ({}; the rewards: --reward-answer, --reward-format, --reward-command, --reward-timeout {} s)", e.reason(),
              when, s_.reward_timeout);
    }
  }
  void record(const rl::RewardSum::Scores& rewards, const Advantages& adv, const std::vector<generate::Completion>& done,
              const GrpoStats& clip) {
    nlohmann::json m;
    m["reward"] = mean_std(rewards.total).first;
    double group_std = 0;  // (TRL's reward_std: the groups' standard deviations, averaged)
    for (const double sd : adv.group_std) group_std += sd;
    m["reward_std"] = group_std / static_cast<double>(adv.groups);
    for (std::size_t i = 0; i < rewards.each.size(); ++i) {
      const auto [mean, sd] = mean_std(rewards.each[i]);
      m["rewards/" + plan_->reward_names[i] + "/mean"] = mean;
      m["rewards/" + plan_->reward_names[i] + "/std"] = sd;
    }
    m["frac_reward_zero_std"] = static_cast<double>(adv.equal_groups) / static_cast<double>(adv.groups);
    const auto [amean, astd] = mean_std(adv.values);
    m["advantages/mean"] = amean;
    m["advantages/std"] = astd;
    std::int64_t tokens = 0, shortest = INT64_MAX, longest = 0, clipped = 0;
    for (const auto& c : done) {
      const auto n = static_cast<std::int64_t>(c.tokens.size());
      tokens += n, shortest = std::min(shortest, n), longest = std::max(longest, n);
      clipped += c.finish == generate::Finish::length ? 1 : 0;
    }
    m["completions/mean_length"] = static_cast<double>(tokens) / static_cast<double>(done.size());
    m["completions/min_length"] = shortest;
    m["completions/max_length"] = longest;
    m["completions/clipped_ratio"] = static_cast<double>(clipped) / static_cast<double>(done.size());
    const double t = static_cast<double>(std::max<std::int64_t>(clip.tokens, 1));
    m["clip_ratio/low_mean"] = clip.low_clipped / t;
    m["clip_ratio/high_mean"] = clip.high_clipped / t;
    m["clip_ratio/region_mean"] = (clip.low_clipped + clip.high_clipped) / t;
    m["sampling_s"] = sampling_s_;
    m["sampling_tokens_per_s"] = static_cast<double>(tokens) / sampling_s_;
    metrics_ = std::move(m);
  }

  const Settings& s_;
  T& trainer_;
  std::shared_ptr<const GrpoPlan> plan_;
  GrpoOptions opt_;
  std::int64_t vocab_;
  std::int32_t pad_;
  bool moe_;
  std::vector<std::int64_t> order_;
  std::int64_t order_epoch_ = -1;
  double sampling_s_ = 0;
  nlohmann::json metrics_;
};

}  // namespace megatrain::app
