// Group relative policy optimisation (GRPO) and its variants as an objective at the head
// (train/objective.hpp), with HF TRL's formulas (GRPOTrainer: loss_type, epsilon, epsilon_high,
// beta, scale_rewards). Each prompt's G completions are scored by rewards; each completion's
// advantage is its reward against its group's (group_advantages). Every completion token t then has
//
//   r_t = exp(log p_t - log p_old_t)        the policy ratio (1 on the first update of a batch:
//                                           p_old is the weights that sampled, the step's own)
//   l_t = -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A) + beta kl_t
//   kl_t = exp(ref_t - log p_t) - (ref_t - log p_t) - 1    (only where beta > 0; ref: the reference model)
//
// and the loss adds the l_t up as loss_type says:
//
//   grpo     the mean over the batch's completions of each completion's mean over its tokens
//   dapo     the mean over the batch's completion tokens (TRL's default)
//   dr_grpo  the sum over the batch's completion tokens / (completions x max_completion_length)
//
// A row is a prompt and one completion; its labels are the completion's tokens (the prompt's carry
// none). The advantages, the old and the reference log-probabilities are given for the step's rows
// beforehand; the policy's own come from the step (needs_log_probs).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "megatrain/train/objective.hpp"

namespace megatrain {

enum class GrpoLoss { grpo, dapo, dr_grpo };
/// "grpo", "dapo", "dr_grpo" (TRL's loss_type names); throws naming the others.
GrpoLoss grpo_loss(std::string_view name);
std::string_view grpo_loss_name(GrpoLoss l);

/// How a completion's reward becomes its advantage (TRL's scale_rewards): its group's mean taken
/// away, then divided by the group's standard deviation (group), the batch's (batch), or not
/// (none: Dr. GRPO).
enum class RewardScale { group, batch, none };
RewardScale reward_scale(std::string_view name);
std::string_view reward_scale_name(RewardScale s);

struct GrpoOptions {
  GrpoLoss loss = GrpoLoss::dapo;
  double epsilon = 0.2;                    ///< the ratio's lower clip: 1 - epsilon (TRL's default)
  double epsilon_high = 0.2;               ///< its upper clip: 1 + epsilon_high (DAPO's clip-higher: 0.28)
  double beta = 0.0;                       ///< the KL penalty's weight (0: no reference model, TRL's default)
  std::int64_t max_completion_length = 0;  ///< dr_grpo's normaliser: the completions' token budget
  /// Throws megatrain::Error naming the field for a value out of range.
  void check() const;
};

/// The advantages of a batch's completions, `group` a prompt, one group after another.
struct Advantages {
  std::vector<double> values;     ///< one a completion
  std::int64_t groups = 0;        ///< the prompts
  std::int64_t equal_groups = 0;  ///< groups whose rewards are all equal: their advantages are 0, they teach nothing
  std::vector<std::uint8_t> equal;  ///< one a group: 1 where its rewards are all equal
  std::vector<double> group_std;    ///< one a group: its rewards' standard deviation (TRL's reward_std averages them)
};

/// The mean and the standard deviation with Bessel's correction (0 for one value) of `v`.
std::pair<double, double> mean_std(std::span<const double> v);

/// TRL's advantages: each reward less its group's mean, divided (unless `scale` is none) by the
/// standard deviation (with Bessel's correction) of its group or of the batch, plus 1e-4.
/// `rewards` holds whole groups; every reward must be finite.
Advantages group_advantages(std::span<const double> rewards, std::int64_t group, RewardScale scale);

/// A step's tokens as TRL reports them, summed over the rows given (divide by `tokens`):
/// clip_ratio/low (ratio under 1 - epsilon with a negative advantage), clip_ratio/high (over
/// 1 + epsilon_high with a positive one), and the KL to the reference.
struct GrpoStats {
  std::int64_t tokens = 0;
  double low_clipped = 0, high_clipped = 0, kl = 0;
  GrpoStats& operator+=(const GrpoStats& o);
};

class Grpo final : public Objective {
 public:
  /// `advantages`: each row's, for every row of the step's batch (this process's rows, in order).
  /// `old_log_probs`: each token's log-probability under the weights that sampled (rows x seq of
  /// this process's rows, as the trainer's scoring pass gives them; empty: the step's own, its
  /// first update of the batch). `reference`: likewise under the reference model (needed where
  /// beta > 0, else empty). `batch_rows`: the completions of the step's whole batch (every
  /// process's), which grpo and dr_grpo divide by.
  Grpo(const GrpoOptions& options, std::vector<double> advantages, std::vector<double> old_log_probs,
       std::vector<double> reference, std::int64_t batch_rows);

  std::string name() const override;
  bool needs_log_probs() const override { return true; }
  void weights(const ObjectiveRows& rows, std::span<float> w) const override;
  double value(const ObjectiveRows& rows) const override;
  /// The tokens of these rows (their log-probabilities known).
  GrpoStats stats(const ObjectiveRows& rows) const;

 private:
  struct Token {
    double loss = 0;  ///< l_t
    double grad = 0;  ///< d l_t / d(log p_t)
    bool low = false, high = false;
    double kl = 0;
  };
  /// Token t (of the whole step's rows) at log-probability `lp`, of a row of advantage `a`.
  Token token(std::size_t t, double lp, double a) const;
  /// Each labelled token's weight in the loss: 1 / its row's tokens x rows (grpo), 1 / the batch's
  /// tokens (dapo), 1 / (rows x max_completion_length) (dr_grpo).
  double scale(const ObjectiveRows& rows, std::int64_t row_tokens) const;
  /// Calls f(the row's advantage, the token's index in the step's rows, its index in `rows`, its
  /// scale) for every labelled token of `rows`.
  template <class F>
  void each_token(const ObjectiveRows& rows, F&& f) const;

  GrpoOptions o_;
  std::vector<double> adv_, old_, ref_;
  std::int64_t batch_rows_;
};

}  // namespace megatrain
