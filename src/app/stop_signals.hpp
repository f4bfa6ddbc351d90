// megatrain-train's SIGINT and SIGTERM, from the first instant of the process to its end.
//
// One thread waits for them (sigwait; the signals are blocked in every other thread, which
// inherit the mask from main). The first asks the run to stop: before training, the setup stops
// at its next check (StopSignals::check) and the program exits 128 + the signal, saying so;
// during training, the loop finishes the step, saves a checkpoint and exits. A second signal
// stops at once: the watcher removes what this process was writing (a checkpoint's or an
// export's staging folder: nothing half-written is left), prints the closing line (the newest
// complete checkpoint, and how to resume) and ends the process.
#pragma once

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <fmt/ranges.h>

#include "megatrain/core/error.hpp"

namespace megatrain::app {

/// Thrown by StopSignals::check where a stop signal came before training started.
class StoppedBeforeTraining : public megatrain::Error {
 public:
  StoppedBeforeTraining(int sig, const std::string& phase)
      : megatrain::Error("megatrain-train", fmt::format("stopped by {} {}: nothing was trained", name(sig), phase),
                         __FILE__, __LINE__),
        signal_(sig) {}
  int signal() const { return signal_; }
  static const char* name(int sig) { return sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "a signal"; }

 private:
  int signal_;
};

class StopSignals {
 public:
  /// What a second signal cleans and says: the run folder, the newest complete checkpoint (0:
  /// none), where the previous run of an --overwrite waits, and the staging entries this process
  /// may be writing: in each folder, those named `<prefix>*.partial-*`.
  struct Status {
    std::string out;
    std::int64_t saved_step = 0;
    std::string saved_path;
    bool training = false;
    std::string replaced;
    std::vector<std::pair<std::filesystem::path, std::string>> writing_in;
  };

  /// Blocks SIGINT and SIGTERM in the calling thread (main, before any other thread starts) and
  /// starts the watcher. Idempotent.
  static void install() {
    State& s = state();
    if (s.watcher.joinable()) return;
    sigset_t set = signals();
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
    s.watcher = std::thread(watch);
  }

  /// Ends the watcher and unblocks the signals in the calling thread (before a program hands its
  /// signals to another handler, as the --gpus launcher does).
  static void uninstall() {
    State& s = state();
    if (!s.watcher.joinable()) return;
    s.quit = true;
    s.watcher.join();
    sigset_t set = signals();
    pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
  }

  /// The first stop signal's number, 0 while none came.
  static int first() { return state().first.load(); }

  /// Before training: throws StoppedBeforeTraining where a stop signal came. `phase` says
  /// where, as words ("while preparing the data").
  static void check(const std::string& phase) {
    if (const int sig = first(); sig != 0) throw StoppedBeforeTraining(sig, phase);
  }

  /// Updates what a second signal cleans and says.
  static void update(const Status& status) {
    State& s = state();
    const std::lock_guard lock(s.m);
    s.status = status;
  }
  template <class F>
  static void edit(F&& f) {
    State& s = state();
    const std::lock_guard lock(s.m);
    f(s.status);
  }

 private:
  struct State {
    std::atomic<int> first{0};
    std::atomic<bool> quit{false};
    std::thread watcher;
    std::mutex m;
    Status status;
    ~State() {  // (at exit: the watcher ends within a tick)
      quit = true;
      if (watcher.joinable()) watcher.join();
    }
  };
  static State& state() {
    static State s;
    return s;
  }
  static sigset_t signals() {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    return set;
  }

  static void watch() {
    State& s = state();
    const sigset_t set = signals();
    const timespec tick{0, 100'000'000};  // (quit is looked at ten times a second)
    while (!s.quit) {
      const int sig = sigtimedwait(&set, nullptr, &tick);
      if (sig < 0) continue;  // (EAGAIN: the tick; EINTR)
      int none = 0;
      if (s.first.compare_exchange_strong(none, sig)) {
        const char msg[] = "\nmegatrain-train: stopping: finishing this step, then saving a checkpoint (interrupt again to "
                           "stop at once)\n";
        (void)!::write(STDERR_FILENO, msg, sizeof msg - 1);
        continue;
      }
      stop_at_once(sig);
    }
  }

  // A second signal: what this process was writing is removed, the closing line printed, and the
  // process ends (128 + the signal, as its default action would give).
  [[noreturn]] static void stop_at_once(int sig) {
    State& s = state();
    Status st;
    {
      const std::lock_guard lock(s.m);
      st = s.status;
    }
    std::vector<std::string> removed;
    for (const auto& [dir, prefix] : st.writing_in) {
      std::error_code ec;
      for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
        const std::string name = it->path().filename().string();
        if (!name.starts_with(prefix) || name.find(".partial-") == std::string::npos) continue;
        std::error_code rm;
        for (int attempt = 0; attempt < 5 && std::filesystem::exists(it->path(), rm); ++attempt)
          std::filesystem::remove_all(it->path(), rm);  // (a writer may add a file meanwhile: again)
        removed.push_back(name);
      }
    }
    std::string line = fmt::format("\nmegatrain-train: stopped at once by a second {}", StoppedBeforeTraining::name(sig));
    if (!removed.empty()) line += fmt::format("; removed what was being written ({})", fmt::join(removed, ", "));
    if (!st.training) {
      line += " before training started: nothing was trained";
    } else if (st.saved_step > 0) {
      line += fmt::format("; the newest complete checkpoint is step {} ({}): resume with: megatrain-train --resume --out {}",
                          st.saved_step, st.saved_path, st.out);
    } else {
      line += "; no checkpoint was saved";
    }
    if (!st.replaced.empty()) line += fmt::format("; the previous run (--overwrite) is still in '{}'", st.replaced);
    line += "\n";
    (void)!::write(STDERR_FILENO, line.data(), line.size());
    std::_Exit(128 + sig);
  }
};

}  // namespace megatrain::app
