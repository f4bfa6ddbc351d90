// Crash-safe replacement of files and directories (see include/megatrain/io/detail/atomic_files.hpp).
#include "megatrain/io/detail/atomic_files.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <random>
#include <system_error>
#include <utility>

#include "megatrain/core/digest.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/fault_injection.hpp"
#include "megatrain/core/log.hpp"

namespace megatrain::io::detail {

namespace fs = std::filesystem;

std::string errno_text(int e) { return std::generic_category().message(e); }

std::string random_suffix() {
  static thread_local std::mt19937_64 rng{std::random_device{}() ^ (static_cast<std::uint64_t>(::getpid()) << 32)};
  return fmt::format("{:08x}", static_cast<std::uint32_t>(rng()));
}

void fsync_directory(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  MT_CHECK(fd >= 0, "cannot open directory '{}' to sync it: {}", dir.string(), errno_text(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  MT_CHECK(rc == 0, "cannot sync directory '{}': {}", dir.string(), errno_text(err));
}

namespace {

/// Whether `path` still names the object open as `fd` (a cleaner may have removed it between
/// our creating it and our locking it).
bool still_named(const fs::path& path, int fd) {
  struct stat a {}, b {};
  if (::fstat(fd, &a) != 0 || a.st_nlink == 0) return false;
  if (::lstat(path.c_str(), &b) != 0) return false;
  return a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

/// Debris kinds, by the suffix a writer gives them.
enum class Debris { partial, old, trash };
constexpr std::pair<std::string_view, Debris> kDebris[] = {
    {".partial-", Debris::partial}, {".old-", Debris::old}, {".trash-", Debris::trash}};

/// If `name` is `<base><suffix><8 hex>`, its base and kind.
std::optional<std::pair<std::string, Debris>> parse_debris(std::string_view name) {
  if (name.size() < 9) return std::nullopt;
  const std::string_view hex = name.substr(name.size() - 8);
  if (!std::all_of(hex.begin(), hex.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); }))
    return std::nullopt;
  const std::string_view head = name.substr(0, name.size() - 8);
  for (const auto& [suffix, kind] : kDebris)
    if (head.size() > suffix.size() && head.ends_with(suffix))
      return std::pair{std::string(head.substr(0, head.size() - suffix.size())), kind};
  return std::nullopt;
}

/// Removes a file or a flat directory at `path` (whichever it is).
void remove_entry(const fs::path& path) {
  std::error_code ec;
  if (fs::is_directory(fs::symlink_status(path, ec))) remove_flat_directory(path);
  else fs::remove(path, ec);
}

/// Handles one debris entry if nobody holds its lock; returns whether it did something.
bool clean_one(const fs::path& parent, const std::string& name, const std::string& base, Debris kind) {
  const fs::path path = parent / name;
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return false;  // gone meanwhile, or not ours to open
  bool done = false;
  if (::flock(fd, LOCK_EX | LOCK_NB) == 0 && still_named(path, fd)) {  // its writer is dead
    std::error_code ec;
    const fs::path target = parent / base;
    if (kind == Debris::old && !fs::exists(fs::symlink_status(target, ec))) {
      // A crash between the two renames of a replacement: the previous version is complete.
      done = ::rename(path.c_str(), target.c_str()) == 0;
      if (done) fsync_directory(parent);
    } else {
      remove_entry(path);
      done = true;
    }
  }
  ::close(fd);
  return done;
}

std::vector<std::string> clean(const fs::path& parent, const std::string* only_base) {
  std::vector<std::pair<std::string, std::pair<std::string, Debris>>> found;
  std::error_code ec;
  for (fs::directory_iterator it(parent, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    auto d = parse_debris(name);
    if (!d || (only_base != nullptr && d->first != *only_base)) continue;
    found.emplace_back(name, std::move(*d));
  }
  // Partial entries first: where a crash left both halves of a replacement, the old one is put
  // back after the new one is gone.
  std::stable_sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.second.second < b.second.second; });
  std::vector<std::string> handled;
  for (const auto& [name, d] : found)
    if (clean_one(parent, name, d.first, d.second)) handled.push_back(name);
  if (!handled.empty()) {
    try {
      fsync_directory(parent);
    } catch (const Error& e) {
      log_warning("{}", e.reason());
    }
  }
  return handled;
}

}  // namespace

std::vector<std::string> remove_debris(const fs::path& target) {
  fs::path t = target;
  if (t.filename().empty()) t = t.parent_path();
  const std::string base = t.filename().string();
  const fs::path parent = t.has_parent_path() ? t.parent_path() : fs::path(".");
  return clean(parent, &base);
}

std::vector<std::string> remove_debris_in(const fs::path& dir) { return clean(dir, nullptr); }

std::string read_file(const fs::path& p, std::uintmax_t max_bytes) {
  std::error_code ec;
  const auto size = fs::file_size(p, ec);
  MT_CHECK(!ec, "cannot read '{}': {}", p.string(), ec.message());
  MT_CHECK(size <= max_bytes, "'{}' is {} bytes, larger than the {} accepted", p.string(), size, max_bytes);
  std::ifstream in(p, std::ios::binary);
  MT_CHECK(in.good(), "cannot open '{}'", p.string());
  std::string s(static_cast<std::size_t>(size), '\0');
  in.read(s.data(), static_cast<std::streamsize>(s.size()));
  MT_CHECK(in.good() || (in.eof() && static_cast<std::uintmax_t>(in.gcount()) == size), "cannot read '{}'", p.string());
  return s;
}

// ---- OutputFile -----------------------------------------------------------------------------------

namespace {
constexpr std::size_t kBufferBytes = 1u << 20;
}

OutputFile::OutputFile(fs::path path, Hasher* hasher) : path_(std::move(path)), hasher_(hasher) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  MT_CHECK(fd_ >= 0, "cannot create '{}': {}", path_.string(), errno_text(errno));
  buffer_.reserve(kBufferBytes);
}

OutputFile::OutputFile(fs::path path, int fd, Hasher* hasher) : path_(std::move(path)), fd_(fd), hasher_(hasher) {
  buffer_.reserve(kBufferBytes);
}

std::unique_ptr<OutputFile> OutputFile::partial_for(const fs::path& target, Hasher* hasher) {
  for (int attempt = 0;; ++attempt) {
    fs::path path = target;
    path += ".partial-" + random_suffix();
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0) {
      MT_CHECK(errno == EEXIST && attempt < 100, "cannot create '{}': {}", path.string(), errno_text(errno));
      continue;
    }
    if (::flock(fd, LOCK_EX) == 0 && still_named(path, fd)) return std::unique_ptr<OutputFile>(new OutputFile(path, fd, hasher));
    ::close(fd);  // a cleaner took it for a dead writer's: start again under another name
    MT_CHECK(attempt < 100, "cannot create a temporary file beside '{}'", target.string());
  }
}

OutputFile::~OutputFile() {
  if (!committed_) ::unlink(path_.c_str());
  if (fd_ >= 0) ::close(fd_);
}

void OutputFile::write(std::span<const std::byte> bytes) {
  if (hasher_ != nullptr) hasher_->update(bytes);
  size_ += bytes.size();
  if (buffer_.size() + bytes.size() <= kBufferBytes) {
    buffer_.insert(buffer_.end(), bytes.begin(), bytes.end());
    return;
  }
  flush();
  if (bytes.size() >= kBufferBytes) write_through(bytes);
  else buffer_.insert(buffer_.end(), bytes.begin(), bytes.end());
}

void OutputFile::write(std::string_view s) { write(std::as_bytes(std::span<const char>(s.data(), s.size()))); }

void OutputFile::finish() {
  flush();
  MT_CHECK(::fsync(fd_) == 0, "cannot sync '{}': {}", path_.string(), errno_text(errno));
}

void OutputFile::flush() {
  write_through(buffer_);
  buffer_.clear();
}

void OutputFile::write_through(std::span<const std::byte> bytes) {
  const std::byte* p = bytes.data();
  std::size_t left = bytes.size();
  if (left > 0)
    if (const int e = fault::write_failure(); e != 0) MT_FAIL("cannot write '{}': {}", path_.string(), errno_text(e));
  while (left > 0) {
    const ::ssize_t w = ::write(fd_, p, std::min<std::size_t>(left, std::size_t{1} << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      MT_FAIL("cannot write '{}': {}", path_.string(), errno_text(errno));
    }
    MT_CHECK(w > 0, "cannot write '{}': the write made no progress", path_.string());
    p += w;
    left -= static_cast<std::size_t>(w);
  }
}

// ---- directories ------------------------------------------------------------------------------

StagingDirectory::StagingDirectory(const fs::path& target) {
  for (int attempt = 0;; ++attempt) {
    path_ = target;
    path_ += ".partial-" + random_suffix();
    if (::mkdir(path_.c_str(), 0777) != 0) {
      MT_CHECK(errno == EEXIST && attempt < 100, "cannot create '{}': {}", path_.string(), errno_text(errno));
      continue;
    }
    fd_ = ::open(path_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    MT_CHECK(fd_ >= 0, "cannot open '{}': {}", path_.string(), errno_text(errno));
    if (::flock(fd_, LOCK_EX) == 0 && still_named(path_, fd_)) return;
    ::close(fd_);  // a cleaner took it for a dead writer's: start again under another name
    fd_ = -1;
    MT_CHECK(attempt < 100, "cannot create a staging directory beside '{}'", target.string());
  }
}

StagingDirectory::~StagingDirectory() {
  if (!released_) remove_flat_directory(path_);
  if (fd_ >= 0) ::close(fd_);
}

void remove_flat_directory(const fs::path& dir) {
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(dir, ec))) return;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->is_directory(ec) && !it->is_symlink(ec)) continue;
    fs::remove(it->path(), ec);
  }
  if (!fs::remove(dir, ec) || ec)
    log_warning("could not remove the directory '{}' ({}); delete it by hand", dir.string(),
                ec ? ec.message() : std::string("not empty"));
}

void retire_directory(const fs::path& dir) {
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(dir, ec))) return;
  fs::path trash;
  for (int attempt = 0;; ++attempt) {
    trash = dir;
    trash += ".trash-" + random_suffix();
    if (!fs::exists(fs::symlink_status(trash, ec))) break;
    MT_CHECK(attempt < 100, "cannot find a free name beside '{}'", dir.string());
  }
  MT_CHECK(::rename(dir.c_str(), trash.c_str()) == 0, "cannot rename '{}' to '{}': {}", dir.string(), trash.string(),
           errno_text(errno));
  fsync_directory(dir.parent_path().empty() ? fs::path(".") : dir.parent_path());
  fault::crash_point("retire");
  remove_flat_directory(trash);
}

fs::path replace_directory(const fs::path& staged, const fs::path& target, bool allow_exchange) {
  const fs::path parent = target.parent_path();
  struct stat st {};
  if (::lstat(target.c_str(), &st) != 0) {
    MT_CHECK(errno == ENOENT, "cannot stat '{}': {}", target.string(), errno_text(errno));
    MT_CHECK(::rename(staged.c_str(), target.c_str()) == 0, "cannot rename '{}' to '{}': {}", staged.string(),
             target.string(), errno_text(errno));
    fsync_directory(parent);
    return {};
  }
  // The previous directory stays locked until our process ends or we close this: whatever name
  // it passes through, no cleaner takes it for a dead writer's.
  const int old_fd = ::open(target.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  MT_CHECK(old_fd >= 0, "cannot open '{}': {}", target.string(), errno_text(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{old_fd};
  MT_CHECK(::flock(old_fd, LOCK_EX) == 0, "cannot lock '{}': {}", target.string(), errno_text(errno));
#ifdef RENAME_EXCHANGE
  if (allow_exchange) {
    if (::renameat2(AT_FDCWD, staged.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0) {
      fsync_directory(parent);
      return staged;  // now holds the previous contents of target
    }
    MT_CHECK(errno == EINVAL || errno == ENOSYS || errno == ENOTSUP || errno == EOPNOTSUPP,
             "cannot exchange '{}' and '{}': {}", staged.string(), target.string(), errno_text(errno));
  }
#else
  (void)allow_exchange;
#endif
  // Two renames. Between them there is no `target`; both directories are complete.
  fs::path old;
  std::error_code ec;
  for (int attempt = 0;; ++attempt) {
    old = target;
    old += ".old-" + random_suffix();
    if (!fs::exists(fs::symlink_status(old, ec))) break;
    MT_CHECK(attempt < 100, "cannot find a free name beside '{}'", target.string());
  }
  MT_CHECK(::rename(target.c_str(), old.c_str()) == 0, "cannot rename '{}' to '{}': {}", target.string(),
           old.string(), errno_text(errno));
  // Halfway: complete the swap whatever happens, so that `target` is missing for a moment only.
  try {
    fsync_directory(parent);
  } catch (const Error& e) {
    log_warning("{}", e.reason());
  }
  fault::crash_point("replace:halfway");
  if (::rename(staged.c_str(), target.c_str()) != 0) {
    const int err = errno;
    const bool restored = ::rename(old.c_str(), target.c_str()) == 0;
    MT_FAIL("cannot rename '{}' to '{}': {}{}", staged.string(), target.string(), errno_text(err),
            restored ? std::string(" (the previous directory was put back)")
                     : fmt::format(" (the previous directory is now '{}')", old.string()));
  }
  fsync_directory(parent);
  return old;
}

void OutputFile::rename_to(const fs::path& target) {
  MT_CHECK(::rename(path_.c_str(), target.c_str()) == 0, "cannot rename '{}' to '{}': {}", path_.string(), target.string(),
           errno_text(errno));
  keep();
}

void write_file_atomically(const fs::path& path, std::string_view contents) {
  remove_debris(path);
  const auto out = OutputFile::partial_for(path);
  out->write(contents);
  out->finish();
  out->rename_to(path);
  fsync_directory(path.has_parent_path() ? path.parent_path() : fs::path("."));
}

}  // namespace megatrain::io::detail
