// metrics.jsonl: one JSON object a line, appended as a run goes, never a torn line.
//
// Each line is appended with one write(2) and checked. A write that fails (a full disk, a
// file-size limit) or writes only part of the line is undone: the file is cut back to its length
// before it, and the line is kept as pending. The caller decides what then happens (stop with a
// checkpoint, or go on); pending lines are written first by the next append that succeeds, so
// the file holds every step once, in order, whenever it can be written at all. A run resumed
// from a checkpoint starts by dropping the lines of steps after the checkpoint (and any line a
// crash tore), atomically.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace megatrain::io {

class MetricsLog {
 public:
  MetricsLog() = default;
  /// Opens `path` to append to it, creating it where missing. `keep_through` >= 0: first rewrite
  /// it (atomically) keeping only the lines whose "step" is at most that (a resumed run); < 0:
  /// start it empty (a new run). Throws megatrain::Error naming the file where that fails.
  MetricsLog(std::filesystem::path path, std::int64_t keep_through);
  MetricsLog(MetricsLog&&) noexcept;
  MetricsLog& operator=(MetricsLog&&) noexcept;
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;
  ~MetricsLog();

  const std::filesystem::path& path() const { return path_; }
  /// Appends `line` (no newline: one is added) after any pending lines. Returns the empty string
  /// when every line is in the file; else why not (the file is as it was before this call, and
  /// the lines not written are pending).
  std::string append(const std::string& line);
  /// Lines not yet in the file, oldest first.
  const std::vector<std::string>& pending() const { return pending_; }
  /// The highest "step" of the lines the file held when opened (0: none).
  std::int64_t kept_through() const { return kept_through_; }

 private:
  std::string write_line(const std::string& line);
  std::filesystem::path path_;
  int fd_ = -1;
  std::vector<std::string> pending_;
  std::int64_t kept_through_ = 0;
};

/// The "step" of a metrics line, or -1 where it has none.
std::int64_t metrics_step(const std::string& line);

/// The lines of a metrics file whose "step" is at most `step`, each with its newline; lines that
/// are not JSON objects with a whole "step" (a line torn by a crash) are left out.
std::string metrics_through(const std::filesystem::path& path, std::int64_t step);

}  // namespace megatrain::io
