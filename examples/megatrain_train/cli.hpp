// megatrain-train's command line: the options, the --config file, and the options a resumed run
// takes over from its checkpoint.
//
// Every option can come from three places, later ones winning: the checkpoint being resumed
// (the options its run was given), the --config file, the command line. Origins records which
// options came from the command line and which from elsewhere, so that contradictions between
// options are judged as the user sees them (an option on the command line overrides one from a
// file, it does not contradict it).
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <optional>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "megatrain/core/error.hpp"
#include "megatrain/core/version.hpp"
#include "megatrain/io/hf_checkpoint.hpp"
#include "megatrain/model/config.hpp"
#include "megatrain/plan/memory_plan.hpp"
#include "megatrain/text/chat.hpp"
#include "megatrain/step/trainer_options.hpp"

namespace megatrain_train {

using json = nlohmann::json;
namespace fs = std::filesystem;

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

/// A boolean option: `--name` alone means true, `--name true` and `--name false` say which (and
/// a --config file's JSON true or false).
inline CLI::Option* add_bool_option(CLI::App* app, const std::string& name, bool& value, const std::string& description) {
  return app->add_flag(name, value, description)
      ->expected(0, 1)
      ->option_text(fmt::format("[true|false]={}", value ? "true" : "false"))
      ->capture_default_str();
}

/// The model options (--model, --model-config, --preset and the shape flags), bound to `s`:
/// megatrain-train's and megatrain-plan's.
inline void add_model_options(CLI::App& app_, Settings& s) {
  using megatrain::ModelConfig;
  CLI::App* app = &app_;
  auto* model = app->add_option_group("model", "Model shape (default: a small Llama)");
  model->add_option("--model", s.model_dir,
                    "Hugging Face model directory (config.json + safetensors) to fine-tune: shape and weights from there");
  add_bool_option(model, "--allow-dtype-mismatch", s.allow_dtype_mismatch,
                  "--model: load tensors stored in another float dtype than config.json declares");
  model->add_option("--model-config", s.model_config, "Hugging Face config.json giving the model shape");
  model->add_option("--preset", s.preset, "Built-in shape: " + fmt::format("{}", fmt::join(ModelConfig::preset_names(), ", ")));
  model->add_option("--hidden", s.hidden, "Hidden size")->capture_default_str();
  model->add_option("--layers", s.layers,
                    "Decoder layers (beside --preset or --model-config: that shape with this many layers, its first ones)")
      ->capture_default_str();
  model->add_option("--heads", s.heads, "Attention heads")->capture_default_str();
  model->add_option("--kv-heads", s.kv_heads, "Key/value heads (grouped-query attention)")->capture_default_str();
  model->add_option("--intermediate", s.intermediate, "MLP intermediate size")->capture_default_str();
  model->add_option("--head-dim", s.head_dim, "Head dimension (default hidden / heads)");
  model->add_option("--vocab", s.vocab, "Vocabulary size (default: 256 for text data)");
  model->add_option("--rope-theta", s.rope_theta, "Rotary base")->capture_default_str();
  model->add_option("--norm-eps", s.norm_eps, "RMSNorm epsilon")->capture_default_str();
  add_bool_option(model, "--tie-embeddings", s.tie_embeddings, "Share the embedding and LM head");

}

/// The options of a step's shape and layout (--batch, --seq, --micro-batches, --max-micro-batch,
/// --chunk, --token-chunk, --checkpoint-every), added to `train`.
inline void add_step_options(CLI::App& train_, Settings& s) {
  CLI::App* train = &train_;
  train->add_option("--batch", s.batch, "Sequences per optimizer step")->capture_default_str();
  train->add_option("--seq", s.seq, "Tokens per sequence")->capture_default_str();
  train->add_option("--micro-batches", s.micro_batches, "Gradient accumulation: split each batch into this many parts")->capture_default_str();
  train->add_option("--max-micro-batch", s.max_micro_batch,
                    "Most sequences on the device at once; a larger --batch runs as gradient accumulation over "
                    "micro-batches (0: no limit)")
      ->capture_default_str();
  train->add_option("--chunk", s.chunk, "Sequences per compute chunk (0: a whole micro-batch)")->capture_default_str();
  train->add_option("--token-chunk", s.token_chunk,
                    "Tokens per block of a decoder block's norms, projections and MLP (0: 16384 where a chunk holds more "
                    "than 32768 tokens, else the whole chunk); bounds their memory at long --seq")
      ->capture_default_str();
  train->add_option("--checkpoint-every", s.checkpoint_every,
                    "Activation checkpoints every N decoder blocks, the outputs between recomputed before the backward "
                    "(the same result; fewer checkpoints, one more forward of those blocks); 0: 1 where that fits, else "
                    "the smallest N that fits")
      ->capture_default_str();
}

/// --clip and --clip-mode, added to `train`.
inline void add_clip_options(CLI::App& train_, Settings& s) {
  CLI::App* train = &train_;
  train->add_option("--clip", s.clip, "Max global gradient norm (0: no clipping)")->capture_default_str();
  train->add_option("--clip-mode", s.clip_mode,
                    "exact (PyTorch's clip_grad_norm_ over this step's gradients, then AdamW) or stale (clips step t "
                    "with step t-1's norm: a different update, which lets the optimizer overlap the backward)")
      ->capture_default_str();
}

/// Where the step runs and what memory it may use (--backend, --host-memory, --gpu-memory,
/// --device-units, --keep-activations, --gradients), added to `runo`.
inline void add_memory_options(CLI::App& runo_, Settings& s) {
  CLI::App* runo = &runo_;
  runo->add_option("--backend", s.backend, "auto, cpu or cuda")->capture_default_str();
  runo->add_option("--host-memory", s.host_memory, "Host memory megatrain may use, e.g. 120G (default: what is free)");
  runo->add_option("--gpu-memory", s.gpu_memory, "GPU memory megatrain may use, e.g. 20G (default: what is free less 1 GiB)");
  runo->add_option("--device-units", s.device_units,
                   "Units (the first in forward order: embedding, blocks, head) whose AdamW state lives in GPU memory "
                   "and is updated there: auto (as many as fit), all, or a count (0: every unit on the host)")
      ->capture_default_str();
  runo->add_option("--keep-activations", s.keep_activations,
                   "Decoder blocks (the last ones) that keep their activations in GPU memory from forward to backward "
                   "instead of recomputing them (the same result, faster, more memory): auto (the plan's choice: the "
                   "fastest step that fits beside the AdamW state on the GPU), all, or a count")
      ->capture_default_str();
  runo->add_option("--spill-activations", s.spill_activations,
                   "Decoder blocks (among those that do not keep their activations on the GPU) that keep them in pinned "
                   "host memory instead of recomputing them, copied over PCIe beside the other blocks' work (the same "
                   "result; host memory and PCIe time instead of GPU time): auto (the plan's choice), or a count")
      ->capture_default_str();
  runo->add_option("--gradients", s.gradients,
                   "Where gradients wait for the global norm (exact clipping, micro-batches): auto (the plan's "
                   "choice: host memory where only that fits or where it is predicted faster, else GPU memory; a "
                   "resumed run's own where it fits), device (GPU memory) or host (4 more bytes of host memory per "
                   "parameter)")
      ->capture_default_str();
  runo->add_option("--host-bf16-copy", s.host_bf16_copy,
                   "Whether host memory keeps a bf16 copy of the weights to stream to the GPU (2 bytes a parameter): "
                   "auto (the plan's choice: kept where the plan fits with it, else none; kept with several ranks), true, "
                   "or false (12 bytes a "
                   "parameter of state instead of 14: the fp32 masters stream and the GPU rounds them, the same bits, "
                   "twice the weights' PCIe bytes; one process, or processes that do not shard the optimizer)")
      ->capture_default_str();
}

/// Refuses --host-bf16-copy false where `ranks` ranks shard the optimizer, which exchange the copy
/// (megatrain-train's and megatrain-plan's check).
inline void check_bf16_copy_option(const Settings& s, bool sharded, int ranks) {
  MT_CHECK(s.host_bf16_copy != "false" || !sharded,
           "--host-bf16-copy false: the {} ranks shard the optimizer (--shard-optimizer true) and exchange the bf16 copy; "
           "use --host-bf16-copy auto or true, or --shard-optimizer false", ranks);
}

/// --device-units and --keep-activations: "auto" (-1: TrainerOptions::kAutoDeviceUnits,
/// kAutoKeptBlocks), "all" (kAll, resolved with the model) or a count >= 0; nullopt when malformed.
inline constexpr std::int64_t kAll = -2;
static_assert(megatrain::TrainerOptions::kAutoDeviceUnits == -1 && megatrain::TrainerOptions::kAutoKeptBlocks == -1 &&
              megatrain::TrainerOptions::kAutoSpilledBlocks == -1);
inline std::optional<std::int64_t> parse_auto_all_count(const std::string& v) {
  if (v == "auto") return megatrain::TrainerOptions::kAutoDeviceUnits;
  if (v == "all") return kAll;
  std::int64_t n = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (ec != std::errc{} || end != v.data() + v.size() || n < 0) return std::nullopt;
  return n;
}

// Where the model's shape comes from: at most one of --model, --model-config, --preset, and no
// shape flag beside it but --layers beside --preset or --model-config (the shape cut to its first
// layers). Checked before anything is opened.
inline void check_model_source(const Settings& s) {
  const char* shape_flags[] = {"--hidden", "--layers", "--heads", "--kv-heads", "--intermediate", "--head-dim", "--rope-theta", "--norm-eps", "--tie-embeddings"};
  std::vector<std::string> sources;
  if (!s.model_dir.empty()) sources.emplace_back("--model");
  if (!s.model_config.empty()) sources.emplace_back("--model-config");
  if (!s.preset.empty()) sources.emplace_back("--preset");
  MT_CHECK(sources.size() <= 1, "{} and {} both give the model shape; pass one", sources[0], sources[1]);
  if (sources.empty()) return;
  for (const char* f : shape_flags) {
    if (std::string_view(f) == "--layers" && sources[0] != "--model") continue;  // (a cut: model_config())
    MT_CHECK(!s.origins.conflicts(f, sources[0]), "{} contradicts {}: the shape comes from there; drop one{}", f, sources[0],
             std::string_view(f) == "--layers" ? " (--layers cuts a --preset or --model-config shape; a --model folder's weights "
                                                 "are its whole model)"
                                               : "");
  }
}

inline megatrain::ModelConfig model_config(const Settings& s, const CLI::App& app, std::int64_t data_vocab,
                                           const megatrain::io::HfCheckpoint* hf) {
  using megatrain::ModelConfig;
  if (hf != nullptr || !s.model_config.empty() || !s.preset.empty()) {
    ModelConfig c = hf != nullptr              ? hf->config()
                    : s.model_config.empty() ? ModelConfig::preset(s.preset)
                                             : ModelConfig::from_file(s.model_config);
    // (the shape cut to its first layers, or repeated; a --config file's count yields to a
    // --preset or --model-config on the command line, as check_model_source's shape flags do)
    const std::string source = s.model_config.empty() ? "--preset" : "--model-config";
    if (hf == nullptr && s.origins.conflicts("--layers", source)) {
      MT_CHECK(s.layers >= 1 && s.layers <= ModelConfig::kMaxLayers, "--layers must be in [1, {}] (got {})",
               ModelConfig::kMaxLayers, s.layers);
      c = c.with_layers(s.layers);
    }
    if (app.get_option("--vocab")->count() > 0)
      MT_CHECK(s.vocab == c.vocab_size, "--vocab {} contradicts the model's vocab_size {}", s.vocab, c.vocab_size);
    return c;
  }
  json j{{"architectures", {"LlamaForCausalLM"}},
         {"hidden_size", s.hidden},
         {"intermediate_size", s.intermediate},
         {"num_hidden_layers", s.layers},
         {"num_attention_heads", s.heads},
         {"num_key_value_heads", s.kv_heads},
         {"vocab_size", s.vocab > 0 ? s.vocab : data_vocab},
         {"max_position_embeddings", std::max<std::int64_t>(s.seq, 2048)},
         {"rms_norm_eps", s.norm_eps},
         {"rope_theta", s.rope_theta},
         {"tie_word_embeddings", s.tie_embeddings}};
  if (s.head_dim > 0) j["head_dim"] = s.head_dim;
  return ModelConfig::from_json(j, "command-line model shape");
}

/// The step's shape and layout as TrainerOptions (batch, sequence, micro-batches, chunks, token
/// blocks, checkpoints, where gradients wait, device units) for a model of `layers` blocks:
/// megatrain-train's and megatrain-plan's.
inline megatrain::TrainerOptions step_layout(const Settings& s, std::int64_t layers) {
  const std::optional<std::int64_t> device_units = parse_auto_all_count(s.device_units);
  MT_CHECK(device_units.has_value(), "--device-units must be auto, all or a count >= 0 (got '{}')", s.device_units);
  const std::optional<std::int64_t> kept = parse_auto_all_count(s.keep_activations);
  MT_CHECK(kept.has_value(), "--keep-activations must be auto, all or a count >= 0 (got '{}')", s.keep_activations);
  const std::optional<std::int64_t> spilled = parse_auto_all_count(s.spill_activations);
  MT_CHECK(spilled.has_value() && *spilled != kAll, "--spill-activations must be auto or a count >= 0 (got '{}')",
           s.spill_activations);
  megatrain::TrainerOptions o;
  o.batch_rows = s.batch;
  o.seq_len = s.seq;
  o.micro_batches = s.micro_batches;
  o.max_micro_rows = s.max_micro_batch;
  o.chunk_rows = s.chunk;
  MT_CHECK(s.token_chunk >= 0, "--token-chunk must be >= 0 (0: automatic; got {})", s.token_chunk);
  o.token_chunk = s.token_chunk;
  MT_CHECK(s.checkpoint_every >= 0, "--checkpoint-every must be >= 0 (0: as the plan needs; got {})", s.checkpoint_every);
  o.checkpoint_every = s.checkpoint_every;
  o.gradient_home = s.gradients == "host" ? megatrain::GradientHome::host : megatrain::GradientHome::device;
  MT_CHECK(s.host_bf16_copy == "auto" || s.host_bf16_copy == "true" || s.host_bf16_copy == "false",
           "--host-bf16-copy must be auto, true or false (got '{}')", s.host_bf16_copy);
  o.host_bf16_copy = s.host_bf16_copy != "false";
  o.device_units = *device_units == kAll ? layers + 2 : *device_units;
  MT_CHECK(o.device_units <= layers + 2, "--device-units {} is more than the model's {} units (the embedding, {} blocks and "
           "the head); use all", o.device_units, layers + 2, layers);
  o.kept_blocks = *kept == kAll ? layers : *kept;
  MT_CHECK(o.kept_blocks <= layers, "--keep-activations {} is more than the model's {} blocks; use all", o.kept_blocks, layers);
  MT_CHECK(o.kept_blocks <= 0 || s.checkpoint_every <= 1,
           "--keep-activations {} needs a checkpoint at every block: drop --checkpoint-every {} (or keep none)", s.keep_activations,
           s.checkpoint_every);
  o.spilled_blocks = *spilled;
  MT_CHECK(o.spilled_blocks <= 0 || o.kept_blocks < 0 || o.spilled_blocks + o.kept_blocks <= layers,
           "--spill-activations {} and --keep-activations {} are more than the model's {} blocks", o.spilled_blocks,
           o.kept_blocks, layers);
  MT_CHECK(o.spilled_blocks <= layers, "--spill-activations {} is more than the model's {} blocks", o.spilled_blocks, layers);
  MT_CHECK(o.spilled_blocks <= 0 || s.checkpoint_every <= 1,
           "--spill-activations {} needs a checkpoint at every block: drop --checkpoint-every {} (or spill none)",
           s.spill_activations, s.checkpoint_every);
  return o;
}

/// The host memory a run may use, and where that figure comes from: --host-memory, the
/// environment's MEGATRAIN_HOST_MEMORY, or what is available now.
/// Whether the processes share one bf16 copy of the weights (--share-weights; ZeRO-1 only):
/// `one_host` says whether every process runs on one host, which `auto` asks for.
inline bool share_weights(const Settings& s, bool one_host) {
  return s.shard_optimizer && (s.share_weights == "true" || (s.share_weights == "auto" && one_host));
}

inline megatrain::plan::HostBudget host_budget(const Settings& s) {
  const bool env = std::getenv("MEGATRAIN_HOST_MEMORY") != nullptr && *std::getenv("MEGATRAIN_HOST_MEMORY") != '\0';
  return {megatrain::available_host_memory(),
          !s.host_memory.empty() ? "--host-memory" : env ? "MEGATRAIN_HOST_MEMORY" : "available host memory"};
}

/// The program's options, bound to `s`.
inline std::unique_ptr<CLI::App> make_app(Settings& s, std::string& config_file) {
  using megatrain::ModelConfig;
  auto app = std::make_unique<CLI::App>(
      "megatrain-train: train a decoder-only language model far larger than the GPU, from a Hugging Face folder, a "
      "config.json, a preset or a shape (docs/training.md)",
      "megatrain-train");
  app->set_help_flag("-h,--help", "Print this help and exit");
  app->set_version_flag("--version", "megatrain-train " + std::string(megatrain::version()), "Print the version and exit");
  // An option may come from the checkpoint, the config file and the command line: the last wins.
  app->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app->add_option("--config", config_file, "JSON file of options (keys: long option names); the command line wins");

  add_model_options(*app, s);

  auto* data = app->add_option_group("data", "Data (default: the built-in text)");
  data->add_option("--data", s.data,
                   "Token file (.bin: uint16/uint32 ids, llm.c format, or examples with .mask and .idx beside it), JSONL or "
                   "JSON records (documents, prompt/completion, alpaca, conversations: tokenised with the model's tokenizer), "
                   "or a text file (with a tokenizer: one document; without: byte tokens)");
  data->add_option("--data-format", s.data_format,
                   "Token width of .bin files: u16, u32, or auto (u32 where the vocabulary exceeds 65536, else u16)")
      ->capture_default_str();
  data->add_option("--val-data", s.val_data, "Separate validation token file (default: hold out the tail of --data)");
  data->add_option("--val-fraction", s.val_fraction, "Fraction of the data (tokens, or examples) held out for validation")
      ->capture_default_str();
  data->add_option("--tokenizer", s.tokenizer,
                   "Tokenizer for text and JSON data: a Hugging Face folder or its tokenizer.json (default: --model's)");
  data->add_option("--chat-format", s.chat_format,
                   fmt::format("How conversations and alpaca records are rendered: auto (the tokenizer's chat template, "
                               "where megatrain renders it) or one of: {}",
                               megatrain::text::chat_format_names()))
      ->capture_default_str();
  data->add_option("--train-on", s.train_on,
                   "Examples: the tokens the loss is taken on: completion (the completions and assistant turns) or "
                   "prompt+completion (every token)")
      ->capture_default_str();
  add_bool_option(data, "--pack", s.pack,
                  "Examples: pack several into each sequence of --seq tokens, attention kept within each (default "
                  "false: one example per sequence, padded)");
  add_bool_option(data, "--skip-bad-lines", s.skip_bad_lines,
                  "JSON data: skip (and count) bad records instead of stopping at the first");

  auto* train = app->add_option_group("training", "Batch, schedule and optimizer");
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
      ->capture_default_str();
  train->add_option("--weight-decay", s.weight_decay, "AdamW decoupled weight decay (matrices only)")->capture_default_str();
  train->add_option("--beta1", s.beta1, "AdamW beta1")->capture_default_str();
  train->add_option("--beta2", s.beta2, "AdamW beta2")->capture_default_str();
  train->add_option("--eps", s.eps, "AdamW epsilon")->capture_default_str();
  add_clip_options(*train, s);
  train->add_option("--on-nonfinite", s.on_nonfinite,
                    "A step whose loss or gradient is NaN or infinite changes nothing; then: stop (save the last good "
                    "step's train state and exit) or skip (count it and go on, as loss scalers do; needs exact clipping)")
      ->capture_default_str();
  train->add_option("--max-nonfinite-skips", s.max_nonfinite_skips,
                    "With --on-nonfinite skip: stop after this many non-finite steps in a row")
      ->capture_default_str();

  auto* runo = app->add_option_group("run", "Run");
  runo->add_option("--seed", s.seed, "Seed for initialisation and data order")->check(CLI::NonNegativeNumber)->capture_default_str();
  runo->add_option("--out", s.out, "Output directory (default: runs/<date-time>)");
  add_bool_option(runo, "--overwrite", s.overwrite,
                  "Replace the previous run in --out, whole (moved aside first, removed once this run has a checkpoint "
                  "or its end)");
  runo->add_option("--on-metrics-error", s.on_metrics_error,
                   "A metrics line that cannot be written (a full disk): stop (save the train state, the lines not "
                   "written with it, and exit) or continue (keep the lines until they can be written)")
      ->check(CLI::IsMember({"stop", "continue"}))
      ->capture_default_str();
  runo->add_option("--rendezvous-timeout", s.rendezvous_timeout,
                   "Launched as several processes (torchrun, mpirun, srun): seconds a process waits for the others "
                   "at start before it gives up naming the missing ones (default: MEGATRAIN_RENDEZVOUS_TIMEOUT, else 300)")
      ->check(CLI::NonNegativeNumber);
  runo->add_option("--gpus", s.gpus,
                   "GPUs of this host to train on, data parallel (N, or all; default 1): this process drives them, a "
                   "rank each (--gpu-ranks); not with a launcher (torchrun, mpirun, srun), which starts one process a "
                   "GPU itself. With the cpu backend: N ranks of it in this process (tests without GPUs)")
      ->capture_default_str();
  runo->add_option("--gpu-ranks", s.gpu_ranks,
                   "With --gpus N: threads (this process drives the N GPUs, a thread each) or processes (one process "
                   "a GPU, started by this program as torchrun would)")
      ->check(CLI::IsMember({"threads", "processes"}))
      ->capture_default_str();
  add_bool_option(runo, "--shard-optimizer", s.shard_optimizer,
                   "Launched as several processes: each keeps and steps 1/N of the fp32 masters and AdamW's moments "
                   "(ZeRO-1: less host memory; the updated weights gathered after each update); false: every process "
                   "all of it (more memory, the host units' update beside the next step)");
  runo->add_option("--share-weights", s.share_weights,
                   "Several processes with --shard-optimizer on GPUs, all on one host: the bf16 weights they stream "
                   "held once in host memory and mapped by every process (2 bytes a parameter for the host, not 2 a "
                   "process); auto: where the launcher says every process runs on this host; true, false")
      ->check(CLI::IsMember({"auto", "true", "false"}))
      ->capture_default_str();
  runo->add_option("--gather-weights", s.gather_weights,
                   "Several processes with --shard-optimizer on GPUs, each with its own bf16 copy (--share-weights "
                   "false, or several hosts): gpus: each process uploads its part of every unit it streams and the "
                   "GPUs gather the rest over NCCL (1/N of the uploads, nothing gathered between steps); host: the "
                   "updated weights gathered through host memory after each update")
      ->check(CLI::IsMember({"gpus", "host"}))
      ->capture_default_str();
  runo->add_option("--eval-every", s.eval_every, "Validation loss every N steps (0: only at the end)")->capture_default_str();
  runo->add_option("--eval-batches", s.eval_batches, "Batches per validation (with --steps 0: 0 skips the evaluation)")->capture_default_str();
  runo->add_option("--log-every", s.log_every, "Print every N steps when not on a terminal")->capture_default_str();
  add_memory_options(*runo, s);
  add_bool_option(runo, "--gemm-tuning", s.gemm_tuning,
                   "GPU: time cuBLASLt's first algorithms for each matrix product over the first step and keep the "
                   "fastest (a few % faster; two fresh runs may then differ in the last bits, a resumed run takes its "
                   "checkpoint's choices and continues bit for bit); false: the heuristic's first, the same in every run");

  auto* ck = app->add_option_group("checkpoints", "Train-state checkpoints (docs/checkpointing.md)");
  ck->add_option("--save-every", s.save_every,
                 "Save the whole train state to <out>/checkpoints every N steps and at the end (0: only when "
                 "interrupted by SIGINT or SIGTERM)")
      ->capture_default_str();
  ck->add_option("--keep", s.keep, "Checkpoints kept, newest first (0: all)")->capture_default_str();
  ck->add_option("--resume", s.resume,
                 "Continue a run: 'latest' (the default: the newest checkpoint in --out), a checkpoint folder, or a run "
                 "folder. Options not given again are the checkpoint's")
      ->expected(0, 1);

  auto* exp = app->add_option_group("export", "Hugging Face export (default: none)");
  exp->add_option("--export", s.export_dir, "Write the trained model as a Hugging Face directory here at the end (atomically)");
  exp->add_option("--export-every", s.export_every, "Also export every N steps (0: only at the end)")->capture_default_str();
  exp->add_option("--export-dtype", s.export_dtype, "Exported weights: bf16, f16 or f32")->capture_default_str();
  exp->add_option("--shard-size", s.shard_size, "Largest safetensors shard, e.g. 5GB (decimal), 2GiB")->capture_default_str();
  return app;
}

// Turns the JSON config into "--key value" arguments placed before the command line, so the
// command line (parsed later, last value wins) overrides the file.
inline std::vector<std::string> config_args(const std::string& path, const CLI::App& app) {
  std::ifstream f(path);
  MT_CHECK(f.good(), "cannot open config file '{}'", path);
  json j;
  try {
    j = json::parse(f);
  } catch (const json::exception& e) {  // (parse_error, or out_of_range for a number beyond a double's range)
    MT_FAIL("config file '{}': malformed JSON: {}", path, e.what());
  }
  MT_CHECK(j.is_object(), "config file '{}' must hold a JSON object of option names and values", path);
  std::vector<std::string> args;
  for (const auto& [key, value] : j.items()) {
    MT_CHECK(key != "config", "config file '{}' cannot name another config file", path);
    try {
      (void)app.get_option("--" + key);
    } catch (const CLI::OptionNotFound&) {
      MT_FAIL("config file '{}': unknown option '{}' (see megatrain-train --help)", path, key);
    }
    args.push_back("--" + key);
    if (value.is_string()) args.push_back(value.get<std::string>());
    else if (value.is_boolean()) args.push_back(value.get<bool>() ? "true" : "false");
    else if (value.is_number()) args.push_back(value.dump());
    else MT_FAIL("config file '{}': option '{}' must be a string, number or boolean, not {}", path, key, value.dump());
  }
  return args;
}

/// Throws megatrain::Error for an empty argument of `args` (in command-line order) that is no
/// option's value. CLI11 2.1.2 takes such an argument for the name of an option group (groups have
/// none) and then never returns: `megatrain-train "" --config x` and {"help": ""} in a --config
/// file hung. A program without positional arguments refuses it anyway.
inline void refuse_empty_positionals(const CLI::App& app, const std::vector<std::string>& args, std::string_view program) {
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (!args[i].empty()) continue;
    bool value = false;
    if (i > 0 && args[i - 1].rfind("--", 0) == 0 && args[i - 1].find('=') == std::string::npos) {
      try {
        value = app.get_option(args[i - 1])->get_items_expected_max() > 0;
      } catch (const CLI::OptionNotFound&) {
      }
    }
    MT_CHECK(value, "an empty argument (\"\"){} is no option's value, and {} takes no positional argument",
             i > 0 ? " after " + args[i - 1] : std::string(), program);
  }
}

/// What was parsed: the settings and the parser that holds their option records.
struct Parsed {
  std::unique_ptr<Settings> settings = std::make_unique<Settings>();
  std::string config_file;
  std::unique_ptr<CLI::App> app;
};

/// Parses into `p` (fresh): `before` (options taken over from a checkpoint: "--key value" pairs),
/// then the --config file named in `args`, then `args` (the command line), later ones winning.
/// Throws CLI::ParseError (p.app can report it) or megatrain::Error.
inline void parse(Parsed& p, const std::vector<std::string>& args, const std::vector<std::string>& before = {}) {
  Settings& s = *p.settings;
  p.app = make_app(s, p.config_file);
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--config" && i + 1 < args.size()) p.config_file = args[i + 1];
    else if (args[i].rfind("--config=", 0) == 0) p.config_file = args[i].substr(9);
  }
  // An option may appear once on the command line (a value there overrides the file's).
  for (const auto& a : args) {
    if (a.rfind("--", 0) != 0 || a.size() == 2) continue;
    const std::string name = a.substr(0, a.find('='));
    MT_CHECK(s.origins.cli.insert(name).second, "{} is given more than once; pass it once", name);
  }
  std::vector<std::string> all = before;
  if (!p.config_file.empty()) {
    const auto file = config_args(p.config_file, *p.app);
    for (const auto& a : file)
      if (a.rfind("--", 0) == 0) s.origins.config.insert(a);
    all.insert(all.end(), file.begin(), file.end());
  }
  for (const auto& a : all)
    if (a.rfind("--", 0) == 0) s.origins.file.insert(a);
  all.insert(all.end(), args.begin(), args.end());
  refuse_empty_positionals(*p.app, all, "megatrain-train");
  std::reverse(all.begin(), all.end());  // CLI11 parses a vector given in reverse order
  p.app->parse(all);
  s.resume_given = p.app->get_option("--resume")->count() > 0;
  if (s.resume_given && s.resume.empty()) s.resume = "latest";
}

/// Whether option x, rather than y (which sets the same thing), decides: x is given and y is not,
/// or x on the command line overrides y from a file. Throws where both are given alike.
inline bool decides(const Settings& s, const std::string& x, const std::string& y) {
  const Origins& o = s.origins;
  MT_CHECK(!(o.conflicts(x, y) && o.conflicts(y, x)), "{} and {} set the same thing; pass one of them", x, y);
  return o.given(x) && (!o.given(y) || o.cli.contains(x));
}

/// The floor of a decaying schedule (see Settings::min_lr).
inline double min_lr_of(const Settings& s) {
  if (decides(s, "--min-lr", "--min-lr-ratio")) return s.min_lr;
  const double ratio = s.origins.given("--min-lr-ratio") ? s.min_lr_ratio : s.schedule == "linear" ? 0.0 : 0.1;
  return ratio * s.lr;
}

/// The options this run was given (command line, config file, or taken over from a checkpoint)
/// that a resumed run takes over: name -> value as the parser holds it (paths made absolute).
inline json given_options(const Parsed& p) {
  json j = json::object();
  const CLI::App& app = *p.app;
  std::vector<const CLI::Option*> opts = app.get_options();
  for (const CLI::App* group : app.get_subcommands([](const CLI::App*) { return true; }))
    for (const CLI::Option* opt : group->get_options()) opts.push_back(opt);
  for (const CLI::Option* opt : opts) {
    if (opt->get_lnames().empty() || opt->count() == 0) continue;
    const std::string name = "--" + opt->get_lnames().front();
    if (!replayed_option(name)) continue;
    std::string value = opt->as<std::string>();
    if (path_option(name) && !value.empty()) value = fs::absolute(value).lexically_normal().string();
    j[name] = value;
  }
  return j;
}

/// What a checkpoint records of the options: those given (given_options), plus the value of
/// every option that defines the update even where it was left at its default, so that a resume
/// by a later megatrain with other defaults still continues the same run.
inline json recorded_options(const Parsed& p) {
  json j = given_options(p);
  j.erase("--gpus");  // (how many GPUs a resumed run uses is the resuming command's choice)
  j.erase("--gpu-ranks");
  const Settings& s = *p.settings;
  const auto record = [&](const char* name, const std::string& value) {
    if (!j.contains(name)) j[name] = value;
  };
  record("--batch", fmt::format("{}", s.batch));
  record("--seq", fmt::format("{}", s.seq));
  record("--seed", fmt::format("{}", s.seed));
  record("--lr", fmt::format("{}", s.lr));
  record("--weight-decay", fmt::format("{}", s.weight_decay));
  record("--beta1", fmt::format("{}", s.beta1));
  record("--beta2", fmt::format("{}", s.beta2));
  record("--eps", fmt::format("{}", s.eps));
  record("--schedule", s.schedule);
  record("--clip", fmt::format("{}", s.clip));
  if (s.clip > 0) record("--clip-mode", s.clip_mode);
  if (s.schedule != "constant" && !j.contains("--min-lr-ratio")) record("--min-lr", fmt::format("{}", min_lr_of(s)));
  return j;
}

/// "--key value" arguments of `given` (from a checkpoint) for parse(); `only` (if not empty)
/// restricts them to those names, and those in `except` are left out.
inline std::vector<std::string> replay_args(const json& given, const std::set<std::string>& only = {},
                                            const std::set<std::string>& except = {}) {
  std::vector<std::string> args;
  for (const auto& [name, value] : given.items()) {
    if (!replayed_option(name) || (!only.empty() && !only.contains(name)) || except.contains(name)) continue;
    args.push_back(name);
    args.push_back(value.get<std::string>());
  }
  return args;
}

}  // namespace megatrain_train
