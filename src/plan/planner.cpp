// The step planner (plan/planner.hpp), compiled once: what needs no backend's types, the
// searches' helpers, the host's check before anything is built, and the plan in words.
#include "megatrain/plan/planner.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace megatrain::plan {

std::size_t cuda_prepare_estimate(const WorkspacePlan& w, std::size_t deterministic_limit) {
  const auto lb = static_cast<std::size_t>(std::min<std::int64_t>(2048, std::max<std::int64_t>(w.max_tokens, 1)));
  std::size_t ws = std::size_t{64} << 20;
  for (const AttentionShape& a : w.attention) {
    const auto rows = static_cast<std::size_t>(a.rows), seq = static_cast<std::size_t>(a.seq);
    const std::size_t dp = rows * static_cast<std::size_t>(a.heads) * seq * seq * 2;
    const std::size_t dq = 2 * rows * seq * static_cast<std::size_t>(a.heads * a.head_dim) * 4 + rows * seq * static_cast<std::size_t>(a.heads) * 8;
    ws = std::max(ws, dp <= deterministic_limit ? dp : dq);
  }
  ws = std::max(ws, w.linear_attention_bytes());
  return ws + lb * static_cast<std::size_t>(w.vocab) * (sizeof(float) + sizeof(bf16));
}

namespace detail {

std::optional<std::int64_t> largest(std::int64_t lo, std::int64_t hi, std::int64_t step,
                                    const std::function<bool(std::int64_t)>& fits) {
  if (hi < lo || !fits(lo)) return std::nullopt;
  std::int64_t a = 0, b = (hi - lo) / step;  // fits(lo + a * step); look in (a, b]
  while (a < b) {
    const std::int64_t mid = a + (b - a + 1) / 2;
    if (fits(lo + mid * step)) a = mid;
    else b = mid - 1;
  }
  return lo + a * step;
}

std::optional<std::int64_t> largest_near(std::int64_t from, std::int64_t step, std::int64_t ceiling,
                                         const std::function<bool(std::int64_t)>& fits) {
  if (!fits(from)) return largest(step, (from - 1) / step * step, step, fits);
  std::int64_t hi = from;
  while (hi < ceiling && fits(std::min(2 * hi, ceiling))) hi = std::min(2 * hi, ceiling);
  if (hi >= ceiling) return hi;
  const std::int64_t top = std::min(2 * hi, ceiling) - 1;
  const std::int64_t first = (hi + step - 1) / step * step;  // the multiples of step above hi
  const auto above = largest(first, top, step, fits);
  return above ? *above : hi;
}

std::int64_t seq_step(std::int64_t seq) { return seq >= 4096 ? 1024 : seq >= 256 ? 64 : 1; }

}  // namespace detail

GradientHome GradientHomeChoice::agree(std::span<const GradientHomeChoice> ranks) {
  const auto all = [&](auto&& f) { return std::all_of(ranks.begin(), ranks.end(), f); };
  if (all([](const GradientHomeChoice& c) { return c.home == GradientHome::device; })) return GradientHome::device;
  if (all([](const GradientHomeChoice& c) { return c.host_fits; })) return GradientHome::host;
  return GradientHome::device;
}

double min_state_bytes_per_param(const StoreShard& shard, bool bf16_copy, bool optimizer_state) {
  const double moments = optimizer_state ? 0.0 : 8.0 / std::max(shard.count, 1);  // (AdamW's m and v, left out)
  if (shard.count <= 1) return (bf16_copy ? 14 : 12) - moments;
  if (!shard.masters) return 6.0 + 8.0 / shard.count - moments;
  return (shard.shares_weights() || shard.keeps_weight_parts() ? 2.0 / shard.count : 2.0) + 12.0 / shard.count - moments;
}

std::size_t min_state_bytes(const ModelConfig& cfg, const StoreShard& shard, bool bf16_copy, bool optimizer_state) {
  return static_cast<std::size_t>(static_cast<double>(checked_mul(cfg.param_count(), 14, "the model's state in bytes")) *
                                  (min_state_bytes_per_param(shard, bf16_copy, optimizer_state) / 14));
}

void check_state_fits_host(const ModelConfig& cfg, const HostBudget& host, std::string_view source, const StoreShard& shard,
                           bool bf16_copy, bool optimizer_state) {
  const std::size_t need = min_state_bytes(cfg, shard, bf16_copy, optimizer_state);
  MT_CHECK(need <= host.bytes,
           "this configuration does not fit: {} describes a model of {} parameters (num_hidden_layers {}, hidden_size {}, "
           "intermediate_size {}, vocab_size {}), whose state alone (fp32 master weights{}{}: "
           "{:.4g} bytes a parameter{}) needs {} of host memory, and {} is available ({}): {}use a machine with more memory, a "
           "smaller model, or check the config",
           source, cfg.param_count(), cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size,
           optimizer_state ? ", AdamW m and v" : "", bf16_copy ? ", the bf16 copy" : " without the bf16 copy",
           min_state_bytes_per_param(shard, bf16_copy, optimizer_state),
           shard.count > 1 ? fmt::format(", this process's part of a state sharded over {}", shard.count) : std::string(),
           format_bytes(need), format_bytes(host.bytes), host.source,
           bf16_copy && shard.count <= 1 && min_state_bytes(cfg, shard, false, optimizer_state) <= host.bytes
               ? fmt::format("without the copy it needs {}: --host-bf16-copy false (TrainerOptions::host_bf16_copy), or ",
                             format_bytes(min_state_bytes(cfg, shard, false, optimizer_state)))
               : std::string());
}

std::string refusal_message(const MemoryPlan& plan, const Suggestions& s) {
  std::string m = fmt::format("this configuration does not fit: {}.", plan.refusal);
  const char* const no_copy = "--host-bf16-copy false (TrainerOptions::host_bf16_copy: no bf16 copy of the weights in "
                              "host memory, 12 bytes a parameter of state instead of 14; the GPU rounds the streamed fp32 "
                              "masters, twice the weights' PCIe bytes)";
  const char* const stale = "--clip-mode stale (ClipMode::stale: no gradient waits for the norm, as each step is clipped with "
                            "the previous step's norm, which changes the update; or --clip 0, no clipping)";
  if (s.store_alone_too_large) {
    m += fmt::format(" The model's state alone ({}) needs {} of host memory and {} is available: ", s.store_what,
                     format_bytes(s.store_bytes), format_bytes(s.host_budget));
    if (s.no_copy_fits) m += fmt::format("without the copy it fits: {}.", no_copy);
    else if (s.stale_no_copy_fits)
      m += fmt::format("it fits with {} and without the copy ({}; --host-bf16-copy auto, the default, drops it where only "
                       "that fits).", stale, no_copy);
    else m += "no batch or sequence length fits; use a machine with more memory, or a smaller model";
    return m;
  }
  std::vector<std::string> would;
  if (s.seq) would.push_back(fmt::format("--seq {} (TrainerOptions::seq_len) at this batch", *s.seq));
  if (s.micro_rows)
    would.push_back(fmt::format("--max-micro-batch {} (TrainerOptions::max_micro_rows: sequences on the GPU at once, the "
                                "batch as gradient accumulation)", *s.micro_rows));
  if (s.host_gradients_fit)
    would.push_back("--gradients host (TrainerOptions::gradient_home: the gradients wait for the norm in host memory)");
  if (s.stale_fits) would.push_back(stale);
  if (s.no_copy_fits) would.push_back(no_copy);
  if (s.stale_no_copy_fits) would.push_back(fmt::format("{} with {}", stale, no_copy));
  if (!would.empty()) m += fmt::format(" What fits: {}.", fmt::join(would, ", or "));
  else m += " No shorter sequence or smaller micro-batch fits either.";
  m += " Or give more memory (--gpu-memory, --host-memory), or run `megatrain-plan` with these options to see every buffer.";
  return m;
}

namespace {

// A scoring pass (a forward with the log-probabilities, no update): what --objective dpo runs over
// its pairs before step 1 (the reference). GRPO's sampling is not priced here.
std::string reference_pass_line(const StepTime& t) {
  return fmt::format("\na scoring pass (a forward with the log-probabilities, no update): {:.3f} s a batch (--objective dpo: "
                     "the reference, once over the training and validation pairs before step 1)\n", t.scoring_s);
}

}  // namespace

std::string format_summary(const StepPlan& p) {
  const TrainerBuffers& b = p.memory.buffers;
  const bool gpu = !p.memory.host_lines_include_device;
  std::string s = fmt::format(
      "plan: {} memory {}{} (activation checkpoints{}: {} of {} there{}; activations kept, not recomputed, for {} of {} "
      "blocks{}; AdamW there for {} of {} units); host memory {} of {} ({}), {:.2f} bytes per parameter{}\n",
      gpu ? "GPU" : "backend", format_bytes(p.memory.device_total() + p.memory.device_before),
      p.memory.device_cap ? fmt::format(" of {}", format_bytes(*p.memory.device_cap)) : std::string(),
      b.checkpoint_every > 1 ? fmt::format(" every {} blocks", b.checkpoint_every) : std::string(), b.checkpoints_on_device,
      b.checkpoints, b.checkpoints_in_host() > 0 ? fmt::format(", {} in host memory", b.checkpoints_in_host()) : "",
      b.kept_blocks, b.blocks, b.spilled_blocks > 0 ? fmt::format(", spilled to host memory for {}", b.spilled_blocks) : "",
      b.device_units, b.units, format_bytes(p.memory.host_total()), format_bytes(p.memory.host_budget), p.memory.host_budget_source,
      static_cast<double>(p.memory.host_total()) / static_cast<double>(p.config.param_count()),
      b.master_staging > 0 ? " (no bf16 copy of the weights: the GPU rounds the streamed fp32 masters)" : "");
  if (gpu)
    s += fmt::format("plan: predicted step {:.3f} s, {:.0f} tokens/s ({}-bound, on the figures of the {}); megatrain-plan "
                     "prints every buffer and term\n",
                     p.time.step_s, p.time.tokens_per_s(), p.time.bottleneck, p.machine.name);
  if (gpu && p.options.log_prob_objective) s += "plan: " + reference_pass_line(p.time).substr(1);
  return s;
}

std::string format_plan(const StepPlan& p) {
  const TrainerBuffers& b = p.memory.buffers;
  const ModelConfig& c = p.config;
  const TrainerOptions& o = p.options;
  std::string s;
  s += fmt::format("plan: {}, {:.3f}B parameters ({} layers, hidden {}, vocab {}); {} x {} tokens per step{}; clipping {}\n",
                   c.architecture_name(), static_cast<double>(c.param_count()) / 1e9, c.num_hidden_layers, c.hidden_size,
                   c.vocab_size, o.batch_rows, o.seq_len,
                   o.micro_batches > 1 ? fmt::format(" in {} micro-batches", o.micro_batches) : "",
                   o.clip_norm > 0 ? (o.clip_mode == ClipMode::exact ? "exact" : "stale") : "off");
  s += "\n| GPU memory | |\n| --- | --- |\n";
  for (const auto& l : p.memory.device) s += fmt::format("| {} | {} |\n", l.what, format_bytes(l.bytes));
  s += fmt::format("| **total** (+ {} the backend holds) | **{}**{} |\n", format_bytes(p.memory.device_before),
                   format_bytes(p.memory.device_total() + p.memory.device_before),
                   p.memory.device_cap ? fmt::format(" of {}", format_bytes(*p.memory.device_cap)) : "");
  s += "\n| host memory | |\n| --- | --- |\n";
  for (const auto& l : p.memory.host) s += fmt::format("| {} | {} |\n", l.what, format_bytes(l.bytes));
  s += fmt::format("| **total** | **{}** of {} ({}); {:.2f} bytes per parameter |\n", format_bytes(p.memory.host_total()),
                   format_bytes(p.memory.host_budget), p.memory.host_budget_source,
                   static_cast<double>(p.memory.host_total()) / static_cast<double>(c.param_count()));
  s += fmt::format("\ndecisions: activation checkpoints {}{} of {} on the GPU{}; activations kept (no recompute) for {} of {} "
                   "blocks{}; AdamW on the GPU for {} of {} units{}{}; token blocks of {}\n",
                   b.checkpoint_every > 1 ? fmt::format("every {} blocks (the outputs between recomputed before the "
                                                        "backward), ", b.checkpoint_every)
                                          : std::string(),
                   b.checkpoints_on_device, b.checkpoints,
                   b.checkpoints_in_host() > 0 ? fmt::format(", {} in host memory", b.checkpoints_in_host()) : "",
                   b.kept_blocks, b.blocks,
                   b.spilled_blocks > 0 ? fmt::format(", spilled to host memory (no recompute) for {}, every {} from the first",
                                                      b.spilled_blocks, b.spill_stride())
                                        : "",
                   b.device_units, b.units,
                   o.resident_gradients()
                       ? fmt::format("; gradients wait for the norm in {} memory",
                                     o.gradient_home == GradientHome::host || p.memory.host_lines_include_device ? "host" : "GPU")
                       : std::string(),
                   b.master_staging > 0 ? "; no bf16 copy of the weights in host memory: the fp32 masters stream and the "
                                          "GPU rounds them (twice the weights' PCIe bytes)"
                                        : "",
                   b.token_block > 0 ? fmt::format("{}", b.token_block) : "the whole chunk");
  s += fmt::format("\n| step time ({}) | seconds | |\n| --- | --- | --- |\n", p.machine.name);
  for (const auto& t : p.time.terms) s += fmt::format("| {} | {:.3f} | {} |\n", t.what, t.seconds, t.detail);
  s += fmt::format("| **predicted step** | **{:.3f}** | {}-bound ({} {:.3f} s + {:.3f} s not overlapped{}): {:.0f} tokens/s, {:.1f} "
                   "model TFLOP/s ({:.1f} executed) |\n",
                   p.time.step_s, p.time.bottleneck, p.time.bound_term, p.time.bound_s, p.time.exposed_s,
                   p.time.exposed_detail.empty() ? std::string() : " (" + p.time.exposed_detail + ")", p.time.tokens_per_s(),
                   p.time.model_flops / p.time.step_s / 1e12, p.time.executed_flops / p.time.step_s / 1e12);
  if (o.log_prob_objective) s += reference_pass_line(p.time);
  if (p.time.busy_tokens > 0)
    s += fmt::format("\nthe GPU is the bound from about {:.0f} tokens per step (this placement; fewer wait on the copies or "
                     "the CPU's AdamW){}\n",
                     std::ceil(p.time.busy_tokens),
                     p.time.busy_tokens > p.time.tokens ? fmt::format(": this step's {:.0f} leave the GPU {:.0f}% busy", p.time.tokens,
                                                                      100.0 * p.time.terms[0].seconds / p.time.step_s)
                                                        : std::string());
  s += p.memory.fits ? "\nfits: yes\n" : fmt::format("\nfits: no: {}\n", p.refusal());
  return s;
}

}  // namespace megatrain::plan
