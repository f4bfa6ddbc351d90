// Qwen3.5-MoE (Qwen3_5MoeForCausalLM, the text model of Qwen3.5-122B-A10B and 397B-A17B):
// Qwen3.5's hybrid of Gated DeltaNet and gated full attention layers (hybrid.hpp), and on every
// layer a mixture of experts of moe_intermediate_size each with a shared expert of
// shared_expert_intermediate_size gated per token (MoeMlp). The router's top-k weights are always
// renormalised (its config class has no norm_topk_prob), and the class has no intermediate_size:
// there is no dense MLP. The defaults are those of transformers 5.17's Qwen3_5MoeTextConfig.
#include "hybrid.hpp"

namespace megatrain::model_families {
namespace {

void parse(const json& j, std::string_view src, ModelConfig& c) {
  parse_hybrid(j, src, c, {.key_value_heads = 2, .fused = false});
  parse_hybrid_moe(j, src, c, {.num_experts = 256, .experts_per_token = 8, .router_aux_loss_coef = 0.001,
                               .expert_size_key = "moe_intermediate_size", .expert_size = 512,
                               .reads_norm_topk_prob = false});
}

void check(const ModelConfig& c, std::string_view src) { check_hybrid_moe(c, src, /*dense_layers=*/false); }

void write(const ModelConfig& c, json& j) {
  write_hybrid_moe(c, j, /*writes_norm_topk_prob=*/false);
  j.erase("intermediate_size");  // (the config class has none)
}

}  // namespace

extern const Family kQwen3_5Moe;  // (declared first: the table in families.cpp names it)
const Family kQwen3_5Moe{Architecture::qwen3_5_moe, "Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", 32768, 10000.0, false,
                         std::nullopt,
                         BlockRecipe{.qk_norm = BlockRecipe::QkNorm::per_head,
                                     .unit_offset_norms = true,
                                     .attention_output_gate = true,
                                     .linear_attention = true,
                                     .moe = true,
                                     .every_layer_sparse = true,
                                     .stacked_experts = true},
                         parse, check, write};

}  // namespace megatrain::model_families
