// How megatrain's writers replace files and directories so that a crash at any moment leaves
// either the old version or the new one, and never debris that a later writer trips over.
//
// A writer stages its output beside the target, under `<target>.partial-<8 hex digits>`, and
// holds an exclusive flock(2) on it for as long as it lives; it fsyncs what it wrote, renames the
// staged entry into place and fsyncs the parent. Replaced directories pass through
// `<target>.old-<hex>` (the two-rename fallback), removed ones through `<target>.trash-<hex>`.
// The kernel drops a flock when its holder dies (kill -9 included), so an entry with one of these
// names that nobody holds a lock on was left by a dead writer: every writer removes such entries
// of its target before it starts (an `.old-` one is put back when the target itself is missing:
// the crash came between the two renames), and never touches an entry whose lock is held.
//
// A creator takes its lock right after creating the entry; a cleaner that wins the race for
// that lock removes the entry while holding it, and the creator, once it has its lock, sees that
// its entry is gone and starts again under a new name. So a live writer's files are never removed.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace megatrain {
class Hasher;
}

namespace megatrain::io::detail {

std::string errno_text(int e);
/// 8 random lowercase hex digits.
std::string random_suffix();
/// fsync(2) on a directory (makes renames and new entries inside it durable).
void fsync_directory(const std::filesystem::path& dir);

/// A file being written: created exclusively, buffered and checked writes, optionally hashed.
/// finish() flushes and fsyncs; the descriptor (and a partial file's lock) stay until
/// destruction. Destroyed without keep(), the file is removed.
class OutputFile {
 public:
  /// Creates `path` (it must not exist), unlocked: for files inside a locked staging directory.
  explicit OutputFile(std::filesystem::path path, Hasher* hasher = nullptr);
  /// Creates a fresh `<target>.partial-<hex>` beside `target`, locked (see the top of this file).
  static std::unique_ptr<OutputFile> partial_for(const std::filesystem::path& target, Hasher* hasher = nullptr);
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;
  ~OutputFile();

  const std::filesystem::path& path() const { return path_; }
  void write(std::span<const std::byte> bytes);
  void write(std::string_view s);
  /// Bytes written so far.
  std::uint64_t size() const { return size_; }
  /// Flushes and fsyncs.
  void finish();
  /// The file is no longer ours to remove (it was renamed into place, or belongs to a directory
  /// that is).
  void keep() { committed_ = true; }
  /// Renames the (finished) file to `target`, replacing it atomically, and keeps it.
  void rename_to(const std::filesystem::path& target);

 private:
  OutputFile(std::filesystem::path path, int fd, Hasher* hasher);
  void flush();
  void write_through(std::span<const std::byte> bytes);

  std::filesystem::path path_;
  int fd_ = -1;
  bool committed_ = false;
  Hasher* hasher_ = nullptr;
  std::uint64_t size_ = 0;
  std::vector<std::byte> buffer_;
};

/// A staging directory `<target>.partial-<hex>`, locked for its lifetime, removed (with the files
/// put in it) unless released.
class StagingDirectory {
 public:
  explicit StagingDirectory(const std::filesystem::path& target);
  StagingDirectory(const StagingDirectory&) = delete;
  StagingDirectory& operator=(const StagingDirectory&) = delete;
  ~StagingDirectory();
  const std::filesystem::path& path() const { return path_; }
  /// It was renamed into place: do not remove it (the lock is kept until destruction).
  void release() { released_ = true; }

 private:
  std::filesystem::path path_;
  int fd_ = -1;
  bool released_ = false;
};

/// Puts directory `staged` at `target` and returns where the previous `target` now is (empty if
/// there was none); the caller deletes it. With renameat2(RENAME_EXCHANGE) in one atomic step
/// where the file system supports it, else by renaming `target` to `<target>.old-<hex>` (locked
/// meanwhile) and `staged` to `target`. `allow_exchange` false forces the fallback (for tests).
std::filesystem::path replace_directory(const std::filesystem::path& staged, const std::filesystem::path& target,
                                        bool allow_exchange);

/// Removes a directory that holds only files; never recurses (a subdirectory is left, with a
/// warning). Missing: nothing to do.
void remove_flat_directory(const std::filesystem::path& dir);

/// Removes a directory of files crash-safely: renamed to `<dir>.trash-<hex>` first (so that a
/// crash never leaves a half-removed directory under its name), then removed.
void retire_directory(const std::filesystem::path& dir);

/// Removes what dead writers of `target` left beside it (`.partial-`, `.old-`, `.trash-`
/// entries nobody holds a lock on); puts an `.old-` directory back when `target` is missing.
/// Returns the names removed or restored.
std::vector<std::string> remove_debris(const std::filesystem::path& target);

/// remove_debris for every target inside `dir` (a folder that one writer manages).
std::vector<std::string> remove_debris_in(const std::filesystem::path& dir);

/// The whole content of the file `path`; throws naming it where it cannot be read or is larger
/// than `max_bytes`.
std::string read_file(const std::filesystem::path& path, std::uintmax_t max_bytes = UINTMAX_MAX);

/// Replaces the file `path` with `contents` atomically (staged, fsynced, renamed, parent fsynced).
void write_file_atomically(const std::filesystem::path& path, std::string_view contents);

}  // namespace megatrain::io::detail
