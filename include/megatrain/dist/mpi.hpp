// dist::HostComm over MPI (library megatrain::mpi, built where MPI is found): the processes that
// mpirun launched (MPI_COMM_WORLD). The first MpiComm initialises MPI unless the program did
// (MPI_THREAD_FUNNELED: the collectives run on the thread that calls Trainer::step), and then
// finalises it when the program exits. A sum is reduced to rank 0 and broadcast, so that every rank
// gets the same bits (each steps its own replica of the weights).
#pragma once

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

 private:
  int rank_ = 0, world_ = 1;
};

}  // namespace megatrain::dist
