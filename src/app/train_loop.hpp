// megatrain-train's training: the run folder started (config.json, options.json, metrics.jsonl),
// the steps, and around them the checkpoints (--save-every, a stop signal, a failure that stops
// the run), the exports (--export, --export-every), validation (--eval-every), samples
// (--sample-every), report.html, and an end that says what was written and what was not.
//
// Every rank runs this alike, each training its share of the global batch; the first rank alone
// prints and writes the run folder (ZeRO-1: every rank writes its part of each checkpoint).
#pragma once

#include <signal.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <cmath>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "megatrain/core/error.hpp"
#include "megatrain/core/fault_injection.hpp"
#include "megatrain/core/log.hpp"
#include "megatrain/io/metrics_log.hpp"
#include "megatrain/io/tensorboard.hpp"
#include "megatrain/io/run_report.hpp"
#include "megatrain/io/train_checkpoint.hpp"
#include "megatrain/train/checkpointer.hpp"
#include "parse.hpp"
#include "progress.hpp"
#include "stop_signals.hpp"
#include "train_load.hpp"
#include "train_grpo.hpp"
#include "train_preference.hpp"
#include "train_samples.hpp"

namespace megatrain::app {

/// The closing line of a run that signal `name` stopped after step `done` of `steps`: the
/// checkpoint to resume from (`saved_step`, at `saved_path`), or why there is none.
std::string stopped_line(const char* name, std::int64_t done, std::int64_t steps, std::int64_t saved_step,
                         const std::string& saved_path, const std::filesystem::path& out);

template <class B>
class TrainLoop {
 public:
  TrainLoop(B& be, const char* backend_name, TrainInputs& in, BuiltStep<B>& built, const StartState& start)
      : be_(be), backend_(backend_name), in_(in), s(in.s), ranks_(in.ranks), built_(built), trainer_(built.trainer()),
        data_(in.data ? &*in.data : nullptr), first_step_(start.first_step), saved_step_(start.first_step - 1),
        progress_(start.first_step, in.s.steps, in.ranks.out()) {
    start_run_folder(start.unwritten_metrics);
    say_start();
    start_objective(start);
    start_checkpoints();
    start_report();
  }

  /// Trains steps first_step to --steps; returns the exit status.
  int run() {
    tell_signals();
    t0_ = std::chrono::steady_clock::now();
    const auto n = static_cast<std::size_t>(s.batch * s.seq);
    if (data_) {  // (a GRPO run makes its rows of its completions)
      ids_.resize(n), labels_.resize(n), positions_.resize(data_->packed() ? n : 0);
      // Examples end in padding, which transformers' attention mask leaves out of a mixture of
      // experts' auxiliary loss (and the tokens per expert): the trainer takes the same mask.
      mask_.resize(data_->examples() && in_.cfg.moe_layer_count() > 0 ? n : 0);
    }
    std::int64_t step = first_step_;
    int stop_signal = 0;  // (a signal any process got: every process stops after the same step)
    for (; step <= s.steps && (stop_signal = ranks_.stop_signal(StopSignals::first())) == 0; ++step)
      if (const std::optional<int> stopped = train_step(step)) return *stopped;
    const std::int64_t done = step - 1;
    // (a signal during the last step: every process hears of it, and the run is saved as promised)
    if (stop_signal == 0) stop_signal = ranks_.stop_signal(StopSignals::first());
    trainer_.finish_update();
    wait_saves();
    write_report();
    if (stop_signal != 0) {
      // A signal asked for a checkpoint: the state after the last finished step is saved (also
      // when that step was the last one), unless it is already, or no step ran.
      save_unless_saved(done);
      ranks_.barrier();  // (no process leaves while the first still saves)
      if (done < s.steps) {
        if (lead_)
          std::fprintf(stderr, "%s\n", stopped_line(StoppedBeforeTraining::name(stop_signal), done, s.steps, saved_step_,
                                                    saved_step_ > 0 ? checkpoint_path(saved_step_) : "", out_).c_str());
        return 128 + stop_signal;
      }
      // (The signal came during the last step: the run is complete, and saved as promised.)
    }
    return finish(done);
  }

 private:
  // ---- the run folder -----------------------------------------------------------------------------
  // Every process got here (or every process stops now, naming those that did not): from here the
  // first process alone writes the run folder (the train state is the same on every process).
  void start_run_folder(const std::vector<std::string>& unwritten) {
    RunPlan& plan = in_.plan;
    // (first, the first process's run folder must be writable: found now, every process is told)
    if (ranks_.several() && ranks_.lead()) {
      std::filesystem::create_directories(plan.out);
      const std::filesystem::path probe = plan.out / fmt::format(".megatrain-write-test-{}", getpid());
      MT_CHECK(std::ofstream(probe).good(), "cannot write in --out '{}'", plan.out.string());
      std::filesystem::remove(probe);
    }
    ranks_.agree_started();
    lead_ = ranks_.lead();
    // (without --out each process made up a folder of its own: the first's is the run's, where every
    // process writes its part of the checkpoints)
    if (ranks_.several() && s.out.empty()) plan.out = std::filesystem::absolute(ranks_.lead_text(plan.out.string()));
    out_ = plan.out;
    if (!lead_) return;
    std::filesystem::create_directories(out_);
    io::write_run_file(out_ / "config.json", in_.cfg.to_json().dump(2) + "\n");
    io::write_run_file(out_ / "options.json", resolved_options(in_.app).dump(2) + "\n");
    // metrics.jsonl (io/metrics_log.hpp): a resumed run continues it where its checkpoint was
    // taken, with the lines that checkpoint kept because they could not be written then.
    metrics_ = io::MetricsLog(out_ / "metrics.jsonl", first_step_ > 1 ? first_step_ - 1 : -1);
    for (const std::string& line : unwritten)  // (those not in the file yet)
      if (io::metrics_step(line) > metrics_.kept_through() && metrics_error_.empty()) metrics_error_ = metrics_.append(line);
    MT_CHECK(metrics_error_.empty(), "the metrics the checkpoint kept could not be written: {}", metrics_error_);
    if (!s.tensorboard.empty()) tensorboard_.emplace(s.tensorboard);
    if (plan.samples) samples_.emplace(plan.samples, out_ / "samples.jsonl", s.sample_tokens, first_step_);
  }

  void say_start() {
    const ModelConfig& cfg = in_.cfg;
    FILE* const o = ranks_.out();
    const std::string data =
        data_ ? fmt::format("{} ({} training tokens, {} validation)", s.data.empty() ? "built-in text" : s.data,
                            data_->train_tokens(), data_->val_tokens())
              : fmt::format("{} ({} training prompts, {} validation; {} completions each, of at most {} tokens)", s.data,
                            in_.plan.grpo->train.size(), in_.plan.grpo->val.size(), s.generations,
                            in_.plan.grpo->completion_tokens);
    std::fprintf(o, "megatrain-train: %s, %lld parameters (%lld layers, hidden %lld, vocab %lld), backend %s, data %s\n",
                 std::string(cfg.architecture_name()).c_str(), static_cast<long long>(cfg.param_count()),
                 static_cast<long long>(cfg.num_hidden_layers), static_cast<long long>(cfg.hidden_size),
                 static_cast<long long>(cfg.vocab_size), backend_, data.c_str());
    const std::int64_t micro = trainer_.options().micro_batches * ranks_.world();  // (the global batch's passes)
    std::fprintf(o, "batch %lld x %lld tokens%s, %s %lld, host memory %s as planned (%s of it the parameter store), "
                 "writing %s\n", static_cast<long long>(s.batch), static_cast<long long>(s.seq),
                 micro > 1 ? fmt::format(" in {} micro-batches of {}", micro, s.batch / micro).c_str() : "",
                 first_step_ > 1 ? fmt::format("steps {} to", first_step_).c_str() : "steps", static_cast<long long>(s.steps),
                 format_bytes(built_.planned_host()).c_str(), format_bytes(built_.store().bytes()).c_str(),
                 out_.string().c_str());
    for (const std::string& note : in_.plan.notes) std::fprintf(o, "%s\n", note.c_str());
    const TrainerOptions& topt = in_.topt;
    if constexpr (B::kDevice)
      std::fprintf(o, "AdamW on the GPU for %zu of %zu units (--device-units), on the host for the rest%s\n",
                   trainer_.device_units(), built_.store().num_units(),
                   topt.resident_gradients() ? fmt::format("; gradients wait for the norm in {} memory (--gradients{})",
                                                           topt.gradient_home == GradientHome::host ? "host" : "GPU",
                                                           s.gradients == "auto" ? " auto" : "").c_str()
                                             : "");
    if (topt.schedule.decays() && s.steps > topt.schedule.total_steps)
      std::fprintf(o, "note: the %s schedule ends at step %lld (the first run's --steps); later steps train at its floor %g\n",
                   s.schedule.c_str(), static_cast<long long>(topt.schedule.total_steps), topt.schedule.min_lr);
    std::fflush(o);
  }

  // ---- checkpoints ----------------------------------------------------------------------------------
  void start_checkpoints() {
    CheckpointerOptions copt;
    copt.keep = static_cast<std::size_t>(s.keep);
    copt.extra_files = in_.plan.side_files;
    copt.extra_files["config.json"] = in_.plan.config_text;
    // (--objective dpo: the reference travels with every checkpoint, so a resumed run takes the same)
    if (preference_) copt.extra_files[kDpoReferenceFile] = preference_->file_bytes();
    // (the first process's only, where every process holds the same train state; ZeRO-1: every
    // process writes its part of each checkpoint, the first puts it in place)
    if (trainer_.options().sharded()) copt.comm = ranks_.comm();
    if (lead_ || copt.comm) checkpointer_.emplace(out_ / "checkpoints", copt);
    nlohmann::json side_names = nlohmann::json::array();
    for (const auto& [name, text] : in_.plan.side_files) side_names.push_back(name);
    user_ = {{"program", "megatrain-train"},
             {"given", in_.plan.given},
             {"data", in_.plan.data_identity},
             {"backend", backend_},
             {"side_files", side_names},
             {"run_dir", std::filesystem::absolute(out_).lexically_normal().string()},
             {"processes", ranks_.world()},
             {"run_id", in_.plan.run_id}};
    if (in_.plan.carried) user_["carried"] = in_.plan.carried->to_json();
    if (preference_) user_["dpo_reference"] = preference_->record();
    checkpoints_.emplace(out_ / "checkpoints");
  }
  std::string checkpoint_path(std::int64_t step) const { return checkpoints_->path_for(step).string(); }

  // What a second stop signal cleans and says (stop_signals.hpp): what this run may be writing.
  void tell_signals() {
    StopSignals::Status st;
    st.out = out_.string();
    st.saved_step = saved_step_;
    if (saved_step_ > 0) st.saved_path = checkpoint_path(saved_step_);
    st.training = true;
    const RunPlan& plan = in_.plan;
    if (plan.folder && plan.folder->replaced()) st.replaced = plan.folder->replaced()->string();
    if (lead_) st.writing_in = {{out_, ""}, {out_ / "checkpoints", ""}};
    if (lead_ && plan.export_options) {
      const std::filesystem::path e = std::filesystem::absolute(s.export_dir).lexically_normal();
      const std::filesystem::path name = e.has_filename() ? e.filename() : e.parent_path().filename();
      st.writing_in.emplace_back(e.has_filename() ? e.parent_path() : e.parent_path().parent_path(), name.string() + ".");
    }
    StopSignals::update(st);
  }

  // Reports a finished save (a failure is a warning: the previous checkpoint is still there).
  void report_save(const SaveResult& r) {
    if (r.ok) {
      saved_step_ = r.step;
      last_save_failed_ = false;
      tell_signals();
      if (lead_)
        progress_.note(fmt::format("saved step {} to {} ({} in {:.1f} s; training waited {:.1f} s for it)", r.step,
                                   r.dir.string(), format_bytes(r.bytes), r.seconds, r.stall_seconds));
      drop_replaced();  // (--overwrite: the new run has its first checkpoint)
      return;
    }
    last_save_failed_ = true;
    // (every process its own failure; the first also another's)
    if (lead_ || !r.failed_elsewhere)
      progress_.note(fmt::format("megatrain-train: warning: the checkpoint of step {} could not be written: {}. {}; "
                                 "training goes on", r.step, r.error,
                                 saved_step_ > 0 ? fmt::format("The newest complete checkpoint is step {}", saved_step_)
                                                 : std::string("There is no complete checkpoint")),
                     stderr);
  }
  void poll_saves() {
    if (checkpointer_)
      for (const SaveResult& r : checkpointer_->poll()) report_save(r);
  }
  void wait_saves() {
    if (checkpointer_)
      for (const SaveResult& r : checkpointer_->wait()) report_save(r);
  }
  // --overwrite: the previous run is removed once this one has a checkpoint or has finished.
  void drop_replaced() {
    if (in_.plan.folder && in_.plan.folder->replaced())
      progress_.note(fmt::format("--overwrite: removed the previous run ('{}')", in_.plan.folder->drop_replaced().string()));
  }

  // (Every process calls it at the same step. ZeRO-1: every process writes its part.) The metrics
  // lines not yet written go with it, so that a resume writes them.
  void save(std::int64_t step) {
    if constexpr (requires { be_.gemm_algorithms(); }) user_["gemm_algorithms"] = be_.gemm_algorithms();
    if (metrics_.pending().empty()) user_.erase("unwritten_metrics");
    else user_["unwritten_metrics"] = metrics_.pending();
    if (checkpointer_)
      checkpointer_->save(trainer_, built_.store(), grpo_ ? grpo_->position(step) : data_->position(step * s.batch), user_);
  }
  // The train state of `step` saved, unless it is already or no step ran (the first decides).
  void save_unless_saved(std::int64_t step) {
    if (ranks_.lead_says(step > 0 && saved_step_ != step)) {
      save(step);
      wait_saves();
    }
  }
  // After a failure that stops the run: the train state of `step` saved (every process takes part),
  // unless it is already; then what was saved, as a sentence (said by the first process).
  std::string save_for_stop(std::int64_t step) {
    save_unless_saved(step);
    if (step == 0) return "No step had finished: there is nothing to save.";
    if (saved_step_ == step) return fmt::format("The train state of step {} is saved in {}.", step, checkpoint_path(step));
    return fmt::format("The train state of step {} could not be saved (see above); {}.", step,
                       saved_step_ > 0 ? fmt::format("the newest complete checkpoint is step {} ({})", saved_step_,
                                                     checkpoint_path(saved_step_))
                                       : std::string("there is no complete checkpoint"));
  }

  // ---- a step -----------------------------------------------------------------------------------------
  // This process's share of the global batch (docs/distributed.md).
  template <class E>
  std::span<const E> mine(const std::vector<E>& v, std::int64_t rows) const {
    const auto per_process = static_cast<std::size_t>(rows * s.seq);
    return v.empty() ? std::span<const E>()
                     : std::span<const E>(v).subspan(static_cast<std::size_t>(ranks_.rank()) * per_process, per_process);
  }

  // --objective dpo: the reference (computed now, or the resumed checkpoint's), before any checkpoint;
  // --objective grpo: its sampling and rewards.
  void start_objective(const StartState& start) {
    if (s.objective == "dpo")
      preference_.emplace(s, trainer_, *data_, ranks_, start.dpo_reference, in_.plan.data_identity, ranks_.out());
    if (s.objective == "grpo") {
      grpo_.emplace(s, trainer_, in_.plan.grpo, in_.cfg.vocab_size, static_cast<std::int32_t>(in_.cfg.pad_token_id.value_or(0)),
                    in_.cfg.moe_layer_count() > 0);
      progress_.name_validation("val_reward");
    }
  }

  // One step, its metrics, validation, save and export. Returns the exit status where the run stops.
  std::optional<int> train_step(std::int64_t step) {
    if (data_) data_->train_batch((step - 1) * s.batch, s.batch, ids_, labels_, positions_, mask_);
    fault::delay_point("train:step");  // (tests: MEGATRAIN_FAULTS=delay@train:step=MICROSECONDS)
    const std::int64_t rows = in_.topt.batch_rows;
    StepStats st;
    try {
      if (grpo_) {
        st = grpo_->step(step);
        progress_.set_extra(fmt::format(" reward {:.3f}", grpo_->mean_reward()));
      }
      else if (preference_)
        st = preference_->step((step - 1) * s.batch, ranks_.rank() * rows, s.batch, mine(ids_, rows), mine(labels_, rows),
                               mine(positions_, rows), mine(mask_, rows));
      else
        st = trainer_.step(mine(ids_, rows), mine(labels_, rows), mine(positions_, rows), mine(mask_, rows));
    } catch (const megatrain::Error& e) {
      if (trainer_.stopped_because().empty()) throw;
      return stop_nonfinite(e, step - 1);
    }
    if (in_.plan.folder) in_.plan.folder->mark_started();  // (from now on the run folder is this run's, whatever happens)
    // The matrix-product algorithms the first step chose (--gemm-tuning): the first process's for
    // every process, as its checkpoints keep them.
    if constexpr (requires { be_.gemm_algorithms(); })
      if (step == first_step_ && ranks_.several() && !be_.restore_gemm_algorithms(ranks_.lead_text(be_.gemm_algorithms())))
        log_warning("rank {}'s GPU or cuBLASLt differs from the first rank's: it keeps its own matrix-product algorithms",
                    ranks_.rank());
    const double tok_s = static_cast<double>(st.tokens) / st.seconds;
    std::optional<double> val;
    // (a GRPO run without validation prompts: none)
    if (((s.eval_every > 0 && step % s.eval_every == 0) || step == s.steps) && (!grpo_ || in_.plan.grpo->val.size() > 0))
      val = validation(step);
    if (lead_) {
      const nlohmann::json m = metrics_line(st, tok_s, val);
      append_metrics(m, step);
      write_tensorboard(m, step);
    }
    if (metrics_failed(step)) return 1;
    write_samples(step);
    if (val) write_report();
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    progress_.update(st, tok_s, elapsed, val, s.log_every);
    poll_saves();
    if (s.save_every > 0 && (step % s.save_every == 0 || step == s.steps)) save(step);
    if (in_.plan.export_options && (step == s.steps || (s.export_every > 0 && step % s.export_every == 0)))
      if (!export_at(step) && step == s.steps) final_export_failed_ = true;
    return std::nullopt;
  }

  nlohmann::json metrics_line(const StepStats& st, double tok_s, std::optional<double> val) const {
    // (a skipped step's loss or norm is not finite: null in JSON)
    nlohmann::json m{{"step", st.step},           {"loss", st.loss},           {"lr", st.lr},
                     {"grad_norm", st.grad_norm}, {"clip_coef", st.clip_coef}, {"tokens", st.tokens},
                     {"tokens_per_s", tok_s},     {"step_time_s", st.seconds}};
    if (st.skipped) m["skipped"] = true;
    if (trainer_.skipped_steps() > 0) m["skipped_steps"] = trainer_.skipped_steps();
    if (!st.expert_load.empty()) {  // a mixture of experts: what users of MoE training watch
      m["aux_loss"] = st.aux_loss;
      nlohmann::json load = nlohmann::json::array();
      for (const auto& l : st.expert_load) load.push_back({l.layer, l.min, l.max});
      m["expert_tokens"] = load;  // [layer, fewest, most] tokens routed to one expert over the step
    }
    if (val) m[grpo_ ? "val_reward" : "val_loss"] = *val;
    if (preference_) preference_->metrics(m, val.has_value());
    if (grpo_) grpo_->metrics(m);
    return m;
  }

  // --sample-every: the prompts' greedy completions by the weights of this step, into samples.jsonl.
  // A file that cannot be written is said once and left; training goes on.
  void write_samples(std::int64_t step) {
    if (!samples_ || (step % s.sample_every != 0 && step != s.steps)) return;
    const auto t0 = std::chrono::steady_clock::now();
    const std::string error = samples_->sample(trainer_, step, in_.cfg.vocab_size);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (error.empty()) {
      progress_.note(fmt::format("sampled step {} into {} in {:.1f} s", step, samples_->file().string(), secs));
      if (tensorboard_) tensorboard_failed(tensorboard_->texts(step, samples_->texts()), step);
      return;
    }
    progress_.note(fmt::format("megatrain-train: warning: --sample-every: {} at step {}; training goes on without samples",
                               error, step), stderr);
    samples_.reset();
  }

  // The step's numbers as TensorBoard scalars (train/..., val/loss). A file that cannot be written
  // is said once and left: metrics.jsonl is the run's record, and training goes on.
  void write_tensorboard(const nlohmann::json& m, std::int64_t step) {
    if (!tensorboard_) return;
    std::vector<std::pair<std::string, float>> v;
    for (const auto& [key, value] : m.items()) {
      if (key == "step" || !value.is_number()) continue;
      const double x = value.template get<double>();
      if (std::isfinite(x))
        v.emplace_back(key == "val_loss" ? std::string("val/loss") : key == "val_reward" ? std::string("val/reward") : "train/" + key,
                       static_cast<float>(x));
    }
    tensorboard_failed(tensorboard_->scalars(step, v), step);
  }
  void tensorboard_failed(const std::string& error, std::int64_t step) {
    if (error.empty()) return;
    progress_.note(fmt::format("megatrain-train: warning: --tensorboard: '{}' could not be written at step {}: {}; "
                               "training goes on, metrics.jsonl has every step", tensorboard_->path().string(), step, error),
                   stderr);
    tensorboard_.reset();
  }

  void append_metrics(const nlohmann::json& m, std::int64_t step) {
    const std::string error = metrics_.append(m.dump());
    if (!error.empty() && metrics_error_.empty() && s.on_metrics_error == "continue")
      progress_.note(fmt::format("megatrain-train: warning: the metrics of step {} could not be written: {}; training "
                                 "goes on (--on-metrics-error continue), the lines kept until they can be written",
                                 step, error), stderr);
    if (!error.empty() && metrics_error_.empty()) metrics_error_ = error;
  }

  // A metrics line that could not be written (a full disk): the run stops with the train state of
  // the step saved, the lines not written kept with it (--on-metrics-error stop), or goes on keeping
  // them in memory until they can be written (continue).
  bool metrics_failed(std::int64_t step) {
    if (!ranks_.lead_says(!metrics_.pending().empty() && s.on_metrics_error == "stop")) return false;
    const std::string saved = save_for_stop(step);
    if (lead_)
      std::fprintf(stderr, "megatrain-train: error: the metrics of step %lld could not be written: %s. The run stops "
                   "(--on-metrics-error stop). %s%s\n", static_cast<long long>(step), metrics_error_.c_str(), saved.c_str(),
                   saved_step_ == step ? fmt::format(" The metrics not written are kept with it: make room, then resume "
                                                     "with: megatrain-train --resume --out {}", out_.string()).c_str()
                                       : "");
    return true;
  }

  // The mean loss over the labelled tokens of --eval-batches x --batch validation sequences (each
  // process evaluates its share; the sums over the processes give the same mean to rounding);
  // after step `step`.
  double validation(std::int64_t step) {
    const std::int64_t rows = s.eval_batches * s.batch, my_rows = rows / ranks_.world();
    if (preference_) return preference_->validation(rows);  // (the DPO loss of the validation pairs)
    if (grpo_) return grpo_->validation(rows, step);        // (the mean reward of greedy completions)
    std::vector<std::int32_t> vi(static_cast<std::size_t>(rows * s.seq)), vl(vi.size()), vp(data_->packed() ? vi.size() : 0);
    data_->val_batch(0, rows, vi, vl, vp);
    const auto my_labels = mine(vl, my_rows);
    if (!ranks_.several()) return trainer_.evaluate(mine(vi, my_rows), my_labels, my_rows, mine(vp, my_rows));
    // (a process whose rows hold no trained token adds nothing: fine-tuning examples may do that)
    const auto valid = std::count_if(my_labels.begin(), my_labels.end(), [](std::int32_t l) { return l != kIgnoreIndex; });
    const double loss = valid > 0 ? trainer_.evaluate(mine(vi, my_rows), my_labels, my_rows, mine(vp, my_rows)) : 0.0;
    double sums[2] = {loss * static_cast<double>(valid), static_cast<double>(valid)};
    ranks_.comm()->all_reduce_sum(sums);
    MT_CHECK(sums[1] > 0, "the validation sequences hold no trained token (every label is ignored)");
    return sums[0] / sums[1];
  }

  // ---- report.html, in the run folder: at each evaluation and at the end (a failure only warns) ----
  void start_report() {
    report_info_.machine = io::describe_machine(B::kDevice ? ranks_.info().local_rank : -1);
    report_info_.machine["backend"] = backend_;
    report_info_.machine["compute_dtype"] = std::is_same_v<typename B::Weight, float> ? "float32" : "bfloat16";
    if (ranks_.several()) report_info_.machine["processes"] = ranks_.world();
  }
  void write_report() {
    if (!lead_) return;
    try {
      const fault::WriteScope scope("report");
      io::write_run_report(out_, report_info_);
      report_error_.clear();
    } catch (const megatrain::Error& e) {
      if (report_error_.empty())
        progress_.note(fmt::format("megatrain-train: warning: report.html not written: {}", e.reason()), stderr);
      report_error_ = e.reason();
    }
  }

  // ---- what stops a run -------------------------------------------------------------------------------
  // A non-finite step stopped the trainer (every process alike: they stepped the same sums): with
  // the last good state kept (exact clipping), that state is saved as a checkpoint (unless it is
  // already); else the newest checkpoint is named.
  int stop_nonfinite(const megatrain::Error& e, std::int64_t good) {
    trainer_.finish_update();
    wait_saves();
    write_report();
    // (the first process knows what it saved; every process takes part in a save)
    const bool kept = trainer_.stopped_with_last_good_state();
    if (kept) save_unless_saved(good);
    if (lead_) {
      std::string what;
      if (kept && good == 0) what = "No step had finished: there is nothing to save.";
      else if (kept && saved_step_ == good)
        what = fmt::format("The train state of step {} (the last good one) is in {}: resume with `megatrain-train --resume "
                           "--out {}` (add --on-nonfinite skip to skip the step that failed).",
                           good, checkpoint_path(good), out_.string());
      else if (kept)
        what = fmt::format("The train state of step {} could not be saved (see above){}.", good,
                           saved_step_ > 0 ? fmt::format("; the newest complete checkpoint is step {}", saved_step_)
                                           : std::string());
      else
        what = saved_step_ > 0 ? fmt::format("The newest checkpoint from before it is step {} ({}).", saved_step_,
                                             checkpoint_path(saved_step_))
                               : std::string("There is no checkpoint from before it.");
      std::fprintf(stderr, "megatrain-train: error: %s\n%s\n", e.reason().c_str(), what.c_str());
    }
    ranks_.barrier();  // (no process leaves while the first finishes)
    return 1;
  }

  // An export (--export, --export-every) of `step`; where it fails, the train state of the step is
  // saved in the run folder and the message says how to export it again. Returns whether it was
  // written. (Every process calls it at the same step.)
  bool export_at(std::int64_t step) {
    try {
      write_export(step);
      return true;
    } catch (const megatrain::Error& e) {
      const std::string saved = save_for_stop(step);
      if (lead_)
        progress_.note(fmt::format("megatrain-train: {}: the export of step {} to '{}' failed: {}. {}{}{}",
                                   step == s.steps ? "error" : "warning", step, s.export_dir, e.reason(), saved,
                                   saved_step_ == step
                                       ? fmt::format(" Export it again with: megatrain-train --resume {} --steps 0 "
                                                     "--eval-batches 0 --export {}", checkpoint_path(step), s.export_dir)
                                       : std::string(),
                                   step == s.steps ? "" : " Training goes on."),
                       stderr);
      return false;
    }
  }
  void write_export(std::int64_t step) {
    HostParamStore<float>& store = built_.store();
    if (trainer_.options().sharded()) {
      wait_saves();  // (a checkpoint in flight completed first: its writers read the store)
      trainer_.finish_update();
    }
    struct Release {  // (what the export gathered is let go again, whatever happens)
      HostParamStore<float>& store;
      ~Release() { store.release_unowned_state(); }
    } release{store};
    if (built_.gathers_for_export()) store.gather_state(*ranks_.comm(), 0);  // (the masters brought to the first process)
    else if (trainer_.options().sharded()) store.gather_weights(*ranks_.comm(), 0);  // (a bf16 copy held in parts: whole on the first)
    // (the others wait while the first reads the weights, a bf16 copy they map together included,
    // and stop with it where it cannot write the export, instead of at their next collective)
    const auto write = [&] { progress_.note(built_.export_model(step)); };
    if (!ranks_.several()) return write();
    io::agree_on(*ranks_.comm(), lead_, write, [&](const std::vector<int>&) {
      return fmt::format("process 0 could not write the export to {} (its message says why)", s.export_dir);
    });
  }

  // The end: what was written, and every write that failed as an error (exit status 1).
  int finish(std::int64_t done) {
    // Metrics lines that never found room (--on-metrics-error continue) are kept with the train state.
    const bool metrics_lost = ranks_.lead_says(!metrics_.pending().empty());
    const std::string metrics_saved = metrics_lost ? save_for_stop(done) : std::string();
    // (At a normal end the others need not wait for the first's export and last save: a process
    // that ends with status 0 stops nothing.)
    const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    std::fprintf(ranks_.out(), "done: %lld steps in %.1f s; metrics in %s\n", static_cast<long long>(s.steps - first_step_ + 1),
                 total, (out_ / "metrics.jsonl").string().c_str());
    drop_replaced();  // (--overwrite: the new run has finished)
    std::vector<std::string> failed;
    if (last_save_failed_)
      failed.push_back(fmt::format("its last checkpoint could not be written{}",
                                   saved_step_ > 0 ? fmt::format(" (the newest complete one is step {})", saved_step_) : ""));
    if (final_export_failed_) failed.push_back(fmt::format("its export to '{}' failed (see above)", s.export_dir));
    if (metrics_lost)
      failed.push_back(fmt::format("{} lines of metrics.jsonl could not be written ({}). {}", metrics_.pending().size(),
                                   metrics_error_, metrics_saved));
    if (!report_error_.empty()) failed.push_back(fmt::format("report.html could not be written ({})", report_error_));
    if (failed.empty()) return 0;
    if (lead_ || !ranks_.threads())  // (the ranks of one process: said once)
      std::fprintf(stderr, "megatrain-train: error: the run finished, but %s\n", fmt::format("{}", fmt::join(failed, "; ")).c_str());
    return 1;
  }

  B& be_;
  const char* backend_;
  TrainInputs& in_;
  const Settings& s;
  Ranks& ranks_;
  BuiltStep<B>& built_;
  Trainer<B>& trainer_;
  const TokenDataset* data_;  // (none in a GRPO run: its prompts are the data)
  const std::int64_t first_step_;
  std::int64_t saved_step_;  // the newest complete checkpoint (or the one resumed from)
  bool lead_ = false, last_save_failed_ = false, final_export_failed_ = false;
  std::filesystem::path out_;
  io::MetricsLog metrics_;
  std::string metrics_error_;  // (the first failed write's reason; empty while none failed)
  std::optional<io::TensorBoardWriter> tensorboard_;  // --tensorboard
  std::optional<TrainSamples> samples_;               // --sample-every (the first process's)
  std::optional<Checkpointer> checkpointer_;
  std::optional<io::CheckpointFolder> checkpoints_;
  nlohmann::json user_;  // what the checkpoints keep of the run besides the train state
  Progress progress_;
  io::RunReportInfo report_info_;
  std::string report_error_;  // (why the last report could not be written; empty: it was)
  std::chrono::steady_clock::time_point t0_;
  std::vector<std::int32_t> ids_, labels_, positions_;
  std::vector<std::uint8_t> mask_;
  std::optional<PreferenceRun<Trainer<B>>> preference_;  // --objective dpo
  std::optional<GrpoRun<Trainer<B>>> grpo_;              // --objective grpo
};

}  // namespace megatrain::app
