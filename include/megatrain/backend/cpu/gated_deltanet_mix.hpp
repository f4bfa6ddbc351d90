// Gated DeltaNet's mixing on the CPU, between its input projections and its output projection:
// the reference the CUDA kernels are checked against, compiled once (src/cpu/gated_deltanet_mix.cpp).
//
//   mixed = [q | k | v]  (the qkv projection, conv_dim = 2 key_dim + value_dim channels)
//   c     = causal_conv_silu(mixed)          within each sequence
//   q, k  = l2norm of each key head of c's q and k parts
//   g     = -exp(A_log) softplus(a + dt_bias),  beta = sigmoid(b)
//   o     = the gated delta rule (q, k, c's v part, g, beta), a fresh state at each sequence
//   y     = norm * rmsnorm(o) * silu(z)        each value head
//
// as transformers' Qwen3_5GatedDeltaNet and Qwen3NextGatedDeltaNet compute them
// (gated_deltanet.hpp and delta_rule.hpp hold the parts). The forward keeps o and each value
// head's rstd; the backward recomputes the rest from mixed, a and b (the delta rule's chunk
// states included), in host memory of its own.
#pragma once

#include <cstdint>
#include <span>

namespace megatrain::cpu {

/// The operands of one chunk's mixing: `tokens` rows (starts.back()) of each, dense.
template <class T>
struct GatedDeltaNetMix {
  std::int64_t key_heads = 0, value_heads = 0, dk = 0, dv = 0, taps = 0;
  std::int64_t chunk = 64;  ///< the delta rule's chunk (delta_rule.hpp)
  double norm_eps = 1e-6;   ///< the gated RMSNorm's (config.json's rms_norm_eps)
  /// Where the sequences start, then where the last one ends (host memory; starts[0] = 0).
  std::span<const std::int32_t> starts;
  const T* mixed = nullptr;  ///< [tokens, conv_dim()]: q, k, v before the convolution
  const T* z = nullptr;      ///< [tokens, value_heads * dv]: the output gate
  const T* a = nullptr;      ///< [tokens, value_heads]: the decay's input
  const T* b = nullptr;      ///< [tokens, value_heads]: beta's input
  const T* conv = nullptr;   ///< [conv_dim(), taps]: conv1d.weight
  const T* A_log = nullptr;  ///< [value_heads]
  const T* dt_bias = nullptr;  ///< [value_heads]
  const T* norm = nullptr;   ///< [dv]: the gated RMSNorm's gain

  std::int64_t tokens() const { return starts.empty() ? 0 : starts.back(); }
  std::int64_t key_dim() const { return key_heads * dk; }
  std::int64_t value_dim() const { return value_heads * dv; }
  std::int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }
  /// Throws naming what does not fit (heads, sizes, starts).
  void check() const;
};

/// The gradients of a mixing's inputs: dmixed, dz, da, db overwritten (dense, as the inputs);
/// dconv, dA_log, ddt_bias, dnorm added to.
template <class T>
struct GatedDeltaNetMixGrads {
  T* mixed = nullptr;
  T* z = nullptr;
  T* a = nullptr;
  T* b = nullptr;
  T* conv = nullptr;
  T* A_log = nullptr;
  T* dt_bias = nullptr;
  T* norm = nullptr;
};

/// y = the mixing's output [tokens, value_dim]; o (the delta rule's output, [tokens, value_dim])
/// and rstd ([tokens * value_heads]) kept for the backward.
template <class T>
void gated_deltanet_mix(const GatedDeltaNetMix<T>& m, T* o, T* rstd, T* y);

/// From dy (the output's gradient) and the forward's o and rstd.
template <class T>
void gated_deltanet_mix_backward(const GatedDeltaNetMix<T>& m, const T* o, const T* rstd, const T* dy,
                                 const GatedDeltaNetMixGrads<T>& g);

extern template struct GatedDeltaNetMix<float>;
extern template struct GatedDeltaNetMix<double>;
extern template void gated_deltanet_mix<float>(const GatedDeltaNetMix<float>&, float*, float*, float*);
extern template void gated_deltanet_mix<double>(const GatedDeltaNetMix<double>&, double*, double*, double*);
extern template void gated_deltanet_mix_backward<float>(const GatedDeltaNetMix<float>&, const float*, const float*,
                                                        const float*, const GatedDeltaNetMixGrads<float>&);
extern template void gated_deltanet_mix_backward<double>(const GatedDeltaNetMix<double>&, const double*, const double*,
                                                         const double*, const GatedDeltaNetMixGrads<double>&);

}  // namespace megatrain::cpu
