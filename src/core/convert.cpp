// Vectorised dtype conversions. Every path computes exactly what the scalar functions in
// core/dtype.hpp compute (integer round-to-nearest-even for bf16, F16C's RNE for f16), so the
// results are bit-identical whichever path runs. Kernels are compiled per instruction set
// with target attributes and picked at run time.
#include <immintrin.h>

#include <cstring>

#include "megatrain/core/cpu_features.hpp"
#include "megatrain/core/dtype.hpp"
#include "megatrain/core/error.hpp"
#include "megatrain/core/detail/convert_paths.hpp"
#include "detail/simd.hpp"

namespace megatrain {
namespace {

void f32_to_bf16_scalar(const float* in, std::uint16_t* out, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) out[i] = float_to_bf16_bits(in[i]);
}
void bf16_to_f32_scalar(const std::uint16_t* in, float* out, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) out[i] = bf16_bits_to_float(in[i]);
}
void f32_to_f16_scalar(const float* in, std::uint16_t* out, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) out[i] = float_to_f16_bits(in[i]);
}
void f16_to_f32_scalar(const std::uint16_t* in, float* out, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) out[i] = f16_bits_to_float(in[i]);
}

MT_TARGET_AVX512 void f32_to_bf16_avx512(const float* in, std::uint16_t* out, std::size_t n) {
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), detail::bf16x16_from_f32(_mm512_loadu_ps(in + i)));
  f32_to_bf16_scalar(in + i, out + i, n - i);
}
MT_TARGET_AVX512 void bf16_to_f32_avx512(const std::uint16_t* in, float* out, std::size_t n) {
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i));
    _mm512_storeu_si512(out + i, _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  bf16_to_f32_scalar(in + i, out + i, n - i);
}
MT_TARGET_AVX512 void f32_to_f16_avx512(const float* in, std::uint16_t* out, std::size_t n) {
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  f32_to_f16_scalar(in + i, out + i, n - i);
}
MT_TARGET_AVX512 void f16_to_f32_avx512(const std::uint16_t* in, float* out, std::size_t n) {
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i))));
  f16_to_f32_scalar(in + i, out + i, n - i);
}

MT_TARGET_AVX2 void f32_to_bf16_avx2(const float* in, std::uint16_t* out, std::size_t n) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), detail::bf16x8_from_f32(_mm256_loadu_ps(in + i)));
  f32_to_bf16_scalar(in + i, out + i, n - i);
}
MT_TARGET_AVX2 void bf16_to_f32_avx2(const std::uint16_t* in, float* out, std::size_t n) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  bf16_to_f32_scalar(in + i, out + i, n - i);
}
MT_TARGET_AVX2 void f32_to_f16_avx2(const float* in, std::uint16_t* out, std::size_t n) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  f32_to_f16_scalar(in + i, out + i, n - i);
}
MT_TARGET_AVX2 void f16_to_f32_avx2(const std::uint16_t* in, float* out, std::size_t n) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  f16_to_f32_scalar(in + i, out + i, n - i);
}

template <class In, class Out>
void check_sizes(std::span<In> in, std::span<Out> out) {
  MT_CHECK(in.size() == out.size(), "input has {} elements but output has {}", in.size(), out.size());
}

}  // namespace

namespace detail {
void convert_f32_to_bf16(SimdLevel level, const float* in, std::uint16_t* out, std::size_t n) {
  switch (level) {
    case SimdLevel::avx512: return f32_to_bf16_avx512(in, out, n);
    case SimdLevel::avx2: return f32_to_bf16_avx2(in, out, n);
    case SimdLevel::scalar: return f32_to_bf16_scalar(in, out, n);
  }
}
void convert_bf16_to_f32(SimdLevel level, const std::uint16_t* in, float* out, std::size_t n) {
  switch (level) {
    case SimdLevel::avx512: return bf16_to_f32_avx512(in, out, n);
    case SimdLevel::avx2: return bf16_to_f32_avx2(in, out, n);
    case SimdLevel::scalar: return bf16_to_f32_scalar(in, out, n);
  }
}
void convert_f32_to_f16(SimdLevel level, const float* in, std::uint16_t* out, std::size_t n) {
  switch (level) {
    case SimdLevel::avx512: return f32_to_f16_avx512(in, out, n);
    case SimdLevel::avx2: return f32_to_f16_avx2(in, out, n);
    case SimdLevel::scalar: return f32_to_f16_scalar(in, out, n);
  }
}
void convert_f16_to_f32(SimdLevel level, const std::uint16_t* in, float* out, std::size_t n) {
  switch (level) {
    case SimdLevel::avx512: return f16_to_f32_avx512(in, out, n);
    case SimdLevel::avx2: return f16_to_f32_avx2(in, out, n);
    case SimdLevel::scalar: return f16_to_f32_scalar(in, out, n);
  }
}
}  // namespace detail

void convert(std::span<const float> in, std::span<bf16> out) {
  check_sizes(in, out);
  detail::convert_f32_to_bf16(active_simd_level(), in.data(), reinterpret_cast<std::uint16_t*>(out.data()), in.size());
}
void convert(std::span<const bf16> in, std::span<float> out) {
  check_sizes(in, out);
  detail::convert_bf16_to_f32(active_simd_level(), reinterpret_cast<const std::uint16_t*>(in.data()), out.data(), in.size());
}
void convert(std::span<const float> in, std::span<f16> out) {
  check_sizes(in, out);
  detail::convert_f32_to_f16(active_simd_level(), in.data(), reinterpret_cast<std::uint16_t*>(out.data()), in.size());
}
void convert(std::span<const f16> in, std::span<float> out) {
  check_sizes(in, out);
  detail::convert_f16_to_f32(active_simd_level(), reinterpret_cast<const std::uint16_t*>(in.data()), out.data(), in.size());
}

}  // namespace megatrain
