// Element types and conversions.
//
// Training keeps fp32 masters and streams bf16 copies; checkpoints also come in f16. Conversions
// to the 16-bit formats round to nearest, ties to even, the same as PyTorch's `.to(bfloat16)`
// and CUDA's __float2bfloat16_rn: NaN stays NaN (made quiet, sign kept), infinities stay
// infinite, values past the largest finite number round to infinity, subnormals round
// correctly (nothing is flushed to zero). Array conversions are vectorised (AVX-512 or AVX2,
// picked at run time) and give bit-identical results to the scalar ones.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <type_traits>

namespace megatrain {

enum class DType : std::uint8_t { f32, f64, bf16, f16, i32, i64, u16, u32 };

constexpr std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::f64: case DType::i64: return 8;
    case DType::f32: case DType::i32: case DType::u32: return 4;
    case DType::bf16: case DType::f16: case DType::u16: return 2;
  }
  return 0;
}

/// The safetensors spelling: F32, F64, BF16, F16, I32, I64, U16, U32.
constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::f64: return "F64";
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
    case DType::u16: return "U16";
    case DType::u32: return "U32";
  }
  return "?";
}

// ---- scalar conversions -------------------------------------------------------------------

/// float -> bfloat16 bits, round to nearest even.
constexpr std::uint16_t float_to_bf16_bits(float f) {
  std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

constexpr float bf16_bits_to_float(std::uint16_t b) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

/// float -> IEEE binary16 bits, round to nearest even.
constexpr std::uint16_t float_to_f16_bits(float f) {
  std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u | ((u >> 13) & 0x3ffu));  // NaN
  if (u >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds past 65504: inf
  if (u < 0x38800000u) {
    // Result is subnormal or zero: adding 0.5 aligns the binary16 subnormal grid with the float
    // mantissa's last bit, so the hardware addition performs the round-to-nearest-even.
    const float aligned = std::bit_cast<float>(u) + 0.5f;
    return static_cast<std::uint16_t>(sign | (std::bit_cast<std::uint32_t>(aligned) - 0x3f000000u));
  }
  const std::uint32_t odd = (u >> 13) & 1u;
  u += 0xc8000fffu + odd;  // rebias exponent (15 - 127) << 23, plus the rounding increment
  return static_cast<std::uint16_t>(sign | (u >> 13));
}

constexpr float f16_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  const std::uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    const float mag = static_cast<float>(mant) * 0x1p-24f;  // exact: mant < 2^10
    return std::bit_cast<float>(std::bit_cast<std::uint32_t>(mag) | sign);
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

/// bfloat16: the top half of an IEEE float. Trivially copyable, layout-compatible with
/// CUDA's __nv_bfloat16.
struct bf16 {
  std::uint16_t bits;
  bf16() = default;
  constexpr explicit bf16(float f) : bits(float_to_bf16_bits(f)) {}
  static constexpr bf16 from_bits(std::uint16_t b) { bf16 r; r.bits = b; return r; }
  constexpr explicit operator float() const { return bf16_bits_to_float(bits); }
  friend constexpr bool operator==(bf16 a, bf16 b) { return a.bits == b.bits; }
};

/// IEEE binary16 ("half").
struct f16 {
  std::uint16_t bits;
  f16() = default;
  constexpr explicit f16(float f) : bits(float_to_f16_bits(f)) {}
  static constexpr f16 from_bits(std::uint16_t b) { f16 r; r.bits = b; return r; }
  constexpr explicit operator float() const { return f16_bits_to_float(bits); }
  friend constexpr bool operator==(f16 a, f16 b) { return a.bits == b.bits; }
};

static_assert(sizeof(bf16) == 2 && sizeof(f16) == 2);

template <class T> struct dtype_of_t;
template <> struct dtype_of_t<float> { static constexpr DType value = DType::f32; };
template <> struct dtype_of_t<double> { static constexpr DType value = DType::f64; };
template <> struct dtype_of_t<bf16> { static constexpr DType value = DType::bf16; };
template <> struct dtype_of_t<f16> { static constexpr DType value = DType::f16; };
template <> struct dtype_of_t<std::int32_t> { static constexpr DType value = DType::i32; };
template <> struct dtype_of_t<std::int64_t> { static constexpr DType value = DType::i64; };
template <> struct dtype_of_t<std::uint16_t> { static constexpr DType value = DType::u16; };
template <> struct dtype_of_t<std::uint32_t> { static constexpr DType value = DType::u32; };
/// The DType of a C++ element type (const ignored).
template <class T> inline constexpr DType dtype_of = dtype_of_t<std::remove_const_t<T>>::value;

// ---- array conversions (src/core/convert.cpp) ----------------------------------------------
// Sizes must match; throws megatrain::Error otherwise. Not parallel: callers split large arrays.

void convert(std::span<const float> in, std::span<bf16> out);
void convert(std::span<const bf16> in, std::span<float> out);
void convert(std::span<const float> in, std::span<f16> out);
void convert(std::span<const f16> in, std::span<float> out);

/// The element type in which ops read full-precision parameters (ParamSpec::full_precision:
/// norm gains) beside weights of type E: fp32 where the weights are bf16, E itself otherwise
/// (const kept).
template <class E>
using full_t = std::conditional_t<std::is_same_v<std::remove_const_t<E>, bf16>,
                                  std::conditional_t<std::is_const_v<E>, const float, float>, E>;

}  // namespace megatrain
