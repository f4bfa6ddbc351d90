#include "megatrain/core/log.hpp"

#include <cstdio>
#include <mutex>

namespace megatrain {
namespace {
std::mutex g_sink_mutex;
LogSink g_sink;
}  // namespace

LogSink set_log_sink(LogSink sink) {
  std::lock_guard lock(g_sink_mutex);
  std::swap(g_sink, sink);
  return sink;
}

void log_message(LogLevel level, std::string_view message) {
  std::lock_guard lock(g_sink_mutex);
  if (g_sink) {
    g_sink(level, message);
    return;
  }
  std::fprintf(stderr, "megatrain %s: %.*s\n", level == LogLevel::warning ? "warning" : "info",
               static_cast<int>(message.size()), message.data());
}

}  // namespace megatrain
