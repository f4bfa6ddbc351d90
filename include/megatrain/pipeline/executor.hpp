// Executors: where a pipeline stage's work runs, and how ordering crosses between them.
//
// A Completion stands for "the work a stage did (or enqueued) for one item". Device work is
// represented by an event recorded after it on the stage's stream; host work by nothing,
// because a host stage's work has finished by the time its completion is posted. An executor
// knows how to order its next work after any completion:
//   - a host executor blocks its thread until a device event has fired (host work needs no wait);
//   - a stream executor makes its stream wait for the event (no host blocking at all).
#pragma once

#include <oneapi/tbb/task_arena.h>

#include <chrono>
#include <concepts>
#include <memory>
#include <utility>

namespace megatrain {

/// The finished (or enqueued) work of one stage for one item.
struct Completion {
  void* device_event = nullptr;                  ///< a cudaEvent_t, or null for host work
  void (*host_sync)(void* event) = nullptr;      ///< blocks the calling thread until the event fires
  bool is_device() const { return device_event != nullptr; }
};

// clang-format off
template <class E>
concept Executor = requires(E& e, const Completion& c) {
  e.wait(c);                                       // order this executor's next work after c
  { e.complete() } -> std::same_as<Completion>;    // a completion for all work submitted so far
  e.synchronize();                                 // block the calling thread until that work is done
};
// clang-format on

/// Runs a stage's work synchronously on the pipeline's thread for that stage, optionally inside
/// a oneTBB task arena of its own (so that, e.g., the optimizer's parallel loops use their own
/// share of cores and do not queue behind the compute stage's).
class HostExecutor {
 public:
  HostExecutor() = default;
  /// Work runs inside a task arena limited to `threads` threads.
  explicit HostExecutor(int threads) : arena_(std::make_shared<tbb::task_arena>(threads)) {}

  void wait(const Completion& c) {
    if (c.is_device()) c.host_sync(c.device_event);
  }
  Completion complete() { return {}; }
  void synchronize() {}

  /// Profiling: a point in this executor's timeline; seconds(a, b) once both have passed.
  using Mark = std::chrono::steady_clock::time_point;
  Mark mark() { return std::chrono::steady_clock::now(); }
  static double seconds(Mark a, Mark b) { return std::chrono::duration<double>(b - a).count(); }
  void reset_marks() {}

  template <class F>
  void run(F&& f) {
    if (arena_) arena_->execute(std::forward<F>(f));
    else f();
  }

 private:
  std::shared_ptr<tbb::task_arena> arena_;
};

}  // namespace megatrain
