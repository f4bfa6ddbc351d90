// Gated DeltaNet's mixing for one new token a row, on the CPU: the decoding step of its cache
// (ChunkShape::decode), compiled once (src/cpu/gated_deltanet_decode.cpp).
//
// Each row's cache holds what the chunked mixing (gated_deltanet_mix.hpp) carries along its
// sequence: the convolution's last taps - 1 inputs (zeros before the sequence's start) and the
// delta rule's state S (value_heads x dk x dv). A token at position 0 starts from zeros. The
// token's step is then the rule itself:
//
//     S = exp(g) S,  delta = beta (v - S^T k),  S = S + k delta^T,  o = scale S^T q
//
// with the convolution, the norms, the gates and the gated RMSNorm as the chunked mixing has them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "megatrain/backend/cpu/gated_deltanet_mix.hpp"

namespace megatrain::cpu {

/// A row's cache in elements of T: the taps, then the state.
inline std::int64_t deltanet_taps_elements(std::int64_t conv_dim, std::int64_t taps) { return (taps - 1) * conv_dim; }
inline std::int64_t deltanet_state_elements(std::int64_t value_heads, std::int64_t dk, std::int64_t dv) {
  return value_heads * dk * dv;
}

/// m's operands hold one token a row (m.starts = 0, 1, ..., rows); row r's token is at
/// positions[r] of its sequence and its cache is cache row first + r of `taps` ([cache rows,
/// taps - 1, conv_dim]) and `state` ([cache rows, value_heads, dk, dv]), both updated. y: the
/// mixing's output [rows, value_dim].
template <class T>
void gated_deltanet_decode(const GatedDeltaNetMix<T>& m, std::span<const std::int32_t> positions, std::int64_t first, T* taps,
                           T* state, T* y);

extern template void gated_deltanet_decode<float>(const GatedDeltaNetMix<float>&, std::span<const std::int32_t>, std::int64_t,
                                                  float*, float*, float*);
extern template void gated_deltanet_decode<double>(const GatedDeltaNetMix<double>&, std::span<const std::int32_t>,
                                                   std::int64_t, double*, double*, double*);

}  // namespace megatrain::cpu
