// The gated delta rule of Gated DeltaNet (Qwen3-Next's and Qwen3.5's linear attention) on the
// CPU: the reference the CUDA kernels are checked against, compiled once (src/cpu/delta_rule.cpp).
//
// Per value head, over each sequence, with a state S of dk x dv:
//
//     S_t = exp(g_t) S_{t-1} + k_t delta_t^T,   delta_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t)
//     o_t = scale * S_t^T q_t
//
// q and k are L2-normalised already; a value head reads key head h / (value_heads / key_heads),
// as transformers' repeat_interleave does. The state starts at zero at each sequence's start
// (packed rows: each example alone).
//
// Chunked, as the GPU computes it: C tokens at a time, the recurrence inside a chunk solved as
// one triangular system (the WY form),
//
//     G = cumsum(g) in the chunk,  A_ij = beta_i exp(G_i - G_j) k_i.k_j (j < i),  T = (I + A)^-1
//     delta = T (beta * (V - diag(exp G) K S))
//     O = scale * (diag(exp G) Q S + ((Q K^T) * exp(G_i - G_j), j <= i) delta)
//     S' = exp(G_C) S + sum_j exp(G_C - G_j) k_j delta_j^T
//
// and the state carried between chunks. The forward keeps each chunk's starting state for the
// backward, which walks the chunks in reverse through the same matrices.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

namespace megatrain::cpu {

/// Throws unless `starts` begins at 0 and rises (no empty sequence); `what` names the caller.
void check_sequence_starts(std::span<const std::int32_t> starts, std::string_view what);

/// The operands of the delta rule over `tokens` tokens. Token t's key head h is
/// q[t * q_stride + h * dk + i] (likewise k); its value head h is v[t * v_stride + h * dv + j];
/// g and beta are [tokens, value_heads]; o and dv are [tokens, value_heads * dv].
template <class T>
struct DeltaRule {
  std::int64_t key_heads = 0, value_heads = 0, dk = 0, dv = 0;
  std::int64_t chunk = 64;
  /// Where the sequences start, then where the last one ends (host memory; starts[0] = 0).
  std::span<const std::int32_t> starts;
  const T* q = nullptr;
  const T* k = nullptr;
  const T* v = nullptr;
  std::int64_t q_stride = 0, k_stride = 0, v_stride = 0;
  const T* g = nullptr;     ///< the decay's logarithm, <= 0
  const T* beta = nullptr;  ///< in (0, 1)
  double scale = 1.0;       ///< dk^-1/2 in Gated DeltaNet

  std::int64_t tokens() const { return starts.empty() ? 0 : starts.back(); }
  /// Chunks over all sequences: the states the forward keeps are [chunks, value_heads, dk, dv].
  std::int64_t chunks() const;
  /// Throws naming what does not fit (heads, sizes, starts).
  void check() const;
};

/// o = the rule's outputs; states = each chunk's starting state (chunks() x value_heads x dk x dv).
template <class T>
void delta_rule_forward(const DeltaRule<T>& a, T* o, T* states);

/// From do (the outputs' gradient) and the forward's states: dq and dk (key heads, as q and k are
/// laid out but dense: [tokens, key_heads * dk]), dv ([tokens, value_heads * dv]), dg and dbeta
/// ([tokens, value_heads]); each overwritten.
template <class T>
void delta_rule_backward(const DeltaRule<T>& a, const T* states, const T* dout, T* dq, T* dk, T* dv, T* dg, T* dbeta);

extern template struct DeltaRule<float>;
extern template struct DeltaRule<double>;
extern template void delta_rule_forward<float>(const DeltaRule<float>&, float*, float*);
extern template void delta_rule_forward<double>(const DeltaRule<double>&, double*, double*);
extern template void delta_rule_backward<float>(const DeltaRule<float>&, const float*, const float*, float*, float*, float*,
                                                float*, float*);
extern template void delta_rule_backward<double>(const DeltaRule<double>&, const double*, const double*, double*, double*,
                                                 double*, double*, double*);

}  // namespace megatrain::cpu
