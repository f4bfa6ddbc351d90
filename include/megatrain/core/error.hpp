// The one exception type of megatrain's public API, and the checks that raise it.
//
// Every failure a user can see is a megatrain::Error whose message says which call failed,
// where (file and line), and why, in words a user can act on. Library code never calls exit().
// MT_CHECK validates arguments and state; the status checks for CUDA, cuBLAS, cuDNN and NCCL
// live in core/cuda_check.hpp (only available in CUDA builds).
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>
#include <string_view>

namespace megatrain {

class Error : public std::runtime_error {
 public:
  /// `call` names what failed (a function or a library call), `reason` says why.
  Error(std::string call, std::string reason, std::string file, int line)
      : std::runtime_error(fmt::format("{}: {} [{}:{}]", call, reason, file, line)),
        call_(std::move(call)), reason_(std::move(reason)), file_(std::move(file)), line_(line) {}

  const std::string& call() const noexcept { return call_; }
  const std::string& reason() const noexcept { return reason_; }
  const std::string& file() const noexcept { return file_; }
  int line() const noexcept { return line_; }

 private:
  std::string call_, reason_, file_;
  int line_;
};

namespace detail {

/// Where a check was made. (std::source_location would do, but clang 14 cannot compile
/// libstdc++ 12's; the builtins below work with every compiler megatrain supports.)
struct SourceLoc {
  const char* file;
  int line;
  const char* function;  ///< the compiler's pretty signature
};

/// Strips a compiler's pretty function signature down to its qualified name ("ns::Class::fn").
constexpr std::string_view short_function_name(std::string_view pretty) {
  auto paren = pretty.find('(');
  if (paren != std::string_view::npos) pretty = pretty.substr(0, paren);
  // Drop the return type: the name starts after the last space outside template brackets.
  int depth = 0;
  for (std::size_t i = pretty.size(); i-- > 0;) {
    char c = pretty[i];
    if (c == '>') ++depth;
    else if (c == '<') --depth;
    else if (c == ' ' && depth == 0) return pretty.substr(i + 1);
  }
  return pretty;
}

[[noreturn]] inline void throw_error(std::string_view call, std::string reason, const SourceLoc& where) {
  std::string_view file = where.file;
  if (auto pos = file.rfind("include/megatrain/"); pos != std::string_view::npos) file.remove_prefix(pos + 8);
  else if (auto pos2 = file.rfind("/src/"); pos2 != std::string_view::npos) file.remove_prefix(pos2 + 1);
  throw Error(std::string(call), std::move(reason), std::string(file), where.line);
}

}  // namespace detail
}  // namespace megatrain

/// The current source location, as a megatrain::detail::SourceLoc.
#define MT_HERE (::megatrain::detail::SourceLoc{__FILE__, __LINE__, __PRETTY_FUNCTION__})

/// Throws megatrain::Error naming the enclosing function when `cond` is false.
/// The remaining arguments are a fmt format string and its arguments.
#define MT_CHECK(cond, ...)                                                                             \
  do {                                                                                                  \
    if (!(cond)) [[unlikely]] {                                                                         \
      ::megatrain::detail::throw_error(::megatrain::detail::short_function_name(__PRETTY_FUNCTION__),   \
                                       ::fmt::format(__VA_ARGS__), MT_HERE);                           \
    }                                                                                                   \
  } while (0)

/// Throws megatrain::Error naming the enclosing function.
#define MT_FAIL(...)                                                                                                \
  ::megatrain::detail::throw_error(::megatrain::detail::short_function_name(__PRETTY_FUNCTION__), ::fmt::format(__VA_ARGS__), \
                                   MT_HERE)
