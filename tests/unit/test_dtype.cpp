// bf16 / f16 conversions: exact values, ties to even, subnormals, NaN and Inf, and every vector
// path bit-identical to the scalar one on random bit patterns.
#include <doctest/doctest.h>

#include <bit>
#include <cstring>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "megatrain/core/detail/convert_paths.hpp"
#include "megatrain/core/dtype.hpp"
#include "megatrain/core/error.hpp"

using namespace megatrain;

namespace {

/// Bit-for-bit equality of two float vectors (memcmp only on non-empty data: an empty vector's
/// data() may be null, which memcmp must not get).
bool same_bytes(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

float from_bits(std::uint32_t u) { return std::bit_cast<float>(u); }

// Independent reference: round a float to a grid of `keep` mantissa bits by exact arithmetic
// in double (a float and its neighbours on a coarser grid are exact in double).
std::uint16_t bf16_reference(float f) {
  if (std::isnan(f)) return static_cast<std::uint16_t>((std::bit_cast<std::uint32_t>(f) >> 16) | 0x40);
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const std::uint16_t lo = static_cast<std::uint16_t>(u >> 16);  // truncated toward zero
  const std::uint16_t hi = static_cast<std::uint16_t>(lo + 1);   // next away from zero
  const double a = std::fabs(static_cast<double>(bf16_bits_to_float(lo)));
  const double b = std::fabs(static_cast<double>(bf16_bits_to_float(hi)));  // may be inf
  const double x = std::fabs(static_cast<double>(f));
  if ((u & 0xffff) == 0) return lo;
  const double da = x - a, db = std::isinf(b) ? (std::ldexp(1.0, 128) - x) : b - x;
  if (da < db) return lo;
  if (db < da) return hi;
  return (lo & 1) ? hi : lo;  // tie: even
}
}  // namespace

TEST_CASE("bf16: exact values, ties to even, overflow, subnormals, NaN, Inf") {
  CHECK(float_to_bf16_bits(1.0f) == 0x3f80);
  CHECK(float_to_bf16_bits(-2.0f) == 0xc000);
  CHECK(float_to_bf16_bits(0.0f) == 0x0000);
  CHECK(float_to_bf16_bits(-0.0f) == 0x8000);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to the even mantissa (1.0).
  CHECK(float_to_bf16_bits(from_bits(0x3f808000)) == 0x3f80);
  // 1 + 3*2^-8 is halfway between 1+2^-7 (odd) and 1+2^-6 (even): rounds up.
  CHECK(float_to_bf16_bits(from_bits(0x3f818000)) == 0x3f82);
  // Just above and below halfway.
  CHECK(float_to_bf16_bits(from_bits(0x3f808001)) == 0x3f81);
  CHECK(float_to_bf16_bits(from_bits(0x3f807fff)) == 0x3f80);
  // Largest float rounds to infinity; the largest bf16 stays.
  CHECK(float_to_bf16_bits(std::numeric_limits<float>::max()) == 0x7f80);
  CHECK(float_to_bf16_bits(from_bits(0x7f7f0000)) == 0x7f7f);
  CHECK(float_to_bf16_bits(std::numeric_limits<float>::infinity()) == 0x7f80);
  CHECK(float_to_bf16_bits(-std::numeric_limits<float>::infinity()) == 0xff80);
  // Subnormals are rounded, not flushed: smallest float subnormal -> 0; tie at a bf16 subnormal.
  CHECK(float_to_bf16_bits(from_bits(0x00000001)) == 0x0000);
  CHECK(float_to_bf16_bits(from_bits(0x00018000)) == 0x0002);  // 1.5 ulp -> 2 (even)
  CHECK(float_to_bf16_bits(from_bits(0x00008000)) == 0x0000);  // 0.5 ulp -> 0 (even)
  CHECK(float_to_bf16_bits(from_bits(0x00010001)) == 0x0001);
  CHECK(float_to_bf16_bits(from_bits(0x007fffff)) == 0x0080);  // largest subnormal rounds up to smallest normal
  // NaN stays NaN (quiet), sign kept; a NaN whose payload lies only in the low bits must not become Inf.
  for (std::uint32_t nan : {0x7fc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu, 0x7f80ffffu}) {
    const std::uint16_t b = float_to_bf16_bits(from_bits(nan));
    CHECK(std::isnan(bf16_bits_to_float(b)));
    CHECK((b & 0x8000) == ((nan >> 16) & 0x8000));
  }
  // Round trip of every bf16 value (except NaNs, which are only required to stay NaN).
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const float f = bf16_bits_to_float(static_cast<std::uint16_t>(b));
    if (std::isnan(f)) continue;
    REQUIRE(float_to_bf16_bits(f) == b);
  }
}

TEST_CASE("bf16: scalar rounding agrees with an exact reference on random floats") {
  std::mt19937 rng(1234);
  for (int i = 0; i < 200000; ++i) {
    const float f = from_bits(static_cast<std::uint32_t>(rng()));
    REQUIRE(float_to_bf16_bits(f) == bf16_reference(f));
  }
}

TEST_CASE("f16: exact values, ties, overflow, subnormals, NaN, Inf") {
  CHECK(float_to_f16_bits(1.0f) == 0x3c00);
  CHECK(float_to_f16_bits(-2.0f) == 0xc000);
  CHECK(float_to_f16_bits(65504.0f) == 0x7bff);
  CHECK(float_to_f16_bits(65519.0f) == 0x7bff);   // below the halfway point to 65536
  CHECK(float_to_f16_bits(65520.0f) == 0x7c00);   // halfway: ties to even -> infinity
  CHECK(float_to_f16_bits(1e10f) == 0x7c00);
  CHECK(float_to_f16_bits(-std::numeric_limits<float>::infinity()) == 0xfc00);
  CHECK(float_to_f16_bits(std::ldexp(1.0f, -24)) == 0x0001);          // smallest subnormal
  CHECK(float_to_f16_bits(std::ldexp(1.0f, -25)) == 0x0000);          // half of it: tie to even (0)
  CHECK(float_to_f16_bits(std::ldexp(3.0f, -25)) == 0x0002);          // 1.5 ulp: tie to even (2)
  CHECK(float_to_f16_bits(std::ldexp(1.0f, -14)) == 0x0400);          // smallest normal
  CHECK(float_to_f16_bits(1.0f + std::ldexp(1.0f, -11)) == 0x3c00);   // tie to even
  CHECK(float_to_f16_bits(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3c02);
  CHECK(std::isnan(f16_bits_to_float(float_to_f16_bits(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(std::isnan(f16_bits_to_float(float_to_f16_bits(from_bits(0x7f800001)))));
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const float f = f16_bits_to_float(static_cast<std::uint16_t>(b));
    if (std::isnan(f)) continue;
    REQUIRE(float_to_f16_bits(f) == b);
  }
  CHECK(f16_bits_to_float(0x0001) == std::ldexp(1.0f, -24));
  CHECK(f16_bits_to_float(0x8000) == 0.0f);
  CHECK(std::signbit(f16_bits_to_float(0x8000)));
}

TEST_CASE("array conversions: every vector path is bit-identical to scalar") {
  std::mt19937 rng(99);
  for (std::size_t n : {0u, 1u, 7u, 8u, 15u, 16u, 17u, 31u, 1000u, 4099u}) {
    std::vector<float> in(n);
    for (auto& x : in) {
      // Half random bit patterns (NaN, Inf, subnormals included), half ordinary values.
      x = (rng() & 1) ? from_bits(static_cast<std::uint32_t>(rng())) : std::normal_distribution<float>(0, 3)(rng);
    }
    std::vector<std::uint16_t> ref(n), got(n);
    std::vector<float> back_ref(n), back(n);
    for (SimdLevel level : {SimdLevel::avx2, SimdLevel::avx512}) {
      if (detect_simd_level() < level) {
        MESSAGE(simd_level_name(level) << " is not available on this CPU: its path is not checked here");
        continue;
      }
      CAPTURE(simd_level_name(level));
      CAPTURE(n);
      detail::convert_f32_to_bf16(SimdLevel::scalar, in.data(), ref.data(), n);
      detail::convert_f32_to_bf16(level, in.data(), got.data(), n);
      CHECK(got == ref);
      detail::convert_bf16_to_f32(SimdLevel::scalar, ref.data(), back_ref.data(), n);
      detail::convert_bf16_to_f32(level, ref.data(), back.data(), n);
      CHECK(same_bytes(back, back_ref));
      detail::convert_f32_to_f16(SimdLevel::scalar, in.data(), ref.data(), n);
      detail::convert_f32_to_f16(level, in.data(), got.data(), n);
      CHECK(got == ref);
      detail::convert_f16_to_f32(SimdLevel::scalar, ref.data(), back_ref.data(), n);
      detail::convert_f16_to_f32(level, ref.data(), back.data(), n);
      CHECK(same_bytes(back, back_ref));
    }
  }
}

TEST_CASE("convert() checks sizes") {
  std::vector<float> a(4, 1.0f);
  std::vector<bf16> b(3);
  CHECK_THROWS_WITH_AS(convert(std::span<const float>(a), std::span<bf16>(b)),
                       doctest::Contains("input has 4 elements but output has 3"), megatrain::Error);
}
