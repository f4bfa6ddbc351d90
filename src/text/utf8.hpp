// UTF-8 decoding shared by the text library's sources (not installed).
#pragma once

#include <cstddef>
#include <string_view>

namespace megatrain::text::detail {

/// Decodes the code point at s[i] into *cp (if given) and returns its length in bytes. Meant for
/// valid UTF-8; a sequence cut short by the end of `s` counts as its lead byte alone.
inline std::size_t utf8_next(std::string_view s, std::size_t i, char32_t* cp = nullptr) {
  const auto b = static_cast<unsigned char>(s[i]);
  std::size_t len = b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
  if (i + len > s.size()) len = 1;
  if (cp) {
    char32_t c = len == 1 ? b : len == 2 ? (b & 0x1F) : len == 3 ? (b & 0x0F) : (b & 0x07);
    for (std::size_t k = 1; k < len; ++k) c = (c << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    *cp = c;
  }
  return len;
}

}  // namespace megatrain::text::detail
