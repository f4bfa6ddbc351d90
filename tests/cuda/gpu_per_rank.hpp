// Multi-process GPU tests: whether this host has a GPU for each rank of the run.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>

#include "megatrain/dist/launch.hpp"

namespace megatrain::test {

/// True where the host has at least one GPU per rank; else says so (the test then exits with
/// kSkipped: CTest counts it skipped).
inline bool gpu_per_rank(const dist::LaunchInfo& me) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) == cudaSuccess && gpus >= me.world) return true;
  std::printf("rank %d: %d GPU(s) here, %d ranks: skipped\n", me.rank, gpus, me.world);
  return false;
}

}  // namespace megatrain::test
