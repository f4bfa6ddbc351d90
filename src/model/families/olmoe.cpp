// OLMoE (OlmoeForCausalLM): q and k RMS-normalised over each token's whole projection (not per
// head), attention_bias, a mixture of experts on every layer. clip_qkv is refused.
#include "common.hpp"

namespace megatrain::model_families {
namespace {

void parse(const json& j, std::string_view src, ModelConfig& c) {
  refuse_mlp_bias(j, src, c.architecture_name());
  c.qkv_bias = c.o_bias = get_bool(j, "attention_bias", src, false);
  parse_moe(j, src, c, {.num_experts = 64, .experts_per_token = 8, .router_aux_loss_coef = 0.01});
  MT_CHECK(!given(j, "clip_qkv"),
           "{}: clip_qkv is {}: clamping the q, k and v projections is not supported; OLMoE's published models have "
           "it null", src, j.contains("clip_qkv") ? j.at("clip_qkv").dump() : "");
}

void check(const ModelConfig& c, std::string_view src) {
  check_attention_bias_only(c, src);
  check_moe(c, src, /*dense_layers=*/false);
}

void write(const ModelConfig& c, json& j) {
  j["attention_bias"] = c.qkv_bias;
  write_moe(c, j, /*writes_norm_topk_prob=*/true);
  j["clip_qkv"] = nullptr;
}

}  // namespace

// (OlmoeConfig's pad_token_id is 1)
extern const Family kOlmoe;  // (declared first: the table in families.cpp names it)
const Family kOlmoe{Architecture::olmoe, "OlmoeForCausalLM", "olmoe", 4096, 10000.0, false, 1,
                           BlockRecipe{.qk_norm = BlockRecipe::QkNorm::whole, .moe = true}, parse, check, write};

}  // namespace megatrain::model_families
