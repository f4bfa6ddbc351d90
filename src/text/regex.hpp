// Regular expressions (PCRE2, UTF-8, Unicode properties) shared by the text library's sources:
// the tokenizers' splits and the rewards' patterns (not installed).
#pragma once

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "megatrain/core/error.hpp"
#include "utf8.hpp"

namespace megatrain::text::detail {

class Regex {
 public:
  /// Compiles `pattern`; a pattern that does not compile is refused naming `where`.
  Regex(const std::string& pattern, const std::string& where) {
    int err = 0;
    PCRE2_SIZE offset = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP, &err, &offset,
                          nullptr);
    if (!code_) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      MT_FAIL("{}: the regular expression '{}' does not compile (at offset {}: {})", where, pattern, offset,
              reinterpret_cast<const char*>(msg));
    }
    jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
    pcre2_pattern_info(code_, PCRE2_INFO_CAPTURECOUNT, &groups_);
  }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  ~Regex() { pcre2_code_free(code_); }

  /// Calls f(start, end) for each non-empty match of the pattern in `s` (valid UTF-8), left to right.
  template <class F>
  void for_each_match(std::string_view s, F&& f) const {
    scan(s, [&](const PCRE2_SIZE* ov) { f(static_cast<std::size_t>(ov[0]), static_cast<std::size_t>(ov[1])); });
  }

  /// The last non-empty match in `s`: its first capture group where the pattern has one (and it
  /// took part), else the whole match; none where nothing matches.
  std::optional<std::string_view> last_match(std::string_view s) const {
    std::optional<std::string_view> last;
    scan(s, [&](const PCRE2_SIZE* ov) {
      const PCRE2_SIZE b = groups_ > 0 && ov[2] != PCRE2_UNSET ? ov[2] : ov[0], e = groups_ > 0 && ov[2] != PCRE2_UNSET ? ov[3] : ov[1];
      last = s.substr(static_cast<std::size_t>(b), static_cast<std::size_t>(e - b));
    });
    return last;
  }

  /// Whether the pattern matches the whole of `s`.
  bool matches_whole(std::string_view s) const {
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
    MT_CHECK(md != nullptr, "out of memory for a regular expression match");
    const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), 0, PCRE2_ANCHORED | PCRE2_ENDANCHORED,
                               md, nullptr);
    pcre2_match_data_free(md);
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    check(rc);
    return true;
  }

 private:
  static void check(int rc) {
    if (rc >= 0) return;
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(rc, msg, sizeof msg);
    MT_FAIL("regular expression match failed: {}", reinterpret_cast<const char*>(msg));
  }
  // Calls f(the match's ovector) for each non-empty match, left to right.
  template <class F>
  void scan(std::string_view s, F&& f) const {
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
    MT_CHECK(md != nullptr, "out of memory for a regular expression match");
    std::size_t pos = 0;
    while (pos <= s.size()) {
      const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
      int rc = jit_ ? pcre2_jit_match(code_, subject, s.size(), pos, 0, md, nullptr) : PCRE2_ERROR_JIT_STACKLIMIT;
      if (rc == PCRE2_ERROR_JIT_STACKLIMIT)  // (no JIT, or its stack is too small here: the interpreter's is on the heap)
        rc = pcre2_match(code_, subject, s.size(), pos, PCRE2_NO_UTF_CHECK, md, nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        pcre2_match_data_free(md);
        check(rc);
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      const std::size_t b = ov[0], e = ov[1];
      if (e == b) {  // an empty match: step over one character
        if (b >= s.size()) break;
        pos = b + utf8_next(s, b);
        continue;
      }
      f(ov);
      pos = e;
    }
    pcre2_match_data_free(md);
  }

  pcre2_code* code_ = nullptr;
  bool jit_ = false;
  std::uint32_t groups_ = 0;
};

}  // namespace megatrain::text::detail
