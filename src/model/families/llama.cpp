// Llama 2 and 3.x (LlamaForCausalLM): the plain pre-norm block, SwiGLU, one attention_bias for
// q/k/v and o_proj, an mlp_bias for the MLP.
#include "common.hpp"

namespace megatrain::model_families {
namespace {

void parse(const json& j, std::string_view src, ModelConfig& c) {
  c.qkv_bias = c.o_bias = get_bool(j, "attention_bias", src, false);
  c.mlp_bias = get_bool(j, "mlp_bias", src, false);
}

void write(const ModelConfig& c, json& j) {
  j["attention_bias"] = c.qkv_bias;
  j["mlp_bias"] = c.mlp_bias;
}

}  // namespace

extern const Family kLlama;  // (declared first: the table in families.cpp names it)
const Family kLlama{Architecture::llama, "LlamaForCausalLM", "llama", 2048, 10000.0, false, std::nullopt,
                           BlockRecipe{}, parse, check_llama_biases, write};

}  // namespace megatrain::model_families
