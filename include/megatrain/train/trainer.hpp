// The streaming trainer: one optimizer step, layer-major over the whole batch.
//
// Units are the embedding (0), the blocks (1..L) and the head (L+1). One step, for each
// micro-batch:
//   forward   F0, F1..FL   prefetch the unit's weights into a slot; run it over every token chunk;
//                          keep its output (the next unit's input) as the activation checkpoint
//   head      H            final norm + LM head + cross-entropy, fused with its backward, chunked
//   backward  BL..B1, B0   prefetch again, recompute each chunk from its checkpoint, backpropagate,
//                          accumulate the weight gradient over chunks, offload it (blocks that
//                          keep their activations, TrainerOptions::kept_blocks, recompute nothing)
//   optimizer              AdamW on the unit as soon as its gradient has landed on the host
// Each item flows through StreamPipeline<prefetch, compute, offload, [user stages], optimizer>,
// so prefetching unit u+1 overlaps computing unit u, offloading u's gradient overlaps computing
// u-1, and the optimizer steps u while the GPU (or CPU) works on lower layers. The pipeline
// decides when things happen, never what is computed: results do not depend on timing.
//
// Gradients are resident (every unit's gradient kept on the host until all have landed) when
// clipping is exact (PyTorch's clip_grad_norm_ over all parameters, then AdamW) or when the
// batch is split into micro-batches (gradient accumulation). Then the optimizer runs as a second
// pass after the global norm is known: in the background, ahead of the next step's forward
// (TrainerOptions::overlap_update), whose prefetch of unit u waits only for u's update (the
// pipeline's rule 4), so the AdamW pass of step t overlaps the forward of step t+1.
// finish_update() waits for it; the next step(), evaluate() and the Checkpointer order
// themselves after it, and the library's readers of a whole store refuse while it runs
// (HostParamStore::check_settled). ClipMode::stale instead clips step t with the global norm
// measured at step t-1 (no clipping at step 1), so each unit still steps the moment its
// gradient lands; it differs from PyTorch exactly in using the previous step's norm.
//
// Where gradients wait for the norm (TrainerOptions::gradient_home): by default on the device,
// one fp32 accumulator per unit (micro-batches add into it there); then the AdamW pass downloads
// each host unit's gradient in slot-sized pieces into the store's landing ring, in forward order,
// while the next forward runs, so host memory stays at the store's 14 bytes per parameter. With
// GradientHome::host every gradient lands in the store's resident slabs during the backward.
//
// Device units (TrainerOptions::device_units, train/device_units.hpp): the first units in
// forward order may keep their AdamW state in backend memory. Nothing of theirs is uploaded, their
// gradients never land on the host, and their update is an `optimize` item of the compute stage
// (Backend::adamw, the host optimizer's formula and bits): right after the item that completes
// the gradient when it streams, in the AdamW pass otherwise. A device block keeps no weights of
// its own: each item that reads them takes a slot of the weights' ring (as a host block's
// prefetch does) and the compute stage rounds the masters into it first (bf16 weights; fp32
// weights are the masters themselves), the same bits as the update's copy. The store's copies of
// them are stale while the backend holds the newer state; finish_update() writes them back (the
// store then holds the whole train state and is its owner again, until the next step() or
// evaluate() loads the device units from it).
//
// The embedding and the head keep dedicated weight slots and gradient accumulators (a tied LM
// head reads the embedding's slot and accumulates into its gradient); blocks share rings of
// `weight_slots` and `grad_slots` buffers.
//
// The embedding's lookup reads fp32 rows, as PyTorch's autocast does (it leaves F.embedding in
// fp32; a tied head's product is in the compute dtype like any other): a device embedding's
// fp32 master table, or, for a host embedding, the batch's distinct rows of its masters,
// gathered on the host once per step and uploaded (then the bf16 table crosses only for a tied
// head). Both give the same bits.
//
// Without resident gradients a host embedding's gradient comes back in two parts, as only the rows
// of the batch's tokens (the "touched" rows) get a gradient from the embedding itself:
//   - the other rows (embed_rest items, spread between the blocks of the backward): with a
//     tied head their gradient is the head's, complete once the head has run, so they cross
//     PCIe and are stepped while the backward runs; untied, their gradient is zero and they
//     are stepped without a copy;
//   - the touched rows (the embedding's backward item and grad_piece items after it): gathered
//     into a compact [rows, hidden] buffer on the device, so only they cross at the end.
// The head's gradient, when larger than a landing slot (an untied head over a large
// vocabulary), lands in slot-sized pieces (grad_piece items). So the host's landing slots need
// only be as large as a decoder block, and the step's tail holds only the touched rows.
#pragma once

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_arena.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "megatrain/backend/arena.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/fault_injection.hpp"
#include "megatrain/core/finite.hpp"
#include "megatrain/core/log.hpp"
#include "megatrain/core/nvtx.hpp"
#include "megatrain/layers/decoder_model.hpp"
#include "megatrain/optim/adamw.hpp"
#include "megatrain/optim/lr_schedule.hpp"
#include "megatrain/pipeline/stream_pipeline.hpp"
#include "megatrain/plan/planner.hpp"
#include "megatrain/store/host_param_store.hpp"
#include "megatrain/train/device_units.hpp"
#include "megatrain/train/trainer_options.hpp"

namespace megatrain {

/// What one step did.
struct StepStats {
  std::int64_t step = 0;
  /// The loss or the gradient was not finite and the step was skipped (NonFinite::skip): no
  /// weight and no AdamW state changed.
  bool skipped = false;
  double loss = 0;          ///< mean over tokens with a label
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

template <class B, class Block = DecoderBlock, class... UserStages>
class Trainer {
  static_assert(Backend<B>, "Trainer<B>: B does not satisfy megatrain::Backend (see megatrain/backend/backend.hpp)");
  static_assert(LayerOp<Block, B>,
                "Trainer<B, Block>: Block does not satisfy megatrain::LayerOp<Block, B>: it needs params(), Weights<E>, "
                "bind(), hidden_size(), scratch_bytes<B>(), forward() and backward() (see megatrain/layers/layer_op.hpp)");
  using Act = typename B::Act;
  using Res = typename B::Res;  // the residual stream: activation checkpoints, gradients between units
  using W = typename B::Weight;
  using Acc = typename B::Acc;
  using Exec = typename B::Executor;
  using Kind = TrainItem::Kind;
  template <class E>
  using Buf = typename B::template Buffer<E>;

 public:
  /// What the store must provide for `opt`: resident gradients or a ring of host landing slots.
  static StoreOptions store_options(const TrainerOptions& options, StoreOptions base = {}) {
    return plan::store_options(options, base, std::is_same_v<W, bf16>);
  }

  /// `model`, `store` and `backend` must outlive the trainer. The store's units must be the
  /// model's (same names and shapes) and its gradients laid out as store_options() says.
  Trainer(const DecoderModel<Block>& model, HostParamStore<float>& store, B& backend, TrainerOptions opt)
      : model_(model), store_(store), be_(backend), opt_(opt.resolved()), state_(std::make_shared<State>()) {
    MT_NVTX_RANGE("Trainer::Trainer");
    opt.validate();
    check_store();
    if constexpr (!MoeBackend<B>) {  // (before anything is allocated)
      for (std::int64_t l = 0; l < model_.config().num_hidden_layers; ++l)
        if (model_.config().is_moe_layer(l)) MoeMlp::refuse_backend(model_.config(), l);
    }
    // Micro-batches added up in host memory: what orders a micro-batch's head (which zeroes the
    // head's and a tied embedding's accumulators) after the offload of the previous micro-batch's
    // embedding gradient is the reuse of the compute stage's ring (Compute::takes_slot,
    // Offload::applies): the slot the head takes must have been held by that backward or by a
    // forward after it, so the ring may be at most L + 2 long.
    MT_CHECK(!(grads_on_host() && opt_.micro_batches > 1) || opt_.grad_slots <= model_.num_blocks() + 2,
             "grad_slots {} is more than {}: with micro-batches added up in host memory (GradientHome::host) a "
             "{}-block model takes at most {}", opt_.grad_slots, model_.num_blocks() + 2, model_.num_blocks(),
             model_.num_blocks() + 2);
    model_.config().check_sequence_length(opt_.seq_len);
    MT_CHECK(opt_.sharded() ? store_.shard().count == opt_.comm->world() && store_.shard().index == opt_.comm->rank() &&
                                  store_.shard().masters == (std::is_same_v<W, bf16>)
                            : !store_.sharded(),
             "the store keeps part {} of {} of the optimizer state, but the trainer's options say {}: build the store "
             "with Trainer::store_options(options)", store_.shard().index, store_.shard().count,
             opt_.sharded() ? fmt::format("part {} of {}", opt_.comm->rank(), opt_.comm->world()) : std::string("all of it"));
    MT_CHECK(store_.weights_in_parts() == weights_in_parts_,
             "the store keeps {} but the trainer's options say {}: build the store with Trainer::store_options(options)",
             store_.weights_in_parts() ? "this process's part of the bf16 weights current" : "the bf16 weights whole",
             weights_in_parts_ ? "each process uploads its part (gather_weights_on_device)" : "they stream whole");
    MT_CHECK(!weights_in_parts_ || opt_.comm->can_sum_backend_memory(B::kDevice),
             "gather_weights_on_device: this communicator cannot gather GPU memory; use NCCL (dist::NcclHostComm), or "
             "set gather_weights_on_device to false");
    MT_CHECK(!reduces_on_device_ || (std::is_same_v<Acc, float> && opt_.comm->can_sum_backend_memory(B::kDevice)),
             "data parallel over {} processes with the gradients waiting in {} memory (GradientHome::device): this "
             "communicator cannot sum that memory; use a communicator that can (NCCL on GPUs, MPI initialised for "
             "threads on the CPU backend), or GradientHome::host", opt_.distributed() ? opt_.comm->world() : 1,
             B::kDevice ? "GPU" : "backend");
    MT_CHECK(!opt_.distributed() || opt_.device_units <= 0 || reduces_on_device_,
             "data parallel over {} processes with {} device units: their gradients are summed in GPU memory, which "
             "needs the gradients waiting there (GradientHome::device, the default)", opt_.distributed() ? opt_.comm->world() : 1,
             opt_.device_units);
    if (opt_.seq_len > model_.config().max_position_embeddings)
      log_warning("the sequence length {} is longer than this model's max_position_embeddings {}: positions past {} "
                  "are ones the model was not trained on; extend its context with rope scaling in config.json "
                  "(rope_scaling: yarn, linear, ...) and a larger max_position_embeddings, or train on at most {} tokens "
                  "per sequence", opt_.seq_len, model_.config().max_position_embeddings,
                  model_.config().max_position_embeddings, model_.config().max_position_embeddings);
    allocate();
    pipeline_ = std::make_unique<Pipeline>(Prefetch{{this}, be_.make_executor(B::Role::upload)},
                                           Compute{{this}, be_.make_executor(B::Role::compute)},
                                           Offload{{this}, be_.make_executor(B::Role::download)},
                                           UserStages(gradient_view())..., Optimize{{this}, HostExecutor(optimizer_threads())});
    // A user stage must not write a ring: the optimizer reads the offload stage's landing slots.
    [this]<std::size_t... J>(std::index_sequence<J...>) {
      [[maybe_unused]] const auto check = [](std::size_t slots) {
        MT_CHECK(slots == 0, "a user stage of the trainer asks for a ring of {} slots; user stages read the landed "
                 "gradients and may write no ring (ring_slots() must be 0)", slots);
      };
      (check(pipeline_->template stage<3 + J>().ring_slots()), ...);
    }(std::index_sequence_for<UserStages...>{});
  }

  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;
  /// Applies an update still in flight (finish_update()) before the trainer goes.
  ~Trainer() {
    try {
      finish_update();
    } catch (const std::exception& e) {
      log_warning("megatrain: the trainer's last update failed while the trainer was destroyed: {}", e.what());
    }
  }

  /// One optimizer step on a batch: ids and labels hold batch_rows * seq_len tokens, row by row
  /// (labels: the next token, or kIgnoreIndex). With TrainerOptions::packed, `positions` (as many)
  /// gives each token's position within its sequence (0 where one starts, and at every row's
  /// first token; empty: each row is one sequence). Throws before changing anything if the batch
  /// is malformed or has no labelled token. With the gradients held for the whole step (exact
  /// clipping), a non-finite loss or gradient is found before any update: it throws (NonFinite::stop)
  /// naming the step, the unit nearest the loss that went non-finite and any weight that holds a
  /// NaN or an infinity, the trainer then taking no further step (stopped_because()); or the step is
  /// skipped (NonFinite::skip; StepStats::skipped). Either way no weight or AdamW state changes.
  /// Without clipping or with stale clipping the updates stream during the backward: a non-finite
  /// step throws after it (the model was updated with it).
  /// `attention_mask` (as many; empty: every token counts) is transformers' attention mask: 1 for
  /// the tokens of the batch's examples, 0 for padding, which must come after a row's tokens
  /// (right padding: attention is causal, so it changes nothing before it) and have no label
  /// (kIgnoreIndex: a padded token's own logits are not transformers'); a mixture of experts'
  /// auxiliary load-balancing loss (whether trained or only reported) and routing statistics then
  /// leave the padding out, as transformers does given that mask.
  StepStats step(std::span<const std::int32_t> ids, std::span<const std::int32_t> labels,
                 std::span<const std::int32_t> positions = {}, std::span<const std::uint8_t> attention_mask = {}) {
    MT_NVTX_RANGE("Trainer::step");
    const auto t0 = std::chrono::steady_clock::now();
    std::int64_t valid = check_batch(ids, labels, opt_.batch_rows);
    MT_CHECK(failed_.empty(), "this trainer stopped at a non-finite step and takes no further step ({})", failed_);
    if (opt_.distributed()) {  // (the loss is the mean over the labelled tokens of the global batch)
      std::int64_t v[1] = {valid};
      opt_.comm->all_reduce_sum(v);
      valid = v[0];
    }
    MT_CHECK(valid > 0, "the batch has no token with a label (all labels are {})", kIgnoreIndex);
    check_positions(positions, opt_.batch_rows);
    check_attention_mask(attention_mask, labels, opt_.batch_rows);
    std::copy(ids.begin(), ids.end(), ids_host_.begin());
    std::copy(labels.begin(), labels.end(), labels_host_.begin());
    stage_positions(positions, opt_.batch_rows);
    stage_attention_mask(attention_mask);

    State& st = *state_;
    st.step = step_ + 1;
    st.adam_step = st.step - skipped_;
    st.lr = opt_.schedule.at(st.step);
    st.loss_scale = 1.0 / static_cast<double>(valid);
    st.clip_coef = 1.0;
    if (opt_.clip_norm > 0 && opt_.clip_mode == ClipMode::stale && last_grad_norm_)
      st.clip_coef = clip_coefficient(*last_grad_norm_, opt_.clip_norm);
    st.sumsq = 0;
    st.micro_rows = opt_.micro_rows();
    if (!devices_.holds(0)) find_touched_rows(ids);  // (the forward's fp32 rows; a streamed gradient's rows)
    load_device_units();

    // (The previous step's AdamW pass, if still in flight, goes first: each unit's prefetch waits
    // for its update.)
    for (std::int64_t m = 0; m < opt_.micro_batches; ++m) pipeline_->submit(step_items(m));
    pipeline_->drain();
    settle();
    // A backend that tunes its matrix products over a trainer's first step fixes its choices then
    // (CudaBackendOptions::gemm_tuning): every later step runs the same algorithms.
    if constexpr (requires { be_.end_gemm_tuning(); }) be_.end_gemm_tuning();
    double grad_norm;
    double loss = sum_loss() * st.loss_scale;
    double aux_loss = local_aux_loss();
    if (opt_.distributed()) {  // every process's share summed: the global batch's loss and gradient
      // (the auxiliary loss: each process's forwards' own, as a rank's in transformers under DDP;
      // the step's the mean over every process's micro-batches; the tokens per expert of the
      // global batch)
      double l[2] = {loss, aux_loss};
      opt_.comm->all_reduce_sum(l);
      loss = l[0];
      aux_loss = l[1] / static_cast<double>(opt_.comm->world());
      if (!router_counts_host_.empty()) opt_.comm->all_reduce_sum(router_counts_host_);
      if (!sums_in_offload_ && !reduces_on_device_)  // (else summed in the backward, as each was completed)
        for (std::size_t u = 0; u < model_.num_units(); ++u) {
          if (opt_.sharded())  // (each process its part's sum: it steps that part)
            opt_.comm->reduce_scatter_sum(store_.unit(u).grad(), store_.shard_bounds(store_.unit(u)));
          else
            opt_.comm->all_reduce_sum(store_.unit(u).grad());
        }
    }
    bool skipped = false;
    // The stages' timings are read while nothing runs: before an AdamW pass that overlaps the next
    // step is submitted (its timings then come with the next step's, as its work runs beside that
    // step's forward), else at the end.
    std::optional<StepStats::Profile> profile;
    if (opt_.resident_gradients()) {
      std::vector<double> unit_sumsq(model_.num_units());
      for (std::size_t u = 0; u < model_.num_units(); ++u) {
        const auto& unit = store_.unit(u);
        const auto [lo, hi] = unit.owned();  // (sharded: this process's part, the parts' sums summed below)
        unit_sumsq[u] = summed_on_device(u) && (!opt_.distributed() || reduces_on_device_)
                            ? sumsq_host_[u]
                            : grad_sum_squares<float>(std::span<const float>(unit.grad()).subspan(
                                  static_cast<std::size_t>(lo), static_cast<std::size_t>(hi - lo)));
      }
      if (opt_.sharded()) opt_.comm->all_reduce_sum(unit_sumsq);
      double sumsq = 0;
      std::size_t bad = model_.num_units();  // the non-finite unit nearest the loss (the backward's first)
      for (std::size_t u = 0; u < model_.num_units(); ++u) {  // in unit order, whatever the placement
        if (!std::isfinite(unit_sumsq[u])) bad = u;
        sumsq += unit_sumsq[u];
      }
      grad_norm = std::sqrt(sumsq);
      // The whole gradient is known before any update (exact clipping's order): a non-finite loss
      // or gradient changes nothing; the run stops there, or skips the step.
      if (!std::isfinite(grad_norm) || !std::isfinite(loss)) {
        // (a non-finite loss: the weights the forward read are looked at, and named)
        const std::string weights = std::isfinite(loss) ? std::string() : nonfinite_weights();
        const std::string what = fmt::format(
            "step {}: the {} not finite (loss {}, gradient norm {}{}{})", st.step,
            std::isfinite(loss) ? "gradient is" : std::isfinite(grad_norm) ? "loss is" : "loss and the gradient are", loss,
            grad_norm,
            bad < model_.num_units() ? fmt::format("; unit '{}' is the first to go non-finite in the backward",
                                                   model_.units()[bad].name)
                                     : std::string(),
            weights.empty() ? std::string() : "; the weights are not finite: " + weights);
        ++skipped_in_a_row_;
        // (skipping cannot help where the weights themselves are not finite)
        if (opt_.on_nonfinite == NonFinite::skip && weights.empty() && skipped_in_a_row_ <= opt_.max_nonfinite_skips) {
          log_warning("{}: the step is skipped (the model and the optimizer state are unchanged; {} skipped in a row, "
                      "the run stops after {})", what, skipped_in_a_row_, opt_.max_nonfinite_skips);
          ++skipped_;
          skipped = true;
        } else {
          failed_ = fmt::format(
              "{}{}; the model and the optimizer state were not updated: they are those of step {}. Look for a NaN or "
              "an infinity in the data or the weights, or lower the learning rate",
              what,
              opt_.on_nonfinite == NonFinite::skip && weights.empty()
                  ? fmt::format(" ({} non-finite steps in a row, more than max_nonfinite_skips {})", skipped_in_a_row_,
                                opt_.max_nonfinite_skips)
                  : std::string(),
              step_);
          --skipped_in_a_row_;  // (this step was not taken: the count stays that of the state kept)
          failed_kept_state_ = true;
          MT_FAIL("{}; this trainer takes no further step", failed_);
        }
      } else {
        skipped_in_a_row_ = 0;
        if (opt_.clip_norm > 0) st.clip_coef = clip_coefficient(grad_norm, opt_.clip_norm);
        pass_ = {st.adam_step, st.lr, st.clip_coef};
        if (opt_.profile && opt_.overlap_update) profile = collect_profile();
        pipeline_->submit(pass_items());
        if (opt_.overlap_update) update_pending_ = true;
        else pipeline_->drain();
        if (opt_.sharded()) {
          store_.state_updated();
          gather_updated();
        }
      }
    } else {  // the host units' sums came with their updates, the device units' from the device
      double sumsq = st.sumsq;
      for (std::size_t u = 0; u < devices_.count(); ++u) sumsq += sumsq_host_[u];
      grad_norm = std::sqrt(sumsq);
    }
    device_newer_ = devices_.count() > 0;
    publish_store_state();
    if (!std::isfinite(grad_norm) || !std::isfinite(loss)) {  // (streamed updates: each unit was updated in the backward)
      if (!skipped) {
        failed_ = fmt::format("step {}: the {} not finite (loss {}, gradient norm {}) and the model was updated with it: "
                              "without clipping or with stale clipping each unit is updated during the backward, before "
                              "the whole gradient is known (exact clipping, the default, stops before any update)",
                              st.step, std::isfinite(loss) ? "gradient is" : "loss is", loss, grad_norm);
        MT_FAIL("{}; this trainer takes no further step", failed_);
      }
    } else {
      last_grad_norm_ = grad_norm;
    }
    step_ = st.step;

    StepStats s;
    s.step = st.step;
    s.skipped = skipped;
    s.loss = loss;
    s.lr = st.lr;
    s.grad_norm = grad_norm;
    s.clip_coef = st.clip_coef;
    s.tokens = opt_.batch_rows * opt_.seq_len * (opt_.distributed() ? opt_.comm->world() : 1);  // (the global batch's)
    s.aux_loss = aux_loss;
    expert_load(s);
    s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (opt_.profile) s.profile = profile ? std::move(*profile) : collect_profile();
    return s;
  }

  /// Mean loss over the labelled tokens of `rows` sequences (forward only; the weights are
  /// not changed). rows must be a multiple of the micro-batch size. `positions` as for step().
  double evaluate(std::span<const std::int32_t> ids, std::span<const std::int32_t> labels, std::int64_t rows,
                  std::span<const std::int32_t> positions = {}) {
    MT_NVTX_RANGE("Trainer::evaluate");
    MT_CHECK(rows > 0 && rows % opt_.micro_rows() == 0, "evaluation rows {} must be a positive multiple of {}", rows,
             opt_.micro_rows());
    const std::int64_t valid = check_batch(ids, labels, rows);
    MT_CHECK(valid > 0, "the evaluation batch has no token with a label");
    check_positions(positions, rows);
    double total = 0;
    const std::int64_t mt = opt_.micro_rows() * opt_.seq_len;
    load_device_units();
    for (std::int64_t first = 0; first < rows; first += opt_.micro_rows()) {
      const auto off = static_cast<std::size_t>(first * opt_.seq_len);
      std::copy_n(ids.begin() + off, mt, ids_host_.begin());
      std::copy_n(labels.begin() + off, mt, labels_host_.begin());
      stage_positions(positions.empty() ? positions : positions.subspan(off, static_cast<std::size_t>(mt)), opt_.micro_rows());
      if (!devices_.holds(0)) find_touched_rows(std::span<const std::int32_t>(ids_host_).first(static_cast<std::size_t>(mt)));
      state_->micro_rows = opt_.micro_rows();
      std::vector<TrainItem> items;
      for (std::size_t u = 0; u <= model_.num_blocks(); ++u) items.push_back({Kind::forward, u, 0, 1});  // (1: keeps nothing)
      items.push_back({Kind::head_eval, model_.head_unit(), 0});
      pipeline_->submit(items);
      pipeline_->drain();
      settle();  // (a pending update went first)
      for (std::int64_t t = 0; t < mt; ++t) total += static_cast<double>(loss_host_[static_cast<std::size_t>(t)]);
    }
    return total / static_cast<double>(valid);
  }

  /// Waits until the last step's update is applied, and writes the state of the device units
  /// back into the store (see the top of this file, TrainerOptions::overlap_update and
  /// device_units): afterwards the store holds the whole train state, and may be read or
  /// written; the next step() or evaluate() loads the device units from it again. Read the
  /// store's weights or moments yourself only after this. Without device units, a no-op when
  /// nothing is in flight.
  void finish_update() {
    MT_NVTX_RANGE("Trainer::finish_update");
    if (update_pending_) pipeline_->drain();
    update_pending_ = false;
    if (device_newer_) save_device_units();
    device_newer_ = false;
    device_owns_ = false;
    publish_store_state();
  }
  /// Whether the last step's update is still being applied (finish_update() waits for it).
  bool update_pending() const { return update_pending_; }

  std::int64_t steps_done() const { return step_; }
  /// Steps skipped as non-finite (TrainerOptions::on_nonfinite skip): in all, and in a row up to
  /// the last step. AdamW's bias correction counts steps_done() - skipped_steps() updates.
  std::int64_t skipped_steps() const { return skipped_; }
  std::int64_t skipped_in_a_row() const { return skipped_in_a_row_; }
  /// Why the trainer stopped (a non-finite step: it takes no further step); empty while it has not.
  const std::string& stopped_because() const { return failed_; }
  /// Whether, stopped, its weights and AdamW states are still those of the last good step (with
  /// the whole gradient known first: exact clipping), which a checkpoint may then keep; false
  /// where the failing step's updates streamed during its backward (no or stale clipping).
  bool stopped_with_last_good_state() const { return !failed_.empty() && failed_kept_state_; }
  const DecoderModel<Block>& model() const { return model_; }
  /// The options in effect (resolved(): micro_batches as max_micro_rows made it).
  const TrainerOptions& options() const { return opt_; }
  /// The global gradient norm of the last step (what ClipMode::stale clips the next step with).
  std::optional<double> last_grad_norm() const { return last_grad_norm_; }
  /// Restores the step counter and the last norm (resuming from a checkpoint whose tensors
  /// were loaded into the store after finish_update()); the next step takes the device units'
  /// state from the store.
  void restore(std::int64_t steps_done, std::optional<double> last_grad_norm, std::int64_t skipped_steps = 0,
               std::int64_t skipped_in_a_row = 0) {
    MT_CHECK(steps_done >= 0, "steps_done must be >= 0");
    MT_CHECK(skipped_steps >= 0 && skipped_steps <= steps_done && skipped_in_a_row >= 0 && skipped_in_a_row <= skipped_steps,
             "restore: {} skipped steps ({} in a row) do not fit {} steps done", skipped_steps, skipped_in_a_row, steps_done);
    MT_CHECK(!update_pending_ && !device_newer_, "restore: the trainer holds a newer state than the store; call "
             "finish_update() before loading the store and restoring");
    device_owns_ = false;
    step_ = steps_done;
    last_grad_norm_ = last_grad_norm;
    skipped_ = skipped_steps;
    skipped_in_a_row_ = skipped_in_a_row;
  }

  /// A function the optimizer stage calls, on its own thread, before it changes unit u's master
  /// weights or moments (each item that steps u calls gate(u) first); it may block. Set it
  /// between calls of step(), not during one (an update in flight sees the old or the new gate
  /// per unit); empty: none. The Checkpointer uses it to write a unit to disk before the next
  /// update changes it.
  void set_update_gate(std::function<void(std::size_t unit)> gate) {
    update_gate_.store(gate ? std::make_shared<const std::function<void(std::size_t)>>(std::move(gate)) : nullptr);
  }
  /// The units in the order the next step first changes them (every unit once).
  std::vector<std::size_t> update_order() const {
    std::vector<std::size_t> order;
    std::vector<char> seen(model_.num_units(), 0);
    const auto add = [&](std::size_t u) {
      if (!seen[u]) order.push_back(u);
      seen[u] = 1;
    };
    if (streamed()) {  // each landed piece is stepped as it lands (Optimize::applies)
      for (const TrainItem& it : step_items(0))
        if (it.carries_gradient()) add(it.unit);
    }
    for (std::size_t u = 0; u < model_.num_units(); ++u) add(u);  // resident: the second pass, in unit order
    return order;
  }

  /// Bytes of backend memory the trainer holds (weight slots, accumulators, checkpoints, scratch,
  /// device units).
  std::size_t device_bytes() const { return device_bytes_; }
  /// How many units (the first in forward order) keep their AdamW state in backend memory.
  std::size_t device_units() const { return devices_.count(); }
  /// Activation checkpoints kept in host memory because the device could not hold them.
  std::size_t spilled_checkpoints() const { return spilled_; }
  /// The memory plan the trainer allocated (plan/memory_plan.hpp): every buffer, in backend and
  /// host memory, and the decisions (checkpoints spilled, device units).
  const plan::MemoryPlan& memory_plan() const { return plan_; }

 private:
  struct State {
    std::int64_t step = 0;
    std::int64_t adam_step = 0;  // AdamW's count (bias correction): the steps not skipped
    double lr = 0, loss_scale = 0, clip_coef = 1;
    double sumsq = 0;  // written by the optimizer stage only
    std::int64_t micro_rows = 0;
  };
  // The AdamW pass of resident gradients (set before it is submitted; the next step's State
  // changes while it may still run).
  struct Pass {
    std::int64_t step = 0;
    double lr = 0, clip_coef = 1;
  };

  // The step's auxiliary loss (StepStats::aux_loss) from what the head items downloaded: each
  // micro-batch's [sparse layer, expert] counts and probability sums (this process's).
  double local_aux_loss() const {
    if (router_counts_host_.empty()) return 0.0;
    const ModelConfig& cfg = model_.config();
    const std::int64_t Lm = cfg.moe_layer_count(), E = cfg.moe.num_experts;
    const auto per = static_cast<std::size_t>(Lm * E);
    double aux = 0;
    for (std::int64_t m = 0; m < opt_.micro_batches; ++m)
      aux += moe_aux_loss(router_counts_host_.subspan(static_cast<std::size_t>(m) * per, per),
                          router_probs_host_.subspan(static_cast<std::size_t>(m) * per, per), Lm, E, counted_tokens(m));
    return aux / static_cast<double>(opt_.micro_batches);
  }
  // ... and each sparse layer's fewest and most tokens per expert (StepStats::expert_load; with
  // several processes, of the global batch: the counts summed over them first).
  void expert_load(StepStats& s) const {
    if (router_counts_host_.empty()) return;
    const ModelConfig& cfg = model_.config();
    const std::int64_t Lm = cfg.moe_layer_count(), E = cfg.moe.num_experts;
    const auto per = static_cast<std::size_t>(Lm * E);
    for (std::int64_t l = 0, idx = 0; l < cfg.num_hidden_layers; ++l) {
      if (!cfg.is_moe_layer(l)) continue;
      StepStats::ExpertLoad load{l, std::numeric_limits<std::int64_t>::max(), 0};
      for (std::int64_t e = 0; e < E; ++e) {
        std::int64_t n = 0;
        for (std::int64_t m = 0; m < opt_.micro_batches; ++m)
          n += router_counts_host_[static_cast<std::size_t>(m) * per + static_cast<std::size_t>(idx * E + e)];
        load.min = std::min(load.min, n);
        load.max = std::max(load.max, n);
      }
      s.expert_load.push_back(load);
      ++idx;
    }
  }
  // A sparse block's routing statistics for micro-batch m (RouterStats): `record` (a training
  // step's forward) where its counts and probabilities go, `aux` (the backward) what the
  // auxiliary loss's gradient reads, when the config asks for that loss. Empty for a dense block.
  RouterStats router_of(std::size_t unit, std::int64_t m, bool record, bool aux) {
    RouterStats r;
    if (router_counts_dev_.size() == 0 || unit < 1 || unit > model_.num_blocks()) return r;
    const std::int64_t l = moe_index_[unit - 1];
    if (l < 0) return r;
    const ModelConfig& cfg = model_.config();
    const std::int64_t Lm = cfg.moe_layer_count(), E = cfg.moe.num_experts;
    const auto micro = static_cast<std::size_t>(m * Lm * E);
    if (record) {
      const auto at = micro + static_cast<std::size_t>(l * E);
      r.counts = View<std::int64_t>(router_counts_dev_.span().subspan(at, static_cast<std::size_t>(E)), Shape{E});
      r.probs = View<double>(router_probs_dev_.span().subspan(at, static_cast<std::size_t>(E)), Shape{E});
    }
    if (aux && cfg.moe.output_router_logits) {
      r.aux_counts = View<const std::int64_t>(
          std::span<const std::int64_t>(router_counts_dev_.span()).subspan(micro, static_cast<std::size_t>(Lm * E)), Shape{Lm, E});
      // (each micro-batch's loss weighs 1 / the micro-batches of the step, every process's: the
      // gradients are summed over the processes)
      const double forwards = static_cast<double>(opt_.micro_batches * (opt_.distributed() ? opt_.comm->world() : 1));
      r.aux_scale = moe_aux_scale(cfg.moe.router_aux_loss_coef, 1.0 / forwards, Lm, E, counted_tokens(m));
    }
    return r;
  }

  static std::vector<std::int64_t> sparse_indices(const ModelConfig& cfg) {
    std::vector<std::int64_t> idx;
    for (std::int64_t l = 0, n = 0; l < cfg.num_hidden_layers; ++l) idx.push_back(cfg.is_moe_layer(l) ? n++ : -1);
    return idx;
  }

  // After a drain: nothing is in flight.
  void settle() {
    update_pending_ = false;
    publish_store_state();
  }
  // The store refuses whole readers (and loaders) while it is not the owner of the whole state
  // (HostParamStore::check_settled): while an update runs, and while the backend holds the
  // device units (after an evaluate() too: a store edited then would not reach them).
  void publish_store_state() { store_.set_update_in_flight(update_pending_ || device_newer_ || device_owns_); }

  // Device units: the backend takes their state from the store when it is not its owner yet.
  void load_device_units() {
    if (device_owns_ || devices_.count() == 0) return;
    MT_NVTX_RANGE("Trainer::load_device_units");
    for (std::size_t u = 0; u < devices_.count(); ++u) {
      const auto& unit = store_.unit(u);
      devices_.load(be_, xfer_, unit, device_weights(u));
      void* stream = nullptr;
      if constexpr (B::kDevice) stream = xfer_.stream();
      // (the store holds this process's part of their bf16 weights: the rest from the others)
      if (weights_in_parts_ && !device_weights(u).empty()) gather_weights(u, 0, stream);
      // A block's weights are made from its masters: the others' parts of them, where each process
      // holds its own (the first update would bring them otherwise).
      if (device_weights(u).empty() && store_.masters_sharded())
        opt_.comm->all_gather_backend_memory(devices_.master_data(u).first(static_cast<std::size_t>(unit.numel())),
                                             store_.shard_bounds(unit), stream);
    }
    xfer_.synchronize();
    device_owns_ = true;
    publish_store_state();
  }
  // ... and gives it back (each unit through the update gate: a checkpoint writer may still read it).
  void save_device_units() {
    MT_NVTX_RANGE("Trainer::save_device_units");
    // (a block's bf16 copy is made in the weights' ring on the compute stream: nothing may run)
    MT_CHECK(!update_pending_, "the device units' state is saved while an update is in flight: call finish_update()");
    const auto gate = update_gate_.load();
    for (std::size_t u = 0; u < devices_.count(); ++u) {
      if (gate) (*gate)(u);
      devices_.save(be_, xfer_, store_, u, std::span<const W>(device_weights(u)), weight_ring_[0].span());
    }
  }

  // ZeRO-1 (TrainerOptions::shard_optimizer): every process stepped its part of each unit; the
  // weights it streams are made whole again from the parts (the same bits on every process).
  void gather_updated() {
    MT_NVTX_RANGE("Trainer::gather_updated");
    store_.gather_updated(*opt_.comm, devices_.count());  // (device units: gathered on the device, Compute)
  }

  // Which weights hold a NaN or an infinity (after a non-finite loss): the first such tensor in
  // unit order as "'name' holds N non-finite values (the first, element i, is v)", and how many
  // more; empty where every master weight is finite. Device units are brought back to the store
  // first (they stay the device's too, unchanged).
  std::string nonfinite_weights() {
    if (device_newer_) {
      save_device_units();
      device_newer_ = false;
    }
    struct Found {
      std::size_t unit = 0, param = 0;
      FiniteScan scan;
    };
    // (sharded masters: the parts this process holds, each scanned from its start in the tensor)
    struct Range {
      std::int64_t begin, end;
    };
    std::vector<Found> all;
    std::vector<Range> where;
    for (std::size_t u = 0; u < store_.num_units(); ++u) {
      const auto& unit = store_.unit(u);
      for (const auto& [a, b] : unit.held_masters())
        for (std::size_t p = 0; p < unit.params().size(); ++p) {
          const auto& param = unit.params()[p];
          const Range r{std::max(a, param.offset), std::min(b, param.offset + param.numel())};
          if (r.end <= r.begin) continue;
          all.push_back({u, p, {}});
          where.push_back(r);
        }
    }
    tbb::parallel_for(std::size_t{0}, all.size(), [&](std::size_t i) {
      Found& f = all[i];
      const auto& param = store_.unit(f.unit).params()[f.param];
      f.scan = scan_finite(store_.unit(f.unit).master().subspan(static_cast<std::size_t>(where[i].begin),
                                                                static_cast<std::size_t>(where[i].end - where[i].begin)));
      f.scan.first += static_cast<std::size_t>(where[i].begin - param.offset);
    });
    std::erase_if(all, [](const Found& f) { return f.scan.ok(); });
    if (store_.masters_sharded()) {  // (every process decides alike: what the others hold counts too)
      std::int64_t found[1] = {static_cast<std::int64_t>(all.size())};
      opt_.comm->all_reduce_sum(found);
      if (all.empty() && found[0] > 0)
        return "weights of another process's part of the model (ZeRO-1; that process's message names them)";
    }
    if (all.empty()) return {};
    const Found& f = all.front();
    return fmt::format("'{}' holds {} non-finite value(s) (the first, element {}, is {}){}",
                       store_.unit(f.unit).params()[f.param].spec.name, f.scan.count, f.scan.first, f.scan.value,
                       all.size() > 1 ? fmt::format(", and {} more tensor(s) do", all.size() - 1) : std::string());
  }

  // ---- stages --------------------------------------------------------------------------------
  template <class X>
  struct Timings {
    std::vector<std::pair<typename X::Mark, typename X::Mark>> spans;
    std::size_t bytes = 0;
    double seconds() const {
      double t = 0;
      for (const auto& [a, b] : spans) t += X::seconds(a, b);
      return t;
    }
    void reset(X& x) {
      spans.clear();
      bytes = 0;
      x.reset_marks();
    }
  };
  /// Marks the start of a stage's work for an item; the returned guard marks its end.
  template <class X>
  struct Timed {
    X& x;
    Timings<X>* t;
    typename X::Mark start{};
    Timed(X& ex, Timings<X>* timings) : x(ex), t(timings) {
      if (t) start = x.mark();
    }
    ~Timed() {
      if (t) t->spans.emplace_back(start, x.mark());
    }
  };

  struct StageBase {
    Trainer* owner;
    void jitter(const TrainItem& it) const {
      if (owner->opt_.jitter_us <= 0) return;
      thread_local std::mt19937 rng(std::random_device{}());
      (void)it;
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % static_cast<unsigned>(owner->opt_.jitter_us + 1)));
    }
  };

  struct Prefetch : StageBase {
    Exec exec;
    Exec& executor() { return exec; }
    std::size_t ring_slots() const { return this->owner->opt_.weight_slots; }
    UnitAccess unit_access() const { return UnitAccess::reads; }
    bool applies(const TrainItem& it) const {
      // The embedding's dedicated slot still holds this step's weights when its backward comes;
      // device units' weights stay on the device. Every host unit's forward passes here, even
      // where it uploads nothing (an untied embedding): rule 4 then holds the unit's forward
      // until its update, i.e. until its waiting gradient has been downloaded, which is what lets
      // kept activations lie over the gradients of the units below them (lay_out_pool). A device
      // block's items that read its weights take a slot here, which the compute stage fills.
      if (this->owner->devices_.holds(it.unit)) return this->owner->makes_device_weights(it);
      return it.kind == Kind::forward || it.kind == Kind::head || it.kind == Kind::head_eval || it.kind == Kind::refill ||
             (it.kind == Kind::backward && it.unit != 0);
    }
    Timings<Exec> timings{};
    void run(const TrainItem& it, const StageSlots& s) {
      MT_NVTX_RANGE("stage:prefetch");
      this->jitter(it);
      Trainer& t = *this->owner;
      if (t.devices_.holds(it.unit)) return;  // (a device block's slot: filled by the compute stage)
      const auto& unit = t.store_.unit(it.unit);
      Timed<Exec> timed(exec, t.opt_.profile ? &timings : nullptr);
      if (it.unit == 0) {
        // The embedding's lookup reads fp32 rows (see the top of this file): the batch's distinct
        // tokens' rows of the master table, gathered once per step (or evaluation part); its bf16
        // weights only where a tied head reads them.
        if (it.kind == Kind::forward && it.micro == 0) {
          const auto d = static_cast<std::size_t>(t.hidden());
          const auto rows = t.touched();
          const std::span<const float> master = unit.master();
          tbb::parallel_for(tbb::blocked_range<std::size_t>(0, rows.size(), 256), [&](const tbb::blocked_range<std::size_t>& r) {
            for (std::size_t i = r.begin(); i != r.end(); ++i)
              std::copy_n(master.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(rows[i]) * d), d,
                          t.embed_rows_host_.begin() + static_cast<std::ptrdiff_t>(i * d));
          });
          t.be_.upload(exec, std::span<const float>(t.embed_rows_host_).first(rows.size() * d),
                       t.embed_rows_.span().first(rows.size() * d));
          timings.bytes += rows.size() * d * sizeof(float);
        }
        if (!t.uploads_weights(it)) return;
      }
      if constexpr (std::is_same_v<W, float>) {
        timings.bytes += static_cast<std::size_t>(unit.numel()) * sizeof(W);
        t.be_.upload(exec, std::span<const float>(unit.master()), t.weight_slot(it.unit, s.out));
      } else {
        // (weights in parts: this process's part alone; the compute stage gathers the rest)
        const auto [lo, hi] = t.weights_in_parts_ ? unit.owned() : std::pair<std::int64_t, std::int64_t>{0, unit.numel()};
        const auto at = static_cast<std::size_t>(lo), n = static_cast<std::size_t>(hi - lo);
        if (t.store_.has_bf16_copy()) {
          timings.bytes += n * sizeof(W);
          t.be_.upload(exec, std::span<const bf16>(unit.compute()).subspan(at, n), t.weight_slot(it.unit, s.out).subspan(at, n));
        } else {  // (no bf16 copy in host memory: the masters, rounded on the GPU)
          timings.bytes += n * sizeof(float);
          t.upload_rounded(exec, std::span<const float>(unit.master()).subspan(at, n), t.weight_slot(it.unit, s.out).subspan(at, n));
        }
      }
      // The unit's full-precision parameters (norm gains) from its fp32 masters: once per step,
      // with the first micro-batch's forward (the rest of the step reads the same values; the
      // unit's last update came before, rule 4).
      if constexpr (kSplitGains)
        if (it.kind != Kind::backward && it.kind != Kind::refill && it.micro == 0) {
          const auto& full = t.full_layout(it.unit);
          for (const auto& e : full.entries()) {
            const auto& p = unit.param(e.spec.name);
            const auto n = static_cast<std::size_t>(e.numel());
            t.be_.upload(exec, std::span<const float>(unit.master()).subspan(static_cast<std::size_t>(p.offset), n),
                         t.gains_[it.unit].span().subspan(static_cast<std::size_t>(e.offset), n));
          }
        }
    }
  };

  struct Compute : StageBase {
    Exec exec;
    std::size_t dy = 0;  // which of the two gradient buffers holds dL/d(current unit's output)
    Timings<Exec> timings{};
    std::vector<StepStats::Profile::Item> timed_items{};  // what each span in `timings` was, and its host time
    Exec& executor() { return exec; }
    std::size_t ring_slots() const { return this->owner->opt_.grad_slots; }
    UnitAccess unit_access() const { return UnitAccess::none; }
    bool applies(const TrainItem& it) const {
      return it.kind == Kind::forward || it.kind == Kind::head || it.kind == Kind::head_eval || it.kind == Kind::backward ||
             it.kind == Kind::refill || (it.kind == Kind::optimize && this->owner->devices_.holds(it.unit));
    }
    // A forward writes no gradient: taking a slot would make it wait for the optimizer stage to
    // pass the item that held the slot, i.e. for the whole AdamW pass still in flight. With
    // micro-batches the forward items keep taking slots: the slots' reuse is what orders the next
    // micro-batch's head (which zeroes the head's and a tied embedding's accumulators) after the
    // offload of the previous micro-batch's embedding gradient. A device unit's update writes
    // no gradient either.
    bool takes_slot(const TrainItem& it) const {
      if (it.kind == Kind::head_eval || it.kind == Kind::optimize || it.kind == Kind::refill) return false;
      return it.kind != Kind::forward || this->owner->opt_.micro_batches > 1;
    }
    void run(const TrainItem& it, const StageSlots& s) {
      MT_NVTX_RANGE("stage:compute");
      this->jitter(it);
      Trainer& t = *this->owner;
      const State& st = *t.state_;
      Timed<Exec> timed(exec, t.opt_.profile ? &timings : nullptr);
      if (t.opt_.profile) timed_items.push_back({static_cast<int>(it.kind), it.unit});
      // Weights in parts (TrainerOptions::gather_weights_on_device): the prefetch uploaded this
      // process's part of the unit's weights; the other processes' parts come from their GPUs.
      if constexpr (B::kDevice)
        if (t.weights_in_parts_ && t.uploads_weights(it)) t.gather_weights(it.unit, s.in, exec.stream());
      if (t.makes_device_weights(it)) t.make_device_weights(it.unit, s.in);
      struct HostClock {  // the host's time to enqueue the item's work (a GPU span as long means launch-bound)
        StepStats::Profile::Item* item;
        std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
        ~HostClock() {
          if (item) item->host_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        }
      } host_clock{t.opt_.profile ? &timed_items.back() : nullptr};
      const std::size_t L = t.model_.num_blocks();
      const std::int64_t rows = st.micro_rows, seq = t.opt_.seq_len, d = t.model_.config().hidden_size;
      const std::int64_t chunk = t.opt_.chunk_rows > 0 ? std::min(t.opt_.chunk_rows, rows) : rows;
      auto rows_of = [&](auto buf, std::int64_t r0, std::int64_t n) {  // [n*seq, d] rows of an activation buffer
        return View<std::remove_reference_t<decltype(buf[0])>>(buf.subspan(static_cast<std::size_t>(r0 * seq * d),
                                                                           static_cast<std::size_t>(n * seq * d)),
                                                               Shape{n * seq, d});
      };
      auto tok = [&](std::span<std::int32_t> buf, std::int64_t r0, std::int64_t n) {
        return View<const std::int32_t>(std::span<const std::int32_t>(buf).subspan(static_cast<std::size_t>(r0 * seq),
                                                                                   static_cast<std::size_t>(n * seq)),
                                        Shape{n * seq});
      };
      auto for_chunks = [&](auto&& f) {
        for (std::int64_t r0 = 0; r0 < rows; r0 += chunk) f(r0, std::min(chunk, rows - r0));
      };
      auto block_chunk = [&](std::int64_t r0, std::int64_t n_rows, RouterStats router = {}) {  // a block's chunk: rows, packing, token blocks
        if (t.masked_)  // (the tokens the routing statistics and the auxiliary loss count)
          router.valid = View<const std::uint8_t>(std::span<const std::uint8_t>(t.valid_dev_.span()).subspan(
                                                      static_cast<std::size_t>(r0 * seq), static_cast<std::size_t>(n_rows * seq)),
                                                  Shape{n_rows * seq});
        return ChunkShape{n_rows, seq, t.packed_rows(it.micro, rows, r0, n_rows), t.token_block(chunk * seq), router};
      };
      switch (it.kind) {
        case Kind::forward: {
          auto out = t.ckpt_out(it.unit);  // where unit u's output goes (its device checkpoint, or a staging buffer)
          if (it.unit == 0) {
            const auto off = static_cast<std::size_t>(it.micro * rows * seq);
            const auto n = static_cast<std::size_t>(rows * seq);
            if (it.piece == 0) t.spill_begin_micro_batch(exec);
            if (it.piece == 0 && t.router_counts_dev_.size() > 0) {  // (a step's forward: its routing recorded from zero)
              const auto per = t.router_counts_dev_.size() / static_cast<std::size_t>(t.opt_.micro_batches);
              t.be_.zero(exec, t.router_counts_dev_.span().subspan(static_cast<std::size_t>(it.micro) * per, per));
              t.be_.zero(exec, t.router_probs_dev_.span().subspan(static_cast<std::size_t>(it.micro) * per, per));
            }
            t.be_.upload(exec, std::span<const std::int32_t>(t.ids_host_).subspan(off, n), t.ids_dev_.span());
            t.be_.upload(exec, std::span<const std::int32_t>(t.labels_host_).subspan(off, n), t.labels_dev_.span());
            if (t.opt_.packed) t.upload_positions(exec, it.micro, rows);
            if (t.masked_ && it.piece == 0)  // (a step's forward: the tokens its auxiliary loss counts)
              t.be_.upload(exec, std::span<const std::uint8_t>(t.valid_host_).subspan(off, n), t.valid_dev_.span());
            // fp32 rows: a device unit's master table, or the batch's distinct rows gathered by
            // the prefetch (indexed by the tokens' compact ids)
            std::span<std::int32_t> ids = t.ids_dev_.span();
            View<const float> table;
            if (t.devices_.holds(0)) {
              table = View<const float>(t.devices_.master(0).first(static_cast<std::size_t>(t.vocab() * d)), Shape{t.vocab(), d});
            } else {
              t.be_.upload(exec, std::span<const std::int32_t>(t.compact_ids_host_).subspan(off, n), t.compact_ids_dev_.span());
              ids = t.compact_ids_dev_.span();
              table = View<const float>(std::span<const float>(t.embed_rows_.span()).first(static_cast<std::size_t>(t.touched_count_ * d)),
                                        Shape{t.touched_count_, d});
            }
            for_chunks([&](std::int64_t r0, std::int64_t n_rows) {
              t.model_.embedding().op().forward_full(t.be_, ChunkShape{n_rows, seq}, table, tok(ids, r0, n_rows),
                                                     rows_of(out, r0, n_rows), t.arena_);
            });
          } else {
            const auto& tmpl = t.model_.block(it.unit - 1);
            const auto w = t.weights(tmpl, it.unit, s.in);
            const auto in = t.ckpt_out(it.unit - 1);  // the previous unit's output is still there
            const RouterStats router = t.router_of(it.unit, it.micro, it.piece == 0, false);  // (a step's: recorded)
            const bool spills = it.piece == 0 && t.plan_.buffers.spills(it.unit);
            if (it.piece == 0 && (t.plan_.buffers.keeps(it.unit) || spills)) {  // its activations stay for the backward
              if constexpr (plan::keeps_activations<B, Block>) {
                Arena kept(spills ? t.spill_stage_for_forward(exec, it.unit) : t.kept_[it.unit]);
                for_chunks([&](std::int64_t r0, std::int64_t n_rows) {
                  tmpl.op().forward_keep(t.be_, block_chunk(r0, n_rows, router), w, View<const Res>(rows_of(in, r0, n_rows)),
                                         rows_of(out, r0, n_rows), kept, t.arena_);
                });
                if (spills) t.spill_down(exec, it.unit);  // (in host memory until the backward)
              }
            } else {
              for_chunks([&](std::int64_t r0, std::int64_t n_rows) {
                tmpl.op().forward(t.be_, block_chunk(r0, n_rows, router), w, View<const Res>(rows_of(in, r0, n_rows)),
                                  rows_of(out, r0, n_rows), t.arena_);
              });
            }
          }
          t.spill(exec, it.unit);
          break;
        }
        case Kind::refill: {  // a block's output again, from the checkpoint below it (or the output refilled before)
          const auto& tmpl = t.model_.block(it.unit - 1);
          const auto w = t.weights(tmpl, it.unit, s.in);
          const auto in = t.ckpt_in(exec, it.unit - 1);
          const auto out = t.ckpt_out(it.unit);
          for_chunks([&](std::int64_t r0, std::int64_t n_rows) {
            tmpl.op().forward(t.be_, block_chunk(r0, n_rows), w, View<const Res>(rows_of(in, r0, n_rows)), rows_of(out, r0, n_rows),
                              t.arena_);
          });
          break;
        }
        case Kind::head:
        case Kind::head_eval: {
          const auto& tmpl = t.model_.head();
          const auto w = t.weights(tmpl, it.unit, s.in, {{&t.model_.embedding().layout(), std::span<const W>(t.embed_slot_.span())}});
          const auto x = t.ckpt_out(L);
          if (it.kind == Kind::head) {  // (accumulators that add up micro-batches: at the first)
            if (t.fresh(it, it.unit)) t.be_.zero(exec, t.head_acc_.span());
            if (t.model_.head().op().tied() && t.fresh(it, 0)) t.be_.zero(exec, t.embed_acc_);
          }
          // (untied: the head's own lm_head; the embedding's gradient buffer is not bound)
          const auto g = t.model_.head().op().tied()
                             ? tmpl.bind(t.head_acc_.span(), {{&t.model_.embedding().layout(), t.embed_acc_}})
                             : tmpl.bind(t.head_acc_.span());
          for_chunks([&](std::int64_t r0, std::int64_t n_rows) {
            const ChunkShape c{n_rows, seq};
            auto loss = View<Acc>(t.loss_dev_.span().subspan(static_cast<std::size_t>(r0 * seq), static_cast<std::size_t>(n_rows * seq)),
                                  Shape{n_rows * seq});
            if (it.kind == Kind::head)
              tmpl.op().forward_backward(t.be_, c, w, View<const Res>(rows_of(x, r0, n_rows)), tok(t.labels_dev_.span(), r0, n_rows),
                                         st.loss_scale, loss, rows_of(t.dbuf_[0].span(), r0, n_rows), g, t.arena_);
            else
              tmpl.op().forward(t.be_, c, w, View<const Res>(rows_of(x, r0, n_rows)), tok(t.labels_dev_.span(), r0, n_rows), loss,
                                t.arena_);
          });
          if (it.kind == Kind::head && t.streamed_unit(0) && t.model_.head().op().tied()) {
            // The touched rows' share of the tied head's gradient moves to the compact buffer,
            // where the embedding's backward adds its own; the rest of the table is final.
            const auto U = static_cast<std::size_t>(t.touched_count_);
            t.be_.upload(exec, std::span<const std::int32_t>(t.touched_host_).first(U), t.touched_dev_.span().first(U));
            t.be_.take_rows(View<const std::int32_t>(std::span<const std::int32_t>(t.touched_dev_.span()).first(U),
                                                     Shape{t.touched_count_}),
                            t.embed_table_grad(), t.touched_grad());
          }
          dy = 0;
          t.be_.download(exec, std::span<const Acc>(t.loss_dev_.span()),
                         t.loss_host_.subspan(it.kind == Kind::head ? static_cast<std::size_t>(it.micro * rows * seq) : 0,
                                              static_cast<std::size_t>(rows * seq)));
          if (it.kind == Kind::head && t.router_counts_dev_.size() > 0) {  // the micro-batch's routing, for StepStats
            const auto per = t.router_counts_dev_.size() / static_cast<std::size_t>(t.opt_.micro_batches);
            const auto at = static_cast<std::size_t>(it.micro) * per;
            t.be_.download(exec, std::span<const std::int64_t>(t.router_counts_dev_.span()).subspan(at, per),
                           t.router_counts_host_.subspan(at, per));
            t.be_.download(exec, std::span<const double>(t.router_probs_dev_.span()).subspan(at, per),
                           t.router_probs_host_.subspan(at, per));
          }
          break;
        }
        case Kind::backward: {
          if (it.unit == 0) {
            const bool tied = t.model_.head().op().tied();
            // Streamed: into the compact buffer of touched rows, indexed by the tokens' compact ids.
            std::span<std::int32_t> ids = t.ids_dev_.span();
            typename Embedding::template Weights<Acc> g{};
            if (t.streamed_unit(0)) {
              const auto off = static_cast<std::size_t>(it.micro * rows * seq), n = static_cast<std::size_t>(rows * seq);
              t.be_.upload(exec, std::span<const std::int32_t>(t.compact_ids_host_).subspan(off, n), t.compact_ids_dev_.span());
              ids = t.compact_ids_dev_.span();
              g.table = t.touched_grad();
              if (!tied) t.be_.zero(exec, g.table.span());
            } else {
              if (!tied && t.fresh(it, 0)) t.be_.zero(exec, t.embed_acc_);
              g = t.model_.embedding().bind(t.embed_acc_);
            }
            // (the padding row, if any: by its index among the touched rows where ids are compact)
            const std::int32_t skip = t.streamed_unit(0) ? t.compact_padding_ : t.model_.embedding().op().padding_id();
            for_chunks([&](std::int64_t r0, std::int64_t n_rows) {
              t.model_.embedding().op().backward(t.be_, ChunkShape{n_rows, seq}, tok(ids, r0, n_rows),
                                                 View<const Res>(rows_of(t.dbuf_[dy].span(), r0, n_rows)), g, t.arena_, skip);
            });
          } else {
            const auto& tmpl = t.model_.block(it.unit - 1);
            const auto w = t.weights(tmpl, it.unit, s.in);
            auto acc = t.grad_target(it.unit, s.out);
            if (t.fresh(it, it.unit)) t.be_.zero(exec, acc);
            const auto g = tmpl.bind(acc);
            const auto x = t.ckpt_in(exec, it.unit - 1);
            const RouterStats router = t.router_of(it.unit, it.micro, false, true);  // (the auxiliary loss's gradient)
            const bool spilled = t.plan_.buffers.spills(it.unit);
            t.spill_fetch();  // (copies up ahead of the spilled blocks' backward)
            if (t.plan_.buffers.keeps(it.unit) || spilled) {  // from the activations its forward kept
              if constexpr (plan::keeps_activations<B, Block>) {
                Arena kept(spilled ? t.spill_stage_for_backward(exec, it.unit) : t.kept_[it.unit]);
                for_chunks([&](std::int64_t r0, std::int64_t n_rows) {
                  tmpl.op().backward_kept(t.be_, block_chunk(r0, n_rows, router), w, View<const Res>(rows_of(x, r0, n_rows)),
                                          View<const Res>(rows_of(t.dbuf_[dy].span(), r0, n_rows)),
                                          rows_of(t.dbuf_[1 - dy].span(), r0, n_rows), g, kept, t.arena_);
                });
                if (spilled) t.spill_backward_done(exec, it.unit);
              }
            } else {
              for_chunks([&](std::int64_t r0, std::int64_t n_rows) {
                tmpl.op().backward(t.be_, block_chunk(r0, n_rows, router), w, View<const Res>(rows_of(x, r0, n_rows)),
                                   View<const Res>(rows_of(t.dbuf_[dy].span(), r0, n_rows)), rows_of(t.dbuf_[1 - dy].span(), r0, n_rows),
                                   g, t.arena_);
              });
            }
            dy = 1 - dy;
          }
          break;
        }
        case Kind::optimize: {  // a device unit's update, with this step's or the AdamW pass's scalars
          const bool pass = t.opt_.resident_gradients();
          const auto& unit = t.store_.unit(it.unit);
          t.devices_.step(t.be_, unit, t.owned_gradient(it.unit, s.out), t.device_weights(it.unit), t.opt_.adamw,
                          pass ? t.pass_.step : st.adam_step, pass ? t.pass_.lr : st.lr, pass ? t.pass_.clip_coef : st.clip_coef);
          if (t.opt_.sharded()) {  // (each process stepped its part: the others' parts of its weights and masters)
            void* stream = nullptr;
            if constexpr (B::kDevice) stream = exec.stream();
            if (!t.device_weights(it.unit).empty()) t.gather_weights(it.unit, 0, stream);
            t.opt_.comm->all_gather_backend_memory(t.devices_.master_data(it.unit).first(static_cast<std::size_t>(unit.numel())),
                                                   t.store_.shard_bounds(unit), stream);
          }
          break;
        }
        case Kind::grad_piece:
        case Kind::embed_rest: break;
      }
      // The unit's share of the global norm, summed on the device once its gradient is complete
      // (the embedding's only after its backward: a tied head adds to it first).
      // Several processes: the complete gradient first summed over them there (each its part's
      // sum where the optimizer is sharded), and only this process's part counted.
      const bool completes = it.kind == Kind::head || it.kind == Kind::backward;
      if (completes && it.micro + 1 == t.opt_.micro_batches && t.summed_on_device(it.unit)) {
        std::span<Acc> g = t.grad_target(it.unit, s.out);
        if constexpr (std::is_same_v<Acc, float>)
          if (t.reduces_on_device_) {
            void* stream = nullptr;
            if constexpr (B::kDevice) stream = exec.stream();
            const auto& unit = t.store_.unit(it.unit);
            if (t.opt_.sharded()) {
              t.opt_.comm->reduce_scatter_backend_memory(g.data(), t.store_.shard_bounds(unit), stream);
              const auto [lo, hi] = unit.owned();
              g = g.subspan(static_cast<std::size_t>(lo), static_cast<std::size_t>(hi - lo));
              if (t.keeps_part(it.unit)) {  // (its part alone waits: the whole buffer free for the next block)
                const std::span<Acc> part = t.grad_acc(it.unit, s.out);
                const Shape shape{static_cast<std::int64_t>(g.size())};
                t.be_.copy(View<const Acc>(std::span<const Acc>(g), shape), View<Acc>(part, shape));
                g = part;
              }
            } else {
              t.opt_.comm->sum_backend_memory(g.data(), g.size(), stream);
            }
          }
        const auto sum = t.sumsq_dev_.span().subspan(it.unit, 1);
        t.be_.sum_squares(View<const Acc>(std::span<const Acc>(g), Shape{static_cast<std::int64_t>(g.size())}),
                          View<double>(sum, Shape{1}));
        t.be_.download(exec, std::span<const double>(sum), t.sumsq_host_.subspan(it.unit, 1));
      }
    }
  };

  struct Offload : StageBase {
    Exec exec;
    Timings<Exec> timings{};
    Exec& executor() { return exec; }
    // The store's landing slots (streamed, or the AdamW pass's pieces of gradients waiting on the
    // device); with GradientHome::host, the two host staging buffers where micro-batches after
    // the first land before the optimizer stage adds them into the resident gradient (none
    // without micro-batches: each unit lands in place).
    std::size_t ring_slots() const {
      const Trainer& t = *this->owner;
      if (t.grads_on_host()) return t.opt_.micro_batches > 1 ? t.staging_.size() : 0;
      return t.store_.grad_ring_slots();
    }
    UnitAccess unit_access() const { return UnitAccess::none; }
    // Every item that lands a gradient (an untied model's embed_rest pieces land none). With
    // micro-batches added up in host memory also the forwards, for nothing but their completion:
    // recorded on this stream, it covers every download before it, so the compute stage's next
    // head, reusing a forward's ring slot, waits for the previous micro-batch's last download
    // (a forward passed through would hand on only its own compute).
    bool applies(const TrainItem& it) const {
      const Trainer& t = *this->owner;
      if (it.kind == Kind::forward) return t.grads_on_host() && t.opt_.micro_batches > 1;
      return it.carries_gradient() && !(it.kind == Kind::embed_rest && !t.model_.head().op().tied());
    }
    bool takes_slot(const TrainItem& it) const { return it.kind != Kind::forward; }  // (writes no staging slot)
    void run(const TrainItem& it, const StageSlots& s) {
      MT_NVTX_RANGE("stage:offload");
      if (it.kind == Kind::forward) return;
      this->jitter(it);
      Trainer& t = *this->owner;
      if (!t.grads_on_host()) {  // a piece into a landing slot
        const Piece p = t.piece(it, s.in);
        Timed<Exec> timed(exec, t.opt_.profile ? &timings : nullptr);
        timings.bytes += p.device.size() * sizeof(Acc);
        t.be_.download(exec, p.device, t.store_.grad_slot(s.out).first(p.device.size()));
        return;
      }
      const auto& unit = t.store_.unit(it.unit);
      const auto n = static_cast<std::size_t>(unit.numel());
      Timed<Exec> timed(exec, t.opt_.profile ? &timings : nullptr);
      timings.bytes += n * sizeof(Acc);
      std::span<const Acc> src = t.grad_acc(it.unit, s.in);
      // Several processes: summed over them first, in the backend's memory (TrainerOptions::sum_during_backward).
      if constexpr (std::is_same_v<Acc, float>)
        if (t.sums_in_offload_) {
          void* stream = nullptr;
          if constexpr (B::kDevice) stream = exec.stream();
          t.opt_.comm->sum_backend_memory(const_cast<float*>(src.data()), src.size(), stream);
        }
      // The first micro-batch lands in place; later ones in a staging slot (see Optimize).
      t.be_.download(exec, src, it.micro == 0 ? unit.grad() : t.staging_[s.out].first(n));
    }
  };

  struct Optimize : StageBase {
    HostExecutor exec;
    Timings<HostExecutor> timings{};
    HostExecutor& executor() { return exec; }
    std::size_t ring_slots() const { return 0; }
    UnitAccess unit_access() const { return UnitAccess::writes; }
    // AdamW on each landed piece (streamed, or the AdamW pass of gradients that waited on the
    // device). GradientHome::host: adds each later micro-batch's staged gradient into the unit's
    // resident gradient, and AdamW on it in the pass. Device units are the compute stage's.
    bool applies(const TrainItem& it) const {
      const Trainer& t = *this->owner;
      if (!t.grads_on_host()) return it.carries_gradient();
      return it.kind == Kind::optimize ? !t.devices_.holds(it.unit) : it.carries_gradient() && it.micro > 0;
    }
    void run(const TrainItem& it, const StageSlots& s) {
      MT_NVTX_RANGE("stage:optimizer");
      this->jitter(it);
      Trainer& t = *this->owner;
      State& st = *t.state_;
      const auto& unit = t.store_.unit(it.unit);
      Timed<HostExecutor> timed(exec, t.opt_.profile ? &timings : nullptr);
      if (it.kind != Kind::optimize && t.grads_on_host()) {  // gradient accumulation on the host
        const auto n = static_cast<std::size_t>(unit.numel());
        exec.run([&] { accumulate_gradient<float>(unit.grad(), std::span<const float>(t.staging_[s.in].first(n))); });
        return;
      }
      if (const auto gate = t.update_gate_.load()) (*gate)(it.unit);
      const auto grad = t.landed_gradient(it, s);
      exec.run([&] {
        if (it.kind == Kind::optimize) {  // the AdamW pass, possibly while the next step begins: its own scalars
          if (t.grads_on_host()) {  // (a sharded store: its part of the unit)
            const auto [lo, hi] = unit.owned();
            const AdamWSegment<float> part{static_cast<std::size_t>(lo), static_cast<std::size_t>(hi - lo),
                                           grad.data() + lo};
            adamw_segments<float>(unit, std::span(&part, 1), t.opt_.adamw, t.pass_.step, t.pass_.lr, t.pass_.clip_coef);
          } else {
            adamw_segments<float>(unit, t.segments(it, grad), t.opt_.adamw, t.pass_.step, t.pass_.lr, t.pass_.clip_coef);
          }
          return;
        }
        // One pass over the landed gradient: AdamW sums its squares (for the norm) as it goes.
        // Elements outside the segments (touched rows inside an embed_rest piece) read zero.
        st.sumsq += adamw_segments<float>(unit, t.segments(it, grad), t.opt_.adamw, st.adam_step, st.lr, st.clip_coef);
      });
    }
  };

  using Pipeline = StreamPipeline<TrainItem, Prefetch, Compute, Offload, UserStages..., Optimize>;

  // ---- memory --------------------------------------------------------------------------------
  void check_store() {
    const auto specs = model_.units();
    MT_CHECK(store_.has_bf16_copy() == opt_.host_bf16_copy,
             "the store keeps {} bf16 copy of the weights but the trainer's options say {}: build the store with "
             "Trainer::store_options(options)", store_.has_bf16_copy() ? "a" : "no",
             opt_.host_bf16_copy ? "it streams the copy (host_bf16_copy)" : "it streams the masters (host_bf16_copy false)");
    MT_CHECK(store_.num_units() == specs.size(), "the store has {} units but the model has {}", store_.num_units(),
             specs.size());
    for (std::size_t u = 0; u < specs.size(); ++u) {
      const auto& su = store_.unit(u);
      MT_CHECK(su.params().size() == specs[u].params.size(), "unit {} ('{}') has {} tensors in the store, {} in the model", u,
               su.name(), su.params().size(), specs[u].params.size());
      for (std::size_t p = 0; p < specs[u].params.size(); ++p)
        MT_CHECK(su.params()[p].spec.name == specs[u].params[p].name && su.params()[p].spec.shape == specs[u].params[p].shape,
                 "unit '{}': the store has {} {} where the model expects {} {}", su.name(), su.params()[p].spec.name,
                 su.params()[p].spec.shape.str(), specs[u].params[p].name, specs[u].params[p].shape.str());
    }
    if (grads_on_host()) {
      MT_CHECK(store_.resident_gradients(),
               "this configuration ({}, gradients waiting in host memory) needs resident gradients: build the store "
               "with Trainer::store_options()",
               opt_.micro_batches > 1 ? "gradient accumulation" : "exact clipping");
      return;
    }
    MT_CHECK(store_.grad_ring_slots() >= 2,
             "the store's gradient ring has {} slots, the trainer needs at least 2: build it with Trainer::store_options()",
             store_.grad_ring_slots());
    // Blocks land whole (gradients waiting on the device: in pieces, any size will do); the
    // embedding lands in whole rows; its table is the unit's only tensor.
    std::int64_t block_numel = 0;
    for (std::size_t l = 0; l < model_.num_blocks(); ++l) block_numel = std::max(block_numel, store_.unit(l + 1).numel());
    MT_CHECK(grads_on_device() || slot_numel() >= std::max(block_numel, model_.config().hidden_size),
             "the store's gradient landing slots hold {} elements, less than a decoder block ({}): build it with "
             "Trainer::store_options()",
             slot_numel(), block_numel);
    MT_CHECK(store_.unit(0).params().size() == 1 && store_.unit(0).params()[0].offset == 0,
             "the embedding unit must hold the table alone, at offset 0");
  }

  // The trainer's memory is what plan::plan_memory() says (plan/memory_plan.hpp), allocated here
  // buffer by buffer in its order; a configuration that does not fit is refused before anything
  // is allocated, with what would fit.
  void allocate() {
    MT_NVTX_RANGE("Trainer::allocate");
    const plan::DeviceBudget budget = plan::device_budget(be_, sizeof...(UserStages) > 0);
    const plan::HostBudget host{store_.host_budget(), "the host memory budget the store was built with"};
    // (decided on this machine's figures where megatrain-plan --probe kept them: plan::machine_figures())
    plan_ = plan::plan_memory<B>(model_, opt_, budget, host, store_.footprint(),
                                 B::kDevice ? plan::machine_figures() : plan::MachineFigures{});
    if (!plan_.fits) MT_FAIL("{}", plan::refusal_message(plan_, plan::suggest<B>(model_, opt_, budget, host, store_.footprint())));
    const plan::TrainerBuffers& b = plan_.buffers;
    const std::size_t L = model_.num_blocks();
    for (std::size_t k = 0; k < b.weight_slots; ++k) weight_ring_.push_back(alloc<W>(b.block_slot));
    // The blocks' own accumulators and the kept activations: one buffer, laid out by the plan
    // (plan::TrainerBuffers::lay_out_pool: kept activations may lie over gradients already used).
    pool_ = alloc<std::byte>(b.pool_bytes);
    block_acc_.assign(L + 2, {});
    kept_.assign(L + 2, {});
    for (std::size_t u = 0; u < b.block_acc.size(); ++u)
      if (b.block_acc[u] > 0) block_acc_[u] = pool_as<Acc>(b.acc_at[u], b.block_acc[u]);
    for (std::size_t u = 1; u <= L; ++u)
      if (b.keeps(u)) kept_[u] = pool_as<std::byte>(b.kept_at[u], b.kept_bytes[u]);
    grad_whole_ = alloc<Acc>(b.grad_whole);  // (blocks keeping their part of the sum: where a whole one is made)
    for (std::size_t k = 0; k < b.grad_slots; ++k) grad_ring_.push_back(alloc<Acc>(b.block_slot));
    if constexpr (kSplitGains)
      for (std::size_t u = 0; u < b.units; ++u) gains_.push_back(alloc<full_t<W>>(b.gains[u]));
    embed_slot_ = alloc<W>(b.embed_slot);
    head_slot_ = alloc<W>(b.head_slot);
    master_staging_ = alloc<float>(b.master_staging);
    // resident gradients (in the pool where plan::TrainerBuffers::embed_acc_in_pool), or a tied head's share (streamed)
    if (b.embed_acc_in_pool) {
      embed_acc_ = pool_as<Acc>(b.acc_at[0], b.embed_acc);
    } else {
      embed_acc_mem_ = alloc<Acc>(b.embed_acc);
      embed_acc_ = embed_acc_mem_.span();
    }
    rows_acc_ = alloc<Acc>(b.rows_acc);    // streamed: the touched rows' compact gradient, their list, the compact ids
    touched_dev_ = alloc<std::int32_t>(b.touched);
    compact_ids_dev_ = alloc<std::int32_t>(b.compact_ids);
    head_acc_ = alloc<Acc>(b.head_acc);
    for (int k = 0; k < 2; ++k) dbuf_.push_back(alloc<Res>(b.act));
    scratch_mem_ = alloc<std::byte>(b.scratch_bytes);
    arena_ = Arena(scratch_mem_.span());
    ids_dev_ = alloc<std::int32_t>(b.micro_tokens);
    labels_dev_ = alloc<std::int32_t>(b.micro_tokens);
    if (b.packed) {  // a micro-batch's positions, and where its sequences start (at most one per token)
      MT_CHECK(b.batch_tokens < static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()),
               "packed rows: a batch of {} tokens exceeds the int32 offsets of its sequences", b.batch_tokens);
      positions_dev_ = alloc<std::int32_t>(b.micro_tokens);
      starts_dev_ = alloc<std::int32_t>(b.micro_tokens + 1);
    }
    loss_dev_ = alloc<Acc>(b.micro_tokens);
    sumsq_dev_ = alloc<double>(b.units);
    if (b.router > 0) {  // (a mixture of experts)
      router_counts_dev_ = alloc<std::int64_t>(b.router);
      router_probs_dev_ = alloc<double>(b.router);
    }
    if (b.token_mask) valid_dev_ = alloc<std::uint8_t>(b.micro_tokens);  // (the auxiliary loss: which tokens count)
    if constexpr (requires { typename B::WorkspacePlan; }) be_.prepare(b.workspace);  // backends that allocate workspaces up front
    // The embedding's fp32 rows for the lookup (a host embedding): first when no unit will be on
    // the device, else after the placement (from the reserve it leaves).
    if (b.embed_rows_first) alloc_embed_rows();
    // Outputs between checkpoints (a checkpoint every k blocks), then the activation checkpoints:
    // the first on the device, the rest in pinned host memory through two device staging buffers.
    for (std::size_t k = 0; k < b.recompute_buffers; ++k) recompute_.push_back(alloc<Res>(b.act));
    const std::size_t fit = b.checkpoints_on_device;
    ckpt_.resize(L + 1);
    ckpt_host_.resize(L + 1);
    for (std::size_t u = 0; u <= L; ++u) {
      if (!b.kept(u)) continue;
      if (b.checkpoint_index(u) < fit) {
        ckpt_[u] = alloc<Res>(b.act);
      } else {
        ckpt_host_mem_.push_back(HostBuffer::allocate(b.checkpoint_bytes()));
        ckpt_host_[u] = ckpt_host_mem_.back().template as<Res>(0, b.act);
      }
    }
    spilled_ = b.checkpoints_in_host();
    if (spilled_ > 0)
      for (int k = 0; k < 2; ++k) ckpt_staging_.push_back(alloc<Res>(b.act));
    // Spilled activations: two device staging buffers, each spilled block's in pinned host memory.
    spill_host_.assign(L + 2, {});
    if (b.spilled_blocks > 0) {
      for (int k = 0; k < 2; ++k) spill_stage_.push_back(alloc<std::byte>(b.spill_slot_bytes));
      for (std::size_t u = L; u >= 1; --u)
        if (b.spills(u)) {
          spill_host_mem_.push_back(HostBuffer::allocate(b.kept_bytes[u]));
          spill_host_[u] = spill_host_mem_.back().template as<std::byte>(0, b.kept_bytes[u]);
          spill_order_.push_back(u);
        }
      spill_down_.emplace(be_.make_executor(B::Role::download));
      spill_up_.emplace(be_.make_executor(B::Role::upload));
      spill_test_delay_ns_ = fault::delay_of("spill") * 1000;  // (tests: delay@spill=MICROSECONDS)
    }
    // Host: ids, labels, compact ids and touched rows (int32), then per-token losses; pinned with a GPU
    const std::size_t batch_tokens = b.batch_tokens;
    host_io_ = HostBuffer::allocate(batch_tokens * (4 * sizeof(std::int32_t) + sizeof(Acc)));
    if (b.packed) {  // positions, then the sequences' starts (pinned: uploaded asynchronously)
      positions_mem_ = HostBuffer::allocate((2 * batch_tokens + 1) * sizeof(std::int32_t));
      positions_host_ = positions_mem_.template as<std::int32_t>(0, batch_tokens);
      starts_host_ = positions_mem_.template as<std::int32_t>(batch_tokens, batch_tokens + 1);
      row_seq_.assign(static_cast<std::size_t>(opt_.batch_rows) + 1, 0);
    }
    ids_host_ = host_io_.template as<std::int32_t>(0, batch_tokens);
    labels_host_ = host_io_.template as<std::int32_t>(batch_tokens, batch_tokens);
    compact_ids_host_ = host_io_.template as<std::int32_t>(2 * batch_tokens, batch_tokens);
    touched_host_ = host_io_.template as<std::int32_t>(3 * batch_tokens, batch_tokens);
    loss_host_ = std::span<Acc>(reinterpret_cast<Acc*>(touched_host_.data() + batch_tokens), batch_tokens);
    sumsq_host_mem_ = HostBuffer::allocate(b.units * sizeof(double));
    sumsq_host_ = sumsq_host_mem_.template as<double>(0, b.units);
    if (b.token_mask) {
      valid_mem_ = HostBuffer::allocate(batch_tokens);
      valid_host_ = valid_mem_.template as<std::uint8_t>(0, batch_tokens);
    }
    if (b.router > 0) {
      router_host_mem_ = HostBuffer::allocate(b.router * 16);
      router_counts_host_ = router_host_mem_.template as<std::int64_t>(0, b.router);
      router_probs_host_ = router_host_mem_.template as<double>(b.router, b.router);
    }
    if (b.staging > 0) {
      staging_mem_ = HostBuffer::allocate(2 * b.staging * sizeof(float));
      for (std::size_t k = 0; k < 2; ++k) staging_.push_back(staging_mem_.template as<float>(k * b.staging, b.staging));
    }
    place_device_units();
    if (b.embed_rows > 0 && !b.embed_rows_first) alloc_embed_rows();
    device_bytes_ = plan_.device_total();
  }
  // A backend buffer of n elements; none (no memory at all) for n = 0, as the plan counts it.
  template <class E>
  Buf<E> alloc(std::size_t n) {
    return n == 0 ? Buf<E>() : be_.template alloc<E>(n);
  }
  // n elements of the pool from byte `at` (256-byte aligned by the plan).
  template <class E>
  std::span<E> pool_as(std::size_t at, std::size_t n) {
    return {reinterpret_cast<E*>(pool_.span().data() + at), n};
  }
  // The embedding's fp32 rows for the lookup, on the device and in (pinned) host memory, and the
  // compact ids where no streamed gradient has them already.
  void alloc_embed_rows() {
    const std::size_t n = plan_.buffers.embed_rows;
    embed_rows_ = alloc<float>(n);
    embed_rows_host_mem_ = HostBuffer::allocate(n * sizeof(float));
    embed_rows_host_ = embed_rows_host_mem_.template as<float>(0, n);
    if (compact_ids_dev_.size() == 0) compact_ids_dev_ = alloc<std::int32_t>(plan_.buffers.micro_tokens);
  }

  // Device units (TrainerOptions::device_units): the plan's count; each needs its state and its
  // own gradient accumulator where gradients would otherwise share a ring or land in pieces (a
  // block's weights are made in the ring's slots from its masters).
  void place_device_units() {
    const std::size_t count = plan_.buffers.device_units;
    opt_.device_units = static_cast<std::int64_t>(count);
    opt_.checkpoint_every = static_cast<std::int64_t>(plan_.buffers.checkpoint_every);
    opt_.kept_blocks = static_cast<std::int64_t>(plan_.buffers.kept_blocks);
    opt_.spilled_blocks = static_cast<std::int64_t>(plan_.buffers.spilled_blocks);
    if (count == 0) return;
    devices_ = DeviceUnits<B>(be_, store_, count);
    for (std::size_t u = 1; u < count && u != model_.head_unit(); ++u)
      if (block_acc_[u].empty())
        block_acc_[u] = (device_acc_.emplace_back(alloc<Acc>(static_cast<std::size_t>(store_.unit(u).numel())))).span();
    if (embed_acc_.empty()) {
      embed_acc_mem_ = alloc<Acc>(static_cast<std::size_t>(store_.unit(0).numel()));
      embed_acc_ = embed_acc_mem_.span();
    }
  }

  // Unit u's output during the forward: its device checkpoint, or (spilled) a staging buffer
  // that alternates with u's neighbours, so the next unit still reads its input from the device.
  // With a checkpoint every k >= 2 blocks, an output that is none lives in a recompute buffer,
  // and the last block's (read only by the head, right after) in the second activation-gradient
  // buffer, which the head does not write.
  std::span<Res> ckpt_out(std::size_t u) {
    const plan::TrainerBuffers& b = plan_.buffers;
    if (!b.kept(u)) return u == model_.num_blocks() ? dbuf_[1].span() : recompute_[b.recompute_buffer(u)].span();
    return ckpt_host_[u].empty() ? ckpt_[u].span() : ckpt_staging_[u % 2].span();
  }
  // After unit u's forward: a spilled checkpoint goes to host memory (on the compute stream,
  // ordered after the kernels that wrote it).
  void spill(Exec& exec, std::size_t u) {
    if (plan_.buffers.kept(u) && !ckpt_host_[u].empty())
      be_.download(exec, std::span<const Res>(ckpt_staging_[u % 2].span()), ckpt_host_[u]);
  }
  // Spilled activations (TrainerOptions::spilled_blocks), on the Compute stage's thread. A
  // micro-batch's forward starts with the staging buffers free: their last readers were on the
  // compute stream, and it waits for the spill streams' last copies (every one consumed in a step
  // that ran to its end; not so after a step that threw).
  void spill_begin_micro_batch(Exec& exec) {
    if (spill_order_.empty()) return;
    exec.wait(spill_down_->complete());
    exec.wait(spill_up_->complete());
    spill_free_ = {};
    spill_fetched_ = spill_used_ = 0;
  }
  std::span<std::byte> spill_stage(std::size_t u) {
    const auto& b = plan_.buffers;
    return spill_stage_[b.spill_index(u) % 2].span().first(b.kept_bytes[u]);
  }
  // Before spilled block u's forward writes its staging buffer: the copy down of its last content done.
  std::span<std::byte> spill_stage_for_forward(Exec& exec, std::size_t u) {
    exec.wait(spill_free_[plan_.buffers.spill_index(u) % 2]);
    return spill_stage(u);
  }
  // After it: the activations down to host memory, on a stream of their own once the forward is done.
  void spill_down(Exec& exec, std::size_t u) {
    const std::size_t k = plan_.buffers.spill_index(u) % 2;
    spill_down_->wait(exec.complete());
    spill_test_delay(*spill_down_);
    be_.download(*spill_down_, std::span<const std::byte>(spill_stage(u)), spill_host_[u]);
    spill_free_[k] = spill_down_->complete();
  }
  // The copies up, in backward order, each into its staging buffer once the block before it there
  // is done with it: two ahead of the backwards done.
  void spill_fetch() {
    while (spill_fetched_ < spill_order_.size() && spill_fetched_ < spill_used_ + 2) {
      const std::size_t u = spill_order_[spill_fetched_++];
      const std::size_t k = plan_.buffers.spill_index(u) % 2;
      spill_up_->wait(spill_free_[k]);
      spill_test_delay(*spill_up_);
      be_.upload(*spill_up_, std::span<const std::byte>(spill_host_[u]), spill_stage(u));
      spill_ready_[k] = spill_up_->complete();
    }
  }
  // Tests (MEGATRAIN_FAULTS=delay@spill=MICROSECONDS): each copy held back that long on its stream, so that a
  // missing wait would let the compute stream read or write a staging buffer too early.
  void spill_test_delay(Exec& e) {
    if constexpr (requires { be_.spin(e, std::int64_t{}); })
      if (spill_test_delay_ns_ > 0) be_.spin(e, spill_test_delay_ns_);
  }
  // Before spilled block u's backward: its activations back in its staging buffer.
  std::span<std::byte> spill_stage_for_backward(Exec& exec, std::size_t u) {
    spill_fetch();
    MT_CHECK(spill_used_ < spill_order_.size() && spill_order_[spill_used_] == u,
             "spilled activations: block {}'s backward out of the order of the copies (internal)", u);
    exec.wait(spill_ready_[plan_.buffers.spill_index(u) % 2]);
    return spill_stage(u);
  }
  // After it: the buffer free for the copy up two spilled blocks later.
  void spill_backward_done(Exec& exec, std::size_t u) {
    spill_free_[plan_.buffers.spill_index(u) % 2] = exec.complete();
    ++spill_used_;
    spill_fetch();
  }

  // Unit u's output as the input of unit u+1's backward: from the device, or brought back.
  std::span<Res> ckpt_in(Exec& exec, std::size_t u) {
    if (!plan_.buffers.kept(u)) return ckpt_out(u);  // (refilled before)
    if (ckpt_host_[u].empty()) return ckpt_[u].span();
    be_.upload(exec, std::span<const Res>(ckpt_host_[u]), ckpt_staging_[0].span());
    return ckpt_staging_[0].span();
  }

  // A unit's fp32 masters into its bf16 weights on the backend (a store without a bf16 copy): in
  // pieces through the staging buffer, each rounded to the nearest even bf16 on `e`'s stream after
  // its copy, as the host optimizer rounds the copy it would have written: the same bits. (The
  // copies and the roundings of one stream run in order: a piece waits for the last rounding.)
  void upload_rounded(Exec& e, std::span<const float> src, std::span<W> dst) {
    if constexpr (std::is_same_v<W, bf16>) {
      const std::span<float> stage = master_staging_.span();
      MT_CHECK(!stage.empty(), "no staging buffer for the masters (the plan kept a bf16 copy)");
      for (std::size_t at = 0; at < src.size(); at += stage.size()) {
        const std::size_t n = std::min(stage.size(), src.size() - at);
        be_.upload(e, src.subspan(at, n), stage.first(n));
        be_.round_weights(e, std::span<const float>(stage.first(n)), dst.subspan(at, n));
      }
    } else {
      be_.upload(e, src, dst);
    }
  }
  // Whether the prefetch uploads the unit's weights for this item (Prefetch::run): a streamed
  // unit's, read by the item; the embedding's only where a tied head reads them (its lookup reads
  // fp32 rows of the masters).
  bool uploads_weights(const TrainItem& it) const {
    if (devices_.holds(it.unit)) return false;
    return reads_weights(it) && (it.unit != 0 || model_.head().op().tied());
  }
  static bool reads_weights(const TrainItem& it) {
    return it.kind == Kind::forward || it.kind == Kind::head || it.kind == Kind::head_eval || it.kind == Kind::refill ||
           (it.kind == Kind::backward && it.unit != 0);
  }
  // Whether the item reads a device block's weights, made from its masters in the item's slot
  // (bf16 weights; fp32 weights are the masters themselves).
  bool makes_device_weights(const TrainItem& it) const {
    if constexpr (std::is_same_v<W, float>) return false;
    return devices_.holds(it.unit) && it.unit != 0 && it.unit != model_.head_unit() && reads_weights(it);
  }
  // ... in its `slot` of the ring, on the compute stream (the masters' last update came before, in
  // its order).
  void make_device_weights(std::size_t u, std::size_t slot) {
    if constexpr (!std::is_same_v<W, float>) {
      static_assert(std::is_same_v<Res, float> && std::is_same_v<Act, W>,
                    "a device block's weights are its masters rounded by Backend::convert (fp32 residuals to weights)");
      const auto n = static_cast<std::int64_t>(store_.unit(u).numel());
      be_.convert(View<const Res>(devices_.master(u).first(static_cast<std::size_t>(n)), Shape{n}),
                  View<Act>(weight_slot(u, slot), Shape{n}));
    } else {
      (void)u, (void)slot;
    }
  }
  // The weights a device unit's update writes: the embedding's and the head's own slots; none for
  // a block (made from its masters where read).
  std::span<W> device_weights(std::size_t u) {
    if (u == 0) return embed_slot_.span();
    if (u == model_.head_unit()) return head_slot_.span();
    return {};
  }

  // Every process's part of unit u's weights in `slot` (its weight_slot) gathered from them, in
  // backend memory, ordered on `stream` (null: the CPU backend's host memory).
  void gather_weights(std::size_t u, std::size_t slot, void* stream) {
    const auto& unit = store_.unit(u);
    opt_.comm->all_gather_backend_memory(weight_slot(u, slot).first(static_cast<std::size_t>(unit.numel())),
                                         store_.shard_bounds(unit), stream);
  }

  // A unit's weights on the device: the embedding's or head's slot, a slot of the blocks' ring
  // (a device block's too, where the compute stage makes them), or a device block's fp32 masters.
  std::span<W> weight_slot(std::size_t unit, std::size_t slot) {
    if (unit == 0) return embed_slot_.span();
    if (unit == model_.head_unit()) return head_slot_.span();
    if constexpr (std::is_same_v<W, float>)  // (a device block's fp32 weights: its masters)
      if (devices_.holds(unit)) return devices_.master_data(unit);
    return weight_ring_[slot].span().first(static_cast<std::size_t>(model_.block(unit - 1).layout().numel()));
  }
  // The ops' view of a unit's weights in slot `slot` (and further units' slabs: a tied table),
  // with the full-precision parameters from where they are: a device unit's fp32 masters, else
  // the gains the prefetch uploaded (only where the weights are bf16).
  template <class Tmpl>
  auto weights(const Tmpl& tmpl, std::size_t unit, std::size_t slot,
               std::initializer_list<typename ParamBinder<const W>::Slab> others = {}) {
    const std::span<const W> w(weight_slot(unit, slot));
    if constexpr (kSplitGains) {
      const typename ParamBinder<const W>::FullSlab full =
          devices_.holds(unit) ? typename ParamBinder<const W>::FullSlab{&tmpl.layout(), devices_.master(unit)}
                               : typename ParamBinder<const W>::FullSlab{&tmpl.full_layout(), std::span<const float>(gains_[unit].span())};
      return tmpl.bind(w, full, others);
    } else {
      return tmpl.bind(w, others);
    }
  }
  const UnitLayout& full_layout(std::size_t unit) const {
    if (unit == 0) return model_.embedding().full_layout();
    if (unit == model_.head_unit()) return model_.head().full_layout();
    return model_.block(unit - 1).full_layout();
  }
  // A unit's gradient accumulator: its own, or a slot of the blocks' ring; where blocks keep only
  // their part of the sum (plan::keeps_gradient_parts) a block's is that part.
  std::span<Acc> grad_acc(std::size_t unit, std::size_t slot) {
    if (unit == 0) return embed_acc_;
    if (unit == model_.head_unit()) return head_acc_.span();
    // (gradients waiting on the device, or a device block: its own, which may be an empty part)
    if (grads_on_device() || !block_acc_[unit].empty()) return block_acc_[unit];
    return grad_ring_[slot].span().first(static_cast<std::size_t>(model_.block(unit - 1).layout().numel()));
  }
  // Whether unit u is a block whose accumulator holds only this process's part of its summed
  // gradient (plan::keeps_gradient_parts: the trainer then has the one whole block's buffer).
  bool keeps_part(std::size_t unit) const { return grad_whole_.size() > 0 && unit != 0 && unit != model_.head_unit(); }
  // Where a unit's whole gradient is made: its accumulator, or where blocks keep only their part,
  // the one buffer of a whole block.
  std::span<Acc> grad_target(std::size_t unit, std::size_t slot) {
    if (keeps_part(unit)) return grad_whole_.span().first(static_cast<std::size_t>(model_.block(unit - 1).layout().numel()));
    return grad_acc(unit, slot);
  }
  // This process's part (StoreShard) of a unit's complete gradient: of its accumulator, or the
  // part a block keeps. All of it where the optimizer is not sharded.
  std::span<const Acc> owned_gradient(std::size_t unit, std::size_t slot) {
    const std::span<const Acc> g = grad_acc(unit, slot);
    if (keeps_part(unit)) return g;
    const auto [lo, hi] = store_.unit(unit).owned();
    return g.subspan(static_cast<std::size_t>(lo), static_cast<std::size_t>(hi - lo));
  }
  /// Where the gradient of `it` sits on the host once offloaded.
  std::span<const float> landed_gradient(const TrainItem& it, const StageSlots& s) {
    const auto& unit = store_.unit(it.unit);
    if (grads_on_host()) {  // a later micro-batch's gradient waits in its staging slot
      if (it.kind != Kind::optimize && it.micro > 0) return staging_[s.in].first(static_cast<std::size_t>(unit.numel()));
      return unit.grad();
    }
    return store_.grad_slot(s.in).first(piece(it, 0).device.size());
  }

  GradientView gradient_view() {
    return {[this](const TrainItem& it, const StageSlots& s) { return landed_gradient(it, s); },
            [this](const TrainItem& it) { return grads_on_host() ? GradientPiece{} : piece(it, 0).where; },
            [this](std::size_t u) -> const std::string& { return store_.unit(u).name(); },
            [this] { return state_->step; }};
  }

  // The items of one micro-batch, in order. Streamed, the embedding's untouched rows are spread
  // over the first four fifths of the backward, between the blocks, so that the optimizer steps
  // them without holding up the blocks' gradients (which need the host's landing slots back).
  // (Stepping them all right after the head stalled the backward on landing slots; stepping an
  // untied model's rows during the forward was slower on the 7B shape; docs/performance.md.)
  std::vector<TrainItem> step_items(std::int64_t m) const {
    const std::size_t L = model_.num_blocks(), H = L + 1;
    // A host unit's gradient lands during the backward when it streams or waits in host memory;
    // a device unit streaming is updated right after the item that completes its gradient.
    const auto lands = [&](std::size_t u) { return !devices_.holds(u) && (streamed() || grads_on_host()); };
    std::vector<TrainItem> items;
    const auto update_now = [&](std::size_t u) {
      if (streamed() && devices_.holds(u)) items.push_back({Kind::optimize, u, m});
    };
    const std::int64_t rest = streamed_unit(0) ? pieces(vocab(), piece_rows()) : 0;
    std::int64_t rest_done = 0;
    auto rest_until = [&](std::int64_t n) {
      for (; rest_done < std::min(n, rest); ++rest_done) items.push_back({Kind::embed_rest, 0, m, rest_done, true});
    };
    for (std::size_t u = 0; u <= L; ++u) items.push_back({Kind::forward, u, m});
    items.push_back({Kind::head, H, m, 0, lands(H)});
    if (streamed_unit(H))
      for (std::int64_t j = 1; j < pieces(head_numel(), slot_numel()); ++j) items.push_back({Kind::grad_piece, H, m, j, true});
    update_now(H);
    const auto span = static_cast<std::int64_t>(std::max<std::size_t>(1, L - L / 5));
    const std::size_t k = plan_.buffers.checkpoint_every;
    for (std::size_t u = L; u >= 1; --u) {
      if (k > 1 && (u == L || u % k == 0))  // the top of a group: its outputs between checkpoints again
        for (std::size_t v = (u - 1) / k * k + 1; v < u; ++v) items.push_back({Kind::refill, v, m});
      items.push_back({Kind::backward, u, m, 0, lands(u)});
      update_now(u);
      const auto done = static_cast<std::int64_t>(L - u + 1);  // blocks submitted so far
      rest_until((rest * done + span - 1) / span);
    }
    rest_until(rest);  // (no blocks)
    items.push_back({Kind::backward, 0, m, 0, lands(0)});
    if (streamed_unit(0))
      for (std::int64_t j = 1; j < pieces(touched_count_, piece_rows()); ++j) items.push_back({Kind::grad_piece, 0, m, j, true});
    update_now(0);
    return items;
  }

  // The AdamW pass of resident gradients, in forward order: a device unit's update on the
  // device; a host unit's from its resident slab, or (gradients waiting on the device) in
  // landing-slot-sized pieces.
  std::vector<TrainItem> pass_items() const {
    std::vector<TrainItem> items;
    for (std::size_t u = 0; u < model_.num_units(); ++u) {
      if (devices_.holds(u) || grads_on_host()) {
        items.push_back({Kind::optimize, u, 0});
        continue;
      }
      const auto [lo, hi] = store_.unit(u).owned();  // (a sharded store: this process's part)
      for (std::int64_t j = 0; j < pieces(hi - lo, slot_numel()); ++j) items.push_back({Kind::optimize, u, 0, j, true});
    }
    return items;
  }

  // ---- where gradients go ------------------------------------------------------------------------
  bool streamed() const { return !opt_.resident_gradients(); }
  bool grads_on_host() const { return opt_.resident_gradients() && opt_.gradient_home == GradientHome::host; }
  bool grads_on_device() const { return opt_.resident_gradients() && opt_.gradient_home == GradientHome::device; }
  /// Whether unit u's gradient streams to the host during the backward (stepped as it lands).
  bool streamed_unit(std::size_t u) const { return streamed() && !devices_.holds(u); }
  /// Whether unit u's gradient adds up micro-batches in its device accumulator.
  bool accumulates_on_device(std::size_t u) const { return devices_.holds(u) || grads_on_device(); }
  /// Whether the item starts unit u's gradient afresh (zeroes its accumulator).
  bool fresh(const TrainItem& it, std::size_t u) const { return it.micro == 0 || !accumulates_on_device(u); }
  /// Whether unit u's share of the norm is summed on the device, over its complete gradient (else:
  /// as its streamed pieces are stepped, or over the resident slab where micro-batches add up).
  bool summed_on_device(std::size_t u) const {
    return devices_.holds(u) || (opt_.resident_gradients() && (grads_on_device() || opt_.micro_batches == 1));
  }
  static std::int64_t pieces(std::int64_t n, std::int64_t per) { return std::max<std::int64_t>(1, (n + per - 1) / per); }
  std::int64_t slot_numel() const { return store_.grad_slot_numel(); }
  std::int64_t vocab() const { return model_.config().vocab_size; }
  std::int64_t hidden() const { return model_.config().hidden_size; }
  std::int64_t head_numel() const { return store_.unit(model_.head_unit()).numel(); }
  std::int64_t piece_rows() const { return slot_numel() / hidden(); }  // embedding rows per landing slot

  // The batch's distinct token ids, sorted (the touched rows), and each token's index among them.
  void find_touched_rows(std::span<const std::int32_t> ids) {
    std::vector<std::int32_t> rows(ids.begin(), ids.end());
    std::sort(rows.begin(), rows.end());
    rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
    std::copy(rows.begin(), rows.end(), touched_host_.begin());
    touched_count_ = static_cast<std::int64_t>(rows.size());
    for (std::size_t i = 0; i < ids.size(); ++i)
      compact_ids_host_[i] = static_cast<std::int32_t>(std::lower_bound(rows.begin(), rows.end(), ids[i]) - rows.begin());
    const std::int32_t pad = model_.embedding().op().padding_id();
    const auto at = std::lower_bound(rows.begin(), rows.end(), pad);
    compact_padding_ = pad >= 0 && at != rows.end() && *at == pad ? static_cast<std::int32_t>(at - rows.begin()) : -1;
  }
  std::span<const std::int32_t> touched() const {
    return std::span<const std::int32_t>(touched_host_).first(static_cast<std::size_t>(touched_count_));
  }
  View<Acc> embed_table_grad() { return View<Acc>(embed_acc_, Shape{vocab(), hidden()}); }
  View<Acc> touched_grad() {
    return View<Acc>(rows_acc_.span().first(static_cast<std::size_t>(touched_count_ * hidden())), Shape{touched_count_, hidden()});
  }

  /// One item's share of its unit's gradient: where it is on the device (what lands on the
  /// host; empty: a zero gradient that does not cross), and where it belongs in the unit.
  struct Piece {
    std::span<const Acc> device;
    GradientPiece where;
  };
  Piece piece(const TrainItem& it, std::size_t device_slot) {
    const auto d = static_cast<std::size_t>(hidden());
    const auto R = static_cast<std::size_t>(piece_rows());
    Piece p;
    if (it.kind == Kind::optimize) {  // elements [o, o + slot) of a gradient that waited on the device
      // (a sharded store: of this process's part [lo, n))
      const auto [lo, hi] = store_.unit(it.unit).owned();
      const auto S = static_cast<std::size_t>(slot_numel()), n = static_cast<std::size_t>(hi);
      const auto o = static_cast<std::size_t>(lo) + static_cast<std::size_t>(it.piece) * S;
      p.device = owned_gradient(it.unit, device_slot).subspan(o - static_cast<std::size_t>(lo), std::min(S, n - o));
      p.where.offset = o;
    } else if (it.kind == Kind::embed_rest) {  // table rows [r0, r1)
      const auto r0 = static_cast<std::size_t>(it.piece) * R, r1 = std::min(static_cast<std::size_t>(vocab()), r0 + R);
      p.where.offset = r0 * d;
      if (model_.head().op().tied()) p.device = std::span<const Acc>(embed_acc_).subspan(r0 * d, (r1 - r0) * d);
    } else if (it.unit == 0) {  // touched rows [i0, i1) of the compact buffer
      const auto i0 = static_cast<std::size_t>(it.kind == Kind::grad_piece ? it.piece : 0) * R;
      const auto i1 = std::min(static_cast<std::size_t>(touched_count_), i0 + R);
      p.device = std::span<const Acc>(rows_acc_.span()).subspan(i0 * d, (i1 - i0) * d);
      p.where.rows = touched().subspan(i0, i1 - i0);
      p.where.row_elems = d;
    } else if (it.unit == model_.head_unit()) {  // elements [o, o + slot) of the head's gradient
      const auto S = static_cast<std::size_t>(slot_numel()), n = static_cast<std::size_t>(head_numel());
      const auto o = static_cast<std::size_t>(it.kind == Kind::grad_piece ? it.piece : 0) * S;
      p.device = std::span<const Acc>(head_acc_.span()).subspan(o, std::min(S, n - o));
      p.where.offset = o;
    } else {  // a block, whole
      p.device = grad_acc(it.unit, device_slot);
    }
    return p;
  }

  /// The AdamW segments of an item's landed gradient `g` (see piece()).
  std::vector<AdamWSegment<float>> segments(const TrainItem& it, std::span<const float> g) {
    const auto w = piece(it, 0).where;
    std::vector<AdamWSegment<float>> out;
    if (!w.rows.empty()) {  // touched rows
      for (std::size_t i = 0; i < w.rows.size(); ++i)
        out.push_back({static_cast<std::size_t>(w.rows[i]) * w.row_elems, w.row_elems, g.data() + i * w.row_elems});
    } else if (it.kind == Kind::embed_rest) {  // the untouched runs of rows [r0, r1)
      const auto d = static_cast<std::size_t>(hidden());
      const std::int64_t r0 = static_cast<std::int64_t>(w.offset / d);
      const std::int64_t r1 = std::min(vocab(), r0 + piece_rows());
      const auto rows = touched();
      auto next = std::lower_bound(rows.begin(), rows.end(), r0);
      for (std::int64_t r = r0; r < r1;) {
        const std::int64_t stop = next == rows.end() ? r1 : std::min<std::int64_t>(r1, *next);
        if (stop > r)
          out.push_back({static_cast<std::size_t>(r) * d, static_cast<std::size_t>(stop - r) * d,
                         g.empty() ? nullptr : g.data() + static_cast<std::size_t>(r - r0) * d});
        r = stop + 1;  // skip the touched row
        if (next != rows.end()) ++next;
      }
    } else {
      out.push_back({w.offset, g.size(), g.data()});
    }
    return out;
  }

  // After a drain: the stages' timings for the step, then cleared.
  StepStats::Profile collect_profile() {
    StepStats::Profile p;
    auto& pre = pipeline_->template stage<0>();
    auto& cmp = pipeline_->template stage<1>();
    auto& off = pipeline_->template stage<2>();
    auto& opt = pipeline_->template stage<3 + sizeof...(UserStages)>();
    p.upload_s = pre.timings.seconds();
    p.upload_bytes = pre.timings.bytes;
    p.compute_s = cmp.timings.seconds();
    for (std::size_t i = 0; i < cmp.timings.spans.size() && i < cmp.timed_items.size(); ++i) {
      const auto& [a, b] = cmp.timings.spans[i];
      p.compute_items.push_back(cmp.timed_items[i]);
      p.compute_items.back().start_s = Exec::seconds(cmp.timings.spans[0].first, a);
      p.compute_items.back().seconds = Exec::seconds(a, b);
    }
    cmp.timed_items.clear();
    p.download_s = off.timings.seconds();
    p.download_bytes = off.timings.bytes;
    p.optimizer_s = opt.timings.seconds();
    pre.timings.reset(pre.exec);
    cmp.timings.reset(cmp.exec);
    off.timings.reset(off.exec);
    opt.timings.reset(opt.exec);
    return p;
  }

  static int optimizer_threads() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

  std::int64_t check_batch(std::span<const std::int32_t> ids, std::span<const std::int32_t> labels, std::int64_t rows) const {
    const auto n = static_cast<std::size_t>(rows * opt_.seq_len);
    MT_CHECK(ids.size() == n && labels.size() == n, "batch of {} ids and {} labels; expected {} sequences x {} tokens = {}",
             ids.size(), labels.size(), rows, opt_.seq_len, n);
    const std::int64_t V = model_.config().vocab_size;
    std::int64_t valid = 0;
    for (std::size_t i = 0; i < n; ++i) {
      MT_CHECK(ids[i] >= 0 && ids[i] < V, "token id {} at position {} is outside the vocabulary [0, {})", ids[i], i, V);
      MT_CHECK(labels[i] == kIgnoreIndex || (labels[i] >= 0 && labels[i] < V),
               "label {} at position {} is outside the vocabulary [0, {}) and is not {}", labels[i], i, V, kIgnoreIndex);
      valid += labels[i] != kIgnoreIndex;
    }
    return valid;
  }

  /// Tokens per block of a decoder block's token-wise work for chunks of `chunk_tokens` (see
  /// TrainerOptions::token_chunk; 0: the whole chunk).
  std::int64_t token_block(std::int64_t chunk_tokens) const { return plan::token_block(opt_, chunk_tokens); }
  /// Positions must come with TrainerOptions::packed, one per token, 0 at each row's start and
  /// wherever a sequence starts, the previous one plus one elsewhere.
  void check_positions(std::span<const std::int32_t> positions, std::int64_t rows) const {
    if (positions.empty()) return;
    MT_CHECK(opt_.packed, "positions were given, but the trainer was not made for packed rows (TrainerOptions::packed)");
    const std::int64_t seq = opt_.seq_len;
    MT_CHECK(static_cast<std::int64_t>(positions.size()) == rows * seq, "{} positions for {} sequences x {} tokens",
             positions.size(), rows, seq);
    for (std::int64_t i = 0; i < rows * seq; ++i) {
      const std::int32_t p = positions[static_cast<std::size_t>(i)];
      const bool ok = i % seq == 0 ? p == 0 : (p == 0 || p == positions[static_cast<std::size_t>(i - 1)] + 1);
      MT_CHECK(ok, "position {} at token {} (row {}, column {}): a row starts at 0, and each position is 0 (a new "
               "sequence) or the previous one plus 1", p, i, i / seq, i % seq);
    }
  }
  /// An attention mask (step()): one 0 or 1 a token, each row's zeros after its ones.
  void check_attention_mask(std::span<const std::uint8_t> mask, std::span<const std::int32_t> labels, std::int64_t rows) const {
    if (mask.empty()) return;
    const std::int64_t seq = opt_.seq_len;
    MT_CHECK(static_cast<std::int64_t>(mask.size()) == rows * seq, "an attention mask of {} values for {} sequences x {} tokens",
             mask.size(), rows, seq);
    for (std::int64_t i = 0; i < rows * seq; ++i) {
      const std::uint8_t v = mask[static_cast<std::size_t>(i)];
      MT_CHECK(v <= 1, "attention mask value {} at token {} (row {}, column {}): it is 1 for a token, 0 for padding", v, i,
               i / seq, i % seq);
      MT_CHECK(v == 0 || i % seq == 0 || mask[static_cast<std::size_t>(i - 1)] == 1,
               "the attention mask has a token after padding at token {} (row {}, column {}): padding must come after a "
               "row's tokens (right padding)", i, i / seq, i % seq);
    }
    // (transformers' mask keeps padding from attending to padding and megatrain attends causally:
    // a padded token's logits differ, so no loss may read them)
    for (std::int64_t i = 0; i < rows * seq; ++i) {
      MT_CHECK(mask[static_cast<std::size_t>(i)] == 1 || labels[static_cast<std::size_t>(i)] == kIgnoreIndex,
               "token {} (row {}, column {}) is padding (attention mask 0) but has the label {}: give padding the label {} "
               "(ignored)", i, i / seq, i % seq, labels[static_cast<std::size_t>(i)], kIgnoreIndex);
    }
  }
  /// A mixture of experts' copy of a mask that leaves some padding out (masked_), and the tokens
  /// each micro-batch counts; without padding the statistics count every token, as before.
  void stage_attention_mask(std::span<const std::uint8_t> mask) {
    valid_count_.clear();
    masked_ = !valid_host_.empty() && std::find(mask.begin(), mask.end(), std::uint8_t{0}) != mask.end();
    if (!masked_) return;
    std::copy(mask.begin(), mask.end(), valid_host_.begin());
    const auto per = static_cast<std::size_t>(opt_.micro_rows() * opt_.seq_len);
    valid_count_.assign(static_cast<std::size_t>(opt_.micro_batches), 0);
    for (std::size_t i = 0; i < valid_host_.size(); ++i) valid_count_[i / per] += valid_host_[i];
  }
  /// The tokens micro-batch m's auxiliary loss counts (all of them without an attention mask).
  std::int64_t counted_tokens(std::int64_t m) const {
    return valid_count_.empty() ? opt_.micro_rows() * opt_.seq_len : valid_count_[static_cast<std::size_t>(m)];
  }
  /// Host copies of the positions of `rows` rows (empty: each row one sequence) and of where
  /// their sequences start (starts_host_, and row_seq_: each row's first sequence).
  void stage_positions(std::span<const std::int32_t> positions, std::int64_t rows) {
    if (!opt_.packed) return;
    const std::int64_t seq = opt_.seq_len;
    std::int64_t n = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      row_seq_[static_cast<std::size_t>(r)] = n;
      for (std::int64_t c = 0; c < seq; ++c) {
        const auto i = static_cast<std::size_t>(r * seq + c);
        const std::int32_t p = positions.empty() ? static_cast<std::int32_t>(c) : positions[i];
        positions_host_[i] = p;
        if (p == 0) starts_host_[static_cast<std::size_t>(n++)] = static_cast<std::int32_t>(i);
      }
    }
    row_seq_[static_cast<std::size_t>(rows)] = n;
    starts_host_[static_cast<std::size_t>(n)] = static_cast<std::int32_t>(rows * seq);
  }
  /// Uploads micro-batch m's positions and sequence starts (with its ids, in its forward).
  void upload_positions(Exec& exec, std::int64_t m, std::int64_t rows) {
    const auto off = static_cast<std::size_t>(m * rows * opt_.seq_len), n = static_cast<std::size_t>(rows * opt_.seq_len);
    be_.upload(exec, std::span<const std::int32_t>(positions_host_).subspan(off, n), positions_dev_.span().first(n));
    const auto s0 = static_cast<std::size_t>(row_seq_[static_cast<std::size_t>(m * rows)]);
    const auto s1 = static_cast<std::size_t>(row_seq_[static_cast<std::size_t>((m + 1) * rows)]);
    be_.upload(exec, std::span<const std::int32_t>(starts_host_).subspan(s0, s1 - s0 + 1), starts_dev_.span().first(s1 - s0 + 1));
  }
  /// The packing of rows [r0, r0 + n) of micro-batch m (of `rows` rows), or none.
  PackedRows packed_rows(std::int64_t m, std::int64_t rows, std::int64_t r0, std::int64_t n) const {
    if (!opt_.packed) return {};
    const std::int64_t seq = opt_.seq_len, base = row_seq_[static_cast<std::size_t>(m * rows)];
    const std::int64_t s0 = row_seq_[static_cast<std::size_t>(m * rows + r0)], s1 = row_seq_[static_cast<std::size_t>(m * rows + r0 + n)];
    const auto count = static_cast<std::size_t>(s1 - s0 + 1);
    PackedRows p;
    p.positions = View<const std::int32_t>(std::span<const std::int32_t>(positions_dev_.span()).subspan(static_cast<std::size_t>(r0 * seq), static_cast<std::size_t>(n * seq)),
                                           Shape{n * seq});
    p.starts = View<const std::int32_t>(std::span<const std::int32_t>(starts_dev_.span()).subspan(static_cast<std::size_t>(s0 - base), count),
                                        Shape{static_cast<std::int64_t>(count)});
    p.host_starts = std::span<const std::int32_t>(starts_host_).subspan(static_cast<std::size_t>(s0), count);
    return p;
  }

  double sum_loss() const {
    double s = 0;
    for (Acc x : loss_host_) s += static_cast<double>(x);
    return s;
  }

  const DecoderModel<Block>& model_;
  HostParamStore<float>& store_;
  B& be_;
  TrainerOptions opt_;
  std::shared_ptr<State> state_;
  std::int64_t step_ = 0;
  std::optional<double> last_grad_norm_;
  std::int64_t skipped_ = 0;           // steps skipped as non-finite (NonFinite::skip), in all
  std::int64_t skipped_in_a_row_ = 0;  // ... and since the last step taken
  std::string failed_;              // why a step stopped (a non-finite step): no further step is taken
  bool failed_kept_state_ = false;  // the weights and AdamW states are those of the last good step
  std::atomic<std::shared_ptr<const std::function<void(std::size_t)>>> update_gate_;
  Pass pass_;
  bool update_pending_ = false;
  // The offload stage sums each gradient over the processes (TrainerOptions::sum_during_backward).
  bool sums_in_offload_ = opt_.distributed() && opt_.sum_during_backward && std::is_same_v<Acc, float> &&
                          opt_.resident_gradients() && opt_.gradient_home == GradientHome::host &&
                          opt_.comm->can_sum_backend_memory(B::kDevice);
  // Gradients waiting on the device with several processes: the compute stage sums each one over
  // them as it is completed (a reduce-scatter where the optimizer is sharded: each process then
  // downloads and steps only its part).
  bool reduces_on_device_ = opt_.distributed() && opt_.resident_gradients() && opt_.gradient_home == GradientHome::device;
  // Each process uploads its part of a unit's bf16 weights, and the GPUs gather the rest
  // (TrainerOptions::gather_weights_on_device).
  bool weights_in_parts_ = B::kDevice && opt_.weights_in_parts(std::is_same_v<W, bf16>);
  std::size_t device_bytes_ = 0;
  plan::MemoryPlan plan_;

  // Norm gains are read at full precision where the weights are bf16: host units' gains live in
  // these fp32 buffers (a unit's full_layout()), refreshed by the prefetch from the masters.
  static constexpr bool kSplitGains = !std::is_same_v<full_t<W>, W>;
  std::vector<Buf<full_t<W>>> gains_;
  DeviceUnits<B> devices_;
  bool device_owns_ = false;   // the backend holds the device units' state (loaded from the store)
  bool device_newer_ = false;  // ... and has changed it since: the store's copies are stale
  Buf<std::byte> pool_;              // the blocks' accumulators and the kept activations (plan::TrainerBuffers::lay_out_pool)
  std::vector<std::span<Acc>> block_acc_;  // a block's own gradient accumulator (gradients waiting on the device; device blocks)
  std::vector<Buf<Acc>> device_acc_;  // ... a device block's own where the others have none
  Buf<Acc> grad_whole_;              // a block's whole gradient, made before its part of the sum is kept (keeps_gradient_parts)
  std::vector<Buf<W>> weight_ring_;
  std::vector<Buf<Acc>> grad_ring_;
  Buf<W> embed_slot_, head_slot_;
  Buf<float> master_staging_;  // (no bf16 copy in host memory: the masters' pieces on their way to bf16)
  std::span<Acc> embed_acc_;  // the embedding's gradient: embed_acc_mem_, or in pool_
  Buf<Acc> embed_acc_mem_, head_acc_;
  std::vector<Buf<Res>> ckpt_;          // ckpt_[u]: output of unit u (input of unit u+1), when on the device
  std::vector<std::span<Res>> ckpt_host_;  // ... or in host memory (spilled)
  std::vector<HostBuffer> ckpt_host_mem_;
  std::vector<Buf<Res>> ckpt_staging_;  // two device buffers for spilled checkpoints
  std::vector<Buf<Res>> recompute_;     // a checkpoint every k >= 2 blocks: the k - 1 outputs between
  std::vector<std::span<std::byte>> kept_;  // kept_[u]: a block's activations from its forward to its backward (in pool_)
  // Spilled activations (plan::TrainerBuffers::spills): two device staging buffers, each spilled
  // block's copy in pinned host memory, the streams of the copies (down, up), and per staging
  // buffer the completion after which it may be written (its last copy down, or the backward that
  // read it) and the one of the copy up into it. The Compute stage alone touches them.
  std::vector<Buf<std::byte>> spill_stage_;
  std::vector<std::span<std::byte>> spill_host_;
  std::vector<HostBuffer> spill_host_mem_;
  std::optional<Exec> spill_down_, spill_up_;
  std::array<Completion, 2> spill_free_{}, spill_ready_{};
  std::vector<std::size_t> spill_order_;  // the spilled blocks in backward order
  std::size_t spill_fetched_ = 0, spill_used_ = 0;  // of a micro-batch's backward: copies up issued, backwards done
  std::int64_t spill_test_delay_ns_ = 0;  // delay@spill (spill_test_delay)
  std::size_t spilled_ = 0;
  std::vector<Buf<Res>> dbuf_;  // gradients w.r.t. activations, ping-pong
  Buf<std::byte> scratch_mem_;
  Arena arena_;
  Buf<std::int32_t> ids_dev_, labels_dev_;
  Buf<std::int32_t> positions_dev_, starts_dev_;  // packed rows: a micro-batch's positions and sequence starts
  // A mixture of experts' routing statistics and auxiliary loss: which tokens count (step()'s
  // attention mask), a micro-batch's on the device, the batch's pinned, and how many each
  // micro-batch counts.
  Buf<std::uint8_t> valid_dev_;
  HostBuffer valid_mem_;
  std::span<std::uint8_t> valid_host_;
  std::vector<std::int64_t> valid_count_;
  bool masked_ = false;  // this step's mask leaves some padding out (else nothing is masked)
  HostBuffer positions_mem_;
  std::span<std::int32_t> positions_host_, starts_host_;  // the batch's (starts: token offsets, then the end)
  std::vector<std::int64_t> row_seq_;                     // each row's first sequence in starts_host_, then the count
  Buf<Acc> rows_acc_;                            // streamed: the touched rows' gradient, compact
  Buf<std::int32_t> touched_dev_, compact_ids_dev_;
  Buf<float> embed_rows_;           // a host embedding: the batch's distinct rows, fp32, for the lookup
  HostBuffer embed_rows_host_mem_;  // (gathered here from the masters, then uploaded)
  std::span<float> embed_rows_host_;
  std::span<std::int32_t> compact_ids_host_, touched_host_;
  std::int32_t compact_padding_ = -1;  // the padding row's index among the touched rows, or -1
  std::int64_t touched_count_ = 0;
  Buf<Acc> loss_dev_;
  HostBuffer host_io_;  // the batch's ids and labels, and per-token losses (pinned with a GPU)
  std::span<std::int32_t> ids_host_, labels_host_;
  std::span<Acc> loss_host_;
  Buf<double> sumsq_dev_;  // each unit's sum of squared gradient elements, where summed on the device
  // A mixture of experts' routing statistics, [micro-batch, sparse layer, expert] (RouterStats)
  Buf<std::int64_t> router_counts_dev_;
  Buf<double> router_probs_dev_;
  HostBuffer router_host_mem_;
  std::span<std::int64_t> router_counts_host_;
  std::span<double> router_probs_host_;
  std::vector<std::int64_t> moe_index_ = sparse_indices(model_.config());  // by block: its index among the sparse layers, or -1
  HostBuffer sumsq_host_mem_;
  std::span<double> sumsq_host_;
  HostBuffer staging_mem_;
  std::vector<std::span<float>> staging_;  // micro-batches after the first land here (two slots)
  Exec xfer_ = be_.make_executor(B::Role::upload);  // device units' state to and from the store
  std::unique_ptr<Pipeline> pipeline_;  // last: its threads stop before the buffers go
};

}  // namespace megatrain
