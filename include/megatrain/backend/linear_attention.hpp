// Gated DeltaNet's mixing operands in a device backend's memory (layers/ops/gated_deltanet.hpp
// builds them; the CUDA backend runs them). The CPU backend takes cpu::GatedDeltaNetMix instead.
#pragma once

#include "megatrain/backend/backend.hpp"
#include "megatrain/backend/delta_net_shape.hpp"

namespace megatrain {

/// The mixing of cfg's linear-attention layers (cfg.linear_attention), as the kernels see it.
inline DeltaNetShape delta_net_shape(const ModelConfig& cfg) {
  const auto& la = cfg.linear_attention;
  return {la.key_heads, la.value_heads, la.key_head_dim, la.value_head_dim, la.conv_kernel, cfg.rms_norm_eps};
}
/// Whether any layer of cfg is a linear-attention one.
inline bool has_linear_attention(const ModelConfig& cfg) {
  for (std::int64_t l = 0; l < cfg.num_hidden_layers; ++l)
    if (cfg.layer_kind(l).token_mixer == TokenMixerKind::linear_attention) return true;
  return false;
}

/// A mixing's operands in a device backend's memory (the CPU's are cpu::GatedDeltaNetMix): the
/// projections (A), the convolution (W) and the per-head parameters and gain (F, fp32).
template <class A, class W, class F>
struct DeltaNetOperands {
  DeltaNetShape shape;
  ChunkShape chunk;  ///< its tokens, and the sequences they hold (rows, or packed)
  View<const A> mixed, z, a, b;  ///< [tokens, conv_dim], [tokens, value_dim], [tokens, value_heads] x 2
  View<const W> conv;            ///< [conv_dim, 1, taps]
  View<const F> A_log, dt_bias, norm;
};
/// The operands of `chunk`'s tokens over contiguous buffers, each given its shape: mixed
/// [tokens, conv_dim], z [tokens, value_dim], a and b [tokens, value_heads], conv [conv_dim, 1,
/// taps], A_log and dt_bias [value_heads], norm [dv].
template <class A, class W, class F>
DeltaNetOperands<A, W, F> delta_net_operands(const DeltaNetShape& s, ChunkShape chunk, std::span<const A> mixed,
                                             std::span<const A> z, std::span<const A> a, std::span<const A> b,
                                             std::span<const W> conv, std::span<const F> A_log, std::span<const F> dt_bias,
                                             std::span<const F> norm) {
  const std::int64_t T = chunk.tokens(), hv = s.value_heads;
  return {s,
          chunk,
          View<const A>(mixed, Shape{T, s.conv_dim()}),
          View<const A>(z, Shape{T, s.value_dim()}),
          View<const A>(a, Shape{T, hv}),
          View<const A>(b, Shape{T, hv}),
          View<const W>(conv, Shape{s.conv_dim(), 1, s.taps}),
          View<const F>(A_log, Shape{hv}),
          View<const F>(dt_bias, Shape{hv}),
          View<const F>(norm, Shape{s.dv})};
}

/// Their gradients: the projections' overwritten, the parameters' added to.
template <class A, class G>
struct DeltaNetGradients {
  View<A> mixed, z, a, b;
  View<G> conv, A_log, dt_bias, norm;
};

}  // namespace megatrain
