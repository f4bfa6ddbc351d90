// Shared by the libFuzzer targets and the seed generator: a scratch folder in memory-backed
// storage, file helpers, the invariant check, input splitting.
#pragma once

#include <signal.h>  // kill
#include <stdlib.h>  // mkdtemp, getenv
#include <unistd.h>

#include <cerrno>

#include <oneapi/tbb/global_control.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

namespace megatrain::fuzz {

namespace fs = std::filesystem;

/// An invariant of a successful parse does not hold: a finding. libFuzzer keeps the input (abort).
#define FUZZ_REQUIRE(cond)                                                                                \
  do {                                                                                                    \
    if (!(cond)) {                                                                                        \
      std::fprintf(stderr, "fuzz: invariant broken at %s:%d: %s\n", __FILE__, __LINE__, #cond);            \
      std::abort();                                                                                       \
    }                                                                                                     \
  } while (0)

/// A folder in memory-backed storage (/dev/shm where it is writable, else $TMPDIR, else /tmp),
/// removed when the process exits normally. Each fuzzing process has its own, named with its pid;
/// those of processes that died (a finding, a timeout, a kill) are removed by the next one.
class Scratch {
 public:
  explicit Scratch(const std::string& name) {
    std::error_code ec;
    fs::path base = "/dev/shm";
    if (!fs::is_directory(base, ec) || ::access(base.c_str(), W_OK) != 0)
      base = std::getenv("TMPDIR") != nullptr ? fs::path(std::getenv("TMPDIR")) : fs::path("/tmp");
    const std::string prefix = "megatrain-fuzz-" + name + "-";
    for (fs::directory_iterator it(base, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string n = it->path().filename().string();
      if (!n.starts_with(prefix)) continue;
      const long pid = std::strtol(n.c_str() + prefix.size(), nullptr, 10);
      std::error_code ignored;
      if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) fs::remove_all(it->path(), ignored);
    }
    std::string templ = (base / (prefix + std::to_string(::getpid()) + "-XXXXXX")).string();
    if (::mkdtemp(templ.data()) == nullptr) {
      std::fprintf(stderr, "fuzz: cannot create a scratch folder in %s\n", base.c_str());
      std::abort();
    }
    path_ = templ;
  }
  ~Scratch() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  const fs::path& path() const { return path_; }
  fs::path operator/(std::string_view name) const { return path_ / name; }

 private:
  fs::path path_;
};

/// Writes `bytes` as the whole of `p` (a failure here is the harness's, not a finding: abort loudly).
inline void write_file(const fs::path& p, std::string_view bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) {
    std::fprintf(stderr, "fuzz: cannot write %s\n", p.c_str());
    std::abort();
  }
}

inline std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

inline void remove_file(const fs::path& p) {
  std::error_code ec;
  fs::remove(p, ec);
}

/// The input as text.
inline std::string_view as_text(const std::uint8_t* data, std::size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

/// `s` cut at the first `sep`: what is before it, and what is after it (nullopt without one).
inline std::pair<std::string_view, std::optional<std::string_view>> split_at(std::string_view s, char sep) {
  const auto at = s.find(sep);
  if (at == std::string_view::npos) return {s, std::nullopt};
  return {s.substr(0, at), s.substr(at + 1)};
}

/// oneTBB limited to MEGATRAIN_FUZZ_THREADS threads (default 1): fuzzing runs one input at a
/// time, and a shared developer machine or CI runner has few cores.
inline void limit_threads() {
  static const tbb::global_control limit(tbb::global_control::max_allowed_parallelism, [] {
    const char* v = std::getenv("MEGATRAIN_FUZZ_THREADS");
    const long n = v != nullptr ? std::strtol(v, nullptr, 10) : 1;
    return static_cast<std::size_t>(n > 0 ? n : 1);
  }());
}

}  // namespace megatrain::fuzz
