// megatrain-train's step, planned and built on a backend: where the state lives (the bf16 copy,
// where gradients wait for the norm) decided by the plan, the plan printed (and refused with what
// would fit when it cannot), then the parameter store and the trainer; and the export of the
// trained weights.
#pragma once

#include <fmt/format.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <type_traits>
#include <vector>

#include "megatrain/core/error.hpp"
#include "megatrain/core/host_memory.hpp"
#include "megatrain/io/hf_checkpoint.hpp"
#include "megatrain/layers/decoder_model.hpp"
#include "megatrain/plan/planner.hpp"
#include "megatrain/train/trainer.hpp"
#include "options.hpp"
#include "sampling_memory.hpp"
#include "train_inputs.hpp"

namespace megatrain::app {

/// What the messages call the model: the checkpoint, the --model or --model-config, the --preset,
/// or the command-line shape.
std::string model_label(const Settings& s, const RunPlan& plan);
/// The host memory this rank may use: several ranks on one host share its memory, each planning
/// for its part unless --host-memory gives each its own.
plan::HostBudget rank_host_budget(const Settings& s, const Ranks& ranks);
/// Refuses --share-weights true and --gather-weights where they cannot apply.
void check_weight_options(const Settings& s, const TrainerOptions& topt, bool bf16_weights, const char* backend_name);
/// What every rank holds and trains, said after the plan where several ranks train.
std::string data_parallel_line(const Settings& s, const TrainerOptions& topt, const Ranks& ranks, bool bf16_weights);

template <class B>
class BuiltStep {
 public:
  BuiltStep(B& be, const char* backend_name, TrainInputs& in)
      : in_(in), budget_(rank_host_budget(in.s, in.ranks)), label_(model_label(in.s, in.plan)), model_(in.cfg) {
    check_weight_options(in.s, in.topt, kBf16, backend_name);
    // (a GRPO run samples between its steps: the caches' memory left free by every plan)
    if (in.plan.grpo)
      in.topt.reserved_device_bytes =
          sampling_bytes<B>(model_, in.topt.batch_rows, in.topt.seq_len, in.topt.resolved().micro_rows());
    // (from the config alone, before its blocks are built: a config of 10^9 layers is refused here)
    plan::check_state_fits_host(in.cfg, budget_, label_, Trainer<B>::store_options(in.topt).shard,
                                in.topt.host_bf16_copy && !auto_copy(), !in.plan.eval_only);
    place_state(be);
    // (ZeRO-1 exports from the first process: from the bf16 copy every process holds for a bf16
    // export of sharded masters, else from the masters, gathered there where they are sharded)
    gathers_for_export_ = in.topt.sharded() && in.plan.export_options &&
                          Trainer<B>::store_options(in.topt).shard.masters && in.plan.export_options->dtype != DType::bf16;
    plan_and_say(be);
    // (every rank's plan fits, and the first's export: agreed before the stores are built, which
    // is collective where the ranks share the weights, so that a rank refused above stops every
    // rank here, named, instead of meeting another rank's collective)
    in.ranks.agree_checked();
    store_.emplace(model_.units(), store_options(in.topt));
    trainer_.emplace(model_, *store_, be, in.topt);
  }

  BuiltStep(const BuiltStep&) = delete;  // (the trainer holds the model, the store and the backend)
  BuiltStep& operator=(const BuiltStep&) = delete;

  Trainer<B>& trainer() { return *trainer_; }
  HostParamStore<float>& store() { return *store_; }
  const std::string& label() const { return label_; }
  /// The host memory the plan counts on (said again at the start).
  std::size_t planned_host() const { return planned_host_; }
  /// Whether an export gathers the masters on the first process (ZeRO-1, not bf16).
  bool gathers_for_export() const { return gathers_for_export_; }
  /// Where the messages before training go: stderr when evaluating only (stdout has the result).
  FILE* info() const { return in_.plan.eval_only ? stderr : in_.ranks.out(); }

  /// Writes --export from the weights of `step`; returns what it did, as a sentence.
  std::string export_model(std::int64_t step) {
    trainer_->finish_update();  // (the step's update, if it runs in the background)
    const auto t0 = std::chrono::steady_clock::now();
    const std::filesystem::path dir(in_.s.export_dir);
    if (dir.has_parent_path()) std::filesystem::create_directories(dir.parent_path());
    io::HfExportOptions& eo = *in_.plan.export_options;
    eo.marker = {{"written_by", "megatrain-train"}, {"step", step}};
    if (!in_.plan.out.empty()) eo.marker["run_dir"] = std::filesystem::absolute(in_.plan.out).lexically_normal().string();
    io::export_hf_model(*store_, in_.cfg, dir, eo);
    return fmt::format("exported step {} to {} ({}) in {:.1f} s", step, in_.s.export_dir, io::torch_dtype_name(eo.dtype),
                       std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }

 private:
  static constexpr bool kBf16 = std::is_same_v<typename B::Weight, bf16>;
  static plan::MachineFigures machine() { return B::kDevice ? plan::machine_figures() : plan::MachineFigures{}; }
  // The backend's memory for the plans: what it holds, with the memory left free for sampling.
  plan::DeviceBudget device_budget(B& be) const {
    plan::DeviceBudget d = plan::device_budget(be);
    d.allocated += in_.topt.reserved_device_bytes;
    return d;
  }
  // --host-bf16-copy auto: the plan decides whether host memory keeps the bf16 copy, by this rank
  // alone; ranks of several keep it.
  bool auto_copy() const { return in_.s.host_bf16_copy == "auto" && kBf16 && !in_.ranks.several(); }

  void place_state(B& be) {
    TrainerOptions& topt = in_.topt;
    if (auto_copy())  // (kept where a plan fits with it, with the gradients where --gradients allows)
      topt.host_bf16_copy = plan::choose_bf16_copy<B>(model_, topt, device_budget(be), budget_, machine(),
                                                      in_.s.gradients == "auto");
    // Where gradients wait for the norm (--gradients auto; plan::choose_gradient_home): where the
    // plan fits, in host memory only where that is predicted faster or alone fits (on every rank);
    // a resumed run keeps its checkpoint's where it fits.
    if (in_.s.gradients != "auto" || !topt.resolved().resident_gradients()) return;
    const RunPlan& plan = in_.plan;
    const std::optional<GradientHome> was =
        plan.resume && !plan.eval_only ? std::optional(plan.resume->state.options.gradient_home) : std::nullopt;
    const plan::GradientHomeChoice mine =
        plan::choose_gradient_home<B>(model_, topt, device_budget(be), budget_, machine(), was);
    // (agreed as the ranks' checks are: a rank refused before this point stops every rank here)
    std::vector<plan::GradientHomeChoice> all;
    for (const std::int64_t v : in_.ranks.agree_on(2 + (mine.home == GradientHome::host ? 1 : 0) +
                                                   (mine.device_fits ? 2 : 0) + (mine.host_fits ? 4 : 0)))
      all.push_back({(v - 2) % 2 == 1 ? GradientHome::host : GradientHome::device, ((v - 2) / 2) % 2 == 1, (v - 2) / 4 == 1});
    topt.gradient_home = plan::GradientHomeChoice::agree(all);
    // (several processes: where they keep their parts of the weights can follow from it)
    plan::check_state_fits_host(in_.cfg, budget_, label_, Trainer<B>::store_options(topt).shard, topt.host_bf16_copy,
                                !in_.plan.eval_only);
  }

  // The store's options: --steps 0 reads the model and never steps it, so it keeps no AdamW
  // moments (StoreOptions::optimizer_state: 6 bytes a parameter with the bf16 copy, not 14).
  StoreOptions store_options(const TrainerOptions& topt) const {
    StoreOptions so;
    so.seed = in_.s.seed;
    so.host_memory_budget = budget_.bytes;
    so.optimizer_state = !in_.plan.eval_only;
    return Trainer<B>::store_options(topt, so);
  }

  // The plan (docs/planner.md), before anything is allocated: printed, and refused with what would
  // fit when it cannot.
  void plan_and_say(B& be) {
    const TrainerOptions& topt = in_.topt;
    const plan::StepPlan sp = plan::plan_step<B>(model_, topt, device_budget(be), budget_, machine(),
                                                 HostParamStore<float>::footprint(model_.units(), store_options(topt)));
    MT_CHECK(sp.memory.fits, "{}", sp.refusal());
    planned_host_ = sp.memory.host_total();
    if (topt.sharded() && in_.ranks.lead() && in_.plan.export_options &&
        (gathers_for_export_ || Trainer<B>::store_options(topt).shard.keeps_weight_parts()))
      check_export_fits(sp);
    std::fprintf(info(), "%s", plan::format_summary(sp).c_str());
    if (in_.plan.grpo) std::fprintf(info(), "%s", sampling_line(topt).c_str());
    if (in_.ranks.several()) std::fprintf(info(), "%s\n", data_parallel_line(in_.s, topt, in_.ranks, kBf16).c_str());
  }

  // ZeRO-1: the first process holds the whole train state while it writes an f32 or f16 export,
  // and the whole bf16 copy for a bf16 export where each process holds its part.
  void check_export_fits(const plan::StepPlan& sp) const {
    const auto parts_of = [&](const TrainerOptions& o) {
      const auto f = HostParamStore<float>::footprint(model_.units(), Trainer<B>::store_options(o));
      return gathers_for_export_ ? f.master_bytes + f.adam_bytes : f.compute_bytes;
    };
    TrainerOptions whole = in_.topt;
    whole.shard_optimizer = false;
    const auto need = sp.memory.host_total() + parts_of(whole) - parts_of(in_.topt);
    MT_CHECK(need <= budget_.bytes, "process 0 writes the --export as {}, for which it gathers {}: {} of host memory "
             "then, more than its {} ({}); {}give it more (--host-memory, or fewer processes on its host), or export "
             "afterwards from a checkpoint (--save-every; megatrain-train --resume DIR --steps 0 --export OUT)",
             io::torch_dtype_name(in_.plan.export_options->dtype),
             gathers_for_export_ ? "the whole train state" : "the whole bf16 copy (each process holds its part)",
             format_bytes(need), format_bytes(budget_.bytes), budget_.source,
             gathers_for_export_ ? "export as bf16 (--export-dtype bf16, the default: nothing of the optimizer's "
                                   "state gathered), or "
                                 : "");
  }

  TrainInputs& in_;
  const plan::HostBudget budget_;
  const std::string label_;
  DecoderModel<> model_;
  std::optional<HostParamStore<float>> store_;
  std::optional<Trainer<B>> trainer_;
  std::size_t planned_host_ = 0;
  bool gathers_for_export_ = false;
};

}  // namespace megatrain::app
