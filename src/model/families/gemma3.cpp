// Gemma 3's text models (Gemma3ForCausalLM, model_type gemma3_text): (1 + w) RMSNorms, four per
// block (the attention's and the MLP's outputs normalised too), q/k norms per head, GeGLU with
// tanh GELU, the embedding times sqrt(hidden_size), the softmax scaled by query_pre_attn_scalar,
// sliding-window and full layers per layer_types, each type with its own rotary parameters.
// Softcapping and bidirectional attention (Gemma 2, the embedding variants) are refused by name
// rather than trained differently.
#include "common.hpp"

#include <fmt/format.h>

namespace megatrain::model_families {
namespace {

void parse(const json& j, std::string_view src, ModelConfig& c) {
  refuse_mlp_bias(j, src, c.architecture_name());
  c.qkv_bias = c.o_bias = get_bool(j, "attention_bias", src, false);
  refuse_dropout(j, src, {"attention_dropout"});
  for (const char* key : {"final_logit_softcapping", "attn_logit_softcapping"})
    MT_CHECK(!given(j, key), "{}: '{}' is {}; softcapping (Gemma 2) is not supported, and Gemma 3 has none (null)", src,
             key, j.at(key).dump());
  MT_CHECK(!get_bool(j, "use_bidirectional_attention", src, false),
           "{}: 'use_bidirectional_attention' is true (an embedding model); megatrain trains causal decoders only", src);
  c.query_pre_attn_scalar = get_double(j, "query_pre_attn_scalar", src, 256.0);
  MT_CHECK(std::isfinite(*c.query_pre_attn_scalar) && *c.query_pre_attn_scalar > 0,
           "{}: query_pre_attn_scalar must be > 0 (got {})", src, *c.query_pre_attn_scalar);
  c.sliding_window = get_int(j, "sliding_window", src, 4096);
  // Which layers slide: layer_types, else every sliding_window_pattern-th layer is full
  const std::int64_t pattern = get_int(j, "sliding_window_pattern", src, 6);
  MT_CHECK(pattern > 0, "{}: sliding_window_pattern must be > 0 (got {})", src, pattern);
  c.layer_types = read_layer_types(j, src, c.num_hidden_layers, [&](std::int64_t i) { return (i + 1) % pattern != 0; });
  // Rotary: transformers 5 writes rope_parameters per layer type; transformers 4's configs (those
  // on the Hub) keep rope_theta and rope_scaling for the full layers and rope_local_base_freq for
  // the sliding ones (unscaled), which transformers 5 reads the same way.
  const json* rp = given(j, "rope_parameters") && j.at("rope_parameters").is_object() ? &j.at("rope_parameters") : nullptr;
  if (rp != nullptr && (rp->contains("full_attention") || rp->contains("sliding_attention"))) {
    const auto one = [&](const char* type, double theta_default, double& theta, RopeScaling& scaling) {
      theta = theta_default;
      scaling = RopeScaling{};
      if (!given(*rp, type)) return;
      const json& r = rp->at(type);
      const std::string where = fmt::format("{} (rope_parameters.{})", src, type);
      MT_CHECK(r.is_object(), "{}: must be an object, not {}", where, r.dump());
      theta = get_double(r, "rope_theta", where, theta_default);
      scaling = parse_rope_scaling(r, where);
    };
    one("full_attention", 1000000.0, c.rope_theta, c.rope_scaling);
    one("sliding_attention", 10000.0, c.local_rope_theta, c.local_rope_scaling);
  } else {
    c.rope_theta = get_double(j, "rope_theta", src, 1000000.0);
    c.local_rope_theta = get_double(j, "rope_local_base_freq", src, 10000.0);
    c.local_rope_scaling = RopeScaling{};
  }
  for (const RopeScaling* r : {&c.rope_scaling, &c.local_rope_scaling})
    MT_CHECK(r->type != RopeScaling::Type::longrope, "{}: longrope rotary scaling on Gemma 3 is not supported", src);
}

void check(const ModelConfig& c, std::string_view src) {
  check_attention_bias_only(c, src);
  MT_CHECK(c.partial_rotary_factor == 1.0, "{}: partial_rotary_factor on Gemma 3 is not supported", src);
  MT_CHECK(static_cast<std::int64_t>(c.layer_types.size()) == c.num_hidden_layers && c.sliding_window.has_value(),
           "{}: Gemma3ForCausalLM needs sliding_window and one layer type per layer ({} for {} layers)", src,
           c.layer_types.size(), c.num_hidden_layers);
  MT_CHECK(std::isfinite(c.local_rope_theta) && c.local_rope_theta > 1,
           "{}: the sliding layers' rope_theta must be > 1 (got {})", src, c.local_rope_theta);
  MT_CHECK(c.query_pre_attn_scalar.has_value() && *c.query_pre_attn_scalar > 0,
           "{}: Gemma3ForCausalLM needs query_pre_attn_scalar > 0", src);
}

// as transformers 5 writes it: the rotary parameters per layer type, no top-level rope_theta
void write(const ModelConfig& c, json& j) {
  j.erase("rope_theta");
  j.erase("rope_scaling");
  const auto params = [&](double theta, const RopeScaling& r) {
    ModelConfig layer = c;  // (yarn's factor and original length resolved for these parameters)
    layer.rope_theta = theta;
    layer.rope_scaling = r;
    return rope_parameters_json(layer);
  };
  j["rope_parameters"] = {{"full_attention", params(c.rope_theta, c.rope_scaling)},
                          {"sliding_attention", params(c.local_rope_theta, c.local_rope_scaling)}};
  j["query_pre_attn_scalar"] = *c.query_pre_attn_scalar;
  j["sliding_window"] = *c.sliding_window;
  j["layer_types"] = layer_types_json(c);
  j["attention_bias"] = c.qkv_bias;
  j["final_logit_softcapping"] = nullptr;
  j["attn_logit_softcapping"] = nullptr;
  j["use_bidirectional_attention"] = false;
}

}  // namespace

// (Gemma3TextConfig defaults to tied embeddings and pad_token_id 0)
extern const Family kGemma3;  // (declared first: the table in families.cpp names it)
const Family kGemma3{Architecture::gemma3, "Gemma3ForCausalLM", "gemma3_text", 131072, 1000000.0, true, 0,
                            BlockRecipe{.qk_norm = BlockRecipe::QkNorm::per_head,
                                        .unit_offset_norms = true,
                                        .sandwich_norms = true,
                                        .query_pre_attn_scalar = true,
                                        .per_layer_windows = true,
                                        .local_rope = true,
                                        .activation = Activation::gelu_tanh,
                                        .activation_key = "hidden_activation",
                                        .scaled_embedding = true},
                            parse, check, write};

}  // namespace megatrain::model_families
