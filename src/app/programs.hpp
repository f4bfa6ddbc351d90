// The programs megatrain ships, as functions of the megatrain_app library: each program's main()
// (examples/megatrain_*/main.cpp) calls its function. The library holds everything the programs
// do: their options (options.hpp, train_app.cpp), how megatrain-train goes from them to a run
// (train_setup.cpp) and trains (train_run.hpp), and the ranks of a data-parallel run (ranks.hpp).
#pragma once

namespace megatrain::app {

/// megatrain-train: trains, fine-tunes, evaluates or exports a model (docs/training.md).
int train_main(int argc, char** argv);
/// megatrain-plan: the memory and the step time of a training configuration (docs/planner.md).
int plan_main(int argc, char** argv);
/// megatrain-tokenize: text and JSON records in, token files out (docs/data.md).
int tokenize_main(int argc, char** argv);
/// megatrain-report: report.html for a run folder (docs/report.md).
int report_main(int argc, char** argv);
/// megatrain-generate: completions of prompts by a model (docs/generation.md).
int generate_main(int argc, char** argv);

}  // namespace megatrain::app
