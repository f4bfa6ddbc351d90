// StreamExecutor: a pipeline stage's CUDA stream. Completions are events recorded on it; waiting
// on another stage's completion makes this stream wait on the GPU (no host blocking), and a host
// stage waiting on this one blocks on the event.
#pragma once

#include <cuda_runtime_api.h>

#include <utility>
#include <vector>

#include "megatrain/core/cuda_check.hpp"
#include "megatrain/pipeline/executor.hpp"

namespace megatrain::cuda {

class StreamExecutor {
 public:
  /// Events are recycled round-robin; a completion must be waited on within kEvents later
  /// completions of the same executor (the pipeline's rings keep stages far closer than that).
  /// (256: a micro-batch's forward items, which no ring holds back, plus the trainer's own
  /// completions for spilled activations, stay well inside it for models of up to ~100 blocks.)
  static constexpr int kEvents = 256;

  StreamExecutor() = default;
  /// Uses `stream`; creates (and later destroys) one of its own when `stream` is null. `device`
  /// (>= 0): the GPU the stream is on, made current on the thread that runs the stage
  /// (bind_thread()): a thread starts on GPU 0, and a stage's kernels must go to its stream's GPU.
  explicit StreamExecutor(cudaStream_t stream, int device = -1) : stream_(stream), device_(device) {
    bind_thread();
    if (stream_ == nullptr) {
      MT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      owns_ = true;
    }
    events_.resize(kEvents);
    for (auto& e : events_) MT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  StreamExecutor(StreamExecutor&& o) noexcept { swap(o); }
  StreamExecutor& operator=(StreamExecutor&& o) noexcept {
    StreamExecutor t(std::move(o));
    swap(t);
    return *this;
  }
  StreamExecutor(const StreamExecutor&) = delete;
  StreamExecutor& operator=(const StreamExecutor&) = delete;
  ~StreamExecutor() {
    for (auto e : events_) (void)cudaEventDestroy(e);
    for (auto e : marks_) (void)cudaEventDestroy(e);
    if (owns_) (void)cudaStreamDestroy(stream_);
  }

  cudaStream_t stream() const { return stream_; }
  /// Makes this executor's GPU current on the calling thread (StreamPipeline calls it as each
  /// stage's thread starts).
  void bind_thread() const {
    if (device_ >= 0) MT_CUDA_CHECK(cudaSetDevice(device_));
  }

  void wait(const Completion& c) {
    if (c.is_device()) MT_CUDA_CHECK(cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(c.device_event), 0));
  }
  Completion complete() {
    cudaEvent_t e = events_[static_cast<std::size_t>(next_++ % kEvents)];
    MT_CUDA_CHECK(cudaEventRecord(e, stream_));
    return {e, &host_sync};
  }
  void synchronize() { MT_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

  /// Profiling: a timing event recorded on this stream; seconds(a, b) once both have fired.
  /// Marks are reused after reset_marks().
  using Mark = cudaEvent_t;
  Mark mark() {
    if (next_mark_ == marks_.size()) {
      cudaEvent_t e = nullptr;
      MT_CUDA_CHECK(cudaEventCreate(&e));
      marks_.push_back(e);
    }
    cudaEvent_t e = marks_[next_mark_++];
    MT_CUDA_CHECK(cudaEventRecord(e, stream_));
    return e;
  }
  static double seconds(Mark a, Mark b) {
    float ms = 0;
    MT_CUDA_CHECK(cudaEventSynchronize(b));  // (a came before b on the stream: both are done)
    MT_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    return ms * 1e-3;
  }
  void reset_marks() { next_mark_ = 0; }

  static void host_sync(void* event) { MT_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event))); }

 private:
  void swap(StreamExecutor& o) noexcept {
    std::swap(stream_, o.stream_);
    std::swap(device_, o.device_);
    std::swap(owns_, o.owns_);
    std::swap(events_, o.events_);
    std::swap(next_, o.next_);
    std::swap(marks_, o.marks_);
    std::swap(next_mark_, o.next_mark_);
  }
  cudaStream_t stream_ = nullptr;
  int device_ = -1;
  bool owns_ = false;
  std::vector<cudaEvent_t> events_;
  long long next_ = 0;
  std::vector<cudaEvent_t> marks_;
  std::size_t next_mark_ = 0;
};

static_assert(Executor<StreamExecutor>);

}  // namespace megatrain::cuda
