// The cost model of one training step (a roofline): what the GPU computes, what crosses PCIe
// each way, what the CPU's AdamW steps, each over the machine's measured rate; the step can be no
// faster than the largest, and the pipeline overlaps the rest with it.
//
//   GPU      matrix products: 8 x the blocks' parameters x tokens (forward, the recompute of the
//            forward from the activation checkpoint, backward; 6 x for blocks that keep their
//            activations), 6 x the head's (no recompute); a mixture of experts' active experts
//            (a token's k) 8 x at their own rate (grouped products; recomputed even in a block
//            that keeps its other activations);
//            causal attention: 2 T S q_dim per layer forward (a sliding layer's S its window's
//            span: attention_span) (twice: forward and recompute) and
//            2.5 times that backward; the element-wise passes (norms, SwiGLU, rotary, residual
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
  double hbm_gbs = 4000;      ///< device memory, bytes read plus written per second (GB/s)
  double adamw_gparams = 4.4;       ///< CPU AdamW (fp32, with the bf16 copy), all cores, G parameters/s
  double adamw_dma_gparams = 4.2;   ///< the same while PCIe copies run both ways
  /// PCIe copies both ways, in total, while the CPU's AdamW runs (its pass beside a forward):
  /// the host's memory serves both. Reference: the lowest of four probes on H200 hosts
  /// (2026-11-29: 63, 64, 68, 72; planner.md).
  double pass_copies_gbs = 63.0;
};

namespace detail {
struct FigureField {
  const char* name;
  double MachineFigures::*value;
};
inline constexpr FigureField kFigureFields[] = {
    {"h2d_gbs", &MachineFigures::h2d_gbs},           {"d2h_gbs", &MachineFigures::d2h_gbs},
    {"duplex_gbs", &MachineFigures::duplex_gbs},     {"gemm_tflops", &MachineFigures::gemm_tflops},
    {"moe_gemm_tflops", &MachineFigures::moe_gemm_tflops},
    {"attention_fwd_tflops", &MachineFigures::attention_fwd_tflops},
    {"attention_bwd_tflops", &MachineFigures::attention_bwd_tflops},
    {"hbm_gbs", &MachineFigures::hbm_gbs},           {"adamw_gparams", &MachineFigures::adamw_gparams},
    {"adamw_dma_gparams", &MachineFigures::adamw_dma_gparams}, {"pass_copies_gbs", &MachineFigures::pass_copies_gbs}};
}  // namespace detail

inline nlohmann::json to_json(const MachineFigures& m) {
  nlohmann::json j{{"name", m.name}};
  for (const auto& f : detail::kFigureFields) j[f.name] = m.*f.value;
  return j;
}

/// Reads figures written by to_json (fields left out keep the reference values); `what` names
/// the source in errors.
inline MachineFigures machine_figures_from_json(const nlohmann::json& j, std::string_view what) {
  std::string names = "name";
  for (const auto& f : detail::kFigureFields) names += fmt::format(", {}", f.name);
  MT_CHECK(j.is_object(), "{}: machine figures must be a JSON object (fields: {})", what, names);
  MachineFigures m;
  m.name = std::string(what);
  for (const auto& [key, value] : j.items()) {
    if (key == "name") {
      MT_CHECK(value.is_string(), "{}: 'name' must be a string", what);
      m.name = value.get<std::string>();
      continue;
    }
    const auto* f = std::find_if(std::begin(detail::kFigureFields), std::end(detail::kFigureFields),
                                 [&](const detail::FigureField& x) { return key == x.name; });
    MT_CHECK(f != std::end(detail::kFigureFields), "{}: unknown field '{}' (fields: {})", what, key, names);
    MT_CHECK(value.is_number() && value.get<double>() > 0 && std::isfinite(value.get<double>()),
             "{}: '{}' must be a positive number (got {})", what, key, value.dump());
    m.*f->value = value.get<double>();
  }
  return m;
}

/// Where `megatrain-plan --probe` keeps this machine's figures (plan/probe.hpp):
/// $MEGATRAIN_MACHINE, else $XDG_CACHE_HOME/megatrain/machine.json, else
/// ~/.cache/megatrain/machine.json (empty: no home).
inline std::filesystem::path default_machine_file() {
  if (const char* e = std::getenv("MEGATRAIN_MACHINE"); e != nullptr && *e != '\0') return e;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && *x != '\0')
    return std::filesystem::path(x) / "megatrain" / "machine.json";
  if (const char* h = std::getenv("HOME"); h != nullptr && *h != '\0')
    return std::filesystem::path(h) / ".cache" / "megatrain" / "machine.json";
  return {};
}

/// The figures of the file at `path` (machine_figures_from_json), `what` naming it in errors.
inline MachineFigures read_machine_figures(const std::filesystem::path& path, std::string_view what) {
  std::ifstream f(path);
  MT_CHECK(f.good(), "{}: cannot open it", what);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    MT_FAIL("{}: malformed JSON: {}", what, e.what());
  }
  return machine_figures_from_json(j, what);
}

/// This machine's figures as a probe kept them (default_machine_file()), else the reference
/// H200 host's: what the trainer's plan decides with, and what megatrain-plan and megatrain-train
/// predict with unless given --machine.
inline MachineFigures machine_figures() {
  const std::filesystem::path f = default_machine_file();
  if (f.empty() || !std::filesystem::exists(f)) return {};
  return read_machine_figures(f, fmt::format("the figures megatrain-plan --probe kept in '{}' (remove it, or probe again)", f.string()));
}

/// Bytes the loss over the logits moves per logit: the fp32 logits read twice (the softmax's
/// maximum and sum, then the gradient) and the bf16 gradient written.
inline constexpr double kLossBytesPerLogit = 10;

/// Bytes of element-wise passes per token of decoder block `layer` (forward, backward and what the
/// backward makes again): about 120 per hidden unit (the fp32 residual stream through two norms,
/// forward, again and backward) and 18 per intermediate unit (SwiGLU forward, then its backward,
/// which makes the product again in the same pass).
/// A mixture-of-experts layer's MLP instead: 18 per intermediate unit of each of a token's k
/// experts, and about 18 per hidden unit and expert (its rows gathered, its output weighted and
/// summed, forward and again, and their backward).
inline double block_elementwise_bytes(const ModelConfig& cfg, std::int64_t layer) {
  const double d = static_cast<double>(cfg.hidden_size);
  if (!cfg.is_moe_layer(layer)) return 120.0 * d + 18.0 * static_cast<double>(cfg.intermediate_size);
  const double k = static_cast<double>(cfg.moe.experts_per_token);
  return 120.0 * d + k * (18.0 * static_cast<double>(cfg.moe.intermediate_size) + 18.0 * d);
}

/// The experts' parameters one token's forward runs through, over every layer (0 for a dense model).
inline double active_expert_params(const ModelConfig& cfg) {
  return static_cast<double>(cfg.moe_layer_count()) * static_cast<double>(cfg.moe.experts_per_token) * 3.0 *
         static_cast<double>(cfg.hidden_size) * static_cast<double>(cfg.moe.intermediate_size);
}

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
  double tokens_per_s() const { return step_s > 0 ? tokens / step_s : 0; }
};

/// The attention's span over the layers for sequences of `seq` tokens: the sum over the layers of
/// twice the keys a query sees on average, which is `seq` for causal attention over the whole
/// sequence (the FLOPs convention's S) and less for a sliding window of w < seq keys (Gemma 3's
/// and GPT-OSS's sliding layers): 2 (w (w + 1) / 2 + (seq - w) w) / seq.
inline double attention_span(const ModelConfig& cfg, double seq) {
  double span = 0;
  for (std::int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    const double w = static_cast<double>(cfg.attention_window(l));
    span += w <= 0 || w >= seq ? seq : 2 * (w * (w + 1) / 2 + (seq - w) * w) / seq;
  }
  return span;
}

/// Model FLOPs of a step of `tokens` tokens in sequences of `seq` (the MFU convention: no
/// recompute; 6 x the matmul parameters per token, the embedding lookup none, a tied head's
/// product counted; a mixture of experts' active parameters only (a token's k experts); causal
/// attention 6 x seq x q_dim per token and layer, a sliding layer's over its window:
/// attention_span).
inline double model_flops(const ModelConfig& cfg, double tokens, double seq) {
  const double V = static_cast<double>(cfg.vocab_size), d = static_cast<double>(cfg.hidden_size);
  const double matmul = static_cast<double>(cfg.active_param_count()) - (cfg.tie_word_embeddings ? 0.0 : V * d);
  return 6 * matmul * tokens + 6.0 * tokens * static_cast<double>(cfg.q_dim()) * attention_span(cfg, seq);
}

/// The step time of `plan` (its decisions: device units, spilled checkpoints) on `m`.
inline StepTime predict_step(const ModelConfig& cfg, const TrainerOptions& options, const MemoryPlan& plan,
                             const MachineFigures& machine) {
  const TrainerOptions opt = options.resolved();
  // (the host's CPU, and so its AdamW rate, is shared by the ranks that run on it)
  const int sharing = !opt.distributed() ? 1 : opt.host_processes > 0 ? opt.host_processes : opt.comm->world();
  MachineFigures m = machine;
  m.adamw_gparams /= sharing;
  m.adamw_dma_gparams /= sharing;
  const TrainerBuffers& b = plan.buffers;
  const double T = static_cast<double>(b.batch_tokens), S = static_cast<double>(opt.seq_len);
  const double L = static_cast<double>(cfg.num_hidden_layers), d = static_cast<double>(cfg.hidden_size);
  const double V = static_cast<double>(cfg.vocab_size);
  const double qd = static_cast<double>(cfg.q_dim());
  const double embed = V * d;
  const double head = embed + d;  // the LM head's product (tied or not) and the final norm
  const double blocks = static_cast<double>(cfg.param_count()) - embed - d - (cfg.tie_word_embeddings ? 0.0 : embed);
  const double block = blocks / L;
  // (the products a token runs: a mixture of experts' tokens see their k experts only)
  const double active_blocks = static_cast<double>(cfg.active_param_count()) - embed - d - (cfg.tie_word_embeddings ? 0.0 : embed);
  // Which parameters are stepped where.
  const std::size_t units = b.units, dev_units = b.device_units;
  const bool embed_dev = dev_units >= 1, head_dev = dev_units >= units;
  const double blocks_dev = static_cast<double>(std::min<std::size_t>(dev_units > 1 ? dev_units - 1 : 0, units - 2));
  const double head_params = cfg.tie_word_embeddings ? d : head;
  const double n_dev = (embed_dev ? embed : 0) + blocks_dev * block + (head_dev ? head_params : 0);
  const double n_host = static_cast<double>(cfg.param_count()) - n_dev;

  StepTime t;
  t.tokens = T;
  // GPU
  // (a checkpoint every k blocks: the k - 1 outputs between are computed once more, before the backward)
  const double refill = b.checkpoint_every > 1 ? static_cast<double>(b.blocks - b.checkpoints) / L : 0.0;  // blocks run once more
  // (kept or spilled activations: those blocks' forward is not recomputed)
  const double kept = static_cast<double>(b.kept_blocks + b.spilled_blocks) / L;
  // (spilled activations: down over PCIe beside the forward, up before the backward)
  double spill_bytes = 0;
  for (std::size_t u = 1; u <= b.blocks; ++u)
    if (b.spills(u)) spill_bytes += static_cast<double>(b.kept_bytes[u]);
  spill_bytes *= static_cast<double>(opt.micro_batches);
  // (a mixture of experts: the active experts' products run grouped, at their own rate, and are
  // recomputed in the backward even where the block keeps its other activations)
  const double experts = active_expert_params(cfg);
  const double dense_gemm = (8 + 2 * refill - 2 * kept) * (active_blocks - experts) * T + 6 * embed * T;
  const double expert_gemm = (8 + 2 * refill) * experts * T;
  const double gemm = dense_gemm + expert_gemm;
  const double att_fwd = 2 * T * qd * attention_span(cfg, S);  // (S x L without sliding layers)
  const double expert_s = expert_gemm / (m.moe_gemm_tflops * 1e12);
  const double gemm_s = dense_gemm / (m.gemm_tflops * 1e12) + expert_s;
  const double att_s =
      (2 + refill - kept) * att_fwd / (m.attention_fwd_tflops * 1e12) + 2.5 * att_fwd / (m.attention_bwd_tflops * 1e12);
  // element-wise passes: block_elementwise_bytes per token and layer; the loss over the logits
  double elem_bytes = kLossBytesPerLogit * T * V;
  for (std::int64_t l = 0; l < cfg.num_hidden_layers; ++l) elem_bytes += T * block_elementwise_bytes(cfg, l);
  const double elem_s = elem_bytes / (m.hbm_gbs * 1e9);
  // (device AdamW: 30 bytes an element; and a device block's bf16 weights made from its masters
  // for each item that reads them, 6 bytes an element: each micro-batch's forward and backward,
  // and the refills between checkpoints)
  const double weight_casts = b.sizes.weight < sizeof(float) ? static_cast<double>(opt.micro_batches) * (2 + refill) : 0.0;
  const double adam_dev_s = (30 * n_dev + 6 * weight_casts * blocks_dev * block) / (m.hbm_gbs * 1e9);
  const double ckpt_moved = static_cast<double>(b.checkpoints_in_host()) * static_cast<double>(b.checkpoint_bytes());
  const double ckpt_s = ckpt_moved / (m.d2h_gbs * 1e9) + ckpt_moved / (m.h2d_gbs * 1e9);
  const double gpu_s = gemm_s + att_s + elem_s + adam_dev_s + ckpt_s;
  t.executed_flops = gemm + (4.5 + refill - kept) * att_fwd;
  t.model_flops = model_flops(cfg, T, S);
  t.terms.push_back({"GPU", gpu_s,
                     fmt::format("matrix products {:.3f} s ({:.1f} TFLOP at {:.0f} TFLOP/s{}), attention {:.3f} s, "
                                 "element-wise {:.3f} s, AdamW {:.3f} s{}",
                                 gemm_s, gemm / 1e12, m.gemm_tflops,
                                 experts > 0 ? fmt::format("; of them the experts' {:.1f} TFLOP at {:.0f}: {:.3f} s",
                                                           expert_gemm / 1e12, m.moe_gemm_tflops, expert_s)
                                             : std::string(),
                                 att_s, elem_s, adam_dev_s,
                                 ckpt_s > 0 ? fmt::format(", checkpoints through host memory {:.3f} s", ckpt_s) : "")});
  // PCIe
  const double rows = std::min(V, T);
  // (each streamed block's weights twice a step, forward and backward: bf16, or the fp32 masters
  // where host memory keeps no bf16 copy and the GPU rounds them)
  const double wb = b.sizes.weight < sizeof(float) && !opt.host_bf16_copy ? 4.0 : 2.0;
  // (the forward's share: the streamed blocks' weights once, the embedding's rows, the head's
  // weights; the backward's: the blocks' weights again)
  const double blocks_up = wb * blocks * ((L - blocks_dev) / L);
  double h2d_fwd = blocks_up + (embed_dev ? 0 : rows * d * 4) + (head_dev ? 0 : wb * head_params);
  if (cfg.tie_word_embeddings && !embed_dev) h2d_fwd += wb * embed;  // the head reads the embedding's table
  const double h2d = h2d_fwd + blocks_up + spill_bytes;
  // (gradients waiting in host memory: each micro-batch's come down, and the CPU adds the later
  // ones to the first's during the backward; on the GPU they add up there and come down once)
  const bool host_home = opt.resident_gradients() && opt.gradient_home == GradientHome::host;
  const double downloads = host_home ? static_cast<double>(opt.micro_batches) : 1.0;
  const double d2h = 4 * n_host * downloads + spill_bytes;
  t.terms.push_back({"PCIe H2D", h2d / (m.h2d_gbs * 1e9),
                     fmt::format("{:.2f} GB of weights{} at {:.1f} GB/s", h2d / 1e9,
                                 spill_bytes > 0 ? fmt::format(" and spilled activations ({:.2f} GB)", spill_bytes / 1e9) : "",
                                 m.h2d_gbs)});
  // With resident gradients (exact clipping, micro-batches) the host units are stepped in the
  // AdamW pass, after the backward, beside the next step's forward; their gradients come down in
  // that pass where they wait on the GPU, and during the backward where they wait in host memory
  // (GradientHome::host). Else they stream down and are stepped during the backward.
  const bool pass = opt.resident_gradients();
  const bool pass_d2h = pass && opt.gradient_home == GradientHome::device;  // (the pass waits for the copies)
  const char* when = pass ? " (in the AdamW pass, beside the next forward)" : "";
  t.terms.push_back({"PCIe D2H", d2h / (m.d2h_gbs * 1e9),
                     fmt::format("{:.2f} GB of fp32 gradients{} at {:.1f} GB/s{}", d2h / 1e9,
                                 spill_bytes > 0 ? fmt::format(" and spilled activations ({:.2f} GB, beside the forward)", spill_bytes / 1e9) : "",
                                 m.d2h_gbs, pass_d2h ? when : pass ? " (during the backward, into host memory)" : "")});
  t.terms.push_back({"PCIe both ways", (h2d + d2h) / (m.duplex_gbs * 1e9), fmt::format("at {:.0f} GB/s in total", m.duplex_gbs)});
  const double cpu_s = n_host / (m.adamw_dma_gparams * 1e9);
  t.terms.push_back({"CPU AdamW", cpu_s, fmt::format("{:.3f}B parameters at {:.2f} Gparam/s{}{}", n_host / 1e9, m.adamw_dma_gparams,
                                                      sharing > 1 ? fmt::format(" (the host's {:.2f} shared by its {} ranks)",
                                                                                machine.adamw_dma_gparams, sharing)
                                                                  : std::string(),
                                                      when)});
  if (host_home && opt.micro_batches > 1) {  // (12 bytes an addition, against AdamW's 30 a parameter)
    const double adds = n_host * static_cast<double>(opt.micro_batches - 1);
    t.terms.push_back({"CPU gradient sums", adds * 12.0 / 30.0 / (m.adamw_dma_gparams * 1e9),
                       fmt::format("{:.3f}B additions of later micro-batches' gradients in host memory, during the backward",
                                   adds / 1e9)});
  }
  // The bound: the largest term that overlaps the whole step (the pass's terms overlap only the
  // forward: what they take beyond it is exposed; the CPU's AdamW of streamed gradients runs
  // beside the backward and the device units' forward: what it takes beyond them is exposed).
  const double fwd_s = 2 * (active_blocks - experts) * T / (m.gemm_tflops * 1e12) + 2 * experts * T / (m.moe_gemm_tflops * 1e12) +
                      att_fwd / (m.attention_fwd_tflops * 1e12) + elem_s / 4;
  // (beside the forward, the pass's copies and the forward's share the link at the rate copies
  // keep while the CPU's AdamW runs: the host's memory serves both)
  const double pass_copies_s = ((pass_d2h ? d2h : spill_bytes) + h2d_fwd) / (m.pass_copies_gbs * 1e9);
  const double pass_s = pass ? std::max({cpu_s, pass_d2h ? d2h / (m.d2h_gbs * 1e9) : 0.0, pass_copies_s}) : 0.0;
  t.bottleneck.clear();
  for (const TimeTerm& term : t.terms) {
    if (term.what == "CPU AdamW" || (pass_d2h && term.what == "PCIe D2H")) continue;
    if (term.seconds > t.bound_s || t.bottleneck.empty()) {
      t.bound_s = term.seconds;
      t.bottleneck = t.bound_term = term.what;
    }
  }
  // Not overlapped: the first block's weights before the first forward; with gradients streamed
  // as they are computed, the last unit's (the embedding's rows) download and update; with the
  // AdamW pass, what it takes beyond the forward beside it.
  const bool first_block_dev = dev_units >= 2;
  t.exposed_s = first_block_dev ? 0.0 : 2 * block / (m.h2d_gbs * 1e9);
  if (!pass && !embed_dev) t.exposed_s += rows * d * 4 / (m.d2h_gbs * 1e9) + rows * d / (m.adamw_gparams * 1e9);
  // Spilled activations: one block in every `stride` spills, so each copy has the link for the
  // time of `stride` blocks (down beside the forward, up beside the backward) before the next
  // spilled block's copy queues behind it; a copy longer than that holds the compute stream (its
  // staging buffer is written again). Beside the forward the link is shared with the AdamW pass's
  // downloads of the host units' gradients (spread over the forward), beside the backward with
  // the uploads of the weights of spilled blocks that stream.
  double stall_fwd = 0, stall_bwd = 0;
  if (b.spilled_blocks > 0) {
    const double one = spill_bytes / static_cast<double>(opt.micro_batches) / static_cast<double>(b.spilled_blocks);
    const double stride = static_cast<double>(b.spill_stride());
    const double block_fwd = fwd_s / L, block_bwd = std::max(0.0, gpu_s - fwd_s) / L;
    const double pass_down = pass_d2h && fwd_s > 0 ? 4 * n_host / fwd_s : 0.0;  // bytes/s the pass's downloads take
    const double down_rate = std::max(m.d2h_gbs * 1e9 - pass_down, 0.25 * m.d2h_gbs * 1e9);
    for (std::size_t u = 1; u <= b.blocks; ++u) {
      if (!b.spills(u)) continue;
      const bool streams = static_cast<double>(u) > blocks_dev;  // (its weights cross beside its copies)
      const double up = one + (streams ? stride * wb * block : 0.0);
      stall_fwd += std::max(0.0, one / down_rate - stride * block_fwd);
      stall_bwd += std::max(0.0, up / (m.h2d_gbs * 1e9) - stride * block_bwd);
    }
    stall_fwd *= static_cast<double>(opt.micro_batches);
    stall_bwd *= static_cast<double>(opt.micro_batches);
  }
  // (what the AdamW pass takes beyond the forward, and the copies' hold on top: while spilled
  // copies hold the compute stream they hold the link and the host's memory the pass needs too,
  // so the pass gains nothing from the longer forward; measured: docs/planner.md)
  if (pass && pass_s > fwd_s) {
    t.exposed_s += pass_s - fwd_s;
    t.exposed_detail = fmt::format("the AdamW pass takes {:.3f} s beside a {:.3f} s forward", pass_s, fwd_s);
  }
  t.exposed_s += stall_fwd + stall_bwd;
  if (t.exposed_detail.empty() && stall_fwd + stall_bwd > 0)
    t.exposed_detail = fmt::format("the spilled activations' copies hold the compute stream {:.3f} s", stall_fwd + stall_bwd);
  // Streamed gradients are stepped as they land during the backward, the lowest host units (the
  // first the next forward needs, after the device units') last: what the CPU's AdamW takes
  // beyond the backward and the device units' forward delays the next step.
  const double bwd_s = std::max(0.0, gpu_s - fwd_s);
  const double slack = bwd_s + fwd_s * blocks_dev / L;
  if (!pass && cpu_s > slack) {
    t.exposed_s += cpu_s - slack;
    t.exposed_detail = fmt::format("the CPU's AdamW takes {:.3f} s beside a {:.3f} s backward", cpu_s, bwd_s);
  }
  // The CPU's AdamW is the bottleneck where it takes longer than the GPU and is what the step
  // waits on beyond it
  // (or, where the pass waits on its copies beside the CPU's AdamW rather than on the CPU, PCIe)
  const double cpu_wait = pass ? pass_s : cpu_s;
  const bool pass_copies_bound = pass && pass_copies_s > cpu_s;
  if (!t.exposed_detail.empty() && cpu_wait > t.bound_s) t.bottleneck = pass_copies_bound ? "PCIe both ways" : "CPU AdamW";
  // The tokens per step from which the GPU is the bound, this placement kept: the GPU's terms
  // grow with the tokens (not the device units' AdamW), the copies' and the CPU's do not
  const double grows = gpu_s - adam_dev_s;
  if (grows > 0) {
    double r = 0;
    for (const TimeTerm& term : t.terms)
      if (term.what != "GPU" && term.what != "CPU AdamW" && !(pass_d2h && term.what == "PCIe D2H"))
        r = std::max(r, (term.seconds - adam_dev_s) / grows);
    if (pass && fwd_s > 0) r = std::max(r, pass_s / fwd_s);
    if (!pass && slack > 0) r = std::max(r, cpu_s / slack);
    t.busy_tokens = r * T;
  }
  t.step_s = t.bound_s + t.exposed_s;
  return t;
}

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
  const auto with_every = [&](std::size_t every) {
    const std::size_t asked = options.kept_blocks > 0 ? static_cast<std::size_t>(options.kept_blocks) : 0;
    // (a backend whose memory is host memory has nothing to spill to)
    const bool auto_spill = options.spilled_blocks == TrainerOptions::kAutoSpilledBlocks && !device.host_memory;
    const std::size_t spill = options.spilled_blocks > 0 ? static_cast<std::size_t>(options.spilled_blocks) : 0;
    const auto plan = [&](std::size_t kept, std::size_t spilled) {
      return detail::plan_memory_every<B>(model, options, every, kept, spilled, device, host, store_footprint);
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
