// Launchers of Gated DeltaNet's mixing on the GPU (src/cuda/gated_deltanet.cu): the same
// computation as the CPU reference (backend/cpu/gated_deltanet_mix.hpp), on bf16 operands with
// every intermediate in fp32 (the delta rule's state included).
//
// The forward: the causal convolution with SiLU, the L2 norms, the gates, the chunked delta rule
// (one block per sequence, value head and slice of 32 value columns, walking its chunks with the
// state in shared memory), the gated RMSNorm. The backward recomputes the forward's inputs to the
// rule and each chunk's starting state, walks the chunks in reverse for the state's gradient
// (one block per sequence, head and slice), then takes every chunk's q, k, g and beta gradients
// at once (one block per chunk and value head), and the element-wise backwards. Deterministic:
// no float atomics; the weights' gradients are summed per segment of tokens, then in order.
//
// Both take the tokens a window at a time (delta_net_window_tokens: the workspace stays bounded
// at any length). A window ends where a chunk of its last sequence ends; a sequence that crosses
// it carries its state into the next window (the forward) or its state's gradient into the one
// before (the backward, which walks the windows in reverse after a forward pass that keeps each
// window's starting state). The convolution reads the tokens before a window from the input, and
// its input gradient the first taps - 1 rows of the next window from a copy kept for it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>

#include "megatrain/backend/delta_net_shape.hpp"
#include "megatrain/core/dtype.hpp"

namespace megatrain::cuda {

/// Where the sequences of a mixing's `tokens` tokens are.
struct DeltaNetSequences {
  std::int64_t tokens = 0;
  /// Packed: the sequences' starts then the end, in device memory, each less `base` ([count + 1]),
  /// the same in host memory (host_starts), and each token's position in its own sequence
  /// ([tokens]). Null: rows of `seq` tokens.
  const std::int32_t* starts = nullptr;
  std::int32_t base = 0;
  std::span<const std::int32_t> host_starts;
  const std::int32_t* positions = nullptr;
  std::int64_t count = 0;  ///< sequences
  std::int64_t seq = 0;    ///< (unpacked) tokens per row
  std::int64_t window = 0; ///< tokens a window (delta_net_window_tokens' `window`; 0: its default)
};

struct DeltaNetInputs {
  const bf16* mixed;  ///< [tokens, conv_dim]: q, k, v before the convolution
  const bf16* z;      ///< [tokens, value_dim]
  const bf16* a;      ///< [tokens, value_heads]
  const bf16* b;      ///< [tokens, value_heads]
  const bf16* conv;   ///< [conv_dim, taps]
  const float* A_log;    ///< [value_heads]
  const float* dt_bias;  ///< [value_heads]
  const float* norm;     ///< [dv]
};

/// dmixed, dz, da, db overwritten; dconv, dA_log, ddt_bias, dnorm added to.
struct DeltaNetGrads {
  bf16 *mixed, *z, *a, *b;
  float *conv, *A_log, *dt_bias, *norm;
};

/// Throws naming what the kernels do not take (a key head wider than kDeltaRuleMaxKeyDim).
void check_delta_net_shape(const DeltaNetShape& s);

/// o: [tokens, value_dim] (the delta rule's output), rstd: [tokens * value_heads], y: [tokens,
/// value_dim]; workspace: delta_net_workspace_bytes(s, tokens, count, false, window).
void launch_delta_net_forward(const DeltaNetShape& s, const DeltaNetSequences& q, const DeltaNetInputs& in, bf16* o,
                              float* rstd, bf16* y, void* workspace, std::size_t bytes, cudaStream_t stream);
/// From dy and the forward's o and rstd; workspace: delta_net_workspace_bytes(..., true).
void launch_delta_net_backward(const DeltaNetShape& s, const DeltaNetSequences& q, const DeltaNetInputs& in,
                               const bf16* o, const float* rstd, const bf16* dy, const DeltaNetGrads& g, void* workspace,
                               std::size_t bytes, cudaStream_t stream);

/// Qwen3-Next's fused projections of n tokens (qkvz [n, conv_dim + value_dim], ba [n, 2 value_heads],
/// grouped per key head) to the separate layout (mixed [n, conv_dim], z, b, a), or back (to_fused).
void launch_delta_net_fused_layout(const DeltaNetShape& s, std::int64_t n, bf16* qkvz, bf16* ba, bf16* mixed, bf16* z, bf16* b,
                                   bf16* a, bool to_fused, cudaStream_t stream);

}  // namespace megatrain::cuda
