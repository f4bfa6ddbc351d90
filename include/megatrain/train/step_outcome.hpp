// A step's outcome, once its items have run: the loss and the auxiliary loss (summed over the
// processes of a data-parallel run, with the gradients that were not summed during the
// backward), the global gradient norm, and what a non-finite loss or gradient does (NonFinite:
// stop, naming the step, the unit and any non-finite weight, or skip). It also keeps what the
// steps leave for the next: the steps done and skipped, the last norm (stale clipping's), and
// why the trainer stopped. The clipping coefficient itself is optim/adamw.hpp's.
#pragma once

#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "megatrain/core/error.hpp"
#include "megatrain/core/finite.hpp"
#include "megatrain/core/log.hpp"
#include "megatrain/optim/adamw.hpp"
#include "megatrain/step/trainer_options.hpp"
#include "megatrain/store/host_param_store.hpp"

namespace megatrain {

/// Which weights hold a NaN or an infinity: the first such tensor in unit order as "'name' holds N
/// non-finite values (the first, element i, is v)", and how many more; empty where every master
/// weight this process holds is finite (sharded masters: every process decides alike, the
/// others' parts counting too).
inline std::string nonfinite_weights(const HostParamStore<float>& store, dist::HostComm* comm) {
  struct Found {
    std::size_t unit = 0, param = 0;
    FiniteScan scan;
  };
  struct Range {  // (sharded masters: the parts this process holds, each scanned from its start in the tensor)
    std::int64_t begin, end;
  };
  std::vector<Found> all;
  std::vector<Range> where;
  for (std::size_t u = 0; u < store.num_units(); ++u) {
    const auto& unit = store.unit(u);
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
    const auto& param = store.unit(f.unit).params()[f.param];
    f.scan = scan_finite(store.unit(f.unit).master().subspan(static_cast<std::size_t>(where[i].begin),
                                                             static_cast<std::size_t>(where[i].end - where[i].begin)));
    f.scan.first += static_cast<std::size_t>(where[i].begin - param.offset);
  });
  std::erase_if(all, [](const Found& f) { return f.scan.ok(); });
  if (store.masters_sharded()) {  // (every process decides alike: what the others hold counts too)
    std::int64_t found[1] = {static_cast<std::int64_t>(all.size())};
    comm->all_reduce_sum(found);
    if (all.empty() && found[0] > 0) return "weights of another process's part of the model (ZeRO-1; that process's message names them)";
  }
  if (all.empty()) return {};
  const Found& f = all.front();
  return fmt::format("'{}' holds {} non-finite value(s) (the first, element {}, is {}){}",
                     store.unit(f.unit).params()[f.param].spec.name, f.scan.count, f.scan.first, f.scan.value,
                     all.size() > 1 ? fmt::format(", and {} more tensor(s) do", all.size() - 1) : std::string());
}

class StepOutcome {
 public:
  /// The step's loss (its objective's value) and auxiliary loss, every process's share summed (the global batch's loss,
  /// the auxiliary loss the mean over every process's micro-batches), with what the backward did
  /// not sum yet: the routing counts and the gradients that waited in host memory.
  template <class Ctx>
  std::pair<double, double> losses(Ctx& t) {
    // (the objective's value: cross-entropy's as the mean of the losses, another's from the rows)
    double loss = t.state.weighted ? t.batch.objective_value(*t.state.objective, t.opt, t.state.batch_labelled)
                                   : t.batch.sum_loss() * t.state.loss_scale;
    double aux = t.experts.aux_loss(t.opt.micro_batches, [&](std::int64_t m) { return t.batch.counted_tokens(t.opt, m); });
    if (!t.opt.distributed()) return {loss, aux};
    double l[2] = {loss, aux};
    t.opt.comm->all_reduce_sum(l);
    if (!t.experts.counts().empty()) t.opt.comm->all_reduce_sum(t.experts.counts());
    if (!t.sums_in_offload && !t.reduces_on_device)  // (else summed in the backward, as each was completed)
      for (std::size_t u = 0; u < t.model.num_units(); ++u) {
        if (t.opt.sharded())  // (each process its part's sum: it steps that part)
          t.opt.comm->reduce_scatter_sum(t.store.unit(u).grad(), t.store.shard_bounds(t.store.unit(u)));
        else
          t.opt.comm->all_reduce_sum(t.store.unit(u).grad());
      }
    return {l[0], l[1] / static_cast<double>(t.opt.comm->world())};
  }

  /// The global norm of a step whose gradients waited for it (resident), in unit order whatever
  /// the placement, and the non-finite unit nearest the loss (the backward's first; the units'
  /// count where none is).
  template <class Ctx>
  std::pair<double, std::size_t> resident_norm(Ctx& t) const {
    std::vector<double> unit_sumsq(t.model.num_units());
    for (std::size_t u = 0; u < t.model.num_units(); ++u) {
      const auto& unit = t.store.unit(u);
      const auto [lo, hi] = unit.owned();  // (sharded: this process's part, the parts' sums summed below)
      unit_sumsq[u] = t.summed_on_device(u) && (!t.opt.distributed() || t.reduces_on_device)
                          ? t.sumsq_host[u]
                          : grad_sum_squares<float>(std::span<const float>(unit.grad()).subspan(
                                static_cast<std::size_t>(lo), static_cast<std::size_t>(hi - lo)));
    }
    if (t.opt.sharded()) t.opt.comm->all_reduce_sum(unit_sumsq);
    double sumsq = 0;
    std::size_t bad = t.model.num_units();
    for (std::size_t u = 0; u < t.model.num_units(); ++u) {
      if (!std::isfinite(unit_sumsq[u])) bad = u;
      sumsq += unit_sumsq[u];
    }
    return {std::sqrt(sumsq), bad};
  }
  /// The global norm of a step whose units were updated as their gradients landed: the host
  /// units' sums came with their updates, the device units' from the device.
  template <class Ctx>
  double streamed_norm(const Ctx& t) const {
    double sumsq = t.state.sumsq;
    for (std::size_t u = 0; u < t.devices.count(); ++u) sumsq += t.sumsq_host[u];
    return std::sqrt(sumsq);
  }

  /// A non-finite loss or gradient where the whole gradient is known before any update (exact
  /// clipping's order): nothing changes; the step is skipped (returns true: NonFinite::skip, the
  /// weights finite, within the limit) or the trainer stops (throws naming the step, the unit and
  /// any non-finite weight). `unit` names the first unit to go non-finite (or none), `weights`
  /// which weights are not finite (empty: all are; only looked at for a non-finite loss).
  bool nonfinite(const TrainerOptions& opt, std::int64_t step, double loss, double grad_norm, const std::string& unit,
                 const std::string& weights) {
    const std::string what = fmt::format(
        "step {}: the {} not finite (loss {}, gradient norm {}{}{})", step,
        std::isfinite(loss) ? "gradient is" : std::isfinite(grad_norm) ? "loss is" : "loss and the gradient are", loss,
        grad_norm, unit.empty() ? std::string() : fmt::format("; unit '{}' is the first to go non-finite in the backward", unit),
        weights.empty() ? std::string() : "; the weights are not finite: " + weights);
    ++skipped_in_a_row;
    // (skipping cannot help where the weights themselves are not finite)
    if (opt.on_nonfinite == NonFinite::skip && weights.empty() && skipped_in_a_row <= opt.max_nonfinite_skips) {
      log_warning("{}: the step is skipped (the model and the optimizer state are unchanged; {} skipped in a row, the run "
                  "stops after {})", what, skipped_in_a_row, opt.max_nonfinite_skips);
      ++skipped;
      return true;
    }
    failed = fmt::format("{}{}; the model and the optimizer state were not updated: they are those of step {}. Look for a NaN "
                         "or an infinity in the data or the weights, or lower the learning rate",
                         what,
                         opt.on_nonfinite == NonFinite::skip && weights.empty()
                             ? fmt::format(" ({} non-finite steps in a row, more than max_nonfinite_skips {})", skipped_in_a_row,
                                           opt.max_nonfinite_skips)
                             : std::string(),
                         steps);
    --skipped_in_a_row;  // (this step was not taken: the count stays that of the state kept)
    failed_kept_state = true;
    MT_FAIL("{}; this trainer takes no further step", failed);
  }
  /// After a step whose units were updated during the backward: a non-finite loss or norm stops
  /// the trainer (the model was updated with it); else the norm is the next stale clip's.
  void after_update(std::int64_t step, double loss, double grad_norm, bool skipped_step) {
    if (std::isfinite(grad_norm) && std::isfinite(loss)) {
      last_grad_norm = grad_norm;
      return;
    }
    if (skipped_step) return;
    failed = fmt::format("step {}: the {} not finite (loss {}, gradient norm {}) and the model was updated with it: without "
                         "clipping or with stale clipping each unit is updated during the backward, before the whole "
                         "gradient is known (exact clipping, the default, stops before any update)",
                         step, std::isfinite(loss) ? "gradient is" : "loss is", loss, grad_norm);
    MT_FAIL("{}; this trainer takes no further step", failed);
  }

  std::int64_t steps = 0;                // optimizer steps done
  std::optional<double> last_grad_norm;  // what ClipMode::stale clips the next step with
  std::int64_t skipped = 0;              // steps skipped as non-finite (NonFinite::skip), in all
  std::int64_t skipped_in_a_row = 0;     // ... and since the last step taken
  std::string failed;                    // why a step stopped (a non-finite step): no further step is taken
  bool failed_kept_state = false;        // the weights and AdamW states are those of the last good step
};

}  // namespace megatrain
