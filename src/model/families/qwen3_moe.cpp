// Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (per-head q/k norms, attention_bias) and a
// mixture of experts of moe_intermediate_size each on the sparse layers; the layers listed in
// mlp_only_layers, and those decoder_sparse_step skips, are dense.
#include "common.hpp"

namespace megatrain::model_families {
namespace {

void parse(const json& j, std::string_view src, ModelConfig& c) {
  refuse_mlp_bias(j, src, c.architecture_name());
  c.qkv_bias = c.o_bias = get_bool(j, "attention_bias", src, false);
  if (get_bool(j, "use_sliding_window", src, false)) c.sliding_window = get_int(j, "sliding_window", src, 4096);
  parse_moe(j, src, c, {.num_experts = 128, .experts_per_token = 8, .router_aux_loss_coef = 0.001,
                        .expert_size_key = "moe_intermediate_size", .expert_size = 768});
  parse_dense_layers(j, src, c);
}

void check(const ModelConfig& c, std::string_view src) {
  check_attention_bias_only(c, src);
  check_moe(c, src, /*dense_layers=*/true);
}

void write(const ModelConfig& c, json& j) {
  j["attention_bias"] = c.qkv_bias;
  write_moe(c, j, /*writes_norm_topk_prob=*/true);
  j["moe_intermediate_size"] = c.moe.intermediate_size;
  j["decoder_sparse_step"] = c.moe.decoder_sparse_step;
  j["mlp_only_layers"] = c.moe.dense_layers;
  j["use_sliding_window"] = c.sliding_window.has_value();
  j["sliding_window"] = window_json(c);
}

}  // namespace

extern const Family kQwen3Moe;  // (declared first: the table in families.cpp names it)
const Family kQwen3Moe{Architecture::qwen3_moe, "Qwen3MoeForCausalLM", "qwen3_moe", 32768, 10000.0, false,
                              std::nullopt, BlockRecipe{.qk_norm = BlockRecipe::QkNorm::per_head, .moe = true}, parse,
                              check, write};

}  // namespace megatrain::model_families
