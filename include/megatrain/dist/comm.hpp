// Collectives on host memory between the processes of a run (issue 19; docs/distributed.md).
//
// A Trainer given a HostComm (TrainerOptions::comm) is one of `world()` processes that train one
// model together, data parallel: each runs its share of every batch, the gradients are summed
// over the processes before the norm and the update, and every process steps the same weights
// the same way (its own replica of the train state). Every rank calls each collective in the same
// order with the same sizes; every rank gets the same bits back.
//
// Two implementations: dist::MpiComm (library megatrain::mpi, where MPI is found: processes
// launched by mpirun, the CPU backend in CI) and dist::NcclHostComm (library megatrain::nccl: the
// GPU machines, which have no MPI; host buffers pass through the GPU).
#pragma once

#include <cstdint>
#include <span>

namespace megatrain::dist {

class HostComm {
 public:
  virtual ~HostComm() = default;
  virtual int rank() const = 0;
  virtual int world() const = 0;
  /// In place: data[i] = the sum over the ranks of data[i], the same bits on every rank.
  virtual void all_reduce_sum(std::span<float> data) = 0;
  virtual void all_reduce_sum(std::span<double> data) = 0;
  virtual void all_reduce_sum(std::span<std::int64_t> data) = 0;
};

}  // namespace megatrain::dist
