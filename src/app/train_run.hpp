// megatrain-train's training on a backend (train_inputs.hpp declares it): the step planned and
// built (train_build.hpp), its starting state loaded (train_load.hpp), then an evaluation only
// (evaluate_only.hpp) or the training (train_loop.hpp). Compiled once a backend, in train_cpu.cpp
// and train_cuda.cpp.
#pragma once

#include "evaluate_only.hpp"
#include "stop_signals.hpp"
#include "train_build.hpp"
#include "train_inputs.hpp"
#include "train_load.hpp"
#include "train_loop.hpp"

namespace megatrain::app {

template <class B>
int run_training(B& be, const char* backend_name, TrainInputs in) {
  BuiltStep<B> built(be, backend_name, in);
  StopSignals::check("while building the model's state");
  const StartState start = load_start_state(be, backend_name, built, in);
  StopSignals::check("while loading the weights");
  if (in.plan.eval_only) return evaluate_only(built, backend_name, in, start.first_step - 1);
  TrainLoop<B> loop(be, backend_name, in, built, start);
  return loop.run();
}

}  // namespace megatrain::app
