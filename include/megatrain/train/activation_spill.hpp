// Spilled activations (TrainerOptions::spilled_blocks, plan::TrainerBuffers::spills): blocks whose
// forward keeps its activations in pinned host memory until the backward, instead of on the GPU
// (or recomputing them).
//
// Two device staging buffers alternate between the spilled blocks. A spilled block's forward
// writes its activations into one; a copy down to the block's host buffer follows on a stream of
// its own, once the forward is done. In the backward the copies come up in backward order, each
// into its staging buffer once the block before it there is done with it: two ahead of the
// backwards done. The events between them are per staging buffer: when it may be written (its
// last copy down, or the backward that read it) and when the copy up into it is done. The compute
// stage alone calls these, on its thread.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "megatrain/core/error.hpp"
#include "megatrain/core/fault_injection.hpp"
#include "megatrain/core/host_memory.hpp"
#include "megatrain/pipeline/executor.hpp"
#include "megatrain/plan/memory_plan.hpp"

namespace megatrain {

template <class B>
class ActivationSpill {
  using Exec = typename B::Executor;
  template <class E>
  using Buf = typename B::template Buffer<E>;

 public:
  /// The staging buffers, the host copies and the copy streams of the blocks the plan spills
  /// (none where it spills none).
  void allocate(B& be, const plan::TrainerBuffers& b, std::size_t blocks) {
    b_ = &b;
    host_.assign(blocks + 2, {});
    if (b.spilled_blocks == 0) return;
    for (int k = 0; k < 2; ++k) stage_.push_back(be.template alloc<std::byte>(b.spill_slot_bytes));
    for (std::size_t u = blocks; u >= 1; --u)
      if (b.spills(u)) {
        host_mem_.push_back(HostBuffer::allocate(b.kept_bytes[u]));
        host_[u] = host_mem_.back().template as<std::byte>(0, b.kept_bytes[u]);
        order_.push_back(u);
      }
    down_.emplace(be.make_executor(B::Role::download));
    up_.emplace(be.make_executor(B::Role::upload));
    test_delay_ns_ = fault::delay_of("spill") * 1000;  // (tests: delay@spill=MICROSECONDS)
    be_ = &be;
  }

  /// A micro-batch's forward starts with the staging buffers free: their last readers were on
  /// the compute stream, which waits for the spill streams' last copies (every one consumed in a
  /// step that ran to its end; not so after a step that threw).
  void begin_micro_batch(Exec& exec) {
    if (order_.empty()) return;
    exec.wait(down_->complete());
    exec.wait(up_->complete());
    free_ = {};
    fetched_ = used_ = 0;
  }
  /// Before spilled block u's forward writes its staging buffer: the copy down of its last content done.
  std::span<std::byte> stage_for_forward(Exec& exec, std::size_t u) {
    exec.wait(free_[index(u)]);
    return stage(u);
  }
  /// After it: the activations down to host memory, on a stream of their own once the forward is done.
  void down(Exec& exec, std::size_t u) {
    down_->wait(exec.complete());
    test_delay(*down_);
    be_->download(*down_, std::span<const std::byte>(stage(u)), host_[u]);
    free_[index(u)] = down_->complete();
  }
  /// The copies up, in backward order, each into its staging buffer once the block before it
  /// there is done with it: two ahead of the backwards done.
  void fetch() {
    while (fetched_ < order_.size() && fetched_ < used_ + 2) {
      const std::size_t u = order_[fetched_++];
      up_->wait(free_[index(u)]);
      test_delay(*up_);
      be_->upload(*up_, std::span<const std::byte>(host_[u]), stage(u));
      ready_[index(u)] = up_->complete();
    }
  }
  /// Before spilled block u's backward: its activations back in its staging buffer.
  std::span<std::byte> stage_for_backward(Exec& exec, std::size_t u) {
    fetch();
    MT_CHECK(used_ < order_.size() && order_[used_] == u,
             "spilled activations: block {}'s backward out of the order of the copies (internal)", u);
    exec.wait(ready_[index(u)]);
    return stage(u);
  }
  /// After it: the buffer free for the copy up two spilled blocks later.
  void backward_done(Exec& exec, std::size_t u) {
    free_[index(u)] = exec.complete();
    ++used_;
    fetch();
  }

 private:
  std::size_t index(std::size_t u) const { return b_->spill_index(u) % 2; }
  std::span<std::byte> stage(std::size_t u) { return stage_[index(u)].span().first(b_->kept_bytes[u]); }
  // Tests (MEGATRAIN_FAULTS=delay@spill=MICROSECONDS): each copy held back that long on its stream,
  // so that a missing wait would let the compute stream read or write a staging buffer too early.
  void test_delay(Exec& e) {
    if constexpr (requires(B& be) { be.spin(e, std::int64_t{}); })
      if (test_delay_ns_ > 0) be_->spin(e, test_delay_ns_);
  }

  const plan::TrainerBuffers* b_ = nullptr;
  B* be_ = nullptr;
  std::vector<Buf<std::byte>> stage_;
  std::vector<std::span<std::byte>> host_;
  std::vector<HostBuffer> host_mem_;
  std::optional<Exec> down_, up_;
  std::array<Completion, 2> free_{}, ready_{};
  std::vector<std::size_t> order_;  // the spilled blocks in backward order
  std::size_t fetched_ = 0, used_ = 0;  // of a micro-batch's backward: copies up issued, backwards done
  std::int64_t test_delay_ns_ = 0;
};

}  // namespace megatrain
