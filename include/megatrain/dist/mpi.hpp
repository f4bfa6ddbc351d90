// dist::HostComm over MPI (library megatrain::mpi, built where MPI is found): the processes that
// mpirun launched (MPI_COMM_WORLD). The first MpiComm initialises MPI unless the program did
// (MPI_THREAD_SERIALIZED: the collectives run on the thread that calls Trainer::step, and the
// gradients' sums on the trainer's offload thread, never two at once), and then
// finalises it when the program exits. A sum is reduced to rank 0 and broadcast, so that every rank
// gets the same bits (each steps its own replica of the weights).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "megatrain/dist/comm.hpp"

namespace megatrain::dist {

class MpiComm final : public HostComm {
 public:
  MpiComm();
  ~MpiComm() override;
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;

  int rank() const override { return rank_; }
  int world() const override { return world_; }
  void all_reduce_sum(std::span<float> data) override;
  void all_reduce_sum(std::span<double> data) override;
  void all_reduce_sum(std::span<std::int64_t> data) override;
  void abort(int status) noexcept override;
  /// Host memory (the CPU backend's), where MPI was initialised for threads.
  bool can_sum_backend_memory(bool device) const override { return !device && serialized_; }
  void sum_backend_memory(float* data, std::size_t n, void* stream) override;
  void reduce_scatter_sum(std::span<float> data, std::span<const std::int64_t> bounds) override;
  void all_gather(std::span<float> data, std::span<const std::int64_t> bounds) override;
  void all_gather(std::span<bf16> data, std::span<const std::int64_t> bounds) override;
  void gather(std::span<float> data, std::span<const std::int64_t> bounds, int root) override;
  void gather(std::span<bf16> data, std::span<const std::int64_t> bounds, int root) override;
  /// Every rank's blob, in rank order, on every rank (MPI_Allgatherv): how processes that mpirun
  /// launched meet to hand out the NCCL unique id (dist::Rendezvous), with no address to agree on.
  std::vector<std::string> all_gather_blobs(std::string_view blob);

 private:
  int rank_ = 0, world_ = 1;
  bool serialized_ = false;  // (MPI allows collectives from any one thread at a time)
};

}  // namespace megatrain::dist
