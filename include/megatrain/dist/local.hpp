// The ranks of a run as threads of one process (issue 19: one process driving several GPUs;
// docs/distributed.md#one-process-several-gpus).
//
// One process may train data parallel on N GPUs by running N ranks as N threads, each with its
// own backend, HostParamStore and Trainer, exactly as N processes would, so that every mode of
// the several-process trainer (ZeRO-1, the weights one copy, device units, checkpoints in parts)
// keeps its meaning and its tests. What the ranks of one process share comes from that: the bf16
// weights and the embedding's fp32 masters are one copy that the ranks' stores map together
// (StoreShard::shared_weights), and each rank keeps and steps only its part of the rest of the
// train state, so the process holds 14 bytes a parameter however many GPUs it drives.
//
// The communicators: on GPUs, one dist::NcclHostComm a rank (made by each rank's thread, meeting
// through the rendezvous on local_launch's 127.0.0.1 port); on the CPU backend, LocalComm below,
// which sums and gathers host memory between the threads directly (no MPI: the ranks' tests run
// in CI as one process). run_local_ranks starts the threads and stops every rank as soon as one
// fails.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "megatrain/dist/comm.hpp"
#include "megatrain/dist/launch.hpp"

namespace megatrain::dist {

/// Rank `rank` of `world` ranks that are threads of this process: local_rank = rank (its GPU),
/// local_world = world, the rendezvous on 127.0.0.1:`port` (free_local_port), launcher "threads".
LaunchInfo local_launch(int rank, int world, int port);

/// A TCP port of 127.0.0.1 that nothing listens on now (the kernel's choice): where the ranks of
/// one process (or of one host, started together) meet.
int free_local_port();

/// Host-memory collectives between `world` threads of this process, one LocalComm each: each
/// collective waits for every rank to call it, then every rank reads the others' buffers directly
/// and sums in rank order, so that every rank gets the same bits. A rank that fails calls abort():
/// every other rank's collective, now or next, then throws naming it. A rank whose peers do not
/// arrive within the collective timeout throws naming them (and aborts the group). Backend memory
/// is host memory (the CPU backend's): sum_backend_memory sums it from the trainer's offload thread.
class LocalComm final : public HostComm {
 public:
  /// `world` communicators of one group: element r is rank r's, for the thread that runs it.
  static std::vector<std::unique_ptr<LocalComm>> group(int world,
                                                       std::chrono::milliseconds timeout = collective_timeout());
  ~LocalComm() override;
  LocalComm(const LocalComm&) = delete;
  LocalComm& operator=(const LocalComm&) = delete;

  int rank() const override { return rank_; }
  int world() const override;
  void all_reduce_sum(std::span<float> data) override;
  void all_reduce_sum(std::span<double> data) override;
  void all_reduce_sum(std::span<std::int64_t> data) override;
  void reduce_scatter_sum(std::span<float> data, std::span<const std::int64_t> bounds) override;
  void all_gather(std::span<float> data, std::span<const std::int64_t> bounds) override;
  void all_gather(std::span<bf16> data, std::span<const std::int64_t> bounds) override;
  void gather(std::span<float> data, std::span<const std::int64_t> bounds, int root) override;
  void gather(std::span<bf16> data, std::span<const std::int64_t> bounds, int root) override;
  bool can_sum_backend_memory(bool device) const override { return !device; }
  void sum_backend_memory(float* data, std::size_t n, void* stream) override;
  /// Every rank's collective, now or next, throws naming this rank (status unused). Never throws.
  void abort(int status) noexcept override;

  struct Group;  // (shared by the group's communicators)

 private:
  LocalComm(std::shared_ptr<Group> g, int rank) : g_(std::move(g)), rank_(rank) {}
  template <class T>
  void sum(std::span<T> data);
  template <class T>
  void sum(std::span<T> data, std::size_t lo, std::size_t n, const char* what);
  template <class E>
  void parts(std::span<E> data, std::span<const std::int64_t> bounds, int root);
  // Publishes this rank's buffer (its address and size), waits for every rank's, runs `fn`, and
  // waits until every rank has run it (so that no buffer changes while another rank reads it).
  void collective(const void* data, std::size_t bytes, const char* what, const std::function<void()>& fn);

  std::shared_ptr<Group> g_;
  int rank_ = 0;
};

/// Runs `rank_main(r)` for r = 0 .. world - 1, each on a thread of its own, and waits for all of
/// them; returns their results in rank order. As each rank that throws or returns nonzero ends,
/// `on_failure(r)` is called from the waiting thread (to abort the others' communicators where it
/// failed, so that they stop instead of waiting in a collective); a rank that throws counts as `thrown_status`,
/// its exception's message printed on stderr first ("rank r of N: error: ...").
std::vector<int> run_local_ranks(int world, const std::function<int(int rank)>& rank_main,
                                 const std::function<void(int failed_rank)>& on_failure = {}, int thrown_status = 1);

}  // namespace megatrain::dist
