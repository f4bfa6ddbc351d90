// What megatrain-train's training on a backend starts from (train_setup.cpp prepares it): the
// settings, the model, the data, the trainer's options, the run's plan and this rank's place.
#pragma once

#include <CLI/CLI.hpp>

#include <optional>

#include "megatrain/data/token_dataset.hpp"
#include "megatrain/model/config.hpp"
#include "megatrain/step/trainer_options.hpp"
#include "ranks.hpp"
#include "run_plan.hpp"
#include "settings.hpp"

namespace megatrain::app {

struct TrainInputs {
  const Settings& s;
  const CLI::App& app;                      // the parser (options.json lists its options)
  const ModelConfig& cfg;
  const std::optional<TokenDataset>& data;  // none where nothing is evaluated or trained
  TrainerOptions topt;                      // resolved but for what the plan chooses
  RunPlan& plan;
  Ranks& ranks;
};

/// Plans, builds, loads and trains (or evaluates, or exports) on backend `be` (train_run.hpp;
/// compiled for the cpu backend in train_cpu.cpp, for the cuda backend in train_cuda.cpp).
/// Returns the exit status.
template <class B>
int run_training(B& be, const char* backend_name, TrainInputs in);

}  // namespace megatrain::app
