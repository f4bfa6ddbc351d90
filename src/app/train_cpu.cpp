// megatrain-train's training on the cpu backend (train_run.hpp), compiled once.
#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/train/cpu_trainer.hpp"
#include "train_run.hpp"

namespace megatrain::app {

template int run_training<CpuBackend<float>>(CpuBackend<float>&, const char*, TrainInputs);

}  // namespace megatrain::app
