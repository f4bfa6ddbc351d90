// Resuming a run: the checkpoint --resume names, opened and checked (a damaged newest one
// passed over for the newest intact one, saying so), and whether the resume continues that
// checkpoint's run or branches from it into a folder of its own.
#pragma once

#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>
#include <vector>

#include "megatrain/io/train_checkpoint.hpp"
#include "megatrain/train/checkpointer.hpp"
#include "settings.hpp"

namespace megatrain::app {

// The checkpoint a run resumes from, opened (every file checked against its checksum).
struct Resume {
  io::TrainCheckpoint ckpt;
  TrainState state;
  nlohmann::json given;                          // the options its run was given
  std::vector<std::string> side_files;  // Hugging Face side files kept in the checkpoint
};

/// A checkpoint folder, opened (every file checked against its checksum) as megatrain-train's.
Resume open_checkpoint(const std::filesystem::path& dir);
/// A run's checkpoints newest first: the one `latest` names, then those of lower steps.
std::vector<std::filesystem::path> checkpoints_newest_first(const std::filesystem::path& root);
/// The checkpoint --resume names, opened: "latest" (the newest intact one of the run in --out), a
/// run folder (the same), or a checkpoint folder (that one).
Resume open_resume(const Settings& s);
/// Whether a resume that writes to the run folder `out` continues the run of `checkpoint` (it
/// lies in out/checkpoints) rather than branching from it into another folder.
bool continues_run(const std::filesystem::path& checkpoint, const std::filesystem::path& out);
/// The training option a TrainerOptions field comes from (update_differences' field names).
std::string option_of(const std::string& field);

}  // namespace megatrain::app
