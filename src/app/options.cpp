// The options megatrain-train and megatrain-plan share (options.hpp).
#include "options.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string_view>
#include <vector>

#include "megatrain/core/error.hpp"
#include "megatrain/core/host_memory.hpp"

namespace megatrain::app {

using json = nlohmann::json;

namespace {
// "a, b or c"
std::string words(const std::vector<std::string>& v) {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i) s += (i == 0 ? "" : i + 1 == v.size() ? " or " : ", ") + v[i];
  return s;
}
}  // namespace

CLI::Validator choice(const std::string& option, std::initializer_list<const char*> values) {
  std::vector<std::string> v(values.begin(), values.end());
  return CLI::Validator(
      [option, v](std::string& x) -> std::string {
        if (std::find(v.begin(), v.end(), x) != v.end()) return {};
        return fmt::format("{} must be {} (got '{}')", option, words(v), x);
      },
      fmt::format("{}", fmt::join(v, "|")));
}

CLI::Validator at_least(const std::string& option, double min) {
  return CLI::Validator(
      [option, min](std::string& x) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(x.c_str(), &end);
        if (!x.empty() && end == x.c_str() + x.size() && v >= min) return {};
        return fmt::format("{} must be a number >= {} (got '{}')", option, min, x);
      },
      fmt::format("NUMBER>={}", min));
}

CLI::Validator auto_all_count(const std::string& option, bool all) {
  return CLI::Validator(
      [option, all](std::string& x) -> std::string {
        const auto v = parse_auto_all_count(x);
        if (v && (all || *v != kAll)) return {};
        return fmt::format("{} must be auto{} or a count >= 0 (got '{}')", option, all ? ", all" : "", x);
      },
      all ? "auto|all|COUNT" : "auto|COUNT");
}

void parse_args(CLI::App& app, std::vector<std::string> args) {
  std::reverse(args.begin(), args.end());  // CLI11 parses a vector given in reverse order
  try {
    app.parse(args);
  } catch (const CLI::ValidationError& e) {
    // (a value the option's validator refuses: the validator's own words, without CLI11's "--x: ")
    const std::string what = e.what();
    const auto colon = what.find(": --");
    throw BadOptionValue(colon != std::string::npos && what.compare(0, 2, "--") == 0 ? what.substr(colon + 2) : what);
  }
}

CLI::Option* add_bool_option(CLI::App* app, const std::string& name, bool& value, const std::string& description) {
  return app->add_flag(name, value, description)
      ->expected(0, 1)
      ->option_text(fmt::format("[true|false]={}", value ? "true" : "false"))
      ->capture_default_str();
}

void add_model_options(CLI::App& app, Settings& s) {
  auto* model = app.add_option_group("model", "Model shape (default: a small Llama)");
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

void add_step_options(CLI::App& train_group, Settings& s) {
  CLI::App* train = &train_group;
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

void add_clip_options(CLI::App& train_group, Settings& s) {
  CLI::App* train = &train_group;
  train->add_option("--clip", s.clip, "Max global gradient norm (0: no clipping)")->capture_default_str();
  train->add_option("--clip-mode", s.clip_mode,
                    "exact (PyTorch's clip_grad_norm_ over this step's gradients, then AdamW) or stale (clips step t "
                    "with step t-1's norm: a different update, which lets the optimizer overlap the backward)")
      ->check(choice("--clip-mode", {"exact", "stale"}))
      ->capture_default_str();
}

void add_memory_options(CLI::App& run_group, Settings& s) {
  CLI::App* runo = &run_group;
  runo->add_option("--backend", s.backend, "auto, cpu or cuda")->check(choice("--backend", {"auto", "cpu", "cuda"}))->capture_default_str();
  runo->add_option("--host-memory", s.host_memory, "Host memory megatrain may use, e.g. 120G (default: what is free)");
  runo->add_option("--gpu-memory", s.gpu_memory, "GPU memory megatrain may use, e.g. 20G (default: what is free less 1 GiB)");
  runo->add_option("--device-units", s.device_units,
                   "Units (the first in forward order: embedding, blocks, head) whose AdamW state lives in GPU memory "
                   "and is updated there: auto (as many as fit), all, or a count (0: every unit on the host)")
      ->check(auto_all_count("--device-units"))
      ->capture_default_str();
  runo->add_option("--keep-activations", s.keep_activations,
                   "Decoder blocks (the last ones) that keep their activations in GPU memory from forward to backward "
                   "instead of recomputing them (the same result, faster, more memory): auto (the plan's choice: the "
                   "fastest step that fits beside the AdamW state on the GPU), all, or a count")
      ->check(auto_all_count("--keep-activations"))
      ->capture_default_str();
  runo->add_option("--spill-activations", s.spill_activations,
                   "Decoder blocks (among those that do not keep their activations on the GPU) that keep them in pinned "
                   "host memory instead of recomputing them, copied over PCIe beside the other blocks' work (the same "
                   "result; host memory and PCIe time instead of GPU time): auto (the plan's choice), or a count")
      ->check(auto_all_count("--spill-activations", false))
      ->capture_default_str();
  runo->add_option("--gradients", s.gradients,
                   "Where gradients wait for the global norm (exact clipping, micro-batches): auto (the plan's "
                   "choice: host memory where only that fits or where it is predicted faster, else GPU memory; a "
                   "resumed run's own where it fits), device (GPU memory) or host (4 more bytes of host memory per "
                   "parameter)")
      ->check(choice("--gradients", {"auto", "device", "host"}))
      ->capture_default_str();
  runo->add_option("--host-bf16-copy", s.host_bf16_copy,
                   "Whether host memory keeps a bf16 copy of the weights to stream to the GPU (2 bytes a parameter): "
                   "auto (the plan's choice: kept where the plan fits with it, else none; kept with several ranks), true, "
                   "or false (12 bytes a "
                   "parameter of state instead of 14: the fp32 masters stream and the GPU rounds them, the same bits, "
                   "twice the weights' PCIe bytes; one process, or processes that do not shard the optimizer)")
      ->check(choice("--host-bf16-copy", {"auto", "true", "false"}))
      ->capture_default_str();
}

void check_bf16_copy_option(const Settings& s, bool sharded, int ranks) {
  MT_CHECK(s.host_bf16_copy != "false" || !sharded,
           "--host-bf16-copy false: the {} ranks shard the optimizer (--shard-optimizer true) and exchange the bf16 copy; "
           "use --host-bf16-copy auto or true, or --shard-optimizer false", ranks);
}

void check_model_source(const Settings& s) {
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

ModelConfig model_config(const Settings& s, const CLI::App& app, std::int64_t data_vocab,
                                           const io::HfCheckpoint* hf) {
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

TrainerOptions step_layout(const Settings& s, std::int64_t layers) {
  const std::optional<std::int64_t> device_units = parse_auto_all_count(s.device_units);
  MT_CHECK(device_units.has_value(), "--device-units must be auto, all or a count >= 0 (got '{}')", s.device_units);
  const std::optional<std::int64_t> kept = parse_auto_all_count(s.keep_activations);
  MT_CHECK(kept.has_value(), "--keep-activations must be auto, all or a count >= 0 (got '{}')", s.keep_activations);
  const std::optional<std::int64_t> spilled = parse_auto_all_count(s.spill_activations);
  MT_CHECK(spilled.has_value() && *spilled != kAll, "--spill-activations must be auto or a count >= 0 (got '{}')",
           s.spill_activations);
  TrainerOptions o;
  o.batch_rows = s.batch;
  o.seq_len = s.seq;
  o.micro_batches = s.micro_batches;
  o.max_micro_rows = s.max_micro_batch;
  o.chunk_rows = s.chunk;
  MT_CHECK(s.token_chunk >= 0, "--token-chunk must be >= 0 (0: automatic; got {})", s.token_chunk);
  o.token_chunk = s.token_chunk;
  MT_CHECK(s.checkpoint_every >= 0, "--checkpoint-every must be >= 0 (0: as the plan needs; got {})", s.checkpoint_every);
  o.checkpoint_every = s.checkpoint_every;
  o.gradient_home = s.gradients == "host" ? GradientHome::host : GradientHome::device;
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

bool share_weights(const Settings& s, bool one_host) {
  return s.shard_optimizer && (s.share_weights == "true" || (s.share_weights == "auto" && one_host));
}

plan::HostBudget host_budget(const Settings& s) {
  const bool env = std::getenv("MEGATRAIN_HOST_MEMORY") != nullptr && *std::getenv("MEGATRAIN_HOST_MEMORY") != '\0';
  return {available_host_memory(),
          !s.host_memory.empty() ? "--host-memory" : env ? "MEGATRAIN_HOST_MEMORY" : "available host memory"};
}

// What the step minimises: cross-entropy, or a preference loss over pairs (docs/preference.md).
void add_objective_options(CLI::App& app, Settings& s) {
  auto* obj = app.add_option_group("objective", "What the step minimises (docs/preference.md)");
  obj->add_option("--objective", s.objective,
                  "sft (cross-entropy on the trained tokens), dpo (preference pairs: --data of prompt, chosen and "
                  "rejected records; the reference is the model as the run starts) or grpo (rewards of sampled "
                  "completions: --data of prompts, --reward-answer, --reward-format or --reward-command; docs/rl.md)")
      ->check(choice("--objective", {"sft", "dpo", "grpo"}))
      ->capture_default_str();
  obj->add_option("--dpo-loss", s.dpo_loss, "dpo: sigmoid (the DPO paper's), hinge or ipo (TRL's loss_type)")
      ->check(choice("--dpo-loss", {"sigmoid", "hinge", "ipo"}))
      ->capture_default_str();
  obj->add_option("--dpo-beta", s.dpo_beta, "dpo: beta, how far the model may move from the reference (TRL's default)")
      ->capture_default_str();
  obj->add_option("--dpo-label-smoothing", s.dpo_label_smoothing,
                  "dpo, sigmoid loss: the chance a pair's preference is wrong, in [0, 0.5) (conservative DPO)")
      ->capture_default_str();
}

void add_grpo_options(CLI::App& app, Settings& s) {
  auto* g = app.add_option_group("grpo", "--objective grpo: rewards, sampling and the policy loss (docs/rl.md)");
  g->add_option("--reward-answer", s.reward_answer,
                "A reward: 1 where the answer this regular expression finds in the completion (its first group, its last "
                "match) equals the record's \"answer\", else 0");
  g->add_option("--reward-format", s.reward_format, "A reward: 1 where the whole completion matches this regular expression");
  g->add_option("--reward-command", s.reward_command,
                "A reward: a program that scores the completions (JSONL records with \"completion\" on its standard "
                "input, one number a line on its standard output)");
  g->add_option("--reward-timeout", s.reward_timeout, "Seconds --reward-command may take a batch")->capture_default_str();
  g->add_option("--reward-weights", s.reward_weights, "The rewards' weights, e.g. 1,0.2: --reward-answer's, --reward-format's, "
                "--reward-command's, of those given (default 1 each)");
  g->add_option("--generations", s.generations, "Completions sampled a prompt (a group); --batch / this many prompts a step")
      ->capture_default_str();
  g->add_option("--max-completion-tokens", s.max_completion_tokens,
                "Tokens a completion may have at most (0: what --seq leaves after the longest prompt)")->capture_default_str();
  g->add_option("--temperature", s.temperature, "Sampling temperature (1: the policy's own distribution)")->capture_default_str();
  g->add_option("--top-k", s.top_k, "Sample among the k most likely tokens (0: all)")->capture_default_str();
  g->add_option("--top-p", s.top_p, "Sample among the most likely tokens up to this probability (1: all)")->capture_default_str();
  g->add_option("--min-p", s.min_p, "Sample among tokens at least this fraction as likely as the most likely (0: all)")
      ->capture_default_str();
  g->add_option("--clip-eps", s.clip_eps, "The policy ratio's lower clip, 1 - this (TRL's epsilon)")->capture_default_str();
  g->add_option("--clip-eps-high", s.clip_eps_high, "Its upper clip, 1 + this (default: --clip-eps; DAPO's clip-higher: 0.28)");
  g->add_option("--kl-beta", s.kl_beta, "The KL penalty to the initial model (0: none)")->capture_default_str();
  g->add_option("--grpo-loss", s.grpo_loss, "dapo (the mean over the batch's completion tokens), grpo (each completion's "
                "mean, averaged) or dr_grpo (the sum over completions x --max-completion-tokens)")
      ->check(choice("--grpo-loss", {"dapo", "grpo", "dr_grpo"}))
      ->capture_default_str();
  g->add_option("--scale-rewards", s.scale_rewards, "Advantages divided by the group's standard deviation (group), the "
                "batch's (batch), or not (none: Dr. GRPO)")
      ->check(choice("--scale-rewards", {"group", "batch", "none"}))
      ->capture_default_str();
  g->add_option("--updates-per-batch", s.updates_per_batch, "Policy updates on each batch of completions")->capture_default_str();
  add_bool_option(g, "--skip-equal-groups", s.skip_equal_groups,
                  "Leave out of the step the groups whose rewards are all equal (they teach nothing; counted either way)");
}

const std::vector<std::string>& grpo_option_names() {
  static const std::vector<std::string> v{"--reward-answer", "--reward-format", "--reward-command", "--reward-timeout", "--reward-weights", "--generations",
                                          "--max-completion-tokens", "--temperature", "--top-k", "--top-p", "--min-p",
                                          "--clip-eps", "--clip-eps-high", "--kl-beta", "--grpo-loss", "--scale-rewards",
                                          "--updates-per-batch", "--skip-equal-groups"};
  return v;
}

void check_objective_options(const Settings& s, std::int64_t batch) {
  for (const char* f : {"--dpo-loss", "--dpo-beta", "--dpo-label-smoothing"})
    MT_CHECK(s.objective == "dpo" || !s.origins.conflicts(f, "--objective"), "{} applies to --objective dpo; drop it", f);
  for (const std::string& f : grpo_option_names())
    MT_CHECK(s.objective == "grpo" || !s.origins.conflicts(f, "--objective"), "{} applies to --objective grpo; drop it", f);
  if (s.objective == "grpo") check_grpo_options(s, batch > 0 ? batch : s.batch);
  if (s.objective != "dpo") return;
  MT_CHECK(std::isfinite(s.dpo_beta) && s.dpo_beta > 0, "--dpo-beta must be > 0 (got {})", s.dpo_beta);
  MT_CHECK(s.dpo_label_smoothing >= 0 && s.dpo_label_smoothing < 0.5, "--dpo-label-smoothing must be in [0, 0.5) (got {})",
           s.dpo_label_smoothing);
  MT_CHECK(s.dpo_label_smoothing == 0 || s.dpo_loss == "sigmoid", "--dpo-label-smoothing applies to --dpo-loss sigmoid, "
           "not {}", s.dpo_loss);
}

void check_grpo_options(const Settings& s, std::int64_t batch) {
  MT_CHECK(s.generations >= 2, "--generations must be >= 2 (a group's advantages compare its completions; got {})",
           s.generations);
  MT_CHECK(batch % s.generations == 0, "--objective grpo: --batch {} must hold whole groups of --generations {} completions "
           "(a multiple of it)", batch, s.generations);
  MT_CHECK(s.max_completion_tokens >= 0, "--max-completion-tokens must be >= 0 (0: what --seq leaves; got {})",
           s.max_completion_tokens);
  // (the step's log-probabilities are the model's at temperature 1: sampling at another would train on another policy's)
  MT_CHECK(s.temperature == 1.0, "--temperature {}: GRPO's ratios here are those of the model's own distribution, which "
           "--temperature 1 samples; another temperature is not supported yet", s.temperature);
  MT_CHECK(s.top_k >= 0 && s.top_p > 0 && s.top_p <= 1 && s.min_p >= 0 && s.min_p < 1,
           "--top-k >= 0, --top-p in (0, 1] and --min-p in [0, 1) (got {}, {} and {})", s.top_k, s.top_p, s.min_p);
  MT_CHECK(std::isfinite(s.clip_eps) && s.clip_eps > 0 && s.clip_eps < 1, "--clip-eps must be in (0, 1) (got {})", s.clip_eps);
  MT_CHECK(!s.origins.given("--clip-eps-high") || (std::isfinite(s.clip_eps_high) && s.clip_eps_high > 0),
           "--clip-eps-high must be > 0 (got {})", s.clip_eps_high);
  MT_CHECK(s.kl_beta == 0, "--kl-beta {}: the KL penalty needs the initial model's log-probabilities, which megatrain-train "
           "does not keep yet; use --kl-beta 0 (recent practice, and TRL's default)", s.kl_beta);
  MT_CHECK(s.updates_per_batch == 1, "--updates-per-batch {}: several updates on one batch of completions are not supported "
           "yet; use 1 (a step samples, then updates once)", s.updates_per_batch);
}

void check_pairs_batch(std::int64_t batch, int ranks) {
  MT_CHECK(batch % 2 == 0, "--objective dpo: --batch {} must be even (a batch is pairs: a chosen and a rejected row "
           "each)", batch);
  MT_CHECK(batch % (2 * ranks) == 0, "--objective dpo: --batch {} must hold whole pairs on each of the {} "
           "ranks (a multiple of {})", batch, ranks, 2 * ranks);
}

void check_pairs_micro_batches(const TrainerOptions& topt, std::int64_t batch) {
  MT_CHECK(topt.resolved().micro_rows() % 2 == 0,
           "--objective dpo: each micro-batch must hold whole pairs, and --batch {} in {} micro-batches is {} rows each: "
           "give --micro-batches (or --max-micro-batch) that leave an even count", batch, topt.resolved().micro_batches,
           topt.resolved().micro_rows());
}

}  // namespace megatrain::app
