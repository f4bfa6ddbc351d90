// The fields the hybrid families share (hybrid.hpp).
#include "hybrid.hpp"

namespace megatrain::model_families {

void parse_hybrid(const json& j, std::string_view src, ModelConfig& c, const HybridDefaults& d) {
  refuse_mlp_bias(j, src, c.architecture_name());
  refuse_dropout(j, src, {"attention_dropout"});
  c.qkv_bias = c.o_bias = get_bool(j, "attention_bias", src, false);
  // the config classes' own defaults where config.json leaves them out
  if (!given(j, "head_dim")) c.head_dim = 256;
  if (!given(j, "num_key_value_heads")) c.num_key_value_heads = d.key_value_heads;
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
  la.fused = d.fused;
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

void check_hybrid(const ModelConfig& c, std::string_view src) {
  check_attention_bias_only(c, src);
  for (std::size_t l = 0; l < c.layer_types.size(); ++l)
    MT_CHECK(c.layer_types[l] != TokenMixerKind::sliding_attention,
             "{}: layer_types makes layer {} a sliding_attention layer; {} has only full_attention and linear_attention "
             "layers", src, l, c.architecture_name());
  MT_CHECK(!c.sliding_window, "{}: {} has no sliding window", src, c.architecture_name());
}

void write_hybrid(const ModelConfig& c, json& j) {
  j["attention_bias"] = c.qkv_bias;
  const auto& la = c.linear_attention;
  j["linear_num_key_heads"] = la.key_heads;
  j["linear_num_value_heads"] = la.value_heads;
  j["linear_key_head_dim"] = la.key_head_dim;
  j["linear_value_head_dim"] = la.value_head_dim;
  j["linear_conv_kernel_dim"] = la.conv_kernel;
  j["layer_types"] = layer_types_json(c);
  // (always written: the classes' default is 0.25, not the 1.0 to_json leaves out)
  j["partial_rotary_factor"] = c.partial_rotary_factor;
  if (j.contains("rope_parameters") && j.at("rope_parameters").is_object())
    j["rope_parameters"]["partial_rotary_factor"] = c.partial_rotary_factor;
}

void parse_hybrid_moe(const json& j, std::string_view src, ModelConfig& c, const MoeDefaults& d) {
  parse_moe(j, src, c, d);
  c.moe.shared_expert_size = get_int(j, "shared_expert_intermediate_size", src, 512);
  // Their routers have recorded the softmax, not the logits, for the auxiliary loss in some
  // transformers versions (a softmax taken twice): not trained until checked against 5.17 itself
  MT_CHECK(!c.moe.output_router_logits,
           "{}: output_router_logits is true; megatrain does not train {}'s auxiliary load-balancing loss yet (what its "
           "router records for it is not yet checked against transformers); set it to false", src, c.architecture_name());
}

void check_hybrid_moe(const ModelConfig& c, std::string_view src, bool dense_layers) {
  check_hybrid(c, src);
  check_moe(c, src, dense_layers);
  MT_CHECK(c.moe.shared_expert_size > 0 && c.moe.shared_expert_size <= (std::int64_t{1} << 24),
           "{}: shared_expert_intermediate_size must be in [1, 2^24] (got {})", src, c.moe.shared_expert_size);
}

void write_hybrid_moe(const ModelConfig& c, json& j, bool writes_norm_topk_prob) {
  write_hybrid(c, j);
  write_moe(c, j, writes_norm_topk_prob);
  j["moe_intermediate_size"] = c.moe.intermediate_size;
  j["shared_expert_intermediate_size"] = c.moe.shared_expert_size;
  j.erase("num_local_experts");  // (their config classes read num_experts alone)
}

}  // namespace megatrain::model_families
