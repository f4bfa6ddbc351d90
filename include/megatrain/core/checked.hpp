// Overflow-checked size arithmetic: counts, shapes and byte sizes derived from files and flags
// go through these, so that a hostile or mistaken value (a hidden_size of 2^62) is an error and
// never a wrapped-around size (signed overflow is undefined behaviour in C++).
#pragma once

#include <cstdint>
#include <string_view>

#include "megatrain/core/error.hpp"

namespace megatrain {

/// a * b, or an Error naming `what` when the product does not fit in 64 bits (or a factor is negative).
inline std::int64_t checked_mul(std::int64_t a, std::int64_t b, std::string_view what) {
  std::int64_t r = 0;
  MT_CHECK(a >= 0 && b >= 0 && !__builtin_mul_overflow(a, b, &r), "{}: {} x {} does not fit in 64 bits", what, a, b);
  return r;
}
/// a + b, likewise.
inline std::int64_t checked_add(std::int64_t a, std::int64_t b, std::string_view what) {
  std::int64_t r = 0;
  MT_CHECK(a >= 0 && b >= 0 && !__builtin_add_overflow(a, b, &r), "{}: {} + {} does not fit in 64 bits", what, a, b);
  return r;
}

}  // namespace megatrain
