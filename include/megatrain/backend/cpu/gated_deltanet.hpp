// The element-wise parts of Gated DeltaNet (Qwen3-Next's and Qwen3.5's linear attention) on the
// CPU, besides the delta rule itself (delta_rule.hpp); compiled once (src/cpu/gated_deltanet.cpp).
//
//   causal convolution   y[t, c] = silu(sum_j w[c, j] x[t - K + 1 + j, c]), a depthwise kernel of K
//                        taps over each sequence (zeros before its start: packed examples alone)
//   L2 norm              y = x / sqrt(sum x^2 + eps) for each head's vector (q and k; eps 1e-6)
//   gates                g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), per value head
//   gated RMSNorm        y = w * x / sqrt(mean x^2 + eps) * silu(z), each value head's vector
//
// Each backward overwrites the inputs' gradients and adds to the weights'. Rows are tokens; a
// stride gives the elements between two tokens' rows where a tensor is a slice of a wider one.
#pragma once

#include <cstdint>
#include <span>

namespace megatrain::cpu {

/// x, y: [tokens, channels] (row strides xs, ys); w: [channels, taps]; starts: the sequences'
/// starts, then the end (host memory, starts[0] = 0).
template <class T>
void causal_conv_silu(const T* x, std::int64_t xs, const T* w, std::int64_t channels, std::int64_t taps,
                      std::span<const std::int32_t> starts, T* y, std::int64_t ys);
/// dx (overwritten; row stride xs as x's) and dw (+=) from dy, recomputing the pre-activation.
template <class T>
void causal_conv_silu_backward(const T* x, std::int64_t xs, const T* w, std::int64_t channels, std::int64_t taps,
                               std::span<const std::int32_t> starts, const T* dy, std::int64_t ys, T* dx, T* dw);

/// x: [tokens, heads * dim] (row stride xs), each head's dim elements a vector; y dense
/// [tokens, heads * dim]; inv[tokens * heads]: each vector's scale, kept for the backward.
template <class T>
void l2norm_heads(const T* x, std::int64_t xs, std::int64_t tokens, std::int64_t heads, std::int64_t dim, double eps,
                  T* y, T* inv);
/// dx (row stride xs) from dy (dense), y and inv of the forward.
template <class T>
void l2norm_heads_backward(const T* y, const T* inv, const T* dy, std::int64_t tokens, std::int64_t heads,
                           std::int64_t dim, T* dx, std::int64_t xs);

/// a, b: [tokens, heads] (row strides as, bs); A_log, dt_bias: [heads]; g, beta dense [tokens, heads].
template <class T>
void deltanet_gates(const T* a, std::int64_t as, const T* b, std::int64_t bs, const T* A_log, const T* dt_bias,
                    std::int64_t tokens, std::int64_t heads, T* g, T* beta);
/// da, db (row strides as, bs; overwritten), dA_log and ddt_bias (+=) from dg and dbeta.
template <class T>
void deltanet_gates_backward(const T* a, std::int64_t as, std::int64_t bs, const T* A_log, const T* dt_bias, const T* g,
                             const T* beta,
                             const T* dg, const T* dbeta, std::int64_t tokens, std::int64_t heads, T* da, T* db,
                             T* dA_log, T* ddt_bias);

/// x, y dense [tokens, heads * dim]; z [tokens, heads * dim] with row stride zs; w: [dim];
/// rstd[tokens * heads] kept for the backward.
template <class T>
void gated_rmsnorm(const T* x, const T* z, std::int64_t zs, const T* w, std::int64_t tokens, std::int64_t heads,
                   std::int64_t dim, double eps, T* y, T* rstd);
/// dx (dense) and dz (row stride zs) overwritten, dw added to, from dy.
template <class T>
void gated_rmsnorm_backward(const T* x, const T* z, std::int64_t zs, const T* w, const T* rstd, const T* dy,
                            std::int64_t tokens, std::int64_t heads, std::int64_t dim, T* dx, T* dz, T* dw);

}  // namespace megatrain::cpu
