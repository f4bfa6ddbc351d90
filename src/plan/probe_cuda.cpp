// probe_machine<CudaBackend>, compiled once (megatrain/plan/probe.hpp declares it extern in
// builds with CUDA).
#include "megatrain/plan/probe.hpp"

#include "megatrain/backend/cuda/cuda_backend.hpp"

namespace megatrain::plan {
template MachineFigures probe_machine<CudaBackend>(CudaBackend&, const ModelConfig&, std::int64_t, std::string,
                                                   const ProbeOptions&);
}  // namespace megatrain::plan
