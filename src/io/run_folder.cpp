// A run folder's lock, its claim and the replacement of a previous run (io/run_folder.hpp).
#include "megatrain/io/run_folder.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <ctime>
#include <system_error>

#include "megatrain/core/error.hpp"
#include "megatrain/core/log.hpp"
#include "megatrain/io/detail/atomic_files.hpp"

namespace megatrain::io {

namespace fs = std::filesystem;
using detail::errno_text;

namespace {

std::string utc_now() {
  char buf[32];
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return buf;
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "unknown";
  return buf;
}

std::string read_all(int fd) {
  std::string text;
  char buf[4096];
  ::lseek(fd, 0, SEEK_SET);
  for (;;) {
    const ::ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buf, static_cast<std::size_t>(n));
    if (text.size() > 65536) break;
  }
  return text;
}

// The holder a lock file names, in words.
std::string describe_holder(const std::string& text) {
  try {
    const auto j = nlohmann::json::parse(text);
    return fmt::format("process {} on host {} ({}, since {})", j.at("pid").get<long long>(), j.at("host").get<std::string>(),
                       j.at("program").get<std::string>(), j.at("since").get<std::string>());
  } catch (const nlohmann::json::exception&) {
    return "another process";
  }
}

// a is b or lies inside it (both absolute and normal).
bool within(const fs::path& a, const fs::path& b) {
  return std::mismatch(b.begin(), b.end(), a.begin(), a.end()).first == b.end();
}

fs::path resolved(const fs::path& p) {
  std::error_code ec;
  fs::path r = fs::weakly_canonical(fs::absolute(p), ec);
  if (ec) r = fs::absolute(p).lexically_normal();
  return r.has_filename() ? r : r.parent_path();
}

}  // namespace

std::string new_run_id() { return detail::random_suffix() + detail::random_suffix(); }

void write_run_file(const fs::path& path, std::string_view contents) { detail::write_file_atomically(path, contents); }

bool holds_run(const fs::path& dir) {
  std::error_code ec;
  if (fs::exists(dir / "metrics.jsonl", ec) && fs::file_size(dir / "metrics.jsonl", ec) > 0) return true;
  const fs::path c = dir / "checkpoints";
  if (!fs::is_directory(c, ec)) return false;
  return fs::directory_iterator(c, ec) != fs::directory_iterator();
}

// ---- RunLock --------------------------------------------------------------------------------------

RunLock RunLock::take(const fs::path& dir, const std::string& program) {
  const fs::path file = dir / kRunLockFile;
  const int fd = ::open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  MT_CHECK(fd >= 0, "cannot open the run folder's lock '{}': {}", file.string(), errno_text(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    const std::string text = read_all(fd);
    ::close(fd);
    MT_CHECK(err == EWOULDBLOCK, "cannot lock the run folder's lock '{}': {}", file.string(), errno_text(err));
    MT_FAIL("the run folder '{}' is in use by {}: one process trains in a run folder at a time; wait for it to end, "
            "stop it, or choose another folder",
            dir.string(), text.empty() ? std::string("another process, which has just started") : describe_holder(text));
  }
  RunLock lock;
  lock.fd_ = fd;
  if (const std::string text = read_all(fd); !text.empty()) lock.taken_over_ = describe_holder(text);
  const std::string me = nlohmann::json{{"pid", static_cast<long long>(::getpid())},
                                        {"host", host_name()},
                                        {"program", program},
                                        {"since", utc_now()}}.dump() + "\n";
  const bool written = ::ftruncate(fd, 0) == 0 && ::pwrite(fd, me.data(), me.size(), 0) == static_cast<::ssize_t>(me.size());
  if (!written) {
    const int err = errno;
    lock.release();
    MT_FAIL("cannot write the run folder's lock '{}': {}", file.string(), errno_text(err));
  }
  return lock;
}

RunLock::RunLock(RunLock&& o) noexcept : fd_(std::exchange(o.fd_, -1)), taken_over_(std::move(o.taken_over_)) {}

RunLock& RunLock::operator=(RunLock&& o) noexcept {
  if (this != &o) {
    release();
    fd_ = std::exchange(o.fd_, -1);
    taken_over_ = std::move(o.taken_over_);
  }
  return *this;
}

RunLock::~RunLock() { release(); }

void RunLock::release() {
  if (fd_ < 0) return;
  (void)!::ftruncate(fd_, 0);
  ::close(fd_);
  fd_ = -1;
}

// ---- RunFolder ------------------------------------------------------------------------------------

RunFolder RunFolder::claim(const fs::path& dir, const RunClaimOptions& o) {
  MT_CHECK(!dir.empty(), "{} is empty: give the folder for the run", o.option);
  std::error_code ec;
  const auto st = fs::status(dir, ec);
  MT_CHECK(!fs::exists(st) || fs::is_directory(st), "{} '{}' is a file, not a folder: give a folder for the run (it is "
           "created where missing)", o.option, dir.string());
  if (o.resume)
    MT_CHECK(fs::is_directory(st), "{} '{}': no such run folder", o.option, dir.string());
  RunFolder f;
  f.path_ = dir;
  if (!fs::exists(st)) {
    fs::create_directories(dir, ec);
    MT_CHECK(!ec, "{} '{}': cannot create the folder: {}", o.option, dir.string(), ec.message());
    f.created_ = true;
  }
  const auto take = [&] {
    try {
      return RunLock::take(dir, o.program);
    } catch (const Error& e) {
      MT_FAIL("{}: {}", o.option, e.reason());
    }
  };
  f.lock_ = take();
  f.taken_over_ = f.lock_.taken_over_from();
  if (o.resume || !holds_run(dir)) return f;
  MT_CHECK(o.overwrite, "{} '{}' already holds a run (metrics.jsonl or checkpoints); continue it with --resume, choose "
           "another {}, or pass --overwrite to replace it", o.option, dir.string(), o.option);

  // --overwrite: refused where the move could lose something the user has; then one rename.
  MT_CHECK(!fs::is_symlink(fs::symlink_status(dir, ec)), "--overwrite: {} '{}' is a symbolic link; give the folder it "
           "points to", o.option, dir.string());
  const fs::path me = resolved(dir);
  MT_CHECK(me.has_parent_path() && me != me.root_path(), "--overwrite: {} '{}' cannot be moved aside", o.option,
           dir.string());
  MT_CHECK(!within(resolved(fs::current_path(ec)), me), "--overwrite: {} '{}' holds the current folder, which cannot be "
           "moved aside; run from elsewhere or choose another {}", o.option, dir.string(), o.option);
  for (const fs::path& in : o.inputs)
    MT_CHECK(in.empty() || !within(resolved(in), me), "--overwrite would move aside '{}', which this run reads, with the "
             "previous run in {} '{}': move it out of the run folder first, or choose another {}", in.string(), o.option,
             dir.string(), o.option);
  fs::path aside;
  for (int attempt = 0;; ++attempt) {
    aside = me;
    aside += ".replaced-" + detail::random_suffix();
    if (!fs::exists(fs::symlink_status(aside, ec))) break;
    MT_CHECK(attempt < 100, "--overwrite: cannot find a free name beside '{}'", dir.string());
  }
  MT_CHECK(::rename(me.c_str(), aside.c_str()) == 0, "--overwrite: cannot move the previous run '{}' aside to '{}': {}",
           dir.string(), aside.string(), errno_text(errno));
  f.lock_.release();  // (the previous run's lock went with it: nobody can start there now)
  detail::fsync_directory(me.parent_path());
  if (::mkdir(me.c_str(), 0777) != 0) {
    const int err = errno;
    const bool back = ::rename(aside.c_str(), me.c_str()) == 0;
    MT_FAIL("--overwrite: cannot create the new run folder '{}': {}{}", dir.string(), errno_text(err),
            back ? std::string(" (the previous run was put back)")
                 : fmt::format(" (the previous run is now '{}')", aside.string()));
  }
  f.replaced_ = aside;
  f.created_ = true;
  f.lock_ = take();
  return f;
}

RunFolder RunFolder::claim_new(const fs::path& parent, const RunClaimOptions& o) {
  std::error_code ec;
  fs::create_directories(parent, ec);
  MT_CHECK(!ec, "cannot create the folder for runs '{}': {}", parent.string(), ec.message());
  char stamp[32];
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", &local);
  for (int n = 1;; ++n) {
    const fs::path dir = parent / (n == 1 ? std::string(stamp) : fmt::format("{}-{}", stamp, n));
    if (::mkdir(dir.c_str(), 0777) == 0) {
      RunClaimOptions mine = o;
      mine.overwrite = mine.resume = false;
      RunFolder f = claim(dir, mine);
      f.created_ = true;
      return f;
    }
    MT_CHECK(errno == EEXIST && n < 1000, "cannot create the run folder '{}': {}", dir.string(), errno_text(errno));
  }
}

RunFolder::RunFolder(RunFolder&& o) noexcept
    : path_(std::exchange(o.path_, {})), lock_(std::move(o.lock_)), replaced_(std::exchange(o.replaced_, std::nullopt)),
      taken_over_(std::move(o.taken_over_)), created_(o.created_), started_(o.started_) {}

RunFolder::~RunFolder() {
  if (path_.empty() || started_) return;
  try {
    if (replaced_) {
      if (restore_replaced()) log_info("--overwrite: the run stopped before its first step; the previous run is back in '{}'",
                                       path_.string());
    } else if (created_) {  // (removed where it holds nothing but its lock: prepared data is kept)
      std::error_code ec;
      bool only_lock = true;
      for (fs::directory_iterator it(path_, ec), end; !ec && it != end; it.increment(ec))
        only_lock = only_lock && it->path().filename() == kRunLockFile;
      lock_.release();
      if (only_lock && !ec) fs::remove_all(path_, ec);
    }
  } catch (...) {  // (a destructor: what could not be undone stays, as it is)
  }
}

fs::path RunFolder::drop_replaced() {
  if (!replaced_) return {};
  const fs::path gone = *replaced_;
  replaced_.reset();
  std::error_code ec;
  fs::remove_all(gone, ec);
  if (ec) log_warning("could not remove the previous run '{}' ({}); delete it by hand", gone.string(), ec.message());
  return gone;
}

bool RunFolder::restore_replaced() {
  if (!replaced_) return false;
  const fs::path aside = *replaced_;
  lock_.release();
  std::error_code ec;
  fs::remove_all(path_, ec);
  if (ec || ::rename(aside.c_str(), path_.c_str()) != 0) {
    log_warning("could not put the previous run back from '{}' to '{}'; it is still in '{}'", aside.string(),
                path_.string(), aside.string());
    return false;
  }
  replaced_.reset();
  return true;
}

}  // namespace megatrain::io
