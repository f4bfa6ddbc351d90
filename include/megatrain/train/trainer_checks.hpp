// What a Trainer checks before it allocates anything: that the store was built for its options
// (Trainer::store_options: resident gradients or a landing ring, a bf16 copy or none, the
// optimizer state whole or this process's part), holds the model's units, and that the options
// fit the model and the communicator. Each refusal says what to do.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "megatrain/core/error.hpp"
#include "megatrain/core/log.hpp"
#include "megatrain/layers/ops/gated_deltanet.hpp"
#include "megatrain/layers/ops/moe_mlp.hpp"
#include "megatrain/layers/ops/self_attention.hpp"
#include "megatrain/step/trainer_options.hpp"
#include "megatrain/train/objective.hpp"

namespace megatrain {

/// The store holds the model's units (names and shapes) and the buffers the options need.
template <class Ctx>
void check_trainer_store(const Ctx& t) {
  const auto& store = t.store;
  const auto specs = t.model.units();
  MT_CHECK(store.has_bf16_copy() == t.opt.host_bf16_copy,
           "the store keeps {} bf16 copy of the weights but the trainer's options say {}: build the store with "
           "Trainer::store_options(options)", store.has_bf16_copy() ? "a" : "no",
           t.opt.host_bf16_copy ? "it streams the copy (host_bf16_copy)" : "it streams the masters (host_bf16_copy false)");
  MT_CHECK(store.num_units() == specs.size(), "the store has {} units but the model has {}", store.num_units(), specs.size());
  for (std::size_t u = 0; u < specs.size(); ++u) {
    const auto& su = store.unit(u);
    MT_CHECK(su.params().size() == specs[u].params.size(), "unit {} ('{}') has {} tensors in the store, {} in the model", u,
             su.name(), su.params().size(), specs[u].params.size());
    for (std::size_t p = 0; p < specs[u].params.size(); ++p)
      MT_CHECK(su.params()[p].spec.name == specs[u].params[p].name && su.params()[p].spec.shape == specs[u].params[p].shape,
               "unit '{}': the store has {} {} where the model expects {} {}", su.name(), su.params()[p].spec.name,
               su.params()[p].spec.shape.str(), specs[u].params[p].name, specs[u].params[p].shape.str());
  }
  if (t.grads_on_host()) {
    MT_CHECK(store.resident_gradients(),
             "this configuration ({}, gradients waiting in host memory) needs resident gradients: build the store with "
             "Trainer::store_options()", t.opt.micro_batches > 1 ? "gradient accumulation" : "exact clipping");
    return;
  }
  MT_CHECK(store.grad_ring_slots() >= 2,
           "the store's gradient ring has {} slots, the trainer needs at least 2: build it with Trainer::store_options()",
           store.grad_ring_slots());
  // Blocks land whole (gradients waiting on the device: in pieces, any size will do); the
  // embedding lands in whole rows; its table is the unit's only tensor.
  std::int64_t block_numel = 0;
  for (std::size_t l = 0; l < t.model.num_blocks(); ++l) block_numel = std::max(block_numel, store.unit(l + 1).numel());
  MT_CHECK(t.grads_on_device() || t.slot_numel() >= std::max(block_numel, t.model.config().hidden_size),
           "the store's gradient landing slots hold {} elements, less than a decoder block ({}): build it with "
           "Trainer::store_options()", t.slot_numel(), block_numel);
  MT_CHECK(store.unit(0).params().size() == 1 && store.unit(0).params()[0].offset == 0,
           "the embedding unit must hold the table alone, at offset 0");
}

/// The options against the model, the store's sharding and the communicator.
template <class Ctx>
void check_trainer_options(const Ctx& t) {
  using B = typename Ctx::Backend;
  using W = typename Ctx::W;
  using Acc = typename Ctx::Acc;
  const auto& opt = t.opt;
  const auto& cfg = t.model.config();
  const auto& store = t.store;
  if constexpr (!MoeBackend<B>) {  // (before anything is allocated)
    for (std::int64_t l = 0; l < cfg.num_hidden_layers; ++l)
      if (cfg.is_moe_layer(l)) MoeMlp::refuse_backend(cfg, l);
  }
  if constexpr (!SharedExpertBackend<B>) {
    for (std::int64_t l = 0; l < cfg.num_hidden_layers; ++l)
      if (cfg.is_moe_layer(l) && cfg.moe.shared_expert_size > 0) MoeMlp::refuse_shared_expert(cfg, l);
  }
  GatedDeltaNet::check_backend<B>(cfg);
  if constexpr (!GatedAttentionBackend<B>)
    MT_CHECK(!cfg.attention_output_gate(), "{}'s attention gates its output (q_proj's gate): this backend has no "
             "gate primitives (GatedAttentionBackend: the CPU and CUDA backends have them)", cfg.architecture_name());
  // Micro-batches added up in host memory: what orders a micro-batch's head (which zeroes the
  // head's and a tied embedding's accumulators) after the offload of the previous micro-batch's
  // embedding gradient is the reuse of the compute stage's ring (Compute::takes_slot,
  // Offload::applies): the slot the head takes must have been held by that backward or by a
  // forward after it, so the ring may be at most L + 2 long.
  const std::size_t L = t.model.num_blocks();
  MT_CHECK(!(t.grads_on_host() && opt.micro_batches > 1) || opt.grad_slots <= L + 2,
           "grad_slots {} is more than {}: with micro-batches added up in host memory (GradientHome::host) a {}-block model "
           "takes at most {}", opt.grad_slots, L + 2, L, L + 2);
  cfg.check_sequence_length(opt.seq_len);
  MT_CHECK(opt.sharded() ? store.shard().count == opt.comm->world() && store.shard().index == opt.comm->rank() &&
                               store.shard().masters == (std::is_same_v<W, bf16>)
                         : !store.sharded(),
           "the store keeps part {} of {} of the optimizer state, but the trainer's options say {}: build the store with "
           "Trainer::store_options(options)", store.shard().index, store.shard().count,
           opt.sharded() ? fmt::format("part {} of {}", opt.comm->rank(), opt.comm->world()) : std::string("all of it"));
  MT_CHECK(store.weights_in_parts() == t.weights_in_parts,
           "the store keeps {} but the trainer's options say {}: build the store with Trainer::store_options(options)",
           store.weights_in_parts() ? "this process's part of the bf16 weights current" : "the bf16 weights whole",
           t.weights_in_parts ? "each process uploads its part (gather_weights_on_device)" : "they stream whole");
  MT_CHECK(!t.weights_in_parts || opt.comm->can_sum_backend_memory(B::kDevice),
           "gather_weights_on_device: this communicator cannot gather GPU memory; use NCCL (dist::NcclHostComm), or set "
           "gather_weights_on_device to false");
  MT_CHECK(!t.reduces_on_device || (std::is_same_v<Acc, float> && opt.comm->can_sum_backend_memory(B::kDevice)),
           "data parallel over {} processes with the gradients waiting in {} memory (GradientHome::device): this "
           "communicator cannot sum that memory; use a communicator that can (NCCL on GPUs, MPI initialised for threads "
           "on the CPU backend), or GradientHome::host", opt.distributed() ? opt.comm->world() : 1,
           B::kDevice ? "GPU" : "backend");
  MT_CHECK(!opt.distributed() || opt.device_units <= 0 || t.reduces_on_device,
           "data parallel over {} processes with {} device units: their gradients are summed in GPU memory, which needs "
           "the gradients waiting there (GradientHome::device, the default)", opt.distributed() ? opt.comm->world() : 1,
           opt.device_units);
  if (opt.seq_len > cfg.max_position_embeddings)
    log_warning("the sequence length {} is longer than this model's max_position_embeddings {}: positions past {} are ones "
                "the model was not trained on; extend its context with rope scaling in config.json (rope_scaling: yarn, "
                "linear, ...) and a larger max_position_embeddings, or train on at most {} tokens per sequence",
                opt.seq_len, cfg.max_position_embeddings, cfg.max_position_embeddings, cfg.max_position_embeddings);
}

/// A store a step may update: one that keeps the optimizer state (StoreOptions::optimizer_state).
template <class Store>
void check_steppable(const Store& store) {
  MT_CHECK(store.has_optimizer_state(), "the store keeps no optimizer state (StoreOptions::optimizer_state false: built to "
           "sample or score): build it with the state to train");
}

/// A step's objective that weighs each token: the trainer was made for it (the buffers, the plan).
inline void check_weighted_objective(const TrainerOptions& opt, const Objective& objective) {
  MT_CHECK(opt.token_weights, "the objective '{}' weighs each token: make the trainer with "
           "TrainerOptions::token_weights = true (a buffer of a weight a token beside the labels)", objective.name());
  MT_CHECK(opt.log_prob_objective || !objective.needs_log_probs(), "the objective '{}' reads the rows' log-probabilities: "
           "make the trainer with TrainerOptions::log_prob_objective = true (the plan then prices the head's second forward)",
           objective.name());
}

}  // namespace megatrain
