// The Trainer on the CPU backend (fp32), compiled once in the library (src/train/cpu_trainer.cpp):
// include this instead of trainer.hpp and cpu_backend.hpp to use Trainer<CpuBackend<float>>
// without compiling it again in every file that does.
#pragma once

#include "megatrain/backend/cpu/cpu_backend.hpp"
#include "megatrain/train/trainer.hpp"

namespace megatrain {
extern template class Trainer<CpuBackend<float>, DecoderBlock>;
}  // namespace megatrain
