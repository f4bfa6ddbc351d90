// The individual vector paths behind megatrain::convert, for tests and benchmarks that compare
// them. Applications call megatrain::convert, which picks active_simd_level().
#pragma once

#include <cstddef>
#include <cstdint>

#include "megatrain/core/cpu_features.hpp"

namespace megatrain::detail {
void convert_f32_to_bf16(SimdLevel level, const float* in, std::uint16_t* out, std::size_t n);
void convert_bf16_to_f32(SimdLevel level, const std::uint16_t* in, float* out, std::size_t n);
void convert_f32_to_f16(SimdLevel level, const float* in, std::uint16_t* out, std::size_t n);
void convert_f16_to_f32(SimdLevel level, const std::uint16_t* in, float* out, std::size_t n);
}  // namespace megatrain::detail
