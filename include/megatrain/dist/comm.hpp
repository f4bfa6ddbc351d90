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

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include "megatrain/core/dtype.hpp"
#include "megatrain/core/error.hpp"

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

  // Sharded data (the optimizer state sharded over the processes, ZeRO-1): `bounds` has world() + 1
  // increasing offsets into `data`, from 0 to data.size(); rank r owns [bounds[r], bounds[r + 1]).
  // Every rank passes the same bounds.

  /// In place: data over rank r's part becomes, on rank r, the sum over the ranks of that part;
  /// the rest of data is left unspecified.
  virtual void reduce_scatter_sum(std::span<float> data, std::span<const std::int64_t> bounds) = 0;
  /// In place: every rank's part of data sent to every rank (data whole and the same on every rank).
  virtual void all_gather(std::span<float> data, std::span<const std::int64_t> bounds) = 0;
  /// The same for bf16 (the weights a process streams, where each steps its part of the masters).
  virtual void all_gather(std::span<bf16> data, std::span<const std::int64_t> bounds) = 0;
  /// In place: every rank's part of data sent to `root` (data whole there); the others' data unchanged.
  virtual void gather(std::span<float> data, std::span<const std::int64_t> bounds, int root) = 0;
  /// The same for bf16 (a bf16 copy kept in parts, made whole on the process that exports it).
  virtual void gather(std::span<bf16> data, std::span<const std::int64_t> bounds, int root) = 0;
  /// Whether sum_backend_memory can sum a backend's gradient buffers: a GPU's (`device`), or host
  /// memory (the CPU backend's) from the trainer's offload thread. Default: neither.
  virtual bool can_sum_backend_memory(bool device) const {
    (void)device;
    return false;
  }
  /// In place, as the trainer's offload stage lands each unit's gradient (TrainerOptions::
  /// sum_during_backward): n floats at `data` summed over the ranks, ordered on `stream` (a
  /// cudaStream_t of the GPU they are on; null for host memory, summed before it returns). Only
  /// where can_sum_backend_memory says so; no other collective of this communicator runs meanwhile.
  virtual void sum_backend_memory(float* data, std::size_t n, void* stream) {
    (void)data;
    (void)n;
    (void)stream;
    MT_FAIL("this communicator cannot sum a backend's memory (can_sum_backend_memory is false)");
  }
  /// As sum_backend_memory, but each rank gets only its part's sum (`bounds` as above, over the
  /// bounds.back() floats at `data`; the rest of them left unspecified): the gradients of a sharded
  /// optimizer as they are completed in the backend's memory. Default: host memory (a null
  /// stream) through reduce_scatter_sum, where can_sum_backend_memory(false) says so.
  virtual void reduce_scatter_backend_memory(float* data, std::span<const std::int64_t> bounds, void* stream) {
    MT_CHECK(stream == nullptr && can_sum_backend_memory(false) && !bounds.empty(),
             "this communicator cannot sum a backend's memory (can_sum_backend_memory is false)");
    reduce_scatter_sum(std::span<float>(data, static_cast<std::size_t>(bounds.back())), bounds);
  }
  /// In place, in the backend's memory (a GPU's, ordered on `stream`; host memory where stream is
  /// null): every rank's part of `data` under `bounds` sent to every rank, as all_gather does: the
  /// weights of units a sharded optimizer steps on the GPUs (device units), each process its part.
  /// Default: host memory, through all_gather, where can_sum_backend_memory(false) says so.
  virtual void all_gather_backend_memory(std::span<float> data, std::span<const std::int64_t> bounds, void* stream) {
    MT_CHECK(stream == nullptr && can_sum_backend_memory(false), "this communicator cannot gather a backend's memory "
             "(can_sum_backend_memory is false)");
    all_gather(data, bounds);
  }
  virtual void all_gather_backend_memory(std::span<bf16> data, std::span<const std::int64_t> bounds, void* stream) {
    MT_CHECK(stream == nullptr && can_sum_backend_memory(false), "this communicator cannot gather a backend's memory "
             "(can_sum_backend_memory is false)");
    all_gather(data, bounds);
  }
  /// This rank failed and will take part in no further collective: MPI ends every process of the
  /// run at once (MPI_Abort, exit status `status`); NCCL aborts the communicator, and the other
  /// ranks stop at their next collective within its timeout. Called on the way out (never throws).
  virtual void abort(int status) noexcept = 0;
};

/// Rank r's part of `data` under `bounds` (see HostComm), the bounds checked first.
template <class E>
std::span<E> shard_part(std::span<E> data, std::span<const std::int64_t> bounds, int world, int r) {
  MT_CHECK(static_cast<int>(bounds.size()) == world + 1 && bounds.front() == 0 &&
               bounds.back() == static_cast<std::int64_t>(data.size()) && std::is_sorted(bounds.begin(), bounds.end()),
           "sharded collective: {} bounds for {} ranks over {} elements (want {} increasing offsets from 0 to {})",
           bounds.size(), world, data.size(), world + 1, data.size());
  MT_CHECK(r >= 0 && r < world, "rank {} of {}", r, world);
  const auto r0 = static_cast<std::size_t>(bounds[static_cast<std::size_t>(r)]);
  return data.subspan(r0, static_cast<std::size_t>(bounds[static_cast<std::size_t>(r) + 1]) - r0);
}

}  // namespace megatrain::dist
