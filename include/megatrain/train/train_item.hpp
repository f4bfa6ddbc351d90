// What flows through a training step and what comes out of it: the items of a step (TrainItem),
// where an item's landed gradient belongs (GradientPiece), what a user stage sees of it
// (GradientView), and what one step did (StepStats).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "megatrain/pipeline/stream_pipeline.hpp"

namespace megatrain {

/// What one step did.
struct StepStats {
  std::int64_t step = 0;
  /// The loss or the gradient was not finite and the step was skipped (NonFinite::skip): no
  /// weight and no AdamW state changed.
  bool skipped = false;
  double loss = 0;          ///< the objective's value: cross-entropy, the mean over tokens with a label
  double lr = 0;
  double grad_norm = 0;     ///< global norm of this step's gradient (before clipping)
  double clip_coef = 1;     ///< what the gradients were multiplied by
  std::int64_t tokens = 0;  ///< tokens in the batch
  double seconds = 0;
  /// A mixture of experts: the step's auxiliary load-balancing loss (transformers'
  /// load_balancing_loss_func over each micro-batch, their mean, over every process's micro-batches
  /// with several, as each rank's forward computes it under DDP; not part of `loss`: where the
  /// config sets output_router_logits, the step trains on loss + router_aux_loss_coef x aux_loss),
  /// and each sparse layer's tokens per expert over the step (the fewest and the most routed to
  /// one expert: a collapsing router shows as min 0 and a growing max).
  double aux_loss = 0;
  struct ExpertLoad {
    std::int64_t layer = 0, min = 0, max = 0;
  };
  std::vector<ExpertLoad> expert_load;
  /// With TrainerOptions::profile: time each stage spent working in this step (the compute
  /// executor's busy time, the copy engines' transfer times) and the bytes copied.
  struct Profile {
    double compute_s = 0, upload_s = 0, download_s = 0, optimizer_s = 0;
    std::size_t upload_bytes = 0, download_bytes = 0;
    /// The compute stream's items in order: what (TrainItem::Kind as a number, unit) and when
    /// (start relative to the step's first compute item, duration), for a timeline.
    struct Item {
      int kind = 0;
      std::size_t unit = 0;
      double start_s = 0, seconds = 0;
      double host_s = 0;  ///< the host's time to enqueue it
    };
    std::vector<Item> compute_items;
  };
  std::optional<Profile> profile;
};

/// One item of a step: which unit, and what to do with it.
struct TrainItem {
  enum class Kind : std::uint8_t {
    forward,     ///< run a unit forward over the micro-batch
    head,        ///< the head's forward and backward (its gradient's first piece)
    head_eval,   ///< the head's forward only (evaluation)
    backward,    ///< recompute and backpropagate a unit (its gradient's first piece)
    refill,      ///< recompute a block's output that is no checkpoint (TrainerOptions::checkpoint_every), for the backward
    grad_piece,  ///< a further piece of the head's gradient, or of the embedding's touched rows
    embed_rest,  ///< the embedding rows no token of the batch uses (see the top of this file)
    optimize,    ///< AdamW on a unit's resident gradient (second pass)
  };
  Kind kind;
  std::size_t unit;
  std::int64_t micro = 0;
  /// grad_piece: piece number (>= 1); embed_rest: which rows (0, 1, ...); optimize: piece (>= 0);
  /// forward: 1 in an evaluation (no activations kept for a backward)
  std::int64_t piece = 0;
  /// Set by the trainer: the item hands a host gradient to the stages after offload (an untied
  /// embedding's untouched rows: a zero one, which does not cross).
  bool host_gradient = false;
  /// Whether a gradient lands on the host for this item (GradientView::gradient).
  bool carries_gradient() const { return host_gradient; }
};

/// Which elements of its unit an item's landed gradient holds: contiguous elements from
/// `offset`, or (when `rows` is not empty) rows of the embedding table: gradient row i, of
/// `row_elems` elements, is table row rows[i]. Every element of a unit's gradient lands in
/// exactly one item of the step; where a piece covers rows that another item carries (the
/// touched rows inside an embed_rest piece), they read zero. An embed_rest piece of an untied
/// model lands nothing: its gradient is zero.
struct GradientPiece {
  std::size_t offset = 0;
  std::span<const std::int32_t> rows;
  std::size_t row_elems = 0;
};

/// What a user stage can see: the landed host gradient of an item, and where it stands.
struct GradientView {
  /// The item's landed gradient (with micro-batches: that micro-batch's share); valid in run().
  std::function<std::span<const float>(const TrainItem&, const StageSlots&)> gradient;
  std::function<GradientPiece(const TrainItem&)> placement;  ///< where gradient()'s elements belong; valid in run()
  std::function<const std::string&(std::size_t unit)> unit_name;
  std::function<std::int64_t()> step;  ///< 1-based step being trained
};

}  // namespace megatrain
