// The fp32 AdamW kernels. All three paths evaluate the operations listed in
// include/megatrain/optim/adamw.hpp in the same order with fused multiply-adds at the same
// places; this file is compiled with -ffp-contract=off so that the compiler adds no others.
// The update is memory-bound (reads g, p, m, v; writes p, m, v and the bf16 copy: 30 bytes per
// parameter), so the vector paths aim at streaming bandwidth, not arithmetic.
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "detail/simd.hpp"
#include "megatrain/optim/adamw.hpp"

namespace megatrain {

void AdamWConfig::validate() const {
  MT_CHECK(std::isfinite(lr) && lr >= 0, "AdamW lr must be finite and >= 0 (got {})", lr);
  MT_CHECK(beta1 >= 0 && beta1 < 1, "AdamW beta1 must be in [0, 1) (got {})", beta1);
  MT_CHECK(beta2 >= 0 && beta2 < 1, "AdamW beta2 must be in [0, 1) (got {})", beta2);
  MT_CHECK(std::isfinite(eps) && eps > 0, "AdamW eps must be finite and > 0 (got {})", eps);
  MT_CHECK(std::isfinite(weight_decay) && weight_decay >= 0, "AdamW weight_decay must be finite and >= 0 (got {})",
           weight_decay);
}

double clip_coefficient(double total_norm, double max_norm) {
  MT_CHECK(max_norm > 0 && std::isfinite(max_norm), "max_norm must be finite and > 0 (got {})", max_norm);
  const double c = max_norm / (total_norm + 1e-6);
  return std::isnan(c) ? c : std::min(c, 1.0);
}

namespace {

void adamw_scalar(const AdamWScalars<float>& s, float* p, float* m, float* v, const float* g, bf16* out,
                  std::size_t n) {
  detail::adamw_generic(s, p, m, v, g, out, n);
}

template <bool kCopy>
MT_TARGET_AVX512 void adamw_avx512(const AdamWScalars<float>& s, float* p, float* m, float* v, const float* g,
                                   bf16* out, std::size_t n) {
  const __m512 gs = _mm512_set1_ps(s.grad_scale), decay = _mm512_set1_ps(s.decay);
  const __m512 omb1 = _mm512_set1_ps(s.one_minus_b1), b2 = _mm512_set1_ps(s.beta2), omb2 = _mm512_set1_ps(s.one_minus_b2);
  const __m512 bc2 = _mm512_set1_ps(s.bc2_sqrt), eps = _mm512_set1_ps(s.eps), nstep = _mm512_set1_ps(-s.step_size);
  // The bf16 copy is not read again in this pass: stream it past the cache (no read-for-ownership).
  const bool stream = (reinterpret_cast<std::uintptr_t>(out) & 31) == 0;
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 gi = _mm512_mul_ps(_mm512_loadu_ps(g + i), gs);
    const __m512 pi = _mm512_mul_ps(_mm512_loadu_ps(p + i), decay);
    const __m512 m0 = _mm512_loadu_ps(m + i);
    const __m512 mi = _mm512_fmadd_ps(omb1, _mm512_sub_ps(gi, m0), m0);
    const __m512 vi = _mm512_fmadd_ps(omb2, _mm512_mul_ps(gi, gi), _mm512_mul_ps(_mm512_loadu_ps(v + i), b2));
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), bc2), eps);
    const __m512 pn = _mm512_fmadd_ps(nstep, _mm512_div_ps(mi, denom), pi);
    _mm512_storeu_ps(p + i, pn);
    _mm512_storeu_ps(m + i, mi);
    _mm512_storeu_ps(v + i, vi);
    if constexpr (kCopy) {
      const __m256i o = detail::bf16x16_from_f32(pn);
      if (stream) _mm256_stream_si256(reinterpret_cast<__m256i*>(out + i), o);
      else _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), o);
    }
  }
  if (kCopy && stream) _mm_sfence();
  adamw_scalar(s, p + i, m + i, v + i, g + i, kCopy ? out + i : nullptr, n - i);
}

template <bool kCopy>
MT_TARGET_AVX2 void adamw_avx2(const AdamWScalars<float>& s, float* p, float* m, float* v, const float* g, bf16* out,
                               std::size_t n) {
  const __m256 gs = _mm256_set1_ps(s.grad_scale), decay = _mm256_set1_ps(s.decay);
  const __m256 omb1 = _mm256_set1_ps(s.one_minus_b1), b2 = _mm256_set1_ps(s.beta2), omb2 = _mm256_set1_ps(s.one_minus_b2);
  const __m256 bc2 = _mm256_set1_ps(s.bc2_sqrt), eps = _mm256_set1_ps(s.eps), nstep = _mm256_set1_ps(-s.step_size);
  const bool stream = (reinterpret_cast<std::uintptr_t>(out) & 15) == 0;
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gi = _mm256_mul_ps(_mm256_loadu_ps(g + i), gs);
    const __m256 pi = _mm256_mul_ps(_mm256_loadu_ps(p + i), decay);
    const __m256 m0 = _mm256_loadu_ps(m + i);
    const __m256 mi = _mm256_fmadd_ps(omb1, _mm256_sub_ps(gi, m0), m0);
    const __m256 vi = _mm256_fmadd_ps(omb2, _mm256_mul_ps(gi, gi), _mm256_mul_ps(_mm256_loadu_ps(v + i), b2));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), bc2), eps);
    const __m256 pn = _mm256_fmadd_ps(nstep, _mm256_div_ps(mi, denom), pi);
    _mm256_storeu_ps(p + i, pn);
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
    if constexpr (kCopy) {
      const __m128i o = detail::bf16x8_from_f32(pn);
      if (stream) _mm_stream_si128(reinterpret_cast<__m128i*>(out + i), o);
      else _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), o);
    }
  }
  if (kCopy && stream) _mm_sfence();
  adamw_scalar(s, p + i, m + i, v + i, g + i, kCopy ? out + i : nullptr, n - i);
}

// Sums of squares: per-lane double accumulators; lanes are combined in a fixed order, so a path
// is deterministic, and paths differ from each other only by the order of double additions.
double sum_squares_scalar(const float* x, std::size_t n) {
  double acc = 0;
  for (std::size_t i = 0; i < n; ++i) acc += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return acc;
}

MT_TARGET_AVX512 double sum_squares_avx512(const float* x, std::size_t n) {
  __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512d lo = _mm512_cvtps_pd(_mm256_loadu_ps(x + i));
    const __m512d hi = _mm512_cvtps_pd(_mm256_loadu_ps(x + i + 8));
    a0 = _mm512_fmadd_pd(lo, lo, a0);
    a1 = _mm512_fmadd_pd(hi, hi, a1);
  }
  alignas(64) double lanes[8];
  _mm512_store_pd(lanes, _mm512_add_pd(a0, a1));
  return (((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))) +
         sum_squares_scalar(x + i, n - i);
}

MT_TARGET_AVX2 double sum_squares_avx2(const float* x, std::size_t n) {
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    a0 = _mm256_fmadd_pd(lo, lo, a0);
    a1 = _mm256_fmadd_pd(hi, hi, a1);
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(a0, a1));
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + sum_squares_scalar(x + i, n - i);
}

}  // namespace

namespace detail {

void adamw_f32(SimdLevel level, const AdamWScalars<float>& s, float* p, float* m, float* v, const float* g, bf16* out,
               std::size_t n) {
  switch (level) {
    case SimdLevel::avx512: return out ? adamw_avx512<true>(s, p, m, v, g, out, n) : adamw_avx512<false>(s, p, m, v, g, out, n);
    case SimdLevel::avx2: return out ? adamw_avx2<true>(s, p, m, v, g, out, n) : adamw_avx2<false>(s, p, m, v, g, out, n);
    case SimdLevel::scalar: return adamw_scalar(s, p, m, v, g, out, n);
  }
}

double sum_squares_f32(SimdLevel level, const float* x, std::size_t n) {
  switch (level) {
    case SimdLevel::avx512: return sum_squares_avx512(x, n);
    case SimdLevel::avx2: return sum_squares_avx2(x, n);
    case SimdLevel::scalar: return sum_squares_scalar(x, n);
  }
  return 0;
}

}  // namespace detail
}  // namespace megatrain
