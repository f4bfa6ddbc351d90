// The cost model of one training step (a roofline): what the GPU computes, what crosses PCIe
// each way, what the CPU's AdamW steps, each over the machine's measured rate; the step can be no
// faster than the largest, and the pipeline overlaps the rest with it.
//
//   GPU      matrix products: 8 x the blocks' parameters x tokens (forward, the recompute of the
//            forward from the activation checkpoint, backward; 6 x for blocks that keep their
//            activations), 6 x the head's (no recompute; 8 x where the objective reads the
//            log-probabilities: TrainerOptions::log_prob_objective); a mixture of experts' active experts
//            (a token's k) 8 x at their own rate (grouped products; recomputed even in a block
//            that keeps its other activations);
//            causal attention: 2 T S q_dim per layer forward (a sliding layer's S its window's
//            span: attention_span) (twice: forward and recompute) and
//            2.5 times that backward; Gated DeltaNet's mixing likewise, its FLOPs counted as
//            mixing_span counts the chunked delta rule's, at its own rates; the element-wise passes (norms, SwiGLU, rotary, residual
//            adds, the loss over the logits) at device-memory bandwidth; AdamW of the device units
//            (30 bytes per parameter through device memory); activation checkpoints that live in
//            host memory cross PCIe on the compute stream, so they count here.
//   H2D      the host units' bf16 weights twice (forward, backward; the head once), the batch's
//            fp32 embedding rows, and a tied head's table.
//   D2H      the host units' fp32 gradients.
//   CPU      AdamW over the host units' parameters (at its rate under PCIe DMA, as it runs while
//            the copies do).
// With exact clipping (resident gradients) the D2H and CPU terms belong to the AdamW pass, which
// runs after the backward beside the next step's forward: what it takes beyond that forward is
// added; when gradients stream instead, the CPU steps each unit as its gradient lands during the
// backward, and what it takes beyond the backward is added (the next forward needs the lowest
// units first, the last to be stepped). The step is the largest term plus what cannot overlap:
// the first block's weights before the first forward can start, and, when gradients stream, the
// last unit's gradient and update.
#pragma once

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "megatrain/core/error.hpp"
#include "megatrain/model/config.hpp"
#include "megatrain/plan/memory_plan.hpp"
#include "megatrain/step/trainer_options.hpp"

namespace megatrain::plan {

/// A machine's measured rates (the cost model's ceilings). The defaults are the reference H200
/// host of docs/design.md; `megatrain-plan --machine FILE` reads others (the fields below, JSON).
struct MachineFigures {
  std::string name = "reference H200 host (docs/design.md)";
  double h2d_gbs = 55.3;      ///< pinned host-to-device copy, GB/s
  double d2h_gbs = 55.3;      ///< pinned device-to-host copy, GB/s
  double duplex_gbs = 97.0;   ///< both directions at once, GB/s in total
  double gemm_tflops = 700;   ///< bf16 matrix products at layer shapes
  /// A mixture of experts' grouped products (every expert's rows, the weight gradients per
  /// expert), in active FLOPs. Reference: the probe's on an H100 at the Qwen3-30B-A3B shape
  /// (2026-11-27, docs/planner.md; no H200 figure yet); a probe of an MoE model measures it.
  double moe_gemm_tflops = 255;
  double attention_fwd_tflops = 600;  ///< causal flash attention forward (cuDNN SDPA)
  double attention_bwd_tflops = 500;  ///< ... backward
  /// Gated DeltaNet's mixing (its convolution, norms and gates, the chunked delta rule, the gated
  /// norm), forward and backward, FLOPs counted as mixing_span counts the delta rule's (2.5 times
  /// the forward's backward). Measured by bench_delta_net on an H100 (2026-12-07, the chunks'
  /// gradients on the tensor cores) at Qwen3.5-27B's heads, 8 x 4,096 tokens: forward 24.1 ms,
  /// backward 92.2 ms (H100 and H200 have the same SMs; a probe of a hybrid model measures its own).
  double delta_rule_fwd_tflops = 11.8;
  double delta_rule_bwd_tflops = 7.8;
  double hbm_gbs = 4000;      ///< device memory, bytes read plus written per second (GB/s)
  double adamw_gparams = 4.4;       ///< CPU AdamW (fp32, with the bf16 copy), all cores, G parameters/s
  double adamw_dma_gparams = 4.2;   ///< the same while PCIe copies run both ways
  /// PCIe copies both ways, in total, while the CPU's AdamW runs (its pass beside a forward):
  /// the host's memory serves both. Reference: the lowest of four probes on H200 hosts
  /// (2026-11-29: 63, 64, 68, 72; planner.md).
  double pass_copies_gbs = 63.0;
};

/// The figures as JSON (machine_figures_from_json reads them back).
nlohmann::json to_json(const MachineFigures& m);

/// Reads figures written by to_json (fields left out keep the reference values); `what` names
/// the source in errors.
MachineFigures machine_figures_from_json(const nlohmann::json& j, std::string_view what);

/// Where `megatrain-plan --probe` keeps this machine's figures (plan/probe.hpp):
/// $MEGATRAIN_MACHINE, else $XDG_CACHE_HOME/megatrain/machine.json, else
/// ~/.cache/megatrain/machine.json (empty: no home).
std::filesystem::path default_machine_file();

/// The figures of the file at `path` (machine_figures_from_json), `what` naming it in errors.
MachineFigures read_machine_figures(const std::filesystem::path& path, std::string_view what);

/// This machine's figures as a probe kept them (default_machine_file()), else the reference
/// H200 host's: what the trainer's plan decides with, and what megatrain-plan and megatrain-train
/// predict with unless given --machine.
MachineFigures machine_figures();

/// Bytes the loss over the logits moves per logit: the fp32 logits read twice (the softmax's
/// maximum and sum, then the gradient) and the bf16 gradient written.
inline constexpr double kLossBytesPerLogit = 10;
/// ... and a forward of the loss alone (the log-probabilities): the fp32 logits read twice.
inline constexpr double kLossForwardBytesPerLogit = 8;

/// Bytes of element-wise passes per token of decoder block `layer` (forward, backward and what the
/// backward makes again): about 120 per hidden unit (the fp32 residual stream through two norms,
/// forward, again and backward) and 18 per intermediate unit (SwiGLU forward, then its backward,
/// which makes the product again in the same pass).
/// A mixture-of-experts layer's MLP instead: 18 per intermediate unit of each of a token's k
/// experts, and about 18 per hidden unit and expert (its rows gathered, its output weighted and
/// summed, forward and again, and their backward).
double block_elementwise_bytes(const ModelConfig& cfg, std::int64_t layer);

/// The experts' parameters one token's forward runs through, over every layer (0 for a dense model).
double active_expert_params(const ModelConfig& cfg);

/// One term of the step time.
struct TimeTerm {
  std::string what;    ///< "GPU", "PCIe H2D", ...
  double seconds = 0;
  std::string detail;  ///< how it was computed
};

/// The predicted step.
struct StepTime {
  std::vector<TimeTerm> terms;  ///< GPU, PCIe H2D, PCIe D2H, PCIe both ways, CPU AdamW
  std::string bottleneck;       ///< what the step waits on: the largest term's name, or the CPU's AdamW beyond it
  std::string bound_term;       ///< the largest term that overlaps the whole step (bound_s)
  double bound_s = 0;           ///< the largest term
  double exposed_s = 0;         ///< what cannot overlap it
  std::string exposed_detail;   ///< the largest part of it, where it matters
  double step_s = 0;            ///< bound + exposed
  /// The tokens per step from which the GPU is the bound (the placement kept): fewer leave it
  /// waiting on the copies or the CPU's AdamW. 0: unknown.
  double busy_tokens = 0;
  double tokens = 0;
  double model_flops = 0;       ///< 6 x matmul parameters x tokens + causal attention (fwd + bwd): the MFU convention
  double executed_flops = 0;    ///< what the GPU runs (recompute included)
  /// A forward of the step's batch with the head's log-probabilities, no gradient and no update
  /// (Trainer::score: a preference run's reference pass, one a batch of its pairs before step 1).
  double scoring_s = 0;
  double tokens_per_s() const { return step_s > 0 ? tokens / step_s : 0; }
};

/// The attention's span over the layers for sequences of `seq` tokens: the sum over the layers of
/// twice the keys a query sees on average, which is `seq` for causal attention over the whole
/// sequence (the FLOPs convention's S) and less for a sliding window of w < seq keys (Gemma 3's
/// and GPT-OSS's sliding layers): 2 (w (w + 1) / 2 + (seq - w) w) / seq.
double attention_span(const ModelConfig& cfg, double seq);
/// The same over the layers of one kind of mixing: softmax attention (full and sliding layers), or
/// Gated DeltaNet's linear attention (`linear`), whose span counts the delta rule's FLOPs
/// (mixing_span). The two add up to attention_span.
double attention_span(const ModelConfig& cfg, double seq, bool linear);

/// Model FLOPs of a step of `tokens` tokens in sequences of `seq` (the MFU convention: no
/// recompute; 6 x the matmul parameters per token, the embedding lookup none, a tied head's
/// product counted; a mixture of experts' active parameters only (a token's k experts); causal
/// attention 6 x seq x q_dim per token and layer, a sliding layer's over its window:
/// attention_span).
double model_flops(const ModelConfig& cfg, double tokens, double seq);

/// The step time of `plan` (its decisions: device units, spilled checkpoints) on `m`.
StepTime predict_step(const ModelConfig& cfg, const TrainerOptions& options, const MemoryPlan& plan,
                      const MachineFigures& machine);

/// The memory plan of `model` trained with `options` on a backend of element types B (anything
/// with B::Weight, B::Act, B::Acc and B::Res: a backend, or plan::CudaTypes when planning without
/// one), with `device` describing the backend's memory and `host` the host's (memory_plan.hpp).
/// `store`: the footprint of the store the trainer will use (default: one built with
/// store_options(options)). With TrainerOptions::checkpoint_every = 0 the plan keeps every
/// unit's output where that fits, else a checkpoint every k blocks for the smallest k that fits
/// (up to about the square root of the depth, beyond which more recompute buffers than
/// checkpoints are saved); a configuration that fits with none is refused with the last k's reason.
/// With TrainerOptions::kept_blocks = kAutoKeptBlocks (and a checkpoint at every block), the
/// number of blocks that keep their activations is the one whose step `machine` predicts the
/// fastest among those that fit (more only where it is faster by 0.1%: memory kept for nothing
/// is memory device units could have). With spilled_blocks = kAutoSpilledBlocks, then, the
/// number that spill theirs to host memory likewise, beside that many kept blocks or up to 3
/// fewer (the staging buffers take GPU memory that kept blocks had), where that is predicted at
/// least kSpillGain faster than spilling none; none on a backend whose memory is host memory.
/// The least predicted gain for which plan_memory spills activations on its own (spilled_blocks
/// auto): 3% of the step (the copies' contention with the GPU's work and the CPU's is priced
/// from measured rates, within about 6% of measured steps: docs/planner.md).
inline constexpr double kSpillGain = 0.03;

template <class B, class Block>
MemoryPlan plan_memory(const DecoderModel<Block>& model, const TrainerOptions& options, const DeviceBudget& device,
                       const HostBudget& host, const std::optional<StoreFootprint>& store_footprint = std::nullopt,
                       const MachineFigures& machine = {}) {
  const std::size_t L = model.num_blocks();
  const OpSizes ops = detail::measure_ops<B>(model, options, store_footprint);  // (the same for every plan tried)
  const auto with_every = [&](std::size_t every) {
    const std::size_t asked = options.kept_blocks > 0 ? static_cast<std::size_t>(options.kept_blocks) : 0;
    // (a backend whose memory is host memory has nothing to spill to)
    const bool auto_spill = options.spilled_blocks == TrainerOptions::kAutoSpilledBlocks && !device.host_memory;
    const std::size_t spill = options.spilled_blocks > 0 ? static_cast<std::size_t>(options.spilled_blocks) : 0;
    const auto plan = [&](std::size_t kept, std::size_t spilled) {
      return detail::plan_memory_every(model.config(), ops, options, every, kept, spilled, device, host);
    };
    if (every != 1 || !keeps_activations<B, Block>) return plan(0, 0);
    const bool auto_kept = options.kept_blocks == TrainerOptions::kAutoKeptBlocks;
    MemoryPlan best = plan(auto_kept ? 0 : asked, spill);
    if (!best.fits) return best;
    double best_s = predict_step(model.config(), options, best, machine).step_s;
    const auto consider = [&](MemoryPlan p) {
      if (!p.fits) return false;
      const double s = predict_step(model.config(), options, p, machine).step_s;
      if (s < best_s * (1 - 1e-3)) {
        best_s = s;
        best = std::move(p);
      }
      return true;
    };
    if (auto_kept)  // (a spilled count given: as many kept blocks as leave it whole)
      for (std::size_t n = 1; n + spill <= L; ++n) consider(plan(n, spill));  // (not monotonic: with every block kept, the scratch of recomputing goes)
    if (auto_spill) {
      // Spilling only where it is predicted at least kSpillGain faster than the best plan without:
      // its copies share PCIe with the weights and with the gradients the CPU's AdamW waits for,
      // which the model prices by bandwidth alone (docs/planner.md: measured on an H200, a
      // predicted 2.7% was within the noise of the calls, for 16 GiB more host memory).
      const MemoryPlan without = best;
      const double bar = best_s * (1 - kSpillGain);
      const std::size_t k0 = without.buffers.kept_blocks;
      for (std::size_t k = auto_kept && k0 > 3 ? k0 - 3 : k0; k <= k0; ++k)
        for (std::size_t n = 1; k + n <= L; ++n)
          if (!consider(plan(k, n))) break;  // (the staging is the same for any count, the host memory grows with it)
      if (best_s > bar) return without;
    }
    return best;
  };
  if (options.checkpoint_every > 0) return with_every(static_cast<std::size_t>(options.checkpoint_every));
  if (options.kept_blocks > 0 || options.spilled_blocks > 0) return with_every(1);  // (kept or spilled activations need a checkpoint at every block)
  MemoryPlan first = with_every(1);
  if (first.fits || first.fixed_too_large || first.store_bytes > first.host_budget) return first;  // (fewer checkpoints cannot help)
  std::size_t most = 2;
  while ((most + 1) * (most + 1) <= L + 2) ++most;  // ~ sqrt(L) + 1
  MemoryPlan last = std::move(first);
  for (std::size_t k = 2; k <= std::min(most, L); ++k) {
    MemoryPlan p = with_every(k);
    if (p.fits) return p;
    p.refusal = fmt::format("even with activation checkpoints every {} blocks, {}", k, p.refusal);
    last = std::move(p);
  }
  return last;
}

}  // namespace megatrain::plan
