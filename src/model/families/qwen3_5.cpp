// Qwen3.5 (Qwen3_5ForCausalLM, the text model): a hybrid of Gated DeltaNet layers
// (layer_types' linear_attention: linear_attn.*, layers/ops/gated_deltanet.hpp) and full
// attention layers whose q_proj also gives a sigmoid gate per head over the attention's output,
// with per-head q/k norms; every RMSNorm multiplies by (1 + w); the rotary embedding turns
// partial_rotary_factor of each head (0.25 unless config.json says); a SwiGLU MLP. The
// defaults are those of transformers 5.17's Qwen3_5TextConfig.
#include "hybrid.hpp"

namespace megatrain::model_families {
namespace {

void parse(const json& j, std::string_view src, ModelConfig& c) {
  parse_hybrid(j, src, c, {.key_value_heads = 4, .fused = false});
}

}  // namespace

extern const Family kQwen3_5;  // (declared first: the table in families.cpp names it)
const Family kQwen3_5{Architecture::qwen3_5, "Qwen3_5ForCausalLM", "qwen3_5_text", 32768, 10000.0, false, std::nullopt,
                      BlockRecipe{.qk_norm = BlockRecipe::QkNorm::per_head,
                                  .unit_offset_norms = true,
                                  .attention_output_gate = true,
                                  .linear_attention = true},
                      parse, check_hybrid, write_hybrid};

}  // namespace megatrain::model_families
