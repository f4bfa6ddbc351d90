// megatrain-train launched as several processes (torchrun, mpirun, srun): data parallel training,
// one process per GPU (docs/distributed.md). Ranks holds this process's place in the run and the
// communicator the trainer sums its gradients over (TrainerOptions::comm), and the few agreements
// the program itself needs: that every rank got through its checks before rank 0 writes anything,
// that a stop signal seen by one rank stops all of them after the same step, and that no rank
// leaves while rank 0 still writes the last checkpoint.
//
// The communicator: NCCL for the cuda backend (the ranks meet on MASTER_ADDR:MASTER_PORT, or
// through MPI where mpirun launched them and the program has MPI), MPI for the cpu backend
// (launched by mpirun or srun; built where MPI was found).
//
// --gpus N (the default way, --gpu-ranks threads): the ranks are N threads of this one process,
// one GPU each (Ranks::local): NCCL between the GPUs as between processes, and on the cpu
// backend dist::LocalComm between the threads.
#pragma once

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "megatrain/core/error.hpp"
#include "megatrain/dist/comm.hpp"
#include "megatrain/dist/launch.hpp"
#include "megatrain/dist/local.hpp"
#if MEGATRAIN_PROGRAM_MPI
#include "megatrain/dist/mpi.hpp"
#endif
#if MEGATRAIN_PROGRAM_NCCL
#include "megatrain/dist/nccl.hpp"
#endif

namespace megatrain::app {

class Ranks {
 public:
  /// One process (no launcher, or a launch of one): no communicator.
  Ranks() = default;

  /// Joins the run the launcher's environment describes (a malformed one is an error naming the
  /// variable): on the cuda backend over NCCL on GPU LOCAL_RANK, meeting the others within the
  /// rendezvous timeout; on the cpu backend over MPI.
  static Ranks join(bool use_cuda, [[maybe_unused]] double rendezvous_timeout_s) {
    Ranks r;
    r.me_ = megatrain::dist::launch_from_env();
    if (r.me_.world <= 1) return r;
    if (use_cuda) {
#if MEGATRAIN_PROGRAM_NCCL
      // Processes that mpirun launched hand out NCCL's unique id through MPI (no MASTER_ADDR to
      // export across hosts); the others meet on MASTER_ADDR:MASTER_PORT.
      megatrain::dist::Rendezvous meet;
#if MEGATRAIN_PROGRAM_MPI
      if (r.me_.launcher == "openmpi") {
        r.mpi_ = std::make_unique<megatrain::dist::MpiComm>();
        MT_CHECK(r.mpi_->world() == r.me_.world && r.mpi_->rank() == r.me_.rank,
                 "Open MPI's variables say this is process {} of {}, but MPI says {} of {}: launch megatrain-train with "
                 "mpirun directly", r.me_.rank, r.me_.world, r.mpi_->rank(), r.mpi_->world());
        meet = [mpi = r.mpi_.get()](std::string_view blob) { return mpi->all_gather_blobs(blob); };
      }
#endif
      try {
        r.comm_ = std::make_unique<megatrain::dist::NcclHostComm>(
            r.me_, r.me_.local_rank,
            megatrain::dist::rendezvous_timeout(rendezvous_timeout_s > 0 ? std::optional(rendezvous_timeout_s) : std::nullopt),
            collective_timeout(), meet);
      } catch (const std::exception& e) {
#if MEGATRAIN_PROGRAM_MPI
        // (the others may wait in MPI's gather, which has no timeout: MPI ends every process, once
        // this one has said why)
        if (r.mpi_) {
          const auto* me = dynamic_cast<const megatrain::Error*>(&e);
          std::fprintf(stderr, "megatrain-train (process %d of %d): error: %s\n", r.me_.rank, r.me_.world,
                       me != nullptr ? me->reason().c_str() : e.what());
          std::fflush(stderr);
          r.mpi_->abort(1);
        }
#endif
        throw;
      }
#else
      MT_FAIL("this is process {} of {} ({} launched them), but megatrain-train was built without NCCL, which several "
              "processes on GPUs train over: build it where NCCL is found (the CUDA toolkit's), or run one process",
              r.me_.rank, r.me_.world, r.me_.launcher);
#endif
    } else {
#if MEGATRAIN_PROGRAM_MPI
      MT_CHECK(r.me_.launcher == "openmpi" || r.me_.launcher == "slurm",
               "this is process {} of {} ({} launched them) on the cpu backend, which trains several processes over MPI: "
               "launch them with mpirun (or srun), or train on GPUs (over NCCL)", r.me_.rank, r.me_.world, r.me_.launcher);
      auto mpi = std::make_unique<megatrain::dist::MpiComm>();
      MT_CHECK(mpi->world() == r.me_.world && mpi->rank() == r.me_.rank,
               "{} says this is process {} of {}, but MPI says {} of {}: launch megatrain-train with mpirun directly",
               r.me_.launcher, r.me_.rank, r.me_.world, mpi->rank(), mpi->world());
      r.comm_ = std::move(mpi);
#else
      MT_FAIL("this is process {} of {} ({} launched them) on the cpu backend, which trains several processes over MPI, "
              "but megatrain-train was built without MPI: install Open MPI (libopenmpi-dev) and build again, or train on "
              "GPUs (over NCCL)", r.me_.rank, r.me_.world, r.me_.launcher);
#endif
    }
    return r;
  }

  /// Rank `rank` of `world` ranks that are threads of this process, one GPU each (--gpus N): on
  /// the cuda backend over NCCL on GPU `rank` (meeting on 127.0.0.1:`port`), on the cpu backend
  /// over `local` (its rank's LocalComm of one group).
  static Ranks local(int rank, int world, bool use_cuda, int port, std::unique_ptr<megatrain::dist::LocalComm> local,
                     [[maybe_unused]] double rendezvous_timeout_s) {
    Ranks r;
    r.me_ = megatrain::dist::local_launch(rank, world, port);
    r.threads_ = true;
    if (use_cuda) {
#if MEGATRAIN_PROGRAM_NCCL
      // (the ranks start together in this process: a minute unless told, not a launcher's 300 s,
      // so that the others stop soon where one cannot reach the meeting, its GPU failing to start)
      const std::optional<double> wait = rendezvous_timeout_s > 0 ? std::optional(rendezvous_timeout_s)
                                         : std::getenv("MEGATRAIN_RENDEZVOUS_TIMEOUT") ? std::nullopt
                                                                                       : std::optional(60.0);
      r.comm_ = std::make_unique<megatrain::dist::NcclHostComm>(
          r.me_, rank, megatrain::dist::rendezvous_timeout(wait), collective_timeout());
#else
      MT_FAIL("--gpus {}: megatrain-train was built without NCCL, which several GPUs train over: build it where NCCL is "
              "found (the CUDA toolkit's), or train on one GPU", world);
#endif
    } else {
      r.comm_ = std::move(local);
    }
    return r;
  }

  /// How long a rank waits in one collective: an hour unless MEGATRAIN_COLLECTIVE_TIMEOUT says
  /// otherwise (the others wait in a collective while the first writes a checkpoint or an export,
  /// which for a large model takes minutes; a launcher ends the run at once where a process dies).
  static std::chrono::milliseconds collective_timeout() {
    return megatrain::dist::collective_timeout(std::getenv("MEGATRAIN_COLLECTIVE_TIMEOUT") ? std::nullopt
                                                                                           : std::optional(3600.0));
  }

  int rank() const { return me_.rank; }
  int world() const { return me_.world; }
  bool several() const { return me_.world > 1; }
  bool lead() const { return me_.rank == 0; }
  const megatrain::dist::LaunchInfo& info() const { return me_; }
  megatrain::dist::HostComm* comm() const { return comm_.get(); }
  /// Whether the ranks are threads of this process (--gpus N), not processes.
  bool threads() const { return threads_; }
  /// Whether every rank got through its checks (agree_started): from here a rank that fails
  /// stops the others' collectives.
  bool started() const { return phase_ == Phase::started; }
  /// What a rank is called in messages: "rank" (a thread of this process) or "process".
  const char* noun() const { return threads_ ? "rank" : "process"; }
  /// Where this rank prints what only the first prints (the others': /dev/null).
  std::FILE* out() const {
    if (lead()) return stdout;
    static std::FILE* const null = std::fopen("/dev/null", "w");
    return null != nullptr ? null : stderr;  // (no /dev/null: to stderr rather than nowhere safe)
  }

  /// Every rank got through its checks and built its trainer: from here rank 0 writes the run
  /// folder. Throws on every rank, naming those that failed (they said why), when one did not.
  void agree_started() {
    agree_checked();
    if (several()) phase_ = Phase::started;
  }
  /// Every rank got through its checks so far (those that can differ between ranks: a GPU's plan,
  /// the first rank's export): the same agreement as agree_started, where the ranks' next steps
  /// are collectives of their own (a store's shared weights). Throws as agree_started does.
  void agree_checked() {
    if (!several()) return;
    (void)agree(0);
  }
  /// Every rank's `mine` (>= 2), in rank order, agreed as agree_checked agrees (so that a rank
  /// that failed before it stops every rank here, named). Throws as agree_checked does.
  std::vector<std::int64_t> agree_on(std::int64_t mine) {
    MT_CHECK(mine >= 2, "Ranks::agree_on: {} is not a value to agree on (>= 2)", mine);
    if (!several()) return {mine};
    return agree(mine);
  }
  /// The first stop signal any rank has seen (its number), else 0: every rank stops after the same step.
  int stop_signal(int mine) {
    if (!several()) return mine;
    for (const auto v : each_rank(mine))
      if (v != 0) return static_cast<int>(v);
    return 0;
  }
  /// What the first rank says (every rank calls it; the others' `v` is not read).
  bool lead_says(bool v) {
    if (!several()) return v;
    std::int64_t x[1] = {lead() && v ? 1 : 0};
    comm_->all_reduce_sum(x);
    return x[0] != 0;
  }
  /// Rank 0's text, on every rank (what each process would otherwise make up on its own).
  std::string lead_text(const std::string& mine) {
    if (!several()) return mine;
    std::int64_t n[1] = {lead() ? static_cast<std::int64_t>(mine.size()) : 0};
    comm_->all_reduce_sum(n);
    std::vector<std::int64_t> chars(static_cast<std::size_t>(n[0]), 0);
    if (lead())
      for (std::size_t i = 0; i < chars.size(); ++i) chars[i] = static_cast<unsigned char>(mine[i]);
    comm_->all_reduce_sum(chars);
    std::string out(chars.size(), '\0');
    for (std::size_t i = 0; i < chars.size(); ++i) out[i] = static_cast<char>(chars[i]);
    return out;
  }
  /// Waits for every rank (rank 0 finishing its last save before any process exits: a launcher
  /// ends the run when one process leaves with an error status).
  void barrier() {
    if (!several()) return;
    std::int64_t v[1] = {0};
    comm_->all_reduce_sum(v);
  }
  /// This rank fails. Before agree_started, the others are told there (so that every rank stops
  /// instead of waiting for this one); after, MPI ends every process now and NCCL's communicator
  /// is aborted (the others stop at their collective timeout; ranks that are threads of this process
  /// at once: LocalComm's group is aborted, and --gpus aborts the other ranks' NCCL communicators).
  /// Never throws.
  void fail(int status) noexcept {
    if (!several() || !comm_) return;
    if (phase_ == Phase::started) {
      comm_->abort(status);
    } else if (phase_ == Phase::starting) {
      phase_ = Phase::agreed_to_stop;
      try {
        (void)flags(1);
      } catch (...) {
      }
    }
  }

 private:
  // Every rank's `mine` (not 1: a rank that fails before agreeing sends 1, fail()), in rank order,
  // once no rank failed; else throws on every rank, naming those that did.
  std::vector<std::int64_t> agree(std::int64_t mine) {
    const auto v = each_rank(mine);
    std::vector<int> failed;
    for (std::size_t i = 0; i < v.size(); ++i)
      if (v[i] == 1) failed.push_back(static_cast<int>(i));
    if (!failed.empty()) phase_ = Phase::agreed_to_stop;
    MT_CHECK(failed.empty(), "{}(es) {} of {} stopped before training (their message says why): every {} stops",
             noun(), fmt::join(failed, ", "), world(), noun());
    return v;
  }
  // Every rank's `mine`, in rank order.
  std::vector<std::int64_t> each_rank(std::int64_t mine) {
    std::vector<std::int64_t> v(static_cast<std::size_t>(world()), 0);
    v[static_cast<std::size_t>(rank())] = mine;
    comm_->all_reduce_sum(v);
    return v;
  }
  // The ranks whose flag is not 0.
  std::vector<int> flags(std::int64_t mine) {
    const auto v = each_rank(mine);
    std::vector<int> out;
    for (std::size_t i = 0; i < v.size(); ++i)
      if (v[i] != 0) out.push_back(static_cast<int>(i));
    return out;
  }

  megatrain::dist::LaunchInfo me_;
  std::unique_ptr<megatrain::dist::HostComm> comm_;
#if MEGATRAIN_PROGRAM_MPI && MEGATRAIN_PROGRAM_NCCL
  std::unique_ptr<megatrain::dist::MpiComm> mpi_;  // (where mpirun launched GPU processes: their meeting)
#endif
  bool threads_ = false;
  enum class Phase { starting, agreed_to_stop, started } phase_ = Phase::starting;
};

}  // namespace megatrain::app
