// Preference training: direct preference optimisation (DPO) and its variants as an objective at
// the head (train/objective.hpp), with HF TRL's formulas (DPOTrainer, its loss_type):
//
//   h = (pi_c - ref_c) - (pi_r - ref_r)       pi: a row's summed log-probability under the weights
//                                             being trained, ref: under the reference model
//   sigmoid  L = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)   (eps: label smoothing,
//            "conservative DPO"; 0: the DPO paper's loss)
//   hinge    L = max(0, 1 - beta h)
//   ipo      L = (h - 1 / (2 beta))^2, each row's log-probabilities (its own and the reference's)
//            averaged over its labelled tokens, as TRL averages them for IPO
//
// The loss is the mean over the step's pairs. The rows come in pairs: row 2i is pair i's chosen
// answer, row 2i + 1 its rejected one, with the same prompt; their labels are the answers'
// tokens (the prompt's carry none). A pair lies in one micro-batch. Packed rows (positions
// given: several sequences a row) hold whole pairs instead: a row's sequences with a label are
// its answers, chosen then rejected, pair after pair (a sequence without one, the padding, is
// none). The reference's summed log-probabilities are given for every answer, computed
// beforehand (the scoring pass of the initial weights, Trainer::score): no second model is held.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "megatrain/train/objective.hpp"

namespace megatrain {

enum class PreferenceLoss { sigmoid, hinge, ipo };

/// "sigmoid", "hinge", "ipo" (TRL's loss_type names); throws naming the others.
PreferenceLoss preference_loss(std::string_view name);
std::string_view preference_loss_name(PreferenceLoss l);

struct PreferenceOptions {
  PreferenceLoss loss = PreferenceLoss::sigmoid;
  double beta = 0.1;             ///< TRL's default
  double label_smoothing = 0.0;  ///< sigmoid only: in [0, 0.5)
  /// Throws megatrain::Error naming the field for a value out of range.
  void check() const;
};

/// A step's pairs as TRL reports them, summed over the pairs of the rows given (divide by the
/// pairs for TRL's means): rewards/chosen = beta (pi_c - ref_c), rewards/rejected likewise,
/// rewards/accuracies (chosen's reward above rejected's), rewards/margins, logps/chosen,
/// logps/rejected (averaged per token for IPO, as its loss reads them).
struct PreferenceStats {
  std::int64_t pairs = 0;
  double rewards_chosen = 0, rewards_rejected = 0, accuracies = 0, margins = 0, logps_chosen = 0, logps_rejected = 0;
  PreferenceStats& operator+=(const PreferenceStats& o);
};

class Dpo final : public Objective {
 public:
  /// `reference`: the reference model's summed log-probability of every answer of the step's
  /// batch (this process's rows, in order); `batch_pairs`: the pairs of the step's whole batch
  /// (every process's), which the loss is the mean over. Packed rows: `row_first[r]` is where row
  /// r's answers start in `reference` (r counted over this process's rows of the step); empty:
  /// an answer a row, row r's at reference[r].
  Dpo(const PreferenceOptions& options, std::vector<double> reference, std::int64_t batch_pairs,
      std::vector<std::int64_t> row_first = {});

  std::string name() const override;
  bool needs_log_probs() const override { return true; }
  void weights(const ObjectiveRows& rows, std::span<float> w) const override;
  double value(const ObjectiveRows& rows) const override;
  /// The pairs of these rows (their log-probabilities known).
  PreferenceStats stats(const ObjectiveRows& rows) const;

 private:
  /// One answer: its tokens [begin, end) of the micro-batch, where its reference is.
  struct Answer {
    std::size_t begin = 0, end = 0, ref = 0;
  };
  struct Pair {
    double h = 0;                          ///< the margin of log-ratios
    double scale_chosen = 1, scale_rejected = 1;  ///< d(pi)/d(log p_t): 1, or 1 / tokens for IPO
    double pi_chosen = 0, pi_rejected = 0, ref_chosen = 0, ref_rejected = 0;
  };
  /// The micro-batch's answers in order: answers 2i and 2i + 1 are pair i's.
  std::vector<Answer> answers(const ObjectiveRows& rows) const;
  /// The pair of answers `chosen` and `rejected`.
  Pair pair(const ObjectiveRows& rows, const Answer& chosen, const Answer& rejected) const;
  /// The loss of a pair and its derivative with respect to h.
  double loss(double h, double* dloss_dh) const;

  PreferenceOptions o_;
  std::vector<double> ref_;
  std::int64_t batch_pairs_;
  std::vector<std::int64_t> row_first_;
};

}  // namespace megatrain
