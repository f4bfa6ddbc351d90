// megatrain-train's options (options.hpp: make_train_app), group by group as --help lists them.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <string>

#include "megatrain/core/version.hpp"
#include "megatrain/text/chat.hpp"
#include "options.hpp"

namespace megatrain::app {

namespace {

// --data and how it is read: token files, JSON records, text; the tokenizer and chat format.
void add_data_options(CLI::App& app, Settings& s) {
  auto* data = app.add_option_group("data", "Data (default: the built-in text)");
  data->add_option("--data", s.data,
                   "Token file (.bin: uint16/uint32 ids, llm.c format, or examples with .mask and .idx beside it), JSONL or "
                   "JSON records (documents, prompt/completion, alpaca, conversations, preference pairs: tokenised with the "
                   "model's tokenizer), "
                   "or a text file (with a tokenizer: one document; without: byte tokens)");
  data->add_option("--data-format", s.data_format,
                   "Token width of .bin files: u16, u32, or auto (u32 where the vocabulary exceeds 65536, else u16)")
      ->check(choice("--data-format", {"auto", "u16", "u32"}))
      ->capture_default_str();
  data->add_option("--val-data", s.val_data, "Separate validation token file (default: hold out the tail of --data)");
  data->add_option("--val-fraction", s.val_fraction, "Fraction of the data (tokens, or examples) held out for validation")
      ->capture_default_str();
  data->add_option("--tokenizer", s.tokenizer,
                   "Tokenizer for text and JSON data: a Hugging Face folder or its tokenizer.json (default: --model's)");
  data->add_option("--chat-format", s.chat_format,
                   fmt::format("How conversations and alpaca records are rendered: auto (the tokenizer's chat template, "
                               "where megatrain renders it) or one of: {}",
                               text::chat_format_names()))
      ->capture_default_str();
  data->add_option("--train-on", s.train_on,
                   "Examples: the tokens the loss is taken on: completion (the completions and assistant turns) or "
                   "prompt+completion (every token)")
      ->check(choice("--train-on", {"completion", "prompt+completion"}))
      ->capture_default_str();
  add_bool_option(data, "--pack", s.pack,
                  "Examples: pack several into each sequence of --seq tokens, attention kept within each (default "
                  "false: one example per sequence, padded)");
  add_bool_option(data, "--skip-bad-lines", s.skip_bad_lines,
                  "JSON data: skip (and count) bad records instead of stopping at the first");

}

// The batch, the schedule, the optimizer, clipping, non-finite steps.
void add_training_options(CLI::App& app, Settings& s) {
  auto* train = app.add_option_group("training", "Batch, schedule and optimizer");
  add_step_options(*train, s);
  train->add_option("--steps", s.steps, "Optimizer steps (0: evaluate only: print the validation loss as JSON)")->capture_default_str();
  train->add_option("--lr", s.lr, "Peak learning rate")->capture_default_str();
  train->add_option("--min-lr", s.min_lr, "Floor of a decaying schedule, absolute (default: --min-lr-ratio x --lr)");
  train->add_option("--min-lr-ratio", s.min_lr_ratio,
                    "Floor of a decaying schedule as a fraction of --lr (default 0.1 with cosine, 0 with linear)");
  train->add_option("--warmup", s.warmup,
                    "Linear warm-up steps (default: min(10, steps / 5) for cosine and linear, 0 for constant)");
  train->add_option("--warmup-ratio", s.warmup_ratio, "Warm-up as a fraction of the schedule's steps, rounded up");
  train->add_option("--schedule", s.schedule,
                    "cosine or linear (warm-up, then decay to the floor at the last step), or constant (after any warm-up)")
      ->check(choice("--schedule", {"cosine", "linear", "constant"}))
      ->capture_default_str();
  train->add_option("--weight-decay", s.weight_decay, "AdamW decoupled weight decay (matrices only)")->capture_default_str();
  train->add_option("--beta1", s.beta1, "AdamW beta1")->capture_default_str();
  train->add_option("--beta2", s.beta2, "AdamW beta2")->capture_default_str();
  train->add_option("--eps", s.eps, "AdamW epsilon")->capture_default_str();
  add_clip_options(*train, s);
  train->add_option("--on-nonfinite", s.on_nonfinite,
                    "A step whose loss or gradient is NaN or infinite changes nothing; then: stop (save the last good "
                    "step's train state and exit) or skip (count it and go on, as loss scalers do; needs exact clipping)")
      ->check(choice("--on-nonfinite", {"stop", "skip"}))
      ->capture_default_str();
  train->add_option("--max-nonfinite-skips", s.max_nonfinite_skips,
                    "With --on-nonfinite skip: stop after this many non-finite steps in a row")
      ->capture_default_str();

}

// Where the run goes and runs: seed, folder, processes and GPUs, evaluation, memory.
void add_run_options(CLI::App& app, Settings& s) {
  auto* runo = app.add_option_group("run", "Run");
  runo->add_option("--seed", s.seed, "Seed for initialisation and data order")->check(at_least("--seed", 0))->capture_default_str();
  runo->add_option("--out", s.out, "Output directory (default: runs/<date-time>)");
  add_bool_option(runo, "--overwrite", s.overwrite,
                  "Replace the previous run in --out, whole (moved aside first, removed once this run has a checkpoint "
                  "or its end)");
  runo->add_option("--on-metrics-error", s.on_metrics_error,
                   "A metrics line that cannot be written (a full disk): stop (save the train state, the lines not "
                   "written with it, and exit) or continue (keep the lines until they can be written)")
      ->check(choice("--on-metrics-error", {"stop", "continue"}))
      ->capture_default_str();
  runo->add_option("--tensorboard", s.tensorboard,
                   "Also write the metrics as TensorBoard event files in this folder (tensorboard --logdir DIR); a "
                   "resumed run adds a file of its own");
  runo->add_option("--sample-every", s.sample_every,
                   "Every N steps (and after the last), greedy completions of --sample-prompts into samples.jsonl and "
                   "report.html (0: none)")
      ->check(at_least("--sample-every", 0));
  runo->add_option("--sample-prompts", s.sample_prompts,
                   "JSONL of prompts for --sample-every: {\"prompt\": text} or {\"messages\": [...]} a line "
                   "(docs/generation.md)");
  runo->add_option("--sample-tokens", s.sample_tokens, "Tokens a --sample-every completion may have at most")
      ->check(at_least("--sample-tokens", 1))
      ->capture_default_str();
  runo->add_option("--rendezvous-timeout", s.rendezvous_timeout,
                   "Launched as several processes (torchrun, mpirun, srun): seconds a process waits for the others "
                   "at start before it gives up naming the missing ones (default: MEGATRAIN_RENDEZVOUS_TIMEOUT, else 300)")
      ->check(at_least("--rendezvous-timeout", 0));
  runo->add_option("--gpus", s.gpus,
                   "GPUs of this host to train on, data parallel (N, or all; default 1): this process drives them, a "
                   "rank each (--gpu-ranks); not with a launcher (torchrun, mpirun, srun), which starts one process a "
                   "GPU itself. With the cpu backend: N ranks of it in this process (tests without GPUs)")
      ->capture_default_str();
  runo->add_option("--gpu-ranks", s.gpu_ranks,
                   "With --gpus N: threads (this process drives the N GPUs, a thread each) or processes (one process "
                   "a GPU, started by this program as torchrun would)")
      ->check(choice("--gpu-ranks", {"threads", "processes"}))
      ->capture_default_str();
  add_bool_option(runo, "--shard-optimizer", s.shard_optimizer,
                   "Launched as several processes: each keeps and steps 1/N of the fp32 masters and AdamW's moments "
                   "(ZeRO-1: less host memory; the updated weights gathered after each update); false: every process "
                   "all of it (more memory, the host units' update beside the next step)");
  runo->add_option("--share-weights", s.share_weights,
                   "Several processes with --shard-optimizer on GPUs, all on one host: the bf16 weights they stream "
                   "held once in host memory and mapped by every process (2 bytes a parameter for the host, not 2 a "
                   "process); auto: where the launcher says every process runs on this host; true, false")
      ->check(choice("--share-weights", {"auto", "true", "false"}))
      ->capture_default_str();
  runo->add_option("--gather-weights", s.gather_weights,
                   "Several processes with --shard-optimizer on GPUs, each with its own bf16 copy (--share-weights "
                   "false, or several hosts): gpus: each process uploads its part of every unit it streams and the "
                   "GPUs gather the rest over NCCL (1/N of the uploads, nothing gathered between steps); host: the "
                   "updated weights gathered through host memory after each update")
      ->check(choice("--gather-weights", {"gpus", "host"}))
      ->capture_default_str();
  runo->add_option("--eval-every", s.eval_every, "Validation loss every N steps (0: only at the end)")->capture_default_str();
  runo->add_option("--eval-batches", s.eval_batches, "Batches per validation (with --steps 0: 0 skips the evaluation)")->capture_default_str();
  runo->add_option("--log-every", s.log_every, "Print every N steps when not on a terminal")->capture_default_str();
  add_memory_options(*runo, s);
  add_bool_option(runo, "--gemm-tuning", s.gemm_tuning,
                   "GPU: time cuBLASLt's first algorithms for each matrix product over the first step and keep the "
                   "fastest (a few % faster; two fresh runs may then differ in the last bits, a resumed run takes its "
                   "checkpoint's choices and continues bit for bit); false: the heuristic's first, the same in every run");

}

// Train-state checkpoints: --save-every, --keep, --resume.
void add_checkpoint_options(CLI::App& app, Settings& s) {
  auto* ck = app.add_option_group("checkpoints", "Train-state checkpoints (docs/checkpointing.md)");
  ck->add_option("--save-every", s.save_every,
                 "Save the whole train state to <out>/checkpoints every N steps and at the end (0: only when "
                 "interrupted by SIGINT or SIGTERM)")
      ->capture_default_str();
  ck->add_option("--keep", s.keep, "Checkpoints kept, newest first (0: all)")->capture_default_str();
  ck->add_option("--resume", s.resume,
                 "Continue a run: 'latest' (the default: the newest checkpoint in --out), a checkpoint folder, or a run "
                 "folder. Options not given again are the checkpoint's")
      ->expected(0, 1);

}

// The Hugging Face export.
void add_export_options(CLI::App& app, Settings& s) {
  auto* exp = app.add_option_group("export", "Hugging Face export (default: none)");
  exp->add_option("--export", s.export_dir, "Write the trained model as a Hugging Face directory here at the end (atomically)");
  exp->add_option("--export-every", s.export_every, "Also export every N steps (0: only at the end)")->capture_default_str();
  exp->add_option("--export-dtype", s.export_dtype, "Exported weights: bf16, f16 or f32")->check(choice("--export-dtype", {"bf16", "f16", "f32"}))
      ->capture_default_str();
  exp->add_option("--shard-size", s.shard_size, "Largest safetensors shard, e.g. 5GB (decimal), 2GiB")->capture_default_str();
  exp->add_flag("--export-language-model", s.export_language_model,
                "From a Qwen3.5 folder with a vision tower: export the language model alone (a ...ForCausalLM folder), "
                "not the whole model");
}

}  // namespace

std::unique_ptr<CLI::App> make_train_app(Settings& s, std::string& config_file) {

  auto app = std::make_unique<CLI::App>(
      "megatrain-train: train a decoder-only language model far larger than the GPU, from a Hugging Face folder, a "
      "config.json, a preset or a shape (docs/training.md)",
      "megatrain-train");
  app->set_help_flag("-h,--help", "Print this help and exit");
  app->set_version_flag("--version", "megatrain-train " + std::string(version()), "Print the version and exit");
  // An option may come from the checkpoint, the config file and the command line: the last wins.
  app->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app->add_option("--config", config_file, "JSON file of options (keys: long option names); the command line wins");

  add_model_options(*app, s);
  add_data_options(*app, s);
  add_training_options(*app, s);
  add_objective_options(*app, s);
  add_grpo_options(*app, s);
  add_run_options(*app, s);
  add_checkpoint_options(*app, s);
  add_export_options(*app, s);
  return app;
}

}  // namespace megatrain::app
