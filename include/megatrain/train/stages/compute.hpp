// The compute stage: each item's work on the device (the compute stream), token chunk by chunk.
//
//   forward    the embedding's lookup (its fp32 rows) or a block over the micro-batch, its output
//              the next unit's input and, where the plan keeps one, its activation checkpoint;
//              blocks that keep (or spill) their activations for the backward keep them here
//   refill     a block's output again from the checkpoint below it (a checkpoint every k blocks)
//   head       the final norm, LM head and loss fused with their backward, each token's gradient
//              weighted by the step's objective (train/objective.hpp); head_eval: the loss alone
//   backward   a unit's backward from its checkpoint (recomputed) or its kept activations, the
//              weight gradient accumulated over chunks and micro-batches
//   optimize   a device unit's AdamW (train/device_units.hpp)
//
// Once an item completes a unit's gradient (its last micro-batch), the unit's share of the global
// norm is summed here where it waits on the device (several processes: the gradient summed over
// them first, each keeping its part where the optimizer is sharded).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "megatrain/core/nvtx.hpp"
#include "megatrain/layers/ops/embedding.hpp"
#include "megatrain/pipeline/stream_pipeline.hpp"
#include "megatrain/plan/memory_plan.hpp"
#include "megatrain/train/stages/stage_base.hpp"

namespace megatrain::stages {

template <class Ctx>
struct Compute : StageBase<Ctx> {
  using B = typename Ctx::Backend;
  using Block = typename Ctx::BlockOp;
  using Exec = typename Ctx::Exec;
  using Act = typename Ctx::Act;
  using Res = typename Ctx::Res;
  using Acc = typename Ctx::Acc;
  using Kind = TrainItem::Kind;
  Exec exec;
  std::size_t dy = 0;  // which of the two gradient buffers holds dL/d(current unit's output)
  Timings<Exec> timings{};
  std::vector<StepStats::Profile::Item> timed_items{};  // what each span in `timings` was, and its host time

  Exec& executor() { return exec; }
  std::size_t ring_slots() const { return this->ctx->opt.grad_slots; }
  UnitAccess unit_access() const { return UnitAccess::none; }
  bool applies(const TrainItem& it) const {
    return it.kind == Kind::forward || it.kind == Kind::head || it.kind == Kind::head_eval || it.kind == Kind::backward ||
           it.kind == Kind::refill || (it.kind == Kind::optimize && this->ctx->devices.holds(it.unit));
  }
  // A forward writes no gradient: taking a slot would make it wait for the optimizer stage to
  // pass the item that held the slot, i.e. for the whole AdamW pass still in flight. With
  // micro-batches the forward items keep taking slots: the slots' reuse is what orders the next
  // micro-batch's head (which zeroes the head's and a tied embedding's accumulators) after the
  // offload of the previous micro-batch's embedding gradient. A device unit's update writes
  // no gradient either.
  bool takes_slot(const TrainItem& it) const {
    if (it.kind == Kind::head_eval || it.kind == Kind::optimize || it.kind == Kind::refill) return false;
    return it.kind != Kind::forward || this->ctx->opt.micro_batches > 1;
  }
  void run(const TrainItem& it, const StageSlots& s) {
    MT_NVTX_RANGE("stage:compute");
    this->jitter(it);
    Ctx& t = *this->ctx;
    Timed<Exec> timed(exec, t.opt.profile ? &timings : nullptr);
    if (t.opt.profile) timed_items.push_back({static_cast<int>(it.kind), it.unit});
    // Weights in parts (TrainerOptions::gather_weights_on_device): the prefetch uploaded this
    // process's part of the unit's weights; the other processes' parts come from their GPUs.
    if constexpr (B::kDevice)
      if (t.weights_in_parts && t.uploads_weights(it)) t.gather_weights(it.unit, s.in, exec.stream());
    if (t.makes_device_weights(it)) t.make_device_weights(it.unit, s.in);
    struct HostClock {  // the host's time to enqueue the item's work (a GPU span as long means launch-bound)
      StepStats::Profile::Item* item;
      std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
      ~HostClock() {
        if (item) item->host_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      }
    } host_clock{t.opt.profile ? &timed_items.back() : nullptr};
    switch (it.kind) {
      case Kind::forward: it.unit == 0 ? embedding_forward(it) : block_forward(it, s); break;
      case Kind::refill: refill(it, s); break;
      case Kind::head:
      case Kind::head_eval: head(it, s); break;
      case Kind::backward: it.unit == 0 ? embedding_backward(it) : block_backward(it, s); break;
      case Kind::optimize: device_update(it, s); break;
      case Kind::grad_piece:
      case Kind::embed_rest: break;
    }
    if ((it.kind == Kind::head || it.kind == Kind::backward) && it.micro + 1 == t.opt.micro_batches && t.summed_on_device(it.unit))
      complete_gradient(it, s);
  }

 private:
  std::int64_t rows() const { return this->ctx->state.micro_rows; }
  std::int64_t seq() const { return this->ctx->decode.running ? 1 : this->ctx->opt.seq_len; }  // (decoding: a token a row)
  std::int64_t chunk() const {
    const auto& o = this->ctx->opt;
    return o.chunk_rows > 0 ? std::min(o.chunk_rows, rows()) : rows();
  }
  // [n*seq, d] rows of an activation buffer, from row r0
  template <class E>
  View<E> rows_of(std::span<E> buf, std::int64_t r0, std::int64_t n) const {
    const std::int64_t d = this->ctx->hidden();
    return View<E>(buf.subspan(static_cast<std::size_t>(r0 * seq() * d), static_cast<std::size_t>(n * seq() * d)), Shape{n * seq(), d});
  }
  // [n*seq] values a token of a per-token buffer (ids, labels, weights), from row r0
  template <class E>
  View<const E> tok(std::span<E> buf, std::int64_t r0, std::int64_t n) const {
    return View<const E>(std::span<const E>(buf).subspan(static_cast<std::size_t>(r0 * seq()), static_cast<std::size_t>(n * seq())),
                         Shape{n * seq()});
  }
  template <class F>
  void for_chunks(F&& f) const {
    for (std::int64_t r0 = 0; r0 < rows(); r0 += chunk()) f(r0, std::min(chunk(), rows() - r0));
  }
  // A block's chunk: its rows, their packing, its token blocks, its routing statistics
  ChunkShape block_chunk(const TrainItem& it, std::int64_t r0, std::int64_t n_rows, RouterStats router = {}) const {
    Ctx& t = *this->ctx;
    if (t.decode.running) {  // (one token a row, each row's cache)
      ChunkShape c{n_rows, 1};
      c.decode = t.decode.layer(it.unit - 1, r0, n_rows);
      return c;
    }
    if (t.batch.masked)  // (the tokens the routing statistics and the auxiliary loss count)
      router.valid = View<const std::uint8_t>(std::span<const std::uint8_t>(t.batch.valid_dev.span()).subspan(
                                                  static_cast<std::size_t>(r0 * seq()), static_cast<std::size_t>(n_rows * seq())),
                                              Shape{n_rows * seq()});
    return ChunkShape{n_rows, seq(), t.batch.packed_rows(t.opt, it.micro, rows(), r0, n_rows), t.token_block(chunk() * seq()), router};
  }
  // A sparse block's routing statistics for micro-batch m (train/expert_statistics.hpp).
  RouterStats router(std::size_t unit, std::int64_t m, bool record, bool aux) const {
    Ctx& t = *this->ctx;
    const double forwards = static_cast<double>(t.opt.micro_batches * (t.opt.distributed() ? t.opt.comm->world() : 1));
    return t.experts.of(unit, t.model.num_blocks(), m, record, aux, t.batch.counted_tokens(t.opt, m), forwards);
  }

  // The micro-batch's tokens up (ids, labels, positions, the tokens that count), then the lookup:
  // a device unit's fp32 master table, or the batch's distinct rows gathered by the prefetch
  // (indexed by the tokens' compact ids).
  void embedding_forward(const TrainItem& it) {
    Ctx& t = *this->ctx;
    const std::int64_t d = t.hidden();
    auto out = t.ckpt_out(0);
    const auto off = static_cast<std::size_t>(it.micro * rows() * seq());
    const auto n = static_cast<std::size_t>(rows() * seq());
    if (it.piece == 0) t.spill.begin_micro_batch(exec);
    if (it.piece == 0 && t.experts.active()) t.experts.zero(t.be, exec, it.micro, t.opt.micro_batches);  // (a step's forward)
    t.be.upload(exec, std::span<const std::int32_t>(t.batch.ids_host).subspan(off, n), t.batch.ids_dev.span().first(n));
    t.be.upload(exec, std::span<const std::int32_t>(t.batch.labels_host).subspan(off, n), t.batch.labels_dev.span().first(n));
    if (t.opt.packed && !t.decode.running) t.batch.upload_positions(t.be, exec, seq(), it.micro, rows());
    if (t.decode.running)
      t.be.upload(exec, std::span<const std::int32_t>(t.decode.positions_host), t.decode.positions_dev.span());
    if (t.batch.masked && it.piece == 0)  // (a step's forward: the tokens its auxiliary loss counts)
      t.be.upload(exec, std::span<const std::uint8_t>(t.batch.valid_host).subspan(off, n), t.batch.valid_dev.span());
    std::span<std::int32_t> ids = t.batch.ids_dev.span();
    View<const float> table;
    if (t.devices.holds(0)) {
      table = View<const float>(t.devices.master(0).first(static_cast<std::size_t>(t.vocab() * d)), Shape{t.vocab(), d});
    } else {
      t.be.upload(exec, t.touched.compact_ids().subspan(off, n), t.compact_ids_dev.span().first(n));
      ids = t.compact_ids_dev.span();
      table = View<const float>(std::span<const float>(t.embed_rows.span()).first(static_cast<std::size_t>(t.touched.count() * d)),
                                Shape{t.touched.count(), d});
    }
    for_chunks([&](std::int64_t r0, std::int64_t n_rows) {
      t.model.embedding().op().forward_full(t.be, ChunkShape{n_rows, seq()}, table, tok(ids, r0, n_rows), rows_of(out, r0, n_rows),
                                            t.arena);
    });
    if (!t.decode.running) t.ckpt_down(exec, 0);
  }

  // A block over the micro-batch; where its activations stay for the backward (kept on the
  // device, or spilled to host memory), its forward keeps them.
  void block_forward(const TrainItem& it, const StageSlots& s) {
    Ctx& t = *this->ctx;
    const auto& tmpl = t.model.block(it.unit - 1);
    const auto w = t.weights(tmpl, it.unit, s.in);
    auto out = t.ckpt_out(it.unit);            // its device checkpoint, or a staging buffer
    const auto in = t.ckpt_out(it.unit - 1);   // the previous unit's output is still there
    const RouterStats router_stats = router(it.unit, it.micro, it.piece == 0, false);  // (a step's: recorded)
    const bool spills = it.piece == 0 && t.plan.buffers.spills(it.unit);
    if (it.piece == 0 && (t.plan.buffers.keeps(it.unit) || spills)) {  // its activations stay for the backward
      if constexpr (plan::keeps_activations<B, Block>) {
        Arena kept(spills ? t.spill.stage_for_forward(exec, it.unit) : t.kept[it.unit]);
        for_chunks([&](std::int64_t r0, std::int64_t n_rows) {
          tmpl.op().forward_keep(t.be, block_chunk(it, r0, n_rows, router_stats), w, View<const Res>(rows_of(in, r0, n_rows)),
                                 rows_of(out, r0, n_rows), kept, t.arena);
        });
        if (spills) t.spill.down(exec, it.unit);  // (in host memory until the backward)
      }
    } else {
      for_chunks([&](std::int64_t r0, std::int64_t n_rows) {
        tmpl.op().forward(t.be, block_chunk(it, r0, n_rows, router_stats), w, View<const Res>(rows_of(in, r0, n_rows)),
                          rows_of(out, r0, n_rows), t.arena);
      });
    }
    if (!t.decode.running) t.ckpt_down(exec, it.unit);
  }

  // A block's output again, from the checkpoint below it (or the output refilled before).
  void refill(const TrainItem& it, const StageSlots& s) {
    Ctx& t = *this->ctx;
    const auto& tmpl = t.model.block(it.unit - 1);
    const auto w = t.weights(tmpl, it.unit, s.in);
    const auto in = t.ckpt_in(exec, it.unit - 1);
    const auto out = t.ckpt_out(it.unit);
    for_chunks([&](std::int64_t r0, std::int64_t n_rows) {
      tmpl.op().forward(t.be, block_chunk(it, r0, n_rows), w, View<const Res>(rows_of(in, r0, n_rows)), rows_of(out, r0, n_rows),
                        t.arena);
    });
  }

  // The final norm, LM head and loss over the micro-batch (with their backward unless head_eval);
  // the per-token losses and the micro-batch's routing statistics down to the host.
  void head(const TrainItem& it, const StageSlots& s) {
    Ctx& t = *this->ctx;
    const auto& tmpl = t.model.head();
    const bool tied = t.model.head().op().tied();
    const auto w = t.weights(tmpl, it.unit, s.in, {{&t.model.embedding().layout(), std::span<const typename Ctx::W>(t.embed_slot.span())}});
    const auto x = t.ckpt_out(t.model.num_blocks());
    if (it.kind == Kind::head) {  // (accumulators that add up micro-batches: at the first)
      if (t.fresh(it, it.unit)) t.be.zero(exec, t.head_acc.span());
      if (tied && t.fresh(it, 0)) t.be.zero(exec, t.embed_acc);
    }
    // (untied: the head's own lm_head; the embedding's gradient buffer is not bound)
    const auto g = tied ? tmpl.bind(t.head_acc.span(), {{&t.model.embedding().layout(), t.embed_acc}}) : tmpl.bind(t.head_acc.span());
    const auto loss_rows = [&](std::int64_t r0, std::int64_t n_rows) {
      return View<Acc>(t.loss_dev.span().subspan(static_cast<std::size_t>(r0 * seq()), static_cast<std::size_t>(n_rows * seq())),
                       Shape{n_rows * seq()});
    };
    const auto forward_only = [&] {
      for_chunks([&](std::int64_t r0, std::int64_t n_rows) {
        tmpl.op().forward(t.be, ChunkShape{n_rows, seq()}, w, View<const Res>(rows_of(x, r0, n_rows)),
                          tok(t.batch.labels_dev.span(), r0, n_rows), loss_rows(r0, n_rows), t.arena);
      });
    };
    if (it.kind == Kind::head_eval && !t.logits_at.empty()) {
      next_logits(w, x);
      dy = 0;
      return;
    }
    if (it.kind == Kind::head_eval) {
      forward_only();
    } else {
      const bool weighted = t.state.weighted;
      if (weighted) upload_weights(it, forward_only);
      for_chunks([&](std::int64_t r0, std::int64_t n_rows) {
        const View<const Acc> weights = weighted ? tok(t.batch.weights_dev.span(), r0, n_rows) : View<const Acc>{};
        tmpl.op().forward_backward(t.be, ChunkShape{n_rows, seq()}, w, View<const Res>(rows_of(x, r0, n_rows)),
                                   tok(t.batch.labels_dev.span(), r0, n_rows), t.state.loss_scale, weights, loss_rows(r0, n_rows),
                                   rows_of(t.dbuf[0].span(), r0, n_rows), g, t.arena);
      });
    }
    if (it.kind == Kind::head && t.streamed_unit(0) && tied) {
      // The touched rows' share of the tied head's gradient moves to the compact buffer, where
      // the embedding's backward adds its own; the rest of the table is final.
      const auto U = static_cast<std::size_t>(t.touched.count());
      t.be.upload(exec, t.touched.rows(), t.touched_dev.span().first(U));
      t.be.take_rows(View<const std::int32_t>(std::span<const std::int32_t>(t.touched_dev.span()).first(U), Shape{t.touched.count()}),
                     t.embed_table_grad(), t.touched_grad());
    }
    dy = 0;
    t.be.download(exec, std::span<const Acc>(t.loss_dev.span()),
                  t.batch.loss_host.subspan(it.kind == Kind::head ? static_cast<std::size_t>(it.micro * rows() * seq()) : 0,
                                            static_cast<std::size_t>(rows() * seq())));
    if (it.kind == Kind::head && t.experts.active()) t.experts.download(t.be, exec, it.micro, t.opt.micro_batches);
  }

  // Trainer::next_logits: the final norm and the LM head at one position of each row
  // (t.logits_at), a row at a time through one device row, down to t.logits_host.
  template <class HeadWeights, class X>
  void next_logits(const HeadWeights& w, const X& x) {
    Ctx& t = *this->ctx;
    const std::int64_t V = t.vocab();
    if (t.decode.running) {  // (a token a row: a chunk's rows' logits in one product)
      for_chunks([&](std::int64_t r0, std::int64_t n) {
        const auto part = View<Act>(t.logits_dev.span().subspan(static_cast<std::size_t>(r0 * V), static_cast<std::size_t>(n * V)),
                                    Shape{n, V});
        t.model.head().op().logits(t.be, ChunkShape{n, 1}, w, View<const Res>(rows_of(x, r0, n)), part, t.arena);
      });
      const auto all = std::span<const Act>(t.logits_dev.span()).first(static_cast<std::size_t>(rows() * V));
      t.be.download(exec, all, std::span<Act>(t.logits_host));
      return;
    }
    const auto out = View<Act>(t.logits_dev.span().first(static_cast<std::size_t>(V)), Shape{1, V});
    for (std::int64_t r = 0; r < rows(); ++r) {
      const auto last = token_rows(rows_of(x, r, 1), t.logits_at[static_cast<std::size_t>(r)], 1);
      t.model.head().op().logits(t.be, ChunkShape{1, 1}, w, View<const Res>(last), out, t.arena);
      t.be.download(exec, std::span<const Act>(out.span()),
                    std::span<Act>(t.logits_host).subspan(static_cast<std::size_t>(r * V), static_cast<std::size_t>(V)));
    }
  }

  // Micro-batch m's token weights up to the device: an objective that reads the log-probabilities
  // gets them from the head's forward first (the losses down, the weights made on the host).
  template <class F>
  void upload_weights(const TrainItem& it, F&& head_forward) {
    Ctx& t = *this->ctx;
    const auto off = static_cast<std::size_t>(it.micro * rows() * seq()), n = static_cast<std::size_t>(rows() * seq());
    if (t.state.objective->needs_log_probs()) {
      head_forward();
      t.be.download(exec, std::span<const Acc>(t.loss_dev.span()).first(n), t.batch.loss_host.subspan(off, n));
      exec.synchronize();
      t.batch.stage_weights(*t.state.objective, t.opt, it.micro, rows(), t.state.batch_labelled);
    }
    t.be.upload(exec, std::span<const Acc>(t.batch.weights_host).subspan(off, n), t.batch.weights_dev.span().first(n));
  }

  // The embedding's backward: streamed, into the compact buffer of touched rows (indexed by the
  // tokens' compact ids); else into its accumulator.
  void embedding_backward(const TrainItem& it) {
    Ctx& t = *this->ctx;
    const bool tied = t.model.head().op().tied();
    std::span<std::int32_t> ids = t.batch.ids_dev.span();
    typename Embedding::template Weights<Acc> g{};
    if (t.streamed_unit(0)) {
      const auto off = static_cast<std::size_t>(it.micro * rows() * seq()), n = static_cast<std::size_t>(rows() * seq());
      t.be.upload(exec, t.touched.compact_ids().subspan(off, n), t.compact_ids_dev.span().first(n));
      ids = t.compact_ids_dev.span();
      g.table = t.touched_grad();
      if (!tied) t.be.zero(exec, g.table.span());
    } else {
      if (!tied && t.fresh(it, 0)) t.be.zero(exec, t.embed_acc);
      g = t.model.embedding().bind(t.embed_acc);
    }
    // (the padding row, if any: by its index among the touched rows where ids are compact)
    const std::int32_t skip = t.streamed_unit(0) ? t.touched.padding() : t.model.embedding().op().padding_id();
    for_chunks([&](std::int64_t r0, std::int64_t n_rows) {
      t.model.embedding().op().backward(t.be, ChunkShape{n_rows, seq()}, tok(ids, r0, n_rows),
                                        View<const Res>(rows_of(t.dbuf[dy].span(), r0, n_rows)), g, t.arena, skip);
    });
  }

  // A block's backward: from the activations its forward kept (on the device, or spilled), or
  // recomputed from its checkpoint; its weight gradient added into its accumulator.
  void block_backward(const TrainItem& it, const StageSlots& s) {
    Ctx& t = *this->ctx;
    const auto& tmpl = t.model.block(it.unit - 1);
    const auto w = t.weights(tmpl, it.unit, s.in);
    auto acc = t.grad_target(it.unit, s.out);
    if (t.fresh(it, it.unit)) t.be.zero(exec, acc);
    const auto g = tmpl.bind(acc);
    const auto x = t.ckpt_in(exec, it.unit - 1);
    const RouterStats router_stats = router(it.unit, it.micro, false, true);  // (the auxiliary loss's gradient)
    const bool spilled = t.plan.buffers.spills(it.unit);
    t.spill.fetch();  // (copies up ahead of the spilled blocks' backward)
    if (t.plan.buffers.keeps(it.unit) || spilled) {  // from the activations its forward kept
      if constexpr (plan::keeps_activations<B, Block>) {
        Arena kept(spilled ? t.spill.stage_for_backward(exec, it.unit) : t.kept[it.unit]);
        for_chunks([&](std::int64_t r0, std::int64_t n_rows) {
          tmpl.op().backward_kept(t.be, block_chunk(it, r0, n_rows, router_stats), w, View<const Res>(rows_of(x, r0, n_rows)),
                                  View<const Res>(rows_of(t.dbuf[dy].span(), r0, n_rows)),
                                  rows_of(t.dbuf[1 - dy].span(), r0, n_rows), g, kept, t.arena);
        });
        if (spilled) t.spill.backward_done(exec, it.unit);
      }
    } else {
      for_chunks([&](std::int64_t r0, std::int64_t n_rows) {
        tmpl.op().backward(t.be, block_chunk(it, r0, n_rows, router_stats), w, View<const Res>(rows_of(x, r0, n_rows)),
                           View<const Res>(rows_of(t.dbuf[dy].span(), r0, n_rows)), rows_of(t.dbuf[1 - dy].span(), r0, n_rows),
                           g, t.arena);
      });
    }
    dy = 1 - dy;
  }

  // A device unit's update, with this step's scalars or the AdamW pass's.
  void device_update(const TrainItem& it, const StageSlots& s) {
    Ctx& t = *this->ctx;
    const bool pass = t.opt.resident_gradients();
    const auto& unit = t.store.unit(it.unit);
    t.devices.step(t.be, unit, t.owned_gradient(it.unit, s.out), t.device_weights(it.unit), t.opt.adamw,
                   pass ? t.pass.step : t.state.adam_step, pass ? t.pass.lr : t.state.lr,
                   pass ? t.pass.clip_coef : t.state.clip_coef);
    if (t.opt.sharded()) {  // (each process stepped its part: the others' parts of its weights and masters)
      void* stream = nullptr;
      if constexpr (B::kDevice) stream = exec.stream();
      if (!t.device_weights(it.unit).empty()) t.gather_weights(it.unit, 0, stream);
      t.opt.comm->all_gather_backend_memory(t.devices.master_data(it.unit).first(static_cast<std::size_t>(unit.numel())),
                                            t.store.shard_bounds(unit), stream);
    }
  }

  // The unit's share of the global norm, summed on the device once its gradient is complete (the
  // embedding's only after its backward: a tied head adds to it first). Several processes: the
  // complete gradient first summed over them there (each its part's sum where the optimizer is
  // sharded), and only this process's part counted.
  void complete_gradient(const TrainItem& it, const StageSlots& s) {
    Ctx& t = *this->ctx;
    std::span<Acc> g = t.grad_target(it.unit, s.out);
    if constexpr (std::is_same_v<Acc, float>)
      if (t.reduces_on_device) {
        void* stream = nullptr;
        if constexpr (B::kDevice) stream = exec.stream();
        const auto& unit = t.store.unit(it.unit);
        if (t.opt.sharded()) {
          t.opt.comm->reduce_scatter_backend_memory(g.data(), t.store.shard_bounds(unit), stream);
          const auto [lo, hi] = unit.owned();
          g = g.subspan(static_cast<std::size_t>(lo), static_cast<std::size_t>(hi - lo));
          if (t.keeps_part(it.unit)) {  // (its part alone waits: the whole buffer free for the next block)
            const std::span<Acc> part = t.grad_acc(it.unit, s.out);
            const Shape shape{static_cast<std::int64_t>(g.size())};
            t.be.copy(View<const Acc>(std::span<const Acc>(g), shape), View<Acc>(part, shape));
            g = part;
          }
        } else {
          t.opt.comm->sum_backend_memory(g.data(), g.size(), stream);
        }
      }
    const auto sum = t.sumsq_dev.span().subspan(it.unit, 1);
    t.be.sum_squares(View<const Acc>(std::span<const Acc>(g), Shape{static_cast<std::int64_t>(g.size())}), View<double>(sum, Shape{1}));
    t.be.download(exec, std::span<const double>(sum), t.sumsq_host.subspan(it.unit, 1));
  }
};

}  // namespace megatrain::stages
