// The Trainer on the CUDA backend, compiled once in the library (src/train/cuda_trainer.cpp, in
// builds with CUDA): include this instead of trainer.hpp and cuda_backend.hpp to use
// Trainer<CudaBackend> without compiling it again in every file that does.
#pragma once

#include "megatrain/backend/cuda/cuda_backend.hpp"
#include "megatrain/train/trainer.hpp"

namespace megatrain {
extern template class Trainer<CudaBackend, DecoderBlock>;
}  // namespace megatrain
