// The step planner: for a model, a step's shape and the machine's memory and rates, what the
// trainer will allocate and decide (memory_plan.hpp), how long a step should take
// (cost_model.hpp), whether it fits, and, when it does not, the largest configuration that does.
//
// The trainer allocates by the same plan (Trainer::memory_plan()), and megatrain-train and
// megatrain-plan print it before anything is allocated (docs/planner.md). A refusal names what
// does not fit and what would: the longest sequence at this batch, and the most sequences per
// micro-batch at this sequence length.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "megatrain/core/checked.hpp"
#include "megatrain/core/dtype.hpp"
#include "megatrain/core/host_memory.hpp"
#include "megatrain/layers/decoder_model.hpp"
#include "megatrain/plan/cost_model.hpp"
#include "megatrain/plan/memory_plan.hpp"
#include "megatrain/step/trainer_options.hpp"

namespace megatrain::plan {

/// The element types of the CUDA backend (bf16 weights and activations, fp32 accumulators and
/// residual stream), for planning a GPU run where none is present.
struct CudaTypes {
  using Act = bf16;
  using Weight = bf16;
  using Acc = float;
  using Res = float;
  static constexpr bool kDevice = true;
};

/// The memory a backend brings to a plan: its cap (what it can still hand out, plus what it
/// holds), what it holds, and its prepare()'s workspaces. `user_stages`: a trainer with user
/// stages, which read gradients landed on the host, places no device units by itself.
template <class B>
DeviceBudget device_budget(B& be, bool user_stages = false) {
  DeviceBudget d;
  if constexpr (requires { be.allocated_bytes(); }) d.allocated = be.allocated_bytes();
  if constexpr (requires { be.memory_available(); }) {
    if (const std::optional<std::size_t> avail = be.memory_available()) d.cap = d.allocated + *avail;
  }
  if constexpr (requires(const WorkspacePlan& w) { be.prepare_bytes(w); })
    d.prepare_bytes = [&be](const WorkspacePlan& w) { return be.prepare_bytes(w); };
  d.host_memory = !B::kDevice;
  d.auto_device_units = B::kDevice && d.cap.has_value() && !user_stages;
  return d;
}

/// What the CUDA backend's prepare() allocates, estimated without a GPU (for planning elsewhere):
/// the logits of a block of 2,048 tokens (fp32 and bf16), and the attention's workspace: cuDNN's
/// deterministic backward (a dP buffer of rows x heads x seq^2 bf16) while it stays within
/// `deterministic_limit`, else its dQ accumulated in fp32 (2 x rows x seq x q_dim x 4 bytes: 8.77
/// GiB in all for the 7B shape at 262,144 tokens on cuDNN 9.19, as CudaBackend::prepare_bytes
/// gave); at least 64 MiB for the rest. A plan made on the GPU machine uses the backend's figure.
std::size_t cuda_prepare_estimate(const WorkspacePlan& w, std::size_t deterministic_limit = std::size_t{8} << 30);

/// The largest configurations near a given one that fit: the longest sequence at its batch (the
/// same sequences per micro-batch), and the most sequences per micro-batch at its sequence length
/// (a larger batch then runs as gradient accumulation).
struct Suggestions {
  std::optional<std::int64_t> seq;          ///< the longest sequence that fits (none: not even the shortest tried)
  std::optional<std::int64_t> micro_rows;   ///< the most sequences per micro-batch at this sequence length
  bool stale_fits = false;                  ///< exact clipping refused, stale clipping (no waiting gradients) fits
  bool host_gradients_fit = false;          ///< gradients waiting on the GPU refused, in host memory they fit
  bool store_alone_too_large = false;       ///< the model's state alone exceeds host memory: no shape helps
  /// Refused with a bf16 copy of the weights in host memory, without one it fits
  /// (TrainerOptions::host_bf16_copy false); or it fits so with stale clipping.
  bool no_copy_fits = false, stale_no_copy_fits = false;
  std::size_t store_bytes = 0, host_budget = 0;
  std::string store_what;  ///< what the store holds, in words
};

namespace detail {
/// The largest v in [lo, hi] (multiples of `step` from lo) for which fits(v), assuming fits is
/// monotone (true up to some v, false after); nullopt when not even lo fits.
std::optional<std::int64_t> largest(std::int64_t lo, std::int64_t hi, std::int64_t step,
                                    const std::function<bool(std::int64_t)>& fits);
/// The largest multiple of `step` (or `from` itself) for which fits(v), searching up from `from`
/// (doubling, up to `ceiling`) when it fits and down from it when it does not.
std::optional<std::int64_t> largest_near(std::int64_t from, std::int64_t step, std::int64_t ceiling,
                                         const std::function<bool(std::int64_t)>& fits);
/// Granularity of sequence lengths searched: whole thousands of tokens (1,024) for long ones.
std::int64_t seq_step(std::int64_t seq);
}  // namespace detail

/// What fits near `options` (each probe is a memory plan): see Suggestions.
template <class B, class Block>
Suggestions suggest(const DecoderModel<Block>& model, const TrainerOptions& options, const DeviceBudget& device,
                    const HostBudget& host, const std::optional<StoreFootprint>& store = std::nullopt) {
  const TrainerOptions opt = options.resolved();
  Suggestions s;
  const StoreFootprint fp =
      store ? *store
            : HostParamStore<float>::footprint(model.units(), store_options(opt, {}, std::is_same_v<typename B::Weight, bf16>));
  s.store_bytes = fp.total_bytes();
  s.host_budget = host.bytes;
  s.store_what = fmt::format("fp32 master weights, AdamW m and v{}{}", fp.compute_bytes > 0 ? ", the bf16 copy" : "",
                             fp.resident_grad_bytes > 0 ? ", the gradients waiting for the norm" : "");
  // (`same_store`: the step keeps this store; a probe that moves the gradients needs another one)
  const auto fits = [&](const TrainerOptions& o, bool same_store = true) {
    try {
      TrainerOptions q = o;  // (kept or spilled activations chosen by the plan: it fits if it fits with none)
      if (q.kept_blocks == TrainerOptions::kAutoKeptBlocks) q.kept_blocks = 0;
      if (q.spilled_blocks == TrainerOptions::kAutoSpilledBlocks) q.spilled_blocks = 0;
      return plan_memory<B>(model, q, device, host, same_store ? std::optional<StoreFootprint>(fp) : std::nullopt).fits;
    } catch (const Error&) {
      return false;
    }
  };
  // Without the bf16 copy in host memory (not for a store sharded over processes, nor where the
  // weights are fp32 and the copy is not what streams)
  if (opt.host_bf16_copy && !opt.sharded() && std::is_same_v<typename B::Weight, bf16>) {
    TrainerOptions o = opt;
    o.host_bf16_copy = false;
    const bool refused = s.store_bytes > host.bytes || !fits(opt);
    s.no_copy_fits = refused && fits(o, false);
    if (refused && !s.no_copy_fits && opt.resident_gradients() && opt.micro_batches == 1 && opt.clip_norm > 0 &&
        opt.clip_mode == ClipMode::exact) {
      o.clip_mode = ClipMode::stale;
      s.stale_no_copy_fits = fits(o, false);
    }
  }
  if (s.store_bytes > host.bytes) {
    s.store_alone_too_large = true;
    return s;
  }
  // The same step with its gradients elsewhere: no waiting at all (stale clipping, a different
  // update), or waiting in host memory.
  if (opt.resident_gradients() && opt.micro_batches == 1 && opt.clip_norm > 0 && opt.clip_mode == ClipMode::exact) {
    TrainerOptions o = opt;
    o.clip_mode = ClipMode::stale;
    s.stale_fits = !fits(opt) && fits(o, false);
    if (s.stale_fits) s.stale_no_copy_fits = false;
  }
  if (opt.resident_gradients() && opt.gradient_home == GradientHome::device) {
    TrainerOptions o = opt;
    o.gradient_home = GradientHome::host;
    s.host_gradients_fit = !fits(opt) && fits(o, false);
  }
  constexpr std::int64_t kCeiling = std::int64_t{1} << 26;  // tokens: far beyond any GPU of today
  s.seq = detail::largest_near(opt.seq_len, detail::seq_step(opt.seq_len), std::max<std::int64_t>(opt.seq_len, kCeiling / opt.micro_rows()),
                               [&](std::int64_t seq) {
                                 TrainerOptions o = opt;
                                 o.seq_len = seq;
                                 return fits(o);
                               });
  s.micro_rows = detail::largest_near(opt.micro_rows(), 1, std::max<std::int64_t>(opt.micro_rows(), kCeiling / opt.seq_len),
                                      [&](std::int64_t m) {
                                        TrainerOptions o = opt;
                                        o.batch_rows = m;
                                        o.micro_batches = 1;
                                        o.max_micro_rows = 0;
                                        return fits(o);
                                      });
  return s;
}

/// The least predicted gain for which choose_gradient_home puts the waiting gradients in host
/// memory where the GPU has room for them too: 1% of the step (4 bytes a parameter of host memory
/// for it).
inline constexpr double kHostGradientsGain = 0.01;

/// What choose_gradient_home decided, and which homes fit (several ranks agree on one that fits
/// every rank's plan: GradientHomeChoice::agree).
struct GradientHomeChoice {
  GradientHome home = GradientHome::device;
  bool device_fits = false, host_fits = false;
  /// The home of several ranks' choices: the GPU where every rank chose it, else host memory
  /// where it fits every rank, else the GPU where it fits every rank, else the GPU (whose
  /// refusal, by the ranks it does not fit, says what would).
  static GradientHome agree(std::span<const GradientHomeChoice> ranks);
};

/// Where gradients wait for the global norm, decided (megatrain-train and megatrain-plan
/// `--gradients auto`, the default): in GPU memory where only that plan fits, in host memory
/// where only that one fits (the 72B shape's 271 GiB of waiting gradients on a 1.5 TB host), and
/// where both fit, in GPU memory unless host memory is predicted at least kHostGradientsGain
/// faster (the GPU memory they leave goes to checkpoints, kept activations or device units);
/// where neither fits, GPU memory, whose refusal says what would. On a backend whose memory is
/// host memory, its own where that fits. `prefer`: a home kept wherever it fits (a resumed run's,
/// whose micro-batches then add up in the same order). Host memory does not fit several
/// processes given device units (their gradients are summed in GPU memory). Without waiting
/// gradients (stale clipping or none, one micro-batch) `options.gradient_home`, which then means
/// nothing. Decide before building the store: a store for host memory holds the waiting
/// gradients (Trainer::store_options).
template <class B, class Block>
GradientHomeChoice choose_gradient_home(const DecoderModel<Block>& model, const TrainerOptions& options,
                                        const DeviceBudget& device, const HostBudget& host, const MachineFigures& machine = {},
                                        std::optional<GradientHome> prefer = std::nullopt) {
  GradientHomeChoice c{options.gradient_home};
  if (!options.resolved().resident_gradients()) {
    c.device_fits = c.host_fits = true;  // (nothing waits: either is the same)
    return c;
  }
  const auto step_s = [&](GradientHome home) -> std::optional<double> {  // (nullopt: does not fit)
    TrainerOptions o = options;
    o.gradient_home = home;
    if (home == GradientHome::host && o.distributed() && o.device_units > 0) return std::nullopt;
    try {
      const MemoryPlan p = plan_memory<B>(model, o, device, host, std::nullopt, machine);
      if (!p.fits) return std::nullopt;
      TrainerOptions r = o.resolved();
      r.device_units = static_cast<std::int64_t>(p.buffers.device_units);
      r.kept_blocks = static_cast<std::int64_t>(p.buffers.kept_blocks);
      r.spilled_blocks = static_cast<std::int64_t>(p.buffers.spilled_blocks);
      return predict_step(model.config(), r, p, machine).step_s;
    } catch (const Error&) {
      return std::nullopt;
    }
  };
  const auto on_device = step_s(GradientHome::device), in_host = step_s(GradientHome::host);
  c.device_fits = on_device.has_value();
  c.host_fits = in_host.has_value();
  if (prefer && (*prefer == GradientHome::device ? c.device_fits : c.host_fits)) c.home = *prefer;
  else if (on_device && (device.host_memory || !in_host)) c.home = GradientHome::device;
  else if (on_device && in_host) c.home = *in_host <= *on_device * (1 - kHostGradientsGain) ? GradientHome::host : GradientHome::device;
  else c.home = in_host ? GradientHome::host : GradientHome::device;
  return c;
}

/// Whether host memory keeps a bf16 copy of the weights (megatrain-train and megatrain-plan
/// `--host-bf16-copy auto`, the default; TrainerOptions::host_bf16_copy): kept wherever a plan
/// fits with it (it costs 2 bytes a parameter of host memory and halves the weights' PCIe bytes),
/// dropped where only a plan without it fits (GPT-OSS-120B's state on a 1.5 TB host); where
/// neither fits, kept (and the refusal says what would). A plan fits with the gradients waiting
/// where `options` says, or where `either_home` also in the other memory (`--gradients auto`,
/// decided after this). Always kept for a store sharded over several processes, which exchange
/// the copy, and where the weights the backend reads are fp32.
template <class B, class Block>
bool choose_bf16_copy(const DecoderModel<Block>& model, const TrainerOptions& options, const DeviceBudget& device,
                      const HostBudget& host, const MachineFigures& machine = {}, bool either_home = false) {
  if (options.sharded() || !std::is_same_v<typename B::Weight, bf16>) return true;
  const auto fits = [&](bool copy) {
    TrainerOptions o = options;
    o.host_bf16_copy = copy;
    const auto one = [&](GradientHome home) {
      o.gradient_home = home;
      try {
        return plan_memory<B>(model, o, device, host, std::nullopt, machine).fits;
      } catch (const Error&) {
        return false;
      }
    };
    if (one(options.gradient_home)) return true;
    return either_home && o.resolved().resident_gradients() &&
           one(options.gradient_home == GradientHome::device ? GradientHome::host : GradientHome::device);
  };
  return fits(true) || !fits(false);
}

/// Host memory a model's state needs at the least, from its config alone: the fp32 master
/// weights, AdamW's m and v and the bf16 copy, 14 bytes a parameter (HostParamStore's footprint
/// adds alignment, gradients and rings to it); of one process of a store sharded over N (`shard`,
/// ZeRO-1) 14 / N with its masters sharded where the host's processes share the bf16 copy or
/// each holds its part of it (StoreShard::weights_in_parts), 2 + 12 / N where each holds a whole
/// copy, else 6 + 8 / N. Without the optimizer state (StoreOptions::optimizer_state false: a
/// model read, never stepped), 8 bytes (8 / N) a parameter fewer.
double min_state_bytes_per_param(const StoreShard& shard = {}, bool bf16_copy = true, bool optimizer_state = true);
std::size_t min_state_bytes(const ModelConfig& cfg, const StoreShard& shard = {}, bool bf16_copy = true,
                            bool optimizer_state = true);

/// Refuses a model whose state alone cannot fit the host budget, from the config alone: called
/// before anything the config sizes is built (the model's units and blocks, the store), so that a
/// config of 10^9 layers is an error and not an attempt to allocate them. `source` names where the
/// config came from (its file, --preset NAME, ...); `shard`: this process's part of a sharded store;
/// `bf16_copy`: whether the state counts a bf16 copy of the weights (false: it may go without one);
/// `optimizer_state`: whether it counts AdamW's m and v.
void check_state_fits_host(const ModelConfig& cfg, const HostBudget& host, std::string_view source,
                           const StoreShard& shard = {}, bool bf16_copy = true, bool optimizer_state = true);

/// The refusal of a plan that does not fit, with what would (the same words from the trainer,
/// megatrain-train and megatrain-plan).
std::string refusal_message(const MemoryPlan& plan, const Suggestions& s);

/// A whole plan: the memory, the step time, and what fits when the configuration does not.
struct StepPlan {
  ModelConfig config;
  TrainerOptions options;  ///< resolved, with the placement the plan decided
  MemoryPlan memory;
  StepTime time;
  MachineFigures machine;
  std::optional<Suggestions> suggestions;  ///< when !memory.fits
  std::string refusal() const { return suggestions ? refusal_message(memory, *suggestions) : std::string(); }
};

/// Plans `options` for `model` (memory and time); a configuration that does not fit also gets
/// what would.
/// `store`: the footprint of the store the trainer will use (default: one built with
/// store_options(options)).
template <class B, class Block>
StepPlan plan_step(const DecoderModel<Block>& model, const TrainerOptions& options, const DeviceBudget& device,
                   const HostBudget& host, const MachineFigures& machine = {},
                   const std::optional<StoreFootprint>& store = std::nullopt) {
  StepPlan p;
  p.config = model.config();
  p.options = options.resolved();
  p.machine = machine;
  p.memory = plan_memory<B>(model, p.options, device, host, store, machine);
  p.options.device_units = static_cast<std::int64_t>(p.memory.buffers.device_units);
  p.options.kept_blocks = static_cast<std::int64_t>(p.memory.buffers.kept_blocks);
  p.options.spilled_blocks = static_cast<std::int64_t>(p.memory.buffers.spilled_blocks);
  p.time = predict_step(p.config, p.options, p.memory, machine);
  if (!p.memory.fits) p.suggestions = suggest<B>(model, p.options, device, host, store);
  return p;
}

/// The plan in two lines (what megatrain-train prints at start).
std::string format_summary(const StepPlan& p);

/// The plan as a short table (markdown): memory by buffer, the decisions, the step's terms.
std::string format_plan(const StepPlan& p);

}  // namespace megatrain::plan
