// Diagnostics that are not errors (a pinning fallback, a slow path taken). They go to a sink that
// the application may replace; the default writes one line to stderr.
#pragma once

#include <fmt/format.h>

#include <functional>
#include <string_view>

namespace megatrain {

enum class LogLevel { info, warning };

using LogSink = std::function<void(LogLevel, std::string_view)>;

/// Replaces the sink (thread-safe); an empty function restores the default. Returns the old sink.
LogSink set_log_sink(LogSink sink);

/// Sends one message to the current sink.
void log_message(LogLevel level, std::string_view message);

template <class... Args>
void log_warning(fmt::format_string<Args...> f, Args&&... args) {
  log_message(LogLevel::warning, fmt::format(f, std::forward<Args>(args)...));
}

template <class... Args>
void log_info(fmt::format_string<Args...> f, Args&&... args) {
  log_message(LogLevel::info, fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace megatrain
