// megatrain-train's training on the cuda backend (train_run.hpp), compiled once.
#include "megatrain/backend/cuda/cuda_backend.hpp"
#include "megatrain/train/cuda_trainer.hpp"
#include "train_run.hpp"

namespace megatrain::app {

template int run_training<CudaBackend>(CudaBackend&, const char*, TrainInputs);

}  // namespace megatrain::app
