// The cost model of one training step (plan/cost_model.hpp), compiled once: the step's terms,
// each in its own phase of predict_step, in the order the header's top comment gives them.
#include "megatrain/plan/cost_model.hpp"
#include "megatrain/plan/mixer_cost.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace megatrain::plan {

double block_elementwise_bytes(const ModelConfig& cfg, std::int64_t layer) {
  return token_mixer_elementwise_bytes(cfg, layer) + channel_mixer_elementwise_bytes(cfg, layer);
}

double active_expert_params(const ModelConfig& cfg) {
  // (a shared expert too: recomputed in the backward with the routed ones)
  const double shared = cfg.moe.shared_expert_size > 0 ? static_cast<double>(cfg.moe.shared_expert_params(cfg.hidden_size)) : 0;
  return static_cast<double>(cfg.moe_layer_count()) *
         (static_cast<double>(cfg.moe.experts_per_token) * 3.0 * static_cast<double>(cfg.hidden_size) *
              static_cast<double>(cfg.moe.intermediate_size) + shared);
}

double attention_span(const ModelConfig& cfg, double seq) {
  double span = 0;
  for (std::int64_t l = 0; l < cfg.num_hidden_layers; ++l) span += mixing_span(cfg, l, seq);
  return span;
}

double attention_span(const ModelConfig& cfg, double seq, bool linear) {
  double span = 0;
  for (std::int64_t l = 0; l < cfg.num_hidden_layers; ++l)
    if ((cfg.layer_kind(l).token_mixer == TokenMixerKind::linear_attention) == linear) span += mixing_span(cfg, l, seq);
  return span;
}

double model_flops(const ModelConfig& cfg, double tokens, double seq) {
  const double V = static_cast<double>(cfg.vocab_size), d = static_cast<double>(cfg.hidden_size);
  const double matmul = static_cast<double>(cfg.active_param_count()) - (cfg.tie_word_embeddings ? 0.0 : V * d);
  return 6 * matmul * tokens + 6.0 * tokens * static_cast<double>(cfg.q_dim()) * attention_span(cfg, seq);
}

namespace {

// One step being predicted: each phase adds its terms to `t` and keeps what the later ones read.
class Prediction {
 public:
  Prediction(const ModelConfig& cfg, const TrainerOptions& options, const MemoryPlan& plan, const MachineFigures& machine)
      : cfg_(cfg), opt_(options.resolved()), b_(plan.buffers), machine_(machine) {
    shape();
  }

  StepTime run() {
    gpu_term();
    pcie_terms();
    cpu_terms();
    bound();
    exposed();
    busy_tokens();
    t_.step_s = t_.bound_s + t_.exposed_s;
    return std::move(t_);
  }

 private:
  // The machine's rates for this rank, the model's parameters, and which are stepped where.
  void shape() {
    // (the host's CPU, and so its AdamW rate, is shared by the ranks that run on it)
    sharing_ = !opt_.distributed() ? 1 : opt_.host_processes > 0 ? opt_.host_processes : opt_.comm->world();
    m_ = machine_;
    m_.adamw_gparams /= sharing_;
    m_.adamw_dma_gparams /= sharing_;
    T_ = static_cast<double>(b_.batch_tokens);
    S_ = static_cast<double>(opt_.seq_len);
    L_ = static_cast<double>(cfg_.num_hidden_layers);
    d_ = static_cast<double>(cfg_.hidden_size);
    V_ = static_cast<double>(cfg_.vocab_size);
    qd_ = static_cast<double>(cfg_.q_dim());
    embed_ = V_ * d_;
    const double head = embed_ + d_;  // the LM head's product (tied or not) and the final norm
    blocks_ = static_cast<double>(cfg_.param_count()) - embed_ - d_ - (cfg_.tie_word_embeddings ? 0.0 : embed_);
    block_ = blocks_ / L_;
    // (the products a token runs: a mixture of experts' tokens see their k experts only)
    active_blocks_ = static_cast<double>(cfg_.active_param_count()) - embed_ - d_ - (cfg_.tie_word_embeddings ? 0.0 : embed_);
    // Which parameters are stepped where.
    const std::size_t units = b_.units;
    dev_units_ = b_.device_units;
    embed_dev_ = dev_units_ >= 1;
    head_dev_ = dev_units_ >= units;
    blocks_dev_ = static_cast<double>(std::min<std::size_t>(dev_units_ > 1 ? dev_units_ - 1 : 0, units - 2));
    head_params_ = cfg_.tie_word_embeddings ? d_ : head;
    n_dev_ = (embed_dev_ ? embed_ : 0) + blocks_dev_ * block_ + (head_dev_ ? head_params_ : 0);
    n_host_ = static_cast<double>(cfg_.param_count()) - n_dev_;
    t_.tokens = T_;
  }

  // GPU
  void gpu_term() {
    const double T = T_, L = L_;
    const TrainerBuffers& b = b_;
    const MachineFigures& m = m_;
    // (a checkpoint every k blocks: the k - 1 outputs between are computed once more, before the backward)
    const double refill = b.checkpoint_every > 1 ? static_cast<double>(b.blocks - b.checkpoints) / L : 0.0;  // blocks run once more
    // (kept or spilled activations: those blocks' forward is not recomputed)
    const double kept = static_cast<double>(b.kept_blocks + b.spilled_blocks) / L;
    // (spilled activations: down over PCIe beside the forward, up before the backward)
    double spill_bytes = 0;
    for (std::size_t u = 1; u <= b.blocks; ++u)
      if (b.spills(u)) spill_bytes += static_cast<double>(b.kept_bytes[u]);
    spill_bytes *= static_cast<double>(opt_.micro_batches);
    spill_bytes_ = spill_bytes;
    // (a mixture of experts: the active experts' products run grouped, at their own rate, and are
    // recomputed in the backward even where the block keeps its other activations)
    const double experts = experts_ = active_expert_params(cfg_);
    // (an objective that reads the log-probabilities: the head's forward once more a micro-batch)
    const double head_passes = opt_.log_prob_objective ? 8 : 6;
    const double dense_gemm = (8 + 2 * refill - 2 * kept) * (active_blocks_ - experts) * T + head_passes * embed_ * T;
    const double expert_gemm = (8 + 2 * refill) * experts * T;
    const double gemm = dense_gemm + expert_gemm;
    // (attention: S x L without sliding layers; Gated DeltaNet's mixing at its own rates)
    const double att_fwd = att_fwd_ = 2 * T * qd_ * attention_span(cfg_, S_, false);
    const double delta_fwd = delta_fwd_ = 2 * T * qd_ * attention_span(cfg_, S_, true);
    const double expert_s = expert_gemm / (m.moe_gemm_tflops * 1e12);
    const double gemm_s = dense_gemm / (m.gemm_tflops * 1e12) + expert_s;
    const double delta_s =
        (2 + refill - kept) * delta_fwd / (m.delta_rule_fwd_tflops * 1e12) + 2.5 * delta_fwd / (m.delta_rule_bwd_tflops * 1e12);
    const double att_s = delta_s + (2 + refill - kept) * att_fwd / (m.attention_fwd_tflops * 1e12) +
                         2.5 * att_fwd / (m.attention_bwd_tflops * 1e12);
    // element-wise passes: block_elementwise_bytes per token and layer; the loss over the logits
    double elem_bytes = (kLossBytesPerLogit + (opt_.log_prob_objective ? kLossForwardBytesPerLogit : 0)) * T * V_;
    for (std::int64_t l = 0; l < cfg_.num_hidden_layers; ++l) elem_bytes += T * block_elementwise_bytes(cfg_, l);
    const double elem_s = elem_s_ = elem_bytes / (m.hbm_gbs * 1e9);
    // (device AdamW: 30 bytes an element; and a device block's bf16 weights made from its masters
    // for each item that reads them, 6 bytes an element: each micro-batch's forward and backward,
    // and the refills between checkpoints)
    const double weight_casts = b.sizes.weight < sizeof(float) ? static_cast<double>(opt_.micro_batches) * (2 + refill) : 0.0;
    const double adam_dev_s = adam_dev_s_ = (30 * n_dev_ + 6 * weight_casts * blocks_dev_ * block_) / (m.hbm_gbs * 1e9);
    const double ckpt_moved = static_cast<double>(b.checkpoints_in_host()) * static_cast<double>(b.checkpoint_bytes());
    const double ckpt_s = ckpt_moved / (m.d2h_gbs * 1e9) + ckpt_moved / (m.h2d_gbs * 1e9);
    gpu_s_ = gemm_s + att_s + elem_s + adam_dev_s + ckpt_s;
    t_.executed_flops = gemm + (4.5 + refill - kept) * (att_fwd + delta_fwd);
    t_.model_flops = model_flops(cfg_, T, S_);
    t_.terms.push_back({"GPU", gpu_s_,
                        fmt::format("matrix products {:.3f} s ({:.1f} TFLOP at {:.0f} TFLOP/s{}{}), attention {:.3f} s{}, "
                                    "element-wise {:.3f} s, AdamW {:.3f} s{}",
                                    gemm_s, gemm / 1e12, m.gemm_tflops,
                                    opt_.log_prob_objective ? "; the head's forward twice: the objective reads its "
                                                              "log-probabilities"
                                                            : "",
                                    experts > 0 ? fmt::format("; of them the experts' {:.1f} TFLOP at {:.0f}: {:.3f} s",
                                                              expert_gemm / 1e12, m.moe_gemm_tflops, expert_s)
                                                : std::string(),
                                    att_s,
                                    delta_fwd > 0 ? fmt::format(" (of it Gated DeltaNet's mixing {:.3f} s at {:.3g} / {:.3g} "
                                                                "TFLOP/s)", delta_s, m.delta_rule_fwd_tflops,
                                                                m.delta_rule_bwd_tflops)
                                                  : std::string(),
                                    elem_s, adam_dev_s,
                                    ckpt_s > 0 ? fmt::format(", checkpoints through host memory {:.3f} s", ckpt_s) : "")});
  }

  // PCIe
  void pcie_terms() {
    const MachineFigures& m = m_;
    const double spill_bytes = spill_bytes_;
    rows_ = std::min(V_, T_);
    // (each streamed block's weights twice a step, forward and backward: bf16, or the fp32 masters
    // where host memory keeps no bf16 copy and the GPU rounds them)
    wb_ = b_.sizes.weight < sizeof(float) && !opt_.host_bf16_copy ? 4.0 : 2.0;
    // (the forward's share: the streamed blocks' weights once, the embedding's rows, the head's
    // weights; the backward's: the blocks' weights again)
    const double blocks_up = wb_ * blocks_ * ((L_ - blocks_dev_) / L_);
    h2d_fwd_ = blocks_up + (embed_dev_ ? 0 : rows_ * d_ * 4) + (head_dev_ ? 0 : wb_ * head_params_);
    if (cfg_.tie_word_embeddings && !embed_dev_) h2d_fwd_ += wb_ * embed_;  // the head reads the embedding's table
    const double h2d = h2d_fwd_ + blocks_up + spill_bytes;
    // (gradients waiting in host memory: each micro-batch's come down, and the CPU adds the later
    // ones to the first's during the backward; on the GPU they add up there and come down once)
    host_home_ = opt_.resident_gradients() && opt_.gradient_home == GradientHome::host;
    const double downloads = host_home_ ? static_cast<double>(opt_.micro_batches) : 1.0;
    const double d2h = d2h_ = 4 * n_host_ * downloads + spill_bytes;
    t_.terms.push_back({"PCIe H2D", h2d / (m.h2d_gbs * 1e9),
                        fmt::format("{:.2f} GB of weights{} at {:.1f} GB/s", h2d / 1e9,
                                    spill_bytes > 0 ? fmt::format(" and spilled activations ({:.2f} GB)", spill_bytes / 1e9) : "",
                                    m.h2d_gbs)});
    // With resident gradients (exact clipping, micro-batches) the host units are stepped in the
    // AdamW pass, after the backward, beside the next step's forward; their gradients come down in
    // that pass where they wait on the GPU, and during the backward where they wait in host memory
    // (GradientHome::host). Else they stream down and are stepped during the backward.
    pass_ = opt_.resident_gradients();
    pass_d2h_ = pass_ && opt_.gradient_home == GradientHome::device;  // (the pass waits for the copies)
    when_ = pass_ ? " (in the AdamW pass, beside the next forward)" : "";
    t_.terms.push_back({"PCIe D2H", d2h / (m.d2h_gbs * 1e9),
                        fmt::format("{:.2f} GB of fp32 gradients{} at {:.1f} GB/s{}", d2h / 1e9,
                                    spill_bytes > 0 ? fmt::format(" and spilled activations ({:.2f} GB, beside the forward)", spill_bytes / 1e9) : "",
                                    m.d2h_gbs, pass_d2h_ ? when_ : pass_ ? " (during the backward, into host memory)" : "")});
    t_.terms.push_back({"PCIe both ways", (h2d + d2h) / (m.duplex_gbs * 1e9), fmt::format("at {:.0f} GB/s in total", m.duplex_gbs)});
  }

  // CPU
  void cpu_terms() {
    const MachineFigures& m = m_;
    cpu_s_ = n_host_ / (m.adamw_dma_gparams * 1e9);
    t_.terms.push_back({"CPU AdamW", cpu_s_, fmt::format("{:.3f}B parameters at {:.2f} Gparam/s{}{}", n_host_ / 1e9, m.adamw_dma_gparams,
                                                         sharing_ > 1 ? fmt::format(" (the host's {:.2f} shared by its {} ranks)",
                                                                                    machine_.adamw_dma_gparams, sharing_)
                                                                      : std::string(),
                                                         when_)});
    if (host_home_ && opt_.micro_batches > 1) {  // (12 bytes an addition, against AdamW's 30 a parameter)
      const double adds = n_host_ * static_cast<double>(opt_.micro_batches - 1);
      t_.terms.push_back({"CPU gradient sums", adds * 12.0 / 30.0 / (m.adamw_dma_gparams * 1e9),
                          fmt::format("{:.3f}B additions of later micro-batches' gradients in host memory, during the backward",
                                      adds / 1e9)});
    }
  }

  // The bound: the largest term that overlaps the whole step (the pass's terms overlap only the
  // forward: what they take beyond it is exposed; the CPU's AdamW of streamed gradients runs
  // beside the backward and the device units' forward: what it takes beyond them is exposed).
  void bound() {
    const MachineFigures& m = m_;
    const double T = T_;
    fwd_s_ = 2 * (active_blocks_ - experts_) * T / (m.gemm_tflops * 1e12) + 2 * experts_ * T / (m.moe_gemm_tflops * 1e12) +
             att_fwd_ / (m.attention_fwd_tflops * 1e12) + delta_fwd_ / (m.delta_rule_fwd_tflops * 1e12) + elem_s_ / 4;
    // (a forward with the head's log-probabilities alone: the GPU's, or the weights' uploads)
    t_.scoring_s = std::max(fwd_s_ + 2 * embed_ * T / (m.gemm_tflops * 1e12) + kLossForwardBytesPerLogit * T * V_ / (m.hbm_gbs * 1e9),
                            h2d_fwd_ / (m.h2d_gbs * 1e9));
    // (beside the forward, the pass's copies and the forward's share the link at the rate copies
    // keep while the CPU's AdamW runs: the host's memory serves both)
    pass_copies_s_ = ((pass_d2h_ ? d2h_ : spill_bytes_) + h2d_fwd_) / (m.pass_copies_gbs * 1e9);
    pass_s_ = pass_ ? std::max({cpu_s_, pass_d2h_ ? d2h_ / (m.d2h_gbs * 1e9) : 0.0, pass_copies_s_}) : 0.0;
    t_.bottleneck.clear();
    for (const TimeTerm& term : t_.terms) {
      if (term.what == "CPU AdamW" || (pass_d2h_ && term.what == "PCIe D2H")) continue;
      if (term.seconds > t_.bound_s || t_.bottleneck.empty()) {
        t_.bound_s = term.seconds;
        t_.bottleneck = t_.bound_term = term.what;
      }
    }
  }

  // Not overlapped: the first block's weights before the first forward; with gradients streamed
  // as they are computed, the last unit's (the embedding's rows) download and update; with the
  // AdamW pass, what it takes beyond the forward beside it.
  void exposed() {
    const MachineFigures& m = m_;
    const double L = L_, fwd_s = fwd_s_, gpu_s = gpu_s_, cpu_s = cpu_s_, pass_s = pass_s_;
    const bool first_block_dev = dev_units_ >= 2;
    t_.exposed_s = first_block_dev ? 0.0 : 2 * block_ / (m.h2d_gbs * 1e9);
    if (!pass_ && !embed_dev_) t_.exposed_s += rows_ * d_ * 4 / (m.d2h_gbs * 1e9) + rows_ * d_ / (m.adamw_gparams * 1e9);
    const double stall = spill_stalls();
    // (what the AdamW pass takes beyond the forward, and the copies' hold on top: while spilled
    // copies hold the compute stream they hold the link and the host's memory the pass needs too,
    // so the pass gains nothing from the longer forward; measured: docs/planner.md)
    if (pass_ && pass_s > fwd_s) {
      t_.exposed_s += pass_s - fwd_s;
      t_.exposed_detail = fmt::format("the AdamW pass takes {:.3f} s beside a {:.3f} s forward", pass_s, fwd_s);
    }
    t_.exposed_s += stall;
    if (t_.exposed_detail.empty() && stall > 0)
      t_.exposed_detail = fmt::format("the spilled activations' copies hold the compute stream {:.3f} s", stall);
    // Streamed gradients are stepped as they land during the backward, the lowest host units (the
    // first the next forward needs, after the device units') last: what the CPU's AdamW takes
    // beyond the backward and the device units' forward delays the next step.
    const double bwd_s = std::max(0.0, gpu_s - fwd_s);
    slack_ = bwd_s + fwd_s * blocks_dev_ / L;
    if (!pass_ && cpu_s > slack_) {
      t_.exposed_s += cpu_s - slack_;
      t_.exposed_detail = fmt::format("the CPU's AdamW takes {:.3f} s beside a {:.3f} s backward", cpu_s, bwd_s);
    }
    // The CPU's AdamW is the bottleneck where it takes longer than the GPU and is what the step
    // waits on beyond it
    // (or, where the pass waits on its copies beside the CPU's AdamW rather than on the CPU, PCIe)
    const double cpu_wait = pass_ ? pass_s : cpu_s;
    const bool pass_copies_bound = pass_ && pass_copies_s_ > cpu_s;
    if (!t_.exposed_detail.empty() && cpu_wait > t_.bound_s) t_.bottleneck = pass_copies_bound ? "PCIe both ways" : "CPU AdamW";
  }

  // Spilled activations: one block in every `stride` spills, so each copy has the link for the
  // time of `stride` blocks (down beside the forward, up beside the backward) before the next
  // spilled block's copy queues behind it; a copy longer than that holds the compute stream (its
  // staging buffer is written again). Beside the forward the link is shared with the AdamW pass's
  // downloads of the host units' gradients (spread over the forward), beside the backward with
  // the uploads of the weights of spilled blocks that stream. The seconds they hold it, forward
  // and backward.
  double spill_stalls() const {
    const MachineFigures& m = m_;
    const TrainerBuffers& b = b_;
    const double L = L_, fwd_s = fwd_s_, gpu_s = gpu_s_;
    double stall_fwd = 0, stall_bwd = 0;
    if (b.spilled_blocks > 0) {
      const double one = spill_bytes_ / static_cast<double>(opt_.micro_batches) / static_cast<double>(b.spilled_blocks);
      const double stride = static_cast<double>(b.spill_stride());
      const double block_fwd = fwd_s / L, block_bwd = std::max(0.0, gpu_s - fwd_s) / L;
      const double pass_down = pass_d2h_ && fwd_s > 0 ? 4 * n_host_ / fwd_s : 0.0;  // bytes/s the pass's downloads take
      const double down_rate = std::max(m.d2h_gbs * 1e9 - pass_down, 0.25 * m.d2h_gbs * 1e9);
      for (std::size_t u = 1; u <= b.blocks; ++u) {
        if (!b.spills(u)) continue;
        const bool streams = static_cast<double>(u) > blocks_dev_;  // (its weights cross beside its copies)
        const double up = one + (streams ? stride * wb_ * block_ : 0.0);
        stall_fwd += std::max(0.0, one / down_rate - stride * block_fwd);
        stall_bwd += std::max(0.0, up / (m.h2d_gbs * 1e9) - stride * block_bwd);
      }
      stall_fwd *= static_cast<double>(opt_.micro_batches);
      stall_bwd *= static_cast<double>(opt_.micro_batches);
    }
    return stall_fwd + stall_bwd;
  }

  // The tokens per step from which the GPU is the bound, this placement kept: the GPU's terms
  // grow with the tokens (not the device units' AdamW), the copies' and the CPU's do not
  void busy_tokens() {
    const double grows = gpu_s_ - adam_dev_s_;
    if (grows > 0) {
      double r = 0;
      for (const TimeTerm& term : t_.terms)
        if (term.what != "GPU" && term.what != "CPU AdamW" && !(pass_d2h_ && term.what == "PCIe D2H"))
          r = std::max(r, (term.seconds - adam_dev_s_) / grows);
      if (pass_ && fwd_s_ > 0) r = std::max(r, pass_s_ / fwd_s_);
      if (!pass_ && slack_ > 0) r = std::max(r, cpu_s_ / slack_);
      t_.busy_tokens = r * T_;
    }
  }

  const ModelConfig& cfg_;
  const TrainerOptions opt_;  // (resolved)
  const TrainerBuffers& b_;
  const MachineFigures& machine_;  // (as given: the host's, for the words)
  MachineFigures m_;               // (this rank's share of the host's CPU)
  int sharing_ = 1;
  StepTime t_;
  // the model's and the step's shape
  double T_ = 0, S_ = 0, L_ = 0, d_ = 0, V_ = 0, qd_ = 0, embed_ = 0, blocks_ = 0, block_ = 0, active_blocks_ = 0;
  // which parameters are stepped where
  std::size_t dev_units_ = 0;
  bool embed_dev_ = false, head_dev_ = false;
  double blocks_dev_ = 0, head_params_ = 0, n_dev_ = 0, n_host_ = 0;
  // what the phases leave to the later ones
  double spill_bytes_ = 0, experts_ = 0, att_fwd_ = 0, delta_fwd_ = 0, elem_s_ = 0, adam_dev_s_ = 0, gpu_s_ = 0;
  double rows_ = 0, wb_ = 0, h2d_fwd_ = 0, d2h_ = 0, cpu_s_ = 0, fwd_s_ = 0, pass_copies_s_ = 0, pass_s_ = 0, slack_ = 0;
  bool host_home_ = false, pass_ = false, pass_d2h_ = false;
  const char* when_ = "";
};

}  // namespace

StepTime predict_step(const ModelConfig& cfg, const TrainerOptions& options, const MemoryPlan& plan,
                      const MachineFigures& machine) {
  return Prediction(cfg, options, plan, machine).run();
}

}  // namespace megatrain::plan
