// Trainer<CudaBackend>, compiled once (megatrain/train/cuda_trainer.hpp declares it extern).
#include "megatrain/train/cuda_trainer.hpp"

namespace megatrain {
template class Trainer<CudaBackend, DecoderBlock>;
}  // namespace megatrain
