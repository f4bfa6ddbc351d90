// A run's folder belongs to one process at a time.
//
// A run folder (metrics.jsonl, checkpoints/, report.html, ...) is written by the one process that
// claimed it. The claim is an advisory lock, flock(2) on `<run>/run.lock`, held for the run's
// life; the file names its holder (pid, host, program, start time). A second run, or a second
// resume, of the same folder is refused at once, naming the holder. The kernel drops the lock
// when its holder dies (kill -9 included), so a lock file that still names a holder but that
// nobody holds was left by a process that is gone: the next claim takes it over and says so.
//
// `--overwrite` replaces a whole previous run. Its folder is moved aside first, to
// `<run>.replaced-<8 hex digits>` beside it (one rename: nothing is deleted yet), and a fresh
// folder is made. The previous run is removed only once the new one has something to show for
// it (its first checkpoint, or its end); a new run that fails before its first step puts the
// previous one back (and a run refused before it wrote anything leaves no folder behind). A replacement that cannot be done safely is refused before anything moves:
// a folder another process holds, a symbolic link, a folder that holds no run, or one that holds
// the new run's own inputs.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace megatrain::io {

/// The file that holds a run folder's lock.
inline constexpr const char* kRunLockFile = "run.lock";

/// A new run's identity (kept in its checkpoints and exports' megatrain_export.json): 16 random
/// hex digits.
std::string new_run_id();

/// Replaces a small file of a run folder (config.json, options.json) atomically: staged beside
/// it, fsynced, renamed. Throws naming the file where that fails.
void write_run_file(const std::filesystem::path& path, std::string_view contents);

/// Whether `dir` holds a run: a metrics.jsonl with a line in it, or a checkpoints/ folder with
/// anything in it.
bool holds_run(const std::filesystem::path& dir);

/// An exclusive flock(2) on `<dir>/run.lock`, naming its holder in the file; released (and the
/// file emptied) on destruction.
class RunLock {
 public:
  RunLock() = default;
  /// Takes the lock of `dir` (which must exist); throws megatrain::Error naming the holder when
  /// another process holds it. `program` names this process in the file.
  static RunLock take(const std::filesystem::path& dir, const std::string& program);
  RunLock(RunLock&& o) noexcept;
  RunLock& operator=(RunLock&& o) noexcept;
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;
  ~RunLock();

  bool held() const { return fd_ >= 0; }
  /// The holder a previous process left in the file without releasing it (it died), as words;
  /// empty when the lock was free and clean.
  const std::string& taken_over_from() const { return taken_over_; }
  /// Releases the lock, emptying the file first (a clean end leaves nothing to take over).
  void release();

 private:
  int fd_ = -1;
  std::string taken_over_;
};

struct RunClaimOptions {
  std::string program = "megatrain-train";  ///< written in the lock file
  /// Continue the run the folder holds (it must exist).
  bool resume = false;
  /// Replace the run the folder holds (see the top of this file).
  bool overwrite = false;
  /// Paths this run reads (its data, model, tokenizer, the checkpoint it starts from): an
  /// overwrite that would move one of them aside is refused.
  std::vector<std::filesystem::path> inputs;
  /// The option that named the folder, for messages ("--out").
  std::string option = "--out";
};

/// A run folder claimed by this process (see the top of this file).
class RunFolder {
 public:
  RunFolder() = default;
  /// Claims `dir` (created where missing). Throws megatrain::Error, before anything moves, where
  /// `dir` is a file, holds a run (unless resume or overwrite), is held by another process, or
  /// cannot be replaced safely.
  static RunFolder claim(const std::filesystem::path& dir, const RunClaimOptions& options);
  /// A new folder `<parent>/<YYYYmmdd-HHMMSS>` (then -2, -3, ... where that exists), claimed.
  static RunFolder claim_new(const std::filesystem::path& parent, const RunClaimOptions& options);
  RunFolder(RunFolder&& o) noexcept;
  RunFolder& operator=(RunFolder&&) = delete;
  ~RunFolder();

  const std::filesystem::path& path() const { return path_; }
  const RunLock& lock() const { return lock_; }
  /// The holder of the folder's lock that died without releasing it (as words), or empty.
  const std::string& taken_over_from() const { return taken_over_; }
  /// Where the previous run was moved by an overwrite, until it is removed or put back.
  const std::optional<std::filesystem::path>& replaced() const { return replaced_; }
  /// The new run has something to show (a checkpoint, its end): removes the previous run.
  /// Returns what was removed (empty: nothing was waiting).
  std::filesystem::path drop_replaced();
  /// The run has trained a step: from now on its folder is kept whatever happens. Until then, a
  /// RunFolder destroyed (the run refused or stopped before its first step) undoes its claim: a
  /// run it replaced is put back; a folder it created is removed where it holds nothing but the
  /// lock (data prepared into it is kept for the next run).
  void mark_started() { started_ = true; }
  bool started() const { return started_; }

 private:
  bool restore_replaced();
  std::filesystem::path path_;
  RunLock lock_;
  std::optional<std::filesystem::path> replaced_;
  std::string taken_over_;
  bool created_ = false, started_ = false;
};

}  // namespace megatrain::io
