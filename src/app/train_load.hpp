// megatrain-train's built step given its starting state: a checkpoint's train state (--resume;
// where the continuation is not bit for bit the uninterrupted run, the run says why) or a Hugging
// Face model's weights (--model).
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "megatrain/core/error.hpp"
#include "megatrain/core/host_memory.hpp"
#include "megatrain/io/train_checkpoint.hpp"
#include "megatrain/train/checkpointer.hpp"
#include "grpo_plan.hpp"  // grpo_position
#include "train_build.hpp"

namespace megatrain::app {

/// Where training starts.
struct StartState {
  std::int64_t first_step = 1;
  /// Metrics lines a checkpoint kept because they could not be written before it (--on-metrics-error).
  std::vector<std::string> unwritten_metrics;
  /// --objective dpo: the reference the checkpoint carries (its record, its file's bytes and the
  /// checkpoint, for messages), if it carries one.
  struct DpoReference {
    nlohmann::json record;
    std::string bytes, checkpoint;
  };
  std::optional<DpoReference> dpo_reference;
};

/// What this resume does otherwise than the run it continues that changes the order of a sum (the
/// backend, the processes, the micro-batches, ...), for the note that says so.
std::vector<std::string> layout_changes(const TrainerOptions& now, const TrainState& was, const char* backend_name,
                                        int world);

/// The matrix-product algorithms the resumed run used (--gemm-tuning): the same again, or (a
/// checkpoint from before they were kept) the heuristic's, as that run took them. Adds to `layout`
/// where this GPU or cuBLASLt cannot take them.
template <class B>
void restore_gemm_algorithms(B& be, const TrainState& st, const Resume& resume, std::vector<std::string>& layout) {
  if constexpr (requires { be.restore_gemm_algorithms(std::string()); }) {
    const std::string saved = st.user.value("gemm_algorithms", std::string());
    if (saved.empty()) {
      be.end_gemm_tuning();
      return;
    }
    bool same = false;
    try {
      same = be.restore_gemm_algorithms(saved);
    } catch (const megatrain::Error& e) {
      MT_FAIL("--resume '{}': its {} holds no usable gemm_algorithms: {}", resume.ckpt.dir().string(), io::kTrainStateFile,
              e.reason());
    }
    if (!same) layout.push_back("another cuBLASLt or GPU (the matrix-product algorithms, tuned again)");
  }
}

/// Loads the checkpoint being resumed (when evaluating or exporting, its weights only) into `built`.
template <class B>
StartState load_checkpoint(B& be, const char* backend_name, BuiltStep<B>& built, TrainInputs& in) {
  Resume& resume = *in.plan.resume;
  const auto t0 = std::chrono::steady_clock::now();
  // (Evaluating or exporting, only the weights matter: the trainer's options are not the run's.)
  const TrainState st = in.plan.eval_only ? resume.state : load_train_state(resume.ckpt, built.trainer(), built.store());
  if (in.plan.eval_only) resume.ckpt.load_into(built.store());
  StartState start;
  start.first_step = st.step + 1;
  if (!in.plan.eval_only && (in.data || in.plan.grpo)) {
    const DataPosition expected = in.data ? in.data->position(st.step * in.s.batch) : grpo_position(*in.plan.grpo, in.s, st.step);
    MT_CHECK(!st.data || *st.data == expected, "--resume '{}': the data position (epoch {}, slot {}) does not follow "
             "from the step and batch (epoch {}, slot {})", resume.ckpt.dir().string(), st.data->epoch,
             st.data->slot, expected.epoch, expected.slot);
  }
  std::fprintf(built.info(), "resumed from %s (step %lld, %s) in %.1f s\n", resume.ckpt.dir().string().c_str(),
               static_cast<long long>(st.step), format_bytes(resume.ckpt.tensor_bytes()).c_str(),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  if (!in.plan.eval_only) {
    // Allowed, but then the continuation is not bit for bit the uninterrupted run: say so.
    std::vector<std::string> layout = layout_changes(built.trainer().options(), st, backend_name, in.ranks.world());
    restore_gemm_algorithms(be, st, resume, layout);
    if (!layout.empty())
      std::fprintf(built.info(), "note: this run computes the same update as the checkpoint's with %s: its floating-point "
                   "sums come in another order, so it is not bit for bit the run that was not interrupted\n",
                   fmt::format("{}", fmt::join(layout, ", ")).c_str());
  }
  if (const nlohmann::json& u = st.user; u.contains("unwritten_metrics") && u["unwritten_metrics"].is_array())
    for (const auto& line : u["unwritten_metrics"]) start.unwritten_metrics.push_back(line.get<std::string>());
  if (st.user.contains("dpo_reference") && st.user["dpo_reference"].is_object()) {
    const std::string file = st.user["dpo_reference"].value("file", "");
    const auto bytes = resume.ckpt.file(file);
    MT_CHECK(bytes.has_value(), "--resume '{}': the checkpoint records a DPO reference but lacks its file '{}'",
             resume.ckpt.dir().string(), file);
    start.dpo_reference = StartState::DpoReference{st.user["dpo_reference"], *bytes, resume.ckpt.dir().string()};
  }
  in.plan.resume.reset();
  in.plan.hf.reset();  // (--model given again was only compared with the checkpoint's model)
  return start;
}

/// Loads the starting state into `built`: the checkpoint being resumed, or --model's weights.
template <class B>
StartState load_start_state(B& be, const char* backend_name, BuiltStep<B>& built, TrainInputs& in) {
  if (in.plan.resume) return load_checkpoint(be, backend_name, built, in);
  if (in.plan.hf) {
    const auto t0 = std::chrono::steady_clock::now();
    in.plan.hf->load_into(built.store());
    std::fprintf(built.info(), "loaded %s (%lld parameters) in %.1f s%s\n", in.s.model_dir.c_str(),
                 static_cast<long long>(built.store().param_count()),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                 in.plan.hf->ignored().empty()
                     ? ""
                     : fmt::format("; not loaded: {}", fmt::join(in.plan.hf->ignored(), ", ")).c_str());
    in.plan.hf.reset();  // unmap the files: an export may replace that very directory
  }
  return {};
}

}  // namespace megatrain::app
