// megatrain-generate's sampling on the cuda backend (generate_run.hpp), compiled once.
#include "generate_run.hpp"
#include "megatrain/backend/cuda/cuda_backend.hpp"
#include "megatrain/train/cuda_trainer.hpp"

namespace megatrain::app {

template std::vector<generate::Completion> run_generation<CudaBackend>(CudaBackend&, const char*, const GenerateInputs&);

}  // namespace megatrain::app
