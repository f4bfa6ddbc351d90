#include "megatrain/core/host_memory.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <string>

#include "megatrain/core/error.hpp"
#include "megatrain/core/fault_injection.hpp"
#include "megatrain/core/log.hpp"

#if MEGATRAIN_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace megatrain {

namespace {
std::size_t page_size() {
  static const std::size_t p = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return p;
}
std::atomic<std::size_t> g_mapped{0};  // bytes mapped by live HostBuffers

// Test hook (core/fault_injection.hpp): `fail@pin` makes every pinning attempt fail as
// cudaHostRegister can (locked-memory limit), in any build and with or without a GPU, so that the
// fallback can be tested.
bool pin_failure_forced() { return fault::failure("pin") != 0; }

// The ranges HostBuffers page-locked, begin -> end (host_pages_locked answers from them).
std::mutex g_locked_mutex;
std::map<std::uintptr_t, std::uintptr_t> g_locked;
void note_locked(void* p, std::size_t bytes, bool locked) {
  std::lock_guard lock(g_locked_mutex);
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  if (locked) g_locked[a] = a + bytes;
  else g_locked.erase(a);
}

// Page-locks [p, p + bytes) for Pinning::automatic. No GPU (or a CPU-only build): pageable,
// silently. A GPU but pinning fails: pageable, with one warning.
bool try_pin(void* p, std::size_t bytes) {
  std::string why;
  if (pin_failure_forced()) {
    why = "forced by MEGATRAIN_FAULTS (fail@pin)";
  } else {
#if MEGATRAIN_HAS_CUDA
    if (!cuda_device_present()) return false;
    // (portable: page-locked for every GPU of the process, as one process driving several GPUs
    // copies through each rank's own buffers from its own GPU, and its host collectives from any)
    const cudaError_t st = cudaHostRegister(p, bytes, cudaHostRegisterPortable);
    if (st == cudaSuccess) {
      note_locked(p, bytes, true);
      return true;
    }
    (void)cudaGetLastError();  // clear the non-sticky error so later calls are not confused
    why = cudaGetErrorString(st);
#else
    (void)p;
    return false;
#endif
  }
  log_warning("pinning {} of host memory failed ({}); using pageable memory, which copies to the GPU several "
              "times slower. Raise the locked-memory limit (ulimit -l) or free memory.",
              format_bytes(bytes), why);
  return false;
}

std::size_t read_size_file(const char* path) {
  std::ifstream f(path);
  std::string s;
  if (!(f >> s) || s == "max") return std::numeric_limits<std::size_t>::max();
  try {
    return static_cast<std::size_t>(std::stoull(s));
  } catch (...) {
    return std::numeric_limits<std::size_t>::max();
  }
}
}  // namespace

HostBuffer HostBuffer::allocate(std::size_t bytes, Pinning pinning) {
  HostBuffer b;
  if (bytes == 0) return b;
  const std::size_t mapped = (bytes + page_size() - 1) / page_size() * page_size();
  void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  MT_CHECK(p != MAP_FAILED, "cannot map {} of host memory: {}", format_bytes(bytes), std::strerror(errno));
  // Large slabs are streamed through by the optimizer: huge pages cut TLB misses.
  if (mapped >= (std::size_t{32} << 20)) (void)madvise(p, mapped, MADV_HUGEPAGE);
  b.data_ = p;
  b.size_ = bytes;
  b.mapped_ = b.charged_ = mapped;
  g_mapped += mapped;
  if (pinning == Pinning::automatic) b.pinned_ = try_pin(p, mapped);
  return b;
}

HostBuffer HostBuffer::allocate_shared(std::size_t bytes, int sharers, const SharedHostHandle* open, Pinning pinning) {
  MT_CHECK(sharers >= 1, "a shared host buffer needs at least one process (got {})", sharers);
  HostBuffer b;
  if (bytes == 0) return b;
  const std::size_t mapped = (bytes + page_size() - 1) / page_size() * page_size();
  int fd = -1;
  if (open == nullptr) {
    fd = memfd_create("megatrain-shared-weights", MFD_CLOEXEC);
    MT_CHECK(fd >= 0, "cannot create {} of host memory to share between processes: {}", format_bytes(bytes),
             std::strerror(errno));
    if (ftruncate(fd, static_cast<off_t>(mapped)) != 0) {
      const int err = errno;
      ::close(fd);
      MT_FAIL("cannot size {} of host memory to share between processes: {}", format_bytes(bytes), std::strerror(err));
    }
  } else {
    const std::string path = fmt::format("/proc/{}/fd/{}", open->pid, open->fd);
    fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    MT_CHECK(fd >= 0, "cannot open the host memory that process {} shares ({}): {}; the processes sharing it must run "
             "on one host as one user", open->pid, path, std::strerror(errno));
    // (the very file the creator made, and as long: else not it, e.g. another pid namespace's process)
    struct stat st {};
    const bool same = ::fstat(fd, &st) == 0 && static_cast<std::int64_t>(st.st_dev) == open->dev &&
                      static_cast<std::int64_t>(st.st_ino) == open->ino && static_cast<std::size_t>(st.st_size) >= mapped;
    if (!same) {
      ::close(fd);
      MT_FAIL("{} is not the host memory that process {} shares (another file, or shorter than {}): the processes "
              "sharing it must run on one host in one pid namespace", path, open->pid, format_bytes(mapped));
    }
  }
  void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    ::close(fd);
    MT_FAIL("cannot map {} of shared host memory: {}", format_bytes(bytes), std::strerror(err));
  }
  if (mapped >= (std::size_t{32} << 20)) (void)madvise(p, mapped, MADV_HUGEPAGE);  // (where shmem allows it)
  b.data_ = p;
  b.size_ = bytes;
  b.mapped_ = mapped;
  b.charged_ = (mapped + static_cast<std::size_t>(sharers) - 1) / static_cast<std::size_t>(sharers);
  b.fd_ = fd;
  b.created_ = open == nullptr;
  g_mapped += b.charged_;
  if (pinning == Pinning::automatic) b.pinned_ = try_pin(p, mapped);
  return b;
}

bool host_pages_locked(const void* data, std::size_t bytes) {
  const auto a = reinterpret_cast<std::uintptr_t>(data);
  std::lock_guard lock(g_locked_mutex);
  auto it = g_locked.upper_bound(a);  // (the first range starting after a; the one before may hold it)
  if (it == g_locked.begin()) return false;
  --it;
  return a >= it->first && a + bytes <= it->second;
}

SharedHostHandle HostBuffer::shared_handle() const {
  MT_CHECK(created_ && fd_ >= 0, "only the process that created a shared host buffer can hand it on");
  struct stat st {};
  MT_CHECK(::fstat(fd_, &st) == 0, "cannot read the shared host memory's file: {}", std::strerror(errno));
  return {static_cast<std::int64_t>(::getpid()), fd_, static_cast<std::int64_t>(st.st_dev),
          static_cast<std::int64_t>(st.st_ino)};
}

bool HostBuffer::pin_ranges(std::vector<std::pair<std::size_t, std::size_t>> ranges) {
  MT_CHECK(!pinned_ && pinned_ranges_.empty(), "pin_ranges: this host buffer is pinned already");
  // (whole pages, in order, those that touch or overlap merged: a page is registered once)
  const std::size_t page = page_size();
  std::vector<std::pair<std::size_t, std::size_t>> pages;  // [begin, end) in bytes
  for (const auto& [first, bytes] : ranges) {
    if (bytes == 0) continue;
    MT_CHECK(first + bytes <= size_, "pin_ranges: bytes [{}, {}) lie outside the buffer's {}", first, first + bytes, size_);
    pages.emplace_back(first / page * page, std::min(mapped_, (first + bytes + page - 1) / page * page));
  }
  std::sort(pages.begin(), pages.end());
  std::vector<std::pair<std::size_t, std::size_t>> merged;
  for (const auto& r : pages) {
    if (!merged.empty() && r.first <= merged.back().second) merged.back().second = std::max(merged.back().second, r.second);
    else merged.push_back(r);
  }
  for (const auto& [a, b] : merged) {
    void* p = static_cast<char*>(data_) + a;
    if (!try_pin(p, b - a)) {  // (pageable then, all of it: one warning)
#if MEGATRAIN_HAS_CUDA
      for (void* q : pinned_ranges_) (void)cudaHostUnregister(q);
#endif
      for (void* q : pinned_ranges_) note_locked(q, 0, false);
      pinned_ranges_.clear();
      return false;
    }
    pinned_ranges_.push_back(p);
  }
  return !pinned_ranges_.empty();
}

void HostBuffer::release() noexcept {
  if (data_ == nullptr) return;
#if MEGATRAIN_HAS_CUDA
  if (pinned_) (void)cudaHostUnregister(data_);
  for (void* q : pinned_ranges_) (void)cudaHostUnregister(q);
#endif
  if (pinned_) note_locked(data_, 0, false);
  for (void* q : pinned_ranges_) note_locked(q, 0, false);
  pinned_ranges_.clear();
  munmap(data_, mapped_);
  if (fd_ >= 0) ::close(fd_);
  g_mapped -= charged_;
  data_ = nullptr;
  size_ = mapped_ = charged_ = 0;
  pinned_ = false;
  fd_ = -1;
  created_ = false;
}

std::uint64_t host_identity() {
  char name[256] = {};
  (void)gethostname(name, sizeof name - 1);
  std::string id = name;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string b;
  if (boot >> b) {
    id += '/';
    id += b;
  }
  char ns[128] = {};  // (e.g. "pid:[4026531836]": processes of other containers are not of this host's)
  if (const ssize_t n = ::readlink("/proc/self/ns/pid", ns, sizeof ns - 1); n > 0) {
    id += '/';
    id.append(ns, static_cast<std::size_t>(n));
  }
  // Test hook (core/fault_injection.hpp): `set@host=NAME` makes this process claim another host
  // (NAME), so that the refusal of sharing across hosts can be tested on one.
  if (const auto t = fault::setting("host"); t && !t->empty()) id += "/test:" + *t;
  std::uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  for (char c : id) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
  return h;
}

std::size_t parse_byte_size(const char* text) {
  MT_CHECK(text != nullptr && *text != '\0', "empty byte size");
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(text, &end);
  MT_CHECK(errno == 0 && end != text && v >= 0 && std::isfinite(v), "'{}' is not a byte size", text);
  double scale = 1;
  std::string suffix(end);
  if (!suffix.empty() && (suffix.back() == 'B' || suffix.back() == 'b')) suffix.pop_back();
  if (suffix == "K" || suffix == "k" || suffix == "Ki") scale = 1024.0;
  else if (suffix == "M" || suffix == "Mi") scale = 1024.0 * 1024;
  else if (suffix == "G" || suffix == "Gi") scale = 1024.0 * 1024 * 1024;
  else if (suffix == "T" || suffix == "Ti") scale = 1024.0 * 1024 * 1024 * 1024;
  else MT_CHECK(suffix.empty(), "'{}' is not a byte size (suffixes: K, M, G, T)", text);
  // 2^63 bytes (8 EiB) is beyond any machine, and a double that large no longer converts to a
  // size without undefined behaviour.
  const double bytes = v * scale;
  MT_CHECK(bytes < 0x1p63, "'{}' is {:.3g} bytes, beyond any machine (at most 2^63); give a size such as 120G", text,
           bytes);
  return static_cast<std::size_t>(bytes);
}

std::size_t host_page_size() { return page_size(); }
std::size_t host_buffer_bytes() { return g_mapped.load(); }

std::size_t available_host_memory() {
  if (const char* env = std::getenv("MEGATRAIN_HOST_MEMORY"); env != nullptr && *env != '\0')
    return parse_byte_size(env);
  std::size_t avail = std::numeric_limits<std::size_t>::max();
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  std::size_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") {
      avail = kib * 1024;
      break;
    }
  }
  // cgroup v2, then v1: the limit minus what the group already uses.
  std::size_t limit = read_size_file("/sys/fs/cgroup/memory.max");
  std::size_t used = read_size_file("/sys/fs/cgroup/memory.current");
  if (limit == std::numeric_limits<std::size_t>::max()) {
    limit = read_size_file("/sys/fs/cgroup/memory/memory.limit_in_bytes");
    used = read_size_file("/sys/fs/cgroup/memory/memory.usage_in_bytes");
  }
  if (limit != std::numeric_limits<std::size_t>::max() && used != std::numeric_limits<std::size_t>::max())
    avail = std::min(avail, limit > used ? limit - used : 0);
  return avail;
}

bool cuda_device_present() {
#if MEGATRAIN_HAS_CUDA
  static const bool present = [] {
    int n = 0;
    const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
    (void)cudaGetLastError();
    return ok;
  }();
  return present;
#else
  return false;
#endif
}

std::string format_bytes(std::size_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024 * 1024) return fmt::format("{:.2f} GiB", b / (1024.0 * 1024 * 1024));
  if (b >= 1024.0 * 1024) return fmt::format("{:.1f} MiB", b / (1024.0 * 1024));
  if (b >= 1024.0) return fmt::format("{:.1f} KiB", b / 1024.0);
  return fmt::format("{} B", bytes);
}

void release_host_pages(void* data, std::size_t bytes) noexcept {
  const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = (reinterpret_cast<std::uintptr_t>(data) + page - 1) & ~(page - 1);
  const auto end = (reinterpret_cast<std::uintptr_t>(data) + bytes) & ~(page - 1);
  if (end > begin) (void)::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

}  // namespace megatrain
