// Counting the NaNs and infinities of fp32 values (weights, AdamW moments, a checkpoint's
// tensors), for the messages that name them: how many, and the first's element and value.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

namespace megatrain {

struct FiniteScan {
  std::size_t count = 0;  ///< values that are NaN or infinite
  std::size_t first = 0;  ///< the first one's element (valid where count > 0)
  float value = 0;        ///< and its value
  bool ok() const { return count == 0; }
};

/// The non-finite values of v.
inline FiniteScan scan_finite(std::span<const float> v) {
  FiniteScan s;
  for (std::size_t i = 0; i < v.size(); ++i)
    if (!std::isfinite(v[i]) && s.count++ == 0) {
      s.first = i;
      s.value = v[i];
    }
  return s;
}

/// The same over the bytes of little-endian fp32 values, read without assuming their alignment
/// (a tensor inside a mapped file).
inline FiniteScan scan_finite(std::span<const std::byte> f32_bytes) {
  FiniteScan s;
  for (std::size_t i = 0; 4 * i + 4 <= f32_bytes.size(); ++i) {
    float x = 0;
    std::memcpy(&x, f32_bytes.data() + 4 * i, 4);
    if (!std::isfinite(x) && s.count++ == 0) {
      s.first = i;
      s.value = x;
    }
  }
  return s;
}

}  // namespace megatrain
