// An NCCL communicator over the ranks of a run (issue 19; docs/distributed.md), in the library
// megatrain::nccl (built where NCCL is found: CUDA builds; the GPU machines load PyTorch's
// libnccl.so.2). Rank 0 makes NCCL's unique id and the rendezvous hands it to every rank
// (dist::tcp_all_gather on MASTER_ADDR:MASTER_PORT: the GPU machines have no MPI, and a missing
// rank is named there instead of hanging NCCL's initialisation); each rank then joins on its GPU.
// Keep NVLink multicast off on shared machines (NCCL_NVLS_ENABLE=0).
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <cstddef>

#include "megatrain/core/dtype.hpp"
#include "megatrain/dist/launch.hpp"

namespace megatrain::dist {

class NcclComm {
 public:
  /// Joins the run `info` describes on CUDA device `device` (made current); throws naming the
  /// rendezvous address or NCCL's error.
  NcclComm(const LaunchInfo& info, int device, std::chrono::milliseconds timeout);
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const { return rank_; }
  int world() const { return world_; }

  /// In place on `stream`: data[i] = the sum over the ranks of data[i] (fp32).
  void all_reduce_sum(float* data, std::size_t n, cudaStream_t stream);
  /// out[i] = the sum over the ranks of in[rank * n + i]: this rank's share of n elements of the
  /// summed in[n * world] (each rank offloads 1/world of a unit's gradient).
  void reduce_scatter_sum(const float* in, float* out, std::size_t n, cudaStream_t stream);
  /// out[r * n + i] = rank r's in[i], for every rank r (the updated weights' shards gathered).
  void all_gather(const float* in, float* out, std::size_t n, cudaStream_t stream);
  void all_gather(const bf16* in, bf16* out, std::size_t n, cudaStream_t stream);

 private:
  void* comm_ = nullptr;  // ncclComm_t
  int rank_ = 0, world_ = 1;
};

}  // namespace megatrain::dist
