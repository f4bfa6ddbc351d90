// The optimizer stage: AdamW on the host's cores (a task arena of its own), on each landed piece
// of a streamed gradient as it lands, or in the AdamW pass once the global norm is known
// (resident gradients: exact clipping, micro-batches). With gradients waiting in host memory it
// also adds each later micro-batch's staged gradient into the unit's resident slab. Device units
// are stepped by the compute stage. Before it changes a unit, the update gate is asked (the
// Checkpointer writes the unit to disk first).
#pragma once

#include <cstddef>
#include <span>

#include "megatrain/core/nvtx.hpp"
#include "megatrain/optim/adamw.hpp"
#include "megatrain/pipeline/executor.hpp"
#include "megatrain/pipeline/stream_pipeline.hpp"
#include "megatrain/train/stages/stage_base.hpp"

namespace megatrain::stages {

template <class Ctx>
struct Optimize : StageBase<Ctx> {
  using Kind = TrainItem::Kind;
  HostExecutor exec;
  Timings<HostExecutor> timings{};

  HostExecutor& executor() { return exec; }
  std::size_t ring_slots() const { return 0; }
  UnitAccess unit_access() const { return UnitAccess::writes; }
  bool applies(const TrainItem& it) const {
    const Ctx& t = *this->ctx;
    if (!t.grads_on_host()) return it.carries_gradient();
    return it.kind == Kind::optimize ? !t.devices.holds(it.unit) : it.carries_gradient() && it.micro > 0;
  }
  void run(const TrainItem& it, const StageSlots& s) {
    MT_NVTX_RANGE("stage:optimizer");
    this->jitter(it);
    Ctx& t = *this->ctx;
    const auto& unit = t.store.unit(it.unit);
    Timed<HostExecutor> timed(exec, t.opt.profile ? &timings : nullptr);
    if (it.kind != Kind::optimize && t.grads_on_host()) {  // gradient accumulation on the host
      const auto n = static_cast<std::size_t>(unit.numel());
      exec.run([&] { accumulate_gradient<float>(unit.grad(), std::span<const float>(t.staging[s.in].first(n))); });
      return;
    }
    if (const auto gate = t.update_gate.load()) (*gate)(it.unit);
    const auto grad = t.landed_gradient(it, s);
    exec.run([&] {
      if (it.kind == Kind::optimize) {  // the AdamW pass, possibly while the next step begins: its own scalars
        if (t.grads_on_host()) {  // (a sharded store: its part of the unit)
          const auto [lo, hi] = unit.owned();
          const AdamWSegment<float> part{static_cast<std::size_t>(lo), static_cast<std::size_t>(hi - lo), grad.data() + lo};
          adamw_segments<float>(unit, std::span(&part, 1), t.opt.adamw, t.pass.step, t.pass.lr, t.pass.clip_coef);
        } else {
          adamw_segments<float>(unit, t.segments(it, grad), t.opt.adamw, t.pass.step, t.pass.lr, t.pass.clip_coef);
        }
        return;
      }
      // One pass over the landed gradient: AdamW sums its squares (for the norm) as it goes.
      // Elements outside the segments (touched rows inside an embed_rest piece) read zero.
      t.state.sumsq += adamw_segments<float>(unit, t.segments(it, grad), t.opt.adamw, t.state.adam_step, t.state.lr,
                                             t.state.clip_coef);
    });
  }
};

}  // namespace megatrain::stages
