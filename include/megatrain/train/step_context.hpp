// What the stages of a step share: the model, the store and the backend; the resolved options;
// the step's scalars; the memory plan and every buffer it allocated (rings of weight slots and
// gradient accumulators, activation checkpoints, the batch, the embedding's touched rows, spilled
// activations, the experts' routing statistics); and where each unit's weights and gradients are
// for a given item. The stages (train/stages/) receive it and nothing else; the Trainer owns it
// and runs the schedule (train/trainer.hpp, whose top comment explains the step).
//
// Where a unit's weights and gradient live (see train/trainer.hpp for why):
//   - the embedding and the head have dedicated weight slots and accumulators (a tied head reads
//     the embedding's slot and accumulates into its gradient); blocks share rings of weight slots
//     and gradient slots (TrainerOptions::weight_slots, grad_slots);
//   - gradients that wait for the norm on the device have an accumulator per unit (in the pool,
//     beside the kept activations: plan::TrainerBuffers::lay_out_pool);
//   - device units (train/device_units.hpp) keep their fp32 masters and moments in backend memory;
//   - without resident gradients, a host embedding's gradient comes back as its touched rows (a
//     compact buffer) and the rest (embed_rest pieces), the head's in slot-sized pieces.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "megatrain/backend/arena.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/host_memory.hpp"
#include "megatrain/core/nvtx.hpp"
#include "megatrain/layers/decoder_model.hpp"
#include "megatrain/optim/adamw.hpp"
#include "megatrain/plan/planner.hpp"
#include "megatrain/step/trainer_options.hpp"
#include "megatrain/store/host_param_store.hpp"
#include "megatrain/train/activation_spill.hpp"
#include "megatrain/train/batch_staging.hpp"
#include "megatrain/train/decode_state.hpp"
#include "megatrain/train/device_units.hpp"
#include "megatrain/train/expert_statistics.hpp"
#include "megatrain/train/touched_rows.hpp"
#include "megatrain/train/train_item.hpp"

namespace megatrain {

template <class B, class Block>
struct StepContext {
  using Backend = B;
  using BlockOp = Block;
  using Act = typename B::Act;
  using Res = typename B::Res;  // the residual stream: activation checkpoints, gradients between units
  using W = typename B::Weight;
  using Acc = typename B::Acc;
  using Exec = typename B::Executor;
  using Kind = TrainItem::Kind;
  template <class E>
  using Buf = typename B::template Buffer<E>;
  /// Norm gains are read at full precision where the weights are bf16: host units' gains live in
  /// fp32 buffers (a unit's full_layout()), refreshed by the prefetch from the masters.
  static constexpr bool kSplitGains = !std::is_same_v<full_t<W>, W>;

  /// The step's scalars, set by Trainer::step before its items are submitted.
  struct Scalars {
    std::int64_t step = 0;
    std::int64_t adam_step = 0;  // AdamW's count (bias correction): the steps not skipped
    double lr = 0, loss_scale = 0, clip_coef = 1;
    double sumsq = 0;  // written by the optimizer stage only
    std::int64_t micro_rows = 0;
    // The step's objective (train/objective.hpp); `weighted`: the head reads a weight per token
    // (else it scales every token's gradient by loss_scale).
    const Objective* objective = nullptr;
    bool weighted = false;
    std::int64_t batch_labelled = 0;  // the global batch's labelled tokens
  };
  /// The AdamW pass of resident gradients (set before it is submitted; the next step's scalars
  /// change while it may still run).
  struct Pass {
    std::int64_t step = 0;
    double lr = 0, clip_coef = 1;
  };

  StepContext(const DecoderModel<Block>& m, HostParamStore<float>& s, B& backend, const TrainerOptions& o)
      : model(m), store(s), be(backend), opt(o), experts(m.config()) {}
  StepContext(const StepContext&) = delete;
  StepContext& operator=(const StepContext&) = delete;

  // ---- memory ------------------------------------------------------------------------------------
  /// Plans the step's memory (plan/memory_plan.hpp) on this backend's budget and allocates every
  /// buffer in its order; a configuration that does not fit is refused before anything is
  /// allocated, with what would fit. Settles the options the plan decides (device units, kept,
  /// spilled blocks, checkpoints).
  void allocate(bool user_stages) {
    MT_NVTX_RANGE("Trainer::allocate");
    plan::DeviceBudget budget = plan::device_budget(be, user_stages);
    budget.allocated += opt.reserved_device_bytes;  // (left free: the caller's, beside the step)
    const plan::HostBudget host{store.host_budget(), "the host memory budget the store was built with"};
    // (decided on this machine's figures where megatrain-plan --probe kept them: plan::machine_figures())
    plan = plan::plan_memory<B>(model, opt, budget, host, store.footprint(), B::kDevice ? plan::machine_figures() : plan::MachineFigures{});
    if (!plan.fits) MT_FAIL("{}", plan::refusal_message(plan, plan::suggest<B>(model, opt, budget, host, store.footprint())));
    allocate_weights_and_gradients();
    allocate_activations();
    allocate_host();
    place_device_units();
    if (plan.buffers.embed_rows > 0 && !plan.buffers.embed_rows_first) alloc_embed_rows();
    device_bytes = plan.device_total();
  }

  // ---- weights -----------------------------------------------------------------------------------
  /// A unit's weights on the device: the embedding's or head's slot, a slot of the blocks' ring
  /// (a device block's too, where the compute stage makes them), or a device block's fp32 masters.
  std::span<W> weight_slot(std::size_t unit, std::size_t slot) {
    if (unit == 0) return embed_slot.span();
    if (unit == model.head_unit()) return head_slot.span();
    if constexpr (std::is_same_v<W, float>)  // (a device block's fp32 weights: its masters)
      if (devices.holds(unit)) return devices.master_data(unit);
    return weight_ring[slot].span().first(static_cast<std::size_t>(model.block(unit - 1).layout().numel()));
  }
  /// The ops' view of a unit's weights in slot `slot` (and further units' slabs: a tied table),
  /// with the full-precision parameters from where they are: a device unit's fp32 masters, else
  /// the gains the prefetch uploaded (only where the weights are bf16).
  template <class Tmpl>
  auto weights(const Tmpl& tmpl, std::size_t unit, std::size_t slot,
               std::initializer_list<typename ParamBinder<const W>::Slab> others = {}) {
    const std::span<const W> w(weight_slot(unit, slot));
    if constexpr (kSplitGains) {
      const typename ParamBinder<const W>::FullSlab full =
          devices.holds(unit) ? typename ParamBinder<const W>::FullSlab{&tmpl.layout(), devices.master(unit)}
                              : typename ParamBinder<const W>::FullSlab{&tmpl.full_layout(), std::span<const float>(gains[unit].span())};
      return tmpl.bind(w, full, others);
    } else {
      return tmpl.bind(w, others);
    }
  }
  const UnitLayout& full_layout(std::size_t unit) const {
    if (unit == 0) return model.embedding().full_layout();
    if (unit == model.head_unit()) return model.head().full_layout();
    return model.block(unit - 1).full_layout();
  }
  /// The weights a device unit's update writes: the embedding's and the head's own slots; none
  /// for a block (made from its masters where read).
  std::span<W> device_weights(std::size_t u) {
    if (u == 0) return embed_slot.span();
    if (u == model.head_unit()) return head_slot.span();
    return {};
  }
  /// Whether an item reads its unit's weights.
  static bool reads_weights(const TrainItem& it) {
    return it.kind == Kind::forward || it.kind == Kind::head || it.kind == Kind::head_eval || it.kind == Kind::refill ||
           (it.kind == Kind::backward && it.unit != 0);
  }
  /// Whether the prefetch uploads the unit's weights for this item: a streamed unit's, read by
  /// the item; the embedding's only where a tied head reads them (its lookup reads fp32 rows).
  bool uploads_weights(const TrainItem& it) const {
    if (devices.holds(it.unit)) return false;
    return reads_weights(it) && (it.unit != 0 || model.head().op().tied());
  }
  /// Whether the item reads a device block's weights, made from its masters in the item's slot
  /// (bf16 weights; fp32 weights are the masters themselves).
  bool makes_device_weights(const TrainItem& it) const {
    if constexpr (std::is_same_v<W, float>) return false;
    return devices.holds(it.unit) && it.unit != 0 && it.unit != model.head_unit() && reads_weights(it);
  }
  /// ... in its `slot` of the ring, on the compute stream (the masters' last update came before).
  void make_device_weights(std::size_t u, std::size_t slot) {
    if constexpr (!std::is_same_v<W, float>) {
      static_assert(std::is_same_v<Res, float> && std::is_same_v<Act, W>,
                    "a device block's weights are its masters rounded by Backend::convert (fp32 residuals to weights)");
      const auto n = static_cast<std::int64_t>(store.unit(u).numel());
      be.convert(View<const Res>(devices.master(u).first(static_cast<std::size_t>(n)), Shape{n}),
                 View<Act>(weight_slot(u, slot), Shape{n}));
    } else {
      (void)u, (void)slot;
    }
  }
  /// Every process's part of unit u's weights in `slot` gathered from them, in backend memory,
  /// ordered on `stream` (null: the CPU backend's host memory).
  void gather_weights(std::size_t u, std::size_t slot, void* stream) {
    const auto& unit = store.unit(u);
    opt.comm->all_gather_backend_memory(weight_slot(u, slot).first(static_cast<std::size_t>(unit.numel())),
                                        store.shard_bounds(unit), stream);
  }
  /// A unit's fp32 masters into its bf16 weights on the backend (a store without a bf16 copy):
  /// in pieces through the staging buffer, each rounded to the nearest even bf16 on `e`'s stream
  /// after its copy, as the host optimizer rounds the copy it would have written: the same bits.
  void upload_rounded(Exec& e, std::span<const float> src, std::span<W> dst) {
    if constexpr (std::is_same_v<W, bf16>) {
      const std::span<float> stage = master_staging.span();
      MT_CHECK(!stage.empty(), "no staging buffer for the masters (the plan kept a bf16 copy)");
      for (std::size_t at = 0; at < src.size(); at += stage.size()) {
        const std::size_t n = std::min(stage.size(), src.size() - at);
        be.upload(e, src.subspan(at, n), stage.first(n));
        be.round_weights(e, std::span<const float>(stage.first(n)), dst.subspan(at, n));
      }
    } else {
      be.upload(e, src, dst);
    }
  }

  // ---- gradients ---------------------------------------------------------------------------------
  bool streamed() const { return !opt.resident_gradients(); }
  bool grads_on_host() const { return opt.resident_gradients() && opt.gradient_home == GradientHome::host; }
  bool grads_on_device() const { return opt.resident_gradients() && opt.gradient_home == GradientHome::device; }
  /// Whether unit u's gradient streams to the host during the backward (stepped as it lands).
  bool streamed_unit(std::size_t u) const { return streamed() && !devices.holds(u); }
  /// Whether unit u's gradient adds up micro-batches in its device accumulator.
  bool accumulates_on_device(std::size_t u) const { return devices.holds(u) || grads_on_device(); }
  /// Whether the item starts unit u's gradient afresh (zeroes its accumulator).
  bool fresh(const TrainItem& it, std::size_t u) const { return it.micro == 0 || !accumulates_on_device(u); }
  /// Whether unit u's share of the norm is summed on the device, over its complete gradient (else:
  /// as its streamed pieces are stepped, or over the resident slab where micro-batches add up).
  bool summed_on_device(std::size_t u) const {
    return devices.holds(u) || (opt.resident_gradients() && (grads_on_device() || opt.micro_batches == 1));
  }
  /// A unit's gradient accumulator: its own, or a slot of the blocks' ring; where blocks keep
  /// only their part of the sum (plan::keeps_gradient_parts) a block's is that part.
  std::span<Acc> grad_acc(std::size_t unit, std::size_t slot) {
    if (unit == 0) return embed_acc;
    if (unit == model.head_unit()) return head_acc.span();
    // (gradients waiting on the device, or a device block: its own, which may be an empty part)
    if (grads_on_device() || !block_acc[unit].empty()) return block_acc[unit];
    return grad_ring[slot].span().first(static_cast<std::size_t>(model.block(unit - 1).layout().numel()));
  }
  /// Whether unit u is a block whose accumulator holds only this process's part of its summed
  /// gradient (plan::keeps_gradient_parts: the trainer then has the one whole block's buffer).
  bool keeps_part(std::size_t unit) const { return grad_whole.size() > 0 && unit != 0 && unit != model.head_unit(); }
  /// Where a unit's whole gradient is made: its accumulator, or (keeps_part) the one buffer of a
  /// whole block.
  std::span<Acc> grad_target(std::size_t unit, std::size_t slot) {
    if (keeps_part(unit)) return grad_whole.span().first(static_cast<std::size_t>(model.block(unit - 1).layout().numel()));
    return grad_acc(unit, slot);
  }
  /// This process's part (StoreShard) of a unit's complete gradient; all of it where the
  /// optimizer is not sharded.
  std::span<const Acc> owned_gradient(std::size_t unit, std::size_t slot) {
    const std::span<const Acc> g = grad_acc(unit, slot);
    if (keeps_part(unit)) return g;
    const auto [lo, hi] = store.unit(unit).owned();
    return g.subspan(static_cast<std::size_t>(lo), static_cast<std::size_t>(hi - lo));
  }
  /// Where the gradient of `it` sits on the host once offloaded.
  std::span<const float> landed_gradient(const TrainItem& it, const StageSlots& s) {
    const auto& unit = store.unit(it.unit);
    if (grads_on_host()) {  // a later micro-batch's gradient waits in its staging slot
      if (it.kind != Kind::optimize && it.micro > 0) return staging[s.in].first(static_cast<std::size_t>(unit.numel()));
      return unit.grad();
    }
    return store.grad_slot(s.in).first(piece(it, 0).device.size());
  }
  static std::int64_t pieces(std::int64_t n, std::int64_t per) { return std::max<std::int64_t>(1, (n + per - 1) / per); }
  std::int64_t slot_numel() const { return store.grad_slot_numel(); }
  std::int64_t vocab() const { return model.config().vocab_size; }
  std::int64_t hidden() const { return model.config().hidden_size; }
  std::int64_t head_numel() const { return store.unit(model.head_unit()).numel(); }
  std::int64_t piece_rows() const { return slot_numel() / hidden(); }  // embedding rows per landing slot
  View<Acc> embed_table_grad() { return View<Acc>(embed_acc, Shape{vocab(), hidden()}); }
  View<Acc> touched_grad() {
    return View<Acc>(rows_acc.span().first(static_cast<std::size_t>(touched.count() * hidden())), Shape{touched.count(), hidden()});
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
      const auto [lo, hi] = store.unit(it.unit).owned();
      const auto S = static_cast<std::size_t>(slot_numel()), n = static_cast<std::size_t>(hi);
      const auto o = static_cast<std::size_t>(lo) + static_cast<std::size_t>(it.piece) * S;
      p.device = owned_gradient(it.unit, device_slot).subspan(o - static_cast<std::size_t>(lo), std::min(S, n - o));
      p.where.offset = o;
    } else if (it.kind == Kind::embed_rest) {  // table rows [r0, r1)
      const auto r0 = static_cast<std::size_t>(it.piece) * R, r1 = std::min(static_cast<std::size_t>(vocab()), r0 + R);
      p.where.offset = r0 * d;
      if (model.head().op().tied()) p.device = std::span<const Acc>(embed_acc).subspan(r0 * d, (r1 - r0) * d);
    } else if (it.unit == 0) {  // touched rows [i0, i1) of the compact buffer
      const auto i0 = static_cast<std::size_t>(it.kind == Kind::grad_piece ? it.piece : 0) * R;
      const auto i1 = std::min(static_cast<std::size_t>(touched.count()), i0 + R);
      p.device = std::span<const Acc>(rows_acc.span()).subspan(i0 * d, (i1 - i0) * d);
      p.where.rows = touched.rows().subspan(i0, i1 - i0);
      p.where.row_elems = d;
    } else if (it.unit == model.head_unit()) {  // elements [o, o + slot) of the head's gradient
      const auto S = static_cast<std::size_t>(slot_numel()), n = static_cast<std::size_t>(head_numel());
      const auto o = static_cast<std::size_t>(it.kind == Kind::grad_piece ? it.piece : 0) * S;
      p.device = std::span<const Acc>(head_acc.span()).subspan(o, std::min(S, n - o));
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
      const auto rows = touched.rows();
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

  // ---- device units --------------------------------------------------------------------------------
  /// Their state from the store into backend memory (with several processes, the parts of their
  /// weights and masters that the others hold).
  void load_device_units() {
    MT_NVTX_RANGE("Trainer::load_device_units");
    for (std::size_t u = 0; u < devices.count(); ++u) {
      const auto& unit = store.unit(u);
      devices.load(be, xfer, unit, device_weights(u));
      void* stream = nullptr;
      if constexpr (B::kDevice) stream = xfer.stream();
      // (the store holds this process's part of their bf16 weights: the rest from the others)
      if (weights_in_parts && !device_weights(u).empty()) gather_weights(u, 0, stream);
      // A block's weights are made from its masters: the others' parts of them, where each process
      // holds its own (the first update would bring them otherwise).
      if (device_weights(u).empty() && store.masters_sharded())
        opt.comm->all_gather_backend_memory(devices.master_data(u).first(static_cast<std::size_t>(unit.numel())),
                                            store.shard_bounds(unit), stream);
    }
    xfer.synchronize();
  }
  /// ... and back into the store, each unit through the update gate.
  void save_device_units() {
    MT_NVTX_RANGE("Trainer::save_device_units");
    const auto gate = update_gate.load();
    for (std::size_t u = 0; u < devices.count(); ++u) {
      if (gate) (*gate)(u);
      devices.save(be, xfer, store, u, std::span<const W>(device_weights(u)), weight_ring[0].span());
    }
  }

  // ---- activation checkpoints ----------------------------------------------------------------------
  /// Unit u's output during the forward: its device checkpoint, or (in host memory) a staging
  /// buffer that alternates with u's neighbours, so the next unit still reads its input from the
  /// device. With a checkpoint every k >= 2 blocks, an output that is none lives in a recompute
  /// buffer, and the last block's (read only by the head, right after) in the second
  /// activation-gradient buffer, which the head does not write.
  std::span<Res> ckpt_out(std::size_t u) {
    const plan::TrainerBuffers& b = plan.buffers;
    if (!b.kept(u)) return u == model.num_blocks() ? dbuf[1].span() : recompute[b.recompute_buffer(u)].span();
    return ckpt_host[u].empty() ? ckpt[u].span() : ckpt_staging[u % 2].span();
  }
  /// After unit u's forward: a checkpoint kept in host memory goes there (on the compute stream,
  /// ordered after the kernels that wrote it).
  void ckpt_down(Exec& exec, std::size_t u) {
    if (plan.buffers.kept(u) && !ckpt_host[u].empty())
      be.download(exec, std::span<const Res>(ckpt_staging[u % 2].span()), ckpt_host[u]);
  }
  /// Unit u's output as the input of unit u+1's backward: from the device, or brought back.
  std::span<Res> ckpt_in(Exec& exec, std::size_t u) {
    if (!plan.buffers.kept(u)) return ckpt_out(u);  // (refilled before)
    if (ckpt_host[u].empty()) return ckpt[u].span();
    be.upload(exec, std::span<const Res>(ckpt_host[u]), ckpt_staging[0].span());
    return ckpt_staging[0].span();
  }
  /// Tokens per block of a decoder block's token-wise work for chunks of `chunk_tokens`.
  std::int64_t token_block(std::int64_t chunk_tokens) const { return plan::token_block(opt, chunk_tokens); }

  // ---- references and state ------------------------------------------------------------------------
  const DecoderModel<Block>& model;
  HostParamStore<float>& store;
  B& be;
  TrainerOptions opt;
  Scalars state;
  Pass pass;
  plan::MemoryPlan plan;
  // The offload stage sums each gradient over the processes (TrainerOptions::sum_during_backward).
  bool sums_in_offload = opt.distributed() && opt.sum_during_backward && std::is_same_v<Acc, float> &&
                         opt.resident_gradients() && opt.gradient_home == GradientHome::host &&
                         opt.comm->can_sum_backend_memory(B::kDevice);
  // Gradients waiting on the device with several processes: the compute stage sums each one over
  // them as it is completed (a reduce-scatter where the optimizer is sharded: each process then
  // downloads and steps only its part).
  bool reduces_on_device = opt.distributed() && opt.resident_gradients() && opt.gradient_home == GradientHome::device;
  // Each process uploads its part of a unit's bf16 weights, and the GPUs gather the rest
  // (TrainerOptions::gather_weights_on_device).
  bool weights_in_parts = B::kDevice && opt.weights_in_parts(std::is_same_v<W, bf16>);
  std::size_t device_bytes = 0;
  /// Called by the optimizer stage before it changes a unit (Trainer::set_update_gate).
  std::atomic<std::shared_ptr<const std::function<void(std::size_t)>>> update_gate;

  // ---- buffers -------------------------------------------------------------------------------------
  DeviceUnits<B> devices;
  std::vector<Buf<full_t<W>>> gains;  // (kSplitGains) host units' norm gains at full precision
  Buf<std::byte> pool;                // the blocks' accumulators and the kept activations (lay_out_pool)
  std::vector<std::span<Acc>> block_acc;  // a block's own gradient accumulator (waiting on the device; device blocks)
  std::vector<Buf<Acc>> device_acc;   // ... a device block's own where the others have none
  Buf<Acc> grad_whole;                // a block's whole gradient, made before its part of the sum is kept (keeps_gradient_parts)
  std::vector<Buf<W>> weight_ring;
  std::vector<Buf<Acc>> grad_ring;
  Buf<W> embed_slot, head_slot;
  Buf<float> master_staging;  // (no bf16 copy in host memory: the masters' pieces on their way to bf16)
  std::span<Acc> embed_acc;   // the embedding's gradient: embed_acc_mem, or in the pool
  Buf<Acc> embed_acc_mem, head_acc;
  std::vector<Buf<Res>> ckpt;              // ckpt[u]: output of unit u (input of unit u+1), when on the device
  std::vector<std::span<Res>> ckpt_host;   // ... or in host memory
  std::vector<HostBuffer> ckpt_host_mem;
  std::vector<Buf<Res>> ckpt_staging;      // two device buffers for checkpoints in host memory
  std::vector<Buf<Res>> recompute;         // a checkpoint every k >= 2 blocks: the k - 1 outputs between
  std::vector<std::span<std::byte>> kept;  // kept[u]: a block's activations from its forward to its backward (in the pool)
  std::size_t checkpoints_in_host = 0;
  ActivationSpill<B> spill;
  std::vector<Buf<Res>> dbuf;  // gradients w.r.t. activations, ping-pong
  Buf<std::byte> scratch_mem;
  Arena arena;
  BatchStaging<B> batch;
  ExpertStatistics<B> experts;
  TouchedRows touched;
  Buf<Acc> rows_acc;                      // streamed: the touched rows' gradient, compact
  Buf<std::int32_t> touched_dev, compact_ids_dev;
  Buf<float> embed_rows;           // a host embedding: the batch's distinct rows, fp32, for the lookup
  HostBuffer embed_rows_host_mem;  // (gathered here from the masters, then uploaded)
  std::span<float> embed_rows_host;
  Buf<Acc> loss_dev;
  // Trainer::next_logits: the position of each row of the micro-batch whose next-token logits the
  // head's evaluation item makes instead of its losses (empty: the losses), one row's logits on
  // the device at a time, and the micro-batch's in host memory (rows x vocab).
  std::vector<std::int64_t> logits_at;
  Buf<Act> logits_dev;
  std::vector<Act> logits_host;
  DecodeState<B> decode;  // Trainer::decode_logits: the caches and the rows' positions
  Buf<double> sumsq_dev;  // each unit's sum of squared gradient elements, where summed on the device
  HostBuffer sumsq_host_mem;
  std::span<double> sumsq_host;
  HostBuffer staging_mem;
  std::vector<std::span<float>> staging;  // micro-batches after the first land here (two slots)
  Exec xfer = be.make_executor(B::Role::upload);  // device units' state to and from the store

 private:
  // A backend buffer of n elements; none (no memory at all) for n = 0, as the plan counts it.
  template <class E>
  Buf<E> alloc(std::size_t n) {
    return n == 0 ? Buf<E>() : be.template alloc<E>(n);
  }
  // n elements of the pool from byte `at` (256-byte aligned by the plan).
  template <class E>
  std::span<E> pool_as(std::size_t at, std::size_t n) {
    return {reinterpret_cast<E*>(pool.span().data() + at), n};
  }
  // The weights' ring, the pool (blocks' accumulators, kept activations), the gradients' ring, the
  // gains, the embedding's and head's slots and accumulators, the touched rows' buffers.
  void allocate_weights_and_gradients() {
    const plan::TrainerBuffers& b = plan.buffers;
    const std::size_t L = model.num_blocks();
    for (std::size_t k = 0; k < b.weight_slots; ++k) weight_ring.push_back(alloc<W>(b.block_slot));
    pool = alloc<std::byte>(b.pool_bytes);
    block_acc.assign(L + 2, {});
    kept.assign(L + 2, {});
    for (std::size_t u = 0; u < b.block_acc.size(); ++u)
      if (b.block_acc[u] > 0) block_acc[u] = pool_as<Acc>(b.acc_at[u], b.block_acc[u]);
    for (std::size_t u = 1; u <= L; ++u)
      if (b.keeps(u)) kept[u] = pool_as<std::byte>(b.kept_at[u], b.kept_bytes[u]);
    grad_whole = alloc<Acc>(b.grad_whole);  // (blocks keeping their part of the sum: where a whole one is made)
    for (std::size_t k = 0; k < b.grad_slots; ++k) grad_ring.push_back(alloc<Acc>(b.block_slot));
    if constexpr (kSplitGains)
      for (std::size_t u = 0; u < b.units; ++u) gains.push_back(alloc<full_t<W>>(b.gains[u]));
    embed_slot = alloc<W>(b.embed_slot);
    head_slot = alloc<W>(b.head_slot);
    master_staging = alloc<float>(b.master_staging);
    // resident gradients (in the pool where plan::TrainerBuffers::embed_acc_in_pool), or a tied head's share (streamed)
    if (b.embed_acc_in_pool) {
      embed_acc = pool_as<Acc>(b.acc_at[0], b.embed_acc);
    } else {
      embed_acc_mem = alloc<Acc>(b.embed_acc);
      embed_acc = embed_acc_mem.span();
    }
    rows_acc = alloc<Acc>(b.rows_acc);  // streamed: the touched rows' compact gradient, their list, the compact ids
    touched_dev = alloc<std::int32_t>(b.touched);
    compact_ids_dev = alloc<std::int32_t>(b.compact_ids);
    head_acc = alloc<Acc>(b.head_acc);
  }
  // The activation gradients, the scratch, the batch, the losses and norms, the routing
  // statistics; the outputs between checkpoints, the checkpoints (the first on the device, the
  // rest in pinned host memory through two device staging buffers) and the spilled activations.
  void allocate_activations() {
    const plan::TrainerBuffers& b = plan.buffers;
    const std::size_t L = model.num_blocks();
    for (int k = 0; k < 2; ++k) dbuf.push_back(alloc<Res>(b.act));
    scratch_mem = alloc<std::byte>(b.scratch_bytes);
    arena = Arena(scratch_mem.span());
    batch.allocate_device(be, b);
    loss_dev = alloc<Acc>(b.micro_tokens);
    sumsq_dev = alloc<double>(b.units);
    experts.allocate_device(be, b);
    if constexpr (requires { typename B::WorkspacePlan; }) be.prepare(b.workspace);  // backends that allocate workspaces up front
    // The embedding's fp32 rows for the lookup (a host embedding): first when no unit will be on
    // the device, else after the placement (from the reserve it leaves).
    if (b.embed_rows_first) alloc_embed_rows();
    for (std::size_t k = 0; k < b.recompute_buffers; ++k) recompute.push_back(alloc<Res>(b.act));
    ckpt.resize(L + 1);
    ckpt_host.resize(L + 1);
    for (std::size_t u = 0; u <= L; ++u) {
      if (!b.kept(u)) continue;
      if (b.checkpoint_index(u) < b.checkpoints_on_device) {
        ckpt[u] = alloc<Res>(b.act);
      } else {
        ckpt_host_mem.push_back(HostBuffer::allocate(b.checkpoint_bytes()));
        ckpt_host[u] = ckpt_host_mem.back().template as<Res>(0, b.act);
      }
    }
    checkpoints_in_host = b.checkpoints_in_host();
    if (checkpoints_in_host > 0)
      for (int k = 0; k < 2; ++k) ckpt_staging.push_back(alloc<Res>(b.act));
    spill.allocate(be, b, L);
  }
  // Host: the batch, the norms' sums, the routing statistics, the staging of micro-batches' gradients.
  void allocate_host() {
    const plan::TrainerBuffers& b = plan.buffers;
    batch.allocate_host(b, opt.batch_rows);
    touched.bind(batch.touched_host, batch.compact_ids_host);
    sumsq_host_mem = HostBuffer::allocate(b.units * sizeof(double));
    sumsq_host = sumsq_host_mem.template as<double>(0, b.units);
    experts.allocate_host(b);
    if (b.staging > 0) {
      staging_mem = HostBuffer::allocate(2 * b.staging * sizeof(float));
      for (std::size_t k = 0; k < 2; ++k) staging.push_back(staging_mem.template as<float>(k * b.staging, b.staging));
    }
  }
  // The embedding's fp32 rows for the lookup, on the device and in (pinned) host memory, and the
  // compact ids where no streamed gradient has them already.
  void alloc_embed_rows() {
    const std::size_t n = plan.buffers.embed_rows;
    embed_rows = alloc<float>(n);
    embed_rows_host_mem = HostBuffer::allocate(n * sizeof(float));
    embed_rows_host = embed_rows_host_mem.template as<float>(0, n);
    if (compact_ids_dev.size() == 0) compact_ids_dev = alloc<std::int32_t>(plan.buffers.micro_tokens);
  }
  // Device units (TrainerOptions::device_units): the plan's count; each needs its state and its
  // own gradient accumulator where gradients would otherwise share a ring or land in pieces (a
  // block's weights are made in the ring's slots from its masters).
  void place_device_units() {
    const std::size_t count = plan.buffers.device_units;
    opt.device_units = static_cast<std::int64_t>(count);
    opt.checkpoint_every = static_cast<std::int64_t>(plan.buffers.checkpoint_every);
    opt.kept_blocks = static_cast<std::int64_t>(plan.buffers.kept_blocks);
    opt.spilled_blocks = static_cast<std::int64_t>(plan.buffers.spilled_blocks);
    if (count == 0) return;
    devices = DeviceUnits<B>(be, store, count);
    for (std::size_t u = 1; u < count && u != model.head_unit(); ++u)
      if (block_acc[u].empty())
        block_acc[u] = (device_acc.emplace_back(alloc<Acc>(static_cast<std::size_t>(store.unit(u).numel())))).span();
    if (embed_acc.empty()) {
      embed_acc_mem = alloc<Acc>(static_cast<std::size_t>(store.unit(0).numel()));
      embed_acc = embed_acc_mem.span();
    }
  }
};

}  // namespace megatrain
