// What Qwen3.5's, Qwen3.5-MoE's and Qwen3-Next's config.json share: the hybrid layer pattern
// (layer_types, or every full_attention_interval-th layer full attention and the rest Gated
// DeltaNet), the linear attention's linear_* fields, the gated attention's head_dim and partial
// rotary defaults. Private to src/model.
#pragma once

#include "common.hpp"

namespace megatrain::model_families {

/// The defaults of a hybrid family's config class where config.json leaves a field out.
struct HybridDefaults {
  std::int64_t key_value_heads;  ///< num_key_value_heads (Qwen3.5: 4; Qwen3.5-MoE, Qwen3-Next: 2)
  bool fused;                    ///< Qwen3-Next's fused in_proj_qkvz / in_proj_ba
};
/// Reads the attention bias, head_dim, partial rotary, linear attention and layer pattern fields.
void parse_hybrid(const json& j, std::string_view src, ModelConfig& c, const HybridDefaults& d);
/// Only full_attention and linear_attention layers, no window.
void check_hybrid(const ModelConfig& c, std::string_view src);
/// The fields parse_hybrid reads, as it reads them back.
void write_hybrid(const ModelConfig& c, json& j);

/// The mixture-of-experts families among them (Qwen3.5-MoE, Qwen3-Next): the experts' fields
/// (parse_moe with `d`) and the shared expert's size; output_router_logits refused.
void parse_hybrid_moe(const json& j, std::string_view src, ModelConfig& c, const MoeDefaults& d);
/// check_hybrid, check_moe and a shared expert of [1, 2^24]; `dense_layers` as check_moe's.
void check_hybrid_moe(const ModelConfig& c, std::string_view src, bool dense_layers);
/// write_hybrid, write_moe and the experts' sizes.
void write_hybrid_moe(const ModelConfig& c, json& j, bool writes_norm_topk_prob);

}  // namespace megatrain::model_families
