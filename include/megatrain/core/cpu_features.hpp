// Which SIMD instruction sets the host CPU offers, for run-time dispatch of vectorised kernels.
#pragma once

#include <string_view>

namespace megatrain {

/// Vector paths of the CPU kernels, narrowest first.
enum class SimdLevel { scalar, avx2, avx512 };

/// The widest path this CPU supports (AVX2 needs FMA too; AVX-512 needs F, BW and VL).
SimdLevel detect_simd_level();

/// The path kernels use: detect_simd_level(), or lower if MEGATRAIN_SIMD=scalar|avx2|avx512 asks
/// for it (a request above what the CPU has is clamped, with a warning).
SimdLevel active_simd_level();

constexpr std::string_view simd_level_name(SimdLevel l) {
  switch (l) {
    case SimdLevel::scalar: return "scalar";
    case SimdLevel::avx2: return "avx2";
    case SimdLevel::avx512: return "avx512";
  }
  return "?";
}

}  // namespace megatrain
