// DeviceUnits<B>: the units whose AdamW state lives in backend memory.
//
// The store is the model's home, but a GPU often has room to spare once the streaming trainer
// has what it needs: there the first units in forward order (TrainerOptions::device_units) keep
// their fp32 master weights and moments, so that they are updated where their gradient already
// is (Backend::adamw): nothing of theirs crosses PCIe in a step, and the host's cores have fewer
// parameters to step. The update is the host optimizer's formula; on the CPU and CUDA backends it
// is bit for bit the same. The weights the ops read are the embedding's and the head's own slots
// (which the update writes); a block keeps none (12 bytes a parameter, not 14): the trainer makes
// them from its masters, in a slot of the weights' ring, for each item that reads them.
//
// Who holds the newer state is explicit: after load() the backend does, and the store's copies
// of these units are stale until save() writes them back (Trainer::finish_update does both).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "megatrain/core/error.hpp"
#include "megatrain/core/nvtx.hpp"
#include "megatrain/core/tensor.hpp"
#include "megatrain/optim/adamw.hpp"
#include "megatrain/store/host_param_store.hpp"

namespace megatrain {

template <class B>
class DeviceUnits {
  using W = typename B::Weight;
  using Acc = typename B::Acc;
  using Exec = typename B::Executor;
  template <class E>
  using Buf = typename B::template Buffer<E>;

 public:
  DeviceUnits() = default;
  /// Allocates backend memory for the state of store units [0, count) (contents undefined until load()).
  DeviceUnits(B& be, const HostParamStore<float>& store, std::size_t count) {
    MT_CHECK(count <= store.num_units(), "{} device units, but the store has {} units", count, store.num_units());
    for (std::size_t u = 0; u < count; ++u) {  // (a sharded store: the moments of this process's part only)
      const auto n = static_cast<std::size_t>(store.unit(u).numel());
      const auto [lo, hi] = store.unit(u).owned();
      const auto mine = static_cast<std::size_t>(hi - lo);
      units_.push_back({be.template alloc<float>(n), be.template alloc<float>(mine), be.template alloc<float>(mine)});
    }
  }

  std::size_t count() const { return units_.size(); }
  bool holds(std::size_t u) const { return u < units_.size(); }
  /// Unit u's fp32 master weights in backend memory (laid out like its slabs).
  std::span<const float> master(std::size_t u) const {
    MT_CHECK(u < units_.size(), "unit {} is not kept in backend memory ({} units are)", u, units_.size());
    return units_[u].master.span();
  }

  std::span<float> master_data(std::size_t u) { return at(u).master.span(); }

  /// One AdamW step of unit u (enqueued on the backend's compute stream): `g` is the part
  /// unit.owned() of its gradient in backend memory (all of it unless the store is sharded), laid
  /// out like that part of its slabs; `w` receives the weights the ops read (empty: none). Tensors
  /// whose spec says weight_decay = false get none, as on the host; the gaps are left alone. Only
  /// the elements of unit.owned() (a sharded store: this process's part; the caller then gathers
  /// the others' parts of the weights and masters).
  void step(B& be, const typename HostParamStore<float>::Unit& unit, std::span<const Acc> g, std::span<W> w,
            const AdamWConfig& cfg, std::int64_t step, double lr, double grad_scale) {
    MT_NVTX_RANGE("DeviceUnits::step");
    auto& d = at(unit.index());
    const auto with_wd = AdamWScalars<float>::make(cfg, step, lr, cfg.weight_decay, grad_scale);
    const auto no_wd = AdamWScalars<float>::make(cfg, step, lr, 0.0, grad_scale);
    const auto [lo, hi] = unit.owned();
    for (const auto& p : unit.params()) {
      const auto a = std::max(p.offset, lo), b = std::min(p.offset + p.numel(), hi);
      if (b <= a) continue;
      const auto o = static_cast<std::size_t>(a), n = static_cast<std::size_t>(b - a), om = static_cast<std::size_t>(a - lo);
      be.adamw(p.spec.weight_decay ? with_wd : no_wd, d.master.span().subspan(o, n), d.m.span().subspan(om, n),
               d.v.span().subspan(om, n), g.subspan(om, n), w.empty() ? w : w.subspan(o, n));
    }
  }

  /// Copies unit u's master weights and moments from the store into backend memory, and its
  /// weights into `w` (the bf16 compute copy, or the masters where the ops read fp32; empty:
  /// none). Enqueued on `e`; the caller synchronises.
  /// A sharded store: what this process holds of them (the moments of its part, the masters of its
  /// part and of the ranges kept whole; the rest of the device's copies is not read before the
  /// first step gathers it; a bf16 copy held in parts: the weights of its part, whose rest the
  /// caller gathers before they are read).
  void load(B& be, Exec& e, const typename HostParamStore<float>::Unit& unit, std::span<W> w) {
    auto& d = at(unit.index());
    held(unit, [&](std::int64_t a, std::int64_t b) { be.upload(e, in(unit.master(), a, b), part(d.master.span(), a, b)); },
         [&](std::int64_t a, std::int64_t b) {
           be.upload(e, in(unit.adam_m(), a, b), part(d.m.span(), 0, b - a));  // (the moments of [a, b) only)
           be.upload(e, in(unit.adam_v(), a, b), part(d.v.span(), 0, b - a));
         });
    if (w.empty()) return;
    if constexpr (std::is_same_v<W, bf16>) {  // (a copy held in parts: its part; the caller gathers the rest)
      const auto [a, b] = unit.held_weights();
      if (!unit.compute().empty()) {
        be.upload(e, in(unit.compute(), a, b), part(w, a, b));
      } else {  // (no bf16 copy in host memory: rounded from the masters just uploaded, as the copy would be)
        const auto n = b - a;
        e.synchronize();
        be.convert(View<const typename B::Res>(in(d.master.span(), a, b), Shape{n}), View<typename B::Act>(part(w, a, b), Shape{n}));
        be.synchronize();
      }
    } else
      be.upload(e, std::span<const float>(unit.master()), w);
  }

  /// Copies unit u's state from backend memory into the store (the bf16 copy too), and waits
  /// for the copies. `w`: the weights the update wrote; empty for a block, whose bf16 copy is
  /// made from its masters (whole in backend memory) in `scratch` (as many elements) on the
  /// backend's compute stream, which must be idle.
  void save(B& be, Exec& e, HostParamStore<float>& store, std::size_t u, std::span<const W> w, std::span<W> scratch) {
    auto& d = at(u);
    const auto& unit = store.unit(u);
    held(unit, [&](std::int64_t a, std::int64_t b) { be.download(e, in(d.master.span(), a, b), part(unit.master(), a, b)); },
         [&](std::int64_t a, std::int64_t b) {
           be.download(e, in(d.m.span(), 0, b - a), part(unit.adam_m(), a, b));
           be.download(e, in(d.v.span(), 0, b - a), part(unit.adam_v(), a, b));
         });
    if constexpr (std::is_same_v<W, bf16>) {
      const auto [a, b] = unit.held_weights();
      if (unit.compute().empty()) {
        // (no bf16 copy in host memory: nothing to write back; the prefetch rounds the masters)
      } else if (w.empty()) {
        MT_CHECK(scratch.size() >= static_cast<std::size_t>(b - a), "device unit {}: a scratch of {} elements for {}", u,
                 scratch.size(), b - a);
        const auto n = b - a;
        be.convert(View<const typename B::Res>(in(d.master.span(), a, b), Shape{n}), View<typename B::Act>(part(scratch, 0, n), Shape{n}));
        be.synchronize();
        be.download(e, in(scratch, 0, n), part(unit.compute(), a, b));
      } else {
        be.download(e, in(w, a, b), part(unit.compute(), a, b));
      }
    }
    e.synchronize();
    if constexpr (!std::is_same_v<W, bf16>) store.sync_compute(unit);
  }

 private:
  template <class E>
  static std::span<E> part(std::span<E> s, std::int64_t a, std::int64_t b) {
    return s.subspan(static_cast<std::size_t>(a), static_cast<std::size_t>(b - a));
  }
  template <class E>
  static std::span<const E> in(std::span<E> s, std::int64_t a, std::int64_t b) {
    return part(s, a, b);
  }
  // The ranges of `unit` this process's store holds: masters(a, b) for the masters, moments(a, b)
  // for m and v (all of the unit where the store is not sharded).
  template <class M, class V>
  static void held(const typename HostParamStore<float>::Unit& unit, M&& masters, V&& moments) {
    if (unit.has_moments()) moments(unit.owned().first, unit.owned().second);  // (none: a store that is never stepped)
    for (const auto& [a, b] : unit.held_masters()) masters(a, b);
  }
  struct Unit {
    Buf<float> master, m, v;
  };
  Unit& at(std::size_t u) {
    MT_CHECK(u < units_.size(), "unit {} is not kept in backend memory ({} units are)", u, units_.size());
    return units_[u];
  }
  std::vector<Unit> units_;
};

}  // namespace megatrain
