// Qwen2 and Qwen2.5 (Qwen2ForCausalLM): Llama's block with biases on q, k and v (always) and none
// on o_proj or the MLP.
#include "common.hpp"

namespace megatrain::model_families {
namespace {

void parse(const json& j, std::string_view src, ModelConfig& c) {
  refuse_bias_keys(j, src, c.architecture_name(), "its q/k/v projections always have a bias, its o_proj and MLP never do");
  c.qkv_bias = true;
  if (get_bool(j, "use_sliding_window", src, false)) c.sliding_window = get_int(j, "sliding_window", src);
}

void check(const ModelConfig& c, std::string_view src) {
  MT_CHECK(c.qkv_bias && !c.o_bias && !c.mlp_bias, "{}: {} has q/k/v biases and no o_proj or MLP bias (got qkv_bias {}, "
           "o_bias {}, mlp_bias {})", src, c.architecture_name(), c.qkv_bias, c.o_bias, c.mlp_bias);
}

void write(const ModelConfig& c, json& j) {
  j["use_sliding_window"] = c.sliding_window.has_value();
  j["sliding_window"] = window_json(c);
  write_full_layer_types(c, j);
}

}  // namespace

extern const Family kQwen2;  // (declared first: the table in families.cpp names it)
const Family kQwen2{Architecture::qwen2, "Qwen2ForCausalLM", "qwen2", 32768, 10000.0, false, std::nullopt,
                           BlockRecipe{}, parse, check, write};

}  // namespace megatrain::model_families
