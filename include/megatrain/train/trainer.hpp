// The streaming trainer: one optimizer step, layer-major over the whole batch.
//
// Units are the embedding (0), the blocks (1..L) and the head (L+1). One step, for each
// micro-batch:
//   forward   F0, F1..FL   prefetch the unit's weights into a slot; run it over every token chunk;
//                          keep its output (the next unit's input) as the activation checkpoint
//   head      H            final norm + LM head + loss, fused with its backward, chunked
//   backward  BL..B1, B0   prefetch again, recompute each chunk from its checkpoint, backpropagate,
//                          accumulate the weight gradient over chunks, offload it (blocks that
//                          keep their activations, TrainerOptions::kept_blocks, recompute nothing)
//   optimizer              AdamW on the unit as soon as its gradient has landed on the host
// Each item flows through StreamPipeline<prefetch, compute, offload, [user stages], optimizer> (train/stages/), so
// prefetching unit u+1 overlaps computing unit u, offloading u's gradient overlaps computing u-1, and the optimizer
// steps u while the GPU (or CPU) works on lower layers. The pipeline decides when things happen, never what is
// computed: results do not depend on timing. The stages share the step's context (train/step_context.hpp: the buffers,
// and where each unit's weights and gradients are).
//
// Gradients are resident (every unit's gradient kept until all are known) when clipping is exact (PyTorch's
// clip_grad_norm_ over all parameters, then AdamW) or when the batch is split into micro-batches (gradient
// accumulation). Then the optimizer runs as a second pass after the global norm is known (train/step_outcome.hpp): in
// the background, ahead of the next step's forward (TrainerOptions::overlap_update), whose prefetch of unit u waits
// only for u's update (the pipeline's rule 4), so the AdamW pass of step t overlaps the forward of step t+1.
// finish_update() waits for it; the next step(), evaluate() and the Checkpointer order themselves after it, and the
// library's readers of a whole store refuse while it runs (HostParamStore::check_settled). ClipMode::stale instead
// clips step t with the global norm measured at step t-1, so each unit still steps the moment its gradient lands.
//
// Where gradients wait for the norm (TrainerOptions::gradient_home): by default on the device, one fp32 accumulator per
// unit; the AdamW pass then downloads each host unit's gradient in slot-sized pieces into the store's landing ring, in
// forward order, while the next forward runs. With GradientHome::host every gradient lands in the store's resident
// slabs during the backward. Device units (train/device_units.hpp) keep their AdamW state in backend memory and are
// updated there; finish_update() writes their state back into the store.
//
// Without resident gradients a host embedding's gradient comes back as its touched rows (train/touched_rows.hpp) and
// the other rows (embed_rest items, between the blocks of the backward: a tied head's gradient, or zero); a head's
// larger than a landing slot in pieces.
//
// Trainer<CpuBackend<float>> and Trainer<CudaBackend> are compiled once in the library: include train/cpu_trainer.hpp
// or train/cuda_trainer.hpp to use them without compiling them again.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "megatrain/core/error.hpp"
#include "megatrain/core/nvtx.hpp"
#include "megatrain/layers/decoder_model.hpp"
#include "megatrain/pipeline/stream_pipeline.hpp"
#include "megatrain/step/trainer_options.hpp"
#include "megatrain/store/host_param_store.hpp"
#include "megatrain/train/stages/compute.hpp"
#include "megatrain/train/stages/offload.hpp"
#include "megatrain/train/stages/optimize.hpp"
#include "megatrain/train/stages/prefetch.hpp"
#include "megatrain/train/step_context.hpp"
#include "megatrain/train/step_outcome.hpp"
#include "megatrain/train/step_profile.hpp"
#include "megatrain/train/train_item.hpp"
#include "megatrain/train/trainer_checks.hpp"

namespace megatrain {

template <class B, class Block = DecoderBlock, class... UserStages>
class Trainer {
  static_assert(Backend<B>, "Trainer<B>: B does not satisfy megatrain::Backend (see megatrain/backend/backend.hpp)");
  static_assert(LayerOp<Block, B>,
                "Trainer<B, Block>: Block does not satisfy megatrain::LayerOp<Block, B>: it needs params(), Weights<E>, "
                "bind(), hidden_size(), scratch_bytes<B>(), forward() and backward() (see megatrain/layers/layer_op.hpp)");
  using Ctx = StepContext<B, Block>;
  using Kind = TrainItem::Kind;

 public:
  /// What the store must provide for `opt`: resident gradients or a ring of host landing slots.
  static StoreOptions store_options(const TrainerOptions& options, StoreOptions base = {}) {
    return plan::store_options(options, base, std::is_same_v<typename B::Weight, bf16>);
  }

  /// `model`, `store` and `backend` must outlive the trainer. The store's units must be the
  /// model's (same names and shapes) and its gradients laid out as store_options() says.
  Trainer(const DecoderModel<Block>& model, HostParamStore<float>& store, B& backend, TrainerOptions opt);
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;
  /// Applies an update still in flight (finish_update()) before the trainer goes.
  ~Trainer();

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
  /// (right padding) and have no label; a mixture of experts' auxiliary loss and routing
  /// statistics then leave the padding out, as transformers does given that mask.
  /// The step minimises cross-entropy (CrossEntropy: the mean of -log p over the labelled tokens).
  StepStats step(std::span<const std::int32_t> ids, std::span<const std::int32_t> labels,
                 std::span<const std::int32_t> positions = {}, std::span<const std::uint8_t> attention_mask = {}) {
    return step(CrossEntropy{}, ids, labels, positions, attention_mask);
  }
  /// The same step minimising `objective` (train/objective.hpp; StepStats::loss is its value). An
  /// objective with a weight per token needs TrainerOptions::token_weights.
  StepStats step(const Objective& objective, std::span<const std::int32_t> ids, std::span<const std::int32_t> labels,
                 std::span<const std::int32_t> positions = {}, std::span<const std::uint8_t> attention_mask = {});

  /// Mean loss over the labelled tokens of `rows` sequences (forward only; the weights are
  /// not changed). rows must be a multiple of the micro-batch size. `positions` as for step().
  double evaluate(std::span<const std::int32_t> ids, std::span<const std::int32_t> labels, std::int64_t rows,
                  std::span<const std::int32_t> positions = {});
  /// Each token's log-probability of its label (0 where it is kIgnoreIndex) under the current weights,
  /// for `rows` sequences as for evaluate(): the same bits as a training step's forward (last_log_probs()).
  std::vector<double> score(std::span<const std::int32_t> ids, std::span<const std::int32_t> labels, std::int64_t rows,
                            std::span<const std::int32_t> positions = {});
  /// Row r's next-token logits after position at[r] (rows x vocab): evaluate()'s forward, the head at those positions alone.
  std::vector<float> next_logits(std::span<const std::int32_t> ids, std::int64_t rows, std::span<const std::int64_t> at);
  /// Decoding with caches of rows of up to `capacity` tokens (train/decoding.hpp): the logits after ids[r] at positions[r].
  std::vector<float> decode_logits(std::span<const std::int32_t> ids, std::span<const std::int32_t> positions, std::int64_t capacity);
  bool decodes() const;  ///< whether this backend and model decode with caches
  void end_decoding() { ctx_.decode = {}; }  ///< frees the caches (a later decode_logits() makes them again)
  /// The last step's log-probabilities of its labels, token by token, until an evaluate() or score().
  std::vector<double> last_log_probs() const { return ctx_.batch.log_probs(); }

  /// Waits until the last step's update is applied and writes the device units' state back: the
  /// store then holds the whole train state (read or write it only after this); the next step()
  /// or evaluate() loads the device units from it again.
  void finish_update();
  /// Whether the last step's update is still being applied (finish_update() waits for it).
  bool update_pending() const { return update_pending_; }

  std::int64_t steps_done() const { return outcome_.steps; }
  /// Steps skipped as non-finite (TrainerOptions::on_nonfinite skip): in all, and in a row up to the last step.
  /// AdamW's bias correction counts steps_done() - skipped_steps() updates.
  std::int64_t skipped_steps() const { return outcome_.skipped; }
  std::int64_t skipped_in_a_row() const { return outcome_.skipped_in_a_row; }
  /// Why the trainer stopped (a non-finite step: it takes no further step); empty while it has not.
  const std::string& stopped_because() const { return outcome_.failed; }
  /// Whether, stopped, its weights and AdamW states are still those of the last good step (with the whole gradient
  /// known first: exact clipping), which a checkpoint may then keep.
  bool stopped_with_last_good_state() const { return !outcome_.failed.empty() && outcome_.failed_kept_state; }
  const DecoderModel<Block>& model() const { return ctx_.model; }
  /// The options in effect (resolved(), with the plan's decisions).
  const TrainerOptions& options() const { return ctx_.opt; }
  /// The global gradient norm of the last step (what ClipMode::stale clips the next step with).
  std::optional<double> last_grad_norm() const { return outcome_.last_grad_norm; }
  /// Restores the step counter and the last norm (resuming from a checkpoint whose tensors were loaded into the
  /// store after finish_update()); the next step takes the device units' state from the store.
  void restore(std::int64_t steps_done, std::optional<double> last_grad_norm, std::int64_t skipped_steps = 0,
               std::int64_t skipped_in_a_row = 0);
  /// A function the optimizer stage calls, on its own thread, before it changes unit u's master weights or moments;
  /// it may block. Set it between calls of step(); empty: none. The Checkpointer writes a unit to disk with it.
  void set_update_gate(std::function<void(std::size_t unit)> gate) {
    ctx_.update_gate.store(gate ? std::make_shared<const std::function<void(std::size_t)>>(std::move(gate)) : nullptr);
  }
  /// The units in the order the next step first changes them (every unit once).
  std::vector<std::size_t> update_order() const;

  std::size_t device_bytes() const { return ctx_.device_bytes; }  ///< backend memory the trainer holds
  /// How many units (the first in forward order) keep their AdamW state in backend memory.
  std::size_t device_units() const { return ctx_.devices.count(); }
  /// Activation checkpoints kept in host memory because the device could not hold them.
  std::size_t spilled_checkpoints() const { return ctx_.checkpoints_in_host; }
  /// The memory plan the trainer allocated (plan/memory_plan.hpp).
  const plan::MemoryPlan& memory_plan() const { return ctx_.plan; }

 private:
  using Pipeline = StreamPipeline<TrainItem, stages::Prefetch<Ctx>, stages::Compute<Ctx>, stages::Offload<Ctx>, UserStages...,
                                  stages::Optimize<Ctx>>;
  static constexpr std::size_t kOptimizerStage = 3 + sizeof...(UserStages);

  // ---- the schedule ----------------------------------------------------------------------------
  // The items of micro-batch m, in order. Streamed, the embedding's untouched rows are spread
  // over the first four fifths of the backward, between the blocks, so that the optimizer steps
  // them without holding up the blocks' gradients (which need the host's landing slots back).
  std::vector<TrainItem> step_items(std::int64_t m) const {
    const Ctx& t = ctx_;
    const std::size_t L = t.model.num_blocks(), H = L + 1;
    // A host unit's gradient lands during the backward when it streams or waits in host memory;
    // a device unit streaming is updated right after the item that completes its gradient.
    const auto lands = [&](std::size_t u) { return !t.devices.holds(u) && (t.streamed() || t.grads_on_host()); };
    std::vector<TrainItem> items;
    const auto update_now = [&](std::size_t u) {
      if (t.streamed() && t.devices.holds(u)) items.push_back({Kind::optimize, u, m});
    };
    const std::int64_t rest = t.streamed_unit(0) ? Ctx::pieces(t.vocab(), t.piece_rows()) : 0;
    std::int64_t rest_done = 0;
    const auto rest_until = [&](std::int64_t n) {
      for (; rest_done < std::min(n, rest); ++rest_done) items.push_back({Kind::embed_rest, 0, m, rest_done, true});
    };
    for (std::size_t u = 0; u <= L; ++u) items.push_back({Kind::forward, u, m});
    items.push_back({Kind::head, H, m, 0, lands(H)});
    if (t.streamed_unit(H))
      for (std::int64_t j = 1; j < Ctx::pieces(t.head_numel(), t.slot_numel()); ++j) items.push_back({Kind::grad_piece, H, m, j, true});
    update_now(H);
    const auto span = static_cast<std::int64_t>(std::max<std::size_t>(1, L - L / 5));
    const std::size_t k = t.plan.buffers.checkpoint_every;
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
    if (t.streamed_unit(0))
      for (std::int64_t j = 1; j < Ctx::pieces(t.touched.count(), t.piece_rows()); ++j) items.push_back({Kind::grad_piece, 0, m, j, true});
    update_now(0);
    return items;
  }
  // The AdamW pass of resident gradients, in forward order: a device unit's update on the device;
  // a host unit's from its resident slab, or (gradients waiting on the device) in landing-slot-
  // sized pieces.
  std::vector<TrainItem> pass_items() const {
    const Ctx& t = ctx_;
    std::vector<TrainItem> items;
    for (std::size_t u = 0; u < t.model.num_units(); ++u) {
      if (t.devices.holds(u) || t.grads_on_host()) {
        items.push_back({Kind::optimize, u, 0});
        continue;
      }
      const auto [lo, hi] = t.store.unit(u).owned();  // (a sharded store: this process's part)
      for (std::int64_t j = 0; j < Ctx::pieces(hi - lo, t.slot_numel()); ++j) items.push_back({Kind::optimize, u, 0, j, true});
    }
    return items;
  }

  // ---- the step's parts ----------------------------------------------------------------------------
  std::int64_t stage_batch(std::span<const std::int32_t> ids, std::span<const std::int32_t> labels,
                           std::span<const std::int32_t> positions, std::span<const std::uint8_t> attention_mask);
  void stage_objective(const Objective& objective, std::int64_t valid);
  // The forward of `rows` rows a micro-batch at a time, then each one's losses to `each(first token,
  // losses)`; or (logits_at: a position a row) its logits to StepContext::logits_host (next_logits).
  template <class F>
  void forward_only(std::span<const std::int32_t> ids, std::span<const std::int32_t> labels, std::int64_t rows,
                    std::span<const std::int32_t> positions, F&& each, std::span<const std::int64_t> logits_at = {});
  bool update_resident(double loss, std::optional<StepStats::Profile>& profile, double& grad_norm);
  // After a drain: nothing is in flight.
  void settle() {
    update_pending_ = false;
    publish_store_state();
  }
  // The store refuses whole readers (and loaders) while it is not the owner of the whole state
  // (HostParamStore::check_settled): while an update runs, and while the backend holds the device
  // units (after an evaluate() too: a store edited then would not reach them).
  void publish_store_state() { ctx_.store.set_update_in_flight(update_pending_ || device_newer_ || device_owns_); }
  void load_device_units();
  void save_device_units();
  StepStats::Profile profile() { return collect_profile<typename B::Executor, Pipeline, kOptimizerStage>(*pipeline_); }
  GradientView gradient_view() {
    return {[this](const TrainItem& it, const StageSlots& s) { return ctx_.landed_gradient(it, s); },
            [this](const TrainItem& it) { return ctx_.grads_on_host() ? GradientPiece{} : ctx_.piece(it, 0).where; },
            [this](std::size_t u) -> const std::string& { return ctx_.store.unit(u).name(); },
            [this] { return ctx_.state.step; }};
  }
  static int optimizer_threads() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

  Ctx ctx_;
  StepOutcome outcome_;
  bool update_pending_ = false;
  bool device_owns_ = false;   // the backend holds the device units' state (loaded from the store)
  bool device_newer_ = false;  // ... and has changed it since: the store's copies are stale
  std::unique_ptr<Pipeline> pipeline_;  // last: its threads stop before the buffers go
};

// ---- definitions (compiled once for the shipped backends: train/cpu_trainer.hpp) ------------------

template <class B, class Block, class... U>
Trainer<B, Block, U...>::Trainer(const DecoderModel<Block>& model, HostParamStore<float>& store, B& backend, TrainerOptions opt)
    : ctx_(model, store, backend, opt.resolved()) {
  MT_NVTX_RANGE("Trainer::Trainer");
  opt.validate();
  check_trainer_store(ctx_);
  check_trainer_options(ctx_);
  ctx_.allocate(sizeof...(U) > 0);
  pipeline_ = std::make_unique<Pipeline>(stages::Prefetch<Ctx>{{&ctx_}, backend.make_executor(B::Role::upload)},
                                         stages::Compute<Ctx>{{&ctx_}, backend.make_executor(B::Role::compute)},
                                         stages::Offload<Ctx>{{&ctx_}, backend.make_executor(B::Role::download)},
                                         U(gradient_view())..., stages::Optimize<Ctx>{{&ctx_}, HostExecutor(optimizer_threads())});
  // A user stage must not write a ring: the optimizer reads the offload stage's landing slots.
  [this]<std::size_t... J>(std::index_sequence<J...>) {
    [[maybe_unused]] const auto check = [](std::size_t slots) {
      MT_CHECK(slots == 0, "a user stage of the trainer asks for a ring of {} slots; user stages read the landed "
               "gradients and may write no ring (ring_slots() must be 0)", slots);
    };
    (check(pipeline_->template stage<3 + J>().ring_slots()), ...);
  }(std::index_sequence_for<U...>{});
}

template <class B, class Block, class... U>
Trainer<B, Block, U...>::~Trainer() {
  try {
    finish_update();
  } catch (const std::exception& e) {
    log_warning("megatrain: the trainer's last update failed while the trainer was destroyed: {}", e.what());
  }
}

template <class B, class Block, class... U>
StepStats Trainer<B, Block, U...>::step(const Objective& objective, std::span<const std::int32_t> ids,
                                        std::span<const std::int32_t> labels, std::span<const std::int32_t> positions,
                                        std::span<const std::uint8_t> attention_mask) {
  MT_NVTX_RANGE("Trainer::step");
  check_steppable(ctx_.store);
  const auto t0 = std::chrono::steady_clock::now();
  const std::int64_t valid = stage_batch(ids, labels, positions, attention_mask);
  stage_objective(objective, valid);
  auto& st = ctx_.state;
  st.step = outcome_.steps + 1;
  st.adam_step = st.step - outcome_.skipped;
  st.lr = ctx_.opt.schedule.at(st.step);
  st.clip_coef = 1.0;
  if (ctx_.opt.clip_norm > 0 && ctx_.opt.clip_mode == ClipMode::stale && outcome_.last_grad_norm)
    st.clip_coef = clip_coefficient(*outcome_.last_grad_norm, ctx_.opt.clip_norm);
  st.sumsq = 0;
  st.micro_rows = ctx_.opt.micro_rows();
  if (!ctx_.devices.holds(0)) ctx_.touched.find(ids, ctx_.model.embedding().op().padding_id());  // (the forward's fp32 rows)
  load_device_units();
  // (The previous step's AdamW pass, if still in flight, goes first: each unit's prefetch waits
  // for its update.)
  for (std::int64_t m = 0; m < ctx_.opt.micro_batches; ++m) pipeline_->submit(step_items(m));
  pipeline_->drain();
  settle();
  // A backend that tunes its matrix products over a trainer's first step fixes its choices then
  // (CudaBackendOptions::gemm_tuning): every later step runs the same algorithms.
  if constexpr (requires { ctx_.be.end_gemm_tuning(); }) ctx_.be.end_gemm_tuning();
  const auto [loss, aux_loss] = outcome_.losses(ctx_);
  // The stages' timings are read while nothing runs: before an AdamW pass that overlaps the next
  // step is submitted (its timings then come with the next step's), else at the end.
  std::optional<StepStats::Profile> prof;
  double grad_norm = 0;
  const bool skipped = ctx_.opt.resident_gradients() ? !update_resident(loss, prof, grad_norm) : false;
  if (!ctx_.opt.resident_gradients()) grad_norm = outcome_.streamed_norm(ctx_);
  device_newer_ = ctx_.devices.count() > 0;
  publish_store_state();
  outcome_.after_update(st.step, loss, grad_norm, skipped);
  outcome_.steps = st.step;

  StepStats s;
  s.step = st.step;
  s.skipped = skipped;
  s.loss = loss;
  s.lr = st.lr;
  s.grad_norm = grad_norm;
  s.clip_coef = st.clip_coef;
  s.tokens = ctx_.opt.batch_rows * ctx_.opt.seq_len * (ctx_.opt.distributed() ? ctx_.opt.comm->world() : 1);  // (the global batch's)
  s.aux_loss = aux_loss;
  ctx_.experts.expert_load(s, ctx_.opt.micro_batches);
  s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (ctx_.opt.profile) s.profile = prof ? std::move(*prof) : profile();
  return s;
}

// The batch checked and copied to the host buffers; returns the labelled tokens of the global
// batch (what the mean of cross-entropy divides by).
template <class B, class Block, class... U>
std::int64_t Trainer<B, Block, U...>::stage_batch(std::span<const std::int32_t> ids, std::span<const std::int32_t> labels,
                                                  std::span<const std::int32_t> positions,
                                                  std::span<const std::uint8_t> attention_mask) {
  const auto& opt = ctx_.opt;
  std::int64_t valid[1] = {BatchStaging<B>::check(ids, labels, opt.batch_rows, opt.seq_len, ctx_.vocab())};
  MT_CHECK(outcome_.failed.empty(), "this trainer stopped at a non-finite step and takes no further step ({})", outcome_.failed);
  if (opt.distributed()) opt.comm->all_reduce_sum(valid);
  MT_CHECK(valid[0] > 0, "the batch has no token with a label (all labels are {})", kIgnoreIndex);
  ctx_.batch.stage(opt, ids, labels, positions, attention_mask);
  return valid[0];
}

// The step's objective: one weight for every token (the head's scale), or a weight per token,
// made here for every micro-batch unless it needs the head's log-probabilities first (then by
// the head, Compute::upload_weights).
template <class B, class Block, class... U>
void Trainer<B, Block, U...>::stage_objective(const Objective& objective, std::int64_t valid) {
  auto& st = ctx_.state;
  st.objective = &objective;
  st.batch_labelled = valid;
  const std::optional<double> uniform = objective.uniform_weight(valid);
  st.weighted = !uniform;
  st.loss_scale = uniform.value_or(1.0);
  if (!st.weighted) return;
  check_weighted_objective(ctx_.opt, objective);
  if (objective.needs_log_probs()) return;
  for (std::int64_t m = 0; m < ctx_.opt.micro_batches; ++m)
    ctx_.batch.stage_weights(objective, ctx_.opt, m, ctx_.opt.micro_rows(), valid);
}

// Resident gradients: the whole gradient is known before any update (exact clipping's order).
// A non-finite loss or gradient changes nothing: the run stops there, or skips the step (returns
// false). Else the AdamW pass is submitted with the step's clip coefficient.
template <class B, class Block, class... U>
bool Trainer<B, Block, U...>::update_resident(double loss, std::optional<StepStats::Profile>& prof, double& grad_norm) {
  auto& st = ctx_.state;
  const auto [norm, bad] = outcome_.resident_norm(ctx_);
  grad_norm = norm;
  if (!std::isfinite(grad_norm) || !std::isfinite(loss)) {
    std::string weights;  // (a non-finite loss: the weights the forward read are looked at, and named)
    if (!std::isfinite(loss)) {
      if (device_newer_) {
        save_device_units();
        device_newer_ = false;
      }
      weights = nonfinite_weights(ctx_.store, ctx_.opt.comm);
    }
    const std::string unit = bad < ctx_.model.num_units() ? ctx_.model.units()[bad].name : std::string();
    outcome_.nonfinite(ctx_.opt, st.step, loss, grad_norm, unit, weights);  // (throws unless the step is skipped)
    return false;
  }
  outcome_.skipped_in_a_row = 0;
  if (ctx_.opt.clip_norm > 0) st.clip_coef = clip_coefficient(grad_norm, ctx_.opt.clip_norm);
  ctx_.pass = {st.adam_step, st.lr, st.clip_coef};
  if (ctx_.opt.profile && ctx_.opt.overlap_update) prof = profile();
  pipeline_->submit(pass_items());
  if (ctx_.opt.overlap_update) update_pending_ = true;
  else pipeline_->drain();
  if (ctx_.opt.sharded()) {  // (ZeRO-1: every process stepped its part; the weights it streams made whole again)
    ctx_.store.state_updated();
    MT_NVTX_RANGE("Trainer::gather_updated");
    ctx_.store.gather_updated(*ctx_.opt.comm, ctx_.devices.count());  // (device units: gathered on the device, Compute)
  }
  return true;
}

template <class B, class Block, class... U>
void Trainer<B, Block, U...>::finish_update() {
  MT_NVTX_RANGE("Trainer::finish_update");
  if (update_pending_) pipeline_->drain();
  update_pending_ = false;
  if (device_newer_) save_device_units();
  device_newer_ = false;
  device_owns_ = false;
  publish_store_state();
}

template <class B, class Block, class... U>
void Trainer<B, Block, U...>::restore(std::int64_t steps_done, std::optional<double> last_grad_norm, std::int64_t skipped_steps,
                                      std::int64_t skipped_in_a_row) {
  MT_CHECK(steps_done >= 0, "steps_done must be >= 0");
  MT_CHECK(skipped_steps >= 0 && skipped_steps <= steps_done && skipped_in_a_row >= 0 && skipped_in_a_row <= skipped_steps,
           "restore: {} skipped steps ({} in a row) do not fit {} steps done", skipped_steps, skipped_in_a_row, steps_done);
  MT_CHECK(!update_pending_ && !device_newer_, "restore: the trainer holds a newer state than the store; call "
           "finish_update() before loading the store and restoring");
  device_owns_ = false;
  outcome_.steps = steps_done;
  outcome_.last_grad_norm = last_grad_norm;
  outcome_.skipped = skipped_steps;
  outcome_.skipped_in_a_row = skipped_in_a_row;
}

template <class B, class Block, class... U>
std::vector<std::size_t> Trainer<B, Block, U...>::update_order() const {
  std::vector<std::size_t> order;
  std::vector<char> seen(ctx_.model.num_units(), 0);
  const auto add = [&](std::size_t u) {
    if (!seen[u]) order.push_back(u);
    seen[u] = 1;
  };
  if (ctx_.streamed()) {  // each landed piece is stepped as it lands (Optimize::applies)
    for (const TrainItem& it : step_items(0))
      if (it.carries_gradient()) add(it.unit);
  }
  for (std::size_t u = 0; u < ctx_.model.num_units(); ++u) add(u);  // resident: the second pass, in unit order
  return order;
}

// Device units: the backend takes their state from the store when it is not its owner yet ...
template <class B, class Block, class... U>
void Trainer<B, Block, U...>::load_device_units() {
  if (device_owns_ || ctx_.devices.count() == 0) return;
  ctx_.load_device_units();
  device_owns_ = true;
  publish_store_state();
}

// ... and gives it back (each unit through the update gate: a checkpoint writer may still read it).
template <class B, class Block, class... U>
void Trainer<B, Block, U...>::save_device_units() {
  // (a block's bf16 copy is made in the weights' ring on the compute stream: nothing may run)
  MT_CHECK(!update_pending_, "the device units' state is saved while an update is in flight: call finish_update()");
  ctx_.save_device_units();
}

}  // namespace megatrain

#include "megatrain/train/scoring.hpp"  // (evaluate() and score(): the forward alone)
#include "megatrain/train/decoding.hpp"  // (decode_logits(): a token a row over the caches)
