// GPT-OSS (GptOssForCausalLM): a learned sink per attention head, q/k/v/o biases, sliding (a window
// of 128) and full layers alternating per layer_types with one rotary table (yarn by default,
// untruncated), a biased router whose top-k logits are softmaxed, experts with biases and the
// clamped SwiGLU, stacked and fused in the checkpoint (gate and up interleaved; MXFP4 blocks and
// scales in the published ones, which io::HfCheckpoint dequantizes; another quantization is
// refused). The defaults are GptOssConfig's (transformers 5.17).
#include "common.hpp"

#include <algorithm>

namespace megatrain::model_families {
namespace {

void parse(const json& j, std::string_view src, ModelConfig& c) {
  refuse_mlp_bias(j, src, c.architecture_name());
  c.qkv_bias = c.o_bias = get_bool(j, "attention_bias", src, true);
  if (given(j, "sliding_window")) c.sliding_window = get_int(j, "sliding_window", src);
  else if (!j.contains("sliding_window")) c.sliding_window = 128;
  c.layer_types = read_layer_types(j, src, c.num_hidden_layers, [](std::int64_t i) { return (i + 1) % 2 != 0; });
  if (!c.sliding_window)  // (null: no window)
    std::fill(c.layer_types.begin(), c.layer_types.end(), TokenMixerKind::full_attention);
  const bool rope_params = given(j, "rope_parameters") && j.at("rope_parameters").is_object();
  if (!given(j, "rope_scaling") && !(rope_params && given(j.at("rope_parameters"), "rope_type"))) {
    c.rope_scaling = RopeScaling{};
    c.rope_scaling.type = RopeScaling::Type::yarn;
    c.rope_scaling.factor = 32.0;
    c.rope_scaling.original_max_position_embeddings = 4096;
    c.rope_scaling.truncate = false;
  }
  if (given(j, "swiglu_limit"))
    MT_CHECK(get_double(j, "swiglu_limit", src) == kClampedSwigluLimit,
             "{}: swiglu_limit is {}, but transformers' GptOssExperts clamps at {} whatever the config says; megatrain "
             "trains the model transformers runs, so set it to {}", src, get_double(j, "swiglu_limit", src),
             kClampedSwigluLimit, kClampedSwigluLimit);
  if (given(j, "quantization_config")) {
    const json& q = j.at("quantization_config");
    const bool mxfp4 = q.is_object() && q.contains("quant_method") && q.at("quant_method") == "mxfp4";
    MT_CHECK(mxfp4, "{}: quantization_config {} is not supported; megatrain reads GPT-OSS's MXFP4 experts (quant_method "
             "\"mxfp4\", dequantized at load) or unquantized weights", src, q.dump());
  }
  // (the softmax of the top-k logits: the renormalised top k of the softmax)
  parse_moe(j, src, c, {.num_experts = 128, .experts_per_token = 4, .router_aux_loss_coef = 0.001,
                        .reads_norm_topk_prob = false});
}

void check(const ModelConfig& c, std::string_view src) {
  check_attention_bias_only(c, src);
  check_moe(c, src, /*dense_layers=*/false);
  MT_CHECK(c.moe.norm_topk_prob, "{}: {} always renormalises its top-k weights", src, c.architecture_name());
}

// as transformers 5 writes it: the rotary parameters in rope_parameters, the layer types
void write(const ModelConfig& c, json& j) {
  j["attention_bias"] = c.qkv_bias;
  j.erase("rope_theta");
  j.erase("rope_scaling");
  j["rope_parameters"] = rope_parameters_json(c);
  j["sliding_window"] = window_json(c);
  j["layer_types"] = layer_types_json(c);
  j["attention_dropout"] = 0.0;
  write_moe(c, j, /*writes_norm_topk_prob=*/false);
  j.erase("num_experts");  // (GptOssConfig maps num_experts onto num_local_experts; one name suffices)
}

}  // namespace

extern const Family kGptOss;  // (declared first: the table in families.cpp names it)
const Family kGptOss{Architecture::gpt_oss, "GptOssForCausalLM", "gpt_oss", 131072, 150000.0, false, std::nullopt,
                            BlockRecipe{.attention_sinks = true,
                                        .per_layer_windows = true,
                                        .moe = true,
                                        .router = "router",
                                        .expert_activation = Activation::clamped_swiglu,
                                        .moe_biases = true,
                                        .fused_experts = true},
                            parse, check, write};

}  // namespace megatrain::model_families
