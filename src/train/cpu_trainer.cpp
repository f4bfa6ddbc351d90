// Trainer<CpuBackend<float>>, compiled once (megatrain/train/cpu_trainer.hpp declares it extern).
#include "megatrain/train/cpu_trainer.hpp"

namespace megatrain {
template class Trainer<CpuBackend<float>, DecoderBlock>;
}  // namespace megatrain
