// Rewards for reinforcement learning (see include/megatrain/rl/rewards.hpp).
#include "megatrain/rl/rewards.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>

#include "../text/regex.hpp"
#include "megatrain/core/error.hpp"

extern char** environ;

namespace megatrain::rl {

namespace detail {
class Pattern : public text::detail::Regex {
 public:
  using Regex::Regex;
};
}  // namespace detail

namespace {

std::string_view trim(std::string_view s) {
  const auto space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; };
  while (!s.empty() && space(s.front())) s.remove_prefix(1);
  while (!s.empty() && space(s.back())) s.remove_suffix(1);
  return s;
}

/// `s` (trimmed) read in full as a finite number, if it is one.
std::optional<double> number(std::string_view s) {
  s = trim(s);
  if (s.empty()) return std::nullopt;
  const std::string z(s);
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(z.c_str(), &end);
  if (end != z.c_str() + z.size() || errno == ERANGE || !std::isfinite(v)) return std::nullopt;
  return v;
}

}  // namespace

AnswerReward::AnswerReward(const std::string& pattern, std::string field)
    : re_(std::make_unique<detail::Pattern>(pattern, "the answer reward")), field_(std::move(field)) {}
AnswerReward::~AnswerReward() = default;

std::vector<double> AnswerReward::score(std::span<const Scored> batch) const {
  std::vector<double> out(batch.size(), 0.0);
  for (std::size_t i = 0; i < batch.size(); ++i) {
    const nlohmann::json* rec = batch[i].record;
    MT_CHECK(rec != nullptr && rec->is_object() && rec->contains(field_),
             "the answer reward compares with the record's '{}' field, and completion {}'s record has none", field_, i);
    const nlohmann::json& want = (*rec)[field_];
    MT_CHECK(want.is_string() || want.is_number(), "the answer reward: completion {}'s record has '{}' = {}, neither a "
             "string nor a number", i, field_, want.dump());
    const std::string want_text = want.is_string() ? std::string(trim(want.get<std::string>())) : want.dump();
    const std::optional<double> want_number = want.is_number() ? std::optional(want.get<double>()) : number(want_text);
    const std::optional<std::string_view> got = re_->last_match(batch[i].completion);
    if (!got) continue;
    const std::optional<double> got_number = want_number ? number(*got) : std::nullopt;
    out[i] = (got_number ? *got_number == *want_number : trim(*got) == want_text) ? 1.0 : 0.0;
  }
  return out;
}

FormatReward::FormatReward(const std::string& pattern) : re_(std::make_unique<detail::Pattern>(pattern, "the format reward")) {}
FormatReward::~FormatReward() = default;

std::vector<double> FormatReward::score(std::span<const Scored> batch) const {
  std::vector<double> out(batch.size());
  for (std::size_t i = 0; i < batch.size(); ++i) out[i] = re_->matches_whole(batch[i].completion) ? 1.0 : 0.0;
  return out;
}

CommandReward::CommandReward(std::string command, double timeout_s) : command_(std::move(command)), timeout_s_(timeout_s) {
  MT_CHECK(!command_.empty(), "the reward command is empty");
  MT_CHECK(std::isfinite(timeout_s) && timeout_s > 0, "the reward command's timeout must be > 0 seconds (got {})", timeout_s);
}

namespace {

/// A child process of /bin/sh -c `command` with its standard input, output and error on pipes,
/// in a process group of its own (so that a timeout kills its children too).
struct Child {
  pid_t pid = -1;
  int in = -1, out = -1, err = -1;

  explicit Child(const std::string& command) {
    int p_in[2], p_out[2], p_err[2];
    MT_CHECK(pipe2(p_in, O_CLOEXEC) == 0 && pipe2(p_out, O_CLOEXEC) == 0 && pipe2(p_err, O_CLOEXEC) == 0,
             "the reward command: cannot make its pipes: {}", std::strerror(errno));
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, p_in[0], 0);
    posix_spawn_file_actions_adddup2(&fa, p_out[1], 1);
    posix_spawn_file_actions_adddup2(&fa, p_err[1], 2);
    posix_spawnattr_t at;
    posix_spawnattr_init(&at);
    sigset_t none, defaults;
    sigemptyset(&none);
    sigemptyset(&defaults);
    for (const int s : {SIGPIPE, SIGINT, SIGTERM, SIGHUP}) sigaddset(&defaults, s);
    posix_spawnattr_setsigmask(&at, &none);
    posix_spawnattr_setsigdefault(&at, &defaults);
    posix_spawnattr_setpgroup(&at, 0);
    posix_spawnattr_setflags(&at, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    std::string sh = "/bin/sh", c = "-c", cmd = command;
    char* argv[] = {sh.data(), c.data(), cmd.data(), nullptr};
    const int rc = posix_spawn(&pid, "/bin/sh", &fa, &at, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&at);
    ::close(p_in[0]);
    ::close(p_out[1]);
    ::close(p_err[1]);
    in = p_in[1];
    out = p_out[0];
    err = p_err[0];
    if (rc != 0) {
      close_all();
      MT_FAIL("the reward command '{}' could not start: {}", command, std::strerror(rc));
    }
    for (const int fd : {in, out, err}) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  ~Child() {
    close_all();
    if (pid > 0) {  // (not waited for: stopped, with its children)
      ::kill(-pid, SIGKILL);
      int status = 0;
      ::waitpid(pid, &status, 0);
    }
  }
  void close_all() {
    for (int* fd : {&in, &out, &err})
      if (*fd >= 0) {
        ::close(*fd);
        *fd = -1;
      }
  }
};

/// SIGPIPE blocked in this thread while it lives (a write to a closed pipe then fails with EPIPE);
/// one raised meanwhile is consumed before the mask is restored.
class PipeSignalBlocked {
 public:
  PipeSignalBlocked() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_, &before_);
  }
  PipeSignalBlocked(const PipeSignalBlocked&) = delete;
  PipeSignalBlocked& operator=(const PipeSignalBlocked&) = delete;
  ~PipeSignalBlocked() {
    const timespec zero{0, 0};
    while (sigtimedwait(&pipe_, nullptr, &zero) > 0) {
    }
    pthread_sigmask(SIG_SETMASK, &before_, nullptr);
  }

 private:
  sigset_t pipe_, before_;
};

/// The command's standard error, its last 2,000 bytes, for a message.
std::string quoted_stderr(const std::string& e) {
  const std::string_view t = trim(e);
  if (t.empty()) return " (its standard error was empty)";
  return fmt::format(" (its standard error: {}{})", t.size() > 2000 ? "..." : "", t.substr(t.size() > 2000 ? t.size() - 2000 : 0));
}

}  // namespace

std::vector<double> CommandReward::score(std::span<const Scored> batch) const {
  std::string input;
  for (const Scored& s : batch) {
    nlohmann::json j = s.record != nullptr && s.record->is_object() ? *s.record : nlohmann::json::object();
    j["completion"] = std::string(s.completion);
    if (!j.contains("prompt")) j["prompt"] = std::string(s.prompt);
    input += j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    input += '\n';
  }
  const PipeSignalBlocked quiet;  // (a command that exits without reading all of it: EPIPE, not SIGPIPE)
  Child child(command_);
  std::string out, err;
  std::size_t written = 0;
  bool timed_out = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s_);
  while (child.out >= 0 || child.err >= 0) {
    if (child.in >= 0 && written == input.size()) {
      ::close(child.in);
      child.in = -1;
    }
    pollfd fds[3] = {{child.in, POLLOUT, 0}, {child.out, POLLIN, 0}, {child.err, POLLIN, 0}};
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) {
      timed_out = true;
      break;
    }
    if (::poll(fds, 3, static_cast<int>(std::min<long long>(left, 1000))) < 0 && errno != EINTR) break;
    if (child.in >= 0 && (fds[0].revents & (POLLOUT | POLLERR | POLLHUP))) {
      const ssize_t n = ::write(child.in, input.data() + written, input.size() - written);
      if (n > 0) written += static_cast<std::size_t>(n);
      else if (n < 0 && errno != EAGAIN && errno != EINTR) written = input.size();  // (EPIPE: it stopped reading)
    }
    for (int k = 1; k <= 2; ++k) {
      int& fd = k == 1 ? child.out : child.err;
      if (fd < 0 || !(fds[k].revents & (POLLIN | POLLERR | POLLHUP))) continue;
      char buf[65536];
      const ssize_t n = ::read(fd, buf, sizeof buf);
      if (n > 0) (k == 1 ? out : err).append(buf, static_cast<std::size_t>(n));
      else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
        ::close(fd);
        fd = -1;
      }
    }
  }
  // (the output is closed: wait for the exit, up to the deadline)
  int status = 0;
  while (!timed_out) {
    const pid_t w = ::waitpid(child.pid, &status, WNOHANG);
    if (w == child.pid) {
      child.pid = -1;
      break;
    }
    if (std::chrono::steady_clock::now() >= deadline) timed_out = true;
    else ::usleep(2000);
  }
  MT_CHECK(!timed_out, "the reward command '{}' did not finish within {} s: it was stopped (raise its timeout, or make it "
           "faster){}", command_, timeout_s_, quoted_stderr(err));
  MT_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the reward command '{}' {}{}", command_,
           WIFEXITED(status) ? fmt::format("exited with status {}", WEXITSTATUS(status))
                             : fmt::format("was killed by signal {}", WTERMSIG(status)),
           quoted_stderr(err));
  std::vector<double> rewards;
  std::size_t line = 0, at = 0;
  while (at < out.size()) {
    std::size_t end = out.find('\n', at);
    if (end == std::string::npos) end = out.size();
    const std::string_view text(out.data() + at, end - at);
    ++line;
    const std::optional<double> v = number(text);
    MT_CHECK(v.has_value(), "the reward command '{}': line {} of its output, '{}', is not a finite number (it must print "
             "one number a line, one line a completion)", command_, line, text.substr(0, 80));
    rewards.push_back(*v);
    at = end + 1;
  }
  MT_CHECK(rewards.size() == batch.size(), "the reward command '{}' printed {} numbers for {} completions (one a line, in "
           "their order){}", command_, rewards.size(), batch.size(), quoted_stderr(err));
  return rewards;
}

void RewardSum::add(std::unique_ptr<Reward> reward, double weight) {
  MT_CHECK(reward != nullptr, "a reward sum: a null reward");
  MT_CHECK(std::isfinite(weight), "a reward sum: the weight of '{}' is {}", reward->name(), weight);
  parts_.emplace_back(std::move(reward), weight);
}

RewardSum::Scores RewardSum::score(std::span<const Scored> batch) const {
  MT_CHECK(!parts_.empty(), "a reward sum with no reward");
  Scores s;
  s.total.assign(batch.size(), 0.0);
  for (const auto& [reward, weight] : parts_) {
    std::vector<double> v = reward->score(batch);
    MT_CHECK(v.size() == batch.size(), "the reward '{}' gave {} values for {} completions", reward->name(), v.size(),
             batch.size());
    for (std::size_t i = 0; i < v.size(); ++i) s.total[i] += weight * v[i];
    s.each.push_back(std::move(v));
  }
  return s;
}

}  // namespace megatrain::rl
