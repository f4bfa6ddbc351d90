// TrainerOptions: what a Trainer is asked to do, and how options are saved with a train state.
//
// Fields split in two: those that define the update (batch, sequence length, AdamW, schedule,
// clipping), which a resumed run must share with the run it continues, and those that only
// decide how the work is laid out (micro-batches, chunks, ring sizes), which may change between
// runs without changing the model's math (though micro-batches and chunks change the order of
// floating-point sums, so a resumed run is bit for bit the uninterrupted one only if they stay).
#pragma once

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "megatrain/core/error.hpp"
#include "megatrain/core/json_number.hpp"
#include "megatrain/dist/comm.hpp"
#include "megatrain/optim/adamw.hpp"
#include "megatrain/optim/lr_schedule.hpp"

namespace megatrain {

enum class ClipMode {
  exact,  ///< clip_grad_norm_ semantics: global norm of this step's gradients, then AdamW
  stale,  ///< clip with the previous step's global norm (none at step 1); no resident gradients
};

/// Where gradients wait for the global norm when they must all be kept (exact clipping, or
/// gradient accumulation over micro-batches): TrainerOptions::gradient_home.
enum class GradientHome {
  device,  ///< in backend memory: one fp32 accumulator per unit (4 bytes per parameter there)
  host,    ///< in the store's resident gradient slabs (4 more bytes per parameter of host memory)
};

/// What a step whose loss or gradient is not finite (NaN or an infinity) does. Either way the
/// weights and AdamW states are not changed by it: the whole gradient's norm is known before any
/// update (this needs TrainerOptions::resident_gradients(): exact clipping, the default).
enum class NonFinite {
  stop,  ///< Trainer::step throws, naming the step and the unit; the trainer takes no further step
  skip,  ///< the step is skipped (counted: StepStats::skipped), as mixed-precision loss scalers skip
};

struct TrainerOptions {
  /// device_units: as many units as the device has room for (see there).
  static constexpr std::int64_t kAutoDeviceUnits = -1;
  /// kept_blocks: as many as make the step fastest (see there).
  static constexpr std::int64_t kAutoKeptBlocks = -1;
  /// spilled_blocks: as many as make the step fastest (see there).
  static constexpr std::int64_t kAutoSpilledBlocks = -1;

  std::int64_t batch_rows = 8;     ///< sequences per optimizer step
  std::int64_t seq_len = 128;
  std::int64_t micro_batches = 1;  ///< gradient accumulation: the batch is run in this many parts
  /// The most sequences allowed on the device at once (0: no limit). A batch larger than this
  /// runs as gradient accumulation: micro_batches grows to the smallest count, at least the
  /// one given, that divides the batch into parts of at most this many sequences.
  std::int64_t max_micro_rows = 0;
  std::int64_t chunk_rows = 0;     ///< sequences per compute chunk (0: a whole micro-batch)
  /// Tokens per block of a decoder block's token-wise work within a chunk (norms, projections,
  /// MLP; attention always sees whole rows), which bounds their buffers at long sequence
  /// lengths. 0: 16,384 where a chunk holds more than 32,768 tokens, else the whole chunk.
  std::int64_t token_chunk = 0;
  /// Activation checkpoints every k decoder blocks (layout only: the same bits). 1: every unit's
  /// output is kept for the backward; k >= 2: only every k-th block's input, and the backward
  /// recomputes the k - 1 outputs between from it before it needs them (one more forward of
  /// those blocks; k - 1 more device buffers), for long sequences whose checkpoints do not fit.
  /// 0: 1 where the step fits, else the smallest k that makes it fit (the planner decides).
  std::int64_t checkpoint_every = 0;
  /// The last N decoder blocks keep their activations in backend memory from forward to backward,
  /// so that the backward runs none of their forward's matrix products again (layout only: the
  /// same bits; a block op that is a KeepingLayerOp, and a checkpoint at every block). The memory
  /// is about (6 + 2 x kv_dim / hidden) x hidden + 4 x intermediate bytes per token and block on
  /// the CUDA backend. kAutoKeptBlocks: the plan's choice, the count whose predicted step is the
  /// fastest among those that fit, beside the device units (plan/cost_model.hpp); 0: none.
  std::int64_t kept_blocks = kAutoKeptBlocks;
  /// N decoder blocks among those that do not keep their activations on the device spill them to
  /// pinned host memory instead: their forward's activations go down over PCIe beside the next
  /// blocks' forward and come back before their backward, on streams of their own, through two
  /// device staging buffers, so the backward runs none of their forward again (layout only: the
  /// same bits as keeping or recomputing; a KeepingLayerOp, a checkpoint at every block). The
  /// blocks are spread over the lowest ones, every (L - kept) / N-th from the first, so that each
  /// copy has the time of several blocks. kAutoSpilledBlocks: the plan's choice (the fastest
  /// predicted step that fits the host memory); 0: none.
  std::int64_t spilled_blocks = kAutoSpilledBlocks;
  /// Rows may hold several sequences (packing, docs/data.md): step() and evaluate() then take
  /// each token's position within its sequence, and attention stays within each sequence.
  bool packed = false;
  /// Backend memory the plan leaves free beside the step's buffers, for the caller's own use
  /// between steps: sampling's decoding caches (megatrain-train --objective grpo).
  std::size_t reserved_device_bytes = 0;
  /// step() may take an objective with a weight per token (train/objective.hpp): a buffer of
  /// them beside the labels, on the device and in host memory (4 bytes a token each).
  bool token_weights = false;
  /// step() may take an objective that reads the rows' log-probabilities
  /// (Objective::needs_log_probs(): a preference loss): the head then runs forward once more a
  /// micro-batch, which the planner prices. Needs token_weights.
  bool log_prob_objective = false;
  AdamWConfig adamw;
  LrSchedule schedule;
  double clip_norm = 0.0;  ///< max global gradient norm; 0 disables clipping
  ClipMode clip_mode = ClipMode::exact;
  /// A non-finite step: stop (the default) or skip it. A skipped step consumes its batch and
  /// counts as a step for the schedule and the data order, but changes no weight and no AdamW
  /// state, and AdamW's bias correction counts only the updates applied (PyTorch's GradScaler
  /// skipping optimizer.step() while the scheduler steps). After max_nonfinite_skips skipped
  /// steps in a row the trainer stops as with NonFinite::stop.
  NonFinite on_nonfinite = NonFinite::stop;
  std::int64_t max_nonfinite_skips = 10;
  std::size_t weight_slots = 2;  ///< ring of block weight slots (>= 2: double buffering)
  std::size_t grad_slots = 2;    ///< ring of block gradient accumulators on the device
  /// With resident gradients (exact clipping, micro-batches): step() returns once the global
  /// norm is known and the AdamW pass runs in the background, unit by unit, ahead of the next
  /// step's forward (which waits for each unit's update only as it reaches that unit). The
  /// update is the same; Trainer::finish_update() waits for it. false: step() returns with the
  /// update applied.
  bool overlap_update = true;
  GradientHome gradient_home = GradientHome::device;
  /// The first N units in forward order (the embedding, the blocks, the head) keep their AdamW
  /// state (fp32 master weights, m and v) and their weights in backend memory, and are updated
  /// there (Backend::adamw: the same formula and, on the CPU and CUDA backends, the same bits as
  /// the host optimizer). The store holds their state again after Trainer::finish_update().
  /// kAutoDeviceUnits: as many as fit in device memory after everything else (none on a backend
  /// whose memory is host memory, or when user stages read the landed gradients).
  std::int64_t device_units = kAutoDeviceUnits;
  /// Data parallel over several processes (dist/comm.hpp; docs/distributed.md): this process is
  /// rank comm->rank() of comm->world(), batch_rows and micro_batches are its share of the global
  /// batch, each step's gradients (and its labelled-token count and loss) are summed over the
  /// processes before the norm and the update, and every process steps its replica of the train
  /// state the same way. Needs resident gradients (exact clipping or micro-batches) and no device
  /// units (kAutoDeviceUnits: none). With GradientHome::device (the default) each unit's gradient
  /// is summed over the processes in backend memory as the backward completes it (on GPUs through
  /// NCCL; dist::HostComm::can_sum_backend_memory must say so), and with shard_optimizer each
  /// process gets, downloads and steps only its part's sum. Null, or a world of 1: this process
  /// alone.
  dist::HostComm* comm = nullptr;
  bool distributed() const { return comm != nullptr && comm->world() > 1; }
  /// With `comm`: ZeRO-1. Each process keeps AdamW's m and v of its part of every unit only
  /// (1/world of them: StoreOptions::shard, which store_options() sets), and where the weights
  /// are bf16 (GPUs) the fp32 masters of its part too, and steps only those elements; each step's
  /// gradients are reduce-scattered (each process gets the sum of its part), the norm summed from
  /// the parts, and after the update the weights each process streams gathered whole on every
  /// process (HostParamStore::gather_updated; or as they stream, on the GPUs:
  /// gather_weights_on_device). The update runs before the next step begins
  /// (overlap_update is off). A checkpoint or an export gathers the state first
  /// (HostParamStore::gather_state).
  bool shard_optimizer = false;
  bool sharded() const { return shard_optimizer && distributed(); }
  /// With shard_optimizer and bf16 weights (GPUs), every process of `comm` on one host: the bf16
  /// weights the processes stream mapped by all of them together (StoreShard::shared_weights),
  /// one copy for the host instead of one a process (2 bytes a parameter in all), each process
  /// writing its part as it steps; the store refuses where a process runs on another host. The
  /// same bits as without. Ignored otherwise.
  bool share_host_weights = false;
  /// With `comm`: how many of its ranks run on this host, sharing its CPU, whose AdamW rate the
  /// planner's cost model divides among them (plan::predict_step; the placement it chooses follows
  /// from it). 0: every rank of `comm` (one host). Changes no result, only the plan.
  int host_processes = 0;
  /// With shard_optimizer and bf16 weights (GPUs) not shared (share_host_weights off, or processes
  /// on several hosts): each process holds its bf16 copy in its own part of each unit only
  /// (StoreShard::weights_in_parts: 2 / world bytes a parameter), the prefetch uploads only that
  /// part, and the GPUs gather the rest from the other
  /// processes (NCCL, on the compute stream, before the item that reads the unit's weights)
  /// instead of the updated weights being gathered through host memory after each update: each
  /// GPU uploads 1/world of the weights, and nothing waits for a gather between steps. The same
  /// bits. Where the offload stage sums gradients (GradientHome::host with sum_during_backward),
  /// and where false: gathered in host memory after the update (HostParamStore::gather_updated).
  bool gather_weights_on_device = true;
  /// The store keeps a bf16 copy of the weights (2 bytes a parameter of host memory), which the
  /// prefetch streams to the GPU. false: it keeps none (StoreOptions::bf16_copy, which
  /// store_options() sets: 12 bytes a parameter of state instead of 14), and the prefetch streams
  /// each unit's fp32 masters in pieces through a staging buffer on the GPU, rounding them there to
  /// bf16 as they arrive: the same bits, twice the weights' PCIe bytes. For a model whose state
  /// fits host memory only so (megatrain-train `--host-bf16-copy auto`: plan::choose_bf16_copy).
  /// Not with shard_optimizer over several processes, which exchange the copy.
  bool host_bf16_copy = true;
  /// Whether the weights are gathered on the device (see gather_weights_on_device), for a trainer
  /// whose weights are bf16 or not.
  bool weights_in_parts(bool bf16_weights) const {
    return sharded() && bf16_weights && !share_host_weights && gather_weights_on_device &&
           !(gradient_home == GradientHome::host && sum_during_backward);
  }
  /// With `comm` and GradientHome::host: each unit's gradient is summed over the processes by the
  /// offload stage as it is made, in the backend's memory before it is downloaded (on GPUs through
  /// NCCL, beside the rest of the backward; dist::HostComm::can_sum_backend_memory), instead of in
  /// host memory after the backward. The same sums. Where the communicator cannot, or false: after
  /// the backward. (GradientHome::device always sums in the backend's memory.)
  bool sum_during_backward = true;
  /// Testing aid: each built-in stage sleeps a random 0..jitter_us microseconds per item.
  int jitter_us = 0;
  /// Time every stage's work (events on GPU streams) and report it in StepStats::profile.
  bool profile = false;

  std::int64_t micro_rows() const { return batch_rows / micro_batches; }
  /// These options with micro_batches raised as max_micro_rows requires (see there).
  TrainerOptions resolved() const {
    TrainerOptions o = *this;
    if (o.distributed() && o.gradient_home == GradientHome::host && o.device_units == kAutoDeviceUnits) o.device_units = 0;
    if (o.sharded()) o.overlap_update = false;  // (the masters are gathered on the caller's thread after the update)
    if (o.max_micro_rows > 0 && o.batch_rows > 0 && o.micro_batches >= 1)
      while (o.micro_batches < o.batch_rows &&
             (o.batch_rows % o.micro_batches != 0 || o.batch_rows / o.micro_batches > o.max_micro_rows))
        ++o.micro_batches;
    return o;
  }
  bool resident_gradients() const { return micro_batches > 1 || (clip_norm > 0 && clip_mode == ClipMode::exact); }
  void validate() const {
    MT_CHECK(batch_rows > 0 && seq_len > 0, "batch of {} sequences of {} tokens is empty", batch_rows, seq_len);
    MT_CHECK(micro_batches >= 1 && batch_rows % micro_batches == 0,
             "{} micro-batches do not divide a batch of {} sequences", micro_batches, batch_rows);
    MT_CHECK(max_micro_rows >= 0, "max_micro_rows must be >= 0 (got {})", max_micro_rows);
    MT_CHECK(host_processes >= 0 && (comm == nullptr || host_processes <= comm->world()),
             "host_processes {}: between 0 (every rank on one host) and the {} ranks", host_processes,
             comm != nullptr ? comm->world() : 1);
    MT_CHECK(chunk_rows >= 0, "chunk_rows must be >= 0 (got {})", chunk_rows);
    MT_CHECK(token_chunk >= 0, "token_chunk must be >= 0 (got {})", token_chunk);
    MT_CHECK(checkpoint_every >= 0, "checkpoint_every must be >= 0 (got {}; 0: as the plan needs)", checkpoint_every);
    MT_CHECK(weight_slots >= 2, "weight_slots must be >= 2 for double buffering (got {})", weight_slots);
    MT_CHECK(grad_slots >= 2, "grad_slots must be >= 2 for double buffering (got {})", grad_slots);
    MT_CHECK(std::isfinite(clip_norm) && clip_norm >= 0, "clip_norm must be finite and >= 0 (got {})", clip_norm);
    MT_CHECK(jitter_us >= 0, "jitter_us must be >= 0");
    MT_CHECK(device_units >= kAutoDeviceUnits, "device_units must be >= 0, or kAutoDeviceUnits (got {})", device_units);
    MT_CHECK(kept_blocks >= kAutoKeptBlocks, "kept_blocks must be >= 0, or kAutoKeptBlocks (got {})", kept_blocks);
    MT_CHECK(spilled_blocks >= kAutoSpilledBlocks, "spilled_blocks must be >= 0, or kAutoSpilledBlocks (got {})",
             spilled_blocks);
    MT_CHECK(spilled_blocks <= 0 || checkpoint_every <= 1,
             "spilled activations (spilled_blocks {}) need a checkpoint at every block, not every {} blocks", spilled_blocks,
             checkpoint_every);
    MT_CHECK(kept_blocks <= 0 || checkpoint_every <= 1,
             "kept activations (kept_blocks {}) need a checkpoint at every block, not every {} blocks", kept_blocks,
             checkpoint_every);
    MT_CHECK(!distributed() || resident_gradients(),
             "data parallel over {} processes sums each step's whole gradient before the update: it needs the gradients "
             "held for the step (exact clipping or micro-batches)",
             distributed() ? comm->world() : 1);
    MT_CHECK(host_bf16_copy || !sharded(),
             "host_bf16_copy false (no bf16 copy of the weights in host memory) with shard_optimizer over {} processes, "
             "which exchange that copy: keep the copy, or shard_optimizer false", sharded() ? comm->world() : 1);
    MT_CHECK(token_weights || !log_prob_objective,
             "log_prob_objective (an objective that reads the log-probabilities) weighs each token: set token_weights too");
    MT_CHECK(max_nonfinite_skips >= 1, "max_nonfinite_skips must be >= 1 (got {})", max_nonfinite_skips);
    MT_CHECK(on_nonfinite == NonFinite::stop || resolved().resident_gradients(),
             "skipping non-finite steps (on_nonfinite skip) needs the whole gradient before any update: exact clipping "
             "(ClipMode::exact, the default) or micro-batches; without clipping or with stale clipping each unit is "
             "updated during the backward");
    adamw.validate();
    schedule.validate();
  }
};

/// The options as JSON (every field; what a train state records). The batch is the global batch:
/// in a run of several processes (`comm`) batch_rows and micro_batches are the sums over the
/// processes (each ran its share), and `processes` says how many there were; so a run may resume
/// on another number of processes with the same meaning (trainer_options_from_json reads them back
/// as one process's).
inline nlohmann::json to_json(const TrainerOptions& o) {
  const std::int64_t world = o.distributed() ? o.comm->world() : 1;
  return {{"batch_rows", o.batch_rows * world},
          {"seq_len", o.seq_len},
          {"micro_batches", o.micro_batches * world},
          {"processes", world},
          {"max_micro_rows", o.max_micro_rows},
          {"chunk_rows", o.chunk_rows},
          {"token_chunk", o.token_chunk},
          {"checkpoint_every", o.checkpoint_every},
          {"packed", o.packed},
          {"adamw",
           {{"lr", o.adamw.lr}, {"beta1", o.adamw.beta1}, {"beta2", o.adamw.beta2}, {"eps", o.adamw.eps},
            {"weight_decay", o.adamw.weight_decay}}},
          {"schedule",
           {{"kind", LrSchedule::name(o.schedule.kind)},
            {"lr", o.schedule.lr},
            {"warmup_steps", o.schedule.warmup_steps},
            {"total_steps", o.schedule.total_steps},
            {"min_lr", o.schedule.min_lr}}},
          {"clip_norm", o.clip_norm},
          {"clip_mode", o.clip_mode == ClipMode::exact ? "exact" : "stale"},
          {"weight_slots", o.weight_slots},
          {"grad_slots", o.grad_slots},
          {"gradient_home", o.gradient_home == GradientHome::device ? "device" : "host"},
          {"device_units", o.device_units},
          {"kept_blocks", o.kept_blocks},
          {"spilled_blocks", o.spilled_blocks},
          {"on_nonfinite", o.on_nonfinite == NonFinite::stop ? "stop" : "skip"},
          {"max_nonfinite_skips", o.max_nonfinite_skips}};
}

/// Reads what to_json wrote; throws megatrain::Error naming `what` and the field otherwise.
inline TrainerOptions trainer_options_from_json(const nlohmann::json& j, std::string_view what) {
  TrainerOptions o;
  try {
    o.batch_rows = json_whole<std::int64_t>(j.at("batch_rows"), what, "batch_rows");
    o.seq_len = json_whole<std::int64_t>(j.at("seq_len"), what, "seq_len");
    o.micro_batches = json_whole<std::int64_t>(j.at("micro_batches"), what, "micro_batches");
    o.max_micro_rows = json_whole<std::int64_t>(j.at("max_micro_rows"), what, "max_micro_rows");
    o.chunk_rows = json_whole<std::int64_t>(j.at("chunk_rows"), what, "chunk_rows");
    o.packed = j.value("packed", false);  // (absent from train states written before packing)
    o.token_chunk = json_whole_or(j, "token_chunk", std::int64_t{0}, what);
    o.checkpoint_every = json_whole_or(j, "checkpoint_every", std::int64_t{1}, what);  // (absent: written before it existed)
    const auto& a = j.at("adamw");
    o.adamw = {a.at("lr").get<double>(), a.at("beta1").get<double>(), a.at("beta2").get<double>(), a.at("eps").get<double>(),
               a.at("weight_decay").get<double>()};
    const auto& s = j.at("schedule");
    o.schedule = {LrSchedule::kind_named(s.at("kind").get<std::string>(), what), s.at("lr").get<double>(),
                  json_whole<std::int64_t>(s.at("warmup_steps"), what, "schedule.warmup_steps"),
                  json_whole<std::int64_t>(s.at("total_steps"), what, "schedule.total_steps"),
                  s.at("min_lr").get<double>()};
    o.clip_norm = j.at("clip_norm").get<double>();
    const std::string mode = j.at("clip_mode").get<std::string>();
    MT_CHECK(mode == "exact" || mode == "stale", "{}: clip_mode '{}' is unknown", what, mode);
    o.clip_mode = mode == "exact" ? ClipMode::exact : ClipMode::stale;
    o.weight_slots = json_whole<std::size_t>(j.at("weight_slots"), what, "weight_slots");
    o.grad_slots = json_whole<std::size_t>(j.at("grad_slots"), what, "grad_slots");
    // (layout only, and absent from train states written before they existed)
    const std::string home = j.value("gradient_home", "host");
    MT_CHECK(home == "device" || home == "host", "{}: gradient_home '{}' is unknown", what, home);
    o.gradient_home = home == "device" ? GradientHome::device : GradientHome::host;
    o.device_units = json_whole_or(j, "device_units", std::int64_t{0}, what);
    o.kept_blocks = json_whole_or(j, "kept_blocks", std::int64_t{0}, what);
    o.spilled_blocks = json_whole_or(j, "spilled_blocks", std::int64_t{0}, what);
    const std::string nonfinite = j.value("on_nonfinite", "stop");
    MT_CHECK(nonfinite == "stop" || nonfinite == "skip", "{}: on_nonfinite '{}' is unknown", what, nonfinite);
    o.on_nonfinite = nonfinite == "stop" ? NonFinite::stop : NonFinite::skip;
    o.max_nonfinite_skips = json_whole_or(j, "max_nonfinite_skips", std::int64_t{10}, what);
  } catch (const nlohmann::json::exception& e) {
    MT_FAIL("{}: the trainer options are malformed: {}", what, e.what());
  }
  return o;
}

/// One field that defines the update and differs between two option sets.
struct OptionDifference {
  std::string field;   ///< "batch_rows", "adamw.beta2", "schedule.warmup_steps", ...
  std::string before;  ///< its value in the first set (JSON)
  std::string after;   ///< in the second
  std::string str() const { return fmt::format("{}: {} vs {}", field, before, after); }
};

/// The fields that define the update (see the top of this file) where `a` and `b` differ. Empty:
/// a run with `b` continues a run with `a` exactly. (A constant schedule's length and floor do not
/// matter, nor the clipping mode without clipping.)
inline std::vector<OptionDifference> update_differences(const TrainerOptions& a, const TrainerOptions& b) {
  std::vector<OptionDifference> out;
  nlohmann::json ja = to_json(a), jb = to_json(b);
  // Schedules of different kinds: the kind is the difference (their other fields mean other things).
  if (ja["schedule"]["kind"] != jb["schedule"]["kind"]) {
    ja["schedule"] = {{"kind", ja["schedule"]["kind"]}, {"lr", ja["schedule"]["lr"]}};
    jb["schedule"] = {{"kind", jb["schedule"]["kind"]}, {"lr", jb["schedule"]["lr"]}};
  }
  for (auto* j : {&ja, &jb}) {
    if ((*j)["schedule"]["kind"] == "constant")
      for (const char* k : {"total_steps", "min_lr"}) (*j)["schedule"].erase(k);
    if ((*j)["clip_norm"] == 0.0) j->erase("clip_mode");
  }
  for (const char* key : {"batch_rows", "seq_len", "adamw", "schedule", "clip_norm", "clip_mode"}) {
    const nlohmann::json none;
    const auto& va = ja.contains(key) ? ja[key] : none;
    const auto& vb = jb.contains(key) ? jb[key] : none;
    if (va == vb) continue;
    if (va.is_object() && vb.is_object()) {
      for (const auto& [k, v] : va.items())
        if (!vb.contains(k) || v != vb[k])
          out.push_back({fmt::format("{}.{}", key, k), v.dump(), vb.contains(k) ? vb[k].dump() : "none"});
    } else {
      out.push_back({key, va.is_null() ? "none" : va.dump(), vb.is_null() ? "none" : vb.dump()});
    }
  }
  return out;
}

}  // namespace megatrain
