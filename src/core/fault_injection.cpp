// Test hooks (include/megatrain/core/fault_injection.hpp).
#include "megatrain/core/fault_injection.hpp"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

namespace megatrain::fault {

namespace {

struct Item {
  std::string action, point, value;
  long from = 1, to = -1;  // #N (from the N-th on), #N..M (from the N-th to the M-th)
};

// The parsed variable and the counts of its points; parsed again when the variable changes.
struct State {
  std::mutex m;
  std::string text;
  std::vector<Item> items;
  std::map<std::string, long, std::less<>> hits;
};

State& state() {
  static State s;
  return s;
}

std::vector<Item> parse(std::string_view text) {
  std::vector<Item> out;
  while (!text.empty()) {
    const auto comma = text.find(',');
    std::string_view item = text.substr(0, comma);
    text = comma == std::string_view::npos ? std::string_view{} : text.substr(comma + 1);
    const auto at = item.find('@');
    if (at == std::string_view::npos) continue;
    Item it;
    it.action = std::string(item.substr(0, at));
    std::string_view rest = item.substr(at + 1);
    if (const auto eq = rest.find('='); eq != std::string_view::npos) {
      it.value = std::string(rest.substr(eq + 1));
      rest = rest.substr(0, eq);
    }
    if (const auto hash = rest.rfind('#'); hash != std::string_view::npos) {
      const std::string n(rest.substr(hash + 1));
      char* end = nullptr;
      it.from = std::strtol(n.c_str(), &end, 10);
      if (end != nullptr && end[0] == '.' && end[1] == '.') it.to = std::strtol(end + 2, nullptr, 10);
      rest = rest.substr(0, hash);
    }
    it.point = std::string(rest);
    out.push_back(std::move(it));
  }
  return out;
}

// The item armed for (action, point) if this hit is one it applies to; counts the hit.
std::optional<Item> armed(std::string_view action, std::string_view point) {
  const char* env = std::getenv(kVariable);
  if (env == nullptr || *env == '\0') return std::nullopt;
  State& s = state();
  std::lock_guard lock(s.m);
  if (s.text != env) {
    s.text = env;
    s.items = parse(s.text);
    s.hits.clear();
  }
  for (const Item& it : s.items) {
    if (it.action != action || it.point != point) continue;
    const long n = ++s.hits[it.action + "@" + it.point];
    if (n >= it.from && (it.to < 0 || n <= it.to)) return it;
    return std::nullopt;
  }
  return std::nullopt;
}

int errno_named(const std::string& name) {
  static const std::map<std::string, int, std::less<>> names{
      {"ENOSPC", ENOSPC}, {"EIO", EIO}, {"EFBIG", EFBIG}, {"EDQUOT", EDQUOT}, {"EACCES", EACCES}, {"EROFS", EROFS}};
  const auto f = names.find(name);
  return f == names.end() ? EIO : f->second;
}

thread_local const char* t_scope = nullptr;

}  // namespace

void crash_point(std::string_view point) {
  if (!armed("crash", point)) return;
  std::fprintf(stderr, "%s: killed at %.*s\n", kVariable, static_cast<int>(point.size()), point.data());
  std::fflush(stderr);
  ::kill(::getpid(), SIGKILL);
}

std::int64_t delay_of(std::string_view point) {
  const auto it = armed("delay", point);
  return it ? std::strtoll(it->value.c_str(), nullptr, 10) : 0;
}

void delay_point(std::string_view point) {
  if (const std::int64_t us = delay_of(point); us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
}

int failure(std::string_view point) {
  const auto it = armed("fail", point);
  return it ? errno_named(it->value) : 0;
}

std::optional<std::string> setting(std::string_view name) {
  const auto it = armed("set", name);
  if (!it) return std::nullopt;
  return it->value;
}

WriteScope::WriteScope(const char* scope) : previous_(t_scope) { t_scope = scope; }
WriteScope::~WriteScope() { t_scope = previous_; }

int write_failure() {
  if (t_scope == nullptr) return 0;
  const char* env = std::getenv(kVariable);
  if (env == nullptr || *env == '\0') return 0;
  return failure(std::string("write:") + t_scope);
}

}  // namespace megatrain::fault
