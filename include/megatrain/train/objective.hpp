// What a training step minimises: an objective over each token's log-probability of its label.
//
// The head gives, for every token t with a label, log p_t = log softmax(logits_t)[label_t]. An
// objective L(log p) is trained through its gradient with respect to those log-probabilities:
// each token's weight is
//
//     w_t = -dL / d(log p_t)
//
// and the step backpropagates sum_t w_t * (-log p_t) from the head, in the same fused pass as
// cross-entropy (Backend::lm_head_loss with token weights). So a new objective is a class here,
// not a new trainer:
//
//   CrossEntropy     the mean of -log p over the batch's labelled tokens (the default)
//   TokenWeighted    sum_t a_t * (-log p_t) with a weight per token given beforehand
//                    (advantage-weighted policy gradients, per-token loss weights)
//   your own         derive from Objective; needs_log_probs() where the weights depend on the
//                    step's own log-probabilities (a preference pair's, for instance)
//
// An objective that needs the log-probabilities costs one more forward of the head on each
// micro-batch: the head runs forward, the host computes the weights, then the head runs
// forward and backward with them. Rows that an objective relates (a preference pair) must lie
// in one micro-batch. docs/training.md#objectives.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace megatrain {

/// The rows of one micro-batch, as an objective sees them.
struct ObjectiveRows {
  std::int64_t first_row = 0;  ///< the micro-batch's first row within the step's batch (this process's rows)
  std::int64_t rows = 0, seq_len = 0;
  std::span<const std::int32_t> labels;  ///< rows * seq_len labels (kIgnoreIndex: none)
  /// rows * seq_len log-probabilities of the labels under the weights of the step (0 where there
  /// is no label); empty when weights() is called before the forward (needs_log_probs() false).
  std::span<const double> log_probs;
  /// The labelled tokens of the step's whole batch (every process's, with several).
  std::int64_t batch_labelled = 0;
  /// Packed rows (TrainerOptions::packed): rows * seq_len positions, each token's within its
  /// sequence (0 where one starts); empty: each row one sequence.
  std::span<const std::int32_t> positions = {};

  /// A whole batch of `rows` rows (one process's, seq_len = labels.size() / rows): its labels, their
  /// log-probabilities, `positions` where packed (else empty), and batch_labelled counted over them.
  static ObjectiveRows whole(std::span<const std::int32_t> labels, std::span<const double> log_probs, std::int64_t rows,
                             std::span<const std::int32_t> positions = {});
};

class Objective {
 public:
  virtual ~Objective() = default;
  /// A name for messages ("cross-entropy").
  virtual std::string name() const = 0;
  /// Where every labelled token's weight is the same: that weight, given the batch's labelled
  /// tokens (the head then scales its gradient by it and reads no weights: cross-entropy).
  virtual std::optional<double> uniform_weight(std::int64_t /*batch_labelled*/) const { return std::nullopt; }
  /// Whether weights() reads the rows' log-probabilities (the head runs its forward first).
  virtual bool needs_log_probs() const { return false; }
  /// Each token's weight w_t = -dL/d(log p_t) into `w` (rows * seq_len; 0 where there is no
  /// label). Called once per micro-batch: before the step, or (needs_log_probs()) between the
  /// head's forward and its backward.
  virtual void weights(const ObjectiveRows& rows, std::span<float> w) const = 0;
  /// The objective's value over these rows, their log-probabilities known. A step's loss is the
  /// sum over its micro-batches (and over the processes, with several).
  virtual double value(const ObjectiveRows& rows) const = 0;
};

/// The mean of -log p over the labelled tokens of the step's batch: PyTorch's cross_entropy
/// with ignore_index=-100, however the batch is split into micro-batches and processes.
class CrossEntropy final : public Objective {
 public:
  std::string name() const override { return "cross-entropy"; }
  std::optional<double> uniform_weight(std::int64_t batch_labelled) const override {
    return 1.0 / static_cast<double>(batch_labelled);
  }
  void weights(const ObjectiveRows& rows, std::span<float> w) const override;
  double value(const ObjectiveRows& rows) const override;
};

/// sum_t a_t * (-log p_t), with a weight a_t for every token of the step's batch given
/// beforehand (this process's rows, row by row; 0 where there is no label): an
/// advantage-weighted policy gradient (a_t = the advantage / the tokens counted), or a loss
/// weighted per token. The weights say the normalisation; nothing else divides.
class TokenWeighted final : public Objective {
 public:
  explicit TokenWeighted(std::vector<float> weights) : w_(std::move(weights)) {}
  std::string name() const override { return "token-weighted"; }
  void weights(const ObjectiveRows& rows, std::span<float> w) const override;
  double value(const ObjectiveRows& rows) const override;

 private:
  std::vector<float> w_;
};

}  // namespace megatrain
