// Decoding with caches on the GPU (ChunkShape::decode): one new token a row, its attention over
// the row's cached keys and values, and Gated DeltaNet's step after the row's cached convolution
// taps and fp32 state. The same arithmetic as the CPU reference (backend/cpu/attention_decode.hpp,
// backend/cpu/gated_deltanet_decode.hpp), on bf16 operands with fp32 accumulation.
// Implemented in src/cuda/decode.cu.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "megatrain/core/dtype.hpp"

namespace megatrain::cuda {

/// Row r's token at positions[r] (device memory) of cache row first + r: its key and value
/// (k, v: [rows, kv_heads * head_dim]) written into the caches ([cache rows, capacity, kv_heads *
/// head_dim]), then its query (q: [rows, heads * head_dim]) over the cached keys 0 .. position
/// (window > 0: the last `window` of them), softmax scaled by `scale`, with each head's sink logit
/// (sinks: [heads] fp32, or null) in the denominator: out [rows, heads * head_dim]. head_dim a
/// multiple of 32, at most 256.
void launch_attention_decode(const bf16* q, const bf16* k, const bf16* v, bf16* kcache, bf16* vcache,
                             const std::int32_t* positions, std::int64_t rows, std::int64_t first, std::int64_t capacity,
                             std::int64_t heads, std::int64_t kv_heads, std::int64_t head_dim, float scale, std::int64_t window,
                             const float* sinks, bf16* out, cudaStream_t stream);

/// Gated DeltaNet's step for one token a row: mixed [rows, conv_dim], z [rows, value_heads * dv],
/// a and b [rows, value_heads] (bf16); conv [conv_dim, taps] (bf16), A_log, dt_bias [value_heads]
/// and norm [dv] (fp32); row r's cache is row first + r of taps ([cache rows, taps - 1,
/// conv_dim], bf16) and state ([cache rows, value_heads, dk, dv], fp32), both updated (a token
/// at position 0 starts from zeros). y: [rows, value_heads * dv].
struct DeltaNetDecodeArgs {
  std::int64_t rows = 0, first = 0, key_heads = 0, value_heads = 0, dk = 0, dv = 0, taps = 0;
  double norm_eps = 1e-6;
  const std::int32_t* positions = nullptr;
  const bf16 *mixed = nullptr, *z = nullptr, *a = nullptr, *b = nullptr, *conv = nullptr;
  const float *A_log = nullptr, *dt_bias = nullptr, *norm = nullptr;
  bf16* taps_cache = nullptr;
  float* state = nullptr;
  bf16* y = nullptr;
};
void launch_deltanet_decode(const DeltaNetDecodeArgs& m, cudaStream_t stream);

}  // namespace megatrain::cuda
