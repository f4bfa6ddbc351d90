// metrics.jsonl, appended without torn lines (io/metrics_log.hpp).
#include "megatrain/io/metrics_log.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <utility>

#include "megatrain/core/error.hpp"
#include "megatrain/core/fault_injection.hpp"
#include "megatrain/io/detail/atomic_files.hpp"

namespace megatrain::io {

namespace fs = std::filesystem;

std::int64_t metrics_step(const std::string& line) {
  try {
    const auto j = nlohmann::json::parse(line);
    if (j.is_object() && j.contains("step") && j["step"].is_number_integer()) return j["step"].get<std::int64_t>();
  } catch (const nlohmann::json::exception&) {
  }
  return -1;
}

std::string metrics_through(const fs::path& path, std::int64_t step) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return {};
  std::ifstream in(path);
  MT_CHECK(in.good(), "cannot read '{}'", path.string());
  std::string line, kept;
  while (std::getline(in, line)) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception&) {
      continue;  // a line torn by a crash
    }
    if (j.is_object() && j.contains("step") && j["step"].is_number_integer() && j["step"].get<std::int64_t>() <= step)
      kept += line + "\n";
  }
  return kept;
}

MetricsLog::MetricsLog(fs::path path, std::int64_t keep_through) : path_(std::move(path)) {
  {
    const fault::WriteScope scope("metrics");
    const std::string kept = keep_through >= 0 ? metrics_through(path_, keep_through) : std::string();
    for (std::size_t at = 0; at < kept.size();) {
      const std::size_t end = kept.find('\n', at);
      kept_through_ = std::max(kept_through_, metrics_step(kept.substr(at, end - at)));
      at = end == std::string::npos ? kept.size() : end + 1;
    }
    detail::write_file_atomically(path_, kept);
  }
  fd_ = ::open(path_.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  MT_CHECK(fd_ >= 0, "cannot open '{}' to append to it: {}", path_.string(), detail::errno_text(errno));
}

MetricsLog::MetricsLog(MetricsLog&& o) noexcept
    : path_(std::move(o.path_)), fd_(std::exchange(o.fd_, -1)), pending_(std::move(o.pending_)),
      kept_through_(o.kept_through_) {}

MetricsLog& MetricsLog::operator=(MetricsLog&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(o.path_);
    fd_ = std::exchange(o.fd_, -1);
    pending_ = std::move(o.pending_);
    kept_through_ = o.kept_through_;
  }
  return *this;
}

MetricsLog::~MetricsLog() {
  if (fd_ >= 0) ::close(fd_);
}

std::string MetricsLog::append(const std::string& line) {
  pending_.push_back(line);
  while (!pending_.empty()) {
    if (std::string error = write_line(pending_.front()); !error.empty()) return error;
    pending_.erase(pending_.begin());
  }
  return {};
}

std::string MetricsLog::write_line(const std::string& line) {
  MT_CHECK(fd_ >= 0, "MetricsLog: not open");
  const fault::WriteScope scope("metrics");
  struct stat st {};
  if (::fstat(fd_, &st) != 0) return fmt::format("cannot write '{}': {}", path_.string(), detail::errno_text(errno));
  const std::string data = line + "\n";
  const auto undo = [&](int err) {
    (void)!::ftruncate(fd_, st.st_size);  // (no torn line: the file as it was)
    return fmt::format("cannot write '{}': {}", path_.string(), detail::errno_text(err));
  };
  if (const int e = fault::write_failure(); e != 0) return undo(e);
  std::size_t done = 0;
  while (done < data.size()) {
    const ::ssize_t w = ::write(fd_, data.data() + done, data.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return undo(w < 0 ? errno : EIO);
    done += static_cast<std::size_t>(w);
  }
  return {};
}

}  // namespace megatrain::io
