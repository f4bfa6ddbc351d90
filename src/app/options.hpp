// The options megatrain-train and megatrain-plan share (the model, the step's shape, clipping,
// memory and placement), how they become a ModelConfig and TrainerOptions, and the checks that
// only make sense once every option is known. Enumerated values are checked as they are parsed
// (choice()): a wrong one is refused before anything else happens, in the program's words.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "megatrain/core/error.hpp"
#include "megatrain/io/hf_checkpoint.hpp"
#include "megatrain/model/config.hpp"
#include "megatrain/plan/memory_plan.hpp"
#include "megatrain/step/trainer_options.hpp"
#include "settings.hpp"

namespace megatrain::app {

/// A validator for an option whose value is one of `values`: anything else is refused at parse
/// time with "OPTION must be a, b or c (got 'x')".
CLI::Validator choice(const std::string& option, std::initializer_list<const char*> values);
/// A validator for a number >= `min`: anything else is refused at parse time with "OPTION must be
/// a number >= MIN (got 'x')".
CLI::Validator at_least(const std::string& option, double min);
/// A validator for auto, all (unless !all) or a count >= 0 (--device-units, --keep-activations,
/// --spill-activations).
CLI::Validator auto_all_count(const std::string& option, bool all = true);

/// A value an option's validator refused: a bad option (exit status 1, as any refused option), not
/// a malformed command line (2).
class BadOptionValue : public megatrain::Error {
 public:
  explicit BadOptionValue(std::string reason) : Error("option", std::move(reason), __FILE__, __LINE__) {}
};

/// Parses `args` (in command-line order) with `app`. A value an option's validator refuses throws
/// BadOptionValue in the validator's words; other parse errors throw CLI::ParseError.
void parse_args(CLI::App& app, std::vector<std::string> args);

/// A boolean option: `--name` alone means true, `--name true` and `--name false` say which (and
/// a --config file's JSON true or false).
CLI::Option* add_bool_option(CLI::App* app, const std::string& name, bool& value, const std::string& description);

/// What the step minimises (--objective, --dpo-loss, --dpo-beta, --dpo-label-smoothing), bound to
/// `s`: megatrain-train's and megatrain-plan's (docs/preference.md).
void add_objective_options(CLI::App& app, Settings& s);
/// --objective grpo's options (--reward, --generations, the sampling, the policy loss), bound to `s`:
/// megatrain-train's and megatrain-plan's (docs/rl.md).
void add_grpo_options(CLI::App& app, Settings& s);
/// The objective's options alone: the --dpo-* options need --objective dpo, the GRPO options
/// --objective grpo, and their ranges (check_grpo_options); `batch`: the step's rows (0: --batch).
void check_objective_options(const Settings& s, std::int64_t batch = 0);
/// --objective grpo's options: whole groups in a batch of `batch` rows, the ranges, what is not
/// supported yet.
void check_grpo_options(const Settings& s, std::int64_t batch);
/// --objective dpo: a global batch of `batch` rows must be whole pairs on each of `ranks` ranks.
void check_pairs_batch(std::int64_t batch, int ranks);
/// --objective dpo: each micro-batch of `topt` (one rank's, resolved) must hold whole pairs.
void check_pairs_micro_batches(const TrainerOptions& topt, std::int64_t batch);

/// The model options (--model, --model-config, --preset and the shape flags), bound to `s`:
/// megatrain-train's and megatrain-plan's.
void add_model_options(CLI::App& app, Settings& s);

/// The options of a step's shape and layout (--batch, --seq, --micro-batches, --max-micro-batch,
/// --chunk, --token-chunk, --checkpoint-every), added to `train`.
void add_step_options(CLI::App& train_group, Settings& s);

/// --clip and --clip-mode, added to `train`.
void add_clip_options(CLI::App& train_group, Settings& s);

/// Where the step runs and what memory it may use (--backend, --host-memory, --gpu-memory,
/// --device-units, --keep-activations, --gradients), added to `runo`.
void add_memory_options(CLI::App& run_group, Settings& s);

/// Refuses --host-bf16-copy false where `ranks` ranks shard the optimizer, which exchange the copy
/// (megatrain-train's and megatrain-plan's check).
void check_bf16_copy_option(const Settings& s, bool sharded, int ranks);

// Where the model's shape comes from: at most one of --model, --model-config, --preset, and no
// shape flag beside it but --layers beside --preset or --model-config (the shape cut to its first
// layers). Checked before anything is opened.
void check_model_source(const Settings& s);

/// The model the options describe: --model's config (`hf`), --model-config's, a --preset (either
/// cut to --layers), or the command-line shape (its vocabulary `data_vocab` where --vocab is not given).
ModelConfig model_config(const Settings& s, const CLI::App& app, std::int64_t data_vocab, const io::HfCheckpoint* hf);

/// The step's shape and layout as TrainerOptions (batch, sequence, micro-batches, chunks, token
/// blocks, checkpoints, where gradients wait, device units) for a model of `layers` blocks:
/// megatrain-train's and megatrain-plan's.
TrainerOptions step_layout(const Settings& s, std::int64_t layers);

/// Whether the processes share one bf16 copy of the weights (--share-weights; ZeRO-1 only):
/// `one_host` says whether every process runs on one host, which `auto` asks for.
bool share_weights(const Settings& s, bool one_host);

/// The host memory a run may use, and where that figure comes from: --host-memory, the
/// environment's MEGATRAIN_HOST_MEMORY, or what is available now.
plan::HostBudget host_budget(const Settings& s);

/// megatrain-train's options, bound to `s` (and the --config file's name to `config_file`).
std::unique_ptr<CLI::App> make_train_app(Settings& s, std::string& config_file);

}  // namespace megatrain::app
