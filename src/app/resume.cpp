// Resuming a run (resume.hpp).
#include "resume.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <map>
#include <optional>

#include "megatrain/core/error.hpp"

namespace megatrain::app {

namespace fs = std::filesystem;
using json = nlohmann::json;

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

}  // namespace megatrain::app
