// The prefetch stage: a unit's weights into a slot of the device's ring (H2D, on the upload
// stream), ahead of the items that read them.
//
// A host unit's bf16 copy crosses (or, without a copy in host memory, its fp32 masters, rounded
// on the GPU); its norm gains at full precision once per step; the embedding's lookup reads the
// batch's distinct rows of its fp32 table (train/touched_rows.hpp), gathered here. Device units'
// weights stay on the device: a device block's items take a slot here, which the compute stage
// fills from its masters.
#pragma once

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <cstddef>
#include <span>
#include <type_traits>

#include "megatrain/core/nvtx.hpp"
#include "megatrain/pipeline/stream_pipeline.hpp"
#include "megatrain/train/stages/stage_base.hpp"

namespace megatrain::stages {

template <class Ctx>
struct Prefetch : StageBase<Ctx> {
  using Exec = typename Ctx::Exec;
  using W = typename Ctx::W;
  using Kind = TrainItem::Kind;
  Exec exec;
  Timings<Exec> timings{};

  Exec& executor() { return exec; }
  std::size_t ring_slots() const { return this->ctx->opt.weight_slots; }
  UnitAccess unit_access() const { return UnitAccess::reads; }
  bool applies(const TrainItem& it) const {
    // The embedding's dedicated slot still holds this step's weights when its backward comes;
    // device units' weights stay on the device. Every host unit's forward passes here, even
    // where it uploads nothing (an untied embedding): rule 4 then holds the unit's forward
    // until its update, i.e. until its waiting gradient has been downloaded, which is what lets
    // kept activations lie over the gradients of the units below them (lay_out_pool). A device
    // block's items that read its weights take a slot here, which the compute stage fills.
    if (this->ctx->devices.holds(it.unit)) return this->ctx->makes_device_weights(it);
    return it.kind == Kind::forward || it.kind == Kind::head || it.kind == Kind::head_eval || it.kind == Kind::refill ||
           (it.kind == Kind::backward && it.unit != 0);
  }
  void run(const TrainItem& it, const StageSlots& s) {
    MT_NVTX_RANGE("stage:prefetch");
    this->jitter(it);
    Ctx& t = *this->ctx;
    if (t.devices.holds(it.unit)) return;  // (a device block's slot: filled by the compute stage)
    const auto& unit = t.store.unit(it.unit);
    Timed<Exec> timed(exec, t.opt.profile ? &timings : nullptr);
    if (it.unit == 0) {
      if (it.kind == Kind::forward && it.micro == 0) upload_embedding_rows(t, unit);
      if (!t.uploads_weights(it)) return;
    }
    if constexpr (std::is_same_v<W, float>) {
      timings.bytes += static_cast<std::size_t>(unit.numel()) * sizeof(W);
      t.be.upload(exec, std::span<const float>(unit.master()), t.weight_slot(it.unit, s.out));
    } else {
      // (weights in parts: this process's part alone; the compute stage gathers the rest)
      const auto [lo, hi] = t.weights_in_parts ? unit.owned() : std::pair<std::int64_t, std::int64_t>{0, unit.numel()};
      const auto at = static_cast<std::size_t>(lo), n = static_cast<std::size_t>(hi - lo);
      if (t.store.has_bf16_copy()) {
        timings.bytes += n * sizeof(W);
        t.be.upload(exec, std::span<const bf16>(unit.compute()).subspan(at, n), t.weight_slot(it.unit, s.out).subspan(at, n));
      } else {  // (no bf16 copy in host memory: the masters, rounded on the GPU)
        timings.bytes += n * sizeof(float);
        t.upload_rounded(exec, std::span<const float>(unit.master()).subspan(at, n), t.weight_slot(it.unit, s.out).subspan(at, n));
      }
    }
    // The unit's full-precision parameters (norm gains) from its fp32 masters: once per step,
    // with the first micro-batch's forward (the rest of the step reads the same values; the
    // unit's last update came before, rule 4).
    if constexpr (Ctx::kSplitGains)
      if (it.kind != Kind::backward && it.kind != Kind::refill && it.micro == 0) {
        const auto& full = t.full_layout(it.unit);
        for (const auto& e : full.entries()) {
          const auto& p = unit.param(e.spec.name);
          const auto n = static_cast<std::size_t>(e.numel());
          t.be.upload(exec, std::span<const float>(unit.master()).subspan(static_cast<std::size_t>(p.offset), n),
                      t.gains[it.unit].span().subspan(static_cast<std::size_t>(e.offset), n));
        }
      }
  }

 private:
  // The embedding's lookup reads fp32 rows: the batch's distinct tokens' rows of the master
  // table, gathered once per step (or evaluation part).
  template <class Unit>
  void upload_embedding_rows(Ctx& t, const Unit& unit) {
    const auto d = static_cast<std::size_t>(t.hidden());
    const auto rows = t.touched.rows();
    const std::span<const float> master = unit.master();
    tbb::parallel_for(tbb::blocked_range<std::size_t>(0, rows.size(), 256), [&](const tbb::blocked_range<std::size_t>& r) {
      for (std::size_t i = r.begin(); i != r.end(); ++i)
        std::copy_n(master.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(rows[i]) * d), d,
                    t.embed_rows_host.begin() + static_cast<std::ptrdiff_t>(i * d));
    });
    t.be.upload(exec, std::span<const float>(t.embed_rows_host).first(rows.size() * d), t.embed_rows.span().first(rows.size() * d));
    timings.bytes += rows.size() * d * sizeof(float);
  }
};

}  // namespace megatrain::stages
