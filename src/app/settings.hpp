// What megatrain-train's options say (Settings), and where each was given (Origins).
//
// Every option can come from three places, later ones winning: the checkpoint being resumed (the
// options its run was given), the --config file, the command line. Origins records which options
// came from the command line and which from elsewhere, so that contradictions between options are
// judged as the user sees them (an option on the command line overrides one from a file, it does
// not contradict it).
#pragma once

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <ctime>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "megatrain/step/trainer_options.hpp"

namespace megatrain::app {

// Where each option was given: on the command line or elsewhere (the --config file, or the
// checkpoint of a resumed run). Long names, "--x".
struct Origins {
  std::set<std::string> cli, file;  // file: the --config file's and the checkpoint's
  std::set<std::string> config;     // the --config file's
  /// Given by the user in this invocation (command line or --config file), not taken over.
  bool given_now(const std::string& x) const { return cli.count(x) > 0 || config.count(x) > 0; }
  /// Whether option x, beside option y (which makes x irrelevant or contradicts it), is an
  /// error: unless x comes only from a file and y from the command line — there the command line
  /// overrides the file, as a value on the command line does.
  bool conflicts(const std::string& x, const std::string& y) const {
    return cli.count(x) > 0 || (file.count(x) > 0 && cli.count(y) == 0);
  }
  bool given(const std::string& x) const { return cli.count(x) > 0 || file.count(x) > 0; }
};

struct Settings {
  Origins origins;
  // model
  std::string model_dir, model_config, preset;
  bool allow_dtype_mismatch = false;
  std::int64_t hidden = 128, layers = 4, heads = 4, kv_heads = 2, intermediate = 352, vocab = 0, head_dim = 0;
  double rope_theta = 10000.0, norm_eps = 1e-5;
  bool tie_embeddings = true;
  // data
  std::string data, val_data, data_format = "auto";
  double val_fraction = 0.05;
  // text and JSON data: the tokenizer (default --model's), the chat format, what is trained on
  std::string tokenizer, chat_format = "auto", train_on = "completion";
  bool skip_bad_lines = false;
  bool pack = false;
  // what the step minimises: sft (cross-entropy), dpo (preference pairs: train/preference.hpp) or
  // grpo (rewards of sampled completions: train_grpo.hpp)
  std::string objective = "sft", dpo_loss = "sigmoid";
  double dpo_beta = 0.1, dpo_label_smoothing = 0.0;
  // --objective grpo: the rewards (an answer's regular expression, a format's, a program), their
  // weights ("1,0.2"), the completions a prompt and their sampling, the policy loss (docs/rl.md)
  std::string reward_answer, reward_format, reward_command, reward_weights, grpo_loss = "dapo", scale_rewards = "group";
  double reward_timeout = 300, temperature = 1.0, top_p = 1.0, min_p = 0.0, clip_eps = 0.2, clip_eps_high = 0.2, kl_beta = 0;
  std::int64_t generations = 8, max_completion_tokens = 0, top_k = 0, updates_per_batch = 1;
  bool skip_equal_groups = false;
  // schedule and optimizer
  std::int64_t batch = 8, seq = 128, micro_batches = 1, max_micro_batch = 0, chunk = 0, token_chunk = 0, checkpoint_every = 0,
               steps = 60;
  double lr = 3e-3, weight_decay = 0.1, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, clip = 1.0;
  // The floor of a decaying schedule: --min-lr (absolute) or --min-lr-ratio x --lr (default 0.1
  // with cosine, 0 with linear); see min_lr_of().
  double min_lr = 0, min_lr_ratio = 0;
  // Warm-up steps: --warmup, or --warmup-ratio x the schedule's length (rounded up); default
  // min(10, length / 5) for a decaying schedule, none for a constant one.
  std::int64_t warmup = -1;
  double warmup_ratio = 0;
  // Exact clipping by default (PyTorch's clip_grad_norm_); stale changes the update (docs/training.md).
  std::string schedule = "cosine", clip_mode = "exact";
  // where gradients wait for the norm, and how many units keep their AdamW state on the GPU
  std::string gradients = "auto", device_units = "auto";
  // whether host memory keeps a bf16 copy of the weights: auto, true or false
  std::string host_bf16_copy = "auto";
  // a step whose loss or gradient is not finite: stop (keeping the last good state) or skip it
  std::string on_nonfinite = "stop";
  std::int64_t max_nonfinite_skips = 10;
  // blocks that keep their activations for the backward (auto: the plan's choice)
  std::string keep_activations = "auto";
  // blocks (among the others) that spill their activations to host memory (auto: the plan's choice)
  std::string spill_activations = "auto";
  // run
  std::uint64_t seed = 1;
  std::string out, backend = "auto", host_memory, gpu_memory;
  std::int64_t eval_every = 20, eval_batches = 4, log_every = 1;
  bool overwrite = false;
  // a metrics line that cannot be written: stop or continue
  std::string on_metrics_error = "stop";
  std::string tensorboard;  // --tensorboard DIR: the metrics as TensorBoard event files too
  // --sample-every N --sample-prompts FILE: greedy completions of the prompts every N steps, into
  // samples.jsonl and report.html (--sample-tokens: their length at most)
  std::int64_t sample_every = 0, sample_tokens = 48;
  std::string sample_prompts;
  // cuBLASLt's algorithms timed over the first step, each product's fastest kept (a resumed run
  // takes its checkpoint's)
  bool gemm_tuning = true;
  // several processes (torchrun, mpirun, srun): how long a rank waits for its peers at start (0:
  // MEGATRAIN_RENDEZVOUS_TIMEOUT, else 300 s)
  double rendezvous_timeout = 0;
  // several processes: each keeps and steps 1/N of AdamW's state (ZeRO-1), or all of it
  bool shard_optimizer = true;
  // several processes with ZeRO-1 on GPUs: the bf16 weights mapped by the processes of the host
  // together (auto: where every process runs on this host, as the launcher says)
  std::string share_weights = "auto";
  std::string gather_weights = "gpus";
  std::string gpus = "1";  // --gpus: 1, N or all
  std::string gpu_ranks = "threads";  // --gpu-ranks: the ranks of --gpus N as threads of this process, or processes
  // checkpoints
  std::int64_t save_every = 0, keep = 2;
  std::string resume;  // "latest" (or empty) or a folder; see resume_given
  bool resume_given = false;
  // Hugging Face export
  std::string export_dir, export_dtype = "bf16", shard_size = "5GB";
  std::int64_t export_every = 0;
  bool export_language_model = false;  // a multimodal folder's language model alone, not the whole model
};

/// Options that name where the model comes from (a resumed run takes its model from the
/// checkpoint: these are not taken over, and when given again the model they describe must be the
/// checkpoint's), and the shape flags of a model given on the command line (taken over, so that
/// one given again is compared with the rest of the shape as it was).
inline const std::vector<std::string>& model_source_options() {
  static const std::vector<std::string> v{"--model", "--allow-dtype-mismatch", "--model-config", "--preset"};
  return v;
}
inline const std::vector<std::string>& model_shape_options() {
  static const std::vector<std::string> v{"--hidden", "--layers", "--heads", "--kv-heads", "--intermediate", "--head-dim",
                                          "--vocab", "--rope-theta", "--norm-eps", "--tie-embeddings"};
  return v;
}
/// Options whose values are paths (recorded as absolute paths, for a resume from elsewhere).
inline bool path_option(const std::string& name) {
  return name == "--data" || name == "--val-data" || name == "--export" || name == "--model" || name == "--model-config";
}
/// Options a resumed run takes over from its checkpoint (when not given again): all but these.
inline bool replayed_option(const std::string& name) {
  static const std::set<std::string> never{"--config", "--out", "--resume", "--overwrite", "--help",
                                           "--rendezvous-timeout"};
  return !never.contains(name) &&
         std::find(model_source_options().begin(), model_source_options().end(), name) == model_source_options().end();
}

inline std::string default_out_dir() {
  char buf[64];
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);  // (the ranks of --gpus N make theirs at once: not std::localtime's shared buffer)
  std::strftime(buf, sizeof buf, "runs/%Y%m%d-%H%M%S", &local);
  return buf;
}

/// --device-units and --keep-activations: "auto" (-1: TrainerOptions::kAutoDeviceUnits,
/// kAutoKeptBlocks), "all" (kAll, resolved with the model) or a count >= 0; nullopt when malformed.
inline constexpr std::int64_t kAll = -2;
static_assert(TrainerOptions::kAutoDeviceUnits == -1 && TrainerOptions::kAutoKeptBlocks == -1 &&
              TrainerOptions::kAutoSpilledBlocks == -1);
inline std::optional<std::int64_t> parse_auto_all_count(const std::string& v) {
  if (v == "auto") return TrainerOptions::kAutoDeviceUnits;
  if (v == "all") return kAll;
  std::int64_t n = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (ec != std::errc{} || end != v.data() + v.size() || n < 0) return std::nullopt;
  return n;
}

}  // namespace megatrain::app
