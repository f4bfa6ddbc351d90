// Qwen3.5 (Qwen3_5ForCausalLM, the text model): a hybrid of Gated DeltaNet layers
// (layer_types' linear_attention: linear_attn.*, layers/ops/gated_deltanet.hpp) and full
// attention layers whose q_proj also gives a sigmoid gate per head over the attention's output,
// with per-head q/k norms; every RMSNorm multiplies by (1 + w); the rotary embedding turns
// partial_rotary_factor of each head (0.25 unless config.json says); a SwiGLU MLP. The
// defaults are those of transformers 5.17's Qwen3_5TextConfig.
#include "common.hpp"

namespace megatrain::model_families {
namespace {

void parse(const json& j, std::string_view src, ModelConfig& c) {
  refuse_mlp_bias(j, src, c.architecture_name());
  refuse_dropout(j, src, {"attention_dropout"});
  c.qkv_bias = c.o_bias = get_bool(j, "attention_bias", src, false);
  // Qwen3_5TextConfig's own defaults where config.json leaves them out
  if (!given(j, "head_dim")) c.head_dim = 256;
  if (!given(j, "num_key_value_heads")) c.num_key_value_heads = 4;
  const bool partial_given = given(j, "partial_rotary_factor") ||
                             (given(j, "rope_parameters") && j.at("rope_parameters").is_object() &&
                              j.at("rope_parameters").contains("partial_rotary_factor"));
  if (!partial_given) c.partial_rotary_factor = 0.25;
  auto& la = c.linear_attention;
  la.key_heads = get_int(j, "linear_num_key_heads", src, 16);
  la.value_heads = get_int(j, "linear_num_value_heads", src, 32);
  la.key_head_dim = get_int(j, "linear_key_head_dim", src, 128);
  la.value_head_dim = get_int(j, "linear_value_head_dim", src, 128);
  la.conv_kernel = get_int(j, "linear_conv_kernel_dim", src, 4);
  la.fused = false;
  // layer_types, or every full_attention_interval-th layer full attention and the rest linear
  if (given(j, "layer_types")) {
    c.layer_types = read_layer_types(j, src, c.num_hidden_layers, [](std::int64_t) { return false; });
  } else {
    const std::int64_t interval = get_int(j, "full_attention_interval", src, 4);
    MT_CHECK(interval > 0, "{}: full_attention_interval must be > 0 (got {})", src, interval);
    c.layer_types.assign(static_cast<std::size_t>(c.num_hidden_layers), TokenMixerKind::linear_attention);
    for (std::int64_t l = interval - 1; l < c.num_hidden_layers; l += interval)
      c.layer_types[static_cast<std::size_t>(l)] = TokenMixerKind::full_attention;
  }
}

void check(const ModelConfig& c, std::string_view src) {
  check_attention_bias_only(c, src);
  for (std::size_t l = 0; l < c.layer_types.size(); ++l)
    MT_CHECK(c.layer_types[l] != TokenMixerKind::sliding_attention,
             "{}: layer_types makes layer {} a sliding_attention layer; {} has only full_attention and linear_attention "
             "layers", src, l, c.architecture_name());
  MT_CHECK(!c.sliding_window, "{}: {} has no sliding window", src, c.architecture_name());
}

void write(const ModelConfig& c, json& j) {
  j["attention_bias"] = c.qkv_bias;
  const auto& la = c.linear_attention;
  j["linear_num_key_heads"] = la.key_heads;
  j["linear_num_value_heads"] = la.value_heads;
  j["linear_key_head_dim"] = la.key_head_dim;
  j["linear_value_head_dim"] = la.value_head_dim;
  j["linear_conv_kernel_dim"] = la.conv_kernel;
  j["layer_types"] = layer_types_json(c);
  // (always written: the class's default is 0.25, not the 1.0 to_json leaves out)
  j["partial_rotary_factor"] = c.partial_rotary_factor;
  if (j.contains("rope_parameters") && j.at("rope_parameters").is_object())
    j["rope_parameters"]["partial_rotary_factor"] = c.partial_rotary_factor;
}

}  // namespace

extern const Family kQwen3_5;  // (declared first: the table in families.cpp names it)
const Family kQwen3_5{Architecture::qwen3_5, "Qwen3_5ForCausalLM", "qwen3_5_text", 32768, 10000.0, false, std::nullopt,
                      BlockRecipe{.qk_norm = BlockRecipe::QkNorm::per_head,
                                  .unit_offset_norms = true,
                                  .attention_output_gate = true,
                                  .linear_attention = true},
                      parse, check, write};

}  // namespace megatrain::model_families
