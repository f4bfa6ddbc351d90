// megatrain-train: trains a decoder-only model from the command line.
//
// With no arguments it trains a small Llama-shaped model on the built-in text (byte-level
// tokens) on whatever backend this machine has. Every option can also come from a JSON file
// (--config FILE: an object whose keys are the long option names without the dashes); options
// given on the command line win over the file. Unknown or contradictory options are errors.
// Output: <out>/metrics.jsonl (one JSON object per step), <out>/config.json (the model shape),
// <out>/options.json (every option as resolved), <out>/checkpoints/ (train states).
//
// Hugging Face models: --model DIR fine-tunes a model directory (config.json + safetensors);
// --export DIR writes the trained weights as such a directory at the end (and every
// --export-every N steps), atomically. --steps 0 evaluates only: the validation loss of the
// model on --val-data (or the held-out tail of --data) is printed as one JSON line on stdout,
// and nothing is written (docs/huggingface.md).
//
// Train states (docs/checkpointing.md): --save-every N writes the whole state (masters, Adam
// moments, step, data position, ...) to <out>/checkpoints every N steps, overlapped with the
// next step; SIGINT or SIGTERM finishes the step, saves and exits; --resume continues a run
// exactly where its newest checkpoint left it, with the options it was given.
#include <signal.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <atomic>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "cli.hpp"
#include "ranks.hpp"
#include "gpus.hpp"
#include "stop_signals.hpp"
#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/fault_injection.hpp"
#include "megatrain/core/host_memory.hpp"
#include "megatrain/core/log.hpp"
#include "megatrain/data/token_dataset.hpp"
#include "megatrain/dist/launch.hpp"
#include "megatrain/io/detail/atomic_files.hpp"
#include "megatrain/io/hf_checkpoint.hpp"
#include "megatrain/io/metrics_log.hpp"
#include "megatrain/io/run_folder.hpp"
#include "megatrain/io/run_report.hpp"
#include "megatrain/io/train_checkpoint.hpp"
#include "megatrain/layers/decoder_model.hpp"
#include "megatrain/model/config.hpp"
#include "megatrain/plan/planner.hpp"
#include "megatrain/text/prepare.hpp"
#include "megatrain/train/checkpointer.hpp"
#include "megatrain/train/cpu_trainer.hpp"
#if MEGATRAIN_HAS_CUDA
#include "megatrain/backend/cuda/cuda_backend.hpp"
#include "megatrain/train/cuda_trainer.hpp"
#endif

using namespace megatrain;
using namespace megatrain_train;

namespace {

// ---- signals ----------------------------------------------------------------------------------------
// SIGINT and SIGTERM: stop_signals.hpp (the first asks the run to stop after the current step,
// saving first; a second ends the process at once, removing what it was writing).
// Who this thread's warnings come from ("megatrain-train (rank 1 of 2)"; empty: the program's),
// and this process's (one of several processes: every thread's, a trainer's stages too).
thread_local std::string t_who;
std::string g_who;
// --gpus N: the rank whose failure made this process abort the others' communicators (-1: none).
std::atomic<int> g_failed_rank{-1};
// --gpus N on GPUs: aborts every running rank's communicator (set by main; empty otherwise).
std::function<void()> g_abort_others;

// ---- the model ------------------------------------------------------------------------------------

// ---- progress -------------------------------------------------------------------------------------

// One line that redraws itself on a terminal; plain lines otherwise.
class Progress {
 public:
  /// Prints to `out` (the first rank's stdout; the others' /dev/null).
  Progress(std::int64_t first_step, std::int64_t steps, std::FILE* out)
      : first_(first_step), steps_(steps), out_(out), tty_(out == stdout && isatty(STDOUT_FILENO) != 0) {}
  void update(const StepStats& s, double tok_per_s, double elapsed, std::optional<double> val, std::int64_t log_every) {
    const double eta = elapsed / static_cast<double>(s.step - first_ + 1) * static_cast<double>(steps_ - s.step);
    if (tty_) {
      const int width = 24;
      const int filled = static_cast<int>(width * s.step / steps_);
      std::string bar(static_cast<std::size_t>(filled), '=');
      if (filled < width) bar += '>';
      bar.resize(width, ' ');
      std::fprintf(out_, "\r\033[Kstep %lld/%lld [%s] loss %.4f | %.0f tok/s | ETA %s%s", static_cast<long long>(s.step),
                   static_cast<long long>(steps_), bar.c_str(), s.loss, tok_per_s, clock(eta).c_str(),
                   val ? fmt::format(" | val {:.4f}", *val).c_str() : "");
      if (s.step == steps_ || val) std::fputc('\n', out_);
      std::fflush(out_);
    } else if (s.step % log_every == 0 || s.step == steps_ || val || s.skipped) {
      std::fprintf(out_, "step %lld/%lld loss %.4f lr %.3g grad_norm %.3f tok/s %.0f%s%s%s\n", static_cast<long long>(s.step),
                   static_cast<long long>(steps_), s.loss, s.lr, s.grad_norm, tok_per_s,
                   val ? fmt::format(" val_loss {:.4f}", *val).c_str() : "", experts(s).c_str(),
                   s.skipped ? " (skipped: not finite)" : "");
      std::fflush(out_);
    }
  }
  /// A mixture of experts: the auxiliary loss and the least and most loaded expert of any layer.
  static std::string experts(const StepStats& s) {
    if (s.expert_load.empty()) return {};
    std::int64_t lo = s.expert_load[0].min, hi = s.expert_load[0].max;
    for (const auto& l : s.expert_load) lo = std::min(lo, l.min), hi = std::max(hi, l.max);
    return fmt::format(" aux_loss {:.4f} tokens/expert {}..{}", s.aux_loss, lo, hi);
  }
  /// A line of its own (a save, a warning), not overwritten by the next update.
  void note(const std::string& line, FILE* to = nullptr) {
    if (tty_) std::fputs("\r\033[K", out_);
    std::fflush(out_);
    if (to == nullptr) to = out_;
    std::fprintf(to, "%s\n", line.c_str());
    std::fflush(to);
  }

 private:
  static std::string clock(double secs) {
    const auto t = static_cast<long long>(std::max(0.0, secs));
    return fmt::format("{}:{:02}:{:02}", t / 3600, (t / 60) % 60, t % 60);
  }
  std::int64_t first_, steps_;
  std::FILE* out_;
  bool tty_;
};

// ---- resuming -------------------------------------------------------------------------------------

// The checkpoint a run resumes from, opened (every file checked against its checksum).
struct Resume {
  io::TrainCheckpoint ckpt;
  TrainState state;
  json given;                          // the options its run was given
  std::vector<std::string> side_files;  // Hugging Face side files kept in the checkpoint
};

// A checkpoint folder, opened (every file checked against its checksum) as megatrain-train's.
Resume open_checkpoint(const fs::path& dir) {
  io::TrainCheckpoint ckpt = io::TrainCheckpoint::open(dir);
  TrainState st = train_state_from_json(ckpt.state(), (dir / io::kTrainStateFile).string());
  const json& user = st.user;
  MT_CHECK(user.value("program", "") == "megatrain-train" && user.contains("given") && user["given"].is_object(),
           "--resume '{}': this checkpoint was not written by megatrain-train (load it with megatrain::load_train_state)",
           dir.string());
  std::vector<std::string> side;
  if (user.contains("side_files")) side = user["side_files"].get<std::vector<std::string>>();
  json given = user["given"];
  return {std::move(ckpt), std::move(st), std::move(given), std::move(side)};
}

// A run's checkpoints newest first: the one `latest` names, then those of lower steps (a run's
// checkpoints of higher steps than `latest` were left by a run that went further before this one
// resumed from an earlier step: not this run's state).
std::vector<fs::path> checkpoints_newest_first(const fs::path& root) {
  const io::CheckpointFolder folder(root);
  std::optional<fs::path> latest;
  try {
    latest = folder.latest();
  } catch (const megatrain::Error&) {  // (`latest` names a folder that is gone: every folder, newest first)
  }
  auto all = folder.list();
  std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<fs::path> out;
  std::int64_t below = std::numeric_limits<std::int64_t>::max();
  if (latest) {
    out.push_back(*latest);
    for (const auto& [step, path] : all)
      if (path.filename() == latest->filename()) below = step;
  }
  for (const auto& [step, path] : all)
    if (step < below) out.push_back(path);
  return out;
}

// The checkpoint --resume names, opened: "latest" (the newest intact one of the run in --out), a
// run folder (the same), or a checkpoint folder (that one). A damaged newest checkpoint is named,
// and the newest intact one taken, saying so.
Resume open_resume(const Settings& s) {
  const auto newest_intact = [](const fs::path& run) {
    std::error_code ec;
    MT_CHECK(fs::is_directory(run, ec), "--resume: the run folder '{}' does not exist (give --out the folder of the run "
             "to continue, or --resume a checkpoint folder)", run.string());
    const auto candidates = checkpoints_newest_first(run / "checkpoints");
    MT_CHECK(!candidates.empty(), "--resume: the run '{}' has no checkpoint in '{}' to resume from (a run saves one every "
             "--save-every N steps, at its end when --save-every is given, and when SIGINT or SIGTERM stops it)",
             run.string(), (run / "checkpoints").string());
    std::vector<std::string> damaged;
    for (const fs::path& c : candidates) {
      try {
        Resume r = open_checkpoint(c);
        if (!damaged.empty())
          std::fprintf(stderr, "megatrain-train: warning: %s; resuming from the newest intact checkpoint, '%s' (step %lld)\n",
                       fmt::format("{}", fmt::join(damaged, "; ")).c_str(), c.string().c_str(),
                       static_cast<long long>(r.state.step));
        return r;
      } catch (const megatrain::Error& e) {
        damaged.push_back(fmt::format("the checkpoint '{}' cannot be resumed from: {}", c.string(), e.reason()));
      }
    }
    MT_FAIL("--resume: no checkpoint of the run '{}' can be resumed from: {}", run.string(), fmt::join(damaged, "; "));
  };
  if (s.resume == "latest") {
    MT_CHECK(!s.out.empty(), "--resume needs the run to continue: give --out RUN_DIR (its checkpoints are in "
             "RUN_DIR/checkpoints), or --resume CHECKPOINT_DIR");
    return newest_intact(s.out);
  }
  const fs::path p(s.resume);
  std::error_code ec;
  MT_CHECK(fs::is_directory(p, ec), "--resume '{}': no such folder", s.resume);
  if (!fs::exists(p / io::kChecksumsFile, ec)) {
    MT_CHECK(fs::is_directory(p / "checkpoints", ec), "--resume '{}' is neither a checkpoint folder (it has no {}) nor a "
             "run folder (it has no checkpoints/)", s.resume, io::kChecksumsFile);
    return newest_intact(p);
  }
  try {
    return open_checkpoint(p);
  } catch (const megatrain::Error& e) {
    // (the checkpoint asked for by name is not replaced by another: the others are named)
    std::vector<std::string> intact;
    if (p.parent_path().filename() == "checkpoints")
      for (const fs::path& c : checkpoints_newest_first(p.parent_path()))
        if (c.filename() != p.filename()) try {
            (void)io::TrainCheckpoint::open(c);
            intact.push_back(c.string());
          } catch (const megatrain::Error&) {
          }
    MT_FAIL("{}{}", e.reason(), intact.empty() ? std::string()
                                                : fmt::format(" (intact checkpoints of this run: {})", fmt::join(intact, ", ")));
  }
}

// Whether a resume that writes to the run folder `out` continues the run of `checkpoint` (it
// lies in out/checkpoints) rather than branching from it into another folder.
bool continues_run(const fs::path& checkpoint, const fs::path& out) {
  std::error_code ec;
  const fs::path a = fs::weakly_canonical(fs::absolute(checkpoint), ec).parent_path();
  const fs::path b = fs::weakly_canonical(fs::absolute(out) / "checkpoints", ec);
  return a == b;
}

// The config.json a run keeps and exports for a model not read from a Hugging Face folder: the
// model's own (ModelConfig::to_json), with the token ids of the --model-config file it came from
// (where it gave them), else of its --tokenizer, so that generation in transformers knows them.
std::string config_text_of(const ModelConfig& cfg, const std::string& model_config, std::optional<std::int32_t> bos,
                           std::optional<std::int32_t> eos) {
  json j = cfg.to_json();
  json file = json::object();
  if (!model_config.empty()) file = json::parse(io::read_side_file(model_config));
  for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"})
    if (file.contains(key) && !j.contains(key)) j[key] = file[key];
  if (bos && !j.contains("bos_token_id")) j["bos_token_id"] = *bos;
  if (eos && !j.contains("eos_token_id")) j["eos_token_id"] = *eos;
  return j.dump(2) + "\n";
}

// A new run's identity (kept in its checkpoints and exports): 16 random hex digits.
std::string new_run_id() { return io::detail::random_suffix() + io::detail::random_suffix(); }

// The training option a TrainerOptions field comes from.
std::string option_of(const std::string& field) {
  static const std::map<std::string, std::string> names{
      {"batch_rows", "--batch"},        {"seq_len", "--seq"},           {"adamw.lr", "--lr"},
      {"schedule.lr", "--lr"},          {"adamw.beta1", "--beta1"},     {"adamw.beta2", "--beta2"},
      {"adamw.eps", "--eps"},           {"adamw.weight_decay", "--weight-decay"}, {"schedule.kind", "--schedule"},
      {"schedule.warmup_steps", "--warmup (or --warmup-ratio)"}, {"schedule.total_steps", "--steps (of the first run: the schedule's length)"},
      {"schedule.min_lr", "--min-lr (or --min-lr-ratio)"},  {"clip_norm", "--clip"},        {"clip_mode", "--clip-mode"}};
  const auto it = names.find(field);
  return it == names.end() ? field : it->second;
}

// ---- what train() needs besides the trainer's options -----------------------------------------------
struct RunPlan {
  std::optional<io::HfCheckpoint> hf;    // --model: weights to load (released once loaded)
  std::optional<Resume> resume;          // --resume: the state to load
  fs::path out;                          // run directory (none when evaluating only)
  bool eval_only = false;                // --steps 0
  std::int64_t eval_rows = 0;            // eval_only: validation windows to evaluate (0: none)
  std::optional<io::HfExportOptions> export_options;  // --export
  std::string config_text;               // config.json of the model (kept in checkpoints)
  std::map<std::string, std::string> side_files;  // tokenizer files etc. (kept in checkpoints, exported)
  json given;                            // the options this run was given (kept in checkpoints)
  json data_identity;                    // the data's digests (kept in checkpoints)
  std::shared_ptr<const fs::path> temp_data;  // data prepared for this run only (evaluation; a resume's, until accepted): removed with the plan
  std::string run_id;                    // this run's identity: in its checkpoints and its exports' megatrain_export.json
  std::vector<std::string> notes;        // said once the run starts
  bool branch = false;                   // --resume from another run's checkpoint into a run folder of its own
  std::shared_ptr<io::RunFolder> folder;  // the run folder, claimed by this process (the first rank's)
};

template <class B>
int train(B& be, const char* backend_name, const Settings& s, const CLI::App& app, const ModelConfig& cfg,
          const std::optional<TokenDataset>& data, TrainerOptions topt, RunPlan& plan, Ranks& ranks);

// The run folder, claimed by the first rank before anything is written in it (io/run_folder.hpp):
// locked for the run's life; with --overwrite, the previous run moved aside.
void claim_run_folder(const Settings& s, RunPlan& plan, Ranks& ranks) {
  if (!ranks.lead()) {  // (the first rank's folder is the run's: the others learn it later)
    plan.out = s.out.empty() ? fs::path(default_out_dir()) : fs::path(s.out);
    return;
  }
  io::RunClaimOptions o;
  o.resume = plan.resume.has_value() && !plan.branch;  // (a branch starts a run folder of its own)
  o.overwrite = s.overwrite;
  for (const std::string* in : {&s.data, &s.val_data, &s.model_dir, &s.model_config, &s.tokenizer})
    if (!in->empty()) o.inputs.emplace_back(*in);
  if (plan.resume) o.inputs.push_back(plan.resume->ckpt.dir());
  plan.folder = std::make_shared<io::RunFolder>(s.out.empty() ? io::RunFolder::claim_new("runs", o)
                                                              : io::RunFolder::claim(s.out, o));
  plan.out = plan.folder->path();
  if (!plan.folder->taken_over_from().empty())
    plan.notes.push_back(fmt::format("note: took over the run folder's lock from {}, which is no longer running",
                                     plan.folder->taken_over_from()));
  if (const auto& r = plan.folder->replaced())
    plan.notes.push_back(fmt::format("--overwrite: the previous run in '{}' was moved to '{}'; it is removed once this run "
                                     "has saved a checkpoint or finished, and put back if this run stops before its first "
                                     "step", plan.out.string(), r->string()));
}

int run(const Settings& s, const CLI::App& app, RunPlan plan, Ranks& ranks) {
  // ---- validate everything before touching anything ------------------------------------------
  MT_CHECK(s.backend == "auto" || s.backend == "cpu" || s.backend == "cuda", "--backend must be auto, cpu or cuda (got '{}')",
           s.backend);
  MT_CHECK(!(s.backend == "cuda" && !MEGATRAIN_HAS_CUDA), "--backend cuda: megatrain was built without CUDA");
  MT_CHECK(!(s.backend == "cuda" && !cuda_device_present()), "--backend cuda: no usable GPU was found");
  const bool use_cuda = s.backend == "cuda" || (s.backend == "auto" && cuda_device_present());
  MT_CHECK(s.gpu_memory.empty() || use_cuda, "--gpu-memory needs the cuda backend");
  MT_CHECK(s.schedule == "constant" || s.schedule == "cosine" || s.schedule == "linear",
           "--schedule must be cosine, linear or constant (got '{}')", s.schedule);
  for (const char* f : {"--min-lr", "--min-lr-ratio"})
    MT_CHECK(!(s.schedule == "constant" && s.origins.conflicts(f, "--schedule")),
             "{} needs --schedule cosine or linear (a constant schedule has no floor)", f);
  MT_CHECK(!s.origins.given("--min-lr-ratio") || (s.min_lr_ratio >= 0 && s.min_lr_ratio <= 1),
           "--min-lr-ratio must be in [0, 1] (got {})", s.min_lr_ratio);
  MT_CHECK(!s.origins.given("--min-lr") || (s.min_lr >= 0 && s.min_lr <= s.lr),
           "--min-lr must be in [0, --lr] (got {} with --lr {}); --min-lr-ratio sets it relative to --lr", s.min_lr, s.lr);
  MT_CHECK(!s.origins.given("--warmup-ratio") || (s.warmup_ratio >= 0 && s.warmup_ratio < 1),
           "--warmup-ratio must be in [0, 1) (got {})", s.warmup_ratio);
  MT_CHECK(!s.origins.given("--warmup") || s.warmup >= 0, "--warmup must be >= 0 (got {})", s.warmup);
  MT_CHECK(s.clip_mode == "exact" || s.clip_mode == "stale", "--clip-mode must be exact or stale (got '{}')", s.clip_mode);
  MT_CHECK(s.gradients == "auto" || s.gradients == "device" || s.gradients == "host",
           "--gradients must be auto, device or host (got '{}')", s.gradients);
  MT_CHECK(s.on_nonfinite == "stop" || s.on_nonfinite == "skip", "--on-nonfinite must be stop or skip (got '{}')",
           s.on_nonfinite);
  MT_CHECK(s.max_nonfinite_skips >= 1, "--max-nonfinite-skips must be >= 1 (got {})", s.max_nonfinite_skips);
  for (const auto& [flag, v] : {std::pair{"--device-units", &s.device_units}, std::pair{"--keep-activations", &s.keep_activations}})
    MT_CHECK(parse_auto_all_count(*v).has_value(), "{} must be auto, all or a count >= 0 (got '{}')", flag, *v);
  MT_CHECK(parse_auto_all_count(s.spill_activations).value_or(kAll) != kAll,
           "--spill-activations must be auto or a count >= 0 (got '{}')", s.spill_activations);
  MT_CHECK(!(s.clip == 0 && s.origins.conflicts("--clip-mode", "--clip")), "--clip-mode given but clipping is off (--clip 0)");
  MT_CHECK(s.data_format == "auto" || s.data_format == "u16" || s.data_format == "u32",
           "--data-format must be auto, u16 or u32 (got '{}')", s.data_format);
  MT_CHECK(s.val_data.empty() || !s.origins.conflicts("--val-fraction", "--val-data"),
           "--val-fraction contradicts --val-data: validation comes from that file; drop one");
  MT_CHECK(s.steps >= 0, "--steps must be >= 0 (got {}; 0 evaluates only)", s.steps);
  MT_CHECK(!s.origins.given("--out") || !s.out.empty(), "--out is empty: give the folder for the run (without --out: "
           "runs/<date-time>)");
  const bool eval_only = s.steps == 0;
  for (const char* flag : {"--shard-optimizer", "--share-weights", "--gather-weights"})
    MT_CHECK(ranks.several() || !s.origins.given_now(flag),
             "{} applies to several processes (launched by torchrun, mpirun or srun, or --gpus); drop it", flag);
  MT_CHECK(s.share_weights != "true" || s.shard_optimizer,
           "--share-weights true shares the weights of processes that each step 1/N of them: it needs --shard-optimizer "
           "true");
  // Several processes (docs/distributed.md): --batch and --micro-batches are the global batch's.
  if (ranks.several()) {
    MT_CHECK(!eval_only, "{}", ranks.threads()
                                   ? fmt::format("--steps 0 (evaluate or export) runs on one GPU: drop --gpus {}", s.gpus)
                                   : fmt::format("--steps 0 (evaluate or export) runs in one process, and this is process {} "
                                                 "of {} ({} launched them): run it once", ranks.rank(), ranks.world(),
                                                 ranks.info().launcher));
    MT_CHECK(s.batch % ranks.world() == 0, "--batch {} (the global batch) must be a multiple of the {} {}: each "
             "trains --batch / {} of its sequences", s.batch, ranks.world(), ranks.threads() ? "GPUs (--gpus)" : "processes",
             ranks.world());
    MT_CHECK(s.micro_batches == 1 || s.micro_batches % ranks.world() == 0,
             "--micro-batches {} (the passes of the global batch) must be 1 or a multiple of the {} {}: each runs "
             "--micro-batches / {} of them", s.micro_batches, ranks.world(),
             ranks.threads() ? "GPUs (--gpus)" : "processes", ranks.world());
  }
  MT_CHECK(s.eval_every >= 0 && s.log_every > 0, "--eval-every >= 0, --log-every > 0");
  MT_CHECK(s.eval_batches > 0 || (eval_only && s.eval_batches == 0),
           "--eval-batches must be > 0 (0, no evaluation, only with --steps 0)");
  MT_CHECK(s.save_every >= 0 && s.keep >= 0, "--save-every and --keep must be >= 0 (got {} and {})", s.save_every, s.keep);
  MT_CHECK(!(s.data.empty() && !s.val_data.empty()) || eval_only,
           "--val-data needs --data (except with --steps 0, which evaluates on --val-data alone)");
  MT_CHECK(!(eval_only && !s.out.empty() && !plan.resume),
           "--steps 0 evaluates only and writes no run directory: drop --out (the loss is printed as JSON)");
  if (eval_only)  // options that only shape training would be ignored: refuse them
    for (const char* f : {"--lr", "--min-lr", "--min-lr-ratio", "--warmup", "--warmup-ratio", "--schedule", "--weight-decay", "--beta1", "--beta2", "--eps", "--clip",
                          "--clip-mode", "--micro-batches", "--overwrite", "--eval-every", "--log-every", "--save-every", "--keep",
                          "--device-units", "--keep-activations", "--spill-activations", "--gradients", "--gemm-tuning",
                          "--on-metrics-error"})
      MT_CHECK(!s.origins.conflicts(f, "--steps"), "{} has no effect with --steps 0 (evaluation only); drop it", f);
  check_model_source(s);
  plan.eval_only = eval_only;

  // Export: every contradiction is found now, not after hours of training.
  MT_CHECK(!s.model_dir.empty() || !s.origins.conflicts("--allow-dtype-mismatch", "--model"),
           "--allow-dtype-mismatch needs --model DIR");
  for (const char* f : {"--export-every", "--export-dtype", "--shard-size"})
    MT_CHECK(!s.export_dir.empty() || !s.origins.conflicts(f, "--export"), "{} needs --export DIR", f);
  MT_CHECK(s.export_every >= 0, "--export-every must be >= 0 (got {}; 0 exports only at the end)", s.export_every);
  MT_CHECK(!(eval_only && s.export_every > 0 && s.origins.conflicts("--export-every", "--steps")),
           "--export-every needs training steps (--steps 0 exports once)");
  MT_CHECK(!(eval_only && s.eval_batches == 0 && s.export_dir.empty()),
           "--steps 0 --eval-batches 0 does nothing: add --export DIR (export without evaluating)");
  if (!s.export_dir.empty()) {
    io::HfExportOptions e;
    MT_CHECK(s.export_dtype == "bf16" || s.export_dtype == "f16" || s.export_dtype == "f32",
             "--export-dtype must be bf16, f16 or f32 (got '{}')", s.export_dtype);
    e.dtype = s.export_dtype == "f32" ? DType::f32 : s.export_dtype == "f16" ? DType::f16 : DType::bf16;
    e.max_shard_bytes = io::parse_shard_size(s.shard_size);
    io::check_hf_export_target(s.export_dir, plan.run_id);
    e.owner = plan.run_id;
    plan.export_options = std::move(e);
  }
  // (--gpus N: set once by main, before the ranks' threads start)
  if (!s.host_memory.empty() && !ranks.threads()) setenv("MEGATRAIN_HOST_MEMORY", s.host_memory.c_str(), 1);

  // The model: a resumed run's is its checkpoint's; a Hugging Face model is opened and checked
  // against its config.json before anything else.
  std::optional<ModelConfig> cfg;
  if (plan.resume) {
    const auto text = plan.resume->ckpt.file("config.json");
    MT_CHECK(text.has_value(), "--resume '{}': the checkpoint has no config.json", plan.resume->ckpt.dir().string());
    cfg = ModelConfig::from_json(json::parse(*text), "the checkpoint's config.json");
    plan.config_text = *text;
    for (const auto& name : plan.resume->side_files) {
      const auto f = plan.resume->ckpt.file(name);
      MT_CHECK(f.has_value(), "--resume '{}': the checkpoint lists {} but lacks it", plan.resume->ckpt.dir().string(), name);
      plan.side_files[name] = *f;
    }
  }
  if (!s.model_dir.empty()) {
    io::HfOpenOptions open_options;
    open_options.allow_dtype_mismatch = s.allow_dtype_mismatch;
    plan.hf = io::HfCheckpoint::open(s.model_dir, open_options);
    StopSignals::check("while opening the model");
    if (!plan.resume) {
      plan.config_text = plan.hf->config_text();
      plan.side_files = io::hf_side_files(s.model_dir);
    }
  }

  // Data first: text data's vocabulary (bytes) sizes a model given on the command line; token
  // files need the vocabulary given, which decides their width unless --data-format does.
  // (With --steps 0 --eval-batches 0 nothing is evaluated and no data is read.)
  const bool need_data = !(eval_only && s.eval_batches == 0);
  if (!eval_only) claim_run_folder(s, plan, ranks);
  fault::delay_point("train:setup");  // (tests: a signal that lands before training starts)
  StopSignals::check("while starting");
  std::string data_file = !s.data.empty() ? s.data : (eval_only ? s.val_data : std::string());
  std::string val_file = s.val_data;
  MT_CHECK(s.train_on == "completion" || s.train_on == "prompt+completion",
           "--train-on must be completion or prompt+completion (got '{}')", s.train_on);
  // JSON data, and text with a tokenizer, are tokenised first (megatrain-tokenize's work) into
  // token files in the run folder (a temporary folder when only evaluating), then memory-mapped.
  std::optional<text::PrepareResult> prepared;
  std::optional<std::int32_t> tokenizer_bos, tokenizer_eos;  // (a --tokenizer's, for an export's config.json)
  if (need_data && !data_file.empty()) {
    const std::string ext = fs::path(data_file).extension().string();
    const bool json_data = ext == ".jsonl" || ext == ".json";
    const std::string tokenizer = !s.tokenizer.empty() ? s.tokenizer : plan.hf ? s.model_dir : std::string();
    MT_CHECK(!json_data || !tokenizer.empty(),
             "--data '{}' is JSON records, tokenised with the model's own tokenizer: give --model DIR (a Hugging Face folder "
             "with tokenizer.json) or --tokenizer", data_file);
    for (const char* f : {"--chat-format", "--skip-bad-lines"})
      MT_CHECK(json_data || !s.origins.conflicts(f, "--data"), "{} applies to JSON data; --data '{}' is not", f, data_file);
    MT_CHECK(!s.origins.given("--tokenizer") || ext != ".bin", "--tokenizer applies to text and JSON data; --data '{}' holds "
             "token ids already", data_file);
    if (ext != ".bin" && !tokenizer.empty()) {
      MT_CHECK(!s.origins.conflicts("--data-format", "--data"),
               "--data-format applies to .bin token files; --data '{}' is tokenised with the model's tokenizer", data_file);
      std::error_code ec;
      const fs::path tp(tokenizer);
      const auto tok = fs::is_directory(tp, ec) ? text::Tokenizer::from_folder(tp) : text::Tokenizer::from_file(tp);
      StopSignals::check("while loading the tokenizer");
      tokenizer_bos = tok.bos_id();
      tokenizer_eos = tok.eos_id();
      // A run on a tokenizer of its own (not --model's): its files go with the checkpoints and
      // exports, as a model folder's would.
      if (!plan.hf && !plan.resume) {
        plan.side_files = io::hf_side_files(fs::is_directory(tp, ec) ? tp : tp.parent_path());
        if (!fs::is_directory(tp, ec)) plan.side_files["tokenizer.json"] = io::read_side_file(tp);
      }
      // (evaluating only: a temporary folder; resuming: RUN/data/incoming, moved over RUN/data's
      // files once the resume is accepted, so a refused resume leaves the run's data as it was)
      // (a process of several other than the first: a folder of its own, as the first writes the run folder's)
      const bool temp = eval_only || !ranks.lead();
      const fs::path dir = temp          ? fs::temp_directory_path() / fmt::format("megatrain-data-{}-{}", getpid(), ranks.rank())
                           : plan.resume ? plan.out / "data" / "incoming"
                                         : plan.out / "data";
      if (temp || plan.resume) {
        std::error_code ignored;
        fs::remove_all(dir, ignored);
        plan.temp_data = std::shared_ptr<const fs::path>(new fs::path(dir), [](const fs::path* p) {
          std::error_code ignored_too;
          fs::remove_all(*p, ignored_too);
          delete p;
        });
      }
      fs::create_directories(dir);
      const auto prepare = [&](const std::string& in, const char* name, const char* option) {
        text::PrepareOptions po;
        po.input = in;
        po.output = dir / name;
        po.chat_format = s.chat_format;
        po.skip_bad_lines = s.skip_bad_lines;
        po.overwrite = true;  // (the run folder's own copy)
        po.input_option = option;
        po.skip_option = "--skip-bad-lines true";
        // (one bar, the first rank's; a stop signal ends the preparation, leaving nothing behind)
        po.progress = [bar = ranks.lead() ? text::terminal_progress(in) : nullptr](std::uintmax_t done, std::uintmax_t total) {
          StopSignals::check("while preparing the data");
          if (bar) bar(done, total);
        };
        auto r = text::prepare_token_files(tok, po);
        std::fprintf(eval_only ? stderr : ranks.out(), "%s\n", r.summary.c_str());
        return r;
      };
      prepared = prepare(data_file, "train.bin", "--data");
      data_file = (dir / "train.bin").string();
      if (!val_file.empty()) {
        MT_CHECK(fs::path(val_file).extension() != ".bin",
                 "--val-data '{}' holds token ids but --data '{}' is tokenised here: give both as token files, or both as "
                 "JSON or text", val_file, s.data);
        const auto v = prepare(val_file, "val.bin", "--val-data");
        MT_CHECK(v.examples == prepared->examples, "--val-data '{}' holds {} but --data '{}' holds {}: give both alike", val_file,
                 v.examples ? "examples" : "documents", s.data, prepared->examples ? "examples" : "documents");
        val_file = (dir / "val.bin").string();
      }
    }
  }
  const bool bin_data = need_data && fs::path(data_file).extension() == ".bin";
  MT_CHECK(!bin_data || s.vocab > 0 || plan.hf || plan.resume || !s.model_config.empty() || !s.preset.empty(),
           "--data '{}' holds token ids{}: give the vocabulary (--vocab, --model, --model-config or --preset)", s.data.empty() ? data_file : s.data, prepared ? " once tokenised" : "");
  MT_CHECK(!need_data || bin_data || !s.origins.conflicts("--data-format", "--data"),
           "--data-format applies to .bin token files, but the data is text ({}), tokenised by bytes",
           data_file.empty() ? "the built-in text" : data_file);
  // auto: uint32 where the vocabulary does not fit 16 bits, else uint16 (the reader refuses a
  // file whose contents say otherwise).
  TokenFormat fmt_bin = s.data_format == "u32" ? TokenFormat::u32 : TokenFormat::u16;
  if (prepared) {
    fmt_bin = prepared->wide ? TokenFormat::u32 : TokenFormat::u16;
  } else if (s.data_format == "auto" && bin_data) {
    const std::int64_t vocab = cfg ? cfg->vocab_size : model_config(s, app, 0, plan.hf ? &*plan.hf : nullptr).vocab_size;
    fmt_bin = vocab > 65536 ? TokenFormat::u32 : TokenFormat::u16;
  }
  std::optional<TokenSource> train_src;
  if (need_data)
    train_src = !data_file.empty() ? TokenSource::open(data_file, fmt_bin)
                                   : TokenSource::from_text(builtin_text(1 << 20, 1), "built-in text");
  const bool text_data = train_src && train_src->format() == TokenFormat::text;
  const std::int64_t data_vocab = text_data ? 256 : 0;
  if (plan.resume) {
    // Model options given again must describe the checkpoint's model.
    std::vector<std::string> opts = model_source_options();
    opts.insert(opts.end(), model_shape_options().begin(), model_shape_options().end());
    if (std::any_of(opts.begin(), opts.end(), [&](const std::string& o) { return s.origins.given_now(o); })) {
      const ModelConfig given = model_config(s, app, data_vocab, plan.hf ? &*plan.hf : nullptr);
      const auto diff = model_differences(cfg->to_json(), given.to_json());
      MT_CHECK(diff.empty(), "--resume: the model options given describe another model than the checkpoint's "
               "(checkpoint vs given: {}); drop them (the checkpoint holds the model)", fmt::join(diff, "; "));
    }
  } else {
    cfg = model_config(s, app, data_vocab, plan.hf ? &*plan.hf : nullptr);
    if (plan.config_text.empty()) plan.config_text = config_text_of(*cfg, s.model_config, tokenizer_bos, tokenizer_eos);
  }
  if (plan.export_options) {
    plan.export_options->config_json = plan.config_text;
    plan.export_options->extra_files = plan.side_files;
  }
  MT_CHECK(!text_data || cfg->vocab_size >= 256,
           "text data is tokenised by bytes (vocabulary 256) but the model's vocab_size is {}", cfg->vocab_size);
  // A pretrained model reads its own tokenizer's ids: byte ids would train it on nonsense (unless
  // its vocabulary is the 256 bytes, as a model megatrain-train trained on text is).
  MT_CHECK(!text_data || !plan.hf || cfg->vocab_size == 256,
           "{} is text, which megatrain-train tokenises by bytes (ids 0-255), not with the tokenizer of --model '{}' "
           "(vocabulary {}): tokenise it with the model's tokenizer first (megatrain-tokenize --tokenizer '{}' --input "
           "FILE --output train.bin) and pass the token file as --data", data_file.empty() ? std::string("the built-in text") : "--data '" + data_file + "'",
           s.model_dir, cfg->vocab_size, s.model_dir);
  std::optional<TokenSource> val_src;
  if (need_data && !val_file.empty()) {
    val_src = TokenSource::open(val_file, fmt_bin);
    MT_CHECK((val_src->format() == TokenFormat::text) == text_data,
             "--val-data '{}' is {} but --data '{}' is {}: both must be token files, or both text", s.val_data,
             val_src->format() == TokenFormat::text ? "text" : "a token file", s.data, text_data ? "text" : "a token file");
  }
  std::optional<TokenDataset> data;
  if (need_data) {
    DatasetOptions dopt;
    dopt.vocab_size = cfg->vocab_size;
    dopt.seq_len = s.seq;
    dopt.val_fraction = s.val_fraction;
    dopt.seed = s.seed;
    dopt.train_on_prompt = s.train_on == "prompt+completion";
    dopt.pack = s.pack;
    MT_CHECK(train_src->has_examples() || !s.origins.conflicts("--train-on", "--data"),
             "--train-on applies to fine-tuning examples (prompt/completion, alpaca, conversations); --data '{}' is documents, "
             "every token of which is trained on", s.data.empty() ? "built-in text" : s.data);
    MT_CHECK(train_src->has_examples() || !s.pack,
             "--pack applies to fine-tuning examples (prompt/completion, alpaca, conversations); --data '{}' is documents, "
             "which fill every sequence already", s.data.empty() ? "built-in text" : s.data);
    data.emplace(std::move(*train_src), dopt, std::move(val_src));
    plan.data_identity = {{"train_digest", data->train_source().digest()},
                          {"train_tokens", data->train_source().size()},
                          {"label", data->train_source().label()}};
    if (data->examples()) {
      const ExampleStats &t = data->train_examples(), &v = data->val_examples();
      plan.data_identity["examples"] = data->train_source().examples();
      plan.data_identity["train_on"] = s.train_on;
      plan.data_identity["pack"] = s.pack;
      const auto cut = [&](const ExampleStats& x) {
        std::string w;
        if (x.truncated) w += fmt::format(", {} cut at --seq {}", x.truncated, s.seq);
        if (x.dropped) w += fmt::format(", {} left out: no trained token within --seq", x.dropped);
        return w;
      };
      std::fprintf(eval_only ? stderr : ranks.out(),
                   "examples: %lld for training%s; %lld for validation%s; %lld trained tokens of %lld (--train-on %s), %s\n",
                   static_cast<long long>(t.examples - t.dropped), cut(t).c_str(), static_cast<long long>(v.examples - v.dropped),
                   cut(v).c_str(), static_cast<long long>(t.labels), static_cast<long long>(t.tokens), s.train_on.c_str(),
                   (s.pack ? fmt::format("packed into {} sequences of --seq {} ({:.1f}% of their tokens are examples'; --pack)", t.rows,
                                         s.seq, 100.0 * static_cast<double>(t.tokens - (t.examples - t.dropped)) /
                                                    static_cast<double>(t.rows * s.seq))
                           : fmt::format("one example per sequence, padded to --seq {}", s.seq)).c_str());
    }
  }

  TrainerOptions topt = step_layout(s, cfg->num_hidden_layers);
  if (ranks.several()) {  // (this process's share of the global batch)
    topt.batch_rows = s.batch / ranks.world();
    topt.micro_batches = std::max<std::int64_t>(1, s.micro_batches / ranks.world());
    topt.comm = ranks.comm();
    topt.shard_optimizer = s.shard_optimizer;  // (ZeRO-1: each process keeps and steps 1/N of AdamW's state)
    // (one bf16 copy for the host's processes: where each runs here, as the launcher says, unless
    // told; the store checks that they do)
    topt.share_host_weights = share_weights(s, ranks.info().local_world == ranks.world());
    // (the ranks on this host share its CPU: the plan divides its AdamW rate among them; a
    // launcher that does not say how many run here: every rank, as on one host)
    topt.host_processes = ranks.info().local_world > 0 ? std::min(ranks.info().local_world, ranks.world()) : 0;
    topt.gather_weights_on_device = s.gather_weights == "gpus";
    check_bf16_copy_option(s, topt.sharded(), ranks.world());
  }
  topt.packed = data && data->packed();
  topt.adamw = {s.lr, s.beta1, s.beta2, s.eps, s.weight_decay};
  if (eval_only) {
    // Every validation window once (at most --eval-batches x --batch when --eval-batches is given),
    // in batches of at most --batch sequences; no optimizer state is needed.
    plan.eval_rows = data ? data->val_windows() : 0;
    if (app.get_option("--eval-batches")->count() > 0) plan.eval_rows = std::min(plan.eval_rows, s.eval_batches * s.batch);
    topt.batch_rows = std::max<std::int64_t>(1, std::min(s.batch, plan.eval_rows));
    topt.micro_batches = 1;  // (--max-micro-batch still splits each evaluation batch)
    topt.device_units = 0;   // (no optimizer state is needed)
    topt.kept_blocks = 0;    // (no backward)
    topt.spilled_blocks = 0;
    topt.schedule = {LrSchedule::Kind::constant, s.lr, 0, 0, 0.0};
  } else {
    // A resumed run keeps its schedule's length (set by its first run's --steps): --steps then
    // only says where this run stops.
    const TrainerOptions* before = plan.resume ? &plan.resume->state.options : nullptr;
    const std::int64_t length = before && before->schedule.decays() ? before->schedule.total_steps : s.steps;
    const bool decays = s.schedule != "constant";
    const std::int64_t warmup =
        decides(s, "--warmup-ratio", "--warmup")
            ? static_cast<std::int64_t>(std::ceil(s.warmup_ratio * static_cast<double>(length)))
        : s.origins.given("--warmup") ? s.warmup
        : decays                      ? std::min<std::int64_t>(10, length / 5)
                                      : 0;
    const auto kind = s.schedule == "cosine"   ? LrSchedule::Kind::warmup_cosine
                      : s.schedule == "linear" ? LrSchedule::Kind::warmup_linear
                                               : LrSchedule::Kind::constant;
    topt.schedule = {kind, s.lr, warmup, decays ? length : 0, decays ? min_lr_of(s) : 0.0};
    if (decays && length <= warmup)
      MT_FAIL("--warmup {} leaves no steps for the {} decay of --steps {}{}", warmup, s.schedule, length,
              before ? " (the first run's: the schedule's length)" : "");
    topt.clip_norm = s.clip;
    topt.clip_mode = s.clip_mode == "stale" ? ClipMode::stale : ClipMode::exact;
    topt.on_nonfinite = s.on_nonfinite == "skip" ? NonFinite::skip : NonFinite::stop;
    topt.max_nonfinite_skips = s.max_nonfinite_skips;
    MT_CHECK(topt.on_nonfinite == NonFinite::stop || topt.resolved().resident_gradients(),
             "--on-nonfinite skip needs the whole gradient before any update, which exact clipping gives (--clip > 0 "
             "with --clip-mode exact, the default); with {} each unit is updated during the backward",
             s.clip == 0 ? "--clip 0" : "--clip-mode stale");
    MT_CHECK(!ranks.several() || topt.resolved().resident_gradients(),
             "{} processes sum the whole gradient of each step before the update, which needs it held for the step: "
             "exact clipping (--clip > 0 with --clip-mode exact, the default) or more than one pass a process "
             "(--micro-batches {} or more); {} updates each unit during the backward", ranks.world(), 2 * ranks.world(),
             s.clip == 0 ? "--clip 0" : "--clip-mode stale");
  }
  topt.validate();
  MT_CHECK(!s.origins.conflicts("--micro-batches", "--max-micro-batch") || topt.resolved().micro_batches == topt.micro_batches,
           "--micro-batches {} contradicts --max-micro-batch {}: parts of {} sequences are more than {}; pass one of them",
           s.micro_batches, s.max_micro_batch, s.batch / std::max<std::int64_t>(s.micro_batches, 1), s.max_micro_batch);

  // A resumed run must train exactly as the run it continues.
  if (plan.resume && !eval_only) {
    const Resume& r = *plan.resume;
    const fs::path dir = r.ckpt.dir();
    std::vector<std::string> diff;
    for (const auto& d : update_differences(r.state.options, topt)) {
      std::string line = fmt::format("{} (checkpoint: {}, now: {})", option_of(d.field), d.before, d.after);
      if (std::find(diff.begin(), diff.end(), line) == diff.end()) diff.push_back(std::move(line));
    }
    const json& was = r.state.user["data"];
    const std::string digest = plan.data_identity["train_digest"].get<std::string>();
    if (was.value("train_digest", "") != digest)
      diff.push_back(fmt::format("--data '{}' (its tokens{} differ from the data the run was trained on: digest {} vs {})",
                                 s.data.empty() ? "built-in text" : s.data, data->examples() ? " or loss masks" : "",
                                 was.value("train_digest", ""), digest));
    if (data->examples() && was.value("train_on", "completion") != s.train_on)
      diff.push_back(fmt::format("--train-on (checkpoint: {}, now: {})", was.value("train_on", "completion"), s.train_on));
    if (data->examples() && was.value("pack", false) != s.pack)
      diff.push_back(fmt::format("--pack (checkpoint: {}, now: {})", was.value("pack", false), s.pack));
    if (r.state.data && r.state.data->seed != s.seed)
      diff.push_back(fmt::format("--seed (checkpoint: {}, now: {})", r.state.data->seed, s.seed));
    if (r.state.data && r.state.data->windows_per_epoch != data->train_windows())
      diff.push_back(fmt::format("--val-fraction or --seq (the training windows per epoch, checkpoint: {}, now: {})",
                                 r.state.data->windows_per_epoch, data->train_windows()));
    MT_CHECK(diff.empty(), "--resume '{}': this run would not continue the checkpoint's run exactly: {}. Drop these options "
             "(a resumed run takes the checkpoint's), or start a new run", dir.string(), fmt::join(diff, "; "));
    MT_CHECK(s.steps > r.state.step, "--steps {}: the checkpoint '{}' is at step {} already; give --steps > {} to train "
             "further, or --steps 0 to evaluate or export it", s.steps, dir.string(), r.state.step, r.state.step);
    // The data prepared again is the run's: it replaces the run folder's copy (the same files).
    if (plan.temp_data && plan.temp_data->filename() == "incoming") {
      for (const auto& e : fs::directory_iterator(*plan.temp_data))
        fs::rename(e.path(), plan.temp_data->parent_path() / e.path().filename());
    }
  }

  if (plan.export_options) {
    // The export directory is replaced as a whole: it must not be, or hold, the run directory or
    // the checkpoint resumed from, nor lie inside a checkpoints folder.
    const auto resolved = [](const fs::path& p) {
      fs::path r = fs::weakly_canonical(fs::absolute(p));
      return r.has_filename() ? r : r.parent_path();  // "dir/" -> "dir"
    };
    const auto within = [](const fs::path& a, const fs::path& b) {  // a is b or inside it
      return std::mismatch(b.begin(), b.end(), a.begin(), a.end()).first == b.end();
    };
    const fs::path e = resolved(s.export_dir);
    if (!plan.out.empty()) {
      const fs::path o = resolved(plan.out);
      MT_CHECK(!within(o, e), "--export '{}' would replace the run directory '{}' (it is, or holds, --out); export elsewhere",
               s.export_dir, plan.out.string());
      MT_CHECK(!within(e, o / "checkpoints"), "--export '{}' lies in the run's checkpoints folder '{}'; export elsewhere",
               s.export_dir, (plan.out / "checkpoints").string());
    }
    if (plan.resume) {
      const fs::path c = resolved(plan.resume->ckpt.dir());
      MT_CHECK(!within(c, e) && !within(e, c.parent_path()),
               "--export '{}' would replace or lie in the checkpoints of '{}'; export elsewhere", s.export_dir,
               c.parent_path().string());
    }
  }
  StopSignals::check("while preparing the run");
  if (use_cuda) {
#if MEGATRAIN_HAS_CUDA
    CudaBackendOptions copt;
    if (!s.gpu_memory.empty()) copt.memory_limit = parse_byte_size(s.gpu_memory.c_str());
    copt.device = ranks.info().local_rank;  // (one GPU a process: the launcher's local rank)
    // (a resumed run takes its checkpoint's choices, which end the tuning: see the resume below)
    copt.gemm_tuning = s.gemm_tuning && !plan.eval_only;
    CudaBackend be(copt);
    return train(be, "cuda", s, app, *cfg, data, topt, plan, ranks);
#endif
  }
  CpuBackend<float> be;
  return train(be, "cpu", s, app, *cfg, data, topt, plan, ranks);
}

// The validation loss over plan.eval_rows windows, in batches of the trainer's batch size (a
// short last batch is padded with rows whose labels are ignored): the mean over every labelled
// token, as transformers' loss with labels = input_ids over the same windows.
template <class T>
std::pair<double, std::int64_t> evaluate_all(T& trainer, const TokenDataset& data, std::int64_t rows, std::int64_t batch,
                                             std::int64_t seq) {
  const auto n = static_cast<std::size_t>(batch * seq);
  std::vector<std::int32_t> ids(n), labels(n), positions(data.packed() ? n : 0);
  double total = 0;
  std::int64_t tokens = 0;
  for (std::int64_t first = 0; first < rows; first += batch) {
    const std::int64_t take = std::min(batch, rows - first);
    std::fill(ids.begin(), ids.end(), 0);
    std::fill(labels.begin(), labels.end(), kIgnoreIndex);
    for (std::size_t i = 0; i < positions.size(); ++i) positions[i] = static_cast<std::int32_t>(i % static_cast<std::size_t>(seq));
    const auto used = static_cast<std::size_t>(take * seq);
    data.val_batch(first, take, std::span(ids).first(used), std::span(labels).first(used),
                   std::span(positions).first(positions.empty() ? 0 : used));
    const auto valid = static_cast<std::int64_t>(std::count_if(labels.begin(), labels.end(),
                                                               [](std::int32_t l) { return l != kIgnoreIndex; }));
    total += trainer.evaluate(ids, labels, batch, positions) * static_cast<double>(valid);
    tokens += valid;
  }
  return {total / static_cast<double>(tokens), tokens};
}

template <class B>
int train(B& be, const char* backend_name, const Settings& s, const CLI::App& app, const ModelConfig& cfg,
          const std::optional<TokenDataset>& data, TrainerOptions topt, RunPlan& plan, Ranks& ranks) {
  // ---- build ----------------------------------------------------------------------------------
  // (Several processes on one host share its memory: each plans for its part unless --host-memory
  // gives each its own.)
  plan::HostBudget budget = host_budget(s);
  // (--host-memory reaches here as MEGATRAIN_HOST_MEMORY, set in run())
  // (--gpus N as threads of this process, as N processes on one host: --host-memory is each
  // rank's, else each plans for its share of what is available)
  if (ranks.several() && ranks.info().local_world > 1 && std::getenv("MEGATRAIN_HOST_MEMORY") == nullptr) {
    budget.bytes /= static_cast<std::size_t>(ranks.info().local_world);
    budget.source = fmt::format("available host memory / {} {} on this host", ranks.info().local_world,
                                ranks.threads() ? "ranks (--gpus)" : "processes");
  }
  const std::string model_label = plan.resume              ? plan.resume->ckpt.dir().string()
                                  : !s.model_dir.empty()   ? s.model_dir
                                  : !s.model_config.empty() ? s.model_config
                                  : !s.preset.empty()       ? "--preset " + s.preset
                                                            : std::string("the command-line shape");
  MT_CHECK(s.share_weights != "true" || (std::is_same_v<typename B::Weight, bf16>),
           "--share-weights true shares the bf16 weights of GPU processes; the {} backend streams none: drop it", backend_name);
  MT_CHECK(!s.origins.given_now("--gather-weights") || (std::is_same_v<typename B::Weight, bf16> && topt.shard_optimizer &&
                                                        !topt.share_host_weights),
           "--gather-weights applies where GPU processes with --shard-optimizer each keep their own bf16 copy "
           "(--share-weights false, or processes on several hosts); {}: drop it",
           !std::is_same_v<typename B::Weight, bf16> ? fmt::format("the {} backend streams no bf16 weights", backend_name)
           : !topt.shard_optimizer                    ? std::string("--shard-optimizer is false")
                                                      : std::string("this host's processes share one copy"));
  // (--host-bf16-copy auto: the plan decides whether host memory keeps the bf16 copy, by this
  // rank alone; ranks of several keep it)
  const bool auto_copy = s.host_bf16_copy == "auto" && std::is_same_v<typename B::Weight, bf16> && !ranks.several();
  // (from the config alone, before its blocks are built: a config of 10^9 layers is refused here)
  plan::check_state_fits_host(cfg, budget, model_label, Trainer<B>::store_options(topt).shard,
                              topt.host_bf16_copy && !auto_copy);
  DecoderModel<> model(cfg);
  if (auto_copy)  // (kept where a plan fits with it, with the gradients where --gradients allows)
    topt.host_bf16_copy = plan::choose_bf16_copy<B>(model, topt, plan::device_budget(be), budget,
                                                    B::kDevice ? plan::machine_figures() : plan::MachineFigures{},
                                                    s.gradients == "auto");
  // Where gradients wait for the norm (--gradients auto; plan::choose_gradient_home): where the
  // plan fits, in host memory only where that is predicted faster or alone fits (on every rank);
  // a resumed run keeps its checkpoint's where it fits.
  if (s.gradients == "auto" && topt.resolved().resident_gradients()) {
    const std::optional<GradientHome> was =
        plan.resume && !plan.eval_only ? std::optional(plan.resume->state.options.gradient_home) : std::nullopt;
    const plan::GradientHomeChoice mine = plan::choose_gradient_home<B>(
        model, topt, plan::device_budget(be), budget, B::kDevice ? plan::machine_figures() : plan::MachineFigures{}, was);
    // (agreed as the ranks' checks are: a rank refused before this point stops every rank here)
    std::vector<plan::GradientHomeChoice> all;
    for (const std::int64_t v : ranks.agree_on(2 + (mine.home == GradientHome::host ? 1 : 0) + (mine.device_fits ? 2 : 0) +
                                               (mine.host_fits ? 4 : 0)))
      all.push_back({(v - 2) % 2 == 1 ? GradientHome::host : GradientHome::device, ((v - 2) / 2) % 2 == 1, (v - 2) / 4 == 1});
    topt.gradient_home = plan::GradientHomeChoice::agree(all);
    // (several processes: where they keep their parts of the weights can follow from it)
    plan::check_state_fits_host(cfg, budget, model_label, Trainer<B>::store_options(topt).shard, topt.host_bf16_copy);
  }
  // (ZeRO-1 exports from the first process: from the bf16 copy every process holds for a bf16 export
  // of sharded masters, else from the masters, gathered there where they are sharded)
  const bool gathers_for_export = topt.sharded() && plan.export_options && Trainer<B>::store_options(topt).shard.masters &&
                                  plan.export_options->dtype != DType::bf16;
  // The plan (docs/planner.md), before anything is allocated: printed, and refused with what would
  // fit when it cannot.
  FILE* const info = plan.eval_only ? stderr : ranks.out();
  std::size_t planned_host = 0;  // (the plan's host memory, said again at the start)
  {
    const plan::StepPlan sp =
        plan::plan_step<B>(model, topt, plan::device_budget(be), budget, B::kDevice ? plan::machine_figures() : plan::MachineFigures{});
    MT_CHECK(sp.memory.fits, "{}", sp.refusal());
    planned_host = sp.memory.host_total();
    const auto parts_of = [&](const TrainerOptions& o) {
      const auto f = HostParamStore<float>::footprint(model.units(), Trainer<B>::store_options(o));
      return gathers_for_export ? f.master_bytes + f.adam_bytes : f.compute_bytes;
    };
    if (topt.sharded() && ranks.lead() && plan.export_options &&
        (gathers_for_export || Trainer<B>::store_options(topt).shard.keeps_weight_parts())) {
      // (ZeRO-1: the first process holds the whole train state while it writes an f32 or f16
      // export, and the whole bf16 copy for a bf16 export where each process holds its part)
      TrainerOptions whole = topt;
      whole.shard_optimizer = false;
      const auto need = sp.memory.host_total() + parts_of(whole) - parts_of(topt);
      MT_CHECK(need <= budget.bytes, "process 0 writes the --export as {}, for which it gathers {}: {} of host memory "
               "then, more than its {} ({}); {}give it more (--host-memory, or fewer processes on its host), or export "
               "afterwards from a checkpoint (--save-every; megatrain-train --resume DIR --steps 0 --export OUT)",
               io::torch_dtype_name(plan.export_options->dtype),
               gathers_for_export ? "the whole train state" : "the whole bf16 copy (each process holds its part)",
               format_bytes(need), format_bytes(budget.bytes), budget.source,
               gathers_for_export ? "export as bf16 (--export-dtype bf16, the default: nothing of the optimizer's "
                                    "state gathered), or "
                                  : "");
    }
    std::fprintf(info, "%s", plan::format_summary(sp).c_str());
    if (ranks.several())
      std::fprintf(info, "data parallel: %s; each trains %lld of the global batch's %lld "
                   "sequences, holds %s%s: the plan above is one "
                   "%s (one GPU's), this %s holds %d times its host memory\n",
                   ranks.threads() ? fmt::format("{} GPUs driven by this process, a rank each (--gpus)", ranks.world()).c_str()
                                   : fmt::format("{} processes ({}), {} on this host", ranks.world(), ranks.info().launcher,
                                                 std::max(1, ranks.info().local_world)).c_str(),
                   static_cast<long long>(topt.batch_rows),
                   static_cast<long long>(s.batch),
                   !topt.shard_optimizer ? "the whole train state"
                   : std::is_same_v<typename B::Weight, bf16>
                       ? fmt::format("{} and 1/{} of the fp32 masters and AdamW's moments",
                                     topt.share_host_weights
                                         ? fmt::format("1/{} of the bf16 weights (one copy, which this host's {} "
                                                       "map together: --share-weights)", ranks.world(),
                                                       ranks.threads() ? "ranks" : "processes")
                                         : std::string("the bf16 weights"),
                                     ranks.world()).c_str()
                       : fmt::format("the fp32 masters and 1/{} of AdamW's moments", ranks.world()).c_str(),
                   topt.shard_optimizer ? " (ZeRO-1; --shard-optimizer)" : "", ranks.threads() ? "rank's" : "process's",
                   ranks.threads() ? "process" : "host", std::max(1, ranks.info().local_world));
  }
  // (every rank's plan fits, and the first's export: agreed before the stores are built, which
  // is collective where the ranks share the weights, so that a rank refused above stops every
  // rank here, named, instead of meeting another rank's collective)
  ranks.agree_checked();
  StoreOptions so;
  so.seed = s.seed;
  so.host_memory_budget = budget.bytes;
  HostParamStore<float> store(model.units(), Trainer<B>::store_options(topt, so));
  Trainer<B> trainer(model, store, be, topt);
  StopSignals::check("while building the model's state");
  // (Evaluating only, everything but the JSON result goes to stderr.)
  std::int64_t first_step = 1;
  // Metrics lines a checkpoint kept because they could not be written before it (--on-metrics-error).
  std::vector<std::string> unwritten;
  if (plan.resume) {
    const auto t0 = std::chrono::steady_clock::now();
    // (Evaluating or exporting, only the weights matter: the trainer's options are not the run's.)
    const TrainState st = plan.eval_only ? plan.resume->state : load_train_state(plan.resume->ckpt, trainer, store);
    if (plan.eval_only) plan.resume->ckpt.load_into(store);
    first_step = st.step + 1;
    if (!plan.eval_only && data) {
      const DataPosition expected = data->position(st.step * s.batch);
      MT_CHECK(!st.data || *st.data == expected, "--resume '{}': the data position (epoch {}, slot {}) does not follow "
               "from the step and batch (epoch {}, slot {})", plan.resume->ckpt.dir().string(), st.data->epoch,
               st.data->slot, expected.epoch, expected.slot);
    }
    std::fprintf(info, "resumed from %s (step %lld, %s) in %.1f s\n", plan.resume->ckpt.dir().string().c_str(),
                 static_cast<long long>(st.step), format_bytes(plan.resume->ckpt.tensor_bytes()).c_str(),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    if (!plan.eval_only) {
      // Allowed, but then the continuation is not bit for bit the uninterrupted run: say so.
      std::vector<std::string> layout;
      const std::string was_backend = st.user.value("backend", "");
      if (!was_backend.empty() && was_backend != backend_name)
        layout.push_back(fmt::format("backend {} (checkpoint: {})", backend_name, was_backend));
      const TrainerOptions now = trainer.options();
      const std::int64_t was_processes = st.user.value("processes", std::int64_t{1});
      if (was_processes != ranks.world())
        layout.push_back(fmt::format("{} process(es) (checkpoint: {})", ranks.world(), was_processes));
      // (the global batch's passes: each process's times the processes, as the train state records them)
      if (now.micro_batches * ranks.world() != st.options.micro_batches)
        layout.push_back(fmt::format("{} micro-batches (checkpoint: {})", now.micro_batches * ranks.world(),
                                     st.options.micro_batches));
      if (now.chunk_rows != st.options.chunk_rows)
        layout.push_back(fmt::format("--chunk {} (checkpoint: {})", now.chunk_rows, st.options.chunk_rows));
      // (placement changes no bit, except the order of a sum: stale clipping's norm, and
      // micro-batches added up in host memory instead of on the GPU or the other way round)
      const bool stale = now.clip_norm > 0 && now.clip_mode == ClipMode::stale;
      if (stale && now.device_units != st.options.device_units)
        layout.push_back(fmt::format("AdamW on the GPU for {} units (checkpoint: {}) with stale clipping", now.device_units,
                                     st.options.device_units));
      if (now.micro_batches > 1 && now.gradient_home != st.options.gradient_home)
        layout.push_back(fmt::format("micro-batches added up in {} memory (checkpoint: {})",
                                     now.gradient_home == GradientHome::host ? "host" : "GPU",
                                     st.options.gradient_home == GradientHome::host ? "host" : "GPU"));
      // (in host memory, a device unit's micro-batches still add up on the GPU: measured on an
      // H200, another count of them changes the norm's last bits)
      else if (now.micro_batches > 1 && now.gradient_home == GradientHome::host && now.device_units != st.options.device_units)
        layout.push_back(fmt::format("AdamW on the GPU for {} units (checkpoint: {}) with micro-batches added up in host "
                                     "memory", now.device_units, st.options.device_units));
      // The matrix-product algorithms the run used (--gemm-tuning): the same again, or (a checkpoint
      // from before they were kept) the heuristic's, as that run took them.
      if constexpr (requires { be.restore_gemm_algorithms(std::string()); }) {
        const std::string saved = st.user.value("gemm_algorithms", std::string());
        if (saved.empty()) {
          be.end_gemm_tuning();
        } else {
          bool same = false;
          try {
            same = be.restore_gemm_algorithms(saved);
          } catch (const megatrain::Error& e) {
            MT_FAIL("--resume '{}': its {} holds no usable gemm_algorithms: {}", plan.resume->ckpt.dir().string(),
                    io::kTrainStateFile, e.reason());
          }
          if (!same) layout.push_back("another cuBLASLt or GPU (the matrix-product algorithms, tuned again)");
        }
      }
      if (!layout.empty())
        std::fprintf(info, "note: this run computes the same update as the checkpoint's with %s: its floating-point sums "
                     "come in another order, so it is not bit for bit the run that was not interrupted\n",
                     fmt::format("{}", fmt::join(layout, ", ")).c_str());
    }
    if (const json& u = st.user; u.contains("unwritten_metrics") && u["unwritten_metrics"].is_array())
      for (const auto& line : u["unwritten_metrics"]) unwritten.push_back(line.get<std::string>());
    plan.resume.reset();
    plan.hf.reset();  // (--model given again was only compared with the checkpoint's model)
  } else if (plan.hf) {
    const auto t0 = std::chrono::steady_clock::now();
    plan.hf->load_into(store);
    std::fprintf(info, "loaded %s (%lld parameters) in %.1f s%s\n", s.model_dir.c_str(),
                 static_cast<long long>(store.param_count()),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                 plan.hf->ignored().empty() ? "" : fmt::format("; not loaded: {}", fmt::join(plan.hf->ignored(), ", ")).c_str());
    plan.hf.reset();  // unmap the files: an export may replace that very directory
  }
  StopSignals::check("while loading the weights");
  const auto export_model = [&](std::int64_t step) {
    trainer.finish_update();  // (the step's update, if it runs in the background)
    const auto t0 = std::chrono::steady_clock::now();
    const fs::path dir(s.export_dir);
    if (dir.has_parent_path()) fs::create_directories(dir.parent_path());
    plan.export_options->marker = {{"written_by", "megatrain-train"}, {"step", step}};
    if (!plan.out.empty()) plan.export_options->marker["run_dir"] = fs::absolute(plan.out).lexically_normal().string();
    io::export_hf_model(store, cfg, dir, *plan.export_options);
    return fmt::format("exported step {} to {} ({}) in {:.1f} s", step, s.export_dir,
                       io::torch_dtype_name(plan.export_options->dtype),
                       std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  };
  constexpr const char* compute_dtype = std::is_same_v<typename B::Weight, float> ? "float32" : "bfloat16";

  if (plan.eval_only) {
    if (plan.eval_rows > 0) {
      std::fprintf(info, "megatrain-train: evaluating %s (%s, %lld parameters) on %lld sequences of %lld tokens, backend %s (%s)\n",
                   model_label.c_str(), std::string(cfg.architecture_name()).c_str(),
                   static_cast<long long>(cfg.param_count()), static_cast<long long>(plan.eval_rows),
                   static_cast<long long>(s.seq), backend_name, compute_dtype);
      const auto [loss, tokens] = evaluate_all(trainer, *data, plan.eval_rows, topt.batch_rows, s.seq);
      json r{{"val_loss", loss},        {"tokens", tokens},         {"sequences", plan.eval_rows}, {"seq", s.seq},
             {"backend", backend_name}, {"compute_dtype", compute_dtype}, {"model", model_label}};
      std::printf("%s\n", r.dump().c_str());
      std::fflush(stdout);
    }
    if (plan.export_options) {
      std::fprintf(info, "%s\n", export_model(first_step - 1).c_str());
      std::fflush(info);
    }
    return 0;
  }

  // Every process got here (or every process stops now, naming those that did not): from here the
  // first process alone writes the run folder (the train state is the same on every process).
  // (first, the first process's run folder must be writable: found now, every process is told)
  if (ranks.several() && ranks.lead()) {
    fs::create_directories(plan.out);
    const fs::path probe = plan.out / fmt::format(".megatrain-write-test-{}", getpid());
    MT_CHECK(std::ofstream(probe).good(), "cannot write in --out '{}'", plan.out.string());
    fs::remove(probe);
  }
  ranks.agree_started();
  const bool lead = ranks.lead();
  // (without --out each process made up a folder of its own: the first's is the run's, where every
  // process writes its part of the checkpoints)
  if (ranks.several() && s.out.empty()) plan.out = fs::absolute(ranks.lead_text(plan.out.string()));
  const fs::path& out = plan.out;
  if (lead) {
    fs::create_directories(out);
    io::detail::write_file_atomically(out / "config.json", cfg.to_json().dump(2) + "\n");
    json o;
    std::vector<const CLI::Option*> opts = app.get_options();
    for (const CLI::App* group : app.get_subcommands([](const CLI::App*) { return true; }))
      for (const CLI::Option* opt : group->get_options()) opts.push_back(opt);
    for (const CLI::Option* opt : opts)
      if (!opt->get_lnames().empty() && opt->get_lnames().front() != "help" && opt->get_lnames().front() != "config")
        o[opt->get_lnames().front()] = opt->count() > 0 ? opt->as<std::string>() : opt->get_default_str();
    io::detail::write_file_atomically(out / "options.json", o.dump(2) + "\n");
  }
  // metrics.jsonl (io/metrics_log.hpp): a resumed run continues it where its checkpoint was taken,
  // with the lines that checkpoint kept because they could not be written then.
  io::MetricsLog metrics;
  std::string metrics_error;  // (the first failed write's reason; empty while none failed)
  if (lead) {
    metrics = io::MetricsLog(out / "metrics.jsonl", first_step > 1 ? first_step - 1 : -1);
    for (const std::string& line : unwritten)  // (those not in the file yet)
      if (io::metrics_step(line) > metrics.kept_through() && metrics_error.empty()) metrics_error = metrics.append(line);
    MT_CHECK(metrics_error.empty(), "the metrics the checkpoint kept could not be written: {}", metrics_error);
  }

  std::fprintf(ranks.out(), "megatrain-train: %s, %lld parameters (%lld layers, hidden %lld, vocab %lld), backend %s, data %s "
              "(%lld training tokens, %lld validation)\n",
              std::string(cfg.architecture_name()).c_str(), static_cast<long long>(cfg.param_count()),
              static_cast<long long>(cfg.num_hidden_layers), static_cast<long long>(cfg.hidden_size),
              static_cast<long long>(cfg.vocab_size), backend_name, s.data.empty() ? "built-in text" : s.data.c_str(),
              static_cast<long long>(data->train_tokens()), static_cast<long long>(data->val_tokens()));
  const std::int64_t micro = trainer.options().micro_batches * ranks.world();  // (the global batch's passes)
  std::fprintf(ranks.out(), "batch %lld x %lld tokens%s, %s %lld, host memory %s as planned (%s of it the parameter store), "
              "writing %s\n", static_cast<long long>(s.batch), static_cast<long long>(s.seq),
              micro > 1 ? fmt::format(" in {} micro-batches of {}", micro, s.batch / micro).c_str() : "",
              first_step > 1 ? fmt::format("steps {} to", first_step).c_str() : "steps", static_cast<long long>(s.steps),
              format_bytes(planned_host).c_str(), format_bytes(store.bytes()).c_str(), out.string().c_str());
  for (const std::string& note : plan.notes) std::fprintf(ranks.out(), "%s\n", note.c_str());
  if constexpr (B::kDevice)
    std::fprintf(ranks.out(), "AdamW on the GPU for %zu of %zu units (--device-units), on the host for the rest%s\n", trainer.device_units(),
                store.num_units(),
                topt.resident_gradients() ? fmt::format("; gradients wait for the norm in {} memory (--gradients{})",
                                                        topt.gradient_home == GradientHome::host ? "host" : "GPU",
                                                        s.gradients == "auto" ? " auto" : "").c_str()
                                          : "");
  if (topt.schedule.decays() && s.steps > topt.schedule.total_steps)
    std::fprintf(ranks.out(), "note: the %s schedule ends at step %lld (the first run's --steps); later steps train at its floor %g\n",
                s.schedule.c_str(), static_cast<long long>(topt.schedule.total_steps), topt.schedule.min_lr);
  std::fflush(ranks.out());

  // ---- checkpoints ------------------------------------------------------------------------------
  CheckpointerOptions copt;
  copt.keep = static_cast<std::size_t>(s.keep);
  copt.extra_files = plan.side_files;
  copt.extra_files["config.json"] = plan.config_text;
  // (the first process's only, where every process holds the same train state; ZeRO-1: every
  // process writes its part of each checkpoint, the first puts it in place)
  if (trainer.options().sharded()) copt.comm = ranks.comm();
  std::optional<Checkpointer> checkpointer;
  if (lead || copt.comm) checkpointer.emplace(out / "checkpoints", copt);
  json side_names = json::array();
  for (const auto& [name, text] : plan.side_files) side_names.push_back(name);
  json user{{"program", "megatrain-train"}, {"given", plan.given}, {"data", plan.data_identity}, {"backend", backend_name},
                  {"side_files", side_names}, {"run_dir", fs::absolute(out).lexically_normal().string()},
                  {"processes", ranks.world()}, {"run_id", plan.run_id}};
  Progress progress(first_step, s.steps, ranks.out());
  std::int64_t saved_step = first_step - 1;  // the newest complete checkpoint (or the one resumed from)
  bool last_save_failed = false;
  const io::CheckpointFolder checkpoints(out / "checkpoints");
  const auto checkpoint_path = [&](std::int64_t step) { return checkpoints.path_for(step).string(); };
  // What a second stop signal cleans and says (stop_signals.hpp): what this run may be writing.
  const auto tell_signals = [&] {
    StopSignals::Status st;
    st.out = out.string();
    st.saved_step = saved_step;
    if (saved_step > 0) st.saved_path = checkpoint_path(saved_step);
    st.training = true;
    if (plan.folder && plan.folder->replaced()) st.replaced = plan.folder->replaced()->string();
    if (lead) st.writing_in = {{out, ""}, {out / "checkpoints", ""}};
    if (lead && plan.export_options) {
      const fs::path e = fs::absolute(s.export_dir).lexically_normal();
      const fs::path name = e.has_filename() ? e.filename() : e.parent_path().filename();
      st.writing_in.emplace_back(e.has_filename() ? e.parent_path() : e.parent_path().parent_path(), name.string() + ".");
    }
    StopSignals::update(st);
  };
  tell_signals();
  // Reports a finished save (a failure is a warning: the previous checkpoint is still there).
  const auto report_one = [&](const SaveResult* r) {
    if (r->ok) {
      saved_step = r->step;
      last_save_failed = false;
      tell_signals();
      if (lead)
        progress.note(fmt::format("saved step {} to {} ({} in {:.1f} s; training waited {:.1f} s for it)", r->step,
                                r->dir.string(), format_bytes(r->bytes), r->seconds, r->stall_seconds));
      if (plan.folder && plan.folder->replaced())  // (--overwrite: the new run has its first checkpoint)
        progress.note(fmt::format("--overwrite: removed the previous run ('{}')", plan.folder->drop_replaced().string()));
    } else {
      last_save_failed = true;
      // (every process its own failure; the first also another's)
      if (lead || !r->failed_elsewhere)
        progress.note(fmt::format("megatrain-train: warning: the checkpoint of step {} could not be written: {}. {}; "
                                "training goes on",
                                r->step, r->error,
                                saved_step > 0 ? fmt::format("The newest complete checkpoint is step {}", saved_step)
                                               : std::string("There is no complete checkpoint")),
                    stderr);
    }
  };
  const auto report = [&](const std::vector<SaveResult>& results) {
    for (const SaveResult& r : results) report_one(&r);
  };
  const auto poll_saves = [&] {
    if (checkpointer) report(checkpointer->poll());
  };
  const auto wait_saves = [&] {
    if (checkpointer) report(checkpointer->wait());
  };
  // (Every process calls it at the same step. ZeRO-1: every process writes its part.) The metrics
  // lines not yet written go with it, so that a resume writes them.
  const auto save = [&](std::int64_t step) {
    if constexpr (requires { be.gemm_algorithms(); }) user["gemm_algorithms"] = be.gemm_algorithms();
    if (metrics.pending().empty()) user.erase("unwritten_metrics");
    else user["unwritten_metrics"] = metrics.pending();
    if (checkpointer) checkpointer->save(trainer, store, data->position(step * s.batch), user);
  };
  // After a failure that stops the run: the train state of `step` saved (every process takes part),
  // unless it is already; then what was saved, as a sentence (said by the first process).
  const auto save_for_stop = [&](std::int64_t step) {
    if (ranks.lead_says(step > 0 && saved_step != step)) {
      save(step);
      wait_saves();
    }
    if (step == 0) return std::string("No step had finished: there is nothing to save.");
    if (saved_step == step) return fmt::format("The train state of step {} is saved in {}.", step, checkpoint_path(step));
    return fmt::format("The train state of step {} could not be saved (see above); {}.", step,
                       saved_step > 0 ? fmt::format("the newest complete checkpoint is step {} ({})", saved_step,
                                                    checkpoint_path(saved_step))
                                      : std::string("there is no complete checkpoint"));
  };
  // ---- train ----------------------------------------------------------------------------------
  // Every process reads the global batch and trains its share of the rows (docs/distributed.md).
  const auto n = static_cast<std::size_t>(s.batch * s.seq);
  const auto share = static_cast<std::size_t>(topt.batch_rows * s.seq);
  std::vector<std::int32_t> ids(n), labels(n), positions(data->packed() ? n : 0);
  // Examples end in padding, which transformers' attention mask leaves out of a mixture of
  // experts' auxiliary loss (and the tokens per expert): the trainer takes the same mask.
  std::vector<std::uint8_t> attention_mask(data->examples() && cfg.moe_layer_count() > 0 ? n : 0);
  const auto mine = [&]<class E>(const std::vector<E>& v, std::size_t per_process) {
    return v.empty() ? std::span<const E>()
                     : std::span<const E>(v).subspan(static_cast<std::size_t>(ranks.rank()) * per_process, per_process);
  };
  const auto t0 = std::chrono::steady_clock::now();
  // The mean loss over the labelled tokens of --eval-batches x --batch validation sequences (each
  // process evaluates its share; the sums over the processes give the same mean to rounding).
  auto validation = [&] {
    const std::int64_t rows = s.eval_batches * s.batch, my_rows = rows / ranks.world();
    std::vector<std::int32_t> vi(static_cast<std::size_t>(rows * s.seq)), vl(vi.size()), vp(data->packed() ? vi.size() : 0);
    data->val_batch(0, rows, vi, vl, vp);
    const auto part = static_cast<std::size_t>(my_rows * s.seq);
    const auto my_labels = mine(vl, part);
    if (!ranks.several()) return trainer.evaluate(mine(vi, part), my_labels, my_rows, mine(vp, part));
    // (a process whose rows hold no trained token adds nothing: fine-tuning examples may do that)
    const auto valid = std::count_if(my_labels.begin(), my_labels.end(), [](std::int32_t l) { return l != kIgnoreIndex; });
    const double loss = valid > 0 ? trainer.evaluate(mine(vi, part), my_labels, my_rows, mine(vp, part)) : 0.0;
    double sums[2] = {loss * static_cast<double>(valid), static_cast<double>(valid)};
    ranks.comm()->all_reduce_sum(sums);
    MT_CHECK(sums[1] > 0, "the validation sequences hold no trained token (every label is ignored)");
    return sums[0] / sums[1];
  };
  // report.html in the run folder: at each evaluation and at the end (a failure only warns).
  io::RunReportInfo report_info;
  report_info.machine = io::describe_machine(B::kDevice ? ranks.info().local_rank : -1);
  report_info.machine["backend"] = backend_name;
  report_info.machine["compute_dtype"] = compute_dtype;
  if (ranks.several()) report_info.machine["processes"] = ranks.world();
  std::string report_error;  // (why the last report could not be written; empty: it was)
  const auto write_report = [&] {
    if (!lead) return;
    try {
      const fault::WriteScope scope("report");
      io::write_run_report(out, report_info);
      report_error.clear();
    } catch (const megatrain::Error& e) {
      if (report_error.empty())
        progress.note(fmt::format("megatrain-train: warning: report.html not written: {}", e.reason()), stderr);
      report_error = e.reason();
    }
  };
  // A non-finite step stopped the trainer (every process alike: they stepped the same sums): with
  // the last good state kept (exact clipping), that state is saved as a checkpoint (unless it is
  // already); else the newest checkpoint is named.
  const auto stop_nonfinite = [&](const megatrain::Error& e, std::int64_t good) {
    trainer.finish_update();
    wait_saves();
    write_report();
    // (the first process knows what it saved; every process takes part in a save)
    if (trainer.stopped_with_last_good_state()) (void)save_for_stop(good);
    if (!lead) {
      ranks.barrier();  // (while the first process finishes)
      return 1;
    }
    std::string what;
    if (trainer.stopped_with_last_good_state()) {
      if (good == 0) what = "No step had finished: there is nothing to save.";
      else if (saved_step == good)
        what = fmt::format("The train state of step {} (the last good one) is in {}: resume with `megatrain-train --resume "
                           "--out {}` (add --on-nonfinite skip to skip the step that failed).",
                           good, checkpoint_path(good), out.string());
      else
        what = fmt::format("The train state of step {} could not be saved (see above){}.", good,
                           saved_step > 0 ? fmt::format("; the newest complete checkpoint is step {}", saved_step) : std::string());
    } else {
      what = saved_step > 0 ? fmt::format("The newest checkpoint from before it is step {} ({}).", saved_step,
                                          checkpoint_path(saved_step))
                            : std::string("There is no checkpoint from before it.");
    }
    std::fprintf(stderr, "megatrain-train: error: %s\n%s\n", e.reason().c_str(), what.c_str());
    ranks.barrier();
    return 1;
  };
  // An export (--export, --export-every) of `step`; where it fails, the train state of the step is
  // saved in the run folder and the message says how to export it again. Returns whether it was
  // written. (Every process calls it at the same step.)
  const auto export_at = [&](std::int64_t step) {
    try {
      if (trainer.options().sharded()) {
        wait_saves();  // (a checkpoint in flight completed first: its writers read the store)
        trainer.finish_update();
      }
      struct Release {  // (what the export gathered is let go again, whatever happens)
        HostParamStore<float>& store;
        ~Release() { store.release_unowned_state(); }
      } release{store};
      if (gathers_for_export) store.gather_state(*ranks.comm(), 0);  // (the masters brought to the first process)
      else if (trainer.options().sharded()) store.gather_weights(*ranks.comm(), 0);  // (a bf16 copy held in parts: whole on the first process)
      // (the others wait while the first reads the weights, a bf16 copy they map together included,
      // and stop with it where it cannot write the export, instead of at their next collective)
      const auto write_export = [&] { progress.note(export_model(step)); };
      if (ranks.several())
        io::agree_on(*ranks.comm(), lead, write_export, [&](const std::vector<int>&) {
          return fmt::format("process 0 could not write the export to {} (its message says why)", s.export_dir);
        });
      else
        write_export();
      return true;
    } catch (const megatrain::Error& e) {
      const std::string saved = save_for_stop(step);
      if (lead)
        progress.note(fmt::format("megatrain-train: {}: the export of step {} to '{}' failed: {}. {}{}{}",
                                  step == s.steps ? "error" : "warning", step, s.export_dir, e.reason(), saved,
                                  saved_step == step ? fmt::format(" Export it again with: megatrain-train --resume {} --steps 0 "
                                                                   "--eval-batches 0 --export {}", checkpoint_path(step),
                                                                   s.export_dir)
                                                     : std::string(),
                                  step == s.steps ? "" : " Training goes on."),
                      stderr);
      return false;
    }
  };
  // A metrics line that could not be written (a full disk): the run stops with the train state of the
  // step saved, the lines not written kept with it (--on-metrics-error stop), or goes on keeping them
  // in memory until they can be written (continue).
  const auto metrics_failed = [&](std::int64_t step) {
    if (!ranks.lead_says(!metrics.pending().empty() && s.on_metrics_error == "stop")) return false;
    const std::string saved = save_for_stop(step);
    if (lead)
      std::fprintf(stderr, "megatrain-train: error: the metrics of step %lld could not be written: %s. The run stops "
                   "(--on-metrics-error stop). %s%s\n", static_cast<long long>(step), metrics_error.c_str(), saved.c_str(),
                   saved_step == step ? fmt::format(" The metrics not written are kept with it: make room, then resume "
                                                    "with: megatrain-train --resume --out {}", out.string()).c_str()
                                      : "");
    return true;
  };

  std::int64_t step = first_step;
  int stop_signal = 0;  // (a signal any process got: every process stops after the same step)
  bool final_export_failed = false;
  for (; step <= s.steps && (stop_signal = ranks.stop_signal(StopSignals::first())) == 0; ++step) {
    data->train_batch((step - 1) * s.batch, s.batch, ids, labels, positions, attention_mask);
    fault::delay_point("train:step");  // (tests: MEGATRAIN_FAULTS=delay@train:step=MICROSECONDS)
    StepStats st;
    try {
      st = trainer.step(mine(ids, share), mine(labels, share), mine(positions, share), mine(attention_mask, share));
    } catch (const megatrain::Error& e) {
      if (trainer.stopped_because().empty()) throw;
      return stop_nonfinite(e, step - 1);
    }
    if (plan.folder) plan.folder->mark_started();  // (from now on the run folder is this run's, whatever happens)
    // The matrix-product algorithms the first step chose (--gemm-tuning): the first process's for
    // every process, as its checkpoints keep them.
    if constexpr (requires { be.gemm_algorithms(); })
      if (step == first_step && ranks.several() && !be.restore_gemm_algorithms(ranks.lead_text(be.gemm_algorithms())))
        log_warning("rank {}'s GPU or cuBLASLt differs from the first rank's: it keeps its own matrix-product algorithms",
                    ranks.rank());
    const double tok_s = static_cast<double>(st.tokens) / st.seconds;
    std::optional<double> val;
    if ((s.eval_every > 0 && step % s.eval_every == 0) || step == s.steps) val = validation();
    // (a skipped step's loss or norm is not finite: null in JSON)
    json m{{"step", st.step},           {"loss", st.loss},         {"lr", st.lr},
           {"grad_norm", st.grad_norm}, {"clip_coef", st.clip_coef}, {"tokens", st.tokens},
           {"tokens_per_s", tok_s},     {"step_time_s", st.seconds}};
    if (st.skipped) m["skipped"] = true;
    if (trainer.skipped_steps() > 0) m["skipped_steps"] = trainer.skipped_steps();
    if (!st.expert_load.empty()) {  // a mixture of experts: what users of MoE training watch
      m["aux_loss"] = st.aux_loss;
      json load = json::array();
      for (const auto& l : st.expert_load) load.push_back({l.layer, l.min, l.max});
      m["expert_tokens"] = load;  // [layer, fewest, most] tokens routed to one expert over the step
    }
    if (val) m["val_loss"] = *val;
    if (lead) {
      const std::string error = metrics.append(m.dump());
      if (!error.empty() && metrics_error.empty() && s.on_metrics_error == "continue")
        progress.note(fmt::format("megatrain-train: warning: the metrics of step {} could not be written: {}; training "
                                  "goes on (--on-metrics-error continue), the lines kept until they can be written",
                                  step, error), stderr);
      if (!error.empty() && metrics_error.empty()) metrics_error = error;
    }
    if (metrics_failed(step)) return 1;
    if (val) write_report();
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    progress.update(st, tok_s, elapsed, val, s.log_every);
    poll_saves();
    if (s.save_every > 0 && (step % s.save_every == 0 || step == s.steps)) save(step);
    if (plan.export_options && (step == s.steps || (s.export_every > 0 && step % s.export_every == 0)))
      if (!export_at(step) && step == s.steps) final_export_failed = true;
  }
  const std::int64_t done = step - 1;
  // (a signal during the last step: every process hears of it, and the run is saved as promised)
  if (stop_signal == 0) stop_signal = ranks.stop_signal(StopSignals::first());
  trainer.finish_update();
  wait_saves();
  write_report();
  if (const int sig = stop_signal; sig != 0) {
    // A signal asked for a checkpoint: the state after the last finished step is saved (also when
    // that step was the last one), unless it is already, or no step ran.
    if (ranks.lead_says(saved_step != done && done > 0)) {
      save(done);
      wait_saves();
    }
    ranks.barrier();  // (no process leaves while the first still saves)
    const char* name = sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "a signal";
    if (done < s.steps) {
      if (!lead) return 128 + sig;
      std::string what;
      if (done == 0) what = "no step had finished: nothing to save";
      else if (saved_step == done)
        what = fmt::format("checkpoint {}. Resume with: megatrain-train --resume --out {}", checkpoint_path(done), out.string());
      else
        what = fmt::format("its checkpoint could not be written (see above){}",
                           saved_step > 0 ? fmt::format("; the newest complete one is step {}", saved_step) : std::string());
      std::fprintf(stderr, "megatrain-train: stopped by %s after step %lld of %lld; %s\n", name, static_cast<long long>(done),
                   static_cast<long long>(s.steps), what.c_str());
      return 128 + sig;
    }
    // (The signal came during the last step: the run is complete, and saved as promised.)
  }
  // Metrics lines that never found room (--on-metrics-error continue) are kept with the train state.
  const bool metrics_lost = ranks.lead_says(!metrics.pending().empty());
  const std::string metrics_saved = metrics_lost ? save_for_stop(done) : std::string();
  // (At a normal end the others need not wait for the first's export and last save: a process that
  // ends with status 0 stops nothing.)
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::fprintf(ranks.out(), "done: %lld steps in %.1f s; metrics in %s\n", static_cast<long long>(s.steps - first_step + 1), total,
              (out / "metrics.jsonl").string().c_str());
  if (plan.folder && plan.folder->replaced())  // (--overwrite: the new run has finished)
    progress.note(fmt::format("--overwrite: removed the previous run ('{}')", plan.folder->drop_replaced().string()));
  // Every write that failed is an error the run reports: exit status 1.
  std::vector<std::string> failed;
  if (last_save_failed)
    failed.push_back(fmt::format("its last checkpoint could not be written{}",
                                 saved_step > 0 ? fmt::format(" (the newest complete one is step {})", saved_step) : ""));
  if (final_export_failed) failed.push_back(fmt::format("its export to '{}' failed (see above)", s.export_dir));
  if (metrics_lost)
    failed.push_back(fmt::format("{} lines of metrics.jsonl could not be written ({}). {}", metrics.pending().size(),
                                 metrics_error, metrics_saved));
  if (!report_error.empty()) failed.push_back(fmt::format("report.html could not be written ({})", report_error));
  if (!failed.empty()) {
    if (lead || !ranks.threads())  // (the ranks of one process: said once)
      std::fprintf(stderr, "megatrain-train: error: the run finished, but %s\n", fmt::format("{}", fmt::join(failed, "; ")).c_str());
    return 1;
  }
  return 0;
}
}  // namespace

int main(int argc, char** argv) {
  // A file-size limit (ulimit -f) must fail a write with a message, not kill the process.
  signal(SIGXFSZ, SIG_IGN);
  // SIGINT and SIGTERM from the first instant (stop_signals.hpp), before any other thread starts.
  StopSignals::install();
  const std::vector<std::string> args(argv + 1, argv + argc);
  Parsed p;
  RunPlan plan;
  try {
    parse(p, args);
    plan.run_id = new_run_id();
    if (p.settings->resume_given) {
      // Resuming: the checkpoint's run options come first, under the config file and the command
      // line. With --steps 0 (evaluate or export) only the data options are taken over.
      const Settings& first = *p.settings;
      Resume r = open_resume(first);
      const fs::path dir = r.ckpt.dir();
      StopSignals::check("while opening the checkpoint");
      const bool eval_only = first.origins.given("--steps") && first.steps == 0;
      const std::set<std::string> data_only{"--data",      "--data-format", "--val-data",    "--val-fraction",
                                            "--batch",     "--seq",         "--seed",        "--train-on",
                                            "--tokenizer", "--chat-format", "--skip-bad-lines", "--pack"};
      std::string out = first.out;
      if (out.empty() && dir.parent_path().filename() == "checkpoints") out = dir.parent_path().parent_path().string();
      MT_CHECK(!out.empty() || eval_only, "--resume '{}': give --out (the run folder to continue in)", dir.string());
      // A branch (a run folder of its own) is another run: it does not export into the folder of
      // the run it came from unless told to.
      const bool branch = !eval_only && !continues_run(dir, out);
      const std::set<std::string> export_options{"--export", "--export-every", "--export-dtype", "--shard-size"};
      std::vector<std::string> before =
          replay_args(r.given, eval_only ? data_only : std::set<std::string>{}, branch ? export_options : std::set<std::string>{});
      if (!out.empty() && first.out.empty()) before.insert(before.end(), {"--out", out});
      if (branch && r.given.contains("--export") && !first.origins.given_now("--export"))
        plan.notes.push_back(fmt::format("note: this run branches from '{}' into '{}': the export of the run it comes from "
                                         "('{}') is not taken over; give --export to export this one", dir.string(), out,
                                         r.given["--export"].get<std::string>()));
      if (!branch) plan.run_id = r.state.user.value("run_id", plan.run_id);
      plan.branch = branch;
      p = Parsed{};
      parse(p, args, before);
      plan.resume = std::move(r);
    }
  } catch (const CLI::ParseError& e) {
    return p.app ? p.app->exit(e) : 2;
  } catch (const StoppedBeforeTraining& e) {
    std::fprintf(stderr, "megatrain-train: %s\n", e.reason().c_str());
    return 128 + e.signal();
  } catch (const megatrain::Error& e) {
    std::fprintf(stderr, "megatrain-train: %s\n", e.reason().c_str());
    return 2;
  }
  const Settings& s = *p.settings;
  int gpus = 1;
  try {
    plan.given = recorded_options(p);
    // --gpus N: N ranks, one GPU each: threads of this process (--gpu-ranks threads, the default),
    // or one process per GPU started here as torchrun would (examples/megatrain_train/gpus.hpp).
    gpus = gpus_wanted(s.gpus, s.backend, s.gpu_ranks);
    MT_CHECK(gpus > 1 || !s.origins.given_now("--gpu-ranks"), "--gpu-ranks applies with --gpus N (N > 1); drop it");
    if (gpus > 1) {
      const auto env = megatrain::dist::launch_from_env();
      if (env.world <= 1 && s.gpu_ranks == "processes") {
        StopSignals::uninstall();  // (the launcher forwards signals to its processes itself)
        return launch_gpus(gpus, argv);
      }
      MT_CHECK(env.world <= 1 || (std::getenv("MEGATRAIN_GPUS_LAUNCHED") != nullptr && env.world == gpus),
               "--gpus {}: this is process {} of {} that {} launched, one GPU each: drop --gpus (the launcher says how "
               "many)", s.gpus, env.rank, env.world, env.launcher);
      if (env.world > 1) gpus = 1;  // (a process that --gpu-ranks processes started)
    }
  } catch (const megatrain::Error& e) {
    std::fprintf(stderr, "megatrain-train: error: %s\n", e.reason().c_str());
    return 1;
  }
  // One rank: this process's place in the run, its messages, its training. `ranks` joins the
  // run (a launcher's processes) or is given (a thread of --gpus N).
  const auto rank_main = [&](Ranks& ranks, const std::function<void(Ranks&)>& join, RunPlan rank_plan) {
    const auto fail = [&](const char* error) {
      const std::string who =
          ranks.several() ? fmt::format(" ({} {} of {})", ranks.noun(), ranks.rank(), ranks.world()) : "";
      // (--gpus N: the first rank to fail is the one the others name; once training has started,
      // a rank stopped because another failed says that, not what its aborted collective said)
      int failed = -1;  // (after the exchange: the rank that failed first, where another did)
      const bool first = !ranks.threads() || g_failed_rank.compare_exchange_strong(failed, ranks.rank());
      const std::string stopped = fmt::format("stopped: rank {} of {} failed (its message says why)", failed, ranks.world());
      const char* what = !first && ranks.started() && !std::getenv("MEGATRAIN_DEBUG") ? stopped.c_str() : error;
      // (ranks that are threads of this process print a message once, not once a rank: the same
      // command fails every rank alike)
      static std::mutex printed_mutex;
      static std::set<std::string> printed;
      {
        const std::lock_guard lock(printed_mutex);
        if (!ranks.threads() || printed.insert(what).second)
          std::fprintf(stderr, "megatrain-train%s: error: %s\n", who.c_str(), what);
        std::fflush(stderr);
      }
      ranks.fail(1);  // (the others are told: every rank stops)
      // (--gpus N, training: the other ranks' communicators aborted now, not once this rank has
      // cleaned up, so that they stop at once instead of waiting in a collective for it)
      if (first && ranks.threads() && ranks.started() && g_abort_others) g_abort_others();
      return 1;
    };
    try {
      join(ranks);
      t_who = ranks.several() ? fmt::format("megatrain-train ({} {} of {})", ranks.noun(), ranks.rank(), ranks.world())
                              : std::string();
      return run(s, *p.app, std::move(rank_plan), ranks);
    } catch (const StoppedBeforeTraining& e) {  // (as asked: no error; every rank stops alike)
      if (ranks.lead()) std::fprintf(stderr, "megatrain-train: %s\n", e.reason().c_str());
      return 128 + e.signal();
    } catch (const megatrain::Error& e) {
      // What went wrong and what to do, in the user's terms (the library's function and source line
      // are in e.what(), for a bug report: MEGATRAIN_DEBUG=1 prints them).
      return fail(std::getenv("MEGATRAIN_DEBUG") ? e.what() : e.reason().c_str());
    } catch (const std::exception& e) {
      return fail(e.what());
    }
  };
  // (a warning says which rank it comes from, as an error does; from a thread of no rank of several
  // in this process, one of a trainer's stages, the library's own words)
  megatrain::set_log_sink([](megatrain::LogLevel level, std::string_view message) {
    const std::string& who = t_who.empty() ? g_who : t_who;
    std::fprintf(stderr, "%s%s %.*s\n", who.empty() ? "megatrain " : (who + ": ").c_str(),
                 level == megatrain::LogLevel::warning ? "warning:" : "info:", static_cast<int>(message.size()),
                 message.data());
  });
  const bool use_cuda = s.backend == "cuda" || (s.backend == "auto" && cuda_device_present());
  if (gpus == 1) {
    // Launched as several processes (torchrun, mpirun, srun): data parallel, one process per GPU
    // (docs/distributed.md); the first process alone prints and writes the run folder.
    Ranks ranks;
    return rank_main(ranks, [&](Ranks& r) {
      r = Ranks::join(use_cuda, s.rendezvous_timeout);
      if (!r.lead()) (void)!std::freopen("/dev/null", "w", stdout);
      if (r.several()) g_who = fmt::format("megatrain-train (process {} of {})", r.rank(), r.world());
    }, std::move(plan));
  }
  // --gpus N: this process drives N GPUs, a rank (thread) each, as N processes would
  // (docs/distributed.md#one-process-several-gpus); the first rank alone prints and writes the run
  // folder. Where one fails, the others' communicators are aborted at once.
  if (!s.host_memory.empty()) setenv("MEGATRAIN_HOST_MEMORY", s.host_memory.c_str(), 1);  // (before the threads)
  if (use_cuda && std::getenv("NCCL_NVLS_ENABLE") == nullptr) setenv("NCCL_NVLS_ENABLE", "0", 1);
  int port = 0;
  std::vector<std::unique_ptr<megatrain::dist::LocalComm>> local(static_cast<std::size_t>(gpus));  // (cpu backend)
  try {
    if (use_cuda)
      port = megatrain::dist::free_local_port();
    else
      local = megatrain::dist::LocalComm::group(gpus, Ranks::collective_timeout());
  } catch (const megatrain::Error& e) {
    std::fprintf(stderr, "megatrain-train: error: %s\n", e.reason().c_str());
    return 1;
  }
  std::mutex live_mutex;
  std::vector<megatrain::dist::HostComm*> live(static_cast<std::size_t>(gpus), nullptr);  // (each rank's, while it runs)
  int first_ended = -1;  // (the first rank that ended with a nonzero status)
  bool aborted = false;
  // (NCCL's communicators are one a rank: where one rank fails, the others' are aborted; the cpu
  // backend's group was aborted by the rank that failed, naming it)
  const auto abort_live = [&] {
    const std::lock_guard lock(live_mutex);
    if (aborted || g_failed_rank.load() < 0 || !use_cuda) return;
    aborted = true;
    for (auto* c : live)
      if (c != nullptr) c->abort(1);
  };
  g_abort_others = abort_live;
  const auto status = megatrain::dist::run_local_ranks(
      gpus,
      [&](int r) {
        Ranks ranks;
        RunPlan mine;  // (what main has filled in; the rest is each rank's own)
        mine.resume = plan.resume;
        mine.given = plan.given;
        mine.run_id = plan.run_id;
        mine.notes = plan.notes;
        mine.branch = plan.branch;
        const int st = rank_main(ranks, [&](Ranks& me) {
          me = Ranks::local(r, gpus, use_cuda, port, std::move(local[static_cast<std::size_t>(r)]), s.rendezvous_timeout);
          const std::lock_guard lock(live_mutex);
          live[static_cast<std::size_t>(r)] = me.comm();
        }, std::move(mine));
        const std::lock_guard lock(live_mutex);
        live[static_cast<std::size_t>(r)] = nullptr;
        return st;
      },
      [&](int ended) {  // (a rank ended with a nonzero status: where one failed, the others stop now)
        if (first_ended < 0) first_ended = ended;
        abort_live();  // (a stop signal, where none failed: every rank stops alike, nothing aborted)
      });
  g_abort_others = nullptr;
  // (the exit status: the failed rank's, else the first to end's: a stop signal's 128 + its number)
  if (const int f = g_failed_rank.load(); f >= 0 && status[static_cast<std::size_t>(f)] != 0)
    return status[static_cast<std::size_t>(f)];
  if (first_ended >= 0) return status[static_cast<std::size_t>(first_ended)];
  return 0;
}
