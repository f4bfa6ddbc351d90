// megatrain-train from its parsed options to its end (train_setup.cpp): one rank's whole run.
#pragma once

#include <CLI/CLI.hpp>

#include "ranks.hpp"
#include "run_plan.hpp"
#include "settings.hpp"

namespace megatrain::app {

/// One rank's run of megatrain-train: every option checked, the model, data and checkpoint opened,
/// the run folder claimed, then the training on the backend the options choose. Returns the exit
/// status; throws megatrain::Error where the run cannot start.
int run_train(const Settings& s, const CLI::App& app, RunPlan plan, Ranks& ranks);

}  // namespace megatrain::app
