// The memory plan of the streaming trainer (plan/memory_plan.hpp), compiled once: what the plan
// needs of a model's ops comes measured (OpSizes); the rest is the same for every backend.
#include "megatrain/plan/memory_plan.hpp"

#include "megatrain/backend/linear_attention.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace megatrain::plan {

std::size_t host_pages(std::size_t bytes) {
  const std::size_t p = host_page_size();
  return (bytes + p - 1) / p * p;
}

StoreOptions store_options(const TrainerOptions& options, StoreOptions base, bool bf16_weights) {
  const TrainerOptions opt = options.resolved();
  base.resident_gradients = opt.resident_gradients() && opt.gradient_home == GradientHome::host;
  base.grad_ring_slots = base.resident_gradients ? 0 : std::max<std::size_t>(base.grad_ring_slots, 2);
  base.grad_slot_size = GradSlotSize::largest_inner_unit;
  base.bf16_copy = opt.host_bf16_copy;
  // (ZeRO-1 with the gradients waiting on the GPUs: only this process's part of each lands)
  if (opt.sharded() && opt.resident_gradients() && opt.gradient_home == GradientHome::device)
    base.grad_slot_size = GradSlotSize::largest_inner_part;
  if (opt.shard_optimizer && opt.distributed()) {
    base.shard = {opt.comm->rank(), opt.comm->world(), bf16_weights, {0},
                  opt.share_host_weights && bf16_weights ? opt.comm : nullptr};
    base.shard.weights_in_parts = opt.weights_in_parts(bf16_weights);
  }
  return base;
}

bool keeps_gradient_parts(const TrainerOptions& o) {
  return o.sharded() && o.resident_gradients() && o.gradient_home == GradientHome::device && o.micro_batches == 1;
}

std::int64_t token_block(const TrainerOptions& opt, std::int64_t chunk_tokens) {
  if (opt.token_chunk > 0) return opt.token_chunk;
  return chunk_tokens > 32768 ? 16384 : 0;
}

std::int64_t chunk_rows(const TrainerOptions& opt) {
  return opt.chunk_rows > 0 ? std::min(opt.chunk_rows, opt.micro_rows()) : opt.micro_rows();
}

void TrainerBuffers::lay_out_pool(bool over_gradients) {
  // (each part starts where an arena over it carves as the arena alone would)
  constexpr std::size_t A = Arena::kAlignBytes;
  const auto up = [](std::size_t n) { return (n + A - 1) / A * A; };
  acc_at.assign(units, 0);
  kept_at.assign(units, 0);
  std::size_t at = 0;
  for (std::size_t u = 0; u < units; ++u) {
    acc_at[u] = at;
    at += up((u == 0 && embed_acc_in_pool ? embed_acc : block_acc[u]) * sizes.acc);
  }
  pool_grad_bytes = at;
  std::size_t low = 0;
  kept_over_gradients = 0;
  for (std::size_t u = 1; u <= blocks; ++u) {
    if (!keeps(u)) continue;
    if (over_gradients && low + kept_bytes[u] <= acc_at[u]) {
      kept_at[u] = low;
      low += up(kept_bytes[u]);
      ++kept_over_gradients;
    } else {
      kept_at[u] = at;
      at += up(kept_bytes[u]);
    }
  }
  pool_bytes = at;
}

namespace detail {

std::size_t device_unit_bytes(const TrainerBuffers& b, std::size_t u, std::size_t numel, bool grads_on_device, int shards) {
  const auto cut = HostParamStore<float>::shard_bounds(static_cast<std::int64_t>(numel), shards);
  std::size_t n = (numel + 2 * static_cast<std::size_t>(cut[1] - cut[0])) * sizeof(float);  // (part 0: the largest)
  const bool block = u != 0 && u + 1 != b.units;
  if (block && !grads_on_device) n += numel * b.sizes.acc;
  if (u == 0 && b.embed_acc == 0) n += numel * b.sizes.acc;
  return n;
}

namespace {

// One plan being made: the decisions of memory_plan.hpp's top comment, a phase each, called in
// order by plan_memory_every; each phase sees what the earlier ones left in the plan.
class Planning {
 public:
  Planning(const ModelConfig& cfg, const OpSizes& ops, const TrainerOptions& options, const DeviceBudget& device,
           const HostBudget& host)
      : cfg_(cfg), ops_(ops), options_(options), opt_(options.resolved()), device_(device), host_(host), b_(plan_.buffers) {
    opt_.validate();
  }

  /// The plan made (once the phases have run).
  MemoryPlan take() { return std::move(plan_); }
  /// The device units asked for (TrainerOptions::device_units: kAutoDeviceUnits, or a count) and the model's units.
  std::int64_t asked_device_units() const { return opt_.device_units; }
  std::size_t units() const { return b_.units; }

  // 1. the fixed buffers: their sizes
  void fixed_buffers(std::size_t every, std::size_t kept, std::size_t spilled) {
    const std::size_t L = ops_.blocks.size();
    b_.sizes = ops_.sizes;
    b_.units = L + 2;
    streamed_ = !opt_.resident_gradients();
    grads_on_device_ = opt_.resident_gradients() && opt_.gradient_home == GradientHome::device;
    grads_on_host_ = opt_.resident_gradients() && opt_.gradient_home == GradientHome::host;
    hidden_ = static_cast<std::size_t>(cfg_.hidden_size);
    const auto vocab = static_cast<std::size_t>(cfg_.vocab_size);

    b_.micro_tokens = static_cast<std::size_t>(opt_.micro_rows() * opt_.seq_len);
    b_.batch_tokens = static_cast<std::size_t>(opt_.batch_rows * opt_.seq_len);
    b_.router = static_cast<std::size_t>(opt_.micro_batches * cfg_.moe_layer_count() * cfg_.moe.num_experts);
    b_.token_mask = b_.router > 0;
    b_.chunk_rows = chunk_rows(opt_);
    b_.token_block = token_block(opt_, b_.chunk_rows * opt_.seq_len);
    chunk_tokens_ = ChunkShape{b_.chunk_rows, opt_.seq_len, {}, b_.token_block}.tokens();

    for (std::size_t l = 0; l < L; ++l) b_.block_slot = std::max(b_.block_slot, ops_.blocks[l].numel);
    b_.weight_slots = opt_.weight_slots;
    b_.block_acc.assign(b_.units, 0);
    parts_ = keeps_gradient_parts(opt_);
    if (grads_on_device_) {
      for (std::size_t l = 0; l < L; ++l) {
        const auto n = static_cast<std::int64_t>(ops_.blocks[l].numel);
        // (parts: this process's part of the sum, as the store cuts the unit)
        const auto cut = HostParamStore<float>::shard_bounds(n, parts_ ? opt_.comm->world() : 1);
        const auto r = static_cast<std::size_t>(parts_ ? opt_.comm->rank() : 0);
        b_.block_acc[l + 1] = static_cast<std::size_t>(cut[r + 1] - cut[r]);
      }
      if (parts_) b_.grad_whole = b_.block_slot;
    } else {
      b_.grad_slots = opt_.grad_slots;
    }
    b_.gains.assign(b_.units, 0);
    if (b_.sizes.split_gains) {
      b_.gains[0] = ops_.embed_full_numel;
      for (std::size_t l = 0; l < L; ++l) b_.gains[l + 1] = ops_.blocks[l].full_numel;
      b_.gains[L + 1] = ops_.head_full_numel;
    }
    b_.embed_slot = ops_.embed_numel;
    b_.head_slot = ops_.head_numel;
    if (b_.sizes.weight < sizeof(float) && !opt_.host_bf16_copy)
      b_.master_staging = std::min(kMasterStagingElements, std::max({b_.block_slot, b_.embed_slot, b_.head_slot}));
    if (!streamed_ || ops_.tied) b_.embed_acc = b_.embed_slot;
    max_rows_ = std::min(vocab, b_.batch_tokens);
    if (streamed_) {
      b_.rows_acc = max_rows_ * hidden_;
      b_.touched = max_rows_;
      b_.compact_ids = b_.micro_tokens;
    }
    b_.head_acc = b_.head_slot;
    b_.act = b_.micro_tokens * hidden_;
    b_.blocks = L;
    b_.checkpoint_every = std::max<std::size_t>(every, 1);
    if (ops_.keeps) {
      b_.kept_blocks = b_.checkpoint_every == 1 ? std::min(kept, L) : 0;
      b_.spilled_blocks = b_.checkpoint_every == 1 ? std::min(spilled, L - b_.kept_blocks) : 0;
    }
    b_.kept_bytes.assign(b_.units, 0);
    b_.scratch_bytes = ops_.head_scratch;
    for (std::size_t l = 0; l < L; ++l) {
      std::size_t scratch = 0;
      if (ops_.keeps && (b_.keeps(l + 1) || b_.spills(l + 1))) {
        b_.kept_bytes[l + 1] = ops_.blocks[l].kept;
        scratch = ops_.blocks[l].kept_scratch;
      }
      if (!b_.keeps(l + 1) && !b_.spills(l + 1)) scratch = ops_.blocks[l].scratch;
      b_.scratch_bytes = std::max(b_.scratch_bytes, scratch);
    }
    workspace();
    b_.checkpoints = b_.checkpoint_every == 1 ? L + 1 : (L - 1) / b_.checkpoint_every + 1;
    b_.recompute_buffers = b_.checkpoint_every - 1;
  }

  // 1. the fixed buffers: their lines; they must fit or nothing does
  void device_lines() {
    const auto& sz = b_.sizes;
    std::vector<MemoryLine>& dev = plan_.device;
    const bool over_gradients = grads_on_device_ && opt_.micro_batches == 1;
    b_.embed_acc_in_pool = over_gradients && b_.kept_blocks > 0 && !ops_.tied && b_.embed_acc > 0;
    b_.lay_out_pool(over_gradients);
    const std::size_t block_accs_bytes =
        (b_.grad_slots * b_.block_slot + b_.grad_whole) * sz.acc + b_.pool_grad_bytes - b_.pool_embed_bytes();
    std::size_t gains = 0;
    for (std::size_t n : b_.gains) gains += n * sizeof(float);
    dev.push_back({fmt::format("block weights ({} slots)", b_.weight_slots), b_.weight_slots * b_.block_slot * sz.weight});
    dev.push_back({!grads_on_device_ ? fmt::format("block gradients ({} slots)", b_.grad_slots)
                   : parts_ ? fmt::format("block gradients (this process's 1/{} of each, waiting for the norm; one whole as it "
                                          "is made)", opt_.comm->world())
                            : std::string("block gradients (waiting for the norm)"),
                   block_accs_bytes});
    if (gains > 0) dev.push_back({"norm gains (fp32)", gains});
    dev.push_back({"embedding and head weights", (b_.embed_slot + b_.head_slot) * sz.weight});
    staging_line_ = dev.size();  // (given back below where nothing streams)
    if (b_.master_staging > 0)
      dev.push_back({"staging of the fp32 masters, rounded to bf16 here (no bf16 copy in host memory)", b_.master_staging * sizeof(float)});
    dev.push_back({"embedding and head gradients", (b_.embed_acc_in_pool ? b_.pool_embed_bytes() : b_.embed_acc * sz.acc) +
                                                       (b_.head_acc + b_.rows_acc) * sz.acc + (b_.touched + b_.compact_ids) * 4});
    dev.push_back({"activation gradients (2 x a micro-batch)", 2 * b_.act * sz.res});
    dev.push_back({fmt::format("scratch of a chunk ({} x {} tokens{})", b_.chunk_rows, opt_.seq_len,
                               b_.token_block > 0 && b_.token_block < chunk_tokens_ ? fmt::format(", blocks of {}", b_.token_block) : ""),
                   b_.scratch_bytes});
    dev.push_back({"token ids, labels, losses", b_.micro_tokens * (2 * 4 + sz.acc) + (opt_.packed ? (2 * b_.micro_tokens + 1) * 4 : 0) +
                                                    (opt_.token_weights ? b_.micro_tokens * sz.acc : 0) +
                                                    b_.units * sizeof(double)});
    if (b_.router > 0)
      dev.push_back({"routing statistics (tokens per expert)", b_.router * 16 + (b_.token_mask ? b_.micro_tokens : 0)});
    if (b_.prepare_bytes > 0) dev.push_back({"backend workspaces (attention, logits of a block)", b_.prepare_bytes});
    if (b_.recompute_buffers > 0)
      dev.push_back({fmt::format("outputs recomputed between checkpoints ({} buffers: a checkpoint every {} blocks)",
                                 b_.recompute_buffers, b_.checkpoint_every),
                     b_.recompute_buffers * b_.act * sz.res});
    b_.embed_rows_first = opt_.device_units == 0;
    if (b_.embed_rows_first) {
      b_.embed_rows = max_rows_ * hidden_;
      dev.push_back({"embedding rows of the batch (fp32)", embed_rows_bytes()});
    }
    plan_.device_before = device_.allocated;
    plan_.device_cap = device_.cap;
    if (device_.cap && device_.allocated + plan_.device_total() > *device_.cap) {
      refuse(fmt::format("the step's buffers need {} of GPU memory beside the {} the backend holds, more than the cap of {}",
                         format_bytes(plan_.device_total()), format_bytes(device_.allocated), format_bytes(*device_.cap)));
      plan_.fixed_too_large = true;
    }
  }

  // 2. the activation checkpoints
  void checkpoints() {
    const std::size_t ckpt = b_.checkpoint_bytes();
    std::size_t fit = b_.checkpoints;
    // (room is kept for a host embedding's rows, which come after the device units when none was
    // asked for: auto placement decides whether the embedding is a device unit)
    const bool rows_late = !b_.embed_rows_first && opt_.device_units == TrainerOptions::kAutoDeviceUnits;
    if (auto avail = left(); avail && plan_.fits) {
      *avail -= std::min(*avail, rows_late ? embed_rows_bytes() : 0);
      const std::size_t usable = *avail - checkpoint_reserve(*avail);
      fit = std::min(b_.checkpoints, usable / std::max<std::size_t>(ckpt, 1));
      if (fit < b_.checkpoints) fit = usable >= 2 * ckpt ? std::min(b_.checkpoints, usable / ckpt - 2) : 0;
      if (fit < b_.checkpoints && usable < 2 * ckpt)
        refuse(fmt::format("the activation checkpoints ({} each, {} of them) do not fit: even the two staging buffers that "
                           "bring them from host memory need {}, and {} of GPU memory is left beside the step's other buffers",
                           format_bytes(ckpt), b_.checkpoints, format_bytes(2 * ckpt), format_bytes(usable)));
    }
    b_.checkpoints_on_device = fit;
    plan_.device.push_back({fmt::format("activation checkpoints on the GPU ({} of {})", fit, b_.checkpoints), fit * ckpt});
    if (fit < b_.checkpoints) plan_.device.push_back({"checkpoint staging buffers (2)", 2 * ckpt});
  }

  // 3. kept activations
  void kept_activations() {
    if (b_.kept_blocks == 0) return;
    const std::size_t need = b_.kept_extra_bytes();
    // (chosen by the plan: beside the same reserve as the checkpoints, for the libraries' own)
    const auto avail = left();
    const bool chosen = options_.kept_blocks == TrainerOptions::kAutoKeptBlocks;
    plan_.device.push_back({fmt::format("activations kept for the backward ({} of {} blocks: no recompute{})", b_.kept_blocks,
                                        b_.blocks,
                                        b_.kept_over_gradients == 0
                                            ? std::string()
                                            : fmt::format("; {} of them over the gradients of blocks below, updated by then",
                                                          b_.kept_over_gradients)),
                            need});
    if (device_.cap && plan_.fits && (need > *avail || (chosen && need > *avail - checkpoint_reserve(*avail))))
      refuse(fmt::format("the activations of {} blocks kept for the backward need {} of GPU memory, more than is left beside "
                         "the step's other buffers; keep fewer (megatrain-train --keep-activations N, or auto)",
                         b_.kept_blocks, format_bytes(need)));
  }

  // 3b. spilled activations: two device staging buffers (and pinned host memory, below)
  void spilled_activations() {
    if (b_.spilled_blocks == 0) return;
    for (std::size_t u = 1; u <= b_.blocks; ++u)
      if (b_.spills(u)) b_.spill_slot_bytes = std::max(b_.spill_slot_bytes, b_.kept_bytes[u]);
    const std::size_t need = 2 * b_.spill_slot_bytes;
    const auto avail = left();
    const bool chosen = options_.spilled_blocks == TrainerOptions::kAutoSpilledBlocks;
    plan_.device.push_back({fmt::format("staging of the activations spilled to host memory (2 x a block's; {} of {} blocks "
                                        "spill, every {} from the first)",
                                        b_.spilled_blocks, b_.blocks, b_.spill_stride()),
                            need});
    if (device_.cap && plan_.fits && (need > *avail || (chosen && need > *avail - checkpoint_reserve(*avail))))
      refuse(fmt::format("the staging buffers of the activations {} blocks spill to host memory need {} of GPU memory, more "
                         "than is left beside the step's other buffers; spill none (megatrain-train --spill-activations 0, "
                         "or auto)",
                         b_.spilled_blocks, format_bytes(need)));
  }

  // 4. device units (a count asked for checked against the model's units); 5. a host embedding's
  // fp32 rows, when not allocated first
  void device_units() {
    std::vector<MemoryLine>& dev = plan_.device;
    const std::size_t units = b_.units, L = b_.blocks;
    std::vector<std::size_t> unit_numel(units);
    unit_numel[0] = b_.embed_slot;
    for (std::size_t l = 0; l < L; ++l) unit_numel[l + 1] = ops_.blocks[l].numel;
    unit_numel[L + 1] = b_.head_slot;
    const int shards = opt_.sharded() ? opt_.comm->world() : 1;
    const auto unit_bytes = [&](std::size_t u) { return device_unit_bytes(b_, u, unit_numel[u], grads_on_device_, shards); };
    std::size_t count = 0;
    if (opt_.device_units != TrainerOptions::kAutoDeviceUnits) {
      count = static_cast<std::size_t>(opt_.device_units);
      std::size_t need = 0;
      for (std::size_t u = 0; u < count; ++u) need += unit_bytes(u);
      if (const auto avail = left(); avail && need > *avail)
        refuse(fmt::format("{} device units need {} of GPU memory for their AdamW state, and {} is left after the trainer's "
                           "buffers; ask for fewer (megatrain-train --device-units N, or auto)",
                           count, format_bytes(need), format_bytes(*avail)));
    } else if (device_.auto_device_units && b_.checkpoints_on_device == b_.checkpoints) {  // (checkpoints in host memory come first)
      if (const auto avail = left()) {
        std::size_t used = 0;
        while (count < units && used + unit_bytes(count) + units_reserve(*avail) <= *avail) used += unit_bytes(count++);
      }
    }
    b_.device_units = count;
    if (b_.master_staging > 0 && count >= units) {  // (every unit's weights made on the GPU: nothing streams)
      dev.erase(dev.begin() + static_cast<std::ptrdiff_t>(staging_line_));
      b_.master_staging = 0;
    }
    std::size_t unit_state = 0;
    for (std::size_t u = 0; u < count; ++u) {
      b_.device_unit_bytes.push_back(unit_bytes(u));
      unit_state += b_.device_unit_bytes.back();
    }
    if (count > 0) {
      std::int64_t params = 0;
      for (std::size_t u = 0; u < count; ++u) params += static_cast<std::int64_t>(unit_numel[u]);
      dev.push_back({fmt::format("AdamW state on the GPU ({} of {} units, {:.3f}B elements)", count, units,
                                 static_cast<double>(params) / 1e9),
                     unit_state});
    }

    // 5. a host embedding's fp32 rows, when not allocated first
    if (count == 0 && !b_.embed_rows_first) {
      b_.embed_rows = max_rows_ * hidden_;
      dev.push_back({"embedding rows of the batch (fp32)", embed_rows_bytes()});
    }
    if (device_.cap && plan_.fits && device_.allocated + plan_.device_total() > *device_.cap)
      refuse(fmt::format("the step needs {} of GPU memory beside the {} the backend holds, more than the cap of {}",
                         format_bytes(plan_.device_total()), format_bytes(device_.allocated), format_bytes(*device_.cap)));
  }

  // Host memory: the store, then the trainer's buffers.
  void host_memory() {
    const auto& sz = b_.sizes;
    const std::size_t ckpt = b_.checkpoint_bytes();
    const StoreFootprint& store = ops_.store;
    std::vector<MemoryLine>& hl = plan_.host;
    hl.push_back({"fp32 master weights", store.master_bytes});
    if (store.adam_bytes > 0) hl.push_back({"AdamW m and v (fp32)", store.adam_bytes});  // (none: a store never stepped)
    const StoreShard shard = store_options(opt_, {}, ops_.bf16_weights).shard;
    if (opt_.host_bf16_copy)
      hl.push_back({shard.shares_weights()
                      ? fmt::format("bf16 weights (what crosses PCIe; 1/{} of the copy this host's processes share)", shard.count)
                  : shard.keeps_weight_parts()
                      ? fmt::format("bf16 weights (this process's 1/{}: what it uploads; the GPUs gather the rest)", shard.count)
                      : std::string("bf16 weights (what crosses PCIe)"),
                    store.compute_bytes});
    if (store.resident_grad_bytes > 0) hl.push_back({"gradients waiting for the norm (fp32)", store.resident_grad_bytes});
    if (store.grad_ring_bytes > 0) hl.push_back({"gradient landing slots", store.grad_ring_bytes});
    plan_.store_bytes = store.total_bytes();
    if (opt_.micro_batches > 1 && grads_on_host_) b_.staging = static_cast<std::size_t>(store.largest_unit);
    std::size_t io = host_pages(b_.batch_tokens * (4 * 4 + sz.acc)) + host_pages(b_.units * sizeof(double));
    if (opt_.packed) io += host_pages((2 * b_.batch_tokens + 1) * 4);
    if (opt_.token_weights) io += host_pages(b_.batch_tokens * sz.acc);
    if (b_.router > 0) io += host_pages(b_.router * 16);
    if (b_.token_mask) io += host_pages(b_.batch_tokens);
    if (b_.embed_rows > 0) io += host_pages(b_.embed_rows * sizeof(float));
    if (b_.staging > 0) io += host_pages(2 * b_.staging * sizeof(float));
    hl.push_back({"batch buffers (pinned)", io});
    if (b_.checkpoints_in_host() > 0)
      hl.push_back({fmt::format("activation checkpoints in host memory ({} of {}, pinned)", b_.checkpoints_in_host(), b_.checkpoints),
                    b_.checkpoints_in_host() * host_pages(ckpt)});
    if (b_.spilled_blocks > 0)
      hl.push_back({fmt::format("activations spilled to host memory ({} blocks, pinned)", b_.spilled_blocks), b_.spilled_host_bytes()});
    plan_.host_lines_include_device = device_.host_memory;
    if (device_.host_memory) hl.push_back({"backend buffers (host memory on this backend)", plan_.device_total()});
    plan_.host_budget = host_.bytes;
    plan_.host_budget_source = host_.source;
    if (plan_.host_total() > host_.bytes)
      refuse(fmt::format("host memory: the model's state needs {} and the trainer's buffers {}{}, {} in all, more than the {} "
                         "available ({})",
                         format_bytes(plan_.store_bytes), format_bytes(plan_.host_total() - plan_.store_bytes),
                         b_.checkpoints_in_host() > 0
                             ? fmt::format(" ({} of them activation checkpoints that do not fit on the GPU)",
                                           format_bytes(b_.checkpoints_in_host() * host_pages(ckpt)))
                         : b_.spilled_blocks > 0
                             ? fmt::format(" ({} of them the activations of {} blocks spilled to host memory; spill fewer: "
                                           "megatrain-train --spill-activations N, or auto)",
                                           format_bytes(b_.spilled_host_bytes()), b_.spilled_blocks)
                             : std::string(),
                         format_bytes(plan_.host_total()), format_bytes(host_.bytes), host_.source));
  }

 private:
  // (the fixed buffers: what the backend's prepare() is asked to fit, and what it adds)
  void workspace() {
    b_.packed = opt_.packed;
    b_.token_weights = opt_.token_weights;
    b_.workspace.max_tokens = chunk_tokens_;
    b_.workspace.max_width = std::max({cfg_.hidden_size, cfg_.intermediate_size, cfg_.q_dim(), cfg_.kv_dim()});
    b_.workspace.vocab = cfg_.vocab_size;
    b_.workspace.packed = opt_.packed;
    for (std::int64_t r : {b_.chunk_rows, opt_.micro_rows() % b_.chunk_rows})
      if (r > 0) {  // (every layer's attention: full, and Gemma 3's sliding layers' window)
        const double scale = cfg_.query_pre_attn_scalar ? cfg_.attention_scale() : 0.0;
        b_.workspace.attention.push_back(
            {r, opt_.seq_len, cfg_.num_attention_heads, cfg_.num_key_value_heads, cfg_.head_dim, {}, scale, 0});
        if (!cfg_.layer_types.empty() && cfg_.sliding_window)
          b_.workspace.attention.push_back({r, opt_.seq_len, cfg_.num_attention_heads, cfg_.num_key_value_heads, cfg_.head_dim,
                                            {}, scale, *cfg_.sliding_window});
      }
    if (has_linear_attention(cfg_)) b_.workspace.linear_attention = delta_net_shape(cfg_);
    b_.prepare_bytes = device_.prepare_bytes ? device_.prepare_bytes(b_.workspace) : 0;
  }

  // What the backend can still hand out (none: no cap).
  std::optional<std::size_t> left() const {
    if (!device_.cap) return std::nullopt;
    const std::size_t used = device_.allocated + plan_.device_total();
    return *device_.cap > used ? *device_.cap - used : 0;
  }
  // The plan does not fit; the first reason is the one it gives.
  void refuse(std::string why) {
    if (plan_.fits) plan_.refusal = std::move(why);
    plan_.fits = false;
  }
  // Device bytes of a host embedding's fp32 rows (and their token ids where none are compacted).
  std::size_t embed_rows_bytes() const {
    return max_rows_ * hidden_ * sizeof(float) + (b_.compact_ids == 0 ? b_.micro_tokens * 4 : 0);
  }

  const ModelConfig& cfg_;
  const OpSizes& ops_;
  const TrainerOptions& options_;  // (as given: whether kept and spilled blocks are the plan's choice)
  const TrainerOptions opt_;       // (resolved)
  const DeviceBudget& device_;
  const HostBudget& host_;
  MemoryPlan plan_;
  TrainerBuffers& b_;
  bool streamed_ = false, grads_on_device_ = false, grads_on_host_ = false, parts_ = false;
  std::size_t hidden_ = 0, max_rows_ = 0;
  std::int64_t chunk_tokens_ = 0;  // (tokens of a chunk)
  std::size_t staging_line_ = 0;   // (the device line of the masters' staging, where there is one)
};

}  // namespace

MemoryPlan plan_memory_every(const ModelConfig& cfg, const OpSizes& ops, const TrainerOptions& options, std::size_t every,
                             std::size_t kept, std::size_t spilled, const DeviceBudget& device, const HostBudget& host) {
  Planning p(cfg, ops, options, device, host);
  p.fixed_buffers(every, kept, spilled);
  p.device_lines();
  p.checkpoints();
  p.kept_activations();
  p.spilled_activations();
  if (p.asked_device_units() != TrainerOptions::kAutoDeviceUnits) {  // (here: the error names this function)
    const auto count = static_cast<std::size_t>(p.asked_device_units());
    MT_CHECK(count <= p.units(), "device_units {} is more than the model's {} units", count, p.units());
  }
  p.device_units();
  p.host_memory();
  return p.take();
}

}  // namespace detail

}  // namespace megatrain::plan
