// The memory plan of the streaming trainer: every buffer it allocates for a configuration, in
// backend (GPU) memory and in host memory, and the decisions that depend on what fits.
//
// One function, plan_memory(), decides; the Trainer allocates what it says (Trainer::allocate
// follows TrainerBuffers field by field), and the programs call it before anything is allocated
// to refuse a configuration that cannot fit, saying why and what would (plan/planner.hpp). So the
// plan is not an estimate of the trainer's memory: it is the trainer's memory. Backends count
// what they hand out (CudaBackend::allocated_bytes, CpuBackend::allocated_bytes) and the tests
// compare the two.
//
// Decisions, in the order the trainer makes them (each sees what the earlier ones left):
//   1. the fixed buffers: weight slots, gradient accumulators, the step's activations and
//      scratch (one chunk), the backend's workspaces (WorkspacePlan, via the backend), token
//      buffers; they must fit or nothing does;
//   2. the activation checkpoints (one residual-stream row per token per unit boundary, L + 1
//      of them): on the device while they fit beside a reserve (1/32 of what is left, for what
//      the backend's libraries allocate themselves), the rest in pinned host memory through two
//      device staging buffers;
//   3. kept activations (TrainerOptions::kept_blocks): the last N blocks keep their activations
//      from forward to backward instead of recomputing them; the count is given, or chosen by
//      plan_memory() in cost_model.hpp (the fastest predicted step that fits); and spilled ones
//      (TrainerOptions::spilled_blocks): S of the others keep theirs in pinned host memory, through
//      two device staging buffers (the count likewise);
//   4. device units (TrainerOptions::device_units): the first units in forward order keep their
//      AdamW state on the device; auto takes the longest prefix that fits beside a reserve (1/32,
//      at least 1 GiB), and none while checkpoints are in host memory (a checkpoint on the GPU saves host
//      memory and PCIe time on the compute stream; a device unit only CPU time);
//   5. the embedding's fp32 rows for the lookup, where the embedding is a host unit.
// Host memory: the store (14 bytes per parameter, plus resident gradients or a landing ring),
// the trainer's pinned buffers, the spilled checkpoints and the spilled activations.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "megatrain/backend/arena.hpp"
#include "megatrain/backend/backend.hpp"
#include "megatrain/core/dtype.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/host_memory.hpp"
#include "megatrain/layers/decoder_model.hpp"
#include "megatrain/store/host_param_store.hpp"
#include "megatrain/step/trainer_options.hpp"

namespace megatrain::plan {

/// Elements of the fp32 staging buffer through which a trainer without a bf16 copy in host memory
/// (TrainerOptions::host_bf16_copy false) streams a unit's masters, piece by piece (64 MiB): long
/// enough that a piece's copy keeps PCIe busy, short beside the GPU's memory.
inline constexpr std::size_t kMasterStagingElements = std::size_t{16} << 20;

/// What a backend brings to a memory plan.
struct DeviceBudget {
  /// The most bytes the backend's buffers may take in all (its memory cap); none: no cap.
  std::optional<std::size_t> cap;
  /// Bytes the backend holds already (its own buffers, such as cuBLASLt's workspace).
  std::size_t allocated = 0;
  /// The bytes the backend's prepare() adds for a workspace plan; empty: it has no prepare().
  std::function<std::size_t(const WorkspacePlan&)> prepare_bytes;
  /// The backend's memory is host memory (the CPU backend): its buffers count against the host budget too.
  bool host_memory = false;
  /// Device units may be placed automatically (a GPU backend, and no user stage reads landed gradients).
  bool auto_device_units = false;
};

/// Bytes of host memory a plan may use in all: the store and the trainer's own buffers.
struct HostBudget {
  std::size_t bytes = 0;
  /// Where that figure came from, for messages ("--host-memory", "MEGATRAIN_HOST_MEMORY", "free memory").
  std::string source = "available host memory";
};

/// Bytes a HostBuffer of `bytes` maps (whole pages).
inline std::size_t host_pages(std::size_t bytes) {
  const std::size_t p = host_page_size();
  return (bytes + p - 1) / p * p;
}

/// What the store must provide for `options`: resident gradients or a ring of host landing slots
/// (the embedding's and the head's gradients land in pieces, so a slot holds a decoder block);
/// sharded (TrainerOptions::sharded()), the part this process keeps, with the masters too where
/// the trainer streams bf16 weights (`bf16_weights`: it then never reads the masters of another
/// process's part, but for the embedding's, kept whole for its fp32 lookup).
inline StoreOptions store_options(const TrainerOptions& options, StoreOptions base = {}, bool bf16_weights = false) {
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

/// Whether each process keeps on its GPU only its part of a block's gradient once it is summed over
/// the processes (ZeRO-1 with the gradients waiting on the device and one pass a step): the
/// block's whole gradient is made in one buffer shared by the blocks, reduce-scattered, and this
/// process's part of the sum kept, so that the gradients waiting for the norm take 1/N of the
/// GPU memory. With micro-batches each block's whole gradient adds up over them (kept whole).
inline bool keeps_gradient_parts(const TrainerOptions& o) {
  return o.sharded() && o.resident_gradients() && o.gradient_home == GradientHome::device && o.micro_batches == 1;
}

/// Tokens per block of a decoder block's token-wise work for a chunk of `chunk_tokens` tokens
/// (TrainerOptions::token_chunk; 0: 16,384 once a chunk holds more than 32,768 tokens).
inline std::int64_t token_block(const TrainerOptions& opt, std::int64_t chunk_tokens) {
  if (opt.token_chunk > 0) return opt.token_chunk;
  return chunk_tokens > 32768 ? 16384 : 0;
}

/// Sequences per compute chunk (TrainerOptions::chunk_rows; 0: a whole micro-batch).
inline std::int64_t chunk_rows(const TrainerOptions& opt) {
  return opt.chunk_rows > 0 ? std::min(opt.chunk_rows, opt.micro_rows()) : opt.micro_rows();
}

/// The element sizes of a backend, which is all a plan needs of its types.
struct ElementSizes {
  std::size_t weight = 0, act = 0, acc = 0, res = 0;
  bool split_gains = false;  ///< norm gains kept at full precision beside bf16 weights (fp32 buffers)
  template <class B>
  static ElementSizes of() {
    using W = typename B::Weight;
    return {sizeof(W), sizeof(typename B::Act), sizeof(typename B::Acc), sizeof(typename B::Res),
            !std::is_same_v<full_t<W>, W>};
  }
};

/// Sizes of every buffer the trainer allocates, in elements of the type named (or in bytes where
/// the name says so); Trainer::allocate() allocates exactly these.
struct TrainerBuffers {
  ElementSizes sizes;
  std::size_t units = 0;                ///< embedding, L blocks, head
  std::int64_t chunk_rows = 0;          ///< sequences per compute chunk
  std::int64_t token_block = 0;         ///< ChunkShape::token_block of a chunk
  std::size_t micro_tokens = 0;         ///< tokens of a micro-batch
  std::size_t batch_tokens = 0;         ///< tokens of a step's batch
  /// A mixture of experts' routing statistics (RouterStats): micro-batches x sparse layers x
  /// experts, each a count (int64) and a sum of probabilities (double), in backend and host memory.
  std::size_t router = 0;
  /// A mixture of experts' routing statistics and auxiliary loss: which tokens count (uint8), a
  /// micro-batch's in backend memory and the batch's in host memory.
  bool token_mask = false;
  // backend memory
  std::size_t weight_slots = 0, block_slot = 0;  ///< ring of block weight slots (Weight), each the largest block
  std::vector<std::size_t> block_acc;   ///< by unit: a block's own gradient accumulator (Acc; 0: none)
  /// Elements of the one buffer where a block's whole gradient is made before its sum's part is
  /// kept (keeps_gradient_parts; 0: none).
  std::size_t grad_whole = 0;
  std::size_t grad_slots = 0;           ///< ring of block_slot accumulators (Acc), when blocks have none of their own
  std::vector<std::size_t> gains;       ///< by unit: full-precision norm gains (fp32), where split_gains
  std::size_t embed_slot = 0, head_slot = 0;  ///< Weight
  std::size_t master_staging = 0;       ///< fp32: a unit's masters on their way to bf16 (no bf16 copy in host memory)
  std::size_t embed_acc = 0, head_acc = 0;    ///< Acc (embed_acc 0: none)
  std::size_t rows_acc = 0, touched = 0, compact_ids = 0;  ///< streamed: Acc, int32, int32
  std::size_t act = 0;                  ///< Res elements of one micro-batch's residual stream (dbuf x2, checkpoints)
  std::size_t scratch_bytes = 0;        ///< the chunk arena: the largest op's scratch
  bool packed = false;                  ///< positions and sequence starts (int32) are kept too
  WorkspacePlan workspace;              ///< what the backend's prepare() is asked to fit
  std::size_t prepare_bytes = 0;        ///< ... and what it adds
  std::size_t embed_rows = 0;           ///< fp32 rows of a host embedding's lookup (0: a device embedding)
  bool embed_rows_first = false;        ///< allocated before the checkpoints (no device units asked for)
  std::size_t blocks = 0;               ///< L
  std::size_t checkpoint_every = 1;     ///< k: unit outputs kept for the backward (TrainerOptions::checkpoint_every)
  std::size_t checkpoints = 0;          ///< activation checkpoints kept: L + 1, or every k-th below L
  std::size_t checkpoints_on_device = 0;  ///< the rest in host memory, through two staging buffers
  std::size_t recompute_buffers = 0;    ///< k - 1 device buffers for the outputs between checkpoints
  std::size_t kept_blocks = 0;           ///< the last N blocks keep their activations (no recompute)
  std::vector<std::size_t> kept_bytes;  ///< by unit: bytes of a kept or spilled block's activations for a micro-batch (0: none)
  std::size_t spilled_blocks = 0;       ///< blocks (among those not kept) whose activations spill to host memory
  std::size_t spill_slot_bytes = 0;     ///< each of the two device staging buffers of spilled activations
  /// One backend buffer (the pool) holds the blocks' own gradient accumulators (block_acc) and the
  /// kept activations, at these byte offsets by unit (lay_out_pool()). Where the gradients wait on
  /// the device for one pass a step, a kept block's activations lie over the gradients of blocks
  /// below it: those are updated before its forward and made again only after its backward.
  std::vector<std::size_t> acc_at, kept_at;
  std::size_t pool_grad_bytes = 0;      ///< the pool's first part: the accumulators, each Arena-aligned (256 bytes)
  std::size_t pool_bytes = 0;           ///< the whole pool: the kept activations not lying over gradients after them
  std::size_t kept_over_gradients = 0;  ///< kept blocks whose activations lie over waiting gradients
  /// The embedding's gradient (embed_acc) is the pool's first part, below every block's: an
  /// untied model's, made by the backward's last item and updated before the next forward's first.
  bool embed_acc_in_pool = false;
  std::size_t device_units = 0;
  std::vector<std::size_t> device_unit_bytes;  ///< by unit, for each device unit: state, own weights and accumulator
  // host memory (pinned where a GPU is present)
  std::size_t staging = 0;              ///< elements of one of two fp32 landing slots (micro-batches added on the host)

  std::size_t checkpoints_in_host() const { return checkpoints - checkpoints_on_device; }
  /// Whether unit u's output (u in [0, L]) is an activation checkpoint: all of them with k = 1;
  /// else every k-th below L (the last block's output, read only by the head right after it, and
  /// the others live in the recompute buffers).
  bool kept(std::size_t u) const { return checkpoint_every == 1 || (u % checkpoint_every == 0 && u < blocks); }
  /// Among the checkpoints, which one unit u's output is (kept(u)).
  std::size_t checkpoint_index(std::size_t u) const { return u / checkpoint_every; }
  /// The recompute buffer of unit u's output when it is not kept and u < L.
  std::size_t recompute_buffer(std::size_t u) const { return u % checkpoint_every - 1; }
  std::size_t checkpoint_bytes() const { return act * sizes.res; }
  /// Whether unit u is a block that keeps its activations from forward to backward.
  bool keeps(std::size_t u) const { return u >= 1 && u <= blocks && u + kept_blocks > blocks; }
  /// The spilled blocks are spread over those that do not keep their activations: every
  /// spill_stride()-th from the first, so that each one's copies have the time of several blocks.
  std::size_t spill_stride() const {
    return spilled_blocks == 0 ? 1 : std::max<std::size_t>(1, (blocks - std::min(kept_blocks, blocks)) / spilled_blocks);
  }
  /// Whether unit u is a block that spills its activations to host memory from forward to backward.
  bool spills(std::size_t u) const {
    if (spilled_blocks == 0 || u < 1 || u > blocks || keeps(u)) return false;
    return (u - 1) % spill_stride() == 0 && (u - 1) / spill_stride() < spilled_blocks;
  }
  /// Spilled unit u's place among the spilled blocks (0: the lowest); its staging buffer is this % 2.
  std::size_t spill_index(std::size_t u) const { return (u - 1) / spill_stride(); }
  /// Pinned host bytes of the spilled activations (each block's in its own buffer).
  std::size_t spilled_host_bytes() const {
    std::size_t n = 0;
    for (std::size_t u = 1; u <= blocks; ++u)
      if (spills(u)) n += host_pages(kept_bytes[u]);
    return n;
  }
  /// Bytes of kept activations beyond the gradients (what keeping costs).
  std::size_t kept_extra_bytes() const { return pool_bytes - pool_grad_bytes; }
  /// Bytes of the pool the embedding's gradient takes (0: it has its own buffer, or none).
  std::size_t pool_embed_bytes() const { return embed_acc_in_pool ? acc_at[1] - acc_at[0] : 0; }

  /// Lays out the pool: the accumulators in unit order, then each kept block's activations, in
  /// unit order, over the accumulators of the blocks below it where `over_gradients` and they end
  /// before its own accumulator, else after the accumulators. Why that is safe, for gradients
  /// waiting on the device (exact clipping) with one pass a step: block b's gradient is live from
  /// its backward until its update, which comes before its next forward (the prefetch of its
  /// weights waits for the update; a device unit's update precedes it on the compute stream);
  /// kept block j's activations are live from its forward to its backward. For b < j the
  /// gradient's update precedes j's forward (b's forward comes first), and it is made again at
  /// b's backward, after j's. With several passes a step a gradient adds up over all of them.
  void lay_out_pool(bool over_gradients) {
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
};

/// Whether a block op can keep its activations on a backend of element types B (KeepingLayerOp).
template <class B, class Op>
inline constexpr bool keeps_activations = requires(const Op& op, Arena& a, ChunkShape c) { op.template reserve_kept<B>(a, c); };

/// One line of a plan's memory.
struct MemoryLine {
  std::string what;
  std::size_t bytes = 0;
};

/// The memory of one configuration: the buffers, the lines they add up to, and whether it fits.
struct MemoryPlan {
  TrainerBuffers buffers;
  std::vector<MemoryLine> device;  ///< backend memory the trainer allocates (the backend's own not included)
  std::vector<MemoryLine> host;    ///< the store, then the trainer's host buffers
  std::size_t device_before = 0;   ///< backend memory already held (DeviceBudget::allocated)
  std::optional<std::size_t> device_cap;
  std::size_t host_budget = 0;
  std::string host_budget_source;
  bool host_lines_include_device = false;  ///< the backend's memory is host memory (the CPU backend)
  bool fits = true;
  std::string refusal;  ///< why not, in a sentence or two, when !fits
  bool fixed_too_large = false;  ///< the step's buffers besides the checkpoints do not fit (fewer checkpoints cannot help)

  std::size_t device_total() const { return sum(device); }  ///< the trainer's backend memory
  std::size_t host_total() const { return sum(host); }
  /// Bytes of the store alone (its lines come first).
  std::size_t store_bytes = 0;

 private:
  static std::size_t sum(const std::vector<MemoryLine>& v) {
    std::size_t s = 0;
    for (const auto& l : v) s += l.bytes;
    return s;
  }
};

namespace detail {
/// What the activation checkpoints leave of `avail` bytes of device memory, for what the
/// backend's libraries allocate on their own (1/32), and what automatic device units leave (the
/// same, at least 1 GiB: the host embedding's rows come after them).
inline std::size_t checkpoint_reserve(std::size_t avail) { return avail / 32; }
inline std::size_t units_reserve(std::size_t avail) { return std::max<std::size_t>(std::size_t{1} << 30, avail / 32); }
/// Device unit u's backend bytes: fp32 master, m and v (of this process's part where the optimizer
/// is sharded over `shards` processes); an accumulator of its own where it would otherwise share a
/// ring or land in pieces (a block's weights are made in the ring's slots from its masters).
inline std::size_t device_unit_bytes(const TrainerBuffers& b, std::size_t u, std::size_t numel, bool grads_on_device,
                                     int shards = 1) {
  const auto cut = HostParamStore<float>::shard_bounds(static_cast<std::int64_t>(numel), shards);
  std::size_t n = (numel + 2 * static_cast<std::size_t>(cut[1] - cut[0])) * sizeof(float);  // (part 0: the largest)
  const bool block = u != 0 && u + 1 != b.units;
  if (block && !grads_on_device) n += numel * b.sizes.acc;
  if (u == 0 && b.embed_acc == 0) n += numel * b.sizes.acc;
  return n;
}
}  // namespace detail

namespace detail {
/// plan_memory with checkpoints every `every` blocks, the last `kept` blocks keeping their
/// activations and `spilled` of the others spilling them to host memory (0 unless every is 1 and
/// the block op can).
template <class B, class Block>
MemoryPlan plan_memory_every(const DecoderModel<Block>& model, const TrainerOptions& options, std::size_t every,
                             std::size_t kept, std::size_t spilled, const DeviceBudget& device, const HostBudget& host,
                             const std::optional<StoreFootprint>& store_footprint) {
  const TrainerOptions opt = options.resolved();
  opt.validate();
  const ModelConfig& cfg = model.config();
  const std::size_t L = model.num_blocks();
  MemoryPlan plan;
  TrainerBuffers& b = plan.buffers;
  b.sizes = ElementSizes::of<B>();
  b.units = model.num_units();
  const bool streamed = !opt.resident_gradients();
  const bool grads_on_device = opt.resident_gradients() && opt.gradient_home == GradientHome::device;
  const bool grads_on_host = opt.resident_gradients() && opt.gradient_home == GradientHome::host;
  const bool tied = model.head().op().tied();
  const auto hidden = static_cast<std::size_t>(cfg.hidden_size);
  const auto vocab = static_cast<std::size_t>(cfg.vocab_size);

  b.micro_tokens = static_cast<std::size_t>(opt.micro_rows() * opt.seq_len);
  b.batch_tokens = static_cast<std::size_t>(opt.batch_rows * opt.seq_len);
  b.router = static_cast<std::size_t>(opt.micro_batches * cfg.moe_layer_count() * cfg.moe.num_experts);
  b.token_mask = b.router > 0;
  b.chunk_rows = chunk_rows(opt);
  b.token_block = token_block(opt, b.chunk_rows * opt.seq_len);
  const ChunkShape chunk{b.chunk_rows, opt.seq_len, {}, b.token_block};

  // 1. the fixed buffers
  for (std::size_t l = 0; l < L; ++l) b.block_slot = std::max(b.block_slot, static_cast<std::size_t>(model.block(l).layout().numel()));
  b.weight_slots = opt.weight_slots;
  b.block_acc.assign(b.units, 0);
  const bool parts = keeps_gradient_parts(opt);
  if (grads_on_device) {
    for (std::size_t l = 0; l < L; ++l) {
      const std::int64_t n = model.block(l).layout().numel();
      // (parts: this process's part of the sum, as the store cuts the unit)
      const auto cut = HostParamStore<float>::shard_bounds(n, parts ? opt.comm->world() : 1);
      const auto r = static_cast<std::size_t>(parts ? opt.comm->rank() : 0);
      b.block_acc[l + 1] = static_cast<std::size_t>(cut[r + 1] - cut[r]);
    }
    if (parts) b.grad_whole = b.block_slot;
  } else {
    b.grad_slots = opt.grad_slots;
  }
  b.gains.assign(b.units, 0);
  if (b.sizes.split_gains) {
    b.gains[0] = static_cast<std::size_t>(model.embedding().full_layout().numel());
    for (std::size_t l = 0; l < L; ++l) b.gains[l + 1] = static_cast<std::size_t>(model.block(l).full_layout().numel());
    b.gains[L + 1] = static_cast<std::size_t>(model.head().full_layout().numel());
  }
  b.embed_slot = static_cast<std::size_t>(model.embedding().layout().numel());
  b.head_slot = static_cast<std::size_t>(model.head().layout().numel());
  if (b.sizes.weight < sizeof(float) && !opt.host_bf16_copy)
    b.master_staging = std::min(kMasterStagingElements, std::max({b.block_slot, b.embed_slot, b.head_slot}));
  if (!streamed || tied) b.embed_acc = b.embed_slot;
  const std::size_t max_rows = std::min(vocab, b.batch_tokens);
  if (streamed) {
    b.rows_acc = max_rows * hidden;
    b.touched = max_rows;
    b.compact_ids = b.micro_tokens;
  }
  b.head_acc = b.head_slot;
  b.act = b.micro_tokens * hidden;
  b.blocks = L;
  b.checkpoint_every = std::max<std::size_t>(every, 1);
  if constexpr (keeps_activations<B, Block>) {
    b.kept_blocks = b.checkpoint_every == 1 ? std::min(kept, L) : 0;
    b.spilled_blocks = b.checkpoint_every == 1 ? std::min(spilled, L - b.kept_blocks) : 0;
  }
  b.kept_bytes.assign(b.units, 0);
  b.scratch_bytes = model.head().op().template scratch_bytes<B>(chunk);
  for (std::size_t l = 0; l < L; ++l) {
    const auto& op = model.block(l).op();
    std::size_t scratch = 0;
    if constexpr (keeps_activations<B, Block>) {
      if (b.keeps(l + 1) || b.spills(l + 1)) {  // the chunks of a micro-batch one after another, as the trainer carves them
        Arena measure;
        for (std::int64_t r0 = 0; r0 < opt.micro_rows(); r0 += b.chunk_rows)
          op.template reserve_kept<B>(measure, ChunkShape{std::min(b.chunk_rows, opt.micro_rows() - r0), opt.seq_len, {}, b.token_block});
        b.kept_bytes[l + 1] = measure.peak();
        scratch = op.template kept_scratch_bytes<B>(chunk);
      }
    }
    if (!b.keeps(l + 1) && !b.spills(l + 1)) scratch = op.template scratch_bytes<B>(chunk);
    b.scratch_bytes = std::max(b.scratch_bytes, scratch);
  }
  b.packed = opt.packed;
  b.workspace.max_tokens = chunk.tokens();
  b.workspace.max_width = std::max({cfg.hidden_size, cfg.intermediate_size, cfg.q_dim(), cfg.kv_dim()});
  b.workspace.vocab = cfg.vocab_size;
  b.workspace.packed = opt.packed;
  for (std::int64_t r : {b.chunk_rows, opt.micro_rows() % b.chunk_rows})
    if (r > 0) {  // (every layer's attention: full, and Gemma 3's sliding layers' window)
      const double scale = cfg.query_pre_attn_scalar ? cfg.attention_scale() : 0.0;
      b.workspace.attention.push_back(
          {r, opt.seq_len, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, {}, scale, 0});
      if (!cfg.sliding_layers.empty() && cfg.sliding_window)
        b.workspace.attention.push_back(
            {r, opt.seq_len, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, {}, scale, *cfg.sliding_window});
    }
  b.prepare_bytes = device.prepare_bytes ? device.prepare_bytes(b.workspace) : 0;
  b.checkpoints = b.checkpoint_every == 1 ? L + 1 : (L - 1) / b.checkpoint_every + 1;
  b.recompute_buffers = b.checkpoint_every - 1;

  const auto& sz = b.sizes;
  std::vector<MemoryLine>& dev = plan.device;
  const bool over_gradients = grads_on_device && opt.micro_batches == 1;
  b.embed_acc_in_pool = over_gradients && b.kept_blocks > 0 && !tied && b.embed_acc > 0;
  b.lay_out_pool(over_gradients);
  const std::size_t block_accs_bytes =
      (b.grad_slots * b.block_slot + b.grad_whole) * sz.acc + b.pool_grad_bytes - b.pool_embed_bytes();
  std::size_t gains = 0;
  for (std::size_t n : b.gains) gains += n * sizeof(float);
  dev.push_back({fmt::format("block weights ({} slots)", b.weight_slots), b.weight_slots * b.block_slot * sz.weight});
  dev.push_back({!grads_on_device ? fmt::format("block gradients ({} slots)", b.grad_slots)
                 : parts ? fmt::format("block gradients (this process's 1/{} of each, waiting for the norm; one whole as it "
                                       "is made)", opt.comm->world())
                         : std::string("block gradients (waiting for the norm)"),
                 block_accs_bytes});
  if (gains > 0) dev.push_back({"norm gains (fp32)", gains});
  dev.push_back({"embedding and head weights", (b.embed_slot + b.head_slot) * sz.weight});
  const std::size_t staging_line = dev.size();  // (given back below where nothing streams)
  if (b.master_staging > 0)
    dev.push_back({"staging of the fp32 masters, rounded to bf16 here (no bf16 copy in host memory)", b.master_staging * sizeof(float)});
  dev.push_back({"embedding and head gradients", (b.embed_acc_in_pool ? b.pool_embed_bytes() : b.embed_acc * sz.acc) +
                                                     (b.head_acc + b.rows_acc) * sz.acc + (b.touched + b.compact_ids) * 4});
  dev.push_back({"activation gradients (2 x a micro-batch)", 2 * b.act * sz.res});
  dev.push_back({fmt::format("scratch of a chunk ({} x {} tokens{})", b.chunk_rows, opt.seq_len,
                             b.token_block > 0 && b.token_block < chunk.tokens() ? fmt::format(", blocks of {}", b.token_block) : ""),
                 b.scratch_bytes});
  dev.push_back({"token ids, labels, losses", b.micro_tokens * (2 * 4 + sz.acc) + (opt.packed ? (2 * b.micro_tokens + 1) * 4 : 0) +
                                                  b.units * sizeof(double)});
  if (b.router > 0)
    dev.push_back({"routing statistics (tokens per expert)", b.router * 16 + (b.token_mask ? b.micro_tokens : 0)});
  if (b.prepare_bytes > 0) dev.push_back({"backend workspaces (attention, logits of a block)", b.prepare_bytes});
  if (b.recompute_buffers > 0)
    dev.push_back({fmt::format("outputs recomputed between checkpoints ({} buffers: a checkpoint every {} blocks)",
                               b.recompute_buffers, b.checkpoint_every),
                   b.recompute_buffers * b.act * sz.res});
  const auto embed_rows_bytes = [&] {
    return max_rows * hidden * sizeof(float) + (b.compact_ids == 0 ? b.micro_tokens * 4 : 0);
  };
  b.embed_rows_first = opt.device_units == 0;
  if (b.embed_rows_first) {
    b.embed_rows = max_rows * hidden;
    dev.push_back({"embedding rows of the batch (fp32)", embed_rows_bytes()});
  }
  plan.device_before = device.allocated;
  plan.device_cap = device.cap;
  const auto left = [&]() -> std::optional<std::size_t> {  // what the backend can still hand out
    if (!device.cap) return std::nullopt;
    const std::size_t used = device.allocated + plan.device_total();
    return *device.cap > used ? *device.cap - used : 0;
  };
  const auto refuse = [&](std::string why) {
    if (plan.fits) plan.refusal = std::move(why);
    plan.fits = false;
  };
  if (device.cap && device.allocated + plan.device_total() > *device.cap) {
    refuse(fmt::format("the step's buffers need {} of GPU memory beside the {} the backend holds, more than the cap of {}",
                       format_bytes(plan.device_total()), format_bytes(device.allocated), format_bytes(*device.cap)));
    plan.fixed_too_large = true;
  }

  // 2. the activation checkpoints
  const std::size_t ckpt = b.checkpoint_bytes();
  std::size_t fit = b.checkpoints;
  // (room is kept for a host embedding's rows, which come after the device units when none was
  // asked for: auto placement decides whether the embedding is a device unit)
  const bool rows_late = !b.embed_rows_first && opt.device_units == TrainerOptions::kAutoDeviceUnits;
  if (auto avail = left(); avail && plan.fits) {
    *avail -= std::min(*avail, rows_late ? embed_rows_bytes() : 0);
    const std::size_t usable = *avail - detail::checkpoint_reserve(*avail);
    fit = std::min(b.checkpoints, usable / std::max<std::size_t>(ckpt, 1));
    if (fit < b.checkpoints) fit = usable >= 2 * ckpt ? std::min(b.checkpoints, usable / ckpt - 2) : 0;
    if (fit < b.checkpoints && usable < 2 * ckpt)
      refuse(fmt::format("the activation checkpoints ({} each, {} of them) do not fit: even the two staging buffers that "
                         "bring them from host memory need {}, and {} of GPU memory is left beside the step's other buffers",
                         format_bytes(ckpt), b.checkpoints, format_bytes(2 * ckpt), format_bytes(usable)));
  }
  b.checkpoints_on_device = fit;
  dev.push_back({fmt::format("activation checkpoints on the GPU ({} of {})", fit, b.checkpoints), fit * ckpt});
  if (fit < b.checkpoints) dev.push_back({"checkpoint staging buffers (2)", 2 * ckpt});

  // 3. kept activations
  if (b.kept_blocks > 0) {
    const std::size_t need = b.kept_extra_bytes();
    // (chosen by the plan: beside the same reserve as the checkpoints, for the libraries' own)
    const auto avail = left();
    const bool chosen = options.kept_blocks == TrainerOptions::kAutoKeptBlocks;
    dev.push_back({fmt::format("activations kept for the backward ({} of {} blocks: no recompute{})", b.kept_blocks, L,
                               b.kept_over_gradients == 0
                                   ? std::string()
                                   : fmt::format("; {} of them over the gradients of blocks below, updated by then",
                                                 b.kept_over_gradients)),
                   need});
    if (device.cap && plan.fits && (need > *avail || (chosen && need > *avail - detail::checkpoint_reserve(*avail))))
      refuse(fmt::format("the activations of {} blocks kept for the backward need {} of GPU memory, more than is left beside "
                         "the step's other buffers; keep fewer (megatrain-train --keep-activations N, or auto)",
                         b.kept_blocks, format_bytes(need)));
  }

  // 3b. spilled activations: two device staging buffers (and pinned host memory, below)
  if (b.spilled_blocks > 0) {
    for (std::size_t u = 1; u <= L; ++u)
      if (b.spills(u)) b.spill_slot_bytes = std::max(b.spill_slot_bytes, b.kept_bytes[u]);
    const std::size_t need = 2 * b.spill_slot_bytes;
    const auto avail = left();
    const bool chosen = options.spilled_blocks == TrainerOptions::kAutoSpilledBlocks;
    dev.push_back({fmt::format("staging of the activations spilled to host memory (2 x a block's; {} of {} blocks spill, every "
                               "{} from the first)",
                               b.spilled_blocks, L, b.spill_stride()),
                   need});
    if (device.cap && plan.fits && (need > *avail || (chosen && need > *avail - detail::checkpoint_reserve(*avail))))
      refuse(fmt::format("the staging buffers of the activations {} blocks spill to host memory need {} of GPU memory, more "
                         "than is left beside the step's other buffers; spill none (megatrain-train --spill-activations 0, "
                         "or auto)",
                         b.spilled_blocks, format_bytes(need)));
  }

  // 4. device units
  const std::size_t units = b.units;
  std::vector<std::size_t> unit_numel(units);
  unit_numel[0] = b.embed_slot;
  for (std::size_t l = 0; l < L; ++l) unit_numel[l + 1] = static_cast<std::size_t>(model.block(l).layout().numel());
  unit_numel[L + 1] = b.head_slot;
  const int shards = opt.sharded() ? opt.comm->world() : 1;
  const auto unit_bytes = [&](std::size_t u) {
    return detail::device_unit_bytes(b, u, unit_numel[u], grads_on_device, shards);
  };
  std::size_t count = 0;
  if (opt.device_units != TrainerOptions::kAutoDeviceUnits) {
    count = static_cast<std::size_t>(opt.device_units);
    MT_CHECK(count <= units, "device_units {} is more than the model's {} units", count, units);
    std::size_t need = 0;
    for (std::size_t u = 0; u < count; ++u) need += unit_bytes(u);
    if (const auto avail = left(); avail && need > *avail)
      refuse(fmt::format("{} device units need {} of GPU memory for their AdamW state, and {} is left after the trainer's "
                         "buffers; ask for fewer (megatrain-train --device-units N, or auto)",
                         count, format_bytes(need), format_bytes(*avail)));
  } else if (device.auto_device_units && fit == b.checkpoints) {  // (checkpoints in host memory come first)
    if (const auto avail = left()) {
      std::size_t used = 0;
      while (count < units && used + unit_bytes(count) + detail::units_reserve(*avail) <= *avail) used += unit_bytes(count++);
    }
  }
  b.device_units = count;
  if (b.master_staging > 0 && count >= units) {  // (every unit's weights made on the GPU: nothing streams)
    dev.erase(dev.begin() + static_cast<std::ptrdiff_t>(staging_line));
    b.master_staging = 0;
  }
  std::size_t unit_state = 0;
  for (std::size_t u = 0; u < count; ++u) {
    b.device_unit_bytes.push_back(unit_bytes(u));
    unit_state += b.device_unit_bytes.back();
  }
  if (count > 0) {
    std::int64_t params = 0;
    for (std::size_t u = 0; u < count; ++u) params += static_cast<std::int64_t>(unit_numel[u]);
    dev.push_back({fmt::format("AdamW state on the GPU ({} of {} units, {:.3f}B elements)", count, units, static_cast<double>(params) / 1e9),
                   unit_state});
  }

  // 5. a host embedding's fp32 rows, when not allocated first
  if (count == 0 && !b.embed_rows_first) {
    b.embed_rows = max_rows * hidden;
    dev.push_back({"embedding rows of the batch (fp32)", embed_rows_bytes()});
  }
  if (device.cap && plan.fits && device.allocated + plan.device_total() > *device.cap)
    refuse(fmt::format("the step needs {} of GPU memory beside the {} the backend holds, more than the cap of {}",
                       format_bytes(plan.device_total()), format_bytes(device.allocated), format_bytes(*device.cap)));

  // Host memory: the store, then the trainer's buffers.
  const StoreFootprint store =
      store_footprint ? *store_footprint
                      : HostParamStore<float>::footprint(model.units(),
                                                         store_options(opt, {}, std::is_same_v<typename B::Weight, bf16>));
  std::vector<MemoryLine>& hl = plan.host;
  hl.push_back({"fp32 master weights", store.master_bytes});
  hl.push_back({"AdamW m and v (fp32)", store.adam_bytes});
  const StoreShard shard = store_options(opt, {}, std::is_same_v<typename B::Weight, bf16>).shard;
  if (opt.host_bf16_copy)
    hl.push_back({shard.shares_weights()
                    ? fmt::format("bf16 weights (what crosses PCIe; 1/{} of the copy this host's processes share)", shard.count)
                : shard.keeps_weight_parts()
                    ? fmt::format("bf16 weights (this process's 1/{}: what it uploads; the GPUs gather the rest)", shard.count)
                    : std::string("bf16 weights (what crosses PCIe)"),
                store.compute_bytes});
  if (store.resident_grad_bytes > 0) hl.push_back({"gradients waiting for the norm (fp32)", store.resident_grad_bytes});
  if (store.grad_ring_bytes > 0) hl.push_back({"gradient landing slots", store.grad_ring_bytes});
  plan.store_bytes = store.total_bytes();
  if (opt.micro_batches > 1 && grads_on_host) b.staging = static_cast<std::size_t>(store.largest_unit);
  std::size_t io = host_pages(b.batch_tokens * (4 * 4 + sz.acc)) + host_pages(b.units * sizeof(double));
  if (opt.packed) io += host_pages((2 * b.batch_tokens + 1) * 4);
  if (b.router > 0) io += host_pages(b.router * 16);
  if (b.token_mask) io += host_pages(b.batch_tokens);
  if (b.embed_rows > 0) io += host_pages(b.embed_rows * sizeof(float));
  if (b.staging > 0) io += host_pages(2 * b.staging * sizeof(float));
  hl.push_back({"batch buffers (pinned)", io});
  if (b.checkpoints_in_host() > 0)
    hl.push_back({fmt::format("activation checkpoints in host memory ({} of {}, pinned)", b.checkpoints_in_host(), b.checkpoints),
                  b.checkpoints_in_host() * host_pages(ckpt)});
  if (b.spilled_blocks > 0)
    hl.push_back({fmt::format("activations spilled to host memory ({} blocks, pinned)", b.spilled_blocks), b.spilled_host_bytes()});
  plan.host_lines_include_device = device.host_memory;
  if (device.host_memory) hl.push_back({"backend buffers (host memory on this backend)", plan.device_total()});
  plan.host_budget = host.bytes;
  plan.host_budget_source = host.source;
  if (plan.host_total() > host.bytes)
    refuse(fmt::format("host memory: the model's state needs {} and the trainer's buffers {}{}, {} in all, more than the {} "
                       "available ({})",
                       format_bytes(plan.store_bytes), format_bytes(plan.host_total() - plan.store_bytes),
                       b.checkpoints_in_host() > 0
                           ? fmt::format(" ({} of them activation checkpoints that do not fit on the GPU)",
                                         format_bytes(b.checkpoints_in_host() * host_pages(ckpt)))
                       : b.spilled_blocks > 0
                           ? fmt::format(" ({} of them the activations of {} blocks spilled to host memory; spill fewer: "
                                         "megatrain-train --spill-activations N, or auto)",
                                         format_bytes(b.spilled_host_bytes()), b.spilled_blocks)
                           : std::string(),
                       format_bytes(plan.host_total()), format_bytes(host.bytes), host.source));
  return plan;
}
}  // namespace detail

}  // namespace megatrain::plan
