// What a megatrain-train run carries from its options to its training, besides the trainer's
// options: the model and checkpoint to load, the run folder, the export, the files kept with the
// checkpoints, and the run's identity.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "megatrain/io/hf_checkpoint.hpp"
#include "megatrain/io/run_folder.hpp"
#include "megatrain/model/config.hpp"
#include "resume.hpp"

namespace megatrain::app {

struct SamplePlan;
struct GrpoPlan;

struct RunPlan {
  std::optional<io::HfCheckpoint> hf;    // --model: weights to load (released once loaded)
  std::optional<Resume> resume;          // --resume: the state to load
  std::filesystem::path out;             // run directory (none when evaluating only)
  bool eval_only = false;                // --steps 0
  std::int64_t eval_rows = 0;            // eval_only: validation windows to evaluate (0: none)
  std::optional<io::HfExportOptions> export_options;  // --export
  std::string config_text;               // config.json of the model (kept in checkpoints)
  std::map<std::string, std::string> side_files;  // tokenizer files etc. (kept in checkpoints, exported)
  // a multimodal folder's tensors beside the language model (recorded in checkpoints; an export of
  // the whole model writes them back)
  std::optional<io::CarriedTensors> carried;
  nlohmann::json given;                  // the options this run was given (kept in checkpoints)
  nlohmann::json data_identity;          // the data's digests (kept in checkpoints)
  // data prepared for this run only (evaluation; a resume's, until accepted): removed with the plan
  std::shared_ptr<const std::filesystem::path> temp_data;
  std::string run_id;                    // this run's identity: in its checkpoints and its exports' megatrain_export.json
  std::vector<std::string> notes;        // said once the run starts
  bool branch = false;                   // --resume from another run's checkpoint into a run folder of its own
  std::shared_ptr<io::RunFolder> folder;  // the run folder, claimed by this process (the first rank's)
  std::shared_ptr<const SamplePlan> samples;  // --sample-every: the prompts, read and checked (train_samples.hpp)
  std::shared_ptr<const GrpoPlan> grpo;       // --objective grpo: its prompts and rewards (grpo_plan.hpp)
};

/// The config.json a run keeps and exports for a model not read from a Hugging Face folder: the
/// model's own (ModelConfig::to_json), with the token ids of the --model-config file it came from
/// (where it gave them), else of its --tokenizer, so that generation in transformers knows them.
std::string config_text_of(const ModelConfig& cfg, const std::string& model_config, std::optional<std::int32_t> bos,
                           std::optional<std::int32_t> eos);

}  // namespace megatrain::app
