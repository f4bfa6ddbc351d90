#include "megatrain/core/cpu_features.hpp"

#include <cstdlib>
#include <string_view>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "megatrain/core/log.hpp"

namespace megatrain {

SimdLevel detect_simd_level() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return SimdLevel::avx512;
  // The AVX2 kernels also use F16C (half-precision conversions): require all three. (Clang's
  // __builtin_cpu_supports does not know "f16c": read CPUID leaf 1, ECX bit 29.)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c) return SimdLevel::avx2;
#endif
  return SimdLevel::scalar;
}

namespace {
SimdLevel compute_active_level() {
  const SimdLevel best = detect_simd_level();
  const char* env = std::getenv("MEGATRAIN_SIMD");
  if (env == nullptr || *env == '\0') return best;
  const std::string_view want(env);
  SimdLevel asked = best;
  if (want == "scalar") asked = SimdLevel::scalar;
  else if (want == "avx2") asked = SimdLevel::avx2;
  else if (want == "avx512") asked = SimdLevel::avx512;
  else {
    log_warning("MEGATRAIN_SIMD={} is not one of scalar, avx2, avx512; using {}", want, simd_level_name(best));
    return best;
  }
  if (asked > best) {
    log_warning("MEGATRAIN_SIMD={} is not supported by this CPU; using {}", want, simd_level_name(best));
    return best;
  }
  return asked;
}
}  // namespace

SimdLevel active_simd_level() {
  static const SimdLevel level = compute_active_level();
  return level;
}

}  // namespace megatrain
