// Host memory for the model's state.
//
// HostBuffer is one page-aligned allocation, either pageable or pinned (page-locked through
// CUDA, so that DMA engines copy it at full PCIe speed: pageable memory moves 6-7x slower).
// Pinning is an attribute added to an ordinary mapping, so a failure to pin (a locked memory
// limit) leaves a working pageable buffer and one warning (log_warning), never a crash; without
// a GPU the buffer is simply pageable. For tests, MEGATRAIN_FAULTS=fail@pin in the environment
// (core/fault_injection.hpp) makes every pinning attempt fail that way, in any build, with or without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace megatrain {

enum class Pinning {
  automatic,  ///< pin when megatrain was built with CUDA and a GPU is present; else pageable (and
              ///< if pinning fails: pageable, with a warning)
  never,      ///< always pageable
};

/// Where the other processes of a host find a shared HostBuffer (HostBuffer::allocate_shared):
/// the process that created it and its descriptor of the memory, and the memory file's device and
/// inode, which the opener checks (a pid of another pid namespace names another process).
struct SharedHostHandle {
  std::int64_t pid = 0, fd = -1, dev = 0, ino = 0;
};

class HostBuffer {
 public:
  HostBuffer() = default;
  /// Allocates `bytes` (rounded up to whole pages), page-aligned. Contents start zeroed.
  /// Throws megatrain::Error if the memory cannot be mapped at all.
  static HostBuffer allocate(std::size_t bytes, Pinning pinning = Pinning::automatic);
  /// `bytes` that `sharers` processes of one host map together (the same pages; zeroed when
  /// created): the first creates it (`open` null), the others open it with the creator's
  /// shared_handle() while the creator's buffer is alive. Each process counts 1/sharers of it
  /// in host_buffer_bytes(). Linux only (an anonymous memory file, opened through /proc).
  static HostBuffer allocate_shared(std::size_t bytes, int sharers, const SharedHostHandle* open,
                                    Pinning pinning = Pinning::automatic);
  /// The handle of a buffer this process created with allocate_shared (throws for any other).
  SharedHostHandle shared_handle() const;

  HostBuffer(HostBuffer&& o) noexcept { swap(o); }
  HostBuffer& operator=(HostBuffer&& o) noexcept {
    HostBuffer tmp(std::move(o));
    swap(tmp);
    return *this;
  }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  ~HostBuffer() { release(); }

  void* data() const { return data_; }
  std::size_t size() const { return size_; }
  /// Whether the whole buffer is page-locked.
  bool pinned() const { return pinned_; }
  /// Page-locks the byte ranges [first, first + second) of a buffer allocated with Pinning::never
  /// (each widened to whole pages, overlapping ones merged), as Pinning::automatic would pin the
  /// whole buffer: where there is no GPU nothing is done, and a failure leaves them pageable with
  /// one warning. The rest stays pageable, so that its pages can be given back
  /// (release_host_pages) while these are copied by DMA. Returns whether they are locked.
  bool pin_ranges(std::vector<std::pair<std::size_t, std::size_t>> ranges);
  /// Whether pin_ranges locked some ranges.
  bool pinned_in_ranges() const { return !pinned_ranges_.empty(); }
  explicit operator bool() const { return data_ != nullptr; }

  /// The buffer as `count` elements of T starting `offset` elements in (bounds-checked).
  template <class T>
  std::span<T> as(std::size_t offset, std::size_t count) const;

 private:
  void release() noexcept;
  void swap(HostBuffer& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    std::swap(mapped_, o.mapped_);
    std::swap(pinned_, o.pinned_);
    std::swap(charged_, o.charged_);
    std::swap(fd_, o.fd_);
    std::swap(created_, o.created_);
    std::swap(pinned_ranges_, o.pinned_ranges_);
  }
  void* data_ = nullptr;
  std::size_t size_ = 0;    // bytes asked for
  std::size_t mapped_ = 0;  // bytes mapped (whole pages)
  std::size_t charged_ = 0;  // bytes counted in host_buffer_bytes (a shared buffer: this process's share)
  bool pinned_ = false;
  int fd_ = -1;           // a shared buffer's memory file
  bool created_ = false;  // ... created by this process
  std::vector<void*> pinned_ranges_;  // (pin_ranges: the starts of the ranges it registered)
};

/// An identity of this host, the same for every process on it and different on another machine
/// (its name, boot id and pid namespace, hashed): what tells processes whether they can share host
/// memory (processes in containers of their own do not, though they share a kernel).
std::uint64_t host_identity();

/// Bytes of host memory a new allocation can use: MemAvailable from /proc/meminfo, capped by
/// the cgroup's memory limit. The environment variable MEGATRAIN_HOST_MEMORY (bytes, or with a
/// K/M/G/T suffix in powers of 1024) overrides it, for machines whose memory grows on demand.
std::size_t available_host_memory();

/// Whether [data, data + bytes) lies within one range that a HostBuffer page-locked (the whole
/// buffer, or one of its pin_ranges): memory the copy engines read and write directly. Memory
/// locked otherwise (cudaHostAlloc) is not known here: false.
bool host_pages_locked(const void* data, std::size_t bytes);

/// Gives the whole pages inside [data, data + bytes) back to the system (they read as zeros
/// afterwards, and hold no memory until written again). For anonymous memory, e.g. a HostBuffer.
void release_host_pages(void* data, std::size_t bytes) noexcept;

/// The host's page size: a HostBuffer maps whole pages.
std::size_t host_page_size();
/// Bytes mapped by the HostBuffers alive in this process (what tests compare memory plans with).
std::size_t host_buffer_bytes();

/// Parses "123", "64G", "1.5T" (powers of 1024) into bytes; throws megatrain::Error on junk.
std::size_t parse_byte_size(const char* text);

/// True when megatrain was built with CUDA and at least one GPU is usable.
bool cuda_device_present();

/// "1.50 GiB", "512.0 MiB", "10 B"
std::string format_bytes(std::size_t bytes);

}  // namespace megatrain

#include "megatrain/core/error.hpp"

template <class T>
std::span<T> megatrain::HostBuffer::as(std::size_t offset, std::size_t count) const {
  MT_CHECK((offset + count) * sizeof(T) <= size_, "elements [{}, {}) of {} bytes pass the end of a {}-byte buffer",
           offset, offset + count, sizeof(T), size_);
  return {static_cast<T*>(data_) + offset, count};
}
