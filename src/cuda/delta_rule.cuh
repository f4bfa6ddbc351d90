// The chunked delta rule's kernels (src/cuda/delta_rule.cu), as gated_deltanet.cu runs them over
// a window of tokens. Internal: not installed.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common.cuh"
#include "megatrain/backend/delta_net_shape.hpp"

namespace megatrain::cuda::delta_rule {

using common::bf;
using common::i64;

// The rule over a window: its pieces of sequences (starts, chunk_first: [sequences + 1], window-
// relative) and, for each token, c's normalised q and k and its v, g and beta.
struct Rule {
  int Hk, Hv, dk, dv;
  i64 kd, cd;  // key_dim, conv_dim: c's row is [q | k | v]
  float scale;
  const float* c;  // [T, cd]: normalised q and k, v
  const float* g;
  const float* beta;
  const std::int32_t* starts;
  const std::int32_t* chunk_first;
  i64 sequences;
  // A sequence crossing the window's start (piece 0, if carry_in) or end (the last piece, if
  // carry_out): its state (or the state's gradient) at the crossing, [Hv, dk, dv] each.
  bool carry_in, carry_out;
  const float* state_in;
  float* state_out;
  __device__ int key_head(int h) const { return h / (Hv / Hk); }
  __device__ i64 vd() const { return static_cast<i64>(Hv) * dv; }
};

/// A window's scratch, in fp32: W ([tokens, Hv, dk]) and U ([tokens, vd]) are the rows of
/// T diag(beta exp(G)) K and T diag(beta) V (forward), then of T^T diag(exp(G_last - G)) K and
/// scale T^T M^T dO (state_grad); T ([chunks, Hv, C, C]) = (I + A)^-1 of each chunk.
struct Scratch {
  float *W, *U, *T;
};

/// The chunks' own products (W, U, T: in parallel), the state walked through the chunks (a block
/// a piece, value head and 32 columns: each chunk's starting state into states [chunks, Hv, dk,
/// dv] and delta [tokens, vd], either may be null; the carries), then o (bf16, if not null: in
/// parallel, which needs states and delta).
void forward(const Rule& r, i64 chunks, const Scratch& w, bf* o, float* states, float* delta, cudaStream_t stream);
/// From dO ([tokens, vd]) and forward's T: each chunk's W and U for the gradient, then the chunks
/// in reverse: each chunk's end-state gradient (dstates) and dr.
void state_grad(const Rule& r, i64 chunks, const Scratch& w, const float* dO, float* dstates, float* dr, cudaStream_t stream);
/// Block (chunk, value head): dq and dk per value head ([tokens, Hv, dk]), dg and dbeta ([tokens, Hv]).
void chunk_grad(const Rule& r, i64 chunks, const float* states, const float* dstates, const float* delta, const float* dr,
                const float* dO, float* dq, float* dk, float* dg, float* dbeta, cudaStream_t stream);

}  // namespace megatrain::cuda::delta_rule
