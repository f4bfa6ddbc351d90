// The offload stage: an item's gradient down to the host (D2H, on the download stream), into a
// landing slot of the store's ring (streamed gradients, and the AdamW pass's pieces of gradients
// that waited on the device), or, with gradients waiting in host memory (GradientHome::host), into
// the unit's resident slab (the first micro-batch) or a staging slot (the later ones, which the
// optimizer stage adds in).
#pragma once

#include <cstddef>
#include <span>
#include <type_traits>

#include "megatrain/core/nvtx.hpp"
#include "megatrain/pipeline/stream_pipeline.hpp"
#include "megatrain/train/stages/stage_base.hpp"

namespace megatrain::stages {

template <class Ctx>
struct Offload : StageBase<Ctx> {
  using B = typename Ctx::Backend;
  using Exec = typename Ctx::Exec;
  using Acc = typename Ctx::Acc;
  using Kind = TrainItem::Kind;
  Exec exec;
  Timings<Exec> timings{};

  Exec& executor() { return exec; }
  // The store's landing slots; with GradientHome::host, the two host staging buffers where
  // micro-batches after the first land (none without micro-batches: each unit lands in place).
  std::size_t ring_slots() const {
    const Ctx& t = *this->ctx;
    if (t.grads_on_host()) return t.opt.micro_batches > 1 ? t.staging.size() : 0;
    return t.store.grad_ring_slots();
  }
  UnitAccess unit_access() const { return UnitAccess::none; }
  // Every item that lands a gradient (an untied model's embed_rest pieces land none). With
  // micro-batches added up in host memory also the forwards, for nothing but their completion:
  // recorded on this stream, it covers every download before it, so the compute stage's next
  // head, reusing a forward's ring slot, waits for the previous micro-batch's last download
  // (a forward passed through would hand on only its own compute).
  bool applies(const TrainItem& it) const {
    const Ctx& t = *this->ctx;
    if (it.kind == Kind::forward) return t.grads_on_host() && t.opt.micro_batches > 1;
    return it.carries_gradient() && !(it.kind == Kind::embed_rest && !t.model.head().op().tied());
  }
  bool takes_slot(const TrainItem& it) const { return it.kind != Kind::forward; }  // (writes no staging slot)
  void run(const TrainItem& it, const StageSlots& s) {
    MT_NVTX_RANGE("stage:offload");
    if (it.kind == Kind::forward) return;
    this->jitter(it);
    Ctx& t = *this->ctx;
    if (!t.grads_on_host()) {  // a piece into a landing slot
      const auto p = t.piece(it, s.in);
      Timed<Exec> timed(exec, t.opt.profile ? &timings : nullptr);
      timings.bytes += p.device.size() * sizeof(Acc);
      t.be.download(exec, p.device, t.store.grad_slot(s.out).first(p.device.size()));
      return;
    }
    const auto& unit = t.store.unit(it.unit);
    const auto n = static_cast<std::size_t>(unit.numel());
    Timed<Exec> timed(exec, t.opt.profile ? &timings : nullptr);
    timings.bytes += n * sizeof(Acc);
    std::span<const Acc> src = t.grad_acc(it.unit, s.in);
    // Several processes: summed over them first, in the backend's memory (TrainerOptions::sum_during_backward).
    if constexpr (std::is_same_v<Acc, float>)
      if (t.sums_in_offload) {
        void* stream = nullptr;
        if constexpr (B::kDevice) stream = exec.stream();
        t.opt.comm->sum_backend_memory(const_cast<float*>(src.data()), src.size(), stream);
      }
    // The first micro-batch lands in place; later ones in a staging slot (see Optimize).
    t.be.download(exec, src, it.micro == 0 ? unit.grad() : t.staging[s.out].first(n));
  }
};

}  // namespace megatrain::stages
