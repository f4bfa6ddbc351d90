// An NCCL communicator over the ranks of a run (issue 19; docs/distributed.md), in the library
// megatrain::nccl (built where NCCL is found: CUDA builds; the GPU machines load PyTorch's
// libnccl.so.2). Rank 0 makes NCCL's unique id and the rendezvous hands it to every rank
// (dist::tcp_all_gather on MASTER_ADDR:MASTER_PORT: the GPU machines have no MPI, and a missing
// rank is named there instead of hanging NCCL's initialisation); each rank then joins on its GPU.
// Keep NVLink multicast off on shared machines (NCCL_NVLS_ENABLE=0).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "megatrain/core/dtype.hpp"
#include "megatrain/dist/comm.hpp"
#include "megatrain/dist/launch.hpp"

namespace megatrain::dist {

/// How the ranks exchange the small blobs of their meeting (every rank's blob, in rank order, on
/// every rank): by default tcp_all_gather on MASTER_ADDR:MASTER_PORT within the rendezvous
/// timeout; where MPI launched the processes, MpiComm::all_gather_blobs (no address needed).
using Rendezvous = std::function<std::vector<std::string>(std::string_view blob)>;

class NcclComm {
 public:
  /// Joins the run `info` describes on CUDA device `device` (made current); throws naming the
  /// rendezvous address or NCCL's error. `meet` (where given) exchanges the NCCL unique id and the
  /// beacons' addresses instead of tcp_all_gather.
  NcclComm(const LaunchInfo& info, int device, std::chrono::milliseconds timeout, const Rendezvous& meet = {});
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const { return rank_; }
  int world() const { return world_; }
  /// The other ranks that are gone, in words (dist::absent_ranks over their beacons, which the
  /// rendezvous exchanged); empty where every other rank's process still answers.
  std::string absent() const { return absent_ranks(beacons_, rank_); }
  /// Whether another rank's process has ended (dist::any_rank_ended over the beacons).
  bool peer_ended() const { return any_rank_ended(beacons_, rank_); }

  /// In place on `stream`: data[i] = the sum over the ranks of data[i] (fp32).
  void all_reduce_sum(float* data, std::size_t n, cudaStream_t stream);
  /// out[i] = the sum over the ranks of in[rank * n + i]: this rank's share of n elements of the
  /// summed in[n * world] (each rank offloads 1/world of a unit's gradient).
  void reduce_scatter_sum(const float* in, float* out, std::size_t n, cudaStream_t stream);
  /// out[r * n + i] = rank r's in[i], for every rank r (the updated weights' shards gathered).
  void all_gather(const float* in, float* out, std::size_t n, cudaStream_t stream);
  void all_gather(const bf16* in, bf16* out, std::size_t n, cudaStream_t stream);

 private:
  friend class NcclHostComm;
  void* comm_ = nullptr;  // ncclComm_t
  int rank_ = 0, world_ = 1;
  Beacon beacon_;                     // (this process's, listening while it lives)
  std::vector<std::string> beacons_;  // every rank's beacon address
};

/// dist::HostComm over NCCL, for processes on GPU machines without MPI: host buffers pass through
/// staging buffers, pinned on the host and on the GPU (64 MiB at a time: up, summed by NCCL,
/// down), on a stream of its own. NCCL's ring gives every rank the same bits. A collective that does not complete within
/// `collective_timeout` (a peer killed, failed or stuck), that NCCL reports failed, or that still
/// waits when another rank's process has ended (its beacon, asked every 2 s once a collective has
/// waited 2 s), aborts the communicator and throws naming this rank and what happened: a rank never
/// waits forever, nor for the whole timeout on a rank that is gone.
class NcclHostComm final : public HostComm {
 public:
  /// Joins the run `info` describes on CUDA device `device` (NcclComm's rendezvous, within
  /// `timeout`).
  NcclHostComm(const LaunchInfo& info, int device, std::chrono::milliseconds timeout,
               std::chrono::milliseconds collective_timeout = dist::collective_timeout(), const Rendezvous& meet = {});
  ~NcclHostComm() override;
  NcclHostComm(const NcclHostComm&) = delete;
  NcclHostComm& operator=(const NcclHostComm&) = delete;

  int rank() const override { return comm_.rank(); }
  int world() const override { return comm_.world(); }
  void all_reduce_sum(std::span<float> data) override;
  void all_reduce_sum(std::span<double> data) override;
  void all_reduce_sum(std::span<std::int64_t> data) override;
  void abort(int status) noexcept override;
  /// A GPU's memory (this communicator's GPU), summed on the given stream as the trainer's offload
  /// stage lands each gradient. A watchdog thread aborts the communicator where such a sum does not
  /// complete within the collective timeout (a peer gone) or NCCL reports an error, saying so: the
  /// stream then goes on, and this rank's next collective throws instead of waiting forever.
  bool can_sum_backend_memory(bool device) const override { return device; }
  void sum_backend_memory(float* data, std::size_t n, void* stream) override;
  void reduce_scatter_backend_memory(float* data, std::span<const std::int64_t> bounds, void* stream) override;
  void all_gather_backend_memory(std::span<float> data, std::span<const std::int64_t> bounds, void* stream) override;
  void all_gather_backend_memory(std::span<bf16> data, std::span<const std::int64_t> bounds, void* stream) override;
  void reduce_scatter_sum(std::span<float> data, std::span<const std::int64_t> bounds) override;
  void all_gather(std::span<float> data, std::span<const std::int64_t> bounds) override;
  void all_gather(std::span<bf16> data, std::span<const std::int64_t> bounds) override;
  void gather(std::span<float> data, std::span<const std::int64_t> bounds, int root) override;
  void gather(std::span<bf16> data, std::span<const std::int64_t> bounds, int root) override;

 private:
  void sum(void* data, std::size_t bytes, std::size_t elem, int type);
  // Root's bytes to every rank through the staging buffers; `keep`: this rank takes them.
  void broadcast(void* data, std::size_t bytes, int root, bool keep);
  // Each rank's part of the elements of `elem` bytes at `data` (bounds in elements) sent to
  // every rank (`root` negative) or to `root` alone.
  void host_parts(void* data, std::size_t elem, std::size_t n, std::span<const std::int64_t> bounds, int root);
  void wait();  // for the stream, within the collective timeout
  void with_comm(const std::function<void(void*)>& call);  // call(communicator) under the lock; throws where it was aborted
  void abort_comm() noexcept;
  std::string stopped() const;  // which other rank stopped, as far as their beacons tell
  void watch();  // the watchdog of the sums on the trainer's streams
  bool peer_gone(std::chrono::steady_clock::time_point since, std::chrono::steady_clock::time_point& knocked) const;
  void watch_stream(cudaStream_t s);  // what was just enqueued on s, given to the watchdog
  // Each rank's part broadcast from it, in one group, on `stream` (a GPU's memory).
  void gather_parts(void* data, std::size_t elem, std::size_t n, std::span<const std::int64_t> bounds, void* stream);
  using PartOp = std::function<void(std::byte* part, std::size_t count, int rank, void* comm, cudaStream_t stream)>;
  void each_part(void* data, std::size_t elem, std::size_t n, std::span<const std::int64_t> bounds, void* stream,
                 const char* what, const PartOp& op);
  struct Pending {
    cudaEvent_t done;
    std::chrono::steady_clock::time_point since;
  };
  NcclComm comm_;
  int device_;
  std::chrono::milliseconds collective_timeout_;
  cudaStream_t stream_ = nullptr;
  void* staging_ = nullptr;
  void* pinned_ = nullptr;  // (host side of the staging: pinned, so that wait() sees the copies)
  std::mutex mutex_;           // guards comm_.comm_'s abort, pending_, free_events_, stopping_
  std::condition_variable wake_;
  std::deque<Pending> pending_;
  std::vector<cudaEvent_t> free_events_;
  bool stopping_ = false;
  std::thread watchdog_;  // (started by the first sum_backend_memory)
};

}  // namespace megatrain::dist
