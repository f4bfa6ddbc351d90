// A mixture of experts' routing statistics over a step: each micro-batch's [sparse layer, expert]
// counts of tokens routed and sums of router probabilities, recorded by the blocks' forwards on
// the device (RouterStats), downloaded with the micro-batch's head; from them the step's
// auxiliary load-balancing loss (transformers' load_balancing_loss_func, StepStats::aux_loss) and
// each sparse layer's fewest and most tokens per expert (StepStats::expert_load). The backward of
// a block reads them again where the config trains on the auxiliary loss.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "megatrain/backend/backend.hpp"
#include "megatrain/core/host_memory.hpp"
#include "megatrain/layers/ops/moe_mlp.hpp"
#include "megatrain/model/config.hpp"
#include "megatrain/plan/memory_plan.hpp"
#include "megatrain/step/trainer_options.hpp"
#include "megatrain/train/train_item.hpp"

namespace megatrain {

template <class B>
class ExpertStatistics {
  using Exec = typename B::Executor;
  template <class E>
  using Buf = typename B::template Buffer<E>;

 public:
  explicit ExpertStatistics(const ModelConfig& cfg) : cfg_(cfg) {
    for (std::int64_t l = 0, n = 0; l < cfg.num_hidden_layers; ++l) index_.push_back(cfg.is_moe_layer(l) ? n++ : -1);
  }
  bool active() const { return counts_dev_.size() > 0; }

  void allocate_device(B& be, const plan::TrainerBuffers& b) {
    if (b.router == 0) return;  // (a dense model)
    counts_dev_ = be.template alloc<std::int64_t>(b.router);
    probs_dev_ = be.template alloc<double>(b.router);
  }
  void allocate_host(const plan::TrainerBuffers& b) {
    if (b.router == 0) return;
    host_mem_ = HostBuffer::allocate(b.router * 16);
    counts_host_ = host_mem_.template as<std::int64_t>(0, b.router);
    probs_host_ = host_mem_.template as<double>(b.router, b.router);
  }

  /// A step's forward of micro-batch m records its routing from zero.
  void zero(B& be, Exec& exec, std::int64_t m, std::int64_t micro_batches) {
    const auto per = counts_dev_.size() / static_cast<std::size_t>(micro_batches);
    be.zero(exec, counts_dev_.span().subspan(static_cast<std::size_t>(m) * per, per));
    be.zero(exec, probs_dev_.span().subspan(static_cast<std::size_t>(m) * per, per));
  }
  /// ... and its head downloads it, for StepStats.
  void download(B& be, Exec& exec, std::int64_t m, std::int64_t micro_batches) {
    const auto per = counts_dev_.size() / static_cast<std::size_t>(micro_batches);
    const auto at = static_cast<std::size_t>(m) * per;
    be.download(exec, std::span<const std::int64_t>(counts_dev_.span()).subspan(at, per), counts_host_.subspan(at, per));
    be.download(exec, std::span<const double>(probs_dev_.span()).subspan(at, per), probs_host_.subspan(at, per));
  }

  /// A sparse block's statistics for micro-batch m: `record` (a training step's forward) where
  /// its counts and probabilities go, `aux` (the backward) what the auxiliary loss's gradient
  /// reads, when the config asks for that loss (`tokens`: the tokens micro-batch m counts;
  /// `forwards`: the forwards of the step, every process's). Empty for a dense block.
  RouterStats of(std::size_t unit, std::size_t blocks, std::int64_t m, bool record, bool aux, std::int64_t tokens,
                 double forwards) {
    RouterStats r;
    if (!active() || unit < 1 || unit > blocks) return r;
    const std::int64_t l = index_[unit - 1];
    if (l < 0) return r;
    const std::int64_t Lm = cfg_.moe_layer_count(), E = cfg_.moe.num_experts;
    const auto micro = static_cast<std::size_t>(m * Lm * E);
    if (record) {
      const auto at = micro + static_cast<std::size_t>(l * E);
      r.counts = View<std::int64_t>(counts_dev_.span().subspan(at, static_cast<std::size_t>(E)), Shape{E});
      r.probs = View<double>(probs_dev_.span().subspan(at, static_cast<std::size_t>(E)), Shape{E});
    }
    if (aux && cfg_.moe.output_router_logits) {
      r.aux_counts = View<const std::int64_t>(
          std::span<const std::int64_t>(counts_dev_.span()).subspan(micro, static_cast<std::size_t>(Lm * E)), Shape{Lm, E});
      // (each micro-batch's loss weighs 1 / the micro-batches of the step, every process's: the
      // gradients are summed over the processes)
      r.aux_scale = moe_aux_scale(cfg_.moe.router_aux_loss_coef, 1.0 / forwards, Lm, E, tokens);
    }
    return r;
  }

  /// The step's auxiliary loss (this process's micro-batches'): the mean of theirs.
  template <class Counted>
  double aux_loss(std::int64_t micro_batches, Counted&& counted_tokens) const {
    if (counts_host_.empty()) return 0.0;
    const std::int64_t Lm = cfg_.moe_layer_count(), E = cfg_.moe.num_experts;
    const auto per = static_cast<std::size_t>(Lm * E);
    double aux = 0;
    for (std::int64_t m = 0; m < micro_batches; ++m)
      aux += moe_aux_loss(counts_host_.subspan(static_cast<std::size_t>(m) * per, per),
                          probs_host_.subspan(static_cast<std::size_t>(m) * per, per), Lm, E, counted_tokens(m));
    return aux / static_cast<double>(micro_batches);
  }
  /// Each sparse layer's fewest and most tokens per expert over the step (with several
  /// processes, of the global batch: the counts summed over them first: counts()).
  void expert_load(StepStats& s, std::int64_t micro_batches) const {
    if (counts_host_.empty()) return;
    const std::int64_t Lm = cfg_.moe_layer_count(), E = cfg_.moe.num_experts;
    const auto per = static_cast<std::size_t>(Lm * E);
    for (std::int64_t l = 0, idx = 0; l < cfg_.num_hidden_layers; ++l) {
      if (!cfg_.is_moe_layer(l)) continue;
      StepStats::ExpertLoad load{l, std::numeric_limits<std::int64_t>::max(), 0};
      for (std::int64_t e = 0; e < E; ++e) {
        std::int64_t n = 0;
        for (std::int64_t m = 0; m < micro_batches; ++m)
          n += counts_host_[static_cast<std::size_t>(m) * per + static_cast<std::size_t>(idx * E + e)];
        load.min = std::min(load.min, n);
        load.max = std::max(load.max, n);
      }
      s.expert_load.push_back(load);
      ++idx;
    }
  }
  /// The step's counts on the host (summed over the processes by the caller).
  std::span<std::int64_t> counts() { return counts_host_; }

 private:
  const ModelConfig& cfg_;
  std::vector<std::int64_t> index_;  // by block: its index among the sparse layers, or -1
  Buf<std::int64_t> counts_dev_;     // [micro-batch, sparse layer, expert]
  Buf<double> probs_dev_;
  HostBuffer host_mem_;
  std::span<std::int64_t> counts_host_;
  std::span<double> probs_host_;
};

}  // namespace megatrain
