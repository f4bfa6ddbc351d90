// Private helpers shared by the vectorised CPU kernels (conversion, AdamW, norms).
// Each kernel variant is compiled for its instruction set with a target attribute and chosen
// at run time through SimdLevel, so one binary runs on any x86-64 CPU.
#pragma once

#include <immintrin.h>

#include <cstdint>

#define MT_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define MT_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace megatrain::detail {

/// 16 floats -> 16 bf16 (round to nearest even, NaN quieted), bit-identical to float_to_bf16_bits.
MT_TARGET_AVX512 inline __m256i bf16x16_from_f32(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  const __mmask16 nan =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x00400000)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

/// 8 floats -> 8 bf16, bit-identical to float_to_bf16_bits.
MT_TARGET_AVX2 inline __m128i bf16x8_from_f32(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
  // |u| fits in 31 bits, so a signed compare against the infinity pattern finds NaNs.
  const __m256i nan =
      _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), nan);
  r = _mm256_srli_epi32(r, 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

}  // namespace megatrain::detail
