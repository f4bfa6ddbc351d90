// megatrain-train --gpus N --gpu-ranks processes: this program starts one process per GPU of
// this host itself, as torchrun would (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// MASTER_ADDR=127.0.0.1, a free MASTER_PORT), each with the same command line, and waits for them
// (docs/distributed.md). The default, --gpu-ranks threads, drives the N GPUs from this process, a
// rank (thread) each (main.cpp; dist::run_local_ranks).
//
// The launcher forwards SIGINT and SIGTERM to every process (which stop after the same step, the
// first saving it), and where one process fails, gives the others a minute to stop on their own
// (the communicator of a dead peer fails their next collective only after its timeout) before it
// kills them. It exits with the first failing process's status, else 0.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#if MEGATRAIN_HAS_CUDA
#include <cuda_runtime.h>
#endif

#include "megatrain/core/error.hpp"
#include "megatrain/dist/launch.hpp"
#include "megatrain/dist/local.hpp"

namespace megatrain::app {

/// GPUs this process can see (0 without CUDA).
inline int visible_gpus() {
#if MEGATRAIN_HAS_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
#else
  return 0;
#endif
}

/// The ranks `--gpus` asks for: 1 (the default: this process alone), N, or `all`. Refused where
/// this host has fewer GPUs. With the cpu backend (which has no GPUs): N ranks of it as threads
/// of this process (what tests of the several-GPU logic run without GPUs; several processes on the
/// cpu backend train under mpirun), not `all` and not --gpu-ranks processes.
inline int gpus_wanted(const std::string& gpus, const std::string& backend, const std::string& ranks_as) {
  MT_CHECK(ranks_as == "threads" || ranks_as == "processes", "--gpu-ranks must be threads or processes (got '{}')",
           ranks_as);
  if (gpus == "1") return 1;
  const bool cpu = backend == "cpu";
  MT_CHECK(!cpu || (gpus != "all" && ranks_as == "threads"),
           "--gpus {}{} with the cpu backend: it runs N ranks of the cpu backend as threads of this process (a number, "
           "--gpu-ranks threads); several processes on the cpu backend train over MPI: `mpirun -np N megatrain-train "
           "...` (docs/distributed.md)", gpus, ranks_as == "processes" ? " --gpu-ranks processes" : "");
  const int have = cpu ? std::numeric_limits<int>::max() : visible_gpus();
  MT_CHECK(have > 0, "--gpus {}: no GPU is visible on this host (CUDA_VISIBLE_DEVICES selects them)", gpus);
  int n = 0;
  if (gpus == "all") {
    n = have;
  } else {
    std::size_t used = 0;
    try {
      n = std::stoi(gpus, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    MT_CHECK(used == gpus.size() && n >= 1, "--gpus must be a number of GPUs >= 1 or `all` (got '{}')", gpus);
  }
  MT_CHECK(n >= 1 && n <= have, "--gpus {}: this host has {} GPU(s) visible (CUDA_VISIBLE_DEVICES selects them); ask "
           "for at most {}", gpus, have, have);
  return n;
}

namespace forwarding {
inline volatile sig_atomic_t g_forward = 0;
inline void remember_signal(int sig) { g_forward = sig; }

}  // namespace forwarding

/// Starts `n` copies of this program (argv as given) with torchrun's variables, and waits for
/// them; returns the exit status megatrain-train should end with.
inline int launch_gpus(int n, char** argv) {
  const int port = megatrain::dist::free_local_port();
  std::vector<pid_t> kids;
  for (int r = 0; r < n; ++r) {
    const pid_t pid = ::fork();
    MT_CHECK(pid >= 0, "--gpus: could not start process {} of {}", r, n);
    if (pid == 0) {
      ::setpgid(0, 0);  // (the terminal's Ctrl-C reaches the launcher, which forwards it once)
      const std::string rank = std::to_string(r), world = std::to_string(n), p = std::to_string(port);
      ::setenv("RANK", rank.c_str(), 1);
      ::setenv("LOCAL_RANK", rank.c_str(), 1);
      ::setenv("WORLD_SIZE", world.c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", world.c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", p.c_str(), 1);
      ::setenv("MEGATRAIN_GPUS_LAUNCHED", "1", 1);
      if (std::getenv("NCCL_NVLS_ENABLE") == nullptr) ::setenv("NCCL_NVLS_ENABLE", "0", 1);
      sigset_t none;  // (a process starts with no signal blocked, whatever its launcher blocks)
      ::sigemptyset(&none);
      ::sigprocmask(SIG_SETMASK, &none, nullptr);
      ::execv("/proc/self/exe", argv);
      std::fprintf(stderr, "megatrain-train --gpus: could not start process %d of %d\n", r, n);
      std::_Exit(127);
    }
    kids.push_back(pid);
  }
  struct sigaction sa{};
  sa.sa_handler = forwarding::remember_signal;
  ::sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  int status = 0, left = n, forwarded = 0;
  std::vector<bool> done(static_cast<std::size_t>(n), false);
  bool failing = false;  // (a process failed, the others still run: killed a minute after)
  auto failed_at = std::chrono::steady_clock::now();
  while (left > 0) {
    if (const int sig = forwarding::g_forward; sig != 0) {
      forwarding::g_forward = 0;
      forwarded = sig;
      for (std::size_t k = 0; k < kids.size(); ++k)
        if (!done[k]) ::kill(kids[k], sig);
    }
    for (std::size_t k = 0; k < kids.size(); ++k) {
      if (done[k]) continue;
      int st = 0;
      if (::waitpid(kids[k], &st, WNOHANG) != kids[k]) continue;
      done[k] = true;
      --left;
      const int code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      if (code != 0 && status == 0) {
        status = code;
        if (forwarded != 0 && code == 128 + forwarded) continue;  // (stopped as asked: the others do too)
        failing = true;
        failed_at = std::chrono::steady_clock::now();
        if (left > 0)
          std::fprintf(stderr, "megatrain-train --gpus: process %zu of %d (GPU %zu) ended with status %d; the others "
                       "stop within a minute\n", k, n, k, code);
      }
    }
    if (failing && left > 0 && std::chrono::steady_clock::now() - failed_at > std::chrono::seconds(60)) {
      for (std::size_t k = 0; k < kids.size(); ++k)
        if (!done[k]) ::kill(kids[k], SIGKILL);
      failing = false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return status;
}

}  // namespace megatrain::app
