// Whole numbers read from JSON files megatrain writes (train_state.json, the trainer options):
// nlohmann's get<int>() of a floating-point value out of the type's range (1e300, -1.0 for a
// size_t) is undefined behaviour, so every such field goes through json_whole, which takes
// integers only and checks the range.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <limits>
#include <string_view>
#include <type_traits>

#include "megatrain/core/error.hpp"

namespace megatrain {

/// `v` as a T: an integer (not 4.0, not 1e300) within T's range; otherwise an Error naming the
/// file or object (`what`) and the field.
template <class T>
T json_whole(const nlohmann::json& v, std::string_view what, std::string_view field) {
  static_assert(std::is_integral_v<T>);
  constexpr auto lo = std::numeric_limits<T>::min();
  constexpr auto hi = std::numeric_limits<T>::max();
  bool ok = false;
  if (v.is_number_unsigned()) {
    ok = v.get<std::uint64_t>() <= static_cast<std::uint64_t>(hi);
  } else if (v.is_number_integer()) {
    const std::int64_t x = v.get<std::int64_t>();
    ok = x >= 0 ? static_cast<std::uint64_t>(x) <= static_cast<std::uint64_t>(hi)
                : std::is_signed_v<T> && x >= static_cast<std::int64_t>(lo);
  }
  MT_CHECK(ok, "{}: field '{}' must be a whole number in [{}, {}], not {}", what, field, lo, hi, v.dump());
  return v.is_number_unsigned() ? static_cast<T>(v.get<std::uint64_t>()) : static_cast<T>(v.get<std::int64_t>());
}

/// j[key] as a T (json_whole), or `fallback` where the key is absent (fields newer than the file).
template <class T>
T json_whole_or(const nlohmann::json& j, const char* key, T fallback, std::string_view what) {
  return j.contains(key) ? json_whole<T>(j.at(key), what, key) : fallback;
}

}  // namespace megatrain
