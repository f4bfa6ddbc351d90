// The decoder block of the shipped families (Llama, Mistral, Qwen2/3, Phi-3, Gemma 3, SmolLM3,
// Qwen3-MoE, Mixtral, OLMoE, GPT-OSS): a ComposedBlock (composed_block.hpp) whose layers each
// take their token mixer and channel mixer from ModelConfig::layer_kind:
//
//   token mixer    SelfAttention (self_attention.hpp): full attention, or within a sliding
//                  window (config.json's layer_types: sliding_attention); GatedDeltaNet
//                  (gated_deltanet.hpp) on Qwen3.5's linear_attention layers, on backends that
//                  provide its primitives (LinearAttentionBackend: the CPU and CUDA backends)
//   channel mixer  SwiGluMlp (swiglu_mlp.hpp) on the dense layers, MoeMlp (moe_mlp.hpp: router and
//                  experts) on the sparse ones; MoeMlp runs on backends that provide its
//                  primitives (MoeBackend: the CPU and CUDA backends), elsewhere it is refused
//
// A block of other mixers is another ComposedBlock (docs/layers.md#mixers).
#pragma once

#include <variant>

#include "megatrain/layers/ops/composed_block.hpp"
#include "megatrain/layers/ops/gated_deltanet.hpp"
#include "megatrain/layers/ops/moe_mlp.hpp"
#include "megatrain/layers/ops/self_attention.hpp"
#include "megatrain/layers/ops/swiglu_mlp.hpp"

namespace megatrain {

/// The token mixers of the shipped families.
using TokenMixers = std::variant<SelfAttention, GatedDeltaNet>;
/// The channel mixers of the shipped families.
using ChannelMixers = std::variant<SwiGluMlp, MoeMlp>;

using DecoderBlock = ComposedBlock<TokenMixers, ChannelMixers>;

}  // namespace megatrain
