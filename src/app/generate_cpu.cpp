// megatrain-generate's sampling on the cpu backend (generate_run.hpp), compiled once.
#include "generate_run.hpp"
#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/train/cpu_trainer.hpp"

namespace megatrain::app {

template std::vector<generate::Completion> run_generation<CpuBackend<float>>(CpuBackend<float>&, const char*,
                                                                             const GenerateInputs&);

}  // namespace megatrain::app
