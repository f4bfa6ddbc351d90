// The memory plan of the streaming trainer: every buffer it allocates for a configuration, in
// backend (GPU) memory and in host memory, and the decisions that depend on what fits.
//
// One function, plan_memory(), decides; the Trainer allocates what it says (Trainer::allocate
// follows TrainerBuffers field by field), and the programs call it before anything is allocated
// to refuse a configuration that cannot fit, saying why and what would (plan/planner.hpp). So the
// plan is not an estimate of the trainer's memory: it is the trainer's memory. Backends count
// what they hand out (CudaBackend::allocated_bytes, CpuBackend::allocated_bytes) and the tests
// compare the two. Of the model's ops on the backend the plan needs only their sizes (OpSizes,
// measured once); the decisions below are made from them by code compiled once
// (src/plan/memory_plan.cpp, a phase each).
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
std::size_t host_pages(std::size_t bytes);

/// What the store must provide for `options`: resident gradients or a ring of host landing slots
/// (the embedding's and the head's gradients land in pieces, so a slot holds a decoder block);
/// sharded (TrainerOptions::sharded()), the part this process keeps, with the masters too where
/// the trainer streams bf16 weights (`bf16_weights`: it then never reads the masters of another
/// process's part, but for the embedding's, kept whole for its fp32 lookup).
StoreOptions store_options(const TrainerOptions& options, StoreOptions base = {}, bool bf16_weights = false);

/// Whether each process keeps on its GPU only its part of a block's gradient once it is summed over
/// the processes (ZeRO-1 with the gradients waiting on the device and one pass a step): the
/// block's whole gradient is made in one buffer shared by the blocks, reduce-scattered, and this
/// process's part of the sum kept, so that the gradients waiting for the norm take 1/N of the
/// GPU memory. With micro-batches each block's whole gradient adds up over them (kept whole).
bool keeps_gradient_parts(const TrainerOptions& o);

/// Tokens per block of a decoder block's token-wise work for a chunk of `chunk_tokens` tokens
/// (TrainerOptions::token_chunk; 0: 16,384 once a chunk holds more than 32,768 tokens).
std::int64_t token_block(const TrainerOptions& opt, std::int64_t chunk_tokens);

/// Sequences per compute chunk (TrainerOptions::chunk_rows; 0: a whole micro-batch).
std::int64_t chunk_rows(const TrainerOptions& opt);

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
  bool token_weights = false;  // a weight per token beside the labels (TrainerOptions::token_weights)
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
  void lay_out_pool(bool over_gradients);
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
std::size_t device_unit_bytes(const TrainerBuffers& b, std::size_t u, std::size_t numel, bool grads_on_device,
                              int shards = 1);
}  // namespace detail

/// What a memory plan needs of a model's ops on a backend of element types B, measured once
/// (detail::measure_ops): the plan itself is arithmetic on these figures, compiled once
/// (detail::plan_memory_every, src/plan/memory_plan.cpp).
struct OpSizes {
  ElementSizes sizes;         ///< ElementSizes::of<B>()
  bool keeps = false;         ///< the blocks can keep their activations on B (keeps_activations)
  bool bf16_weights = false;  ///< B's weights are bf16 (store_options' `bf16_weights`)
  bool tied = false;          ///< the head's product reads the embedding's table
  std::size_t embed_numel = 0, embed_full_numel = 0;  ///< elements of the embedding's layout and full_layout
  std::size_t head_numel = 0, head_full_numel = 0;    ///< ... and of the head's
  std::size_t head_scratch = 0;                       ///< the head's scratch of a chunk
  /// A decoder block's figures.
  struct Block {
    std::size_t numel = 0, full_numel = 0;  ///< elements of its layout and full_layout
    std::size_t scratch = 0;       ///< its scratch of a chunk, recomputing from a checkpoint
    std::size_t kept_scratch = 0;  ///< ... keeping its activations (0 where it cannot)
    /// Bytes of its activations kept over a micro-batch's chunks, one after another as the trainer
    /// carves them (0 where it cannot keep them).
    std::size_t kept = 0;
  };
  std::vector<Block> blocks;  ///< by block, 0-based (unit l + 1)
  StoreFootprint store;       ///< the footprint of the store the plan counts in host memory
};

namespace detail {
/// The figures of `model`'s ops on a backend of element types B for a plan of `options`
/// (validated), with the store's footprint `store_footprint` (default: one built with
/// store_options(options)).
template <class B, class Block>
OpSizes measure_ops(const DecoderModel<Block>& model, const TrainerOptions& options,
                    const std::optional<StoreFootprint>& store_footprint) {
  const TrainerOptions opt = options.resolved();
  opt.validate();
  OpSizes s;
  s.sizes = ElementSizes::of<B>();
  s.keeps = keeps_activations<B, Block>;
  s.bf16_weights = std::is_same_v<typename B::Weight, bf16>;
  s.tied = model.head().op().tied();
  s.embed_numel = static_cast<std::size_t>(model.embedding().layout().numel());
  s.embed_full_numel = static_cast<std::size_t>(model.embedding().full_layout().numel());
  s.head_numel = static_cast<std::size_t>(model.head().layout().numel());
  s.head_full_numel = static_cast<std::size_t>(model.head().full_layout().numel());
  const std::int64_t rows = chunk_rows(opt), block = token_block(opt, rows * opt.seq_len);
  const ChunkShape chunk{rows, opt.seq_len, {}, block};
  s.head_scratch = model.head().op().template scratch_bytes<B>(chunk);
  s.blocks.resize(model.num_blocks());
  for (std::size_t l = 0; l < s.blocks.size(); ++l) {
    const auto& blk = model.block(l);
    OpSizes::Block& o = s.blocks[l];
    o.numel = static_cast<std::size_t>(blk.layout().numel());
    o.full_numel = static_cast<std::size_t>(blk.full_layout().numel());
    o.scratch = blk.op().template scratch_bytes<B>(chunk);
    if constexpr (keeps_activations<B, Block>) {  // the chunks of a micro-batch one after another, as the trainer carves them
      Arena measure;
      for (std::int64_t r0 = 0; r0 < opt.micro_rows(); r0 += rows)
        blk.op().template reserve_kept<B>(measure, ChunkShape{std::min(rows, opt.micro_rows() - r0), opt.seq_len, {}, block});
      o.kept = measure.peak();
      o.kept_scratch = blk.op().template kept_scratch_bytes<B>(chunk);
    }
  }
  s.store = store_footprint ? *store_footprint
                            : HostParamStore<float>::footprint(model.units(), store_options(opt, {}, s.bf16_weights));
  return s;
}

/// plan_memory of a model of `cfg` whose ops measure `ops`, with checkpoints every `every`
/// blocks, the last `kept` blocks keeping their activations and `spilled` of the others spilling
/// them to host memory (0 unless every is 1 and the block op can): the decisions of this file's
/// top comment, in order.
MemoryPlan plan_memory_every(const ModelConfig& cfg, const OpSizes& ops, const TrainerOptions& options, std::size_t every,
                             std::size_t kept, std::size_t spilled, const DeviceBudget& device, const HostBudget& host);
}  // namespace detail

}  // namespace megatrain::plan
