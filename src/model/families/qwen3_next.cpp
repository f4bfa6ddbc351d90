// Qwen3-Next (Qwen3NextForCausalLM, Qwen3-Next-80B-A3B): the hybrid of Gated DeltaNet and gated
// full attention layers (hybrid.hpp) with the linear attention's projections fused as its
// checkpoints hold them (in_proj_qkvz, in_proj_ba: grouped per key head), and a mixture of
// experts with a shared expert gated per token (MoeMlp) on the sparse layers; the layers listed in
// mlp_only_layers, and those decoder_sparse_step skips, have a dense SwiGLU MLP of
// intermediate_size. The defaults are those of transformers 5.17's Qwen3NextConfig.
#include "hybrid.hpp"

namespace megatrain::model_families {
namespace {

void parse(const json& j, std::string_view src, ModelConfig& c) {
  parse_hybrid(j, src, c, {.key_value_heads = 2, .fused = true});
  parse_hybrid_moe(j, src, c, {.num_experts = 512, .experts_per_token = 10, .router_aux_loss_coef = 0.001,
                               .expert_size_key = "moe_intermediate_size", .expert_size = 512, .norm_topk_prob = true});
  parse_dense_layers(j, src, c);
}

void check(const ModelConfig& c, std::string_view src) { check_hybrid_moe(c, src, /*dense_layers=*/true); }

void write(const ModelConfig& c, json& j) {
  write_hybrid_moe(c, j, /*writes_norm_topk_prob=*/true);
  j["decoder_sparse_step"] = c.moe.decoder_sparse_step;
  j["mlp_only_layers"] = c.moe.dense_layers;
}

}  // namespace

extern const Family kQwen3Next;  // (declared first: the table in families.cpp names it)
const Family kQwen3Next{Architecture::qwen3_next, "Qwen3NextForCausalLM", "qwen3_next", 32768, 10000.0, false, std::nullopt,
                        BlockRecipe{.qk_norm = BlockRecipe::QkNorm::per_head,
                                    .unit_offset_norms = true,
                                    .attention_output_gate = true,
                                    .linear_attention = true,
                                    .moe = true},
                        parse, check, write};

}  // namespace megatrain::model_families
