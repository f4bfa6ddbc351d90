// Arena: scratch memory handed out in stack order from one pre-allocated buffer (host or
// device: the arena only does pointer arithmetic). An arena built without storage *measures*:
// it hands out views over no memory and records how much a real one would need, so an op
// states its scratch needs with the same code that carves its buffers (see LayerOp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "megatrain/core/error.hpp"
#include "megatrain/core/host_memory.hpp"
#include "megatrain/core/tensor.hpp"

namespace megatrain {

class Arena {
 public:
  static constexpr std::size_t kAlignBytes = 256;

  /// A measuring arena.
  Arena() = default;
  /// An arena over `storage` (not owned).
  explicit Arena(std::span<std::byte> storage) : base_(storage.data()), capacity_(storage.size()) {}

  bool measuring() const { return base_ == nullptr; }
  std::size_t used() const { return used_; }
  /// The most ever in use at once: what a real arena needs.
  std::size_t peak() const { return peak_; }
  std::size_t capacity() const { return capacity_; }

  /// A fresh contiguous view of `shape`, 256-byte aligned. Contents are undefined.
  template <class E>
  View<E> alloc(Shape shape) {
    const std::size_t bytes = static_cast<std::size_t>(shape.numel()) * sizeof(E);
    const std::size_t start = (used_ + kAlignBytes - 1) / kAlignBytes * kAlignBytes;
    const std::size_t end = start + bytes;
    if (!measuring())
      MT_CHECK(end <= capacity_, "scratch arena of {} is too small: needs at least {}", format_bytes(capacity_),
               format_bytes(end));
    used_ = end;
    peak_ = std::max(peak_, used_);
    E* p = measuring() ? nullptr : reinterpret_cast<E*>(base_ + start);
    return View<E>(std::span<E>(p, static_cast<std::size_t>(shape.numel())), shape);
  }

  /// Everything allocated after `mark()` is released by `release(mark)`.
  std::size_t mark() const { return used_; }
  void release(std::size_t mark) {
    MT_CHECK(mark <= used_, "arena mark {} is past the current use {}", mark, used_);
    used_ = mark;
  }

 private:
  std::byte* base_ = nullptr;
  std::size_t capacity_ = 0;
  std::size_t used_ = 0;
  std::size_t peak_ = 0;
};

/// Releases everything allocated in a scope.
class ArenaScope {
 public:
  explicit ArenaScope(Arena& a) : arena_(a), mark_(a.mark()) {}
  ~ArenaScope() { arena_.release(mark_); }
  ArenaScope(const ArenaScope&) = delete;
  ArenaScope& operator=(const ArenaScope&) = delete;

 private:
  Arena& arena_;
  std::size_t mark_;
};

}  // namespace megatrain
